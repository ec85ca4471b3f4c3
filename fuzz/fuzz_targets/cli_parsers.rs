//! The command-line value parsers: `--contexts`, numeric lists, `--kv-budget` and
//! `--policy` resolution.
#![no_main]
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use slowfast_engine::budget_tokens;
use slowfast_engine::session::{parse_contexts, parse_list, policy_spec, POLICIES};

#[derive(Debug, Arbitrary)]
struct Input {
    text: String,
    budget: f64,
    context: usize,
    sinks: usize,
    policy: u8,
    has_budget: bool,
}

fuzz_target!(|inp: Input| {
    let _ = parse_contexts(&inp.text);
    let _ = parse_list::<usize>("--x", &inp.text);
    let _ = parse_list::<f64>("--x", &inp.text);
    if let Ok(b) = inp.text.trim().parse::<f64>() {
        let _ = budget_tokens(b, inp.context);
    }
    let _ = budget_tokens(inp.budget, inp.context);
    let names: Vec<&str> = POLICIES.split(", ").collect();
    let name = if (inp.policy as usize) < names.len() * 8 {
        names[inp.policy as usize % names.len()]
    } else {
        inp.text.as_str()
    };
    let budget = inp.has_budget.then_some(inp.budget);
    let _ = policy_spec(name, budget, inp.sinks, inp.context);
});
