//! The GGUF reader on arbitrary bytes: header, metadata, tensor directory, data ranges;
//! a file that parses is then read as a model config and a tokenizer.
#![no_main]
use libfuzzer_sys::fuzz_target;
use slowfast_loader::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes(data) else {
        return;
    };
    for t in g.tensors() {
        let d = g.tensor_data(&t.name).expect("indexed tensor");
        assert_eq!(d.len() as u64, t.size);
    }
    for k in g.keys() {
        let _ = g.get_str_array(k);
        let _ = g.get_f32_array(k);
        let _ = g.get_i32_array(k);
    }
    let _ = slowfast_model::config::from_gguf(&g).map(|c| c.validate());
    if let Ok(tok) = slowfast_tokenizer::Tokenizer::from_gguf(&g) {
        if let Ok(ids) = tok.encode("Hello <start_of_turn>world é 😀", true) {
            let _ = tok.decode(&ids);
        }
    }
});
