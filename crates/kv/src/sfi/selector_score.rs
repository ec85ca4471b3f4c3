//! SFI Selector fast path, per-token stage (methods.md §1.4 steps 2-8 after the row pass): the
//! reusable scratch buffers, the position prior, per-head scoring (evidence, prior, lambda, fused
//! score, soft-NMS), cross-head exclusivity and the equalised count.
use super::selector::{mixing_lambda, SelectorConfig, SelectorInput};
use super::selector_math as math;

/// Reusable buffers of the fast path; grows to the largest call and is then reused.
#[derive(Debug, Default, Clone)]
pub struct SelectorScratch {
    pub(super) colmax: Vec<f32>, // [n_kv_heads, n] max logit over rows (-inf: token invisible to the head)
    pub(super) acc: Vec<f32>,    // [n_kv_heads, n] sum_r p_r(j)^alpha
    pub(super) acc64: Vec<f64>,  // [n] geometric-mean path: sum_r log p_r(j)
    pub(super) rowbuf: Vec<f32>, // [n] exp(alpha (z - m)) of one row
    pub(super) rowmax: Vec<f32>, // [n_kv_heads, rows]
    pub(super) pos_prior: Vec<f64>, // [n] log delta(j)
    pub(super) lin_f: Vec<f64>,  // [n]
    pub(super) lin_r: Vec<f64>,  // [n]
    pub(super) scores: Vec<f64>, // [n_kv_heads, n] log s, then log s', then log s''
    pub(super) nms: [Vec<f64>; 3], // [n] each: block prefix max, block suffix max, pooled
    pub(super) idx: Vec<u32>,    // [n] candidate offsets
    pub(super) valid_rows: Vec<usize>, // [n_kv_heads]
}

pub(super) fn fit<T: Clone>(v: &mut Vec<T>, len: usize, fill: T) {
    v.clear();
    v.resize(len, fill);
}

/// Position part of the prior for the whole domain (vectorised `log_pos_prior`; key index j
/// at position `positions[j]` when given, else j); `tmp` is scratch.
pub(super) fn pos_prior(
    cfg: &SelectorConfig,
    lo: usize,
    hi: usize,
    positions: Option<&[u32]>,
    out: &mut [f64],
    tmp: &mut [f64],
) {
    let at = |i: usize| positions.map_or(i, |p| p[i] as usize);
    let (first, last) = (at(lo), at(hi.max(lo + 1) - 1));
    let span = (last - first).max(1) as f64;
    let p = cfg.prior_pos_power.max(1.0);
    for (i, (u, t)) in out.iter_mut().zip(tmp.iter_mut()).enumerate() {
        let pj = at(lo + i);
        *u = ((pj - first) as f64 / span).clamp(0.0, 1.0);
        *t = ((last - pj) as f64 / span).max(cfg.eps);
    }
    math::ln_slice(out);
    out.iter_mut().for_each(|v| *v *= p);
    math::exp_slice(out); // u^p
    math::ln_slice(tmp);
    for (v, &t) in out.iter_mut().zip(tmp.iter()) {
        *v = -cfg.prior_beta * *v + cfg.prior_pos_eta * t;
    }
}

/// Subtracts the max of the finite entries and exponentiates (all -inf: all 0).
fn exp_rel_max(x: &mut [f64]) {
    let mx = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if mx == f64::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    x.iter_mut().for_each(|v| *v -= mx);
    math::exp_slice(x);
}

dispatch!(score_head, score_head_body, (cfg: &SelectorConfig, inp: &SelectorInput, sc: &mut SelectorScratch, h: usize, geometric: bool) -> ());
dispatch!(cross_head, cross_head_body, (cfg: &SelectorConfig, sc: &mut SelectorScratch, nh: usize, n: usize) -> ());

