//! cuBLAS GEMM for linear layers: `Y[n, out] = X[n, in] · W[out, in]^T`, bf16 operands, f32
//! accumulation, bf16 or f32 output.

use std::ffi::c_void;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use half::bf16;

use crate::buffer::{GpuBuffer, GpuElem};
use crate::context::CudaContext;
use crate::error::CudaError;
use crate::ops::fused::MMA_MAX_ROWS;

/// Output element types of [`CudaContext::linear`].
pub trait GemmOut: GpuElem {
    #[doc(hidden)]
    const CUDA_TYPE: cudaDataType;
}
impl GemmOut for bf16 {
    const CUDA_TYPE: cudaDataType = cudaDataType::CUDA_R_16BF;
}
impl GemmOut for f32 {
    const CUDA_TYPE: cudaDataType = cudaDataType::CUDA_R_32F;
}

/// The device addresses of a linear layer's `x [n, in]`, `w [out, in]` and `y [n, out]`,
/// each checked to hold its shape.
fn linear_ptrs<O: GemmOut>(
    op: &'static str,
    x: &GpuBuffer<bf16>,
    w: &GpuBuffer<bf16>,
    y: &mut GpuBuffer<O>,
    n: usize,
    in_features: usize,
    out_features: usize,
) -> Result<(u64, u64, u64), CudaError> {
    Ok((
        x.ptr_min(op, "x [n, in]", n * in_features)?,
        w.ptr_min(op, "w [out, in]", out_features * in_features)?,
        y.ptr_min(op, "y [n, out]", n * out_features)?,
    ))
}

/// Whether the GEMV kernels can write `out_type` for `in` inputs (bf16 or f32, `in` a multiple
/// of 8).
fn gemv_fits(out_type: cudaDataType, in_features: usize) -> bool {
    in_features % 8 == 0
        && matches!(
            out_type,
            cudaDataType::CUDA_R_16BF | cudaDataType::CUDA_R_32F
        )
}

impl CudaContext {
    /// `y[n, out] = x[n, in] · w[out, in]^T` (row-major everywhere), f32 accumulation.
    pub fn linear<O: GemmOut>(
        &self,
        x: &GpuBuffer<bf16>,
        w: &GpuBuffer<bf16>,
        y: &mut GpuBuffer<O>,
        n: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "linear";
        let lim = i32::MAX as usize;
        if n == 0
            || in_features == 0
            || out_features == 0
            || n > lim
            || in_features > lim
            || out_features > lim
        {
            return Err(CudaError::bad(
                OP,
                format!("shape n={n}, in={in_features}, out={out_features}"),
            ));
        }
        let (px, pw, py) = linear_ptrs(OP, x, w, y, n, in_features, out_features)?;
        self.linear_raw(px, pw, py, O::CUDA_TYPE, n, in_features, out_features)
    }

