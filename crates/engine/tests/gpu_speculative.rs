//! Speculative decoding on the GPU. The verification pass (`GpuDecoder::verify`: γ + 1 rows a
//! sequence, one dense `attn_verify` launch a layer) against plain decode steps of the same
//! tokens, batched, on fixtures and real shapes (every row's logits; rewinding keeps SFI's
//! memory). On the default model (`SLOWFAST_DEFAULT_MODEL`), 256 greedy tokens at an 8K
//! context from each drafter against full KV's plain decode on the GPU: the verification's
//! multi-row products (cuBLAS) and a decode step's one-row GEMV round bf16 differently, so the
//! texts may part, but only at a near-tie of full KV's logits, which the test checks; the
//! same through the serving scheduler, three requests batched per drafter. Skips
//! without a GPU unless SLOWFAST_REQUIRE_GPU=1.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use slowfast_cuda::{CudaContext, GpuKvPolicy};
use slowfast_engine::cuda::{load_decoder, GpuSession};
use slowfast_engine::device::Steps;
use slowfast_engine::sampler::{Sampler, SamplerConfig};
use slowfast_engine::session::{policy_spec, KvDtype, PolicySpec};
use slowfast_engine::spec::{DraftKind, SpecOptions, SpecTarget, SpecTokens, Speculator};
use slowfast_model::Model;

mod gpu_common;
use gpu_common::gpu;

/// The bench's pseudo-random tokens, from a spread-out odd seed.
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    slowfast_engine::bench::random_tokens(n, vocab, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}

/// Max |a - b| over a row, over the row's standard deviation.
fn row_err(a: &[f32], b: &[f32]) -> f64 {
    let n = b.len() as f64;
    let mean = b.iter().map(|&x| x as f64).sum::<f64>() / n;
    let sd = (b.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    let worst = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max);
    worst / sd.max(1e-9)
}

/// SFI with a small memory (4 sinks, 64 recent, 128 selected), for sequences of a few hundred
/// tokens.
fn small_sfi() -> GpuKvPolicy {
    GpuKvPolicy::Sfi(slowfast_cuda::GpuSfiConfig {
        sinks: 4,
        recent: 64,
        selected: 128,
        page: 16,
        bootstrap_rows: 16,
        selector: slowfast_cuda::ops::sfi::SelectorConfig::default(),
        refresh_lag: 0,
        candidates: 0.0,
    })
}

