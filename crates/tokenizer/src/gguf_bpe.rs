//! GGUF byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, e.g. Qwen, Llama 3):
//! rebuilt as an HF `tokenizer.json` (vocab, merges, the pre-tokenizer regex of
//! `tokenizer.ggml.pre`, control / user-defined tokens as added tokens, BOS post-processor)
//! and run through the `tokenizers` crate.
use serde_json::{json, Value};
use slowfast_loader::gguf::GgufFile;

use crate::error::{Result, TokenizerError};
use crate::hf::HfTokenizer;
use crate::llama_names::{self, SpecialIds};

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3` split (from Llama 3's tokenizer.json).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2` split (single digits).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn bad(key: &str, msg: impl Into<String>) -> TokenizerError {
    TokenizerError::BadKey {
        key: key.to_owned(),
        msg: msg.into(),
    }
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` name, and whether merges are ignored for
/// words already in the vocabulary (Llama 3 style).
fn pre_tokenizer(pre: &str) -> Result<(Value, bool)> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex});
    let split = |re: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            byte_level(false)
        ]})
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => (byte_level(true), false),
        "llama-bpe" | "llama3" | "smaug-bpe" | "dbrx" => (split(LLAMA3_SPLIT), true),
        "qwen2" | "qwen35" | "deepseek-r1-qwen" => (split(QWEN2_SPLIT), false),
        // llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM (its STARCODER regex pair): every digit on
        // its own, then the GPT-2 split; SmolLM2's tokenizer.json says the same (Digits with
        // individual_digits, then ByteLevel with use_regex).
        "smollm" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true)
            ]}),
            false,
        ),
        other => {
            return Err(bad(
                "tokenizer.ggml.pre",
                format!("`{other}` is not a supported BPE pre-tokenizer (supported: default, gpt2, llama-bpe, qwen2, smollm)"),
            ))
        }
    })
}

/// Build the BPE tokenizer of a GGUF file; returns it with its BOS / EOS texts set.
pub fn bpe_from_gguf(file: &GgufFile) -> Result<HfTokenizer> {
    let tokens = file
        .get_str_array("tokenizer.ggml.tokens")
        .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.tokens".into()))?;
    let merges = file
        .get_str_array("tokenizer.ggml.merges")
        .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.merges".into()))?;
    let n = tokens.len();
    let mut types = match file.get("tokenizer.ggml.token_type") {
        None => vec![1; n],
        Some(_) => file
            .get_i32_array("tokenizer.ggml.token_type")
            .ok_or_else(|| bad("tokenizer.ggml.token_type", "is not an array of integers"))?,
    };
    if types.len() != n {
        return Err(TokenizerError::BadVocab(format!(
            "{} token types for {n} tokens",
            types.len()
        )));
    }
    let id_opt = |key: &str| -> Option<u32> { file.get_u32(key).filter(|&i| (i as usize) < n) };
    let bos = id_opt("tokenizer.ggml.bos_token_id");
    let eos = id_opt("tokenizer.ggml.eos_token_id");
    // llama.cpp's name-based fix-ups (end-of-turn / FIM names become control tokens).
    let (eog, _) = llama_names::apply(
        &tokens,
        &mut types,
        SpecialIds {
            eos,
            eot: id_opt("tokenizer.ggml.eot_token_id"),
            eom: id_opt("tokenizer.ggml.eom_token_id"),
        },
    );
    let pre = file.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let (pre_tok, ignore_merges) = pre_tokenizer(pre)?;
    let mut vocab = serde_json::Map::with_capacity(n);
    let mut added = Vec::new();
    for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert((*t).to_owned(), json!(i));
        // 3 = control (special), 4 = user-defined (matched literally, shown on decode).
        if ty == 3 || ty == 4 {
            added.push(
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": ty == 3}),
            );
        }
    }
    // llama.cpp adds no BOS to BPE vocabularies unless the file asks.
    let add_bos = file
        .get_bool("tokenizer.ggml.add_bos_token")
        .unwrap_or(false);
    let post = match (add_bos, bos) {
        (true, Some(b)) => {
            let t = tokens[b as usize];
            json!({"type": "TemplateProcessing",
                   "single": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                            {"Sequence": {"id": "B", "type_id": 1}}],
                   "special_tokens": {t: {"id": t, "ids": [b], "tokens": [t]}}})
        }
        (true, None) => {
            return Err(bad(
                "tokenizer.ggml.add_bos_token",
                "is true but there is no valid bos_token_id",
            ))
        }
        _ => Value::Null,
    };
    let raw = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tok,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges}
    });
    let text = |id: Option<u32>| id.map(|i| tokens[i as usize].to_owned());
    let cfg = json!({"bos_token": text(bos), "eos_token": text(eos)});
    let mut hf = HfTokenizer::from_values(&raw, &cfg).map_err(|msg| {
        TokenizerError::BadVocab(format!(
            "cannot build the BPE tokenizer from GGUF metadata: {msg}"
        ))
    })?;
    hf.extra_eos = eog;
    Ok(hf)
}
