//! One attention task: the query rows of one tile (all G heads of one kv head) against one
//! contiguous range of that kv head's keys, by tiled online softmax. Two layouts: column-major
//! scores for many rows (prefill), row-major for a few rows (decode). Also ISA dispatch.

use super::elem::KvElem;
pub(crate) use super::isa::Isa;
use super::kernels::{pv, qk_cols, qk_rows, scale, softmax_cols, softmax_row, widen, NextTile};
use super::scratch::POOL_TILE;
pub(crate) use super::scratch::{Scratch, SyncPtr, POOL_PARTIALS, POOL_TASK_OUT};
use super::simd::{Scalar, Simd};
use super::types::{Geometry, KvSegment, Mask, QueryPositions};

/// Keys per tile in the column (prefill) layout.
pub(crate) const BK_COLS: usize = 64;
/// Keys per tile in the row (decode) layout.
pub(crate) const BK_ROWS: usize = 128;
/// At most this many rows (query rows x group heads) take the row layout.
pub(crate) const ROW_PATH_MAX: usize = 8;

/// Where a task stores its raw scaled logits: head `kv_head*G + g`, query `i`, key `j` lands at
/// `base + (g * n_q + i) * total + j`.
#[derive(Clone, Copy)]
pub(crate) struct LogitsSink {
    pub ptr: SyncPtr,
    pub base: usize,
    pub total: usize,
}

/// Query rows `i0..i0+nq` x keys `keys.0..keys.1` (in segment order) of one kv head.
pub(crate) struct Task<'a, T> {
    pub geo: Geometry,
    pub mask: Mask,
    pub q: &'a [f32], // [n_q, n_heads, d]
    pub q_pos: QueryPositions<'a>,
    pub kv_head: usize,
    pub i0: usize,
    pub nq: usize,
    pub segs: &'a [KvSegment<'a, T>],
    pub keys: (usize, usize),
    pub logits: Option<LogitsSink>,
}

impl<T> Task<'_, T> {
    fn rows(&self) -> usize {
        self.nq * self.geo.group
    }

    fn q_range(&self) -> (u32, u32) {
        (0..self.nq)
            .map(|i| self.q_pos.at(self.i0 + i))
            .fold((u32::MAX, 0), |(lo, hi), p| (lo.min(p), hi.max(p)))
    }

    /// Tiles of the task's key range: `(segment, a, b, global)` with `[a, b)` segment-local
    /// (at most `bk` keys) and `global` the index of key `a` in segment order.
    fn tiles(&self, bk: usize) -> Tiles<'_, T> {
        Tiles {
            segs: self.segs,
            d: self.geo.d,
            bk,
            keys: self.keys,
            seg: 0,
            base: 0,
            a: self.keys.0,
        }
    }

    /// Writes `val(r, j)` as the logit of local row `r`, tile key `j` (global index `g0 + j`).
    fn store_logits(&self, g0: usize, nk: usize, val: impl Fn(usize, usize) -> f32) {
        let Some(sink) = self.logits else { return };
        let g = self.geo.group;
        for r in 0..self.rows() {
            let (i, gh) = (self.i0 + r / g, r % g);
            let row = sink.base + (gh * self.geo.n_q + i) * sink.total + g0;
            for j in 0..nk {
                // SAFETY: (head, query row, key) triples are disjoint between tasks.
                unsafe { *sink.ptr.0.add(row + j) = val(r, j) };
            }
        }
    }

    /// Copies the scaled query rows of the tile: `f(r, c, value)` for local row `r = i*G + g`.
    fn each_q(&self, mut f: impl FnMut(usize, usize, f32)) {
        let Geometry {
            n_heads,
            group,
            d,
            scale,
            ..
        } = self.geo;
        for i in 0..self.nq {
            let src = &self.q[((self.i0 + i) * n_heads + self.kv_head * group) * d..][..group * d];
            for (x, &v) in src.iter().enumerate() {
                f(i * group + x / d, x % d, v * scale);
            }
        }
    }
}

/// Iterator of `Task::tiles`.
pub(crate) struct Tiles<'a, T> {
    segs: &'a [KvSegment<'a, T>],
    d: usize,
    bk: usize,
    keys: (usize, usize),
    seg: usize,
    base: usize,
    a: usize,
}

