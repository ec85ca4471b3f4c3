//! Micro-benchmark of the CUDA crate at Qwen3-4B shapes: device-copy bandwidth (the
//! roofline), flash-decoding GB/s for 8K..128K contexts at batch 1 and 8, cuBLAS GEMM
//! TFLOP/s for 32K-token prefill projections and prefill flash-attention TFLOP/s.
//! Usage: cuda_bench [quick | profile]  (profile: one launch of each attention kernel, for ncu)

use slowfast_cuda::{
    bf16, AttnWorkspace, CudaContext, CudaError, DecodeAttn, GpuBuffer, KvLayout, PrefillAttn,
};

fn rand_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0)
        })
        .collect()
}

fn copy_bw(ctx: &CudaContext) -> Result<f64, CudaError> {
    let n = 1usize << 30; // 2 GiB of bf16
    let src = ctx.upload(&rand_bf16(n, 7))?;
    let mut dst = ctx.alloc::<bf16>(n)?;
    ctx.copy(&src, &mut dst)?;
    let ms = ctx.time_ms(20, || ctx.copy(&src, &mut dst))?;
    Ok(2.0 * (n * 2) as f64 / (ms as f64 * 1e-3) / 1e9)
}

fn decode(
    ctx: &CudaContext,
    batch: usize,
    ctx_len: usize,
    copy_gbs: f64,
    splits: Option<usize>,
) -> Result<(), CudaError> {
    let (n_heads, kv_heads, d) = (32, 8, 128);
    let per_seq = 2 * kv_heads * ctx_len * d * 2; // K + V bytes
                                                  // enough replicas that one sweep is >= 1 GiB, so timings do not come from L2
    let reps = (1usize << 30).div_ceil(per_seq * batch).max(1);
    let kv = KvLayout {
        num_slots: batch * reps,
        kv_heads,
        capacity: ctx_len,
        head_dim: d,
    };
    let kc = ctx.upload(&rand_bf16(kv.elems(), 1))?;
    let vc = ctx.upload(&rand_bf16(kv.elems(), 2))?;
    let q = ctx.upload(&rand_bf16(batch * n_heads * d, 3))?;
    let lens = ctx.upload(&vec![ctx_len as u32; batch])?;
    let slot_sets: Vec<GpuBuffer<u32>> = (0..reps)
        .map(|r| {
            ctx.upload(
                &(0..batch)
                    .map(|b| (r * batch + b) as u32)
                    .collect::<Vec<_>>(),
            )
        })
        .collect::<Result<_, _>>()?;
    let mut out = ctx.alloc::<bf16>(batch * n_heads * d)?;
    let mut ws = AttnWorkspace::new();
    let p = DecodeAttn {
        batch,
        n_heads,
        scale: 0.088,
        window: None,
        max_seq_len: ctx_len,
        splits,
    };
    let mut i = 0;
    let mut step = |ws: &mut AttnWorkspace, out: &mut GpuBuffer<bf16>| {
        i += 1;
        ctx.attn_decode(
            &q,
            &kc,
            &vc,
            kv,
            &lens,
            &slot_sets[i % reps],
            out,
            None,
            ws,
            &p,
        )
    };
    for _ in 0..3 {
        step(&mut ws, &mut out)?;
    }
    let iters = (200 * reps).clamp(50, 1000);
    let ms = ctx.time_ms(iters, || step(&mut ws, &mut out))?;
    let bytes = (per_seq * batch) as f64;
    let gbs = bytes / (ms as f64 * 1e-3) / 1e9;
    let (splits, chunk) = ctx.decode_split(&p, &kv);
    println!(
        "decode  b{batch:<2} ctx {:>4}K  {:>8.1} us  {:>6.0} GB/s  {:>5.1}% of copy  (splits {splits}{}, chunk {chunk})",
        ctx_len / 1024,
        ms * 1e3,
        gbs,
        100.0 * gbs / copy_gbs,
        if p.splits.is_some() { " forced" } else { "" }
    );
    Ok(())
}

fn gemm(ctx: &CudaContext, name: &str, n: usize, k: usize, m: usize) -> Result<f64, CudaError> {
    let x = ctx.upload(&rand_bf16(n * k, 4))?;
    let w = ctx.upload(&rand_bf16(m * k, 5))?;
    let mut y = ctx.alloc::<bf16>(n * m)?;
    ctx.linear(&x, &w, &mut y, n, k, m)?;
    let ms = ctx.time_ms(10, || ctx.linear(&x, &w, &mut y, n, k, m))?;
    let tf = 2.0 * (n * k * m) as f64 / (ms as f64 * 1e-3) / 1e12;
    println!(
        "gemm    {name:<10} n {n:>6} in {k:>5} out {m:>6}  {:>8.3} ms  {tf:>6.1} TFLOP/s",
        ms
    );
    Ok(tf)
}

