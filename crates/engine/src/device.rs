//! The compute device a session runs on (`--device cpu|cuda`) and the stepping interface the
//! generate loop uses on either. The CUDA side lives in `crate::cuda` (feature `cuda`); a
//! build without it answers `--device cuda` with a clear error.
use slowfast_kv::PolicyStats;

use crate::session::{KvDtype, PolicySpec, Session};
use crate::{EngineError, Loaded};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            _ => Err(format!("unknown device `{s}` (cpu or cuda)")),
        }
    }
}

/// Whether this build carries the CUDA engine (`--features cuda`).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// The error for `--device cuda` in a build without the `cuda` feature.
pub fn not_built() -> EngineError {
    EngineError::BadInput(
        "--device cuda: slowfast was built without CUDA support; rebuild with `cargo build --release --features cuda` (needs an NVIDIA driver at run time, no CUDA toolkit)".into(),
    )
}

/// The error for `--tensor-parallel` above 1 with `--device cuda`.
pub fn tp_not_on_gpu() -> EngineError {
    EngineError::BadInput(
        "--tensor-parallel above 1 runs on the CPU only so far (ranks in threads, the reference for the GPU); the GPU's ranks need an NCCL communicator and a multi-GPU machine (issue 26, docs/tensor-parallel.md)".into(),
    )
}

/// What the generate loop needs from a session (CPU `Session` or the GPU session).
pub trait Steps {
    /// Prefill `tokens`; returns the last row's logits.
    fn prefill(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError>;
    /// Decode one token; returns its next-token logits.
    fn step(&mut self, token: u32) -> Result<&[f32], EngineError>;
    fn logits(&self) -> &[f32];
    fn kv_bytes(&self) -> usize;
    fn policy_name(&self) -> &'static str;
    fn policy_stats(&self) -> PolicyStats;
}

impl Steps for Session<'_> {
    fn prefill(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError> {
        Session::prefill(self, tokens, progress)
    }
    fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        Session::step(self, token)
    }
    fn logits(&self) -> &[f32] {
        Session::logits(self)
    }
    fn kv_bytes(&self) -> usize {
        Session::kv_bytes(self)
    }
    fn policy_name(&self) -> &'static str {
        Session::policy_name(self)
    }
    fn policy_stats(&self) -> PolicyStats {
        Session::policy_stats(self)
    }
}

/// A session for one sequence of up to `max_tokens` tokens on `device`, split over
/// `m.tensor_parallel` ranks when that is above 1 (`crate::tp`; the CPU only so far).
pub fn session<'m>(
    device: Device,
    m: &'m Loaded,
    max_tokens: usize,
    kv: KvDtype,
    chunk: usize,
    policy: &PolicySpec,
) -> Result<Box<dyn Steps + 'm>, EngineError> {
    let model = &m.model;
    if m.tensor_parallel > 1 {
        if device != Device::Cpu {
            return Err(tp_not_on_gpu());
        }
        return Ok(Box::new(crate::tp::TpSession::new(
            model,
            m.tensor_parallel,
            max_tokens,
            kv,
            chunk,
            policy,
        )?));
    }
    match device {
        Device::Cpu => Ok(Box::new(Session::try_with_policy(
            model, max_tokens, kv, chunk, policy,
        )?)),
        #[cfg(feature = "cuda")]
        Device::Cuda => Ok(Box::new(crate::cuda::GpuSession::new(
            model, max_tokens, kv, policy,
        )?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(not_built()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_and_the_no_cuda_message() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda);
        assert!("tpu".parse::<Device>().unwrap_err().contains("tpu"));
        assert!(not_built().to_string().contains("--features cuda"));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_session_without_the_feature_says_so() {
        let mut small = slowfast_model::presets::preset("qwen3-0.6b").unwrap();
        small.num_hidden_layers = 1;
        small.layer_sliding = vec![false];
        small.vocab_size = 300; // the byte-level tokenizer needs 258
        small.hidden_size = 64;
        small.intermediate_size = 64;
        let w = slowfast_model::random::random_weights(&small, slowfast_quant::GgmlType::F32, 1)
            .unwrap();
        let m = Loaded {
            tokenizer: slowfast_tokenizer::Tokenizer::byte_level(small.vocab_size).unwrap(),
            model: slowfast_model::Model::new(small, w).unwrap(),
            name: "random".into(),
            tensor_parallel: 1,
        };
        let err = match session(Device::Cuda, &m, 16, KvDtype::F32, 8, &PolicySpec::Full) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a build without the cuda feature made a GPU session"),
        };
        assert!(err.contains("built without CUDA"), "{err}");
    }
}
