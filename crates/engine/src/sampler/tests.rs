//! Tests of the sampler chain: each filter against a plain full-sort reference on fresh
//! random logits, ties, determinism, a chi-square check of the draw, and no reallocation.
use super::*;

fn cfg(temperature: f32) -> SamplerConfig {
    SamplerConfig {
        temperature,
        ..SamplerConfig::greedy()
    }
}

fn random_logits(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() * 8.0 - 4.0) as f32)
        .collect()
}

/// Reference: full sort, then each filter written out plainly.
fn reference_support(logits: &[f32], c: &SamplerConfig) -> Vec<u32> {
    let mut v: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (l / c.temperature, i as u32))
        .collect();
    v.sort_by(by_logit_desc);
    if c.top_k > 0 {
        v.truncate(c.top_k);
    }
    let max = v[0].0 as f64;
    let probs: Vec<f64> = v.iter().map(|x| (x.0 as f64 - max).exp()).collect();
    let z: f64 = probs.iter().sum();
    let mut keep = v.len();
    let mut cum = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cum += p / z;
        if cum >= c.top_p as f64 {
            keep = i + 1;
            break;
        }
    }
    v.truncate(keep);
    let mut ids: Vec<u32> = v
        .iter()
        .filter(|x| (x.0 as f64 - max).exp() >= c.min_p as f64 * 1.0 - 1e-12)
        .map(|x| x.1)
        .collect();
    ids.sort();
    ids
}

#[test]
fn validate_names_the_flag() {
    let bad = [
        (
            SamplerConfig {
                temperature: -0.1,
                ..cfg(1.0)
            },
            "--temperature",
        ),
        (
            SamplerConfig {
                temperature: f32::NAN,
                ..cfg(1.0)
            },
            "--temperature",
        ),
        (
            SamplerConfig {
                top_p: 0.0,
                ..cfg(1.0)
            },
            "--top-p",
        ),
        (
            SamplerConfig {
                top_p: 1.5,
                ..cfg(1.0)
            },
            "--top-p",
        ),
        (
            SamplerConfig {
                min_p: -0.1,
                ..cfg(1.0)
            },
            "--min-p",
        ),
        (
            SamplerConfig {
                min_p: 1.1,
                ..cfg(1.0)
            },
            "--min-p",
        ),
        (
            SamplerConfig {
                repetition_penalty: 0.0,
                ..cfg(1.0)
            },
            "--repetition-penalty",
        ),
    ];
    for (c, flag) in bad {
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(flag), "{e}");
        assert!(Sampler::new(c, 10).is_err());
    }
    assert!(SamplerConfig::default().validate().is_ok());
    assert!(SamplerConfig::greedy().validate().is_ok());
    assert_eq!(
        Sampler::new(cfg(1.0), 0).unwrap_err(),
        SamplerError::EmptyVocab
    );
}

#[test]
fn greedy_takes_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplerConfig::greedy(), 5).unwrap();
    assert_eq!(s.sample(&[1.0, 3.0, f32::NAN, 3.0, -2.0]).unwrap(), 1);
    assert_eq!(
        s.sample(&[f32::NEG_INFINITY, 0.0, 0.0, 0.0, 0.0]).unwrap(),
        1
    );
    let e = s.sample(&[f32::NEG_INFINITY; 5]).unwrap_err();
    assert_eq!(e, SamplerError::NoCandidates);
    let e = s.sample(&[0.0; 4]).unwrap_err().to_string();
    assert!(e.contains("4 entries") && e.contains("has 5"), "{e}");
}

#[test]
fn argmax_matches_plain_loop() {
    let mut rng = Rng::new(17);
    for trial in 0..300 {
        let n = 1 + (rng.next_u64() % 100) as usize;
        let xs: Vec<f32> = (0..n)
            .map(|_| match rng.next_u64() % 10 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                _ => (rng.next_u64() % 5) as f32, // many ties
            })
            .collect();
        let mut want = None;
        let mut best = f32::NEG_INFINITY;
        for (i, &x) in xs.iter().enumerate() {
            if !x.is_nan() && x > best {
                best = x;
                want = Some(i as u32);
            }
        }
        assert_eq!(argmax(&xs), want, "trial {trial}: {xs:?}");
    }
}

