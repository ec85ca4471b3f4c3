//! `KvStore`: per-layer K/V, written in place at each token's position. Global layers hold
//! every position (slot = position) in *blocks* of `block` tokens (`[kv_heads, block,
//! head_dim]` each, K and V), allocated as positions are written, up to the capacity asked for:
//! a layer's block table maps slot `s` to row `s % block` of block `s / block`. Blocks are
//! reference-counted, so a block can be shared between stores (the prefix cache hands the same
//! prompt blocks to every sequence that starts with them); writing into a shared block copies
//! it first. Sliding-window layers hold a ring of `window + chunk` slots (slot = position mod
//! capacity), allocated up front as one contiguous buffer.
//! Evicting policies *compact* a layer (`compact`): each kv head keeps a chosen set of slots,
//! moved to the front of a smaller contiguous allocation, with an explicit position per slot
//! (keys keep their RoPE positions, masks stay exact); later tokens are appended after them.
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use slowfast_backend::cpu::attention::{KvElem, KvPositions, KvSegment};
pub use slowfast_backend::e4m3::E4m3;

/// A KV element type that can be written from f32 (f32 as is, f16 rounded to nearest).
pub trait CacheElem: KvElem + Default {
    fn store(src: &[f32], dst: &mut [Self]);
    /// Widen a slice to f32 (`dst.len() == src.len()`; vectorised for f16).
    fn load(src: &[Self], dst: &mut [f32]);
}

impl CacheElem for f32 {
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl CacheElem for half::f16 {
    fn store(src: &[f32], dst: &mut [half::f16]) {
        dst.convert_from_f32_slice(src);
    }
    fn load(src: &[half::f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

/// fp8 KV (`--kv-dtype fp8`): one byte a value, rounded to nearest even and saturated at
/// +-448 (`slowfast_backend::e4m3`, the GPU's rounding too).
impl CacheElem for E4m3 {
    fn store(src: &[f32], dst: &mut [E4m3]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = E4m3::from_f32(x);
        }
    }
    fn load(src: &[E4m3], dst: &mut [f32]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = x.to_f32();
        }
    }
}

/// Tokens a KV block of a CPU server's sequences holds by default (`serve --kv-block`). A
/// head's rows of a block are one run of memory, and decode streams them from DRAM: runs of 16
/// tokens (4 KiB at head dim 128, f16) read at 0.75x the contiguous rate on the development VM,
/// 128 tokens at 0.91-0.97x (`cargo bench -p slowfast-backend --bench attention -- paged`,
/// docs/serving.md). 128 is also the attention kernel's key tile.
pub const KV_BLOCK: usize = 128;

/// Tokens of room for growth the serving scheduler keeps for each running sequence (and adds
/// to a prompt at admission): admitting into memory the running sequences are about to need
/// would buy a preemption at once.
pub const KV_GROW: usize = 64;

/// Slots a head a global layer allocates to hold positions `[0, len)`: whole blocks.
pub fn block_slots(len: usize, block: usize) -> usize {
    len.div_ceil(block.max(1)) * block.max(1)
}

/// One block of a global layer: `block` consecutive positions of every kv head, K and V
/// `[kv_heads, block, head_dim]`.
#[derive(Clone)]
pub struct KvBlock<T> {
    k: Vec<T>,
    v: Vec<T>,
}

impl<T> KvBlock<T> {
    /// Bytes of its keys and values.
    pub fn nbytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<T>()
    }
}

impl<T: Copy + Default> KvBlock<T> {
    /// A block of the rows `k`, `v` (`[tokens, kv_heads, head_dim]`, as [`KvStore::read`]
    /// gives them).
    pub fn from_rows(k: &[T], v: &[T], n_kv_heads: usize, head_dim: usize) -> Self {
        let (nkv, d) = (n_kv_heads, head_dim);
        let n = k.len() / (nkv * d).max(1);
        let mut blk = KvBlock {
            k: vec![T::default(); k.len()],
            v: vec![T::default(); v.len()],
        };
        for t in 0..n {
            for h in 0..nkv {
                let (src, dst) = ((t * nkv + h) * d, (h * n + t) * d);
                blk.k[dst..dst + d].copy_from_slice(&k[src..src + d]);
                blk.v[dst..dst + d].copy_from_slice(&v[src..src + d]);
            }
        }
        blk
    }
    /// Its rows as `[tokens, kv_heads, head_dim]` K and V (for [`KvStore::write_elems`]).
    pub fn rows(&self, n_kv_heads: usize, head_dim: usize) -> (Vec<T>, Vec<T>) {
        let (nkv, d) = (n_kv_heads, head_dim);
        let n = self.k.len() / (nkv * d).max(1);
        let (mut k, mut v) = (
            vec![T::default(); self.k.len()],
            vec![T::default(); self.v.len()],
        );
        for t in 0..n {
            for h in 0..nkv {
                let (dst, src) = ((t * nkv + h) * d, (h * n + t) * d);
                k[dst..dst + d].copy_from_slice(&self.k[src..src + d]);
                v[dst..dst + d].copy_from_slice(&self.v[src..src + d]);
            }
        }
        (k, v)
    }
}

/// How one layer stores its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Slots per kv head. Given to [`KvStore::new`]: the most the layer may hold. In a store's
    /// [`LayerKv::spec`]: the slots allocated now (a global layer adds blocks on demand up to
    /// [`LayerKv::limit`]).
    pub capacity: usize,
    /// Ring buffer (sliding-window layer) instead of slot = position.
    pub ring: bool,
}

/// One layer's K and V.
#[derive(Clone)]
pub struct LayerKv<T> {
    pub spec: LayerSpec,
    /// Most slots per kv head this layer may allocate (the capacity asked for; a compacted
    /// layer's allocation).
    limit: usize,
    /// A global layer that is not compacted: its block table (`spec.capacity` is the blocks'
    /// slots). Empty otherwise.
    blocks: Vec<Arc<KvBlock<T>>>,
    /// Tokens a block.
    block: usize,
    head_dim: usize,
    /// A ring or a compacted layer: one contiguous buffer each. Empty for a paged layer.
    k: Vec<T>, // [kv_heads, capacity, head_dim]
    v: Vec<T>, // [kv_heads, capacity, head_dim]
    /// Set once the layer is compacted: per kv head, the position of each used slot
    /// (`pos[h].len()` slots in use).
    compact: Option<Compact>,
    /// One past the newest position written to this layer (ahead of the store's `len` while
    /// a forward is under way).
    written: usize,
}

/// Slot bookkeeping of a compacted layer.
#[derive(Debug, Clone)]
struct Compact {
    pos: Vec<Vec<u32>>, // [kv_heads][used slots]
    /// Per kv head: positions ascend with the slot (false after an out-of-order eviction).
    sorted: Vec<bool>,
}

