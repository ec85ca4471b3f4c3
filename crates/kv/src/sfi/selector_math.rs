//! SIMD-friendly kernels of the fast Selector: the f32 row passes over captured logits (max,
//! exp-and-sum, accumulate) with runtime dispatch to AVX-512 / AVX2 builds of the same portable
//! code, a vectorisable f32 exp, and the O(n) sliding-window max used by soft-NMS.

const LANES: usize = 16;

/// How `row_exp` turns buf = exp(a (z - m)) into the row's softmax denominator sum exp(z - m).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PowMode {
    /// a = 1/2: exp(z - m) = buf^2.
    Square,
    /// a = 1: exp(z - m) = buf.
    Identity,
    /// Any other a: a second exp.
    Separate,
}

/// exp(x) in f32 for x <= 0 (larger x is clamped to 88): Cody-Waite reduction and a degree-7
/// polynomial, relative error ~1e-7; returns 0 below -87 (so exp(-inf) = 0).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + MAGIC;
    let nf = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = xc - nf * LN2_HI - nf * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

#[inline(always)]
pub(crate) fn row_max_colmax_body(z: &[f32], colmax: &mut [f32]) -> (f32, bool) {
    let mut mx = [f32::NEG_INFINITY; LANES];
    let mut bad = [0u32; LANES];
    let mut zc = z.chunks_exact(LANES);
    let mut cc = colmax.chunks_exact_mut(LANES);
    for (zs, cs) in (&mut zc).zip(&mut cc) {
        for i in 0..LANES {
            let v = zs[i];
            mx[i] = if v > mx[i] { v } else { mx[i] };
            cs[i] = if v > cs[i] { v } else { cs[i] };
            bad[i] += (v.is_nan() | (v == f32::INFINITY)) as u32;
        }
    }
    let mut m = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut nbad: u32 = bad.iter().sum();
    for (&v, c) in zc.remainder().iter().zip(cc.into_remainder()) {
        m = if v > m { v } else { m };
        *c = if v > *c { v } else { *c };
        nbad += (v.is_nan() | (v == f32::INFINITY)) as u32;
    }
    (m, nbad > 0)
}

#[inline(always)]
pub(crate) fn row_exp_body(z: &[f32], m: f32, a: f32, mode: PowMode, buf: &mut [f32]) -> f64 {
    let mut sum = [0.0f64; LANES];
    let mut zc = z.chunks_exact(LANES);
    let mut bc = buf.chunks_exact_mut(LANES);
    for (zs, bs) in (&mut zc).zip(&mut bc) {
        let mut e = [0f32; LANES];
        let mut t = [0f32; LANES];
        for i in 0..LANES {
            e[i] = exp_f32(a * (zs[i] - m));
        }
        match mode {
            PowMode::Square => (0..LANES).for_each(|i| t[i] = e[i] * e[i]),
            PowMode::Identity => t = e,
            PowMode::Separate => (0..LANES).for_each(|i| t[i] = exp_f32(zs[i] - m)),
        }
        bs.copy_from_slice(&e);
        for i in 0..LANES {
            sum[i] += t[i] as f64;
        }
    }
    let mut total: f64 = sum.iter().sum();
    for (&v, b) in zc.remainder().iter().zip(bc.into_remainder()) {
        let e = exp_f32(a * (v - m));
        *b = e;
        total += match mode {
            PowMode::Square => e * e,
            PowMode::Identity => e,
            PowMode::Separate => exp_f32(v - m),
        } as f64;
    }
    total
}

#[inline(always)]
pub(crate) fn axpy_body(acc: &mut [f32], x: &[f32], c: f32) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += c * v;
    }
}

/// ln 2 split into a high part with trailing zero bits (exact products with small integers) and
/// the rest (fdlibm's constants).
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);

