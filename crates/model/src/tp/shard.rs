//! `shard`: one rank's config and weights under a `TpPlan` (column-parallel rows, row-parallel
//! columns, vocabulary rows of the embedding and LM head, norms whole).
use std::ops::Range;

use crate::config::ModelConfig;
use crate::tp::TpPlan;
use crate::weights::{LayerWeights, ModelWeights};
use crate::ModelError;

fn heads_to(r: &Range<usize>, head_dim: usize) -> Range<usize> {
    r.start * head_dim..r.end * head_dim
}

fn bias(b: &Option<Vec<f32>>, r: &Range<usize>) -> Option<Vec<f32>> {
    b.as_ref().map(|b| b[r.clone()].to_vec())
}

/// The config and weights of `rank` under `plan`. The config holds the rank's query heads,
/// kv heads and intermediate columns; `vocab_size` stays the full vocabulary (tokens are
/// checked against it and the gathered logits have that width), while the rank's embedding
/// (and LM head) hold only its `plan` vocabulary rows.
pub fn shard(
    cfg: &ModelConfig,
    weights: &ModelWeights,
    plan: &TpPlan,
    rank: usize,
) -> Result<(ModelConfig, ModelWeights), ModelError> {
    let s = plan.rank(rank)?;
    plan.check_weights(cfg, weights)?;
    let hd = cfg.head_dim;
    let mut rc = cfg.clone();
    rc.num_attention_heads = s.heads.len();
    rc.num_key_value_heads = s.kv_heads.len();
    rc.intermediate_size = s.intermediate.len();
    let (q, kv, inter) = (
        heads_to(&s.heads, hd),
        heads_to(&s.kv_heads, hd),
        s.intermediate.clone(),
    );
    let at = |l: usize, name: &str, e: ModelError| {
        ModelError::TensorParallel(format!(
            "--tensor-parallel {}: rank {rank}, layer {l} `{name}`: {e}",
            plan.tp
        ))
    };
    let layers = weights
        .layers
        .iter()
        .enumerate()
        .map(|(l, w)| {
            Ok(LayerWeights {
                attn_norm: w.attn_norm.clone(),
                wq: w.wq.slice_rows(q.clone()).map_err(|e| at(l, "q_proj", e))?, // [q, hidden]
                wk: w
                    .wk
                    .slice_rows(kv.clone())
                    .map_err(|e| at(l, "k_proj", e))?, // [kv, hidden]
                wv: w
                    .wv
                    .slice_rows(kv.clone())
                    .map_err(|e| at(l, "v_proj", e))?, // [kv, hidden]
                wo: w.wo.slice_cols(q.clone()).map_err(|e| at(l, "o_proj", e))?, // [hidden, q]
                bq: bias(&w.bq, &q),
                bk: bias(&w.bk, &kv),
                bv: bias(&w.bv, &kv),
                q_norm: w.q_norm.clone(),
                k_norm: w.k_norm.clone(),
                post_attn_norm: w.post_attn_norm.clone(),
                ffn_norm: w.ffn_norm.clone(),
                // [inter, hidden]
                w_gate: (w.w_gate.slice_rows(inter.clone())).map_err(|e| at(l, "gate_proj", e))?,
                w_up: w
                    .w_up
                    .slice_rows(inter.clone())
                    .map_err(|e| at(l, "up_proj", e))?,
                // [hidden, inter]
                w_down: (w.w_down.slice_cols(inter.clone())).map_err(|e| at(l, "down_proj", e))?,
                post_ffw_norm: w.post_ffw_norm.clone(),
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let vocab = |name: &str, e: ModelError| {
        ModelError::TensorParallel(format!(
            "--tensor-parallel {}: rank {rank} `{name}`: {e}",
            plan.tp
        ))
    };
    let embed = weights
        .embed
        .slice_rows(s.vocab.clone()) // [vocab slice, hidden]
        .map_err(|e| vocab("embed_tokens", e))?;
    let lm_head = match &weights.lm_head {
        Some(h) => Some(
            h.slice_rows(s.vocab.clone()) // [vocab slice, hidden]
                .map_err(|e| vocab("lm_head", e))?,
        ),
        None => None,
    };
    Ok((
        rc,
        ModelWeights {
            embed,
            layers,
            final_norm: weights.final_norm.clone(),
            lm_head,
        },
    ))
}
