//! GGUF byte-level BPE (`tokenizer.ggml.model == "gpt2"`): a GGUF written from the repo's tiny
//! HF tokenizers (tests/fixtures/hf/<name>/tokenizer.json) must tokenize exactly like the HF
//! tokenizer it came from; the Qwen2 / Llama 3 / SmolLM split regexes load and round-trip.
use std::path::{Path, PathBuf};

use serde_json::Value;
use slowfast_tokenizer::{ChatMessage, Tokenizer};

mod common;
use common::{gguf, V};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name)
}

/// GGUF metadata for the HF tokenizer in `dir`, as llama.cpp's converter would write it.
fn gguf_from_hf(dir: &Path, pre: &'static str, arch: &'static str, add_bos: bool) -> Vec<u8> {
    let t: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = t["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    let mut types = vec![1i32; vocab.len()];
    for (k, v) in vocab {
        tokens[v.as_u64().unwrap() as usize] = k.clone();
    }
    for a in t["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap() as usize;
        if id >= tokens.len() {
            tokens.resize(id + 1, String::new());
            types.resize(id + 1, 1);
        }
        tokens[id] = a["content"].as_str().unwrap().to_owned();
        types[id] = if a["special"].as_bool().unwrap() {
            3
        } else {
            4
        };
    }
    let merges: Vec<String> = t["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            _ => panic!("bad merge {m}"),
        })
        .collect();
    let id = |name: &str| tokens.iter().position(|t| t == name).unwrap() as u32;
    let (bos, eos) = (id("<bos>"), id("<|im_end|>"));
    gguf(&[
        ("general.architecture", V::Str(arch)),
        ("tokenizer.ggml.model", V::Str("gpt2")),
        ("tokenizer.ggml.pre", V::Str(pre)),
        ("tokenizer.ggml.tokens", V::Strs(tokens)),
        ("tokenizer.ggml.token_type", V::I32s(types)),
        ("tokenizer.ggml.merges", V::Strs(merges)),
        ("tokenizer.ggml.bos_token_id", V::U32(bos)),
        ("tokenizer.ggml.eos_token_id", V::U32(eos)),
        ("tokenizer.ggml.add_bos_token", V::Bool(add_bos)),
    ])
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("slowfast-bpe-{}-{name}.gguf", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

const TEXTS: &[&str] = &[
    "The miller kept the wheel turning for forty years, and his father before him; café talk.",
    "  leading spaces\tand tabs\n\nnewlines 12345 67 — ünïcödé 中文 😀",
    "<|im_start|>user\nhello<|im_end|>\n",
    "don't I'LL we've 3.14159",
    "",
];

#[test]
fn gguf_bpe_matches_the_hf_tokenizer() {
    for (name, add_bos) in [("qwen3", false), ("llama", true)] {
        let dir = fixture(name);
        let hf = Tokenizer::from_hf_dir(&dir).unwrap();
        let path = write(name, &gguf_from_hf(&dir, "gpt2", "qwen3", add_bos));
        let gg = Tokenizer::from_gguf_path(&path).unwrap();
        assert_eq!(gg.vocab_size(), hf.vocab_size(), "{name}");
        for text in TEXTS {
            for parse_special in [true, false] {
                let want = hf.encode_with(text, true, parse_special).unwrap();
                let got = gg.encode_with(text, true, parse_special).unwrap();
                assert_eq!(got, want, "{name} {text:?} parse_special={parse_special}");
                assert_eq!(gg.decode(&got), hf.decode(&want), "{name} {text:?}");
            }
        }
        let im_end = gg.token_id("<|im_end|>").unwrap();
        assert!(gg.eos_ids().contains(&im_end), "{name}");
        assert_eq!(gg.bos_id(), gg.token_id("<bos>"));
        // No template in the file: the built-in ChatML for the qwen3 architecture.
        let s = gg
            .apply_chat_template(&[ChatMessage::new("user", "hi")], true)
            .unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }
}

#[test]
fn split_regexes_load_and_round_trip() {
    let dir = fixture("qwen3");
    for pre in ["qwen2", "llama-bpe", "smollm", "default"] {
        let gg = Tokenizer::from_gguf_path(&write(pre, &gguf_from_hf(&dir, pre, "qwen3", false)))
            .unwrap();
        for text in TEXTS {
            let ids = gg.encode_with(text, false, false).unwrap();
            assert_eq!(gg.decode(&ids), *text, "{pre}");
        }
        // Qwen2 and SmolLM split digits one by one; Llama 3 in groups of up to three.
        let digits = gg.encode("12345", false).unwrap();
        let n = digits.len();
        match pre {
            "qwen2" | "smollm" => assert_eq!(n, 5, "{digits:?}"),
            "llama-bpe" => assert!(n >= 2, "{digits:?}"),
            _ => {}
        }
    }
    let e = Tokenizer::from_gguf_path(&write(
        "bad",
        &gguf_from_hf(&dir, "made-up", "qwen3", false),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("made-up") && e.contains("tokenizer.ggml.pre"),
        "{e}"
    );
}
