//! `Session`: one sequence being decoded — the model, its preallocated KV store (f32 or f16),
//! scratch buffers and the logits of the last step. Prefill runs in chunks; decode one token.
use half::f16;
use slowfast_kv::KvStore;
use slowfast_model::{LogitsRows, Model, Scratch};

use crate::EngineError;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            _ => Err(format!("unknown KV dtype `{s}` (f32 or f16)")),
        }
    }
}

enum Cache {
    F32(KvStore<f32>),
    F16(KvStore<f16>),
}

/// Default prefill chunk (tokens per forward call).
pub const DEFAULT_CHUNK: usize = 512;

pub struct Session<'m> {
    pub model: &'m Model,
    cache: Cache,
    scratch: Scratch,
    chunk: usize,
    logits: Vec<f32>,
}

impl<'m> Session<'m> {
    /// A session able to hold `max_tokens` tokens, prefilling `chunk` tokens at a time.
    pub fn new(model: &'m Model, max_tokens: usize, kv: KvDtype, chunk: usize) -> Self {
        let chunk = chunk.clamp(1, max_tokens.max(1));
        let cache = match kv {
            KvDtype::F32 => Cache::F32(model.new_cache(max_tokens, chunk)),
            KvDtype::F16 => Cache::F16(model.new_cache(max_tokens, chunk)),
        };
        Session {
            model,
            cache,
            scratch: Scratch::default(),
            chunk,
            logits: Vec::new(),
        }
    }

    /// Tokens in the cache.
    pub fn pos(&self) -> usize {
        match &self.cache {
            Cache::F32(c) => c.len(),
            Cache::F16(c) => c.len(),
        }
    }

    pub fn capacity(&self) -> usize {
        match &self.cache {
            Cache::F32(c) => c.capacity(),
            Cache::F16(c) => c.capacity(),
        }
    }

    /// Bytes of KV cache allocated.
    pub fn kv_bytes(&self) -> usize {
        match &self.cache {
            Cache::F32(c) => c.nbytes(),
            Cache::F16(c) => c.nbytes(),
        }
    }

    /// Run `tokens` at the current position; returns logits of the requested rows.
    pub fn forward(&mut self, tokens: &[u32], rows: LogitsRows) -> Result<&[f32], EngineError> {
        let pos = self.pos();
        let (m, s, l) = (self.model, &mut self.scratch, &mut self.logits);
        match &mut self.cache {
            Cache::F32(c) => m.forward(tokens, pos, c, s, rows, l)?,
            Cache::F16(c) => m.forward(tokens, pos, c, s, rows, l)?,
        }
        Ok(&self.logits)
    }

    /// Prefill `tokens` in chunks; returns the last row's logits. `progress(done, total)` is
    /// called after each chunk.
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::BadInput(
                "empty prompt: nothing to prefill".into(),
            ));
        }
        let n_chunks = tokens.len().div_ceil(self.chunk);
        for (i, c) in tokens.chunks(self.chunk).enumerate() {
            let rows = if i + 1 == n_chunks {
                LogitsRows::Last
            } else {
                LogitsRows::None
            };
            self.forward(c, rows)?;
            progress(((i + 1) * self.chunk).min(tokens.len()), tokens.len());
        }
        Ok(&self.logits)
    }

    /// Decode one token; returns its next-token logits.
    pub fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.forward(&[token], LogitsRows::Last)
    }

    /// Logits of the last forward call.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
}
