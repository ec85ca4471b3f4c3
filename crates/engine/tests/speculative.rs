//! Lossless speculative decoding on the default model: at an 8K context, 256 greedy tokens of
//! every drafter (SFI's fast path, StreamingLLM, prompt lookup, a draft model) are full KV's
//! tokens, with an f16 KV cache as users run it. The prompt is Jane Austen's Emma from
//! scripts/get_texts.sh; without the model or the text the test says why it skipped (and fails
//! under SLOWFAST_REQUIRE_MODEL=1, where CI has both).
use std::path::PathBuf;

use slowfast_engine::sampler::{Sampler, SamplerConfig};
use slowfast_engine::session::{policy_spec, KvDtype, PolicySpec, Session};
use slowfast_engine::spec::{DraftKind, SpecOptions, SpecTokens, Speculator};
use slowfast_engine::Loaded;

const CONTEXT: usize = 8192;
const NEW: usize = 256;

fn load() -> Option<(Loaded, Vec<u32>)> {
    let p = slowfast_loader::test_model_path()?;
    let text = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/texts/austen_emma.txt");
    let Ok(text) = std::fs::read_to_string(&text) else {
        if std::env::var("SLOWFAST_REQUIRE_MODEL").as_deref() == Ok("1") {
            panic!("{} is missing: run scripts/get_texts.sh", text.display());
        }
        eprintln!(
            "skipped: {} is missing (scripts/get_texts.sh)",
            text.display()
        );
        return None;
    };
    let m = slowfast_engine::load(p.to_str().unwrap(), &mut |_| {}).unwrap();
    // Past the front matter; the prompt leaves room for the generated tokens.
    let start = text.len() / 7;
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    let mut ids = m
        .tokenizer
        .encode(&text[start..start + 60_000], true)
        .unwrap();
    ids.truncate(CONTEXT - NEW);
    Some((m, ids))
}

/// `NEW` greedy tokens: the first from the prefill's logits, the rest from `spec`'s rounds.
fn decode<'m>(
    sess: &mut Session<'m>,
    spec: &mut Speculator<'m>,
    sampler: &mut Sampler,
) -> Vec<u32> {
    let mut out = vec![sampler.sample_and_accept(sess.logits()).unwrap()];
    while out.len() < NEW {
        let last = *out.last().unwrap();
        let new = spec.round(sess, last, sampler, NEW - out.len()).unwrap();
        out.extend(new);
    }
    out.truncate(NEW);
    out
}

fn sampler(m: &Loaded, prompt: &[u32]) -> Sampler {
    let mut s = Sampler::new(SamplerConfig::greedy(), m.model.cfg.vocab_size).unwrap();
    for &t in prompt {
        s.accept(t);
    }
    s
}

