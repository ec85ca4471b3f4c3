//! `/metrics` in Prometheus' text format: request outcomes, token counters and latency
//! histograms kept here, the scheduler's live gauges read from `Gauges`.
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use slowfast_engine::scheduler::Gauges;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The client went away before the end.
    Cancelled,
    /// Refused or failed on the server's side after validation.
    Error,
    /// Refused before it reached the scheduler (bad input, auth, queue full).
    Rejected,
}

const OUTCOMES: [(Outcome, &str); 4] = [
    (Outcome::Ok, "ok"),
    (Outcome::Cancelled, "cancelled"),
    (Outcome::Error, "error"),
    (Outcome::Rejected, "rejected"),
];

/// A histogram with fixed upper bounds (seconds), cumulative on output.
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>, // one per bound, + the +Inf bucket
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((seconds * 1e6).max(0.0) as u64, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cum += c.load(Ordering::Relaxed);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
                }
            }
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cum}");
    }
}

const TTFT_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// The server's own counters.
pub struct Metrics {
    outcomes: [AtomicU64; 4],
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            outcomes: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
        }
    }
}

impl Metrics {
    pub fn count(&self, o: Outcome) {
        let i = OUTCOMES.iter().position(|(x, _)| *x == o).expect("listed");
        self.outcomes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The whole exposition, gauges included.
    pub fn render(&self, g: &Gauges) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP slowfast_requests_total Requests by how they ended.\n# TYPE slowfast_requests_total counter"
        );
        for (i, (_, name)) in OUTCOMES.iter().enumerate() {
            let n = self.outcomes[i].load(Ordering::Relaxed);
            let _ = writeln!(s, "slowfast_requests_total{{outcome=\"{name}\"}} {n}");
        }
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut s,
            "slowfast_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            ld(&self.prompt_tokens),
        );
        counter(
            &mut s,
            "slowfast_generation_tokens_total",
            "Tokens generated.",
            ld(&self.generation_tokens),
        );
        let us = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as u64;
        gauge(
            &mut s,
            "slowfast_running_sequences",
            "Sequences in the running batch (prefilling or decoding).",
            us(&g.running),
        );
        gauge(
            &mut s,
            "slowfast_queued_sequences",
            "Requests waiting for a place in the batch.",
            us(&g.queued),
        );
        let used = us(&g.kv_bytes_in_use);
        gauge(
            &mut s,
            "slowfast_kv_bytes_in_use",
            "KV cache bytes held by running sequences.",
            used,
        );
        gauge(
            &mut s,
            "slowfast_kv_bytes_free",
            "KV cache bytes still free under --kv-memory.",
            us(&g.kv_bytes_capacity).saturating_sub(used),
        );
        let _ = writeln!(
            s,
            "# HELP slowfast_sfi_steps_total Decode steps of sparse policies by kind (slow: dense, refreshing; fast: sparse).\n# TYPE slowfast_sfi_steps_total counter"
        );
        let _ = writeln!(
            s,
            "slowfast_sfi_steps_total{{kind=\"slow\"}} {}",
            ld(&g.slow_steps)
        );
        let _ = writeln!(
            s,
            "slowfast_sfi_steps_total{{kind=\"fast\"}} {}",
            ld(&g.fast_steps)
        );
        counter(
            &mut s,
            "slowfast_decode_steps_total",
            "Batched decode steps run.",
            ld(&g.decode_steps),
        );
        counter(
            &mut s,
            "slowfast_decode_rows_total",
            "Sequence rows decoded (rows / steps = the mean batch).",
            ld(&g.decode_rows),
        );
        counter(
            &mut s,
            "slowfast_prefill_tokens_total",
            "Prompt tokens prefilled.",
            ld(&g.prefill_tokens),
        );
        counter(
            &mut s,
            "slowfast_preemptions_total",
            "Sequences preempted for lack of KV memory (their KV freed, prefilled again later).",
            ld(&g.preemptions),
        );
        counter(
            &mut s,
            "slowfast_prefix_cache_hit_tokens_total",
            "Prompt tokens restored from the prefix cache instead of prefilled.",
            ld(&g.prefix_hit_tokens),
        );
        gauge(
            &mut s,
            "slowfast_prefix_cache_bytes",
            "KV bytes the prefix cache holds.",
            us(&g.prefix_cache_bytes),
        );
        counter(
            &mut s,
            "slowfast_spec_drafted_tokens_total",
            "Speculative decoding: tokens the drafters proposed.",
            ld(&g.spec_drafted),
        );
        counter(
            &mut s,
            "slowfast_spec_accepted_tokens_total",
            "Speculative decoding: drafted tokens the verifications accepted (accepted / drafted = the acceptance rate).",
            ld(&g.spec_accepted),
        );
        counter(
            &mut s,
            "slowfast_spec_verifications_total",
            "Speculative decoding: verification passes (tokens produced by speculative sequences / verifications = mean tokens per verification).",
            ld(&g.spec_verifications),
        );
        self.ttft.write(
            &mut s,
            "slowfast_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        self.itl.write(
            &mut s,
            "slowfast_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        for x in [0.05, 0.1, 0.5, 3.0] {
            h.observe(x);
        }
        let mut s = String::new();
        h.write(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_count 4\n"), "{s}");
        assert!(s.contains("x_sum 3.65\n"), "{s}");
    }

    #[test]
    fn every_metric_is_rendered() {
        let m = Metrics::default();
        m.count(Outcome::Cancelled);
        let g = Gauges::default();
        g.kv_bytes_capacity.store(100, Ordering::Relaxed);
        g.kv_bytes_in_use.store(30, Ordering::Relaxed);
        let s = m.render(&g);
        for want in [
            "slowfast_requests_total{outcome=\"cancelled\"} 1",
            "slowfast_requests_total{outcome=\"ok\"} 0",
            "slowfast_kv_bytes_in_use 30",
            "slowfast_kv_bytes_free 70",
            "slowfast_running_sequences 0",
            "slowfast_queued_sequences 0",
            "slowfast_sfi_steps_total{kind=\"slow\"} 0",
            "slowfast_time_to_first_token_seconds_count 0",
            "slowfast_inter_token_latency_seconds_bucket",
        ] {
            assert!(s.contains(want), "missing {want}");
        }
    }
}
