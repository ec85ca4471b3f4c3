//! Prefill path: `Y = X Wᵀ` for many activation rows, by dequantizing tiles of weight rows to f32
//! and running an f32 GEMM (`gemm` crate); small batches go to the quantized-dot matvec instead.

use crate::dequant_simd::dequantize_fast;
use crate::dot::Isa;
use crate::matvec::{matvec_with, DotPath, MatvecScratch, QMatrix};
use crate::types::GgmlType;
use crate::QuantError;
use rayon::prelude::*;

/// Batch size from which `matmul` switches from quantized dots to dequant + GEMM, per weight
/// type. Measured by `cargo bench -p slowfast-quant` (see docs/quant-kernels.md).
pub fn gemm_crossover(ty: GgmlType) -> usize {
    match ty {
        // Measured on 2 Zen 4 cores: quantized dots win up to n = 64 on 1024->3072, GEMM at 128.
        GgmlType::Q4_K | GgmlType::Q6_K => 96,
        // Legacy quants and floats: quantized dots win at n = 16, GEMM from n = 32.
        _ => 32,
    }
}

/// `y = x Wᵀ`: `x` is `[n, cols]`, `y` is `[n, rows]`. Dispatches on `n`: below
/// [`gemm_crossover`] it runs the batched quantized-dot matvec, otherwise dequant + GEMM.
pub fn matmul(w: &QMatrix, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), QuantError> {
    if n < gemm_crossover(w.ty) {
        let rows = 0..w.rows;
        let mut scratch = MatvecScratch::new();
        matvec_with(
            w,
            x,
            n,
            rows,
            y,
            &mut scratch,
            DotPath::Quantized,
            Isa::best(),
        )
    } else {
        matmul_gemm(w, x, n, y)
    }
}

/// Dequantized weight rows per GEMM tile, aiming at a ~256 KiB f32 tile that stays in L2.
fn tile_rows(w: &QMatrix, threads: usize) -> usize {
    let by_cache = (64 * 1024 / w.cols.max(1)).clamp(16, 512);
    let by_threads = w.rows.div_ceil(threads * 2).max(16);
    by_cache.min(by_threads).next_multiple_of(16)
}

/// `y = x Wᵀ` always by dequantizing weight tiles and an f32 GEMM (parallel over tiles).
pub fn matmul_gemm(w: &QMatrix, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), QuantError> {
    let rb = w.validate()?;
    if !w.ty.is_supported() {
        return Err(w.ty.unsupported("matmul"));
    }
    QuantError::check_len("matmul x", "values", n * w.cols, x.len())?;
    QuantError::check_len("matmul y", "values", n * w.rows, y.len())?;
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    if w.cols == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let (rows, cols) = (w.rows, w.cols);
    let tr = tile_rows(w, rayon::current_num_threads());
    let isa = Isa::best();
    let ntiles = rows.div_ceil(tr);
    let yp = SyncPtr(y.as_mut_ptr());
    (0..ntiles)
        .into_par_iter()
        .for_each_init(Vec::new, |tile: &mut Vec<f32>, t| {
            let r0 = t * tr;
            let r1 = (r0 + tr).min(rows);
            let m = r1 - r0;
            tile.resize(m * cols, 0.0); // [m, cols]
            for (r, dst) in (r0..r1).zip(tile.chunks_exact_mut(cols)) {
                dequantize_fast(isa, w.ty, &w.data[r * rb..(r + 1) * rb], dst);
            }
            // SAFETY: dst is y[:, r0..r1] ([n, rows] row-major, row stride `rows`), disjoint per tile;
            // lhs is x [n, cols]; rhs[k, j] = tile[j, k] ([cols, m] with column stride `cols`).
            unsafe {
                gemm::gemm(
                    n,
                    m,
                    cols,
                    yp.get().add(r0),
                    1,
                    rows as isize,
                    false,
                    x.as_ptr(),
                    1,
                    cols as isize,
                    tile.as_ptr(),
                    cols as isize,
                    1,
                    0.0f32,
                    1.0f32,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    Ok(())
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: each tile task writes its own disjoint columns of y; y outlives the parallel loop.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the raw field).
    fn get(self) -> *mut f32 {
        self.0
    }
}
