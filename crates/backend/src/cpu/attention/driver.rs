//! Work split of one attention call into tasks (kv head x query tile x key chunk), run on
//! rayon; split-KV partials (flash-decoding) are merged by log-sum-exp afterwards.

#![allow(clippy::too_many_arguments)]

use super::elem::KvElem;
use super::merge::merge_row;
use super::tile::{
    run_task, Isa, LogitsSink, Scratch, SyncPtr, Task, BK_ROWS, POOL_PARTIALS, POOL_TASK_OUT,
    ROW_PATH_MAX,
};
use super::types::{total_keys, Geometry, KvSource, Mask, QueryPositions};
use rayon::prelude::*;

/// Rows (query rows x group heads) per prefill task.
const ROWS_TARGET: usize = 128;
/// Smallest key chunk worth a task of its own.
const MIN_CHUNK_KEYS: usize = 512;
/// Tasks per thread we aim for (load balance under causal skipping).
const TASKS_PER_THREAD: usize = 4;

/// How a call is cut into tasks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// Query rows per tile.
    pub bq: usize,
    pub n_qt: usize,
    /// Key chunks per (kv head, query tile); > 1 means split-KV with a merge pass.
    pub chunks: usize,
}

impl Plan {
    pub(crate) fn new(
        geo: &Geometry,
        max_keys: usize,
        threads: usize,
        force_chunks: Option<usize>,
    ) -> Plan {
        let bq = if geo.n_q * geo.group <= ROW_PATH_MAX {
            geo.n_q.max(1)
        } else {
            (ROWS_TARGET / geo.group).max(1)
        };
        let n_qt = geo.n_q.div_ceil(bq);
        let base = geo.n_kv * n_qt;
        let want = (TASKS_PER_THREAD * threads).div_ceil(base.max(1));
        let chunks = force_chunks.unwrap_or_else(|| want.min(max_keys / MIN_CHUNK_KEYS).max(1));
        Plan { bq, n_qt, chunks }
    }

    fn n_tasks(&self, geo: &Geometry) -> usize {
        geo.n_kv * self.n_qt * self.chunks
    }

    /// Key range of chunk `c` among `total` keys, boundaries aligned to whole tiles.
    fn chunk(&self, c: usize, total: usize) -> (usize, usize) {
        let size = total.div_ceil(self.chunks).div_ceil(BK_ROWS) * BK_ROWS;
        ((c * size).min(total), ((c + 1) * size).min(total))
    }
}

/// Everything a call needs besides the per-task indices.
pub(crate) struct Call<'a, 's, T, K: ?Sized> {
    pub isa: Isa,
    pub geo: Geometry,
    pub mask: Mask,
    pub q: &'a [f32], // [n_q, n_heads, d]
    pub q_pos: QueryPositions<'a>,
    pub kv: &'a K,
    pub force_chunks: Option<usize>,
    pub _s: std::marker::PhantomData<&'s T>,
}

