//! H2O on the GPU (kernels/h2o.cu): prefill rows' probabilities summed into every key's
//! score, the end-of-prefill selection of the heavy hitters (`sfi_topk` over the scores), and
//! each decode step's score update and eviction. The rules are the CPU policy's
//! (`slowfast_kv::h2o`); only the arithmetic runs here.

use super::{u32_of, KvLayout};
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// Query heads a kv head the decode kernel takes (`H2O_MAXG`).
pub const H2O_MAX_GROUP: usize = 16;

/// Device scratch of H2O's prefill scoring (`rows` captured rows at a time) and its selection
/// (up to `heavy` keys a kv head out of up to `max_n`).
pub struct H2oScratch {
    rows: usize,
    n_heads: usize,
    kv_heads: usize,
    max_n: usize,
    heavy: usize,
    stats: GpuBuffer<f32>,  // [rows, n_heads] (max, 1 / sum) pairs
    scores: GpuBuffer<f64>, // [kv_heads, n]
    cnt: GpuBuffer<u32>,    // [kv_heads]
    sel: GpuBuffer<u32>,    // [kv_heads, k]
    mcount: GpuBuffer<u32>, // [1]
}

impl H2oScratch {
    pub fn new(
        ctx: &CudaContext,
        rows: usize,
        n_heads: usize,
        kv_heads: usize,
        max_n: usize,
        heavy: usize,
    ) -> Result<Self, CudaError> {
        if rows == 0 || kv_heads == 0 || n_heads % kv_heads != 0 || heavy == 0 || max_n == 0 {
            return Err(CudaError::bad(
                "h2o scratch",
                format!("{rows} rows, {n_heads} heads over {kv_heads} kv heads, {heavy} heavy of {max_n}"),
            ));
        }
        Ok(H2oScratch {
            rows,
            n_heads,
            kv_heads,
            max_n,
            heavy,
            stats: ctx.alloc(rows * n_heads * 2)?,
            scores: ctx.alloc(kv_heads * max_n)?,
            cnt: ctx.alloc(kv_heads)?,
            sel: ctx.alloc(kv_heads * heavy)?,
            mcount: ctx.alloc(1)?,
        })
    }

    /// (positions `[kv_heads, k]`, the count `[1]`, k) of the last selection, for
    /// `CudaContext::gather_picks`.
    pub(crate) fn picks(&self, k: usize) -> (u64, u64, usize) {
        (self.sel.device_ptr(), self.mcount.device_ptr(), k)
    }
}

/// One prefill sub-chunk's scoring: `rows` captured rows (attn_sparse_decode's capture, log2
/// units, row r of query head h at `logits + ((r * n_heads + h) * lstride + j) * 4`), row r
/// seeing keys `j < len0 + r`, added to one (layer, slot)'s scores `[kv_heads, sstride]`.
#[derive(Clone, Copy, Debug)]
pub struct H2oColsum {
    pub logits: u64,
    pub lstride: usize,
    pub rows: usize,
    pub len0: usize,
    pub scores: u64,
    pub sstride: usize,
}

/// One (layer, slot)'s selection at the end of a prefill: the top `k` of keys `0..n` by
/// `scores` (`[kv_heads, sstride]`), their positions into `cpos` (`[kv_heads, heavy]`), every
/// other key of `0..n` scored -inf (evicted).
#[derive(Clone, Copy, Debug)]
pub struct H2oSettle {
    pub scores: u64,
    pub sstride: usize,
    pub cpos: u64,
    pub n: usize,
    pub k: usize,
}

/// One decode step's update of one global layer (kernels/h2o.cu, `h2o_logits` and `h2o_evict`): the
/// layer's caches, its compact K / V `[num_slots, kv_heads, heavy, head_dim]`, positions
/// `[num_slots, kv_heads, heavy]`, scores `[num_slots, kv_heads, capacity]` and clen / rstart
/// `[num_slots]`; the step's rows (q after RoPE, lengths with the step's token, slots).
#[derive(Clone, Copy, Debug)]
pub struct H2oStep {
    pub batch: usize,
    pub n_heads: usize,
    pub scale: f32,
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub ck: u64,
    pub cv: u64,
    pub cpos: u64,
    pub scores: u64,
    pub clen: u64,
    pub rstart: u64,
    pub seq_lens: u64,
    pub slots: u64,
    pub heavy: usize,
    pub recent: usize,
    /// Scratch (`H2oStepScratch`): the step's logits, the blocks' softmax partials and lowest
    /// heavy hitters, and their counters (zero; each step leaves them zero).
    pub zs: u64,
    pub part: u64,
    pub mins: u64,
    pub count: u64,
}

