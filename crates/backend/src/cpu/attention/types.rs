//! Public argument types of the attention kernels: shapes, key/query positions, KV segments,
//! masks, the per-kv-head segment source and the error type.

use super::elem::KvElem;

/// Head layout of one attention layer (per tensor-parallel rank).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    /// Query heads (`num_attention_heads`).
    pub n_heads: usize,
    /// Key/value heads (`num_key_value_heads`); must divide `n_heads` (GQA group size G).
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier applied to q·k before the softmax (usually `1/sqrt(head_dim)`).
    pub scale: f32,
}

impl AttnShape {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads.max(1)
    }
}

/// Absolute position of each key of a segment.
#[derive(Clone, Copy, Debug)]
pub enum KvPositions<'a> {
    /// Key `i` of the segment sits at position `start + i`.
    Range { start: u32 },
    /// Key `i` sits at `list[i]` (length must equal the segment length).
    List(&'a [u32]),
}

impl KvPositions<'_> {
    #[inline]
    pub(crate) fn at(&self, i: usize) -> u32 {
        match self {
            KvPositions::Range { start } => start.wrapping_add(i as u32),
            KvPositions::List(l) => l[i],
        }
    }

    /// (min, max) position over keys `[a, b)` (b > a).
    pub(crate) fn min_max(&self, a: usize, b: usize) -> (u32, u32) {
        match self {
            KvPositions::Range { start } => (start + a as u32, start + (b - 1) as u32),
            KvPositions::List(l) => l[a..b]
                .iter()
                .fold((u32::MAX, 0), |(lo, hi), &p| (lo.min(p), hi.max(p))),
        }
    }
}

/// A run of cached keys/values of one kv head, rows contiguous.
#[derive(Clone, Copy, Debug)]
pub struct KvSegment<'a, T> {
    pub k: &'a [T], // [len, head_dim]
    pub v: &'a [T], // [len, head_dim]
    pub pos: KvPositions<'a>,
}

impl<T> KvSegment<'_, T> {
    /// Number of keys, given the head dimension.
    pub fn len(&self, head_dim: usize) -> usize {
        self.k.len() / head_dim.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }
}

/// Absolute position of each query row.
#[derive(Clone, Copy, Debug)]
pub enum QueryPositions<'a> {
    /// Row `i` sits at `start + i` (prefill chunk or decode step).
    Start(u32),
    /// Row `i` sits at `list[i]`.
    List(&'a [u32]),
}

impl QueryPositions<'_> {
    #[inline]
    pub(crate) fn at(&self, i: usize) -> u32 {
        match self {
            QueryPositions::Start(s) => s + i as u32,
            QueryPositions::List(l) => l[i],
        }
    }
}

/// Which keys a query may see. Key at `pos_j` is visible to the query at `p` iff
/// `(!causal || pos_j <= p) && window.map_or(true, |w| p - pos_j < w)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mask {
    pub causal: bool,
    /// Sliding window length in positions (`Some(0)` hides everything).
    pub window: Option<u32>,
}

impl Mask {
    /// Causal, no window.
    pub const CAUSAL: Mask = Mask {
        causal: true,
        window: None,
    };

    #[inline]
    pub fn visible(&self, q_pos: u32, k_pos: u32) -> bool {
        let d = q_pos as i64 - k_pos as i64;
        (!self.causal || d >= 0) && self.window.is_none_or(|w| d < w as i64)
    }

    /// Every pair of a query in `[q_lo, q_hi]` and key in `[k_lo, k_hi]` is hidden.
    #[inline]
    pub(crate) fn all_hidden(&self, (q_lo, q_hi): (u32, u32), (k_lo, k_hi): (u32, u32)) -> bool {
        (self.causal && k_lo as i64 > q_hi as i64)
            || self
                .window
                .is_some_and(|w| q_lo as i64 - k_hi as i64 >= w as i64)
    }

    /// Every such pair is visible (no per-element masking needed).
    #[inline]
    pub(crate) fn all_visible(&self, (q_lo, q_hi): (u32, u32), (k_lo, k_hi): (u32, u32)) -> bool {
        (!self.causal || k_hi <= q_lo)
            && self
                .window
                .is_none_or(|w| (q_hi as i64 - k_lo as i64) < w as i64)
    }
}

/// Where the kernels find the KV segments of each kv head (zero allocation per call).
pub trait KvSource<'s, T>: Sync {
    /// The segments of kv head `kv_head`, attended in this order (logits follow this order).
    fn segments(&self, kv_head: usize) -> &[KvSegment<'s, T>];
}

/// One segment list per kv head: `heads[h]` are the segments of kv head `h`.
impl<'s, T: Sync> KvSource<'s, T> for [&'s [KvSegment<'s, T>]] {
    fn segments(&self, kv_head: usize) -> &[KvSegment<'s, T>] {
        self[kv_head]
    }
}

impl<'s, T: Sync> KvSource<'s, T> for Vec<Vec<KvSegment<'s, T>>> {
    fn segments(&self, kv_head: usize) -> &[KvSegment<'s, T>] {
        &self[kv_head]
    }
}

