//! What the llama.cpp comparison tests share (gemma3_llamacpp.rs, smollm2_llamacpp.rs): their
//! JSON fixtures under tests/fixtures/<model>/, the log-probs of a text under full KV, greedy cases.
#![allow(dead_code)] // each test file uses its own part

use std::path::PathBuf;

use slowfast_engine::eval::nll_of;
use slowfast_engine::{KvDtype, Loaded, Session};
use slowfast_model::LogitsRows;

/// tests/fixtures/<dir>/<name>, parsed.
pub fn fixture(dir: &str, name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(dir)
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Log-probs of every next token, prefilled in chunks of 512 with all-row logits.
pub fn logprobs(m: &Loaded, toks: &[u32], kv: KvDtype) -> Vec<f64> {
    let chunk = 512;
    let mut s = Session::new(&m.model, toks.len(), kv, chunk);
    let vocab = m.model.cfg.vocab_size;
    let mut out = Vec::new();
    for (ci, c) in toks.chunks(chunk).enumerate() {
        let logits = s.forward(c, LogitsRows::All).unwrap().to_vec();
        for (r, row) in logits.chunks(vocab).enumerate() {
            let i = ci * chunk + r;
            if i + 1 < toks.len() {
                out.push(-nll_of(row, toks[i + 1]));
            }
        }
    }
    out
}

/// A greedy fixture case (`prompt`, `prompt_ids`, `greedy_ids`): checks the prompt's ids, then
/// decodes as many tokens greedily; returns (ours, llama.cpp's).
pub fn greedy_case(m: &Loaded, case: &serde_json::Value, kv: KvDtype) -> (Vec<u32>, Vec<u32>) {
    let prompt = ids(&case["prompt_ids"]);
    let want = ids(&case["greedy_ids"]);
    let ours = m
        .tokenizer
        .encode(case["prompt"].as_str().unwrap(), true)
        .unwrap();
    assert_eq!(ours, prompt, "prompt tokenization differs");
    let mut s = Session::new(&m.model, prompt.len() + want.len() + 1, kv, 512);
    let mut logits = s.prefill(&prompt, &mut |_, _| {}).unwrap().to_vec();
    let mut got = Vec::new();
    for _ in 0..want.len() {
        let t = slowfast_engine::sampler::argmax(&logits).unwrap();
        got.push(t);
        logits = s.step(t).unwrap().to_vec();
    }
    (got, want)
}
