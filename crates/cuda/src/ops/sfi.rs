//! SFI on the GPU: the sparse / capturing flash-decoding launch and the Selector pipeline
//! (kernels/sfi.cu). Pointers are raw device addresses so callers can address one layer's or
//! one slot's part of a larger buffer; every launch checks the sizes it is told.

use super::{u32_of, KvLayout};
use crate::buffer::GpuBuffer;
use crate::context::{attn_smem_bytes, CudaContext, KArg};
use crate::error::CudaError;
use crate::ops::attention::AttnWorkspace;
pub use slowfast_kv::sfi::selector::SelectorConfig;

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// The layout `sfi_cfg` in kernels/sfi.cu reads: the Selector's knobs as 16 doubles.
fn cfg_array(c: &SelectorConfig) -> [f64; 16] {
    [
        c.alpha,
        c.gamma,
        c.prior_weight_l2,
        c.prior_weight_pos,
        c.prior_pos_power,
        c.prior_pos_eta,
        c.prior_beta,
        c.soft_alpha,
        c.lambda_clip_single,
        c.lambda_clip_multi,
        c.eps,
        (c.nms_window / 2) as f64,
        if c.lambda_soft { 1.0 } else { 0.0 },
        c.cross_head_alpha,
        1.0 / c.cross_head_temperature,
        0.0,
    ]
}

/// Device scratch of the Selector for up to `layers` layers x `kv_heads` heads x `rows`
/// captured rows over a domain of up to `max_n` tokens, choosing up to `k` per head.
pub struct SelectorScratch {
    cfg: GpuBuffer<f64>,
    params: SelectorConfig,
    layers: usize,
    kv_heads: usize,
    rows: usize,
    max_n: usize,
    k: usize,
    stats: GpuBuffer<f32>, // [kv_heads, rows] (m, c) pairs
    ev: GpuBuffer<f64>,    // [kv_heads, n]
    /// The one-block-per-head kernels' f and r (only when `split` is off).
    fa: Option<GpuBuffer<f64>>,
    fb: Option<GpuBuffer<f64>>,
    scores: GpuBuffer<f64>,
    /// The split Selector (kernels/sfi.cu, "split over many blocks"), else sfi_score /
    /// sfi_cross_head / sfi_topk.
    split: Option<Split>,
    cnt: GpuBuffer<u32>,    // [kv_heads]
    sel: GpuBuffer<u32>,    // [kv_heads, k]
    mcount: GpuBuffer<u32>, // [1]
    /// With `SLOWFAST_SFI_PROFILE=1`: milliseconds per stage (see [`SFI_STAGES`]), summed
    /// over runs, each stage timed alone between events (synchronising).
    pub(crate) profile: std::cell::RefCell<Option<[f64; 7]>>,
}

/// Chunk of the domain (positions) of the split Selector's per-chunk kernels (`SFI_SC`).
const SFI_SC: usize = 2048;
/// Candidate buffer a head (`TOPK_CAP`) and histogram bins (`TOPK_BINS`) of kernels/sfi.cu.
const TOPK_CAP: usize = 2048;
const TOPK_BINS: usize = 4096;
/// Most dynamic shared memory `sfi_score_fin` may use (its attribute, context.rs).
pub(crate) const SCORE_FIN_SMEM: usize = 160 * 1024;

/// Scratch of the split Selector for `lh` = layers x kv heads and up to `nch` chunks a head.
struct Split {
    /// Positions a `sfi_score_fin` block handles: its smem holds every kv head's span.
    span: usize,
    pos: GpuBuffer<f64>,  // [max_n] position prior of the domain
    part: GpuBuffer<f64>, // [lh, nch, 8] chunk sums
    hc: GpuBuffer<f64>,   // [lh, 8] per-head constants
    /// Zeroed at every run: min / max [lh, 2] u64, counts and candidate counts [lh] u32 each,
    /// histograms [lh, TOPK_BINS], taken counts [lh, nch] (u32 units).
    zero: GpuBuffer<u32>,
    above: GpuBuffer<u32>, // [lh, nch]
    tinfo: GpuBuffer<u32>, // [lh, 2] b*, count above it
    cand: GpuBuffer<u64>,  // [lh, TOPK_CAP] candidate keys
    cpos: GpuBuffer<u32>,  // [lh, TOPK_CAP] their positions
    tres: GpuBuffer<u64>,  // [lh, 2] threshold key, last position taken at it
}

/// Where the zeroed scratch keeps each array for `lh` heads and `nch` chunks a head, in u32
/// units: (min / max, finite counts, candidate counts, histograms, taken counts, total).
fn zero_layout(lh: usize, nch: usize) -> [usize; 6] {
    let cnt = 4 * lh; // after min / max: [lh, 2] u64
    let (ccount, hist) = (cnt + lh, cnt + 2 * lh);
    let taken = hist + lh * TOPK_BINS;
    [0, cnt, ccount, hist, taken, taken + lh * nch]
}

impl Split {
    /// `sfi_score_fin`'s dynamic shared memory (bytes): every kv head's `span` final scores and
    /// one head's log s with a soft-NMS halo of `half` on each side.
    fn fin_smem(kv_heads: usize, span: usize, half: usize) -> usize {
        (kv_heads * span + span + 2 * half) * 8
    }

    /// The split Selector for `kv_heads` heads and soft-NMS half window `half`, or None when
    /// `sfi_score_fin`'s shared memory cannot hold the smallest span.
    fn span(kv_heads: usize, half: usize) -> Option<usize> {
        let bytes = |span: usize| Self::fin_smem(kv_heads, span, half);
        // 40 KiB when it fits (several blocks a SM), else the most the attribute allows.
        let fit = |budget: usize| {
            (256..=2048)
                .rev()
                .step_by(256)
                .find(|&sp| bytes(sp) <= budget)
        };
        fit(40 * 1024).or_else(|| fit(SCORE_FIN_SMEM))
    }

