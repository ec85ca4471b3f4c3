//! Every non-attention kernel against a plain CPU reference on fresh random inputs.
#![cfg(feature = "cuda")]
#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use slowfast_cuda::ops::sampling::uniform_from_seed;
use slowfast_cuda::{bf16, CudaError, Glu, GpuBuffer, KvLayout, RmsNorm, Rope};

#[test]
fn embed_add_glu() {
    let Some(ctx) = gpu("embed_add_glu") else {
        return;
    };
    let mut rng = Rng::new(1);
    let (vocab, hidden, n) = (1000, 640, 37);
    let table = rng.vec_bf16(vocab * hidden, 1.0);
    let mut ids: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
    ids[5] = vocab as u32 + 3; // out of range -> zero row
    let (dt, di) = (ctx.upload(&table).unwrap(), ctx.upload(&ids).unwrap());
    let mut out = ctx.upload(&nan_bf16(n * hidden)).unwrap();
    let scale = (hidden as f32).sqrt();
    ctx.embed(&dt, &di, &mut out, n, hidden, vocab, scale)
        .unwrap();
    let got = to_f64(&ctx.download(&out).unwrap());
    let want: Vec<f64> = (0..n * hidden)
        .map(|i| {
            let (r, c) = (i / hidden, i % hidden);
            let id = ids[r] as usize;
            if id >= vocab {
                0.0
            } else {
                bf(table[id * hidden + c].to_f64() * scale as f64)
            }
        })
        .collect();
    assert_close("embed", &got, &want, 1e-3);

    let m = 10_001;
    let (a, b) = (rng.vec_bf16(m, 1.0), rng.vec_bf16(m, 1.0));
    let (mut da, db) = (ctx.upload(&a).unwrap(), ctx.upload(&b).unwrap());
    let mut dout = ctx.upload(&nan_bf16(m)).unwrap();
    ctx.add(&da, &db, &mut dout, m).unwrap();
    ctx.add_assign(&mut da, &db, m).unwrap();
    let want: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| bf(x.to_f64() + y.to_f64()))
        .collect();
    assert_close("add", &to_f64(&ctx.download(&dout).unwrap()), &want, 1e-3);
    assert_close(
        "add_assign",
        &to_f64(&ctx.download(&da).unwrap()),
        &want,
        1e-3,
    );

    // cols 1001: the scalar path (rows not 16-byte aligned); 1000: 16-byte loads and stores
    for (rows, cols) in [(5, 1001), (13, 1000)] {
        let gu = rng.vec_bf16(rows * 2 * cols, 2.0);
        let dgu = ctx.upload(&gu).unwrap();
        for act in [Glu::SwiGlu, Glu::GeGluTanh] {
            let mut o = ctx.upload(&nan_bf16(rows * cols)).unwrap();
            ctx.glu(act, &dgu, &mut o, rows, cols).unwrap();
            let want: Vec<f64> = (0..rows * cols)
                .map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let g = gu[r * 2 * cols + c].to_f64();
                    let u = gu[r * 2 * cols + cols + c].to_f64();
                    let a = match act {
                        Glu::SwiGlu => g / (1.0 + (-g).exp()),
                        Glu::GeGluTanh => {
                            0.5 * g
                                * (1.0
                                    + ((2.0 / std::f64::consts::PI).sqrt()
                                        * (g + 0.044715 * g * g * g))
                                        .tanh())
                        }
                    };
                    a * u
                })
                .collect();
            assert_close(
                &format!("glu {act:?}"),
                &to_f64(&ctx.download(&o).unwrap()),
                &want,
                1e-2,
            );
        }
    }
    let (rows, cols) = (13, 1000);
    let gu = rng.vec_bf16(rows * 2 * cols, 2.0);
    let dgu = ctx.upload(&gu).unwrap();
    // glu_split on separate buffers equals the fused layout
    let gate: Vec<bf16> = (0..rows * cols)
        .map(|i| gu[(i / cols) * 2 * cols + i % cols])
        .collect();
    let up: Vec<bf16> = (0..rows * cols)
        .map(|i| gu[(i / cols) * 2 * cols + cols + i % cols])
        .collect();
    let (dg, du) = (ctx.upload(&gate).unwrap(), ctx.upload(&up).unwrap());
    let mut o1 = ctx.upload(&nan_bf16(rows * cols)).unwrap();
    let mut o2 = ctx.upload(&nan_bf16(rows * cols)).unwrap();
    ctx.glu_split(Glu::SwiGlu, &dg, &du, &mut o1, rows, cols)
        .unwrap();
    ctx.glu(Glu::SwiGlu, &dgu, &mut o2, rows, cols).unwrap();
    assert_eq!(
        to_f64(&ctx.download(&o1).unwrap()),
        to_f64(&ctx.download(&o2).unwrap())
    );
}

