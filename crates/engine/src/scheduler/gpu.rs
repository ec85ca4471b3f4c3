//! The scheduler's GPU device (feature `cuda`): one `GpuDecoder` with `max_batch` slots of
//! `max_context` tokens, every slot running the server's one KV policy. A sequence owns a
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

use super::{BatchDevice, SchedulerConfig};
use crate::cuda::{gpu_policy, load_decoder, open_context, GPU_CHUNK};
use crate::session::PolicySpec;
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

/// The sizes of a GPU policy, for messages.
fn describe(p: &GpuKvPolicy) -> String {
    match p {
        GpuKvPolicy::Full => "full KV".into(),
        GpuKvPolicy::Streaming { sinks, recent } => format!("{sinks} sinks + {recent} recent"),
        GpuKvPolicy::Sfi(c) => format!(
            "{} sinks + {} selected + {} recent (page {}, {} bootstrap rows)",
            c.sinks, c.selected, c.recent, c.page, c.bootstrap_rows
        ),
    }
}

/// SFI's sentence trigger of a sequence (host-side, on its generated tokens).
fn trigger_of(policy: &PolicySpec) -> Result<Option<Trigger>, EngineError> {
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
    /// KV bytes reported per sequence (the preallocated cache over the slots).
    share: usize,
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
        let mut dec = load_decoder(ctx, &loaded.model, slots, cfg.max_context, GPU_CHUNK)?;
        dec.set_policy(gp).map_err(gpu_err)?;
        // Every slot holds at least one token: decode steps step them all.
        for s in 0..slots {
            dec.prefill(s, &[0], false).map_err(gpu_err)?;
        }
        let dense_below = match gp {
            GpuKvPolicy::Sfi(_) => gp.dense_below(),
            _ => usize::MAX,
        };
        Ok(GpuDevice {
            share: dec.kv_bytes() / slots,
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
        })
    }

    /// KV bytes of the decoder's cache (all slots).
    pub fn kv_total(&self) -> usize {
        self.share * self.used.len()
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

    fn kv_estimate(&self, _policy: &PolicySpec, _capacity: usize) -> usize {
        0 // preallocated: the slot count bounds the batch
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
            let (want, got) = (describe(&self.policy), describe(&gp));
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
        })
    }

    /// Parts of at most `GPU_CHUNK` tokens, as `GpuDecoder::prefill` splits one call (SFI's
    /// bootstrap rows taken into the last part), so the slot ends as one call would leave it.
    fn prefill_plan(&self, _seq: &GpuSeq, n: usize) -> Vec<(usize, usize)> {
        self.dec.prefill_bounds(n)
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
        self.dec
            .prefill(slot, &prompt[a..b], false)
            .map_err(gpu_err)?;
        seq.prefilled = b;
        self.hold[slot] = b;
        if let Some(t) = seq.trigger.as_mut() {
            if self.dec.step_counts().2 > refreshes {
                t.reset_after_refresh(); // the bootstrap
            }
        }
        seq.argmax = None;
        if i + 1 == plan.len() {
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
        // SFI: each sequence's trigger runs on the token fed (as `GpuSession::step`).
        let mut fired = vec![false; seqs.len()];
        for ((s, &t), f) in seqs.iter_mut().zip(tokens).zip(fired.iter_mut()) {
            *f = s.trigger.as_mut().is_some_and(|tr| tr.on_token(t));
            if *f {
                self.dec.request_refresh(s.slot).map_err(gpu_err)?;
            }
        }
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

    fn kv_bytes(&self, _seq: &GpuSeq) -> usize {
        self.share
    }

    fn stats(&self, seq: &GpuSeq) -> PolicyStats {
        seq.stats.clone()
    }

    fn policy_name(&self, _seq: &GpuSeq) -> &'static str {
        self.name
    }

    fn close(&mut self, seq: GpuSeq) {
        let s = seq.slot;
        self.used[s] = false;
        self.hold[s] = 1;
        // Back to one dummy token (an error here shows at the next step).
        let len = self.dec.slot_len(s);
        let _ = self.cut(s, len.min(1));
        self.dirty = true;
    }
}
