//! `slowfast eval --task agree|passkey|ruler|stability` and `--task nll --batch` as a user runs it: every bad flag gives an
//! error naming it (before any model loads), and each task runs end to end on the tiny
//! Gemma 3 fixture (random weights: the numbers are not meaningful, the records are checked).
use std::path::PathBuf;
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_slowfast"));
    c.env("SLOWFAST_HOME", tmp("home"));
    c
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("slowfast-evaltasks-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fixture() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf/gemma3")
        .to_str()
        .unwrap()
        .to_owned()
}

fn text() -> String {
    let p = tmp("text").join("text.txt");
    std::fs::write(
        &p,
        "The quick brown fox jumps over the lazy dog. Is it not so? It is!\n".repeat(60),
    )
    .unwrap();
    p.to_str().unwrap().to_owned()
}

fn args<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

/// Run `eval` with `args`; expect failure with `expect` in stderr and no panic.
fn fails(args: &[&str], expect: &str) {
    let out = bin().arg("eval").args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure for {args:?}: {err}"
    );
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    assert!(
        err.contains(expect),
        "for {args:?} expected `{expect}` in: {err}"
    );
}

/// Run `eval` with `args` and `--json`; returns the records.
fn records(args: &[&str]) -> Vec<serde_json::Value> {
    // One file a call: tests run in parallel threads of one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let json = tmp("json").join(format!("{n}.json"));
    let out = bin()
        .arg("eval")
        .args(["--model", &fixture(), "--kv-dtype", "f32"])
        .args(args)
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.starts_with("| task | policy |"), "{table}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    v.as_array().unwrap().clone()
}

#[test]
fn bad_eval_flags_are_named_before_loading_a_model() {
    let t = text();
    // A model that does not exist: every error below must come before loading it.
    let m = ["--model", "/nonexistent/model.gguf"];
    let pk_base = [&m[..], &["--task", "passkey"]].concat();
    fails(
        &args(&pk_base, &["--passkey-depths", "0.5,1.5"]),
        "--passkey-depths: 1.5",
    );
    fails(&args(&pk_base, &["--passkey-depths", "0.5,abc"]), "`abc`");
    fails(
        &args(&pk_base, &["--passkey-needles", "0"]),
        "--passkey-needles",
    );
    fails(
        &args(&pk_base, &["--passkey-needles", "9"]),
        "--passkey-needles (9)",
    );
    fails(
        &args(&pk_base, &["--passkey-trials", "0"]),
        "--passkey-trials",
    );
    fails(
        &args(&pk_base, &["--passkey-answer-tokens", "0"]),
        "--passkey-answer-tokens",
    );
    fails(&args(&pk_base, &["--passkey-question", "middle"]), "middle");
    fails(&args(&pk_base, &["--policies", "full,h3o"]), "h3o");
    fails(&args(&pk_base, &["--policies", "sfi"]), "--kv-budget");
    fails(
        &[&m[..], &["--task", "agree"]].concat(),
        "--task agree needs --input",
    );
    fails(&[&m[..], &["--task", "bogus", "-i", &t]].concat(), "bogus");
    fails(
        &[&m[..], &["--task", "agree", "-i", &t, "--context", "100"]].concat(),
        "--eval-tokens (128)",
    );
    fails(
        &[
            &m[..],
            &[
                "--task",
                "stability",
                "-i",
                &t,
                "--context",
                "100",
                "--eval-tokens",
                "1",
            ],
        ]
        .concat(),
        "--eval-tokens (1)",
    );
    let st_base = [&m[..], &["--task", "stability", "-i", &t]].concat();
    fails(
        &args(&st_base, &["--policies", "sfi", "--kv-budget", "0.2"]),
        "runs full KV only",
    );
    fails(
        &args(&st_base, &["--stability-topk", "0"]),
        "--stability-topk",
    );
    fails(
        &args(&st_base, &["--stability-distances", "1,0"]),
        "--stability-distances: 0",
    );
    fails(
        &args(&st_base, &["--stability-distances", "1,x"]),
        "--stability-distances: `x`",
    );
    // Flags fine: now the missing model is the error, and the missing input file before it.
    fails(&args(&st_base, &[]), "/nonexistent/model.gguf");
    fails(
        &[&m[..], &["--task", "nll", "-i", "/nonexistent/text.txt"]].concat(),
        "cannot read /nonexistent/text.txt",
    );
}

