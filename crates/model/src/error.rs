//! The model crate's error type.

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown or unsupported architecture: {0}")]
    UnknownArch(String),
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("invalid weights: {0}")]
    Weights(String),
    #[error(transparent)]
    Load(#[from] slowfast_loader::LoadError),
    #[error("the sequence needs {needed} tokens of context but the KV cache holds {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    #[error("{0}")]
    Compute(String),
    /// A tensor-parallel plan that does not fit the model, or a failed collective.
    #[error("{0}")]
    TensorParallel(String),
}
