//! Tests of the tiled kernels against the f64 reference on seeded random inputs: head layouts,
//! head dims, masks, chunked prefill, ring buffers, position lists, f16 KV, every ISA.

use super::tile::Isa;
use super::*;
use half::f16;

/// splitmix64 stream of uniform floats in [-1, 1).
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(super) fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub(super) fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * amp).collect()
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Owned data of one segment: keys, values (`[len, d]`), positions.
pub(super) struct SegData<T> {
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub pos: Vec<u32>,
    /// Describe positions as a `Range` (they must then be consecutive).
    pub as_range: bool,
}

pub(super) trait FromF32: KvElem {
    fn from_f32(x: f32) -> Self;
}
impl FromF32 for f32 {
    fn from_f32(x: f32) -> f32 {
        x
    }
}
impl FromF32 for f16 {
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
}
impl FromF32 for crate::e4m3::E4m3 {
    fn from_f32(x: f32) -> Self {
        crate::e4m3::E4m3::from_f32(x)
    }
}

impl<T: FromF32> SegData<T> {
    /// Random keys/values at the given positions.
    pub(super) fn random(rng: &mut Rng, d: usize, pos: Vec<u32>, as_range: bool) -> SegData<T> {
        let n = pos.len();
        let k = rng.vec(n * d, 1.0).into_iter().map(T::from_f32).collect();
        let v = rng.vec(n * d, 1.0).into_iter().map(T::from_f32).collect();
        SegData {
            k,
            v,
            pos,
            as_range,
        }
    }
    pub(super) fn view(&self) -> KvSegment<'_, T> {
        let pos = if self.as_range {
            KvPositions::Range {
                start: self.pos.first().copied().unwrap_or(0),
            }
        } else {
            KvPositions::List(&self.pos)
        };
        KvSegment {
            k: &self.k,
            v: &self.v,
            pos,
        }
    }
}

/// A full problem: shape, queries, per-kv-head segments.
pub(super) struct Case<T> {
    pub shape: AttnShape,
    pub q: Vec<f32>,
    pub q_pos: Vec<u32>,
    pub heads: Vec<Vec<SegData<T>>>,
}

impl<T: FromF32> Case<T> {
    /// `n_q` queries at `q_pos0..`, every kv head holding the segments laid out by `layout`
    /// (a list of (positions, as_range)); `q_amp` scales the queries (peakier softmax).
    pub(super) fn new(
        seed: u64,
        (n_heads, n_kv_heads, d): (usize, usize, usize),
        n_q: usize,
        q_pos0: u32,
        layout: &[(Vec<u32>, bool)],
        q_amp: f32,
    ) -> Case<T> {
        let mut rng = Rng::new(seed);
        let shape = AttnShape {
            n_heads,
            n_kv_heads,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let q = rng.vec(n_q * n_heads * d, q_amp);
        let heads = (0..n_kv_heads)
            .map(|_| {
                layout
                    .iter()
                    .map(|(p, r)| SegData::random(&mut rng, d, p.clone(), *r))
                    .collect()
            })
            .collect();
        Case {
            shape,
            q,
            q_pos: (0..n_q as u32).map(|i| q_pos0 + i).collect(),
            heads,
        }
    }

    pub(super) fn n_q(&self) -> usize {
        self.q_pos.len()
    }

    pub(super) fn views(&self) -> Vec<Vec<KvSegment<'_, T>>> {
        self.heads
            .iter()
            .map(|h| h.iter().map(|s| s.view()).collect())
            .collect()
    }

    /// Runs the kernel (given ISA / chunking) and the reference; asserts they agree.
    pub(super) fn check(&self, mask: Mask, isa: Isa, chunks: Option<usize>, tol: f32) {
        let views = self.views();
        let n = self.q.len();
        let nl = self.n_q() * self.shape.n_heads;
        let qp = QueryPositions::List(&self.q_pos);
        let (mut out, mut lse) = (vec![f32::NAN; n], vec![f32::NAN; nl]);
        attention_impl(
            isa,
            chunks,
            &self.shape,
            &self.q,
            qp,
            &views,
            mask,
            &mut out,
            Some(&mut lse),
            None,
        )
        .unwrap();
        let (mut r_out, mut r_lse) = (vec![0.0; n], vec![0.0; nl]);
        attention_reference(
            &self.shape,
            &self.q,
            qp,
            &views,
            mask,
            &mut r_out,
            Some(&mut r_lse),
            None,
        )
        .unwrap();
        assert_close("out", &out, &r_out, tol);
        assert_close("lse", &lse, &r_lse, tol);
    }
}

/// |a - b| <= tol * (1 + |b|) elementwise; equal infinities pass; NaN fails.
pub(super) fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let ok = if y.is_infinite() {
            x == y
        } else {
            (x - y).abs() <= tol * (1.0 + y.abs())
        };
        assert!(ok, "{what}[{i}]: got {x}, reference {y}");
    }
}

/// Positions `a..b` as one range segment.
pub(super) fn range(a: u32, b: u32) -> (Vec<u32>, bool) {
    ((a..b).collect(), true)
}

const TOL: f32 = 1e-5;

fn all_isas(f: impl Fn(Isa)) {
    for &isa in Isa::available() {
        f(isa);
    }
}

