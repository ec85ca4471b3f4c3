//! The HTTP handlers: auth, body parsing, submission to the scheduler, and the responses
//! (one JSON object, or server-sent events: one chunk per batch of tokens, then `[DONE]`).
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use slowfast_engine::scheduler::{Event, EventSink, Finish, FinishReason, SubmitError, TokenOut};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::api::{self, Endpoint, Limits, Shape};
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::AppState;

type St = State<Arc<AppState>>;

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn metrics(State(s): St) -> Response {
    let text = s.metrics.render(s.sched.gauges());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::OPENAPI_JSON,
    )
        .into_response()
}

pub async fn models(State(s): St, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.served_model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "slowfast",
            "max_model_len": s.cfg.max_context,
        }]
    }))
    .into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "no such endpoint (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/inspect/{id}, /health, /metrics, /openapi.json, the playground at /)",
        "not_found",
    )
}

pub async fn completions(State(s): St, h: HeaderMap, b: Body) -> Response {
    let b = read_body(&s, &h, b).await;
    handle(s, h, b, Endpoint::Completions).await
}

pub async fn chat(State(s): St, h: HeaderMap, b: Body) -> Response {
    let b = read_body(&s, &h, b).await;
    handle(s, h, b, Endpoint::Chat).await
}

/// The whole request body, at most --max-body-bytes (413 past it, told by Content-Length or
/// counted), received within --body-read-timeout (408 past it: a client trickling its body
/// cannot hold a handler); a body cut short (the client closed) is a 400, and so is one that
/// is not UTF-8.
async fn read_body(s: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = s.cfg.max_body_bytes;
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)"
            ),
            "body_too_large",
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let collect = async {
        let mut buf: Vec<u8> = Vec::with_capacity(declared.unwrap_or(0) as usize);
        let mut data = body.into_data_stream();
        while let Some(chunk) = data.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_body(format!(
                    "cannot read the request body (the client closed it early?): {e}"
                ))
            })?;
            if buf.len() + chunk.len() > limit {
                return Err(too_large());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    let t = s.cfg.body_read_timeout;
    let bytes = match tokio::time::timeout(t, collect).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(ApiError::status(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s (--body-read-timeout)",
                    t.as_secs_f64()
                ),
                "body_read_timeout",
            ))
        }
    };
    if let Err(e) = std::str::from_utf8(&bytes) {
        return Err(ApiError::bad_body(format!(
            "the request body is not valid UTF-8 (invalid byte at offset {}); send JSON in UTF-8",
            e.valid_up_to()
        )));
    }
    Ok(bytes)
}

pub(crate) fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.cfg.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if g.trim() == key => Ok(()),
        Some(_) => Err(ApiError::status(
            StatusCode::UNAUTHORIZED,
            "invalid API key",
            "invalid_api_key",
        )),
        None => Err(ApiError::status(
            StatusCode::UNAUTHORIZED,
            "missing API key: send `Authorization: Bearer <key>`",
            "invalid_api_key",
        )),
    }
}

/// The scheduler's events into a tokio channel; a dropped receiver (client gone) closes it.
struct ChannelSink(UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&self, ev: Event) -> bool {
        self.0.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Counts a request's tokens and latencies as they come, and its outcome when it ends (a
/// request dropped before its end, because the client left, counts as cancelled).
struct Tracker {
    state: Arc<AppState>,
    arrived: Instant,
    last: Option<Instant>,
    outcome: Option<Outcome>,
}

impl Tracker {
    fn tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let m = &self.state.metrics;
        match self.last {
            None => m.ttft.observe((now - self.arrived).as_secs_f64()),
            Some(t) => m.itl.observe((now - t).as_secs_f64() / n as f64),
        }
        self.last = Some(now);
        m.generation_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.state
            .metrics
            .count(self.outcome.unwrap_or(Outcome::Cancelled));
    }
}

