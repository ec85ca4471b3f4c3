//! The SFI policy: per global layer, a compact buffer of sink + Selector-chosen keys/values
//! (rebuilt at each refresh, contiguous per kv head) read together with the recent window in
//! place; slow steps (trigger) and the prefill bootstrap attend densely and refresh it.
use slowfast_backend::cpu::attention::{
    attention_with_logits, AttnShape, KvPositions, KvSegment, Mask, QueryPositions,
};

use super::candidates::{candidate_pages, view_ranges};
use super::selector::{select_into, Selection, SelectorConfig, SelectorInput, SelectorScratch};
use super::trigger::{Trigger, TriggerConfig, TriggerError, TriggerStats};
use crate::inspect::{runs_of, Held, SlowLog, SlowReason};
use crate::policy::{push_range, reset_out, AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::quest::PageBounds;
use crate::score::top_k;
use crate::store::{CacheElem, KvError, KvStore};

/// SFI knobs (methods.md §1.3).
#[derive(Debug, Clone, PartialEq)]
pub struct SfiConfig {
    /// Sink tokens S kept in every memory.
    pub sinks: usize,
    /// Recent window Wr, read in place (page-aligned start).
    pub recent: usize,
    /// Selector-chosen tokens per kv head (k).
    pub selected: usize,
    /// Page size P aligning the recent window's start.
    pub page: usize,
    /// Query rows captured at the end of prefill for the bootstrap selection.
    pub bootstrap_rows: usize,
    pub trigger: TriggerConfig,
    pub selector: SelectorConfig,
    /// Decode steps between a slow step and the first fast step that reads its new memory
    /// (0: the very next step, as the paper and the CPU do). Only the GPU overlaps the
    /// Selector with the fast steps this way; the CPU refuses a lag above 0.
    pub async_lag: usize,
    /// Candidate pool of the per-step re-rank, as a multiple of `selected` (1: off). Above 1
    /// each refresh keeps `pool * selected` Selector-chosen tokens, grouped in position order
    /// into pages of `page` memory entries with each page's per-dimension key min and max; every
    /// fast step then reads the sinks, the pages whose bound on `q·k` (Quest's, the largest
    /// over the kv head's query heads) is highest, and the recent window. A bound costs about
    /// one key read (counted as attended), so the step reads `(selected - pages) / page` pages:
    /// the same keys a step as without the re-rank.
    pub pool: f32,
    /// The drift trigger (0: off; an extension, issue 27 direction 1). At each refresh a
    /// layer records the share of its slow query's attention, over what a fast step reads,
    /// that falls on the Selector-chosen keys; each fast step measures the same share for its
    /// own query from the logits it computes anyway. When the fast step's shares, summed over
    /// the global layers, fall below `drift` times the refresh's, the next step is slow
    /// (within the trigger's `min_gap`). Not with the re-rank (`pool` > 1).
    pub drift: f32,
    /// The cheaper slow step (0: off, a slow step reads every key; an extension, issue 27
    /// direction 3; at least 1 when on). A slow decode step reads the pages holding the sinks,
    /// the recent window and the `candidates * selected` tokens' worth of pages (of `page` keys)
    /// whose Quest bound on `q·k` is highest, shared by the layer's kv heads
    /// (`candidates::candidate_pages`), and pays a key read for each page's bound; the
    /// Selector chooses the memory among the keys the step read.
    pub candidates: f32,
}

impl SfiConfig {
    /// Defaults with a total budget of `budget` tokens per kv head (S + k + Wr).
    pub fn with_budget(budget: usize) -> Result<Self, String> {
        let (sinks, recent) = (4, 256);
        if budget <= sinks + recent {
            return Err(format!(
                "the SFI budget ({budget} tokens) must exceed sinks + recent window ({})",
                sinks + recent
            ));
        }
        Ok(Self::new(sinks, recent, budget - sinks - recent))
    }

    /// `sinks` + `selected` Selector-chosen tokens + a `recent` window, other knobs at the
    /// authors' defaults.
    pub fn new(sinks: usize, recent: usize, selected: usize) -> Self {
        SfiConfig {
            sinks,
            recent,
            selected,
            page: 16,
            bootstrap_rows: 16,
            trigger: TriggerConfig::default(),
            selector: SelectorConfig::default(),
            async_lag: 0,
            pool: 1.0,
            drift: 0.0,
            candidates: 0.0,
        }
    }
}

/// Captured prefill logits waiting for the end of prefill.
#[derive(Default, Clone)]
struct Pending {
    rows: usize,
    n_heads: usize,
    /// Key slots the capture covered, and one past the newest position then.
    keys: usize,
    hi: usize,
    logits: Vec<f32>,
}

/// One layer's sparse memory.
#[derive(Clone)]
struct LayerMem<T> {
    k: Vec<T>,     // [kv_heads, len, head_dim]
    v: Vec<T>,     // [kv_heads, len, head_dim]
    pos: Vec<u32>, // [kv_heads, len]
    len: usize,    // tokens per kv head (equal across heads)
    recent_start: usize,
    /// The re-rank (`SfiConfig::pool` > 1): entries before this are sinks, always read.
    sinks: usize,
    /// Per kv head: Quest's key bounds of the selected entries (after the sinks), in pages of
    /// `page` entries; empty without the re-rank.
    bounds: Vec<PageBounds>,
    /// Per kv head: the pages this fast step reads (ascending), chosen in `query`.
    pick: Vec<Vec<usize>>,
    /// The drift trigger: the share of the refreshing query's attention on the selected
    /// entries (mean over query heads; see `SfiConfig::drift`).
    share: f64,
}

impl<T> LayerMem<T> {
    /// Pages of selected entries per kv head (0 without the re-rank).
    fn pages(&self, page: usize) -> usize {
        self.bounds.first().map_or(0, |b| b.tokens.div_ceil(page))
    }
}

#[derive(Clone)]
pub struct SfiPolicy<T> {
    cfg: SfiConfig,
    trigger: Trigger,
    layers: Vec<Option<LayerMem<T>>>,
    /// This decode step is slow (dense + refresh).
    slow_now: bool,
    /// A refresh ran during the current forward (bootstrap or slow step).
    refreshed: bool,
    scratch: SelectorScratch,
    selection: Selection,
    norms: Vec<f32>,
    /// Per layer: the captured bootstrap logits of the latest prefill chunk, selected from
    /// once at `end_prefill` (so earlier chunks cost no Selector run).
    pending: Vec<Option<Pending>>,
    /// Per layer, per kv head: the L2 norm of each cached key computed so far.
    key_norms: Vec<Vec<Vec<f32>>>,
    stats: PolicyStats,
    step: StepCounter,
    refreshes: usize,
    /// Speculative drafting is under way: the trigger does not advance (verifications are
    /// the slow steps, see `end_verify`).
    drafting: bool,
    /// A verification starting at this position is running: decode calls read densely, and
    /// the first row's queries are kept per global layer (`vq`) for a refresh at its end.
    verifying: Option<usize>,
    vq: Vec<Option<Vec<f32>>>,
    scale: f32,
    /// Why the trigger made this decode step slow (set with `slow_now`).
    reason: Option<SlowReason>,
    /// The slow steps so far (inspection).
    log: SlowLog,
    /// The drift trigger, this forward: the fast step's shares and the refreshes' shares,
    /// summed over the layers measured.
    drift_now: (f64, f64),
    /// Per layer: keys per kv head its last fast step read (memory, then the recent window).
    read: Vec<usize>,
    /// The cheaper slow step (`SfiConfig::candidates`): this decode step's query, per layer
    /// and kv head the page bounds of the cached keys before the recent window, and per layer
    /// the key slots this slow step read (set in `segments`, selected from in `observe`).
    q: Vec<f32>,
    page_bounds: Vec<Vec<PageBounds>>,
    view: Vec<Option<Vec<u32>>>,
}

/// Which trigger counter moved between two readings: the reason of the step that fired.
fn trigger_reason(before: &TriggerStats, after: &TriggerStats) -> SlowReason {
    if after.sentence > before.sentence {
        SlowReason::Sentence
    } else if after.interval > before.interval {
        SlowReason::Interval
    } else if after.periodic > before.periodic {
        SlowReason::Periodic
    } else if after.drift > before.drift {
        SlowReason::Drift
    } else {
        SlowReason::Random
    }
}

impl<T: CacheElem> SfiPolicy<T> {
    pub fn new(
        cfg: SfiConfig,
        enders: &[u32],
        newlines: &[u32],
        vocab_size: usize,
    ) -> Result<Self, TriggerError> {
        let trigger = Trigger::new(cfg.trigger.clone(), enders, newlines, vocab_size)?;
        Ok(SfiPolicy {
            cfg,
            trigger,
            layers: Vec::new(),
            slow_now: false,
            refreshed: false,
            scratch: SelectorScratch::default(),
            selection: Selection {
                per_head: Vec::new(),
            },
            norms: Vec::new(),
            key_norms: Vec::new(),
            pending: Vec::new(),
            stats: PolicyStats::default(),
            step: StepCounter::default(),
            refreshes: 0,
            drafting: false,
            verifying: None,
            vq: Vec::new(),
            scale: 1.0,
            reason: None,
            log: SlowLog::default(),
            drift_now: (0.0, 0.0),
            read: Vec::new(),
            q: Vec::new(),
            page_bounds: Vec::new(),
            view: Vec::new(),
        })
    }

    /// Memory refreshes so far (bootstrap included), summed over layers.
    pub fn refreshes(&self) -> usize {
        self.refreshes
    }

    /// Below this length a sequence stays dense (the memory would not be smaller).
    fn dense_below(&self) -> usize {
        self.cfg.sinks + self.cfg.selected + self.cfg.recent
    }

    fn mem(&self, layer: usize) -> Option<&LayerMem<T>> {
        self.layers.get(layer).and_then(|m| m.as_ref())
    }

    /// Selector-chosen tokens a refresh keeps: `selected`, or the re-rank's pool.
    fn kept(&self) -> usize {
        if self.cfg.pool > 1.0 {
            ((self.cfg.selected as f64) * self.cfg.pool as f64).round() as usize
        } else {
            self.cfg.selected
        }
    }

    /// This call attends densely (sliding layer, prefill, a verification, a capture for a
    /// refresh, or no memory yet); otherwise it reads the sparse memory.
    fn reads_dense(&self, call: &AttnCall) -> bool {
        call.sliding
            || !call.is_decode()
            || self.verifying.is_some()
            || self.refresh_rows(call) > 0
            || self.mem(call.layer).is_none()
    }

    /// Query rows of this call whose dense logits a refresh selects from (0: none).
    fn refresh_rows(&self, call: &AttnCall) -> usize {
        if call.sliding || call.hi() <= self.dense_below() || self.verifying.is_some() {
            0
        } else if !call.is_decode() {
            // Every prefill chunk captures; the last one's selection is what decode starts with.
            self.cfg.bootstrap_rows.min(call.n)
        } else if self.slow_now || self.mem(call.layer).is_none() {
            1
        } else {
            0
        }
    }

    /// The drift trigger measures this call: a fast step of a layer with a memory.
    fn measures_drift(&self, call: &AttnCall) -> bool {
        self.cfg.drift > 0.0 && self.cfg.pool <= 1.0 && !self.drafting && !self.reads_dense(call)
    }

    /// The pages a cheaper slow step of this call reads besides the sinks' and the recent
    /// window (`SfiConfig::candidates`), or None: the call reads as it would without it (a
    /// slow step then reads every key). Only decode slow steps of plain global layers with a
    /// memory, and only when some page would be left out.
    fn candidate_step(&self, call: &AttnCall, store: &KvStore<T>) -> Option<usize> {
        if self.cfg.candidates <= 0.0
            || !call.is_decode()
            || call.sliding
            || call.lo != 0
            || !self.slow_now
            || self.verifying.is_some()
            || self.mem(call.layer).is_none()
            || store.layer(call.layer).is_compact()
            || self.q.is_empty()
            || !self
                .q
                .len()
                .is_multiple_of(store.n_kv_heads * store.head_dim)
        {
            return None;
        }
        let (first, pages) = self.candidate_domain(call.hi());
        let want = (self.cfg.candidates as f64 * self.kept() as f64 / self.cfg.page.max(1) as f64)
            .ceil() as usize;
        (first + want < pages).then_some(want)
    }

    /// The candidate pages of a cheaper slow step at `hi`: from the first page after the
    /// sinks' to the recent window's page-aligned start.
    fn candidate_domain(&self, hi: usize) -> (usize, usize) {
        let p = self.cfg.page.max(1);
        (self.cfg.sinks.div_ceil(p), self.recent_start(hi) / p)
    }

    /// The position where a slow step at `hi` starts the recent window: `recent` keys back,
    /// rounded down to a page boundary.
    fn recent_start(&self, hi: usize) -> usize {
        let p = self.cfg.page.max(1);
        (hi - self.cfg.recent.min(hi)) / p * p
    }

    /// A cheaper slow step's reads (`candidate_step` said `want` pages): bring the page bounds
    /// up to the recent window, pick the pages, push the view's ranges for every kv head and
    /// keep its slots for `observe`.
    fn read_candidates<'s>(
        &mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        want: usize,
        out: &mut [Vec<KvSegment<'s, T>>],
    ) {
        let (l, hi, p) = (call.layer, call.hi(), self.cfg.page.max(1));
        let (nkv, d) = (store.n_kv_heads, store.head_dim);
        let (first, pages) = self.candidate_domain(hi);
        if self.page_bounds.len() <= l {
            self.page_bounds.resize_with(l + 1, Vec::new);
        }
        let bounds = &mut self.page_bounds[l];
        bounds.resize_with(nkv, PageBounds::default);
        for (h, b) in bounds.iter_mut().enumerate() {
            let rows = store.head(l, h);
            b.update(|t| rows.k(t), pages * p, p, d);
        }
        // The pages of the Selector's first and last candidate positions.
        let forced = [self.cfg.sinks / p, pages - 1];
        let picked = candidate_pages(bounds, &self.q, d, (first, pages), &forced, want);
        let ranges = view_ranges(first, &picked, p, pages * p, hi);
        for (h, o) in out.iter_mut().enumerate() {
            for r in &ranges {
                push_range(store, l, h, r.clone(), o);
            }
        }
        let view: Vec<u32> = ranges
            .iter()
            .flat_map(|r| r.start as u32..r.end as u32)
            .collect();
        // A page bound (min and max rows) costs about one key read; still a slow step.
        self.step.record((view.len() + pages - first) as f64, hi);
        if self.view.len() <= l {
            self.view.resize_with(l + 1, || None);
        }
        self.view[l] = Some(view);
    }

    /// Select and gather the memory of `layer` from captured logits over the `keys` slots the
    /// capture saw (`[0, keys)`, or the slots `view` lists: a cheaper slow step's), the newest
    /// at position `hi - 1`. On a plain global layer
    /// slot j holds position j (`keys == hi`); on a compacted one (FastKV's token-selective
    /// prefill writes only the propagated tokens after its TSP layer) the slots carry explicit
    /// positions, which the sinks, the recent window, the Selector's position prior and the
    /// memory's key positions all use.
    #[allow(clippy::too_many_arguments)]
    fn refresh(
        &mut self,
        layer: usize,
        rows: usize,
        logits: &[f32],
        store: &KvStore<T>,
        n_heads: usize,
        keys: usize,
        hi: usize,
        view: Option<&[u32]>,
    ) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        if keys <= self.dense_below() {
            self.layers[layer] = None;
            return;
        }
        let (nkv, d) = (store.n_kv_heads, store.head_dim);
        // Slot positions of a compacted layer: every kv head must hold the same ascending
        // positions (FastKV's propagation writes all heads alike); anything else stays dense.
        let slot_pos: Option<Vec<u32>> = if let Some(v) = view {
            // A cheaper slow step's view of a plain layer: slot j' = view[j] at position j'.
            Some(v.to_vec())
        } else if store.layer(layer).is_compact() {
            let p = store.slot_positions(layer, 0);
            let same = (1..nkv).all(|h| store.slot_positions(layer, h) == p);
            if !same
                || p.len() < keys
                || p[..keys].windows(2).any(|w| w[1] <= w[0])
                || p[keys - 1] as usize >= hi
            {
                self.layers[layer] = None;
                return;
            }
            Some(p[..keys].to_vec())
        } else {
            None
        };
        let at = |j: usize| slot_pos.as_ref().map_or(j, |p| p[j] as usize);
        // The cache slot of captured key j (j itself but for a view).
        let slot = |j: usize| view.map_or(j, |v| v[j] as usize);
        let g = n_heads / nkv;
        let p = self.cfg.page.max(1);
        // Positions: the recent window starts at a page boundary; the sinks are positions
        // [0, sinks). Slots: the first slot at or after each.
        let recent_start = self.recent_start(hi);
        let (sink_slots, recent_slot) = match &slot_pos {
            None => (self.cfg.sinks.min(recent_start), recent_start),
            Some(sp) => {
                let r = sp.partition_point(|&q| (q as usize) < recent_start);
                (
                    sp.partition_point(|&q| (q as usize) < self.cfg.sinks)
                        .min(r),
                    r,
                )
            }
        };
        // Key norms of the cached (post-RoPE) keys, by slot: kept per layer and extended by
        // the slots written since the last refresh (cached keys are never rewritten and the
        // slots of a layer SFI reads only ever grow at the end).
        if self.key_norms.len() <= layer {
            self.key_norms.resize_with(layer + 1, Vec::new);
        }
        let cached = &mut self.key_norms[layer];
        cached.resize_with(nkv, Vec::new);
        self.norms.clear();
        let mut row = vec![0.0f32; d];
        let slots = view.map_or(keys, |v| v.last().map_or(0, |&j| j as usize + 1));
        for (h, kn) in cached.iter_mut().enumerate() {
            let rows = store.head(layer, h);
            kn.truncate(slots);
            for j in kn.len()..slots {
                T::load(rows.k(j), &mut row);
                kn.push(l2_norm(&row));
            }
            match view {
                Some(v) => self.norms.extend(v.iter().map(|&j| kn[j as usize])),
                None => self.norms.extend_from_slice(kn),
            }
        }
        let inp = SelectorInput {
            n_kv_heads: nkv,
            rows: g * rows,
            seq_len: keys,
            logits,
            key_norms: &self.norms,
            sinks: sink_slots,
            recent_start: recent_slot,
            k: self.kept(),
            positions: slot_pos.as_deref(),
        };
        if select_into(
            &self.cfg.selector,
            &inp,
            &mut self.scratch,
            &mut self.selection,
        )
        .is_err()
        {
            // Inputs the Selector rejects (e.g. non-finite logits) leave the layer dense.
            self.layers[layer] = None;
            return;
        }
        let chosen = self.selection.per_head.first().map_or(0, |v| v.len());
        let m_len = sink_slots + chosen;
        let mut mem = self.layers[layer].take().unwrap_or(LayerMem {
            k: Vec::new(),
            v: Vec::new(),
            pos: Vec::new(),
            len: 0,
            recent_start: 0,
            sinks: 0,
            bounds: Vec::new(),
            pick: Vec::new(),
            share: 0.0,
        });
        mem.len = m_len;
        mem.recent_start = recent_start;
        mem.sinks = sink_slots;
        mem.bounds.clear();
        mem.pick.clear();
        mem.pos.clear();
        mem.k.clear();
        mem.v.clear();
        for h in 0..nkv {
            let rows = store.head(layer, h);
            let sel = &self.selection.per_head[h];
            for j in (0..sink_slots as u32).chain(sel.iter().copied()) {
                let (j, s) = (j as usize, slot(j as usize));
                mem.pos.push(at(j) as u32);
                mem.k.extend_from_slice(rows.k(s));
                mem.v.extend_from_slice(rows.v(s));
            }
        }
        if self.cfg.pool > 1.0 {
            page_bounds(&mut mem, nkv, d, p);
        }
        if self.cfg.drift > 0.0 {
            // The last captured row's share over what the fast steps will read: the sinks,
            // the selected slots and the recent window.
            let row = rows - 1;
            let mut sum = 0.0;
            for hq in 0..n_heads {
                let l = &logits[(hq * rows + row) * keys..(hq * rows + row + 1) * keys];
                let sel = &self.selection.per_head[hq / g];
                let others = (0..sink_slots).chain(recent_slot..keys);
                sum += selected_share(sel.iter().map(|&j| l[j as usize]), others.map(|j| l[j]));
            }
            mem.share = sum / n_heads.max(1) as f64;
        }
        self.layers[layer] = Some(mem);
        self.refreshed = true;
        self.refreshes += 1;
    }
}

