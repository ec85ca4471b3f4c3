//! KV policies of the GPU decoder: full KV, StreamingLLM, SFI, SnapKV, PyramidKV, Quest, H2O
//! (methods.md §1-2) and the diagnostic oracles. The global layers of a sparse policy decode through
//! `attn_sparse_decode_*`: per (layer, slot) a compact buffer of chosen rows, its length and
//! the start of a range read in place, all on the device, so a fast step needs no host work and
//! replays as one CUDA graph; sliding layers keep their window.
//!
//! SnapKV / PyramidKV per (global layer, slot): at the end of prefill the last `window` prompt
//! rows attend densely and leave their scores; `snap_select` (ops/snapkv.rs) keeps the top
//! `capacity - window` keys of the rest a kv head in the compact buffer, and the window and
//! every decoded token after it are read in place from `rstart = prompt - window`. Nothing is
//! selected again. The cache itself stays allocated (the dropped rows are not read).
//!
//! Quest per (global layer, slot): per-page key bounds (`[slot, kv_head, page, 2, head_dim]`),
//! all computed after each prefill and the newest full pages again at every decode step; each
//! decode step scores the pages against its query, keeps the top `pages - 1` full ones a kv
//! head (ops/quest.rs) and reads them in place through the sparse kernel's page list, with the
//! newest, partial page as the range read in place. The first `dense_layers` layers read
//! densely. Nothing is evicted, as on the CPU.
//!
//! H2O per (global layer, slot): every key's score (`[slot, kv_head, capacity]`), summed from
//! each prefill row's probabilities (the rows re-attend in sub-chunks whose capture leaves their
//! logits, ops/h2o.rs) and each decode step's; at the end of a prefill the top `heavy` keys before
//! the window go to the compact buffer (`sfi_topk` and the gather), and every decode step adds its
//! probabilities and evicts one key inside the step's graph (`CudaContext::h2o_decode`), so the compact
//! buffer always holds the heavy hitters and the window `[len - recent, len)` is read in place.
//!
//! Oracle per (global layer, slot) (`slowfast_kv::oracle::OracleRule`, diagnostic): a step due a
//! selection attends densely and captures its scores, `snap_select` keeps the exact top keys of
//! its own query a kv head (one row, no pooling, from the sinks on), the gather puts them
//! behind the sinks, and the layer attends again over that memory and the keys from the
//! domain's end; the steps in between (`every` > 1) read it as a fast step does.
//!
//! SFI per (global layer, slot): a compact buffer of the sinks and the Selector's choice
//! (`[slot, kv_head, ccap, head_dim]`), rebuilt at each refresh, and the recent window read in
//! place from `rstart`. A slow step attends densely and captures the scores of its query (one
//! row per query head); the prefill bootstrap captures the last `bootstrap_rows` prompt rows.
//! The Selector then runs on the device (ops/sfi.rs) and the gather publishes the new memory:
//! after a slow decode step for all global layers of a sequence at once (one launch per stage,
//! layers x kv heads blocks), at the bootstrap layer by layer (its 16 captured rows per layer
//! would not all fit).
//!
//! Asynchronous refresh (a refresh lag L > 0, the default): a slow decode step's Selector and
//! gather run on the context's side stream into staging copies of the compact buffers, clen and
//! rstart, overlapping the next fast steps, which keep reading the previous memory (still exact
//! for what it holds: its compact rows plus the recent window from its older start); L steps
//! later the decode stream waits for that work and `publish` copies the staged memory into the
//! live buffers. The prefill bootstrap and a sequence's first memory stay synchronous.

use half::bf16;

use crate::buffer::GpuBuffer;
use crate::context::CudaContext;
use crate::error::CudaError;
use crate::ops::attention::AttnWorkspace;
use crate::ops::h2o::{H2oColsum, H2oScratch, H2oSettle, H2oStep, H2oStepScratch, H2O_MAX_GROUP};
use crate::ops::quest::{QuestArgs, QuestPages, QuestScratch, QUEST_FRESH};
use crate::ops::sfi::{
    GatherArgs, SelectArgs, SelectView, SelectorConfig, SelectorScratch, SparseDecode, SparsePost,
};
use crate::ops::sfi_cand::{CandPick, ViewPlan, VMETA};
use crate::ops::snapkv::{SnapArgs, SnapScratch};
use crate::ops::KvLayout;
use slowfast_kv::oracle::OracleRule;
use slowfast_kv::pyramid::pyramid_budgets;
use slowfast_kv::quest::QuestPolicy;

/// SFI on the GPU: S sinks + k Selector-chosen tokens + a recent window (page-aligned start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSfiConfig {
    pub sinks: usize,
    pub recent: usize,
    pub selected: usize,
    pub page: usize,
    pub bootstrap_rows: usize,
    pub selector: SelectorConfig,
    /// Decode steps between a slow step and the publication of its new memory: above 0 the
    /// Selector runs on a second stream, overlapped with that many fast steps that keep the
    /// previous memory; 0 refreshes in order, within the slow step (the CPU's SFI).
    pub refresh_lag: usize,
    /// The cheaper slow step (`SfiConfig::candidates`, 0 = off): a slow step reads the sinks'
    /// pages, the recent window and `candidates x selected` tokens' worth of the pages with
    /// the highest Quest bound, and the Selector chooses among them (kernels/sfi_cand.cu).
    pub candidates: f32,
}

/// SnapKV (PyramidKV with `pyramid_beta`) on the GPU: the CPU policy's knobs
/// (`slowfast_kv::snapkv::SnapKvConfig`), the same rules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSnapConfig {
    /// Tokens kept a kv head in each global layer (PyramidKV: the mean), window included.
    pub capacity: usize,
    /// The observation window: the last prompt rows, which score the keys and stay.
    pub window: usize,
    /// Max-pooling kernel (odd).
    pub kernel: usize,
    pub pyramid_beta: Option<f64>,
}

impl GpuSnapConfig {
    /// Capacities (window included) of `layers` global layers for a prompt of `n` tokens:
    /// the CPU's (`SnapKvPolicy::end_prefill`).
    pub fn capacities(&self, layers: usize, n: usize) -> Vec<usize> {
        match self.pyramid_beta {
            Some(beta) => pyramid_budgets(self.capacity, self.window, layers, n, beta),
            None => vec![self.capacity; layers],
        }
    }

    /// The most keys a layer's selection may keep, over every prompt length: PyramidKV's
    /// bottom layer keeps at most `2 (C - w) - min` plus one of the rounding.
    pub fn max_picks(&self) -> usize {
        let c = self.capacity - self.window;
        match self.pyramid_beta {
            Some(_) => 2 * c + 1,
            None => c,
        }
    }
}

/// Quest on the GPU: the CPU policy's numbers (`slowfast_kv::quest::QuestPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuQuestConfig {
    /// Pages read a decode step, the newest (partial) one included.
    pub pages: usize,
    /// Tokens a page.
    pub page: usize,
    /// The first this many layers read densely.
    pub dense_layers: usize,
}

impl GpuQuestConfig {
    /// The CPU policy's configuration for a budget of `budget` tokens a kv head.
    pub fn for_budget(budget: usize) -> Self {
        let p = QuestPolicy::new(budget);
        GpuQuestConfig {
            pages: p.pages(),
            page: p.page,
            dense_layers: p.dense_layers,
        }
    }
}

/// Which KV policy the decoder's global layers run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GpuKvPolicy {
    Full,
    /// StreamingLLM: the first `sinks` and the last `recent` tokens.
    Streaming {
        sinks: usize,
        recent: usize,
    },
    Sfi(GpuSfiConfig),
    /// SnapKV / PyramidKV: one selection at the end of prefill.
    Snap(GpuSnapConfig),
    /// Quest: the top pages by a key-bound score, chosen at every decode step.
    Quest(GpuQuestConfig),
    /// H2O: the `heavy` best-scored older keys and the `recent` newest, one eviction a step
    /// (the CPU's `slowfast_kv::h2o::H2oPolicy`).
    H2o {
        heavy: usize,
        recent: usize,
    },
    /// Diagnostic only (`eval`): the exact top keys of each decode step's own query (or SFI's
    /// layout with an exact choice), the CPU's `slowfast_kv::oracle` rules.
    Oracle(OracleRule),
}

impl GpuKvPolicy {
    /// SnapKV's (PyramidKV's) configuration, when the policy is one of them.
    pub fn snap(&self) -> Option<GpuSnapConfig> {
        match *self {
            GpuKvPolicy::Snap(c) => Some(c),
            _ => None,
        }
    }

    /// The policy's sizes, for messages.
    pub fn describe(&self) -> String {
        match self {
            GpuKvPolicy::Full => "full KV".into(),
            GpuKvPolicy::Streaming { sinks, recent } => format!("{sinks} sinks + {recent} recent"),
            GpuKvPolicy::Sfi(c) => format!(
                "{} sinks + {} selected + {} recent (page {}, {} bootstrap rows{})",
                c.sinks,
                c.selected,
                c.recent,
                c.page,
                c.bootstrap_rows,
                if c.candidates > 0.0 {
                    format!(", slow steps over {}x candidates", c.candidates)
                } else {
                    String::new()
                }
            ),
            GpuKvPolicy::Snap(c) => format!(
                "{} kept a layer{} with a {}-token window (pooling {})",
                c.capacity,
                if c.pyramid_beta.is_some() {
                    " on average"
                } else {
                    ""
                },
                c.window,
                c.kernel
            ),
            GpuKvPolicy::Quest(c) => format!(
                "{} pages of {} a step ({} dense layers first)",
                c.pages, c.page, c.dense_layers
            ),
            GpuKvPolicy::H2o { heavy, recent } => {
                format!("{heavy} heavy hitters + {recent} recent")
            }
            GpuKvPolicy::Oracle(r) => {
                let (sinks, recent, k) = r.layout();
                format!(
                    "the exact top {k} keys{} of the step's query, selected every {} step(s)",
                    if recent > 0 {
                        format!(" + {sinks} sinks + {recent} recent")
                    } else {
                        String::new()
                    },
                    r.every
                )
            }
        }
    }

    /// Rows at the end of a prompt that a prefill must compute for the policy to build its
    /// memory, when only a prefill builds it (SnapKV's observation window); None otherwise
    /// (SFI's decode steps build one too).
    pub fn prefill_rows(&self) -> Option<usize> {
        match *self {
            GpuKvPolicy::Snap(c) => Some(c.window),
            _ => None,
        }
    }

    /// Sequences up to this length attend densely (a sparse memory would not be smaller).
    pub fn dense_below(&self) -> usize {
        match *self {
            GpuKvPolicy::Full => usize::MAX,
            GpuKvPolicy::Streaming { sinks, recent } => sinks + recent,
            GpuKvPolicy::Sfi(c) => c.sinks + c.selected + c.recent,
            // a prompt within the capacity keeps everything, in every layer (PyramidKV's
            // budgets are then all at least the prompt)
            GpuKvPolicy::Snap(c) => c.capacity,
            // every page is read (as the CPU's `n_pages > pages()` test)
            GpuKvPolicy::Quest(c) => c.pages * c.page,
            GpuKvPolicy::H2o { heavy, recent } => heavy + recent,
            GpuKvPolicy::Oracle(r) => r.budget,
        }
    }

    /// Whether requests may share a cached prompt prefix under the policy: not H2O, whose
    /// scores sum the attention of every prompt row (the CPU's `KvPolicy::shares_prefix`).
    pub fn shares_prefix(&self) -> bool {
        !matches!(self, GpuKvPolicy::H2o { .. })
    }

    /// Whether a sparse decode step may run `qkv_post` inside the attention kernel: not when
    /// the policy reads the step's query outside it (Quest's page scores, H2O's scores).
    pub fn post_in_attention(&self) -> bool {
        !matches!(
            self,
            GpuKvPolicy::Quest(_) | GpuKvPolicy::H2o { .. } | GpuKvPolicy::Oracle(_)
        )
    }

