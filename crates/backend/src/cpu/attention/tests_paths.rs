//! Tests of the side paths: partial merging, logits capture, empty rows, extreme logits,
//! argument errors, the vector `exp`.

use super::tests::{assert_close, range, Case, FromF32, Rng};
use super::tile::Isa;
use super::*;

const TOL: f32 = 1e-5;

#[test]
fn partial_plus_merge_equals_whole() {
    for seed in 0..4 {
        // Keys 0..700 split into an old part [0, 400) and a recent part [400, 700).
        let c = Case::<f32>::new(
            seed,
            (8, 2, 64),
            5,
            695,
            &[range(0, 400), range(400, 700)],
            4.0,
        );
        let shape = c.shape;
        let views = c.views();
        let old: Vec<Vec<KvSegment<f32>>> = views.iter().map(|h| vec![h[0]]).collect();
        let recent: Vec<Vec<KvSegment<f32>>> = views.iter().map(|h| vec![h[1]]).collect();
        let qp = QueryPositions::List(&c.q_pos);
        let (n, nl) = (c.q.len(), c.n_q() * shape.n_heads);
        let mask = Mask {
            causal: true,
            window: Some(500),
        };
        let (mut oa, mut la) = (vec![0.0; n], vec![0.0; nl]);
        let (mut ob, mut lb) = (vec![0.0; n], vec![0.0; nl]);
        attention(&shape, &c.q, qp, &old, mask, &mut oa, Some(&mut la)).unwrap();
        attention(&shape, &c.q, qp, &recent, mask, &mut ob, Some(&mut lb)).unwrap();
        merge_partials(&mut oa, &mut la, &ob, &lb, shape.head_dim).unwrap();
        let (mut ow, mut lw) = (vec![0.0; n], vec![0.0; nl]);
        attention_reference(&shape, &c.q, qp, &views, mask, &mut ow, Some(&mut lw), None).unwrap();
        assert_close("merged out", &oa, &ow, TOL);
        assert_close("merged lse", &la, &lw, TOL);
    }
}

#[test]
fn merge_with_empty_partial() {
    let mut rng = Rng::new(7);
    let (mut oa, mut la) = (rng.vec(2 * 4, 1.0), vec![0.3, f32::NEG_INFINITY]);
    let ob = rng.vec(2 * 4, 1.0);
    let lb = vec![f32::NEG_INFINITY, f32::NEG_INFINITY];
    let keep = oa[..4].to_vec();
    merge_partials(&mut oa, &mut la, &ob, &lb, 4).unwrap();
    assert_close("kept row", &oa[..4], &keep, 1e-7);
    assert_eq!(la, vec![0.3, f32::NEG_INFINITY]);
    assert_eq!(&oa[4..], &[0.0; 4]);
    assert!(merge_partials(&mut oa, &mut la, &ob[..3], &lb, 4).is_err());
}

#[test]
fn logits_capture_matches_reference() {
    let layout = [(vec![0, 3, 9, 17, 40, 41, 77], false), range(100, 260)];
    for seed in 0..3 {
        for (n_q, q0) in [(1usize, 259u32), (6, 254), (40, 220)] {
            let c = Case::<f32>::new(seed, (8, 2, 128), n_q, q0, &layout, 4.0);
            let views = c.views();
            let qp = QueryPositions::List(&c.q_pos);
            let (n, nl) = (c.q.len(), n_q * c.shape.n_heads);
            let len = logits_len(&c.shape, n_q, &views);
            assert_eq!(len, c.shape.n_heads * n_q * 167);
            let mask = Mask {
                causal: true,
                window: Some(200),
            };
            for &isa in Isa::available() {
                for chunks in [None, Some(2)] {
                    let (mut out, mut lse, mut lg) =
                        (vec![0.0; n], vec![0.0; nl], vec![f32::NAN; len]);
                    attention_impl(
                        isa,
                        chunks,
                        &c.shape,
                        &c.q,
                        qp,
                        &views,
                        mask,
                        &mut out,
                        Some(&mut lse),
                        Some(&mut lg),
                    )
                    .unwrap();
                    let (mut ro, mut rl, mut rlg) = (vec![0.0; n], vec![0.0; nl], vec![0.0; len]);
                    attention_reference(
                        &c.shape,
                        &c.q,
                        qp,
                        &views,
                        mask,
                        &mut ro,
                        Some(&mut rl),
                        Some(&mut rlg),
                    )
                    .unwrap();
                    assert_close("logits", &lg, &rlg, TOL);
                    assert_close("out", &out, &ro, TOL);
                    assert_close("lse", &lse, &rl, TOL);
                }
            }
        }
    }
}

