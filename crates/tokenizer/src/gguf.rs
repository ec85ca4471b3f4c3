//! Building a tokenizer from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
use slowfast_loader::gguf::{GgufFile, GgufValue};

use crate::error::{Result, TokenizerError};
use crate::spm::{SpmConfig, SpmVocab};

/// Read the SPM vocabulary of a GGUF file (`tokenizer.ggml.model == "llama"`).
pub fn spm_from_gguf(file: &GgufFile) -> Result<SpmVocab> {
    let model = file
        .get_str("tokenizer.ggml.model")
        .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.model".into()))?;
    if model != "llama" {
        return Err(TokenizerError::UnsupportedModel(model.to_owned()));
    }
    let tokens = string_array(file, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    // Scores and types are optional in GGUF; llama.cpp defaults them to 0 and normal.
    let scores = match file.get("tokenizer.ggml.scores") {
        None => vec![0.0; n],
        Some(_) => file
            .get_f32_array("tokenizer.ggml.scores")
            .ok_or_else(|| bad("tokenizer.ggml.scores", "is not an array of numbers"))?,
    };
    let types = match file.get("tokenizer.ggml.token_type") {
        None => vec![1; n],
        Some(_) => file
            .get_i32_array("tokenizer.ggml.token_type")
            .ok_or_else(|| bad("tokenizer.ggml.token_type", "is not an array of integers"))?,
    };
    let d = SpmConfig::default();
    let cfg = SpmConfig {
        bos_id: opt_id(file, "tokenizer.ggml.bos_token_id", d.bos_id)?,
        eos_id: opt_id(file, "tokenizer.ggml.eos_token_id", d.eos_id)?,
        unk_id: opt_id(file, "tokenizer.ggml.unknown_token_id", d.unk_id)?,
        pad_id: opt_id(file, "tokenizer.ggml.padding_token_id", d.pad_id)?,
        eot_id: opt_id(file, "tokenizer.ggml.eot_token_id", None)?,
        add_bos: opt_bool(file, "tokenizer.ggml.add_bos_token", d.add_bos)?,
        add_eos: opt_bool(file, "tokenizer.ggml.add_eos_token", d.add_eos)?,
        add_space_prefix: opt_bool(file, "tokenizer.ggml.add_space_prefix", d.add_space_prefix)?,
    };
    SpmVocab::new(tokens, scores, &types, cfg)
}

/// `tokenizer.chat_template` when the file has one.
pub fn chat_template(file: &GgufFile) -> Option<String> {
    file.get_str("tokenizer.chat_template").map(str::to_owned)
}

fn bad(key: &str, msg: &str) -> TokenizerError {
    TokenizerError::BadKey {
        key: key.to_owned(),
        msg: msg.to_owned(),
    }
}

fn string_array(file: &GgufFile, key: &str) -> Result<Vec<Vec<u8>>> {
    let v = file
        .get(key)
        .ok_or_else(|| TokenizerError::MissingKey(key.to_owned()))?;
    let arr = v
        .as_array()
        .ok_or_else(|| bad(key, "is not an array of strings"))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| match v {
            GgufValue::String(s) => Ok(s.as_bytes().to_vec()),
            _ => Err(bad(key, &format!("element {i} is not a string"))),
        })
        .collect()
}

/// An optional token id; a negative value (-1) means "none", as GGUF writers use.
fn opt_id(file: &GgufFile, key: &str, default: Option<u32>) -> Result<Option<u32>> {
    match file.get(key) {
        None => Ok(default),
        Some(v) => {
            let i = v.as_i64().ok_or_else(|| bad(key, "is not an integer"))?;
            if i < 0 {
                Ok(None)
            } else {
                u32::try_from(i)
                    .map(Some)
                    .map_err(|_| bad(key, &format!("value {i} does not fit a token id")))
            }
        }
    }
}

fn opt_bool(file: &GgufFile, key: &str, default: bool) -> Result<bool> {
    match file.get(key) {
        None => Ok(default),
        Some(_) => file
            .get_bool(key)
            .ok_or_else(|| bad(key, "is not a boolean")),
    }
}