async fn handle(
    s: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, ApiError>,
    ep: Endpoint,
) -> Response {
    let arrived = Instant::now();
    let prepared = authorize(&s, &headers).and_then(|()| {
        let bytes = body?;
        let body = api::parse(&bytes)?;
        let lim = Limits {
            served_model_name: &s.cfg.served_model_name,
            max_context: s.cfg.max_context,
            tokenizer: &s.loaded.tokenizer,
            resolve: s.resolve.as_ref(),
            end_of_turn: &s.end_of_turn,
            speculate: s.cfg.speculate.as_ref(),
            draft_model: s.cfg.draft_model,
        };
        api::check(body, ep, &lim)
    });
    let prepared = prepared.and_then(|(req, shape)| {
        if req.inspect && s.cfg.device != "cpu" {
            return Err(ApiError::bad(
                "inspect",
                format!(
                    "inspect: the KV inspection runs on the CPU only (this server runs on {})",
                    s.cfg.device
                ),
            ));
        }
        Ok((req, shape))
    });
    let (req, shape) = match prepared {
        Ok(x) => x,
        Err(e) => {
            s.metrics.count(Outcome::Rejected);
            return e.into_response();
        }
    };
    let inspect_prompt = req.inspect.then(|| req.prompt.clone());
    let prompt_tokens = req.prompt.len();
    let (tx, rx) = unbounded_channel();
    if let Err(e) = s.sched.submit(req, Box::new(ChannelSink(tx))) {
        s.metrics.count(Outcome::Rejected);
        let (status, code) = match e {
            SubmitError::QueueFull(_) => (StatusCode::TOO_MANY_REQUESTS, "queue_full"),
            SubmitError::Stopped => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        };
        return ApiError::status(status, e.to_string(), code).into_response();
    }
    s.metrics
        .prompt_tokens
        .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = Meta {
        id: match ep {
            Endpoint::Completions => format!("cmpl-{n}"),
            Endpoint::Chat => format!("chatcmpl-{n}"),
        },
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: s.cfg.served_model_name.clone(),
        shape,
        inspect_prompt,
    };
    let tracker = Tracker {
        state: s.clone(),
        arrived,
        last: None,
        outcome: None,
    };
    if meta.shape.stream {
        let mut resp = Sse::new(sse_stream(s, rx, tracker, meta))
            .keep_alive(KeepAlive::default())
            .into_response();
        // nginx: pass the stream through unbuffered.
        resp.headers_mut()
            .insert("x-accel-buffering", header::HeaderValue::from_static("no"));
        resp
    } else {
        whole(s, rx, tracker, meta).await
    }
}

/// Per-response constants.
struct Meta {
    id: String,
    created: u64,
    model: String,
    shape: Shape,
    /// The prompt's tokens, kept when the request asked for an inspection.
    inspect_prompt: Option<Vec<u32>>,
}

/// Keeps the inspection of a finished request (before its last chunk or its response goes
/// out, so a client that reads the end can fetch it at once).
fn keep_inspection(s: &AppState, meta: &Meta, generated: &[u32], f: &Finish) {
    if let (Some(prompt), Some(ins)) = (&meta.inspect_prompt, &f.inspection) {
        let rec = crate::inspect::record(
            &meta.id,
            &meta.model,
            &s.loaded.tokenizer,
            prompt,
            generated,
            f,
            ins,
        );
        s.inspections.put(meta.id.clone(), rec);
    }
}

