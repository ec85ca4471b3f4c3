//! The n-gram (prompt-lookup) drafter, as llama.cpp's `lookup` and vLLM's `ngram`: match the
//! history's last n tokens against its earlier text and propose what followed. No model.
//!
//! The index: for each n in min_n..=max_n, a map from the hash of an n-gram to the last end
//! position (exclusive) at which it occurred, counting only ends before the history's length
//! (so a match is always an *earlier* occurrence), plus, per end position, the previous end of
//! an n-gram of the same hash. The chain makes `truncate` exact (each removed end restores the
//! map entry it replaced) and makes hash collisions harmless: a candidate is compared token by
//! token, and on a mismatch the chain leads to the next older one.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// No position.
const NONE: u32 = u32::MAX;

/// Invalid drafter settings (from `NgramDrafter::try_new`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NgramError {
    #[error("the n-gram drafter's min_n must be at least 1, got 0")]
    MinZero,
    #[error("the n-gram drafter's min_n ({min_n}) must not exceed its max_n ({max_n})")]
    MinAboveMax { min_n: usize, max_n: usize },
}

/// The keys are already well-mixed 64-bit hashes: use them as they are.
#[derive(Debug, Clone, Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = fmix64(self.0 ^ b as u64);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

type Index = HashMap<u64, u32, BuildHasherDefault<IdHasher>>;

/// MurmurHash3's 64-bit finaliser (a bijection).
fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

