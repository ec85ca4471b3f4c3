//! Flags shared by several commands and small helpers.
use anyhow::{bail, Context, Result};
use slowfast_engine::session::TriggerKind;
use slowfast_engine::{KvDtype, Loaded};

/// Model and runtime flags common to generate, eval and bench.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a .gguf file, an HF directory, random:<preset>[@dtype], hf:<org>/<repo>, gemma3-270m
    /// or smollm2-135m.
    #[arg(long, short = 'm', default_value = slowfast_engine::DEFAULT_MODEL)]
    pub model: String,
    /// Compute device. `cuda` needs a build with `--features cuda` and an NVIDIA GPU; it runs
    /// generate, bench, serve and eval (tasks nll, agree, passkey, ruler and stability) with the
    /// policies full, streaming, sfi, snapkv, pyramidkv, quest, h2o and fastkv (on models whose
    /// layers after its TSP layer are global), and (eval) the diagnostic oracle and oracle-sfi.
    /// (--sfi-async-lag trades a little of SFI's quality there for speed).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Element type of the KV cache. The CPU stores f16 or f32, the GPU bf16 for either; fp8
    /// stores e4m3 on both (half of f16's bytes a token; the GPU calibrates power-of-two scales
    /// at load, the CPU stores the values as they are).
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32", "fp8"])]
    pub kv_dtype: String,
    /// Prompt tokens per prefill forward pass.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Tensor parallelism: split the model over this many ranks (q/k/v and gate/up by
    /// columns, o and down by rows with an all-reduce each, kv heads partitioned or replicated
    /// when fewer than the ranks, embedding and LM head by vocabulary). Each rank keeps the KV
    /// and runs the KV policy of its own kv heads. The CPU runs the ranks as threads: the
    /// reference for the GPU's ranks, not a speed-up. generate and eval (nll, agree, passkey,
    /// ruler) take it; --device cuda, bench and serve do not yet (docs/tensor-parallel.md)
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel: usize,
}

impl ModelArgs {
    pub fn kv(&self) -> KvDtype {
        self.kv_dtype.parse().expect("clap restricts the values")
    }

    pub fn device(&self) -> slowfast_engine::Device {
        self.device.parse().expect("clap restricts the values")
    }

    /// Check the device and load the model (fetching the default model on first use).
    pub fn load(&self) -> Result<Loaded> {
        if self.device() == slowfast_engine::Device::Cuda && !slowfast_engine::device::CUDA_BUILT {
            return Err(slowfast_engine::device::not_built().into());
        }
        if self.chunk == 0 {
            bail!("--chunk must be at least 1");
        }
        if self.tensor_parallel == 0 {
            bail!("--tensor-parallel must be at least 1 (1: the whole model)");
        }
        if self.tensor_parallel > 1 && self.device() == slowfast_engine::Device::Cuda {
            return Err(slowfast_engine::device::tp_not_on_gpu().into());
        }
        let t = std::time::Instant::now();
        let mut m = slowfast_engine::load(&self.model, &mut |s| eprintln!("{s}"))
            .with_context(|| format!("loading model `{}`", self.model))?;
        m.set_tensor_parallel(self.tensor_parallel)?;
        eprintln!(
            "loaded {} ({}, {} layers) in {:.1}s",
            self.model,
            m.model.cfg.arch.name(),
            m.model.cfg.num_hidden_layers,
            t.elapsed().as_secs_f64()
        );
        Ok(m)
    }
}

impl ModelArgs {
    /// Refuse `--tensor-parallel` above 1 in a command that runs the whole model (`what`).
    pub fn whole_model_only(&self, what: &str) -> Result<()> {
        if self.tensor_parallel > 1 {
            bail!("--tensor-parallel {}: {what} runs the whole model so far; generate and eval take --tensor-parallel (docs/tensor-parallel.md)", self.tensor_parallel);
        }
        Ok(())
    }
}

