//! AVX2 + FMA + F16C dot kernels (`maddubs` integer block sums, 256-bit f32 FMA).
#![cfg(target_arch = "x86_64")]

use crate::activation::ActRef;
use crate::types::{GgmlType, QK, QK_K};
use std::arch::x86_64::*;

/// # Safety
/// The CPU must support avx2, fma and f16c; lengths as documented on `dot_row`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot(ty: GgmlType, row: &[u8], x: &[f32], a: ActRef<'_>) -> f32 {
    match ty {
        GgmlType::F32 => f32_dot(row, x),
        GgmlType::F16 => f16_dot(row, x),
        GgmlType::BF16 => bf16_dot(row, x),
        GgmlType::Q8_0 => q8_0(row, a),
        GgmlType::Q5_0 => q5_0(row, a),
        GgmlType::Q4_0 => q4_0(row, a),
        GgmlType::Q4_K => q4_k(row, a),
        GgmlType::Q6_K => q6_k(row, a),
        GgmlType::Q4_1 => q4_1(row, a),
        GgmlType::Q5_1 => q5_1(row, a),
        GgmlType::IQ4_NL => iq4_nl(row, a),
        GgmlType::Q2_K => q2_k(row, a),
        GgmlType::Q3_K => q3_k(row, a),
        GgmlType::Q5_K => q5_k(row, a),
        GgmlType::IQ4_XS => iq4_xs(row, a),
        _ => unreachable!("has_dot checked by callers"),
    }
}

/// # Safety
/// As for `dot`; `rows` holds `out.len()` rows of `rb` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_rows(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    x: &[f32],
    a: ActRef<'_>,
    out: &mut [f32],
) {
    macro_rules! each {
        ($row:ident => $e:expr) => {
            for (o, $row) in out.iter_mut().zip(rows.chunks_exact(rb)) {
                *o = $e;
            }
        };
    }
    match ty {
        GgmlType::F32 => each!(row => f32_dot(row, x)),
        GgmlType::F16 => each!(row => f16_dot(row, x)),
        GgmlType::BF16 => each!(row => bf16_dot(row, x)),
        GgmlType::Q8_0 => each!(row => q8_0(row, a)),
        GgmlType::Q5_0 => each!(row => q5_0(row, a)),
        GgmlType::Q4_0 => each!(row => q4_0(row, a)),
        GgmlType::Q4_K => each!(row => q4_k(row, a)),
        GgmlType::Q6_K => each!(row => q6_k(row, a)),
        GgmlType::Q4_1 => each!(row => q4_1(row, a)),
        GgmlType::Q5_1 => each!(row => q5_1(row, a)),
        GgmlType::IQ4_NL => each!(row => iq4_nl(row, a)),
        GgmlType::Q2_K => each!(row => q2_k(row, a)),
        GgmlType::Q3_K => each!(row => q3_k(row, a)),
        GgmlType::Q5_K => each!(row => q5_k(row, a)),
        GgmlType::IQ4_XS => each!(row => iq4_xs(row, a)),
        _ => unreachable!("has_dot checked by callers"),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Read an f16 at `p` (unaligned) as f32. Only for an f16 that ends a buffer (Q6_K's `d`);
/// elsewhere use `f16_head`, which has no false register dependency.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The f16 at `p` as f32, read as an 8-byte load straight into `vcvtph2ps`: `p..p + 8` must be
/// readable (true for a scale at the start of a block of >= 8 bytes). A 16-bit insert would
/// merge into whatever register LLVM picks (often an accumulator) and serialize the loop.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_head(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_loadl_epi64(p as *const __m128i)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Sum of 32 u8 * i8 products as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_us8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_dot(row: &[u8], x: &[f32]) -> f32 {
    let (w, xp, n) = (row.as_ptr() as *const f32, x.as_ptr(), x.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * k;
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(w.add(i)),
            _mm256_loadu_ps(xp.add(i)),
            acc[0],
        );
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    while i < n {
        s += w.add(i).read_unaligned() * *xp.add(i);
        i += 1;
    }
    s
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const u16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16x8(p: *const u16) -> __m256 {
    let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
    _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
}

macro_rules! half_dot {
    ($name:ident, $load:ident, $scalar:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name(row: &[u8], x: &[f32]) -> f32 {
            let (w, xp, n) = (row.as_ptr() as *const u16, x.as_ptr(), x.len());
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let o = i + 8 * k;
                    *a = _mm256_fmadd_ps($load(w.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps($load(w.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
                i += 8;
            }
            let sum4 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut s = hsum(sum4);
            let conv: fn(u16) -> f32 = $scalar;
            while i < n {
                s += conv(w.add(i).read_unaligned()) * *xp.add(i);
                i += 1;
            }
            s
        }
    };
}
half_dot!(f16_dot, f16x8, |h| half::f16::from_bits(h).to_f32());
half_dot!(bf16_dot, bf16x8, |h| half::bf16::from_bits(h).to_f32());

/// Scaled integer sum of one Q8_0 block as 8 f32 lanes (to be summed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_block(bp: *const u8, x: *const u8, dx: f32) -> (__m256, __m256) {
    let wv = load(bp.add(2));
    let xv = load(x);
    // |w| * sign(x, w) keeps maddubs' first operand unsigned.
    let p = mul_sum_us8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
    (_mm256_set1_ps(f16_head(bp) * dx), _mm256_cvtepi32_ps(p))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq, xd) = (row.as_ptr(), a.qs.as_ptr() as *const u8, a.d.as_ptr());
    let bsz = 2 + QK;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut b = 0;
    while b + 2 <= nb {
        let (d0, p0) = q8_0_block(w.add(b * bsz), xq.add(b * QK), *xd.add(b));
        let (d1, p1) = q8_0_block(w.add((b + 1) * bsz), xq.add((b + 1) * QK), *xd.add(b + 1));
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
        acc1 = _mm256_fmadd_ps(d1, p1, acc1);
        b += 2;
    }
    if b < nb {
        let (d0, p0) = q8_0_block(w.add(b * bsz), xq.add(b * QK), *xd.add(b));
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
    }
    hsum(_mm256_add_ps(acc0, acc1))
}

/// 32 bytes, 0xFF where the matching bit of `x` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits_32(x: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// 16 bytes of nibbles -> 32 bytes: low nibbles then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles_32(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p as *const __m128i);
    let v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// One Q4_0/Q5_0 block: (scale, sum(q * x) - offset * sum(x) as 8 f32 lanes to be summed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_block<const FIVE: bool>(
    bp: *const u8,
    x: *const u8,
    dx: f32,
    sx: i16,
) -> (__m256, __m256) {
    let q = if FIVE {
        let qh = (bp.add(2) as *const u32).read_unaligned();
        let hb = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles_32(bp.add(6)), hb)
    } else {
        nibbles_32(bp.add(2))
    };
    let offset = if FIVE { 16 } else { 8 };
    let corr = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-offset * sx as i32));
    let p = _mm256_add_epi32(mul_sum_us8(q, load(x)), corr);
    (_mm256_set1_ps(f16_head(bp) * dx), _mm256_cvtepi32_ps(p))
}

