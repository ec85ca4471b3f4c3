//! Scalar dequantization of one row, bit-exact with ggml's `dequantize_row_*` reference code.
//!
//! The arithmetic (order of the f32 products) follows ggml exactly, so results equal gguf-py's
//! `gguf.quants.dequantize` bit for bit (checked by the fixture test).

use crate::types::{GgmlType, QK, QK_K};
use crate::QuantError;
use half::{bf16, f16};

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Dequantize one row of `ty` (`src` holds whole blocks) into `dst` (`dst.len()` values).
///
/// Errors when `dst.len()` is not a whole number of blocks, when `src.len()` does not match
/// `ty.row_bytes(dst.len())`, or when `ty` is not supported.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(ty.unsupported("dequantize_row"));
    }
    let expected = ty.row_bytes(dst.len())?;
    QuantError::check_len("dequantize_row src", "bytes", expected, src.len())?;
    crate::dequant_simd::dequantize_fast(crate::Isa::best(), ty, src, dst);
    Ok(())
}

/// Dequantize with sizes already validated (`src.len() == ty.row_bytes(dst.len())`).
pub(crate) fn dequantize_unchecked(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let ts = ty.type_size();
    let bs = ty.block_size();
    match ty {
        GgmlType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        _ => {
            let f = match ty {
                GgmlType::Q4_0 => block_q4_0,
                GgmlType::Q4_1 => block_q4_1,
                GgmlType::Q5_0 => block_q5_0,
                GgmlType::Q5_1 => block_q5_1,
                GgmlType::Q8_0 => block_q8_0,
                GgmlType::Q2_K => block_q2_k,
                GgmlType::Q3_K => block_q3_k,
                GgmlType::Q4_K => block_q4_k,
                GgmlType::Q5_K => block_q5_k,
                GgmlType::Q6_K => block_q6_k,
                GgmlType::Q8_K => block_q8_k,
                GgmlType::IQ4_NL => block_iq4_nl,
                GgmlType::IQ4_XS => block_iq4_xs,
                _ => unreachable!("is_supported checked by callers"),
            };
            for (y, b) in dst.chunks_exact_mut(bs).zip(src.chunks_exact(ts)) {
                f(b, y);
            }
        }
    }
}

/// Q4_0: f16 d, 16 bytes of nibbles; y = d * (q - 8), low nibbles first.
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..2 + QK / 2];
    for j in 0..QK / 2 {
        let x0 = (qs[j] & 0x0F) as i32 - 8;
        let x1 = (qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + QK / 2] = x1 as f32 * d;
    }
}

/// Q5_0: f16 d, u32 qh (5th bits), 16 bytes of nibbles; y = d * (q - 16).
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..6 + QK / 2];
    for j in 0..QK / 2 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0F) | xh0) as i32 - 16;
        let x1 = ((qs[j] >> 4) | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + QK / 2] = x1 as f32 * d;
    }
}

/// Q8_0: f16 d, 32 i8; y = q * d.
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..2 + QK]) {
        *v = (q as i8) as f32 * d;
    }
}

/// Q8_K: f32 d, 256 i8, 16 i16 block sums (ignored here); y = d * q.
fn block_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (v, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
        *v = d * (q as i8) as f32;
    }
}

/// Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K: returns (scale, min) of sub-block `j`.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes scales/mins, 128 bytes nibbles; 8 sub-blocks of 32.
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..16 + QK_K / 2];
    for (c, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc, m) = scale_min_k4(2 * c, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(2 * c + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q6_K: 128 bytes low nibbles, 64 bytes high 2-bits, 16 i8 scales, f16 d; 16 sub-blocks of 16.
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, QK_K / 2 + QK_K / 4 + QK_K / 16);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Q4_1: f16 d, f16 m, 16 bytes of nibbles; y = q * d + m, low nibbles first.
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..4 + QK / 2];
    for j in 0..QK / 2 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + QK / 2] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q5_1: f16 d, f16 m, u32 qh (5th bits), 16 bytes of nibbles; y = q * d + m.
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..8 + QK / 2];
    for j in 0..QK / 2 {
        let x0 = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
        let x1 = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        y[j] = x0 as f32 * d + m;
        y[j + QK / 2] = x1 as f32 * d + m;
    }
}