/// Read a UTF-8 text file, naming the file in every error.
pub fn read_text(path: &std::path::Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Flags of the sparse KV policies, shared by generate, eval and bench.
#[derive(clap::Args, Debug, Clone)]
pub struct PolicyArgs {
    /// KV budget of a sparse policy: tokens per kv head of each global layer (window
    /// included), or a fraction of the context when below 1. h2o splits it half heavy
    /// hitters, half recent; snapkv/pyramidkv/fastkv keep it after prefill (pyramidkv: on
    /// average over layers); quest reads it as pages of 16 tokens (at least 3) per decode step;
    /// streaming: sinks + recent; sfi: sinks + selected + recent.
    #[arg(long)]
    pub kv_budget: Option<f64>,
    /// Attention-sink tokens kept by the streaming and SFI policies.
    #[arg(long, alias = "sfi-sinks", default_value_t = 4)]
    pub sinks: usize,
    /// SFI: recent window read in place (tokens; its start is page-aligned).
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().recent)]
    pub sfi_recent: usize,
    /// SFI: force a slow (dense, refreshing) step after this many decode steps.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().refresh_interval)]
    pub sfi_refresh_interval: usize,
    /// SFI: least decode steps between two sentence-triggered refreshes.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().min_gap)]
    pub sfi_min_gap: usize,
    /// SFI slow-step trigger: punct (first token of a sentence), periodic, random, off.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().trigger, value_parser = TriggerKind::NAMES)]
    pub sfi_trigger: String,
    /// SFI, --device cuda only: run each slow step's Selector on a second stream and publish its
    /// new memory this many decode steps later; the fast steps in between keep the previous
    /// memory. 0 (the default, and the CPU's SFI) refreshes within the slow step. Lag 4 was
    /// measured 0.1 % faster at batch 1 and 1.5 % at batch 6 (128K), for +0.06 nats of ΔNLL on
    /// source code at 8K (run 106, docs/results.md "SFI's refresh lag").
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().async_lag)]
    pub sfi_async_lag: usize,
    /// SFI: re-rank the memory at every fast step (CPU only; 1 turns it off). Each refresh
    /// keeps this many times the selected tokens as candidates, in pages of 16 with their
    /// keys' min and max; each fast step reads the pages with the highest bound on q·k
    /// (Quest's), as many as the budget allows once the bounds (a key read each) are paid for,
    /// so a step reads as many keys as without it. See docs/results.md.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().pool)]
    pub sfi_pool: f64,
    /// SFI: the drift trigger (CPU only; 0 turns it off). Each refresh records the share of
    /// its query's attention, over what a fast step reads, on the selected keys; each fast step
    /// measures its own share from the logits it computes anyway. When the fast step's shares,
    /// summed over the global layers, fall below this fraction of the refresh's, the next step
    /// is slow (past --sfi-min-gap). Adds slow steps where the memory went stale; see
    /// docs/results.md for its cost and gain.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().drift, allow_negative_numbers = true)]
    pub sfi_drift: f64,
    /// SFI: the cheaper slow step (CPU and GPU; 0 turns it off: a slow step then reads every
    /// key, as in the paper). A slow step reads the sinks' page, the recent window and this many
    /// times the selected tokens in pages of 16, those whose bound on q·k (Quest's key min/max,
    /// a key read a page) is highest for some query head; the Selector picks the memory among
    /// them. The default 2 decodes as fast or faster than dense slow steps on the GPU and keeps
    /// their quality on the CPU; with more slow steps (--sfi-trigger periodic
    /// --sfi-refresh-interval 6) it halves the loss on code. See docs/results.md.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().candidates, allow_negative_numbers = true)]
    pub sfi_candidates: f64,
    /// SFI, --device cuda at batch > 1 (serve, bench): on, sequences past --sfi-min-gap join a
    /// slow step another sequence fires, up to the 4 score rows a GPU step captures, so the
    /// batch runs fewer slow steps (each costs mostly per step, not per row); a rider is past
    /// its min gap and next to its own slow step (a sentence end, or its interval due within
    /// the gap). off: each sequence refreshes on its own schedule (the CPU's SFI). No
    /// effect at batch 1 or when the CPU serves (its slow rows each cost a dense pass);
    /// `eval --batch` replays the GPU's schedule on the CPU to measure it. See docs/serving.md.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub sfi_ride: String,
    /// SFI: prefill query rows (the last ones) whose dense attention bootstraps the first
    /// selection.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().bootstrap_rows)]
    pub sfi_bootstrap_rows: usize,
    /// Diagnostic policies oracle / oracle-sfi: reselect the exact top keys every this many
    /// decode steps (1: every step); in between the chosen keys are reused while the recent
    /// window grows, as in SFI (measures what staleness alone costs).
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().oracle_every)]
    pub oracle_every: usize,
    /// SFI Selector: power-mean exponent of the evidence over captured rows (0: geometric mean).
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.alpha)]
    pub sfi_alpha: f64,
    /// SFI Selector: key-norm prior exponent (smaller keys get more prior).
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.gamma)]
    pub sfi_gamma: f64,
    /// SFI Selector: weight of the key-norm prior in the prior.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.prior_weight_l2)]
    pub sfi_prior_weight_l2: f64,
    /// SFI Selector: weight of the position prior in the prior.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.prior_weight_pos)]
    pub sfi_prior_weight_pos: f64,
    /// SFI Selector: soft-NMS / span-pooling window in tokens (0 turns it off). The paper's
    /// soft-NMS: --sfi-soft-alpha 1 --sfi-nms-window 32.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.nms_window)]
    pub sfi_nms_window: usize,
    /// SFI Selector: shift the soft-NMS / pooling window this many tokens towards earlier
    /// keys: key j pools over [j - w/2 - shift, j + w/2 - shift], so with pooling a peak at p
    /// lifts p + shift - w/2 ..= p + shift + w/2 (shift = w/2: the peak and the w keys after
    /// it; an extension; 0: centred, the default).
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.nms_shift)]
    pub sfi_nms_shift: usize,
    /// SFI Selector: soft-NMS strength (0 turns it off; the paper uses 1). Negative values,
    /// down to -1, pool instead (slowfast's default, -1 with an 8-token window): the neighbours
    /// of a peak move up towards it, so spans such as a number are kept whole (-1: each key
    /// scores its window's maximum). See docs/results.md for both measured.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.soft_alpha, allow_negative_numbers = true)]
    pub sfi_soft_alpha: f64,
    /// SFI Selector: cross-head exclusivity strength (skipped with <= 2 kv heads; 0 turns it off).
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.cross_head_alpha)]
    pub sfi_cross_head_alpha: f64,
    /// SFI Selector: cross-head exclusivity softmax temperature.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.cross_head_temperature)]
    pub sfi_cross_head_temperature: f64,
    /// SFI Selector: clip of the evidence/prior mixing weight lambda with one captured row.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.lambda_clip_single)]
    pub sfi_lambda_clip_single: f64,
    /// SFI Selector: clip of lambda with several captured rows.
    #[arg(long, default_value_t = slowfast_engine::session::SfiKnobs::default().selector.lambda_clip_multi)]
    pub sfi_lambda_clip_multi: f64,
    /// SFI Selector: normalise each captured row's attention over every key it sees (sinks and
    /// recent window included) instead of over the candidates only, so a query head weighs in
    /// the evidence by the attention it gives the candidates (an extension; CPU only).
    #[arg(long)]
    pub sfi_evidence_mass: bool,
    /// FastKV: fraction of the prompt propagated past the TSP layer (sets the prefill cost;
    /// --kv-budget sets the decode KV kept per layer).
    #[arg(long, default_value_t = 0.2)]
    pub fastkv_tsp_rate: f64,
    /// FastKV: layer after which only the selected tokens propagate (a global-attention
    /// layer; default: the global layer nearest the middle of the model).
    #[arg(long)]
    pub fastkv_tsp_layer: Option<usize>,
    /// Prefill of the sfi policy: full (every prompt token through every layer) or fastkv
    /// (FastKV's token-selective propagation, --fastkv-tsp-rate of the prompt past
    /// --fastkv-tsp-layer; SFI then decodes over what that leaves, no retention step). `--policy
    /// sfi --prefill fastkv` is the policy `sfi+fastkv`. Only sfi takes it (fastkv always
    /// prefills this way; full, the reference, is left dense); other policies refuse it.
    #[arg(long, default_value = "full", value_parser = ["full", "fastkv"])]
    pub prefill: String,
}

