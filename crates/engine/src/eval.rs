//! `slowfast eval`: quality measurements, one record per (task, policy). `nll` (here):
//! prefill N−E tokens of a text, then E teacher-forced decode steps; the mean next-token
//! negative log-likelihood (natural log) over the E predictions those steps make (of tokens
//! t_{N−E+1} .. t_N). `agree`, `passkey`, `ruler` and `stability` live in the submodules.
pub mod agree;
pub mod passkey;
pub mod ruler;
pub mod stability;

use std::time::Instant;

use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec, Session};
use crate::EngineError;
use slowfast_kv::sfi::trigger::CAPTURE_ROWS;

/// One row of `eval` output (one task under one policy). The task's own numbers are in
/// `metrics`, serialized inline (an `nll` record keeps its `nll`, `ppl`, `delta_nll` fields).
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalRecord {
    pub task: String,
    pub policy: String,
    pub model: String,
    pub context: usize,
    /// Decode steps the task scored (nll, agree, stability) or answer tokens per trial
    /// (passkey; ruler: the largest answer budget of its tasks).
    pub eval_tokens: usize,
    /// KV budget in tokens (None for full KV).
    pub kv_budget: Option<usize>,
    #[serde(flatten)]
    pub metrics: Metrics,
    /// Keys attended over keys a dense step would attend, over the decode steps.
    pub retained_fraction: f64,
    pub slow_steps: usize,
    pub fast_steps: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub kv_bytes: usize,
    /// KV bytes held after prefill (after one-shot compression) and at the end of decoding.
    pub kv_bytes_after_prefill: usize,
    pub kv_bytes_end: usize,
}

