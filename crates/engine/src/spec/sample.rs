//! Speculative sampling over sparse distributions (Leviathan et al. 2023, arXiv 2211.17192;
//! Chen et al. 2023, arXiv 2302.01318): a draft token drawn from q is kept with probability
//! min(1, p/q), else replaced by a draw from norm(max(0, p − q)); the kept-or-replaced token is
//! then distributed exactly as p. Distributions are (probability, token id) pairs with distinct
//! ids in any order, as `Sampler::distribution` writes them. No model here.
use crate::sampler::Rng;

/// Draw a token from a distribution given as (prob, id) pairs (as Sampler::distribution writes).
/// The weights need not sum to exactly 1 (they are normalised); negative or NaN weights count
/// as 0. One value is taken from `rng` per call.
///
/// # Panics
/// When `p` is empty (`Sampler::distribution` never writes an empty one when it returns `Ok`).
pub fn draw(p: &[(f32, u32)], rng: &mut Rng) -> u32 {
    assert!(!p.is_empty(), "spec::sample::draw: empty distribution");
    let weight = |w: f32| w.max(0.0) as f64; // f32::max turns NaN into 0
    let total: f64 = p.iter().map(|e| weight(e.0)).sum();
    let u = rng.next_f64() * total;
    let mut cum = 0.0;
    for &(w, id) in p {
        cum += weight(w);
        if u < cum {
            return id;
        }
    }
    // Only when every weight is 0 (or u rounded up to the total): the last positive entry.
    p.iter()
        .rev()
        .find(|e| e.0 > 0.0)
        .unwrap_or(&p[p.len() - 1])
        .1
}

/// Speculative acceptance of draft token `d`, drawn by the drafter from `q`, against the target's `p`
/// (both from `Sampler::distribution` under the same settings). Accept with probability
/// min(1, p(d)/q(d)) → None. Otherwise Some(t) with t drawn from the residual
/// norm(max(0, p − q)). When both are one-hot (greedy) this is: accept iff d is p's token,
/// else Some(p's token). A d with q(d) = 0 (should not happen) is rejected. If the residual is
/// all zero (p == q numerically) draw from p.
///
/// Random values are taken from `rng` only where the outcome is uncertain: one for the
/// acceptance test when 0 < p(d) < q(d), and one for the residual draw on a rejection. A sure
/// acceptance (p(d) ≥ q(d) > 0) takes none.
///
/// Cost: O(|p| + |q|) for the lookups, plus on a rejection a sort of copies of both by id
/// (linear when they are already in id order) and a merge.
///
/// # Panics
/// On a rejection when `p` is empty.
pub fn verify_token(p: &[(f32, u32)], q: &[(f32, u32)], d: u32, rng: &mut Rng) -> Option<u32> {
    let pd = prob(p, d);
    let qd = prob(q, d);
    if qd > 0.0 {
        if pd >= qd {
            return None;
        }
        if pd > 0.0 && rng.next_f64() * (qd as f64) < pd as f64 {
            return None;
        }
    }
    Some(draw_residual(p, q, rng))
}

/// p(d): the weight of `d` in `p`, 0 when absent (or not a positive number).
fn prob(p: &[(f32, u32)], d: u32) -> f32 {
    p.iter().find(|e| e.1 == d).map_or(0.0, |e| e.0.max(0.0))
}

