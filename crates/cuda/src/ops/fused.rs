//! Fused kernels (kernels/gemv.cu, kernels/decode_fused.cu): for the decode step at 1-2 rows a
//! weight-streaming GEMV whose input row is made in the kernel (plain or RMS-normed) and whose
//! output can be added to the residual stream or be the GLU of its `[gate; up]` rows; for every forward
//! the per-head q/k norm + RoPE + KV append after the merged q/k/v projection. Each does what a
//! chain of the plain kernels does (same roundings to bf16), in one launch.

use half::bf16;

use super::elementwise::Glu;
use super::u32_of;
use super::KvLayout;
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// Rows the fused GEMV's CUDA-core kernels take (its `gemv_fused_n{1,2}` entry points).
pub const FUSED_MAX_ROWS: usize = 2;
/// Rows the fused GEMV takes in all: 3 to this many run the tensor-core kernels
/// (`gemv_mma_fused_m*`).
pub const MMA_MAX_ROWS: usize = 8;

/// The input row of [`CudaContext::gemv_fused`], made on the fly from `x` by every block.
#[derive(Clone, Copy)]
pub enum GemvInput<'a> {
    /// `x [n, in]` as it is.
    Plain,
    /// `rmsnorm(x [n, in]) * w` (what `rmsnorm` writes).
    Norm { w: &'a GpuBuffer<f32>, eps: f32 },
}

