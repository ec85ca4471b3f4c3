//! SnapKV's selection on the GPU (`CudaContext::snap_select`, kernels/snapkv.cu) against the
//! CPU policy's arithmetic (`slowfast_kv::score`: accumulate_probs, max_pool, snap_keep) on
//! fresh random captured logits: the scores agree to float rounding and the kept sets agree up
//! to near-ties.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use slowfast_cuda::ops::snapkv::{SnapArgs, SnapScratch};
use slowfast_kv::score::{accumulate_probs, max_pool, snap_keep};

#[test]
fn snap_select_matches_cpu() {
    let Some(ctx) = gpu("snap_select_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(0x5a4b);
    // (query heads, kv heads, prompt length L, window, kept k a kv head, pooling kernel)
    let cases = [
        (8, 2, 3000, 32, 500, 7),
        (4, 4, 1000, 8, 100, 1),
        (32, 8, 20000, 32, 2000, 7),
        (2, 1, 300, 32, 400, 7), // k above the prefix: every key is kept
        (16, 2, 5000, 16, 37, 3),
    ];
    for (case, &(nh, nkv, len, w, k, kernel)) in cases.iter().enumerate() {
        let group = nh / nkv;
        let prefix = len - w;
        let lstride = len + 5;
        // Captured rows r = 0..w see keys j < len - w + 1 + r; past that the buffer holds garbage
        // (the capture writes only what a row sees).
        let len0 = len - w + 1;
        let mut logits = vec![f32::NAN; w * nh * lstride];
        // Peaks a head shares across rows (what a window looks at), on noise.
        let peaks: Vec<Vec<usize>> = (0..nh)
            .map(|_| (0..8).map(|_| rng.below(prefix)).collect())
            .collect();
        for r in 0..w {
            for h in 0..nh {
                let row = &mut logits[(r * nh + h) * lstride..][..len0 + r];
                for x in row.iter_mut() {
                    *x = rng.normal(2.0);
                }
                for &p in &peaks[h] {
                    row[p] += 6.0 + rng.uniform();
                }
            }
        }
        let dev = ctx.upload(&logits).unwrap();
        let mut sc = SnapScratch::new(&ctx, w, nh, nkv, prefix, k).unwrap();
        let a = SnapArgs {
            logits: dev.device_ptr(),
            lstride,
            rows: w,
            len0,
            n: prefix,
            k,
            kernel,
            lo: 0,
        };
        ctx.snap_select(&a, &mut sc).unwrap();
        let picks = sc.download(&ctx).unwrap();
        let gpu_scores = sc.scores(&ctx, prefix).unwrap();

        // The CPU: natural-unit logits `[n_heads, rows, len]`, -inf past each row's keys.
        let ln2 = std::f32::consts::LN_2;
        let mut cpu_logits = vec![f32::NEG_INFINITY; nh * w * len];
        for h in 0..nh {
            for r in 0..w {
                for j in 0..len0 + r {
                    cpu_logits[(h * w + r) * len + j] = logits[(r * nh + h) * lstride + j] * ln2;
                }
            }
        }
        let mut per_q = Vec::new();
        accumulate_probs(&cpu_logits, w, &vec![len; nkv], &mut per_q);
        for kvh in 0..nkv {
            let heads: Vec<&[f32]> = per_q[kvh * group..(kvh + 1) * group]
                .iter()
                .map(|v| v.as_slice())
                .collect();
            let mut cpu_s = vec![0.0f32; prefix];
            for q in &heads {
                for (o, x) in cpu_s.iter_mut().zip(max_pool(&q[..prefix], kernel)) {
                    *o += x;
                }
            }
            let what = format!("case {case} kv head {kvh}");
            let top = cpu_s.iter().fold(0.0f32, |m, &x| m.max(x)) as f64;
            let worst = gpu_scores[kvh]
                .iter()
                .zip(&cpu_s)
                .map(|(&g, &c)| (g - c as f64).abs())
                .fold(0.0, f64::max);
            assert!(
                worst <= 1e-5 * top.max(1.0),
                "{what}: scores differ by {worst} (largest score {top})"
            );
            // The CPU's keep set (window excluded) against the GPU's picks.
            let keep: Vec<u32> = snap_keep(&heads, len, w, k + w, kernel)
                .into_iter()
                .filter(|&p| p < prefix)
                .map(|p| p as u32)
                .collect();
            let got = &picks[kvh];
            assert_eq!(got.len(), k.min(prefix), "{what}: count");
            assert!(
                got.windows(2).all(|p| p[0] < p[1]) && got.iter().all(|&p| (p as usize) < prefix),
                "{what}: picks not ascending or past the prefix"
            );
            let mut sorted = cpu_s.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let threshold = sorted[k.min(prefix) - 1] as f64;
            let a: std::collections::BTreeSet<u32> = got.iter().copied().collect();
            let b: std::collections::BTreeSet<u32> = keep.iter().copied().collect();
            let differ: Vec<u32> = a.symmetric_difference(&b).copied().collect();
            for &p in &differ {
                let gap = (cpu_s[p as usize] as f64 - threshold).abs();
                assert!(
                    gap <= 2e-5 * top.max(1.0),
                    "{what}: position {p} (score {}) differs by more than a near-tie of the threshold {threshold}",
                    cpu_s[p as usize]
                );
            }
            println!(
                "{what}: {} kept of {prefix}, {} differ (near-ties), worst score error {worst:.2e}",
                got.len(),
                differ.len()
            );
        }
    }
}

/// Candidates after the first keys (`lo > 0`, the oracle's SFI layout): one captured row, no
/// pooling. The scores of keys `lo .. lo + n` equal those of a selection from 0 (the softmax
/// still runs over every key the row sees), and the picks are positions, the top `k` of them.
#[test]
fn snap_select_from_an_offset_scores_the_same_keys() {
    let Some(ctx) = gpu("snap_select_from_an_offset_scores_the_same_keys") else {
        return;
    };
    let mut rng = Rng::new(0x0a1e);
    let (nh, nkv, len, lo, k) = (16, 4, 3000, 4, 300);
    let n = len - 64 - lo; // a recent window of 64 after the candidates
    let lstride = len + 3;
    let mut logits = vec![f32::NAN; nh * lstride];
    for h in 0..nh {
        for x in &mut logits[h * lstride..h * lstride + len] {
            *x = rng.normal(2.0);
        }
    }
    let dev = ctx.upload(&logits).unwrap();
    let mut from0 = SnapScratch::new(&ctx, 1, nh, nkv, len, k).unwrap();
    let mut off = SnapScratch::new(&ctx, 1, nh, nkv, len, k).unwrap();
    let base = SnapArgs {
        logits: dev.device_ptr(),
        lstride,
        rows: 1,
        len0: len,
        n: lo + n,
        k,
        kernel: 1,
        lo: 0,
    };
    ctx.snap_select(&base, &mut from0).unwrap();
    ctx.snap_select(&SnapArgs { n, lo, ..base }, &mut off)
        .unwrap();
    let (all, part) = (
        from0.scores(&ctx, lo + n).unwrap(),
        off.scores(&ctx, n).unwrap(),
    );
    let picks = off.download(&ctx).unwrap();
    for kvh in 0..nkv {
        assert_eq!(&all[kvh][lo..], &part[kvh][..], "kv head {kvh}: scores");
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| part[kvh][b].total_cmp(&part[kvh][a]).then(a.cmp(&b)));
        let mut want: Vec<u32> = order[..k].iter().map(|&j| (j + lo) as u32).collect();
        want.sort_unstable();
        assert_eq!(
            picks[kvh], want,
            "kv head {kvh}: the top {k} positions from {lo}"
        );
    }
    assert!(
        ctx.snap_select(&SnapArgs { n: len, lo, ..base }, &mut off)
            .is_err(),
        "candidates past what the row sees are refused"
    );
}