/// A draw from norm(max(0, p − q)), or from p when that is all zero.
fn draw_residual(p: &[(f32, u32)], q: &[(f32, u32)], rng: &mut Rng) -> u32 {
    let mut ps = p.to_vec();
    ps.sort_unstable_by_key(|e| e.1);
    let mut qs = q.to_vec();
    qs.sort_unstable_by_key(|e| e.1);
    // Merge by id: r(x) = max(0, p(x) − q(x)), only over p's support (elsewhere p = 0).
    let mut r: Vec<(f64, u32)> = Vec::with_capacity(ps.len());
    let mut j = 0;
    let mut total = 0.0f64;
    for &(pw, id) in &ps {
        while j < qs.len() && qs[j].1 < id {
            j += 1;
        }
        let qw = if j < qs.len() && qs[j].1 == id {
            qs[j].0.max(0.0) as f64
        } else {
            0.0
        };
        let w = pw.max(0.0) as f64 - qw;
        if w > 0.0 {
            r.push((w, id));
            total += w;
        }
    }
    if total <= 0.0 {
        return draw(p, rng);
    }
    let u = rng.next_f64() * total;
    let mut cum = 0.0;
    for &(w, id) in &r {
        cum += w;
        if u < cum {
            return id;
        }
    }
    r[r.len() - 1].1
}

/// Pearson's chi-square goodness-of-fit test, for the statistical tests of the sampler and of
/// speculative acceptance.
#[cfg(test)]
pub(crate) mod chi2 {
    /// ln Γ(x) for x > 0 (Lanczos, g = 7, 9 terms; ~1e-15 relative).
    fn ln_gamma(x: f64) -> f64 {
        const G: [f64; 9] = [
            0.999_999_999_999_809_9,
            676.520_368_121_885_1,
            -1_259.139_216_722_402_8,
            771.323_428_777_653_1,
            -176.615_029_162_140_6,
            12.507_343_278_686_905,
            -0.138_571_095_265_720_12,
            9.984_369_578_019_572e-6,
            1.505_632_735_149_311_6e-7,
        ];
        if x < 0.5 {
            let pi = std::f64::consts::PI;
            return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
        }
        let x = x - 1.0;
        let mut a = G[0];
        let t = x + 7.5;
        for (i, &g) in G.iter().enumerate().skip(1) {
            a += g / (x + i as f64);
        }
        0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
    }

    /// The regularised upper incomplete gamma function Q(a, x) (Numerical Recipes' gammq:
    /// the series below a + 1, Lentz's continued fraction above).
    fn gamma_q(a: f64, x: f64) -> f64 {
        if x <= 0.0 {
            return 1.0;
        }
        let ln_pre = a * x.ln() - x - ln_gamma(a);
        if x < a + 1.0 {
            let (mut ap, mut sum, mut del) = (a, 1.0 / a, 1.0 / a);
            for _ in 0..10_000 {
                ap += 1.0;
                del *= x / ap;
                sum += del;
                if del.abs() < sum.abs() * 1e-16 {
                    break;
                }
            }
            1.0 - sum * ln_pre.exp()
        } else {
            let tiny = 1e-300;
            let mut b = x + 1.0 - a;
            let mut c = 1.0 / tiny;
            let mut d = 1.0 / b;
            let mut h = d;
            for i in 1..10_000 {
                let an = -(i as f64) * (i as f64 - a);
                b += 2.0;
                d = an * d + b;
                if d.abs() < tiny {
                    d = tiny;
                }
                c = b + an / c;
                if c.abs() < tiny {
                    c = tiny;
                }
                d = 1.0 / d;
                let del = d * c;
                h *= del;
                if (del - 1.0).abs() < 1e-16 {
                    break;
                }
            }
            ln_pre.exp() * h
        }
    }

    /// P(X > stat) for X chi-square with `dof` degrees of freedom.
    pub fn p_value(stat: f64, dof: usize) -> f64 {
        gamma_q(dof as f64 / 2.0, stat / 2.0)
    }

