//! Turning a checkpoint into `ModelWeights`: GGUF files, HF safetensors directories and
//! deterministic random weights all end in the same structure (the loader maps names).
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::Dtype;
use slowfast_loader::gguf::GgufFile;
use slowfast_loader::safetensors::SafetensorsSet;
use slowfast_quant::GgmlType;

use crate::config::{Arch, ModelConfig};
use crate::weights::{Bytes, LayerWeights, ModelWeights, Weight};
use crate::ModelError;

/// A weight's role in the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Embed,
    Output,
    FinalNorm,
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    PostAttnNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
    PostFfwNorm,
}

fn gguf_name(role: Role, layer: usize) -> String {
    let s = match role {
        Role::Embed => return "token_embd.weight".into(),
        Role::Output => return "output.weight".into(),
        Role::FinalNorm => return "output_norm.weight".into(),
        Role::AttnNorm => "attn_norm",
        Role::Q => "attn_q",
        Role::K => "attn_k",
        Role::V => "attn_v",
        Role::O => "attn_output",
        Role::QBias => return format!("blk.{layer}.attn_q.bias"),
        Role::KBias => return format!("blk.{layer}.attn_k.bias"),
        Role::VBias => return format!("blk.{layer}.attn_v.bias"),
        Role::QNorm => "attn_q_norm",
        Role::KNorm => "attn_k_norm",
        Role::PostAttnNorm => "post_attention_norm",
        Role::FfnNorm => "ffn_norm",
        Role::Gate => "ffn_gate",
        Role::Up => "ffn_up",
        Role::Down => "ffn_down",
        Role::PostFfwNorm => "post_ffw_norm",
    };
    format!("blk.{layer}.{s}.weight")
}

fn hf_name(arch: Arch, role: Role, layer: usize) -> String {
    let s = match role {
        Role::Embed => return "model.embed_tokens.weight".into(),
        Role::Output => return "lm_head.weight".into(),
        Role::FinalNorm => return "model.norm.weight".into(),
        Role::AttnNorm => "input_layernorm",
        Role::Q => "self_attn.q_proj",
        Role::K => "self_attn.k_proj",
        Role::V => "self_attn.v_proj",
        Role::O => "self_attn.o_proj",
        Role::QBias => return format!("model.layers.{layer}.self_attn.q_proj.bias"),
        Role::KBias => return format!("model.layers.{layer}.self_attn.k_proj.bias"),
        Role::VBias => return format!("model.layers.{layer}.self_attn.v_proj.bias"),
        Role::QNorm => "self_attn.q_norm",
        Role::KNorm => "self_attn.k_norm",
        Role::PostAttnNorm => "post_attention_layernorm",
        // Llama/Qwen call the pre-MLP norm `post_attention_layernorm`.
        Role::FfnNorm if arch == Arch::Gemma3 => "pre_feedforward_layernorm",
        Role::FfnNorm => "post_attention_layernorm",
        Role::Gate => "mlp.gate_proj",
        Role::Up => "mlp.up_proj",
        Role::Down => "mlp.down_proj",
        Role::PostFfwNorm => "post_feedforward_layernorm",
    };
    format!("model.layers.{layer}.{s}.weight")
}

/// Where weights come from.
trait Source {
    /// The tensor as a matrix `[rows, cols]`, or `None` when absent.
    fn matrix(&self, name: &str) -> Result<Option<Weight>, ModelError>;
    fn describe(&self) -> String;
}

struct GgufSource<'a>(&'a GgufFile);

impl Source for GgufSource<'_> {
    fn matrix(&self, name: &str) -> Result<Option<Weight>, ModelError> {
        let Some(info) = self.0.tensor_info(name) else {
            return Ok(None);
        };
        let ty = GgmlType::from_id(info.ggml_type).ok_or_else(|| {
            ModelError::Weights(format!("`{name}`: unknown ggml type id {}", info.ggml_type))
        })?;
        let cols = info.dims[0] as usize;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        let data = Bytes::Mapped {
            map: self.0.shared_mmap(),
            start: info.offset as usize,
            len: info.size as usize,
        };
        Weight::new(ty, rows, cols, data, name).map(Some)
    }
    fn describe(&self) -> String {
        self.0.path().display().to_string()
    }
}

