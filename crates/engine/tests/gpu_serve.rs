//! The serving scheduler on the GPU (`Device::Cuda`, one decoder of `max_batch` slots) on a
//! small random Qwen3-shaped model: greedy requests give `generate --device cuda`'s tokens,
//! alone and batched, under full KV, StreamingLLM, SFI and SnapKV; a cancelled request frees its slot
//! for the next; requests for another policy than the server's are refused; speculative
//! requests batch with plain ones. Skips without a GPU unless SLOWFAST_REQUIRE_GPU=1.
#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use slowfast_engine::generate::{generate, GenerateOptions};
use slowfast_engine::sampler::SamplerConfig;
use slowfast_engine::scheduler::{
    self, ChannelSink, Event, Finish, Outcome, Request, SchedulerConfig, SchedulerHandle,
};
use slowfast_engine::session::SfiKnobs;
use slowfast_engine::{Device, KvDtype, Loaded, PolicySpec};
use slowfast_model::Model;
use slowfast_quant::GgmlType;

fn have_gpu(name: &str) -> bool {
    match slowfast_cuda::CudaContext::new(0) {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("SLOWFAST_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{name}: no GPU: {e}");
            }
            eprintln!("skipping {name}: {e}");
            false
        }
    }
}

/// Qwen3-0.6B shapes (head dim 128, 16 / 8 heads, q/k norm) cut to 4 layers and an 8K vocab,
/// random bf16 weights, a byte-level tokenizer.
fn model() -> Arc<Loaded> {
    model_with(4096, 0x5e7e)
}

/// The 4-layer model with a context of `context` tokens and weights from `seed`.
fn model_with(context: usize, seed: u64) -> Arc<Loaded> {
    let mut cfg = slowfast_model::presets::preset("qwen3-0.6b").unwrap();
    cfg.num_hidden_layers = 4;
    cfg.layer_sliding = vec![false; 4];
    cfg.vocab_size = 8192;
    cfg.max_position_embeddings = context;
    let w = slowfast_model::random::random_weights(&cfg, GgmlType::BF16, seed).unwrap();
    let tokenizer = slowfast_tokenizer::Tokenizer::byte_level(cfg.vocab_size).unwrap();
    Arc::new(Loaded {
        model: Model::new(cfg, w).unwrap(),
        tokenizer,
        name: "random qwen3 (4 layers)".into(),
        tensor_parallel: 1,
    })
}

const MAX_CONTEXT: usize = 256;

/// The GPU server's config: `max_batch` slots of `max_context`, the pool from the device, no
/// prefix cache.
fn config(max_batch: usize, max_context: usize, policy: &PolicySpec) -> SchedulerConfig {
    SchedulerConfig {
        device: Device::Cuda,
        max_batch,
        max_queue: 16,
        prefill_tokens_per_step: 512,
        chunk: 64,
        kv_dtype: KvDtype::F32,
        kv_memory: usize::MAX,
        kv_reserve: false,
        gpu_memory_utilization: 0.9,
        max_context,
        default_policy: policy.clone(),
        draft: None,
        prefix_cache_bytes: 0,
        prefix_block: 16,
    }
}

fn sched(m: &Arc<Loaded>, max_batch: usize, policy: &PolicySpec) -> SchedulerHandle {
    scheduler::spawn(m.clone(), config(max_batch, MAX_CONTEXT, policy))
        .unwrap()
        .0
}

fn sink(id: usize, tx: &Sender<(usize, Event)>) -> (Box<ChannelSink>, Arc<AtomicBool>) {
    ChannelSink::new(id, tx)
}

fn request(prompt: Vec<u32>, max_tokens: usize, policy: &PolicySpec) -> Request {
    Request::greedy(prompt, max_tokens, policy.clone())
}

fn collect(rx: &Receiver<(usize, Event)>, n: usize) -> Vec<Outcome> {
    scheduler::collect(rx, n, Duration::from_secs(300))
}

/// (prompt, max_tokens) of the three requests: different lengths, the longest 56 tokens.
fn requests(vocab: usize) -> Vec<(Vec<u32>, usize)> {
    [(5usize, 20usize), (23, 12), (40, 16)]
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| {
            let p = slowfast_engine::bench::random_tokens(n, vocab, 0xA11 + i as u64);
            (p, k)
        })
        .collect()
}

