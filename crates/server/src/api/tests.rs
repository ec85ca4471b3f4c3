//! Request parsing and checking: every refusal names its field, defaults follow OpenAI, and
//! a good body becomes the scheduler request it should.
use super::*;

fn tok() -> Tokenizer {
    Tokenizer::byte_level(512).unwrap()
}

fn resolver() -> Box<PolicyResolver> {
    Box::new(
        |p: Option<&KvPolicyRequest>, ctx: usize| match p.and_then(|p| p.name.as_deref()) {
            None | Some("full") => Ok(PolicySpec::Full),
            Some("streaming") => Ok(PolicySpec::Streaming {
                sinks: 4,
                recent: ctx.min(64),
            }),
            Some(o) => Err(format!("unknown policy `{o}`")),
        },
    )
}

fn run(json: &str, ep: Endpoint) -> Result<(Request, Shape), ApiError> {
    run_with(json, ep, None)
}

/// `run` on a server whose default speculation is `speculate` (`serve --speculate`).
fn run_with(
    json: &str,
    ep: Endpoint,
    speculate: Option<&SpecOptions>,
) -> Result<(Request, Shape), ApiError> {
    let t = tok();
    let r = resolver();
    let lim = Limits {
        served_model_name: "m",
        max_context: 64,
        tokenizer: &t,
        resolve: r.as_ref(),
        end_of_turn: &[7],
        speculate,
        draft_model: false,
    };
    check(parse(json.as_bytes())?, ep, &lim)
}

#[test]
fn speculate_picks_the_drafter_and_its_policy() {
    use slowfast_engine::spec::SpecTokens;
    let c = Endpoint::Completions;
    // The drafter's own policy for sfi/streaming, full KV for ngram/model.
    let (r, _) = run(
        r#"{"prompt": "hi", "speculate": {"drafter": "streaming", "spec_tokens": 3}}"#,
        c,
    )
    .unwrap();
    let o = r.speculate.expect("speculation");
    assert_eq!(
        (o.drafter, o.tokens),
        (DraftKind::Streaming, SpecTokens::Fixed(3))
    );
    assert_eq!(r.policy.name(), "streaming");
    let (r, _) = run(
        r#"{"prompt": "hi", "speculate": {"drafter": "ngram", "spec_tokens": "adaptive:5", "refresh": "trigger"}}"#,
        c,
    )
    .unwrap();
    let o = r.speculate.unwrap();
    assert_eq!(o.tokens, SpecTokens::Adaptive { max: 5 });
    assert!(!o.refresh_every);
    assert_eq!(r.policy.name(), "full");
    // The server's default, and `off`.
    let d = SpecOptions {
        drafter: DraftKind::Ngram,
        ..SpecOptions::default()
    };
    let (r, _) = run_with(r#"{"prompt": "hi"}"#, c, Some(&d)).unwrap();
    assert_eq!(r.speculate, Some(d.clone()));
    let (r, _) = run_with(
        r#"{"prompt": "hi", "speculate": {"drafter": "off"}}"#,
        c,
        Some(&d),
    )
    .unwrap();
    assert_eq!(r.speculate, None);
    // Refusals name the field.
    for (body, param) in [
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "model"}}"#,
            "speculate.drafter",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "off", "refresh": "AAA"}}"#,
            "speculate.refresh",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "eagle"}}"#,
            "speculate.drafter",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "ngram", "spec_tokens": 0}}"#,
            "speculate.spec_tokens",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "ngram", "refresh": "often"}}"#,
            "speculate.refresh",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "ngram", "gamma": 2}}"#,
            "speculate.gamma",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "ngram"}, "kv_policy": {"name": "streaming"}}"#,
            "kv_policy.name",
        ),
        (
            r#"{"prompt": "hi", "speculate": {"drafter": "ngram"}, "logprobs": 2}"#,
            "speculate",
        ),
    ] {
        let e = err(body, c);
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
}

fn err(json: &str, ep: Endpoint) -> ApiError {
    run(json, ep).expect_err("must be refused")
}

#[test]
fn a_completion_becomes_its_request() {
    let (r, s) = run(
        r#"{"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x",
            "seed": 3, "logprobs": 2, "stream": true, "stream_options": {"include_usage": true},
            "kv_policy": {"name": "streaming"}, "return_token_ids": true, "user": "ignored"}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!(r.prompt, vec![256, b'h' as u32, b'i' as u32]); // BOS + bytes
    assert_eq!(r.max_tokens, 5);
    assert_eq!(r.sampler.temperature, 0.0);
    assert_eq!(r.sampler.seed, 3);
    assert_eq!(r.stop, vec!["x".to_owned()]);
    assert_eq!(r.logprobs, Some(2));
    assert!(r.stop_tokens.is_empty());
    assert_eq!(r.policy.name(), "streaming");
    assert!(s.stream && s.include_usage && s.return_token_ids && s.logprobs);
}

