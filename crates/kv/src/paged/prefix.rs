//! `PrefixCache`: which blocks of a [`BlockPool`] hold the KV of which token prefixes.
//!
//! A full block of `B` prompt tokens is named by a hash chain: `h(i) = hash(h(i-1), tokens of
//! block i)`, starting from a namespace (everything besides the tokens that decides the KV:
//! the model, its KV layout). A prompt's cached prefix is found by walking its chain from the
//! first block; each step checks the stored tokens and parent, so a hash collision can only
//! end a match early, never return another prompt's KV.
//!
//! References: the cache holds one on every block it names; a reader pins the blocks it found
//! (one more each) while it copies or reads them, and unpins them after. A cached block held
//! by nobody else is evictable, least recently used first; among blocks last used together,
//! the deepest first, so a chain shrinks from its end and stays reachable from its start.
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use super::pool::{BlockId, BlockPool, PoolError};

/// The hash of an empty prefix in `namespace`.
pub fn root_hash(namespace: u64) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    ("slowfast-prefix-root", namespace).hash(&mut h);
    h.finish()
}

/// The hash of a prefix whose last full block is `tokens` and the rest hashes to `parent`.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    (parent, tokens).hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone)]
struct Entry {
    hash: u64,
    parent: u64,
    tokens: Vec<u32>,
    /// Blocks before this one in its chain.
    depth: u32,
    /// When it was last found or unpinned.
    tick: u64,
}

/// Counters since the cache was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Full blocks asked for by lookups, and how many were found.
    pub queried_blocks: u64,
    pub hit_blocks: u64,
    pub inserted_blocks: u64,
    pub evicted_blocks: u64,
}

/// A hash-chain index over the blocks of its own [`BlockPool`].
#[derive(Debug, Clone)]
pub struct PrefixCache {
    pool: BlockPool,
    by_hash: HashMap<u64, BlockId>,
    entries: Vec<Option<Entry>>,
    /// Cached blocks nobody but the cache holds: (tick, deeper first, id).
    evictable: BTreeSet<(u64, Reverse<u32>, BlockId)>,
    tick: u64,
    stats: PrefixStats,
}

/// Blocks a lookup found, pinned until [`PrefixCache::unpin`].
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use = "found blocks stay pinned until unpinned"]
pub struct Found {
    pub blocks: Vec<BlockId>,
}

