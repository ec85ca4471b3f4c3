//! slowfast-model: model configs (GGUF, HF, presets), weights by role, and the one generic
//! decoder that runs Llama, Qwen2, Qwen3, Mistral and Gemma 3 on the CPU.
pub mod attention;
pub mod batch;
pub mod config;
pub mod decoder;
pub mod error;
pub mod load;
pub mod presets;
pub mod random;
pub mod tp;
pub mod weights;

pub use batch::DecodeRow;
pub use config::{Activation, Arch, ModelConfig, RopeScaling};
pub use decoder::{LogitsRows, MatmulPrecision, Model, Scratch, TspConfig};
pub use error::ModelError;
pub use tp::{Communicator, SingleRank, ThreadGroup, TpPlan};
pub use weights::{ModelWeights, Weight};
