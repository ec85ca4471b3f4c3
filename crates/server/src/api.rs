//! The request bodies of `/v1/completions` and `/v1/chat/completions`: parsed with the field
//! at fault named in every error, checked against what slowfast supports, and turned into a
//! scheduler `Request` (tokenized, its KV policy resolved).
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use slowfast_engine::sampler::SamplerConfig;
use slowfast_engine::scheduler::Request;
use slowfast_engine::spec::{DraftKind, SpecOptions};
use slowfast_engine::PolicySpec;
use slowfast_tokenizer::{ChatMessage, Tokenizer};

use crate::error::ApiError;

/// The per-request KV policy (extension field `kv_policy`); absent fields keep the server's
/// defaults (its command-line flags).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KvPolicyRequest {
    /// full, streaming, h2o, snapkv, pyramidkv, quest, fastkv, sfi, sfi+fastkv.
    pub name: Option<String>,
    /// Tokens per kv head of each global layer, or a fraction of the sequence below 1.
    pub kv_budget: Option<f64>,
    pub sinks: Option<usize>,
    pub sfi_recent: Option<usize>,
    pub sfi_refresh_interval: Option<usize>,
    pub sfi_min_gap: Option<usize>,
    pub sfi_trigger: Option<String>,
}

/// Speculative decoding of one request (extension field `speculate`; CPU): the drafter, and
/// optionally γ and SFI's refresh. Absent, the server's `--speculate` holds.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpeculateRequest {
    /// sfi, streaming, ngram, model, or off (plain decoding even if the server speculates).
    pub drafter: String,
    /// A count (1-32), `adaptive` or `adaptive:N`; default: the server's `--spec-tokens`.
    pub spec_tokens: Option<serde_json::Value>,
    /// sfi: `every` or `trigger`; default: the server's `--spec-refresh`.
    pub refresh: Option<String>,
}

/// Resolves a request's KV policy (None: the server's default) for a sequence of `context`
/// tokens; the error names what is wrong.
pub type PolicyResolver =
    dyn Fn(Option<&KvPolicyRequest>, usize) -> Result<PolicySpec, String> + Send + Sync;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(#[serde(deserialize_with = "objects")] Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Every field either endpoint reads (unknown fields are ignored, as OpenAI's clients send
/// many); the endpoint-specific rules are in `check_*`.
#[derive(Debug, Default, Deserialize)]
pub struct Body {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    #[serde(default, deserialize_with = "opt_objects")]
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    // Sampling numbers are read as JSON's f64 and narrowed by `sampler` (see `narrow`).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Completions: an integer (top alternatives); chat: a boolean.
    pub logprobs: Option<serde_json::Value>,
    pub top_logprobs: Option<usize>,
    pub n: Option<usize>,
    pub best_of: Option<usize>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub tools: Option<serde_json::Value>,
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, deserialize_with = "opt_object")]
    pub stream_options: Option<StreamOptions>,
    // --- extensions ---
    #[serde(default, deserialize_with = "opt_object")]
    pub kv_policy: Option<KvPolicyRequest>,
    #[serde(default, deserialize_with = "opt_object")]
    pub speculate: Option<SpeculateRequest>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub return_token_ids: bool,
    /// Keep an inspection of the KV at the end (`GET /v1/inspect/{id}`).
    #[serde(default)]
    pub inspect: bool,
}

/// A struct read from a JSON object only. serde's derive also reads a struct from an array of
/// its fields in declaration order (`["user", "hi"]` as a message), which is not OpenAI's API
/// and would make the order of the fields in this file part of it.
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(V(PhantomData)).map(Obj)
    }
}

fn opt_object<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    Ok(Option::<Obj<T>>::deserialize(d)?.map(|o| o.0))
}

fn objects<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Vec::<Obj<T>>::deserialize(d)?
        .into_iter()
        .map(|o| o.0)
        .collect())
}

fn opt_objects<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Vec<T>>, D::Error> {
    Ok(Option::<Vec<Obj<T>>>::deserialize(d)?.map(|v| v.into_iter().map(|o| o.0).collect()))
}

