//! Safetensors: one shard's header checked against its bytes, and the sharded index
//! (`model.safetensors.index.json`). The first byte picks which.
#![no_main]
use libfuzzer_sys::fuzz_target;
use slowfast_loader::safetensors::{parse_header, parse_index};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    if sel & 1 == 0 {
        if let Ok(ts) = parse_header(rest) {
            for (_, t) in ts {
                assert!(t.start <= t.end && t.end <= rest.len());
            }
        }
    } else if let Ok(files) = parse_index(rest) {
        for f in files {
            assert!(!f.contains('/') && !f.starts_with('.'));
        }
    }
});
