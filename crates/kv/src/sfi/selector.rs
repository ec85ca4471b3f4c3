//! SFI Selector (methods.md §1.4), fast path: turns the attention logits captured at a slow step
//! plus the cached key norms into the per-kv-head token sets of the sparse memory. Rows are
//! reduced in f32 with SIMD kernels (`selector_math`), the per-token scoring runs in f64, and
//! every buffer lives in a reusable [`SelectorScratch`] (no allocation after warm-up).
use super::selector_math::{self as math, PowMode};
pub use super::selector_score::SelectorScratch;
use super::selector_score::{cross_head, equal_count, fit, pos_prior, score_head};
use thiserror::Error;

/// Selector knobs; `Default` gives the authors' defaults (AlphaFairSelectorConfig).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectorConfig {
    /// Power-mean exponent over rows (|alpha| < 1e-6: geometric mean). Must not be negative.
    pub alpha: f64,
    /// Key-norm prior exponent: log pi = -gamma * log max(|k|, eps).
    pub gamma: f64,
    pub prior_weight_l2: f64,
    pub prior_weight_pos: f64,
    /// Position prior power p (used as max(p, 1)).
    pub prior_pos_power: f64,
    pub prior_pos_eta: f64,
    pub prior_beta: f64,
    /// Soft-NMS window: the pooled max covers [j - w/2, j + w/2] (shifted by `nms_shift`).
    pub nms_window: usize,
    /// Shift of the soft-NMS / pooling window towards earlier keys (an extension, default 0):
    /// key j pools over [j - w/2 - shift, j + w/2 - shift] (clipped to the domain; empty:
    /// -inf, leaving the key's own score). With pooling (`soft_alpha` < 0) a peak at p then
    /// lifts the keys p + shift - w/2 ..= p + shift + w/2 (shift = w/2: the peak and the w
    /// keys after it, the keys a reader moving forward along a span will want next).
    pub nms_shift: usize,
    /// Soft-NMS strength a: log s' = log s - a * (pooled - log s). 0 turns it off; a < 0
    /// (down to -1, an extension) pools instead: a peak's neighbours move up towards it, so
    /// contiguous spans (a number, a name) are kept whole.
    pub soft_alpha: f64,
    pub cross_head_alpha: f64,
    pub cross_head_temperature: f64,
    pub lambda_clip_single: f64,
    pub lambda_clip_multi: f64,
    /// Use lambda_max * tanh(lambda / lambda_max) instead of the hard clip (default off).
    pub lambda_soft: bool,
    /// Normalise each captured row's probabilities over every key the row sees (sinks and
    /// recent window included) instead of over the candidate domain D, so that a row weighs
    /// in the evidence by the attention mass it puts on D (an extension, default off; the
    /// weighting of the diagnostic oracle). Changes step 1 only.
    pub evidence_mass: bool,
    pub eps: f64,
}

impl Default for SelectorConfig {
    fn default() -> Self {
        Self {
            alpha: 0.5,
            gamma: 0.5,
            prior_weight_l2: 1.0,
            prior_weight_pos: 0.7,
            prior_pos_power: 1.8,
            prior_pos_eta: 0.4,
            prior_beta: -(0.6f64.ln()) / 0.9,
            nms_window: 32,
            nms_shift: 0,
            soft_alpha: 1.0,
            cross_head_alpha: 0.85,
            cross_head_temperature: 2.0,
            lambda_clip_single: 0.35,
            lambda_clip_multi: 0.25,
            lambda_soft: false,
            evidence_mass: false,
            eps: 1e-12,
        }
    }
}

/// Inputs for one (layer, sequence).
#[derive(Debug, Clone, Copy)]
pub struct SelectorInput<'a> {
    pub n_kv_heads: usize,
    /// Rows per kv head: G query heads x W captured query positions.
    pub rows: usize,
    /// L: keys [0, L).
    pub seq_len: usize,
    /// Raw scaled logits z_r(j); -inf marks a key the row cannot see.
    pub logits: &'a [f32], // [n_kv_heads, rows, seq_len]
    /// L2 norm of each cached (post-RoPE) key.
    pub key_norms: &'a [f32], // [n_kv_heads, seq_len]
    /// S: the sinks [0, S) are always kept and never selected.
    pub sinks: usize,
    /// Page-aligned start of the recent window; the candidate domain is D = [sinks, recent_start).
    pub recent_start: usize,
    /// Budget of selected tokens per kv head.
    pub k: usize,
    /// Position of each key index `[0, seq_len)`, ascending, shared by all kv heads, when
    /// indices are cache slots rather than positions (a compacted layer, e.g. after FastKV's
    /// token-selective prefill); the position prior then spaces keys by their real positions.
    /// None: index j is position j.
    pub positions: Option<&'a [u32]>,
}

