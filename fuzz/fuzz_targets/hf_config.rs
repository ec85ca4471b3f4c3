//! HF model-directory JSON: `config.json` (model config), `tokenizer.json` and
//! `tokenizer_config.json`. The first byte picks which file the rest is.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use slowfast_tokenizer::{HfTokenizer, Tokenizer};

fn fixture_tokenizer_json() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| {
        std::fs::read(slowfast_fuzz::repo().join("tests/fixtures/hf/qwen3/tokenizer.json"))
            .expect("fixture tokenizer.json")
    })
}

fn use_tokenizer(hf: HfTokenizer) {
    if let Ok(t) = Tokenizer::from_hf(hf) {
        if let Ok(ids) = t.encode("Hi <|im_start|> there", true) {
            let _ = t.decode(&ids);
        }
        let m = [slowfast_tokenizer::ChatMessage::new("user", "hi")];
        let _ = t.apply_chat_template(&m, true);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    match sel % 3 {
        0 => {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) {
                if let Ok(c) = slowfast_model::config::from_hf_json(&v) {
                    if c.validate().is_ok() {
                        let _ = c.num_parameters();
                        let _ = c.kv_values_per_token();
                    }
                }
            }
        }
        1 => {
            if let Ok(hf) = HfTokenizer::from_json_bytes(rest, None) {
                use_tokenizer(hf);
            }
        }
        _ => {
            if let Ok(hf) = HfTokenizer::from_json_bytes(fixture_tokenizer_json(), Some(rest)) {
                use_tokenizer(hf);
            }
        }
    }
});
