//! Incremental decoding for streaming output: token bytes go in, only complete UTF-8 text
//! comes out (a character split across tokens is held until its last byte arrives).
use crate::Tokenizer;

/// Holds the undecoded tail of a token stream.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>, // bytes of an unfinished UTF-8 sequence
    special: bool,
}

impl StreamDecoder {
    /// A decoder that hides control tokens (like `Tokenizer::decode`).
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that prints control tokens' text too.
    pub fn with_special(special: bool) -> Self {
        StreamDecoder {
            pending: Vec::new(),
            special,
        }
    }

    /// Add one token; returns the text that became complete (often the whole token, empty
    /// while a multi-byte character is still partial).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        let bytes = tok.token_bytes(id, self.special);
        self.push_bytes(&bytes)
    }

    /// Add raw bytes; returns the text that became complete. Bytes that can never be valid
    /// UTF-8 come out as U+FFFD, as `String::from_utf8_lossy` would print them.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // The prefix up to `valid_up_to` is valid UTF-8.
                    out.push_str(std::str::from_utf8(&rest[..good]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for more bytes.
                        None => {
                            rest = &rest[good..];
                            break;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &rest[good + bad..];
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }

    /// Whatever is still held (an unfinished character), lossily; resets the decoder.
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// Bytes held back so far.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_multibyte_characters() {
        let text = "aé中😀b";
        let bytes = text.as_bytes();
        // Every way of cutting the bytes into 1..=3 byte chunks gives back the text.
        for chunk in 1..=3 {
            let mut d = StreamDecoder::new();
            let mut got = String::new();
            for c in bytes.chunks(chunk) {
                let s = d.push_bytes(c);
                got.push_str(&s);
                // Never emits a partial character.
                assert!(!s.contains(char::REPLACEMENT_CHARACTER));
            }
            got.push_str(&d.flush());
            assert_eq!(got, text, "chunk {chunk}");
        }
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(&[0xF0, 0x9F]), "");
        assert_eq!(d.pending(), &[0xF0, 0x9F]);
        assert_eq!(d.push_bytes(&[0x98]), "");
        assert_eq!(d.push_bytes(&[0x80, b'x']), "😀x");
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        // A truncated sequence followed by ASCII is invalid, not pending.
        assert_eq!(d.push_bytes(&[0xE4, 0xB8, b'c']), "\u{FFFD}c");
        assert_eq!(d.push_bytes(&[0xE4]), "");
        assert_eq!(d.flush(), "\u{FFFD}");
        assert!(d.pending().is_empty());
    }

    #[test]
    fn random_bytes_match_lossy_decode() {
        // splitmix64, enough for test data
        let mut x = 0x1234_5678_u64;
        let mut next = move || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let pool: Vec<u8> = "aé中😀"
            .bytes()
            .chain([0xFF, 0xC3, 0xE4, 0xF0, 0x80])
            .collect();
        for _ in 0..2000 {
            let len = (next() % 24) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| pool[(next() % pool.len() as u64) as usize])
                .collect();
            let mut d = StreamDecoder::new();
            let mut out = String::new();
            let mut i = 0;
            while i < bytes.len() {
                let n = 1 + (next() % 4) as usize;
                let end = (i + n).min(bytes.len());
                out.push_str(&d.push_bytes(&bytes[i..end]));
                i = end;
            }
            out.push_str(&d.flush());
            assert_eq!(out, String::from_utf8_lossy(&bytes), "{bytes:x?}");
        }
    }
}