#[test]
fn logits_with_uneven_kv_heads() {
    // Kv head 0 holds 50 keys, kv head 1 holds 90 (per-head selections differ).
    let mut c = Case::<f32>::new(3, (4, 2, 64), 3, 97, &[range(0, 90)], 3.0);
    let d = 64;
    c.heads[0][0].k.truncate(50 * d);
    c.heads[0][0].v.truncate(50 * d);
    c.heads[0][0].pos.truncate(50);
    let views = c.views();
    let qp = QueryPositions::List(&c.q_pos);
    let len = logits_len(&c.shape, 3, &views);
    assert_eq!(len, 3 * 2 * (50 + 90));
    let (n, nl) = (c.q.len(), 3 * 4);
    let (mut out, mut lg) = (vec![0.0; n], vec![0.0; len]);
    attention_with_logits(
        &c.shape,
        &c.q,
        qp,
        &views,
        Mask::CAUSAL,
        &mut out,
        None,
        &mut lg,
    )
    .unwrap();
    let (mut ro, mut rl, mut rlg) = (vec![0.0; n], vec![0.0; nl], vec![0.0; len]);
    attention_reference(
        &c.shape,
        &c.q,
        qp,
        &views,
        Mask::CAUSAL,
        &mut ro,
        Some(&mut rl),
        Some(&mut rlg),
    )
    .unwrap();
    assert_close("logits", &lg, &rlg, TOL);
    assert_close("out", &out, &ro, TOL);
}

#[test]
fn rows_without_visible_keys_are_zero() {
    // Queries at positions 0..4 see no key at positions 10.. (causal); window 0 hides all.
    let c = Case::<f32>::new(1, (4, 2, 64), 4, 0, &[range(10, 60)], 3.0);
    for mask in [
        Mask::CAUSAL,
        Mask {
            causal: true,
            window: Some(0),
        },
    ] {
        for &isa in Isa::available() {
            for chunks in [None, Some(2)] {
                let views = c.views();
                let (mut out, mut lse) = (vec![f32::NAN; c.q.len()], vec![0.0; 16]);
                let qp = QueryPositions::Start(0);
                attention_impl(
                    isa,
                    chunks,
                    &c.shape,
                    &c.q,
                    qp,
                    &views,
                    mask,
                    &mut out,
                    Some(&mut lse),
                    None,
                )
                .unwrap();
                assert!(out.iter().all(|&x| x == 0.0), "{mask:?} {isa:?}");
                assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
            }
        }
    }
    // No segments at all.
    let shape = c.shape;
    let empty: Vec<Vec<KvSegment<f32>>> = vec![vec![], vec![]];
    let mut out = vec![1.0; c.q.len()];
    attention(
        &shape,
        &c.q,
        QueryPositions::Start(5),
        &empty,
        Mask::CAUSAL,
        &mut out,
        None,
    )
    .unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
    // Partly visible: some rows see keys, earlier rows none (mixed within one tile).
    let c = Case::<f32>::new(2, (4, 2, 64), 30, 0, &[range(20, 40)], 3.0);
    for &isa in Isa::available() {
        c.check(Mask::CAUSAL, isa, None, TOL);
    }
}

