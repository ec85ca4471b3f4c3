//! Speculative decoding on the tiny Qwen3 fixture: greedy output equals full KV's for every
//! drafter and γ, sampled output follows the target's distribution (chi-square against the
//! exact marginals), and bad settings fail with errors that name them.
use std::path::PathBuf;

use super::*;
use crate::generate::{generate, generate_with_draft, GenerateOptions};
use crate::load::Loaded;
use crate::session::{policy_spec, policy_spec_with, PolicySpec, SfiKnobs};

fn fixture() -> Loaded {
    named("qwen3")
}

fn named(name: &str) -> Loaded {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name);
    crate::load(dir.to_str().unwrap(), &mut |_| {}).unwrap()
}

/// The fixture's tokenizer with other (random) weights of the same shapes: a draft model
/// that disagrees often.
fn other_weights(seed: u64) -> Loaded {
    other_weights_of("qwen3", seed)
}

fn other_weights_of(name: &str, seed: u64) -> Loaded {
    let mut l = named(name);
    let w =
        slowfast_model::random::random_weights(&l.model.cfg, slowfast_quant::GgmlType::F32, seed)
            .unwrap();
    l.model = Model::new(l.model.cfg.clone(), w).unwrap();
    l.name = format!("random weights {seed}");
    l
}

/// A prompt with repeated phrases (so prompt lookup finds matches).
fn prompt(n: usize) -> Vec<u32> {
    let phrase: Vec<u32> = (0..23u32).map(|i| (i * 37 + 11) % 500 + 6).collect();
    (0..n)
        .map(|i| {
            if i % 50 < 30 {
                phrase[i % 23]
            } else {
                (i as u32 * 13) % 500 + 6
            }
        })
        .collect()
}

fn sfi_spec(context: usize) -> PolicySpec {
    policy_spec_with(
        "sfi",
        Some(40.0),
        2,
        context,
        &SfiKnobs {
            recent: 16,
            min_gap: 2,
            refresh_interval: 8,
            ..Default::default()
        },
    )
    .unwrap()
}

fn opts(max_new: usize, policy: PolicySpec, spec: Option<SpecOptions>) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: max_new,
        sampler: SamplerConfig::greedy(),
        ignore_eos: true,
        kv_dtype: KvDtype::F32,
        chunk: 32,
        policy,
        speculate: spec,
        ..Default::default()
    }
}

fn spec(drafter: DraftKind, tokens: SpecTokens, refresh_every: bool) -> SpecOptions {
    SpecOptions {
        drafter,
        tokens,
        refresh_every,
        ..SpecOptions::default()
    }
}

#[test]
fn greedy_output_is_full_kv_for_every_drafter_and_gamma() {
    // Qwen3 (every layer global) and Gemma 3 (sliding-window rings of 8 tokens).
    for name in ["gemma3", "qwen3"] {
        greedy_case(name);
    }
}

fn greedy_case(fixture_name: &str) {
    let m = named(fixture_name);
    let same = named(fixture_name);
    let other = other_weights_of(fixture_name, 7);
    let p = prompt(120);
    let max_new = 64;
    let ctx = p.len() + max_new;
    let want = generate(&m, &p, &opts(max_new, PolicySpec::Full, None), &mut |_| {})
        .unwrap()
        .tokens;
    assert_eq!(want.len(), max_new);
    let with_vocab = |s: PolicySpec| s.with_vocab(&m.tokenizer);
    let cases: Vec<(&str, PolicySpec, SpecOptions, Option<&Loaded>)> = vec![
        (
            "sfi/1",
            with_vocab(sfi_spec(ctx)),
            spec(DraftKind::Sfi, SpecTokens::Fixed(1), true),
            None,
        ),
        (
            "sfi/4",
            with_vocab(sfi_spec(ctx)),
            spec(DraftKind::Sfi, SpecTokens::Fixed(4), true),
            None,
        ),
        (
            "sfi/8/trigger",
            with_vocab(sfi_spec(ctx)),
            spec(DraftKind::Sfi, SpecTokens::Fixed(8), false),
            None,
        ),
        (
            "sfi/adaptive",
            with_vocab(sfi_spec(ctx)),
            spec(DraftKind::Sfi, SpecTokens::Adaptive { max: 8 }, true),
            None,
        ),
        (
            "streaming/6",
            policy_spec("streaming", Some(24.0), 2, ctx).unwrap(),
            spec(DraftKind::Streaming, SpecTokens::Fixed(6), true),
            None,
        ),
        (
            "ngram/5",
            PolicySpec::Full,
            spec(DraftKind::Ngram, SpecTokens::Fixed(5), true),
            None,
        ),
        (
            "model(same)/6",
            PolicySpec::Full,
            spec(DraftKind::Model, SpecTokens::Fixed(6), true),
            Some(&same),
        ),
        (
            "model(other)/3",
            PolicySpec::Full,
            spec(DraftKind::Model, SpecTokens::Adaptive { max: 6 }, true),
            Some(&other),
        ),
    ];
    for (name, policy, s, draft) in cases {
        let out = generate_with_draft(&m, draft, &p, &opts(max_new, policy, Some(s)), &mut |_| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            out.tokens, want,
            "{fixture_name} {name}: speculative greedy differs from full KV"
        );
        let r = out.speculative.expect("speculative stats");
        let st = &r.stats;
        assert!(
            st.verifications > 0 && st.accepted <= st.drafted,
            "{name}: {st:?}"
        );
        // Every token after the first came out of a verification (the last round may overshoot).
        assert!(st.produced >= max_new - 1, "{name}: {st:?}");
        assert!(
            st.produced <= max_new - 1 + MAX_SPEC_TOKENS,
            "{name}: {st:?}"
        );
        if name.starts_with("model(same)") {
            // The same weights draft exactly what the target picks.
            assert_eq!(st.accepted, st.drafted, "{name}: {st:?}");
        }
        if name.starts_with("model(other)") {
            assert!(
                st.accepted < st.drafted,
                "{name}: random weights cannot agree always"
            );
        }
    }
}

