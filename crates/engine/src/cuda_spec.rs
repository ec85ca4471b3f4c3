//! `slowfast bench --device cuda --speculate ...`: speculative decoding's speed on the GPU,
//! batched, with a replayed acceptance (`spec::replay`): random-weight models draft nonsense,
//! so each verification keeps a length drawn from a distribution measured on real text. The
//! work per round is the real one: γ draft steps of the drafter's policy (the captured decode
//! graph; their tokens come back to the host after each step, as a live loop needs them), one
//! `verify` pass of γ + 1 rows a sequence, the download of its argmax, `rewind` of every
//! sequence to its accepted length, and for SFI the Selector's refresh from the verification.
use std::time::Instant;

use slowfast_cuda::{GpuDecoder, GpuKvPolicy};

use crate::cuda::gpu_err;
use crate::spec::replay::AcceptModel;
use crate::EngineError;

/// What `bench --speculate` times.
#[derive(Debug, Clone)]
pub struct GpuSpecOptions {
    /// sfi, streaming, ngram.
    pub drafters: Vec<String>,
    pub gammas: Vec<usize>,
    pub accept: AcceptModel,
    /// SFI: the Selector refreshes from every verification (else every `interval` tokens).
    pub refresh_every: bool,
    /// Verification rounds timed per (drafter, γ).
    pub rounds: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuSpecRecord {
    pub model: String,
    pub drafter: String,
    pub gamma: usize,
    pub batch: usize,
    pub context: usize,
    /// How accepted lengths were chosen (always replayed here).
    pub acceptance: String,
    pub rounds: usize,
    /// Tokens produced per verification (accepted + 1), mean over sequences and rounds.
    pub tokens_per_verification: f64,
    /// Accepted over drafted.
    pub acceptance_rate: f64,
    /// Produced tokens per second, summed over the batch.
    pub tok_s: f64,
    /// Over full KV's plain decode at the same context and batch in this run (0 if not run).
    pub speedup_vs_full: f64,
    pub draft_ms_per_round: f64,
    pub verify_ms_per_round: f64,
    pub refresh_every: bool,
    /// Draft steps that ran as SFI slow steps (dense + refresh: a memory forgotten by a
    /// rewind, or none yet), over all rounds; 0 for the other drafters.
    pub slow_draft_steps: usize,
}

/// The policy a drafter runs on the decoder (its own sparse policy, or full KV for n-gram).
pub fn drafter_policy(
    drafter: &str,
    sfi: GpuKvPolicy,
    streaming: GpuKvPolicy,
) -> Result<GpuKvPolicy, EngineError> {
    match drafter {
        "sfi" => Ok(sfi),
        "streaming" => Ok(streaming),
        "ngram" => Ok(GpuKvPolicy::Full),
        d => Err(EngineError::BadInput(format!(
            "bench --speculate: drafter `{d}` is not timed on the GPU (sfi, streaming, ngram)"
        ))),
    }
}

/// Times `o.rounds` rounds of `drafter` at every γ from the decoder's current state: every
/// slot holds the same prompt of `context` tokens, the policy is already set and warmed up
/// (one decode step, a captured graph), `next[s]` the slot's pending token. `interval`: SFI's
/// refresh interval when not refreshing every verification. `full_tok_s`: full KV's rate here.
#[allow(clippy::too_many_arguments)]
pub fn time_drafter(
    dec: &mut GpuDecoder,
    model: &str,
    drafter: &str,
    o: &GpuSpecOptions,
    context: usize,
    mut next: Vec<u32>,
    interval: usize,
    full_tok_s: f64,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<GpuSpecRecord>, EngineError> {
    let b = dec.num_slots();
    let sfi = drafter == "sfi";
    let drafts_on_gpu = drafter != "ngram";
    let mut out = Vec::new();
    let mut rng = 0x5EC0_DE5Eu64 ^ context as u64;
    let mut uniform = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let base: Vec<usize> = (0..b).map(|s| dec.slot_len(s)).collect();
    for &gamma in &o.gammas {
        let rows = gamma + 1;
        let ctx = dec.context().clone();
        let (mut produced, mut accepted) = (0usize, 0usize);
        let (mut draft_ms, mut verify_ms) = (0.0f64, 0.0f64);
        let mut since = vec![0usize; b];
        let mut slow_drafts = 0usize;
        // Each γ starts from the prompt.
        for (s, &l) in base.iter().enumerate() {
            dec.rewind(s, l).map_err(gpu_err)?;
        }
        dec.set_next(&next).map_err(gpu_err)?;
        dec.resume_decode().map_err(gpu_err)?;
        if sfi {
            // A memory built past the prompt was forgotten by the rewind: the bridge step
            // rebuilds it outside the timing, as the warm-up did for the first γ.
            dec.decode_step().map_err(gpu_err)?;
            next = dec.next_tokens().map_err(gpu_err)?;
        }
        if dec.slot_len(0) + o.rounds * (rows + 1) + rows > dec.capacity() {
            return Err(EngineError::BadInput(format!(
                "bench --speculate: {} rounds of γ {gamma} do not fit the cache of {} tokens",
                o.rounds,
                dec.capacity()
            )));
        }
        ctx.synchronize().map_err(gpu_err)?;
        let t0 = Instant::now();
        let mut toks = vec![0u32; b * rows];
        for _ in 0..o.rounds {
            let td = Instant::now();
            let p0: Vec<usize> = (0..b).map(|s| dec.slot_len(s)).collect();
            for s in 0..b {
                toks[s * rows] = next[s];
            }
            if drafts_on_gpu {
                let slow0 = dec.step_counts().0;
                for k in 0..gamma {
                    dec.decode_step().map_err(gpu_err)?;
                    let nx = dec.next_tokens().map_err(gpu_err)?;
                    for s in 0..b {
                        toks[s * rows + k + 1] = nx[s];
                    }
                }
                slow_drafts += dec.step_counts().0 - slow0;
                for (s, &l) in p0.iter().enumerate() {
                    dec.rewind(s, l).map_err(gpu_err)?;
                }
            } else {
                // Prompt lookup on the host: its proposals cost no GPU time.
                for s in 0..b {
                    for k in 1..rows {
                        toks[s * rows + k] = next[s];
                    }
                }
            }
            let tv = Instant::now();
            draft_ms += (tv - td).as_secs_f64() * 1e3;
            let refresh: Vec<bool> = (0..b)
                .map(|s| sfi && (o.refresh_every || since[s] >= interval))
                .collect();
            dec.verify(&toks, rows, &refresh).map_err(gpu_err)?;
            let am = dec.verify_argmax().map_err(gpu_err)?;
            for s in 0..b {
                let a = o.accept.draw(drafter, gamma, uniform()).min(gamma);
                dec.rewind(s, p0[s] + a + 1).map_err(gpu_err)?;
                next[s] = am[s * rows + a];
                produced += a + 1;
                accepted += a;
                since[s] += a + 1;
            }
            let fired: Vec<usize> = (0..b).filter(|&s| refresh[s]).collect();
            if !fired.is_empty() {
                dec.refresh_from_verify(&fired).map_err(gpu_err)?;
                fired.iter().for_each(|&s| since[s] = 0);
            }
            dec.set_next(&next).map_err(gpu_err)?;
            dec.resume_decode().map_err(gpu_err)?;
            verify_ms += tv.elapsed().as_secs_f64() * 1e3;
        }
        dec.flush_refreshes().map_err(gpu_err)?;
        ctx.synchronize().map_err(gpu_err)?;
        let secs = t0.elapsed().as_secs_f64();
        let tok_s = produced as f64 / secs;
        let rec = GpuSpecRecord {
            model: model.to_owned(),
            drafter: drafter.to_owned(),
            gamma,
            batch: b,
            context,
            acceptance: o.accept.label(),
            rounds: o.rounds,
            tokens_per_verification: produced as f64 / (o.rounds * b) as f64,
            acceptance_rate: accepted as f64 / (o.rounds * b * gamma) as f64,
            tok_s,
            speedup_vs_full: if full_tok_s > 0.0 {
                tok_s / full_tok_s
            } else {
                0.0
            },
            draft_ms_per_round: draft_ms / o.rounds as f64,
            verify_ms_per_round: verify_ms / o.rounds as f64,
            refresh_every: o.refresh_every,
            slow_draft_steps: if sfi { slow_drafts } else { 0 },
        };
        progress(&format!(
            "context {context} speculate {drafter} γ {gamma} ({}): {:.1} tok/s, {:.2}x full, {:.2} tokens a verification, draft {:.3} + verify {:.3} ms a round, {} slow draft steps",
            rec.acceptance, rec.tok_s, rec.speedup_vs_full, rec.tokens_per_verification, rec.draft_ms_per_round, rec.verify_ms_per_round, rec.slow_draft_steps
        ));
        out.push(rec);
    }
    Ok(out)
}

/// A markdown table of speculative records.
pub fn spec_table(rs: &[GpuSpecRecord]) -> String {
    let mut s = String::from(
        "| context | batch | drafter | γ | tokens / verification | acceptance | tok/s | vs full KV | draft ms / round | verify ms / round | slow draft steps |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rs {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {:.3} | {:.1} | {:.2}x | {:.3} | {:.3} | {} |\n",
            r.context,
            r.batch,
            r.drafter,
            r.gamma,
            r.tokens_per_verification,
            r.acceptance_rate,
            r.tok_s,
            r.speedup_vs_full,
            r.draft_ms_per_round,
            r.verify_ms_per_round,
            r.slow_draft_steps
        ));
    }
    if let Some(r) = rs.first() {
        s.push_str(&format!(
            "\nAcceptance {} (random weights: drafts are not checked).\n",
            r.acceptance
        ));
    }
    s
}
