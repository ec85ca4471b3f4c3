//! Plain f64 reference of the SFI Selector (methods.md §1.4), written step by step in log space
//! straight from the spec; the fast path in `selector.rs` is tested against it.
use super::selector::{
    log_pos_prior, mixing_lambda, rank, validate, Selection, SelectorConfig, SelectorError,
    SelectorInput,
};

const NEG_INF: f64 = f64::NEG_INFINITY;

fn logsumexp(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let m = xs.clone().fold(NEG_INF, f64::max);
    if m == NEG_INF {
        return NEG_INF;
    }
    m + xs.map(|x| (x - m).exp()).sum::<f64>().ln()
}

fn logaddexp(a: f64, b: f64) -> f64 {
    logsumexp([a, b].into_iter())
}

/// Subtracts LSE over the finite entries (normalises a log-distribution over the valid tokens).
fn normalise(v: &mut [f64]) {
    let z = logsumexp(v.iter().copied());
    if z > NEG_INF {
        v.iter_mut().for_each(|x| *x -= z);
    }
}

/// Runs the reference Selector. Returns the selection and, per kv head, the final scores
/// log s''(j) for j in [sinks, recent_start) (index j - sinks; -inf for tokens no row sees).
pub fn select_reference(
    cfg: &SelectorConfig,
    inp: &SelectorInput,
) -> Result<(Selection, Vec<Vec<f64>>), SelectorError> {
    validate(cfg, inp)?;
    let (nh, rows, len) = (inp.n_kv_heads, inp.rows, inp.seq_len);
    let (lo, hi) = (inp.sinks, inp.recent_start);
    let n = hi - lo;
    let z = |h: usize, r: usize, j: usize| inp.logits[(h * rows + r) * len + j] as f64;
    for h in 0..nh {
        for r in 0..rows {
            for j in lo..hi {
                let v = z(h, r, j);
                if v.is_nan() || v == f64::INFINITY {
                    return Err(SelectorError::BadLogit {
                        head: h,
                        row: r,
                        pos: j,
                        value: v as f32,
                    });
                }
            }
        }
    }
    // visible[h][i]: some row of head h sees token lo + i.
    let visible: Vec<Vec<bool>> = (0..nh)
        .map(|h| {
            (lo..hi)
                .map(|j| (0..rows).any(|r| z(h, r, j) > NEG_INF))
                .collect()
        })
        .collect();
    let k = inp.k.min(n);
    let mut scores = vec![vec![NEG_INF; n]; nh];
    if k == 0 {
        return Ok((
            Selection {
                per_head: vec![Vec::new(); nh],
            },
            scores,
        ));
    }
    if k == n && visible.iter().all(|v| v.iter().all(|&b| b)) {
        let all: Vec<u32> = (lo as u32..hi as u32).collect();
        return Ok((
            Selection {
                per_head: vec![all; nh],
            },
            scores,
        ));
    }

    for h in 0..nh {
        // 1. Per-row log-probabilities over D; rows that see nothing are dropped.
        let mut logp: Vec<Vec<f64>> = Vec::new(); // [valid rows, n]
        for r in 0..rows {
            let lse = logsumexp((lo..hi).map(|j| z(h, r, j)));
            if lse > NEG_INF {
                // Normalised over D, or (evidence_mass) over every key the row sees.
                let norm = if cfg.evidence_mass {
                    logsumexp((0..inp.seq_len).map(|j| z(h, r, j)))
                } else {
                    lse
                };
                logp.push((lo..hi).map(|j| z(h, r, j) - norm).collect());
            }
        }
        let rcnt = logp.len();
        if rcnt == 0 {
            continue;
        }
        // 2. Evidence: power mean over rows, normalised over D.
        let mut logf: Vec<f64> = (0..n)
            .map(|i| {
                if cfg.alpha.abs() < 1e-6 {
                    logp.iter().map(|p| p[i]).sum::<f64>() / rcnt as f64
                } else {
                    (logsumexp(logp.iter().map(|p| cfg.alpha * p[i])) - (rcnt as f64).ln())
                        / cfg.alpha
                }
            })
            .collect();
        for (i, v) in logf.iter_mut().enumerate() {
            if !visible[h][i] {
                *v = NEG_INF;
            }
        }
        normalise(&mut logf);
        // 3. Prior from key norm and position, normalised over D.
        let mut logr: Vec<f64> = (0..n)
            .map(|i| {
                if !visible[h][i] {
                    return NEG_INF;
                }
                let j = lo + i;
                let norm = inp.key_norms[h * len + j] as f64;
                let log_pi = -cfg.gamma * norm.max(cfg.eps).ln();
                cfg.prior_weight_l2 * log_pi
                    + cfg.prior_weight_pos * log_pos_prior(cfg, lo, hi, j, inp.positions)
            })
            .collect();
        normalise(&mut logr);
        // 4. Closed-form mixing weight.
        let (mut ff, mut rr, mut fr) = (0.0, 0.0, 0.0);
        for i in 0..n {
            let (f, r) = (logf[i].exp(), logr[i].exp());
            ff += f * f;
            rr += r * r;
            fr += f * r;
        }
        let lam = mixing_lambda(cfg, ff, rr, fr, rcnt);
        // 5. Fused score, normalised over D.
        let mut logs: Vec<f64> = (0..n)
            .map(|i| {
                if !visible[h][i] {
                    return NEG_INF;
                }
                logaddexp((1.0 - lam).ln() + logf[i], (lam + cfg.eps).ln() + logr[i])
            })
            .collect();
        normalise(&mut logs);
        // 6. Soft-NMS along positions.
        let (half, shift) = (cfg.nms_window as i64 / 2, cfg.nms_shift as i64);
        for i in 0..n {
            if logs[i] == NEG_INF {
                continue;
            }
            // Window [i - half - shift, i + half - shift] clipped to [0, n).
            let a = (i as i64 - half - shift).max(0);
            let b = (i as i64 + half - shift).min(n as i64 - 1);
            // A window under 2 tokens turns the step off (shift included).
            let pooled = if half == 0 {
                logs[i]
            } else {
                (a..=b).map(|t| logs[t as usize]).fold(NEG_INF, f64::max)
            };
            scores[h][i] = logs[i] - cfg.soft_alpha * (pooled - logs[i]).max(0.0);
        }
    }
    // 7. Cross-head exclusivity (only with more than two kv heads).
    if nh > 2 {
        let before = scores.clone();
        for i in 0..n {
            let heads: Vec<usize> = (0..nh).filter(|&h| before[h][i] > NEG_INF).collect();
            let lse = logsumexp(
                heads
                    .iter()
                    .map(|&h| before[h][i] / cfg.cross_head_temperature),
            );
            for &h in &heads {
                let log_rho = before[h][i] / cfg.cross_head_temperature - lse;
                scores[h][i] = before[h][i] + cfg.cross_head_alpha * log_rho.max(cfg.eps.ln());
            }
        }
    }
    // 8. Top-k per head over finite scores, then equal counts across heads.
    let mut order: Vec<Vec<u32>> = scores
        .iter()
        .map(|s| {
            let mut idx: Vec<u32> = (0..n as u32).filter(|&i| s[i as usize] > NEG_INF).collect();
            idx.sort_by(|&a, &b| rank(s, a, b));
            idx.truncate(k);
            idx
        })
        .collect();
    let m = order.iter().map(Vec::len).min().unwrap_or(0);
    for idx in order.iter_mut() {
        idx.truncate(m);
        idx.sort_unstable();
        idx.iter_mut().for_each(|i| *i += lo as u32);
    }
    Ok((Selection { per_head: order }, scores))
}