impl<T: Clone> LayerKv<T> {
    /// True once an evicting policy compacted this layer.
    pub fn is_compact(&self) -> bool {
        self.compact.is_some()
    }
    /// Most slots per kv head the layer may allocate (`spec.capacity` is what it has now).
    pub fn limit(&self) -> usize {
        self.limit
    }
    /// Whether the layer is kept in blocks (a global layer, not compacted).
    fn grows(&self) -> bool {
        !self.spec.ring && self.compact.is_none()
    }
    /// Offset of kv head `h`'s row at `slot` in its buffer, and that buffer's index in the
    /// block table (0 for a contiguous layer).
    #[inline]
    fn at(&self, h: usize, slot: usize) -> (usize, usize) {
        if self.grows() {
            let b = self.block;
            (slot / b, (h * b + slot % b) * self.head_dim)
        } else {
            (0, (h * self.spec.capacity + slot) * self.head_dim)
        }
    }
    /// Kv head `h`'s key and value rows at `slot`.
    #[inline]
    fn row(&self, h: usize, slot: usize) -> (&[T], &[T]) {
        let (b, o) = self.at(h, slot);
        let d = self.head_dim;
        if self.grows() {
            let blk = &self.blocks[b];
            (&blk.k[o..o + d], &blk.v[o..o + d])
        } else {
            (&self.k[o..o + d], &self.v[o..o + d])
        }
    }
    /// Kv head `h`'s key and value rows at `slot`, writable (a shared block is copied first).
    #[inline]
    fn row_mut(&mut self, h: usize, slot: usize) -> (&mut [T], &mut [T]) {
        let (b, o) = self.at(h, slot);
        let d = self.head_dim;
        if self.grows() {
            let blk = Arc::make_mut(&mut self.blocks[b]);
            (&mut blk.k[o..o + d], &mut blk.v[o..o + d])
        } else {
            (&mut self.k[o..o + d], &mut self.v[o..o + d])
        }
    }
    /// Bytes of this layer's buffers, a block shared by `n` holders counted `1/n`.
    fn nbytes(&self) -> usize {
        let own = (self.k.capacity() + self.v.capacity()) * std::mem::size_of::<T>();
        own + self
            .blocks
            .iter()
            .map(|b| b.nbytes() / Arc::strong_count(b))
            .sum::<usize>()
    }
}

/// The key and value rows of one kv head of one layer, by slot (whatever the layout: blocks,
/// a ring, a compacted buffer).
pub struct HeadRows<'a, T> {
    layer: &'a LayerKv<T>,
    h: usize,
}

impl<'a, T: Clone> HeadRows<'a, T> {
    /// The key at `slot`.
    #[inline]
    pub fn k(&self, slot: usize) -> &'a [T] {
        self.layer.row(self.h, slot).0
    }
    /// The value at `slot`.
    #[inline]
    pub fn v(&self, slot: usize) -> &'a [T] {
        self.layer.row(self.h, slot).1
    }
}

/// The KV cache of one sequence.
#[derive(Clone)]
pub struct KvStore<T> {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    layers: Vec<LayerKv<T>>,
    /// Positions `[0, len)` have been written (in every layer).
    len: usize,
    /// Tokens a block of a global layer.
    block: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvError {
    #[error(
        "position {pos} is beyond the KV cache capacity of {capacity} tokens in layer {layer}"
    )]
    Full {
        layer: usize,
        pos: usize,
        capacity: usize,
    },
    #[error(
        "KV write of {got} values does not match {n} tokens x {n_kv_heads} kv heads x {head_dim}"
    )]
    Shape {
        got: usize,
        n: usize,
        n_kv_heads: usize,
        head_dim: usize,
    },
    #[error("writing {n} tokens at position {pos0} into a window ring of {capacity} slots would overwrite keys the same chunk still needs")]
    ChunkTooLong {
        pos0: usize,
        n: usize,
        capacity: usize,
    },
    #[error("compacting layer {layer} kv head {head}: slot {slot} is not held (the head holds {held} slots)")]
    BadSlot {
        layer: usize,
        head: usize,
        slot: usize,
        held: usize,
    },
    #[error(
        "compacting layer {layer}: got slot lists for {got} kv heads, the store has {n_kv_heads}"
    )]
    KeepHeads {
        layer: usize,
        got: usize,
        n_kv_heads: usize,
    },
    #[error("layer {layer} is compacted: its slots no longer follow positions")]
    Compacted { layer: usize },
    #[error("layer {layer} is not kept in blocks (a window ring, or compacted)")]
    NotPaged { layer: usize },
    #[error("layer {layer} already holds {len} positions: blocks are adopted by an empty layer")]
    NotEmpty { layer: usize, len: usize },
    #[error("layer {layer} does not hold positions {pos0}..{} (it holds {}..{})", pos0 + n, held.0, held.1)]
    NotHeld {
        layer: usize,
        pos0: usize,
        n: usize,
        held: (usize, usize),
    },
    #[error("layer {layer}: explicit positions must ascend and start at or after the {len} tokens already written, got {got:?}")]
    BadPositions {
        layer: usize,
        len: usize,
        got: Vec<u32>,
    },
}

impl<T: CacheElem> KvStore<T> {
    /// A store of `specs` layers: window rings are allocated (zeroed) here, each global layer
    /// as one block of its whole capacity when its first position is written (the contiguous
    /// layout a lone sequence decodes fastest from; [`Self::with_block`] for smaller blocks).
    pub fn new(n_kv_heads: usize, head_dim: usize, specs: &[LayerSpec]) -> Self {
        let whole = specs
            .iter()
            .filter(|s| !s.ring)
            .map(|s| s.capacity)
            .max()
            .unwrap_or(1);
        Self::with_block(n_kv_heads, head_dim, specs, whole)
    }

    /// [`Self::new`] with blocks of `block` tokens (at least 1).
    pub fn with_block(
        n_kv_heads: usize,
        head_dim: usize,
        specs: &[LayerSpec],
        block: usize,
    ) -> Self {
        let block = block.max(1);
        let layers = specs
            .iter()
            .map(|&spec| {
                let alloc = if spec.ring { spec.capacity } else { 0 };
                let n = n_kv_heads * alloc * head_dim;
                LayerKv {
                    spec: LayerSpec {
                        capacity: alloc,
                        ring: spec.ring,
                    },
                    limit: spec.capacity,
                    blocks: Vec::new(),
                    block,
                    head_dim,
                    k: vec![T::default(); n],
                    v: vec![T::default(); n],
                    compact: None,
                    written: 0,
                }
            })
            .collect();
        KvStore {
            n_kv_heads,
            head_dim,
            layers,
            len: 0,
            block,
        }
    }
}