/// Selected positions per kv head, each sorted ascending; all heads have the same length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    pub per_head: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum SelectorError {
    #[error("selector config: {field} = {value} is invalid (expected {expected})")]
    Config {
        field: &'static str,
        value: f64,
        expected: &'static str,
    },
    #[error("selector input: n_kv_heads = {n_kv_heads} and rows = {rows} must both be >= 1")]
    EmptyShape { n_kv_heads: usize, rows: usize },
    #[error("selector input: need sinks <= recent_start <= seq_len <= u32::MAX, got sinks = {sinks}, recent_start = {recent_start}, seq_len = {seq_len}")]
    Domain {
        sinks: usize,
        recent_start: usize,
        seq_len: usize,
    },
    #[error("selector input: {name} has {got} values, expected {expected} ({shape})")]
    Len {
        name: &'static str,
        got: usize,
        expected: usize,
        shape: &'static str,
    },
    #[error("selector input: logit at kv head {head}, row {row}, position {pos} is {value} (NaN and +inf are not allowed; use -inf for masked keys)")]
    BadLogit {
        head: usize,
        row: usize,
        pos: usize,
        value: f32,
    },
    #[error("selector input: key positions must ascend strictly")]
    Positions,
    #[error("selector input: key norm at kv head {head}, position {pos} is {value} (expected finite and >= 0)")]
    BadKeyNorm { head: usize, pos: usize, value: f32 },
}

fn check(
    ok: bool,
    field: &'static str,
    value: f64,
    expected: &'static str,
) -> Result<(), SelectorError> {
    if ok {
        Ok(())
    } else {
        Err(SelectorError::Config {
            field,
            value,
            expected,
        })
    }
}

/// Checks the config and the input shapes and key norms (logits are checked where they are read).
pub(crate) fn validate(cfg: &SelectorConfig, inp: &SelectorInput) -> Result<(), SelectorError> {
    cfg.validate()?;
    validate_input(inp)
}

impl SelectorConfig {
    /// Checks every knob's range (an error names the field and the value).
    pub fn validate(&self) -> Result<(), SelectorError> {
        validate_config(self)
    }
}

fn validate_config(cfg: &SelectorConfig) -> Result<(), SelectorError> {
    let fin = |x: f64| x.is_finite();
    check(
        fin(cfg.alpha) && cfg.alpha > -1e-6,
        "alpha",
        cfg.alpha,
        "finite, >= 0",
    )?;
    check(fin(cfg.gamma), "gamma", cfg.gamma, "finite")?;
    check(
        fin(cfg.prior_weight_l2),
        "prior_weight_l2",
        cfg.prior_weight_l2,
        "finite",
    )?;
    check(
        fin(cfg.prior_weight_pos),
        "prior_weight_pos",
        cfg.prior_weight_pos,
        "finite",
    )?;
    check(
        fin(cfg.prior_pos_power),
        "prior_pos_power",
        cfg.prior_pos_power,
        "finite",
    )?;
    check(
        fin(cfg.prior_pos_eta),
        "prior_pos_eta",
        cfg.prior_pos_eta,
        "finite",
    )?;
    check(fin(cfg.prior_beta), "prior_beta", cfg.prior_beta, "finite")?;
    check(
        fin(cfg.soft_alpha) && cfg.soft_alpha >= -1.0,
        "soft_alpha",
        cfg.soft_alpha,
        "finite, >= -1",
    )?;
    check(
        fin(cfg.cross_head_alpha),
        "cross_head_alpha",
        cfg.cross_head_alpha,
        "finite",
    )?;
    let t = cfg.cross_head_temperature;
    check(
        fin(t) && t > 0.0,
        "cross_head_temperature",
        t,
        "finite, > 0",
    )?;
    let (a, b) = (cfg.lambda_clip_single, cfg.lambda_clip_multi);
    check(
        (0.0..=1.0).contains(&a),
        "lambda_clip_single",
        a,
        "in [0, 1]",
    )?;
    check(
        (0.0..=1.0).contains(&b),
        "lambda_clip_multi",
        b,
        "in [0, 1]",
    )?;
    check(
        cfg.eps > 0.0 && cfg.eps < 1e-3,
        "eps",
        cfg.eps,
        "in (0, 1e-3)",
    )?;
    Ok(())
}

