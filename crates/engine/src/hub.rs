//! `hf:<org>/<repo>`: download an HF model repository (config, tokenizer, safetensors) into
//! `$SLOWFAST_HOME/hub/<org>/<repo>` over HTTPS, or fail clearly when no hub is reachable.
use std::io::{Read, Write};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::EngineError;

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into())
}

fn err(msg: String) -> EngineError {
    EngineError::BadInput(msg)
}

/// Fail fast (a few seconds) when the hub's host cannot be reached at all.
fn check_reachable(base: &str) -> Result<(), EngineError> {
    let host = base
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or("");
    let addr = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:443")
    };
    let unreachable = |why: String| {
        err(format!(
            "cannot reach the model hub at {base} ({why}); this machine has no route to it. \
             Download the repository elsewhere and pass its directory with --model DIR"
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

fn get(url: &str, dest: &Path, progress: &mut dyn FnMut(&str)) -> Result<bool, EngineError> {
    let mut resp = match ureq::get(url).call() {
        Ok(r) => r,
        Err(ureq::Error::StatusCode(404)) => return Ok(false),
        Err(e) => return Err(err(format!("GET {url}: {e}"))),
    };
    let tmp = dest.with_extension("part");
    let mut f = std::fs::File::create(&tmp).map_err(|e| err(format!("{}: {e}", tmp.display())))?;
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
        f.write_all(&buf[..k])
            .map_err(|e| err(format!("{}: {e}", tmp.display())))?;
        n += k as u64;
        if n - last >= 100 << 20 {
            progress(&format!("  {} MB of {}", n >> 20, dest.display()));
            last = n;
        }
    }
    std::fs::rename(&tmp, dest).map_err(|e| err(format!("{}: {e}", dest.display())))?;
    Ok(true)
}

/// Download `org/repo` (main revision) and return its local directory.
pub fn download(repo: &str, progress: &mut dyn FnMut(&str)) -> Result<PathBuf, EngineError> {
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty() || p.starts_with('.')) {
        return Err(err(format!("hf:{repo}: expected hf:<org>/<repo>")));
    }
    let dir = slowfast_loader::slowfast_home()
        .join("hub")
        .join(parts[0])
        .join(parts[1]);
    if dir.join("config.json").is_file() && dir.join(".complete").is_file() {
        return Ok(dir);
    }
    let base = endpoint();
    check_reachable(&base)?;
    std::fs::create_dir_all(&dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
    let url = |f: &str| format!("{base}/{repo}/resolve/main/{f}");
    progress(&format!("downloading hf:{repo} into {}", dir.display()));
    if !get(&url("config.json"), &dir.join("config.json"), progress)? {
        return Err(err(format!(
            "hf:{repo}: no config.json (is it a model repository?)"
        )));
    }
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        get(&url(f), &dir.join(f), progress)?;
    }
    if !get(
        &url("model.safetensors"),
        &dir.join("model.safetensors"),
        progress,
    )? {
        let index = dir.join("model.safetensors.index.json");
        if !get(&url("model.safetensors.index.json"), &index, progress)? {
            return Err(err(format!("hf:{repo}: no model.safetensors or index")));
        }
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&index)
                .map_err(|e| err(format!("{}: {e}", index.display())))?,
        )
        .map_err(|e| err(format!("{}: {e}", index.display())))?;
        let mut shards: Vec<String> = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .map(|m| {
                m.values()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        for s in shards {
            if s.contains('/') || s.starts_with('.') {
                return Err(err(format!("hf:{repo}: bad shard name {s:?}")));
            }
            progress(&format!("downloading {s}"));
            if !get(&url(&s), &dir.join(&s), progress)? {
                return Err(err(format!("hf:{repo}: shard {s} is missing")));
            }
        }
    }
    std::fs::write(dir.join(".complete"), b"")
        .map_err(|e| err(format!("{}: {e}", dir.display())))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_repo_names_are_rejected() {
        for r in ["", "org", "org/", "/repo", "a/b/c", "../x"] {
            assert!(download(r, &mut |_| {}).is_err(), "{r}");
        }
    }

    #[test]
    fn unreachable_hub_fails_with_a_clear_message() {
        // Port 9 on loopback (discard) is closed here: the check must fail fast and say why.
        let e = check_reachable("http://127.0.0.1:9")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot reach the model hub"), "{e}");
    }
}
