//! The scheduler's CPU device: each sequence is a `Session` (its own KV store and policy);
//! a decode step runs every row through one batched forward (`batch::step_batch`), whose
//! rows are bit-equal to decoding each sequence alone. A speculative sequence also carries
//! its drafter and decodes by its own draft–verify rounds.
use slowfast_kv::PolicyStats;
use slowfast_model::{Model, Scratch};

use super::{BatchDevice, Inspection, SpecTurn};
use crate::prefix::PrefixCacheCpu;
use crate::sampler::SamplerConfig;
use crate::session::{each_cache, Cache, KvDtype, PolicySpec, Session};
use crate::spec::{SpecOptions, SpecStats, Speculator};
use crate::EngineError;

pub(super) struct CpuDevice<'m> {
    model: &'m Model,
    /// The model of `speculate` requests with the `model` drafter (`serve --draft-model`).
    draft: Option<&'m Model>,
    kv: KvDtype,
    chunk: usize,
    /// Tokens a KV block of a sequence holds (the prefix cache's block, so they are shared).
    block: usize,
    scratch: Scratch,
    /// Whole prefill chunks of earlier prompts (`--prefix-cache-memory`).
    prefix: Option<PrefixCacheCpu>,
}

impl<'m> CpuDevice<'m> {
    /// `prefix`: the prefix cache's bytes (0: none) and block size.
    pub fn new(
        model: &'m Model,
        draft: Option<&'m Model>,
        kv: KvDtype,
        chunk: usize,
        prefix: (usize, usize),
    ) -> Result<Self, EngineError> {
        let cache = match prefix {
            (0, _) => None,
            (bytes, block) => Some(PrefixCacheCpu::new(model, kv, chunk, block, bytes)?),
        };
        Ok(CpuDevice {
            model,
            draft,
            kv,
            chunk,
            block: prefix.1,
            scratch: Scratch::default(),
            prefix: cache,
        })
    }
}

/// A CPU sequence: its session, and its drafter when it decodes speculatively.
pub(super) struct CpuSeq<'m> {
    sess: Session<'m>,
    spec: Option<Box<Speculator<'m>>>,
}

/// KV bytes a `Session` of `capacity` tokens holds when full (before an evicting policy
/// shrinks it), its global layers in blocks of `block` tokens.
pub fn kv_bytes_for(
    model: &Model,
    capacity: usize,
    chunk: usize,
    block: usize,
    kv: KvDtype,
) -> usize {
    kv_bytes_at(model, capacity, capacity, chunk, block, kv)
}

/// KV bytes a `Session` of `capacity` tokens holds once `len` tokens are written: its window
/// rings, and its global layers in whole blocks of `block` tokens (`KvStore::nbytes_at`).
pub fn kv_bytes_at(
    model: &Model,
    capacity: usize,
    len: usize,
    chunk: usize,
    block: usize,
    kv: KvDtype,
) -> usize {
    let chunk = chunk.clamp(1, capacity.max(1));
    let slots: usize = model
        .kv_layout(capacity, chunk)
        .iter()
        .map(|l| {
            if l.ring {
                l.capacity
            } else {
                slowfast_kv::block_slots(len.min(l.capacity), block)
            }
        })
        .sum();
    let elem = match kv {
        KvDtype::F32 => 4,
        KvDtype::F16 => 2,
        KvDtype::Fp8 => 1,
    };
    2 * slots * model.cfg.num_key_value_heads * model.cfg.head_dim * elem
}

impl<'m> BatchDevice for CpuDevice<'m> {
    type Seq = CpuSeq<'m>;

    fn kv_estimate(&self, _policy: &PolicySpec, capacity: usize, len: usize) -> usize {
        kv_bytes_at(self.model, capacity, len, self.chunk, self.block, self.kv)
    }

    fn kv_grown(&self, seq: &CpuSeq<'m>, extra: usize) -> usize {
        seq.sess.kv_bytes_at(seq.sess.pos() + extra)
    }

