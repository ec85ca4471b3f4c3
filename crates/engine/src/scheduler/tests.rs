//! The scheduler on the tiny Qwen3 fixture: batched greedy output equals `generate` alone for
//! mixed prompt lengths and policies, prefill interleaves with decoding, cancellation frees
//! the KV, the queue is bounded, and bad requests fail alone.
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use super::*;
use crate::generate::{generate, GenerateOptions};
use crate::session::policy_spec;

fn loaded() -> Arc<Loaded> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen3");
    Arc::new(crate::load(dir.to_str().unwrap(), &mut |_| {}).unwrap())
}

fn cfg(max_batch: usize, max_queue: usize) -> SchedulerConfig {
    SchedulerConfig {
        device: Device::Cpu,
        max_batch,
        max_queue,
        prefill_tokens_per_step: 16,
        chunk: 16,
        kv_dtype: KvDtype::F32,
        kv_memory: usize::MAX,
        kv_reserve: false,
        gpu_memory_utilization: 0.9,
        max_context: 256,
        default_policy: PolicySpec::Full,
        draft: None,
        prefix_cache_bytes: 0,
        prefix_block: 16,
    }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11 + salt * 101) % 500 + 6)
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, policy: PolicySpec) -> Request {
    Request::greedy(prompt, max_tokens, policy)
}

fn collect(rx: &Receiver<(usize, Event)>, n: usize) -> Vec<Outcome> {
    super::collect(rx, n, Duration::from_secs(120))
}

/// The SFI knobs of these tests: a short window and frequent refreshes for short prompts.
fn sfi_knobs() -> crate::session::SfiKnobs {
    crate::session::SfiKnobs {
        recent: 8,
        min_gap: 2,
        refresh_interval: 6,
        ..Default::default()
    }
}

/// What `generate` gives for `prompt` alone (greedy, ignoring EOS, chunk 16, KV in `kv`).
fn alone(
    m: &Loaded,
    prompt: &[u32],
    max_tokens: usize,
    spec: &PolicySpec,
    kv: KvDtype,
) -> crate::generate::GenerateOutput {
    let opts = GenerateOptions {
        max_new_tokens: max_tokens,
        sampler: SamplerConfig::greedy(),
        ignore_eos: true,
        kv_dtype: kv,
        chunk: 16,
        policy: spec.clone(),
        ..Default::default()
    };
    generate(m, prompt, &opts, &mut |_| {}).unwrap()
}

/// Every request's tokens and slow / fast step counts equal its run alone.
fn assert_as_alone(got: &[Outcome], want: &[crate::generate::GenerateOutput], names: &[&str]) {
    assert_eq!(got.len(), want.len());
    for (i, ((toks, fin, err), w)) in got.iter().zip(want).enumerate() {
        assert!(err.is_none(), "request {i}: {err:?}");
        assert_eq!(toks, &w.tokens, "request {i} ({})", names[i]);
        let f = fin.as_ref().unwrap();
        assert_eq!(f.reason, FinishReason::Length);
        assert_eq!(f.completion_tokens, w.generated_tokens);
        assert_eq!(f.policy, w.policy);
        assert_eq!(f.stats.slow_steps, w.policy_stats.slow_steps, "request {i}");
        assert_eq!(f.stats.fast_steps, w.policy_stats.fast_steps, "request {i}");
    }
}