/// Collects the events of a non-streaming request into one response.
async fn whole(
    s: Arc<AppState>,
    mut rx: UnboundedReceiver<Event>,
    mut tracker: Tracker,
    meta: Meta,
) -> Response {
    let mut toks: Vec<TokenOut> = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Token(t)) => {
                tracker.tokens(1);
                toks.push(t);
            }
            Some(Event::Done(f)) => {
                tracker.outcome = Some(Outcome::Ok);
                let ids: Vec<u32> = toks.iter().map(|t| t.id).collect();
                keep_inspection(&s, &meta, &ids, &f);
                let text: String = toks
                    .iter()
                    .map(|t| t.text.as_str())
                    .chain([f.text.as_str()])
                    .collect();
                let mut choice = match meta.shape.endpoint {
                    Endpoint::Completions => json!({"index": 0, "text": text}),
                    Endpoint::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}})
                    }
                };
                choice["logprobs"] = logprobs_json(&s, &meta.shape, &toks);
                choice["finish_reason"] = json!(finish_name(f.reason));
                if meta.shape.return_token_ids {
                    choice["token_ids"] = json!(toks.iter().map(|t| t.id).collect::<Vec<_>>());
                }
                let object = match meta.shape.endpoint {
                    Endpoint::Completions => "text_completion",
                    Endpoint::Chat => "chat.completion",
                };
                return Json(json!({
                    "id": meta.id,
                    "object": object,
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": usage(&f),
                    "slowfast": extension(&f),
                }))
                .into_response();
            }
            Some(Event::Error(e)) => {
                tracker.outcome = Some(Outcome::Error);
                return scheduler_error(e, toks.is_empty()).into_response();
            }
            None => {
                tracker.outcome = Some(Outcome::Error);
                return ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the scheduler failed while running this request (see the server's log)",
                    "internal",
                )
                .into_response();
            }
        }
    }
}

/// A scheduler failure before any token is the request's fault (e.g. a policy that cannot
/// run this prompt); after tokens, the server's.
fn scheduler_error(msg: String, before_tokens: bool) -> ApiError {
    if before_tokens {
        ApiError::bad("prompt", msg)
    } else {
        ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, msg, "internal")
    }
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// slowfast's own fields of a finished request.
fn extension(f: &Finish) -> Value {
    json!({
        "policy": f.policy,
        "slow_steps": f.stats.slow_steps,
        "fast_steps": f.stats.fast_steps,
        "mean_attended_tokens": f.stats.mean_attended(),
    })
}