#[test]
fn large_logits_do_not_overflow() {
    for seed in 0..3 {
        // Scores of several hundred: naive exp would overflow f32.
        let c = Case::<f32>::new(seed, (4, 1, 128), 20, 500, &[range(0, 520)], 300.0);
        // f32 rounding of logits ~300 is ~3e-5 absolute, which moves the softmax weights by
        // as much relative to the f64 reference: a looser tolerance here is the arithmetic.
        for &isa in Isa::available() {
            c.check(Mask::CAUSAL, isa, None, 1e-4);
            c.check(Mask::CAUSAL, isa, Some(3), 1e-4);
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    let c = Case::<f32>::new(1, (4, 2, 64), 2, 10, &[range(0, 12)], 1.0);
    let views = c.views();
    let qp = QueryPositions::Start(10);
    let mut out = vec![0.0; c.q.len()];
    let bad = AttnShape {
        n_heads: 4,
        n_kv_heads: 3,
        ..c.shape
    };
    assert!(matches!(
        attention(&bad, &c.q, qp, &views, Mask::CAUSAL, &mut out, None),
        Err(AttnError::BadShape(_))
    ));
    let mut short = vec![0.0; 5];
    assert!(matches!(
        attention(&c.shape, &c.q, qp, &views, Mask::CAUSAL, &mut short, None),
        Err(AttnError::Length { .. })
    ));
    let mut lse = vec![0.0; 3];
    assert!(attention(
        &c.shape,
        &c.q,
        qp,
        &views,
        Mask::CAUSAL,
        &mut out,
        Some(&mut lse)
    )
    .is_err());
    let list = [10u32, 11, 12];
    assert!(attention(
        &c.shape,
        &c.q,
        QueryPositions::List(&list),
        &views,
        Mask::CAUSAL,
        &mut out,
        None
    )
    .is_err());
    let d = &c.heads[0][0];
    let seg = KvSegment {
        k: &d.k,
        v: &d.v[..64],
        pos: KvPositions::Range { start: 0 },
    };
    let segs: Vec<Vec<KvSegment<f32>>> = vec![vec![seg], vec![]];
    let e = attention(&c.shape, &c.q, qp, &segs, Mask::CAUSAL, &mut out, None).unwrap_err();
    assert!(e.to_string().contains("kv head 0 segment 0"), "{e}");
    let seg = KvSegment {
        k: &d.k,
        v: &d.v,
        pos: KvPositions::List(&list),
    };
    let segs: Vec<Vec<KvSegment<f32>>> = vec![vec![seg], vec![]];
    assert!(matches!(
        attention(&c.shape, &c.q, qp, &segs, Mask::CAUSAL, &mut out, None),
        Err(AttnError::SegmentPositions { .. })
    ));
    let mut lg = vec![0.0; 7];
    assert!(attention_with_logits(
        &c.shape,
        &c.q,
        qp,
        &views,
        Mask::CAUSAL,
        &mut out,
        None,
        &mut lg
    )
    .is_err());
}

#[test]
fn closure_source_and_mask_rule() {
    let c = Case::<f32>::new(5, (4, 2, 64), 3, 40, &[range(0, 43)], 2.0);
    let views = c.views();
    let src = KvFn(|h: usize| views[h].as_slice());
    let qp = QueryPositions::Start(40);
    let (mut a, mut b) = (vec![0.0; c.q.len()], vec![0.0; c.q.len()]);
    attention(&c.shape, &c.q, qp, &src, Mask::CAUSAL, &mut a, None).unwrap();
    attention(&c.shape, &c.q, qp, &views, Mask::CAUSAL, &mut b, None).unwrap();
    assert_eq!(a, b);
    let arrays: Vec<[KvSegment<f32>; 1]> = views.iter().map(|h| [h[0]]).collect();
    attention(
        &c.shape,
        &c.q,
        qp,
        arrays.as_slice(),
        Mask::CAUSAL,
        &mut a,
        None,
    )
    .unwrap();
    assert_eq!(a, b);
    let m = Mask {
        causal: true,
        window: Some(3),
    };
    assert!(m.visible(10, 10) && m.visible(10, 8) && !m.visible(10, 7) && !m.visible(10, 11));
    let m = Mask {
        causal: false,
        window: Some(3),
    };
    assert!(m.visible(10, 12) && !m.visible(10, 7));
}

#[test]
fn vector_exp_accuracy() {
    use super::simd::{exp, Scalar, Simd};
    fn check<S: Simd>() {
        let mut x = -100.0f32;
        while x < 88.0 {
            let mut buf = vec![x; S::LANES];
            // SAFETY: buf holds LANES floats; the caller checked the ISA.
            unsafe { S::store(buf.as_mut_ptr(), exp::<S>(S::load(buf.as_ptr()))) };
            let want = (x as f64).exp();
            if x < -87.3 {
                assert_eq!(buf[0], 0.0, "exp({x})");
            } else {
                assert!(
                    ((buf[0] as f64 - want) / want).abs() < 5e-7,
                    "exp({x}) = {} want {want}",
                    buf[0]
                );
            }
            x += 0.0137;
        }
        let mut buf = vec![f32::NEG_INFINITY; S::LANES];
        unsafe { S::store(buf.as_mut_ptr(), exp::<S>(S::load(buf.as_ptr()))) };
        assert_eq!(buf[0], 0.0);
    }
    check::<Scalar>();
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::available().contains(&Isa::Avx2) {
            check::<super::simd::Avx2>();
        }
        if Isa::available().contains(&Isa::Avx512) {
            check::<super::simd::Avx512>();
        }
    }
}

#[test]
fn plan_splits_long_decode_and_tiles_prefill() {
    use super::driver::Plan;
    use super::types::Geometry;
    let geo = |n_q, n_heads, n_kv| Geometry {
        n_q,
        n_heads,
        n_kv,
        group: n_heads / n_kv,
        d: 256,
        scale: 1.0,
    };
    // One row, one kv head, 32K keys: split across threads (flash-decoding).
    let p = Plan::new(&geo(1, 4, 1), 32768, 2, None);
    assert!(p.chunks >= 2 && p.n_qt == 1, "{p:?}");
    // Short context: not worth splitting.
    assert_eq!(Plan::new(&geo(1, 4, 1), 300, 2, None).chunks, 1);
    // 32K-token prefill: bounded query tiles (work space independent of the key count).
    let p = Plan::new(&geo(32768, 4, 1), 32768, 2, None);
    assert!(p.bq * 4 <= 128 && p.chunks == 1, "{p:?}");
}

#[test]
fn nested_calls_from_rayon_workers_agree() {
    use half::f16;
    use rayon::prelude::*;
    // Several sequences attended concurrently from inside rayon tasks (scratch pools nest).
    let cases: Vec<Case<f16>> = (0..6)
        .map(|s| {
            Case::<f16>::new(
                40 + s,
                (8, 2, 128),
                1 + 20 * (s as usize % 2),
                2000,
                &[range(0, 2021)],
                3.0,
            )
        })
        .collect();
    let outs: Vec<Vec<f32>> = cases
        .par_iter()
        .map(|c| {
            let views = c.views();
            let mut out = vec![0.0; c.q.len()];
            let qp = QueryPositions::List(&c.q_pos);
            attention(&c.shape, &c.q, qp, &views, Mask::CAUSAL, &mut out, None).unwrap();
            out
        })
        .collect();
    for (c, out) in cases.iter().zip(&outs) {
        let views = c.views();
        let mut r = vec![0.0; c.q.len()];
        let qp = QueryPositions::List(&c.q_pos);
        attention_reference(&c.shape, &c.q, qp, &views, Mask::CAUSAL, &mut r, None, None).unwrap();
        assert_close("nested out", out, &r, TOL);
    }
}

/// The views of `c` with every segment cut again at random lengths (some 1 key, some empty,
/// most not a multiple of a tile): the same keys in the same order, segmented differently.
fn resegmented<'c, T: FromF32>(c: &'c Case<T>, rng: &mut Rng) -> Vec<Vec<KvSegment<'c, T>>> {
    let d = c.shape.head_dim;
    c.heads
        .iter()
        .map(|head| {
            let mut segs = Vec::new();
            for s in head {
                let mut a = 0;
                while a < s.pos.len() {
                    let n = match rng.below(8) {
                        0 => 0,
                        1 | 2 => 1,
                        3 => 1 + rng.below(8) as usize,
                        4 => [63, 64, 65, 127, 128, 129][rng.below(6) as usize],
                        _ => 1 + rng.below(200) as usize,
                    };
                    let b = (a + n).min(s.pos.len());
                    let pos = if s.as_range {
                        KvPositions::Range { start: s.pos[a] }
                    } else {
                        KvPositions::List(&s.pos[a..b])
                    };
                    segs.push(KvSegment {
                        k: &s.k[a * d..b * d],
                        v: &s.v[a * d..b * d],
                        pos,
                    });
                    a = b;
                }
            }
            segs
        })
        .collect()
}

