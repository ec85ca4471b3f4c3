//! Per-thread reusable f32 work buffers and the shared output pointer of the attention tasks.

use std::cell::Cell;

/// Raw pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub *mut f32);
// SAFETY: used only for writes to element sets that the work split makes disjoint.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Thread-local buffer pools: tile work space, task output, split-KV partials.
pub(crate) const POOL_TILE: usize = 0;
pub(crate) const POOL_TASK_OUT: usize = 1;
pub(crate) const POOL_PARTIALS: usize = 2;

thread_local! {
    static SCRATCH: [Cell<Vec<f32>>; 3] = const { [Cell::new(Vec::new()), Cell::new(Vec::new()), Cell::new(Vec::new())] };
}

/// A zeroed f32 buffer borrowed from a thread-local pool (no allocation in steady state);
/// returned to the pool on drop. Nested use of one pool on one thread gets a fresh buffer.
pub(crate) struct Scratch(Vec<f32>, usize);

impl Scratch {
    pub(crate) fn take(pool: usize, n: usize) -> Scratch {
        let mut v = SCRATCH.with(|c| c[pool].take());
        v.clear();
        v.resize(n, 0.0);
        Scratch(v, pool)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        SCRATCH.with(|c| {
            let cur = c[self.1].take();
            c[self.1].set(if cur.capacity() >= v.capacity() {
                cur
            } else {
                v
            });
        });
    }
}

impl std::ops::Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}
