//! Flags shared by several commands and small helpers.
use anyhow::{bail, Context, Result};
use slowfast_engine::{KvDtype, Loaded};

/// Model and runtime flags common to generate, eval and bench.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a .gguf file, an HF directory, random:<preset>[@dtype], hf:<org>/<repo>, or gemma3-270m.
    #[arg(long, short = 'm', default_value = slowfast_engine::DEFAULT_MODEL)]
    pub model: String,
    /// Compute device. `cuda` needs a build with `--features cuda` and an NVIDIA GPU.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Element type of the KV cache.
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    pub kv_dtype: String,
    /// Prompt tokens per prefill forward pass.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
}

impl ModelArgs {
    pub fn kv(&self) -> KvDtype {
        self.kv_dtype.parse().expect("clap restricts the values")
    }

    /// Check the device and load the model (fetching the default model on first use).
    pub fn load(&self) -> Result<Loaded> {
        if self.device == "cuda" {
            bail!(
                "--device cuda: the CUDA engine is not wired into the decoder yet; this build runs models on the CPU only (use --device cpu)"
            );
        }
        if self.chunk == 0 {
            bail!("--chunk must be at least 1");
        }
        let t = std::time::Instant::now();
        let m = slowfast_engine::load(&self.model, &mut |s| eprintln!("{s}"))
            .with_context(|| format!("loading model `{}`", self.model))?;
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
    /// KV budget of a sparse policy: tokens, or a fraction of the context when below 1.
    #[arg(long)]
    pub kv_budget: Option<f64>,
    /// Attention-sink tokens kept by the streaming policy.
    #[arg(long, default_value_t = 4)]
    pub sinks: usize,
}
