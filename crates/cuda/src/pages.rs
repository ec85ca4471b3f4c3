//! KV memory on demand for the decoder's slot layout.
//!
//! The decoder's kernels address each layer's K and V cache as `[slots, kv_heads, capacity,
//! head_dim]`. With pages on, that array is a reservation of virtual addresses only: each
//! `(slot, head)` run of `capacity` rows is a whole number of physical pages (the driver's
//! allocation granularity, 2 MiB on the H200), and a run is backed only as far as its slot's
//! sequence has grown. The kernels are unchanged, so decode reads the same addresses as with
//! the cache allocated whole, and costs the same; what changes is that a short sequence holds
//! the pages of its length, not of `capacity`.
//!
//! A slot that holds no sequence (free, or preempted) maps one shared *scratch* page at the
//! start of each of its runs: the serving scheduler feeds free slots dummy tokens (every slot
//! steps in a decode step), whose keys land there and are never read for anything kept.
//!
//! [`PagePool`] is the bookkeeping: which physical pages each slot maps, the free list, the
//! limit. It drives a [`PageBackend`]: the CUDA driver's virtual memory calls in a `cuda`
//! build (`model.rs`), a recording fake in the tests here.

use std::collections::HashMap;

use slowfast_kv::paged::{block_hash, root_hash, BlockId, Found, PrefixCache, PrefixStats};

use crate::error::CudaError;

/// Rows past a sequence's length that stay mapped: the attention kernels load whole tiles
/// (at most 128 rows) and zero-fill the rows past the end; keeping a tile's worth mapped
/// past it means no load is ever issued against an unmapped address.
pub const PAGE_MARGIN: usize = 256;

/// Rows below the first one an attention path asks for that its tiles may still load (the
/// kernels' largest tile): kept mapped under a slot's lowest read row.
pub const READ_MARGIN: usize = 128;

/// The lowest row of a sequence of `len` tokens that an attention path may read again as it
/// decodes, less [`READ_MARGIN`]: on a sliding-window layer (`windows[l]` = Some(w)) its
/// window's first row for the next token, on a global layer `global_from` (the policy's: 0
/// unless it compacted the prompt and reads in place only from there).
pub fn lowest_read_row(windows: &[Option<usize>], global_from: usize, len: usize) -> usize {
    windows
        .iter()
        .map(|w| w.map_or(global_from, |w| (len + 1).saturating_sub(w)))
        .min()
        .unwrap_or(0)
        .saturating_sub(READ_MARGIN)
}

/// The shape of paged KV: how many tokens a page holds per `(slot, head)` run, and how many
/// runs a slot has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    /// Bytes of one physical page.
    pub page_bytes: usize,
    /// Tokens a page holds in one run (`page_bytes / (head_dim * elem_bytes)`).
    pub page_tokens: usize,
    /// Runs of one slot: cache buffers (layers x K/V) x kv heads.
    pub runs_per_slot: usize,
    /// Runs of one slot in one buffer (the kv heads).
    pub heads: usize,
    /// Cache buffers (layers x 2).
    pub buffers: usize,
}

impl PageGeometry {
    /// Geometry for pages of `page_bytes` over rows of `head_dim` elements of `elem_bytes`,
    /// `kv_heads` heads and `buffers` cache buffers. Errors when a row does not divide a page.
    pub fn new(
        page_bytes: usize,
        head_dim: usize,
        elem_bytes: usize,
        kv_heads: usize,
        buffers: usize,
    ) -> Result<Self, CudaError> {
        let row = head_dim * elem_bytes;
        if row == 0 || page_bytes == 0 || page_bytes % row != 0 || kv_heads == 0 || buffers == 0 {
            return Err(CudaError::bad(
                "KV pages",
                format!("a page of {page_bytes} bytes over rows of {row} bytes, {kv_heads} heads, {buffers} buffers"),
            ));
        }
        Ok(PageGeometry {
            page_bytes,
            page_tokens: page_bytes / row,
            runs_per_slot: buffers * kv_heads,
            heads: kv_heads,
            buffers,
        })
    }

    /// `capacity` rounded up to whole pages: the run length (rows) of the paged layout.
    pub fn padded_capacity(&self, capacity: usize) -> usize {
        capacity.div_ceil(self.page_tokens) * self.page_tokens
    }

    /// Pages one run maps to hold `tokens` tokens (with [`PAGE_MARGIN`] rows past them),
    /// at most the run's `capacity` (padded).
    pub fn pages_for(&self, tokens: usize, capacity: usize) -> usize {
        if tokens == 0 {
            return 0;
        }
        (tokens + PAGE_MARGIN)
            .min(self.padded_capacity(capacity))
            .div_ceil(self.page_tokens)
    }

    /// Bytes a slot holding `tokens` tokens maps (every run).
    pub fn bytes_for(&self, tokens: usize, capacity: usize) -> usize {
        self.pages_for(tokens, capacity) * self.page_bytes * self.runs_per_slot
    }

    /// Byte offset of `(slot, head)`'s run in a buffer whose runs are `capacity` rows
    /// (padded).
    pub fn run_offset(&self, capacity: usize, slot: usize, head: usize) -> usize {
        let run_bytes = self.padded_capacity(capacity) / self.page_tokens * self.page_bytes;
        (slot * self.heads + head) * run_bytes
    }
}

