//! SFI on the GPU against the CPU: the sparse / capturing flash-decoding kernel against an f64
//! reference over the same virtual key set, and the GPU Selector against the CPU Selector
//! (`slowfast_kv::sfi::selector::select`) on fresh random logits and key norms, then the gather.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use slowfast_cuda::ops::sfi::{GatherArgs, SelectArgs, SelectorScratch, SparseDecode};
use slowfast_cuda::{bf16, AttnWorkspace, KvLayout};
use slowfast_kv::sfi::selector::{self, SelectorConfig, SelectorInput};

/// One sequence's sparse view: compact rows (positions), recent start, sliding recent window.
struct View {
    len: usize,
    compact: Vec<Vec<usize>>, // per kv head
    rstart: usize,
    capture: bool,
}

#[test]
fn sparse_decode_matches_reference() {
    let Some(ctx) = gpu("sparse_decode_matches_reference") else {
        return;
    };
    let mut rng = Rng::new(61);
    for &(d, nh, nkv, rwin) in &[(128, 32, 8, 0usize), (256, 4, 1, 0), (64, 16, 2, 300)] {
        let batch = 5;
        let cap = 3000;
        let ccap = 400;
        let kv = KvLayout {
            num_slots: batch,
            kv_heads: nkv,
            capacity: cap,
            head_dim: d,
            fp8: false,
        };
        let mut views = Vec::new();
        for b in 0..batch {
            let len = 500 + rng.below(cap - 600);
            let c = if b == 1 { 0 } else { 4 + rng.below(ccap - 4) };
            let compact = (0..nkv)
                .map(|_| {
                    let mut v: Vec<usize> = (0..c).map(|_| rng.below(len / 2)).collect();
                    v.sort_unstable();
                    v
                })
                .collect();
            let rstart = if b == 1 {
                0
            } else {
                len / 2 + rng.below(len / 2)
            };
            views.push(View {
                len,
                compact,
                rstart,
                capture: b == 3,
            });
        }
        let lens: Vec<(usize, usize)> = (0..batch).map(|b| (b, views[b].len)).collect();
        let kc = fill_cache(&mut rng, &kv, &lens);
        let vc = fill_cache(&mut rng, &kv, &lens);
        // Compact buffers gathered on the host; unused rows NaN.
        let mut ck = vec![bf16::NAN; batch * nkv * ccap * d];
        let mut cv = ck.clone();
        for (b, v) in views.iter().enumerate() {
            for h in 0..nkv {
                for (i, &p) in v.compact[h].iter().enumerate() {
                    let src = ((b * nkv + h) * cap + p) * d;
                    let dst = ((b * nkv + h) * ccap + i) * d;
                    ck[dst..dst + d].copy_from_slice(&kc[src..src + d]);
                    cv[dst..dst + d].copy_from_slice(&vc[src..src + d]);
                }
            }
        }
        let q = rng.vec_bf16(batch * nh * d, 1.0);
        let scale = 1.3 / (d as f64).sqrt();
        let u32s = |f: &dyn Fn(&View) -> usize| -> Vec<u32> {
            views.iter().map(|v| f(v) as u32).collect()
        };
        let dl = ctx.upload(&u32s(&|v| v.len)).unwrap();
        let dclen = ctx.upload(&u32s(&|v| v.compact[0].len())).unwrap();
        let drs = ctx.upload(&u32s(&|v| v.rstart)).unwrap();
        // a capturing row's scores go to score row capture[b] - 1: here row b
        let caps: Vec<u32> = (0..batch)
            .map(|b| if views[b].capture { b as u32 + 1 } else { 0 })
            .collect();
        let dcap = ctx.upload(&caps).unwrap();
        let slots: Vec<u32> = (0..batch as u32).collect();
        let dslots = ctx.upload(&slots).unwrap();
        let (dq, dk, dv) = (
            ctx.upload(&q).unwrap(),
            ctx.upload(&kc).unwrap(),
            ctx.upload(&vc).unwrap(),
        );
        let (dck, dcv) = (ctx.upload(&ck).unwrap(), ctx.upload(&cv).unwrap());
        let out = ctx.upload(&nan_bf16(batch * nh * d)).unwrap();
        let logits = ctx.upload(&vec![f32::NAN; batch * nh * cap]).unwrap();
        let mut ws = AttnWorkspace::new();
        for splits in [ctx.sparse_splits(batch, nh, &kv), 1, 7] {
            let p = SparseDecode {
                batch,
                n_heads: nh,
                scale: scale as f32,
                splits,
                q: dq.device_ptr(),
                out: out.device_ptr(),
                seq_lens: dl.device_ptr(),
                slots: dslots.device_ptr(),
                ck: dck.device_ptr(),
                cv: dcv.device_ptr(),
                ccap,
                clen: dclen.device_ptr(),
                rstart: drs.device_ptr(),
                rwin,
                logits: logits.device_ptr(),
                capture: dcap.device_ptr(),
                lstride: cap,
                post: None,
                cidx: 0,
                cgran: 1,
                vpages: 0,
                vmeta: 0,
                vcap: 0,
            };
            ctx.attn_sparse_decode(&dk, &dv, kv, &mut ws, &p).unwrap();
            let got = to_f64(&ctx.download(&out).unwrap());
            let got_logits = ctx.download(&logits).unwrap();
            let g = nh / nkv;
            let mut want = Vec::new();
            for (b, v) in views.iter().enumerate() {
                for hq in 0..nh {
                    let h = hq / g;
                    // Key rows: (buffer, row) pairs of the virtual sequence.
                    let keys: Vec<(bool, usize)> = if v.capture {
                        (0..v.len).map(|p| (false, p)).collect()
                    } else {
                        let rlo = if rwin > 0 {
                            v.rstart.max(v.len.saturating_sub(rwin))
                        } else {
                            v.rstart
                        };
                        (0..v.compact[h].len())
                            .map(|i| (true, i))
                            .chain((rlo.min(v.len)..v.len).map(|p| (false, p)))
                            .collect()
                    };
                    let qo = (b * nh + hq) * d;
                    let row = |c: bool, r: usize, m: &[bf16]| -> Vec<f64> {
                        let base = if c {
                            ((b * nkv + h) * ccap + r) * d
                        } else {
                            ((b * nkv + h) * cap + r) * d
                        };
                        m[base..base + d].iter().map(|x| x.to_f64()).collect()
                    };
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|&(c, r)| {
                            let k = row(c, r, if c { &ck } else { &kc });
                            (0..d).map(|i| q[qo + i].to_f64() * k[i]).sum::<f64>() * scale
                        })
                        .collect();
                    let vrows: Vec<Vec<f64>> = keys
                        .iter()
                        .map(|&(c, r)| row(c, r, if c { &cv } else { &vc }))
                        .collect();
                    want.extend(softmax_mix(&s, d, |t, i| vrows[t][i]));
                    if v.capture {
                        for (p, &sv) in s.iter().enumerate() {
                            let gl = got_logits[(b * nh + hq) * cap + p] as f64;
                            let wl = sv * std::f64::consts::LOG2_E;
                            assert!(
                                (gl - wl).abs() < 2e-3 * (1.0 + wl.abs()),
                                "logit b{b} h{hq} p{p}: {gl} vs {wl}"
                            );
                        }
                    }
                }
            }
            assert_close(
                &format!("sparse decode d{d} {nh}/{nkv} rwin {rwin} splits {splits}"),
                &got,
                &want,
                2e-2,
            );
        }
    }
}