    fn open(&mut self, policy: &PolicySpec, capacity: usize) -> Result<CpuSeq<'m>, EngineError> {
        let mut sess = Session::try_with_policy(self.model, capacity, self.kv, self.chunk, policy)?;
        sess.set_kv_block(self.block)?;
        Ok(CpuSeq { sess, spec: None })
    }

    fn prefill_plan(&self, seq: &CpuSeq<'m>, n: usize) -> Vec<(usize, usize)> {
        seq.sess.prefill_plan(n)
    }

    fn prefill_part(
        &mut self,
        seq: &mut CpuSeq<'m>,
        prompt: &[u32],
        plan: &[(usize, usize)],
        i: usize,
    ) -> Result<(), EngineError> {
        seq.sess.prefill_part(prompt, plan, i)?;
        if let Some(p) = &mut self.prefix {
            p.remember(&seq.sess, prompt, plan, i);
        }
        Ok(())
    }

    fn reuse_prefix(
        &mut self,
        seq: &mut CpuSeq<'m>,
        prompt: &[u32],
        plan: &[(usize, usize)],
    ) -> usize {
        match &mut self.prefix {
            Some(p) => p.reuse(&mut seq.sess, prompt, plan),
            None => 0,
        }
    }

    fn prefix_bytes(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCacheCpu::nbytes)
    }

    fn decode(
        &mut self,
        seqs: &mut [&mut CpuSeq<'m>],
        tokens: &[u32],
        _greedy: bool,
    ) -> Result<(), EngineError> {
        let mut sessions: Vec<&mut Session<'m>> = seqs.iter_mut().map(|s| &mut s.sess).collect();
        crate::batch::step_batch(&mut sessions, tokens, &mut self.scratch)
    }

    fn logits<'a>(&'a self, seq: &'a CpuSeq<'m>) -> &'a [f32] {
        seq.sess.logits()
    }

    fn kv_bytes(&self, seq: &CpuSeq<'m>) -> usize {
        seq.sess.kv_bytes()
    }

    fn stats(&self, seq: &CpuSeq<'m>) -> PolicyStats {
        seq.sess.policy_stats()
    }

    fn policy_name(&self, seq: &CpuSeq<'m>) -> &'static str {
        seq.sess.policy_name()
    }

    fn close(&mut self, seq: CpuSeq<'m>) {
        drop(seq);
    }

    fn spec_attach(
        &mut self,
        seq: &mut CpuSeq<'m>,
        opts: &SpecOptions,
        prompt: &[u32],
        sampler: &SamplerConfig,
    ) -> Result<(), EngineError> {
        let draft = match opts.drafter {
            crate::spec::DraftKind::Model => Some(self.draft.ok_or_else(|| {
                EngineError::BadInput(
                    "speculate: the model drafter needs a server started with --draft-model".into(),
                )
            })?),
            _ => None,
        };
        let spec = Speculator::new(&mut seq.sess, prompt, opts.clone(), draft, self.kv, sampler)?;
        seq.spec = Some(Box::new(spec));
        Ok(())
    }

    fn spec_rounds(
        &mut self,
        turns: &mut [SpecTurn<'_, CpuSeq<'m>>],
    ) -> Vec<Result<Vec<u32>, EngineError>> {
        turns
            .iter_mut()
            .map(|t| {
                let seq = &mut *t.seq;
                let spec = seq.spec.as_mut().ok_or_else(|| {
                    EngineError::BadInput(
                        "a speculative round of a sequence without a drafter".into(),
                    )
                })?;
                spec.round(&mut seq.sess, t.t0, t.sampler, t.max_out)
            })
            .collect()
    }

    fn spec_stats(&self, seq: &CpuSeq<'m>) -> Option<SpecStats> {
        seq.spec.as_ref().map(|s| s.stats().clone())
    }

    fn inspect(&self, seq: &CpuSeq<'m>) -> Option<Inspection> {
        Some(each_cache!(&seq.sess.cache, (store, policy) => {
            Inspection::of(self.model, store, policy.as_ref())
        }))
    }
}