impl<T> SfiPolicy<T> {
    /// The drift trigger on a fast step of `layer`: its logits (`[n_heads, read]`, the sinks,
    /// the selected entries, then the recent window) give this query's share on the selected
    /// entries, added to this forward's sums with the share of the refresh.
    fn measure_drift(&mut self, layer: usize, logits: &[f32]) {
        let Some(m) = self.layers.get(layer).and_then(|m| m.as_ref()) else {
            return;
        };
        let read = self.read.get(layer).copied().unwrap_or(0);
        if read < m.len.max(1) || !logits.len().is_multiple_of(read) {
            return;
        }
        let heads = logits.len() / read;
        let sum: f64 = logits
            .chunks_exact(read)
            .map(|l| {
                let others = l[..m.sinks].iter().chain(&l[m.len..]).copied();
                selected_share(l[m.sinks..m.len].iter().copied(), others)
            })
            .sum();
        self.drift_now.0 += sum / heads as f64;
        self.drift_now.1 += m.share;
    }

    /// Forget what was derived from positions `>= len` (speculative decoding cut them off):
    /// the cached key norms, and captures not yet selected from.
    fn forget_from(&mut self, len: usize) {
        for layer in &mut self.key_norms {
            for kn in layer.iter_mut() {
                kn.truncate(len);
            }
        }
        for p in &mut self.pending {
            *p = None;
        }
        let page = self.cfg.page.max(1);
        for b in self.page_bounds.iter_mut().flatten() {
            b.tokens = b.tokens.min(len / page * page);
        }
    }
}