/// Parses a JSON body; errors say where the JSON breaks or which field has the wrong type.
pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let body: Body = serde_path_to_error::deserialize(&mut de)
        .map(|o: Obj<Body>| o.0)
        .map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                ApiError::bad_body(format!("the request body is not valid JSON: {inner}"))
            } else if path == "." {
                ApiError::bad_body(format!("the request body must be a JSON object: {inner}"))
            } else {
                ApiError::bad(path.clone(), format!("field `{path}`: {inner}"))
            }
        })?;
    de.end()
        .map_err(|e| ApiError::bad_body(format!("the request body is not valid JSON: {e}")))?;
    Ok(body)
}

/// Which endpoint a body came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What the response needs besides the scheduler's events.
#[derive(Debug, Clone)]
pub struct Shape {
    pub endpoint: Endpoint,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// Log-probabilities asked for (chat: `logprobs: true`).
    pub logprobs: bool,
}

/// Limits the server applies to every request.
pub struct Limits<'a> {
    pub served_model_name: &'a str,
    pub max_context: usize,
    pub tokenizer: &'a Tokenizer,
    pub resolve: &'a PolicyResolver,
    /// Tokens that end a chat reply (see `end_of_turn_ids`).
    pub end_of_turn: &'a [u32],
    /// The server's speculative decoding (`serve --speculate`), for requests that say none.
    pub speculate: Option<&'a SpecOptions>,
    /// Whether the server has a draft model (`serve --draft-model`) for the `model` drafter.
    pub draft_model: bool,
}

