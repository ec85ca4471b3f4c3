//! The serving scheduler: continuous batching of many requests over one model. Requests join
//! the running batch at step boundaries and leave it the step they finish; long prompts are
//! prefilled in chunks under a per-step token budget between decode steps; a request whose
//! client went away is dropped within one step; the waiting queue is bounded. It owns the
//! sequences (their KV, samplers, stop matchers), never HTTP: events go to an [`EventSink`].
//!
//! KV memory: a sequence holds what its tokens need so far (the CPU's stores grow on demand).
//! A request is admitted when the KV its prompt needs fits beside the running ones; when the
//! running sequences' next tokens would not fit, the newest one is preempted (its KV freed,
//! it goes back to the front of the queue) and resumed later by prefilling its prompt and
//! the tokens it generated again (recompute). The oldest sequence always goes on, so every
//! request that fits alone finishes.
//!
//! The device part (how a sequence is prefilled and how a batch is stepped) is the
//! [`BatchDevice`] trait: the CPU's batched decode (`cpu.rs`), the GPU decoder's slots
//! (`gpu.rs`, feature `cuda`).
mod channel;
mod cpu;
#[cfg(feature = "cuda")]
mod gpu;
mod inspect;
mod sequence;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use slowfast_kv::PolicyStats;

use crate::sampler::{Sampler, SamplerConfig};
use crate::session::PolicySpec;
use crate::spec::{SpecOptions, SpecStats};
use crate::{Device, EngineError, KvDtype, Loaded};
pub use channel::{collect, ChannelSink, Outcome};
pub use cpu::kv_bytes_for;
pub use inspect::{Inspection, LayerHeld};
use sequence::{SeqState, Sequence};

/// One generation request, tokenized and validated by the caller.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (the scheduler also stops at the model's context).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Keep going past EOS tokens.
    pub ignore_eos: bool,
    /// Tokens that end the sequence besides the tokenizer's EOS (a chat template's end of
    /// turn); also ignored with `ignore_eos`.
    pub stop_tokens: Vec<u32>,
    /// The KV policy of this sequence (resolved for `prompt + max_tokens` tokens).
    pub policy: PolicySpec,
    /// Log-probabilities: None = off; Some(n) = the chosen token's and the `n` most likely.
    pub logprobs: Option<usize>,
    /// Speculative decoding of this sequence (CPU; lossless): its own draft–verify rounds
    /// instead of a row of the batched step. `policy` is then the drafter's (sfi, streaming)
    /// or full KV.
    pub speculate: Option<SpecOptions>,
    /// Attach an [`Inspection`] of the sequence's KV to its `Finish` (CPU only).
    pub inspect: bool,
}

impl Request {
    /// A greedy request that ignores EOS (so it runs exactly `max_tokens` unless the context
    /// ends first), with no stop strings and no logprobs: what tests and load runs send.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize, policy: PolicySpec) -> Self {
        Request {
            prompt,
            max_tokens,
            sampler: SamplerConfig::greedy(),
            stop: Vec::new(),
            ignore_eos: true,
            stop_tokens: Vec::new(),
            policy,
            logprobs: None,
            speculate: None,
            inspect: false,
        }
    }
}

/// The log-probability of one generated token and of the most likely alternatives, from the
/// model's distribution (log-softmax of the raw logits, before penalties and filters).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// (token id, log-probability), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One generated token.
#[derive(Debug, Clone)]
pub struct TokenOut {
    pub id: u32,
    /// Text that became safe to send with this token (may be empty: held back as the possible
    /// start of a stop string or of a multi-byte character).
    pub text: String,
    pub logprob: Option<TokenLogprob>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
}

/// The end of a sequence.
#[derive(Debug, Clone)]
pub struct Finish {
    pub reason: FinishReason,
    /// Text held back until the end (flushed now; never a stop string).
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub policy: String,
    pub stats: PolicyStats,
    /// What the policy held at the end and its slow steps, when the request asked for it
    /// (`Request::inspect`) and the device can tell (the CPU).
    pub inspection: Option<Box<Inspection>>,
}

/// What the scheduler tells a request's owner.
#[derive(Debug, Clone)]
pub enum Event {
    Token(TokenOut),
    Done(Finish),
    /// The request failed (bad policy for this prompt, a model error); nothing follows.
    Error(String),
}

