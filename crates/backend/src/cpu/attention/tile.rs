//! One attention task: the query rows of one tile (all G heads of one kv head) against one
//! range of that kv head's keys (numbered in segment order), by tiled online softmax. Two
//! layouts: column-major scores for many rows (prefill), row-major for a few rows (decode).
//! Also ISA dispatch.
//!
//! Key tiles follow the global key order, not the segments: a tile may span several segments
//! (read piece by piece) and a segment several tiles. Every key's score and every output's
//! P·V chain are computed key by key, and the softmax steps see the same tiles, so the result
//! is bit-identical however the same keys are segmented (one contiguous buffer for `generate`,
//! blocks of a paged cache under `serve`). The split-KV chunks of `driver.rs` are global key
//! ranges aligned to whole tiles, so that holds across chunks and their merge too.

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

/// Query rows `i0..i0+nq` x keys `keys.0..keys.1` (global indices: keys numbered across
/// `segs` in order; `keys.0` a multiple of the tile size) of one kv head.
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

    /// Tiles of the task's key range in the global key order (keys numbered across the
    /// segments in order): tile `i` holds keys `[keys.0 + bk*i, min(keys.0 + bk*(i+1), keys.1))`,
    /// wherever the segments end. So the online softmax sees the same tiles, and rounds the
    /// same, however the same keys are cut into segments (one buffer, or blocks of a paged
    /// cache); a tile that spans segments is read as several pieces (`Tile::pieces`).
    fn tiles(&self, bk: usize) -> Tiles<'_, T> {
        Tiles {
            segs: self.segs,
            d: self.geo.d,
            bk,
            end: self.keys.1,
            g0: self.keys.0,
            at: Cursor { seg: 0, base: 0 },
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

/// A place in a task's segment list: segment `seg`, whose first key has global index `base`.
#[derive(Clone, Copy)]
struct Cursor {
    seg: usize,
    base: usize,
}

/// Iterator of `Task::tiles`: advances one cursor monotonically over the segments (no
/// allocation; a tile is its first key's cursor and its global range).
pub(crate) struct Tiles<'a, T> {
    segs: &'a [KvSegment<'a, T>],
    d: usize,
    bk: usize,
    end: usize,
    /// Global index of the next tile's first key.
    g0: usize,
    /// Cursor on the segment that holds key `g0` or one before it (moved up by `next`).
    at: Cursor,
}

impl<'a, T> Iterator for Tiles<'a, T> {
    type Item = Tile<'a, T>;

    fn next(&mut self) -> Option<Tile<'a, T>> {
        if self.g0 >= self.end {
            return None;
        }
        // Skip the segments that end at or before g0 (empty ones included).
        while self.at.base + self.segs[self.at.seg].len(self.d) <= self.g0 {
            self.at.base += self.segs[self.at.seg].len(self.d);
            self.at.seg += 1;
        }
        let nk = self.bk.min(self.end - self.g0);
        let tile = Tile {
            segs: self.segs,
            d: self.d,
            at: self.at,
            g0: self.g0,
            nk,
        };
        self.g0 += nk;
        Some(tile)
    }
}

/// Global keys `[g0, g0 + nk)` of a task, `at` the cursor on the segment holding key `g0`.
#[derive(Clone, Copy)]
pub(crate) struct Tile<'a, T> {
    segs: &'a [KvSegment<'a, T>],
    d: usize,
    at: Cursor,
    g0: usize,
    nk: usize,
}

impl<'a, T> Tile<'a, T> {
    /// The tile's keys as runs within one segment each, in order (one piece when the tile lies
    /// in one segment); computed lazily from the tile's cursor, so cheap to repeat.
    fn pieces(&self) -> Pieces<'a, T> {
        Pieces {
            segs: self.segs,
            d: self.d,
            at: self.at,
            g: self.g0,
            g0: self.g0,
            end: self.g0 + self.nk,
        }
    }

    /// (min, max) position over the tile's keys.
    fn k_range(&self) -> (u32, u32) {
        self.pieces().fold((u32::MAX, 0), |(lo, hi), p| {
            let (a, b) = p.seg.pos.min_max(p.a, p.a + p.n);
            (lo.min(a), hi.max(b))
        })
    }
}

/// Keys `[a, a + n)` of segment `seg`, at offset `off` in their tile.
#[derive(Clone, Copy)]
struct Piece<'a, T> {
    seg: &'a KvSegment<'a, T>,
    a: usize,
    n: usize,
    off: usize,
}

impl<T> Piece<'_, T> {
    fn k(&self, d: usize) -> *const T {
        self.seg.k[self.a * d..].as_ptr()
    }

    fn v(&self, d: usize) -> *const T {
        self.seg.v[self.a * d..].as_ptr()
    }
}

/// Iterator of `Tile::pieces`.
struct Pieces<'a, T> {
    segs: &'a [KvSegment<'a, T>],
    d: usize,
    at: Cursor,
    /// Global index of the next piece's first key.
    g: usize,
    g0: usize,
    end: usize,
}

impl<'a, T> Iterator for Pieces<'a, T> {
    type Item = Piece<'a, T>;

