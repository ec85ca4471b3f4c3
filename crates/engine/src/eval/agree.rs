//! `eval --task agree`: greedy continuation of E tokens after a prompt of N−E tokens of a text,
//! under each policy, compared position by position with the full-KV continuation.
use std::time::Instant;

use super::{
    argmax, boxed, check_input_len, check_model_context, prefill_free, prefill_reporting,
    prefilled_sessions, prefilled_steps, EvalRecord, Metrics,
};
use crate::device::Steps;
use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec};
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
    /// Teacher-forced: the fraction of the E positions where the policy's argmax, fed the
    /// full-KV continuation, equals the full-KV token (None when not measured).
    pub teacher_forced_agreement: Option<f64>,
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
    /// Also measure teacher-forced agreement (a second decode pass per sparse policy; a policy
    /// with its own prefill, SFI, prefills twice).
    pub teacher_forced: bool,
}

/// Greedy continuations of E tokens after `tokens[..N−E]` under each policy, compared
/// position by position with the first, which must be full KV (the reference, agreement 1).
/// One record per policy. Every continuation token comes out of a decode step: the prefill
/// (shared where `prefilled_sessions` can) stops one token short of the prompt and the last
/// prompt token is the first decode step.
pub fn eval_agree(
    m: &Loaded,
    tokens: &[u32],
    o: &AgreeOptions,
    policies: &[PolicySpec],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    eval_agree_on(crate::Device::Cpu, true, m, tokens, o, policies, progress)
}

