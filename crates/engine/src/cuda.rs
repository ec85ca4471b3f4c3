//! `--device cuda`: the CPU model's weights dequantized to bf16 and uploaded to one GPU
//! (`slowfast_cuda::GpuDecoder`), a one-sequence session for the generate loop, and the GPU
//! benchmark (decode tok/s and GB/s against a device copy measured in the same run, prefill
//! tok/s and TFLOP/s against a cuBLAS GEMM measured in the same run).
use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;
use slowfast_cuda::ops::elementwise::Glu;
use slowfast_cuda::{
    CudaContext, DecoderSpec, GpuDecoder, GpuKvPolicy, GpuQuestConfig, GpuSfiConfig, GpuSnapConfig,
    KvOptions, Norm, Tensor, TspArgs, WeightSource,
};
use slowfast_kv::sfi::trigger::{riders, Trigger, TriggerConfig, TriggerKind};
use slowfast_kv::PolicyStats;
use slowfast_model::decoder::rope_inv_freq;
use slowfast_model::{Activation, Model, Weight};
use slowfast_quant::GgmlType;

use crate::device::Steps;
use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec};
use crate::EngineError;

/// Prompt tokens per prefill pass on the GPU (GEMMs run near their peak from a few thousand
/// rows; activations stay below a few GiB).
pub const GPU_CHUNK: usize = 8192;

/// Decode steps a trace takes: one to warm, one recorded (graph-replayed, a fast step for
/// sparse policies), when `SLOWFAST_TRACE` compiled tracing in.
const TRACE_STEPS: usize = 2;

/// Runs a decode step, then one more with an empty trace buffer, writes that step's records to
/// `$SLOWFAST_TRACE/trace-<tag>.csv` and prints where its time went.
fn trace_steps(
    ctx: &slowfast_cuda::CudaContext,
    dec: &mut slowfast_cuda::GpuDecoder,
    tag: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(), EngineError> {
    use slowfast_cuda::trace;
    let Some(dir) = trace::trace_dir() else {
        return Ok(());
    };
    dec.decode_step().map_err(gpu_err)?;
    ctx.synchronize().map_err(gpu_err)?;
    ctx.trace_reset().map_err(gpu_err)?;
    dec.decode_step().map_err(gpu_err)?;
    let recs = ctx.trace_take().map_err(gpu_err)?;
    progress(&format!(
        "trace {tag}: one step -> {}",
        write_trace(&dir, tag, &recs)?
    ));
    Ok(())
}

/// Writes one traced step's records to `<dir>/trace-<tag>.csv`; returns that path and
/// [`slowfast_cuda::trace::format_summary`]'s table, for the progress line.
fn write_trace(
    dir: &std::path::Path,
    tag: &str,
    recs: &[slowfast_cuda::trace::TraceRecord],
) -> Result<String, EngineError> {
    use slowfast_cuda::trace;
    std::fs::create_dir_all(dir).map_err(|e| EngineError::Io(format!("{}: {e}", dir.display())))?;
    let path = dir.join(format!("trace-{tag}.csv"));
    std::fs::write(&path, trace::to_csv(recs))
        .map_err(|e| EngineError::Io(format!("{}: {e}", path.display())))?;
    Ok(format!(
        "{}\n{}",
        path.display(),
        trace::format_summary(recs, 1)
    ))
}

/// Decode steps [`slow_step_anatomy`] takes: five timings of `ANATOMY_REPS`, a warm-up plain
/// step and the traced slow step.
const ANATOMY_STEPS: usize = 5 * ANATOMY_REPS + 2;
const ANATOMY_REPS: usize = 8;

/// Where a slow step's time goes against a fast one's (with `SLOWFAST_TRACE`, for sparse
/// policies that refresh): graph-replayed fast steps, the same steps launched plainly, slow steps
/// with one slot capturing (the staggered schedule's kind) back to back, and for the plain and
/// the slow step the host's time to queue one against the time to its end (a host-bound step
/// queues about as long as it runs); then one slow step's kernel trace. Leaves the graph dropped.
fn slow_step_anatomy(
    ctx: &slowfast_cuda::CudaContext,
    dec: &mut slowfast_cuda::GpuDecoder,
    tag: &str,
    batch: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<(), EngineError> {
    use slowfast_cuda::trace;
    let Some(dir) = trace::trace_dir() else {
        return Ok(());
    };
    let e = gpu_err;
    // host ms to queue `f`, and ms to its end, from an idle device (medians)
    let host_wall = |dec: &mut slowfast_cuda::GpuDecoder,
                     f: &mut dyn FnMut(
        &mut slowfast_cuda::GpuDecoder,
        usize,
    ) -> Result<(), slowfast_cuda::CudaError>|
     -> Result<(f64, f64), EngineError> {
        let (mut host, mut wall) = (Vec::new(), Vec::new());
        for i in 0..ANATOMY_REPS {
            dec.flush_refreshes().map_err(e)?;
            ctx.synchronize().map_err(e)?;
            let t = Instant::now();
            f(dec, i).map_err(e)?;
            host.push(t.elapsed().as_secs_f64() * 1e3);
            ctx.synchronize().map_err(e)?;
            wall.push(t.elapsed().as_secs_f64() * 1e3);
        }
        host.sort_by(f64::total_cmp);
        wall.sort_by(f64::total_cmp);
        Ok((host[host.len() / 2], wall[wall.len() / 2]))
    };
    let slow1 = |d: &mut slowfast_cuda::GpuDecoder, i: usize| {
        d.request_refresh(i % batch)?;
        d.decode_step()
    };
    dec.flush_refreshes().map_err(e)?;
    let graphed = ctx.time_ms(ANATOMY_REPS, || dec.decode_step()).map_err(e)?;
    let mut i = 0;
    let slow = ctx
        .time_ms(ANATOMY_REPS, || {
            i += 1;
            slow1(dec, i)
        })
        .map_err(e)?;
    let (slow_host, slow_wall) = host_wall(dec, &mut |d, i| slow1(d, i))?;
    dec.flush_refreshes().map_err(e)?;
    dec.begin_decode().map_err(e)?; // drops the graph: plain launches from here
    dec.decode_step().map_err(e)?;
    let plain = ctx.time_ms(ANATOMY_REPS, || dec.decode_step()).map_err(e)?;
    let (plain_host, plain_wall) = host_wall(dec, &mut |d, _| d.decode_step())?;
    ctx.synchronize().map_err(e)?;
    ctx.trace_reset().map_err(e)?;
    slow1(dec, 0).map_err(e)?;
    dec.flush_refreshes().map_err(e)?;
    let recs = ctx.trace_take().map_err(e)?;
    let written = write_trace(&dir, &format!("{tag}-slow1"), &recs)?;
    progress(&format!(
        "anatomy {tag}: ms a step, back to back: fast graphed {graphed:.3}, fast plain {plain:.3}, \
         slow (one slot capturing) {slow:.3}; from idle, host queueing / to the end: fast plain \
         {plain_host:.3} / {plain_wall:.3}, slow {slow_host:.3} / {slow_wall:.3}\n\
         trace {tag}-slow1: one slow step -> {written}"
    ));
    Ok(())
}

pub(crate) fn gpu_err(e: slowfast_cuda::CudaError) -> EngineError {
    EngineError::BadInput(format!("--device cuda: {e}"))
}

/// Opens GPU 0 (compiles or loads the kernels).
pub fn open_context() -> Result<Arc<CudaContext>, EngineError> {
    CudaContext::new(0).map(Arc::new).map_err(gpu_err)
}

/// The GPU decoder's spec for a model config.
pub fn spec_of(m: &Model) -> DecoderSpec {
    let c = &m.cfg;
    DecoderSpec {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        intermediate: c.intermediate_size,
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        qk_norm: c.qk_norm,
        post_norms: c.post_norms,
        embed_scale: if c.scale_embeddings {
            (c.hidden_size as f32).sqrt()
        } else {
            1.0
        },
        glu: match c.activation {
            Activation::Silu => Glu::SwiGlu,
            Activation::GeluTanh => Glu::GeGluTanh,
        },
        attn_scale: c.attn_scale,
        windows: (0..c.num_hidden_layers)
            .map(|l| c.is_sliding(l).then_some(c.sliding_window).flatten())
            .collect(),
        inv_freq_global: rope_inv_freq(c.head_dim, c.rope_theta, &c.rope_scaling),
        inv_freq_local: rope_inv_freq(c.head_dim, c.rope_local_theta, &c.local_rope_scaling()),
        tied: c.tie_word_embeddings,
    }
}

/// The CPU model's weights, dequantized row by row (in parallel) to bf16.
struct Dequant<'a>(&'a Model);

fn to_bf16(w: &Weight) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; w.rows * w.cols];
    if w.ty == GgmlType::BF16 {
        out.par_chunks_mut(1 << 16)
            .zip(w.data.as_slice().par_chunks(1 << 17))
            .for_each(|(o, b)| {
                for (d, s) in o.iter_mut().zip(b.chunks_exact(2)) {
                    *d = bf16::from_bits(u16::from_le_bytes([s[0], s[1]]));
                }
            });
        return out;
    }
    out.par_chunks_mut(w.cols).enumerate().for_each_init(
        || vec![0f32; w.cols],
        |row, (r, o)| {
            w.row_f32(r, row);
            for (d, s) in o.iter_mut().zip(row.iter()) {
                *d = bf16::from_f32(*s);
            }
        },
    );
    out
}

