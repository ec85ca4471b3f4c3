//! The KV-policy seam: a policy decides which cached positions each layer's attention reads
//! at each step, and hears about steps and tokens. Models never name a policy; the attention
//! step of `slowfast-model` asks the policy for each kv head's segments.
use std::ops::Range;

use slowfast_backend::cpu::attention::KvSegment;

use crate::inspect::{Held, SlowLog};
use crate::store::{CacheElem, KvError, KvStore};

/// Counters every policy reports (for `generate --json`, eval and bench).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PolicyStats {
    /// Decode steps that attended to everything (dense).
    pub slow_steps: usize,
    /// Decode steps that attended to a subset.
    pub fast_steps: usize,
    /// Sum over decode steps of the keys attended, averaged over global layers and kv heads.
    pub attended_tokens: f64,
    /// Sum over decode steps of the keys a dense step would have attended (same averaging).
    pub dense_tokens: f64,
}

impl PolicyStats {
    /// Mean keys attended per decode step.
    pub fn mean_attended(&self) -> f64 {
        let steps = self.slow_steps + self.fast_steps;
        if steps == 0 {
            0.0
        } else {
            self.attended_tokens / steps as f64
        }
    }
    /// Attended over dense keys, over all decode steps (1 for full KV).
    pub fn retained_fraction(&self) -> f64 {
        if self.dense_tokens == 0.0 {
            1.0
        } else {
            self.attended_tokens / self.dense_tokens
        }
    }
}

/// Accumulates one decode step's attended/dense key counts over the global layers, then adds
/// the per-layer means to `PolicyStats` when the step ends.
#[derive(Debug, Default, Clone)]
pub struct StepCounter {
    attended: f64,
    dense: f64,
    layers: usize,
    /// Some layer of this step read a sparse memory.
    sparse: bool,
}

impl StepCounter {
    /// One global layer of a decode step: mean keys attended per kv head, and what dense
    /// attention would read.
    pub fn record(&mut self, attended: f64, dense: usize) {
        self.attended += attended;
        self.dense += dense as f64;
        self.layers += 1;
    }
    /// This step read a sparse memory on some layer: [`StepCounter::finish_step`] counts it fast.
    pub fn mark_sparse(&mut self) {
        self.sparse = true;
    }
    /// Close the step as fast if a layer was marked sparse, else as slow (dense).
    pub fn finish_step(&mut self, stats: &mut PolicyStats) {
        let slow = !self.sparse;
        self.finish(stats, slow);
    }
    /// Close the step (if any layer was recorded) as slow or fast.
    pub fn finish(&mut self, stats: &mut PolicyStats, slow: bool) {
        if self.layers > 0 {
            let l = self.layers as f64;
            stats.attended_tokens += self.attended / l;
            stats.dense_tokens += self.dense / l;
            if slow {
                stats.slow_steps += 1;
            } else {
                stats.fast_steps += 1;
            }
        }
        *self = StepCounter::default();
    }
}

/// What one layer's attention call covers.
#[derive(Debug, Clone, Copy)]
pub struct AttnCall {
    pub layer: usize,
    /// Query rows are at positions `pos0 .. pos0 + n` (n = 1 in decode).
    pub pos0: usize,
    pub n: usize,
    /// Oldest position the layer's mask lets any row see (sliding window), else 0.
    pub lo: usize,
    /// True for sliding-window layers (policies leave their window alone).
    pub sliding: bool,
}

impl AttnCall {
    pub fn is_decode(&self) -> bool {
        self.n == 1
    }
    /// One past the newest position.
    pub fn hi(&self) -> usize {
        self.pos0 + self.n
    }

    /// A one-token decode call of a global (not sliding-window) layer at `pos0`; the tests'
    /// shorthand.
    #[cfg(test)]
    pub(crate) fn decode(layer: usize, pos0: usize) -> Self {
        AttnCall {
            layer,
            pos0,
            n: 1,
            lo: 0,
            sliding: false,
        }
    }
}

/// A KV policy over a cache of element type `T`.
pub trait KvPolicy<T: CacheElem>: Send {
    fn name(&self) -> &'static str;

    /// The call's query rows (`[n, n_heads, head_dim]`, after RoPE), handed over just before
    /// `segments`. Query-aware policies (Quest) read them here; others ignore them.
    fn query(&mut self, _call: &AttnCall, _q: &[f32]) {}

