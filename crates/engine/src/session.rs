//! `Session`: one sequence being decoded — the model, its preallocated KV store (f32 or f16),
//! scratch buffers and the logits of the last step. Prefill runs in chunks; decode one token.
use half::f16;
use slowfast_kv::sfi::memory::{SfiConfig, SfiPolicy};
pub use slowfast_kv::sfi::selector::SelectorConfig;
use slowfast_kv::sfi::selector::SelectorError;
use slowfast_kv::sfi::trigger::TriggerConfig;
pub use slowfast_kv::sfi::trigger::TriggerKind;
use slowfast_kv::{
    CacheElem, E4m3, FullPolicy, H2oPolicy, KvPolicy, KvStore, OracleConfig, OraclePolicy,
    PolicyStats, QuestPolicy, SnapKvConfig, SnapKvPolicy, StreamingPolicy,
};
use slowfast_model::{LogitsRows, Model, Scratch, TspConfig};

use crate::EngineError;

/// Element type of the KV cache: f32 / f16 on the CPU (bf16 on the GPU for either of them), or
/// e4m3 with `Fp8` on both (one byte a value; the GPU calibrates power-of-two scales at load,
/// the CPU stores the values as they are, e4m3's range reaching 448).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Fp8,
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "fp8" => Ok(KvDtype::Fp8),
            _ => Err(format!("unknown KV dtype `{s}` (f32, f16 or fp8)")),
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
    /// H2O: `heavy` best-scored keys (accumulated attention) + `recent` newest, evicted as
    /// decoding proceeds.
    H2o { heavy: usize, recent: usize },
    /// SnapKV (or PyramidKV when `pyramid_beta` is set): compress once after prefill.
    SnapKv(SnapKvConfig),
    /// FastKV: token-selective propagation in prefill (`tsp_rate` of the prompt goes past
    /// `tsp_layer`, None = the global layer nearest the middle), then SnapKV-style retention
    /// of `cfg.capacity` tokens per layer for decode.
    FastKv {
        cfg: SnapKvConfig,
        tsp_rate: f64,
        tsp_layer: Option<usize>,
    },
    /// Quest: query-aware top pages per decode step over the full cache.
    Quest { budget: usize },
    /// Diagnostic only (eval): at each decode step the exact top `budget` keys of the current
    /// query's dense attention per kv head (`recent` = 0, "oracle"), or SFI's layout with an
    /// exact per-step selection (`sinks` + `recent` newest + the top of the rest,
    /// "oracle-sfi"). An upper bound for fixed-budget selection, not a deployable policy.
    Oracle {
        budget: usize,
        sinks: usize,
        recent: usize,
        /// Reselect every this many decode steps (1: each step).
        every: usize,
    },
    /// FastKV's token-selective prefill (`tsp_rate` of the prompt goes past `tsp_layer`,
    /// chosen by the last `window` rows' attention max-pooled with `kernel`), then `decode`'s
    /// policy over the KV it leaves, with no retention step: layers up to the TSP layer hold
    /// the whole prompt, later ones only the propagated tokens, at their positions. With
    /// `decode` = SFI this is `sfi+fastkv`.
    FastKvPrefill {
        decode: Box<PolicySpec>,
        tsp_rate: f64,
        tsp_layer: Option<usize>,
        window: usize,
        kernel: usize,
    },
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
            PolicySpec::H2o { .. } => "h2o",
            PolicySpec::SnapKv(c) => c.name,
            PolicySpec::FastKv { .. } => "fastkv",
            PolicySpec::Quest { .. } => "quest",
            PolicySpec::Oracle { recent: 0, .. } => "oracle",
            PolicySpec::Oracle { .. } => "oracle-sfi",
            PolicySpec::Sfi { .. } => "sfi",
            PolicySpec::FastKvPrefill { decode, .. } => match **decode {
                PolicySpec::Sfi { .. } => "sfi+fastkv",
                PolicySpec::Full => "full+fastkv",
                _ => "fastkv-prefill",
            },
        }
    }

    /// Tokens attended per kv head by the sparse steps (None for full KV).
    pub fn budget(&self) -> Option<usize> {
        match self {
            PolicySpec::Full => None,
            PolicySpec::Streaming { sinks, recent } => Some(sinks + recent),
            PolicySpec::H2o { heavy, recent } => Some(heavy + recent),
            PolicySpec::SnapKv(c) | PolicySpec::FastKv { cfg: c, .. } => Some(c.capacity),
            PolicySpec::Quest { budget } | PolicySpec::Oracle { budget, .. } => Some(*budget),
            PolicySpec::Sfi { cfg, .. } => Some(cfg.sinks + cfg.selected + cfg.recent),
            PolicySpec::FastKvPrefill { decode, .. } => decode.budget(),
        }
    }

    /// Attach the tokenizer's sentence-ender and newline tokens (SFI's trigger).
    pub fn with_vocab(mut self, tok: &slowfast_tokenizer::Tokenizer) -> Self {
        if let PolicySpec::FastKvPrefill { decode, .. } = &mut self {
            let d = std::mem::replace(&mut **decode, PolicySpec::Full);
            **decode = d.with_vocab(tok);
            return self;
        }
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

    /// The policy object; `scale` is the model's attention scale (the oracle's softmax).
    fn build<T: CacheElem>(&self, scale: f32) -> Result<Box<dyn KvPolicy<T>>, EngineError> {
        Ok(match self {
            PolicySpec::Full => Box::new(FullPolicy::new()),
            PolicySpec::Streaming { sinks, recent } => {
                Box::new(StreamingPolicy::new(*sinks, *recent))
            }
            PolicySpec::H2o { heavy, recent } => Box::new(
                H2oPolicy::new(*heavy, *recent)
                    .map_err(|e| EngineError::BadInput(format!("--policy h2o: {e}")))?,
            ),
            PolicySpec::SnapKv(c) | PolicySpec::FastKv { cfg: c, .. } => Box::new(
                SnapKvPolicy::new(c.clone())
                    .map_err(|e| EngineError::BadInput(format!("--policy {}: {e}", self.name())))?,
            ),
            PolicySpec::Quest { budget } => Box::new(QuestPolicy::new(*budget)),
            PolicySpec::Oracle {
                budget,
                sinks,
                recent,
                every,
            } => Box::new(
                OraclePolicy::<T>::new(OracleConfig {
                    budget: *budget,
                    sinks: *sinks,
                    recent: *recent,
                    scale,
                    every: *every,
                })
                .map_err(EngineError::BadInput)?,
            ),
            PolicySpec::Sfi {
                cfg,
                enders,
                newlines,
                vocab_size,
            } => {
                self.check_device(crate::Device::Cpu)?;
                Box::new(
                    SfiPolicy::<T>::new((**cfg).clone(), enders, newlines, (*vocab_size).max(1))
                        .map_err(|e| EngineError::BadInput(format!("SFI trigger: {e}")))?,
                )
            }
            PolicySpec::FastKvPrefill { decode, .. } => decode.build(scale)?,
        })
    }

    /// Refuses what this policy's settings cannot do on `device` (SFI's asynchronous refresh
    /// exists on the GPU only).
    pub fn check_device(&self, device: crate::Device) -> Result<(), EngineError> {
        match self {
            PolicySpec::Sfi { cfg, .. } if cfg.async_lag > 0 && device == crate::Device::Cpu => {
                Err(EngineError::BadInput(format!(
                    "--sfi-async-lag {} needs --device cuda: the CPU refreshes SFI's memory within the slow step (lag 0)",
                    cfg.async_lag
                )))
            }
            PolicySpec::FastKvPrefill { decode, .. } => decode.check_device(device),
            _ => Ok(()),
        }
    }
}