#[test]
fn top_k_one_is_greedy() {
    let mut rng = Rng::new(7);
    for trial in 0..50 {
        let mut logits = random_logits(&mut rng, 300);
        if trial % 5 == 0 {
            let m = logits.iter().cloned().fold(f32::MIN, f32::max);
            logits[299] = m; // a tie: the lower id must win
        }
        let c = SamplerConfig {
            top_k: 1,
            seed: trial,
            ..cfg(1.3)
        };
        let mut s = Sampler::new(c, 300).unwrap();
        assert_eq!(s.sample(&logits).unwrap(), argmax(&logits).unwrap());
    }
}

#[test]
fn filters_match_reference_on_random_logits() {
    let mut rng = Rng::new(11);
    for trial in 0..200u64 {
        let n = if trial % 10 == 0 {
            20_000
        } else {
            1 + (rng.next_u64() % 700) as usize
        };
        let mut logits = random_logits(&mut rng, n);
        if trial % 7 < 3 {
            // Coarse logits: many exact ties, which must break towards lower ids.
            for l in logits.iter_mut() {
                *l = (*l * 2.0).round() / 2.0;
            }
        }
        let c = SamplerConfig {
            temperature: 0.3 + rng.next_f64() as f32 * 1.5,
            top_k: [0, 1, 5, 50, 1000][(trial % 5) as usize],
            top_p: [1.0, 0.9, 0.5, 0.05][(trial % 4) as usize],
            min_p: [0.0, 0.05, 0.3][(trial % 3) as usize],
            ..SamplerConfig::greedy()
        };
        let mut s = Sampler::new(c.clone(), n).unwrap();
        s.sample(&logits).unwrap();
        let mut got: Vec<u32> = s.cand.iter().map(|x| x.1).collect();
        got.sort();
        assert_eq!(got, reference_support(&logits, &c), "trial {trial} {c:?}");
    }
}

#[test]
fn top_p_keeps_smallest_set_reaching_p() {
    // probabilities 0.5, 0.25, 0.125, 0.125
    let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
    for (p, want) in [
        (0.49, 1),
        (0.51, 2),
        (0.74, 2),
        (0.76, 3),
        (0.99, 4),
        (1.0, 4),
    ] {
        let c = SamplerConfig {
            top_p: p,
            ..cfg(1.0)
        };
        let mut s = Sampler::new(c, 4).unwrap();
        s.sample(&logits).unwrap();
        assert_eq!(s.cand.len(), want, "top_p {p}");
    }
}

#[test]
fn min_p_drops_unlikely_tokens() {
    // probabilities proportional to 1, 0.5, 0.09, 0.2
    let logits = [0.0, 0.5f32.ln(), 0.09f32.ln(), 0.2f32.ln()];
    let c = SamplerConfig {
        min_p: 0.1,
        ..cfg(1.0)
    };
    let mut s = Sampler::new(c, 4).unwrap();
    for _ in 0..500 {
        assert_ne!(s.sample(&logits).unwrap(), 2);
    }
    let mut ids: Vec<u32> = s.cand.iter().map(|c| c.1).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 3]);
}

#[test]
fn presence_and_frequency_penalties_follow_llama_cpp() {
    let c = SamplerConfig {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        repeat_last_n: 8,
        ..SamplerConfig::greedy()
    };
    let mut s = Sampler::new(c, 4).unwrap();
    for t in [0, 0, 0, 3] {
        s.accept(t);
    }
    // token 0: 3 - 3 * 0.25 - 0.5 = 1.75 < token 1 (2.0); token 3: 1 - 0.25 - 0.5
    assert_eq!(s.sample(&[3.0, 2.0, -1.0, 1.0]).unwrap(), 1);
    assert_eq!(s.work, vec![1.75, 2.0, -1.0, 0.25]);
    for (bad, flag) in [
        (
            SamplerConfig {
                presence_penalty: 2.5,
                ..SamplerConfig::greedy()
            },
            "--presence-penalty",
        ),
        (
            SamplerConfig {
                frequency_penalty: f32::NAN,
                ..SamplerConfig::greedy()
            },
            "--frequency-penalty",
        ),
    ] {
        assert!(bad.validate().unwrap_err().to_string().contains(flag));
    }
}

