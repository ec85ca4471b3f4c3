//! Splitting input text around special / user-defined token texts before the subword pass
//! (llama.cpp's `tokenizer_st_partition`: specials longest-first, each matched left to right
//! over every still-raw fragment).

/// A piece of the input: raw text still to be tokenized, or an already-resolved token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    /// Byte range `[start, end)` of the input text.
    Raw { start: usize, end: usize },
    /// A special token matched literally in the text.
    Token(u32),
}

/// One special token the partition may match: its id and literal text.
#[derive(Debug, Clone)]
pub struct SpecialText {
    pub id: u32,
    pub text: Vec<u8>,
}

/// Which adjacent byte pairs occur in a text: a cheap filter that rules out most special
/// texts before the substring search.
struct PairSet {
    bits: Vec<u64>, // [65536 / 64]
    singles: [u64; 4],
}

impl PairSet {
    fn new(text: &[u8]) -> Self {
        let mut bits = vec![0u64; 1024];
        let mut singles = [0u64; 4];
        for &b in text {
            singles[(b >> 6) as usize] |= 1 << (b & 63);
        }
        for w in text.windows(2) {
            let k = ((w[0] as usize) << 8) | w[1] as usize;
            bits[k >> 6] |= 1 << (k & 63);
        }
        PairSet { bits, singles }
    }

    fn may_contain(&self, needle: &[u8]) -> bool {
        match needle.len() {
            0 => false,
            1 => self.singles[(needle[0] >> 6) as usize] & (1 << (needle[0] & 63)) != 0,
            _ => needle.windows(2).all(|w| {
                let k = ((w[0] as usize) << 8) | w[1] as usize;
                self.bits[k >> 6] & (1 << (k & 63)) != 0
            }),
        }
    }
}

/// Split `text` around occurrences of `specials` (already ordered longest text first).
/// `include(id)` says whether a special takes part in this call (control tokens only take
/// part when specials are parsed).
pub fn partition(
    text: &[u8],
    specials: &[SpecialText],
    include: impl Fn(u32) -> bool,
) -> Vec<Fragment> {
    if text.is_empty() {
        return Vec::new();
    }
    let mut frags = vec![Fragment::Raw {
        start: 0,
        end: text.len(),
    }];
    let pairs = PairSet::new(text);
    let mut next = Vec::new();
    for sp in specials {
        if !include(sp.id) || !pairs.may_contain(&sp.text) {
            continue;
        }
        let mut changed = false;
        next.clear();
        for &frag in &frags {
            let Fragment::Raw { start, end } = frag else {
                next.push(frag);
                continue;
            };
            let mut base = start;
            while let Some(pos) = find(&text[base..end], &sp.text) {
                let m = base + pos;
                if m > base {
                    next.push(Fragment::Raw {
                        start: base,
                        end: m,
                    });
                }
                next.push(Fragment::Token(sp.id));
                changed = true;
                base = m + sp.text.len();
                if base >= end {
                    break;
                }
            }
            if base < end {
                next.push(Fragment::Raw { start: base, end });
            }
        }
        if changed {
            std::mem::swap(&mut frags, &mut next);
        }
    }
    frags
}

/// First occurrence of `needle` in `hay` (plain byte search; `needle` is non-empty).
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.len() > hay.len() {
        return None;
    }
    let first = needle[0];
    let last_start = hay.len() - needle.len();
    let mut i = 0;
    while i <= last_start {
        match hay[i..=last_start].iter().position(|&b| b == first) {
            None => return None,
            Some(p) => {
                let at = i + p;
                if &hay[at..at + needle.len()] == needle {
                    return Some(at);
                }
                i = at + 1;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(id: u32, t: &str) -> SpecialText {
        SpecialText {
            id,
            text: t.as_bytes().to_vec(),
        }
    }

    #[test]
    fn splits_longest_first() {
        // Ordered longest first, as the vocabulary builds them.
        let specials = vec![sp(3, "\n\n\n"), sp(2, "\n\n"), sp(1, "\n"), sp(9, "<b>")];
        let text = b"a\n\n\n\n\nb<b>c";
        let f = partition(text, &specials, |_| true);
        assert_eq!(
            f,
            vec![
                Fragment::Raw { start: 0, end: 1 },
                Fragment::Token(3),
                Fragment::Token(2),
                Fragment::Raw { start: 6, end: 7 },
                Fragment::Token(9),
                Fragment::Raw { start: 10, end: 11 },
            ]
        );
    }

    #[test]
    fn excluded_specials_stay_raw() {
        let specials = vec![sp(9, "<b>")];
        let f = partition(b"x<b>", &specials, |id| id != 9);
        assert_eq!(f, vec![Fragment::Raw { start: 0, end: 4 }]);
        assert!(partition(b"", &specials, |_| true).is_empty());
    }

    #[test]
    fn find_matches_std() {
        let hay = b"abcabcabd";
        for needle in [&b"abd"[..], b"c", b"bca", b"zz", b"abcabcabdx"] {
            let want = hay.windows(needle.len()).position(|w| w == needle);
            assert_eq!(find(hay, needle), want, "{needle:?}");
        }
    }
}
