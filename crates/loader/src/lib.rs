//! slowfast-loader: reading checkpoints — GGUF files, safetensors (single or sharded), HF model
//! directories — into raw tensors by name, plus fetching the default model.
pub mod error;
pub mod fetch;
pub mod gguf;
pub mod paths;
pub mod safetensors;

pub use error::LoadError;
pub use paths::{default_model_path, slowfast_home, test_model_path};
