//! Minimal f32 vector abstraction (scalar, AVX2+FMA+F16C, AVX-512F) that the attention
//! micro-kernels are written against once, plus a vectorised `exp`.
//!
//! The methods are `#[inline(always)]` and carry no `#[target_feature]` themselves: they are
//! inlined into the `#[target_feature]` entry points in `kernels.rs`, which are only called
//! after runtime detection confirmed the features.

#![allow(clippy::missing_safety_doc)]

/// One f32 vector type and its operations.
pub(crate) trait Simd: Copy + Send + Sync + 'static {
    const LANES: usize;
    type V: Copy;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Loads `LANES` f16 values (raw bits) and widens them to f32.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// Loads `LANES` e4m3 bytes and widens them to f32 (through f16: `crate::e4m3`).
    unsafe fn load_e4m3(p: *const u8) -> Self::V;
    /// `a * b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn hsum(v: Self::V) -> f32;
    unsafe fn hmax(v: Self::V) -> f32;
    /// Round to nearest integer (as f32).
    unsafe fn round(v: Self::V) -> Self::V;
    /// `v * 2^n` for integer-valued `n` in [-126, 127].
    unsafe fn ldexp(v: Self::V, n: Self::V) -> Self::V;
    /// Lanes where `x < t` become 0, others keep `v`.
    unsafe fn zero_below(x: Self::V, t: Self::V, v: Self::V) -> Self::V;
    /// Hints that the cache line at `p` will be read soon.
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        #[cfg(target_arch = "x86_64")]
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// `exp(x)` per lane, relative error ~2 ulp on [-87, 88]; `x < -87.3` (including -inf) gives 0.
#[inline(always)]
pub(crate) unsafe fn exp<S: Simd>(x: S::V) -> S::V {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let lo = S::splat(-87.3);
    let xc = S::max(x, lo);
    let xc = S::sub(
        S::splat(0.0),
        S::max(S::sub(S::splat(0.0), xc), S::splat(-88.3)),
    );
    let n = S::round(S::mul(xc, S::splat(LOG2E)));
    let r = S::fma(n, S::splat(-LN2_HI), xc);
    let r = S::fma(n, S::splat(-LN2_LO), r);
    // exp(r) on |r| <= ln2/2, degree-6 Taylor/minimax (Cephes expf coefficients).
    let mut p = S::splat(1.987_569_1e-4);
    p = S::fma(p, r, S::splat(1.398_199_9e-3));
    p = S::fma(p, r, S::splat(8.333_452e-3));
    p = S::fma(p, r, S::splat(4.166_579_6e-2));
    p = S::fma(p, r, S::splat(1.666_666_5e-1));
    p = S::fma(p, r, S::splat(0.5));
    let r2 = S::mul(r, r);
    p = S::fma(p, r2, S::add(r, S::splat(1.0)));
    S::zero_below(x, lo, S::ldexp(p, n))
}

/// Portable one-lane fallback.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Simd for Scalar {
    const LANES: usize = 1;
    type V = f32;
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> f32 {
        half::f16::from_bits(*p).to_f32()
    }
    #[inline(always)]
    unsafe fn load_e4m3(p: *const u8) -> f32 {
        crate::e4m3::e4m3_to_f32(*p)
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        if a > b {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    unsafe fn hsum(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn hmax(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn round(v: f32) -> f32 {
        v.round_ties_even()
    }
    #[inline(always)]
    unsafe fn ldexp(v: f32, n: f32) -> f32 {
        v * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }
    #[inline(always)]
    unsafe fn zero_below(x: f32, t: f32, v: f32) -> f32 {
        if x < t {
            0.0
        } else {
            v
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Simd;
    use std::arch::x86_64::*;

    /// 8 lanes; requires avx2, fma, f16c.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        #[inline(always)]
        unsafe fn load_e4m3(p: *const u8) -> __m256 {
            // 8 bytes sign-extended to 8 i16 lanes: << 7 puts the 7 value bits at f16's 13..7
            // and the sign at bit 15 (bit 14, the sign's copy, masked off); times 2^8
            let x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i)), 7);
            let h16 = _mm_and_si128(x, _mm_set1_epi16(0xBF80u16 as i16));
            let h = _mm256_cvtph_ps(h16);
            _mm256_mul_ps(h, _mm256_set1_ps(crate::e4m3::E4M3_F16_FACTOR))
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn hsum(v: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
        #[inline(always)]
        unsafe fn hmax(v: __m256) -> f32 {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
        #[inline(always)]
        unsafe fn round(v: __m256) -> __m256 {
            _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
        }
        #[inline(always)]
        unsafe fn ldexp(v: __m256, n: __m256) -> __m256 {
            let e = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                23,
            );
            _mm256_mul_ps(v, _mm256_castsi256_ps(e))
        }
        #[inline(always)]
        unsafe fn zero_below(x: __m256, t: __m256, v: __m256) -> __m256 {
            _mm256_andnot_ps(_mm256_cmp_ps(x, t, _CMP_LT_OQ), v)
        }
    }

    /// 16 lanes; requires avx512f.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
        #[inline(always)]
        unsafe fn load_e4m3(p: *const u8) -> __m512 {
            // 16 bytes sign-extended to 16 i16 lanes, shifted and masked as in the AVX2 load
            let x = _mm256_slli_epi16(
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i)),
                7,
            );
            let h16 = _mm256_and_si256(x, _mm256_set1_epi16(0xBF80u16 as i16));
            let h = _mm512_cvtph_ps(h16);
            _mm512_mul_ps(h, _mm512_set1_ps(crate::e4m3::E4M3_F16_FACTOR))
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn hsum(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }
        #[inline(always)]
        unsafe fn hmax(v: __m512) -> f32 {
            _mm512_reduce_max_ps(v)
        }
        #[inline(always)]
        unsafe fn round(v: __m512) -> __m512 {
            _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
        }
        #[inline(always)]
        unsafe fn ldexp(v: __m512, n: __m512) -> __m512 {
            _mm512_scalef_ps(v, n)
        }
        #[inline(always)]
        unsafe fn zero_below(x: __m512, t: __m512, v: __m512) -> __m512 {
            let m = _mm512_cmp_ps_mask(x, t, _CMP_LT_OQ);
            _mm512_maskz_mov_ps(!m, v)
        }
    }
}