/// Q4_0 / Q5_0: unsigned q (optionally with a 5th bit), minus offset * sum(x).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const FIVE: bool>(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let bsz = if FIVE { 6 + QK / 2 } else { 2 + QK / 2 };
    let (w, xq, xd, xs) = (
        row.as_ptr(),
        a.qs.as_ptr() as *const u8,
        a.d.as_ptr(),
        a.sums.as_ptr(),
    );
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut b = 0;
    while b + 2 <= nb {
        let (d0, p0) = legacy_block::<FIVE>(w.add(b * bsz), xq.add(b * QK), *xd.add(b), *xs.add(b));
        let (d1, p1) = legacy_block::<FIVE>(
            w.add((b + 1) * bsz),
            xq.add((b + 1) * QK),
            *xd.add(b + 1),
            *xs.add(b + 1),
        );
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
        acc1 = _mm256_fmadd_ps(d1, p1, acc1);
        b += 2;
    }
    if b < nb {
        let (d0, p0) = legacy_block::<FIVE>(w.add(b * bsz), xq.add(b * QK), *xd.add(b), *xs.add(b));
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
    }
    hsum(_mm256_add_ps(acc0, acc1))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0(row: &[u8], a: ActRef<'_>) -> f32 {
    legacy::<false>(row, a)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0(row: &[u8], a: ActRef<'_>) -> f32 {
    legacy::<true>(row, a)
}

/// Unpack Q4_K's 12 scale bytes into [8 scales, 8 mins] (ggml's `utmp` trick).
#[inline(always)]
pub(super) fn unpack_k4_scales(s: &[u8]) -> [u8; 16] {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let t3 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let t2 = u1 & KMASK1;
    let t1 = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let t0 = u0 & KMASK1;
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&t0.to_le_bytes());
    out[4..8].copy_from_slice(&t1.to_le_bytes());
    out[8..12].copy_from_slice(&t2.to_le_bytes());
    out[12..16].copy_from_slice(&t3.to_le_bytes());
    out
}

