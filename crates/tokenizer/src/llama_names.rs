//! llama.cpp's name-based token fix-ups at vocabulary load: tokens named like end-of-turn,
//! end-of-generation or fill-in-the-middle markers are forced to control type, a few are
//! forced back to user-defined / normal, and the end-of-generation (EOG) set is collected.
//! Reproduced because they change tokenization (control texts only match when specials are
//! parsed) and decoding (control tokens are hidden).

/// GGUF token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Candidates for the end-of-turn id when the file names none.
pub const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<end_of_utterance>",
];

/// Fill-in-the-middle markers (forced to control); pad / repo / file-sep also end generation.
const FIM_NAMES: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_EOG_NAMES: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// Names that end generation (forced to control). Note `</s>`: llama.cpp lists it for
/// PaddleOCR, which makes Gemma 3's user-defined `</s>` a control, end-of-generation token.
pub const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
];

/// Always rendered (gpt-oss): forced to user-defined.
const USER_DEFINED_NAMES: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Special ids as the file gives them.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecialIds {
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
}

/// Apply the fix-ups to `types` (GGUF token types, parallel to `tokens`). Returns the EOG ids
/// (sorted) and the end-of-turn id (the file's, else the lowest id with an EOT name).
pub fn apply(
    tokens: &[impl AsRef<[u8]>],
    types: &mut [i32],
    ids: SpecialIds,
) -> (Vec<u32>, Option<u32>) {
    let find_all = |names: &[&str]| -> Vec<u32> {
        tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| names.iter().any(|n| n.as_bytes() == t.as_ref()))
            .map(|(i, _)| i as u32)
            .collect()
    };
    fn force_control(ids: &[u32], types: &mut [i32]) {
        for &i in ids {
            types[i as usize] = CONTROL;
        }
    }
    // Without ids in the file, the first token with such a name becomes the EOT / EOM token.
    let eot_named = find_all(EOT_NAMES);
    let eot = ids.eot.or(eot_named.first().copied());
    if ids.eot.is_none() {
        force_control(&eot_named[..eot_named.len().min(1)], types);
    }
    let eom_named = find_all(&["<|eom_id|>"]);
    let eom = ids.eom.or(eom_named.first().copied());
    if ids.eom.is_none() {
        force_control(&eom_named[..eom_named.len().min(1)], types);
    }
    force_control(&find_all(FIM_NAMES), types);
    let fim_eog = find_all(FIM_EOG_NAMES);
    force_control(&fim_eog, types);
    let named_eog = find_all(EOG_NAMES);
    force_control(&named_eog, types);
    for i in find_all(USER_DEFINED_NAMES) {
        types[i as usize] = USER_DEFINED;
    }
    let mut eog: Vec<u32> = fim_eog.into_iter().chain(named_eog).collect();
    eog.extend([ids.eos, eot, eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();
    let text_of = |i: u32| tokens[i as usize].as_ref();
    let has =
        |eog: &[u32], name: &str| eog.iter().copied().find(|&i| text_of(i) == name.as_bytes());
    // o200k_harmony / solar-open: `<|end|>` is not an end of generation there.
    if let Some(end) = has(&eog, "<|end|>") {
        let ret_call = has(&eog, "<|return|>").is_some()
            && (has(&eog, "<|call|>").is_some() || has(&eog, "<|calls|>").is_some());
        let calls_flush = (has(&eog, "<|call|>").is_some() || has(&eog, "<|calls|>").is_some())
            && has(&eog, "<|flush|>").is_some();
        if ret_call || calls_flush {
            eog.retain(|&i| i != end);
            types[end as usize] = USER_DEFINED;
        }
    }
    // Gemma 4 / PaddleOCR: `</s>` is text when `<|tool_response>` exists.
    if let (Some(s), Some(_)) = (has(&eog, "</s>"), has(&eog, "<|tool_response>")) {
        eog.retain(|&i| i != s);
        types[s as usize] = NORMAL;
    }
    (eog, eot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_like_vocabulary() {
        let tokens = [
            "<pad>",
            "<eos>",
            "<bos>",
            "<end_of_turn>",
            "</s>",
            "<s>",
            "<|fim_pad|>",
            "x",
        ];
        let mut types = vec![3, 3, 3, 3, 4, 4, 1, 1];
        let (eog, eot) = apply(
            &tokens,
            &mut types,
            SpecialIds {
                eos: Some(1),
                ..SpecialIds::default()
            },
        );
        assert_eq!(eot, Some(3));
        assert_eq!(eog, vec![1, 3, 4, 6]);
        assert_eq!(types, vec![3, 3, 3, 3, 3, 4, 3, 1]);
    }

    #[test]
    fn workarounds() {
        let tokens = [
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "</s>",
            "<|tool_response>",
            "<|channel|>",
        ];
        let mut types = vec![1; 6];
        let (eog, _) = apply(&tokens, &mut types, SpecialIds::default());
        assert_eq!(eog, vec![1, 2, 4]);
        assert_eq!(types, vec![USER_DEFINED, 3, 3, NORMAL, 3, USER_DEFINED]);
    }
}
