//! SnapKV (and PyramidKV's scoring): once, at the end of prefill, each global layer scores
//! its keys by the softmax attention of the last `window` prompt rows (per query head,
//! max-pooled with `kernel`, summed over the GQA group), keeps the top `capacity - window`
//! plus the window per kv head and compacts the store (memory is freed). Decode then reads
//! everything kept plus the new tokens; nothing more is evicted. Sliding-window layers keep
//! their ring.
use slowfast_backend::cpu::attention::KvSegment;

use crate::policy::{AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::pyramid::pyramid_budgets;
use crate::score::{accumulate_probs, dense_segments, keys_per_head, snap_keep};
use crate::store::{CacheElem, KvError, KvStore};

/// SnapKV knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapKvConfig {
    /// Tokens kept per kv head in each global layer (the mean over layers for PyramidKV),
    /// window included.
    pub capacity: usize,
    /// Observation window: the last prompt rows whose attention scores the keys.
    pub window: usize,
    /// Max-pooling kernel (odd).
    pub kernel: usize,
    /// PyramidKV: per-layer capacities decreasing linearly with depth, `min = (C - w) / beta`
    /// (None: every layer keeps `capacity`).
    pub pyramid_beta: Option<f64>,
}

impl SnapKvConfig {
    /// SnapKV with the brief's defaults: window 32, max-pool kernel 7.
    pub fn snapkv(capacity: usize) -> Self {
        SnapKvConfig {
            capacity,
            window: 32,
            kernel: 7,
            pyramid_beta: None,
        }
    }
    /// PyramidKV: SnapKV scoring, pyramid budgets with beta = 20 (same total).
    pub fn pyramidkv(capacity: usize) -> Self {
        SnapKvConfig {
            pyramid_beta: Some(20.0),
            ..Self::snapkv(capacity)
        }
    }
}

pub struct SnapKvPolicy {
    cfg: SnapKvConfig,
    /// Per layer: the last capture's summed probabilities per query head (indexed by slot).
    scores: Vec<Option<Vec<Vec<f32>>>>,
    /// Capacities used at the last compression, per layer (None: not a scored layer).
    pub layer_capacity: Vec<Option<usize>>,
    stats: PolicyStats,
    step: StepCounter,
}

impl SnapKvPolicy {
    pub fn new(cfg: SnapKvConfig) -> Result<Self, String> {
        if cfg.kernel == 0 || cfg.kernel.is_multiple_of(2) {
            return Err(format!("pooling kernel must be odd, got {}", cfg.kernel));
        }
        if cfg.capacity <= cfg.window {
            return Err(format!(
                "the KV budget ({} tokens) must exceed the observation window ({} tokens)",
                cfg.capacity, cfg.window
            ));
        }
        Ok(SnapKvPolicy {
            cfg,
            scores: Vec::new(),
            layer_capacity: Vec::new(),
            stats: PolicyStats::default(),
            step: StepCounter::default(),
        })
    }

    fn name_of(&self) -> &'static str {
        if self.cfg.pyramid_beta.is_some() {
            "pyramidkv"
        } else {
            "snapkv"
        }
    }
}

impl<T: CacheElem> KvPolicy<T> for SnapKvPolicy {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    ) {
        dense_segments(call, store, out, &mut self.step);
    }

    fn capture_rows(&self, call: &AttnCall) -> usize {
        if call.sliding || call.is_decode() {
            0
        } else {
            self.cfg.window
        }
    }

    fn observe(&mut self, call: &AttnCall, rows: usize, logits: &[f32], store: &KvStore<T>) {
        if self.scores.len() <= call.layer {
            self.scores.resize_with(call.layer + 1, || None);
        }
        // Each prefill chunk replaces the previous capture: the last chunk's rows are the
        // observation window (the session makes that chunk at least `window` rows long).
        let mut acc = Vec::new();
        accumulate_probs(logits, rows, &keys_per_head(call, store), &mut acc);
        self.scores[call.layer] = Some(acc);
    }

    fn end_forward(&mut self, _pos0: usize, n: usize) {
        if n == 1 {
            self.step.finish(&mut self.stats, false);
        }
    }

    fn prefill_tail(&self) -> usize {
        self.cfg.window
    }

    fn end_prefill(&mut self, store: &mut KvStore<T>) -> Result<(), KvError> {
        let layers: Vec<usize> = (0..self.scores.len())
            .filter(|&l| self.scores[l].is_some())
            .collect();
        let n = store.len();
        let caps = match self.cfg.pyramid_beta {
            Some(beta) => {
                pyramid_budgets(self.cfg.capacity, self.cfg.window, layers.len(), n, beta)
            }
            None => vec![self.cfg.capacity; layers.len()],
        };
        self.layer_capacity = vec![None; store.n_layers()];
        let nkv = store.n_kv_heads;
        for (&l, &cap) in layers.iter().zip(&caps) {
            self.layer_capacity[l] = Some(cap);
            let per_q = self.scores[l].take().expect("filtered above");
            let group = per_q.len() / nkv.max(1);
            let mut keep = Vec::with_capacity(nkv);
            let mut evicts = false;
            for h in 0..nkv {
                let held = store.held(l, h);
                let heads: Vec<&[f32]> = per_q[h * group..(h + 1) * group]
                    .iter()
                    .map(|v| v.as_slice())
                    .collect();
                if heads.iter().any(|s| s.len() < held) {
                    // The capture did not cover this layer's keys (no prefill chunk reached
                    // it with the window): leave the layer alone.
                    evicts = false;
                    keep.clear();
                    break;
                }
                let k = snap_keep(&heads, held, self.cfg.window, cap, self.cfg.kernel);
                evicts |= k.len() < held;
                keep.push(k);
            }
            if evicts {
                let headroom = store.layer(l).spec.capacity - store.held(l, 0);
                store.compact(l, &keep, headroom)?;
            }
        }
        self.scores.clear();
        Ok(())
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }
}