fn policies(m: &Loaded) -> Vec<PolicySpec> {
    let sfi = slowfast_engine::session::policy_spec_with(
        "sfi",
        Some(36.0),
        4,
        MAX_CONTEXT,
        &SfiKnobs {
            recent: 16,
            min_gap: 2,
            refresh_interval: 6,
            ..Default::default()
        },
    )
    .unwrap()
    .with_vocab(&m.tokenizer);
    // SnapKV keeps 4 picks + a 32-token window: the 40-token prompt (and the prefix-cache
    // test's 8K ones) is compacted, the shorter ones are read whole.
    let snapkv =
        slowfast_engine::session::policy_spec("snapkv", Some(36.0), 4, MAX_CONTEXT).unwrap();
    // Quest reads 3 pages of 16: longer sequences choose pages at every step.
    let quest = slowfast_engine::session::policy_spec("quest", Some(48.0), 4, MAX_CONTEXT).unwrap();
    // H2O keeps 12 heavy hitters + 12 recent: the 40-token prompt is compacted at its end, the
    // 23-token one passes the budget while it decodes (and the prefix-cache test's 8K prompts
    // are prefilled in two parts, with dummy steps between them).
    let h2o = slowfast_engine::session::policy_spec("h2o", Some(24.0), 4, MAX_CONTEXT).unwrap();
    // FastKV keeps 28 picks + an 8-token window past layer 1 of 4: the 23- and 40-token prompts
    // propagate their window alone (20 % of them is below it), the 40-token one is compacted
    // in layers 0-1 and the 23-token one read whole there; the 5-token one is prefilled plainly.
    let fastkv =
        slowfast_engine::session::policy_spec("fastkv", Some(36.0), 4, MAX_CONTEXT).unwrap();
    vec![
        PolicySpec::Full,
        PolicySpec::Streaming {
            sinks: 4,
            recent: 28,
        },
        sfi,
        snapkv,
        quest,
        h2o,
        fastkv,
    ]
}

/// `generate --device cuda` of each request alone.
fn alone(m: &Loaded, reqs: &[(Vec<u32>, usize)], policy: &PolicySpec) -> Vec<Outcome> {
    reqs.iter()
        .map(|(p, k)| {
            let opts = GenerateOptions {
                max_new_tokens: *k,
                sampler: SamplerConfig::greedy(),
                ignore_eos: true,
                policy: policy.clone(),
                device: Device::Cuda,
                ..Default::default()
            };
            let g = generate(m, p, &opts, &mut |_| {}).unwrap();
            let fin = Finish {
                reason: scheduler::FinishReason::Length,
                text: String::new(),
                prompt_tokens: g.prompt_tokens,
                completion_tokens: g.generated_tokens,
                policy: g.policy,
                stats: g.policy_stats,
                inspection: None,
            };
            (g.tokens, Some(fin), None)
        })
        .collect()
}

/// Submits every request at once and collects them.
fn together(h: &SchedulerHandle, reqs: &[(Vec<u32>, usize)], policy: &PolicySpec) -> Vec<Outcome> {
    let (tx, rx) = channel();
    for (i, (p, k)) in reqs.iter().enumerate() {
        h.submit(request(p.clone(), *k, policy), sink(i, &tx).0)
            .unwrap();
    }
    collect(&rx, reqs.len())
}

/// Submits the requests one after another, each when the one before is done.
fn one_by_one(
    h: &SchedulerHandle,
    reqs: &[(Vec<u32>, usize)],
    policy: &PolicySpec,
) -> Vec<Outcome> {
    reqs.iter()
        .map(|(p, k)| {
            let (tx, rx) = channel();
            h.submit(request(p.clone(), *k, policy), sink(0, &tx).0)
                .unwrap();
            collect(&rx, 1).remove(0)
        })
        .collect()
}

fn check(what: &str, got: &[Outcome], want: &[Outcome], stats: bool) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.2.is_none(), "{what}: request {i} failed: {:?}", g.2);
        let (gf, wf) = (g.1.as_ref().unwrap(), w.1.as_ref().unwrap());
        assert_eq!(g.0, w.0, "{what}: request {i}: tokens");
        assert_eq!(gf.completion_tokens, wf.completion_tokens, "{what}: {i}");
        assert_eq!(gf.policy, wf.policy, "{what}: {i}");
        if stats {
            assert_eq!(
                gf.stats.slow_steps, wf.stats.slow_steps,
                "{what}: {i}: slow"
            );
            assert_eq!(
                gf.stats.fast_steps, wf.stats.fast_steps,
                "{what}: {i}: fast"
            );
        }
        let steps = gf.stats.slow_steps + gf.stats.fast_steps;
        assert_eq!(steps, gf.completion_tokens - 1, "{what}: {i}: decode steps");
    }
}

