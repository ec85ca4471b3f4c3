//! slowfast-cuda: the GPU building blocks of the engine. Kernels are CUDA C++ in
//! `kernels/*.cu`, compiled at start with NVRTC for the device's own architecture and cached
//! on disk; GEMMs go through cuBLAS; attention is flash-decoding (decode) and tiled flash
//! attention (prefill). The runtime needs the `cuda` feature; without it
//! [`CudaContext::new`] returns [`CudaError::NotBuilt`]. The NVRTC compile check
//! ([`compile_kernels`]) works in every build and needs no GPU.

pub mod error;
pub mod fp8;
pub mod kernels;
pub mod nvrtc;
pub mod pages;
pub mod trace;

#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod context;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod sparse;
#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(feature = "cuda")]
mod vmm;

pub use error::CudaError;
pub use nvrtc::{compile_kernels, load_or_compile_kernels, KernelImage};

#[cfg(feature = "cuda")]
pub use buffer::{GpuBuffer, GpuElem};
#[cfg(feature = "cuda")]
pub use context::CudaContext;
#[cfg(feature = "cuda")]
pub use half::bf16;
#[cfg(feature = "cuda")]
pub use model::{
    fp8_scale, DecoderSpec, GpuDecoder, KvOptions, Norm, Tensor, TspArgs, WeightSource,
};
#[cfg(feature = "cuda")]
pub use ops::attention::{AttnWorkspace, DecodeAttn, PrefillAttn};
#[cfg(feature = "cuda")]
pub use ops::elementwise::Glu;
#[cfg(feature = "cuda")]
pub use ops::fused::{GemvInput, GemvOutput, QkvPost};
#[cfg(feature = "cuda")]
pub use ops::norm::{RmsNorm, Rope};
#[cfg(feature = "cuda")]
pub use ops::KvLayout;
#[cfg(feature = "cuda")]
pub use sparse::{CompactMemory, GpuKvPolicy, GpuQuestConfig, GpuSfiConfig, GpuSnapConfig};
#[cfg(not(feature = "cuda"))]
pub use stub::CudaContext;

/// Whether this build carries the CUDA runtime (the `cuda` feature).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");
