//! The SFI policy: per global layer, a compact buffer of sink + Selector-chosen keys/values
//! (rebuilt at each refresh, contiguous per kv head) read together with the recent window in
//! place; slow steps (trigger) and the prefill bootstrap attend densely and refresh it.
use slowfast_backend::cpu::attention::{KvPositions, KvSegment};

use super::selector::{select_into, Selection, SelectorConfig, SelectorInput, SelectorScratch};
use super::trigger::{Trigger, TriggerConfig, TriggerError};
use crate::policy::{push_range, reset_out, AttnCall, KvPolicy, PolicyStats, StepCounter};
use crate::store::{CacheElem, KvError, KvStore};

/// SFI knobs (methods.md §1.3).
#[derive(Debug, Clone, PartialEq)]
pub struct SfiConfig {
    /// Sink tokens S kept in every memory.
    pub sinks: usize,
    /// Recent window Wr, read in place (page-aligned start).
    pub recent: usize,
    /// Selector-chosen tokens per kv head (k).
    pub selected: usize,
    /// Page size P aligning the recent window's start.
    pub page: usize,
    /// Query rows captured at the end of prefill for the bootstrap selection.
    pub bootstrap_rows: usize,
    pub trigger: TriggerConfig,
    pub selector: SelectorConfig,
}

impl SfiConfig {
    /// Defaults with a total budget of `budget` tokens per kv head (S + k + Wr).
    pub fn with_budget(budget: usize) -> Result<Self, String> {
        let (sinks, recent) = (4, 256);
        if budget <= sinks + recent {
            return Err(format!(
                "the SFI budget ({budget} tokens) must exceed sinks + recent window ({})",
                sinks + recent
            ));
        }
        Ok(Self::new(sinks, recent, budget - sinks - recent))
    }

    /// `sinks` + `selected` Selector-chosen tokens + a `recent` window, other knobs at the
    /// authors' defaults.
    pub fn new(sinks: usize, recent: usize, selected: usize) -> Self {
        SfiConfig {
            sinks,
            recent,
            selected,
            page: 16,
            bootstrap_rows: 16,
            trigger: TriggerConfig::default(),
            selector: SelectorConfig::default(),
        }
    }
}

/// Captured prefill logits waiting for the end of prefill.
#[derive(Default)]
struct Pending {
    rows: usize,
    n_heads: usize,
    len: usize,
    logits: Vec<f32>,
}

/// One layer's sparse memory.
struct LayerMem<T> {
    k: Vec<T>,     // [kv_heads, len, head_dim]
    v: Vec<T>,     // [kv_heads, len, head_dim]
    pos: Vec<u32>, // [kv_heads, len]
    len: usize,    // tokens per kv head (equal across heads)
    recent_start: usize,
}

pub struct SfiPolicy<T> {
    cfg: SfiConfig,
    trigger: Trigger,
    layers: Vec<Option<LayerMem<T>>>,
    /// This decode step is slow (dense + refresh).
    slow_now: bool,
    /// A refresh ran during the current forward (bootstrap or slow step).
    refreshed: bool,
    scratch: SelectorScratch,
    selection: Selection,
    norms: Vec<f32>,
    /// Per layer: the captured bootstrap logits of the latest prefill chunk, selected from
    /// once at `end_prefill` (so earlier chunks cost no Selector run).
    pending: Vec<Option<Pending>>,
    /// Per layer, per kv head: the L2 norm of each cached key computed so far.
    key_norms: Vec<Vec<Vec<f32>>>,
    stats: PolicyStats,
    step: StepCounter,
    sparse_this_step: bool,
    refreshes: usize,
}

impl<T: CacheElem> SfiPolicy<T> {
    pub fn new(
        cfg: SfiConfig,
        enders: &[u32],
        newlines: &[u32],
        vocab_size: usize,
    ) -> Result<Self, TriggerError> {
        let trigger = Trigger::new(cfg.trigger.clone(), enders, newlines, vocab_size)?;
        Ok(SfiPolicy {
            cfg,
            trigger,
            layers: Vec::new(),
            slow_now: false,
            refreshed: false,
            scratch: SelectorScratch::default(),
            selection: Selection {
                per_head: Vec::new(),
            },
            norms: Vec::new(),
            key_norms: Vec::new(),
            pending: Vec::new(),
            stats: PolicyStats::default(),
            step: StepCounter::default(),
            sparse_this_step: false,
            refreshes: 0,
        })
    }

    /// Memory refreshes so far (bootstrap included), summed over layers.
    pub fn refreshes(&self) -> usize {
        self.refreshes
    }