fn validate_input(inp: &SelectorInput) -> Result<(), SelectorError> {
    if inp.n_kv_heads == 0 || inp.rows == 0 {
        return Err(SelectorError::EmptyShape {
            n_kv_heads: inp.n_kv_heads,
            rows: inp.rows,
        });
    }
    if inp.sinks > inp.recent_start
        || inp.recent_start > inp.seq_len
        || inp.seq_len > u32::MAX as usize
    {
        return Err(SelectorError::Domain {
            sinks: inp.sinks,
            recent_start: inp.recent_start,
            seq_len: inp.seq_len,
        });
    }
    if let Some(p) = inp.positions {
        if p.len() != inp.seq_len {
            return Err(SelectorError::Len {
                name: "positions",
                got: p.len(),
                expected: inp.seq_len,
                shape: "[seq_len]",
            });
        }
        if p.windows(2).any(|w| w[1] <= w[0]) {
            return Err(SelectorError::Positions);
        }
    }
    let want = inp
        .n_kv_heads
        .checked_mul(inp.rows)
        .and_then(|x| x.checked_mul(inp.seq_len));
    if want != Some(inp.logits.len()) {
        return Err(SelectorError::Len {
            name: "logits",
            got: inp.logits.len(),
            expected: want.unwrap_or(usize::MAX),
            shape: "[n_kv_heads, rows, seq_len]",
        });
    }
    if inp.key_norms.len() != inp.n_kv_heads * inp.seq_len {
        return Err(SelectorError::Len {
            name: "key_norms",
            got: inp.key_norms.len(),
            expected: inp.n_kv_heads * inp.seq_len,
            shape: "[n_kv_heads, seq_len]",
        });
    }
    for h in 0..inp.n_kv_heads {
        let norms = &inp.key_norms[h * inp.seq_len..(h + 1) * inp.seq_len];
        for (pos, &v) in norms
            .iter()
            .enumerate()
            .take(inp.recent_start)
            .skip(inp.sinks)
        {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SelectorError::BadKeyNorm {
                    head: h,
                    pos,
                    value: v,
                });
            }
        }
    }
    Ok(())
}

/// Position part of the prior, shared by all heads: log delta(j) for j in [lo, hi), with key
/// index j at position `positions[j]` when given (else j).
pub(crate) fn log_pos_prior(
    cfg: &SelectorConfig,
    lo: usize,
    hi: usize,
    j: usize,
    positions: Option<&[u32]>,
) -> f64 {
    let at = |i: usize| positions.map_or(i, |p| p[i] as usize);
    let (first, last, pj) = (at(lo), at(hi - 1), at(j));
    let span = (last - first).max(1) as f64;
    let u = ((pj - first) as f64 / span).clamp(0.0, 1.0);
    let p = cfg.prior_pos_power.max(1.0);
    let tail = ((last - pj) as f64 / span).max(cfg.eps);
    -cfg.prior_beta * u.powf(p) + cfg.prior_pos_eta * tail.ln()
}

/// Closed-form mixing weight from ff = sum f^2, rr = sum r^2, fr = sum f r and the valid row count.
pub(crate) fn mixing_lambda(
    cfg: &SelectorConfig,
    ff: f64,
    rr: f64,
    fr: f64,
    row_count: usize,
) -> f64 {
    let star = (ff - fr) / (ff - 2.0 * fr + rr).max(cfg.eps);
    let lmax = if row_count <= 1 {
        cfg.lambda_clip_single
    } else {
        cfg.lambda_clip_multi
    };
    let mut lam = star.clamp(0.0, lmax);
    if cfg.lambda_soft && lmax > 0.0 {
        lam = lmax * (lam / lmax).tanh();
    }
    lam.min(1.0 - cfg.eps)
}

/// Ordering used by top-k: higher score first, then lower position.
pub(crate) fn rank(scores: &[f64], a: u32, b: u32) -> std::cmp::Ordering {
    scores[b as usize]
        .total_cmp(&scores[a as usize])
        .then(a.cmp(&b))
}

/// Runs the Selector; convenience wrapper of [`select_into`] that allocates the result.
pub fn select(
    cfg: &SelectorConfig,
    inp: &SelectorInput,
    scratch: &mut SelectorScratch,
) -> Result<Selection, SelectorError> {
    let mut out = Selection::default();
    select_into(cfg, inp, scratch, &mut out)?;
    Ok(out)
}