    /// Whether a capturing decode step's output reads the memory it chose within the step (the
    /// oracle: its dense pass only scores), so that it counts as a sparse step, as on the CPU;
    /// SFI's slow steps output their dense (or view) attention.
    pub fn selects_within_step(&self) -> bool {
        matches!(self, GpuKvPolicy::Oracle(_))
    }

    /// Whether some decode steps capture the dense scores of their query (SFI's slow steps,
    /// the oracle's selections), chosen per slot by `SparseState::wants_capture`.
    pub fn captures_in_decode(&self) -> bool {
        matches!(self, GpuKvPolicy::Sfi(_) | GpuKvPolicy::Oracle(_))
    }
}

/// Slots whose slow steps capture scores in one decode step (a row each of every global
/// layer's score buffer): at 12 x 128K of Qwen3-4B the buffer for every slot took 7.2 GiB,
/// for 4 it takes 2.4. More slow steps at once wait a step (a slot without a memory reads
/// densely meanwhile). The number lives with the riding rule it bounds.
pub use slowfast_kv::sfi::trigger::CAPTURE_ROWS;

/// Key tiles (`DECODE_BK`, 64 keys) a block of the sparse fast step streams at most (when the
/// wave allows that many blocks). The kernel's 3-stage ring loads two tiles before its
/// `pdl_wait()`, so a third is in flight while the first two are scored.
/// - Run 68 (before the loads moved ahead of the wait), StreamingLLM at 8K with 2048 tokens a
///   head, Qwen3-4B shapes, batch 1, 33 (one wave, one tile a block) / 16 / 8 / 4 splits:
///   2.742 / 2.693 / 2.589 / 2.723 ms a step; batch 6, 2 / 3 / 5 (one wave) / 8: 4.033 / 4.049 /
///   **3.931** / 4.018 ms.
/// - Run 90 (with them), batch 1 at 8K, 8 / 11 / 16 / 32 splits: StreamingLLM 2.501 / **2.475**
///   / 2.632 / 2.635 ms, SFI's fast step (2113 keys a head, so 9, 12 and 17 splits hold keys at
///   11, 16 and 32) 2.520 / **2.466** / 2.459 / 2.469; batch 6, 5 / 8 / 11: 3.611 / 3.807 /
///   3.799.
const FAST_TILES_PER_SPLIT: usize = 3;

/// The sparse fast step's split count: one wave of blocks (`wave`), but no more splits than
/// leave each block at most [`FAST_TILES_PER_SPLIT`] tiles of the `attended` keys a head.
fn fast_step_splits(wave: usize, attended: usize) -> usize {
    let tiles = attended.div_ceil(crate::ops::attention::DECODE_BK);
    wave.min(tiles.div_ceil(FAST_TILES_PER_SPLIT)).max(1)
}

/// One (slot) refresh during a forward: the sequence length after the forward's tokens, the
/// captured rows per query head and, for the prefill bootstrap, the first captured row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refresh {
    pub slot: usize,
    pub len: usize,
    pub rows: usize,
    /// Bootstrap: index in the prefill chunk of the first captured row.
    pub boot_row0: Option<usize>,
}

impl Refresh {
    /// The bootstrap of `slot` at length `len` by a prefill chunk of `m` rows: its last
    /// `rows` (at most `m`) capture.
    pub fn bootstrap(slot: usize, len: usize, rows: usize, m: usize) -> Self {
        let rows = rows.min(m);
        Refresh {
            slot,
            len,
            rows,
            boot_row0: Some(m - rows),
        }
    }
}

/// Device state of a sparse policy. Per-layer arrays cover the global layers only (index
/// `gi`, see `gidx`).
pub(crate) struct SparseState {
    pub policy: GpuKvPolicy,
    num_slots: usize,
    kv: KvLayout,
    /// Layer -> index among the global layers (None for a sliding layer).
    gidx: Vec<Option<usize>>,
    ng: usize,
    /// SFI: compact K and V `[ng, num_slots, kv_heads, ccap, head_dim]`.
    compact: Option<(GpuBuffer<bf16>, GpuBuffer<bf16>)>,
    ccap: usize,
    /// SFI: key norms `[ng, num_slots, kv_heads, capacity]`.
    norms: Option<GpuBuffer<f32>>,
    /// The global layers' K and V caches (device addresses).
    kptrs: GpuBuffer<u64>,
    vptrs: GpuBuffer<u64>,
    clen: GpuBuffer<u32>,   // [ng, num_slots]
    rstart: GpuBuffer<u32>, // [ng, num_slots]
    /// Per slot: 0, or 1 + the row of `logits` its capturing step writes (SFI's slow steps).
    capture: GpuBuffer<u32>, // [num_slots]
    /// The slots of the current capture, in row order (host copy of `capture`).
    cap_slots: Vec<usize>,
    /// Score rows a decode step can capture at once (`CAPTURE_ROWS`, at most the slots).
    cap_rows: usize,
    rows1: GpuBuffer<u32>, // [bootstrap rows]: 1, 2, ... (bootstrap row r writes row r)
    zeros: GpuBuffer<u32>, // [bootstrap rows]
    boot_lens: GpuBuffer<u32>,
    boot_slots: GpuBuffer<u32>,
    boot_out: GpuBuffer<bf16>, // [bootstrap rows, n_heads, hdk]
    /// SFI: captured scores, decode `[ng, cap_rows, n_heads, capacity]` (a capturing slot's
    /// row is its place in `cap_slots`); the bootstrap uses the first `bootstrap rows x
    /// n_heads` rows.
    logits: GpuBuffer<f32>,
    /// Per slot: key norms are computed for positions below this.
    norm_len: Vec<usize>,
    /// Per slot: whether the global layers hold a memory (else a step is dense).
    pub has_mem: Vec<bool>,
    /// Per slot: the sequence length at its last refresh.
    refreshed_len: Vec<usize>,
    sel: Option<SelectorScratch>,
    /// SnapKV / PyramidKV: the selection's scratch.
    snap: Option<SnapScratch>,
    /// Quest: the page geometry, every global layer's bounds `[ng, layer_elems]` and the
    /// per-step selection's scratch.
    quest: Option<(QuestPages, GpuBuffer<bf16>, QuestScratch)>,
    /// Per slot: keys a fast step reads beyond the sequence length, averaged over the global
    /// layers (SnapKV: compact rows less the prompt before the window; 0 when dense).
    snap_off: Vec<f64>,
    /// Per slot: the prompt's length when SnapKV / PyramidKV's selection compacted it on
    /// every global layer (each then reads in place from the window's start on).
    snap_prompt: Vec<Option<usize>>,
    /// FastKV's prefill after its TSP layer (`GpuDecoder::prefill_fastkv`): the prompt's
    /// length, while the layers after the TSP layer hold only its propagated rows, compact
    /// from row 0 (a refresh's `len` of them).
    pub(crate) tsp_prompt: Option<usize>,
    /// SFI with asynchronous refresh: where the side stream's gather writes.
    stage: Option<Stage>,
    pub splits: usize,
    /// Splits of a step with capturing (dense) rows, one entry per count of them: enough for
    /// those rows' blocks alone to fill the device (the fast step's `splits` is sized for the
    /// whole batch, which left one dense 128K sequence of six 40 blocks).
    cap_splits: Vec<usize>,
    /// The splits of the current step (set with the capture flags).
    step_splits: usize,
    /// Memory refreshes so far (one per slot and forward, all layers together).
    pub refreshes: usize,
    /// SFI's cheaper slow step (`GpuSfiConfig::candidates` > 0).
    cand: Option<Cand>,
    /// Per slot: keys its last decode slow step read a layer (`plan_views`: its length, or a
    /// view's keys plus a key read a page bound, as the CPU counts them).
    slow_read: Vec<usize>,
    /// H2O's scores, positions and prefill scoring.
    h2o: Option<H2oState>,
    /// The oracle's selection state.
    oracle: Option<OracleState>,
}

/// The oracle's device state: a selection's scratch (one captured row, SnapKV's scoring with
/// no pooling) and the picks of every global layer and slot. The sparse steps since a slot's
/// last selection are its length less `refreshed_len`.
struct OracleState {
    rule: OracleRule,
    sc: SnapScratch,
    /// The chosen positions `[ng, num_slots, kv_heads, k]` (ascending a head; for tests).
    picks: GpuBuffer<u32>,
}

/// Bytes of captured logits one H2O prefill sub-chunk may take: its rows re-attend in groups of
/// this many bytes' worth of scores (at 128K x 32 heads, 64 rows).
const H2O_SCORE_BYTES: usize = 1 << 30;

/// H2O's device state (kernels/h2o.cu).
struct H2oState {
    heavy: usize,
    recent: usize,
    /// Every key's score `[ng, num_slots, kv_heads, capacity]` (an evicted key's is -inf).
    scores: GpuBuffer<f32>,
    /// The scores as the last prefill of each slot left them, before its selection (same
    /// layout), and that prefill's end: a server cuts a slot back there after the dummy decode
    /// steps it runs between a prompt's parts (`truncate_slot`), and the next part goes on from
    /// these sums, so that a prompt prefilled in parts selects once, at its end, as in one.
    saved: GpuBuffer<f32>,
    saved_len: Vec<Option<usize>>,
    /// Per slot: a cut back to `saved_len` happened; the next prefill there resumes the sums.
    resume: Vec<bool>,
    /// Positions of the compact rows `[ng, num_slots, kv_heads, heavy]`.
    cpos: GpuBuffer<u32>,
    /// Prefill rows re-attended at once, their lengths by position (`lens[p] = p + 1`), slots,
    /// capture flags (1, 2, ...), outputs, logits and workspace.
    rows: usize,
    lens: GpuBuffer<u32>,
    slots: GpuBuffer<u32>,
    slots_for: Option<usize>,
    rows1: GpuBuffer<u32>,
    out: GpuBuffer<bf16>,
    logits: GpuBuffer<f32>,
    ws: AttnWorkspace,
    sc: H2oScratch,
    /// A decode step's scratch.
    step: H2oStepScratch,
}

impl H2oState {
    /// The address in `saved` of the score at `p` (an address in `scores`).
    fn saved_at(&self, p: u64) -> u64 {
        p - self.scores.device_ptr() + self.saved.device_ptr()
    }
}

/// SFI's cheaper slow step (kernels/sfi_cand.cu, the CPU rule in `slowfast_kv::sfi::candidates`).
struct Cand {
    /// Page geometry and every global layer's page bounds `[ng, layer_elems]` (Quest's layout).
    pg: QuestPages,
    bounds: GpuBuffer<bf16>,
    /// Per slot: the pages whose bounds hold (all global layers alike).
    bounds_len: Vec<usize>,
    /// Candidate pages picked a slow step, the sinks' pages, and a row's page-list room.
    want: usize,
    first: usize,
    vcap: usize,
    /// Scratch of the pick: `[cap_rows, n_heads, maxp]`, `[ng, cap_rows, n_heads]` (every
    /// layer's, zeroed once a slow step), `[cap_rows, maxp]`, `[cap_rows]` x 2.
    ub: GpuBuffer<f32>,
    best: GpuBuffer<u32>,
    scores: GpuBuffer<f32>,
    cnt: GpuBuffer<u32>,
    mcount: GpuBuffer<u32>,
    /// The page lists `[ng, cap_rows, vcap]` and the rows' plans `[cap_rows, VMETA]`.
    vpages: GpuBuffer<u32>,
    vmeta: GpuBuffer<u32>,
    /// The current capture's plans, by capture row (None: that row reads densely).
    plans: Vec<Option<ViewPlan>>,
    /// Key norms in view order for the Selector `[ng, kv_heads, vmax]`.
    norms_v: GpuBuffer<f32>,
    vmax: usize,
    /// The split count of a step whose capturing rows all read views: the fast step's rule
    /// for the longest view (a dense capturing row's count would cut every row's few keys
    /// into blocks of a tile or less).
    splits: usize,
}