    /// The p-value of observing `counts` when outcome i has probability `probs[i]` (normalised
    /// here). Outcomes of probability 0 must not occur (asserted). Outcomes expected fewer than
    /// 5 times are pooled into one bin, as the chi-square approximation needs. 1.0 when fewer
    /// than two bins remain (nothing to test).
    pub fn goodness_of_fit(counts: &[u64], probs: &[f64]) -> f64 {
        assert_eq!(counts.len(), probs.len());
        let n: u64 = counts.iter().sum();
        let z: f64 = probs.iter().sum();
        let (mut pooled_o, mut pooled_e) = (0.0, 0.0);
        let (mut stat, mut bins) = (0.0, 0usize);
        for (&o, &p) in counts.iter().zip(probs) {
            let e = n as f64 * p / z;
            if p == 0.0 {
                assert_eq!(o, 0, "an outcome of probability 0 occurred");
            } else if e < 5.0 {
                pooled_o += o as f64;
                pooled_e += e;
            } else {
                stat += (o as f64 - e).powi(2) / e;
                bins += 1;
            }
        }
        if pooled_e > 0.0 {
            stat += (pooled_o - pooled_e).powi(2) / pooled_e;
            bins += 1;
        }
        if bins < 2 {
            return 1.0;
        }
        p_value(stat, bins - 1)
    }

    #[test]
    fn p_values_match_published_tables() {
        // (critical value, dof, tail probability) from standard chi-square tables.
        for (x, dof, alpha) in [
            (3.841, 1, 0.05),
            (15.137, 1, 1e-4),
            (18.421, 2, 1e-4),
            (20.515, 5, 0.001),
            (18.307, 10, 0.05),
            (37.566, 20, 0.01),
            (29.877, 7, 1e-4),
        ] {
            let got = p_value(x, dof);
            assert!(
                (got - alpha).abs() < alpha * 2e-3,
                "dof {dof} x {x}: {got} vs {alpha}"
            );
        }
        // dof 2 is exactly exp(-x/2).
        assert!((p_value(10.0, 2) - (-5.0f64).exp()).abs() < 1e-14);
        assert_eq!(p_value(0.0, 3), 1.0);
    }
}

#[cfg(test)]
mod tests {
    //! Statistical tests at a stated significance: each chi-square test fails when its p-value
    //! falls below `ALPHA` = 1e-4 (the seeds are fixed, so a pass is reproducible; a correct
    //! implementation fails a given test with probability 1e-4 over seeds).
    use super::chi2::goodness_of_fit;
    use super::*;
    use crate::sampler::{Sampler, SamplerConfig};

    const ALPHA: f64 = 1e-4;

    /// A random sparse distribution over `0..vocab`: each id in the support with probability
    /// `keep` (at least one kept), random weights, pairs shuffled (not in id order).
    fn random_dist(rng: &mut Rng, vocab: u32, keep: f64) -> Vec<(f32, u32)> {
        let mut v: Vec<(f32, u32)> = vec![];
        for id in 0..vocab {
            let w = (0.05 + rng.next_f64()) as f32;
            if rng.next_f64() < keep {
                v.push((w, id));
            }
        }
        if v.is_empty() {
            v.push((1.0, (rng.next_u64() % vocab as u64) as u32));
        }
        normalise(&mut v);
        shuffle(rng, &mut v);
        v
    }

    fn normalise(v: &mut [(f32, u32)]) {
        let z: f32 = v.iter().map(|e| e.0).sum();
        for e in v.iter_mut() {
            e.0 /= z;
        }
    }

    fn shuffle<T>(rng: &mut Rng, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
    }

    /// Dense f64 probabilities over `0..vocab`.
    fn dense(p: &[(f32, u32)], vocab: usize) -> Vec<f64> {
        let mut d = vec![0.0; vocab];
        for &(w, id) in p {
            d[id as usize] += w as f64;
        }
        d
    }

    /// Σ_x min(p(x), q(x)): the probability that a draft is accepted.
    fn overlap(p: &[(f32, u32)], q: &[(f32, u32)], vocab: usize) -> f64 {
        let (p, q) = (dense(p, vocab), dense(q, vocab));
        p.iter().zip(&q).map(|(a, b)| a.min(*b)).sum()
    }

