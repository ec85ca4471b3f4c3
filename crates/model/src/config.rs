//! `ModelConfig`: the architecture hyper-parameters of the one generic decoder, read from GGUF
//! metadata, an HF `config.json`, or a named preset. Families differ only in a few flags.
use serde_json::Value;

use crate::ModelError;

/// The model families the generic decoder implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
    Gemma3,
    /// Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen): Llama plus q/k/v biases.
    Qwen2,
    /// Mistral: Llama with a sliding window on every layer.
    Mistral,
}

impl Arch {
    /// Per-head RMSNorm of q and k (Qwen3, Gemma 3).
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Gemma3)
    }
    /// Biases on the q, k and v projections (Qwen2).
    pub fn qkv_bias(self) -> bool {
        self == Arch::Qwen2
    }
    /// Gemma's sandwich norms (after attention and MLP) and sqrt(hidden)-scaled embeddings.
    pub fn gemma_style(self) -> bool {
        self == Arch::Gemma3
    }
    pub fn activation(self) -> Activation {
        if self == Arch::Gemma3 {
            Activation::GeluTanh
        } else {
            Activation::Silu
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2 => "qwen2",
            Arch::Mistral => "mistral",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// silu(gate) * up (Llama, Qwen3).
    Silu,
    /// gelu_tanh(gate) * up (Gemma 3).
    GeluTanh,
}

/// Frequency scaling of RoPE.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (Gemma 3 4B+ global layers).
    Linear {
        factor: f32,
    },
    /// Llama 3.x piecewise frequency scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// Explicit per-frequency divisors (GGUF `rope_freqs.weight`), one per rotary pair.
    Factors(Vec<f32>),
}

/// Hyper-parameters of the generic decoder. Field names follow HF's `config.json`.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    /// RoPE base of global (full-attention) layers.
    pub rope_theta: f32,
    /// RoPE base of sliding-window layers (Gemma 3: 10000).
    pub rope_local_theta: f32,
    /// Scaling of the global layers' RoPE.
    pub rope_scaling: RopeScaling,
    /// Window of the sliding-window layers (tokens), if any layer slides.
    pub sliding_window: Option<usize>,
    /// Per layer: true when the layer uses the sliding window.
    pub layer_sliding: Vec<bool>,
    /// Longest context the checkpoint was trained for.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Norms after attention and after the MLP (Gemma 3).
    pub post_norms: bool,
    /// Embeddings multiplied by sqrt(hidden_size) (Gemma).
    pub scale_embeddings: bool,
    pub activation: Activation,
    /// Attention logit scale (1/sqrt(head_dim) unless the model says otherwise).
    pub attn_scale: f32,
}

impl ModelConfig {
    /// Parameters of the transformer (embedding counted once when tied).
    pub fn num_parameters(&self) -> u64 {
        let h = self.hidden_size as u64;
        let q = (self.num_attention_heads * self.head_dim) as u64;
        let kv = (self.num_key_value_heads * self.head_dim) as u64;
        let i = self.intermediate_size as u64;
        let bias = if self.arch.qkv_bias() { q + 2 * kv } else { 0 };
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + bias;
        let norms = if self.qk_norm {
            2 * self.head_dim as u64
        } else {
            0
        } + if self.post_norms { 2 * h } else { 0 };
        let emb = self.vocab_size as u64 * h;
        self.num_hidden_layers as u64 * (per_layer + norms)
            + emb * if self.tie_word_embeddings { 1 } else { 2 }
            + h
    }

    /// Values of K plus V stored per token over all layers (global layers; sliding layers hold
    /// at most their window).
    pub fn kv_values_per_token(&self) -> usize {
        2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
    }

    /// RoPE scaling of the sliding-window layers: none for Gemma 3 (its local layers use
    /// their own theta unscaled), the global scaling for every other family (one RoPE).
    pub fn local_rope_scaling(&self) -> RopeScaling {
        if self.arch == Arch::Gemma3 {
            RopeScaling::None
        } else {
            self.rope_scaling.clone()
        }
    }

    pub fn is_sliding(&self, layer: usize) -> bool {
        self.layer_sliding.get(layer).copied().unwrap_or(false)
    }

