//! Quest: query-aware page selection at decode. Each global layer's keys are cut into pages
//! of `page` tokens; per page and channel the key minimum and maximum are kept (updated as
//! tokens arrive). At each decode step a page's score is the upper bound
//! `Σ_i max(q_i·max_i, q_i·min_i)` of `q·k` over its keys, summed over the query heads of the
//! kv head's GQA group; the top `max(3, budget / page)` pages (the newest page always among
//! them) are attended exactly. Nothing is evicted (memory stays); the first `dense_layers`
//! layers, prefill and sliding-window layers stay dense.
use slowfast_backend::cpu::attention::{KvElem, KvSegment};

use crate::policy::{
    dense_segments, push_range, reset_out, sorted_runs, AttnCall, KvPolicy, PolicyStats,
    StepCounter,
};
use crate::score::top_k;
use crate::store::{CacheElem, KvStore};

/// Per-page key bounds of one kv head.
#[derive(Debug, Default, Clone)]
pub struct PageBounds {
    pub min: Vec<f32>, // [pages, head_dim]
    pub max: Vec<f32>, // [pages, head_dim]
    /// Tokens summarised (positions `0 .. tokens`).
    pub tokens: usize,
}

impl PageBounds {
    /// Bring the bounds up to date with positions `0 .. hi`, `key(t)` the key at position `t`
    /// (slot = position). The last, partial page is recomputed on every call.
    pub fn update<'a, T: KvElem + 'a>(
        &mut self,
        key: impl Fn(usize) -> &'a [T],
        hi: usize,
        page: usize,
        d: usize,
    ) {
        let first_page = self.tokens / page; // possibly partial before
        let pages = hi.div_ceil(page);
        self.min.resize(pages * d, f32::INFINITY);
        self.max.resize(pages * d, f32::NEG_INFINITY);
        for p in first_page..pages {
            let (mn, mx) = (
                &mut self.min[p * d..(p + 1) * d],
                &mut self.max[p * d..(p + 1) * d],
            );
            mn.fill(f32::INFINITY);
            mx.fill(f32::NEG_INFINITY);
            for t in p * page..((p + 1) * page).min(hi) {
                for (i, k) in key(t)[..d].iter().enumerate() {
                    let k = k.to_f32();
                    mn[i] = mn[i].min(k);
                    mx[i] = mx[i].max(k);
                }
            }
        }
        self.tokens = hi;
    }

    /// Upper bound of `q·k` over the keys of page `p`: `Σ_i max(q_i·min_i, q_i·max_i)`, summed
    /// in eight independent lanes (so it vectorises: SFI's cheaper slow step scores every page
    /// of the context with it).
    pub fn upper_bound(&self, p: usize, q: &[f32]) -> f32 {
        let d = q.len();
        let (mn, mx) = (&self.min[p * d..(p + 1) * d], &self.max[p * d..(p + 1) * d]);
        let mut acc = [0.0f32; 8];
        let (qc, nc, xc) = (q.chunks_exact(8), mn.chunks_exact(8), mx.chunks_exact(8));
        let tail: f32 = qc
            .remainder()
            .iter()
            .zip(nc.remainder().iter().zip(xc.remainder()))
            .map(|(&q, (&a, &b))| (q * a).max(q * b))
            .sum();
        for (q8, (n8, x8)) in qc.zip(nc.zip(xc)) {
            for i in 0..8 {
                let (a, b) = (q8[i] * n8[i], q8[i] * x8[i]);
                acc[i] += if a > b { a } else { b };
            }
        }
        acc.iter().sum::<f32>() + tail
    }
}

pub struct QuestPolicy {
    /// Tokens attended per kv head (rounded to pages, at least 3 pages).
    pub budget: usize,
    pub page: usize,
    pub dense_layers: usize,
    bounds: Vec<Vec<PageBounds>>, // [layer][kv head]
    q: Vec<f32>,                  // this decode step's query [n_heads, head_dim]
    scores: Vec<f32>,
    stats: PolicyStats,
    step: StepCounter,
}

impl QuestPolicy {
    /// Quest's defaults: pages of 16 tokens, the first two layers dense.
    pub fn new(budget: usize) -> Self {
        QuestPolicy {
            budget,
            page: 16,
            dense_layers: 2,
            bounds: Vec::new(),
            q: Vec::new(),
            scores: Vec::new(),
            stats: PolicyStats::default(),
            step: StepCounter::default(),
        }
    }

    /// Pages selected per step.
    pub fn pages(&self) -> usize {
        (self.budget / self.page).max(3)
    }
}