/// Decodes `k` given tokens on every slot with plain decode steps (their logits), rewinds,
/// verifies the same tokens in one pass and returns the worst row error between the two.
fn verify_against_steps(
    ctx: &Arc<CudaContext>,
    m: &Model,
    policy: GpuKvPolicy,
    lens: &[usize],
    k: usize,
) -> f64 {
    let v = m.cfg.vocab_size;
    let b = lens.len();
    let cap = lens.iter().max().unwrap() + 2 * k + 8;
    let mut dec = load_decoder(ctx.clone(), m, b, cap, 256).unwrap();
    for (s, &n) in lens.iter().enumerate() {
        dec.prefill(s, &tokens(n, v, 7 + s as u64), false).unwrap();
    }
    dec.set_policy(policy).unwrap();
    // One step first: SFI's bridge builds the memory the later fast steps read.
    let fed: Vec<Vec<u32>> = (0..b).map(|s| tokens(k + 1, v, 50 + s as u64)).collect();
    dec.set_next(&fed.iter().map(|f| f[0]).collect::<Vec<_>>())
        .unwrap();
    dec.begin_decode().unwrap();
    dec.decode_step().unwrap();
    let p0: Vec<usize> = (0..b).map(|s| dec.slot_len(s)).collect();
    // Dense reference: the same tokens as plain steps under full KV.
    let mut want = vec![Vec::new(); b];
    let sfi_mem = dec.compact_memory(0).unwrap();
    dec.set_policy(GpuKvPolicy::Full).unwrap();
    for i in 1..=k {
        dec.set_next(&fed.iter().map(|f| f[i]).collect::<Vec<_>>())
            .unwrap();
        dec.begin_decode().unwrap();
        dec.decode_step().unwrap();
        let l = dec.logits().unwrap();
        for s in 0..b {
            want[s].push(l[s * v..(s + 1) * v].to_vec());
        }
    }
    for (s, &l) in p0.iter().enumerate() {
        dec.rewind(s, l).unwrap();
    }
    let flat: Vec<u32> = fed.iter().flat_map(|f| f[1..].to_vec()).collect();
    dec.verify(&flat, k, &vec![false; b]).unwrap();
    let got = dec.verify_logits().unwrap();
    assert_eq!(dec.slot_len(0), p0[0] + k);
    let mut worst = 0.0f64;
    for s in 0..b {
        for i in 0..k {
            let r = &got[(s * k + i) * v..(s * k + i + 1) * v];
            worst = worst.max(row_err(r, &want[s][i]));
        }
    }
    // A rewind within the memory's length keeps SFI's memory (checked on the SFI decoder).
    if let Some(mem) = sfi_mem {
        let mut d2 = load_decoder(ctx.clone(), m, 1, cap, 256).unwrap();
        d2.prefill(0, &tokens(lens[0], v, 7), false).unwrap();
        d2.set_policy(policy).unwrap();
        d2.set_next(&[fed[0][0]]).unwrap();
        d2.begin_decode().unwrap();
        d2.decode_step().unwrap();
        assert_eq!(d2.compact_memory(0).unwrap().unwrap(), mem);
        d2.set_next(&[fed[0][1]]).unwrap();
        d2.decode_step().unwrap();
        d2.rewind(0, p0[0]).unwrap();
        assert_eq!(
            d2.compact_memory(0).unwrap().unwrap(),
            mem,
            "rewind dropped SFI's memory"
        );
    }
    worst
}

#[test]
fn verification_rows_equal_decode_steps() {
    let Some(ctx) = gpu("verification_rows_equal_decode_steps") else {
        return;
    };
    for name in ["random:qwen3-0.6b", "random:gemma3-270m"] {
        let m = slowfast_engine::load(name, &mut |_| {}).unwrap().model;
        for k in [1usize, 3, 7] {
            let e = verify_against_steps(&ctx, &m, GpuKvPolicy::Full, &[700, 300, 1200], k);
            eprintln!("{name}: {k} rows a sequence x 3: worst logits error {e:.4} (row std)");
            assert!(
                e < 0.35,
                "{name}: verification rows off the decode steps ({e})"
            );
        }
        // One sequence and few rows (a pass of 2-4 rows in all), short and long.
        for lens in [&[43usize][..], &[700], &[300, 40]] {
            for k in [2usize, 3, 4] {
                let e = verify_against_steps(&ctx, &m, GpuKvPolicy::Full, lens, k);
                eprintln!(
                    "{name}: {k} rows a sequence x {lens:?}: worst logits error {e:.4} (row std)"
                );
                assert!(
                    e < 0.35,
                    "{name}: verification rows off the decode steps ({e}, {lens:?} x {k})"
                );
            }
        }
        let sfi = small_sfi();
        let e = verify_against_steps(&ctx, &m, sfi, &[900], 5);
        assert!(e < 0.35, "{name}: verification rows off under SFI ({e})");
    }
}

