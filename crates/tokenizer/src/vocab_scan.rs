//! Token classes derived from the vocabulary's decoded text: sentence enders and newline-only
//! tokens (the Slow-Fast Inference trigger fires near sentence boundaries).

/// Characters that end a sentence.
const ENDERS: &[char] = &['.', '?', '!', '。', '？', '！'];

fn is_newline(c: char) -> bool {
    c == '\n' || c == '\r'
}

/// Closing quotes and brackets that may follow a sentence's final punctuation (`."`, `?'`, `!)`).
const CLOSERS: &[char] = &[
    '"', '\'', '\u{201d}', '\u{2019}', ')', '\u{300d}', '\u{300f}',
];

/// Decoded text ends a sentence: after stripping trailing newlines and then closing quotes or
/// brackets it ends in `.` `?` `!` `。` `？` `！` (a text of only newlines does not count).
/// Prose ends many sentences inside quotes (`."` is one token in Gemma's vocabulary).
pub fn is_sentence_ender(text: &str) -> bool {
    let core = text.trim_end_matches(is_newline).trim_end_matches(CLOSERS);
    core.ends_with(ENDERS)
}

/// The SFI reference's stricter class: the text is exactly one ender character, optionally
/// followed by newlines (`.`, `.\n`, `?\n\n`, ...), with no word or space before it.
pub fn is_punctuation_ender(text: &str) -> bool {
    let core = text.trim_end_matches(is_newline);
    let mut chars = core.chars();
    matches!((chars.next(), chars.next()), (Some(c), None) if ENDERS.contains(&c))
}

/// Decoded text is one or more newlines and nothing else.
pub fn is_newline_only(text: &str) -> bool {
    !text.is_empty() && text.chars().all(is_newline)
}

/// Ids whose decoded bytes (as valid UTF-8) satisfy `pred`.
pub fn scan(
    vocab_size: usize,
    bytes_of: impl Fn(u32) -> Vec<u8>,
    pred: impl Fn(&str) -> bool,
) -> Vec<u32> {
    (0..vocab_size as u32)
        .filter(|&id| {
            let b = bytes_of(id);
            std::str::from_utf8(&b).is_ok_and(&pred)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        for t in [
            ".",
            " end.",
            "?\n",
            "!\n\n",
            "。",
            "？",
            "Mr.",
            "...\r\n",
            ".\"",
            "?'\n",
            ".\u{201d}",
            "!)",
            "。」",
        ] {
            assert!(is_sentence_ender(t), "{t:?}");
        }
        for t in [
            "Mr", "\n", "", ". ", "a", ".a", "\n\n", "\"", "a\"", ")", ".\" ",
        ] {
            assert!(!is_sentence_ender(t), "{t:?}");
        }
        for t in [".", "?\n", "!\n\n", "。"] {
            assert!(is_punctuation_ender(t), "{t:?}");
        }
        for t in ["Mr.", " .", "..", "\n", "", "a"] {
            assert!(!is_punctuation_ender(t), "{t:?}");
        }
        assert!(is_newline_only("\n"));
        assert!(is_newline_only("\r\n\n"));
        assert!(!is_newline_only(""));
        assert!(!is_newline_only(" \n"));
    }
}