#[test]
fn defaults_follow_openai() {
    let (r, s) = run(r#"{"prompt": [1, 2, 3]}"#, Endpoint::Completions).unwrap();
    assert_eq!(r.prompt, vec![1, 2, 3]);
    assert_eq!(r.max_tokens, 16);
    assert_eq!(r.sampler.temperature, 1.0);
    assert_eq!(r.sampler.top_p, 1.0);
    assert_eq!((r.sampler.top_k, r.sampler.min_p), (0, 0.0));
    assert!(!s.stream && !s.logprobs);
    // Chat: the template, the end-of-turn tokens, and the rest of the context by default.
    let (r, _) = run(
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#,
        Endpoint::Chat,
    )
    .unwrap();
    assert_eq!(r.stop_tokens, vec![7]);
    assert_eq!(r.prompt.len() + r.max_tokens, 64);
    // max_tokens is cut to the context.
    let (r, _) = run(
        r#"{"prompt": "abc", "max_tokens": 1000}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!(r.max_tokens, 60);
}

#[test]
fn every_refusal_names_its_field() {
    use Endpoint::*;
    let cases: &[(&str, Endpoint, u16, Option<&str>, &str)] = &[
        (
            r#"{"prompt": "x""#,
            Completions,
            400,
            None,
            "not valid JSON",
        ),
        (
            r#"{"prompt": "x"} trailing"#,
            Completions,
            400,
            None,
            "not valid JSON",
        ),
        (
            r#"{"prompt": "x", "max_tokens": "ten"}"#,
            Completions,
            400,
            Some("max_tokens"),
            "max_tokens",
        ),
        (
            r#"{"prompt": "x", "temperature": -1}"#,
            Completions,
            400,
            Some("temperature"),
            "temperature",
        ),
        (
            r#"{"prompt": "x", "top_p": 0}"#,
            Completions,
            400,
            Some("top_p"),
            "top_p",
        ),
        (
            r#"{"prompt": "x", "presence_penalty": 3}"#,
            Completions,
            400,
            Some("presence_penalty"),
            "presence_penalty",
        ),
        (
            r#"{"prompt": "x", "n": 2}"#,
            Completions,
            400,
            Some("n"),
            "n = 2",
        ),
        (
            r#"{"prompt": "x", "max_tokens": 0}"#,
            Completions,
            400,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            r#"{"prompt": "x", "logprobs": 21}"#,
            Completions,
            400,
            Some("logprobs"),
            "0..=20",
        ),
        (
            r#"{"prompt": "x", "echo": true}"#,
            Completions,
            400,
            Some("echo"),
            "echo",
        ),
        (
            r#"{"prompt": "x", "stream_options": {"include_usage": true}}"#,
            Completions,
            400,
            Some("stream_options"),
            "stream = true",
        ),
        (
            r#"{"prompt": "x", "kv_policy": {"name": "bogus"}}"#,
            Completions,
            400,
            Some("kv_policy"),
            "bogus",
        ),
        (
            r#"{"prompt": "x", "kv_policy": {"budget": 3}}"#,
            Completions,
            400,
            Some("kv_policy.budget"),
            "unknown field",
        ),
        (
            r#"{"prompt": ["a", "b"]}"#,
            Completions,
            400,
            Some("prompt"),
            "2 prompts",
        ),
        (
            r#"{"prompt": [1, 99999]}"#,
            Completions,
            400,
            Some("prompt"),
            "99999",
        ),
        (r#"{}"#, Completions, 400, Some("prompt"), "required"),
        (
            r#"{"model": "other", "prompt": "x"}"#,
            Completions,
            404,
            Some("model"),
            "other",
        ),
        (
            &format!(r#"{{"prompt": "{}"}}"#, "y".repeat(80)),
            Completions,
            400,
            Some("prompt"),
            "--max-context",
        ),
        (r#"{"messages": []}"#, Chat, 400, Some("messages"), "empty"),
        (
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
            Chat,
            400,
            Some("messages[0].role"),
            "robot",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            Chat,
            400,
            Some("messages[0].content[0].type"),
            "image_url",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": 3}"#,
            Chat,
            400,
            Some("logprobs"),
            "boolean",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}"#,
            Chat,
            400,
            Some("tools"),
            "tools",
        ),
        (
            r#"{"messages": "hello"}"#,
            Chat,
            400,
            Some("messages"),
            "messages",
        ),
        (r#"{"prompt": "x"}"#, Chat, 400, Some("prompt"), "messages"),
        // Found by schemathesis (tests/serve/schemathesis.sh):
        // a zero max_tokens beside a max_completion_tokens,
        (
            r#"{"prompt": "x", "max_tokens": 0, "max_completion_tokens": 3}"#,
            Completions,
            400,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            r#"{"prompt": "x", "max_tokens": 3, "max_completion_tokens": 0}"#,
            Completions,
            400,
            Some("max_completion_tokens"),
            "at least 1",
        ),
        // a budget that no policy takes, under a policy that reads none,
        (
            r#"{"prompt": "x", "kv_policy": {"kv_budget": 0}}"#,
            Completions,
            400,
            Some("kv_policy.kv_budget"),
            "positive",
        ),
        (
            r#"{"prompt": "x", "kv_policy": {"name": "full", "kv_budget": -5}}"#,
            Completions,
            400,
            Some("kv_policy.kv_budget"),
            "positive",
        ),
        // numbers past f32's range,
        (
            r#"{"prompt": "x", "temperature": 1e39}"#,
            Completions,
            400,
            Some("temperature"),
            "temperature",
        ),
        (
            r#"{"prompt": "x", "repetition_penalty": 1e300}"#,
            Completions,
            400,
            Some("repetition_penalty"),
            "repetition_penalty",
        ),
        // numbers that f32 rounding carried onto a bound,
        (
            r#"{"prompt": "x", "top_p": 1.0000000000000002}"#,
            Completions,
            400,
            Some("top_p"),
            "got 1.0000000000000002",
        ),
        (
            r#"{"prompt": "x", "min_p": -1e-50}"#,
            Completions,
            400,
            Some("min_p"),
            "min_p must be in [0, 1]",
        ),
        (
            r#"{"prompt": "x", "presence_penalty": 2.0000000000000004}"#,
            Completions,
            400,
            Some("presence_penalty"),
            "presence_penalty",
        ),
        (
            r#"{"prompt": "x", "frequency_penalty": -2.0000000000000004}"#,
            Completions,
            400,
            Some("frequency_penalty"),
            "frequency_penalty",
        ),
        // and arrays where the API has objects (serde's derive read them as the fields in order).
        (
            r#"[null, "x"]"#,
            Completions,
            400,
            None,
            "must be a JSON object",
        ),
        (
            r#"{"messages": [["user", "hi"]]}"#,
            Chat,
            400,
            Some("messages[0]"),
            "JSON object",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [["text", "hi"]]}]}"#,
            Chat,
            400,
            Some("messages[0].content"),
            "messages[0].content",
        ),
        (
            r#"{"prompt": "x", "stream": true, "stream_options": [true]}"#,
            Completions,
            400,
            Some("stream_options"),
            "JSON object",
        ),
        (
            r#"{"prompt": "x", "kv_policy": ["full", null, null, null, null, null, null]}"#,
            Completions,
            400,
            Some("kv_policy"),
            "JSON object",
        ),
    ];
    for (body, ep, status, param, text) in cases {
        let e = err(body, *ep);
        assert_eq!(e.status.as_u16(), *status, "{body}: {e:?}");
        assert_eq!(e.param.as_deref(), *param, "{body}: {e:?}");
        assert!(
            e.message.contains(text),
            "{body}: `{}` lacks `{text}`",
            e.message
        );
        let b = e.body();
        assert_eq!(b["error"]["message"], e.message.as_str());
    }
}

/// Found by schemathesis: a positive top_p or repetition_penalty below f32's range became 0,
/// which the sampler refuses ("top_p must be in (0, 1], got 0" for a top_p of 5e-324). It is now
/// the smallest normal f32; a tiny temperature or min_p becomes 0 (greedy, off).
#[test]
fn numbers_below_f32_keep_their_meaning() {
    let (r, _) = run(
        r#"{"prompt": "x", "top_p": 5e-324, "repetition_penalty": 1e-50, "temperature": 1e-300,
            "min_p": 1e-60}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!(r.sampler.top_p, f32::MIN_POSITIVE);
    assert_eq!(r.sampler.repetition_penalty, f32::MIN_POSITIVE);
    assert_eq!((r.sampler.temperature, r.sampler.min_p), (0.0, 0.0));
    // In range, numbers are as given (to f32).
    let (r, _) = run(
        r#"{"prompt": "x", "top_p": 0.25, "temperature": 3.4028234663852886e38}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!((r.sampler.top_p, r.sampler.temperature), (0.25, f32::MAX));
}
