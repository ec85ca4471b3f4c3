//! `slowfast bench --device cuda --speculate ...`: speculative decoding's speed on the GPU,
//! batched, with a replayed acceptance (`spec::timing` has the options, records and the
//! batch-1 loop of every device). Per round: γ draft steps of the drafter's policy (the
//! captured decode graph; their tokens come back to the host after each step, as a live loop
//! needs them), one `verify` pass of γ + 1 rows a sequence, the download of its argmax,
//! `rewind` of every sequence to its accepted length, and for SFI the Selector's refresh from
//! the verification.
use std::time::Instant;

use slowfast_cuda::GpuDecoder;

use crate::cuda::gpu_err;
use crate::spec::timing::{Point, ReplayOptions, ReplayRecord, Tally, Uniform};
use crate::EngineError;

/// Times `o.rounds` rounds of `drafter` at every γ from the decoder's current state: every
/// slot holds the same prompt of `context` tokens, the policy is already set and warmed up
/// (one decode step, a captured graph), `next[s]` the slot's pending token. `interval`: SFI's
/// refresh interval when not refreshing every verification. `full_tok_s`: full KV's rate here.
#[allow(clippy::too_many_arguments)]
pub fn time_drafter(
    dec: &mut GpuDecoder,
    model: &str,
    drafter: &str,
    o: &ReplayOptions,
    context: usize,
    mut next: Vec<u32>,
    interval: usize,
    full_tok_s: f64,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ReplayRecord>, EngineError> {
    let b = dec.num_slots();
    let sfi = drafter == "sfi";
    let drafts_on_gpu = drafter != "ngram";
    let mut out = Vec::new();
    let mut rng = Uniform::new(context);
    let base: Vec<usize> = (0..b).map(|s| dec.slot_len(s)).collect();
    for &gamma in &o.gammas {
        let rows = gamma + 1;
        let ctx = dec.context().clone();
        let mut tally = Tally::default();
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
        dec.set_verify_graphs(o.verify_graphs);
        // One verification of this shape outside the timing, rewound: it sizes the partials
        // and, with graphs on, captures the graph that the timed rounds replay.
        let l0: Vec<usize> = (0..b).map(|s| dec.slot_len(s)).collect();
        let warm: Vec<u32> = next.iter().flat_map(|&t| vec![t; rows]).collect();
        dec.verify(&warm, rows, &vec![false; b]).map_err(gpu_err)?;
        for (s, &l) in l0.iter().enumerate() {
            dec.rewind(s, l).map_err(gpu_err)?;
        }
        dec.set_next(&next).map_err(gpu_err)?;
        dec.resume_decode().map_err(gpu_err)?;
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
            tally.draft_s += (tv - td).as_secs_f64();
            let refresh: Vec<bool> = (0..b)
                .map(|s| sfi && (o.refresh_every || since[s] >= interval))
                .collect();
            dec.verify(&toks, rows, &refresh).map_err(gpu_err)?;
            let am = dec.verify_argmax().map_err(gpu_err)?;
            for s in 0..b {
                let a = o.accept.draw(drafter, gamma, rng.draw()).min(gamma);
                dec.rewind(s, p0[s] + a + 1).map_err(gpu_err)?;
                next[s] = am[s * rows + a];
                tally.produced += a + 1;
                tally.accepted += a;
                since[s] += a + 1;
            }
            let fired: Vec<usize> = (0..b).filter(|&s| refresh[s]).collect();
            if !fired.is_empty() {
                dec.refresh_from_verify(&fired).map_err(gpu_err)?;
                fired.iter().for_each(|&s| since[s] = 0);
            }
            dec.set_next(&next).map_err(gpu_err)?;
            dec.resume_decode().map_err(gpu_err)?;
            tally.verify_s += tv.elapsed().as_secs_f64();
        }
        dec.flush_refreshes().map_err(gpu_err)?;
        ctx.synchronize().map_err(gpu_err)?;
        tally.wall_s = t0.elapsed().as_secs_f64();
        let point = Point {
            model,
            device: "cuda",
            drafter,
            gamma,
            batch: b,
            context,
            full_tok_s,
        };
        let rec = tally.record(&point, o, Some(if sfi { slow_drafts } else { 0 }));
        progress(&rec.line());
        out.push(rec);
    }
    Ok(out)
}
