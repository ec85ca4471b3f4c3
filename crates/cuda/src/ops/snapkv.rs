//! SnapKV's and PyramidKV's selection on the GPU (kernels/snapkv.cu): the observation window's
//! softmax probabilities summed over its rows, max-pooled, summed over the GQA group, and the
//! top `k` keys a kv head by `sfi_topk`. The rules (window, kernel, capacities, the keep set)
//! are the CPU policy's (`slowfast_kv::snapkv`, `slowfast_kv::score::snap_keep`); only the
//! arithmetic runs here.

use super::u32_of;
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// Device scratch of one layer's selection: up to `rows` captured rows of `n_heads` query heads
/// over a prefix of up to `max_n` keys, choosing up to `max_k` a kv head.
pub struct SnapScratch {
    rows: usize,
    n_heads: usize,
    kv_heads: usize,
    max_n: usize,
    max_k: usize,
    stats: GpuBuffer<f32>,  // [rows, n_heads] (max, 1 / sum) pairs
    probs: GpuBuffer<f32>,  // [n_heads, n]
    scores: GpuBuffer<f64>, // [kv_heads, n]
    cnt: GpuBuffer<u32>,    // [kv_heads]
    sel: GpuBuffer<u32>,    // [kv_heads, k]
    mcount: GpuBuffer<u32>, // [1]
    /// k of the last selection (the stride of `sel`).
    k: usize,
}

/// One layer's selection: the captured logits (log2 units) of the last `rows` prompt rows,
/// row r of query head h at `logits + ((r * n_heads + h) * lstride + j) * 4` for key j, row r
/// seeing keys `j < len0 + r`; the candidates are keys `lo .. lo + n`, `k` of them kept a kv
/// head (the softmax is over every key a row sees).
#[derive(Clone, Copy, Debug)]
pub struct SnapArgs {
    pub logits: u64,
    pub lstride: usize,
    pub rows: usize,
    pub len0: usize,
    pub n: usize,
    pub k: usize,
    /// The max-pooling kernel (odd).
    pub kernel: usize,
    /// The first candidate (SnapKV: 0; the oracle's SFI layout: after the sinks).
    pub lo: usize,
}

impl SnapScratch {
    pub fn new(
        ctx: &CudaContext,
        rows: usize,
        n_heads: usize,
        kv_heads: usize,
        max_n: usize,
        max_k: usize,
    ) -> Result<Self, CudaError> {
        if rows == 0 || kv_heads == 0 || n_heads % kv_heads != 0 || max_k == 0 {
            return Err(CudaError::bad(
                "snapkv scratch",
                format!("{rows} rows, {n_heads} heads over {kv_heads} kv heads, k {max_k}"),
            ));
        }
        let n = max_n.max(1);
        Ok(SnapScratch {
            rows,
            n_heads,
            kv_heads,
            max_n: n,
            max_k,
            stats: ctx.alloc(rows * n_heads * 2)?,
            probs: ctx.alloc(n_heads * n)?,
            scores: ctx.alloc(kv_heads * n)?,
            cnt: ctx.alloc(kv_heads)?,
            sel: ctx.alloc(kv_heads * max_k)?,
            mcount: ctx.alloc(1)?,
            k: max_k,
        })
    }

    /// (positions `[kv_heads, k]`, the count `[1]`, k) of the last selection, for
    /// `CudaContext::gather_picks`.
    pub(crate) fn picks(&self) -> (u64, u64, usize) {
        (self.sel.device_ptr(), self.mcount.device_ptr(), self.k)
    }

    /// The last selection's positions per kv head, ascending (downloads; for tests).
    pub fn download(&self, ctx: &CudaContext) -> Result<Vec<Vec<u32>>, CudaError> {
        let sel = ctx.download(&self.sel)?;
        let m = ctx.download(&self.mcount)?[0] as usize;
        Ok((0..self.kv_heads)
            .map(|h| sel[h * self.k..h * self.k + m].to_vec())
            .collect())
    }

    /// The last selection's scores `[kv_heads][n]` (downloads; for tests).
    pub fn scores(&self, ctx: &CudaContext, n: usize) -> Result<Vec<Vec<f64>>, CudaError> {
        let s = ctx.download(&self.scores)?;
        Ok((0..self.kv_heads)
            .map(|h| s[h * n..(h + 1) * n].to_vec())
            .collect())
    }
}

