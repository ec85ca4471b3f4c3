//! HF `tokenizer.json` (via the `tokenizers` crate) plus `tokenizer_config.json` (special
//! tokens, chat template) and the per-token byte table used for streaming.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;

use crate::error::{Result, TokenizerError};

/// What the HF side of a model directory gives us.
pub struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    /// The same tokenizer with special-token matching off (for `parse_special = false`).
    literal: OnceLock<tokenizers::Tokenizer>,
    pieces: Vec<Vec<u8>>, // [vocab_size] decoded bytes per id
    special: Vec<bool>,   // [vocab_size] added special tokens (hidden on decode)
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) chat_template: Option<String>,
    pub(crate) extra_eos: Vec<u32>,
    pub(crate) model_type: Option<String>,
    /// The decoder strips one leading space (`Strip` decoder, SentencePiece-style prefix).
    pub(crate) strip_leading_space: bool,
}

/// How the tokenizer's decoder turns vocabulary strings into bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceStyle {
    /// GPT-2 byte-to-unicode alphabet.
    ByteLevel,
    /// SentencePiece style: U+2581 for spaces, `<0xXX>` byte fallback.
    Metaspace { byte_fallback: bool },
    /// Strings as they are.
    Plain,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| TokenizerError::BadFile {
        path: path.to_owned(),
        msg: format!("invalid JSON: {e}"),
    })
}

/// `"<s>"` or `{"content": "<s>", ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// A chat template given as a string or as a list of `{name, template}`.
fn template_of(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let pick = list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())?;
            pick.get("template")?.as_str().map(str::to_owned)
        }
        _ => None,
    }
}

fn piece_style(decoder: Option<&Value>) -> PieceStyle {
    let Some(d) = decoder else {
        return PieceStyle::Plain;
    };
    let text = d.to_string();
    if text.contains("\"ByteLevel\"") {
        PieceStyle::ByteLevel
    } else if text.contains("\"Metaspace\"") || text.contains('\u{2581}') {
        PieceStyle::Metaspace {
            byte_fallback: text.contains("\"ByteFallback\""),
        }
    } else {
        PieceStyle::Plain
    }
}

/// A `Strip` decoder that removes one leading space (Llama 2 / Mistral tokenizers).
fn strips_leading_space(decoder: Option<&Value>) -> bool {
    fn walk(v: &Value) -> bool {
        match v {
            Value::Object(o) => {
                let is_strip = o.get("type").and_then(Value::as_str) == Some("Strip")
                    && o.get("content").and_then(Value::as_str) == Some(" ")
                    && o.get("start").and_then(Value::as_u64).unwrap_or(0) > 0;
                is_strip || o.values().any(walk)
            }
            Value::Array(a) => a.iter().any(walk),
            _ => false,
        }
    }
    decoder.is_some_and(walk)
}

/// GPT-2's byte -> printable char table, inverted.
fn byte_level_inverse() -> std::collections::HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = std::collections::HashMap::new();
    let mut extra = 0u32;
    for b in 0..=255u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        map.insert(char::from_u32(c).unwrap_or('\u{FFFD}'), b as u8);
    }
    map
}

fn decode_piece(s: &str, style: PieceStyle, inv: &std::collections::HashMap<char, u8>) -> Vec<u8> {
    match style {
        PieceStyle::Plain => s.as_bytes().to_vec(),
        PieceStyle::ByteLevel => s
            .chars()
            .flat_map(|c| match inv.get(&c) {
                Some(&b) => vec![b],
                None => c.to_string().into_bytes(),
            })
            .collect(),
        PieceStyle::Metaspace { byte_fallback } => {
            if byte_fallback {
                if let Some(hex) = s.strip_prefix("<0x").and_then(|r| r.strip_suffix('>')) {
                    if let Ok(b) = u8::from_str_radix(hex, 16) {
                        return vec![b];
                    }
                }
            }
            s.replace('\u{2581}', " ").into_bytes()
        }
    }
}