#[test]
fn kv_append_writes_the_right_rows() {
    let Some(ctx) = gpu("kv_append") else { return };
    let mut rng = Rng::new(2);
    let kv = KvLayout {
        num_slots: 3,
        kv_heads: 2,
        capacity: 50,
        head_dim: 128,
        fp8: false,
    };
    let n = 9;
    let k = rng.vec_bf16(n * kv.kv_heads * kv.head_dim, 1.0);
    let v = rng.vec_bf16(n * kv.kv_heads * kv.head_dim, 1.0);
    let pos: Vec<u32> = (0..n)
        .map(|i| {
            if i == 4 {
                50
            } else {
                (i * 5 + rng.below(5)) as u32
            }
        })
        .collect();
    let slots: Vec<u32> = (0..n)
        .map(|i| if i == 7 { 3 } else { rng.below(3) as u32 })
        .collect();
    let init_k = rng.vec_bf16(kv.elems(), 1.0);
    let init_v = rng.vec_bf16(kv.elems(), 1.0);
    let mut dkc = ctx.upload(&init_k).unwrap();
    let mut dvc = ctx.upload(&init_v).unwrap();
    let (dk, dv, dp, ds) = (
        ctx.upload(&k).unwrap(),
        ctx.upload(&v).unwrap(),
        ctx.upload(&pos).unwrap(),
        ctx.upload(&slots).unwrap(),
    );
    ctx.kv_append(&dk, &dv, &mut dkc, &mut dvc, &dp, &ds, n, kv)
        .unwrap();
    let (mut wk, mut wv) = (init_k.clone(), init_v.clone());
    for t in 0..n {
        if pos[t] as usize >= kv.capacity || slots[t] as usize >= kv.num_slots {
            continue;
        }
        for h in 0..kv.kv_heads {
            let dst = ((slots[t] as usize * kv.kv_heads + h) * kv.capacity + pos[t] as usize)
                * kv.head_dim;
            let src = (t * kv.kv_heads + h) * kv.head_dim;
            wk[dst..dst + kv.head_dim].copy_from_slice(&k[src..src + kv.head_dim]);
            wv[dst..dst + kv.head_dim].copy_from_slice(&v[src..src + kv.head_dim]);
        }
    }
    assert!(ctx.download(&dkc).unwrap() == wk, "k cache differs");
    assert!(ctx.download(&dvc).unwrap() == wv, "v cache differs");
}

fn rms_ref(x: &[f64], w: &[f32], eps: f64, gemma: bool) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, &w)| v * s * if gemma { 1.0 + w as f64 } else { w as f64 })
        .collect()
}