struct StSource<'a>(&'a SafetensorsSet);

impl Source for StSource<'_> {
    fn matrix(&self, name: &str) -> Result<Option<Weight>, ModelError> {
        let Some(t) = self.0.get(name) else {
            return Ok(None);
        };
        let ty = match t.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            d => {
                return Err(ModelError::Weights(format!(
                    "`{name}`: dtype {d:?} is not supported (F32, F16, BF16)"
                )))
            }
        };
        let (rows, cols) = match t.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            s => {
                return Err(ModelError::Weights(format!(
                    "`{name}`: unexpected shape {s:?}"
                )))
            }
        };
        let data = Bytes::Mapped {
            map: Arc::clone(&self.0.shards[t.shard].1),
            start: t.start,
            len: t.end - t.start,
        };
        Weight::new(ty, rows, cols, data, name).map(Some)
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

struct Loader<'a> {
    src: &'a dyn Source,
    cfg: &'a ModelConfig,
    name: &'a dyn Fn(Role, usize) -> String,
    /// HF Gemma stores norm weights as w in (1 + w); GGUF stores 1 + w.
    norm_offset: f32,
}

impl Loader<'_> {
    fn opt(&self, role: Role, layer: usize) -> Result<Option<Weight>, ModelError> {
        self.src.matrix(&(self.name)(role, layer))
    }
    fn req(
        &self,
        role: Role,
        layer: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Weight, ModelError> {
        let name = (self.name)(role, layer);
        let w = self.src.matrix(&name)?.ok_or_else(|| {
            ModelError::Weights(format!(
                "tensor `{name}` not found in {}",
                self.src.describe()
            ))
        })?;
        if (w.rows, w.cols) != (rows, cols) {
            return Err(ModelError::Weights(format!(
                "tensor `{name}` has shape [{}, {}], expected [{rows}, {cols}] for this config",
                w.rows, w.cols
            )));
        }
        Ok(w)
    }
    fn norm(&self, role: Role, layer: usize, n: usize) -> Result<Vec<f32>, ModelError> {
        let w = self.req(role, layer, 1, n)?;
        Ok(w.to_f32()
            .into_iter()
            .map(|x| x + self.norm_offset)
            .collect())
    }

    /// A bias vector `[n]` (stored as f32 whatever the file's type).
    fn bias(&self, role: Role, layer: usize, n: usize) -> Result<Vec<f32>, ModelError> {
        Ok(self.req(role, layer, 1, n)?.to_f32())
    }

    fn load(&self) -> Result<ModelWeights, ModelError> {
        let c = self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let embed = self.req(Role::Embed, 0, c.vocab_size, h)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(match self.opt(Role::Output, 0)? {
                Some(_) => self.req(Role::Output, 0, c.vocab_size, h)?,
                None => {
                    return Err(ModelError::Weights(format!(
                        "the config says the output head is not tied, but `{}` is missing from {}",
                        (self.name)(Role::Output, 0),
                        self.src.describe()
                    )))
                }
            })
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let gemma = c.post_norms;
            let bias = c.arch.qkv_bias();
            layers.push(LayerWeights {
                attn_norm: self.norm(Role::AttnNorm, l, h)?,
                wq: self.req(Role::Q, l, q_dim, h)?,
                wk: self.req(Role::K, l, kv_dim, h)?,
                wv: self.req(Role::V, l, kv_dim, h)?,
                wo: self.req(Role::O, l, h, q_dim)?,
                bq: bias.then(|| self.bias(Role::QBias, l, q_dim)).transpose()?,
                bk: bias
                    .then(|| self.bias(Role::KBias, l, kv_dim))
                    .transpose()?,
                bv: bias
                    .then(|| self.bias(Role::VBias, l, kv_dim))
                    .transpose()?,
                q_norm: c
                    .qk_norm
                    .then(|| self.norm(Role::QNorm, l, hd))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| self.norm(Role::KNorm, l, hd))
                    .transpose()?,
                post_attn_norm: gemma
                    .then(|| self.norm(Role::PostAttnNorm, l, h))
                    .transpose()?,
                ffn_norm: self.norm(Role::FfnNorm, l, h)?,
                w_gate: self.req(Role::Gate, l, c.intermediate_size, h)?,
                w_up: self.req(Role::Up, l, c.intermediate_size, h)?,
                w_down: self.req(Role::Down, l, h, c.intermediate_size)?,
                post_ffw_norm: gemma
                    .then(|| self.norm(Role::PostFfwNorm, l, h))
                    .transpose()?,
            });
        }
        Ok(ModelWeights {
            embed,
            layers,
            final_norm: self.norm(Role::FinalNorm, 0, h)?,
            lm_head,
        })
    }
}

