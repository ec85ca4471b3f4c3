//! slowfast-tokenizer: text <-> token ids for every model slowfast runs — GGUF SentencePiece
//! vocabularies (id-exact with llama.cpp), HF `tokenizer.json`, and a byte-level stand-in for
//! random models — plus chat templates, streaming decode and vocabulary-derived token classes.
pub mod byte_level;
pub mod chat;
pub mod error;
pub mod gguf;
pub mod gguf_bpe;
pub mod hf;
pub mod llama_names;
pub mod partition;
pub mod spm;
pub mod stream;
pub mod vocab_scan;

use std::path::Path;

use slowfast_loader::gguf::GgufFile;

pub use byte_level::ByteTokenizer;
pub use chat::{ChatMessage, ChatTemplate};
pub use error::{Result, TokenizerError};
pub use hf::HfTokenizer;
pub use spm::{SpmConfig, SpmVocab, TokenKind};
pub use stream::StreamDecoder;

enum Inner {
    Spm(Box<SpmVocab>),
    Hf(Box<HfTokenizer>),
    Bytes(ByteTokenizer),
}

/// Any of slowfast's tokenizers behind one interface.
pub struct Tokenizer {
    inner: Inner,
    chat: Option<ChatTemplate>,
    /// Why there is no chat template, for the error when one is asked for.
    chat_missing: String,
    eos_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            Inner::Spm(_) => "spm",
            Inner::Hf(_) => "hf",
            Inner::Bytes(_) => "bytes",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .finish_non_exhaustive()
    }
}

