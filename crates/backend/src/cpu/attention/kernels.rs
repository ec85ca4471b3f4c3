//! Register-blocked micro-kernels of the tiled attention, written once against `Simd`:
//! Q·Kᵀ in two layouts (column-major scores for prefill, row-major for decode), P·V, and
//! the online-softmax tile updates. All `#[inline(always)]`: they get their ISA from the
//! `#[target_feature]` entry points in `tile.rs`.
//!
//! Safety contract (all functions): pointers are valid for the extents named in the docs.

#![allow(clippy::too_many_arguments)]

use super::elem::{load, KvElem};
use super::simd::{exp, Simd};

/// Scores in column layout: `st[j * rows_pad + r] = Σ_c qt[c * rows_pad + r] * k[j * d + c]`
/// for keys `j < nk` and rows `r < rows_pad` (a multiple of `2 * S::LANES`).
/// `qt`: [d, rows_pad] (pre-scaled queries, transposed); `k`: [nk, d] f32; `st`: [nk, rows_pad].
#[inline(always)]
pub(crate) unsafe fn qk_cols<S: Simd>(
    qt: *const f32,
    rows_pad: usize,
    d: usize,
    k: *const f32,
    nk: usize,
    st: *mut f32,
) {
    let mut r = 0;
    while r < rows_pad {
        let (qt, st) = (qt.add(r), st.add(r));
        let mut j = 0;
        // 8 keys x 2 vectors = 16 accumulators fit AVX-512's 32 registers; 16-register ISAs
        // take 4 keys at a time.
        if S::LANES >= 16 {
            while j + 8 <= nk {
                qk_cols_block::<S, 8>(qt, rows_pad, d, k.add(j * d), st.add(j * rows_pad));
                j += 8;
            }
        }
        while j + 4 <= nk {
            qk_cols_block::<S, 4>(qt, rows_pad, d, k.add(j * d), st.add(j * rows_pad));
            j += 4;
        }
        let (kj, sj) = (k.add(j * d), st.add(j * rows_pad));
        match nk - j {
            3 => qk_cols_block::<S, 3>(qt, rows_pad, d, kj, sj),
            2 => qk_cols_block::<S, 2>(qt, rows_pad, d, kj, sj),
            1 => qk_cols_block::<S, 1>(qt, rows_pad, d, kj, sj),
            _ => {}
        }
        r += 2 * S::LANES;
    }
}

/// MR keys x (2 vectors of rows) block of `qk_cols`.
#[inline(always)]
unsafe fn qk_cols_block<S: Simd, const MR: usize>(
    qt: *const f32,
    rows_pad: usize,
    d: usize,
    k: *const f32,
    st: *mut f32,
) {
    let z = S::splat(0.0);
    let mut acc = [[z; 2]; MR];
    for c in 0..d {
        let q0 = S::load(qt.add(c * rows_pad));
        let q1 = S::load(qt.add(c * rows_pad + S::LANES));
        for (m, a) in acc.iter_mut().enumerate() {
            let kb = S::splat(*k.add(m * d + c));
            a[0] = S::fma(kb, q0, a[0]);
            a[1] = S::fma(kb, q1, a[1]);
        }
    }
    for (m, a) in acc.iter().enumerate() {
        S::store(st.add(m * rows_pad), a[0]);
        S::store(st.add(m * rows_pad + S::LANES), a[1]);
    }
}