#[test]
fn rmsnorm_variants() {
    let Some(ctx) = gpu("rmsnorm_variants") else {
        return;
    };
    let mut rng = Rng::new(3);
    // Hidden sizes of the real models, and two that are not multiples of 8 / 16 with more rows;
    // the largest row the register-resident path takes (4 chunks a thread of 512) and a row of
    // whole chunks past it (the strided path).
    let cases = [
        (7usize, 640usize, true),
        (5, 2560, false),
        (3, 4096, false),
        (2, 100, false),
        (33, 264, true),
        (2, 16384, false),
        (2, 16392, true),
    ];
    for &(rows, dim, gemma) in &cases {
        let cfg = RmsNorm { eps: 1e-6, gemma };
        let x = rng.vec_bf16(rows * dim, 1.5);
        let res = rng.vec_bf16(rows * dim, 3.0);
        let w = rng.vec_f32(dim, 0.5);
        let pw = rng.vec_f32(dim, 0.5);
        let (dx, dw, dpw) = (
            ctx.upload(&x).unwrap(),
            ctx.upload(&w).unwrap(),
            ctx.upload(&pw).unwrap(),
        );
        let mut out = ctx.upload(&nan_bf16(rows * dim)).unwrap();
        ctx.rmsnorm(&dx, &dw, &mut out, rows, dim, cfg).unwrap();
        let xf = to_f64(&x);
        let want: Vec<f64> = xf
            .chunks(dim)
            .flat_map(|r| rms_ref(r, &w, 1e-6, gemma))
            .collect();
        assert_close(
            &format!("rmsnorm {dim}"),
            &to_f64(&ctx.download(&out).unwrap()),
            &want,
            1e-2,
        );

        for post in [false, true] {
            let mut dres = ctx.upload(&res).unwrap();
            let mut out = ctx.upload(&nan_bf16(rows * dim)).unwrap();
            ctx.add_rmsnorm(
                &dx,
                &mut dres,
                post.then_some(&dpw),
                &dw,
                &mut out,
                rows,
                dim,
                cfg,
            )
            .unwrap();
            let mut want_res = Vec::new();
            let mut want_out = Vec::new();
            for r in 0..rows {
                let xr = &xf[r * dim..(r + 1) * dim];
                let y = if post {
                    rms_ref(xr, &pw, 1e-6, gemma)
                } else {
                    xr.to_vec()
                };
                let nr: Vec<f64> = (0..dim)
                    .map(|c| bf(res[r * dim + c].to_f64() + y[c]))
                    .collect();
                want_out.extend(rms_ref(&nr, &w, 1e-6, gemma));
                want_res.extend(nr);
            }
            assert_close(
                &format!("add_rmsnorm residual post={post}"),
                &to_f64(&ctx.download(&dres).unwrap()),
                &want_res,
                1e-2,
            );
            assert_close(
                &format!("add_rmsnorm out post={post}"),
                &to_f64(&ctx.download(&out).unwrap()),
                &want_out,
                1e-2,
            );
        }
    }
    // per-head norm
    let (rows, hd) = (3 * 8, 128);
    let x = rng.vec_bf16(rows * hd, 2.0);
    let w = rng.vec_f32(hd, 0.3);
    let mut dx = ctx.upload(&x).unwrap();
    let dw = ctx.upload(&w).unwrap();
    ctx.head_rmsnorm(
        &mut dx,
        &dw,
        rows,
        hd,
        RmsNorm {
            eps: 1e-6,
            gemma: true,
        },
    )
    .unwrap();
    let want: Vec<f64> = to_f64(&x)
        .chunks(hd)
        .flat_map(|r| rms_ref(r, &w, 1e-6, true))
        .collect();
    assert_close(
        "head_rmsnorm",
        &to_f64(&ctx.download(&dx).unwrap()),
        &want,
        1e-2,
    );
}

