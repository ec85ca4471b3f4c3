//! Tests of `eval --task ruler`: prompt generation on a byte-level tokenizer (one token a
//! byte, so sizes are exact), scoring on hand-made outputs, and the chat wrapping.
use super::*;
use slowfast_tokenizer::Tokenizer;

const ESSAY: &str = "It is a truth universally acknowledged, that a single man in possession \
of a good fortune, must be in want of a wife. However little known the feelings or views of \
such a man may be on his first entering a neighbourhood, this truth is so well fixed in the \
minds of the surrounding families, that he is considered the rightful property of some one or \
other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, \"have you \
heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. ";

fn essay() -> String {
    ESSAY.repeat(30)
}

fn text(tok: &Tokenizer, s: &RulerSample) -> String {
    tok.decode(&s.tokens)
}

#[test]
fn string_match_all_is_the_mean_of_case_insensitive_hits() {
    let refs = |r: &[&str]| r.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(string_match_all(" 1234567.", &refs(&["1234567"])), 100.0);
    assert_eq!(string_match_all(" 1234568.", &refs(&["1234567"])), 0.0);
    let s = string_match_all(
        " are: ABCDE, fghij and klm",
        &refs(&["abcde", "FGHIJ", "nopqr"]),
    );
    assert!((s - 200.0 / 3.0).abs() < 1e-9, "{s}");
    assert_eq!(string_match_all("", &refs(&["x"])), 0.0);
    assert_eq!(string_match_all("anything", &[]), 0.0);
    // Substring hits: a longer number containing the reference counts, as in RULER.
    assert_eq!(string_match_all("91234567", &refs(&["1234567"])), 100.0);
}

#[test]
fn every_task_fits_the_context_and_ends_with_its_answer_prefix() {
    let tok = Tokenizer::byte_level(300).unwrap();
    let e = essay();
    for context in [3000, 12000] {
        let g = RulerGen::new(&tok, Some(&e), context, 5, false);
        for task in RulerTask::ALL {
            for i in 0..2 {
                let s = g.sample(task, i, 2).unwrap();
                let n = s.tokens.len() + task.budget();
                assert!(n <= context, "{} at {context}: {n}", task.name());
                // The haystack grew to fill the context, up to one haystack unit (a noise
                // line, a whole essay sentence, a needle or a list entry).
                assert!(
                    n + 300 > context,
                    "{} at {context}: only {n} tokens",
                    task.name()
                );
                assert_eq!(s.tokens[0], tok.bos_id().unwrap(), "BOS first");
                let t = text(&tok, &s);
                assert!(
                    t.ends_with(&s.answer_prefix),
                    "{}: {:?}",
                    task.name(),
                    &t[t.len() - 120..]
                );
                assert!(!s.answers.is_empty());
                for a in &s.answers {
                    assert!(
                        t.contains(a.as_str()),
                        "{}: {a} not in the prompt",
                        task.name()
                    );
                }
            }
        }
    }
}

#[test]
fn samples_are_deterministic_in_the_seed() {
    let tok = Tokenizer::byte_level(300).unwrap();
    let e = essay();
    let g = RulerGen::new(&tok, Some(&e), 3000, 7, false);
    let other = RulerGen::new(&tok, Some(&e), 3000, 8, false);
    for task in RulerTask::ALL {
        let s = g.sample(task, 1, 4).unwrap();
        assert_eq!(s, g.sample(task, 1, 4).unwrap(), "{}", task.name());
        assert_ne!(s.tokens, g.sample(task, 2, 4).unwrap().tokens);
        assert_ne!(s.answers, other.sample(task, 1, 4).unwrap().answers);
    }
}