/// The re-rank's page bounds of `mem`'s selected entries (after its sinks): per kv head,
/// Quest's per-page key min and max over pages of `page` entries.
fn page_bounds<T: CacheElem>(mem: &mut LayerMem<T>, nkv: usize, d: usize, page: usize) {
    let sel = mem.len - mem.sinks;
    mem.bounds.clear();
    mem.bounds.resize_with(nkv, PageBounds::default);
    for (h, b) in mem.bounds.iter_mut().enumerate() {
        let first = h * mem.len + mem.sinks;
        let keys = &mem.k[first * d..(first + sel) * d];
        b.update(|t| &keys[t * d..(t + 1) * d], sel, page, d);
    }
}

/// Choose, per kv head, the `want` pages of `mem` with the highest bound for the decode
/// query `q` (`[n_heads, head_dim]`; a page scores its largest bound over the kv head's query
/// heads), ascending in `mem.pick`. Ties go to the earlier page.
fn pick_pages<T>(mem: &mut LayerMem<T>, q: &[f32], want: usize, page: usize) {
    let nkv = mem.bounds.len();
    let pages = mem.pages(page);
    let d = mem.k.len() / (nkv * mem.len).max(1);
    let g = q.len() / (d * nkv).max(1);
    mem.pick.resize_with(nkv, Vec::new);
    let mut score = Vec::with_capacity(pages);
    for (h, (pick, b)) in mem.pick.iter_mut().zip(&mem.bounds).enumerate() {
        score.clear();
        score.extend((0..pages).map(|c| {
            (0..g)
                .map(|i| b.upper_bound(c, &q[(h * g + i) * d..(h * g + i + 1) * d]))
                .fold(f32::NEG_INFINITY, f32::max)
        }));
        *pick = top_k(&score, want);
        pick.sort_unstable();
    }
}

/// The share of softmax mass on the `selected` logits among the `selected` and `others` ones
/// (0 when none is finite).
fn selected_share(
    selected: impl Iterator<Item = f32> + Clone,
    others: impl Iterator<Item = f32> + Clone,
) -> f64 {
    let m = selected
        .clone()
        .chain(others.clone())
        .fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return 0.0;
    }
    let mass = |x: f32| ((x - m) as f64).exp();
    let sel: f64 = selected.map(mass).sum();
    sel / (sel + others.map(mass).sum::<f64>())
}

/// `sqrt(sum x^2)` with eight independent partial sums (vectorises).
fn l2_norm(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    (acc.iter().sum::<f32>() + tail).sqrt()
}