    /// `trials` rounds of: d ~ q, then `verify`; returns the counts of the output token (d when
    /// accepted, else the replacement) and the number of acceptances.
    fn run(
        p: &[(f32, u32)],
        q: &[(f32, u32)],
        vocab: usize,
        trials: usize,
        seed: u64,
        verify: impl Fn(&[(f32, u32)], &[(f32, u32)], u32, &mut Rng) -> Option<u32>,
    ) -> (Vec<u64>, u64) {
        let mut rng = Rng::new(seed);
        let mut counts = vec![0u64; vocab];
        let mut accepted = 0;
        for _ in 0..trials {
            let d = draw(q, &mut rng);
            let t = match verify(p, q, d, &mut rng) {
                None => {
                    accepted += 1;
                    d
                }
                Some(t) => t,
            };
            counts[t as usize] += 1;
        }
        (counts, accepted)
    }

    /// |observed − expected| of a binomial count within 5 standard deviations (plus a hair for
    /// the f32 rounding of the distributions).
    fn assert_rate(hits: u64, trials: usize, want: f64, what: &str) {
        let n = trials as f64;
        let want = want.clamp(0.0, 1.0);
        let sd = (want * (1.0 - want) / n).sqrt();
        let got = hits as f64 / n;
        assert!(
            (got - want).abs() <= 5.0 * sd + 1e-6,
            "{what}: rate {got} vs {want} (sd {sd})"
        );
    }

    /// The (p, q) pairs of the exactness tests over 8 tokens.
    type Dist = Vec<(f32, u32)>;

    fn pairs() -> Vec<(&'static str, Dist, Dist)> {
        let mut rng = Rng::new(0xD1CE);
        let mut out = vec![];
        for _ in 0..4 {
            out.push((
                "random, full support",
                random_dist(&mut rng, 8, 1.0),
                random_dist(&mut rng, 8, 1.0),
            ));
            out.push((
                "random, partial supports",
                random_dist(&mut rng, 8, 0.6),
                random_dist(&mut rng, 8, 0.6),
            ));
        }
        // q misses tokens of p (p has 0..8, q only 0..3).
        let mut q: Vec<(f32, u32)> = (0..3).map(|i| (1.0 + i as f32, i)).collect();
        normalise(&mut q);
        out.push(("q misses tokens of p", random_dist(&mut rng, 8, 1.0), q));
        // p misses tokens of q (p only 4..8, q all).
        let mut p: Vec<(f32, u32)> = (4..8).map(|i| (i as f32 - 3.0, i)).collect();
        normalise(&mut p);
        out.push(("p misses tokens of q", p, random_dist(&mut rng, 8, 1.0)));
        // Disjoint supports: every draft is rejected.
        out.push((
            "disjoint supports",
            vec![(0.3, 6), (0.7, 7)],
            vec![(0.5, 0), (0.5, 1)],
        ));
        // Equal: every draft is accepted.
        let p = random_dist(&mut rng, 8, 1.0);
        let mut q = p.clone();
        shuffle(&mut rng, &mut q);
        out.push(("p == q", p, q));
        out.push((
            "p one-hot, q spread",
            vec![(1.0, 5)],
            random_dist(&mut rng, 8, 1.0),
        ));
        out.push((
            "q one-hot, p spread",
            random_dist(&mut rng, 8, 1.0),
            vec![(1.0, 2)],
        ));
        out
    }

    /// (a) + (c): the output token is distributed as p, and the acceptance rate is Σ min(p, q).
    #[test]
    fn speculative_output_is_distributed_as_p() {
        let trials = 200_000;
        for (i, (what, p, q)) in pairs().into_iter().enumerate() {
            let (counts, accepted) = run(&p, &q, 8, trials, 1000 + i as u64, verify_token);
            let pv = goodness_of_fit(&counts, &dense(&p, 8));
            assert!(
                pv > ALPHA,
                "{what}: p-value {pv}, counts {counts:?}, p {p:?} q {q:?}"
            );
            assert_rate(accepted, trials, overlap(&p, &q, 8), what);
        }
    }

