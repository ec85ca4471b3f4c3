//! GGUF tokenizer loading on small hand-written GGUF files: a working vocabulary end to end,
//! and clear errors for missing, corrupt or unsupported tokenizer metadata.
use std::path::PathBuf;

use slowfast_tokenizer::{Tokenizer, TokenizerError};

mod common;
use common::{gguf, V};

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("slowfast-tok-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// `<unk> <s> </s> <start_of_turn>`, 256 byte tokens, then a few pieces.
fn vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut t = vec![
        "<unk>".to_string(),
        "<s>".into(),
        "</s>".into(),
        "<start_of_turn>".into(),
    ];
    let mut ty = vec![2, 3, 3, 3];
    for b in 0..=255u8 {
        t.push(format!("<0x{b:02X}>"));
        ty.push(6);
    }
    for p in ["▁", "a", "b", "c", "ab", "▁ab", "bc", "▁abc"] {
        t.push(p.into());
        ty.push(1);
    }
    let n = t.len();
    let scores = (0..n).map(|i| -(i as f32)).collect();
    (t, scores, ty)
}

fn base_kvs() -> Vec<(&'static str, V)> {
    let (t, s, ty) = vocab();
    vec![
        ("general.architecture", V::Str("llama")),
        ("tokenizer.ggml.model", V::Str("llama")),
        ("tokenizer.ggml.tokens", V::Strs(t)),
        ("tokenizer.ggml.scores", V::F32s(s)),
        ("tokenizer.ggml.token_type", V::I32s(ty)),
        ("tokenizer.ggml.bos_token_id", V::U32(1)),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ("tokenizer.ggml.unknown_token_id", V::U32(0)),
        ("tokenizer.ggml.padding_token_id", V::I32(-1)),
        ("tokenizer.ggml.add_bos_token", V::Bool(true)),
        ("tokenizer.ggml.add_space_prefix", V::Bool(true)),
    ]
}

#[test]
fn small_vocab_end_to_end() {
    let p = write("ok.gguf", &gguf(&base_kvs()));
    let tok = Tokenizer::from_gguf_path(&p).unwrap();
    let id = |s: &str| tok.token_id(s).unwrap();
    // Space prefix, then "▁abc" (score -267) loses to nothing: ▁+a+b+c merges via "ab", "▁ab".
    let ids = tok.encode("abc d", true).unwrap();
    let d = id("<0x64>");
    assert_eq!(ids, vec![1, id("▁abc"), id("▁"), d]);
    assert_eq!(tok.decode(&ids), "abc d");
    // Special text is parsed by `encode`, plain with parse_special = false.
    let ids = tok.encode("<start_of_turn>ab", false).unwrap();
    assert_eq!(ids, vec![3, id("▁ab")]);
    let ids = tok.encode_with("<start_of_turn>", false, false).unwrap();
    assert!(ids.len() > 5 && !ids.contains(&3));
    assert_eq!(tok.eos_ids(), &[2]);
    // llama architecture: the Llama 3 header template is the built-in fallback.
    let s = tok
        .apply_chat_template(&[slowfast_tokenizer::ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert!(s.starts_with("<|start_header_id|>user"), "{s}");
}

#[test]
fn missing_file_names_the_path() {
    let p = std::env::temp_dir().join("slowfast-no-such-file.gguf");
    let e = Tokenizer::from_gguf_path(&p).unwrap_err().to_string();
    assert!(e.contains("slowfast-no-such-file.gguf"), "{e}");
}

#[test]
fn corrupt_file_is_an_error() {
    let p = write("corrupt.gguf", b"GGUF\x03\x00\x00\x00garbage");
    let e = Tokenizer::from_gguf_path(&p).unwrap_err();
    assert!(matches!(e, TokenizerError::BadFile { .. }), "{e}");
    let p = write("notgguf.gguf", b"hello world, not a gguf");
    assert!(Tokenizer::from_gguf_path(&p).is_err());
}

#[test]
fn missing_or_bad_metadata() {
    let p = write(
        "nokeys.gguf",
        &gguf(&[("general.architecture", V::Str("gemma3"))]),
    );
    let e = Tokenizer::from_gguf_path(&p).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.model"), "{e}");

    let mut kvs = base_kvs();
    kvs[1] = ("tokenizer.ggml.model", V::Str("bert"));
    let e = Tokenizer::from_gguf_path(&write("bert.gguf", &gguf(&kvs))).unwrap_err();
    assert!(e.to_string().contains("`bert`"), "{e}");

    // A BPE vocabulary needs its merges.
    let mut kvs = base_kvs();
    kvs[1] = ("tokenizer.ggml.model", V::Str("gpt2"));
    let e = Tokenizer::from_gguf_path(&write("gpt2.gguf", &gguf(&kvs))).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.merges"), "{e}");

    let mut kvs = base_kvs();
    kvs[3] = ("tokenizer.ggml.scores", V::F32s(vec![0.0; 3]));
    let e = Tokenizer::from_gguf_path(&write("scores.gguf", &gguf(&kvs))).unwrap_err();
    assert!(e.to_string().contains("3 scores"), "{e}");

    let mut kvs = base_kvs();
    kvs[2] = ("tokenizer.ggml.tokens", V::Str("not an array"));
    let e = Tokenizer::from_gguf_path(&write("tokens.gguf", &gguf(&kvs))).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");

    let mut kvs = base_kvs();
    kvs[5] = ("tokenizer.ggml.bos_token_id", V::U32(99_999));
    let e = Tokenizer::from_gguf_path(&write("bos.gguf", &gguf(&kvs))).unwrap_err();
    assert!(e.to_string().contains("bos_token_id 99999"), "{e}");

    // No chat template and an architecture without a built-in one.
    let mut kvs = base_kvs();
    kvs[0] = ("general.architecture", V::Str("mamba"));
    let tok = Tokenizer::from_gguf_path(&write("mamba.gguf", &gguf(&kvs))).unwrap();
    let e = tok.apply_chat_template(&[], true).unwrap_err().to_string();
    assert!(e.contains("mamba"), "{e}");
}
