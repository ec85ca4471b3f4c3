//! Portable dot kernels: the same integer block sums as the SIMD kernels, in plain Rust.

use crate::activation::ActRef;
use crate::dequant::{f16_at, iq4_xs_scale, q2_at, q3_k_scales, KVALUES_IQ4NL};
use crate::types::{GgmlType, QK, QK_K};
use half::{bf16, f16};

pub(super) fn dot(ty: GgmlType, row: &[u8], x: &[f32], a: ActRef<'_>) -> f32 {
    match ty {
        GgmlType::F32 => row
            .chunks_exact(4)
            .zip(x)
            .map(|(b, &v)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * v)
            .sum(),
        GgmlType::F16 => row
            .chunks_exact(2)
            .zip(x)
            .map(|(b, &v)| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() * v)
            .sum(),
        GgmlType::BF16 => row
            .chunks_exact(2)
            .zip(x)
            .map(|(b, &v)| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() * v)
            .sum(),
        GgmlType::Q8_0 => q8_0(row, a),
        GgmlType::Q5_0 => q5_0(row, a),
        GgmlType::Q4_0 => q4_0(row, a),
        GgmlType::Q4_K => q4_k(row, a),
        GgmlType::Q6_K => q6_k(row, a),
        GgmlType::Q4_1 => q4_1(row, a),
        GgmlType::Q5_1 => q5_1(row, a),
        GgmlType::IQ4_NL => iq4_nl(row, a),
        GgmlType::Q2_K => q2_k(row, a),
        GgmlType::Q3_K => q3_k(row, a),
        GgmlType::Q5_K => q5_k(row, a),
        GgmlType::IQ4_XS => iq4_xs(row, a),
        _ => unreachable!("has_dot checked by callers"),
    }
}

/// Dot products of consecutive rows (`rb` bytes each) with one activation.
pub(super) fn dot_rows(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    x: &[f32],
    a: ActRef<'_>,
    out: &mut [f32],
) {
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(rb)) {
        *o = dot(ty, row, x, a);
    }
}

