//! RMSNorm (plain, fused with residual add, Gemma sandwich form), per-head q/k RMSNorm and
//! NeoX RoPE.

use half::bf16;

use super::u32_of;
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// RMSNorm settings.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub eps: f32,
    /// Gemma stores `w - 1`: scale by `(1 + w)`.
    pub gemma: bool,
}

/// Rotary embedding settings (NeoX rotate-half layout).
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    /// Base, e.g. 10000 or 1e6.
    pub theta: f32,
    /// Leading dimensions rotated (== head_dim for full rotary).
    pub rot_dim: usize,
    /// Linear position scaling: angle = pos / pos_scale * theta^(-2i/rot_dim).
    pub pos_scale: f32,
}

impl CudaContext {
    /// `out = rmsnorm(x) * w`; x, out [rows, dim], w [dim] f32.
    pub fn rmsnorm(
        &self,
        x: &GpuBuffer<bf16>,
        w: &GpuBuffer<f32>,
        out: &mut GpuBuffer<bf16>,
        rows: usize,
        dim: usize,
        cfg: RmsNorm,
    ) -> Result<(), CudaError> {
        let n = rows * dim;
        let (px, pw, po) = (
            x.ptr_min("rmsnorm", "x", n)?,
            w.ptr_min("rmsnorm", "w", dim)?,
            out.ptr_min("rmsnorm", "out", n)?,
        );
        self.launch_rmsnorm(px, 0, 0, pw, po, rows, dim, cfg)
    }