impl HfTokenizer {
    /// Load `dir/tokenizer.json` and, when present, `tokenizer_config.json`,
    /// `generation_config.json` (extra EOS ids) and `config.json` (`model_type`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let opt = |name: &str| -> Option<PathBuf> {
            let p = dir.join(name);
            p.is_file().then_some(p)
        };
        let mut t = Self::from_files(
            &dir.join("tokenizer.json"),
            opt("tokenizer_config.json").as_deref(),
        )?;
        if let Some(p) = opt("generation_config.json") {
            let v = read_json(&p)?;
            let ids: Vec<u32> = match v.get("eos_token_id") {
                Some(Value::Number(n)) => n.as_u64().into_iter().map(|x| x as u32).collect(),
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect(),
                _ => Vec::new(),
            };
            t.extra_eos.extend(ids);
        }
        if let Some(p) = opt("config.json") {
            let v = read_json(&p)?;
            t.model_type = v
                .get("model_type")
                .and_then(Value::as_str)
                .map(str::to_owned);
        }
        Ok(t)
    }

    /// Load a `tokenizer.json` and an optional `tokenizer_config.json`.
    pub fn from_files(tokenizer_json: &Path, config: Option<&Path>) -> Result<Self> {
        let raw = read_json(tokenizer_json)?;
        let cfg = match config {
            Some(p) => read_json(p)?,
            None => Value::Null,
        };
        Self::from_values(&raw, &cfg).map_err(|msg| TokenizerError::BadFile {
            path: tokenizer_json.to_owned(),
            msg,
        })
    }

    /// Build from the bytes of a `tokenizer.json` and an optional `tokenizer_config.json`.
    pub fn from_json_bytes(
        tokenizer_json: &[u8],
        config: Option<&[u8]>,
    ) -> std::result::Result<Self, String> {
        let raw: Value =
            serde_json::from_slice(tokenizer_json).map_err(|e| format!("invalid JSON: {e}"))?;
        let cfg = match config {
            Some(b) => serde_json::from_slice(b).map_err(|e| format!("invalid JSON: {e}"))?,
            None => Value::Null,
        };
        Self::from_values(&raw, &cfg)
    }

    /// Build from an in-memory `tokenizer.json` value and `tokenizer_config.json` value
    /// (`Value::Null` when there is none). Errors are the `tokenizers` crate's message.
    pub fn from_values(raw: &Value, cfg: &Value) -> std::result::Result<Self, String> {
        let tok: tokenizers::Tokenizer = raw.to_string().parse().map_err(|e| format!("{e}"))?;
        if let Some(pp) = tok.get_post_processor() {
            // Checked as the crate parsed it: its post-processors are untagged, so a JSON
            // without `"type"` (or with a misspelt one) still parses as a TemplateProcessing,
            // and the templates look tokens up by the `special_tokens` map's keys.
            let parsed = serde_json::to_value(pp).map_err(|e| format!("post_processor: {e}"))?;
            check_template_processing(&parsed)?;
        }
        let style = piece_style(raw.get("decoder"));
        let inv = byte_level_inverse();
        let n = tok.get_vocab_size(true);
        let added = tok.get_added_tokens_decoder();
        let mut pieces = Vec::with_capacity(n);
        let mut special = vec![false; n];
        for id in 0..n as u32 {
            if let Some(a) = added.get(&id) {
                special[id as usize] = a.special;
                pieces.push(a.content.as_bytes().to_vec());
            } else if let Some(s) = tok.id_to_token(id) {
                pieces.push(decode_piece(&s, style, &inv));
            } else {
                pieces.push(Vec::new());
            }
        }
        Ok(HfTokenizer {
            tok,
            literal: OnceLock::new(),
            pieces,
            special,
            bos_token: token_string(cfg.get("bos_token")),
            eos_token: token_string(cfg.get("eos_token")),
            chat_template: template_of(cfg.get("chat_template")),
            extra_eos: Vec::new(),
            model_type: None,
            strip_leading_space: strips_leading_space(raw.get("decoder")),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The `tokenizers` crate's own decode (its full decoder pipeline), as a reference for
    /// the per-token byte table.
    pub fn library_decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tok
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Other(format!("decode failed: {e}")))
    }

    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.tok.token_to_id(text)
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.tok.id_to_token(id)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    pub fn token_bytes(&self, id: u32, special: bool) -> &[u8] {
        match self.pieces.get(id as usize) {
            Some(_) if self.special[id as usize] && !special => &[],
            Some(p) => p,
            None => &[],
        }
    }

    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.tok
        } else {
            self.literal.get_or_init(|| {
                let mut t = self.tok.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = tok
            .encode(text, add_special)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}

/// A `TemplateProcessing` post-processor (alone or inside a `Sequence`) whose `single` or
/// `pair` template names a special token missing from its `special_tokens` map makes the
/// `tokenizers` crate panic at encode time (found by the `hf_config` fuzz target): refuse it
/// at load, naming the token. `pp` is the post-processor as the crate serializes what it
/// parsed (tagged with `"type"`, `special_tokens` keyed as the lookups key them).
fn check_template_processing(pp: &Value) -> std::result::Result<(), String> {
    match pp.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            for p in pp
                .get("processors")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                check_template_processing(p)?;
            }
        }
        Some("TemplateProcessing") => {
            let known = pp.get("special_tokens").and_then(Value::as_object);
            for key in ["single", "pair"] {
                for piece in pp.get(key).and_then(Value::as_array).into_iter().flatten() {
                    let Some(id) = piece.get("SpecialToken").and_then(|t| t.get("id")) else {
                        continue;
                    };
                    let id = id.as_str().unwrap_or_default();
                    if !known.is_some_and(|k| k.contains_key(id)) {
                        return Err(format!(
                            "post_processor: the `{key}` template uses the special token {id:?}, \
                             which its `special_tokens` does not define"
                        ));
                    }
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_with_an_undefined_special_token_is_refused() {
        // Found by the hf_config fuzz target: the tokenizers crate panicked in encode.
        let raw: Value = serde_json::from_str(
            r#"{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "<s>": 1},
                "unk_token": "a"},
                "post_processor": {"type": "TemplateProcessing",
                  "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}}],
                  "pair": [], "special_tokens": {}}}"#,
        )
        .unwrap();
        let e = HfTokenizer::from_values(&raw, &Value::Null).err().unwrap();
        assert!(e.contains("\"<s>\"") && e.contains("special_tokens"), "{e}");
        let mut ok = raw.clone();
        ok["post_processor"]["special_tokens"] =
            serde_json::json!({"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}});
        let t = HfTokenizer::from_values(&ok, &Value::Null).unwrap();
        assert_eq!(t.encode("a", true, true).unwrap(), vec![1, 0]);
    }

    #[test]
    fn an_untagged_template_keyed_by_another_name_is_refused() {
        // Found by the hf_config fuzz campaign: without `"type"` the crate still parses a
        // TemplateProcessing (its post-processors are untagged), and it looks `<s>` up by the
        // map's key, here `<s>x`, so the first check (on `"type"` and the raw JSON) missed it.
        let raw: Value = serde_json::from_str(
            r#"{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "<s>": 1},
                "unk_token": "a"},
                "post_processor": {"typo": "TemplateProcessing",
                  "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}}],
                  "pair": [],
                  "special_tokens": {"<s>x": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}}"#,
        )
        .unwrap();
        let e = HfTokenizer::from_values(&raw, &Value::Null).err().unwrap();
        assert!(e.contains("\"<s>\"") && e.contains("special_tokens"), "{e}");
        // keyed by its own name it loads and encodes
        let mut ok = raw.clone();
        ok["post_processor"]["special_tokens"] =
            serde_json::json!({"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}});
        let t = HfTokenizer::from_values(&ok, &Value::Null).unwrap();
        assert_eq!(t.encode("a", true, true).unwrap(), vec![1, 0]);
    }

    #[test]
    fn a_sequence_of_processors_is_checked_inside() {
        let raw: Value = serde_json::from_str(
            r#"{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "<s>": 1},
                "unk_token": "a"},
                "post_processor": {"type": "Sequence", "processors": [
                  {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                   "use_regex": false},
                  {"type": "TemplateProcessing",
                   "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                              {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [], "special_tokens": {}}]}}"#,
        )
        .unwrap();
        let e = HfTokenizer::from_values(&raw, &Value::Null).err().unwrap();
        assert!(e.contains("\"<s>\""), "{e}");
    }

    #[test]
    fn piece_styles() {
        let inv = byte_level_inverse();
        assert_eq!(inv.len(), 256);
        let sp = PieceStyle::Metaspace {
            byte_fallback: true,
        };
        assert_eq!(decode_piece("▁the", sp, &inv), b" the");
        assert_eq!(decode_piece("<0x0A>", sp, &inv), b"\n");
        let no_fb = PieceStyle::Metaspace {
            byte_fallback: false,
        };
        assert_eq!(decode_piece("<0x0A>", no_fb, &inv), b"<0x0A>");
        assert_eq!(decode_piece("Ġthe", PieceStyle::ByteLevel, &inv), b" the");
        assert_eq!(
            decode_piece("ä¸", PieceStyle::ByteLevel, &inv),
            &[0xE4, 0xB8]
        );
        assert_eq!(decode_piece("x▁", PieceStyle::Plain, &inv), "x▁".as_bytes());
    }

    #[test]
    fn decoder_detection_and_config_values() {
        let v: Value = serde_json::from_str(
            r#"{"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}"#,
        )
        .unwrap();
        assert_eq!(
            piece_style(Some(&v)),
            PieceStyle::Metaspace {
                byte_fallback: true
            }
        );
        let v: Value = serde_json::from_str(r#"{"type": "ByteLevel"}"#).unwrap();
        assert_eq!(piece_style(Some(&v)), PieceStyle::ByteLevel);
        assert_eq!(piece_style(None), PieceStyle::Plain);
        assert!(!strips_leading_space(Some(&v)));
        let v: Value = serde_json::from_str(
            r#"{"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}"#,
        )
        .unwrap();
        assert!(strips_leading_space(Some(&v)));
        let cfg: Value = serde_json::from_str(
            r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(token_string(cfg.get("bos_token")).as_deref(), Some("<s>"));
        assert_eq!(token_string(cfg.get("eos_token")).as_deref(), Some("</s>"));
        assert_eq!(template_of(cfg.get("chat_template")).as_deref(), Some("D"));
        assert_eq!(token_string(cfg.get("pad_token")), None);
    }
}