impl WeightSource for Dequant<'_> {
    fn matrix(&self, t: Tensor) -> Result<Vec<bf16>, String> {
        let w = &self.0.weights;
        let m = match t {
            Tensor::Embed => &w.embed,
            Tensor::LmHead => w.lm_head(),
            Tensor::Q(l) => &w.layers[l].wq,
            Tensor::K(l) => &w.layers[l].wk,
            Tensor::V(l) => &w.layers[l].wv,
            Tensor::O(l) => &w.layers[l].wo,
            Tensor::Gate(l) => &w.layers[l].w_gate,
            Tensor::Up(l) => &w.layers[l].w_up,
            Tensor::Down(l) => &w.layers[l].w_down,
        };
        Ok(to_bf16(m))
    }

    fn norm(&self, n: Norm) -> Result<Vec<f32>, String> {
        let w = &self.0.weights;
        let missing = || format!("{n:?} is missing");
        Ok(match n {
            Norm::Attn(l) => w.layers[l].attn_norm.clone(),
            Norm::Q(l) => w.layers[l].q_norm.clone().ok_or_else(missing)?,
            Norm::K(l) => w.layers[l].k_norm.clone().ok_or_else(missing)?,
            Norm::PostAttn(l) => w.layers[l].post_attn_norm.clone().ok_or_else(missing)?,
            Norm::Ffn(l) => w.layers[l].ffn_norm.clone(),
            Norm::PostFfw(l) => w.layers[l].post_ffw_norm.clone().ok_or_else(missing)?,
            Norm::Final => w.final_norm.clone(),
        })
    }

    fn qkv_bias(&self, layer: usize) -> Result<Option<[Vec<f32>; 3]>, String> {
        let l = &self.0.weights.layers[layer];
        Ok(match (&l.bq, &l.bk, &l.bv) {
            (None, None, None) => None,
            (Some(q), Some(k), Some(v)) => Some([q.clone(), k.clone(), v.clone()]),
            _ => {
                return Err(format!(
                    "layer {layer} has biases on only some of q, k and v"
                ))
            }
        })
    }
}

/// Uploads `model` to the GPU with a KV cache of `slots` sequences of `capacity` tokens.
pub fn load_decoder(
    ctx: Arc<CudaContext>,
    model: &Model,
    slots: usize,
    capacity: usize,
    chunk: usize,
) -> Result<GpuDecoder, EngineError> {
    load_decoder_with(ctx, model, (slots, capacity, chunk), KvOptions::default())
}

/// As [`load_decoder`], with the KV cache paged ([`GpuDecoder::new_paged`]): slots map
/// pages as their sequences grow, within the limit `set_kv_limit` gives (the server's).
pub fn load_paged_decoder(
    ctx: Arc<CudaContext>,
    model: &Model,
    slots: usize,
    capacity: usize,
    chunk: usize,
) -> Result<GpuDecoder, EngineError> {
    let opts = KvOptions {
        paged: true,
        fp8: false,
    };
    load_decoder_with(ctx, model, (slots, capacity, chunk), opts)
}

/// The KV cache options of the GPU decoder for `--kv-dtype` (fp8: e4m3; f16 / f32: bf16).
pub fn kv_options(kv: KvDtype, paged: bool) -> KvOptions {
    KvOptions {
        paged,
        fp8: kv == KvDtype::Fp8,
    }
}

/// Uploads `model` with a KV cache of `slots` sequences of `capacity` tokens, prefilling
/// `chunk` tokens at a time, kept as `opts` says.
pub fn load_decoder_with(
    ctx: Arc<CudaContext>,
    model: &Model,
    (slots, capacity, chunk): (usize, usize, usize),
    opts: KvOptions,
) -> Result<GpuDecoder, EngineError> {
    let (spec, w) = (spec_of(model), &Dequant(model));
    GpuDecoder::with_options(ctx, spec, w, (slots, capacity, chunk), opts).map_err(gpu_err)
}

/// The KV policies the GPU runs (the others answer that they are CPU-only).
pub const GPU_POLICIES: &str =
    "full, streaming, h2o, sfi, snapkv, pyramidkv, quest, fastkv, oracle, oracle-sfi";

/// The GPU form of a KV policy ([`GPU_POLICIES`]); the others answer that they are CPU-only.
pub fn gpu_policy(spec: &PolicySpec) -> Result<GpuKvPolicy, EngineError> {
    Ok(match spec {
        PolicySpec::Full => GpuKvPolicy::Full,
        PolicySpec::Streaming { sinks, recent } => GpuKvPolicy::Streaming {
            sinks: *sinks,
            recent: *recent,
        },
        PolicySpec::Sfi { cfg, .. }
            if cfg.selector.nms_shift != 0
                || cfg.selector.evidence_mass
                || cfg.pool > 1.0
                || cfg.drift > 0.0 =>
        {
            return Err(EngineError::BadInput(
                "--device cuda: --sfi-nms-shift, --sfi-evidence-mass, --sfi-pool and --sfi-drift are not on the GPU yet (CPU only)".into(),
            ))
        }
        PolicySpec::Sfi { cfg, .. } => GpuKvPolicy::Sfi(GpuSfiConfig {
            sinks: cfg.sinks,
            recent: cfg.recent,
            selected: cfg.selected,
            page: cfg.page,
            bootstrap_rows: cfg.bootstrap_rows,
            selector: cfg.selector,
            refresh_lag: cfg.async_lag,
            candidates: cfg.candidates,
        }),
        // SnapKV and PyramidKV: the CPU policy's knobs; FastKV's retention is SnapKV's too
        // (its propagation is `GpuDecoder::prefill_fastkv`, run by `GpuSession`)
        PolicySpec::SnapKv(cfg) | PolicySpec::FastKv { cfg, .. } => GpuKvPolicy::Snap(GpuSnapConfig {
            capacity: cfg.capacity,
            window: cfg.window,
            kernel: cfg.kernel,
            pyramid_beta: cfg.pyramid_beta,
        }),
        // Quest: the CPU policy's pages, page size and dense layers
        PolicySpec::Quest { budget } => GpuKvPolicy::Quest(GpuQuestConfig::for_budget(*budget)),
        // H2O: the CPU policy's split of the budget
        PolicySpec::H2o { heavy, recent } => GpuKvPolicy::H2o {
            heavy: *heavy,
            recent: *recent,
        },
        // the diagnostic oracles: the CPU policy's rule (layout and reselection period)
        PolicySpec::Oracle {
            budget,
            sinks,
            recent,
            every,
        } => GpuKvPolicy::Oracle(slowfast_kv::OracleRule {
            budget: *budget,
            sinks: *sinks,
            recent: *recent,
            every: *every,
        }),
        PolicySpec::FastKvPrefill { .. } => {
            return Err(EngineError::BadInput(format!(
                "--device cuda: {} runs on the CPU only: its decoding reads every row of the layers FastKV's prefill left compact (on cuda: {GPU_POLICIES})",
                spec.name()
            )))
        }
    })
}