#[test]
fn repetition_penalty_follows_llama_cpp() {
    let c = SamplerConfig {
        repetition_penalty: 2.0,
        repeat_last_n: 2,
        ..SamplerConfig::greedy()
    };
    let mut s = Sampler::new(c, 4).unwrap();
    // token 0 (logit 3) penalised to 1.5 < token 1 (2.0)
    s.accept(0);
    s.accept(0); // counted once
    assert_eq!(s.sample(&[3.0, 2.0, -1.0, 1.0]).unwrap(), 1);
    assert_eq!(s.work, vec![1.5, 2.0, -1.0, 1.0]);
    // window of 2: after two more tokens 0 is forgotten; negative logits are multiplied
    s.accept(2);
    s.accept(1);
    s.sample(&[3.0, 2.0, -1.0, 1.0]).unwrap();
    assert_eq!(s.work, vec![3.0, 1.0, -2.0, 1.0]);
    assert_eq!(s.sample(&[3.0, 2.0, -1.0, 1.0]).unwrap(), 0);
    // After a reset nothing is penalised.
    s.reset();
    assert_eq!(s.sample(&[2.0, 2.5, -1.0, 1.0]).unwrap(), 1);
    s.accept(1);
    assert_eq!(s.sample(&[2.0, 2.5, -1.0, 1.0]).unwrap(), 0);
}