#[test]
fn eval_help_explains_every_task_flag() {
    let out = bin().args(["eval", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for f in [
        "--task",
        "--eval-tokens",
        "--seed",
        "--agree-no-teacher-forced",
        "--passkey-trials",
        "--passkey-depths",
        "--passkey-needles",
        "--passkey-distractors",
        "--passkey-answer-tokens",
        "--passkey-question",
        "--stability-topk",
        "--stability-distances",
        "--ruler-tasks",
        "--ruler-samples",
        "--chat",
        "agree      greedy",
        "ruler      RULER's",
        "passkey    ",
        "stability  dense",
    ] {
        assert!(help.contains(f), "--help lacks {f}: {help}");
    }
}

#[test]
fn agree_runs_full_first_and_compares_with_it() {
    let t = text();
    let sparse = ["--kv-budget", "40", "--sinks", "2", "--sfi-recent", "16"];
    let args = [
        &[
            "--task",
            "agree",
            "-i",
            &t,
            "--context",
            "128",
            "--eval-tokens",
            "16",
        ][..],
        &["--policies", "streaming,sfi"],
        &sparse,
    ]
    .concat();
    let r = records(&args);
    let names: Vec<_> = r.iter().map(|x| x["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["full", "streaming", "sfi"]);
    assert_eq!(r[0]["agreement"], 1.0);
    assert_eq!(r[0]["teacher_forced_agreement"], 1.0);
    assert!(r[0]["first_divergence"].is_null());
    for x in &r {
        assert_eq!(x["task"], "agree");
        assert_eq!(x["eval_tokens"], 16);
        let a = x["agreement"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&a));
        let m = x["matched"].as_u64().unwrap();
        assert_eq!(a, m as f64 / 16.0);
        let tf = x["teacher_forced_agreement"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&tf));
        assert!(x.get("retained_fraction").is_some() && x.get("nll").is_none());
    }
    assert_eq!(r[1]["kv_budget"], 40);
    assert!(r[1]["retained_fraction"].as_f64().unwrap() < 1.0);
}

#[test]
fn passkey_and_stability_write_their_records() {
    let r = records(&[
        "--task",
        "passkey",
        "--context",
        "200",
        "--passkey-trials",
        "3",
        "--passkey-depths",
        "0.25,0.75",
        "--passkey-answer-tokens",
        "4",
    ]);
    assert_eq!(r.len(), 1);
    let p = &r[0];
    assert_eq!(
        (p["task"].as_str(), p["trials"].as_u64()),
        (Some("passkey"), Some(3))
    );
    let acc = p["accuracy"].as_f64().unwrap();
    assert_eq!(acc, p["correct"].as_f64().unwrap() / 3.0);
    let depths: Vec<_> = p["per_depth"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["trials"].as_u64().unwrap())
        .collect();
    assert_eq!(depths, [2, 1]);
    assert_eq!(p["answers"].as_array().unwrap().len(), 3);
    assert_eq!(p["question"], "prefill", "the default question placement");

    let t = text();
    let r = records(&[
        "--task",
        "stability",
        "-i",
        &t,
        "--context",
        "128",
        "--eval-tokens",
        "48",
        "--stability-topk",
        "4",
        "--stability-distances",
        "1,3",
    ]);
    let s = &r[0];
    assert_eq!(
        (s["task"].as_str(), s["policy"].as_str()),
        (Some("stability"), Some("full"))
    );
    assert_eq!(s["steps"], 48);
    assert_eq!(s["topk"], 4);
    let d: Vec<_> = s["jaccard_by_distance"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["distance"].as_u64().unwrap())
        .collect();
    assert_eq!(d, [1, 3]);
    assert!(s["boundaries"].as_u64().unwrap() >= 1, "{s}");
    for k in ["jaccard_within", "jaccard_across"] {
        let j = s[k].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&j), "{k} = {j}");
    }
    assert!(!s["per_head"].as_array().unwrap().is_empty());
}

