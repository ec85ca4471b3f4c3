//! Attention kernel benchmark (Instant-based, median of runs): decode of one query row over a
//! long KV cache (GB/s of KV read) and causal / sliding-window prefill (GFLOP/s), for Qwen3-0.6B
//! and Gemma 3 270M head shapes, f32 and f16 KV; `paged`: f16 decode over the same cache held
//! in separately allocated blocks of 16-128 tokens (`[kv_heads, block, head_dim]` each, as
//! `KvStore` keeps a global layer), one segment a block, beside the contiguous layout. Run:
//! `cargo bench -p slowfast-backend --bench attention [-- [decode] [paged] [prefill] [bw] [qwen|gemma]]`.

use half::f16;
use rayon::prelude::*;
use slowfast_backend::cpu::attention::{
    attention, AttnShape, KvElem, KvPositions, KvSegment, Mask, QueryPositions,
};
use slowfast_backend::e4m3::E4m3;
use std::time::Instant;

struct Model {
    name: &'static str,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

const MODELS: [Model; 2] = [
    Model {
        name: "qwen3-0.6b",
        n_heads: 16,
        n_kv_heads: 8,
        head_dim: 128,
    },
    Model {
        name: "gemma3-270m",
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
    },
];

fn shape(m: &Model) -> AttnShape {
    AttnShape {
        n_heads: m.n_heads,
        n_kv_heads: m.n_kv_heads,
        head_dim: m.head_dim,
        scale: 1.0 / (m.head_dim as f32).sqrt(),
    }
}

/// Deterministic pseudo-random values in [-1, 1).
fn fill(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// (median, fastest) wall time of `runs` runs after one warm-up.
fn median_secs(runs: usize, mut f: impl FnMut()) -> (f64, f64) {
    f(); // warm-up
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (t[runs / 2], t[0])
}

/// KV cache of one layer: `[kv_heads, ctx, head_dim]` keys and values.
struct Cache<T> {
    k: Vec<T>,
    v: Vec<T>,
}

fn cache<T: KvElem>(m: &Model, ctx: usize, conv: fn(f32) -> T) -> Cache<T> {
    let n = m.n_kv_heads * ctx * m.head_dim;
    Cache {
        k: fill(n, 1).into_iter().map(conv).collect(),
        v: fill(n, 2).into_iter().map(conv).collect(),
    }
}

fn segments<'a, T>(c: &'a Cache<T>, m: &Model, ctx: usize) -> Vec<Vec<KvSegment<'a, T>>> {
    let per = ctx * m.head_dim;
    (0..m.n_kv_heads)
        .map(|h| {
            vec![KvSegment {
                k: &c.k[h * per..(h + 1) * per],
                v: &c.v[h * per..(h + 1) * per],
                pos: KvPositions::Range { start: 0 },
            }]
        })
        .collect()
}

fn decode<T: KvElem>(m: &Model, ctx: usize, dtype: &str, conv: fn(f32) -> T) {
    let c = cache(m, ctx, conv);
    let segs = segments(&c, m, ctx);
    let q = fill(m.n_heads * m.head_dim, 3);
    let mut out = vec![0.0; q.len()];
    let qp = QueryPositions::Start(ctx as u32 - 1);
    let t = median_secs(21, || {
        attention(&shape(m), &q, qp, &segs, Mask::CAUSAL, &mut out, None).unwrap();
    });
    let bytes = 2 * m.n_kv_heads * ctx * m.head_dim * std::mem::size_of::<T>();
    println!(
        "| decode | {} | {} | {}K | {:.1} us | {:.1} GB/s | {:.1} GB/s |",
        m.name,
        dtype,
        ctx / 1024,
        t.0 * 1e6,
        bytes as f64 / t.0 / 1e9,
        bytes as f64 / t.1 / 1e9
    );
}

/// f16 decode over `ctx` keys kept contiguous (block 0) or in blocks of `block` tokens, each
/// block its own allocation; the same values either way.
fn decode_paged(m: &Model, ctx: usize, block: usize) {
    let (nkv, d) = (m.n_kv_heads, m.head_dim);
    let c = cache(m, ctx, f16::from_f32);
    let blocks: Vec<(Vec<f16>, Vec<f16>)> = (0..ctx.div_ceil(block.max(1)))
        .filter(|_| block > 0)
        .map(|b| {
            let n = block.min(ctx - b * block);
            let (mut k, mut v) = (
                vec![f16::ZERO; nkv * block * d],
                vec![f16::ZERO; nkv * block * d],
            );
            for h in 0..nkv {
                let (src, dst) = ((h * ctx + b * block) * d, h * block * d);
                k[dst..dst + n * d].copy_from_slice(&c.k[src..src + n * d]);
                v[dst..dst + n * d].copy_from_slice(&c.v[src..src + n * d]);
            }
            (k, v)
        })
        .collect();
    let segs: Vec<Vec<KvSegment<'_, f16>>> = if block == 0 {
        segments(&c, m, ctx)
    } else {
        (0..nkv)
            .map(|h| {
                blocks
                    .iter()
                    .enumerate()
                    .map(|(b, (k, v))| {
                        let n = block.min(ctx - b * block);
                        let o = h * block * d;
                        KvSegment {
                            k: &k[o..o + n * d],
                            v: &v[o..o + n * d],
                            pos: KvPositions::Range {
                                start: (b * block) as u32,
                            },
                        }
                    })
                    .collect()
            })
            .collect()
    };
    let q = fill(m.n_heads * d, 3);
    let mut out = vec![0.0; q.len()];
    let qp = QueryPositions::Start(ctx as u32 - 1);
    let t = median_secs(21, || {
        attention(&shape(m), &q, qp, &segs, Mask::CAUSAL, &mut out, None).unwrap();
    });
    let bytes = 2 * nkv * ctx * d * 2;
    let layout = if block == 0 {
        "contiguous".to_string()
    } else {
        format!("blocks of {block}")
    };
    println!(
        "| paged decode | {} | f16, {layout} | {}K | {:.1} us | {:.1} GB/s | {:.1} GB/s |",
        m.name,
        ctx / 1024,
        t.0 * 1e6,
        bytes as f64 / t.0 / 1e9,
        bytes as f64 / t.1 / 1e9
    );
}

