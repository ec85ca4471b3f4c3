//! Token sampling: the sampler chain over one row of logits (repetition penalty, temperature,
//! top-k, top-p, min-p, then a seeded draw; temperature 0 is greedy) and its validated config.
//! All scratch space is allocated at construction, so sampling allocates nothing per call.
use std::cmp::Ordering;

/// Invalid sampler settings or logits; messages name the CLI flag at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("--temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("--top-p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("--min-p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("--repetition-penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("--presence-penalty must be a number in [-2, 2], got {0}")]
    PresencePenalty(f32),
    #[error("--frequency-penalty must be a number in [-2, 2], got {0}")]
    FrequencyPenalty(f32),
    #[error("the sampler needs a vocabulary of at least one token")]
    EmptyVocab,
    #[error("logits row has {got} entries but the vocabulary has {want}")]
    LogitsLen { got: usize, want: usize },
    #[error("every logit is NaN or -inf: nothing to sample")]
    NoCandidates,
}

/// Sampler settings (llama.cpp-style names and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = disabled.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches p; 1 = disabled.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = disabled.
    pub min_p: f32,
    /// Penalise tokens seen in the last `repeat_last_n` tokens; 1 = disabled.
    pub repetition_penalty: f32,
    /// Window of the repetition, presence and frequency penalties; 0 = disabled.
    pub repeat_last_n: usize,
    /// OpenAI's presence penalty: subtracted once from the logit of each token of the window
    /// (llama.cpp's `penalty_present`); 0 = disabled.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a token's logit once per occurrence in the
    /// window (llama.cpp's `penalty_freq`); 0 = disabled.
    pub frequency_penalty: f32,
    /// Seed of the draw; a seed gives the same tokens for the same logits.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0x5EED,
        }
    }
}

impl SamplerConfig {
    /// Plain argmax decoding.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }

