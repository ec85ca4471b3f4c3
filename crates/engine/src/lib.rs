//! slowfast-engine: sampling, the generate loop, evaluation and benchmarks.
pub mod sampler;
