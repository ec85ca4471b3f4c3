//! HTTP request bodies: `api::parse` then `api::check` for both endpoints, with the server's
//! default limits (8192-token context, the default model's tokenizer when present, the
//! policies resolved the way `slowfast serve` resolves them).
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use slowfast_engine::session::{policy_spec_knobs, FastKvKnobs, SfiKnobs};
use slowfast_server::api::{self, Endpoint, Limits};
use slowfast_server::KvPolicyRequest;

fn resolve(
    req: Option<&KvPolicyRequest>,
    ctx: usize,
) -> Result<slowfast_engine::PolicySpec, String> {
    let mut k = SfiKnobs::default();
    let (mut name, mut budget, mut sinks) = ("full".to_string(), None, 4);
    if let Some(r) = req {
        if let Some(n) = &r.name {
            name = n.clone();
        }
        budget = r.kv_budget;
        sinks = r.sinks.unwrap_or(sinks);
        k.recent = r.sfi_recent.unwrap_or(k.recent);
        k.refresh_interval = r.sfi_refresh_interval.unwrap_or(k.refresh_interval);
        k.min_gap = r.sfi_min_gap.unwrap_or(k.min_gap);
        if let Some(t) = &r.sfi_trigger {
            k.trigger = t.clone();
        }
    }
    policy_spec_knobs(&name, budget, sinks, ctx, &k, &FastKvKnobs::default())
        .map_err(|e| e.to_string())
}

fn eot() -> &'static [u32] {
    static E: OnceLock<Vec<u32>> = OnceLock::new();
    E.get_or_init(|| api::end_of_turn_ids(slowfast_fuzz::spm()))
}

fuzz_target!(|data: &[u8]| {
    let Ok(body) = api::parse(data) else {
        return;
    };
    let tok = slowfast_fuzz::spm();
    let lim = Limits {
        served_model_name: "gemma-3-270m-q4_k_m",
        max_context: 8192,
        tokenizer: tok,
        resolve: &resolve,
        end_of_turn: eot(),
        speculate: None,
        draft_model: false,
    };
    // `check` takes the body by value: parse it again for the second endpoint.
    let _ = api::check(body, Endpoint::Completions, &lim);
    if let Ok(body) = api::parse(data) {
        let _ = api::check(body, Endpoint::Chat, &lim);
    }
});
