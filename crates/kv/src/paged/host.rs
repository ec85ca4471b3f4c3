//! `PrefixKv`: the CPU's prefix cache. A [`PrefixCache`] names the blocks; this keeps their
//! keys and values, one [`KvBlock`] a layer, and hands them to a sequence's [`KvStore`].
//!
//! A global layer whose blocks are the cache's size shares them: caching a block takes one more
//! reference to the store's own block, and a hit puts the cached blocks at the start of the new
//! sequence's block table (`KvStore::adopt_blocks`), so every sequence that starts with a
//! cached prefix reads the same memory, with no copy. Window rings (and a global layer with
//! blocks of another size) copy the rows instead. Either way the KV is bit-exact, so a prompt
//! served from the cache continues exactly as it would have without it, provided the blocks
//! were computed the way this sequence would have computed them: the caller keeps that promise
//! by caching and restoring whole prefill chunks, and the namespace ([`PrefixKv::namespace`])
//! keeps stores whose window rings differ apart.
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::pool::BlockId;
use super::prefix::{Found, PrefixCache, PrefixStats};
use crate::store::{CacheElem, KvBlock, KvError, KvStore};

/// Cached keys and values of prompt prefixes, in blocks of `block_size` tokens.
pub struct PrefixKv<T> {
    cache: PrefixCache,
    n_kv_heads: usize,
    head_dim: usize,
    /// Per layer, per block id: the block's keys and values (None until first used).
    blocks: Vec<Vec<Option<Arc<KvBlock<T>>>>>,
}

impl<T: CacheElem> PrefixKv<T> {
    /// Bytes one cached block takes.
    pub fn block_bytes(n_layers: usize, n_kv_heads: usize, head_dim: usize, block: usize) -> usize {
        2 * n_layers * block * n_kv_heads * head_dim * std::mem::size_of::<T>()
    }