impl<'a, T> Iterator for Tiles<'a, T> {
    type Item = (&'a KvSegment<'a, T>, usize, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        while self.seg < self.segs.len() {
            let seg = &self.segs[self.seg];
            let n = seg.len(self.d);
            let a = self.a.max(self.base);
            let end = self.keys.1.min(self.base + n);
            if a < end {
                let b = (a + self.bk).min(end);
                self.a = b;
                return Some((seg, a - self.base, b - self.base, a));
            }
            self.seg += 1;
            self.base += n;
        }
        None
    }
}

/// Runs one task with the given ISA; `out` [rows, d] and `lse` [rows] get the task's
/// normalised output and log-sum-exp (rows with no visible key: zeros and -inf).
pub(crate) fn run_task<T: KvElem>(isa: Isa, t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    assert!(
        out.len() >= t.rows() * t.geo.d
            && lse.len() >= t.rows()
            && t.geo.d.is_multiple_of(isa.lanes())
    );
    // SAFETY: the ISA was detected on this CPU (Isa::available) and divides head_dim.
    unsafe {
        match isa {
            Isa::Scalar => run::<T, Scalar>(t, out, lse),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => run_avx2(t, out, lse),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => run_avx512(t, out, lse),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<T: KvElem>(t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    run::<T, super::simd::Avx2>(t, out, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512<T: KvElem>(t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    run::<T, super::simd::Avx512>(t, out, lse)
}

#[inline(always)]
unsafe fn run<T: KvElem, S: Simd>(t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    if t.rows() <= ROW_PATH_MAX {
        run_rows::<T, S>(t, out, lse)
    } else {
        run_cols::<T, S>(t, out, lse)
    }
}

/// Final normalisation: `out = o / l`, `lse = m + ln l`; empty rows give zeros and -inf.
fn finish(
    rows: usize,
    d: usize,
    o: &[f32],
    m: &[f32],
    l: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    for r in 0..rows {
        let dst = &mut out[r * d..(r + 1) * d];
        if l[r] > 0.0 {
            let inv = 1.0 / l[r];
            for (x, &y) in dst.iter_mut().zip(&o[r * d..(r + 1) * d]) {
                *x = y * inv;
            }
            lse[r] = m[r] + l[r].ln();
        } else {
            dst.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        }
    }
}

/// Column layout: scores `st` [keys, rows_pad], softmax statistics vectorised over rows.
#[inline(always)]
unsafe fn run_cols<T: KvElem, S: Simd>(t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    let (d, rows) = (t.geo.d, t.rows());
    let rows_pad = rows.div_ceil(2 * S::LANES) * 2 * S::LANES;
    let kc_len = if T::IS_F16 { BK_COLS * d } else { 0 };
    let total = d * rows_pad + kc_len + BK_COLS * rows_pad + rows_pad * d + 3 * rows_pad;
    let mut buf = Scratch::take(POOL_TILE, total);
    {
        let (qt, rest) = buf.split_at_mut(d * rows_pad); // [d, rows_pad]
        let (kc, rest) = rest.split_at_mut(kc_len); // [BK_COLS, d] widened keys (f16 only)
        let (st, rest) = rest.split_at_mut(BK_COLS * rows_pad); // [BK_COLS, rows_pad]
        let (o, rest) = rest.split_at_mut(rows_pad * d); // [rows_pad, d]
        let (m, rest) = rest.split_at_mut(rows_pad);
        let (l, alpha) = rest.split_at_mut(rows_pad);
        m.fill(f32::NEG_INFINITY);
        t.each_q(|r, c, v| qt[c * rows_pad + r] = v);
        let q_range = t.q_range();
        let g = t.geo.group;
        for (seg, a, b, g0) in t.tiles(BK_COLS) {
            let nk = b - a;
            let k_range = seg.pos.min_max(a, b);
            if t.mask.all_hidden(q_range, k_range) {
                t.store_logits(g0, nk, |_, _| f32::NEG_INFINITY);
                continue;
            }
            let kp = if T::IS_F16 {
                widen::<T, S>(seg.k.as_ptr().add(a * d), kc.as_mut_ptr(), nk * d);
                kc.as_ptr()
            } else {
                seg.k.as_ptr().add(a * d) as *const f32
            };
            qk_cols::<S>(qt.as_ptr(), rows_pad, d, kp, nk, st.as_mut_ptr());
            if !t.mask.all_visible(q_range, k_range) {
                for j in 0..nk {
                    let kpos = seg.pos.at(a + j);
                    let srow = &mut st[j * rows_pad..][..rows]; // [nq, G] of key j
                    for (i, heads) in srow.chunks_exact_mut(g).enumerate() {
                        if !t.mask.visible(t.q_pos.at(t.i0 + i), kpos) {
                            heads.fill(f32::NEG_INFINITY);
                        }
                    }
                }
            }
            t.store_logits(g0, nk, |r, j| st[j * rows_pad + r]);
            softmax_cols::<S>(
                st.as_mut_ptr(),
                nk,
                rows_pad,
                m.as_mut_ptr(),
                l.as_mut_ptr(),
                alpha.as_mut_ptr(),
            );
            for (r, &a) in alpha[..rows].iter().enumerate() {
                if a != 1.0 {
                    scale::<S>(o.as_mut_ptr().add(r * d), d, a);
                }
            }
            pv::<T, S>(
                st.as_ptr(),
                1,
                rows_pad,
                rows,
                nk,
                seg.v.as_ptr().add(a * d),
                d,
                o.as_mut_ptr(),
            );
        }
        finish(rows, d, o, m, l, out, lse);
    }
}

/// Row layout: scores `s` [rows, BK_ROWS], one softmax row at a time (decode).
#[inline(always)]
unsafe fn run_rows<T: KvElem, S: Simd>(t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    let (d, rows) = (t.geo.d, t.rows());
    let total = rows * d + rows * BK_ROWS + rows * d;
    let mut m = [f32::NEG_INFINITY; ROW_PATH_MAX];
    let mut l = [0.0f32; ROW_PATH_MAX];
    let mut buf = Scratch::take(POOL_TILE, total);
    {
        let (qr, rest) = buf.split_at_mut(rows * d); // [rows, d]
        let (s, o) = rest.split_at_mut(rows * BK_ROWS); // [rows, BK_ROWS], [rows, d]
        t.each_q(|r, c, v| qr[r * d + c] = v);
        let q_range = t.q_range();
        let g = t.geo.group;
        let mut tiles = t.tiles(BK_ROWS).peekable();
        while let Some((seg, a, b, g0)) = tiles.next() {
            let nk = b - a;
            let k_range = seg.pos.min_max(a, b);
            if t.mask.all_hidden(q_range, k_range) {
                t.store_logits(g0, nk, |_, _| f32::NEG_INFINITY);
                continue;
            }
            // The next tile's keys, for the prefetches at this tile's end (with a paged cache,
            // the next KV block rather than the memory after this one).
            let next = tiles
                .peek()
                .map_or(NextTile::NONE, |&(s2, a2, b2, _)| NextTile {
                    k: s2.k.as_ptr().add(a2 * d),
                    v: s2.v.as_ptr().add(a2 * d),
                    n: b2 - a2,
                });
            qk_rows::<T, S>(
                qr.as_ptr(),
                rows,
                d,
                seg.k.as_ptr().add(a * d),
                nk,
                s.as_mut_ptr(),
                BK_ROWS,
                seg.v.as_ptr().add(a * d),
                next,
            );
            let nk_pad = nk.div_ceil(S::LANES) * S::LANES;
            for r in 0..rows {
                s[r * BK_ROWS + nk..r * BK_ROWS + nk_pad].fill(f32::NEG_INFINITY);
            }
            if !t.mask.all_visible(q_range, k_range) {
                for r in 0..rows {
                    let qp = t.q_pos.at(t.i0 + r / g);
                    for j in 0..nk {
                        if !t.mask.visible(qp, seg.pos.at(a + j)) {
                            s[r * BK_ROWS + j] = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            t.store_logits(g0, nk, |r, j| s[r * BK_ROWS + j]);
            for r in 0..rows {
                let (mn, ln, alpha) =
                    softmax_row::<S>(s.as_mut_ptr().add(r * BK_ROWS), nk_pad, m[r], l[r]);
                (m[r], l[r]) = (mn, ln);
                if alpha != 1.0 {
                    scale::<S>(o.as_mut_ptr().add(r * d), d, alpha);
                }
            }
            pv::<T, S>(
                s.as_ptr(),
                BK_ROWS,
                1,
                rows,
                nk,
                seg.v.as_ptr().add(a * d),
                d,
                o.as_mut_ptr(),
            );
        }
        finish(rows, d, o, &m, &l, out, lse);
    }
}
