//! Row dot products of one weight row with one activation, per instruction set.
//!
//! `Isa` picks the kernel family; `dot_row` dispatches on the weight type. Every SIMD kernel has
//! a scalar twin in `scalar.rs` computing the same integer sums.

mod avx2;
mod avx512;
mod scalar;

use crate::activation::ActRef;
use crate::types::GgmlType;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::q6_k_unpack as q6_k_unpack_avx2;
use std::sync::OnceLock;

/// Kernel family for the dot products. `Isa::best()` is what `matvec` uses; tests force each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, any CPU.
    Scalar,
    /// AVX2 + FMA + F16C (`maddubs` integer dots, 256-bit f32 FMA).
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (`vpdpbusd`/`vpdpwssd` integer dots, 512-bit f32 FMA).
    Avx512,
}

impl Isa {
    /// The fastest family this CPU supports (detected once).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            if Isa::Avx512.is_available() {
                Isa::Avx512
            } else if Isa::Avx2.is_available() {
                Isa::Avx2
            } else {
                Isa::Scalar
            }
        })
    }

    /// Whether this CPU can run the family.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// All families this CPU supports, slowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    /// Lower-case name (`"scalar"`, `"avx2"`, `"avx512"`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Whether `dot_row` has a kernel for weights of `ty`.
pub(crate) fn has_dot(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS
    )
}

/// Dot product of one weight row (`ty`, `row` = whole row bytes) with the activation: `x` for
/// float weights, `a` (quantized as `ActKind::for_weight(ty)`) otherwise.
///
/// Callers guarantee `has_dot(ty)`, `isa.is_available()`, `row.len() == ty.row_bytes(x.len())`
/// and an `a` quantized from `x`.
#[inline]
pub(crate) fn dot_row(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32], a: ActRef<'_>) -> f32 {
    debug_assert!(isa.is_available());
    debug_assert_eq!(Ok(row.len()), ty.row_bytes(x.len()));
    match isa {
        Isa::Scalar => scalar::dot(ty, row, x, a),
        // SAFETY: the caller checked the CPU features (`isa.is_available()`) and the lengths.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot(ty, row, x, a) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot(ty, row, x, a) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar::dot(ty, row, x, a),
    }
}

/// `out[r] = dot_row(W[r], x)` for consecutive rows `rows` (`out.len()` rows of `rb` bytes): one
/// dispatch per call instead of per row. Same contract as `dot_row`.
#[inline]
pub(crate) fn dot_rows(
    isa: Isa,
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    x: &[f32],
    a: ActRef<'_>,
    out: &mut [f32],
) {
    debug_assert!(isa.is_available());
    debug_assert_eq!(Ok(rb), ty.row_bytes(x.len()));
    assert_eq!(rows.len(), rb * out.len(), "dot_rows: rows/out mismatch");
    match isa {
        Isa::Scalar => scalar::dot_rows(ty, rows, rb, x, a, out),
        // SAFETY: the caller checked the CPU features (`isa.is_available()`) and the lengths.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_rows(ty, rows, rb, x, a, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot_rows(ty, rows, rb, x, a, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar::dot_rows(ty, rows, rb, x, a, out),
    }
}