pub(crate) enum Cache {
    F32(KvStore<f32>, Box<dyn KvPolicy<f32>>),
    F16(KvStore<f16>, Box<dyn KvPolicy<f16>>),
    /// fp8 KV (`--kv-dtype fp8`): one byte a value.
    E4m3(KvStore<E4m3>, Box<dyn KvPolicy<E4m3>>),
}

/// A `match` over a [`Cache`] (a place or a reference to one) with one body for every element
/// type: `each_cache!(&self.cache, (c, p) => c.len())` binds the store and the policy of
/// whichever variant it is.
macro_rules! each_cache {
    ($cache:expr, ($c:pat, $p:pat) => $body:expr) => {
        match $cache {
            Cache::F32($c, $p) => $body,
            Cache::F16($c, $p) => $body,
            Cache::E4m3($c, $p) => $body,
        }
    };
}
pub(crate) use each_cache;

/// A [`Cache`] of the same element type as `$cache`, from the store and policy its body makes
/// of `$cache`'s: `map_cache!(&self.cache, (c, p) => (c.clone(), p.try_clone()?))`.
macro_rules! map_cache {
    ($cache:expr, ($c:pat, $p:pat) => ($store:expr, $policy:expr)) => {
        match $cache {
            Cache::F32($c, $p) => Cache::F32($store, $policy),
            Cache::F16($c, $p) => Cache::F16($store, $policy),
            Cache::E4m3($c, $p) => Cache::E4m3($store, $policy),
        }
    };
}

/// What a session asks of its policy token by token, whatever the cache's element type.
trait PolicyView {
    fn on_token(&mut self, token: u32);
    fn slow_now(&self) -> bool;
    fn rider(&self) -> Option<&slowfast_kv::sfi::trigger::Trigger>;
    fn ride(&mut self);
}

impl<T: CacheElem> PolicyView for Box<dyn KvPolicy<T>> {
    fn on_token(&mut self, token: u32) {
        (**self).on_token(token)
    }
    fn slow_now(&self) -> bool {
        (**self).slow_now()
    }
    fn rider(&self) -> Option<&slowfast_kv::sfi::trigger::Trigger> {
        (**self).rider()
    }
    fn ride(&mut self) {
        (**self).ride()
    }
}

/// Default prefill chunk (tokens per forward call).
pub const DEFAULT_CHUNK: usize = 512;

