//! SFI's cheaper slow step on the GPU (kernels/sfi_cand.cu, `CudaContext::sfi_cand_pick`, the
//! sparse decode kernel's views, the Selector over a view) against the CPU rule
//! (`slowfast_kv::sfi::candidates::candidate_pages`, `selector::select` with explicit
//! positions) on fresh random caches, queries and scores.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

mod common;

use std::collections::BTreeSet;

use common::*;
use slowfast_cuda::ops::quest::QuestPages;
use slowfast_cuda::ops::sfi::{SelectArgs, SelectView, SelectorScratch, SparseDecode};
use slowfast_cuda::ops::sfi_cand::{CandPick, ViewPlan, VMETA};
use slowfast_cuda::{AttnWorkspace, KvLayout};
use slowfast_kv::quest::PageBounds;
use slowfast_kv::sfi::candidates::candidate_pages;
use slowfast_kv::sfi::selector::{self, SelectorConfig, SelectorInput};

/// Position of view index `j` (pages of `page` keys from `list`, then the recent part).
fn view_pos(list: &[u32], page: usize, rs: usize, j: usize) -> usize {
    let n = list.len() * page;
    if j < n {
        list[j / page] as usize * page + j % page
    } else {
        rs + j - n
    }
}

/// The pick of one capturing row (slot 1 of two; a second, inactive row beside it): the page
/// list is the sinks' pages and the CPU's `candidate_pages` up to near-ties, the bounds it
/// computed are the keys' exact min / max, a second pick over the kept bounds gives the same
/// list, and the sparse decode kernel reading the view leaves the view's scores in view order
/// and attends over exactly its keys.
#[test]
fn cand_pages_match_the_cpu_rule_and_the_view_reads_them() {
    let Some(ctx) = gpu("cand_pages_match_the_cpu_rule_and_the_view_reads_them") else {
        return;
    };
    let mut rng = Rng::new(0xca9d);
    // (head dim, query heads, kv heads, page, sinks, want, length)
    let cases: [(usize, usize, usize, usize, usize, usize, usize); 4] = [
        (128, 32, 8, 16, 4, 40, 5000),
        (64, 4, 1, 16, 16, 7, 1500),
        (64, 9, 3, 8, 4, 30, 2100),
        (128, 16, 2, 16, 4, 200, 40_000),
    ];
    for (case, &(d, nh, nkv, page, sinks, want, len)) in cases.iter().enumerate() {
        let g = nh / nkv;
        let recent = 100;
        let kv = KvLayout {
            num_slots: 2,
            kv_heads: nkv,
            capacity: len + 50,
            head_dim: d,
            fp8: false,
        };
        let pg = QuestPages::new(kv, page).unwrap();
        let kc = fill_cache(&mut rng, &kv, &[(0, len), (1, len)]);
        let vc = fill_cache(&mut rng, &kv, &[(0, len), (1, len)]);
        let (dk, dv) = (ctx.upload(&kc).unwrap(), ctx.upload(&vc).unwrap());
        let bounds = ctx.upload(&nan_bf16(pg.layer_elems(kv))).unwrap();
        let q = rng.vec_bf16(2 * nh * d, 1.0);
        let dq = ctx.upload(&q).unwrap();
        let first = sinks.div_ceil(page);
        let recent_start = (len - recent) / page * page;
        let pages = recent_start / page;
        let plan = ViewPlan {
            batch_row: 1,
            page,
            first,
            pages,
            want,
            recent_start,
            fresh: 0,
        };
        let cap_rows = 2;
        let vcap = plan.entries();
        let mut meta = ViewPlan::vmeta(Some(&plan)).to_vec();
        meta.extend(ViewPlan::vmeta(None));
        assert_eq!(meta.len(), cap_rows * VMETA);
        let dmeta = ctx.upload(&meta).unwrap();
        let dslots = ctx.upload(&[0u32, 1]).unwrap();
        let ub = ctx.upload(&vec![0.0f32; cap_rows * nh * pg.maxp]).unwrap();
        let best = ctx.upload(&vec![0u32; cap_rows * nh]).unwrap();
        let scores = ctx.upload(&vec![0.0f32; cap_rows * pg.maxp]).unwrap();
        let cnt = ctx.upload(&vec![0u32; cap_rows]).unwrap();
        let mcount = ctx.upload(&vec![0u32; cap_rows]).unwrap();
        let vpages = ctx.upload(&vec![u32::MAX; cap_rows * vcap]).unwrap();
        let a = CandPick {
            q: dq.device_ptr(),
            k_cache: dk.device_ptr(),
            bounds: bounds.device_ptr(),
            slots: dslots.device_ptr(),
            vmeta: dmeta.device_ptr(),
            n_heads: nh,
            cap_rows,
            maxp: pg.maxp,
            forced0: sinks / page,
            ub: ub.device_ptr(),
            best: best.device_ptr(),
            scores: scores.device_ptr(),
            cnt: cnt.device_ptr(),
            mcount: mcount.device_ptr(),
            vpages: vpages.device_ptr(),
            vcap,
        };
        ctx.sfi_cand_pick(kv, &a).unwrap();
        let list_all = ctx.download(&vpages).unwrap();
        let list = list_all[..vcap].to_vec();
        let what = format!("case {case}");
        assert!(
            list_all[vcap..].iter().all(|&p| p == u32::MAX),
            "{what}: the inactive row got a list"
        );

        // The CPU rule over the same (bf16) keys and query.
        let keys: Vec<Vec<f32>> = (0..nkv)
            .map(|h| {
                let base = (nkv + h) * kv.capacity * d; // slot 1
                kc[base..base + len * d]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect()
            })
            .collect();
        let pbs: Vec<PageBounds> = keys
            .iter()
            .map(|k| {
                let mut b = PageBounds::default();
                b.update(|t| &k[t * d..(t + 1) * d], pages * page, page, d);
                b
            })
            .collect();
        let qf: Vec<f32> = q[nh * d..2 * nh * d].iter().map(|x| x.to_f32()).collect();
        let forced = [sinks / page, pages - 1];
        let cpu = candidate_pages(&pbs, &qf, d, (first, pages), &forced, want);
        assert_eq!(list.len(), first + cpu.len(), "{what}: entries");
        assert!(
            list.windows(2).all(|w| w[0] < w[1]),
            "{what}: list not ascending: {list:?}"
        );
        assert_eq!(
            list[..first],
            (0..first as u32).collect::<Vec<_>>()[..],
            "{what}: the sinks' pages come first"
        );
        for &f in &forced {
            if f >= first {
                assert!(
                    list.contains(&(f as u32)),
                    "{what}: forced page {f} missing"
                );
            }
        }
        // Near-ties at the cut: the CPU's score of every page the two lists disagree on.
        let score = |c: usize| -> f64 {
            (0..nh)
                .map(|hq| {
                    let b = &pbs[hq / g];
                    let qh = &qf[hq * d..(hq + 1) * d];
                    let best = (first..pages)
                        .map(|p| b.upper_bound(p, qh))
                        .fold(f32::NEG_INFINITY, f32::max);
                    (b.upper_bound(c, qh) - best) as f64
                })
                .fold(f64::NEG_INFINITY, f64::max)
        };
        let have: BTreeSet<usize> = list[first..].iter().map(|&p| p as usize).collect();
        let want_set: BTreeSet<usize> = cpu.iter().copied().collect();
        let cut = want_set
            .iter()
            .filter(|c| !forced.contains(c))
            .map(|&c| score(c))
            .fold(f64::INFINITY, f64::min);
        let diff: Vec<usize> = have.symmetric_difference(&want_set).copied().collect();
        for &c in &diff {
            let gap = (score(c) - cut).abs();
            assert!(
                gap <= 1e-3 * (1.0 + cut.abs()),
                "{what}: page {c} differs from the CPU's by {gap} at the cut {cut}"
            );
        }
        println!(
            "case {case}: {} pages, {} differ at near-ties",
            have.len(),
            diff.len()
        );

        // The bounds the pick computed: each candidate page's exact min / max.
        let gb = ctx.download(&bounds).unwrap();
        for h in 0..nkv {
            for p in (first..pages).step_by(37) {
                let o = ((nkv + h) * pg.maxp + p) * 2 * d;
                for c in 0..d {
                    let col = (p * page..(p + 1) * page).map(|t| keys[h][t * d + c]);
                    let (mn, mx) = col.fold((f32::MAX, f32::MIN), |(a, b), x| (a.min(x), b.max(x)));
                    assert_eq!(
                        (gb[o + c].to_f32(), gb[o + d + c].to_f32()),
                        (mn, mx),
                        "{what}: bounds of kv head {h} page {p} channel {c}"
                    );
                }
            }
        }
        // Again over the kept bounds (none fresh): the same list.
        let mut meta2 = meta.clone();
        meta2[6] = pages as u32;
        let dmeta2 = ctx.upload(&meta2).unwrap();
        ctx.memset_zero(&best).unwrap();
        ctx.sfi_cand_pick(
            kv,
            &CandPick {
                vmeta: dmeta2.device_ptr(),
                ..a
            },
        )
        .unwrap();
        assert_eq!(
            ctx.download(&vpages).unwrap()[..vcap],
            list[..],
            "{what}: kept bounds"
        );

        // The view: slot 1 captures into score row 0 reading its list and recent part; slot 0
        // reads densely (no capture). Scores in view order; the output over the view's keys.
        let lstride = kv.capacity;
        let logits = ctx
            .upload(&vec![f32::NAN; cap_rows * nh * lstride])
            .unwrap();
        let capture = ctx.upload(&[0u32, 1]).unwrap();
        let lens = ctx.upload(&[len as u32, len as u32]).unwrap();
        let zeros = ctx.upload(&[0u32, 0]).unwrap();
        let out = ctx.upload(&nan_bf16(2 * nh * d)).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let mut ws = AttnWorkspace::new();
        for splits in [ctx.sparse_splits(2, nh, &kv), 1, 7] {
            let p = SparseDecode {
                batch: 2,
                n_heads: nh,
                scale: scale as f32,
                splits,
                q: dq.device_ptr(),
                out: out.device_ptr(),
                seq_lens: lens.device_ptr(),
                slots: dslots.device_ptr(),
                ck: dk.device_ptr(),
                cv: dv.device_ptr(),
                ccap: kv.capacity,
                clen: zeros.device_ptr(),
                rstart: zeros.device_ptr(),
                rwin: 0,
                logits: logits.device_ptr(),
                capture: capture.device_ptr(),
                lstride,
                post: None,
                cidx: 0,
                cgran: 1,
                vpages: vpages.device_ptr(),
                vmeta: dmeta.device_ptr(),
                vcap,
            };
            ctx.attn_sparse_decode(&dk, &dv, kv, &mut ws, &p).unwrap();
            let vlen = plan.view_len(len);
            let got_l = ctx.download(&logits).unwrap();
            let got = to_f64(&ctx.download(&out).unwrap());
            let mut want_o = Vec::new();
            for b in 0..2 {
                for hq in 0..nh {
                    let h = hq / g;
                    let rows: Vec<usize> = if b == 1 {
                        (0..vlen)
                            .map(|j| view_pos(&list, page, recent_start, j))
                            .collect()
                    } else {
                        (0..len).collect()
                    };
                    let base = (b * nkv + h) * kv.capacity * d;
                    let qo = (b * nh + hq) * d;
                    let s = scaled_dots(
                        &rows,
                        d,
                        scale,
                        |i| q[qo + i].to_f64(),
                        |r, i| kc[base + r * d + i].to_f64(),
                    );
                    if b == 1 {
                        let row = &got_l[hq * lstride..hq * lstride + vlen];
                        let worst = row
                            .iter()
                            .zip(&s)
                            .map(|(&x, &y)| (x as f64 - y * std::f64::consts::LOG2_E).abs())
                            .fold(0.0, f64::max);
                        assert!(worst < 2e-2, "{what} head {hq}: view scores off by {worst}");
                    }
                    want_o.extend(softmax_mix(&s, d, |t, i| {
                        vc[base + rows[t] * d + i].to_f64()
                    }));
                }
            }
            assert_close(
                &format!("{what}: attention over the view, {splits} splits"),
                &got,
                &want_o,
                2e-2,
            );
        }
    }
}

