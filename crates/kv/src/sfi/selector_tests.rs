//! Tests of the SFI Selector: fast path vs the f64 reference on random inputs (same sets up to
//! ties), kernel-vs-portable checks, bad-input errors and scratch reuse; shared test helpers.
use super::selector::*;
use super::selector_cases::one_head;
use super::selector_math::{self as math, portable, PowMode};
use super::selector_ref::select_reference;

const NEG_INF: f32 = f32::NEG_INFINITY;

pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(super) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(super) fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

pub(super) struct Case {
    pub(super) nh: usize,
    pub(super) rows: usize,
    pub(super) len: usize,
    pub(super) sinks: usize,
    pub(super) recent_start: usize,
    pub(super) k: usize,
    pub(super) logits: Vec<f32>, // [nh, rows, len]
    pub(super) norms: Vec<f32>,  // [nh, len]
}

impl Case {
    pub(super) fn input(&self) -> SelectorInput<'_> {
        SelectorInput {
            n_kv_heads: self.nh,
            rows: self.rows,
            seq_len: self.len,
            logits: &self.logits,
            key_norms: &self.norms,
            sinks: self.sinks,
            recent_start: self.recent_start,
            k: self.k,
            positions: None,
        }
    }
}

/// Random logits with peaks and masked keys, random norms with a few zeros.
pub(super) fn random_case(rng: &mut Rng, nh: usize, rows: usize, len: usize) -> Case {
    let sinks = rng.below(5).min(len);
    let recent = rng.below(300).min(len - sinks);
    let recent_start = (len - recent) / 16 * 16;
    let recent_start = recent_start.max(sinks);
    let n = recent_start - sinks;
    let k = 1 + rng.below(n.max(1) + 2);
    let sigma = [0.5, 2.0, 6.0][rng.below(3)];
    let mut logits = vec![0f32; nh * rows * len];
    for h in 0..nh {
        let peaks: Vec<usize> = (0..1 + rng.below(20)).map(|_| rng.below(len)).collect();
        let masked_from = if rng.below(4) == 0 {
            rng.below(len + 1)
        } else {
            len
        };
        for r in 0..rows {
            let dead_row = rows > 1 && rng.below(8) == 0;
            let row = &mut logits[(h * rows + r) * len..(h * rows + r + 1) * len];
            for (j, v) in row.iter_mut().enumerate() {
                *v = (sigma * rng.normal()) as f32;
                if dead_row || j >= masked_from || rng.below(50) == 0 {
                    *v = NEG_INF;
                }
            }
            for &p in &peaks {
                if row[p] > NEG_INF {
                    row[p] += 4.0 + 8.0 * rng.unit() as f32;
                }
            }
        }
    }
    let norms = (0..nh * len)
        .map(|_| {
            if rng.below(40) == 0 {
                0.0
            } else {
                (20.0 * rng.unit()) as f32
            }
        })
        .collect();
    Case {
        nh,
        rows,
        len,
        sinks,
        recent_start,
        k,
        logits,
        norms,
    }
}

/// Same sets per head, except tokens whose reference scores tie with the k-th score (1e-6 rel).
pub(super) fn assert_same_up_to_ties(
    fast: &Selection,
    reference: &Selection,
    scores: &[Vec<f64>],
    c: &Case,
    ctx: &str,
) -> usize {
    assert_eq!(fast.per_head.len(), c.nh, "{ctx}");
    let mut ties = 0;
    for (h, (f, r)) in fast.per_head.iter().zip(&reference.per_head).enumerate() {
        assert_eq!(f.len(), r.len(), "{ctx} head {h}: lengths");
        assert_eq!(
            f.len(),
            fast.per_head[0].len(),
            "{ctx}: equal lengths across heads"
        );
        assert!(
            f.windows(2).all(|w| w[0] < w[1]),
            "{ctx} head {h}: sorted, unique"
        );
        assert!(
            f.iter()
                .all(|&p| (c.sinks..c.recent_start).contains(&(p as usize))),
            "{ctx}: in domain"
        );
        if f == r {
            continue;
        }
        let score = |p: u32| scores[h][p as usize - c.sinks];
        let kth = r.iter().map(|&p| score(p)).fold(f64::INFINITY, f64::min);
        for &p in f
            .iter()
            .filter(|p| !r.contains(p))
            .chain(r.iter().filter(|p| !f.contains(p)))
        {
            let s = score(p);
            assert!(
                (s - kth).abs() <= 1e-6 * kth.abs(),
                "{ctx} head {h}: token {p} differs with score {s} vs k-th {kth}"
            );
            ties += 1;
        }
    }
    ties
}