/// Tokens equal up to the first difference, over all tokens.
fn agreement(got: &[Outcome], want: &[Outcome]) -> String {
    let mut parts = Vec::new();
    for (g, w) in got.iter().zip(want) {
        let same = g.0.iter().zip(&w.0).take_while(|(a, b)| a == b).count();
        parts.push(format!("{same}/{}", w.0.len()));
    }
    parts.join(", ")
}

#[test]
fn greedy_requests_equal_generate_alone() {
    if !have_gpu("greedy_requests_equal_generate_alone") {
        return;
    }
    let m = model();
    let reqs = requests(m.model.cfg.vocab_size);
    for policy in policies(&m) {
        let name = policy.name();
        let want = alone(&m, &reqs, &policy);
        // One slot: the same kernels as `generate` (one row), so the same tokens and counts.
        let h = sched(&m, 1, &policy);
        let got = together(&h, &reqs, &policy);
        check(&format!("{name}, max_batch 1"), &got, &want, true);
        drop(h);
        // Four slots, three requests at once: each row as when it runs alone in the four-slot
        // decoder (rows are independent; at <= 64 tokens flash-decoding runs one split for any
        // batch length), and as `generate` alone.
        let h = sched(&m, 4, &policy);
        let batched = together(&h, &reqs, &policy);
        let single = one_by_one(&h, &reqs, &policy);
        let g = h.gauges();
        assert!(
            g.decode_rows.load(Ordering::Relaxed) > g.decode_steps.load(Ordering::Relaxed),
            "{name}: some steps must have decoded several rows"
        );
        eprintln!(
            "{name}: batched vs generate alone, tokens equal before the first difference: {}",
            agreement(&batched, &want)
        );
        eprintln!(
            "{name}: batched vs alone in the same slots: {}",
            agreement(&batched, &single)
        );
        if name == "sfi" {
            // A slot joining or leaving publishes the others' pending (asynchronous) refreshes
            // early, so SFI's rows may drift from their runs alone: it only has to serve them.
            for (i, b) in batched.iter().enumerate() {
                assert!(b.2.is_none(), "sfi batched: request {i}: {:?}", b.2);
                let f = b.1.as_ref().unwrap();
                assert_eq!(f.completion_tokens, reqs[i].1, "sfi batched: request {i}");
                assert_eq!(f.stats.slow_steps + f.stats.fast_steps, reqs[i].1 - 1);
            }
            continue;
        }
        check(
            &format!("{name}, 3 of 4 slots vs 1 of 4"),
            &batched,
            &single,
            true,
        );
        check(
            &format!("{name}, 3 of 4 slots vs generate"),
            &batched,
            &want,
            true,
        );
    }
}

#[test]
fn logits_path_equals_the_argmax_path() {
    if !have_gpu("logits_path_equals_the_argmax_path") {
        return;
    }
    // Asking for logprobs makes the device download the logits and the host sample from them
    // (greedy, so the same argmax): the same tokens as the argmax-only path.
    let m = model();
    let reqs = requests(m.model.cfg.vocab_size);
    let policy = PolicySpec::Full;
    let h = sched(&m, 4, &policy);
    let fast = together(&h, &reqs, &policy);
    let (tx, rx) = channel();
    for (i, (p, k)) in reqs.iter().enumerate() {
        let mut r = request(p.clone(), *k, &policy);
        r.logprobs = Some(2);
        h.submit(r, sink(i, &tx).0).unwrap();
    }
    let slow = collect(&rx, reqs.len());
    check("logprobs vs argmax", &slow, &fast, true);
}

