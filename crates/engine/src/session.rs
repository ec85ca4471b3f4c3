//! `Session`: one sequence being decoded — the model, its preallocated KV store (f32 or f16),
//! scratch buffers and the logits of the last step. Prefill runs in chunks; decode one token.
use half::f16;
use slowfast_kv::sfi::memory::{SfiConfig, SfiPolicy};
use slowfast_kv::{CacheElem, FullPolicy, KvPolicy, KvStore, PolicyStats, StreamingPolicy};
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

/// Which KV policy a session runs, with its parameters resolved to token counts.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicySpec {
    /// Dense attention (the default).
    Full,
    /// StreamingLLM: `sinks` first tokens + `recent` last tokens.
    Streaming { sinks: usize, recent: usize },
    /// Slow-Fast Inference; `enders`/`newlines` (the trigger's token classes) come from the
    /// tokenizer via `with_vocab`.
    Sfi {
        cfg: Box<SfiConfig>,
        enders: Vec<u32>,
        newlines: Vec<u32>,
        vocab_size: usize,
    },
}

impl PolicySpec {
    pub fn name(&self) -> &'static str {
        match self {
            PolicySpec::Full => "full",
            PolicySpec::Streaming { .. } => "streaming",
            PolicySpec::Sfi { .. } => "sfi",
        }
    }

    /// Tokens attended per kv head by the sparse steps (None for full KV).
    pub fn budget(&self) -> Option<usize> {
        match self {
            PolicySpec::Full => None,
            PolicySpec::Streaming { sinks, recent } => Some(sinks + recent),
            PolicySpec::Sfi { cfg, .. } => Some(cfg.sinks + cfg.selected + cfg.recent),
        }
    }

    /// Attach the tokenizer's sentence-ender and newline tokens (SFI's trigger).
    pub fn with_vocab(mut self, tok: &slowfast_tokenizer::Tokenizer) -> Self {
        if let PolicySpec::Sfi {
            enders,
            newlines,
            vocab_size,
            ..
        } = &mut self
        {
            *enders = tok.sentence_ender_ids();
            *newlines = tok.newline_ids();
            *vocab_size = tok.vocab_size();
        }
        self
    }

    fn build<T: CacheElem>(&self) -> Result<Box<dyn KvPolicy<T>>, EngineError> {
        Ok(match self {
            PolicySpec::Full => Box::new(FullPolicy::new()),
            PolicySpec::Streaming { sinks, recent } => {
                Box::new(StreamingPolicy::new(*sinks, *recent))
            }
            PolicySpec::Sfi {
                cfg,
                enders,
                newlines,
                vocab_size,
            } => Box::new(
                SfiPolicy::<T>::new((**cfg).clone(), enders, newlines, (*vocab_size).max(1))
                    .map_err(|e| EngineError::BadInput(format!("SFI trigger: {e}")))?,
            ),
        })
    }
}

enum Cache {
    F32(KvStore<f32>, Box<dyn KvPolicy<f32>>),
    F16(KvStore<f16>, Box<dyn KvPolicy<f16>>),
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
    /// A session able to hold `max_tokens` tokens, prefilling `chunk` tokens at a time, with
    /// dense attention.
    pub fn new(model: &'m Model, max_tokens: usize, kv: KvDtype, chunk: usize) -> Self {
        Self::try_with_policy(model, max_tokens, kv, chunk, &PolicySpec::Full)
            .expect("full KV has nothing to validate")
    }

    /// A session whose attention goes through the KV policy `policy`.
    pub fn try_with_policy(
        model: &'m Model,
        max_tokens: usize,
        kv: KvDtype,
        chunk: usize,
        policy: &PolicySpec,
    ) -> Result<Self, EngineError> {
        let chunk = chunk.clamp(1, max_tokens.max(1));
        let cache = match kv {
            KvDtype::F32 => Cache::F32(model.new_cache(max_tokens, chunk), policy.build()?),
            KvDtype::F16 => Cache::F16(model.new_cache(max_tokens, chunk), policy.build()?),
        };
        Ok(Session {
            model,
            cache,
            scratch: Scratch::default(),
            chunk,
            logits: Vec::new(),
        })
    }

    /// A copy of this session (KV cache, position, last logits) that continues under
    /// `policy` with a fresh policy state. Meant for policies whose state a dense prefill does
    /// not touch (full, streaming): `eval` prefills once and forks.
    pub fn fork(&self, policy: &PolicySpec) -> Result<Session<'m>, EngineError> {
        let cache = match &self.cache {
            Cache::F32(c, _) => Cache::F32(c.clone(), policy.build()?),
            Cache::F16(c, _) => Cache::F16(c.clone(), policy.build()?),
        };
        Ok(Session {
            model: self.model,
            cache,
            scratch: Scratch::default(),
            chunk: self.chunk,
            logits: self.logits.clone(),
        })
    }

    /// Tokens in the cache.
    pub fn pos(&self) -> usize {
        match &self.cache {
            Cache::F32(c, _) => c.len(),
            Cache::F16(c, _) => c.len(),
        }
    }

    pub fn capacity(&self) -> usize {
        match &self.cache {
            Cache::F32(c, _) => c.capacity(),
            Cache::F16(c, _) => c.capacity(),
        }
    }

    /// Bytes of KV cache allocated.
    pub fn kv_bytes(&self) -> usize {
        match &self.cache {
            Cache::F32(c, _) => c.nbytes(),
            Cache::F16(c, _) => c.nbytes(),
        }
    }

    /// The KV policy's counters (slow/fast steps, attended tokens).
    pub fn policy_stats(&self) -> PolicyStats {
        match &self.cache {
            Cache::F32(_, p) => p.stats(),
            Cache::F16(_, p) => p.stats(),
        }
    }

    pub fn policy_name(&self) -> &'static str {
        match &self.cache {
            Cache::F32(_, p) => p.name(),
            Cache::F16(_, p) => p.name(),
        }
    }

    /// Run `tokens` at the current position; returns logits of the requested rows.
    pub fn forward(&mut self, tokens: &[u32], rows: LogitsRows) -> Result<&[f32], EngineError> {
        let pos = self.pos();
        let (m, s, l) = (self.model, &mut self.scratch, &mut self.logits);
        match &mut self.cache {
            Cache::F32(c, p) => m.forward_with(tokens, pos, c, p.as_mut(), s, rows, l)?,
            Cache::F16(c, p) => m.forward_with(tokens, pos, c, p.as_mut(), s, rows, l)?,
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
        match &mut self.cache {
            Cache::F32(_, p) => p.on_token(token),
            Cache::F16(_, p) => p.on_token(token),
        }
        self.forward(&[token], LogitsRows::Last)
    }

    /// Logits of the last forward call.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
}

