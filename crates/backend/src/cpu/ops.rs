//! Elementwise CPU ops of the decoder: RMSNorm, RoPE (NeoX rotate-half layout), gated
//! activations, residual adds. Written as plain loops that the compiler vectorizes.

/// `out[i] = x[i] / rms(x) * w[i]` for each row of `dim` values; `x`, `out` are `[rows, dim]`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// In-place RMSNorm of every `w.len()`-sized chunk of `x` (per-head q/k norm).
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for xr in x.chunks_exact_mut(dim) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v *= inv * g;
        }
    }
}

/// Rotate each head of `x` (`[rows, n_heads, head_dim]`) by the angles `pos[row] * inv_freq[i]`
/// in the NeoX layout: pairs are `(x[i], x[i + head_dim/2])`. `cos`/`sin` are `[rows, head_dim/2]`.
pub fn rope_inplace(x: &mut [f32], n_heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (r, row) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        let (c, s) = (
            &cos[r * half..(r + 1) * half],
            &sin[r * half..(r + 1) * half],
        );
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * c[i] - x1 * s[i];
                b[i] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

/// `cos`/`sin` tables (`[positions.len(), inv_freq.len()]`) for the given positions. Angles are
/// computed in f64 so long positions keep their precision.
pub fn rope_tables(
    positions: impl Iterator<Item = usize>,
    inv_freq: &[f64],
    cos: &mut Vec<f32>,
    sin: &mut Vec<f32>,
) {
    cos.clear();
    sin.clear();
    for p in positions {
        for &f in inv_freq {
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// gelu with the tanh approximation (PyTorch `gelu(approximate="tanh")`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]`.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// `x[i] += y[i]`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x[r, i] += b[i]` for every row `r` of `x` (`[rows, b.len()]`): a linear layer's bias.
pub fn add_bias(x: &mut [f32], b: &[f32]) {
    debug_assert!(b.is_empty() || x.len().is_multiple_of(b.len()));
    for row in x.chunks_exact_mut(b.len()) {
        add_inplace(row, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_bias_adds_to_every_row() {
        let mut x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        add_bias(&mut x, &[10.0, 20.0, 30.0]);
        assert_eq!(x, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    }

    #[test]
    fn rmsnorm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 0.0, 4.0];
        let w = [1.0f32, 2.0, 0.5];
        let mut out = [0.0; 6];
        rmsnorm(&x, &w, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * 3..r * 3 + 3];
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 3.0;
            for i in 0..3 {
                let want = row[i] as f64 / (ms + 1e-6).sqrt() * w[i] as f64;
                assert!((out[r * 3 + i] as f64 - want).abs() < 1e-6);
            }
        }
        let mut y = x;
        rmsnorm_inplace(&mut y, &w, 1e-6);
        assert_eq!(y, out);
    }

    #[test]
    fn rope_rotates_pairs_and_preserves_norm() {
        let (nh, hd) = (2, 8);
        let inv: Vec<f64> = (0..hd / 2)
            .map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / hd as f64))
            .collect();
        let (mut c, mut s) = (Vec::new(), Vec::new());
        rope_tables([0usize, 7].into_iter(), &inv, &mut c, &mut s);
        let x0: Vec<f32> = (0..2 * nh * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut x = x0.clone();
        rope_inplace(&mut x, nh, hd, &c, &s);
        // position 0 is the identity
        assert_eq!(&x[..nh * hd], &x0[..nh * hd]);
        // position 7: pair (i, i + hd/2) rotated by 7 * inv[i]
        for h in 0..nh {
            let b = nh * hd + h * hd;
            for i in 0..hd / 2 {
                let a = 7.0 * inv[i];
                let (p, q) = (x0[b + i] as f64, x0[b + i + hd / 2] as f64);
                assert!((x[b + i] as f64 - (p * a.cos() - q * a.sin())).abs() < 1e-5);
                assert!((x[b + i + hd / 2] as f64 - (p * a.sin() + q * a.cos())).abs() < 1e-5);
            }
            let n0: f32 = x0[b..b + hd].iter().map(|v| v * v).sum();
            let n1: f32 = x[b..b + hd].iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
        }
    }

    #[test]
    fn activations_match_definitions() {
        let g0 = [-3.0f32, -0.5, 0.0, 0.7, 2.5];
        let up = [1.0f32, 2.0, 3.0, -1.0, 0.5];
        let mut g = g0;
        silu_mul(&mut g, &up);
        for i in 0..5 {
            let x = g0[i] as f64;
            assert!((g[i] as f64 - x / (1.0 + (-x).exp()) * up[i] as f64).abs() < 1e-6);
        }
        let mut g = g0;
        gelu_tanh_mul(&mut g, &up);
        for i in 0..5 {
            let x = g0[i] as f64;
            let want = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
            assert!((g[i] as f64 - want * up[i] as f64).abs() < 1e-5);
        }
    }
}
