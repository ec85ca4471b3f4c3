//! Shared helpers of the GPU tests: the context (or a printed skip), random inputs, error norms.
#![allow(dead_code)]

use slowfast_cuda::{bf16, CudaContext, KvLayout};

/// The device-0 context, or None after printing why the test is skipped.
/// With SLOWFAST_REQUIRE_GPU=1 a missing GPU fails the test instead.
pub fn gpu(test: &str) -> Option<CudaContext> {
    match CudaContext::new(0) {
        Ok(c) => Some(c),
        Err(e) => {
            if std::env::var("SLOWFAST_REQUIRE_GPU")
                .map(|v| v == "1")
                .unwrap_or(false)
            {
                panic!("{test}: SLOWFAST_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            println!("{test}: skipped, no usable GPU ({e})");
            None
        }
    }
}

/// xorshift64* with a per-test seed mixed with the clock, so every run draws fresh inputs.
pub struct Rng(u64);
impl Rng {
    pub fn new(tag: u64) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let seed = (t ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        println!("rng seed {seed:#x}");
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Approximately normal (sum of uniforms), times `scale`.
    pub fn normal(&mut self, scale: f32) -> f32 {
        (self.uniform() + self.uniform() + self.uniform()) * scale
    }
    pub fn vec_f32(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal(scale)).collect()
    }
    pub fn vec_bf16(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.normal(scale))).collect()
    }
}

pub fn to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// An f32 device buffer as f64 values.
pub fn dl_f32(ctx: &CudaContext, b: &slowfast_cuda::GpuBuffer<f32>) -> Vec<f64> {
    ctx.download(b).unwrap().iter().map(|&v| v as f64).collect()
}

pub fn nan_bf16(n: usize) -> Vec<bf16> {
    vec![bf16::NAN; n]
}

/// ||got - want|| / ||want||, failing on any non-finite value in `got`.
pub fn rel_err(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} is {} (unwritten or NaN); want {}",
            got[i], want[i]
        );
    }
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_err(what, got, want);
    println!("{what}: rel err {e:.3e} (tol {tol:.0e})");
    assert!(e < tol, "{what}: relative error {e:.3e} over {tol:.0e}");
}

pub fn bf(x: f64) -> f64 {
    bf16::from_f64(x).to_f64()
}

/// A cache with random rows where (slot, position) < that slot's length and NaN elsewhere
/// (rows a kernel must never read).
pub fn fill_cache(rng: &mut Rng, kv: &KvLayout, lens: &[(usize, usize)]) -> Vec<bf16> {
    // random where (slot, pos) < len, NaN elsewhere (must never be read)
    let mut c = vec![bf16::NAN; kv.elems()];
    for &(slot, len) in lens {
        for h in 0..kv.kv_heads {
            let b = (slot * kv.kv_heads + h) * kv.capacity * kv.head_dim;
            for x in &mut c[b..b + len * kv.head_dim] {
                *x = bf16::from_f32(rng.normal(1.0));
            }
        }
    }
    c
}

/// GPU and CPU selections of one head agree up to near-ties: the symmetric difference is small.
pub fn check_sets(what: &str, gpu: &[u32], cpu: &[u32]) {
    let a: std::collections::BTreeSet<u32> = gpu.iter().copied().collect();
    let b: std::collections::BTreeSet<u32> = cpu.iter().copied().collect();
    assert_eq!(
        a.len(),
        gpu.len(),
        "{what}: duplicate positions from the GPU"
    );
    let diff = a.symmetric_difference(&b).count();
    println!("{what}: {} chosen, {} differ", cpu.len(), diff);
    assert!(
        diff <= 2 + cpu.len() / 200,
        "{what}: {diff} of {} positions differ",
        cpu.len()
    );
    assert!(
        gpu.windows(2).all(|w| w[0] < w[1]),
        "{what}: GPU positions not ascending"
    );
}

/// The f64 attention scores `scale · q·k` of the key rows `rows`: `q(i)` and `k(r, i)` give
/// element `i < d` of the query and of key row `r`.
pub fn scaled_dots(
    rows: &[usize],
    d: usize,
    scale: f64,
    q: impl Fn(usize) -> f64,
    k: impl Fn(usize, usize) -> f64,
) -> Vec<f64> {
    rows.iter()
        .map(|&r| (0..d).map(|i| q(i) * k(r, i)).sum::<f64>() * scale)
        .collect()
}

/// Softmax of the scores `s` (f64) applied to value rows: `v(t, i)` is element `i < d` of the
/// row of score `t`. The f64 reference of an attention output.
pub fn softmax_mix(s: &[f64], d: usize, v: impl Fn(usize, usize) -> f64) -> Vec<f64> {
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut o = vec![0.0; d];
    for (t, &wt) in w.iter().enumerate() {
        for (i, x) in o.iter_mut().enumerate() {
            *x += wt / z * v(t, i);
        }
    }
    o
}
