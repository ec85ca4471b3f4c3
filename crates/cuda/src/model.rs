//! The generic decoder (Llama / Qwen3 / Gemma 3 flags) on the GPU: bf16 weights uploaded once,
//! a bf16 KV cache of `num_slots` sequences (`[slot, kv_head, position, head_dim]` per layer),
//! chunked prefill of one sequence and batched decode steps with greedy argmax on the device.
//! A decode step queues kernels only: no host synchronisation and no allocation (after the
//! first step sized the attention workspace).
//!
//! Head dims below the kernels' 64 / 128 / 256 are zero-padded per head (q/k/v rows, o
//! columns); the q/k norm weights and eps are rescaled so the padded RMS equals the true one.

use std::sync::Arc;

use cudarc::cublas::sys::cudaDataType;
use half::bf16;

use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, PdlMode};
use crate::error::CudaError;
use crate::ops::attention::{AttnWorkspace, DecodeAttn, PrefillAttn};
use crate::ops::elementwise::Glu;
use crate::ops::fused::{GemvInput, GemvOutput, QkvPost};
use crate::ops::norm::RmsNorm;
use crate::ops::sfi::SparsePost;
use crate::ops::KvLayout;
use crate::pages::{PageGeometry, PagePool};
use crate::sparse::{GpuKvPolicy, Refresh, SparseState};
use crate::vmm::{Reservation, Vmm};

/// Architecture of the decoder, resolved from a model config.
#[derive(Clone, Debug)]
pub struct DecoderSpec {
    pub hidden: usize,
    pub layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Per-head RMSNorm of q and k before RoPE.
    pub qk_norm: bool,
    /// Norms after attention and after the MLP (Gemma 3).
    pub post_norms: bool,
    /// Embedding rows are multiplied by this (Gemma: sqrt(hidden)).
    pub embed_scale: f32,
    pub glu: Glu,
    pub attn_scale: f32,
    /// Per layer: the sliding window, None for a global layer.
    pub windows: Vec<Option<usize>>,
    /// RoPE inverse frequencies `[head_dim / 2]` of global and sliding layers.
    pub inv_freq_global: Vec<f64>,
    pub inv_freq_local: Vec<f64>,
    /// LM head tied to the embedding.
    pub tied: bool,
}

/// A weight matrix of the decoder, `[rows = out, cols = in]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tensor {
    Embed,
    LmHead,
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

/// A norm weight vector (already in its final form: Gemma's `1 + w` folded in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    Attn(usize),
    Q(usize),
    K(usize),
    PostAttn(usize),
    Ffn(usize),
    PostFfw(usize),
    Final,
}

/// How the decoder keeps its KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvOptions {
    /// Physical pages mapped as sequences grow ([`GpuDecoder::new_paged`]).
    pub paged: bool,
    /// e4m3 (fp8) keys and values, one byte an element instead of bf16's two: per-layer (K,
    /// with q/k norms) or per-head power-of-two scales are calibrated at load and folded into
    /// the weights, so every attention kernel reads plain e4m3 values.
    pub fp8: bool,
}

/// Tokens of the fp8 calibration prefill ([`GpuDecoder::kv_scales`]).
const CALIB_TOKENS: usize = 512;
/// fp8 scales leave this factor of headroom above the calibration's largest |k| / |v|: keys
/// and values up to 16x larger still fit e4m3's 448 (the 3-bit mantissa makes the rounding
/// error relative, so headroom costs only the subnormal range at the bottom).
const FP8_HEADROOM: f32 = 16.0;

/// FastKV's token-selective propagation for [`GpuDecoder::prefill_fastkv`]: from after
/// `layer` on, only `len` prompt tokens (the top scored plus the last `window`, scored by
/// the window's attention max-pooled with `kernel`) are processed (the CPU's
/// `slowfast_model::TspConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TspArgs {
    pub layer: usize,
    pub len: usize,
    pub window: usize,
    pub kernel: usize,
}

/// The power-of-two scale for values up to `amax` in e4m3 with [`FP8_HEADROOM`] (1 for 0 or a
/// non-finite amax).
pub fn fp8_scale(amax: f32) -> f32 {
    if !(amax.is_finite() && amax > 0.0) {
        return 1.0;
    }
    (amax * FP8_HEADROOM / 448.0).log2().ceil().exp2()
}

/// Where the decoder's weights come from (the engine dequantizes its CPU model).
pub trait WeightSource {
    /// The matrix as bf16, row-major `[rows, cols]`.
    fn matrix(&self, t: Tensor) -> Result<Vec<bf16>, String>;
    fn norm(&self, n: Norm) -> Result<Vec<f32>, String>;
    /// Layer `layer`'s q, k and v projection biases (`[heads * head_dim]`, `[kv_heads *
    /// head_dim]` twice), for models that have them (Qwen2); None for the others.
    fn qkv_bias(&self, _layer: usize) -> Result<Option<[Vec<f32>; 3]>, String> {
        Ok(None)
    }
}

struct Layer {
    attn_norm: GpuBuffer<f32>,
    q_norm: Option<GpuBuffer<f32>>,
    k_norm: Option<GpuBuffer<f32>>,
    post_attn: Option<GpuBuffer<f32>>,
    ffn_norm: GpuBuffer<f32>,
    post_ffw: Option<GpuBuffer<f32>>,
    /// q, k and v stacked: [(heads + 2 kv_heads) * hdk, hidden] (one GEMV at decode).
    wqkv: GpuBuffer<bf16>,
    /// Their biases, stacked and padded as the rows: [(heads + 2 kv_heads) * hdk] (Qwen2).
    bqkv: Option<GpuBuffer<f32>>,
    wo: GpuBuffer<bf16>,        // [hidden, heads * hdk]
    w_gate_up: GpuBuffer<bf16>, // [2 * intermediate, hidden]
    w_down: GpuBuffer<bf16>,    // [hidden, intermediate]
}

/// Activations for up to `rows` token rows.
struct Acts {
    rows: usize,
    x: GpuBuffer<bf16>,    // [rows, hidden] residual stream
    xb: GpuBuffer<bf16>,   // [rows, hidden] normed
    qkv: GpuBuffer<bf16>,  // [rows, (heads + 2 kv_heads) * hdk] merged projection
    q: GpuBuffer<bf16>,    // [rows, heads, hdk] after norm + RoPE
    att: GpuBuffer<bf16>,  // [rows, heads, hdk]
    o: GpuBuffer<bf16>,    // [rows, hidden]
    gu: GpuBuffer<bf16>,   // [rows, 2 * intermediate]
    act: GpuBuffer<bf16>,  // [rows, intermediate]
    ids: GpuBuffer<u32>,   // [rows]
    pos: GpuBuffer<u32>,   // [rows]
    slots: GpuBuffer<u32>, // [rows]
}

/// The decoder on one GPU with its KV cache.
pub struct GpuDecoder {
    ctx: Arc<CudaContext>,
    spec: DecoderSpec,
    /// Head dim the kernels run at (64, 128 or 256; >= spec.head_dim).
    hdk: usize,
    head_norm: RmsNorm,
    layers: Vec<Layer>,
    /// Per layer: K and V caches, each [slots, kv_heads, capacity, hdk].
    caches: Vec<(GpuBuffer<bf16>, GpuBuffer<bf16>)>,
    /// Paged KV: the physical pages behind `caches` (None: allocated whole).
    pages: Option<KvPaging>,
    embed: GpuBuffer<bf16>,
    lm_head: Option<GpuBuffer<bf16>>,
    final_norm: GpuBuffer<f32>,
    freq_global: GpuBuffer<f64>,
    freq_local: GpuBuffer<f64>,
    kv: KvLayout,
    chunk: usize,
    pre: Acts,
    dec: Acts,
    logits: GpuBuffer<f32>, // [slots, vocab]
    dec_lens: GpuBuffer<u32>,
    next: GpuBuffer<u32>, // [slots] next input token per slot
    ws: AttnWorkspace,
    slot_len: Vec<usize>,
    /// Longest slot at `begin_decode` (+1): sizes the flash-decoding split (a longer sequence
    /// later is still exact, its last split just takes the rest).
    decode_span: usize,
    /// The decode step captured as a CUDA graph (for the current `decode_span`).
    graph: Option<cudarc::driver::CudaGraph>,
    weight_bytes: usize,
    /// The KV policy's device state (None: full KV).
    sparse: Option<SparseState>,
    /// Per slot: a refresh (slow step) requested for the next decode step.
    want_refresh: Vec<bool>,
    /// Paged KV, per slot: rows below which the slot gave its pages back
    /// ([`GpuDecoder::give_back_unread_kv`]; 0: none), and whether it goes on giving back
    /// the pages its sliding windows leave as it decodes.
    kv_floor: Vec<usize>,
    give_back: Vec<bool>,
    /// Decode steps that ran a refresh / that ran sparse only.
    slow_steps: usize,
    fast_steps: usize,
    /// SFI: decode steps between a slow step and the publication of its asynchronous
    /// refresh (0: refresh in order on the decode stream); from the policy's
    /// [`crate::GpuSfiConfig::refresh_lag`].
    refresh_lag: usize,
    /// Asynchronous refreshes not yet published.
    pending: Vec<PendingRefresh>,
    /// Decode steps so far (the clock of `pending`).
    step_no: usize,
    /// The slots whose memory the last `decode_step` refreshed (its slow rows).
    last_refresh: Vec<usize>,
    /// Speculative verification (allocated by the first `verify`).
    ver: Option<VerifyBufs>,
    /// fp8 KV calibration under way: `[layers][2 kv_heads]` largest |k|, |v| (qkv_post_f8).
    calib: Option<GpuBuffer<f32>>,
    /// fp8 KV: per layer, each kv head's K and V scale folded into the weights (1 with bf16).
    kv_scales: Vec<(Vec<f32>, Vec<f32>)>,
    /// Whether verifications without score capture replay CUDA graphs (`set_verify_graphs`).
    verify_graphs: bool,
    /// Verifications that replayed a captured graph.
    verify_replays: usize,
}

