//! Tests of the SFI Selector: fast path vs the f64 reference on random inputs, hand-made cases
//! for each step of methods.md §1.4, kernel-vs-portable checks and bad-input errors.
use super::selector::*;
use super::selector_math::{self as math, portable, PowMode};
use super::selector_ref::select_reference;

const NEG_INF: f32 = f32::NEG_INFINITY;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

struct Case {
    nh: usize,
    rows: usize,
    len: usize,
    sinks: usize,
    recent_start: usize,
    k: usize,
    logits: Vec<f32>, // [nh, rows, len]
    norms: Vec<f32>,  // [nh, len]
}

impl Case {
    fn input(&self) -> SelectorInput<'_> {
        SelectorInput {
            n_kv_heads: self.nh,
            rows: self.rows,
            seq_len: self.len,
            logits: &self.logits,
            key_norms: &self.norms,
            sinks: self.sinks,
            recent_start: self.recent_start,
            k: self.k,
        }
    }
}

/// Random logits with peaks and masked keys, random norms with a few zeros.
fn random_case(rng: &mut Rng, nh: usize, rows: usize, len: usize) -> Case {
    let sinks = rng.below(5).min(len);
    let recent = rng.below(300).min(len - sinks);
    let recent_start = (len - recent) / 16 * 16;
    let recent_start = recent_start.max(sinks);
    let n = recent_start - sinks;
    let k = 1 + rng.below(n.max(1) + 2);
    let sigma = [0.5, 2.0, 6.0][rng.below(3)];
    let mut logits = vec![0f32; nh * rows * len];
    for h in 0..nh {
        let peaks: Vec<usize> = (0..1 + rng.below(20)).map(|_| rng.below(len)).collect();
        let masked_from = if rng.below(4) == 0 {
            rng.below(len + 1)
        } else {
            len
        };
        for r in 0..rows {
            let dead_row = rows > 1 && rng.below(8) == 0;
            let row = &mut logits[(h * rows + r) * len..(h * rows + r + 1) * len];
            for (j, v) in row.iter_mut().enumerate() {
                *v = (sigma * rng.normal()) as f32;
                if dead_row || j >= masked_from || rng.below(50) == 0 {
                    *v = NEG_INF;
                }
            }
            for &p in &peaks {
                if row[p] > NEG_INF {
                    row[p] += 4.0 + 8.0 * rng.unit() as f32;
                }
            }
        }
    }
    let norms = (0..nh * len)
        .map(|_| {
            if rng.below(40) == 0 {
                0.0
            } else {
                (20.0 * rng.unit()) as f32
            }
        })
        .collect();
    Case {
        nh,
        rows,
        len,
        sinks,
        recent_start,
        k,
        logits,
        norms,
    }
}

/// Same sets per head, except tokens whose reference scores tie with the k-th score (1e-6 rel).
fn assert_same_up_to_ties(
    fast: &Selection,
    reference: &Selection,
    scores: &[Vec<f64>],
    c: &Case,
    ctx: &str,
) -> usize {
    assert_eq!(fast.per_head.len(), c.nh, "{ctx}");
    let mut ties = 0;
    for (h, (f, r)) in fast.per_head.iter().zip(&reference.per_head).enumerate() {
        assert_eq!(f.len(), r.len(), "{ctx} head {h}: lengths");
        assert_eq!(
            f.len(),
            fast.per_head[0].len(),
            "{ctx}: equal lengths across heads"
        );
        assert!(
            f.windows(2).all(|w| w[0] < w[1]),
            "{ctx} head {h}: sorted, unique"
        );
        assert!(
            f.iter()
                .all(|&p| (c.sinks..c.recent_start).contains(&(p as usize))),
            "{ctx}: in domain"
        );
        if f == r {
            continue;
        }
        let score = |p: u32| scores[h][p as usize - c.sinks];
        let kth = r.iter().map(|&p| score(p)).fold(f64::INFINITY, f64::min);
        for &p in f
            .iter()
            .filter(|p| !r.contains(p))
            .chain(r.iter().filter(|p| !f.contains(p)))
        {
            let s = score(p);
            assert!(
                (s - kth).abs() <= 1e-6 * kth.abs(),
                "{ctx} head {h}: token {p} differs with score {s} vs k-th {kth}"
            );
            ties += 1;
        }
    }
    ties
}