/// Where a request's events go. `send` returns false once the receiver is gone; a closed sink
/// cancels its request at the next step.
pub trait EventSink: Send {
    fn send(&self, ev: Event) -> bool;
    fn is_closed(&self) -> bool;
}

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub device: Device,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Requests waiting for a place beyond the running ones; past it `submit` refuses.
    pub max_queue: usize,
    /// Prompt tokens prefilled per scheduler step (at least one chunk always runs, so a
    /// prompt makes progress).
    pub prefill_tokens_per_step: usize,
    /// Tokens per prefill chunk.
    pub chunk: usize,
    pub kv_dtype: KvDtype,
    /// KV bytes all running sequences may hold together: a request waits until its prompt's
    /// KV fits, and running sequences are preempted (recomputed later) rather than exceed it.
    pub kv_memory: usize,
    /// Reserve each request's whole KV (prompt + max_tokens) at admission instead: fewer
    /// sequences run together, none is ever preempted.
    pub kv_reserve: bool,
    /// GPU, when `kv_memory` is 0: the fraction of the device's memory the server may use;
    /// the KV page pool is what is left of it after the weights, the policy's state and a
    /// workspace.
    pub gpu_memory_utilization: f64,
    /// Longest sequence (prompt + generated) a request may have.
    pub max_context: usize,
    /// The server's default KV policy (resolved for `max_context`). On the GPU it is the
    /// decoder's one policy: every request must run it.
    pub default_policy: PolicySpec,
    /// The draft model of speculative requests with the `model` drafter (same vocabulary,
    /// checked at spawn).
    pub draft: Option<Arc<Loaded>>,
    /// Prefix cache (CPU): KV bytes it may hold (0: off), in blocks of `prefix_block` tokens
    /// (a divisor of `chunk`).
    pub prefix_cache_bytes: usize,
    pub prefix_block: usize,
}

/// Live counters, read by the server's `/metrics`.
#[derive(Debug, Default)]
pub struct Gauges {
    pub running: AtomicUsize,
    pub queued: AtomicUsize,
    pub kv_bytes_in_use: AtomicUsize,
    pub kv_bytes_capacity: AtomicUsize,
    pub slow_steps: AtomicU64,
    pub fast_steps: AtomicU64,
    /// Scheduler iterations that ran a decode step, and the rows they decoded.
    pub decode_steps: AtomicU64,
    pub decode_rows: AtomicU64,
    pub prefill_tokens: AtomicU64,
    /// Sequences preempted for lack of KV memory (each prefilled again later).
    pub preemptions: AtomicU64,
    /// Prompt tokens restored from the prefix cache instead of prefilled, and the bytes the
    /// cache holds.
    pub prefix_hit_tokens: AtomicU64,
    pub prefix_cache_bytes: AtomicUsize,
    /// Speculative decoding: tokens drafted, drafts accepted, verification passes.
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub spec_verifications: AtomicU64,
}

/// Why `submit` refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the scheduler has stopped")]
    Stopped,
}

struct Submission {
    req: Request,
    sink: Box<dyn EventSink>,
}

/// A request waiting for a place: new, or preempted and waiting to be resumed.
enum Waiting {
    New(Box<Submission>),
    Resume(Box<SeqState>),
}

impl Waiting {
    fn is_closed(&self) -> bool {
        match self {
            Waiting::New(s) => s.sink.is_closed(),
            Waiting::Resume(st) => st.sink.is_closed(),
        }
    }
}

/// The handle through which requests reach the scheduler thread (cheap to clone).
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: Sender<Submission>,
    gauges: Arc<Gauges>,
    max_queue: usize,
}

