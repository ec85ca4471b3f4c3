//! `hf:<org>/<repo>[@<revision>]` and bare `org/repo`: models in the standard Hugging Face hub
//! cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`), laid out as `huggingface_hub` lays it out:
//!
//! ```text
//! models--{org}--{repo}/refs/{revision}          the commit hash the revision points at
//! models--{org}--{repo}/snapshots/{commit}/FILE  symlinks to ../../blobs/{etag}
//! models--{org}--{repo}/blobs/{etag}             the file contents
//! ```
//!
//! A snapshot already there (from transformers, vLLM, `huggingface-cli download`, or an earlier
//! slowfast run) is used as it is, with no network. Otherwise, unless `HF_HUB_OFFLINE` is set,
//! the files are downloaded from `$HF_ENDPOINT` (default `https://huggingface.co`) into the same
//! layout, so `huggingface_hub` finds them too.
use std::io::{Read, Write};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::EngineError;

fn err(msg: String) -> EngineError {
    EngineError::BadInput(msg)
}

/// Where and how to look for hub models; `from_env` reads it as `huggingface_hub` does.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// The hub cache directory (holding `models--org--repo`).
    pub cache: PathBuf,
    /// The hub's base URL.
    pub endpoint: String,
    /// `HF_HUB_OFFLINE`: never touch the network.
    pub offline: bool,
}

/// `huggingface_hub`'s reading of a boolean environment variable.
fn truthy(v: Option<&str>) -> bool {
    v.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_uppercase().as_str(),
            "1" | "ON" | "YES" | "TRUE"
        )
    })
}

fn expand_home(p: &str, home: Option<&str>) -> PathBuf {
    match (p.strip_prefix('~'), home) {
        (Some(rest), Some(h)) if rest.is_empty() || rest.starts_with('/') => {
            PathBuf::from(format!("{h}{rest}"))
        }
        _ => PathBuf::from(p),
    }
}

impl HubConfig {
    /// Build from a variable lookup (the environment, or a map in tests).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> HubConfig {
        let get = |k: &str| var(k).filter(|v| !v.is_empty());
        let home = get("HOME");
        let home = home.as_deref();
        let cache = if let Some(c) = get("HF_HUB_CACHE").or_else(|| get("HUGGINGFACE_HUB_CACHE")) {
            expand_home(&c, home)
        } else if let Some(h) = get("HF_HOME") {
            expand_home(&h, home).join("hub")
        } else if let Some(x) = get("XDG_CACHE_HOME") {
            expand_home(&x, home).join("huggingface").join("hub")
        } else {
            PathBuf::from(home.unwrap_or(".")).join(".cache/huggingface/hub")
        };
        let endpoint = get("HF_ENDPOINT")
            .unwrap_or_else(|| "https://huggingface.co".into())
            .trim_end_matches('/')
            .to_owned();
        let offline = truthy(
            get("HF_HUB_OFFLINE")
                .or_else(|| get("TRANSFORMERS_OFFLINE"))
                .as_deref(),
        );
        HubConfig {
            cache,
            endpoint,
            offline,
        }
    }

    pub fn from_env() -> HubConfig {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// `{cache}/models--{org}--{repo}`.
    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.cache
            .join(format!("models--{}", repo.replace('/', "--")))
    }
}

/// Split `org/repo[@revision]`, checking the names; the revision defaults to `main`.
pub fn parse_repo(spec: &str) -> Result<(String, String), EngineError> {
    let (repo, rev) = match spec.split_once('@') {
        Some((r, v)) => (r, v),
        None => (spec, "main"),
    };
    let parts: Vec<&str> = repo.split('/').collect();
    let ok_name = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && !p.contains("--")
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if parts.len() != 2 || !parts.iter().all(|p| ok_name(p)) {
        return Err(err(format!(
            "hf:{spec}: expected hf:<org>/<repo>[@<revision>]"
        )));
    }
    if rev.is_empty() || rev.starts_with('.') || rev.contains("..") || rev.contains('\\') {
        return Err(err(format!("hf:{spec}: bad revision `{rev}`")));
    }
    Ok((repo.to_owned(), rev.to_owned()))
}

