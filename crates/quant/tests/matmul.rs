//! Prefill matmul (dequant tiles + GEMM) against matvec, and the automatic dispatch.

mod common;

use common::{dot_types, random_matrix, Rng};
use slowfast_quant::{
    gemm_crossover, matmul, matmul_gemm, matvec_batch, matvec_with, DotPath, Isa, MatvecScratch,
    QMatrix,
};

#[test]
fn gemm_matches_dequantized_matvec() {
    let mut rng = Rng::fresh("gemm_matches_dequantized_matvec");
    let mut scratch = MatvecScratch::new();
    for (ty, colss) in dot_types() {
        let cols = *colss.last().unwrap();
        for (rows, n) in [(77usize, 1usize), (301, 13)] {
            let data = random_matrix(&mut rng, ty, rows, cols);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let x = rng.vec(n * cols); // [n, cols]
            let mut y = vec![f32::NAN; n * rows]; // [n, rows]
            matmul_gemm(&w, &x, n, &mut y).unwrap();
            let mut want = vec![0.0f32; n * rows];
            let path = DotPath::Dequantized;
            matvec_with(
                &w,
                &x,
                n,
                0..rows,
                &mut want,
                &mut scratch,
                path,
                Isa::best(),
            )
            .unwrap();
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                let tol = 1e-4 * (1.0 + b.abs());
                assert!(
                    (a - b).abs() <= tol,
                    "{ty} {rows}x{cols} n={n} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn matmul_dispatches_small_batches_to_quantized_dots() {
    let mut rng = Rng::fresh("matmul_dispatches_small_batches_to_quantized_dots");
    let mut scratch = MatvecScratch::new();
    for (ty, colss) in dot_types() {
        let cols = colss[0];
        let rows = 45;
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let n = gemm_crossover(ty) - 1;
        let x = rng.vec(n * cols);
        let (mut y, mut want) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
        matmul(&w, &x, n, &mut y).unwrap();
        matvec_batch(&w, &x, n, &mut want, &mut scratch).unwrap();
        assert_eq!(
            y, want,
            "{ty}: matmul below the crossover is the batched matvec"
        );
        let n = gemm_crossover(ty);
        let x = rng.vec(n * cols);
        let (mut y, mut want) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
        matmul(&w, &x, n, &mut y).unwrap();
        matmul_gemm(&w, &x, n, &mut want).unwrap();
        assert_eq!(y, want, "{ty}: matmul at the crossover is dequant + GEMM");
    }
}
