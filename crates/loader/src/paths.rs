//! Where slowfast keeps downloaded models and caches (`$SLOWFAST_HOME`, default ~/.cache/slowfast).
use std::path::PathBuf;

/// File name of the default model inside `$SLOWFAST_HOME/models`.
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// `$SLOWFAST_HOME`, or `~/.cache/slowfast`.
pub fn slowfast_home() -> PathBuf {
    if let Some(h) = std::env::var_os("SLOWFAST_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("slowfast")
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    slowfast_home().join("models").join(DEFAULT_MODEL_FILE)
}

/// The default model for tests: `$SLOWFAST_TEST_GGUF`, else the fetched default model.
/// Returns `None` (after printing a skip line) when absent, and panics when absent while
/// `SLOWFAST_REQUIRE_MODEL=1` (CI fetches the model first, so there a missing model fails).
pub fn test_model_path() -> Option<PathBuf> {
    let p = std::env::var_os("SLOWFAST_TEST_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(default_model_path);
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("SLOWFAST_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!(
            "SLOWFAST_REQUIRE_MODEL=1 but the default model is missing at {} (run `slowfast fetch`)",
            p.display()
        );
    }
    eprintln!(
        "skipped: default model not found at {} (run `slowfast fetch`)",
        p.display()
    );
    None
}
