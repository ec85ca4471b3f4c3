//! `slowfast info` and `slowfast fetch`.
use anyhow::{anyhow, Result};
use slowfast_loader::fetch::{fetch as fetch_model, known_model, known_model_names};

use crate::common::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// Model to fetch: gemma3-270m (the default model, 253 MB) or smollm2-135m (98 MB).
    #[arg(default_value = "gemma3-270m")]
    pub name: String,
}

pub fn fetch(a: FetchArgs) -> Result<()> {
    let m = known_model(&a.name).ok_or_else(|| {
        anyhow!(
            "unknown model `{}` (known: {})",
            a.name,
            known_model_names()
        )
    })?;
    let p = fetch_model(m, &mut |s| eprintln!("{s}"))?;
    println!("{}", p.display());
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn info(a: InfoArgs) -> Result<()> {
    let m = a.model.load()?;
    let c = &m.model.cfg;
    let w = &m.model.weights;
    let kv_per_token_f16 = c.kv_values_per_token() * 2;
    let global_layers = c.layer_sliding.iter().filter(|s| !**s).count();
    let kv_per_token_global = 2 * global_layers * c.num_key_value_heads * c.head_dim * 2;
    let dtypes: Vec<String> = w
        .dtype_summary()
        .iter()
        .map(|(t, b)| format!("{} {:.1} MB", t.name(), *b as f64 / 1e6))
        .collect();
    let v = serde_json::json!({
        "model": m.name,
        "architecture": c.arch.name(),
        "parameters": c.num_parameters(),
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "context_length": c.max_position_embeddings,
        "sliding_window": c.sliding_window,
        "sliding_layers": c.layer_sliding.iter().filter(|s| **s).count(),
        "weight_bytes": w.nbytes(),
        "weight_dtypes": dtypes,
        "kv_bytes_per_token_f16_all_layers": kv_per_token_f16,
        "kv_bytes_per_token_f16_global_layers": kv_per_token_global,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "qkv_bias": c.arch.qkv_bias(),
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("model:            {}", m.name);
    println!("architecture:     {}", c.arch.name());
    println!("parameters:       {:.1} M", c.num_parameters() as f64 / 1e6);
    println!(
        "layers:           {} (hidden {}, {} heads, {} kv heads, head_dim {}, mlp {})",
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size
    );
    println!("vocabulary:       {}", c.vocab_size);
    println!("context length:   {}", c.max_position_embeddings);
    if c.arch.qkv_bias() {
        println!("attention:        q/k/v projections with biases");
    }
    if let Some(wd) = c.sliding_window {
        println!(
            "sliding window:   {wd} tokens on {} of {} layers",
            c.layer_sliding.iter().filter(|s| **s).count(),
            c.num_hidden_layers
        );
    }
    println!(
        "weights:          {:.1} MB ({})",
        w.nbytes() as f64 / 1e6,
        dtypes.join(", ")
    );
    println!(
        "KV bytes/token:   {} (f16, all layers); {} in global layers (sliding layers hold at most their window)",
        kv_per_token_f16, kv_per_token_global
    );
    Ok(())
}
