//! Quest's page selection on the GPU (kernels/quest.cu): per-page key bounds kept on the
//! device, each decode step's page scores, and the top `k` full pages a kv head
//! (`quest_topk`, a radix select over the page scores in shared memory). The rules (page
//! size, pages read, the bound, the newest page always read) are the CPU policy's
//! (`slowfast_kv::quest`); only the arithmetic runs here. The sparse decode kernel reads the
//! chosen pages in place through its page list.

use super::{u32_of, KvLayout};
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// Full pages before the newest one whose bounds a decode step recomputes from the keys: a
/// page fills while the sequence decodes, and a speculative verification may add up to
/// `QUEST_FRESH * page` tokens at once.
pub const QUEST_FRESH: usize = 4;

/// The per-step selection's scratch for up to `rows` sequences: page scores, the chosen
/// pages (the sparse kernel's page list `[rows, kv_heads, k]`) and their counts `[rows]`.
pub struct QuestScratch {
    rows: usize,
    kv_heads: usize,
    maxp: usize,
    k: usize,
    scores: GpuBuffer<f32>, // [rows, kv_heads, maxp]
    cnt: GpuBuffer<u32>,    // [rows, kv_heads]
    sel: GpuBuffer<u32>,    // [rows, kv_heads, k]
    mcount: GpuBuffer<u32>, // [rows]
}

impl QuestScratch {
    /// Scratch for `rows` sequences of `kv_heads` heads over `maxp` pages, keeping `k`.
    pub fn new(
        ctx: &CudaContext,
        rows: usize,
        kv_heads: usize,
        maxp: usize,
        k: usize,
    ) -> Result<Self, CudaError> {
        if rows == 0 || kv_heads == 0 || maxp == 0 || k == 0 {
            return Err(CudaError::bad(
                "quest scratch",
                format!("{rows} rows, {kv_heads} kv heads, {maxp} pages, k {k}"),
            ));
        }
        Ok(QuestScratch {
            rows,
            kv_heads,
            maxp,
            k,
            scores: ctx.alloc(rows * kv_heads * maxp)?,
            cnt: ctx.alloc(rows * kv_heads)?,
            sel: ctx.alloc(rows * kv_heads * k)?,
            mcount: ctx.alloc(rows)?,
        })
    }

    /// Pages kept a kv head at most (the page list's stride).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The page list `[rows, kv_heads, k]` (ascending pages) and its counts `[rows]`.
    pub fn page_list(&self) -> (u64, u64) {
        (self.sel.device_ptr(), self.mcount.device_ptr())
    }

    /// The last selection: per row, per kv head, the chosen pages, ascending (downloads; for
    /// tests).
    pub fn download(&self, ctx: &CudaContext) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        let m = ctx.download(&self.mcount)?;
        let sel = ctx.download(&self.sel)?;
        Ok(self.per_row_head(&sel, self.k, |r| m[r] as usize))
    }

    /// The last selection's page scores `[rows][kv_heads][maxp]` (downloads; for tests; only
    /// the full pages before each sequence's newest are written).
    pub fn scores(&self, ctx: &CudaContext) -> Result<Vec<Vec<Vec<f32>>>, CudaError> {
        let s = ctx.download(&self.scores)?;
        Ok(self.per_row_head(&s, self.maxp, |_| self.maxp))
    }

    /// `v` (`[rows, kv_heads, stride]`) as per-row, per-head vectors of the first `len(row)`
    /// entries.
    fn per_row_head<T: Copy>(
        &self,
        v: &[T],
        stride: usize,
        len: impl Fn(usize) -> usize,
    ) -> Vec<Vec<Vec<T>>> {
        (0..self.rows)
            .map(|r| {
                (0..self.kv_heads)
                    .map(|h| {
                        let at = (r * self.kv_heads + h) * stride;
                        v[at..at + len(r)].to_vec()
                    })
                    .collect()
            })
            .collect()
    }
}

/// One layer's bounds: `[num_slots, kv_heads, maxp, 2, head_dim]` bf16 (min, then max).
#[derive(Clone, Copy, Debug)]
pub struct QuestPages {
    /// Tokens a page.
    pub page: usize,
    /// Pages a (slot, kv head) run: `capacity / page`, rounded up.
    pub maxp: usize,
}

impl QuestPages {
    pub fn new(kv: KvLayout, page: usize) -> Result<Self, CudaError> {
        if page == 0 || kv.head_dim > 256 {
            return Err(CudaError::bad(
                "quest pages",
                format!("pages of {page} tokens, head dim {}", kv.head_dim),
            ));
        }
        Ok(QuestPages {
            page,
            maxp: kv.capacity.div_ceil(page),
        })
    }

    /// Bound elements of one layer.
    pub fn layer_elems(&self, kv: KvLayout) -> usize {
        kv.num_slots * kv.kv_heads * self.maxp * 2 * kv.head_dim
    }
}

