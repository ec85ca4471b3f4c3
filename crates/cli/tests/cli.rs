//! The `slowfast` binary as a user runs it: bad input gives a clear error naming the problem
//! and a non-zero exit, never a panic; good input on the tiny fixtures works end to end.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_slowfast"));
    // Never fetch into the user's cache from a test.
    c.env("SLOWFAST_HOME", tmp("home"));
    c
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("slowfast-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Run and expect failure; returns stderr, checked for a message and for no panic.
fn fails(args: &[&str], expect: &str) -> String {
    let out: Output = bin().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "expected failure for {args:?}; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    assert!(
        err.contains(expect),
        "for {args:?} expected `{expect}` in stderr: {err}"
    );
    err
}

/// `generate --json` of 8 greedy tokens after "Hello world" on the tiny Qwen3 fixture, with
/// `extra` flags: the printed object (the command must succeed).
fn generate_json(extra: &[&str]) -> serde_json::Value {
    let dir = fixture("qwen3");
    let out = bin()
        .args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "Hello world",
            "-n",
            "8",
        ])
        .args(["--temperature", "0", "--ignore-eos", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn generates_on_a_tiny_hf_model_with_json_output() {
    let v = generate_json(&["--kv-dtype", "f32"]);
    for k in [
        "text",
        "prompt_tokens",
        "generated_tokens",
        "prefill_tok_s",
        "decode_tok_s",
        "policy",
        "model",
    ] {
        assert!(v.get(k).is_some(), "missing key {k} in {v}");
    }
    assert_eq!(v["generated_tokens"], 8);
    assert_eq!(v["policy"], "full");
}

/// `--kv-dtype fp8` on the CPU: the same generation in a KV cache of half f16's bytes (and a
/// quarter of f32's).
#[test]
fn fp8_kv_generates_on_the_cpu_in_half_the_bytes_of_f16() {
    let kv_bytes = |kv: &str| {
        let v = generate_json(&["--kv-dtype", kv]);
        assert_eq!(v["generated_tokens"], 8, "{kv}: {v}");
        v["kv_bytes"].as_u64().unwrap()
    };
    let (b32, b16, b8) = (kv_bytes("f32"), kv_bytes("f16"), kv_bytes("fp8"));
    assert!(b8 > 0);
    assert_eq!((b16, b32), (2 * b8, 4 * b8));
}

#[test]
fn truncated_gguf_is_a_clear_error() {
    // A GGUF header that promises one tensor whose data is not in the file.
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "llama");
    s(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(64u64.to_le_bytes());
    b.extend(1000u64.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    let p = tmp("gguf").join("trunc.gguf");
    std::fs::write(&p, &b).unwrap();
    fails(
        &["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"],
        "truncated",
    );
    // Not a GGUF at all.
    let p2 = tmp("gguf").join("junk.gguf");
    std::fs::write(&p2, b"this is not a model").unwrap();
    fails(
        &[
            "generate",
            "--model",
            p2.to_str().unwrap(),
            "--prompt",
            "hi",
        ],
        "junk.gguf",
    );
}

#[test]
fn truncated_real_gguf_is_a_clear_error() {
    let Some(model) = slowfast_loader_path() else {
        return;
    };
    let data = std::fs::read(&model).unwrap();
    let p = tmp("gguf-real").join("cut.gguf");
    std::fs::write(&p, &data[..data.len() / 3]).unwrap();
    fails(
        &["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"],
        "truncated",
    );
}

fn slowfast_loader_path() -> Option<PathBuf> {
    let p = std::env::var_os("SLOWFAST_TEST_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("SLOWFAST_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/slowfast")
                });
            home.join("models/gemma-3-270m-q4_k_m.gguf")
        });
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var("SLOWFAST_REQUIRE_MODEL").as_deref() != Ok("1"),
        "default model missing"
    );
    eprintln!("skipped: default model not found");
    None
}

#[test]
fn corrupt_safetensors_is_a_clear_error() {
    let d = tmp("st");
    copy_dir(&fixture("qwen3"), &d);
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    fails(
        &["generate", "--model", d.to_str().unwrap(), "--prompt", "hi"],
        "model.safetensors",
    );
}

