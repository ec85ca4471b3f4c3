//! The scheduler's GPU device (feature `cuda`): one paged `GpuDecoder` with `max_batch` slots
//! of up to `max_context` tokens, every slot running the server's one KV policy. A slot maps
//! KV pages as its sequence grows, from a pool of `--kv-memory` bytes (default: what
//! `--gpu-memory-utilization` leaves); the scheduler admits and preempts by those bytes
//! (`kv_estimate`, `kv_grown`), as on the CPU. A sequence owns a
//! slot from `open` to `close`; a decode step steps every slot (the decoder has no per-step
//! row selection), so a slot that is not decoding (free, or holding a prompt still being
//! prefilled) is fed the dummy token 0 and later truncated back to what it holds.
//!
//! Slot lengths on the host and on the device agree only after `begin_decode`; it runs
//! before a step whenever a prefill, a slot's truncation or a close changed a length. With
//! `SLOWFAST_SERVE_GRAPHS` not 0 (the default), the second step of an unchanged batch
//! captures the step as a CUDA graph, replayed from there until the next change. Greedy
//! steps (every row temperature 0 without penalties or logprobs) download the device's
//! argmax tokens only; other steps download the logits `[slots, vocab]` for the host
//! sampler, as `GpuSession` does.
use slowfast_cuda::{CudaError, GpuDecoder, GpuKvPolicy};
use slowfast_kv::sfi::trigger::Trigger;
use slowfast_kv::PolicyStats;

use super::{BatchDevice, SchedulerConfig, SpecTurn};
use crate::cuda::{
    gpu_policy, kv_options, load_decoder_with, open_context, step_triggers, trigger_of, GPU_CHUNK,
};
use crate::sampler::SamplerConfig;
use crate::session::PolicySpec;
use crate::spec::{DraftKind, Row, SpecOptions, SpecStats, Speculator, MAX_SPEC_TOKENS};
use crate::{EngineError, Loaded};

/// Dummy tokens a slot that is not decoding may gather before it is truncated back (each
/// truncation costs a `begin_decode` and a graph capture; each dummy token a little
/// attention).
const IDLE_SPAN: usize = 256;

fn gpu_err(e: CudaError) -> EngineError {
    EngineError::BadInput(format!("--device cuda: {e}"))
}

/// Whether decode steps replay CUDA graphs (`SLOWFAST_SERVE_GRAPHS=0` turns them off).
fn graphs_on() -> bool {
    std::env::var("SLOWFAST_SERVE_GRAPHS").map_or(true, |v| v.trim() != "0")
}

/// The KV page pool when `--kv-memory` is not given: `utilization` of the device's memory,
/// less what is in use after the weights, the activations and the policy's state were
/// allocated, less a workspace (attention partials, cuBLAS, CUDA graphs: 1 GiB, or 2 % of
/// the device).
fn auto_kv_memory(
    ctx: &std::sync::Arc<slowfast_cuda::CudaContext>,
    utilization: f64,
) -> Result<usize, EngineError> {
    super::check_gpu_memory_utilization(utilization)?;
    let (free, total) = ctx.mem_info().map_err(gpu_err)?;
    let used = total - free;
    let workspace = (1usize << 30).max(total / 50);
    let budget = (total as f64 * utilization) as usize;
    let kv = budget.saturating_sub(used + workspace);
    if kv == 0 {
        return Err(EngineError::BadInput(format!(
            "--gpu-memory-utilization {utilization}: {} MiB of the device's {} MiB leave no room for KV after the {} MiB in use and a {} MiB workspace (raise it, or give --kv-memory)",
            budget >> 20,
            total >> 20,
            used >> 20,
            workspace >> 20
        )));
    }
    Ok(kv)
}

