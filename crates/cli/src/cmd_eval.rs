//! `slowfast eval`: quality tasks under several KV policies, one markdown table on stdout
//! (progress on stderr) and optionally one JSON record per (task, policy).
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use slowfast_engine::eval::agree::{eval_agree_on, AgreeOptions};
use slowfast_engine::eval::passkey::{eval_passkey_spec, PasskeyMetrics, PasskeyOptions};
use slowfast_engine::eval::ruler::{eval_ruler_on, RulerOptions, RulerTask};
use slowfast_engine::eval::stability::{eval_stability_on, StabilityOptions};
use slowfast_engine::eval::{eval_nll_batch, eval_nll_on, EvalRecord, Metrics, NllOptions};
use slowfast_engine::PolicySpec;

use crate::common::{read_text, ModelArgs, PolicyArgs};

#[derive(clap::Args, Debug)]
#[command(after_help = "Tasks:
  nll        prefill N-E tokens of --input, then E teacher-forced decode steps; mean next-token
             NLL (and its difference from full KV).
  agree      greedy continuation of E tokens after N-E tokens of --input under each policy,
             compared position by position with full KV (which always runs first, as the
             reference, even when --policies leaves it out): agreement and first divergence;
             also teacher-forced agreement (each policy fed full KV's continuation: how often
             its argmax is full KV's token).
  passkey    --passkey-trials synthetic retrieval prompts of N tokens drawn from --seed: keys
             (5-digit numbers) at --passkey-depths in a haystack (--input, else a generated
             filler), optional distractor numbers, and a completion-style question at the
             end; accuracy = exact match of the first number decoded.
  ruler      RULER's synthetic tasks, generated offline from --seed (--ruler-tasks, default
             all): niah_single_1 (repeated filler, word -> 7-digit number), niah_single_2
             (essay, word -> number), niah_single_3 (essay, word -> UUID), niah_multikey_1
             (essay, 4 keys, one asked), niah_multikey_2 (distractor needles, word ->
             number), niah_multikey_3 (distractor needles, UUID -> UUID), niah_multivalue (4
             values of one key), niah_multiquery (4 keys asked), vt (variable tracking: one
             chain of 4 hops), cwe (common-words extraction), fwe (frequent-words
             extraction). Each prompt's haystack grows until the prompt plus the task's
             answer budget (128 tokens for niah, 30 vt, 120 cwe, 50 fwe) fits --context;
             the prompt ends with RULER's answer prefix and each policy answers greedily.
             Score: string_match_all (mean over the expected strings of case-insensitive
             substring hits, x100), averaged over --ruler-samples prompts per task; the
             table shows each task and the mean. The essay tasks need --input (a long
             English text, e.g. data/texts/austen_prideprejudice.txt from
             scripts/get_texts.sh). --chat wraps prompts for instruct models.
  stability  dense attention over the last E tokens of N tokens of --input (teacher-forced):
             per global layer and query head, the top-k keys of each decode step; mean
             Jaccard overlap of consecutive steps within a sentence and across a sentence
             start, and of steps d apart. Runs full KV only; on --device cuda each decode
             step is a dense SFI slow step whose captured logits the same probe reads.")]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Task to run (see Tasks below).
    #[arg(long, default_value = "nll", value_parser = ["nll", "agree", "passkey", "ruler", "stability"])]
    pub task: String,
    /// UTF-8 text to evaluate on (nll, agree, stability need it; passkey uses it as haystack,
    /// else a generated filler; ruler: the essay haystack of niah_single_2, niah_single_3,
    /// niah_multikey_1, niah_multivalue and niah_multiquery).
    #[arg(long, short = 'i')]
    pub input: Option<PathBuf>,
    /// Context length N in tokens (nll: the text is tokenized with BOS and truncated to N+1
    /// tokens; passkey: the whole prompt, question included; ruler: prompt plus answer budget).
    #[arg(long, default_value_t = 8192)]
    pub context: usize,
    /// E: decode steps scored after a prefill of N-E tokens [default: 512 for nll and
    /// stability, 128 for agree; passkey does not use it].
    #[arg(long)]
    pub eval_tokens: Option<usize>,
    /// Comma-separated KV policies to compare in one run: full, streaming, h2o, snapkv,
    /// pyramidkv, quest, fastkv, sfi, sfi+fastkv (SFI's decode after FastKV's prefill, see
    /// --prefill; the others: `generate --help`), and the diagnostic upper bounds oracle
    /// (exact top --kv-budget keys of each step's dense attention) and oracle-sfi (SFI's
    /// layout: sinks + --sfi-recent + the exact top of the rest); see --oracle-every.
    #[arg(long, default_value = "full")]
    pub policies: String,
    #[command(flatten)]
    pub sparse: PolicyArgs,
    /// passkey: every answer through speculative decoding (--speculate sfi|streaming|ngram and
    /// the spec flags of generate; --policies full): the answers are full KV's, and the record
    /// adds the drafter's acceptance (`speculative` in --json).
    #[command(flatten)]
    pub spec: crate::common::SpecArgs,
    /// nll: decode this many disjoint windows of --input together on the CPU, as one GPU
    /// batch steps that many sequences (window j: BOS, then the N tokens from 1 + j x N), and
    /// score all of them. With SFI this replays the GPU's batch schedule, where sequences ride
    /// each other's slow steps (--sfi-ride, up to the 4 score rows a GPU step has), so riding's
    /// cost in quality shows against --sfi-ride off. Full KV and the other policies score the
    /// same as 1-window runs over each window. See docs/serving.md.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Write the records as a JSON array to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// agree: skip the teacher-forced agreement (it costs a second decode pass per sparse
    /// policy, and a second prefill for SFI).
    #[arg(long)]
    pub agree_no_teacher_forced: bool,
    /// passkey and ruler: seed of the prompts (keys, values, names, depths of the other
    /// pieces, haystack offsets, word lists).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// passkey: number of trials (prompts); each policy answers every one.
    #[arg(long, default_value_t = 10)]
    pub passkey_trials: usize,
    /// passkey: comma-separated depths (fractions of the prompt, strictly between 0 and 1) of
    /// the key asked for; trial i uses the (i mod count)-th.
    #[arg(long, default_value = "0.1,0.3,0.5,0.7,0.9")]
    pub passkey_depths: String,
    /// passkey: keys per prompt; with more than 1 they are named ("the pass key of the red
    /// door") and one of them is asked for (at most 8).
    #[arg(long, default_value_t = 1)]
    pub passkey_needles: usize,
    /// passkey: other 5-digit numbers per prompt, in sentences not about a pass key.
    #[arg(long, default_value_t = 0)]
    pub passkey_distractors: usize,
    /// passkey: tokens greedily decoded for each answer.
    #[arg(long, default_value_t = 8)]
    pub passkey_answer_tokens: usize,
    /// passkey: where the question goes: `prefill` makes it the end of the (dense) prompt
    /// prefill, as in long-context benchmarks, so only the answer is decoded under the policy;
    /// `decode` feeds it token by token through the policy after a prefill of the haystack
    /// alone (a follow-up question: the sparse memory was chosen before the question came).
    #[arg(long, default_value = "prefill", value_parser = ["prefill", "decode"])]
    pub passkey_question: String,
    /// ruler: comma-separated tasks to run (`all`, or any of niah_single_1, niah_single_2,
    /// niah_single_3, niah_multikey_1, niah_multikey_2, niah_multikey_3, niah_multivalue,
    /// niah_multiquery, vt, cwe, fwe).
    #[arg(long, default_value = "all")]
    pub ruler_tasks: String,
    /// ruler: prompts per task; the asked needle's depth goes evenly from 0 to 100 % over
    /// them (50 % with one).
    #[arg(long, default_value_t = 4)]
    pub ruler_samples: usize,
    /// ruler: wrap each prompt in the model's chat template as a user turn, the answer prefix
    /// starting the model's turn (for instruct models; base models take the plain prompt).
    #[arg(long)]
    pub chat: bool,
    /// stability: keys in each step's support (top-k by attention logit, per query head).
    #[arg(long, default_value_t = 64)]
    pub stability_topk: usize,
    /// stability: comma-separated step distances d for the overlap of steps t and t + d.
    #[arg(long, default_value = "1,2,4,8,16")]
    pub stability_distances: String,
}