pub struct Session<'m> {
    pub model: &'m Model,
    /// FastKV prefill: (fraction of the prompt propagated, TSP layer, window, kernel).
    pub(crate) tsp: Option<TspRule>,
    pub(crate) cache: Cache,
    pub(crate) scratch: Scratch,
    pub(crate) chunk: usize,
    pub(crate) logits: Vec<f32>,
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
            KvDtype::F32 => Cache::F32(
                model.new_cache(max_tokens, chunk),
                policy.build(model.cfg.attn_scale)?,
            ),
            KvDtype::F16 => Cache::F16(
                model.new_cache(max_tokens, chunk),
                policy.build(model.cfg.attn_scale)?,
            ),
            KvDtype::Fp8 => Cache::E4m3(
                model.new_cache(max_tokens, chunk),
                policy.build(model.cfg.attn_scale)?,
            ),
        };
        let tsp = tsp_of(policy, model);
        Ok(Session {
            model,
            tsp,
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
        let scale = self.model.cfg.attn_scale;
        let cache = map_cache!(&self.cache, (c, _) => (c.clone(), policy.build(scale)?));
        Ok(self.with_cache(cache))
    }

    /// This session's model, chunk and last logits over `cache` (a copy of its own). The
    /// prefill is done: a copy never runs FastKV's propagation.
    fn with_cache(&self, cache: Cache) -> Session<'m> {
        Session {
            model: self.model,
            cache,
            scratch: Scratch::default(),
            chunk: self.chunk,
            logits: self.logits.clone(),
            tsp: None,
        }
    }

    /// An exact copy of this session: cache, position, last logits and the policy's whole
    /// state (an SFI memory bootstrapped in prefill included), for the policies that can give
    /// one (full, streaming, sfi); `fork` starts the others afresh.
    pub fn try_clone(&self) -> Result<Session<'m>, EngineError> {
        let copy = |name: &str| {
            EngineError::BadInput(format!(
                "the {name} policy's state cannot be copied: fork the session instead"
            ))
        };
        if self.tsp.is_some() {
            return Err(copy("fastkv"));
        }
        let cache = map_cache!(&self.cache, (c, p) => (
            c.clone(),
            p.try_clone().ok_or_else(|| copy(p.name()))?
        ));
        Ok(self.with_cache(cache))
    }

    /// The model this session runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Tokens in the cache.
    pub fn pos(&self) -> usize {
        each_cache!(&self.cache, (c, _) => c.len())
    }

    /// What the KV policy holds on `layer` now, per kv head, by role (`KvPolicy::held`).
    pub fn held(&self, layer: usize) -> Vec<slowfast_kv::Held> {
        each_cache!(&self.cache, (c, p) => p.held(layer, c))
    }

    pub fn capacity(&self) -> usize {
        each_cache!(&self.cache, (c, _) => c.capacity())
    }

    /// Bytes of KV cache allocated.
    pub fn kv_bytes(&self) -> usize {
        each_cache!(&self.cache, (c, _) => c.nbytes())
    }

    /// Keep the global layers' KV in blocks of `block` tokens (a server's, to share its prefix
    /// cache's blocks): only before anything is written.
    pub fn set_kv_block(&mut self, block: usize) -> Result<(), EngineError> {
        each_cache!(&mut self.cache, (c, _) => c.set_block(block))
            .map_err(|e| EngineError::BadInput(e.to_string()))
    }

    /// KV bytes once positions `[0, len)` are written (the global layers grow on demand).
    pub fn kv_bytes_at(&self, len: usize) -> usize {
        each_cache!(&self.cache, (c, _) => c.nbytes_at(len))
    }

    /// The KV policy's counters (slow/fast steps, attended tokens).
    pub fn policy_stats(&self) -> PolicyStats {
        each_cache!(&self.cache, (_, p) => p.stats())
    }

    /// Whether a prefix cache may stand in for this session's prefill of a prompt's leading
    /// chunks (see `KvPolicy::shares_prefix`; never under FastKV's token-selective prefill).
    pub fn shares_prefix(&self) -> bool {
        self.tsp.is_none() && each_cache!(&self.cache, (_, p) => p.shares_prefix())
    }

    pub fn policy_name(&self) -> &'static str {
        each_cache!(&self.cache, (_, p) => p.name())
    }

    /// Run `tokens` at the current position; returns logits of the requested rows.
    pub fn forward(&mut self, tokens: &[u32], rows: LogitsRows) -> Result<&[f32], EngineError> {
        let pos = self.pos();
        let (m, s, l) = (self.model, &mut self.scratch, &mut self.logits);
        each_cache!(&mut self.cache, (c, p) => {
            m.forward_with(tokens, pos, c, p.as_mut(), s, rows, l)?
        });
        Ok(&self.logits)
    }

    /// Prefill `tokens` in chunks; returns the last row's logits. `progress(done, total)` is
    /// called after each chunk.
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError> {
        let plan = self.prefill_plan(tokens.len());
        for (i, &(_, b)) in plan.iter().enumerate() {
            self.prefill_part(tokens, &plan, i)?;
            progress(b, tokens.len());
        }
        Ok(&self.logits)
    }

    /// The forward calls `prefill` makes for a prompt of `n` tokens, as `[a, b)` bounds into
    /// it: chunks of at most `chunk` tokens (the last one at least the policy's observation
    /// window), or one part for FastKV's token-selective prefill, which runs whole.
    pub fn prefill_plan(&self, n: usize) -> Vec<(usize, usize)> {
        if self.tsp.is_some() && self.pos() == 0 {
            return vec![(0, n)];
        }
        chunk_bounds(n, self.chunk, self.prefill_tail())
    }

    fn prefill_tail(&self) -> usize {
        each_cache!(&self.cache, (_, p) => p.prefill_tail())
    }

    /// Runs part `i` of `plan` (from `prefill_plan(tokens.len())`, parts in order); the last
    /// part writes the last row's logits and ends the prefill (the policy's end of prefill:
    /// compression, SFI's bootstrap). A server interleaves these with other sequences' steps.
    pub fn prefill_part(
        &mut self,
        tokens: &[u32],
        plan: &[(usize, usize)],
        i: usize,
    ) -> Result<(), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::BadInput(
                "empty prompt: nothing to prefill".into(),
            ));
        }
        let &(a, b) = plan.get(i).ok_or_else(|| {
            EngineError::BadInput(format!("prefill part {i} of a {}-part plan", plan.len()))
        })?;
        if let (Some(rule), 0) = (self.tsp, self.pos()) {
            let n = tokens.len();
            let bounds = chunk_bounds(n, self.chunk, self.prefill_tail());
            let tsp = rule.config(n);
            let (m, s, l) = (self.model, &mut self.scratch, &mut self.logits);
            each_cache!(&mut self.cache, (c, p) => {
                fastkv_prefill(m, tokens, c, p.as_mut(), s, &bounds, &tsp, l)?
            });
        } else {
            let rows = if i + 1 == plan.len() {
                LogitsRows::Last
            } else {
                LogitsRows::None
            };
            self.forward(&tokens[a..b], rows)?;
        }
        if i + 1 < plan.len() {
            return Ok(());
        }
        let r = each_cache!(&mut self.cache, (c, p) => p.end_prefill(c));
        r.map_err(|e| {
            EngineError::BadInput(format!("end of prefill ({}): {e}", self.policy_name()))
        })
    }

    /// Benchmarks only: fill positions `0..n` of an empty cache with pseudo-random keys and
    /// values (uniform in [-1, 1), reproducible from `seed`) without running the model, so a
    /// decode benchmark at a long context need not pay for a full prefill (decode speed does
    /// not depend on the values). The policy sees none of these positions; a real prefill
    /// after them (e.g. the prompt's last chunk) bootstraps it as usual.
    pub fn fill_synthetic(&mut self, n: usize, seed: u64) -> Result<(), EngineError> {
        each_cache!(&mut self.cache, (c, _) => fill_store(c, n, seed))
    }

    /// Decode one token; returns its next-token logits.
    pub fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.policy_mut().on_token(token);
        self.forward_step(token)
    }

    /// One decode step of several sessions together, as one step of a GPU batch takes them
    /// (riding, `slowfast_kv::sfi::trigger::riders`): each policy sees its token, then, when
    /// some session's step is slow by its own trigger, sessions that may ride join it, up to
    /// `room` slow steps in all (the GPU's `CAPTURE_ROWS`; 0: none ride, so each session steps
    /// exactly as `step` would). The CPU runs every slow step that fired, past `room` too,
    /// where the GPU would make the ones past its score rows wait a step. Returns which
    /// sessions fired a slow step and the indices of those that rode; each one's logits are in
    /// its `logits()`.
    pub fn step_together(
        sessions: &mut [Session<'_>],
        tokens: &[u32],
        room: usize,
    ) -> Result<(Vec<bool>, Vec<usize>), EngineError> {
        if sessions.len() != tokens.len() {
            return Err(EngineError::BadInput(format!(
                "step_together: {} sessions but {} tokens",
                sessions.len(),
                tokens.len()
            )));
        }
        for (s, &t) in sessions.iter_mut().zip(tokens) {
            s.policy_mut().on_token(t);
        }
        let slow: Vec<bool> = sessions.iter().map(|s| s.policy().slow_now()).collect();
        let left = room.saturating_sub(slow.iter().filter(|&&b| b).count());
        let rode = {
            let able: Vec<_> = sessions.iter().map(|s| s.policy().rider()).collect();
            slowfast_kv::sfi::trigger::riders(&able, &slow, left)
        };
        for &i in &rode {
            sessions[i].policy_mut().ride();
        }
        for (s, &t) in sessions.iter_mut().zip(tokens) {
            s.forward_step(t)?;
        }
        Ok((slow, rode))
    }

    /// The policy, whatever the cache's element type.
    fn policy(&self) -> &dyn PolicyView {
        each_cache!(&self.cache, (_, p) => p)
    }

    fn policy_mut(&mut self) -> &mut dyn PolicyView {
        each_cache!(&mut self.cache, (_, p) => p)
    }

    /// The decode step after the policy saw its token: forward, then the policy's end of step.
    fn forward_step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.forward(&[token], LogitsRows::Last)?;
        let r = each_cache!(&mut self.cache, (c, p) => p.end_step(c));
        r.map_err(|e| EngineError::BadInput(format!("decode step ({}): {e}", self.policy_name())))?;
        Ok(&self.logits)
    }

    /// Logits of the last forward call.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Drop positions `>= len` from the cache (a draft model's rejected tokens); the policy is
    /// not told, so this is for full KV sessions.
    pub fn truncate(&mut self, len: usize) {
        each_cache!(&mut self.cache, (c, _) => c.truncate(len))
    }

    /// Speculative decoding, self-drafting: the decode steps from here on are drafts of the
    /// session's sparse policy, undone by `end_draft`. Errors for policies that cannot draft.
    pub fn begin_draft(&mut self) -> Result<(), EngineError> {
        let r = each_cache!(&mut self.cache, (_, p) => p.begin_draft());
        r.map_err(EngineError::BadInput)
    }

    /// Most tokens one `verify` can take (sliding-window rings bound it; see
    /// `Model::verify_rows_max`).
    pub fn verify_rows_max(&self) -> usize {
        each_cache!(&self.cache, (c, _) => self.model.verify_rows_max(c))
    }

    /// End of the draft steps: the cache goes back to `len` positions (the drafted keys go).
    pub fn end_draft(&mut self, len: usize) {
        each_cache!(&mut self.cache, (c, p) => {
                c.truncate(len);
                p.end_draft(len)
        })
    }

    /// A verification forward: `tokens` at the current position in one pass over the weights,
    /// every row's logits (`[tokens.len(), vocab]`), each bit-equal to a dense decode step at
    /// its position (the policy reads densely until `end_verify`). Always follow it with
    /// `end_verify`.
    pub fn verify(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        let pos = self.pos();
        let (m, s, l) = (self.model, &mut self.scratch, &mut self.logits);
        let scale = m.cfg.attn_scale;
        each_cache!(&mut self.cache, (c, p) => {
                p.begin_verify(pos, scale);
                m.verify_forward(tokens, pos, c, p.as_mut(), s, l)?
        });
        Ok(&self.logits)
    }

    /// After a verification: the cache goes back to `len` positions, `fed` being the tokens
    /// at `len - fed.len() .. len` it kept; the policy may refresh its sparse memory from the
    /// verification's dense attention (always with `refresh`, else when its trigger fires).
    pub fn end_verify(&mut self, fed: &[u32], len: usize, refresh: bool) {
        each_cache!(&mut self.cache, (c, p) => {
                c.truncate(len);
                p.end_verify(fed, len, refresh, c)
        })
    }
}