pub(super) struct GpuDevice {
    dec: GpuDecoder,
    /// The decoder's policy (every sequence runs it).
    policy: GpuKvPolicy,
    name: &'static str,
    /// Per slot: owned by an open sequence.
    used: Vec<bool>,
    /// Per slot, when it is not decoding: the tokens that matter (a free slot: its one dummy
    /// token; a prompt being prefilled: its prefilled part, at least the dummy). Past them
    /// stand dummy tokens appended by decode steps.
    hold: Vec<usize>,
    /// Per slot: decoded at the last step.
    last_active: Vec<bool>,
    /// A slot length changed on the host since the last `begin_decode`.
    dirty: bool,
    /// Decode steps since the last `begin_decode`.
    since_begin: usize,
    graphs: bool,
    /// SFI: a slot longer than this without a memory gets a (bridge) refresh.
    dense_below: usize,
    /// FastKV's propagation rule (`TspRule`): a prompt is one part, prefilled by
    /// `GpuDecoder::prefill_fastkv` (as on the CPU, it shares no prefix).
    tsp: Option<crate::session::TspRule>,
    vocab: usize,
}

pub(super) struct GpuSeq {
    slot: usize,
    /// Prompt tokens prefilled so far.
    prefilled: usize,
    /// The row of the last step that downloaded logits (the prompt's last row; non-greedy
    /// decode steps). Empty after a greedy step.
    logits: Vec<f32>,
    /// The device's argmax of the last greedy decode step.
    argmax: Option<u32>,
    trigger: Option<Trigger>,
    stats: PolicyStats,
    /// Its drafter when it decodes speculatively (`spec_rounds`).
    spec: Option<Box<Speculator<'static>>>,
}

impl GpuDevice {
    pub fn new(
        loaded: &Loaded,
        cfg: &SchedulerConfig,
        policy: &PolicySpec,
    ) -> Result<Self, EngineError> {
        let gp = gpu_policy(policy)?;
        trigger_of(policy)?; // the server's own trigger must build
        let slots = cfg.max_batch;
        let ctx = open_context()?;
        let dims = (slots, cfg.max_context, GPU_CHUNK);
        let opts = kv_options(cfg.kv_dtype, true);
        let mut dec = load_decoder_with(ctx.clone(), &loaded.model, dims, opts)?;
        dec.set_policy(gp).map_err(gpu_err)?;
        // Every slot holds at least one token: decode steps step them all (a free slot's
        // dummy tokens go to the scratch page).
        for s in 0..slots {
            dec.release_slot(s).map_err(gpu_err)?;
        }
        // --kv-memory, at most what the device has room for.
        let room = auto_kv_memory(&ctx, cfg.gpu_memory_utilization)?;
        let limit = match cfg.kv_memory {
            0 => room,
            n if n > room => {
                eprintln!(
                    "slowfast serve: --kv-memory {n} is more than the device has room for; the KV pages get {room} bytes"
                );
                room
            }
            n => n,
        };
        dec.set_kv_limit(limit).map_err(gpu_err)?;
        // The prefix cache: whole prefill parts (GPU_CHUNK tokens), sharing the slots' pages.
        if cfg.prefix_cache_bytes > 0 {
            let pt = dec.page_tokens();
            if !gp.shares_prefix() {
                eprintln!(
                    "slowfast serve: no prefix cache under --policy {} (its scores sum the attention of every prompt row)",
                    policy.name()
                );
            } else if GPU_CHUNK.is_multiple_of(pt) {
                dec.enable_prefix_cache(GPU_CHUNK, cfg.prefix_cache_bytes.min(limit))
                    .map_err(gpu_err)?;
            } else {
                eprintln!(
                    "slowfast serve: no prefix cache on the GPU for this model (a KV page of {pt} tokens is more than a prefill part of {GPU_CHUNK})"
                );
            }
        }
        let dense_below = match gp {
            GpuKvPolicy::Sfi(_) => gp.dense_below(),
            _ => usize::MAX,
        };
        Ok(GpuDevice {
            vocab: dec.spec().vocab,
            dec,
            policy: gp,
            name: policy.name(),
            used: vec![false; slots],
            hold: vec![1; slots],
            last_active: vec![false; slots],
            dirty: true,
            since_begin: 0,
            graphs: graphs_on(),
            dense_below,
            tsp: crate::session::tsp_of(policy, &loaded.model),
        })
    }