/// Compile the checkpoint's template, else the built-in one for `arch`.
fn pick_template(
    own: Option<&str>,
    arch: Option<&str>,
    bos: &str,
    eos: &str,
) -> Result<(Option<ChatTemplate>, String)> {
    if let Some(src) = own {
        return Ok((Some(ChatTemplate::new(src, bos, eos)?), String::new()));
    }
    match arch.and_then(chat::builtin_template) {
        Some(src) => Ok((Some(ChatTemplate::new(src, bos, eos)?), String::new())),
        None => Ok((
            None,
            format!(
                "the checkpoint has no chat template and architecture `{}` has no built-in one",
                arch.unwrap_or("unknown")
            ),
        )),
    }
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

impl Tokenizer {
    /// The vocabulary and chat template of a GGUF file: SentencePiece (`llama`) or byte-level
    /// BPE (`gpt2`).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        if file.get_str("tokenizer.ggml.model") == Some("gpt2") {
            let mut hf = gguf_bpe::bpe_from_gguf(file)?;
            hf.chat_template = gguf::chat_template(file);
            hf.model_type = file.get_str("general.architecture").map(str::to_owned);
            if let Some(eot) = file.get_u32("tokenizer.ggml.eot_token_id") {
                hf.extra_eos.push(eot);
            }
            return Self::from_hf(hf);
        }
        let vocab = gguf::spm_from_gguf(file)?;
        let text = |id: Option<u32>| {
            id.and_then(|i| vocab.text(i))
                .map(|t| String::from_utf8_lossy(t).into_owned())
                .unwrap_or_default()
        };
        let cfg = vocab.config().clone();
        let (chat, chat_missing) = pick_template(
            gguf::chat_template(file).as_deref(),
            file.get_str("general.architecture"),
            &text(cfg.bos_id),
            &text(cfg.eos_id),
        )?;
        let eos_ids = vocab.eog_ids().to_vec();
        Ok(Tokenizer {
            inner: Inner::Spm(Box::new(vocab)),
            chat,
            chat_missing,
            eos_ids,
        })
    }

    /// Open a GGUF file and read its tokenizer.
    pub fn from_gguf_path(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path).map_err(|e| TokenizerError::BadFile {
            path: path.to_owned(),
            msg: e.to_string(),
        })?;
        Self::from_gguf(&file)
    }

    /// An HF model directory (`tokenizer.json`, optional `tokenizer_config.json`,
    /// `generation_config.json`, `config.json`).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        Self::from_hf(HfTokenizer::from_dir(dir)?)
    }

    /// A loaded HF tokenizer; the chat template falls back on its `model_type`.
    pub fn from_hf(hf: HfTokenizer) -> Result<Self> {
        let (chat, chat_missing) = pick_template(
            hf.chat_template.as_deref(),
            hf.model_type.as_deref(),
            hf.bos_token.as_deref().unwrap_or(""),
            hf.eos_token.as_deref().unwrap_or(""),
        )?;
        let mut eos_ids = Vec::new();
        if let Some(id) = hf.eos_token.as_deref().and_then(|t| hf.id_of(t)) {
            push_unique(&mut eos_ids, id);
        }
        for &id in &hf.extra_eos {
            push_unique(&mut eos_ids, id);
        }
        for name in llama_names::EOG_NAMES {
            if let Some(id) = hf.id_of(name).filter(|&id| hf.is_special(id)) {
                push_unique(&mut eos_ids, id);
            }
        }
        Ok(Tokenizer {
            inner: Inner::Hf(Box::new(hf)),
            chat,
            chat_missing,
            eos_ids,
        })
    }

    /// The byte-level stand-in for a random model with `vocab_size` ids (ChatML template).
    pub fn byte_level(vocab_size: usize) -> Result<Self> {
        let b = ByteTokenizer::new(vocab_size)?;
        Ok(Tokenizer {
            inner: Inner::Bytes(b),
            chat: Some(ChatTemplate::new(chat::CHATML_TEMPLATE, "<bos>", "<eos>")?),
            chat_missing: String::new(),
            eos_ids: vec![byte_level::BYTE_EOS],
        })
    }

    /// Encode `text`; `add_special` adds BOS/EOS as the model asks. Special-token texts in
    /// `text` (e.g. `<start_of_turn>`) become their tokens, as llama.cpp does for prompts.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Encode with explicit control over special-token parsing: with `parse_special = false`
    /// control-token texts are tokenized as plain text (user-defined tokens still match).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Spm(v) => v.encode(text, add_special, parse_special),
            Inner::Hf(h) => h.encode(text, add_special, parse_special),
            Inner::Bytes(b) => Ok(b.encode(text, add_special, parse_special)),
        }
    }

    /// Text of `ids`, control tokens hidden; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// Text of `ids`; `special` prints control tokens' text too.
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::new();
        // A vocabulary that prefixes a space when encoding drops it again from the first
        // piece that prints anything (hidden control tokens like BOS do not count).
        let mut strip = self.strips_leading_space();
        for &id in ids {
            let b = self.token_bytes(id, special);
            if strip && !b.is_empty() {
                strip = false;
                if b[0] == b' ' {
                    bytes.extend_from_slice(&b[1..]);
                    continue;
                }
            }
            bytes.extend_from_slice(&b);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn strips_leading_space(&self) -> bool {
        match &self.inner {
            Inner::Spm(v) => v.config().add_space_prefix,
            Inner::Hf(h) => h.strip_leading_space,
            Inner::Bytes(_) => false,
        }
    }

    /// Decoded bytes of one token (may be part of a UTF-8 character); control tokens give
    /// nothing unless `special`. Unknown ids give nothing.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        match &self.inner {
            Inner::Spm(v) => v.piece(id, special).to_vec(),
            Inner::Hf(h) => h.token_bytes(id, special).to_vec(),
            Inner::Bytes(b) => b.token_bytes(id, special),
        }
    }

    /// The vocabulary's own string for a token (`▁the`, `<0x0A>`, `<start_of_turn>`).
    pub fn token_text(&self, id: u32) -> Option<String> {
        match &self.inner {
            Inner::Spm(v) => v.text(id).map(|t| String::from_utf8_lossy(t).into_owned()),
            Inner::Hf(h) => h.token_text(id),
            Inner::Bytes(b) => b.token_text(id),
        }
    }

    /// The id whose vocabulary string is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.inner {
            Inner::Spm(v) => v.id_of(text),
            Inner::Hf(h) => h.id_of(text),
            Inner::Bytes(b) => {
                (0..b.vocab_size() as u32).find(|&i| b.token_text(i).as_deref() == Some(text))
            }
        }
    }

    /// Control / special tokens (hidden on decode).
    pub fn is_special(&self, id: u32) -> bool {
        match &self.inner {
            Inner::Spm(v) => v.kind(id).is_some_and(|k| k.is_special()),
            Inner::Hf(h) => h.is_special(id),
            Inner::Bytes(b) => b.is_special(id),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Spm(v) => v.len(),
            Inner::Hf(h) => h.vocab_size(),
            Inner::Bytes(b) => b.vocab_size(),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        match &self.inner {
            Inner::Spm(v) => v.config().bos_id,
            Inner::Hf(h) => h.bos_token.as_deref().and_then(|t| h.id_of(t)),
            Inner::Bytes(_) => Some(byte_level::BYTE_BOS),
        }
    }

    /// Ids that end generation: EOS plus end-of-turn tokens found by name
    /// (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, ...). For GGUF files this is llama.cpp's
    /// EOG set (for Gemma 3: `<eos>`, `<end_of_turn>` and `</s>`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `encode(.., add_special = true)` puts BOS first.
    pub fn adds_bos(&self) -> bool {
        match &self.inner {
            Inner::Spm(v) => v.config().add_bos,
            Inner::Hf(h) => {
                let bos = self.bos_id();
                bos.is_some()
                    && h.encode("", true, true)
                        .ok()
                        .and_then(|v| v.first().copied())
                        == bos
            }
            Inner::Bytes(_) => true,
        }
    }

    /// Render a conversation with the model's chat template (or the built-in one for its
    /// architecture). A leading BOS text is removed when encoding adds BOS itself, so encode
    /// the result with `add_special = true`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self
            .chat
            .as_ref()
            .ok_or_else(|| TokenizerError::NoChatTemplate(self.chat_missing.clone()))?;
        let s = t.render(messages, add_generation_prompt)?;
        let bos = t.bos_token();
        if !bos.is_empty() && self.adds_bos() {
            if let Some(rest) = s.strip_prefix(bos) {
                return Ok(rest.to_owned());
            }
        }
        Ok(s)
    }

    /// Tokens whose text ends a sentence (`.` `?` `!` `。` `？` `！`, trailing newlines allowed).
    pub fn sentence_ender_ids(&self) -> Vec<u32> {
        vocab_scan::scan(
            self.vocab_size(),
            |id| self.token_bytes(id, false),
            vocab_scan::is_sentence_ender,
        )
    }

    /// The SFI reference's narrower class: tokens that are exactly one ender character,
    /// optionally followed by newlines (no word glued in front, unlike `sentence_ender_ids`).
    pub fn punctuation_ender_ids(&self) -> Vec<u32> {
        vocab_scan::scan(
            self.vocab_size(),
            |id| self.token_bytes(id, false),
            vocab_scan::is_punctuation_ender,
        )
    }

    /// Tokens whose text is only newlines.
    pub fn newline_ids(&self) -> Vec<u32> {
        vocab_scan::scan(
            self.vocab_size(),
            |id| self.token_bytes(id, false),
            vocab_scan::is_newline_only,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<StreamDecoder>();
        let t = Tokenizer::byte_level(300).unwrap();
        let ids = std::thread::scope(|s| {
            s.spawn(|| t.encode("shared", false).unwrap())
                .join()
                .unwrap()
        });
        assert_eq!(t.decode(&ids), "shared");
    }
}