/// Device scratch of H2O's decode steps for up to `slots` rows (kernels/h2o.cu: `zs`, `part`,
/// `mins`, `count`).
pub struct H2oStepScratch {
    pub zs: GpuBuffer<f32>,
    pub part: GpuBuffer<f32>,
    pub mins: GpuBuffer<f32>,
    pub count: GpuBuffer<u32>,
}

impl H2oStepScratch {
    pub fn new(
        ctx: &CudaContext,
        slots: usize,
        n_heads: usize,
        kv_heads: usize,
        heavy: usize,
        recent: usize,
    ) -> Result<Self, CudaError> {
        let hcap = h2o_held(heavy, recent);
        let blocks = hcap.div_ceil(H2O_KEYS);
        let count = ctx.alloc(slots * kv_heads)?;
        ctx.memset_zero(&count)?;
        Ok(H2oStepScratch {
            zs: ctx.alloc(slots * n_heads * hcap)?,
            part: ctx.alloc(slots * n_heads * blocks * 2)?,
            mins: ctx.alloc(slots * kv_heads * blocks * 4)?,
            count,
        })
    }
}

/// Held keys a block of the decode kernels takes (`H2O_KEYS`).
const H2O_KEYS: usize = 256;

/// Held keys of an H2O step (`heavy + recent + 1`): the stride of `H2oStep::zs`.
fn h2o_held(heavy: usize, recent: usize) -> usize {
    heavy + recent + 1
}

impl CudaContext {
    /// Adds the probabilities of `a.rows` captured prefill rows to their keys' scores.
    pub fn h2o_colsum(&self, a: &H2oColsum, sc: &H2oScratch) -> Result<(), CudaError> {
        const OP: &str = "h2o_colsum";
        if a.rows == 0
            || a.rows > sc.rows
            || a.len0 == 0
            || a.len0 + a.rows - 1 > a.lstride
            || a.len0 + a.rows - 1 > a.sstride
            || a.logits == 0
            || a.scores == 0
        {
            return Err(CudaError::bad(
                OP,
                format!("{a:?} (scratch: {} rows)", sc.rows),
            ));
        }
        let nh = sc.n_heads as u32;
        let lstride = u32_of(OP, "lstride", a.lstride)?;
        let len0 = u32_of(OP, "len0", a.len0)?;
        self.snap_rowstats(a.logits, sc.stats.device_ptr(), a.rows, nh, lstride, len0)?;
        let keys = a.len0 + a.rows - 1;
        self.launch(
            "h2o_colsum",
            (keys.div_ceil(256) as u32, sc.kv_heads as u32, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(a.logits),
                KArg::P(sc.stats.device_ptr()),
                KArg::P(a.scores),
                KArg::U(nh),
                KArg::U((sc.n_heads / sc.kv_heads) as u32),
                KArg::U(a.rows as u32),
                KArg::U(lstride),
                KArg::U(len0),
                KArg::U(u32_of(OP, "sstride", a.sstride)?),
            ],
        )
    }

    /// Keeps the top `a.k` of keys `0..a.n` a kv head (ties: lower position first) by their
    /// scores; their positions go to `a.cpos`, the others' scores to -inf. The picks stay in
    /// `sc` for `gather_picks`.
    pub fn h2o_settle(&self, a: &H2oSettle, sc: &mut H2oScratch) -> Result<(), CudaError> {
        const OP: &str = "h2o_settle";
        if a.n == 0
            || a.n > sc.max_n
            || a.n > a.sstride
            || a.k == 0
            || a.k > sc.heavy
            || a.k > a.n
            || a.scores == 0
            || a.cpos == 0
        {
            return Err(CudaError::bad(
                OP,
                format!("{a:?} (scratch: {} keys, {} heavy)", sc.max_n, sc.heavy),
            ));
        }
        let kvh = sc.kv_heads as u32;
        let n = u32_of(OP, "n", a.n)?;
        let sstride = u32_of(OP, "sstride", a.sstride)?;
        self.launch(
            "h2o_prep",
            (a.n.div_ceil(256) as u32, kvh, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(a.scores),
                KArg::P(sc.scores.device_ptr()),
                KArg::P(sc.cnt.device_ptr()),
                KArg::U(n),
                KArg::U(sstride),
            ],
        )?;
        let picks = [
            sc.scores.device_ptr(),
            sc.cnt.device_ptr(),
            sc.sel.device_ptr(),
            sc.mcount.device_ptr(),
        ];
        self.topk_launch(picks, (kvh, 1, 1024), (kvh, n, a.k as u32, 0))?;
        self.launch(
            "h2o_mark",
            (a.n.max(a.k).div_ceil(256) as u32, kvh, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(sc.sel.device_ptr()),
                KArg::P(sc.mcount.device_ptr()),
                KArg::P(a.cpos),
                KArg::P(a.scores),
                KArg::U(n),
                KArg::U(a.k as u32),
                KArg::U(sc.heavy as u32),
                KArg::U(sstride),
            ],
        )
    }