impl<T: CacheElem> KvStore<T> {
    /// Number of positions written.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn layer(&self, layer: usize) -> &LayerKv<T> {
        &self.layers[layer]
    }
    /// Forget everything (buffers are kept).
    pub fn clear(&mut self) {
        self.len = 0;
        for l in &mut self.layers {
            l.written = 0;
        }
    }
    /// Drop positions `>= len` (e.g. rejected speculative tokens); never grows.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        for l in &mut self.layers {
            l.written = l.written.min(len);
            let cap = l.spec.capacity;
            if let Some(c) = &mut l.compact {
                for h in 0..nkv {
                    let base = h * cap * d;
                    retain_slots(
                        &mut c.pos[h],
                        &mut l.k[base..base + cap * d],
                        &mut l.v[base..base + cap * d],
                        d,
                        |p| (p as usize) < len,
                    );
                }
            }
        }
    }
    /// Record that positions up to `len` are written in every layer (after the last layer).
    pub fn set_len(&mut self, len: usize) {
        self.len = len;
    }
    /// Positions a global layer can hold: its slots, or for a compacted layer the positions
    /// written so far plus its free slots.
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| !l.spec.ring)
            .map(|l| match &l.compact {
                None => l.limit,
                Some(c) => {
                    let used = c.pos.iter().map(Vec::len).max().unwrap_or(0);
                    self.len + l.spec.capacity.saturating_sub(used)
                }
            })
            .min()
            .unwrap_or(usize::MAX)
    }
    /// Tokens a block of a global layer.
    pub fn block_size(&self) -> usize {
        self.block
    }
    /// Keep global layers in blocks of `block` tokens from now on: only while the store is
    /// empty (their blocks, if any, are dropped).
    pub fn set_block(&mut self, block: usize) -> Result<(), KvError> {
        if let Some(l) = self.layers.iter().position(|l| l.written > 0) {
            return Err(KvError::NotEmpty {
                layer: l,
                len: self.layers[l].written,
            });
        }
        self.block = block.max(1);
        for l in &mut self.layers {
            l.block = self.block;
            if l.grows() {
                l.blocks = Vec::new();
                l.spec.capacity = 0;
            }
        }
        Ok(())
    }
    /// Bytes held by the K/V buffers (allocations, so compaction shows up here); a block
    /// shared with `n - 1` other holders (stores, the prefix cache) counts `1/n`, so the
    /// holders' bytes add up to the memory in use.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(LayerKv::nbytes).sum()
    }
    /// Bytes the K/V buffers will hold once positions `[0, len)` are written (what
    /// [`Self::nbytes`] says then, if no policy compacts a layer meanwhile).
    pub fn nbytes_at(&self, len: usize) -> usize {
        let row = 2 * self.n_kv_heads * self.head_dim * std::mem::size_of::<T>();
        self.layers
            .iter()
            .map(|l| {
                let alloc = l.spec.capacity;
                let more = if l.grows() {
                    block_slots(len.min(l.limit), l.block).saturating_sub(alloc)
                } else {
                    0
                };
                l.nbytes() + more * row
            })
            .sum()
    }
    /// Adds blocks to a global layer until it holds positions `[0, need)` (`need <= limit`).
    fn grow(&mut self, layer: usize, need: usize) {
        let n = self.n_kv_heads * self.block * self.head_dim;
        let l = &mut self.layers[layer];
        while l.spec.capacity < need {
            l.blocks.push(Arc::new(KvBlock {
                k: vec![T::default(); n],
                v: vec![T::default(); n],
            }));
            l.spec.capacity += l.block;
        }
    }
    /// Slots of kv head `h` of `layer` holding a token.
    pub fn held(&self, layer: usize, h: usize) -> usize {
        let l = &self.layers[layer];
        match &l.compact {
            Some(c) => c.pos[h].len(),
            None if l.spec.ring => l.written.min(l.spec.capacity),
            None => l.written,
        }
    }
    /// The position of each held slot of kv head `h` (slot order; the order `segments` reads
    /// them in when the whole history is asked for).
    pub fn slot_positions(&self, layer: usize, h: usize) -> Vec<u32> {
        let l = &self.layers[layer];
        match &l.compact {
            Some(c) => c.pos[h].clone(),
            None if l.spec.ring => {
                let (cap, n) = (l.spec.capacity, l.written);
                let first = n.saturating_sub(cap);
                let mut v = vec![0u32; n - first];
                for p in first..n {
                    v[p % cap] = p as u32;
                }
                v
            }
            None => (0..l.written as u32).collect(),
        }
    }

    /// Keep, for each kv head `h`, only the slots `keep[h]` of `layer` (any order; they are
    /// stored by ascending position) and shrink the layer's allocation to the most any head
    /// keeps plus `headroom` free slots per head. The freed memory is returned to the allocator.
    pub fn compact(
        &mut self,
        layer: usize,
        keep: &[Vec<usize>],
        headroom: usize,
    ) -> Result<(), KvError> {
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        if keep.len() != nkv {
            return Err(KvError::KeepHeads {
                layer,
                got: keep.len(),
                n_kv_heads: nkv,
            });
        }
        // Per head: the kept (position, slot) pairs by ascending position.
        let mut kept: Vec<Vec<(u32, usize)>> = Vec::with_capacity(nkv);
        for (h, slots) in keep.iter().enumerate() {
            let all = self.slot_positions(layer, h);
            let mut v = Vec::with_capacity(slots.len());
            for &s in slots {
                let p = *all.get(s).ok_or(KvError::BadSlot {
                    layer,
                    head: h,
                    slot: s,
                    held: all.len(),
                })?;
                v.push((p, s));
            }
            v.sort_unstable();
            v.dedup();
            kept.push(v);
        }
        let l = &mut self.layers[layer];
        let cap = kept.iter().map(Vec::len).max().unwrap_or(0) + headroom;
        let mut k = vec![T::default(); nkv * cap * d];
        let mut v = vec![T::default(); nkv * cap * d];
        for (h, slots) in kept.iter().enumerate() {
            for (i, &(_, s)) in slots.iter().enumerate() {
                let dst = (h * cap + i) * d;
                let (ks, vs) = l.row(h, s);
                k[dst..dst + d].copy_from_slice(ks);
                v[dst..dst + d].copy_from_slice(vs);
            }
        }
        l.blocks = Vec::new();
        l.k = k;
        l.v = v;
        l.spec.capacity = cap;
        l.limit = cap;
        l.compact = Some(Compact {
            pos: kept
                .iter()
                .map(|v| v.iter().map(|&(p, _)| p).collect())
                .collect(),
            sorted: vec![true; nkv],
        });
        Ok(())
    }

    /// Shrink a compacted `layer`'s allocation to what it holds plus `headroom` slots per head
    /// (e.g. after FastKV wrote only its propagated tokens into a full-size allocation).
    /// Layers that are not compacted are left alone.
    pub fn shrink(&mut self, layer: usize, headroom: usize) -> Result<(), KvError> {
        let l = &self.layers[layer];
        let Some(c) = &l.compact else {
            return Ok(());
        };
        let most = c.pos.iter().map(Vec::len).max().unwrap_or(0);
        if l.spec.ring || l.spec.capacity <= most + headroom {
            return Ok(());
        }
        let keep: Vec<Vec<usize>> = c.pos.iter().map(|p| (0..p.len()).collect()).collect();
        self.compact(layer, &keep, headroom)
    }

    /// Evict slot `slot` of kv head `h` of a compacted `layer`: the last held slot moves into
    /// its place (O(head_dim); positions then no longer ascend with the slot).
    pub fn evict_slot(&mut self, layer: usize, h: usize, slot: usize) -> Result<(), KvError> {
        let d = self.head_dim;
        let l = &mut self.layers[layer];
        let cap = l.spec.capacity;
        let c = l.compact.as_mut().ok_or(KvError::BadSlot {
            layer,
            head: h,
            slot,
            held: 0,
        })?;
        let held = c.pos[h].len();
        if slot >= held {
            return Err(KvError::BadSlot {
                layer,
                head: h,
                slot,
                held,
            });
        }
        let last = held - 1;
        if slot != last {
            let base = h * cap * d;
            l.k.copy_within(base + last * d..base + (last + 1) * d, base + slot * d);
            l.v.copy_within(base + last * d..base + (last + 1) * d, base + slot * d);
            c.sorted[h] = false;
        }
        c.pos[h].swap_remove(slot);
        Ok(())
    }

    /// Write `n` tokens' keys and values (`[n, kv_heads, head_dim]`, f32) at positions
    /// `pos0..pos0 + n` of `layer`.
    pub fn write(
        &mut self,
        layer: usize,
        pos0: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let n = self.tokens_in(k.len(), v.len())?;
        if self.layers[layer].compact.is_some() {
            let pos: Vec<u32> = (pos0..pos0 + n).map(|p| p as u32).collect();
            return self.append(layer, &pos, k, v);
        }
        self.put(layer, pos0, n, |src, dk, dv| {
            T::store(&k[src..src + dk.len()], dk);
            T::store(&v[src..src + dv.len()], dv);
        })
    }

    /// Like [`Self::write`] with keys and values already in the store's element type (KV
    /// copied out by [`Self::read`]: bit-exact), into a layer that is not compacted.
    pub fn write_elems(
        &mut self,
        layer: usize,
        pos0: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), KvError> {
        let n = self.tokens_in(k.len(), v.len())?;
        if self.layers[layer].compact.is_some() {
            return Err(KvError::Compacted { layer });
        }
        self.put(layer, pos0, n, |src, dk, dv| {
            dk.copy_from_slice(&k[src..src + dk.len()]);
            dv.copy_from_slice(&v[src..src + dv.len()]);
        })
    }

    /// Copies positions `pos0..pos0 + n` of `layer` into `k`, `v` (`[n, kv_heads, head_dim]`,
    /// `n` from their length). The layer must not be compacted and must still hold them (a
    /// window ring keeps only its last `capacity` positions).
    pub fn read(&self, layer: usize, pos0: usize, k: &mut [T], v: &mut [T]) -> Result<(), KvError> {
        let n = self.tokens_in(k.len(), v.len())?;
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        let l = &self.layers[layer];
        if l.compact.is_some() {
            return Err(KvError::Compacted { layer });
        }
        let cap = l.spec.capacity;
        let oldest = if l.spec.ring {
            l.written.saturating_sub(cap)
        } else {
            0
        };
        if n > 0 && (pos0 < oldest || pos0 + n > l.written) {
            return Err(KvError::NotHeld {
                layer,
                pos0,
                n,
                held: (oldest, l.written),
            });
        }
        for t in 0..n {
            let slot = if l.spec.ring {
                (pos0 + t) % cap
            } else {
                pos0 + t
            };
            for h in 0..nkv {
                let dst = (t * nkv + h) * d;
                let (ks, vs) = l.row(h, slot);
                k[dst..dst + d].copy_from_slice(ks);
                v[dst..dst + d].copy_from_slice(vs);
            }
        }
        Ok(())
    }

    /// Tokens in a `[n, kv_heads, head_dim]` K and V of these lengths.
    fn tokens_in(&self, k_len: usize, v_len: usize) -> Result<usize, KvError> {
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        let n = k_len / (nkv * d).max(1);
        if k_len != n * nkv * d || v_len != k_len {
            return Err(KvError::Shape {
                got: k_len.max(v_len),
                n,
                n_kv_heads: nkv,
                head_dim: d,
            });
        }
        Ok(n)
    }

    /// Writes `n` tokens at `pos0..pos0 + n` of a layer that is not compacted:
    /// `put(src, k_dst, v_dst)` fills one (token, kv head) row, `src` its offset in the
    /// caller's `[n, kv_heads, head_dim]` input.
    fn put(
        &mut self,
        layer: usize,
        pos0: usize,
        n: usize,
        mut put: impl FnMut(usize, &mut [T], &mut [T]),
    ) -> Result<(), KvError> {
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        let l = &self.layers[layer];
        if l.spec.ring {
            if n > l.spec.capacity {
                return Err(KvError::ChunkTooLong {
                    pos0,
                    n,
                    capacity: l.spec.capacity,
                });
            }
        } else if pos0 + n > l.limit {
            return Err(KvError::Full {
                layer,
                pos: pos0 + n - 1,
                capacity: l.limit,
            });
        } else if pos0 + n > l.spec.capacity {
            self.grow(layer, pos0 + n);
        }
        let l = &mut self.layers[layer];
        let cap = l.spec.capacity;
        l.written = l.written.max(pos0 + n);
        for t in 0..n {
            let slot = if l.spec.ring {
                (pos0 + t) % cap
            } else {
                pos0 + t
            };
            for h in 0..nkv {
                let (dk, dv) = l.row_mut(h, slot);
                put((t * nkv + h) * d, dk, dv);
            }
        }
        Ok(())
    }

    /// Write `n` tokens at explicit, ascending `positions` (`k`, `v`: `[n, kv_heads, head_dim]`)
    /// that need not be contiguous (FastKV propagates a subset of the prompt). Contiguous
    /// positions into a layer that is not compacted take the plain `write` path; otherwise the
    /// layer is compacted first (keeping what it holds) and the tokens are appended.
    pub fn write_at(
        &mut self,
        layer: usize,
        positions: &[u32],
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        if k.len() != positions.len() * nkv * d || v.len() != k.len() {
            return Err(KvError::Shape {
                got: k.len().max(v.len()),
                n: positions.len(),
                n_kv_heads: nkv,
                head_dim: d,
            });
        }
        let Some(&p0) = positions.first() else {
            return Ok(());
        };
        let written = self.layers[layer].written;
        if (p0 as usize) < written || positions.windows(2).any(|w| w[1] <= w[0]) {
            return Err(KvError::BadPositions {
                layer,
                len: written,
                got: positions.iter().take(8).copied().collect(),
            });
        }
        let contiguous = positions
            .iter()
            .enumerate()
            .all(|(i, &p)| p as usize == p0 as usize + i);
        let l = &self.layers[layer];
        if l.compact.is_none() {
            if contiguous && p0 as usize == written {
                return self.write(layer, p0 as usize, k, v);
            }
            // Keep what the layer holds; room for everything it could hold before.
            let keep: Vec<Vec<usize>> = (0..nkv)
                .map(|h| (0..self.held(layer, h)).collect())
                .collect();
            let headroom = l.limit - self.held(layer, 0);
            self.compact(layer, &keep, headroom)?;
        }
        self.append(layer, positions, k, v)
    }

    /// Append tokens at ascending `positions` to a compacted layer. A compacted ring layer
    /// first drops the slots a ring of its size would have overwritten.
    fn append(
        &mut self,
        layer: usize,
        positions: &[u32],
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        let n = positions.len();
        let l = &mut self.layers[layer];
        let cap = l.spec.capacity;
        let c = l.compact.as_mut().expect("append needs a compacted layer");
        l.written = l.written.max(*positions.last().unwrap() as usize + 1);
        for h in 0..nkv {
            let base = h * cap * d;
            if l.spec.ring {
                if n > cap {
                    return Err(KvError::ChunkTooLong {
                        pos0: positions[0] as usize,
                        n,
                        capacity: cap,
                    });
                }
                if c.pos[h].len() + n > cap {
                    // A ring keeps the last `cap` positions: older ones are never read again.
                    let oldest = (positions[0] as usize).saturating_sub(cap - n);
                    retain_slots(
                        &mut c.pos[h],
                        &mut l.k[base..base + cap * d],
                        &mut l.v[base..base + cap * d],
                        d,
                        |p| p as usize >= oldest,
                    );
                }
            }
            let held = c.pos[h].len();
            if held + n > cap {
                return Err(KvError::Full {
                    layer,
                    pos: *positions.last().unwrap() as usize,
                    capacity: cap,
                });
            }
            if c.pos[h].last().is_some_and(|&p| p >= positions[0]) {
                c.sorted[h] = false;
            }
            for (t, &p) in positions.iter().enumerate() {
                let src = (t * nkv + h) * d;
                let dst = base + (held + t) * d;
                T::store(&k[src..src + d], &mut l.k[dst..dst + d]);
                T::store(&v[src..src + d], &mut l.v[dst..dst + d]);
                c.pos[h].push(p);
            }
        }
        Ok(())
    }

    /// The keys of kv head `h` at positions `[lo, hi)` as contiguous segments pushed onto
    /// `out`: one a block of a global layer, one or two of a ring (two when it wraps), one with
    /// a position list for a compacted layer (holding only the kept positions of the range).
    /// `lo` must be within what the layer still holds.
    pub fn segments_into<'s>(
        &'s self,
        layer: usize,
        h: usize,
        lo: usize,
        hi: usize,
        out: &mut Vec<KvSegment<'s, T>>,
    ) {
        let l = &self.layers[layer];
        let (cap, d) = (l.spec.capacity, self.head_dim);
        if hi <= lo {
            return;
        }
        let base = h * cap * d;
        if let Some(c) = &l.compact {
            // Held slots with positions in [lo, hi): a binary search while positions ascend;
            // otherwise (after out-of-order evictions) every held slot, which must all lie in
            // the range (global layers are always read from 0 to the newest position).
            let pos = &c.pos[h];
            let (a, b) = if c.sorted[h] {
                (
                    pos.partition_point(|&p| (p as usize) < lo),
                    pos.partition_point(|&p| (p as usize) < hi),
                )
            } else {
                debug_assert!(pos.iter().all(|&p| (lo..hi).contains(&(p as usize))));
                (0, pos.len())
            };
            if a < b {
                out.push(KvSegment {
                    k: &l.k[base + a * d..base + b * d],
                    v: &l.v[base + a * d..base + b * d],
                    pos: KvPositions::List(&pos[a..b]),
                });
            }
            return;
        }
        if !l.spec.ring {
            debug_assert!(hi <= cap);
            let bs = l.block;
            let mut p = lo;
            while p < hi {
                let (blk, r) = (&l.blocks[p / bs], p % bs);
                let n = (bs - r).min(hi - p);
                let o = (h * bs + r) * d;
                out.push(KvSegment {
                    k: &blk.k[o..o + n * d],
                    v: &blk.v[o..o + n * d],
                    pos: KvPositions::Range { start: p as u32 },
                });
                p += n;
            }
            return;
        }
        let seg = |slot: usize, pos: usize, len: usize| KvSegment {
            k: &l.k[base + slot * d..base + (slot + len) * d],
            v: &l.v[base + slot * d..base + (slot + len) * d],
            pos: KvPositions::Range { start: pos as u32 },
        };
        debug_assert!(hi - lo <= cap, "ring of {cap} cannot hold [{lo}, {hi})");
        let s = lo % cap;
        let first = (cap - s).min(hi - lo);
        out.push(seg(s, lo, first));
        if first < hi - lo {
            out.push(seg(0, lo + first, hi - lo - first));
        }
    }

    /// Blocks `blocks` of global `layer` (positions `[start * block_size, end * block_size)`),
    /// shared with the caller: the same memory, one more reference each. A later write into a
    /// shared block (by this store or one adopting it) copies the block first.
    pub fn share_blocks(
        &self,
        layer: usize,
        blocks: std::ops::Range<usize>,
    ) -> Result<Vec<Arc<KvBlock<T>>>, KvError> {
        let l = &self.layers[layer];
        if !l.grows() {
            return Err(KvError::NotPaged { layer });
        }
        if blocks.end * l.block > l.written {
            return Err(KvError::NotHeld {
                layer,
                pos0: blocks.start * l.block,
                n: blocks.len() * l.block,
                held: (0, l.written),
            });
        }
        Ok(l.blocks[blocks].to_vec())
    }

    /// Makes `blocks` (from [`Self::share_blocks`] of a store of the same shape and block
    /// size) the first blocks of global `layer`, which must hold nothing yet: positions
    /// `[0, blocks.len() * block_size)` are then written, without a copy.
    pub fn adopt_blocks(
        &mut self,
        layer: usize,
        blocks: &[Arc<KvBlock<T>>],
    ) -> Result<(), KvError> {
        let want = self.n_kv_heads * self.block * self.head_dim;
        let l = &mut self.layers[layer];
        let n = blocks.len() * l.block;
        if !l.grows() {
            return Err(KvError::NotPaged { layer });
        }
        if l.written > 0 {
            return Err(KvError::NotEmpty {
                layer,
                len: l.written,
            });
        }
        if n > l.limit {
            return Err(KvError::Full {
                layer,
                pos: n - 1,
                capacity: l.limit,
            });
        }
        if let Some(b) = blocks
            .iter()
            .find(|b| b.k.len() != want || b.v.len() != want)
        {
            return Err(KvError::Shape {
                got: b.k.len(),
                n: l.block,
                n_kv_heads: self.n_kv_heads,
                head_dim: self.head_dim,
            });
        }
        let keep = l.blocks.len().saturating_sub(blocks.len());
        let rest: Vec<_> = l.blocks.drain(..).skip(blocks.len()).take(keep).collect();
        l.blocks = blocks.iter().cloned().chain(rest).collect();
        l.spec.capacity = l.blocks.len() * l.block;
        l.written = n;
        Ok(())
    }

    /// [`Self::segments_into`] into a new vector.
    pub fn segments(&self, layer: usize, h: usize, lo: usize, hi: usize) -> Vec<KvSegment<'_, T>> {
        let mut out = Vec::new();
        self.segments_into(layer, h, lo, hi, &mut out);
        out
    }

    /// Kv head `h`'s key and value rows of `layer`, by slot (policies that gather tokens:
    /// compact buffers, key norms, page bounds).
    pub fn head(&self, layer: usize, h: usize) -> HeadRows<'_, T> {
        HeadRows {
            layer: &self.layers[layer],
            h,
        }
    }
}