#[test]
fn seeded_draws_are_deterministic() {
    let mut rng = Rng::new(3);
    let logits = random_logits(&mut rng, 1000);
    let run = |seed| {
        let c = SamplerConfig {
            seed,
            ..SamplerConfig::default()
        };
        let mut s = Sampler::new(c, 1000).unwrap();
        (0..64)
            .map(|_| s.sample_and_accept(&logits).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn draws_follow_the_distribution() {
    // Chi-square test on a 6-token vocabulary with temperature 0.7.
    let logits = [1.0f32, 0.5, 0.0, -0.5, 2.0, -3.0];
    let t = 0.7f64;
    let w: Vec<f64> = logits.iter().map(|&l| (l as f64 / t).exp()).collect();
    let z: f64 = w.iter().sum();
    let c = SamplerConfig {
        seed: 99,
        ..cfg(0.7)
    };
    let mut s = Sampler::new(c, 6).unwrap();
    let n = 60_000;
    let mut counts = [0usize; 6];
    for _ in 0..n {
        counts[s.sample(&logits).unwrap() as usize] += 1;
    }
    let chi2: f64 = counts
        .iter()
        .zip(&w)
        .map(|(&o, &wi)| {
            let e = n as f64 * wi / z;
            (o as f64 - e).powi(2) / e
        })
        .sum();
    // 5 degrees of freedom: P(chi2 > 20.5) ~ 0.001.
    assert!(chi2 < 20.5, "chi2 {chi2}, counts {counts:?}");
    // And a biased sampler fails the same check: drop token 4's extra mass.
    let skewed = [1.0f32, 0.5, 0.0, -0.5, 1.0, -3.0];
    let mut counts = [0usize; 6];
    for _ in 0..n {
        counts[s.sample(&skewed).unwrap() as usize] += 1;
    }
    let chi2: f64 = counts
        .iter()
        .zip(&w)
        .map(|(&o, &wi)| {
            let e = n as f64 * wi / z;
            (o as f64 - e).powi(2) / e
        })
        .sum();
    assert!(
        chi2 > 20.5,
        "the check cannot tell distributions apart: {chi2}"
    );
}

#[test]
fn sampling_does_not_reallocate() {
    let n = 5000;
    let mut rng = Rng::new(5);
    let configs = [
        SamplerConfig {
            repetition_penalty: 1.3,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            top_k: 0,
            top_p: 0.9,
            ..SamplerConfig::default()
        },
    ];
    for c in configs {
        let mut s = Sampler::new(c, n).unwrap();
        let buffers = |s: &Sampler| {
            (
                (s.work.capacity(), s.work.as_ptr()),
                (s.cand.capacity(), s.cand.as_ptr()),
                (s.weights.capacity(), s.weights.as_ptr()),
                (s.history.capacity(), s.seen.capacity()),
            )
        };
        let before = buffers(&s);
        for _ in 0..200 {
            let logits = random_logits(&mut rng, n);
            s.sample_and_accept(&logits).unwrap();
        }
        assert_eq!(before, buffers(&s));
    }
}

/// A digest of `sample`'s outputs over random logits and configs (penalties included), pinned
/// from the code before `distribution` was split out, so the refactor cannot change a draw.
fn sample_digest() -> u64 {
    let mut rng = Rng::new(2024);
    let mut digest = 0xCBF2_9CE4_8422_2325u64;
    for trial in 0..60u64 {
        let n = 1 + (rng.next_u64() % 300) as usize;
        let c = SamplerConfig {
            temperature: [0.0, 0.5, 1.0, 1.7][(trial % 4) as usize],
            top_k: [0, 1, 5, 40][(trial % 4) as usize],
            top_p: [1.0, 0.9, 0.5][(trial % 3) as usize],
            min_p: [0.0, 0.05, 0.2][(trial % 3) as usize],
            repetition_penalty: [1.0, 1.3][(trial % 2) as usize],
            repeat_last_n: 16,
            presence_penalty: [0.0, 0.4][(trial % 5 == 0) as usize],
            frequency_penalty: [0.0, 0.3][(trial % 7 == 0) as usize],
            seed: trial,
        };
        let mut s = Sampler::new(c, n).unwrap();
        for _ in 0..20 {
            let logits = random_logits(&mut rng, n);
            let t = s.sample_and_accept(&logits).unwrap();
            digest = (digest ^ t as u64).wrapping_mul(0x0100_0000_01B3);
        }
    }
    digest
}

#[test]
fn sample_outputs_are_pinned() {
    assert_eq!(sample_digest(), 4_130_222_452_524_478_297);
}

/// `distribution` describes `sample`: for random logits and configs (penalties with a history
/// included), the frequencies of many draws pass a chi-square test against it at p-value 1e-4;
/// it is a probability distribution (positive, summing to 1, distinct ids); it draws nothing
/// from the random stream.
#[test]
fn distribution_is_what_sample_draws_from() {
    use crate::spec::sample::chi2::goodness_of_fit;
    let mut rng = Rng::new(31);
    let draws = 40_000;
    let mut dist = vec![];
    for trial in 0..24u64 {
        let n = 3 + (rng.next_u64() % 30) as usize;
        let mut logits = random_logits(&mut rng, n);
        if trial % 4 == 1 {
            logits[0] = f32::NEG_INFINITY;
            logits[n - 1] = f32::NAN;
        }
        let c = SamplerConfig {
            temperature: 0.4 + rng.next_f64() as f32 * 1.2,
            top_k: [0, 3, 10][(trial % 3) as usize],
            top_p: [1.0, 0.9, 0.6, 0.95][(trial % 4) as usize],
            min_p: [0.0, 0.05, 0.2][(trial % 3) as usize],
            repetition_penalty: [1.0, 1.5][(trial % 2) as usize],
            repeat_last_n: 8,
            presence_penalty: [0.0, 0.5][(trial % 5 == 0) as usize],
            frequency_penalty: [0.0, 0.3][(trial % 3 == 0) as usize],
            seed: trial,
        };
        let mut s = Sampler::new(c.clone(), n).unwrap();
        for _ in 0..5 {
            s.accept((rng.next_u64() % n as u64) as u32);
        }
        let before = s.clone();
        s.distribution(&logits, &mut dist).unwrap();
        assert_eq!(s.rng.next_u64(), before.rng.clone().next_u64());
        let mut s = before;
        let sum: f64 = dist.iter().map(|d| d.0 as f64).sum();
        assert!((sum - 1.0).abs() < 1e-5, "trial {trial}: sum {sum}");
        assert!(dist.iter().all(|d| d.0 > 0.0 && (d.1 as usize) < n));
        let mut ids: Vec<u32> = dist.iter().map(|d| d.1).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), dist.len(), "trial {trial}: repeated ids");
        let mut probs = vec![0.0f64; n];
        for &(p, id) in &dist {
            probs[id as usize] = p as f64;
        }
        let mut counts = vec![0u64; n];
        for _ in 0..draws {
            counts[s.sample(&logits).unwrap() as usize] += 1;
        }
        let pv = goodness_of_fit(&counts, &probs);
        assert!(
            pv > 1e-4,
            "trial {trial} {c:?}: p-value {pv}, {counts:?} vs {dist:?}"
        );
    }
}

#[test]
fn greedy_distribution_is_the_one_hot_argmax() {
    let mut rng = Rng::new(8);
    let mut dist = vec![];
    for trial in 0..100u64 {
        let n = 1 + (rng.next_u64() % 40) as usize;
        // Coarse logits: ties, which go to the lowest id.
        let logits: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 4) as f32).collect();
        let c = SamplerConfig {
            repetition_penalty: [1.0, 1.4][(trial % 2) as usize],
            repeat_last_n: 4,
            top_k: 5, // ignored when greedy, as in `sample`
            ..SamplerConfig::greedy()
        };
        let mut s = Sampler::new(c, n).unwrap();
        s.accept((rng.next_u64() % n as u64) as u32);
        s.distribution(&logits, &mut dist).unwrap();
        assert_eq!(
            dist,
            vec![(1.0, s.sample(&logits).unwrap())],
            "trial {trial}"
        );
    }
    // Errors are those of `sample`.
    let mut s = Sampler::new(SamplerConfig::greedy(), 3).unwrap();
    let e = s.distribution(&[f32::NEG_INFINITY; 3], &mut dist);
    assert_eq!(e, Err(SamplerError::NoCandidates));
    let mut s = Sampler::new(cfg(1.0), 3).unwrap();
    let e = s.distribution(&[f32::NAN; 3], &mut dist);
    assert_eq!(e, Err(SamplerError::NoCandidates));
    assert!(s.distribution(&[0.0; 2], &mut dist).is_err());
}

