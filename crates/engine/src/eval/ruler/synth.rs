//! RULER's non-NIAH tasks: variable tracking (one chain of 4 hops in filler, one worked
//! example), common-words extraction (a numbered word list, one worked example) and
//! frequent-words extraction (coded words with zeta-law counts).
use super::gen::{shuffle, RulerGen, RulerSample, NOISE};
use super::tasks::RulerTask;
use super::words;
use crate::eval::passkey::SplitMix64;
use crate::EngineError;

const VT_TEMPLATE: &str = "Memorize and track the chain(s) of variable assignment hidden in the \
following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} \
in the text above.";
// "assgined" is RULER's spelling.
const VT_PREFIX: &str = " Answer: According to the chain(s) of variable assignment in the text \
above, {num_v} variables are assgined the value {query}, they are: ";

const CWE_TEMPLATE: &str = "Below is a numbered list of words. In these words, some appear more \
often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the \
10 most common words in the above list?";
const CWE_PREFIX: &str = " Answer: The top 10 words that appear most often in the list are:";

const FWE_TEMPLATE: &str = "Read the following coded text and track the frequency of each coded \
word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide \
any explanation. Please ignore the dots '....'. What are the three most frequently appeared \
words in the above coded text?";
const FWE_PREFIX: &str = " Answer: According to the coded text above, the three most frequently \
appeared words are:";

/// Hops of the variable-tracking chain (5 variables).
const VT_HOPS: usize = 4;
/// Filler lines of the variable-tracking worked example.
const VT_EXAMPLE_NOISE: usize = 5;
/// Common words of common-words extraction.
const CWE_COMMON: usize = 10;