#[test]
fn unknown_architecture_is_a_clear_error() {
    let d = tmp("arch");
    copy_dir(&fixture("qwen3"), &d);
    let cfg = d.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text
        .replace("Qwen3ForCausalLM", "MambaForCausalLM")
        .replace("\"qwen3\"", "\"mamba\"");
    std::fs::write(&cfg, text).unwrap();
    fails(
        &["generate", "--model", d.to_str().unwrap(), "--prompt", "hi"],
        "MambaForCausalLM",
    );
}

#[test]
fn missing_tokenizer_is_a_clear_error() {
    let d = tmp("tok");
    copy_dir(&fixture("qwen3"), &d);
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    fails(
        &["generate", "--model", d.to_str().unwrap(), "--prompt", "hi"],
        "tokenizer.json",
    );
}

#[test]
fn prompt_longer_than_the_context_is_a_clear_error() {
    // The tiny qwen3 has a 256-token context.
    let long = "lorem ipsum dolor sit amet ".repeat(200);
    let dir = fixture("qwen3");
    fails(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            &long,
        ],
        "context",
    );
}

#[test]
fn invalid_sampling_values_are_clear_errors() {
    let dir = fixture("qwen3");
    let m = dir.to_str().unwrap();
    fails(
        &[
            "generate",
            "--model",
            m,
            "--prompt",
            "hi",
            "--temperature",
            "-1",
        ],
        "temperature",
    );
    fails(
        &["generate", "--model", m, "--prompt", "hi", "--top-p", "1.5"],
        "top-p",
    );
    fails(
        &["generate", "--model", m, "--prompt", "hi", "--top-p", "0"],
        "top-p",
    );
    fails(
        &["generate", "--model", m, "--prompt", "hi", "--min-p", "2"],
        "min-p",
    );
    fails(
        &[
            "generate",
            "--model",
            m,
            "--prompt",
            "hi",
            "--repeat-penalty",
            "0",
        ],
        "repetition-penalty",
    );
    fails(
        &["generate", "--model", m, "--prompt", "hi", "--top-k", "x"],
        "top-k",
    );
}

#[test]
fn sfi_async_lag_on_the_cpu_and_bad_pool_drift_and_candidates_are_clear_errors() {
    let dir = fixture("qwen3");
    let m = dir.to_str().unwrap();
    // `cmd` (generate or serve) on the fixture with SFI at 300 tokens and the flags `extra`.
    let sfi = |cmd: &str, extra: &[&str]| -> Vec<String> {
        let head: &[&str] = if cmd == "serve" {
            &["serve", "--model", m, "--port", "0"]
        } else {
            &["generate", "--model", m, "--prompt", "hi"]
        };
        let tail = ["--policy", "sfi", "--kv-budget", "300"];
        head.iter()
            .chain(&tail)
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let fails_with = |args: Vec<String>, msg: &str| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&args, msg);
    };
    let lag = ["--sfi-async-lag", "4"];
    fails_with(
        sfi("generate", &lag),
        "--sfi-async-lag 4 needs --device cuda",
    );
    // The server refuses it before it listens, not at the first request.
    fails_with(sfi("serve", &lag), "--sfi-async-lag 4 needs --device cuda");
    // Also when only the speculative drafter runs SFI.
    let drafter = [
        "serve",
        "--model",
        m,
        "--port",
        "0",
        "--kv-budget",
        "300",
        "--sfi-async-lag",
        "4",
        "--speculate",
        "sfi",
    ];
    fails(&drafter, "--sfi-async-lag 4 needs --device cuda");
    for bad in ["0.5", "17", "NaN"] {
        let msg = format!("--sfi-pool {bad} is invalid");
        fails_with(sfi("generate", &["--sfi-pool", bad]), &msg);
    }
    for bad in ["-0.1", "1.5", "inf"] {
        let msg = format!("--sfi-drift {bad} is invalid");
        fails_with(sfi("generate", &["--sfi-drift", bad]), &msg);
    }
    fails_with(
        sfi("generate", &["--sfi-drift", "0.5", "--sfi-pool", "3"]),
        "--sfi-drift 0.5 and --sfi-pool 3 do not combine",
    );
    for bad in ["0.5", "-1", "65", "NaN"] {
        let msg = format!("--sfi-candidates {bad} is invalid");
        fails_with(sfi("generate", &["--sfi-candidates", bad]), &msg);
    }
}