#[test]
fn fast_matches_reference_on_random_inputs() {
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    let mut ties = 0;
    let mut runs = 0;
    for seed in 0..6u64 {
        let mut rng = Rng(seed * 7919 + 1);
        for &nh in &[1usize, 2, 3, 5, 8] {
            for &rows in &[1usize, 4, 16] {
                let len = [1usize, 17, 300, 1500, 4096][rng.below(5)];
                if len * nh * rows > 4096 * 40 && seed > 1 {
                    continue; // keep the reference's run time small
                }
                let c = random_case(&mut rng, nh, rows, len);
                let ctx = format!(
                    "seed {seed} nh {nh} rows {rows} len {len} k {} D [{}, {})",
                    c.k, c.sinks, c.recent_start
                );
                let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
                let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
                ties += assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
                runs += 1;
            }
        }
    }
    println!("{runs} random cases, {ties} tokens differed within the tie tolerance");
}

#[test]
fn fast_matches_reference_with_other_alphas_and_k_sweep() {
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(99);
    for alpha in [0.0, 1.0, 0.3] {
        let cfg = SelectorConfig {
            alpha,
            ..Default::default()
        };
        let mut c = random_case(&mut rng, 4, 4, 700);
        let n = c.recent_start - c.sinks;
        for k in [1, 2, n / 3, n - 1, n, n + 5] {
            c.k = k;
            let ctx = format!("alpha {alpha} k {k} n {n}");
            let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
            let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
            assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
        }
    }
}

