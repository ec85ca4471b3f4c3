//! Deterministic random weights for `random:<preset>` models. Values are uniform with a
//! variance that keeps activations O(1); they only need to be finite and reproducible.
use std::sync::Arc;

use rayon::prelude::*;
use slowfast_quant::GgmlType;

use crate::config::ModelConfig;
use crate::weights::{Bytes, LayerWeights, ModelWeights, Weight};
use crate::ModelError;

/// splitmix64: a tiny, good-enough PRNG for weight filling.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn uniform(state: &mut u64) -> f32 {
    // 24 random bits -> [-1, 1)
    ((splitmix(state) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// A `[rows, cols]` matrix of type `ty` with values uniform in ±amp, seeded by `seed`.
pub fn random_weight(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    amp: f32,
    seed: u64,
) -> Result<Weight, ModelError> {
    let rb = ty
        .row_bytes(cols)
        .map_err(|e| ModelError::Weights(format!("random weight: {e}")))?;
    let mut data = vec![0u8; rb * rows];
    data.par_chunks_mut(rb * 64)
        .enumerate()
        .try_for_each(|(chunk, out)| {
            let mut row = vec![0f32; cols];
            for (i, dst) in out.chunks_mut(rb).enumerate() {
                let r = (chunk * 64 + i) as u64;
                let mut s = seed ^ r.wrapping_mul(0xD1B5_4A32_D192_ED03);
                for x in row.iter_mut() {
                    *x = uniform(&mut s) * amp;
                }
                slowfast_quant::quantize_row(ty, &row, dst)
                    .map_err(|e| ModelError::Weights(format!("random weight: {e}")))?;
            }
            Ok::<(), ModelError>(())
        })?;
    Weight::new(ty, rows, cols, Bytes::Owned(Arc::new(data)), "random")
}

/// Random weights for `cfg` in type `ty` (norm weights are 1).
pub fn random_weights(
    cfg: &ModelConfig,
    ty: GgmlType,
    seed: u64,
) -> Result<ModelWeights, ModelError> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (q_dim, kv_dim, inter) = (
        cfg.num_attention_heads * hd,
        cfg.num_key_value_heads * hd,
        cfg.intermediate_size,
    );
    // Uniform ±a has std a/sqrt(3); a = sqrt(3/fan_in) gives unit-variance outputs.
    let amp = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let mut next = seed;
    let mut w = |rows: usize, cols: usize, a: f32| {
        next = next.wrapping_add(1);
        random_weight(ty, rows, cols, a, next.wrapping_mul(0x2545_F491_4F6C_DD1D))
    };
    let embed = w(cfg.vocab_size, h, 1.0)?;
    let bias = cfg.arch.qkv_bias();
    // Biases draw from their own seed sequence (the matrices stay those of a bias-free model).
    let mut next_bias = seed ^ 0xB1A5_B1A5_B1A5_B1A5;
    let mut b = |n: usize| -> Result<Option<Vec<f32>>, ModelError> {
        next_bias = next_bias.wrapping_add(1);
        let seed = next_bias.wrapping_mul(0x2545_F491_4F6C_DD1D);
        bias.then(|| random_weight(GgmlType::F32, 1, n, 0.5, seed).map(|w| w.to_f32()))
            .transpose()
    };
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for _ in 0..cfg.num_hidden_layers {
        layers.push(LayerWeights {
            attn_norm: vec![1.0; h],
            wq: w(q_dim, h, amp(h))?,
            wk: w(kv_dim, h, amp(h))?,
            wv: w(kv_dim, h, amp(h))?,
            wo: w(h, q_dim, amp(q_dim))?,
            bq: b(q_dim)?,
            bk: b(kv_dim)?,
            bv: b(kv_dim)?,
            q_norm: cfg.qk_norm.then(|| vec![1.0; hd]),
            k_norm: cfg.qk_norm.then(|| vec![1.0; hd]),
            post_attn_norm: cfg.post_norms.then(|| vec![1.0; h]),
            ffn_norm: vec![1.0; h],
            w_gate: w(inter, h, amp(h))?,
            w_up: w(inter, h, amp(h))?,
            w_down: w(h, inter, amp(inter))?,
            post_ffw_norm: cfg.post_norms.then(|| vec![1.0; h]),
        });
    }
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(w(cfg.vocab_size, h, amp(h))?)
    };
    Ok(ModelWeights {
        embed,
        layers,
        final_norm: vec![1.0; h],
        lm_head,
    })
}
