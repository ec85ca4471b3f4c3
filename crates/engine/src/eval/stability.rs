//! `eval --task stability`: SFI's stability observation measured on a real model. Prefill N−E
//! tokens of a text, then E teacher-forced decode steps with dense attention under the probe
//! policy, which keeps each global layer's and query head's top-k keys per step; reported: the
//! mean Jaccard overlap of consecutive steps inside a sentence and across a sentence start,
//! and the overlap of steps t and t + d.
use std::time::Instant;

use slowfast_kv::probe::{ProbePolicy, StabilityStats};
use slowfast_kv::{CacheElem, KvPolicy};
use slowfast_model::{LogitsRows, Scratch};

use super::{check_input_len, check_model_context, EvalRecord, Metrics};
use crate::load::Loaded;
use crate::session::KvDtype;
use crate::EngineError;

/// The shape of a stability run.
#[derive(Debug, Clone)]
pub struct StabilityOptions {
    pub context: usize,
    /// Decode steps measured (the last E tokens of the context).
    pub eval_tokens: usize,
    pub kv: KvDtype,
    pub chunk: usize,
    /// Size of each step's support (top-k keys by attention logit).
    pub topk: usize,
    /// Step distances d of the overlap(t, t + d) curve.
    pub distances: Vec<usize>,
}

/// Mean overlap at one distance.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DistanceJaccard {
    pub distance: usize,
    pub jaccard: Option<f64>,
    pub samples: usize,
}

