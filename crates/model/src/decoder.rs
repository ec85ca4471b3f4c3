//! The one generic decoder: Llama, Qwen3 and Gemma 3 differ only in `ModelConfig` flags.
//! `forward` runs a chunk of tokens (a prefill chunk, or one decode token) through every layer
//! against a preallocated KV store; attention goes through `crate::attention`.
use slowfast_backend::cpu::ops;
use slowfast_kv::{CacheElem, FullPolicy, KvPolicy, KvStore, LayerSpec};
use slowfast_quant::{
    gemm_crossover, matmul, matmul_gemm, matvec_with, DotPath, Isa, MatvecScratch,
};

use crate::attention::attend_layer;
use crate::config::{Activation, ModelConfig, RopeScaling};
use crate::weights::{ModelWeights, Weight};
use crate::ModelError;

/// Which rows of a forward chunk get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// No logits (a prefill chunk that is not the last).
    None,
    /// The last row only (`[vocab]`).
    Last,
    /// Every row (`[n, vocab]`).
    All,
}

/// How activations meet quantized weights in the matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// Few rows (decode): activations quantized to 8 bits and integer dot products, as
    /// llama.cpp does; many rows (prefill): dequantized weight tiles and an f32 GEMM.
    Fast,
    /// Always f32 activations against dequantized weights (the exact product of the stored
    /// weights; slower for decode).
    Exact,
}

/// A loaded model: config, weights and RoPE frequencies.
pub struct Model {
    pub cfg: ModelConfig,
    pub weights: ModelWeights,
    pub precision: MatmulPrecision,
    /// RoPE inverse frequencies of global and sliding layers (`[head_dim/2]`).
    inv_freq_global: Vec<f64>,
    inv_freq_local: Vec<f64>,
}

/// Buffers reused across forward calls (sized for the largest chunk seen).
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,    // [n, hidden] residual stream
    xb: Vec<f32>,   // [n, hidden] normed input
    q: Vec<f32>,    // [n, heads, head_dim]
    k: Vec<f32>,    // [n, kv_heads, head_dim]
    v: Vec<f32>,    // [n, kv_heads, head_dim]
    att: Vec<f32>,  // [n, heads, head_dim]
    o: Vec<f32>,    // [n, hidden]
    gate: Vec<f32>, // [n, intermediate]
    up: Vec<f32>,   // [n, intermediate]
    cos: Vec<f32>,  // [n, head_dim/2]
    sin: Vec<f32>,  // [n, head_dim/2]
    cos_l: Vec<f32>,
    sin_l: Vec<f32>,
}

