//! Logits of the tiny random HF checkpoints (tests/fixtures/hf, made with transformers) must
//! match the expected ones: whole-sequence prefill, chunked prefill, and token-by-token decode.
use std::path::PathBuf;

use safetensors::SafeTensors;
use slowfast_model::load::{load_model, ModelSource};
use slowfast_model::{LogitsRows, Model, Scratch};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name)
}

struct Expected {
    ids: Vec<u32>,
    logits: Vec<f32>, // [T, vocab]
    greedy: Vec<u32>,
}

fn expected(name: &str) -> Expected {
    let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let i64s = |k: &str| -> Vec<u32> {
        st.tensor(k)
            .unwrap()
            .data()
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    };
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Expected {
        ids: i64s("input_ids"),
        logits,
        greedy: i64s("greedy_ids"),
    }
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    diff / scale
}

fn run_chunks(m: &Model, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut cache = m.new_cache::<f32>(ids.len() + 16, chunk);
    let mut s = Scratch::default();
    let mut all = Vec::new();
    let mut out = Vec::new();
    for (i, c) in ids.chunks(chunk).enumerate() {
        m.forward(c, i * chunk, &mut cache, &mut s, LogitsRows::All, &mut out)
            .unwrap();
        all.extend_from_slice(&out);
    }
    all
}

fn greedy(m: &Model, ids: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache::<f32>(ids.len() + n + 1, 64);
    let mut s = Scratch::default();
    let mut out = Vec::new();
    m.forward(ids, 0, &mut cache, &mut s, LogitsRows::Last, &mut out)
        .unwrap();
    let mut got = Vec::new();
    for i in 0..n {
        let t = out
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (j, &v)| if v > b.1 { (j, v) } else { b },
            )
            .0 as u32;
        got.push(t);
        m.forward(
            &[t],
            ids.len() + i,
            &mut cache,
            &mut s,
            LogitsRows::Last,
            &mut out,
        )
        .unwrap();
    }
    got
}

fn check(name: &str) {
    let m = load_model(&ModelSource::HfDir(fixture(name))).unwrap();
    let e = expected(name);
    for chunk in [e.ids.len(), 5, 1] {
        let got = run_chunks(&m, &e.ids, chunk);
        let err = rel_err(&got, &e.logits);
        eprintln!("{name} chunk {chunk}: {err:e}");
        assert!(
            err <= 1e-4,
            "{name} chunk {chunk}: max relative error {err:e}"
        );
    }
    assert_eq!(
        greedy(&m, &e.ids, e.greedy.len()),
        e.greedy,
        "{name}: greedy continuation"
    );
    // An f16 KV cache stays close (not exact).
    let mut cache = m.new_cache::<half::f16>(e.ids.len(), 8);
    let (mut s, mut out, mut all) = (Scratch::default(), Vec::new(), Vec::new());
    for (i, c) in e.ids.chunks(8).enumerate() {
        m.forward(c, i * 8, &mut cache, &mut s, LogitsRows::All, &mut out)
            .unwrap();
        all.extend_from_slice(&out);
    }
    let err = rel_err(&all, &e.logits);
    assert!(err <= 2e-2, "{name} f16 KV: max relative error {err:e}");
}

#[test]
fn qwen3_logits_match_transformers() {
    check("qwen3");
}

#[test]
fn qwen3_bf16_logits_match_transformers() {
    check("qwen3-bf16");
}

#[test]
fn llama_sharded_logits_match_transformers() {
    check("llama");
}

#[test]
fn gemma3_logits_match_transformers() {
    check("gemma3");
}

#[test]
fn qwen2_logits_match_transformers() {
    // q/k/v biases, untied head, window 8 on the layers from max_window_layers = 1 on (the
    // config has no layer_types: the Qwen2 rule decides).
    let m = load_model(&ModelSource::HfDir(fixture("qwen2"))).unwrap();
    assert_eq!(m.cfg.arch, slowfast_model::Arch::Qwen2);
    assert_eq!(m.cfg.sliding_window, Some(8));
    assert_eq!(m.cfg.layer_sliding, [false, true, true]);
    assert!(!m.cfg.tie_word_embeddings && m.weights.lm_head.is_some());
    assert!(m
        .weights
        .layers
        .iter()
        .all(|l| l.bq.is_some() && l.bk.is_some() && l.bv.is_some()));
    check("qwen2");
}

#[test]
fn mistral_logits_match_transformers() {
    // Window 6 on every layer, tied embeddings.
    let m = load_model(&ModelSource::HfDir(fixture("mistral"))).unwrap();
    assert_eq!(m.cfg.arch, slowfast_model::Arch::Mistral);
    assert_eq!(m.cfg.sliding_window, Some(6));
    assert_eq!(m.cfg.layer_sliding, [true, true]);
    assert!(m.cfg.tie_word_embeddings && m.weights.lm_head.is_none());
    check("mistral");
}