    /// Fill `out[h]` with the segments kv head `h` attends to in this call (in key order).
    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    );

    /// How many of this call's last query rows should have their attention logits captured
    /// and handed to `observe` (0: none). The logits cover the keys `segments` returns, in
    /// order: positions `lo .. hi` when the segments are dense, as every policy's refresh
    /// needs; SFI's drift trigger also captures its sparse fast steps.
    fn capture_rows(&self, _call: &AttnCall) -> usize {
        0
    }

    /// The captured logits of the last `rows` query rows: `[n_heads, rows, keys]`, raw
    /// scaled `q·k` with -inf where the causal mask hides a key. `keys` is `hi - lo` for an
    /// uncompacted layer, else what kv head `hq / group` holds (query head blocks follow each
    /// other, see `attention_with_logits`).
    fn observe(&mut self, _call: &AttnCall, _rows: usize, _logits: &[f32], _store: &KvStore<T>) {}

    /// Called after the whole forward of positions `pos0 .. pos0 + n` (prefill chunk or decode
    /// step) has run through every layer.
    fn end_forward(&mut self, _pos0: usize, _n: usize) {}

    /// The token about to be fed at the next decode step (trigger policies look at it).
    fn on_token(&mut self, _token: u32) {}

    /// Riding (`crate::sfi::trigger::riders`), after this step's `on_token`: whether the step
    /// is slow by the policy's own trigger (false for policies without one).
    fn slow_now(&self) -> bool {
        false
    }

    /// Riding, after this step's `on_token`: the trigger to weigh when another sequence of
    /// the batch takes a slow step, if this step could become one (a policy with a trigger and
    /// a memory to refresh, not drafting). None for the other policies.
    fn rider(&self) -> Option<&crate::sfi::trigger::Trigger> {
        None
    }

    /// Riding: the caller chose this sequence by `riders`; its current step becomes a slow
    /// step. Only called when `rider` returned a trigger.
    fn ride(&mut self) {}

    /// Prompt rows at the end of prefill the policy observes (an observation window): the
    /// session makes its last prefill chunk at least this long.
    fn prefill_tail(&self) -> usize {
        0
    }

    /// After the last prefill chunk, with the store mutable: one-shot compressors (SnapKV,
    /// PyramidKV) and H2O evict here, freeing memory.
    fn end_prefill(&mut self, _store: &mut KvStore<T>) -> Result<(), KvError> {
        Ok(())
    }

    /// After each decode step (after `end_forward`), with the store mutable (H2O evicts).
    fn end_step(&mut self, _store: &mut KvStore<T>) -> Result<(), KvError> {
        Ok(())
    }

    fn stats(&self) -> PolicyStats;

    /// Inspection (read only): per kv head, the positions of global layer `layer` that the
    /// policy holds now, by role: what its next decode step reads besides the token that step
    /// adds. The default is every position the store holds for the layer, with no role (full
    /// KV, and what a one-shot compressor kept).
    fn held(&self, layer: usize, store: &KvStore<T>) -> Vec<Held> {
        (0..store.n_kv_heads)
            .map(|h| Held::kept_slots(&store.slot_positions(layer, h)))
            .collect()
    }

    /// Inspection: the log of this sequence's slow steps and their reasons, for policies
    /// that alternate slow and fast steps (SFI); None for the others.
    fn slow_log(&self) -> Option<&SlowLog> {
        None
    }

    /// Speculative decoding with this policy as the drafter (its sparse decode steps propose
    /// tokens; a dense multi-row forward through it verifies them). Draft steps are about to
    /// run that `end_draft` undoes: the policy must not let them change what survives (SFI's
    /// trigger does not advance while drafting). Policies that evict (H2O, SnapKV) or keep
    /// per-step state they cannot roll back refuse, naming themselves.
    fn begin_draft(&mut self) -> Result<(), String> {
        Err(format!(
            "the {} policy cannot draft for speculative decoding (drafters: sfi, streaming)",
            self.name()
        ))
    }

    /// The draft steps are over and the store was cut back to `len` positions (the drafted
    /// keys are gone): forget anything derived from positions `>= len`.
    fn end_draft(&mut self, _len: usize) {}

    /// A verification forward is about to run: one-row decode calls at positions `pos0`,
    /// `pos0 + 1`, ... (each exactly what a dense decode step at that position computes), which
    /// the policy must read densely (what `FullPolicy` reads) and capture nothing from. `scale`
    /// is the model's attention scale. Full KV needs nothing.
    fn begin_verify(&mut self, _pos0: usize, _scale: f32) {}

    /// The verification ran and the store was then cut back to `len` positions: `fed` are the
    /// tokens the verification fed at positions `len - fed.len() .. len` that were kept. With
    /// `refresh`, or when the policy's own trigger fires on `fed`, the policy may rebuild its
    /// sparse memory from the verification's dense attention (a verification is a slow step).
    fn end_verify(&mut self, _fed: &[u32], _len: usize, _refresh: bool, _store: &KvStore<T>) {}

    /// Whether KV another sequence computed for the same prompt prefix may stand in for this
    /// policy's own prefill of it (prefix caching). True when the policy's prefill reads every
    /// key densely, leaves the store as written, and keeps nothing from the prefix's query rows
    /// (watching the prompt's last chunk is fine: that chunk is always computed). False by
    /// default: H2O sums every prompt row's attention, FastKV propagates a subset of the prompt.
    fn shares_prefix(&self) -> bool {
        false
    }

    /// A copy of the policy's whole state, for a copy of its cache (`Session::try_clone`):
    /// `None` where the policy cannot give one (then fork the cache under a fresh policy).
    fn try_clone(&self) -> Option<Box<dyn KvPolicy<T>>> {
        None
    }
}