impl Drop for GpuDecoder {
    /// Paged KV: no kernel may still run when the pool unmaps its pages (a prefill left in
    /// flight faulted on the unmapped pages, run 138).
    fn drop(&mut self) {
        if self.pages.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}

/// The pages of a paged KV cache and the address ranges the caches view (the pool, dropped
/// first, unmaps its pages before the ranges are freed).
struct KvPaging {
    pool: PagePool<Vmm>,
    _reserved: Vec<Reservation>,
}

/// An asynchronous refresh waiting to be published: its (slot, length) pairs, the event that
/// ends its side-stream work, and the decode step from which it is published.
struct PendingRefresh {
    slots: Vec<(usize, usize)>,
    done: cudarc::driver::CudaEvent,
    due: usize,
}

fn bad(what: String) -> CudaError {
    CudaError::bad("gpu decoder", what)
}

/// Kernel head dim for a model head dim.
pub fn kernel_head_dim(head_dim: usize) -> Option<usize> {
    [64, 128, 256].into_iter().find(|&d| head_dim <= d)
}

/// `[heads * hd, cols]` -> `[heads * hdk, cols]` with zero rows after each head.
fn pad_rows(w: Vec<bf16>, heads: usize, hd: usize, hdk: usize, cols: usize) -> Vec<bf16> {
    if hd == hdk {
        return w;
    }
    let mut out = vec![bf16::ZERO; heads * hdk * cols];
    for h in 0..heads {
        let src = &w[h * hd * cols..(h + 1) * hd * cols];
        out[h * hdk * cols..h * hdk * cols + hd * cols].copy_from_slice(src);
    }
    out
}

/// q, k and v biases stacked as `wqkv`'s rows: each head's `hd` values padded to `hdk`.
fn stack_bias(
    b: &[Vec<f32>; 3],
    nh: usize,
    nkv: usize,
    hd: usize,
    hdk: usize,
) -> Result<Vec<f32>, String> {
    let mut out = Vec::with_capacity((nh + 2 * nkv) * hdk);
    for (v, heads) in b.iter().zip([nh, nkv, nkv]) {
        if v.len() != heads * hd {
            return Err(format!(
                "a q/k/v bias of {} values for {heads} heads of {hd}",
                v.len()
            ));
        }
        for h in v.chunks(hd) {
            out.extend_from_slice(h);
            out.resize(out.len() + hdk - hd, 0.0);
        }
    }
    Ok(out)
}

/// `[rows, heads * hd]` -> `[rows, heads * hdk]` with zero columns after each head.
fn pad_cols(w: Vec<bf16>, rows: usize, heads: usize, hd: usize, hdk: usize) -> Vec<bf16> {
    if hd == hdk {
        return w;
    }
    let mut out = vec![bf16::ZERO; rows * heads * hdk];
    for r in 0..rows {
        for h in 0..heads {
            let s = r * heads * hd + h * hd;
            let d = r * heads * hdk + h * hdk;
            out[d..d + hd].copy_from_slice(&w[s..s + hd]);
        }
    }
    out
}

impl Acts {
    fn new(ctx: &CudaContext, s: &DecoderSpec, hdk: usize, rows: usize) -> Result<Self, CudaError> {
        let (h, qd, kd, i) = (
            s.hidden,
            s.n_heads * hdk,
            s.n_kv_heads * hdk,
            s.intermediate,
        );
        Ok(Acts {
            rows,
            x: ctx.alloc(rows * h)?,
            xb: ctx.alloc(rows * h)?,
            qkv: ctx.alloc(rows * (qd + 2 * kd))?,
            q: ctx.alloc(rows * qd)?,
            att: ctx.alloc(rows * qd)?,
            o: ctx.alloc(rows * h)?,
            gu: ctx.alloc(rows * 2 * i)?,
            act: ctx.alloc(rows * i)?,
            ids: ctx.alloc(rows)?,
            pos: ctx.alloc(rows)?,
            slots: ctx.alloc(rows)?,
        })
    }
}

/// Which attention a forward pass runs.
#[derive(Clone, Copy)]
enum Attn {
    /// One sequence's chunk at `pos0` in `slot`.
    Prefill { slot: usize, pos0: usize },
    /// One token for each of `batch` slots.
    Decode,
    /// Speculative verification: `rps` consecutive tokens of every slot (`verify`).
    Verify { rps: usize },
}

/// Speculative verification's buffers: `rows` = slots x rows a slot at most.
struct VerifyBufs {
    acts: Acts,
    /// Per row: its sequence length (position + 1).
    lens: GpuBuffer<u32>,
    /// `[rows, vocab]` and their argmax.
    logits: GpuBuffer<f32>,
    next: GpuBuffer<u32>,
    /// Its own partials, so a captured decode graph's workspace never moves.
    ws: AttnWorkspace,
    /// Rows a slot, each slot's length before, and the span its key splits are planned for
    /// (the longest sequence, rounded up to a power of two), of the last `verify`.
    rps: usize,
    pos0: Vec<usize>,
    span: usize,
    /// SFI slots whose row 0 captured scores in the last `verify` (for `refresh_from_verify`).
    captured: Vec<Refresh>,
    /// Verifications captured as CUDA graphs, one a shape (dropped with these buffers).
    graphs: Vec<VerifyGraph>,
}

/// Rows a slot that the first verification's buffers hold at least (γ 8 and the pending
/// token); a wider verification reallocates them and drops their graphs.
const VERIFY_ROWS_MIN: usize = 9;

/// Verification graphs kept at once (the oldest goes first).
const MAX_VERIFY_GRAPHS: usize = 16;

/// One verification (`verify` without score capture) as a CUDA graph: its kernels read the
/// tokens, positions and lengths from device buffers that `verify` fills before the launch, so
/// it replays exactly at any length. It is keyed by what its launches fix: the rows a slot, the
/// key splits of each attention window (planned for the span at capture; a longer span that
/// plans others captures again) and the partials it writes.
struct VerifyGraph {
    rows: usize,
    splits: Vec<usize>,
    ws: (u64, u64),
    graph: cudarc::driver::CudaGraph,
}

impl GpuDecoder {
    /// Uploads the weights (bf16) and allocates a KV cache of `num_slots` sequences of up to
    /// `capacity` tokens each; prefill runs in chunks of at most `chunk` tokens.
    pub fn new(
        ctx: Arc<CudaContext>,
        spec: DecoderSpec,
        src: &dyn WeightSource,
        num_slots: usize,
        capacity: usize,
        chunk: usize,
    ) -> Result<Self, CudaError> {
        Self::with_options(
            ctx,
            spec,
            src,
            (num_slots, capacity, chunk),
            KvOptions::default(),
        )
    }

    /// A decoder of `num_slots` sequences of up to `capacity` tokens, prefilling `chunk`
    /// tokens at a time, its KV cache as `opts` says (paged, fp8). With fp8 KV the decoder
    /// calibrates its scales before it returns ([`GpuDecoder::kv_scales`]).
    pub fn with_options(
        ctx: Arc<CudaContext>,
        spec: DecoderSpec,
        src: &dyn WeightSource,
        (num_slots, capacity, chunk): (usize, usize, usize),
        opts: KvOptions,
    ) -> Result<Self, CudaError> {
        let mut d = Self::build(ctx, spec, src, num_slots, capacity, chunk, opts)?;
        if opts.fp8 {
            d.calibrate_fp8()?;
        }
        Ok(d)
    }

    /// As [`GpuDecoder::new`], but the KV cache is paged (`pages.rs`): its addresses are
    /// reserved for `num_slots` x `capacity` (rounded up to whole pages) and each slot maps
    /// physical pages as its sequence grows, up to [`GpuDecoder::set_kv_limit`] bytes in all
    /// (0 until set: slots hold only the scratch page of their dummy tokens). Decode reads
    /// the same addresses through the same kernels.
    pub fn new_paged(
        ctx: Arc<CudaContext>,
        spec: DecoderSpec,
        src: &dyn WeightSource,
        num_slots: usize,
        capacity: usize,
        chunk: usize,
    ) -> Result<Self, CudaError> {
        let opts = KvOptions {
            paged: true,
            fp8: false,
        };
        Self::with_options(ctx, spec, src, (num_slots, capacity, chunk), opts)
    }

