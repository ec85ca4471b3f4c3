//! The SFI policy on a real (tiny) model: dense while the sequence is shorter than its memory,
//! slow steps equal full KV exactly, fast steps attend to sinks + selected + recent only.
use std::path::PathBuf;

use slowfast_engine::{KvDtype, PolicySpec, Session};
use slowfast_kv::sfi::memory::SfiConfig;
use slowfast_kv::sfi::trigger::TriggerKind;
use slowfast_model::load::{load_model, ModelSource};
use slowfast_model::Model;

fn model() -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen3");
    load_model(&ModelSource::HfDir(dir)).unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 500 + 6).collect()
}

fn sfi(cfg: SfiConfig) -> PolicySpec {
    PolicySpec::Sfi {
        cfg: Box::new(cfg),
        enders: vec![],
        newlines: vec![],
        vocab_size: 512,
    }
}

/// Prefill `prompt`, then teacher-force `rest`; logits of every decode step.
fn run(
    m: &Model,
    spec: &PolicySpec,
    prompt: &[u32],
    rest: &[u32],
) -> (Vec<Vec<f32>>, slowfast_kv::PolicyStats) {
    let mut s =
        Session::try_with_policy(m, prompt.len() + rest.len() + 1, KvDtype::F32, 16, spec).unwrap();
    s.prefill(prompt, &mut |_, _| {}).unwrap();
    let out = rest.iter().map(|&t| s.step(t).unwrap().to_vec()).collect();
    (out, s.policy_stats())
}

#[test]
fn budget_at_least_the_context_equals_full_kv() {
    let m = model();
    let t = tokens(120);
    let (full, _) = run(&m, &PolicySpec::Full, &t[..80], &t[80..]);
    let (got, stats) = run(&m, &sfi(SfiConfig::new(4, 256, 2000)), &t[..80], &t[80..]);
    assert_eq!(
        got, full,
        "a memory larger than the sequence must leave attention dense"
    );
    assert_eq!(stats.fast_steps, 0);
}

#[test]
fn slow_steps_equal_full_kv_exactly() {
    let m = model();
    let t = tokens(150);
    let mut cfg = SfiConfig::new(2, 8, 6);
    cfg.trigger.kind = TriggerKind::Periodic;
    cfg.trigger.period = 1; // every decode step is slow
    cfg.trigger.min_gap = 1;
    // A 96-token prompt is whole 16-token chunks, so SFI's prefill chunks (the last one holds
    // at least the 16 bootstrap rows) are the same as full KV's and bit equality is expected.
    let (full, _) = run(&m, &PolicySpec::Full, &t[..96], &t[96..]);
    let (got, stats) = run(&m, &sfi(cfg), &t[..96], &t[96..]);
    assert_eq!(got, full);
    assert_eq!((stats.slow_steps, stats.fast_steps), (54, 0));
}

#[test]
fn fast_steps_attend_to_the_sparse_memory_only() {
    let m = model();
    let t = tokens(150);
    let mut cfg = SfiConfig::new(2, 8, 6);
    cfg.trigger.kind = TriggerKind::Off; // bootstrap at the end of prefill only
    let (full, _) = run(&m, &PolicySpec::Full, &t[..100], &t[100..]);
    let (got, stats) = run(&m, &sfi(cfg), &t[..100], &t[100..]);
    assert_eq!((stats.slow_steps, stats.fast_steps), (0, 50));
    // sinks 2 + selected 6 + the recent window from the page-aligned start (96) to the end.
    let first_attended = 2 + 6 + (101 - 96);
    assert!(stats.mean_attended() >= first_attended as f64);
    assert!(
        stats.retained_fraction() < 0.5,
        "{}",
        stats.retained_fraction()
    );
    // Sparse attention changes the logits, but stays a sensible approximation.
    assert_ne!(got[0], full[0]);
    let max_diff = got
        .iter()
        .flatten()
        .zip(full.iter().flatten())
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(max_diff.is_finite() && max_diff < 10.0, "{max_diff}");
}

