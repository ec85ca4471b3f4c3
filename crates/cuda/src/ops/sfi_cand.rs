//! SFI's cheaper slow step on the GPU (kernels/sfi_cand.cu). The rule is the CPU's
//! (`slowfast_kv::sfi::candidates`: `candidate_pages`, `view_ranges`); here only its arithmetic:
//! per global layer, the page bounds of each capturing row's sequence (kept like Quest's), the
//! pages' score shared by the kv heads, and the top pages as the row's page list, which the
//! sparse decode kernel reads as the row's view; after the forward, the key norms and the
//! position prior in view order for the Selector, and its picks mapped back to positions.

use super::sfi::SelectView;
use super::{u32_of, KvLayout};
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;
use crate::kernels::CAND_THREADS_A_PAGE;

/// u32s of one capturing row's `vmeta` entry (kernels/sfi_cand.cu): active, page, entries,
/// recent start, first candidate page, pages, first page whose bounds are computed afresh,
/// batch row.
pub const VMETA: usize = 8;

/// Pages one block of `sfi_cand_ub` scores (`SFI_CAND_PAGES`: 256 threads).
const CAND_PAGES_A_BLOCK: u32 = 256 / CAND_THREADS_A_PAGE;

/// One capturing row's cheaper slow step, as the host plans it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewPlan {
    /// The row's index in the batch.
    pub batch_row: usize,
    /// Keys a page.
    pub page: usize,
    /// Candidate pages `[first, pages)`: after the sinks' pages, before the recent window.
    pub first: usize,
    pub pages: usize,
    /// Pages picked among the candidates.
    pub want: usize,
    /// Where the recent window starts (`pages * page`).
    pub recent_start: usize,
    /// Pages from here on get their bounds computed from the keys first.
    pub fresh: usize,
}

impl ViewPlan {
    /// The `vmeta` entry of the plan (None: an inactive row, which attends densely).
    pub fn vmeta(plan: Option<&ViewPlan>) -> [u32; VMETA] {
        match plan {
            None => [0; VMETA],
            Some(p) => [
                1,
                p.page as u32,
                (p.first + p.want) as u32,
                p.recent_start as u32,
                p.first as u32,
                p.pages as u32,
                p.fresh as u32,
                p.batch_row as u32,
            ],
        }
    }

    /// The page-list entries the row reads: the sinks' pages and the picked ones.
    pub fn entries(&self) -> usize {
        self.first + self.want
    }

    /// Keys of the view at sequence length `len`.
    pub fn view_len(&self, len: usize) -> usize {
        self.entries() * self.page + len - self.recent_start
    }
}

/// One global layer's page pick for the capturing rows (`cap_rows` of them, `vmeta` uploaded).
#[derive(Clone, Copy, Debug)]
pub struct CandPick {
    /// q `[batch, n_heads, head_dim]` after q/k post-processing; this layer's K cache; its
    /// bounds `[num_slots, kv_heads, maxp, 2, head_dim]` (bf16, written for fresh pages).
    pub q: u64,
    pub k_cache: u64,
    pub bounds: u64,
    pub slots: u64,
    pub vmeta: u64,
    pub n_heads: usize,
    pub cap_rows: usize,
    pub maxp: usize,
    /// The Selector's first candidate position's page (`sinks / page`), always read.
    pub forced0: usize,
    /// Scratch: `ub [cap_rows, n_heads, maxp]` f32, `best [cap_rows, n_heads]` u32 (zeroed by
    /// the caller before the pick: it takes the largest bound with `atomicMax`), `scores
    /// [cap_rows, maxp]` f32, `cnt [cap_rows]` and `mcount [cap_rows]` u32.
    pub ub: u64,
    pub best: u64,
    pub scores: u64,
    pub cnt: u64,
    pub mcount: u64,
    /// Out: this layer's page lists `[cap_rows, vcap]`, `vcap` = first + want.
    pub vpages: u64,
    pub vcap: usize,
}