    fn build(
        ctx: Arc<CudaContext>,
        spec: DecoderSpec,
        src: &dyn WeightSource,
        num_slots: usize,
        capacity: usize,
        chunk: usize,
        KvOptions { paged, fp8 }: KvOptions,
    ) -> Result<Self, CudaError> {
        let s = &spec;
        let hd = s.head_dim;
        let hdk = kernel_head_dim(hd)
            .ok_or_else(|| bad(format!("head_dim {hd} (the GPU kernels support up to 256)")))?;
        if s.windows.len() != s.layers
            || s.inv_freq_global.len() != hd / 2
            || s.inv_freq_local.len() != hd / 2
            || s.n_kv_heads == 0
            || s.n_heads % s.n_kv_heads != 0
        {
            return Err(bad(format!("inconsistent spec {spec:?}")));
        }
        if num_slots == 0 || num_slots > 1024 || capacity == 0 || chunk == 0 {
            return Err(bad(format!(
                "{num_slots} slots (1..=1024) of capacity {capacity}, chunk {chunk}"
            )));
        }
        let (h, nh, nkv, inter) = (s.hidden, s.n_heads, s.n_kv_heads, s.intermediate);
        let mut weight_bytes = 0usize;
        let mut up = |t: Tensor, rows: usize, cols: usize| -> Result<Vec<bf16>, CudaError> {
            let w = src.matrix(t).map_err(|e| bad(format!("{t:?}: {e}")))?;
            if w.len() != rows * cols {
                return Err(bad(format!(
                    "{t:?}: {} values for [{rows}, {cols}]",
                    w.len()
                )));
            }
            weight_bytes += w.len() * 2;
            Ok(w)
        };
        let norm = |n: Norm, len: usize| -> Result<Vec<f32>, CudaError> {
            let w = src.norm(n).map_err(|e| bad(format!("{n:?}: {e}")))?;
            if w.len() != len {
                return Err(bad(format!("{n:?}: {} values, expected {len}", w.len())));
            }
            Ok(w)
        };
        // Padded head: mean over hdk of zero-extended x is ms * hd / hdk; scaling the weight
        // by sqrt(hd / hdk) and eps by hd / hdk gives x * w / sqrt(ms + eps) exactly.
        let r = hd as f32 / hdk as f32;
        let head_w = |w: Vec<f32>| -> Vec<f32> {
            let mut o = vec![0.0f32; hdk];
            for (d, v) in o.iter_mut().zip(&w) {
                *d = v * r.sqrt();
            }
            o
        };
        let mut kv = KvLayout {
            num_slots,
            kv_heads: nkv,
            capacity,
            head_dim: hdk,
            fp8,
        };
        // Paged: whole pages per (slot, head) run, the addresses reserved up front.
        let paging = match paged {
            true => {
                let vmm = Vmm::new(ctx.ctx.clone())?;
                let (elem, runs) = (kv.elem_bytes(), 2 * s.layers);
                let geo = PageGeometry::new(vmm.page_bytes(), hdk, elem, nkv, runs)?;
                kv.capacity = geo.padded_capacity(capacity);
                Some((vmm, geo))
            }
            false => None,
        };
        let capacity = kv.capacity;
        let mut reservations = Vec::new();
        let mut layers = Vec::with_capacity(s.layers);
        let mut caches = Vec::with_capacity(s.layers);
        for l in 0..s.layers {
            let mut wqkv = pad_rows(up(Tensor::Q(l), nh * hd, h)?, nh, hd, hdk, h);
            wqkv.extend(pad_rows(up(Tensor::K(l), nkv * hd, h)?, nkv, hd, hdk, h));
            wqkv.extend(pad_rows(up(Tensor::V(l), nkv * hd, h)?, nkv, hd, hdk, h));
            let bqkv = match src
                .qkv_bias(l)
                .map_err(|e| CudaError::bad("weights", format!("layer {l}: {e}")))?
            {
                Some(b) => Some(
                    stack_bias(&b, nh, nkv, hd, hdk)
                        .map_err(|e| CudaError::bad("weights", format!("layer {l}: {e}")))?,
                ),
                None => None,
            };
            let wo = pad_cols(up(Tensor::O(l), h, nh * hd)?, h, nh, hd, hdk);
            let mut gate_up = up(Tensor::Gate(l), inter, h)?;
            gate_up.extend_from_slice(&up(Tensor::Up(l), inter, h)?);
            let w_down = up(Tensor::Down(l), h, inter)?;
            let opt = |n: Norm, on: bool, len: usize| -> Result<Option<Vec<f32>>, CudaError> {
                if on {
                    norm(n, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let q_norm = opt(Norm::Q(l), s.qk_norm, hd)?.map(&head_w);
            let k_norm = opt(Norm::K(l), s.qk_norm, hd)?.map(&head_w);
            let upo = |v: Option<Vec<f32>>| v.map(|v| ctx.upload(&v)).transpose();
            layers.push(Layer {
                attn_norm: ctx.upload(&norm(Norm::Attn(l), h)?)?,
                q_norm: upo(q_norm)?,
                k_norm: upo(k_norm)?,
                post_attn: upo(opt(Norm::PostAttn(l), s.post_norms, h)?)?,
                ffn_norm: ctx.upload(&norm(Norm::Ffn(l), h)?)?,
                post_ffw: upo(opt(Norm::PostFfw(l), s.post_norms, h)?)?,
                wqkv: ctx.upload(&wqkv)?,
                bqkv: bqkv.map(|b| ctx.upload(&b)).transpose()?,
                wo: ctx.upload(&wo)?,
                w_gate_up: ctx.upload(&gate_up)?,
                w_down: ctx.upload(&w_down)?,
            });
            match &paging {
                Some((vmm, _)) => {
                    let bytes = kv.buf_len() * 2;
                    let (k, v) = (vmm.reserve(bytes)?, vmm.reserve(bytes)?);
                    caches.push((
                        GpuBuffer::mapped(k.ptr, kv.buf_len()),
                        GpuBuffer::mapped(v.ptr, kv.buf_len()),
                    ));
                    reservations.push(k);
                    reservations.push(v);
                }
                None => caches.push((ctx.alloc(kv.buf_len())?, ctx.alloc(kv.buf_len())?)),
            }
        }
        let embed = ctx.upload(&up(Tensor::Embed, s.vocab, h)?)?;
        let lm_head = if s.tied {
            None
        } else {
            Some(ctx.upload(&up(Tensor::LmHead, s.vocab, h)?)?)
        };
        let pages = match paging {
            Some((vmm, geo)) => {
                let bases = reservations.iter().map(|r| r.ptr).collect();
                Some(KvPaging {
                    pool: PagePool::new(vmm, geo, bases, num_slots, capacity, 0)?,
                    _reserved: reservations,
                })
            }
            None => None,
        };
        let chunk = chunk.min(capacity);
        let pre = Acts::new(&ctx, s, hdk, chunk)?;
        let dec = Acts::new(&ctx, s, hdk, num_slots)?;
        let slots: Vec<u32> = (0..num_slots as u32).collect();
        let mut dec = dec;
        ctx.upload_into(&slots, &mut dec.slots)?;
        Ok(GpuDecoder {
            final_norm: ctx.upload(&norm(Norm::Final, h)?)?,
            freq_global: ctx.upload(&s.inv_freq_global)?,
            freq_local: ctx.upload(&s.inv_freq_local)?,
            logits: ctx.alloc(num_slots * s.vocab)?,
            dec_lens: ctx.alloc(num_slots)?,
            next: ctx.alloc(num_slots)?,
            head_norm: RmsNorm {
                eps: s.eps * r,
                gemma: false,
            },
            ws: AttnWorkspace::new(),
            slot_len: vec![0; num_slots],
            decode_span: 1,
            graph: None,
            sparse: None,
            want_refresh: vec![false; num_slots],
            kv_floor: vec![0; num_slots],
            give_back: vec![false; num_slots],
            slow_steps: 0,
            fast_steps: 0,
            refresh_lag: 0,
            pending: Vec::new(),
            step_no: 0,
            last_refresh: Vec::new(),
            ver: None,
            calib: None,
            kv_scales: vec![(vec![1.0; nkv], vec![1.0; nkv]); s.layers],
            verify_graphs: true,
            verify_replays: 0,
            hdk,
            layers,
            caches,
            pages,
            embed,
            lm_head,
            kv,
            chunk,
            pre,
            dec,
            weight_bytes,
            spec,
            ctx,
        })
    }

    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn num_slots(&self) -> usize {
        self.kv.num_slots
    }
    pub fn capacity(&self) -> usize {
        self.kv.capacity
    }
    /// Tokens cached in `slot`.
    pub fn slot_len(&self, slot: usize) -> usize {
        self.slot_len[slot]
    }
    /// Bytes of all weight matrices on the device (embedding once).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }
    /// Bytes of the KV cache allocated (all layers, K and V): with pages, those the slots
    /// hold now.
    pub fn kv_bytes(&self) -> usize {
        match &self.pages {
            Some(p) => p.pool.bytes_in_use(),
            None => self.caches.len() * 2 * self.kv.buf_len() * 2,
        }
    }

    /// Whether the KV cache is paged ([`GpuDecoder::new_paged`]).
    pub fn paged(&self) -> bool {
        self.pages.is_some()
    }

    /// Bytes of KV `slot` holds: its pages, or its share of the whole cache.
    pub fn slot_kv_bytes(&self, slot: usize) -> usize {
        match &self.pages {
            Some(p) => p.pool.slot_bytes(slot),
            None => self.kv_bytes() / self.kv.num_slots,
        }
    }

    /// Bytes of KV a slot holding `tokens` tokens maps (paged), or a slot's share.
    pub fn kv_bytes_for(&self, tokens: usize) -> usize {
        match &self.pages {
            Some(p) => p.pool.geometry().bytes_for(tokens, self.kv.capacity),
            None => self.kv_bytes() / self.kv.num_slots,
        }
    }

    /// Tokens a KV page holds per (slot, head) run (paged), else the capacity.
    pub fn page_tokens(&self) -> usize {
        self.pages
            .as_ref()
            .map_or(self.kv.capacity, |p| p.pool.geometry().page_tokens)
    }

    /// The most bytes of pages the slots may hold together (paged; the whole cache
    /// otherwise).
    pub fn kv_limit(&self) -> usize {
        match &self.pages {
            Some(p) => p.pool.limit_bytes(),
            None => self.kv_bytes(),
        }
    }

    /// Sets the bytes of pages the slots may hold together (paged only; at least what they
    /// hold now). Pages are created as slots grow; none is created here.
    pub fn set_kv_limit(&mut self, bytes: usize) -> Result<(), CudaError> {
        match self.pages.as_mut() {
            Some(p) => p.pool.set_limit(bytes),
            None => Err(bad("set_kv_limit: the KV cache is not paged".into())),
        }
    }

    /// Maps the pages `slot` needs to hold `tokens` tokens (paged; a no-op otherwise). A
    /// slot on the scratch page leaves it (after the device is idle: kernels queued for its
    /// dummy tokens still use it), except for a free slot's dummy tokens, which stay there.
    fn ensure_kv(&mut self, slot: usize, tokens: usize, dummy: bool) -> Result<(), CudaError> {
        let Some(p) = self.pages.as_mut() else {
            return Ok(());
        };
        if p.pool.on_scratch(slot) {
            if dummy {
                let room = p.pool.room(slot);
                if tokens > room {
                    return Err(bad(format!(
                        "slot {slot} holds no KV pages and {tokens} dummy tokens pass its scratch page of {room}"
                    )));
                }
                return Ok(());
            }
            self.ctx.synchronize()?;
        }
        p.pool.ensure(slot, tokens)
    }

    /// Empties `slot`, gives its KV pages back to the pool (paged) and leaves it holding
    /// one dummy token (token 0, on the scratch page when paged), as a free slot of the
    /// serving scheduler does: decode steps step every slot. Synchronises when paged.
    pub fn release_slot(&mut self, slot: usize) -> Result<(), CudaError> {
        self.reset_slot(slot)?;
        self.prefill_into(slot, &[0], false, true).map(|_| ())
    }

    /// Bytes of weights one decode step reads (every matrix once; one embedding row per token
    /// is negligible and left out; a tied head reads the embedding once).
    pub fn decode_weight_bytes(&self) -> usize {
        let (s, h) = (&self.spec, self.spec.hidden);
        let per_layer = (s.n_heads * 2 + s.n_kv_heads * 2) * self.hdk * h + 3 * h * s.intermediate;
        (s.layers * per_layer + s.vocab * h) * 2
    }

    /// Forgets the sequence in `slot`.
    /// Paged: its pages go back to the pool (synchronises), the slot to the scratch page.
    pub fn reset_slot(&mut self, slot: usize) -> Result<(), CudaError> {
        self.check_slot(slot)?;
        self.forget_slot(slot)?;
        self.release_pages(slot)
    }

    /// Paged: `slot`'s pages go back to the pool (synchronises), the slot to the scratch page.
    fn release_pages(&mut self, slot: usize) -> Result<(), CudaError> {
        if let Some(p) = self.pages.as_mut() {
            if !p.pool.on_scratch(slot) {
                self.ctx.synchronize()?;
                p.pool.release(slot)?;
            }
        }
        Ok(())
    }

    /// The lowest row of `slot` an attention path may read again while the slot holds
    /// `len` tokens and decodes ([`crate::pages::lowest_read_row`]): on a global layer the
    /// policy's row 0, except after SnapKV / PyramidKV compacted a prompt of at most `len`
    /// tokens.
    fn lowest_read(&self, slot: usize, len: usize) -> usize {
        let global = self
            .sparse
            .as_ref()
            .and_then(|sp| sp.reads_from(slot))
            .filter(|&(prompt, _)| len >= prompt)
            .map_or(0, |(_, from)| from);
        crate::pages::lowest_read_row(&self.spec.windows, global, len)
    }

    /// Paged KV: gives back the pages of `slot` that no attention path reads again, now
    /// and, as the slot decodes, each page its sliding windows leave behind: SnapKV's and
    /// PyramidKV's prompt before its window once every global layer compacted it, and the
    /// rows behind the windows of sliding-window layers (a model whose global layers read
    /// everything gives back nothing). Call it once the slot's prompt is whole: until the
    /// slot is reset, a prefill into it, a cut below what it still reads, `copy_slot` and
    /// `set_policy` are refused. A page the prefix cache holds stays cached. Returns the
    /// bytes of pages the slot stopped mapping (0 when not paged). Synchronises when it
    /// gives pages back.
    pub fn give_back_unread_kv(&mut self, slot: usize) -> Result<usize, CudaError> {
        self.check_slot(slot)?;
        let Some(p) = self.pages.as_ref() else {
            return Ok(0);
        };
        if p.pool.on_scratch(slot) || self.slot_len[slot] == 0 {
            return Ok(0);
        }
        self.give_back[slot] = true;
        self.drop_unread(slot)
    }

    /// The pages of `slot` wholly below its lowest read row go back to the pool.
    fn drop_unread(&mut self, slot: usize) -> Result<usize, CudaError> {
        let lowest = self.lowest_read(slot, self.slot_len[slot]);
        let Some(p) = self.pages.as_ref() else {
            return Ok(0);
        };
        if lowest / p.pool.geometry().page_tokens <= p.pool.dropped(slot) {
            return Ok(0);
        }
        self.flush_refreshes()?;
        self.ctx.synchronize()?;
        let p = self.pages.as_mut().expect("paged");
        let before = p.pool.slot_bytes(slot);
        p.pool.drop_below(slot, lowest)?;
        self.kv_floor[slot] = p.pool.dropped(slot) * p.pool.geometry().page_tokens;
        Ok(before - p.pool.slot_bytes(slot))
    }

    /// Rows below which `slot` gave its KV pages back (0: none).
    pub fn kv_floor(&self, slot: usize) -> usize {
        self.kv_floor[slot]
    }

    /// Refuses what would read the rows `slot` gave back (`what` names the call).
    fn check_floor(&self, slot: usize, what: &str) -> Result<(), CudaError> {
        match self.kv_floor[slot] {
            0 => Ok(()),
            f => Err(bad(format!(
                "{what}: slot {slot} gave back its KV below row {f} (give_back_unread_kv); reset the slot first"
            ))),
        }
    }

    /// Forgets the sequence in `slot` (length, refresh request, policy state), its KV
    /// pages left as they are (all of them given back when it gave some back already).
    fn forget_slot(&mut self, slot: usize) -> Result<(), CudaError> {
        self.flush_refreshes()?;
        if self.kv_floor[slot] > 0 {
            // its first pages are gone: the slot starts again from the scratch page
            self.release_pages(slot)?;
            self.kv_floor[slot] = 0;
        }
        self.give_back[slot] = false;
        self.slot_len[slot] = 0;
        self.want_refresh[slot] = false;
        if let Some(sp) = self.sparse.as_mut() {
            sp.reset_slot(&self.ctx, slot)?;
        }
        Ok(())
    }

    /// Paged KV: turns on the prefix cache, over whole blocks of `block_tokens` (a multiple
    /// of a page's tokens; the serving scheduler uses its prefill part), at most `bytes` of
    /// pages, evicted least recently used when slots need the memory.
    pub fn enable_prefix_cache(
        &mut self,
        block_tokens: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        match self.pages.as_mut() {
            Some(p) => p.pool.enable_prefix(block_tokens, bytes),
            None => Err(bad("the prefix cache needs the paged KV".into())),
        }
    }

    /// Maps into `slot` the cached pages of the longest cached prefix of `tokens` (whole
    /// blocks, at most `max_blocks`); returns its length, now the slot's sequence (a slot
    /// holding pages gives them back first). Nothing cached: 0, and a slot on the scratch
    /// page (a free slot's dummy tokens) is left as it was. The shared pages are read only:
    /// the slot's tokens continue past them. Synchronises.
    pub fn adopt_prefix(
        &mut self,
        slot: usize,
        tokens: &[u32],
        max_blocks: usize,
    ) -> Result<usize, CudaError> {
        self.check_slot(slot)?;
        match &self.pages {
            Some(p) if p.pool.prefix_block().is_some() => {
                if !p.pool.on_scratch(slot) {
                    self.reset_slot(slot)?;
                }
            }
            _ => return Ok(0),
        }
        self.flush_refreshes()?;
        // A hit unmaps the scratch page, which kernels queued for the dummy tokens use.
        self.ctx.synchronize()?;
        let pool = &mut self.pages.as_mut().expect("paged").pool;
        let n = pool.adopt(slot, tokens, max_blocks)?;
        if n > 0 {
            self.forget_slot(slot)?;
            self.slot_len[slot] = n;
        }
        Ok(n)
    }

    /// Caches the first `blocks` whole blocks of `slot`'s sequence, whose tokens begin
    /// `tokens` (blocks cached already are kept as they are).
    pub fn cache_prefix(&mut self, slot: usize, tokens: &[u32], blocks: usize) {
        let len = self.slot_len[slot];
        if let Some(p) = self.pages.as_mut() {
            p.pool
                .remember(slot, &tokens[..len.min(tokens.len())], blocks);
        }
    }

    /// Bytes of pages only the prefix cache holds.
    pub fn prefix_cache_bytes(&self) -> usize {
        self.pages
            .as_ref()
            .map_or(0, |p| p.pool.cached_only_bytes())
    }

    /// Tokens of a prefix-cache block (None: no prefix cache).
    pub fn prefix_block(&self) -> Option<usize> {
        self.pages.as_ref().and_then(|p| p.pool.prefix_block())
    }

    /// Bytes of the pages `slot` must still map to hold `tokens` tokens (paged; 0 otherwise).
    pub fn kv_bytes_more(&self, slot: usize, tokens: usize) -> usize {
        match &self.pages {
            Some(p) => {
                let g = p.pool.geometry();
                let more = g
                    .pages_for(tokens, self.kv.capacity)
                    .saturating_sub(p.pool.pages(slot));
                more * g.runs_per_slot * g.page_bytes
            }
            None => 0,
        }
    }

    /// fp8 KV: per layer, each kv head's (K scale, V scale), the power-of-two factors the
    /// stored keys and values are divided by (folded into the weights); 1 with bf16 KV.
    pub fn kv_scales(&self) -> &[(Vec<f32>, Vec<f32>)] {
        &self.kv_scales
    }

    /// Whether the KV cache holds e4m3 values.
    pub fn kv_fp8(&self) -> bool {
        self.kv.fp8
    }

    /// Bytes of one cached position of one kv head (the kernel head dim's bf16 or e4m3).
    pub fn kv_row_bytes(&self) -> usize {
        self.kv.row_bytes()
    }

    /// fp8 KV: prefills [`CALIB_TOKENS`] fixed tokens into slot 0 (the special ids 0-3, then a
    /// fixed pseudo-random sequence over the vocabulary) collecting each kv head's largest
    /// |k| and |v| per layer, picks power-of-two scales with [`FP8_HEADROOM`] and folds them
    /// into the weights: K's into the k-norm (or k rows) and its inverse into the q-norm (or
    /// q rows) — scores unchanged; V's into the v rows and its inverse into the output
    /// projection's columns — outputs unchanged. Powers of two make the folds exact. Keys of a
    /// model with q/k norms share one scale a layer (the norm weights are shared by the heads).
    fn calibrate_fp8(&mut self) -> Result<(), CudaError> {
        let (l, nkv) = (self.spec.layers, self.spec.n_kv_heads);
        let n = CALIB_TOKENS.min(self.kv.capacity);
        let vocab = self.spec.vocab as u64;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let tokens: Vec<u32> = (0..n as u64)
            .map(|i| {
                if i < 4 {
                    return (i % vocab) as u32;
                }
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % vocab) as u32
            })
            .collect();
        let limit = self.pages.as_ref().map(|p| p.pool.limit_bytes());
        if let Some(p) = self.pages.as_mut() {
            let need = p.pool.geometry().bytes_for(n, self.kv.capacity);
            p.pool.set_limit(need.max(p.pool.limit_bytes()))?;
        }
        self.calib = Some(self.ctx.upload(&vec![0.0f32; l * 2 * nkv])?);
        let run = self.prefill(0, &tokens, false);
        let amax = self.ctx.download(self.calib.as_ref().expect("set above"));
        self.calib = None;
        run?;
        let amax = amax?;
        self.reset_slot(0)?;
        if let (Some(p), Some(limit)) = (self.pages.as_mut(), limit) {
            p.pool.set_limit(limit)?;
        }
        let (hdk, nh, hidden) = (self.hdk, self.spec.n_heads, self.spec.hidden);
        let g = nh / nkv;
        for (li, a) in amax.chunks(2 * nkv).enumerate() {
            let mut sk: Vec<f32> = a[..nkv].iter().map(|&m| fp8_scale(m)).collect();
            let sv: Vec<f32> = a[nkv..].iter().map(|&m| fp8_scale(m)).collect();
            let w = &mut self.layers[li];
            // The bias rows scale with their weight rows (q and k only without q/k norms: a
            // norm after the bias takes the scale instead).
            let mut bias_f = vec![1.0f32; (nh + 2 * nkv) * hdk];
            match (&mut w.q_norm, &mut w.k_norm) {
                (Some(qn), Some(kn)) => {
                    let s = sk.iter().cloned().fold(0.0f32, f32::max);
                    sk.iter_mut().for_each(|v| *v = s);
                    for (buf, f) in [(qn, s), (kn, 1.0 / s)] {
                        let v: Vec<f32> = self.ctx.download(buf)?.iter().map(|x| x * f).collect();
                        self.ctx.upload_into(&v, buf)?;
                    }
                }
                _ => {
                    // wqkv [(heads + 2 kv_heads) * hdk, hidden]: k rows of head h, q rows of its group
                    for (h, &s) in sk.iter().enumerate() {
                        let (k0, q0) = ((nh + h) * hdk, h * g * hdk);
                        let c = &self.ctx;
                        c.scale_block(&mut w.wqkv, k0 * hidden, hdk, hidden, hidden, 1.0 / s)?;
                        c.scale_block(&mut w.wqkv, q0 * hidden, g * hdk, hidden, hidden, s)?;
                        bias_f[k0..k0 + hdk].iter_mut().for_each(|f| *f = 1.0 / s);
                        bias_f[q0..q0 + g * hdk].iter_mut().for_each(|f| *f = s);
                    }
                }
            }
            for (h, &s) in sv.iter().enumerate() {
                let v0 = (nh + nkv + h) * hdk;
                self.ctx
                    .scale_block(&mut w.wqkv, v0 * hidden, hdk, hidden, hidden, 1.0 / s)?;
                bias_f[v0..v0 + hdk].iter_mut().for_each(|f| *f = 1.0 / s);
                // wo [hidden, heads * hdk]: the columns of the group's query heads
                self.ctx
                    .scale_block(&mut w.wo, h * g * hdk, hidden, nh * hdk, g * hdk, s)?;
            }
            if let Some(b) = w.bqkv.as_mut() {
                let v: Vec<f32> = self
                    .ctx
                    .download(b)?
                    .iter()
                    .zip(&bias_f)
                    .map(|(x, f)| x * f)
                    .collect();
                self.ctx.upload_into(&v, b)?;
            }
            self.kv_scales[li] = (sk, sv);
        }
        self.ctx.synchronize()
    }

    /// Device address of `(slot, head)`'s run of `capacity` rows in cache buffer `c`.
    fn kv_run(&self, c: &GpuBuffer<bf16>, slot: usize, head: usize) -> u64 {
        let row0 = (slot * self.kv.kv_heads + head) * self.kv.capacity;
        c.device_ptr() + (row0 * self.kv.row_bytes()) as u64
    }

    /// Tokens at the start of `slot` on pages shared from the prefix cache (never written).
    fn shared_tokens(&self, slot: usize) -> usize {
        self.pages
            .as_ref()
            .map_or(0, |p| p.pool.shared_tokens(slot))
    }

    /// Switches the global layers to `policy` (allocates its device state; forgets every
    /// slot's memory). Full KV drops the state.
    pub fn set_policy(&mut self, policy: GpuKvPolicy) -> Result<(), CudaError> {
        if let Some(s) = self.kv_floor.iter().position(|&f| f > 0) {
            self.check_floor(s, "set_policy")?;
        }
        self.flush_refreshes()?;
        self.ctx.synchronize()?; // no side work may still use the buffers dropped here
        self.sparse = None;
        self.graph = None;
        self.refresh_lag = match policy {
            GpuKvPolicy::Sfi(c) => c.refresh_lag,
            _ => 0,
        };
        self.sparse = SparseState::new(
            &self.ctx,
            policy,
            &self.spec.windows,
            &self.caches,
            self.spec.n_heads,
            self.kv,
            self.refresh_lag > 0,
        )?;
        // sequences already held (a policy set after their prefill)
        if let Some(sp) = self.sparse.as_mut() {
            for (s, &len) in self.slot_len.iter().enumerate().filter(|(_, &l)| l > 0) {
                sp.prefilled(&self.ctx, s, len)?;
            }
        }
        Ok(())
    }

    /// Publishes every asynchronous refresh still pending (the decode stream waits for their
    /// side-stream work on the device; no host synchronisation).
    pub fn flush_refreshes(&mut self) -> Result<(), CudaError> {
        self.publish_pending(true)
    }

    /// Publishes the pending refreshes that are due (all with `all`).
    fn publish_pending(&mut self, all: bool) -> Result<(), CudaError> {
        let now = self.step_no;
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| all || p.due <= now);
        self.pending = keep;
        for p in due {
            self.ctx.wait_side(&p.done)?;
            if let Some(sp) = self.sparse.as_mut() {
                for &(slot, len) in &p.slots {
                    sp.publish(&self.ctx, slot, len)?;
                }
            }
        }
        Ok(())
    }

    /// Asks for a slow step (dense attention + memory refresh) of `slot` at the next decode
    /// step (SFI; ignored by the other policies).
    pub fn request_refresh(&mut self, slot: usize) -> Result<(), CudaError> {
        self.check_slot(slot)?;
        self.want_refresh[slot] = true;
        Ok(())
    }

    /// Whether `slot` takes a slow step at the next decode step as things stand: asked for
    /// with `request_refresh`, or waiting from an earlier step for a score row.
    pub fn refresh_requested(&self, slot: usize) -> bool {
        self.want_refresh.get(slot).copied().unwrap_or(false)
    }

    /// Whether a refresh asked for `slot` now would run at the next decode step (SFI, and the
    /// slot long enough for a sparse memory); a rider that would not is not asked.
    pub fn would_refresh(&self, slot: usize) -> bool {
        self.sparse.as_ref().is_some_and(|sp| {
            sp.sfi().is_some()
                && slot < self.kv.num_slots
                && sp.wants_capture(slot, self.slot_len[slot] + 1, true)
        })
    }

    /// SFI: the score rows the next decode step has left after the slots that want one
    /// (`refresh_requested`): room for more slots to refresh in the same step (riding,
    /// `slowfast_kv::sfi::trigger::riders`). 0 for the other policies.
    pub fn capture_room(&self) -> usize {
        let Some(sp) = self.sparse.as_ref().filter(|s| s.sfi().is_some()) else {
            return 0;
        };
        let wanting = self.want_refresh.iter().filter(|&&w| w).count();
        sp.capture_rows().saturating_sub(wanting)
    }

    /// (decode steps that ran a refresh, decode steps that ran sparse only, refreshes).
    pub fn step_counts(&self) -> (usize, usize, usize) {
        (
            self.slow_steps,
            self.fast_steps,
            self.sparse.as_ref().map_or(0, |s| s.refreshes),
        )
    }

    /// The slots the last `decode_step` refreshed (SFI's slow rows: asked for with
    /// `request_refresh`, or the bridge of a slot without a memory); empty otherwise.
    pub fn last_refreshed(&self) -> &[usize] {
        &self.last_refresh
    }

    /// Whether the policy's capturing steps output attention over the memory they chose (the
    /// oracle), not their dense pass: they count as sparse steps reading `attended`.
    pub fn selects_within_step(&self) -> bool {
        self.sparse
            .as_ref()
            .is_some_and(|s| s.policy.selects_within_step())
    }

    /// Tokens a fast step of `slot` attends per kv head on a global layer now.
    pub fn attended(&self, slot: usize) -> usize {
        let n = self.slot_len[slot];
        self.sparse.as_ref().map_or(n, |s| s.attended(slot, n))
    }

    /// Keys a layer the last decode slow step of `slot` read: every key, or with SFI's cheaper
    /// slow step its view and the page bounds it scored (`len`, the step's length, when it
    /// read densely or none happened).
    pub fn slow_step_read(&self, slot: usize, len: usize) -> usize {
        self.sparse
            .as_ref()
            .and_then(|s| s.slow_read(slot))
            .unwrap_or(len)
            .min(len)
    }

    /// Shortens the cached sequence of `slot` to its first `len` tokens (later positions are
    /// overwritten by what comes next).
    pub fn truncate(&mut self, slot: usize, len: usize) -> Result<(), CudaError> {
        self.check_slot(slot)?;
        if len > self.slot_len[slot] || len < self.shared_tokens(slot) {
            return Err(bad(format!(
                "truncate slot {slot} of {} tokens ({} shared) to {len}",
                self.slot_len[slot],
                self.shared_tokens(slot)
            )));
        }
        self.flush_refreshes()?;
        if self.kv_floor[slot] > 0 {
            if len == 0 {
                return self.forget_slot(slot); // its pages go too
            }
            // SnapKV's selection depends on the prompt alone: the memory stays when the
            // cut keeps the prompt (and every read stays above what was given back)
            if self.lowest_read(slot, len) < self.kv_floor[slot] {
                return Err(bad(format!(
                    "truncate slot {slot} to {len}: it gave back its KV below row {}, which the cut sequence would read",
                    self.kv_floor[slot]
                )));
            }
            self.slot_len[slot] = len;
            return Ok(());
        }
        self.slot_len[slot] = len;
        self.give_back[slot] = false; // the policy's memory goes with the cut (H2O's back to
                                      // where its last prefill ended stays: `truncate_slot`)
        if let Some(sp) = self.sparse.as_mut() {
            sp.truncate_slot(&self.ctx, slot, len)?;
        }
        Ok(())
    }

    /// Shortens slot `slot` to its first `len` tokens, as `truncate` does, but keeps the
    /// policy's memory where it stays valid (SFI: a memory built at a length within `len`):
    /// speculative decoding cuts rejected drafts this way after every verification.
    pub fn rewind(&mut self, slot: usize, len: usize) -> Result<(), CudaError> {
        self.check_slot(slot)?;
        if len > self.slot_len[slot] || len < self.shared_tokens(slot) {
            return Err(bad(format!(
                "rewind slot {slot} of {} tokens ({} shared) to {len}",
                self.slot_len[slot],
                self.shared_tokens(slot)
            )));
        }
        if len == self.slot_len[slot] {
            return Ok(());
        }
        if self.kv_floor[slot] > 0 && self.lowest_read(slot, len) < self.kv_floor[slot] {
            return Err(bad(format!(
                "rewind slot {slot} to {len}: it gave back its KV below row {}, which the cut sequence would read",
                self.kv_floor[slot]
            )));
        }
        // A refresh still pending for this slot and built past `len` must not be published
        // later: publish it now, so the check below forgets it. One built within `len` stays
        // pending (its Selector keeps overlapping the next steps).
        if self
            .pending
            .iter()
            .any(|p| p.slots.iter().any(|&(s, l)| s == slot && l > len))
        {
            self.flush_refreshes()?;
        }
        self.slot_len[slot] = len;
        if let Some(sp) = self.sparse.as_mut() {
            sp.rewind_slot(&self.ctx, slot, len)?;
        }
        Ok(())
    }

    /// Prepares decode steps after `rewind` / `verify` / `set_next` like `begin_decode`, but
    /// keeps a captured graph: its kernels read the lengths and positions from the device and
    /// split each sequence's keys there, so any length is exact (the split count, sized for the
    /// span at capture, only balances the work).
    pub fn resume_decode(&mut self) -> Result<(), CudaError> {
        if self.graph.is_none() {
            return self.begin_decode();
        }
        if let Some(s) = self.slot_len.iter().position(|&l| l == 0) {
            return Err(bad(format!(
                "slot {s} is empty: prefill it before decoding"
            )));
        }
        let pos: Vec<u32> = self.slot_len.iter().map(|&l| l as u32).collect();
        let lens: Vec<u32> = pos.iter().map(|p| p + 1).collect();
        self.ctx.upload_into(&pos, &mut self.dec.pos)?;
        self.ctx.upload_into(&lens, &mut self.dec_lens)
    }

    /// Speculative verification: scores `rows` tokens of every slot in one pass, slot s's
    /// `tokens[s * rows..(s + 1) * rows]` at positions `slot_len(s)..`, with dense attention
    /// over the slot's whole cache (each K/V tile read once for all rows, `attn_verify`), and
    /// leaves every row's logits and argmax (`verify_logits`, `verify_argmax`). Their keys and
    /// values are written into the cache and each slot grows by `rows`; `rewind` cuts what is
    /// rejected. SFI: row 0 of each slot with `capture[s]` (the first `CAPTURE_ROWS` of them)
    /// also leaves its scores, from which `refresh_from_verify` rebuilds the memory (the
    /// verification is its slow step).
    pub fn verify(
        &mut self,
        tokens: &[u32],
        rows: usize,
        capture: &[bool],
    ) -> Result<(), CudaError> {
        let ns = self.kv.num_slots;
        if rows == 0 || rows > 64 || tokens.len() != ns * rows {
            return Err(bad(format!(
                "verify: {} tokens for {ns} slots x {rows} rows (1..=64 rows)",
                tokens.len()
            )));
        }
        if capture.len() != ns {
            return Err(bad(format!(
                "verify: {} capture flags for {ns} slots",
                capture.len()
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab) {
            return Err(bad(format!("token id {t} outside the vocabulary")));
        }
        for (s, &l) in self.slot_len.iter().enumerate() {
            if l == 0 {
                return Err(bad(format!(
                    "slot {s} is empty: prefill it before verifying"
                )));
            }
            if l + rows > self.kv.capacity {
                return Err(bad(format!(
                    "verify: slot {s} holds {l} of {} tokens, no room for {rows} rows",
                    self.kv.capacity
                )));
            }
        }
        for s in 0..ns {
            self.ensure_kv(s, self.slot_len[s] + rows, true)?;
        }
        // Pending refreshes are published first when this pass captures: their Selector reads
        // the scores it overwrites.
        if capture.iter().any(|&c| c) {
            self.flush_refreshes()?;
        }
        let n = ns * rows;
        if self.ver.as_ref().is_none_or(|v| v.acts.rows < n) {
            // Room for γ up to 8 at once, so the graphs of several γ share these buffers.
            let cap = ns * rows.max(VERIFY_ROWS_MIN);
            self.ver = None;
            self.ver = Some(VerifyBufs {
                acts: Acts::new(&self.ctx, &self.spec, self.hdk, cap)?,
                lens: self.ctx.alloc(cap)?,
                logits: self.ctx.alloc(cap * self.spec.vocab)?,
                next: self.ctx.alloc(cap)?,
                ws: AttnWorkspace::new(),
                rps: rows,
                pos0: Vec::new(),
                span: 0,
                captured: Vec::new(),
                graphs: Vec::new(),
            });
        }
        let pos: Vec<u32> = (0..n)
            .map(|i| (self.slot_len[i / rows] + i % rows) as u32)
            .collect();
        let lens: Vec<u32> = pos.iter().map(|p| p + 1).collect();
        let slots: Vec<u32> = (0..n).map(|i| (i / rows) as u32).collect();
        let mut refresh = Vec::new();
        if let Some(sp) = self.sparse.as_mut().filter(|s| s.sfi().is_some()) {
            if capture.iter().any(|&c| c) {
                // the first `CAPTURE_ROWS` flagged slots capture; the others refresh later
                let wanting = (0..capture.len()).filter(|&s| capture[s]).collect();
                let (now, _) = sp.split_capture(wanting);
                let mut flags = vec![false; capture.len()];
                now.iter().for_each(|&s| flags[s] = true);
                sp.set_capture(&self.ctx, &flags)?;
                for s in now {
                    refresh.push(Refresh {
                        slot: s,
                        len: self.slot_len[s] + 1,
                        rows: 1,
                        boot_row0: None,
                    });
                }
            }
        }
        {
            let v = self.ver.as_mut().expect("allocated above");
            self.ctx.upload_into(tokens, &mut v.acts.ids)?;
            self.ctx.upload_into(&pos, &mut v.acts.pos)?;
            self.ctx.upload_into(&slots, &mut v.acts.slots)?;
            self.ctx.upload_into(&lens, &mut v.lens)?;
            v.rps = rows;
            v.pos0 = self.slot_len.clone();
            // The key splits are planned for the longest sequence rounded up to a power of
            // two: more splits than a shorter span fills only leave blocks idle (the kernel
            // reads each row's length), and a captured graph's plan then lasts until the span
            // doubles, not one 64-key tile (which it would at one kv head and few sequences).
            let longest = self.slot_len.iter().max().copied().unwrap_or(0) + rows;
            v.span = longest.next_power_of_two();
            v.captured = refresh.clone();
        }
        self.ctx.set_pdl_mode(PdlMode::Off);
        if !refresh.is_empty() || !self.verify_graphs {
            self.queue_verify(n, rows, &refresh)?;
        } else {
            let splits = self.verify_splits(rows);
            let v = self.ver.as_mut().expect("allocated above");
            let ws = v.ws.ptrs();
            // Graphs whose partials moved (a wider verification grew them) are stale.
            v.graphs.retain(|g| g.ws == ws);
            match v
                .graphs
                .iter()
                .find(|g| g.rows == rows && g.splits == splits)
            {
                Some(g) => {
                    g.graph
                        .launch()
                        .map_err(crate::context::drv("cuGraphLaunch"))?;
                    self.verify_replays += 1;
                }
                None => {
                    // Partials for any row count the buffers hold at this plan, so capturing
                    // another shape later does not move them under this one's graph.
                    let (need_o, need_ml) = self.verify_partials();
                    let ctx = self.ctx.clone();
                    let v = self.ver.as_mut().expect("allocated above");
                    v.ws.ensure(&ctx, need_o, need_ml)?;
                    // Run it once, then capture it for next time.
                    self.queue_verify(n, rows, &[])?;
                    let graph = ctx.capture_graph(|| self.queue_verify(n, rows, &[]))?;
                    let v = self.ver.as_mut().expect("allocated above");
                    let ws = v.ws.ptrs();
                    // The plan changes when the span doubles and γ takes a few values, so
                    // few shapes recur; a bound keeps memory flat all the same.
                    if v.graphs.len() >= MAX_VERIFY_GRAPHS {
                        v.graphs.remove(0);
                    }
                    v.graphs.push(VerifyGraph {
                        rows,
                        splits,
                        ws,
                        graph,
                    });
                }
            }
        }
        for l in self.slot_len.iter_mut() {
            *l += rows;
        }
        self.slow_steps += 1;
        Ok(())
    }

    /// Queues one verification of `rows` rows a slot (`n` in all; the inputs uploaded): the
    /// layers, the LM head and the argmax of every row.
    fn queue_verify(
        &mut self,
        n: usize,
        rows: usize,
        refresh: &[Refresh],
    ) -> Result<(), CudaError> {
        self.forward(n, Attn::Verify { rps: rows }, refresh)?;
        let (h, vocab) = (self.spec.hidden, self.spec.vocab);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed).device_ptr();
        let v = self
            .ver
            .as_mut()
            .expect("verify allocates its buffers first");
        self.ctx.linear_raw(
            v.acts.xb.device_ptr(),
            head,
            v.logits.device_ptr(),
            cudaDataType::CUDA_R_32F,
            n,
            h,
            vocab,
        )?;
        self.ctx.argmax(&v.logits, &mut v.next, n, vocab)
    }

    /// The key splits of each attention window's layers in a verification of `rows` rows a
    /// slot at the current span (what a captured verification graph fixes).
    fn verify_splits(&self, rows: usize) -> Vec<usize> {
        let mut windows: Vec<Option<usize>> = self.spec.windows.clone();
        windows.sort_unstable();
        windows.dedup();
        let span = self.ver.as_ref().map_or(0, |v| v.span);
        windows
            .into_iter()
            .map(|window| {
                let p = DecodeAttn {
                    batch: self.kv.num_slots,
                    n_heads: self.spec.n_heads,
                    scale: self.spec.attn_scale,
                    window,
                    max_seq_len: span,
                    splits: None,
                };
                self.ctx.verify_plan(&p, &self.kv, rows).2
            })
            .collect()
    }

    /// The partials (floats of outputs, of max/sum pairs) that a verification of any row
    /// count the buffers hold needs at the current span's plan.
    fn verify_partials(&self) -> (usize, usize) {
        let ns = self.kv.num_slots;
        let most = self.ver.as_ref().map_or(0, |v| v.acts.rows / ns);
        let (nh, d) = (self.spec.n_heads, self.kv.head_dim);
        (1..=most)
            .map(|r| {
                let splits = self.verify_splits(r).into_iter().max().unwrap_or(1);
                let hrows = ns * r * nh;
                (hrows * splits * d, hrows * splits * 2)
            })
            .fold((0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1)))
    }

    /// Whether `verify` without score capture replays CUDA graphs (on by default; off runs its
    /// kernels one launch at a time, for tests and to measure what the graphs save).
    pub fn set_verify_graphs(&mut self, on: bool) {
        self.verify_graphs = on;
    }

    /// How many verification shapes are captured as CUDA graphs now, and how many
    /// verifications replayed one so far.
    pub fn verify_graph_counts(&self) -> (usize, usize) {
        let captured = self.ver.as_ref().map_or(0, |v| v.graphs.len());
        (captured, self.verify_replays)
    }

    /// The argmax of every row of the last `verify`, `[slots x rows]` (synchronises).
    pub fn verify_argmax(&self) -> Result<Vec<u32>, CudaError> {
        let v = self
            .ver
            .as_ref()
            .ok_or_else(|| bad("verify_argmax before any verify".into()))?;
        self.ctx.download_prefix(&v.next, self.kv.num_slots * v.rps)
    }

    /// The logits of every row of the last `verify`, `[slots x rows, vocab]` (synchronises).
    pub fn verify_logits(&self) -> Result<Vec<f32>, CudaError> {
        let v = self
            .ver
            .as_ref()
            .ok_or_else(|| bad("verify_logits before any verify".into()))?;
        let n = self.kv.num_slots * v.rps * self.spec.vocab;
        self.ctx.download_prefix(&v.logits, n)
    }

    /// SFI: rebuilds the memory of `slots` from the scores their row 0 captured in the last
    /// `verify` (a memory at the length of that row), as a slow step does: asynchronously with
    /// a refresh lag (published `lag` decode steps later), else in order. Call before anything
    /// else runs on the decoder after that `verify` (a `rewind` to at least row 0's length is
    /// fine).
    pub fn refresh_from_verify(&mut self, slots: &[usize]) -> Result<(), CudaError> {
        let Some(v) = self.ver.as_ref() else {
            return Ok(());
        };
        let refresh: Vec<Refresh> = v
            .captured
            .iter()
            .filter(|r| slots.contains(&r.slot))
            .copied()
            .collect();
        if refresh.is_empty() {
            return Ok(());
        }
        if let Some(r) = refresh.iter().find(|r| self.slot_len[r.slot] < r.len) {
            return Err(bad(format!(
                "refresh_from_verify: slot {} was cut below its verified row 0",
                r.slot
            )));
        }
        let nh = self.spec.n_heads;
        let Some(sp) = self.sparse.as_mut() else {
            return Ok(());
        };
        let staged = self.refresh_lag > 0 && sp.can_stage(&refresh);
        match sp.refresh_decode(&self.ctx, &refresh, nh, staged)? {
            Some(done) => self.pending.push(PendingRefresh {
                slots: refresh.iter().map(|r| (r.slot, r.len)).collect(),
                done,
                due: self.step_no + self.refresh_lag,
            }),
            None => sp.finish_refresh(&refresh),
        }
        if let Some(v) = self.ver.as_mut() {
            v.captured.retain(|r| !slots.contains(&r.slot));
        }
        Ok(())
    }

    /// SFI with `SLOWFAST_SFI_PROFILE=1`: milliseconds per Selector stage
    /// (`ops::sfi::SFI_STAGES`) summed over the refreshes so far.
    pub fn sfi_profile(&self) -> Option<[f64; 7]> {
        self.sparse.as_ref().and_then(|s| s.profile())
    }

    /// Slot `slot`'s live compact memory (SFI's or SnapKV's rows, lengths, the starts of the
    /// ranges read in place, of every global layer); None for a policy without one. Downloads
    /// and synchronises: for tests.
    pub fn compact_memory(
        &self,
        slot: usize,
    ) -> Result<Option<crate::sparse::CompactMemory>, CudaError> {
        self.check_slot(slot)?;
        match self.sparse.as_ref().filter(|s| s.has_compact()) {
            Some(s) => s.memory(&self.ctx, slot).map(Some),
            None => Ok(None),
        }
    }

    /// H2O: slot `slot`'s heavy hitters on every global layer, `[global layer][kv head]`
    /// positions ascending (`SparseState::h2o_heavy`); the window from `compact_memory`'s
    /// `rstart` up is the rest of what a step reads. Downloads and synchronises: for tests.
    pub fn h2o_heavy(&self, slot: usize) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        self.check_slot(slot)?;
        match self.sparse.as_ref() {
            Some(s) => s.h2o_heavy(&self.ctx, slot),
            None => Err(bad("h2o_heavy: the policy is full KV".into())),
        }
    }

    /// The oracle: slot `slot`'s picks of its last selection on every global layer, `[global
    /// layer][kv head]` positions ascending (`SparseState::oracle_picks`). Downloads and
    /// synchronises: for tests.
    pub fn oracle_picks(&self, slot: usize) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        self.check_slot(slot)?;
        match self.sparse.as_ref() {
            Some(s) => s.oracle_picks(&self.ctx, slot),
            None => Err(bad("oracle_picks: the policy is full KV".into())),
        }
    }

