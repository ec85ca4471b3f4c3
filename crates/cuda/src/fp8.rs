//! e4m3 (fp8) on the host: the rounding the kernels apply when they write fp8 KV
//! (`f2fp8` in kernels/common.cuh) and the widening they apply when they read it, for tests
//! and for uploading fp8 caches.
use half::bf16;

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

/// The value of an e4m3 byte (0x7f / 0xff, e4m3's NaN, are never written: read as 480).
pub fn e4m3_to_f32(x: u8) -> f32 {
    let sign = if x & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((x >> 3) & 15) as i32, (x & 7) as f32);
    sign * match e {
        0 => m * (-9f32).exp2(),
        _ => (1.0 + m / 8.0) * ((e - 7) as f32).exp2(),
    }
}

/// e4m3 bytes packed two a `bf16` element (little-endian), as a cache buffer holds them.
pub fn pack_e4m3(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .collect()
}

/// The bytes of a cache buffer of e4m3 values.
pub fn unpack_e4m3(words: &[bf16]) -> Vec<u8> {
    words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_and_widens_exactly_to_bf16() {
        for x in 0..=255u8 {
            if x & 0x7f == 0x7f {
                continue; // NaN codes
            }
            let v = e4m3_to_f32(x);
            assert_eq!(bf16::from_f32(v).to_f32(), v, "code {x:#04x}");
            let back = e4m3_from_f32(v);
            // +0 and -0 keep their sign
            assert_eq!(back, x, "code {x:#04x} value {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), (-9f32).exp2());
        assert_eq!(e4m3_to_f32(0x08), (-6f32).exp2());
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // 1 + 1/16 sits between 1 and 1 + 1/8: ties to even (1); a hair above goes up
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0626)), 1.125);
        // 1 + 3/16: ties to even (1.25)
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.1875)), 1.25);
        // carry into the exponent
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.97)), 2.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1e9)), 448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(-1e9)), -448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).abs(), 448.0);
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1e-4)), 0.0);
        // the nearest code, on random values: never further than half a step
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

    /// The kernels' packed widening (`fp8x2_bf16x2` in common.cuh): the byte's sign to bit
    /// 15 and its other bits to bits 4-14, read as a bf16 (a subnormal one for e4m3's
    /// subnormals), times 2^120, is the e4m3 value, for every code.
    #[test]
    fn the_kernels_widening_identity_holds_for_every_code() {
        for x in 0..=255u8 {
            let bits = ((x as u16 & 0x80) << 8) | ((x as u16 & 0x7f) << 4);
            let v = bf16::from_bits(bits).to_f32() * 120f32.exp2();
            assert_eq!(v, e4m3_to_f32(x), "code {x:#04x}");
            assert_eq!(bf16::from_f32(v).to_f32(), v, "code {x:#04x} exact in bf16");
        }
        assert_eq!(bf16::from_f32(120f32.exp2()).to_bits(), 0x7b80);
    }

    #[test]
    fn bytes_pack_two_a_word() {
        let b = [1u8, 2, 3, 4, 5];
        assert_eq!(&unpack_e4m3(&pack_e4m3(&b))[..5], &b);
    }
}
