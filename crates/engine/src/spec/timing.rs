//! Timing speculative decoding with a replayed acceptance (`replay::AcceptModel`), on any
//! device: random-weight models draft nonsense, so each verification keeps a length drawn from
//! a distribution measured on real text. The work per round is the real one: γ draft steps of
//! the drafter's policy, one verification of γ + 1 rows, the cut back to the accepted length
//! and, for SFI, the Selector's refresh from the verification. `bench --speculate` runs it:
//! batch 1 through [`SpecTarget`] here (the CPU), batched on the GPU (`cuda_spec`).
use std::time::Instant;

use crate::sampler::argmax;
use crate::spec::replay::AcceptModel;
use crate::spec::SpecTarget;
use crate::EngineError;

/// What `bench --speculate` times.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// sfi, streaming, ngram.
    pub drafters: Vec<String>,
    pub gammas: Vec<usize>,
    pub accept: AcceptModel,
    /// SFI: the Selector refreshes from every verification (else on its trigger: the GPU
    /// bench's is every `--sfi-refresh-interval` tokens, the CPU's the policy's own).
    pub refresh_every: bool,
    /// Verification rounds timed per (drafter, γ).
    pub rounds: usize,
    /// GPU: verifications replay CUDA graphs (else kernel by kernel; the CPU has none).
    pub verify_graphs: bool,
}

/// The drafters `bench --speculate` times: their own sparse decode steps (sfi, streaming) or
/// prompt lookup on the host (ngram, over full KV).
pub const BENCH_DRAFTERS: [&str; 3] = ["sfi", "streaming", "ngram"];

/// The KV policy a bench drafter's sequence runs: its own (sfi, streaming), or full KV under
/// prompt lookup (ngram).
pub fn drafter_policy(drafter: &str) -> &str {
    if drafter == "ngram" {
        "full"
    } else {
        drafter
    }
}

/// One (drafter, γ) point.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplayRecord {
    pub model: String,
    pub device: String,
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
    /// GPU: whether verifications replayed CUDA graphs.
    pub verify_graphs: bool,
    /// Draft steps that ran as SFI slow steps (dense + refresh: a memory forgotten by a
    /// rewind, or none yet), over all rounds; 0 for the other drafters; None where the device
    /// does not count them (the CPU).
    pub slow_draft_steps: Option<usize>,
}

impl ReplayRecord {
    /// The progress line of a finished point.
    pub fn line(&self) -> String {
        format!(
            "context {} speculate {} γ {} ({}): {:.1} tok/s, {:.2}x full, {:.2} tokens a verification, draft {:.3} + verify {:.3} ms a round{}{}",
            self.context,
            self.drafter,
            self.gamma,
            self.acceptance,
            self.tok_s,
            self.speedup_vs_full,
            self.tokens_per_verification,
            self.draft_ms_per_round,
            self.verify_ms_per_round,
            self.slow_draft_steps
                .map_or(String::new(), |n| format!(", {n} slow draft steps")),
            if self.device == "cuda" && !self.verify_graphs {
                ", verification graphs off"
            } else {
                ""
            }
        )
    }
}

/// Uniform draws in [0, 1) for the replay, reproducible per context.
pub struct Uniform(u64);

impl Uniform {
    pub fn new(context: usize) -> Self {
        Uniform(0x5EC0_DE5Eu64 ^ context as u64)
    }

    pub fn draw(&mut self) -> f64 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What a timed (drafter, γ) point summed: produced and accepted tokens, draft and
/// verification seconds, wall seconds.
#[derive(Debug, Default)]
pub struct Tally {
    pub produced: usize,
    pub accepted: usize,
    pub draft_s: f64,
    pub verify_s: f64,
    pub wall_s: f64,
}

/// Context for turning a [`Tally`] into a record.
pub struct Point<'a> {
    pub model: &'a str,
    pub device: &'a str,
    pub drafter: &'a str,
    pub gamma: usize,
    pub batch: usize,
    pub context: usize,
    pub full_tok_s: f64,
}

