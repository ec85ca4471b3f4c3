//! `slowfast serve`: the OpenAI-compatible server over the continuous-batching scheduler.
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use slowfast_engine::scheduler::{self, SchedulerConfig};
use slowfast_engine::spec::DraftKind;
use slowfast_engine::KvDtype;
use slowfast_server::{KvPolicyRequest, ServerConfig};

use crate::common::{ModelArgs, PolicyArgs, SpecArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The server's default KV policy (see `generate --help`); a request may choose its own
    /// with the extension field `kv_policy`.
    #[arg(long, default_value = "full")]
    pub policy: String,
    #[command(flatten)]
    pub sparse: PolicyArgs,
    /// Speculative decoding of every request that does not choose (extension field
    /// `speculate`, which may also say `{"drafter": "off"}`); see `generate --help`. On the
    /// CPU each such sequence runs its own draft–verify rounds beside the batched step; on
    /// the GPU every slot runs the drafter's policy (sfi, streaming; ngram: full KV) and the
    /// speculative sequences draft and verify together, one batched pass a round (no `model`
    /// drafter there).
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Sequences decoded together at most (the running batch).
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Longest sequence a request may have, prompt + generated tokens (default: the model's
    /// context, at most 8192). Longer prompts get a 400; max_tokens is cut to fit.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Requests that may wait for a place in the batch; past it a request gets a 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// KV cache bytes the running sequences may hold together (default on the CPU:
    /// --max-batch sequences of --max-context tokens; on the GPU: what
    /// --gpu-memory-utilization leaves). A sequence holds what its tokens need so far (on the
    /// GPU in pages of 2 MiB a layer and head): a request waits until its prompt's KV fits,
    /// and when the running sequences grow past this the newest is preempted (its KV freed)
    /// and later prefilled again with what it generated.
    #[arg(long)]
    pub kv_memory: Option<usize>,
    /// GPU: the fraction of the device's memory the server may use when --kv-memory is not
    /// given; the KV pages get what is left after the weights, the policy's state and a
    /// workspace.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Reserve each request's whole KV (prompt + max_tokens) at admission instead of growing
    /// it: fewer sequences run together, none is ever preempted.
    #[arg(long)]
    pub kv_reserve: bool,
    /// Prefix cache: KV bytes it may hold for reuse by later prompts that start with the same
    /// whole prefill chunks (a shared system prompt is then prefilled once; output is
    /// unchanged); 0 turns it off. Default: as much as --kv-memory. On the CPU the sequences
    /// that start with a cached prefix share its KV blocks (one copy in memory); on the GPU
    /// whole 8192-token prefill parts whose KV pages the sequences map and share.
    #[arg(long)]
    pub prefix_cache_memory: Option<usize>,
    /// Tokens a KV block holds on the CPU: the unit in which a sequence's KV grows and in
    /// which the prefix cache shares it (must divide --chunk). Default: 128, or the largest
    /// power of two that divides --chunk when 128 does not.
    #[arg(long, visible_alias = "prefix-block")]
    pub kv_block: Option<usize>,
    /// Prompt tokens prefilled per scheduler step, between decode steps (at least one
    /// --chunk a step), so running streams keep flowing while a long prompt is read.
    #[arg(long, default_value_t = 512)]
    pub max_prefill_tokens: usize,
    /// Require `Authorization: Bearer KEY` on the /v1 endpoints.
    #[arg(long, env = "SLOWFAST_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model name /v1/models lists and requests must use (default: the --model argument).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest request body accepted (bytes); larger ones get a 413.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a connection may take to send a whole request head (from when it opens, or
    /// from its previous response); slower or idle ones are closed (slowloris).
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout: f64,
    /// Seconds a request may take to send its whole body after its head; past it, a 408.
    #[arg(long, default_value_t = 30.0)]
    pub body_read_timeout: f64,
}

pub fn run(a: Args) -> Result<()> {
    a.model.whole_model_only("serve")?;
    if a.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if a.max_prefill_tokens == 0 {
        bail!("--max-prefill-tokens must be at least 1");
    }
    if a.max_body_bytes < 1024 {
        bail!("--max-body-bytes must be at least 1024");
    }
    scheduler::check_gpu_memory_utilization(a.gpu_memory_utilization)?;
    for (name, v) in [
        ("--header-read-timeout", a.header_read_timeout),
        ("--body-read-timeout", a.body_read_timeout),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= 86400.0) {
            bail!("{name} must be a number of seconds in (0, 86400], not {v}");
        }
    }
    let speculate = a.spec.options()?;
    let gpu = a.model.device() != slowfast_engine::Device::Cpu;
    if gpu
        && speculate
            .as_ref()
            .is_some_and(|o| o.drafter == DraftKind::Model)
    {
        bail!("--speculate model runs on the CPU only (--device cpu); on the GPU use sfi, streaming or ngram");
    }
    let loaded = Arc::new(a.model.load()?);
    let draft = a.spec.load_draft()?.map(Arc::new);
    let draft_model = draft.is_some();
    let ctx = loaded.model.cfg.max_position_embeddings;
    let max_context = a.max_context.unwrap_or(ctx.min(8192));
    if max_context < 2 || max_context > ctx {
        bail!("--max-context {max_context} must be in 2..={ctx} (the model's context)");
    }
    // The default policy must resolve for a full-length sequence before the server starts.
    let defaults = a.sparse.clone();
    let default_name = a.policy.clone();
    let default_policy = defaults
        .spec(&default_name, max_context)
        .with_context(|| format!("--policy {default_name}"))?
        .with_vocab(&loaded.tokenizer);
    default_policy.check_device(a.model.device())?;
    // The drafter's policy must resolve too (a budget for sfi / streaming; --policy full).
    // The server's sparse flags (--kv-budget, ...) size it for every speculative request.
    let spec_policy = a
        .spec
        .session_policy(&a.policy, &a.sparse, max_context)
        .context("--speculate")?
        .map(|p| p.with_vocab(&loaded.tokenizer));
    if let Some(p) = &spec_policy {
        p.check_device(a.model.device())?;
    }
    let spec_name = spec_policy.as_ref().map(|p| p.name().to_owned());
    // On the GPU every slot runs one policy: a speculating server's is the drafter's.
    let default_policy = match spec_policy {
        Some(p) if gpu => p,
        _ => default_policy,
    };
    let tok = loaded.clone();
    let resolve = move |req: Option<&KvPolicyRequest>, context: usize| {
        let mut p = defaults.clone();
        let mut name = default_name.clone();
        if let Some(r) = req {
            if let Some(n) = &r.name {
                name = n.clone();
                let own = name == default_name || Some(&name) == spec_name.as_ref();
                if r.kv_budget.is_none() && !own {
                    // A budget belongs to the server's own policy (or its drafter's).
                    p.kv_budget = None;
                }
            }
            p.kv_budget = r.kv_budget.or(p.kv_budget);
            p.sinks = r.sinks.unwrap_or(p.sinks);
            p.sfi_recent = r.sfi_recent.unwrap_or(p.sfi_recent);
            p.sfi_refresh_interval = r.sfi_refresh_interval.unwrap_or(p.sfi_refresh_interval);
            p.sfi_min_gap = r.sfi_min_gap.unwrap_or(p.sfi_min_gap);
            if let Some(t) = &r.sfi_trigger {
                if !slowfast_engine::session::TriggerKind::NAMES.contains(&t.as_str()) {
                    return Err(format!(
                        "kv_policy.sfi_trigger `{t}` is not one of punct, periodic, random, off"
                    ));
                }
                p.sfi_trigger = t.clone();
            }
        }
        p.spec(&name, context)
            .map(|s| s.with_vocab(&tok.tokenizer))
            .map_err(|e| format!("kv_policy: {e:#}").replace("--", ""))
    };
    let device = a.model.device();
    let kv_dtype: KvDtype = a.model.kv();
    let kv_block = a
        .kv_block
        .unwrap_or_else(|| slowfast_engine::prefix::default_block(a.model.chunk));
    // On the GPU, 0: the device sizes its page pool from --gpu-memory-utilization.
    let kv_memory = a.kv_memory.unwrap_or_else(|| match gpu {
        true => 0,
        false => {
            a.max_batch
                * scheduler::kv_bytes_for(
                    &loaded.model,
                    max_context,
                    a.model.chunk,
                    kv_block,
                    kv_dtype,
                )
        }
    });

    // As much as the running sequences' KV on the CPU; on the GPU the whole page pool (its
    // cached pages are shared with the slots and evicted when they need the memory).
    let prefix_cache_bytes =
        a.prefix_cache_memory
            .unwrap_or(if gpu { usize::MAX } else { kv_memory });
    let sched_cfg = SchedulerConfig {
        device,
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        prefill_tokens_per_step: a.max_prefill_tokens,
        chunk: a.model.chunk,
        kv_dtype,
        kv_memory,
        kv_reserve: a.kv_reserve,
        gpu_memory_utilization: a.gpu_memory_utilization,
        max_context,
        default_policy,
        draft,
        prefix_cache_bytes,
        prefix_block: kv_block,
    };
    let (handle, _thread) = scheduler::spawn(loaded.clone(), sched_cfg)?;
    let cfg = ServerConfig {
        host: a.host,
        port: a.port,
        served_model_name: a.served_model_name.unwrap_or_else(|| a.model.model.clone()),
        api_key: a.api_key.filter(|k| !k.is_empty()),
        max_body_bytes: a.max_body_bytes,
        max_context,
        device: a.model.device.clone(),
        max_batch: a.max_batch,
        header_read_timeout: std::time::Duration::from_secs_f64(a.header_read_timeout),
        body_read_timeout: std::time::Duration::from_secs_f64(a.body_read_timeout),
        speculate,
        draft_model,
    };
    slowfast_server::run(cfg, loaded, handle, Arc::new(resolve))?;
    Ok(())
}
