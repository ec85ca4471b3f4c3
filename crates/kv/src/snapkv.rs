//! SnapKV (and PyramidKV's scoring): once, at the end of prefill, each global layer scores
//! its keys by the softmax attention of the last `window` prompt rows (per query head,
//! max-pooled with `kernel`, summed over the GQA group), keeps the top `capacity - window`
//! plus the window per kv head and compacts the store (memory is freed). Decode then reads
//! everything kept plus the new tokens; nothing more is evicted. Sliding-window layers keep
//! their ring.
use slowfast_backend::cpu::attention::KvSegment;

use crate::policy::dense_segments;
use crate::policy::{AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::pyramid::pyramid_budgets;
use crate::score::{accumulate_probs, keys_per_head, snap_keep};
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
    /// Policy name reported (snapkv, pyramidkv, or fastkv for FastKV's decode-KV retention).
    pub name: &'static str,
}

impl SnapKvConfig {
    /// SnapKV with the brief's defaults: window 32, max-pool kernel 7.
    pub fn snapkv(capacity: usize) -> Self {
        SnapKvConfig {
            capacity,
            window: 32,
            kernel: 7,
            pyramid_beta: None,
            name: "snapkv",
        }
    }
    /// FastKV's KV retention: SnapKV scoring with window 8, kernel 7, in every layer
    /// (FastKV's prefill propagation is run by the session, see `Model::prefill_fastkv`).
    pub fn fastkv(capacity: usize) -> Self {
        SnapKvConfig {
            window: 8,
            name: "fastkv",
            ..Self::snapkv(capacity)
        }
    }
    /// PyramidKV: SnapKV scoring, pyramid budgets with beta = 20 (same total).
    pub fn pyramidkv(capacity: usize) -> Self {
        SnapKvConfig {
            pyramid_beta: Some(20.0),
            name: "pyramidkv",
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
        self.cfg.name
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
        // Decode room the store was sized for (positions it can still take).
        let headroom = store.capacity().saturating_sub(n);
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
                store.compact(l, &keep, headroom)?;
            } else {
                // FastKV's propagated layers hold fewer tokens than they were allocated for.
                store.shrink(l, headroom)?;
            }
        }
        self.scores.clear();
        Ok(())
    }

    /// Prefill reads densely; the observation window is the last chunk, always computed.
    fn shares_prefix(&self) -> bool {
        true
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;

    fn store(len: usize, cap: usize, layers: usize) -> KvStore<f32> {
        let spec = LayerSpec {
            capacity: cap,
            ring: false,
        };
        let mut st = KvStore::<f32>::with_block(1, 2, &vec![spec; layers], 16);
        let kv: Vec<f32> = (0..len * 2).map(|i| (i / 2) as f32).collect();
        for l in 0..layers {
            st.write(l, 0, &kv, &kv).unwrap();
        }
        st.set_len(len);
        st
    }

    /// Window logits `[2 heads, rows, keys]`: head 0 looks at 10 (logit 5) and 25 (logit 4),
    /// head 1 at nothing in particular; rows cannot see keys past their own position.
    fn window_logits(rows: usize, keys: usize) -> Vec<f32> {
        let mut l = vec![0.0f32; 2 * rows * keys];
        for h in 0..2 {
            for r in 0..rows {
                let row = &mut l[(h * rows + r) * keys..(h * rows + r + 1) * keys];
                for (j, x) in row.iter_mut().enumerate() {
                    if j > keys - rows + r {
                        *x = f32::NEG_INFINITY;
                    }
                }
                if h == 0 {
                    row[10] = 5.0;
                    row[25] = 4.0;
                }
            }
        }
        l
    }

    fn call(layer: usize, pos0: usize, n: usize) -> AttnCall {
        AttnCall {
            layer,
            pos0,
            n,
            lo: 0,
            sliding: false,
        }
    }

    #[test]
    fn keeps_pooled_top_tokens_and_the_window_once() {
        let mut st = store(40, 100, 1);
        let full = st.nbytes();
        let mut cfg = SnapKvConfig::snapkv(10);
        cfg.window = 4;
        let mut p = SnapKvPolicy::new(cfg).unwrap();
        assert_eq!(KvPolicy::<f32>::prefill_tail(&p), 4);
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &call(0, 0, 40)), 4);
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &call(0, 40, 1)), 0);
        p.observe(&call(0, 0, 40), 4, &window_logits(4, 40), &st);
        p.end_prefill(&mut st).unwrap();
        // Max-pooling (kernel 7) spreads the peak at 10 over 7..=13; the 6 picks are the
        // first six of those ties, then the window 36..40.
        assert_eq!(
            st.slot_positions(0, 0),
            vec![7, 8, 9, 10, 11, 12, 36, 37, 38, 39]
        );
        // 10 kept + 60 decode headroom; before, the 40 prompt tokens held three 16-token blocks.
        assert_eq!(full, 2 * 48 * 2 * 4);
        assert_eq!(st.nbytes(), 2 * 70 * 2 * 4);
        // Decode reads exactly what is kept plus the new token.
        let kv = vec![0.5f32; 2];
        st.write(0, 40, &kv, &kv).unwrap();
        st.set_len(41);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call(0, 40, 1), &st, &mut out);
        assert_eq!(out[0].iter().map(|s| s.len(2)).sum::<usize>(), 11);
        KvPolicy::<f32>::end_forward(&mut p, 40, 1);
        let s = KvPolicy::<f32>::stats(&p);
        assert_eq!((s.attended_tokens, s.dense_tokens), (11.0, 41.0));
    }

    #[test]
    fn pyramid_layers_keep_their_budgets_and_big_budgets_keep_everything() {
        let mut st = store(200, 256, 3);
        let mut cfg = SnapKvConfig::pyramidkv(40);
        cfg.window = 4;
        let mut p = SnapKvPolicy::new(cfg).unwrap();
        for l in 0..3 {
            p.observe(&call(l, 0, 200), 4, &window_logits(4, 200), &st);
        }
        p.end_prefill(&mut st).unwrap();
        let held: Vec<usize> = (0..3).map(|l| st.held(l, 0)).collect();
        assert_eq!(held, pyramid_budgets(40, 4, 3, 200, 20.0));
        assert_eq!(held.iter().sum::<usize>(), 120);
        assert!(held[0] > held[1] && held[1] > held[2]);
        // Budget >= prompt: nothing is compacted.
        let mut st = store(40, 100, 1);
        let mut p = SnapKvPolicy::new(SnapKvConfig::snapkv(40)).unwrap();
        p.observe(&call(0, 0, 40), 32, &window_logits(32, 40), &st);
        p.end_prefill(&mut st).unwrap();
        assert!(!st.layer(0).is_compact());
        assert!(SnapKvPolicy::new(SnapKvConfig::snapkv(32)).is_err());
    }
}
