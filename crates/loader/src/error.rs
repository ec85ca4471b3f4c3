//! The loader's error type: every variant names the file or key at fault.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid GGUF file: {msg}")]
    BadGguf { path: PathBuf, msg: String },
    #[error("{path} is not a valid safetensors file: {msg}")]
    BadSafetensors { path: PathBuf, msg: String },
    #[error("{path}: {msg}")]
    BadConfig { path: PathBuf, msg: String },
    #[error("missing metadata key `{key}` in {path}")]
    MissingKey { path: PathBuf, key: String },
    #[error("tensor `{name}` not found in {path}")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{0}")]
    Other(String),
}

impl LoadError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LoadError::Io {
            path: path.into(),
            source,
        }
    }
}