/// Keep the slots whose position passes `keep`, in order, moving them to the front.
fn retain_slots<T: Copy>(
    pos: &mut Vec<u32>,
    k: &mut [T],
    v: &mut [T],
    d: usize,
    keep: impl Fn(u32) -> bool,
) {
    let mut w = 0;
    for r in 0..pos.len() {
        if keep(pos[r]) {
            if w != r {
                k.copy_within(r * d..(r + 1) * d, w * d);
                v.copy_within(r * d..(r + 1) * d, w * d);
                pos[w] = pos[r];
            }
            w += 1;
        }
    }
    pos.truncate(w);
}

/// A read of at most two segments as two options (tests of rings and compacted layers).
#[cfg(test)]
fn two<S>(v: Vec<S>) -> [Option<S>; 2] {
    assert!(v.len() <= 2, "{} segments", v.len());
    let mut it = v.into_iter();
    [it.next(), it.next()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv_for(n: usize, nkv: usize, d: usize, pos0: usize) -> Vec<f32> {
        (0..n * nkv * d)
            .map(|i| {
                let (t, r) = (i / (nkv * d), i % (nkv * d));
                ((pos0 + t) * 1000 + r) as f32
            })
            .collect()
    }

    /// Global layers allocate whole blocks as positions arrive: against a plain model of every
    /// position written (random chunk sizes, block sizes 1, 3, 16 and 32, f16, a ring beside),
    /// reads and dense segment reads of random ranges return what was written, each segment
    /// lies in one block, the allocation is what `nbytes_at` predicted before each write, and
    /// the limit holds.
    #[test]
    fn global_layers_grow_by_blocks_and_keep_what_they_hold() {
        let (nkv, d, limit) = (3, 8, 700);
        for (seed, bs) in (0..8u64).zip([1usize, 3, 16, 32].into_iter().cycle()) {
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = |m: usize| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng % m as u64) as usize
            };
            let specs = [
                LayerSpec {
                    capacity: limit,
                    ring: false,
                },
                LayerSpec {
                    capacity: 96,
                    ring: true,
                },
            ];
            let mut s = KvStore::<half::f16>::with_block(nkv, d, &specs, bs);
            let ring_bytes = 2 * nkv * d * 96 * 2;
            assert_eq!(
                s.nbytes(),
                ring_bytes,
                "only the ring is allocated at first"
            );
            assert_eq!(s.capacity(), limit);
            let mut model: Vec<f32> = Vec::new(); // [pos][h][d]
            let mut len = 0;
            while len < limit {
                let n = (1 + next(90)).min(limit - len);
                let kv: Vec<f32> = (0..n * nkv * d)
                    .map(|i| (next(2000) + i % 7) as f32)
                    .collect();
                let predicted = s.nbytes_at(len + n);
                for l in 0..2 {
                    s.write(l, len, &kv, &kv).unwrap();
                }
                model.extend_from_slice(&kv);
                len += n;
                s.set_len(len);
                assert_eq!(s.nbytes(), predicted, "seed {seed} at {len}");
                assert_eq!(s.layer(0).spec.capacity, block_slots(len, bs));
                let a = next(len);
                let m = 1 + next(len - a);
                let (mut k, mut v) = (
                    vec![half::f16::ZERO; m * nkv * d],
                    vec![half::f16::ZERO; m * nkv * d],
                );
                s.read(0, a, &mut k, &mut v).unwrap();
                let want = &model[a * nkv * d..(a + m) * nkv * d];
                assert!(
                    k.iter().zip(want).all(|(x, y)| x.to_f32() == *y),
                    "seed {seed}"
                );
                assert_eq!(k, v);
                let h = next(nkv);
                let segs = s.segments(0, h, a, a + m);
                let mut at = a;
                for g in &segs {
                    let KvPositions::Range { start } = g.pos else {
                        panic!("a global layer reads ranges")
                    };
                    let n = g.len(d);
                    assert_eq!(start as usize, at);
                    assert!(
                        n >= 1 && at / bs == (at + n - 1) / bs,
                        "one block a segment"
                    );
                    for (i, row) in g.k.chunks(d).enumerate() {
                        let w = &model[((at + i) * nkv + h) * d..][..d];
                        assert!(row.iter().zip(w).all(|(x, y)| x.to_f32() == *y));
                        assert_eq!(s.head(0, h).k(at + i), row);
                    }
                    at += n;
                }
                assert_eq!(at, a + m, "the segments cover the range");
            }
            assert_eq!(s.layer(0).spec.capacity, block_slots(limit, bs));
            let one = vec![0.0f32; nkv * d];
            assert!(matches!(
                s.write(0, limit, &one, &one),
                Err(KvError::Full { capacity, .. }) if capacity == limit
            ));
        }
    }

    /// Blocks shared between stores are one copy: the adopting store reads the same memory,
    /// each holder counts a shared block half, a write into a shared block copies it (the other
    /// holder keeps its values), and misuse is refused with nothing changed.
    #[test]
    fn shared_blocks_are_one_copy_until_written() {
        let (nkv, d, bs) = (2, 4, 16);
        let specs = [
            LayerSpec {
                capacity: 128,
                ring: false,
            },
            LayerSpec {
                capacity: 24,
                ring: true,
            },
        ];
        let kv =
            |n: usize, x: f32| -> Vec<f32> { (0..n * nkv * d).map(|i| x + i as f32).collect() };
        let mut a = KvStore::<f32>::with_block(nkv, d, &specs, 16);
        a.write(0, 0, &kv(40, 0.0), &kv(40, 0.5)).unwrap();
        a.set_len(40);
        let alone = a.nbytes();
        assert_eq!(alone, 2 * 48 * nkv * d * 4 + 2 * 24 * nkv * d * 4);
        let shared = a.share_blocks(0, 0..2).unwrap();
        assert!(matches!(
            a.share_blocks(0, 0..3),
            Err(KvError::NotHeld { .. })
        ));
        assert!(matches!(
            a.share_blocks(1, 0..1),
            Err(KvError::NotPaged { layer: 1 })
        ));
        let mut b = KvStore::<f32>::with_block(nkv, d, &specs, 16);
        b.adopt_blocks(0, &shared).unwrap();
        drop(shared);
        assert!(matches!(
            b.adopt_blocks(0, &a.share_blocks(0, 0..1).unwrap()),
            Err(KvError::NotEmpty { layer: 0, len: 32 })
        ));
        // B holds positions 0..32 without a copy: the same rows, the same addresses.
        for h in 0..nkv {
            for p in [0, 15, 16, 31] {
                assert_eq!(b.head(0, h).k(p), a.head(0, h).k(p));
                assert!(std::ptr::eq(b.head(0, h).k(p), a.head(0, h).k(p)));
            }
        }
        let block = 2 * bs * nkv * d * 4;
        assert_eq!(a.nbytes(), alone - block, "two blocks counted half");
        assert_eq!(b.nbytes() - 2 * 24 * nkv * d * 4, block);
        // B continues after the shared blocks: no copy.
        b.write(0, 32, &kv(4, 900.0), &kv(4, 900.0)).unwrap();
        assert!(std::ptr::eq(b.head(0, 1).k(20), a.head(0, 1).k(20)));
        // B rewrites position 20 (in shared block 1): the block is copied first.
        b.truncate(20);
        b.write(0, 20, &kv(1, -7.0), &kv(1, -7.0)).unwrap();
        assert!(!std::ptr::eq(b.head(0, 1).k(20), a.head(0, 1).k(20)));
        assert_eq!(b.head(0, 0).k(20)[0], -7.0);
        assert_eq!(a.head(0, 0).k(20)[0], (20 * nkv * d) as f32);
        assert_eq!(
            b.head(0, 0).k(21),
            a.head(0, 0).k(21),
            "the copy keeps the rest"
        );
        assert!(
            std::ptr::eq(b.head(0, 0).k(3), a.head(0, 0).k(3)),
            "block 0 still shared"
        );
        // A block of another shape is refused.
        let mut c = KvStore::<f32>::with_block(nkv, d, &specs, 8);
        let e = c
            .adopt_blocks(0, &a.share_blocks(0, 0..1).unwrap())
            .unwrap_err();
        assert!(matches!(e, KvError::Shape { .. }), "{e}");
        assert_eq!(c.layer(0).spec.capacity, 0);
    }

    /// `KvBlock::from_rows` and `rows` are inverse transposes.
    #[test]
    fn block_rows_round_trip() {
        let (nkv, d, n) = (3, 4, 5);
        let k: Vec<f32> = (0..n * nkv * d).map(|i| i as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        let b = KvBlock::from_rows(&k, &v, nkv, d);
        // Kv head 1 of token 2 sits at row (1 * n + 2) of the block.
        assert_eq!(
            &b.k[(n + 2) * d..(n + 3) * d],
            &k[(2 * nkv + 1) * d..(2 * nkv + 2) * d]
        );
        assert_eq!(b.rows(nkv, d), (k, v));
    }

    #[test]
    fn linear_layer_round_trips_positions() {
        let (nkv, d) = (2, 4);
        let mut s = KvStore::<f32>::new(
            nkv,
            d,
            &[LayerSpec {
                capacity: 16,
                ring: false,
            }],
        );
        let k = kv_for(5, nkv, d, 3);
        s.write(0, 3, &k, &k).unwrap();
        let [a, b] = two(s.segments(0, 1, 3, 8));
        let a = a.unwrap();
        assert!(b.is_none());
        assert_eq!(a.k.len(), 5 * d);
        // kv head 1 of position 4 is element (4-3)*nkv*d + 1*d
        assert_eq!(a.k[d], k[nkv * d + d]);
        assert!(matches!(a.pos, KvPositions::Range { start: 3 }));
        assert!(matches!(s.write(0, 14, &k, &k), Err(KvError::Full { .. })));
    }

    #[test]
    fn ring_layer_wraps_into_two_segments_with_right_positions() {
        let (nkv, d, cap) = (1, 2, 6);
        let mut s = KvStore::<f32>::new(
            nkv,
            d,
            &[LayerSpec {
                capacity: cap,
                ring: true,
            }],
        );
        for p in 0..10 {
            let k = kv_for(1, nkv, d, p);
            s.write(0, p, &k, &k).unwrap();
        }
        // the ring holds positions 4..10; slots: 4->4, 5->5, 6->0, ..., 9->3
        let [a, b] = two(s.segments(0, 0, 4, 10));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.k, &[4000.0, 4001.0, 5000.0, 5001.0]);
        assert!(matches!(a.pos, KvPositions::Range { start: 4 }));
        assert_eq!(b.k.len(), 4 * d);
        assert_eq!(b.k[0], 6000.0);
        assert!(matches!(b.pos, KvPositions::Range { start: 6 }));
        let too_long = kv_for(7, nkv, d, 10);
        assert!(matches!(
            s.write(0, 10, &too_long, &too_long),
            Err(KvError::ChunkTooLong { .. })
        ));
    }

    #[test]
    fn f16_store_rounds_values() {
        let mut s = KvStore::<half::f16>::new(
            1,
            2,
            &[LayerSpec {
                capacity: 4,
                ring: false,
            }],
        );
        s.write(0, 0, &[1.0, 0.1], &[2.0, -0.5]).unwrap();
        let [a, _] = two(s.segments(0, 0, 0, 1));
        let a = a.unwrap();
        assert_eq!(a.k[0].to_f32(), 1.0);
        assert!((a.k[1].to_f32() - 0.1).abs() < 1e-3);
        assert_eq!(a.v[1].to_f32(), -0.5);
    }
}

