//! `eval --task passkey`: synthetic retrieval. Each trial hides one or more pass keys (5-digit
//! numbers, optionally named, "the pass key of the red door") and distractor numbers in a
//! haystack of `--context` tokens, ends with a completion-style question ("... What is the
//! pass key? The pass key is") and greedily decodes a few tokens; a trial is right when the
//! first number in the answer equals the key asked for. Everything is drawn from `--seed`.
use std::time::Instant;

use super::{argmax, check_model_context, prefilled_sessions, EvalRecord, Metrics};
use crate::device::{Device, Steps};
use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec};
use crate::EngineError;
use slowfast_kv::PolicyStats;
use slowfast_tokenizer::Tokenizer;

/// Names of the keys when a trial holds several ("the pass key of the red door").
pub const KEY_NAMES: [&str; 8] = [
    "red", "blue", "green", "yellow", "black", "white", "silver", "golden",
];

/// Haystack used without `--input`: the filler of the original passkey test.
pub const FILLER: &str = " The grass is green. The sky is blue. The sun is yellow. Here we go. \
There and back again.";

const DISTRACTORS: [&str; 4] = [
    " The coach had travelled {} yards since the morning.",
    " The parish register listed {} names that year.",
    " He was said to have {} pounds in the funds.",
    " The old road was marked with the number {}.",
];

/// The shape of a passkey run.
#[derive(Debug, Clone)]
pub struct PasskeyOptions {
    /// Prompt length in tokens (BOS + haystack + needles + distractors + question).
    pub context: usize,
    pub kv: KvDtype,
    pub chunk: usize,
    pub trials: usize,
    /// Keys per trial (one is asked for); above 1 the keys are named.
    pub needles: usize,
    /// Other 5-digit numbers per trial, in sentences that are not about a pass key.
    pub distractors: usize,
    /// Depths (fractions of the prompt) of the asked key; trial i uses depth i mod len.
    pub depths: Vec<f64>,
    pub seed: u64,
    /// Tokens greedily decoded for the answer.
    pub answer_tokens: usize,
    /// Put the question in the prefill (dense for every policy) instead of feeding it as
    /// decode steps (through the policy's sparse memory).
    pub question_in_prefill: bool,
}

impl PasskeyOptions {
    /// Check the options, naming the flag of any bad one.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |s: String| Err(EngineError::BadInput(s));
        if self.trials == 0 {
            return bad("--passkey-trials must be at least 1".into());
        }
        if self.needles == 0 || self.needles > KEY_NAMES.len() {
            return bad(format!(
                "--passkey-needles ({}) must be between 1 and {}",
                self.needles,
                KEY_NAMES.len()
            ));
        }
        if self.depths.is_empty() {
            return bad("--passkey-depths needs at least one depth".into());
        }
        if let Some(d) = self.depths.iter().find(|d| !(**d > 0.0 && **d < 1.0)) {
            return bad(format!(
                "--passkey-depths: {d} is not a fraction strictly between 0 and 1"
            ));
        }
        if self.answer_tokens == 0 {
            return bad("--passkey-answer-tokens must be at least 1".into());
        }
        Ok(())
    }
}

/// One generated trial.
#[derive(Debug, Clone, PartialEq)]
pub struct PasskeyTrial {
    /// The whole prompt (BOS first when the tokenizer adds one), `context` tokens.
    pub tokens: Vec<u32>,
    /// Where the question starts in `tokens`.
    pub question_start: usize,
    /// The key asked for, as digits.
    pub answer: String,
    /// The name of the key asked for (None with a single key).
    pub name: Option<&'static str>,
    /// Requested depth of the asked key.
    pub depth: f64,
    /// Token index where the asked key's sentence starts.
    pub needle_pos: usize,
}