/// The chi-square goodness-of-fit p-value of `counts` against `probs`.
fn p_value(counts: &[usize], probs: &[f64]) -> f64 {
    let c: Vec<u64> = counts.iter().map(|&c| c as u64).collect();
    super::super::sample::chi2::goodness_of_fit(&c, probs)
}

/// Exact marginals of the 2nd and 3rd generated tokens under `cfg` with full KV, by
/// enumerating the first two tokens' supports.
fn exact_marginals(m: &Loaded, p: &[u32], cfg: &SamplerConfig) -> (Vec<f64>, Vec<f64>) {
    let v = m.model.cfg.vocab_size;
    let mut s = Session::new(&m.model, 64, KvDtype::F32, 32);
    s.prefill(p, &mut |_, _| {}).unwrap();
    let mut sampler = Sampler::new(cfg.clone(), v).unwrap();
    let mut d1 = Vec::new();
    sampler.distribution(s.logits(), &mut d1).unwrap();
    let (mut m2, mut m3) = (vec![0.0; v], vec![0.0; v]);
    for &(p1, t1) in &d1 {
        let mut s1 = s.fork(&PolicySpec::Full).unwrap();
        let mut d2 = Vec::new();
        sampler.distribution(s1.step(t1).unwrap(), &mut d2).unwrap();
        for &(p2, t2) in &d2 {
            m2[t2 as usize] += p1 as f64 * p2 as f64;
            let mut s2 = s1.fork(&PolicySpec::Full).unwrap();
            let mut d3 = Vec::new();
            sampler.distribution(s2.step(t2).unwrap(), &mut d3).unwrap();
            for &(p3, t3) in &d3 {
                m3[t3 as usize] += p1 as f64 * p2 as f64 * p3 as f64;
            }
        }
    }
    (m2, m3)
}

/// Sampled speculative decoding (`drafter`, γ = 2) over many seeds: the 2nd and 3rd tokens
/// (both out of verifications) follow the exact full-KV marginals. Returns the statistics.
fn sampled_marginals(
    m: &Loaded,
    draft: Option<&Loaded>,
    policy: &PolicySpec,
    s: Option<SpecOptions>,
    cfg: &SamplerConfig,
    runs: usize,
) -> (Vec<usize>, Vec<usize>) {
    let p = prompt(24);
    let v = m.model.cfg.vocab_size;
    let (mut c2, mut c3) = (vec![0usize; v], vec![0usize; v]);
    for seed in 0..runs as u64 {
        let mut o = opts(3, policy.clone(), s.clone());
        o.sampler = SamplerConfig {
            seed: seed * 7919 + 1,
            ..cfg.clone()
        };
        let out = generate_with_draft(m, draft, &p, &o, &mut |_| {}).unwrap();
        c2[out.tokens[1] as usize] += 1;
        c3[out.tokens[2] as usize] += 1;
    }
    (c2, c3)
}