/// The sparse kernel with `qkv_post` inside (`SparsePost`) against `qkv_post` followed by the
/// plain sparse launch: the same output, captured scores and caches bit for bit, with the new
/// cache row NaN until one of them writes it (so a tile that read it before the new key was
/// put in its place would poison the output). A compact row, a dense row and a capturing row
/// (or, without capture, a third sparse one); capturing launches at one wave and 7 splits, fast
/// ones at 8 and 1; head dims 128, 256 and 64 (with a sliding recent window and no q/k norms).
#[test]
fn sparse_decode_post_equals_qkv_post_then_sparse_decode() {
    use slowfast_cuda::ops::sfi::SparsePost;
    use slowfast_cuda::QkvPost;
    let Some(ctx) = gpu("sparse_decode_post") else {
        return;
    };
    let mut rng = Rng::new(62);
    for &(d, nh, nkv, rwin, norms) in &[
        (128usize, 32usize, 8usize, 0usize, true),
        (256, 4, 1, 0, true),
        (64, 16, 2, 300, false),
    ] {
        let (batch, cap, ccap) = (3usize, 1200usize, 200usize);
        let kv = KvLayout {
            num_slots: batch,
            kv_heads: nkv,
            capacity: cap,
            head_dim: d,
            fp8: false,
        };
        let lens = [700usize, 333, 1100];
        let clens = [50usize, 0, 120];
        let rstarts = [600usize, 0, 900];
        // caches random below each length, the new row (len - 1) NaN
        let mut init_k = rng.vec_bf16(kv.elems(), 1.0);
        let mut init_v = rng.vec_bf16(kv.elems(), 1.0);
        for (b, &len) in lens.iter().enumerate() {
            for h in 0..nkv {
                let at = ((b * nkv + h) * cap + len - 1) * d;
                for i in at..at + d {
                    init_k[i] = bf16::NAN;
                    init_v[i] = bf16::NAN;
                }
            }
        }
        let ck = rng.vec_bf16(batch * nkv * ccap * d, 1.0);
        let cv = rng.vec_bf16(batch * nkv * ccap * d, 1.0);
        let row = (nh + 2 * nkv) * d;
        let qkv = rng.vec_bf16(batch * row, 1.0);
        let qn: Vec<f32> = (0..d).map(|_| 1.0 + rng.normal(0.3)).collect();
        let kn: Vec<f32> = (0..d).map(|_| 1.0 + rng.normal(0.3)).collect();
        let freqs: Vec<f64> = (0..d / 2)
            .map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64))
            .collect();
        let u32s = |v: &[usize]| -> Vec<u32> { v.iter().map(|&x| x as u32).collect() };
        let pos: Vec<usize> = lens.iter().map(|&l| l - 1).collect();
        let (dl, dclen, drs, dpos) = (
            ctx.upload(&u32s(&lens)).unwrap(),
            ctx.upload(&u32s(&clens)).unwrap(),
            ctx.upload(&u32s(&rstarts)).unwrap(),
            ctx.upload(&u32s(&pos)).unwrap(),
        );
        let dslots = ctx.upload(&[0u32, 1, 2]).unwrap();
        let dcap = ctx.upload(&[0u32, 0, 1]).unwrap();
        let (dck, dcv) = (ctx.upload(&ck).unwrap(), ctx.upload(&cv).unwrap());
        let dqkv = ctx.upload(&qkv).unwrap();
        let (dqn, dkn, df) = (
            ctx.upload(&qn).unwrap(),
            ctx.upload(&kn).unwrap(),
            ctx.upload(&freqs).unwrap(),
        );
        let qp = QkvPost {
            n_tokens: batch,
            q_heads: nh,
            q_norm: norms.then_some(&dqn),
            k_norm: norms.then_some(&dkn),
            eps: 1e-6,
            rot_dim: d,
            inv_freq: &df,
            amax: 0,
            rope_pos: 0,
        };
        let sp = SparsePost {
            qkv: dqkv.device_ptr(),
            qkv_stride: row,
            q_norm: if norms { dqn.device_ptr() } else { 0 },
            k_norm: if norms { dkn.device_ptr() } else { 0 },
            eps: 1e-6,
            positions: dpos.device_ptr(),
            rot_dim: d,
            inv_freq: df.device_ptr(),
        };
        let mut ws = AttnWorkspace::new();
        for (splits, cap_on) in [
            (ctx.sparse_splits(batch, nh, &kv), true),
            (7, true),
            (8, false),
            (1, false),
        ] {
            // (out, scores, k cache, v cache) bits of one way
            let mut run = |post: bool| -> (Vec<u16>, Vec<u32>, Vec<u16>, Vec<u16>) {
                let (mut kc, mut vc) = (ctx.upload(&init_k).unwrap(), ctx.upload(&init_v).unwrap());
                let mut q = ctx.upload(&nan_bf16(batch * nh * d)).unwrap();
                if !post {
                    ctx.qkv_post(&dqkv, &mut q, &mut kc, &mut vc, &dpos, &dslots, kv, &qp)
                        .unwrap();
                }
                let out = ctx.upload(&nan_bf16(batch * nh * d)).unwrap();
                let logits = ctx.upload(&vec![f32::NAN; batch * nh * cap]).unwrap();
                let p = SparseDecode {
                    batch,
                    n_heads: nh,
                    scale: 0.09,
                    splits,
                    q: q.device_ptr(),
                    out: out.device_ptr(),
                    seq_lens: dl.device_ptr(),
                    slots: dslots.device_ptr(),
                    ck: dck.device_ptr(),
                    cv: dcv.device_ptr(),
                    ccap,
                    clen: dclen.device_ptr(),
                    rstart: drs.device_ptr(),
                    rwin,
                    logits: if cap_on { logits.device_ptr() } else { 0 },
                    capture: dcap.device_ptr(),
                    lstride: cap,
                    post: post.then_some(sp),
                    cidx: 0,
                    cgran: 1,
                    vpages: 0,
                    vmeta: 0,
                    vcap: 0,
                };
                ctx.attn_sparse_decode(&kc, &vc, kv, &mut ws, &p).unwrap();
                let b16 = |v: Vec<bf16>| -> Vec<u16> { v.iter().map(|x| x.to_bits()).collect() };
                (
                    b16(ctx.download(&out).unwrap()),
                    ctx.download(&logits)
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect(),
                    b16(ctx.download(&kc).unwrap()),
                    b16(ctx.download(&vc).unwrap()),
                )
            };
            let (want, got) = (run(false), run(true));
            let tag = format!("d{d} {nh}/{nkv} rwin {rwin} splits {splits} capture {cap_on}");
            assert!(
                want.0.iter().all(|&x| !bf16::from_bits(x).is_nan()),
                "{tag}: the reference output has NaNs"
            );
            assert_eq!(want.0, got.0, "{tag}: outputs differ");
            assert_eq!(want.1, got.1, "{tag}: captured scores differ");
            assert_eq!(want.2, got.2, "{tag}: k caches differ");
            assert_eq!(want.3, got.3, "{tag}: v caches differ");
            println!("{tag}: bit-identical");
        }
    }
}

