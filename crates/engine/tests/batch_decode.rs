//! `step_batch` against `Session::step` on small random models: sessions with different prompt
//! lengths and KV policies, prefilled separately, then decoded one by one and batched (with
//! sessions joining and leaving the batch) give bit-equal logits at every step, also past the
//! GEMM crossover; mismatched batches are refused.
use slowfast_engine::batch::step_batch;
use slowfast_engine::session::{policy_spec, policy_spec_with, SfiKnobs};
use slowfast_engine::{EngineError, KvDtype, PolicySpec, Session};
use slowfast_model::{Model, Scratch};
use slowfast_quant::{gemm_crossover, GgmlType};

const VOCAB: usize = 320;

/// The `qwen3-0.6b` preset cut down to 2 layers of width 256 (Q4_K rows are 256 wide).
fn qwen_like(ty: GgmlType) -> Model {
    let mut c = slowfast_model::presets::preset("qwen3-0.6b").unwrap();
    c.num_hidden_layers = 2;
    c.layer_sliding = vec![false; 2];
    c.vocab_size = VOCAB;
    c.hidden_size = 256;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.attn_scale = 1.0 / 8.0;
    c.intermediate_size = 512;
    let w = slowfast_model::random::random_weights(&c, ty, 11).unwrap();
    Model::new(c, w).unwrap()
}

/// A Gemma 3 shape: two sliding layers (window 8) and a global one, q/k and post norms,
/// GELU, scaled embeddings, RoPE with a local theta.
fn gemma_like(ty: GgmlType) -> Model {
    let mut c = slowfast_model::presets::gemma3(256, 3, 2, 1, 128, 512, VOCAB, 8, 3);
    c.max_position_embeddings = 4096;
    let w = slowfast_model::random::random_weights(&c, ty, 5).unwrap();
    Model::new(c, w).unwrap()
}

/// xorshift64: the test's fresh random tokens.
struct Rng(u64);

impl Rng {
    fn token(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % VOCAB as u64) as u32
    }
}

/// The policy of session `i`: full, streaming, SFI (periodic, and punctuation-triggered on
/// the frequent tokens below 40), H2O, SnapKV and Quest in turn, with budgets below most
/// prompts.
fn policy(i: usize, context: usize) -> PolicySpec {
    let knobs = SfiKnobs {
        recent: 8,
        refresh_interval: 3,
        min_gap: 2,
        trigger: "periodic".into(),
        bootstrap_rows: 4,
        ..SfiKnobs::default()
    };
    match i % 7 {
        0 => PolicySpec::Full,
        1 => policy_spec("streaming", Some(12.0), 2, context).unwrap(),
        2 => policy_spec_with("sfi", Some(20.0), 2, context, &knobs).unwrap(),
        3 => policy_spec("h2o", Some(16.0), 2, context).unwrap(),
        4 => policy_spec("snapkv", Some(40.0), 2, context).unwrap(),
        5 => policy_spec("quest", Some(16.0), 2, context).unwrap(),
        _ => {
            let knobs = SfiKnobs {
                trigger: "punct".into(),
                ..knobs
            };
            let mut spec = policy_spec_with("sfi", Some(20.0), 2, context, &knobs).unwrap();
            if let PolicySpec::Sfi {
                enders, vocab_size, ..
            } = &mut spec
            {
                *enders = (0..40).collect();
                *vocab_size = VOCAB;
            }
            spec
        }
    }
}

/// `n` sessions, session `i` with a prompt of `24 + 13 i mod 48` random tokens prefilled in
/// chunks of 16, each with the policy `policy(i)`. Two calls give identical sessions.
fn sessions(m: &Model, n: usize, kv: KvDtype, steps: usize) -> Vec<Session<'_>> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|i| {
            let len = 24 + (13 * i) % 48;
            let context = len + steps + 1;
            let mut s = Session::try_with_policy(m, context, kv, 16, &policy(i, context)).unwrap();
            let prompt: Vec<u32> = (0..len).map(|_| rng.token()).collect();
            s.prefill(&prompt, &mut |_, _| {}).unwrap();
            s
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|f| f.to_bits()).collect()
}

