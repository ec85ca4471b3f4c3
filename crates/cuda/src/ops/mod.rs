//! Launch wrappers: each checks shapes and buffer sizes on the host, then queues a kernel.

pub mod attention;
pub mod elementwise;
pub mod fused;
pub mod gemm;
pub mod h2o;
pub mod norm;
pub mod quest;
pub mod sampling;
pub mod sfi;
pub mod sfi_cand;
pub mod snapkv;

use crate::error::CudaError;

/// Geometry of one layer's KV cache: `[num_slots, kv_heads, capacity, head_dim]` bf16 (or
/// e4m3 bytes with `fp8`) for K and the same for V; a slot holds one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_slots: usize,
    pub kv_heads: usize,
    pub capacity: usize,
    pub head_dim: usize,
    /// The caches hold e4m3 bytes (fp8 KV); the buffers are still `GpuBuffer<bf16>`, of
    /// [`KvLayout::buf_len`] elements (two e4m3 values an element).
    pub fp8: bool,
}

impl KvLayout {
    /// Elements in one of K or V.
    pub fn elems(&self) -> usize {
        self.num_slots * self.kv_heads * self.capacity * self.head_dim
    }

    /// Bytes of one cached element (2: bf16, 1: e4m3).
    pub fn elem_bytes(&self) -> usize {
        if self.fp8 {
            1
        } else {
            2
        }
    }

    /// Bytes of one cached row (a position of one head).
    pub fn row_bytes(&self) -> usize {
        self.head_dim * self.elem_bytes()
    }

    /// Buffer (`GpuBuffer<bf16>`) elements of one cached row: what copies of rows count in.
    pub fn row_len(&self) -> usize {
        self.row_bytes() / 2
    }

    /// Length of a cache buffer (`GpuBuffer<bf16>` elements) holding the layout.
    pub fn buf_len(&self) -> usize {
        self.num_slots * self.kv_heads * self.capacity * self.row_len()
    }

    pub(crate) fn check(&self, op: &'static str) -> Result<(), CudaError> {
        if self.num_slots == 0 || self.kv_heads == 0 || self.capacity == 0 {
            return Err(CudaError::bad(op, format!("empty KV layout {self:?}")));
        }
        if !matches!(self.head_dim, 64 | 128 | 256) {
            return Err(CudaError::bad(
                op,
                format!("head_dim {} (supported: 64, 128, 256)", self.head_dim),
            ));
        }
        if self.capacity > u32::MAX as usize / 2 || self.elems() > (1usize << 40) {
            return Err(CudaError::bad(op, format!("KV layout too large: {self:?}")));
        }
        Ok(())
    }
}

pub(crate) fn u32_of(op: &'static str, what: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v)
        .map_err(|_| CudaError::bad(op, format!("{what} = {v} does not fit in 32 bits")))
}

pub(crate) fn grid_1d(n: usize, block: usize) -> u32 {
    n.div_ceil(block).clamp(1, 65535 * 16) as u32
}
