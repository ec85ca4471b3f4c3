//! Quest on the GPU (`CudaContext::quest_bounds` / `quest_select`, kernels/quest.cu) against the
//! CPU policy's arithmetic (`slowfast_kv::quest::PageBounds`, `slowfast_kv::score::top_k`) on
//! fresh random caches and queries: page scores agree to float rounding, the chosen pages agree
//! up to near-ties, and the sparse decode kernel reading those pages in place through its page
//! list matches an f64 reference over the same keys.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

mod common;

use std::collections::BTreeSet;

use common::*;
use slowfast_cuda::ops::quest::{QuestArgs, QuestPages, QuestScratch, QUEST_FRESH};
use slowfast_cuda::ops::sfi::SparseDecode;
use slowfast_cuda::{AttnWorkspace, KvLayout};
use slowfast_kv::quest::PageBounds;
use slowfast_kv::score::top_k;

#[test]
fn quest_pages_match_cpu_and_decode_reads_them() {
    let Some(ctx) = gpu("quest_pages_match_cpu_and_decode_reads_them") else {
        return;
    };
    let mut rng = Rng::new(0x9e57);
    // (head dim, query heads, kv heads, pages read a step, lengths of the batch)
    // (the last: more full pages than the top-k holds in shared memory, 8192)
    let cases: [(usize, usize, usize, usize, &[usize]); 4] = [
        (128, 16, 4, 40, &[3000, 1201, 640]),
        (64, 4, 4, 3, &[999, 17, 48]),
        (256, 8, 1, 100, &[5000, 1600]),
        (64, 2, 1, 300, &[140_001]),
    ];
    let page = 16;
    for (case, &(d, nh, nkv, pages, lens)) in cases.iter().enumerate() {
        let batch = lens.len();
        let g = nh / nkv;
        let kv = KvLayout {
            num_slots: batch,
            kv_heads: nkv,
            capacity: lens.iter().max().unwrap() + 200,
            head_dim: d,
            fp8: false,
        };
        let pg = QuestPages::new(kv, page).unwrap();
        let slot_lens: Vec<(usize, usize)> = lens.iter().copied().enumerate().collect();
        let kc = fill_cache(&mut rng, &kv, &slot_lens);
        let vc = fill_cache(&mut rng, &kv, &slot_lens);
        let (dk, dv) = (ctx.upload(&kc).unwrap(), ctx.upload(&vc).unwrap());
        let kptrs = ctx.upload(&[dk.device_ptr()]).unwrap();
        let bounds = ctx
            .upload(&vec![slowfast_cuda::bf16::NAN; pg.layer_elems(kv)])
            .unwrap();
        // Bounds after a "prefill" of all but the last few full pages: the decode step's
        // `fresh` pages must fill in the rest.
        for (s, &len) in lens.iter().enumerate() {
            let nfull = (len - 1) / page;
            let upto = nfull.saturating_sub(QUEST_FRESH - 1);
            ctx.quest_bounds(
                kv,
                pg,
                kptrs.device_ptr(),
                1,
                bounds.device_ptr(),
                s,
                (0, upto),
            )
            .unwrap();
        }
        let q = rng.vec_bf16(batch * nh * d, 1.0);
        let dq = ctx.upload(&q).unwrap();
        let dl = ctx
            .upload(&lens.iter().map(|&l| l as u32).collect::<Vec<_>>())
            .unwrap();
        let dslots = ctx.upload(&(0..batch as u32).collect::<Vec<_>>()).unwrap();
        let sc = QuestScratch::new(&ctx, batch, nkv, pg.maxp, pages - 1).unwrap();
        let a = QuestArgs {
            q: dq.device_ptr(),
            k_cache: dk.device_ptr(),
            bounds: bounds.device_ptr(),
            seq_lens: dl.device_ptr(),
            slots: dslots.device_ptr(),
            batch,
            n_heads: nh,
            fresh: QUEST_FRESH,
        };
        ctx.quest_select(kv, pg, &a, &sc).unwrap();
        let picks = sc.download(&ctx).unwrap();
        let gpu_scores = sc.scores(&ctx).unwrap();

        for (b, &len) in lens.iter().enumerate() {
            let nfull = (len - 1) / page;
            for h in 0..nkv {
                let what = format!("case {case} sequence {b} kv head {h}");
                let base = (b * nkv + h) * kv.capacity * d;
                let keys: Vec<f32> = kc[base..base + len * d]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let mut pb = PageBounds::default();
                pb.update(|t| &keys[t * d..(t + 1) * d], len, page, d);
                let cpu_s: Vec<f32> = (0..nfull)
                    .map(|p| {
                        (0..g)
                            .map(|gi| {
                                let qo = (b * nh + h * g + gi) * d;
                                let qv: Vec<f32> =
                                    q[qo..qo + d].iter().map(|x| x.to_f32()).collect();
                                pb.upper_bound(p, &qv)
                            })
                            .sum()
                    })
                    .collect();
                let top = cpu_s.iter().fold(1.0f32, |m, &x| m.max(x.abs())) as f64;
                let gs = &gpu_scores[b][h];
                let worst = (0..nfull)
                    .map(|p| (gs[p] as f64 - cpu_s[p] as f64).abs())
                    .fold(0.0, f64::max);
                assert!(
                    worst <= 1e-5 * top,
                    "{what}: scores differ by {worst} (largest {top})"
                );
                let k = (pages - 1).min(nfull);
                let got = &picks[b][h];
                assert_eq!(got.len(), k, "{what}: count");
                assert!(
                    got.windows(2).all(|p| p[0] < p[1])
                        && got.iter().all(|&p| (p as usize) < nfull),
                    "{what}: pages not ascending or not full"
                );
                let want: BTreeSet<u32> = top_k(&cpu_s, k).into_iter().map(|p| p as u32).collect();
                let have: BTreeSet<u32> = got.iter().copied().collect();
                let mut sorted = cpu_s.clone();
                sorted.sort_by(|x, y| y.total_cmp(x));
                if k > 0 {
                    let threshold = sorted[k - 1] as f64;
                    for &p in have.symmetric_difference(&want) {
                        let gap = (cpu_s[p as usize] as f64 - threshold).abs();
                        assert!(
                            gap <= 2e-5 * top,
                            "{what}: page {p} differs by more than a near-tie of {threshold}"
                        );
                    }
                }
            }
        }

        // The sparse kernel over the page list: the chosen pages' rows, then the newest page.
        let out = ctx.upload(&nan_bf16(batch * nh * d)).unwrap();
        let zeros = ctx.upload(&vec![0u32; batch]).unwrap();
        let (list, counts) = sc.page_list();
        let scale = 1.1 / (d as f64).sqrt();
        let mut ws = AttnWorkspace::new();
        for splits in [ctx.sparse_splits(batch, nh, &kv), 1, 5] {
            let p = SparseDecode {
                batch,
                n_heads: nh,
                scale: scale as f32,
                splits,
                q: dq.device_ptr(),
                out: out.device_ptr(),
                seq_lens: dl.device_ptr(),
                slots: dslots.device_ptr(),
                ck: dk.device_ptr(),
                cv: dv.device_ptr(),
                ccap: sc.k(),
                clen: counts,
                rstart: zeros.device_ptr(),
                rwin: 0,
                logits: 0,
                capture: zeros.device_ptr(),
                lstride: kv.capacity,
                post: None,
                cidx: list,
                cgran: page,
                vpages: 0,
                vmeta: 0,
                vcap: 0,
            };
            ctx.attn_sparse_decode(&dk, &dv, kv, &mut ws, &p).unwrap();
            let got = to_f64(&ctx.download(&out).unwrap());
            let mut want = Vec::new();
            for (b, &len) in lens.iter().enumerate() {
                let newest = (len - 1) / page * page;
                for hq in 0..nh {
                    let h = hq / g;
                    let rows: Vec<usize> = picks[b][h]
                        .iter()
                        .flat_map(|&pgi| pgi as usize * page..(pgi as usize + 1) * page)
                        .chain(newest..len)
                        .collect();
                    let base = (b * nkv + h) * kv.capacity * d;
                    let qo = (b * nh + hq) * d;
                    let s = scaled_dots(
                        &rows,
                        d,
                        scale,
                        |i| q[qo + i].to_f64(),
                        |r, i| kc[base + r * d + i].to_f64(),
                    );
                    want.extend(softmax_mix(&s, d, |t, i| {
                        vc[base + rows[t] * d + i].to_f64()
                    }));
                }
            }
            assert_close(
                &format!("case {case}: sparse decode over the page list, {splits} splits"),
                &got,
                &want,
                2e-2,
            );
        }
        println!("case {case}: pages and decode agree with the CPU");
    }
}
