//! The tokenizer's error type: every variant names the file, key or input at fault.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("GGUF tokenizer metadata: missing key `{0}`")]
    MissingKey(String),
    #[error("GGUF tokenizer metadata: key `{key}` {msg}")]
    BadKey { key: String, msg: String },
    #[error("unsupported tokenizer model `{0}` (supported: `llama` SentencePiece and `gpt2` byte-level BPE)")]
    UnsupportedModel(String),
    #[error("invalid vocabulary: {0}")]
    BadVocab(String),
    #[error("{path} is not a usable tokenizer file: {msg}")]
    BadFile { path: PathBuf, msg: String },
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("token id {id} is out of range for a vocabulary of {vocab_size} tokens")]
    BadTokenId { id: u32, vocab_size: usize },
    #[error("no chat template: {0}")]
    NoChatTemplate(String),
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    #[error("{0}")]
    Other(String),
}

impl TokenizerError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TokenizerError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, TokenizerError>;