    /// SFI: the dense scores of slot `slot`'s last slow step on every global layer, `[global
    /// layer][query head][key]` over the slot's keys then (`SparseState::captured_scores`).
    /// Call right after the `decode_step` that refreshed it (`last_refreshed`); downloads and
    /// synchronises.
    pub fn captured_scores(&self, slot: usize) -> Result<Vec<f32>, CudaError> {
        self.check_slot(slot)?;
        if !self.last_refresh.contains(&slot) {
            return Err(bad(format!(
                "slot {slot} did not capture scores in the last decode step"
            )));
        }
        match self.sparse.as_ref().filter(|s| s.sfi().is_some()) {
            Some(s) => s.captured_scores(&self.ctx, slot, self.spec.n_heads, self.slot_len[slot]),
            None => Err(bad("only SFI's slow steps capture scores".to_string())),
        }
    }

    /// Bytes of the policy's compact buffers.
    pub fn compact_bytes(&self) -> usize {
        self.sparse.as_ref().map_or(0, |s| s.compact_bytes())
    }

    fn check_slot(&self, slot: usize) -> Result<(), CudaError> {
        if slot >= self.kv.num_slots {
            return Err(bad(format!("slot {slot} of {}", self.kv.num_slots)));
        }
        Ok(())
    }

    /// Copies the cached sequence of slot `from` into slot `to` (every layer's K and V).
    pub fn copy_slot(&mut self, from: usize, to: usize) -> Result<(), CudaError> {
        self.check_slot(from)?;
        self.check_slot(to)?;
        if from == to {
            return Ok(());
        }
        self.check_floor(from, "copy_slot")?;
        self.check_floor(to, "copy_slot")?;
        self.flush_refreshes()?;
        // Each head's run up to the length (with pages, the rest of `to` may not be mapped).
        let len = self.slot_len[from];
        self.ensure_kv(to, len, false)?;
        let stream = self.ctx.stream().cu_stream();
        for (k, v) in &self.caches {
            for c in [k, v] {
                for h in 0..self.kv.kv_heads {
                    let at = |slot| self.kv_run(c, slot, h);
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            at(to),
                            at(from),
                            len * self.kv.row_bytes(),
                            stream,
                        )
                    }
                    .map_err(crate::context::drv("cuMemcpyDtoDAsync (KV slot)"))?;
                }
            }
        }
        self.slot_len[to] = self.slot_len[from];
        if let Some(sp) = self.sparse.as_mut() {
            sp.copy_slot(&self.ctx, from, to)?;
        }
        Ok(())
    }

    /// Fills the empty `slot` with `tokens.len()` positions for timing long contexts: the
    /// first `min(chunk, len)` tokens are prefilled for real and their keys and values copied
    /// over the rest of the positions (doubling copies per layer and head). Decode cost does
    /// not depend on the values; the copies' rotary phases belong to their source positions.
    pub fn fill_synthetic(&mut self, slot: usize, tokens: &[u32]) -> Result<(), CudaError> {
        self.check_slot(slot)?;
        if self.slot_len[slot] != 0 || tokens.is_empty() {
            return Err(bad(format!(
                "fill_synthetic: slot {slot} must be empty and the fill not empty"
            )));
        }
        let len = tokens.len();
        let seed = len.min(self.chunk);
        self.prefill(slot, &tokens[..seed], false)?;
        if len == seed {
            return Ok(());
        }
        if len > self.kv.capacity {
            return Err(bad(format!(
                "fill_synthetic: {len} tokens exceed the KV capacity {}",
                self.kv.capacity
            )));
        }
        self.ensure_kv(slot, len, false)?;
        let (d, stream) = (self.kv.row_bytes(), self.ctx.stream().cu_stream());
        for (k, v) in &self.caches {
            for c in [k, v] {
                for h in 0..self.kv.kv_heads {
                    let run = self.kv_run(c, slot, h);
                    let mut have = seed;
                    while have < len {
                        let n = have.min(len - have);
                        unsafe {
                            cudarc::driver::result::memcpy_dtod_async(
                                run + (have * d) as u64,
                                run,
                                n * d,
                                stream,
                            )
                        }
                        .map_err(crate::context::drv("cuMemcpyDtoDAsync (KV fill)"))?;
                        have += n;
                    }
                }
            }
        }
        self.slot_len[slot] = len;
        if let Some(sp) = self.sparse.as_mut() {
            sp.reset_slot(&self.ctx, slot)?;
        }
        Ok(())
    }

    /// The chunks `[a, b)` in which `prefill` runs `total` tokens: `chunk` tokens each, the
    /// last one holding at least SFI's bootstrap rows (taken from the chunk before when needed:
    /// the bootstrap captures the last rows of the last chunk).
    pub fn prefill_bounds(&self, total: usize) -> Vec<(usize, usize)> {
        let boot = self.sparse.as_ref().map_or(0, |s| s.bootstrap_rows());
        let mut bounds: Vec<(usize, usize)> = (0..total)
            .step_by(self.chunk)
            .map(|a| (a, (a + self.chunk).min(total)))
            .collect();
        if let [.., prev, last] = bounds.as_mut_slice() {
            let short = boot
                .saturating_sub(last.1 - last.0)
                .min(prev.1 - prev.0 - 1);
            prev.1 -= short;
            last.0 -= short;
        }
        bounds
    }

    /// Appends `tokens` to the sequence in `slot` (chunked). The last row's logits go to row
    /// `slot` of the logits; with `all_logits` every row's logits are returned `[n, vocab]`
    /// (for tests; allocates and synchronises).
    pub fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Option<Vec<f32>>, CudaError> {
        self.prefill_into(slot, tokens, all_logits, false)
    }

    /// `prefill`; `dummy`: a free slot's dummy tokens, which stay on the scratch page of a
    /// paged slot that holds no pages.
    fn prefill_into(
        &mut self,
        slot: usize,
        tokens: &[u32],
        all_logits: bool,
        dummy: bool,
    ) -> Result<Option<Vec<f32>>, CudaError> {
        self.check_slot(slot)?;
        let v = self.spec.vocab;
        if tokens.is_empty() {
            return Err(bad("prefill of no tokens".into()));
        }
        self.flush_refreshes()?; // the bootstrap uses the Selector's scratch on this stream
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(bad(format!("token id {t} outside the vocabulary of {v}")));
        }
        self.check_floor(slot, "prefill")?;
        // a prompt being prefilled is not whole: the caller says when it is again
        self.give_back[slot] = false;
        let start = self.slot_len[slot];
        if start < self.shared_tokens(slot) {
            return Err(bad(format!(
                "slot {slot}: prefill at {start} would write the shared prefix of {} tokens",
                self.shared_tokens(slot)
            )));
        }
        if start + tokens.len() > self.kv.capacity {
            return Err(bad(format!(
                "{} + {} tokens exceed the KV capacity {}",
                start,
                tokens.len(),
                self.kv.capacity
            )));
        }
        self.ensure_kv(slot, start + tokens.len(), dummy)?;
        let mut all = all_logits.then(Vec::new);
        let mut scratch: Option<GpuBuffer<f32>> = None;
        let total = tokens.len();
        let boot = self.sparse.as_ref().map_or(0, |s| s.bootstrap_rows());
        let bounds = self.prefill_bounds(total);
        let dense_below = self
            .sparse
            .as_ref()
            .map_or(usize::MAX, |s| s.policy.dense_below());
        for &(a, b) in &bounds {
            let c = &tokens[a..b];
            let pos0 = start + a;
            let n = c.len();
            let refresh: Vec<Refresh> = if boot > 0 && b == total && start + total > dense_below {
                vec![Refresh::bootstrap(slot, start + total, boot, n)]
            } else {
                Vec::new()
            };
            let pos: Vec<u32> = (pos0..pos0 + n).map(|p| p as u32).collect();
            self.ctx.upload_into(c, &mut self.pre.ids)?;
            self.ctx.upload_into(&pos, &mut self.pre.pos)?;
            self.ctx
                .upload_into(&vec![slot as u32; n], &mut self.pre.slots)?;
            self.forward(n, Attn::Prefill { slot, pos0 }, &refresh)?;
            if let Some(sp) = self.sparse.as_mut() {
                sp.finish_refresh(&refresh);
            }
            let h = self.spec.hidden;
            let head = self.lm_head.as_ref().unwrap_or(&self.embed).device_ptr();
            if let Some(all) = all.as_mut() {
                let buf = match scratch.take() {
                    Some(b) => b,
                    None => self.ctx.alloc::<f32>(self.chunk * v)?,
                };
                self.ctx.linear_raw(
                    self.pre.xb.device_ptr(),
                    head,
                    buf.device_ptr(),
                    cudaDataType::CUDA_R_32F,
                    n,
                    h,
                    v,
                )?;
                let got = self.ctx.download(&buf)?;
                all.extend_from_slice(&got[..n * v]);
                scratch = Some(buf);
            }
            if pos0 + n == start + tokens.len() {
                self.ctx.linear_raw(
                    self.pre.xb.device_ptr() + ((n - 1) * h * 2) as u64,
                    head,
                    self.logits.device_ptr() + (slot * v * 4) as u64,
                    cudaDataType::CUDA_R_32F,
                    1,
                    h,
                    v,
                )?;
            }
        }
        self.slot_len[slot] = start + tokens.len();
        // (a free slot's dummy tokens get no memory: they are never read for anything kept)
        if let Some(sp) = self.sparse.as_mut().filter(|_| !dummy) {
            sp.prefilled(&self.ctx, slot, start + tokens.len())?;
        }
        Ok(all)
    }

    /// FastKV's prefill (the CPU's `slowfast_model::Model::prefill_fastkv`) of a whole prompt
    /// into the empty `slot`, under FastKV's retention (a SnapKV policy whose window is
    /// `tsp.window`): every token runs through layers `0..=tsp.layer`; there the last
    /// `tsp.window` rows' attention, max-pooled and summed over the heads, picks the top
    /// `tsp.len - window` earlier tokens, which with the window are the only rows the later
    /// layers process, at their own positions. Those layers store them compact (row i the
    /// i-th kept token); every global layer then keeps its SnapKV capacity (the later ones
    /// from the kept rows) and the window moves to its own rows, so decoding reads them as it
    /// reads SnapKV's. The last row's logits go to row `slot`; returns the kept positions,
    /// ascending. With `tsp.len >= tokens.len()` this is `prefill`.
    ///
    /// The layers after `tsp.layer` must be global: a sliding window would read the rows the
    /// propagation left empty.
    pub fn prefill_fastkv(
        &mut self,
        slot: usize,
        tokens: &[u32],
        tsp: &TspArgs,
    ) -> Result<Vec<u32>, CudaError> {
        self.check_slot(slot)?;
        let (n, l_count) = (tokens.len(), self.layers.len());
        let globals = || {
            (0..l_count)
                .filter(|&l| self.spec.windows[l].is_none())
                .collect::<Vec<_>>()
        };
        if n == 0 || self.slot_len[slot] != 0 {
            return Err(bad(format!(
                "FastKV prefill needs a non-empty prompt and an empty slot (slot {slot} holds {}, prompt {n})",
                self.slot_len[slot]
            )));
        }
        let snap = self.sparse.as_ref().and_then(|s| s.snap());
        if !snap.is_some_and(|c| c.pyramid_beta.is_none() && c.window == tsp.window) {
            return Err(bad(format!(
                "FastKV prefill needs its retention, SnapKV with window {} (the policy is {})",
                tsp.window,
                self.sparse
                    .as_ref()
                    .map_or("full KV".into(), |s| s.policy.describe())
            )));
        }
        if tsp.layer >= l_count || self.spec.windows[tsp.layer].is_some() {
            return Err(bad(format!(
                "--fastkv-tsp-layer {} must be a global-attention layer of this {l_count}-layer model (global layers: {:?})",
                tsp.layer,
                globals()
            )));
        }
        if let Some(l) = (tsp.layer + 1..l_count).find(|&l| self.spec.windows[l].is_some()) {
            return Err(bad(format!(
                "FastKV on the GPU: layer {l}, after the TSP layer {}, has a sliding window, which would read the rows the propagation leaves empty; take a TSP layer past every sliding layer (global layers: {:?}) or --device cpu",
                tsp.layer,
                globals()
            )));
        }
        if tsp.window == 0 || tsp.kernel % 2 == 0 || tsp.len < tsp.window.min(n) {
            return Err(bad(format!(
                "FastKV: {tsp:?} (window >= 1, an odd kernel, len >= window)"
            )));
        }
        if tsp.len >= n {
            self.prefill(slot, tokens, false)?;
            return Ok((0..n as u32).collect());
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab) {
            return Err(bad(format!(
                "token id {t} outside the vocabulary of {}",
                self.spec.vocab
            )));
        }
        if n > self.kv.capacity {
            return Err(bad(format!(
                "{n} tokens exceed the KV capacity {}",
                self.kv.capacity
            )));
        }
        self.flush_refreshes()?;
        self.check_floor(slot, "prefill")?;
        self.give_back[slot] = false;
        self.ensure_kv(slot, n, false)?;
        let (h, v, nh) = (self.spec.hidden, self.spec.vocab, self.spec.n_heads);
        let w = tsp.window.min(n);
        // Phase 1: every token through layers 0..=T, the residual stream kept; the last chunk
        // captures its window's scores (SnapKV's selection in these layers, and the TSP's).
        let hidden = self.ctx.alloc::<bf16>(n * h)?;
        let bounds = self.prefill_bounds(n);
        for &(a, b) in &bounds {
            let m = b - a;
            let refresh = if b == n {
                vec![Refresh::bootstrap(slot, n, w, m)]
            } else {
                Vec::new()
            };
            let pos: Vec<u32> = (a as u32..b as u32).collect();
            self.ctx.upload_into(&tokens[a..b], &mut self.pre.ids)?;
            self.ctx.upload_into(&pos, &mut self.pre.pos)?;
            self.ctx
                .upload_into(&vec![slot as u32; m], &mut self.pre.slots)?;
            let mode = Attn::Prefill { slot, pos0: a };
            self.forward_layers(m, mode, &refresh, 0..tsp.layer + 1, 0)?;
            let dst = hidden.device_ptr() + (a * h * 2) as u64;
            let src = self.pre.x.device_ptr();
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst,
                    src,
                    m * h * 2,
                    self.ctx.stream().cu_stream(),
                )
            }
            .map_err(crate::context::drv("cuMemcpyDtoDAsync (FastKV hidden)"))?;
        }
        let sp = self.sparse.as_ref().expect("checked above");
        let mut keep = if tsp.len > w {
            sp.tsp_picks(&self.ctx, n, w, tsp.len - w, tsp.kernel, nh)?
        } else {
            Vec::new()
        };
        keep.extend((n - w) as u32..n as u32);
        // Phase 2: the kept rows through the remaining layers, compact, at their positions;
        // chunks as a prefill's, the last holding at least the window (the policy's bootstrap
        // rows are the window: checked above).
        let k = keep.len();
        let chunks = self.prefill_bounds(k);
        let mut rope = self.ctx.alloc::<u32>(self.chunk)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed).device_ptr();
        let refreshed = Refresh {
            slot,
            len: n,
            rows: w,
            boot_row0: None,
        };
        let mut res = Ok(());
        if let Some(sp) = self.sparse.as_mut() {
            sp.tsp_prompt = Some(n);
        }
        for &(a, b) in &chunks {
            let m = b - a;
            let refresh = if b == k {
                vec![Refresh::bootstrap(slot, k, w, m)]
            } else {
                Vec::new()
            };
            let rows: Vec<u32> = (a as u32..b as u32).collect();
            let step = (|| {
                self.ctx.upload_into(&keep[a..b], &mut self.pre.ids)?;
                self.ctx.upload_into(&keep[a..b], &mut rope)?;
                self.ctx.upload_into(&rows, &mut self.pre.pos)?;
                self.ctx
                    .upload_into(&vec![slot as u32; m], &mut self.pre.slots)?;
                self.ctx
                    .embed(&hidden, &self.pre.ids, &mut self.pre.x, m, h, n, 1.0)?;
                let mode = Attn::Prefill { slot, pos0: a };
                self.forward_layers(m, mode, &refresh, tsp.layer + 1..l_count, rope.device_ptr())
            })();
            if step.is_err() {
                res = step;
                break;
            }
        }
        if let Some(sp) = self.sparse.as_mut() {
            sp.tsp_prompt = None;
        }
        res?;
        let m = chunks.last().map_or(0, |&(a, b)| b - a);
        self.ctx.linear_raw(
            self.pre.xb.device_ptr() + ((m - 1) * h * 2) as u64,
            head,
            self.logits.device_ptr() + (slot * v * 4) as u64,
            cudaDataType::CUDA_R_32F,
            1,
            h,
            v,
        )?;
        self.slot_len[slot] = n;
        if let Some(sp) = self.sparse.as_mut() {
            sp.finish_refresh(std::slice::from_ref(&refreshed));
            sp.prefilled(&self.ctx, slot, n)?;
        }
        self.ctx.synchronize()?; // `hidden` and `rope` are freed on return
        Ok(keep)
    }

    /// Sets the next input token of every slot from the argmax of its logits row.
    pub fn argmax_next(&mut self) -> Result<(), CudaError> {
        let (b, v) = (self.kv.num_slots, self.spec.vocab);
        self.ctx.argmax(&self.logits, &mut self.next, b, v)
    }

    /// Sets the next input token of every slot (`tokens.len() == num_slots`).
    pub fn set_next(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        if tokens.len() != self.kv.num_slots {
            return Err(bad(format!(
                "{} next tokens for {} slots",
                tokens.len(),
                self.kv.num_slots
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab) {
            return Err(bad(format!("token id {t} outside the vocabulary")));
        }
        self.ctx.upload_into(tokens, &mut self.next)
    }

    /// The next input token of every slot (synchronises).
    pub fn next_tokens(&self) -> Result<Vec<u32>, CudaError> {
        self.ctx.download(&self.next)
    }

    /// Logits `[num_slots, vocab]` of the last prefill / decode step (synchronises).
    pub fn logits(&self) -> Result<Vec<f32>, CudaError> {
        self.ctx.download(&self.logits)
    }

    /// Prepares decode steps for every slot from the host's view of the slot lengths (call
    /// after prefill or after `set_next` / slot changes; no per-step host work after it).
    pub fn begin_decode(&mut self) -> Result<(), CudaError> {
        if let Some(s) = self.slot_len.iter().position(|&l| l == 0) {
            return Err(bad(format!(
                "slot {s} is empty: prefill it before decoding"
            )));
        }
        self.flush_refreshes()?;
        let pos: Vec<u32> = self.slot_len.iter().map(|&l| l as u32).collect();
        let lens: Vec<u32> = pos.iter().map(|p| p + 1).collect();
        self.decode_span = self.slot_len.iter().max().copied().unwrap_or(0) + 1;
        self.graph = None;
        self.ctx.upload_into(&pos, &mut self.dec.pos)?;
        self.ctx.upload_into(&lens, &mut self.dec_lens)
    }

    /// One decode step of every slot: feeds each slot's next token, writes the logits and
    /// sets the next tokens to their argmax. Queues kernels only (`begin_decode` first); runs
    /// the captured graph when `capture_decode` made one.
    pub fn decode_step(&mut self) -> Result<(), CudaError> {
        if let Some(s) = self.slot_len.iter().position(|&l| l >= self.kv.capacity) {
            return Err(bad(format!(
                "slot {s} is full ({} tokens)",
                self.kv.capacity
            )));
        }
        for s in 0..self.kv.num_slots {
            self.ensure_kv(s, self.slot_len[s] + 1, true)?;
            if self.give_back[s] {
                self.drop_unread(s)?; // a page its sliding windows left (rarely: synchronises)
            }
        }
        // SFI: slots that asked for a refresh, or long enough for a memory but without one
        // (the bridge after a short prompt), run a slow step: dense + capture + refresh; past
        // the score rows a step holds (`CAPTURE_ROWS`, `SparseState::split_capture`), the
        // others wait for the next step. The oracle: slots due a selection capture (every slot
        // fits in one step).
        let (mut refresh, mut deferred) = (Vec::new(), Vec::new());
        if let Some(sp) = self
            .sparse
            .as_ref()
            .filter(|s| s.policy.captures_in_decode())
        {
            let wanting = (0..self.kv.num_slots)
                .filter(|&s| sp.wants_capture(s, self.slot_len[s] + 1, self.want_refresh[s]))
                .collect();
            let now;
            (now, deferred) = sp.split_capture(wanting);
            refresh = now
                .into_iter()
                .map(|s| Refresh {
                    slot: s,
                    len: self.slot_len[s] + 1,
                    rows: 1,
                    boot_row0: None,
                })
                .collect();
        }
        self.want_refresh.iter_mut().for_each(|w| *w = false);
        for s in deferred {
            self.want_refresh[s] = true;
        }
        self.last_refresh = refresh.iter().map(|r| r.slot).collect();
        self.step_no += 1;
        // Due asynchronous refreshes are published before this step reads the memory; all of
        // them when this step captures scores (the rows a pending Selector still reads are
        // numbered afresh: `SparseState::set_capture`) or refreshes in order (the Selector's
        // scratch is then used on this stream).
        let staged = self.refresh_lag > 0
            && self
                .sparse
                .as_ref()
                .is_some_and(|sp| sp.can_stage(&refresh));
        let again = !refresh.is_empty() && !self.pending.is_empty();
        self.publish_pending(again || (!refresh.is_empty() && !staged))?;
        if refresh.is_empty() {
            match &self.graph {
                Some(g) => g.launch().map_err(crate::context::drv("cuGraphLaunch"))?,
                None => {
                    self.queue_step(&[], false)?;
                }
            }
            self.fast_steps += self.sparse.is_some() as usize;
        } else {
            let mut flags = vec![false; self.kv.num_slots];
            refresh.iter().for_each(|r| flags[r.slot] = true);
            if let Some(sp) = self.sparse.as_mut() {
                sp.set_capture(&self.ctx, &flags)?;
                let lens: Vec<usize> = self.slot_len.iter().map(|l| l + 1).collect();
                sp.plan_views(&self.ctx, &lens)?;
            }
            match self.queue_step(&refresh, staged)? {
                Some(done) => self.pending.push(PendingRefresh {
                    slots: refresh.iter().map(|r| (r.slot, r.len)).collect(),
                    done,
                    due: self.step_no + self.refresh_lag,
                }),
                None => {
                    if let Some(sp) = self.sparse.as_mut() {
                        sp.finish_refresh(&refresh);
                    }
                }
            }
            match self.sparse.as_ref() {
                Some(sp) if sp.policy.selects_within_step() => self.fast_steps += 1,
                _ => self.slow_steps += 1,
            }
        }
        if self.sparse.is_none() {
            self.slow_steps += 1;
        }
        for l in self.slot_len.iter_mut() {
            *l += 1;
        }
        Ok(())
    }

    /// Captures one decode step as a CUDA graph; later `decode_step`s replay it (one launch
    /// instead of ~15 per layer). Call after `begin_decode` and one plain `decode_step` (which
    /// sizes the attention workspace); `begin_decode` drops the graph.
    pub fn capture_decode(&mut self) -> Result<(), CudaError> {
        self.graph = None;
        let ctx = self.ctx.clone();
        let g = ctx.capture_graph(|| self.queue_step(&[], false).map(|_| ()))?;
        self.graph = Some(g);
        Ok(())
    }

    /// Whether decode steps replay a captured graph.
    pub fn has_graph(&self) -> bool {
        self.graph.is_some()
    }

    /// Queues one decode step; the fused step (1-2 rows) launches its kernels with PDL where
    /// the device allows it. At 3+ rows (cuBLAS GEMMs) the step's own PDL kernels get it when
    /// the model runs sparse attention, not in dense steps (`CudaContext::pdl_wide`: batch 6
    /// at 128K, SFI +1.2 %, full KV -2.6 %, runs 60-61).
    /// `refresh`: the slots whose memory this step rebuilds, on the side stream with `staged`
    /// (then the event that ends that work comes back).
    fn queue_step(
        &mut self,
        refresh: &[Refresh],
        staged: bool,
    ) -> Result<Option<cudarc::driver::CudaEvent>, CudaError> {
        let mode = if self.ctx.decode_pdl_rows(self.kv.num_slots) {
            PdlMode::All
        } else {
            self.ctx.pdl_wide(self.sparse.is_some())
        };
        self.ctx.set_pdl_mode(mode);
        let r = self.queue_step_kernels(refresh, staged);
        self.ctx.set_pdl_mode(PdlMode::Off);
        r
    }

    fn queue_step_kernels(
        &mut self,
        refresh: &[Refresh],
        staged: bool,
    ) -> Result<Option<cudarc::driver::CudaEvent>, CudaError> {
        let b = self.kv.num_slots;
        let (h, v) = (self.spec.hidden, self.spec.vocab);
        self.forward(b, Attn::Decode, refresh)?;
        let mut done = None;
        if let Some(sp) = self.sparse.as_mut().filter(|_| !refresh.is_empty()) {
            // The Selector for every global layer of each refreshed slot at once.
            done = sp.refresh_decode(&self.ctx, refresh, self.spec.n_heads, staged)?;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed).device_ptr();
        self.ctx.linear_raw(
            self.dec.xb.device_ptr(),
            head,
            self.logits.device_ptr(),
            cudaDataType::CUDA_R_32F,
            b,
            h,
            v,
        )?;
        self.ctx.argmax(&self.logits, &mut self.next, b, v)?;
        self.ctx
            .advance_positions(&mut self.dec.pos, &mut self.dec_lens, b)?;
        Ok(done)
    }

    /// The layers over `n` rows of `pre` (prefill) or `dec` (decode); leaves the final-normed
    /// rows in `xb`.
    fn forward(&mut self, n: usize, mode: Attn, refresh: &[Refresh]) -> Result<(), CudaError> {
        let all = 0..self.layers.len();
        self.forward_layers(n, mode, refresh, all, 0)
    }

    /// `forward` through `range` of the layers only: from the embedding when it starts at 0,
    /// else from the residual stream already in the activations' `x` (FastKV's propagated
    /// rows). `rope_pos`: device address of the rows' RoPE positions when they differ from the
    /// cache rows in `pos` (0: the same; see [`QkvPost::rope_pos`]).
    fn forward_layers(
        &mut self,
        n: usize,
        mode: Attn,
        refresh: &[Refresh],
        range: std::ops::Range<usize>,
        rope_pos: u64,
    ) -> Result<(), CudaError> {
        let GpuDecoder {
            ctx,
            spec: s,
            hdk,
            head_norm,
            layers,
            caches,
            embed,
            final_norm,
            freq_global,
            freq_local,
            kv,
            pre,
            dec,
            dec_lens,
            next,
            ws,
            decode_span,
            sparse,
            ver,
            calib,
            ..
        } = self;
        let (ctx, hdk, kv) = (&**ctx, *hdk, *kv);
        let (h, nh, nkv, inter) = (s.hidden, s.n_heads, s.n_kv_heads, s.intermediate);
        let (a, ws, vlens, span) = match mode {
            Attn::Prefill { .. } => (pre, ws, None, *decode_span),
            Attn::Decode => (dec, ws, None, *decode_span),
            Attn::Verify { .. } => {
                let v = ver
                    .as_mut()
                    .ok_or_else(|| bad("verify forward without its buffers".into()))?;
                (&mut v.acts, &mut v.ws, Some(&v.lens), v.span)
            }
        };
        debug_assert!(n <= a.rows);
        let norm = RmsNorm {
            eps: s.eps,
            gemma: false,
        };
        let ids = match mode {
            Attn::Prefill { .. } | Attn::Verify { .. } => &a.ids,
            Attn::Decode => &*next,
        };
        // Decode at 1-2 rows runs the fused kernels (ops/fused.rs): one GEMV for
        // q/k/v, one kernel for q/k norm + RoPE + KV append, the GLU inside the down GEMV; without
        // Gemma's post-norms the residual adds and the input norms move into the GEMVs too.
        let fused = matches!(mode, Attn::Decode) && ctx.decode_fused_rows(n);
        let res_in_gemv = fused && !s.post_norms;
        let first = range.start;
        if first == 0 {
            ctx.embed(embed, ids, &mut a.x, n, h, s.vocab, s.embed_scale)?;
        }
        if !res_in_gemv {
            ctx.rmsnorm(&a.x, &layers[first].attn_norm, &mut a.xb, n, h, norm)?;
        }
        let span_layers = layers.iter().zip(caches.iter_mut()).enumerate();
        for (l, (w, (kc, vc))) in span_layers.skip(first).take(range.len()) {
            let window = s.windows[l];
            let freqs = if window.is_some() {
                &*freq_local
            } else {
                &*freq_global
            };
            let (qd, kd) = (nh * hdk, nkv * hdk);
            // q, k and v in one projection, then q/k norms, RoPE and the KV append in one kernel.
            if res_in_gemv {
                let input = GemvInput::Norm {
                    w: &w.attn_norm,
                    eps: s.eps,
                };
                let y = GemvOutput::Bf16(&mut a.qkv);
                ctx.gemv_fused(&a.x, input, &w.wqkv, y, n, h, qd + 2 * kd)?;
            } else {
                ctx.linear(&a.xb, &w.wqkv, &mut a.qkv, n, h, qd + 2 * kd)?;
            }
            if let Some(b) = &w.bqkv {
                ctx.add_bias(&mut a.qkv, b, n)?;
            }
            let p = QkvPost {
                n_tokens: n,
                q_heads: nh,
                q_norm: w.q_norm.as_ref(),
                k_norm: w.k_norm.as_ref(),
                eps: head_norm.eps,
                rot_dim: s.head_dim,
                inv_freq: freqs,
                amax: calib
                    .as_ref()
                    .map_or(0, |c| c.device_ptr() + (l * 2 * nkv * 4) as u64),
                rope_pos,
            };
            let sp = sparse.as_mut().filter(|sp| sp.covers(l));
            let dp = DecodeAttn {
                batch: n,
                n_heads: nh,
                scale: s.attn_scale,
                window,
                max_seq_len: span,
                splits: None,
            };
            // The fused dense step may run qkv_post inside flash-decoding (set_attn_post, tests).
            let post_in_attn = matches!(mode, Attn::Decode)
                && fused
                && sp.is_none()
                && ctx.attn_post()
                && ctx.decode_post_kernel(&dp, &kv).is_some();
            // Sparse decode steps may run it inside sparse flash-decoding (SLOWFAST_SPARSE_POST).
            let sparse_post = if matches!(mode, Attn::Decode)
                && sp
                    .as_ref()
                    .is_some_and(|s| s.policy.post_in_attention() && !s.reads_views())
                && ctx.sparse_post_in(fused)
            {
                let [q_norm, k_norm, inv_freq] = p.check("sparse decode", kv.head_dim)?;
                Some(SparsePost {
                    qkv: a.qkv.device_ptr(),
                    qkv_stride: qd + 2 * kd,
                    q_norm,
                    k_norm,
                    eps: p.eps,
                    positions: a.pos.device_ptr(),
                    rot_dim: p.rot_dim,
                    inv_freq,
                })
            } else {
                None
            };
            if post_in_attn {
                ctx.attn_decode_post(
                    &a.qkv, kc, vc, kv, dec_lens, &a.slots, &a.pos, &mut a.att, None, ws, &dp, &p,
                )?;
            } else if sparse_post.is_none() {
                ctx.qkv_post(&a.qkv, &mut a.q, kc, vc, &a.pos, &a.slots, kv, &p)?;
            }
            match (mode, sp) {
                (Attn::Verify { rps }, sp) => {
                    // Dense over every layer; SFI's global layers leave row 0's scores.
                    let capture = match sp {
                        Some(sp) if !refresh.is_empty() => sp.verify_capture(l, nh),
                        _ => None,
                    };
                    let lens = vlens.ok_or_else(|| bad("verify without lengths".into()))?;
                    let p = DecodeAttn {
                        batch: n / rps,
                        ..dp
                    };
                    ctx.attn_verify(
                        &a.q, kc, vc, kv, lens, &a.slots, &mut a.att, ws, &p, rps, capture,
                    )?;
                }
                (Attn::Decode, None) if post_in_attn => {}
                (Attn::Prefill { slot, pos0 }, sp) => {
                    let p = PrefillAttn {
                        n_tokens: n,
                        n_heads: nh,
                        slot,
                        pos0,
                        scale: s.attn_scale,
                        window,
                    };
                    ctx.attn_prefill(&a.q, kc, vc, kv, &mut a.att, None, &p)?;
                    if let Some(sp) = sp {
                        let q = a.q.device_ptr();
                        let rows = (slot, pos0, n);
                        sp.h2o_prefill_layer(ctx, l, kc, vc, q, rows, nh, s.attn_scale)?;
                        for r in refresh {
                            let q = a.q.device_ptr();
                            sp.bootstrap_layer(ctx, l, kc, vc, ws, q, r, pos0, nh, s.attn_scale)?;
                        }
                    }
                }
                (Attn::Decode, Some(sp)) => {
                    let io = (
                        a.q.device_ptr(),
                        a.att.device_ptr(),
                        dec_lens.device_ptr(),
                        a.slots.device_ptr(),
                    );
                    let scale = s.attn_scale;
                    sp.decode_layer(ctx, l, kc, vc, ws, io, n, nh, scale, refresh, sparse_post)?;
                }
                (Attn::Decode, None) => {
                    ctx.attn_decode(
                        &a.q, kc, vc, kv, dec_lens, &a.slots, &mut a.att, None, ws, &dp,
                    )?;
                }
            }
            if res_in_gemv {
                // x += o; x += down(glu(gate_up(ffn_norm(x)))); the next norm is in the next GEMV.
                let o = GemvOutput::Residual(&mut a.x);
                ctx.gemv_fused(&a.att, GemvInput::Plain, &w.wo, o, n, qd, h)?;
                let input = GemvInput::Norm {
                    w: &w.ffn_norm,
                    eps: s.eps,
                };
                let glu = GemvOutput::Glu(&mut a.act, s.glu);
                ctx.gemv_fused(&a.x, input, &w.w_gate_up, glu, n, h, 2 * inter)?;
                let o = GemvOutput::Residual(&mut a.x);
                ctx.gemv_fused(&a.act, GemvInput::Plain, &w.w_down, o, n, inter, h)?;
                continue;
            }
            ctx.linear(&a.att, &w.wo, &mut a.o, n, qd, h)?;
            // x += post_attn(o); xb = ffn_norm(x)
            ctx.add_rmsnorm(
                &a.o,
                &mut a.x,
                w.post_attn.as_ref(),
                &w.ffn_norm,
                &mut a.xb,
                n,
                h,
                norm,
            )?;
            if fused {
                let glu = GemvOutput::Glu(&mut a.act, s.glu);
                ctx.gemv_fused(&a.xb, GemvInput::Plain, &w.w_gate_up, glu, n, h, 2 * inter)?;
                let o = GemvOutput::Bf16(&mut a.o);
                ctx.gemv_fused(&a.act, GemvInput::Plain, &w.w_down, o, n, inter, h)?;
            } else {
                ctx.linear(&a.xb, &w.w_gate_up, &mut a.gu, n, h, 2 * inter)?;
                ctx.glu(s.glu, &a.gu, &mut a.act, n, inter)?;
                ctx.linear(&a.act, &w.w_down, &mut a.o, n, inter, h)?;
            }
            // x += post_ffw(o); xb = next layer's input norm (the final norm after the last)
            let next_norm = layers.get(l + 1).map_or(&*final_norm, |nl| &nl.attn_norm);
            ctx.add_rmsnorm(
                &a.o,
                &mut a.x,
                w.post_ffw.as_ref(),
                next_norm,
                &mut a.xb,
                n,
                h,
                norm,
            )?;
        }
        if res_in_gemv {
            // The residual stream was never normed inside the loop: the final norm.
            ctx.rmsnorm(&a.x, final_norm, &mut a.xb, n, h, norm)?;
        }
        Ok(())
    }
}
