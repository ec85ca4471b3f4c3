//! `slowfast eval`: quality tasks on a text (nll).
use std::path::PathBuf;

use anyhow::{bail, Result};
use slowfast_engine::eval::{eval_nll, EvalRecord};

use crate::common::{read_text, ModelArgs};

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
    /// Write the records as a JSON array to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn table(rs: &[EvalRecord]) -> String {
    let mut s = String::from(
        "| task | policy | context | eval tokens | nll | ppl |\n|---|---|---|---|---|---|\n",
    );
    for r in rs {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.4} | {:.3} |\n",
            r.task, r.policy, r.context, r.eval_tokens, r.nll, r.ppl
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
    let text = read_text(&a.input)?;
    let m = a.model.load()?;
    let ids = m.tokenizer.encode(&text, true)?;
    eprintln!("{}: {} tokens", a.input.display(), ids.len());
    let rec = eval_nll(
        &m,
        &ids,
        a.context,
        a.eval_tokens,
        a.model.kv(),
        a.model.chunk,
        &mut |s| eprintln!("{s}"),
    )?;
    let recs = vec![rec];
    print!("{}", table(&recs));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&recs)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}