/// Which sessions step at `step`: all of them, every other one, or a single one.
fn active(i: usize, n: usize, step: usize) -> bool {
    match step % 3 {
        0 => true,
        1 => i % 2 == step % 2,
        _ => i == step % n,
    }
}

/// Decode `steps` fresh random tokens in `n` sessions with `Session::step` and with
/// `step_batch` (sessions joining and leaving the batch): bit-equal logits every time.
fn check(m: &Model, n: usize, kv: KvDtype, steps: usize) {
    let mut alone = sessions(m, n, kv, steps);
    let mut batched = sessions(m, n, kv, steps);
    let names: Vec<&str> = alone.iter().map(|s| s.policy_name()).collect();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut scratch = Scratch::default();
    for step in 0..steps {
        let ids: Vec<usize> = (0..n).filter(|&i| active(i, n, step)).collect();
        let tokens: Vec<u32> = ids.iter().map(|_| rng.token()).collect();
        let want: Vec<Vec<f32>> = ids
            .iter()
            .zip(&tokens)
            .map(|(&i, &t)| alone[i].step(t).unwrap().to_vec())
            .collect();
        let mut batch: Vec<&mut Session<'_>> = batched
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| active(*i, n, step))
            .map(|(_, s)| s)
            .collect();
        step_batch(&mut batch, &tokens, &mut scratch).unwrap();
        for (&i, want) in ids.iter().zip(&want) {
            let (a, b) = (&alone[i], &batched[i]);
            let what = format!(
                "session {i} ({}), step {step}, batch of {}",
                names[i],
                ids.len()
            );
            assert_eq!(b.logits().len(), VOCAB, "{what}");
            assert_eq!(bits(b.logits()), bits(want), "{what}");
            assert_eq!(b.pos(), a.pos(), "{what}");
            assert_eq!(b.kv_bytes(), a.kv_bytes(), "{what}");
            assert_eq!(b.policy_stats(), a.policy_stats(), "{what}");
        }
    }
    // The sparse policies did work: some steps attended to less than the whole cache.
    let sparse = alone
        .iter()
        .filter(|s| s.policy_stats().retained_fraction() < 1.0)
        .count();
    assert!(sparse > 0, "no session attended sparsely");
}

#[test]
fn batched_steps_equal_single_steps_past_the_gemm_crossover() {
    assert_eq!(gemm_crossover(GgmlType::F32), 32);
    assert_eq!(gemm_crossover(GgmlType::Q8_0), 32);
    check(&qwen_like(GgmlType::F32), 33, KvDtype::F32, 7);
    check(&gemma_like(GgmlType::Q8_0), 33, KvDtype::F16, 7);
}

#[test]
fn batched_steps_equal_single_steps_quantized_sliding() {
    check(&gemma_like(GgmlType::Q4_K), 9, KvDtype::F32, 10);
    check(&qwen_like(GgmlType::Q4_K), 8, KvDtype::F16, 8);
}

#[test]
fn batched_steps_equal_single_steps_with_fp8_kv() {
    check(&gemma_like(GgmlType::Q8_0), 9, KvDtype::Fp8, 7);
    check(&qwen_like(GgmlType::F32), 8, KvDtype::Fp8, 8);
}