    fn new(ctx: &CudaContext, lh: usize, max_n: usize, span: usize) -> Result<Self, CudaError> {
        let nch = max_n.div_ceil(SFI_SC).max(1);
        Ok(Split {
            span,
            pos: ctx.alloc(max_n)?,
            part: ctx.alloc(lh * nch * 8)?,
            hc: ctx.alloc(lh * 8)?,
            zero: ctx.alloc(zero_layout(lh, nch)[5])?,
            above: ctx.alloc(lh * nch)?,
            tinfo: ctx.alloc(lh * 2)?,
            cand: ctx.alloc(lh * TOPK_CAP)?,
            cpos: ctx.alloc(lh * TOPK_CAP)?,
            tres: ctx.alloc(lh * 2)?,
        })
    }
}

/// The stages [`SelectorScratch`] profiles.
pub const SFI_STAGES: [&str; 7] = [
    "key norms",
    "row stats",
    "evidence",
    "score",
    "cross-head",
    "top-k",
    "gather",
];

impl SelectorScratch {
    pub fn new(
        ctx: &CudaContext,
        params: SelectorConfig,
        layers: usize,
        kv_heads: usize,
        rows: usize,
        max_n: usize,
        k: usize,
    ) -> Result<Self, CudaError> {
        const OP: &str = "sfi selector";
        params
            .validate()
            .map_err(|e| CudaError::bad(OP, e.to_string()))?;
        if layers == 0 || kv_heads == 0 || rows == 0 || k == 0 {
            return Err(CudaError::bad(
                OP,
                format!(
                    "{layers} layers, {kv_heads} kv heads, {rows} rows, k = {k}: all must be >= 1"
                ),
            ));
        }
        let n = max_n.max(1);
        let lh = layers * kv_heads;
        let span = Split::span(kv_heads, params.nms_window / 2);
        // The split kernels whenever the soft-NMS span allows (the one-block-per-head ones
        // are the reference, `set_split(false)` in the tests; run 50).
        let split = match span {
            Some(sp) => Some(Split::new(ctx, lh, n, sp)?),
            None => None,
        };
        let pair = |on: bool| -> Result<Option<GpuBuffer<f64>>, CudaError> {
            Ok(if on { Some(ctx.alloc(lh * n)?) } else { None })
        };
        Ok(SelectorScratch {
            cfg: ctx.upload(&cfg_array(&params))?,
            params,
            layers,
            kv_heads,
            rows,
            max_n: n,
            k,
            stats: ctx.alloc(lh * rows * 2)?,
            ev: ctx.alloc(lh * n)?,
            fa: pair(split.is_none())?,
            fb: pair(split.is_none())?,
            scores: ctx.alloc(lh * n)?,
            split,
            cnt: ctx.alloc(lh)?,
            sel: ctx.alloc(lh * k)?,
            mcount: ctx.alloc(layers)?,
            profile: std::cell::RefCell::new(
                (std::env::var("SLOWFAST_SFI_PROFILE").as_deref() == Ok("1")).then_some([0.0; 7]),
            ),
        })
    }

    /// Device addresses of the top-k's scores, finite counts, picks `[layers, kv_heads, k]`
    /// and per-layer counts.
    pub fn topk_picks(&self) -> [u64; 4] {
        [
            self.scores.device_ptr(),
            self.cnt.device_ptr(),
            self.sel.device_ptr(),
            self.mcount.device_ptr(),
        ]
    }

    /// Chosen positions `[layers, kv_heads, k]` (the first `m[layer]` of each head valid) and
    /// the per-layer counts m (downloads; for tests).
    pub fn download(&self, ctx: &CudaContext) -> Result<(Vec<u32>, Vec<usize>), CudaError> {
        let sel = ctx.download(&self.sel)?;
        let m = ctx
            .download(&self.mcount)?
            .iter()
            .map(|&m| m as usize)
            .collect();
        Ok((sel, m))
    }

    /// The per-stage milliseconds summed so far, when profiling.
    pub fn profile(&self) -> Option<[f64; 7]> {
        *self.profile.borrow()
    }

    /// Switches between the split Selector and the one-block-per-head kernels (A/B, tests);
    /// allocates what the chosen one needs. Err when the split one cannot hold the
    /// configuration.
    /// Room for a cheaper slow step's position prior (one row of `n` keys a layer, the split
    /// Selector's `pos`); the views need the split Selector.
    pub fn reserve_view(&mut self, ctx: &CudaContext, n: usize) -> Result<(), CudaError> {
        let need = self.layers * n.max(1);
        match self.split.as_mut() {
            Some(sp) if sp.pos.len() < need => {
                sp.pos = ctx.alloc(need)?;
                Ok(())
            }
            Some(_) => Ok(()),
            None => Err(CudaError::bad(
                "sfi selector",
                "a cheaper slow step's view needs the split Selector",
            )),
        }
    }

    pub fn set_split(&mut self, ctx: &CudaContext, on: bool) -> Result<(), CudaError> {
        let lh = self.layers * self.kv_heads;
        if on && self.split.is_none() {
            let span = Split::span(self.kv_heads, self.params.nms_window / 2).ok_or_else(|| {
                CudaError::bad(
                    "sfi selector",
                    format!(
                        "{} kv heads with a soft-NMS window of {}: too large for the split Selector",
                        self.kv_heads, self.params.nms_window
                    ),
                )
            })?;
            self.split = Some(Split::new(ctx, lh, self.max_n, span)?);
        } else if !on {
            self.split = None;
            if self.fa.is_none() {
                self.fa = Some(ctx.alloc(lh * self.max_n)?);
                self.fb = Some(ctx.alloc(lh * self.max_n)?);
            }
        }
        Ok(())
    }

