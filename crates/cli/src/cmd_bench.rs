//! `slowfast bench`: prefill/decode throughput at several contexts, side by side.
use std::path::PathBuf;

use anyhow::{bail, Result};
use slowfast_engine::bench::{run as run_bench, table, BenchOptions};

use crate::common::{ModelArgs, PolicyArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated context lengths; a `k` suffix means x1024 (e.g. 2k,8k).
    #[arg(long, default_value = "2k,8k")]
    pub contexts: String,
    /// Decode steps timed per context.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Timed decode runs per context (the median is reported).
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Comma-separated KV policies, each timed at every context: full, streaming, h2o, snapkv,
    /// pyramidkv, quest, fastkv, sfi, sfi+fastkv (SFI's decode after FastKV's prefill, see
    /// --prefill; the others: `generate --help`). With `--device cuda`: full, streaming, sfi,
    /// snapkv, pyramidkv, quest, h2o, fastkv (its own whole-prompt prefill, timed, after the
    /// others; not with --real-prefill) and the oracles; SFI's slow step then comes every
    /// `--sfi-refresh-interval` steps per sequence (staggered over the batch), and fast and slow
    /// steps are also timed alone.
    #[arg(long, default_value = "full")]
    pub policies: String,
    /// Prefill only the last N prompt tokens of each context for real and fill the KV of the
    /// positions before them with pseudo-random values (decode speed does not depend on them;
    /// makes 32K+ decode benchmarks affordable on a CPU; on the GPU the positions get copies
    /// of the first 8192 tokens' KV, for 256K+ contexts). Prefill tok/s then covers those N
    /// tokens only. Default: prefill the whole context.
    #[arg(long)]
    pub real_prefill: Option<usize>,
    #[command(flatten)]
    pub sparse: PolicyArgs,
    /// Sequences decoded together (`--device cuda` only; each holds a copy of the prompt; the
    /// CPU's --speculate rounds are batch 1 too).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// The KV cache paged as `serve` keeps it instead of allocated whole: with `--device cuda`
    /// in pages mapped as the sequences grow (same kernels); on the CPU in blocks of 128 tokens
    /// (`serve --kv-block`'s default) read through block tables.
    #[arg(long)]
    pub paged_kv: bool,
    /// Write the records as a JSON array to this file (with --speculate: an object, `runs`
    /// and `speculative`).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also time speculative decoding at every context, for these comma-separated drafters
    /// (sfi, streaming, ngram), each at every --spec-tokens (on the GPU batched over --batch
    /// sequences). The acceptance is replayed (--spec-accept) and labelled so: a random-weight
    /// model's drafts mean nothing. Put `full` in --policies for the speedup column. Real
    /// end-to-end runs: `generate --speculate`.
    #[arg(long)]
    pub speculate: Option<String>,
    /// With --speculate: comma-separated drafted tokens per verification (γ), each timed.
    #[arg(long, default_value = "2,4,6,8")]
    pub spec_tokens: String,
    /// With --speculate: accepted lengths to replay: `alpha:A` (each draft accepted with
    /// probability A until the first rejection) or a JSON file {drafter: {γ: [counts of
    /// verifications accepting 0..=γ]}} (the `accept_hist` of `generate --speculate --json`).
    #[arg(long, default_value = "alpha:0.9")]
    pub spec_accept: String,
    /// With --speculate sfi: refresh the Selector's memory from `every` verification, or on
    /// `trigger` (on the GPU every --sfi-refresh-interval tokens a sequence, the GPU bench's
    /// trigger; on the CPU SFI's own trigger over the kept tokens).
    #[arg(long, default_value = "every", value_parser = ["every", "trigger"])]
    pub spec_refresh: String,
    /// With --speculate: verification rounds timed per drafter and γ.
    #[arg(long, default_value_t = 32)]
    pub spec_rounds: usize,
    /// With --speculate on --device cuda: verifications replay CUDA graphs (`on`, the default,
    /// as generate and serve run them) or launch kernel by kernel (`off`, to measure what the
    /// graphs save).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub spec_graphs: String,
}

/// Parse "2k,8k,32768" into token counts (`slowfast_engine::session::parse_contexts`).
pub fn parse_contexts(s: &str) -> Result<Vec<usize>> {
    Ok(slowfast_engine::session::parse_contexts(s)?)
}

pub fn run(a: Args) -> Result<()> {
    a.model.whole_model_only("bench")?;
    let contexts = parse_contexts(&a.contexts)?;
    if a.new_tokens == 0 {
        bail!("--new-tokens must be at least 1");
    }
    let o = BenchOptions {
        contexts,
        new_tokens: a.new_tokens,
        kv_dtype: a.model.kv(),
        chunk: a.model.chunk,
        repeats: a.repeats,
        policies: a.policies.split(',').map(|p| p.trim().to_owned()).collect(),
        real_prefill: a.real_prefill,
        kv_block: a
            .paged_kv
            .then_some(slowfast_engine::prefix::default_block(a.model.chunk)),
    };
    if a.real_prefill == Some(0) {
        bail!("--real-prefill must be at least 1 (the last prompt tokens run through the model)");
    }
    // Check every policy against every context before the (slow) model load.
    for &c in &o.contexts {
        for p in &o.policies {
            a.sparse.spec(p, c)?;
        }
    }
    let spec = spec_options(&a)?;
    if let Some(so) = &spec {
        for &c in &o.contexts {
            for d in &so.drafters {
                a.sparse
                    .spec(slowfast_engine::spec::timing::drafter_policy(d), c)?;
            }
        }
    }
    if a.model.device() == slowfast_engine::Device::Cuda {
        return run_cuda(&a, o, spec);
    }
    if a.batch != 1 {
        bail!("--batch: batched decode runs on --device cuda only");
    }
    let m = a.model.load()?;
    let spec_for = |name: &str, ctx: usize| policy_for(&a, &m, name, ctx);
    let recs = run_bench(&m, &o, &spec_for, &mut |s| eprintln!("{s}"))?;
    print!("{}", table(&recs));
    let Some(so) = spec else {
        return write_json(&a.json, &recs);
    };
    let spec_recs =
        slowfast_engine::bench::run_spec(&m, &o, &so, &spec_for, &recs, &mut |s| eprintln!("{s}"))?;
    println!();
    print!("{}", slowfast_engine::spec::timing::table(&spec_recs));
    write_json(
        &a.json,
        &serde_json::json!({ "runs": recs, "speculative": spec_recs }),
    )
}