#[cfg(test)]
mod compact_tests {
    use super::*;

    /// A global layer of `len` tokens whose key rows are `[pos*10 + h, ...]`.
    fn filled(nkv: usize, d: usize, cap: usize, len: usize) -> KvStore<f32> {
        let mut s = KvStore::<f32>::with_block(
            nkv,
            d,
            &[LayerSpec {
                capacity: cap,
                ring: false,
            }],
            16,
        );
        let kv: Vec<f32> = (0..len * nkv * d)
            .map(|i| ((i / (nkv * d)) * 10 + (i / d) % nkv) as f32)
            .collect();
        s.write(0, 0, &kv, &kv).unwrap();
        s.set_len(len);
        s
    }

    fn rows(seg: &KvSegment<'_, f32>, d: usize) -> Vec<f32> {
        seg.k.chunks(d).map(|r| r[0]).collect()
    }

    #[test]
    fn compaction_keeps_chosen_slots_with_positions_and_frees_memory() {
        let (nkv, d) = (2, 4);
        let mut s = filled(nkv, d, 100, 20);
        // 20 written tokens hold two blocks of 16 slots, not the capacity of 100.
        assert_eq!(s.nbytes(), 2 * nkv * 32 * d * 4);
        s.compact(0, &[vec![7, 2, 19], vec![0, 5, 6]], 3).unwrap();
        // 3 kept + 3 headroom slots per head, K and V, f32
        assert_eq!(s.nbytes(), 2 * nkv * 6 * d * 4);
        assert_eq!(s.held(0, 0), 3);
        assert_eq!(s.slot_positions(0, 0), vec![2, 7, 19]);
        let [a, b] = two(s.segments(0, 1, 0, 20));
        assert!(b.is_none());
        let a = a.unwrap();
        assert_eq!(rows(&a, d), vec![1.0, 51.0, 61.0]);
        assert!(matches!(a.pos, KvPositions::List(&[0, 5, 6])));
        // Positions capacity: 20 written + 3 free slots.
        assert_eq!(s.capacity(), 23);
        // Shrinking to what is held + 1 frees two slots per head; never grows.
        s.shrink(0, 1).unwrap();
        assert_eq!(s.nbytes(), 2 * nkv * 4 * d * 4);
        s.shrink(0, 3).unwrap();
        assert_eq!(s.nbytes(), 2 * nkv * 4 * d * 4);
        assert_eq!(s.slot_positions(0, 1), vec![0, 5, 6]);
        s.compact(0, &[vec![0, 1, 2], vec![0, 1, 2]], 3).unwrap();
        // Append after compaction keeps ascending positions.
        let kv = vec![200.0f32; nkv * d];
        s.write(0, 20, &kv, &kv).unwrap();
        s.set_len(21);
        assert_eq!(s.slot_positions(0, 0), vec![2, 7, 19, 20]);
        // A sub-range reads only the kept positions inside it.
        let [a, _] = two(s.segments(0, 0, 5, 20));
        assert!(matches!(a.unwrap().pos, KvPositions::List(&[7, 19])));
        // Eviction reuses the slot (the last one moves in).
        s.evict_slot(0, 0, 0).unwrap();
        assert_eq!(s.slot_positions(0, 0), vec![20, 7, 19]);
        let [a, _] = two(s.segments(0, 0, 0, 21));
        assert_eq!(rows(&a.unwrap(), d), vec![200.0, 70.0, 190.0]);
        assert!(matches!(
            s.evict_slot(0, 0, 3),
            Err(KvError::BadSlot { slot: 3, .. })
        ));
        assert!(matches!(
            s.compact(0, &[vec![0]], 0),
            Err(KvError::KeepHeads { got: 1, .. })
        ));
        // Truncate drops the positions past the new length.
        s.truncate(20);
        assert_eq!(s.slot_positions(0, 0), vec![7, 19]);
        // The store refuses to overflow the shrunk allocation.
        let kv = vec![0.0f32; 5 * nkv * d];
        assert!(matches!(
            s.write(0, 20, &kv, &kv),
            Err(KvError::Full { .. })
        ));
    }

