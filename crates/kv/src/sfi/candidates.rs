//! SFI's cheaper slow step (issue 27, direction 3): which keys a slow step reads.
//!
//! A plain slow step attends to every key and the Selector scores them all. With
//! `SfiConfig::candidates` set, a slow step reads instead:
//! - the pages holding the sinks;
//! - the `want` pages (of `page` keys) whose Quest bound on `q·k` is highest, among them
//!   always the pages holding the Selector's first and last candidate positions (the first
//!   after the sinks, the last before the window), so that its position prior spans the same
//!   positions as on a dense step;
//! - the recent window, from its page-aligned start.
//!
//! Each page's per-dimension key min and max (Quest's [`PageBounds`], kept per kv head and
//! extended as pages fill) bound `q·k` over its keys. The pages are shared by the kv heads of
//! the layer, so the Selector sees one set of key positions: a page scores the largest, over
//! every query head, of its bound less that head's best page bound (a gap in logit units, so
//! heads with larger logits do not crowd out the others). Reading a bound costs about one key
//! read, so a slow step reads `pages + sinks' pages + want · page + recent` keys instead of
//! every key.
use std::ops::Range;

use crate::quest::PageBounds;
use crate::score::top_k;

/// The `want` candidate pages among `first..pages` for the decode query `q`
/// (`[n_heads, d]`, the query heads of kv head `h` at `h * group ..`): per page, the
/// largest over query heads of its bound less that query head's best bound; the top `want`,
/// ascending (ties to the earlier page), the `forced` pages (within `first..pages`) always
/// among them. `bounds[h]` must cover `pages` pages.
pub fn candidate_pages(
    bounds: &[PageBounds],
    q: &[f32],
    d: usize,
    (first, pages): (usize, usize),
    forced: &[usize],
    want: usize,
) -> Vec<usize> {
    let nkv = bounds.len();
    let n = pages.saturating_sub(first);
    if nkv == 0 || n == 0 || want == 0 || d == 0 {
        return Vec::new();
    }
    let heads = q.len() / d;
    let group = (heads / nkv).max(1);
    let mut score = vec![f32::NEG_INFINITY; n];
    let mut ub = vec![0.0f32; n];
    for hq in 0..heads {
        let b = &bounds[(hq / group).min(nkv - 1)];
        let qh = &q[hq * d..(hq + 1) * d];
        let mut best = f32::NEG_INFINITY;
        for (c, u) in ub.iter_mut().enumerate() {
            *u = b.upper_bound(first + c, qh);
            best = best.max(*u);
        }
        for (s, &u) in score.iter_mut().zip(&ub) {
            *s = s.max(u - best);
        }
    }
    for &c in forced {
        if (first..pages).contains(&c) {
            score[c - first] = f32::INFINITY;
        }
    }
    let mut picked: Vec<usize> = top_k(&score, want).into_iter().map(|c| first + c).collect();
    picked.sort_unstable();
    picked
}

/// The key ranges a candidate slow step reads, ascending and merged where they touch: the
/// first `sink_pages` pages, the `picked` pages (ascending), and `recent_start..hi`.
pub fn view_ranges(
    sink_pages: usize,
    picked: &[usize],
    page: usize,
    recent_start: usize,
    hi: usize,
) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut push = |r: Range<usize>| {
        if r.is_empty() {
            return;
        }
        match out.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    };
    push(0..(sink_pages * page).min(recent_start));
    for &c in picked {
        push(c * page..((c + 1) * page).min(recent_start));
    }
    push(recent_start..hi);
    out
}

#[cfg(test)]
mod tests {
    use super::super::selector_tests::Rng;
    use super::*;