fn is_commit_hash(rev: &str) -> bool {
    rev.len() == 40
        && rev
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// The weight files a snapshot needs: `model.safetensors`, or the index and every shard it
/// names. `Err` says what is missing.
fn weight_files(dir: &Path) -> Result<Vec<String>, String> {
    if dir.join("model.safetensors").is_file() {
        return Ok(vec!["model.safetensors".into()]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index)
        .map_err(|_| "model.safetensors (or model.safetensors.index.json)".to_owned())?;
    shards_of(&text).map_err(|e| format!("a readable model.safetensors.index.json ({e})"))
}

/// The shard names of a `model.safetensors.index.json`, sorted and deduplicated.
fn shards_of(index_json: &str) -> Result<Vec<String>, String> {
    let v: serde_json::Value = serde_json::from_str(index_json).map_err(|e| e.to_string())?;
    let mut shards: Vec<String> = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("no weight_map")?
        .values()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect();
    shards.sort();
    shards.dedup();
    if let Some(s) = shards
        .iter()
        .find(|s| s.contains('/') || s.contains('\\') || s.starts_with('.'))
    {
        return Err(format!("bad shard name {s:?}"));
    }
    Ok(shards)
}

/// Check that a snapshot directory holds a whole model: config.json, tokenizer.json and the
/// weights. `Err` lists what is missing.
pub fn check_snapshot(dir: &Path) -> Result<(), String> {
    let mut missing = Vec::new();
    for f in ["config.json", "tokenizer.json"] {
        if !dir.join(f).is_file() {
            missing.push(f.to_owned());
        }
    }
    match weight_files(dir) {
        Ok(files) => {
            for f in files {
                if !dir.join(&f).is_file() {
                    missing.push(f);
                }
            }
        }
        Err(m) => missing.push(m),
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing.join(", "))
    }
}

/// What the cache holds for `repo` at `rev`.
#[derive(Debug)]
pub enum Cached {
    /// A complete snapshot.
    Ready(PathBuf),
    /// A snapshot that lacks files (the message lists them).
    Incomplete(PathBuf, String),
    /// No snapshot for that revision.
    Absent,
}

/// Look `repo@rev` up in the cache: a commit hash names `snapshots/{rev}` directly, any other
/// revision is read from `refs/{rev}`.
pub fn lookup(cfg: &HubConfig, repo: &str, rev: &str) -> Cached {
    let root = cfg.repo_dir(repo);
    let commit = if is_commit_hash(rev) {
        rev.to_owned()
    } else {
        match std::fs::read_to_string(root.join("refs").join(rev)) {
            Ok(s) => s.trim().to_owned(),
            Err(_) => return Cached::Absent,
        }
    };
    if commit.is_empty() || commit.contains('/') || commit.starts_with('.') {
        return Cached::Absent;
    }
    let snap = root.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Cached::Absent;
    }
    match check_snapshot(&snap) {
        Ok(()) => Cached::Ready(snap),
        Err(m) => Cached::Incomplete(snap, m),
    }
}