    /// Below this length a sequence stays dense (the memory would not be smaller).
    fn dense_below(&self) -> usize {
        self.cfg.sinks + self.cfg.selected + self.cfg.recent
    }

    fn mem(&self, layer: usize) -> Option<&LayerMem<T>> {
        self.layers.get(layer).and_then(|m| m.as_ref())
    }

    /// Select and gather the memory of `layer` from captured logits over keys `[0, len)`.
    fn refresh(
        &mut self,
        layer: usize,
        rows: usize,
        logits: &[f32],
        store: &KvStore<T>,
        n_heads: usize,
        len: usize,
    ) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        if len <= self.dense_below() {
            self.layers[layer] = None;
            return;
        }
        let (nkv, d) = (store.n_kv_heads, store.head_dim);
        let g = n_heads / nkv;
        let p = self.cfg.page.max(1);
        let recent_start = (len - self.cfg.recent.min(len)) / p * p;
        // Key norms of the cached (post-RoPE) keys: kept per layer and extended by the
        // positions written since the last refresh (cached keys are never rewritten).
        if self.key_norms.len() <= layer {
            self.key_norms.resize_with(layer + 1, Vec::new);
        }
        let cached = &mut self.key_norms[layer];
        cached.resize_with(nkv, Vec::new);
        self.norms.clear();
        let mut row = vec![0.0f32; d];
        for (h, kn) in cached.iter_mut().enumerate() {
            let (kslab, _) = store.head_slab(layer, h);
            kn.truncate(len);
            for j in kn.len()..len {
                T::load(&kslab[j * d..(j + 1) * d], &mut row);
                kn.push(l2_norm(&row));
            }
            self.norms.extend_from_slice(kn);
        }
        let inp = SelectorInput {
            n_kv_heads: nkv,
            rows: g * rows,
            seq_len: len,
            logits,
            key_norms: &self.norms,
            sinks: self.cfg.sinks,
            recent_start,
            k: self.cfg.selected,
        };
        if select_into(
            &self.cfg.selector,
            &inp,
            &mut self.scratch,
            &mut self.selection,
        )
        .is_err()
        {
            // Inputs the Selector rejects (e.g. non-finite logits) leave the layer dense.
            self.layers[layer] = None;
            return;
        }
        let chosen = self.selection.per_head.first().map_or(0, |v| v.len());
        let m_len = self.cfg.sinks + chosen;
        let mut mem = self.layers[layer].take().unwrap_or(LayerMem {
            k: Vec::new(),
            v: Vec::new(),
            pos: Vec::new(),
            len: 0,
            recent_start: 0,
        });
        mem.len = m_len;
        mem.recent_start = recent_start;
        mem.pos.clear();
        mem.k.clear();
        mem.v.clear();
        for h in 0..nkv {
            let (kslab, vslab) = store.head_slab(layer, h);
            let sel = &self.selection.per_head[h];
            for j in (0..self.cfg.sinks as u32).chain(sel.iter().copied()) {
                let j = j as usize;
                mem.pos.push(j as u32);
                mem.k.extend_from_slice(&kslab[j * d..(j + 1) * d]);
                mem.v.extend_from_slice(&vslab[j * d..(j + 1) * d]);
            }
        }
        self.layers[layer] = Some(mem);
        self.refreshed = true;
        self.refreshes += 1;
    }
}

/// `sqrt(sum x^2)` with eight independent partial sums (vectorises).
fn l2_norm(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    (acc.iter().sum::<f32>() + tail).sqrt()
}

