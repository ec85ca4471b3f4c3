//! Exact CPU attention (FlashAttention-style tiled online softmax) over a KV cache given as
//! per-kv-head segment lists; prefill, split-KV decode, logits capture, partial merging.
//!
//! Layouts: `q`/`out` `[n_q, n_heads, head_dim]` (f32); per kv head, segments of
//! `k`/`v` `[len, head_dim]` (f32 or f16) with absolute key positions; `lse` `[n_q, n_heads]`
//! (natural log of the sum of exp of the scaled logits). Query head `hq` reads kv head
//! `hq / (n_heads / n_kv_heads)`. The kernels allocate nothing quadratic in the sequence: work
//! space per task is O(tile rows x (head_dim + tile keys)), from thread-local pools.

mod driver;
mod elem;
mod isa;
mod kernels;
mod merge;
mod reference;
mod scratch;
mod simd;
mod tile;
mod types;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_paths;

pub use elem::{ElemKind, KvElem};
pub use merge::merge_partials;
pub use reference::attention_reference;
pub use types::{
    AttnError, AttnShape, KvFn, KvPositions, KvSegment, KvSource, Mask, QueryPositions,
};

use driver::Call;
use tile::Isa;
use types::{total_keys, validate};

/// Attention of the query rows `q` over the KV segments of `kv`, written to `out`
/// `[n_q, n_heads, head_dim]` and, if given, `lse` `[n_q, n_heads]`. A row that sees no key
/// gets zeros and lse = -inf. Runs on the rayon pool.
#[allow(clippy::too_many_arguments)]
pub fn attention<'s, T: KvElem, K: KvSource<'s, T> + ?Sized>(
    shape: &AttnShape,
    q: &[f32],
    q_pos: QueryPositions,
    kv: &K,
    mask: Mask,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<(), AttnError> {
    attention_impl(
        Isa::best(shape.head_dim),
        None,
        shape,
        q,
        q_pos,
        kv,
        mask,
        out,
        lse,
        None,
    )
}

/// Number of f32 that [`attention_with_logits`] writes: `n_q * Σ_hq total_keys(kv head of hq)`
/// (`n_heads * n_q * total_keys` when every kv head has the same number of keys).
pub fn logits_len<'s, T: KvElem, K: KvSource<'s, T> + ?Sized>(
    shape: &AttnShape,
    n_q: usize,
    kv: &K,
) -> usize {
    let g = shape.n_heads / shape.n_kv_heads.max(1);
    (0..shape.n_kv_heads)
        .map(|h| total_keys(kv.segments(h), shape.head_dim.max(1)))
        .sum::<usize>()
        * g
        * n_q
}

/// Like [`attention`], and also writes the raw scaled logits `scale * q·k` of every (query
/// head, query row, key): head `hq`'s block `[n_q, total_keys(kv head of hq)]` follows the
/// blocks of heads `0..hq` (a plain `[n_heads, n_q, total_keys]` array when all kv heads hold
/// the same number of keys). Keys are in segment order; masked keys get -inf.
#[allow(clippy::too_many_arguments)]
pub fn attention_with_logits<'s, T: KvElem, K: KvSource<'s, T> + ?Sized>(
    shape: &AttnShape,
    q: &[f32],
    q_pos: QueryPositions,
    kv: &K,
    mask: Mask,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
    logits: &mut [f32],
) -> Result<(), AttnError> {
    attention_impl(
        Isa::best(shape.head_dim),
        None,
        shape,
        q,
        q_pos,
        kv,
        mask,
        out,
        lse,
        Some(logits),
    )
}

/// Shared entry: validation, then the driver with an explicit ISA and (tests) key-chunk count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_impl<'s, T: KvElem, K: KvSource<'s, T> + ?Sized>(
    isa: Isa,
    force_chunks: Option<usize>,
    shape: &AttnShape,
    q: &[f32],
    q_pos: QueryPositions,
    kv: &K,
    mask: Mask,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
    logits: Option<&mut [f32]>,
) -> Result<(), AttnError> {
    let geo = validate(
        shape,
        q,
        q_pos,
        kv,
        out.len(),
        lse.as_ref().map(|l| l.len()),
    )?;
    let isa = if geo.d.is_multiple_of(isa.lanes()) {
        isa
    } else {
        Isa::Scalar
    };
    let call = Call {
        isa,
        geo,
        mask,
        q,
        q_pos,
        kv,
        force_chunks,
        _s: std::marker::PhantomData,
    };
    match logits {
        None => call.run(out, lse, None),
        Some(lg) => {
            let expected = logits_len(shape, geo.n_q, kv);
            if lg.len() != expected {
                return Err(AttnError::Length {
                    what: "logits",
                    expected,
                    got: lg.len(),
                });
            }
            // Offset of kv head h's block: all heads of earlier kv heads come first.
            let mut bases = Vec::with_capacity(geo.n_kv);
            let mut acc = 0;
            for h in 0..geo.n_kv {
                bases.push(acc);
                acc += geo.group * geo.n_q * total_keys(kv.segments(h), geo.d);
            }
            call.run(out, lse, Some((lg, &bases)));
        }
    }
    Ok(())
}