impl Tally {
    pub fn record(
        &self,
        p: &Point<'_>,
        o: &ReplayOptions,
        slow_draft_steps: Option<usize>,
    ) -> ReplayRecord {
        let tok_s = self.produced as f64 / self.wall_s.max(1e-12);
        let verifications = (o.rounds * p.batch).max(1) as f64;
        ReplayRecord {
            model: p.model.to_owned(),
            device: p.device.to_owned(),
            drafter: p.drafter.to_owned(),
            gamma: p.gamma,
            batch: p.batch,
            context: p.context,
            acceptance: o.accept.label(),
            rounds: o.rounds,
            tokens_per_verification: self.produced as f64 / verifications,
            acceptance_rate: self.accepted as f64 / (verifications * p.gamma as f64),
            tok_s,
            speedup_vs_full: if p.full_tok_s > 0.0 {
                tok_s / p.full_tok_s
            } else {
                0.0
            },
            draft_ms_per_round: self.draft_s * 1e3 / o.rounds.max(1) as f64,
            verify_ms_per_round: self.verify_s * 1e3 / o.rounds.max(1) as f64,
            refresh_every: o.refresh_every,
            verify_graphs: o.verify_graphs && p.device == "cuda",
            slow_draft_steps,
        }
    }
}

/// Times `o.rounds` rounds of `drafter` at γ `gamma` on one sequence, from its current state
/// (`next`: its pending token; returns the next pending token). The target runs the drafter's
/// policy (sfi, streaming) or full KV (ngram, whose proposals cost nothing here: a repeat of
/// the pending token, rejected or kept as the replay says).
pub fn time_target(
    t: &mut dyn SpecTarget,
    drafter: &str,
    gamma: usize,
    o: &ReplayOptions,
    next: u32,
    rng: &mut Uniform,
) -> Result<(Tally, u32), EngineError> {
    let rows = gamma + 1;
    if t.pos() + o.rounds * rows + rows > t.capacity() {
        return Err(EngineError::BadInput(format!(
            "bench --speculate: {} rounds of γ {gamma} do not fit the cache of {} tokens",
            o.rounds,
            t.capacity()
        )));
    }
    let vocab = t.vocab_size();
    let drafts = drafter != "ngram";
    let mut tally = Tally::default();
    let mut next = next;
    let t0 = Instant::now();
    let mut toks = Vec::with_capacity(rows);
    for _ in 0..o.rounds {
        let td = Instant::now();
        let p0 = t.pos();
        toks.clear();
        toks.push(next);
        if drafts {
            t.begin_draft()?;
            for _ in 0..gamma {
                let x = *toks.last().unwrap();
                let l = t.step(x)?;
                toks.push(argmax(l).unwrap_or(0));
            }
            t.end_draft(p0)?;
        } else {
            toks.resize(rows, next);
        }
        let tv = Instant::now();
        tally.draft_s += (tv - td).as_secs_f64();
        let logits = t.verify(&toks)?;
        let a = o.accept.draw(drafter, gamma, rng.draw()).min(gamma);
        next = argmax(&logits[a * vocab..(a + 1) * vocab]).unwrap_or(0);
        t.end_verify(
            &toks[..a + 1],
            p0 + a + 1,
            drafter == "sfi" && o.refresh_every,
        )?;
        tally.verify_s += tv.elapsed().as_secs_f64();
        tally.produced += a + 1;
        tally.accepted += a;
    }
    tally.wall_s = t0.elapsed().as_secs_f64();
    Ok((tally, next))
}