/// FastKV's token-selective propagation under a policy, for one model: `rate` of a prompt
/// goes past `layer`, scored by the last `window` rows max-pooled with `kernel`. One rule for
/// both devices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TspRule {
    rate: f64,
    layer: usize,
    window: usize,
    kernel: usize,
}

impl TspRule {
    /// The propagation of a prompt of `n` tokens: `rate` of them, at least the window.
    pub(crate) fn config(&self, n: usize) -> TspConfig {
        TspConfig {
            layer: self.layer,
            len: ((n as f64 * self.rate).floor() as usize).clamp(self.window.min(n), n),
            window: self.window,
            kernel: self.kernel,
        }
    }
}

/// FastKV's propagation under `policy` for `model` (the default TSP layer: the global layer
/// nearest the middle), or None for a policy without it.
pub(crate) fn tsp_of(policy: &PolicySpec, model: &Model) -> Option<TspRule> {
    let (rate, layer, window, kernel) = match policy {
        PolicySpec::FastKv {
            cfg,
            tsp_rate,
            tsp_layer,
        } => (*tsp_rate, *tsp_layer, cfg.window, cfg.kernel),
        PolicySpec::FastKvPrefill {
            tsp_rate,
            tsp_layer,
            window,
            kernel,
            ..
        } => (*tsp_rate, *tsp_layer, *window, *kernel),
        _ => return None,
    };
    Some(TspRule {
        rate,
        layer: layer.unwrap_or_else(|| model.default_tsp_layer()),
        window,
        kernel,
    })
}