#[test]
fn niah_needles_sit_at_the_spread_depths_with_ruler_wording() {
    let tok = Tokenizer::byte_level(300).unwrap();
    let e = essay();
    let g = RulerGen::new(&tok, Some(&e), 6000, 3, false);
    for task in [
        RulerTask::NiahSingle1,
        RulerTask::NiahSingle2,
        RulerTask::NiahMultikey2,
    ] {
        for i in 0..5 {
            let s = g.sample(task, i, 5).unwrap();
            let t = text(&tok, &s);
            let depth = s.depth.unwrap();
            assert_eq!(depth, i as f64 * 25.0);
            let needle = format!(
                "One of the special magic numbers for {} is: {}.",
                t.split(" for ")
                    .last()
                    .unwrap()
                    .split(" mentioned")
                    .next()
                    .unwrap(),
                s.answers[0]
            );
            let at = t
                .find(&needle)
                .unwrap_or_else(|| panic!("{needle:?} in {t}"));
            let start = t.find("afterwards.\n").unwrap() + 12;
            let end = t.rfind("\nWhat is the special magic").unwrap();
            let frac = 100.0 * (at - start) as f64 / (end - start) as f64;
            assert!(
                (frac - depth).abs() < 4.0,
                "{}: at {frac}, asked {depth}",
                task.name()
            );
            assert!(t.contains("A special magic number is hidden within the following text."));
            assert!(s
                .answer_prefix
                .ends_with("mentioned in the provided text is"));
            if task == RulerTask::NiahSingle2 {
                // Essay needles go in at sentence boundaries.
                let before = t[..at].trim_end();
                assert!(
                    before.ends_with(['.', '?', '"', '\n']),
                    "{:?}",
                    &before[before.len() - 30..]
                );
            }
        }
    }
}