    /// One decode step of H2O on one global layer (after its sparse attention).
    pub fn h2o_decode(&self, kv: KvLayout, a: &H2oStep) -> Result<(), CudaError> {
        const OP: &str = "h2o_decode";
        kv.check(OP)?;
        let g = a.n_heads / kv.kv_heads.max(1);
        if a.batch == 0
            || a.batch > kv.num_slots
            || a.n_heads % kv.kv_heads != 0
            || g > H2O_MAX_GROUP
            || a.heavy == 0
            || a.recent == 0
            || [
                a.q, a.k_cache, a.v_cache, a.ck, a.cv, a.cpos, a.scores, a.clen, a.rstart,
                a.seq_lens, a.slots, a.zs, a.part, a.mins, a.count,
            ]
            .contains(&0)
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "{a:?} over {kv:?} (at most {H2O_MAX_GROUP} query heads a kv head, a heavy and a recent part)"
                ),
            ));
        }
        let hcap = h2o_held(a.heavy, a.recent);
        let grid = (
            a.batch as u32,
            kv.kv_heads as u32,
            hcap.div_ceil(H2O_KEYS) as u32,
        );
        let (cap, hd) = (u32_of(OP, "capacity", kv.capacity)?, kv.head_dim as u32);
        let (heavy, recent) = (
            u32_of(OP, "heavy", a.heavy)?,
            u32_of(OP, "recent", a.recent)?,
        );
        let hcap = u32_of(OP, "held keys", hcap)?;
        let (nh, kvh) = (a.n_heads as u32, kv.kv_heads as u32);
        self.launch(
            crate::kernels::kv_kernel("h2o_logits", kv.fp8),
            grid,
            (256, 1, 1),
            (g * kv.head_dim * 4) as u32,
            &[
                KArg::P(a.q),
                KArg::P(a.k_cache),
                KArg::P(a.ck),
                KArg::P(a.seq_lens),
                KArg::P(a.slots),
                KArg::P(a.zs),
                KArg::P(a.part),
                KArg::U(nh),
                KArg::U(kvh),
                KArg::U(cap),
                KArg::U(hd),
                KArg::U(heavy),
                KArg::U(recent),
                KArg::U(hcap),
                KArg::F(a.scale),
            ],
        )?;
        self.launch(
            "h2o_evict",
            grid,
            (256, 1, 1),
            0,
            &[
                KArg::P(a.k_cache),
                KArg::P(a.v_cache),
                KArg::P(a.ck),
                KArg::P(a.cv),
                KArg::P(a.cpos),
                KArg::P(a.scores),
                KArg::P(a.clen),
                KArg::P(a.rstart),
                KArg::P(a.seq_lens),
                KArg::P(a.slots),
                KArg::P(a.zs),
                KArg::P(a.part),
                KArg::P(a.mins),
                KArg::P(a.count),
                KArg::U(nh),
                KArg::U(kvh),
                KArg::U(cap),
                KArg::U(kv.row_bytes() as u32),
                KArg::U(heavy),
                KArg::U(recent),
                KArg::U(hcap),
            ],
        )
    }

    /// Zeroes `bytes` bytes at device address `ptr` on the current stream.
    pub(crate) fn zero_raw(&self, ptr: u64, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: callers pass a range inside one of their own buffers.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.current_stream()) }
            .map_err(crate::context::drv("cuMemsetD8Async (range)"))
    }
}