#[test]
fn rope_neox_matches_reference() {
    let Some(ctx) = gpu("rope_neox") else { return };
    let mut rng = Rng::new(4);
    let (n, hq, hk, hd) = (6, 8, 2, 128);
    for &(rot, theta, ps) in &[(128usize, 1.0e6f32, 1.0f32), (64, 10000.0, 8.0)] {
        let q = rng.vec_bf16(n * hq * hd, 1.0);
        let k = rng.vec_bf16(n * hk * hd, 1.0);
        let pos: Vec<u32> = (0..n)
            .map(|i| {
                if i == 0 {
                    131_000
                } else {
                    rng.below(40_000) as u32
                }
            })
            .collect();
        let (mut dq, mut dk, dp) = (
            ctx.upload(&q).unwrap(),
            ctx.upload(&k).unwrap(),
            ctx.upload(&pos).unwrap(),
        );
        let rope = Rope {
            theta,
            rot_dim: rot,
            pos_scale: ps,
        };
        ctx.rope_neox(&mut dq, Some(&mut dk), &dp, n, hq, hk, hd, rope)
            .unwrap();
        let apply = |x: &[bf16], heads: usize| -> Vec<f64> {
            let mut out = to_f64(x);
            for t in 0..n {
                for h in 0..heads {
                    let b = (t * heads + h) * hd;
                    for i in 0..rot / 2 {
                        let ang = pos[t] as f64 / ps as f64
                            * (theta as f64).powf(-2.0 * i as f64 / rot as f64);
                        let (s, c) = ang.sin_cos();
                        let (x1, x2) = (x[b + i].to_f64(), x[b + i + rot / 2].to_f64());
                        out[b + i] = x1 * c - x2 * s;
                        out[b + i + rot / 2] = x2 * c + x1 * s;
                    }
                }
            }
            out
        };
        assert_close(
            &format!("rope q rot {rot}"),
            &to_f64(&ctx.download(&dq).unwrap()),
            &apply(&q, hq),
            1e-2,
        );
        assert_close(
            &format!("rope k rot {rot}"),
            &to_f64(&ctx.download(&dk).unwrap()),
            &apply(&k, hk),
            1e-2,
        );
    }
}

#[test]
fn argmax_and_top_p() {
    let Some(ctx) = gpu("argmax_and_top_p") else {
        return;
    };
    let mut rng = Rng::new(5);
    let (rows, vocab) = (16, 151_936);
    let mut logits = rng.vec_f32(rows * vocab, 3.0);
    // a tie in row 3: the lower index wins
    let m = logits[3 * vocab..4 * vocab]
        .iter()
        .cloned()
        .fold(f32::MIN, f32::max);
    logits[3 * vocab + 777] = m + 1.0;
    logits[3 * vocab + 99_999] = m + 1.0;
    // the row is split over blocks that merge through a counter the last one resets: three
    // launches in a row, each with a new maximum somewhere else, must all be right
    let argmax_ref = |logits: &[f32], rows: usize, vocab: usize| -> Vec<u32> {
        (0..rows)
            .map(|r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let mut best = 0;
                for (i, &v) in row.iter().enumerate() {
                    if v > row[best] || (row[best].is_nan() && !v.is_nan()) {
                        best = i;
                    }
                }
                best as u32
            })
            .collect()
    };
    let mut out = ctx.upload(&vec![u32::MAX; rows]).unwrap();
    for round in 0..3 {
        if round > 0 {
            for r in 0..rows {
                let i = r * vocab + (rng.next_u64() as usize % vocab);
                logits[i] = 100.0 + round as f32;
            }
        }
        let dl = ctx.upload(&logits).unwrap();
        ctx.argmax(&dl, &mut out, rows, vocab).unwrap();
        let got = ctx.download(&out).unwrap();
        assert_eq!(
            got,
            argmax_ref(&logits, rows, vocab),
            "argmax, launch {round}"
        );
    }
    // Launches of changing row counts (a verification of 1, then 2, 4, 16 rows a pass): the
    // counters of the rows a launch adds were never the pairs of the launch before.
    for (i, n) in [1usize, 2, 1, 4, 16, 3].into_iter().enumerate() {
        for r in 0..n {
            let j = r * vocab + (rng.next_u64() as usize % vocab);
            logits[j] = 200.0 + i as f32;
        }
        let dl = ctx.upload(&logits[..n * vocab]).unwrap();
        ctx.argmax(&dl, &mut out, n, vocab).unwrap();
        let got = ctx.download(&out).unwrap();
        assert_eq!(
            &got[..n],
            &argmax_ref(&logits[..n * vocab], n, vocab)[..],
            "argmax of {n} rows after a launch of another count"
        );
    }
    // a short row, a row of -inf and NaN (NaN never wins), one with a NaN first
    let small = [
        1.0,
        5.0,
        5.0,
        -2.0,
        0.0,
        3.0,
        4.0, //
        f32::NEG_INFINITY,
        f32::NAN,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::NAN,
        f32::NAN,
        -1.0,
        -3.0,
        f32::NAN,
        -0.5,
        -9.0,
        -1.0,
    ];
    let ds = ctx.upload(&small).unwrap();
    let mut out3 = ctx.upload(&[u32::MAX; 3]).unwrap();
    ctx.argmax(&ds, &mut out3, 3, 7).unwrap();
    assert_eq!(ctx.download(&out3).unwrap(), vec![1, 0, 4]);
    let dl = ctx.upload(&logits).unwrap();

    for &(temp, top_p) in &[(1.0f32, 0.9f32), (0.7, 0.5), (1.3, 1.0), (1.0, 0.01)] {
        let seeds: Vec<u64> = (0..rows).map(|_| rng.next_u64()).collect();
        let ds = ctx.upload(&seeds).unwrap();
        let mut out = ctx.upload(&vec![u32::MAX; rows]).unwrap();
        ctx.sample_top_p(&dl, &ds, &mut out, rows, vocab, temp, top_p)
            .unwrap();
        let got = ctx.download(&out).unwrap();
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mx = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let e: Vec<f64> = row
                .iter()
                .map(|&x| ((x as f64 - mx) / temp as f64).exp())
                .collect();
            let z: f64 = e.iter().sum();
            let mut sorted = e.clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let mut acc = 0.0;
            let mut t = sorted[sorted.len() - 1];
            for &v in &sorted {
                acc += v;
                if acc >= top_p as f64 * z {
                    t = v;
                    break;
                }
            }
            let tok = got[r] as usize;
            assert!(tok < vocab, "row {r}: token {tok}");
            assert!(
                e[tok] >= t * (1.0 - 1e-4),
                "row {r}: token {tok} (e {}) is outside the nucleus (threshold {t})",
                e[tok]
            );
            let mass: f64 = e.iter().filter(|&&v| v >= t).sum();
            let target = uniform_from_seed(seeds[r]) as f64 * mass;
            let before: f64 = e[..tok].iter().filter(|&&v| v >= t).sum();
            let slack = 1e-4 * mass + 1e-6;
            assert!(
                before <= target + slack && before + e[tok] >= target - slack,
                "row {r}: token {tok} covers [{before}, {}) but the draw is {target}",
                before + e[tok]
            );
        }
    }
}