#[test]
fn fast_matches_reference_on_random_inputs() {
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    let mut ties = 0;
    let mut runs = 0;
    for seed in 0..6u64 {
        let mut rng = Rng(seed * 7919 + 1);
        for &nh in &[1usize, 2, 3, 5, 8] {
            for &rows in &[1usize, 4, 16] {
                let len = [1usize, 17, 300, 1500, 4096][rng.below(5)];
                if len * nh * rows > 4096 * 40 && seed > 1 {
                    continue; // keep the reference's run time small
                }
                let c = random_case(&mut rng, nh, rows, len);
                let ctx = format!(
                    "seed {seed} nh {nh} rows {rows} len {len} k {} D [{}, {})",
                    c.k, c.sinks, c.recent_start
                );
                let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
                let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
                ties += assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
                runs += 1;
            }
        }
    }
    println!("{runs} random cases, {ties} tokens differed within the tie tolerance");
}

/// The AVX2 and portable builds give the same answers (other tests run the best build).
#[test]
fn fast_matches_reference_at_every_simd_level() {
    use std::sync::atomic::Ordering;
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    for cap in [1u8, 2] {
        crate::sfi::SIMD_CAP.store(cap, Ordering::Relaxed);
        let mut rng = Rng(1000 + cap as u64);
        for &(nh, rows, len) in &[(3usize, 4usize, 2000usize), (8, 1, 1000), (2, 16, 517)] {
            let c = random_case(&mut rng, nh, rows, len);
            let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
            let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
            assert_same_up_to_ties(
                &fast,
                &reference,
                &scores,
                &c,
                &format!("simd cap {cap} nh {nh}"),
            );
        }
    }
    crate::sfi::SIMD_CAP.store(0, Ordering::Relaxed);
}

#[test]
fn fast_matches_reference_with_other_alphas_and_k_sweep() {
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(99);
    for alpha in [0.0, 1.0, 0.3] {
        let cfg = SelectorConfig {
            alpha,
            ..Default::default()
        };
        let mut c = random_case(&mut rng, 4, 4, 700);
        let n = c.recent_start - c.sinks;
        for k in [1, 2, n / 3, n - 1, n, n + 5] {
            c.k = k;
            let ctx = format!("alpha {alpha} k {k} n {n}");
            let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
            let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
            assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
        }
    }
}

#[test]
fn fast_matches_reference_with_span_pooling() {
    // soft_alpha < 0 turns soft-NMS into pooling: neighbours of a peak move up towards it.
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(1234);
    for (soft_alpha, nms_window) in [(-1.0, 8), (-0.5, 6), (-1.0, 32)] {
        let cfg = SelectorConfig {
            soft_alpha,
            nms_window,
            ..Default::default()
        };
        let mut c = random_case(&mut rng, 4, 4, 600);
        c.k = (c.recent_start - c.sinks) / 4;
        let ctx = format!("soft_alpha {soft_alpha} window {nms_window}");
        let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
        let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
        assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
    }
}

