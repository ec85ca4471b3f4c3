//! AVX-512 (F/BW/VL + VNNI) dot kernels: `vpdpbusd` / `vpdpwssd` integer sums, 512-bit f32 FMA.
#![cfg(target_arch = "x86_64")]

use super::avx2::{
    crumbs, f16_at, f16_head, hsum, iq4nl_table, min_sum_16, q4_k_min_sum, q6_k_bias, q6_k_unpack,
    scale_pair, unpack_k4_scales,
};
use crate::activation::ActRef;
use crate::types::{GgmlType, QK, QK_K};
use std::arch::x86_64::*;

/// # Safety
/// The CPU must support avx2, fma, f16c, avx512f/bw/vl/vnni; lengths as on `dot_row`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot(ty: GgmlType, row: &[u8], x: &[f32], a: ActRef<'_>) -> f32 {
    match ty {
        GgmlType::F32 => float_dot::<0>(row, x),
        GgmlType::F16 => float_dot::<1>(row, x),
        GgmlType::BF16 => float_dot::<2>(row, x),
        GgmlType::Q8_0 => q8_0(row, a),
        GgmlType::Q5_0 => legacy::<true>(row, a),
        GgmlType::Q4_0 => legacy::<false>(row, a),
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
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
        GgmlType::F32 => each!(row => float_dot::<0>(row, x)),
        GgmlType::F16 => each!(row => float_dot::<1>(row, x)),
        GgmlType::BF16 => each!(row => float_dot::<2>(row, x)),
        GgmlType::Q8_0 => each!(row => q8_0(row, a)),
        GgmlType::Q5_0 => each!(row => legacy::<true>(row, a)),
        GgmlType::Q4_0 => each!(row => legacy::<false>(row, a)),
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
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 16 weights at element `i` as f32; `KIND`: 0 = f32, 1 = f16, 2 = bf16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load16<const KIND: u8>(w: *const u8, i: usize) -> __m512 {
    match KIND {
        0 => _mm512_loadu_ps((w as *const f32).add(i)),
        1 => _mm512_cvtph_ps(load(w.add(2 * i))),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(load(w.add(2 * i))),
            16,
        )),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn float_dot<const KIND: u8>(row: &[u8], x: &[f32]) -> f32 {
    let (w, xp, n) = (row.as_ptr(), x.as_ptr(), x.len());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let o = i + 16 * k;
            *a = _mm512_fmadd_ps(load16::<KIND>(w, o), _mm512_loadu_ps(xp.add(o)), *a);
        }
        i += 64;
    }
    while i + 16 <= n {
        acc[0] = _mm512_fmadd_ps(load16::<KIND>(w, i), _mm512_loadu_ps(xp.add(i)), acc[0]);
        i += 16;
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    let mut s = _mm512_reduce_add_ps(sum);
    while i < n {
        let v = match KIND {
            0 => (w as *const f32).add(i).read_unaligned(),
            1 => half::f16::from_bits((w as *const u16).add(i).read_unaligned()).to_f32(),
            _ => half::bf16::from_bits((w as *const u16).add(i).read_unaligned()).to_f32(),
        };
        s += v * *xp.add(i);
        i += 1;
    }
    s
}

/// Scaled integer sum of one Q8_0 block as 8 f32 lanes (to be summed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_block(bp: *const u8, x: *const u8, dx: f32) -> (__m256, __m256) {
    let wv = load(bp.add(2));
    let xv = load(x);
    // |w| * sign(x, w) keeps vpdpbusd's first operand unsigned.
    let p = _mm256_dpbusd_epi32(
        _mm256_setzero_si256(),
        _mm256_abs_epi8(wv),
        _mm256_sign_epi8(xv, wv),
    );
    (_mm256_set1_ps(f16_head(bp) * dx), _mm256_cvtepi32_ps(p))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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