/// Per-token scoring of head `h`: evidence f, prior r, lambda, fused log s, soft-NMS.
/// (Index loops: each walks several [n] buffers in step, and vectorise as written.)
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn score_head_body(
    cfg: &SelectorConfig,
    inp: &SelectorInput,
    sc: &mut SelectorScratch,
    h: usize,
    geometric: bool,
) {
    let (lo, hi) = (inp.sinks, inp.recent_start);
    let n = hi - lo;
    let vis = &sc.colmax[h * n..(h + 1) * n];
    let acc = &sc.acc[h * n..(h + 1) * n];
    let norms = &inp.key_norms[h * inp.seq_len + lo..h * inp.seq_len + hi];
    fit(&mut sc.lin_f, n, 0.0);
    fit(&mut sc.lin_r, n, 0.0);
    if sc.valid_rows[h] == 0 {
        return; // no row sees the domain: every score stays -inf
    }
    let hidden = |j: usize| vis[j] == f32::NEG_INFINITY;
    // Evidence f (linear, relative to its max; normalised below).
    if geometric {
        let inv_rows = 1.0 / sc.valid_rows[h] as f64;
        for j in 0..n {
            sc.lin_f[j] = if hidden(j) {
                f64::NEG_INFINITY
            } else {
                sc.acc64[j] * inv_rows
            };
        }
        exp_rel_max(&mut sc.lin_f);
    } else if cfg.alpha != 0.5 {
        for j in 0..n {
            sc.lin_f[j] = acc[j] as f64;
        }
        math::ln_slice(&mut sc.lin_f);
        let inv_a = 1.0 / cfg.alpha;
        for j in 0..n {
            sc.lin_f[j] = if hidden(j) {
                f64::NEG_INFINITY
            } else {
                sc.lin_f[j] * inv_a
            };
        }
        exp_rel_max(&mut sc.lin_f);
    } else {
        for j in 0..n {
            let a = acc[j] as f64;
            sc.lin_f[j] = a * a;
        }
    }
    // Prior r.
    for j in 0..n {
        sc.lin_r[j] = (norms[j] as f64).max(cfg.eps);
    }
    math::ln_slice(&mut sc.lin_r);
    let wl = -cfg.gamma * cfg.prior_weight_l2;
    for j in 0..n {
        let lr = wl * sc.lin_r[j] + cfg.prior_weight_pos * sc.pos_prior[j];
        sc.lin_r[j] = if hidden(j) { f64::NEG_INFINITY } else { lr };
    }
    exp_rel_max(&mut sc.lin_r);
    let zf: f64 = sc.lin_f.iter().sum();
    let zr: f64 = sc.lin_r.iter().sum();
    let (inv_f, inv_r) = (if zf > 0.0 { 1.0 / zf } else { 0.0 }, 1.0 / zr);
    let (mut ff, mut rr, mut fr) = (0.0, 0.0, 0.0);
    for j in 0..n {
        let (f, r) = (sc.lin_f[j] * inv_f, sc.lin_r[j] * inv_r);
        sc.lin_f[j] = f;
        sc.lin_r[j] = r;
        ff += f * f;
        rr += r * r;
        fr += f * r;
    }
    let lam = mixing_lambda(cfg, ff, rr, fr, sc.valid_rows[h]);
    // Fused score s = (1 - lam) f + (lam + eps) r, normalised, in log space.
    let (wf, wr) = (1.0 - lam, lam + cfg.eps);
    for j in 0..n {
        sc.lin_f[j] = wf * sc.lin_f[j] + wr * sc.lin_r[j];
    }
    let inv_s = 1.0 / sc.lin_f.iter().sum::<f64>();
    sc.lin_f.iter_mut().for_each(|v| *v *= inv_s);
    math::ln_slice(&mut sc.lin_f);
    let scores = &mut sc.scores[h * n..(h + 1) * n];
    for j in 0..n {
        scores[j] = if hidden(j) {
            f64::NEG_INFINITY
        } else {
            sc.lin_f[j]
        };
    }
    // Soft-NMS.
    let half = cfg.nms_window / 2;
    if half > 0 && cfg.soft_alpha != 0.0 {
        let [g, hb, pooled] = &mut sc.nms;
        math::sliding_max(scores, half, g, hb, pooled);
        let shift = cfg.nms_shift;
        if shift > 0 {
            // Key j pools the window centred on j - shift: pooled[j - shift] for j >= shift
            // (same clipping). The first `shift` keys see the clipped prefix
            // [0, j + half - shift] (empty: -inf), kept in `g` as a running maximum.
            let m = shift.min(n);
            g.clear();
            let (mut run, mut next) = (f64::NEG_INFINITY, 0usize);
            for j in 0..m {
                if j + half >= shift {
                    let upper = (j + half - shift).min(n - 1);
                    while next <= upper {
                        run = run.max(scores[next]);
                        next += 1;
                    }
                    g.push(run);
                } else {
                    g.push(f64::NEG_INFINITY);
                }
            }
            for j in (m..n).rev() {
                pooled[j] = pooled[j - shift];
            }
            pooled[..m].copy_from_slice(g);
        }
        for j in 0..n {
            let s = scores[j];
            if s > f64::NEG_INFINITY {
                scores[j] = s - cfg.soft_alpha * (pooled[j] - s).max(0.0);
            }
        }
    }
}

/// Cross-head exclusivity, in place on log s' of every head (head-major passes that vectorise).
#[inline(always)]
fn cross_head_body(cfg: &SelectorConfig, sc: &mut SelectorScratch, nh: usize, n: usize) {
    let inv_t = 1.0 / cfg.cross_head_temperature;
    let leps = cfg.eps.ln();
    let [mx, sum, tmp] = &mut sc.nms;
    fit(mx, n, f64::NEG_INFINITY);
    fit(sum, n, 0.0);
    fit(tmp, n, 0.0);
    for h in 0..nh {
        for (m, &s) in mx.iter_mut().zip(&sc.scores[h * n..(h + 1) * n]) {
            *m = m.max(s * inv_t);
        }
    }
    mx.iter_mut()
        .for_each(|m| *m = if *m == f64::NEG_INFINITY { 0.0 } else { *m });
    for h in 0..nh {
        for ((t, &s), &m) in tmp
            .iter_mut()
            .zip(&sc.scores[h * n..(h + 1) * n])
            .zip(mx.iter())
        {
            *t = s * inv_t - m; // -inf for tokens head h does not see: exp gives 0
        }
        math::exp_slice(tmp);
        sum.iter_mut().zip(tmp.iter()).for_each(|(a, &t)| *a += t);
    }
    math::ln_slice(sum);
    sum.iter_mut().zip(mx.iter()).for_each(|(a, &m)| *a += m); // LSE_h(log s' / T)
    for h in 0..nh {
        for (s, &lse) in sc.scores[h * n..(h + 1) * n].iter_mut().zip(sum.iter()) {
            // -inf stays -inf (f64::max ignores the NaN of -inf - -inf).
            *s += cfg.cross_head_alpha * (*s * inv_t - lse).max(leps);
        }
    }
}

/// The equalised count: min over heads of min(k, number of finite final scores).
pub(super) fn equal_count(scores: &[f64], nh: usize, n: usize, k: usize) -> usize {
    (0..nh)
        .map(|h| {
            scores[h * n..(h + 1) * n]
                .iter()
                .filter(|s| **s > f64::NEG_INFINITY)
                .count()
                .min(k)
        })
        .min()
        .unwrap_or(0)
}