/// Resolve `--kv-budget`: a value below 1 is a fraction of `context`, otherwise a token count.
pub fn budget_tokens(budget: f64, context: usize) -> Result<usize, EngineError> {
    if !budget.is_finite() || budget <= 0.0 {
        return Err(EngineError::BadInput(format!(
            "--kv-budget must be a positive token count or a fraction below 1, got {budget}"
        )));
    }
    Ok(if budget < 1.0 {
        ((budget * context as f64).round() as usize).max(1)
    } else {
        budget as usize
    })
}

/// SFI knobs from the command line (the rest keep the authors' defaults).
#[derive(Debug, Clone)]
pub struct SfiKnobs {
    pub recent: usize,
    pub refresh_interval: usize,
    pub min_gap: usize,
    pub trigger: String,
}

impl Default for SfiKnobs {
    fn default() -> Self {
        SfiKnobs {
            recent: 256,
            refresh_interval: 96,
            min_gap: 16,
            trigger: "punct".into(),
        }
    }
}

/// Build the policy named `name` for a sequence of `context` tokens (SFI with default knobs).
pub fn policy_spec(
    name: &str,
    budget: Option<f64>,
    sinks: usize,
    context: usize,
) -> Result<PolicySpec, EngineError> {
    policy_spec_with(name, budget, sinks, context, &SfiKnobs::default())
}

fn sfi_spec(b: usize, sinks: usize, k: &SfiKnobs) -> Result<PolicySpec, EngineError> {
    if b <= sinks + k.recent {
        return Err(EngineError::BadInput(format!(
            "--kv-budget ({b} tokens) must exceed --sinks + --sfi-recent ({})",
            sinks + k.recent
        )));
    }
    let mut cfg = SfiConfig::new(sinks, k.recent, b - sinks - k.recent);
    cfg.trigger.kind = k
        .trigger
        .parse()
        .map_err(|e| EngineError::BadInput(format!("--sfi-trigger: {e}")))?;
    cfg.trigger.refresh_interval = k.refresh_interval;
    cfg.trigger.period = k.refresh_interval;
    cfg.trigger.min_gap = k.min_gap;
    cfg.trigger
        .validate()
        .map_err(|e| EngineError::BadInput(format!("SFI trigger: {e}")))?;
    Ok(PolicySpec::Sfi {
        cfg: Box::new(cfg),
        enders: Vec::new(),
        newlines: Vec::new(),
        vocab_size: 0,
    })
}

/// `policy_spec` with explicit SFI knobs.
pub fn policy_spec_with(
    name: &str,
    budget: Option<f64>,
    sinks: usize,
    context: usize,
    sfi: &SfiKnobs,
) -> Result<PolicySpec, EngineError> {
    let need_budget = |p: &str| {
        budget.ok_or_else(|| EngineError::BadInput(format!("--policy {p} needs --kv-budget")))
    };
    match name {
        "full" => Ok(PolicySpec::Full),
        "sfi" => sfi_spec(budget_tokens(need_budget("sfi")?, context)?, sinks, sfi),
        "streaming" => {
            let b = budget_tokens(need_budget("streaming")?, context)?;
            if b <= sinks {
                return Err(EngineError::BadInput(format!(
                    "--kv-budget ({b} tokens) must exceed the {sinks} sink tokens"
                )));
            }
            Ok(PolicySpec::Streaming {
                sinks,
                recent: b - sinks,
            })
        }
        other => Err(EngineError::BadInput(format!(
            "unknown policy `{other}` (available: full, streaming, sfi)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_and_policy_names() {
        assert_eq!(budget_tokens(0.2, 8192).unwrap(), 1638);
        assert_eq!(budget_tokens(2048.0, 8192).unwrap(), 2048);
        assert!(budget_tokens(0.0, 10).is_err());
        assert!(budget_tokens(f64::NAN, 10).is_err());
        assert_eq!(
            policy_spec("streaming", Some(0.25), 4, 1024).unwrap(),
            PolicySpec::Streaming {
                sinks: 4,
                recent: 252
            }
        );
        assert!(policy_spec("streaming", None, 4, 1024).is_err());
        assert!(policy_spec("streaming", Some(3.0), 4, 1024).is_err());
        assert!(policy_spec("h3o", None, 4, 1024)
            .unwrap_err()
            .to_string()
            .contains("h3o"));
    }
}
