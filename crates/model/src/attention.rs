//! The attention step of a layer: the one place where the decoder meets the KV store. It
//! gathers the segments a query chunk may see and runs the exact tiled-softmax kernel.
use slowfast_backend::cpu::attention::{
    attention, attention_with_logits, logits_len, AttnShape, KvSegment, Mask, QueryPositions,
};
use slowfast_kv::{AttnCall, CacheElem, KvPolicy, KvStore};

use crate::config::ModelConfig;
use crate::ModelError;

/// Attention of `n` query rows (`q`: `[n, heads, head_dim]`, positions `pos0..pos0 + n`) of
/// `layer` over the cached keys the KV policy selects (within what the mask allows); writes
/// `out` `[n, heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_layer<T: CacheElem>(
    cfg: &ModelConfig,
    layer: usize,
    q: &[f32],
    pos0: usize,
    n: usize,
    window: Option<usize>,
    cache: &KvStore<T>,
    policy: &mut dyn KvPolicy<T>,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let shape = AttnShape {
        n_heads: cfg.num_attention_heads,
        n_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        scale: cfg.attn_scale,
    };
    let hi = pos0 + n;
    // The oldest key any row of the chunk can see.
    let lo = match window {
        Some(w) => (pos0 + 1).saturating_sub(w),
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
    policy.query(&call, q);
    policy.segments(&call, cache, &mut segs);
    let mask = Mask {
        causal: true,
        window: window.map(|w| w as u32),
    };
    let err = |e| ModelError::Compute(format!("attention in layer {layer}: {e}"));
    attention(
        &shape,
        q,
        QueryPositions::Start(pos0 as u32),
        &segs,
        mask,
        out,
        None,
    )
    .map_err(err)?;
    if capture == 0 {
        return Ok(());
    }
    // Slow step / bootstrap: the dense logits of the last `capture` rows, for the policy.
    let width = cfg.num_attention_heads * cfg.head_dim;
    let q_last = &q[(n - capture) * width..n * width];
    // [n_heads, capture, keys]: keys = hi - lo unless the policy compacted the layer.
    let mut logits = vec![0.0f32; logits_len(&shape, capture, &segs)];
    let mut o = vec![0.0f32; capture * width];
    let start = QueryPositions::Start((hi - capture) as u32);
    attention_with_logits(
        &shape,
        q_last,
        start,
        &segs,
        mask,
        &mut o,
        None,
        &mut logits,
    )
    .map_err(err)?;
    drop(segs);
    policy.observe(&call, capture, &logits, cache);
    Ok(())
}
