//! The SPM tokenizer on the real Gemma 3 270M vocabulary against ids made by llama.cpp
//! (tests/fixtures/gemma3_llamacpp_ids.json, from tests/fixtures/make_ids.py).
use std::path::Path;

use serde::Deserialize;
use slowfast_tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

#[derive(Deserialize)]
struct Case {
    text: String,
    add_special: bool,
    parse_special: bool,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

fn load() -> Option<Tokenizer> {
    let path = slowfast_loader::test_model_path()?;
    Some(Tokenizer::from_gguf_path(&path).expect("the default model's tokenizer loads"))
}

fn read_fixture(name: &str) -> Fixture {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn fixture() -> Fixture {
    read_fixture("gemma3_llamacpp_ids.json")
}

#[test]
fn ids_match_llama_cpp() {
    let Some(tok) = load() else { return };
    let fx = fixture();
    assert!(fx.cases.len() > 40);
    let random = read_fixture("gemma3_llamacpp_random.json");
    assert_eq!(random.cases.len(), 300);
    let mut bad = Vec::new();
    for c in fx.cases.iter().chain(&random.cases) {
        let got = tok
            .encode_with(&c.text, c.add_special, c.parse_special)
            .unwrap();
        if got != c.ids {
            bad.push(format!(
                "{:?} (add_special={}, parse_special={}):\n  want {:?}\n  got  {:?}",
                c.text, c.add_special, c.parse_special, c.ids, got
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn decode_round_trips() {
    let Some(tok) = load() else { return };
    for c in fixture().cases {
        let ids = tok
            .encode_with(&c.text, c.add_special, c.parse_special)
            .unwrap();
        if c.parse_special {
            // Control tokens print only when asked; BOS shows as its text.
            let want = if c.add_special {
                format!("<bos>{}", c.text)
            } else {
                c.text.clone()
            };
            assert_eq!(tok.decode_with(&ids, true), want);
        } else {
            assert_eq!(tok.decode(&ids), c.text, "ids {ids:?}");
        }
    }
    assert_eq!(tok.decode(&[2, 105, 2364]), "user");
}

#[test]
fn stream_decoder_matches_decode() {
    let Some(tok) = load() else { return };
    let text = "Emoji: 😀👍🏽 🇫🇷 — 日本語 \u{1d11e} \u{20000} é";
    let ids = tok.encode(text, true).unwrap();
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(&tok, id);
        assert!(
            !piece.contains('\u{FFFD}'),
            "partial character emitted for {id}"
        );
        out.push_str(&piece);
    }
    out.push_str(&dec.flush());
    assert_eq!(out, text);
    // U+20000 has no token: four byte-fallback tokens, held until the character is whole.
    let ids = tok.encode_with("\u{20000}", false, false).unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
    let mut dec = StreamDecoder::new();
    for &id in &ids[..3] {
        assert_eq!(dec.push(&tok, id), "");
    }
    assert_eq!(dec.push(&tok, ids[3]), "\u{20000}");
}

#[test]
fn special_ids_and_token_classes() {
    let Some(tok) = load() else { return };
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_id(), Some(2));
    let eot = tok.token_id("<end_of_turn>").unwrap();
    let eos = tok.token_id("<eos>").unwrap();
    // llama.cpp's end-of-generation set: <eos>, <end_of_turn>, and `</s>` (a user-defined
    // token that llama.cpp's name list turns into a control token).
    let close_s = tok.token_id("</s>").unwrap();
    assert_eq!(tok.eos_ids(), &[eos, eot, close_s]);
    assert!(tok.is_special(close_s));
    assert_eq!(tok.decode(&[close_s]), "");
    assert!(tok.is_special(eot));
    let enders = tok.sentence_ender_ids();
    let newlines = tok.newline_ids();
    let id = |t: &str| {
        tok.token_id(t)
            .unwrap_or_else(|| panic!("{t:?} not in vocab"))
    };
    for t in [".", "?", "!", "▁.", "。", ".\"", "?\""] {
        assert!(enders.contains(&id(t)), "{t:?}");
    }
    for t in ["Mr", "▁Mr", "\n", ",", "<eos>"] {
        assert!(!enders.contains(&id(t)), "{t:?}");
    }
    for t in ["\n", "\n\n", "\n\n\n\n"] {
        assert!(newlines.contains(&id(t)), "{t:?}");
    }
    assert!(!newlines.contains(&id(".")));
    // Every class member really decodes to such text.
    for &i in &enders {
        let s = tok.decode(&[i]);
        let closers = [
            '"', '\'', '\u{201d}', '\u{2019}', ')', '\u{300d}', '\u{300f}',
        ];
        assert!(
            s.trim_end_matches('\n')
                .trim_end_matches(closers)
                .ends_with(['.', '?', '!', '。', '？', '！']),
            "{s:?}"
        );
    }
    for &i in &newlines {
        assert!(tok.decode(&[i]).chars().all(|c| c == '\n' || c == '\r'));
    }
    assert!(enders.len() > 100, "{} enders", enders.len());
    let strict = tok.punctuation_ender_ids();
    assert!(strict.contains(&id(".")) && strict.contains(&id("。")));
    assert!(!strict.contains(&id("▁.")));
    // . ? ! 。 ？ ！ and the byte tokens <0x2E> <0x3F> <0x21> (newlines never merge in Gemma).
    assert_eq!(strict.len(), 9, "{strict:?}");
    for &i in &strict {
        assert!([".", "?", "!", "。", "？", "！"].contains(&tok.decode(&[i]).as_str()));
    }
    assert!(strict.iter().all(|i| enders.contains(i)));
}

#[test]
fn gemma_chat_template() {
    let Some(tok) = load() else { return };
    let msgs = [
        ChatMessage::new("system", "Answer briefly."),
        ChatMessage::new("user", "What is 2+2?"),
    ];
    let s = tok.apply_chat_template(&msgs, true).unwrap();
    // BOS comes from encode(add_special), not from the rendered text.
    assert_eq!(
        s,
        "<start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = tok.encode(&s, true).unwrap();
    assert_eq!(&ids[..3], &[2, 105, 2364]);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    assert_eq!(ids.last(), Some(&107));
}