#[test]
fn batched_greedy_equals_generate_alone() {
    let m = loaded();
    let (h, _t) = spawn(m.clone(), cfg(8, 16)).unwrap();
    let (tx, rx) = channel();
    let lens = [3usize, 40, 17, 120, 64, 9];
    let policies = ["full", "sfi", "streaming", "sfi", "h2o", "full"];
    let mut want = Vec::new();
    for (i, (&n, &p)) in lens.iter().zip(&policies).enumerate() {
        let prompt = tokens(n, i as u32);
        let max_tokens = 12 + 3 * i;
        let budget = (p != "full").then_some(24.0);
        let spec = match p {
            "sfi" => crate::session::policy_spec_with(p, budget, 2, n + max_tokens, &sfi_knobs()),
            _ => policy_spec(p, budget, 2, n + max_tokens),
        }
        .unwrap()
        .with_vocab(&m.tokenizer);
        want.push(alone(&m, &prompt, max_tokens, &spec, KvDtype::F32));
        let (sink, _) = ChannelSink::new(i, &tx);
        h.submit(request(prompt, max_tokens, spec), sink).unwrap();
    }
    assert_as_alone(&collect(&rx, lens.len()), &want, &policies);
    assert!(
        h.gauges().decode_rows.load(Ordering::Relaxed)
            > h.gauges().decode_steps.load(Ordering::Relaxed),
        "some decode steps must have batched several rows"
    );
}

#[test]
fn speculative_requests_in_a_batch_give_full_kv_tokens() {
    use crate::spec::{DraftKind, SpecOptions, SpecTokens};
    let m = loaded();
    let mut c = cfg(8, 16);
    c.draft = Some(loaded());
    let (h, _t) = spawn(m.clone(), c).unwrap();
    let (tx, rx) = channel();
    // Plain rows and speculative sequences side by side; the output is full KV's.
    let kinds = [
        (None, "full"),
        (Some(DraftKind::Ngram), "full"),
        (Some(DraftKind::Streaming), "streaming"),
        (None, "streaming"),
        (Some(DraftKind::Sfi), "sfi"),
        (Some(DraftKind::Model), "full"),
    ];
    let mut want = Vec::new();
    for (i, &(drafter, p)) in kinds.iter().enumerate() {
        let prompt = tokens(30 + 20 * i, i as u32);
        let max_tokens = 20 + 3 * i;
        let ctx = prompt.len() + max_tokens;
        let budget = (p != "full").then_some(24.0);
        let spec = crate::session::policy_spec_with(p, budget, 2, ctx, &sfi_knobs())
            .unwrap()
            .with_vocab(&m.tokenizer);
        // Lossless: a speculative sequence gives full KV's tokens.
        let exact = if drafter.is_some() {
            &PolicySpec::Full
        } else {
            &spec
        };
        want.push(alone(&m, &prompt, max_tokens, exact, KvDtype::F32).tokens);
        let mut r = request(prompt, max_tokens, spec);
        r.speculate = drafter.map(|d| SpecOptions {
            drafter: d,
            tokens: SpecTokens::Fixed(4),
            ..SpecOptions::default()
        });
        let (sink, _) = ChannelSink::new(i, &tx);
        h.submit(r, sink).unwrap();
    }
    let got = collect(&rx, kinds.len());
    for (i, ((toks, fin, err), w)) in got.iter().zip(&want).enumerate() {
        assert!(err.is_none(), "request {i}: {err:?}");
        assert_eq!(toks, w, "request {i} ({:?})", kinds[i]);
        assert_eq!(fin.as_ref().unwrap().reason, FinishReason::Length);
    }
    let g = h.gauges();
    let (d, a, v) = (
        g.spec_drafted.load(Ordering::Relaxed),
        g.spec_accepted.load(Ordering::Relaxed),
        g.spec_verifications.load(Ordering::Relaxed),
    );
    assert!(
        v > 0 && a > 0 && a <= d,
        "drafted {d}, accepted {a}, verifications {v}"
    );
    // A speculative request asking for logprobs is refused, alone.
    let mut r = request(tokens(10, 9), 4, PolicySpec::Full);
    r.logprobs = Some(2);
    r.speculate = Some(SpecOptions::default());
    let (sink, _) = ChannelSink::new(0, &tx);
    h.submit(r, sink).unwrap();
    let (_, _, err) = collect(&rx, 1).remove(0);
    assert!(err.unwrap().contains("logprobs"));
}