/// What [`PagePool`] needs from the memory system: physical pages, and mapping one page at a
/// virtual address (one page long) and unmapping it.
pub trait PageBackend {
    type Handle: Copy + Eq + std::hash::Hash + std::fmt::Debug;
    /// A new physical page.
    fn create(&mut self) -> Result<Self::Handle, CudaError>;
    /// Maps page `h` at `va` (not yet accessible: `grant` follows).
    fn map(&mut self, va: u64, h: Self::Handle) -> Result<(), CudaError>;
    /// Makes the mapped pages of `[va, va + bytes)` readable and writable by the device (one
    /// call for a run of pages: the driver's access call costs about as much as a map).
    fn grant(&mut self, va: u64, bytes: usize) -> Result<(), CudaError>;
    /// Unmaps the page at `va`.
    fn unmap(&mut self, va: u64) -> Result<(), CudaError>;
    /// Gives a physical page back to the system (it is mapped nowhere).
    fn release(&mut self, h: Self::Handle);
}

/// One slot's pages: `owned[(p - dropped) * runs + r]` is page `p` of run `r`.
#[derive(Debug)]
struct SlotPages<H> {
    owned: Vec<H>,
    /// Leading page steps given back while the slot holds its sequence: no attention path
    /// reads their rows again ([`PagePool::drop_below`]); nothing is mapped there.
    dropped: usize,
    /// The scratch page is mapped at page 0 of every run (the slot holds no sequence).
    scratch: bool,
    /// Leading page steps mapped from the prefix cache (read only).
    shared: usize,
}

/// Whole prompt blocks (`block_pages` page steps each) of every run, named by the hash chain
/// of their tokens ([`PrefixCache`]): a later prompt that starts with the same blocks maps the
/// same physical pages instead of prefilling them.
struct PrefixIndex<H> {
    cache: PrefixCache,
    /// A cached block's pages, `[p * runs + r]` for its page steps p.
    pages: HashMap<BlockId, Vec<H>>,
    block_pages: usize,
}

/// The pages of every slot of the decoder's KV, within a limit. A page is held by the slots
/// that map it and by the prefix cache; it goes back to the free list when none holds it.
pub struct PagePool<B: PageBackend> {
    backend: B,
    geo: PageGeometry,
    /// Run length (rows), a whole number of pages.
    capacity: usize,
    /// Base virtual address of each cache buffer.
    bases: Vec<u64>,
    slots: Vec<SlotPages<B::Handle>>,
    free: Vec<B::Handle>,
    /// Physical pages created (owned by slots or free), the scratch page not counted.
    created: usize,
    /// At most this many pages are created.
    limit: usize,
    scratch: B::Handle,
    /// Per page: how many slots map it (absent: none).
    maps: HashMap<B::Handle, u32>,
    /// Pages the prefix cache holds.
    held: HashMap<B::Handle, u32>,
    prefix: Option<PrefixIndex<B::Handle>>,
}

impl<B: PageBackend> PagePool<B> {
    /// A pool over `bases.len()` buffers of `num_slots` slots of `capacity` rows (padded to
    /// whole pages) holding at most `limit_bytes` of pages; every slot starts on the scratch
    /// page.
    pub fn new(
        mut backend: B,
        geo: PageGeometry,
        bases: Vec<u64>,
        num_slots: usize,
        capacity: usize,
        limit_bytes: usize,
    ) -> Result<Self, CudaError> {
        if bases.len() != geo.buffers {
            return Err(CudaError::bad(
                "KV pages",
                format!(
                    "{} buffer addresses for {} buffers",
                    bases.len(),
                    geo.buffers
                ),
            ));
        }
        let scratch = backend.create()?;
        let mut pool = PagePool {
            backend,
            geo,
            capacity: geo.padded_capacity(capacity),
            bases,
            slots: (0..num_slots)
                .map(|_| SlotPages {
                    owned: Vec::new(),
                    dropped: 0,
                    scratch: false,
                    shared: 0,
                })
                .collect(),
            free: Vec::new(),
            created: 0,
            limit: limit_bytes / geo.page_bytes,
            scratch,
            maps: HashMap::new(),
            held: HashMap::new(),
            prefix: None,
        };
        for s in 0..num_slots {
            pool.map_scratch(s)?;
        }
        Ok(pool)
    }

    pub fn geometry(&self) -> &PageGeometry {
        &self.geo
    }

    /// Rows of each run (the padded capacity).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Virtual address of page `p` of run `r` of `slot`.
    fn va(&self, slot: usize, r: usize, p: usize) -> u64 {
        let (b, h) = (r / self.geo.heads, r % self.geo.heads);
        self.bases[b]
            + (self.geo.run_offset(self.capacity, slot, h) + p * self.geo.page_bytes) as u64
    }

    fn map_scratch(&mut self, slot: usize) -> Result<(), CudaError> {
        for r in 0..self.geo.runs_per_slot {
            let va = self.va(slot, r, 0);
            self.backend.map(va, self.scratch)?;
            self.backend.grant(va, self.geo.page_bytes)?;
        }
        self.slots[slot].scratch = true;
        Ok(())
    }