/// Output, lse and logits bits of one call.
fn run_bits<'s, T: FromF32>(
    c: &Case<T>,
    views: &Vec<Vec<KvSegment<'s, T>>>,
    isa: Isa,
    chunks: Option<usize>,
    mask: Mask,
) -> [Vec<u32>; 3] {
    let qp = QueryPositions::List(&c.q_pos);
    let nl = c.n_q() * c.shape.n_heads;
    let len = logits_len(&c.shape, c.n_q(), views);
    let (mut out, mut lse, mut lg) = (
        vec![f32::NAN; c.q.len()],
        vec![f32::NAN; nl],
        vec![f32::NAN; len],
    );
    attention_impl(
        isa,
        chunks,
        &c.shape,
        &c.q,
        qp,
        views,
        mask,
        &mut out,
        Some(&mut lse),
        Some(&mut lg),
    )
    .unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    [bits(&out), bits(&lse), bits(&lg)]
}

/// Attention over the same keys cut into different segments is bit-identical (output, lse,
/// logits): the kernel's tiles follow the global key order, not the segments. This is what
/// keeps `serve` (a paged cache, one segment a block) equal to `generate` (one buffer).
fn check_segmentation_invariant<T: FromF32>(c: &Case<T>, masks: &[Mask], seed: u64) {
    let mut rng = Rng::new(seed);
    let whole = c.views();
    for &isa in Isa::available() {
        for &chunks in &[None, Some(2), Some(3)] {
            for &mask in masks {
                let want = run_bits(c, &whole, isa, chunks, mask);
                for _ in 0..3 {
                    let split = resegmented(c, &mut rng);
                    let got = run_bits(c, &split, isa, chunks, mask);
                    for (what, (g, w)) in ["out", "lse", "logits"].iter().zip(got.iter().zip(&want))
                    {
                        let bad = g.iter().zip(w).position(|(a, b)| a != b);
                        assert!(
                            bad.is_none(),
                            "{what}[{bad:?}] differs: {isa:?} chunks {chunks:?} {mask:?} n_q {} shape {:?} segments {:?}",
                            c.n_q(),
                            c.shape,
                            split[0].iter().map(|s| s.len(c.shape.head_dim)).collect::<Vec<_>>()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn segmentation_does_not_change_results() {
    use half::f16;
    let masks = [
        Mask::CAUSAL,
        Mask {
            causal: true,
            window: Some(200),
        },
        Mask {
            causal: true,
            window: Some(37),
        },
        Mask::default(),
    ];
    // An SFI-like layout: sinks + a sorted selection (a position list) + a recent window.
    let mut rng = Rng::new(99);
    let mut sel: Vec<u32> = (0..4).collect();
    sel.extend((0..180).map(|_| 4 + rng.below(2500) as u32));
    sel.sort_unstable();
    sel.dedup();
    let sfi = [(sel, false), range(2500, 2700)];
    for seed in 0..2u64 {
        // Decode: one query row, groups 1..8 (rows <= 8: the row layout).
        for g in 1..=8usize {
            let d = if g % 2 == 0 { 128 } else { 64 };
            let c = Case::<f32>::new(
                seed * 10 + g as u64,
                (2 * g, 2, d),
                1,
                699,
                &[range(0, 700)],
                4.0,
            );
            check_segmentation_invariant(&c, &masks, seed);
            let c = Case::<f16>::new(seed * 10 + g as u64, (g, 1, d), 1, 2699, &sfi, 4.0);
            check_segmentation_invariant(&c, &masks, seed + 1);
        }
        // Two rows of group 4: still the row layout.
        let c = Case::<f16>::new(seed, (8, 2, 128), 2, 450, &[range(0, 452)], 4.0);
        check_segmentation_invariant(&c, &masks, seed + 2);
        // Prefill: many rows, the column layout; a chunk over cached keys and a whole prompt.
        let c = Case::<f32>::new(seed, (8, 2, 64), 45, 300, &[range(0, 345)], 3.0);
        check_segmentation_invariant(&c, &masks, seed + 3);
        let c = Case::<f16>::new(seed, (4, 1, 128), 150, 0, &[range(0, 150)], 3.0);
        check_segmentation_invariant(&c, &masks, seed + 4);
        let c = Case::<f16>::new(seed, (8, 4, 64), 40, 2660, &sfi, 3.0);
        check_segmentation_invariant(&c, &masks, seed + 5);
    }
}
