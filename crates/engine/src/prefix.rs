//! Prefix caching for CPU sessions: a prompt whose leading prefill chunks another request
//! already computed starts from copies of their KV instead of recomputing them.
//!
//! Exactness: a chunk's KV depends on its tokens, the KV before it and how the chunk was cut
//! (the attention's tiling follows the chunk's rows). So only whole prefill chunks
//! (`[j * chunk, (j + 1) * chunk)`, never a prompt's last part) are cached and restored, under a
//! namespace of the store's shape, its window rings and the chunk size. A prompt served from
//! the cache then continues bit-for-bit as it would have without it: tested on every policy
//! that shares ([`slowfast_kv::KvPolicy::shares_prefix`]).
use std::hash::{Hash, Hasher};

use half::f16;
use slowfast_kv::paged::{PrefixKv, PrefixStats};
use slowfast_kv::{CacheElem, KvStore};

use crate::session::{Cache, KvDtype, Session};
use crate::EngineError;

/// The CPU's prefix cache, in the KV element type of the sessions it serves.
pub enum PrefixCacheCpu {
    F32(PrefixKv<f32>),
    F16(PrefixKv<f16>),
    E4m3(PrefixKv<slowfast_kv::E4m3>),
}

/// Tokens a KV block (of a CPU server's sequences and of its prefix cache) holds by default
/// with prefill chunks of `chunk` tokens: their greatest common divisor
/// ([`slowfast_kv::KV_BLOCK`], 128, when it divides the chunk).
pub fn default_block(chunk: usize) -> usize {
    let (mut a, mut b) = (slowfast_kv::KV_BLOCK, chunk.max(1));
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl PrefixCacheCpu {
    /// A cache of at most `bytes` for sessions of `model` with KV in `kv` and prefill chunks
    /// of `chunk` tokens, in blocks of `block` tokens (which must divide the chunk).
    pub fn new(
        model: &slowfast_model::Model,
        kv: KvDtype,
        chunk: usize,
        block: usize,
        bytes: usize,
    ) -> Result<Self, EngineError> {
        check_block(block, chunk)?;
        let c = &model.cfg;
        let (l, h, d) = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim);
        Ok(match kv {
            KvDtype::F32 => Self::F32(PrefixKv::new(l, h, d, block, bytes)),
            KvDtype::F16 => Self::F16(PrefixKv::new(l, h, d, block, bytes)),
            KvDtype::Fp8 => Self::E4m3(PrefixKv::new(l, h, d, block, bytes)),
        })
    }

    pub fn stats(&self) -> PrefixStats {
        match self {
            Self::F32(p) => p.stats(),
            Self::F16(p) => p.stats(),
            Self::E4m3(p) => p.stats(),
        }
    }

    /// Bytes the cached blocks take now.
    pub fn nbytes(&self) -> usize {
        match self {
            Self::F32(p) => p.nbytes(),
            Self::F16(p) => p.nbytes(),
            Self::E4m3(p) => p.nbytes(),
        }
    }

    /// Restores into the fresh `sess` the longest run of `plan`'s leading whole chunks that
    /// the cache holds for `prompt`; returns how many parts of `plan` that skips (0: none,
    /// or the session's policy cannot share a prefix).
    pub fn reuse(&mut self, sess: &mut Session, prompt: &[u32], plan: &[(usize, usize)]) -> usize {
        if !sess.shares_prefix() || sess.pos() != 0 {
            return 0;
        }
        let chunk = sess.chunk;
        let whole = whole_chunks(plan, chunk);
        if whole == 0 {
            return 0;
        }
        let r = match (self, &mut sess.cache) {
            (Self::F32(p), Cache::F32(c, _)) => restore(p, c, chunk, prompt, &plan[..whole]),
            (Self::F16(p), Cache::F16(c, _)) => restore(p, c, chunk, prompt, &plan[..whole]),
            (Self::E4m3(p), Cache::E4m3(c, _)) => restore(p, c, chunk, prompt, &plan[..whole]),
            _ => Ok(0),
        };
        r.unwrap_or_else(|e| {
            // The store is left empty: the prompt is prefilled from its start.
            eprintln!("prefix cache: restore failed ({e}); prefilling the whole prompt");
            0
        })
    }

    /// After part `i` of `plan` ran in `sess`: caches it if it is a whole chunk (not the last
    /// part). A failure only means the part is not cached.
    pub fn remember(&mut self, sess: &Session, prompt: &[u32], plan: &[(usize, usize)], i: usize) {
        if !sess.shares_prefix() || i + 1 >= plan.len() || whole_chunks(plan, sess.chunk) <= i {
            return;
        }
        let (a, b) = plan[i];
        let chunk = sess.chunk;
        let r = match (self, &sess.cache) {
            (Self::F32(p), Cache::F32(c, _)) => p.remember(ns(c, chunk), prompt, a, b, c),
            (Self::F16(p), Cache::F16(c, _)) => p.remember(ns(c, chunk), prompt, a, b, c),
            (Self::E4m3(p), Cache::E4m3(c, _)) => p.remember(ns(c, chunk), prompt, a, b, c),
            _ => Ok(0),
        };
        if let Err(e) = r {
            eprintln!("prefix cache: positions {a}..{b} not cached ({e})");
        }
    }
}