/// The Gemma 3 fixture with room for 2048 positions (its config says 256; the weights are
/// random and RoPE takes any position), so RULER's answer budgets fit beside a prompt.
fn fixture_2k() -> String {
    let dir = tmp("fixture2k");
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["max_position_embeddings"] = 2048.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    dir.to_str().unwrap().to_owned()
}

#[test]
fn bad_ruler_flags_are_named_before_loading_a_model() {
    let t = text();
    let m = ["--model", "/nonexistent/model.gguf", "--task", "ruler"];
    fails(
        &args(&m, &["--ruler-tasks", "vt,niah_single_7", "-i", &t]),
        "--ruler-tasks: unknown task `niah_single_7`",
    );
    fails(
        &args(&m, &["--ruler-samples", "0", "-i", &t]),
        "--ruler-samples",
    );
    fails(&args(&m, &[]), "niah_single_2, niah_single_3");
    fails(
        &args(&m, &["--ruler-tasks", "vt,niah_multivalue"]),
        "niah_multivalue hide needles in an essay and need --input",
    );
    fails(
        &[
            "--model",
            "/nonexistent/model.gguf",
            "--task",
            "passkey",
            "--chat",
        ],
        "--chat is for --task ruler",
    );
    // Flags fine, no essay task: the missing model is the error.
    fails(
        &args(&m, &["--ruler-tasks", "vt,cwe,fwe,niah_single_1"]),
        "/nonexistent/model.gguf",
    );
    // The stability probe runs full KV only (on either device), named before the model loads.
    let stab = ["--model", "/nonexistent/model.gguf", "--task", "stability"];
    fails(
        &args(&stab, &["--device", "cuda", "-i", &t, "--policies", "sfi"]),
        "--task stability measures dense attention and runs full KV only",
    );
}