fn q8_0(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(2 + QK).enumerate() {
        let xq = &a.qs[b * QK..b * QK + QK];
        let s: i32 = blk[2..]
            .iter()
            .zip(xq)
            .map(|(&w, &x)| (w as i8 as i32) * x as i32)
            .sum();
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

/// Q4_0 / Q5_0: sum of unsigned q * x, minus `offset` * sum(x).
fn q4_0(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(2 + QK / 2).enumerate() {
        let xq = &a.qs[b * QK..b * QK + QK];
        let mut s = 0i32;
        for j in 0..QK / 2 {
            s += (blk[2 + j] & 0xF) as i32 * xq[j] as i32;
            s += (blk[2 + j] >> 4) as i32 * xq[j + QK / 2] as i32;
        }
        s -= 8 * a.sums[b] as i32;
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

fn q5_0(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(6 + QK / 2).enumerate() {
        let xq = &a.qs[b * QK..b * QK + QK];
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let mut s = 0i32;
        for j in 0..QK / 2 {
            let lo = (blk[6 + j] & 0xF) as u32 | (((qh >> j) & 1) << 4);
            let hi = (blk[6 + j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            s += lo as i32 * xq[j] as i32 + hi as i32 * xq[j + QK / 2] as i32;
        }
        s -= 16 * a.sums[b] as i32;
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

fn q4_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(144).enumerate() {
        let xq = &a.qs[b * QK_K..b * QK_K + QK_K];
        let bs = &a.sums[b * 16..b * 16 + 16];
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = crate::dequant::scale_min_k4(j, &blk[4..16]);
            let q = &blk[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let s: i32 = (0..32)
                .map(|l| ((q[l] >> shift) & 0xF) as i32 * xq[32 * j + l] as i32)
                .sum();
            sumi += sc as i32 * s;
            summ += m as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        let d = a.d[b];
        acc += f16_at(blk, 0) * d * sumi as f32 - f16_at(blk, 2) * d * summ as f32;
    }
    acc
}

fn q6_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(210).enumerate() {
        let xq = &a.qs[b * QK_K..b * QK_K + QK_K];
        let bs = &a.sums[b * 16..b * 16 + 16];
        let mut q = [0u8; QK_K];
        for n in 0..2 {
            let (ql, qh) = (&blk[64 * n..64 * n + 64], &blk[128 + 32 * n..160 + 32 * n]);
            for l in 0..32 {
                q[128 * n + l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                q[128 * n + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                q[128 * n + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                q[128 * n + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        let mut sumi = 0i32;
        for j in 0..16 {
            let sc = blk[192 + j] as i8 as i32;
            let s: i32 = (16 * j..16 * j + 16)
                .map(|i| q[i] as i32 * xq[i] as i32)
                .sum();
            sumi += sc * (s - 32 * bs[j] as i32);
        }
        acc += f16_at(blk, 208) * a.d[b] * sumi as f32;
    }
    acc
}

/// Q4_1: d * dx * sum(q * x) + m * dx * sum(x) (unsigned q; the min times the activation sum).
fn q4_1(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(4 + QK / 2).enumerate() {
        let xq = &a.qs[b * QK..b * QK + QK];
        let mut s = 0i32;
        for j in 0..QK / 2 {
            s += (blk[4 + j] & 0xF) as i32 * xq[j] as i32;
            s += (blk[4 + j] >> 4) as i32 * xq[j + QK / 2] as i32;
        }
        let dx = a.d[b];
        acc += f16_at(blk, 0) * dx * s as f32 + f16_at(blk, 2) * dx * a.sums[b] as f32;
    }
    acc
}

fn q5_1(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(8 + QK / 2).enumerate() {
        let xq = &a.qs[b * QK..b * QK + QK];
        let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
        let mut s = 0i32;
        for j in 0..QK / 2 {
            let lo = (blk[8 + j] & 0xF) as u32 | (((qh >> j) & 1) << 4);
            let hi = (blk[8 + j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            s += lo as i32 * xq[j] as i32 + hi as i32 * xq[j + QK / 2] as i32;
        }
        let dx = a.d[b];
        acc += f16_at(blk, 0) * dx * s as f32 + f16_at(blk, 2) * dx * a.sums[b] as f32;
    }
    acc
}

fn iq4_nl(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(2 + QK / 2).enumerate() {
        let xq = &a.qs[b * QK..b * QK + QK];
        let mut s = 0i32;
        for j in 0..QK / 2 {
            s += KVALUES_IQ4NL[(blk[2 + j] & 0xF) as usize] as i32 * xq[j] as i32;
            s += KVALUES_IQ4NL[(blk[2 + j] >> 4) as usize] as i32 * xq[j + QK / 2] as i32;
        }
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

/// Q2_K: d * dx * sum_j sc_j * sum(q * x) - dmin * dx * sum_j m_j * bsums_j (16-value groups).
fn q2_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(84).enumerate() {
        let xq = &a.qs[b * QK_K..b * QK_K + QK_K];
        let bs = &a.sums[b * 16..b * 16 + 16];
        let (sc, qs) = (&blk[..16], &blk[16..80]);
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..16 {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|e| q2_at(qs, e) as i32 * xq[e] as i32)
                .sum();
            sumi += (sc[j] & 0xF) as i32 * s;
            summ += (sc[j] >> 4) as i32 * bs[j] as i32;
        }
        let d = a.d[b];
        acc += f16_at(blk, 80) * d * sumi as f32 - f16_at(blk, 82) * d * summ as f32;
    }
    acc
}

/// Q3_K: unsigned q = q2 | high bit << 2 (0..7), value q - 4, so each 16-value group contributes
/// sc_j * (sum(q * x) - 4 * bsums_j).
fn q3_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(110).enumerate() {
        let xq = &a.qs[b * QK_K..b * QK_K + QK_K];
        let bs = &a.sums[b * 16..b * 16 + 16];
        let (hm, qs) = (&blk[..32], &blk[32..96]);
        let sc = q3_k_scales(&blk[96..108]);
        let mut sumi = 0i32;
        for j in 0..16 {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|e| {
                    let q = q2_at(qs, e) | (((hm[e % 32] >> (e / 32)) & 1) << 2);
                    q as i32 * xq[e] as i32
                })
                .sum();
            sumi += sc[j] as i32 * (s - 4 * bs[j] as i32);
        }
        acc += f16_at(blk, 108) * a.d[b] * sumi as f32;
    }
    acc
}

fn q5_k(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(176).enumerate() {
        let xq = &a.qs[b * QK_K..b * QK_K + QK_K];
        let bs = &a.sums[b * 16..b * 16 + 16];
        let qh = &blk[16..48];
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = crate::dequant::scale_min_k4(j, &blk[4..16]);
            let q = &blk[48 + 32 * (j / 2)..48 + 32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let s: i32 = (0..32)
                .map(|l| {
                    let v = ((q[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4);
                    v as i32 * xq[32 * j + l] as i32
                })
                .sum();
            sumi += sc as i32 * s;
            summ += m as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        let d = a.d[b];
        acc += f16_at(blk, 0) * d * sumi as f32 - f16_at(blk, 2) * d * summ as f32;
    }
    acc
}

fn iq4_xs(row: &[u8], a: ActRef<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(136).enumerate() {
        let xq = &a.qs[b * QK_K..b * QK_K + QK_K];
        let mut sumi = 0i32;
        for ib in 0..8 {
            let qs = &blk[8 + 16 * ib..8 + 16 * ib + 16];
            let x = &xq[32 * ib..32 * ib + 32];
            let mut s = 0i32;
            for j in 0..16 {
                s += KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as i32 * x[j] as i32;
                s += KVALUES_IQ4NL[(qs[j] >> 4) as usize] as i32 * x[j + 16] as i32;
            }
            sumi += iq4_xs_scale(blk, ib) * s;
        }
        acc += f16_at(blk, 0) * a.d[b] * sumi as f32;
    }
    acc
}