/// The Selector over a view against the CPU's over the same keys with explicit positions:
/// scores in view order, key norms brought into view order on the device (`sfi_view_norms`),
/// the position prior at the view's positions, and the picks mapped back to positions
/// (`sfi_view_unmap`); two layers in one launch, each with its own page list.
#[test]
fn selector_over_a_view_matches_the_cpu_with_positions() {
    let Some(ctx) = gpu("selector_over_a_view_matches_the_cpu_with_positions") else {
        return;
    };
    let mut rng = Rng::new(0x51e7);
    let cfg = SelectorConfig::default();
    // (n_heads, kv_heads, capacity, page, sinks, entries, recent part, k)
    let cases: [[usize; 8]; 2] = [
        [32, 8, 20_000, 16, 4, 120, 140, 700],
        [4, 1, 9000, 16, 16, 60, 250, 300],
    ];
    for (ci, &[nh, nkv, cap, page, sinks, entries, rlen, k]) in cases.iter().enumerate() {
        let g = nh / nkv;
        let layers = 2;
        let first = sinks.div_ceil(page);
        let recent_start = cap - 2 * rlen;
        let pages = recent_start / page;
        let recent_start = pages * page;
        let vlen = entries * page + rlen;
        let lstride = cap;
        let ls = nh * lstride;
        let kv = KvLayout {
            num_slots: 1,
            kv_heads: nkv,
            capacity: cap,
            head_dim: 64,
            fp8: false,
        };
        let mut lists = Vec::new();
        let mut gl = vec![f32::NAN; layers * ls];
        let mut norms_pos = vec![f32::NAN; layers * nkv * cap];
        let mut cpu_sel = Vec::new();
        for z in 0..layers {
            // sinks' pages, then distinct random candidate pages, ascending
            let mut picked = BTreeSet::new();
            while picked.len() < entries - first {
                picked.insert(first + rng.below(pages - first));
            }
            let list: Vec<u32> = (0..first).chain(picked).map(|p| p as u32).collect();
            let pos: Vec<u32> = (0..vlen)
                .map(|j| view_pos(&list, page, recent_start, j) as u32)
                .collect();
            let logits: Vec<f32> = (0..nkv * g * vlen)
                .map(|_| rng.normal(1.5) + if rng.uniform() > 0.995 { 6.0 } else { 0.0 })
                .collect();
            for x in &mut norms_pos[z * nkv * cap..(z + 1) * nkv * cap] {
                *x = 5.0 + 3.0 * rng.uniform();
            }
            let norms_v: Vec<f32> = (0..nkv)
                .flat_map(|h| {
                    let np = &norms_pos;
                    pos.iter()
                        .map(move |&p| np[(z * nkv + h) * cap + p as usize])
                })
                .collect();
            let inp = SelectorInput {
                n_kv_heads: nkv,
                rows: g,
                seq_len: vlen,
                logits: &logits,
                key_norms: &norms_v,
                sinks,
                recent_start: entries * page,
                k,
                positions: Some(&pos),
            };
            let mut sc = selector::SelectorScratch::default();
            let s = selector::select(&cfg, &inp, &mut sc).unwrap();
            // the CPU picks view indices; the GPU's are positions after the unmap
            cpu_sel.push(
                s.per_head
                    .iter()
                    .map(|h| h.iter().map(|&j| pos[j as usize]).collect::<Vec<u32>>())
                    .collect::<Vec<_>>(),
            );
            for h in 0..nkv {
                for gi in 0..g {
                    for j in 0..vlen {
                        gl[z * ls + (h * g + gi) * lstride + j] =
                            logits[(h * g + gi) * vlen + j] * std::f32::consts::LOG2_E;
                    }
                }
            }
            lists.push(list);
        }
        let vcap = entries;
        let dlists = ctx.upload(&lists.concat()).unwrap();
        let dl = ctx.upload(&gl).unwrap();
        let dn = ctx.upload(&norms_pos).unwrap();
        let vmax = vlen + 3;
        let norms_v = ctx.upload(&vec![f32::NAN; layers * nkv * vmax]).unwrap();
        let view = SelectView {
            vpages: dlists.device_ptr(),
            row: 0,
            cap_rows: 1,
            vcap,
            entries,
            page,
            recent_start,
        };
        ctx.sfi_view_norms(
            kv,
            layers,
            &view,
            vlen,
            dn.device_ptr(),
            nkv * cap,
            &norms_v,
            vmax,
        )
        .unwrap();
        let mut gsc = SelectorScratch::new(&ctx, cfg, layers, nkv, g, cap, k).unwrap();
        gsc.reserve_view(&ctx, vmax).unwrap();
        let a = SelectArgs {
            layers,
            logits: dl.device_ptr(),
            lstride,
            logit_layer_stride: ls,
            n_heads: nh,
            kv_heads: nkv,
            rows: 1,
            sinks,
            recent_start: entries * page,
            norms: norms_v.device_ptr(),
            norm_stride: vmax,
            norm_layer_stride: nkv * vmax,
            view: Some(view),
        };
        ctx.sfi_select(&a, &mut gsc).unwrap();
        let [_, _, picks, mc] = gsc.topk_picks();
        ctx.sfi_view_unmap(nkv, layers, &view, picks, mc, k)
            .unwrap();
        let (sel, ms) = gsc.download(&ctx).unwrap();
        for z in 0..layers {
            assert_eq!(ms[z], cpu_sel[z][0].len(), "case {ci} layer {z}: count");
            for h in 0..nkv {
                let o = (z * nkv + h) * k;
                let gpu: &[u32] = &sel[o..o + ms[z]];
                let cpu = &cpu_sel[z][h];
                check_sets(&format!("case {ci} layer {z} head {h}"), gpu, cpu);
                assert!(
                    gpu.iter().all(|&p| (p as usize) < recent_start
                        && lists[z].binary_search(&(p / page as u32)).is_ok()),
                    "case {ci} layer {z} head {h}: a pick outside the view's pages"
                );
            }
        }
    }
}
