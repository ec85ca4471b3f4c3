//! Speculative decoding on the CPU: a drafter proposes up to γ tokens, the target (full KV of
//! the same model) scores all of them in one multi-row pass that reads the weights and the KV
//! once, and the longest acceptable prefix is kept (greedy: the tokens equal to the target's
//! argmax; sampling: speculative rejection sampling, `spec::sample::verify_token`). The output
//! is therefore the target's: full KV's greedy text, or full KV's sampling distribution.
//!
//! Drafters:
//! - `sfi` / `streaming`: the same session's sparse policy. Its decode steps draft; the
//!   verification runs through the same policy as a dense multi-row call, so it doubles as
//!   SFI's slow step (the Selector refreshes from it: every verification, or when the trigger
//!   fires). Drafted keys are cut off before the verification rewrites those positions.
//! - `ngram`: prompt lookup over the history, no model.
//! - `model`: a second, smaller model with the same vocabulary, full KV of its own.
use std::time::Instant;

use super::ngram::NgramDrafter;
use super::sample::{draw, verify_token};
use super::target::SpecTarget;
use crate::sampler::{Sampler, SamplerConfig};
use crate::session::{KvDtype, Session};
use crate::EngineError;
use slowfast_model::Model;

/// Which drafter proposes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// The SFI fast path of the target model (lossless SFI).
    Sfi,
    /// StreamingLLM KV of the target model (MagicDec's drafter).
    Streaming,
    /// Prompt lookup (n-gram match over the history).
    Ngram,
    /// A separate draft model (`--draft-model`).
    Model,
}

impl DraftKind {
    pub fn name(self) -> &'static str {
        match self {
            DraftKind::Sfi => "sfi",
            DraftKind::Streaming => "streaming",
            DraftKind::Ngram => "ngram",
            DraftKind::Model => "model",
        }
    }
    /// Drafters that are the target session's own sparse policy.
    pub fn is_self(self) -> bool {
        matches!(self, DraftKind::Sfi | DraftKind::Streaming)
    }
}

impl std::str::FromStr for DraftKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sfi" => Ok(DraftKind::Sfi),
            "streaming" => Ok(DraftKind::Streaming),
            "ngram" => Ok(DraftKind::Ngram),
            "model" => Ok(DraftKind::Model),
            _ => Err(format!(
                "unknown drafter `{s}` (sfi, streaming, ngram or model)"
            )),
        }
    }
}

/// Tokens drafted per verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecTokens {
    Fixed(usize),
    /// Chosen before each verification from the running acceptance rate and the measured
    /// draft and verification times, up to `max`.
    Adaptive {
        max: usize,
    },
}

impl SpecTokens {
    pub fn max(self) -> usize {
        match self {
            SpecTokens::Fixed(n) | SpecTokens::Adaptive { max: n } => n,
        }
    }
    pub fn label(self) -> String {
        match self {
            SpecTokens::Fixed(n) => n.to_string(),
            SpecTokens::Adaptive { max } => format!("adaptive(<={max})"),
        }
    }
}

/// Most tokens one verification may draft (the verification is one prefill-sized chunk).
pub const MAX_SPEC_TOKENS: usize = 32;

impl std::str::FromStr for SpecTokens {
    type Err = String;
    /// `N` (fixed) or `adaptive` / `adaptive:N` (at most N, default 8).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!("--spec-tokens: `{s}` is not a count in 1..={MAX_SPEC_TOKENS}, `adaptive` or `adaptive:N`")
        };
        let check = |n: usize| {
            if (1..=MAX_SPEC_TOKENS).contains(&n) {
                Ok(n)
            } else {
                Err(bad())
            }
        };
        match s.trim() {
            "adaptive" => Ok(SpecTokens::Adaptive { max: 8 }),
            t => match t.strip_prefix("adaptive:") {
                Some(n) => Ok(SpecTokens::Adaptive {
                    max: check(n.parse().map_err(|_| bad())?)?,
                }),
                None => Ok(SpecTokens::Fixed(check(t.parse().map_err(|_| bad())?)?)),
            },
        }
    }
}

