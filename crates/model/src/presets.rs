//! Published architectures for `random:<preset>` models (deterministic random weights, used for
//! throughput work: speed does not depend on weight values).
use crate::config::{Activation, Arch, ModelConfig, RopeScaling};
use crate::ModelError;

/// Names accepted after `random:`.
pub const PRESETS: &[&str] = &[
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "llama3-8b",
];

fn qwen3(hidden: usize, layers: usize, heads: usize, inter: usize, tie: bool) -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: 8,
        head_dim: 128,
        intermediate_size: inter,
        vocab_size: 151936,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_local_theta: 1e6,
        rope_scaling: RopeScaling::None,
        sliding_window: None,
        layer_sliding: vec![false; layers],
        max_position_embeddings: 131072,
        tie_word_embeddings: tie,
        qk_norm: true,
        post_norms: false,
        scale_embeddings: false,
        activation: Activation::Silu,
        attn_scale: 1.0 / (128f32).sqrt(),
    }
}

/// The config of a named preset (Qwen3 and Llama 3 shapes as published on their model cards).
pub fn preset(name: &str) -> Result<ModelConfig, ModelError> {
    Ok(match name {
        "qwen3-0.6b" => qwen3(1024, 28, 16, 3072, true),
        "qwen3-1.7b" => qwen3(2048, 28, 16, 6144, true),
        "qwen3-4b" => qwen3(2560, 36, 32, 9728, true),
        "qwen3-8b" => qwen3(4096, 36, 32, 12288, false),
        "llama3-8b" => ModelConfig {
            arch: Arch::Llama,
            hidden_size: 4096,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 128256,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_local_theta: 500000.0,
            rope_scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
            sliding_window: None,
            layer_sliding: vec![false; 32],
            max_position_embeddings: 131072,
            tie_word_embeddings: false,
            qk_norm: false,
            post_norms: false,
            scale_embeddings: false,
            activation: Activation::Silu,
            attn_scale: 1.0 / (128f32).sqrt(),
        },
        other => {
            return Err(ModelError::Config(format!(
                "unknown preset `random:{other}` (known: {})",
                PRESETS.join(", ")
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_sized_like_the_published_models() {
        for p in PRESETS {
            let c = preset(p).unwrap();
            c.validate().unwrap();
        }
        // Qwen3-4B has about 4.0B parameters (3.6B without embeddings), Llama 3 8B about 8.0B.
        let q4 = preset("qwen3-4b").unwrap().num_parameters() as f64 / 1e9;
        assert!((3.9..4.1).contains(&q4), "{q4}");
        let l8 = preset("llama3-8b").unwrap().num_parameters() as f64 / 1e9;
        assert!((7.9..8.1).contains(&l8), "{l8}");
        assert!(preset("gpt2").is_err());
    }
}
