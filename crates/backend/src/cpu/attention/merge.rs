//! Exact log-sum-exp merging of partial attention results computed over disjoint key sets.

use super::types::AttnError;

/// Merges the partial result `(out_b, lse_b)` into `(out_a, lse_a)`, in place, exactly:
/// `out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`, `lse = ln(e^{lse_a} + e^{lse_b})`.
/// `out_*`: [rows, head_dim]; `lse_*`: [rows]. A row with lse = -inf (no visible key) is empty.
pub fn merge_partials(
    out_a: &mut [f32],
    lse_a: &mut [f32],
    out_b: &[f32],
    lse_b: &[f32],
    head_dim: usize,
) -> Result<(), AttnError> {
    let rows = lse_a.len();
    let checks = [
        ("lse_b [rows]", rows, lse_b.len()),
        ("out_a [rows, head_dim]", rows * head_dim, out_a.len()),
        ("out_b [rows, head_dim]", rows * head_dim, out_b.len()),
    ];
    for (what, expected, got) in checks {
        if expected != got {
            return Err(AttnError::Length {
                what,
                expected,
                got,
            });
        }
    }
    for r in 0..rows {
        let (oa, ob) = (
            &mut out_a[r * head_dim..(r + 1) * head_dim],
            &out_b[r * head_dim..(r + 1) * head_dim],
        );
        lse_a[r] = merge_row(oa, lse_a[r], &[(ob, lse_b[r])]);
    }
    Ok(())
}

/// Merges partial rows `parts` (each `(out, lse)`) into `acc` (itself a partial with `lse_acc`);
/// returns the merged lse. Used for split-KV decode and by `merge_partials`.
pub(crate) fn merge_row(acc: &mut [f32], lse_acc: f32, parts: &[(&[f32], f32)]) -> f32 {
    let mx = parts.iter().fold(lse_acc, |m, &(_, l)| m.max(l));
    if mx == f32::NEG_INFINITY {
        acc.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let w0 = (lse_acc - mx).exp();
    let mut total = w0;
    for x in acc.iter_mut() {
        *x *= w0;
    }
    for &(o, l) in parts {
        let w = (l - mx).exp();
        if w == 0.0 {
            continue;
        }
        total += w;
        for (x, &y) in acc.iter_mut().zip(o) {
            *x += w * y;
        }
    }
    let inv = 1.0 / total;
    for x in acc.iter_mut() {
        *x *= inv;
    }
    mx + total.ln()
}
