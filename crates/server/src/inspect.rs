//! `GET /v1/inspect/{id}`: the KV inspection of a finished request that asked for it
//! (`"inspect": true`). The server keeps the records of the last [`KEEP`] such requests;
//! each names, per layer and kv head, the positions the KV policy held at the end by role
//! (sinks, selected, recent window, kept) as `[start, end)` runs, the policy's slow steps with
//! their reasons, and the text of every position, so a page can colour the prompt.
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use slowfast_engine::scheduler::{Finish, Inspection};
use slowfast_tokenizer::Tokenizer;

use crate::error::ApiError;
use crate::AppState;

/// Records kept (the oldest goes first).
pub const KEEP: usize = 16;
/// Runs (over every layer, kv head and role) one record holds at most; past it each head's
/// selected and kept runs are cut and the record says `"truncated": true`.
pub const MAX_RUNS: usize = 1 << 16;

/// The records of the last `KEEP` inspected requests, by response id.
#[derive(Default)]
pub struct Inspections {
    records: Mutex<VecDeque<(String, Arc<Value>)>>,
}

impl Inspections {
    pub fn put(&self, id: String, record: Value) {
        let mut r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|(k, _)| *k != id);
        if r.len() >= KEEP {
            r.pop_front();
        }
        r.push_back((id, Arc::new(record)));
    }

    pub fn get(&self, id: &str) -> Option<Arc<Value>> {
        let r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        r.iter().find(|(k, _)| k == id).map(|(_, v)| v.clone())
    }
}

/// The text of a token (lossy: a character split over tokens shows as U+FFFD in each).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&tok.token_bytes(id, true)).into_owned()
}

/// The JSON record of a finished request: `prompt` and `generated` are its token ids.
pub fn record(
    id: &str,
    model: &str,
    tok: &Tokenizer,
    prompt: &[u32],
    generated: &[u32],
    f: &Finish,
    ins: &Inspection,
) -> Value {
    let tokens: Vec<String> = prompt
        .iter()
        .chain(generated)
        .take(ins.positions)
        .map(|&t| token_text(tok, t))
        .collect();
    let heads: usize = ins.layers.iter().map(|l| l.heads.len()).sum();
    // Each head gets an equal share of the run limit (sinks and the window come first).
    let share = MAX_RUNS / heads.max(1);
    let mut truncated = false;
    let layers: Vec<Value> = ins
        .layers
        .iter()
        .map(|l| {
            let hs: Vec<Value> = l
                .heads
                .iter()
                .map(|h| {
                    let mut h = h.clone();
                    truncated |= h.truncate_runs(share);
                    json!({
                        "sinks": h.sinks, "selected": h.selected,
                        "recent": h.recent, "kept": h.kept,
                    })
                })
                .collect();
            json!({"layer": l.layer, "sliding": l.sliding, "heads": hs})
        })
        .collect();
    json!({
        "id": id,
        "object": "slowfast.inspection",
        "model": model,
        "policy": f.policy,
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "positions": ins.positions,
        "tokens": tokens,
        "layers": layers,
        "slow_steps": ins.slow_steps,
        "slow_steps_total": ins.slow_steps_total,
        "steps": {"slow": f.stats.slow_steps, "fast": f.stats.fast_steps},
        "truncated": truncated,
    })
}

pub(crate) async fn get(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = crate::handlers::authorize(&s, &headers) {
        return e.into_response();
    }
    match s.inspections.get(&id) {
        Some(v) => axum::Json(v.as_ref().clone()).into_response(),
        None => ApiError::status(
            StatusCode::NOT_FOUND,
            format!(
                "no inspection of `{id}`: the request must send \"inspect\": true, run on the CPU and be among the last {KEEP} inspected"
            ),
            "not_found",
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_records() {
        let s = Inspections::default();
        for i in 0..KEEP + 3 {
            s.put(format!("cmpl-{i}"), json!({"i": i}));
        }
        assert!(s.get("cmpl-0").is_none() && s.get("cmpl-2").is_none());
        assert_eq!(s.get("cmpl-3").unwrap()["i"], 3);
        assert_eq!(s.get(&format!("cmpl-{}", KEEP + 2)).unwrap()["i"], KEEP + 2);
        // The same id again replaces its record without pushing another out.
        s.put("cmpl-3".into(), json!({"i": 99}));
        assert_eq!(s.get("cmpl-3").unwrap()["i"], 99);
        assert_eq!(s.get("cmpl-4").unwrap()["i"], 4);
    }
}