impl PrefixCache {
    /// A cache over `n_blocks` blocks of `block_size` tokens. Every call names a namespace,
    /// which keeps prefixes whose KV differs for reasons besides the tokens apart.
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        PrefixCache {
            pool: BlockPool::new(n_blocks, block_size),
            by_hash: HashMap::new(),
            entries: vec![None; n_blocks],
            evictable: BTreeSet::new(),
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Blocks that name a prefix.
    pub fn n_cached(&self) -> usize {
        self.by_hash.len()
    }

    /// The hash of `tokens[..k * B]` in `namespace`, for k = 0..=full blocks of `tokens`.
    pub fn chain(&self, namespace: u64, tokens: &[u32]) -> Vec<u64> {
        let mut h = root_hash(namespace);
        let mut out = vec![h];
        for b in tokens.chunks_exact(self.block_size()) {
            h = block_hash(h, b);
            out.push(h);
        }
        out
    }

    /// The cached blocks of the longest cached prefix of `tokens` (whole blocks, at most
    /// `max_blocks`), pinned.
    pub fn lookup(&mut self, namespace: u64, tokens: &[u32], max_blocks: usize) -> Found {
        self.tick += 1;
        let bs = self.block_size();
        let mut parent = root_hash(namespace);
        let mut found = Vec::new();
        let asked = (tokens.len() / bs).min(max_blocks);
        for b in tokens.chunks_exact(bs).take(asked) {
            let h = block_hash(parent, b);
            let Some(&id) = self.by_hash.get(&h) else {
                break;
            };
            let e = self.entries[id as usize].as_ref().expect("indexed entry");
            if e.parent != parent || e.tokens != b {
                break; // a collision: stop short rather than read another prefix's KV
            }
            self.pin(id);
            found.push(id);
            parent = h;
        }
        self.stats.queried_blocks += asked as u64;
        self.stats.hit_blocks += found.len() as u64;
        Found { blocks: found }
    }

    /// Releases what [`Self::lookup`] or [`Self::insert`] pinned.
    pub fn unpin(&mut self, found: Found) {
        self.tick += 1;
        for id in found.blocks {
            self.unpin_one(id);
        }
    }

    /// Makes `tokens` (one full block), following the prefix that hashes to `parent` at depth
    /// `depth`, a cached block. Returns it pinned, for the caller to fill with its KV before
    /// unpinning; None when it is cached already or no block is free or evictable.
    pub fn insert(&mut self, parent: u64, depth: u32, tokens: &[u32]) -> Option<BlockId> {
        assert_eq!(tokens.len(), self.block_size(), "a cached block is full");
        let hash = block_hash(parent, tokens);
        if self.by_hash.contains_key(&hash) {
            return None;
        }
        let id = match self.pool.alloc() {
            Some(id) => id,
            None => {
                self.evict_one()?;
                self.pool.alloc()?
            }
        };
        self.tick += 1;
        self.entries[id as usize] = Some(Entry {
            hash,
            parent,
            tokens: tokens.to_vec(),
            depth,
            tick: self.tick,
        });
        self.by_hash.insert(hash, id);
        self.pin(id); // the cache's reference is the allocation; the caller's is this one
        self.stats.inserted_blocks += 1;
        Some(id)
    }

    /// Forgets a block [`Self::insert`] just returned (still pinned by the caller, who must not
    /// unpin it): its KV could not be filled in.
    pub fn discard(&mut self, id: BlockId) {
        let e = self.entries[id as usize].take().expect("an inserted block");
        self.by_hash.remove(&e.hash);
        for _ in 0..2 {
            self.pool
                .release(id)
                .expect("the cache's and the caller's references");
        }
        self.stats.inserted_blocks -= 1;
    }

    /// Evicts the least recently used block nobody else holds (None: there is none).
    pub fn evict_one(&mut self) -> Option<BlockId> {
        let &(tick, depth, id) = self.evictable.iter().next()?;
        self.evictable.remove(&(tick, depth, id));
        let e = self.entries[id as usize].take().expect("evictable entry");
        self.by_hash.remove(&e.hash);
        let left = self.pool.release(id).expect("the cache's reference");
        debug_assert_eq!(left, 0);
        self.stats.evicted_blocks += 1;
        Some(id)
    }

    fn pin(&mut self, id: BlockId) {
        let e = self.entries[id as usize].as_ref().expect("cached block");
        if self.pool.refs(id) == 1 {
            self.evictable.remove(&(e.tick, Reverse(e.depth), id));
        }
        self.pool.retain(id).expect("cached block is allocated");
    }

    fn unpin_one(&mut self, id: BlockId) {
        match self.pool.release(id) {
            Ok(1) => {
                let tick = self.tick;
                let e = self.entries[id as usize].as_mut().expect("cached block");
                e.tick = tick;
                self.evictable.insert((tick, Reverse(e.depth), id));
            }
            Ok(_) => {}
            Err(e @ PoolError::NotAllocated(_)) | Err(e @ PoolError::OutOfRange { .. }) => {
                panic!("unpinning a block the cache does not hold: {e}")
            }
        }
    }

    /// Checks the invariants (tests): every entry indexed once, the cache's reference on every
    /// cached block, exactly the singly-held ones evictable, every other block free.
    pub fn check(&self) -> Result<(), String> {
        let mut n = 0;
        for (id, e) in self.entries.iter().enumerate() {
            let id = id as BlockId;
            let refs = self.pool.refs(id);
            match e {
                None => {
                    if refs != 0 {
                        return Err(format!("block {id} is held ({refs}) but names nothing"));
                    }
                }
                Some(e) => {
                    n += 1;
                    if self.by_hash.get(&e.hash) != Some(&id) {
                        return Err(format!("block {id} is not indexed by its hash"));
                    }
                    let ev = self.evictable.contains(&(e.tick, Reverse(e.depth), id));
                    if refs == 0 || ev != (refs == 1) {
                        return Err(format!("block {id}: {refs} references, evictable {ev}"));
                    }
                }
            }
        }
        if n != self.by_hash.len() || self.evictable.len() > n {
            return Err("the index and the entries disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: u64 = 7;

    fn cache(n: usize) -> PrefixCache {
        PrefixCache::new(n, 4)
    }

    /// Inserts every full block of `tokens` not yet cached; returns the blocks inserted.
    fn insert_all(c: &mut PrefixCache, tokens: &[u32]) -> Vec<BlockId> {
        let chain = c.chain(NS, tokens);
        let mut new = Vec::new();
        for (i, b) in tokens.chunks_exact(c.block_size()).enumerate() {
            if let Some(id) = c.insert(chain[i], i as u32, b) {
                new.push(id);
            }
        }
        c.unpin(Found {
            blocks: new.clone(),
        });
        new
    }

    #[test]
    fn hits_follow_the_chain_and_misses_end_it() {
        let mut c = cache(16);
        let a: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
        assert_eq!(insert_all(&mut c, &a).len(), 2);
        // Same first block, different second: one block found.
        let mut b = a.clone();
        b[5] = 99;
        let f = c.lookup(NS, &b, usize::MAX);
        assert_eq!(f.blocks.len(), 1);
        c.unpin(f);
        // A longer prompt with the same 8 tokens: both found, capped by max_blocks.
        let long: Vec<u32> = (0..20).collect();
        let f = c.lookup(NS, &long, 1);
        assert_eq!(f.blocks.len(), 1);
        c.unpin(f);
        let f = c.lookup(NS, &long, usize::MAX);
        assert_eq!(f.blocks.len(), 2);
        c.unpin(f);
        // A different first block finds nothing, even with the second block equal.
        let mut d = a.clone();
        d[0] = 5;
        let f = c.lookup(NS, &d, usize::MAX);
        assert_eq!(f, Found::default());
        // Another namespace shares nothing.
        assert_ne!(c.chain(NS + 1, &a)[1..], c.chain(NS, &a)[1..]);
        let f = c.lookup(NS + 1, &a, usize::MAX);
        assert_eq!(f, Found::default());
        assert_eq!(
            c.stats(),
            PrefixStats {
                queried_blocks: 2 + 1 + 5 + 2 + 2,
                hit_blocks: 1 + 1 + 2,
                inserted_blocks: 2,
                evicted_blocks: 0
            }
        );
        c.check().unwrap();
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_lru_goes_deepest_first() {
        let mut c = cache(3);
        let a: Vec<u32> = (0..12).collect(); // 3 blocks fill the pool
        assert_eq!(insert_all(&mut c, &a).len(), 3);
        let pinned = c.lookup(NS, &a, 1);
        // Inserting another prompt's block evicts the deepest unpinned block of `a`.
        let b: Vec<u32> = (100..104).collect();
        let id = c.insert(root_hash(NS), 0, &b).unwrap();
        c.unpin(Found { blocks: vec![id] });
        let f = c.lookup(NS, &a, usize::MAX);
        assert_eq!(f.blocks.len(), 2, "the third block of a went first");
        c.unpin(f);
        // With everything pinned, an insert is refused rather than evicting a held block.
        let all_b = c.lookup(NS, &b, usize::MAX);
        let rest = c.lookup(NS, &a, usize::MAX);
        assert_eq!(c.insert(root_hash(NS), 0, &[9, 9, 9, 9]), None);
        c.check().unwrap();
        c.unpin(rest);
        c.unpin(all_b);
        c.unpin(pinned);
        c.check().unwrap();
        assert_eq!(c.pool().n_used(), c.n_cached());
    }

    #[test]
    fn random_lookups_inserts_and_evictions_keep_the_invariants() {
        let mut r = super::super::pool::tests::rng(3);
        for _ in 0..30 {
            let n = 2 + r(12) as usize;
            let mut c = cache(n);
            let mut pins: Vec<Found> = Vec::new();
            for _ in 0..400 {
                // Prompts over a small alphabet so prefixes repeat.
                let len = r(24) as usize;
                let p: Vec<u32> = (0..len).map(|_| r(2) as u32).collect();
                match r(3) {
                    0 => {
                        insert_all(&mut c, &p);
                    }
                    1 => {
                        let f = c.lookup(NS, &p, usize::MAX);
                        // What is found is exactly the prefix's blocks, in order.
                        let chain = c.chain(NS, &p);
                        for (i, &id) in f.blocks.iter().enumerate() {
                            let e = c.entries[id as usize].as_ref().unwrap();
                            assert_eq!(e.hash, chain[i + 1]);
                            assert_eq!(e.tokens, p[i * 4..(i + 1) * 4]);
                        }
                        pins.push(f);
                    }
                    _ => {
                        if !pins.is_empty() {
                            let k = r(pins.len() as u64) as usize;
                            c.unpin(pins.swap_remove(k));
                        }
                    }
                }
                c.check().unwrap();
                assert!(c.pool().n_used() <= n);
            }
            for f in pins.drain(..) {
                c.unpin(f);
            }
            c.check().unwrap();
            while c.evict_one().is_some() {}
            assert_eq!(c.pool().n_free(), n, "every block comes back");
        }
    }
}