/// `x[n, k] · w[m, k]^T` in f64.
fn linear_ref(x: &[bf16], w: &[bf16], n: usize, k: usize, m: usize) -> Vec<f64> {
    (0..n * m)
        .map(|i| {
            (0..k)
                .map(|j| x[(i / m) * k + j].to_f64() * w[(i % m) * k + j].to_f64())
                .sum()
        })
        .collect()
}

#[test]
fn linear_matches_reference() {
    let Some(ctx) = gpu("linear") else { return };
    let mut rng = Rng::new(6);
    let (n, k, m) = (37, 640, 300);
    let x = rng.vec_bf16(n * k, 1.0);
    let w = rng.vec_bf16(m * k, 0.05);
    let (dx, dw) = (ctx.upload(&x).unwrap(), ctx.upload(&w).unwrap());
    let want = linear_ref(&x, &w, n, k, m);
    let mut y16 = ctx.upload(&nan_bf16(n * m)).unwrap();
    ctx.linear(&dx, &dw, &mut y16, n, k, m).unwrap();
    assert_close(
        "linear bf16 out",
        &to_f64(&ctx.download(&y16).unwrap()),
        &want,
        1e-2,
    );
    let mut y32 = ctx.upload(&vec![f32::NAN; n * m]).unwrap();
    ctx.linear(&dx, &dw, &mut y32, n, k, m).unwrap();
    let got = dl_f32(&ctx, &y32);
    assert_close("linear f32 out", &got, &want, 1e-4);
    // a too-small output buffer is refused with a message naming it
    let mut small = ctx.alloc::<f32>(10).unwrap();
    let err = ctx
        .linear(&dx, &dw, &mut small, n, k, m)
        .unwrap_err()
        .to_string();
    assert!(err.contains("y [n, out]"), "{err}");
}