/// FastKV's token-selective prefill into an empty `c`, then the layers it left holding only
/// the propagated tokens (compacted, in a full-size allocation) shrunk to what they hold plus
/// the room decoding can still use, so a policy without a retention step (`sfi+fastkv`) frees
/// the dropped rows too. (FastKV's own retention compacts every layer again at end_prefill.)
#[allow(clippy::too_many_arguments)]
fn fastkv_prefill<T: CacheElem>(
    m: &Model,
    tokens: &[u32],
    c: &mut KvStore<T>,
    p: &mut dyn KvPolicy<T>,
    s: &mut Scratch,
    bounds: &[(usize, usize)],
    tsp: &TspConfig,
    logits: &mut Vec<f32>,
) -> Result<(), EngineError> {
    let room = c.capacity().saturating_sub(tokens.len());
    m.prefill_fastkv(tokens, c, p, s, bounds, tsp, logits)?;
    for layer in 0..c.n_layers() {
        if c.layer(layer).is_compact() && !c.layer(layer).spec.ring {
            c.shrink(layer, room)
                .map_err(|e| EngineError::BadInput(format!("FastKV prefill: {e}")))?;
        }
    }
    Ok(())
}

fn fill_store<T: CacheElem>(c: &mut KvStore<T>, n: usize, seed: u64) -> Result<(), EngineError> {
    if !c.is_empty() {
        return Err(EngineError::BadInput(
            "synthetic KV fill needs an empty cache".into(),
        ));
    }
    if n > c.capacity() {
        return Err(EngineError::BadInput(format!(
            "synthetic KV fill of {n} tokens exceeds the cache capacity of {}",
            c.capacity()
        )));
    }
    let width = c.n_kv_heads * c.head_dim;
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    for layer in 0..c.n_layers() {
        // Ring (sliding-window) layers take chunks no longer than their capacity.
        let step = c.layer(layer).limit().clamp(1, 512);
        let mut k = vec![0.0f32; step * width];
        let mut v = vec![0.0f32; step * width];
        let mut p = 0;
        while p < n {
            let m = step.min(n - p);
            k[..m * width].iter_mut().for_each(|x| *x = next());
            v[..m * width].iter_mut().for_each(|x| *x = next());
            c.write(layer, p, &k[..m * width], &v[..m * width])
                .map_err(|e| EngineError::BadInput(format!("synthetic KV fill: {e}")))?;
            p += m;
        }
    }
    c.set_len(n);
    Ok(())
}

/// Prefill chunks `[a, b)` of at most `chunk` tokens over `n` tokens; when the policy watches
/// the last `tail` prompt rows (and `tail <= chunk`), the last chunk is made at least that
/// long by shortening the one before it.
pub fn chunk_bounds(n: usize, chunk: usize, tail: usize) -> Vec<(usize, usize)> {
    let chunk = chunk.max(1);
    let mut v: Vec<(usize, usize)> = (0..n)
        .step_by(chunk)
        .map(|a| (a, (a + chunk).min(n)))
        .collect();
    let tail = tail.min(chunk).min(n);
    let k = v.len();
    if k >= 2 && v[k - 1].1 - v[k - 1].0 < tail {
        let start = n - tail;
        v[k - 2].1 = start;
        v[k - 1].0 = start;
        if v[k - 2].0 == start {
            v.remove(k - 2);
        }
    }
    v
}

