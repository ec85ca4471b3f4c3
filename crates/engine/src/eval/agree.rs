//! `eval --task agree`: greedy continuation of E tokens after a prompt of N−E tokens of a text,
//! under each policy, compared position by position with the full-KV continuation.
use std::time::Instant;

use super::{argmax, check_input_len, check_model_context, prefill_reporting, EvalRecord, Metrics};
use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec, Session};
use crate::EngineError;

/// How a greedy continuation compares with the full-KV one.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AgreeMetrics {
    /// Fraction of the E positions whose token equals the full-KV token at that position.
    pub agreement: f64,
    /// First position (0-based) where the tokens differ; None when all E agree.
    pub first_divergence: Option<usize>,
    /// Positions that agree.
    pub matched: usize,
    /// The continuation, decoded.
    pub text: String,
}

/// `(fraction equal, first differing index, count equal)` of `got` against `reference`,
/// position by position over the reference's length (missing positions count as different).
pub fn agreement(reference: &[u32], got: &[u32]) -> (f64, Option<usize>, usize) {
    let matched = reference.iter().zip(got).filter(|(a, b)| a == b).count();
    let first = (0..reference.len()).find(|&i| got.get(i) != Some(&reference[i]));
    let frac = if reference.is_empty() {
        1.0
    } else {
        matched as f64 / reference.len() as f64
    };
    (frac, first, matched)
}

/// The shape of an `agree` run: context N, continuation length E.
#[derive(Debug, Clone, Copy)]
pub struct AgreeOptions {
    pub context: usize,
    pub eval_tokens: usize,
    pub kv: KvDtype,
    pub chunk: usize,
}

/// Greedy continuation of E tokens after `tokens[..N−E]` under `policy`; with `reference` (the
/// full-KV continuation) the record says how far they agree, without it the record is the
/// reference itself (agreement 1). Returns the record and the continuation. Every continuation
/// token comes out of a decode step: the prefill stops one token short of the prompt and the
/// last prompt token is the first decode step.
pub fn eval_agree(
    m: &Loaded,
    tokens: &[u32],
    o: &AgreeOptions,
    policy: &PolicySpec,
    reference: Option<&[u32]>,
    progress: &mut dyn FnMut(&str),
) -> Result<(EvalRecord, Vec<u32>), EngineError> {
    let AgreeOptions {
        context,
        eval_tokens,
        kv,
        chunk,
    } = *o;
    if eval_tokens == 0 || eval_tokens + 2 > context {
        return Err(EngineError::BadInput(format!(
            "--eval-tokens ({eval_tokens}) must be at least 1 and at most --context ({context}) - 2"
        )));
    }
    let n_prompt = context - eval_tokens;
    check_input_len(tokens.len(), n_prompt, context)?;
    check_model_context(m, context)?;
    let mut sess = Session::try_with_policy(&m.model, context, kv, chunk, policy)?;
    let prefill_seconds = prefill_reporting(&mut sess, &tokens[..n_prompt - 1], progress)?;
    let t1 = Instant::now();
    let mut last_report = Instant::now();
    let mut out = Vec::with_capacity(eval_tokens);
    let mut next = tokens[n_prompt - 1];
    while out.len() < eval_tokens {
        next = argmax(sess.step(next)?);
        out.push(next);
        if last_report.elapsed().as_secs_f64() > 2.0 || out.len() == eval_tokens {
            progress(&format!("decode {}/{eval_tokens}", out.len()));
            last_report = Instant::now();
        }
    }
    let (agreement, first_divergence, matched) = agreement(reference.unwrap_or(&out), &out);
    let stats = sess.policy_stats();
    let rec = EvalRecord {
        task: "agree".into(),
        policy: policy.name().into(),
        model: m.name.clone(),
        context,
        eval_tokens,
        kv_budget: policy.budget(),
        metrics: Metrics::Agree(AgreeMetrics {
            agreement,
            first_divergence,
            matched,
            text: m.tokenizer.decode(&out),
        }),
        retained_fraction: stats.retained_fraction(),
        slow_steps: stats.slow_steps,
        fast_steps: stats.fast_steps,
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        kv_bytes: sess.kv_bytes(),
    };
    Ok((rec, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_counts_positions_and_finds_the_first_divergence() {
        assert_eq!(agreement(&[1, 2, 3, 4], &[1, 2, 3, 4]), (1.0, None, 4));
        assert_eq!(agreement(&[1, 2, 3, 4], &[1, 9, 3, 4]), (0.75, Some(1), 3));
        // Position by position: a shifted copy agrees nowhere after the shift.
        assert_eq!(agreement(&[1, 2, 3, 4], &[1, 1, 2, 3]), (0.25, Some(1), 1));
        // A shorter run counts the missing positions as different.
        assert_eq!(agreement(&[1, 2, 3, 4], &[1, 2]), (0.5, Some(2), 2));
        assert_eq!(agreement(&[], &[]), (1.0, None, 0));
    }

    #[test]
    fn greedy_continuation_agrees_with_itself_on_the_real_model() {
        let Some(path) = slowfast_loader::paths::test_model_path() else {
            return;
        };
        let m = crate::load(path.to_str().unwrap(), &mut |_| {}).unwrap();
        let text = "It is a truth universally acknowledged, that a single man in possession \
                    of a good fortune, must be in want of a wife. However little known the \
                    feelings or views of such a man may be on his first entering a neighbourhood";
        let ids = m.tokenizer.encode(text, true).unwrap();
        let o = AgreeOptions {
            context: ids.len() + 6,
            eval_tokens: 8,
            kv: KvDtype::F32,
            chunk: 16,
        };
        let full = PolicySpec::Full;
        let (r0, cont) = eval_agree(&m, &ids, &o, &full, None, &mut |_| {}).unwrap();
        assert_eq!(cont.len(), 8);
        let (r1, again) = eval_agree(&m, &ids, &o, &full, Some(&cont), &mut |_| {}).unwrap();
        assert_eq!(again, cont);
        for r in [r0, r1] {
            let Metrics::Agree(a) = r.metrics else {
                panic!("an agree record")
            };
            assert_eq!((a.agreement, a.first_divergence), (1.0, None));
        }
        let short = AgreeOptions {
            eval_tokens: o.context - 1,
            ..o
        };
        let e = eval_agree(&m, &ids, &short, &full, None, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("--eval-tokens"), "{e}");
    }
}