/// One decode step's selection on one layer: `q [batch, n_heads, head_dim]` after `qkv_post`,
/// that layer's K cache and bounds, the step's lengths (the newest token included) and slots.
#[derive(Clone, Copy, Debug)]
pub struct QuestArgs {
    pub q: u64,
    pub k_cache: u64,
    pub bounds: u64,
    pub seq_lens: u64,
    pub slots: u64,
    pub batch: usize,
    pub n_heads: usize,
    /// Full pages before the newest whose bounds are recomputed first ([`QUEST_FRESH`]).
    pub fresh: usize,
}

impl CudaContext {
    /// Bounds of pages `[p0, p1)` of `slot` on `layers` layers: K caches from the device array
    /// `kptrs` (u64 each), layer z's bounds at `bounds + z * layer_elems * 2` bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn quest_bounds(
        &self,
        kv: KvLayout,
        pg: QuestPages,
        kptrs: u64,
        layers: usize,
        bounds: u64,
        slot: usize,
        (p0, p1): (usize, usize),
    ) -> Result<(), CudaError> {
        const OP: &str = "quest_bounds";
        let p1 = p1.min(pg.maxp);
        if p0 >= p1 || layers == 0 {
            return Ok(());
        }
        if slot >= kv.num_slots || kptrs == 0 || bounds == 0 {
            return Err(CudaError::bad(
                OP,
                format!("slot {slot} of {}", kv.num_slots),
            ));
        }
        self.launch(
            crate::kernels::kv_kernel("quest_bounds", kv.fp8),
            (
                (p1 - p0).div_ceil(8) as u32,
                kv.kv_heads as u32,
                u32_of(OP, "layers", layers)?,
            ),
            (256, 1, 1),
            0,
            &[
                KArg::P(kptrs),
                KArg::P(bounds),
                KArg::P(pg.layer_elems(kv) as u64), // a u64 scalar: the layer stride
                KArg::U(slot as u32),
                KArg::U(kv.kv_heads as u32),
                KArg::U(u32_of(OP, "capacity", kv.capacity)?),
                KArg::U(kv.head_dim as u32),
                KArg::U(u32_of(OP, "maxp", pg.maxp)?),
                KArg::U(u32_of(OP, "page", pg.page)?),
                KArg::U(p0 as u32),
                KArg::U(p1 as u32),
            ],
        )
    }

    /// Scores every full page of each sequence of `a` and keeps the top `sc.k()` of them a kv
    /// head (ties: lower page first) as the page list in `sc`.
    pub fn quest_select(
        &self,
        kv: KvLayout,
        pg: QuestPages,
        a: &QuestArgs,
        sc: &QuestScratch,
    ) -> Result<(), CudaError> {
        const OP: &str = "quest_select";
        let g = a.n_heads / kv.kv_heads.max(1);
        if a.batch == 0
            || a.batch > sc.rows
            || a.n_heads % kv.kv_heads != 0
            || g * kv.head_dim > 16 * 256
            || sc.kv_heads != kv.kv_heads
            || sc.maxp != pg.maxp
            || [a.q, a.k_cache, a.bounds, a.seq_lens, a.slots].contains(&0)
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "{a:?} over {} kv heads of {} dims, {} pages (scratch: {} rows, {} pages)",
                    kv.kv_heads, kv.head_dim, pg.maxp, sc.rows, sc.maxp
                ),
            ));
        }
        let kvh = kv.kv_heads as u32;
        let maxp = u32_of(OP, "maxp", pg.maxp)?;
        self.launch(
            crate::kernels::kv_kernel("quest_score", kv.fp8),
            (maxp.div_ceil(64), kvh, a.batch as u32),
            (256, 1, 1),
            0,
            &[
                KArg::P(a.q),
                KArg::P(a.k_cache),
                KArg::P(a.bounds),
                KArg::P(a.seq_lens),
                KArg::P(a.slots),
                KArg::P(sc.scores.device_ptr()),
                KArg::P(sc.cnt.device_ptr()),
                KArg::U(a.n_heads as u32),
                KArg::U(kvh),
                KArg::U(u32_of(OP, "capacity", kv.capacity)?),
                KArg::U(u32_of(OP, "num_slots", kv.num_slots)?),
                KArg::U(kv.head_dim as u32),
                KArg::U(maxp),
                KArg::U(u32_of(OP, "page", pg.page)?),
                KArg::U(u32_of(OP, "fresh", a.fresh)?),
            ],
        )?;
        self.launch(
            "quest_topk",
            (kvh, a.batch as u32, 1),
            (1024, 1, 1),
            0,
            &[
                KArg::P(sc.scores.device_ptr()),
                KArg::P(sc.cnt.device_ptr()),
                KArg::P(sc.sel.device_ptr()),
                KArg::P(sc.mcount.device_ptr()),
                KArg::U(kvh),
                KArg::U(maxp),
                KArg::U(u32_of(OP, "k", sc.k)?),
            ],
        )
    }
}
