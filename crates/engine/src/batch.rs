//! Batched decode of several CPU sessions (continuous batching): `step_batch` does for each
//! session what `Session::step` does, with one `Model::decode_batch` forward for all of them.
use half::f16;
use slowfast_kv::CacheElem;
use slowfast_model::{DecodeRow, Model, Scratch};

use crate::session::{Cache, Session};
use crate::EngineError;

/// Decode `tokens[i]` in `sessions[i]`, all in one forward: for each session the policy sees
/// `on_token`, the token runs at the session's own position, then `end_step`; afterwards every
/// session's `logits()` holds its own `[vocab]` row, bit-equal to what `Session::step` would
/// give. The sessions must share one `Model` (the same object) and one KV dtype.
///
/// The batch is checked (token ids, cache room) before any policy sees a token, so a rejected
/// batch leaves every session as it was; the model's errors name the row (`row i` is
/// `sessions[i]`). An `end_step` failure of one session does not skip the others (their
/// forward has run); the first one is returned.
pub fn step_batch(
    sessions: &mut [&mut Session<'_>],
    tokens: &[u32],
    scratch: &mut Scratch,
) -> Result<(), EngineError> {
    let Some(first) = sessions.first() else {
        return Err(EngineError::BadInput("step_batch with no sessions".into()));
    };
    if tokens.len() != sessions.len() {
        return Err(EngineError::BadInput(format!(
            "step_batch: {} tokens for {} sessions",
            tokens.len(),
            sessions.len()
        )));
    }
    let model = first.model;
    let dtype = |s: &Session<'_>| match s.cache {
        Cache::F32(..) => "f32",
        Cache::F16(..) => "f16",
        Cache::E4m3(..) => "fp8",
    };
    let dtype0 = dtype(first);
    for (i, s) in sessions.iter().enumerate() {
        if !std::ptr::eq(s.model, model) {
            return Err(EngineError::BadInput(format!(
                "step_batch: session {i} runs a different model from session 0"
            )));
        }
        if dtype(s) != dtype0 {
            return Err(EngineError::BadInput(format!(
                "step_batch: session {i} has an {} KV cache, session 0 an {dtype0} one (a batch needs one KV dtype)",
                dtype(s)
            )));
        }
    }
    // Split each session into its cache + policy (a batch row) and its logits buffer.
    let mut logits: Vec<&mut Vec<f32>> = Vec::with_capacity(sessions.len());
    let mut rows32: Vec<DecodeRow<'_, f32>> = Vec::new();
    let mut rows16: Vec<DecodeRow<'_, f16>> = Vec::new();
    let mut rows8: Vec<DecodeRow<'_, slowfast_kv::E4m3>> = Vec::new();
    for (s, &token) in sessions.iter_mut().zip(tokens) {
        let Session {
            cache, logits: l, ..
        } = &mut **s;
        logits.push(l);
        match cache {
            Cache::F32(cache, p) => rows32.push(DecodeRow {
                token,
                cache,
                policy: p.as_mut(),
            }),
            Cache::F16(cache, p) => rows16.push(DecodeRow {
                token,
                cache,
                policy: p.as_mut(),
            }),
            Cache::E4m3(cache, p) => rows8.push(DecodeRow {
                token,
                cache,
                policy: p.as_mut(),
            }),
        }
    }
    // one dtype a batch (checked above): the non-empty list
    if !rows16.is_empty() {
        step_rows(model, &mut rows16, scratch, &mut logits)
    } else if !rows8.is_empty() {
        step_rows(model, &mut rows8, scratch, &mut logits)
    } else {
        step_rows(model, &mut rows32, scratch, &mut logits)
    }
}

/// `step_batch` on rows of one KV dtype; `logits[i]` is row `i`'s session's logits.
fn step_rows<T: CacheElem>(
    model: &Model,
    rows: &mut [DecodeRow<'_, T>],
    scratch: &mut Scratch,
    logits: &mut [&mut Vec<f32>],
) -> Result<(), EngineError> {
    // Before `on_token` touches any policy, so a refused batch leaves every session as it was
    // (`decode_batch` checks again for its other callers: O(rows), no allocation).
    model.check_decode_batch(rows)?;
    for r in rows.iter_mut() {
        r.policy.on_token(r.token);
    }
    // Row 0's own buffer takes the whole `[rows, vocab]` block and is cut back to its row
    // after the others are copied out: no allocation per step.
    let mut all = std::mem::take(&mut *logits[0]);
    let r = model.decode_batch(rows, scratch, &mut all);
    if r.is_ok() {
        let v = model.cfg.vocab_size;
        for (i, l) in logits.iter_mut().enumerate().skip(1) {
            l.clear();
            l.extend_from_slice(&all[i * v..(i + 1) * v]);
        }
        all.truncate(v);
    }
    *logits[0] = all;
    r?;
    let mut first_err = None;
    for (i, r) in rows.iter_mut().enumerate() {
        if let Err(e) = r.policy.end_step(r.cache) {
            first_err.get_or_insert_with(|| {
                EngineError::BadInput(format!(
                    "decode step of session {i} ({}): {e}",
                    r.policy.name()
                ))
            });
        }
    }
    first_err.map_or(Ok(()), Err)
}