impl SchedulerHandle {
    /// Queues a request; its events go to `sink`. Refused when `max_queue` requests wait.
    pub fn submit(&self, req: Request, sink: Box<dyn EventSink>) -> Result<(), SubmitError> {
        let q = &self.gauges.queued;
        let mut cur = q.load(Ordering::Relaxed);
        loop {
            if cur >= self.max_queue {
                return Err(SubmitError::QueueFull(cur));
            }
            match q.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.tx.send(Submission { req, sink }).map_err(|_| {
            q.fetch_sub(1, Ordering::AcqRel);
            SubmitError::Stopped
        })
    }

    pub fn gauges(&self) -> &Arc<Gauges> {
        &self.gauges
    }
}

/// `--gpu-memory-utilization` must be a fraction in (0, 1].
pub fn check_gpu_memory_utilization(u: f64) -> Result<(), EngineError> {
    if u > 0.0 && u <= 1.0 {
        Ok(())
    } else {
        Err(EngineError::BadInput(format!(
            "--gpu-memory-utilization must be a fraction in (0, 1], not {u}"
        )))
    }
}

/// What the scheduler needs from a device: open a sequence (allocating its KV), prefill it
/// part by part, and step many sequences' next tokens together.
pub(crate) trait BatchDevice {
    type Seq;
    /// KV bytes a sequence opened for `capacity` tokens under `policy` holds once its first
    /// `len` tokens are written.
    fn kv_estimate(&self, policy: &PolicySpec, capacity: usize, len: usize) -> usize;
    /// KV bytes `seq` will hold once `extra` more tokens are written (devices that allocate
    /// up front: what it holds now).
    fn kv_grown(&self, seq: &Self::Seq, _extra: usize) -> usize {
        self.kv_bytes(seq)
    }
    /// A sequence able to hold `capacity` tokens under `policy`.
    fn open(&mut self, policy: &PolicySpec, capacity: usize) -> Result<Self::Seq, EngineError>;
    /// The prefill parts of a prompt of `n` tokens (`[a, b)` bounds, run in order).
    fn prefill_plan(&self, seq: &Self::Seq, n: usize) -> Vec<(usize, usize)>;
    /// Restores the leading parts of `plan` from a prefix cache into the fresh `seq`;
    /// returns the parts restored (0: none; devices without a cache).
    fn reuse_prefix(
        &mut self,
        _seq: &mut Self::Seq,
        _prompt: &[u32],
        _plan: &[(usize, usize)],
    ) -> usize {
        0
    }
    /// Bytes the prefix cache holds.
    fn prefix_bytes(&self) -> usize {
        0
    }
    /// Runs part `i` of `plan`; after the last one `logits(seq)` is the prompt's last row.
    fn prefill_part(
        &mut self,
        seq: &mut Self::Seq,
        prompt: &[u32],
        plan: &[(usize, usize)],
        i: usize,
    ) -> Result<(), EngineError>;
    /// Feeds `tokens[i]` to `seqs[i]`, all in one step; then `logits(seqs[i])` is its row.
    /// `greedy`: every row takes the argmax of its logits (temperature 0, no penalties, no
    /// logprobs), so a device may give `argmax(seqs[i])` instead of the logits.
    fn decode(
        &mut self,
        seqs: &mut [&mut Self::Seq],
        tokens: &[u32],
        greedy: bool,
    ) -> Result<(), EngineError>;
    fn logits<'a>(&'a self, seq: &'a Self::Seq) -> &'a [f32];
    /// The argmax of the sequence's last decode row when the device computed it (a greedy
    /// step); then `logits` may be empty. None: sample from `logits`.
    fn argmax(&self, _seq: &Self::Seq) -> Option<u32> {
        None
    }
    fn kv_bytes(&self, seq: &Self::Seq) -> usize;
    fn stats(&self, seq: &Self::Seq) -> PolicyStats;
    fn policy_name(&self, seq: &Self::Seq) -> &'static str;
    /// Frees the sequence's KV.
    fn close(&mut self, seq: Self::Seq);
    /// Speculative decoding: give a just-opened sequence for `prompt` its drafter. Devices
    /// without it refuse.
    fn spec_attach(
        &mut self,
        _seq: &mut Self::Seq,
        _opts: &SpecOptions,
        _prompt: &[u32],
        _sampler: &SamplerConfig,
    ) -> Result<(), EngineError> {
        Err(EngineError::BadInput(
            "speculative decoding does not run on this device".into(),
        ))
    }
    /// Draft–verify rounds of speculative sequences, one per turn (see `Speculator::round`):
    /// each turn's new tokens, already recorded in its sampler. The CPU runs one sequence
    /// after the other; the GPU drafts and verifies them all in one batched pass.
    fn spec_rounds(
        &mut self,
        turns: &mut [SpecTurn<'_, Self::Seq>],
    ) -> Vec<Result<Vec<u32>, EngineError>> {
        turns
            .iter()
            .map(|_| {
                Err(EngineError::BadInput(
                    "speculative decoding does not run on this device".into(),
                ))
            })
            .collect()
    }
    /// The sequence's speculative counters (None without a drafter).
    fn spec_stats(&self, _seq: &Self::Seq) -> Option<SpecStats> {
        None
    }
    /// What the sequence's policy holds now, layer by layer, and its slow steps (None where
    /// the device cannot tell).
    fn inspect(&self, _seq: &Self::Seq) -> Option<Inspection> {
        None
    }
}

/// One speculative sequence's part of `BatchDevice::spec_rounds`.
pub struct SpecTurn<'a, S> {
    pub seq: &'a mut S,
    /// The pending token (sampled, recorded in `sampler`, not yet in the cache).
    pub t0: u32,
    pub sampler: &'a mut Sampler,
    /// Most tokens the round may return.
    pub max_out: usize,
    /// Temperature 0 without penalties: the device's argmax of a row is its distribution.
    pub greedy: bool,
}

/// Starts the scheduler thread over `loaded`; the thread ends when every handle is dropped
/// and nothing is left to run.
pub fn spawn(
    loaded: Arc<Loaded>,
    cfg: SchedulerConfig,
) -> Result<(SchedulerHandle, std::thread::JoinHandle<()>), EngineError> {
    if cfg.max_batch == 0 || cfg.chunk == 0 || cfg.max_context == 0 {
        return Err(EngineError::BadInput(
            "--max-batch, --chunk and --max-context must be at least 1".into(),
        ));
    }
    if let Some(d) = &cfg.draft {
        crate::spec::check_same_vocab(&loaded.tokenizer, &d.tokenizer)?;
    }
    if cfg.prefix_cache_bytes > 0 {
        crate::prefix::check_block(cfg.prefix_block, cfg.chunk)?;
    }
    let gauges = Arc::new(Gauges::default());
    gauges
        .kv_bytes_capacity
        .store(cfg.kv_memory, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel();
    let handle = SchedulerHandle {
        tx,
        gauges: gauges.clone(),
        max_queue: cfg.max_queue,
    };
    // The device opens here so that a GPU failure is reported before the server listens.
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), EngineError>>();
    let thread = std::thread::Builder::new()
        .name("slowfast-scheduler".into())
        .spawn(move || match cfg.device {
            Device::Cpu => {
                let _ = ready_tx.send(Ok(()));
                supervise(&loaded, &cfg, &rx, &gauges, || {
                    cpu::CpuDevice::new(
                        &loaded.model,
                        cfg.draft.as_ref().map(|d| &d.model),
                        cfg.kv_dtype,
                        cfg.chunk,
                        (cfg.prefix_cache_bytes, cfg.prefix_block),
                    )
                });
            }
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let policy = cfg.default_policy.clone();
                match gpu::GpuDevice::new(&loaded, &cfg, &policy) {
                    Ok(dev) => {
                        // The decoder's page pool: its limit bounds admission.
                        let mut cfg = cfg;
                        cfg.kv_memory = dev.kv_total();
                        gauges
                            .kv_bytes_capacity
                            .store(cfg.kv_memory, Ordering::Relaxed);
                        let _ = ready_tx.send(Ok(()));
                        let mut first = Some(dev);
                        supervise(&loaded, &cfg, &rx, &gauges, || match first.take() {
                            Some(d) => Ok(d),
                            None => gpu::GpuDevice::new(&loaded, &cfg, &policy),
                        });
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => {
                let _ = ready_tx.send(Err(crate::device::not_built()));
            }
        })
        .map_err(|e| EngineError::Io(format!("cannot start the scheduler thread: {e}")))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok((handle, thread)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(EngineError::Io("the scheduler thread died at start".into())),
    }
}

/// Runs the scheduler loop until every handle is gone. A panic inside a step (a bug) fails
/// the requests that were running, whose sinks are dropped, and the loop starts again on a
/// fresh device (`make`); waiting requests keep their place.
fn supervise<D: BatchDevice>(
    m: &Loaded,
    cfg: &SchedulerConfig,
    rx: &Receiver<Submission>,
    g: &Gauges,
    mut make: impl FnMut() -> Result<D, EngineError>,
) {
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    loop {
        let dev = match make() {
            Ok(d) => d,
            Err(e) => {
                eprintln!("slowfast scheduler: cannot open the device again: {e}; stopping");
                return;
            }
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run(dev, m, cfg, rx, g, &mut waiting)
        }));
        match r {
            Ok(()) => return,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                eprintln!(
                    "slowfast scheduler: a step panicked ({msg}); its running requests failed, restarting"
                );
                g.running.store(0, Ordering::Relaxed);
                g.kv_bytes_in_use.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// The scheduler loop.
fn run<D: BatchDevice>(
    mut dev: D,
    m: &Loaded,
    cfg: &SchedulerConfig,
    rx: &Receiver<Submission>,
    g: &Gauges,
    waiting: &mut VecDeque<Waiting>,
) {
    // Running sequences, in arrival order (the newest is preempted first).
    let mut running: Vec<Sequence<D::Seq>> = Vec::new();
    let mut open = true;
    loop {
        // 1. New requests (block only when there is nothing else to do).
        loop {
            let next = if running.is_empty() && waiting.is_empty() && open {
                match rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(s) => Ok(s),
                    Err(RecvTimeoutError::Timeout) => Err(TryRecvError::Empty),
                    Err(RecvTimeoutError::Disconnected) => Err(TryRecvError::Disconnected),
                }
            } else {
                rx.try_recv()
            };
            match next {
                Ok(s) => waiting.push_back(Waiting::New(Box::new(s))),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if !open && running.is_empty() && waiting.is_empty() {
            return;
        }
        // 2. Cancelled requests leave now (their KV is freed at once).
        waiting.retain(|s| {
            let keep = !s.is_closed();
            if !keep {
                g.queued.fetch_sub(1, Ordering::AcqRel);
            }
            keep
        });
        for s in running.iter_mut().filter(|s| s.st.sink.is_closed()) {
            s.st.finished = true;
        }
        retire(&mut dev, &mut running);
        // 3. Admission, first come first served (preempted sequences first), while a place is
        // free and the KV of the prompt (plus one growth step) fits beside what is held.
        // With --kv-reserve: each running sequence's whole KV, reserved. Otherwise what they
        // hold, and room for each one's next KV_GROW tokens (admitting into memory the running
        // ones are about to need only buys a preemption and its recomputation).
        let mut kv_in_use: usize = running
            .iter()
            .map(|s| match cfg.kv_reserve {
                true => s.st.kv_reserved(&dev),
                false => dev.kv_grown(&s.seq, slowfast_kv::KV_GROW),
            })
            .sum();
        while running.len() < cfg.max_batch {
            let Some(front) = waiting.front() else { break };
            let need = match front {
                Waiting::New(sub) => {
                    let cap = sequence::capacity_of(&sub.req, m);
                    let len = match cfg.kv_reserve {
                        true => cap,
                        false => (sub.req.prompt.len() + slowfast_kv::KV_GROW).min(cap),
                    };
                    dev.kv_estimate(&sub.req.policy, cap, len)
                }
                Waiting::Resume(st) => st.kv_need(&dev),
            };
            if kv_in_use + need > cfg.kv_memory && !running.is_empty() {
                break; // waits for a running sequence to finish
            }
            g.queued.fetch_sub(1, Ordering::AcqRel);
            let opened = match waiting.pop_front().expect("front exists") {
                Waiting::New(sub) => Sequence::open(&mut dev, m, sub.req, sub.sink),
                Waiting::Resume(st) => {
                    Sequence::resume(&mut dev, st).map_err(|(st, e)| (st.sink, e))
                }
            };
            match opened {
                Ok(s) => {
                    // What its prompt will need, not what it holds yet (nothing, on the CPU).
                    kv_in_use += need.max(dev.kv_bytes(&s.seq));
                    // In arrival order: a resumed sequence goes before those that came later.
                    let at = running.partition_point(|r| r.st.arrival < s.st.arrival);
                    running.insert(at, s);
                }
                Err((sink, e)) => {
                    sink.send(Event::Error(e.to_string()));
                }
            }
        }
        // 3b. The decode step's new tokens must fit: preempt the newest sequences until they
        // do (the oldest always stays).
        loop {
            let projected: usize = running
                .iter()
                .map(|s| {
                    let extra = usize::from(s.st.pending.is_some() && !s.st.speculative());
                    dev.kv_grown(&s.seq, extra)
                })
                .sum();
            if cfg.kv_reserve
                || projected <= cfg.kv_memory
                || !preempt_newest(&mut dev, &mut running, 0, waiting, g)
            {
                break;
            }
        }
        kv_in_use = running.iter().map(|s| dev.kv_bytes(&s.seq)).sum();
        g.running.store(running.len(), Ordering::Relaxed);
        g.kv_bytes_in_use.store(kv_in_use, Ordering::Relaxed);
        // 4. One decode step of every sequence past its prefill.
        let mut seqs: Vec<&mut D::Seq> = Vec::new();
        let mut tokens: Vec<u32> = Vec::new();
        let mut greedy = true;
        for s in running.iter_mut().filter(|s| !s.st.speculative()) {
            if let Some(t) = s.st.pending {
                greedy &= s.st.greedy();
                seqs.push(&mut s.seq);
                tokens.push(t);
            }
        }
        if !seqs.is_empty() {
            let before: Vec<PolicyStats> = seqs.iter().map(|s| dev.stats(s)).collect();
            let r = dev.decode(&mut seqs, &tokens, greedy);
            for (s, b) in seqs.iter().zip(&before) {
                let a = dev.stats(s);
                g.slow_steps.fetch_add(
                    a.slow_steps.saturating_sub(b.slow_steps) as u64,
                    Ordering::Relaxed,
                );
                g.fast_steps.fetch_add(
                    a.fast_steps.saturating_sub(b.fast_steps) as u64,
                    Ordering::Relaxed,
                );
            }
            drop(seqs);
            g.decode_steps.fetch_add(1, Ordering::Relaxed);
            g.decode_rows
                .fetch_add(tokens.len() as u64, Ordering::Relaxed);
            let stepped = running
                .iter_mut()
                .filter(|s| s.st.pending.is_some() && !s.st.speculative());
            match &r {
                // Sampling (a pass over the vocabulary a row) runs on the pool, a row a task.
                Ok(()) => sequence::sample_all(stepped, &dev, m),
                // A failed batched step fails every sequence in it.
                Err(e) => stepped.for_each(|s| {
                    s.st.pending = None;
                    s.st.fail(&e.to_string())
                }),
            }
        } else {
            drop(seqs);
        }
        // 4b. Speculative sequences: a draft–verify round each (several tokens), batched
        // where the device can.
        let mut turns = Vec::new();
        let mut spec_idx = Vec::new();
        for (i, s) in running.iter_mut().enumerate() {
            if !s.st.speculative() {
                continue;
            }
            let Some(t0) = s.st.pending.take() else {
                continue;
            };
            let (max_out, greedy) = (s.st.remaining(), s.st.greedy());
            spec_idx.push(i);
            turns.push(SpecTurn {
                seq: &mut s.seq,
                t0,
                sampler: s.st.sampler_mut(),
                max_out,
                greedy,
            });
        }
        if !turns.is_empty() {
            let before: Vec<SpecStats> = turns
                .iter()
                .map(|t| dev.spec_stats(t.seq).unwrap_or_default())
                .collect();
            let results = dev.spec_rounds(&mut turns);
            drop(turns);
            for ((&i, r), before) in spec_idx.iter().zip(results).zip(before) {
                let s = &mut running[i];
                let after = dev.spec_stats(&s.seq).unwrap_or_default();
                let d = |a: usize, b: usize| a.saturating_sub(b) as u64;
                g.spec_drafted
                    .fetch_add(d(after.drafted, before.drafted), Ordering::Relaxed);
                g.spec_accepted
                    .fetch_add(d(after.accepted, before.accepted), Ordering::Relaxed);
                g.spec_verifications.fetch_add(
                    d(after.verifications, before.verifications),
                    Ordering::Relaxed,
                );
                match r {
                    Ok(tokens) => {
                        g.decode_rows
                            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
                        let info = (dev.policy_name(&s.seq), dev.stats(&s.seq));
                        for tok in tokens {
                            s.st.emit(tok, None, m, info.clone());
                            if s.st.finished {
                                break;
                            }
                        }
                    }
                    Err(e) => s.st.fail(&e.to_string()),
                }
            }
        }
        // 5. Prefill under the step's token budget, oldest first (at least one part a step).
        // A part runs only if its KV fits, preempting newer sequences to make room; a part that
        // still does not fit waits, except the oldest sequence's (so a prompt that fits alone
        // always completes).
        let mut budget = cfg.prefill_tokens_per_step;
        let mut ran = false;
        let mut i = 0;
        'prefill: while i < running.len() {
            while running[i].st.prefilling() {
                // Once, right before its first part runs: the chunks of the prompts prefilled
                // before it are in the prefix cache by then.
                let hit = running[i].reuse_prefix(&mut dev);
                g.prefix_hit_tokens.fetch_add(hit as u64, Ordering::Relaxed);
                let n = running[i].st.next_part_len();
                if ran && n > budget {
                    break 'prefill;
                }
                loop {
                    let held: usize = running.iter().map(|s| dev.kv_bytes(&s.seq)).sum();
                    let s = &running[i];
                    let grown = held - dev.kv_bytes(&s.seq) + dev.kv_grown(&s.seq, n);
                    if grown <= cfg.kv_memory || cfg.kv_reserve {
                        break;
                    }
                    if preempt_newest(&mut dev, &mut running, i, waiting, g) {
                        continue;
                    }
                    if i > 0 {
                        break 'prefill; // waits for memory: the older ones go first
                    }
                    break; // the oldest: it runs over the budget rather than fail
                }
                let s = &mut running[i];
                budget = budget.saturating_sub(n);
                ran = true;
                g.prefill_tokens.fetch_add(n as u64, Ordering::Relaxed);
                match s.prefill_next(&mut dev) {
                    Ok(true) => s.after_logits(&dev, m),
                    Ok(false) => {}
                    Err(e) => s.st.fail(&e.to_string()),
                }
            }
            i += 1;
        }
        g.prefix_cache_bytes
            .store(dev.prefix_bytes(), Ordering::Relaxed);
        // 6. Finished sequences leave the batch and free their KV.
        retire(&mut dev, &mut running);
        g.running.store(running.len(), Ordering::Relaxed);
        g.kv_bytes_in_use.store(
            running.iter().map(|s| dev.kv_bytes(&s.seq)).sum(),
            Ordering::Relaxed,
        );
    }
}

/// Preempts the newest running sequence after index `keep` that is not speculative (a
/// speculative one keeps its drafter's state; it is never preempted): its KV is freed and it
/// waits at the front of the queue, to be prefilled again with what it generated. False when
/// there is none.
fn preempt_newest<D: BatchDevice>(
    dev: &mut D,
    running: &mut Vec<Sequence<D::Seq>>,
    keep: usize,
    waiting: &mut VecDeque<Waiting>,
    g: &Gauges,
) -> bool {
    let Some(i) = (keep + 1..running.len())
        .rev()
        .find(|&i| !running[i].st.speculative() && !running[i].st.finished)
    else {
        return false;
    };
    let st = running.remove(i).preempt(dev);
    waiting.push_front(Waiting::Resume(st));
    g.queued.fetch_add(1, Ordering::AcqRel);
    g.preemptions.fetch_add(1, Ordering::Relaxed);
    true
}

/// Removes the finished sequences (keeping the others' order), sends each its `Done` (with
/// the inspection of its KV when asked, taken before the KV goes) and frees their KV.
fn retire<D: BatchDevice>(dev: &mut D, running: &mut Vec<Sequence<D::Seq>>) {
    let mut i = 0;
    while i < running.len() {
        if running[i].st.finished {
            let mut s = running.remove(i);
            if let Some(mut f) = s.st.done.take() {
                if s.st.inspect {
                    f.inspection = dev.inspect(&s.seq).map(Box::new);
                }
                s.st.sink.send(Event::Done(f));
            }
            dev.close(s.seq);
        } else {
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests;