    /// The test has power: two plausible mistakes fail it.
    #[test]
    fn the_exactness_check_catches_wrong_verifiers() {
        let trials = 200_000;
        // Replacement drawn from p instead of the residual.
        let from_p = |p: &[(f32, u32)], q: &[(f32, u32)], d: u32, rng: &mut Rng| {
            verify_token(p, q, d, rng).map(|_| draw(p, rng))
        };
        // Acceptance with probability p/q without the min (always accept when p ≥ q is right,
        // but here: accept with probability p(d) alone).
        let accept_p = |p: &[(f32, u32)], q: &[(f32, u32)], d: u32, rng: &mut Rng| {
            if rng.next_f64() < prob(p, d) as f64 {
                None
            } else {
                Some(draw_residual(p, q, rng))
            }
        };
        let mut rng = Rng::new(77);
        let p = random_dist(&mut rng, 8, 1.0);
        let q = random_dist(&mut rng, 8, 1.0);
        for (name, pv) in [
            ("residual from p", {
                let (c, _) = run(&p, &q, 8, trials, 1, from_p);
                goodness_of_fit(&c, &dense(&p, 8))
            }),
            ("accept with p(d)", {
                let (c, _) = run(&p, &q, 8, trials, 2, accept_p);
                goodness_of_fit(&c, &dense(&p, 8))
            }),
        ] {
            assert!(pv < ALPHA, "{name} passed the check: p-value {pv}");
        }
    }

    /// (b) One-hot p and q: accept iff the draft is p's token, else p's token.
    #[test]
    fn greedy_one_hot_accepts_iff_the_draft_is_the_argmax() {
        let mut rng = Rng::new(1);
        for t in 0..6 {
            for d in 0..6 {
                let (p, q) = ([(1.0, t)], [(1.0, d)]);
                let want = if d == t { None } else { Some(t) };
                for _ in 0..20 {
                    assert_eq!(verify_token(&p, &q, d, &mut rng), want, "t {t} d {d}");
                }
            }
        }
        // A sure acceptance draws nothing from the stream.
        let mut a = Rng::new(5);
        let b = a.clone();
        assert_eq!(verify_token(&[(1.0, 3)], &[(1.0, 3)], 3, &mut a), None);
        assert_eq!(a.next_u64(), b.clone().next_u64());
        // Greedy samplers' distributions are one-hot, so the same holds end to end.
        let mut target = Sampler::new(SamplerConfig::greedy(), 6).unwrap();
        let mut drafter = Sampler::new(SamplerConfig::greedy(), 6).unwrap();
        let (mut p, mut q) = (vec![], vec![]);
        for trial in 0..50 {
            let lp: Vec<f32> = (0..6).map(|_| (rng.next_u64() % 4) as f32).collect();
            let lq: Vec<f32> = (0..6).map(|_| (rng.next_u64() % 4) as f32).collect();
            target.distribution(&lp, &mut p).unwrap();
            drafter.distribution(&lq, &mut q).unwrap();
            let d = drafter.sample(&lq).unwrap();
            let t = target.sample(&lp).unwrap();
            let want = if d == t { None } else { Some(t) };
            assert_eq!(
                verify_token(&p, &q, d, target.rng_mut()),
                want,
                "trial {trial}"
            );
        }
    }

    #[test]
    fn draft_outside_q_is_rejected_and_a_zero_residual_draws_from_p() {
        let p = [(0.25, 1), (0.75, 2)];
        let q = [(0.25, 1), (0.75, 2)];
        let mut rng = Rng::new(9);
        let mut counts = [0u64; 3];
        for _ in 0..100_000 {
            // d = 0 is not in q: rejected; p == q, so the residual is 0 and p is drawn.
            counts[verify_token(&p, &q, 0, &mut rng).unwrap() as usize] += 1;
        }
        let pv = goodness_of_fit(&counts, &[0.0, 0.25, 0.75]);
        assert!(pv > ALPHA, "p-value {pv}, counts {counts:?}");
        // Not in q but in p, with the rest of q covering p: the residual is d's own mass.
        let p = [(0.5, 0), (0.5, 1)];
        let q = [(1.0, 1)];
        for _ in 0..100 {
            assert_eq!(verify_token(&p, &q, 0, &mut rng), Some(0));
        }
    }