    /// Check internal consistency; every error names the offending field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.hidden_size == 0 || self.num_hidden_layers == 0 || self.vocab_size == 0 {
            return bad(format!(
                "hidden_size ({}), num_hidden_layers ({}) and vocab_size ({}) must be positive",
                self.hidden_size, self.num_hidden_layers, self.vocab_size
            ));
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be positive and even",
                self.head_dim
            ));
        }
        if self.layer_sliding.len() != self.num_hidden_layers {
            return bad(format!(
                "{} layer types given for {} layers",
                self.layer_sliding.len(),
                self.num_hidden_layers
            ));
        }
        if self.layer_sliding.iter().any(|&s| s) && self.sliding_window.unwrap_or(0) == 0 {
            return bad("sliding layers need a positive sliding_window".into());
        }
        if self.rms_norm_eps.is_nan()
            || self.rms_norm_eps <= 0.0
            || self.rope_theta.is_nan()
            || self.rope_theta <= 0.0
        {
            return bad(format!(
                "rms_norm_eps ({}) and rope_theta ({}) must be positive",
                self.rms_norm_eps, self.rope_theta
            ));
        }
        Ok(())
    }

    /// Gemma 3's layer pattern: every `period`-th layer (1-based) is global, the rest slide.
    pub fn gemma3_pattern(n_layers: usize, period: usize) -> Vec<bool> {
        (0..n_layers).map(|l| (l + 1) % period != 0).collect()
    }
}