/// Push the stored segments of positions `r` of kv head `h` into `out`.
pub fn push_range<'s, T: CacheElem>(
    store: &'s KvStore<T>,
    layer: usize,
    h: usize,
    r: Range<usize>,
    out: &mut Vec<KvSegment<'s, T>>,
) {
    store.segments_into(layer, h, r.start, r.end, out);
}

/// Segments as `(first position, keys)` runs, adjacent position ranges merged (a dense read
/// of a paged layer is one segment a block); panics on a position list. For tests.
#[cfg(test)]
pub(crate) fn range_runs<T>(segs: &[KvSegment<'_, T>], d: usize) -> Vec<(u32, usize)> {
    let mut out: Vec<(u32, usize)> = Vec::new();
    for s in segs {
        let slowfast_backend::cpu::attention::KvPositions::Range { start } = s.pos else {
            panic!("ranges expected")
        };
        match out.last_mut() {
            Some((a, n)) if *a as usize + *n == start as usize => *n += s.len(d),
            _ => out.push((start, s.len(d))),
        }
    }
    out
}

/// The maximal runs of consecutive values of `sorted` (ascending, distinct) as ranges, so that
/// picked positions or pages are read as few segments: `[3, 4, 5, 9]` gives `3..6, 9..10`.
pub fn sorted_runs(sorted: &[usize]) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let first = *sorted.get(i)?;
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        i = j + 1;
        Some(first..sorted[j] + 1)
    })
}

/// Reset `out` to `n_kv` empty lists, keeping their allocations.
pub fn reset_out<T>(out: &mut Vec<Vec<KvSegment<'_, T>>>, n_kv: usize) {
    out.truncate(n_kv);
    for v in out.iter_mut() {
        v.clear();
    }
    while out.len() < n_kv {
        out.push(Vec::new());
    }
}

/// Dense read of everything the layer holds in `lo .. hi` (for compacted layers, what the
/// policy kept), counting decode steps of global layers in `step` (keys held per kv head
/// against the `hi - lo` a dense step reads).
pub fn dense_segments<'s, T: CacheElem>(
    call: &AttnCall,
    store: &'s KvStore<T>,
    out: &mut Vec<Vec<KvSegment<'s, T>>>,
    step: &mut StepCounter,
) {
    reset_out(out, store.n_kv_heads);
    for (h, o) in out.iter_mut().enumerate() {
        push_range(store, call.layer, h, call.lo..call.hi(), o);
    }
    if call.is_decode() && !call.sliding {
        let d = store.head_dim;
        let held: usize = out
            .iter()
            .map(|o| o.iter().map(|s| s.len(d)).sum::<usize>())
            .sum();
        step.record(
            held as f64 / store.n_kv_heads.max(1) as f64,
            call.hi() - call.lo,
        );
    }
}

/// Dense attention over everything the mask allows: the default policy, identical to the
/// engine without a seam.
#[derive(Debug, Default, Clone)]
pub struct FullPolicy {
    stats: PolicyStats,
    step: StepCounter,
}

impl FullPolicy {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<T: CacheElem> KvPolicy<T> for FullPolicy {
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
    fn end_forward(&mut self, _pos0: usize, _n: usize) {
        self.step.finish(&mut self.stats, true);
    }
    fn try_clone(&self) -> Option<Box<dyn KvPolicy<T>>> {
        Some(Box::new(self.clone()))
    }
    fn shares_prefix(&self) -> bool {
        true
    }
    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::sorted_runs;

    #[test]
    fn sorted_runs_splits_at_gaps() {
        let runs = |v: &[usize]| sorted_runs(v).collect::<Vec<_>>();
        assert_eq!(runs(&[3, 4, 5, 9]), vec![3..6, 9..10]);
        assert_eq!(runs(&[0, 2, 4]), vec![0..1, 2..3, 4..5]);
        assert_eq!(runs(&[7]), vec![7..8]);
        assert!(runs(&[]).is_empty());
    }
}
