//! Hand-made cases for each step of the SFI Selector (methods.md §1.4): power-mean evidence,
//! soft-NMS, cross-head exclusivity, equalised counts, the closed-form lambda, the prior, and
//! small or fully masked domains.
use super::selector::*;
use super::selector_ref::select_reference;
use super::selector_tests::{random_case, Case, Rng};

const NEG_INF: f32 = f32::NEG_INFINITY;

/// A case with one head whose logits are `row` (single row) and norms all 1.
pub(super) fn one_head(row: Vec<f32>, sinks: usize, recent_start: usize, k: usize) -> Case {
    let len = row.len();
    Case {
        nh: 1,
        rows: 1,
        len,
        sinks,
        recent_start,
        k,
        logits: row,
        norms: vec![1.0; len],
    }
}

/// Config isolating the evidence: lambda forced to 0, no NMS.
fn evidence_only(alpha: f64) -> SelectorConfig {
    SelectorConfig {
        alpha,
        lambda_clip_single: 0.0,
        lambda_clip_multi: 0.0,
        nms_window: 0,
        ..Default::default()
    }
}

#[test]
fn power_mean_evidence_matches_direct_computation() {
    let mut rng = Rng(5);
    let (rows, len) = (6, 200);
    for alpha in [0.5, 0.0, 2.0] {
        let logits: Vec<f32> = (0..rows * len).map(|_| rng.normal() as f32).collect();
        let c = Case {
            nh: 1,
            rows,
            len,
            sinks: 3,
            recent_start: 180,
            k: 10,
            logits,
            norms: vec![1.0; len],
        };
        let (_, scores) = select_reference(&evidence_only(alpha), &c.input()).unwrap();
        // Direct: p_r = softmax over D; f = power mean (geometric at alpha 0); normalised.
        let p: Vec<Vec<f64>> = (0..rows)
            .map(|r| {
                let z: Vec<f64> = (3..180).map(|j| c.logits[r * len + j] as f64).collect();
                let s: f64 = z.iter().map(|v| v.exp()).sum();
                z.iter().map(|v| v.exp() / s).collect()
            })
            .collect();
        let f: Vec<f64> = (0..177)
            .map(|i| {
                if alpha == 0.0 {
                    (p.iter().map(|pr| pr[i].ln()).sum::<f64>() / rows as f64).exp()
                } else {
                    (p.iter().map(|pr| pr[i].powf(alpha)).sum::<f64>() / rows as f64)
                        .powf(1.0 / alpha)
                }
            })
            .collect();
        let total: f64 = f.iter().sum();
        for i in 0..177 {
            let want = (f[i] / total).ln();
            assert!(
                (scores[0][i] - want).abs() < 1e-6,
                "alpha {alpha} token {i}: {} vs {want}",
                scores[0][i]
            );
        }
    }
}

#[test]
fn soft_nms_pushes_neighbours_down_and_keeps_local_maxima() {
    let (len, peak) = (400, 100);
    let mut row = vec![0f32; len];
    row[peak] = 6.0;
    row[300] = 3.0;
    let on = SelectorConfig {
        nms_window: 32,
        ..evidence_only(0.5)
    };
    let c = one_head(row, 2, 384, 20);
    let (_, off) = select_reference(&evidence_only(0.5), &c.input()).unwrap();
    let (_, nms) = select_reference(&on, &c.input()).unwrap();
    let (s0, s1) = (&off[0], &nms[0]);
    let i = |p: usize| p - 2;
    assert_eq!(s1[i(peak)], s0[i(peak)], "local max unchanged");
    assert_eq!(s1[i(300)], s0[i(300)], "second local max unchanged");
    for d in 1..=16 {
        for p in [peak - d, peak + d] {
            let gap = s0[i(peak)] - s0[i(p)];
            assert!(
                (s1[i(p)] - (s0[i(p)] - gap)).abs() < 1e-9,
                "neighbour {p} pushed down by its log-gap"
            );
        }
    }
    // Just outside the window of the peak: only the (tiny, prior-driven) flat-region gaps remain.
    assert!((s1[i(peak + 17)] - s0[i(peak + 17)]).abs() < 1e-6);
    assert!((s1[i(peak - 17)] - s0[i(peak - 17)]).abs() < 1e-6);
    // Window clipped at the domain edges: the first and last tokens are compared with what is
    // inside the domain only (no panic, no penalty beyond the clipped window).
    let mut row = vec![0f32; 64];
    row[2] = 5.0;
    let c = one_head(row, 2, 48, 4);
    let (_, off) = select_reference(&evidence_only(0.5), &c.input()).unwrap();
    let (_, nms) = select_reference(&on, &c.input()).unwrap();
    assert_eq!(nms[0][0], off[0][0]);
    assert!((nms[0][16] - (2.0 * off[0][16] - off[0][0])).abs() < 1e-9);
    assert!((nms[0][17] - off[0][17]).abs() < 1e-6);
    // The fast path agrees on both cases.
    let mut scratch = SelectorScratch::default();
    let (reference, _) = select_reference(&on, &c.input()).unwrap();
    assert_eq!(select(&on, &c.input(), &mut scratch).unwrap(), reference);
}