/// exp(x) in f64: Cody-Waite reduction and a degree-12 Taylor polynomial (error ~2 ulp);
/// x < -708 (and -inf) gives 0, x > 709 is clamped. Branch-free so that loops vectorise.
#[inline(always)]
pub(crate) fn exp_f64(x: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let xc = x.clamp(-708.0, 709.0);
    let t = xc * std::f64::consts::LOG2_E + MAGIC;
    let nf = t - MAGIC;
    let ni = (t.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
    let r = (xc - nf * LN2_HI) - nf * LN2_LO;
    let mut p = 1.0 / 479_001_600.0;
    for c in [
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    let scale = f64::from_bits(((ni + 1023) as u64) << 52);
    if x < -708.0 {
        0.0
    } else {
        p * scale
    }
}

/// ln(x) in f64 for x >= 0 (0 gives -inf; subnormals are rescaled): mantissa in [sqrt(1/2),
/// sqrt(2)), then 2 atanh(s) as a series in s^2 (error ~2 ulp). Branch-free.
#[inline(always)]
pub(crate) fn ln_f64(x: f64) -> f64 {
    let sub = x < f64::MIN_POSITIVE;
    let xs = if sub { x * 18_014_398_509_481_984.0 } else { x }; // 2^54
    let bits = xs.to_bits();
    let mut m = f64::from_bits((bits & 0x000F_FFFF_FFFF_FFFF) | 0x3FF0_0000_0000_0000);
    // Exponent as f64 without an int->float conversion: 2^52 + e_biased, minus the bias.
    let mut e =
        f64::from_bits(0x4330_0000_0000_0000 | (bits >> 52)) - (4_503_599_627_370_496.0 + 1023.0);
    e -= if sub { 54.0 } else { 0.0 };
    let big = m > std::f64::consts::SQRT_2;
    m = if big { m * 0.5 } else { m };
    e += if big { 1.0 } else { 0.0 };
    let s = (m - 1.0) / (m + 1.0);
    let w = s * s;
    let mut p = 1.0 / 23.0;
    for c in [
        1.0 / 21.0,
        1.0 / 19.0,
        1.0 / 17.0,
        1.0 / 15.0,
        1.0 / 13.0,
        1.0 / 11.0,
        1.0 / 9.0,
        1.0 / 7.0,
        1.0 / 5.0,
        1.0 / 3.0,
        1.0,
    ] {
        p = p * w + c;
    }
    let r = e * LN2_HI + (2.0 * s * p + e * LN2_LO);
    if x > 0.0 {
        r
    } else {
        f64::NEG_INFINITY
    }
}

#[inline(always)]
pub(crate) fn exp_slice_body(x: &mut [f64]) {
    x.iter_mut().for_each(|v| *v = exp_f64(*v));
}

#[inline(always)]
pub(crate) fn ln_slice_body(x: &mut [f64]) {
    x.iter_mut().for_each(|v| *v = ln_f64(*v));
}

dispatch!(row_max_colmax, row_max_colmax_body, (z: &[f32], colmax: &mut [f32]) -> (f32, bool));
dispatch!(row_exp, row_exp_body, (z: &[f32], m: f32, a: f32, mode: PowMode, buf: &mut [f32]) -> f64);
dispatch!(axpy, axpy_body, (acc: &mut [f32], x: &[f32], c: f32) -> ());
dispatch!(exp_slice, exp_slice_body, (x: &mut [f64]) -> ());
dispatch!(ln_slice, ln_slice_body, (x: &mut [f64]) -> ());

/// out[j] = max of x over [j - half, j + half] clipped to the slice (van Herk / Gil-Werman:
/// block prefix and suffix maxima, O(n)). `g` and `h` are scratch.
pub(crate) fn sliding_max(
    x: &[f64],
    half: usize,
    g: &mut Vec<f64>,
    h: &mut Vec<f64>,
    out: &mut Vec<f64>,
) {
    let n = x.len();
    let w = 2 * half + 1;
    g.clear();
    g.extend_from_slice(x);
    h.clear();
    h.extend_from_slice(x);
    out.clear();
    out.resize(n, f64::NEG_INFINITY);
    for start in (0..n).step_by(w) {
        let end = (start + w).min(n);
        for j in start + 1..end {
            g[j] = g[j].max(g[j - 1]);
        }
        for j in (start..end - 1).rev() {
            h[j] = h[j].max(h[j + 1]);
        }
    }
    let clipped = |j: usize| {
        let a = j.saturating_sub(half);
        let b = (j + half).min(n - 1);
        if a / w != b / w {
            h[a].max(g[b])
        } else if a.is_multiple_of(w) {
            g[b]
        } else {
            h[a]
        }
    };
    let (left, right) = (half.min(n), n.saturating_sub(half).max(half.min(n)));
    for j in (0..left).chain(right..n) {
        out[j] = clipped(j);
    }
    // Full-width windows [j - half, j + half] span one whole block or two blocks.
    for j in left..right {
        out[j] = h[j - half].max(g[j + half]);
    }
}

/// Portable builds of the row kernels, for tests comparing them with the dispatched ones.
#[cfg(test)]
pub(crate) mod portable {
    pub(crate) use super::{
        axpy_body as axpy, exp_slice_body as exp_slice, ln_slice_body as ln_slice,
        row_exp_body as row_exp, row_max_colmax_body as row_max_colmax,
    };
}