    #[test]
    fn draw_follows_the_weights() {
        let mut rng = Rng::new(3);
        let p = [
            (0.1, 4),
            (0.0, 0),
            (0.6, 2),
            (0.3, 1),
            (-1.0, 3),
            (f32::NAN, 5),
        ];
        let mut counts = [0u64; 6];
        for _ in 0..100_000 {
            counts[draw(&p, &mut rng) as usize] += 1;
        }
        let pv = goodness_of_fit(&counts, &[0.0, 0.3, 0.6, 0.0, 0.1, 0.0]);
        assert!(pv > ALPHA, "p-value {pv}, counts {counts:?}");
        // Unnormalised weights are fine; a single entry is always drawn.
        let mut counts = [0u64; 2];
        for _ in 0..50_000 {
            counts[draw(&[(3.0, 0), (1.0, 1)], &mut rng) as usize] += 1;
        }
        assert!(
            goodness_of_fit(&counts, &[0.75, 0.25]) > ALPHA,
            "{counts:?}"
        );
        assert_eq!(draw(&[(1.0, 7)], &mut rng), 7);
        assert_eq!(draw(&[(0.0, 7)], &mut rng), 7);
    }

    /// p and q from `Sampler::distribution` of two random logit rows under the same settings
    /// (top-k, top-p, min-p, temperature); the draft token from the drafter's own `sample`.
    /// The output token must follow p, and the acceptance rate must be Σ min(p, q).
    #[test]
    fn speculative_sampling_with_sampler_distributions() {
        let vocab = 16;
        let trials = 200_000;
        let mut rng = Rng::new(0xFEED);
        let configs = [
            (1.0, 8, 0.9, 0.05),
            (0.7, 0, 0.95, 0.0),
            (1.3, 10, 1.0, 0.1),
            (1.0, 0, 1.0, 0.0),
            (0.5, 5, 0.8, 0.02),
        ];
        for (i, &(temperature, top_k, top_p, min_p)) in configs.iter().enumerate() {
            let cfg = SamplerConfig {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: 10 + i as u64,
                ..SamplerConfig::greedy()
            };
            let mut target = Sampler::new(cfg.clone(), vocab).unwrap();
            let mut drafter = Sampler::new(
                SamplerConfig {
                    seed: 100 + i as u64,
                    ..cfg.clone()
                },
                vocab,
            )
            .unwrap();
            let lp: Vec<f32> = (0..vocab)
                .map(|_| (rng.next_f64() * 6.0 - 3.0) as f32)
                .collect();
            // The draft's logits: the target's, perturbed (a drafter that mostly agrees).
            let lq: Vec<f32> = lp
                .iter()
                .map(|&l| l + (rng.next_f64() * 3.0 - 1.5) as f32)
                .collect();
            let (mut p, mut q) = (vec![], vec![]);
            target.distribution(&lp, &mut p).unwrap();
            drafter.distribution(&lq, &mut q).unwrap();
            let mut counts = vec![0u64; vocab];
            let mut accepted = 0;
            for _ in 0..trials {
                let d = drafter.sample(&lq).unwrap();
                let t = match verify_token(&p, &q, d, target.rng_mut()) {
                    None => {
                        accepted += 1;
                        d
                    }
                    Some(t) => t,
                };
                counts[t as usize] += 1;
            }
            let what = format!("{cfg:?}: p {p:?} q {q:?}");
            let pv = goodness_of_fit(&counts, &dense(&p, vocab));
            assert!(pv > ALPHA, "{what}: p-value {pv}, counts {counts:?}");
            assert_rate(accepted, trials, overlap(&p, &q, vocab), &what);
        }
    }
}
