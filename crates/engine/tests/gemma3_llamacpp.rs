//! The default model against llama.cpp (fixtures in tests/fixtures/gemma3, made with
//! llama-cpp-python). Two references: llama.cpp on the Q4_K_M file itself (its matmuls round
//! activations to 8 bits), and llama.cpp on the same weights dequantized to F32 with an f32 KV
//! cache (exact arithmetic on the same weights).
mod llamacpp;
use llamacpp::{fixture, floats, greedy_case, ids, logprobs};

use slowfast_engine::{KvDtype, Loaded};
use slowfast_model::MatmulPrecision;

fn load(precision: MatmulPrecision) -> Option<Loaded> {
    let p = slowfast_loader::test_model_path()?;
    let mut m = slowfast_engine::load(p.to_str().unwrap(), &mut |_| {}).unwrap();
    m.model.precision = precision;
    Some(m)
}

struct Diff {
    mean: f64,
    max: f64,
    nll_ours: f64,
    nll_ref: f64,
}

fn compare(got: &[f64], want: &[f64]) -> Diff {
    assert_eq!(got.len(), want.len());
    let d: Vec<f64> = got.iter().zip(want).map(|(a, b)| (a - b).abs()).collect();
    Diff {
        mean: d.iter().sum::<f64>() / d.len() as f64,
        max: d.iter().fold(0.0, |m: f64, &x| m.max(x)),
        nll_ours: -got.iter().sum::<f64>() / got.len() as f64,
        nll_ref: -want.iter().sum::<f64>() / want.len() as f64,
    }
}

#[test]
fn logprobs_on_2k_tokens_match_llama_cpp() {
    let Some(m) = load(MatmulPrecision::Fast) else {
        return;
    };
    // Same weights in exact arithmetic: every position within 0.02 nats.
    let f = fixture("gemma3", "logprobs_2k_dequant_f32.json");
    let toks = ids(&f["token_ids"]);
    let ours = m
        .tokenizer
        .encode(f["text"].as_str().unwrap(), true)
        .unwrap();
    assert_eq!(
        ours, toks,
        "tokenization of the passage differs from llama.cpp"
    );
    let got = logprobs(&m, &toks, KvDtype::F32);
    let d = compare(&got, &floats(&f["logprobs"]));
    eprintln!(
        "vs llama.cpp (F32 weights, f32 KV): mean |d| {:.5}, max {:.4}",
        d.mean, d.max
    );
    assert!(d.max <= 0.02, "max |d logprob| {} > 0.02", d.max);
    assert!(d.mean <= 0.002, "mean |d logprob| {}", d.mean);

    // llama.cpp on the Q4_K_M file with an f16 KV cache: its 8-bit activation rounding moves
    // each log-prob by 0.068 nats on average (llama.cpp Q4 vs llama.cpp F32 on this passage),
    // so per position we can only be as close as that noise; the mean NLL must agree.
    let f = fixture("gemma3", "logprobs_2k.json");
    assert_eq!(ids(&f["token_ids"]), toks);
    let got = logprobs(&m, &toks, KvDtype::F16);
    let d = compare(&got, &floats(&f["logprobs"]));
    eprintln!(
        "vs llama.cpp (Q4_K_M, f16 KV): mean |d| {:.4}, max {:.4}; mean nll {:.4} vs {:.4}",
        d.mean, d.max, d.nll_ours, d.nll_ref
    );
    assert!(
        (d.nll_ours - d.nll_ref).abs() <= 0.02,
        "mean nll differs by more than 0.02"
    );
    assert!(
        d.mean <= 0.08,
        "mean |d logprob| {} exceeds llama.cpp's own rounding noise",
        d.mean
    );
}

/// A greedy case with llama.cpp's top-2 logit gap at each step.
fn greedy_case_gaps(
    m: &Loaded,
    case: &serde_json::Value,
    kv: KvDtype,
) -> (Vec<u32>, Vec<u32>, Vec<f64>) {
    let (got, want) = greedy_case(m, case, kv);
    (got, want, floats(&case["top2_gap"]))
}

#[test]
fn greedy_32_tokens_equal_llama_cpp_q4() {
    // The fast path (8-bit activations in decode, f16 KV) against llama.cpp on the same file.
    let Some(m) = load(MatmulPrecision::Fast) else {
        return;
    };
    // llama.cpp's matmuls round activations to 8 bits (and ours in decode too, but not
    // bit-identically), so 32-token runs on this reference part after a step whose top-2 gap
    // is within that rounding noise (llama.cpp Q4 vs llama.cpp F32: 0.068 nats per log-prob on
    // average, up to 0.7). Every prompt must agree on its first 8 tokens and over 75% of all
    // tokens; exact agreement over all 32 tokens is checked against the F32 reference below.
    let (mut agree, mut total) = (0, 0);
    for case in fixture("gemma3", "greedy.json")["cases"]
        .as_array()
        .unwrap()
    {
        let (got, want, gaps) = greedy_case_gaps(&m, case, KvDtype::F16);
        let first = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len());
        eprintln!(
            "{:?}: equal for {first} of {} tokens",
            case["prompt"],
            got.len()
        );
        assert!(
            first >= 8,
            "prompt {:?} parted at step {first} (gap {:?})",
            case["prompt"],
            gaps.get(first)
        );
        agree += first;
        total += got.len();
    }
    assert!(
        agree * 4 > total * 3,
        "only {agree} of {total} tokens agree"
    );
    let capital = &fixture("gemma3", "greedy.json")["cases"][0];
    let text = m
        .tokenizer
        .decode(&greedy_case(&m, capital, KvDtype::F16).0);
    assert!(text.starts_with(" Berlin."), "{text:?}");
}

#[test]
fn greedy_32_tokens_equal_llama_cpp_f32_in_exact_mode() {
    let Some(m) = load(MatmulPrecision::Exact) else {
        return;
    };
    for case in fixture("gemma3", "greedy_dequant_f32.json")["cases"]
        .as_array()
        .unwrap()
    {
        let (got, want) = greedy_case(&m, case, KvDtype::F32);
        assert_eq!(got, want, "prompt {:?}", case["prompt"]);
    }
}
