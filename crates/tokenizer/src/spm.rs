//! SentencePiece-style vocabulary (GGUF `tokenizer.ggml.model == "llama"`): llama.cpp's SPM
//! tokenization (space escaping, special-text partition, score-ordered bigram merges, byte
//! fallback) and its piece decoding, reproduced id for id.
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{Result, TokenizerError};
use crate::llama_names::{self, SpecialIds};
use crate::partition::{partition, Fragment, SpecialText};

/// U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's visible space.
const SPACE_MARK: &str = "\u{2581}";

/// Token kinds as stored in GGUF `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    pub fn from_gguf(t: i32) -> Self {
        match t {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Undefined,
        }
    }

    /// Control and unknown tokens are "special": hidden on decode unless asked for, and only
    /// matched in input text when specials are parsed.
    pub fn is_special(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::Unknown)
    }
}

/// Special ids and flags of an SPM vocabulary (GGUF `tokenizer.ggml.*` scalars).
#[derive(Debug, Clone)]
pub struct SpmConfig {
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
}

impl Default for SpmConfig {
    /// llama.cpp's defaults for a `llama` vocabulary whose metadata says nothing.
    fn default() -> Self {
        SpmConfig {
            bos_id: Some(1),
            eos_id: Some(2),
            unk_id: Some(0),
            pad_id: None,
            eot_id: None,
            add_bos: true,
            add_eos: false,
            add_space_prefix: true,
        }
    }
}

/// A loaded SentencePiece vocabulary.
pub struct SpmVocab {
    texts: Vec<Vec<u8>>,   // [n_vocab] raw token text
    scores: Vec<f32>,      // [n_vocab]
    kinds: Vec<TokenKind>, // [n_vocab]
    pieces: Vec<Vec<u8>>,  // [n_vocab] decoded bytes (control/unknown: their raw text)
    text_to_id: HashMap<Vec<u8>, u32>,
    specials: Vec<SpecialText>, // control / user-defined / unknown, longest text first
    eog: Vec<u32>,              // end-of-generation ids, as llama.cpp collects them
    byte_ids: [Option<u32>; 256],
    cfg: SpmConfig,
}