/// FastKV's propagation of a prompt of `n` tokens on the GPU: the CPU's rule
/// ([`crate::session::TspRule`]), as the decoder takes it.
pub(crate) fn tsp_args(rule: &crate::session::TspRule, n: usize) -> TspArgs {
    let c = rule.config(n);
    TspArgs {
        layer: c.layer,
        len: c.len,
        window: c.window,
        kernel: c.kernel,
    }
}

/// Keys of the probe's SFI memory (sinks, recent window, picks): a prompt past their sum
/// refreshes, so every decode step can capture (`probe_stability`).
const PROBE_MEMORY: (usize, usize, usize) = (4, 16, 16);

/// Shortest prompt [`probe_stability`] takes: its decode steps must be past the SFI memory
/// it borrows the capture of.
pub const PROBE_MIN_PROMPT: usize = PROBE_MEMORY.0 + PROBE_MEMORY.1 + PROBE_MEMORY.2;

/// `eval --task stability --device cuda`: prefills `tokens[..n_prefill]`, then decodes the
/// rest teacher-forced with every step a slow step of SFI (dense attention whose capture
/// leaves every global layer's logits: the output is full KV's), and hands each step's
/// logits to `probe`. Returns (prefill seconds, decode seconds, KV bytes).
pub fn probe_stability(
    model: &Model,
    tokens: &[u32],
    n_prefill: usize,
    kv: KvDtype,
    probe: &mut slowfast_kv::probe::ProbePolicy,
    progress: &mut dyn FnMut(&str),
) -> Result<(f64, f64, usize), EngineError> {
    if n_prefill < PROBE_MIN_PROMPT || n_prefill >= tokens.len() {
        return Err(EngineError::BadInput(format!(
            "--device cuda stability: the prefilled part ({n_prefill} tokens) must hold at least {PROBE_MIN_PROMPT} tokens and leave decode steps ({} tokens in all)",
            tokens.len()
        )));
    }
    let (sinks, recent, selected) = PROBE_MEMORY;
    let cfg = slowfast_kv::sfi::memory::SfiConfig::new(sinks, recent, selected);
    let ctx = open_context()?;
    let mut dec = load_decoder_with(
        ctx,
        model,
        (1, tokens.len(), GPU_CHUNK),
        kv_options(kv, false),
    )?;
    dec.set_policy(GpuKvPolicy::Sfi(GpuSfiConfig {
        sinks,
        recent,
        selected,
        page: cfg.page,
        bootstrap_rows: cfg.bootstrap_rows,
        selector: cfg.selector,
        refresh_lag: 0,
        candidates: 0.0, // the capture must cover every key
    }))
    .map_err(gpu_err)?;
    let globals: Vec<usize> = (0..model.cfg.num_hidden_layers)
        .filter(|&l| !model.cfg.is_sliding(l))
        .collect();
    let nh = model.cfg.num_attention_heads;
    let t0 = Instant::now();
    dec.prefill(0, &tokens[..n_prefill], false)
        .map_err(gpu_err)?;
    dec.logits().map_err(gpu_err)?; // waits for the prefill
    let prefill_seconds = t0.elapsed().as_secs_f64();
    progress(&format!("prefill {n_prefill}/{n_prefill} tokens"));
    let t1 = Instant::now();
    let mut last_report = Instant::now();
    let steps = tokens.len() - n_prefill;
    dec.begin_decode().map_err(gpu_err)?;
    for (i, &t) in tokens[n_prefill..].iter().enumerate() {
        probe.see_token(t);
        dec.set_next(&[t]).map_err(gpu_err)?;
        dec.request_refresh(0).map_err(gpu_err)?;
        dec.decode_step().map_err(gpu_err)?;
        let scores = dec.captured_scores(0).map_err(gpu_err)?;
        let len = dec.slot_len(0);
        for (gi, &l) in globals.iter().enumerate() {
            probe.observe_row(l, 0, len, &scores[gi * nh * len..(gi + 1) * nh * len]);
        }
        probe.end_step();
        if last_report.elapsed().as_secs_f64() > 2.0 || i + 1 == steps {
            let st = probe.stability();
            progress(&format!(
                "decode {}/{steps} (jaccard within {:.3}, across {:.3})",
                i + 1,
                st.within.get().unwrap_or(f64::NAN),
                st.across.get().unwrap_or(f64::NAN)
            ));
            last_report = Instant::now();
        }
    }
    Ok((prefill_seconds, t1.elapsed().as_secs_f64(), dec.kv_bytes()))
}

/// SFI's slow-step trigger for `policy` (the CPU's, run on the host over the kept tokens), or
/// none for the other policies. One place for the GPU session and the GPU scheduler.
pub(crate) fn trigger_of(policy: &PolicySpec) -> Result<Option<Trigger>, EngineError> {
    match policy {
        PolicySpec::Sfi {
            cfg,
            enders,
            newlines,
            vocab_size,
        } => Trigger::new(cfg.trigger.clone(), enders, newlines, (*vocab_size).max(1))
            .map(Some)
            .map_err(|e| EngineError::BadInput(format!("SFI trigger: {e}"))),
        _ => Ok(None),
    }
}

/// One sequence on the GPU, stepped by the generate loop (logits come back to the host for
/// the CPU sampler chain, so sampling is the same as on the CPU). SFI's sentence trigger runs
/// on the host on the sampled tokens and asks the decoder for a slow step.
pub struct GpuSession {
    dec: GpuDecoder,
    logits: Vec<f32>,
    decoding: bool,
    /// Speculative decoding: steps are drafts (SFI's trigger does not see them).
    drafting: bool,
    /// The slot's length changed under a captured graph (`rewind`): `resume_decode` first.
    resync: bool,
    /// The last verification's logits `[rows, vocab]`.
    vlogits: Vec<f32>,
    steps: usize,
    trigger: Option<Trigger>,
    /// FastKV's propagation rule (`TspRule`): a prompt into the empty slot runs
    /// `GpuDecoder::prefill_fastkv`.
    tsp: Option<crate::session::TspRule>,
    name: &'static str,
    attended: f64,
    dense: f64,
}