/// The text of one token as the logprobs list shows it.
fn token_str(s: &AppState, id: u32) -> (String, Vec<u8>) {
    let b = s.loaded.tokenizer.token_bytes(id, true);
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// `logprobs` of a choice (or a chunk) for `toks`, in the endpoint's shape; null when off.
fn logprobs_json(s: &AppState, shape: &Shape, toks: &[TokenOut]) -> Value {
    if !shape.logprobs {
        return Value::Null;
    }
    match shape.endpoint {
        Endpoint::Completions => {
            let (mut tokens, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
            let mut off = 0;
            for t in toks {
                let lp = t.logprob.as_ref().expect("asked for");
                let (txt, _) = token_str(s, t.id);
                offs.push(off);
                off += txt.len();
                tokens.push(txt);
                lps.push(lp.logprob);
                let mut m = serde_json::Map::new();
                for &(id, l) in &lp.top {
                    m.insert(token_str(s, id).0, json!(l));
                }
                tops.push(Value::Object(m));
            }
            json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
        }
        Endpoint::Chat => {
            let content: Vec<Value> = toks
                .iter()
                .map(|t| {
                    let lp = t.logprob.as_ref().expect("asked for");
                    let (txt, bytes) = token_str(s, t.id);
                    let top: Vec<Value> = lp
                        .top
                        .iter()
                        .map(|&(id, l)| {
                            let (tt, tb) = token_str(s, id);
                            json!({"token": tt, "logprob": l, "bytes": tb})
                        })
                        .collect();
                    json!({"token": txt, "logprob": lp.logprob, "bytes": bytes, "top_logprobs": top})
                })
                .collect();
            json!({ "content": content })
        }
    }
}

/// State of a streaming response.
struct Streaming {
    s: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    tracker: Tracker,
    meta: Meta,
    sent_role: bool,
    done: bool,
    /// The ids generated so far (kept for an inspection only).
    generated: Vec<u32>,
}

impl Streaming {
    fn chunk(&mut self, text: String, toks: &[TokenOut], finish: Option<&Finish>) -> SseEvent {
        let m = &self.meta;
        let mut choice = match m.shape.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": text}),
            Endpoint::Chat => {
                let mut delta = json!({"content": text});
                if !self.sent_role {
                    delta["role"] = json!("assistant");
                    self.sent_role = true;
                }
                json!({"index": 0, "delta": delta})
            }
        };
        choice["logprobs"] = logprobs_json(&self.s, &m.shape, toks);
        choice["finish_reason"] = json!(finish.map(|f| finish_name(f.reason)));
        if m.shape.return_token_ids {
            choice["token_ids"] = json!(toks.iter().map(|t| t.id).collect::<Vec<_>>());
        }
        let object = match m.shape.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let mut v = json!({
            "id": m.id,
            "object": object,
            "created": m.created,
            "model": m.model,
            "choices": [choice],
        });
        if let Some(f) = finish {
            v["slowfast"] = extension(f);
        }
        if m.shape.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    }

    /// The next events to send: a chunk of every token waiting now, or the end.
    async fn next(&mut self) -> Option<Vec<SseEvent>> {
        if self.done {
            return None;
        }
        let first = self.rx.recv().await;
        let mut toks = Vec::new();
        let mut end = None;
        match first {
            Some(Event::Token(t)) => toks.push(t),
            other => end = Some(other),
        }
        if end.is_none() {
            // Tokens that arrived meanwhile go in the same chunk (a slow client gets fewer,
            // larger chunks), up to the end of the request.
            while let Ok(ev) = self.rx.try_recv() {
                match ev {
                    Event::Token(t) => toks.push(t),
                    other => {
                        end = Some(Some(other));
                        break;
                    }
                }
            }
        }
        self.tracker.tokens(toks.len());
        if self.meta.inspect_prompt.is_some() {
            self.generated.extend(toks.iter().map(|t| t.id));
        }
        let text: String = toks.iter().map(|t| t.text.as_str()).collect();
        let mut out = Vec::new();
        match end {
            None => out.push(self.chunk(text, &toks, None)),
            Some(Some(Event::Done(f))) => {
                keep_inspection(&self.s, &self.meta, &self.generated, &f);
                let text = text + &f.text;
                out.push(self.chunk(text, &toks, Some(&f)));
                if self.meta.shape.include_usage {
                    let m = &self.meta;
                    let object = match m.shape.endpoint {
                        Endpoint::Completions => "text_completion",
                        Endpoint::Chat => "chat.completion.chunk",
                    };
                    let v = json!({
                        "id": m.id, "object": object, "created": m.created, "model": m.model,
                        "choices": [], "usage": usage(&f), "slowfast": extension(&f),
                    });
                    out.push(SseEvent::default().data(v.to_string()));
                }
                out.push(SseEvent::default().data("[DONE]"));
                self.tracker.outcome = Some(Outcome::Ok);
                self.done = true;
            }
            Some(other) => {
                if !toks.is_empty() {
                    out.push(self.chunk(text, &toks, None));
                }
                let err = match other {
                    Some(Event::Error(e)) => scheduler_error(e, !self.sent_any()),
                    _ => ApiError::status(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the scheduler failed while running this request (see the server's log)",
                        "internal",
                    ),
                };
                out.push(SseEvent::default().data(err.body().to_string()));
                out.push(SseEvent::default().data("[DONE]"));
                self.tracker.outcome = Some(Outcome::Error);
                self.done = true;
            }
        }
        Some(out)
    }

    fn sent_any(&self) -> bool {
        self.tracker.last.is_some()
    }
}

fn sse_stream(
    s: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    tracker: Tracker,
    meta: Meta,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let st = Streaming {
        s,
        rx,
        tracker,
        meta,
        sent_role: false,
        done: false,
        generated: Vec::new(),
    };
    stream::unfold(st, |mut st| async move { st.next().await.map(|v| (v, st)) })
        .flat_map(|v| stream::iter(v.into_iter().map(Ok)))
}