    /// A cache of at most `max_bytes` of KV (whole blocks; nothing is allocated until a block
    /// is first used) for stores of `n_layers` layers.
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        max_bytes: usize,
    ) -> Self {
        let per = Self::block_bytes(n_layers, n_kv_heads, head_dim, block_size).max(1);
        PrefixKv {
            cache: PrefixCache::new(max_bytes / per, block_size),
            n_kv_heads,
            head_dim,
            blocks: vec![Vec::new(); n_layers],
        }
    }

    pub fn block_size(&self) -> usize {
        self.cache.block_size()
    }

    /// Blocks the cache may hold.
    pub fn n_blocks(&self) -> usize {
        self.cache.pool().n_blocks()
    }

    /// Blocks naming a prefix now.
    pub fn n_cached(&self) -> usize {
        self.cache.n_cached()
    }

    pub fn stats(&self) -> PrefixStats {
        self.cache.stats()
    }

    /// Bytes of the cached blocks, a block shared with `n - 1` sequences counted `1/n` (as
    /// [`KvStore::nbytes`] counts it), so the cache's bytes and the sequences' add up to the
    /// memory in use.
    pub fn nbytes(&self) -> usize {
        let pool = self.cache.pool();
        self.blocks
            .iter()
            .flat_map(|l| l.iter().enumerate())
            .filter(|(id, _)| pool.refs(*id as BlockId) > 0)
            .filter_map(|(_, b)| b.as_ref())
            .map(|b| b.nbytes() / Arc::strong_count(b))
            .sum()
    }

    /// What besides the tokens decides a store's KV: its shape and its window rings (a ring's
    /// capacity decides how prefill reads it, so its rounding).
    pub fn namespace(store: &KvStore<T>) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        (
            store.n_layers(),
            store.n_kv_heads,
            store.head_dim,
            size_of::<T>(),
        )
            .hash(&mut h);
        for l in 0..store.n_layers() {
            let s = store.layer(l).spec;
            (s.ring, if s.ring { s.capacity } else { 0 }).hash(&mut h);
        }
        h.finish()
    }

    /// The cached blocks of the longest cached prefix of `tokens` (at most `max_tokens`),
    /// pinned: give them to [`Self::restore`] or [`Self::release`].
    pub fn lookup(&mut self, namespace: u64, tokens: &[u32], max_tokens: usize) -> Found {
        let b = self.block_size();
        self.cache.lookup(namespace, tokens, max_tokens / b)
    }

    /// Unpins blocks found and not restored.
    pub fn release(&mut self, found: Found) {
        self.cache.unpin(found);
    }

    /// Gives the first `n` tokens of `found` (`n` a multiple of the block size, within the
    /// blocks found) to the empty, uncompacted `store` and makes them its length; unpins.
    /// Global layers of the cache's block size share the cached blocks; a window ring gets a
    /// copy of the positions it can hold.
    pub fn restore(
        &mut self,
        found: Found,
        n: usize,
        store: &mut KvStore<T>,
    ) -> Result<(), KvError> {
        let r = self.copy_in(&found.blocks, n, store);
        self.cache.unpin(found);
        r
    }

    /// Whether `store`'s `layer` keeps its blocks at the cache's size (so they are shared).
    fn shares(&self, store: &KvStore<T>, layer: usize) -> bool {
        let l = store.layer(layer);
        !l.spec.ring && !l.is_compact() && store.block_size() == self.block_size()
    }

    fn copy_in(&self, blocks: &[BlockId], n: usize, store: &mut KvStore<T>) -> Result<(), KvError> {
        let b = self.block_size();
        assert!(
            n.is_multiple_of(b) && n / b <= blocks.len(),
            "restoring {n} tokens from {} blocks of {b}",
            blocks.len()
        );
        assert!(store.is_empty() && store.n_layers() == self.blocks.len());
        let cached = |l: usize, id: BlockId| -> &Arc<KvBlock<T>> {
            self.blocks[l][id as usize]
                .as_ref()
                .expect("a cached block holds its KV")
        };
        for l in 0..self.blocks.len() {
            if self.shares(store, l) {
                let shared: Vec<_> = blocks[..n / b]
                    .iter()
                    .map(|&id| cached(l, id).clone())
                    .collect();
                store.adopt_blocks(l, &shared)?;
                continue;
            }
            let spec = store.layer(l).spec;
            let first = if spec.ring {
                n.saturating_sub(spec.capacity)
            } else {
                0
            };
            for (j, &id) in blocks[..n / b].iter().enumerate() {
                if (j + 1) * b <= first {
                    continue; // fully behind the ring's reach
                }
                let (k, v) = cached(l, id).rows(self.n_kv_heads, self.head_dim);
                store.write_elems(l, j * b, &k, &v)?;
            }
        }
        store.set_len(n);
        Ok(())
    }

    /// Caches the whole blocks of `tokens[a..b]` (`a`, `b` multiples of the block size, and
    /// `store` holding those positions in every layer), following the prefix `tokens[..a]`.
    /// Blocks cached already are kept; when no block is free or evictable the rest is
    /// skipped. Returns the blocks added.
    pub fn remember(
        &mut self,
        namespace: u64,
        tokens: &[u32],
        a: usize,
        b: usize,
        store: &KvStore<T>,
    ) -> Result<usize, KvError> {
        let bs = self.block_size();
        assert!(a.is_multiple_of(bs) && b.is_multiple_of(bs) && a <= b && b <= tokens.len());
        let chain = self.cache.chain(namespace, &tokens[..b]);
        let mut added = 0;
        for j in a / bs..b / bs {
            // None: cached already, or every block is pinned.
            let Some(id) = self
                .cache
                .insert(chain[j], j as u32, &tokens[j * bs..(j + 1) * bs])
            else {
                continue;
            };
            if let Err(e) = self.copy_out(id, j, store) {
                self.cache.discard(id);
                return Err(e);
            }
            self.cache.unpin(Found { blocks: vec![id] });
            added += 1;
        }
        Ok(added)
    }

    /// Block `j` of `store` (positions `[j * bs, (j + 1) * bs)`) into cache block `id`.
    fn copy_out(&mut self, id: BlockId, j: usize, store: &KvStore<T>) -> Result<(), KvError> {
        let (bs, w) = (self.block_size(), self.n_kv_heads * self.head_dim);
        let mut got = Vec::with_capacity(self.blocks.len());
        for l in 0..self.blocks.len() {
            let blk = if self.shares(store, l) {
                store.share_blocks(l, j..j + 1)?.pop().expect("one block")
            } else {
                let (mut k, mut v) = (vec![T::default(); bs * w], vec![T::default(); bs * w]);
                store.read(l, j * bs, &mut k, &mut v)?;
                Arc::new(KvBlock::from_rows(&k, &v, self.n_kv_heads, self.head_dim))
            };
            got.push(blk);
        }
        for (l, blk) in got.into_iter().enumerate() {
            let slots = &mut self.blocks[l];
            if slots.len() <= id as usize {
                slots.resize(id as usize + 1, None);
            }
            slots[id as usize] = Some(blk);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;

    const NKV: usize = 2;
    const D: usize = 4;

    /// A global layer and a window ring of 40 slots (a window of 8 and chunks of 32), filled with distinct values at 0..n.
    fn filled(n: usize, seed: f32) -> KvStore<half::f16> {
        let specs = [
            LayerSpec {
                capacity: 256,
                ring: false,
            },
            LayerSpec {
                capacity: 40,
                ring: true,
            },
        ];
        let mut s = KvStore::with_block(NKV, D, &specs, 16);
        for l in 0..2 {
            for p0 in (0..n).step_by(8) {
                let m = 8.min(n - p0);
                let x: Vec<f32> = (0..m * NKV * D)
                    .map(|i| seed + (l * 100_000 + p0 * NKV * D + i) as f32 * 0.001)
                    .collect();
                let y: Vec<f32> = x.iter().map(|a| -a).collect();
                s.write(l, p0, &x, &y).unwrap();
            }
        }
        s.set_len(n);
        s
    }

    fn same_held(a: &KvStore<half::f16>, b: &KvStore<half::f16>, upto: usize) {
        for l in 0..a.n_layers() {
            let ring = a.layer(l).spec;
            let first = if ring.ring {
                upto.saturating_sub(ring.capacity)
            } else {
                0
            };
            let n = upto - first;
            let mut buf = [
                vec![half::f16::ZERO; n * NKV * D],
                vec![half::f16::ZERO; n * NKV * D],
                vec![half::f16::ZERO; n * NKV * D],
                vec![half::f16::ZERO; n * NKV * D],
            ];
            let [ka, va, kb, vb] = &mut buf;
            a.read(l, first, ka, va).unwrap();
            b.read(l, first, kb, vb).unwrap();
            assert!(ka == kb && va == vb, "layer {l} differs");
        }
    }

    #[test]
    fn a_restored_prefix_is_bit_equal_and_rings_get_their_window() {
        let src = filled(64, 1.0);
        let ns = PrefixKv::namespace(&src);
        let tokens: Vec<u32> = (0..70).collect();
        let mut pc = PrefixKv::<half::f16>::new(2, NKV, D, 16, 1 << 20);
        assert_eq!(pc.nbytes(), 0, "nothing allocated before a block is used");
        // Prefill chunks of 32: each is remembered right after it runs.
        assert_eq!(
            pc.remember(ns, &tokens, 0, 32, &filled(32, 1.0)).unwrap(),
            2
        );
        assert_eq!(pc.remember(ns, &tokens, 32, 64, &src).unwrap(), 2);
        assert_eq!(
            pc.remember(ns, &tokens, 32, 64, &src).unwrap(),
            0,
            "cached already"
        );
        assert!(pc.nbytes() > 0);
        let found = pc.lookup(ns, &tokens, 69);
        assert_eq!(found.blocks.len(), 4);
        let mut dst = KvStore::with_block(NKV, D, &[src.layer(0).spec, src.layer(1).spec], 16);
        pc.restore(found, 48, &mut dst).unwrap();
        assert_eq!(dst.len(), 48);
        same_held(&src_upto(48), &dst, 48);
        // The global layer adopted the cached blocks: the memory `src` wrote for positions
        // 32..48, with no copy; the ring got a copy.
        for h in 0..NKV {
            assert!(std::ptr::eq(dst.head(0, h).k(40), src.head(0, h).k(40)));
            assert!(!std::ptr::eq(dst.head(1, h).k(0), src.head(1, h).k(0))); // slot of 40
        }
        // Once src is gone, dst and the cache share the global layer's blocks 0-2 (each counts
        // them half); the cache alone holds its block 3 and its copies of the ring's 4 blocks.
        drop(src);
        let blk = PrefixKv::<half::f16>::block_bytes(1, NKV, D, 16);
        assert_eq!(dst.nbytes(), 2 * 40 * NKV * D * 2 + 3 * blk / 2);
        assert_eq!(pc.nbytes(), 3 * blk / 2 + blk + 4 * blk);
        // Everything unpinned: every cached block can be evicted again.
        assert_eq!(pc.cache.pool().n_used(), 4);
        while pc.cache.evict_one().is_some() {}
        assert_eq!(pc.cache.pool().n_used(), 0);
    }

    /// The source store as it stood after `n` positions (what a sequence would hold).
    fn src_upto(n: usize) -> KvStore<half::f16> {
        filled(n, 1.0)
    }

    #[test]
    fn a_block_the_store_no_longer_holds_is_not_cached() {
        // The ring holds 40 positions: positions 0..24 are gone after 64 tokens.
        let src = filled(64, 2.0);
        let ns = PrefixKv::namespace(&src);
        let tokens: Vec<u32> = (0..64).collect();
        let mut pc = PrefixKv::<half::f16>::new(2, NKV, D, 16, 1 << 20);
        let e = pc.remember(ns, &tokens, 0, 16, &src).unwrap_err();
        assert!(matches!(e, KvError::NotHeld { layer: 1, .. }), "{e}");
        assert_eq!((pc.n_cached(), pc.cache.pool().n_used()), (0, 0));
        pc.cache.check().unwrap();
        // A store of another ring size is another namespace.
        let other = KvStore::<half::f16>::new(
            NKV,
            D,
            &[
                src.layer(0).spec,
                LayerSpec {
                    capacity: 48,
                    ring: true,
                },
            ],
        );
        assert_ne!(PrefixKv::namespace(&other), ns);
    }

    #[test]
    fn the_byte_limit_bounds_the_blocks() {
        let per = PrefixKv::<f32>::block_bytes(2, NKV, D, 16);
        let pc = PrefixKv::<f32>::new(2, NKV, D, 16, 3 * per + per / 2);
        assert_eq!(pc.n_blocks(), 3);
    }
}