    /// KV bytes the slots may hold together (the page pool's limit).
    pub fn kv_total(&self) -> usize {
        self.dec.kv_limit()
    }

    /// Drops the captured graph when slot lengths changed on the host (`begin_decode`),
    /// else brings the device's lengths up to the host's and keeps it (`resume_decode`).
    fn sync(&mut self) -> Result<(), EngineError> {
        if self.dirty {
            self.dec.begin_decode().map_err(gpu_err)?;
            self.dirty = false;
            self.since_begin = 0;
        } else {
            self.resume()?;
        }
        Ok(())
    }

    /// `resume_decode`, which re-begins (dropping nothing) when no graph was captured.
    fn resume(&mut self) -> Result<(), EngineError> {
        if !self.dec.has_graph() {
            self.since_begin = 0;
        }
        self.dec.resume_decode().map_err(gpu_err)
    }

    /// One decode step of every slot, captured as a graph from the second step after a
    /// `begin_decode` (as `decode` does).
    fn step_all(&mut self) -> Result<(), EngineError> {
        if self.since_begin == 1 && self.graphs && !self.dec.has_graph() {
            let _ = self.dec.capture_decode();
        }
        self.dec.decode_step().map_err(gpu_err)?;
        self.since_begin += 1;
        Ok(())
    }