/// Row order that undoes llama.cpp's q/k permutation for Llama GGUFs (which interleave the
/// rotary pairs): GGUF row `h*hd + 2i + j` holds HF row `h*hd + j*hd/2 + i`.
fn unpermute_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut perm = vec![0; n_heads * head_dim];
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                perm[h * head_dim + j * half + i] = h * head_dim + 2 * i + j;
            }
        }
    }
    perm
}

/// Load weights from an opened GGUF file.
pub fn weights_from_gguf(g: &GgufFile, cfg: &ModelConfig) -> Result<ModelWeights, ModelError> {
    let src = GgufSource(g);
    let mut w = Loader {
        src: &src,
        cfg,
        name: &gguf_name,
        norm_offset: 0.0,
    }
    .load()?;
    if cfg.arch == Arch::Llama {
        let pq = unpermute_rows(cfg.num_attention_heads, cfg.head_dim);
        let pk = unpermute_rows(cfg.num_key_value_heads, cfg.head_dim);
        for l in &mut w.layers {
            l.wq = l.wq.permute_rows(&pq);
            l.wk = l.wk.permute_rows(&pk);
        }
    }
    Ok(w)
}

/// Load weights from an HF directory's safetensors.
pub fn weights_from_safetensors(dir: &Path, cfg: &ModelConfig) -> Result<ModelWeights, ModelError> {
    let set = SafetensorsSet::open_dir(dir)?;
    let src = StSource(&set);
    let arch = cfg.arch;
    let name = move |r: Role, l: usize| hf_name(arch, r, l);
    Loader {
        src: &src,
        cfg,
        name: &name,
        norm_offset: if arch == Arch::Gemma3 { 1.0 } else { 0.0 },
    }
    .load()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        // llama.cpp's converter: w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2) — HF row
        // (h, j, i) moves to GGUF row (h, i, j).
        let (nh, hd) = (3, 8);
        let hf: Vec<usize> = (0..nh * hd).collect();
        let mut gguf = vec![0; nh * hd];
        for h in 0..nh {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    gguf[h * hd + 2 * i + j] = hf[h * hd + j * hd / 2 + i];
                }
            }
        }
        let perm = unpermute_rows(nh, hd);
        let back: Vec<usize> = perm.iter().map(|&p| gguf[p]).collect();
        assert_eq!(back, hf);
    }

    /// Tensors by name, for loading without a file.
    struct MapSource(std::collections::HashMap<String, Weight>);

    impl Source for MapSource {
        fn matrix(&self, name: &str) -> Result<Option<Weight>, ModelError> {
            Ok(self.0.get(name).cloned())
        }
        fn describe(&self) -> String {
            "the test tensors".into()
        }
    }

    #[test]
    fn qwen2_biases_load_by_gguf_name_and_bad_ones_are_named() {
        let cfg = crate::presets::qwen2(64, 2, 4, 2, 16, 32, 48, true);
        let rand = |rows: usize, cols: usize, seed: u64| {
            crate::random::random_weight(GgmlType::F32, rows, cols, 0.5, seed).unwrap()
        };
        let mut t = std::collections::HashMap::new();
        let mut put = |role: Role, layer: usize, rows: usize, cols: usize| {
            let seed = t.len() as u64;
            t.insert(gguf_name(role, layer), rand(rows, cols, seed));
        };
        put(Role::Embed, 0, 48, 64);
        put(Role::FinalNorm, 0, 1, 64);
        for l in 0..2 {
            for (role, rows, cols) in [
                (Role::AttnNorm, 1, 64),
                (Role::Q, 64, 64),
                (Role::K, 32, 64),
                (Role::V, 32, 64),
                (Role::QBias, 1, 64),
                (Role::KBias, 1, 32),
                (Role::VBias, 1, 32),
                (Role::O, 64, 64),
                (Role::FfnNorm, 1, 64),
                (Role::Gate, 32, 64),
                (Role::Up, 32, 64),
                (Role::Down, 64, 32),
            ] {
                put(role, l, rows, cols);
            }
        }
        let load = |t: &std::collections::HashMap<String, Weight>| {
            let src = MapSource(t.clone());
            Loader {
                src: &src,
                cfg: &cfg,
                name: &gguf_name,
                norm_offset: 0.0,
            }
            .load()
        };
        let w = load(&t).unwrap();
        let bk = &t["blk.1.attn_k.bias"];
        assert_eq!(w.layers[1].bk.as_deref(), Some(&bk.to_f32()[..]));
        assert!(w.lm_head.is_none());
        // A k bias of the q width: the error names the tensor and both shapes.
        let mut bad = t.clone();
        bad.insert("blk.1.attn_k.bias".into(), rand(1, 64, 99));
        let e = load(&bad).unwrap_err().to_string();
        assert!(
            e.contains("`blk.1.attn_k.bias` has shape [1, 64], expected [1, 32]"),
            "{e}"
        );
        let mut missing = t.clone();
        missing.remove("blk.0.attn_v.bias");
        let e = load(&missing).unwrap_err().to_string();
        assert!(e.contains("`blk.0.attn_v.bias` not found"), "{e}");
    }
}

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// A `.gguf` file.
    Gguf(std::path::PathBuf),
    /// An HF model directory (config.json + safetensors).
    HfDir(std::path::PathBuf),
    /// `random:<preset>` with weights of type `ty`.
    Random { preset: String, ty: GgmlType },
}