/// sum_j mins[j] * (bsums[2j] + bsums[2j+1]) for one Q4_K super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_min_sum(mins: &[u8], bsums: *const i16) -> i32 {
    let bs = _mm256_loadu_si256(bsums as *const __m256i);
    let pair = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    let m = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
    let p = _mm_madd_epi16(m, pair);
    let p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0b01_00_11_10));
    let p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0b10_11_00_01));
    _mm_cvtsi128_si32(p)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut accm = 0.0f32;
    for b in 0..nb {
        let bp = w.add(b * 144);
        let dx = *a.d.get_unchecked(b);
        let sm = unpack_k4_scales(std::slice::from_raw_parts(bp.add(4), 12));
        accm +=
            f16_head(bp.add(2)) * dx * q4_k_min_sum(&sm[8..], a.sums.as_ptr().add(16 * b)) as f32;
        let x = xq.add(b * QK_K);
        let mut sumi = _mm256_setzero_si256();
        for k in 0..4 {
            let q4 = load(bp.add(16 + 32 * k));
            let lo = _mm256_and_si256(q4, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            let p0 = _mm256_maddubs_epi16(lo, load(x.add(64 * k)));
            let p1 = _mm256_maddubs_epi16(hi, load(x.add(64 * k + 32)));
            let p0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(sm[2 * k] as i16));
            let p1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(sm[2 * k + 1] as i16));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        let d = _mm256_set1_ps(f16_head(bp) * dx);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) - accm
}

/// Shuffle masks giving [s[2k] x8, s[2k+1] x8] from 16 i8 scales.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scale_pair(scales: __m128i, k: usize) -> __m256i {
    let lo = (2 * k) as i8;
    let hi = lo + 1;
    let m = _mm_set_epi8(
        hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
    );
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, m))
}

/// Four 32-byte chunks of 6-bit Q6_K values (0..=63) from one 128-value half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_unpack(ql: *const u8, qh: *const u8) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x03);
    let (l0, l1, h) = (load(ql), load(ql.add(32)), load(qh));
    let h0 = _mm256_slli_epi16(_mm256_and_si256(h, m2), 4);
    let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4);
    let h4 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4);
    let h6 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4);
    [
        _mm256_or_si256(_mm256_and_si256(l0, m4), h0),
        _mm256_or_si256(_mm256_and_si256(l1, m4), h2),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), h4),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h6),
    ]
}

/// 32 * sum_j scales[j] * bsums[j] as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_bias(scales: __m128i, bsums: *const i16) -> __m256i {
    let bs = _mm256_loadu_si256(bsums as *const __m256i);
    _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), bs), 5)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let bp = w.add(b * 210);
        let x = xq.add(b * QK_K);
        let scales = _mm_loadu_si128(bp.add(192) as *const __m128i);
        let mut sumi = _mm256_sub_epi32(
            _mm256_setzero_si256(),
            q6_k_bias(scales, a.sums.as_ptr().add(16 * b)),
        );
        for n in 0..2 {
            let q = q6_k_unpack(bp.add(64 * n), bp.add(128 + 32 * n));
            for (k, qk) in q.iter().enumerate() {
                let p = _mm256_maddubs_epi16(*qk, load(x.add(128 * n + 32 * k)));
                let p = _mm256_madd_epi16(p, scale_pair(scales, 4 * n + k));
                sumi = _mm256_add_epi32(sumi, p);
            }
        }
        let d = _mm256_set1_ps(f16_at(bp.add(208)) * *a.d.get_unchecked(b));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}

/// Horizontal sum of 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// One Q4_1/Q5_1 block: (d * dx, sum(q * x) as 8 f32 lanes, m * dx * sum(x)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn affine_block<const FIVE: bool>(
    bp: *const u8,
    x: *const u8,
    dx: f32,
    sx: i16,
) -> (__m256, __m256, f32) {
    let q = if FIVE {
        let qh = (bp.add(4) as *const u32).read_unaligned();
        let hb = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles_32(bp.add(8)), hb)
    } else {
        nibbles_32(bp.add(4))
    };
    let p = mul_sum_us8(q, load(x));
    let dm = _mm_cvtph_ps(_mm_loadl_epi64(bp as *const __m128i)); // [d, m, ..]
    let (d, m) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
    (
        _mm256_set1_ps(d * dx),
        _mm256_cvtepi32_ps(p),
        m * dx * sx as f32,
    )
}