impl PolicyArgs {
    /// The policy `name` for sequences of `context` tokens, validated.
    pub fn spec(&self, name: &str, context: usize) -> Result<slowfast_engine::PolicySpec> {
        let name = match (self.prefill.as_str(), name) {
            ("full", _) | ("fastkv", "full" | "fastkv" | "sfi+fastkv") => name,
            ("fastkv", "sfi") => "sfi+fastkv",
            (p, other) => bail!(
                "--prefill {p} works with --policy sfi only (got --policy {other}; fastkv always prefills this way)"
            ),
        };
        let knobs = slowfast_engine::session::SfiKnobs {
            recent: self.sfi_recent,
            refresh_interval: self.sfi_refresh_interval,
            min_gap: self.sfi_min_gap,
            trigger: self.sfi_trigger.clone(),
            bootstrap_rows: self.sfi_bootstrap_rows,
            oracle_every: self.oracle_every,
            async_lag: self.sfi_async_lag,
            pool: self.sfi_pool,
            drift: self.sfi_drift,
            candidates: self.sfi_candidates,
            ride: self.sfi_ride == "on",
            selector: slowfast_engine::session::SelectorConfig {
                alpha: self.sfi_alpha,
                gamma: self.sfi_gamma,
                prior_weight_l2: self.sfi_prior_weight_l2,
                prior_weight_pos: self.sfi_prior_weight_pos,
                nms_window: self.sfi_nms_window,
                nms_shift: self.sfi_nms_shift,
                soft_alpha: self.sfi_soft_alpha,
                cross_head_alpha: self.sfi_cross_head_alpha,
                cross_head_temperature: self.sfi_cross_head_temperature,
                lambda_clip_single: self.sfi_lambda_clip_single,
                lambda_clip_multi: self.sfi_lambda_clip_multi,
                evidence_mass: self.sfi_evidence_mass,
                ..Default::default()
            },
        };
        let fastkv = slowfast_engine::session::FastKvKnobs {
            tsp_rate: self.fastkv_tsp_rate,
            tsp_layer: self.fastkv_tsp_layer,
        };
        Ok(slowfast_engine::session::policy_spec_knobs(
            name,
            self.kv_budget,
            self.sinks,
            context,
            &knobs,
            &fastkv,
        )?)
    }
}