    fn next(&mut self) -> Option<Piece<'a, T>> {
        while self.g < self.end {
            let seg = &self.segs[self.at.seg];
            let seg_end = self.at.base + seg.len(self.d);
            if self.g < seg_end {
                let n = seg_end.min(self.end) - self.g;
                let p = Piece {
                    seg,
                    a: self.g - self.at.base,
                    n,
                    off: self.g - self.g0,
                };
                self.g += n;
                return Some(p);
            }
            self.at = Cursor {
                seg: self.at.seg + 1,
                base: seg_end,
            };
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
/// Q·Kᵀ, the mask and P·V run piece by piece at the piece's offset in the tile (each key's
/// score and each output's FMA chain over the keys come out the same as for one piece), the
/// softmax once over the whole tile.
#[inline(always)]
unsafe fn run_cols<T: KvElem, S: Simd>(t: &Task<'_, T>, out: &mut [f32], lse: &mut [f32]) {
    let (d, rows) = (t.geo.d, t.rows());
    let rows_pad = rows.div_ceil(2 * S::LANES) * 2 * S::LANES;
    let kc_len = if T::NARROW { BK_COLS * d } else { 0 };
    let total = d * rows_pad + kc_len + BK_COLS * rows_pad + rows_pad * d + 3 * rows_pad;
    let mut buf = Scratch::take(POOL_TILE, total);
    {
        let (qt, rest) = buf.split_at_mut(d * rows_pad); // [d, rows_pad]
        let (kc, rest) = rest.split_at_mut(kc_len); // [BK_COLS, d] widened keys (narrow types only)
        let (st, rest) = rest.split_at_mut(BK_COLS * rows_pad); // [BK_COLS, rows_pad]
        let (o, rest) = rest.split_at_mut(rows_pad * d); // [rows_pad, d]
        let (m, rest) = rest.split_at_mut(rows_pad);
        let (l, alpha) = rest.split_at_mut(rows_pad);
        m.fill(f32::NEG_INFINITY);
        t.each_q(|r, c, v| qt[c * rows_pad + r] = v);
        let q_range = t.q_range();
        let g = t.geo.group;
        for tile in t.tiles(BK_COLS) {
            let (g0, nk) = (tile.g0, tile.nk);
            let k_range = tile.k_range();
            if t.mask.all_hidden(q_range, k_range) {
                t.store_logits(g0, nk, |_, _| f32::NEG_INFINITY);
                continue;
            }
            let check = !t.mask.all_visible(q_range, k_range);
            for p in tile.pieces() {
                let kp = if T::NARROW {
                    let kc = kc.as_mut_ptr().add(p.off * d);
                    widen::<T, S>(p.k(d), kc, p.n * d);
                    kc
                } else {
                    p.k(d) as *const f32
                };
                let sp = st.as_mut_ptr().add(p.off * rows_pad);
                qk_cols::<S>(qt.as_ptr(), rows_pad, d, kp, p.n, sp);
                if check {
                    for j in 0..p.n {
                        let kpos = p.seg.pos.at(p.a + j);
                        let srow = &mut st[(p.off + j) * rows_pad..][..rows]; // [nq, G] of key
                        for (i, heads) in srow.chunks_exact_mut(g).enumerate() {
                            if !t.mask.visible(t.q_pos.at(t.i0 + i), kpos) {
                                heads.fill(f32::NEG_INFINITY);
                            }
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
            for p in tile.pieces() {
                let pp = st.as_ptr().add(p.off * rows_pad);
                pv::<T, S>(pp, 1, rows_pad, rows, p.n, p.v(d), d, o.as_mut_ptr());
            }
        }
        finish(rows, d, o, m, l, out, lse);
    }
}

/// Row layout: scores `s` [rows, BK_ROWS], one softmax row at a time (decode). Pieces as in
/// `run_cols`.
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
        while let Some(tile) = tiles.next() {
            let (g0, nk) = (tile.g0, tile.nk);
            let k_range = tile.k_range();
            if t.mask.all_hidden(q_range, k_range) {
                t.store_logits(g0, nk, |_, _| f32::NEG_INFINITY);
                continue;
            }
            let check = !t.mask.all_visible(q_range, k_range);
            let mut pieces = tile.pieces().peekable();
            while let Some(p) = pieces.next() {
                // The keys read after this piece, for the prefetches at its end: the tile's
                // next piece or the next tile's first (with a paged cache, the next KV block
                // rather than the memory after this one).
                let next = match pieces.peek() {
                    Some(&n) => Some(n),
                    None => tiles.peek().and_then(|t2| t2.pieces().next()),
                };
                let next = next.map_or(NextTile::NONE, |n| NextTile {
                    k: n.k(d),
                    v: n.v(d),
                    n: n.n,
                });
                let sp = s.as_mut_ptr().add(p.off);
                qk_rows::<T, S>(qr.as_ptr(), rows, d, p.k(d), p.n, sp, BK_ROWS, p.v(d), next);
                if check {
                    for r in 0..rows {
                        let qp = t.q_pos.at(t.i0 + r / g);
                        for j in 0..p.n {
                            if !t.mask.visible(qp, p.seg.pos.at(p.a + j)) {
                                s[r * BK_ROWS + p.off + j] = f32::NEG_INFINITY;
                            }
                        }
                    }
                }
            }
            let nk_pad = nk.div_ceil(S::LANES) * S::LANES;
            for r in 0..rows {
                s[r * BK_ROWS + nk..r * BK_ROWS + nk_pad].fill(f32::NEG_INFINITY);
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
            for p in tile.pieces() {
                let sp = s.as_ptr().add(p.off);
                pv::<T, S>(sp, BK_ROWS, 1, rows, p.n, p.v(d), d, o.as_mut_ptr());
            }
        }
        finish(rows, d, o, &m, &l, out, lse);
    }
}
