//! Diagnostic only: an oracle upper bound for fixed-budget KV selection, not a deployable
//! policy (it reads every key at every step to decide what to read). At each decode step of a
//! global layer it computes the current query's exact dense attention and keeps, per kv head,
//! the `budget` keys with the most attention mass summed over the query heads of the kv head's
//! GQA group (the selection a per-kv-head policy such as SFI could at best make at that step).
//! With `recent > 0` it keeps SFI's layout instead: `sinks` + the `recent` newest + the exact
//! top of the rest, `budget` in all. With `every > 1` it reselects only every `every` decode
//! steps and reuses the chosen keys in between while the recent window grows, as SFI does
//! (what staleness alone costs). Prefill, sliding-window and compacted layers stay dense.
use slowfast_backend::cpu::attention::KvSegment;

use crate::inspect::Held as HeldPositions;
use crate::policy::{
    dense_segments, push_range, reset_out, sorted_runs, AttnCall, KvPolicy, PolicyStats,
    StepCounter,
};
use crate::score::top_k;
use crate::store::{CacheElem, KvStore};

#[derive(Debug, Clone, PartialEq)]
pub struct OracleConfig {
    /// Keys attended per kv head (sinks and recent window included).
    pub budget: usize,
    /// Layout: 0 = the exact top `budget` keys anywhere; else `sinks` first tokens and the
    /// `recent` newest are always kept and the top of the rest fills the budget.
    pub sinks: usize,
    pub recent: usize,
    /// Softmax scale of `q·k` (the model's attention scale).
    pub scale: f32,
    /// Reselect every this many decode steps (1: every step); in between the chosen keys are
    /// reused and the newer keys (from the window's start at selection) are read as well.
    pub every: usize,
}

/// The oracle's rules, the same on both devices (the CPU's `OraclePolicy`, the GPU's
/// `GpuKvPolicy::Oracle`): the layout of the budget and when to select again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OracleRule {
    pub budget: usize,
    pub sinks: usize,
    pub recent: usize,
    pub every: usize,
}

impl OracleRule {
    /// Errors naming the bad knob.
    pub fn check(&self) -> Result<(), String> {
        if self.every == 0 {
            return Err("oracle: the reselection period must be at least 1".into());
        }
        if self.recent > 0 && self.sinks + self.recent >= self.budget {
            return Err(format!(
                "oracle: the budget ({}) must exceed sinks + recent ({})",
                self.budget,
                self.sinks + self.recent
            ));
        }
        Ok(())
    }

    /// (always-kept first keys, always-kept newest keys, keys chosen from the rest): with
    /// `recent` = 0 ("oracle") the whole budget is chosen from every key.
    pub fn layout(&self) -> (usize, usize, usize) {
        let (sinks, recent) = if self.recent > 0 {
            (self.sinks, self.recent)
        } else {
            (0, 0)
        };
        (sinks, recent, self.budget - sinks - recent)
    }

    /// Whether a sequence of `len` keys (the current token's included) reads sparsely: a
    /// budget smaller than what it holds.
    pub fn sparse_at(&self, len: usize) -> bool {
        len > self.budget
    }

    /// Whether a sparse step selects afresh, given the sparse steps since the last selection
    /// (None: no selection yet).
    pub fn reselects(&self, age: Option<usize>) -> bool {
        age.is_none_or(|a| a >= self.every)
    }

    /// The candidates `[lo, hi)` of a selection at length `len`: after the first keys, before
    /// the newest; later steps read the picks and every key from `hi` on.
    pub fn domain(&self, len: usize) -> (usize, usize) {
        let (sinks, recent, _) = self.layout();
        (sinks, len - recent)
    }
}

/// One layer's chosen keys between reselections.
struct Held {
    /// Per kv head: the kept positions below `recent_from`, ascending.
    picks: Vec<Vec<usize>>,
    recent_from: usize,
    age: usize,
}

