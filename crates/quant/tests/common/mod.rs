//! Shared test helpers: a seeded xorshift RNG (seed printed, override with SLOWFAST_TEST_SEED)
//! and random quantized matrices.
#![allow(dead_code)]

use slowfast_quant::{quantize_row, GgmlType};

pub struct Rng(u64);

impl Rng {
    /// A fresh generator; the seed comes from SLOWFAST_TEST_SEED or the clock and is printed so
    /// a failure can be replayed.
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("SLOWFAST_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("{test}: SLOWFAST_TEST_SEED={seed}");
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15 | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Roughly normal (sum of uniforms), with occasional outliers like real activations.
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.f32()).sum::<f32>() * 0.85;
        if self.next_u64().is_multiple_of(97) {
            s * 8.0
        } else {
            s
        }
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// Byte offsets of the f16 scales (and mins) inside one block of `ty`.
pub fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::Q8_K => &[],
        _ => &[0],
    }
}

/// The largest |sub-block scale * quant| of `ty` (so random scales can keep |w| near 0.1).
fn max_scaled_quant(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q4_1 => 15.0,
        GgmlType::Q5_1 => 31.0,
        GgmlType::IQ4_NL => 127.0,
        GgmlType::Q2_K => 45.0,
        GgmlType::Q3_K => 128.0,
        GgmlType::Q5_K => 63.0 * 31.0,
        GgmlType::IQ4_XS => 32.0 * 127.0,
        _ => 16.0,
    }
}

/// `rows` rows of `cols` values of `ty` made of random bytes with sane f16 scales (finite,
/// sized so |w| <= ~0.1 like the quantized test matrices; small ones are f16 subnormals): every
/// bit pattern of the quants, sub-block scales and masks.
pub fn random_blocks(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut data: Vec<u8> = (0..rows * rb).map(|_| rng.next_u64() as u8).collect();
    let amp = 0.1 / max_scaled_quant(ty);
    for blk in data.chunks_exact_mut(ty.type_size()) {
        for &o in f16_scale_offsets(ty) {
            let d = half::f16::from_f32(rng.f32() * amp).to_bits().to_le_bytes();
            blk[o..o + 2].copy_from_slice(&d);
        }
    }
    data
}

/// A random `rows x cols` matrix quantized to `ty` (row-major ggml bytes); random blocks
/// (`random_blocks`) for the types `quantize_row` does not support.
pub fn random_matrix(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut data = vec![0u8; rows * rb];
    let probe = vec![0.0f32; ty.block_size()];
    if quantize_row(ty, &probe, &mut vec![0u8; ty.type_size()]).is_err() {
        return random_blocks(rng, ty, rows, cols);
    }
    for r in 0..rows {
        let src: Vec<f32> = (0..cols).map(|_| rng.normal() * 0.05).collect();
        quantize_row(ty, &src, &mut data[r * rb..(r + 1) * rb]).unwrap();
    }
    data
}

/// The weight types with a full dot path, with column counts to test (odd tails for floats).
pub fn dot_types() -> Vec<(GgmlType, Vec<usize>)> {
    vec![
        (GgmlType::F32, vec![37, 640]),
        (GgmlType::F16, vec![45, 640]),
        (GgmlType::BF16, vec![23, 640]),
        (GgmlType::Q8_0, vec![160, 640]),
        (GgmlType::Q5_0, vec![96, 640]),
        (GgmlType::Q4_0, vec![64, 640]),
        (GgmlType::Q4_K, vec![256, 1024]),
        (GgmlType::Q6_K, vec![512, 1024]),
        (GgmlType::Q4_1, vec![96, 640]),
        (GgmlType::Q5_1, vec![64, 640]),
        (GgmlType::IQ4_NL, vec![160, 640]),
        (GgmlType::Q2_K, vec![256, 1024]),
        (GgmlType::Q3_K, vec![512, 1024]),
        (GgmlType::Q5_K, vec![256, 1024]),
        (GgmlType::IQ4_XS, vec![512, 1024]),
    ]
}
