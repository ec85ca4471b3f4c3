//! `eval --task ruler`: RULER's synthetic tasks (arXiv 2404.06654) generated offline — eight
//! needle-in-a-haystack variants, variable tracking, common- and frequent-words extraction.
//! Each prompt grows its haystack until it and the task's answer budget fit `--context`; every
//! policy answers the same prompt greedily (up to the budget or an end token), scored by
//! string_match_all (the mean over the references of case-insensitive substring hits, x100).
//! One record per policy holds the per-task scores and their mean.
pub mod gen;
mod synth;
pub mod tasks;
pub mod words;

use std::time::Instant;

use super::{argmax, check_model_context, prefilled_steps, EvalRecord, Metrics};
use crate::device::Steps;
use crate::load::Loaded;
use crate::session::{KvDtype, PolicySpec};
use crate::EngineError;
pub use gen::{RulerGen, RulerSample};
use slowfast_kv::PolicyStats;
pub use tasks::RulerTask;

/// The shape of a ruler run.
#[derive(Debug, Clone)]
pub struct RulerOptions {
    /// Prompt tokens plus the task's answer budget.
    pub context: usize,
    pub kv: KvDtype,
    pub chunk: usize,
    pub tasks: Vec<RulerTask>,
    /// Prompts per task.
    pub samples: usize,
    pub seed: u64,
    /// Wrap each prompt in the model's chat template (instruct models).
    pub chat: bool,
}

impl RulerOptions {
    /// Check the options, naming the flag of any bad one.
    pub fn validate(&self) -> Result<(), EngineError> {
        if self.samples == 0 {
            return Err(EngineError::BadInput(
                "--ruler-samples must be at least 1".into(),
            ));
        }
        if self.tasks.is_empty() {
            return Err(EngineError::BadInput(
                "--ruler-tasks needs at least one task".into(),
            ));
        }
        Ok(())
    }
}

/// string_match_all: the mean over `refs` of whether each occurs in `output` (ignoring case),
/// x100.
pub fn string_match_all(output: &str, refs: &[String]) -> f64 {
    if refs.is_empty() {
        return 0.0;
    }
    let out = output.to_lowercase();
    let hits = refs
        .iter()
        .filter(|r| out.contains(&r.to_lowercase()))
        .count();
    100.0 * hits as f64 / refs.len() as f64
}

/// One answer of one sample.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RulerAnswer {
    pub expected: Vec<String>,
    pub output: String,
    pub score: f64,
    pub prompt_tokens: usize,
    pub depth: Option<f64>,
}

/// The score of one task under one policy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RulerTaskScore {
    pub task: String,
    /// Mean string_match_all over the samples, 0..100.
    pub score: f64,
    pub samples: usize,
    /// Answer budget in tokens.
    pub budget: usize,
    pub answers: Vec<RulerAnswer>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct RulerMetrics {
    /// Mean of the task scores, 0..100.
    pub score: f64,
    pub samples: usize,
    pub seed: u64,
    pub chat: bool,
    pub tasks: Vec<RulerTaskScore>,
}

/// Greedy answer in a prefilled session: up to `budget` tokens, stopping at an end token.
fn answer(
    m: &Loaded,
    sess: &mut dyn Steps,
    budget: usize,
    progress_tokens: &mut usize,
) -> Result<String, EngineError> {
    let eos = m.tokenizer.eos_ids();
    let mut out = Vec::with_capacity(budget);
    let mut next = argmax(sess.logits());
    while !eos.contains(&next) {
        out.push(next);
        if out.len() == budget {
            break;
        }
        next = argmax(sess.step(next)?);
    }
    *progress_tokens += out.len();
    Ok(m.tokenizer.decode(&out))
}

/// Run `o.samples` prompts of each task under each policy (every policy on the same prompt);
/// one record per policy. `essay`: the text of the essay haystacks.
pub fn eval_ruler(
    m: &Loaded,
    essay: Option<&str>,
    o: &RulerOptions,
    policies: &[PolicySpec],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    eval_ruler_on(crate::Device::Cpu, true, m, essay, o, policies, progress)
}

