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
    "gemma3-270m",
    "qwen2.5-0.5b",
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

/// A Gemma 3 shape: sliding layers of window `window` with a global one every `global_every`,
/// q/k and post norms, GELU, scaled embeddings, tied embeddings, RoPE with a local theta.
/// The `gemma3-270m` preset, and the small Gemma-like models the tests build.
#[allow(clippy::too_many_arguments)]
pub fn gemma3(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    vocab: usize,
    window: usize,
    global_every: usize,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Gemma3,
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        intermediate_size: inter,
        vocab_size: vocab,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_local_theta: 1e4,
        rope_scaling: RopeScaling::None,
        sliding_window: Some(window),
        layer_sliding: ModelConfig::gemma3_pattern(layers, global_every),
        max_position_embeddings: 32768,
        tie_word_embeddings: true,
        qk_norm: true,
        post_norms: true,
        scale_embeddings: true,
        activation: Activation::GeluTanh,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

/// A Qwen2 / Qwen2.5 shape: Llama plus q/k/v biases, RoPE theta 1e6, no sliding window (the
/// published checkpoints set `use_sliding_window: false`). The `qwen2.5-0.5b` preset, and the
/// small biased models the tests build.
#[allow(clippy::too_many_arguments)]
pub fn qwen2(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    vocab: usize,
    tie: bool,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        intermediate_size: inter,
        vocab_size: vocab,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_local_theta: 1e6,
        rope_scaling: RopeScaling::None,
        sliding_window: None,
        layer_sliding: vec![false; layers],
        max_position_embeddings: 32768,
        tie_word_embeddings: tie,
        qk_norm: false,
        post_norms: false,
        scale_embeddings: false,
        activation: Activation::Silu,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
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
        "gemma3-270m" => gemma3(640, 18, 4, 1, 256, 2048, 262144, 512, 6),
        "qwen2.5-0.5b" => qwen2(896, 24, 14, 2, 64, 4864, 151936, true),
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
        // Gemma 3 270M: 268M parameters, 170M of them the embedding.
        let g = preset("gemma3-270m").unwrap().num_parameters() as f64 / 1e6;
        assert!((265.0..271.0).contains(&g), "{g}");
        // Qwen2.5-0.5B: 494M parameters (q/k/v biases included).
        let q05 = preset("qwen2.5-0.5b").unwrap().num_parameters() as f64 / 1e6;
        assert!((493.0..495.0).contains(&q05), "{q05}");
        assert!(preset("gpt2").is_err());
    }
}