/// 16 bytes of nibbles -> 32 bytes: low nibbles then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn nibbles_32(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p as *const __m128i);
    let v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// One Q4_0/Q5_0 block: (scale, sum(q * x) - offset * sum(x) as 8 f32 lanes to be summed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn legacy_block<const FIVE: bool>(
    bp: *const u8,
    x: *const u8,
    dx: f32,
    sx: i16,
) -> (__m256, __m256) {
    let q = if FIVE {
        let qh = (bp.add(2) as *const u32).read_unaligned();
        let hb = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles_32(bp.add(6)), hb)
    } else {
        nibbles_32(bp.add(2))
    };
    // Start lane 0 at -offset * sum(x) so the offset costs no extra dependency chain.
    let offset = if FIVE { 16 } else { 8 };
    let init = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-offset * sx as i32));
    let p = _mm256_dpbusd_epi32(init, q, load(x));
    (_mm256_set1_ps(f16_head(bp) * dx), _mm256_cvtepi32_ps(p))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
            sumi = _mm256_dpwssd_epi32(sumi, p0, _mm256_set1_epi16(sm[2 * k] as i16));
            sumi = _mm256_dpwssd_epi32(sumi, p1, _mm256_set1_epi16(sm[2 * k + 1] as i16));
        }
        let d = _mm256_set1_ps(f16_head(bp) * dx);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) - accm
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
                sumi = _mm256_dpwssd_epi32(sumi, p, scale_pair(scales, 4 * n + k));
            }
        }
        let d = _mm256_set1_ps(f16_at(bp.add(208)) * *a.d.get_unchecked(b));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}

/// One Q4_1/Q5_1 block: (d * dx, sum(q * x) as 8 f32 lanes, m * dx * sum(x)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn affine_block<const FIVE: bool>(
    bp: *const u8,
    x: *const u8,
    dx: f32,
    sx: i16,
) -> (__m256, __m256, f32) {
    let q = if FIVE {
        let qh = (bp.add(4) as *const u32).read_unaligned();
        let hb = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles_32(bp.add(8)), hb)
    } else {
        nibbles_32(bp.add(4))
    };
    let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, load(x));
    let dm = _mm_cvtph_ps(_mm_loadl_epi64(bp as *const __m128i)); // [d, m, ..]
    let (d, m) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
    (
        _mm256_set1_ps(d * dx),
        _mm256_cvtepi32_ps(p),
        m * dx * sx as f32,
    )
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_1(row: &[u8], a: ActRef<'_>) -> f32 {
    affine::<false>(row, a)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q5_1(row: &[u8], a: ActRef<'_>) -> f32 {
    affine::<true>(row, a)
}

/// One IQ4_NL block: (d * dx, sum(kv[q] * x) as 8 f32 lanes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn iq4_nl_block(bp: *const u8, x: *const u8, dx: f32, table: __m256i) -> (__m256, __m256) {
    let v = _mm256_shuffle_epi8(table, nibbles_32(bp.add(2)));
    let xv = load(x);
    let p = _mm256_dpbusd_epi32(
        _mm256_setzero_si256(),
        _mm256_abs_epi8(v),
        _mm256_sign_epi8(xv, v),
    );
    (_mm256_set1_ps(f16_head(bp) * dx), _mm256_cvtepi32_ps(p))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
                sumi = _mm256_dpwssd_epi32(sumi, p, scale_pair(scales, 4 * n + j));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) - accm
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
                let set = _mm256_test_epi8_mask(hm, bit);
                let qj = _mm256_mask_add_epi8(q2, set, q2, _mm256_set1_epi8(4));
                let p = _mm256_maddubs_epi16(qj, load(x.add(128 * n + 32 * j)));
                sumi = _mm256_dpwssd_epi32(sumi, p, scale_pair(scales, 4 * n + j));
            }
        }
        let d = _mm256_set1_ps(f16_at(bp.add(108)) * *a.d.get_unchecked(b));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
            let b0 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((1u8 << (2 * k)) as i8));
            let b1 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((1u8 << (2 * k + 1)) as i8));
            let lo = _mm256_and_si256(q4, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            let lo = _mm256_mask_add_epi8(lo, b0, lo, sixteen);
            let hi = _mm256_mask_add_epi8(hi, b1, hi, sixteen);
            let p0 = _mm256_maddubs_epi16(lo, load(x.add(64 * k)));
            let p1 = _mm256_maddubs_epi16(hi, load(x.add(64 * k + 32)));
            sumi = _mm256_dpwssd_epi32(sumi, p0, _mm256_set1_epi16(sm[2 * k] as i16));
            sumi = _mm256_dpwssd_epi32(sumi, p1, _mm256_set1_epi16(sm[2 * k + 1] as i16));
        }
        let d = _mm256_set1_ps(f16_head(bp) * dx);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) - accm
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
            let xv = load(x.add(32 * ib));
            let p = _mm256_dpbusd_epi32(
                _mm256_setzero_si256(),
                _mm256_abs_epi8(v),
                _mm256_sign_epi8(xv, v),
            );
            let ls = crate::dequant::iq4_xs_scale(blk, ib);
            sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(p, _mm256_set1_epi32(ls)));
        }
        let d = _mm256_set1_ps(f16_head(bp) * *a.d.get_unchecked(b));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}
