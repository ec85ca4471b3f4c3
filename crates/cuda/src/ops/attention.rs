//! Attention over the slot KV cache: flash-decoding for decode (split over the KV length,
//! then a reduce) and tiled flash attention for prefill. Optional per-row log-sum-exp.

use half::bf16;

use super::{u32_of, KvLayout};
use crate::buffer::GpuBuffer;
use crate::context::{attn_smem_bytes, CudaContext, KArg};
use crate::error::CudaError;
use crate::ops::fused::QkvPost;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// Keys a flash-decoding tile holds (`DEC_BK` in kernels/attn_decode.cu).
pub(crate) const DECODE_BK: usize = 64;

/// Prefill kernels: (name, head_dim, query rows per block).
pub const PREFILL_VARIANTS: &[(&str, usize, usize)] = &[
    ("attn_prefill_d64", 64, 64),
    ("attn_prefill_d128", 128, 64),
    ("attn_prefill_d256", 256, 64),
    ("attn_prefill_d64_m2", 64, 128),
    ("attn_prefill_d128_m2", 128, 128),
    ("attn_prefill_d128_wg", 128, 128),
    ("attn_prefill_d128_wg3", 128, 128),
];

/// Whether prefill kernel `kernel` runs on Hopper's warpgroup MMA (sm_90a only, 256 threads).
pub fn prefill_is_wgmma(kernel: &str) -> bool {
    kernel.starts_with("attn_prefill_d128_wg")
}
/// The variant `attn_prefill` uses for head_dim 64, 128, 256 (the two-m-tile kernels were
/// 5-8% faster at 32K on the H200, crates/cuda/gpu-runs/run2-bench.log).
const PREFILL_DEFAULT: [&str; 3] = [
    "attn_prefill_d64_m2",
    "attn_prefill_d128_m2",
    "attn_prefill_d256",
];

/// The head-dim-128 prefill kernel on sm_90a devices.
const PREFILL_WGMMA_D128: &str = "attn_prefill_d128_wg";

/// One decode step for a batch of sequences (one new query token each).
#[derive(Clone, Copy, Debug)]
pub struct DecodeAttn {
    pub batch: usize,
    pub n_heads: usize,
    /// Softmax scale applied to q·k (e.g. 1/sqrt(head_dim)).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys (p - window, p].
    pub window: Option<usize>,
    /// Upper bound of the sequence lengths in this batch: sizes the split. A smaller value is
    /// still correct (the last split takes the rest) but balances the work worse.
    pub max_seq_len: usize,
    /// Force a number of KV splits (None: chosen from the SM count).
    pub splits: Option<usize>,
}

/// A prefill chunk of one sequence: query rows at positions pos0..pos0 + n_tokens, whose keys
/// and values are already in the cache (append before calling).
#[derive(Clone, Copy, Debug)]
pub struct PrefillAttn {
    pub n_tokens: usize,
    pub n_heads: usize,
    /// Cache slot of the sequence.
    pub slot: usize,
    pub pos0: usize,
    pub scale: f32,
    pub window: Option<usize>,
}

/// Scratch for flash-decoding partials; grows on demand and is reused between calls.
#[derive(Default)]
pub struct AttnWorkspace {
    part_o: Option<GpuBuffer<f32>>,
    part_ml: Option<GpuBuffer<f32>>,
}

impl AttnWorkspace {
    pub fn new() -> Self {
        Self::default()
    }

    /// Device addresses of the partial buffers (0 before the first `ensure`): a captured graph
    /// that used them is valid while they stay the same.
    pub(crate) fn ptrs(&self) -> (u64, u64) {
        let p = |b: &Option<GpuBuffer<f32>>| b.as_ref().map_or(0, |b| b.device_ptr());
        (p(&self.part_o), p(&self.part_ml))
    }

    /// Device addresses of partial buffers of at least `need_o` / `need_ml` floats.
    pub(crate) fn ensure(
        &mut self,
        ctx: &CudaContext,
        need_o: usize,
        need_ml: usize,
    ) -> Result<(u64, u64), CudaError> {
        if self.part_o.as_ref().is_none_or(|b| b.len() < need_o) {
            self.part_o = Some(ctx.alloc::<f32>(need_o)?);
        }
        if self.part_ml.as_ref().is_none_or(|b| b.len() < need_ml) {
            self.part_ml = Some(ctx.alloc::<f32>(need_ml)?);
        }
        let o = self.part_o.as_ref().map(|b| b.device_ptr()).unwrap_or(0);
        let ml = self.part_ml.as_ref().map(|b| b.device_ptr()).unwrap_or(0);
        Ok((o, ml))
    }
}