/// The 2-bit value of element `e` (0..256) of a Q2_K/Q3_K `qs` (64 bytes): byte `32 * (e / 128)
/// + e % 32`, bits `2 * ((e % 128) / 32)`.
#[inline(always)]
pub(crate) fn q2_at(qs: &[u8], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

/// Q2_K: 16 bytes scales (low nibble scale, high nibble min), 64 bytes of 2-bit values, f16 d,
/// f16 dmin; 16 sub-blocks of 16; y = (d * sc) * q - dmin * m.
fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let (sc, qs) = (&b[..16], &b[16..80]);
    for (j, y) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * (sc[j] & 0xF) as f32;
        let ml = dmin * (sc[j] >> 4) as f32;
        for (l, v) in y.iter_mut().enumerate() {
            *v = dl * q2_at(qs, 16 * j + l) as f32 - ml;
        }
    }
}

/// The 16 signed 6-bit scales of Q3_K (`s` = its 12 scale bytes), already minus 32. Scale `j`
/// has its low 4 bits in byte `j % 8` (low nibble for j < 8, high nibble after) and its high 2
/// bits in byte `8 + j % 4` at bit `2 * (j / 4)`; unpacked four at a time in u32 lanes.
#[inline(always)]
pub(crate) fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let a0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let a1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let t = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let r = [
        (a0 & K2) | ((t & K1) << 4),
        (a1 & K2) | (((t >> 2) & K1) << 4),
        ((a0 >> 4) & K2) | (((t >> 4) & K1) << 4),
        ((a1 >> 4) & K2) | (((t >> 6) & K1) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(r) {
        for (v, b) in o.iter_mut().zip(w.to_le_bytes()) {
            *v = b as i8 - 32;
        }
    }
    out
}

/// Q3_K: 32 bytes high-bit mask, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, f16 d; 16
/// sub-blocks of 16; y = (d * (sc - 32)) * (q2 - (high bit clear ? 4 : 0)).
fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let (hm, qs) = (&b[..32], &b[32..96]);
    let sc = q3_k_scales(&b[96..108]);
    for (j, y) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * sc[j] as f32;
        for (l, v) in y.iter_mut().enumerate() {
            let e = 16 * j + l;
            let h = (hm[e % 32] >> (e / 32)) & 1;
            let q = q2_at(qs, e) as i32 - if h == 0 { 4 } else { 0 };
            *v = dl * q as f32;
        }
    }
}

/// Q5_K: f16 d, f16 dmin, 12 bytes scales/mins (as Q4_K), 32 bytes of 5th bits, 128 bytes of
/// nibbles; 8 sub-blocks of 32; y = (d * sc) * q - dmin * m.
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (g, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(g, scales);
        let (dl, ml) = (d * sc as f32, min * m as f32);
        let q = &qs[32 * (g / 2)..32 * (g / 2) + 32];
        let shift = 4 * (g % 2);
        for l in 0..32 {
            let v = ((q[l] >> shift) & 0xF) | (((qh[l] >> g) & 1) << 4);
            y[l] = dl * v as f32 - ml;
        }
    }
}

/// The 16 non-linear levels of IQ4_NL / IQ4_XS.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// IQ4_NL: f16 d, 16 bytes of nibble indices into `KVALUES_IQ4NL`; y = d * kv[q].
fn block_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
    }
}

/// The 6-bit scale (0..63, biased by 32) of IQ4_XS sub-block `ib` (0..8); `b` is the block.
#[inline(always)]
pub(crate) fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let sh = u16::from_le_bytes([b[2], b[3]]);
    let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    let hi = ((sh >> (2 * ib)) & 3) as u8;
    (lo | (hi << 4)) as i32 - 32
}

/// IQ4_XS: f16 d, u16 high scale bits, 4 bytes low scale nibbles, 128 bytes of nibble indices;
/// 8 sub-blocks of 32 (16 bytes each, low nibbles first); y = (d * (ls - 32)) * kv[q].
fn block_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (ib, y) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * iq4_xs_scale(b, ib) as f32;
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        for (j, &q) in qs.iter().enumerate() {
            y[j] = dl * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
            y[j + 16] = dl * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
        }
    }
}
