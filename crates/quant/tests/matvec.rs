//! matvec kernels (every type x every instruction set available here x both dot paths) against
//! the f64 reference, on fresh random inputs with odd row counts.
#![allow(clippy::needless_range_loop)] // index loops read clearer in these checks

mod common;

use common::{dot_types, random_matrix, Rng};
use slowfast_quant::{
    matvec, matvec_batch, matvec_into, matvec_reference, matvec_rows, matvec_with, DotPath,
    GgmlType, Isa, MatvecScratch, QMatrix,
};

/// Values sharing one activation scale for `ty` (the activation quantization block).
fn act_block(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q8_0
        | GgmlType::Q5_0
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_1
        | GgmlType::IQ4_NL => Some(32),
        GgmlType::Q4_K
        | GgmlType::Q6_K
        | GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q5_K
        | GgmlType::IQ4_XS => Some(256),
        _ => None,
    }
}

/// Error bound of the quantized-dot path against the exact dot of the dequantized weights:
/// activation rounding (half a step, amax/127 per block) times |w|, plus f32 summation error.
fn bound(w: &QMatrix, r: usize, x: &[f32], path: DotPath) -> f64 {
    let mut row = vec![0.0f32; w.cols];
    w.dequantize_row(r, &mut row).unwrap();
    let abs: f64 = row.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
    let mut tol = 2e-5 * abs + 1e-6;
    if let (Some(bs), DotPath::Quantized) = (act_block(w.ty), path) {
        for (wb, xb) in row.chunks(bs).zip(x.chunks(bs)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            let wsum: f64 = wb.iter().map(|v| v.abs() as f64).sum();
            tol += wsum * amax / 127.0 * 0.5 * 1.001;
        }
    }
    tol
}

/// `x` after the activation quantization the quantized path applies (round(x * 127 / amax)
/// per block, times amax / 127), so the kernel can be checked to f32 rounding.
fn quantized_activation(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let Some(bs) = act_block(ty) else {
        return x.to_vec();
    };
    let mut out = Vec::with_capacity(x.len());
    for xb in x.chunks(bs) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        // Q8_0 activation scales are stored as f16, as ggml does; Q8_K keeps f32.
        let d = if bs == 32 {
            half::f16::from_f32(amax / 127.0).to_f32()
        } else {
            amax / 127.0
        };
        out.extend(xb.iter().map(|v| (v * id).round_ties_even() * d));
    }
    out
}

/// f64 dot of dequantized row `r` with `x`, and the f32-rounding tolerance for it.
fn exact_dot(w: &QMatrix, r: usize, x: &[f32]) -> (f64, f64) {
    let mut row = vec![0.0f32; w.cols];
    w.dequantize_row(r, &mut row).unwrap();
    let dot = row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let abs: f64 = row.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
    (dot, 2e-5 * abs + 1e-6)
}

#[test]
fn quantized_kernels_match_reference_on_the_quantized_activation() {
    let mut rng = Rng::fresh("quantized_kernels_match_reference_on_the_quantized_activation");
    let mut scratch = MatvecScratch::new();
    for (ty, colss) in dot_types() {
        for cols in colss {
            let rows = 67;
            let data = random_matrix(&mut rng, ty, rows, cols);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let x = rng.vec(cols);
            let xq = quantized_activation(ty, &x);
            for isa in Isa::available() {
                let mut y = vec![f32::NAN; rows];
                let path = DotPath::Quantized;
                matvec_with(&w, &x, 1, 0..rows, &mut y, &mut scratch, path, isa).unwrap();
                for r in 0..rows {
                    let (want, tol) = exact_dot(&w, r, &xq);
                    let err = (y[r] as f64 - want).abs();
                    assert!(
                        err <= tol,
                        "{ty} {isa:?} {rows}x{cols} row {r}: got {}, want {want}, err {err:e}",
                        y[r]
                    );
                }
            }
        }
    }
}