    /// A seed from the clock, for requests that give none.
    pub fn clock_seed() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    }

    pub fn validate(&self) -> Result<(), SamplerError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplerError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplerError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplerError::MinP(self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplerError::RepetitionPenalty(self.repetition_penalty));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(SamplerError::PresencePenalty(self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(SamplerError::FrequencyPenalty(self.frequency_penalty));
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, deterministic for a seed.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Order candidates most likely first, lower id first on ties.
fn by_logit_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// The sampler chain with its scratch buffers and token history.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    vocab_size: usize,
    rng: Rng,
    work: Vec<f32>, // [vocab] logits after the penalty (only used with a penalty)
    cand: Vec<(f32, u32)>, // [<= vocab] (scaled logit, id) still in the running
    history: Vec<u32>, // [<= repeat_last_n] ring of recent tokens
    history_next: usize, // ring write position once full
    seen: Vec<u32>, // [<= repeat_last_n] scratch: the recent tokens, sorted
    weights: Vec<f32>, // [<= vocab] scratch: exp(logit - max) per candidate
}

impl Sampler {
    pub fn new(cfg: SamplerConfig, vocab_size: usize) -> Result<Self, SamplerError> {
        cfg.validate()?;
        if vocab_size == 0 {
            return Err(SamplerError::EmptyVocab);
        }
        Ok(Sampler {
            rng: Rng::new(cfg.seed),
            vocab_size,
            work: Vec::with_capacity(vocab_size),
            cand: Vec::with_capacity(vocab_size),
            history: Vec::with_capacity(cfg.repeat_last_n),
            history_next: 0,
            seen: Vec::with_capacity(cfg.repeat_last_n),
            weights: Vec::with_capacity(vocab_size),
            cfg,
        })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Forget the history and restart the random stream from the seed.
    pub fn reset(&mut self) {
        self.rng = Rng::new(self.cfg.seed);
        self.history.clear();
        self.history_next = 0;
    }

    /// Record a token (prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        let n = self.cfg.repeat_last_n;
        if n == 0 {
            return;
        }
        if self.history.len() < n {
            self.history.push(token);
        } else {
            self.history[self.history_next] = token;
            self.history_next = (self.history_next + 1) % n;
        }
    }

    /// Sample a token and record it in the history.
    pub fn sample_and_accept(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        let t = self.sample(logits)?;
        self.accept(t);
        Ok(t)
    }

    /// Sample one token from `logits` (`[vocab]`). Does not record it; see `accept`.
    /// NaN logits count as -inf.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        if let Some(t) = self.filter(logits)? {
            return Ok(t);
        }
        Ok(draw(&self.cand, &mut self.weights, &mut self.rng))
    }

    /// The distribution `sample` draws from for `logits` under this sampler's settings and
    /// current history (penalties, temperature, top-k, top-p, min-p): (probability, token id)
    /// pairs with probability > 0, summing to 1, written into `out` (cleared first). Greedy
    /// (temperature 0): the argmax alone with probability 1 (lowest id on ties, as `sample`).
    /// The pairs are in no particular order. Draws nothing from the random stream.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        out: &mut Vec<(f32, u32)>,
    ) -> Result<(), SamplerError> {
        out.clear();
        if let Some(t) = self.filter(logits)? {
            out.push((1.0, t));
            return Ok(());
        }
        let total = weigh(&self.cand, &mut self.weights);
        if total.is_nan() {
            // A +inf logit (after scaling) makes every weight NaN; `draw` then falls through
            // to the last candidate, always.
            out.push((1.0, self.cand[self.cand.len() - 1].1));
            return Ok(());
        }
        let inv = 1.0 / total;
        out.extend(
            self.cand
                .iter()
                .zip(&self.weights)
                .map(|(c, &w)| ((w as f64 * inv) as f32, c.1))
                .filter(|&(p, _)| p > 0.0),
        );
        Ok(())
    }

    /// The sampler's random stream (speculative acceptance draws from it).
    pub fn rng_mut(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Restart the random stream from `seed` (a drafter's own stream), keeping the history.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = Rng::new(seed);
    }

    /// Take `other`'s token history (the penalties' window), keeping settings and stream.
    pub fn copy_history(&mut self, other: &Sampler) {
        self.history.clear();
        self.history.extend_from_slice(&other.history);
        self.history_next = other.history_next;
    }

    /// The chain up to the draw, shared by `sample` and `distribution`: `Some(argmax)` when
    /// greedy, else `None` with the surviving (scaled logit, id) candidates in `self.cand`.
    fn filter(&mut self, logits: &[f32]) -> Result<Option<u32>, SamplerError> {
        if logits.len() != self.vocab_size {
            return Err(SamplerError::LogitsLen {
                got: logits.len(),
                want: self.vocab_size,
            });
        }
        // Only a penalty needs a modified copy of the row.
        let penalize = (self.cfg.repetition_penalty != 1.0
            || self.cfg.presence_penalty != 0.0
            || self.cfg.frequency_penalty != 0.0)
            && !self.history.is_empty();
        if penalize {
            self.work.clear();
            self.work.extend_from_slice(logits);
            self.apply_repetition_penalty();
        }
        let src: &[f32] = if penalize { &self.work } else { logits };
        if self.cfg.temperature == 0.0 {
            return argmax(src).map(Some).ok_or(SamplerError::NoCandidates);
        }
        collect_top_k(src, self.cfg.top_k, &mut self.cand);
        if self.cand.is_empty() {
            return Err(SamplerError::NoCandidates);
        }
        let inv_t = 1.0 / self.cfg.temperature;
        for c in self.cand.iter_mut() {
            c.0 *= inv_t;
        }
        if self.cfg.top_p < 1.0 {
            keep_top_p(&mut self.cand, self.cfg.top_p);
        }
        if self.cfg.min_p > 0.0 {
            let max = self
                .cand
                .iter()
                .map(|c| c.0)
                .fold(f32::NEG_INFINITY, f32::max);
            let threshold = max + self.cfg.min_p.ln();
            self.cand.retain(|c| c.0 >= threshold);
        }
        Ok(None)
    }

    /// llama.cpp semantics: each distinct token of the last `repeat_last_n` gets its logit
    /// divided by the repetition penalty when positive, multiplied when not; then the
    /// frequency penalty times its count and the presence penalty are subtracted.
    fn apply_repetition_penalty(&mut self) {
        let (p, fp, pp) = (
            self.cfg.repetition_penalty,
            self.cfg.frequency_penalty,
            self.cfg.presence_penalty,
        );
        if self.history.is_empty() {
            return;
        }
        self.seen.clear();
        self.seen.extend_from_slice(&self.history);
        self.seen.sort_unstable();
        for run in self.seen.chunk_by(|a, b| a == b) {
            if let Some(l) = self.work.get_mut(run[0] as usize) {
                if p != 1.0 {
                    *l = if *l <= 0.0 { *l * p } else { *l / p };
                }
                *l -= run.len() as f32 * fp + pp;
            }
        }
    }
}

/// Index of the largest value, lowest index on ties; `None` when all are -inf.
pub fn argmax(xs: &[f32]) -> Option<u32> {
    // Pass 1: the maximum, in 8 independent lanes so the compiler can vectorise it.
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            // NaN compares false, so it is never picked.
            *m = if x > *m { x } else { *m };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &x in lanes.iter().chain(chunks.remainder()) {
        best = if x > best { x } else { best };
    }
    if best == f32::NEG_INFINITY {
        return None;
    }
    // Pass 2: its first (lowest) index.
    xs.iter().position(|&x| x == best).map(|i| i as u32)
}