    fn unmap_scratch(&mut self, slot: usize) -> Result<(), CudaError> {
        for r in 0..self.geo.runs_per_slot {
            let va = self.va(slot, r, 0);
            self.backend.unmap(va)?;
        }
        self.slots[slot].scratch = false;
        Ok(())
    }

    /// Whether `slot` holds no pages of its own (only the scratch page). Unmapping it (the
    /// first `ensure`) needs the device idle; the caller synchronises first.
    pub fn on_scratch(&self, slot: usize) -> bool {
        self.slots[slot].scratch
    }

    /// Page steps each run of `slot` covers: those it maps and the leading ones it dropped.
    pub fn pages(&self, slot: usize) -> usize {
        let s = &self.slots[slot];
        s.dropped + s.owned.len() / self.geo.runs_per_slot
    }

    /// Leading page steps of `slot` given back by [`PagePool::drop_below`].
    pub fn dropped(&self, slot: usize) -> usize {
        self.slots[slot].dropped
    }

    /// Tokens `slot` may write without another `ensure` (scratch: the dummy tokens of a
    /// free slot, up to one page).
    pub fn room(&self, slot: usize) -> usize {
        let s = &self.slots[slot];
        if s.scratch {
            self.geo.page_tokens - PAGE_MARGIN.min(self.geo.page_tokens)
        } else {
            (self.pages(slot) * self.geo.page_tokens).saturating_sub(PAGE_MARGIN)
        }
    }

    /// Bytes of pages `slot` maps, a page shared by n slots counted 1/n in each (so the slots'
    /// bytes add up to the pages they map).
    pub fn slot_bytes(&self, slot: usize) -> usize {
        let pb = self.geo.page_bytes;
        self.slots[slot]
            .owned
            .iter()
            .map(|h| pb.div_ceil(self.maps.get(h).copied().unwrap_or(1).max(1) as usize))
            .sum()
    }

    /// Bytes of pages held by slots or by the prefix cache.
    pub fn bytes_in_use(&self) -> usize {
        (self.created - self.free.len()) * self.geo.page_bytes
    }

    /// Bytes of pages only the prefix cache holds (no slot maps them): evicted when a slot
    /// needs the memory.
    pub fn cached_only_bytes(&self) -> usize {
        self.held
            .keys()
            .filter(|h| !self.maps.contains_key(h))
            .count()
            * self.geo.page_bytes
    }

    /// Tokens at the start of `slot` mapped from the prefix cache (read only).
    pub fn shared_tokens(&self, slot: usize) -> usize {
        self.slots[slot].shared * self.geo.page_tokens
    }

    /// Takes a hold on page `h` for a slot mapping.
    fn map_ref(&mut self, h: B::Handle) {
        *self.maps.entry(h).or_insert(0) += 1;
    }

    /// Drops a slot mapping's hold on `h`; a page nobody holds goes to the free list.
    fn unmap_ref(&mut self, h: B::Handle) {
        let n = self.maps.get_mut(&h).expect("a mapped page");
        *n -= 1;
        if *n == 0 {
            self.maps.remove(&h);
            if !self.held.contains_key(&h) {
                self.free.push(h);
            }
        }
    }

    /// Drops the prefix cache's hold on `h`.
    fn unhold(&mut self, h: B::Handle) {
        let n = self.held.get_mut(&h).expect("a cached page");
        *n -= 1;
        if *n == 0 {
            self.held.remove(&h);
            if !self.maps.contains_key(&h) {
                self.free.push(h);
            }
        }
    }

    /// Evicts the prefix cache's least recently used block no lookup holds; false when there
    /// is none.
    fn evict_block(&mut self) -> bool {
        let Some(px) = self.prefix.as_mut() else {
            return false;
        };
        let Some(id) = px.cache.evict_one() else {
            return false;
        };
        let pages = px.pages.remove(&id).expect("a cached block has pages");
        for h in pages {
            self.unhold(h);
        }
        true
    }

    /// Pages that can be had now: free, or not yet created within the limit.
    fn available(&self) -> usize {
        self.free.len() + (self.limit - self.created.min(self.limit))
    }

    /// Turns the prefix cache on: whole blocks of `block_tokens` tokens (a multiple of a
    /// page's tokens), at most `bytes` of them cached.
    pub fn enable_prefix(&mut self, block_tokens: usize, bytes: usize) -> Result<(), CudaError> {
        let pt = self.geo.page_tokens;
        if block_tokens == 0 || block_tokens % pt != 0 {
            return Err(CudaError::bad(
                "KV pages",
                format!("prefix blocks of {block_tokens} tokens: not whole pages of {pt}"),
            ));
        }
        let block_pages = block_tokens / pt;
        let n_blocks = bytes / (block_pages * self.geo.runs_per_slot * self.geo.page_bytes);
        if n_blocks == 0 {
            return Err(CudaError::bad(
                "KV pages",
                format!("a prefix cache of {bytes} bytes holds no block of {block_tokens} tokens"),
            ));
        }
        self.prefix = Some(PrefixIndex {
            cache: PrefixCache::new(n_blocks, block_tokens),
            pages: HashMap::new(),
            block_pages,
        });
        Ok(())
    }