/// [`eval_agree`] on `device` (`--device cuda`: the policies `cuda::GPU_POLICIES` names); without `share`
/// each policy prefills the prompt itself, and again for the teacher-forced pass (the GPU
/// always does).
pub fn eval_agree_on(
    device: crate::Device,
    share: bool,
    m: &Loaded,
    tokens: &[u32],
    o: &AgreeOptions,
    policies: &[PolicySpec],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    let AgreeOptions {
        context,
        eval_tokens,
        kv,
        chunk,
        teacher_forced,
    } = *o;
    if eval_tokens == 0 || eval_tokens + 2 > context {
        return Err(EngineError::BadInput(format!(
            "--eval-tokens ({eval_tokens}) must be at least 1 and at most --context ({context}) - 2"
        )));
    }
    if policies.first() != Some(&PolicySpec::Full) {
        return Err(EngineError::BadInput(
            "agree needs full KV as its first policy (the reference)".into(),
        ));
    }
    let n_prompt = context - eval_tokens;
    check_input_len(tokens.len(), n_prompt, context)?;
    check_model_context(m, context)?;
    let prompt = &tokens[..n_prompt - 1];
    // Copies for the teacher-forced pass, taken before any decoding (the policies with
    // their own prefill, and every policy off the CPU, get a fresh one after the greedy pass).
    let mut forced: Vec<Option<Box<dyn Steps + '_>>> = Vec::new();
    let sessions = if share && device == crate::Device::Cpu && m.tensor_parallel == 1 {
        let sessions = prefilled_sessions(m, context, kv, chunk, policies, prompt, progress)?;
        if teacher_forced {
            for ((sess, _), p) in sessions.iter().zip(policies).skip(1) {
                forced.push(match prefill_free(p) {
                    true => Some(Box::new(sess.fork(p)?)),
                    false => None,
                });
            }
        }
        boxed(sessions)
    } else {
        if teacher_forced {
            forced.extend(policies.iter().skip(1).map(|_| None));
        }
        prefilled_steps(
            device, false, m, context, kv, chunk, policies, prompt, progress,
        )?
    };
    let mut reference: Option<Vec<u32>> = None;
    let mut recs = Vec::new();
    for ((mut sess, prefill_seconds), policy) in sessions.into_iter().zip(policies) {
        let kv_bytes_after_prefill = sess.kv_bytes();
        let t1 = Instant::now();
        let mut last_report = Instant::now();
        let mut out = Vec::with_capacity(eval_tokens);
        let mut next = tokens[n_prompt - 1];
        while out.len() < eval_tokens {
            next = argmax(sess.step(next)?);
            out.push(next);
            if last_report.elapsed().as_secs_f64() > 2.0 || out.len() == eval_tokens {
                progress(&format!(
                    "{}: decode {}/{eval_tokens}",
                    policy.name(),
                    out.len()
                ));
                last_report = Instant::now();
            }
        }
        let decode_seconds = t1.elapsed().as_secs_f64();
        let (agreement, first_divergence, matched) =
            agreement(reference.get_or_insert_with(|| out.clone()), &out);
        let stats = sess.policy_stats();
        recs.push(EvalRecord {
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
                teacher_forced_agreement: teacher_forced.then_some(1.0),
                text: m.tokenizer.decode(&out),
            }),
            retained_fraction: stats.retained_fraction(),
            slow_steps: stats.slow_steps,
            fast_steps: stats.fast_steps,
            prefill_seconds,
            decode_seconds,
            kv_bytes: sess.kv_bytes(),
            kv_bytes_after_prefill,
            kv_bytes_end: sess.kv_bytes(),
        });
    }
    let reference = reference.expect("full KV ran first");
    for (i, f) in forced.into_iter().enumerate() {
        let (rec, policy) = (&mut recs[i + 1], &policies[i + 1]);
        let mut sess = match f {
            Some(s) => s,
            None => {
                progress(&format!(
                    "{}: prefill again for the teacher-forced pass",
                    policy.name()
                ));
                let mut s = crate::device::session(device, m, context, kv, chunk, policy)?;
                prefill_reporting(&mut *s, prompt, progress)?;
                s
            }
        };
        let mut hits = 0;
        let mut input = tokens[n_prompt - 1];
        for &want in &reference {
            hits += usize::from(argmax(sess.step(input)?) == want);
            input = want;
        }
        let tf = hits as f64 / reference.len() as f64;
        progress(&format!(
            "{}: teacher-forced agreement {tf:.3}",
            policy.name()
        ));
        if let Metrics::Agree(a) = &mut rec.metrics {
            a.teacher_forced_agreement = Some(tf);
        }
    }
    Ok(recs)
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

    /// The tiny Gemma 3 fixture (random weights, sliding and global layers), full KV,
    /// streaming and SFI, and a 120-token agree run of 24 steps with the teacher-forced pass.
    fn gemma3_fixture_setup() -> (Loaded, [PolicySpec; 3], AgreeOptions) {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/hf/gemma3"
        );
        let m = crate::load(dir, &mut |_| {}).unwrap();
        let knobs = crate::session::SfiKnobs {
            recent: 16,
            ..Default::default()
        };
        let sfi = crate::session::policy_spec_with("sfi", Some(48.0), 2, 128, &knobs)
            .unwrap()
            .with_vocab(&m.tokenizer);
        let stream = crate::session::policy_spec("streaming", Some(40.0), 2, 128).unwrap();
        let o = AgreeOptions {
            context: 120,
            eval_tokens: 24,
            kv: KvDtype::F32,
            chunk: 16,
            teacher_forced: true,
        };
        (m, [PolicySpec::Full, stream, sfi], o)
    }

    /// The GPU's way (`prefilled_steps` without sharing: every policy prefills its own
    /// session, and again for the teacher-forced pass), run on the CPU, gives the records of
    /// the shared prefills: the same continuations, agreements and step counts.
    #[test]
    fn own_prefills_give_the_shared_prefills_records() {
        let (m, policies, o) = gemma3_fixture_setup();
        let ids: Vec<u32> = (0..96u32).map(|i| (i * 53 + 7) % 500).collect();
        let shared = eval_agree(&m, &ids, &o, &policies, &mut |_| {}).unwrap();
        let mut said = Vec::new();
        let cpu = crate::Device::Cpu;
        let own = eval_agree_on(cpu, false, &m, &ids, &o, &policies, &mut |s| {
            said.push(s.to_string())
        })
        .unwrap();
        // every policy prefilled its own session: 3, then 2 again for the forced pass
        let prefills = said
            .iter()
            .filter(|s| s.starts_with("prefill under"))
            .count();
        let again = said.iter().filter(|s| s.contains("prefill again")).count();
        assert_eq!((prefills, again), (3, 2), "{said:?}");
        assert_eq!(shared.len(), own.len());
        for (a, b) in shared.iter().zip(&own) {
            let (Metrics::Agree(x), Metrics::Agree(y)) = (&a.metrics, &b.metrics) else {
                panic!("agree records")
            };
            assert_eq!((&x.text, x.matched), (&y.text, y.matched), "{}", a.policy);
            assert_eq!(
                x.teacher_forced_agreement, y.teacher_forced_agreement,
                "{}",
                a.policy
            );
            assert_eq!((a.slow_steps, a.fast_steps), (b.slow_steps, b.fast_steps));
        }
    }

    #[test]
    fn forked_sessions_continue_exactly_like_their_own_prefill() {
        // The tiny Gemma 3 fixture (random weights, sliding and global layers): full KV and
        // streaming forked from an SFI prefill must match their own prefills bit for bit.
        let (m, policies, o) = gemma3_fixture_setup();
        let ids: Vec<u32> = (0..96u32).map(|i| (i * 37 + 11) % 500).collect();
        let shared = eval_agree(&m, &ids, &o, &policies, &mut |_| {}).unwrap();
        for (i, p) in policies.iter().enumerate() {
            // Full alone prefills itself; streaming after full forks from a full prefill.
            let alone = if i == 0 {
                vec![PolicySpec::Full]
            } else {
                vec![PolicySpec::Full, p.clone()]
            };
            let own = eval_agree(&m, &ids, &o, &alone, &mut |_| {}).unwrap();
            let (Metrics::Agree(a), Metrics::Agree(b)) =
                (&shared[i].metrics, &own[i.min(1)].metrics)
            else {
                panic!("agree records")
            };
            assert_eq!(a.text, b.text, "{}", p.name());
            assert_eq!(a.matched, b.matched, "{}", p.name());
            assert_eq!(
                a.teacher_forced_agreement,
                b.teacher_forced_agreement,
                "{}",
                p.name()
            );
            let tf = a.teacher_forced_agreement.unwrap();
            // Up to the first divergence the greedy and teacher-forced runs are the same run.
            let first = a.first_divergence.unwrap_or(o.eval_tokens);
            assert!(
                tf >= first as f64 / o.eval_tokens as f64,
                "{}: {tf}",
                p.name()
            );
        }
        let Metrics::Agree(r) = &shared[0].metrics else {
            panic!("an agree record")
        };
        assert_eq!((r.agreement, r.first_divergence), (1.0, None));
        assert!(shared[1].retained_fraction < 1.0);
        let e = eval_agree(&m, &ids, &o, &policies[1..], &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("full KV"), "{e}");
        let long = AgreeOptions {
            eval_tokens: 119,
            ..o
        };
        let e = eval_agree(&m, &ids, &long, &policies, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("--eval-tokens (119)"), "{e}");
    }
}