#[test]
fn selector_matches_cpu() {
    let Some(ctx) = gpu("selector_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(62);
    let paper = SelectorConfig::default();
    let pooled = SelectorConfig {
        soft_alpha: -1.0,
        nms_window: 8,
        ..SelectorConfig::default()
    };
    let geo = SelectorConfig {
        alpha: 0.0,
        ..SelectorConfig::default()
    };
    let alpha07 = SelectorConfig {
        alpha: 0.7,
        lambda_soft: true,
        ..SelectorConfig::default()
    };
    // Equal logits and key norms and no position prior: the domain is one class of exactly
    // equal scores apart from a few peaks and their soft-NMS neighbours, so the split top-k's
    // threshold bin overflows its candidate buffer (the radix select path) and ties decide.
    let flat = SelectorConfig {
        prior_weight_pos: 0.0,
        ..SelectorConfig::default()
    };
    // (config, n_heads, kv_heads, rows per query head, len, sinks, recent, k, tied)
    let cases = [
        (paper, 32, 8, 1, 5000, 4, 256, 700, false),
        (pooled, 32, 8, 1, 9000, 4, 256, 1500, false),
        (pooled, 4, 1, 16, 3000, 4, 256, 500, false),
        (geo, 16, 2, 4, 2000, 4, 100, 300, false),
        (alpha07, 12, 4, 2, 4000, 8, 128, 900, false),
        (paper, 8, 8, 1, 1200, 4, 256, 5000, false), // k above the domain: everything
        (flat, 32, 8, 1, 9000, 4, 256, 1500, true),
        (paper, 32, 8, 1, 40000, 4, 256, 2000, false), // 20 chunks a head
    ];
    for (ci, &(cfg, nh, nkv, r, len, sinks, recent, k, tied)) in cases.iter().enumerate() {
        let g = nh / nkv;
        let rows = g * r;
        let layers = 2; // two layers in one launch, each checked against its own CPU run
        let recent_start = (len - recent) / 16 * 16;
        let lstride = len + 7;
        let ls = r * nh * lstride; // logits per layer
        let mut gl = vec![f32::NAN; layers * ls];
        let mut norms_all = Vec::new();
        let mut cpu_sel = Vec::new();
        for z in 0..layers {
            // CPU layout [nkv, rows, len] (natural units); peaky rows so the choice is not flat.
            let mut logits = vec![0.0f32; nkv * rows * len];
            for (i, x) in logits.iter_mut().enumerate() {
                let u = rng.uniform();
                *x = if tied {
                    if i % len % 997 == 500 {
                        8.0
                    } else {
                        0.0
                    }
                } else {
                    rng.normal(1.5) + if u > 0.995 { 6.0 } else { 0.0 }
                };
            }
            let norms: Vec<f32> = (0..nkv * len)
                .map(|_| if tied { 6.0 } else { 5.0 + 3.0 * rng.uniform() })
                .collect();
            let inp = SelectorInput {
                n_kv_heads: nkv,
                rows,
                seq_len: len,
                logits: &logits,
                key_norms: &norms,
                sinks,
                recent_start,
                k,
                positions: None,
            };
            let mut sc = selector::SelectorScratch::default();
            cpu_sel.push(selector::select(&cfg, &inp, &mut sc).unwrap());
            // GPU capture layout [r, n_heads, lstride], log2 units; row (kvh, rr = r_i * G + gi).
            for h in 0..nkv {
                for rr in 0..rows {
                    let (ri, gi) = (rr / g, rr % g);
                    for j in 0..len {
                        gl[z * ls + (ri * nh + h * g + gi) * lstride + j] =
                            logits[(h * rows + rr) * len + j] * std::f32::consts::LOG2_E;
                    }
                }
            }
            norms_all.extend(norms);
        }
        let dl = ctx.upload(&gl).unwrap();
        let dn = ctx.upload(&norms_all).unwrap();
        let mut gsc = SelectorScratch::new(&ctx, cfg, layers, nkv, rows, len, k).unwrap();
        let a = SelectArgs {
            layers,
            logits: dl.device_ptr(),
            lstride,
            logit_layer_stride: ls,
            n_heads: nh,
            kv_heads: nkv,
            rows: r,
            sinks,
            recent_start,
            norms: dn.device_ptr(),
            norm_stride: len,
            norm_layer_stride: nkv * len,
            view: None,
        };
        // The one-block-per-head kernels, then the split Selector (left on for the gather).
        let (mut sel, mut ms) = (Vec::new(), Vec::new());
        for split in [false, true] {
            gsc.set_split(&ctx, split).unwrap();
            ctx.sfi_select(&a, &mut gsc).unwrap();
            (sel, ms) = gsc.download(&ctx).unwrap();
            let fallbacks = gsc.radix_fallbacks(&ctx, layers).unwrap();
            println!("case {ci} split {split}: {fallbacks} heads through the radix select");
            if split && tied {
                assert!(
                    fallbacks > 0,
                    "case {ci}: the tied case never overflowed the bin"
                );
            }
            for z in 0..layers {
                let m = ms[z];
                assert_eq!(
                    m,
                    cpu_sel[z].per_head[0].len(),
                    "case {ci} split {split} layer {z}: equalised count"
                );
                for h in 0..nkv {
                    let o = (z * nkv + h) * k;
                    check_sets(
                        &format!("case {ci} split {split} layer {z} head {h}"),
                        &sel[o..o + m],
                        &cpu_sel[z].per_head[h],
                    );
                    if tied {
                        assert_eq!(
                            sel[o..o + m],
                            cpu_sel[z].per_head[h][..],
                            "case {ci} split {split} layer {z} head {h}: ties go to lower positions"
                        );
                    }
                }
            }
        }
        // The gather: sinks then the chosen rows of both layers; clen / rstart published.
        let d = 64;
        let kv = KvLayout {
            num_slots: 2,
            kv_heads: nkv,
            capacity: len,
            head_dim: d,
            fp8: false,
        };
        let caches: Vec<(Vec<bf16>, Vec<bf16>)> = (0..layers)
            .map(|_| (rng.vec_bf16(kv.elems(), 1.0), rng.vec_bf16(kv.elems(), 1.0)))
            .collect();
        let dev: Vec<_> = caches
            .iter()
            .map(|(k, v)| (ctx.upload(k).unwrap(), ctx.upload(v).unwrap()))
            .collect();
        let kptrs = ctx
            .upload(
                &dev.iter()
                    .map(|(k, _)| k.device_ptr())
                    .collect::<Vec<u64>>(),
            )
            .unwrap();
        let vptrs = ctx
            .upload(
                &dev.iter()
                    .map(|(_, v)| v.device_ptr())
                    .collect::<Vec<u64>>(),
            )
            .unwrap();
        let ccap = sinks + k;
        let cs = 2 * nkv * ccap * d;
        let dck = ctx.upload(&nan_bf16(layers * cs)).unwrap();
        let dcv = ctx.upload(&nan_bf16(layers * cs)).unwrap();
        let dclen = ctx.upload(&vec![7u32; 2 * layers]).unwrap();
        let drs = ctx.upload(&vec![7u32; 2 * layers]).unwrap();
        let ga = GatherArgs {
            layers,
            kptrs: kptrs.device_ptr(),
            vptrs: vptrs.device_ptr(),
            slot: 1,
            sinks,
            recent_start,
            ck: dck.device_ptr(),
            cv: dcv.device_ptr(),
            ccap,
            compact_layer_stride: cs,
            clen: dclen.device_ptr(),
            rstart: drs.device_ptr(),
        };
        ctx.sfi_gather(kv, &gsc, &ga).unwrap();
        let (gk, gv) = (ctx.download(&dck).unwrap(), ctx.download(&dcv).unwrap());
        let (clen, rs) = (ctx.download(&dclen).unwrap(), ctx.download(&drs).unwrap());
        for z in 0..layers {
            assert_eq!(
                clen[2 * z..2 * z + 2],
                [7, (sinks + ms[z]) as u32],
                "case {ci} layer {z}: clen"
            );
            assert_eq!(
                rs[2 * z..2 * z + 2],
                [7, recent_start as u32],
                "case {ci} layer {z}: rstart"
            );
            let (kc, vc) = &caches[z];
            for h in 0..nkv {
                let o = (z * nkv + h) * k;
                let pos: Vec<usize> = (0..sinks)
                    .chain(sel[o..o + ms[z]].iter().map(|&p| p as usize))
                    .collect();
                for (i, &p) in pos.iter().enumerate() {
                    let src = ((nkv + h) * len + p) * d;
                    let dst = z * cs + ((nkv + h) * ccap + i) * d;
                    assert!(
                        gk[dst..dst + d]
                            .iter()
                            .zip(&kc[src..src + d])
                            .all(|(a, b)| a.to_bits() == b.to_bits())
                            && gv[dst..dst + d]
                                .iter()
                                .zip(&vc[src..src + d])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "case {ci} layer {z}: gathered row {i} of head {h} is not position {p}"
                    );
                }
            }
        }
    }
}

#[test]
fn key_norms_match_cpu() {
    let Some(ctx) = gpu("key_norms_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(63);
    let kv = KvLayout {
        num_slots: 3,
        kv_heads: 4,
        capacity: 1000,
        head_dim: 128,
        fp8: false,
    };
    let kc = rng.vec_bf16(kv.elems(), 1.0);
    let dk = ctx.upload(&kc).unwrap();
    let kptrs = ctx.upload(&[dk.device_ptr()]).unwrap();
    let norms = ctx
        .upload(&vec![-1.0f32; kv.kv_heads * kv.capacity])
        .unwrap();
    let stride = kv.kv_heads * kv.capacity;
    ctx.sfi_key_norms(
        kptrs.device_ptr(),
        1,
        kv,
        2,
        10,
        700,
        norms.device_ptr(),
        stride,
    )
    .unwrap();
    ctx.sfi_key_norms(
        kptrs.device_ptr(),
        1,
        kv,
        2,
        700,
        1000,
        norms.device_ptr(),
        stride,
    )
    .unwrap();
    let got = ctx.download(&norms).unwrap();
    for h in 0..kv.kv_heads {
        for p in 0..kv.capacity {
            let g = got[h * kv.capacity + p];
            if p < 10 {
                assert_eq!(g, -1.0, "position {p} outside the range was written");
                continue;
            }
            let b = ((2 * kv.kv_heads + h) * kv.capacity + p) * 128;
            let w: f64 = kc[b..b + 128]
                .iter()
                .map(|x| x.to_f64() * x.to_f64())
                .sum::<f64>()
                .sqrt();
            assert!(
                (g as f64 - w).abs() < 1e-4 * w,
                "norm h{h} p{p}: {g} vs {w}"
            );
        }
    }
}
