//! quantize_row -> dequantize_row round trips stay within each format's error bound.

mod common;

use common::Rng;
use slowfast_quant::{dequantize_row, quantize_row, GgmlType};

/// Max error allowed relative to the block's max |x| (half a quantization step, with slack for
/// the f16/6-bit/8-bit scale rounding of each format).
fn rel_bound(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => 1.0 / 2048.0,
        GgmlType::BF16 => 1.0 / 256.0,
        GgmlType::Q8_K => 0.5 / 127.0 * 1.01,
        // + the f16 rounding of the block scale
        GgmlType::Q8_0 => 0.5 / 127.0 * 1.01 + 1.0 / 2048.0,
        GgmlType::Q6_K => 0.06,
        // ggml's Q5_0/Q4_0 map the signed max to -16/-8, so a value of the opposite sign near
        // the max clips to +15/+7: a full step.
        GgmlType::Q5_0 => 1.0 / 16.0 * 1.01 + 1.0 / 2048.0,
        GgmlType::Q4_0 => 1.0 / 8.0 * 1.01 + 1.0 / 2048.0,
        GgmlType::Q4_K => 0.2,
        _ => unreachable!(),
    }
}

#[test]
fn round_trip_error_is_bounded() {
    let mut rng = Rng::fresh("round_trip_error_is_bounded");
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q8_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
    ];
    for ty in types {
        let n = 1024;
        let x = rng.vec(n);
        let mut q = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut back = vec![0.0f32; n];
        dequantize_row(ty, &q, &mut back).unwrap();
        let bs = ty.block_size().max(32);
        let mut sq = 0.0f64;
        for (xb, yb) in x.chunks(bs).zip(back.chunks(bs)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (a, b) in xb.iter().zip(yb) {
                let mut tol = if ty.block_size() == 1 { a.abs() } else { amax } * rel_bound(ty);
                if ty == GgmlType::F16 {
                    // Below 2^-14 f16 is subnormal: a fixed spacing of 2^-24, half of it absolute.
                    tol = tol.max(2f32.powi(-25));
                }
                assert!((a - b).abs() <= tol, "{ty}: {a} -> {b} (block amax {amax})");
                sq += ((a - b) as f64).powi(2);
            }
        }
        let rms = (sq / n as f64).sqrt();
        println!("{ty}: round-trip rms error {rms:.2e}");
    }
}

#[test]
fn zero_blocks_stay_zero() {
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q8_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
    ] {
        let x = vec![0.0f32; 256];
        let mut q = vec![0xAAu8; ty.row_bytes(256).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut back = vec![1.0f32; 256];
        dequantize_row(ty, &q, &mut back).unwrap();
        assert!(
            back.iter().all(|&v| v == 0.0),
            "{ty}: zeros came back as {back:?}"
        );
    }
}
