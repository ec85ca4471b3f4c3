//! H2O (heavy hitters + recent window): per kv head of each global layer, every key's score is
//! the softmax attention it received, summed over all queries so far (all prompt rows, then
//! each decode step) and over the query heads of its GQA group. Whenever a head holds more
//! than `heavy + recent` keys, it keeps the `recent` newest and the `heavy` best-scored older
//! keys: at the end of prefill the store is compacted (memory freed), then each decode step
//! evicts the lowest-scored non-recent key (its slot is reused). Sliding layers keep their ring.
use slowfast_backend::cpu::attention::KvSegment;

use crate::inspect::Held;
use crate::policy::dense_segments;
use crate::policy::{AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::score::{accumulate_probs, group_sum, keys_per_head, top_k};
use crate::store::{CacheElem, KvError, KvStore};

/// Free slots per head left after the first compaction (decode appends one token per step,
/// then evicts one).
const HEADROOM: usize = 16;

pub struct H2oPolicy {
    pub heavy: usize,
    pub recent: usize,
    /// Per layer, per kv head: accumulated score of each slot.
    scores: Vec<Option<Vec<Vec<f32>>>>,
    stats: PolicyStats,
    step: StepCounter,
    evicted: usize,
}

impl H2oPolicy {
    /// A budget of `heavy + recent` keys per kv head.
    pub fn new(heavy: usize, recent: usize) -> Result<Self, String> {
        if recent == 0 {
            return Err("H2O needs a recent window of at least one token".into());
        }
        Ok(H2oPolicy {
            heavy,
            recent,
            scores: Vec::new(),
            stats: PolicyStats::default(),
            step: StepCounter::default(),
            evicted: 0,
        })
    }

    /// Half heavy hitters, half recent window (H2O's default ratios are equal).
    pub fn with_budget(budget: usize) -> Result<Self, String> {
        let heavy = budget / 2;
        Self::new(heavy, budget - heavy)
    }

    /// Keys evicted so far (all layers and heads).
    pub fn evicted(&self) -> usize {
        self.evicted
    }

    /// Bring every scored layer back to the budget.
    fn enforce<T: CacheElem>(&mut self, store: &mut KvStore<T>) -> Result<(), KvError> {
        let budget = self.heavy + self.recent;
        let len = store.len();
        let recent_from = len.saturating_sub(self.recent) as u32;
        for l in 0..self.scores.len() {
            let Some(sc) = self.scores[l].as_mut() else {
                continue;
            };
            let nkv = store.n_kv_heads;
            if (0..nkv).all(|h| store.held(l, h) <= budget) {
                continue;
            }
            if !store.layer(l).is_compact() {
                // First eviction: keep the recent window and the heavy hitters, compact.
                let mut keep = Vec::with_capacity(nkv);
                for (h, s) in sc.iter().enumerate() {
                    let pos = store.slot_positions(l, h);
                    let old: Vec<usize> =
                        (0..pos.len()).filter(|&i| pos[i] < recent_from).collect();
                    let old_scores: Vec<f32> = old
                        .iter()
                        .map(|&i| s.get(i).copied().unwrap_or(0.0))
                        .collect();
                    let mut k: Vec<usize> = top_k(&old_scores, self.heavy)
                        .into_iter()
                        .map(|j| old[j])
                        .collect();
                    k.extend((0..pos.len()).filter(|&i| pos[i] >= recent_from));
                    // The store orders kept slots by position; mirror that for the scores.
                    k.sort_unstable_by_key(|&i| pos[i]);
                    self.evicted += pos.len() - k.len();
                    keep.push(k);
                }
                let headroom = HEADROOM.min(store.layer(l).limit() - store.held(l, 0));
                store.compact(l, &keep, headroom)?;
                for (s, k) in sc.iter_mut().zip(&keep) {
                    *s = k
                        .iter()
                        .map(|&i| s.get(i).copied().unwrap_or(0.0))
                        .collect();
                }
                continue;
            }
            for (h, s) in sc.iter_mut().enumerate() {
                s.resize(store.held(l, h), 0.0);
                while store.held(l, h) > budget {
                    let pos = store.slot_positions(l, h);
                    let victim = (0..pos.len())
                        .filter(|&i| pos[i] < recent_from)
                        .min_by(|&a, &b| s[a].total_cmp(&s[b]).then(pos[a].cmp(&pos[b])));
                    let Some(victim) = victim else { break };
                    store.evict_slot(l, h, victim)?;
                    s.swap_remove(victim);
                    self.evicted += 1;
                }
            }
        }
        Ok(())
    }
}

impl<T: CacheElem> KvPolicy<T> for H2oPolicy {
    fn name(&self) -> &'static str {
        "h2o"
    }

    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    ) {
        dense_segments(call, store, out, &mut self.step);
    }

    /// Every row of global layers: prefill rows and each decode step add to the scores.
    fn capture_rows(&self, call: &AttnCall) -> usize {
        if call.sliding {
            0
        } else {
            call.n
        }
    }

    fn observe(&mut self, call: &AttnCall, rows: usize, logits: &[f32], store: &KvStore<T>) {
        if self.scores.len() <= call.layer {
            self.scores.resize_with(call.layer + 1, || None);
        }
        let keys = keys_per_head(call, store);
        let mut per_q = Vec::new();
        accumulate_probs(logits, rows, &keys, &mut per_q);
        let add = group_sum(&per_q, store.n_kv_heads);
        let sc = self.scores[call.layer].get_or_insert_with(|| vec![Vec::new(); store.n_kv_heads]);
        for (s, a) in sc.iter_mut().zip(add) {
            // Slot i of the read is slot i of the store (dense read of what the head holds).
            if s.len() < a.len() {
                s.resize(a.len(), 0.0);
            }
            for (x, y) in s.iter_mut().zip(a) {
                *x += y;
            }
        }
    }

    fn end_forward(&mut self, _pos0: usize, n: usize) {
        if n == 1 {
            self.step.finish(&mut self.stats, false);
        }
    }

    fn end_prefill(&mut self, store: &mut KvStore<T>) -> Result<(), KvError> {
        self.enforce(store)
    }

    fn end_step(&mut self, store: &mut KvStore<T>) -> Result<(), KvError> {
        self.enforce(store)
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }

    /// Once the layer is over budget and compacted: the heavy hitters (selected) and the
    /// `recent` newest keys; before that everything, kept.
    fn held(&self, layer: usize, store: &KvStore<T>) -> Vec<Held> {
        let len = store.len();
        let recent_from = len.saturating_sub(self.recent);
        (0..store.n_kv_heads)
            .map(|h| {
                let pos = store.slot_positions(layer, h);
                if !store.layer(layer).is_compact() {
                    return Held::kept_slots(&pos);
                }
                let heavy: Vec<u32> = pos
                    .iter()
                    .copied()
                    .filter(|&p| (p as usize) < recent_from)
                    .collect();
                let recent = pos
                    .iter()
                    .map(|&p| p as usize)
                    .filter(|&p| p >= recent_from)
                    .min()
                    .map_or(len..len, |first| first..len);
                Held::with_roles(0..0, &heavy, recent)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;

    fn call(pos0: usize, n: usize) -> AttnCall {
        AttnCall {
            layer: 0,
            pos0,
            n,
            lo: 0,
            sliding: false,
        }
    }

    /// Logits of one row for 2 query heads (one kv head) with `hot` keys at logit 6.
    fn row(keys: usize, hot0: &[usize], hot1: &[usize]) -> Vec<f32> {
        let mut l = vec![0.0f32; 2 * keys];
        for &k in hot0 {
            l[k] = 6.0;
        }
        for &k in hot1 {
            l[keys + k] = 6.0;
        }
        l
    }

    #[test]
    fn keeps_heavy_hitters_and_recent_then_evicts_each_step() {
        let (nkv, d, cap) = (1, 2, 64);
        let mut st = KvStore::<f32>::with_block(
            nkv,
            d,
            &[LayerSpec {
                capacity: cap,
                ring: false,
            }],
            16,
        );
        let kv: Vec<f32> = (0..10 * d).map(|i| (i / d) as f32).collect();
        st.write(0, 0, &kv, &kv).unwrap();
        st.set_len(10);
        let full_bytes = st.nbytes();
        let mut p = H2oPolicy::new(2, 2).unwrap();
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &call(0, 10)), 10);
        // One captured row: head 0 attends to 3, head 1 to 6 and (a little) 1.
        let mut l = row(10, &[3], &[6]);
        l[10 + 1] = 3.0;
        p.observe(&call(9, 1), 1, &l, &st);
        p.end_prefill(&mut st).unwrap();
        assert_eq!(st.slot_positions(0, 0), vec![3, 6, 8, 9]);
        assert_eq!(p.evicted(), 6);
        // 4 kept + 16 headroom slots instead of 64.
        assert_eq!(st.nbytes(), 2 * 20 * nkv * d * 4);
        assert_eq!(
            full_bytes,
            2 * 16 * nkv * d * 4,
            "10 tokens hold one block of 16"
        );
        // Decode position 10: it attends strongly to 8, which leaves the recent window now.
        let kv = vec![10.0f32; d];
        st.write(0, 10, &kv, &kv).unwrap();
        st.set_len(11);
        // Read order = slot order: [3, 6, 8, 9, 10]
        let l = row(5, &[2], &[2]);
        p.observe(&call(10, 1), 1, &l, &st);
        p.end_step(&mut st).unwrap();
        let mut kept = st.slot_positions(0, 0);
        kept.sort();
        // 3 and 6 both scored about 1 at prefill, but head 1 gave some of its mass to key 1,
        // so 6 is the lowest-scored key outside the recent window (9, 10).
        assert_eq!(kept, vec![3, 8, 9, 10]);
        assert_eq!(st.held(0, 0), 4, "budget honoured exactly");
        assert_eq!(p.evicted(), 7);
        // Inspection: the heavy hitters as selected, the two newest as the recent window.
        let held = KvPolicy::<f32>::held(&p, 0, &st);
        assert_eq!(held.len(), nkv);
        assert_eq!(held[0].selected, vec![[3, 4], [8, 9]]);
        assert_eq!(held[0].recent, vec![[9, 11]]);
        assert!(held[0].sinks.is_empty() && held[0].kept.is_empty());
    }

    #[test]
    fn budget_above_the_length_evicts_nothing() {
        let mut st = KvStore::<f32>::new(
            1,
            2,
            &[LayerSpec {
                capacity: 32,
                ring: false,
            }],
        );
        let kv = vec![1.0f32; 10 * 2];
        st.write(0, 0, &kv, &kv).unwrap();
        st.set_len(10);
        let bytes = st.nbytes();
        let mut p = H2oPolicy::with_budget(10).unwrap();
        p.observe(&call(9, 1), 1, &row(10, &[1], &[2]), &st);
        p.end_prefill(&mut st).unwrap();
        assert!(!st.layer(0).is_compact());
        assert_eq!(st.nbytes(), bytes);
        // Nothing evicted: the inspection shows everything, kept.
        let held = KvPolicy::<f32>::held(&p, 0, &st);
        assert_eq!(held, vec![crate::inspect::Held::kept_range(0..10)]);
        assert!(H2oPolicy::new(3, 0).is_err());
    }
}
