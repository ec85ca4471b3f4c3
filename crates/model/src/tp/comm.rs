//! `Communicator`: the collectives a tensor-parallel rank needs (all-reduce, all-gather,
//! broadcast), with `SingleRank` (TP = 1) and `ThreadGroup` (ranks in threads of one process,
//! the CPU reference an NCCL communicator must agree with).
use std::sync::{Arc, Condvar, Mutex, RwLock};

use crate::ModelError;

/// The collectives of one rank of a tensor-parallel group. Every rank calls the same
/// collectives in the same order with the same lengths. Object-safe, so a model holds an
/// `Arc<dyn Communicator>` and an NCCL implementation can stand in for these.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Every rank's `buf` becomes the element-wise sum of all ranks' `buf`.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), ModelError>;
    /// `out` (`[size, local.len()]`) becomes every rank's `local`, in rank order.
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), ModelError>;
    /// Every rank's `buf` becomes rank 0's (a decision taken once, e.g. SFI's trigger).
    fn broadcast_u32(&self, buf: &mut [u32]) -> Result<(), ModelError>;
}

/// TP = 1: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<(), ModelError> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), ModelError> {
        if out.len() != local.len() {
            return Err(ModelError::TensorParallel(format!(
                "all_gather of {} values into {} (one rank: expected equal lengths)",
                local.len(),
                out.len()
            )));
        }
        out.copy_from_slice(local);
        Ok(())
    }
    fn broadcast_u32(&self, _buf: &mut [u32]) -> Result<(), ModelError> {
        Ok(())
    }
}

/// A reusable barrier that fails instead of hanging once a rank has left the group (its
/// handle dropped, e.g. after an error or a panic), unlike `std::sync::Barrier`.
struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
}

struct GateState {
    arrived: usize,
    generation: u64,
    left: Option<usize>,
}

/// What the ranks of a `ThreadGroup` share: one staging buffer per rank and the gate.
struct Shared {
    size: usize,
    slots: Vec<RwLock<Vec<f32>>>, // [size][len] each rank's contribution
    words: RwLock<Vec<u32>>,      // rank 0's broadcast
    gate: Gate,
}

/// One rank of a group of threads in one process. Collectives stage each rank's data in a
/// shared buffer, meet at a barrier, and read every rank's buffer in rank order, so the
/// all-reduce gives every rank bit-identical sums.
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// The `size` rank handles of a new group (hand handle `r` to the thread of rank `r`).
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        let shared = Arc::new(Shared {
            size,
            slots: (0..size).map(|_| RwLock::new(Vec::new())).collect(),
            words: RwLock::new(Vec::new()),
            gate: Gate {
                state: Mutex::new(GateState {
                    arrived: 0,
                    generation: 0,
                    left: None,
                }),
                cv: Condvar::new(),
            },
        });
        (0..size)
            .map(|rank| ThreadGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn fail(&self, what: String) -> ModelError {
        ModelError::TensorParallel(format!(
            "tensor-parallel rank {} of {}: {what}",
            self.rank, self.shared.size
        ))
    }

    /// Wait until every rank arrives; an error once some rank has left the group.
    fn wait(&self) -> Result<(), ModelError> {
        let g = &self.shared.gate;
        let mut st = g.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = st.left {
            return Err(self.fail(format!("rank {r} left the group")));
        }
        st.arrived += 1;
        if st.arrived == self.shared.size {
            st.arrived = 0;
            st.generation += 1;
            g.cv.notify_all();
            return Ok(());
        }
        let gen = st.generation;
        while st.generation == gen && st.left.is_none() {
            st = g.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match st.left {
            Some(r) if st.generation == gen => Err(self.fail(format!("rank {r} left the group"))),
            _ => Ok(()),
        }
    }

    fn stage(&self, data: &[f32]) {
        let mut slot = self.shared.slots[self.rank]
            .write()
            .unwrap_or_else(|e| e.into_inner());
        slot.clear();
        slot.extend_from_slice(data);
    }

    /// Every rank's staged buffer, checked to hold `len` values.
    fn check_lens(&self, op: &str, len: usize) -> Result<(), ModelError> {
        for (r, s) in self.shared.slots.iter().enumerate() {
            let n = s.read().unwrap_or_else(|e| e.into_inner()).len();
            if n != len {
                return Err(self.fail(format!(
                    "{op} of {len} values but rank {r} sent {n} (every rank must pass the same length)"
                )));
            }
        }
        Ok(())
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let g = &self.shared.gate;
        let mut st = g.state.lock().unwrap_or_else(|e| e.into_inner());
        st.left.get_or_insert(self.rank);
        g.cv.notify_all();
    }
}

impl Communicator for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), ModelError> {
        self.stage(buf);
        self.wait()?;
        let r = self.check_lens("all_reduce_sum", buf.len()).map(|()| {
            // ((s0 + s1) + s2) + ...: the same order on every rank.
            for (i, s) in self.shared.slots.iter().enumerate() {
                let s = s.read().unwrap_or_else(|e| e.into_inner());
                if i == 0 {
                    buf.copy_from_slice(&s);
                } else {
                    buf.iter_mut().zip(s.iter()).for_each(|(b, x)| *b += x);
                }
            }
        });
        self.wait()?; // nobody restages before every rank has read
        r
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), ModelError> {
        let n = local.len();
        if out.len() != n * self.shared.size {
            return Err(self.fail(format!(
                "all_gather of {n} values per rank into {} (expected {})",
                out.len(),
                n * self.shared.size
            )));
        }
        self.stage(local);
        self.wait()?;
        let r = self.check_lens("all_gather", n).map(|()| {
            for (s, o) in self.shared.slots.iter().zip(out.chunks_exact_mut(n.max(1))) {
                o.copy_from_slice(&s.read().unwrap_or_else(|e| e.into_inner()));
            }
        });
        self.wait()?;
        r
    }

    fn broadcast_u32(&self, buf: &mut [u32]) -> Result<(), ModelError> {
        if self.rank == 0 {
            let mut w = self.shared.words.write().unwrap_or_else(|e| e.into_inner());
            w.clear();
            w.extend_from_slice(buf);
        }
        self.wait()?;
        let r = if self.rank == 0 {
            Ok(())
        } else {
            let w = self.shared.words.read().unwrap_or_else(|e| e.into_inner());
            if w.len() == buf.len() {
                buf.copy_from_slice(&w);
                Ok(())
            } else {
                Err(self.fail(format!(
                    "broadcast_u32 of {} values but rank 0 sent {}",
                    buf.len(),
                    w.len()
                )))
            }
        };
        self.wait()?;
        r
    }
}
