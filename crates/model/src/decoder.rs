//! The one generic decoder: Llama, Qwen2, Qwen3, Mistral and Gemma 3 differ only in
//! `ModelConfig` flags (and Qwen2's q/k/v biases in the weights).
//! `forward` runs a chunk of tokens (a prefill chunk, or one decode token) through every layer
//! against a preallocated KV store; attention goes through `crate::attention`. `crate::batch`
//! runs one decode token of several sequences through the same layer code. A rank of a
//! tensor-parallel group (`Model::shard`) runs the same code on its slice of the weights, with
//! the collectives of `crate::tp` after the embedding, the o and down projections and the head.
use std::ops::Range;
use std::sync::Arc;

use slowfast_backend::cpu::ops;
use slowfast_kv::{CacheElem, FullPolicy, KvPolicy, KvStore, LayerSpec};
use slowfast_quant::{
    gemm_crossover, matmul, matmul_gemm, matvec_with, DotPath, Isa, MatvecScratch,
};

use crate::attention::attend_layer;
use crate::config::{Activation, ModelConfig, RopeScaling};
use crate::tp::{Communicator, KvShare, TpPlan};
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

/// FastKV's token-selective propagation: from `layer` on, only `len` prompt tokens (the top
/// scored plus the last `window`) are processed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TspConfig {
    pub layer: usize,
    pub len: usize,
    pub window: usize,
    pub kernel: usize,
}

/// Positions of the rows of a forward: contiguous from a start, or an ascending list (FastKV
/// propagates a subset of the prompt with its original positions).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowPos<'a> {
    Range(usize),
    List(&'a [u32]),
}

/// What the rows of a forward are to the matrix products (see `Model::linear`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    /// Consecutive tokens of one sequence.
    Chunk,
    /// One token of each of several independent sequences (batched decode).
    Independent,
}

/// One layer's rows handed to its attention step (see `Model::layer`): the roped queries
/// `[n, heads, head_dim]`, keys and values `[n, kv_heads, head_dim]`, the sliding window of
/// the layer (None: global), and the output `[n, heads, head_dim]` to fill.
pub(crate) struct Attend<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub window: Option<usize>,
    pub out: &'a mut [f32],
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
    /// The model's place in a tensor-parallel group (`None`: the whole model, no collectives).
    tp: Option<TpRank>,
}