/// The cache holds whole prefill chunks: its block must divide the chunk.
pub fn check_block(block: usize, chunk: usize) -> Result<(), EngineError> {
    if block == 0 || !chunk.is_multiple_of(block) {
        return Err(EngineError::BadInput(format!(
            "the KV block of {block} tokens must divide the prefill chunk of \
             {chunk} tokens (--kv-block, --chunk)"
        )));
    }
    Ok(())
}

/// Leading parts of `plan` that are whole chunks, the last part excluded: what a prefix
/// cache may hold and restore (the CPU's and the GPU scheduler's).
pub(crate) fn whole_chunks(plan: &[(usize, usize)], chunk: usize) -> usize {
    plan[..plan.len().saturating_sub(1)]
        .iter()
        .take_while(|&&(a, b)| a.is_multiple_of(chunk) && b - a == chunk)
        .count()
}

fn ns<T: CacheElem>(store: &KvStore<T>, chunk: usize) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    (PrefixKv::namespace(store), chunk).hash(&mut h);
    h.finish()
}

fn restore<T: CacheElem>(
    p: &mut PrefixKv<T>,
    store: &mut KvStore<T>,
    chunk: usize,
    prompt: &[u32],
    whole: &[(usize, usize)],
) -> Result<usize, slowfast_kv::KvError> {
    let found = p.lookup(ns(store, chunk), prompt, whole[whole.len() - 1].1);
    let covered = found.blocks.len() * p.block_size();
    let k = whole.iter().take_while(|&&(_, b)| b <= covered).count();
    if k == 0 {
        p.release(found);
        return Ok(0);
    }
    p.restore(found, whole[k - 1].1, store)
        .inspect_err(|_| store.clear())?;
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{policy_spec_with, SfiKnobs};
    use crate::PolicySpec;

    fn fixture(name: &str) -> crate::Loaded {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/hf")
            .join(name);
        crate::load(dir.to_str().unwrap(), &mut |_| {}).unwrap()
    }

    /// Prefills `prompt` in `sess` part by part, remembering each part in `pc` if given and
    /// restoring from it first; returns the parts restored.
    fn prefill(sess: &mut Session, prompt: &[u32], pc: Option<&mut PrefixCacheCpu>) -> usize {
        let plan = sess.prefill_plan(prompt.len());
        let (mut pc, mut k) = (pc, 0);
        if let Some(p) = pc.as_deref_mut() {
            k = p.reuse(sess, prompt, &plan);
        }
        for i in k..plan.len() {
            sess.prefill_part(prompt, &plan, i).unwrap();
            if let Some(p) = pc.as_deref_mut() {
                p.remember(sess, prompt, &plan, i);
            }
        }
        k
    }

    /// Last prompt logits and those of 12 greedy steps, as bits.
    fn run(sess: &mut Session) -> Vec<u32> {
        let mut out: Vec<u32> = sess.logits().iter().map(|x| x.to_bits()).collect();
        for _ in 0..12 {
            let t = crate::sampler::argmax(sess.logits()).unwrap();
            out.extend(sess.step(t).unwrap().iter().map(|x| x.to_bits()));
        }
        out
    }

    #[test]
    fn a_prompt_served_from_the_cache_continues_bit_for_bit() {
        // Gemma 3's fixture has window rings (window 8), Qwen3's only global layers.
        for model in ["gemma3", "qwen3"] {
            let m = fixture(model);
            let vocab = m.model.cfg.vocab_size as u32;
            let tok = |n: usize, salt: u32| -> Vec<u32> {
                (0..n as u32)
                    .map(|i| (i * 31 + 7 + salt * 53) % (vocab - 8) + 6)
                    .collect()
            };
            let shared = tok(40, 1);
            let [a, b]: [Vec<u32>; 2] = [2, 3].map(|s| [shared.clone(), tok(27, s)].concat());
            let knobs = SfiKnobs {
                recent: 8,
                min_gap: 2,
                refresh_interval: 6,
                ..Default::default()
            };
            for p in ["full", "sfi", "streaming"] {
                let spec = |n: usize| -> PolicySpec {
                    let budget = (p != "full").then_some(20.0);
                    policy_spec_with(p, budget, 2, n, &knobs)
                        .unwrap()
                        .with_vocab(&m.tokenizer)
                };
                let sess = |n: usize| {
                    Session::try_with_policy(&m.model, n, KvDtype::F16, 16, &spec(n)).unwrap()
                };
                let mut pc = PrefixCacheCpu::new(&m.model, KvDtype::F16, 16, 8, 1 << 22).unwrap();
                let mut first = sess(a.len() + 16);
                assert_eq!(prefill(&mut first, &a, Some(&mut pc)), 0);
                // Another capacity: the global layers' size does not enter the namespace.
                let mut cached = sess(b.len() + 13);
                assert_eq!(prefill(&mut cached, &b, Some(&mut pc)), 2, "{model} {p}");
                assert_eq!(cached.pos(), b.len());
                let mut plain = sess(b.len() + 13);
                prefill(&mut plain, &b, None);
                assert!(
                    run(&mut cached) == run(&mut plain),
                    "{model} {p}: outputs differ"
                );
            }
        }
    }

    #[test]
    fn policies_that_cannot_share_are_never_restored() {
        let m = fixture("qwen3");
        let prompt: Vec<u32> = (0..60).map(|i| i % 300 + 6).collect();
        let mut pc = PrefixCacheCpu::new(&m.model, KvDtype::F32, 16, 16, 1 << 22).unwrap();
        let mut s = Session::new(&m.model, 80, KvDtype::F32, 16);
        prefill(&mut s, &prompt, Some(&mut pc));
        let h2o = crate::session::policy_spec("h2o", Some(20.0), 2, 80).unwrap();
        let mut s = Session::try_with_policy(&m.model, 80, KvDtype::F32, 16, &h2o).unwrap();
        assert!(!s.shares_prefix());
        assert_eq!(prefill(&mut s, &prompt, Some(&mut pc)), 0);
        // Another KV type is another cache: an f16 session finds nothing in an f32 one.
        let mut s = Session::new(&m.model, 80, KvDtype::F16, 16);
        assert_eq!(prefill(&mut s, &prompt, Some(&mut pc)), 0);
        assert_eq!(pc.stats().hit_blocks, 0);
    }
}