/// fp8 (e4m3) KV on the CPU: a prompt and teacher-forced decode steps stay close to f32 KV
/// (the worst logit within 0.25 sd of the logits, the GPU fp8 test's bound), further from it than f16 KV
/// (the cache really is narrower), and the cache holds half of f16's bytes.
#[test]
fn fp8_kv_is_near_f32_kv_in_half_the_bytes_of_f16() {
    for m in [gemma_like(GgmlType::Q8_0), qwen_like(GgmlType::F32)] {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let prompt: Vec<u32> = (0..40).map(|_| rng.token()).collect();
        let rest: Vec<u32> = (0..24).map(|_| rng.token()).collect();
        let run = |kv: KvDtype| {
            let mut s = Session::new(&m, 80, kv, 16);
            let mut rows = vec![s.prefill(&prompt, &mut |_, _| {}).unwrap().to_vec()];
            for &t in &rest {
                rows.push(s.step(t).unwrap().to_vec());
            }
            (rows, s.kv_bytes())
        };
        let (r32, _) = run(KvDtype::F32);
        let (r16, b16) = run(KvDtype::F16);
        let (r8, b8) = run(KvDtype::Fp8);
        // the worst |logit - f32's| of any step, over that step's standard deviation of logits
        let off = |a: &[Vec<f32>], b: &[Vec<f32>]| {
            a.iter()
                .zip(b)
                .map(|(p, q)| {
                    let n = p.len() as f64;
                    let mean = p.iter().map(|&x| x as f64).sum::<f64>() / n;
                    let sd = (p.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
                    let worst = p.iter().zip(q).map(|(&x, &y)| (x - y).abs() as f64);
                    worst.fold(0.0f64, f64::max) / sd
                })
                .fold(0.0f64, f64::max)
        };
        let (o16, o8) = (off(&r32, &r16), off(&r32, &r8));
        eprintln!("worst logit off f32 KV's, in sd: f16 {o16:.2e}, fp8 {o8:.2e}");
        assert!(
            o8 > o16,
            "fp8 KV ({o8:.2e}) no further from f32 than f16 ({o16:.2e})"
        );
        assert!(o8 < 0.25, "fp8 KV's worst logit is {o8:.3} sd off f32 KV's");
        assert_eq!(2 * b8, b16, "fp8 KV bytes {b8}, f16 {b16}");
    }
}

#[test]
fn one_session_batch_equals_step() {
    let m = gemma_like(GgmlType::Q8_0);
    let mut a = sessions(&m, 3, KvDtype::F32, 4).pop().unwrap();
    let mut b = sessions(&m, 3, KvDtype::F32, 4).pop().unwrap();
    let mut scratch = Scratch::default();
    for t in [5u32, 17, 300, 2] {
        let want = a.step(t).unwrap().to_vec();
        step_batch(&mut [&mut b], &[t], &mut scratch).unwrap();
        assert_eq!(bits(b.logits()), bits(&want));
    }
}

fn bad_input(r: Result<(), EngineError>) -> String {
    match r {
        Err(EngineError::BadInput(m)) => m,
        other => panic!("expected BadInput, got {other:?}"),
    }
}

#[test]
fn mismatched_batches_are_refused() {
    let m = qwen_like(GgmlType::F32);
    let other = qwen_like(GgmlType::F32); // equal weights, another object
    let mut scratch = Scratch::default();
    let mut s32 = Session::new(&m, 32, KvDtype::F32, 8);
    let mut s16 = Session::new(&m, 32, KvDtype::F16, 8);
    let mut s_other = Session::new(&other, 32, KvDtype::F32, 8);
    let e = bad_input(step_batch(&mut [&mut s32, &mut s16], &[1, 2], &mut scratch));
    assert!(e.contains("session 1") && e.contains("KV dtype"), "{e}");
    let e = bad_input(step_batch(
        &mut [&mut s32, &mut s_other],
        &[1, 2],
        &mut scratch,
    ));
    assert!(
        e.contains("session 1") && e.contains("different model"),
        "{e}"
    );
    let e = bad_input(step_batch(&mut [&mut s32], &[1, 2], &mut scratch));
    assert!(e.contains("2 tokens for 1 sessions"), "{e}");
    let e = bad_input(step_batch(&mut [], &[], &mut scratch));
    assert!(e.contains("no sessions"), "{e}");

    // A token outside the vocabulary or a full cache: refused before any session moves.
    let mut s2 = Session::new(&m, 32, KvDtype::F32, 8);
    let e = step_batch(&mut [&mut s32, &mut s2], &[1, VOCAB as u32], &mut scratch).unwrap_err();
    assert!(e.to_string().starts_with("row 1: token id 320"), "{e}");
    assert_eq!((s32.pos(), s2.pos()), (0, 0));
    let mut full = Session::new(&m, 1, KvDtype::F32, 1);
    full.step(3).unwrap();
    let e = step_batch(&mut [&mut s32, &mut full], &[1, 2], &mut scratch).unwrap_err();
    assert!(
        e.to_string().contains("row 1: the sequence needs 2 tokens"),
        "{e}"
    );
    assert_eq!((s32.pos(), full.pos()), (0, 1));
    step_batch(&mut [&mut s32, &mut s2], &[1, 2], &mut scratch).unwrap();
    assert_eq!((s32.pos(), s2.pos()), (1, 1));
}
