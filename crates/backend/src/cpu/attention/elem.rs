//! `KvElem`: the element types a KV cache may hold (f32, f16) and how kernels widen them to f32.

use super::simd::Simd;
use half::f16;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

/// A KV-cache element type. Sealed: implemented for `f32` and `half::f16`.
pub trait KvElem: sealed::Sealed + Copy + Send + Sync + 'static {
    /// True for `f16` (kernels widen with F16C / AVX-512), false for `f32`.
    const IS_F16: bool;
    /// Widens one element (reference paths).
    fn to_f32(self) -> f32;
}

impl KvElem for f32 {
    const IS_F16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElem for f16 {
    const IS_F16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Loads `S::LANES` consecutive elements at `p` as f32 vector.
#[inline(always)]
pub(crate) unsafe fn load<T: KvElem, S: Simd>(p: *const T) -> S::V {
    if T::IS_F16 {
        S::load_f16(p as *const u16)
    } else {
        S::load(p as *const f32)
    }
}