    /// Against a plain f64 reference on fresh random keys: each page's bound from its keys
    /// (and every key's `q·k` within it), the gap to each query head's best page, the largest
    /// gap over query heads, the top `want`; the same pages up to near-ties at the cut.
    #[test]
    fn candidate_pages_match_a_plain_reference() {
        let mut rng = Rng(29);
        for case in 0..60 {
            let (nkv, g, d) = (1 + rng.below(3), 1 + rng.below(4), 2 + rng.below(14));
            let page = 1 + rng.below(16);
            let pages = 1 + rng.below(40);
            let first = rng.below(3).min(pages);
            let len = pages * page;
            // Each kv head its own scale, so the gap normalisation matters.
            let keys: Vec<Vec<f32>> = (0..nkv)
                .map(|h| {
                    let s = 1.0 + 3.0 * h as f64;
                    (0..len * d).map(|_| (rng.normal() * s) as f32).collect()
                })
                .collect();
            let bounds: Vec<PageBounds> = keys
                .iter()
                .map(|k| {
                    let mut b = PageBounds::default();
                    b.update(|t| &k[t * d..(t + 1) * d], len, page, d);
                    b
                })
                .collect();
            let q: Vec<f32> = (0..nkv * g * d).map(|_| rng.normal() as f32).collect();
            let want = rng.below(pages + 2);
            let forced = [first + rng.below(3), pages.saturating_sub(1)];
            let got = candidate_pages(&bounds, &q, d, (first, pages), &forced, want);
            // Reference.
            let mut score = vec![f64::NEG_INFINITY; pages];
            for hq in 0..nkv * g {
                let (k, qh) = (&keys[hq / g], &q[hq * d..(hq + 1) * d]);
                let ub: Vec<f64> = (first..pages)
                    .map(|c| {
                        let rows: Vec<&[f32]> = (c * page..(c + 1) * page)
                            .map(|j| &k[j * d..(j + 1) * d])
                            .collect();
                        let u: f64 = (0..d)
                            .map(|t| {
                                let lo = rows.iter().map(|r| r[t] as f64).fold(f64::MAX, f64::min);
                                let hi = rows.iter().map(|r| r[t] as f64).fold(f64::MIN, f64::max);
                                (qh[t] as f64 * lo).max(qh[t] as f64 * hi)
                            })
                            .sum();
                        for r in &rows {
                            let dot: f64 =
                                qh.iter().zip(*r).map(|(&a, &b)| a as f64 * b as f64).sum();
                            assert!(dot <= u + 1e-3, "case {case}: q·k {dot} above bound {u}");
                        }
                        u
                    })
                    .collect();
                let best = ub.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                for (c, u) in ub.iter().enumerate() {
                    score[first + c] = score[first + c].max(u - best);
                }
            }
            for &c in &forced {
                if (first..pages).contains(&c) {
                    score[c] = f64::INFINITY;
                }
            }
            let n = pages - first;
            assert_eq!(got.len(), want.min(n), "case {case}");
            assert!(
                got.windows(2).all(|w| w[0] < w[1]),
                "case {case}: not ascending"
            );
            assert!(
                got.iter().all(|&c| (first..pages).contains(&c)),
                "case {case}"
            );
            if got.is_empty() {
                continue;
            }
            let mut order: Vec<usize> = (first..pages).collect();
            order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
            let cut = score[order[got.len() - 1]];
            for (c, &sc) in score.iter().enumerate().skip(first) {
                if (sc - cut).abs() > 1e-3 {
                    assert_eq!(got.contains(&c), sc > cut, "case {case}: page {c}");
                }
            }
        }
    }

    #[test]
    fn view_ranges_merge_touching_ranges_and_clip_at_the_recent_window() {
        // Sinks' page 0, pages 1 and 2 (touching it), page 5 (touching the window from 96).
        assert_eq!(
            view_ranges(1, &[1, 2, 5], 16, 96, 110),
            vec![0..48, 80..110]
        );
        assert_eq!(
            view_ranges(1, &[3], 16, 96, 110),
            vec![0..16, 48..64, 96..110]
        );
        // Every page picked: one range, the dense read.
        assert_eq!(view_ranges(1, &[1, 2, 3, 4, 5], 16, 96, 110), vec![0..110]);
        // No sinks' page.
        assert_eq!(view_ranges(0, &[2], 16, 96, 97), vec![32..48, 96..97]);
    }
}