fn prefill(m: &Model, n: usize, window: Option<u32>) {
    let c = cache(m, n, |x| x);
    let segs = segments(&c, m, n);
    let q = fill(n * m.n_heads * m.head_dim, 4);
    let mut out = vec![0.0; q.len()];
    let mask = Mask {
        causal: true,
        window,
    };
    let runs = if n * m.n_heads * m.head_dim > 2048 * 2048 {
        3
    } else {
        5
    };
    let t = median_secs(runs, || {
        attention(
            &shape(m),
            &q,
            QueryPositions::Start(0),
            &segs,
            mask,
            &mut out,
            None,
        )
        .unwrap();
    });
    // Useful work: visible (query, key) pairs x heads x (2d for q.k + 2d for p.v).
    let pairs: usize = (0..n)
        .map(|i| window.map_or(i + 1, |w| (i + 1).min(w as usize)))
        .sum();
    let flops = pairs as f64 * m.n_heads as f64 * 4.0 * m.head_dim as f64;
    let wname = window.map_or("causal".to_string(), |w| format!("window {w}"));
    println!(
        "| prefill | {} | f32 | {}K {} | {:.1} ms | {:.1} GFLOP/s | {:.1} GFLOP/s |",
        m.name,
        n / 1024,
        wname,
        t.0 * 1e3,
        flops / t.0 / 1e9,
        flops / t.1 / 1e9
    );
}

/// Parallel read bandwidth of a plain sum over 512 MiB (the ceiling for decode).
fn bandwidth() {
    let a = fill(128 << 20, 5);
    let t = median_secs(5, || {
        let s: f32 = a
            .par_chunks(1 << 16)
            .map(|c| {
                // 16 independent lanes so the sum vectorises and is not add-latency bound.
                let mut acc = [0.0f32; 16];
                for x in c.chunks_exact(16) {
                    for (a, &b) in acc.iter_mut().zip(x) {
                        *a += b;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(s);
    });
    println!(
        "| read bw | sum over 512 MiB | f32 | - | {:.1} ms | {:.1} GB/s | {:.1} GB/s |",
        t.0 * 1e3,
        (a.len() * 4) as f64 / t.0 / 1e9,
        (a.len() * 4) as f64 / t.1 / 1e9
    );
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    // Positional filters: kinds (bw, decode, prefill) and model names; none given = all.
    let kinds = ["bw", "decode", "paged", "prefill"];
    let (kind_args, model_args): (Vec<&String>, Vec<&String>) =
        args.iter().partition(|a| kinds.contains(&a.as_str()));
    let want = |s: &str| kind_args.is_empty() || kind_args.iter().any(|a| *a == s);
    let models: Vec<&Model> = MODELS
        .iter()
        .filter(|m| model_args.is_empty() || model_args.iter().any(|a| m.name.contains(a.as_str())))
        .collect();
    println!("threads: {}", rayon::current_num_threads());
    println!(
        "| kind | model | kv | size | median time | median throughput | best-run throughput |"
    );
    println!("|---|---|---|---|---|---|---|");
    if want("bw") {
        bandwidth();
    }
    if want("decode") {
        for &m in &models {
            for ctx in [8192, 32768] {
                decode::<f32>(m, ctx, "f32", |x| x);
                decode::<f16>(m, ctx, "f16", f16::from_f32);
                decode::<E4m3>(m, ctx, "fp8", E4m3::from_f32);
            }
        }
    }
    if want("paged") {
        for &m in &models {
            // 128K keys of Qwen3-0.6B shapes are 512 MiB: more than a large L3 holds.
            for ctx in [32768, 131072] {
                for block in [0, 16, 32, 64, 128, 0] {
                    decode_paged(m, ctx, block);
                }
            }
        }
    }
    if want("prefill") {
        for &m in &models {
            for n in [2048, 8192] {
                prefill(m, n, None);
                prefill(m, n, Some(512));
            }
        }
    }
}