impl<T: CacheElem> KvPolicy<T> for QuestPolicy {
    fn name(&self) -> &'static str {
        "quest"
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
        reset_out(out, store.n_kv_heads);
        let (lo, hi, l) = (call.lo, call.hi(), call.layer);
        let (page, d, nkv) = (self.page, store.head_dim, store.n_kv_heads);
        let n_pages = hi.div_ceil(page);
        let sparse = call.is_decode()
            && !call.sliding
            && l >= self.dense_layers
            && !store.layer(l).is_compact()
            && lo == 0
            && hi - lo > self.budget
            && n_pages > self.pages()
            && self.q.len().is_multiple_of(nkv * d)
            && !self.q.is_empty();
        if !sparse {
            dense_segments(call, store, out, &mut self.step);
            return;
        }
        if self.bounds.len() <= l {
            self.bounds.resize_with(l + 1, Vec::new);
        }
        self.bounds[l].resize_with(nkv, PageBounds::default);
        let group = self.q.len() / d / nkv;
        let k_pages = self.pages();
        let mut attended = 0usize;
        for (h, o) in out.iter_mut().enumerate() {
            let b = &mut self.bounds[l][h];
            let rows = store.head(l, h);
            b.update(|t| rows.k(t), hi, page, d);
            self.scores.clear();
            for p in 0..n_pages {
                let s: f32 = (0..group)
                    .map(|g| {
                        let hq = h * group + g;
                        b.upper_bound(p, &self.q[hq * d..(hq + 1) * d])
                    })
                    .sum();
                self.scores.push(s);
            }
            // The newest page (holding the query's own key) is always read.
            self.scores[n_pages - 1] = f32::INFINITY;
            let mut picked = top_k(&self.scores, k_pages);
            picked.sort_unstable();
            // Adjacent pages become one segment.
            for r in sorted_runs(&picked) {
                let (a, z) = (r.start * page, (r.end * page).min(hi));
                attended += z - a;
                push_range(store, l, h, a..z, o);
            }
        }
        self.step.record(attended as f64 / nkv as f64, hi - lo);
        self.step.mark_sparse();
    }

    fn end_forward(&mut self, _pos0: usize, n: usize) {
        if n == 1 {
            self.step.finish_step(&mut self.stats);
        }
    }

    /// Prefill reads densely; page bounds come from the store when decode first needs them.
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

    #[test]
    fn page_bounds_bound_every_key_and_are_tight_for_one_key_pages() {
        let d = 8;
        let mut s = 12345u64;
        let mut rnd = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let keys: Vec<f32> = (0..50 * d).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..d).map(|_| rnd()).collect();
        let mut b = PageBounds::default();
        b.update(|t| &keys[t * d..(t + 1) * d], 37, 16, d);
        b.update(|t| &keys[t * d..(t + 1) * d], 50, 16, d); // incremental: page 2 recomputed, page 3 new
        let mut fresh = PageBounds::default();
        fresh.update(|t| &keys[t * d..(t + 1) * d], 50, 16, d);
        assert_eq!((&b.min, &b.max), (&fresh.min, &fresh.max));
        for t in 0..50 {
            let dot: f32 = q
                .iter()
                .zip(&keys[t * d..(t + 1) * d])
                .map(|(a, b)| a * b)
                .sum();
            assert!(b.upper_bound(t / 16, &q) >= dot - 1e-5);
        }
        let mut one = PageBounds::default();
        one.update(|t| &keys[t * d..(t + 1) * d], 3, 1, d);
        let dot: f32 = q.iter().zip(&keys[2 * d..3 * d]).map(|(a, b)| a * b).sum();
        assert!((one.upper_bound(2, &q) - dot).abs() < 1e-5);
    }

    #[test]
    fn decode_reads_the_top_pages_and_the_newest() {
        let d = 2;
        let mut st = KvStore::<f32>::new(
            1,
            d,
            &[LayerSpec {
                capacity: 128,
                ring: false,
            }],
        );
        let mut kv = vec![0.0f32; 65 * d];
        for t in 52..56 {
            kv[t * d] = 10.0; // page 3 holds keys along the query
        }
        st.write(0, 0, &kv, &kv).unwrap();
        st.set_len(65);
        let mut p = QuestPolicy::new(48); // 3 pages
        p.dense_layers = 0;
        let call = AttnCall::decode(0, 64);
        // Two query heads sharing the kv head.
        KvPolicy::<f32>::query(&mut p, &call, &[1.0, 0.0, 0.5, 0.0]);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        let got = crate::policy::range_runs(&out[0], d);
        // Page 3 (the bound), page 0 (first of the zero-bound ties), page 4 (newest).
        assert_eq!(got, vec![(0, 16), (48, 17)]);
        drop(out);
        KvPolicy::<f32>::end_forward(&mut p, 64, 1);
        let s = KvPolicy::<f32>::stats(&p);
        assert_eq!(
            (s.fast_steps, s.attended_tokens, s.dense_tokens),
            (1, 33.0, 65.0)
        );
        // A budget covering the context reads everything.
        let mut p = QuestPolicy::new(80);
        p.dense_layers = 0;
        let mut out = Vec::new();
        KvPolicy::<f32>::query(&mut p, &call, &[1.0, 0.0, 0.5, 0.0]);
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        assert_eq!(crate::policy::range_runs(&out[0], d), vec![(0, 65)]);
    }
}