impl GpuSession {
    pub fn new(
        model: &Model,
        max_tokens: usize,
        kv: KvDtype,
        policy: &PolicySpec,
    ) -> Result<Self, EngineError> {
        let gp = gpu_policy(policy)?;
        let trigger = trigger_of(policy)?;
        let ctx = open_context()?;
        let dims = (1, max_tokens.max(1), GPU_CHUNK);
        let mut dec = load_decoder_with(ctx, model, dims, kv_options(kv, false))?;
        dec.set_policy(gp).map_err(gpu_err)?;
        Ok(GpuSession {
            dec,
            logits: Vec::new(),
            decoding: false,
            drafting: false,
            resync: false,
            vlogits: Vec::new(),
            steps: 0,
            trigger,
            tsp: crate::session::tsp_of(policy, model),
            name: policy.name(),
            attended: 0.0,
            dense: 0.0,
        })
    }

    pub fn decoder(&mut self) -> &mut GpuDecoder {
        &mut self.dec
    }
}

impl Steps for GpuSession {
    fn prefill(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::BadInput(
                "empty prompt: nothing to prefill".into(),
            ));
        }
        let refreshes = self.dec.step_counts().2;
        match self.tsp {
            Some(rule) if self.dec.slot_len(0) == 0 => {
                let tsp = tsp_args(&rule, tokens.len());
                self.dec.prefill_fastkv(0, tokens, &tsp).map_err(gpu_err)?;
            }
            _ => {
                self.dec.prefill(0, tokens, false).map_err(gpu_err)?;
            }
        }
        self.logits = self.dec.logits().map_err(gpu_err)?;
        self.decoding = false;
        if let Some(t) = self.trigger.as_mut() {
            if self.dec.step_counts().2 > refreshes {
                t.reset_after_refresh(); // the bootstrap
            }
        }
        progress(tokens.len(), tokens.len());
        Ok(&self.logits)
    }

    fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        if !self.decoding {
            self.dec.begin_decode().map_err(gpu_err)?;
            self.decoding = true;
        } else if self.resync {
            self.dec.resume_decode().map_err(gpu_err)?;
        }
        self.resync = false;
        self.dec.set_next(&[token]).map_err(gpu_err)?;
        // Drafts are not the sequence: SFI's trigger sees the kept tokens at `end_verify`.
        let fired = !self.drafting && self.trigger.as_mut().is_some_and(|t| t.on_token(token));
        if fired {
            self.dec.request_refresh(0).map_err(gpu_err)?;
        }
        let (refreshes, len) = (self.dec.step_counts().2, self.dec.slot_len(0) + 1);
        self.dec.decode_step().map_err(gpu_err)?;
        let slow = self.dec.step_counts().2 > refreshes && !self.dec.selects_within_step();
        if let Some(t) = self.trigger.as_mut().filter(|_| slow && !fired) {
            t.reset_after_refresh(); // a refresh the trigger did not ask for (the bridge)
        }
        // a slow step reads every key, or a cheaper slow step its view (and a key a page bound)
        self.attended += if slow {
            self.dec.slow_step_read(0, len)
        } else {
            self.dec.attended(0)
        } as f64;
        self.dense += len as f64;
        if self.steps == 0 {
            // Later steps replay the step as one CUDA graph (plain launches if capture fails).
            let _ = self.dec.capture_decode();
        }
        self.logits = self.dec.logits().map_err(gpu_err)?;
        self.steps += 1;
        Ok(&self.logits)
    }

    fn logits(&self) -> &[f32] {
        &self.logits
    }
    fn kv_bytes(&self) -> usize {
        self.dec.kv_bytes()
    }
    fn policy_name(&self) -> &'static str {
        self.name
    }
    fn policy_stats(&self) -> PolicyStats {
        let (slow, fast, _) = self.dec.step_counts();
        PolicyStats {
            slow_steps: slow,
            fast_steps: fast,
            attended_tokens: self.attended,
            dense_tokens: self.dense,
        }
    }
}

/// Speculative decoding on the GPU: the same `Speculator` loop as on the CPU. Draft steps are
/// the session's decode steps (its sparse policy, replayed as the captured graph); a
/// verification is one `GpuDecoder::verify` pass of all rows (dense, each K/V tile read once);
/// rejected drafts are cut with `rewind`, which keeps SFI's memory; SFI's Selector refreshes
/// from the verification's row 0 (every verification, or when the trigger fires on the kept
/// tokens).
impl crate::spec::SpecTarget for GpuSession {
    fn pos(&self) -> usize {
        self.dec.slot_len(0)
    }
    fn capacity(&self) -> usize {
        self.dec.capacity()
    }
    fn vocab_size(&self) -> usize {
        self.dec.spec().vocab
    }
    fn chunk(&self) -> usize {
        GPU_CHUNK
    }
    fn policy_name(&self) -> &'static str {
        self.name
    }
    fn verify_rows_max(&self) -> usize {
        crate::spec::MAX_SPEC_TOKENS + 1
    }
    fn begin_draft(&mut self) -> Result<(), EngineError> {
        if !matches!(self.name, "sfi" | "streaming") {
            return Err(EngineError::BadInput(format!(
                "the {} policy cannot draft for speculative decoding (drafters: sfi, streaming)",
                self.name
            )));
        }
        self.drafting = true;
        Ok(())
    }
    fn end_draft(&mut self, len: usize) -> Result<(), EngineError> {
        self.drafting = false;
        self.dec.rewind(0, len).map_err(gpu_err)?;
        self.resync = true;
        Ok(())
    }
    fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        Steps::step(self, token)
    }
    fn verify(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::BadInput("verify: no tokens".into()));
        }
        // SFI: row 0 always leaves its scores; end_verify decides whether the Selector runs.
        let capture = [self.trigger.is_some()];
        self.dec
            .verify(tokens, tokens.len(), &capture)
            .map_err(gpu_err)?;
        self.vlogits = self.dec.verify_logits().map_err(gpu_err)?;
        // Row 0's keys (the verification is dense): counted as a slow step's.
        let row0 = (self.dec.slot_len(0) - tokens.len() + 1) as f64;
        self.dense += row0;
        self.attended += row0;
        Ok(&self.vlogits)
    }
    fn end_verify(&mut self, fed: &[u32], len: usize, refresh: bool) -> Result<(), EngineError> {
        self.dec.rewind(0, len).map_err(gpu_err)?;
        self.resync = true;
        let mut fire = refresh;
        if let Some(t) = self.trigger.as_mut() {
            for &tok in fed {
                fire |= t.on_token(tok);
            }
            if fire {
                self.dec.refresh_from_verify(&[0]).map_err(gpu_err)?;
                t.reset_after_refresh();
            }
        }
        Ok(())
    }
}

/// Options of `slowfast bench --device cuda`.
#[derive(Debug, Clone)]
pub struct GpuBenchOptions {
    pub contexts: Vec<usize>,
    pub new_tokens: usize,
    /// Sequences decoded together (each slot holds a copy of the prefilled prompt).
    pub batch: usize,
    /// Timed decode runs per context (the median is reported).
    pub repeats: usize,
    /// KV policies timed at every context ([`GPU_POLICIES`]).
    pub policies: Vec<String>,
    /// The KV cache paged ([`GpuDecoder::new_paged`], the server's) instead of allocated
    /// whole.
    pub paged: bool,
    /// Prefill only the last N tokens of each context for real; the positions before them
    /// get copies of the first prefill chunk's KV (`GpuDecoder::fill_synthetic`).
    pub real_prefill: Option<usize>,
    /// `Fp8`: e4m3 KV; otherwise bf16.
    pub kv_dtype: KvDtype,
}

