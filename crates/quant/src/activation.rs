//! Quantized activations for the integer dot products: Q8_0-style (32-value blocks) for the
//! legacy quants and Q8_K-style (256-value blocks with 16-value sums) for the K-quants.
//!
//! Stored as separate arrays (not ggml's interleaved blocks) so the SIMD kernels can load the
//! int8 values, scales and sums directly. Scales stay f32 (ggml rounds Q8_0's to f16).

use crate::quantize::nearest_int;
use crate::types::{GgmlType, QK, QK_K};

/// How a weight type wants its activation: as f32, or quantized to 8-bit blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ActKind {
    F32,
    Q8_0,
    Q8K,
}

impl ActKind {
    pub(crate) fn for_weight(ty: GgmlType) -> ActKind {
        match ty {
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL => ActKind::Q8_0,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => ActKind::Q8K,
            _ => ActKind::F32,
        }
    }

    fn block(self) -> usize {
        match self {
            ActKind::F32 => 1,
            ActKind::Q8_0 => QK,
            ActKind::Q8K => QK_K,
        }
    }

    /// Values covered by one entry of `sums`.
    fn sum_group(self) -> usize {
        match self {
            ActKind::F32 => 1,
            ActKind::Q8_0 => QK,
            ActKind::Q8K => 16,
        }
    }
}

/// One activation vector quantized to int8 blocks (reused across calls: no allocation once
/// sized).
#[derive(Debug, Clone, Default)]
pub(crate) struct QuantAct {
    pub qs: Vec<i8>,    // [cols]
    pub d: Vec<f32>,    // [cols / block]
    pub sums: Vec<i16>, // [cols / sum_group], sum of the int8 values of each group
}

/// Borrowed view handed to the dot kernels.
#[derive(Clone, Copy)]
pub(crate) struct ActRef<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sums: &'a [i16],
}

impl QuantAct {
    pub(crate) fn view(&self) -> ActRef<'_> {
        ActRef {
            qs: &self.qs,
            d: &self.d,
            sums: &self.sums,
        }
    }

    /// Quantize `x` (a whole number of `kind` blocks; checked by callers) into self.
    pub(crate) fn quantize(&mut self, kind: ActKind, x: &[f32]) {
        if kind == ActKind::F32 {
            self.qs.clear();
            self.d.clear();
            self.sums.clear();
            return;
        }
        let n = x.len();
        let bs = kind.block();
        self.qs.resize(n, 0);
        self.d.resize(n / bs, 0.0);
        self.sums.resize(n / kind.sum_group(), 0);
        let g = kind.sum_group();
        for (b, (xb, qb)) in x
            .chunks_exact(bs)
            .zip(self.qs.chunks_exact_mut(bs))
            .enumerate()
        {
            let amax = absmax(xb);
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            // ggml stores a Q8_0 block's scale as f16 (Q8_K keeps f32); rounding it the same
            // way keeps our integer dot products equal to llama.cpp's.
            self.d[b] = if kind == ActKind::Q8_0 {
                half::f16::from_f32(amax / 127.0).to_f32()
            } else {
                amax / 127.0
            };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = nearest_int(v * id) as i8;
            }
            for (k, qg) in qb.chunks_exact(g).enumerate() {
                self.sums[b * (bs / g) + k] = qg.iter().map(|&q| q as i16).sum();
            }
        }
    }
}

/// Max |v| with 8 independent lanes so it vectorizes.
fn absmax(x: &[f32]) -> f32 {
    let mut m = [0.0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for i in 0..8 {
            m[i] = if c[i].abs() > m[i] { c[i].abs() } else { m[i] };
        }
    }
    let mut r = it.remainder().iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for v in m {
        r = r.max(v);
    }
    r
}
