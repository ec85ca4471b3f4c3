//! The support-stability probe: dense attention (like `FullPolicy`) that also captures the
//! dense logits of every global-layer decode step, keeps each query head's top-k key set and
//! accumulates the Jaccard overlap of the sets of decode steps t and t + d, split into pairs
//! inside one sentence and pairs that straddle a sentence boundary (SFI's stability
//! observation, measured instead of assumed).
use std::collections::VecDeque;

use slowfast_backend::cpu::attention::KvSegment;

use crate::policy::{dense_segments, AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::store::{CacheElem, KvStore};

/// `|a ∩ b| / |a ∪ b|` of two sorted, duplicate-free lists (1 when both are empty).
pub fn jaccard(a: &[u32], b: &[u32]) -> f64 {
    let (mut i, mut j, mut inter) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                inter += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - inter;
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

/// The positions (`lo + index`) of the `k` largest finite entries of `row`, sorted by position.
/// Ties go to the older position. `idx` is scratch.
pub fn top_k_positions(row: &[f32], lo: usize, k: usize, idx: &mut Vec<u32>, out: &mut Vec<u32>) {
    idx.clear();
    idx.extend((0..row.len() as u32).filter(|&j| row[j as usize].is_finite()));
    let by_score = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if idx.len() > k {
        idx.select_nth_unstable_by(k, by_score);
        idx.truncate(k);
    }
    out.clear();
    out.extend(idx.iter().map(|&j| j + lo as u32));
    out.sort_unstable();
}

/// Sum and count of Jaccard samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Mean {
    pub sum: f64,
    pub count: usize,
}

impl Mean {
    pub fn add(&mut self, x: f64) {
        self.sum += x;
        self.count += 1;
    }
    /// The mean, or None without samples.
    pub fn get(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// Jaccard of consecutive decode steps for one (global layer, query head).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HeadStability {
    pub layer: usize,
    pub head: usize,
    pub within: Mean,
    pub across: Mean,
}

/// What the probe measured. Every pair of decode steps contributes one sample per (global
/// layer, query head).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StabilityStats {
    pub topk: usize,
    /// Decode steps with captured supports.
    pub steps: usize,
    /// Consecutive steps (d = 1) in the same sentence.
    pub within: Mean,
    /// Consecutive steps whose second query starts a new sentence.
    pub across: Mean,
    /// `(d, overlap of steps t and t + d)` for each distance asked for.
    pub by_distance: Vec<(usize, Mean)>,
    pub per_head: Vec<HeadStability>,
    /// Sentence boundaries crossed by the decode steps.
    pub boundaries: usize,
}

/// One decode step's supports: `sets[slot * n_heads + head]`, slot = index of the global
/// layer among those seen, and the sentence the step's query token belongs to.
#[derive(Debug, Clone)]
struct StepSupport {
    sentence: usize,
    sets: Vec<Vec<u32>>,
}

/// Dense attention with a top-k support recorder on global-layer decode steps.
#[derive(Debug)]
pub struct ProbePolicy {
    topk: usize,
    distances: Vec<usize>,
    is_ender: Vec<bool>,
    is_newline: Vec<bool>,
    /// Global layers in the order first seen.
    layers: Vec<usize>,
    n_heads: usize,
    history: VecDeque<StepSupport>,
    current: Option<StepSupport>,
    sentence: usize,
    after_ender: bool,
    idx: Vec<u32>,
    result: StabilityStats,
    stats: PolicyStats,
    step: StepCounter,
}

impl ProbePolicy {
    /// Record top-`topk` supports and compare steps `distances` apart (each ≥ 1). `enders` and
    /// `newlines` are the tokenizer's sentence-ender and newline-only ids: a query token
    /// starts a new sentence when it is the first token after an ender that is neither an
    /// ender nor a newline (the rule of SFI's sentence trigger).
    pub fn new(
        topk: usize,
        distances: &[usize],
        enders: &[u32],
        newlines: &[u32],
        vocab_size: usize,
    ) -> Result<Self, String> {
        if topk == 0 {
            return Err("top-k must be at least 1".into());
        }
        if let Some(bad) = distances.iter().find(|&&d| d == 0) {
            return Err(format!("distance {bad}: distances must be at least 1"));
        }
        let mut is_ender = vec![false; vocab_size];
        let mut is_newline = vec![false; vocab_size];
        for (ids, flags) in [(enders, &mut is_ender), (newlines, &mut is_newline)] {
            for &t in ids {
                *flags.get_mut(t as usize).ok_or_else(|| {
                    format!("token id {t} is outside the vocabulary of {vocab_size}")
                })? = true;
            }
        }
        let mut distances = distances.to_vec();
        if !distances.contains(&1) {
            distances.push(1);
        }
        distances.sort_unstable();
        distances.dedup();
        Ok(ProbePolicy {
            topk,
            is_ender,
            is_newline,
            layers: Vec::new(),
            n_heads: 0,
            history: VecDeque::new(),
            current: None,
            sentence: 0,
            after_ender: false,
            idx: Vec::new(),
            result: StabilityStats {
                topk,
                steps: 0,
                within: Mean::default(),
                across: Mean::default(),
                by_distance: distances.iter().map(|&d| (d, Mean::default())).collect(),
                per_head: Vec::new(),
                boundaries: 0,
            },
            distances,
            stats: PolicyStats::default(),
            step: StepCounter::default(),
        })
    }

    /// The overlaps measured so far.
    pub fn stability(&self) -> &StabilityStats {
        &self.result
    }

    /// One decode step's dense logits on global layer `layer`: `logits[head * len + j]` is
    /// query head `head`'s logit of key `lo + j` (any monotone scale: only the order counts).
    /// The CPU's `observe` and the GPU's slow-step capture (`eval --device cuda`) both call it.
    pub fn observe_row(&mut self, layer: usize, lo: usize, len: usize, logits: &[f32]) {
        if len == 0 || logits.len() < len {
            return;
        }
        let n_heads = logits.len() / len;
        self.n_heads = n_heads;
        let slot = self.slot(layer);
        let sentence = self.sentence;
        let cur = self.current.get_or_insert_with(|| StepSupport {
            sentence,
            sets: Vec::new(),
        });
        let need = (slot + 1) * n_heads;
        if cur.sets.len() < need {
            cur.sets.resize_with(need, Vec::new);
        }
        for (h, row) in logits.chunks_exact(len).enumerate() {
            top_k_positions(
                row,
                lo,
                self.topk,
                &mut self.idx,
                &mut cur.sets[slot * n_heads + h],
            );
        }
    }

    /// The decode step whose rows `observe_row` saw is over: compare it with the earlier ones.
    pub fn end_step(&mut self) {
        if let Some(cur) = self.current.take() {
            self.close_step(cur);
        }
    }

    /// The query token of the next decode step (sentence starts follow SFI's trigger rule).
    pub fn see_token(&mut self, token: u32) {
        let t = token as usize;
        let ender = self.is_ender.get(t).copied().unwrap_or(false);
        let newline = self.is_newline.get(t).copied().unwrap_or(false);
        if ender {
            self.after_ender = true;
        } else if self.after_ender && !newline {
            self.after_ender = false;
            self.sentence += 1;
            self.result.boundaries += 1;
        }
    }

    fn slot(&mut self, layer: usize) -> usize {
        match self.layers.iter().position(|&l| l == layer) {
            Some(s) => s,
            None => {
                self.layers.push(layer);
                self.layers.len() - 1
            }
        }
    }

    /// Compare a finished step with the remembered ones and remember it.
    fn close_step(&mut self, cur: StepSupport) {
        let max_d = *self.distances.last().expect("1 is always there");
        let nh = self.n_heads;
        if self.result.per_head.len() < cur.sets.len() {
            let have = self.result.per_head.len();
            self.result
                .per_head
                .extend((have..cur.sets.len()).map(|i| HeadStability {
                    layer: self.layers[i / nh],
                    head: i % nh,
                    within: Mean::default(),
                    across: Mean::default(),
                }));
        }
        for (di, &d) in self.distances.iter().enumerate() {
            let Some(prev) = self.history.len().checked_sub(d).map(|i| &self.history[i]) else {
                continue;
            };
            let same = prev.sentence == cur.sentence;
            for (i, (a, b)) in prev.sets.iter().zip(&cur.sets).enumerate() {
                let j = jaccard(a, b);
                self.result.by_distance[di].1.add(j);
                if d == 1 {
                    let h = &mut self.result.per_head[i];
                    if same {
                        self.result.within.add(j);
                        h.within.add(j);
                    } else {
                        self.result.across.add(j);
                        h.across.add(j);
                    }
                }
            }
        }
        self.result.steps += 1;
        self.history.push_back(cur);
        while self.history.len() > max_d {
            self.history.pop_front();
        }
    }
}

impl<T: CacheElem> KvPolicy<T> for ProbePolicy {
    fn name(&self) -> &'static str {
        "full"
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
        usize::from(call.is_decode() && !call.sliding)
    }

    fn observe(&mut self, call: &AttnCall, rows: usize, logits: &[f32], _store: &KvStore<T>) {
        if rows == 1 {
            self.observe_row(call.layer, call.lo, call.hi() - call.lo, logits);
        }
    }

    fn end_forward(&mut self, _pos0: usize, n: usize) {
        self.step.finish(&mut self.stats, true);
        if n == 1 {
            self.end_step();
        }
    }

    fn on_token(&mut self, token: u32) {
        self.see_token(token);
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
    fn jaccard_of_sorted_sets() {
        assert_eq!(jaccard(&[1, 2, 3], &[2, 3, 4]), 0.5);
        assert_eq!(jaccard(&[1, 2], &[1, 2]), 1.0);
        assert_eq!(jaccard(&[1], &[2]), 0.0);
        assert_eq!(jaccard(&[], &[]), 1.0);
        assert_eq!(jaccard(&[5], &[]), 0.0);
    }

    #[test]
    fn top_k_keeps_largest_finite_scores_and_breaks_ties_by_age() {
        let (mut idx, mut out) = (Vec::new(), Vec::new());
        let row = [0.5, 3.0, f32::NEG_INFINITY, 2.0, 3.0, -1.0];
        top_k_positions(&row, 10, 2, &mut idx, &mut out);
        assert_eq!(out, vec![11, 14]);
        top_k_positions(&row, 0, 3, &mut idx, &mut out);
        assert_eq!(out, vec![1, 3, 4]);
        // Ties: 1.0 at 0, 2, 3; the older two win.
        top_k_positions(&[1.0, 0.0, 1.0, 1.0], 0, 2, &mut idx, &mut out);
        assert_eq!(out, vec![0, 2]);
        // Fewer finite entries than k.
        top_k_positions(&[f32::NEG_INFINITY, 4.0], 0, 5, &mut idx, &mut out);
        assert_eq!(out, vec![1]);
    }

    fn store(len: usize) -> KvStore<f32> {
        let mut s = KvStore::<f32>::new(
            1,
            2,
            &[LayerSpec {
                capacity: 64,
                ring: false,
            }],
        );
        s.set_len(len);
        s
    }

    /// Feed one decode step: token, then 2 heads of hand-made logits over `len` keys whose
    /// top-2 are `a` (head 0) and `b` (head 1).
    fn feed(
        p: &mut ProbePolicy,
        st: &KvStore<f32>,
        token: u32,
        len: usize,
        a: [usize; 2],
        b: [usize; 2],
    ) {
        KvPolicy::<f32>::on_token(p, token);
        let call = AttnCall::decode(3, len - 1);
        assert_eq!(KvPolicy::<f32>::capture_rows(p, &call), 1);
        let mut logits = vec![0.0f32; 2 * len];
        for j in a {
            logits[j] = 5.0;
        }
        for j in b {
            logits[len + j] = 5.0;
        }
        p.observe(&call, 1, &logits, st);
        KvPolicy::<f32>::end_forward(p, len - 1, 1);
    }

    #[test]
    fn probe_splits_pairs_at_sentence_starts() {
        // Token 7 ends a sentence, 9 is a newline; anything else is a word.
        let mut p = ProbePolicy::new(2, &[1, 2], &[7], &[9], 16).unwrap();
        let st = store(10);
        // Step 0 (word), step 1 (".") in sentence 0; step 2 ("\n") still sentence 0; step 3
        // (word) starts sentence 1.
        feed(&mut p, &st, 1, 6, [0, 1], [2, 3]);
        feed(&mut p, &st, 7, 7, [0, 1], [2, 4]); // J = 1 (head 0), 1/3 (head 1): within
        feed(&mut p, &st, 9, 8, [0, 2], [2, 4]); // J = 1/3, 1: within
        feed(&mut p, &st, 3, 9, [5, 6], [2, 4]); // J = 0, 1: across
        let s = p.stability();
        assert_eq!(s.steps, 4);
        assert_eq!(s.boundaries, 1);
        assert_eq!(s.within.count, 4);
        let want_within = (1.0 + 1.0 / 3.0 + 1.0 / 3.0 + 1.0) / 4.0;
        assert!((s.within.get().unwrap() - want_within).abs() < 1e-12);
        assert_eq!(s.across.count, 2);
        assert!((s.across.get().unwrap() - 0.5).abs() < 1e-12);
        // d = 2: steps (0,2) -> 1/3, 1/3; (1,3) -> 0, 1.
        let (d, m) = s.by_distance[1];
        assert_eq!(d, 2);
        assert_eq!(m.count, 4);
        assert!((m.get().unwrap() - (2.0 / 3.0 + 1.0) / 4.0).abs() < 1e-12);
        // Per head: head 0 across = 0, head 1 across = 1; both are layer 3.
        assert_eq!(s.per_head.len(), 2);
        assert_eq!((s.per_head[0].layer, s.per_head[0].head), (3, 0));
        assert_eq!(s.per_head[0].across.get(), Some(0.0));
        assert_eq!(s.per_head[1].across.get(), Some(1.0));
    }

    #[test]
    fn probe_ignores_prefill_and_sliding_layers_and_checks_its_inputs() {
        let p = ProbePolicy::new(4, &[1], &[], &[], 8).unwrap();
        let prefill = AttnCall {
            layer: 0,
            pos0: 0,
            n: 8,
            lo: 0,
            sliding: false,
        };
        let sliding = AttnCall {
            sliding: true,
            ..AttnCall::decode(3, 9)
        };
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &prefill), 0);
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &sliding), 0);
        assert!(ProbePolicy::new(0, &[1], &[], &[], 8).is_err());
        assert!(ProbePolicy::new(4, &[0], &[], &[], 8)
            .unwrap_err()
            .contains("distance 0"));
        assert!(ProbePolicy::new(4, &[1], &[8], &[], 8)
            .unwrap_err()
            .contains("token id 8"));
    }
}