fn check_heads(
    op: &'static str,
    n_heads: usize,
    kv: &KvLayout,
    scale: f32,
    window: Option<usize>,
) -> Result<(), CudaError> {
    kv.check(op)?;
    if n_heads == 0 || n_heads % kv.kv_heads != 0 || n_heads > 65535 {
        return Err(CudaError::bad(
            op,
            format!(
                "n_heads {n_heads} must be a positive multiple of kv_heads {}",
                kv.kv_heads
            ),
        ));
    }
    if !scale.is_finite() || scale <= 0.0 {
        return Err(CudaError::bad(
            op,
            format!("scale {scale} must be finite and positive"),
        ));
    }
    if window == Some(0) {
        return Err(CudaError::bad(op, "window 0 (use None for full attention)"));
    }
    Ok(())
}

/// What the device offers flash-decoding: SMs, shared memory a SM and reserved a block
/// (bytes), and the forced K/V stage count (0: choose).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeDevice {
    pub sm_count: usize,
    pub smem_per_sm: usize,
    pub smem_reserved: usize,
    pub stages: usize,
}

/// The dense flash-decoding kernel and (splits, chunk) for `p` on layout `kv`: one wave of
/// blocks (as many as fit on the device at once: shared memory sets how many a SM holds,
/// registers at most 4), no second-wave tail. At head_dim 128 the 4-stage kernel (one block a
/// SM, more K/V in flight) when its wave fills >= 95 % of the SMs (batch 1: 16 splits x 8 kv
/// heads on 132 SMs), else the 3-stage one (two a SM: batch 6 at 8 kv heads leaves 36 SMs idle
/// with one a SM, gpu-runs/history.md run 27); `dev.stages` 3 or 4 forces one (tests).
pub(crate) fn decode_plan(
    dev: DecodeDevice,
    p: &DecodeAttn,
    kv: &KvLayout,
) -> (&'static str, usize, usize) {
    let visible = visible_keys(p.max_seq_len, p.window, kv);
    let tiles = visible.div_ceil(DECODE_BK);
    let row_groups = (p.n_heads / kv.kv_heads.max(1)).div_ceil(16);
    let groups = (p.batch * kv.kv_heads * row_groups).max(1);
    let plan = |kernel: &'static str| {
        let smem = attn_smem_bytes(kernel).unwrap_or(0) as usize;
        let per_sm = (dev.smem_per_sm / (smem + dev.smem_reserved).max(1)).clamp(1, 4);
        let resident = dev.sm_count.max(1) * per_sm;
        let want = p.splits.unwrap_or_else(|| (resident / groups).max(1));
        let splits = want.clamp(1, tiles.min(1024));
        let chunk = visible.div_ceil(splits).div_ceil(DECODE_BK) * DECODE_BK;
        let splits = visible.div_ceil(chunk);
        let fill = (splits * groups) as f64 / resident as f64;
        (kernel, splits, chunk, fill)
    };
    let (k, s, c, _) = match (kv.head_dim, dev.stages) {
        (64, _) => plan("attn_decode_d64"),
        (128, 3) => plan("attn_decode_d128"),
        (128, 4) => plan("attn_decode_d128_s4"),
        (128, _) => {
            let deep = plan("attn_decode_d128_s4");
            if deep.3 >= 0.95 {
                deep
            } else {
                plan("attn_decode_d128")
            }
        }
        _ => plan("attn_decode_d256"),
    };
    (k, s, c)
}

/// Keys a decode-shaped launch may read: `max_seq_len`, within the cache and the window.
fn visible_keys(max_seq_len: usize, window: Option<usize>, kv: &KvLayout) -> usize {
    max_seq_len
        .min(kv.capacity)
        .min(window.unwrap_or(usize::MAX))
        .max(1)
}

/// A verification kernel (`VERIFY_ENTRY` in kernels/attn_decode.cu).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct VerifyVariant {
    pub name: &'static str,
    pub head_dim: usize,
    /// 16-row groups a block (128 threads each).
    pub groups: usize,
    /// K/V pipeline stages.
    pub stages: usize,
}

const fn vv(name: &'static str, head_dim: usize, groups: usize, stages: usize) -> VerifyVariant {
    VerifyVariant {
        name,
        head_dim,
        groups,
        stages,
    }
}

/// Every verification kernel the source defines.
pub(crate) const VERIFY_VARIANTS: &[VerifyVariant] = &[
    vv("attn_verify_d64", 64, 1, 4),
    vv("attn_verify_d64_g2", 64, 2, 4),
    vv("attn_verify_d64_g4", 64, 4, 4),
    vv("attn_verify_d128", 128, 1, 3),
    vv("attn_verify_d128_g2", 128, 2, 3),
    vv("attn_verify_d128_g3", 128, 3, 3),
    vv("attn_verify_d256", 256, 1, 2),
    vv("attn_verify_d256_g2", 256, 2, 2),
];