/// Runs the Selector, writing into `out` (its vectors are reused: no allocation after warm-up).
pub fn select_into(
    cfg: &SelectorConfig,
    inp: &SelectorInput,
    sc: &mut SelectorScratch,
    out: &mut Selection,
) -> Result<(), SelectorError> {
    validate(cfg, inp)?;
    let (nh, rows, len) = (inp.n_kv_heads, inp.rows, inp.seq_len);
    let (lo, hi) = (inp.sinks, inp.recent_start);
    let n = hi - lo;
    out.per_head.resize_with(nh, Vec::new);
    out.per_head.iter_mut().for_each(|v| v.clear());
    let k = inp.k.min(n);
    if k == 0 {
        return Ok(());
    }
    let row =
        |h: usize, r: usize| &inp.logits[(h * rows + r) * len + lo..(h * rows + r) * len + hi];

    // Pass 1: row maxima, per-token visibility, bad-value check.
    fit(&mut sc.colmax, nh * n, f32::NEG_INFINITY);
    fit(&mut sc.rowmax, nh * rows, f32::NEG_INFINITY);
    for h in 0..nh {
        for r in 0..rows {
            let z = row(h, r);
            let (m, bad) = math::row_max_colmax(z, &mut sc.colmax[h * n..(h + 1) * n]);
            if bad {
                let j = z
                    .iter()
                    .position(|v| v.is_nan() || *v == f32::INFINITY)
                    .unwrap_or(0);
                return Err(SelectorError::BadLogit {
                    head: h,
                    row: r,
                    pos: lo + j,
                    value: z[j],
                });
            }
            sc.rowmax[h * rows + r] = m;
        }
    }
    let all_visible = sc.colmax.iter().all(|&c| c > f32::NEG_INFINITY);
    if k == n && all_visible {
        for v in out.per_head.iter_mut() {
            v.extend(lo as u32..hi as u32);
        }
        return Ok(());
    }

    // Pass 2: evidence accumulators (power mean over rows, before the 1/alpha power).
    let geometric = cfg.alpha.abs() < 1e-6;
    let (a32, mode) = if geometric {
        (1.0f32, PowMode::Identity)
    } else if cfg.alpha == 0.5 {
        (0.5, PowMode::Square)
    } else if cfg.alpha == 1.0 {
        (1.0, PowMode::Identity)
    } else {
        (cfg.alpha as f32, PowMode::Separate)
    };
    fit(&mut sc.acc, nh * n, 0.0);
    fit(&mut sc.rowbuf, n, 0.0);
    fit(&mut sc.valid_rows, nh, 0);
    fit(&mut sc.scores, nh * n, f64::NEG_INFINITY);
    fit(&mut sc.pos_prior, n, 0.0);
    fit(&mut sc.lin_r, n, 0.0);
    pos_prior(cfg, lo, hi, inp.positions, &mut sc.pos_prior, &mut sc.lin_r);
    for h in 0..nh {
        if geometric {
            fit(&mut sc.acc64, n, 0.0);
        }
        for r in 0..rows {
            let m = sc.rowmax[h * rows + r];
            if m == f32::NEG_INFINITY {
                continue;
            }
            sc.valid_rows[h] += 1;
            let z = row(h, r);
            let sum = math::row_exp(z, m, a32, mode, &mut sc.rowbuf);
            // log of the row's normaliser relative to m: over D, or over every key it sees.
            let log_norm = if cfg.evidence_mass {
                let all = &inp.logits[(h * rows + r) * len..(h * rows + r + 1) * len];
                let mx = all.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                let s: f64 = all.iter().map(|&v| (v as f64 - mx).exp()).sum();
                mx + s.ln() - m as f64
            } else {
                sum.ln()
            };
            if geometric {
                let lse = m as f64 + log_norm;
                for (a, &zj) in sc.acc64.iter_mut().zip(z) {
                    *a += zj as f64 - lse;
                }
            } else {
                let c = (-cfg.alpha * log_norm).exp() as f32;
                math::axpy(&mut sc.acc[h * n..(h + 1) * n], &sc.rowbuf, c);
            }
        }
        score_head(cfg, inp, sc, h, geometric);
    }

    if nh > 2 {
        cross_head(cfg, sc, nh, n);
    }
    let m = equal_count(&sc.scores, nh, n, k);
    for (h, v) in out.per_head.iter_mut().enumerate() {
        let idx = &mut sc.idx;
        idx.clear();
        idx.extend((0..n as u32).filter(|&j| sc.scores[h * n + j as usize] > f64::NEG_INFINITY));
        let scores = &sc.scores[h * n..(h + 1) * n];
        if idx.len() > m && m > 0 {
            idx.select_nth_unstable_by(m - 1, |&a, &b| rank(scores, a, b));
        }
        idx.truncate(m);
        idx.sort_unstable();
        v.extend(idx.iter().map(|&j| j + lo as u32));
    }
    Ok(())
}