    /// Tokens of a prefix-cache block (None: the cache is off).
    pub fn prefix_block(&self) -> Option<usize> {
        self.prefix.as_ref().map(|p| p.cache.block_size())
    }

    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(|p| p.cache.stats())
    }

    /// Caches the first `blocks` whole blocks of `slot`'s sequence, whose tokens begin
    /// `tokens`: each block not cached yet gets a hold on the slot's pages. Stops early when
    /// the cache is full of blocks in use.
    pub fn remember(&mut self, slot: usize, tokens: &[u32], blocks: usize) {
        let runs = self.geo.runs_per_slot;
        let Some(px) = self.prefix.as_ref() else {
            return;
        };
        if self.slots[slot].dropped > 0 {
            return; // its first blocks are no longer mapped
        }
        let (bt, bp) = (px.cache.block_size(), px.block_pages);
        let blocks = blocks.min(tokens.len() / bt).min(self.pages(slot) / bp);
        let mut parent = root_hash(0);
        for j in 0..blocks {
            let toks = &tokens[j * bt..(j + 1) * bt];
            if self.prefix.as_ref().expect("on").cache.pool().n_free() == 0 && !self.evict_block() {
                return;
            }
            let px = self.prefix.as_mut().expect("on");
            if let Some(id) = px.cache.insert(parent, j as u32, toks) {
                let pages = self.slots[slot].owned[j * bp * runs..(j + 1) * bp * runs].to_vec();
                for &h in &pages {
                    *self.held.entry(h).or_insert(0) += 1;
                }
                let px = self.prefix.as_mut().expect("on");
                px.pages.insert(id, pages);
                px.cache.unpin(Found { blocks: vec![id] });
            }
            parent = block_hash(parent, toks);
        }
    }

    /// Maps into the empty `slot` (on the scratch page; the device idle) the pages of the
    /// longest cached prefix of `tokens`, at most `max_blocks` blocks; returns its tokens.
    pub fn adopt(
        &mut self,
        slot: usize,
        tokens: &[u32],
        max_blocks: usize,
    ) -> Result<usize, CudaError> {
        let runs = self.geo.runs_per_slot;
        let Some(px) = self.prefix.as_mut() else {
            return Ok(0);
        };
        if !self.slots[slot].scratch {
            return Err(CudaError::bad(
                "KV pages",
                format!("slot {slot} must be empty to take a cached prefix"),
            ));
        }
        let found = px.cache.lookup(0, tokens, max_blocks);
        let n = found.blocks.len();
        let (bt, bp) = (px.cache.block_size(), px.block_pages);
        let owned: Vec<B::Handle> = found
            .blocks
            .iter()
            .flat_map(|id| px.pages[id].iter().copied())
            .collect();
        px.cache.unpin(found);
        if n == 0 {
            return Ok(0);
        }
        self.unmap_scratch(slot)?;
        for &h in &owned {
            self.map_ref(h);
        }
        self.slots[slot].owned = owned;
        self.slots[slot].shared = n * bp;
        for r in 0..runs {
            for p in 0..n * bp {
                let h = self.slots[slot].owned[p * runs + r];
                let va = self.va(slot, r, p);
                self.backend.map(va, h)?;
            }
            let va = self.va(slot, r, 0);
            self.backend.grant(va, n * bp * self.geo.page_bytes)?;
        }
        Ok(n * bt)
    }

    /// Bytes of pages the pool may hold.
    pub fn limit_bytes(&self) -> usize {
        self.limit * self.geo.page_bytes
    }

    /// Sets the bytes of pages the pool may hold (at least those the slots hold now); free
    /// pages past it are given back.
    pub fn set_limit(&mut self, bytes: usize) -> Result<(), CudaError> {
        let slots_hold = self.bytes_in_use() - self.cached_only_bytes();
        if bytes < slots_hold {
            return Err(CudaError::bad(
                "KV pages",
                format!(
                    "a limit of {} MiB below the {} MiB the slots hold",
                    bytes >> 20,
                    slots_hold >> 20
                ),
            ));
        }
        self.limit = bytes / self.geo.page_bytes;
        while self.created > self.limit {
            match self.free.pop() {
                Some(h) => {
                    self.backend.release(h);
                    self.created -= 1;
                }
                None if self.evict_block() => {}
                None => break, // cached pages the slots map: given back as they leave
            }
        }
        Ok(())
    }

    /// Pages created and not owned by a slot.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Maps pages so that `slot` holds `tokens` tokens (and [`PAGE_MARGIN`] rows past them);
    /// the first call on a slot on the scratch page unmaps it. Nothing changes when the pages
    /// do not fit in the limit.
    pub fn ensure(&mut self, slot: usize, tokens: usize) -> Result<(), CudaError> {
        let runs = self.geo.runs_per_slot;
        let want = self.geo.pages_for(tokens, self.capacity);
        let have = self.pages(slot);
        if want <= have {
            return Ok(());
        }
        let need = (want - have) * runs;
        while need > self.available() && self.evict_block() {}
        let avail = self.available();
        if need > avail {
            return Err(CudaError::bad(
                "KV pages",
                format!(
                    "slot {slot} needs {} MiB more for {tokens} tokens; {} MiB of the {} MiB pool are free",
                    (need * self.geo.page_bytes) >> 20,
                    (avail * self.geo.page_bytes) >> 20,
                    self.limit_bytes() >> 20
                ),
            ));
        }
        if self.slots[slot].scratch {
            self.unmap_scratch(slot)?;
        }
        // Pages first (all or none), then each run's new pages mapped and granted at once.
        let mut fresh = Vec::with_capacity(need);
        while fresh.len() < need {
            match self.free.pop() {
                Some(h) => fresh.push(h),
                None => match self.backend.create() {
                    Ok(h) => {
                        self.created += 1;
                        fresh.push(h);
                    }
                    Err(e) => {
                        self.free.append(&mut fresh);
                        return Err(e);
                    }
                },
            }
        }
        let first = self.slots[slot].owned.len();
        for &h in &fresh {
            self.map_ref(h);
        }
        self.slots[slot].owned.extend_from_slice(&fresh);
        for r in 0..runs {
            for p in have..want {
                let va = self.va(slot, r, p);
                let h = self.slots[slot].owned[first + (p - have) * runs + r];
                self.backend.map(va, h)?;
            }
            let va = self.va(slot, r, have);
            self.backend
                .grant(va, (want - have) * self.geo.page_bytes)?;
        }
        Ok(())
    }

    /// Unmaps every page of `slot` into the free list and puts it back on the scratch page.
    /// The device must be idle (the caller synchronises).
    pub fn release(&mut self, slot: usize) -> Result<(), CudaError> {
        if self.slots[slot].scratch {
            return Ok(());
        }
        let runs = self.geo.runs_per_slot;
        let owned = std::mem::take(&mut self.slots[slot].owned);
        let dropped = std::mem::take(&mut self.slots[slot].dropped);
        self.slots[slot].shared = 0;
        for (i, &h) in owned.iter().enumerate() {
            let va = self.va(slot, i % runs, dropped + i / runs);
            self.backend.unmap(va)?;
            self.unmap_ref(h);
        }
        self.map_scratch(slot)
    }

    /// Gives back the pages of `slot` wholly below row `tokens` in every run (the attention
    /// paths read nothing there again: SnapKV's prompt after its compaction, the rows a
    /// sliding window left), always keeping the last page the slot maps. Returns the page
    /// steps dropped now. A page the prefix cache or another slot holds stays with them. The
    /// device must be idle (the caller synchronises); the addresses stay reserved, so a
    /// CUDA graph over them stays valid.
    pub fn drop_below(&mut self, slot: usize, tokens: usize) -> Result<usize, CudaError> {
        if self.slots[slot].scratch {
            return Ok(0);
        }
        let runs = self.geo.runs_per_slot;
        let have = self.pages(slot);
        let from = self.slots[slot].dropped;
        let to = (tokens / self.geo.page_tokens).min(have.saturating_sub(1));
        if to <= from {
            return Ok(0);
        }
        let gone: Vec<B::Handle> = self.slots[slot].owned.drain(..(to - from) * runs).collect();
        for (i, &h) in gone.iter().enumerate() {
            let va = self.va(slot, i % runs, from + i / runs);
            self.backend.unmap(va)?;
            self.unmap_ref(h);
        }
        self.slots[slot].dropped = to;
        Ok(to - from)
    }

    /// Gives the free pages back to the system (after preemptions emptied many slots, when
    /// another allocation needs the memory).
    pub fn trim(&mut self) {
        for h in self.free.drain(..) {
            self.backend.release(h);
            self.created -= 1;
        }
    }
}

