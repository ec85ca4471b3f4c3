//! The engine's error type: bad user input is kept apart from internal failures.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    BadInput(String),
    #[error(transparent)]
    Model(#[from] slowfast_model::ModelError),
    #[error(transparent)]
    Load(#[from] slowfast_loader::LoadError),
    #[error(transparent)]
    Tokenizer(#[from] slowfast_tokenizer::TokenizerError),
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),
    #[error("{0}")]
    Io(String),
}