/// The element type of `dec`'s KV cache, as records name it.
pub fn gpu_kv_name(dec: &GpuDecoder) -> &'static str {
    if dec.kv_fp8() {
        "fp8"
    } else {
        "bf16"
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuBenchRecord {
    pub model: String,
    pub device: String,
    pub policy: String,
    pub batch: usize,
    pub context: usize,
    pub new_tokens: usize,
    pub kv_dtype: String,
    pub prefill_seconds: f64,
    pub prefill_tok_s: f64,
    /// Matmul + causal attention FLOPs of the prefill over its time.
    pub prefill_tflops: f64,
    /// Over the bf16 GEMM rate measured in the same run (8192^3).
    pub prefill_pct_of_gemm: f64,
    /// Tokens per second summed over the batch (SFI: slow steps included, on their schedule).
    pub decode_tok_s: f64,
    pub decode_ms_per_step: f64,
    /// Whether the timed (fast) steps replayed a CUDA graph of the step.
    pub cuda_graph: bool,
    /// Full KV: the same steps launched kernel by kernel (no graph); sparse policies: 0.
    pub decode_ms_per_step_no_graph: f64,
    /// Sparse policies: a step with no refresh (graph replay), and a step where every
    /// sequence refreshes (dense + capture + Selector + gather, plain launches); else 0.
    pub fast_ms_per_step: f64,
    pub slow_ms_per_step: f64,
    /// SFI: each sequence's slow step comes every this many steps (staggered over the batch).
    pub refresh_interval: usize,
    /// SFI: the share of the timed schedule's steps that were slow (some slot refreshed).
    pub slow_share: f64,
    /// SFI: refreshes a sequence a step on the schedule (1 / `refresh_interval` without
    /// riding; more with it, riders refreshing early).
    pub refreshes_per_seq_step: f64,
    /// SFI: whether slots rode slow steps together (`--sfi-ride`).
    pub rides: bool,
    /// Tokens a fast step attends per kv head on a global layer (mean over the batch).
    pub attended_tokens: f64,
    /// (weights + K/V read per fast step) / fast step time (full KV: per step).
    pub decode_gb_s: f64,
    /// Over the device-to-device copy rate measured in the same run.
    pub decode_pct_of_copy: f64,
    pub decode_bytes_per_step: f64,
    pub copy_gb_s: f64,
    pub gemm_tflops: f64,
    pub weight_bytes: usize,
    pub kv_bytes: usize,
    /// Bytes of the sparse policy's compact buffers.
    pub compact_bytes: usize,
    pub peak_gpu_mem_gib: f64,
    pub device_name: String,
    /// `paged` (mapped as the sequences grow) or `contiguous` (allocated whole).
    pub kv_layout: String,
}

/// Device-to-device copy rate (GB/s, bytes read + written) over 2 GiB.
pub fn copy_rate(ctx: &CudaContext) -> Result<f64, EngineError> {
    let n = 1usize << 30;
    let src = ctx.alloc::<bf16>(n).map_err(gpu_err)?;
    let mut dst = ctx.alloc::<bf16>(n).map_err(gpu_err)?;
    ctx.copy(&src, &mut dst).map_err(gpu_err)?;
    let ms = ctx
        .time_ms(20, || ctx.copy(&src, &mut dst))
        .map_err(gpu_err)?;
    Ok(2.0 * (n * 2) as f64 / (ms as f64 * 1e-3) / 1e9)
}

/// cuBLAS bf16 GEMM rate (TFLOP/s) at 8192^3 with random operands.
pub fn gemm_rate(ctx: &CudaContext) -> Result<f64, EngineError> {
    let n = 8192usize;
    let mut s = 0x1234_5678_9abc_def1u64;
    let data: Vec<bf16> = (0..n * n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        })
        .collect();
    let a = ctx.upload(&data).map_err(gpu_err)?;
    let b = ctx.upload(&data).map_err(gpu_err)?;
    let mut c = ctx.alloc::<bf16>(n * n).map_err(gpu_err)?;
    for _ in 0..3 {
        ctx.linear(&a, &b, &mut c, n, n, n).map_err(gpu_err)?;
    }
    let ms = ctx
        .time_ms(10, || ctx.linear(&a, &b, &mut c, n, n, n))
        .map_err(gpu_err)?;
    Ok(2.0 * (n * n * n) as f64 / (ms as f64 * 1e-3) / 1e12)
}

/// FLOPs of prefilling `n` tokens from position 0: every weight matrix (the LM head for the
/// last row only) and causal attention (QK^T and PV; sliding layers within their window).
pub fn prefill_flops(m: &Model, n: usize) -> f64 {
    let c = &m.cfg;
    let (h, hd) = (c.hidden_size as f64, c.head_dim as f64);
    let (nh, nkv, i) = (
        c.num_attention_heads as f64,
        c.num_key_value_heads as f64,
        c.intermediate_size as f64,
    );
    let per_tok = c.num_hidden_layers as f64 * (h * (2.0 * nh * hd + 2.0 * nkv * hd) + 3.0 * h * i);
    let mut flops = 2.0 * per_tok * n as f64 + 2.0 * h * c.vocab_size as f64;
    for l in 0..c.num_hidden_layers {
        let keys: f64 = match (c.is_sliding(l), c.sliding_window) {
            (true, Some(w)) if w < n => {
                let w = w as f64;
                w * (w + 1.0) / 2.0 + (n as f64 - w) * w
            }
            _ => n as f64 * (n as f64 + 1.0) / 2.0,
        };
        flops += 4.0 * hd * nh * keys;
    }
    flops
}

fn used_gib(ctx: &CudaContext) -> f64 {
    ctx.mem_info()
        .map(|(free, total)| (total - free) as f64 / (1u64 << 30) as f64)
        .unwrap_or(0.0)
}

/// The bench's SFI schedule: one trigger a slot that forces a slow step every `interval`
/// steps (no sentence ends: the bench's tokens are never enders), slot s first at step
/// `interval - s * interval / batch`, riding as the policy's trigger says.
fn bench_triggers(
    pspec: &PolicySpec,
    batch: usize,
    interval: usize,
) -> Result<Vec<Trigger>, EngineError> {
    let PolicySpec::Sfi { cfg, .. } = pspec else {
        return Err(EngineError::BadInput(
            "the refresh schedule is SFI's".into(),
        ));
    };
    let tc = TriggerConfig {
        kind: TriggerKind::Punct,
        refresh_interval: interval,
        min_gap: cfg.trigger.min_gap.min(interval),
        ride: cfg.trigger.ride,
        ..TriggerConfig::default()
    };
    (0..batch)
        .map(|s| {
            let mut t = Trigger::new(tc.clone(), &[], &[], 1)
                .map_err(|e| EngineError::BadInput(format!("SFI trigger: {e}")))?;
            for _ in 0..s * interval / batch {
                t.on_token(0);
            }
            Ok(t)
        })
        .collect()
}

/// Whether policy `pspec` rides slow steps together (SFI with `--sfi-ride on`).
fn rides(pspec: &PolicySpec) -> bool {
    matches!(pspec, PolicySpec::Sfi { cfg, .. } if cfg.trigger.ride)
}

