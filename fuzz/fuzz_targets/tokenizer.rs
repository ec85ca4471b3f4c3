//! Encode and decode arbitrary bytes with the SentencePiece (default model, else fixture),
//! GGUF BPE, HF BPE and byte-level tokenizers, and stream-decode arbitrary id sequences.
#![no_main]
use libfuzzer_sys::fuzz_target;
use slowfast_tokenizer::{StreamDecoder, Tokenizer};

fn pick(sel: u8) -> &'static Tokenizer {
    match sel % 4 {
        0 => slowfast_fuzz::spm(),
        1 => slowfast_fuzz::bpe(),
        2 => slowfast_fuzz::hf_bpe(),
        _ => slowfast_fuzz::bytes(),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let tok = pick(sel);
    let special = sel & 0x10 != 0;
    if sel & 0x20 == 0 {
        // Text in: encode, decode back.
        let text = String::from_utf8_lossy(rest);
        if let Ok(ids) = tok.encode_with(&text, sel & 0x40 != 0, special) {
            let n = tok.vocab_size() as u32;
            assert!(
                ids.iter().all(|&i| i < n),
                "encode produced an id past the vocabulary"
            );
            let _ = tok.decode_with(&ids, special);
            let mut sd = StreamDecoder::with_special(special);
            let mut s: String = ids.iter().map(|&i| sd.push(tok, i)).collect();
            s.push_str(&sd.flush());
        }
    } else {
        // Ids in (some past the vocabulary): decode and stream-decode must agree.
        let n = tok.vocab_size() as u32;
        let ids: Vec<u32> = slowfast_fuzz::ids(rest)
            .into_iter()
            .map(|i| if sel & 0x80 != 0 { i } else { i % (n + 8) })
            .collect();
        let full = tok.decode_with(&ids, special);
        let mut sd = StreamDecoder::with_special(special);
        let mut s: String = ids.iter().map(|&i| sd.push(tok, i)).collect();
        s.push_str(&sd.flush());
        let _ = full;
        let _ = tok.token_text(ids.first().copied().unwrap_or(0));
        // Raw byte pushes, split at arbitrary points.
        let mut sd = StreamDecoder::new();
        let mut out = String::new();
        for c in rest.chunks((sel as usize % 7) + 1) {
            out.push_str(&sd.push_bytes(c));
        }
        out.push_str(&sd.flush());
        assert_eq!(
            out,
            String::from_utf8_lossy(rest),
            "stream decode differs from lossy"
        );
    }
});