    /// How many (layer, kv head) of the last split run had more than `TOPK_CAP` scores in the
    /// threshold's bin and went through the radix select (downloads; for tests).
    pub fn radix_fallbacks(&self, ctx: &CudaContext, layers: usize) -> Result<usize, CudaError> {
        let Some(sp) = &self.split else {
            return Ok(0);
        };
        let lh = layers * self.kv_heads;
        let z = ctx.download(&sp.zero)?;
        let [_, _, ccount, hist, _, _] = zero_layout(lh, 1);
        let cc = &z[ccount..hist];
        Ok(cc.iter().filter(|&&c| c as usize > TOPK_CAP).count())
    }
}

/// One Selector run over the captured logits of `layers` layers of one sequence.
#[derive(Clone, Copy, Debug)]
pub struct SelectArgs {
    pub layers: usize,
    /// Captured scores (log2 units): row r of query head hq of layer z at `logits + (z *
    /// logit_layer_stride + (r * n_heads + hq) * lstride + j) * 4` for key j.
    pub logits: u64,
    pub lstride: usize,
    pub logit_layer_stride: usize,
    pub n_heads: usize,
    pub kv_heads: usize,
    /// Captured query rows per query head (the rows per kv head are G x this).
    pub rows: usize,
    /// Domain [sinks, recent_start).
    pub sinks: usize,
    pub recent_start: usize,
    /// Key norms of this sequence `[kv_heads, norm_stride]` (f32), layer z at
    /// `norms + z * norm_layer_stride * 4`.
    pub norms: u64,
    pub norm_stride: usize,
    pub norm_layer_stride: usize,
    /// A cheaper slow step's view (SFI's `candidates`): the domain's indices are view indices,
    /// and the position prior takes their positions. None: index = position.
    pub view: Option<SelectView>,
}

/// The view a capturing row of a cheaper slow step read (kernels/sfi_cand.cu): its page list
/// (`vpages [layers, cap_rows, vcap]`, row `row`, `entries` pages of `page` keys), then its keys
/// from `recent_start` on. View index j is position `vpages[j / page] * page + j % page` below
/// `entries * page`, else `recent_start + j - entries * page`.
#[derive(Clone, Copy, Debug)]
pub struct SelectView {
    pub vpages: u64,
    pub row: usize,
    pub cap_rows: usize,
    pub vcap: usize,
    pub entries: usize,
    pub page: usize,
    pub recent_start: usize,
}

impl SelectView {
    /// The kernel arguments naming the view: (vpages, row, cap rows, vcap, entries, page,
    /// recent start).
    pub(crate) fn args(&self) -> [KArg; 7] {
        [
            KArg::P(self.vpages),
            KArg::U(self.row as u32),
            KArg::U(self.cap_rows as u32),
            KArg::U(self.vcap as u32),
            KArg::U(self.entries as u32),
            KArg::U(self.page as u32),
            KArg::U(self.recent_start as u32),
        ]
    }
}

/// The compact-memory gather of `layers` layers of one slot.
#[derive(Clone, Copy, Debug)]
pub struct GatherArgs {
    pub layers: usize,
    /// Device arrays of `layers` u64: each layer's K and V cache (`[num_slots, kv_heads,
    /// capacity, head_dim]` bf16, the layout of the launch's `KvLayout`).
    pub kptrs: u64,
    pub vptrs: u64,
    pub slot: usize,
    pub sinks: usize,
    pub recent_start: usize,
    /// Compact K and V `[num_slots, kv_heads, ccap, head_dim]` of the first layer; the next
    /// layer's start `compact_layer_stride` elements later.
    pub ck: u64,
    pub cv: u64,
    pub ccap: usize,
    pub compact_layer_stride: usize,
    /// `[layers, num_slots]` compact length and recent-window start (written).
    pub clen: u64,
    pub rstart: u64,
}

/// A sparse / capturing decode launch (`attn_sparse_decode_*`), see kernels/attn_decode.cu.
#[derive(Clone, Copy, Debug)]
pub struct SparseDecode {
    pub batch: usize,
    pub n_heads: usize,
    pub scale: f32,
    /// Splits over each sequence's virtual length (the chunk is per sequence).
    pub splits: usize,
    /// q and out `[batch, n_heads, head_dim]` (bf16).
    pub q: u64,
    pub out: u64,
    /// `[batch]` lengths and cache slots.
    pub seq_lens: u64,
    pub slots: u64,
    /// Compact K/V `[num_slots, kv_heads, ccap, head_dim]` (may be the cache itself with
    /// ccap = capacity: StreamingLLM's sinks), `[batch]` compact lengths and recent starts.
    pub ck: u64,
    pub cv: u64,
    pub ccap: usize,
    pub clen: u64,
    pub rstart: u64,
    /// Sliding recent window (0: the recent part runs from rstart).
    pub rwin: usize,
    /// Capture: `[batch, n_heads, lstride]` f32 scores for rows with `capture[b] != 0` (those
    /// rows attend densely); 0 = no capture.
    pub logits: u64,
    pub capture: u64,
    pub lstride: usize,
    /// The q/k/v post-processing inside the kernel (`attn_sparse_decode_post_*`): q comes from
    /// the projection row instead of `q`, and the new key and value go into the cache.
    pub post: Option<SparsePost>,
    /// A page list instead of compact buffers (Quest; 0 = none): `[batch, kv_heads, ccap]`
    /// entries, `clen[b]` of them in use, entry e naming cache rows `[e cgran, (e + 1) cgran)`;
    /// the recent part then starts at the newest key's page. Not with `post`.
    pub cidx: u64,
    pub cgran: usize,
    /// SFI's cheaper slow step (kernels/sfi_cand.cu): capturing row r reads its view when
    /// `vmeta [cap_rows, 8]` says so, the page list `vpages + r * vcap` (0 = no views). Not with
    /// `post`.
    pub vpages: u64,
    pub vmeta: u64,
    pub vcap: usize,
}

