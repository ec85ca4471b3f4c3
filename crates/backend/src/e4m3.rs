//! e4m3 (fp8, the OCP "E4M3FN" format: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits,
//! no infinities, largest 448): the rounding every writer of fp8 KV applies (the CPU's
//! `E4m3` cache element, the GPU's `f2fp8` in kernels/common.cuh) and its exact widening.
//!
//! Widening goes through f16: an e4m3 byte `x` shifted into f16's bit layout
//! (`(x & 0x80) << 8 | (x & 0x7f) << 7`) is an f16 of the same sign and mantissa whose
//! exponent is 8 lower (f16's bias 15 against e4m3's 7), subnormals included, so the value is
//! that f16 times 256. The CPU's SIMD loads widen 8 or 16 bytes that way at once.

/// The e4m3 byte of `f`: round to nearest even, saturating to +-448 (NaN saturates too).
pub fn e4m3_from_f32(f: f32) -> u8 {
    let s = ((f.to_bits() >> 24) & 0x80) as u8;
    let a = if f.is_nan() {
        448.0
    } else {
        f.abs().min(448.0)
    };
    if a < 0.015625 {
        // subnormal: multiples of 2^-9 (8 of them is 2^-6, the first normal's code)
        return s | (a * 512.0).round_ties_even() as u8;
    }
    let mut b = a.to_bits();
    b += 0x7ffff + ((b >> 20) & 1);
    s | ((((b >> 23) - 120) << 3) | ((b >> 20) & 7)) as u8
}

/// The f16 bits whose value times [`E4M3_F16_FACTOR`] is the e4m3 byte `x`'s value.
#[inline(always)]
pub fn e4m3_f16_bits(x: u8) -> u16 {
    ((x as u16 & 0x80) << 8) | ((x as u16 & 0x7f) << 7)
}

/// The factor between an e4m3 byte's value and the f16 of [`e4m3_f16_bits`]: 2^(15 - 7).
pub const E4M3_F16_FACTOR: f32 = 256.0;

/// The value of an e4m3 byte (0x7f / 0xff, e4m3's NaN, are never written: read as 480).
#[inline(always)]
pub fn e4m3_to_f32(x: u8) -> f32 {
    half::f16::from_bits(e4m3_f16_bits(x)).to_f32() * E4M3_F16_FACTOR
}

/// An fp8 (e4m3) KV-cache element: one byte a value, half of f16's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct E4m3(pub u8);

impl E4m3 {
    pub fn from_f32(f: f32) -> Self {
        E4m3(e4m3_from_f32(f))
    }
    pub fn to_f32(self) -> f32 {
        e4m3_to_f32(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The widening through f16 against the format's definition, for every byte.
    #[test]
    fn widening_matches_the_definition_for_every_byte() {
        for x in 0..=255u8 {
            if x & 0x7f == 0x7f {
                continue; // NaN, never written
            }
            let sign = if x & 0x80 != 0 { -1.0 } else { 1.0 };
            let (e, m) = (((x >> 3) & 15) as i32, (x & 7) as f32);
            let want = sign
                * match e {
                    0 => m * (-9f32).exp2(),
                    _ => (1.0 + m / 8.0) * ((e - 7) as f32).exp2(),
                };
            assert_eq!(e4m3_to_f32(x), want, "byte {x:#04x}");
            // every value rounds back to its own byte (zero keeps its sign)
            assert_eq!(e4m3_from_f32(want), x, "byte {x:#04x}");
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), (-9f32).exp2());
        assert_eq!(e4m3_to_f32(0x08), (-6f32).exp2());
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0626)), 1.125);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.1875)), 1.25);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.97)), 2.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1e9)), 448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(-1e9)), -448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).abs(), 448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1e-4)), 0.0);
        // the subnormal step: 2^-9, ties to even
        assert_eq!(
            e4m3_to_f32(e4m3_from_f32(1.5 * (-9f32).exp2())),
            2.0 * (-9f32).exp2()
        );
        assert_eq!(e4m3_to_f32(e4m3_from_f32(0.4 * (-9f32).exp2())), 0.0);
    }

    /// The nearest code, on random values: never further than half a step (2^-9 among the
    /// subnormals, an eighth of the power of two below elsewhere), saturating past 448.
    #[test]
    fn random_values_round_to_the_nearest_code() {
        let mut x = 1u64;
        for _ in 0..100_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let f = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1000.0;
            let g = e4m3_to_f32(e4m3_from_f32(f));
            if f.abs() >= 448.0 {
                assert_eq!(g, 448f32.copysign(f));
                continue;
            }
            let step = if f.abs() < 0.015625 {
                (-9f32).exp2()
            } else {
                (f.abs().log2().floor() - 3.0).exp2()
            };
            assert!((g - f).abs() <= step / 2.0 + 1e-9, "{f} -> {g}");
        }
    }
}