/// The per-task numbers of a record.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(untagged)]
pub enum Metrics {
    Nll(NllMetrics),
    Agree(agree::AgreeMetrics),
    Passkey(passkey::PasskeyMetrics),
    Ruler(ruler::RulerMetrics),
    Stability(stability::StabilityMetrics),
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct NllMetrics {
    pub nll: f64,
    pub ppl: f64,
    /// NLL minus the full-KV NLL of the same run (filled in when full KV ran too).
    pub delta_nll: Option<f64>,
    /// Windows of the text decoded together as one batch (`eval --batch`; 1: the usual run).
    pub windows: usize,
    /// Slow steps that were rides (joined another window's slow step), over all windows.
    pub rides: usize,
    /// Decode steps of the batch in which some window took a slow step by its trigger or a
    /// ride (what a GPU batch pays a slow step for; the windows' `slow_steps` in a 1-window
    /// run).
    pub batch_slow_steps: usize,
    /// Each window's mean NLL (`--batch`; empty for a 1-window run), for paired comparisons.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub window_nll: Vec<f64>,
}

/// Index of the largest logit (the first one on ties): greedy decoding.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Check that `context` fits the model.
pub(crate) fn check_model_context(m: &Loaded, context: usize) -> Result<(), EngineError> {
    let max_ctx = m.model.cfg.max_position_embeddings;
    if context > max_ctx {
        return Err(EngineError::BadInput(format!(
            "--context {context} exceeds the model's context of {max_ctx} tokens"
        )));
    }
    Ok(())
}

/// Check that a text of `have` tokens covers `need` tokens of `--context {context}`.
pub(crate) fn check_input_len(have: usize, need: usize, context: usize) -> Result<(), EngineError> {
    if have < need {
        return Err(EngineError::BadInput(format!(
            "the input has {have} tokens; --context {context} needs at least {need}"
        )));
    }
    Ok(())
}

/// Whether `p` can continue a dense prefill made under another policy: its state does not
/// depend on the prefill (full KV; streaming only acts on decode steps). SFI captures its
/// bootstrap rows during the prefill and so runs its own; so does any other policy.
pub fn prefill_free(p: &PolicySpec) -> bool {
    matches!(
        p,
        PolicySpec::Full | PolicySpec::Streaming { .. } | PolicySpec::Oracle { .. }
    )
}

/// Whether the KV store after a prefill under `p` is the plain dense one, so prefill-free
/// policies may continue from a copy (SFI and Quest only read it; H2O, SnapKV, PyramidKV and
/// FastKV compress it at the end of prefill).
fn leaves_kv_dense(p: &PolicySpec) -> bool {
    matches!(
        p,
        PolicySpec::Full
            | PolicySpec::Streaming { .. }
            | PolicySpec::Sfi { .. }
            | PolicySpec::Quest { .. }
            | PolicySpec::Oracle { .. }
    )
}

/// One session per policy (capacity `cap`), each with `tokens` prefilled, and the prefill's
/// seconds. The prefill is dense under every policy, so it runs once under the first policy
/// that needs its own (else the first policy) and the prefill-free policies continue from
/// copies of that session; other policies that need their own prefill get one.
pub(crate) fn prefilled_sessions<'m>(
    m: &'m Loaded,
    cap: usize,
    kv: KvDtype,
    chunk: usize,
    policies: &[PolicySpec],
    tokens: &[u32],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<(Session<'m>, f64)>, EngineError> {
    // The base: a policy that needs its own prefill anyway but leaves the KV dense (SFI), else
    // the first prefill-free one.
    let base = policies
        .iter()
        .position(|p| !prefill_free(p) && leaves_kv_dense(p))
        .or_else(|| policies.iter().position(prefill_free))
        .unwrap_or(0);
    let mut out: Vec<Option<(Session<'m>, f64)>> = policies.iter().map(|_| None).collect();
    for (i, p) in policies.iter().enumerate() {
        if i == base || !prefill_free(p) {
            progress(&format!("prefill under {}", p.name()));
            let mut sess = Session::try_with_policy(&m.model, cap, kv, chunk, p)?;
            let secs = prefill_reporting(&mut sess, tokens, progress)?;
            out[i] = Some((sess, secs));
        }
    }
    for (i, p) in policies.iter().enumerate() {
        if out[i].is_none() {
            let (b, secs) = out[base].as_ref().expect("prefilled above");
            out[i] = Some((b.fork(p)?, *secs));
        }
    }
    Ok(out
        .into_iter()
        .map(|s| s.expect("every slot filled"))
        .collect())
}

/// A prefilled session on some device and its prefill seconds.
pub(crate) type Prefilled<'m> = (Box<dyn crate::device::Steps + 'm>, f64);

/// One session a policy on `device`, each holding `tokens` prefilled, with its prefill seconds.
/// With `share` (the CPU) the policies that need no prefill of their own fork one prefill
/// ([`prefilled_sessions`]); otherwise, as on the GPU, each policy prefills its own session.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefilled_steps<'m>(
    device: crate::Device,
    share: bool,
    m: &'m Loaded,
    cap: usize,
    kv: KvDtype,
    chunk: usize,
    policies: &[PolicySpec],
    tokens: &[u32],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Prefilled<'m>>, EngineError> {
    if share && device == crate::Device::Cpu && m.tensor_parallel == 1 {
        let sessions = prefilled_sessions(m, cap, kv, chunk, policies, tokens, progress)?;
        return Ok(boxed(sessions));
    }
    policies
        .iter()
        .map(|p| {
            progress(&format!("prefill under {}", p.name()));
            let mut sess = crate::device::session(device, m, cap, kv, chunk, p)?;
            let secs = prefill_reporting(&mut *sess, tokens, progress)?;
            Ok((sess, secs))
        })
        .collect()
}