/// Speculative decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOptions {
    pub drafter: DraftKind,
    pub tokens: SpecTokens,
    /// SFI drafter: refresh the Selector's memory from every verification (true) or only when
    /// the SFI trigger fires on the kept tokens (false).
    pub refresh_every: bool,
    /// N-gram drafter: longest and shortest suffix matched.
    pub ngram_max: usize,
    pub ngram_min: usize,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            drafter: DraftKind::Sfi,
            tokens: SpecTokens::Fixed(6),
            refresh_every: true,
            ngram_max: 3,
            ngram_min: 1,
        }
    }
}

/// Counters of one speculative run (for `--json`, eval and `/metrics`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpecStats {
    /// Tokens the drafter proposed.
    pub drafted: usize,
    /// Of those, tokens the target accepted.
    pub accepted: usize,
    /// Verification passes.
    pub verifications: usize,
    /// Tokens the verifications produced (accepted drafts + one correction or bonus each).
    pub produced: usize,
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    /// Per count of drafted tokens g (a key per g seen): how many verifications of g drafts
    /// accepted 0, 1, ..., g of them (`bench --spec-accept` replays these).
    pub accept_hist: std::collections::BTreeMap<usize, Vec<usize>>,
}

impl SpecStats {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    /// Mean tokens produced per verification.
    pub fn tokens_per_verification(&self) -> f64 {
        if self.verifications == 0 {
            0.0
        } else {
            self.produced as f64 / self.verifications as f64
        }
    }
    pub fn add(&mut self, o: &SpecStats) {
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.verifications += o.verifications;
        self.produced += o.produced;
        self.draft_seconds += o.draft_seconds;
        self.verify_seconds += o.verify_seconds;
        for (&g, h) in &o.accept_hist {
            let mine = self.accept_hist.entry(g).or_insert_with(|| vec![0; g + 1]);
            for (m, x) in mine.iter_mut().zip(h) {
                *m += x;
            }
        }
    }
}

/// The stats with their derived rates, as `--json` prints them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpecReport {
    pub drafter: &'static str,
    pub spec_tokens: String,
    #[serde(flatten)]
    pub stats: SpecStats,
    pub acceptance_rate: f64,
    pub tokens_per_verification: f64,
}

impl SpecReport {
    pub fn new(opts: &SpecOptions, stats: &SpecStats) -> Self {
        SpecReport {
            drafter: opts.drafter.name(),
            spec_tokens: opts.tokens.label(),
            stats: stats.clone(),
            acceptance_rate: stats.acceptance_rate(),
            tokens_per_verification: stats.tokens_per_verification(),
        }
    }
}

/// Running estimates behind adaptive γ: the acceptance probability of one drafted token,
/// seconds per draft step, and the verification's seconds as `a + b * rows` (rows = γ + 1),
/// fitted by exponentially weighted least squares (a GPU verification is nearly flat in its
/// rows, a CPU one nearly proportional).
#[derive(Debug, Clone)]
struct Adapt {
    alpha: f64,
    draft_s: f64,
    /// Weighted sums of (rows, seconds): weight, x, y, xx, xy.
    sums: [f64; 5],
    seen: usize,
}

impl Adapt {
    /// Weight of the newest round in the running estimates.
    const W: f64 = 0.2;

    fn new() -> Self {
        Adapt {
            alpha: 0.8,
            draft_s: 0.0,
            sums: [0.0; 5],
            seen: 0,
        }
    }

    /// The fitted verification cost `(a, b)` of `a + b * rows`.
    fn verify_cost(&self) -> (f64, f64) {
        let [w, x, y, xx, xy] = self.sums;
        if w <= 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (x / w, y / w);
        let var = xx / w - mx * mx;
        if var > 1e-6 {
            let b = ((xy / w - mx * my) / var).max(0.0);
            ((my - b * mx).max(0.0), b)
        } else {
            (0.0, my / mx.max(1.0))
        }
    }

    /// γ maximising expected tokens per second: a verification of γ drafts yields
    /// (1 − α^(γ+1)) / (1 − α) tokens and costs γ draft steps plus its verification.
    fn pick(&self, max: usize) -> usize {
        if self.seen < 2 {
            return max.min(4);
        }
        let a = self.alpha.clamp(0.0, 0.999);
        let (va, vb) = self.verify_cost();
        let rate = |g: usize| {
            let tokens = (1.0 - a.powi(g as i32 + 1)) / (1.0 - a);
            let cost = g as f64 * self.draft_s + va + vb * (g + 1) as f64;
            tokens / cost.max(1e-12)
        };
        (1..=max)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
            .unwrap_or(1)
    }