impl<T: CacheElem> KvPolicy<T> for SfiPolicy<T> {
    fn name(&self) -> &'static str {
        "sfi"
    }

    fn capture_rows(&self, call: &AttnCall) -> usize {
        if call.sliding || call.hi() <= self.dense_below() {
            0
        } else if !call.is_decode() {
            // Every prefill chunk captures; the last one's selection is what decode starts with.
            self.cfg.bootstrap_rows.min(call.n)
        } else if self.slow_now || self.mem(call.layer).is_none() {
            1
        } else {
            0
        }
    }

    fn segments<'s>(
        &'s mut self,
        call: &AttnCall,
        store: &'s KvStore<T>,
        out: &mut Vec<Vec<KvSegment<'s, T>>>,
    ) {
        let nkv = store.n_kv_heads;
        reset_out(out, nkv);
        let (lo, hi) = (call.lo, call.hi());
        let dense = call.sliding
            || !call.is_decode()
            || self.capture_rows(call) > 0
            || self.mem(call.layer).is_none();
        if call.is_decode() && !call.sliding {
            let attended = match (dense, self.mem(call.layer)) {
                (false, Some(m)) => m.len + (hi - m.recent_start),
                _ => hi - lo,
            };
            self.step.record(attended as f64, hi - lo);
            self.sparse_this_step |= !dense;
        }
        if dense {
            for (h, o) in out.iter_mut().enumerate() {
                push_range(store, call.layer, h, lo..hi, o);
            }
            return;
        }
        let d = store.head_dim;
        let m = self.layers[call.layer].as_ref().expect("checked above");
        for (h, o) in out.iter_mut().enumerate() {
            let r = h * m.len..(h + 1) * m.len;
            o.push(KvSegment {
                k: &m.k[r.start * d..r.end * d],
                v: &m.v[r.start * d..r.end * d],
                pos: KvPositions::List(&m.pos[r]),
            });
            push_range(store, call.layer, h, m.recent_start..hi, o);
        }
    }

    fn observe(&mut self, call: &AttnCall, rows: usize, logits: &[f32], store: &KvStore<T>) {
        debug_assert_eq!(call.lo, 0, "SFI memories live in global layers");
        let len = call.hi() - call.lo;
        let n_heads = logits.len() / (rows * len).max(1);
        if call.is_decode() {
            self.refresh(call.layer, rows, logits, store, n_heads, len);
            return;
        }
        // Prefill: keep the latest chunk's capture; `end_prefill` selects from it.
        if self.pending.len() <= call.layer {
            self.pending.resize_with(call.layer + 1, || None);
        }
        let p = self.pending[call.layer].get_or_insert_with(Pending::default);
        (p.rows, p.n_heads, p.len) = (rows, n_heads, len);
        p.logits.clear();
        p.logits.extend_from_slice(logits);
    }

    fn prefill_tail(&self) -> usize {
        self.cfg.bootstrap_rows
    }

    fn end_prefill(&mut self, store: &mut KvStore<T>) -> Result<(), KvError> {
        let mut pending = std::mem::take(&mut self.pending);
        for (layer, p) in pending.iter_mut().enumerate() {
            if let Some(p) = p.take() {
                // Only positions the capture saw: a later forward may have grown the store.
                if p.len <= store.len() {
                    self.refresh(layer, p.rows, &p.logits, store, p.n_heads, p.len);
                }
            }
        }
        self.pending = pending;
        if self.refreshed {
            // The bootstrap: restart the trigger's reuse count.
            self.trigger.reset_after_refresh();
            self.refreshed = false;
        }
        Ok(())
    }

    fn end_forward(&mut self, _pos0: usize, n: usize) {
        if n == 1 {
            let slow = !self.sparse_this_step;
            self.step.finish(&mut self.stats, slow);
        }
        if self.refreshed && !self.slow_now {
            // Bootstrap or a forced refresh: restart the trigger's reuse count.
            self.trigger.reset_after_refresh();
        }
        self.sparse_this_step = false;
        self.refreshed = false;
        self.slow_now = false;
    }

    fn on_token(&mut self, token: u32) {
        self.slow_now = self.trigger.on_token(token);
    }

    fn stats(&self) -> PolicyStats {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerSpec;

    /// A store of `len` tokens whose key/value rows encode (head, position).
    fn store(nkv: usize, d: usize, len: usize) -> KvStore<f32> {
        let mut s = KvStore::<f32>::new(
            nkv,
            d,
            &[LayerSpec {
                capacity: len + 8,
                ring: false,
            }],
        );
        let k: Vec<f32> = (0..len * nkv * d)
            .map(|i| {
                let (t, h, c) = (i / (nkv * d), (i / d) % nkv, i % d);
                (t * 100 + h * 10 + c) as f32 * 0.01 + 0.5
            })
            .collect();
        s.write(0, 0, &k, &k).unwrap();
        s.set_len(len);
        s
    }

    #[test]
    fn refresh_gathers_sinks_and_the_peaks_the_logits_point_at() {
        let (nkv, g, d, len) = (2, 2, 4, 200);
        let st = store(nkv, d, len);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(3, 32, 5), &[], &[], 100).unwrap();
        // One captured row per query head; kv head h's rows peak at 5 distinct positions.
        let peaks = [[10usize, 40, 41, 90, 150], [20, 60, 61, 110, 130]];
        let mut logits = vec![0.0f32; nkv * g * len];
        for hq in 0..nkv * g {
            for &j in &peaks[hq / g] {
                logits[hq * len + j] = 12.0;
            }
        }
        let call = AttnCall {
            layer: 0,
            pos0: len - 1,
            n: 1,
            lo: 0,
            sliding: false,
        };
        p.observe(&call, 1, &logits, &st);
        assert_eq!(p.refreshes(), 1);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        for h in 0..nkv {
            let [compact, recent] = out[h].as_slice() else {
                panic!("two segments expected")
            };
            let KvPositions::List(pos) = compact.pos else {
                panic!("compact segment has a list")
            };
            let mut want: Vec<u32> = vec![0, 1, 2];
            want.extend(peaks[h].iter().map(|&j| j as u32));
            assert_eq!(pos, &want[..], "head {h}");
            for (i, &j) in pos.iter().enumerate() {
                let (ks, vs) = st.head_slab(0, h);
                assert_eq!(
                    &compact.k[i * d..(i + 1) * d],
                    &ks[j as usize * d..(j as usize + 1) * d]
                );
                assert_eq!(
                    &compact.v[i * d..(i + 1) * d],
                    &vs[j as usize * d..(j as usize + 1) * d]
                );
            }
            // Recent window: page-aligned start (200 - 32 = 168, floor to 16 -> 160) to the end.
            assert!(matches!(recent.pos, KvPositions::Range { start: 160 }));
            assert_eq!(recent.k.len(), (len - 160) * d);
        }
    }

    #[test]
    fn key_norms_extend_incrementally_and_match_a_fresh_computation() {
        let (nkv, g, d) = (2, 2, 12);
        let st = store(nkv, d, 200);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(2, 16, 8), &[], &[], 100).unwrap();
        for len in [120usize, 200, 160] {
            let call = AttnCall {
                layer: 0,
                pos0: len - 1,
                n: 1,
                lo: 0,
                sliding: false,
            };
            let logits = vec![0.5f32; nkv * g * len];
            p.observe(&call, 1, &logits, &st);
            assert_eq!(p.norms.len(), nkv * len);
            for h in 0..nkv {
                let (ks, _) = st.head_slab(0, h);
                for j in 0..len {
                    let row = &ks[j * d..(j + 1) * d];
                    let want = row.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
                    let got = p.norms[h * len + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want,
                        "len {len} head {h} pos {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn prefill_captures_wait_for_end_prefill_and_only_the_last_chunk_counts() {
        let (nkv, g, d, len) = (1, 2, 4, 200);
        let mut st = store(nkv, d, len);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(2, 32, 3), &[], &[], 100).unwrap();
        assert_eq!(KvPolicy::<f32>::prefill_tail(&p), 16);
        // Two chunks' captures (2 rows each): the first points at 10, 11, 12, the last at
        // 50, 60, 70.
        for (hi, peaks) in [(150usize, [10usize, 11, 12]), (200, [50, 60, 70])] {
            let call = AttnCall {
                layer: 0,
                pos0: hi - 2,
                n: 2,
                lo: 0,
                sliding: false,
            };
            let mut logits = vec![0.0f32; nkv * g * 2 * hi];
            for r in 0..g * 2 {
                for &j in &peaks {
                    logits[r * hi + j] = 15.0;
                }
            }
            p.observe(&call, 2, &logits, &st);
            assert_eq!(
                p.refreshes(),
                0,
                "no Selector run before the end of prefill"
            );
        }
        KvPolicy::<f32>::end_prefill(&mut p, &mut st).unwrap();
        assert_eq!(p.refreshes(), 1);
        let m = p.mem(0).expect("a memory after the bootstrap");
        assert_eq!(m.pos, vec![0, 1, 50, 60, 70]);
        // Nothing pending any more: a second end_prefill selects nothing.
        KvPolicy::<f32>::end_prefill(&mut p, &mut st).unwrap();
        assert_eq!(p.refreshes(), 1);
    }

    #[test]
    fn short_sequences_stay_dense() {
        let st = store(1, 4, 50);
        let mut p = SfiPolicy::<f32>::new(SfiConfig::new(4, 32, 20), &[], &[], 100).unwrap();
        let call = AttnCall {
            layer: 0,
            pos0: 49,
            n: 1,
            lo: 0,
            sliding: false,
        };
        assert_eq!(KvPolicy::<f32>::capture_rows(&p, &call), 0);
        let mut out = Vec::new();
        KvPolicy::<f32>::segments(&mut p, &call, &st, &mut out);
        assert!(matches!(out[0][0].pos, KvPositions::Range { start: 0 }));
        assert_eq!(out[0][0].k.len(), 50 * 4);
    }
}
