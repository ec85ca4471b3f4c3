//! Chat templates: the built-in and fixture templates over arbitrary message lists
//! (arbitrary roles and contents), and arbitrary template sources.
#![no_main]
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use slowfast_tokenizer::chat::{CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE};
use slowfast_tokenizer::{ChatMessage, ChatTemplate};

#[derive(Debug, Arbitrary)]
struct Input {
    template: u8,
    source: Option<String>,
    bos: String,
    messages: Vec<(u8, String, String)>,
    add_generation_prompt: bool,
    via_tokenizer: bool,
}

fn templates() -> &'static [ChatTemplate] {
    static T: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        let mut srcs: Vec<String> = vec![
            GEMMA_TEMPLATE.into(),
            CHATML_TEMPLATE.into(),
            LLAMA3_TEMPLATE.into(),
        ];
        for m in ["gemma3", "llama", "qwen3"] {
            let p =
                slowfast_fuzz::repo().join(format!("tests/fixtures/hf/{m}/tokenizer_config.json"));
            if let Ok(b) = std::fs::read(p) {
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b) {
                    if let Some(s) = v.get("chat_template").and_then(|s| s.as_str()) {
                        srcs.push(s.to_owned());
                    }
                }
            }
        }
        srcs.iter()
            .filter_map(|s| ChatTemplate::new(s, "<bos>", "<eos>").ok())
            .collect()
    })
}

const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "model"];

fuzz_target!(|inp: Input| {
    let msgs: Vec<ChatMessage> = inp
        .messages
        .iter()
        .take(64)
        .map(|(r, role, content)| {
            let role = if *r < 200 {
                ROLES[*r as usize % ROLES.len()].to_owned()
            } else {
                role.clone()
            };
            ChatMessage::new(role, content.clone())
        })
        .collect();
    if inp.via_tokenizer {
        let tok = if inp.template & 1 == 0 {
            slowfast_fuzz::spm()
        } else {
            slowfast_fuzz::hf_bpe()
        };
        if let Ok(s) = tok.apply_chat_template(&msgs, inp.add_generation_prompt) {
            let _ = tok.encode(&s, true);
        }
        return;
    }
    match &inp.source {
        Some(src) if inp.template >= 128 => {
            if let Ok(t) = ChatTemplate::new(src, &inp.bos, "<eos>") {
                let _ = t.render(&msgs, inp.add_generation_prompt);
            }
        }
        _ => {
            let ts = templates();
            let t = &ts[inp.template as usize % ts.len()];
            let _ = t.render(&msgs, inp.add_generation_prompt);
        }
    }
});