/// A verification replayed from its CUDA graph gives the logits of the same verification
/// launched kernel by kernel, bit for bit, over rounds that grow and rewind the sequences (the
/// graph reads the new lengths from the device), under full KV and SFI without score capture,
/// on a model with sliding layers and one without.
#[test]
fn verification_graphs_replay_the_eager_pass() {
    let Some(ctx) = gpu("verification_graphs_replay_the_eager_pass") else {
        return;
    };
    let sfi = small_sfi();
    for name in ["random:qwen3-0.6b", "random:gemma3-270m"] {
        let m = slowfast_engine::load(name, &mut |_| {}).unwrap().model;
        let v = m.cfg.vocab_size;
        for policy in [GpuKvPolicy::Full, sfi] {
            let lens = [700usize, 300, 1200];
            let b = lens.len();
            let mut decs: Vec<_> = [false, true]
                .into_iter()
                .map(|graphs| {
                    let mut d = load_decoder(ctx.clone(), &m, b, 1400, 256).unwrap();
                    for (s, &n) in lens.iter().enumerate() {
                        d.prefill(s, &tokens(n, v, 7 + s as u64), false).unwrap();
                    }
                    d.set_policy(policy).unwrap();
                    d.set_next(&[1, 2, 3]).unwrap();
                    d.begin_decode().unwrap();
                    d.decode_step().unwrap();
                    d.set_verify_graphs(graphs);
                    d
                })
                .collect();
            for round in 0..6u64 {
                let rows = [3usize, 5][round as usize % 2];
                let fed = tokens(b * rows, v, 90 + round);
                let mut got = Vec::new();
                for d in decs.iter_mut() {
                    d.verify(&fed, rows, &[false; 3]).unwrap();
                    got.push((d.verify_logits().unwrap(), d.verify_argmax().unwrap()));
                    // Keep a different share of each slot's rows, as acceptance would.
                    for s in 0..b {
                        let keep = (s + round as usize) % (rows + 1);
                        d.rewind(s, d.slot_len(s) - rows + keep).unwrap();
                    }
                }
                assert!(
                    got[0] == got[1],
                    "{name} round {round}: the graph's verification differs"
                );
            }
            // Two shapes (3 and 5 rows), every span within 2048 (the splits' plan): each
            // captured once, then replayed.
            let kind = format!("{policy:?}");
            let kind = kind.split('(').next().unwrap_or_default();
            let (captured, replays) = decs[1].verify_graph_counts();
            eprintln!("{name} {kind}: {captured} graphs, {replays} replays of 6");
            assert_eq!((captured, replays), (2, 4), "{name} {kind}");
            assert_eq!(decs[0].verify_graph_counts(), (0, 0));
        }
    }
}

/// Full KV's greedy tokens and each step's top-2 logit gap, on the GPU.
fn plain_greedy(m: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut s = GpuSession::new(
        m,
        prompt.len() + n + 40,
        slowfast_engine::KvDtype::F16,
        &PolicySpec::Full,
    )
    .unwrap();
    let mut smp = Sampler::new(SamplerConfig::greedy(), m.cfg.vocab_size).unwrap();
    prompt.iter().for_each(|&t| smp.accept(t));
    let mut logits = s.prefill(prompt, &mut |_, _| {}).unwrap().to_vec();
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    while out.len() < n {
        let t = smp.sample_and_accept(&logits).unwrap();
        let top = logits[t as usize];
        let second = logits
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != t as usize)
            .map(|(_, &x)| x)
            .fold(f32::NEG_INFINITY, f32::max);
        out.push(t);
        gaps.push(top - second);
        logits = Steps::step(&mut s, t).unwrap().to_vec();
    }
    (out, gaps)
}

/// English prose and technical text of this repository's docs (the GPU machine has no
/// Debian texts), for prompts.
fn docs_text() -> String {
    let mut root = std::env::current_dir().unwrap();
    while !root.join("docs/results.md").is_file() {
        assert!(
            root.pop(),
            "run from the repository (docs/results.md is the prompt)"
        );
    }
    let mut text = String::new();
    for f in [
        "README.md",
        "docs/results.md",
        "docs/benchmarks.md",
        "docs/serving.md",
    ] {
        text.push_str(&std::fs::read_to_string(root.join(f)).unwrap_or_default());
    }
    text
}

