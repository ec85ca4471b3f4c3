//! The CUDA context of a build without the `cuda` feature: it cannot be constructed.

use crate::error::CudaError;

/// Stand-in for the GPU context; [`CudaContext::new`] always fails with
/// [`CudaError::NotBuilt`], so code can name the type without `#[cfg]`.
#[derive(Debug)]
pub enum CudaContext {}

impl CudaContext {
    /// Always `Err(CudaError::NotBuilt)`.
    pub fn new(_ordinal: usize) -> Result<Self, CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// Never returns (the type has no values).
    pub fn device_name(&self) -> &str {
        match *self {}
    }
}