/// SplitMix64: a small, seedable generator (enough for drawing trial layouts).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in `[a, b)`.
    pub fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A depth in [0.05, 0.95] at least 0.05 away from `depth` (so other pieces do not push the
/// asked key off its depth).
fn away_from(rng: &mut SplitMix64, depth: f64) -> f64 {
    loop {
        let d = rng.uniform(0.05, 0.95);
        if (d - depth).abs() >= 0.05 {
            return d;
        }
    }
}

/// The first number of an answer: skip leading spaces, quotes and colons, then take the run
/// of ASCII digits (None when the answer does not start with one).
pub fn parse_answer(text: &str) -> Option<&str> {
    let t = text.trim_start_matches(|c: char| c.is_whitespace() || matches!(c, ':' | '"' | '\''));
    let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    (end > 0).then(|| &t[..end])
}

/// Builds trials from a haystack of tokens (no BOS).
pub struct PasskeyGen<'t> {
    tok: &'t Tokenizer,
    haystack: Vec<u32>,
    is_ender: Vec<bool>,
}

struct Piece {
    depth: f64,
    ids: Vec<u32>,
    asked: bool,
}

impl<'t> PasskeyGen<'t> {
    /// `haystack`: the tokens of a long text (None: the generated filler, repeated).
    pub fn new(tok: &'t Tokenizer, haystack: Option<Vec<u32>>) -> Result<Self, EngineError> {
        let haystack = match haystack {
            Some(h) if !h.is_empty() => h,
            Some(_) => return Err(EngineError::BadInput("the --input text is empty".into())),
            None => tok.encode(FILLER, false)?,
        };
        let mut is_ender = vec![false; tok.vocab_size()];
        for t in tok.sentence_ender_ids() {
            if let Some(f) = is_ender.get_mut(t as usize) {
                *f = true;
            }
        }
        Ok(PasskeyGen {
            tok,
            haystack,
            is_ender,
        })
    }

    fn encode(&self, s: &str) -> Result<Vec<u32>, EngineError> {
        Ok(self.tok.encode(s, false)?)
    }

    fn ends_sentence(&self, t: u32) -> bool {
        self.is_ender.get(t as usize).copied().unwrap_or(false)
    }