#[test]
fn long_prefill_interleaves_with_decoding() {
    let m = loaded();
    let (h, _t) = spawn(m.clone(), cfg(4, 4)).unwrap();
    let (tx, rx) = channel();
    let sink = |id| ChannelSink::new(id, &tx).0;
    h.submit(request(tokens(4, 0), 60, PolicySpec::Full), sink(0))
        .unwrap();
    // Let request 0 start decoding, then a 200-token prompt (13 chunks of 16) arrives.
    let first = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(matches!(first, (0, Event::Token(_))));
    h.submit(request(tokens(200, 1), 4, PolicySpec::Full), sink(1))
        .unwrap();
    let mut tokens_of_0_before_1 = 0;
    loop {
        match rx.recv_timeout(Duration::from_secs(30)).unwrap() {
            (0, Event::Token(_)) => tokens_of_0_before_1 += 1,
            (1, Event::Token(_)) => break,
            (_, e) => panic!("unexpected {e:?}"),
        }
    }
    assert!(
        tokens_of_0_before_1 >= 10,
        "request 0 produced only {tokens_of_0_before_1} tokens while 1 prefilled in 13 chunks"
    );
}

#[test]
fn a_closed_sink_cancels_and_frees_the_kv() {
    let m = loaded();
    let (h, _t) = spawn(m.clone(), cfg(4, 4)).unwrap();
    let (tx, rx) = channel();
    let (sink, closed) = ChannelSink::new(0, &tx);
    h.submit(request(tokens(30, 0), 200, PolicySpec::Full), sink)
        .unwrap();
    let _ = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(h.gauges().kv_bytes_in_use.load(Ordering::Relaxed) > 0);
    closed.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    while h.gauges().running.load(Ordering::Relaxed) > 0
        || h.gauges().kv_bytes_in_use.load(Ordering::Relaxed) > 0
    {
        assert!(t0.elapsed() < Duration::from_secs(10), "not cancelled");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The scheduler goes on serving (on a channel of its own: tokens the cancelled request
    // sent before it stopped may still sit in the first one).
    let (tx2, rx2) = channel();
    let (sink, _) = ChannelSink::new(0, &tx2);
    h.submit(request(tokens(5, 3), 3, PolicySpec::Full), sink)
        .unwrap();
    let got = collect(&rx2, 1);
    assert_eq!(got[0].0.len(), 3);
}

#[test]
fn the_queue_is_bounded() {
    let m = loaded();
    let (h, _t) = spawn(m.clone(), cfg(1, 1)).unwrap();
    let (tx, _rx) = channel();
    let mut refused = 0;
    for i in 0..4 {
        let (sink, _) = ChannelSink::new(i, &tx);
        if let Err(e) = h.submit(request(tokens(20, 0), 150, PolicySpec::Full), sink) {
            assert!(matches!(e, SubmitError::QueueFull(1)), "{e}");
            refused += 1;
        }
    }
    // One running + one waiting at most: of four, at least two are refused.
    assert!(refused >= 2, "refused {refused}");
}

#[test]
fn bad_requests_fail_alone() {
    let m = loaded();
    let (h, _t) = spawn(m.clone(), cfg(4, 4)).unwrap();
    let (tx, rx) = channel();
    let sink = |id| ChannelSink::new(id, &tx).0;
    // Longer than the model's 256 positions; empty; a good one beside them.
    h.submit(request(tokens(300, 0), 4, PolicySpec::Full), sink(0))
        .unwrap();
    h.submit(request(Vec::new(), 4, PolicySpec::Full), sink(1))
        .unwrap();
    h.submit(request(tokens(8, 0), 4, PolicySpec::Full), sink(2))
        .unwrap();
    let got = collect(&rx, 3);
    assert!(got[0].2.as_ref().unwrap().contains("300 tokens"), "{got:?}");
    assert!(got[1].2.as_ref().unwrap().contains("empty"));
    assert_eq!(got[2].0.len(), 4);
    assert_eq!(got[2].1.as_ref().unwrap().prompt_tokens, 8);
}

#[test]
fn logprobs_match_a_plain_reference() {
    let mut rng = crate::sampler::Rng::new(7);
    for trial in 0..20 {
        let n = 50 + trial * 13;
        let logits: Vec<f32> = (0..n)
            .map(|i| {
                if i % 17 == 3 {
                    2.5 // ties: the lower id first
                } else {
                    (rng.next_f64() * 6.0 - 3.0) as f32
                }
            })
            .collect();
        let tok = (trial * 7 % n) as u32;
        let got = sequence::logprob_of(&logits, tok, 5);
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let lp = |i: usize| ((logits[i] as f64).exp() / z).ln();
        assert!((got.logprob as f64 - lp(tok as usize)).abs() < 1e-5);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        let want: Vec<u32> = order[..5].iter().map(|&i| i as u32).collect();
        assert_eq!(ids, want);
        for &(i, l) in &got.top {
            assert!((l as f64 - lp(i as usize)).abs() < 1e-5);
        }
    }
}

/// A device whose every sequence predicts token 7, and whose first decode step panics.
struct Flaky {
    logits: Vec<f32>,
    panicked: Arc<AtomicBool>,
}

impl BatchDevice for Flaky {
    type Seq = usize;
    fn kv_estimate(&self, _: &PolicySpec, _: usize, _: usize) -> usize {
        1
    }
    fn open(&mut self, _: &PolicySpec, _: usize) -> Result<usize, EngineError> {
        Ok(0)
    }
    fn prefill_plan(&self, _: &usize, n: usize) -> Vec<(usize, usize)> {
        vec![(0, n)]
    }
    fn prefill_part(
        &mut self,
        _: &mut usize,
        _: &[u32],
        _: &[(usize, usize)],
        _: usize,
    ) -> Result<(), EngineError> {
        Ok(())
    }
    fn decode(&mut self, seqs: &mut [&mut usize], _: &[u32], _: bool) -> Result<(), EngineError> {
        if !self.panicked.swap(true, Ordering::SeqCst) {
            panic!("a bug in a decode step");
        }
        seqs.iter_mut().for_each(|s| **s += 1);
        Ok(())
    }
    fn logits<'a>(&'a self, _: &'a usize) -> &'a [f32] {
        &self.logits
    }
    fn kv_bytes(&self, _: &usize) -> usize {
        1
    }
    fn stats(&self, _: &usize) -> PolicyStats {
        PolicyStats::default()
    }
    fn policy_name(&self, _: &usize) -> &'static str {
        "full"
    }
    fn close(&mut self, _: usize) {}
}

#[test]
fn a_panicking_step_fails_its_requests_and_the_scheduler_goes_on() {
    let m = loaded();
    let vocab = m.model.cfg.vocab_size;
    let mut logits = vec![0.0f32; vocab];
    logits[7] = 5.0;
    let panicked = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let g = Arc::new(Gauges::default());
    let handle = SchedulerHandle {
        tx,
        gauges: g.clone(),
        max_queue: 8,
    };
    let (etx, erx) = channel();
    let sink = |id| ChannelSink::new(id, &etx).0;
    handle
        .submit(request(tokens(4, 0), 5, PolicySpec::Full), sink(0))
        .unwrap();
    let (m2, g2, p2) = (m.clone(), g.clone(), panicked.clone());
    let t = std::thread::spawn(move || {
        let c = cfg(4, 8);
        supervise(&m2, &c, &rx, &g2, || {
            Ok(Flaky {
                logits: logits.clone(),
                panicked: p2.clone(),
            })
        })
    });
    // Request 0 got its first token (from the prefill), then its decode step panicked: its
    // sink is dropped without a Done.
    let mut got0 = Vec::new();
    while let Ok((id, ev)) = erx.recv_timeout(Duration::from_secs(10)) {
        assert_eq!(id, 0);
        got0.push(ev);
        if panicked.load(Ordering::SeqCst) {
            break;
        }
    }
    assert!(panicked.load(Ordering::SeqCst));
    assert!(got0.iter().all(|e| !matches!(e, Event::Done(_))));
    // A later request is served by the restarted loop.
    handle
        .submit(request(tokens(4, 1), 3, PolicySpec::Full), sink(1))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut toks = Vec::new();
    loop {
        let (id, ev) = erx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the restarted scheduler answers");
        if id != 1 {
            continue;
        }
        match ev {
            Event::Token(t) => toks.push(t.id),
            Event::Done(f) => {
                assert_eq!(f.completion_tokens, 3);
                break;
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(toks, vec![7, 7, 7]);
    drop(handle);
    t.join().unwrap();
}

#[test]
fn inspection_reports_what_each_policy_holds_at_the_end() {
    let m = loaded();
    let (h, _t) = spawn(m.clone(), cfg(4, 16)).unwrap();
    let (tx, rx) = channel();
    let (n, max_tokens) = (120usize, 20usize);
    let knobs = sfi_knobs();
    let policies = ["sfi", "streaming", "full", "sfi"];
    for (i, p) in policies.iter().enumerate() {
        let budget = (*p != "full").then_some(24.0);
        let spec = crate::session::policy_spec_with(p, budget, 2, n + max_tokens, &knobs)
            .unwrap()
            .with_vocab(&m.tokenizer);
        let mut req = request(tokens(n, 3), max_tokens, spec);
        req.inspect = i < 3; // the last one does not ask
        let (sink, _) = ChannelSink::new(i, &tx);
        h.submit(req, sink).unwrap();
    }
    let got = collect(&rx, policies.len());
    let fin = |i: usize| got[i].1.as_ref().unwrap();
    // Every position fed: the prompt and the generated tokens but the last.
    let len = n + max_tokens - 1;
    let layers = m.model.cfg.num_hidden_layers;

    let f = fin(0);
    let ins = f.inspection.as_ref().expect("asked for");
    assert_eq!(ins.positions, len);
    assert_eq!(ins.layers.len(), layers);
    for l in &ins.layers {
        assert_eq!(l.heads.len(), m.model.cfg.num_key_value_heads);
        for hd in &l.heads {
            assert_eq!(hd.sinks, vec![[0, 2]], "layer {}", l.layer);
            let [[r0, r1]] = hd.recent[..] else {
                panic!("one recent run: {hd:?}")
            };
            // The window starts at a page boundary at most `recent` back from a refresh.
            assert_eq!((r1 as usize, r0 % 16), (len, 0));
            assert!(len - (r0 as usize) < 8 + 16 + 6 + 16, "{r0}");
            let sel: usize = hd.selected.iter().map(|r| (r[1] - r[0]) as usize).sum();
            assert!(sel > 0 && sel <= 14, "selected {sel}");
            assert!(hd.selected.iter().all(|r| r[0] >= 2 && r[1] <= r0));
            assert!(hd.kept.is_empty());
        }
    }
    let slow = ins.slow_steps.as_ref().expect("SFI logs its slow steps");
    assert_eq!(ins.slow_steps_total, f.stats.slow_steps);
    assert_eq!(slow.len(), f.stats.slow_steps);
    assert!(!slow.is_empty());
    assert!(slow.windows(2).all(|w| w[0].position < w[1].position));
    assert!(slow
        .iter()
        .all(|s| (n..len).contains(&(s.position as usize))));

    let ins = fin(1).inspection.as_ref().expect("asked for");
    for l in &ins.layers {
        for hd in &l.heads {
            assert_eq!(hd.sinks, vec![[0, 2]]);
            assert_eq!(hd.recent, vec![[(len + 1 - 22) as u32, len as u32]]);
            assert!(hd.selected.is_empty() && hd.kept.is_empty());
        }
    }
    assert!(ins.slow_steps.is_none());

    let ins = fin(2).inspection.as_ref().expect("asked for");
    for l in &ins.layers {
        assert_eq!(l.heads[0], slowfast_kv::Held::kept_range(0..len));
    }
    assert!(fin(3).inspection.is_none());
}

#[test]
fn the_prefix_cache_skips_whole_shared_chunks_and_changes_no_token() {
    let m = loaded();
    let mut c = cfg(8, 16);
    c.kv_dtype = KvDtype::F16;
    c.prefix_cache_bytes = 1 << 24;
    c.prefix_block = 8;
    let (h, _t) = spawn(m.clone(), c).unwrap();
    let (tx, rx) = channel();
    // One 50-token system prompt (3 whole chunks of 16) and a different question each.
    let system = tokens(50, 99);
    let policies = [
        "full",
        "sfi",
        "streaming",
        "snapkv",
        "quest",
        "h2o",
        "fastkv",
        "sfi",
        "pyramidkv",
    ];
    let shares = |p: &str| !["h2o", "fastkv"].contains(&p);
    let mut want = Vec::new();
    for (i, &p) in policies.iter().enumerate() {
        let mut prompt = system.clone();
        // At least 80 tokens: SnapKV's 32-row last part then starts past the shared chunks.
        prompt.extend(tokens(30 + 7 * i, i as u32));
        let max_tokens = 14;
        let ctx = prompt.len() + max_tokens;
        let budget = (p != "full").then_some(40.0);
        let spec = crate::session::policy_spec_with(p, budget, 2, ctx, &sfi_knobs())
            .unwrap()
            .with_vocab(&m.tokenizer);
        want.push(alone(&m, &prompt, max_tokens, &spec, KvDtype::F16));
        let (sink, _) = ChannelSink::new(i, &tx);
        h.submit(request(prompt, max_tokens, spec), sink).unwrap();
    }
    assert_as_alone(&collect(&rx, policies.len()), &want, &policies);
    // Every sharing request after the first restored the 48 tokens of the 3 whole chunks;
    // H2O and FastKV prefilled theirs.
    let sharing = policies.iter().filter(|p| shares(p)).count() as u64;
    let g = h.gauges();
    assert_eq!(
        g.prefix_hit_tokens.load(Ordering::Relaxed),
        48 * (sharing - 1)
    );
    let prompt_tokens: u64 = (0..policies.len()).map(|i| 50 + 30 + 7 * i as u64).sum();
    assert_eq!(
        g.prefill_tokens.load(Ordering::Relaxed),
        prompt_tokens - 48 * (sharing - 1)
    );
    assert!(g.prefix_cache_bytes.load(Ordering::Relaxed) > 0);
}

#[test]
fn a_prefix_block_that_does_not_divide_the_chunk_is_refused() {
    let mut c = cfg(2, 2);
    c.prefix_cache_bytes = 1 << 20;
    c.prefix_block = 12;
    let e = spawn(loaded(), c).err().expect("refused at start");
    assert!(
        e.to_string()
            .contains("must divide the prefill chunk of 16"),
        "{e}"
    );
}

/// KV bytes of one sequence of the fixture at `slots` slots a head (f32, no rings).
fn kv_rows(m: &Loaded, slots: usize) -> usize {
    let c = &m.model.cfg;
    2 * slots * c.num_key_value_heads * c.head_dim * 4 * c.num_hidden_layers
}

/// Tight KV memory: sequences grow past what is free, the newest is preempted, resumed by
/// prefilling its prompt and generated tokens, and every request still finishes with its
/// tokens. With 1-token prefill chunks the recomputed KV is bit-equal to the decoded KV, so
/// the greedy tokens equal `generate` alone exactly; with 16-token chunks (a GEMM) they may
/// part after a preemption, so only the oldest request (never preempted) is checked whole.
#[test]
fn preempted_sequences_resume_and_finish_with_their_tokens() {
    let m = loaded();
    for chunk in [1usize, 16] {
        let mut c = cfg(4, 16);
        c.chunk = chunk;
        c.prefill_tokens_per_step = 64;
        // Two sequences of 128 slots and a little: the third waits, and a sequence growing
        // past 128 preempts the newest.
        c.kv_memory = kv_rows(&m, 128) * 2 + kv_rows(&m, 32);
        let (h, _t) = spawn(m.clone(), c).unwrap();
        let (tx, rx) = channel();
        let lens = [40usize, 50, 60];
        let max_tokens = 150;
        let (mut want, mut reqs) = (Vec::new(), Vec::new());
        for (i, &n) in lens.iter().enumerate() {
            let prompt = tokens(n, 40 + i as u32);
            let spec = policy_spec("full", None, 2, n + max_tokens).unwrap();
            let opts = GenerateOptions {
                max_new_tokens: max_tokens,
                sampler: SamplerConfig::greedy(),
                ignore_eos: true,
                kv_dtype: KvDtype::F32,
                chunk,
                policy: spec.clone(),
                ..Default::default()
            };
            want.push(generate(&m, &prompt, &opts, &mut |_| {}).unwrap());
            reqs.push(request(prompt, max_tokens, spec));
        }
        // All at once, so that they compete for the memory.
        for (i, r) in reqs.into_iter().enumerate() {
            h.submit(r, ChannelSink::new(i, &tx).0).unwrap();
        }
        let got = collect(&rx, lens.len());
        let g = h.gauges();
        assert!(
            g.preemptions.load(Ordering::Relaxed) > 0,
            "chunk {chunk}: the memory is too tight for three sequences"
        );
        for (i, ((toks, fin, err), w)) in got.iter().zip(&want).enumerate() {
            assert!(err.is_none(), "chunk {chunk}, request {i}: {err:?}");
            let f = fin.as_ref().unwrap();
            assert_eq!(
                f.completion_tokens, max_tokens,
                "chunk {chunk}, request {i}"
            );
            assert_eq!(f.prompt_tokens, lens[i]);
            assert_eq!(toks.len(), max_tokens);
            if chunk == 1 || i == 0 {
                assert_eq!(toks, &w.tokens, "chunk {chunk}, request {i}");
            } else {
                assert_eq!(
                    toks[0], w.tokens[0],
                    "request {i}: the prompt's own next token"
                );
            }
        }
        // Everything freed; the prefill counter covers the recomputed tokens too.
        let deadline = Instant::now() + Duration::from_secs(10);
        while g.kv_bytes_in_use.load(Ordering::Relaxed) > 0 || g.running.load(Ordering::Relaxed) > 0
        {
            assert!(Instant::now() < deadline, "the KV was not freed");
            std::thread::sleep(Duration::from_millis(5));
        }
        // More than two prompts again: generated tokens were recomputed, not only prompts.
        let again = g.prefill_tokens.load(Ordering::Relaxed) as usize - lens.iter().sum::<usize>();
        assert!(
            again > lens[1] + lens[2],
            "chunk {chunk}: {again} tokens prefilled again"
        );
    }
}

/// `kv_reserve`: the same load under the same memory admits by whole reservations and never
/// preempts; every token equals `generate` alone.
#[test]
fn reserved_kv_never_preempts() {
    let m = loaded();
    let mut c = cfg(4, 16);
    c.kv_memory = kv_rows(&m, 200) * 2;
    c.kv_reserve = true;
    let (h, _t) = spawn(m.clone(), c).unwrap();
    let (tx, rx) = channel();
    let (mut want, mut reqs) = (Vec::new(), Vec::new());
    for (i, n) in [40usize, 50, 60].into_iter().enumerate() {
        let prompt = tokens(n, 40 + i as u32);
        let spec = policy_spec("full", None, 2, n + 150).unwrap();
        want.push(alone(&m, &prompt, 150, &spec, KvDtype::F32));
        reqs.push(request(prompt, 150, spec));
    }
    for (i, r) in reqs.into_iter().enumerate() {
        h.submit(r, ChannelSink::new(i, &tx).0).unwrap();
    }
    assert_as_alone(&collect(&rx, 3), &want, &["full"; 3]);
    let g = h.gauges();
    assert_eq!(g.preemptions.load(Ordering::Relaxed), 0);
    // At most one sequence of 190-210 tokens fit beside another's reservation at a time.
    assert!(g.decode_rows.load(Ordering::Relaxed) <= 2 * g.decode_steps.load(Ordering::Relaxed));
}

/// Every policy under memory so tight that sequences are preempted, with the
/// prefix cache on and one request cancelled on the way: every other request finishes with
/// all its tokens, nothing fails, and the KV and the queue are empty at the end.
#[test]
fn every_policy_survives_preemption() {
    let m = loaded();
    let mut c = cfg(6, 32);
    c.kv_dtype = KvDtype::F16;
    c.prefix_cache_bytes = 1 << 22;
    c.prefix_block = 8;
    // About two and a half sequences of 128 slots (f16).
    c.kv_memory = kv_rows(&m, 320) / 2;
    let (h, _t) = spawn(m.clone(), c).unwrap();
    let (tx, rx) = channel();
    let policies = [
        "full",
        "sfi",
        "streaming",
        "snapkv",
        "quest",
        "h2o",
        "fastkv",
        "pyramidkv",
        "sfi",
        "full",
    ];
    let mut cancel = None;
    let mut reqs = Vec::new();
    for (i, &p) in policies.iter().enumerate() {
        let n = 20 + (i * 37) % 90;
        let max_tokens = 60 + (i * 53) % 70;
        let budget = (p != "full").then_some(40.0);
        let spec = crate::session::policy_spec_with(p, budget, 2, n + max_tokens, &sfi_knobs())
            .unwrap()
            .with_vocab(&m.tokenizer);
        reqs.push((
            request(tokens(n, 7 + i as u32), max_tokens, spec),
            max_tokens,
        ));
    }
    for (i, (r, _)) in reqs.iter().enumerate() {
        let (sink, closed) = ChannelSink::new(i, &tx);
        if i == 4 {
            cancel = Some(closed);
        }
        h.submit(r.clone(), sink).unwrap();
    }
    // Cancel request 4 once some tokens have flowed.
    let mut out: Vec<Outcome> = vec![(Vec::new(), None, None); policies.len()];
    let mut left = policies.len() - 1;
    let deadline = Instant::now() + Duration::from_secs(300);
    while left > 0 {
        let (id, ev) = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the scheduler answers in time");
        match ev {
            Event::Token(t) => {
                out[id].0.push(t.id);
                if out[0].0.len() == 20 {
                    if let Some(c) = cancel.take() {
                        c.store(true, Ordering::Relaxed);
                    }
                }
            }
            Event::Done(f) if id != 4 => {
                out[id].1 = Some(f);
                left -= 1;
            }
            Event::Done(_) => {}
            Event::Error(e) => panic!("request {id} ({}) failed: {e}", policies[id]),
        }
    }
    for (i, (toks, fin, _)) in out.iter().enumerate().filter(|&(i, _)| i != 4) {
        let f = fin.as_ref().unwrap();
        assert_eq!(f.completion_tokens, reqs[i].1, "{} ({i})", policies[i]);
        assert_eq!(toks.len(), reqs[i].1);
    }
    let g = h.gauges();
    let pre = g.preemptions.load(Ordering::Relaxed);
    assert!(pre >= 1, "the memory is too loose: {pre} preemptions");
    let deadline = Instant::now() + Duration::from_secs(10);
    while g.kv_bytes_in_use.load(Ordering::Relaxed) > 0
        || g.running.load(Ordering::Relaxed) > 0
        || g.queued.load(Ordering::Relaxed) > 0
    {
        assert!(
            Instant::now() < deadline,
            "the KV or the queue was not emptied"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