#[test]
fn every_drafter_gives_full_kv_greedy_tokens_at_8k() {
    let Some((m, prompt)) = load() else { return };
    let cap = CONTEXT + 64;
    let kv = KvDtype::F16;
    let mut full = Session::try_with_policy(&m.model, cap, kv, 512, &PolicySpec::Full).unwrap();
    full.prefill(&prompt, &mut |_, _| {}).unwrap();
    // Full KV, one token a step.
    let mut want = Vec::with_capacity(NEW);
    {
        let mut s = full.fork(&PolicySpec::Full).unwrap();
        let mut smp = sampler(&m, &prompt);
        let mut t = smp.sample_and_accept(s.logits()).unwrap();
        want.push(t);
        while want.len() < NEW {
            t = smp.sample_and_accept(s.step(t).unwrap()).unwrap();
            want.push(t);
        }
    }
    let opts = |drafter, tokens, refresh_every| SpecOptions {
        drafter,
        tokens,
        refresh_every,
        ..SpecOptions::default()
    };
    let budget = Some(0.2);
    let streaming = policy_spec("streaming", budget, 4, CONTEXT).unwrap();
    let sfi = policy_spec("sfi", budget, 4, CONTEXT)
        .unwrap()
        .with_vocab(&m.tokenizer);
    let greedy = SamplerConfig::greedy();
    // The 8K prefills dominate this test (about a minute each on 2 cores): one of full KV
    // serves every full-KV target and the draft model (exact copies), one of SFI both SFI
    // cases (SFI bootstraps its memory in its own prefill).
    let mut cases: Vec<(&str, Session<'_>, Speculator<'_>)> = Vec::new();
    let mut s = full.fork(&PolicySpec::Full).unwrap();
    let o = opts(DraftKind::Ngram, SpecTokens::Fixed(6), true);
    let spec = Speculator::new(&mut s, &prompt, o, None, kv, &greedy).unwrap();
    cases.push(("ngram/6", s, spec));
    let mut s = full.fork(&PolicySpec::Full).unwrap();
    let o = opts(DraftKind::Model, SpecTokens::Fixed(4), true);
    let draft = full.try_clone().unwrap();
    let spec = Speculator::with_draft_session(&mut s, &prompt, o, draft, &greedy).unwrap();
    cases.push(("model(itself)/4", s, spec));
    let mut s = full.fork(&streaming).unwrap();
    let o = opts(DraftKind::Streaming, SpecTokens::Fixed(4), true);
    let spec = Speculator::new(&mut s, &prompt, o, None, kv, &greedy).unwrap();
    cases.push(("streaming/4", s, spec));
    let mut sfi_prefilled = Session::try_with_policy(&m.model, cap, kv, 512, &sfi).unwrap();
    sfi_prefilled.prefill(&prompt, &mut |_, _| {}).unwrap();
    for (name, o) in [
        (
            "sfi/6/every",
            opts(DraftKind::Sfi, SpecTokens::Fixed(6), true),
        ),
        (
            "sfi/adaptive/trigger",
            opts(DraftKind::Sfi, SpecTokens::Adaptive { max: 8 }, false),
        ),
    ] {
        let mut s = sfi_prefilled.try_clone().unwrap();
        let spec = Speculator::new(&mut s, &prompt, o, None, kv, &greedy).unwrap();
        cases.push((name, s, spec));
    }
    drop(sfi_prefilled);
    for (name, mut s, mut spec) in cases {
        let got = decode(&mut s, &mut spec, &mut sampler(&m, &prompt));
        let st = spec.stats();
        eprintln!(
            "{name}: acceptance {:.3}, {:.2} tokens per verification ({} verifications)",
            st.acceptance_rate(),
            st.tokens_per_verification(),
            st.verifications
        );
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(
            first, None,
            "{name}: differs from full KV at token {first:?}"
        );
        assert!(st.accepted > 0, "{name}: nothing accepted: {st:?}");
        if name.starts_with("model(itself)") {
            // Its chunked catch-up forwards may differ from single steps in the last bits only,
            // which flips a near-tie now and then: 0.96+ on the machines of 2026-12-01, 0.909 on
            // an AMD EPYC one (2026-12-02; prompt lookup gets 0.43 on the same text).
            assert!(
                st.acceptance_rate() > 0.85,
                "{name}: drafting for itself: {st:?}"
            );
        }
    }
}

/// `eval --task passkey --speculate`: the answers are full KV's, token for token (the question
/// fed as decode steps enters through verification passes), for a self-drafter and prompt
/// lookup, and the records carry the drafters' counters.
#[test]
fn passkey_answers_under_speculation_are_full_kvs() {
    use slowfast_engine::eval::passkey::{eval_passkey_spec, PasskeyOptions};
    use slowfast_engine::eval::Metrics;
    use slowfast_engine::Device;
    let Some((m, prompt)) = load() else { return };
    let o = PasskeyOptions {
        context: 2048,
        kv: KvDtype::F16,
        chunk: 512,
        trials: 3,
        needles: 1,
        distractors: 2,
        depths: vec![0.2, 0.5, 0.8],
        seed: 3,
        answer_tokens: 8,
        question_in_prefill: false,
    };
    let hay = Some(prompt);
    let answers = |recs: &[slowfast_engine::eval::EvalRecord]| match &recs[0].metrics {
        Metrics::Passkey(p) => (
            p.answers
                .iter()
                .map(|a| a.answer.clone())
                .collect::<Vec<_>>(),
            p.speculative.clone(),
        ),
        _ => unreachable!("a passkey record"),
    };
    let full = eval_passkey_spec(
        Device::Cpu,
        &m,
        hay.clone(),
        &o,
        &[PolicySpec::Full],
        None,
        &mut |_| {},
    )
    .unwrap();
    let (want, none) = answers(&full);
    assert!(none.is_none());
    let streaming = policy_spec("streaming", Some(0.2), 4, o.context).unwrap();
    for (drafter, policy) in [
        (DraftKind::Ngram, PolicySpec::Full),
        (DraftKind::Streaming, streaming),
    ] {
        let so = SpecOptions {
            drafter,
            tokens: SpecTokens::Fixed(4),
            ..SpecOptions::default()
        };
        let recs = eval_passkey_spec(
            Device::Cpu,
            &m,
            hay.clone(),
            &o,
            &[policy],
            Some(&so),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(recs[0].policy, "full");
        let (got, report) = answers(&recs);
        assert_eq!(got, want, "{drafter:?}: answers differ from full KV's");
        let r = report.expect("a speculative report");
        assert!(
            r.stats.verifications > 0 && r.stats.drafted > 0,
            "{drafter:?}: {r:?}"
        );
    }
}