    /// Trial `i` of a run (deterministic in `o.seed` and `i`).
    pub fn trial(&self, o: &PasskeyOptions, i: usize) -> Result<PasskeyTrial, EngineError> {
        let mut rng = SplitMix64::new(o.seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        let mut numbers: Vec<u32> = Vec::new();
        while numbers.len() < o.needles + o.distractors {
            let n = 10_000 + rng.below(90_000) as u32;
            if !numbers.contains(&n) {
                numbers.push(n);
            }
        }
        let mut names: Vec<&'static str> = KEY_NAMES.to_vec();
        for j in 0..names.len() {
            let r = j + rng.below(names.len() - j);
            names.swap(j, r);
        }
        let asked = rng.below(o.needles);
        let depth = o.depths[i % o.depths.len()];
        let named = o.needles > 1;
        let mut pieces = Vec::new();
        for (j, &key) in numbers[..o.needles].iter().enumerate() {
            let text = if named {
                let n = names[j];
                format!(" The pass key of the {n} door is {key}. Remember it. {key} is the pass key of the {n} door.")
            } else {
                format!(" The pass key is {key}. Remember it. {key} is the pass key.")
            };
            let d = if j == asked {
                depth
            } else {
                away_from(&mut rng, depth)
            };
            pieces.push(Piece {
                depth: d,
                ids: self.encode(&text)?,
                asked: j == asked,
            });
        }
        for &n in &numbers[o.needles..] {
            let t = DISTRACTORS[rng.below(DISTRACTORS.len())].replace("{}", &n.to_string());
            pieces.push(Piece {
                depth: away_from(&mut rng, depth),
                ids: self.encode(&t)?,
                asked: false,
            });
        }
        let question = if named {
            let n = names[asked];
            format!("\n\nWhat is the pass key of the {n} door? The pass key of the {n} door is")
        } else {
            "\n\nWhat is the pass key? The pass key is".to_string()
        };
        let question = self.encode(&question)?;
        let bos: Vec<u32> = if self.tok.adds_bos() {
            self.tok.bos_id().into_iter().collect()
        } else {
            Vec::new()
        };
        let fixed = bos.len() + question.len() + pieces.iter().map(|p| p.ids.len()).sum::<usize>();
        if o.context < fixed + 16 * (pieces.len() + 1) {
            return Err(EngineError::BadInput(format!(
                "--context {} is too short for {} key(s), {} distractor(s) and the question ({fixed} tokens)",
                o.context, o.needles, o.distractors
            )));
        }
        let hay_len = o.context - fixed;
        let hay = self.haystack_slice(&mut rng, hay_len);
        // Place pieces in depth order: piece k starts at final index
        // bos + q_k + (tokens of the pieces before it), which should be depth_k * context.
        pieces.sort_by(|a, b| a.depth.total_cmp(&b.depth));
        let mut tokens = bos.clone();
        let (mut q_prev, mut needle_pos) = (0usize, 0usize);
        let mut before = 0usize;
        for p in &pieces {
            let want = (p.depth * o.context as f64).round() as usize;
            let q = want
                .saturating_sub(bos.len() + before)
                .clamp(q_prev, hay_len);
            let q = self.snap_to_sentence(&hay, q, q_prev, hay_len);
            tokens.extend_from_slice(&hay[q_prev..q]);
            if p.asked {
                needle_pos = tokens.len();
            }
            tokens.extend_from_slice(&p.ids);
            before += p.ids.len();
            q_prev = q;
        }
        tokens.extend_from_slice(&hay[q_prev..]);
        let question_start = tokens.len();
        tokens.extend_from_slice(&question);
        debug_assert_eq!(tokens.len(), o.context);
        Ok(PasskeyTrial {
            tokens,
            question_start,
            answer: numbers[asked].to_string(),
            name: named.then(|| names[asked]),
            depth,
            needle_pos,
        })
    }

    /// `len` haystack tokens from a random place, starting at a sentence start when one is
    /// near; the haystack repeats when it is shorter than `len`.
    fn haystack_slice(&self, rng: &mut SplitMix64, len: usize) -> Vec<u32> {
        let h = &self.haystack;
        if h.len() <= len {
            return h.iter().copied().cycle().take(len).collect();
        }
        let room = h.len() - len;
        let mut start = rng.below(room + 1);
        if let Some(k) =
            (start..(start + 256).min(room + 1)).find(|&k| k > 0 && self.ends_sentence(h[k - 1]))
        {
            start = k;
        }
        h[start..start + len].to_vec()
    }

    /// The sentence start (index after an ender) nearest to `q` within 48 tokens and inside
    /// `lo..=hi`, else `q`.
    fn snap_to_sentence(&self, hay: &[u32], q: usize, lo: usize, hi: usize) -> usize {
        (0..=48usize)
            .flat_map(|d| [q.checked_sub(d), Some(q + d)])
            .flatten()
            .find(|&k| k >= lo.max(1) && k <= hi && self.ends_sentence(hay[k - 1]))
            .unwrap_or(q)
    }
}

/// Right/total for one depth.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DepthAccuracy {
    pub depth: f64,
    pub trials: usize,
    pub correct: usize,
    pub accuracy: f64,
}

/// One trial's outcome.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PasskeyAnswer {
    pub depth: f64,
    pub expected: String,
    pub answer: String,
    pub correct: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PasskeyMetrics {
    pub accuracy: f64,
    pub correct: usize,
    pub trials: usize,
    pub needles: usize,
    pub distractors: usize,
    pub seed: u64,
    /// "decode" (question fed through the policy) or "prefill" (question in the dense prefill).
    pub question: String,
    pub per_depth: Vec<DepthAccuracy>,
    pub answers: Vec<PasskeyAnswer>,
    /// With `eval --speculate`: the drafter's counters over every answer (the answers are
    /// full KV's, verified).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<crate::spec::SpecReport>,
}

/// Answer a trial in a prefilled session: feed the rest of the prompt as decode steps, then
/// greedily decode `o.answer_tokens` tokens; returns the decoded answer.
fn answer(
    m: &Loaded,
    sess: &mut dyn Steps,
    rest: &[u32],
    o: &PasskeyOptions,
) -> Result<String, EngineError> {
    for &q in rest {
        sess.step(q)?;
    }
    let mut out = Vec::with_capacity(o.answer_tokens);
    let mut next = argmax(sess.logits());
    out.push(next);
    while out.len() < o.answer_tokens {
        next = argmax(sess.step(next)?);
        out.push(next);
    }
    Ok(m.tokenizer.decode(&out))
}

