//! Reference quantizers (`quantize_row`): ggml's simple `quantize_row_*_ref` algorithms.
//!
//! Q4_K and Q6_K use plain min/max scale choice (no importance-weighted search); they exist to
//! build random-weight test and benchmark matrices, not to produce release-quality models.

use crate::types::{GgmlType, QK, QK_K};
use crate::QuantError;
use half::{bf16, f16};

/// ggml's `nearest_int`: round half to even for |v| < 2^22.
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let val = v + 12582912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantize `src` (a whole number of blocks) into `dst` (`ty.row_bytes(src.len())` bytes).
///
/// Supported: F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q8_K, Q4_K, Q6_K.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let expected = ty.row_bytes(src.len())?;
    let block: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::F32 => |x, y| y.copy_from_slice(&x[0].to_le_bytes()),
        GgmlType::F16 => |x, y| y.copy_from_slice(&f16::from_f32(x[0]).to_bits().to_le_bytes()),
        GgmlType::BF16 => |x, y| y.copy_from_slice(&bf16::from_f32(x[0]).to_bits().to_le_bytes()),
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q8_K => block_q8_k,
        GgmlType::Q4_K => block_q4_k,
        GgmlType::Q6_K => block_q6_k,
        _ => return Err(ty.unsupported("quantize_row")),
    };
    QuantError::check_len("quantize_row dst", "bytes", expected, dst.len())?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    for (x, y) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(ts)) {
        block(x, y);
    }
    Ok(())
}

/// The value with the largest magnitude (first one on ties), and that magnitude.
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

fn put_f16(y: &mut [u8], v: f32) {
    y[..2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

fn block_q4_0(x: &[f32], y: &mut [u8]) {
    let (max, _) = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, d);
    for j in 0..QK / 2 {
        let x0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let x1 = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
        y[2 + j] = x0 | (x1 << 4);
    }
}

fn block_q5_0(x: &[f32], y: &mut [u8]) {
    let (max, _) = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, d);
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let x0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
        let x1 = ((x[j + QK / 2] * id + 16.5) as i8).min(31) as u8;
        y[6 + j] = (x0 & 0x0F) | ((x1 & 0x0F) << 4);
        qh |= (((x0 & 0x10) >> 4) as u32) << j;
        qh |= (((x1 & 0x10) >> 4) as u32) << (j + QK / 2);
    }
    y[2..6].copy_from_slice(&qh.to_le_bytes());
}

fn block_q8_0(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, d);
    for (q, &v) in y[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

fn block_q8_k(x: &[f32], y: &mut [u8]) {
    let (max, amax) = signed_absmax(x);
    if amax == 0.0 {
        y.fill(0);
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in y[4..4 + QK_K].iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for j in 0..QK_K / 16 {
        let s: i32 = y[4 + 16 * j..4 + 16 * j + 16]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        let o = 4 + QK_K + 2 * j;
        y[o..o + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    y[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

fn block_q4_k(x: &[f32], y: &mut [u8]) {
    // Per sub-block of 32: y = scale * q - min, q in 0..=15, min >= 0.
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().fold(0.0f32, |m, &v| m.min(v));
        let hi = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
        scales[j] = (hi - lo) / 15.0;
        mins[j] = -lo;
    }
    let max_scale = scales.iter().fold(0.0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0.0f32, |m, &v| m.max(v));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        lm[j] = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
    }
    put_f16(&mut y[0..2], max_scale / 63.0);
    put_f16(&mut y[2..4], max_min / 63.0);
    let sc = &mut y[4..16];
    sc.fill(0);
    for j in 0..8 {
        if j < 4 {
            sc[j] = ls[j];
            sc[j + 4] = lm[j];
        } else {
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            sc[j - 4] |= (ls[j] >> 4) << 6;
            sc[j] |= (lm[j] >> 4) << 6;
        }
    }
    let d = crate::dequant::f16_at(y, 0);
    let dmin = crate::dequant::f16_at(y, 2);
    let mut l = [0u8; QK_K];
    for j in 0..8 {
        let (s, m) = crate::dequant::scale_min_k4(j, &y[4..16]);
        let dd = d * s as f32;
        if dd == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / dd).clamp(0, 15) as u8;
        }
    }
    let qs = &mut y[16..16 + QK_K / 2];
    for c in 0..4 {
        for i in 0..32 {
            qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
}

fn block_q6_k(x: &[f32], y: &mut [u8]) {
    // Per sub-block of 16: symmetric scale so the largest-magnitude value maps to -32.
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for (j, sub) in x.chunks_exact(16).enumerate() {
        let (max, _) = signed_absmax(sub);
        scales[j] = max / -32.0;
        if scales[j].abs() > max_abs_scale {
            max_abs_scale = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut l = [32u8; QK_K];
    if max_abs_scale == 0.0 {
        y.fill(0);
    } else {
        let iscale = -128.0 / max_scale;
        put_f16(&mut y[208..210], 1.0 / iscale);
        let d = crate::dequant::f16_at(y, 208);
        for j in 0..16 {
            let s = nearest_int(iscale * scales[j]).clamp(-128, 127) as i8;
            y[192 + j] = s as u8;
            let dd = d * s as f32;
            if dd == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                l[i] = (nearest_int(x[i] / dd).clamp(-32, 31) + 32) as u8;
            }
        }
    }
    for n in 0..2 {
        let l = &l[128 * n..128 * n + 128];
        for i in 0..32 {
            y[64 * n + i] = (l[i] & 0xF) | ((l[i + 64] & 0xF) << 4);
            y[64 * n + 32 + i] = (l[i + 32] & 0xF) | ((l[i + 96] & 0xF) << 4);
            y[128 + 32 * n + i] = (l[i] >> 4)
                | ((l[i + 32] >> 4) << 2)
                | ((l[i + 64] >> 4) << 4)
                | ((l[i + 96] >> 4) << 6);
        }
    }
}