/// Read an HF `config.json` into a `ModelConfig`.
pub fn hf_config(dir: &Path) -> Result<ModelConfig, ModelError> {
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).map_err(|e| slowfast_loader::LoadError::io(&p, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::Config(format!("{}: invalid JSON: {e}", p.display())))?;
    crate::config::from_hf_json(&v).map_err(|e| match e {
        ModelError::Config(m) => ModelError::Config(format!("{}: {m}", p.display())),
        ModelError::UnknownArch(m) => ModelError::UnknownArch(format!("{}: {m}", p.display())),
        e => e,
    })
}

/// Load a model (config + weights) from a source.
pub fn load_model(src: &ModelSource) -> Result<crate::Model, ModelError> {
    let (cfg, weights) = match src {
        ModelSource::Gguf(p) => {
            let g = GgufFile::open(p)?;
            let cfg = crate::config::from_gguf(&g)?;
            let w = weights_from_gguf(&g, &cfg)?;
            (cfg, w)
        }
        ModelSource::HfDir(d) => {
            let cfg = hf_config(d)?;
            let w = weights_from_safetensors(d, &cfg)?;
            (cfg, w)
        }
        ModelSource::Random { preset, ty } => {
            let cfg = crate::presets::preset(preset)?;
            let w = crate::random::random_weights(&cfg, *ty, 0x5EED)?;
            (cfg, w)
        }
    };
    crate::Model::new(cfg, weights)
}