/// [`answer`] through speculative decoding: the question enters the cache through dense
/// verification passes (no draft: exact for every drafter), then `opts`' drafter proposes and
/// dense passes verify the answer's tokens, which are therefore full KV's greedy answer.
fn answer_spec(
    m: &Loaded,
    sess: &mut dyn crate::spec::SpecSession,
    tokens: &[u32],
    split: usize,
    o: &PasskeyOptions,
    opts: &crate::spec::SpecOptions,
    stats: &mut crate::spec::SpecStats,
) -> Result<String, EngineError> {
    use crate::sampler::{Sampler, SamplerConfig};
    let vocab = m.model.cfg.vocab_size;
    let mut last = sess.logits().to_vec();
    let target = sess.target();
    for part in tokens[split..].chunks(target.verify_rows_max().max(1)) {
        let n = target.pos();
        let l = target.verify(part)?;
        last = l[(part.len() - 1) * vocab..part.len() * vocab].to_vec();
        target.end_verify(part, n + part.len(), true)?;
    }
    let greedy = SamplerConfig::greedy();
    let mut sampler = Sampler::new(greedy.clone(), vocab)?;
    tokens.iter().for_each(|&t| sampler.accept(t));
    let mut spec = crate::spec::Speculator::new(target, tokens, opts.clone(), None, o.kv, &greedy)?;
    let mut out = vec![sampler.sample_and_accept(&last)?];
    while out.len() < o.answer_tokens {
        let t0 = *out.last().expect("one token");
        out.extend(spec.round(target, t0, &mut sampler, o.answer_tokens - out.len())?);
    }
    out.truncate(o.answer_tokens);
    stats.add(spec.stats());
    Ok(m.tokenizer.decode(&out))
}

/// Run `o.trials` trials under each policy (trial by trial, every policy on the same
/// prompt); one record per policy.
pub fn eval_passkey(
    m: &Loaded,
    haystack: Option<Vec<u32>>,
    o: &PasskeyOptions,
    policies: &[PolicySpec],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    eval_passkey_on(Device::Cpu, m, haystack, o, policies, progress)
}

/// A prefilled session and its prefill's seconds.
type Prefilled<'m> = (Box<dyn Steps + 'm>, f64);