/// One slot's compact memory (SFI's, SnapKV's) on every global layer, as the fast step reads it (see
/// [`crate::GpuDecoder::compact_memory`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CompactMemory {
    /// Compact K rows, `[layer][kv_head, ccap, head_dim]` concatenated; V the same.
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
    /// Per layer: rows of the compact buffer in use, and the recent window's start.
    pub clen: Vec<u32>,
    pub rstart: Vec<u32>,
}

/// The shapes and cache addresses a gather into the compact buffers needs.
#[derive(Clone, Copy)]
struct GatherGeom {
    kv: KvLayout,
    ns: usize,
    ccap: usize,
    kptrs: u64,
    vptrs: u64,
}

impl GatherGeom {
    /// The gather of global layers `[gi0, gi0 + layers)` of `slot` (the first `sinks` keys,
    /// then the chosen ones, below `recent_start`) into `dst`: compact K and V, clen and
    /// rstart, the live buffers or the staging ones (same layouts).
    fn args(
        &self,
        (gi0, layers): (usize, usize),
        slot: usize,
        (sinks, recent_start): (usize, usize),
        dst: (
            &GpuBuffer<bf16>,
            &GpuBuffer<bf16>,
            &GpuBuffer<u32>,
            &GpuBuffer<u32>,
        ),
    ) -> GatherArgs {
        let (kv, ns) = (self.kv, self.ns);
        let cs = ns * kv.kv_heads * self.ccap * kv.row_len();
        let (ck, cv, clen, rstart) = dst;
        GatherArgs {
            layers,
            kptrs: self.kptrs + (gi0 * 8) as u64,
            vptrs: self.vptrs + (gi0 * 8) as u64,
            slot,
            sinks,
            recent_start,
            ck: ck.device_ptr() + (gi0 * cs * 2) as u64,
            cv: cv.device_ptr() + (gi0 * cs * 2) as u64,
            ccap: self.ccap,
            compact_layer_stride: cs,
            clen: clen.device_ptr() + (gi0 * ns * 4) as u64,
            rstart: rstart.device_ptr() + (gi0 * ns * 4) as u64,
        }
    }
}

/// Staging copies of the compact K / V, clen and rstart (the live buffers' layouts).
struct Stage {
    ck: GpuBuffer<bf16>,
    cv: GpuBuffer<bf16>,
    clen: GpuBuffer<u32>,
    rstart: GpuBuffer<u32>,
}

