//! Device buffers of f32 / bf16 / u32 / u64 elements and the host<->device copies.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

use crate::error::CudaError;

/// Element types a [`GpuBuffer`] may hold.
pub trait GpuElem: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {
    /// Name used in error messages.
    const NAME: &'static str;
}
impl GpuElem for f32 {
    const NAME: &'static str = "f32";
}
impl GpuElem for half::bf16 {
    const NAME: &'static str = "bf16";
}
impl GpuElem for f64 {
    const NAME: &'static str = "f64";
}
impl GpuElem for u32 {
    const NAME: &'static str = "u32";
}
impl GpuElem for u64 {
    const NAME: &'static str = "u64";
}

/// A typed allocation in device memory (plain cuMemAlloc, never managed memory), or a view
/// of reserved addresses whose pages another owner maps (the paged KV caches, `pages.rs`).
pub struct GpuBuffer<T: GpuElem> {
    /// The allocation; `None` for a view of mapped pages (addressed by kernels only).
    slice: Option<CudaSlice<T>>,
    len: usize,
    pub(crate) ptr: u64,
}

impl<T: GpuElem> GpuBuffer<T> {
    pub(crate) fn from_slice(slice: CudaSlice<T>, stream: &Arc<CudaStream>) -> Self {
        let ptr = {
            let (ptr, _guard) = slice.device_ptr(stream);
            ptr
        };
        GpuBuffer {
            len: slice.len(),
            slice: Some(slice),
            ptr,
        }
    }

    /// `len` elements at `ptr` in pages mapped by their owner, who keeps the addresses
    /// reserved while this view lives. Kernels address it; the copy helpers refuse it.
    pub(crate) fn mapped(ptr: u64, len: usize) -> Self {
        GpuBuffer {
            slice: None,
            len,
            ptr,
        }
    }

    /// The allocation, for the copy helpers (an error for a view of mapped pages).
    pub(crate) fn slice(&self) -> Result<&CudaSlice<T>, CudaError> {
        self.slice.as_ref().ok_or_else(|| {
            CudaError::bad("copy", "the paged KV cache is addressed by kernels only")
        })
    }

    pub(crate) fn slice_mut(&mut self) -> Result<&mut CudaSlice<T>, CudaError> {
        self.slice.as_mut().ok_or_else(|| {
            CudaError::bad("copy", "the paged KV cache is addressed by kernels only")
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Raw device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Raw device address of element `offset` after checking that `len` elements fit there.
    pub fn ptr_range(
        &self,
        op: &'static str,
        what: &str,
        offset: usize,
        len: usize,
    ) -> Result<u64, CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => {
                Ok(self.ptr + (offset * std::mem::size_of::<T>()) as u64)
            }
            _ => Err(CudaError::bad(
                op,
                format!(
                    "{what}: needs {len} {} elements at offset {offset}, buffer holds {}",
                    T::NAME,
                    self.len()
                ),
            )),
        }
    }

    /// Checks that the buffer holds at least `need` elements and returns its address.
    pub fn ptr_min(&self, op: &'static str, what: &str, need: usize) -> Result<u64, CudaError> {
        self.ptr_range(op, what, 0, need)
    }
}

impl<T: GpuElem> std::fmt::Debug for GpuBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuBuffer<{}>[{}] @ {:#x}",
            T::NAME,
            self.len(),
            self.ptr
        )
    }
}