/// One session per policy with `tokens` prefilled on `device` (the CPU shares one dense
/// prefill among the policies that allow it; the GPU prefills each).
#[allow(clippy::too_many_arguments)]
fn prefilled_on<'m>(
    device: Device,
    m: &'m Loaded,
    cap: usize,
    o: &PasskeyOptions,
    policies: &[PolicySpec],
    tokens: &[u32],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Prefilled<'m>>, EngineError> {
    if device == Device::Cpu && m.tensor_parallel == 1 {
        let s = prefilled_sessions(m, cap, o.kv, o.chunk, policies, tokens, progress)?;
        return Ok(s
            .into_iter()
            .map(|(s, t)| (Box::new(s) as Box<dyn Steps + 'm>, t))
            .collect());
    }
    let mut out = Vec::with_capacity(policies.len());
    for p in policies {
        progress(&format!("prefill under {} on {device:?}", p.name()));
        let mut sess = crate::device::session(device, m, cap, o.kv, o.chunk, p)?;
        let secs = super::prefill_reporting(&mut *sess, tokens, progress)?;
        out.push((sess, secs));
    }
    Ok(out)
}

/// [`eval_passkey`] on `device` (`--device cuda`: the policies `cuda::GPU_POLICIES` names).
pub fn eval_passkey_on(
    device: Device,
    m: &Loaded,
    haystack: Option<Vec<u32>>,
    o: &PasskeyOptions,
    policies: &[PolicySpec],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    eval_passkey_spec(device, m, haystack, o, policies, None, progress)
}

/// [`eval_passkey_on`], with `spec`: every answer through speculative decoding (`eval
/// --speculate`), each of `policies` being a drafter's session policy (the drafter's own, or
/// full KV for `ngram`); the records carry the acceptance counters.
pub fn eval_passkey_spec(
    device: Device,
    m: &Loaded,
    haystack: Option<Vec<u32>>,
    o: &PasskeyOptions,
    policies: &[PolicySpec],
    spec: Option<&crate::spec::SpecOptions>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    o.validate()?;
    if spec.is_some_and(|s| s.drafter == crate::spec::DraftKind::Model) {
        return Err(EngineError::BadInput(
            "eval --speculate: the model drafter is for generate and serve (sfi, streaming, ngram here)".into(),
        ));
    }
    let mut spec_stats = vec![crate::spec::SpecStats::default(); policies.len()];
    let mut spec_answers: Vec<Option<(String, f64)>> = vec![None; policies.len()];
    check_model_context(m, o.context + o.answer_tokens)?;
    let gen = PasskeyGen::new(&m.tokenizer, haystack)?;
    let mut answers: Vec<Vec<PasskeyAnswer>> = vec![Vec::new(); policies.len()];
    let mut times = vec![(0.0, 0.0); policies.len()];
    let mut stats = vec![PolicyStats::default(); policies.len()];
    let mut kv_bytes = vec![0; policies.len()];
    let mut kv_after_prefill = vec![0; policies.len()];
    for i in 0..o.trials {
        let t = gen.trial(o, i)?;
        let split = if o.question_in_prefill {
            o.context
        } else {
            t.question_start
        };
        let cap = o.context + o.answer_tokens;
        let sessions: Vec<(Box<dyn Steps + '_>, f64)> = match spec {
            None => prefilled_on(device, m, cap, o, policies, &t.tokens[..split], progress)?,
            Some(so) => {
                let mut v = Vec::new();
                for (pi, p) in policies.iter().enumerate() {
                    // Room for the last round's drafts past the answer.
                    let cap = cap + crate::spec::MAX_SPEC_TOKENS + 1;
                    let mut sess =
                        crate::spec::spec_session(device, &m.model, cap, o.kv, o.chunk, p)?;
                    let pf = super::prefill_reporting(&mut *sess, &t.tokens[..split], progress)?;
                    kv_after_prefill[pi] = sess.kv_bytes();
                    let t1 = Instant::now();
                    let text =
                        answer_spec(m, &mut *sess, &t.tokens, split, o, so, &mut spec_stats[pi])?;
                    spec_answers[pi] = Some((text, t1.elapsed().as_secs_f64()));
                    v.push((sess as Box<dyn Steps + '_>, pf));
                }
                v
            }
        };
        for (pi, ((mut sess, pf), p)) in sessions.into_iter().zip(policies).enumerate() {
            if spec.is_none() {
                kv_after_prefill[pi] = sess.kv_bytes();
            }
            let t1 = Instant::now();
            let (text, dec) = match spec_answers[pi].take() {
                Some(done) => done,
                None => {
                    let text = answer(m, &mut *sess, &t.tokens[split..], o)?;
                    (text, t1.elapsed().as_secs_f64())
                }
            };
            let got = parse_answer(&text).unwrap_or("").to_string();
            let correct = got == t.answer;
            progress(&format!(
                "trial {}/{} depth {:.2} {}: expected {} got {:?} {}",
                i + 1,
                o.trials,
                t.depth,
                p.name(),
                t.answer,
                text,
                if correct { "ok" } else { "WRONG" }
            ));
            answers[pi].push(PasskeyAnswer {
                depth: t.depth,
                expected: t.answer.clone(),
                answer: got,
                correct,
            });
            times[pi].0 += pf;
            times[pi].1 += dec;
            let s = sess.policy_stats();
            let acc = &mut stats[pi];
            acc.slow_steps += s.slow_steps;
            acc.fast_steps += s.fast_steps;
            acc.attended_tokens += s.attended_tokens;
            acc.dense_tokens += s.dense_tokens;
            kv_bytes[pi] = sess.kv_bytes();
        }
    }
    let mut recs = Vec::new();
    for (pi, p) in policies.iter().enumerate() {
        let a = std::mem::take(&mut answers[pi]);
        let correct = a.iter().filter(|x| x.correct).count();
        let mut depths: Vec<f64> = Vec::new();
        for &d in &o.depths {
            if !depths.contains(&d) {
                depths.push(d);
            }
        }
        let per_depth = depths
            .iter()
            .filter_map(|&d| {
                let at: Vec<_> = a.iter().filter(|x| x.depth == d).collect();
                let c = at.iter().filter(|x| x.correct).count();
                (!at.is_empty()).then(|| DepthAccuracy {
                    depth: d,
                    trials: at.len(),
                    correct: c,
                    accuracy: c as f64 / at.len() as f64,
                })
            })
            .collect();
        let stats = &stats[pi];
        recs.push(EvalRecord {
            task: "passkey".into(),
            // Speculative answers are full KV's (the session's policy only drafts).
            policy: if spec.is_some() { "full" } else { p.name() }.into(),
            model: m.name.clone(),
            context: o.context,
            eval_tokens: o.answer_tokens,
            kv_budget: if spec.is_some() { None } else { p.budget() },
            metrics: Metrics::Passkey(PasskeyMetrics {
                accuracy: correct as f64 / a.len() as f64,
                correct,
                trials: a.len(),
                needles: o.needles,
                distractors: o.distractors,
                seed: o.seed,
                question: if o.question_in_prefill {
                    "prefill"
                } else {
                    "decode"
                }
                .into(),
                per_depth,
                answers: a,
                speculative: spec.map(|so| crate::spec::SpecReport::new(so, &spec_stats[pi])),
            }),
            retained_fraction: stats.retained_fraction(),
            slow_steps: stats.slow_steps,
            fast_steps: stats.fast_steps,
            prefill_seconds: times[pi].0,
            decode_seconds: times[pi].1,
            kv_bytes: kv_bytes[pi],
            kv_bytes_after_prefill: kv_after_prefill[pi],
            kv_bytes_end: kv_bytes[pi],
        });
    }
    Ok(recs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "It is a truth universally acknowledged. A single man must be in want of a \
wife! However little known the feelings of such a man may be, this truth is fixed. Is it not so? \
My dear Mr. Bennet, have you heard that Netherfield Park is let at last. ";

    fn opts(context: usize, needles: usize, distractors: usize) -> PasskeyOptions {
        PasskeyOptions {
            context,
            kv: KvDtype::F32,
            chunk: 64,
            trials: 5,
            needles,
            distractors,
            depths: vec![0.1, 0.3, 0.5, 0.7, 0.9],
            seed: 7,
            answer_tokens: 8,
            question_in_prefill: false,
        }
    }

    fn haystack(tok: &Tokenizer) -> Vec<u32> {
        tok.encode(&TEXT.repeat(40), false).unwrap()
    }

    #[test]
    fn trials_are_deterministic_in_the_seed() {
        let tok = Tokenizer::byte_level(300).unwrap();
        let g = PasskeyGen::new(&tok, Some(haystack(&tok))).unwrap();
        let o = opts(3000, 2, 3);
        assert_eq!(g.trial(&o, 3).unwrap(), g.trial(&o, 3).unwrap());
        assert_ne!(g.trial(&o, 3).unwrap(), g.trial(&o, 4).unwrap());
        let other = PasskeyOptions {
            seed: 8,
            ..o.clone()
        };
        assert_ne!(
            g.trial(&o, 3).unwrap().tokens,
            g.trial(&other, 3).unwrap().tokens
        );
    }

    #[test]
    fn the_asked_key_sits_at_the_requested_depth() {
        let tok = Tokenizer::byte_level(300).unwrap();
        for (hay, needles, distractors) in [
            (Some(haystack(&tok)), 1, 0),
            (Some(haystack(&tok)), 3, 4),
            (None, 2, 2),
        ] {
            let g = PasskeyGen::new(&tok, hay).unwrap();
            let o = opts(12000, needles, distractors);
            for i in 0..10 {
                let t = g.trial(&o, i).unwrap();
                assert_eq!(t.tokens.len(), o.context);
                assert_eq!(t.depth, o.depths[i % 5]);
                let at = t.needle_pos as f64 / o.context as f64;
                assert!(
                    (at - t.depth).abs() < 0.03,
                    "trial {i}: key at {at}, asked {}",
                    t.depth
                );
                let needle = tok.decode(&t.tokens[t.needle_pos..t.needle_pos + 60]);
                let want = match t.name {
                    Some(n) => format!(" The pass key of the {n} door is {}.", t.answer),
                    None => format!(" The pass key is {}.", t.answer),
                };
                assert!(needle.starts_with(&want), "{needle:?} vs {want:?}");
                let q = tok.decode(&t.tokens[t.question_start..]);
                assert!(q.starts_with("\n\nWhat is the pass key"), "{q:?}");
                assert!(q.ends_with(" is"), "{q:?}");
                if let Some(n) = t.name {
                    assert!(q.contains(&format!("the {n} door")), "{q:?}");
                }
                // Every key and distractor is in the prompt exactly once as a number.
                let all = tok.decode(&t.tokens);
                assert_eq!(all.matches(&t.answer).count(), 2, "key twice in its needle");
                let numbers = all
                    .split(|c: char| !c.is_ascii_digit())
                    .filter(|s| s.len() == 5)
                    .count();
                assert_eq!(numbers, 2 * needles + distractors);
            }
        }
    }

    #[test]
    fn too_short_a_context_and_bad_options_are_named() {
        let tok = Tokenizer::byte_level(300).unwrap();
        let g = PasskeyGen::new(&tok, None).unwrap();
        let e = g.trial(&opts(100, 3, 3), 0).unwrap_err().to_string();
        assert!(e.contains("--context 100"), "{e}");
        let bad = |o: PasskeyOptions, flag: &str| {
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        };
        bad(
            PasskeyOptions {
                trials: 0,
                ..opts(3000, 1, 0)
            },
            "--passkey-trials",
        );
        bad(opts(3000, 0, 0), "--passkey-needles");
        bad(opts(3000, 9, 0), "--passkey-needles");
        bad(
            PasskeyOptions {
                depths: vec![0.5, 1.0],
                ..opts(3000, 1, 0)
            },
            "1",
        );
        bad(
            PasskeyOptions {
                depths: vec![],
                ..opts(3000, 1, 0)
            },
            "--passkey-depths",
        );
        bad(
            PasskeyOptions {
                answer_tokens: 0,
                ..opts(3000, 1, 0)
            },
            "--passkey-answer-tokens",
        );
        assert!(PasskeyGen::new(&tok, Some(Vec::new())).is_err());
    }

    #[test]
    fn answers_parse_to_their_first_number() {
        assert_eq!(parse_answer(" 48213.\n\n"), Some("48213"));
        assert_eq!(parse_answer(": \"48213\""), Some("48213"));
        assert_eq!(parse_answer("48213 and 11111"), Some("48213"));
        assert_eq!(parse_answer(" not 48213"), None);
        assert_eq!(parse_answer(""), None);
        assert_eq!(parse_answer(" 482"), Some("482"));
    }

    #[test]
    fn the_real_model_finds_a_key_in_a_short_haystack() {
        let Some(path) = slowfast_loader::paths::test_model_path() else {
            return;
        };
        let m = crate::load(path.to_str().unwrap(), &mut |_| {}).unwrap();
        let o = PasskeyOptions {
            trials: 2,
            depths: vec![0.3, 0.6],
            ..opts(300, 1, 0)
        };
        let recs = eval_passkey(&m, None, &o, &[PolicySpec::Full], &mut |_| {}).unwrap();
        let Metrics::Passkey(p) = &recs[0].metrics else {
            panic!("a passkey record")
        };
        assert_eq!(p.trials, 2);
        assert_eq!(p.correct, 2, "{:?}", p.answers);
        assert_eq!(p.per_depth.len(), 2);
    }
}