/// The server's batched speculation on the default model: three greedy requests of 1.5K,
/// 2.5K and 3.5K tokens at once through the GPU scheduler, per drafter, against full KV's
/// plain decode of each alone (parting only at a near-tie, as above).
#[test]
fn default_model_served_speculation_is_full_kv() {
    use slowfast_engine::scheduler::{self, ChannelSink, Request, SchedulerConfig};
    let Ok(path) = std::env::var("SLOWFAST_DEFAULT_MODEL") else {
        eprintln!("default_model_served_speculation_is_full_kv: skipped (set SLOWFAST_DEFAULT_MODEL to the gguf)");
        return;
    };
    if gpu("default_model_served_speculation_is_full_kv").is_none() {
        return;
    }
    const NEW: usize = 64;
    const CONTEXT: usize = 4096;
    let m = Arc::new(slowfast_engine::load(&path, &mut |_| {}).unwrap());
    let all = m.tokenizer.encode(&docs_text(), true).unwrap();
    let prompts: Vec<Vec<u32>> = [(0usize, 1500usize), (1800, 2500), (4300, 3500)]
        .iter()
        .map(|&(a, n)| all[a..a + n].to_vec())
        .collect();
    let refs: Vec<(Vec<u32>, Vec<f32>)> = prompts
        .iter()
        .map(|p| plain_greedy(&m.model, p, NEW))
        .collect();
    let cases = [
        ("sfi/6/every", DraftKind::Sfi, SpecTokens::Fixed(6), true),
        (
            "sfi/adaptive/trigger",
            DraftKind::Sfi,
            SpecTokens::Adaptive { max: 8 },
            false,
        ),
        (
            "streaming/4",
            DraftKind::Streaming,
            SpecTokens::Fixed(4),
            true,
        ),
        ("ngram/6", DraftKind::Ngram, SpecTokens::Fixed(6), true),
    ];
    for (name, kind, tokens, every) in cases {
        let policy = match kind {
            DraftKind::Sfi => policy_spec("sfi", Some(0.2), 4, CONTEXT)
                .unwrap()
                .with_vocab(&m.tokenizer),
            DraftKind::Streaming => policy_spec("streaming", Some(0.2), 4, CONTEXT).unwrap(),
            _ => PolicySpec::Full,
        };
        let cfg = SchedulerConfig {
            device: slowfast_engine::Device::Cuda,
            max_batch: 3,
            max_queue: 8,
            prefill_tokens_per_step: 4096,
            chunk: 512,
            kv_dtype: KvDtype::F32,
            kv_memory: usize::MAX,
            kv_reserve: false,
            gpu_memory_utilization: 0.9,
            max_context: CONTEXT,
            default_policy: policy.clone(),
            draft: None,
            prefix_cache_bytes: 0,
            prefix_block: 16,
        };
        let h = scheduler::spawn(m.clone(), cfg).unwrap().0;
        let (tx, rx) = std::sync::mpsc::channel();
        for (i, p) in prompts.iter().enumerate() {
            let mut r = Request::greedy(p.clone(), NEW, policy.clone());
            r.ignore_eos = true;
            r.speculate = Some(SpecOptions {
                drafter: kind,
                tokens,
                refresh_every: every,
                ..SpecOptions::default()
            });
            h.submit(r, ChannelSink::new(i, &tx).0).unwrap();
        }
        let got = scheduler::collect(&rx, prompts.len(), std::time::Duration::from_secs(600));
        let g = h.gauges();
        let (drafted, accepted) = (
            g.spec_drafted.load(std::sync::atomic::Ordering::Relaxed),
            g.spec_accepted.load(std::sync::atomic::Ordering::Relaxed),
        );
        for (i, (o, (want, gaps))) in got.iter().zip(&refs).enumerate() {
            assert!(o.2.is_none(), "{name}: request {i} failed: {:?}", o.2);
            assert_eq!(o.0.len(), NEW, "{name}: request {i}");
            let same = o.0.iter().zip(want).take_while(|(a, b)| a == b).count();
            eprintln!(
                "served {name}: request {i}: {same}/{NEW} tokens equal to full KV's; {accepted}/{drafted} drafts accepted over the batch"
            );
            if same < NEW {
                assert!(
                    gaps[same] < 0.15,
                    "served {name}: request {i} parted from full KV at token {same} where its top-2 gap is {:.3} (not a tie)",
                    gaps[same]
                );
            }
        }
        assert!(accepted > 0, "{name}: no draft accepted");
    }
}