fn resize(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

/// RoPE inverse frequencies for `theta` with a scaling rule (HF `_compute_*_parameters`).
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f64> {
    let half = head_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64))
        .collect();
    match scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / *factor as f64).collect(),
        RopeScaling::Factors(fs) => base
            .iter()
            .enumerate()
            .map(|(i, f)| f / fs.get(i).copied().unwrap_or(1.0) as f64)
            .collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, lo, hi, orig) = (
                *factor as f64,
                *low_freq_factor as f64,
                *high_freq_factor as f64,
                *original_max_position_embeddings as f64,
            );
            let (low_wavelen, high_wavelen) = (orig / lo, orig / hi);
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (orig / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

impl Model {
    pub fn new(cfg: ModelConfig, weights: ModelWeights) -> Result<Self, ModelError> {
        cfg.validate()?;
        if weights.layers.len() != cfg.num_hidden_layers {
            return Err(ModelError::Weights(format!(
                "{} layers of weights for a {}-layer config",
                weights.layers.len(),
                cfg.num_hidden_layers
            )));
        }
        let inv_freq_global = rope_inv_freq(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling);
        let inv_freq_local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, &RopeScaling::None);
        Ok(Model {
            cfg,
            weights,
            precision: MatmulPrecision::Fast,
            inv_freq_global,
            inv_freq_local,
        })
    }

    /// Per-layer KV layout for sequences of up to `max_tokens` processed in chunks of at most
    /// `max_chunk` tokens: global layers hold every position, sliding layers a ring of
    /// `window + max_chunk` slots.
    pub fn kv_layout(&self, max_tokens: usize, max_chunk: usize) -> Vec<LayerSpec> {
        (0..self.cfg.num_hidden_layers)
            .map(
                |l| match (self.cfg.is_sliding(l), self.cfg.sliding_window) {
                    (true, Some(w)) if w + max_chunk < max_tokens => LayerSpec {
                        capacity: w + max_chunk,
                        ring: true,
                    },
                    _ => LayerSpec {
                        capacity: max_tokens,
                        ring: false,
                    },
                },
            )
            .collect()
    }

    /// A KV store for this model (see `kv_layout`).
    pub fn new_cache<T: CacheElem>(&self, max_tokens: usize, max_chunk: usize) -> KvStore<T> {
        KvStore::new(
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            &self.kv_layout(max_tokens, max_chunk),
        )
    }

    fn linear(&self, w: &Weight, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), ModelError> {
        let v = w.view();
        let r = match self.precision {
            MatmulPrecision::Fast => matmul(&v, x, n, y),
            MatmulPrecision::Exact if n >= gemm_crossover(w.ty) => matmul_gemm(&v, x, n, y),
            MatmulPrecision::Exact => matvec_with(
                &v,
                x,
                n,
                0..w.rows,
                y,
                &mut MatvecScratch::new(),
                DotPath::Dequantized,
                Isa::best(),
            ),
        };
        r.map_err(|e| ModelError::Compute(format!("{w:?}: {e}")))
    }

    /// Run `tokens` (at positions `pos0..pos0 + n`) through the model with dense attention,
    /// writing their K/V into `cache`. `logits` receives `[vocab]` (Last) or `[n, vocab]` (All).
    pub fn forward<T: CacheElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvStore<T>,
        s: &mut Scratch,
        rows: LogitsRows,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.forward_with(tokens, pos0, cache, &mut FullPolicy::new(), s, rows, logits)
    }

    /// `forward` with a KV policy deciding what each layer's attention reads.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with<T: CacheElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvStore<T>,
        policy: &mut dyn KvPolicy<T>,
        s: &mut Scratch,
        rows: LogitsRows,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::Compute("forward called with no tokens".into()));
        }
        if pos0 != cache.len() {
            return Err(ModelError::Compute(format!(
                "forward at position {pos0} but the cache holds {} tokens",
                cache.len()
            )));
        }
        let cap = cache.capacity();
        if pos0 + n > cap {
            return Err(ModelError::ContextFull {
                needed: pos0 + n,
                capacity: cap,
            });
        }
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::Compute(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                c.vocab_size
            )));
        }
        // Embedding lookup (Gemma scales by sqrt(hidden)).
        let x = resize(&mut s.x, n * h);
        let scale = if c.scale_embeddings {
            (h as f32).sqrt()
        } else {
            1.0
        };
        for (t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            self.weights.embed.row_f32(*t as usize, row);
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        ops::rope_tables(
            pos0..pos0 + n,
            &self.inv_freq_global,
            &mut s.cos,
            &mut s.sin,
        );
        if c.layer_sliding.iter().any(|&b| b) {
            ops::rope_tables(
                pos0..pos0 + n,
                &self.inv_freq_local,
                &mut s.cos_l,
                &mut s.sin_l,
            );
        }
        for (l, w) in self.weights.layers.iter().enumerate() {
            let sliding = c.is_sliding(l);
            // --- attention block ---
            let xb = resize(&mut s.xb, n * h);
            ops::rmsnorm(&s.x, &w.attn_norm, c.rms_norm_eps, xb);
            let q = resize(&mut s.q, n * nh * hd);
            self.linear(&w.wq, xb, n, q)?;
            let k = resize(&mut s.k, n * nkv * hd);
            self.linear(&w.wk, xb, n, k)?;
            let v = resize(&mut s.v, n * nkv * hd);
            self.linear(&w.wv, xb, n, v)?;
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                ops::rmsnorm_inplace(q, qn, c.rms_norm_eps);
                ops::rmsnorm_inplace(k, kn, c.rms_norm_eps);
            }
            let (cos, sin) = if sliding {
                (&s.cos_l, &s.sin_l)
            } else {
                (&s.cos, &s.sin)
            };
            ops::rope_inplace(q, nh, hd, cos, sin);
            ops::rope_inplace(k, nkv, hd, cos, sin);
            cache
                .write(l, pos0, k, v)
                .map_err(|e| ModelError::Compute(format!("layer {l}: {e}")))?;
            let att = resize(&mut s.att, n * nh * hd);
            let window = if sliding { c.sliding_window } else { None };
            attend_layer(c, l, q, pos0, n, window, cache, policy, att)?;
            let o = resize(&mut s.o, n * h);
            self.linear(&w.wo, att, n, o)?;
            if let Some(pn) = &w.post_attn_norm {
                ops::rmsnorm_inplace(o, pn, c.rms_norm_eps);
            }
            ops::add_inplace(&mut s.x, o);
            // --- MLP block ---
            let xb = resize(&mut s.xb, n * h);
            ops::rmsnorm(&s.x, &w.ffn_norm, c.rms_norm_eps, xb);
            let gate = resize(&mut s.gate, n * c.intermediate_size);
            self.linear(&w.w_gate, xb, n, gate)?;
            let up = resize(&mut s.up, n * c.intermediate_size);
            self.linear(&w.w_up, xb, n, up)?;
            match c.activation {
                Activation::Silu => ops::silu_mul(gate, up),
                Activation::GeluTanh => ops::gelu_tanh_mul(gate, up),
            }
            let o = resize(&mut s.o, n * h);
            self.linear(&w.w_down, gate, n, o)?;
            if let Some(pn) = &w.post_ffw_norm {
                ops::rmsnorm_inplace(o, pn, c.rms_norm_eps);
            }
            ops::add_inplace(&mut s.x, o);
        }
        cache.set_len(pos0 + n);
        policy.end_forward(pos0, n);
        // Final norm + LM head on the rows that need logits.
        let first = match rows {
            LogitsRows::None => return Ok(()),
            LogitsRows::Last => n - 1,
            LogitsRows::All => 0,
        };
        let m = n - first;
        let xb = resize(&mut s.xb, m * h);
        ops::rmsnorm(
            &s.x[first * h..],
            &self.weights.final_norm,
            c.rms_norm_eps,
            xb,
        );
        logits.resize(m * c.vocab_size, 0.0);
        self.linear(self.weights.lm_head(), xb, m, logits)
    }
}