/// One decode step's SFI triggers on a GPU decoder, as `serve`'s scheduler and the bench take
/// them: each sequence's trigger on the token it is fed (one that fires asks its slot for a
/// refresh), then the riders (`riders`) into the score rows the step has left. `seqs` holds
/// (slot, trigger, token) a sequence, None for one without a trigger. Returns which of `seqs`
/// refresh at this step by their trigger (fired or rode); slots waiting from an earlier step
/// for a score row are not counted.
pub(crate) fn step_triggers(
    dec: &mut GpuDecoder,
    seqs: &mut [(usize, Option<&mut Trigger>, u32)],
) -> Result<Vec<bool>, slowfast_cuda::CudaError> {
    let mut fired = vec![false; seqs.len()];
    for ((slot, trig, tok), f) in seqs.iter_mut().zip(fired.iter_mut()) {
        *f = trig.as_mut().is_some_and(|t| t.on_token(*tok));
        if *f {
            dec.request_refresh(*slot)?;
        }
    }
    let slow: Vec<bool> = seqs.iter().map(|s| dec.refresh_requested(s.0)).collect();
    let able: Vec<Option<&Trigger>> = seqs
        .iter()
        .map(|(slot, t, _)| t.as_deref().filter(|_| dec.would_refresh(*slot)))
        .collect();
    let rode = riders(&able, &slow, dec.capture_room());
    for i in rode {
        if let Some(t) = seqs[i].1.as_mut() {
            t.ride();
        }
        dec.request_refresh(seqs[i].0)?;
        fired[i] = true;
    }
    Ok(fired)
}

