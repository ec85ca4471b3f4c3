//! `slowfast eval`: quality tasks on a text (nll).
use std::path::PathBuf;

use anyhow::{bail, Result};
use slowfast_engine::eval::{eval_nll, EvalRecord, NllOptions};

use crate::common::{read_text, ModelArgs, PolicyArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Task: nll (mean next-token negative log-likelihood over teacher-forced decode steps).
    #[arg(long, default_value = "nll", value_parser = ["nll"])]
    pub task: String,
    /// UTF-8 text to evaluate on.
    #[arg(long, short = 'i')]
    pub input: PathBuf,
    /// Context length N in tokens (the text is tokenized with BOS and truncated to N+1 tokens).
    #[arg(long, default_value_t = 8192)]
    pub context: usize,
    /// E: scored decode steps after a prefill of N-E tokens.
    #[arg(long, default_value_t = 512)]
    pub eval_tokens: usize,
    /// Comma-separated KV policies to compare in one run: full, streaming, h2o, snapkv,
    /// pyramidkv, quest, fastkv, sfi (see `generate --help`).
    #[arg(long, default_value = "full")]
    pub policies: String,
    #[command(flatten)]
    pub sparse: PolicyArgs,
    /// Write the records as a JSON array to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn table(rs: &[EvalRecord]) -> String {
    let mut s = String::from(
        "| task | policy | kv budget | context | eval tokens | nll | Δnll vs full | ppl | retained | KV MiB after prefill | KV MiB end |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rs {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.4} | {} | {:.3} | {:.3} | {:.1} | {:.1} |\n",
            r.task,
            r.policy,
            r.kv_budget.map_or("-".into(), |b| b.to_string()),
            r.context,
            r.eval_tokens,
            r.nll,
            r.delta_nll.map_or("-".into(), |d| format!("{d:+.4}")),
            r.ppl,
            r.retained_fraction,
            r.kv_bytes_after_prefill as f64 / (1 << 20) as f64,
            r.kv_bytes_end as f64 / (1 << 20) as f64
        ));
    }
    s
}

pub fn run(a: Args) -> Result<()> {
    if a.eval_tokens == 0 || a.eval_tokens >= a.context {
        bail!(
            "--eval-tokens ({}) must be at least 1 and less than --context ({})",
            a.eval_tokens,
            a.context
        );
    }
    let specs = a
        .policies
        .split(',')
        .map(|p| a.sparse.spec(p.trim(), a.context))
        .collect::<Result<Vec<_>, _>>()?;
    a.model.require_cpu("eval")?;
    let text = read_text(&a.input)?;
    let m = a.model.load()?;
    let ids = m.tokenizer.encode(&text, true)?;
    eprintln!("{}: {} tokens", a.input.display(), ids.len());
    let specs: Vec<_> = specs
        .into_iter()
        .map(|s| s.with_vocab(&m.tokenizer))
        .collect();
    let mut recs = Vec::new();
    for spec in &specs {
        eprintln!("== policy {}", spec.name());
        let o = NllOptions {
            context: a.context,
            eval_tokens: a.eval_tokens,
            kv: a.model.kv(),
            chunk: a.model.chunk,
        };
        let rec = eval_nll(&m, &ids, &o, spec, &mut |s| eprintln!("{s}"))?;
        recs.push(rec);
    }
    if let Some(full) = recs.iter().find(|r| r.policy == "full").map(|r| r.nll) {
        for r in &mut recs {
            r.delta_nll = Some(r.nll - full);
        }
    }
    print!("{}", table(&recs));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&recs)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}