/// Scores in row layout: `s[r * ld + j] = Σ_c q[r * d + c] * k[j * d + c]` for `r < rows`,
/// `j < nk`. `q`: [rows, d] pre-scaled; `k`: [nk, d]; `d` a multiple of `S::LANES`.
/// Meanwhile prefetches the value rows `v` [nk, d] that P·V reads next (P·V walks them in
/// column blocks, a pattern the hardware prefetcher does not follow from DRAM).
#[inline(always)]
pub(crate) unsafe fn qk_rows<T: KvElem, S: Simd>(
    q: *const f32,
    rows: usize,
    d: usize,
    k: *const T,
    nk: usize,
    s: *mut f32,
    ld: usize,
    v: *const T,
    next: NextTile<T>,
) {
    let mut r = 0;
    while r < rows {
        let (q, s) = (q.add(r * d), s.add(r * ld));
        let pf = if r == 0 { v } else { std::ptr::null() };
        match rows - r {
            1 => qk_rows_block::<T, S, 1>(q, d, k, nk, s, ld, pf, next),
            2 => qk_rows_block::<T, S, 2>(q, d, k, nk, s, ld, pf, next),
            3 => qk_rows_block::<T, S, 3>(q, d, k, nk, s, ld, pf, next),
            _ => qk_rows_block::<T, S, 4>(q, d, k, nk, s, ld, pf, next),
        }
        r += 4;
    }
}

/// Keys ahead of the current one whose rows `qk_rows` prefetches.
const K_PREFETCH: usize = 8;

/// Prefetches row `j` of `v` [_, d] (no-op for a null `v`). The address may lie past the
/// rows (prefetch never faults), hence the wrapping arithmetic.
#[inline(always)]
unsafe fn prefetch_row<T, S: Simd>(v: *const T, j: usize, d: usize) {
    if v.is_null() {
        return;
    }
    let bytes = d * std::mem::size_of::<T>();
    let row = (v as *const u8).wrapping_add(j * bytes);
    let mut b = 0;
    while b < bytes {
        S::prefetch(row.wrapping_add(b));
        b += 64;
    }
}

/// The keys and values a decode tile reads after the current one (`n` rows; null and 0 at the
/// end), so prefetches run across a KV block's end into the next block instead of the memory
/// after it.
#[derive(Clone, Copy)]
pub(crate) struct NextTile<T> {
    pub k: *const T,
    pub v: *const T,
    pub n: usize,
}

impl<T> NextTile<T> {
    pub(crate) const NONE: NextTile<T> = NextTile {
        k: std::ptr::null(),
        v: std::ptr::null(),
        n: 0,
    };
}