/// Q4_1 / Q5_1: d * dx * sum(q * x) + m * dx * sum(x) per block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn affine<const FIVE: bool>(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let bsz = if FIVE { 8 + QK / 2 } else { 4 + QK / 2 };
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let (mut acc0, mut acc1, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps(), 0.0f32);
    let mut b = 0;
    while b + 2 <= nb {
        let (d0, p0, m0) = affine_block::<FIVE>(
            w.add(b * bsz),
            xq.add(b * QK),
            *a.d.get_unchecked(b),
            *a.sums.get_unchecked(b),
        );
        let (d1, p1, m1) = affine_block::<FIVE>(
            w.add((b + 1) * bsz),
            xq.add((b + 1) * QK),
            *a.d.get_unchecked(b + 1),
            *a.sums.get_unchecked(b + 1),
        );
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
        acc1 = _mm256_fmadd_ps(d1, p1, acc1);
        accm += m0 + m1;
        b += 2;
    }
    if b < nb {
        let (d0, p0, m0) = affine_block::<FIVE>(
            w.add(b * bsz),
            xq.add(b * QK),
            *a.d.get_unchecked(b),
            *a.sums.get_unchecked(b),
        );
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
        accm += m0;
    }
    hsum(_mm256_add_ps(acc0, acc1)) + accm
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1(row: &[u8], a: ActRef<'_>) -> f32 {
    affine::<false>(row, a)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1(row: &[u8], a: ActRef<'_>) -> f32 {
    affine::<true>(row, a)
}

/// `KVALUES_IQ4NL` in both 128-bit lanes, for `pshufb` lookups.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq4nl_table() -> __m256i {
    let t = _mm_loadu_si128(crate::dequant::KVALUES_IQ4NL.as_ptr() as *const __m128i);
    _mm256_broadcastsi128_si256(t)
}

/// Sum of 32 i8 * i8 products (`w` values within -127..=127) as 16 i16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_ss8_i16(w: __m256i, x: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
}

/// One IQ4_NL block: (d * dx, sum(kv[q] * x) as 8 f32 lanes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_nl_block(bp: *const u8, x: *const u8, dx: f32, table: __m256i) -> (__m256, __m256) {
    let v = _mm256_shuffle_epi8(table, nibbles_32(bp.add(2)));
    let p = _mm256_madd_epi16(mul_ss8_i16(v, load(x)), _mm256_set1_epi16(1));
    (_mm256_set1_ps(f16_head(bp) * dx), _mm256_cvtepi32_ps(p))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_nl(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq, xd) = (row.as_ptr(), a.qs.as_ptr() as *const u8, a.d.as_ptr());
    let table = iq4nl_table();
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut b = 0;
    while b + 2 <= nb {
        let (d0, p0) = iq4_nl_block(w.add(b * 18), xq.add(b * QK), *xd.add(b), table);
        let (d1, p1) = iq4_nl_block(
            w.add((b + 1) * 18),
            xq.add((b + 1) * QK),
            *xd.add(b + 1),
            table,
        );
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
        acc1 = _mm256_fmadd_ps(d1, p1, acc1);
        b += 2;
    }
    if b < nb {
        let (d0, p0) = iq4_nl_block(w.add(b * 18), xq.add(b * QK), *xd.add(b), table);
        acc0 = _mm256_fmadd_ps(d0, p0, acc0);
    }
    hsum(_mm256_add_ps(acc0, acc1))
}

/// The four 2-bit fields (bits 0-1, 2-3, 4-5, 6-7) of 32 bytes, each as 32 bytes 0..=3.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn crumbs(q: __m256i, m3: __m256i) -> [__m256i; 4] {
    [
        _mm256_and_si256(q, m3),
        _mm256_and_si256(_mm256_srli_epi16(q, 2), m3),
        _mm256_and_si256(_mm256_srli_epi16(q, 4), m3),
        _mm256_and_si256(_mm256_srli_epi16(q, 6), m3),
    ]
}