/// Speculative decoding flags, shared by generate, eval and serve.
#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding, lossless (the output is full KV's: its greedy text, or its
    /// sampling distribution): a drafter proposes --spec-tokens tokens, one dense pass over
    /// the whole KV verifies them. Drafters: sfi (SFI's fast path of the same model, with
    /// --kv-budget and the --sfi-* knobs; verifications are its slow steps), streaming
    /// (StreamingLLM KV of the same model, --kv-budget), ngram (prompt lookup, no model),
    /// model (a smaller model with the same vocabulary, --draft-model). On --device cpu and
    /// cuda (cuda: the drafter's steps replay the decode graph, a verification is one
    /// multi-row dense pass).
    #[arg(long, value_parser = ["sfi", "streaming", "ngram", "model"])]
    pub speculate: Option<String>,
    /// Tokens drafted per verification: a count (1-32), `adaptive` (chosen each round from the
    /// running acceptance rate and the measured draft and verification times, at most 8) or
    /// `adaptive:N` (at most N).
    #[arg(long, default_value = "6")]
    pub spec_tokens: String,
    /// --speculate sfi: when a verification refreshes the Selector's memory from its dense
    /// attention: `every` verification, or only when SFI's `trigger` fires on the kept tokens.
    #[arg(long, default_value = "every", value_parser = ["every", "trigger"])]
    pub spec_refresh: String,
    /// --speculate ngram: longest suffix (in tokens) looked up in the history; shorter ones
    /// down to 1 are tried when it does not match.
    #[arg(long, default_value_t = 3)]
    pub spec_ngram: usize,
    /// --speculate model: the draft model (same forms as --model); its vocabulary must be the
    /// model's.
    #[arg(long)]
    pub draft_model: Option<String>,
}

impl SpecArgs {
    /// The validated options (None without --speculate).
    pub fn options(&self) -> Result<Option<slowfast_engine::spec::SpecOptions>> {
        use slowfast_engine::spec::{DraftKind, SpecOptions, SpecTokens};
        let Some(name) = &self.speculate else {
            if self.draft_model.is_some() {
                bail!("--draft-model is used by --speculate model only");
            }
            return Ok(None);
        };
        let drafter: DraftKind = name.parse().map_err(anyhow::Error::msg)?;
        let tokens: SpecTokens = self.spec_tokens.parse().map_err(anyhow::Error::msg)?;
        if drafter == DraftKind::Model && self.draft_model.is_none() {
            bail!("--speculate model needs --draft-model");
        }
        if drafter != DraftKind::Model && self.draft_model.is_some() {
            bail!("--draft-model is used by --speculate model only (got --speculate {name})");
        }
        if self.spec_ngram == 0 {
            bail!("--spec-ngram must be at least 1");
        }
        Ok(Some(SpecOptions {
            drafter,
            tokens,
            refresh_every: self.spec_refresh == "every",
            ngram_max: self.spec_ngram,
            ngram_min: 1,
        }))
    }

    /// The session's policy under speculation: the drafter's own (sfi, streaming) or full KV;
    /// `policy` (the --policy flag) must be full, since the output is full KV's.
    pub fn session_policy(
        &self,
        policy: &str,
        sparse: &PolicyArgs,
        context: usize,
    ) -> Result<Option<slowfast_engine::PolicySpec>> {
        let Some(opts) = self.options()? else {
            return Ok(None);
        };
        if policy != "full" {
            bail!(
                "--speculate is lossless (the output is full KV's), so --policy must stay full (got --policy {policy}); the sfi and streaming drafters take --kv-budget"
            );
        }
        Ok(Some(if opts.drafter.is_self() {
            if sparse.prefill != "full" {
                bail!(
                    "--speculate {}: --prefill must be full",
                    opts.drafter.name()
                );
            }
            sparse.spec(opts.drafter.name(), context)?
        } else {
            slowfast_engine::PolicySpec::Full
        }))
    }

    /// Load the draft model of --speculate model.
    pub fn load_draft(&self) -> Result<Option<Loaded>> {
        let Some(spec) = &self.draft_model else {
            return Ok(None);
        };
        let m = slowfast_engine::load(spec, &mut |s| eprintln!("{s}"))
            .with_context(|| format!("loading draft model `{spec}`"))?;
        Ok(Some(m))
    }
}