/// Consecutive-step overlap of one (global layer, query head).
#[derive(Debug, Clone, serde::Serialize)]
pub struct HeadJaccard {
    pub layer: usize,
    pub head: usize,
    pub within: Option<f64>,
    pub across: Option<f64>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct StabilityMetrics {
    pub topk: usize,
    pub steps: usize,
    /// Sentence starts among the measured steps.
    pub boundaries: usize,
    /// Mean Jaccard of consecutive steps inside one sentence.
    pub jaccard_within: Option<f64>,
    /// Mean Jaccard of consecutive steps whose second query starts a new sentence.
    pub jaccard_across: Option<f64>,
    /// Samples (step pairs × global layers × query heads) behind the two means.
    pub within_samples: usize,
    pub across_samples: usize,
    pub jaccard_by_distance: Vec<DistanceJaccard>,
    pub per_head: Vec<HeadJaccard>,
}

impl From<&StabilityStats> for StabilityMetrics {
    fn from(s: &StabilityStats) -> Self {
        StabilityMetrics {
            topk: s.topk,
            steps: s.steps,
            boundaries: s.boundaries,
            jaccard_within: s.within.get(),
            jaccard_across: s.across.get(),
            within_samples: s.within.count,
            across_samples: s.across.count,
            jaccard_by_distance: s
                .by_distance
                .iter()
                .map(|(d, m)| DistanceJaccard {
                    distance: *d,
                    jaccard: m.get(),
                    samples: m.count,
                })
                .collect(),
            per_head: s
                .per_head
                .iter()
                .map(|h| HeadJaccard {
                    layer: h.layer,
                    head: h.head,
                    within: h.within.get(),
                    across: h.across.get(),
                })
                .collect(),
        }
    }
}

/// Timings and the probe's measurements of one run.
struct Run {
    prefill_seconds: f64,
    decode_seconds: f64,
    kv_bytes: usize,
    stats: slowfast_kv::PolicyStats,
}

fn run<T: CacheElem>(
    m: &Loaded,
    tokens: &[u32],
    o: &StabilityOptions,
    probe: &mut ProbePolicy,
    progress: &mut dyn FnMut(&str),
) -> Result<Run, EngineError> {
    let model = &m.model;
    let chunk = o.chunk.clamp(1, o.context);
    let mut cache = model.new_cache::<T>(o.context, chunk);
    let (mut s, mut logits) = (Scratch::default(), Vec::new());
    let n_prefill = o.context - o.eval_tokens;
    let t0 = Instant::now();
    let mut last_report = Instant::now();
    for c in tokens[..n_prefill].chunks(chunk) {
        let pos = cache.len();
        model.forward_with(
            c,
            pos,
            &mut cache,
            probe,
            &mut s,
            LogitsRows::None,
            &mut logits,
        )?;
        if last_report.elapsed().as_secs_f64() > 2.0 || cache.len() == n_prefill {
            progress(&format!("prefill {}/{n_prefill} tokens", cache.len()));
            last_report = Instant::now();
        }
    }
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for (i, &t) in tokens[n_prefill..o.context].iter().enumerate() {
        KvPolicy::<T>::on_token(probe, t);
        let pos = cache.len();
        model.forward_with(
            &[t],
            pos,
            &mut cache,
            probe,
            &mut s,
            LogitsRows::None,
            &mut logits,
        )?;
        if last_report.elapsed().as_secs_f64() > 2.0 || i + 1 == o.eval_tokens {
            let st = probe.stability();
            progress(&format!(
                "decode {}/{} (jaccard within {:.3}, across {:.3})",
                i + 1,
                o.eval_tokens,
                st.within.get().unwrap_or(f64::NAN),
                st.across.get().unwrap_or(f64::NAN)
            ));
            last_report = Instant::now();
        }
    }
    Ok(Run {
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        kv_bytes: cache.nbytes(),
        stats: KvPolicy::<T>::stats(probe),
    })
}

#[cfg(feature = "cuda")]
fn run_gpu(
    m: &Loaded,
    tokens: &[u32],
    o: &StabilityOptions,
    kv: KvDtype,
    probe: &mut ProbePolicy,
    progress: &mut dyn FnMut(&str),
) -> Result<Run, EngineError> {
    if m.tensor_parallel > 1 {
        return Err(crate::device::tp_not_on_gpu());
    }
    let n_prefill = o.context - o.eval_tokens;
    let (prefill_seconds, decode_seconds, kv_bytes) =
        crate::cuda::probe_stability(&m.model, tokens, n_prefill, kv, probe, progress)?;
    Ok(Run {
        prefill_seconds,
        decode_seconds,
        kv_bytes,
        stats: slowfast_kv::PolicyStats {
            slow_steps: o.eval_tokens,
            fast_steps: 0,
            attended_tokens: 0.0,
            dense_tokens: 0.0,
        },
    })
}

/// Measure support stability over the last E tokens of `tokens[..N]` (dense attention), on
/// the CPU.
pub fn eval_stability(
    m: &Loaded,
    tokens: &[u32],
    o: &StabilityOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<EvalRecord, EngineError> {
    eval_stability_on(crate::Device::Cpu, m, tokens, o, progress)
}

/// [`eval_stability`] on `device`. On the GPU every decode step is one of SFI's slow steps
/// (dense attention, full KV's output) whose captured logits feed the same probe
/// (`cuda::probe_stability`); bf16 KV there, so near-ties may order differently from the
/// CPU's f32 / f16.
pub fn eval_stability_on(
    device: crate::Device,
    m: &Loaded,
    tokens: &[u32],
    o: &StabilityOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<EvalRecord, EngineError> {
    if o.eval_tokens < 2 || o.eval_tokens >= o.context {
        return Err(EngineError::BadInput(format!(
            "--eval-tokens ({}) must be at least 2 and less than --context ({}) for stability",
            o.eval_tokens, o.context
        )));
    }
    check_input_len(tokens.len(), o.context, o.context)?;
    check_model_context(m, o.context)?;
    let tok = &m.tokenizer;
    let mut probe = ProbePolicy::new(
        o.topk,
        &o.distances,
        &tok.sentence_ender_ids(),
        &tok.newline_ids(),
        tok.vocab_size().max(m.model.cfg.vocab_size),
    )
    .map_err(|e| EngineError::BadInput(format!("--stability-topk/--stability-distances: {e}")))?;
    let r = match (device, o.kv) {
        #[cfg(feature = "cuda")]
        (crate::Device::Cuda, kv) => run_gpu(m, &tokens[..o.context], o, kv, &mut probe, progress)?,
        #[cfg(not(feature = "cuda"))]
        (crate::Device::Cuda, _) => return Err(crate::device::not_built()),
        (crate::Device::Cpu, KvDtype::F32) => run::<f32>(m, tokens, o, &mut probe, progress)?,
        (crate::Device::Cpu, KvDtype::F16) => run::<half::f16>(m, tokens, o, &mut probe, progress)?,
        (crate::Device::Cpu, KvDtype::Fp8) => {
            run::<slowfast_kv::E4m3>(m, tokens, o, &mut probe, progress)?
        }
    };
    Ok(EvalRecord {
        task: "stability".into(),
        policy: "full".into(),
        model: m.name.clone(),
        context: o.context,
        eval_tokens: o.eval_tokens,
        kv_budget: None,
        metrics: Metrics::Stability(probe.stability().into()),
        retained_fraction: r.stats.retained_fraction(),
        slow_steps: r.stats.slow_steps,
        fast_steps: r.stats.fast_steps,
        prefill_seconds: r.prefill_seconds,
        decode_seconds: r.decode_seconds,
        kv_bytes: r.kv_bytes,
        kv_bytes_after_prefill: r.kv_bytes,
        kv_bytes_end: r.kv_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stability_on_the_real_model_measures_every_global_head() {
        let Some(path) = slowfast_loader::paths::test_model_path() else {
            return;
        };
        let m = crate::load(path.to_str().unwrap(), &mut |_| {}).unwrap();
        let text = "It is a truth universally acknowledged, that a single man in possession \
                    of a good fortune, must be in want of a wife. However little known the \
                    feelings or views of such a man may be on his first entering a \
                    neighbourhood, this truth is so well fixed in the minds of the surrounding \
                    families. My dear Mr. Bennet, said his lady to him one day, have you heard \
                    that Netherfield Park is let at last? Mr. Bennet replied that he had not.";
        let ids = m.tokenizer.encode(text, true).unwrap();
        let o = StabilityOptions {
            context: ids.len(),
            eval_tokens: 60,
            kv: KvDtype::F32,
            chunk: 32,
            topk: 8,
            distances: vec![1, 4],
        };
        let r = eval_stability(&m, &ids, &o, &mut |_| {}).unwrap();
        let Metrics::Stability(s) = r.metrics else {
            panic!("a stability record")
        };
        let cfg = &m.model.cfg;
        let globals = (0..cfg.num_hidden_layers)
            .filter(|&l| !cfg.is_sliding(l))
            .count();
        assert_eq!(s.steps, 60);
        assert_eq!(s.per_head.len(), globals * cfg.num_attention_heads);
        assert_eq!(s.within_samples + s.across_samples, 59 * s.per_head.len());
        assert!(s.boundaries >= 1, "the text has sentence starts");
        assert!(s.across_samples > 0);
        for j in [s.jaccard_within.unwrap(), s.jaccard_across.unwrap()] {
            assert!((0.0..=1.0).contains(&j));
        }
        assert_eq!(r.retained_fraction, 1.0);
        let bad = StabilityOptions { topk: 0, ..o };
        let e = eval_stability(&m, &ids, &bad, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("--stability-topk"), "{e}");
    }
}
