//! `slowfast bench`: prefill and decode throughput at given context lengths, side by side in
//! one run. Prompts are deterministic pseudo-random token ids (speed does not depend on them).
use std::time::Instant;

use crate::load::Loaded;
use crate::sampler::argmax;
use crate::session::{KvDtype, PolicySpec, Session};
use crate::spec::timing::{
    drafter_policy, time_target, Point, ReplayOptions, ReplayRecord, Uniform,
};
use crate::EngineError;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub contexts: Vec<usize>,
    pub new_tokens: usize,
    pub kv_dtype: KvDtype,
    pub chunk: usize,
    /// Timed repetitions of the decode phase (the median is reported).
    pub repeats: usize,
    /// KV policies to compare at each context (names given to `spec_for`).
    pub policies: Vec<String>,
    /// Prefill only the last this-many prompt tokens for real (None: all); the KV of the
    /// positions before them is pseudo-random (`Session::fill_synthetic`).
    pub real_prefill: Option<usize>,
    /// Keep the global layers' KV in blocks of this many tokens, as a CPU server does (None:
    /// one block of the whole context).
    pub kv_block: Option<usize>,
}

/// Makes the policy `name` for a context length.
pub type SpecFor<'a> = &'a dyn Fn(&str, usize) -> Result<PolicySpec, EngineError>;

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRecord {
    pub model: String,
    pub policy: String,
    pub device: String,
    pub threads: usize,
    pub context: usize,
    pub new_tokens: usize,
    pub kv_dtype: String,
    /// Prompt tokens prefilled for real (the rest of the context was synthetic KV).
    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub decode_ms_per_token: f64,
    /// Weight + KV bytes read per decode step, over the step time.
    pub decode_gb_s: f64,
    /// KV bytes held at the end (same as `kv_bytes_end`).
    pub kv_bytes: usize,
    /// Timed decode steps that were slow (dense; for SFI they also refresh the memory) and
    /// the mean time of a slow and of a fast step (None when there was none).
    pub slow_steps: usize,
    pub slow_ms_per_step: Option<f64>,
    pub fast_ms_per_step: Option<f64>,
    /// KV bytes held right after prefill (after any one-shot compression) and at the end of
    /// decoding (evicting policies free memory; the store's real allocations).
    pub kv_bytes_after_prefill: usize,
    pub kv_bytes_end: usize,
    /// Mean keys attended per decode step (global layers) and its fraction of dense.
    pub mean_attended_tokens: f64,
    pub retained_fraction: f64,
}