/// Parse `--contexts` ("2k,8k,32768") into token counts; `k` is 1024. Counts that overflow
/// `usize` are errors.
pub fn parse_contexts(s: &str) -> Result<Vec<usize>, EngineError> {
    s.split(',')
        .map(|t| {
            let t = t.trim().to_ascii_lowercase();
            let (num, mul) = match (t.strip_suffix('k'), t.strip_suffix('m')) {
                (Some(n), _) => (n, 1024),
                (_, Some(n)) => (n, 1 << 20),
                _ => (t.as_str(), 1),
            };
            match num.parse::<usize>().ok().and_then(|v| v.checked_mul(mul)) {
                Some(v) if v > 0 => Ok(v),
                _ => Err(EngineError::BadInput(format!(
                    "--contexts: `{t}` is not a positive token count (e.g. 8k, 8192 or 1m)"
                ))),
            }
        })
        .collect()
}

/// Parse a comma-separated list of numbers for `flag`, naming the bad item on error.
pub fn parse_list<T: std::str::FromStr>(flag: &str, s: &str) -> Result<Vec<T>, EngineError> {
    s.split(',')
        .map(|x| {
            x.trim().parse().map_err(|_| {
                EngineError::BadInput(format!("{flag}: `{}` is not a valid number", x.trim()))
            })
        })
        .collect()
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
    /// Prefill query rows whose dense logits bootstrap the first selection.
    pub bootstrap_rows: usize,
    /// The Selector's knobs (methods.md §1.4).
    pub selector: SelectorConfig,
    /// Diagnostic oracles (`oracle`, `oracle-sfi`): reselect every this many decode steps.
    pub oracle_every: usize,
    /// Decode steps before a slow step's new memory is read (GPU only; 0: the next step).
    pub async_lag: usize,
    /// Candidate pool of the per-step re-rank, a multiple of the selected tokens (1: off).
    pub pool: f64,
    /// The drift trigger's threshold (0: off; `SfiConfig::drift`).
    pub drift: f64,
    /// The cheaper slow step's candidate pages, a multiple of the selected tokens (0: off;
    /// `SfiConfig::candidates`).
    pub candidates: f64,
    /// Sequences past their min gap join a slow step another one of the batch fires
    /// (`TriggerConfig::ride`; the GPU only has room for it).
    pub ride: bool,
}

impl Default for SfiKnobs {
    fn default() -> Self {
        // The trigger's and the policy's own defaults (crates/kv); the recent window, the
        // cheaper slow step and the Selector's pooling are slowfast's, here.
        let (t, c) = (TriggerConfig::default(), SfiConfig::new(0, 0, 0));
        SfiKnobs {
            recent: 256,
            refresh_interval: t.refresh_interval,
            min_gap: t.min_gap,
            trigger: t.kind.name().into(),
            bootstrap_rows: c.bootstrap_rows,
            oracle_every: 1,
            async_lag: c.async_lag,
            pool: c.pool.into(),
            drift: c.drift.into(),
            // slowfast's default: the cheaper slow step (pages of candidates, F = 2) on the
            // trigger's schedule. As fast or faster on the GPU at batch 1-6, 32K-128K (1.01-1.20x
            // today's dense slow steps, runs 138-139), the same RULER and passkey and no worse NLL
            // on the CPU (docs/results.md, "A cheaper slow step"); `SfiConfig::new` keeps the
            // paper's dense slow step.
            candidates: 2.0,
            ride: t.ride,
            selector: SelectorConfig {
                // slowfast's default: span pooling instead of the paper's soft-NMS (window
                // 32, strength 1), which drops the neighbours of a peak (docs/results.md).
                soft_alpha: -1.0,
                nms_window: 8,
                ..SelectorConfig::default()
            },
        }
    }
}