/// Where [`CudaContext::gemv_fused`] writes `y [n, out]`.
pub enum GemvOutput<'a> {
    Bf16(&'a mut GpuBuffer<bf16>),
    F32(&'a mut GpuBuffer<f32>),
    /// `res [n, out] += bf16(y)` (the residual add of `add_rmsnorm`).
    Residual(&'a mut GpuBuffer<bf16>),
    /// The rows of `w` are `[gate; up]` (out even): `glu [n, out / 2] = act(gate) * up`, what
    /// `glu` writes from the `[gate | up]` rows, so the next GEMV reads a plain row.
    Glu(&'a mut GpuBuffer<bf16>, Glu),
}

/// Per-head norm and RoPE settings of [`CudaContext::qkv_post`].
#[derive(Clone, Copy)]
pub struct QkvPost<'a> {
    pub n_tokens: usize,
    pub q_heads: usize,
    /// Per-head RMSNorm weights `[head_dim]` of q and k (Qwen3, Gemma 3), or none.
    pub q_norm: Option<&'a GpuBuffer<f32>>,
    pub k_norm: Option<&'a GpuBuffer<f32>>,
    pub eps: f32,
    /// Leading dims rotated (<= head_dim, even).
    pub rot_dim: usize,
    /// RoPE inverse frequencies `[rot_dim / 2]`.
    pub inv_freq: &'a GpuBuffer<f64>,
    /// fp8 caches: device address of `[2 kv_heads]` f32 that collect each kv head's largest
    /// |k| then |v| (atomic max; calibration), or 0.
    pub amax: u64,
    /// `qkv_post` only: device address of `[n]` RoPE positions, the rows then being stored at
    /// `positions` (FastKV's propagated rows, compact in the cache); 0: RoPE at `positions`.
    pub rope_pos: u64,
}

/// Whether a q/k post-processing's RoPE width and norm eps are usable for heads of `head_dim`:
/// the rotation even, non-zero and no wider than the head, eps neither NaN nor negative.
pub(crate) fn post_scalars_ok(rot_dim: usize, eps: f32, head_dim: usize) -> bool {
    rot_dim != 0 && rot_dim <= head_dim && rot_dim % 2 == 0 && !eps.is_nan() && eps >= 0.0
}

impl QkvPost<'_> {
    /// Refuses no tokens or q heads, a rotation that is odd, zero or wider than `head_dim`,
    /// and a NaN or negative eps, naming them; else the device addresses of the q and k norm
    /// weights (0 when absent) and of the inverse frequencies, each checked for its length.
    pub(crate) fn check(&self, op: &'static str, head_dim: usize) -> Result<[u64; 3], CudaError> {
        if self.n_tokens == 0
            || self.q_heads == 0
            || !post_scalars_ok(self.rot_dim, self.eps, head_dim)
        {
            return Err(CudaError::bad(
                op,
                format!(
                    "{} tokens, {} q heads, rot_dim {} of head_dim {head_dim}, eps {}",
                    self.n_tokens, self.q_heads, self.rot_dim, self.eps
                ),
            ));
        }
        let nrm = |b: Option<&GpuBuffer<f32>>, what: &str| -> Result<u64, CudaError> {
            b.map_or(Ok(0), |b| b.ptr_min(op, what, head_dim))
        };
        Ok([
            nrm(self.q_norm, "q_norm [head_dim]")?,
            nrm(self.k_norm, "k_norm [head_dim]")?,
            self.inv_freq
                .ptr_min(op, "inv_freq [rot_dim / 2]", self.rot_dim / 2)?,
        ])
    }
}

impl CudaContext {
    /// Whether a decode step of `n` rows runs the fused kernels (on unless
    /// `SLOWFAST_DECODE_FUSED=0`; `n` within the GEMV path's rows, or within
    /// `SLOWFAST_GEMV_MMA_ROWS` for the tensor-core kernels).
    pub fn decode_fused_rows(&self, n: usize) -> bool {
        self.decode_pdl_rows(n) || (self.decode_fused && n <= self.gemv_mma_rows())
    }

    /// Whether a decode step of `n` rows launches its fused kernels with PDL: at 1-2 rows
    /// only (at 6, with cuBLAS, PDL cost SFI's schedule 16 %: gpu-runs/history.md run 22).
    pub fn decode_pdl_rows(&self, n: usize) -> bool {
        self.decode_fused && n <= self.gemv_max_rows.min(FUSED_MAX_ROWS)
    }

    /// `y = xin · wᵀ` for `n` <= [`MMA_MAX_ROWS`] rows (3 and more on tensor cores), `xin`
    /// prepared from `x` as `input` says, `w [out, in]` bf16, f32 accumulation, written as `y`
    /// says; `in % 8 == 0`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_fused(
        &self,
        x: &GpuBuffer<bf16>,
        input: GemvInput,
        w: &GpuBuffer<bf16>,
        y: GemvOutput,
        n: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemv_fused";
        if n == 0
            || n > MMA_MAX_ROWS
            || in_features == 0
            || in_features % 8 != 0
            || out_features == 0
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "n={n} (1..={MMA_MAX_ROWS}), in={in_features} (a multiple of 8), \
                     out={out_features}"
                ),
            ));
        }
        let (mode, nw, eps) = match input {
            GemvInput::Plain => (0usize, 0u64, 0.0f32),
            GemvInput::Norm { w, eps } => {
                if eps.is_nan() || eps < 0.0 {
                    return Err(CudaError::bad(OP, format!("eps {eps}")));
                }
                (1, w.ptr_min(OP, "norm weight [in]", in_features)?, eps)
            }
        };
        let px = x.ptr_min(OP, "x", n * in_features)?;
        let pw = w.ptr_min(OP, "w [out, in]", out_features * in_features)?;
        let m = n * out_features;
        let (py, flags) = match y {
            GemvOutput::Bf16(b) => (b.ptr_min(OP, "y [n, out]", m)?, 0u32),
            GemvOutput::F32(b) => (b.ptr_min(OP, "y [n, out]", m)?, 1),
            GemvOutput::Residual(b) => (b.ptr_min(OP, "residual [n, out]", m)?, 2),
            GemvOutput::Glu(b, g) => {
                if out_features % 2 != 0 {
                    return Err(CudaError::bad(
                        OP,
                        format!("GLU output from {out_features} rows (must be even)"),
                    ));
                }
                let act = match g {
                    Glu::SwiGlu => 0,
                    Glu::GeGluTanh => 16,
                };
                (b.ptr_min(OP, "glu [n, out / 2]", m / 2)?, 8 | act)
            }
        };
        if n > FUSED_MAX_ROWS {
            let ptrs = [px, nw, pw, py];
            return self.gemv_mma_launch(mode, ptrs, n, in_features, out_features, flags, eps);
        }
        let args = [
            KArg::P(px),
            KArg::P(nw),
            KArg::P(pw),
            KArg::P(py),
            KArg::U(in_features as u32),
            KArg::U(u32_of(OP, "out", out_features)?),
            KArg::U(flags),
            KArg::F(eps),
        ];
        self.gemv_launch(n, mode, out_features, &args)
    }

    /// Launches the tensor-core GEMV (`gemv_mma_fused_m{mode}`) for `n` <= 8 rows: `ptrs` are
    /// x, the norm weight (0 in mode 0), w and y; `flags` as `gemv_fused_*`'s. 16 output rows a
    /// block, or with the GLU flag 8 GLU outputs (their gate and up rows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_mma_launch(
        &self,
        mode: usize,
        ptrs: [u64; 4],
        n: usize,
        in_features: usize,
        out_features: usize,
        flags: u32,
        eps: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemv_mma";
        let [px, nw, pw, py] = ptrs;
        let args = [
            KArg::P(px),
            KArg::P(nw),
            KArg::P(pw),
            KArg::P(py),
            KArg::U(n as u32),
            KArg::U(in_features as u32),
            KArg::U(u32_of(OP, "out", out_features)?),
            KArg::U(flags),
            KArg::F(eps),
        ];
        let blocks = if flags & 8 != 0 {
            (out_features / 2).div_ceil(8)
        } else {
            out_features.div_ceil(16)
        };
        let name = ["gemv_mma_fused_m0", "gemv_mma_fused_m1"][mode];
        let grid = (u32_of(OP, "blocks", blocks)?, 1, 1);
        self.launch(name, grid, (256, 1, 1), 0, &args)
    }

    /// Launches the fused GEMV for `n` rows in input mode `mode` (0 plain, 1 norm)
    /// with the `gemv_fused_*` argument list `args`.
    pub(crate) fn gemv_launch(
        &self,
        n: usize,
        mode: usize,
        out_features: usize,
        args: &[KArg],
    ) -> Result<(), CudaError> {
        const NAMES: [[&str; 2]; 2] = [
            ["gemv_fused_n1_m0", "gemv_fused_n1_m1"],
            ["gemv_fused_n2_m0", "gemv_fused_n2_m1"],
        ];
        // Four output rows a block (GEMV_GR in kernels/gemv.cu).
        let grid = u32_of("gemv_fused", "blocks", out_features.div_ceil(4))?;
        self.launch(NAMES[n - 1][mode], (grid, 1, 1), (256, 1, 1), 0, args)
    }

    /// After the merged q/k/v projection of `p.n_tokens` rows (`qkv [n, (q_heads + 2
    /// kv_heads) * head_dim]`, each row q then k then v): per-head RMSNorm of q and k (when
    /// weights are given), NeoX RoPE of both at `positions`, q written to `q [n, q_heads,
    /// head_dim]`, k and v appended to the caches at `(slots[t], positions[t])` (rows with a
    /// slot or position out of range are not cached). What `head_rmsnorm`, `rope_neox_with` and
    /// `kv_append` do after three projections, in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_post(
        &self,
        qkv: &GpuBuffer<bf16>,
        q: &mut GpuBuffer<bf16>,
        k_cache: &mut GpuBuffer<bf16>,
        v_cache: &mut GpuBuffer<bf16>,
        positions: &GpuBuffer<u32>,
        slots: &GpuBuffer<u32>,
        kv: KvLayout,
        p: &QkvPost,
    ) -> Result<(), CudaError> {
        const OP: &str = "qkv_post";
        kv.check(OP)?;
        let (n, hd) = (p.n_tokens, kv.head_dim);
        let [qn, kn, freq] = p.check(OP, hd)?;
        let row = (p.q_heads + 2 * kv.kv_heads) * hd;
        let args = [
            KArg::P(qkv.ptr_min(OP, "qkv [n, (q_heads + 2 kv_heads) * head_dim]", n * row)?),
            KArg::U(u32_of(OP, "qkv row", row)?),
            KArg::P(q.ptr_min(OP, "q [n, q_heads, head_dim]", n * p.q_heads * hd)?),
            KArg::P(k_cache.ptr_min(OP, "k_cache", kv.buf_len())?),
            KArg::P(v_cache.ptr_min(OP, "v_cache", kv.buf_len())?),
            KArg::P(qn),
            KArg::P(kn),
            KArg::F(p.eps),
            KArg::P(positions.ptr_min(OP, "positions [n]", n)?),
            KArg::P(slots.ptr_min(OP, "slots [n]", n)?),
            KArg::U(p.q_heads as u32),
            KArg::U(kv.kv_heads as u32),
            KArg::U(hd as u32),
            KArg::U(p.rot_dim as u32),
            KArg::P(freq),
            KArg::U(kv.capacity as u32),
            KArg::U(kv.num_slots as u32),
            KArg::P(p.rope_pos),
            // qkv_post_f8 only: each kv head's largest |k| and |v| (calibrate_fp8), or null
            KArg::P(p.amax),
        ];
        let args = &args[..args.len() - usize::from(!kv.fp8)];
        // QKV_POST_HEADS (decode_fused.cu) heads a block, a warp each
        const HEADS: usize = 8;
        let grid = (
            u32_of(OP, "n_tokens", n)?,
            u32_of(OP, "heads", (p.q_heads + 2 * kv.kv_heads).div_ceil(HEADS))?,
            1,
        );
        self.launch(
            crate::kernels::kv_kernel("qkv_post_bf16", kv.fp8),
            grid,
            (32 * HEADS as u32, 1, 1),
            0,
            args,
        )
    }

    /// Reads `p` once (16-byte loads, a grid of 8 blocks of 256 a SM), writing nothing but a
    /// never-taken store into `sink` (>= that many words): the pure read rate that a GEMV
    /// over the same bytes could reach at most (examples/cuda_bench.rs `gemv`).
    pub fn stream_read_bench(
        &self,
        p: &GpuBuffer<bf16>,
        sink: &mut GpuBuffer<u32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "stream_read_bench";
        let grid = self.sm_count() * 8;
        let args = [
            KArg::P(p.ptr_min(OP, "p", 8)?),
            KArg::P((p.len() / 8) as u64),
            KArg::P(sink.ptr_min(OP, "sink", grid as usize)?),
        ];
        self.launch(OP, (grid, 1, 1), (256, 1, 1), 0, &args)
    }
}
