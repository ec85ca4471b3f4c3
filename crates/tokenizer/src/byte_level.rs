//! Byte-level stand-in tokenizer for `random:<preset>` models: ids 0..=255 are the bytes,
//! then BOS and EOS; any further ids of the preset's vocabulary are unused (decode to nothing).
use crate::error::{Result, TokenizerError};

/// Ids 0..256 = bytes, 256 = BOS, 257 = EOS, 258.. unused.
#[derive(Debug, Clone)]
pub struct ByteTokenizer {
    vocab_size: usize,
}

pub const BYTE_BOS: u32 = 256;
pub const BYTE_EOS: u32 = 257;
const BOS_TEXT: &str = "<bos>";
const EOS_TEXT: &str = "<eos>";

impl ByteTokenizer {
    /// `vocab_size` must hold the 256 bytes plus BOS and EOS.
    pub fn new(vocab_size: usize) -> Result<Self> {
        if vocab_size < 258 {
            return Err(TokenizerError::BadVocab(format!(
                "the byte-level tokenizer needs a vocabulary of at least 258 ids (256 bytes + BOS + EOS), got {vocab_size}"
            )));
        }
        if vocab_size > u32::MAX as usize {
            return Err(TokenizerError::BadVocab(format!(
                "vocabulary of {vocab_size} ids is too large"
            )));
        }
        Ok(ByteTokenizer { vocab_size })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Bytes of `text`, with BOS first when `add_special`. With `parse_special` the literal
    /// texts `<bos>` / `<eos>` become those ids.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() + 1);
        if add_special {
            out.push(BYTE_BOS);
        }
        let mut rest = text.as_bytes();
        while !rest.is_empty() {
            if parse_special {
                if let Some(r) = rest.strip_prefix(BOS_TEXT.as_bytes()) {
                    out.push(BYTE_BOS);
                    rest = r;
                    continue;
                }
                if let Some(r) = rest.strip_prefix(EOS_TEXT.as_bytes()) {
                    out.push(BYTE_EOS);
                    rest = r;
                    continue;
                }
            }
            out.push(rest[0] as u32);
            rest = &rest[1..];
        }
        out
    }

    /// Decoded bytes of one id (BOS/EOS text only when `special`).
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        match id {
            0..=255 => vec![id as u8],
            BYTE_BOS if special => BOS_TEXT.as_bytes().to_vec(),
            BYTE_EOS if special => EOS_TEXT.as_bytes().to_vec(),
            _ => Vec::new(),
        }
    }

    /// Vocabulary text: printable ASCII as itself, other bytes as `<0xXX>`.
    pub fn token_text(&self, id: u32) -> Option<String> {
        match id {
            0x21..=0x7E => Some((id as u8 as char).to_string()),
            0..=255 => Some(format!("<0x{id:02X}>")),
            BYTE_BOS => Some(BOS_TEXT.into()),
            BYTE_EOS => Some(EOS_TEXT.into()),
            _ if (id as usize) < self.vocab_size => Some(format!("<unused{}>", id - 258)),
            _ => None,
        }
    }

    pub fn is_special(&self, id: u32) -> bool {
        id >= 256
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_specials() {
        let t = ByteTokenizer::new(300).unwrap();
        let ids = t.encode("hé<bos>", true, false);
        assert_eq!(ids[0], BYTE_BOS);
        assert_eq!(ids.len(), 1 + "hé<bos>".len());
        let ids = t.encode("a<eos>", false, true);
        assert_eq!(ids, vec![97, BYTE_EOS]);
        assert_eq!(t.token_bytes(BYTE_EOS, false), b"");
        assert_eq!(t.token_bytes(299, true), b"");
        assert_eq!(t.token_text(298).unwrap(), "<unused40>");
        assert_eq!(t.token_text(300), None);
        let e = ByteTokenizer::new(100).unwrap_err().to_string();
        assert!(e.contains("at least 258"), "{e}");
    }
}