/// The request's speculative decoding: its `speculate` field over the server's default.
fn speculation(
    req: Option<&SpeculateRequest>,
    default: Option<&SpecOptions>,
) -> Result<Option<SpecOptions>, ApiError> {
    let Some(r) = req else {
        return Ok(default.cloned());
    };
    // Every field is checked, `off` included (a bad value is refused whatever the drafter).
    let drafter: Option<DraftKind> = match r.drafter.as_str() {
        "off" => None,
        d => Some(d.parse().map_err(|e: String| {
            ApiError::bad(
                "speculate.drafter",
                e.replace("drafter", "speculate.drafter"),
            )
        })?),
    };
    let mut o = default.cloned().unwrap_or_default();
    if let Some(v) = &r.spec_tokens {
        let text = match v {
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        o.tokens = text.parse().map_err(|e: String| {
            ApiError::bad(
                "speculate.spec_tokens",
                e.replace("--spec-tokens", "speculate.spec_tokens"),
            )
        })?;
    }
    if let Some(f) = &r.refresh {
        o.refresh_every = match f.as_str() {
            "every" => true,
            "trigger" => false,
            _ => {
                return Err(ApiError::bad(
                    "speculate.refresh",
                    format!("speculate.refresh `{f}` is not one of every, trigger"),
                ))
            }
        };
    }
    Ok(drafter.map(|d| SpecOptions { drafter: d, ..o }))
}

/// Checks a body and builds the scheduler's request.
pub fn check(body: Body, ep: Endpoint, lim: &Limits) -> Result<(Request, Shape), ApiError> {
    if let Some(m) = &body.model {
        if m != lim.served_model_name {
            return Err(ApiError {
                status: axum::http::StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    lim.served_model_name
                ),
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    if let Some(n) = body.n.filter(|&n| n != 1) {
        return Err(ApiError::bad(
            "n",
            format!("n = {n} is not supported (only n = 1)"),
        ));
    }
    if let Some(b) = body.best_of.filter(|&b| b != 1) {
        return Err(ApiError::bad(
            "best_of",
            format!("best_of = {b} is not supported (only 1)"),
        ));
    }
    if body.echo == Some(true) {
        return Err(ApiError::bad("echo", "echo = true is not supported"));
    }
    if body.suffix.is_some() {
        return Err(ApiError::bad(
            "suffix",
            "suffix (insertion) is not supported",
        ));
    }
    if body.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::bad("logit_bias", "logit_bias is not supported"));
    }
    if body.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::bad(
            "tools",
            "tools (function calling) are not supported",
        ));
    }
    if let Some(rf) = &body.response_format {
        let kind = rf.get("type").and_then(|t| t.as_str());
        if !rf.is_null() && kind != Some("text") {
            return Err(ApiError::bad(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    if body.stream_options.is_some() && !body.stream {
        return Err(ApiError::bad(
            "stream_options",
            "stream_options needs stream = true",
        ));
    }
    let sampler = sampler(&body)?;
    let tok = lim.tokenizer;
    let (prompt, logprobs) = match ep {
        Endpoint::Completions => {
            if body.messages.is_some() {
                return Err(ApiError::bad(
                    "messages",
                    "/v1/completions takes `prompt`; messages go to /v1/chat/completions",
                ));
            }
            let ids = match body.prompt {
                None => return Err(ApiError::bad("prompt", "`prompt` is required")),
                Some(Prompt::Text(t)) => encode(tok, &t, false)?,
                Some(Prompt::Texts(v)) if v.len() == 1 => encode(tok, &v[0], false)?,
                Some(Prompt::Texts(v)) => {
                    return Err(ApiError::bad(
                        "prompt",
                        format!(
                            "{} prompts in one request are not supported (send one)",
                            v.len()
                        ),
                    ))
                }
                Some(Prompt::Tokens(ids)) => {
                    let v = tok.vocab_size();
                    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= v) {
                        return Err(ApiError::bad(
                            "prompt",
                            format!("token id {bad} is outside the vocabulary of {v} tokens"),
                        ));
                    }
                    ids
                }
            };
            let lp = match &body.logprobs {
                None | Some(serde_json::Value::Null) => None,
                Some(v) => match v.as_u64() {
                    Some(n) if n <= 20 => Some(n as usize),
                    _ => {
                        return Err(ApiError::bad(
                            "logprobs",
                            format!(
                                "logprobs must be an integer in 0..=20 for completions, got {v}"
                            ),
                        ))
                    }
                },
            };
            (ids, lp)
        }
        Endpoint::Chat => {
            if body.prompt.is_some() {
                return Err(ApiError::bad(
                    "prompt",
                    "/v1/chat/completions takes `messages`; a prompt goes to /v1/completions",
                ));
            }
            let msgs = body
                .messages
                .ok_or_else(|| ApiError::bad("messages", "`messages` is required"))?;
            if msgs.is_empty() {
                return Err(ApiError::bad("messages", "`messages` is empty"));
            }
            let mut conv = Vec::with_capacity(msgs.len());
            for (i, m) in msgs.into_iter().enumerate() {
                if !matches!(
                    m.role.as_str(),
                    "system" | "user" | "assistant" | "developer"
                ) {
                    return Err(ApiError::bad(
                        format!("messages[{i}].role"),
                        format!(
                            "role `{}` is not supported (system, user, assistant)",
                            m.role
                        ),
                    ));
                }
                let text = match m.content {
                    None => {
                        return Err(ApiError::bad(
                            format!("messages[{i}].content"),
                            "`content` is required (a string or a list of text parts)",
                        ))
                    }
                    Some(Content::Text(t)) => t,
                    Some(Content::Parts(parts)) => {
                        let mut t = String::new();
                        for (j, p) in parts.into_iter().enumerate() {
                            if p.kind != "text" {
                                return Err(ApiError::bad(
                                    format!("messages[{i}].content[{j}].type"),
                                    format!(
                                        "content parts of type `{}` are not supported (text only)",
                                        p.kind
                                    ),
                                ));
                            }
                            t.push_str(&p.text.unwrap_or_default());
                        }
                        t
                    }
                };
                let role = if m.role == "developer" {
                    "system".to_owned()
                } else {
                    m.role
                };
                conv.push(ChatMessage::new(role, text));
            }
            let text = tok
                .apply_chat_template(&conv, true)
                .map_err(|e| ApiError::bad("messages", format!("the chat template failed: {e}")))?;
            let ids = encode(tok, &text, true)?;
            let lp = match &body.logprobs {
                None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {
                    if body.top_logprobs.is_some_and(|n| n > 0) {
                        return Err(ApiError::bad(
                            "top_logprobs",
                            "top_logprobs needs logprobs = true",
                        ));
                    }
                    None
                }
                Some(serde_json::Value::Bool(true)) => match body.top_logprobs.unwrap_or(0) {
                    n if n <= 20 => Some(n),
                    n => {
                        return Err(ApiError::bad(
                            "top_logprobs",
                            format!("top_logprobs must be in 0..=20, got {n}"),
                        ))
                    }
                },
                Some(v) => {
                    return Err(ApiError::bad(
                        "logprobs",
                        format!("logprobs must be a boolean for chat completions, got {v}"),
                    ))
                }
            };
            (ids, lp)
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad(
            "prompt",
            "the prompt is empty after tokenization",
        ));
    }
    if prompt.len() >= lim.max_context {
        return Err(ApiError::bad(
            if ep == Endpoint::Chat {
                "messages"
            } else {
                "prompt"
            },
            format!(
                "the prompt has {} tokens; this server's context (--max-context) is {} tokens",
                prompt.len(),
                lim.max_context
            ),
        ));
    }
    let room = lim.max_context - prompt.len();
    // Both are checked, though max_completion_tokens wins when both are given.
    for (param, v) in [
        ("max_tokens", body.max_tokens),
        ("max_completion_tokens", body.max_completion_tokens),
    ] {
        if v == Some(0) {
            return Err(ApiError::bad(param, format!("{param} must be at least 1")));
        }
    }
    let asked = body.max_completion_tokens.or(body.max_tokens);
    let max_tokens = match ep {
        // OpenAI's default for completions.
        Endpoint::Completions => asked.unwrap_or(16),
        Endpoint::Chat => asked.unwrap_or(room),
    }
    .min(room);
    let stop = match body.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 16 {
        return Err(ApiError::bad(
            "stop",
            format!("{} stop strings; at most 16", stop.len()),
        ));
    }
    // A budget is checked by the policies that read one; one that is never valid is refused
    // whatever the policy.
    if let Some(b) = body.kv_policy.as_ref().and_then(|p| p.kv_budget) {
        if !(b.is_finite() && b > 0.0) {
            return Err(ApiError::bad(
                "kv_policy.kv_budget",
                format!("kv_policy.kv_budget must be a positive token count or a fraction below 1, got {b}"),
            ));
        }
    }
    let speculate = speculation(body.speculate.as_ref(), lim.speculate)?;
    if speculate
        .as_ref()
        .is_some_and(|o| o.drafter == DraftKind::Model)
        && !lim.draft_model
    {
        return Err(ApiError::bad(
            "speculate.drafter",
            "speculate.drafter `model` needs a server started with --draft-model".to_string(),
        ));
    }
    if speculate.is_some() && logprobs.is_some() {
        return Err(ApiError::bad(
            "speculate",
            "logprobs are not available with speculative decoding; send \"speculate\": {\"drafter\": \"off\"} or no logprobs".to_string(),
        ));
    }
    // Lossless speculation: the sequence runs the drafter's own policy (sfi, streaming) or
    // full KV (ngram, model), whatever the server's default policy is.
    let kv_policy = match &speculate {
        None => body.kv_policy.clone(),
        Some(o) => {
            let want = if o.drafter.is_self() {
                o.drafter.name()
            } else {
                "full"
            };
            let mut kp = body.kv_policy.clone().unwrap_or_default();
            if let Some(n) = kp.name.as_deref().filter(|&n| n != want) {
                return Err(ApiError::bad(
                    "kv_policy.name",
                    format!(
                        "kv_policy.name `{n}` with speculate.drafter `{}`: speculative decoding is lossless (full KV's output) and runs the {want} policy",
                        o.drafter.name()
                    ),
                ));
            }
            kp.name = Some(want.to_owned());
            Some(kp)
        }
    };
    let policy = (lim.resolve)(kv_policy.as_ref(), prompt.len() + max_tokens)
        .map_err(|e| ApiError::bad("kv_policy", e))?;
    let shape = Shape {
        endpoint: ep,
        stream: body.stream,
        include_usage: body.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: body.return_token_ids,
        logprobs: logprobs.is_some(),
    };
    Ok((
        Request {
            prompt,
            max_tokens,
            sampler,
            stop,
            ignore_eos: body.ignore_eos,
            stop_tokens: match ep {
                Endpoint::Chat => lim.end_of_turn.to_vec(),
                Endpoint::Completions => Vec::new(),
            },
            policy,
            logprobs,
            speculate,
            inspect: body.inspect,
        },
        shape,
    ))
}

/// The end-of-turn tokens of the common chat templates that this vocabulary has (Gemma's
/// `<end_of_turn>`, ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`): a chat reply ends there.
pub fn end_of_turn_ids(tok: &Tokenizer) -> Vec<u32> {
    ["<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>"]
        .iter()
        .filter_map(|t| tok.token_id(t))
        .filter(|&id| tok.is_special(id))
        .collect()
}

fn encode(tok: &Tokenizer, text: &str, chat: bool) -> Result<Vec<u32>, ApiError> {
    // As `slowfast generate`: BOS as the model asks; special-token texts parsed in chat only.
    tok.encode_with(text, true, chat).map_err(|e| {
        ApiError::bad(
            if chat { "messages" } else { "prompt" },
            format!("cannot tokenize: {e}"),
        )
    })
}

/// A request's number as the sampler's f32. Where only positive values are valid (top_p,
/// repetition_penalty), a positive value below f32's range becomes the smallest normal f32
/// instead of 0: `top_p: 1e-50` is in (0, 1] and means "the top token only", as 1e-30 does.
/// Elsewhere such a value becomes 0 (a temperature of 1e-50 is greedy). A value past f32's
/// range becomes infinite, which the sampler's checks refuse.
fn narrow(x: f64, positive: bool) -> f32 {
    let v = x as f32;
    if positive && x > 0.0 && v < f32::MIN_POSITIVE {
        f32::MIN_POSITIVE
    } else {
        v
    }
}

/// The sampler chain of a request: OpenAI's defaults (temperature 1, top_p 1), slowfast's
/// extensions top_k, min_p and repetition_penalty off unless given.
fn sampler(b: &Body) -> Result<SamplerConfig, ApiError> {
    let top_k = match b.top_k {
        None => 0,
        Some(k) if k <= 0 => 0, // -1 / 0: off (vLLM, llama.cpp)
        Some(k) => k as usize,
    };
    // Rounding to f32 must not carry a value past a bound onto it (a top_p of
    // 1.0000000000000002 is not 1, a min_p of -1e-50 is not 0): such values are refused here,
    // as sent, with the sampler's words.
    let bounded = [
        ("top_p", b.top_p, "in (0, 1]", 0.0, 1.0),
        ("min_p", b.min_p, "in [0, 1]", 0.0, 1.0),
        (
            "presence_penalty",
            b.presence_penalty,
            "a number in [-2, 2]",
            -2.0,
            2.0,
        ),
        (
            "frequency_penalty",
            b.frequency_penalty,
            "a number in [-2, 2]",
            -2.0,
            2.0,
        ),
    ];
    for (field, x, range, lo, hi) in bounded {
        if let Some(x) = x.filter(|&x| x < lo || x > hi) {
            return Err(ApiError::bad(
                field,
                format!("{field} must be {range}, got {x}"),
            ));
        }
    }
    let seed = b.seed.unwrap_or_else(SamplerConfig::clock_seed);
    let c = SamplerConfig {
        temperature: narrow(b.temperature.unwrap_or(1.0), false),
        top_k,
        top_p: narrow(b.top_p.unwrap_or(1.0), true),
        min_p: narrow(b.min_p.unwrap_or(0.0), false),
        repetition_penalty: narrow(b.repetition_penalty.unwrap_or(1.0), true),
        repeat_last_n: 64,
        presence_penalty: narrow(b.presence_penalty.unwrap_or(0.0), false),
        frequency_penalty: narrow(b.frequency_penalty.unwrap_or(0.0), false),
        seed,
    };
    c.validate().map_err(|e| {
        // The sampler names its CLI flag (`--top-p`); the API's field is `top_p`.
        let msg = e.to_string();
        let field = msg
            .split_whitespace()
            .next()
            .unwrap_or("")
            .trim_start_matches("--")
            .replace('-', "_");
        ApiError::bad(
            field.clone(),
            msg.replacen(&format!("--{}", field.replace('_', "-")), &field, 1),
        )
    })?;
    Ok(c)
}

#[cfg(test)]
mod tests;
