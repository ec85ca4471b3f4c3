//! The scheduler's CPU device: each sequence is a `Session` (its own KV store and policy);
//! a decode step runs every row through one batched forward (`batch::step_batch`), whose
//! rows are bit-equal to decoding each sequence alone.
use slowfast_kv::PolicyStats;
use slowfast_model::{Model, Scratch};

use super::BatchDevice;
use crate::session::{KvDtype, PolicySpec, Session};
use crate::EngineError;

pub(super) struct CpuDevice<'m> {
    model: &'m Model,
    kv: KvDtype,
    chunk: usize,
    scratch: Scratch,
}

impl<'m> CpuDevice<'m> {
    pub fn new(model: &'m Model, kv: KvDtype, chunk: usize) -> Self {
        CpuDevice {
            model,
            kv,
            chunk,
            scratch: Scratch::default(),
        }
    }
}

/// KV bytes a `Session` of `capacity` tokens allocates (before an evicting policy shrinks it).
pub fn kv_bytes_for(model: &Model, capacity: usize, chunk: usize, kv: KvDtype) -> usize {
    let chunk = chunk.clamp(1, capacity.max(1));
    let slots: usize = model
        .kv_layout(capacity, chunk)
        .iter()
        .map(|l| l.capacity)
        .sum();
    let elem = match kv {
        KvDtype::F32 => 4,
        KvDtype::F16 => 2,
    };
    2 * slots * model.cfg.num_key_value_heads * model.cfg.head_dim * elem
}

impl<'m> BatchDevice for CpuDevice<'m> {
    type Seq = Session<'m>;

    fn kv_estimate(&self, _policy: &PolicySpec, capacity: usize) -> usize {
        kv_bytes_for(self.model, capacity, self.chunk, self.kv)
    }

    fn open(&mut self, policy: &PolicySpec, capacity: usize) -> Result<Session<'m>, EngineError> {
        Session::try_with_policy(self.model, capacity, self.kv, self.chunk, policy)
    }

    fn prefill_plan(&self, seq: &Session<'m>, n: usize) -> Vec<(usize, usize)> {
        seq.prefill_plan(n)
    }

    fn prefill_part(
        &mut self,
        seq: &mut Session<'m>,
        prompt: &[u32],
        plan: &[(usize, usize)],
        i: usize,
    ) -> Result<(), EngineError> {
        seq.prefill_part(prompt, plan, i)
    }

    fn decode(
        &mut self,
        seqs: &mut [&mut Session<'m>],
        tokens: &[u32],
        _greedy: bool,
    ) -> Result<(), EngineError> {
        crate::batch::step_batch(seqs, tokens, &mut self.scratch)
    }

    fn logits<'a>(&'a self, seq: &'a Session<'m>) -> &'a [f32] {
        seq.logits()
    }

    fn kv_bytes(&self, seq: &Session<'m>) -> usize {
        seq.kv_bytes()
    }

    fn stats(&self, seq: &Session<'m>) -> PolicyStats {
        seq.policy_stats()
    }

    fn policy_name(&self, seq: &Session<'m>) -> &'static str {
        seq.policy_name()
    }

    fn close(&mut self, seq: Session<'m>) {
        drop(seq);
    }
}
