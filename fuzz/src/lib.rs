//! Shared pieces of the slowfast fuzz targets: the tokenizers they run (loaded once) and
//! the repository paths their fixtures come from.
use std::path::PathBuf;
use std::sync::OnceLock;

use slowfast_tokenizer::Tokenizer;

/// The repository root (the parent of `fuzz/`).
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The default model if present (`SLOWFAST_FUZZ_MODEL` overrides the path).
pub fn default_model() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("SLOWFAST_FUZZ_MODEL") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/slowfast/models/gemma-3-270m-q4_k_m.gguf");
    p.is_file().then_some(p)
}

/// SentencePiece: the default model's tokenizer (Gemma 3, 262k pieces), else the tiny llama
/// GGUF fixture.
pub fn spm() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let p =
            default_model().unwrap_or_else(|| repo().join("tests/fixtures/gguf/llama-tiny.gguf"));
        Tokenizer::from_gguf_path(&p).expect("SentencePiece tokenizer")
    })
}

/// Byte-level BPE: the tiny Qwen 3 GGUF fixture (`tokenizer.ggml.model = gpt2`).
pub fn bpe() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_gguf_path(&repo().join("tests/fixtures/gguf/qwen3-tiny.gguf"))
            .expect("BPE tokenizer")
    })
}

/// The HF `tokenizer.json` fixture (BPE via the `tokenizers` crate).
pub fn hf_bpe() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_hf_dir(&repo().join("tests/fixtures/hf/qwen3")).expect("HF"))
}

/// The byte-level stand-in tokenizer of random models.
pub fn bytes() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::byte_level(512).expect("byte level"))
}

/// Little-endian u32 ids from raw bytes.
pub fn ids(data: &[u8]) -> Vec<u32> {
    data.chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}
