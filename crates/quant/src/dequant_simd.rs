//! AVX2 row dequantization for the f32 paths (dequantized matvec, GEMM tiles); the same f32
//! operations in the same order as the scalar `dequant.rs`, so results are bit-identical
//! (checked by tests/dequant.rs).

use crate::dequant::dequantize_unchecked;
use crate::dot::Isa;
use crate::types::GgmlType;

/// Dequantize with sizes already validated, using SIMD when `isa` allows.
pub(crate) fn dequantize_fast(isa: Isa, ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && avx2::has(ty) {
        // SAFETY: Avx2 and Avx512 both imply avx2+fma+f16c (`Isa::is_available`, checked by
        // callers); sizes validated by callers.
        unsafe { avx2::dequantize(ty, src, dst) };
        return;
    }
    let _ = isa;
    dequantize_unchecked(ty, src, dst);
}

/// `dequantize_row` with a forced instruction set (tests compare every set bit for bit).
pub fn dequantize_row_with(
    isa: Isa,
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
) -> Result<(), crate::QuantError> {
    if !ty.is_supported() {
        return Err(ty.unsupported("dequantize_row"));
    }
    if !isa.is_available() {
        return Err(crate::QuantError::Unsupported {
            ty: isa.name(),
            op: "dequantize on this CPU (instruction set)",
        });
    }
    let expected = ty.row_bytes(dst.len())?;
    crate::QuantError::check_len("dequantize_row src", "bytes", expected, src.len())?;
    dequantize_fast(isa, ty, src, dst);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::types::{GgmlType, QK, QK_K};
    use std::arch::x86_64::*;

    pub(super) fn has(ty: GgmlType) -> bool {
        matches!(
            ty,
            GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q8_0
                | GgmlType::Q5_0
                | GgmlType::Q4_0
                | GgmlType::Q4_K
                | GgmlType::Q6_K
                | GgmlType::Q4_1
                | GgmlType::Q5_1
                | GgmlType::IQ4_NL
                | GgmlType::Q2_K
                | GgmlType::Q3_K
                | GgmlType::Q5_K
                | GgmlType::IQ4_XS
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            (p as *const u16).read_unaligned() as i32,
        )))
    }

    /// dst[0..8] = i8 lanes 0..8 of `v` as f32 * d.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn put8(v: __m128i, d: __m256, dst: *mut f32) {
        let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        _mm256_storeu_ps(dst, _mm256_mul_ps(f, d));
    }

    /// dst[0..32] = 32 i8 of `v` as f32 * d.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn put32(v: __m256i, d: __m256, dst: *mut f32) {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        put8(lo, d, dst);
        put8(_mm_srli_si128(lo, 8), d, dst.add(8));
        put8(hi, d, dst.add(16));
        put8(_mm_srli_si128(hi, 8), d, dst.add(24));
    }

    /// dst[0..32] = 32 u8 of `v` as f32 * d - m.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn put32_affine(v: __m256i, d: __m256, m: __m256, dst: *mut f32) {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        for (k, part) in [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
            .into_iter()
            .enumerate()
        {
            let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
            _mm256_storeu_ps(dst.add(8 * k), _mm256_sub_ps(_mm256_mul_ps(d, f), m));
        }
    }

    /// dst[0..8] = u8 lanes 0..8 of `v` as f32 * d - m.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn put8_affine(v: __m128i, d: __m256, m: __m256, dst: *mut f32) {
        let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        _mm256_storeu_ps(dst, _mm256_sub_ps(_mm256_mul_ps(d, f), m));
    }

    /// dst[0..32] = 32 u8 of `v` as f32 * d + m (Q4_1 / Q5_1: no FMA, the scalar rounding).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn put32_plus(v: __m256i, d: __m256, m: __m256, dst: *mut f32) {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        for (k, part) in [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
            .into_iter()
            .enumerate()
        {
            let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
            _mm256_storeu_ps(dst.add(8 * k), _mm256_add_ps(_mm256_mul_ps(f, d), m));
        }
    }

    /// 0xFF in each byte of `v` whose bit `bit` is set.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bit_set(v: __m256i, bit: usize) -> __m256i {
        let b = _mm256_set1_epi8((1u8 << bit) as i8);
        _mm256_cmpeq_epi8(_mm256_and_si256(v, b), b)
    }

    /// The 5th bits of Q5_0/Q5_1 (`qh` u32 at `p`) as 0x10 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn five_bits(p: *const u8) -> __m256i {
        let qh = (p as *const u32).read_unaligned();
        let shuf = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
        let bits = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bits), _mm256_set1_epi64x(-1));
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles_32(p: *const u8) -> __m256i {
        let t = _mm_loadu_si128(p as *const __m128i);
        let v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }

    /// # Safety
    /// avx2+fma+f16c available; `src.len() == ty.row_bytes(dst.len())`; `has(ty)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
        let (s, y, n) = (src.as_ptr(), dst.as_mut_ptr(), dst.len());
        match ty {
            GgmlType::F16 | GgmlType::BF16 => {
                let mut i = 0;
                while i + 8 <= n {
                    let h = _mm_loadu_si128(s.add(2 * i) as *const __m128i);
                    let f = if ty == GgmlType::F16 {
                        _mm256_cvtph_ps(h)
                    } else {
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                    };
                    _mm256_storeu_ps(y.add(i), f);
                    i += 8;
                }
                super::dequantize_unchecked(ty, &src[2 * i..], &mut dst[i..]);
            }
            GgmlType::Q8_0 => {
                for b in 0..n / QK {
                    let bp = s.add(b * (2 + QK));
                    let d = _mm256_set1_ps(f16(bp));
                    put32(
                        _mm256_loadu_si256(bp.add(2) as *const __m256i),
                        d,
                        y.add(b * QK),
                    );
                }
            }
            GgmlType::Q4_0 | GgmlType::Q5_0 => {
                let five = ty == GgmlType::Q5_0;
                let bsz = ty.type_size();
                for b in 0..n / QK {
                    let bp = s.add(b * bsz);
                    let q = if five {
                        let qh = (bp.add(2) as *const u32).read_unaligned();
                        let shuf = _mm256_set_epi64x(
                            0x0303030303030303,
                            0x0202020202020202,
                            0x0101010101010101,
                            0,
                        );
                        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
                        let bits = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
                        let set =
                            _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bits), _mm256_set1_epi64x(-1));
                        let hb = _mm256_and_si256(set, _mm256_set1_epi8(0x10));
                        _mm256_sub_epi8(
                            _mm256_or_si256(nibbles_32(bp.add(6)), hb),
                            _mm256_set1_epi8(16),
                        )
                    } else {
                        _mm256_sub_epi8(nibbles_32(bp.add(2)), _mm256_set1_epi8(8))
                    };
                    put32(q, _mm256_set1_ps(f16(bp)), y.add(b * QK));
                }
            }
            GgmlType::Q4_K => {
                let m4 = _mm256_set1_epi8(0x0F);
                for b in 0..n / QK_K {
                    let bp = s.add(b * 144);
                    let (d, min) = (f16(bp), f16(bp.add(2)));
                    let sc = std::slice::from_raw_parts(bp.add(4), 12);
                    let yb = y.add(b * QK_K);
                    for c in 0..4 {
                        let q = _mm256_loadu_si256(bp.add(16 + 32 * c) as *const __m256i);
                        let (s1, m1) = crate::dequant::scale_min_k4(2 * c, sc);
                        let (s2, m2) = crate::dequant::scale_min_k4(2 * c + 1, sc);
                        let d1 = _mm256_set1_ps(d * s1 as f32);
                        let d2 = _mm256_set1_ps(d * s2 as f32);
                        let n1 = _mm256_set1_ps(min * m1 as f32);
                        let n2 = _mm256_set1_ps(min * m2 as f32);
                        put32_affine(_mm256_and_si256(q, m4), d1, n1, yb.add(64 * c));
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        put32_affine(hi, d2, n2, yb.add(64 * c + 32));
                    }
                }
            }
            GgmlType::Q6_K => {
                for b in 0..n / QK_K {
                    let bp = s.add(b * 210);
                    let d = f16(bp.add(208));
                    let yb = y.add(b * QK_K);
                    for h in 0..2 {
                        let q = crate::dot::q6_k_unpack_avx2(bp.add(64 * h), bp.add(128 + 32 * h));
                        for (k, qk) in q.iter().enumerate() {
                            let v = _mm256_sub_epi8(*qk, _mm256_set1_epi8(32));
                            let j = 8 * h + 2 * k; // scale index of the first 16 values
                            let sa = _mm256_set1_ps(d * (*bp.add(192 + j) as i8) as f32);
                            let sb = _mm256_set1_ps(d * (*bp.add(193 + j) as i8) as f32);
                            let (lo, hi) =
                                (_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                            let dst = yb.add(128 * h + 32 * k);
                            put8(lo, sa, dst);
                            put8(_mm_srli_si128(lo, 8), sa, dst.add(8));
                            put8(hi, sb, dst.add(16));
                            put8(_mm_srli_si128(hi, 8), sb, dst.add(24));
                        }
                    }
                }
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                let five = ty == GgmlType::Q5_1;
                let bsz = ty.type_size();
                for b in 0..n / QK {
                    let bp = s.add(b * bsz);
                    let q = if five {
                        _mm256_or_si256(nibbles_32(bp.add(8)), five_bits(bp.add(4)))
                    } else {
                        nibbles_32(bp.add(4))
                    };
                    let (d, m) = (_mm256_set1_ps(f16(bp)), _mm256_set1_ps(f16(bp.add(2))));
                    put32_plus(q, d, m, y.add(b * QK));
                }
            }
            GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
                let kv = crate::dequant::KVALUES_IQ4NL.as_ptr() as *const __m128i;
                let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(kv));
                let bsz = ty.type_size();
                for b in 0..n / ty.block_size() {
                    let bp = s.add(b * bsz);
                    let d = f16(bp);
                    if ty == GgmlType::IQ4_NL {
                        let v = _mm256_shuffle_epi8(table, nibbles_32(bp.add(2)));
                        put32(v, _mm256_set1_ps(d), y.add(b * QK));
                        continue;
                    }
                    let blk = std::slice::from_raw_parts(bp, bsz);
                    for ib in 0..8 {
                        let dl = d * crate::dequant::iq4_xs_scale(blk, ib) as f32;
                        let v = _mm256_shuffle_epi8(table, nibbles_32(bp.add(8 + 16 * ib)));
                        put32(v, _mm256_set1_ps(dl), y.add(b * QK_K + 32 * ib));
                    }
                }
            }
            GgmlType::Q2_K | GgmlType::Q3_K => {
                let m3 = _mm256_set1_epi8(3);
                let bsz = ty.type_size();
                for b in 0..n / QK_K {
                    let bp = s.add(b * bsz);
                    let yb = y.add(b * QK_K);
                    let blk = std::slice::from_raw_parts(bp, bsz);
                    let (qs, hm) = if ty == GgmlType::Q2_K {
                        (bp.add(16), _mm256_setzero_si256())
                    } else {
                        (bp.add(32), _mm256_loadu_si256(bp as *const __m256i))
                    };
                    let sc3 = if ty == GgmlType::Q3_K {
                        crate::dequant::q3_k_scales(&blk[96..108])
                    } else {
                        [0; 16]
                    };
                    for nh in 0..2 {
                        let q = _mm256_loadu_si256(qs.add(32 * nh) as *const __m256i);
                        for j in 0..4 {
                            let sh = _mm_cvtsi32_si128(2 * j as i32);
                            let q2 = _mm256_and_si256(_mm256_srl_epi16(q, sh), m3);
                            let e0 = 128 * nh + 32 * j; // first element of these 32
                            let parts =
                                [_mm256_castsi256_si128(q2), _mm256_extracti128_si256(q2, 1)];
                            if ty == GgmlType::Q2_K {
                                let (d, dmin) = (f16(bp.add(80)), f16(bp.add(82)));
                                for (h, part) in parts.into_iter().enumerate() {
                                    let sc = blk[(e0 + 16 * h) / 16];
                                    let dl = _mm256_set1_ps(d * (sc & 0xF) as f32);
                                    let ml = _mm256_set1_ps(dmin * (sc >> 4) as f32);
                                    let dst = yb.add(e0 + 16 * h);
                                    put8_affine(part, dl, ml, dst);
                                    put8_affine(_mm_srli_si128(part, 8), dl, ml, dst.add(8));
                                }
                            } else {
                                // q - 4 where the high bit is clear.
                                let four = _mm256_andnot_si256(
                                    bit_set(hm, 4 * nh + j),
                                    _mm256_set1_epi8(4),
                                );
                                let v = _mm256_sub_epi8(q2, four);
                                let parts =
                                    [_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)];
                                let d = f16(bp.add(108));
                                for (h, part) in parts.into_iter().enumerate() {
                                    let dl = _mm256_set1_ps(d * sc3[(e0 + 16 * h) / 16] as f32);
                                    let dst = yb.add(e0 + 16 * h);
                                    put8(part, dl, dst);
                                    put8(_mm_srli_si128(part, 8), dl, dst.add(8));
                                }
                            }
                        }
                    }
                }
            }
            GgmlType::Q5_K => {
                let m4 = _mm256_set1_epi8(0x0F);
                let sixteen = _mm256_set1_epi8(16);
                for b in 0..n / QK_K {
                    let bp = s.add(b * 176);
                    let (d, min) = (f16(bp), f16(bp.add(2)));
                    let sc = std::slice::from_raw_parts(bp.add(4), 12);
                    let qh = _mm256_loadu_si256(bp.add(16) as *const __m256i);
                    let yb = y.add(b * QK_K);
                    for c in 0..4 {
                        let q = _mm256_loadu_si256(bp.add(48 + 32 * c) as *const __m256i);
                        for h in 0..2 {
                            let g = 2 * c + h;
                            let (s1, m1) = crate::dequant::scale_min_k4(g, sc);
                            let dl = _mm256_set1_ps(d * s1 as f32);
                            let ml = _mm256_set1_ps(min * m1 as f32);
                            let sh = _mm_cvtsi32_si128(4 * h as i32);
                            let nib = _mm256_and_si256(_mm256_srl_epi16(q, sh), m4);
                            let hb = _mm256_and_si256(bit_set(qh, g), sixteen);
                            put32_affine(_mm256_or_si256(nib, hb), dl, ml, yb.add(32 * g));
                        }
                    }
                }
            }
            _ => unreachable!("has(ty) checked by the caller"),
        }
    }
}