/// The drift trigger on a real model: measuring a fast step (its logits captured through the
/// kernel that writes them) leaves that step's output bit-equal to plain SFI's; a threshold
/// the shares never fall below fires nothing, one they always fall below makes every step past
/// `min_gap` slow.
#[test]
fn drift_measurement_changes_no_fast_step_and_fires_slow_steps_when_the_share_falls() {
    let m = model();
    let t = tokens(180);
    let mut cfg = SfiConfig::new(2, 8, 6);
    cfg.trigger.kind = TriggerKind::Off;
    cfg.trigger.min_gap = 4;
    let (plain, plain_stats) = run(&m, &sfi(cfg.clone()), &t[..100], &t[100..]);
    cfg.drift = 1e-30;
    let (measured, stats) = run(&m, &sfi(cfg.clone()), &t[..100], &t[100..]);
    assert_eq!(measured, plain);
    assert_eq!(stats, plain_stats);
    assert_eq!((stats.slow_steps, stats.fast_steps), (0, 80));
    // Above 1 no share passes (the library takes it; the CLI stops at 1): every fast step
    // notes drift, so with a 4-step gap every fourth step is slow (3 fast, then 1 slow).
    cfg.drift = 1.5;
    let (fired, stats) = run(&m, &sfi(cfg), &t[..100], &t[100..]);
    assert_eq!((stats.slow_steps, stats.fast_steps), (20, 60));
    assert_eq!(
        fired[..3],
        plain[..3],
        "the steps before the first drift refresh"
    );
    assert_ne!(fired[3], plain[3]);
}

/// The cheaper slow step on a real model: the same slow steps at the same moments, each
/// reading its candidate pages instead of every key (fewer keys attended), and the steps
/// before the first one unchanged. With candidate pages that cover every page before the
/// window it is plain SFI, bit for bit.
#[test]
fn cheaper_slow_steps_keep_the_schedule_and_read_fewer_keys() {
    let m = model();
    let t = tokens(200);
    let mut cfg = SfiConfig::new(2, 8, 6);
    cfg.trigger.kind = TriggerKind::Periodic;
    cfg.trigger.period = 5;
    cfg.trigger.min_gap = 1;
    let (plain, plain_stats) = run(&m, &sfi(cfg.clone()), &t[..120], &t[120..]);
    cfg.candidates = 2.0; // one 16-key page besides the sinks' and the window's neighbour
    let (cheap, stats) = run(&m, &sfi(cfg.clone()), &t[..120], &t[120..]);
    assert_eq!(
        (stats.slow_steps, stats.fast_steps),
        (plain_stats.slow_steps, plain_stats.fast_steps)
    );
    assert!(stats.slow_steps >= 10, "{stats:?}");
    assert!(
        stats.attended_tokens < plain_stats.attended_tokens,
        "{stats:?} against {plain_stats:?}"
    );
    let first_slow = cheap.iter().zip(&plain).position(|(a, b)| a != b).unwrap();
    assert!(
        first_slow >= 4,
        "step {first_slow} changed before the first slow step"
    );
    assert!(cheap.iter().flatten().all(|x| x.is_finite()));
    cfg.candidates = 64.0;
    let (all, all_stats) = run(&m, &sfi(cfg), &t[..120], &t[120..]);
    assert_eq!(all, plain);
    assert_eq!(all_stats, plain_stats);
}

/// SFI's decode after FastKV's token-selective prefill (`sfi+fastkv`): half the prompt goes
/// past the TSP layer (layer 1 of 3), so layer 2 holds only the propagated tokens, in a
/// compacted layer whose slots carry their positions.
fn sfi_fastkv(decode: PolicySpec, rate: f64) -> PolicySpec {
    let tsp = slowfast_kv::SnapKvConfig::fastkv(64);
    PolicySpec::FastKvPrefill {
        decode: Box::new(decode),
        tsp_rate: rate,
        tsp_layer: None,
        window: tsp.window,
        kernel: tsp.kernel,
    }
}