#[test]
fn a_cancelled_request_frees_its_slot() {
    if !have_gpu("a_cancelled_request_frees_its_slot") {
        return;
    }
    let m = model();
    let policy = PolicySpec::Full;
    let h = sched(&m, 1, &policy);
    let g = h.gauges().clone();
    assert!(g.kv_bytes_capacity.load(Ordering::Relaxed) > 0);
    let (tx, rx) = channel();
    let v = m.model.cfg.vocab_size;
    let (s, closed) = sink(0, &tx);
    h.submit(
        request(
            slowfast_engine::bench::random_tokens(30, v, 1),
            200,
            &policy,
        ),
        s,
    )
    .unwrap();
    let _ = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(g.kv_bytes_in_use.load(Ordering::Relaxed) > 0);
    assert_eq!(g.running.load(Ordering::Relaxed), 1);
    closed.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    while g.running.load(Ordering::Relaxed) > 0 || g.kv_bytes_in_use.load(Ordering::Relaxed) > 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "not cancelled");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The one slot serves the next requests, as `generate` alone.
    let reqs = requests(v);
    let want = alone(&m, &reqs, &policy);
    let got = one_by_one(&h, &reqs, &policy);
    check("after a cancel", &got, &want, true);
}

#[test]
fn other_policies_are_refused() {
    if !have_gpu("other_policies_are_refused") {
        return;
    }
    let m = model();
    let streaming = PolicySpec::Streaming {
        sinks: 4,
        recent: 28,
    };
    let h = sched(&m, 2, &streaming);
    let (tx, rx) = channel();
    let v = m.model.cfg.vocab_size;
    let p = || slowfast_engine::bench::random_tokens(10, v, 2);
    h.submit(request(p(), 4, &PolicySpec::Full), sink(0, &tx).0)
        .unwrap();
    let other = PolicySpec::Streaming {
        sinks: 4,
        recent: 60,
    };
    h.submit(request(p(), 4, &other), sink(1, &tx).0).unwrap();
    h.submit(request(p(), 4, &streaming), sink(2, &tx).0)
        .unwrap();
    let got = collect(&rx, 3);
    let e0 = got[0].2.as_deref().unwrap_or("");
    assert!(e0.contains("--policy streaming; got full"), "{e0}");
    let e1 = got[1].2.as_deref().unwrap_or("");
    assert!(
        e1.contains("4 sinks + 28 recent") && e1.contains("4 sinks + 60 recent"),
        "{e1}"
    );
    assert!(got[2].2.is_none(), "{:?}", got[2].2);
    assert_eq!(got[2].0.len(), 4);
}

/// Full KV's greedy tokens of `prompt` on the GPU and each step's top-2 logit gap over the
/// row's standard deviation (random weights give logits of any scale).
fn full_kv_with_gaps(m: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    use slowfast_engine::device::Steps;
    let mut s = slowfast_engine::cuda::GpuSession::new(
        m,
        MAX_CONTEXT,
        slowfast_engine::KvDtype::F16,
        &PolicySpec::Full,
    )
    .unwrap();
    let mut logits = s.prefill(prompt, &mut |_, _| {}).unwrap().to_vec();
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    while out.len() < n {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let n = logits.len() as f64;
        let mean = logits.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = logits
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        out.push(idx[0] as u32);
        gaps.push((logits[idx[0]] - logits[idx[1]]) / var.sqrt().max(1e-9) as f32);
        logits = Steps::step(&mut s, idx[0] as u32).unwrap().to_vec();
    }
    (out, gaps)
}

