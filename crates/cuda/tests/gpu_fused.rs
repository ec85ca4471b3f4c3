//! The fused decode kernels (ops/fused.rs) against plain references on fresh random
//! inputs: the GEMV at 1-8 rows in each input mode (plain, RMS-normed, GLU) and output form
//! (bf16, f32, residual add) against f64, and the q/k norm + RoPE + KV append kernel (on a merged q/k/v
//! row) against the chain of separate kernels it replaces.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use slowfast_cuda::{bf16, GemvInput, GemvOutput, Glu, KvLayout, QkvPost, RmsNorm, Rope};

/// `xin[n, k] · w[m, k]^T` in f64.
fn matvec(xin: &[f64], w: &[bf16], n: usize, k: usize, m: usize) -> Vec<f64> {
    (0..n * m)
        .map(|i| {
            let (r, o) = (i / m, i % m);
            (0..k).map(|j| xin[r * k + j] * w[o * k + j].to_f64()).sum()
        })
        .collect()
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

fn gelu_tanh(g: f64) -> f64 {
    0.5 * g * (1.0 + (0.797_884_560_802_865_4 * (g + 0.044715 * g * g * g)).tanh())
}

#[test]
fn fused_gemv_matches_reference() {
    let Some(ctx) = gpu("fused_gemv") else { return };
    let mut rng = Rng::new(21);
    let eps = 1e-6f32;
    // (in, out): a decode q/k/v shape, an odd out, a small one, the down projection's in.
    for &(k, m) in &[(2560usize, 6144usize), (2560, 1027), (136, 33), (9728, 300)] {
        // 1-2 rows: the CUDA-core kernels; 3-8: the tensor-core ones
        for n in 1..=8 {
            let x = rng.vec_bf16(n * k, 1.0);
            let w = rng.vec_bf16(m * k, 0.05);
            let nw: Vec<f32> = (0..k).map(|_| 1.0 + rng.normal(0.3)).collect();
            let (dx, dw, dnw) = (
                ctx.upload(&x).unwrap(),
                ctx.upload(&w).unwrap(),
                ctx.upload(&nw).unwrap(),
            );
            let tag = format!("n {n} in {k} out {m}");

            // plain input, f32 and bf16 out
            let want = matvec(&to_f64(&x), &w, n, k, m);
            {
                let mut y32 = ctx.upload(&vec![f32::NAN; n * m]).unwrap();
                let out = GemvOutput::F32(&mut y32);
                ctx.gemv_fused(&dx, GemvInput::Plain, &dw, out, n, k, m)
                    .unwrap();
                let got = dl_f32(&ctx, &y32);
                assert_close(&format!("plain f32 {tag}"), &got, &want, 1e-4);
                let mut y16 = ctx.upload(&nan_bf16(n * m)).unwrap();
                let out = GemvOutput::Bf16(&mut y16);
                ctx.gemv_fused(&dx, GemvInput::Plain, &dw, out, n, k, m)
                    .unwrap();
                let got = to_f64(&ctx.download(&y16).unwrap());
                assert_close(&format!("plain bf16 {tag}"), &got, &want, 1e-2);
            }

            // RMS-normed input (the bf16 row rmsnorm writes)
            let mut xn = vec![0.0f64; n * k];
            for r in 0..n {
                let row = &x[r * k..(r + 1) * k];
                let ms = row.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / k as f64;
                let s = 1.0 / (ms + eps as f64).sqrt();
                for j in 0..k {
                    xn[r * k + j] = bf(row[j].to_f64() * s * nw[j] as f64);
                }
            }
            let want = matvec(&xn, &w, n, k, m);
            let res = rng.vec_bf16(n * m, 1.0);
            let want_res: Vec<f64> = res
                .iter()
                .zip(&want)
                .map(|(r, y)| bf(r.to_f64() + bf(*y)))
                .collect();
            {
                let mut y32 = ctx.upload(&vec![f32::NAN; n * m]).unwrap();
                let input = GemvInput::Norm { w: &dnw, eps };
                let out = GemvOutput::F32(&mut y32);
                ctx.gemv_fused(&dx, input, &dw, out, n, k, m).unwrap();
                let got = dl_f32(&ctx, &y32);
                assert_close(&format!("norm f32 {tag}"), &got, &want, 1e-3);

                // residual add onto a random residual row: res = bf16(res + bf16(y))
                let mut dres = ctx.upload(&res).unwrap();
                let input = GemvInput::Norm { w: &dnw, eps };
                let out = GemvOutput::Residual(&mut dres);
                ctx.gemv_fused(&dx, input, &dw, out, n, k, m).unwrap();
                let got = to_f64(&ctx.download(&dres).unwrap());
                assert_close(&format!("residual {tag}"), &got, &want_res, 1e-2);
            }

            // GLU output: the rows are [gate; up] halves; glu = bf16(act(bf16(g)) * bf16(u)),
            // both activations, plain and normed input (m even: the odd shapes skip it)
            if m % 2 == 0 {
                let half = m / 2;
                for (act, f) in [
                    (Glu::SwiGlu, silu as fn(f64) -> f64),
                    (Glu::GeGluTanh, gelu_tanh),
                ] {
                    for normed in [false, true] {
                        let (xin, input) = if normed {
                            (xn.clone(), GemvInput::Norm { w: &dnw, eps })
                        } else {
                            (to_f64(&x), GemvInput::Plain)
                        };
                        let y = matvec(&xin, &w, n, k, m);
                        let want: Vec<f64> = (0..n * half)
                            .map(|i| {
                                let (r, j) = (i / half, i % half);
                                let (g, u) = (bf(y[r * m + j]), bf(y[r * m + half + j]));
                                bf(f(g) * u)
                            })
                            .collect();
                        let mut dg = ctx.upload(&nan_bf16(n * half)).unwrap();
                        let out = GemvOutput::Glu(&mut dg, act);
                        ctx.gemv_fused(&dx, input, &dw, out, n, k, m).unwrap();
                        let got = to_f64(&ctx.download(&dg).unwrap());
                        let tag = format!("glu out {act:?} normed {normed} {tag}");
                        assert_close(&tag, &got, &want, 2e-2);
                    }
                }
            }
        }
    }
    // bad shapes are refused with a message naming them
    let (dx, dw) = (
        ctx.upload(&nan_bf16(9 * 104)).unwrap(),
        ctx.upload(&nan_bf16(104)).unwrap(),
    );
    let mut y = ctx.alloc::<f32>(9).unwrap();
    let err = ctx
        .gemv_fused(
            &dx,
            GemvInput::Plain,
            &dw,
            GemvOutput::F32(&mut y),
            9,
            104,
            1,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("n=9"), "{err}");
}

#[test]
fn qkv_post_matches_the_separate_kernels() {
    let Some(ctx) = gpu("qkv_post") else { return };
    let mut rng = Rng::new(22);
    // (head_dim, rot_dim, q heads, kv heads, with q/k norms)
    for &(hd, rot, hq, hk, norms) in &[
        (128usize, 128usize, 32usize, 8usize, true),
        (64, 32, 4, 1, true),
        (256, 256, 4, 1, false),
    ] {
        let n = 2;
        let kv = KvLayout {
            num_slots: 3,
            kv_heads: hk,
            capacity: 64,
            head_dim: hd,
            fp8: false,
        };
        let q = rng.vec_bf16(n * hq * hd, 1.0);
        let k = rng.vec_bf16(n * hk * hd, 1.0);
        let v = rng.vec_bf16(n * hk * hd, 1.0);
        let qn: Vec<f32> = (0..hd).map(|_| 1.0 + rng.normal(0.3)).collect();
        let kn: Vec<f32> = (0..hd).map(|_| 1.0 + rng.normal(0.3)).collect();
        let freqs: Vec<f64> = (0..rot / 2)
            .map(|i| 1e6f64.powf(-2.0 * i as f64 / rot as f64))
            .collect();
        // row 0 past the cache (RoPE at 131K, not cached), row 1 cached
        let pos = vec![131_000u32, rng.below(64) as u32];
        let slots = vec![2u32, 0];
        let cache = |rng: &mut Rng| -> Vec<bf16> {
            (0..kv.elems())
                .map(|_| bf16::from_f32(rng.uniform()))
                .collect()
        };
        let (init_k, init_v) = (cache(&mut rng), cache(&mut rng));
        let eps = 1e-6f32;
        let up = |d: &[bf16]| ctx.upload(d).unwrap();
        let (dp, ds, dqn, dkn, df) = (
            ctx.upload(&pos).unwrap(),
            ctx.upload(&slots).unwrap(),
            ctx.upload(&qn).unwrap(),
            ctx.upload(&kn).unwrap(),
            ctx.upload(&freqs).unwrap(),
        );

        // the chain of separate kernels
        let (mut q1, mut k1, v1) = (up(&q), up(&k), up(&v));
        let (mut kc1, mut vc1) = (up(&init_k), up(&init_v));
        let cfg = RmsNorm { eps, gemma: false };
        if norms {
            ctx.head_rmsnorm(&mut q1, &dqn, n * hq, hd, cfg).unwrap();
            ctx.head_rmsnorm(&mut k1, &dkn, n * hk, hd, cfg).unwrap();
        }
        let rope = Rope {
            theta: 1.0,
            rot_dim: rot,
            pos_scale: 1.0,
        };
        ctx.rope_neox_with(&mut q1, Some(&mut k1), &dp, n, hq, hk, hd, rope, Some(&df))
            .unwrap();
        ctx.kv_append(&k1, &v1, &mut kc1, &mut vc1, &dp, &ds, n, kv)
            .unwrap();

        // the fused kernel on the merged rows [q | k | v]
        let (qr, kr) = (hq * hd, hk * hd);
        let qkv: Vec<bf16> = (0..n)
            .flat_map(|t| {
                let (q, k, v) = (&q, &k, &v);
                q[t * qr..(t + 1) * qr]
                    .iter()
                    .chain(&k[t * kr..(t + 1) * kr])
                    .chain(&v[t * kr..(t + 1) * kr])
                    .copied()
            })
            .collect();
        let dqkv = up(&qkv);
        let mut q2 = up(&nan_bf16(n * qr));
        let (mut kc2, mut vc2) = (up(&init_k), up(&init_v));
        let p = QkvPost {
            n_tokens: n,
            q_heads: hq,
            q_norm: norms.then_some(&dqn),
            k_norm: norms.then_some(&dkn),
            eps,
            rot_dim: rot,
            inv_freq: &df,
            amax: 0,
            rope_pos: 0,
        };
        ctx.qkv_post(&dqkv, &mut q2, &mut kc2, &mut vc2, &dp, &ds, kv, &p)
            .unwrap();

        let tag = format!("hd {hd} rot {rot} norms {norms}");
        let d = |b: &slowfast_cuda::GpuBuffer<bf16>| to_f64(&ctx.download(b).unwrap());
        assert_close(&format!("q {tag}"), &d(&q2), &d(&q1), 1e-3);
        // the cache rows written and nothing else
        let (kc1, kc2, vc1, vc2) = (d(&kc1), d(&kc2), d(&vc1), d(&vc2));
        let mut changed = 0;
        for i in 0..kv.elems() {
            if kc2[i] != init_k[i].to_f64() || vc2[i] != init_v[i].to_f64() {
                changed += 1;
            }
        }
        assert!(
            changed <= (n - 1) * hk * hd,
            "{tag}: {changed} cache elements changed, at most {} written",
            (n - 1) * hk * hd
        );
        let (pos, slots) = (&pos, &slots);
        let rows: Vec<usize> = (1..n)
            .flat_map(|t| {
                (0..hk).map(move |h| {
                    ((slots[t] as usize * hk + h) * kv.capacity + pos[t] as usize) * hd
                })
            })
            .collect();
        let pick = |c: &[f64]| -> Vec<f64> {
            rows.iter()
                .flat_map(|&r| c[r..r + hd].iter().copied())
                .collect()
        };
        assert_close(&format!("k cache {tag}"), &pick(&kc2), &pick(&kc1), 1e-3);
        assert_eq!(pick(&vc2), pick(&vc1), "{tag}: v cache rows");
    }
}

/// Flash-decoding with the q/k/v post-processing inside (`attn_decode_post`) against
/// `qkv_post` followed by `attn_decode`, on the same merged rows and caches: the attention
/// output, its log-sum-exp and both caches bit-identical. The new position at and next to the
/// 64-key tile edges and split ends, windows, batch 2 in permuted slots, 32 query heads on one
/// kv head (two row groups), a partial rotation, with and without the head norms.
#[test]
fn attn_decode_post_equals_qkv_post_then_decode() {
    use slowfast_cuda::{AttnWorkspace, DecodeAttn};
    let Some(ctx) = gpu("attn_decode_post") else {
        return;
    };
    let mut rng = Rng::new(31);
    // (head_dim, q heads, kv heads, rot, norms, lens, window)
    type Case = (
        usize,
        usize,
        usize,
        usize,
        bool,
        &'static [usize],
        Option<usize>,
    );
    let cases: &[Case] = &[
        (128, 32, 8, 128, true, &[1], None),
        (128, 32, 8, 128, true, &[64], None),
        (128, 32, 8, 128, true, &[65], None),
        (128, 32, 8, 128, true, &[3001], None),
        (128, 32, 8, 128, true, &[3001], Some(700)),
        (128, 32, 8, 128, false, &[100, 2049], None),
        (256, 4, 1, 256, true, &[600], Some(512)),
        (64, 8, 2, 32, false, &[1000, 7], None),
        (64, 32, 1, 64, true, &[257], None),
    ];
    for &(hd, hq, hk, rot, norms, lens, window) in cases {
        let batch = lens.len();
        let cap = lens.iter().max().unwrap() + 3;
        let kv = KvLayout {
            num_slots: batch + 1,
            kv_heads: hk,
            capacity: cap,
            head_dim: hd,
            fp8: false,
        };
        let slots: Vec<u32> = (0..batch)
            .map(|b| ((b + 1) % kv.num_slots) as u32)
            .collect();
        let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        let pos: Vec<u32> = lens32.iter().map(|&l| l - 1).collect();
        let row = (hq + 2 * hk) * hd;
        let qkv = rng.vec_bf16(batch * row, 1.0);
        let init = |rng: &mut Rng| rng.vec_bf16(kv.elems(), 1.0);
        let (init_k, init_v) = (init(&mut rng), init(&mut rng));
        let qn: Vec<f32> = (0..hd).map(|_| 1.0 + rng.normal(0.3)).collect();
        let kn: Vec<f32> = (0..hd).map(|_| 1.0 + rng.normal(0.3)).collect();
        let freqs: Vec<f64> = (0..rot / 2)
            .map(|i| 10000f64.powf(-2.0 * i as f64 / rot as f64))
            .collect();
        let (dqkv, dl, ds, dp) = (
            ctx.upload(&qkv).unwrap(),
            ctx.upload(&lens32).unwrap(),
            ctx.upload(&slots).unwrap(),
            ctx.upload(&pos).unwrap(),
        );
        let (dqn, dkn, df) = (
            ctx.upload(&qn).unwrap(),
            ctx.upload(&kn).unwrap(),
            ctx.upload(&freqs).unwrap(),
        );
        let post = QkvPost {
            n_tokens: batch,
            q_heads: hq,
            q_norm: norms.then_some(&dqn),
            k_norm: norms.then_some(&dkn),
            eps: 1e-6,
            rot_dim: rot,
            inv_freq: &df,
            amax: 0,
            rope_pos: 0,
        };
        let p = DecodeAttn {
            batch,
            n_heads: hq,
            scale: 0.09,
            window,
            max_seq_len: cap,
            splits: None,
        };
        let rows = batch * hq;
        let mut ws = AttnWorkspace::new();

        // qkv_post, then flash-decoding
        let (mut kc1, mut vc1) = (ctx.upload(&init_k).unwrap(), ctx.upload(&init_v).unwrap());
        let mut q = ctx.upload(&nan_bf16(rows * hd)).unwrap();
        ctx.qkv_post(&dqkv, &mut q, &mut kc1, &mut vc1, &dp, &ds, kv, &post)
            .unwrap();
        let mut o1 = ctx.upload(&nan_bf16(rows * hd)).unwrap();
        let mut l1 = ctx.upload(&vec![f32::NAN; rows]).unwrap();
        ctx.attn_decode(
            &q,
            &kc1,
            &vc1,
            kv,
            &dl,
            &ds,
            &mut o1,
            Some(&mut l1),
            &mut ws,
            &p,
        )
        .unwrap();

        // the one kernel
        let (mut kc2, mut vc2) = (ctx.upload(&init_k).unwrap(), ctx.upload(&init_v).unwrap());
        let mut o2 = ctx.upload(&nan_bf16(rows * hd)).unwrap();
        let mut l2 = ctx.upload(&vec![f32::NAN; rows]).unwrap();
        let kernel = ctx.decode_post_kernel(&p, &kv).expect("a post kernel");
        ctx.attn_decode_post(
            &dqkv,
            &mut kc2,
            &mut vc2,
            kv,
            &dl,
            &ds,
            &dp,
            &mut o2,
            Some(&mut l2),
            &mut ws,
            &p,
            &post,
        )
        .unwrap();

        let tag =
            format!("{kernel} hd {hd} heads {hq}/{hk} rot {rot} lens {lens:?} window {window:?}");
        let bits = |b: &slowfast_cuda::GpuBuffer<bf16>| -> Vec<u16> {
            ctx.download(b)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let fbits = |b: &slowfast_cuda::GpuBuffer<f32>| -> Vec<u32> {
            ctx.download(b)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        assert_eq!(bits(&o2), bits(&o1), "{tag}: attention output");
        assert_eq!(fbits(&l2), fbits(&l1), "{tag}: lse");
        assert_eq!(bits(&kc2), bits(&kc1), "{tag}: k cache");
        assert_eq!(bits(&vc2), bits(&vc1), "{tag}: v cache");
        // and the new rows were written at all (against the initial caches)
        let k_new = bits(&kc2);
        let at = ((slots[0] as usize * hk) * cap + pos[0] as usize) * hd;
        assert_ne!(
            &k_new[at..at + hd],
            &init_k[at..at + hd]
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()[..],
            "{tag}: the new k row"
        );
        println!("{tag}: bit-identical");
    }
}