impl<'a, 's: 'a, T: KvElem, K: KvSource<'s, T> + ?Sized> Call<'a, 's, T, K> {
    fn task(&self, plan: &Plan, idx: usize, logits: Option<(SyncPtr, &[usize])>) -> Task<'a, T> {
        let g = &self.geo;
        let (kv_head, rest) = (
            idx / (plan.n_qt * plan.chunks),
            idx % (plan.n_qt * plan.chunks),
        );
        let (qt, c) = (rest / plan.chunks, rest % plan.chunks);
        let segs = self.kv.segments(kv_head);
        let total = total_keys(segs, g.d);
        let i0 = qt * plan.bq;
        Task {
            geo: *g,
            mask: self.mask,
            q: self.q,
            q_pos: self.q_pos,
            kv_head,
            i0,
            nq: plan.bq.min(g.n_q - i0),
            segs,
            keys: plan.chunk(c, total),
            logits: logits.map(|(ptr, bases)| LogitsSink {
                ptr,
                base: bases[kv_head],
                total,
            }),
        }
    }

    /// Runs the call: `out` [n_q, n_heads, d], `lse` [n_q, n_heads], `logits` as documented on
    /// `attention_with_logits` (with `logit_bases[h]` the offset of kv head h's block).
    pub(crate) fn run(
        &self,
        out: &mut [f32],
        lse: Option<&mut [f32]>,
        logits: Option<(&mut [f32], &[usize])>,
    ) {
        let g = self.geo;
        let max_keys = (0..g.n_kv)
            .map(|h| total_keys(self.kv.segments(h), g.d))
            .max()
            .unwrap_or(0);
        let plan = Plan::new(
            &g,
            max_keys,
            rayon::current_num_threads(),
            self.force_chunks,
        );
        let n_tasks = plan.n_tasks(&g);
        let out_p = SyncPtr(out.as_mut_ptr());
        let lse_p = lse.map(|l| SyncPtr(l.as_mut_ptr()));
        let logits = logits.map(|(l, b)| (SyncPtr(l.as_mut_ptr()), b));
        let rows_max = plan.bq * g.group;
        if plan.chunks == 1 {
            (0..n_tasks).into_par_iter().for_each(|idx| {
                let t = self.task(&plan, idx, logits);
                let rows = t.nq * g.group;
                let mut buf = Scratch::take(POOL_TASK_OUT, rows * (g.d + 1));
                let (o, l) = buf.split_at_mut(rows * g.d); // [rows, d], [rows]
                run_task(self.isa, &t, o, l);
                self.scatter(&t, o, l, out_p, lse_p);
            });
            return;
        }
        // Split-KV: every task writes a partial [rows_max, d] + [rows_max], then merge.
        let stride = rows_max * (g.d + 1);
        let mut parts = Scratch::take(POOL_PARTIALS, n_tasks * stride);
        parts
            .par_chunks_mut(stride)
            .enumerate()
            .for_each(|(idx, part)| {
                let t = self.task(&plan, idx, logits);
                let (o, l) = part.split_at_mut(rows_max * g.d);
                run_task(self.isa, &t, o, l);
            });
        let parts = &*parts;
        (0..g.n_kv * plan.n_qt)
            .into_par_iter()
            .for_each(|group_idx| {
                let t = self.task(&plan, group_idx * plan.chunks, None);
                let rows = t.nq * g.group;
                let mut buf = Scratch::take(POOL_TASK_OUT, rows * (g.d + 1));
                let (o, l) = buf.split_at_mut(rows * g.d);
                let chunk = |c: usize| &parts[(group_idx * plan.chunks + c) * stride..][..stride];
                for r in 0..rows {
                    let first = chunk(0);
                    let acc = &mut o[r * g.d..(r + 1) * g.d];
                    acc.copy_from_slice(&first[r * g.d..(r + 1) * g.d]);
                    let mut lse_r = first[rows_max * g.d + r];
                    for c in 1..plan.chunks {
                        let p = chunk(c);
                        lse_r = merge_row(
                            acc,
                            lse_r,
                            &[(&p[r * g.d..(r + 1) * g.d], p[rows_max * g.d + r])],
                        );
                    }
                    l[r] = lse_r;
                }
                self.scatter(&t, o, l, out_p, lse_p);
            });
    }

    /// Copies a task's rows (r = i*G + g) to `out` [n_q, n_heads, d] and `lse` [n_q, n_heads].
    fn scatter(&self, t: &Task<'_, T>, o: &[f32], l: &[f32], out: SyncPtr, lse: Option<SyncPtr>) {
        let g = &self.geo;
        let w = g.group * g.d;
        for i in 0..t.nq {
            let row0 = (t.i0 + i) * g.n_heads + t.kv_head * g.group;
            // SAFETY: (query row, head) pairs are disjoint between tasks of one pass, and
            // `out`/`lse` were validated to hold [n_q, n_heads(, d)].
            unsafe {
                std::ptr::copy_nonoverlapping(o[i * w..].as_ptr(), out.0.add(row0 * g.d), w);
                if let Some(lse) = lse {
                    std::ptr::copy_nonoverlapping(
                        l[i * g.group..].as_ptr(),
                        lse.0.add(row0),
                        g.group,
                    );
                }
            }
        }
    }
}