impl VerifyVariant {
    pub fn threads(&self) -> usize {
        128 * self.groups
    }

    /// Dynamic shared memory: the Q rows and the K/V ring, or at the end the merge slices
    /// ([groups][4][16][D + 8] f32 and (max, sum) [2][groups][4][16]) where the ring was,
    /// whichever is larger.
    pub fn smem_bytes(&self) -> usize {
        let str_ = self.head_dim + 8;
        let q = self.groups * 16 * str_ * 2;
        let ring = 2 * self.stages * DECODE_BK * str_ * 2;
        let merge = self.groups * 64 * str_ * 4 + 2 * self.groups * 64 * 4;
        q + ring.max(merge)
    }
}

/// Verification's kernel for `row_groups` 16-row groups a kv head, and its block columns a kv
/// head. As few block columns as the widest variant allows, then the narrowest variant that
/// still covers a column's share, so no group of warps idles needlessly.
pub(crate) fn verify_kernel(head_dim: usize, row_groups: usize) -> (VerifyVariant, usize) {
    let d = if matches!(head_dim, 64 | 128) {
        head_dim
    } else {
        256
    };
    let variants = || VERIFY_VARIANTS.iter().filter(move |v| v.head_dim == d);
    let widest = variants().map(|v| v.groups).max().unwrap_or(1);
    let cols = row_groups.max(1).div_ceil(widest);
    let want = row_groups.max(1).div_ceil(cols);
    let v = variants()
        .filter(|v| v.groups >= want)
        .min_by_key(|v| v.groups)
        .expect("the widest variant covers want");
    (*v, cols)
}

/// Splits of a verification launch of `blocks` blocks a split, `per_sm` of which fit a SM at
/// once, over the `visible` keys (no more splits than 64-key tiles). The verification blocks
/// are big (one a SM at head_dim 128), so one wave can leave many SMs idle (b6 at 8 kv heads:
/// 48 blocks a split, 2 splits fill 96 of 132 SMs); so the splits that keep the most SMs busy
/// over all waves, each wave past the first charged 4 % for its tail, fewest on a tie.
fn verify_splits(sm_count: usize, per_sm: usize, blocks: usize, visible: usize) -> usize {
    let resident = (sm_count.max(1) * per_sm.max(1)) as f64;
    let most = visible.div_ceil(DECODE_BK).clamp(1, 1024);
    let score = |s: usize| {
        let total = (blocks.max(1) * s) as f64;
        let waves = (total / resident).ceil();
        total / (waves * resident) - 0.04 * (waves - 1.0)
    };
    (1..=most).fold(1, |best, s| {
        if score(s) > score(best) + 1e-9 {
            s
        } else {
            best
        }
    })
}

fn check_decode(op: &'static str, p: &DecodeAttn, kv: &KvLayout) -> Result<(), CudaError> {
    check_heads(op, p.n_heads, kv, p.scale, p.window)?;
    if p.batch == 0 || p.batch > 65535 {
        return Err(CudaError::bad(op, format!("batch {} (1..=65535)", p.batch)));
    }
    Ok(())
}

/// Device addresses of a flash-decoding call's caches, lengths, slots and outputs (checked).
struct DecodeIo {
    k: u64,
    v: u64,
    lens: u64,
    slots: u64,
    out: u64,
    lse: u64,
}

impl DecodeIo {
    #[allow(clippy::too_many_arguments)]
    fn new(
        op: &'static str,
        k_cache: &GpuBuffer<bf16>,
        v_cache: &GpuBuffer<bf16>,
        seq_lens: &GpuBuffer<u32>,
        slots: &GpuBuffer<u32>,
        out: &mut GpuBuffer<bf16>,
        lse: Option<&mut GpuBuffer<f32>>,
        p: &DecodeAttn,
        kv: &KvLayout,
    ) -> Result<Self, CudaError> {
        let rows = p.batch * p.n_heads;
        Ok(DecodeIo {
            k: k_cache.ptr_min(op, "k_cache", kv.buf_len())?,
            v: v_cache.ptr_min(op, "v_cache", kv.buf_len())?,
            lens: seq_lens.ptr_min(op, "seq_lens [batch]", p.batch)?,
            slots: slots.ptr_min(op, "slots [batch]", p.batch)?,
            out: out.ptr_min(op, "out [batch, n_heads, head_dim]", rows * kv.head_dim)?,
            lse: match lse {
                Some(b) => b.ptr_min(op, "lse [batch, n_heads]", rows)?,
                None => 0,
            },
        })
    }
}