#[test]
fn fast_matches_reference_with_a_shifted_window() {
    // nms_shift moves the pooling / soft-NMS window towards earlier keys; shifts beyond the
    // half window (a key outside its own window), beyond the domain, and a tiny domain.
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(4321);
    let cases = [
        (-1.0, 8, 4, 600),
        (-1.0, 8, 8, 600),
        (-1.0, 16, 12, 600),
        (-0.5, 6, 3, 600),
        (1.0, 32, 16, 600),
        (-1.0, 8, 30, 600),
        (-1.0, 8, 700, 600),
        (-1.0, 8, 6, 40),
        (-1.0, 0, 6, 600),
    ];
    for (soft_alpha, nms_window, nms_shift, len) in cases {
        let cfg = SelectorConfig {
            soft_alpha,
            nms_window,
            nms_shift,
            ..Default::default()
        };
        for nh in [1, 4] {
            let mut c = random_case(&mut rng, nh, 4, len);
            c.k = ((c.recent_start - c.sinks) / 4).max(1);
            let ctx =
                format!("soft_alpha {soft_alpha} window {nms_window} shift {nms_shift} nh {nh}");
            let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
            let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
            assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
        }
    }
}

#[test]
fn fast_matches_reference_with_mass_weighted_evidence() {
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(777);
    for alpha in [0.5, 1.0, 0.0, 0.7] {
        for (nh, rows) in [(1, 4), (4, 2), (2, 16)] {
            let cfg = SelectorConfig {
                alpha,
                evidence_mass: true,
                soft_alpha: -1.0,
                nms_window: 8,
                ..Default::default()
            };
            let mut c = random_case(&mut rng, nh, rows, 500);
            c.k = ((c.recent_start - c.sinks) / 3).max(1);
            let ctx = format!("evidence_mass alpha {alpha} nh {nh} rows {rows}");
            let fast = select(&cfg, &c.input(), &mut scratch).unwrap();
            let (reference, scores) = select_reference(&cfg, &c.input()).unwrap();
            assert_same_up_to_ties(&fast, &reference, &scores, &c, &ctx);
        }
    }
}

/// Two rows with equally peaked attention over D, one of them spending almost all its mass on
/// a sink: normalised over D they tie (the lower position wins), weighted by mass the row
/// that attends to D decides.
#[test]
fn mass_weighted_evidence_follows_the_row_that_attends_to_the_domain() {
    let (len, sinks, x, y) = (100usize, 2usize, 20usize, 40usize);
    let mut logits = vec![0.0f32; 2 * len];
    logits[0] = 20.0; // row 0: a sink
    logits[x] = 5.0;
    logits[len + y] = 5.0; // row 1
    let norms = vec![1.0f32; len];
    let inp = SelectorInput {
        n_kv_heads: 1,
        rows: 2,
        seq_len: len,
        logits: &logits,
        key_norms: &norms,
        sinks,
        recent_start: 80,
        k: 1,
        positions: None,
    };
    let mut cfg = SelectorConfig {
        alpha: 1.0,
        soft_alpha: 0.0,
        lambda_clip_single: 0.0,
        lambda_clip_multi: 0.0,
        ..Default::default()
    };
    let mut scratch = SelectorScratch::default();
    assert_eq!(
        select(&cfg, &inp, &mut scratch).unwrap().per_head[0],
        vec![x as u32]
    );
    cfg.evidence_mass = true;
    assert_eq!(
        select(&cfg, &inp, &mut scratch).unwrap().per_head[0],
        vec![y as u32]
    );
    let (reference, _) = select_reference(&cfg, &inp).unwrap();
    assert_eq!(reference.per_head[0], vec![y as u32]);
}

