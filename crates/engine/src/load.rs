//! Resolving a `--model` argument (a .gguf path, an HF directory, `random:<preset>`, the aliases
//! of the fetchable models `gemma3-270m` and `smollm2-135m`, `hf:<org>/<repo>[@rev]` or a bare `org/repo`, through the Hugging Face cache) into a loaded model and its tokenizer.
use std::path::{Path, PathBuf};

use slowfast_loader::fetch::{ensure, known_model, known_model_names};
use slowfast_model::load::{load_model, ModelSource};
use slowfast_model::Model;
use slowfast_quant::GgmlType;
use slowfast_tokenizer::Tokenizer;

use crate::EngineError;

/// The alias of the default model.
pub const DEFAULT_MODEL: &str = "gemma3-270m";

/// A model with its tokenizer, ready to run.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// How the user named it (for reports).
    pub name: String,
    /// Ranks a session splits the model over (`--tensor-parallel`; 1: the whole model). On
    /// the CPU the ranks are threads (`crate::tp`); see [`Loaded::set_tensor_parallel`].
    pub tensor_parallel: usize,
}

impl Loaded {
    /// Split sessions of this model over `n` ranks, after checking that it splits (heads, kv
    /// heads, MLP columns, quant blocks); 1 is the whole model.
    pub fn set_tensor_parallel(&mut self, n: usize) -> Result<(), EngineError> {
        if n == 0 {
            return Err(EngineError::BadInput(
                "--tensor-parallel must be at least 1".into(),
            ));
        }
        if n > 1 {
            crate::tp::check(&self.model, n)?;
        }
        self.tensor_parallel = n;
        Ok(())
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("name", &self.name)
            .field("arch", &self.model.cfg.arch.name())
            .finish_non_exhaustive()
    }
}

/// Parse `random:<preset>[@<dtype>]` (dtype: bf16 (default), f16, f32, q8_0, q4_k, ...).
fn parse_random(spec: &str) -> Result<ModelSource, EngineError> {
    let (preset, ty) = match spec.split_once('@') {
        Some((p, t)) => (p, t),
        None => (spec, "bf16"),
    };
    let ty = GgmlType::ALL
        .iter()
        .copied()
        .find(|g| g.name().eq_ignore_ascii_case(ty) && g.is_quantizable())
        .ok_or_else(|| {
            EngineError::BadInput(format!(
                "random:{spec}: unknown weight type `{ty}` for random weights (they are \
                 quantized here, in one of: {})",
                GgmlType::quantizable_names().to_ascii_lowercase()
            ))
        })?;
    Ok(ModelSource::Random {
        preset: preset.to_owned(),
        ty,
    })
}

/// Turn a model argument into a source, fetching the default model if needed.
pub fn resolve(spec: &str, progress: &mut dyn FnMut(&str)) -> Result<ModelSource, EngineError> {
    if let Some(m) = known_model(spec) {
        return Ok(ModelSource::Gguf(ensure(m, progress)?));
    }
    if let Some(p) = spec.strip_prefix("random:") {
        return parse_random(p);
    }
    if let Some(repo) = spec.strip_prefix("hf:") {
        let cfg = crate::hub::HubConfig::from_env();
        return Ok(ModelSource::HfDir(crate::hub::resolve(
            repo, &cfg, progress,
        )?));
    }
    let path = PathBuf::from(spec);
    if path.is_dir() {
        return Ok(ModelSource::HfDir(path));
    }
    if path.is_file() {
        return Ok(ModelSource::Gguf(path));
    }
    // A bare `org/repo[@rev]` that is no local path: the same as `hf:org/repo`.
    if looks_like_repo_id(spec) {
        let cfg = crate::hub::HubConfig::from_env();
        return crate::hub::resolve(spec, &cfg, progress)
            .map(ModelSource::HfDir)
            .map_err(|e| {
                EngineError::BadInput(format!(
                    "model `{spec}` is no local file or directory; as a hub repo id: {e}"
                ))
            });
    }
    Err(EngineError::BadInput(format!(
        "model `{spec}` not found: expected a .gguf file, an HF model directory, hf:<org>/<repo>, random:<preset> or a fetchable model ({})",
        known_model_names()
    )))
}

/// `org/repo[@rev]` that cannot be meant as a file path (no leading `.`, `/` or `~`, not `.gguf`).
fn looks_like_repo_id(spec: &str) -> bool {
    !spec.starts_with(['.', '/', '~'])
        && !spec.to_ascii_lowercase().ends_with(".gguf")
        && crate::hub::parse_repo(spec).is_ok()
}

fn tokenizer_for(src: &ModelSource, model: &Model) -> Result<Tokenizer, EngineError> {
    Ok(match src {
        ModelSource::Gguf(p) => Tokenizer::from_gguf_path(p)?,
        ModelSource::HfDir(d) => {
            if !d.join("tokenizer.json").is_file() {
                return Err(EngineError::BadInput(format!(
                    "{}: missing tokenizer.json (the HF directory needs its tokenizer)",
                    d.display()
                )));
            }
            Tokenizer::from_hf_dir(d)?
        }
        ModelSource::Random { .. } => Tokenizer::byte_level(model.cfg.vocab_size)?,
    })
}

/// Load the model and tokenizer named by `spec`.
pub fn load(spec: &str, progress: &mut dyn FnMut(&str)) -> Result<Loaded, EngineError> {
    let src = resolve(spec, progress)?;
    if let ModelSource::Gguf(p) = &src {
        check_gguf_path(p)?;
    }
    let model = load_model(&src)?;
    let tokenizer = tokenizer_for(&src, &model)?;
    Ok(Loaded {
        model,
        tokenizer,
        name: spec.to_owned(),
        tensor_parallel: 1,
    })
}

fn check_gguf_path(p: &Path) -> Result<(), EngineError> {
    let mut magic = [0u8; 4];
    use std::io::Read;
    let mut f = std::fs::File::open(p)
        .map_err(|e| EngineError::BadInput(format!("{}: {e}", p.display())))?;
    if f.read_exact(&mut magic).is_err() || &magic != b"GGUF" {
        return Err(EngineError::BadInput(format!(
            "{}: not a GGUF file (no GGUF magic); pass a .gguf file, an HF directory or random:<preset>",
            p.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_weight_types_are_the_quantizable_ones() {
        for t in GgmlType::QUANTIZABLE {
            let spec = format!("qwen3-0.6b@{}", t.name().to_ascii_lowercase());
            match parse_random(&spec).unwrap() {
                ModelSource::Random { ty, .. } => assert_eq!(ty, *t),
                _ => unreachable!(),
            }
        }
        let Err(EngineError::BadInput(msg)) = parse_random("qwen3-0.6b@iq2_xxs") else {
            panic!("iq2_xxs accepted")
        };
        assert!(msg.contains("q4_k") && msg.contains("q8_0"), "{msg}");
        // Q3_K loads from files but has no quantizer: refused here by name, not at build time
        let Err(EngineError::BadInput(msg)) = parse_random("qwen3-0.6b@q3_k") else {
            panic!("q3_k accepted")
        };
        assert!(msg.contains("`q3_k`") && !msg.contains("q3_k,"), "{msg}");
    }

    #[test]
    fn unknown_names_list_the_fetchable_models() {
        let Err(EngineError::BadInput(msg)) = resolve("no-such-model.gguf", &mut |_| {}) else {
            panic!("resolved")
        };
        assert!(msg.contains("gemma3-270m, smollm2-135m"), "{msg}");
    }
}