    /// [`CudaContext::linear`] on raw device addresses (shapes checked by the caller).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_raw(
        &self,
        px: u64,
        pw: u64,
        py: u64,
        out_type: cudaDataType,
        n: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "linear";
        if n <= self.gemv_max_rows && gemv_fits(out_type, in_features) {
            return self.gemv_raw(px, pw, py, out_type, n, in_features, out_features);
        }
        if n <= self.gemv_mma_rows() && gemv_fits(out_type, in_features) {
            return self.gemv_mma_raw(px, pw, py, out_type, n, in_features, out_features);
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: Y^T[out, n] = W[out, in] · X^T[in, n], with W read transposed
        // from its column-major [in, out] storage.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                out_features as i32,
                n as i32,
                in_features as i32,
                &alpha as *const f32 as *const c_void,
                pw as *const c_void,
                cudaDataType::CUDA_R_16BF,
                in_features as i32,
                px as *const c_void,
                cudaDataType::CUDA_R_16BF,
                in_features as i32,
                &beta as *const f32 as *const c_void,
                py as *mut c_void,
                out_type,
                out_features as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| CudaError::Blas {
            op: OP,
            reason: format!("cublasGemmEx: {e:?}"),
        })
    }

    /// The weight-streaming GEMV (kernels/gemv.cu) for `n` <= 8 rows: `y[n, out] = x[n, in] ·
    /// w[out, in]^T`, f32 accumulation, bf16 or f32 output; `in` a multiple of 8.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_raw(
        &self,
        px: u64,
        pw: u64,
        py: u64,
        out_type: cudaDataType,
        n: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<(), CudaError> {
        // 1-2 rows run the fused GEMV's plain entries (below), 3-8 these.
        const NAMES: [&str; 6] = [
            "gemv_bf16_n3",
            "gemv_bf16_n4",
            "gemv_bf16_n5",
            "gemv_bf16_n6",
            "gemv_bf16_n7",
            "gemv_bf16_n8",
        ];
        if n == 0 || n > 8 || in_features % 8 != 0 {
            return Err(CudaError::bad(
                "gemv",
                format!("{n} rows (1..=8), in = {in_features} (a multiple of 8)"),
            ));
        }
        let f32_out = (out_type == cudaDataType::CUDA_R_32F) as u32;
        if n <= crate::ops::fused::FUSED_MAX_ROWS {
            // The fused GEMV's plain entries (same product, flag 1: f32 out).
            use crate::context::KArg;
            let args = [
                KArg::P(px),
                KArg::P(0),
                KArg::P(pw),
                KArg::P(py),
                KArg::U(in_features as u32),
                KArg::U(out_features as u32),
                KArg::U(f32_out),
                KArg::F(0.0),
            ];
            return self.gemv_launch(n, 0, out_features, &args);
        }
        // Four output rows a block (GEMV_GR in kernels/gemv.cu).
        let blocks = u32::try_from(out_features.div_ceil(4))
            .map_err(|_| CudaError::bad("gemv", format!("{out_features} output rows")))?;
        self.launch(
            NAMES[n - 3],
            (blocks, 1, 1),
            (256, 1, 1),
            0,
            &[
                crate::context::KArg::P(px),
                crate::context::KArg::P(pw),
                crate::context::KArg::P(py),
                crate::context::KArg::U(in_features as u32),
                crate::context::KArg::U(out_features as u32),
                crate::context::KArg::U(f32_out),
            ],
        )
    }

    /// The tensor-core GEMV (kernels/gemv.cu `gemv_mma_fused_m0`) for 1..=8 rows: `y[n, out] =
    /// x[n, in] · w[out, in]^T`, f32 accumulation, bf16 or f32 output; `in` a multiple of 8.
    /// `linear` runs it at `SLOWFAST_GEMV_MAX_ROWS` < n <= `SLOWFAST_GEMV_MMA_ROWS`.
    #[doc(hidden)]
    pub fn gemv_mma<O: GemmOut>(
        &self,
        x: &GpuBuffer<bf16>,
        w: &GpuBuffer<bf16>,
        y: &mut GpuBuffer<O>,
        n: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemv_mma";
        if n == 0
            || n > MMA_MAX_ROWS
            || in_features == 0
            || out_features == 0
            || in_features % 8 != 0
        {
            return Err(CudaError::bad(
                OP,
                format!("{n} rows (1..={MMA_MAX_ROWS}), in = {in_features} (a positive multiple of 8), out = {out_features}"),
            ));
        }
        let (px, pw, py) = linear_ptrs(OP, x, w, y, n, in_features, out_features)?;
        self.gemv_mma_raw(px, pw, py, O::CUDA_TYPE, n, in_features, out_features)
    }

    /// The plain tensor-core GEMV (`gemv_mma_fused_m0`, no norm, bf16 or f32 out).
    #[allow(clippy::too_many_arguments)]
    fn gemv_mma_raw(
        &self,
        px: u64,
        pw: u64,
        py: u64,
        out_type: cudaDataType,
        n: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<(), CudaError> {
        let f32_out = (out_type == cudaDataType::CUDA_R_32F) as u32;
        let ptrs = [px, 0, pw, py];
        self.gemv_mma_launch(0, ptrs, n, in_features, out_features, f32_out, 0.0)
    }
}