/// With pooling, a window shifted by its half width keeps the keys after a peak: key j pools
/// [j - w, j], so one sharp peak and a budget of `w + 1` keep the peak and the `w` keys that
/// follow it.
#[test]
fn shifted_pooling_keeps_the_keys_after_a_peak() {
    let (len, sinks, peak) = (200usize, 2usize, 60usize);
    let mut logits = vec![0.0f32; len];
    logits[peak] = 30.0;
    let norms = vec![1.0f32; len];
    let cfg = SelectorConfig {
        soft_alpha: -1.0,
        nms_window: 8,
        nms_shift: 4,
        lambda_clip_single: 0.0,
        lambda_clip_multi: 0.0,
        ..Default::default()
    };
    let inp = SelectorInput {
        n_kv_heads: 1,
        rows: 1,
        seq_len: len,
        logits: &logits,
        key_norms: &norms,
        sinks,
        recent_start: 160,
        k: 9,
        positions: None,
    };
    let mut scratch = SelectorScratch::default();
    let fast = select(&cfg, &inp, &mut scratch).unwrap();
    let want: Vec<u32> = (peak as u32..=(peak + 8) as u32).collect();
    assert_eq!(fast.per_head[0], want);
    let (reference, _) = select_reference(&cfg, &inp).unwrap();
    assert_eq!(reference.per_head[0], want);
}