#[test]
fn sampled_tokens_follow_the_target_distribution() {
    let m = fixture();
    let other = other_weights(11);
    let cfg = SamplerConfig {
        temperature: 1.3,
        top_k: 6,
        top_p: 0.97,
        min_p: 0.02,
        repetition_penalty: 1.0,
        repeat_last_n: 0,
        ..SamplerConfig::default()
    };
    let (e2, e3) = exact_marginals(&m, &prompt(24), &cfg);
    let runs = 3000;
    // The prompt has 24 tokens: a window of 2 sinks + 6 recent drafts from a third of it.
    let streaming = PolicySpec::Streaming {
        sinks: 2,
        recent: 6,
    };
    for (name, policy, s, draft) in [
        (
            "streaming",
            streaming.clone(),
            spec(DraftKind::Streaming, SpecTokens::Fixed(2), true),
            None,
        ),
        (
            "model",
            PolicySpec::Full,
            spec(DraftKind::Model, SpecTokens::Fixed(2), true),
            Some(&other),
        ),
        (
            "ngram",
            PolicySpec::Full,
            spec(DraftKind::Ngram, SpecTokens::Fixed(2), true),
            None,
        ),
    ] {
        let (c2, c3) = sampled_marginals(&m, draft, &policy, Some(s), &cfg, runs);
        for (k, (c, e)) in [(2, (&c2, &e2)), (3, (&c3, &e3))] {
            let p = p_value(c, e);
            assert!(
                p >= 1e-4,
                "{name}: token {k}: chi-square p-value {p:.2e} < 1e-4"
            );
        }
    }
    // Power: the draft model's own samples (another distribution) fail the same test, by a
    // token the target never samples or by the p-value.
    let (c2, _) = sampled_marginals(&other, None, &PolicySpec::Full, None, &cfg, runs);
    let outside = c2.iter().zip(&e2).any(|(&c, &e)| c > 0 && e == 0.0);
    assert!(
        outside || p_value(&c2, &e2) < 1e-4,
        "the test cannot tell the draft model from the target"
    );
}
#[test]
fn bad_settings_are_clear_errors() {
    let m = fixture();
    let p = prompt(40);
    let h2o = policy_spec("h2o", Some(24.0), 2, 80).unwrap();
    let err = generate(
        &m,
        &p,
        &opts(
            8,
            h2o,
            Some(spec(DraftKind::Sfi, SpecTokens::Fixed(4), true)),
        ),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("h2o"), "{err}");
    let err = generate(
        &m,
        &p,
        &opts(
            8,
            PolicySpec::Full,
            Some(spec(DraftKind::Model, SpecTokens::Fixed(4), true)),
        ),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("--draft-model"), "{err}");
    for (s, ok) in [
        ("4", true),
        ("adaptive", true),
        ("adaptive:12", true),
        ("0", false),
        ("33", false),
        ("adaptive:0", false),
        ("many", false),
    ] {
        assert_eq!(s.parse::<SpecTokens>().is_ok(), ok, "{s}");
    }
    assert!("ngrams"
        .parse::<DraftKind>()
        .unwrap_err()
        .contains("ngrams"));
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let a = fixture();
    check_same_vocab(&a.tokenizer, &fixture().tokenizer).unwrap();
    // The fixture with one special token renamed: same size, one token differs.
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen3");
    let dir = std::env::temp_dir().join(format!("slowfast-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let tj = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&tj).unwrap();
    assert!(text.contains("<|im_start|>"));
    std::fs::write(&tj, text.replace("<|im_start|>", "<|im_begin|>")).unwrap();
    let b = crate::load(dir.to_str().unwrap(), &mut |_| {}).unwrap();
    let err = generate_with_draft(
        &a,
        Some(&b),
        &prompt(20),
        &opts(
            4,
            PolicySpec::Full,
            Some(spec(DraftKind::Model, SpecTokens::Fixed(2), true)),
        ),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        err.contains("--draft-model") && err.contains("token 1") && err.contains("im_begin"),
        "{err}"
    );
}

#[test]
fn a_small_window_ring_bounds_the_drafts() {
    // Gemma 3's fixture slides a window of 8; with prefill chunks of 2 its rings hold 10
    // slots, so a verification takes at most 3 rows: γ = 8 is cut to 2 and stays exact.
    let m = named("gemma3");
    let p = prompt(60);
    let mut o = opts(24, PolicySpec::Full, None);
    o.chunk = 2;
    let want = generate(&m, &p, &o, &mut |_| {}).unwrap().tokens;
    o.speculate = Some(spec(DraftKind::Ngram, SpecTokens::Fixed(8), true));
    let out = generate(&m, &p, &o, &mut |_| {}).unwrap();
    assert_eq!(out.tokens, want);
    let st = out.speculative.unwrap().stats;
    assert!(st.drafted <= 2 * st.verifications, "{st:?}");
}