/// Pseudo-random token ids in `[0, vocab)`, reproducible.
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// Run the benchmark for every context; `progress` gets a line per phase.
pub fn run(
    m: &Loaded,
    o: &BenchOptions,
    spec_for: SpecFor<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BenchRecord>, EngineError> {
    let cfg = &m.model.cfg;
    let mut out = Vec::new();
    let threads = rayon::current_num_threads();
    // Every context is checked before the first (long) run.
    for &ctx in &o.contexts {
        if ctx + o.new_tokens > cfg.max_position_embeddings {
            return Err(EngineError::BadInput(format!(
                "context {ctx} + {} new tokens exceeds the model's context of {} tokens",
                o.new_tokens, cfg.max_position_embeddings
            )));
        }
    }
    for &ctx in &o.contexts {
        let prompt = random_tokens(ctx, cfg.vocab_size, 0x5107 + ctx as u64);
        for pname in &o.policies {
            let policy = spec_for(pname, ctx)?;
            out.push(run_one(m, o, ctx, &prompt, &policy, threads, progress)?);
        }
    }
    Ok(out)
}

/// Prefill `prompt` and time decode steps under one policy.
fn run_one(
    m: &Loaded,
    o: &BenchOptions,
    ctx: usize,
    prompt: &[u32],
    policy: &PolicySpec,
    threads: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchRecord, EngineError> {
    let cfg = &m.model.cfg;
    let name = policy.name();
    let cap = ctx + o.new_tokens * o.repeats.max(1) + 1;
    let (mut sess, real, prefill_s) = prefilled(m, o, prompt, policy, cap, progress)?;
    let kv_bytes_after_prefill = sess.kv_bytes();
    let mut times = Vec::new();
    // Per-step times split by kind: slow (dense, refreshing) and fast (sparse) steps.
    let (mut slow_s, mut slow_n, mut fast_s, mut fast_n) = (0.0f64, 0usize, 0.0f64, 0usize);
    for r in 0..o.repeats.max(1) {
        progress(&format!(
            "context {ctx}, policy {name}: decode {} tokens (run {}/{})",
            o.new_tokens,
            r + 1,
            o.repeats.max(1)
        ));
        let mut tok = argmax(sess.logits()).unwrap_or(0);
        let t1 = Instant::now();
        for _ in 0..o.new_tokens {
            let before = sess.policy_stats().slow_steps;
            let ts = Instant::now();
            let l = sess.step(tok)?;
            tok = argmax(l).unwrap_or(0);
            let dt = ts.elapsed().as_secs_f64();
            if sess.policy_stats().slow_steps > before {
                (slow_s, slow_n) = (slow_s + dt, slow_n + 1);
            } else {
                (fast_s, fast_n) = (fast_s + dt, fast_n + 1);
            }
        }
        times.push(t1.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let per_tok = times[times.len() / 2] / o.new_tokens as f64;
    // Bytes read per step: all weights once plus the K/V each layer attends (sliding layers:
    // their window; global layers: what the policy attended on average).
    let stats = sess.policy_stats();
    let kv_elem = match o.kv_dtype {
        KvDtype::F32 => 4,
        KvDtype::F16 => 2,
        KvDtype::Fp8 => 1,
    };
    let avg_ctx = (ctx + o.new_tokens / 2) as f64;
    let kv_read: f64 = (0..cfg.num_hidden_layers)
        .map(|l| {
            let span = match (cfg.is_sliding(l), cfg.sliding_window) {
                (true, Some(w)) => avg_ctx.min(w as f64),
                _ => stats.mean_attended(),
            };
            2.0 * span * (cfg.num_key_value_heads * cfg.head_dim * kv_elem) as f64
        })
        .sum();
    let bytes = m.model.weights.decode_bytes_per_step() as f64 + kv_read;
    Ok(BenchRecord {
        model: m.name.clone(),
        policy: name.into(),
        device: "cpu".into(),
        threads,
        context: ctx,
        new_tokens: o.new_tokens,
        kv_dtype: format!("{:?}", o.kv_dtype).to_lowercase(),
        prefill_tokens: real,
        prefill_tok_s: real as f64 / prefill_s,
        decode_tok_s: 1.0 / per_tok,
        decode_ms_per_token: per_tok * 1e3,
        decode_gb_s: bytes / per_tok / 1e9,
        kv_bytes: sess.kv_bytes(),
        slow_steps: slow_n,
        slow_ms_per_step: (slow_n > 0).then(|| slow_s / slow_n as f64 * 1e3),
        fast_ms_per_step: (fast_n > 0).then(|| fast_s / fast_n as f64 * 1e3),
        kv_bytes_after_prefill,
        kv_bytes_end: sess.kv_bytes(),
        mean_attended_tokens: stats.mean_attended(),
        retained_fraction: stats.retained_fraction(),
    })
}

/// A session of `cap` tokens under `policy` holding `prompt` (its last `o.real_prefill`
/// tokens prefilled for real, the KV before them synthetic); (session, real tokens, prefill
/// seconds).
fn prefilled<'m>(
    m: &'m Loaded,
    o: &BenchOptions,
    prompt: &[u32],
    policy: &PolicySpec,
    cap: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<(Session<'m>, usize, f64), EngineError> {
    let (ctx, name) = (prompt.len(), policy.name());
    let mut sess = Session::try_with_policy(&m.model, cap, o.kv_dtype, o.chunk, policy)?;
    if let Some(b) = o.kv_block {
        sess.set_kv_block(b)?;
    }
    let real = o.real_prefill.unwrap_or(ctx).clamp(1, ctx);
    if real < ctx {
        progress(&format!(
            "context {ctx}, policy {name}: synthetic KV for {} tokens",
            ctx - real
        ));
        sess.fill_synthetic(ctx - real, 0x5eed + ctx as u64)?;
    }
    progress(&format!(
        "context {ctx}, policy {name}: prefill {real} tokens"
    ));
    let t0 = Instant::now();
    let mut last = Instant::now();
    sess.prefill(&prompt[ctx - real..], &mut |done, total| {
        if last.elapsed().as_secs_f64() > 5.0 {
            progress(&format!("  prefill {done}/{total}"));
            last = Instant::now();
        }
    })?;
    Ok((sess, real, t0.elapsed().as_secs_f64()))
}

/// `bench --speculate` on the CPU: at every context, each drafter's session (its own policy:
/// sfi, streaming; full KV for ngram) holds the bench's prompt, takes one warm-up step, then
/// `so.rounds` replayed rounds at each γ in turn (`spec::timing::time_target`, batch 1).
/// `full`: the plain records of this run, for the speedup over full KV's decode.
pub fn run_spec(
    m: &Loaded,
    o: &BenchOptions,
    so: &ReplayOptions,
    spec_for: SpecFor<'_>,
    full: &[BenchRecord],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ReplayRecord>, EngineError> {
    let cfg = &m.model.cfg;
    let mut out = Vec::new();
    for &ctx in &o.contexts {
        let prompt = random_tokens(ctx, cfg.vocab_size, 0x5107 + ctx as u64);
        let full_tok_s = full
            .iter()
            .find(|r| r.context == ctx && r.policy == "full")
            .map_or(0.0, |r| r.decode_tok_s);
        for d in &so.drafters {
            let policy = spec_for(drafter_policy(d), ctx)?;
            let span: usize = so.gammas.iter().map(|g| so.rounds * (g + 1)).sum();
            let cap = ctx + 1 + span + so.gammas.iter().max().unwrap_or(&1) + 2;
            let (mut sess, _, _) = prefilled(m, o, &prompt, &policy, cap, progress)?;
            let first = argmax(sess.logits()).unwrap_or(0);
            let mut next = argmax(sess.step(first)?).unwrap_or(0);
            progress(&format!(
                "context {ctx} speculate {d}: {} rounds at γ {:?}",
                so.rounds, so.gammas
            ));
            let mut rng = Uniform::new(ctx);
            for &gamma in &so.gammas {
                let (tally, nx) = time_target(&mut sess, d, gamma, so, next, &mut rng)?;
                next = nx;
                let point = Point {
                    model: &m.name,
                    device: "cpu",
                    drafter: d,
                    gamma,
                    batch: 1,
                    context: ctx,
                    full_tok_s,
                };
                let rec = tally.record(&point, so, None);
                progress(&rec.line());
                out.push(rec);
            }
        }
    }
    Ok(out)
}

/// A markdown table of bench records.
pub fn table(rs: &[BenchRecord]) -> String {
    let mut s = String::from(
        "| model | policy | context | prefill tok/s | decode tok/s | ms/token | slow ms (n) | fast ms | decode GB/s | KV MiB after prefill | KV MiB end | retained |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
    for r in rs {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.2} | {:.2} | {} ({}) | {} | {:.1} | {:.1} | {:.1} | {:.3} |\n",
            r.model,
            r.policy,
            r.context,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.decode_ms_per_token,
            ms(r.slow_ms_per_step),
            r.slow_steps,
            ms(r.fast_ms_per_step),
            r.decode_gb_s,
            r.kv_bytes_after_prefill as f64 / (1 << 20) as f64,
            r.kv_bytes_end as f64 / (1 << 20) as f64,
            r.retained_fraction
        ));
    }
    s
}
