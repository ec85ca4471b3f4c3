//! slowfast-engine: sampling, the generate loop, evaluation and benchmarks.
pub mod batch;
pub mod bench;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_spec;
pub mod device;
pub mod error;
pub mod eval;
pub mod generate;
pub mod hub;
pub mod load;
pub mod prefix;
pub mod sampler;
pub mod scheduler;
pub mod session;
pub mod spec;
pub mod stop;
pub mod tp;

pub use device::Device;
pub use error::EngineError;
pub use load::{load, Loaded, DEFAULT_MODEL};
pub use session::{budget_tokens, policy_spec, KvDtype, PolicySpec, Session};
