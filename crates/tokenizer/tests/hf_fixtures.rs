//! The HF path against HF transformers' own output for the tiny checkpoints in the repo's
//! tests/fixtures/hf/<name>/ (made by scripts/fixtures/make_hf_tiny.py): input ids, decoded
//! text, chat template rendering and chat ids.
use std::path::PathBuf;

use serde::Deserialize;
use slowfast_tokenizer::{ChatMessage, Tokenizer};

#[derive(Deserialize)]
struct Expected {
    text: String,
    input_ids: Vec<u32>,
    decoded_input: String,
    chat_messages: Vec<ChatMessage>,
    chat_add_generation_prompt: bool,
    chat_text: String,
    chat_ids: Vec<u32>,
}

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name)
}

#[test]
fn matches_transformers() {
    for name in ["qwen3", "llama", "gemma3", "qwen3-bf16"] {
        let dir = fixture_dir(name);
        let exp: Expected =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!(
            tok.encode(&exp.text, true).unwrap(),
            exp.input_ids,
            "{name}"
        );
        assert_eq!(
            tok.decode_with(&exp.input_ids, true),
            exp.decoded_input,
            "{name}"
        );
        assert_eq!(tok.decode(&exp.input_ids), exp.text, "{name}");
        let chat = tok
            .apply_chat_template(&exp.chat_messages, exp.chat_add_generation_prompt)
            .unwrap();
        assert_eq!(chat, exp.chat_text, "{name}");
        assert_eq!(tok.encode(&chat, true).unwrap(), exp.chat_ids, "{name}");
        let im_end = tok.token_id("<|im_end|>").unwrap();
        assert!(
            tok.eos_ids().contains(&im_end),
            "{name}: {:?}",
            tok.eos_ids()
        );
    }
}