/// A markdown table of speculative records.
pub fn table(rs: &[ReplayRecord]) -> String {
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
                .map_or("-".to_string(), |n| n.to_string())
        ));
    }
    if let Some(r) = rs.first() {
        s.push_str(&format!(
            "\nAcceptance {} (random weights: drafts are not checked).\n",
            r.acceptance
        ));
        if r.device == "cuda" && !r.verify_graphs {
            s.push_str("Verifications launched kernel by kernel (--spec-graphs off).\n");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target whose logits always point at token `pos % vocab`, recording the calls.
    struct Fake {
        pos: usize,
        drafting: Option<usize>,
        logits: Vec<f32>,
        steps: usize,
        verified: Vec<usize>,
        refreshes: usize,
    }

    impl Fake {
        fn at(pos: usize) -> Self {
            Fake {
                pos,
                drafting: None,
                logits: vec![],
                steps: 0,
                verified: vec![],
                refreshes: 0,
            }
        }

        fn argmax_at(&mut self, rows: usize) -> &[f32] {
            self.logits = vec![0.0; rows * 8];
            for r in 0..rows {
                self.logits[r * 8 + (self.pos + r) % 8] = 1.0;
            }
            &self.logits
        }
    }

    impl SpecTarget for Fake {
        fn pos(&self) -> usize {
            self.pos
        }
        fn capacity(&self) -> usize {
            1000
        }
        fn vocab_size(&self) -> usize {
            8
        }
        fn chunk(&self) -> usize {
            64
        }
        fn policy_name(&self) -> &'static str {
            "fake"
        }
        fn verify_rows_max(&self) -> usize {
            64
        }
        fn begin_draft(&mut self) -> Result<(), EngineError> {
            assert!(self.drafting.is_none());
            self.drafting = Some(self.pos);
            Ok(())
        }
        fn end_draft(&mut self, len: usize) -> Result<(), EngineError> {
            assert_eq!(self.drafting.take(), Some(len));
            self.pos = len;
            Ok(())
        }
        fn step(&mut self, _token: u32) -> Result<&[f32], EngineError> {
            assert!(self.drafting.is_some(), "a step outside a draft");
            self.steps += 1;
            self.pos += 1;
            Ok(self.argmax_at(1))
        }
        fn verify(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
            assert!(self.drafting.is_none(), "a verification inside a draft");
            self.verified.push(tokens.len());
            self.argmax_at(tokens.len());
            self.pos += tokens.len();
            Ok(&self.logits)
        }
        fn end_verify(
            &mut self,
            fed: &[u32],
            len: usize,
            refresh: bool,
        ) -> Result<(), EngineError> {
            assert!(len <= self.pos && len == self.pos - self.verified.last().unwrap() + fed.len());
            self.pos = len;
            self.refreshes += refresh as usize;
            Ok(())
        }
    }

    fn opts(alpha: f64, refresh_every: bool) -> ReplayOptions {
        ReplayOptions {
            drafters: vec!["sfi".into()],
            gammas: vec![3],
            accept: AcceptModel::Alpha(alpha),
            refresh_every,
            verify_graphs: true,
            rounds: 10,
        }
    }

    #[test]
    fn replayed_rounds_draft_verify_and_keep_the_drawn_length() {
        for (alpha, kept) in [(1.0, 4), (0.0, 1)] {
            let mut t = Fake::at(100);
            let o = opts(alpha, true);
            let (tally, next) =
                time_target(&mut t, "sfi", 3, &o, 5, &mut Uniform::new(100)).unwrap();
            // γ draft steps and one verification of γ + 1 rows a round
            assert_eq!((t.steps, t.verified), (30, vec![4; 10]));
            assert_eq!(t.pos, 100 + 10 * kept);
            assert_eq!(
                (tally.produced, tally.accepted),
                (10 * kept, 10 * (kept - 1))
            );
            // the pending token is the verification's argmax at the last kept row (row r of a
            // verification at p points at (p + r) % 8)
            assert_eq!(next as usize, (100 + 10 * kept - 1) % 8);
            assert_eq!(t.refreshes, 10);
            let p = Point {
                model: "m",
                device: "cpu",
                drafter: "sfi",
                gamma: 3,
                batch: 1,
                context: 100,
                full_tok_s: 0.0,
            };
            let r = tally.record(&p, &o, None);
            assert_eq!(r.tokens_per_verification, kept as f64);
            assert_eq!(r.acceptance_rate, (kept - 1) as f64 / 3.0);
            assert_eq!(r.speedup_vs_full, 0.0);
        }
        // prompt lookup drafts nothing on the device; streaming never refreshes
        let mut t = Fake::at(10);
        time_target(
            &mut t,
            "ngram",
            3,
            &opts(0.5, true),
            1,
            &mut Uniform::new(1),
        )
        .unwrap();
        assert_eq!((t.steps, t.refreshes), (0, 0));
        time_target(
            &mut t,
            "streaming",
            2,
            &opts(0.5, true),
            1,
            &mut Uniform::new(1),
        )
        .unwrap();
        assert_eq!((t.steps, t.refreshes), (20, 0));
    }

    #[test]
    fn a_round_count_past_the_cache_is_refused() {
        let mut t = Fake::at(990);
        let e = time_target(&mut t, "sfi", 3, &opts(1.0, true), 1, &mut Uniform::new(1));
        assert!(format!("{}", e.unwrap_err()).contains("do not fit the cache"));
    }
}
