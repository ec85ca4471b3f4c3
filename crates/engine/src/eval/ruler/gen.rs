//! Prompt generation of `eval --task ruler`: the shared machinery (seeded draws, the search
//! for the largest haystack that fits, chat wrapping) and the NIAH tasks. Variable tracking,
//! common- and frequent-words extraction are in `synth`.
use super::tasks::{Haystack, Kind, Niah, RulerTask};
use super::words;
use crate::eval::passkey::SplitMix64;
use crate::EngineError;
use slowfast_tokenizer::{ChatMessage, Tokenizer};

/// The repeated haystack of niah_single_1 and the filler of variable tracking.
pub const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

const NIAH_TEMPLATE: &str = "Some special magic {v} are hidden within the following text. Make \
sure to memorize it. I will quiz you about the {v} afterwards.\n{context}\nWhat are all the \
special magic {v} for {query} mentioned in the provided text?";
const NIAH_PREFIX: &str = " The special magic {v} for {query} mentioned in the provided text are";

/// One generated prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct RulerSample {
    pub task: RulerTask,
    /// The whole prompt (BOS first when the tokenizer adds one), ending with the answer prefix.
    pub tokens: Vec<u32>,
    pub answer_prefix: String,
    /// The references string_match_all looks for in the output.
    pub answers: Vec<String>,
    /// Depth (percent of the haystack) of the first needle asked for (NIAH only).
    pub depth: Option<f64>,
    /// The haystack size the search settled on (sentences, words or list entries).
    pub haystack: usize,
}

/// Builds the prompts of one run: a tokenizer, the essay haystack, `--context`, `--seed`.
pub struct RulerGen<'t> {
    pub(super) tok: &'t Tokenizer,
    essay: Vec<String>,
    pub(super) context: usize,
    seed: u64,
    chat: bool,
    adjectives: Vec<&'static str>,
    nouns: Vec<&'static str>,
}

/// A prompt body and its answer prefix, before tokenization.
pub(super) type Text = (String, String);