/// Speculative requests batched with plain ones on a server of each policy, with its
/// drafter (sfi: every verification and on the trigger with adaptive γ; streaming; ngram on
/// full KV). Every round steps and verifies all slots, parking the others: the plain requests
/// still give `generate`'s tokens exactly (full KV, StreamingLLM; SFI's may drift, as when
/// batched at all). The speculative greedy ones give full KV's tokens, or part from them
/// only where full KV's top two logits nearly tie (the verification's GEMMs round bf16
/// otherwise than a decode step's). A sampled speculative request runs the logits path.
#[test]
fn speculative_requests_batch_with_plain_ones() {
    if !have_gpu("speculative_requests_batch_with_plain_ones") {
        return;
    }
    use slowfast_engine::spec::{DraftKind, SpecOptions, SpecTokens};
    // A verification row and a decode step of the same token differ by at most 0.35 of the
    // row's std here (`gpu_speculative`'s verification_rows_equal_decode_steps): a parting
    // within twice that is a tie.
    const TIE: f32 = 0.7;
    let m = model();
    let v = m.model.cfg.vocab_size;
    let reqs = requests(v);
    let refs: Vec<(Vec<u32>, Vec<f32>)> = reqs
        .iter()
        .map(|(p, k)| full_kv_with_gaps(&m.model, p, *k))
        .collect();
    let ps = policies(&m);
    let cases = [
        (&ps[0], DraftKind::Ngram, SpecTokens::Fixed(4), true),
        (&ps[1], DraftKind::Streaming, SpecTokens::Fixed(4), true),
        (&ps[2], DraftKind::Sfi, SpecTokens::Fixed(4), true),
        (
            &ps[2],
            DraftKind::Sfi,
            SpecTokens::Adaptive { max: 6 },
            false,
        ),
    ];
    let (mut same, mut total) = (0, 0);
    for (policy, drafter, tokens, every) in cases {
        let what = format!("{} {}", drafter.name(), tokens.label());
        let opts = SpecOptions {
            drafter,
            tokens,
            refresh_every: every,
            ..SpecOptions::default()
        };
        let h = sched(&m, 4, policy);
        let (tx, rx) = channel();
        // Requests 0 and 2 speculate, 1 decodes plainly, 3 speculates sampling.
        for (i, (p, k)) in reqs.iter().enumerate() {
            let mut r = request(p.clone(), *k, policy);
            r.speculate = (i != 1).then(|| opts.clone());
            h.submit(r, sink(i, &tx).0).unwrap();
        }
        let mut r = request(reqs[0].0.clone(), 12, policy);
        r.speculate = Some(opts.clone());
        r.sampler = SamplerConfig {
            temperature: 0.8,
            seed: 7,
            ..SamplerConfig::greedy()
        };
        h.submit(r, sink(3, &tx).0).unwrap();
        let got = collect(&rx, 4);
        for (i, g) in got.iter().enumerate() {
            assert!(g.2.is_none(), "{what}: request {i} failed: {:?}", g.2);
            let want = if i == 3 { 12 } else { reqs[i].1 };
            assert_eq!(g.0.len(), want, "{what}: request {i}: token count");
            assert!(g.0.iter().all(|&t| (t as usize) < v));
        }
        let plain = alone(&m, &reqs[1..2], policy);
        if policy.name() != "sfi" {
            check(
                &format!("{what}: the plain request"),
                &got[1..2],
                &plain,
                true,
            );
        }
        for i in [0, 2] {
            let (want, gaps) = &refs[i];
            let n = got[i]
                .0
                .iter()
                .zip(want)
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "{what}: speculative request {i}: {n}/{} tokens equal to full KV's",
                want.len()
            );
            if n < want.len() {
                assert!(
                    gaps[n] < TIE,
                    "{what}: request {i} parted from full KV at token {n}, where its top-2 gap is {} row std (not a tie)",
                    gaps[n]
                );
            }
            same += n;
            total += want.len();
        }
        let g = h.gauges();
        let (ver, drafted, accepted) = (
            g.spec_verifications.load(Ordering::Relaxed),
            g.spec_drafted.load(Ordering::Relaxed),
            g.spec_accepted.load(Ordering::Relaxed),
        );
        eprintln!("{what}: {ver} verifications, {accepted}/{drafted} drafts accepted");
        assert!(ver > 0 && accepted <= drafted, "{what}: counters");
        if drafter != DraftKind::Ngram {
            assert!(
                accepted > 0,
                "{what}: the self-drafter's drafts are never accepted"
            );
        }
    }
    assert!(
        2 * same >= total,
        "speculative requests agree with full KV on {same}/{total} tokens only"
    );
}

/// The model drafter, and a drafter of another policy than the server's, are refused.
#[test]
fn gpu_speculation_refuses_other_drafters() {
    if !have_gpu("gpu_speculation_refuses_other_drafters") {
        return;
    }
    use slowfast_engine::spec::{DraftKind, SpecOptions};
    let m = model();
    let ps = policies(&m);
    let h = sched(&m, 2, &ps[0]);
    let (tx, rx) = channel();
    let p = slowfast_engine::bench::random_tokens(10, m.model.cfg.vocab_size, 3);
    for (i, d) in [DraftKind::Model, DraftKind::Sfi].into_iter().enumerate() {
        let mut r = request(p.clone(), 4, &ps[0]);
        r.speculate = Some(SpecOptions {
            drafter: d,
            ..SpecOptions::default()
        });
        h.submit(r, sink(i, &tx).0).unwrap();
    }
    let got = collect(&rx, 2);
    let e0 = got[0].2.as_deref().unwrap_or("");
    assert!(e0.contains("model drafter runs on the CPU only"), "{e0}");
    let e1 = got[1].2.as_deref().unwrap_or("");
    assert!(
        e1.contains("needs the sfi policy") && e1.contains("runs full"),
        "{e1}"
    );
}