pub struct OraclePolicy<T> {
    cfg: OracleConfig,
    q: Vec<f32>,
    row: Vec<f32>,
    logits: Vec<f32>,
    scores: Vec<f32>,
    held: Vec<Option<Held>>,
    stats: PolicyStats,
    step: StepCounter,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl OracleConfig {
    /// The rules of the layout and the reselection (shared with the GPU).
    pub fn rule(&self) -> OracleRule {
        OracleRule {
            budget: self.budget,
            sinks: self.sinks,
            recent: self.recent,
            every: self.every,
        }
    }
}

impl<T: CacheElem> OraclePolicy<T> {
    pub fn new(cfg: OracleConfig) -> Result<Self, String> {
        cfg.rule().check()?;
        Ok(OraclePolicy {
            cfg,
            q: Vec::new(),
            row: Vec::new(),
            logits: Vec::new(),
            scores: Vec::new(),
            held: Vec::new(),
            stats: PolicyStats::default(),
            step: StepCounter::default(),
            _t: std::marker::PhantomData,
        })
    }

    /// Positions `lo .. hi` scored by the group's summed attention probability over
    /// positions `0 .. hi` (the dense softmax), for kv head `h` of `layer`; into `self.scores`
    /// (index j - lo).
    fn score(&mut self, store: &KvStore<T>, layer: usize, h: usize, hi: usize, lo: usize) {
        let d = store.head_dim;
        let g = self.q.len() / d / store.n_kv_heads;
        let rows = store.head(layer, h);
        self.logits.resize(g * hi, 0.0);
        self.row.resize(d, 0.0);
        for j in 0..hi {
            T::load(rows.k(j), &mut self.row);
            for gi in 0..g {
                let hq = h * g + gi;
                let q = &self.q[hq * d..(hq + 1) * d];
                let dot: f32 = q.iter().zip(&self.row).map(|(a, b)| a * b).sum();
                self.logits[gi * hi + j] = dot * self.cfg.scale;
            }
        }
        self.scores.clear();
        self.scores.resize(hi - lo, 0.0);
        for gi in 0..g {
            let z = &self.logits[gi * hi..(gi + 1) * hi];
            let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = z.iter().map(|&x| ((x - m) as f64).exp()).sum();
            let lse = m as f64 + sum.ln();
            for (s, &x) in self.scores.iter_mut().zip(&z[lo..hi]) {
                *s += (x as f64 - lse).exp() as f32;
            }
        }
    }
}

impl<T: CacheElem> KvPolicy<T> for OraclePolicy<T> {
    fn name(&self) -> &'static str {
        if self.cfg.recent > 0 {
            "oracle-sfi"
        } else {
            "oracle"
        }
    }