/// `slowfast bench --device cuda`: per context, prefill one random prompt into slot 0 (full
/// KV), copy it to the other slots, then for each policy time greedy decode steps of the whole
/// batch (argmax on the device, no host round trip between steps). A sparse policy starts
/// from the prefilled cache (SFI: its first step is the bridge, a dense step that builds the
/// memory) and is timed three ways: fast steps only, slow steps only, and its schedule (SFI:
/// each sequence refreshes every `refresh_interval` steps, staggered over the batch).
///
/// With `spec`, speculative decoding is timed at each context after the policies
/// (`cuda_spec::time_drafter`, replayed acceptance), against full KV's rate when `full` ran.
pub fn bench(
    m: &Loaded,
    o: &GpuBenchOptions,
    spec_opts: Option<&crate::spec::timing::ReplayOptions>,
    spec_for: &dyn Fn(&str, usize) -> Result<PolicySpec, EngineError>,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<GpuBenchRecord>, Vec<crate::spec::timing::ReplayRecord>), EngineError> {
    let cfg = &m.model.cfg;
    if o.contexts.is_empty() || o.new_tokens == 0 || o.batch == 0 || o.policies.is_empty() {
        return Err(EngineError::BadInput(
            "bench: need contexts, policies, --new-tokens >= 1 and --batch >= 1".into(),
        ));
    }
    for &n in &o.contexts {
        for p in &o.policies {
            let spec = spec_for(p, n)?;
            gpu_policy(&spec)?;
            if matches!(spec, PolicySpec::FastKv { .. }) && o.real_prefill.is_some_and(|r| r < n) {
                return Err(EngineError::BadInput(format!(
                    "bench --policies fastkv: its token-selective prefill runs over the whole prompt, so --real-prefill ({}) must be left out or be the context ({n})",
                    o.real_prefill.unwrap_or(n)
                )));
            }
        }
    }
    let max_ctx = *o.contexts.iter().max().unwrap_or(&1);
    let repeats = o.repeats.max(1);
    // Per policy and repeat: a warm-up step and at most three timed runs of new_tokens steps.
    // (and SFI's bridge steps, CAPTURE_ROWS slots a step, once and after each repeat's slow
    // steps)
    let bridge = o.batch.div_ceil(slowfast_cuda::sparse::CAPTURE_ROWS);
    let mut capacity = max_ctx
        + (3 * o.new_tokens + 2 + TRACE_STEPS + ANATOMY_STEPS + bridge) * repeats
        + 2
        + bridge;
    if let Some(so) = spec_opts {
        let g = so.gammas.iter().copied().max().unwrap_or(1);
        capacity = capacity.max(max_ctx + 4 + (so.rounds + 1) * (g + 2));
        for &n in &o.contexts {
            for d in &so.drafters {
                so.accept
                    .check(d, &so.gammas)
                    .map_err(EngineError::BadInput)?;
                match d.as_str() {
                    "ngram" => {}
                    p => {
                        gpu_policy(&spec_for(p, n)?)?;
                    }
                }
            }
        }
    }
    // Past the model's context only for timing, with the KV filled (--real-prefill).
    if max_ctx > cfg.max_position_embeddings && o.real_prefill.is_none() {
        return Err(EngineError::BadInput(format!(
            "context {max_ctx} exceeds the model's context of {} tokens (give --real-prefill N to time it with a filled KV)",
            cfg.max_position_embeddings
        )));
    }
    if capacity > cfg.max_position_embeddings {
        progress(&format!(
            "note: decoding runs up to {} tokens past the model's context of {} (timing only)",
            capacity - cfg.max_position_embeddings,
            cfg.max_position_embeddings
        ));
    }
    let ctx = open_context()?;
    progress(&format!(
        "device {} (sm_{}{}, {} SMs), kernels from cache: {}",
        ctx.device_name(),
        ctx.compute_capability().0,
        ctx.compute_capability().1,
        ctx.sm_count(),
        ctx.kernels_from_cache()
    ));
    let copy = copy_rate(&ctx)?;
    let gemm = gemm_rate(&ctx)?;
    progress(&format!(
        "ceilings: device copy {copy:.0} GB/s, bf16 GEMM 8192^3 {gemm:.0} TFLOP/s"
    ));
    let t = Instant::now();
    let dims = (o.batch, capacity, GPU_CHUNK);
    let mut dec = match o.paged {
        false => load_decoder_with(ctx.clone(), &m.model, dims, kv_options(o.kv_dtype, false))?,
        true => {
            let opts = kv_options(o.kv_dtype, true);
            let mut d = load_decoder_with(ctx.clone(), &m.model, dims, opts)?;
            // Every slot at its longest, within what the device has free (less 2 GiB for
            // the policy's state and the workspace).
            let (free, _) = ctx.mem_info().map_err(gpu_err)?;
            let want = o.batch * d.kv_bytes_for(capacity);
            let limit = want.min(free.saturating_sub(2 << 30));
            d.set_kv_limit(limit).map_err(gpu_err)?;
            progress(&format!(
                "paged KV: pages of {} tokens a head, a pool of {:.2} GiB ({:.2} GiB for every slot at its longest)",
                d.page_tokens(),
                limit as f64 / (1u64 << 30) as f64,
                want as f64 / (1u64 << 30) as f64
            ));
            d
        }
    };
    progress(&format!(
        "weights on the GPU: {:.2} GiB bf16 (dequantized + uploaded in {:.1}s); KV cache {:.2} GiB {} for {} x {} tokens",
        dec.weight_bytes() as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64(),
        dec.kv_bytes() as f64 / (1u64 << 30) as f64,
        gpu_kv_name(&dec),
        o.batch,
        capacity
    ));
    let spec = dec.spec().clone();
    let mut out = Vec::new();
    let mut spec_out = Vec::new();
    for &n in &o.contexts {
        let prompt = crate::bench::random_tokens(n, cfg.vocab_size, 0x5107 + n as u64);
        dec.set_policy(GpuKvPolicy::Full).map_err(gpu_err)?;
        for s in 0..o.batch {
            dec.reset_slot(s).map_err(gpu_err)?;
        }
        progress(&format!("context {n}: prefill"));
        // --real-prefill N: the positions before the last N filled, not timed.
        let real = o.real_prefill.unwrap_or(n).clamp(1, n);
        if real < n {
            dec.fill_synthetic(0, &prompt[..n - real])
                .map_err(gpu_err)?;
        }
        ctx.synchronize().map_err(gpu_err)?;
        let t0 = Instant::now();
        dec.prefill(0, &prompt[n - real..], false)
            .map_err(gpu_err)?;
        ctx.synchronize().map_err(gpu_err)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        for s in 1..o.batch {
            dec.copy_slot(0, s).map_err(gpu_err)?;
        }
        let first = dec.logits().map_err(gpu_err)?;
        // The real part's FLOPs: its rows attend over the whole context.
        let flops = prefill_flops(&m.model, n) - prefill_flops(&m.model, n - real);
        let tflops = flops / prefill_s / 1e12;
        // FastKV last: its prefill leaves the layers after its TSP layer compact, so the
        // prompt's KV is not every policy's any more.
        let fastkv = |p: &&String| p.as_str() == "fastkv";
        let order = o.policies.iter().filter(|p| !fastkv(p));
        for pname in order.chain(o.policies.iter().filter(fastkv)) {
            let pspec = spec_for(pname, n)?;
            let gp = gpu_policy(&pspec)?;
            let interval = match &pspec {
                PolicySpec::Sfi { cfg, .. } => cfg.trigger.refresh_interval.max(1),
                _ => 0,
            };
            let next = crate::sampler::argmax(&first[..cfg.vocab_size]).unwrap_or(0);
            let (mut prefill_s, mut tflops) = (prefill_s, tflops);
            match crate::session::tsp_of(&pspec, &m.model) {
                Some(rule) => {
                    // its own prefill of the whole prompt, timed (FastKV's point), then copied
                    let tsp = tsp_args(&rule, n);
                    let (len, layer) = (tsp.len, tsp.layer);
                    progress(&format!(
                        "context {n} {pname}: prefill ({len} tokens past layer {layer})"
                    ));
                    dec.set_policy(gp).map_err(gpu_err)?;
                    for s in 0..o.batch {
                        dec.reset_slot(s).map_err(gpu_err)?;
                    }
                    ctx.synchronize().map_err(gpu_err)?;
                    let t0 = Instant::now();
                    dec.prefill_fastkv(0, &prompt, &tsp).map_err(gpu_err)?;
                    ctx.synchronize().map_err(gpu_err)?;
                    prefill_s = t0.elapsed().as_secs_f64();
                    // the FLOPs it ran: layers 0..=layer over every token, the rest over len
                    let l = m.model.cfg.num_hidden_layers as f64;
                    let part = (layer + 1) as f64 / l;
                    let flops = part * prefill_flops(&m.model, n)
                        + (1.0 - part) * prefill_flops(&m.model, len);
                    tflops = flops / prefill_s / 1e12;
                    for s in 1..o.batch {
                        dec.copy_slot(0, s).map_err(gpu_err)?;
                    }
                    dec.set_next(&vec![next; dec.num_slots()])
                        .map_err(gpu_err)?;
                    dec.begin_decode().map_err(gpu_err)?;
                }
                None => restart_slots(&mut dec, &prompt, gp, next)?,
            }
            ctx.synchronize().map_err(gpu_err)?;
            let mut peak = used_gib(&ctx);
            let sparse = gp != GpuKvPolicy::Full;
            let (mut times, mut plain, mut fast, mut slow, mut graph_ok) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), true);
            let (mut slow_share, mut per_seq) = (Vec::new(), Vec::new());
            let mut attended = 0.0;
            for r in 0..repeats {
                progress(&format!(
                    "context {n} {pname}: decode {} steps x batch {} (run {}/{repeats})",
                    o.new_tokens,
                    o.batch,
                    r + 1
                ));
                if !sparse {
                    let ms = ctx
                        .time_ms(o.new_tokens, || dec.decode_step())
                        .map_err(gpu_err)?;
                    plain.push(ms as f64);
                }
                if let Err(e) = dec.capture_decode() {
                    graph_ok = false;
                    progress(&format!(
                        "CUDA graph capture failed ({e}); timing plain steps"
                    ));
                }
                let ms = ctx
                    .time_ms(o.new_tokens, || dec.decode_step())
                    .map_err(gpu_err)?;
                if r == 0 && ctx.tracing() {
                    let tag = format!("{pname}-b{}-{n}", o.batch);
                    trace_steps(&ctx, &mut dec, &tag, progress)?;
                }
                attended +=
                    (0..o.batch).map(|s| dec.attended(s) as f64).sum::<f64>() / o.batch as f64;
                if !sparse {
                    times.push(ms as f64);
                } else {
                    fast.push(ms as f64);
                    if interval > 0 {
                        // Every slot refreshes every step.
                        let k = o.new_tokens.min(16);
                        let ms = ctx
                            .time_ms(k, || {
                                for s in 0..o.batch {
                                    dec.request_refresh(s)?;
                                }
                                dec.decode_step()
                            })
                            .map_err(gpu_err)?;
                        slow.push(ms as f64);
                        // Slots still waiting for a score row (past CAPTURE_ROWS a step) and
                        // refreshes still on the side stream finish outside the next timing,
                        // so the schedule starts with none pending.
                        while (0..o.batch).any(|s| dec.refresh_requested(s)) {
                            dec.decode_step().map_err(gpu_err)?;
                        }
                        dec.flush_refreshes().map_err(gpu_err)?;
                        ctx.synchronize().map_err(gpu_err)?;
                        // The schedule (`bench_triggers`): slot s refreshes every `interval`
                        // steps, first at step interval - s * interval / batch; with riding
                        // (the default) slots past their min gap join a slow step that runs
                        // anyway, as in `serve`.
                        let mut trig = bench_triggers(&pspec, o.batch, interval)?;
                        let mut t = 1usize;
                        let (slow0, fast0, ref0) = dec.step_counts();
                        let ms = ctx
                            .time_ms(o.new_tokens, || {
                                let mut seqs: Vec<_> = (trig.iter_mut().enumerate())
                                    .map(|(s, t)| (s, Some(t), 0))
                                    .collect();
                                step_triggers(&mut dec, &mut seqs)?;
                                t += 1;
                                dec.decode_step()?;
                                if t > o.new_tokens {
                                    // the last step waits for refreshes still in flight
                                    dec.flush_refreshes()?;
                                }
                                Ok(())
                            })
                            .map_err(gpu_err)?;
                        times.push(ms as f64);
                        let (slow1, fast1, ref1) = dec.step_counts();
                        let steps = (slow1 + fast1 - slow0 - fast0).max(1) as f64;
                        slow_share.push((slow1 - slow0) as f64 / steps);
                        per_seq.push((ref1 - ref0) as f64 / (steps * o.batch as f64));
                        if r == 0 && ctx.tracing() {
                            let tag = format!("{pname}-b{}-{n}", o.batch);
                            slow_step_anatomy(&ctx, &mut dec, &tag, o.batch, progress)?;
                        }
                    } else {
                        times.push(ms as f64);
                    }
                }
                dec.begin_decode().map_err(gpu_err)?; // drops the graph
            }
            peak = peak.max(used_gib(&ctx));
            let med = |v: &mut Vec<f64>| -> f64 {
                if v.is_empty() {
                    return 0.0;
                }
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let step_ms = med(&mut times);
            let plain_ms = med(&mut plain);
            let fast_ms = med(&mut fast);
            let slow_ms = med(&mut slow);
            let slow_share = med(&mut slow_share);
            let refreshes_per_seq_step = med(&mut per_seq);
            let attended = attended / repeats as f64;
            // K/V bytes read per (fast) step: global layers the attended tokens, sliding ones
            // their window, at the kernel head dim.
            let avg = n as f64 + 1.0 + o.new_tokens as f64;
            let kv_read: f64 = spec
                .windows
                .iter()
                .map(|w| {
                    let span = match w {
                        Some(w) => avg.min(*w as f64),
                        None if sparse => attended,
                        None => avg,
                    };
                    2.0 * span * (spec.n_kv_heads * dec.kv_row_bytes()) as f64
                })
                .sum::<f64>()
                * o.batch as f64;
            let bytes = dec.decode_weight_bytes() as f64 + kv_read;
            let roof_ms = if sparse { fast_ms } else { step_ms };
            let gbs = bytes / (roof_ms * 1e-3) / 1e9;
            let rec = GpuBenchRecord {
                model: m.name.clone(),
                device: "cuda".into(),
                policy: pname.clone(),
                batch: o.batch,
                context: n,
                new_tokens: o.new_tokens,
                kv_dtype: gpu_kv_name(&dec).into(),
                prefill_seconds: prefill_s,
                prefill_tok_s: real as f64 / prefill_s,
                prefill_tflops: tflops,
                prefill_pct_of_gemm: 100.0 * tflops / gemm,
                decode_tok_s: o.batch as f64 / (step_ms * 1e-3),
                decode_ms_per_step: step_ms,
                cuda_graph: graph_ok,
                decode_ms_per_step_no_graph: plain_ms,
                fast_ms_per_step: fast_ms,
                slow_ms_per_step: slow_ms,
                refresh_interval: interval,
                slow_share,
                refreshes_per_seq_step,
                rides: interval > 0 && rides(&pspec),
                attended_tokens: attended,
                decode_gb_s: gbs,
                decode_pct_of_copy: 100.0 * gbs / copy,
                decode_bytes_per_step: bytes,
                copy_gb_s: copy,
                gemm_tflops: gemm,
                weight_bytes: dec.weight_bytes(),
                kv_bytes: dec.kv_bytes(),
                compact_bytes: dec.compact_bytes(),
                peak_gpu_mem_gib: peak,
                device_name: ctx.device_name().to_owned(),
                kv_layout: if o.paged { "paged" } else { "contiguous" }.into(),
            };
            if let Some(prof) = dec.sfi_profile() {
                let refreshes = dec.step_counts().2.max(1) as f64;
                let parts: Vec<String> = slowfast_cuda::ops::sfi::SFI_STAGES
                    .iter()
                    .zip(prof)
                    .map(|(s, ms)| format!("{s} {:.3}", ms / refreshes))
                    .collect();
                progress(&format!(
                    "context {n} {pname}: Selector ms per refresh (all layers, profiled alone): {}",
                    parts.join(", ")
                ));
            }
            progress(&format!(
                "context {n} {pname}: decode {:.3} ms/step, {:.1} tok/s (fast {:.3}, slow {:.3}, no graph {:.3}); {:.0} GB/s ({:.1}% of copy) at {:.0} tokens a head",
                rec.decode_ms_per_step, rec.decode_tok_s, fast_ms, slow_ms, plain_ms, rec.decode_gb_s, rec.decode_pct_of_copy, attended
            ));
            if interval > 0 {
                progress(&format!(
                    "context {n} {pname}: schedule every {interval}, riding {}: {:.1}% of steps slow, {:.4} refreshes a sequence a step",
                    if rec.rides { "on" } else { "off" },
                    100.0 * slow_share,
                    refreshes_per_seq_step
                ));
            }
            out.push(rec);
        }
        if let Some(so) = spec_opts {
            let full = out
                .iter()
                .find(|r| r.policy == "full" && r.context == n)
                .map_or(0.0, |r| r.decode_tok_s);
            for d in &so.drafters {
                let ps = spec_for(crate::spec::timing::drafter_policy(d), n)?;
                let interval = match &ps {
                    PolicySpec::Sfi { cfg, .. } => cfg.trigger.refresh_interval.max(1),
                    _ => 0,
                };
                let gp = gpu_policy(&ps)?;
                let next = crate::sampler::argmax(&first[..cfg.vocab_size]).unwrap_or(0);
                restart_slots(&mut dec, &prompt, gp, next)?;
                let _ = dec.capture_decode();
                let next = dec.next_tokens().map_err(gpu_err)?;
                progress(&format!(
                    "context {n} speculate {d}: {} rounds at γ {:?} x batch {}",
                    so.rounds, so.gammas, o.batch
                ));
                spec_out.extend(crate::cuda_spec::time_drafter(
                    &mut dec, &m.name, d, so, n, next, interval, full, progress,
                )?);
            }
        }
    }
    Ok((out, spec_out))
}