    /// One verification: `drafted` tokens of which `accepted` were kept, its draft and
    /// verification times.
    fn update(&mut self, drafted: usize, accepted: usize, draft_s: f64, verify_s: f64) {
        let w = Self::W;
        if drafted > 0 {
            // The first rejection ends a verification: accepted / (accepted + 1 rejection) is
            // the per-token acceptance estimate of a geometric run.
            let rejected = (accepted < drafted) as usize;
            let a = accepted as f64 / (accepted + rejected).max(1) as f64;
            self.alpha = (1.0 - w) * self.alpha + w * a;
            let d = draft_s / drafted as f64;
            self.draft_s = if self.seen == 0 {
                d
            } else {
                (1.0 - w) * self.draft_s + w * d
            };
        }
        let x = (drafted + 1) as f64;
        for (s, v) in self
            .sums
            .iter_mut()
            .zip([1.0, x, verify_s, x * x, x * verify_s])
        {
            *s = (1.0 - w) * *s + v;
        }
        self.seen += 1;
    }
}

/// One scored row handed to a speculative sequence by a device that drafts or verifies
/// many sequences in one pass (the GPU scheduler's batched rounds).
#[derive(Debug, Clone, Copy)]
pub enum Row<'a> {
    /// The row's logits over the vocabulary.
    Logits(&'a [f32]),
    /// The device's argmax of the row: enough for a greedy sampler (temperature 0, no
    /// penalties), whose distribution is that one token.
    Argmax(u32),
}

enum Drafter<'m> {
    /// The target session's own policy drafts.
    SelfPolicy,
    Ngram(NgramDrafter),
    Model {
        sess: Box<Session<'m>>,
        /// Committed tokens not yet in the draft model's cache (fed before the next draft).
        lag: Vec<u32>,
    },
}

/// Speculative decoding of one sequence: the drafter's state beside the target's `Session`
/// (which the caller keeps and hands to each `round`).
pub struct Speculator<'m> {
    drafter: Drafter<'m>,
    opts: SpecOptions,
    stats: SpecStats,
    adapt: Adapt,
    /// Per drafted position, the drafter's distribution (reused buffers).
    q: Vec<Vec<(f32, u32)>>,
    p: Vec<(f32, u32)>,
    drafts: Vec<u32>,
    /// The drafter's sampler: the target's settings and history, its own random stream (and
    /// the draft model's vocabulary width).
    ds: Sampler,
}

/// Refuses a draft model whose tokenizer differs from the target's, naming the first
/// differing token.
pub fn check_same_vocab(
    target: &slowfast_tokenizer::Tokenizer,
    draft: &slowfast_tokenizer::Tokenizer,
) -> Result<(), EngineError> {
    let (a, b) = (target.vocab_size(), draft.vocab_size());
    if a != b {
        return Err(EngineError::BadInput(format!(
            "--draft-model: its vocabulary has {b} tokens but the model's has {a}; speculative decoding needs the same vocabulary"
        )));
    }
    for id in 0..a as u32 {
        if target.token_bytes(id, true) != draft.token_bytes(id, true) {
            return Err(EngineError::BadInput(format!(
                "--draft-model: token {id} is {:?} in the draft model's vocabulary but {:?} in the model's; speculative decoding needs the same vocabulary",
                String::from_utf8_lossy(&draft.token_bytes(id, true)),
                String::from_utf8_lossy(&target.token_bytes(id, true)),
            )));
        }
    }
    Ok(())
}

impl<'m> Speculator<'m> {
    /// Speculative decoding over `target`, a session for `prompt` (prefilled or not yet) whose
    /// policy is the drafter's (`sfi`, `streaming`) or full KV (`ngram`, `model`). A draft
    /// model (`draft`, with `kind` = Model) is prefilled with the prompt here.
    pub fn new(
        target: &mut dyn SpecTarget,
        prompt: &[u32],
        opts: SpecOptions,
        draft: Option<&'m Model>,
        kv: KvDtype,
        sampler: &SamplerConfig,
    ) -> Result<Self, EngineError> {
        Self::check_tokens(&opts)?;
        if opts.drafter != DraftKind::Model && draft.is_some() {
            return Err(EngineError::BadInput(
                "--draft-model is only used with --speculate model".into(),
            ));
        }
        Self::check_target(target, &opts)?;
        let drafter = match opts.drafter {
            DraftKind::Sfi | DraftKind::Streaming => Drafter::SelfPolicy,
            DraftKind::Ngram => Drafter::Ngram(Self::ngram(&opts, prompt)?),
            DraftKind::Model => {
                let m = draft.ok_or_else(|| {
                    EngineError::BadInput("--speculate model needs --draft-model".into())
                })?;
                let mut sess = Box::new(Session::new(
                    m,
                    target.capacity(),
                    kv,
                    target.chunk().max(MAX_SPEC_TOKENS),
                ));
                // The prompt minus its last token: the pending token of each draft is fed first.
                if prompt.len() > 1 {
                    sess.prefill(&prompt[..prompt.len() - 1], &mut |_, _| {})?;
                }
                Self::model_drafter(sess, prompt)?
            }
        };
        let vocab = match (opts.drafter, draft) {
            (DraftKind::Model, Some(m)) => m.cfg.vocab_size,
            _ => target.vocab_size(),
        };
        Self::assemble(drafter, opts, sampler, vocab)
    }

