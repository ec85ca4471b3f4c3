//! Attention-score helpers shared by the scoring baselines (H2O, SnapKV, PyramidKV, FastKV):
//! softmax column sums of captured logits per kv head, 1-D max pooling, top-k, SnapKV-style
//! keep sets (the dense read of whatever a layer holds is `policy::dense_segments`).
use crate::policy::AttnCall;
use crate::store::{CacheElem, KvStore};

/// Keys each kv head attends in a dense read of `call` (what `attend_layer` captured logits
/// over): `hi - lo`, or the held slots of a compacted layer.
pub fn keys_per_head<T: CacheElem>(call: &AttnCall, store: &KvStore<T>) -> Vec<usize> {
    (0..store.n_kv_heads)
        .map(|h| {
            store
                .segments(call.layer, h, call.lo, call.hi())
                .iter()
                .map(|s| s.len(store.head_dim))
                .sum()
        })
        .collect()
}

/// Softmax probabilities of captured logits (`[n_heads, rows, keys_h]` blocks, see
/// `KvPolicy::observe`), summed over the rows, added per query head into `acc[hq]` (resized
/// to the kv head's key count). -inf (masked) keys get 0.
pub fn accumulate_probs(logits: &[f32], rows: usize, keys: &[usize], acc: &mut Vec<Vec<f32>>) {
    let per_group: usize = keys.iter().sum::<usize>() * rows;
    let group = logits.len().checked_div(per_group).unwrap_or(0);
    let n_heads = group * keys.len();
    acc.resize_with(n_heads, Vec::new);
    let mut off = 0;
    for (hq, a) in acc.iter_mut().enumerate() {
        let n = keys[hq / group.max(1)];
        if a.len() < n {
            a.resize(n, 0.0);
        }
        for r in 0..rows {
            let row = &logits[off + r * n..off + (r + 1) * n];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            if max == f32::NEG_INFINITY {
                continue;
            }
            let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
            let inv = 1.0 / sum;
            for (s, &x) in a.iter_mut().zip(row) {
                *s += (x - max).exp() * inv;
            }
        }
        off += rows * n;
    }
}

/// Sum the per-query-head scores of each GQA group into per-kv-head scores.
pub fn group_sum(per_q: &[Vec<f32>], n_kv: usize) -> Vec<Vec<f32>> {
    let group = per_q.len() / n_kv.max(1);
    (0..n_kv)
        .map(|h| {
            let heads = &per_q[h * group..(h + 1) * group];
            let n = heads.iter().map(Vec::len).max().unwrap_or(0);
            let mut s = vec![0.0f32; n];
            for hs in heads {
                for (o, &x) in s.iter_mut().zip(hs) {
                    *o += x;
                }
            }
            s
        })
        .collect()
}

/// 1-D max pooling with an odd `kernel`, stride 1, padding `kernel / 2` (the output has the
/// input's length).
pub fn max_pool(x: &[f32], kernel: usize) -> Vec<f32> {
    let r = kernel / 2;
    (0..x.len())
        .map(|i| {
            x[i.saturating_sub(r)..(i + r + 1).min(x.len())]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
        })
        .collect()
}

/// Indices of the `k` largest scores (ties: lower index first), in no particular order.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx
}

/// SnapKV's keep set over `n` tokens (slot = position): the last `window` tokens plus the
/// top `capacity - window` of the max-pooled (`kernel`) per-query-head scores summed over
/// the GQA group. `per_q[g]` holds the scores of the group's query heads (`len >= n`).
/// Everything when `n <= capacity`.
pub fn snap_keep(
    per_q: &[&[f32]],
    n: usize,
    window: usize,
    capacity: usize,
    kernel: usize,
) -> Vec<usize> {
    if n <= capacity {
        return (0..n).collect();
    }
    let w = window.min(capacity).min(n);
    let prefix = n - w;
    let mut s = vec![0.0f32; prefix];
    for q in per_q {
        for (o, x) in s.iter_mut().zip(max_pool(&q[..prefix], kernel)) {
            *o += x;
        }
    }
    let mut keep = top_k(&s, capacity - w);
    keep.extend(prefix..n);
    keep.sort_unstable();
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_sum_to_rows_and_respect_masks() {
        // 2 query heads, 1 kv head, 2 rows, 3 keys; the first row cannot see key 2.
        let ninf = f32::NEG_INFINITY;
        let logits = [0.0, 0.0, ninf, 1.0, 2.0, 3.0, 5.0, 0.0, ninf, 0.0, 0.0, 0.0];
        let mut acc = Vec::new();
        accumulate_probs(&logits, 2, &[3], &mut acc);
        assert_eq!(acc.len(), 2);
        assert!((acc[0].iter().sum::<f32>() - 2.0).abs() < 1e-6);
        assert!((acc[0][0] - (0.5 + 1.0 / (1.0 + 1f32.exp() + 2f32.exp()))).abs() < 1e-6);
        assert!((acc[1][2] - 1.0 / 3.0).abs() < 1e-6);
        let g = group_sum(&acc, 1);
        assert!((g[0].iter().sum::<f32>() - 4.0).abs() < 1e-5);
    }

    #[test]
    fn pooling_and_top_k() {
        assert_eq!(
            max_pool(&[0.0, 5.0, 0.0, 0.0, 0.0, 1.0], 3),
            vec![5.0, 5.0, 5.0, 0.0, 1.0, 1.0]
        );
        let mut t = top_k(&[0.1, 0.9, 0.5, 0.9, 0.0], 3);
        t.sort();
        assert_eq!(t, vec![1, 2, 3]);
        assert!(top_k(&[1.0], 0).is_empty());
    }

    #[test]
    fn snap_keep_takes_window_and_pooled_peaks() {
        let mut s = vec![0.0f32; 40];
        s[10] = 1.0;
        s[30] = 0.5;
        s[38] = 9.0; // inside the window: kept anyway, not counted as a pick
        let keep = snap_keep(&[&s], 40, 4, 6, 1);
        assert_eq!(keep, vec![10, 30, 36, 37, 38, 39]);
        // kernel 3 pools the peak onto its neighbours: the two picks are the first ties
        let keep = snap_keep(&[&s], 40, 4, 6, 3);
        assert_eq!(keep, vec![9, 10, 36, 37, 38, 39]);
        assert_eq!(snap_keep(&[&s], 40, 4, 40, 7), (0..40).collect::<Vec<_>>());
    }
}