/// The support of `distribution` is the reference filter chain's, at vocabulary sizes where the
/// chi-square test above is too slow.
#[test]
fn distribution_support_matches_reference() {
    let mut rng = Rng::new(12);
    let mut dist = vec![];
    for trial in 0..60u64 {
        let n = if trial % 10 == 0 {
            20_000
        } else {
            1 + (rng.next_u64() % 700) as usize
        };
        let logits = random_logits(&mut rng, n);
        let c = SamplerConfig {
            temperature: 0.3 + rng.next_f64() as f32 * 1.5,
            top_k: [0, 1, 5, 50, 1000][(trial % 5) as usize],
            top_p: [1.0, 0.9, 0.5, 0.05][(trial % 4) as usize],
            min_p: [0.0, 0.05, 0.3][(trial % 3) as usize],
            ..SamplerConfig::greedy()
        };
        let mut s = Sampler::new(c.clone(), n).unwrap();
        s.distribution(&logits, &mut dist).unwrap();
        let mut got: Vec<u32> = dist.iter().map(|x| x.1).collect();
        got.sort();
        assert_eq!(got, reference_support(&logits, &c), "trial {trial} {c:?}");
    }
}

/// A +inf logit: `sample` always falls through to the last candidate, and `distribution` says so.
#[test]
fn distribution_with_infinite_logits_matches_sample() {
    let logits = [0.0, f32::INFINITY, 1.0, f32::INFINITY, 2.0];
    let mut dist = vec![];
    for seed in 0..20 {
        let c = SamplerConfig {
            seed,
            ..SamplerConfig::default()
        };
        let mut s = Sampler::new(c, 5).unwrap();
        s.distribution(&logits, &mut dist).unwrap();
        assert_eq!(dist.len(), 1);
        assert_eq!(dist[0].0, 1.0);
        for _ in 0..10 {
            assert_eq!(s.sample(&logits).unwrap(), dist[0].1);
        }
    }
}