impl<'t> RulerGen<'t> {
    /// `essay`: the long text of the essay haystacks (None: the tasks that need it fail).
    /// `chat`: wrap each prompt in the tokenizer's chat template (a user turn), the answer
    /// prefix starting the model's turn.
    pub fn new(
        tok: &'t Tokenizer,
        essay: Option<&str>,
        context: usize,
        seed: u64,
        chat: bool,
    ) -> Self {
        RulerGen {
            tok,
            essay: essay
                .map(|e| e.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default(),
            context,
            seed,
            chat,
            adjectives: words::list(words::ADJECTIVES),
            nouns: words::list(words::NOUNS),
        }
    }

    /// Sample `i` of `samples` of `task` (deterministic in the seed, the task and `i`).
    pub fn sample(
        &self,
        task: RulerTask,
        i: usize,
        samples: usize,
    ) -> Result<RulerSample, EngineError> {
        let mut rng = sample_rng(self.seed, task, i);
        match task.niah() {
            Some(p) => self.niah(task, p, &mut rng, even_depth(i, samples)),
            None => match task {
                RulerTask::Vt => self.vt(&mut rng),
                RulerTask::Cwe => self.cwe(&mut rng),
                _ => self.fwe(&mut rng),
            },
        }
    }

    /// The prompt's tokens: the body (in a chat user turn with `--chat`) then the prefix.
    pub(super) fn encode(&self, body: &str, prefix: &str) -> Result<Vec<u32>, EngineError> {
        let text = if self.chat {
            let turn = self
                .tok
                .apply_chat_template(&[ChatMessage::new("user", body)], true)?;
            format!("{turn}{}", prefix.trim_start())
        } else {
            format!("{body}{prefix}")
        };
        // Special-token texts only count inside the chat template's own markup.
        Ok(self.tok.encode_with(&text, true, self.chat)?)
    }

    /// The largest haystack size `n >= lo` whose prompt `build(n)` leaves room for the
    /// task's answer in `--context` (galloping, then bisecting, on the tokenized prompt);
    /// `hi` caps `n`. Returns the tokens, the answer prefix and `n`.
    pub(super) fn fit(
        &self,
        task: RulerTask,
        lo: usize,
        hi: usize,
        build: &dyn Fn(usize) -> Text,
    ) -> Result<(Vec<u32>, String, usize), EngineError> {
        let budget = task.budget();
        let limit = self.context.saturating_sub(budget);
        let try_n = |n: usize| -> Result<Option<(Vec<u32>, String)>, EngineError> {
            let (body, prefix) = build(n);
            let t = self.encode(&body, &prefix)?;
            Ok((t.len() <= limit).then_some((t, prefix)))
        };
        let Some(mut best) = try_n(lo)? else {
            let (body, prefix) = build(lo);
            let have = self.encode(&body, &prefix)?.len();
            return Err(EngineError::BadInput(format!(
                "--context {} is too short for ruler task {}: its smallest prompt has {have} tokens and the answer {budget} more",
                self.context,
                task.name()
            )));
        };
        let (mut good, mut bad) = (lo, None::<usize>);
        // Gallop: double until a size does not fit (or hits the cap).
        while bad.is_none() && good < hi {
            let n = (good.max(1) * 2).min(hi);
            match try_n(n)? {
                Some(b) => (good, best) = (n, b),
                None => bad = Some(n),
            }
        }
        if let Some(mut bad) = bad {
            while bad - good > 1 {
                let mid = good + (bad - good) / 2;
                match try_n(mid)? {
                    Some(b) => (good, best) = (mid, b),
                    None => bad = mid,
                }
            }
        }
        Ok((best.0, best.1, good))
    }

    /// A random key or value.
    fn random(&self, kind: Kind, rng: &mut SplitMix64) -> String {
        match kind {
            Kind::Word => format!(
                "{}-{}",
                self.adjectives[rng.below(self.adjectives.len())],
                self.nouns[rng.below(self.nouns.len())]
            ),
            Kind::Number => (1_000_000 + rng.below(9_000_000)).to_string(),
            Kind::Uuid => uuid4(rng),
        }
    }

    /// A NIAH prompt: `p.num_k` keys with `p.num_v` values each hidden as needles, the first
    /// needle asked for at `depth` percent, the others at random depths of RULER's 40-point
    /// grid; `p.num_q` keys asked.
    fn niah(
        &self,
        task: RulerTask,
        p: Niah,
        rng: &mut SplitMix64,
        depth: f64,
    ) -> Result<RulerSample, EngineError> {
        if p.haystack == Haystack::Essay && self.essay.is_empty() {
            return Err(EngineError::BadInput(format!(
                "ruler task {} hides its needles in an essay: pass a long English text with --input (e.g. data/texts/austen_prideprejudice.txt from scripts/get_texts.sh)",
                task.name()
            )));
        }
        let mut keys: Vec<String> = Vec::new();
        while keys.len() < p.num_k {
            let k = self.random(p.key, rng);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let mut values: Vec<Vec<String>> = Vec::new();
        let mut all_values: Vec<String> = Vec::new();
        for _ in 0..p.num_k {
            let mut vs = Vec::new();
            while vs.len() < p.num_v {
                let v = self.random(p.value, rng);
                if !all_values.contains(&v) {
                    all_values.push(v.clone());
                    vs.push(v);
                }
            }
            values.push(vs);
        }
        let mut order: Vec<usize> = (0..p.num_k).collect();
        shuffle(&mut order, rng);
        let asked = &order[..p.num_q];
        let type_v = match p.value {
            Kind::Uuid => "uuids",
            _ => "numbers",
        };
        // The needles, each with its depth; the first value of the first key asked sits at
        // `depth`.
        let mut needles: Vec<(f64, String)> = Vec::new();
        for (k, key) in keys.iter().enumerate() {
            for (j, v) in values[k].iter().enumerate() {
                let d = if k == asked[0] && j == 0 {
                    depth
                } else {
                    rng.below(40) as f64 * 100.0 / 39.0
                };
                needles.push((
                    d,
                    format!("One of the special magic {type_v} for {key} is: {v}."),
                ));
            }
        }
        needles.sort_by(|a, b| a.0.total_cmp(&b.0));
        let queries: Vec<&str> = asked.iter().map(|&k| keys[k].as_str()).collect();
        let query = match queries.as_slice() {
            [one] => one.to_string(),
            [init @ .., last] => format!("{}, and {last}", init.join(", ")),
            [] => unreachable!("num_q >= 1"),
        };
        let answers: Vec<String> = asked.iter().flat_map(|&k| values[k].clone()).collect();
        let (mut template, mut prefix) = (NIAH_TEMPLATE.to_string(), NIAH_PREFIX.to_string());
        let mut tv = type_v;
        if p.num_v * p.num_q == 1 {
            // One value asked: RULER's singular wording.
            for s in [&mut template, &mut prefix] {
                *s = s
                    .replace("Some", "A")
                    .replace("are all", "is")
                    .replace("are", "is");
            }
            tv = &type_v[..type_v.len() - 1];
        }
        let template = template.replace("{v}", tv).replace("{query}", &query);
        let prefix = prefix.replace("{v}", tv).replace("{query}", &query);
        let hay_seed = rng.next_u64();
        let start = self.essay_start(rng);
        let build = |n: usize| -> Text {
            let context = match p.haystack {
                Haystack::Repeat => insert(&vec![NOISE.to_string(); n], &needles, "\n"),
                Haystack::Needle => {
                    let mut r = SplitMix64::new(hay_seed);
                    let mut lines = Vec::with_capacity(n);
                    while lines.len() < n {
                        let (k, v) = (self.random(p.key, &mut r), self.random(p.value, &mut r));
                        if !keys.contains(&k) && !all_values.contains(&v) {
                            lines.push(format!(
                                "One of the special magic {type_v} for {k} is: {v}."
                            ));
                        }
                    }
                    insert(&lines, &needles, "\n")
                }
                Haystack::Essay => insert(&self.essay_sentences(start, n), &needles, " "),
            };
            (template.replace("{context}", &context), prefix.clone())
        };
        let (tokens, answer_prefix, n) = self.fit(task, 1, usize::MAX / 4, &build)?;
        Ok(RulerSample {
            task,
            tokens,
            answer_prefix,
            answers,
            depth: Some(depth),
            haystack: n,
        })
    }

    /// A random word index of the essay that starts a sentence.
    fn essay_start(&self, rng: &mut SplitMix64) -> usize {
        if self.essay.is_empty() {
            return 0;
        }
        let s = rng.below(self.essay.len());
        (s..s + 200)
            .map(|k| k % self.essay.len())
            .find(|&k| k > 0 && ends_sentence(&self.essay[k - 1]))
            .unwrap_or(s)
    }

    /// The whole sentences among `n` essay words from word `start` (wrapping around).
    fn essay_sentences(&self, start: usize, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut cur: Vec<&str> = Vec::new();
        for k in 0..n {
            let w = &self.essay[(start + k) % self.essay.len()];
            cur.push(w);
            if ends_sentence(w) {
                out.push(cur.join(" "));
                cur.clear();
            }
        }
        // An unfinished last sentence stays out unless it is all there is, so every needle
        // (at 100 % too) follows a sentence end.
        if out.is_empty() && !cur.is_empty() {
            out.push(cur.join(" "));
        }
        out
    }
}

/// Whether a word ends a sentence (`.` `!` `?`, closing quotes allowed; not "Mr." and such).
fn ends_sentence(w: &str) -> bool {
    let t = w.trim_end_matches(['"', '\'', '\u{201d}', '\u{2019}', ')', '_']);
    t.ends_with(['.', '!', '?'])
        && !matches!(t, "Mr." | "Mrs." | "Ms." | "Dr." | "St." | "Col." | "Capt.")
}

/// `units` joined by `sep` with each needle inserted before unit round(len * depth / 100)
/// (needles sorted by depth keep their order).
fn insert(units: &[String], needles: &[(f64, String)], sep: &str) -> String {
    let n = units.len();
    let mut parts: Vec<&str> = Vec::with_capacity(n + needles.len());
    let mut next = 0;
    for i in 0..=n {
        while next < needles.len() && ((n as f64 * needles[next].0 / 100.0).round() as usize) <= i {
            parts.push(&needles[next].1);
            next += 1;
        }
        if let Some(u) = units.get(i) {
            parts.push(u);
        }
    }
    parts.join(sep)
}

/// The generator of sample `i` of `task`. The seed, the task and the sample are hashed in
/// turn: seeds that differ by multiples of SplitMix64's increment would give shifted copies
/// of one stream (correlated draws across tasks).
pub fn sample_rng(seed: u64, task: RulerTask, i: usize) -> SplitMix64 {
    let t = RulerTask::ALL.iter().position(|&x| x == task).unwrap_or(0) as u64;
    let h = |x: u64| SplitMix64::new(x).next_u64();
    SplitMix64::new(h(h(h(seed) ^ t) ^ i as u64))
}

/// Depth (percent) of sample `i` of `samples`: evenly from 0 to 100 (50 for one sample).
pub fn even_depth(i: usize, samples: usize) -> f64 {
    if samples <= 1 {
        50.0
    } else {
        i as f64 * 100.0 / (samples - 1) as f64
    }
}

/// Fisher-Yates shuffle from `rng`.
pub(super) fn shuffle<T>(v: &mut [T], rng: &mut SplitMix64) {
    for j in (1..v.len()).rev() {
        v.swap(j, rng.below(j + 1));
    }
}

/// A random version-4 UUID, lowercase hex.
fn uuid4(rng: &mut SplitMix64) -> String {
    let (a, b) = (rng.next_u64(), rng.next_u64());
    let a = (a & !0xF000) | 0x4000; // version 4
    let b = (b & !(0b11 << 62)) | (0b10 << 62); // RFC 4122 variant
    let h = format!("{a:016x}{b:016x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needles_go_in_at_their_depths_in_order() {
        let units: Vec<String> = (0..10).map(|i| i.to_string()).collect();
        let needles = [(0.0, "A".into()), (50.0, "B".into()), (100.0, "C".into())];
        assert_eq!(insert(&units, &needles, " "), "A 0 1 2 3 4 B 5 6 7 8 9 C");
        assert_eq!(insert(&[], &needles, "\n"), "A\nB\nC");
        assert_eq!(even_depth(0, 1), 50.0);
        assert_eq!(
            (0..4).map(|i| even_depth(i, 5)).collect::<Vec<_>>(),
            [0.0, 25.0, 50.0, 75.0]
        );
    }

    #[test]
    fn samples_draw_from_unrelated_streams() {
        // A stream shifted from another shares its outputs: none may repeat across the
        // (task, sample) pairs of one seed.
        let mut seen = std::collections::HashSet::new();
        for task in RulerTask::ALL {
            for i in 0..8 {
                let mut r = sample_rng(0, task, i);
                for _ in 0..64 {
                    assert!(seen.insert(r.next_u64()), "{} sample {i}", task.name());
                }
            }
        }
        assert_ne!(
            sample_rng(1, RulerTask::Vt, 0).next_u64(),
            sample_rng(0, RulerTask::Vt, 0).next_u64()
        );
    }

    #[test]
    fn uuids_and_sentence_ends_look_right() {
        let mut rng = SplitMix64::new(3);
        let u = uuid4(&mut rng);
        let parts: Vec<usize> = u.split('-').map(str::len).collect();
        assert_eq!(parts, [8, 4, 4, 4, 12], "{u}");
        assert_eq!(&u[14..15], "4");
        assert!(matches!(&u[19..20], "8" | "9" | "a" | "b"), "{u}");
        assert_ne!(u, uuid4(&mut rng));
        assert!(ends_sentence("again.") && ends_sentence("so?\"") && ends_sentence("it!"));
        assert!(!ends_sentence("Mr.") && !ends_sentence("word,"));
    }
}