/// Read a `ModelConfig` from an HF `config.json` value.
pub fn from_hf_json(v: &Value) -> Result<ModelConfig, ModelError> {
    // Gemma 3 multimodal checkpoints nest the text model's config.
    let v = v.get("text_config").filter(|t| t.is_object()).unwrap_or(v);
    let archs: Vec<&str> = v
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let model_type = v.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
    let arch = if archs.contains(&"Qwen3ForCausalLM") || model_type == "qwen3" {
        Arch::Qwen3
    } else if archs.contains(&"Qwen2ForCausalLM") || model_type == "qwen2" {
        Arch::Qwen2
    } else if archs.contains(&"MistralForCausalLM") || model_type == "mistral" {
        Arch::Mistral
    } else if archs.contains(&"LlamaForCausalLM") || model_type == "llama" {
        Arch::Llama
    } else if archs
        .iter()
        .any(|a| *a == "Gemma3ForCausalLM" || *a == "Gemma3ForConditionalGeneration")
        || model_type == "gemma3_text"
        || model_type == "gemma3"
    {
        Arch::Gemma3
    } else {
        return Err(ModelError::UnknownArch(format!(
            "architectures {archs:?} / model_type {model_type:?} (supported: Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM)"
        )));
    };
    let req = |k: &str| -> Result<u64, ModelError> {
        v.get(k)
            .and_then(|x| x.as_u64())
            .ok_or_else(|| ModelError::Config(format!("config.json: missing or invalid `{k}`")))
    };
    let opt_f = |k: &str| v.get(k).and_then(|x| x.as_f64());
    let hidden_size = req("hidden_size")? as usize;
    let num_hidden_layers = req("num_hidden_layers")? as usize;
    let num_attention_heads = req("num_attention_heads")? as usize;
    let num_key_value_heads = v
        .get("num_key_value_heads")
        .and_then(|x| x.as_u64())
        .map(|x| x as usize)
        .unwrap_or(num_attention_heads);
    let head_dim = v
        .get("head_dim")
        .and_then(|x| x.as_u64())
        .map(|x| x as usize)
        .unwrap_or(hidden_size / num_attention_heads.max(1));
    // transformers >= 5 moves RoPE settings into `rope_parameters` (per layer type for Gemma 3).
    let rope_params = v.get("rope_parameters");
    let rope_for = |layer_type: &str| -> Option<&Value> {
        let rp = rope_params?;
        if rp.get("rope_theta").is_some() || rp.get("rope_type").is_some() {
            Some(rp)
        } else {
            rp.get(layer_type)
        }
    };
    let theta_of = |p: Option<&Value>| p.and_then(|p| p.get("rope_theta")).and_then(|x| x.as_f64());
    let rope_theta = opt_f("rope_theta")
        .or_else(|| theta_of(rope_for("full_attention")))
        .unwrap_or(10000.0) as f32;
    let scaling_src = v
        .get("rope_scaling")
        .filter(|s| s.is_object())
        .or_else(|| rope_for("full_attention"));
    let rope_scaling = parse_hf_rope_scaling(scaling_src)?;
    // Per-layer attention types as transformers >= 4.53 saves them (`layer_types`).
    let layer_types = match v.get("layer_types").and_then(|t| t.as_array()) {
        Some(types) => Some(
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(ModelError::Config(format!(
                        "config.json: unknown layer type {other:?} in layer_types"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        None => None,
    };
    // `sliding_window` as transformers reads it: absent -> the class default, null -> none.
    let window_or = |default: Option<usize>| match v.get("sliding_window") {
        None => default,
        Some(x) => x.as_u64().map(|x| x as usize),
    };
    let (sliding_window, layer_sliding, rope_local_theta) = match arch {
        Arch::Gemma3 => {
            let pattern = match layer_types {
                Some(t) => t,
                None => {
                    let period = v
                        .get("sliding_window_pattern")
                        .and_then(|x| x.as_u64())
                        .unwrap_or(6) as usize;
                    ModelConfig::gemma3_pattern(num_hidden_layers, period.max(1))
                }
            };
            let local = opt_f("rope_local_base_freq")
                .or_else(|| theta_of(rope_for("sliding_attention")))
                .unwrap_or(10000.0) as f32;
            (window_or(None), pattern, local)
        }
        // Qwen2Config / Qwen3Config (transformers 5.24): the window exists only with
        // `use_sliding_window`; a layer slides when `layer_types` says so or, without
        // `layer_types`, from `max_window_layers` (default 28) on; a "sliding" layer without a
        // window attends to everything.
        Arch::Qwen2 | Arch::Qwen3 => {
            let use_window = v.get("use_sliding_window").and_then(|u| u.as_bool()) == Some(true);
            let window = window_or(Some(4096)).filter(|_| use_window);
            let pattern = match layer_types {
                Some(t) => t.into_iter().map(|s| s && window.is_some()).collect(),
                None => {
                    let first = v
                        .get("max_window_layers")
                        .and_then(|x| x.as_u64())
                        .unwrap_or(28) as usize;
                    (0..num_hidden_layers)
                        .map(|l| window.is_some() && l >= first)
                        .collect()
                }
            };
            (window, pattern, rope_theta)
        }
        // MistralConfig: `sliding_window` (default 4096, null: none) on every layer;
        // `layer_types` is ignored (transformers warns and does the same).
        Arch::Mistral => {
            let window = window_or(Some(4096));
            (
                window,
                vec![window.is_some(); num_hidden_layers],
                rope_theta,
            )
        }
        Arch::Llama => {
            let window = v
                .get("sliding_window")
                .and_then(|x| x.as_u64())
                .filter(|_| v.get("use_sliding_window").and_then(|u| u.as_bool()) == Some(true))
                .map(|x| x as usize);
            (
                window,
                vec![window.is_some(); num_hidden_layers],
                rope_theta,
            )
        }
    };
    if !arch.qkv_bias() && v.get("attention_bias").and_then(|b| b.as_bool()) == Some(true) {
        return Err(ModelError::Config(format!(
            "config.json: `attention_bias: true` (biases on the q/k/v/o projections) is not supported for {}",
            arch.name()
        )));
    }
    let attn_scale = match opt_f("query_pre_attn_scalar") {
        Some(s) if arch == Arch::Gemma3 => (1.0 / s.sqrt()) as f32,
        _ => 1.0 / (head_dim as f32).sqrt(),
    };
    let tie_default = arch == Arch::Gemma3;
    let cfg = ModelConfig {
        arch,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        intermediate_size: req("intermediate_size")? as usize,
        vocab_size: req("vocab_size")? as usize,
        rms_norm_eps: opt_f("rms_norm_eps").unwrap_or(1e-6) as f32,
        rope_theta,
        rope_local_theta,
        rope_scaling,
        sliding_window,
        layer_sliding,
        max_position_embeddings: v
            .get("max_position_embeddings")
            .and_then(|x| x.as_u64())
            .unwrap_or(4096) as usize,
        tie_word_embeddings: v
            .get("tie_word_embeddings")
            .and_then(|x| x.as_bool())
            .unwrap_or(tie_default),
        qk_norm: arch.qk_norm(),
        post_norms: arch.gemma_style(),
        scale_embeddings: arch.gemma_style(),
        activation: arch.activation(),
        attn_scale,
    };
    if let Some(act) = v
        .get("hidden_act")
        .or_else(|| v.get("hidden_activation"))
        .and_then(|a| a.as_str())
    {
        let expect = match cfg.activation {
            Activation::Silu => ["silu", "swish"].contains(&act),
            Activation::GeluTanh => ["gelu_pytorch_tanh", "gelu_tanh"].contains(&act),
        };
        if !expect {
            return Err(ModelError::Config(format!(
                "config.json: activation {act:?} is not supported for {}",
                arch.name()
            )));
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

fn parse_hf_rope_scaling(s: Option<&Value>) -> Result<RopeScaling, ModelError> {
    let Some(s) = s else {
        return Ok(RopeScaling::None);
    };
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let f = |k: &str, d: f64| s.get(k).and_then(|x| x.as_f64()).unwrap_or(d) as f32;
    Ok(match ty {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: f("factor", 1.0),
        },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor", 8.0),
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_position_embeddings: f("original_max_position_embeddings", 8192.0),
        },
        other => {
            return Err(ModelError::Config(format!(
            "config.json: rope scaling type {other:?} is not supported (default, linear, llama3)"
        )))
        }
    })
}

/// Read a `ModelConfig` from GGUF metadata.
pub fn from_gguf(g: &slowfast_loader::gguf::GgufFile) -> Result<ModelConfig, ModelError> {
    let arch_name = g.require_str("general.architecture")?;
    let arch = match arch_name {
        "llama" => Arch::Llama,
        "qwen3" => Arch::Qwen3,
        "gemma3" => Arch::Gemma3,
        "qwen2" => Arch::Qwen2,
        other => {
            return Err(ModelError::UnknownArch(format!(
                "GGUF architecture {other:?} in {} (supported: llama, qwen2, qwen3, gemma3)",
                g.path().display()
            )))
        }
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden_size = g.require_u32(&k("embedding_length"))? as usize;
    let num_hidden_layers = g.require_u32(&k("block_count"))? as usize;
    let num_attention_heads = g.require_u32(&k("attention.head_count"))? as usize;
    let num_key_value_heads = g
        .get_u32(&k("attention.head_count_kv"))
        .map(|x| x as usize)
        .unwrap_or(num_attention_heads);
    let head_dim = g
        .get_u32(&k("attention.key_length"))
        .map(|x| x as usize)
        .unwrap_or(hidden_size / num_attention_heads.max(1));
    if let Some(vl) = g.get_u32(&k("attention.value_length")) {
        if vl as usize != head_dim {
            return Err(ModelError::Config(format!(
                "{}: value_length {vl} differs from key_length {head_dim} (unsupported)",
                g.path().display()
            )));
        }
    }
    let (token_info, _) = g.require_tensor("token_embd.weight")?;
    let vocab_size = g
        .get_u32(&k("vocab_size"))
        .map(|x| x as usize)
        .unwrap_or(*token_info.dims.get(1).unwrap_or(&0) as usize);
    let rope_theta = g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0);
    let mut rope_scaling = match g.get_str(&k("rope.scaling.type")) {
        Some("linear") => RopeScaling::Linear {
            factor: g.get_f32(&k("rope.scaling.factor")).unwrap_or(1.0),
        },
        _ => RopeScaling::None,
    };
    if let Some((info, data)) = g
        .tensor_info("rope_freqs.weight")
        .and_then(|i| Some((i, g.tensor_data(&i.name)?)))
    {
        if info.ggml_type != 0 {
            return Err(ModelError::Config("rope_freqs.weight must be F32".into()));
        }
        let factors = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        rope_scaling = RopeScaling::Factors(factors);
    }
    let (sliding_window, layer_sliding) = if arch == Arch::Gemma3 {
        let w = g
            .get_u32(&k("attention.sliding_window"))
            .map(|x| x as usize);
        let pattern = if w.is_some() {
            ModelConfig::gemma3_pattern(num_hidden_layers, 6)
        } else {
            vec![false; num_hidden_layers]
        };
        (w, pattern)
    } else {
        (None, vec![false; num_hidden_layers])
    };
    let tie_word_embeddings = g.tensor_info("output.weight").is_none();
    let cfg = ModelConfig {
        arch,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        intermediate_size: g.require_u32(&k("feed_forward_length"))? as usize,
        vocab_size,
        rms_norm_eps: g.require_f32(&k("attention.layer_norm_rms_epsilon"))?,
        rope_theta,
        rope_local_theta: if arch == Arch::Gemma3 {
            10000.0
        } else {
            rope_theta
        },
        rope_scaling,
        sliding_window,
        layer_sliding,
        max_position_embeddings: g.get_u32(&k("context_length")).unwrap_or(4096) as usize,
        tie_word_embeddings,
        qk_norm: arch.qk_norm(),
        post_norms: arch.gemma_style(),
        scale_embeddings: arch.gemma_style(),
        activation: arch.activation(),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
    };
    cfg.validate()?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn base(extra: Value) -> Value {
        let mut v = json!({
            "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
        });
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    }

    #[test]
    fn qwen2_window_follows_use_sliding_window_and_max_window_layers() {
        let q = |extra: Value| from_hf_json(&base(extra)).unwrap();
        let c = q(
            json!({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true,
                         "sliding_window": 16, "max_window_layers": 2}),
        );
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.arch.qkv_bias() && !c.qk_norm);
        assert_eq!(c.sliding_window, Some(16));
        assert_eq!(c.layer_sliding, [false, false, true, true]);
        // Without use_sliding_window there is no window, whatever max_window_layers says.
        let c = q(json!({"model_type": "qwen2", "sliding_window": 16, "max_window_layers": 0}));
        assert_eq!((c.sliding_window, c.layer_sliding), (None, vec![false; 4]));
        // layer_types (transformers >= 4.53) decides over max_window_layers.
        let c = q(
            json!({"model_type": "qwen2", "use_sliding_window": true, "sliding_window": 16,
            "max_window_layers": 0, "layer_types":
            ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
        );
        assert_eq!(c.layer_sliding, [true, false, true, false]);
        // The class defaults: window 4096 from layer 28 on.
        let c = q(json!({"model_type": "qwen2", "use_sliding_window": true}));
        assert_eq!(
            (c.sliding_window, c.layer_sliding),
            (Some(4096), vec![false; 4])
        );
        // The same rule for Qwen3.
        let c = q(json!({"model_type": "qwen3", "use_sliding_window": true,
                         "sliding_window": 16, "max_window_layers": 3}));
        assert_eq!(c.layer_sliding, [false, false, false, true]);
    }

    #[test]
    fn mistral_window_is_on_every_layer_unless_null() {
        let m = |extra: Value| from_hf_json(&base(extra)).unwrap();
        let c = m(json!({"architectures": ["MistralForCausalLM"], "sliding_window": 32}));
        assert_eq!(c.arch, Arch::Mistral);
        assert!(!c.arch.qkv_bias() && !c.qk_norm);
        assert_eq!(
            (c.sliding_window, c.layer_sliding),
            (Some(32), vec![true; 4])
        );
        let c = m(json!({"model_type": "mistral", "sliding_window": null}));
        assert_eq!((c.sliding_window, c.layer_sliding), (None, vec![false; 4]));
        let c = m(json!({"model_type": "mistral"}));
        assert_eq!(c.sliding_window, Some(4096));
    }

    #[test]
    fn attention_bias_outside_qwen2_is_refused() {
        let e = from_hf_json(&base(
            json!({"model_type": "llama", "attention_bias": true}),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("attention_bias") && e.contains("llama"), "{e}");
        from_hf_json(&base(
            json!({"model_type": "llama", "attention_bias": false}),
        ))
        .unwrap();
    }

    #[test]
    fn local_rope_scaling_is_the_global_one_outside_gemma() {
        let mut c = from_hf_json(&base(json!({"model_type": "mistral",
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}})))
        .unwrap();
        assert_eq!(c.local_rope_scaling(), RopeScaling::Linear { factor: 2.0 });
        c.arch = Arch::Gemma3;
        assert_eq!(c.local_rope_scaling(), RopeScaling::None);
    }
}
