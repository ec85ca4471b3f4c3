//! Decode/prefill kernel benchmark on the Gemma 3 270M and Qwen3-0.6B shapes.
//!
//! `cargo bench -p slowfast-quant --bench kernels [-- FILTER]` prints markdown tables:
//! (a) quantized-dot matvec, (b) dequantize-then-f32-dot matvec, (c) f32 weights (memory-bound
//! reference), prefill n=512: (d) dequant tiles + GEMM, (e) quantized dots per token row; then the
//! matvec-vs-GEMM crossover sweep and a whole Gemma decode step. Median of several timed runs
//! after warm-up; GB/s counts weight bytes, GFLOP/s counts 2 * rows * cols * n.

use slowfast_quant::{
    matmul_gemm, matvec_with, quantize_row, DotPath, GgmlType, Isa, MatvecScratch, QMatrix,
};
use std::time::Instant;

struct Rng(u64);
impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Byte offsets of the f16 scales in one block of the types without a quantizer.
fn f16_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        _ => &[0],
    }
}

fn make(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut data = vec![0u8; rows * rb];
    if quantize_row(
        ty,
        &vec![0.0; ty.block_size()],
        &mut vec![0u8; ty.type_size()],
    )
    .is_err()
    {
        // No quantizer for this type: random bytes with small f16 scales (speed does not
        // depend on the values).
        for b in data.iter_mut() {
            *b = (rng.f32() * 128.0 + 128.0) as u8;
        }
        for blk in data.chunks_exact_mut(ty.type_size()) {
            for &o in f16_offsets(ty) {
                let d = half::f16::from_f32(rng.f32() * 0.005).to_bits();
                blk[o..o + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        return data;
    }
    let mut src = vec![0.0f32; cols];
    for r in 0..rows {
        src.iter_mut().for_each(|v| *v = rng.f32() * 0.05);
        quantize_row(ty, &src, &mut data[r * rb..(r + 1) * rb]).unwrap();
    }
    data
}

/// Median seconds per call of `f`: warm-up, then 7 samples of enough calls to last >= 20 ms.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    f();
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let reps = ((0.02 / once) as usize).clamp(1, 10_000);
    let mut samples: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples[3]
}

fn matvec_time(w: &QMatrix, x: &[f32], n: usize, path: DotPath) -> f64 {
    let mut y = vec![0.0f32; n * w.rows];
    let mut s = MatvecScratch::new();
    let isa = Isa::best();
    time(|| matvec_with(w, x, n, 0..w.rows, &mut y, &mut s, path, isa).unwrap())
}

fn gemm_time(w: &QMatrix, x: &[f32], n: usize) -> f64 {
    let mut y = vec![0.0f32; n * w.rows];
    time(|| matmul_gemm(w, x, n, &mut y).unwrap())
}

struct Shape {
    model: &'static str,
    name: &'static str,
    cols: usize,
    rows: usize,
}

const fn sh(model: &'static str, name: &'static str, cols: usize, rows: usize) -> Shape {
    Shape {
        model,
        name,
        cols,
        rows,
    }
}

const SHAPES: &[Shape] = &[
    sh("gemma3-270m", "q", 640, 1024),
    sh("gemma3-270m", "k/v", 640, 256),
    sh("gemma3-270m", "o", 1024, 640),
    sh("gemma3-270m", "gate/up", 640, 2048),
    sh("gemma3-270m", "down", 2048, 640),
    sh("gemma3-270m", "lm_head", 640, 262144),
    sh("qwen3-0.6b", "q", 1024, 2048),
    sh("qwen3-0.6b", "k/v", 1024, 1024),
    sh("qwen3-0.6b", "o", 2048, 1024),
    sh("qwen3-0.6b", "gate/up", 1024, 3072),
    sh("qwen3-0.6b", "down", 3072, 1024),
    sh("qwen3-0.6b", "lm_head", 1024, 151936),
];

const TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_XS,
];

fn main() {
    // Args: [SECTIONS [MATCH]]: SECTIONS a comma list of decode,prefill,crossover,step,isa
    // (default all); MATCH a substring of "model matrix type" limiting the decode/prefill table.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let sections = args.first().cloned().unwrap_or_default();
    let want = |s: &str| sections.is_empty() || sections.split(',').any(|x| x == s);
    let pattern = args.get(1).cloned().unwrap_or_default();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    println!(
        "isa={} threads={}",
        Isa::best().name(),
        rayon::current_num_threads()
    );
    if want("decode") || want("prefill") {
        decode_and_prefill(&mut rng, want("prefill"), &pattern);
    }
    if want("crossover") {
        crossover(&mut rng);
    }
    if want("step") {
        gemma_step(&mut rng);
    }
    if want("isa") {
        per_isa(&mut rng);
    }
}

/// Quantized-dot matvec per instruction set on one shape, single-threaded: ns per row.
fn per_isa(rng: &mut Rng) {
    let (cols, rows) = (1024, 3072);
    let isas = Isa::available();
    println!("\nQuantized-dot matvec {cols}->{rows}, 1 thread: ns per row (GB/s of weights)");
    let head: Vec<&str> = isas.iter().map(|i| i.name()).collect();
    println!("| type | {} |", head.join(" | "));
    println!("|---|{}", "---|".repeat(isas.len()));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for &ty in &TYPES[3..] {
        let data = make(rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let mut line = format!("| {ty} |");
        for &isa in &isas {
            let mut y = vec![0.0f32; rows];
            let mut s = MatvecScratch::new();
            let t = pool.install(|| {
                time(|| {
                    matvec_with(&w, &x, 1, 0..rows, &mut y, &mut s, DotPath::Quantized, isa)
                        .unwrap()
                })
            });
            let gbs = data.len() as f64 / t / 1e9;
            line += &format!(" {:.0} ({gbs:.1}) |", t / rows as f64 * 1e9);
        }
        println!("{line}");
    }
}

fn decode_and_prefill(rng: &mut Rng, prefill: bool, pattern: &str) {
    println!("\n| model | matrix | in->out | type | MB | (a) qdot us | GB/s | (b) deq+dot us | GB/s | (c) f32 us | (d) n=512 deq+GEMM ms | GFLOP/s | (e) n=512 qdot ms | GFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in SHAPES {
        let lm = s.name == "lm_head";
        if !TYPES
            .iter()
            .any(|t| format!("{} {} {}", s.model, s.name, t).contains(pattern))
        {
            continue;
        }
        let f32_data = make(rng, GgmlType::F32, s.rows, s.cols);
        let wf = QMatrix::new(GgmlType::F32, s.rows, s.cols, &f32_data).unwrap();
        let x: Vec<f32> = (0..s.cols).map(|_| rng.f32()).collect();
        let tf = matvec_time(&wf, &x, 1, DotPath::Quantized);
        drop(f32_data);
        let types: &[GgmlType] = if lm {
            &[GgmlType::Q8_0, GgmlType::Q6_K]
        } else {
            TYPES
        };
        for &ty in types {
            let label = format!("{} {} {}", s.model, s.name, ty);
            if ty.row_bytes(s.cols).is_err() || !label.contains(pattern) {
                continue;
            }
            let data = make(rng, ty, s.rows, s.cols);
            let w = QMatrix::new(ty, s.rows, s.cols, &data).unwrap();
            let mb = data.len() as f64 / 1e6;
            let ta = matvec_time(&w, &x, 1, DotPath::Quantized);
            let tb = matvec_time(&w, &x, 1, DotPath::Dequantized);
            let flop1 = 2.0 * s.rows as f64 * s.cols as f64;
            let (pd, pe) = if lm || !prefill {
                ("-".to_string(), "-".to_string())
            } else {
                let n = 512;
                let xn: Vec<f32> = (0..n * s.cols).map(|_| rng.f32()).collect();
                let td = gemm_time(&w, &xn, n);
                let te = matvec_time(&w, &xn, n, DotPath::Quantized);
                let g = |t: f64| flop1 * n as f64 / t / 1e9;
                (
                    format!("{:.2} | {:.1}", td * 1e3, g(td)),
                    format!("{:.2} | {:.1}", te * 1e3, g(te)),
                )
            };
            println!(
                "| {} | {} | {}->{} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
                s.model,
                s.name,
                s.cols,
                s.rows,
                ty,
                mb,
                ta * 1e6,
                mb / 1e3 / ta,
                tb * 1e6,
                mb / 1e3 / tb,
                tf * 1e6,
                pd,
                pe
            );
        }
    }
}

fn crossover(rng: &mut Rng) {
    println!("\nCrossover: batched quantized-dot matvec vs dequant+GEMM, time per call in us");
    println!("| matrix | type | n=1 qdot/gemm | 4 | 8 | 16 | 32 | 64 | 128 |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let cases = [
        (640, 2048, GgmlType::Q5_0),
        (640, 2048, GgmlType::Q8_0),
        (640, 2048, GgmlType::F16),
        (1024, 3072, GgmlType::Q4_K),
        (1024, 3072, GgmlType::Q6_K),
        (1024, 3072, GgmlType::BF16),
        (1024, 3072, GgmlType::F32),
    ];
    for (cols, rows, ty) in cases {
        let data = make(rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let mut line = format!("| {cols}->{rows} | {ty} |");
        for n in [1usize, 4, 8, 16, 32, 64, 128] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
            let tq = matvec_time(&w, &x, n, DotPath::Quantized);
            let tg = gemm_time(&w, &x, n);
            line += &format!(" {:.0}/{:.0} |", tq * 1e6, tg * 1e6);
        }
        println!("{line}");
    }
}

/// All decode matvecs of one Gemma 3 270M token with the Q4_K_M file's tensor types.
fn gemma_step(rng: &mut Rng) {
    // (count, cols, rows, type) from gemma-3-270m-q4_k_m.gguf (18 layers).
    let parts = [
        (18, 640, 1024, GgmlType::Q5_0),  // q
        (27, 640, 256, GgmlType::Q5_0),   // k (18) + v (9)
        (9, 640, 256, GgmlType::Q8_0),    // v
        (18, 1024, 640, GgmlType::Q4_K),  // o
        (36, 640, 2048, GgmlType::Q5_0),  // gate, up
        (9, 2048, 640, GgmlType::Q4_K),   // down
        (9, 2048, 640, GgmlType::Q6_K),   // down
        (1, 640, 262144, GgmlType::Q8_0), // lm_head (tied embedding)
    ];
    println!(
        "\nGemma 3 270M Q4_K_M decode step, matvecs only (quantized dots, {} threads)",
        rayon::current_num_threads()
    );
    println!("| part | count | us each | ms total |");
    println!("|---|---|---|---|");
    let mut total = 0.0;
    for (count, cols, rows, ty) in parts {
        let data = make(rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let t = matvec_time(&w, &x, 1, DotPath::Quantized);
        total += t * count as f64;
        println!(
            "| {cols}->{rows} {ty} | {count} | {:.1} | {:.2} |",
            t * 1e6,
            t * count as f64 * 1e3
        );
    }
    println!("| total | | | {:.2} |", total * 1e3);
}
