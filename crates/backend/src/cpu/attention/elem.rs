//! `KvElem`: the element types a KV cache may hold (f32, f16, e4m3) and how kernels widen
//! them to f32.

use super::simd::Simd;
use crate::e4m3::E4m3;
use half::f16;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for crate::e4m3::E4m3 {}
}

/// How a [`KvElem`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemKind {
    F32,
    /// Kernels widen with F16C / AVX-512.
    F16,
    /// fp8: kernels widen a byte through f16 (`crate::e4m3`).
    E4m3,
}

/// A KV-cache element type. Sealed: implemented for `f32`, `half::f16` and [`E4m3`].
pub trait KvElem: sealed::Sealed + Copy + Send + Sync + 'static {
    const KIND: ElemKind;
    /// Narrower than f32: kernels widen a tile of keys before their dot products.
    const NARROW: bool = !matches!(Self::KIND, ElemKind::F32);
    /// Widens one element (reference paths).
    fn to_f32(self) -> f32;
}

impl KvElem for f32 {
    const KIND: ElemKind = ElemKind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElem for f16 {
    const KIND: ElemKind = ElemKind::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl KvElem for E4m3 {
    const KIND: ElemKind = ElemKind::E4m3;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        E4m3::to_f32(self)
    }
}

/// Loads `S::LANES` consecutive elements at `p` as f32 vector.
#[inline(always)]
pub(crate) unsafe fn load<T: KvElem, S: Simd>(p: *const T) -> S::V {
    match T::KIND {
        ElemKind::F16 => S::load_f16(p as *const u16),
        ElemKind::E4m3 => S::load_e4m3(p as *const u8),
        ElemKind::F32 => S::load(p as *const f32),
    }
}