/// A candidate merge of two adjacent symbols.
#[derive(Debug, Clone, Copy)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Highest score first; on equal scores the leftmost pair first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A run of input bytes that is (so far) one token candidate, in a linked list.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    n: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SpmVocab {
    /// Build from the parallel GGUF arrays. `types` are GGUF token types (1 normal, 2
    /// unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub fn new(
        tokens: Vec<Vec<u8>>,
        scores: Vec<f32>,
        types: &[i32],
        mut cfg: SpmConfig,
    ) -> Result<Self> {
        let n = tokens.len();
        if n == 0 {
            return Err(TokenizerError::BadVocab("the token list is empty".into()));
        }
        if n > u32::MAX as usize {
            return Err(TokenizerError::BadVocab(format!("{n} tokens is too many")));
        }
        if scores.len() != n {
            return Err(TokenizerError::BadVocab(format!(
                "{} scores for {n} tokens",
                scores.len()
            )));
        }
        if types.len() != n {
            return Err(TokenizerError::BadVocab(format!(
                "{} token types for {n} tokens",
                types.len()
            )));
        }
        for (name, id) in [
            ("bos_token_id", &mut cfg.bos_id),
            ("eos_token_id", &mut cfg.eos_id),
            ("unknown_token_id", &mut cfg.unk_id),
            ("padding_token_id", &mut cfg.pad_id),
            ("eot_token_id", &mut cfg.eot_id),
        ] {
            if let Some(v) = *id {
                if v as usize >= n {
                    return Err(TokenizerError::BadVocab(format!(
                        "{name} {v} is outside the vocabulary of {n} tokens"
                    )));
                }
            }
        }
        // llama.cpp's name-based fix-ups (end-of-turn / FIM names become control tokens).
        let mut types = types.to_vec();
        let (eog, eot) = llama_names::apply(
            &tokens,
            &mut types,
            SpecialIds {
                eos: cfg.eos_id,
                eot: cfg.eot_id,
                eom: None,
            },
        );
        cfg.eot_id = eot;
        let kinds: Vec<TokenKind> = types.iter().map(|&t| TokenKind::from_gguf(t)).collect();
        let mut text_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // Later ids win on duplicate texts, as in llama.cpp.
            text_to_id.insert(t.clone(), i as u32);
        }
        if cfg.add_bos && cfg.bos_id.is_none() {
            return Err(TokenizerError::BadVocab(
                "add_bos_token is true but there is no bos_token_id".into(),
            ));
        }
        if cfg.add_eos && cfg.eos_id.is_none() {
            return Err(TokenizerError::BadVocab(
                "add_eos_token is true but there is no eos_token_id".into(),
            ));
        }
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = text_to_id
                .get(hex.as_bytes())
                .or_else(|| text_to_id.get(&[b as u8][..]))
                .copied();
        }
        let pieces = tokens
            .iter()
            .zip(&kinds)
            .map(|(t, &k)| piece_of(t, k))
            .collect();
        let mut specials: Vec<SpecialText> = kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| {
                matches!(
                    k,
                    TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
                )
            })
            .filter(|(i, _)| !tokens[*i].is_empty())
            .map(|(i, _)| SpecialText {
                id: i as u32,
                text: tokens[i].clone(),
            })
            .collect();
        specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        Ok(SpmVocab {
            texts: tokens,
            scores,
            kinds,
            pieces,
            text_to_id,
            specials,
            eog,
            byte_ids,
            cfg,
        })
    }

    pub fn config(&self) -> &SpmConfig {
        &self.cfg
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Raw vocabulary text of a token (with U+2581 for spaces).
    pub fn text(&self, id: u32) -> Option<&[u8]> {
        self.texts.get(id as usize).map(|t| t.as_slice())
    }

    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.text_to_id.get(text.as_bytes()).copied()
    }

    /// Decoded bytes of one token; control / unknown tokens give nothing unless `special`.
    pub fn piece(&self, id: u32, special: bool) -> &[u8] {
        match self.kinds.get(id as usize) {
            None => &[],
            Some(k) if k.is_special() && !special => &[],
            Some(_) => &self.pieces[id as usize],
        }
    }

    /// Encode `text`. `add_special` adds BOS/EOS as the vocabulary asks; `parse_special`
    /// lets control-token texts in the input become those tokens (user-defined tokens are
    /// always matched first, as in llama.cpp).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let bytes = text.as_bytes();
        let frags = partition(bytes, &self.specials, |id| {
            parse_special || !self.kinds[id as usize].is_special()
        });
        let mut out = Vec::with_capacity(bytes.len() / 3 + 2);
        if add_special && self.cfg.add_bos {
            out.extend(self.cfg.bos_id);
        }
        let mut prev_special = true;
        let mut buf = String::new();
        for f in frags {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Raw { start, end } => {
                    buf.clear();
                    if self.cfg.add_space_prefix && prev_special {
                        buf.push_str(SPACE_MARK);
                    }
                    for ch in text[start..end].chars() {
                        if ch == ' ' {
                            buf.push_str(SPACE_MARK);
                        } else {
                            buf.push(ch);
                        }
                    }
                    self.encode_raw(&buf, &mut out)?;
                    prev_special = false;
                }
            }
        }
        if add_special && self.cfg.add_eos {
            out.extend(self.cfg.eos_id);
        }
        Ok(out)
    }

    /// The bigram-merge pass over already space-escaped text.
    fn encode_raw(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let bytes = text.as_bytes();
        // One symbol per UTF-8 character.
        let mut symbols: Vec<Symbol> = Vec::with_capacity(bytes.len());
        for (i, (start, ch)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                n: ch.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
        }
        let count = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.next = (i + 1 < count).then_some(i + 1);
        }
        if count == 0 {
            return Ok(());
        }
        let mut queue = BinaryHeap::with_capacity(count);
        for i in 1..count {
            self.try_add_bigram(bytes, &symbols, Some(i - 1), Some(i), &mut queue);
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (symbols[bg.left], symbols[bg.right]);
            if l.n == 0 || r.n == 0 || l.n + r.n != bg.size {
                continue; // stale: one side already merged
            }
            symbols[bg.left].n += r.n;
            symbols[bg.right].n = 0;
            symbols[bg.left].next = r.next;
            if let Some(nx) = r.next {
                symbols[nx].prev = Some(bg.left);
            }
            let prev = symbols[bg.left].prev;
            let next = symbols[bg.left].next;
            self.try_add_bigram(bytes, &symbols, prev, Some(bg.left), &mut queue);
            self.try_add_bigram(bytes, &symbols, Some(bg.left), next, &mut queue);
        }
        let mut cur = Some(0);
        while let Some(i) = cur {
            let s = symbols[i];
            let piece = &bytes[s.start..s.start + s.n];
            match self.text_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    // A character with no token: fall back to its bytes.
                    for &b in piece {
                        match self.byte_ids[b as usize].or(self.cfg.unk_id) {
                            Some(id) => out.push(id),
                            None => {
                                return Err(TokenizerError::Encode(format!(
                                    "no byte-fallback token for byte 0x{b:02X} and no unknown token"
                                )))
                            }
                        }
                    }
                }
            }
            cur = s.next;
        }
        Ok(())
    }

    fn try_add_bigram(
        &self,
        bytes: &[u8],
        symbols: &[Symbol],
        left: Option<usize>,
        right: Option<usize>,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let size = l.n + r.n;
        let Some(&id) = self.text_to_id.get(&bytes[l.start..l.start + size]) else {
            return;
        };
        queue.push(Bigram {
            left,
            right,
            score: self.scores[id as usize],
            size,
        });
    }

    /// End-of-generation ids: EOS, end-of-turn and the other names llama.cpp stops on.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Token ids of the special (control / user-defined / unknown) texts, longest first.
    pub fn special_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.specials.iter().map(|s| s.id)
    }
}