#[test]
fn non_utf8_prompt_file_is_a_clear_error() {
    let p = tmp("utf8").join("bad.txt");
    std::fs::write(&p, [b'h', b'i', 0xff, 0xfe, b'!']).unwrap();
    let dir = fixture("qwen3");
    let err = fails(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-file",
            p.to_str().unwrap(),
        ],
        "not valid UTF-8",
    );
    assert!(err.contains("bad.txt"), "{err}");
}

#[test]
fn missing_model_and_unknown_preset_are_clear_errors() {
    fails(
        &[
            "generate",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ],
        "not found",
    );
    fails(
        &["generate", "--model", "random:gpt5", "--prompt", "hi"],
        "unknown preset",
    );
    fails(
        &["info", "--model", "random:qwen3-0.6b@q3_k"],
        "unknown weight type",
    );
}

#[test]
fn eval_nll_on_a_tiny_model_writes_json_records() {
    let text = tmp("eval").join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let json = tmp("eval").join("out.json");
    let dir = fixture("llama");
    let out = bin()
        .args(["eval", "--task", "nll", "--model", dir.to_str().unwrap()])
        .args([
            "--input",
            text.to_str().unwrap(),
            "--context",
            "128",
            "--eval-tokens",
            "32",
        ])
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let r = &v[0];
    for k in ["task", "policy", "context", "eval_tokens", "nll"] {
        assert!(r.get(k).is_some(), "missing {k}");
    }
    let nll = r["nll"].as_f64().unwrap();
    assert!(nll.is_finite() && nll > 0.0, "{nll}");
    // Asking for more context than the text has is an error naming the numbers.
    fails(
        &[
            "eval",
            "--model",
            dir.to_str().unwrap(),
            "--input",
            text.to_str().unwrap(),
            "--context",
            "4000",
            "--eval-tokens",
            "32",
        ],
        "needs at least",
    );
}