#[test]
fn default_model_speculative_greedy_is_full_kv_at_8k() {
    let Ok(path) = std::env::var("SLOWFAST_DEFAULT_MODEL") else {
        eprintln!("default_model_speculative_greedy_is_full_kv_at_8k: skipped (set SLOWFAST_DEFAULT_MODEL to the gguf)");
        return;
    };
    if gpu("default_model_speculative_greedy_is_full_kv_at_8k").is_none() {
        return;
    }
    const NEW: usize = 256;
    const CONTEXT: usize = 8192;
    let m = slowfast_engine::load(&path, &mut |_| {}).unwrap();
    let mut prompt = m.tokenizer.encode(&docs_text(), true).unwrap();
    assert!(
        prompt.len() > CONTEXT - NEW,
        "docs too short for the prompt"
    );
    prompt.truncate(CONTEXT - NEW);
    let (want, gaps) = plain_greedy(&m.model, &prompt, NEW);
    let budget = Some(0.2);
    let cases = [
        ("sfi/6/every", DraftKind::Sfi, 6, true),
        ("sfi/4/trigger", DraftKind::Sfi, 4, false),
        ("streaming/4", DraftKind::Streaming, 4, true),
        ("ngram/6", DraftKind::Ngram, 6, true),
    ];
    for (name, kind, g, every) in cases {
        let policy = match kind {
            DraftKind::Sfi => policy_spec("sfi", budget, 4, CONTEXT)
                .unwrap()
                .with_vocab(&m.tokenizer),
            DraftKind::Streaming => policy_spec("streaming", budget, 4, CONTEXT).unwrap(),
            _ => PolicySpec::Full,
        };
        let mut s = GpuSession::new(
            &m.model,
            CONTEXT + 64,
            slowfast_engine::KvDtype::F16,
            &policy,
        )
        .unwrap();
        s.prefill(&prompt, &mut |_, _| {}).unwrap();
        let o = SpecOptions {
            drafter: kind,
            tokens: SpecTokens::Fixed(g),
            refresh_every: every,
            ..SpecOptions::default()
        };
        let greedy = SamplerConfig::greedy();
        let mut spec = Speculator::new(&mut s, &prompt, o, None, KvDtype::F32, &greedy).unwrap();
        let mut smp = Sampler::new(greedy, m.model.cfg.vocab_size).unwrap();
        prompt.iter().for_each(|&t| smp.accept(t));
        let mut got = vec![smp.sample_and_accept(Steps::logits(&s)).unwrap()];
        while got.len() < NEW {
            let last = *got.last().unwrap();
            got.extend(
                spec.round(
                    &mut s as &mut dyn SpecTarget,
                    last,
                    &mut smp,
                    NEW - got.len(),
                )
                .unwrap(),
            );
        }
        got.truncate(NEW);
        let st = spec.stats();
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{name}: {same}/{NEW} tokens equal to full KV's; acceptance {:.3}, {:.2} tokens a verification",
            st.acceptance_rate(),
            st.tokens_per_verification()
        );
        if same < NEW {
            // The texts part only where full KV's top two logits nearly tie (bf16 rounding).
            assert!(
                gaps[same] < 0.15,
                "{name}: parted from full KV at token {same} where its top-2 gap is {:.3} (not a tie)",
                gaps[same]
            );
        }
    }
}