#[test]
fn ruler_runs_every_task_under_each_policy() {
    let essay = tmp("essay").join("essay.txt");
    std::fs::write(
        &essay,
        "It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife. \"My dear Mr. Bennet,\" said his lady to him one day, \
\"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not.\n"
            .repeat(40),
    )
    .unwrap();
    let json = tmp("json").join("ruler.json");
    let out = bin()
        .arg("eval")
        .args([
            "--model",
            &fixture_2k(),
            "--kv-dtype",
            "f32",
            "--task",
            "ruler",
        ])
        .args(["--context", "2048", "--ruler-samples", "1", "--seed", "3"])
        .args(["-i", essay.to_str().unwrap()])
        .args([
            "--policies",
            "full,sfi",
            "--kv-budget",
            "256",
            "--sinks",
            "2",
        ])
        .args(["--sfi-recent", "32", "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("ruler vt sample 1/1"),
        "progress on stderr: {err}"
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.starts_with("| task | policy | kv budget | context | samples | niah_single_1 |"),
        "{table}"
    );
    assert!(table.contains("| fwe | average | retained |"), "{table}");
    let r: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let names: Vec<_> = r.iter().map(|x| x["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["full", "sfi"]);
    let all = [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
    ];
    for x in &r {
        assert_eq!(
            (x["task"].as_str(), x["context"].as_u64()),
            (Some("ruler"), Some(2048))
        );
        let tasks = x["tasks"].as_array().unwrap();
        let got: Vec<_> = tasks.iter().map(|t| t["task"].as_str().unwrap()).collect();
        assert_eq!(got, all);
        let mut sum = 0.0;
        for t in tasks {
            let s = t["score"].as_f64().unwrap();
            assert!((0.0..=100.0).contains(&s), "{t}");
            sum += s;
            assert_eq!(t["samples"], 1);
            let a = &t["answers"][0];
            assert!(a["prompt_tokens"].as_u64().unwrap() + t["budget"].as_u64().unwrap() <= 2048);
            assert!(!a["expected"].as_array().unwrap().is_empty());
        }
        let avg = x["score"].as_f64().unwrap();
        assert!((avg - sum / all.len() as f64).abs() < 1e-9);
        assert!((0.0..=100.0).contains(&avg));
    }
    assert_eq!(r[1]["kv_budget"], 256);
}

/// `--task nll --batch`: every window scored and counted, riding only with it on, bad inputs
/// named.
#[test]
fn eval_nll_batch_scores_every_window_and_names_what_it_needs() {
    let p = tmp("batch-text").join("text.txt");
    // Sentences end often, so SFI's triggers fire at different steps in different windows.
    let words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"];
    let mut t = String::new();
    for i in 0..900 {
        t.push_str(words[(i * 5 + i / 7) % words.len()]);
        t.push_str(if i % (3 + i % 5) == 0 { ". " } else { " " });
    }
    std::fs::write(&p, &t).unwrap();
    let x = p.to_str().unwrap();
    let common = [
        "--task",
        "nll",
        "--input",
        x,
        "--context",
        "160",
        "--eval-tokens",
        "64",
        "--kv-budget",
        "48",
        "--sinks",
        "4",
        "--sfi-recent",
        "16",
        "--sfi-min-gap",
        "4",
        "--sfi-refresh-interval",
        "24",
    ];
    let v = records(&args(&common, &["--batch", "6", "--policies", "full,sfi"]));
    let (full, sfi) = (&v[0], &v[1]);
    assert_eq!(
        (full["policy"].as_str(), sfi["policy"].as_str()),
        (Some("full"), Some("sfi"))
    );
    for r in [full, sfi] {
        assert_eq!(r["windows"], 6);
        assert_eq!(
            r["slow_steps"].as_u64().unwrap() + r["fast_steps"].as_u64().unwrap(),
            6 * 64,
            "every window's steps are counted: {r}"
        );
    }
    assert_eq!(full["rides"], 0);
    assert_eq!(full["window_nll"].as_array().map(Vec::len), Some(6));
    let mean = full["window_nll"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .sum::<f64>()
        / 6.0;
    assert!(
        (mean - full["nll"].as_f64().unwrap()).abs() < 1e-9,
        "nll is the windows' mean"
    );
    // A batch step is slow when any window's is: at most every window's slow steps, at least
    // the busiest window's.
    let bs = sfi["batch_slow_steps"].as_u64().unwrap();
    assert!(bs > 0 && bs <= sfi["slow_steps"].as_u64().unwrap(), "{sfi}");
    assert!(
        sfi["rides"].as_u64().unwrap() > 0,
        "six windows ride: {sfi}"
    );
    // With riding off no window rides, and each refreshes on its own trigger only.
    let off = records(&args(
        &common,
        &["--batch", "6", "--policies", "sfi", "--sfi-ride", "off"],
    ));
    assert_eq!(off[0]["rides"], 0);
    assert!(off[0]["slow_steps"].as_u64().unwrap() < sfi["slow_steps"].as_u64().unwrap());
    // Too little text for disjoint windows, another task, a zero: each named.
    let m = fixture();
    let with_model = args(&["--model", &m], &common);
    fails(&args(&with_model, &["--batch", "400"]), "disjoint windows");
    fails(
        &["--task", "passkey", "--model", &m, "--batch", "2"],
        "--batch is for --task nll",
    );
    fails(
        &args(&with_model, &["--batch", "0"]),
        "--batch must be at least 1",
    );
}