#[test]
fn every_kernel_matches_reference() {
    let mut rng = Rng::fresh("every_kernel_matches_reference");
    let mut scratch = MatvecScratch::new();
    for (ty, colss) in dot_types() {
        for cols in colss {
            // 37 rows: sequential path; 301 rows of 640+ columns: the parallel path.
            for rows in [37usize, 301] {
                let data = random_matrix(&mut rng, ty, rows, cols);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                let x = rng.vec(cols);
                let mut want = vec![0.0f32; rows];
                matvec_reference(&w, &x, &mut want).unwrap();
                for isa in Isa::available() {
                    for path in [DotPath::Quantized, DotPath::Dequantized] {
                        let mut y = vec![f32::NAN; rows];
                        matvec_with(&w, &x, 1, 0..rows, &mut y, &mut scratch, path, isa).unwrap();
                        for r in 0..rows {
                            let tol = bound(&w, r, &x, path);
                            let err = (y[r] as f64 - want[r] as f64).abs();
                            assert!(
                                err <= tol,
                                "{ty} {isa:?} {path:?} {rows}x{cols} row {r}: got {}, want {}, \
                                 err {err:e} > tol {tol:e}",
                                y[r],
                                want[r]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simd_equals_scalar_integer_sums() {
    // Same integer block sums, only the f32 accumulation order differs.
    let mut rng = Rng::fresh("simd_equals_scalar_integer_sums");
    let mut scratch = MatvecScratch::new();
    for (ty, colss) in dot_types() {
        let cols = *colss.last().unwrap();
        let rows = 129;
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x = rng.vec(cols);
        let mut base = vec![0.0f32; rows];
        matvec_with(
            &w,
            &x,
            1,
            0..rows,
            &mut base,
            &mut scratch,
            DotPath::Quantized,
            Isa::Scalar,
        )
        .unwrap();
        for isa in Isa::available() {
            let mut y = vec![0.0f32; rows];
            matvec_with(
                &w,
                &x,
                1,
                0..rows,
                &mut y,
                &mut scratch,
                DotPath::Quantized,
                isa,
            )
            .unwrap();
            for r in 0..rows {
                let tol = bound(&w, r, &x, DotPath::Dequantized);
                let err = (y[r] - base[r]).abs() as f64;
                assert!(
                    err <= tol,
                    "{ty} {isa:?} row {r}: {} vs scalar {}",
                    y[r],
                    base[r]
                );
            }
        }
    }
}

#[test]
fn rows_batch_and_default_agree_bitwise() {
    let mut rng = Rng::fresh("rows_batch_and_default_agree_bitwise");
    let mut scratch = MatvecScratch::new();
    for (ty, colss) in dot_types() {
        let cols = *colss.last().unwrap();
        let rows = 203;
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let n = 3;
        let x = rng.vec(n * cols); // [n, cols]
        let mut full = vec![0.0f32; rows];
        matvec(&w, &x[..cols], &mut full).unwrap();
        let mut again = vec![0.0f32; rows];
        matvec_into(&w, &x[..cols], &mut again, &mut scratch).unwrap();
        assert_eq!(full, again, "{ty}: matvec vs matvec_into");
        let mut part = vec![0.0f32; 50];
        matvec_rows(&w, &x[..cols], 101..151, &mut part, &mut scratch).unwrap();
        assert_eq!(&full[101..151], &part[..], "{ty}: matvec_rows");
        let mut yb = vec![0.0f32; n * rows]; // [n, rows]
        matvec_batch(&w, &x, n, &mut yb, &mut scratch).unwrap();
        for i in 0..n {
            let mut yi = vec![0.0f32; rows];
            matvec_into(&w, &x[i * cols..(i + 1) * cols], &mut yi, &mut scratch).unwrap();
            assert_eq!(
                &yb[i * rows..(i + 1) * rows],
                &yi[..],
                "{ty}: batch row {i}"
            );
        }
    }
}

#[test]
fn q8_k_weights_fall_back_to_dequantized_dots() {
    let mut rng = Rng::fresh("q8_k_weights_fall_back_to_dequantized_dots");
    let (rows, cols) = (9, 512);
    let data = random_matrix(&mut rng, GgmlType::Q8_K, rows, cols);
    let w = QMatrix::new(GgmlType::Q8_K, rows, cols, &data).unwrap();
    let x = rng.vec(cols);
    let (mut y, mut want) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    matvec(&w, &x, &mut y).unwrap();
    matvec_reference(&w, &x, &mut want).unwrap();
    for r in 0..rows {
        let tol = bound(&w, r, &x, DotPath::Dequantized);
        assert!(
            ((y[r] - want[r]).abs() as f64) <= tol,
            "row {r}: {} vs {}",
            y[r],
            want[r]
        );
    }
}
