//! StreamingLLM: attend to the first `sinks` tokens (attention sinks) and the most recent
//! tokens, nothing in between. Applied to decode steps of global layers; prefill stays dense
//! and sliding-window layers keep their window.
use slowfast_backend::cpu::attention::KvSegment;

use crate::inspect::Held;
use crate::policy::{push_range, reset_out, AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::store::{CacheElem, KvStore};

#[derive(Debug, Clone)]
pub struct StreamingPolicy {
    pub sinks: usize,
    pub recent: usize,
    stats: PolicyStats,
    step: StepCounter,
    /// A verification is running: decode calls read densely.
    verifying: bool,
}

impl StreamingPolicy {
    /// A budget of `sinks + recent` tokens per kv head.
    pub fn new(sinks: usize, recent: usize) -> Self {
        StreamingPolicy {
            sinks,
            recent,
            stats: PolicyStats::default(),
            step: StepCounter::default(),
            verifying: false,
        }
    }
}

impl<T: CacheElem> KvPolicy<T> for StreamingPolicy {
    fn name(&self) -> &'static str {
        "streaming"
    }

    fn try_clone(&self) -> Option<Box<dyn KvPolicy<T>>> {
        Some(Box::new(self.clone()))
    }

    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    ) {
        reset_out(out, store.n_kv_heads);
        let (lo, hi) = (call.lo, call.hi());
        let sparse = call.is_decode()
            && !call.sliding
            && !self.verifying
            && hi - lo > self.sinks + self.recent;
        for (h, o) in out.iter_mut().enumerate() {
            if sparse {
                push_range(store, call.layer, h, lo..lo + self.sinks, o);
                push_range(store, call.layer, h, hi - self.recent..hi, o);
            } else {
                push_range(store, call.layer, h, lo..hi, o);
            }
        }
        if call.is_decode() && !call.sliding {
            let attended = if sparse {
                self.sinks + self.recent
            } else {
                hi - lo
            };
            self.step.record(attended as f64, hi - lo);
            if sparse {
                self.step.mark_sparse();
            }
        }
    }

    fn end_forward(&mut self, _pos0: usize, _n: usize) {
        self.step.finish_step(&mut self.stats);
    }

    /// Prefill reads densely; the sinks and window are positions.
    fn shares_prefix(&self) -> bool {
        true
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }

    /// The sinks and the recent window a decode step at position `len` reads (everything
    /// while the sequence is not longer than the budget).
    fn held(&self, _layer: usize, store: &KvStore<T>) -> Vec<Held> {
        let len = store.len();
        let held = if len < self.sinks + self.recent {
            Held::kept_range(0..len)
        } else {
            Held::with_roles(0..self.sinks, &[], (len + 1 - self.recent)..len)
        };
        vec![held; store.n_kv_heads]
    }

    /// StreamingLLM keeps no state besides its counters: drafting needs no undo.
    fn begin_draft(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn begin_verify(&mut self, _pos0: usize, _scale: f32) {
        self.verifying = true;
    }

    fn end_verify(&mut self, _fed: &[u32], _len: usize, _refresh: bool, _store: &KvStore<T>) {
        self.verifying = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;

    fn starts(segs: &[KvSegment<'_, f32>], d: usize) -> Vec<(u32, usize)> {
        crate::policy::range_runs(segs, d)
    }

    /// One layer of capacity 64 holding 40 zero rows of width `d`.
    fn store_of_40(d: usize) -> KvStore<f32> {
        let mut st = KvStore::<f32>::new(
            1,
            d,
            &[LayerSpec {
                capacity: 64,
                ring: false,
            }],
        );
        let kv = vec![0.0; 40 * d];
        st.write(0, 0, &kv, &kv).unwrap();
        st.set_len(40);
        st
    }

    #[test]
    fn held_is_the_sinks_and_the_window_of_the_next_step() {
        let d = 2;
        let mut st = store_of_40(d);
        let p = StreamingPolicy::new(4, 8);
        // The step at position 40 reads 0..4 and 33..41: 33..40 are held now.
        let held = KvPolicy::<f32>::held(&p, 0, &st);
        assert_eq!(held[0].sinks, vec![[0, 4]]);
        assert_eq!(held[0].recent, vec![[33, 40]]);
        assert!(held[0].selected.is_empty() && held[0].kept.is_empty());
        // Within the budget: everything.
        st.truncate(11);
        let held = KvPolicy::<f32>::held(&StreamingPolicy::new(4, 8), 0, &st);
        assert_eq!(held, vec![Held::kept_range(0..11)]);
    }

    #[test]
    fn decode_keeps_sinks_and_recent_and_counts_them() {
        let d = 2;
        let st = store_of_40(d);
        let mut p = StreamingPolicy::new(4, 8);
        {
            let mut out = Vec::new();
            let call = AttnCall::decode(0, 39);
            KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
            assert_eq!(starts(&out[0], d), vec![(0, 4), (32, 8)]);
        }
        KvPolicy::<f32>::end_forward(&mut p, 39, 1);
        // Prefill and short sequences stay dense.
        {
            let mut out = Vec::new();
            let call = AttnCall {
                layer: 0,
                pos0: 0,
                n: 40,
                lo: 0,
                sliding: false,
            };
            KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
            assert_eq!(starts(&out[0], d), vec![(0, 40)]);
        }
        KvPolicy::<f32>::end_forward(&mut p, 0, 40);
        let s = KvPolicy::<f32>::stats(&p);
        assert_eq!((s.fast_steps, s.slow_steps), (1, 0));
        assert_eq!(s.attended_tokens, 12.0);
        assert_eq!(s.dense_tokens, 40.0);
        assert!((s.retained_fraction() - 0.3).abs() < 1e-12);
    }
}