/// Throughput of the scheduler on the GPU with and without CUDA graphs (a timing, not a
/// check: `--ignored`): Qwen3-0.6B shapes (28 layers, random weights), 8 slots, greedy
/// requests submitted at once, so requests join and leave the batch all the time (every
/// change re-begins the decoder and re-captures the graph): 24 of 128 tokens (prompts of
/// 50-400 tokens), then 64 of 2-9 tokens (prompts of 20-80: a change nearly every step).
#[test]
#[ignore]
fn serve_throughput_with_and_without_graphs() {
    if !have_gpu("serve_throughput_with_and_without_graphs") {
        return;
    }
    let m = Arc::new(slowfast_engine::load("random:qwen3-0.6b", &mut |_| {}).unwrap());
    let v = m.model.cfg.vocab_size;
    let long: Vec<(Vec<u32>, usize)> = (0..24)
        .map(|i| {
            let n = 50 + (i * 151) % 350;
            (
                slowfast_engine::bench::random_tokens(n, v, 0x7000 + i as u64),
                128,
            )
        })
        .collect();
    let churn: Vec<(Vec<u32>, usize)> = (0..64)
        .map(|i| {
            let n = 20 + (i * 37) % 60;
            let k = 2 + (i * 5) % 8;
            (
                slowfast_engine::bench::random_tokens(n, v, 0x9000 + i as u64),
                k,
            )
        })
        .collect();
    for (what, reqs) in [("long", &long), ("churn", &churn)] {
        for graphs in ["0", "1", "0", "1"] {
            std::env::set_var("SLOWFAST_SERVE_GRAPHS", graphs);
            let cfg = SchedulerConfig {
                device: Device::Cuda,
                max_batch: 8,
                max_queue: 128,
                prefill_tokens_per_step: 512,
                chunk: 64,
                kv_dtype: KvDtype::F32,
                kv_memory: usize::MAX,
                kv_reserve: false,
                gpu_memory_utilization: 0.9,
                max_context: 1024,
                default_policy: PolicySpec::Full,
                draft: None,
                prefix_cache_bytes: 0,
                prefix_block: 16,
            };
            let h = scheduler::spawn(m.clone(), cfg).unwrap().0;
            let _ = together(&h, &reqs[..4], &PolicySpec::Full); // warm-up
            let g = h.gauges();
            let (s0, r0) = (
                g.decode_steps.load(Ordering::Relaxed),
                g.decode_rows.load(Ordering::Relaxed),
            );
            let t = Instant::now();
            let out = together(&h, reqs, &PolicySpec::Full);
            let s = t.elapsed().as_secs_f64();
            let toks: usize = out.iter().map(|o| o.0.len()).sum();
            let steps = g.decode_steps.load(Ordering::Relaxed) - s0;
            let rows = g.decode_rows.load(Ordering::Relaxed) - r0;
            eprintln!(
                "{what}, SLOWFAST_SERVE_GRAPHS={graphs}: {toks} tokens in {s:.3}s = {:.0} tok/s ({steps} decode steps, {:.2} rows a step, {:.3} ms a step)",
                toks as f64 / s,
                rows as f64 / steps.max(1) as f64,
                s * 1e3 / steps.max(1) as f64
            );
        }
    }
    std::env::remove_var("SLOWFAST_SERVE_GRAPHS");
}

