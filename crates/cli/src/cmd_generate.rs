//! `slowfast generate`: stream a continuation (or a chat reply) of a prompt.
use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Result};
use slowfast_engine::generate::{generate_with_draft, GenerateOptions};
use slowfast_engine::sampler::SamplerConfig;
use slowfast_tokenizer::ChatMessage;

use crate::common::{read_text, ModelArgs, PolicyArgs, SpecArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(
        long,
        short = 'p',
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt from a UTF-8 file.
    #[arg(long, short = 'f')]
    pub prompt_file: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Drop tokens less likely than MIN_P times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalty for tokens seen in the last --repeat-last-n tokens (1 = off; alias --repeat-penalty).
    #[arg(
        long,
        alias = "repeat-penalty",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub repetition_penalty: f32,
    /// Window of the repetition, presence and frequency penalties.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtract P from the logit of every token seen in the last --repeat-last-n tokens
    /// (OpenAI's presence_penalty, in [-2, 2]; 0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract F times its count in the last --repeat-last-n tokens from each token's logit
    /// (OpenAI's frequency_penalty, in [-2, 2]; 0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this string appears (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// KV policy: full (dense attention), streaming (sinks + recent window), h2o (heavy
    /// hitters + recent, evicting while decoding), snapkv (compress once after prefill),
    /// pyramidkv (snapkv with per-layer budgets shrinking with depth), quest (query-aware
    /// top pages, nothing evicted), fastkv (token-selective propagation in prefill, see
    /// --fastkv-*, then snapkv-style retention), sfi (Slow-Fast) or sfi+fastkv (SFI's decode
    /// after FastKV's prefill; same as `--policy sfi --prefill fastkv`). All but full need
    /// --kv-budget.
    #[arg(long, default_value = "full")]
    pub policy: String,
    #[command(flatten)]
    pub sparse: PolicyArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Print one JSON object with the text and timings at the end instead of streaming.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let seed = a.seed.unwrap_or_else(SamplerConfig::clock_seed);
    let sampler = SamplerConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        repeat_last_n: a.repeat_last_n,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        seed,
    };
    // Validate everything the user typed before the (slow) model load.
    sampler.validate()?;
    let speculate = a.spec.options()?;
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_text(f)?,
        (None, None) => bail!("give --prompt or --prompt-file"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let m = a.model.load()?;
    let draft = a.spec.load_draft()?;
    let text = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::new("system", s.clone()));
        }
        msgs.push(ChatMessage::new("user", prompt));
        m.tokenizer.apply_chat_template(&msgs, true)?
    } else {
        prompt
    };
    let ids = m.tokenizer.encode_with(&text, true, a.chat)?;
    let context = ids.len() + a.max_new_tokens;
    let policy = match a.spec.session_policy(&a.policy, &a.sparse, context)? {
        Some(p) => p,
        None => a.sparse.spec(&a.policy, context)?,
    }
    .with_vocab(&m.tokenizer);
    let opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        sampler,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        kv_dtype: a.model.kv(),
        chunk: a.model.chunk,
        policy,
        device: a.model.device(),
        speculate,
    };
    let stdout = std::io::stdout();
    let json = a.json;
    let out = generate_with_draft(&m, draft.as_ref(), &ids, &opts, &mut |piece| {
        if !json {
            let mut o = stdout.lock();
            let _ = o.write_all(piece.as_bytes());
            let _ = o.flush();
        }
    })?;
    if json {
        let v = serde_json::json!({
            "text": out.text,
            "model": m.name,
            "policy": out.policy,
            "slow_steps": out.policy_stats.slow_steps,
            "fast_steps": out.policy_stats.fast_steps,
            "mean_attended_tokens": out.policy_stats.mean_attended(),
            "retained_fraction": out.policy_stats.retained_fraction(),
            "device": a.model.device,
            "prompt_tokens": out.prompt_tokens,
            "generated_tokens": out.generated_tokens,
            "prefill_tok_s": out.prefill_tok_s,
            "decode_tok_s": out.decode_tok_s,
            "prefill_seconds": out.prefill_seconds,
            "decode_seconds": out.decode_seconds,
            "stop_reason": out.stop_reason,
            "kv_bytes": out.kv_bytes,
            "seed": seed,
            "tokens": out.tokens,
            "speculative": out.speculative,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; stop: {:?}]",
            out.prompt_tokens,
            out.prefill_tok_s,
            out.generated_tokens,
            out.decode_tok_s,
            out.stop_reason
        );
        if let Some(r) = &out.speculative {
            eprintln!(
                "[speculative ({}, {} tokens): {} drafted, {} accepted ({:.1} %), {:.2} tokens per verification]",
                r.drafter,
                r.spec_tokens,
                r.stats.drafted,
                r.stats.accepted,
                100.0 * r.acceptance_rate,
                r.tokens_per_verification
            );
        }
    }
    Ok(())
}
