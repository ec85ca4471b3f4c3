//! e4m3 (fp8) on the host: the rounding the kernels apply when they write fp8 KV
//! (`f2fp8` in kernels/common.cuh) and the widening they apply when they read it, for tests
//! and for uploading fp8 caches.
use half::bf16;

/// e4m3's rounding (round to nearest even, saturating to +-448) and widening: the CPU's fp8
/// KV's too.
pub use slowfast_backend::e4m3::{e4m3_from_f32, e4m3_to_f32};

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

    /// Every e4m3 value is a bf16 too (the kernels widen to bf16 without rounding); the
    /// rounding itself is tested with `slowfast_backend::e4m3`.
    #[test]
    fn every_code_widens_exactly_to_bf16() {
        for x in 0..=255u8 {
            if x & 0x7f == 0x7f {
                continue; // NaN codes
            }
            let v = e4m3_to_f32(x);
            assert_eq!(bf16::from_f32(v).to_f32(), v, "code {x:#04x}");
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