impl<B: PageBackend> Drop for PagePool<B> {
    fn drop(&mut self) {
        let runs = self.geo.runs_per_slot;
        for s in 0..self.slots.len() {
            let owned = std::mem::take(&mut self.slots[s].owned);
            let dropped = self.slots[s].dropped;
            for i in 0..owned.len() {
                let va = self.va(s, i % runs, dropped + i / runs);
                let _ = self.backend.unmap(va);
            }
            if self.slots[s].scratch {
                for r in 0..runs {
                    let va = self.va(s, r, 0);
                    let _ = self.backend.unmap(va);
                }
            }
        }
        // Every page once: mapped by slots, held by the cache, or free.
        let mut all: Vec<B::Handle> = self.maps.keys().copied().collect();
        all.extend(self.held.keys().filter(|h| !self.maps.contains_key(h)));
        all.append(&mut self.free);
        for h in all {
            self.backend.release(h);
        }
        self.backend.release(self.scratch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};
    use std::sync::{Arc, Mutex};

    /// Records what is mapped where and which pages exist; refuses double maps, unmaps of
    /// nothing and releases of mapped or unknown pages.
    #[derive(Default)]
    struct Book {
        next: u32,
        live: HashSet<u32>,
        at: HashMap<u64, u32>,
    }

    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<Book>>);

