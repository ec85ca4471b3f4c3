//! The HF path on a tiny byte-level BPE `tokenizer.json` written by the test: encoding,
//! special tokens, per-token bytes for streaming, EOS ids, chat template, and load errors.
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::json;
use slowfast_tokenizer::{ChatMessage, HfTokenizer, StreamDecoder, Tokenizer, TokenizerError};

/// GPT-2's byte -> printable char table.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut extra = 0;
    (0..=255u32)
        .map(|b| {
            if printable.contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

const MERGES: &[(&str, &str)] = &[
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
];
const SPECIALS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
];

fn tokenizer_json() -> serde_json::Value {
    let mut vocab = BTreeMap::new();
    for (i, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), i as u32);
    }
    for (a, b) in MERGES {
        let n = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), n);
    }
    let base = vocab.len() as u32;
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, (t, special))| {
            json!({"id": base + i as u32, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab,
                  "merges": MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("slowfast-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write_model(name: &str, config: Option<serde_json::Value>) -> PathBuf {
    let d = dir(name);
    std::fs::write(d.join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    if let Some(c) = config {
        std::fs::write(d.join("tokenizer_config.json"), c.to_string()).unwrap();
    }
    d
}

fn chatml_config() -> serde_json::Value {
    json!({
        "bos_token": null,
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    })
}

#[test]
fn encode_decode_and_specials() {
    let tok = Tokenizer::from_hf_dir(&write_model("basic", Some(chatml_config()))).unwrap();
    let id = |t: &str| tok.token_id(t).unwrap();
    assert_eq!(tok.vocab_size(), 256 + MERGES.len() + SPECIALS.len());
    let ids = tok.encode("hello world", true).unwrap();
    assert_eq!(&ids[..2], &[id("hello"), id("Ġw")]);
    assert_eq!(tok.decode(&ids), "hello world");

    let im_start = id("<|im_start|>");
    let ids = tok.encode("<|im_start|>hello", false).unwrap();
    assert_eq!(ids, vec![im_start, id("hello")]);
    let plain = tok.encode_with("<|im_start|>hello", false, false).unwrap();
    assert!(!plain.contains(&im_start), "{plain:?}");
    assert_eq!(tok.decode(&plain), "<|im_start|>hello");
    // Special tokens are hidden on decode unless asked for; non-special added tokens show.
    assert_eq!(
        tok.decode(&[im_start, id("hello"), id("<think>")]),
        "hello<think>"
    );
    assert_eq!(tok.decode_with(&[im_start], true), "<|im_start|>");
    assert!(tok.is_special(im_start) && !tok.is_special(id("<think>")));
    assert_eq!(tok.bos_id(), None);
    assert!(!tok.adds_bos());
    // EOS from the config, then end-of-turn names llama.cpp also stops on.
    assert_eq!(tok.eos_ids(), &[id("<|im_end|>"), id("<|endoftext|>")]);
}

#[test]
fn streaming_multibyte_text() {
    let tok = Tokenizer::from_hf_dir(&write_model("stream", None)).unwrap();
    let text = "héllo 中文 😀!";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(tok.decode(&ids), text);
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    let mut held = 0;
    for &i in &ids {
        let s = d.push(&tok, i);
        if s.is_empty() {
            held += 1;
        }
        assert!(!s.contains('\u{FFFD}'));
        out.push_str(&s);
    }
    assert_eq!(out + &d.flush(), text);
    assert!(
        held >= 5,
        "multi-byte characters should be held back ({held})"
    );
    // One byte token of a 3-byte character is not text on its own.
    let zhong = tok.encode("中", false).unwrap();
    assert_eq!(zhong.len(), 3);
    assert_eq!(tok.token_bytes(zhong[0], false), vec![0xE4]);
    let sorted_ids = |texts: &[&str]| {
        let mut v: Vec<u32> = texts.iter().map(|t| tok.token_id(t).unwrap()).collect();
        v.sort();
        v
    };
    assert_eq!(tok.sentence_ender_ids(), sorted_ids(&["!", "?", "."]));
    // Byte-level spellings of '\n' and '\r'.
    assert_eq!(tok.newline_ids(), sorted_ids(&["Ċ", "č"]));
}

#[test]
fn chat_template_and_generation_config() {
    let d = write_model("chat", Some(chatml_config()));
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [261, 263]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(&d).unwrap();
    let s = tok
        .apply_chat_template(&[ChatMessage::new("user", "hello")], true)
        .unwrap();
    assert_eq!(
        s,
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&s, true).unwrap();
    assert_eq!(ids[0], tok.token_id("<|im_start|>").unwrap());
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(tok.eos_ids(), &[im_end, 261]);

    // No template in the config: the model_type's built-in one (ChatML for qwen3).
    let d = write_model("builtin", Some(json!({"eos_token": "<|im_end|>"})));
    std::fs::write(d.join("config.json"), r#"{"model_type": "qwen3"}"#).unwrap();
    let tok = Tokenizer::from_hf_dir(&d).unwrap();
    let s = tok
        .apply_chat_template(&[ChatMessage::new("user", "hi")], false)
        .unwrap();
    assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n");
    // Neither: a clear error.
    let tok = Tokenizer::from_hf_dir(&write_model("none", None)).unwrap();
    let e = tok.apply_chat_template(&[], true).unwrap_err();
    assert!(matches!(e, TokenizerError::NoChatTemplate(_)), "{e}");
}

#[test]
fn missing_and_corrupt_files() {
    let d = dir("missing");
    let e = Tokenizer::from_hf_dir(&d).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::write(d.join("tokenizer.json"), "{ not json").unwrap();
    let e = Tokenizer::from_hf_dir(&d).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json") && e.contains("JSON"), "{e}");
    std::fs::write(d.join("tokenizer.json"), r#"{"model": {"type": "Nope"}}"#).unwrap();
    let e = Tokenizer::from_hf_dir(&d).unwrap_err();
    assert!(matches!(e, TokenizerError::BadFile { .. }), "{e}");
    let d = write_model("badcfg", None);
    std::fs::write(d.join("tokenizer_config.json"), "[1,").unwrap();
    let e = Tokenizer::from_hf_dir(&d).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json"), "{e}");
}

#[test]
fn byte_level_stand_in() {
    let tok = Tokenizer::byte_level(512).unwrap();
    let ids = tok.encode("hé", true).unwrap();
    assert_eq!(ids, vec![256, b'h' as u32, 0xC3, 0xA9]);
    assert_eq!(tok.decode(&ids), "hé");
    assert_eq!(tok.eos_ids(), &[257]);
    assert_eq!(tok.bos_id(), Some(256));
    assert_eq!(
        tok.sentence_ender_ids(),
        vec![b'!' as u32, b'.' as u32, b'?' as u32]
    );
    assert_eq!(tok.newline_ids(), vec![b'\n' as u32, b'\r' as u32]);
    let s = tok
        .apply_chat_template(&[ChatMessage::new("user", "x")], true)
        .unwrap();
    assert_eq!(s, "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
    assert!(Tokenizer::byte_level(100).is_err());
}

/// A SentencePiece-style BPE (Llama 2 layout): `▁` for spaces, a prepended `▁`, byte fallback,
/// and a decoder that strips the leading space again.
fn metaspace_json() -> serde_json::Value {
    let mut vocab = BTreeMap::new();
    for t in ["<unk>", "<s>", "</s>"] {
        let n = vocab.len() as u32;
        vocab.insert(t.to_string(), n);
    }
    for b in 0..=255u32 {
        let n = vocab.len() as u32;
        vocab.insert(format!("<0x{b:02X}>"), n);
    }
    let merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a")];
    for p in ["▁", "t", "h", "e", "a", "c"] {
        let n = vocab.len() as u32;
        vocab.insert(p.to_string(), n);
    }
    for (a, b) in merges {
        let n = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), n);
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
}

#[test]
fn metaspace_byte_fallback_matches_library_decode() {
    let cfg = json!({"bos_token": "<s>", "eos_token": "</s>"});
    let hf = HfTokenizer::from_values(&metaspace_json(), &cfg).unwrap();
    let reference = HfTokenizer::from_values(&metaspace_json(), &cfg).unwrap();
    let tok = Tokenizer::from_hf(hf).unwrap();
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.adds_bos());
    for text in ["the cat", "a  théâtre 中 😀", " the", "the\nend"] {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids[0], 1);
        let want = reference.library_decode(&ids, true).unwrap();
        assert_eq!(tok.decode(&ids), want, "{text:?} {ids:?}");
        assert_eq!(want, *text);
        // Streaming prints the prefix space the normalizer added; decode strips it.
        let mut d = StreamDecoder::new();
        let streamed: String =
            ids.iter().map(|&i| d.push(&tok, i)).collect::<String>() + &d.flush();
        assert_eq!(streamed, format!(" {text}"));
    }
    let ids = tok.encode("the", false).unwrap();
    assert_eq!(ids, vec![tok.token_id("▁the").unwrap()]);
}