#[test]
fn prefill_causal_mha_gqa_mqa_head_dims() {
    let heads = [(4, 4), (8, 2), (4, 1)];
    for (hi, &(h, kvh)) in heads.iter().enumerate() {
        for (di, &d) in [64, 128, 256].iter().enumerate() {
            for seed in 0..2 {
                let n_q = 70 + 13 * hi + 7 * di;
                let c = Case::<f32>::new(
                    seed * 100 + (hi * 3 + di) as u64,
                    (h, kvh, d),
                    n_q,
                    0,
                    &[range(0, n_q as u32)],
                    3.0,
                );
                all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
            }
        }
    }
}

#[test]
fn prefill_sliding_window() {
    for (seed, w) in [(1u64, 16u32), (2, 50), (3, 1), (4, 300)] {
        let c = Case::<f32>::new(seed, (4, 2, 64), 150, 0, &[range(0, 150)], 3.0);
        all_isas(|isa| {
            c.check(
                Mask {
                    causal: true,
                    window: Some(w),
                },
                isa,
                None,
                TOL,
            )
        });
    }
}

#[test]
fn chunked_prefill_with_cached_keys() {
    // 45 new rows at positions 200.. over 200 cached keys plus their own.
    for seed in 0..3 {
        let c = Case::<f32>::new(seed, (8, 2, 128), 45, 200, &[range(0, 245)], 3.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        c.check(
            Mask {
                causal: true,
                window: Some(64),
            },
            Isa::best(128),
            None,
            TOL,
        );
    }
}

#[test]
fn ring_buffer_two_segments_wrapped() {
    // Capacity 256 ring after 600 tokens: slots [88, 256) hold positions 344..512 (older),
    // slots [0, 88) hold 512..600 (newer); the newer part is listed first in memory order.
    let layout = [range(512, 600), range(344, 512)];
    for seed in 0..3 {
        let c = Case::<f32>::new(seed, (4, 1, 256), 3, 597, &layout, 4.0);
        all_isas(|isa| {
            c.check(
                Mask {
                    causal: true,
                    window: Some(256),
                },
                isa,
                None,
                TOL,
            )
        });
        let c = Case::<f32>::new(seed + 10, (4, 1, 256), 20, 580, &layout, 4.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
    }
}

#[test]
fn explicit_position_lists() {
    // SFI-like: sinks + sorted selected tokens (a list) + recent window (a range).
    for seed in 0..3 {
        let mut rng = Rng::new(seed);
        let mut sel: Vec<u32> = (0..4).collect();
        sel.extend((0..150).map(|_| 4 + rng.below(3000) as u32));
        sel.sort_unstable();
        sel.dedup();
        let layout = [(sel, false), range(3000, 3100)];
        let c = Case::<f32>::new(seed, (16, 8, 128), 1, 3099, &layout, 4.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        let c = Case::<f32>::new(seed, (16, 8, 128), 30, 3070, &layout, 4.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        // Unsorted list positions with a window.
        let mut shuffled: Vec<u32> = (0..300).map(|i| (i * 7919) % 1000).collect();
        shuffled.dedup();
        let c = Case::<f32>::new(seed, (4, 2, 64), 12, 990, &[(shuffled, false)], 3.0);
        all_isas(|isa| {
            c.check(
                Mask {
                    causal: true,
                    window: Some(400),
                },
                isa,
                None,
                TOL,
            )
        });
    }
}

#[test]
fn f16_kv_cache() {
    for seed in 0..3 {
        let c = Case::<f16>::new(seed, (8, 2, 128), 90, 40, &[range(0, 130)], 3.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        let c = Case::<f16>::new(seed, (4, 1, 256), 1, 2999, &[range(0, 3000)], 3.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
    }
}

/// fp8 (e4m3) keys and values: every ISA's widening (8 or 16 bytes through f16) against the
/// reference's byte-by-byte one, prefill and decode rows, one and several tiles.
#[test]
fn e4m3_kv_cache() {
    use crate::e4m3::E4m3;
    for seed in 0..3 {
        let c = Case::<E4m3>::new(seed, (8, 2, 128), 90, 40, &[range(0, 130)], 3.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        let c = Case::<E4m3>::new(seed, (4, 1, 256), 1, 2999, &[range(0, 3000)], 3.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        let c = Case::<E4m3>::new(
            seed,
            (8, 4, 64),
            2,
            700,
            &[range(0, 300), range(400, 802)],
            3.0,
        );
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
    }
}

#[test]
fn decode_long_context_split_kv() {
    for seed in 0..2 {
        let c = Case::<f32>::new(seed, (16, 8, 128), 1, 6000, &[range(0, 6001)], 4.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
        let c = Case::<f32>::new(seed, (4, 1, 256), 2, 9000, &[range(0, 9002)], 4.0);
        for chunks in [None, Some(3), Some(7)] {
            all_isas(|isa| c.check(Mask::CAUSAL, isa, chunks, TOL));
        }
        // Prefill tiles with a forced key split.
        let c = Case::<f32>::new(seed, (4, 2, 64), 100, 0, &[range(0, 100)], 3.0);
        all_isas(|isa| c.check(Mask::CAUSAL, isa, Some(2), TOL));
    }
}

#[test]
fn non_causal_and_odd_head_dims() {
    for (seed, d) in [(1u64, 8usize), (2, 40), (3, 72), (4, 96)] {
        let c = Case::<f32>::new(seed, (6, 3, d), 17, 0, &[range(0, 33)], 3.0);
        all_isas(|isa| c.check(Mask::default(), isa, None, TOL));
        all_isas(|isa| c.check(Mask::CAUSAL, isa, None, TOL));
    }
}