impl CudaContext {
    /// The page lists of one global layer's cheaper slow steps (see [`CandPick`]).
    pub fn sfi_cand_pick(&self, kv: KvLayout, a: &CandPick) -> Result<(), CudaError> {
        const OP: &str = "sfi_cand_pick";
        let g = a.n_heads / kv.kv_heads.max(1);
        if a.cap_rows == 0
            || a.n_heads % kv.kv_heads != 0
            || g > 16
            || kv.head_dim > 256
            || kv.head_dim % 8 != 0
            || a.maxp == 0
            || a.vcap == 0
            || [a.q, a.k_cache, a.bounds, a.slots, a.vmeta, a.ub, a.best]
                .into_iter()
                .chain([a.scores, a.cnt, a.mcount, a.vpages])
                .any(|p| p == 0)
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "{a:?} over {} kv heads of {} dims",
                    kv.kv_heads, kv.head_dim
                ),
            ));
        }
        let (rows, maxp) = (a.cap_rows as u32, u32_of(OP, "maxp", a.maxp)?);
        self.launch(
            crate::kernels::kv_kernel("sfi_cand_ub", kv.fp8),
            (maxp.div_ceil(CAND_PAGES_A_BLOCK), kv.kv_heads as u32, rows),
            (256, 1, 1),
            0,
            &[
                KArg::P(a.q),
                KArg::P(a.k_cache),
                KArg::P(a.bounds),
                KArg::P(a.slots),
                KArg::P(a.vmeta),
                KArg::P(a.ub),
                KArg::P(a.best),
                KArg::U(a.n_heads as u32),
                KArg::U(kv.kv_heads as u32),
                KArg::U(u32_of(OP, "capacity", kv.capacity)?),
                KArg::U(kv.head_dim as u32),
                KArg::U(maxp),
            ],
        )?;
        self.launch(
            "sfi_cand_score",
            (maxp.div_ceil(256), rows, 1),
            (256, 1, 1),
            0,
            &[
                KArg::P(a.ub),
                KArg::P(a.best),
                KArg::P(a.vmeta),
                KArg::P(a.scores),
                KArg::P(a.cnt),
                KArg::U(a.n_heads as u32),
                KArg::U(maxp),
                KArg::U(u32_of(OP, "forced page", a.forced0)?),
            ],
        )?;
        // Quest's radix select, a "kv head" a capturing row: the top vcap pages ascending.
        self.launch(
            "quest_topk",
            (1, rows, 1),
            (1024, 1, 1),
            0,
            &[
                KArg::P(a.scores),
                KArg::P(a.cnt),
                KArg::P(a.vpages),
                KArg::P(a.mcount),
                KArg::U(1),
                KArg::U(maxp),
                KArg::U(u32_of(OP, "vcap", a.vcap)?),
            ],
        )
    }

    /// The key norms of `view`'s keys (`vlen` of them) for `layers` layers, in view order:
    /// `norms` this slot's `[layers, .., kv_heads, capacity]` (layer stride `nls`), `out
    /// [layers, kv_heads, ostride]`.
    #[allow(clippy::too_many_arguments)]
    pub fn sfi_view_norms(
        &self,
        kv: KvLayout,
        layers: usize,
        view: &SelectView,
        vlen: usize,
        norms: u64,
        nls: usize,
        out: &GpuBuffer<f32>,
        ostride: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "sfi_view_norms";
        if vlen == 0 || layers == 0 {
            return Ok(());
        }
        if vlen > ostride || out.len() < layers * kv.kv_heads * ostride || norms == 0 {
            return Err(CudaError::bad(
                OP,
                format!("{vlen} keys into rows of {ostride}, {layers} layers"),
            ));
        }
        let mut args = vec![
            KArg::P(norms),
            KArg::P(view.vpages),
            KArg::P(out.device_ptr()),
        ];
        let v = view.args();
        args.extend_from_slice(&v[1..]);
        args.extend_from_slice(&[
            KArg::U(vlen as u32),
            KArg::U(u32_of(OP, "capacity", kv.capacity)?),
            KArg::U(u32_of(OP, "norm layer stride", nls)?),
            KArg::U(ostride as u32),
        ]);
        self.launch(
            "sfi_view_norms",
            (vlen.div_ceil(256) as u32, kv.kv_heads as u32, layers as u32),
            (256, 1, 1),
            0,
            &args,
        )
    }

    /// The Selector's picks `sel [layers, kv_heads, k_cap]` (`mcount [layers]` a head) from view
    /// indices to positions, in place (before `sfi_gather`).
    pub fn sfi_view_unmap(
        &self,
        kv_heads: usize,
        layers: usize,
        view: &SelectView,
        sel: u64,
        mcount: u64,
        k_cap: usize,
    ) -> Result<(), CudaError> {
        if layers == 0 {
            return Ok(());
        }
        let mut args = vec![KArg::P(sel), KArg::P(mcount)];
        args.extend_from_slice(&view.args());
        args.push(KArg::U(k_cap as u32));
        self.launch(
            "sfi_view_unmap",
            (kv_heads as u32, layers as u32, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }
}
