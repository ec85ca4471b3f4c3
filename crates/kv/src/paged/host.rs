//! `PrefixKv`: the CPU's prefix cache. A [`PrefixCache`] names the blocks; this keeps their
//! keys and values (every layer, `[block][token][kv head][dim]`, grown as blocks are first
//! used) and copies them between the cache and a sequence's [`KvStore`].
//!
//! On the CPU a sequence's store stays contiguous: a hit copies the cached blocks into it
//! (a memcpy per block and layer, instead of the prefill that made them), and the blocks a
//! prefill writes are copied into the cache. The copy is bit-exact, so a prompt served from the
//! cache continues exactly as it would have without it, provided the blocks were computed the
//! way this sequence would have computed them: the caller keeps that promise by caching and
//! restoring whole prefill chunks, and the namespace ([`PrefixKv::namespace`]) keeps stores
//! whose window rings differ apart.
use std::hash::{Hash, Hasher};

use super::pool::BlockId;
use super::prefix::{Found, PrefixCache, PrefixStats};
use crate::store::{CacheElem, KvError, KvStore};

/// Cached keys and values of prompt prefixes, in blocks of `block_size` tokens.
pub struct PrefixKv<T> {
    cache: PrefixCache,
    /// Elements of one token in one layer (kv heads x head dim).
    width: usize,
    /// Per layer, the keys and values of the blocks allocated so far (`[block][token][kv][dim]`).
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
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
            width: n_kv_heads * head_dim,
            k: vec![Vec::new(); n_layers],
            v: vec![Vec::new(); n_layers],
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

    /// Bytes allocated for cached blocks (they grow on demand, up to the limit).
    pub fn nbytes(&self) -> usize {
        (self.k.iter().chain(&self.v).map(Vec::len).sum::<usize>()) * std::mem::size_of::<T>()
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

    /// Copies the first `n` tokens of `found` (`n` a multiple of the block size, within the
    /// blocks found) into the empty, uncompacted `store` and makes them its length; unpins.
    /// A window ring gets only the positions it can hold.
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

    fn copy_in(&self, blocks: &[BlockId], n: usize, store: &mut KvStore<T>) -> Result<(), KvError> {
        let b = self.block_size();
        assert!(
            n.is_multiple_of(b) && n / b <= blocks.len(),
            "restoring {n} tokens from {} blocks of {b}",
            blocks.len()
        );
        assert!(store.is_empty() && store.n_layers() == self.k.len());
        let stride = b * self.width;
        for l in 0..self.k.len() {
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
                let at = id as usize * stride;
                let (k, v) = (&self.k[l][at..at + stride], &self.v[l][at..at + stride]);
                store.write_elems(l, j * b, k, v)?;
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
            if let Err(e) = self.copy_out(id, j * bs, store) {
                self.cache.discard(id);
                return Err(e);
            }
            self.cache.unpin(Found { blocks: vec![id] });
            added += 1;
        }
        Ok(added)
    }

    fn copy_out(&mut self, id: BlockId, pos0: usize, store: &KvStore<T>) -> Result<(), KvError> {
        let stride = self.block_size() * self.width;
        let grown = self.k.first().map_or(0, Vec::len) / stride; // blocks allocated, in every layer
        if id as usize >= grown {
            // Grow every layer's storage to cover `id`, doubling (within the limit).
            let want = (id as usize + 1).max(grown * 2).min(self.n_blocks());
            for kv in self.k.iter_mut().chain(&mut self.v) {
                kv.resize(want * stride, T::default());
            }
        }
        let at = id as usize * stride;
        for l in 0..self.k.len() {
            let (k, v) = (
                &mut self.k[l][at..at + stride],
                &mut self.v[l][at..at + stride],
            );
            store.read(l, pos0, k, v)?;
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
        let mut s = KvStore::new(NKV, D, &specs);
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
        let mut dst = KvStore::new(NKV, D, &[src.layer(0).spec, src.layer(1).spec]);
        pc.restore(found, 48, &mut dst).unwrap();
        assert_eq!(dst.len(), 48);
        same_held(&src_upto(48), &dst, 48);
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
