//! Replays the inputs the fuzzers (`fuzz/`, docs/fuzzing.md) keep under
//! `fuzz/regressions/{gguf,safetensors}`: each must be refused or read, never panic.
use std::path::PathBuf;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions")
        .join(target);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut v: Vec<_> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn gguf_regressions_do_not_panic() {
    for (p, b) in inputs("gguf") {
        let r = std::panic::catch_unwind(|| {
            if let Ok(g) = slowfast_loader::gguf::GgufFile::from_bytes(&b) {
                for t in g.tensors() {
                    assert_eq!(g.tensor_data(&t.name).unwrap().len() as u64, t.size);
                }
            }
        });
        assert!(r.is_ok(), "{} panicked", p.display());
    }
}

#[test]
fn safetensors_regressions_do_not_panic() {
    for (p, b) in inputs("safetensors") {
        let Some((&sel, rest)) = b.split_first() else {
            continue;
        };
        let r = std::panic::catch_unwind(|| {
            if sel & 1 == 0 {
                let _ = slowfast_loader::safetensors::parse_header(rest);
            } else {
                let _ = slowfast_loader::safetensors::parse_index(rest);
            }
        });
        assert!(r.is_ok(), "{} panicked", p.display());
    }
}