#[test]
fn sfi_fastkv_with_budget_at_least_the_context_equals_fastkv_prefill_and_full_decode() {
    let m = model();
    let t = tokens(130);
    let (prompt, rest) = (&t[..96], &t[96..]);
    let (reference, _) = run(&m, &sfi_fastkv(PolicySpec::Full, 0.5), prompt, rest);
    let (got, stats) = run(
        &m,
        &sfi_fastkv(sfi(SfiConfig::new(4, 256, 2000)), 0.5),
        prompt,
        rest,
    );
    assert_eq!(got, reference);
    assert_eq!(stats.fast_steps, 0);
    // Layer 2 (after the TSP layer) keeps only the 48 propagated rows plus room for decoding.
    let bytes = |spec: &PolicySpec| {
        let mut s = Session::try_with_policy(&m, 131, KvDtype::F32, 16, spec).unwrap();
        s.prefill(prompt, &mut |_, _| {}).unwrap();
        s.kv_bytes()
    };
    let per_slot = 2 * m.cfg.num_key_value_heads * m.cfg.head_dim * 4;
    assert_eq!(
        bytes(&sfi_fastkv(PolicySpec::Full, 0.5)),
        // Layers 0 and 1 are one block of the session's 131 slots.
        (2 * 131 + 48 + (131 - 96)) * per_slot
    );
    // FastKV with a retention budget covering everything decodes the same way.
    let fastkv = PolicySpec::FastKv {
        cfg: slowfast_kv::SnapKvConfig::fastkv(131),
        tsp_rate: 0.5,
        tsp_layer: None,
    };
    let (fk, _) = run(&m, &fastkv, prompt, rest);
    assert_eq!(fk, reference);
    // The prefill did propagate only half the prompt: not full KV's logits.
    let (full, _) = run(&m, &PolicySpec::Full, prompt, rest);
    assert_ne!(full, reference);
    // The CLI name resolves to this composition.
    let spec = slowfast_engine::session::policy_spec("sfi+fastkv", Some(0.5), 4, 1024).unwrap();
    assert_eq!(spec.name(), "sfi+fastkv");
    assert_eq!(spec.budget(), Some(512));
    assert!(matches!(
        spec,
        PolicySpec::FastKvPrefill { ref decode, .. } if decode.name() == "sfi"
    ));
}

#[test]
fn sfi_fastkv_with_a_small_budget_reads_the_sparse_memory_of_the_compacted_layer() {
    let m = model();
    let t = tokens(130);
    let (prompt, rest) = (&t[..96], &t[96..]);
    let mut cfg = SfiConfig::new(2, 8, 6);
    cfg.trigger.kind = TriggerKind::Off; // bootstrap at the end of prefill only
    let (reference, _) = run(&m, &sfi_fastkv(PolicySpec::Full, 0.5), prompt, rest);
    let (got, stats) = run(&m, &sfi_fastkv(sfi(cfg), 0.5), prompt, rest);
    assert_eq!((stats.slow_steps, stats.fast_steps), (0, rest.len()));
    // Layers 0 and 1 read sinks + selected + the recent window from the page-aligned start
    // chosen at the bootstrap ((96 - 8) / 16 * 16 = 80) to the newest position; layer 2 reads
    // fewer, as it holds only the propagated half of the positions before 96.
    let dense_01: f64 = (0..rest.len()).map(|i| (2 + 6 + 97 + i - 80) as f64).sum();
    let mean = stats.attended_tokens * 3.0;
    assert!(mean < 3.0 * dense_01 && mean > 2.0 * dense_01, "{stats:?}");
    assert!(stats.retained_fraction() < 0.5, "{stats:?}");
    assert_ne!(got[0], reference[0]);
    let max_diff = got
        .iter()
        .flatten()
        .zip(reference.iter().flatten())
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(max_diff.is_finite() && max_diff < 10.0, "{max_diff}");
}

/// Sessions of `spec`, each prefilled with its own window `prompts[j]`.
fn prefilled<'m>(
    m: &'m Model,
    specs: &[PolicySpec],
    prompts: &[&[u32]],
    cap: usize,
) -> Vec<Session<'m>> {
    specs
        .iter()
        .zip(prompts)
        .map(|(spec, p)| {
            let mut s = Session::try_with_policy(m, cap, KvDtype::F32, 16, spec).unwrap();
            s.prefill(p, &mut |_, _| {}).unwrap();
            s
        })
        .collect()
}