/// `count` distinct names of `len` uppercase letters, none in `taken`.
fn var_names(rng: &mut SplitMix64, count: usize, len: usize, taken: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    while out.len() < count {
        let s: String = (0..len)
            .map(|_| (b'A' + rng.below(26) as u8) as char)
            .collect();
        if !out.contains(&s) && !taken.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// The chain's statements hidden among `noise` filler lines at sorted random places drawn
/// from `seed`.
fn vt_context(names: &[String], value: &str, noise: usize, seed: u64) -> String {
    let mut chain = vec![format!("VAR {} = {value}.", names[0])];
    for w in names.windows(2) {
        chain.push(format!("VAR {} = VAR {}.", w[1], w[0]));
    }
    let mut rng = SplitMix64::new(seed);
    let mut at: Vec<usize> = chain.iter().map(|_| rng.below(noise + 1)).collect();
    at.sort_unstable();
    let mut lines: Vec<&str> = Vec::with_capacity(noise + chain.len());
    let mut c = 0;
    for i in 0..=noise {
        while c < chain.len() && at[c] <= i {
            lines.push(&chain[c]);
            c += 1;
        }
        if i < noise {
            lines.push(NOISE);
        }
    }
    lines.join("\n")
}

fn vt_text(names: &[String], value: &str, noise: usize, seed: u64) -> (String, String) {
    let body = VT_TEMPLATE
        .replace("{query}", value)
        .replace("{context}", &vt_context(names, value, noise, seed));
    let prefix = VT_PREFIX
        .replace("{num_v}", &names.len().to_string())
        .replace("{query}", value);
    (body, prefix)
}

/// A numbered list: the first `CWE_COMMON` of `words` `common` times each, the rest
/// `uncommon` times, in an order drawn from `seed`.
fn cwe_list(words: &[&str], common: usize, uncommon: usize, seed: u64) -> String {
    let mut list: Vec<&str> = Vec::new();
    for (i, w) in words.iter().enumerate() {
        let reps = if i < CWE_COMMON { common } else { uncommon };
        list.extend(std::iter::repeat_n(*w, reps));
    }
    shuffle(&mut list, &mut SplitMix64::new(seed));
    list.iter()
        .enumerate()
        .map(|(i, w)| format!("{}. {w}", i + 1))
        .collect::<Vec<_>>()
        .join(" ")
}

impl RulerGen<'_> {
    /// Variable tracking: "VAR ABCDE = 12345" and 4 hops "VAR X = VAR Y" among filler lines,
    /// after one worked example (3-letter names, value 12345); the answer is all 5 names.
    pub(super) fn vt(&self, rng: &mut SplitMix64) -> Result<RulerSample, EngineError> {
        let names = var_names(rng, VT_HOPS + 1, 5, &[]);
        let value = (10_000 + rng.below(90_000)).to_string();
        let ex_names = var_names(rng, VT_HOPS + 1, 3, &names);
        let (ex_body, ex_prefix) = vt_text(&ex_names, "12345", VT_EXAMPLE_NOISE, rng.next_u64());
        let example = format!("{ex_body}{ex_prefix}{}", ex_names.join(" "));
        let seed = rng.next_u64();
        let build = |n: usize| {
            let (body, prefix) = vt_text(&names, &value, n, seed);
            (format!("{example}\n\n{body}"), prefix)
        };
        let (tokens, answer_prefix, n) = self.fit(RulerTask::Vt, 1, usize::MAX / 4, &build)?;
        Ok(RulerSample {
            task: RulerTask::Vt,
            tokens,
            answer_prefix,
            answers: names,
            depth: None,
            haystack: n,
        })
    }

    /// Common-words extraction: 10 words repeated often among words repeated rarely (below
    /// 4K context 6 and 1 times, with a worked example of 20 words 3/1; from 4K, 30 and 3
    /// with an example of 40 words 10/3); the answer is the 10 common words.
    pub(super) fn cwe(&self, rng: &mut SplitMix64) -> Result<RulerSample, EngineError> {
        let mut pool = words::pool();
        shuffle(&mut pool, rng);
        let (ex_words, ex_common, ex_uncommon, common, uncommon) = if self.context < 4096 {
            (20, 3, 1, 6, 1)
        } else {
            (40, 10, 3, 30, 3)
        };
        let (ex, rest) = pool.split_at(ex_words);
        let ex_list = cwe_list(ex, ex_common, ex_uncommon, rng.next_u64());
        let ex_answer = ex[..CWE_COMMON]
            .iter()
            .enumerate()
            .map(|(i, w)| format!("{}. {w}", i + 1))
            .collect::<Vec<_>>()
            .join(" ");
        let example = format!(
            "{}{CWE_PREFIX} {ex_answer}",
            CWE_TEMPLATE.replace("{context}", &ex_list)
        );
        let seed = rng.next_u64();
        let build = |n: usize| {
            let list = cwe_list(&rest[..n], common, uncommon, seed);
            (
                format!("{example}\n{}", CWE_TEMPLATE.replace("{context}", &list)),
                CWE_PREFIX.to_string(),
            )
        };
        let (tokens, answer_prefix, n) =
            self.fit(RulerTask::Cwe, CWE_COMMON + 1, rest.len(), &build)?;
        Ok(RulerSample {
            task: RulerTask::Cwe,
            tokens,
            answer_prefix,
            answers: rest[..CWE_COMMON].iter().map(|w| w.to_string()).collect(),
            depth: None,
            haystack: n,
        })
    }

    /// Frequent-words extraction: a vocabulary of context/50 random 6-letter words, word k
    /// (1-based) appearing floor(n k^-2 / zeta(2)) times in a shuffled text, the most
    /// frequent replaced by "..."; the answer is ranks 2 to 4.
    pub(super) fn fwe(&self, rng: &mut SplitMix64) -> Result<RulerSample, EngineError> {
        let size = (self.context / 50).max(10);
        let mut vocab: Vec<String> = Vec::new();
        while vocab.len() < size {
            let w: String = (0..6)
                .map(|_| (b'a' + rng.below(26) as u8) as char)
                .collect();
            if !vocab.contains(&w) {
                vocab.push(w);
            }
        }
        vocab[0] = "...".into();
        let zeta2 = std::f64::consts::PI * std::f64::consts::PI / 6.0;
        let seed = rng.next_u64();
        let build = |n: usize| {
            let mut text: Vec<&str> = Vec::new();
            for (k, w) in vocab.iter().enumerate() {
                let c = (n as f64 / ((k + 1) * (k + 1)) as f64 / zeta2) as usize;
                text.extend(std::iter::repeat_n(w.as_str(), c));
            }
            shuffle(&mut text, &mut SplitMix64::new(seed));
            (
                FWE_TEMPLATE.replace("{context}", &text.join(" ")),
                FWE_PREFIX.to_string(),
            )
        };
        // From 64 words on, ranks 2..4 appear at least twice and more often than rank 5.
        let (tokens, answer_prefix, n) = self.fit(RulerTask::Fwe, 64, usize::MAX / 4, &build)?;
        Ok(RulerSample {
            task: RulerTask::Fwe,
            tokens,
            answer_prefix,
            answers: vocab[1..4].to_vec(),
            depth: None,
            haystack: n,
        })
    }
}