/// The GEMV path `linear` takes for 1..=8 rows, at decode shapes (odd row counts, `in` not a
/// multiple of the lane stride, a large `in` whose staged rows need opt-in shared memory).
#[test]
fn small_batch_linear_matches_reference() {
    let Some(ctx) = gpu("small_batch_linear") else {
        return;
    };
    let mut rng = Rng::new(7);
    for &(k, m) in &[(2560usize, 1027usize), (9728, 300), (136, 33)] {
        for n in 1..=8 {
            check_small_linear(
                &ctx,
                &mut rng,
                (n, k, m),
                "gemv",
                |x, w, y| ctx.linear(x, w, y, n, k, m),
                |x, w, y| ctx.linear(x, w, y, n, k, m),
            );
        }
    }
}

/// Random `x [n, k]` and `w [m, k]` through `f32_out` and `bf16_out` against f64.
fn check_small_linear(
    ctx: &slowfast_cuda::CudaContext,
    rng: &mut Rng,
    (n, k, m): (usize, usize, usize),
    what: &str,
    f32_out: impl Fn(&GpuBuffer<bf16>, &GpuBuffer<bf16>, &mut GpuBuffer<f32>) -> Result<(), CudaError>,
    bf16_out: impl Fn(&GpuBuffer<bf16>, &GpuBuffer<bf16>, &mut GpuBuffer<bf16>) -> Result<(), CudaError>,
) {
    let x = rng.vec_bf16(n * k, 1.0);
    let w = rng.vec_bf16(m * k, 0.05);
    let (dx, dw) = (ctx.upload(&x).unwrap(), ctx.upload(&w).unwrap());
    let want = linear_ref(&x, &w, n, k, m);
    let mut y32 = ctx.upload(&vec![f32::NAN; n * m]).unwrap();
    f32_out(&dx, &dw, &mut y32).unwrap();
    let got = dl_f32(ctx, &y32);
    assert_close(
        &format!("{what} f32 out n {n} in {k} out {m}"),
        &got,
        &want,
        1e-4,
    );
    let mut y16 = ctx.upload(&nan_bf16(n * m)).unwrap();
    bf16_out(&dx, &dw, &mut y16).unwrap();
    let got = to_f64(&ctx.download(&y16).unwrap());
    assert_close(
        &format!("{what} bf16 out n {n} in {k} out {m}"),
        &got,
        &want,
        1e-2,
    );
}

/// The tensor-core GEMV at every row count (the input rows are the mma's 8 columns, unused
/// ones zero), `in` not a multiple of its 32-wide slices or of a warp's 4 slices in flight,
/// `out` not a multiple of the block's 16 rows; and `linear` through it when enabled.
#[test]
fn tensor_core_gemv_matches_reference() {
    let Some(ctx) = gpu("tensor_core_gemv") else {
        return;
    };
    let mut rng = Rng::new(8);
    for &(k, m) in &[
        (8usize, 1usize),
        (24, 17),
        (40, 33),
        (136, 15),
        (2560, 1027),
        (4104, 16),
        (9728, 300),
    ] {
        for n in 1..=8 {
            check_small_linear(
                &ctx,
                &mut rng,
                (n, k, m),
                "gemv_mma",
                |x, w, y| ctx.gemv_mma(x, w, y, n, k, m),
                |x, w, y| ctx.gemv_mma(x, w, y, n, k, m),
            );
        }
    }
    // `linear` at 6 rows through it, then back to cuBLAS
    let (n, k, m) = (6, 2560, 1027);
    ctx.set_gemv_mma_rows(8);
    check_small_linear(
        &ctx,
        &mut rng,
        (n, k, m),
        "linear via gemv_mma",
        |x, w, y| ctx.linear(x, w, y, n, k, m),
        |x, w, y| ctx.linear(x, w, y, n, k, m),
    );
    ctx.set_gemv_mma_rows(0);
    // bad shapes are refused, naming the input
    let (dx, dw) = (
        ctx.upload(&nan_bf16(9 * k)).unwrap(),
        ctx.upload(&nan_bf16(m * k)).unwrap(),
    );
    let mut y32 = ctx.alloc::<f32>(9 * m).unwrap();
    let err = ctx
        .gemv_mma(&dx, &dw, &mut y32, 9, k, m)
        .unwrap_err()
        .to_string();
    assert!(err.contains("9 rows"), "{err}");
}
