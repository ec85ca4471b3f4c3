//! Flash-decoding and prefill flash attention against an f64 CPU reference on random inputs,
//! with NaN poison in every cache row that must not be read.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use slowfast_cuda::ops::attention::{prefill_is_wgmma, PREFILL_VARIANTS};
use slowfast_cuda::{bf16, AttnWorkspace, DecodeAttn, KvLayout, PrefillAttn};

/// Reference attention of one query row over keys [lo, hi) of one (slot, kv head).
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[bf16],
    kc: &[bf16],
    vc: &[bf16],
    base: usize,
    d: usize,
    lo: usize,
    hi: usize,
    scale: f64,
) -> (Vec<f64>, f64) {
    if lo >= hi {
        return (vec![0.0; d], f64::NEG_INFINITY);
    }
    let s: Vec<f64> = (lo..hi)
        .map(|j| {
            (0..d)
                .map(|c| q[c].to_f64() * kc[base + j * d + c].to_f64())
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = p.iter().sum();
    let mut o = vec![0.0; d];
    for (jj, j) in (lo..hi).enumerate() {
        for c in 0..d {
            o[c] += p[jj] * vc[base + j * d + c].to_f64();
        }
    }
    (o.iter().map(|x| x / z).collect(), m + z.ln())
}

fn check_lse(what: &str, got: &[f32], want: &[f64]) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert!(g == f32::NEG_INFINITY, "{what}: lse[{i}] = {g}, want -inf");
        } else {
            assert!(
                (g as f64 - w).abs() < 2e-2,
                "{what}: lse[{i}] = {g}, want {w}"
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_decode(
    ctx: &slowfast_cuda::CudaContext,
    rng: &mut Rng,
    d: usize,
    n_heads: usize,
    kv_heads: usize,
    lens: &[usize],
    window: Option<usize>,
    splits: Option<usize>,
    max_seq_len: Option<usize>,
) {
    let batch = lens.len();
    let cap = lens.iter().cloned().max().unwrap_or(1).max(1) + 5;
    let kv = KvLayout {
        num_slots: batch + 1,
        kv_heads,
        capacity: cap,
        head_dim: d,
        fp8: false,
    };
    // sequence b lives in slot (b + 1) % num_slots
    let slots: Vec<u32> = (0..batch)
        .map(|b| ((b + 1) % kv.num_slots) as u32)
        .collect();
    let sl: Vec<(usize, usize)> = (0..batch).map(|b| (slots[b] as usize, lens[b])).collect();
    let kc = fill_cache(rng, &kv, &sl);
    let vc = fill_cache(rng, &kv, &sl);
    let q = rng.vec_bf16(batch * n_heads * d, 1.0);
    let scale = 1.0 / (d as f64).sqrt() * 1.5;
    let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let (dq, dk, dv) = (
        ctx.upload(&q).unwrap(),
        ctx.upload(&kc).unwrap(),
        ctx.upload(&vc).unwrap(),
    );
    let (dl, ds) = (ctx.upload(&lens32).unwrap(), ctx.upload(&slots).unwrap());
    let mut out = ctx.upload(&nan_bf16(batch * n_heads * d)).unwrap();
    let mut lse = ctx.upload(&vec![f32::NAN; batch * n_heads]).unwrap();
    let mut ws = AttnWorkspace::new();
    let p = DecodeAttn {
        batch,
        n_heads,
        scale: scale as f32,
        window,
        max_seq_len: max_seq_len.unwrap_or(cap),
        splits,
    };
    ctx.attn_decode(
        &dq,
        &dk,
        &dv,
        kv,
        &dl,
        &ds,
        &mut out,
        Some(&mut lse),
        &mut ws,
        &p,
    )
    .unwrap();
    let got = to_f64(&ctx.download(&out).unwrap());
    let got_lse = ctx.download(&lse).unwrap();
    let g = n_heads / kv_heads;
    let mut want = Vec::new();
    let mut want_lse = Vec::new();
    for b in 0..batch {
        for h in 0..n_heads {
            let base = (slots[b] as usize * kv_heads + h / g) * cap * d;
            let hi = lens[b];
            let lo = window.map_or(0, |w| hi.saturating_sub(w));
            let qo = (b * n_heads + h) * d;
            let (o, l) = attend(&q[qo..qo + d], &kc, &vc, base, d, lo, hi, scale);
            want.extend(o);
            want_lse.push(l);
        }
    }
    let what = format!(
        "decode d{d} h{n_heads}/{kv_heads} lens {lens:?} window {window:?} splits {:?}",
        ctx.decode_split(&p, &kv)
    );
    assert_close(&what, &got, &want, 2e-2);
    check_lse(&what, &got_lse, &want_lse);
}

#[test]
fn decode_matches_reference() {
    let Some(ctx) = gpu("decode_matches_reference") else {
        return;
    };
    // Both splits: even on the device at every step (the default), and the host's chunk of
    // whole tiles.
    for balance in [true, false] {
        ctx.set_decode_balance(balance);
        decode_cases(&ctx, balance);
    }
    ctx.set_decode_balance(true);
}

fn decode_cases(ctx: &slowfast_cuda::CudaContext, balance: bool) {
    let mut rng = Rng::new(11 + balance as u64);
    let lens: Vec<usize> = (0..5).map(|_| 1 + rng.below(3000)).collect();
    run_decode(ctx, &mut rng, 128, 32, 8, &lens, None, None, None);
    run_decode(ctx, &mut rng, 128, 32, 8, &lens, Some(700), None, None);
    run_decode(ctx, &mut rng, 128, 32, 8, &lens, None, Some(1), None);
    run_decode(ctx, &mut rng, 128, 32, 8, &lens, None, Some(7), None);
    run_decode(
        ctx,
        &mut rng,
        256,
        4,
        1,
        &[2500, 1, 64, 65],
        None,
        None,
        None,
    );
    run_decode(
        ctx,
        &mut rng,
        256,
        4,
        1,
        &[2500, 1, 64, 65],
        Some(512),
        None,
        None,
    );
    run_decode(ctx, &mut rng, 64, 32, 1, &[777, 0, 1500], None, None, None);
    run_decode(ctx, &mut rng, 128, 8, 8, &[4000], None, None, None);
    // a max_seq_len below the real lengths only unbalances the splits
    run_decode(ctx, &mut rng, 128, 32, 8, &lens, None, Some(4), Some(100));
    let big: Vec<usize> = (0..64).map(|_| 1 + rng.below(600)).collect();
    run_decode(ctx, &mut rng, 128, 16, 2, &big, None, None, None);
    // one key past a whole number of tiles a split, and splits that do not divide the keys
    run_decode(
        ctx,
        &mut rng,
        128,
        32,
        8,
        &[4097],
        None,
        Some(16),
        Some(4097),
    );
    run_decode(
        ctx,
        &mut rng,
        128,
        32,
        8,
        &[4097, 70],
        None,
        Some(7),
        Some(4097),
    );
    run_decode(ctx, &mut rng, 64, 8, 2, &[5, 3], None, Some(16), None);
}

#[allow(clippy::too_many_arguments)]
fn run_prefill(
    ctx: &slowfast_cuda::CudaContext,
    rng: &mut Rng,
    d: usize,
    n_heads: usize,
    kv_heads: usize,
    pos0: usize,
    n: usize,
    window: Option<usize>,
) {
    let kv_len = pos0 + n;
    let kv = KvLayout {
        num_slots: 2,
        kv_heads,
        capacity: kv_len + 70,
        head_dim: d,
        fp8: false,
    };
    let slot = 1;
    let kc = fill_cache(rng, &kv, &[(slot, kv_len)]);
    let vc = fill_cache(rng, &kv, &[(slot, kv_len)]);
    let q = rng.vec_bf16(n * n_heads * d, 1.0);
    let scale = 1.0 / (d as f64).sqrt() * 2.0;
    let (dq, dk, dv) = (
        ctx.upload(&q).unwrap(),
        ctx.upload(&kc).unwrap(),
        ctx.upload(&vc).unwrap(),
    );
    let mut out = ctx.upload(&nan_bf16(n * n_heads * d)).unwrap();
    let mut lse = ctx.upload(&vec![f32::NAN; n * n_heads]).unwrap();
    let p = PrefillAttn {
        n_tokens: n,
        n_heads,
        slot,
        pos0,
        scale: scale as f32,
        window,
    };
    let g = n_heads / kv_heads;
    let mut want = Vec::new();
    let mut want_lse = Vec::new();
    for i in 0..n {
        let pos = pos0 + i;
        for h in 0..n_heads {
            let base = (slot * kv_heads + h / g) * kv.capacity * d;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let qo = (i * n_heads + h) * d;
            let (o, l) = attend(&q[qo..qo + d], &kc, &vc, base, d, lo, pos + 1, scale);
            want.extend(o);
            want_lse.push(l);
        }
    }
    // the default kernel, then every variant for this head_dim
    let variants = PREFILL_VARIANTS
        .iter()
        .filter(|v| v.1 == d && (ctx.has_wgmma() || !prefill_is_wgmma(v.0)))
        .map(|v| Some(v.0));
    for kernel in std::iter::once(None).chain(variants) {
        ctx.upload_into(&nan_bf16(n * n_heads * d), &mut out)
            .unwrap();
        ctx.upload_into(&vec![f32::NAN; n * n_heads], &mut lse)
            .unwrap();
        match kernel {
            None => ctx
                .attn_prefill(&dq, &dk, &dv, kv, &mut out, Some(&mut lse), &p)
                .unwrap(),
            Some(k) => ctx
                .attn_prefill_with_kernel(&dq, &dk, &dv, kv, &mut out, Some(&mut lse), &p, k)
                .unwrap(),
        }
        let got = to_f64(&ctx.download(&out).unwrap());
        let got_lse = ctx.download(&lse).unwrap();
        let what = format!(
            "prefill {} d{d} h{n_heads}/{kv_heads} pos0 {pos0} n {n} window {window:?}",
            kernel.unwrap_or("default")
        );
        assert_close(&what, &got, &want, 2e-2);
        check_lse(&what, &got_lse, &want_lse);
    }
}

#[test]
fn prefill_matches_reference() {
    let Some(ctx) = gpu("prefill_matches_reference") else {
        return;
    };
    let mut rng = Rng::new(12);
    run_prefill(&ctx, &mut rng, 128, 8, 2, 0, 300, None);
    run_prefill(&ctx, &mut rng, 128, 8, 2, 200, 150, Some(100));
    run_prefill(&ctx, &mut rng, 128, 4, 4, 0, 1, None);
    run_prefill(&ctx, &mut rng, 256, 4, 1, 37, 200, None);
    run_prefill(&ctx, &mut rng, 256, 4, 1, 0, 333, Some(64));
    run_prefill(&ctx, &mut rng, 64, 4, 4, 5, 130, None);
    run_prefill(&ctx, &mut rng, 64, 8, 2, 300, 257, Some(200));
    run_prefill(&ctx, &mut rng, 128, 8, 1, 1000, 129, Some(333));
    // many key tiles (the online softmax's rescales), a start off the 128-row grid
    run_prefill(&ctx, &mut rng, 128, 8, 2, 64, 700, None);
}

#[test]
fn bad_shapes_are_refused() {
    let Some(ctx) = gpu("bad_shapes_are_refused") else {
        return;
    };
    let kv = KvLayout {
        num_slots: 1,
        kv_heads: 2,
        capacity: 16,
        head_dim: 96,
        fp8: false,
    };
    let b = ctx.alloc::<bf16>(4096).unwrap();
    let mut o = ctx.alloc::<bf16>(4096).unwrap();
    let p = PrefillAttn {
        n_tokens: 4,
        n_heads: 4,
        slot: 0,
        pos0: 0,
        scale: 0.1,
        window: None,
    };
    let e = ctx
        .attn_prefill(&b, &b, &b, kv, &mut o, None, &p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("head_dim 96"), "{e}");
    let kv = KvLayout { head_dim: 64, ..kv };
    let p = PrefillAttn { pos0: 14, ..p };
    let e = ctx
        .attn_prefill(&b, &b, &b, kv, &mut o, None, &p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("capacity 16"), "{e}");
}

/// Speculative verification: `rps` causal rows per sequence against the f64 reference of each
/// row alone, with row 0's captured scores where the slot's flag is set.
#[allow(clippy::too_many_arguments)]
fn run_verify(
    ctx: &slowfast_cuda::CudaContext,
    rng: &mut Rng,
    d: usize,
    n_heads: usize,
    kv_heads: usize,
    first: &[usize],
    rps: usize,
    window: Option<usize>,
) {
    let seqs = first.len();
    let cap = first.iter().cloned().max().unwrap_or(1) + rps + 3;
    let kv = KvLayout {
        num_slots: seqs + 1,
        kv_heads,
        capacity: cap,
        head_dim: d,
        fp8: false,
    };
    // sequence b lives in slot (b + 1) % num_slots; its rows see first[b] .. first[b] + rps - 1
    let slot_of: Vec<usize> = (0..seqs).map(|b| (b + 1) % kv.num_slots).collect();
    let sl: Vec<(usize, usize)> = (0..seqs)
        .map(|b| (slot_of[b], first[b] + rps - 1))
        .collect();
    let kc = fill_cache(rng, &kv, &sl);
    let vc = fill_cache(rng, &kv, &sl);
    let rows = seqs * rps;
    let q = rng.vec_bf16(rows * n_heads * d, 1.0);
    let scale = 1.0 / (d as f64).sqrt() * 1.5;
    let lens: Vec<u32> = (0..rows)
        .map(|i| (first[i / rps] + i % rps) as u32)
        .collect();
    let slots: Vec<u32> = (0..rows).map(|i| slot_of[i / rps] as u32).collect();
    // capture row 0 of every other sequence, its scores into score row `slot` (flag slot + 1)
    let flags: Vec<u32> = (0..kv.num_slots)
        .map(|s| {
            let on = (0..seqs).any(|b| slot_of[b] == s && b % 2 == 0);
            if on {
                s as u32 + 1
            } else {
                0
            }
        })
        .collect();
    let (dq, dk, dv) = (
        ctx.upload(&q).unwrap(),
        ctx.upload(&kc).unwrap(),
        ctx.upload(&vc).unwrap(),
    );
    let (dl, ds, df) = (
        ctx.upload(&lens).unwrap(),
        ctx.upload(&slots).unwrap(),
        ctx.upload(&flags).unwrap(),
    );
    let lg = vec![f32::NAN; kv.num_slots * n_heads * cap];
    let logits = ctx.upload(&lg).unwrap();
    let mut out = ctx.upload(&nan_bf16(rows * n_heads * d)).unwrap();
    let mut ws = AttnWorkspace::new();
    let p = DecodeAttn {
        batch: seqs,
        n_heads,
        scale: scale as f32,
        window,
        max_seq_len: cap,
        splits: None,
    };
    let capture = Some((logits.device_ptr(), df.device_ptr(), cap));
    ctx.attn_verify(
        &dq, &dk, &dv, kv, &dl, &ds, &mut out, &mut ws, &p, rps, capture,
    )
    .unwrap();
    let got = to_f64(&ctx.download(&out).unwrap());
    let got_logits = ctx.download(&logits).unwrap();
    let g = n_heads / kv_heads;
    let mut want = Vec::new();
    for i in 0..rows {
        for h in 0..n_heads {
            let base = (slots[i] as usize * kv_heads + h / g) * cap * d;
            let hi = lens[i] as usize;
            let lo = window.map_or(0, |w| hi.saturating_sub(w));
            let qo = (i * n_heads + h) * d;
            want.extend(attend(&q[qo..qo + d], &kc, &vc, base, d, lo, hi, scale).0);
        }
    }
    let what =
        format!("verify d{d} h{n_heads}/{kv_heads} first {first:?} rows {rps} window {window:?}");
    assert_close(&what, &got, &want, 2e-2);
    // row 0's scores of the flagged slots, in log2 units; nothing else written
    for b in 0..seqs {
        let s = slot_of[b];
        for h in 0..n_heads {
            let base = (s * kv_heads + h / g) * cap * d;
            let qo = (b * rps * n_heads + h) * d;
            let hi = first[b];
            let lo = window.map_or(0, |w| hi.saturating_sub(w));
            for j in 0..cap {
                let got = got_logits[(s * n_heads + h) * cap + j];
                if flags[s] != 0 && j >= lo && j < hi {
                    let dot: f64 = (0..d)
                        .map(|c| q[qo + c].to_f64() * kc[base + j * d + c].to_f64())
                        .sum();
                    let want = dot * scale * std::f64::consts::LOG2_E;
                    assert!(
                        (got as f64 - want).abs() < 2e-2 * (1.0 + want.abs()),
                        "{what}: score slot {s} head {h} key {j} = {got}, want {want}"
                    );
                } else {
                    assert!(
                        got.is_nan(),
                        "{what}: score slot {s} head {h} key {j} written"
                    );
                }
            }
        }
    }
}

#[test]
fn verify_matches_reference() {
    let Some(ctx) = gpu("verify_matches_reference") else {
        return;
    };
    let mut rng = Rng::new(31);
    // Qwen3-4B's group of 4: 1 row = one 16-row group partly used, 4 rows fill it (one group
    // a block), 5 need two groups (attn_verify_d128_g2), 9 three (_g3: one block reads each
    // K/V tile for all of them)
    run_verify(&ctx, &mut rng, 128, 32, 8, &[3000, 65, 1], 1, None);
    run_verify(&ctx, &mut rng, 128, 32, 8, &[3000, 65, 1], 4, None);
    run_verify(&ctx, &mut rng, 128, 32, 8, &[3000, 650, 3], 5, None);
    run_verify(&ctx, &mut rng, 128, 32, 8, &[2900, 700, 64], 9, None);
    run_verify(&ctx, &mut rng, 128, 32, 8, &[2900, 700, 64], 9, Some(512));
    // Gemma 3 270M: 4 heads, 1 kv head, head dim 256, a 512-key window on most layers; 7 rows
    // are two groups (_g2), 9 rows three: two block columns of _g2, the second half idle
    run_verify(&ctx, &mut rng, 256, 4, 1, &[4000, 300], 7, Some(512));
    run_verify(&ctx, &mut rng, 256, 4, 1, &[4000, 300], 3, None);
    run_verify(&ctx, &mut rng, 256, 4, 1, &[4000, 300], 9, None);
    // a group of 16 (rows past one mma group each), head dim 64: 5 groups, two columns of _g4
    run_verify(&ctx, &mut rng, 64, 32, 2, &[1500, 17], 5, None);
}

/// fp8 caches: flash-decoding, the sparse fast step's kernel (over a compact buffer) and
/// prefill attention over e4m3 caches give bit for bit what the bf16 kernels give over the
/// same values widened to bf16 (the fp8 kernels widen their tiles in shared memory).
#[test]
fn fp8_caches_read_as_their_bf16_widening() {
    use slowfast_cuda::fp8::{e4m3_from_f32, e4m3_to_f32, pack_e4m3};
    let Some(ctx) = gpu("fp8_caches_read_as_their_bf16_widening") else {
        return;
    };
    let mut rng = Rng::new(0xf8);
    for d in [64, 128, 256] {
        let (n_heads, kv_heads) = (8, 2);
        let lens = [300usize, 77, 1];
        let batch = lens.len();
        let kv = KvLayout {
            num_slots: batch,
            kv_heads,
            capacity: 320,
            head_dim: d,
            fp8: false,
        };
        let kv8 = KvLayout { fp8: true, ..kv };
        let mut caches = Vec::new();
        for _ in 0..2 {
            let bytes: Vec<u8> = (0..kv.elems())
                .map(|_| e4m3_from_f32(rng.normal(3.0)))
                .collect();
            let wide: Vec<bf16> = bytes
                .iter()
                .map(|&b| bf16::from_f32(e4m3_to_f32(b)))
                .collect();
            caches.push((
                ctx.upload(&pack_e4m3(&bytes)).unwrap(),
                ctx.upload(&wide).unwrap(),
            ));
        }
        let [(k8, k16), (v8, v16)] = [caches.remove(0), caches.remove(0)];
        let q = ctx.upload(&rng.vec_bf16(batch * n_heads * d, 1.0)).unwrap();
        let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        let slots: Vec<u32> = (0..batch as u32).collect();
        let (dl, ds) = (ctx.upload(&lens32).unwrap(), ctx.upload(&slots).unwrap());
        let p = DecodeAttn {
            batch,
            n_heads,
            scale: 0.1,
            window: None,
            max_seq_len: 320,
            splits: None,
        };
        let mut outs = Vec::new();
        for (k, v, layout) in [(&k16, &v16, kv), (&k8, &v8, kv8)] {
            let mut out = ctx.upload(&nan_bf16(batch * n_heads * d)).unwrap();
            let mut ws = AttnWorkspace::new();
            ctx.attn_decode(&q, k, v, layout, &dl, &ds, &mut out, None, &mut ws, &p)
                .unwrap();
            outs.push(ctx.download(&out).unwrap());
        }
        assert_eq!(outs[0], outs[1], "decode d{d}: fp8 != bf16 widening");
        // prefill: 64 query rows at positions 200.. of slot 0, through the same kernel
        let kernel = match d {
            64 => "attn_prefill_d64",
            128 => "attn_prefill_d128",
            _ => "attn_prefill_d256",
        };
        let qp = ctx.upload(&rng.vec_bf16(64 * n_heads * d, 1.0)).unwrap();
        let pp = PrefillAttn {
            n_tokens: 64,
            n_heads,
            slot: 0,
            pos0: 200,
            scale: 0.1,
            window: None,
        };
        let mut outs = Vec::new();
        for (k, v, layout) in [(&k16, &v16, kv), (&k8, &v8, kv8)] {
            let mut out = ctx.upload(&nan_bf16(64 * n_heads * d)).unwrap();
            ctx.attn_prefill_with_kernel(&qp, k, v, layout, &mut out, None, &pp, kernel)
                .unwrap();
            outs.push(ctx.download(&out).unwrap());
        }
        assert_eq!(outs[0], outs[1], "prefill d{d}: fp8 != bf16 widening");
        // the default prefill kernel over fp8 (never the bf16-only wgmma one)
        let mut out = ctx.upload(&nan_bf16(64 * n_heads * d)).unwrap();
        ctx.attn_prefill(&qp, &k8, &v8, kv8, &mut out, None, &pp)
            .unwrap();
        let got = to_f64(&ctx.download(&out).unwrap());
        assert!(
            got.iter().all(|x| x.is_finite()),
            "prefill d{d} default kernel"
        );
    }
}
