//! slowfast-quant: GGML weight formats (dequantize / quantize rows) and fast CPU kernels.
//!
//! * [`GgmlType`]: ggml type ids, block sizes, bytes per row.
//! * [`dequantize_row`] (bit-exact with ggml) and [`quantize_row`] (ggml's reference quantizers).
//! * Decode: [`matvec`] / [`matvec_into`] / [`matvec_rows`] / [`matvec_batch`] on a
//!   [`QMatrix`] — integer dot products against an 8-bit quantized activation (AVX-512 VNNI,
//!   AVX2 or scalar, picked at run time), parallel over row chunks.
//! * Prefill: [`matmul`] — dequantized weight tiles + f32 GEMM, or batched quantized dots for
//!   small batches ([`gemm_crossover`]).
//!
//! Which path wins per phase is measured by `cargo bench -p slowfast-quant --bench kernels`
//! (results in docs/quant-kernels.md).

mod activation;
mod dequant;
mod dequant_simd;
mod dot;
mod error;
mod matmul;
mod matvec;
mod quantize;
mod reference;
mod types;

pub use dequant::dequantize_row;
pub use dequant_simd::dequantize_row_with;
pub use dot::Isa;
pub use error::QuantError;
pub use matmul::{gemm_crossover, matmul, matmul_gemm};
pub use matvec::{
    matvec, matvec_batch, matvec_into, matvec_rows, matvec_with, DotPath, MatvecScratch, QMatrix,
};
pub use quantize::quantize_row;
pub use reference::matvec_reference;
pub use types::{GgmlType, QK, QK_K};