    /// `new` for the model drafter whose draft session is given, already holding the prompt
    /// (all of it, or all but its last token), e.g. a copy of a full-KV session of the same
    /// model, so the draft model's prefill is not run twice.
    pub fn with_draft_session(
        target: &mut dyn SpecTarget,
        prompt: &[u32],
        opts: SpecOptions,
        sess: Session<'m>,
        sampler: &SamplerConfig,
    ) -> Result<Self, EngineError> {
        Self::check_tokens(&opts)?;
        if opts.drafter != DraftKind::Model {
            return Err(EngineError::BadInput(format!(
                "a draft session is for --speculate model, not {}",
                opts.drafter.name()
            )));
        }
        Self::check_target(target, &opts)?;
        let vocab = sess.model().cfg.vocab_size;
        if vocab != target.vocab_size() {
            return Err(EngineError::BadInput(format!(
                "the draft session's vocabulary has {vocab} tokens, the target's {}",
                target.vocab_size()
            )));
        }
        let drafter = Self::model_drafter(Box::new(sess), prompt)?;
        Self::assemble(drafter, opts, sampler, vocab)
    }

    /// The session's policy before any work (a draft model's prefill): the drafter's own,
    /// which must be able to draft (probed with an empty draft), else full KV.
    fn check_target(target: &mut dyn SpecTarget, opts: &SpecOptions) -> Result<(), EngineError> {
        if opts.drafter.is_self() {
            let name = target.policy_name();
            if name != opts.drafter.name() {
                return Err(EngineError::BadInput(format!(
                    "--speculate {}: the session runs the {name} policy, not the drafter's",
                    opts.drafter.name()
                )));
            }
            target.begin_draft()?;
            let len = target.pos();
            target.end_draft(len)?;
        } else if target.policy_name() != "full" {
            return Err(EngineError::BadInput(format!(
                "--speculate {}: the target must run full KV, not {}",
                opts.drafter.name(),
                target.policy_name()
            )));
        }
        Ok(())
    }