/// A case with one head whose logits are `row` (single row) and norms all 1.
fn one_head(row: Vec<f32>, sinks: usize, recent_start: usize, k: usize) -> Case {
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

#[test]
fn sliding_max_matches_brute_force() {
    let mut rng = Rng(3);
    let (mut g, mut h, mut out) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..200 {
        let n = 1 + rng.below(150);
        let half = rng.below(40);
        let x: Vec<f64> = (0..n)
            .map(|_| {
                if rng.below(10) == 0 {
                    f64::NEG_INFINITY
                } else {
                    rng.normal()
                }
            })
            .collect();
        math::sliding_max(&x, half, &mut g, &mut h, &mut out);
        for j in 0..n {
            let want = x[j.saturating_sub(half)..=(j + half).min(n - 1)]
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(out[j], want, "n {n} half {half} j {j}");
        }
    }
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
            log_pos_prior(&cfg, lo, hi, j) < log_pos_prior(&cfg, lo, hi, j - 1),
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

#[test]
fn bad_inputs_are_errors() {
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    let mut c = one_head(vec![0.0; 64], 2, 48, 4);
    c.logits[7] = f32::NAN;
    let e = select(&cfg, &c.input(), &mut scratch).unwrap_err();
    assert!(
        matches!(e, SelectorError::BadLogit { head: 0, row: 0, pos: 7, value } if value.is_nan()),
        "{e}"
    );
    assert!(matches!(
        select_reference(&cfg, &c.input()),
        Err(SelectorError::BadLogit { pos: 7, .. })
    ));
    c.logits[7] = f32::INFINITY;
    assert!(matches!(
        select(&cfg, &c.input(), &mut scratch),
        Err(SelectorError::BadLogit { pos: 7, .. })
    ));
    c.logits[7] = 0.0;
    c.norms[9] = -1.0;
    assert!(matches!(
        select(&cfg, &c.input(), &mut scratch),
        Err(SelectorError::BadKeyNorm { pos: 9, .. })
    ));
    c.norms[9] = 1.0;
    c.recent_start = 65;
    assert!(matches!(
        select(&cfg, &c.input(), &mut scratch),
        Err(SelectorError::Domain { .. })
    ));
    c.recent_start = 48;
    c.rows = 2;
    let msg = select(&cfg, &c.input(), &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("logits has 64 values, expected 128"), "{msg}");
    c.rows = 1;
    let bad = SelectorConfig {
        cross_head_temperature: 0.0,
        ..cfg
    };
    let msg = select(&bad, &c.input(), &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("cross_head_temperature"), "{msg}");
    let bad = SelectorConfig { alpha: -1.0, ..cfg };
    assert!(select_reference(&bad, &c.input()).is_err());
}

#[test]
fn exp_f32_is_accurate() {
    let mut x = -87.0f32;
    while x <= 0.0 {
        let (got, want) = (math::exp_f32(x) as f64, (x as f64).exp());
        assert!(
            ((got - want) / want).abs() < 3e-7,
            "exp({x}) = {got}, want {want}"
        );
        x += 0.0137;
    }
    assert_eq!(math::exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(math::exp_f32(-100.0), 0.0);
}

#[test]
fn dispatched_row_kernels_match_portable_ones() {
    let mut rng = Rng(23);
    for n in [1usize, 15, 16, 17, 100, 1000] {
        let z: Vec<f32> = (0..n)
            .map(|_| {
                if rng.below(7) == 0 {
                    NEG_INF
                } else {
                    (3.0 * rng.normal()) as f32
                }
            })
            .collect();
        let (mut c1, mut c2) = (vec![-1.0f32; n], vec![-1.0f32; n]);
        let a = math::row_max_colmax(&z, &mut c1);
        let b = portable::row_max_colmax(&z, &mut c2);
        assert_eq!(a, b);
        assert_eq!(c1, c2);
        let m = a.0;
        if m == NEG_INF {
            continue; // the selector skips rows that see nothing
        }
        for (alpha, mode) in [
            (0.5, PowMode::Square),
            (1.0, PowMode::Identity),
            (0.3, PowMode::Separate),
        ] {
            let (mut b1, mut b2) = (vec![0f32; n], vec![0f32; n]);
            let s1 = math::row_exp(&z, m, alpha, mode, &mut b1);
            let s2 = portable::row_exp(&z, m, alpha, mode, &mut b2);
            assert!((s1 - s2).abs() <= 1e-6 * s2, "{s1} vs {s2}");
            let want: f64 = z.iter().map(|&v| ((v - m) as f64).exp()).sum();
            assert!((s1 - want).abs() <= 1e-5 * want, "sum {s1} vs {want}");
            for j in 0..n {
                assert!((b1[j] - b2[j]).abs() <= 1e-6 * b2[j].abs());
                let w = (alpha as f64 * (z[j] - m) as f64).exp();
                assert!((b1[j] as f64 - w).abs() <= 1e-6 * w + 1e-37);
            }
            let (mut a1, mut a2) = (b1.clone(), b1.clone());
            math::axpy(&mut a1, &b2, 0.7);
            portable::axpy(&mut a2, &b2, 0.7);
            assert_eq!(a1, a2);
        }
    }
}

#[test]
fn scratch_is_reused_without_growth() {
    let cfg = SelectorConfig::default();
    let mut rng = Rng(31);
    let c = random_case(&mut rng, 4, 4, 2000);
    let mut scratch = SelectorScratch::default();
    let mut out = Selection::default();
    select_into(&cfg, &c.input(), &mut scratch, &mut out).unwrap();
    let first = out.clone();
    let ptrs: Vec<*const u32> = out.per_head.iter().map(|v| v.as_ptr()).collect();
    select_into(&cfg, &c.input(), &mut scratch, &mut out).unwrap();
    assert_eq!(out, first);
    let again: Vec<*const u32> = out.per_head.iter().map(|v| v.as_ptr()).collect();
    assert_eq!(ptrs, again, "output buffers reused");
}

#[test]
fn f64_exp_and_ln_are_accurate_and_dispatch_matches_portable() {
    let mut rng = Rng(41);
    let xs: Vec<f64> = (0..5000)
        .map(|_| -700.0 * rng.unit().powi(3) + 5.0 * rng.normal())
        .collect();
    let mut e1 = xs.clone();
    let mut e2 = xs.clone();
    math::exp_slice(&mut e1);
    portable::exp_slice(&mut e2);
    for ((&x, &a), &b) in xs.iter().zip(&e1).zip(&e2) {
        let want = x.exp();
        assert!(
            (a - want).abs() <= 4e-16 * want,
            "exp({x}) = {a}, want {want}"
        );
        assert!((a - b).abs() <= 4e-16 * want);
    }
    let ys: Vec<f64> = (0..5000)
        .map(|_| (200.0 * rng.normal()).exp())
        .chain([1e-310, 5e-324, 1.0, 2.0])
        .collect();
    let mut l1 = ys.clone();
    let mut l2 = ys.clone();
    math::ln_slice(&mut l1);
    portable::ln_slice(&mut l2);
    for ((&y, &a), &b) in ys.iter().zip(&l1).zip(&l2) {
        let want = y.ln();
        assert!(
            (a - want).abs() <= 4e-16 * want.abs().max(1.0),
            "ln({y}) = {a}, want {want}"
        );
        assert!((a - b).abs() <= 4e-16 * want.abs().max(1.0));
    }
    let mut special = [0.0, f64::NEG_INFINITY, -800.0];
    math::ln_slice(&mut special[..1]);
    math::exp_slice(&mut special[1..]);
    assert_eq!(special, [f64::NEG_INFINITY, 0.0, 0.0]);
}