/// A rank of a tensor-parallel group: its communicator and vocabulary rows.
struct TpRank {
    comm: Arc<dyn Communicator>,
    /// The rows of the full vocabulary this rank's embedding and LM head hold.
    vocab: Range<usize>,
    /// Logits per rank as gathered (`TpPlan::vocab_per_rank`, the last rank's zero-padded).
    vocab_per_rank: usize,
    /// The ranks holding the same (replicated) kv heads, whose KV policies gather each
    /// other's queries and captures (`None`: this rank's kv heads are its own).
    share: Option<KvShare>,
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
    tp_local: Vec<f32>, // [rows, vocab_per_rank] a rank's logits (tensor parallel)
    tp_all: Vec<f32>,   // [ranks, rows, vocab_per_rank] gathered logits (tensor parallel)
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
        let inv_freq_local = rope_inv_freq(
            cfg.head_dim,
            cfg.rope_local_theta,
            &cfg.local_rope_scaling(),
        );
        Ok(Model {
            cfg,
            weights,
            precision: MatmulPrecision::Fast,
            inv_freq_global,
            inv_freq_local,
            tp: None,
        })
    }

    /// Rank `rank` of the tensor-parallel group `comm` under `plan`: its slice of the weights
    /// (`crate::tp::shard`), the same precision, and the collectives the layers need. Its
    /// `forward`s produce the full `[vocab]` logits on every rank of the group.
    pub fn shard(
        &self,
        plan: &TpPlan,
        rank: usize,
        comm: Arc<dyn Communicator>,
    ) -> Result<Model, ModelError> {
        if self.tp.is_some() {
            return Err(ModelError::TensorParallel(
                "a rank's model cannot be sharded again (shard the whole model)".into(),
            ));
        }
        if comm.size() != plan.tp || comm.rank() != rank {
            return Err(ModelError::TensorParallel(format!(
                "--tensor-parallel {}: rank {rank} was given the communicator of rank {} of {}",
                plan.tp,
                comm.rank(),
                comm.size()
            )));
        }
        let (cfg, weights) = crate::tp::shard(&self.cfg, &self.weights, plan, rank)?;
        let mut m = Model::new(cfg, weights)?;
        m.precision = self.precision;
        m.tp = Some(TpRank {
            comm: comm.clone(),
            vocab: plan.rank(rank)?.vocab.clone(),
            vocab_per_rank: plan.vocab_per_rank,
            share: KvShare::new(plan, rank, comm.clone()),
        });
        Ok(m)
    }

    /// The communicator of a tensor-parallel rank (`None` for a whole model).
    pub fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        self.tp.as_ref().map(|t| &t.comm)
    }

    /// The ranks sharing this rank's kv heads (`attend_layer`'s `share`).
    pub(crate) fn kv_share(&self) -> Option<&KvShare> {
        self.tp.as_ref().and_then(|t| t.share.as_ref())
    }

    /// Sum a row-parallel product's partial rows over the group (nothing for a whole model).
    fn all_reduce(&self, x: &mut [f32]) -> Result<(), ModelError> {
        match &self.tp {
            Some(t) => t.comm.all_reduce_sum(x),
            None => Ok(()),
        }
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

    /// `y = x Wᵀ` over `n` rows. `Chunk` rows are one sequence's chunk and go through the
    /// kernel their count calls for; `Independent` rows (a batched decode) each get exactly
    /// what a one-row product computes (per-row dots, never the GEMM), so a row's result does
    /// not depend on the batch it is in.
    fn linear(
        &self,
        w: &Weight,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        rows: Rows,
    ) -> Result<(), ModelError> {
        let v = w.view();
        let r = match (self.precision, rows) {
            (MatmulPrecision::Fast, Rows::Chunk) => matmul(&v, x, n, y),
            (MatmulPrecision::Exact, Rows::Chunk) if n >= gemm_crossover(w.ty) => {
                matmul_gemm(&v, x, n, y)
            }
            // Each row on its own: in `Fast` what `matmul` runs for one row (its GEMM starts
            // at `gemm_crossover` > 1 rows), in `Exact` what it runs below the crossover.
            (precision, _) => {
                debug_assert!(gemm_crossover(w.ty) > 1);
                let path = match precision {
                    MatmulPrecision::Fast => DotPath::Quantized,
                    MatmulPrecision::Exact => DotPath::Dequantized,
                };
                let mut scratch = MatvecScratch::new();
                matvec_with(&v, x, n, 0..w.rows, y, &mut scratch, path, Isa::best())
            }
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
        self.check_forward(tokens, pos0, cache)?;
        self.embed(tokens, s)?;
        self.rope(RowPos::Range(pos0), n, s);
        self.run_layers(
            0..c.num_hidden_layers,
            n,
            RowPos::Range(pos0),
            cache,
            policy,
            s,
        )?;
        cache.set_len(pos0 + n);
        policy.end_forward(pos0, n);
        self.head(n, rows, Rows::Chunk, s, logits)
    }

    /// Speculative verification: `tokens` at positions `pos0..pos0 + n` in one pass over the
    /// weights, each row computed exactly as a one-token `forward_with` at its position would
    /// be (per-row products, and per row a one-row attention call through `policy` over the
    /// keys up to its position), so the rows' logits are bit-equal to decoding the tokens one
    /// by one. Every row's K/V is written first; row i reads none past its own. `logits`
    /// receives `[n, vocab]`.
    #[allow(clippy::too_many_arguments)]
    pub fn verify_forward<T: CacheElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvStore<T>,
        policy: &mut dyn KvPolicy<T>,
        s: &mut Scratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let n = tokens.len();
        self.check_forward(tokens, pos0, cache)?;
        let most = self.verify_rows_max(cache);
        if n > most {
            return Err(ModelError::Compute(format!(
                "a verification of {n} rows needs more window-ring slots than the cache holds (at most {most} rows; a larger prefill chunk makes room)"
            )));
        }
        self.embed(tokens, s)?;
        self.rope(RowPos::Range(pos0), n, s);
        let qw = c.num_attention_heads * c.head_dim;
        let share = self.kv_share();
        for l in 0..c.num_hidden_layers {
            self.layer(l, n, Rows::Independent, s, |a| {
                cache
                    .write(l, pos0, a.k, a.v)
                    .map_err(|e| ModelError::Compute(format!("layer {l}: {e}")))?;
                for i in 0..n {
                    let (q, out) = (&a.q[i * qw..(i + 1) * qw], &mut a.out[i * qw..(i + 1) * qw]);
                    attend_layer(
                        c,
                        l,
                        q,
                        pos0 + i,
                        1,
                        a.window,
                        None,
                        cache,
                        policy,
                        out,
                        share,
                    )?;
                }
                Ok(())
            })?;
        }
        cache.set_len(pos0 + n);
        policy.end_forward(pos0, n);
        self.head(n, LogitsRows::All, Rows::Independent, s, logits)
    }

    /// Most rows one `verify_forward` can take on `cache`: it writes every row's K/V before
    /// the first row attends, so a sliding layer's ring must hold that row's window and the
    /// rows after it (unbounded without sliding layers).
    pub fn verify_rows_max<T: CacheElem>(&self, cache: &KvStore<T>) -> usize {
        (0..self.cfg.num_hidden_layers)
            .filter(|&l| self.cfg.is_sliding(l) && cache.layer(l).spec.ring)
            .filter_map(|l| {
                let w = self.cfg.sliding_window?;
                Some((cache.layer(l).spec.capacity + 1).saturating_sub(w))
            })
            .min()
            .unwrap_or(usize::MAX)
    }

    /// The checks every forward makes before touching the cache.
    fn check_forward<T: CacheElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &KvStore<T>,
    ) -> Result<(), ModelError> {
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
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Compute(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// Run the `n` rows of the residual stream `s.x` (positions `pos`, RoPE tables already in
    /// `s`) through `layers`, writing their K/V into `cache`.
    fn run_layers<T: CacheElem>(
        &self,
        layers: std::ops::Range<usize>,
        n: usize,
        pos: RowPos<'_>,
        cache: &mut KvStore<T>,
        policy: &mut dyn KvPolicy<T>,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let share = self.kv_share();
        for l in layers {
            self.layer(l, n, Rows::Chunk, s, |a| {
                match pos {
                    RowPos::Range(p0) => cache.write(l, p0, a.k, a.v),
                    RowPos::List(list) => cache.write_at(l, list, a.k, a.v),
                }
                .map_err(|e| ModelError::Compute(format!("layer {l}: {e}")))?;
                let (p0, list) = match pos {
                    RowPos::Range(p0) => (p0, None),
                    RowPos::List(list) => (0, Some(list)),
                };
                attend_layer(
                    &self.cfg, l, a.q, p0, n, a.window, list, cache, policy, a.out, share,
                )
            })?;
        }
        Ok(())
    }

    /// Layer `l` on the `n` rows of the residual stream `s.x` (RoPE tables already in `s`):
    /// norms, projections, RoPE and the MLP here; `attend` stores the rows' K/V and writes
    /// their attention output (`Attend::out`), so one sequence's chunk and a batch of
    /// sequences (each with its own cache) share this one copy of the layer math.
    pub(crate) fn layer(
        &self,
        l: usize,
        n: usize,
        rows: Rows,
        s: &mut Scratch,
        attend: impl FnOnce(Attend<'_>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let w = &self.weights.layers[l];
        let sliding = c.is_sliding(l);
        // --- attention block ---
        let xb = resize(&mut s.xb, n * h);
        ops::rmsnorm(&s.x, &w.attn_norm, c.rms_norm_eps, xb);
        let q = resize(&mut s.q, n * nh * hd);
        self.linear(&w.wq, xb, n, q, rows)?;
        let k = resize(&mut s.k, n * nkv * hd);
        self.linear(&w.wk, xb, n, k, rows)?;
        let v = resize(&mut s.v, n * nkv * hd);
        self.linear(&w.wv, xb, n, v, rows)?;
        for (x, bias) in [(&mut *q, &w.bq), (&mut *k, &w.bk), (&mut *v, &w.bv)] {
            if let Some(bias) = bias {
                ops::add_bias(x, bias);
            }
        }
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
        let att = resize(&mut s.att, n * nh * hd);
        attend(Attend {
            q,
            k,
            v,
            window: if sliding { c.sliding_window } else { None },
            out: &mut *att,
        })?;
        let o = resize(&mut s.o, n * h);
        self.linear(&w.wo, att, n, o, rows)?;
        self.all_reduce(o)?; // row-parallel: each rank holds a partial sum
        if let Some(pn) = &w.post_attn_norm {
            ops::rmsnorm_inplace(o, pn, c.rms_norm_eps);
        }
        ops::add_inplace(&mut s.x, o);
        // --- MLP block ---
        let xb = resize(&mut s.xb, n * h);
        ops::rmsnorm(&s.x, &w.ffn_norm, c.rms_norm_eps, xb);
        let gate = resize(&mut s.gate, n * c.intermediate_size);
        self.linear(&w.w_gate, xb, n, gate, rows)?;
        let up = resize(&mut s.up, n * c.intermediate_size);
        self.linear(&w.w_up, xb, n, up, rows)?;
        match c.activation {
            Activation::Silu => ops::silu_mul(gate, up),
            Activation::GeluTanh => ops::gelu_tanh_mul(gate, up),
        }
        let o = resize(&mut s.o, n * h);
        self.linear(&w.w_down, gate, n, o, rows)?;
        self.all_reduce(o)?; // row-parallel: each rank holds a partial sum
        if let Some(pn) = &w.post_ffw_norm {
            ops::rmsnorm_inplace(o, pn, c.rms_norm_eps);
        }
        ops::add_inplace(&mut s.x, o);
        Ok(())
    }

    /// Final norm + LM head on the rows of `s.x` (`n` rows) that need logits.
    pub(crate) fn head(
        &self,
        n: usize,
        which: LogitsRows,
        rows: Rows,
        s: &mut Scratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let first = match which {
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
        let Some(t) = &self.tp else {
            return self.linear(self.weights.lm_head(), xb, m, logits, rows);
        };
        // A rank's vocabulary slice, padded to the common width, gathered in rank order.
        let (v, len, per) = (c.vocab_size, t.vocab.len(), t.vocab_per_rank);
        let local = resize(&mut s.tp_local, m * per); // [m, per]
        self.linear(self.weights.lm_head(), xb, m, &mut local[..m * len], rows)?;
        if len < per {
            // [m, len] -> [m, per], from the last row back (rows only move right).
            for i in (0..m).rev() {
                local.copy_within(i * len..(i + 1) * len, i * per);
                local[i * per + len..(i + 1) * per].fill(0.0);
            }
        }
        let all = resize(&mut s.tp_all, t.comm.size() * m * per); // [ranks, m, per]
        t.comm.all_gather(local, all)?;
        for (r, part) in all.chunks_exact(m * per).enumerate() {
            let (lo, hi) = ((r * per).min(v), ((r + 1) * per).min(v));
            for (i, row) in part.chunks_exact(per).enumerate() {
                logits[i * v + lo..i * v + hi].copy_from_slice(&row[..hi - lo]);
            }
        }
        Ok(())
    }

    /// Embedding lookup of `tokens` into `s.x` (Gemma scales by sqrt(hidden)). A
    /// tensor-parallel rank writes the rows of the tokens in its vocabulary slice and zeros
    /// elsewhere, then sums over the group (exact: one rank's row plus zeros).
    pub(crate) fn embed(&self, tokens: &[u32], s: &mut Scratch) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (n, h) = (tokens.len(), c.hidden_size);
        let x = resize(&mut s.x, n * h);
        let scale = if c.scale_embeddings {
            (h as f32).sqrt()
        } else {
            1.0
        };
        let vocab = self
            .tp
            .as_ref()
            .map_or(0..c.vocab_size, |t| t.vocab.clone());
        for (&t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            let t = t as usize;
            if !vocab.contains(&t) {
                row.fill(0.0);
                continue;
            }
            self.weights.embed.row_f32(t - vocab.start, row);
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        self.all_reduce(x)
    }

    /// FastKV prefill (token-selective propagation) of `tokens` at positions `0..n` into an
    /// empty `cache`: chunks of `chunk` rows run through layers `0..=tsp_layer` with full
    /// context; there the last `window` rows' softmax attention (summed over heads and rows,
    /// max-pooled with `kernel`) picks the top `tsp_len - window` earlier tokens, which with
    /// the window are the only rows layers `tsp_layer + 1..` process, at their original
    /// positions. Writes the last row's `[vocab]` logits. With `tsp_len >= n` this is exactly
    /// `forward_with` over the same chunks.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_fastkv<T: CacheElem>(
        &self,
        tokens: &[u32],
        cache: &mut KvStore<T>,
        policy: &mut dyn KvPolicy<T>,
        s: &mut Scratch,
        chunks: &[(usize, usize)],
        tsp: &TspConfig,
        logits: &mut Vec<f32>,
    ) -> Result<Vec<u32>, ModelError> {
        let c = &self.cfg;
        let (n, h, hd) = (tokens.len(), c.hidden_size, c.head_dim);
        let l_count = c.num_hidden_layers;
        if n == 0 || !cache.is_empty() {
            return Err(ModelError::Compute(
                "FastKV prefill needs a non-empty prompt and an empty cache".into(),
            ));
        }
        if tsp.layer >= l_count || c.is_sliding(tsp.layer) {
            return Err(ModelError::Compute(format!(
                "--fastkv-tsp-layer {} must be a global-attention layer of this {l_count}-layer model (global layers: {:?})",
                tsp.layer,
                (0..l_count).filter(|&l| !c.is_sliding(l)).collect::<Vec<_>>()
            )));
        }
        if n > cache.capacity() {
            return Err(ModelError::ContextFull {
                needed: n,
                capacity: cache.capacity(),
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::Compute(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                c.vocab_size
            )));
        }
        // Phase 1: every token through layers 0..=T; keep the residual stream.
        let mut hidden = vec![0.0f32; n * h]; // [n, hidden]
        let mut q_last = Vec::new(); // [rows, heads, head_dim] of the last rows at layer T
        for &(a, b) in chunks {
            let m = b - a;
            self.embed(&tokens[a..b], s)?;
            self.rope(RowPos::Range(a), m, s);
            self.run_layers(0..tsp.layer + 1, m, RowPos::Range(a), cache, policy, s)?;
            hidden[a * h..b * h].copy_from_slice(&s.x[..m * h]);
            let rows = tsp.window.min(m);
            let width = c.num_attention_heads * hd;
            q_last.clear();
            q_last.extend_from_slice(&s.q[(m - rows) * width..m * width]);
        }
        let keep = if tsp.len >= n {
            (0..n as u32).collect::<Vec<u32>>()
        } else {
            self.tsp_select(tsp, n, &q_last, cache)?
        };
        // Phase 2: the kept rows through the remaining layers, chunk by chunk.
        let sel_chunks: Vec<(usize, usize)> = if keep.len() == n {
            chunks.to_vec()
        } else {
            // Same chunk size; the last chunk holds at least the window (policies observe it).
            let size = chunks.first().map_or(n, |&(a, b)| b - a).max(1);
            let k = keep.len();
            let mut v: Vec<(usize, usize)> = (0..k)
                .step_by(size)
                .map(|a| (a, (a + size).min(k)))
                .collect();
            let w = tsp.window.min(size).min(k);
            let last = v.len() - 1;
            if last > 0 && v[last].1 - v[last].0 < w {
                v[last - 1].1 = k - w;
                v[last].0 = k - w;
                if v[last - 1].0 == k - w {
                    v.remove(last - 1);
                }
            }
            v
        };
        for &(a, b) in &sel_chunks {
            let m = b - a;
            let x = resize(&mut s.x, m * h);
            for (i, &p) in keep[a..b].iter().enumerate() {
                x[i * h..(i + 1) * h]
                    .copy_from_slice(&hidden[p as usize * h..(p as usize + 1) * h]);
            }
            let list = &keep[a..b];
            let contiguous = list.windows(2).all(|w| w[1] == w[0] + 1);
            let pos = if contiguous {
                RowPos::Range(list[0] as usize)
            } else {
                RowPos::List(list)
            };
            self.rope(pos, m, s);
            self.run_layers(tsp.layer + 1..l_count, m, pos, cache, policy, s)?;
        }
        cache.set_len(n);
        policy.end_forward(0, n);
        let m = sel_chunks.last().map_or(0, |&(a, b)| b - a);
        self.head(m, LogitsRows::Last, Rows::Chunk, s, logits)?;
        Ok(keep)
    }

    /// FastKV's token choice at the TSP layer: softmax attention of the last rows (`q_last`)
    /// over all keys of layer `tsp.layer`, summed over rows and heads, max-pooled; the top
    /// `len - window` earlier positions plus the window, ascending.
    fn tsp_select<T: CacheElem>(
        &self,
        tsp: &TspConfig,
        n: usize,
        q_last: &[f32],
        cache: &KvStore<T>,
    ) -> Result<Vec<u32>, ModelError> {
        use slowfast_backend::cpu::attention::{
            attention_with_logits, logits_len, AttnShape, KvSegment, Mask, QueryPositions,
        };
        let c = &self.cfg;
        let shape = AttnShape {
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: c.attn_scale,
        };
        let rows = q_last.len() / (c.num_attention_heads * c.head_dim);
        let segs: Vec<Vec<KvSegment<'_, T>>> = (0..c.num_key_value_heads)
            .map(|kh| cache.segments(tsp.layer, kh, 0, n))
            .collect();
        let mut lg = vec![0.0f32; logits_len(&shape, rows, &segs)];
        let mut o = vec![0.0f32; q_last.len()];
        attention_with_logits(
            &shape,
            q_last,
            QueryPositions::Start((n - rows) as u32),
            &segs,
            Mask::CAUSAL,
            &mut o,
            None,
            &mut lg,
        )
        .map_err(|e| ModelError::Compute(format!("FastKV scores at layer {}: {e}", tsp.layer)))?;
        let mut per_q = Vec::new();
        slowfast_kv::score::accumulate_probs(
            &lg,
            rows,
            &vec![n; c.num_key_value_heads],
            &mut per_q,
        );
        let w = tsp.window.min(tsp.len).min(n);
        let mut total = vec![0.0f32; n - w];
        for q in &per_q {
            for (t, x) in total
                .iter_mut()
                .zip(slowfast_kv::score::max_pool(&q[..n - w], tsp.kernel))
            {
                *t += x;
            }
        }
        // Tensor parallel: each rank summed its own query heads; the sum over ranks is the
        // whole model's total (in another order), the same on every rank.
        self.all_reduce(&mut total)?;
        let mut keep: Vec<u32> = slowfast_kv::score::top_k(&total, tsp.len - w)
            .into_iter()
            .map(|i| i as u32)
            .collect();
        keep.extend((n - w) as u32..n as u32);
        keep.sort_unstable();
        Ok(keep)
    }

    /// The global-attention layer nearest the middle of the model (FastKV's default TSP layer).
    pub fn default_tsp_layer(&self) -> usize {
        let l = self.cfg.num_hidden_layers;
        let mid = (l as f64 - 1.0) / 2.0;
        (0..l)
            .filter(|&i| !self.cfg.is_sliding(i))
            .min_by(|&a, &b| (a as f64 - mid).abs().total_cmp(&(b as f64 - mid).abs()))
            .unwrap_or(l / 2)
    }

    /// RoPE tables (global and, if the model has sliding layers, local) for `n` rows.
    pub(crate) fn rope(&self, pos: RowPos<'_>, n: usize, s: &mut Scratch) {
        let sliding = self.cfg.layer_sliding.iter().any(|&b| b);
        match pos {
            RowPos::Range(p0) => {
                ops::rope_tables(p0..p0 + n, &self.inv_freq_global, &mut s.cos, &mut s.sin);
                if sliding {
                    ops::rope_tables(p0..p0 + n, &self.inv_freq_local, &mut s.cos_l, &mut s.sin_l);
                }
            }
            RowPos::List(l) => {
                let it = || l.iter().map(|&p| p as usize);
                ops::rope_tables(it(), &self.inv_freq_global, &mut s.cos, &mut s.sin);
                if sliding {
                    ops::rope_tables(it(), &self.inv_freq_local, &mut s.cos_l, &mut s.sin_l);
                }
            }
        }
    }
}