#[allow(clippy::too_many_arguments)]
fn prefill(
    ctx: &CudaContext,
    n_heads: usize,
    kv_heads: usize,
    d: usize,
    n: usize,
    iters: usize,
    kernel: Option<&'static str>,
) -> Result<f64, CudaError> {
    let kv = KvLayout {
        num_slots: 1,
        kv_heads,
        capacity: n,
        head_dim: d,
    };
    let kc = ctx.upload(&rand_bf16(kv.elems(), 6))?;
    let vc = ctx.upload(&rand_bf16(kv.elems(), 7))?;
    let q = ctx.upload(&rand_bf16(n * n_heads * d, 8))?;
    let mut out = ctx.alloc::<bf16>(n * n_heads * d)?;
    let mut lse = ctx.alloc::<f32>(n * n_heads)?;
    let p = PrefillAttn {
        n_tokens: n,
        n_heads,
        slot: 0,
        pos0: 0,
        scale: 1.0 / (d as f32).sqrt(),
        window: None,
    };
    let mut run = || match kernel {
        None => ctx.attn_prefill(&q, &kc, &vc, kv, &mut out, Some(&mut lse), &p),
        Some(k) => ctx.attn_prefill_with_kernel(&q, &kc, &vc, kv, &mut out, Some(&mut lse), &p, k),
    };
    run()?;
    let ms = ctx.time_ms(iters, &mut run)?;
    // causal: n(n+1)/2 scored pairs, 4 d flops each (QK^T and PV)
    let flops = 4.0 * d as f64 * n_heads as f64 * (n as f64 * (n as f64 + 1.0) / 2.0);
    let tf = flops / (ms as f64 * 1e-3) / 1e12;
    println!(
        "prefill attn {:<22} h{n_heads}/{kv_heads} d{d} n {:>4}K  {:>9.2} ms  {tf:>6.1} TFLOP/s",
        kernel.unwrap_or("default"),
        n / 1024,
        ms
    );
    Ok(tf)
}

fn main() -> Result<(), CudaError> {
    let quick = std::env::args().any(|a| a == "quick");
    let t0 = std::time::Instant::now();
    let ctx = CudaContext::new(0)?;
    println!(
        "device {} sm_{}{} ({} SMs), kernels from cache: {}, start {:.2}s",
        ctx.device_name(),
        ctx.compute_capability().0,
        ctx.compute_capability().1,
        ctx.sm_count(),
        ctx.kernels_from_cache(),
        t0.elapsed().as_secs_f64()
    );
    if std::env::args().any(|a| a == "profile") {
        // one launch of each attention kernel of interest, for ncu
        for k in ["attn_prefill_d128", "attn_prefill_d128_m2"] {
            prefill(&ctx, 32, 8, 128, 8192, 1, Some(k))?;
        }
        decode(&ctx, 1, 131072, 1.0, None)?;
        return Ok(());
    }
    let bw = copy_bw(&ctx)?;
    println!("copy    device-to-device {bw:.0} GB/s (read + write)");
    let ctxs: &[usize] = if quick {
        &[32768]
    } else {
        &[8192, 16384, 32768, 65536, 131072]
    };
    for &b in &[1usize, 8] {
        for &c in ctxs {
            decode(&ctx, b, c, bw, None)?;
        }
    }
    for &(b, c) in &[(1usize, 32768usize), (1, 131072), (8, 131072)] {
        for splits in [8usize, 16, 32, 66, 132] {
            decode(&ctx, b, c, bw, Some(splits))?;
        }
    }
    let big = gemm(&ctx, "8192^3", 8192, 8192, 8192)?;
    let n = 32768;
    let mut flops = 0.0;
    let mut secs = 0.0;
    for (name, k, m) in [
        ("qkv", 2560, 6144),
        ("o_proj", 4096, 2560),
        ("gate_up", 2560, 19456),
        ("down", 9728, 2560),
    ] {
        let tf = gemm(&ctx, name, n, k, m)?;
        let f = 2.0 * (n * k * m) as f64;
        flops += f;
        secs += f / (tf * 1e12);
    }
    println!(
        "gemm    Qwen3-4B layer projections at 32K tokens: {:.1} TFLOP/s overall",
        flops / secs / 1e12
    );
    let mut best = 0.0f64;
    for k in [None, Some("attn_prefill_d128")] {
        best = best.max(prefill(&ctx, 32, 8, 128, 32768, 3, k)?);
    }
    println!(
        "prefill attn (best d128 variant) / 8192^3 GEMM rate: {:.0}%",
        100.0 * best / big
    );
    prefill(&ctx, 8, 1, 256, 32768, 3, None)?;
    prefill(&ctx, 32, 8, 64, 32768, 3, None)?;
    prefill(&ctx, 32, 8, 64, 32768, 3, Some("attn_prefill_d64"))?;
    if !quick {
        prefill(&ctx, 32, 8, 128, 131072, 1, None)?;
    }
    Ok(())
}
