//! The attention step of a layer: the one place where the decoder meets the KV store. It
//! gathers the segments a query chunk may see and runs the exact tiled-softmax kernel.
use slowfast_backend::cpu::attention::{
    attention, attention_with_logits, logits_len, AttnShape, KvSegment, Mask, QueryPositions,
};
use slowfast_kv::{AttnCall, CacheElem, KvPolicy, KvStore};

use crate::config::ModelConfig;
use crate::tp::KvShare;
use crate::ModelError;

/// Attention of `n` query rows (`q`: `[n, heads, head_dim]`, positions `pos0..pos0 + n`, or
/// the ascending `q_list` when given: FastKV's propagated rows) of `layer` over the cached keys
/// the KV policy selects (within what the mask allows); writes `out` `[n, heads, head_dim]`.
/// `share` (a tensor-parallel rank whose kv heads other ranks hold too): the policy reads the
/// query and the captured logits of every query head of those kv heads, gathered.
#[allow(clippy::too_many_arguments)]
pub fn attend_layer<T: CacheElem>(
    cfg: &ModelConfig,
    layer: usize,
    q: &[f32],
    pos0: usize,
    n: usize,
    window: Option<usize>,
    q_list: Option<&[u32]>,
    cache: &KvStore<T>,
    policy: &mut dyn KvPolicy<T>,
    out: &mut [f32],
    share: Option<&KvShare>,
) -> Result<(), ModelError> {
    let shape = AttnShape {
        n_heads: cfg.num_attention_heads,
        n_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        scale: cfg.attn_scale,
    };
    // With a position list, the call spans its first to its last row (hi = last + 1).
    let (first, hi) = match q_list {
        Some(l) => (l[0] as usize, *l.last().unwrap() as usize + 1),
        None => (pos0, pos0 + n),
    };
    let pos0 = hi - n;
    // Positions of query rows `r0..r1`.
    let q_pos = |r0: usize, r1: usize| match q_list {
        Some(l) => QueryPositions::List(&l[r0..r1]),
        None => QueryPositions::Start((pos0 + r0) as u32),
    };
    // The oldest key any row of the chunk can see.
    let lo = match window {
        Some(w) => (first + 1).saturating_sub(w),
        None => 0,
    };
    let call = AttnCall {
        layer,
        pos0,
        n,
        lo,
        sliding: window.is_some(),
    };
    debug_assert_eq!(hi, call.hi());
    let capture = policy.capture_rows(&call).min(n);
    let mut segs: Vec<Vec<KvSegment<'_, T>>> = Vec::with_capacity(cfg.num_key_value_heads);
    // Sliding layers hold no policy state; every rank skips them alike.
    let share = share.filter(|_| window.is_none());
    match share {
        Some(sh) => {
            let mut all_q = Vec::new(); // [n, sharers x heads, head_dim]
            sh.gather_blocks(q, n, &mut all_q)?;
            policy.query(&call, &all_q);
        }
        None => policy.query(&call, q),
    }
    policy.segments(&call, cache, &mut segs);
    let mask = Mask {
        causal: true,
        window: window.map(|w| w as u32),
    };
    let err = |e| ModelError::Compute(format!("attention in layer {layer}: {e}"));
    // A decode slow step (one row, captured) runs once, through the kernel that also writes
    // the dense logits. In prefill every row goes through the plain kernel (so the outputs do
    // not depend on what a policy captures) and the captured tail is re-run for its logits.
    let width = cfg.num_attention_heads * cfg.head_dim;
    let plain = if n == 1 && capture == 1 { 0 } else { n };
    if plain > 0 {
        attention(
            &shape,
            &q[..plain * width],
            q_pos(0, plain),
            &segs,
            mask,
            &mut out[..plain * width],
            None,
        )
        .map_err(err)?;
    }
    if capture == 0 {
        return Ok(());
    }
    let tail = n - capture;
    let mut scratch_out;
    let o: &mut [f32] = if plain == 0 {
        out
    } else {
        scratch_out = vec![0.0f32; capture * width];
        &mut scratch_out
    };
    // [n_heads, capture, keys]: keys = hi - lo unless the policy compacted the layer.
    let mut logits = vec![0.0f32; logits_len(&shape, capture, &segs)];
    attention_with_logits(
        &shape,
        &q[tail * width..n * width],
        q_pos(tail, n),
        &segs,
        mask,
        o,
        None,
        &mut logits,
    )
    .map_err(err)?;
    drop(segs);
    if let Some(sh) = share {
        let mut all = Vec::new(); // [sharers x heads, capture, keys]
        sh.gather_blocks(&logits, 1, &mut all)?;
        logits = all;
    }
    policy.observe(&call, capture, &logits, cache);
    Ok(())
}