impl CudaContext {
    /// Per (captured row, query head): the max and 1 / sum of 2^(z - max) over the keys the
    /// row sees (row r: `j < len0 + r`) into `stats` (`[rows, n_heads]` pairs): kernels/snapkv.cu's
    /// `snap_rowstats`, for SnapKV's selection and H2O's prefill scores.
    pub(crate) fn snap_rowstats(
        &self,
        logits: u64,
        stats: u64,
        rows: usize,
        n_heads: u32,
        lstride: u32,
        len0: u32,
    ) -> Result<(), CudaError> {
        self.launch(
            "snap_rowstats",
            (rows as u32, n_heads, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(logits),
                KArg::P(stats),
                KArg::U(n_heads),
                KArg::U(lstride),
                KArg::U(len0),
            ],
        )
    }

    /// Scores keys `a.lo .. a.lo + a.n` of one layer and keeps the top `a.k` a kv head (ties:
    /// lower position first) in `sc`, as positions.
    pub fn snap_select(&self, a: &SnapArgs, sc: &mut SnapScratch) -> Result<(), CudaError> {
        self.snap_scores(a, sc, "snap_select")?;
        self.snap_topk(a, sc, sc.kv_heads as u32)
    }

    /// FastKV's token choice at its TSP layer (the CPU's `Model::tsp_select`): `snap_select`'s
    /// pooled scores of every kv head summed into one row, and its top `a.k` keys (ties: lower
    /// position first), ascending, as the picks of kv head 0 in `sc`.
    pub fn tsp_select(&self, a: &SnapArgs, sc: &mut SnapScratch) -> Result<(), CudaError> {
        const OP: &str = "tsp_select";
        self.snap_scores(a, sc, OP)?;
        let n = u32_of(OP, "n", a.n)?;
        self.launch(
            "snap_head_sum",
            (a.n.div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(sc.scores.device_ptr()),
                KArg::P(sc.cnt.device_ptr()),
                KArg::U(sc.kv_heads as u32),
                KArg::U(n),
            ],
        )?;
        self.snap_topk(a, sc, 1)
    }

    /// The top `a.k` of the first `rows` rows of `sc`'s scores (`sfi_topk`), into its picks.
    fn snap_topk(&self, a: &SnapArgs, sc: &mut SnapScratch, rows: u32) -> Result<(), CudaError> {
        sc.k = a.k;
        let picks = [
            sc.scores.device_ptr(),
            sc.cnt.device_ptr(),
            sc.sel.device_ptr(),
            sc.mcount.device_ptr(),
        ];
        let (n, k, lo) = (a.n as u32, a.k as u32, a.lo as u32);
        self.topk_launch(picks, (rows, 1, 1024), (rows, n, k, lo))
    }

    /// The scores of `snap_select` (row stats, column sums, pooling), checked.
    fn snap_scores(
        &self,
        a: &SnapArgs,
        sc: &mut SnapScratch,
        op: &'static str,
    ) -> Result<(), CudaError> {
        if a.rows == 0
            || a.rows > sc.rows
            || a.n == 0
            || a.n > sc.max_n
            || a.k == 0
            || a.k > sc.max_k
            || a.kernel % 2 == 0
            || a.logits == 0
            || a.len0 < a.lo + a.n
            || a.len0 + a.rows - 1 > a.lstride
        {
            return Err(CudaError::bad(
                op,
                format!(
                    "{a:?} (scratch: {} rows, {} keys, k {}); rows must see every candidate",
                    sc.rows, sc.max_n, sc.max_k
                ),
            ));
        }
        let (nh, kvh) = (sc.n_heads as u32, sc.kv_heads as u32);
        let n = u32_of(op, "n", a.n)?;
        let lstride = u32_of(op, "lstride", a.lstride)?;
        let len0 = u32_of(op, "len0", a.len0)?;
        u32_of(op, "lo", a.lo)?;
        self.snap_rowstats(a.logits, sc.stats.device_ptr(), a.rows, nh, lstride, len0)?;
        let blocks = a.n.div_ceil(256) as u32;
        self.launch(
            "snap_colsum",
            (blocks, nh, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(a.logits + 4 * a.lo as u64),
                KArg::P(sc.stats.device_ptr()),
                KArg::P(sc.probs.device_ptr()),
                KArg::U(nh),
                KArg::U(a.rows as u32),
                KArg::U(lstride),
                KArg::U(n),
            ],
        )?;
        self.launch(
            "snap_pool",
            (blocks, kvh, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(sc.probs.device_ptr()),
                KArg::P(sc.scores.device_ptr()),
                KArg::P(sc.cnt.device_ptr()),
                KArg::U(nh / kvh),
                KArg::U(n),
                KArg::U((a.kernel / 2) as u32),
            ],
        )
    }
}