#[test]
fn sliding_max_matches_brute_force() {
    let mut rng = Rng(3);
    let (mut g, mut h, mut out) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..200 {
        let n = 1 + rng.below(150);
        let half = rng.below(40);
        let x: Vec<f64> = (0..n)
            .map(|_| {
                if rng.below(10) == 0 {
                    f64::NEG_INFINITY
                } else {
                    rng.normal()
                }
            })
            .collect();
        math::sliding_max(&x, half, &mut g, &mut h, &mut out);
        for j in 0..n {
            let want = x[j.saturating_sub(half)..=(j + half).min(n - 1)]
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(out[j], want, "n {n} half {half} j {j}");
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    let mut c = one_head(vec![0.0; 64], 2, 48, 4);
    c.logits[7] = f32::NAN;
    let e = select(&cfg, &c.input(), &mut scratch).unwrap_err();
    assert!(
        matches!(e, SelectorError::BadLogit { head: 0, row: 0, pos: 7, value } if value.is_nan()),
        "{e}"
    );
    assert!(matches!(
        select_reference(&cfg, &c.input()),
        Err(SelectorError::BadLogit { pos: 7, .. })
    ));
    c.logits[7] = f32::INFINITY;
    assert!(matches!(
        select(&cfg, &c.input(), &mut scratch),
        Err(SelectorError::BadLogit { pos: 7, .. })
    ));
    c.logits[7] = 0.0;
    c.norms[9] = -1.0;
    assert!(matches!(
        select(&cfg, &c.input(), &mut scratch),
        Err(SelectorError::BadKeyNorm { pos: 9, .. })
    ));
    c.norms[9] = 1.0;
    c.recent_start = 65;
    assert!(matches!(
        select(&cfg, &c.input(), &mut scratch),
        Err(SelectorError::Domain { .. })
    ));
    c.recent_start = 48;
    c.rows = 2;
    let msg = select(&cfg, &c.input(), &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("logits has 64 values, expected 128"), "{msg}");
    c.rows = 1;
    let bad = SelectorConfig {
        cross_head_temperature: 0.0,
        ..cfg
    };
    let msg = select(&bad, &c.input(), &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("cross_head_temperature"), "{msg}");
    let bad = SelectorConfig { alpha: -1.0, ..cfg };
    assert!(select_reference(&bad, &c.input()).is_err());
    let bad = SelectorConfig {
        soft_alpha: -1.5,
        ..cfg
    };
    let msg = select(&bad, &c.input(), &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("soft_alpha"), "{msg}");
}

#[test]
fn exp_f32_is_accurate() {
    let mut x = -87.0f32;
    while x <= 0.0 {
        let (got, want) = (math::exp_f32(x) as f64, (x as f64).exp());
        assert!(
            ((got - want) / want).abs() < 3e-7,
            "exp({x}) = {got}, want {want}"
        );
        x += 0.0137;
    }
    assert_eq!(math::exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(math::exp_f32(-100.0), 0.0);
}

#[test]
fn dispatched_row_kernels_match_portable_ones() {
    let mut rng = Rng(23);
    for n in [1usize, 15, 16, 17, 100, 1000] {
        let z: Vec<f32> = (0..n)
            .map(|_| {
                if rng.below(7) == 0 {
                    NEG_INF
                } else {
                    (3.0 * rng.normal()) as f32
                }
            })
            .collect();
        let (mut c1, mut c2) = (vec![-1.0f32; n], vec![-1.0f32; n]);
        let a = math::row_max_colmax(&z, &mut c1);
        let b = portable::row_max_colmax(&z, &mut c2);
        assert_eq!(a, b);
        assert_eq!(c1, c2);
        let m = a.0;
        if m == NEG_INF {
            continue; // the selector skips rows that see nothing
        }
        for (alpha, mode) in [
            (0.5, PowMode::Square),
            (1.0, PowMode::Identity),
            (0.3, PowMode::Separate),
        ] {
            let (mut b1, mut b2) = (vec![0f32; n], vec![0f32; n]);
            let s1 = math::row_exp(&z, m, alpha, mode, &mut b1);
            let s2 = portable::row_exp(&z, m, alpha, mode, &mut b2);
            assert!((s1 - s2).abs() <= 1e-6 * s2, "{s1} vs {s2}");
            let want: f64 = z.iter().map(|&v| ((v - m) as f64).exp()).sum();
            assert!((s1 - want).abs() <= 1e-5 * want, "sum {s1} vs {want}");
            for j in 0..n {
                assert!((b1[j] - b2[j]).abs() <= 1e-6 * b2[j].abs());
                let w = (alpha as f64 * (z[j] - m) as f64).exp();
                assert!((b1[j] as f64 - w).abs() <= 1e-6 * w + 1e-37);
            }
            let (mut a1, mut a2) = (b1.clone(), b1.clone());
            math::axpy(&mut a1, &b2, 0.7);
            portable::axpy(&mut a2, &b2, 0.7);
            assert_eq!(a1, a2);
        }
    }
}

/// Counts the allocations made by the current thread (delegates to the system allocator).
struct CountingAlloc;

thread_local! {
    static ALLOCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards every call unchanged to `System`; only bumps a thread-local counter.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn warmed_up_select_into_allocates_nothing() {
    let mut rng = Rng(77);
    let big = random_case(&mut rng, 8, 16, 3000);
    let small = random_case(&mut rng, 8, 2, 1200);
    for alpha in [0.5, 0.0, 0.7] {
        let cfg = SelectorConfig {
            alpha,
            ..Default::default()
        };
        let mut scratch = SelectorScratch::default();
        let mut out = Selection::default();
        select_into(&cfg, &big.input(), &mut scratch, &mut out).unwrap(); // warm-up
        let before = ALLOCS.with(|c| c.get());
        for c in [&small, &big, &small] {
            select_into(&cfg, &c.input(), &mut scratch, &mut out).unwrap();
        }
        assert_eq!(
            ALLOCS.with(|c| c.get()),
            before,
            "alpha {alpha}: allocations after warm-up"
        );
    }
}

#[test]
fn scratch_is_reused_without_growth() {
    let cfg = SelectorConfig::default();
    let mut rng = Rng(31);
    let c = random_case(&mut rng, 4, 4, 2000);
    let mut scratch = SelectorScratch::default();
    let mut out = Selection::default();
    select_into(&cfg, &c.input(), &mut scratch, &mut out).unwrap();
    let first = out.clone();
    let ptrs: Vec<*const u32> = out.per_head.iter().map(|v| v.as_ptr()).collect();
    select_into(&cfg, &c.input(), &mut scratch, &mut out).unwrap();
    assert_eq!(out, first);
    let again: Vec<*const u32> = out.per_head.iter().map(|v| v.as_ptr()).collect();
    assert_eq!(ptrs, again, "output buffers reused");
}

#[test]
fn f64_exp_and_ln_are_accurate_and_dispatch_matches_portable() {
    let mut rng = Rng(41);
    let xs: Vec<f64> = (0..5000)
        .map(|_| -700.0 * rng.unit().powi(3) + 5.0 * rng.normal())
        .collect();
    let mut e1 = xs.clone();
    let mut e2 = xs.clone();
    math::exp_slice(&mut e1);
    portable::exp_slice(&mut e2);
    for ((&x, &a), &b) in xs.iter().zip(&e1).zip(&e2) {
        let want = x.exp();
        assert!(
            (a - want).abs() <= 4e-16 * want,
            "exp({x}) = {a}, want {want}"
        );
        assert!((a - b).abs() <= 4e-16 * want);
    }
    let ys: Vec<f64> = (0..5000)
        .map(|_| (200.0 * rng.normal()).exp())
        .chain([1e-310, 5e-324, 1.0, 2.0])
        .collect();
    let mut l1 = ys.clone();
    let mut l2 = ys.clone();
    math::ln_slice(&mut l1);
    portable::ln_slice(&mut l2);
    for ((&y, &a), &b) in ys.iter().zip(&l1).zip(&l2) {
        let want = y.ln();
        assert!(
            (a - want).abs() <= 4e-16 * want.abs().max(1.0),
            "ln({y}) = {a}, want {want}"
        );
        assert!((a - b).abs() <= 4e-16 * want.abs().max(1.0));
    }
    let mut special = [0.0, f64::NEG_INFINITY, -800.0];
    math::ln_slice(&mut special[..1]);
    math::exp_slice(&mut special[1..]);
    assert_eq!(special, [f64::NEG_INFINITY, 0.0, 0.0]);
}

/// Explicit key positions (a compacted layer): the identity list changes nothing; a sparse
/// list moves the position prior to the real positions, and fast path and reference agree.
#[test]
fn explicit_positions_feed_the_position_prior() {
    let cfg = SelectorConfig::default();
    let mut scratch = SelectorScratch::default();
    let mut rng = Rng(4242);
    for &(nh, rows, len) in &[(2usize, 4usize, 300usize), (3, 1, 1500), (1, 16, 17)] {
        let c = random_case(&mut rng, nh, rows, len);
        let ident: Vec<u32> = (0..len as u32).collect();
        let plain = select(&cfg, &c.input(), &mut scratch).unwrap();
        let with_ident = SelectorInput {
            positions: Some(&ident),
            ..c.input()
        };
        assert_eq!(select(&cfg, &with_ident, &mut scratch).unwrap(), plain);
        // Slots at irregular, ascending positions (gaps grow along the sequence).
        let sparse: Vec<u32> = (0..len as u32).map(|i| i * 3 + i * i / 7).collect();
        let inp = SelectorInput {
            positions: Some(&sparse),
            ..c.input()
        };
        let fast = select(&cfg, &inp, &mut scratch).unwrap();
        let (reference, scores) = select_reference(&cfg, &inp).unwrap();
        assert_same_up_to_ties(&fast, &reference, &scores, &c, "sparse positions");
    }
    // The prior follows the positions: equal slot spacing, unequal position spacing.
    let pos = [0u32, 1, 2, 100, 101, 102];
    let d = |j: usize| log_pos_prior(&cfg, 0, 6, j, Some(&pos));
    let (near, far) = (d(1) - d(2), d(2) - d(3));
    assert!(far > 10.0 * near, "near {near} far {far}");
    // Bad position lists are refused.
    let c = one_head(vec![0.0; 64], 2, 48, 4);
    let short = [0u32; 10];
    let bad = SelectorInput {
        positions: Some(&short),
        ..c.input()
    };
    assert!(matches!(
        select(&cfg, &bad, &mut scratch),
        Err(SelectorError::Len {
            name: "positions",
            ..
        })
    ));
    let flat = vec![5u32; 64];
    let bad = SelectorInput {
        positions: Some(&flat),
        ..c.input()
    };
    assert_eq!(
        select(&cfg, &bad, &mut scratch),
        Err(SelectorError::Positions)
    );
}