/// Resolve `org/repo[@rev]` to a snapshot directory: from the cache, else (unless offline) by
/// downloading into it.
pub fn resolve(
    spec: &str,
    cfg: &HubConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, EngineError> {
    let (repo, rev) = parse_repo(spec)?;
    let found = lookup(cfg, &repo, &rev);
    if let Cached::Ready(dir) = found {
        return Ok(dir);
    }
    if cfg.offline {
        let what = match &found {
            Cached::Incomplete(dir, m) => {
                format!("its snapshot {} lacks {m}", dir.display())
            }
            _ => format!(
                "there is no snapshot of revision `{rev}` under {}",
                cfg.repo_dir(&repo).display()
            ),
        };
        return Err(err(format!(
            "hf:{repo}@{rev} is not in the Hugging Face cache {} ({what}) and HF_HUB_OFFLINE is \
             set. Fill the cache where the hub is reachable with `huggingface-cli download {repo}{}` \
             (or `hf download`), copy it here, or point HF_HUB_CACHE / HF_HOME at a cache that has it",
            cfg.cache.display(),
            if rev == "main" {
                String::new()
            } else {
                format!(" --revision {rev}")
            }
        )));
    }
    download(&repo, &rev, cfg, progress)
}

/// Fail fast (a few seconds) when the hub's host cannot be reached at all.
fn check_reachable(base: &str) -> Result<(), EngineError> {
    let (scheme_port, rest) = if let Some(r) = base.strip_prefix("http://") {
        (80, r)
    } else {
        (443, base.trim_start_matches("https://"))
    };
    let host = rest.split('/').next().unwrap_or("");
    let addr = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{scheme_port}")
    };
    let unreachable = |why: String| {
        err(format!(
            "cannot reach the model hub at {base} ({why}); this machine has no route to it. \
             Download the repository elsewhere (`huggingface-cli download <org>/<repo>`) into the \
             Hugging Face cache, or pass its directory with --model DIR"
        ))
    };
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| unreachable(format!("cannot resolve {host}: {e}")))?
        .collect();
    for a in &addrs {
        if std::net::TcpStream::connect_timeout(a, Duration::from_secs(5)).is_ok() {
            return Ok(());
        }
    }
    Err(unreachable(format!("no connection to {addr}")))
}

fn io_err(p: &Path, e: std::io::Error) -> EngineError {
    err(format!("{}: {e}", p.display()))
}

fn http_get(url: &str) -> Result<Option<ureq::http::Response<ureq::Body>>, EngineError> {
    let mut req = ureq::get(url);
    if let Ok(tok) = std::env::var("HF_TOKEN") {
        if !tok.is_empty() {
            req = req.header("Authorization", format!("Bearer {tok}"));
        }
    }
    match req.call() {
        Ok(r) => Ok(Some(r)),
        Err(ureq::Error::StatusCode(404)) => Ok(None),
        Err(e) => Err(err(format!("GET {url}: {e}"))),
    }
}

fn header(resp: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.trim()
                .trim_start_matches("W/")
                .trim_matches('"')
                .to_owned()
        })
        .filter(|v| !v.is_empty())
}