#[test]
fn niah_variants_hide_and_ask_what_they_should() {
    let tok = Tokenizer::byte_level(300).unwrap();
    let e = essay();
    let g = RulerGen::new(&tok, Some(&e), 6000, 11, false);
    let count = |t: &str| t.matches("One of the special magic").count();
    // multikey_1: 4 keys, one asked.
    let s = g.sample(RulerTask::NiahMultikey1, 0, 1).unwrap();
    assert_eq!((count(&text(&tok, &s)), s.answers.len()), (4, 1));
    // multivalue: 4 values of one key, all asked; plural wording.
    let s = g.sample(RulerTask::NiahMultivalue, 0, 1).unwrap();
    assert_eq!((count(&text(&tok, &s)), s.answers.len()), (4, 4));
    assert!(s
        .answer_prefix
        .starts_with(" The special magic numbers for "));
    assert!(s.answer_prefix.ends_with(" are"));
    // multiquery: 4 keys, all asked, joined "a, b, c, and d".
    let s = g.sample(RulerTask::NiahMultiquery, 0, 1).unwrap();
    assert_eq!(s.answers.len(), 4);
    assert_eq!(s.answer_prefix.matches(", ").count(), 3);
    assert!(s.answer_prefix.contains(", and "));
    // single_3 and multikey_3: UUID values (and keys).
    for task in [RulerTask::NiahSingle3, RulerTask::NiahMultikey3] {
        let s = g.sample(task, 0, 1).unwrap();
        assert_eq!(s.answers[0].len(), 36, "{}", s.answers[0]);
        assert!(s.answer_prefix.contains("special magic uuid for "));
    }
    let s = g.sample(RulerTask::NiahMultikey3, 0, 1).unwrap();
    let key = s
        .answer_prefix
        .split(" for ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert_eq!(key.len(), 36, "{key}");
    // multikey_2: many distractor needles, only the real one carries the key.
    let s = g.sample(RulerTask::NiahMultikey2, 0, 1).unwrap();
    let t = text(&tok, &s);
    assert!(count(&t) > 20);
    let key = s
        .answer_prefix
        .split(" for ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert_eq!(t.matches(&format!("for {key} is:")).count(), 1);
}

#[test]
fn synthetic_tasks_hold_their_answers() {
    let tok = Tokenizer::byte_level(300).unwrap();
    for context in [3000, 12000] {
        let g = RulerGen::new(&tok, None, context, 2, false);
        // Variable tracking: the chain in order, after one worked example.
        let s = g.sample(RulerTask::Vt, 0, 1).unwrap();
        let t = text(&tok, &s);
        let real = &t[t.rfind("Memorize and track").unwrap()..];
        let value = s.answer_prefix.split("the value ").nth(1).unwrap();
        let value = value.split(',').next().unwrap();
        let mut at = real
            .find(&format!("VAR {} = {value}.", s.answers[0]))
            .unwrap();
        for w in s.answers.windows(2) {
            let next = real.find(&format!("VAR {} = VAR {}.", w[1], w[0])).unwrap();
            assert!(next > at);
            at = next;
        }
        assert_eq!(
            t.matches("Memorize and track").count(),
            2,
            "one worked example"
        );
        assert!(s
            .answer_prefix
            .contains("5 variables are assgined the value"));
        // Common words: each answer repeated often in the real list, the others rarely.
        let s = g.sample(RulerTask::Cwe, 0, 1).unwrap();
        let t = text(&tok, &s);
        let list = &t[t.rfind("Below is a numbered list").unwrap()..];
        let words: Vec<&str> = list
            .split_whitespace()
            .filter(|w| w.chars().all(|c| c.is_ascii_lowercase()))
            .collect();
        let (common, rare) = if context < 4096 { (6, 1) } else { (30, 3) };
        for a in &s.answers {
            assert_eq!(words.iter().filter(|w| *w == a).count(), common, "{a}");
        }
        let rares = words.iter().filter(|w| !s.answers.iter().any(|a| a == *w));
        let mut seen = std::collections::HashMap::new();
        for w in rares {
            *seen.entry(*w).or_insert(0) += 1;
        }
        // (List words only; the template's own words appear once or twice.)
        assert!(seen.values().filter(|&&c| c == rare).count() > 20);
        // Frequent words: ranks 2..4 in order, above every other coded word.
        let s = g.sample(RulerTask::Fwe, 0, 1).unwrap();
        let t = text(&tok, &s);
        let mut counts = std::collections::HashMap::new();
        for w in t.split_whitespace().filter(|w| w.len() == 6) {
            *counts.entry(w).or_insert(0usize) += 1;
        }
        let c: Vec<usize> = s.answers.iter().map(|a| counts[a.as_str()]).collect();
        assert!(c[0] > c[1] && c[1] > c[2], "{c:?}");
        let others = counts
            .iter()
            .filter(|(w, _)| !s.answers.iter().any(|a| a == *w))
            .map(|(_, &n)| n)
            .max()
            .unwrap_or(0);
        assert!(c[2] > others, "{c:?} vs {others}");
        assert!(t.contains("... "), "the top word is dots");
    }
}

#[test]
fn missing_essay_and_short_context_are_named() {
    let tok = Tokenizer::byte_level(300).unwrap();
    let g = RulerGen::new(&tok, None, 3000, 0, false);
    let e = g
        .sample(RulerTask::NiahSingle2, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--input") && e.contains("niah_single_2"), "{e}");
    assert!(
        g.sample(RulerTask::NiahSingle1, 0, 1).is_ok(),
        "no essay needed"
    );
    let g = RulerGen::new(&tok, None, 300, 0, false);
    let e = g
        .sample(RulerTask::NiahSingle1, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--context 300") && e.contains("niah_single_1"),
        "{e}"
    );
    let o = RulerOptions {
        context: 4096,
        kv: KvDtype::F32,
        chunk: 64,
        tasks: vec![RulerTask::Vt],
        samples: 0,
        seed: 0,
        chat: false,
    };
    assert!(o
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--ruler-samples"));
}

#[test]
fn chat_wraps_the_prompt_in_a_user_turn() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/gemma3");
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let g = RulerGen::new(&tok, None, 2048, 0, true);
    let s = g.sample(RulerTask::NiahSingle1, 0, 1).unwrap();
    let t = tok.decode_with(&s.tokens, true);
    // The fixture's template is ChatML: the body sits where a user message goes and the
    // answer prefix follows the generation prompt.
    let turn = tok
        .apply_chat_template(
            &[slowfast_tokenizer::ChatMessage::new("user", "BODY")],
            true,
        )
        .unwrap();
    let (pre, post) = turn.split_once("BODY").unwrap();
    assert!(post.contains("assistant"), "{turn}");
    assert!(t.contains(&format!("{pre}A special magic number")), "{t}");
    assert!(
        t.contains(&format!("{post}The special magic number for ")),
        "{t}"
    );
    assert!(t.ends_with("mentioned in the provided text is"));
    assert!(s.tokens.len() + 128 <= 2048);
    let plain = RulerGen::new(&tok, None, 2048, 0, false)
        .sample(RulerTask::NiahSingle1, 0, 1)
        .unwrap();
    assert!(!tok
        .decode_with(&plain.tokens, true)
        .contains("<start_of_turn>"));
}