impl SparseState {
    /// The device state of `policy`; `staged` allocates the staging buffers of the
    /// asynchronous refresh (SFI only).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &CudaContext,
        policy: GpuKvPolicy,
        windows: &[Option<usize>],
        caches: &[(GpuBuffer<bf16>, GpuBuffer<bf16>)],
        n_heads: usize,
        kv: KvLayout,
        staged: bool,
    ) -> Result<Option<Self>, CudaError> {
        let bad = |w: String| CudaError::bad("gpu kv policy", w);
        let (sfi, boot) = match policy {
            GpuKvPolicy::Full => return Ok(None),
            GpuKvPolicy::Snap(c) => {
                if c.window == 0 || c.capacity <= c.window || c.kernel % 2 == 0 {
                    return Err(bad(format!(
                        "SnapKV: {c:?} (the capacity must exceed a window of >= 1, the kernel be odd)"
                    )));
                }
                (None, c.window)
            }
            GpuKvPolicy::Streaming { recent, .. } => {
                if recent == 0 {
                    return Err(bad("streaming: recent window 0".into()));
                }
                (None, 1)
            }
            GpuKvPolicy::Quest(c) => {
                if c.pages < 2 || c.page == 0 {
                    return Err(bad(format!(
                        "Quest: {c:?} (at least 2 pages a step, of >= 1 token)"
                    )));
                }
                (None, 1)
            }
            GpuKvPolicy::H2o { heavy, recent } => {
                if heavy == 0 || recent == 0 || n_heads / kv.kv_heads > H2O_MAX_GROUP {
                    return Err(bad(format!(
                        "H2O: {heavy} heavy + {recent} recent (both >= 1, at most {H2O_MAX_GROUP} query heads a kv head)"
                    )));
                }
                (None, 1)
            }
            GpuKvPolicy::Oracle(r) => {
                r.check().map_err(bad)?;
                (None, 1)
            }
            GpuKvPolicy::Sfi(c) => {
                if c.selected == 0 || c.recent == 0 || c.bootstrap_rows == 0 || c.page == 0 {
                    return Err(bad(format!(
                        "SFI: {c:?} (selected, recent, bootstrap rows and page must be >= 1)"
                    )));
                }
                (Some(c), c.bootstrap_rows)
            }
        };
        let ns = kv.num_slots;
        let mut gidx = Vec::with_capacity(windows.len());
        let (mut kp, mut vp) = (Vec::new(), Vec::new());
        for (w, (k, v)) in windows.iter().zip(caches) {
            gidx.push(w.is_none().then_some(kp.len()));
            if w.is_none() {
                kp.push(k.device_ptr());
                vp.push(v.device_ptr());
            }
        }
        let ng = kp.len();
        if ng == 0 {
            return Ok(None); // every layer slides: the policy has nothing to act on
        }
        let snap_cfg = policy.snap();
        let ccap = match (sfi, snap_cfg, policy) {
            (Some(c), _, _) => c.sinks + c.selected,
            (_, Some(c), _) => c.max_picks(),
            (_, _, GpuKvPolicy::H2o { heavy, .. }) => heavy,
            (_, _, GpuKvPolicy::Oracle(r)) => r.budget - r.layout().1,
            _ => 0,
        };
        let compact = match ccap {
            1.. => {
                // rows of the caches' type (e4m3 with fp8 KV: half the buffer elements)
                let el = ng * ns * kv.kv_heads * ccap * kv.row_len();
                Some((ctx.alloc(el)?, ctx.alloc(el)?))
            }
            0 => None,
        };
        let norms = match sfi {
            Some(_) => Some(ctx.alloc(ng * ns * kv.kv_heads * kv.capacity)?),
            None => None,
        };
        let (init_clen, init_rstart) = match policy {
            GpuKvPolicy::Streaming { sinks, .. } => (sinks as u32, sinks as u32),
            _ => (0, 0),
        };
        let g = n_heads / kv.kv_heads;
        let sel = match sfi {
            Some(c) => Some(SelectorScratch::new(
                ctx,
                c.selector,
                ng,
                kv.kv_heads,
                g * c.bootstrap_rows,
                kv.capacity,
                c.selected,
            )?),
            None => None,
        };
        let stage = match (&compact, staged && sfi.is_some()) {
            (Some((k, _)), true) => Some(Stage {
                ck: ctx.alloc(k.len())?,
                cv: ctx.alloc(k.len())?,
                clen: ctx.alloc(ng * ns)?,
                rstart: ctx.alloc(ng * ns)?,
            }),
            _ => None,
        };
        let snap = match snap_cfg {
            Some(c) => Some(SnapScratch::new(
                ctx,
                c.window,
                n_heads,
                kv.kv_heads,
                kv.capacity,
                c.max_picks(),
            )?),
            None => None,
        };
        let quest = match policy {
            GpuKvPolicy::Quest(c) => {
                let pg = QuestPages::new(kv, c.page)?;
                let bounds = ctx.alloc(ng * pg.layer_elems(kv))?;
                let sc = QuestScratch::new(ctx, ns, kv.kv_heads, pg.maxp, c.pages - 1)?;
                Some((pg, bounds, sc))
            }
            _ => None,
        };
        let h2o = match policy {
            GpuKvPolicy::H2o { heavy, recent } => {
                let cap = kv.capacity;
                let rows = (H2O_SCORE_BYTES / (n_heads * cap * 4)).clamp(1, 512);
                let lens: Vec<u32> = (1..=cap as u32).collect();
                let per = ng * ns * kv.kv_heads;
                Some(H2oState {
                    heavy,
                    recent,
                    scores: ctx.alloc(per * cap)?,
                    saved: ctx.alloc(per * cap)?,
                    saved_len: vec![None; ns],
                    resume: vec![false; ns],
                    cpos: ctx.alloc(per * heavy)?,
                    rows,
                    lens: ctx.upload(&lens)?,
                    slots: ctx.alloc(rows)?,
                    slots_for: None,
                    rows1: ctx.upload(&(1..=rows as u32).collect::<Vec<_>>())?,
                    out: ctx.alloc(rows * n_heads * kv.head_dim)?,
                    logits: ctx.alloc(rows * n_heads * cap)?,
                    ws: AttnWorkspace::new(),
                    sc: H2oScratch::new(ctx, rows, n_heads, kv.kv_heads, cap, heavy)?,
                    step: H2oStepScratch::new(ctx, ns, n_heads, kv.kv_heads, heavy, recent)?,
                })
            }
            _ => None,
        };
        if let Some(h) = &h2o {
            ctx.memset_zero(&h.scores)?;
            ctx.memset_zero(&h.cpos)?;
        }
        let oracle = match policy {
            GpuKvPolicy::Oracle(rule) => {
                let k = rule.layout().2;
                Some(OracleState {
                    rule,
                    sc: SnapScratch::new(ctx, 1, n_heads, kv.kv_heads, kv.capacity, k)?,
                    picks: ctx.alloc(ng * ns * kv.kv_heads * k)?,
                })
            }
            _ => None,
        };
        // The oracle selects in the step that captures, every step by default: every slot may
        // capture at once (one layer's scores at a time, `decode_layer`).
        let cap_rows = match policy {
            GpuKvPolicy::Oracle(_) => ns,
            _ => ns.min(CAPTURE_ROWS),
        };
        let mut sel = sel;
        let cand = match sfi {
            Some(c) if c.candidates > 0.0 => {
                let pg = QuestPages::new(kv, c.page)?;
                let first = c.sinks.div_ceil(c.page);
                // the CPU's count (`SfiPolicy::candidate_step`)
                let want =
                    (c.candidates as f64 * c.selected as f64 / c.page as f64).ceil() as usize;
                let vcap = first + want.max(1);
                let vmax = (vcap * c.page + c.recent + c.page).min(kv.capacity);
                if let Some(sel) = sel.as_mut() {
                    sel.reserve_view(ctx, vmax)?;
                }
                Some(Cand {
                    pg,
                    bounds: ctx.alloc(ng * pg.layer_elems(kv))?,
                    bounds_len: vec![0; ns],
                    want: want.max(1),
                    first,
                    vcap,
                    ub: ctx.alloc(cap_rows * n_heads * pg.maxp)?,
                    best: ctx.alloc(ng * cap_rows * n_heads)?,
                    scores: ctx.alloc(cap_rows * pg.maxp)?,
                    cnt: ctx.alloc(cap_rows)?,
                    mcount: ctx.alloc(cap_rows)?,
                    vpages: ctx.alloc(ng * cap_rows * vcap)?,
                    vmeta: ctx.alloc(cap_rows * VMETA)?,
                    plans: Vec::new(),
                    norms_v: ctx.alloc(ng * kv.kv_heads * vmax)?,
                    vmax,
                    splits: fast_step_splits(ctx.sparse_splits(ns, n_heads, &kv), vmax),
                })
            }
            _ => None,
        };
        let logits_rows = match policy {
            GpuKvPolicy::Sfi(_) => (ng * cap_rows).max(boot),
            GpuKvPolicy::Snap(_) => boot,
            GpuKvPolicy::Oracle(_) => cap_rows,
            _ => 1,
        };
        // SLOWFAST_SPARSE_SPLITS=N sets the fast step's split count (A/B runs).
        let fast_splits = crate::context::env_usize("SLOWFAST_SPARSE_SPLITS")
            .map(|n| n.clamp(1, 1024))
            .unwrap_or_else(|| {
                fast_step_splits(ctx.sparse_splits(ns, n_heads, &kv), policy.dense_below())
            });
        Ok(Some(SparseState {
            policy,
            num_slots: ns,
            kv,
            gidx,
            ng,
            compact,
            ccap,
            norms,
            kptrs: ctx.upload(&kp)?,
            vptrs: ctx.upload(&vp)?,
            clen: ctx.upload(&vec![init_clen; ng * ns])?,
            rstart: ctx.upload(&vec![init_rstart; ng * ns])?,
            capture: ctx.alloc(ns)?,
            cap_slots: Vec::new(),
            cap_rows,
            rows1: ctx.upload(&(1..=boot as u32).collect::<Vec<_>>())?,
            zeros: ctx.alloc(boot.max(ns))?,
            boot_lens: ctx.alloc(boot)?,
            boot_slots: ctx.alloc(boot)?,
            boot_out: ctx.alloc(boot * n_heads * kv.head_dim)?,
            logits: ctx.alloc(logits_rows * n_heads * kv.capacity)?,
            norm_len: vec![0; ns],
            has_mem: vec![false; ns],
            refreshed_len: vec![0; ns],
            sel,
            snap,
            quest,
            snap_off: vec![0.0; ns],
            snap_prompt: vec![None; ns],
            tsp_prompt: None,
            stage,
            splits: fast_splits,
            // capturing rows get their own split count (run 50)
            cap_splits: (0..=ns)
                .map(|c| ctx.sparse_splits(c.max(1), n_heads, &kv).max(fast_splits))
                .collect(),
            step_splits: fast_splits,
            refreshes: 0,
            cand,
            slow_read: vec![0; ns],
            h2o,
            oracle,
        }))
    }

    pub fn sfi(&self) -> Option<GpuSfiConfig> {
        match self.policy {
            GpuKvPolicy::Sfi(c) => Some(c),
            _ => None,
        }
    }

    /// Whether layer `l` runs the policy (a global layer).
    pub fn covers(&self, l: usize) -> bool {
        self.gidx.get(l).is_some_and(|g| g.is_some())
    }

    /// Whether the policy keeps a compact buffer (SFI, SnapKV).
    pub fn has_compact(&self) -> bool {
        self.compact.is_some()
    }

    pub fn snap(&self) -> Option<GpuSnapConfig> {
        self.policy.snap()
    }

    /// Rows the last prefill chunk must hold and capture (SFI's bootstrap, SnapKV's
    /// observation window), else 0.
    pub fn bootstrap_rows(&self) -> usize {
        match self.policy {
            GpuKvPolicy::Sfi(c) => c.bootstrap_rows,
            GpuKvPolicy::Snap(c) => c.window,
            _ => 0,
        }
    }

    /// Start of the recent window of a sequence of `len` tokens.
    pub fn recent_start(&self, len: usize) -> usize {
        match self.policy {
            GpuKvPolicy::Sfi(c) => (len - c.recent.min(len)) / c.page * c.page,
            GpuKvPolicy::Streaming { recent, .. } => len.saturating_sub(recent),
            GpuKvPolicy::Snap(c) => len.saturating_sub(c.window),
            GpuKvPolicy::Quest(c) => len.saturating_sub(1) / c.page * c.page,
            GpuKvPolicy::H2o { recent, .. } => len.saturating_sub(recent),
            GpuKvPolicy::Oracle(r) => r.domain(len).1,
            GpuKvPolicy::Full => 0,
        }
    }

    /// Sets which slots capture (attend densely and refresh) in the next plain decode step:
    /// at most `CAPTURE_ROWS` of them, each given the next score row.
    pub fn set_capture(&mut self, ctx: &CudaContext, flags: &[bool]) -> Result<(), CudaError> {
        let slots: Vec<usize> = (0..flags.len()).filter(|&s| flags[s]).collect();
        if slots.len() > self.cap_rows {
            return Err(CudaError::bad(
                "sparse capture",
                format!(
                    "{} capturing slots, room for {}",
                    slots.len(),
                    self.cap_rows
                ),
            ));
        }
        let mut v = vec![0u32; flags.len()];
        for (row, &s) in slots.iter().enumerate() {
            v[s] = row as u32 + 1;
        }
        self.step_splits = self.cap_splits[slots.len().min(self.num_slots)];
        self.cap_slots = slots;
        if let Some(c) = self.cand.as_mut() {
            c.plans.clear();
        }
        ctx.upload_into(&v, &mut self.capture)
    }

    /// SFI's cheaper slow step: plans the views of this decode step's capturing slots (after
    /// `set_capture`; `lens[s]` = slot s's length with this step's token). A slot reads a view
    /// when it has a memory and some candidate page would be left out (the CPU's
    /// `SfiPolicy::candidate_step`), else densely. Returns whether any slot reads a view.
    pub fn plan_views(&mut self, ctx: &CudaContext, lens: &[usize]) -> Result<bool, CudaError> {
        let Some(c) = self.sfi() else {
            return Ok(false);
        };
        for &s in &self.cap_slots {
            self.slow_read[s] = lens[s];
        }
        let rs: Vec<usize> = self
            .cap_slots
            .iter()
            .map(|&s| self.recent_start(lens[s]))
            .collect();
        let Some(cd) = self.cand.as_mut() else {
            return Ok(false);
        };
        let p = c.page;
        cd.plans = self
            .cap_slots
            .iter()
            .zip(rs)
            .map(|(&s, recent_start)| {
                let pages = recent_start / p;
                (self.has_mem[s] && cd.first + cd.want < pages).then_some(ViewPlan {
                    batch_row: s,
                    page: p,
                    first: cd.first,
                    pages,
                    want: cd.want,
                    recent_start,
                    fresh: cd.bounds_len[s].min(pages),
                })
            })
            .collect();
        let meta: Vec<u32> = (0..self.cap_rows)
            .flat_map(|r| ViewPlan::vmeta(cd.plans.get(r).and_then(|p| p.as_ref())))
            .collect();
        ctx.upload_into(&meta, &mut cd.vmeta)?;
        let any = cd.plans.iter().any(Option::is_some);
        if any {
            ctx.memset_zero(&cd.best)?;
            if cd.plans.iter().all(Option::is_some) {
                self.step_splits = cd.splits;
            }
        }
        for p in cd.plans.iter().flatten() {
            cd.bounds_len[p.batch_row] = cd.bounds_len[p.batch_row].max(p.pages);
            self.slow_read[p.batch_row] = p.view_len(lens[p.batch_row]) + p.pages - p.first;
        }
        Ok(any)
    }

    /// Whether this decode step's capturing rows read views: the step's query is then needed
    /// before attention (the page pick), so q/k post-processing runs first.
    pub fn reads_views(&self) -> bool {
        self.cand
            .as_ref()
            .is_some_and(|c| c.plans.iter().any(Option::is_some))
    }

    /// The score row of capturing slot `slot` (its place among the capturing slots).
    fn cap_row(&self, slot: usize) -> Result<usize, CudaError> {
        self.cap_slots
            .iter()
            .position(|&s| s == slot)
            .ok_or_else(|| CudaError::bad("sfi refresh", format!("slot {slot} captured no scores")))
    }

    fn copy_raw(ctx: &CudaContext, src: u64, dst: u64, bytes: usize) -> Result<(), CudaError> {
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, ctx.stream().cu_stream())
        }
        .map_err(crate::context::drv("cuMemcpyDtoDAsync (sparse state)"))
    }

    /// Forgets slot `s`'s memory (a new sequence): dense until its next refresh.
    pub fn reset_slot(&mut self, ctx: &CudaContext, s: usize) -> Result<(), CudaError> {
        self.norm_len[s] = 0;
        if let Some(c) = self.cand.as_mut() {
            c.bounds_len[s] = 0;
        }
        self.has_mem[s] = false;
        self.refreshed_len[s] = 0;
        self.snap_off[s] = 0.0;
        self.snap_prompt[s] = None;
        if let Some(h) = &self.h2o {
            for gi in 0..self.ng {
                let (sc, cp, _) = self.h2o_at(h, gi, s);
                ctx.zero_raw(sc, self.kv.kv_heads * self.kv.capacity * 4)?;
                ctx.zero_raw(cp, self.kv.kv_heads * h.heavy * 4)?;
            }
        }
        if let Some(h) = self.h2o.as_mut() {
            h.saved_len[s] = None;
            h.resume[s] = false;
        }
        if self.compact.is_some() {
            for gi in 0..self.ng {
                for buf in [&self.clen, &self.rstart] {
                    let dst = buf.device_ptr() + ((gi * self.num_slots + s) * 4) as u64;
                    Self::copy_raw(ctx, self.zeros.device_ptr(), dst, 4)?;
                }
            }
        }
        Ok(())
    }

    /// After slot `s` was cut back to `len` tokens by a truncation (its memory goes with the
    /// cut): every policy forgets it, except H2O cut back to where its last prefill ended (a
    /// server's cut between a prompt's parts), which gets that prefill's state back.
    pub fn truncate_slot(
        &mut self,
        ctx: &CudaContext,
        s: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        let Some(h) = self
            .h2o
            .as_ref()
            .filter(|h| len > 0 && h.saved_len[s] == Some(len))
        else {
            return self.reset_slot(ctx, s);
        };
        self.h2o_copy_sums(ctx, h, s, false)?;
        self.h2o_settle(ctx, s, len, false)?;
        if let Some(h) = self.h2o.as_mut() {
            h.resume[s] = true;
        }
        Ok(())
    }

    /// H2O: slot `s`'s sums on every global layer copied into `saved` (`keep`), or back from
    /// it.
    fn h2o_copy_sums(
        &self,
        ctx: &CudaContext,
        h: &H2oState,
        s: usize,
        keep: bool,
    ) -> Result<(), CudaError> {
        let bytes = self.kv.kv_heads * self.kv.capacity * 4;
        for gi in 0..self.ng {
            let (sc, _, _) = self.h2o_at(h, gi, s);
            let (src, dst) = if keep {
                (sc, h.saved_at(sc))
            } else {
                (h.saved_at(sc), sc)
            };
            Self::copy_raw(ctx, src, dst, bytes)?;
        }
        Ok(())
    }

    /// After slot `s`'s sequence was cut back to `len` tokens (speculative decoding's rejected
    /// drafts): its memory stays when it was built at a length within `len` (the compact rows
    /// and the recent window's start are below it), else it is forgotten; key norms past `len`
    /// are recomputed at the next refresh.
    pub fn rewind_slot(
        &mut self,
        ctx: &CudaContext,
        s: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        if self.h2o.is_some() {
            return Err(CudaError::bad(
                "rewind",
                "H2O's scores and evictions cannot be rewound (it drafts no speculation)"
                    .to_string(),
            ));
        }
        if self.refreshed_len[s] > len {
            return self.reset_slot(ctx, s);
        }
        self.norm_len[s] = self.norm_len[s].min(len);
        if let Some(c) = self.cand.as_mut() {
            c.bounds_len[s] = c.bounds_len[s].min(len / c.pg.page);
        }
        Ok(())
    }

    /// After slot `s` holds `len` tokens from a prefill (or under a policy set after it): Quest
    /// computes every page's key bounds on every global layer.
    pub fn prefilled(&mut self, ctx: &CudaContext, s: usize, len: usize) -> Result<(), CudaError> {
        self.h2o_settle(ctx, s, len, true)?;
        if let Some((pg, bounds, _)) = &self.quest {
            let (kptrs, b) = (self.kptrs.device_ptr(), bounds.device_ptr());
            ctx.quest_bounds(
                self.kv,
                *pg,
                kptrs,
                self.ng,
                b,
                s,
                (0, len.div_ceil(pg.page)),
            )?;
        }
        // SFI's cheaper slow step: the full pages' bounds now, so that no slow step pays for
        // the prompt's pages (run 137: 265 us a layer at the first one, 32K); pages filled
        // later get theirs at the slow step that first reads them.
        if let Some(cd) = self.cand.as_mut() {
            let full = (len / cd.pg.page).min(cd.pg.maxp);
            let from = cd.bounds_len[s].min(full);
            if full > from {
                ctx.quest_bounds(
                    self.kv,
                    cd.pg,
                    self.kptrs.device_ptr(),
                    self.ng,
                    cd.bounds.device_ptr(),
                    s,
                    (from, full),
                )?;
                cd.bounds_len[s] = full;
            }
        }
        Ok(())
    }

    /// Score rows a decode step can capture at once (`CAPTURE_ROWS`, at most the slots).
    pub fn capture_rows(&self) -> usize {
        self.cap_rows
    }

    /// Splits the slots that want a slow step into those this step captures (the first
    /// `CAPTURE_ROWS`, at most the slots) and those that wait for a later step.
    pub fn split_capture(&self, wanting: Vec<usize>) -> (Vec<usize>, Vec<usize>) {
        let mut now = wanting;
        let later = now.split_off(now.len().min(self.cap_rows));
        (now, later)
    }

    /// SFI on global layer `l`: where a verification's row 0 leaves its scores for the
    /// Selector (the decode capture's logits of that layer, the capture flags, the row stride).
    pub fn verify_capture(&self, l: usize, n_heads: usize) -> Option<(u64, u64, usize)> {
        let gi = self.gidx.get(l).copied().flatten()?;
        self.sfi()?;
        let ls = self.cap_rows * n_heads * self.kv.capacity * 4;
        Some((
            self.logits.device_ptr() + (gi * ls) as u64,
            self.capture.device_ptr(),
            self.kv.capacity,
        ))
    }

    /// Copies slot `from`'s memory to slot `to` (after the KV itself was copied).
    pub fn copy_slot(
        &mut self,
        ctx: &CudaContext,
        from: usize,
        to: usize,
    ) -> Result<(), CudaError> {
        let (ns, kv) = (self.num_slots, self.kv);
        for gi in 0..self.ng {
            for buf in [&self.clen, &self.rstart] {
                let b = buf.device_ptr();
                let (f, t) = ((gi * ns + from) * 4, (gi * ns + to) * 4);
                Self::copy_raw(ctx, b + f as u64, b + t as u64, 4)?;
            }
            let el = kv.kv_heads * self.ccap * kv.row_bytes();
            if let Some((ck, cv)) = &self.compact {
                for c in [ck, cv] {
                    let b = c.device_ptr();
                    let (f, t) = ((gi * ns + from) * el, (gi * ns + to) * el);
                    Self::copy_raw(ctx, b + f as u64, b + t as u64, el)?;
                }
            }
            if let Some(nb) = &self.norms {
                let el = kv.kv_heads * kv.capacity * 4;
                let b = nb.device_ptr();
                let (f, t) = ((gi * ns + from) * el, (gi * ns + to) * el);
                Self::copy_raw(ctx, b + f as u64, b + t as u64, el)?;
            }
            if let Some(h) = &self.h2o {
                let (fs, fc, _) = self.h2o_at(h, gi, from);
                let (ts, tc, _) = self.h2o_at(h, gi, to);
                Self::copy_raw(ctx, fs, ts, kv.kv_heads * kv.capacity * 4)?;
                Self::copy_raw(ctx, fc, tc, kv.kv_heads * h.heavy * 4)?;
                Self::copy_raw(
                    ctx,
                    h.saved_at(fs),
                    h.saved_at(ts),
                    kv.kv_heads * kv.capacity * 4,
                )?;
            }
            if let Some((pg, bounds, _)) = &self.quest {
                let el = pg.layer_elems(kv) / ns * 2; // one slot's bytes
                let b = bounds.device_ptr() + (gi * pg.layer_elems(kv) * 2) as u64;
                let (f, t) = (from * el, to * el);
                Self::copy_raw(ctx, b + f as u64, b + t as u64, el)?;
            }
        }
        self.norm_len[to] = self.norm_len[from];
        if let Some(c) = self.cand.as_mut() {
            c.bounds_len[to] = 0; // recomputed at its first cheaper slow step
        }
        self.has_mem[to] = self.has_mem[from];
        self.refreshed_len[to] = self.refreshed_len[from];
        self.snap_off[to] = self.snap_off[from];
        self.snap_prompt[to] = self.snap_prompt[from];
        if let Some(h) = self.h2o.as_mut() {
            h.saved_len[to] = h.saved_len[from];
            h.resume[to] = h.resume[from];
        }
        Ok(())
    }

    /// Decode attention of global layer `l` for `batch` slots (row b = slot b); with
    /// `refresh` (this step's capturing slots, in `cap_slots` order) they attend densely and
    /// leave their scores for the Selector (the oracle selects from them within the layer).
    /// With `post` the kernel does `qkv_post`'s work first (q from the projection rows, the new
    /// key and value written into `kc` / `vc`, which the caller holds mutably); `io.0` is then
    /// unused.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_layer(
        &mut self,
        ctx: &CudaContext,
        l: usize,
        kc: &GpuBuffer<bf16>,
        vc: &GpuBuffer<bf16>,
        ws: &mut AttnWorkspace,
        io: (u64, u64, u64, u64),
        batch: usize,
        n_heads: usize,
        scale: f32,
        refresh: &[Refresh],
        post: Option<SparsePost>,
    ) -> Result<(), CudaError> {
        let (q, out, seq_lens, slots) = io;
        let capture = !refresh.is_empty();
        let (kv, ns) = (self.kv, self.num_slots);
        let gi = self.gidx[l].ok_or_else(|| {
            CudaError::bad("sparse decode", format!("layer {l} is a sliding layer"))
        })?;
        let el = ns * kv.kv_heads * self.ccap * kv.row_bytes();
        let off = (gi * ns * 4) as u64;
        let (mut clen, mut rstart) = (self.clen.device_ptr() + off, self.rstart.device_ptr() + off);
        let (mut cidx, mut cgran) = (0, 1);
        let (ck, cv, ccap, rwin) = match (&self.compact, self.policy) {
            (Some((ck, cv)), _) => (
                ck.device_ptr() + (gi * el) as u64,
                cv.device_ptr() + (gi * el) as u64,
                self.ccap,
                0,
            ),
            (None, GpuKvPolicy::Streaming { recent, .. }) => {
                (kc.device_ptr(), vc.device_ptr(), kv.capacity, recent)
            }
            (None, GpuKvPolicy::Quest(c)) => {
                // this step's pages, read in place; the first layers densely
                let (pg, bounds, sc) = self.quest.as_ref().expect("Quest's state");
                if post.is_some() {
                    return Err(CudaError::bad(
                        "sparse decode",
                        "Quest scores pages with the step's query: qkv_post runs first",
                    ));
                }
                (clen, rstart) = (self.zeros.device_ptr(), self.zeros.device_ptr());
                if l >= c.dense_layers {
                    let a = QuestArgs {
                        q,
                        k_cache: kc.device_ptr(),
                        bounds: bounds.device_ptr() + (gi * pg.layer_elems(kv) * 2) as u64,
                        seq_lens,
                        slots,
                        batch,
                        n_heads,
                        fresh: QUEST_FRESH,
                    };
                    ctx.quest_select(kv, *pg, &a, sc)?;
                    (cidx, clen) = sc.page_list();
                    cgran = pg.page;
                }
                (kc.device_ptr(), vc.device_ptr(), sc.k(), 0)
            }
            _ => (kc.device_ptr(), vc.device_ptr(), kv.capacity, 0),
        };
        // SFI's cheaper slow step: the capturing rows' page lists of this layer first.
        let (mut vpages, mut vmeta, mut vcap) = (0, 0, 0);
        if let (true, Some(cd), Some(c)) = (capture, self.cand.as_ref(), self.sfi()) {
            if cd.plans.iter().any(Option::is_some) {
                if post.is_some() {
                    return Err(CudaError::bad(
                        "sparse decode",
                        "a cheaper slow step picks pages with the step's query: qkv_post runs first",
                    ));
                }
                let vp = cd.vpages.device_ptr() + (gi * self.cap_rows * cd.vcap * 4) as u64;
                let a = CandPick {
                    q,
                    k_cache: kc.device_ptr(),
                    bounds: cd.bounds.device_ptr() + (gi * cd.pg.layer_elems(kv) * 2) as u64,
                    slots,
                    vmeta: cd.vmeta.device_ptr(),
                    n_heads,
                    cap_rows: self.cap_rows,
                    maxp: cd.pg.maxp,
                    forced0: c.sinks / c.page,
                    ub: cd.ub.device_ptr(),
                    best: cd.best.device_ptr() + (gi * self.cap_rows * n_heads * 4) as u64,
                    scores: cd.scores.device_ptr(),
                    cnt: cd.cnt.device_ptr(),
                    mcount: cd.mcount.device_ptr(),
                    vpages: vp,
                    vcap: cd.vcap,
                };
                ctx.sfi_cand_pick(kv, &a)?;
                (vpages, vmeta, vcap) = (vp, cd.vmeta.device_ptr(), cd.vcap);
            }
        }
        let ls = self.cap_rows * n_heads * kv.capacity * 4;
        let p = SparseDecode {
            batch,
            n_heads,
            scale,
            splits: if capture {
                self.step_splits
            } else {
                self.splits
            },
            q,
            out,
            seq_lens,
            slots,
            ck,
            cv,
            ccap,
            clen,
            rstart,
            rwin,
            logits: match (capture, &self.oracle) {
                (false, _) => 0,
                // the oracle selects within the layer: one layer's scores at a time
                (true, Some(_)) => self.logits.device_ptr(),
                (true, None) => self.logits.device_ptr() + (gi * ls) as u64,
            },
            capture: self.capture.device_ptr(),
            lstride: kv.capacity,
            post,
            cidx,
            cgran,
            vpages,
            vmeta,
            vcap,
        };
        // The partials at the most splits any step uses, from the first step on: a later
        // capturing step must not reallocate what a captured fast-step graph points at.
        let most = self
            .cap_splits
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .clamp(1, 1024);
        let rows = batch * n_heads * most;
        ws.ensure(ctx, rows * kv.head_dim, rows * 2)?;
        ctx.attn_sparse_decode(kc, vc, kv, ws, &p)?;
        if capture && self.oracle.is_some() {
            // The capturing rows attended densely: their picks, then every row over its memory.
            self.oracle_select(ctx, gi, n_heads, refresh)?;
            let fast = SparseDecode {
                logits: 0,
                splits: self.splits,
                ..p
            };
            ctx.attn_sparse_decode(kc, vc, kv, ws, &fast)?;
        }
        if let (Some(h), Some((ck, cv))) = (&self.h2o, &self.compact) {
            if post.is_some() {
                return Err(CudaError::bad(
                    "sparse decode",
                    "H2O scores keys with the step's query: qkv_post runs first",
                ));
            }
            let (scores, cpos, _) = self.h2o_at(h, gi, 0);
            let a = H2oStep {
                batch,
                n_heads,
                scale,
                q,
                k_cache: kc.device_ptr(),
                v_cache: vc.device_ptr(),
                ck: ck.device_ptr() + (gi * el) as u64,
                cv: cv.device_ptr() + (gi * el) as u64,
                cpos,
                scores,
                clen,
                rstart,
                seq_lens,
                slots,
                heavy: h.heavy,
                recent: h.recent,
                zs: h.step.zs.device_ptr(),
                part: h.step.part.device_ptr(),
                mins: h.step.mins.device_ptr(),
                count: h.step.count.device_ptr(),
            };
            ctx.h2o_decode(kv, &a)?;
        }
        Ok(())
    }

    /// The oracle on global layer `gi`, after the capturing rows of `refresh` left their scores
    /// (row r of `logits` for the r-th capturing slot): each slot's exact top keys of its query
    /// in the rule's domain (`snap_select`, one row, no pooling) gathered behind its sinks, and
    /// the keys from the domain's end read in place.
    fn oracle_select(
        &mut self,
        ctx: &CudaContext,
        gi: usize,
        n_heads: usize,
        refresh: &[Refresh],
    ) -> Result<(), CudaError> {
        let rows: Vec<usize> = refresh
            .iter()
            .map(|r| self.cap_row(r.slot))
            .collect::<Result<_, _>>()?;
        let geom = self.gather_geom();
        let (kv, ns) = (self.kv, self.num_slots);
        let (Some(o), Some((ck, cv))) = (self.oracle.as_mut(), &self.compact) else {
            return Ok(());
        };
        let (sinks, _, k) = o.rule.layout();
        for (r, row) in refresh.iter().zip(rows) {
            let (slot, len) = (r.slot, r.len);
            let (lo, hi) = o.rule.domain(len);
            let a = SnapArgs {
                logits: self.logits.device_ptr() + (row * n_heads * kv.capacity * 4) as u64,
                lstride: kv.capacity,
                rows: 1,
                len0: len,
                n: hi - lo,
                k,
                kernel: 1,
                lo,
            };
            ctx.snap_select(&a, &mut o.sc)?;
            let dst = (ck, cv, &self.clen, &self.rstart);
            let g = geom.args((gi, 1), slot, (sinks, hi), dst);
            ctx.gather_picks(kv, o.sc.picks(), &g)?;
            let at = ((gi * ns + slot) * kv.kv_heads * k * 4) as u64;
            let bytes = kv.kv_heads * k * 4;
            Self::copy_raw(ctx, o.sc.picks().0, o.picks.device_ptr() + at, bytes)?;
        }
        Ok(())
    }

    /// The oracle's last picks of slot `s` on every global layer, `[layer][kv_head]` ascending
    /// positions (the sinks and the keys read in place not included; empty before a selection).
    /// Downloads and synchronises; for tests.
    pub fn oracle_picks(
        &self,
        ctx: &CudaContext,
        s: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        let Some(o) = &self.oracle else {
            return Err(CudaError::bad(
                "oracle picks",
                "the policy is not the oracle".to_string(),
            ));
        };
        if !self.has_mem[s] {
            return Ok(vec![vec![Vec::new(); self.kv.kv_heads]; self.ng]);
        }
        let all = ctx.download(&o.picks)?;
        let (ns, kvh, k) = (self.num_slots, self.kv.kv_heads, o.rule.layout().2);
        Ok((0..self.ng)
            .map(|gi| {
                (0..kvh)
                    .map(|h| all[((gi * ns + s) * kvh + h) * k..][..k].to_vec())
                    .collect()
            })
            .collect())
    }

    /// H2O's buffers of (global layer `gi`, slot `s`): its scores `[kv_heads, capacity]`, its
    /// compact rows' positions `[kv_heads, heavy]` and the layer's clen entry (device addresses).
    fn h2o_at(&self, h: &H2oState, gi: usize, s: usize) -> (u64, u64, u64) {
        let (ns, kvh) = (self.num_slots, self.kv.kv_heads);
        let row = (gi * ns + s) * kvh;
        (
            h.scores.device_ptr() + (row * self.kv.capacity * 4) as u64,
            h.cpos.device_ptr() + (row * h.heavy * 4) as u64,
            self.clen.device_ptr() + ((gi * ns + s) * 4) as u64,
        )
    }

    /// H2O, a prefill chunk of `n` rows at `pos0` of `slot` on global layer `l` (q rows
    /// `[n, n_heads, hdk]`, this chunk's keys already cached): the rows attend again, a
    /// sub-chunk at a time, and their probabilities are added to every key's score (the first
    /// chunk of a sequence starts the scores from zero). Nothing for other policies.
    #[allow(clippy::too_many_arguments)]
    pub fn h2o_prefill_layer(
        &mut self,
        ctx: &CudaContext,
        l: usize,
        kc: &GpuBuffer<bf16>,
        vc: &GpuBuffer<bf16>,
        q: u64,
        (slot, pos0, n): (usize, usize, usize),
        n_heads: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        let (Some(gi), Some(mut h)) = (self.gidx[l], self.h2o.take()) else {
            return Ok(());
        };
        let res = self.h2o_score_rows(
            ctx,
            &mut h,
            gi,
            (kc, vc),
            q,
            (slot, pos0, n),
            n_heads,
            scale,
        );
        self.h2o = Some(h);
        res
    }

    #[allow(clippy::too_many_arguments)]
    fn h2o_score_rows(
        &self,
        ctx: &CudaContext,
        h: &mut H2oState,
        gi: usize,
        (kc, vc): (&GpuBuffer<bf16>, &GpuBuffer<bf16>),
        q: u64,
        (slot, pos0, n): (usize, usize, usize),
        n_heads: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        let (kv, zeros) = (self.kv, self.zeros.device_ptr());
        let (scores, cpos, _) = self.h2o_at(h, gi, slot);
        if h.resume[slot] && h.saved_len[slot] == Some(pos0) {
            // the next part of a prompt: its sums before the last part's selection
            Self::copy_raw(
                ctx,
                h.saved_at(scores),
                scores,
                kv.kv_heads * kv.capacity * 4,
            )?;
        }
        if pos0 == 0 {
            ctx.zero_raw(scores, kv.kv_heads * kv.capacity * 4)?;
            ctx.zero_raw(cpos, kv.kv_heads * h.heavy * 4)?;
        }
        if h.slots_for != Some(slot) {
            ctx.upload_into(&vec![slot as u32; h.rows], &mut h.slots)?;
            h.slots_for = Some(slot);
        }
        for r0 in (0..n).step_by(h.rows) {
            let rows = h.rows.min(n - r0);
            let splits = ctx.sparse_splits(rows, n_heads, &kv);
            let wr = rows * n_heads * splits;
            h.ws.ensure(ctx, wr * kv.head_dim, wr * 2)?;
            let p = SparseDecode {
                batch: rows,
                n_heads,
                scale,
                splits,
                q: q + (r0 * n_heads * kv.head_dim * 2) as u64,
                out: h.out.device_ptr(),
                seq_lens: h.lens.device_ptr() + ((pos0 + r0) * 4) as u64,
                slots: h.slots.device_ptr(),
                logits: h.logits.device_ptr(),
                capture: h.rows1.device_ptr(),
                ..SparseDecode::in_place(kc.device_ptr(), vc.device_ptr(), kv.capacity, zeros)
            };
            ctx.attn_sparse_decode(kc, vc, kv, &mut h.ws, &p)?;
            let a = H2oColsum {
                logits: h.logits.device_ptr(),
                lstride: kv.capacity,
                rows,
                len0: pos0 + r0 + 1,
                scores,
                sstride: kv.capacity,
            };
            ctx.h2o_colsum(&a, &h.sc)?;
        }
        Ok(())
    }

    /// H2O after slot `s` holds `len` tokens from a prefill: on every global layer the top
    /// `heavy` keys before the window `[len - recent, len)` by score go to the compact buffer,
    /// the others are evicted (the CPU's `H2oPolicy::end_prefill`). A policy set after the
    /// prefill has no scores yet: its ties keep the first positions. With `keep` (the end of a
    /// prefill) the sums are kept first, for a cut back to `len` (`truncate_slot`).
    fn h2o_settle(
        &mut self,
        ctx: &CudaContext,
        s: usize,
        len: usize,
        keep: bool,
    ) -> Result<(), CudaError> {
        let Some(mut h) = self.h2o.take() else {
            return Ok(());
        };
        let kept = if keep {
            self.h2o_copy_sums(ctx, &h, s, true)
        } else {
            Ok(())
        };
        let res = kept.and_then(|_| self.h2o_settle_with(ctx, &mut h, s, len));
        if keep {
            h.saved_len[s] = Some(len);
            h.resume[s] = false;
        }
        self.h2o = Some(h);
        res?;
        self.snap_prompt[s] = Some(len);
        self.has_mem[s] = true;
        self.refreshed_len[s] = len;
        Ok(())
    }

    fn h2o_settle_with(
        &self,
        ctx: &CudaContext,
        h: &mut H2oState,
        s: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        let n = len.saturating_sub(h.recent);
        let k = h.heavy.min(n);
        let geom = self.gather_geom();
        let Some((ck, cv)) = &self.compact else {
            return Ok(());
        };
        for gi in 0..self.ng {
            let (scores, cpos, clen) = self.h2o_at(h, gi, s);
            if k == 0 {
                let rstart = self.rstart.device_ptr() + ((gi * self.num_slots + s) * 4) as u64;
                for dst in [clen, rstart] {
                    Self::copy_raw(ctx, self.zeros.device_ptr(), dst, 4)?;
                }
                continue;
            }
            let a = H2oSettle {
                scores,
                sstride: self.kv.capacity,
                cpos,
                n,
                k,
            };
            ctx.h2o_settle(&a, &mut h.sc)?;
            let dst = (ck, cv, &self.clen, &self.rstart);
            let g = geom.args((gi, 1), s, (0, n), dst);
            ctx.gather_picks(self.kv, h.sc.picks(k), &g)?;
        }
        Ok(())
    }

    /// H2O: the positions of slot `slot`'s heavy hitters on every global layer, per kv head,
    /// ascending (downloads and synchronises; for tests). The window `[rstart, len)` is the rest.
    pub fn h2o_heavy(
        &self,
        ctx: &CudaContext,
        slot: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        let Some(h) = &self.h2o else {
            return Err(CudaError::bad(
                "h2o heavy",
                "the policy is not H2O".to_string(),
            ));
        };
        let clen = ctx.download(&self.clen)?;
        let cpos = ctx.download(&h.cpos)?;
        let (ns, kvh) = (self.num_slots, self.kv.kv_heads);
        Ok((0..self.ng)
            .map(|gi| {
                let c = clen[gi * ns + slot] as usize;
                (0..kvh)
                    .map(|kh| {
                        let at = ((gi * ns + slot) * kvh + kh) * h.heavy;
                        let mut v = cpos[at..at + c].to_vec();
                        v.sort_unstable();
                        v
                    })
                    .collect()
            })
            .collect())
    }

    /// The prefill bootstrap of global layer `l`: the rows [row0, row0 + rows) of a chunk at
    /// `pos0` of `slot` (q rows `[n, n_heads, hdk]`) attend densely and leave their scores, then
    /// the Selector and the gather build this layer's memory.
    #[allow(clippy::too_many_arguments)]
    pub fn bootstrap_layer(
        &mut self,
        ctx: &CudaContext,
        l: usize,
        kc: &GpuBuffer<bf16>,
        vc: &GpuBuffer<bf16>,
        ws: &mut AttnWorkspace,
        q: u64,
        r: &Refresh,
        pos0: usize,
        n_heads: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        let Some(gi) = self.gidx[l] else {
            return Ok(());
        };
        let kv = self.kv;
        let row0 = r.boot_row0.unwrap_or(0);
        let lens: Vec<u32> = (0..r.rows).map(|i| (pos0 + row0 + i + 1) as u32).collect();
        ctx.upload_into(&lens, &mut self.boot_lens)?;
        ctx.upload_into(&vec![r.slot as u32; r.rows], &mut self.boot_slots)?;
        let p = SparseDecode {
            batch: r.rows,
            n_heads,
            scale,
            splits: ctx.sparse_splits(r.rows, n_heads, &kv),
            q: q + (row0 * n_heads * kv.head_dim * 2) as u64,
            out: self.boot_out.device_ptr(),
            seq_lens: self.boot_lens.device_ptr(),
            slots: self.boot_slots.device_ptr(),
            logits: self.logits.device_ptr(),
            capture: self.rows1.device_ptr(),
            ..SparseDecode::in_place(
                kc.device_ptr(),
                vc.device_ptr(),
                kv.capacity,
                self.zeros.device_ptr(),
            )
        };
        ctx.attn_sparse_decode(kc, vc, kv, ws, &p)?;
        if self.snap().is_some() {
            return self.snap_layer(ctx, gi, r, (kc.device_ptr(), vc.device_ptr()));
        }
        self.select_gather(ctx, gi, 1, r, self.logits.device_ptr(), 0, n_heads, false)
    }

    /// SnapKV's selection on global layer `gi` of `r.slot` after its observation window (the
    /// last `r.rows` of `r.len` prompt rows) left its scores: the top keys before the window
    /// into the compact buffer, the window and what follows read in place. A layer whose
    /// capacity holds the prompt stays dense (as the CPU's `snap_keep` keeps everything).
    /// Under FastKV's propagation (`tsp_prompt`) the layer holds `r.len` propagated rows of
    /// a longer prompt, compact from row 0: the top keys before its window (all of them when
    /// they fit) go to the compact buffer, and the window moves to the rows of its positions,
    /// the prompt's last, where decoding reads it in place. `(kc, vc)`: the layer's caches.
    fn snap_layer(
        &mut self,
        ctx: &CudaContext,
        gi: usize,
        r: &Refresh,
        (kc, vc): (u64, u64),
    ) -> Result<(), CudaError> {
        let geom = self.gather_geom();
        let (Some(c), Some(sc), Some((ck, cv))) = (self.snap(), self.snap.as_mut(), &self.compact)
        else {
            return Ok(());
        };
        let (kv, ns, n) = (self.kv, self.num_slots, r.len);
        let full = self.tsp_prompt.unwrap_or(n);
        let cap = c.capacities(self.ng, full)[gi];
        let at = |buf: &GpuBuffer<u32>| buf.device_ptr() + ((gi * ns + r.slot) * 4) as u64;
        let (clen, rstart) = (at(&self.clen), at(&self.rstart));
        if gi == 0 {
            self.snap_off[r.slot] = 0.0; // a new selection (a later prefill) replaces the last
            self.snap_prompt[r.slot] = Some(full);
        }
        // (FastKV's later layers hold fewer rows than the prompt: never read whole)
        if full <= cap && full == n {
            for dst in [clen, rstart] {
                Self::copy_raw(ctx, self.zeros.device_ptr(), dst, 4)?;
            }
            self.snap_prompt[r.slot] = None; // this layer reads the whole prompt
            return Ok(());
        }
        let w = c.window.min(n);
        let (prefix, k) = (n - w, (cap - w).min(n - w));
        if full > n {
            // FastKV: the window's rows [n - w, n) belong at [full - w, full)
            let eb = kv.row_len() * 2; // bytes a row (e4m3: half the bf16 elements)
            let row = |base: u64, h: usize, t: usize| {
                base + (((r.slot * kv.kv_heads + h) * kv.capacity + t) * eb) as u64
            };
            let overlap = full - w < n;
            let tmp = if overlap {
                Some(ctx.alloc::<bf16>(w * kv.row_len())?)
            } else {
                None
            };
            for base in [kc, vc] {
                for h in 0..kv.kv_heads {
                    let (src, dst) = (row(base, h, prefix), row(base, h, full - w));
                    match &tmp {
                        Some(t) => {
                            Self::copy_raw(ctx, src, t.device_ptr(), w * eb)?;
                            Self::copy_raw(ctx, t.device_ptr(), dst, w * eb)?;
                        }
                        None => Self::copy_raw(ctx, src, dst, w * eb)?,
                    }
                }
            }
            if let Some(t) = tmp {
                ctx.synchronize()?; // the staging rows are freed on drop
                drop(t);
            }
            if prefix == 0 {
                Self::copy_raw(ctx, self.zeros.device_ptr(), clen, 4)?;
                let rs = ctx.upload(&[(full - w) as u32])?;
                Self::copy_raw(ctx, rs.device_ptr(), rstart, 4)?;
                ctx.synchronize()?;
                self.snap_off[r.slot] += -((full - w) as f64) / self.ng as f64;
                return Ok(());
            }
        }
        let a = SnapArgs {
            logits: self.logits.device_ptr(),
            lstride: kv.capacity,
            rows: r.rows,
            len0: n + 1 - r.rows,
            n: prefix,
            k,
            kernel: c.kernel,
            lo: 0,
        };
        ctx.snap_select(&a, sc)?;
        let dst = (ck, cv, &self.clen, &self.rstart);
        // the range read in place starts at the window, at its own rows
        let g = geom.args((gi, 1), r.slot, (0, full - w), dst);
        ctx.gather_picks(kv, sc.picks(), &g)?;
        // keys a fast step reads at length len: k + (len - (full - w))
        self.snap_off[r.slot] += (k as f64 - (full - w) as f64) / self.ng as f64;
        Ok(())
    }

    /// FastKV's token choice after a prefill chunk whose last `rows` rows, of a prompt of `n`
    /// tokens, captured their scores at the TSP layer (the last global layer that chunk ran):
    /// the top `k` keys before those rows by `tsp_select`, ascending (downloads).
    pub fn tsp_picks(
        &self,
        ctx: &CudaContext,
        n: usize,
        rows: usize,
        k: usize,
        kernel: usize,
        n_heads: usize,
    ) -> Result<Vec<u32>, CudaError> {
        let kv = self.kv;
        let mut sc = SnapScratch::new(ctx, rows, n_heads, kv.kv_heads, n - rows, k)?;
        let a = SnapArgs {
            logits: self.logits.device_ptr(),
            lstride: kv.capacity,
            rows,
            len0: n + 1 - rows,
            n: n - rows,
            k,
            kernel,
            lo: 0,
        };
        ctx.tsp_select(&a, &mut sc)?;
        Ok(sc.download(ctx)?.swap_remove(0))
    }

    /// Whether the refreshes of a slow decode step can run asynchronously: staging buffers
    /// exist, every refreshed slot already has a memory to keep using meanwhile, and the
    /// Selector is not being profiled (the profile times stages on the decode stream).
    pub fn can_stage(&self, refresh: &[Refresh]) -> bool {
        self.stage.is_some()
            && self.profile().is_none()
            && refresh
                .iter()
                .all(|r| self.has_mem[r.slot] && r.boot_row0.is_none())
    }

    /// The refreshes of a slow decode step, all global layers of each refreshed slot at once
    /// (their scores were captured by `decode_layer`). With `staged` (see `can_stage`) they
    /// run on the side stream into the staging buffers, and the event returned marks their
    /// end; `publish` each slot after the decode stream waited for it.
    pub fn refresh_decode(
        &mut self,
        ctx: &CudaContext,
        refresh: &[Refresh],
        n_heads: usize,
        staged: bool,
    ) -> Result<Option<cudarc::driver::CudaEvent>, CudaError> {
        let ls = self.cap_rows * n_heads * self.kv.capacity;
        let rows: Vec<usize> = refresh
            .iter()
            .map(|r| self.cap_row(r.slot))
            .collect::<Result<_, _>>()?;
        if staged {
            ctx.side_begin()?;
        }
        let mut res = Ok(());
        for (r, row) in refresh.iter().zip(rows) {
            let logits = self.logits.device_ptr() + (row * n_heads * self.kv.capacity * 4) as u64;
            res = self.select_gather(ctx, 0, self.ng, r, logits, ls, n_heads, staged);
            if res.is_err() {
                break;
            }
        }
        // The views were this step's: the next steps run q/k post-processing where they would.
        if let Some(c) = self.cand.as_mut() {
            c.plans.clear();
        }
        if !staged {
            return res.map(|_| None);
        }
        let done = ctx.side_end();
        res?;
        for r in refresh {
            self.norm_len[r.slot] = r.len;
            self.refreshes += 1;
        }
        done.map(Some)
    }

    /// Publishes slot `slot`'s staged memory (refreshed at length `len`) into the live buffers
    /// (after the decode stream waited for the refresh's event).
    pub fn publish(&mut self, ctx: &CudaContext, slot: usize, len: usize) -> Result<(), CudaError> {
        let (Some(st), Some((ck, cv))) = (&self.stage, &self.compact) else {
            return Err(CudaError::bad(
                "sfi publish",
                "no staged refresh".to_string(),
            ));
        };
        let kv = self.kv;
        let per_slot = kv.kv_heads * self.ccap * kv.row_len();
        let src = [
            st.ck.device_ptr(),
            st.cv.device_ptr(),
            st.clen.device_ptr(),
            st.rstart.device_ptr(),
        ];
        let dst = [
            ck.device_ptr(),
            cv.device_ptr(),
            self.clen.device_ptr(),
            self.rstart.device_ptr(),
        ];
        ctx.sfi_publish(src, dst, slot, self.num_slots, self.ng, per_slot)?;
        self.refreshed_len[slot] = len;
        Ok(())
    }

    /// Key norms, Selector and gather for global layers [gi0, gi0 + layers) of `r.slot`, into
    /// the live compact buffers or (`staged`) the staging ones.
    #[allow(clippy::too_many_arguments)]
    fn select_gather(
        &mut self,
        ctx: &CudaContext,
        gi0: usize,
        layers: usize,
        r: &Refresh,
        logits: u64,
        logit_layer_stride: usize,
        n_heads: usize,
        staged: bool,
    ) -> Result<(), CudaError> {
        let recent_start = self.recent_start(r.len);
        let geom = self.gather_geom();
        // A decode slow step that read a view (SFI's cheaper slow step): its plan.
        let plan = match (&self.cand, r.boot_row0) {
            (Some(cd), None) => self
                .cap_row(r.slot)
                .ok()
                .and_then(|row| cd.plans.get(row).copied().flatten().map(|p| (row, p))),
            _ => None,
        };
        let (Some(c), Some((ck, cv)), Some(norms), Some(sel)) =
            (self.sfi(), &self.compact, &self.norms, self.sel.as_mut())
        else {
            return Ok(());
        };
        let (kv, ns) = (self.kv, self.num_slots);
        let nls = ns * kv.kv_heads * kv.capacity; // norms per layer
        let slot_norms =
            norms.device_ptr() + ((gi0 * nls + r.slot * kv.kv_heads * kv.capacity) * 4) as u64;
        let kptrs = self.kptrs.device_ptr() + (gi0 * 8) as u64;
        let p0 = self.norm_len[r.slot].min(r.len);
        ctx.sfi_stage(sel, 0, || {
            ctx.sfi_key_norms(kptrs, layers, kv, r.slot, p0, r.len, slot_norms, nls)
        })?;
        let mut a = SelectArgs {
            layers,
            logits,
            lstride: kv.capacity,
            logit_layer_stride,
            n_heads,
            kv_heads: kv.kv_heads,
            rows: r.rows,
            sinks: c.sinks,
            recent_start,
            norms: slot_norms,
            norm_stride: kv.capacity,
            norm_layer_stride: nls,
            view: None,
        };
        // A view: the captured scores are in view order; the Selector's domain, key norms and
        // position prior follow it, and its picks go back to positions before the gather.
        let view = match (plan, &self.cand) {
            (Some((row, p)), Some(cd)) => {
                let v = SelectView {
                    vpages: cd.vpages.device_ptr() + (gi0 * self.cap_rows * cd.vcap * 4) as u64,
                    row,
                    cap_rows: self.cap_rows,
                    vcap: cd.vcap,
                    entries: p.entries(),
                    page: p.page,
                    recent_start: p.recent_start,
                };
                let vlen = p.view_len(r.len);
                let out = &cd.norms_v;
                ctx.sfi_stage(sel, 0, || {
                    ctx.sfi_view_norms(kv, layers, &v, vlen, slot_norms, nls, out, cd.vmax)
                })?;
                a.recent_start = p.entries() * p.page;
                a.norms = out.device_ptr();
                a.norm_stride = cd.vmax;
                a.norm_layer_stride = kv.kv_heads * cd.vmax;
                a.view = Some(v);
                Some(v)
            }
            _ => None,
        };
        ctx.sfi_select(&a, sel)?;
        if let Some(v) = view {
            let [_, _, picks, mcount] = sel.topk_picks();
            let k = c.selected;
            ctx.sfi_stage(sel, 5, || {
                ctx.sfi_view_unmap(kv.kv_heads, layers, &v, picks, mcount, k)
            })?;
        }
        let dst = match (&self.stage, staged) {
            (Some(st), true) => (&st.ck, &st.cv, &st.clen, &st.rstart),
            (None, true) => {
                return Err(CudaError::bad(
                    "sfi refresh",
                    "no staging buffers".to_string(),
                ))
            }
            _ => (ck, cv, &self.clen, &self.rstart),
        };
        let g = geom.args((gi0, layers), r.slot, (c.sinks, recent_start), dst);
        ctx.sfi_stage(sel, 6, || ctx.sfi_gather(kv, sel, &g))
    }

    /// Where the gathers of this state read and write (see [`GatherGeom::args`]).
    fn gather_geom(&self) -> GatherGeom {
        GatherGeom {
            kv: self.kv,
            ns: self.num_slots,
            ccap: self.ccap,
            kptrs: self.kptrs.device_ptr(),
            vptrs: self.vptrs.device_ptr(),
        }
    }

    /// Per-stage Selector milliseconds summed so far (`SLOWFAST_SFI_PROFILE=1`).
    pub fn profile(&self) -> Option<[f64; 7]> {
        self.sel.as_ref().and_then(|s| s.profile())
    }

    /// After a forward that refreshed `refreshed` slots (the bootstrap: after its last layer).
    pub fn finish_refresh(&mut self, refreshed: &[Refresh]) {
        for r in refreshed {
            self.norm_len[r.slot] = r.len;
            self.has_mem[r.slot] = true;
            self.refreshed_len[r.slot] = r.len;
            self.refreshes += 1;
        }
    }

    /// Whether slot `s`, `len` keys long with this step's token, captures in this decode step:
    /// SFI when its trigger asked (`requested`) or it has no memory yet, the oracle by its
    /// reselection rule; never for the other policies.
    pub fn wants_capture(&self, s: usize, len: usize, requested: bool) -> bool {
        match (self.policy, &self.oracle) {
            (GpuKvPolicy::Sfi(_), _) => {
                len > self.policy.dense_below() && (requested || !self.has_mem[s])
            }
            // the steps since the last selection: one a token
            (_, Some(o)) => {
                let age = self.has_mem[s].then(|| len - self.refreshed_len[s]);
                o.rule.sparse_at(len) && o.rule.reselects(age)
            }
            _ => false,
        }
    }

    /// Slot `slot`'s live SFI memory of every global layer: compact K and V rows
    /// (`[layer][kv_head, ccap, head_dim]` concatenated), compact lengths and recent starts
    /// (downloads and synchronises; for tests).
    pub fn memory(&self, ctx: &CudaContext, slot: usize) -> Result<CompactMemory, CudaError> {
        let Some((ck, cv)) = &self.compact else {
            return Err(CudaError::bad(
                "compact memory",
                "the policy keeps no compact memory".to_string(),
            ));
        };
        let (ns, kv) = (self.num_slots, self.kv);
        let per = kv.kv_heads * self.ccap * kv.row_len();
        let pick = |all: Vec<bf16>| -> Vec<bf16> {
            (0..self.ng)
                .flat_map(|gi| all[(gi * ns + slot) * per..(gi * ns + slot + 1) * per].to_vec())
                .collect()
        };
        let at =
            |all: Vec<u32>| -> Vec<u32> { (0..self.ng).map(|gi| all[gi * ns + slot]).collect() };
        Ok(CompactMemory {
            k: pick(ctx.download(ck)?),
            v: pick(ctx.download(cv)?),
            clen: at(ctx.download(&self.clen)?),
            rstart: at(ctx.download(&self.rstart)?),
        })
    }

    /// The scores slot `slot`'s last capturing decode step left on every global layer
    /// (`[ng][n_heads][len]`: each query head's logits over keys `0..len`, in the Selector's
    /// log2 units), for probes of dense attention (`eval --task stability`). An error when the
    /// slot did not capture in the last capturing step, or when SFI's cheaper slow step is
    /// on (its rows are a view's keys, not `0..len`). Downloads and synchronises.
    pub fn captured_scores(
        &self,
        ctx: &CudaContext,
        slot: usize,
        n_heads: usize,
        len: usize,
    ) -> Result<Vec<f32>, CudaError> {
        if self.cand.is_some() {
            return Err(CudaError::bad(
                "captured scores",
                "SFI's cheaper slow step captures a view's keys, not every key".to_string(),
            ));
        }
        if len > self.kv.capacity {
            return Err(CudaError::bad(
                "captured scores",
                format!("{len} keys of a capacity of {}", self.kv.capacity),
            ));
        }
        let row = self.cap_row(slot)?;
        let (cap, ls) = (self.kv.capacity, self.cap_rows * n_heads * self.kv.capacity);
        let mut out = Vec::with_capacity(self.ng * n_heads * len);
        for gi in 0..self.ng {
            let at = gi * ls + row * n_heads * cap;
            let rows = ctx.download_range(&self.logits, at..at + n_heads * cap)?;
            for h in 0..n_heads {
                out.extend_from_slice(&rows[h * cap..h * cap + len]);
            }
        }
        Ok(out)
    }

    /// Bytes of the compact buffers (all layers and slots).
    pub fn compact_bytes(&self) -> usize {
        self.compact
            .as_ref()
            .map_or(0, |(k, v)| (k.len() + v.len()) * 2)
    }

    /// Tokens a fast step of `slot` at length `len` attends per kv head on a global layer
    /// (SFI: sinks + chosen + the recent window from its start at the last refresh).
    /// Keys slot `slot`'s last decode slow step read a layer (its length when dense, a view's
    /// keys plus a key a page bound when cheap; None before any).
    pub fn slow_read(&self, slot: usize) -> Option<usize> {
        self.slow_read.get(slot).copied().filter(|&n| n > 0)
    }

    /// The lowest row of slot `slot` the global layers may read again, and the shortest
    /// length it holds while they do: SnapKV / PyramidKV after a selection that compacted
    /// every global layer (the window before the prompt's end and what follows); None when a
    /// global layer reads from row 0 (every other policy, or a prompt that fit).
    pub fn reads_from(&self, slot: usize) -> Option<(usize, usize)> {
        let n = self.snap_prompt.get(slot).copied().flatten()?;
        let window = match self.policy {
            GpuKvPolicy::Snap(c) => c.window, // every layer's is the same (snap_layer)
            // the heavy hitters are copies; decode steps read the window and move it up
            GpuKvPolicy::H2o { recent, .. } => recent,
            _ => return None,
        };
        self.has_mem[slot].then_some((n, n - window.min(n)))
    }

    pub fn attended(&self, slot: usize, len: usize) -> usize {
        match self.policy {
            GpuKvPolicy::Full => len,
            _ if len <= self.policy.dense_below() => len,
            GpuKvPolicy::Streaming { sinks, recent } => sinks + recent.min(len - sinks),
            GpuKvPolicy::Sfi(c) => {
                if !self.has_mem[slot] {
                    return len;
                }
                let rs = self.recent_start(self.refreshed_len[slot]);
                c.sinks + c.selected.min(rs.saturating_sub(c.sinks)) + len.saturating_sub(rs)
            }
            // no memory: the prompt fit, every step reads everything (as on the CPU)
            GpuKvPolicy::Snap(_) if !self.has_mem[slot] => len,
            GpuKvPolicy::Snap(_) => (len as f64 + self.snap_off[slot]).round() as usize,
            // the heavy hitters and the window of a step at `len`
            GpuKvPolicy::H2o { heavy, recent } => {
                let r0 = len.saturating_sub(recent + 1);
                heavy.min(r0) + len - r0
            }
            GpuKvPolicy::Oracle(_) if !self.has_mem[slot] => len,
            GpuKvPolicy::Oracle(r) => {
                // the sinks and picks of the last selection, and every key from its domain's end
                let (sinks, _, k) = r.layout();
                let (lo, hi) = r.domain(self.refreshed_len[slot]);
                sinks + k.min(hi - lo) + len - hi
            }
            GpuKvPolicy::Quest(c) => {
                // the chosen full pages and the newest page; the first layers read densely
                let dense = self.gidx[..c.dense_layers.min(self.gidx.len())]
                    .iter()
                    .filter(|g| g.is_some())
                    .count();
                let full = (len - 1) / c.page;
                let sparse = (c.pages - 1).min(full) * c.page + len - full * c.page;
                (dense * len + (self.ng - dense) * sparse) / self.ng
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{fast_step_splits, GpuKvPolicy, GpuSnapConfig};

    #[test]
    fn snap_compact_buffer_holds_every_layers_picks() {
        // The compact buffer is sized once (`max_picks`) before any prompt is seen: every
        // layer's selection (capacity less the window) must fit it for every prompt length.
        for &(capacity, window, layers) in
            &[(1638, 32, 36), (100, 8, 28), (40, 32, 3), (2048, 32, 2)]
        {
            for beta in [None, Some(20.0), Some(2.0)] {
                let c = GpuSnapConfig {
                    capacity,
                    window,
                    kernel: 7,
                    pyramid_beta: beta,
                };
                for n in (capacity + 1..capacity * 8).step_by(capacity / 7 + 1) {
                    let caps = c.capacities(layers, n);
                    assert_eq!(caps.len(), layers);
                    let most = caps.iter().map(|&k| k - window.min(k)).max().unwrap();
                    assert!(
                        most <= c.max_picks(),
                        "{c:?} at {n}: {most} > {}",
                        c.max_picks()
                    );
                }
            }
        }
        let p = GpuKvPolicy::Snap(GpuSnapConfig {
            capacity: 512,
            window: 32,
            kernel: 7,
            pyramid_beta: None,
        });
        assert_eq!((p.dense_below(), p.prefill_rows()), (512, Some(32)));
        assert_eq!(GpuKvPolicy::Full.prefill_rows(), None);
    }

    #[test]
    fn fast_step_splits_leave_each_block_three_tiles_within_one_wave() {
        // Qwen3-4B on 132 SMs at 2048 tokens a head: batch 1 (wave 33) -> 11, batch 6 (wave 5)
        // -> 5, the counts runs 68 and 90 measured fastest.
        assert_eq!(fast_step_splits(33, 2048), 11);
        assert_eq!(fast_step_splits(5, 2048), 5);
        assert_eq!(fast_step_splits(33, 4096), 22);
        assert_eq!(fast_step_splits(33, 1 << 14), 33);
        // a short memory still gets one split; a partial tile counts
        assert_eq!(fast_step_splits(33, 100), 1);
        assert_eq!(fast_step_splits(33, 192), 1);
        assert_eq!(fast_step_splits(33, 193), 2);
        assert_eq!(fast_step_splits(33, 0), 1);
        assert_eq!(fast_step_splits(1, 1 << 20), 1);
    }
}