#[test]
fn info_names_qwen2_biases_and_the_mistral_window() {
    let info = |name: &str| -> serde_json::Value {
        let out = bin()
            .args(["info", "--json", "--model", fixture(name).to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let q = info("qwen2");
    assert_eq!(q["architecture"], "qwen2");
    assert_eq!(q["qkv_bias"], true);
    assert_eq!(
        (q["sliding_window"].as_u64(), q["sliding_layers"].as_u64()),
        (Some(8), Some(2))
    );
    let m = info("mistral");
    assert_eq!(m["architecture"], "mistral");
    assert_eq!(m["qkv_bias"], false);
    assert_eq!(
        (m["sliding_window"].as_u64(), m["sliding_layers"].as_u64()),
        (Some(6), Some(2))
    );
    assert_eq!(m["tie_word_embeddings"], true);
}

/// `bench --speculate` on the CPU: every drafter at every γ, the replayed acceptance
/// reproduced exactly at its extremes, and the speedup against full KV of the same run.
#[test]
fn bench_speculate_on_the_cpu_replays_the_acceptance() {
    let dir = fixture("qwen3");
    for (alpha, accepted) in [("alpha:1", true), ("alpha:0", false)] {
        let json = tmp(&format!("spec-bench-{accepted}")).join("spec.json");
        let out = bin()
            .args([
                "bench",
                "--model",
                dir.to_str().unwrap(),
                "--contexts",
                "96",
            ])
            .args([
                "--new-tokens",
                "4",
                "--policies",
                "full",
                "--kv-dtype",
                "f32",
            ])
            .args(["--speculate", "sfi,streaming,ngram", "--spec-tokens", "2,4"])
            .args(["--spec-accept", alpha, "--spec-rounds", "3"])
            .args(["--kv-budget", "48", "--sinks", "4", "--sfi-recent", "16"])
            .args(["--json", json.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("| drafter | γ |"), "{stdout}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(v["runs"][0]["policy"], "full");
        let recs = v["speculative"].as_array().unwrap();
        let got: Vec<(String, u64)> = recs
            .iter()
            .map(|r| {
                (
                    r["drafter"].as_str().unwrap().to_owned(),
                    r["gamma"].as_u64().unwrap(),
                )
            })
            .collect();
        let want: Vec<(String, u64)> = ["sfi", "streaming", "ngram"]
            .iter()
            .flat_map(|d| [2, 4].map(|g| (d.to_string(), g)))
            .collect();
        assert_eq!(got, want);
        for r in recs {
            let g = r["gamma"].as_f64().unwrap();
            let tpv = r["tokens_per_verification"].as_f64().unwrap();
            let rate = r["acceptance_rate"].as_f64().unwrap();
            if accepted {
                assert_eq!((tpv, rate), (g + 1.0, 1.0), "{r}");
            } else {
                assert_eq!((tpv, rate), (1.0, 0.0), "{r}");
            }
            assert_eq!(r["device"], "cpu");
            assert_eq!(r["rounds"], 3);
            assert!(r["slow_draft_steps"].is_null(), "{r}");
            assert_eq!(r["verify_graphs"], false, "the CPU has no graphs: {r}");
            assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["speedup_vs_full"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["acceptance"].as_str().unwrap().starts_with("replayed"));
        }
    }
    let m = dir.to_str().unwrap();
    for (flags, expect) in [
        (
            &["--speculate", "model"][..],
            "`model` is not a drafter the bench times",
        ),
        (
            &["--speculate", "ngram", "--spec-tokens", "0"],
            "--spec-tokens: `0`",
        ),
        (
            &["--speculate", "ngram", "--spec-accept", "alpha:2"],
            "alpha 2 is not in [0, 1]",
        ),
        (
            &["--speculate", "ngram", "--spec-graphs", "off"],
            "--spec-graphs off: verification graphs exist on --device cuda only",
        ),
    ] {
        let mut args = vec!["bench", "--model", m, "--contexts", "96"];
        args.extend(flags);
        fails(&args, expect);
    }
}

#[test]
fn serve_refuses_a_kv_block_that_does_not_divide_the_chunk_and_a_bad_memory_fraction() {
    let dir = fixture("qwen3");
    let m = dir.to_str().unwrap();
    let serve = ["serve", "--model", m, "--port", "0"];
    let with = |extra: &[&str]| -> Vec<String> {
        serve.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let run = |args: Vec<String>, msg: &str| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&args, msg);
    };
    // --prefix-block is the old name of --kv-block.
    for flag in ["--kv-block", "--prefix-block"] {
        run(
            with(&[flag, "24"]),
            "block of 24 tokens must divide the prefill chunk of 512 tokens",
        );
    }
    for bad in ["0", "1.5", "NaN"] {
        run(
            with(&["--gpu-memory-utilization", bad]),
            "--gpu-memory-utilization must be a fraction in (0, 1]",
        );
    }
}

#[test]
fn tensor_parallel_on_the_cpu_matches_one_rank_and_refuses_what_it_cannot_split() {
    let text = tmp("tp").join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let dir = fixture("llama"); // 8 query heads, 2 kv heads, f32 weights
    let nll = |tp: &str, policies: &str| -> Vec<f64> {
        let json = tmp("tp").join(format!("out-{tp}.json"));
        let out = bin()
            .args(["eval", "--task", "nll", "--model", dir.to_str().unwrap()])
            .args(["--input", text.to_str().unwrap(), "--context", "160"])
            .args(["--eval-tokens", "48", "--kv-dtype", "f32"])
            .args(["--policies", policies, "--kv-budget", "40", "--sinks", "4"])
            .args(["--sfi-recent", "16", "--tensor-parallel", tp])
            .args(["--json", json.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tp {tp}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["nll"].as_f64().unwrap())
            .collect()
    };
    // Full KV and StreamingLLM are the same computation split over ranks (f32 weights).
    let one = nll("1", "full,streaming");
    for tp in ["2", "4"] {
        let got = nll(tp, "full,streaming");
        for (a, b) in got.iter().zip(&one) {
            assert!((a - b).abs() < 1e-4, "tp {tp}: nll {a} against {b}");
        }
    }
    // SFI per rank runs (its choice may differ: exclusivity among a rank's kv heads).
    let sfi = nll("2", "sfi");
    assert!(sfi[0].is_finite() && sfi[0] > 0.0);
    let d = dir.to_str().unwrap();
    fails(
        &["generate", "-m", d, "-p", "hi", "--tensor-parallel", "3"],
        "8 attention heads do not divide by 3",
    );
    fails(
        &["bench", "-m", d, "--tensor-parallel", "2"],
        "bench runs the whole model",
    );
    fails(
        &["generate", "-m", d, "-p", "hi", "--tensor-parallel", "0"],
        "--tensor-parallel must be at least 1",
    );
}