    impl PageBackend for Fake {
        type Handle = u32;
        fn create(&mut self) -> Result<u32, CudaError> {
            let mut b = self.0.lock().unwrap();
            b.next += 1;
            let h = b.next;
            b.live.insert(h);
            Ok(h)
        }
        fn map(&mut self, va: u64, h: u32) -> Result<(), CudaError> {
            let mut b = self.0.lock().unwrap();
            assert!(b.live.contains(&h), "map of unknown page {h}");
            assert!(b.at.insert(va, h).is_none(), "double map at {va:#x}");
            Ok(())
        }
        fn grant(&mut self, va: u64, bytes: usize) -> Result<(), CudaError> {
            let b = self.0.lock().unwrap();
            for p in (va..va + bytes as u64).step_by(PAGE) {
                assert!(
                    b.at.contains_key(&p),
                    "grant over an unmapped page at {p:#x}"
                );
            }
            Ok(())
        }
        fn unmap(&mut self, va: u64) -> Result<(), CudaError> {
            let mut b = self.0.lock().unwrap();
            assert!(b.at.remove(&va).is_some(), "unmap of nothing at {va:#x}");
            Ok(())
        }
        fn release(&mut self, h: u32) {
            let mut b = self.0.lock().unwrap();
            assert!(b.live.remove(&h), "release of unknown page {h}");
            assert!(
                !b.at.values().any(|&m| m == h),
                "release of page {h} still mapped"
            );
        }
    }

    const PAGE: usize = 4096;

