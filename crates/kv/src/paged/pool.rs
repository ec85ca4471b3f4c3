//! `BlockPool`: fixed-size KV blocks handed out by id, with reference counts. It holds no KV
//! itself; the device keeps the blocks' memory and indexes it by id. Ids come lowest first, so
//! storage sized to the highest id in use grows only as blocks are needed.
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A block's index into the device's block storage.
pub type BlockId = u32;

/// Misuse of the pool: the caller's bookkeeping is wrong; nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("block {0} is not allocated (double free, or a stale id)")]
    NotAllocated(BlockId),
    #[error("block {id} is out of range: the pool has {n_blocks} blocks")]
    OutOfRange { id: BlockId, n_blocks: usize },
}

/// Reference-counted blocks of `block_size` tokens; `n_blocks` of them at most.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    /// Free ids, smallest first.
    free: BinaryHeap<Reverse<BlockId>>,
}

impl BlockPool {
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "a block holds at least one token");
        assert!(
            n_blocks <= BlockId::MAX as usize,
            "too many blocks for a u32 id"
        );
        BlockPool {
            block_size,
            refs: vec![0; n_blocks],
            free: (0..n_blocks as BlockId).map(Reverse).collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn n_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks holding at least one reference.
    pub fn n_used(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// The smallest free block, with one reference; None when every block is taken.
    pub fn alloc(&mut self) -> Option<BlockId> {
        let Reverse(id) = self.free.pop()?;
        debug_assert_eq!(self.refs[id as usize], 0);
        self.refs[id as usize] = 1;
        Some(id)
    }

    /// One more reference to an allocated block (another sequence shares it).
    pub fn retain(&mut self, id: BlockId) -> Result<u32, PoolError> {
        let r = self.slot(id)?;
        if *r == 0 {
            return Err(PoolError::NotAllocated(id));
        }
        *r += 1;
        Ok(*r)
    }

    /// Drops one reference; returns the references left (0: the block is free again).
    pub fn release(&mut self, id: BlockId) -> Result<u32, PoolError> {
        let r = self.slot(id)?;
        if *r == 0 {
            return Err(PoolError::NotAllocated(id));
        }
        *r -= 1;
        let left = *r;
        if left == 0 {
            self.free.push(Reverse(id));
        }
        Ok(left)
    }

    /// References held on `id` (0: free).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.refs.get(id as usize).copied().unwrap_or(0)
    }

    fn slot(&mut self, id: BlockId) -> Result<&mut u32, PoolError> {
        let n_blocks = self.refs.len();
        self.refs
            .get_mut(id as usize)
            .ok_or(PoolError::OutOfRange { id, n_blocks })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// xorshift, so the random sequences need no dependency and replay from the seed.
    pub(crate) fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut s = seed | 1;
        move |n| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s % n.max(1)
        }
    }

    #[test]
    fn random_alloc_share_free_never_leaks_or_double_frees() {
        for seed in 1..40u64 {
            let mut r = rng(seed);
            let n = 1 + r(40) as usize;
            let mut pool = BlockPool::new(n, 16);
            // The plain model: a reference count per block, kept beside the pool.
            let mut model = vec![0u32; n];
            let mut held: Vec<BlockId> = Vec::new(); // one entry per reference we own
            for _ in 0..2000 {
                match r(4) {
                    0 => match pool.alloc() {
                        Some(id) => {
                            assert_eq!(model[id as usize], 0, "handed out a used block");
                            let lowest = model.iter().position(|&c| c == 0).unwrap();
                            assert_eq!(id as usize, lowest, "not the smallest free id");
                            model[id as usize] = 1;
                            held.push(id);
                        }
                        None => assert!(model.iter().all(|&c| c > 0), "refused with free blocks"),
                    },
                    1 if !held.is_empty() => {
                        let id = held[r(held.len() as u64) as usize];
                        assert_eq!(pool.retain(id), Ok(model[id as usize] + 1));
                        model[id as usize] += 1;
                        held.push(id);
                    }
                    _ if !held.is_empty() => {
                        let id = held.swap_remove(r(held.len() as u64) as usize);
                        model[id as usize] -= 1;
                        assert_eq!(pool.release(id), Ok(model[id as usize]));
                    }
                    _ => {}
                }
                let used = model.iter().filter(|&&c| c > 0).count();
                assert_eq!(pool.n_used(), used);
                assert_eq!(pool.n_free(), n - used);
                for (id, &c) in model.iter().enumerate() {
                    assert_eq!(pool.refs(id as BlockId), c);
                }
            }
            // Returning every reference frees every block.
            for id in held.drain(..) {
                pool.release(id).unwrap();
            }
            assert_eq!(pool.n_free(), n);
        }
    }

    #[test]
    fn double_free_and_stale_ids_are_errors_that_change_nothing() {
        let mut pool = BlockPool::new(2, 32);
        let a = pool.alloc().unwrap();
        assert_eq!(pool.release(a), Ok(0));
        assert_eq!(pool.release(a), Err(PoolError::NotAllocated(a)));
        assert_eq!(pool.retain(a), Err(PoolError::NotAllocated(a)));
        assert_eq!(
            pool.release(7),
            Err(PoolError::OutOfRange { id: 7, n_blocks: 2 })
        );
        assert_eq!(pool.n_free(), 2);
        assert_eq!(
            (pool.alloc(), pool.alloc(), pool.alloc()),
            (Some(0), Some(1), None)
        );
    }
}