    /// The batched draft–verify round of `turns` (see `spec_rounds`). Every slot steps, so
    /// the others (free, prefilling, or decoding plainly) are fed dummy tokens and rewound to
    /// what they held.
    fn spec_batch(
        &mut self,
        turns: &mut [SpecTurn<'_, GpuSeq>],
    ) -> Result<Vec<Result<Vec<u32>, EngineError>>, EngineError> {
        let n = self.used.len();
        let cap = self.dec.capacity();
        let mut is_turn = vec![false; n];
        turns.iter().for_each(|t| is_turn[t.seq.slot] = true);
        // What each slot holds: a turn's sequence its committed tokens (`hold`, kept up to
        // date by these rounds), a plain decoding sequence its length, the rest `hold`.
        let keep: Vec<usize> = (0..n)
            .map(|s| {
                if !is_turn[s] && self.last_active[s] {
                    self.dec.slot_len(s)
                } else {
                    self.hold[s].min(self.dec.slot_len(s))
                }
            })
            .collect();
        for (s, &k) in keep.iter().enumerate() {
            if self.dec.slot_len(s) != k {
                self.dec.rewind(s, k).map_err(gpu_err)?;
            }
        }
        // γ: each turn's own (`Speculator::plan`), the batch drafting as many steps as the
        // longest and verifying that many + 1 rows; no slot may outgrow the cache.
        let room = keep
            .iter()
            .map(|&k| cap.saturating_sub(k + 1))
            .min()
            .unwrap_or(0);
        let mut gammas = Vec::with_capacity(turns.len());
        for t in turns.iter_mut() {
            let spec = t.seq.spec.as_mut().ok_or_else(|| {
                EngineError::BadInput("a speculative round of a sequence without a drafter".into())
            })?;
            let g = spec
                .plan(keep[t.seq.slot], cap, MAX_SPEC_TOKENS + 1, t.max_out)?
                .min(room);
            spec.begin_drafts(g, t.sampler);
            gammas.push(g);
        }
        let sampled = turns.iter().any(|t| !t.greedy);
        let t_draft = std::time::Instant::now();
        // Self-drafters (sfi, streaming): the decoder's own sparse steps, every slot at once.
        let steps = turns
            .iter()
            .zip(&gammas)
            .filter(|(t, _)| t.seq.spec.as_ref().is_some_and(|s| s.drafts_on_target()))
            .map(|(_, &g)| g)
            .max()
            .unwrap_or(0);
        if steps > 0 {
            let mut next = vec![0u32; n];
            turns.iter().for_each(|t| next[t.seq.slot] = t.t0);
            self.dec.set_next(&next).map_err(gpu_err)?;
            self.sync()?;
            for k in 0..steps {
                self.step_all()?;
                let argmax = self.dec.next_tokens().map_err(gpu_err)?;
                let logits = if sampled {
                    self.dec.logits().map_err(gpu_err)?
                } else {
                    Vec::new()
                };
                let mut resample = false;
                let v = self.vocab;
                for (t, &g) in turns.iter_mut().zip(&gammas) {
                    let slot = t.seq.slot;
                    let spec = t.seq.spec.as_mut().expect("checked above");
                    if !spec.drafts_on_target() || k >= g {
                        continue;
                    }
                    let row = if t.greedy {
                        Row::Argmax(argmax[slot])
                    } else {
                        Row::Logits(&logits[slot * v..(slot + 1) * v])
                    };
                    let tok = spec.draft_row(row)?;
                    resample |= tok != argmax[slot];
                    next[slot] = tok;
                    let st = &mut t.seq.stats;
                    st.fast_steps += 1;
                    st.attended_tokens += self.dec.attended(slot) as f64;
                    st.dense_tokens += (keep[slot] + k + 1) as f64;
                }
                if resample && k + 1 < steps {
                    // The step left each slot's argmax as its next token; sampled drafts
                    // replace theirs.
                    for s in (0..n).filter(|&s| !is_turn[s]) {
                        next[s] = argmax[s];
                    }
                    self.dec.set_next(&next).map_err(gpu_err)?;
                }
            }
            for (s, &k) in keep.iter().enumerate() {
                self.dec.rewind(s, k).map_err(gpu_err)?;
            }
        }
        let draft_s = t_draft.elapsed().as_secs_f64();
        // One verification of every slot: the pending token and the drafts (padded to the
        // longest), dense over the whole cache; SFI's row 0 leaves its scores for a refresh.
        let t_verify = std::time::Instant::now();
        let rows = turns
            .iter()
            .map(|t| t.seq.spec.as_ref().map_or(0, |s| s.drafts().len()))
            .max()
            .unwrap_or(0)
            + 1;
        let mut toks = vec![0u32; n * rows];
        let mut capture = vec![false; n];
        for t in turns.iter() {
            let slot = t.seq.slot;
            let d = t.seq.spec.as_ref().expect("checked above").drafts();
            let row = &mut toks[slot * rows..(slot + 1) * rows];
            row[0] = t.t0;
            row[1..=d.len()].copy_from_slice(d);
            let last = row[d.len()];
            row[d.len() + 1..].iter_mut().for_each(|x| *x = last);
            capture[slot] = t.seq.trigger.is_some();
        }
        self.dec.verify(&toks, rows, &capture).map_err(gpu_err)?;
        let argmax = self.dec.verify_argmax().map_err(gpu_err)?;
        let logits = if sampled {
            self.dec.verify_logits().map_err(gpu_err)?
        } else {
            Vec::new()
        };
        let v = self.vocab;
        let mut out = Vec::with_capacity(turns.len());
        let mut fired = Vec::new();
        for t in turns.iter_mut() {
            let slot = t.seq.slot;
            let spec = t.seq.spec.as_mut().expect("checked above");
            let base = slot * rows;
            let greedy = t.greedy;
            let row = |i: usize| {
                if greedy {
                    Row::Argmax(argmax[base + i])
                } else {
                    Row::Logits(&logits[(base + i) * v..(base + i + 1) * v])
                }
            };
            let got = match spec.accept(&row, t.sampler) {
                Ok(o) => o,
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            let accepted = got.len() - 1;
            let len = keep[slot] + accepted + 1;
            self.dec.rewind(slot, len).map_err(gpu_err)?;
            self.hold[slot] = len;
            // SFI: the verification is the slow step; the Selector runs from it on every
            // verification (`refresh: every`) or when the trigger fires on the kept tokens.
            if let Some(tr) = t.seq.trigger.as_mut() {
                let mut fire = spec.options().refresh_every;
                fire |= tr.on_token(t.t0);
                for &tok in &spec.drafts()[..accepted] {
                    fire |= tr.on_token(tok);
                }
                if fire {
                    fired.push(slot);
                    tr.reset_after_refresh();
                }
            }
            let st = &mut t.seq.stats;
            st.slow_steps += 1;
            st.attended_tokens += (keep[slot] + 1) as f64;
            st.dense_tokens += (keep[slot] + 1) as f64;
            out.push(Ok(got));
        }
        for (s, &k) in keep.iter().enumerate().filter(|&(s, _)| !is_turn[s]) {
            self.dec.rewind(s, k).map_err(gpu_err)?;
        }
        if !fired.is_empty() {
            self.dec.refresh_from_verify(&fired).map_err(gpu_err)?;
        }
        self.resume()?;
        let verify_s = t_verify.elapsed().as_secs_f64();
        // Every sequence of the batch waited for the whole round: its cost, for adaptive γ.
        let mut res = Vec::with_capacity(turns.len());
        for (t, o) in turns.iter_mut().zip(out) {
            let len = self.hold[t.seq.slot];
            let spec = t.seq.spec.as_mut().expect("checked above");
            res.push(o.map(|got| spec.finish_round(got, len, draft_s, verify_s, t.max_out)));
        }
        Ok(res)
    }

    /// Shortens `slot` to `len` tokens (at least one: a dummy when `len` is 0).
    fn cut(&mut self, slot: usize, len: usize) -> Result<(), EngineError> {
        if self.dec.slot_len(slot) != len {
            self.dirty = true;
        }
        self.dec.truncate(slot, len).map_err(gpu_err)?;
        if len == 0 {
            self.dec.prefill(slot, &[0], false).map_err(gpu_err)?;
        }
        Ok(())
    }
}

impl BatchDevice for GpuDevice {
    type Seq = GpuSeq;

    /// The pages of `len` tokens and of the dummy tokens a prefilling slot may gather (the
    /// same count as `kv_grown`, so a sequence admitted is not preempted at its first step).
    fn kv_estimate(&self, _policy: &PolicySpec, _capacity: usize, len: usize) -> usize {
        self.dec.kv_bytes_for(len + IDLE_SPAN)
    }

    /// The pages `seq` holds, or those it needs for `extra` more tokens and the dummy tokens
    /// a decode step may append meanwhile (a prefilling slot gathers up to `IDLE_SPAN`): the
    /// decoder maps them at the step, so the scheduler must have counted them.
    fn kv_grown(&self, seq: &GpuSeq, extra: usize) -> usize {
        let len = self.dec.slot_len(seq.slot).max(seq.prefilled);
        self.dec.slot_kv_bytes(seq.slot) + self.dec.kv_bytes_more(seq.slot, len + extra + IDLE_SPAN)
    }

    /// Maps the cached pages of the prompt's leading whole parts (not its last) into the
    /// fresh sequence's slot; returns the parts skipped.
    fn reuse_prefix(&mut self, seq: &mut GpuSeq, prompt: &[u32], plan: &[(usize, usize)]) -> usize {
        let Some(block) = self.dec.prefix_block() else {
            return 0;
        };
        let whole = crate::prefix::whole_chunks(plan, block);
        if whole == 0 || seq.prefilled != 0 {
            return 0;
        }
        match self.dec.adopt_prefix(seq.slot, prompt, whole) {
            Ok(0) => 0, // the slot keeps its dummy token until its first part
            Ok(n) => {
                self.dirty = true;
                seq.prefilled = n;
                self.hold[seq.slot] = n;
                n / block
            }
            Err(e) => {
                eprintln!("prefix cache: adopting failed ({e}); prefilling the whole prompt");
                self.dirty = true;
                let _ = self.dec.release_slot(seq.slot);
                0
            }
        }
    }

    fn prefix_bytes(&self) -> usize {
        self.dec.prefix_cache_bytes()
    }

    fn open(&mut self, policy: &PolicySpec, capacity: usize) -> Result<GpuSeq, EngineError> {
        if policy.name() != self.name {
            return Err(EngineError::BadInput(format!(
                "on --device cuda every request runs the server's --policy {}; got {}",
                self.name,
                policy.name()
            )));
        }
        let gp = gpu_policy(policy)?;
        if gp != self.policy {
            let (want, got) = (
                GpuKvPolicy::describe(&self.policy),
                GpuKvPolicy::describe(&gp),
            );
            let what = if want == got {
                "its Selector settings differ".to_owned()
            } else {
                got
            };
            return Err(EngineError::BadInput(format!(
                "on --device cuda every request runs the server's --policy {} as the server sized it ({want}); got {what} (per-request KV sizes do not run on the GPU; a fractional --kv-budget resolves per request: give it in tokens)",
                self.name
            )));
        }
        if capacity > self.dec.capacity() {
            return Err(EngineError::BadInput(format!(
                "the request needs {capacity} tokens but a GPU slot holds {} (--max-context)",
                self.dec.capacity()
            )));
        }
        let trigger = trigger_of(policy)?;
        let slot = self
            .used
            .iter()
            .position(|u| !u)
            .ok_or_else(|| EngineError::BadInput("every GPU slot is in use".into()))?;
        // The slot keeps its dummy tokens until its first prefill part (a decode step of the
        // other slots may come first, and no slot may be empty then).
        self.used[slot] = true;
        self.hold[slot] = 1;
        Ok(GpuSeq {
            slot,
            prefilled: 0,
            logits: Vec::new(),
            argmax: None,
            trigger,
            stats: PolicyStats::default(),
            spec: None,
        })
    }

    /// Parts of at most `GPU_CHUNK` tokens, as `GpuDecoder::prefill` splits one call (SFI's
    /// bootstrap rows taken into the last part), so the slot ends as one call would leave it;
    /// FastKV's token-selective prefill is one part.
    fn prefill_plan(&self, _seq: &GpuSeq, n: usize) -> Vec<(usize, usize)> {
        match self.tsp {
            Some(_) => vec![(0, n)],
            None => self.dec.prefill_bounds(n),
        }
    }

    fn prefill_part(
        &mut self,
        seq: &mut GpuSeq,
        prompt: &[u32],
        plan: &[(usize, usize)],
        i: usize,
    ) -> Result<(), EngineError> {
        let (a, b) = plan[i];
        debug_assert_eq!(a, seq.prefilled);
        let slot = seq.slot;
        // Drops the dummy tokens decode steps appended since the last part (the first part:
        // the free slot's dummy); SFI forgets the slot's memory, rebuilt by the bootstrap.
        self.dec.truncate(slot, a).map_err(gpu_err)?;
        self.dirty = true;
        let refreshes = self.dec.step_counts().2;
        match self.tsp {
            Some(rule) if a == 0 => {
                let tsp = crate::cuda::tsp_args(&rule, b);
                self.dec
                    .prefill_fastkv(slot, &prompt[..b], &tsp)
                    .map_err(gpu_err)?;
            }
            _ => {
                self.dec
                    .prefill(slot, &prompt[a..b], false)
                    .map_err(gpu_err)?;
            }
        }
        seq.prefilled = b;
        self.hold[slot] = b;
        // Whole parts before the last go to the prefix cache.
        if let Some(block) = self.dec.prefix_block() {
            if i < crate::prefix::whole_chunks(plan, block) {
                self.dec.cache_prefix(slot, prompt, i + 1);
            }
        }
        if let Some(t) = seq.trigger.as_mut() {
            if self.dec.step_counts().2 > refreshes {
                t.reset_after_refresh(); // the bootstrap
            }
        }
        seq.argmax = None;
        if i + 1 == plan.len() {
            // The prompt is whole: pages no attention path reads again go back to the pool
            // (SnapKV's compacted prompt, rows behind sliding windows; paged KV only).
            self.dec.give_back_unread_kv(slot).map_err(gpu_err)?;
            // The prompt's last row is row `slot` (the decoder downloads every row).
            let all = self.dec.logits().map_err(gpu_err)?;
            let v = self.vocab;
            seq.logits.clear();
            seq.logits.extend_from_slice(&all[slot * v..(slot + 1) * v]);
        }
        Ok(())
    }

    fn decode(
        &mut self,
        seqs: &mut [&mut GpuSeq],
        tokens: &[u32],
        greedy: bool,
    ) -> Result<(), EngineError> {
        let n = self.used.len();
        let mut active = vec![false; n];
        let mut next = vec![0u32; n];
        for (s, &t) in seqs.iter().zip(tokens) {
            active[s.slot] = true;
            next[s.slot] = t;
        }
        if active != self.last_active {
            self.dirty = true;
        }
        // Slots that are not decoding go back to what they hold before their dummy tokens
        // could fill them, grow long, or (SFI) need a memory; free ones whenever the decoder
        // is re-begun anyway.
        let cap = self.dec.capacity();
        let must = |d: &Self, s: usize| {
            let (len, hold) = (d.dec.slot_len(s), d.hold[s]);
            len > hold
                && (len + 1 >= cap
                    || len + 1 - hold >= IDLE_SPAN
                    || (len + 1 > d.dense_below && hold < d.dense_below))
        };
        if (0..n).any(|s| !active[s] && must(self, s)) {
            self.dirty = true;
        }
        if self.dirty {
            for (s, &on) in active.iter().enumerate() {
                let cut =
                    !on && self.dec.slot_len(s) > self.hold[s] && (!self.used[s] || must(self, s));
                if cut {
                    self.cut(s, self.hold[s])?;
                }
            }
        }
        self.dec.set_next(&next).map_err(gpu_err)?;
        // SFI: each sequence's trigger runs on the token fed (as `GpuSession::step`), and
        // sequences past their min gap ride a slow step that runs anyway (`step_triggers`).
        let mut trig: Vec<_> = (seqs.iter_mut().zip(tokens))
            .map(|(s, &t)| (s.slot, s.trigger.as_mut(), t))
            .collect();
        let fired = step_triggers(&mut self.dec, &mut trig).map_err(gpu_err)?;
        if self.dirty {
            self.dec.begin_decode().map_err(gpu_err)?;
            self.dirty = false;
            self.since_begin = 0;
        } else if self.since_begin == 1 && self.graphs {
            // The second step of an unchanged batch: from here on steps replay it as one CUDA
            // graph (plain launches if capture fails) until the next `begin_decode` drops it.
            // Captured only once a batch outlives its first step (the first sized the
            // attention workspace), so a batch changing every step captures nothing.
            let _ = self.dec.capture_decode();
        }
        let lens: Vec<usize> = seqs.iter().map(|s| self.dec.slot_len(s.slot) + 1).collect();
        self.dec.decode_step().map_err(gpu_err)?;
        self.last_active = active;
        let sparse = self.policy != GpuKvPolicy::Full;
        let refreshed = self.dec.last_refreshed();
        for ((s, f), &len) in seqs.iter_mut().zip(&fired).zip(&lens) {
            // Full KV: every step is dense (slow, as the CPU's FullPolicy counts it).
            let slow = !sparse || refreshed.contains(&s.slot);
            if let Some(t) = s.trigger.as_mut().filter(|_| slow && !f) {
                t.reset_after_refresh(); // a refresh the trigger did not ask for (the bridge)
            }
            let st = &mut s.stats;
            if slow {
                st.slow_steps += 1;
                st.attended_tokens += len as f64;
            } else {
                st.fast_steps += 1;
                st.attended_tokens += self.dec.attended(s.slot) as f64;
            }
            st.dense_tokens += len as f64;
        }
        self.since_begin += 1;
        if greedy {
            // The step left each slot's argmax as its next token: a few bytes to download.
            let toks = self.dec.next_tokens().map_err(gpu_err)?;
            for s in seqs.iter_mut() {
                s.argmax = Some(toks[s.slot]);
                s.logits.clear();
            }
        } else {
            let all = self.dec.logits().map_err(gpu_err)?;
            let v = self.vocab;
            for s in seqs.iter_mut() {
                s.argmax = None;
                s.logits.clear();
                s.logits
                    .extend_from_slice(&all[s.slot * v..(s.slot + 1) * v]);
            }
        }
        Ok(())
    }

    fn logits<'a>(&'a self, seq: &'a GpuSeq) -> &'a [f32] {
        &seq.logits
    }

    fn argmax(&self, seq: &GpuSeq) -> Option<u32> {
        seq.argmax
    }

    fn kv_bytes(&self, seq: &GpuSeq) -> usize {
        self.dec.slot_kv_bytes(seq.slot)
    }

    fn stats(&self, seq: &GpuSeq) -> PolicyStats {
        seq.stats.clone()
    }

    fn policy_name(&self, _seq: &GpuSeq) -> &'static str {
        self.name
    }

    fn spec_attach(
        &mut self,
        seq: &mut GpuSeq,
        opts: &SpecOptions,
        prompt: &[u32],
        sampler: &SamplerConfig,
    ) -> Result<(), EngineError> {
        // The decoder's one policy drafts (sfi, streaming) or is full KV (ngram).
        let want = match opts.drafter {
            DraftKind::Ngram => "full",
            DraftKind::Model => {
                return Err(EngineError::BadInput(
                    "speculate: the model drafter runs on the CPU only (serve --device cpu --draft-model)"
                        .into(),
                ))
            }
            d => d.name(),
        };
        if want != self.name {
            return Err(EngineError::BadInput(format!(
                "speculate.drafter `{}` needs the {want} policy, but this GPU server runs {} in every slot (serve --device cuda --policy {want})",
                opts.drafter.name(),
                self.name
            )));
        }
        let spec = Speculator::batched(prompt, opts.clone(), sampler, self.vocab)?;
        seq.spec = Some(Box::new(spec));
        Ok(())
    }

    /// Every turn in one round: the self-drafters' steps batched over the slots, one
    /// verification of all slots, per-sequence accept lengths.
    fn spec_rounds(
        &mut self,
        turns: &mut [SpecTurn<'_, GpuSeq>],
    ) -> Vec<Result<Vec<u32>, EngineError>> {
        match self.spec_batch(turns) {
            Ok(r) => r,
            // A failed batched round fails every sequence in it.
            Err(e) => turns
                .iter()
                .map(|_| Err(EngineError::BadInput(e.to_string())))
                .collect(),
        }
    }

    fn spec_stats(&self, seq: &GpuSeq) -> Option<SpecStats> {
        seq.spec.as_ref().map(|s| s.stats().clone())
    }

    fn close(&mut self, seq: GpuSeq) {
        let s = seq.slot;
        self.used[s] = false;
        self.hold[s] = 1;
        // Its pages back to the pool, one dummy token on the scratch page (an error here
        // shows at the next step).
        let _ = self.dec.release_slot(s);
        self.dirty = true;
    }
}