impl<T: CacheElem> KvPolicy<T> for SfiPolicy<T> {
    fn name(&self) -> &'static str {
        "sfi"
    }

    fn try_clone(&self) -> Option<Box<dyn KvPolicy<T>>> {
        Some(Box::new(self.clone()))
    }

    /// A refresh's rows, or on a fast step the drift trigger's one row (its logits are over
    /// the sparse memory and the recent window, in `segments`' order).
    fn capture_rows(&self, call: &AttnCall) -> usize {
        self.refresh_rows(call)
            .max(self.measures_drift(call) as usize)
    }

    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    ) {
        let nkv = store.n_kv_heads;
        reset_out(out, nkv);
        if let Some(want) = self.candidate_step(call, store) {
            self.read_candidates(call, store, want, out);
            return;
        }
        let (lo, hi) = (call.lo, call.hi());
        let dense = self.reads_dense(call);
        let mut bound_reads = 0;
        if dense {
            for (h, o) in out.iter_mut().enumerate() {
                push_range(store, call.layer, h, lo..hi, o);
            }
        } else {
            let d = store.head_dim;
            let m = self.layers[call.layer].as_ref().expect("checked above");
            let seg = |a: usize, b: usize| KvSegment {
                k: &m.k[a * d..b * d],
                v: &m.v[a * d..b * d],
                pos: KvPositions::List(&m.pos[a..b]),
            };
            let page = self.cfg.page.max(1);
            let pages = m.pages(page);
            for (h, o) in out.iter_mut().enumerate() {
                let base = h * m.len;
                if pages == 0 {
                    o.push(seg(base, base + m.len));
                } else {
                    // The sinks, then each run of consecutive picked pages as one segment.
                    bound_reads += pages;
                    if m.sinks > 0 {
                        o.push(seg(base, base + m.sinks));
                    }
                    for r in crate::policy::sorted_runs(&m.pick[h]) {
                        let a = base + m.sinks + r.start * page;
                        let b = (base + m.sinks + r.end * page).min(base + m.len);
                        o.push(seg(a, b));
                    }
                }
                push_range(store, call.layer, h, m.recent_start..hi, o);
            }
            let d = store.head_dim;
            let read = out[0].iter().map(|s| s.len(d)).sum();
            if self.read.len() <= call.layer {
                self.read.resize(call.layer + 1, 0);
            }
            self.read[call.layer] = read;
        }
        if call.is_decode() && !call.sliding {
            // Keys read per kv head (a compacted layer holds fewer than its positions).
            let d = store.head_dim;
            let read: usize = out
                .iter()
                .map(|o| o.iter().map(|s| s.len(d)).sum::<usize>())
                .sum();
            // A page bound (min and max rows) costs about one key read.
            let read = read + bound_reads;
            self.step.record(read as f64 / nkv.max(1) as f64, hi - lo);
            if !dense {
                self.step.mark_sparse();
            }
        }
    }

    fn observe(&mut self, call: &AttnCall, rows: usize, logits: &[f32], store: &KvStore<T>) {
        debug_assert_eq!(call.lo, 0, "SFI memories live in global layers");
        let hi = call.hi();
        // The capture covers every held key: positions [0, hi) of a plain layer, the slots a
        // compacted one holds (all below hi: nothing newer has been written yet).
        // A cheaper slow step captured the keys of its view only.
        let view = self.view.get_mut(call.layer).and_then(Option::take);
        let keys = if let Some(v) = &view {
            v.len()
        } else if store.layer(call.layer).is_compact() {
            store.held(call.layer, 0)
        } else {
            hi - call.lo
        };
        let n_heads = logits.len() / (rows * keys).max(1);
        if call.is_decode() {
            if self.measures_drift(call) {
                self.measure_drift(call.layer, logits);
            } else {
                let v = view.as_deref();
                self.refresh(call.layer, rows, logits, store, n_heads, keys, hi, v);
            }
            return;
        }
        // Prefill: keep the latest chunk's capture; `end_prefill` selects from it.
        if self.pending.len() <= call.layer {
            self.pending.resize_with(call.layer + 1, || None);
        }
        let p = self.pending[call.layer].get_or_insert_with(Pending::default);
        (p.rows, p.n_heads, p.keys, p.hi) = (rows, n_heads, keys, hi);
        p.logits.clear();
        p.logits.extend_from_slice(logits);
    }

    fn prefill_tail(&self) -> usize {
        self.cfg.bootstrap_rows
    }

    fn end_prefill(&mut self, store: &mut KvStore<T>) -> Result<(), KvError> {
        let mut pending = std::mem::take(&mut self.pending);
        for (layer, p) in pending.iter_mut().enumerate() {
            if let Some(p) = p.take() {
                // Only positions the capture saw: a later forward may have grown the store.
                if p.hi <= store.len() {
                    let (rows, n_heads) = (p.rows, p.n_heads);
                    self.refresh(layer, rows, &p.logits, store, n_heads, p.keys, p.hi, None);
                }
            }
        }
        self.pending = pending;
        if self.refreshed {
            // The bootstrap: restart the trigger's reuse count.
            self.trigger.reset_after_refresh();
            self.refreshed = false;
        }
        Ok(())
    }

    fn end_forward(&mut self, pos0: usize, n: usize) {
        let (now, then) = std::mem::take(&mut self.drift_now);
        if then > 0.0 && now < self.cfg.drift as f64 * then {
            self.trigger.note_drift();
        }
        if n == 1 {
            let slow = self.stats.slow_steps;
            self.step.finish_step(&mut self.stats);
            if self.stats.slow_steps > slow {
                let reason = match self.reason {
                    Some(r) if self.slow_now => r,
                    _ if self.refreshed => SlowReason::Bootstrap,
                    _ => SlowReason::Short,
                };
                self.log.push(pos0, reason);
            }
        }
        if self.refreshed && !self.slow_now {
            // Bootstrap or a forced refresh: restart the trigger's reuse count.
            self.trigger.reset_after_refresh();
        }
        self.refreshed = false;
        self.slow_now = false;
        self.view.iter_mut().for_each(|v| *v = None);
    }

    fn on_token(&mut self, token: u32) {
        let before = self.trigger.stats();
        self.slow_now = !self.drafting && self.trigger.on_token(token);
        self.reason = self
            .slow_now
            .then(|| trigger_reason(&before, &self.trigger.stats()));
    }

    fn slow_now(&self) -> bool {
        self.slow_now
    }

    fn rider(&self) -> Option<&Trigger> {
        // As the GPU's `would_refresh`: a memory exists (past the dense span), so a slow step
        // would refresh it.
        let has_memory = self.layers.iter().any(Option::is_some);
        (!self.slow_now && !self.drafting && self.verifying.is_none() && has_memory)
            .then_some(&self.trigger)
    }

    fn ride(&mut self) {
        self.trigger.ride();
        self.slow_now = true;
        self.reason = Some(SlowReason::Ride);
    }

    fn begin_draft(&mut self) -> Result<(), String> {
        self.drafting = true;
        Ok(())
    }

    fn end_draft(&mut self, len: usize) {
        self.drafting = false;
        self.slow_now = false;
        self.refreshed = false;
        self.forget_from(len);
        self.log.truncate(len);
    }

    fn query(&mut self, call: &AttnCall, q: &[f32]) {
        if self.cfg.candidates > 0.0 && self.slow_now && call.is_decode() && !call.sliding {
            self.q.clear();
            self.q.extend_from_slice(q);
        }
        if self.cfg.pool > 1.0 && !self.reads_dense(call) {
            let page = self.cfg.page.max(1);
            let m = self.layers[call.layer]
                .as_mut()
                .expect("reads_dense checked");
            // Equal cost: the bounds (about a key read a page) come out of the budget.
            let pages = m.pages(page);
            let want = (self.cfg.selected.saturating_sub(pages) / page).max(1);
            pick_pages(m, q, want, page);
        }
        if self.verifying == Some(call.pos0) && call.is_decode() && !call.sliding {
            if self.vq.len() <= call.layer {
                self.vq.resize_with(call.layer + 1, || None);
            }
            let v = self.vq[call.layer].get_or_insert_with(Vec::new);
            v.clear();
            v.extend_from_slice(q);
        }
    }

    fn begin_verify(&mut self, pos0: usize, scale: f32) {
        self.verifying = Some(pos0);
        self.scale = scale;
        for v in &mut self.vq {
            *v = None;
        }
    }

    fn end_verify(&mut self, fed: &[u32], len: usize, refresh: bool, store: &KvStore<T>) {
        let pos0 = self.verifying.take();
        // The verification's per-row reads are no decode step of the policy's.
        self.step = StepCounter::default();
        // The kept tokens as if decoded one by one: the trigger sees each.
        let mut fired = false;
        for &t in fed {
            fired |= self.trigger.on_token(t);
        }
        self.forget_from(len);
        let Some(pos0) = pos0 else { return };
        if !(refresh || fired) || pos0 >= len {
            return;
        }
        // The slow step's capture: the first verified row (always kept), dense over every
        // key it sees, as a slow decode step at `pos0` would capture it.
        let vq = std::mem::take(&mut self.vq);
        for (layer, q) in vq.iter().enumerate() {
            let Some(q) = q else { continue };
            if store.layer(layer).is_compact() {
                continue;
            }
            let hi = pos0 + 1;
            let (nkv, d) = (store.n_kv_heads, store.head_dim);
            let n_heads = q.len() / d.max(1);
            let shape = AttnShape {
                n_heads,
                n_kv_heads: nkv,
                head_dim: d,
                scale: self.scale,
            };
            let segs: Vec<Vec<KvSegment<'_, T>>> = (0..nkv)
                .map(|h| {
                    let mut o = Vec::new();
                    push_range(store, layer, h, 0..hi, &mut o);
                    o
                })
                .collect();
            let mut out = vec![0.0f32; q.len()];
            let mut logits = vec![0.0f32; n_heads * hi];
            let mask = Mask {
                causal: true,
                window: None,
            };
            let ok = attention_with_logits(
                &shape,
                q,
                QueryPositions::Start(pos0 as u32),
                &segs,
                mask,
                &mut out,
                None,
                &mut logits,
            );
            drop(segs);
            if ok.is_ok() {
                self.refresh(layer, 1, &logits, store, n_heads, hi, hi, None);
            }
        }
        self.vq = vq;
        if self.refreshed {
            self.trigger.reset_after_refresh();
            self.refreshed = false;
            self.log.push(pos0, SlowReason::Verify);
        }
    }

    /// Prefill reads densely; the bootstrap selects from the last chunk's capture, always computed.
    fn shares_prefix(&self) -> bool {
        true
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }

    /// A layer with a memory: its sinks and Selector-chosen keys, and the recent window from
    /// its page-aligned start to the newest position; a layer without one (the sequence is
    /// within the budget, or the Selector left it dense) holds everything. With the re-rank
    /// (`pool` > 1) the selected keys are the candidate pool; each fast step reads the pages of
    /// it that its query picks.
    fn held(&self, layer: usize, store: &KvStore<T>) -> Vec<Held> {
        let Some(m) = self.mem(layer) else {
            return (0..store.n_kv_heads)
                .map(|h| Held::kept_slots(&store.slot_positions(layer, h)))
                .collect();
        };
        let len = store.len();
        (0..store.n_kv_heads)
            .map(|h| {
                let pos = &m.pos[h * m.len..(h + 1) * m.len];
                let (sinks, selected): (Vec<u32>, Vec<u32>) =
                    pos.iter().partition(|&&p| (p as usize) < self.cfg.sinks);
                let recent = m.recent_start.min(len)..len;
                let selected: Vec<u32> = selected
                    .into_iter()
                    .filter(|&p| !recent.contains(&(p as usize)))
                    .collect();
                // The window is read in place: on a compacted layer (FastKV's propagated
                // tokens) only the positions the layer holds.
                let recent = if store.layer(layer).is_compact() {
                    let held: Vec<u32> = store
                        .slot_positions(layer, h)
                        .into_iter()
                        .filter(|&p| recent.contains(&(p as usize)))
                        .collect();
                    runs_of(&held)
                } else if recent.is_empty() {
                    vec![]
                } else {
                    vec![[recent.start as u32, recent.end as u32]]
                };
                Held {
                    sinks: runs_of(&sinks),
                    selected: runs_of(&selected),
                    recent,
                    kept: vec![],
                }
            })
            .collect()
    }

    fn slow_log(&self) -> Option<&SlowLog> {
        Some(&self.log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;

    /// A store of `len` tokens whose key/value rows encode (head, position).
    fn store(nkv: usize, d: usize, len: usize) -> KvStore<f32> {
        let mut s = KvStore::<f32>::new(
            nkv,
            d,
            &[LayerSpec {
                capacity: len + 8,
                ring: false,
            }],
        );
        let k: Vec<f32> = (0..len * nkv * d)
            .map(|i| {
                let (t, h, c) = (i / (nkv * d), (i / d) % nkv, i % d);
                (t * 100 + h * 10 + c) as f32 * 0.01 + 0.5
            })
            .collect();
        s.write(0, 0, &k, &k).unwrap();
        s.set_len(len);
        s
    }

    /// One captured decode row per query head over `keys` keys; the `g` rows of kv head h
    /// peak (12 against 0) at `peaks[h]`.
    fn peaked_logits(g: usize, keys: usize, peaks: &[&[usize]]) -> Vec<f32> {
        let mut logits = vec![0.0f32; peaks.len() * g * keys];
        for hq in 0..peaks.len() * g {
            for &j in peaks[hq / g] {
                logits[hq * keys + j] = 12.0;
            }
        }
        logits
    }

    #[test]
    fn refresh_gathers_sinks_and_the_peaks_the_logits_point_at() {
        let (nkv, g, d, len) = (2, 2, 4, 200);
        let st = store(nkv, d, len);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 5), &[], &[], 100).unwrap();
        // One captured row per query head; kv head h's rows peak at 5 distinct positions.
        let peaks = [[10usize, 40, 41, 90, 150], [20, 60, 61, 110, 130]];
        let logits = peaked_logits(g, len, &[&peaks[0], &peaks[1]]);
        let call = AttnCall::decode(0, len - 1);
        p.observe(&call, 1, &logits, &st);
        assert_eq!(p.refreshes(), 1);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        for h in 0..nkv {
            let [compact, recent @ ..] = out[h].as_slice() else {
                panic!("segments expected")
            };
            let KvPositions::List(pos) = compact.pos else {
                panic!("compact segment has a list")
            };
            let mut want: Vec<u32> = vec![0, 1, 2];
            want.extend(peaks[h].iter().map(|&j| j as u32));
            assert_eq!(pos, &want[..], "head {h}");
            for (i, &j) in pos.iter().enumerate() {
                let rows = st.head(0, h);
                assert_eq!(&compact.k[i * d..(i + 1) * d], rows.k(j as usize));
                assert_eq!(&compact.v[i * d..(i + 1) * d], rows.v(j as usize));
            }
            // Recent window: page-aligned start (200 - 32 = 168, floor to 16 -> 160) to the end.
            assert_eq!(crate::policy::range_runs(recent, d), vec![(160, len - 160)]);
        }
    }

    /// The re-rank against a plain reference on fresh random memories: every key's `q·k` is
    /// within its page's bound, and the picked pages are the `want` highest-bound ones (each
    /// page's bound recomputed from its keys, max over the group's query heads).
    #[test]
    fn rerank_picks_the_pages_with_the_highest_bounds() {
        use super::super::selector_tests::Rng;
        let mut rng = Rng(17);
        for case in 0..40 {
            let (nkv, g, d) = (1 + rng.below(3), 1 + rng.below(3), 4 + rng.below(12));
            let (sinks, sel, page) = (rng.below(5), 1 + rng.below(90), 1 + rng.below(16));
            let len = sinks + sel;
            let k: Vec<f32> = (0..nkv * len * d).map(|_| rng.normal() as f32).collect();
            let mut mem = LayerMem::<f32> {
                v: k.clone(),
                k,
                pos: (0..nkv * len).map(|j| (j % len) as u32).collect(),
                len,
                recent_start: len,
                sinks,
                bounds: Vec::new(),
                pick: Vec::new(),
                share: 0.0,
            };
            page_bounds(&mut mem, nkv, d, page);
            let pages = sel.div_ceil(page);
            assert_eq!(mem.pages(page), pages);
            let q: Vec<f32> = (0..nkv * g * d).map(|_| rng.normal() as f32).collect();
            let want = 1 + rng.below(pages + 2);
            pick_pages(&mut mem, &q, want, page);
            for h in 0..nkv {
                // Reference: each page's bound from its keys, then the top `want`.
                let mut bounds: Vec<(f64, usize)> = (0..pages)
                    .map(|c| {
                        let rows = (sinks + c * page..(sinks + (c + 1) * page).min(len))
                            .map(|j| &mem.k[(h * len + j) * d..(h * len + j + 1) * d]);
                        let rows: Vec<&[f32]> = rows.collect();
                        let best = (0..g)
                            .map(|i| {
                                let qh = &q[(h * g + i) * d..(h * g + i + 1) * d];
                                let ub: f64 = (0..d)
                                    .map(|t| {
                                        let lo =
                                            rows.iter().map(|r| r[t]).fold(f32::INFINITY, f32::min);
                                        let hi = rows
                                            .iter()
                                            .map(|r| r[t])
                                            .fold(f32::NEG_INFINITY, f32::max);
                                        (qh[t] as f64 * lo as f64).max(qh[t] as f64 * hi as f64)
                                    })
                                    .sum();
                                for r in &rows {
                                    let dot: f64 =
                                        qh.iter().zip(*r).map(|(&a, &b)| a as f64 * b as f64).sum();
                                    assert!(
                                        dot <= ub + 1e-4,
                                        "case {case}: q·k {dot} above its page bound {ub}"
                                    );
                                }
                                ub
                            })
                            .fold(f64::NEG_INFINITY, f64::max);
                        (best, c)
                    })
                    .collect();
                bounds.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let got = mem.pick[h].clone();
                assert!(
                    got.windows(2).all(|w| w[0] < w[1]),
                    "case {case}: not ascending"
                );
                assert_eq!(got.len(), want.min(pages), "case {case}");
                // Same set up to near-ties at the cut (f32 against f64 sums).
                let cut = bounds[want.min(pages) - 1].0;
                for &(b, c) in &bounds {
                    if (b - cut).abs() > 1e-4 {
                        assert_eq!(
                            got.contains(&c),
                            b > cut,
                            "case {case}: page {c} bound {b} cut {cut}"
                        );
                    }
                }
            }
        }
    }

    /// With the re-rank on, a fast step reads the sinks, the picked pages and the recent
    /// window: with one key a page for the bounds, no more keys than without it.
    #[test]
    fn rerank_fast_step_reads_the_budget() {
        let (nkv, d, len) = (2, 8, 400);
        // The store holds the decoded token at `len` too (the fast step below reads it).
        let st = store(nkv, d, len + 1);
        let mut cfg = SfiConfig::new(4, 32, 64);
        cfg.pool = 2.0;
        cfg.trigger.kind = super::super::trigger::TriggerKind::Off;
        let mut p = SfiPolicy::<f32>::new(cfg, &[], &[], 10).unwrap();
        let call = AttnCall::decode(0, len - 1);
        // A slow step whose logits peak at 200 positions: the pool holds 128 of them.
        let peaks: Vec<usize> = (40..240).collect();
        let logits = peaked_logits(2, len, &[&peaks, &peaks]);
        p.observe(&call, 1, &logits, &st);
        p.end_forward(len - 1, 1);
        let m = p.mem(0).unwrap();
        assert_eq!(m.len, 4 + 128);
        assert_eq!(m.pages(16), 8);
        let q: Vec<f32> = (0..4 * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let call = AttnCall::decode(0, len);
        KvPolicy::<f32>::query(&mut p, &call, &q);
        let recent = len + 1 - p.mem(0).unwrap().recent_start;
        let mut out = Vec::new();
        p.segments(&call, &st, &mut out);
        for (h, o) in out.iter().enumerate() {
            let n: usize = o.iter().map(|s| s.len(d)).sum();
            // 8 page bounds paid from the 64 selected: 3 pages of 16.
            assert_eq!(n, 4 + 3 * 16 + recent, "kv head {h}");
            assert!(n + 8 <= 4 + 64 + recent);
        }
    }

    /// A store of `len` random keys (values equal to keys) in one global layer.
    fn random_store(
        rng: &mut super::super::selector_tests::Rng,
        nkv: usize,
        d: usize,
        len: usize,
    ) -> KvStore<f32> {
        let mut s = KvStore::<f32>::new(
            nkv,
            d,
            &[LayerSpec {
                capacity: len + 8,
                ring: false,
            }],
        );
        let k: Vec<f32> = (0..len * nkv * d).map(|_| rng.normal() as f32).collect();
        s.write(0, 0, &k, &k).unwrap();
        s.set_len(len);
        s
    }

    /// The cheaper slow step against its plain reference, on fresh random keys, queries and
    /// logits: the step reads the sinks' page, the recent window and exactly the top pages
    /// of `candidates::candidate_pages` (shared by the kv heads), charged a key read a page
    /// bound; the memory it selects equals a dense slow step's whose logits on the keys it
    /// did not read are -inf (the Selector's "cannot see"), gathered from the right slots.
    #[test]
    fn cheaper_slow_step_selects_as_a_dense_step_that_sees_only_its_pages() {
        use super::super::selector_tests::Rng;
        use crate::quest::PageBounds;
        let mut rng = Rng(41);
        for case in 0..12 {
            let (nkv, g, d) = (1 + rng.below(3), 1 + rng.below(3), 4 + rng.below(8));
            let len = 300 + rng.below(200);
            let st = random_store(&mut rng, nkv, d, len);
            let mut cfg = SfiConfig::new(1 + rng.below(20), 32, 24 + rng.below(24));
            cfg.trigger.kind = super::super::trigger::TriggerKind::Off;
            // Span pooling looks at neighbouring indices, which differ between the two
            // layouts next to a page left out; the rest of the Selector must agree.
            cfg.selector.soft_alpha = 0.0;
            let mut dense = SfiPolicy::<f32>::new(cfg.clone(), &[], &[], 10).unwrap();
            cfg.candidates = 1.0 + rng.below(3) as f32;
            let mut cheap = SfiPolicy::<f32>::new(cfg.clone(), &[], &[], 10).unwrap();
            // A bootstrap memory for both, then a slow step at `hi - 1`.
            let boot = AttnCall::decode(0, len - 40);
            let logits: Vec<f32> = (0..nkv * g * (len - 39))
                .map(|_| rng.normal() as f32)
                .collect();
            for p in [&mut dense, &mut cheap] {
                p.observe(&boot, 1, &logits, &st);
                p.end_forward(len - 40, 1);
                p.slow_now = true;
            }
            let call = AttnCall::decode(0, len - 1);
            let q: Vec<f32> = (0..nkv * g * d).map(|_| rng.normal() as f32).collect();
            KvPolicy::<f32>::query(&mut cheap, &call, &q);
            let mut out = Vec::new();
            cheap.segments(&call, &st, &mut out);
            // The reference view: bounds from the keys, then the top pages.
            let page = 16;
            let rs = (len - 32) / page * page;
            let (first, pages) = (cfg.sinks.div_ceil(page), rs / page);
            let want = (cfg.candidates as usize * cfg.selected).div_ceil(page);
            let bounds: Vec<PageBounds> = (0..nkv)
                .map(|h| {
                    let mut b = PageBounds::default();
                    let rows = st.head(0, h);
                    b.update(|t| rows.k(t), rs, page, d);
                    b
                })
                .collect();
            let forced = [cfg.sinks / page, pages - 1];
            let picked = candidate_pages(&bounds, &q, d, (first, pages), &forced, want);
            assert_eq!(picked.len(), want, "case {case}");
            let mut view: Vec<u32> = (0..(first * page) as u32).collect();
            for &c in &picked {
                view.extend((c * page) as u32..((c + 1) * page) as u32);
            }
            view.extend(rs as u32..len as u32);
            for (h, o) in out.iter().enumerate() {
                let read: Vec<u32> = o
                    .iter()
                    .flat_map(|sg| match sg.pos {
                        KvPositions::Range { start } => start..start + sg.len(d) as u32,
                        KvPositions::List(_) => panic!("a slow step reads the cache in place"),
                    })
                    .collect();
                assert_eq!(read, view, "case {case}, kv head {h}");
            }
            drop(out);
            // Logits over the view for the cheap step; the same values, -inf elsewhere, dense.
            let row: Vec<f32> = (0..nkv * g * len)
                .map(|_| rng.normal() as f32 * 3.0)
                .collect();
            let mut masked = vec![f32::NEG_INFINITY; nkv * g * len];
            let mut over_view = Vec::new();
            for hq in 0..nkv * g {
                for &j in &view {
                    masked[hq * len + j as usize] = row[hq * len + j as usize];
                    over_view.push(row[hq * len + j as usize]);
                }
            }
            cheap.observe(&call, 1, &over_view, &st);
            KvPolicy::<f32>::segments(&mut dense, &call, &st, &mut Vec::new());
            dense.observe(&call, 1, &masked, &st);
            let (a, b) = (cheap.mem(0).unwrap(), dense.mem(0).unwrap());
            assert_eq!(a.pos, b.pos, "case {case}");
            assert_eq!((&a.k, &a.v), (&b.k, &b.v), "case {case}");
            assert!(a.pos.iter().all(|p| view.binary_search(p).is_ok()));
            for (p, kind) in [(&mut cheap, "cheap"), (&mut dense, "dense")] {
                p.end_forward(len - 1, 1);
                let s = KvPolicy::<f32>::stats(p);
                // The bootstrap read nothing through `segments`: one slow step counted.
                assert_eq!((s.slow_steps, s.fast_steps), (1, 0), "{kind}");
                let read = s.attended_tokens;
                let want_read = if kind == "cheap" {
                    (view.len() + pages - first) as f64
                } else {
                    len as f64
                };
                assert_eq!(read, want_read, "case {case}: {kind}");
            }
        }
    }

    /// The cheaper slow step applies only where it reads less: a sequence whose candidate
    /// pages cover everything before the window, a fast step, a layer without a memory and
    /// the flag off read as before.
    #[test]
    fn cheaper_slow_step_only_where_it_leaves_pages_out() {
        let (nkv, d, len) = (1, 4, 200);
        let st = store(nkv, d, len);
        let mut cfg = SfiConfig::new(4, 32, 48);
        cfg.trigger.kind = super::super::trigger::TriggerKind::Off;
        cfg.candidates = 2.0; // 6 pages of the 9 after page 0 and before the window (160)
        let mut p = SfiPolicy::<f32>::new(cfg.clone(), &[], &[], 10).unwrap();
        let call = AttnCall::decode(0, len - 1);
        let q = vec![1.0f32; d];
        // No memory yet: dense.
        p.slow_now = true;
        KvPolicy::<f32>::query(&mut p, &call, &q);
        assert_eq!(p.candidate_step(&call, &st), None);
        let logits = peaked_logits(1, len, &[&[50, 60]]);
        p.observe(&call, 1, &logits, &st);
        p.end_forward(len - 1, 1);
        let call = AttnCall::decode(0, len);
        // A fast step: the memory, not the view.
        assert_eq!(p.candidate_step(&call, &st), None);
        p.slow_now = true;
        KvPolicy::<f32>::query(&mut p, &call, &q);
        assert_eq!(p.candidate_step(&call, &st), Some(6));
        // Seven pages wanted of nine: still one left out... nine of nine: dense.
        p.cfg.candidates = 3.0;
        assert_eq!(p.candidate_step(&call, &st), None);
        p.cfg.candidates = 0.0;
        assert_eq!(p.candidate_step(&call, &st), None);
    }

    #[test]
    fn held_reports_sinks_selected_and_the_recent_window() {
        let (nkv, g, d, len) = (2, 2, 4, 200);
        let st = store(nkv, d, len);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 5), &[], &[], 100).unwrap();
        // Before any refresh the layer is dense: everything, kept.
        let dense = KvPolicy::<f32>::held(&p, 0, &st);
        assert_eq!(dense, vec![Held::kept_range(0..len); nkv]);
        let peaks = [[10usize, 40, 41, 90, 150], [20, 60, 61, 110, 130]];
        let logits = peaked_logits(g, len, &[&peaks[0], &peaks[1]]);
        p.observe(&AttnCall::decode(0, len - 1), 1, &logits, &st);
        let held = KvPolicy::<f32>::held(&p, 0, &st);
        assert_eq!(held[0].sinks, vec![[0, 3]]);
        assert_eq!(
            held[0].selected,
            vec![[10, 11], [40, 42], [90, 91], [150, 151]]
        );
        assert_eq!(
            held[1].selected,
            vec![[20, 21], [60, 62], [110, 111], [130, 131]]
        );
        for h in &held {
            assert_eq!(h.recent, vec![[160, 200]]);
            assert!(h.kept.is_empty());
        }
    }

    /// Drive one decode step of a one-layer sequence at position `pos` through the seam the
    /// way the model does (token, capture, segments, observe, end of forward).
    fn decode_step(p: &mut SfiPolicy<f32>, st: &KvStore<f32>, pos: usize, token: u32) {
        KvPolicy::<f32>::on_token(p, token);
        let call = AttnCall::decode(0, pos);
        let rows = KvPolicy::<f32>::capture_rows(p, &call);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(p, &call, st, &mut out);
        drop(out);
        if rows > 0 {
            let logits = peaked_logits(2, pos + 1, &[&[10, 40, 90]]);
            KvPolicy::<f32>::observe(p, &call, rows, &logits, st);
        }
        KvPolicy::<f32>::end_forward(p, pos, 1);
    }

    #[test]
    fn slow_log_names_each_slow_steps_reason() {
        let st = store(1, 4, 200);
        let mut cfg = SfiConfig::new(3, 32, 3);
        cfg.trigger = TriggerConfig {
            kind: super::super::trigger::TriggerKind::Periodic,
            period: 3,
            ..TriggerConfig::default()
        };
        let mut p = SfiPolicy::<f32>::new(cfg, &[], &[], 100).unwrap();
        // Step 1 builds the memory (no bootstrap ran), steps 3 and 6 are periodic.
        for (i, pos) in (150..157).enumerate() {
            decode_step(&mut p, &st, pos, 7 + i as u32);
        }
        let log = KvPolicy::<f32>::slow_log(&p).unwrap();
        let got: Vec<(u32, SlowReason)> =
            log.steps().iter().map(|s| (s.position, s.reason)).collect();
        assert_eq!(
            got,
            vec![
                (150, SlowReason::Bootstrap),
                (152, SlowReason::Periodic),
                (155, SlowReason::Periodic)
            ]
        );
        let stats = KvPolicy::<f32>::stats(&p);
        assert_eq!((stats.slow_steps, stats.fast_steps), (3, 4));
        assert_eq!(log.total(), stats.slow_steps);
        // A sequence within the budget: every step dense, logged as short.
        let short = store(1, 4, 30);
        let mut q = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 3), &[], &[], 100).unwrap();
        for pos in 20..23 {
            decode_step(&mut q, &short, pos, 7);
        }
        let reasons: Vec<SlowReason> = KvPolicy::<f32>::slow_log(&q)
            .unwrap()
            .steps()
            .iter()
            .map(|s| s.reason)
            .collect();
        assert_eq!(reasons, vec![SlowReason::Short; 3]);
    }

    /// The drift trigger's shares against a plain f64 softmax on fresh random logits, and the
    /// trigger they drive: a fast step whose share falls below `drift` times the refresh's
    /// makes the next step slow (logged as drift); one above it does not.
    #[test]
    fn drift_shares_match_a_plain_softmax_and_fire_the_next_step() {
        use super::super::selector_tests::Rng;
        use super::super::trigger::TriggerKind;
        let mut rng = Rng(5);
        // share = sum over `sel` of e^l / sum over `sel` and `rest`, in f64.
        let plain = |l: &[f32], sel: &[usize], rest: &[usize]| {
            let e = |j: &usize| (l[*j] as f64).exp();
            let a: f64 = sel.iter().map(e).sum();
            a / (a + rest.iter().map(e).sum::<f64>())
        };
        let (nkv, g, d, len) = (2, 3, 4, 220);
        let st = store(nkv, d, len);
        let mut cfg = SfiConfig::new(3, 32, 5);
        cfg.drift = 0.5;
        cfg.trigger = TriggerConfig {
            kind: TriggerKind::Off,
            min_gap: 1,
            ..TriggerConfig::default()
        };
        let mut p = SfiPolicy::<f32>::new(cfg, &[], &[], 100).unwrap();
        // Step at position 200: no memory yet, a dense capture over 201 keys refreshes it.
        let (pos, keys) = (200, 201);
        KvPolicy::<f32>::on_token(&mut p, 7);
        let call = AttnCall::decode(0, pos);
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &call), 1);
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut Vec::new());
        let logits: Vec<f32> = (0..nkv * g * keys)
            .map(|_| 3.0 * rng.normal() as f32)
            .collect();
        KvPolicy::<f32>::observe(&mut p, &call, 1, &logits, &st);
        KvPolicy::<f32>::end_forward(&mut p, pos, 1);
        // Recent window from (201 - 32) / 16 * 16 = 160.
        let mem = p.layers[0].as_ref().unwrap();
        let mut want = 0.0;
        for hq in 0..nkv * g {
            let h = hq / g;
            let sel: Vec<usize> = mem.pos[h * mem.len + 3..(h + 1) * mem.len]
                .iter()
                .map(|&j| j as usize)
                .collect();
            let rest: Vec<usize> = (0..3).chain(160..keys).collect();
            want += plain(&logits[hq * keys..(hq + 1) * keys], &sel, &rest);
        }
        want /= (nkv * g) as f64;
        assert!((mem.share - want).abs() < 1e-9, "{} vs {want}", mem.share);
        let reference = mem.share;
        // Fast steps: the logits are over [3 sinks, 5 selected, the window 160..=pos].
        let fast = |p: &mut SfiPolicy<f32>, pos: usize, lift: f32, rng: &mut Rng| -> (bool, f64) {
            KvPolicy::<f32>::on_token(p, 7);
            let slow = p.slow_now;
            let call = AttnCall::decode(0, pos);
            let rows = KvPolicy::<f32>::capture_rows(p, &call);
            let mut out = Vec::new();
            KvPolicy::<f32>::segments(p, &call, &st, &mut out);
            let read: usize = out[0].iter().map(|s| s.len(d)).sum();
            drop(out);
            if slow {
                let logits = vec![0.0; nkv * g * (pos + 1)];
                KvPolicy::<f32>::observe(p, &call, rows, &logits, &st);
                KvPolicy::<f32>::end_forward(p, pos, 1);
                return (true, 0.0);
            }
            assert_eq!((rows, read), (1, 8 + pos + 1 - 160), "a fast step captures");
            let logits: Vec<f32> = (0..nkv * g * read)
                .map(|i| {
                    rng.normal() as f32
                        + if (3..8).contains(&(i % read)) {
                            lift
                        } else {
                            0.0
                        }
                })
                .collect();
            let mut share = 0.0;
            for l in logits.chunks(read) {
                let rest: Vec<usize> = (0..3).chain(8..read).collect();
                share += plain(l, &[3, 4, 5, 6, 7], &rest);
            }
            KvPolicy::<f32>::observe(p, &call, 1, &logits, &st);
            assert!((p.drift_now.0 - share / (nkv * g) as f64).abs() < 1e-9);
            assert!((p.drift_now.1 - reference).abs() < 1e-12);
            KvPolicy::<f32>::end_forward(p, pos, 1);
            (false, share / (nkv * g) as f64)
        };
        // Selected keys far above the rest: the share holds, nothing fires.
        let (slow, share) = fast(&mut p, 201, 8.0, &mut rng);
        assert!(!slow && share >= 0.5 * reference, "{share} vs {reference}");
        let (slow, share) = fast(&mut p, 202, -8.0, &mut rng);
        assert!(!slow && share < 0.5 * reference, "{share} vs {reference}");
        // The share fell below half the refresh's: the next step is slow, logged as drift.
        assert!(fast(&mut p, 203, 0.0, &mut rng).0);
        let log = KvPolicy::<f32>::slow_log(&p).unwrap();
        let reasons: Vec<(u32, SlowReason)> =
            log.steps().iter().map(|s| (s.position, s.reason)).collect();
        assert_eq!(
            reasons,
            vec![(200, SlowReason::Bootstrap), (203, SlowReason::Drift)]
        );
        // Without the drift trigger a fast step captures nothing.
        let mut q = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 5), &[], &[], 100).unwrap();
        KvPolicy::<f32>::on_token(&mut q, 7);
        KvPolicy::<f32>::observe(&mut q, &AttnCall::decode(0, 200), 1, &logits, &st);
        KvPolicy::<f32>::end_forward(&mut q, 200, 1);
        KvPolicy::<f32>::on_token(&mut q, 7);
        assert_eq!(
            KvPolicy::<f32>::capture_rows(&q, &AttnCall::decode(0, 201)),
            0
        );
    }

    /// A compacted layer (FastKV's propagated tokens): slots carry explicit positions. The
    /// memory holds the sinks by position, the positions of the slots the logits point at, and
    /// the recent window starts at a position; a layer holding no more than the budget stays
    /// dense.
    #[test]
    fn compacted_layers_select_slots_and_keep_their_positions() {
        let (nkv, g, d) = (2, 2, 4);
        // Positions 0..4 (sinks), then every third position up to 297: 104 slots.
        let pos: Vec<u32> = (0..4).chain((6..300).step_by(3)).collect();
        let keys = pos.len();
        let mut st = KvStore::<f32>::new(
            nkv,
            d,
            &[LayerSpec {
                capacity: 400,
                ring: false,
            }],
        );
        let kv: Vec<f32> = pos
            .iter()
            .flat_map(|&p| (0..nkv * d).map(move |i| p as f32 + (i / d) as f32 * 0.25 + 0.5))
            .collect();
        st.write_at(0, &pos, &kv, &kv).unwrap();
        st.set_len(300);
        assert!(st.layer(0).is_compact());
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 4), &[], &[], 100).unwrap();
        let peak_slots = [[10usize, 20, 30, 40], [15, 25, 35, 45]];
        let logits = peaked_logits(g, keys, &[&peak_slots[0], &peak_slots[1]]);
        let call = AttnCall::decode(0, 299);
        p.observe(&call, 1, &logits, &st);
        assert_eq!(p.refreshes(), 1);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        for h in 0..nkv {
            let [compact, recent] = out[h].as_slice() else {
                panic!("two segments expected")
            };
            let KvPositions::List(got) = compact.pos else {
                panic!("compact segment has a list")
            };
            let mut want: Vec<u32> = vec![0, 1, 2];
            want.extend(peak_slots[h].iter().map(|&j| pos[j]));
            assert_eq!(got, &want[..], "head {h}");
            for (i, &q) in got.iter().enumerate() {
                assert_eq!(compact.k[i * d], q as f32 + h as f32 * 0.25 + 0.5);
            }
            // Recent window: positions from (300 - 32) / 16 * 16 = 256, i.e. the held ones.
            let KvPositions::List(r) = recent.pos else {
                panic!("a compacted layer's recent window has a position list")
            };
            let held: Vec<u32> = pos.iter().copied().filter(|&q| q >= 256).collect();
            assert_eq!(r, &held[..]);
        }
        // Inspection: the window is the held positions from 256 (every third one), the
        // selected keys are at their positions.
        drop(out);
        let insp = KvPolicy::<f32>::held(&p, 0, &st);
        for (h, ins) in insp.iter().enumerate() {
            let window: Vec<u32> = pos.iter().copied().filter(|&q| q >= 256).collect();
            assert_eq!(ins.recent, crate::inspect::runs_of(&window));
            let sel: Vec<u32> = peak_slots[h].iter().map(|&j| pos[j]).collect();
            assert_eq!(ins.selected, crate::inspect::runs_of(&sel));
            assert_eq!(ins.sinks, vec![[0, 3]]);
        }
        // Holding no more than the budget: dense.
        let mut q = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 80), &[], &[], 100).unwrap();
        q.observe(&call, 1, &logits, &st);
        assert_eq!(q.refreshes(), 0);
        assert!(q.mem(0).is_none());
    }

    #[test]
    fn key_norms_extend_incrementally_and_match_a_fresh_computation() {
        let (nkv, g, d) = (2, 2, 12);
        let st = store(nkv, d, 200);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(2, 16, 8), &[], &[], 100).unwrap();
        for len in [120usize, 200, 160] {
            let call = AttnCall::decode(0, len - 1);
            let logits = vec![0.5f32; nkv * g * len];
            p.observe(&call, 1, &logits, &st);
            assert_eq!(p.norms.len(), nkv * len);
            for h in 0..nkv {
                let rows = st.head(0, h);
                for j in 0..len {
                    let row = rows.k(j);
                    let want = row.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
                    let got = p.norms[h * len + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want,
                        "len {len} head {h} pos {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn prefill_captures_wait_for_end_prefill_and_only_the_last_chunk_counts() {
        let (nkv, g, d, len) = (1, 2, 4, 200);
        let mut st = store(nkv, d, len);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(2, 32, 3), &[], &[], 100).unwrap();
        assert_eq!(KvPolicy::<f32>::prefill_tail(&p), 16);
        // Two chunks' captures (2 rows each): the first points at 10, 11, 12, the last at
        // 50, 60, 70.
        for (hi, peaks) in [(150usize, [10usize, 11, 12]), (200, [50, 60, 70])] {
            let call = AttnCall {
                layer: 0,
                pos0: hi - 2,
                n: 2,
                lo: 0,
                sliding: false,
            };
            let mut logits = vec![0.0f32; nkv * g * 2 * hi];
            for r in 0..g * 2 {
                for &j in &peaks {
                    logits[r * hi + j] = 15.0;
                }
            }
            p.observe(&call, 2, &logits, &st);
            assert_eq!(
                p.refreshes(),
                0,
                "no Selector run before the end of prefill"
            );
        }
        KvPolicy::<f32>::end_prefill(&mut p, &mut st).unwrap();
        assert_eq!(p.refreshes(), 1);
        let m = p.mem(0).expect("a memory after the bootstrap");
        assert_eq!(m.pos, vec![0, 1, 50, 60, 70]);
        // Nothing pending any more: a second end_prefill selects nothing.
        KvPolicy::<f32>::end_prefill(&mut p, &mut st).unwrap();
        assert_eq!(p.refreshes(), 1);
    }

    #[test]
    fn short_sequences_stay_dense() {
        let st = store(1, 4, 50);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(4, 32, 20), &[], &[], 100).unwrap();
        let call = AttnCall::decode(0, 49);
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &call), 0);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        assert_eq!(crate::policy::range_runs(&out[0], 4), vec![(0, 50)]);
    }
}