/// The arguments every dense flash-decoding entry starts with: q (or the q/k/v row), caches,
/// lengths, slots, the partials, head counts, capacity, slots and window.
fn decode_args(
    op: &'static str,
    pq: u64,
    io: &DecodeIo,
    (part_o, part_ml): (u64, u64),
    p: &DecodeAttn,
    kv: &KvLayout,
) -> Result<Vec<KArg>, CudaError> {
    Ok(vec![
        KArg::P(pq),
        KArg::P(io.k),
        KArg::P(io.v),
        KArg::P(io.lens),
        KArg::P(io.slots),
        KArg::P(part_o),
        KArg::P(part_ml),
        KArg::U(p.n_heads as u32),
        KArg::U(kv.kv_heads as u32),
        KArg::U(kv.capacity as u32),
        KArg::U(u32_of(op, "num_slots", kv.num_slots)?),
        KArg::U(p.window.map_or(Ok(0), |w| u32_of(op, "window", w))?),
    ])
}

impl CudaContext {
    /// The dense flash-decoding kernel and (splits, chunk) for `p` on layout `kv` on this
    /// device (see [`decode_plan`]).
    pub fn decode_plan(&self, p: &DecodeAttn, kv: &KvLayout) -> (&'static str, usize, usize) {
        let dev = DecodeDevice {
            sm_count: self.sm_count() as usize,
            smem_per_sm: self.smem_per_sm as usize,
            smem_reserved: self.smem_reserved as usize,
            stages: crate::context::DECODE_DEFAULT_STAGES,
        };
        decode_plan(dev, p, kv)
    }

    /// (splits, chunk) that flash-decoding uses for `p` on layout `kv`.
    pub fn decode_split(&self, p: &DecodeAttn, kv: &KvLayout) -> (usize, usize) {
        let (_, s, c) = self.decode_plan(p, kv);
        (s, c)
    }