/// CPU sessions with their prefill seconds as [`Prefilled`] ones.
pub(crate) fn boxed<'m>(sessions: Vec<(Session<'m>, f64)>) -> Vec<Prefilled<'m>> {
    sessions
        .into_iter()
        .map(|(s, t)| (Box::new(s) as Box<dyn crate::device::Steps + 'm>, t))
        .collect()
}

/// Prefill `tokens`, reporting progress at most every 2 s; returns the seconds it took.
pub(crate) fn prefill_reporting(
    sess: &mut dyn crate::device::Steps,
    tokens: &[u32],
    progress: &mut dyn FnMut(&str),
) -> Result<f64, EngineError> {
    let t0 = Instant::now();
    let mut last_report = Instant::now();
    sess.prefill(tokens, &mut |done, total| {
        if last_report.elapsed().as_secs_f64() > 2.0 || done == total {
            progress(&format!("prefill {done}/{total} tokens"));
            last_report = Instant::now();
        }
    })?;
    Ok(t0.elapsed().as_secs_f64())
}

/// `-ln softmax(logits)[target]`, in f64.
pub fn nll_of(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (sum.ln() + max) - logits[target as usize] as f64
}

/// An `nll` run scores E decode steps after a prefill of N - E tokens: 1 <= E < N.
fn check_nll_shape(context: usize, eval_tokens: usize) -> Result<(), EngineError> {
    if eval_tokens == 0 || eval_tokens >= context {
        return Err(EngineError::BadInput(format!(
            "--eval-tokens ({eval_tokens}) must be at least 1 and less than --context ({context})"
        )));
    }
    Ok(())
}

/// The shape of an `nll` run: context N, scored decode steps E, KV dtype and prefill chunk.
#[derive(Debug, Clone, Copy)]
pub struct NllOptions {
    pub context: usize,
    pub eval_tokens: usize,
    pub kv: KvDtype,
    pub chunk: usize,
}

/// Mean NLL of E teacher-forced decode steps after a prefill of N−E tokens, under `policy`.
/// `tokens` must hold at least N+1 tokens (t_0 .. t_N).
pub fn eval_nll(
    m: &Loaded,
    tokens: &[u32],
    o: &NllOptions,
    policy: &PolicySpec,
    progress: &mut dyn FnMut(&str),
) -> Result<EvalRecord, EngineError> {
    eval_nll_on(crate::Device::Cpu, m, tokens, o, policy, progress)
}

/// [`eval_nll`] on `device` (`--device cuda`: the policies `cuda::GPU_POLICIES` names).
pub fn eval_nll_on(
    device: crate::Device,
    m: &Loaded,
    tokens: &[u32],
    o: &NllOptions,
    policy: &PolicySpec,
    progress: &mut dyn FnMut(&str),
) -> Result<EvalRecord, EngineError> {
    let NllOptions {
        context,
        eval_tokens,
        kv,
        chunk,
    } = *o;
    check_nll_shape(context, eval_tokens)?;
    check_input_len(tokens.len(), context + 1, context)?;
    check_model_context(m, context)?;
    let n_prefill = context - eval_tokens;
    let mut sess = crate::device::session(device, m, context, kv, chunk, policy)?;
    let prefill_seconds = prefill_reporting(&mut *sess, &tokens[..n_prefill], progress)?;
    let kv_bytes_after_prefill = sess.kv_bytes();
    let t1 = Instant::now();
    let mut last_report = Instant::now();
    let mut total = 0.0;
    for i in n_prefill..context {
        let logits = sess.step(tokens[i])?;
        total += nll_of(logits, tokens[i + 1]);
        let done = i + 1 - n_prefill;
        if last_report.elapsed().as_secs_f64() > 2.0 || done == eval_tokens {
            progress(&format!(
                "decode {done}/{eval_tokens} (running nll {:.4})",
                total / done as f64
            ));
            last_report = Instant::now();
        }
    }
    let nll = total / eval_tokens as f64;
    let stats = sess.policy_stats();
    Ok(EvalRecord {
        task: "nll".into(),
        policy: policy.name().into(),
        kv_budget: policy.budget(),
        metrics: Metrics::Nll(NllMetrics {
            nll,
            ppl: nll.exp(),
            delta_nll: None,
            windows: 1,
            rides: 0,
            batch_slow_steps: stats.slow_steps,
            window_nll: Vec::new(),
        }),
        retained_fraction: stats.retained_fraction(),
        slow_steps: stats.slow_steps,
        fast_steps: stats.fast_steps,
        model: m.name.clone(),
        context,
        eval_tokens,
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        kv_bytes: sess.kv_bytes(),
        kv_bytes_after_prefill,
        kv_bytes_end: sess.kv_bytes(),
    })
}

/// [`eval_nll`] over `batch` windows of the text decoded together on the CPU, as one GPU
/// batch of `batch` sequences steps them ([`Session::step_together`] with the GPU's room,
/// `CAPTURE_ROWS`): so SFI's riding (`--sfi-ride`) changes when each window refreshes as it
/// does on the GPU, and its cost in quality can be measured here. Window j is `tokens[0]`
/// (the BOS) and then the N tokens from `1 + j * N`, so window 0 is what [`eval_nll`] scores
/// and the windows do not overlap: `tokens` must hold at least `1 + batch * N` tokens. Each
/// window is prefilled once for all `policies` ([`prefilled_sessions`]); then each policy's
/// windows decode together. A record's NLL is the mean over every window's E steps; its step
/// counts are sums over the windows, its retained fraction and KV bytes means.
pub fn eval_nll_batch(
    m: &Loaded,
    tokens: &[u32],
    o: &NllOptions,
    policies: &[PolicySpec],
    batch: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    let NllOptions {
        context,
        eval_tokens,
        kv,
        chunk,
    } = *o;
    if batch == 0 {
        return Err(EngineError::BadInput("--batch must be at least 1".into()));
    }
    check_nll_shape(context, eval_tokens)?;
    check_model_context(m, context)?;
    let need = 1 + batch * context;
    if tokens.len() < need {
        return Err(EngineError::BadInput(format!(
            "--batch {batch} at --context {context} needs {need} tokens of input (BOS + batch x context: disjoint windows), the text has {}",
            tokens.len()
        )));
    }
    let windows: Vec<Vec<u32>> = (0..batch)
        .map(|j| {
            let start = 1 + j * context;
            std::iter::once(tokens[0])
                .chain(tokens[start..start + context].iter().copied())
                .collect()
        })
        .collect();
    let n_prefill = context - eval_tokens;
    // by_policy[p]: policy p's session of every window, and the prefill seconds.
    let mut by_policy: Vec<(Vec<Session>, f64)> =
        policies.iter().map(|_| (Vec::new(), 0.0)).collect();
    for (j, w) in windows.iter().enumerate() {
        progress(&format!("window {}/{batch}", j + 1));
        let sessions =
            prefilled_sessions(m, context, kv, chunk, policies, &w[..n_prefill], progress)?;
        for ((sess, secs), slot) in sessions.into_iter().zip(by_policy.iter_mut()) {
            slot.0.push(sess);
            slot.1 += secs;
        }
    }
    let mut recs = Vec::new();
    for (policy, (mut sessions, prefill_seconds)) in policies.iter().zip(by_policy) {
        progress(&format!("== policy {} over {batch} windows", policy.name()));
        let kv_after: usize = sessions.iter().map(|s| s.kv_bytes()).sum();
        let t1 = Instant::now();
        let mut last_report = Instant::now();
        let (mut total, mut rides, mut batch_slow) = (0.0, 0, 0);
        let mut per_window = vec![0.0; batch];
        for i in n_prefill..context {
            let fed: Vec<u32> = windows.iter().map(|w| w[i]).collect();
            let (fired, rode) = Session::step_together(&mut sessions, &fed, CAPTURE_ROWS)?;
            rides += rode.len();
            batch_slow += usize::from(!rode.is_empty() || fired.contains(&true));
            for ((s, w), acc) in sessions.iter().zip(&windows).zip(per_window.iter_mut()) {
                let x = nll_of(s.logits(), w[i + 1]);
                total += x;
                *acc += x / eval_tokens as f64;
            }
            let done = i + 1 - n_prefill;
            if last_report.elapsed().as_secs_f64() > 2.0 || done == eval_tokens {
                progress(&format!(
                    "decode {done}/{eval_tokens} x {batch} windows (running nll {:.4}, {rides} rides)",
                    total / (done * batch) as f64
                ));
                last_report = Instant::now();
            }
        }
        let nll = total / (eval_tokens * batch) as f64;
        let stats: Vec<_> = sessions.iter().map(|s| s.policy_stats()).collect();
        let kv_end: usize = sessions.iter().map(|s| s.kv_bytes()).sum();
        recs.push(EvalRecord {
            task: "nll".into(),
            policy: policy.name().into(),
            kv_budget: policy.budget(),
            metrics: Metrics::Nll(NllMetrics {
                nll,
                ppl: nll.exp(),
                delta_nll: None,
                windows: batch,
                rides,
                batch_slow_steps: batch_slow,
                window_nll: per_window,
            }),
            retained_fraction: stats.iter().map(|s| s.retained_fraction()).sum::<f64>()
                / batch as f64,
            slow_steps: stats.iter().map(|s| s.slow_steps).sum(),
            fast_steps: stats.iter().map(|s| s.fast_steps).sum(),
            model: m.name.clone(),
            context,
            eval_tokens,
            prefill_seconds,
            decode_seconds: t1.elapsed().as_secs_f64(),
            kv_bytes: kv_end / batch,
            kv_bytes_after_prefill: kv_after / batch,
            kv_bytes_end: kv_end / batch,
        });
    }
    Ok(recs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_matches_log_softmax() {
        let l = [1.0f32, 2.0, 3.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        for t in 0..3 {
            let want = -((l[t] as f64).exp() / z).ln();
            assert!((nll_of(&l, t as u32) - want).abs() < 1e-12);
        }
    }

    #[test]
    fn records_serialize_the_task_metrics_inline() {
        let rec = |metrics| EvalRecord {
            task: "nll".into(),
            policy: "full".into(),
            model: "m".into(),
            context: 8,
            eval_tokens: 2,
            kv_budget: None,
            metrics,
            retained_fraction: 1.0,
            slow_steps: 2,
            fast_steps: 0,
            prefill_seconds: 0.5,
            decode_seconds: 0.25,
            kv_bytes: 64,
            kv_bytes_after_prefill: 64,
            kv_bytes_end: 64,
        };
        let nll = rec(Metrics::Nll(NllMetrics {
            nll: 2.0,
            ppl: 2f64.exp(),
            delta_nll: Some(0.0),
            windows: 1,
            rides: 0,
            batch_slow_steps: 2,
            window_nll: Vec::new(),
        }));
        let v = serde_json::to_value(&nll).unwrap();
        // The fields an `nll` record always had, at the top level.
        for k in [
            "task",
            "policy",
            "model",
            "context",
            "eval_tokens",
            "kv_budget",
            "nll",
            "ppl",
            "delta_nll",
            "retained_fraction",
            "slow_steps",
            "fast_steps",
            "prefill_seconds",
            "decode_seconds",
            "kv_bytes",
        ] {
            assert!(v.get(k).is_some(), "missing {k} in {v}");
        }
        assert_eq!(v["nll"], 2.0);
        let agree = rec(Metrics::Agree(agree::AgreeMetrics {
            agreement: 0.5,
            first_divergence: Some(3),
            matched: 1,
            teacher_forced_agreement: None,
            text: "ab".into(),
        }));
        let v = serde_json::to_value(&agree).unwrap();
        assert_eq!(v["agreement"], 0.5);
        assert_eq!(v["first_divergence"], 3);
        assert!(v.get("nll").is_none());
    }

    #[test]
    fn argmax_takes_the_first_largest() {
        assert_eq!(argmax(&[0.0, 3.0, 1.0, 3.0]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
    }
}
