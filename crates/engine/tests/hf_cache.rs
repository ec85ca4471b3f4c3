//! `hf:<org>/<repo>` through the standard Hugging Face cache, against the real `huggingface_hub`:
//! a fake hub on loopback (tests/hub/fake_hub.py) serves the qwen3 HF fixture; the cache that
//! `huggingface_hub.snapshot_download` lays out is then used offline by slowfast and gives the same
//! greedy tokens as the fixture directory; and a cache that slowfast downloads into is found by
//! `huggingface_hub.try_to_load_from_cache` / `snapshot_download(local_files_only=True)`.
//!
//! Needs python3 with `huggingface_hub` (installed with pip when missing); skipped with a note
//! when neither works, unless SLOWFAST_REQUIRE_HF_TEST=1.
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use slowfast_engine::generate::{generate, GenerateOptions};
use slowfast_engine::hub::{self, HubConfig};
use slowfast_engine::sampler::SamplerConfig;

const REPO: &str = "fixture/qwen3";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script() -> PathBuf {
    root().join("tests/hub/fake_hub.py")
}

fn have_hf_hub() -> bool {
    let ok = || {
        Command::new("python3")
            .args(["-c", "import huggingface_hub"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if ok() {
        return true;
    }
    let _ = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "huggingface_hub"])
        .status();
    ok()
}

fn py(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "fake_hub.py {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The fake hub; it stops when its stdin closes (on drop).
struct FakeHub {
    child: Child,
    endpoint: String,
}

impl FakeHub {
    fn start(fixture: &Path) -> FakeHub {
        let mut child = Command::new("python3")
            .arg(script())
            .args(["serve", fixture.to_str().unwrap(), REPO])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .expect("PORT <n>")
            .to_owned();
        FakeHub {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("slowfast-hfcache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn greedy_tokens(spec: &str) -> Vec<u32> {
    let m = slowfast_engine::load(spec, &mut |_| {}).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let ids = m
        .tokenizer
        .encode("The capital of France is", true)
        .unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 6,
        sampler: SamplerConfig::greedy(),
        ignore_eos: true,
        ..Default::default()
    };
    generate(&m, &ids, &opts, &mut |_| {}).unwrap().tokens
}

#[test]
fn huggingface_hub_cache_round_trip() {
    if !have_hf_hub() {
        assert!(
            std::env::var("SLOWFAST_REQUIRE_HF_TEST").as_deref() != Ok("1"),
            "python3 with huggingface_hub is required"
        );
        eprintln!("skipped: python3 with huggingface_hub is not available");
        return;
    }
    let fixture = root()
        .join("tests/fixtures/hf/qwen3")
        .canonicalize()
        .unwrap();
    let hub_srv = FakeHub::start(&fixture);

    // 1. huggingface_hub fills a cache; slowfast uses it offline.
    let cache = tmp("py");
    let snap = PathBuf::from(py(&[
        "download",
        &hub_srv.endpoint,
        REPO,
        cache.to_str().unwrap(),
    ]));
    let offline = HubConfig {
        cache: cache.clone(),
        endpoint: "http://127.0.0.1:9".into(), // closed: any network use would fail
        offline: true,
    };
    let found = hub::resolve(REPO, &offline, &mut |_| {}).unwrap();
    assert_eq!(found.canonicalize().unwrap(), snap.canonicalize().unwrap());
    let commit = snap.file_name().unwrap().to_str().unwrap().to_owned();
    let by_commit = hub::resolve(&format!("{REPO}@{commit}"), &offline, &mut |_| {}).unwrap();
    assert_eq!(by_commit, found);

    // Through `--model` resolution as the CLI does it, from the environment (the only test in
    // this binary, so setting variables races nothing).
    std::env::set_var("HF_HUB_CACHE", &cache);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    std::env::set_var("HF_ENDPOINT", "http://127.0.0.1:9");
    let want = greedy_tokens(fixture.to_str().unwrap());
    assert_eq!(want.len(), 6);
    assert_eq!(greedy_tokens(&format!("hf:{REPO}")), want);
    assert_eq!(greedy_tokens(REPO), want, "bare repo id");
    let e = slowfast_engine::load("hf:fixture/absent", &mut |_| {})
        .expect_err("absent repo")
        .to_string();
    assert!(e.contains("huggingface-cli download fixture/absent"), "{e}");

    // 2. slowfast downloads into an empty cache; huggingface_hub finds every file.
    let cache2 = tmp("rs");
    let online = HubConfig {
        cache: cache2.clone(),
        endpoint: hub_srv.endpoint.clone(),
        offline: false,
    };
    let got = hub::resolve(REPO, &online, &mut |_| {}).unwrap();
    assert_eq!(
        got,
        cache2
            .join("models--fixture--qwen3/snapshots")
            .join(&commit)
    );
    assert_eq!(
        std::fs::read_to_string(cache2.join("models--fixture--qwen3/refs/main")).unwrap(),
        commit
    );
    let files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ];
    for f in files {
        assert_eq!(
            std::fs::read(got.join(f)).unwrap(),
            std::fs::read(fixture.join(f)).unwrap(),
            "{f}"
        );
    }
    let mut args = vec!["check", REPO, cache2.to_str().unwrap()];
    args.extend(files);
    let py_snap = PathBuf::from(py(&args));
    assert_eq!(py_snap.canonicalize().unwrap(), got.canonicalize().unwrap());
    // And it is then used offline as it is.
    let again = HubConfig {
        offline: true,
        ..online
    };
    assert_eq!(hub::resolve(REPO, &again, &mut |_| {}).unwrap(), got);

    let _ = std::fs::remove_dir_all(&cache);
    let _ = std::fs::remove_dir_all(&cache2);
}
