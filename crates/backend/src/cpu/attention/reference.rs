//! Naive reference attention in f64: materialises every score, obviously correct, slow.
//! The fast kernels are tested against it.

use super::elem::KvElem;
use super::types::{total_keys, validate, AttnError, AttnShape, KvSource, Mask, QueryPositions};

/// Same contract as [`super::attention_with_logits`] (logits optional), computed in f64.
#[allow(clippy::too_many_arguments)]
pub fn attention_reference<'s, T: KvElem, K: KvSource<'s, T> + ?Sized>(
    shape: &AttnShape,
    q: &[f32],
    q_pos: QueryPositions,
    kv: &K,
    mask: Mask,
    out: &mut [f32],
    mut lse: Option<&mut [f32]>,
    mut logits: Option<&mut [f32]>,
) -> Result<(), AttnError> {
    let geo = validate(
        shape,
        q,
        q_pos,
        kv,
        out.len(),
        lse.as_ref().map(|l| l.len()),
    )?;
    let (n_q, h, g, d) = (geo.n_q, geo.n_heads, geo.group, geo.d);
    if let Some(lg) = logits.as_ref() {
        let expected = super::logits_len(shape, n_q, kv);
        if lg.len() != expected {
            return Err(AttnError::Length {
                what: "logits",
                expected,
                got: lg.len(),
            });
        }
    }
    let mut logit_base = 0;
    for hq in 0..h {
        let segs = kv.segments(hq / g);
        let total = total_keys(segs, d);
        for i in 0..n_q {
            let p = q_pos.at(i);
            let qrow = &q[(i * h + hq) * d..][..d];
            // (score, key row index inside its segment, segment)
            let mut scores: Vec<(f64, usize, usize)> = Vec::with_capacity(total);
            for (si, seg) in segs.iter().enumerate() {
                for j in 0..seg.len(d) {
                    let s = if mask.visible(p, seg.pos.at(j)) {
                        let k = &seg.k[j * d..][..d];
                        let dot: f64 = qrow
                            .iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b.to_f32() as f64)
                            .sum();
                        dot * shape.scale as f64
                    } else {
                        f64::NEG_INFINITY
                    };
                    scores.push((s, j, si));
                }
            }
            if let Some(lg) = logits.as_deref_mut() {
                for (j, &(s, _, _)) in scores.iter().enumerate() {
                    lg[logit_base + i * total + j] = s as f32;
                }
            }
            let mx = scores.iter().fold(f64::NEG_INFINITY, |m, s| m.max(s.0));
            let orow = &mut out[(i * h + hq) * d..][..d];
            let lse_v = if mx == f64::NEG_INFINITY {
                orow.fill(0.0);
                f64::NEG_INFINITY
            } else {
                let mut acc = vec![0.0f64; d];
                let mut sum = 0.0f64;
                for &(s, j, si) in &scores {
                    let w = (s - mx).exp();
                    sum += w;
                    for (a, v) in acc.iter_mut().zip(&segs[si].v[j * d..][..d]) {
                        *a += w * v.to_f32() as f64;
                    }
                }
                for (o, a) in orow.iter_mut().zip(&acc) {
                    *o = (a / sum) as f32;
                }
                mx + sum.ln()
            };
            if let Some(l) = lse.as_deref_mut() {
                l[i * h + hq] = lse_v as f32;
            }
        }
        logit_base += n_q * total;
    }
    Ok(())
}