/// [`eval_ruler`] on `device` (`--device cuda`: the policies `cuda::GPU_POLICIES` names); without `share`
/// each policy prefills every prompt itself (the GPU always does).
pub fn eval_ruler_on(
    device: crate::Device,
    share: bool,
    m: &Loaded,
    essay: Option<&str>,
    o: &RulerOptions,
    policies: &[PolicySpec],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<EvalRecord>, EngineError> {
    o.validate()?;
    check_model_context(m, o.context)?;
    let gen = RulerGen::new(&m.tokenizer, essay, o.context, o.seed, o.chat);
    let np = policies.len();
    let mut scores: Vec<Vec<RulerTaskScore>> = vec![Vec::new(); np];
    let mut times = vec![(0.0, 0.0); np];
    let mut stats = vec![PolicyStats::default(); np];
    let mut kv_bytes = vec![(0, 0); np];
    let mut decoded = 0usize;
    let t_run = Instant::now();
    let total = o.tasks.len() * o.samples;
    for (ti, &task) in o.tasks.iter().enumerate() {
        let mut answers: Vec<Vec<RulerAnswer>> = vec![Vec::new(); np];
        for i in 0..o.samples {
            let s = gen.sample(task, i, o.samples)?;
            let done = ti * o.samples + i;
            progress(&format!(
                "ruler {} sample {}/{} ({} prompt tokens, haystack {}{}) [{done}/{total} prompts, {:.0}s]",
                task.name(),
                i + 1,
                o.samples,
                s.tokens.len(),
                s.haystack,
                s.depth.map_or(String::new(), |d| format!(", depth {d:.0}%")),
                t_run.elapsed().as_secs_f64()
            ));
            let cap = s.tokens.len() + task.budget();
            let (dev, kv, chunk) = (device, o.kv, o.chunk);
            let sessions =
                prefilled_steps(dev, share, m, cap, kv, chunk, policies, &s.tokens, progress)?;
            for (pi, ((mut sess, pf), p)) in sessions.into_iter().zip(policies).enumerate() {
                let after_prefill = sess.kv_bytes();
                let t1 = Instant::now();
                let text = answer(m, &mut *sess, task.budget(), &mut decoded)?;
                let score = string_match_all(&text, &s.answers);
                progress(&format!(
                    "  {}: {score:.0} (expected {}) {:?}",
                    p.name(),
                    s.answers.join(", "),
                    text
                ));
                times[pi].0 += pf;
                times[pi].1 += t1.elapsed().as_secs_f64();
                let st = sess.policy_stats();
                let acc = &mut stats[pi];
                acc.slow_steps += st.slow_steps;
                acc.fast_steps += st.fast_steps;
                acc.attended_tokens += st.attended_tokens;
                acc.dense_tokens += st.dense_tokens;
                kv_bytes[pi] = (after_prefill, sess.kv_bytes());
                answers[pi].push(RulerAnswer {
                    expected: s.answers.clone(),
                    output: text,
                    score,
                    prompt_tokens: s.tokens.len(),
                    depth: s.depth,
                });
            }
        }
        for (pi, a) in answers.into_iter().enumerate() {
            let score = a.iter().map(|x| x.score).sum::<f64>() / a.len() as f64;
            progress(&format!(
                "ruler {} {}: {score:.1}",
                task.name(),
                policies[pi].name()
            ));
            scores[pi].push(RulerTaskScore {
                task: task.name().into(),
                score,
                samples: a.len(),
                budget: task.budget(),
                answers: a,
            });
        }
    }
    progress(&format!(
        "ruler: {total} prompts, {decoded} answer tokens in {:.0}s",
        t_run.elapsed().as_secs_f64()
    ));
    let max_budget = o.tasks.iter().map(|t| t.budget()).max().unwrap_or(0);
    Ok(policies
        .iter()
        .enumerate()
        .map(|(pi, p)| {
            let tasks = std::mem::take(&mut scores[pi]);
            let score = tasks.iter().map(|t| t.score).sum::<f64>() / tasks.len() as f64;
            EvalRecord {
                task: "ruler".into(),
                policy: p.name().into(),
                model: m.name.clone(),
                context: o.context,
                eval_tokens: max_budget,
                kv_budget: p.budget(),
                metrics: Metrics::Ruler(RulerMetrics {
                    score,
                    samples: o.samples,
                    seed: o.seed,
                    chat: o.chat,
                    tasks,
                }),
                retained_fraction: stats[pi].retained_fraction(),
                slow_steps: stats[pi].slow_steps,
                fast_steps: stats[pi].fast_steps,
                prefill_seconds: times[pi].0,
                decode_seconds: times[pi].1,
                kv_bytes: kv_bytes[pi].1,
                kv_bytes_after_prefill: kv_bytes[pi].0,
                kv_bytes_end: kv_bytes[pi].1,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests;