/// Three heads: heads 0 and 1 peak at token 50, head 2 at token 150.
fn three_heads(nh: usize) -> Case {
    let len = 256;
    let mut logits = vec![0f32; nh * len];
    for h in 0..nh {
        logits[h * len + if h == 2 { 150 } else { 50 }] = 8.0;
    }
    Case {
        nh,
        rows: 1,
        len,
        sinks: 4,
        recent_start: 240,
        k: 8,
        logits,
        norms: vec![1.0; nh * len],
    }
}

#[test]
fn cross_head_exclusivity_penalises_shared_tokens() {
    let c = three_heads(3);
    let off = SelectorConfig {
        cross_head_alpha: 0.0,
        ..Default::default()
    };
    let cfg = SelectorConfig::default();
    let (_, s0) = select_reference(&off, &c.input()).unwrap();
    let (_, s1) = select_reference(&cfg, &c.input()).unwrap();
    let t = 50 - 4;
    // Direct formula at the shared token.
    let lse = s0
        .iter()
        .map(|s| s[t] / 2.0)
        .map(f64::exp)
        .sum::<f64>()
        .ln();
    for h in 0..3 {
        let want = s0[h][t] + 0.85 * (s0[h][t] / 2.0 - lse).max(1e-12f64.ln());
        assert!((s1[h][t] - want).abs() < 1e-12);
    }
    let pen = |h: usize, i: usize| s1[h][i] - s0[h][i];
    // Shared peak (heads 0, 1, rho ~ 1/2 each) is penalised more than head 2's own peak (rho ~ 1).
    assert!(
        pen(0, t) < -0.5 && pen(1, t) < -0.5,
        "shared token penalised: {}",
        pen(0, t)
    );
    assert!(
        pen(2, 150 - 4) > -0.15,
        "exclusive token nearly free: {}",
        pen(2, 146)
    );
    assert!(pen(0, t) < pen(2, 150 - 4) - 0.4);
    // With two kv heads the step is skipped.
    let c2 = three_heads(2);
    assert_eq!(
        select_reference(&off, &c2.input()).unwrap().1,
        select_reference(&cfg, &c2.input()).unwrap().1
    );
    let mut scratch = SelectorScratch::default();
    assert_eq!(
        select(&cfg, &c.input(), &mut scratch).unwrap(),
        select_reference(&cfg, &c.input()).unwrap().0
    );
}

#[test]
fn equalisation_truncates_every_head_to_the_smallest_valid_count() {
    let mut rng = Rng(11);
    let (nh, len) = (3, 300);
    let mut c = random_case(&mut rng, nh, 2, len);
    c.sinks = 2;
    c.recent_start = 288;
    c.k = 40;
    // Head 1 sees only 8 domain tokens (j = 5 mod 40), in both of its rows.
    for r in 0..2 {
        for j in 0..len {
            let keep = j % 40 == 5 || !(2..288).contains(&j);
            c.logits[(2 + r) * len + j] = if keep {
                (0.3 * j as f64).sin() as f32
            } else {
                NEG_INF
            };
        }
    }
    let cfg = SelectorConfig::default();
    let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
    for h in 0..nh {
        assert_eq!(reference.per_head[h].len(), 8, "head {h}");
    }
    // Head 0 keeps its 8 best tokens.
    let mut best: Vec<u32> = (0..286u32)
        .filter(|&i| scores[0][i as usize].is_finite())
        .collect();
    best.sort_by(|&a, &b| scores[0][b as usize].total_cmp(&scores[0][a as usize]));
    let mut top: Vec<u32> = best[..8].iter().map(|i| i + 2).collect();
    top.sort_unstable();
    assert_eq!(reference.per_head[0], top);
    let mut scratch = SelectorScratch::default();
    assert_eq!(select(&cfg, &c.input(), &mut scratch).unwrap(), reference);
}