    /// The model drafter over `sess`, which holds the prompt, or all of it but the last token
    /// (then fed before the first draft).
    fn model_drafter(sess: Box<Session<'m>>, prompt: &[u32]) -> Result<Drafter<'m>, EngineError> {
        let lag = match prompt.len().checked_sub(sess.pos()) {
            Some(0) => Vec::new(),
            Some(1) => prompt[prompt.len() - 1..].to_vec(),
            _ => {
                return Err(EngineError::BadInput(format!(
                    "the draft session holds {} tokens of a {}-token prompt (all, or all but one)",
                    sess.pos(),
                    prompt.len()
                )))
            }
        };
        Ok(Drafter::Model { sess, lag })
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }
    pub fn options(&self) -> &SpecOptions {
        &self.opts
    }

    /// A speculative sequence whose device drafts and verifies it batched with others (the
    /// GPU scheduler): the `sfi`, `streaming` (the device's own policy drafts) and `ngram`
    /// drafters; the device checks that its policy is the drafter's. `prompt`: the tokens
    /// before the first pending one.
    pub fn batched(
        prompt: &[u32],
        opts: SpecOptions,
        sampler: &SamplerConfig,
        vocab: usize,
    ) -> Result<Self, EngineError> {
        Self::check_tokens(&opts)?;
        let drafter = match opts.drafter {
            DraftKind::Sfi | DraftKind::Streaming => Drafter::SelfPolicy,
            DraftKind::Ngram => Drafter::Ngram(Self::ngram(&opts, prompt)?),
            DraftKind::Model => {
                return Err(EngineError::BadInput(
                    "speculate: the model drafter runs on the CPU only (serve --device cpu --draft-model)"
                        .into(),
                ))
            }
        };
        Self::assemble(drafter, opts, sampler, vocab)
    }

    fn check_tokens(opts: &SpecOptions) -> Result<(), EngineError> {
        if opts.tokens.max() == 0 || opts.tokens.max() > MAX_SPEC_TOKENS {
            return Err(EngineError::BadInput(format!(
                "--spec-tokens must be in 1..={MAX_SPEC_TOKENS}"
            )));
        }
        Ok(())
    }

    fn ngram(opts: &SpecOptions, prompt: &[u32]) -> Result<NgramDrafter, EngineError> {
        let mut d = NgramDrafter::try_new(opts.ngram_max, opts.ngram_min)
            .map_err(|e| EngineError::BadInput(e.to_string()))?;
        d.extend(prompt);
        Ok(d)
    }

    fn assemble(
        drafter: Drafter<'m>,
        opts: SpecOptions,
        sampler: &SamplerConfig,
        vocab: usize,
    ) -> Result<Self, EngineError> {
        let mut ds = Sampler::new(sampler.clone(), vocab)?;
        ds.reseed(sampler.seed ^ 0xD2AF_7000_5EC0_DE00);
        Ok(Speculator {
            drafter,
            opts,
            stats: SpecStats::default(),
            adapt: Adapt::new(),
            q: Vec::new(),
            p: Vec::new(),
            drafts: Vec::new(),
            ds,
        })
    }

    /// Whether the target's own decode steps draft (`sfi`, `streaming`).
    pub fn drafts_on_target(&self) -> bool {
        matches!(self.drafter, Drafter::SelfPolicy)
    }

    /// The round's γ for a target at `pos` of `capacity` positions whose verification takes
    /// at most `rows_max` rows, with `max_out` tokens still wanted (at least 1: a one-row
    /// pass would be a decode step, not a check).
    pub fn plan(
        &self,
        pos: usize,
        capacity: usize,
        rows_max: usize,
        max_out: usize,
    ) -> Result<usize, EngineError> {
        if pos + 2 > capacity {
            return Err(EngineError::BadInput(format!(
                "speculative decoding: the cache of {capacity} positions is full"
            )));
        }
        let want = match self.opts.tokens {
            SpecTokens::Fixed(g) => g,
            SpecTokens::Adaptive { max } => self.adapt.pick(max),
        };
        Ok(want
            .min(max_out.saturating_sub(1))
            .min(capacity.saturating_sub(pos + 1))
            .min(rows_max.saturating_sub(1))
            .max(1))
    }

    /// Starts the round's drafts after the pending token `t0`: the drafter's sampler takes
    /// the target's history; a host drafter (`ngram`) proposes its (up to `gamma`) tokens
    /// now, a self-drafter's come from `draft_row`.
    pub fn begin_drafts(&mut self, gamma: usize, sampler: &Sampler) {
        self.drafts.clear();
        if self.q.len() < gamma {
            self.q.resize_with(gamma, Vec::new);
        }
        // Drafts follow the target's sampler settings and history, on their own stream.
        self.ds.copy_history(sampler);
        if let Drafter::Ngram(d) = &mut self.drafter {
            d.propose(gamma, &mut self.drafts);
            self.drafts.truncate(gamma);
            // A deterministic proposal: q is the drafted token with probability 1.
            for (q, &t) in self.q.iter_mut().zip(&self.drafts) {
                q.clear();
                q.push((1.0, t));
            }
        }
    }

    /// The next draft from the drafter's scored row (its sampler draws it): the drafted token.
    pub fn draft_row(&mut self, row: Row) -> Result<u32, EngineError> {
        let i = self.drafts.len();
        if self.q.len() <= i {
            self.q.resize_with(i + 1, Vec::new);
        }
        let tok = match row {
            Row::Logits(l) => {
                self.ds.distribution(l, &mut self.q[i])?;
                draw(&self.q[i], self.ds.rng_mut())
            }
            Row::Argmax(t) => {
                self.q[i].clear();
                self.q[i].push((1.0, t));
                t
            }
        };
        self.ds.accept(tok);
        self.drafts.push(tok);
        Ok(tok)
    }

    /// This round's drafts so far.
    pub fn drafts(&self) -> &[u32] {
        &self.drafts
    }

    /// Checks the drafts against the verification's rows (`row(i)`: the target's row after
    /// the pending token and the first i drafts, i in 0..=drafts): the accepted drafts, then
    /// the target's own token, each recorded in `sampler`.
    pub fn accept<'r>(
        &mut self,
        row: &dyn Fn(usize) -> Row<'r>,
        sampler: &mut Sampler,
    ) -> Result<Vec<u32>, EngineError> {
        let g = self.drafts.len();
        let mut out = Vec::with_capacity(g + 1);
        for i in 0..=g {
            match row(i) {
                Row::Logits(l) => sampler.distribution(l, &mut self.p)?,
                Row::Argmax(t) => {
                    self.p.clear();
                    self.p.push((1.0, t));
                }
            }
            if i == g {
                let t = draw(&self.p, sampler.rng_mut());
                sampler.accept(t);
                out.push(t);
                break;
            }
            let d = self.drafts[i];
            match verify_token(&self.p, &self.q[i], d, sampler.rng_mut()) {
                None => {
                    sampler.accept(d);
                    out.push(d);
                }
                Some(t) => {
                    sampler.accept(t);
                    out.push(t);
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Ends a round whose verification produced `out` (from `accept`; the target now holds
    /// `target_len` positions): the drafter catches up, the counters and adaptive γ learn
    /// from it, and `out` is cut to `max_out` tokens.
    pub fn finish_round(
        &mut self,
        mut out: Vec<u32>,
        target_len: usize,
        draft_s: f64,
        verify_s: f64,
        max_out: usize,
    ) -> Vec<u32> {
        let g = self.drafts.len();
        let accepted = out.len() - 1;
        self.after_round(target_len, &out);
        self.stats.drafted += g;
        self.stats.accepted += accepted;
        self.stats.verifications += 1;
        self.stats.produced += out.len();
        self.stats.draft_seconds += draft_s;
        self.stats.verify_seconds += verify_s;
        if g > 0 {
            self.stats
                .accept_hist
                .entry(g)
                .or_insert_with(|| vec![0; g + 1])[accepted.min(g)] += 1;
        }
        self.adapt.update(g, accepted, draft_s, verify_s);
        out.truncate(max_out.max(1));
        out
    }

    /// One draft–verify round after the pending token `t0` (already sampled and recorded in
    /// `sampler`, not yet in the cache). Returns the new tokens, at most `max_out` of them
    /// and at least one: the accepted drafts, then the target's own token (a correction, or a
    /// bonus when every draft was accepted), each recorded in `sampler`. The last one is the
    /// next pending token.
    pub fn round(
        &mut self,
        target: &mut dyn SpecTarget,
        t0: u32,
        sampler: &mut Sampler,
        max_out: usize,
    ) -> Result<Vec<u32>, EngineError> {
        let n = target.pos();
        let gamma = self.plan(n, target.capacity(), target.verify_rows_max(), max_out)?;
        let t_draft = Instant::now();
        self.draft(target, t0, gamma, sampler)?;
        let draft_s = t_draft.elapsed().as_secs_f64();
        let g = self.drafts.len();
        let t_verify = Instant::now();
        let out = if g == 0 {
            // Nothing proposed (n-gram without a match): a plain dense step.
            let logits = target.step(t0)?;
            sampler.distribution(logits, &mut self.p)?;
            let t = draw(&self.p, sampler.rng_mut());
            sampler.accept(t);
            vec![t]
        } else {
            let mut fed = Vec::with_capacity(g + 1);
            fed.push(t0);
            fed.extend_from_slice(&self.drafts);
            let vocab = target.vocab_size();
            let logits = target.verify(&fed)?;
            let out = self.accept(
                &|i| Row::Logits(&logits[i * vocab..(i + 1) * vocab]),
                sampler,
            )?;
            let accepted = out.len() - 1;
            // Keep t0 and the accepted drafts; the last token of `out` is pending.
            fed.truncate(accepted + 1);
            target.end_verify(&fed, n + accepted + 1, self.opts.refresh_every)?;
            out
        };
        let verify_s = t_verify.elapsed().as_secs_f64();
        Ok(self.finish_round(out, target.pos(), draft_s, verify_s, max_out))
    }

    /// Propose up to `gamma` tokens after `t0` into `self.drafts`, with the drafter's
    /// distribution of each in `self.q`.
    fn draft(
        &mut self,
        target: &mut dyn SpecTarget,
        t0: u32,
        gamma: usize,
        sampler: &Sampler,
    ) -> Result<(), EngineError> {
        self.begin_drafts(gamma, sampler);
        match &mut self.drafter {
            Drafter::SelfPolicy => {
                let n = target.pos();
                target.begin_draft()?;
                let mut tok = t0;
                let r = (|| {
                    for _ in 0..gamma {
                        let logits = target.step(tok)?;
                        tok = self.draft_row(Row::Logits(logits))?;
                    }
                    Ok::<(), EngineError>(())
                })();
                let e = target.end_draft(n);
                r?;
                e?;
            }
            Drafter::Ngram(_) => {} // proposed by begin_drafts
            Drafter::Model { sess, lag } => {
                let ds = &mut self.ds;
                lag.push(t0);
                // The committed tokens it has not seen, then t0: the last row drafts.
                sess.forward(lag, slowfast_model::LogitsRows::Last)?;
                lag.clear();
                for i in 0..gamma {
                    if i > 0 {
                        let t = self.drafts[i - 1];
                        sess.forward(&[t], slowfast_model::LogitsRows::Last)?;
                    }
                    ds.distribution(sess.logits(), &mut self.q[i])?;
                    let t = draw(&self.q[i], ds.rng_mut());
                    ds.accept(t);
                    self.drafts.push(t);
                }
            }
        }
        Ok(())
    }

    /// Bring the drafter's view up to the committed tokens `out` (after the round's `t0`; the
    /// last one is pending, not yet in any cache).
    fn after_round(&mut self, target_len: usize, out: &[u32]) {
        match &mut self.drafter {
            Drafter::SelfPolicy => {}
            Drafter::Ngram(d) => d.extend(out),
            Drafter::Model { sess, lag, .. } => {
                // Its cache holds t0 at n0 and drafts d1.. after it; keep those accepted
                // (equal to `out`'s prefix) whose keys it computed (all but the last draft).
                let n0 = target_len - (out.len() - 1) - 1;
                let accepted = out.len() - 1;
                let drafted_in_cache = self.drafts.len().saturating_sub(1);
                let keep = accepted.min(drafted_in_cache);
                sess.truncate(n0 + 1 + keep);
                lag.clear();
                lag.extend_from_slice(&out[keep..out.len() - 1]);
            }
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod adapt_tests {
    use super::Adapt;

    /// Feeds rounds whose costs follow `verify(rows)` and `draft` seconds a step, with a
    /// per-token acceptance `alpha`, and returns the γ picked at the end.
    fn settle(alpha: f64, draft: f64, verify: impl Fn(usize) -> f64) -> usize {
        let mut a = Adapt::new();
        let mut g = 4;
        for i in 0..200 {
            // A deterministic geometric run: accept while the running product stays above a
            // fixed pseudo-random threshold.
            let u = ((i * 7919) % 97) as f64 / 97.0;
            let mut accepted = 0;
            while accepted < g && alpha.powi(accepted as i32 + 1) > u {
                accepted += 1;
            }
            a.update(g, accepted, g as f64 * draft, verify(g + 1));
            g = a.pick(8);
        }
        g
    }

    #[test]
    fn flat_verifications_and_cheap_drafts_draft_long() {
        // GPU-like: the verification costs the same at any row count, drafts a tenth of it.
        assert!(settle(0.95, 0.1, |_| 1.0) >= 6);
    }

    #[test]
    fn proportional_verifications_draft_short() {
        // CPU-like: every verified row costs 0.6 of a step and a draft step 0.8: speculation
        // cannot pay, so γ drops to the least.
        assert_eq!(settle(0.7, 0.8, |rows| 0.6 * rows as f64), 1);
    }

    #[test]
    fn the_fit_recovers_a_linear_cost() {
        let mut a = Adapt::new();
        for g in [1usize, 3, 5, 7, 2, 6].iter().cycle().take(60) {
            a.update(*g, 0, 0.0, 0.5 + 0.25 * (*g + 1) as f64);
        }
        let (va, vb) = a.verify_cost();
        assert!(
            (va - 0.5).abs() < 1e-6 && (vb - 0.25).abs() < 1e-6,
            "{va} {vb}"
        );
    }
}