/// Decoded bytes of a token as llama.cpp's `token_to_piece` gives them with `special=true`.
fn piece_of(text: &[u8], kind: TokenKind) -> Vec<u8> {
    match kind {
        TokenKind::Normal => unescape(text),
        TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined => text.to_vec(),
        TokenKind::Byte => parse_byte_token(text).map(|b| vec![b]).unwrap_or_default(),
        TokenKind::Unused | TokenKind::Undefined => Vec::new(),
    }
}

/// U+2581 -> ' '.
fn unescape(text: &[u8]) -> Vec<u8> {
    let mark = SPACE_MARK.as_bytes();
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i..].starts_with(mark) {
            out.push(b' ');
            i += mark.len();
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

/// `<0xAB>` -> 0xAB.
fn parse_byte_token(text: &[u8]) -> Option<u8> {
    let s = std::str::from_utf8(text).ok()?;
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny vocabulary: bytes, a few merges, a user-defined token and a control token.
    fn tiny() -> SpmVocab {
        let mut toks: Vec<(String, f32, i32)> = vec![
            ("<unk>".into(), 0.0, 2),
            ("<s>".into(), 0.0, 3),
            ("</s>".into(), 0.0, 3),
            ("<ctl>".into(), 0.0, 3),
            ("\n\n".into(), 0.0, 4),
        ];
        for b in 0..=255u8 {
            toks.push((format!("<0x{b:02X}>"), 0.0, 6));
        }
        for (t, s) in [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("he", -3.0),
            ("ll", -1.5),
            ("hell", -2.5),
            ("hello", -1.0),
            ("▁hello", -0.5),
            ("lo", -0.1),
            ("é", -4.0),
        ] {
            toks.push((t.into(), s, 1));
        }
        let types: Vec<i32> = toks.iter().map(|t| t.2).collect();
        let cfg = SpmConfig {
            add_space_prefix: false,
            ..SpmConfig::default()
        };
        SpmVocab::new(
            toks.iter().map(|t| t.0.as_bytes().to_vec()).collect(),
            toks.iter().map(|t| t.1).collect(),
            &types,
            cfg,
        )
        .unwrap()
    }

    fn ids(v: &SpmVocab, words: &[&str]) -> Vec<u32> {
        words.iter().map(|w| v.id_of(w).unwrap()).collect()
    }

    #[test]
    fn merges_follow_scores() {
        let v = tiny();
        // "lo" (-0.1) merges first, which leaves "ll" stale; then "he"; "hel" is no token.
        let got = v.encode("hello", false, false).unwrap();
        assert_eq!(got, ids(&v, &["he", "l", "lo"]));
        let got = v.encode(" hello", true, false).unwrap();
        assert_eq!(got[0], 1);
        assert_eq!(&got[1..], ids(&v, &["▁", "he", "l", "lo"]).as_slice());
    }

    #[test]
    fn byte_fallback_and_specials() {
        let v = tiny();
        // 'ß' is not in the vocabulary: two byte tokens.
        let got = v.encode("ß\n\n<ctl>", false, false).unwrap();
        let mut want = vec![v.id_of("<0xC3>").unwrap(), v.id_of("<0x9F>").unwrap()];
        want.push(v.id_of("\n\n").unwrap());
        // Without parse_special the control text is plain text ('l' is a vocabulary token).
        for c in "<ctl>".chars() {
            let byte = format!("<0x{:02X}>", c as u32);
            want.push(v.id_of(&c.to_string()).or(v.id_of(&byte)).unwrap());
        }
        assert_eq!(got, want);
        let got = v.encode("<ctl>é", false, true).unwrap();
        assert_eq!(got, ids(&v, &["<ctl>", "é"]));
    }

    #[test]
    fn pieces_decode() {
        let v = tiny();
        assert_eq!(v.piece(v.id_of("▁hello").unwrap(), false), b" hello");
        assert_eq!(v.piece(v.id_of("<0xC3>").unwrap(), false), &[0xC3]);
        assert_eq!(v.piece(3, false), b"");
        assert_eq!(v.piece(3, true), b"<ctl>");
        assert_eq!(v.piece(99_999, true), b"");
    }

    #[test]
    fn rejects_bad_arrays() {
        let e = SpmVocab::new(vec![b"a".to_vec()], vec![], &[1], SpmConfig::default());
        assert!(e.is_err());
        let e = SpmVocab::new(
            vec![b"a".to_vec()],
            vec![0.0],
            &[1],
            SpmConfig {
                bos_id: Some(5),
                ..SpmConfig::default()
            },
        );
        let msg = e.err().unwrap().to_string();
        assert!(msg.contains("bos_token_id 5"), "{msg}");
    }
}