#[test]
fn lambda_closed_form_and_clips() {
    let cfg = SelectorConfig::default();
    // f = r: the flattest mixture is reached at every lambda; the numerator is 0.
    assert_eq!(mixing_lambda(&cfg, 0.1, 0.1, 0.1, 1), 0.0);
    // Peaked f vs flat r over n tokens: lambda* = 1, clipped (single row 0.35, multi 0.25).
    let n = 100.0;
    assert_eq!(mixing_lambda(&cfg, 1.0, 1.0 / n, 1.0 / n, 1), 0.35);
    assert_eq!(mixing_lambda(&cfg, 1.0, 1.0 / n, 1.0 / n, 4), 0.25);
    let soft = SelectorConfig {
        lambda_soft: true,
        ..cfg
    };
    assert!((mixing_lambda(&soft, 1.0, 1.0 / n, 1.0 / n, 1) - 0.35 * 1f64.tanh()).abs() < 1e-15);
    // Unclipped interior value equals the minimiser of sum((1-l) f + l r)^2 (grid search).
    let f = [0.4, 0.3, 0.2, 0.1];
    let r = [0.1, 0.2, 0.3, 0.4];
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let wide = SelectorConfig {
        lambda_clip_single: 1.0,
        ..cfg
    };
    let lam = mixing_lambda(&wide, dot(&f, &f), dot(&r, &r), dot(&f, &r), 1);
    let energy = |l: f64| {
        f.iter()
            .zip(&r)
            .map(|(a, b)| ((1.0 - l) * a + l * b).powi(2))
            .sum::<f64>()
    };
    let grid = (0..=10000)
        .map(|i| i as f64 / 10000.0)
        .min_by(|a, b| energy(*a).total_cmp(&energy(*b)))
        .unwrap();
    assert!(
        (lam - grid).abs() < 2e-4 && (lam - 0.5).abs() < 1e-12,
        "lambda {lam} grid {grid}"
    );
    assert_eq!(
        mixing_lambda(&cfg, dot(&f, &f), dot(&r, &r), dot(&f, &r), 1),
        0.35
    );
}

#[test]
fn prior_prefers_small_norms_and_early_positions() {
    // Position prior alone decreases along the domain.
    let cfg = SelectorConfig::default();
    let (lo, hi) = (4, 500);
    for j in lo + 1..hi {
        assert!(
            log_pos_prior(&cfg, lo, hi, j, None) < log_pos_prior(&cfg, lo, hi, j - 1, None),
            "j {j}"
        );
    }
    // End to end: one dominant token makes lambda > 0, so the other tokens are ranked by r.
    let len = 512;
    let mut row = vec![0f32; len];
    row[10] = 40.0;
    let mut c = one_head(row, lo, hi, 5);
    for (j, v) in c.norms.iter_mut().enumerate() {
        *v = if j % 2 == 0 { 4.0 } else { 1.0 };
    }
    let cfg = SelectorConfig {
        nms_window: 0,
        ..cfg
    };
    let (_, s) = select_reference(&cfg, &c.input()).unwrap();
    let s = &s[0];
    for i in 20..s.len() - 2 {
        let j = i + lo;
        if j % 2 == 0 {
            assert!(s[i] < s[i + 1], "smaller norm at {} scores higher", j + 1);
        }
        assert!(s[i + 2] < s[i], "later position {} scores lower", j + 2);
    }
    // Zero norms are clamped by eps (finite scores).
    c.norms.iter_mut().for_each(|v| *v = 0.0);
    let (_, s) = select_reference(&cfg, &c.input()).unwrap();
    assert!(s[0].iter().all(|v| v.is_finite()));
}

#[test]
fn small_domains_and_masked_rows() {
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(17);
    let mut c = random_case(&mut rng, 3, 2, 100);
    c.logits.iter_mut().for_each(|v| *v = v.max(-5.0)); // everything visible
    c.sinks = 4;
    c.recent_start = 64;
    c.k = 60;
    let all: Vec<u32> = (4..64).collect();
    assert_eq!(
        select(&cfg, &c.input(), &mut scratch).unwrap().per_head,
        vec![all.clone(); 3]
    );
    c.k = 1000;
    assert_eq!(
        select_reference(&cfg, &c.input()).unwrap().0.per_head,
        vec![all; 3]
    );
    c.k = 0;
    assert_eq!(
        select(&cfg, &c.input(), &mut scratch).unwrap().per_head,
        vec![Vec::<u32>::new(); 3]
    );
    c.k = 5;
    c.recent_start = 4; // empty domain
    assert_eq!(
        select(&cfg, &c.input(), &mut scratch).unwrap().per_head,
        vec![Vec::<u32>::new(); 3]
    );
    // A head whose rows see nothing in the domain leaves every head empty.
    c.recent_start = 64;
    for j in 0..200 {
        c.logits[200 + j] = NEG_INF;
    }
    let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
    assert_eq!(fast.per_head, vec![Vec::<u32>::new(); 3]);
    assert_eq!(select_reference(&cfg, &c.input()).unwrap().0, fast);
}