    /// Residual add fused with the next norm:
    /// `residual += post_w.map_or(x, |pw| rmsnorm(x) * pw); out = rmsnorm(residual) * w`.
    /// The `post_w` form is Gemma's sandwich norm (post-attention / post-MLP norm).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        x: &GpuBuffer<bf16>,
        residual: &mut GpuBuffer<bf16>,
        post_w: Option<&GpuBuffer<f32>>,
        w: &GpuBuffer<f32>,
        out: &mut GpuBuffer<bf16>,
        rows: usize,
        dim: usize,
        cfg: RmsNorm,
    ) -> Result<(), CudaError> {
        const OP: &str = "add_rmsnorm";
        let n = rows * dim;
        let px = x.ptr_min(OP, "x", n)?;
        let pr = residual.ptr_min(OP, "residual", n)?;
        let ppw = match post_w {
            Some(b) => b.ptr_min(OP, "post_w", dim)?,
            None => 0,
        };
        let (pw, po) = (w.ptr_min(OP, "w", dim)?, out.ptr_min(OP, "out", n)?);
        self.launch_rmsnorm(px, pr, ppw, pw, po, rows, dim, cfg)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_rmsnorm(
        &self,
        x: u64,
        res: u64,
        post_w: u64,
        w: u64,
        out: u64,
        rows: usize,
        dim: usize,
        cfg: RmsNorm,
    ) -> Result<(), CudaError> {
        const OP: &str = "rmsnorm";
        if dim == 0 || cfg.eps.is_nan() || cfg.eps < 0.0 {
            return Err(CudaError::bad(OP, format!("dim {dim}, eps {}", cfg.eps)));
        }
        let args = [
            KArg::P(x),
            KArg::P(res),
            KArg::P(post_w),
            KArg::P(w),
            KArg::P(out),
            KArg::U(u32_of(OP, "dim", dim)?),
            KArg::F(cfg.eps),
            KArg::U(cfg.gemma as u32),
        ];
        let threads = if dim >= 2048 { 512 } else { 256 };
        self.launch(
            "rmsnorm_bf16",
            (u32_of(OP, "rows", rows)?, 1, 1),
            (threads, 1, 1),
            0,
            &args,
        )
    }

    /// In-place RMSNorm of every head vector: x [rows, head_dim] (rows = tokens * heads), w [head_dim].
    pub fn head_rmsnorm(
        &self,
        x: &mut GpuBuffer<bf16>,
        w: &GpuBuffer<f32>,
        rows: usize,
        head_dim: usize,
        cfg: RmsNorm,
    ) -> Result<(), CudaError> {
        const OP: &str = "head_rmsnorm";
        let args = [
            KArg::P(x.ptr_min(OP, "x [rows, head_dim]", rows * head_dim)?),
            KArg::P(w.ptr_min(OP, "w [head_dim]", head_dim)?),
            KArg::U(u32_of(OP, "rows", rows)?),
            KArg::U(u32_of(OP, "head_dim", head_dim)?),
            KArg::F(cfg.eps),
            KArg::U(cfg.gemma as u32),
        ];
        self.launch(
            "head_rmsnorm_bf16",
            (rows.div_ceil(4) as u32, 1, 1),
            (128, 1, 1),
            0,
            &args,
        )
    }

    /// NeoX RoPE in place on q [n, q_heads, head_dim] and (optionally) k [n, k_heads, head_dim]
    /// at `positions` [n].
    #[allow(clippy::too_many_arguments)]
    pub fn rope_neox(
        &self,
        q: &mut GpuBuffer<bf16>,
        k: Option<&mut GpuBuffer<bf16>>,
        positions: &GpuBuffer<u32>,
        n: usize,
        q_heads: usize,
        k_heads: usize,
        head_dim: usize,
        rope: Rope,
    ) -> Result<(), CudaError> {
        self.rope_neox_with(q, k, positions, n, q_heads, k_heads, head_dim, rope, None)
    }

    /// [`CudaContext::rope_neox`] with an explicit inverse-frequency table `inv_freq`
    /// [rot_dim/2] (f64) replacing `theta` / `pos_scale` when given (Llama 3 scaling,
    /// GGUF `rope_freqs`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_neox_with(
        &self,
        q: &mut GpuBuffer<bf16>,
        k: Option<&mut GpuBuffer<bf16>>,
        positions: &GpuBuffer<u32>,
        n: usize,
        q_heads: usize,
        k_heads: usize,
        head_dim: usize,
        rope: Rope,
        inv_freq: Option<&GpuBuffer<f64>>,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_neox";
        if rope.rot_dim == 0
            || rope.rot_dim % 2 != 0
            || rope.rot_dim > head_dim
            || rope.rot_dim > 2048
        {
            return Err(CudaError::bad(
                OP,
                format!("rot_dim {} with head_dim {head_dim}", rope.rot_dim),
            ));
        }
        if rope.theta.is_nan()
            || rope.theta <= 0.0
            || rope.pos_scale.is_nan()
            || rope.pos_scale <= 0.0
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "theta {} / pos_scale {} must be positive",
                    rope.theta, rope.pos_scale
                ),
            ));
        }
        let pk = match k {
            Some(b) => b.ptr_min(OP, "k [n, k_heads, head_dim]", n * k_heads * head_dim)?,
            None => 0,
        };
        let heads = q_heads + if pk != 0 { k_heads } else { 0 };
        let args = [
            KArg::P(q.ptr_min(OP, "q [n, q_heads, head_dim]", n * q_heads * head_dim)?),
            KArg::P(pk),
            KArg::P(positions.ptr_min(OP, "positions [n]", n)?),
            KArg::U(u32_of(OP, "q_heads", q_heads)?),
            KArg::U(u32_of(OP, "k_heads", k_heads)?),
            KArg::U(u32_of(OP, "head_dim", head_dim)?),
            KArg::U(rope.rot_dim as u32),
            KArg::F(rope.theta),
            KArg::F(rope.pos_scale),
            KArg::P(match inv_freq {
                Some(t) => t.ptr_min(OP, "inv_freq [rot_dim/2]", rope.rot_dim / 2)?,
                None => 0,
            }),
        ];
        let block = (rope.rot_dim / 2).div_ceil(32) * 32;
        self.launch(
            "rope_neox_bf16",
            (u32_of(OP, "n", n)?, heads as u32, 1),
            (block as u32, 1, 1),
            0,
            &args,
        )
    }
}