impl SparseDecode {
    /// Rows that read the whole cache `(kc, vc)` in place (no compact rows: `zeros` holds a
    /// zero clen and rstart for every slot), without a page list, views or q/k/v
    /// post-processing, capture rows `capacity` long: what the prefill captures (SFI's
    /// bootstrap, SnapKV's window, H2O's scores) start from. The caller sets the rows, their
    /// queries, outputs and lengths, and the capture.
    pub fn in_place(kc: u64, vc: u64, capacity: usize, zeros: u64) -> Self {
        SparseDecode {
            batch: 0,
            n_heads: 0,
            scale: 0.0,
            splits: 1,
            q: 0,
            out: 0,
            seq_lens: 0,
            slots: 0,
            ck: kc,
            cv: vc,
            ccap: capacity,
            clen: zeros,
            rstart: zeros,
            rwin: 0,
            logits: 0,
            capture: 0,
            lstride: capacity,
            post: None,
            cidx: 0,
            cgran: 1,
            vpages: 0,
            vmeta: 0,
            vcap: 0,
        }
    }
}

/// What `qkv_post` would do before a sparse decode launch, done inside it: `qkv [batch,
/// qkv_stride]` the merged projection rows, `positions[b] = seq_lens[b] - 1` (the new token, its
/// k and v written to the cache at `(slots[b], positions[b])`), the per-head norm weights (0:
/// none), RoPE over the first `rot_dim` dims with `inv_freq [rot_dim / 2]`. Outputs, scores and
/// caches are bit-identical to `qkv_post` followed by the plain launch, provided every row
/// attends its newest key (`rstart[b] < seq_lens[b]`, as SFI's and StreamingLLM's recent windows
/// do): the block that attends it is the one that writes it.
#[derive(Clone, Copy, Debug)]
pub struct SparsePost {
    pub qkv: u64,
    pub qkv_stride: usize,
    pub q_norm: u64,
    pub k_norm: u64,
    pub eps: f32,
    pub positions: u64,
    pub rot_dim: usize,
    pub inv_freq: u64,
}

impl CudaContext {
    /// Runs `f`; when `sc` profiles, times it alone (synchronising) into stage `i`.
    pub(crate) fn sfi_stage(
        &self,
        sc: &SelectorScratch,
        i: usize,
        mut f: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if sc.profile.borrow().is_none() {
            return f();
        }
        let ms = self.time_ms(1, &mut f)?;
        if let Some(p) = sc.profile.borrow_mut().as_mut() {
            p[i] += ms as f64;
        }
        Ok(())
    }

    /// Splits a sparse decode of `batch` sequences uses: one wave of blocks.
    pub fn sparse_splits(&self, batch: usize, n_heads: usize, kv: &KvLayout) -> usize {
        let row_groups = (n_heads / kv.kv_heads.max(1)).div_ceil(16);
        let groups = (batch * kv.kv_heads * row_groups).max(1);
        let resident = self.sm_count() as usize * if kv.head_dim == 256 { 1 } else { 2 };
        (resident / groups).clamp(1, 1024)
    }