/// Extend the hash of an n-gram one token to the left (n-grams are hashed from their last
/// token backwards, so the hashes of lengths 1..=max_n ending at one place come in one pass).
fn step(h: u64, t: u32) -> u64 {
    fmix64((h ^ (t as u64 + 1)).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// `(min_n, max_n)` made valid: min_n raised to 1, then max_n raised to min_n.
fn clamp(max_n: usize, min_n: usize) -> (usize, usize) {
    let min_n = min_n.max(1);
    (min_n, max_n.max(min_n))
}

/// Prompt lookup: proposes the tokens that followed the most recent earlier occurrence of the
/// history's last n tokens (n from max_n down to min_n, the longest match wins; the most recent
/// occurrence among those of that length). No model.
///
/// Costs: `extend` O(max_n) per token (amortised: hash-map inserts), `propose` O(max_n + gamma)
/// (expected; a hash collision costs one more comparison), `truncate` O(max_n) per dropped token.
/// Memory: 4 bytes per token per n in min_n..=max_n, plus the maps. Histories up to
/// `u32::MAX - 1` tokens.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    max_n: usize,
    min_n: usize,
    history: Vec<u32>,
    /// Per n (index n - min_n): n-gram hash → the last end e < len at which it occurred
    /// (the n-gram is history[e - n..e]).
    last: Vec<Index>,
    /// `prev[e * levels + (n - min_n)]`: the end the map held for the hash of the n-gram ending
    /// at e before e was indexed (`NONE` when it held none, or when e < n).
    prev: Vec<u32>,
    /// Tests only: hash every n-gram to one key, so every lookup walks the collision chain.
    #[cfg(test)]
    collide: bool,
}

impl NgramDrafter {
    /// A drafter matching n-grams of max_n down to min_n tokens (the lead's defaults: 3 and 1).
    /// Never fails: invalid settings are clamped, min_n to at least 1 and then max_n to at
    /// least min_n. Use `try_new` to refuse them instead.
    pub fn new(max_n: usize, min_n: usize) -> Self {
        let (min_n, max_n) = clamp(max_n, min_n);
        NgramDrafter {
            max_n,
            min_n,
            history: Vec::new(),
            last: (min_n..=max_n).map(|_| Index::default()).collect(),
            prev: Vec::new(),
            #[cfg(test)]
            collide: false,
        }
    }

    /// `step`, or a constant in tests that force collisions.
    fn hash_step(&self, h: u64, t: u32) -> u64 {
        #[cfg(test)]
        if self.collide {
            return 0;
        }
        step(h, t)
    }

    /// `new`, but an error for min_n = 0 or min_n > max_n (for user-given settings).
    pub fn try_new(max_n: usize, min_n: usize) -> Result<Self, NgramError> {
        if min_n == 0 {
            return Err(NgramError::MinZero);
        }
        if min_n > max_n {
            return Err(NgramError::MinAboveMax { min_n, max_n });
        }
        Ok(Self::new(max_n, min_n))
    }

    /// The longest n-gram matched.
    pub fn max_n(&self) -> usize {
        self.max_n
    }

    /// The shortest n-gram matched.
    pub fn min_n(&self) -> usize {
        self.min_n
    }

    fn levels(&self) -> usize {
        self.max_n - self.min_n + 1
    }

    /// Append tokens to the history (prompt, then every committed token).
    pub fn extend(&mut self, tokens: &[u32]) {
        self.history.reserve(tokens.len());
        self.prev.reserve(tokens.len() * self.levels());
        for &t in tokens {
            // The n-grams ending where `t` goes become earlier occurrences once it is pushed.
            self.index_end(self.history.len());
            self.history.push(t);
        }
    }

    /// Drop the history back to `len` tokens (nothing when it is no longer than that).
    pub fn truncate(&mut self, len: usize) {
        for e in (len..self.history.len()).rev() {
            self.unindex_end(e);
        }
        self.history.truncate(len);
        self.prev.truncate(len * self.levels());
    }

    pub fn len(&self) -> usize {
        self.history.len()
    }

    pub fn is_empty(&self) -> bool {
        self.history.is_empty()
    }

    /// The history (prompt and committed tokens).
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Up to `gamma` proposed tokens (empty when nothing matches).
    pub fn propose(&self, gamma: usize, out: &mut Vec<u32>) {
        out.clear();
        let len = self.history.len();
        // A match ends at some e with n <= e <= len - 1.
        let top = self.max_n.min(len.saturating_sub(1));
        if gamma == 0 || top < self.min_n {
            return;
        }
        let suffix = |n: usize| &self.history[len - n..];
        let mut hashes = Vec::with_capacity(top);
        let mut h = 0;
        for n in 1..=top {
            h = self.hash_step(h, self.history[len - n]);
            hashes.push(h);
        }
        let levels = self.levels();
        for n in (self.min_n..=top).rev() {
            let li = n - self.min_n;
            let Some(&first) = self.last[li].get(&hashes[n - 1]) else {
                continue;
            };
            let mut e = first;
            while e != NONE {
                let end = e as usize;
                if &self.history[end - n..end] == suffix(n) {
                    out.extend_from_slice(&self.history[end..len.min(end + gamma)]);
                    return;
                }
                e = self.prev[end * levels + li]; // a hash collision: the next older one
            }
        }
    }

    /// Index the n-grams ending at `e` (= the history's length, about to grow past it).
    fn index_end(&mut self, e: usize) {
        let pos = u32::try_from(e)
            .ok()
            .filter(|&p| p != NONE)
            .expect("the n-gram drafter holds at most u32::MAX - 1 tokens");
        let mut h = 0;
        for n in 1..=self.max_n {
            if n > e {
                // No n-gram of this length (or longer) ends at e.
                for _ in n.max(self.min_n)..=self.max_n {
                    self.prev.push(NONE);
                }
                return;
            }
            h = self.hash_step(h, self.history[e - n]);
            if n >= self.min_n {
                let old = self.last[n - self.min_n].insert(h, pos);
                self.prev.push(old.unwrap_or(NONE));
            }
        }
    }

    /// Undo `index_end(e)`; `e` must be the last end indexed.
    fn unindex_end(&mut self, e: usize) {
        let levels = self.levels();
        let mut h = 0;
        for n in 1..=self.max_n.min(e) {
            h = self.hash_step(h, self.history[e - n]);
            if n >= self.min_n {
                let li = n - self.min_n;
                let old = self.prev[e * levels + li];
                let map = &mut self.last[li];
                debug_assert_eq!(map.get(&h), Some(&(e as u32)));
                if old == NONE {
                    map.remove(&h);
                } else {
                    map.insert(h, old);
                }
            }
        }
        self.prev.truncate(e * levels);
    }
}

/// The plain reference: a backwards scan over the history. `max_n` and `min_n` are clamped as
/// `NgramDrafter::new` does.
pub fn propose_reference(history: &[u32], gamma: usize, max_n: usize, min_n: usize) -> Vec<u32> {
    let (min_n, max_n) = clamp(max_n, min_n);
    let len = history.len();
    if gamma == 0 {
        return vec![];
    }
    for n in (min_n..=max_n).rev() {
        if len < n + 1 {
            continue;
        }
        let suffix = &history[len - n..];
        for e in (n..len).rev() {
            if &history[e - n..e] == suffix {
                return history[e..len.min(e + gamma)].to_vec();
            }
        }
    }
    vec![]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Rng;

    fn drafter_of(history: &[u32], max_n: usize, min_n: usize) -> NgramDrafter {
        let mut d = NgramDrafter::new(max_n, min_n);
        d.extend(history);
        d
    }

    fn proposal(d: &NgramDrafter, gamma: usize) -> Vec<u32> {
        let mut out = vec![7777]; // cleared by propose
        d.propose(gamma, &mut out);
        out
    }

    #[test]
    fn examples() {
        // The longest match wins: [1, 2] occurred at 0..2 (followed by 7); [2] alone more
        // recently at 4..5 (followed by 8).
        let h = [1, 2, 7, 3, 2, 8, 1, 2];
        let d = drafter_of(&h, 3, 1);
        assert_eq!(proposal(&d, 10), vec![7, 3, 2, 8, 1, 2]);
        assert_eq!(proposal(&d, 2), vec![7, 3]);
        assert_eq!(proposal(&d, 0), Vec::<u32>::new());
        // With n = 1 only: the most recent earlier 2.
        assert_eq!(proposal(&drafter_of(&h, 1, 1), 3), vec![8, 1, 2]);
        // The continuation may run into the current suffix itself.
        assert_eq!(proposal(&drafter_of(&[5, 5, 5], 3, 1), 4), vec![5]);
        assert_eq!(proposal(&drafter_of(&[4, 5, 4, 5], 3, 1), 4), vec![4, 5]);
        // The last token itself is never a match: nothing earlier matches.
        assert!(proposal(&drafter_of(&[1, 2, 3], 3, 1), 4).is_empty());
        assert!(proposal(&drafter_of(&[9], 3, 1), 4).is_empty());
        assert!(proposal(&drafter_of(&[], 3, 1), 4).is_empty());
        // min_n 2: a single repeated token is not enough.
        assert!(proposal(&drafter_of(&[1, 2, 3, 2], 3, 2), 4).is_empty());
        assert_eq!(proposal(&drafter_of(&[1, 2, 3, 2], 3, 1), 4), vec![3, 2]);
    }

    #[test]
    fn settings_are_validated_or_clamped() {
        assert_eq!(
            NgramDrafter::try_new(3, 0).unwrap_err(),
            NgramError::MinZero
        );
        let e = NgramDrafter::try_new(1, 2).unwrap_err();
        assert_eq!(e, NgramError::MinAboveMax { min_n: 2, max_n: 1 });
        assert!(e.to_string().contains("min_n (2)"), "{e}");
        let d = NgramDrafter::try_new(3, 1).unwrap();
        assert_eq!((d.max_n(), d.min_n()), (3, 1));
        for ((max_n, min_n), want) in [((0, 0), (1, 1)), ((3, 0), (3, 1)), ((1, 2), (2, 2))] {
            let d = NgramDrafter::new(max_n, min_n);
            assert_eq!((d.max_n(), d.min_n()), want);
            // The reference clamps the same way.
            let h = [1, 2, 1, 2, 3, 1, 2];
            let d = drafter_of(&h, max_n, min_n);
            assert_eq!(proposal(&d, 5), propose_reference(&h, 5, max_n, min_n));
        }
    }

    /// The index after `truncate` is the index of a fresh drafter over the same history.
    fn assert_same_index(a: &NgramDrafter, b: &NgramDrafter) {
        assert_eq!(a.history, b.history);
        assert_eq!(a.prev, b.prev);
        assert_eq!(a.last, b.last);
    }

    /// The fast drafter against the reference on fresh random histories over small vocabularies
    /// (so matches are frequent), random settings and gamma, extended in random chunks and
    /// truncated at random; after each truncate the index must equal a fresh one's. `collide`
    /// hashes every n-gram to one key, so each lookup walks the chain past non-matching ends.
    fn random_vs_reference(seed: u64, trials: usize, collide: bool) {
        let mut rng = Rng::new(seed);
        let mut below = |n: usize| (rng.next_u64() % n as u64) as usize;
        let build = |history: &[u32], max_n, min_n| {
            let mut d = NgramDrafter::new(max_n, min_n);
            d.collide = collide;
            d.extend(history);
            d
        };
        let (mut proposals, mut nonempty) = (0, 0);
        for trial in 0..trials {
            let vocab = [1, 2, 3, 4, 8, 50][trial % 6] as usize;
            let max_n = 1 + below(5);
            let min_n = 1 + below(max_n);
            let mut d = build(&[], max_n, min_n);
            for _ in 0..40 {
                if below(10) < 2 {
                    // Truncate, sometimes past the end (a no-op) or to 0.
                    d.truncate(below(d.len() + 3));
                    assert_same_index(&d, &build(&d.history, max_n, min_n));
                } else {
                    let chunk: Vec<u32> = (0..below(12)).map(|_| below(vocab) as u32).collect();
                    d.extend(&chunk);
                }
                let gamma = below(9);
                let got = proposal(&d, gamma);
                let want = propose_reference(&d.history, gamma, max_n, min_n);
                assert_eq!(
                    got, want,
                    "trial {trial} max_n {max_n} min_n {min_n} gamma {gamma} history {:?}",
                    d.history
                );
                proposals += 1;
                nonempty += !got.is_empty() as usize;
            }
        }
        // The test exercises matches, not just empty proposals.
        assert!(nonempty * 2 > proposals, "{nonempty} of {proposals}");
    }

    #[test]
    fn matches_reference_on_random_histories() {
        random_vs_reference(0x6E67, 600, false);
    }

    #[test]
    fn hash_collisions_are_harmless() {
        random_vs_reference(0xC011, 200, true);
    }

    /// One true match of the longest n in a long history of distinct n-grams.
    #[test]
    fn long_history_single_match() {
        let mut rng = Rng::new(5);
        let mut h: Vec<u32> = (0..20_000)
            .map(|_| (rng.next_u64() % 1000) as u32)
            .collect();
        h[100..103].copy_from_slice(&[5000, 5001, 5002]);
        h.extend_from_slice(&[5000, 5001, 5002]);
        let d = drafter_of(&h, 3, 1);
        assert_eq!(proposal(&d, 4), h[103..107].to_vec());
        assert_eq!(proposal(&d, 4), propose_reference(&h, 4, 3, 1));
    }

    /// A 128K-token prompt indexes quickly (the bound is loose: it only catches a quadratic
    /// index; a release build takes milliseconds) and proposes like the reference.
    #[test]
    fn indexes_a_128k_prompt() {
        let mut rng = Rng::new(128);
        let mut h: Vec<u32> = Vec::with_capacity(131_072);
        while h.len() < 131_072 {
            // Text-like: random tokens with copied spans, so matches of every length exist.
            if h.len() > 64 && rng.next_u64().is_multiple_of(4) {
                let start = (rng.next_u64() % (h.len() as u64 - 32)) as usize;
                let span = 2 + (rng.next_u64() % 30) as usize;
                for i in 0..span {
                    h.push(h[start + i]);
                }
            } else {
                h.push((rng.next_u64() % 32_000) as u32);
            }
        }
        h.truncate(131_072);
        let t = std::time::Instant::now();
        let mut d = NgramDrafter::new(3, 1);
        d.extend(&h);
        let took = t.elapsed();
        assert!(
            took.as_secs_f64() < 10.0,
            "indexing 128K tokens took {took:?}"
        );
        eprintln!("indexed 131072 tokens in {took:?}");
        for cut in [131_072, 100_000, 65_537] {
            d.truncate(cut);
            for gamma in [1, 4, 8] {
                assert_eq!(
                    proposal(&d, gamma),
                    propose_reference(&h[..cut], gamma, 3, 1)
                );
            }
        }
    }
}
