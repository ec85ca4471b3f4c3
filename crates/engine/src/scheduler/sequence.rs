//! One request inside the scheduler: its device sequence, where its prefill stands, and the
//! token loop of `generate` (sample, EOS, streamed text with stop strings held back, the
//! token limit), driven one step at a time. A running sequence can be preempted (its device
//! sequence closed, its KV freed) and resumed later by prefilling its prompt and the tokens it
//! generated so far; its sampler, streamed text and counters carry over.
use slowfast_tokenizer::StreamDecoder;

use super::{BatchDevice, Event, EventSink, Finish, FinishReason, Request, TokenLogprob, TokenOut};
use crate::sampler::Sampler;
use slowfast_kv::PolicyStats;

/// The policy's name and counters, for the final event.
pub(super) type PolicyInfo = (&'static str, PolicyStats);
use crate::session::PolicySpec;
use crate::stop::StopMatcher;
use crate::{EngineError, Loaded};

/// Admission numbers, increasing over the process (schedulers only compare their own).
static ARRIVALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Tokens a request's sequence holds at most (prompt + generated), as `generate` sizes it.
pub(super) fn capacity_of(req: &Request, m: &Loaded) -> usize {
    (req.prompt.len() + req.max_tokens).min(m.model.cfg.max_position_embeddings)
}

/// A request's device sequence and its token-loop state (kept apart so the device's logits,
/// which may live in the sequence, can be read while the state changes).
pub(super) struct Sequence<S> {
    pub seq: S,
    pub st: SeqState,
}

pub(super) struct SeqState {
    pub sink: Box<dyn EventSink>,
    /// The prompt, then every token generated (the last one is `pending` while it waits for
    /// its decode step): what a resumed sequence prefills.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Admission order (first come, first served, also after a preemption).
    pub arrival: u64,
    /// What the device sequence was opened with (again on resume).
    policy: PolicySpec,
    capacity: usize,
    /// The prefill parts of `tokens[..plan end]`.
    plan: Vec<(usize, usize)>,
    /// Next prefill part to run (== plan.len() once prefilled).
    part: usize,
    /// The prefix cache was asked for this prompt's leading chunks (once, at the first part).
    reuse_tried: bool,
    /// The token to feed at the next decode step.
    pub pending: Option<u32>,
    sampler: Sampler,
    stream: StreamDecoder,
    stops: StopMatcher,
    eos: Vec<u32>,
    ignore_eos: bool,
    logprobs: Option<usize>,
    /// The token is the argmax of the logits (temperature 0, no penalties, no logprobs).
    greedy: bool,
    max_new: usize,
    generated: usize,
    pub finished: bool,
    /// The end, sent when the sequence retires (after its inspection, if asked for).
    pub done: Option<Finish>,
    /// Attach an inspection of the KV to `done`.
    pub inspect: bool,
    /// Decoded by speculative rounds (`BatchDevice::spec_round`), not the batched step.
    speculative: bool,
}

impl<S> Sequence<S> {
    /// Before the first prefill part: lets the device restore the prompt's leading chunks from
    /// its prefix cache (asked at the first part, not at admission, so that a request admitted
    /// beside another with the same prefix finds the chunks that one has prefilled since).
    /// Returns the prompt tokens restored.
    pub fn reuse_prefix<D: BatchDevice<Seq = S>>(&mut self, dev: &mut D) -> usize {
        let st = &mut self.st;
        if st.reuse_tried || st.part != 0 || st.speculative {
            return 0;
        }
        st.reuse_tried = true;
        st.part = dev.reuse_prefix(&mut self.seq, &st.tokens, &st.plan);
        st.part.checked_sub(1).map_or(0, |k| st.plan[k].1)
    }

    /// Runs the next prefill part; true when the prompt is done (its logits are ready).
    pub fn prefill_next<D: BatchDevice<Seq = S>>(
        &mut self,
        dev: &mut D,
    ) -> Result<bool, EngineError> {
        let st = &mut self.st;
        dev.prefill_part(&mut self.seq, &st.tokens, &st.plan, st.part)?;
        st.part += 1;
        Ok(st.part == st.plan.len())
    }

    /// Samples from the device's logits of this sequence (or takes the device's argmax of
    /// them, for a greedy request) and moves its state on.
    pub fn after_logits<D: BatchDevice<Seq = S>>(&mut self, dev: &D, m: &Loaded) {
        let info = (dev.policy_name(&self.seq), dev.stats(&self.seq));
        let argmax = dev.argmax(&self.seq).filter(|_| self.st.greedy);
        self.st.after_logits(dev.logits(&self.seq), argmax, m, info);
    }

    /// Validates the request against the model and opens its device sequence (its KV is
    /// allocated here). On failure the sink comes back with the error.
    #[allow(clippy::type_complexity)]
    pub fn open<D: BatchDevice<Seq = S>>(
        dev: &mut D,
        m: &Loaded,
        req: Request,
        sink: Box<dyn EventSink>,
    ) -> Result<Self, (Box<dyn EventSink>, EngineError)> {
        let ctx = m.model.cfg.max_position_embeddings;
        let check = || -> Result<(Sampler, usize), EngineError> {
            if req.prompt.is_empty() {
                return Err(EngineError::BadInput("the prompt is empty".into()));
            }
            if req.prompt.len() >= ctx {
                return Err(EngineError::BadInput(format!(
                    "the prompt has {} tokens but the model's context is {ctx} tokens",
                    req.prompt.len()
                )));
            }
            let mut sampler = Sampler::new(req.sampler.clone(), m.model.cfg.vocab_size)?;
            for &t in &req.prompt {
                sampler.accept(t);
            }
            Ok((sampler, req.max_tokens.min(ctx - req.prompt.len())))
        };
        let (sampler, max_new) = match check() {
            Ok(x) => x,
            Err(e) => return Err((sink, e)),
        };
        if req.speculate.is_some() && req.logprobs.is_some() {
            let e = "logprobs are not available with speculative decoding (speculate)";
            return Err((sink, EngineError::BadInput(e.into())));
        }
        let capacity = capacity_of(&req, m);
        let mut seq = match dev.open(&req.policy, capacity) {
            Ok(s) => s,
            Err(e) => return Err((sink, e)),
        };
        if let Some(o) = &req.speculate {
            if let Err(e) = dev.spec_attach(&mut seq, o, &req.prompt, &req.sampler) {
                dev.close(seq);
                return Err((sink, e));
            }
        }
        let plan = dev.prefill_plan(&seq, req.prompt.len());
        let st = SeqState {
            sink,
            plan,
            part: 0,
            reuse_tried: false,
            pending: None,
            sampler,
            stream: StreamDecoder::new(),
            stops: StopMatcher::new(req.stop.iter().cloned()),
            eos: m
                .tokenizer
                .eos_ids()
                .iter()
                .chain(&req.stop_tokens)
                .copied()
                .collect(),
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            greedy: {
                let c = &req.sampler;
                c.temperature == 0.0
                    && c.repetition_penalty == 1.0
                    && c.presence_penalty == 0.0
                    && c.frequency_penalty == 0.0
                    && req.logprobs.is_none()
            },
            max_new,
            generated: 0,
            finished: false,
            done: None,
            inspect: req.inspect,
            speculative: req.speculate.is_some(),
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            arrival: ARRIVALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            policy: req.policy,
            capacity,
        };
        Ok(Sequence { seq, st })
    }

    /// Frees the device sequence (its KV) and keeps the state, to resume later: the prefill
    /// then covers the prompt and every token generated so far, the last of which (the
    /// pending one) is in it, so the prefill's logits give the next token.
    pub fn preempt<D: BatchDevice<Seq = S>>(self, dev: &mut D) -> Box<SeqState> {
        dev.close(self.seq);
        let mut st = Box::new(self.st);
        st.pending = None;
        st.plan.clear();
        st.part = 0;
        st.reuse_tried = false;
        st
    }

    /// Reopens a preempted sequence's device sequence, to prefill its tokens again.
    #[allow(clippy::type_complexity)]
    pub fn resume<D: BatchDevice<Seq = S>>(
        dev: &mut D,
        mut st: Box<SeqState>,
    ) -> Result<Self, (Box<SeqState>, EngineError)> {
        let seq = match dev.open(&st.policy, st.capacity) {
            Ok(s) => s,
            Err(e) => return Err((st, e)),
        };
        st.plan = dev.prefill_plan(&seq, st.tokens.len());
        Ok(Sequence { seq, st: *st })
    }
}

impl SeqState {
    /// KV bytes the sequence holds once (re)prefilled, plus one growth step (as a new
    /// request's prompt is counted), by the device's estimate: what admission needs free.
    /// Without the growth step a resumed sequence at a growth boundary is preempted again at
    /// its first decode step, and again after each resume.
    pub fn kv_need<D: BatchDevice>(&self, dev: &D) -> usize {
        let len = (self.tokens.len() + slowfast_kv::KV_GROW).min(self.capacity);
        dev.kv_estimate(&self.policy, self.capacity, len)
    }

    /// KV bytes the sequence holds at its longest (`--kv-reserve` admission).
    pub fn kv_reserved<D: BatchDevice>(&self, dev: &D) -> usize {
        dev.kv_estimate(&self.policy, self.capacity, self.capacity)
    }

    /// Whether prefill parts remain.
    pub fn prefilling(&self) -> bool {
        !self.finished && self.part < self.plan.len()
    }

    /// Whether the next token is the argmax of the logits with nothing else needed from them
    /// (temperature 0, no penalties, no logprobs).
    pub fn greedy(&self) -> bool {
        self.greedy
    }

    /// Whether speculative rounds decode this sequence.
    pub fn speculative(&self) -> bool {
        self.speculative
    }

    /// Tokens still to generate.
    pub fn remaining(&self) -> usize {
        self.max_new.saturating_sub(self.generated)
    }

    /// The sampler (speculative rounds sample and record their tokens in it).
    pub fn sampler_mut(&mut self) -> &mut Sampler {
        &mut self.sampler
    }

    /// Tokens of the next prefill part.
    pub fn next_part_len(&self) -> usize {
        self.plan.get(self.part).map_or(0, |&(a, b)| b - a)
    }

    /// The step after a forward: sample from `logits` (or take the device's `argmax` of them,
    /// greedy requests only), stream the token, and either queue it for the next decode step
    /// or finish (the loop of `generate`, one iteration).
    fn after_logits(&mut self, logits: &[f32], argmax: Option<u32>, m: &Loaded, info: PolicyInfo) {
        if self.max_new == 0 {
            return self.finish(FinishReason::Length, true, info);
        }
        let tok = match argmax {
            Some(t) => {
                self.sampler.accept(t);
                t
            }
            None => match self.sampler.sample_and_accept(logits) {
                Ok(t) => t,
                Err(e) => return self.fail(&e.to_string()),
            },
        };
        self.emit(tok, Some(logits), m, info);
    }

    /// A token chosen (and recorded in the sampler): stream it, and either queue it for the
    /// next decode step or finish. `logits` (its row) serve the logprobs.
    pub fn emit(&mut self, tok: u32, logits: Option<&[f32]>, m: &Loaded, info: PolicyInfo) {
        if !self.ignore_eos && self.eos.contains(&tok) {
            return self.finish(FinishReason::Stop, true, info);
        }
        self.generated += 1;
        self.tokens.push(tok);
        let piece = self.stream.push(&m.tokenizer, tok);
        let step = self.stops.push(&piece);
        let logprob = match (self.logprobs, logits) {
            (Some(n), Some(l)) => Some(logprob_of(l, tok, n)),
            _ => None,
        };
        let out = TokenOut {
            id: tok,
            text: step.emit,
            logprob,
        };
        if !self.sink.send(Event::Token(out)) {
            self.finished = true; // the client left: dropped at the end of this step
            return;
        }
        if step.stopped.is_some() {
            self.finish(FinishReason::Stop, false, info);
        } else if self.generated >= self.max_new {
            self.finish(FinishReason::Length, true, info);
        } else {
            self.pending = Some(tok);
        }
    }

    /// Ends the sequence; `flush` sends the text still held back (not after a stop string).
    fn finish(&mut self, mut reason: FinishReason, flush: bool, info: PolicyInfo) {
        let mut text = String::new();
        if flush {
            let rest = self.stream.flush();
            let step = self.stops.push(&rest);
            text = step.emit;
            if step.stopped.is_some() {
                reason = FinishReason::Stop;
            } else {
                text.push_str(&self.stops.flush());
            }
        }
        self.finished = true;
        let (policy, stats) = info;
        self.done = Some(Finish {
            reason,
            text,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
            policy: policy.to_owned(),
            stats,
            inspection: None,
        });
    }

    pub fn fail(&mut self, msg: &str) {
        self.finished = true;
        self.sink.send(Event::Error(msg.to_owned()));
    }
}

/// `after_logits` of every sequence of a decode step, in parallel over the rows (each row's
/// sampler, stream and sink are its own; the logits are read in place).
pub(super) fn sample_all<'a, S: 'a, D: BatchDevice<Seq = S>>(
    seqs: impl Iterator<Item = &'a mut Sequence<S>>,
    dev: &D,
    m: &Loaded,
) {
    use rayon::prelude::*;
    let mut work: Vec<(&mut SeqState, &[f32], Option<u32>, PolicyInfo)> = seqs
        .map(|s| {
            s.st.pending = None;
            let info = (dev.policy_name(&s.seq), dev.stats(&s.seq));
            let argmax = dev.argmax(&s.seq).filter(|_| s.st.greedy);
            (&mut s.st, dev.logits(&s.seq), argmax, info)
        })
        .collect();
    work.par_iter_mut()
        .for_each(|(st, logits, argmax, info)| st.after_logits(logits, *argmax, m, info.clone()));
}

/// Log-softmax of `logits` at `tok`, and the `n` most likely tokens (most likely first, lower
/// id first on ties).
pub(crate) fn logprob_of(logits: &[f32], tok: u32, n: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - max) as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |x: f32| (x as f64 - lse) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let key = |&i: &u32| {
            let x = logits[i as usize];
            if x.is_nan() {
                f32::NEG_INFINITY
            } else {
                x
            }
        };
        let cmp = |a: &u32, b: &u32| key(b).total_cmp(&key(a)).then(a.cmp(b));
        let k = n.min(idx.len());
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, cmp);
            idx.truncate(k);
        }
        idx.sort_unstable_by(cmp);
        top.extend(idx.into_iter().map(|i| (i, lp(logits[i as usize]))));
    }
    TokenLogprob {
        logprob: lp(logits[tok as usize]),
        top,
    }
}