/// KV pages on demand with preemption: three 7,600-token prompts decoding 300 tokens each in
/// a pool of three page steps (4 layers x K/V x 8 heads x 2 MiB = 128 MiB a step of 8,192
/// tokens). All three prompts fit at first; past about 7,680 tokens each needs a second step,
/// so the newest are preempted, wait, and are prefilled again with what they generated.
/// Every request finishes with all its tokens; the oldest, never preempted, gives exactly
/// `generate --device cuda`'s tokens (rows are independent of the batch); the pool ends
/// empty.
#[test]
fn kv_pages_preempt_and_every_request_finishes() {
    if !have_gpu("kv_pages_preempt_and_every_request_finishes") {
        return;
    }
    let m = model_with(32768, 0x9a9e);
    let step = 4 * 2 * 8 * (2usize << 20);
    let reqs: Vec<(Vec<u32>, usize)> = (0..3)
        .map(|i| {
            let p = slowfast_engine::bench::random_tokens(7600, 8192, 0x7A6E + i as u64);
            (p, 300)
        })
        .collect();
    let policy = PolicySpec::Full;
    let want = alone(&m, &reqs[..1], &policy);
    let cfg = SchedulerConfig {
        prefill_tokens_per_step: 8192,
        kv_memory: 3 * step,
        ..config(3, 16384, &policy)
    };
    let h = scheduler::spawn(m.clone(), cfg).unwrap().0;
    let t = Instant::now();
    let got = together(&h, &reqs, &policy);
    let g = h.gauges();
    let pre = g.preemptions.load(Ordering::Relaxed);
    eprintln!(
        "3 x (7600 + 300) tokens in a pool of 3 page steps: {pre} preemptions, {:.1}s; vs generate alone (request 0): {}",
        t.elapsed().as_secs_f64(),
        agreement(&got[..1], &want)
    );
    assert!(pre > 0, "the pool must have run out");
    // The two newer ones each cross a page step once; a resumed one waits for room to grow
    // instead of being preempted again at once.
    assert!(pre <= 4, "{pre} preemptions: resumed sequences thrash");
    for (i, o) in got.iter().enumerate() {
        assert!(o.2.is_none(), "request {i} failed: {:?}", o.2);
        assert_eq!(o.0.len(), 300, "request {i}");
    }
    check("the oldest, never preempted", &got[..1], &want, false);
    // Everything back: no request holds pages.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(g.kv_bytes_in_use.load(Ordering::Relaxed), 0);
    assert_eq!(g.kv_bytes_capacity.load(Ordering::Relaxed), 3 * step);
}

/// The GPU prefix cache in the server: six requests whose prompts share an 8192-token prefix
/// (one whole prefill part) and differ after it. The first prefills it and caches its pages;
/// the others map them: the cache serves 5 x 8192 tokens. Under full KV every request's greedy
/// tokens equal `generate --device cuda` alone (the same prefill parts write the same KV);
/// under SFI every request finishes. H2O shares nothing (its scores sum every prompt row): its
/// prompts run in two parts with dummy decode steps between them, and still select as one
/// prefill does, so its tokens equal `generate` alone too.
#[test]
fn prefix_cache_shares_pages_and_keeps_the_tokens() {
    if !have_gpu("prefix_cache_shares_pages_and_keeps_the_tokens") {
        return;
    }
    let m = model_with(32768, 0x9a9f);
    let shared = slowfast_engine::bench::random_tokens(8192, 8192, 0x5157);
    let reqs: Vec<(Vec<u32>, usize)> = (0..6)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(slowfast_engine::bench::random_tokens(
                40 + 9 * i,
                8192,
                0x7A11 + i as u64,
            ));
            (p, 24)
        })
        .collect();
    for policy in policies(&m).into_iter().filter(|p| p.name() != "streaming") {
        let want = alone(&m, &reqs, &policy);
        let cfg = SchedulerConfig {
            prefix_cache_bytes: usize::MAX,
            ..config(4, 16384, &policy)
        };
        let h = scheduler::spawn(m.clone(), cfg).unwrap().0;
        let got = together(&h, &reqs, &policy);
        let hits = h.gauges().prefix_hit_tokens.load(Ordering::Relaxed);
        eprintln!(
            "{}: prefix cache served {hits} tokens; vs generate alone: {}",
            policy.name(),
            agreement(&got, &want)
        );
        // H2O's scores and FastKV's propagation read the whole prompt: no prefix is shared
        let want_hits = if matches!(policy.name(), "h2o" | "fastkv") {
            0
        } else {
            5 * 8192
        };
        assert_eq!(hits, want_hits, "{}", policy.name());
        if policy.name() == "sfi" {
            // Batched SFI rows may part from their runs alone (see
            // greedy_requests_equal_generate_alone): every request finishes.
            for (i, g) in got.iter().enumerate() {
                assert!(g.2.is_none(), "sfi: request {i}: {:?}", g.2);
                assert_eq!(g.0.len(), 24, "sfi: request {i}");
            }
            continue;
        }
        check(
            &format!("{} with the prefix cache", policy.name()),
            &got,
            &want,
            false,
        );
    }
}