/// Prefetches the key and value rows `j` of a tile of `nk` rows at `k`, `v`; past the tile, row
/// `j - nk` of the next tile.
#[inline(always)]
unsafe fn prefetch_ahead<T, S: Simd>(
    k: *const T,
    v: *const T,
    nk: usize,
    next: NextTile<T>,
    j: usize,
    d: usize,
) {
    if j < nk {
        prefetch_row::<T, S>(k, j, d);
        prefetch_row::<T, S>(v, j, d);
    } else if j - nk < next.n {
        prefetch_row::<T, S>(next.k, j - nk, d);
        prefetch_row::<T, S>(next.v, j - nk, d);
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_rows_block<T: KvElem, S: Simd, const MR: usize>(
    q: *const f32,
    d: usize,
    k: *const T,
    nk: usize,
    s: *mut f32,
    ld: usize,
    pf: *const T,
    next: NextTile<T>,
) {
    let z = S::splat(0.0);
    let mut j = 0;
    // Two keys at a time: 2*MR independent accumulator chains.
    while j + 2 <= nk {
        prefetch_row::<T, S>(pf, j, d);
        prefetch_row::<T, S>(pf, j + 1, d);
        if !pf.is_null() {
            prefetch_ahead::<T, S>(k, pf, nk, next, j + K_PREFETCH, d);
            prefetch_ahead::<T, S>(k, pf, nk, next, j + 1 + K_PREFETCH, d);
        }
        let (k0, k1) = (k.add(j * d), k.add((j + 1) * d));
        let mut a0 = [z; MR];
        let mut a1 = [z; MR];
        let mut c = 0;
        while c < d {
            let kv0 = load::<T, S>(k0.add(c));
            let kv1 = load::<T, S>(k1.add(c));
            for m in 0..MR {
                let qv = S::load(q.add(m * d + c));
                a0[m] = S::fma(qv, kv0, a0[m]);
                a1[m] = S::fma(qv, kv1, a1[m]);
            }
            c += S::LANES;
        }
        for m in 0..MR {
            *s.add(m * ld + j) = S::hsum(a0[m]);
            *s.add(m * ld + j + 1) = S::hsum(a1[m]);
        }
        j += 2;
    }
    if j < nk {
        prefetch_row::<T, S>(pf, j, d);
        let k0 = k.add(j * d);
        let mut a0 = [z; MR];
        let mut c = 0;
        while c < d {
            let kv0 = load::<T, S>(k0.add(c));
            for (m, a) in a0.iter_mut().enumerate() {
                *a = S::fma(S::load(q.add(m * d + c)), kv0, *a);
            }
            c += S::LANES;
        }
        for (m, a) in a0.iter().enumerate() {
            *s.add(m * ld + j) = S::hsum(*a);
        }
    }
}

/// `o[r * d + c] += Σ_{j < nk} p[r * p_rs + j * p_ks] * v[j * d + c]` for `r < rows`, all `c < d`.
/// `o`: [rows, d]; `v`: [nk, d]; `d` a multiple of `S::LANES`.
#[inline(always)]
pub(crate) unsafe fn pv<T: KvElem, S: Simd>(
    p: *const f32,
    p_rs: usize,
    p_ks: usize,
    rows: usize,
    nk: usize,
    v: *const T,
    d: usize,
    o: *mut f32,
) {
    let nvec = d / S::LANES;
    let mut r = 0;
    while r < rows {
        let (p, o) = (p.add(r * p_rs), o.add(r * d));
        match rows - r {
            1 => pv_rows::<T, S, 1>(p, p_rs, p_ks, nk, v, d, nvec, o),
            2 => pv_rows::<T, S, 2>(p, p_rs, p_ks, nk, v, d, nvec, o),
            3 => pv_rows::<T, S, 3>(p, p_rs, p_ks, nk, v, d, nvec, o),
            _ => pv_rows::<T, S, 4>(p, p_rs, p_ks, nk, v, d, nvec, o),
        }
        r += 4;
    }
}

#[inline(always)]
unsafe fn pv_rows<T: KvElem, S: Simd, const MR: usize>(
    p: *const f32,
    p_rs: usize,
    p_ks: usize,
    nk: usize,
    v: *const T,
    d: usize,
    nvec: usize,
    o: *mut f32,
) {
    // 4 x 4 accumulators fit AVX-512's 32 registers; narrower ISAs (16 registers) use 4 x 2.
    let nv_max = if S::LANES >= 16 { 4 } else { 2 };
    let mut n = 0;
    while n < nvec {
        let c = n * S::LANES;
        match (nvec - n).min(nv_max) {
            1 => pv_block::<T, S, MR, 1>(p, p_rs, p_ks, nk, v.add(c), d, o.add(c)),
            2 => pv_block::<T, S, MR, 2>(p, p_rs, p_ks, nk, v.add(c), d, o.add(c)),
            3 => pv_block::<T, S, MR, 3>(p, p_rs, p_ks, nk, v.add(c), d, o.add(c)),
            _ => pv_block::<T, S, MR, 4>(p, p_rs, p_ks, nk, v.add(c), d, o.add(c)),
        }
        n += nv_max.min(nvec - n);
    }
}

/// MR rows x NV vectors of output columns, accumulated in registers over all keys.
#[inline(always)]
unsafe fn pv_block<T: KvElem, S: Simd, const MR: usize, const NV: usize>(
    p: *const f32,
    p_rs: usize,
    p_ks: usize,
    nk: usize,
    v: *const T,
    d: usize,
    o: *mut f32,
) {
    let z = S::splat(0.0);
    let mut acc = [[z; NV]; MR];
    for (m, a) in acc.iter_mut().enumerate() {
        for (n, x) in a.iter_mut().enumerate() {
            *x = S::load(o.add(m * d + n * S::LANES));
        }
    }
    for j in 0..nk {
        let mut vv = [z; NV];
        for (n, x) in vv.iter_mut().enumerate() {
            *x = load::<T, S>(v.add(j * d + n * S::LANES));
        }
        for (m, a) in acc.iter_mut().enumerate() {
            let pb = S::splat(*p.add(m * p_rs + j * p_ks));
            for n in 0..NV {
                a[n] = S::fma(pb, vv[n], a[n]);
            }
        }
    }
    for (m, a) in acc.iter().enumerate() {
        for (n, x) in a.iter().enumerate() {
            S::store(o.add(m * d + n * S::LANES), *x);
        }
    }
}

/// Online-softmax step on column-layout scores `st` [nk, rows_pad] (rows_pad a multiple of
/// `S::LANES`): updates running max `m` and sum `l` [rows_pad], overwrites `st` with
/// `exp(s - m_new)` and writes the rescale factor of the old accumulator to `alpha` [rows_pad].
#[inline(always)]
pub(crate) unsafe fn softmax_cols<S: Simd>(
    st: *mut f32,
    nk: usize,
    rows_pad: usize,
    m: *mut f32,
    l: *mut f32,
    alpha: *mut f32,
) {
    let mut r = 0;
    while r < rows_pad {
        let m_old = S::load(m.add(r));
        let mut t = m_old;
        for j in 0..nk {
            t = S::max(t, S::load(st.add(j * rows_pad + r)));
        }
        // Finite stand-in for an all -inf max, so that exp(-inf - m) = 0 instead of NaN.
        let ms = S::max(t, S::splat(f32::MIN));
        let mut sum = S::splat(0.0);
        for j in 0..nk {
            let e = exp::<S>(S::sub(S::load(st.add(j * rows_pad + r)), ms));
            S::store(st.add(j * rows_pad + r), e);
            sum = S::add(sum, e);
        }
        let a = exp::<S>(S::sub(m_old, ms));
        S::store(alpha.add(r), a);
        S::store(l.add(r), S::fma(S::load(l.add(r)), a, sum));
        S::store(m.add(r), t);
        r += S::LANES;
    }
}

/// Online-softmax step on one row of row-layout scores `s` [nk_pad] (`nk_pad` a multiple of
/// `S::LANES`, entries past the real keys hold -inf). Returns (new max, new sum, alpha).
#[inline(always)]
pub(crate) unsafe fn softmax_row<S: Simd>(
    s: *mut f32,
    nk_pad: usize,
    m: f32,
    l: f32,
) -> (f32, f32, f32) {
    let mut t = S::splat(m);
    let mut j = 0;
    while j < nk_pad {
        t = S::max(t, S::load(s.add(j)));
        j += S::LANES;
    }
    let t = S::hmax(t);
    let ms = S::splat(t.max(f32::MIN));
    let mut sum = S::splat(0.0);
    let mut j = 0;
    while j < nk_pad {
        let e = exp::<S>(S::sub(S::load(s.add(j)), ms));
        S::store(s.add(j), e);
        sum = S::add(sum, e);
        j += S::LANES;
    }
    let alpha = (m - t.max(f32::MIN)).exp();
    let new_l = l * alpha + S::hsum(sum);
    (t, new_l, alpha)
}

/// `x[c] *= a` for `c < n` (n a multiple of `S::LANES`).
#[inline(always)]
pub(crate) unsafe fn scale<S: Simd>(x: *mut f32, n: usize, a: f32) {
    let av = S::splat(a);
    let mut c = 0;
    while c < n {
        S::store(x.add(c), S::mul(S::load(x.add(c)), av));
        c += S::LANES;
    }
}

/// Widens `n` elements (a multiple of `S::LANES`) from `src` to f32 at `dst`.
#[inline(always)]
pub(crate) unsafe fn widen<T: KvElem, S: Simd>(src: *const T, dst: *mut f32, n: usize) {
    let mut c = 0;
    while c < n {
        S::store(dst.add(c), load::<T, S>(src.add(c)));
        c += S::LANES;
    }
}