/// Parse a comma-separated list, naming `flag` and the bad item on error.
fn parse_list<T: std::str::FromStr>(flag: &str, s: &str) -> Result<Vec<T>> {
    Ok(slowfast_engine::session::parse_list(flag, s)?)
}

fn opt(x: Option<f64>, prec: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.prec$}"))
}

fn budget(r: &EvalRecord) -> String {
    r.kv_budget.map_or("-".into(), |b| b.to_string())
}

/// The markdown table of one task's records.
fn table(rs: &[EvalRecord]) -> String {
    let mut s = String::new();
    let Some(first) = rs.first() else {
        return s;
    };
    match &first.metrics {
        Metrics::Nll(_) => s.push_str(
            "| task | policy | kv budget | context | eval tokens | windows | nll | Δnll vs full | ppl | retained | slow steps (rides; batch) | KV MiB after prefill | KV MiB end |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        ),
        Metrics::Agree(_) => s.push_str(
            "| task | policy | kv budget | context | eval tokens | agreement | first divergence | teacher-forced | retained |\n|---|---|---|---|---|---|---|---|---|\n",
        ),
        Metrics::Passkey(_) => s.push_str(
            "| task | policy | kv budget | context | trials | accuracy | by depth (right/trials) | retained |\n|---|---|---|---|---|---|---|---|\n",
        ),
        Metrics::Ruler(m) => {
            s.push_str("| task | policy | kv budget | context | samples |");
            for t in &m.tasks {
                s.push_str(&format!(" {} |", t.task));
            }
            s.push_str(" average | retained |\n|---|---|---|---|---|");
            s.push_str(&"---|".repeat(m.tasks.len() + 2));
            s.push('\n');
        }
        Metrics::Stability(m) => {
            s.push_str("| task | policy | context | steps | top-k | boundaries | jaccard within | jaccard across |");
            for d in &m.jaccard_by_distance {
                s.push_str(&format!(" d={} |", d.distance));
            }
            s.push_str("\n|---|---|---|---|---|---|---|---|");
            s.push_str(&"---|".repeat(m.jaccard_by_distance.len()));
            s.push('\n');
        }
    }
    for r in rs {
        let line = match &r.metrics {
            Metrics::Nll(m) => format!(
                "| {} | {} | {} | {} | {} | {} | {:.4} | {} | {:.3} | {:.3} | {} ({}; {}) | {:.1} | {:.1} |",
                r.task,
                r.policy,
                budget(r),
                r.context,
                r.eval_tokens,
                m.windows,
                m.nll,
                m.delta_nll.map_or("-".into(), |d| format!("{d:+.4}")),
                m.ppl,
                r.retained_fraction,
                r.slow_steps,
                m.rides,
                m.batch_slow_steps,
                r.kv_bytes_after_prefill as f64 / (1 << 20) as f64,
                r.kv_bytes_end as f64 / (1 << 20) as f64
            ),
            Metrics::Agree(m) => format!(
                "| {} | {} | {} | {} | {} | {:.3} | {} | {} | {:.3} |",
                r.task,
                r.policy,
                budget(r),
                r.context,
                r.eval_tokens,
                m.agreement,
                m.first_divergence.map_or("none".into(), |d| d.to_string()),
                opt(m.teacher_forced_agreement, 3),
                r.retained_fraction
            ),
            Metrics::Passkey(m) => format!(
                "| {} | {} | {} | {} | {} | {:.3} | {} | {:.3} |",
                r.task,
                r.policy,
                budget(r),
                r.context,
                m.trials,
                m.accuracy,
                m.per_depth
                    .iter()
                    .map(|d| format!("{}: {}/{}", d.depth, d.correct, d.trials))
                    .collect::<Vec<_>>()
                    .join(", "),
                r.retained_fraction
            ),
            Metrics::Ruler(m) => {
                let mut l = format!(
                    "| {} | {} | {} | {} | {} |",
                    r.task,
                    r.policy,
                    budget(r),
                    r.context,
                    m.samples
                );
                for t in &m.tasks {
                    l.push_str(&format!(" {:.1} |", t.score));
                }
                l.push_str(&format!(" {:.1} | {:.3} |", m.score, r.retained_fraction));
                l
            }
            Metrics::Stability(m) => {
                let mut l = format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    r.task,
                    r.policy,
                    r.context,
                    m.steps,
                    m.topk,
                    m.boundaries,
                    opt(m.jaccard_within, 3),
                    opt(m.jaccard_across, 3)
                );
                for d in &m.jaccard_by_distance {
                    l.push_str(&format!(" {} |", opt(d.jaccard, 3)));
                }
                l
            }
        };
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// Check the flags that need no model, before loading it.
fn check(a: &Args, e: Option<usize>) -> Result<()> {
    if a.context == 0 {
        bail!("--context must be at least 1");
    }
    if !matches!(a.task.as_str(), "passkey" | "ruler") && a.input.is_none() {
        bail!("--task {} needs --input (a UTF-8 text file)", a.task);
    }
    if a.batch == 0 {
        bail!("--batch must be at least 1 (windows decoded together)");
    }
    if a.batch > 1 && a.task != "nll" {
        bail!("--batch is for --task nll (got --task {})", a.task);
    }
    if a.batch > 1 && a.model.device() != slowfast_engine::Device::Cpu {
        bail!("--batch {}: the batched nll replays the GPU's batch schedule on the CPU; run it with --device cpu", a.batch);
    }
    if a.chat && a.task != "ruler" {
        bail!("--chat is for --task ruler (got --task {})", a.task);
    }
    if let Some(e) = e {
        let ok = match a.task.as_str() {
            "agree" => e >= 1 && e + 2 <= a.context,
            "stability" => e >= 2 && e < a.context,
            _ => e >= 1 && e < a.context,
        };
        if !ok {
            bail!(
                "--eval-tokens ({e}) is out of range for --task {} with --context {} (nll: 1..N-1, agree: 1..N-2, stability: 2..N-1)",
                a.task,
                a.context
            );
        }
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    let e = match a.task.as_str() {
        "passkey" | "ruler" => None,
        "agree" => Some(a.eval_tokens.unwrap_or(128)),
        _ => Some(a.eval_tokens.unwrap_or(512)),
    };
    check(&a, e)?;
    let mut names: Vec<&str> = Vec::new();
    for p in a.policies.split(',').map(str::trim) {
        if !names.contains(&p) {
            names.push(p);
        }
    }
    if a.task == "stability" && names != ["full"] {
        bail!(
            "--task stability measures dense attention and runs full KV only; got --policies {}",
            a.policies
        );
    }
    if a.task == "agree" && names.first() != Some(&"full") {
        if !names.contains(&"full") {
            eprintln!("note: agree compares with full KV, so full runs first as the reference");
        }
        names.retain(|&p| p != "full");
        names.insert(0, "full");
    }
    let spec_opts = a.spec.options()?;
    let specs = match a
        .spec
        .session_policy(&names.join(","), &a.sparse, a.context)?
    {
        Some(drafter_policy) => {
            if a.task != "passkey" {
                bail!(
                    "--speculate: eval runs it on --task passkey (the other tasks are teacher-forced or not yet speculative; got --task {})",
                    a.task
                );
            }
            vec![drafter_policy]
        }
        None => names
            .iter()
            .map(|p| a.sparse.spec(p, a.context))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let device = a.model.device();
    if a.task == "stability" {
        a.model.whole_model_only("eval --task stability")?;
    }
    if a.batch > 1 {
        a.model.whole_model_only("eval --batch")?;
    }
    if a.model.tensor_parallel > 1 && a.spec.speculate.is_some() {
        a.model.whole_model_only("eval --speculate")?;
    }
    let depths: Vec<f64> = parse_list("--passkey-depths", &a.passkey_depths)?;
    let distances: Vec<usize> = parse_list("--stability-distances", &a.stability_distances)?;
    if let Some(d) = distances.iter().find(|&&d| d == 0) {
        bail!("--stability-distances: {d} is not a step distance (at least 1)");
    }
    if a.stability_topk == 0 {
        bail!("--stability-topk must be at least 1");
    }
    let pk = PasskeyOptions {
        context: a.context,
        kv: a.model.kv(),
        chunk: a.model.chunk,
        trials: a.passkey_trials,
        needles: a.passkey_needles,
        distractors: a.passkey_distractors,
        depths,
        seed: a.seed,
        answer_tokens: a.passkey_answer_tokens,
        question_in_prefill: a.passkey_question == "prefill",
    };
    if a.task == "passkey" {
        pk.validate()?;
    }
    let ruler = RulerOptions {
        context: a.context,
        kv: a.model.kv(),
        chunk: a.model.chunk,
        tasks: if a.task == "ruler" {
            RulerTask::parse_list(&a.ruler_tasks)?
        } else {
            Vec::new()
        },
        samples: a.ruler_samples,
        seed: a.seed,
        chat: a.chat,
    };
    if a.task == "ruler" {
        ruler.validate()?;
        let essay: Vec<&str> = ruler
            .tasks
            .iter()
            .filter(|t| t.needs_essay())
            .map(|t| t.name())
            .collect();
        if !essay.is_empty() && a.input.is_none() {
            bail!(
                "--task ruler: {} hide needles in an essay and need --input (a long English text, e.g. data/texts/austen_prideprejudice.txt from scripts/get_texts.sh); or leave them out with --ruler-tasks",
                essay.join(", ")
            );
        }
    }
    let text = a.input.as_deref().map(read_text).transpose()?;
    let m = a.model.load()?;
    let specs: Vec<PolicySpec> = specs
        .into_iter()
        .map(|s| s.with_vocab(&m.tokenizer))
        .collect();
    let mut progress = |s: &str| eprintln!("{s}");
    let (kv, chunk, context) = (a.model.kv(), a.model.chunk, a.context);
    let encode = |bos: bool| -> Result<Vec<u32>> {
        let (Some(t), Some(p)) = (&text, &a.input) else {
            unreachable!("checked: the task has --input")
        };
        let ids = m
            .tokenizer
            .encode(t, bos)
            .with_context(|| format!("tokenizing {}", p.display()))?;
        eprintln!("{}: {} tokens", p.display(), ids.len());
        Ok(ids)
    };
    let mut recs = Vec::new();
    match a.task.as_str() {
        "nll" => {
            let ids = encode(true)?;
            let o = NllOptions {
                context,
                eval_tokens: e.expect("set for nll"),
                kv,
                chunk,
            };
            if a.batch > 1 {
                recs = eval_nll_batch(&m, &ids, &o, &specs, a.batch, &mut progress)?;
            } else {
                for spec in &specs {
                    eprintln!("== policy {}", spec.name());
                    recs.push(eval_nll_on(device, &m, &ids, &o, spec, &mut progress)?);
                }
            }
            if let Some(full) =
                recs.iter()
                    .find(|r| r.policy == "full")
                    .and_then(|r| match &r.metrics {
                        Metrics::Nll(n) => Some(n.nll),
                        _ => None,
                    })
            {
                for r in &mut recs {
                    if let Metrics::Nll(n) = &mut r.metrics {
                        n.delta_nll = Some(n.nll - full);
                    }
                }
            }
        }
        "agree" => {
            let ids = encode(true)?;
            let o = AgreeOptions {
                context,
                eval_tokens: e.expect("set for agree"),
                kv,
                chunk,
                teacher_forced: !a.agree_no_teacher_forced,
            };
            recs = eval_agree_on(device, true, &m, &ids, &o, &specs, &mut progress)?;
            for r in &recs {
                if let Metrics::Agree(x) = &r.metrics {
                    eprintln!(
                        "{}: agreement {:.3}, first divergence {:?}; continuation {:?}",
                        r.policy, x.agreement, x.first_divergence, x.text
                    );
                }
            }
        }
        "passkey" => {
            let hay = match &text {
                Some(_) => Some(encode(false)?),
                None => {
                    eprintln!("no --input: the haystack is the generated filler");
                    None
                }
            };
            recs = eval_passkey_spec(
                device,
                &m,
                hay,
                &pk,
                &specs,
                spec_opts.as_ref(),
                &mut progress,
            )?;
            for r in &recs {
                if let Metrics::Passkey(PasskeyMetrics {
                    speculative: Some(s),
                    ..
                }) = &r.metrics
                {
                    eprintln!(
                        "speculate {} (γ {}): acceptance {:.3}, {:.2} tokens a verification",
                        s.drafter, s.spec_tokens, s.acceptance_rate, s.tokens_per_verification
                    );
                }
            }
        }
        "ruler" => {
            let essay = text.as_deref();
            recs = eval_ruler_on(device, true, &m, essay, &ruler, &specs, &mut progress)?;
        }
        "stability" => {
            let ids = encode(true)?;
            let o = StabilityOptions {
                context,
                eval_tokens: e.expect("set for stability"),
                kv,
                chunk,
                topk: a.stability_topk,
                distances,
            };
            eprintln!("== policy full (stability probe)");
            recs.push(eval_stability_on(device, &m, &ids, &o, &mut progress)?);
        }
        other => unreachable!("clap restricts --task, got {other}"),
    }
    print!("{}", table(&recs));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&recs)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}