/// sum_j mins[j] * bsums[j] over 16 groups (`mins` 16 u8 in a 128-bit register).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn min_sum_16(mins: __m128i, bsums: *const i16) -> i32 {
    let bs = _mm256_loadu_si256(bsums as *const __m256i);
    hsum_i32(_mm256_madd_epi16(_mm256_cvtepu8_epi16(mins), bs))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut accm = 0.0f32;
    for b in 0..nb {
        let bp = w.add(b * 84);
        let dx = *a.d.get_unchecked(b);
        let sc = _mm_loadu_si128(bp as *const __m128i);
        let scales = _mm_and_si128(sc, m4);
        let mins = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(
            (bp.add(80) as *const i32).read_unaligned(),
        ));
        let (d, dmin) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
        accm += dmin * dx * min_sum_16(mins, a.sums.as_ptr().add(16 * b)) as f32;
        let x = xq.add(b * QK_K);
        let mut sumi = _mm256_setzero_si256();
        for n in 0..2 {
            for (j, qj) in crumbs(load(bp.add(16 + 32 * n)), m3)
                .into_iter()
                .enumerate()
            {
                let p = _mm256_maddubs_epi16(qj, load(x.add(128 * n + 32 * j)));
                let p = _mm256_madd_epi16(p, scale_pair(scales, 4 * n + j));
                sumi = _mm256_add_epi32(sumi, p);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) - accm
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let m3 = _mm256_set1_epi8(3);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let bp = w.add(b * 110);
        let sc = crate::dequant::q3_k_scales(std::slice::from_raw_parts(bp.add(96), 12));
        let scales = _mm_loadu_si128(sc.as_ptr() as *const __m128i);
        let x = xq.add(b * QK_K);
        let hm = load(bp);
        // sum_j sc_j * (sum(q * x) - 4 * bsums_j) with q = q2 | high bit << 2 in 0..=7.
        let bias = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(scales),
            _mm256_loadu_si256(a.sums.as_ptr().add(16 * b) as *const __m256i),
        );
        let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(bias, 2));
        for n in 0..2 {
            for (j, q2) in crumbs(load(bp.add(32 + 32 * n)), m3)
                .into_iter()
                .enumerate()
            {
                let bit = _mm256_set1_epi8((1u8 << (4 * n + j)) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                let qj = _mm256_or_si256(q2, _mm256_and_si256(set, _mm256_set1_epi8(4)));
                let p = _mm256_maddubs_epi16(qj, load(x.add(128 * n + 32 * j)));
                let p = _mm256_madd_epi16(p, scale_pair(scales, 4 * n + j));
                sumi = _mm256_add_epi32(sumi, p);
            }
        }
        let d = _mm256_set1_ps(f16_at(bp.add(108)) * *a.d.get_unchecked(b));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let m4 = _mm256_set1_epi8(0x0F);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = _mm256_setzero_ps();
    let mut accm = 0.0f32;
    for b in 0..nb {
        let bp = w.add(b * 176);
        let dx = *a.d.get_unchecked(b);
        let sm = unpack_k4_scales(std::slice::from_raw_parts(bp.add(4), 12));
        accm +=
            f16_head(bp.add(2)) * dx * q4_k_min_sum(&sm[8..], a.sums.as_ptr().add(16 * b)) as f32;
        let x = xq.add(b * QK_K);
        let qh = load(bp.add(16));
        let mut sumi = _mm256_setzero_si256();
        for k in 0..4 {
            let q4 = load(bp.add(48 + 32 * k));
            let b0 = _mm256_set1_epi8((1u8 << (2 * k)) as i8);
            let b1 = _mm256_set1_epi8((1u8 << (2 * k + 1)) as i8);
            let h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen);
            let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen);
            let lo = _mm256_or_si256(_mm256_and_si256(q4, m4), h0);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), m4), h1);
            let p0 = _mm256_maddubs_epi16(lo, load(x.add(64 * k)));
            let p1 = _mm256_maddubs_epi16(hi, load(x.add(64 * k + 32)));
            let p0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(sm[2 * k] as i16));
            let p1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(sm[2 * k + 1] as i16));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        let d = _mm256_set1_ps(f16_head(bp) * dx);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) - accm
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs(row: &[u8], a: ActRef<'_>) -> f32 {
    let nb = a.d.len();
    let (w, xq) = (row.as_ptr(), a.qs.as_ptr() as *const u8);
    let table = iq4nl_table();
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let bp = w.add(b * 136);
        let blk = std::slice::from_raw_parts(bp, 136);
        let x = xq.add(b * QK_K);
        let mut sumi = _mm256_setzero_si256();
        for ib in 0..8 {
            let v = _mm256_shuffle_epi8(table, nibbles_32(bp.add(8 + 16 * ib)));
            let p = mul_ss8_i16(v, load(x.add(32 * ib)));
            let ls = crate::dequant::iq4_xs_scale(blk, ib) as i16;
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16(ls)));
        }
        let d = _mm256_set1_ps(f16_head(bp) * *a.d.get_unchecked(b));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}
