//! Error type of the CUDA crate: every failure names the operation and the bad input.

use thiserror::Error;

/// Errors from building, loading or launching the CUDA kernels.
#[derive(Debug, Error)]
pub enum CudaError {
    /// The crate was compiled without the `cuda` feature.
    #[error("slowfast was built without CUDA support (rebuild with --features cuda)")]
    NotBuilt,
    /// A CUDA library (driver, NVRTC, cuBLAS) could not be found or loaded.
    #[error("{library} is not available: {reason}")]
    LibraryMissing {
        library: &'static str,
        reason: String,
    },
    /// No CUDA device with the requested ordinal.
    #[error("no CUDA device {ordinal}: {reason}")]
    NoDevice { ordinal: usize, reason: String },
    /// The device is too old for these kernels.
    #[error("device {name} has compute capability {major}.{minor}; slowfast's kernels need 8.0 or newer")]
    UnsupportedDevice {
        name: String,
        major: i32,
        minor: i32,
    },
    /// NVRTC rejected the kernel sources.
    #[error("NVRTC failed to compile the kernels for {arch} (options {options:?}):\n{log}")]
    Compile {
        arch: String,
        options: Vec<String>,
        log: String,
    },
    /// The CUDA headers (cuda_bf16.h) were not found.
    #[error(
        "CUDA headers not found: {0} (set SLOWFAST_CUDA_INCLUDE to a folder holding cuda_bf16.h)"
    )]
    MissingHeaders(String),
    /// A driver-API call failed.
    #[error("CUDA driver call failed during {op}: {reason}")]
    Driver { op: &'static str, reason: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS failed during {op}: {reason}")]
    Blas { op: &'static str, reason: String },
    /// An argument has the wrong size or value.
    #[error("{op}: {what}")]
    BadArgument { op: &'static str, what: String },
    /// Reading or writing the kernel cache failed.
    #[error("kernel cache {path}: {reason}")]
    Cache { path: String, reason: String },
}

impl CudaError {
    /// Shorthand for [`CudaError::BadArgument`].
    pub fn bad(op: &'static str, what: impl Into<String>) -> Self {
        CudaError::BadArgument {
            op,
            what: what.into(),
        }
    }
}
