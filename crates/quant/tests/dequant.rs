//! SIMD dequantization is bit-identical to the scalar ggml-order code, for every type and
//! instruction set, on fresh random rows (including the odd tails of the float types).
#![allow(clippy::needless_range_loop)] // index loops read clearer in these checks

mod common;

use common::{f16_scale_offsets, random_matrix, Rng};
use slowfast_quant::{dequantize_row_with, GgmlType, Isa};

#[test]
fn simd_dequant_is_bit_identical() {
    let mut rng = Rng::fresh("simd_dequant_is_bit_identical");
    let cases = [
        (GgmlType::F32, 77),
        (GgmlType::F16, 83),
        (GgmlType::BF16, 91),
        (GgmlType::Q8_0, 640),
        (GgmlType::Q5_0, 640),
        (GgmlType::Q4_0, 320),
        (GgmlType::Q4_K, 1024),
        (GgmlType::Q6_K, 1024),
        (GgmlType::Q8_K, 512),
        (GgmlType::Q4_1, 320),
        (GgmlType::Q5_1, 640),
        (GgmlType::IQ4_NL, 640),
        (GgmlType::Q2_K, 1024),
        (GgmlType::Q3_K, 1024),
        (GgmlType::Q5_K, 1024),
        (GgmlType::IQ4_XS, 1024),
    ];
    for (ty, cols) in cases {
        let mut data = random_matrix(&mut rng, ty, 3, cols);
        // Also raw random bytes for the integer formats (every scale / bit pattern).
        if ty.block_size() > 1 {
            let d_off = f16_scale_offsets(ty);
            let ts = ty.type_size();
            let rb = ty.row_bytes(cols).unwrap();
            for byte in data[rb..].iter_mut() {
                *byte = rng.next_u64() as u8;
            }
            for blk in data[rb..].chunks_exact_mut(ts) {
                for &o in d_off {
                    let d = half::f16::from_f32(rng.f32() * 0.1).to_bits().to_le_bytes();
                    blk[o..o + 2].copy_from_slice(&d);
                }
                if ty == GgmlType::Q8_K {
                    blk[..4].copy_from_slice(&(rng.f32() * 0.01).to_le_bytes());
                }
            }
        }
        let rb = ty.row_bytes(cols).unwrap();
        for row in data.chunks_exact(rb) {
            let mut want = vec![0.0f32; cols];
            dequantize_row_with(Isa::Scalar, ty, row, &mut want).unwrap();
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; cols];
                dequantize_row_with(isa, ty, row, &mut got).unwrap();
                for i in 0..cols {
                    assert_eq!(got[i].to_bits(), want[i].to_bits(), "{ty} {isa:?} [{i}]");
                }
            }
        }
    }
}