    /// Flash-decoding: out[b, h, :] = softmax(scale q[b, h] · K^T) V over the first
    /// `seq_lens[b]` cached positions of slot `slots[b]` (the last `window` of them with a
    /// sliding window). q, out [batch, n_heads, head_dim]; lse [batch, n_heads] (natural log).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode(
        &self,
        q: &GpuBuffer<bf16>,
        k_cache: &GpuBuffer<bf16>,
        v_cache: &GpuBuffer<bf16>,
        kv: KvLayout,
        seq_lens: &GpuBuffer<u32>,
        slots: &GpuBuffer<u32>,
        out: &mut GpuBuffer<bf16>,
        lse: Option<&mut GpuBuffer<f32>>,
        ws: &mut AttnWorkspace,
        p: &DecodeAttn,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_decode";
        check_decode(OP, p, &kv)?;
        let pq = q.ptr_min(
            OP,
            "q [batch, n_heads, head_dim]",
            p.batch * p.n_heads * kv.head_dim,
        )?;
        let io = DecodeIo::new(OP, k_cache, v_cache, seq_lens, slots, out, lse, p, &kv)?;
        let (kernel, _, _) = self.decode_plan(p, &kv);
        self.decode_launch(OP, kernel, pq, io, ws, p, kv, &[])
    }

    /// The flash-decoding kernel that takes the q/k/v projection row itself and does what
    /// [`CudaContext::qkv_post`] does (q/k norms, RoPE, appending k and v to the caches) for a
    /// decode step, when the plan has one (not for a forced 6-stage ring).
    pub fn decode_post_kernel(&self, p: &DecodeAttn, kv: &KvLayout) -> Option<&'static str> {
        match self.decode_plan(p, kv).0 {
            "attn_decode_d64" => Some("attn_decode_post_d64"),
            "attn_decode_d128" => Some("attn_decode_post_d128"),
            "attn_decode_d128_s4" => Some("attn_decode_post_d128_s4"),
            "attn_decode_d256" => Some("attn_decode_post_d256"),
            _ => None,
        }
    }

    /// [`CudaContext::qkv_post`] of one decode step followed by [`CudaContext::attn_decode`], in
    /// one kernel (and its reduce): `qkv [batch, (n_heads + 2 kv_heads) head_dim]` is the merged
    /// projection row of each sequence, `positions[b]` must be `seq_lens[b] - 1` (the new
    /// token, whose k and v are appended to the caches at `(slots[b], positions[b])`). The
    /// outputs and the caches are bit-identical to the two calls. Errors when
    /// [`CudaContext::decode_post_kernel`] has none.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_post(
        &self,
        qkv: &GpuBuffer<bf16>,
        k_cache: &mut GpuBuffer<bf16>,
        v_cache: &mut GpuBuffer<bf16>,
        kv: KvLayout,
        seq_lens: &GpuBuffer<u32>,
        slots: &GpuBuffer<u32>,
        positions: &GpuBuffer<u32>,
        out: &mut GpuBuffer<bf16>,
        lse: Option<&mut GpuBuffer<f32>>,
        ws: &mut AttnWorkspace,
        p: &DecodeAttn,
        post: &QkvPost,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_decode_post";
        check_decode(OP, p, &kv)?;
        let hd = kv.head_dim;
        let [qn, kn, freq] = post.check(OP, hd)?;
        if post.n_tokens != p.batch || post.q_heads != p.n_heads {
            return Err(CudaError::bad(
                OP,
                format!(
                    "{} tokens / {} q heads for batch {} / {} heads",
                    post.n_tokens, post.q_heads, p.batch, p.n_heads
                ),
            ));
        }
        let Some(kernel) = self.decode_post_kernel(p, &kv) else {
            return Err(CudaError::bad(
                OP,
                format!("no post kernel for plan {}", self.decode_plan(p, &kv).0),
            ));
        };
        let stride = (p.n_heads + 2 * kv.kv_heads) * hd;
        let pqkv = qkv.ptr_min(
            OP,
            "qkv [batch, (n_heads + 2 kv_heads) * head_dim]",
            p.batch * stride,
        )?;
        let extra = [
            KArg::U(u32_of(OP, "qkv row", stride)?),
            KArg::P(qn),
            KArg::P(kn),
            KArg::F(post.eps),
            KArg::P(positions.ptr_min(OP, "positions [batch]", p.batch)?),
            KArg::U(post.rot_dim as u32),
            KArg::P(freq),
        ];
        let io = DecodeIo::new(OP, k_cache, v_cache, seq_lens, slots, out, lse, p, &kv)?;
        self.decode_launch(OP, kernel, pqkv, io, ws, p, kv, &extra)
    }

    /// Speculative verification: `rows_per_seq` query rows of each of `p.batch` sequences at
    /// consecutive positions, causal among themselves, dense over the cache (each K/V tile read
    /// once for a 16-row group of rows x query heads). q, out `[p.batch * rows_per_seq, n_heads,
    /// head_dim]`; `seq_lens` / `slots` have one entry a row: row r of sequence b sees the first
    /// `seq_lens[b * rows_per_seq + r]` positions of slot `slots[b * rows_per_seq]` (the last
    /// `window` of them), the lengths rising by one a row. With `capture = Some((logits, flags,
    /// lstride))`, row 0 of each sequence whose slot's flag is set writes its scaled scores (log2
    /// units) to `logits[slot, head, j]` (row stride `lstride`) for SFI's Selector.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_verify(
        &self,
        q: &GpuBuffer<bf16>,
        k_cache: &GpuBuffer<bf16>,
        v_cache: &GpuBuffer<bf16>,
        kv: KvLayout,
        seq_lens: &GpuBuffer<u32>,
        slots: &GpuBuffer<u32>,
        out: &mut GpuBuffer<bf16>,
        ws: &mut AttnWorkspace,
        p: &DecodeAttn,
        rows_per_seq: usize,
        capture: Option<(u64, u64, usize)>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_verify";
        check_decode(OP, p, &kv)?;
        if rows_per_seq == 0 || rows_per_seq > 64 {
            return Err(CudaError::bad(
                OP,
                format!("rows_per_seq {rows_per_seq} (1..=64)"),
            ));
        }
        let rows = p.batch * rows_per_seq;
        let pr = DecodeAttn { batch: rows, ..*p };
        let pq = q.ptr_min(
            OP,
            "q [rows, n_heads, head_dim]",
            rows * p.n_heads * kv.head_dim,
        )?;
        let io = DecodeIo::new(OP, k_cache, v_cache, seq_lens, slots, out, None, &pr, &kv)?;
        let d = kv.head_dim;
        let (v, cols, splits) = self.verify_plan(p, &kv, rows_per_seq);
        let hrows = rows * p.n_heads;
        let (part_o, part_ml) = ws.ensure(self, hrows * splits * d, hrows * splits * 2)?;
        let (logits, flags, lstride) = capture.unwrap_or((0, 0, 0));
        let mut args = decode_args(OP, pq, &io, (part_o, part_ml), p, &kv)?;
        args.extend([
            KArg::F(p.scale * LOG2E),
            KArg::U(rows_per_seq as u32),
            KArg::P(logits),
            KArg::P(flags),
            KArg::U(u32_of(OP, "lstride", lstride)?),
        ]);
        let grid_y = u32_of(OP, "kv_heads * block columns", kv.kv_heads * cols)?;
        self.launch(
            crate::kernels::kv_kernel(v.name, kv.fp8),
            (splits as u32, grid_y, p.batch as u32),
            (v.threads() as u32, 1, 1),
            v.smem_bytes() as u32,
            &args,
        )?;
        self.attn_decode_reduce_raw(part_o, part_ml, io.out, 0, hrows, p.n_heads, splits, d)
    }

    /// The verification kernel, its block columns a kv head and the key splits that
    /// [`CudaContext::attn_verify`] launches for `p` (`p.batch` sequences) with `rows_per_seq`
    /// rows each. The kernel reads the lengths from the device, so a captured verification is
    /// exact at any length; the split count only balances the work.
    pub(crate) fn verify_plan(
        &self,
        p: &DecodeAttn,
        kv: &KvLayout,
        rows_per_seq: usize,
    ) -> (VerifyVariant, usize, usize) {
        // rows_per_seq x the query heads a sequence, as 16-row groups of each kv head.
        let row_groups = (p.n_heads / kv.kv_heads * rows_per_seq).div_ceil(16);
        let (v, cols) = verify_kernel(kv.head_dim, row_groups);
        let visible = visible_keys(p.max_seq_len + rows_per_seq, p.window, kv);
        let per_sm = self.verify_per_sm.get(v.name).copied().unwrap_or(1);
        let blocks = p.batch * kv.kv_heads * cols;
        let splits = verify_splits(self.sm_count() as usize, per_sm, blocks, visible);
        (v, cols, splits)
    }

    /// Launches flash-decoding kernel `kernel` (first argument `pq`: q, or the q/k/v row for the
    /// post kernels, whose `extra` arguments follow the common ones) and its reduce.
    #[allow(clippy::too_many_arguments)]
    fn decode_launch(
        &self,
        op: &'static str,
        kernel: &'static str,
        pq: u64,
        io: DecodeIo,
        ws: &mut AttnWorkspace,
        p: &DecodeAttn,
        kv: KvLayout,
        extra: &[KArg],
    ) -> Result<(), CudaError> {
        let d = kv.head_dim;
        let rows = p.batch * p.n_heads;
        let (_, splits, chunk) = self.decode_plan(p, &kv);
        let (part_o, part_ml) = ws.ensure(self, rows * splits * d, rows * splits * 2)?;
        let smem = attn_smem_bytes(kernel).unwrap_or(0);
        let row_groups = (p.n_heads / kv.kv_heads).div_ceil(16);
        let mut args = decode_args(op, pq, &io, (part_o, part_ml), p, &kv)?;
        args.extend([
            // 0: the kernel splits each sequence's keys evenly itself
            KArg::U(if self.decode_balance() {
                0
            } else {
                u32_of(op, "chunk", chunk)?
            }),
            KArg::F(p.scale * LOG2E),
        ]);
        args.extend_from_slice(extra);
        let grid_y = u32_of(op, "kv_heads * row groups", kv.kv_heads * row_groups)?;
        self.launch(
            crate::kernels::kv_kernel(kernel, kv.fp8),
            (splits as u32, grid_y, p.batch as u32),
            (128, 1, 1),
            smem,
            &args,
        )?;
        self.attn_decode_reduce_raw(part_o, part_ml, io.out, io.lse, rows, p.n_heads, splits, d)
    }

    /// Merges flash-decoding partials of `rows` = batch x n_heads rows into out (bf16) and,
    /// when `lse` is not 0, the natural log-sum-exp per row.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_decode_reduce_raw(
        &self,
        part_o: u64,
        part_ml: u64,
        out: u64,
        lse: u64,
        rows: usize,
        n_heads: usize,
        splits: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let rargs = [
            KArg::P(part_o),
            KArg::P(part_ml),
            KArg::P(out),
            KArg::P(lse),
            KArg::U(n_heads as u32),
            KArg::U(splits as u32),
            KArg::U(d as u32),
        ];
        self.launch(
            "attn_decode_reduce",
            (n_heads as u32, (rows / n_heads) as u32, 1),
            (256, 1, 1),
            0,
            &rargs,
        )
    }

    /// Causal flash attention for a prefill chunk: out[i, h, :] attends to cached keys
    /// 0..=pos0 + i (within the window). q, out [n_tokens, n_heads, head_dim];
    /// lse [n_tokens, n_heads] (natural log). No buffer grows with n_tokens^2.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill(
        &self,
        q: &GpuBuffer<bf16>,
        k_cache: &GpuBuffer<bf16>,
        v_cache: &GpuBuffer<bf16>,
        kv: KvLayout,
        out: &mut GpuBuffer<bf16>,
        lse: Option<&mut GpuBuffer<f32>>,
        p: &PrefillAttn,
    ) -> Result<(), CudaError> {
        let d = kv.head_dim;
        let kernel = match d {
            64 => PREFILL_DEFAULT[0],
            // the wgmma kernel reads bf16 caches only
            128 if self.wgmma && !kv.fp8 => PREFILL_WGMMA_D128,
            128 => PREFILL_DEFAULT[1],
            _ => PREFILL_DEFAULT[2],
        };
        self.attn_prefill_with_kernel(q, k_cache, v_cache, kv, out, lse, p, kernel)
    }

    /// [`CudaContext::attn_prefill`] through a named kernel variant (see
    /// [`PREFILL_VARIANTS`]); for benchmarks and tests of the variants.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_with_kernel(
        &self,
        q: &GpuBuffer<bf16>,
        k_cache: &GpuBuffer<bf16>,
        v_cache: &GpuBuffer<bf16>,
        kv: KvLayout,
        out: &mut GpuBuffer<bf16>,
        lse: Option<&mut GpuBuffer<f32>>,
        p: &PrefillAttn,
        kernel: &'static str,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_prefill";
        let Some(&(_, kd, bq)) = PREFILL_VARIANTS.iter().find(|v| v.0 == kernel) else {
            return Err(CudaError::bad(
                OP,
                format!("unknown prefill kernel {kernel}"),
            ));
        };
        check_heads(OP, p.n_heads, &kv, p.scale, p.window)?;
        if prefill_is_wgmma(kernel) && kv.fp8 {
            return Err(CudaError::bad(
                OP,
                format!("kernel {kernel} reads bf16 caches, not fp8"),
            ));
        }
        if prefill_is_wgmma(kernel) && !self.wgmma {
            return Err(CudaError::bad(
                OP,
                format!("kernel {kernel} needs an sm_90a device (Hopper warpgroup MMA)"),
            ));
        }
        if kd != kv.head_dim {
            return Err(CudaError::bad(
                OP,
                format!("kernel {kernel} is for head_dim {kd}, not {}", kv.head_dim),
            ));
        }
        if p.n_tokens == 0 || p.pos0 + p.n_tokens > kv.capacity {
            return Err(CudaError::bad(
                OP,
                format!(
                    "positions {}..{} do not fit the cache capacity {}",
                    p.pos0,
                    p.pos0 + p.n_tokens,
                    kv.capacity
                ),
            ));
        }
        if p.slot >= kv.num_slots {
            return Err(CudaError::bad(
                OP,
                format!("slot {} of {}", p.slot, kv.num_slots),
            ));
        }
        let d = kv.head_dim;
        let rows = p.n_tokens * p.n_heads;
        // a slot's caches, in buffer elements (half as many with fp8)
        let slot_elems = kv.kv_heads * kv.capacity * kv.row_len();
        let pk = k_cache.ptr_range(OP, "k_cache slot", p.slot * slot_elems, slot_elems)?;
        let pv = v_cache.ptr_range(OP, "v_cache slot", p.slot * slot_elems, slot_elems)?;
        let pq = q.ptr_min(OP, "q [n_tokens, n_heads, head_dim]", rows * d)?;
        let po = out.ptr_min(OP, "out [n_tokens, n_heads, head_dim]", rows * d)?;
        let plse = match lse {
            Some(b) => b.ptr_min(OP, "lse [n_tokens, n_heads]", rows)?,
            None => 0,
        };
        let args = [
            KArg::P(pq),
            KArg::P(pk),
            KArg::P(pv),
            KArg::P(po),
            KArg::P(plse),
            KArg::U(u32_of(OP, "n_tokens", p.n_tokens)?),
            KArg::U(p.n_heads as u32),
            KArg::U(kv.kv_heads as u32),
            KArg::U(kv.capacity as u32),
            KArg::U(p.pos0 as u32),
            KArg::U(p.window.map_or(Ok(0), |w| u32_of(OP, "window", w))?),
            KArg::F(p.scale * LOG2E),
        ];
        let grid = (p.n_tokens.div_ceil(bq) as u32, p.n_heads as u32, 1);
        let threads = if prefill_is_wgmma(kernel) { 256 } else { 128 };
        self.launch(
            crate::kernels::kv_kernel(kernel, kv.fp8),
            grid,
            (threads, 1, 1),
            attn_smem_bytes(kernel).unwrap_or(0),
            &args,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200: 132 SMs, 228 KiB of shared memory a SM, 1 KiB reserved a block.
    fn h200(stages: usize) -> DecodeDevice {
        DecodeDevice {
            sm_count: 132,
            smem_per_sm: 233_472,
            smem_reserved: 1024,
            stages,
        }
    }

    fn qwen3_4b(batch: usize, ctx: usize) -> (DecodeAttn, KvLayout) {
        let p = DecodeAttn {
            batch,
            n_heads: 32,
            scale: 0.088,
            window: None,
            max_seq_len: ctx,
            splits: None,
        };
        let kv = KvLayout {
            num_slots: batch,
            kv_heads: 8,
            capacity: 131_328,
            head_dim: 128,
            fp8: false,
        };
        (p, kv)
    }

    #[test]
    fn the_deep_ring_runs_only_where_one_block_a_sm_fills_the_device() {
        // batch 1: 16 splits x 8 kv heads = 128 blocks of 132 slots -> 4 stages
        let (p, kv) = qwen3_4b(1, 32_768);
        let (k, s, c) = decode_plan(h200(0), &p, &kv);
        assert_eq!((k, s, c), ("attn_decode_d128_s4", 16, 2048));
        // batch 6: 4 stages would fill 96 of 132 SMs -> 3 stages, 5 x 48 = 240 of 264 slots
        let (p, kv) = qwen3_4b(6, 131_072);
        let (k, s, _) = decode_plan(h200(0), &p, &kv);
        assert_eq!((k, s), ("attn_decode_d128", 5));
        // batch 8: 2 x 64 = 128 blocks -> 4 stages
        let (p, kv) = qwen3_4b(8, 32_768);
        assert_eq!(decode_plan(h200(0), &p, &kv).0, "attn_decode_d128_s4");
        // a forced stage count wins
        let (p, kv) = qwen3_4b(1, 32_768);
        assert_eq!(decode_plan(h200(3), &p, &kv).0, "attn_decode_d128");
        assert_eq!(decode_plan(h200(4), &p, &kv).0, "attn_decode_d128_s4");
    }

    #[test]
    fn splits_cover_the_visible_keys_and_never_outnumber_the_tiles() {
        for stages in [0, 3, 4, 6] {
            for batch in [1, 2, 6, 8, 64] {
                for ctx in [1, 63, 64, 65, 1000, 8192, 32_768, 131_072] {
                    let (p, kv) = qwen3_4b(batch, ctx);
                    let (_, s, c) = decode_plan(h200(stages), &p, &kv);
                    assert_eq!(c % DECODE_BK, 0, "chunk {c}");
                    assert!(s * c >= ctx && (s - 1) * c < ctx, "{s} x {c} for {ctx}");
                    assert!(s <= ctx.div_ceil(DECODE_BK).max(1), "{s} splits for {ctx}");
                }
            }
        }
    }

    #[test]
    fn verification_reads_each_tile_once_for_as_many_row_groups_as_a_block_holds() {
        // Qwen3-4B (G = 4): rows x 4 heads in 16-row groups.
        let g = |rows: usize| (4 * rows).div_ceil(16);
        let k = |d: usize, groups: usize| {
            let (v, cols) = verify_kernel(d, groups);
            (v.name, v.groups, cols)
        };
        assert_eq!(k(128, g(3)), ("attn_verify_d128", 1, 1));
        assert_eq!(k(128, g(5)), ("attn_verify_d128_g2", 2, 1));
        assert_eq!(k(128, g(9)), ("attn_verify_d128_g3", 3, 1));
        // 4 groups: two columns of two, not a column of three and one of one.
        assert_eq!(k(128, 4), ("attn_verify_d128_g2", 2, 2));
        assert_eq!(k(64, 3), ("attn_verify_d64_g4", 4, 1));
        assert_eq!(k(256, 3), ("attn_verify_d256_g2", 2, 2));
        // Every variant fits an H200 block (227 KiB) and keeps the decode kernel's ring for one
        // group (so NGB = 1 launches exactly as before).
        for v in VERIFY_VARIANTS {
            let smem = v.smem_bytes();
            assert!(smem <= 232_448, "{}: {smem} bytes", v.name);
            assert_eq!(attn_smem_bytes(v.name), Some(smem as u32));
            if v.groups == 1 {
                let ring = (16 + 2 * v.stages * 64) * (v.head_dim + 8) * 2;
                assert_eq!(smem, ring, "{}", v.name);
            }
        }
        // b6 at 128K, 48 blocks a split, one a SM: 8 splits are 3 waves at 97 % (384 of 396)
        // where 2 splits would leave 36 SMs idle; b1 (8 blocks): 16 splits, 128 of 132 SMs.
        assert_eq!(verify_splits(132, 1, 48, 131_072), 8);
        assert_eq!(verify_splits(132, 1, 8, 131_072), 16);
        // never more splits than tiles
        assert_eq!(verify_splits(132, 2, 8, 100), 2);
        for blocks in 1..200 {
            let s = verify_splits(132, 1, blocks, 131_072);
            let fill = (blocks * s) as f64 / ((blocks * s).div_ceil(132) * 132) as f64;
            assert!(
                fill >= 0.8 || blocks * s < 132,
                "{blocks} blocks: {s} splits fill {fill}"
            );
        }
    }
}