    fn query(&mut self, call: &AttnCall, q: &[f32]) {
        if call.is_decode() {
            self.q.clear();
            self.q.extend_from_slice(q);
        }
    }

    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    ) {
        let nkv = store.n_kv_heads;
        reset_out(out, nkv);
        let (lo, hi, l) = (call.lo, call.hi(), call.layer);
        let d = store.head_dim;
        let sparse = call.is_decode()
            && !call.sliding
            && lo == 0
            && !store.layer(l).is_compact()
            && self.cfg.rule().sparse_at(hi)
            && !self.q.is_empty()
            && self.q.len().is_multiple_of(nkv * d);
        if !sparse {
            dense_segments(call, store, out, &mut self.step);
            return;
        }
        if self.held.len() <= l {
            self.held.resize_with(l + 1, || None);
        }
        let rule = self.cfg.rule();
        if rule.reselects(self.held[l].as_ref().map(|hd| hd.age)) {
            // Always-kept ranges and the candidate domain [a, z).
            let (sinks, _, k) = rule.layout();
            let (a, z) = rule.domain(hi);
            let mut picks = Vec::with_capacity(nkv);
            for h in 0..nkv {
                self.score(store, l, h, hi, a);
                self.scores.truncate(z - a);
                let mut p: Vec<usize> = (0..sinks)
                    .chain(top_k(&self.scores, k).into_iter().map(|j| j + a))
                    .collect();
                p.sort_unstable();
                picks.push(p);
            }
            self.held[l] = Some(Held {
                picks,
                recent_from: z,
                age: 0,
            });
        }
        let hd = self.held[l].as_mut().expect("set above");
        hd.age += 1;
        let mut attended = 0;
        for (h, o) in out.iter_mut().enumerate() {
            let picked = &hd.picks[h];
            for r in sorted_runs(picked) {
                push_range(store, l, h, r, o);
            }
            push_range(store, l, h, hd.recent_from..hi, o);
            attended += picked.len() + hi - hd.recent_from;
        }
        self.step.record(attended as f64 / nkv as f64, hi - lo);
        self.step.mark_sparse();
    }

    fn end_forward(&mut self, _pos0: usize, n: usize) {
        if n == 1 {
            self.step.finish_step(&mut self.stats);
        }
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }

    /// After a selection: the sinks, the picks and every key from the candidates' end on
    /// (what the next step reads besides its own token); before one, every key, kept.
    fn held(&self, layer: usize, store: &KvStore<T>) -> Vec<HeldPositions> {
        let Some(hd) = self.held.get(layer).and_then(|h| h.as_ref()) else {
            return (0..store.n_kv_heads)
                .map(|h| HeldPositions::kept_slots(&store.slot_positions(layer, h)))
                .collect();
        };
        let (sinks, _, _) = self.cfg.rule().layout();
        hd.picks
            .iter()
            .map(|p| {
                let sel: Vec<u32> = p.iter().map(|&x| x as u32).collect();
                HeldPositions::with_roles(0..sinks, &sel, hd.recent_from..store.len())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;
    use slowfast_backend::cpu::attention::KvPositions;

    /// One kv head, head_dim 2: key j = (1, 0) scaled by `w[j]`; query heads (1, 0), so the
    /// attention logit of key j is `w[j]`.
    fn setup(w: &[f32], g: usize) -> (KvStore<f32>, Vec<f32>) {
        let d = 2;
        let mut s = KvStore::<f32>::new(
            1,
            d,
            &[LayerSpec {
                capacity: w.len() + 4,
                ring: false,
            }],
        );
        let k: Vec<f32> = w.iter().flat_map(|&x| [x, 0.0]).collect();
        s.write(0, 0, &k, &k).unwrap();
        s.set_len(w.len());
        let q: Vec<f32> = (0..g).flat_map(|_| [1.0f32, 0.0]).collect();
        (s, q)
    }

    fn positions(segs: &[KvSegment<'_, f32>], d: usize) -> Vec<usize> {
        segs.iter()
            .flat_map(|s| match s.pos {
                KvPositions::Range { start } => {
                    (start as usize..start as usize + s.len(d)).collect::<Vec<_>>()
                }
                KvPositions::List(p) => p.iter().map(|&x| x as usize).collect(),
            })
            .collect()
    }

    /// The positions `p` attends for `call` with query `q`, and how many segments they form.
    fn attend(
        p: &mut OraclePolicy<f32>,
        st: &KvStore<f32>,
        call: &AttnCall,
        q: &[f32],
    ) -> (Vec<usize>, usize) {
        p.query(call, q);
        let mut out = Vec::new();
        p.segments(call, st, &mut out);
        (positions(&out[0], 2), out[0].len())
    }

    #[test]
    fn keeps_the_exact_top_keys_of_the_current_query() {
        let mut w = vec![0.0f32; 40];
        for (j, x) in [(3, 5.0), (17, 4.0), (18, 6.0), (30, 3.0)] {
            w[j] = x;
        }
        let (st, q) = setup(&w, 2);
        let cfg = OracleConfig {
            budget: 4,
            sinks: 0,
            recent: 0,
            scale: 1.0,
            every: 1,
        };
        let mut p = OraclePolicy::<f32>::new(cfg).unwrap();
        let (got, segments) = attend(&mut p, &st, &AttnCall::decode(0, 39), &q);
        assert_eq!(got, vec![3, 17, 18, 30]);
        // Adjacent picks form one segment.
        assert_eq!(segments, 3);
        assert_eq!(KvPolicy::<f32>::name(&p), "oracle");
    }

    #[test]
    fn sfi_layout_keeps_sinks_and_recent_and_fills_the_rest_exactly() {
        let mut w = vec![0.0f32; 64];
        for (j, x) in [(5, 2.0), (9, 7.0), (20, 6.0), (60, 9.0)] {
            w[j] = x;
        }
        let (st, q) = setup(&w, 1);
        let cfg = OracleConfig {
            budget: 2 + 2 + 8,
            sinks: 2,
            recent: 8,
            scale: 1.0,
            every: 1,
        };
        let mut p = OraclePolicy::<f32>::new(cfg).unwrap();
        let call = AttnCall::decode(0, 63);
        let mut want = vec![0, 1, 9, 20];
        want.extend(56..64);
        assert_eq!(attend(&mut p, &st, &call, &q).0, want);
        // Prefill and short sequences stay dense.
        let pre = AttnCall {
            n: 4,
            pos0: 60,
            ..call
        };
        let mut out2 = Vec::new();
        p.segments(&pre, &st, &mut out2);
        assert_eq!(positions(&out2[0], 2), (0..64).collect::<Vec<_>>());
        assert!(OraclePolicy::<f32>::new(OracleConfig {
            budget: 10,
            sinks: 2,
            recent: 8,
            scale: 1.0,
            every: 1,
        })
        .is_err());
    }

    #[test]
    fn held_reports_the_last_selection_by_role() {
        let mut w = vec![0.0f32; 64];
        for (j, x) in [(9, 7.0), (20, 6.0)] {
            w[j] = x;
        }
        let (st, q) = setup(&w, 1);
        let cfg = OracleConfig {
            budget: 12,
            sinks: 2,
            recent: 8,
            scale: 1.0,
            every: 1,
        };
        let mut p = OraclePolicy::<f32>::new(cfg).unwrap();
        // Before a selection: everything, kept.
        assert_eq!(KvPolicy::held(&p, 0, &st)[0].kept, vec![[0, 64]]);
        attend(&mut p, &st, &AttnCall::decode(0, 63), &q);
        let h = &KvPolicy::held(&p, 0, &st)[0];
        assert_eq!(h.sinks, vec![[0, 2]]);
        assert_eq!(h.selected, vec![[9, 10], [20, 21]]);
        assert_eq!(h.recent, vec![[56, 64]]);
        assert!(h.kept.is_empty());
    }

    #[test]
    fn the_rule_splits_the_budget_and_counts_steps() {
        let exact = OracleRule {
            budget: 64,
            sinks: 4,
            recent: 0,
            every: 1,
        };
        // Without a recent window the whole budget is chosen from every key (sinks ignored).
        assert_eq!(exact.layout(), (0, 0, 64));
        assert_eq!(exact.domain(100), (0, 100));
        assert!(!exact.sparse_at(64) && exact.sparse_at(65));
        let sfi = OracleRule {
            recent: 16,
            every: 4,
            ..exact
        };
        assert_eq!(sfi.layout(), (4, 16, 44));
        assert_eq!(sfi.domain(100), (4, 84));
        assert!(sfi.reselects(None) && !sfi.reselects(Some(3)) && sfi.reselects(Some(4)));
        assert!(OracleRule { every: 0, ..sfi }.check().is_err());
        assert!(OracleRule { budget: 20, ..sfi }.check().is_err());
        assert!(sfi.check().is_ok());
    }

    #[test]
    fn a_reselection_period_reuses_the_picks_and_grows_the_recent_window() {
        let mut w = vec![0.0f32; 50];
        for (j, x) in [(3, 5.0), (17, 4.0), (30, 3.0)] {
            w[j] = x;
        }
        let (st, q) = setup(&w, 1);
        let mut p = OraclePolicy::<f32>::new(OracleConfig {
            budget: 2,
            sinks: 0,
            recent: 0,
            scale: 1.0,
            every: 2,
        })
        .unwrap();
        let mut got = Vec::new();
        for pos0 in [39, 40, 41] {
            // The second step's query prefers key 30: ignored until the reselection.
            let q2: Vec<f32> = if pos0 == 40 {
                vec![-1.0, 0.0]
            } else {
                q.clone()
            };
            got.push(attend(&mut p, &st, &AttnCall::decode(0, pos0), &q2).0);
        }
        assert_eq!(got[0], vec![3, 17]);
        assert_eq!(got[1], vec![3, 17, 40]);
        assert_eq!(got[2], vec![3, 17]);
        let st = KvPolicy::<f32>::stats(&p);
        assert_eq!(
            st.fast_steps, 0,
            "end_forward not called: nothing closed yet"
        );
    }
}