/// Names accepted by `--policy` / `--policies`.
pub const POLICIES: &str =
    "full, streaming, h2o, snapkv, pyramidkv, quest, fastkv, sfi, sfi+fastkv, oracle, oracle-sfi";

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
    // Saturating: `--sinks` / `kv_policy.sinks` may be any usize (cli_parsers found the
    // overflow panic).
    if b <= sinks.saturating_add(k.recent) {
        return Err(EngineError::BadInput(format!(
            "--kv-budget ({b} tokens) must exceed --sinks + --sfi-recent ({})",
            sinks.saturating_add(k.recent)
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
    cfg.trigger.ride = k.ride;
    if k.bootstrap_rows == 0 {
        return Err(EngineError::BadInput(
            "--sfi-bootstrap-rows must be at least 1".into(),
        ));
    }
    cfg.bootstrap_rows = k.bootstrap_rows;
    cfg.async_lag = k.async_lag;
    if !(k.pool.is_finite() && (1.0..=16.0).contains(&k.pool)) {
        return Err(EngineError::BadInput(format!(
            "--sfi-pool {} is invalid (expected 1 to 16: the candidate pool as a multiple of the selected tokens)",
            k.pool
        )));
    }
    cfg.pool = k.pool as f32;
    if !(k.drift.is_finite() && (0.0..=1.0).contains(&k.drift)) {
        return Err(EngineError::BadInput(format!(
            "--sfi-drift {} is invalid (expected 0 to 1: the share of the refresh's attention on the selected keys below which a fast step fires a slow one; 0 turns it off)",
            k.drift
        )));
    }
    if k.drift > 0.0 && k.pool > 1.0 {
        return Err(EngineError::BadInput(format!(
            "--sfi-drift {} and --sfi-pool {} do not combine yet: the re-rank changes what a fast step reads from step to step, so its share has no fixed reference",
            k.drift, k.pool
        )));
    }
    cfg.drift = k.drift as f32;
    if !(k.candidates.is_finite() && (k.candidates == 0.0 || (1.0..=64.0).contains(&k.candidates)))
    {
        return Err(EngineError::BadInput(format!(
            "--sfi-candidates {} is invalid (expected 0 to turn it off, or 1 to 64: the pages a slow step reads, as a multiple of the selected tokens)",
            k.candidates
        )));
    }
    cfg.candidates = k.candidates as f32;
    k.selector.validate().map_err(|e| match e {
        SelectorError::Config {
            field,
            value,
            expected,
        } => EngineError::BadInput(format!(
            "--sfi-{} = {value} is invalid (expected {expected})",
            field.replace('_', "-")
        )),
        e => EngineError::BadInput(format!("SFI selector: {e}")),
    })?;
    cfg.selector = k.selector;
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

/// FastKV knobs from the command line.
#[derive(Debug, Clone)]
pub struct FastKvKnobs {
    /// Fraction of the prompt propagated past the TSP layer (sets the prefill cost).
    pub tsp_rate: f64,
    /// TSP layer (None: the global layer nearest the middle of the model).
    pub tsp_layer: Option<usize>,
}

impl Default for FastKvKnobs {
    fn default() -> Self {
        FastKvKnobs {
            tsp_rate: 0.2,
            tsp_layer: None,
        }
    }
}

fn check_tsp_rate(r: f64) -> Result<f64, EngineError> {
    if r > 0.0 && r <= 1.0 {
        Ok(r)
    } else {
        Err(EngineError::BadInput(format!(
            "--fastkv-tsp-rate must be in (0, 1], got {r}"
        )))
    }
}

/// `policy_spec` with explicit SFI knobs (FastKV at its defaults).
pub fn policy_spec_with(
    name: &str,
    budget: Option<f64>,
    sinks: usize,
    context: usize,
    sfi: &SfiKnobs,
) -> Result<PolicySpec, EngineError> {
    policy_spec_knobs(name, budget, sinks, context, sfi, &FastKvKnobs::default())
}

/// `policy_spec` with explicit SFI and FastKV knobs.
pub fn policy_spec_knobs(
    name: &str,
    budget: Option<f64>,
    sinks: usize,
    context: usize,
    sfi: &SfiKnobs,
    fastkv: &FastKvKnobs,
) -> Result<PolicySpec, EngineError> {
    let need_budget = |p: &str| {
        budget.ok_or_else(|| EngineError::BadInput(format!("--policy {p} needs --kv-budget")))
    };
    match name {
        "full" => Ok(PolicySpec::Full),
        "sfi" => sfi_spec(budget_tokens(need_budget("sfi")?, context)?, sinks, sfi),
        "sfi+fastkv" => {
            let b = budget_tokens(need_budget("sfi+fastkv")?, context)?;
            let decode = sfi_spec(b, sinks, sfi)?;
            let tsp = SnapKvConfig::fastkv(b);
            Ok(PolicySpec::FastKvPrefill {
                decode: Box::new(decode),
                tsp_rate: check_tsp_rate(fastkv.tsp_rate)?,
                tsp_layer: fastkv.tsp_layer,
                window: tsp.window,
                kernel: tsp.kernel,
            })
        }
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
        "h2o" => {
            let b = budget_tokens(need_budget("h2o")?, context)?;
            if b < 2 {
                return Err(EngineError::BadInput(format!(
                    "--policy h2o: --kv-budget ({b} tokens) must be at least 2 (heavy hitters + recent window)"
                )));
            }
            Ok(PolicySpec::H2o {
                heavy: b / 2,
                recent: b - b / 2,
            })
        }
        "snapkv" | "pyramidkv" => {
            let b = budget_tokens(need_budget(name)?, context)?;
            let cfg = if name == "snapkv" {
                SnapKvConfig::snapkv(b)
            } else {
                SnapKvConfig::pyramidkv(b)
            };
            if b <= cfg.window {
                return Err(EngineError::BadInput(format!(
                    "--policy {name}: --kv-budget ({b} tokens) must exceed the observation window of {} tokens",
                    cfg.window
                )));
            }
            Ok(PolicySpec::SnapKv(cfg))
        }
        "fastkv" => {
            let b = budget_tokens(need_budget("fastkv")?, context)?;
            let cfg = SnapKvConfig::fastkv(b);
            if b <= cfg.window {
                return Err(EngineError::BadInput(format!(
                    "--policy fastkv: --kv-budget ({b} tokens) must exceed the observation window of {} tokens",
                    cfg.window
                )));
            }
            Ok(PolicySpec::FastKv {
                cfg,
                tsp_rate: check_tsp_rate(fastkv.tsp_rate)?,
                tsp_layer: fastkv.tsp_layer,
            })
        }
        "quest" => Ok(PolicySpec::Quest {
            budget: budget_tokens(need_budget("quest")?, context)?,
        }),
        "oracle" => Ok(PolicySpec::Oracle {
            budget: budget_tokens(need_budget("oracle")?, context)?,
            sinks: 0,
            recent: 0,
            every: sfi.oracle_every.max(1),
        }),
        "oracle-sfi" => {
            let b = budget_tokens(need_budget("oracle-sfi")?, context)?;
            if b <= sinks.saturating_add(sfi.recent) || sfi.recent == 0 {
                return Err(EngineError::BadInput(format!(
                    "--policy oracle-sfi: --kv-budget ({b} tokens) must exceed --sinks + --sfi-recent ({}), and --sfi-recent must be positive",
                    sinks.saturating_add(sfi.recent)
                )));
            }
            Ok(PolicySpec::Oracle {
                budget: b,
                sinks,
                recent: sfi.recent,
                every: sfi.oracle_every.max(1),
            })
        }
        other => Err(EngineError::BadInput(format!(
            "unknown policy `{other}` (available: {POLICIES})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copied session (SFI's memory bootstrapped in its prefill, the trigger, the counters)
    /// continues exactly as the original: the same logits at every step, bit for bit, over
    /// steps that refresh the memory; a policy without a copy is refused by name.
    #[test]
    fn try_clone_continues_exactly() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/hf/qwen3");
        let m = crate::load(dir.to_str().unwrap(), &mut |_| {}).unwrap();
        let prompt: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 500 + 6).collect();
        let knobs = SfiKnobs {
            recent: 16,
            min_gap: 2,
            refresh_interval: 8,
            ..Default::default()
        };
        let sfi = policy_spec_with("sfi", Some(40.0), 2, 400, &knobs).unwrap();
        let streaming = policy_spec("streaming", Some(40.0), 2, 400).unwrap();
        for (spec, kv) in [
            (&sfi, KvDtype::F32),
            (&sfi, KvDtype::F16),
            (&streaming, KvDtype::F16),
        ] {
            let mut a = Session::try_with_policy(&m.model, 400, kv, 64, spec).unwrap();
            a.prefill(&prompt, &mut |_, _| {}).unwrap();
            let mut b = a.try_clone().unwrap();
            assert_eq!(b.pos(), a.pos());
            assert_eq!(b.logits(), a.logits());
            for i in 0..60u32 {
                let t = (i * 53 + 7) % 500 + 6;
                let la = a.step(t).unwrap().to_vec();
                assert_eq!(b.step(t).unwrap(), &la[..], "{} step {i}", spec.name());
            }
            assert_eq!(a.policy_stats(), b.policy_stats());
            if spec.name() == "sfi" {
                assert!(a.policy_stats().slow_steps > 1, "{:?}", a.policy_stats());
            }
        }
        let h2o = policy_spec("h2o", Some(40.0), 2, 400).unwrap();
        let mut s = Session::try_with_policy(&m.model, 400, KvDtype::F32, 64, &h2o).unwrap();
        s.prefill(&prompt, &mut |_, _| {}).unwrap();
        let e = s.try_clone().err().expect("h2o has no copy").to_string();
        assert!(e.contains("h2o"), "{e}");
    }

    #[test]
    fn parse_contexts_refuses_overflow() {
        // Found reviewing the parsers for cli_parsers: `v * 1024` overflowed (debug panic).
        assert_eq!(parse_contexts("2k,8K, 100").unwrap(), vec![2048, 8192, 100]);
        assert_eq!(parse_contexts("1m,2M").unwrap(), vec![1 << 20, 2 << 20]);
        assert!(parse_contexts("18446744073709551615k").is_err());
        assert!(parse_contexts(&format!("{}k", usize::MAX / 1024 + 1)).is_err());
        assert_eq!(
            parse_contexts(&format!("{}k", usize::MAX / 1024)).unwrap(),
            vec![usize::MAX / 1024 * 1024]
        );
        assert!(parse_contexts("0,1").is_err());
        assert!(parse_contexts("").is_err());
        assert_eq!(parse_list::<f64>("--d", "0.5, 1").unwrap(), vec![0.5, 1.0]);
        assert!(parse_list::<usize>("--d", "1,x").is_err());
    }

    #[test]
    fn huge_sinks_are_an_error_not_an_overflow() {
        // Found by the cli_parsers fuzz target: `sinks + recent` overflowed (debug panic; the
        // server passes `kv_policy.sinks` from the request body here).
        for name in ["sfi", "sfi+fastkv", "oracle-sfi"] {
            assert!(
                policy_spec(name, Some(5270.0), usize::MAX, 8192).is_err(),
                "{name}"
            );
        }
        assert!(policy_spec("streaming", Some(5270.0), usize::MAX, 8192).is_err());
    }

    #[test]
    fn last_prefill_chunk_covers_the_observation_window() {
        assert_eq!(chunk_bounds(10, 4, 0), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(chunk_bounds(10, 4, 3), vec![(0, 4), (4, 7), (7, 10)]);
        assert_eq!(chunk_bounds(9, 4, 4), vec![(0, 4), (4, 5), (5, 9)]);
        assert_eq!(chunk_bounds(5, 4, 4), vec![(0, 1), (1, 5)]);
        assert_eq!(chunk_bounds(3, 4, 32), vec![(0, 3)]);
        // A window longer than a chunk is capped at the chunk (sliding rings hold window + chunk).
        assert_eq!(chunk_bounds(9, 4, 32), vec![(0, 4), (4, 5), (5, 9)]);
    }

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
        assert_eq!(
            policy_spec("h2o", Some(0.25), 4, 1024).unwrap(),
            PolicySpec::H2o {
                heavy: 128,
                recent: 128
            }
        );
        assert!(policy_spec("snapkv", Some(32.0), 4, 1024).is_err());
        assert_eq!(
            policy_spec("pyramidkv", Some(64.0), 4, 1024)
                .unwrap()
                .name(),
            "pyramidkv"
        );
        assert!(policy_spec("quest", None, 4, 1024).is_err());
        // The diagnostic oracles: exact top-k (no layout), or SFI's layout (sinks + recent).
        assert_eq!(
            policy_spec("oracle", Some(0.25), 4, 1024).unwrap(),
            PolicySpec::Oracle {
                budget: 256,
                sinks: 0,
                recent: 0,
                every: 1
            }
        );
        let o = policy_spec("oracle-sfi", Some(0.5), 4, 1024).unwrap();
        assert_eq!(
            o,
            PolicySpec::Oracle {
                budget: 512,
                sinks: 4,
                recent: 256,
                every: 1
            }
        );
        assert_eq!(o.name(), "oracle-sfi");
        assert!(policy_spec("oracle-sfi", Some(0.25), 4, 1024).is_err());
        assert!(policy_spec("h3o", None, 4, 1024)
            .unwrap_err()
            .to_string()
            .contains("h3o"));
    }
}
