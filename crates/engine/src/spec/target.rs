//! What the draft–verify loop needs of the target model's sequence, on any device: the CPU
//! `Session` and the GPU's `GpuSession` both implement it, so `Speculator` is one loop.
use crate::EngineError;

/// The target sequence of speculative decoding. Its policy is the drafter's (`sfi`,
/// `streaming`: its decode steps draft) or full KV (`ngram`, `model`).
pub trait SpecTarget {
    /// Tokens in the cache.
    fn pos(&self) -> usize;
    /// Most tokens the cache holds.
    fn capacity(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// Prefill chunk (a draft model's session uses at least this).
    fn chunk(&self) -> usize;
    fn policy_name(&self) -> &'static str;
    /// Most tokens one `verify` can take.
    fn verify_rows_max(&self) -> usize;
    /// The decode steps from here on are drafts, undone by `end_draft` (errors for a policy
    /// that cannot draft).
    fn begin_draft(&mut self) -> Result<(), EngineError>;
    /// End of the draft steps: the cache goes back to `len` positions.
    fn end_draft(&mut self, len: usize) -> Result<(), EngineError>;
    /// One decode step of `token`: the next token's logits.
    fn step(&mut self, token: u32) -> Result<&[f32], EngineError>;
    /// A verification: `tokens` at the current position in one pass, dense over the whole
    /// cache; every row's logits `[tokens.len(), vocab]`. Always followed by `end_verify`.
    fn verify(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError>;
    /// After a verification: the cache goes back to `len` positions, `fed` being the kept
    /// tokens at `len - fed.len() .. len`; the policy may refresh its sparse memory from the
    /// verification (always with `refresh`, else when its trigger fires on `fed`).
    fn end_verify(&mut self, fed: &[u32], len: usize, refresh: bool) -> Result<(), EngineError>;
}

impl SpecTarget for crate::session::Session<'_> {
    fn pos(&self) -> usize {
        crate::session::Session::pos(self)
    }
    fn capacity(&self) -> usize {
        crate::session::Session::capacity(self)
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
    fn chunk(&self) -> usize {
        self.chunk
    }
    fn policy_name(&self) -> &'static str {
        crate::session::Session::policy_name(self)
    }
    fn verify_rows_max(&self) -> usize {
        crate::session::Session::verify_rows_max(self)
    }
    fn begin_draft(&mut self) -> Result<(), EngineError> {
        crate::session::Session::begin_draft(self)
    }
    fn end_draft(&mut self, len: usize) -> Result<(), EngineError> {
        crate::session::Session::end_draft(self, len);
        Ok(())
    }
    fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        crate::session::Session::step(self, token)
    }
    fn verify(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        crate::session::Session::verify(self, tokens)
    }
    fn end_verify(&mut self, fed: &[u32], len: usize, refresh: bool) -> Result<(), EngineError> {
        crate::session::Session::end_verify(self, fed, len, refresh);
        Ok(())
    }
}

/// A session that both steps and is a speculative target (the CPU `Session`, `GpuSession`).
pub trait SpecSession: crate::device::Steps + SpecTarget {
    fn target(&mut self) -> &mut dyn SpecTarget;
}

impl<T: crate::device::Steps + SpecTarget> SpecSession for T {
    fn target(&mut self) -> &mut dyn SpecTarget {
        self
    }
}

/// A session of `policy` (the drafter's, or full KV) on `device` that speculative decoding
/// drafts and verifies in, holding `cap` tokens.
pub fn spec_session<'m>(
    device: crate::device::Device,
    model: &'m slowfast_model::Model,
    cap: usize,
    kv: crate::session::KvDtype,
    chunk: usize,
    policy: &crate::session::PolicySpec,
) -> Result<Box<dyn SpecSession + 'm>, EngineError> {
    use crate::device::Device;
    match device {
        Device::Cpu => Ok(Box::new(crate::session::Session::try_with_policy(
            model, cap, kv, chunk, policy,
        )?)),
        #[cfg(feature = "cuda")]
        Device::Cuda => Ok(Box::new(crate::cuda::GpuSession::new(
            model, cap, kv, policy,
        )?)),
        #[allow(unreachable_patterns)]
        _ => Err(crate::device::not_built()),
    }
}