/// The candidates of `src` (ids with a logit above -inf), or only the `k` best when
/// `0 < k < len`. One pass: candidates above the running k-th best are pushed, and the list
/// is cut back to k whenever it reaches 2k, so the cost stays O(n) with little sorting.
fn collect_top_k(src: &[f32], k: usize, cand: &mut Vec<(f32, u32)>) {
    cand.clear();
    if k == 0 || k >= src.len() {
        cand.extend(
            src.iter()
                .enumerate()
                .filter(|(_, &l)| l > f32::NEG_INFINITY)
                .map(|(i, &l)| (l, i as u32)),
        );
        return;
    }
    // Ids arrive in increasing order, so a later logit equal to the k-th best loses the tie.
    let mut threshold = f32::NEG_INFINITY;
    for (i, &l) in src.iter().enumerate() {
        if l > threshold {
            cand.push((l, i as u32));
            if cand.len() == 2 * k {
                cand.select_nth_unstable_by(k - 1, by_logit_desc);
                cand.truncate(k);
                threshold = cand.iter().map(|c| c.0).fold(f32::INFINITY, f32::min);
            }
        }
    }
    if cand.len() > k {
        cand.select_nth_unstable_by(k - 1, by_logit_desc);
        cand.truncate(k);
    }
}

/// Keep the smallest most-likely set (in `by_logit_desc` order) whose probability mass
/// reaches `p`. Bucket select, no full sort: candidates are bucketed by logit (buckets are
/// ordered like the logits), whole buckets are kept until the mass is nearly reached, and only
/// the boundary bucket is sorted.
fn keep_top_p(cand: &mut Vec<(f32, u32)>, p: f32) {
    const NB: usize = 1024;
    let (mut max, mut min) = (f32::NEG_INFINITY, f32::INFINITY);
    for c in cand.iter() {
        max = max.max(c.0);
        min = min.min(c.0);
    }
    let range = max - min;
    let scale = if range > 0.0 {
        (NB as f32 - 1.0) / range
    } else {
        0.0
    };
    // Bucket 0 holds the largest logits; the index never decreases as the logit falls.
    let bucket = |l: f32| (((max - l) * scale) as usize).min(NB - 1);
    let mut mass = [0.0f64; NB];
    let mut total = 0.0f64;
    for c in cand.iter() {
        let w = ((c.0 - max).exp()) as f64;
        mass[bucket(c.0)] += w;
        total += w;
    }
    let target = p as f64 * total;
    let mut cum = 0.0f64;
    let mut boundary = NB - 1;
    for (b, &m) in mass.iter().enumerate() {
        if cum + m >= target {
            boundary = b;
            break;
        }
        cum += m;
    }
    // Move whole buckets before the boundary to the front, then the boundary bucket.
    let mut front = 0;
    for j in 0..cand.len() {
        if bucket(cand[j].0) < boundary {
            cand.swap(front, j);
            front += 1;
        }
    }
    let mut end = front;
    for j in front..cand.len() {
        if bucket(cand[j].0) == boundary {
            cand.swap(end, j);
            end += 1;
        }
    }
    cand[front..end].sort_unstable_by(by_logit_desc);
    for i in front..end {
        cum += ((cand[i].0 - max).exp()) as f64;
        if cum >= target {
            cand.truncate(i + 1);
            return;
        }
    }
    cand.truncate(end);
}

/// `weights[i] = exp(logit_i - max)` for each candidate; returns their sum (in f64, in order).
/// `draw` and `Sampler::distribution` both read these, so they describe the same distribution.
fn weigh(cand: &[(f32, u32)], weights: &mut Vec<f32>) -> f64 {
    let max = cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
    weights.clear();
    weights.extend(cand.iter().map(|c| (c.0 - max).exp()));
    weights.iter().map(|&w| w as f64).sum()
}

/// Draw one id with probability proportional to exp(logit).
fn draw(cand: &[(f32, u32)], weights: &mut Vec<f32>, rng: &mut Rng) -> u32 {
    let total = weigh(cand, weights);
    let u = rng.next_f64() * total;
    let mut cum = 0.0;
    for (c, &w) in cand.iter().zip(weights.iter()) {
        cum += w as f64;
        if u < cum {
            return c.1;
        }
    }
    cand[cand.len() - 1].1
}

#[cfg(test)]
mod tests;
