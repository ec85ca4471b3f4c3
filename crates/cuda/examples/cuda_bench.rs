//! Micro-benchmark of the CUDA crate at Qwen3-4B shapes: device-copy bandwidth (the
//! roofline), flash-decoding GB/s for 8K..128K contexts at batch 1 and 8, cuBLAS GEMM
//! TFLOP/s for 32K-token prefill projections and prefill flash-attention TFLOP/s.
//! Usage: cuda_bench [quick | profile | profile-gemv | gemv | gemvb | prefill | decode]
//! (profile: one launch of each attention kernel, for ncu; profile-gemv: the 6-row tensor-core
//! GEMV and the 1-row fused GEMV on the same weights, for ncu; gemv: the 1-row GEMV kernels
//! against the pure read rate, shape by shape, then a 36-layer chain of the four projections;
//! gemvb: 3-8 rows, cuBLAS against the tensor-core GEMV, shape by shape and as a graph of a
//! 6-row step's 144; prefill: the head-dim-128 prefill kernels side by side at 8K and 32K, then
//! the default at 128K; decode: flash-decoding alone at 8K-128K)

use slowfast_cuda::{
    bf16, AttnWorkspace, CudaContext, CudaError, DecodeAttn, GemvInput, GemvOutput, Glu, GpuBuffer,
    KvLayout, PrefillAttn,
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
        fp8: false,
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
    let (kernel, splits, chunk) = ctx.decode_plan(&p, &kv);
    println!(
        "decode  b{batch:<2} ctx {:>4}K  {:>8.1} us  {:>6.0} GB/s  {:>5.1}% of copy  ({kernel}, splits {splits}{}, chunk {chunk})",
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
        fp8: false,
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

/// One decode-step projection of Qwen3-4B as the fused step runs it: name, input mode (0
/// plain, 1 RMS-normed), in, out, output (0 bf16, 1 f32, 2 residual add, 3 GLU of the rows).
const PROJ: [(&str, usize, usize, usize, usize); 5] = [
    ("qkv", 1, 2560, 6144, 0),
    ("o", 0, 4096, 2560, 2),
    ("gate_up", 1, 2560, 19456, 3),
    ("down", 0, 9728, 2560, 2),
    ("lm_head", 0, 2560, 151936, 1),
];

/// One row through projection `(mode, in, out, kind)` with weights `w`.
#[allow(clippy::too_many_arguments)]
fn gemv_once(
    ctx: &CudaContext,
    mode: usize,
    x: &GpuBuffer<bf16>,
    nw: &GpuBuffer<f32>,
    w: &GpuBuffer<bf16>,
    y16: &mut GpuBuffer<bf16>,
    y32: &mut GpuBuffer<f32>,
    kind: usize,
    in_f: usize,
    out_f: usize,
) -> Result<(), CudaError> {
    let input = match mode {
        0 => GemvInput::Plain,
        _ => GemvInput::Norm { w: nw, eps: 1e-6 },
    };
    let y = match kind {
        0 => GemvOutput::Bf16(y16),
        1 => GemvOutput::F32(y32),
        2 => GemvOutput::Residual(y16),
        _ => GemvOutput::Glu(y16, Glu::SwiGlu),
    };
    ctx.gemv_fused(x, input, w, y, 1, in_f, out_f)
}

/// Copies of one random `[out, in]` weight, enough that a sweep over them is >= 512 MiB (so
/// timings do not come from L2), and the iteration count to time them with.
fn weight_replicas(
    ctx: &CudaContext,
    in_f: usize,
    out_f: usize,
) -> Result<(Vec<GpuBuffer<bf16>>, usize), CudaError> {
    let reps = (512usize << 20).div_ceil(in_f * out_f * 2).max(2);
    let w0 = ctx.upload(&rand_bf16(in_f * out_f, 12))?;
    let mut ws = vec![];
    for _ in 0..reps {
        let mut w = ctx.alloc::<bf16>(in_f * out_f)?;
        ctx.copy(&w0, &mut w)?;
        ws.push(w);
    }
    Ok((ws, (reps * 8).clamp(40, 400)))
}

/// 3-8 rows through each Qwen3-4B decode projection: cuBLAS (what `linear` runs there by
/// default) against the tensor-core GEMV, as a share of the copy rate.
fn small_batch_ab(ctx: &CudaContext, copy_gbs: f64) -> Result<(), CudaError> {
    let x = ctx.upload(&rand_bf16(8 * 9728, 11))?;
    let mut y = ctx.alloc::<bf16>(8 * 151936)?;
    for &(name, _, in_f, out_f, _) in &PROJ {
        let bytes = in_f * out_f * 2;
        let (ws, iters) = weight_replicas(ctx, in_f, out_f)?;
        let reps = ws.len();
        let pct = |ms: f32| 100.0 * bytes as f64 / (ms as f64 * 1e-3) / 1e9 / copy_gbs;
        for n in [3usize, 4, 6, 8] {
            let mut i = 0;
            ctx.set_gemv_mma_rows(0);
            let blas = ctx.time_ms(iters, || {
                i += 1;
                ctx.linear(&x, &ws[i % reps], &mut y, n, in_f, out_f)
            })?;
            let mma = ctx.time_ms(iters, || {
                i += 1;
                ctx.gemv_mma(&x, &ws[i % reps], &mut y, n, in_f, out_f)
            })?;
            println!(
                "gemv    {name:<8} {in_f:>5} -> {out_f:>6}  n {n}  cublas {:>7.2} us {:>5.1}%  mma {:>7.2} us {:>5.1}%",
                blas * 1e3,
                pct(blas),
                mma * 1e3,
                pct(mma)
            );
        }
    }
    small_batch_chain(ctx, copy_gbs, &x, &mut y)
}

/// For ncu (`gpu_run.sh ncu-gemv`): the o, gate|up and down projections, each launched twice at
/// 6 rows through the tensor-core GEMV and twice at 1 row through the fused GEMV, so one profile
/// sets the 6-row kernel beside the 1-row one on the same bytes.
fn profile_gemv(ctx: &CudaContext) -> Result<(), CudaError> {
    let x = ctx.upload(&rand_bf16(8 * 9728, 11))?;
    let nw = ctx.upload(&vec![1.0f32; 9728])?;
    let mut y16 = ctx.alloc::<bf16>(8 * 19456)?;
    let mut y32 = ctx.alloc::<f32>(8 * 19456)?;
    for &(_, mode, in_f, out_f, kind) in &PROJ[1..4] {
        let w = ctx.upload(&rand_bf16(in_f * out_f, 12))?;
        for _ in 0..2 {
            ctx.gemv_mma(&x, &w, &mut y16, 6, in_f, out_f)?;
        }
        for _ in 0..2 {
            gemv_once(
                ctx, mode, &x, &nw, &w, &mut y16, &mut y32, kind, in_f, out_f,
            )?;
        }
    }
    ctx.synchronize()
}

/// `layers` layers of the four projections' weights (values irrelevant: timing only).
fn layer_weights(ctx: &CudaContext, layers: usize) -> Result<Vec<Vec<GpuBuffer<bf16>>>, CudaError> {
    (0..layers)
        .map(|_| {
            PROJ[..4]
                .iter()
                .map(|&(_, _, in_f, out_f, _)| ctx.alloc::<bf16>(in_f * out_f))
                .collect()
        })
        .collect()
}

/// Milliseconds a replay of `chain` captured as a CUDA graph takes (20 replays), its kernels
/// launched with PDL when `pdl`; one run first, outside the capture (cuBLAS workspaces, first
/// launches).
fn time_graph(
    ctx: &CudaContext,
    pdl: bool,
    chain: &mut dyn FnMut() -> Result<(), CudaError>,
) -> Result<f32, CudaError> {
    ctx.set_pdl(pdl);
    chain()?;
    let graph = ctx.capture_graph(&mut *chain);
    ctx.set_pdl(false);
    let graph = graph?;
    ctx.time_ms(20, || {
        graph.launch().map_err(|e| CudaError::Driver {
            op: "cuGraphLaunch",
            reason: format!("{e:?}"),
        })
    })
}

/// One line for a graph of `gemms` products of `rows` rows streaming `bytes` in `ms`.
fn print_graph(
    tag: &str,
    label: &str,
    gemms: usize,
    rows: usize,
    bytes: usize,
    ms: f32,
    copy_gbs: f64,
) {
    let g = bytes as f64 / (ms as f64 * 1e-3) / 1e9;
    println!(
        "{tag:<7} graph of {gemms} {label} GEMMs at {rows} rows ({:.2} GB): {ms:>7.3} ms {g:>5.0} GB/s {:>5.1}% of copy",
        bytes as f64 / 1e9,
        100.0 * g / copy_gbs
    );
}

/// The weight side of a 6-row decode step as the step runs it, from a CUDA graph: 36 layers of
/// q/k/v, o, gate|up and down (each layer its own weights, 7.3 GB), through cuBLAS, the
/// tensor-core GEMV, and the tensor-core GEMV under PDL. Per-kernel times (above, or ncu) do not
/// tell what a chain of them costs in a graph: the batch-6 step did not follow them (runs 47,
/// 59, 67).
fn small_batch_chain(
    ctx: &CudaContext,
    copy_gbs: f64,
    x: &GpuBuffer<bf16>,
    y: &mut GpuBuffer<bf16>,
) -> Result<(), CudaError> {
    let (rows, layers) = (6usize, 36usize);
    let lw = layer_weights(ctx, layers)?;
    let total = PROJ[..4].iter().map(|p| p.2 * p.3 * 2).sum::<usize>() * layers;
    for (label, mma, pdl) in [
        ("cublas", false, false),
        ("mma", true, false),
        ("mma pdl", true, true),
    ] {
        let mut chain = || -> Result<(), CudaError> {
            for l in &lw {
                for (j, &(_, _, in_f, out_f, _)) in PROJ[..4].iter().enumerate() {
                    if mma {
                        ctx.gemv_mma(x, &l[j], y, rows, in_f, out_f)?;
                    } else {
                        ctx.linear(x, &l[j], y, rows, in_f, out_f)?;
                    }
                }
            }
            Ok(())
        };
        ctx.set_gemv_mma_rows(0);
        let ms = time_graph(ctx, pdl, &mut chain)?;
        print_graph("gemv", label, 4 * layers, rows, total, ms, copy_gbs);
    }
    Ok(())
}

fn gemv_ab(ctx: &CudaContext, copy_gbs: f64) -> Result<(), CudaError> {
    let x = ctx.upload(&rand_bf16(2 * 9728, 11))?;
    let nw = ctx.upload(&vec![1.0f32; 9728])?;
    let mut y16 = ctx.alloc::<bf16>(151936)?;
    let mut y32 = ctx.alloc::<f32>(151936)?;
    let mut sink = ctx.alloc::<u32>(ctx.sm_count() as usize * 8)?;
    for &(name, mode, in_f, out_f, kind) in &PROJ {
        let bytes = in_f * out_f * 2;
        let (ws, iters) = weight_replicas(ctx, in_f, out_f)?;
        let reps = ws.len();
        let gbs = |ms: f32| bytes as f64 / (ms as f64 * 1e-3) / 1e9;
        let mut i = 0;
        let ms = ctx.time_ms(iters, || {
            i += 1;
            ctx.stream_read_bench(&ws[i % reps], &mut sink)
        })?;
        println!(
            "gemv    {name:<8} {in_f:>5} -> {out_f:>6} ({:>6.1} MB)  read-only {:>7.2} us {:>5.0} GB/s {:>5.1}%",
            bytes as f64 / 1e6,
            ms * 1e3,
            gbs(ms),
            100.0 * gbs(ms) / copy_gbs
        );
        {
            let mut line = format!("gemv    {name:<8} {:<14}", "fused gemv");
            for pdl in [false, true] {
                ctx.set_pdl(pdl);
                gemv_once(
                    ctx, mode, &x, &nw, &ws[0], &mut y16, &mut y32, kind, in_f, out_f,
                )?;
                let ms = ctx.time_ms(iters, || {
                    i += 1;
                    let w = &ws[i % reps];
                    gemv_once(ctx, mode, &x, &nw, w, &mut y16, &mut y32, kind, in_f, out_f)
                })?;
                ctx.set_pdl(false);
                line += &format!(
                    "  {}: {:>7.2} us {:>5.0} GB/s {:>5.1}%",
                    if pdl { "pdl" } else { "plain" },
                    ms * 1e3,
                    gbs(ms),
                    100.0 * gbs(ms) / copy_gbs
                );
            }
            println!("{line}");
        }
    }
    // The weight side of a decode step: 36 layers of q/k/v, o, gate|up, down, each layer with
    // its own weights (7.3 GB), then the LM head, under PDL as the fused step runs them.
    let layers = 36;
    let lw = layer_weights(ctx, layers)?;
    let (_, _, hin, hout, _) = PROJ[4];
    let head = ctx.alloc::<bf16>(hin * hout)?;
    let total: usize =
        PROJ.iter().map(|p| p.2 * p.3 * 2).sum::<usize>() * layers - hin * hout * 2 * (layers - 1);
    let chain = |y16: &mut GpuBuffer<bf16>, y32: &mut GpuBuffer<f32>| {
        for l in &lw {
            for (j, &(_, mode, in_f, out_f, kind)) in PROJ[..4].iter().enumerate() {
                gemv_once(ctx, mode, &x, &nw, &l[j], y16, y32, kind, in_f, out_f)?;
            }
        }
        gemv_once(ctx, 0, &x, &nw, &head, y16, y32, 1, hin, hout)
    };
    {
        ctx.set_pdl(true);
        chain(&mut y16, &mut y32)?;
        let ms = ctx.time_ms(10, || chain(&mut y16, &mut y32))?;
        ctx.set_pdl(false);
        let g = total as f64 / (ms as f64 * 1e-3) / 1e9;
        println!(
            "gemv    chain of {} GEMVs ({:.2} GB) pdl: {:>7.3} ms {:>5.0} GB/s {:>5.1}% of copy",
            4 * layers + 1,
            total as f64 / 1e9,
            ms,
            g,
            100.0 * g / copy_gbs
        );
    }
    Ok(())
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
        if ctx.has_wgmma() {
            prefill(&ctx, 32, 8, 128, 8192, 1, Some("attn_prefill_d128_wg"))?;
        }
        decode(&ctx, 1, 32768, 1.0, None)?;
        return Ok(());
    }
    if std::env::args().any(|a| a == "profile-gemv") {
        return profile_gemv(&ctx);
    }
    let bw = copy_bw(&ctx)?;
    println!("copy    device-to-device {bw:.0} GB/s (read + write)");
    if std::env::args().any(|a| a == "gemvb") {
        return small_batch_ab(&ctx, bw);
    }
    if std::env::args().any(|a| a == "gemv") {
        return gemv_ab(&ctx, bw);
    }
    if std::env::args().any(|a| a == "prefill") {
        // the head-dim-128 prefill kernels side by side (Qwen3-4B heads), against the GEMM rate
        let big = gemm(&ctx, "8192^3", 8192, 8192, 8192)?;
        let mut kernels = vec!["attn_prefill_d128_m2"];
        if ctx.has_wgmma() {
            kernels.extend(["attn_prefill_d128_wg", "attn_prefill_d128_wg3"]);
        }
        for n in [8192, 32768] {
            for &k in &kernels {
                let tf = prefill(&ctx, 32, 8, 128, n, 3, Some(k))?;
                println!("  = {:.1} % of the 8192^3 GEMM rate", 100.0 * tf / big);
            }
        }
        prefill(&ctx, 32, 8, 128, 131072, 1, None)?;
        return Ok(());
    }
    if std::env::args().any(|a| a == "decode") {
        // batch 1 also 33 keys past each size (the host chunk's extra tile)
        for c in [8192, 8225, 32768, 32801, 131072, 131105] {
            decode(&ctx, 1, c, bw, None)?;
        }
        for c in [8192, 32768] {
            decode(&ctx, 8, c, bw, None)?;
        }
        return Ok(());
    }
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
    for k in [None, Some("attn_prefill_d128_m2")] {
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
