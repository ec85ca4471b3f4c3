//! The generate loop: prefill the prompt, then sample token by token, streaming decoded text
//! (with stop strings held back) until EOS, a stop string, or the token limit.
use std::time::Instant;

use slowfast_tokenizer::StreamDecoder;

use crate::device::Device;
use crate::load::Loaded;
use crate::sampler::{Sampler, SamplerConfig};
use crate::session::{KvDtype, PolicySpec, DEFAULT_CHUNK};
use crate::spec::{SpecOptions, SpecReport, SpecSession, Speculator};
use crate::stop::StopMatcher;
use crate::EngineError;
use slowfast_kv::PolicyStats;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Keep going past EOS tokens.
    pub ignore_eos: bool,
    pub kv_dtype: KvDtype,
    pub chunk: usize,
    pub policy: PolicySpec,
    pub device: Device,
    /// Speculative decoding (CPU): the drafter and γ. With `sfi` / `streaming` drafters
    /// `policy` is the drafter's; the output is full KV's either way.
    pub speculate: Option<SpecOptions>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 128,
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            ignore_eos: false,
            kv_dtype: KvDtype::F16,
            chunk: DEFAULT_CHUNK,
            policy: PolicySpec::Full,
            device: Device::Cpu,
            speculate: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    StopString,
    MaxTokens,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct GenerateOutput {
    pub text: String,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub stop_reason: StopReason,
    pub kv_bytes: usize,
    pub policy: String,
    pub policy_stats: PolicyStats,
    /// Speculative decoding's counters (None without it).
    pub speculative: Option<SpecReport>,
}

/// Generate from `prompt_ids`, calling `on_text` with each piece of text that is safe to print.
pub fn generate(
    m: &Loaded,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput, EngineError> {
    generate_with_draft(m, None, prompt_ids, opts, on_text)
}

/// Where the tokens after the first come from: plain decode steps, or draft–verify rounds.
enum Decoder<'m> {
    Plain(Box<dyn crate::device::Steps + 'm>),
    Spec(Box<dyn SpecSession + 'm>, Box<Speculator<'m>>),
}

/// `generate` with a draft model for `--speculate model`.
pub fn generate_with_draft(
    m: &Loaded,
    draft: Option<&Loaded>,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput, EngineError> {
    opts.sampler.validate()?;
    let ctx = m.model.cfg.max_position_embeddings;
    let needed = prompt_ids.len() + opts.max_new_tokens;
    if prompt_ids.is_empty() {
        return Err(EngineError::BadInput(
            "the prompt is empty after tokenization".into(),
        ));
    }
    if prompt_ids.len() >= ctx {
        return Err(EngineError::BadInput(format!(
            "the prompt has {} tokens but the model's context is {ctx} tokens",
            prompt_ids.len()
        )));
    }
    let max_new = opts.max_new_tokens.min(ctx - prompt_ids.len());
    let mut sampler = Sampler::new(opts.sampler.clone(), m.model.cfg.vocab_size)?;
    for &t in prompt_ids {
        sampler.accept(t);
    }
    if opts.speculate.is_some() && m.tensor_parallel > 1 {
        return Err(EngineError::BadInput(
            "--speculate with --tensor-parallel above 1 is not supported yet (the drafter and the verification run on the whole model)".into(),
        ));
    }
    let t0 = Instant::now();
    let mut dec = match &opts.speculate {
        None => {
            let mut sess = crate::device::session(
                opts.device,
                m,
                needed.min(ctx),
                opts.kv_dtype,
                opts.chunk,
                &opts.policy,
            )?;
            sess.prefill(prompt_ids, &mut |_, _| {})?;
            Decoder::Plain(sess)
        }
        Some(spec) => {
            if let Some(d) = draft {
                crate::spec::check_same_vocab(&m.tokenizer, &d.tokenizer)?;
            }
            // Room for the last round's drafts past the final token.
            let cap = (needed + crate::spec::MAX_SPEC_TOKENS + 1).min(ctx);
            let mut sess = crate::spec::spec_session(
                opts.device,
                &m.model,
                cap,
                opts.kv_dtype,
                opts.chunk,
                &opts.policy,
            )?;
            sess.prefill(prompt_ids, &mut |_, _| {})?;
            let spec = Speculator::new(
                sess.target(),
                prompt_ids,
                spec.clone(),
                draft.map(|d| &d.model),
                opts.kv_dtype,
                &opts.sampler,
            )?;
            Decoder::Spec(sess, Box::new(spec))
        }
    };
    let prefill_seconds = t0.elapsed().as_secs_f64();

    let eos = m.tokenizer.eos_ids().to_vec();
    let mut stream = StreamDecoder::new();
    let mut stops = StopMatcher::new(opts.stop.iter().cloned());
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut reason = StopReason::MaxTokens;
    let t1 = Instant::now();
    let mut decode_steps = 0usize;
    let mut queue = std::collections::VecDeque::new();
    let mut last = 0u32;
    for i in 0..max_new {
        if queue.is_empty() {
            match &mut dec {
                Decoder::Plain(sess) => {
                    if i > 0 {
                        sess.step(last)?;
                        decode_steps += 1;
                    }
                    queue.push_back(sampler.sample_and_accept(sess.logits())?);
                }
                Decoder::Spec(sess, spec) => {
                    if i == 0 {
                        queue.push_back(sampler.sample_and_accept(sess.logits())?);
                    } else {
                        let new = spec.round(sess.target(), last, &mut sampler, max_new - i)?;
                        decode_steps += new.len();
                        queue.extend(new);
                    }
                }
            }
        }
        let tok = queue.pop_front().expect("refilled above");
        last = tok;
        if !opts.ignore_eos && eos.contains(&tok) {
            reason = StopReason::Eos;
            break;
        }
        tokens.push(tok);
        let piece = stream.push(&m.tokenizer, tok);
        let step = stops.push(&piece);
        if !step.emit.is_empty() {
            on_text(&step.emit);
            text.push_str(&step.emit);
        }
        if step.stopped.is_some() {
            reason = StopReason::StopString;
            break;
        }
    }
    if reason != StopReason::StopString {
        let rest = stream.flush();
        let step = stops.push(&rest);
        let mut tail = step.emit;
        if step.stopped.is_some() {
            reason = StopReason::StopString;
        } else {
            tail.push_str(&stops.flush());
        }
        if !tail.is_empty() {
            on_text(&tail);
            text.push_str(&tail);
        }
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    Ok(GenerateOutput {
        text,
        generated_tokens: tokens.len(),
        tokens,
        prompt_tokens: prompt_ids.len(),
        prefill_seconds,
        decode_seconds,
        prefill_tok_s: prompt_ids.len() as f64 / prefill_seconds.max(1e-9),
        decode_tok_s: decode_steps as f64 / decode_seconds.max(1e-9),
        stop_reason: reason,
        kv_bytes: match &dec {
            Decoder::Plain(s) => s.kv_bytes(),
            Decoder::Spec(s, _) => s.kv_bytes(),
        },
        policy: match &dec {
            Decoder::Plain(s) => s.policy_name().to_owned(),
            Decoder::Spec(s, _) => crate::device::Steps::policy_name(&**s).to_owned(),
        },
        policy_stats: match &dec {
            Decoder::Plain(s) => s.policy_stats(),
            Decoder::Spec(s, _) => s.policy_stats(),
        },
        speculative: match &dec {
            Decoder::Plain(_) => None,
            Decoder::Spec(_, s) => Some(SpecReport::new(s.options(), s.stats())),
        },
    })
}