/// The policy `name` at context `ctx` from the command line, with the model's vocabulary.
fn policy_for(
    a: &Args,
    m: &slowfast_engine::Loaded,
    name: &str,
    ctx: usize,
) -> Result<slowfast_engine::PolicySpec, slowfast_engine::EngineError> {
    a.sparse
        .spec(name, ctx)
        .map(|s| s.with_vocab(&m.tokenizer))
        .map_err(|e| slowfast_engine::EngineError::BadInput(format!("{e:#}")))
}

fn write_json<T: serde::Serialize>(p: &Option<PathBuf>, recs: &T) -> Result<()> {
    if let Some(p) = p {
        std::fs::write(p, serde_json::to_string_pretty(recs)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_cuda(
    a: &Args,
    o: BenchOptions,
    spec: Option<slowfast_engine::spec::timing::ReplayOptions>,
) -> Result<()> {
    use slowfast_engine::cuda::{bench, gpu_policy, table, GpuBenchOptions};
    // The policies that run on the GPU (checked before the model load).
    for &c in &o.contexts {
        for p in &o.policies {
            gpu_policy(&a.sparse.spec(p, c)?)?;
        }
    }
    let m = a.model.load()?;
    let go = GpuBenchOptions {
        contexts: o.contexts,
        new_tokens: o.new_tokens,
        batch: a.batch,
        repeats: o.repeats,
        policies: o.policies,
        paged: a.paged_kv,
        real_prefill: a.real_prefill,
        kv_dtype: a.model.kv(),
    };
    let spec_for = |name: &str, ctx: usize| policy_for(a, &m, name, ctx);
    let (recs, spec_recs) = bench(&m, &go, spec.as_ref(), &spec_for, &mut |s| eprintln!("{s}"))?;
    print!("{}", table(&recs));
    if spec.is_none() {
        return write_json(&a.json, &recs);
    }
    println!();
    print!("{}", slowfast_engine::spec::timing::table(&spec_recs));
    write_json(
        &a.json,
        &serde_json::json!({ "runs": recs, "speculative": spec_recs }),
    )
}

/// `--speculate` and its flags, checked before the model load.
fn spec_options(a: &Args) -> Result<Option<slowfast_engine::spec::timing::ReplayOptions>> {
    use slowfast_engine::spec::replay::AcceptModel;
    let Some(list) = &a.speculate else {
        return Ok(None);
    };
    let drafters: Vec<String> = list.split(',').map(|d| d.trim().to_owned()).collect();
    for d in &drafters {
        if !slowfast_engine::spec::timing::BENCH_DRAFTERS.contains(&d.as_str()) {
            bail!("--speculate: `{d}` is not a drafter the bench times (sfi, streaming, ngram)");
        }
    }
    let mut gammas = Vec::new();
    for g in a.spec_tokens.split(',') {
        match g.trim().parse::<usize>() {
            Ok(n) if (1..=slowfast_engine::spec::MAX_SPEC_TOKENS).contains(&n) => gammas.push(n),
            _ => bail!(
                "--spec-tokens: `{g}` is not a count in 1..={}",
                slowfast_engine::spec::MAX_SPEC_TOKENS
            ),
        }
    }
    if a.spec_rounds == 0 {
        bail!("--spec-rounds must be at least 1");
    }
    if a.spec_graphs == "off" && a.model.device() != slowfast_engine::Device::Cuda {
        bail!("--spec-graphs off: verification graphs exist on --device cuda only");
    }
    let accept = AcceptModel::parse(&a.spec_accept).map_err(anyhow::Error::msg)?;
    for d in &drafters {
        accept.check(d, &gammas).map_err(anyhow::Error::msg)?;
    }
    Ok(Some(slowfast_engine::spec::timing::ReplayOptions {
        drafters,
        gammas,
        accept,
        refresh_every: a.spec_refresh == "every",
        rounds: a.spec_rounds,
        verify_graphs: a.spec_graphs == "on",
    }))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _a: &Args,
    _o: BenchOptions,
    _spec: Option<slowfast_engine::spec::timing::ReplayOptions>,
) -> Result<()> {
    Err(slowfast_engine::device::not_built().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_parse() {
        assert_eq!(parse_contexts("2k,8K, 100").unwrap(), vec![2048, 8192, 100]);
        assert!(parse_contexts("2k,x").is_err());
        assert!(parse_contexts("0").is_err());
    }
}