    #[test]
    fn explicit_positions_compact_the_layer_and_rings_drop_old_slots() {
        let (nkv, d) = (1, 2);
        let mut s = KvStore::<f32>::new(
            nkv,
            d,
            &[
                LayerSpec {
                    capacity: 6,
                    ring: true,
                },
                LayerSpec {
                    capacity: 64,
                    ring: false,
                },
            ],
        );
        let kv = |ps: &[u32]| -> Vec<f32> { ps.iter().flat_map(|&p| [p as f32, 0.0]).collect() };
        // Contiguous positions take the plain path.
        s.write_at(1, &[0, 1, 2], &kv(&[0, 1, 2]), &kv(&[0, 1, 2]))
            .unwrap();
        assert!(!s.layer(1).is_compact());
        s.write_at(1, &[5, 9], &kv(&[5, 9]), &kv(&[5, 9])).unwrap();
        assert!(s.layer(1).is_compact());
        assert_eq!(s.slot_positions(1, 0), vec![0, 1, 2, 5, 9]);
        assert!(matches!(
            s.write_at(1, &[12, 11], &kv(&[12, 11]), &kv(&[12, 11])),
            Err(KvError::BadPositions { .. })
        ));
        // Ring of 6: sparse positions, older ones dropped once it is full.
        s.write_at(0, &[0, 3, 4], &kv(&[0, 3, 4]), &kv(&[0, 3, 4]))
            .unwrap();
        s.write_at(0, &[7, 8, 9], &kv(&[7, 8, 9]), &kv(&[7, 8, 9]))
            .unwrap();
        s.write_at(0, &[10, 11], &kv(&[10, 11]), &kv(&[10, 11]))
            .unwrap();
        // Room for 2: keep positions >= 10 - (6 - 2) = 6.
        assert_eq!(s.slot_positions(0, 0), vec![7, 8, 9, 10, 11]);
        let [a, _] = two(s.segments(0, 0, 8, 12));
        let a = a.unwrap();
        assert_eq!(rows(&a, d), vec![8.0, 9.0, 10.0, 11.0]);
    }
}