    /// Draws in `0..n` from a xorshift generator seeded with `x`.
    fn xorshift(mut x: u64) -> impl FnMut(usize) -> usize {
        move |n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        }
    }

    fn geo() -> PageGeometry {
        // Rows of 64 bf16 (128 bytes): 32 tokens a page; 2 heads, 3 buffers.
        PageGeometry::new(PAGE, 64, 2, 2, 3).unwrap()
    }

    #[test]
    fn geometry_pads_capacity_and_counts_pages_with_the_margin() {
        let g = geo();
        assert_eq!(g.page_tokens, 32);
        assert_eq!(g.runs_per_slot, 6);
        assert_eq!(g.padded_capacity(1000), 1024);
        assert_eq!(g.pages_for(0, 1000), 0);
        // 1 token + 256 margin = 257 rows = 9 pages of 32.
        assert_eq!(g.pages_for(1, 1000), 9);
        // Never past the padded capacity.
        assert_eq!(g.pages_for(1000, 1000), 32);
        assert_eq!(g.bytes_for(1, 1000), 9 * PAGE * 6);
        assert_eq!(g.run_offset(1000, 1, 1), 3 * 32 * PAGE);
        assert!(PageGeometry::new(PAGE, 48, 3, 1, 1).is_err()); // 144-byte rows
        let h200 = PageGeometry::new(2 << 20, 128, 2, 8, 72).unwrap();
        assert_eq!(h200.page_tokens, 8192);
        assert_eq!(h200.padded_capacity(131072), 131072);
    }

    /// Random ensure / release / drop_below / trim on 4 slots against a plain model of what
    /// each slot should hold: no page is mapped twice, unmapped twice or lost; every address a
    /// slot maps lies in its own runs, from its first kept page on; dropping the pool
    /// releases everything.
    #[test]
    fn random_traffic_never_leaks_double_maps_or_crosses_slots() {
        let book = Fake::default();
        let g = geo();
        let (slots, cap) = (4, 1000);
        let bases = vec![0x1000_0000u64, 0x2000_0000, 0x3000_0000];
        let limit = 160 * PAGE;
        let mut pool = PagePool::new(book.clone(), g, bases.clone(), slots, cap, limit).unwrap();
        let run_bytes = (pool.capacity() / g.page_tokens * PAGE) as u64;
        let mut model = vec![0usize; slots]; // tokens ensured per slot (0: scratch)
        let mut kept = vec![0usize; slots]; // first page step each slot still maps
        let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15u64);
        let (mut refused, mut dropped) = (0, 0);
        for _ in 0..3000 {
            let s = rnd(slots);
            match rnd(11) {
                0..=5 => {
                    let t = model[s] + 1 + rnd(200);
                    let want = g.pages_for(t, cap) * g.runs_per_slot;
                    let held: usize = (0..slots).map(|i| pool.pages(i) * g.runs_per_slot).sum();
                    let fits = held - pool.pages(s) * g.runs_per_slot + want <= limit / PAGE;
                    match pool.ensure(s, t) {
                        Ok(()) => {
                            assert!(fits || want <= pool.pages(s) * g.runs_per_slot);
                            model[s] = model[s].max(t);
                        }
                        Err(e) => {
                            assert!(!fits, "refused although it fits: {e}");
                            assert!(e.to_string().contains(&format!("slot {s} needs")));
                            refused += 1;
                        }
                    }
                }
                6..=8 => {
                    pool.release(s).unwrap();
                    model[s] = 0;
                    kept[s] = 0;
                }
                9 => {
                    let below = rnd(model[s] + 1);
                    let free_before = pool.free_pages();
                    let n = pool.drop_below(s, below).unwrap();
                    let want = if model[s] == 0 {
                        0
                    } else {
                        (below / g.page_tokens)
                            .min(g.pages_for(model[s], cap) - 1)
                            .max(kept[s])
                    };
                    assert_eq!(n, want - kept[s], "drop_below({s}, {below})");
                    assert_eq!(pool.free_pages(), free_before + n * g.runs_per_slot);
                    kept[s] = want;
                    assert_eq!(pool.dropped(s), want);
                    dropped += n;
                }
                _ => pool.trim(),
            }
            // What each slot maps, from the book: its pages, in its runs only.
            let b = book.0.lock().unwrap();
            for (i, &m) in model.iter().enumerate() {
                let want = (g.pages_for(m, cap).max(1) - kept[i]) * g.runs_per_slot;
                let mine: Vec<u64> =
                    b.at.keys()
                        .filter(|&&va| {
                            bases.iter().any(|&base| {
                                va >= base
                                    && (va - base) / run_bytes / g.heads as u64 == i as u64
                                    && va < base + run_bytes * (slots * g.heads) as u64
                            })
                        })
                        .copied()
                        .collect();
                assert_eq!(mine.len(), want, "slot {i} holding {m} tokens");
                for va in mine {
                    let base = bases.iter().rev().find(|&&b| va >= b).unwrap();
                    let page = (va - base) % run_bytes / PAGE as u64;
                    assert!(page >= kept[i] as u64, "slot {i} maps dropped page {page}");
                }
                assert_eq!(pool.on_scratch(i), m == 0);
                assert!(m == 0 || pool.room(i) >= m);
            }
            let owned: usize = (0..slots).map(|i| pool.slot_bytes(i)).sum();
            assert_eq!(owned, pool.bytes_in_use());
            assert!(pool.bytes_in_use() <= limit);
            // Live pages: owned + free + scratch.
            assert_eq!(b.live.len(), owned / PAGE + pool.free_pages() + 1);
        }
        assert!(refused > 0, "the limit was never reached");
        assert!(dropped > 0, "no page was ever dropped");
        drop(pool);
        let b = book.0.lock().unwrap();
        assert!(b.at.is_empty() && b.live.is_empty(), "pages leaked");
    }

    /// The prefix cache over random prompts from a 2-letter alphabet of blocks (so prompts
    /// share prefixes), as the scheduler drives it: an empty slot adopts the longest cached
    /// prefix, maps the rest, caches its whole blocks; slots are released at random. Checked
    /// each step: a slot maps exactly the pages of its length, at its own addresses; a page a
    /// prefill writes is mapped by that slot alone and not cached; every whole page of every
    /// slot holds the KV of its own tokens (a wrong share would show another prompt's); no
    /// page is lost; the slots' bytes add up to the pages they map; a full cache evicts;
    /// dropping the pool releases everything.
    #[test]
    fn shared_prefixes_hold_their_own_tokens_and_never_leak() {
        let book = Fake::default();
        let g = geo(); // 32 tokens a page, 6 runs
        let (slots, cap, bt) = (3, 1000, 64); // blocks of 2 pages
        let bases = vec![0x1000_0000u64, 0x2000_0000, 0x3000_0000];
        let mut pool = PagePool::new(book.clone(), g, bases, slots, cap, 400 * PAGE).unwrap();
        pool.enable_prefix(bt, 120 * PAGE).unwrap(); // 10 blocks of 12 pages
        let mut held: Vec<Option<Vec<u32>>> = vec![None; slots];
        let mut rnd = xorshift(0x2545_f491_4f6c_dd1du64);
        let mut hits = 0;
        let runs = g.runs_per_slot;
        // A page's content: the tokens up to its end (its KV depends on all of them).
        let tag = |t: &[u32], p: usize| -> Vec<u32> {
            t[..((p + 1) * g.page_tokens).min(t.len())].to_vec()
        };
        let mut content: HashMap<u32, Vec<u32>> = HashMap::new();
        let mut dropped_cached = 0;
        for _ in 0..1500 {
            let s = rnd(slots);
            if held[s].is_some() && rnd(3) == 0 {
                pool.release(s).unwrap();
                held[s] = None;
            } else if held[s].is_some() && rnd(4) == 0 {
                // What SnapKV's compaction does: the prompt's first pages go, and cached ones
                // stay cached (another prompt may adopt them).
                let t = held[s].as_ref().unwrap().len();
                let first = pool.slots[s].dropped;
                let cached: usize = pool.slots[s]
                    .owned
                    .iter()
                    .filter(|h| pool.held.contains_key(h))
                    .count();
                let n = pool.drop_below(s, rnd(t + 1)).unwrap();
                let left: usize = pool.slots[s]
                    .owned
                    .iter()
                    .filter(|h| pool.held.contains_key(h))
                    .count();
                dropped_cached += cached - left;
                assert_eq!(pool.slots[s].dropped, first + n);
            } else if held[s].is_none() {
                // A prompt of 1-5 blocks, each all-0 or all-1 tokens, and a tail of 0-40.
                let mut t = Vec::new();
                for _ in 0..1 + rnd(5) {
                    t.extend(std::iter::repeat_n(rnd(2) as u32, bt));
                }
                t.extend(std::iter::repeat_n(7u32, rnd(41)));
                let whole = (t.len() - 1) / bt; // the last part is never adopted
                let got = pool.adopt(s, &t, whole).unwrap();
                assert_eq!(got % bt, 0);
                assert_eq!(pool.shared_tokens(s), got);
                hits += usize::from(got > 0);
                match pool.ensure(s, t.len()) {
                    Ok(()) => {
                        // The prefill writes the pages past the adopted ones: none of them
                        // may be held by the cache or mapped by another slot.
                        let sp = pool.shared_tokens(s) / g.page_tokens;
                        for p in sp..pool.pages(s) {
                            for r in 0..runs {
                                let page = pool.slots[s].owned[p * runs + r];
                                assert_eq!(pool.maps[&page], 1, "a written page is shared");
                                assert!(!pool.held.contains_key(&page), "a cached page written");
                                content.insert(page, tag(&t, p));
                            }
                        }
                        pool.remember(s, &t, t.len() / bt);
                        held[s] = Some(t);
                    }
                    Err(_) => pool.release(s).unwrap(),
                }
            }
            let b = book.0.lock().unwrap();
            for (i, h) in held.iter().enumerate() {
                let want = h.as_ref().map_or(0, |t| g.pages_for(t.len(), cap));
                assert_eq!(pool.pages(i), want, "slot {i}");
                assert_eq!(pool.on_scratch(i), h.is_none());
                let d = pool.slots[i].dropped;
                for r in 0..runs {
                    for p in 0..want {
                        let va = pool.va(i, r, p);
                        let page = (p >= d).then(|| &pool.slots[i].owned[(p - d) * runs + r]);
                        assert_eq!(b.at.get(&va), page, "slot {i} run {r} page {p}");
                    }
                }
            }
            // What each page holds: every whole page of a slot holds its own tokens' KV.
            for (i, h) in held.iter().enumerate() {
                let Some(t) = h else { continue };
                let d = pool.slots[i].dropped;
                for p in d..t.len() / g.page_tokens {
                    for r in 0..runs {
                        let page = pool.slots[i].owned[(p - d) * runs + r];
                        assert_eq!(content.get(&page), Some(&tag(t, p)), "slot {i} page {p}");
                    }
                }
            }
            let mapped: HashSet<u32> = (0..slots)
                .flat_map(|i| pool.slots[i].owned.clone())
                .collect();
            let attributed: usize = (0..slots).map(|i| pool.slot_bytes(i)).sum();
            assert!(attributed >= mapped.len() * PAGE && attributed < mapped.len() * PAGE + PAGE);
            let cached_only = pool.cached_only_bytes() / PAGE;
            assert_eq!(
                b.live.len(),
                mapped.len() + cached_only + pool.free_pages() + 1
            );
            assert_eq!(pool.bytes_in_use(), (mapped.len() + cached_only) * PAGE);
        }
        let st = pool.prefix_stats().unwrap();
        assert!(hits > 100, "only {hits} prefix hits");
        assert!(st.evicted_blocks > 0, "the cache never filled");
        assert!(
            dropped_cached > 0,
            "no cached page was ever dropped by a slot"
        );
        drop(pool);
        let b = book.0.lock().unwrap();
        assert!(b.at.is_empty() && b.live.is_empty(), "pages leaked");
    }

    /// The next token at position `len` reads, on a layer of window w, positions
    /// `len + 1 - w ..= len`; a global layer reads from the policy's row; a tile below it.
    #[test]
    fn lowest_read_row_is_the_lowest_layer_less_a_tile() {
        let gemma = [Some(512), Some(512), None, Some(512)];
        // a global layer reading everything keeps row 0
        assert_eq!(lowest_read_row(&gemma, 0, 20_000), 0);
        // SnapKV compacted the prompt: its window starts at 19_968; the local layers read
        // from 20_001 - 512 = 19_489
        assert_eq!(
            lowest_read_row(&gemma, 19_968, 20_000),
            19_489 - READ_MARGIN
        );
        assert_eq!(
            lowest_read_row(&gemma, 10_000, 20_000),
            10_000 - READ_MARGIN
        );
        // every layer windowed (Mistral): the window's start moves with the length
        let mistral = [Some(4096); 3];
        assert_eq!(lowest_read_row(&mistral, 0, 4095), 0);
        assert_eq!(
            lowest_read_row(&mistral, 0, 10_000),
            10_001 - 4096 - READ_MARGIN
        );
        // short sequences and no layers read from 0
        assert_eq!(lowest_read_row(&gemma, 19_968, 100), 0);
        assert_eq!(lowest_read_row(&[], 5, 100), 0);
    }

    #[test]
    fn a_refused_ensure_changes_nothing() {
        let book = Fake::default();
        let g = geo();
        let mut pool = PagePool::new(
            book.clone(),
            g,
            vec![0, 1 << 30, 2 << 30],
            2,
            1000,
            60 * PAGE,
        )
        .unwrap();
        pool.ensure(0, 1).unwrap(); // 9 pages x 6 runs = 54
        let before = (
            pool.pages(1),
            pool.bytes_in_use(),
            book.0.lock().unwrap().at.len(),
        );
        assert!(pool.ensure(1, 1).is_err());
        assert!(pool.on_scratch(1));
        assert_eq!(
            before,
            (
                pool.pages(1),
                pool.bytes_in_use(),
                book.0.lock().unwrap().at.len()
            )
        );
        pool.release(0).unwrap();
        pool.ensure(1, 1).unwrap(); // the freed pages are reused, none created
        assert_eq!(pool.bytes_in_use(), 54 * PAGE);
        assert_eq!(book.0.lock().unwrap().live.len(), 55);
    }
}