/// Download one file of `commit` into `blobs/{etag}` and link `snapshots/{commit}/{file}` to it.
/// `Ok(false)`: the hub has no such file.
fn fetch_file(
    base: &str,
    repo: &str,
    commit: &str,
    file: &str,
    root: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<bool, EngineError> {
    let snap = root.join("snapshots").join(commit);
    let link = snap.join(file);
    if link.is_file() {
        return Ok(true);
    }
    let url = format!("{base}/{repo}/resolve/{commit}/{file}");
    let Some(mut resp) = http_get(&url)? else {
        return Ok(false);
    };
    let etag = header(&resp, "x-linked-etag")
        .or_else(|| header(&resp, "etag"))
        .filter(|e| !e.contains('/') && !e.starts_with('.'))
        .unwrap_or_else(|| format!("{commit}-{file}"));
    let blobs = root.join("blobs");
    std::fs::create_dir_all(&blobs).map_err(|e| io_err(&blobs, e))?;
    let blob = blobs.join(&etag);
    if !blob.is_file() {
        let tmp = blobs.join(format!("{etag}.incomplete"));
        let mut f = std::fs::File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        let mut body = resp.body_mut().as_reader();
        let mut buf = vec![0u8; 1 << 20];
        let (mut n, mut last) = (0u64, 0u64);
        loop {
            let k = body
                .read(&mut buf)
                .map_err(|e| err(format!("GET {url}: {e}")))?;
            if k == 0 {
                break;
            }
            f.write_all(&buf[..k]).map_err(|e| io_err(&tmp, e))?;
            n += k as u64;
            if n - last >= 100 << 20 {
                progress(&format!("  {} MB of {file}", n >> 20));
                last = n;
            }
        }
        f.sync_all().map_err(|e| io_err(&tmp, e))?;
        std::fs::rename(&tmp, &blob).map_err(|e| io_err(&blob, e))?;
    }
    std::fs::create_dir_all(&snap).map_err(|e| io_err(&snap, e))?;
    #[cfg(unix)]
    {
        let _ = std::fs::remove_file(&link);
        let target = Path::new("../../blobs").join(&etag);
        if std::os::unix::fs::symlink(&target, &link).is_err() {
            std::fs::copy(&blob, &link).map_err(|e| io_err(&link, e))?;
        }
    }
    #[cfg(not(unix))]
    std::fs::copy(&blob, &link).map_err(|e| io_err(&link, e))?;
    Ok(true)
}

/// The optional small files fetched beside the weights.
const EXTRA_FILES: [&str; 4] = [
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Download `repo@rev` into the cache layout and return its snapshot directory.
pub fn download(
    repo: &str,
    rev: &str,
    cfg: &HubConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, EngineError> {
    let base = cfg.endpoint.as_str();
    check_reachable(base)?;
    // The revision's commit and file list.
    let api = format!("{base}/api/models/{repo}/revision/{rev}");
    let Some(mut resp) = http_get(&api)? else {
        return Err(err(format!(
            "hf:{repo}@{rev}: the hub at {base} has no such repository or revision"
        )));
    };
    let info: serde_json::Value = serde_json::from_str(
        &resp
            .body_mut()
            .read_to_string()
            .map_err(|e| err(format!("GET {api}: {e}")))?,
    )
    .map_err(|e| err(format!("GET {api}: {e}")))?;
    let commit = info
        .get("sha")
        .and_then(|s| s.as_str())
        .filter(|s| is_commit_hash(s))
        .ok_or_else(|| err(format!("GET {api}: no commit sha in the answer")))?
        .to_owned();
    let listed: Option<Vec<String>> = info.get("siblings").and_then(|s| s.as_array()).map(|a| {
        a.iter()
            .filter_map(|f| {
                f.get("rfilename")
                    .and_then(|n| n.as_str())
                    .map(str::to_owned)
            })
            .collect()
    });
    let has = |f: &str| listed.as_ref().is_none_or(|l| l.iter().any(|x| x == f));
    let root = cfg.repo_dir(repo);
    progress(&format!(
        "downloading hf:{repo}@{rev} ({commit}) into {}",
        root.display()
    ));
    let get = |f: &str, progress: &mut dyn FnMut(&str)| -> Result<bool, EngineError> {
        if !has(f) {
            return Ok(false);
        }
        fetch_file(base, repo, &commit, f, &root, progress)
    };
    if !get("config.json", progress)? {
        return Err(err(format!(
            "hf:{repo}: no config.json (is it a model repository?)"
        )));
    }
    if !get("tokenizer.json", progress)? {
        return Err(err(format!("hf:{repo}: no tokenizer.json")));
    }
    for f in EXTRA_FILES {
        get(f, progress)?;
    }
    if !get("model.safetensors", progress)? {
        if !get("model.safetensors.index.json", progress)? {
            return Err(err(format!("hf:{repo}: no model.safetensors or index")));
        }
        let snap = root.join("snapshots").join(&commit);
        let index = snap.join("model.safetensors.index.json");
        let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
        let shards = shards_of(&text).map_err(|e| err(format!("{}: {e}", index.display())))?;
        for s in shards {
            progress(&format!("downloading {s}"));
            if !get(&s, progress)? {
                return Err(err(format!("hf:{repo}: shard {s} is missing")));
            }
        }
    }
    if !is_commit_hash(rev) {
        let refs = root.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| io_err(&refs, e))?;
        let r = refs.join(rev);
        if let Some(p) = r.parent() {
            std::fs::create_dir_all(p).map_err(|e| io_err(p, e))?;
        }
        std::fs::write(&r, &commit).map_err(|e| io_err(&r, e))?;
    }
    let snap = root.join("snapshots").join(&commit);
    check_snapshot(&snap).map_err(|m| err(format!("hf:{repo}: the download lacks {m}")))?;
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg_of(vars: &[(&str, &str)]) -> HubConfig {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubConfig::from_lookup(|k| m.get(k).cloned())
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("slowfast-hub-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const C1: &str = "0123456789abcdef0123456789abcdef01234567";
    const C2: &str = "fedcba9876543210fedcba9876543210fedcba98";

    fn snapshot(cache: &Path, repo: &str, commit: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = cache.join(format!("models--{}", repo.replace('/', "--")));
        let snap = root.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(root.join("blobs")).unwrap();
        for (i, (f, body)) in files.iter().enumerate() {
            let blob = root.join("blobs").join(format!("{commit}{i}"));
            std::fs::write(&blob, body).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{commit}{i}"), snap.join(f)).unwrap();
        }
        snap
    }

    fn set_ref(cache: &Path, repo: &str, rev: &str, commit: &str) {
        let refs = cache
            .join(format!("models--{}", repo.replace('/', "--")))
            .join("refs");
        std::fs::create_dir_all(&refs).unwrap();
        std::fs::write(refs.join(rev), commit).unwrap();
    }

    const WHOLE: [(&str, &str); 3] = [
        ("config.json", "{}"),
        ("tokenizer.json", "{}"),
        ("model.safetensors", "x"),
    ];

    #[test]
    fn cache_dir_follows_huggingface_hub_precedence() {
        let all = [
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/c"),
        ];
        assert_eq!(cfg_of(&all).cache, PathBuf::from("/c"));
        assert_eq!(cfg_of(&all[..3]).cache, PathBuf::from("/hf/hub"));
        assert_eq!(cfg_of(&all[..2]).cache, PathBuf::from("/x/huggingface/hub"));
        assert_eq!(
            cfg_of(&all[..1]).cache,
            PathBuf::from("/h/.cache/huggingface/hub")
        );
        assert_eq!(
            cfg_of(&[("HOME", "/h"), ("HF_HOME", "~/hf")]).cache,
            PathBuf::from("/h/hf/hub")
        );
        // An empty variable counts as unset.
        assert_eq!(
            cfg_of(&[("HOME", "/h"), ("HF_HUB_CACHE", "")]).cache,
            PathBuf::from("/h/.cache/huggingface/hub")
        );
    }

    #[test]
    fn offline_and_endpoint() {
        for v in ["1", "true", "ON", "yes"] {
            assert!(cfg_of(&[("HF_HUB_OFFLINE", v)]).offline, "{v}");
        }
        for v in ["0", "false", "", "no"] {
            assert!(!cfg_of(&[("HF_HUB_OFFLINE", v)]).offline, "{v}");
        }
        assert!(cfg_of(&[("TRANSFORMERS_OFFLINE", "1")]).offline);
        assert_eq!(cfg_of(&[]).endpoint, "https://huggingface.co");
        assert_eq!(
            cfg_of(&[("HF_ENDPOINT", "http://127.0.0.1:8/")]).endpoint,
            "http://127.0.0.1:8"
        );
    }

    #[test]
    fn repo_names_and_revisions() {
        assert_eq!(
            parse_repo("Qwen/Qwen3-0.6B").unwrap(),
            ("Qwen/Qwen3-0.6B".into(), "main".into())
        );
        assert_eq!(
            parse_repo("a/b@v1.0").unwrap(),
            ("a/b".into(), "v1.0".into())
        );
        assert_eq!(parse_repo(&format!("a/b@{C1}")).unwrap().1, C1);
        for r in [
            "", "org", "org/", "/repo", "a/b/c", "../x", "a/..", "a/b@", "a/b@../x", "a--b/c",
        ] {
            assert!(parse_repo(r).is_err(), "{r}");
        }
    }

    #[test]
    fn refs_point_at_snapshots() {
        let cache = tmp("refs");
        let cfg = HubConfig {
            cache: cache.clone(),
            endpoint: "http://127.0.0.1:9".into(),
            offline: true,
        };
        let s1 = snapshot(&cache, "org/m", C1, &WHOLE);
        let s2 = snapshot(&cache, "org/m", C2, &WHOLE);
        assert!(matches!(lookup(&cfg, "org/m", "main"), Cached::Absent));
        set_ref(&cache, "org/m", "main", &format!("{C1}\n"));
        set_ref(&cache, "org/m", "v2", C2);
        let mut quiet = |_: &str| {};
        assert_eq!(resolve("org/m", &cfg, &mut quiet).unwrap(), s1);
        assert_eq!(resolve("org/m@main", &cfg, &mut quiet).unwrap(), s1);
        assert_eq!(resolve("org/m@v2", &cfg, &mut quiet).unwrap(), s2);
        // A commit hash needs no ref.
        assert_eq!(
            resolve(&format!("org/m@{C2}"), &cfg, &mut quiet).unwrap(),
            s2
        );
        let _ = std::fs::remove_dir_all(&cache);
    }

    #[test]
    fn a_missing_shard_makes_the_snapshot_incomplete() {
        let cache = tmp("shard");
        let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00002-of-00002.safetensors"}}"#;
        let snap = snapshot(
            &cache,
            "org/s",
            C1,
            &[
                ("config.json", "{}"),
                ("tokenizer.json", "{}"),
                ("model.safetensors.index.json", index),
                ("model-00001-of-00002.safetensors", "x"),
            ],
        );
        set_ref(&cache, "org/s", "main", C1);
        let cfg = HubConfig {
            cache: cache.clone(),
            endpoint: "http://127.0.0.1:9".into(),
            offline: true,
        };
        match lookup(&cfg, "org/s", "main") {
            Cached::Incomplete(d, m) => {
                assert_eq!(d, snap);
                assert_eq!(m, "model-00002-of-00002.safetensors");
            }
            other => panic!("{other:?}"),
        }
        let e = resolve("org/s", &cfg, &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
        std::fs::write(snap.join("model-00002-of-00002.safetensors"), "y").unwrap();
        assert!(matches!(lookup(&cfg, "org/s", "main"), Cached::Ready(_)));
        let _ = std::fs::remove_dir_all(&cache);
    }

    #[test]
    fn offline_miss_names_the_cache_and_the_fix() {
        let cache = tmp("offline");
        let cfg = HubConfig {
            cache: cache.clone(),
            endpoint: "http://127.0.0.1:9".into(),
            offline: true,
        };
        let e = resolve("org/none", &cfg, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(&cache.display().to_string()), "{e}");
        assert!(e.contains("HF_HUB_OFFLINE"), "{e}");
        assert!(e.contains("huggingface-cli download org/none"), "{e}");
        let e = resolve("org/none@v1", &cfg, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("--revision v1"), "{e}");
        let _ = std::fs::remove_dir_all(&cache);
    }

    #[test]
    fn unreachable_hub_fails_with_a_clear_message() {
        // Port 9 on loopback (discard) is closed here: the check must fail fast and say why.
        let e = check_reachable("http://127.0.0.1:9")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot reach the model hub"), "{e}");
        let cache = tmp("unreach");
        let cfg = HubConfig {
            cache: cache.clone(),
            endpoint: "http://127.0.0.1:9".into(),
            offline: false,
        };
        let e = resolve("org/none", &cfg, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot reach the model hub"), "{e}");
        let _ = std::fs::remove_dir_all(&cache);
    }
}