/// A fixed number `N` of segments per kv head (e.g. `N = 2` for a ring buffer).
impl<'s, T: Sync, const N: usize> KvSource<'s, T> for [[KvSegment<'s, T>; N]] {
    fn segments(&self, kv_head: usize) -> &[KvSegment<'s, T>] {
        &self[kv_head]
    }
}

impl<'s, T: Sync, const N: usize> KvSource<'s, T> for Vec<[KvSegment<'s, T>; N]> {
    fn segments(&self, kv_head: usize) -> &[KvSegment<'s, T>] {
        &self[kv_head]
    }
}

/// Adapter for a closure `kv_head -> segments`.
pub struct KvFn<F>(pub F);

impl<'s, T: 's, F> KvSource<'s, T> for KvFn<F>
where
    F: Fn(usize) -> &'s [KvSegment<'s, T>] + Sync,
{
    fn segments(&self, kv_head: usize) -> &[KvSegment<'s, T>] {
        (self.0)(kv_head)
    }
}

/// Bad arguments to an attention call; each message names the argument.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AttnError {
    #[error("attention shape {0:?}: n_heads, n_kv_heads and head_dim must be > 0 and n_kv_heads must divide n_heads")]
    BadShape(AttnShape),
    #[error("{what}: expected length {expected}, got {got}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("kv head {kv_head} segment {segment}: k has {k} and v has {v} elements (expected equal, a multiple of head_dim {head_dim})")]
    SegmentShape {
        kv_head: usize,
        segment: usize,
        k: usize,
        v: usize,
        head_dim: usize,
    },
    #[error(
        "kv head {kv_head} segment {segment}: position list has {got} entries for {expected} keys"
    )]
    SegmentPositions {
        kv_head: usize,
        segment: usize,
        expected: usize,
        got: usize,
    },
    #[error("kv head {kv_head} segment {segment}: range positions start {start} + {len} keys overflow u32")]
    PositionOverflow {
        kv_head: usize,
        segment: usize,
        start: u32,
        len: usize,
    },
    #[error("query positions: start {start} + {n_q} rows overflow u32")]
    QueryOverflow { start: u32, n_q: usize },
}

/// Validated geometry of one call, shared by the kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub n_q: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub group: usize,
    pub d: usize,
    pub scale: f32,
}

/// Checks every argument against the shape; returns the geometry or the first problem found.
pub(crate) fn validate<'s, T: KvElem, S: KvSource<'s, T> + ?Sized>(
    shape: &AttnShape,
    q: &[f32],
    q_pos: QueryPositions,
    kv: &S,
    out_len: usize,
    lse_len: Option<usize>,
) -> Result<Geometry, AttnError> {
    let (h, kvh, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    if h == 0 || kvh == 0 || d == 0 || !h.is_multiple_of(kvh) {
        return Err(AttnError::BadShape(*shape));
    }
    let n_q = match q_pos {
        QueryPositions::Start(start) => {
            let n_q = q.len() / (h * d);
            if n_q > 0
                && u32::try_from(n_q - 1)
                    .ok()
                    .and_then(|x| start.checked_add(x))
                    .is_none()
            {
                return Err(AttnError::QueryOverflow { start, n_q });
            }
            n_q
        }
        QueryPositions::List(l) => l.len(),
    };
    let rows = n_q * h * d;
    if q.len() != rows {
        return Err(AttnError::Length {
            what: "q [n_q, n_heads, head_dim]",
            expected: rows,
            got: q.len(),
        });
    }
    if out_len != rows {
        return Err(AttnError::Length {
            what: "out [n_q, n_heads, head_dim]",
            expected: rows,
            got: out_len,
        });
    }
    if let Some(l) = lse_len {
        if l != n_q * h {
            return Err(AttnError::Length {
                what: "lse [n_q, n_heads]",
                expected: n_q * h,
                got: l,
            });
        }
    }
    for kv_head in 0..kvh {
        for (segment, s) in kv.segments(kv_head).iter().enumerate() {
            if s.k.len() != s.v.len() || !s.k.len().is_multiple_of(d) {
                return Err(AttnError::SegmentShape {
                    kv_head,
                    segment,
                    k: s.k.len(),
                    v: s.v.len(),
                    head_dim: d,
                });
            }
            let len = s.k.len() / d;
            match s.pos {
                KvPositions::List(l) if l.len() != len => {
                    return Err(AttnError::SegmentPositions {
                        kv_head,
                        segment,
                        expected: len,
                        got: l.len(),
                    });
                }
                KvPositions::Range { start }
                    if len > 0
                        && u32::try_from(len - 1)
                            .ok()
                            .and_then(|x| start.checked_add(x))
                            .is_none() =>
                {
                    return Err(AttnError::PositionOverflow {
                        kv_head,
                        segment,
                        start,
                        len,
                    });
                }
                _ => {}
            }
        }
    }
    Ok(Geometry {
        n_q,
        n_heads: h,
        n_kv: kvh,
        group: h / kvh,
        d,
        scale: shape.scale,
    })
}

/// Total keys of kv head `h` over its segments.
pub(crate) fn total_keys<T>(segs: &[KvSegment<'_, T>], d: usize) -> usize {
    segs.iter().map(|s| s.len(d)).sum()
}
