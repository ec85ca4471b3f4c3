//! `KvShare`: the ranks that hold the same replicated kv head(s) (a group larger than the
//! kv-head count). A KV policy chooses per kv head from the evidence of that head's query
//! heads; split over ranks, each rank sees only its own. So before a policy reads a query or
//! a capture's logits, the sharing ranks gather each other's, and every one of them makes the
//! whole model's choice, the same on each (per-rank evidence cost SFI +0.10 nats on code at
//! TP 2 on Gemma 3 270M: docs/tensor-parallel.md).
use std::ops::Range;
use std::sync::Arc;

use super::{Communicator, TpPlan};
use crate::ModelError;

/// The ranks sharing this rank's kv heads, and the group's communicator.
pub struct KvShare {
    comm: Arc<dyn Communicator>,
    /// Consecutive ranks (in rank order their query heads are the kv heads' in order).
    sharers: Range<usize>,
}

impl KvShare {
    /// `None` unless other ranks hold this rank's kv heads too.
    pub fn new(plan: &TpPlan, rank: usize, comm: Arc<dyn Communicator>) -> Option<KvShare> {
        let mine = &plan.ranks.get(rank)?.kv_heads;
        let sharers: Vec<usize> = (0..plan.tp)
            .filter(|&r| plan.ranks[r].kv_heads == *mine)
            .collect();
        if sharers.len() < 2 {
            return None;
        }
        let range = sharers[0]..sharers[sharers.len() - 1] + 1;
        debug_assert_eq!(range.len(), sharers.len(), "sharers are consecutive ranks");
        Some(KvShare {
            comm,
            sharers: range,
        })
    }

    /// `local` is `rows` equal blocks (a query `[rows, heads, head_dim]`: a block a row; a
    /// capture's logits `[heads, rows, keys]`: one block). `out` becomes, block by block, the
    /// sharing ranks' blocks in rank order: the heads of the kv heads in the whole model's
    /// order. A collective: every rank of the group calls it, with any length; the ranks
    /// sharing kv heads must agree on theirs.
    pub fn gather_blocks(
        &self,
        local: &[f32],
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let size = self.comm.size();
        let n = local.len();
        // Lengths first (two f32 halves of 16 bits: exact), since ranks holding other kv
        // heads may gather other lengths.
        let mine = [(n >> 16) as f32, (n & 0xffff) as f32];
        let mut lens = vec![0.0f32; 2 * size];
        self.comm.all_gather(&mine, &mut lens)?;
        let len_of =
            |r: usize, lens: &[f32]| ((lens[2 * r] as usize) << 16) | lens[2 * r + 1] as usize;
        let max = (0..size).map(|r| len_of(r, &lens)).max().unwrap_or(0);
        // Every rank joins the gather below even when its pair disagrees, so the group stays
        // in step and only the pair fails.
        let apart = self.sharers.clone().find(|&r| len_of(r, &lens) != n);
        let mut padded = local.to_vec();
        padded.resize(max, 0.0);
        let mut all = vec![0.0f32; size * max];
        self.comm.all_gather(&padded, &mut all)?;
        if let Some(r) = apart {
            return Err(ModelError::TensorParallel(format!(
                "ranks {:?} share kv heads but gather {} and {n} values (their KV policies went apart)",
                self.sharers,
                len_of(r, &lens)
            )));
        }
        if n.checked_rem(rows) != Some(0) {
            return Err(ModelError::TensorParallel(format!(
                "{n} values do not split into {rows} equal blocks"
            )));
        }
        let blk = n / rows;
        out.clear();
        for b in 0..rows {
            for r in self.sharers.clone() {
                let start = r * max + b * blk;
                out.extend_from_slice(&all[start..start + blk]);
            }
        }
        Ok(())
    }
}