    /// Sparse flash-decoding (see [`SparseDecode`]) over one layer's cache.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_sparse_decode(
        &self,
        k_cache: &GpuBuffer<half::bf16>,
        v_cache: &GpuBuffer<half::bf16>,
        kv: KvLayout,
        ws: &mut AttnWorkspace,
        p: &SparseDecode,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_sparse_decode";
        kv.check(OP)?;
        if p.batch == 0 || p.batch > 65535 || p.n_heads % kv.kv_heads != 0 {
            return Err(CudaError::bad(
                OP,
                format!("batch {} / n_heads {}", p.batch, p.n_heads),
            ));
        }
        for (what, v) in [
            ("q", p.post.map_or(p.q, |pp| pp.qkv)),
            ("out", p.out),
            ("seq_lens", p.seq_lens),
            ("slots", p.slots),
            ("clen", p.clen),
            ("rstart", p.rstart),
            ("ck", p.ck),
            ("cv", p.cv),
        ] {
            if v == 0 {
                return Err(CudaError::bad(OP, format!("{what} is null")));
            }
        }
        if p.cidx != 0 && (p.post.is_some() || p.cgran == 0) {
            return Err(CudaError::bad(
                OP,
                format!(
                    "a page list needs pages of >= 1 row (got {}) and no post-processing",
                    p.cgran
                ),
            ));
        }
        if p.logits != 0 && (p.capture == 0 || p.lstride < kv.capacity) {
            return Err(CudaError::bad(
                OP,
                "capture needs capture flags and lstride >= capacity",
            ));
        }
        let d = kv.head_dim;
        let rows = p.batch * p.n_heads;
        let splits = p.splits.clamp(1, 1024);
        let (part_o, part_ml) = ws.ensure(self, rows * splits * d, rows * splits * 2)?;
        if let Some(pp) = p.post {
            let row = (p.n_heads + 2 * kv.kv_heads) * d;
            if pp.positions == 0
                || pp.inv_freq == 0
                || pp.qkv_stride < row
                || !crate::ops::fused::post_scalars_ok(pp.rot_dim, pp.eps, d)
            {
                return Err(CudaError::bad(
                    OP,
                    format!(
                        "post: qkv row {} (at least {row}), rot_dim {} of {d}, eps {}, \
                         positions / inv_freq set: {} / {}",
                        pp.qkv_stride,
                        pp.rot_dim,
                        pp.eps,
                        pp.positions != 0,
                        pp.inv_freq != 0
                    ),
                ));
            }
        }
        let kernel = match (d, p.post.is_some()) {
            (64, false) => "attn_sparse_decode_d64",
            (128, false) => "attn_sparse_decode_d128",
            (_, false) => "attn_sparse_decode_d256",
            (64, true) => "attn_sparse_decode_post_d64",
            (128, true) => "attn_sparse_decode_post_d128",
            (_, true) => "attn_sparse_decode_post_d256",
        };
        let row_groups = (p.n_heads / kv.kv_heads).div_ceil(16);
        let mut args = vec![
            KArg::P(p.post.map_or(p.q, |pp| pp.qkv)),
            KArg::P(k_cache.ptr_min(OP, "k_cache", kv.buf_len())?),
            KArg::P(v_cache.ptr_min(OP, "v_cache", kv.buf_len())?),
            KArg::P(p.seq_lens),
            KArg::P(p.slots),
            KArg::P(part_o),
            KArg::P(part_ml),
            KArg::U(p.n_heads as u32),
            KArg::U(kv.kv_heads as u32),
            KArg::U(kv.capacity as u32),
            KArg::U(u32_of(OP, "num_slots", kv.num_slots)?),
            KArg::F(p.scale * LOG2E),
            KArg::P(p.ck),
            KArg::P(p.cv),
            KArg::P(p.clen),
            KArg::P(p.rstart),
            KArg::U(u32_of(OP, "ccap", p.ccap)?),
            KArg::U(u32_of(OP, "rwin", p.rwin)?),
            KArg::P(p.logits),
            KArg::P(p.capture),
            KArg::U(u32_of(OP, "lstride", p.lstride)?),
        ];
        if p.vmeta != 0 && (p.post.is_some() || p.vpages == 0 || p.logits == 0) {
            return Err(CudaError::bad(
                OP,
                "views need page lists, captured scores and no post-processing",
            ));
        }
        if p.post.is_none() {
            args.extend_from_slice(&[
                KArg::P(p.cidx),
                KArg::U(u32_of(OP, "cgran", p.cgran)?),
                KArg::P(p.vpages),
                KArg::P(p.vmeta),
                KArg::U(u32_of(OP, "vcap", p.vcap)?),
            ]);
        }
        if let Some(pp) = p.post {
            args.extend_from_slice(&[
                KArg::U(u32_of(OP, "qkv row", pp.qkv_stride)?),
                KArg::P(pp.q_norm),
                KArg::P(pp.k_norm),
                KArg::F(pp.eps),
                KArg::P(pp.positions),
                KArg::U(pp.rot_dim as u32),
                KArg::P(pp.inv_freq),
            ]);
        }
        self.launch(
            crate::kernels::kv_kernel(kernel, kv.fp8),
            (
                splits as u32,
                u32_of(OP, "kv_heads * row groups", kv.kv_heads * row_groups)?,
                p.batch as u32,
            ),
            (128, 1, 1),
            attn_smem_bytes(kernel).unwrap_or(0),
            &args,
        )?;
        self.attn_decode_reduce_raw(part_o, part_ml, p.out, 0, rows, p.n_heads, splits, d)
    }

    /// Key norms of positions [p0, p1) of `slot` for `layers` layers: K caches from the device
    /// array `kptrs` (u64 each, layout `kv`), norms into `norms` (`[kv_heads, capacity]` f32 of
    /// that slot, layer z at `norms + z * layer_stride * 4`).
    #[allow(clippy::too_many_arguments)]
    pub fn sfi_key_norms(
        &self,
        kptrs: u64,
        layers: usize,
        kv: KvLayout,
        slot: usize,
        p0: usize,
        p1: usize,
        norms: u64,
        layer_stride: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "sfi_key_norms";
        if p1 <= p0 || layers == 0 {
            return Ok(());
        }
        if slot >= kv.num_slots || p1 > kv.capacity || norms == 0 || kptrs == 0 {
            return Err(CudaError::bad(
                OP,
                format!(
                    "slot {slot}, positions {p0}..{p1}, capacity {}",
                    kv.capacity
                ),
            ));
        }
        let args = [
            KArg::P(kptrs),
            KArg::P(norms),
            KArg::U(u32_of(OP, "layer stride", layer_stride)?),
            KArg::U(slot as u32),
            KArg::U(kv.kv_heads as u32),
            KArg::U(kv.capacity as u32),
            KArg::U(kv.head_dim as u32),
            KArg::U(p0 as u32),
            KArg::U(p1 as u32),
        ];
        self.launch(
            crate::kernels::kv_kernel("sfi_key_norms", kv.fp8),
            (
                (p1 - p0).div_ceil(8) as u32,
                kv.kv_heads as u32,
                layers as u32,
            ),
            (256, 1, 1),
            0,
            &args,
        )
    }

    /// Runs the Selector (rowstats, evidence, score, cross-head, top-k) over `a`; the chosen
    /// positions stay in `sc` for [`CudaContext::sfi_gather`].
    pub fn sfi_select(&self, a: &SelectArgs, sc: &mut SelectorScratch) -> Result<(), CudaError> {
        const OP: &str = "sfi_select";
        let g = a.n_heads / a.kv_heads.max(1);
        let rows = g * a.rows;
        let (lo, hi) = (a.sinks, a.recent_start);
        let n = hi.saturating_sub(lo);
        if a.layers == 0
            || a.layers > sc.layers
            || a.kv_heads != sc.kv_heads
            || rows > sc.rows
            || n > sc.max_n
            || hi > a.lstride
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "{} kv heads x {rows} rows over [{lo}, {hi}) (scratch: {} x {} over {}; lstride {})",
                    a.kv_heads, sc.kv_heads, sc.rows, sc.max_n, a.lstride
                ),
            ));
        }
        if a.logits == 0 || a.norms == 0 || a.norm_stride < hi {
            return Err(CudaError::bad(
                OP,
                "null logits / norms or short norm stride",
            ));
        }
        if n == 0 {
            // no candidates: every layer's count is 0
            return self.topk_launch(sc.topk_picks(), (1, a.layers as u32, 32), (0, 0, 0, 0));
        }
        // The CPU Selector's test for the geometric mean.
        let geo = (sc.params.alpha.abs() < 1e-6) as u32;
        let alpha = sc.params.alpha as f32;
        let (nh, kvh, nl) = (a.n_heads as u32, a.kv_heads as u32, a.layers as u32);
        let ls = u32_of(OP, "logit layer stride", a.logit_layer_stride)?;
        self.sfi_stage(sc, 1, || {
            self.launch(
                "sfi_rowstats",
                (rows as u32, kvh, nl),
                (256, 1, 1),
                0,
                &[
                    KArg::P(a.logits),
                    KArg::P(sc.stats.device_ptr()),
                    KArg::U(nh),
                    KArg::U(g as u32),
                    KArg::U(u32_of(OP, "lstride", a.lstride)?),
                    KArg::U(lo as u32),
                    KArg::U(hi as u32),
                    KArg::F(alpha),
                    KArg::U(geo),
                    KArg::U(ls),
                ],
            )
        })?;
        self.sfi_stage(sc, 2, || {
            self.launch(
                "sfi_evidence",
                (n.div_ceil(256) as u32, kvh, nl),
                (256, 1, 1),
                0,
                &[
                    KArg::P(a.logits),
                    KArg::P(sc.stats.device_ptr()),
                    KArg::P(sc.ev.device_ptr()),
                    KArg::U(nh),
                    KArg::U(g as u32),
                    KArg::U(rows as u32),
                    KArg::U(a.lstride as u32),
                    KArg::U(lo as u32),
                    KArg::U(hi as u32),
                    KArg::F(alpha),
                    KArg::U(geo),
                    KArg::U(ls),
                ],
            )
        })?;
        if let Some(sp) = &sc.split {
            return self.sfi_select_split(a, sc, sp, n, rows, geo);
        }
        if a.view.is_some() {
            return Err(CudaError::bad(
                OP,
                "a cheaper slow step's view needs the split Selector",
            ));
        }
        let (fa, fb) = match (&sc.fa, &sc.fb) {
            (Some(fa), Some(fb)) => (fa.device_ptr(), fb.device_ptr()),
            _ => {
                return Err(CudaError::bad(
                    OP,
                    "no f / r scratch for the per-head kernels",
                ))
            }
        };
        self.sfi_stage(sc, 3, || {
            self.launch(
                "sfi_score",
                (kvh, nl, 1),
                (1024, 1, 1),
                0,
                &[
                    KArg::P(sc.ev.device_ptr()),
                    KArg::P(sc.stats.device_ptr()),
                    KArg::P(a.norms),
                    KArg::P(fa),
                    KArg::P(fb),
                    KArg::P(sc.scores.device_ptr()),
                    KArg::P(sc.cnt.device_ptr()),
                    KArg::U(rows as u32),
                    KArg::U(u32_of(OP, "norm_stride", a.norm_stride)?),
                    KArg::U(lo as u32),
                    KArg::U(hi as u32),
                    KArg::P(sc.cfg.device_ptr()),
                    KArg::U(geo),
                    KArg::U(u32_of(OP, "norm layer stride", a.norm_layer_stride)?),
                ],
            )
        })?;
        if a.kv_heads > 2 {
            self.sfi_stage(sc, 4, || {
                self.launch(
                    "sfi_cross_head",
                    (n.div_ceil(256) as u32, 1, nl),
                    (256, 1, 1),
                    0,
                    &[
                        KArg::P(sc.scores.device_ptr()),
                        KArg::U(kvh),
                        KArg::U(n as u32),
                        KArg::P(sc.cfg.device_ptr()),
                    ],
                )
            })?;
        }
        let picks = sc.topk_picks();
        self.sfi_stage(sc, 5, || {
            self.topk_launch(
                picks,
                (kvh, nl, 1024),
                (kvh, n as u32, sc.k as u32, lo as u32),
            )
        })
    }

    /// `sfi_topk` over `scores [layers, kv_heads, n]` with finite counts `cnt`: the top `k` a
    /// kv head (ties: lower position first) as ascending positions `lo + i` into `sel`, the
    /// equalised count into `mcount`. `grid` = (kv heads, layers, threads a block); `args` =
    /// (kv heads, n, k, lo).
    pub(crate) fn topk_launch(
        &self,
        [scores, cnt, sel, mcount]: [u64; 4],
        (gx, gy, threads): (u32, u32, u32),
        (kvh, n, k, lo): (u32, u32, u32, u32),
    ) -> Result<(), CudaError> {
        self.launch(
            "sfi_topk",
            (gx, gy, 1),
            (threads, 1, 1),
            0,
            &[
                KArg::P(scores),
                KArg::P(cnt),
                KArg::P(sel),
                KArg::P(mcount),
                KArg::U(kvh),
                KArg::U(n),
                KArg::U(k),
                KArg::U(lo),
            ],
        )
    }

    /// The split Selector's score and top-k stages (after the row stats and the evidence):
    /// see kernels/sfi.cu, "split over many blocks".
    fn sfi_select_split(
        &self,
        a: &SelectArgs,
        sc: &SelectorScratch,
        sp: &Split,
        n: usize,
        rows: usize,
        geo: u32,
    ) -> Result<(), CudaError> {
        const OP: &str = "sfi_select";
        let (kvh, nl) = (a.kv_heads as u32, a.layers as u32);
        let lh = a.layers * a.kv_heads;
        let nch = n.div_ceil(SFI_SC);
        let zero = sp.zero.device_ptr();
        let [mm, cnt, ccount, hist, taken, len] = zero_layout(lh, nch).map(|u| zero + 4 * u as u64);
        let zero_bytes = (len - zero) as usize;
        let (lo, hi) = (a.sinks as u32, a.recent_start as u32);
        let (n32, k32, nch32) = (n as u32, sc.k as u32, nch as u32);
        let cfg = sc.cfg.device_ptr();
        let ns = u32_of(OP, "norm layer stride", a.norm_layer_stride)?;
        let norm_stride = u32_of(OP, "norm_stride", a.norm_stride)?;
        let stream = self.current_stream();
        // A view's position prior is per layer ([layers, n]); else one row all layers share.
        let pstride = if a.view.is_some() { n32 } else { 0 };
        if a.view.is_some() && a.layers * n > sp.pos.len() {
            return Err(CudaError::bad(
                OP,
                format!(
                    "a view's position prior of {} layers x {n} keys (room for {}; reserve_view)",
                    a.layers,
                    sp.pos.len()
                ),
            ));
        }
        // The per-chunk kernels: grid (chunks, kv heads, layers), 256 threads.
        let per_chunk = |name: &'static str, args: &[KArg]| {
            self.launch(name, (nch32, kvh, nl), (256, 1, 1), 0, args)
        };
        self.sfi_stage(sc, 3, || {
            // SAFETY: `zero_bytes` lies inside `sp.zero` (sized for the scratch's most layers
            // and chunks), on the stream the kernels below run on.
            unsafe { cudarc::driver::result::memset_d8_async(zero, 0, zero_bytes, stream) }
                .map_err(crate::context::drv("cuMemsetD8Async (sfi selector)"))?;
            match &a.view {
                None => self.launch(
                    "sfi_pos_prior",
                    (n.div_ceil(256) as u32, 1, 1),
                    (256, 1, 1),
                    0,
                    &[KArg::P(sp.pos.device_ptr()), KArg::U(n32), KArg::P(cfg)],
                )?,
                Some(v) => {
                    let mut args = vec![KArg::P(sp.pos.device_ptr())];
                    args.extend_from_slice(&v.args());
                    args.extend_from_slice(&[KArg::U(lo), KArg::U(hi), KArg::P(cfg)]);
                    self.launch(
                        "sfi_pos_prior_view",
                        (n.div_ceil(256) as u32, 1, nl),
                        (256, 1, 1),
                        0,
                        &args,
                    )?
                }
            }
            per_chunk(
                "sfi_score_part",
                &[
                    KArg::P(sc.ev.device_ptr()),
                    KArg::P(sc.stats.device_ptr()),
                    KArg::P(a.norms),
                    KArg::P(sp.pos.device_ptr()),
                    KArg::P(sp.part.device_ptr()),
                    KArg::U(rows as u32),
                    KArg::U(norm_stride),
                    KArg::U(lo),
                    KArg::U(hi),
                    KArg::P(cfg),
                    KArg::U(geo),
                    KArg::U(ns),
                    KArg::U(pstride),
                ],
            )?;
            self.launch(
                "sfi_score_lambda",
                (kvh, nl, 1),
                (32, 1, 1),
                0,
                &[
                    KArg::P(sp.part.device_ptr()),
                    KArg::P(sc.stats.device_ptr()),
                    KArg::P(sp.hc.device_ptr()),
                    KArg::U(rows as u32),
                    KArg::U(nch32),
                    KArg::P(cfg),
                    KArg::U(geo),
                ],
            )?;
            let smem = Split::fin_smem(a.kv_heads, sp.span, sc.params.nms_window / 2);
            self.launch(
                "sfi_score_fin",
                (n.div_ceil(sp.span) as u32, nl, 1),
                (256, 1, 1),
                smem as u32,
                &[
                    KArg::P(sc.ev.device_ptr()),
                    KArg::P(a.norms),
                    KArg::P(sp.pos.device_ptr()),
                    KArg::P(sp.hc.device_ptr()),
                    KArg::P(sc.scores.device_ptr()),
                    KArg::P(cnt),
                    KArg::P(mm),
                    KArg::U(kvh),
                    KArg::U(norm_stride),
                    KArg::U(lo),
                    KArg::U(hi),
                    KArg::U(sp.span as u32),
                    KArg::P(cfg),
                    KArg::U(geo),
                    KArg::U(ns),
                    KArg::U(pstride),
                ],
            )
        })?;
        let scores = sc.scores.device_ptr();
        self.sfi_stage(sc, 5, || {
            per_chunk(
                "sfi_topk_hist",
                &[
                    KArg::P(scores),
                    KArg::P(cnt),
                    KArg::P(mm),
                    KArg::P(hist),
                    KArg::U(n32),
                    KArg::U(k32),
                ],
            )?;
            per_chunk(
                "sfi_topk_cand",
                &[
                    KArg::P(scores),
                    KArg::P(cnt),
                    KArg::P(mm),
                    KArg::P(hist),
                    KArg::P(sp.above.device_ptr()),
                    KArg::P(sp.tinfo.device_ptr()),
                    KArg::P(sp.cand.device_ptr()),
                    KArg::P(sp.cpos.device_ptr()),
                    KArg::P(ccount),
                    KArg::U(n32),
                    KArg::U(k32),
                ],
            )?;
            self.launch(
                "sfi_topk_rank",
                (kvh, nl, 1),
                (1024, 1, 1),
                0,
                &[
                    KArg::P(scores),
                    KArg::P(cnt),
                    KArg::P(sp.tinfo.device_ptr()),
                    KArg::P(sp.cand.device_ptr()),
                    KArg::P(sp.cpos.device_ptr()),
                    KArg::P(ccount),
                    KArg::P(sp.above.device_ptr()),
                    KArg::P(taken),
                    KArg::P(sp.tres.device_ptr()),
                    KArg::P(sc.mcount.device_ptr()),
                    KArg::U(n32),
                    KArg::U(k32),
                    KArg::U(nch32),
                ],
            )?;
            per_chunk(
                "sfi_topk_write",
                &[
                    KArg::P(scores),
                    KArg::P(cnt),
                    KArg::P(sp.above.device_ptr()),
                    KArg::P(taken),
                    KArg::P(sp.tres.device_ptr()),
                    KArg::P(sc.sel.device_ptr()),
                    KArg::U(n32),
                    KArg::U(k32),
                    KArg::U(lo),
                ],
            )
        })
    }

    /// Gathers sinks + the positions `sc` chose into the compact buffers and publishes their
    /// length and recent start for `g.slot`, for `g.layers` layers of caches with layout `kv`.
    pub fn sfi_gather(
        &self,
        kv: KvLayout,
        sc: &SelectorScratch,
        g: &GatherArgs,
    ) -> Result<(), CudaError> {
        if g.layers > sc.layers {
            return Err(CudaError::bad(
                "sfi_gather",
                format!("{} layers (scratch: {})", g.layers, sc.layers),
            ));
        }
        let picks = (sc.sel.device_ptr(), sc.mcount.device_ptr(), sc.k);
        self.gather_picks(kv, picks, g)
    }

    /// The gather of [`CudaContext::sfi_gather`] from any selection: `picks` = (positions
    /// `[layers, kv_heads, k]`, counts `[layers]`, k), as `sfi_topk` leaves them.
    pub(crate) fn gather_picks(
        &self,
        kv: KvLayout,
        (sel, mcount, k): (u64, u64, usize),
        g: &GatherArgs,
    ) -> Result<(), CudaError> {
        const OP: &str = "sfi_gather";
        if g.slot >= kv.num_slots
            || g.ccap < g.sinks
            || g.layers == 0
            || [g.ck, g.cv, g.kptrs, g.vptrs, g.clen, g.rstart, sel, mcount].contains(&0)
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "slot {} / ccap {} / sinks {} / {} layers (or a null pointer)",
                    g.slot, g.ccap, g.sinks, g.layers
                ),
            ));
        }
        let args = [
            KArg::P(g.kptrs),
            KArg::P(g.vptrs),
            KArg::P(g.ck),
            KArg::P(g.cv),
            KArg::P(sel),
            KArg::P(mcount),
            KArg::P(g.clen),
            KArg::P(g.rstart),
            KArg::U(g.slot as u32),
            KArg::U(kv.kv_heads as u32),
            KArg::U(kv.capacity as u32),
            KArg::U(g.ccap as u32),
            // a copy of rows: their length in buffer elements (half the head dim with fp8)
            KArg::U(kv.row_len() as u32),
            KArg::U(g.sinks as u32),
            KArg::U(u32_of(OP, "k", k)?),
            KArg::U(u32_of(OP, "recent_start", g.recent_start)?),
            KArg::U(kv.num_slots as u32),
            KArg::U(u32_of(OP, "compact layer stride", g.compact_layer_stride)?),
        ];
        self.launch(
            "sfi_gather",
            (
                g.ccap.div_ceil(8) as u32,
                kv.kv_heads as u32,
                g.layers as u32,
            ),
            (256, 1, 1),
            0,
            &args,
        )
    }

    /// Copies slot `slot`'s staged memory of `layers` global layers (compact K / V `[layers,
    /// num_slots, per_slot]` and clen / rstart `[layers, num_slots]`, as the gather wrote them
    /// into the staging buffers) into the live buffers: `src` and `dst` are (K, V, clen, rstart).
    pub fn sfi_publish(
        &self,
        src: [u64; 4],
        dst: [u64; 4],
        slot: usize,
        num_slots: usize,
        layers: usize,
        per_slot: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "sfi_publish";
        if slot >= num_slots
            || layers == 0
            || per_slot % 8 != 0
            || src.contains(&0)
            || dst.contains(&0)
        {
            return Err(CudaError::bad(
                OP,
                format!("slot {slot} of {num_slots}, {layers} layers, {per_slot} elements a slot"),
            ));
        }
        let mut args: Vec<KArg> = src.iter().chain(&dst).map(|&p| KArg::P(p)).collect();
        args.extend([
            KArg::U(slot as u32),
            KArg::U(num_slots as u32),
            KArg::P(per_slot as u64),
        ]);
        self.launch(
            OP,
            (u32_of(OP, "layers", 2 * layers)?, 32, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }
}