/// Every slot back to the prompt's first `n` tokens under policy `gp`, each restarting from
/// the prompt's first next token `next`, and a warm-up step (sizes the workspace; SFI: the
/// bridge steps build the memories, `CAPTURE_ROWS` a step).
fn restart_slots(
    dec: &mut GpuDecoder,
    prompt: &[u32],
    gp: GpuKvPolicy,
    next: u32,
) -> Result<(), EngineError> {
    let n = prompt.len();
    for s in 0..dec.num_slots() {
        dec.truncate(s, n).map_err(gpu_err)?;
    }
    dec.set_policy(gp).map_err(gpu_err)?;
    // A policy that builds its memory only at the end of a prefill (SnapKV) sees the prompt's
    // last rows prefilled again (the same keys and values written over themselves).
    if let Some(w) = gp.prefill_rows().filter(|&w| w < n) {
        for s in 0..dec.num_slots() {
            dec.truncate(s, n - w).map_err(gpu_err)?;
            dec.prefill(s, &prompt[n - w..], false).map_err(gpu_err)?;
        }
    }
    dec.set_next(&vec![next; dec.num_slots()])
        .map_err(gpu_err)?;
    dec.begin_decode().map_err(gpu_err)?;
    // SFI's bridge steps: a step builds at most `CAPTURE_ROWS` memories, so a larger batch
    // takes a few warm-up steps before every slot has one
    for _ in 0..=dec.num_slots() {
        dec.decode_step().map_err(gpu_err)?;
        if dec.last_refreshed().is_empty() {
            break;
        }
    }
    Ok(())
}

/// A markdown table of GPU bench records, with each sparse policy's speedup over full KV at
/// the same context and batch.
pub fn table(rs: &[GpuBenchRecord]) -> String {
    let mut s = String::from(
        "| model | policy | batch | context | prefill tok/s (% GEMM) | decode tok/s | vs full | ms/step | fast / slow ms | tokens a head | fast-step GB/s (% copy) | peak GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rs {
        let full = rs
            .iter()
            .find(|f| f.policy == "full" && f.context == r.context && f.batch == r.batch)
            .map(|f| r.decode_tok_s / f.decode_tok_s);
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} ({:.0}%) | {:.1} | {} | {:.3} | {:.3} / {:.3} | {:.0} | {:.0} ({:.1}%) | {:.1} |\n",
            r.model,
            match r.kv_layout.as_str() {
                "paged" => format!("{} (paged KV)", r.policy),
                _ => r.policy.clone(),
            },
            r.batch,
            r.context,
            r.prefill_tok_s,
            r.prefill_pct_of_gemm,
            r.decode_tok_s,
            full.map_or("-".into(), |x| format!("{x:.2}x")),
            r.decode_ms_per_step,
            r.fast_ms_per_step,
            r.slow_ms_per_step,
            r.attended_tokens,
            r.decode_gb_s,
            r.decode_pct_of_copy,
            r.peak_gpu_mem_gib
        ));
    }
    s
}