#[test]
fn stepping_together_with_no_room_is_stepping_alone() {
    let m = model();
    let t = tokens(400);
    let windows: Vec<&[u32]> = vec![&t[..130], &t[130..260], &t[260..390]];
    let mut cfg = SfiConfig::new(2, 8, 6);
    cfg.trigger.min_gap = 3;
    cfg.trigger.refresh_interval = 9;
    cfg.trigger.ride = true;
    let spec = sfi(cfg);
    let specs = vec![spec.clone(); 3];
    let prompts: Vec<&[u32]> = windows.iter().map(|w| &w[..96]).collect();
    let mut together = prefilled(&m, &specs, &prompts, 140);
    let mut alone = prefilled(&m, &specs, &prompts, 140);
    for i in 96..130 {
        let fed: Vec<u32> = windows.iter().map(|w| w[i]).collect();
        let (_, rode) = Session::step_together(&mut together, &fed, 0).unwrap();
        assert!(rode.is_empty(), "no room, no riders");
        for (j, s) in alone.iter_mut().enumerate() {
            let want = s.step(fed[j]).unwrap().to_vec();
            assert_eq!(together[j].logits(), &want[..], "window {j}, position {i}");
        }
    }
    let stats = |v: &[Session]| -> Vec<_> { v.iter().map(|s| s.policy_stats()).collect() };
    assert_eq!(stats(&together), stats(&alone));
    assert!(
        Session::step_together(&mut together, &[1, 2], 0).is_err(),
        "3 sessions, 2 tokens"
    );
}

#[test]
fn a_rider_refreshes_on_the_firing_sequences_schedule() {
    let m = model();
    let t = tokens(300);
    // Sequence 0 fires every 7 steps; sequence 1's own trigger never fires, so with riding on
    // it refreshes exactly when 0 does (past its min gap of 3): the same steps, hence the same
    // logits, as a sequence whose own trigger fires every 7.
    let mut every7 = SfiConfig::new(2, 8, 6);
    every7.trigger.kind = TriggerKind::Periodic;
    every7.trigger.period = 7;
    let mut never = SfiConfig::new(2, 8, 6);
    never.trigger.kind = TriggerKind::Off;
    never.trigger.min_gap = 3;
    let (a, b) = (&t[..150], &t[150..300]);
    let prompts: Vec<&[u32]> = vec![&a[..100], &b[..100]];
    let run = |rider: SfiConfig, room: usize| {
        let mut v = prefilled(&m, &[sfi(every7.clone()), sfi(rider)], &prompts, 160);
        let (mut logits, mut rides) = (Vec::new(), 0);
        for i in 100..150 {
            let (fired, rode) = Session::step_together(&mut v, &[a[i], b[i]], room).unwrap();
            assert_eq!(
                fired[0],
                (i - 99) % 7 == 0,
                "sequence 0 fires every 7 steps"
            );
            rides += rode.len();
            logits.push(v[1].logits().to_vec());
        }
        (logits, v[1].policy_stats(), rides)
    };
    let (rode, stats, rides) = run(never.clone(), 4);
    assert_eq!(
        rides, 7,
        "one ride per slow step of sequence 0 (steps 7, 14, .., 49)"
    );
    assert_eq!((stats.slow_steps, stats.fast_steps), (7, 43));
    let (own, own_stats, _) = run(every7.clone(), 4);
    assert_eq!(rode, own, "riding on a period-7 schedule is that schedule");
    assert_eq!(own_stats, stats);
    // Riding off, or no room: sequence 1 never refreshes.
    let mut off = never.clone();
    off.trigger.ride = false;
    for (cfg, room) in [(off, 4), (never, 1)] {
        let (_, stats, rides) = run(cfg, room);
        assert_eq!((rides, stats.slow_steps), (0, 0));
    }
}
