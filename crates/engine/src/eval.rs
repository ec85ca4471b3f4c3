//! `slowfast eval`: quality measurements. `nll`: prefill N−E tokens of a text, then E
//! teacher-forced decode steps; the mean next-token negative log-likelihood (natural log) over
//! the E predictions those steps make (of tokens t_{N−E+1} .. t_N).
use std::time::Instant;

use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec, Session};
use crate::EngineError;

/// One row of `eval` output (one task under one policy).
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalRecord {
    pub task: String,
    pub policy: String,
    pub model: String,
    pub context: usize,
    pub eval_tokens: usize,
    /// KV budget in tokens (None for full KV).
    pub kv_budget: Option<usize>,
    pub nll: f64,
    pub ppl: f64,
    /// NLL minus the full-KV NLL of the same run (filled in when full KV ran too).
    pub delta_nll: Option<f64>,
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

/// `-ln softmax(logits)[target]`, in f64.
pub fn nll_of(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (sum.ln() + max) - logits[target as usize] as f64
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
    let NllOptions {
        context,
        eval_tokens,
        kv,
        chunk,
    } = *o;
    if eval_tokens == 0 || eval_tokens >= context {
        return Err(EngineError::BadInput(format!(
            "--eval-tokens ({eval_tokens}) must be at least 1 and less than --context ({context})"
        )));
    }
    if tokens.len() < context + 1 {
        return Err(EngineError::BadInput(format!(
            "the input has {} tokens; --context {context} needs at least {}",
            tokens.len(),
            context + 1
        )));
    }
    let max_ctx = m.model.cfg.max_position_embeddings;
    if context > max_ctx {
        return Err(EngineError::BadInput(format!(
            "--context {context} exceeds the model's context of {max_ctx} tokens"
        )));
    }
    let n_prefill = context - eval_tokens;
    let mut sess = Session::try_with_policy(&m.model, context, kv, chunk, policy)?;
    let t0 = Instant::now();
    let mut last_report = Instant::now();
    sess.prefill(&tokens[..n_prefill], &mut |done, total| {
        if last_report.elapsed().as_secs_f64() > 2.0 || done == total {
            progress(&format!("prefill {done}/{total} tokens"));
            last_report = Instant::now();
        }
    })?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let kv_bytes_after_prefill = sess.kv_bytes();
    let t1 = Instant::now();
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
        delta_nll: None,
        retained_fraction: stats.retained_fraction(),
        slow_steps: stats.slow_steps,
        fast_steps: stats.fast_steps,
        model: m.name.clone(),
        context,
        eval_tokens,
        nll,
        ppl: nll.exp(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        kv_bytes: sess.kv_bytes(),
        kv_bytes_after_prefill,
        kv_bytes_end: sess.kv_bytes(),
    })
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
}
