//! `TpPlan`: which query heads, kv heads, MLP columns and vocabulary rows each tensor-parallel
//! rank owns, and the checks that a model's shapes and weight types allow that split.
use std::ops::Range;

use crate::config::ModelConfig;
use crate::weights::{ModelWeights, Weight};
use crate::ModelError;

/// What one rank of a tensor-parallel group owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSlice {
    /// Query heads (column-parallel rows of `wq`, row-parallel columns of `wo`).
    pub heads: Range<usize>,
    /// Kv heads the rank's query heads use (rows of `wk`/`wv`); shared by several ranks when
    /// the group is larger than the kv-head count (replicated, as vLLM does).
    pub kv_heads: Range<usize>,
    /// MLP intermediate columns (rows of `w_gate`/`w_up`, columns of `w_down`).
    pub intermediate: Range<usize>,
    /// Vocabulary rows of the embedding and the LM head (the last rank's may be shorter).
    pub vocab: Range<usize>,
}

/// The partition of a model over `tp` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPlan {
    pub tp: usize,
    /// Vocabulary rows per rank as gathered (`ceil(vocab / tp)`): every rank's logits slice is
    /// padded to this width so the gather moves equal counts.
    pub vocab_per_rank: usize,
    pub ranks: Vec<RankSlice>,
}

/// `d` divides `n` (`checked_rem`: `usize::is_multiple_of` is newer than the MSRV, 1.85).
fn divides(d: usize, n: usize) -> bool {
    n.checked_rem(d) == Some(0)
}

/// Both ends of `cols` fall on `block`-value boundaries.
pub(crate) fn on_blocks(cols: &Range<usize>, block: usize) -> bool {
    divides(block, cols.start) && divides(block, cols.end)
}

fn err(tp: usize, what: String) -> ModelError {
    ModelError::TensorParallel(format!("--tensor-parallel {tp}: {what}"))
}

impl TpPlan {
    /// Partition `cfg` over `tp` ranks. Query heads and intermediate columns must divide
    /// evenly; kv heads must divide evenly, or (for `tp` larger than the kv-head count) `tp`
    /// must be a multiple of it, each rank then holding the one kv head its query heads use.
    pub fn new(cfg: &ModelConfig, tp: usize) -> Result<TpPlan, ModelError> {
        let (nh, nkv, inter) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
        );
        if tp == 0 {
            return Err(err(tp, "the group needs at least one rank".into()));
        }
        if !divides(tp, nh) {
            return Err(err(
                tp,
                format!("{nh} attention heads do not divide by {tp}"),
            ));
        }
        if nkv >= tp && !divides(tp, nkv) {
            return Err(err(
                tp,
                format!("{nkv} key-value heads do not divide by {tp}"),
            ));
        }
        if nkv < tp && !divides(nkv, tp) {
            return Err(err(
                tp,
                format!(
                    "{nkv} key-value heads cannot be replicated over {tp} ranks (the rank count must be a multiple of the kv-head count when it exceeds it)"
                ),
            ));
        }
        if !divides(tp, inter) {
            return Err(err(
                tp,
                format!("intermediate_size {inter} does not divide by {tp}"),
            ));
        }
        let vocab = cfg.vocab_size;
        let vocab_per_rank = vocab.div_ceil(tp);
        let (hr, ir) = (nh / tp, inter / tp);
        let ranks = (0..tp)
            .map(|r| {
                let kv_heads = if nkv >= tp {
                    r * nkv / tp..(r + 1) * nkv / tp
                } else {
                    // tp = k·nkv: ranks r·... share kv head r / k (their query heads' group).
                    let kv = r / (tp / nkv);
                    kv..kv + 1
                };
                RankSlice {
                    heads: r * hr..(r + 1) * hr,
                    kv_heads,
                    intermediate: r * ir..(r + 1) * ir,
                    vocab: (r * vocab_per_rank).min(vocab)..((r + 1) * vocab_per_rank).min(vocab),
                }
            })
            .collect();
        Ok(TpPlan {
            tp,
            vocab_per_rank,
            ranks,
        })
    }

    /// The slice of `rank`, or an error naming the group size.
    pub fn rank(&self, rank: usize) -> Result<&RankSlice, ModelError> {
        self.ranks.get(rank).ok_or_else(|| {
            err(
                self.tp,
                format!("rank {rank} is outside the group (ranks 0..{})", self.tp),
            )
        })
    }

    /// Check that every row-parallel slice (the `wo` columns of a rank's query heads, the
    /// `w_down` columns of its intermediate range) falls on whole blocks of the weight's ggml
    /// type, in every layer.
    pub fn check_weights(&self, cfg: &ModelConfig, w: &ModelWeights) -> Result<(), ModelError> {
        let hd = cfg.head_dim;
        let check = |layer: usize, name: &str, wt: &Weight, cols: Range<usize>, of: &str| {
            let bs = wt.ty.block_size();
            if !on_blocks(&cols, bs) {
                return Err(err(
                    self.tp,
                    format!(
                        "layer {layer} `{name}` ({}) would be split at columns {cols:?} ({of}), not on its {bs}-value blocks; a {}-column slice per rank must be a multiple of {bs}",
                        wt.ty.name(),
                        cols.len()
                    ),
                ));
            }
            Ok(())
        };
        for (l, lw) in w.layers.iter().enumerate() {
            for (r, s) in self.ranks.iter().enumerate() {
                let heads = s.heads.start * hd..s.heads.end * hd;
                check(
                    l,
                    "o_proj",
                    &lw.wo,
                    heads,
                    &format!("rank {r}'s query heads {:?} × head_dim {hd}", s.heads),
                )?;
                check(
                    l,
                    "down_proj",
                    &lw.w_down,
                    s.intermediate.clone(),
                    &format!("rank {r}'s intermediate columns"),
                )?;
            }
        }
        Ok(())
    }
}
