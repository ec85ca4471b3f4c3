//! `KvStore`: per-layer K/V buffers `[kv_heads, capacity, head_dim]`, preallocated and written
//! in place at each token's position. Global layers hold every position (slot = position);
//! sliding-window layers hold a ring of `window + chunk` slots (slot = position mod capacity).
use half::slice::HalfFloatSliceExt;
use slowfast_backend::cpu::attention::{KvElem, KvPositions, KvSegment};

/// A KV element type that can be written from f32 (f32 as is, f16 rounded to nearest).
pub trait CacheElem: KvElem + Default {
    fn store(src: &[f32], dst: &mut [Self]);
}

impl CacheElem for f32 {
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl CacheElem for half::f16 {
    fn store(src: &[f32], dst: &mut [half::f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// How one layer stores its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Slots per kv head.
    pub capacity: usize,
    /// Ring buffer (sliding-window layer) instead of slot = position.
    pub ring: bool,
}

/// One layer's K and V.
#[derive(Clone)]
pub struct LayerKv<T> {
    pub spec: LayerSpec,
    k: Vec<T>, // [kv_heads, capacity, head_dim]
    v: Vec<T>, // [kv_heads, capacity, head_dim]
}

/// The KV cache of one sequence.
#[derive(Clone)]
pub struct KvStore<T> {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    layers: Vec<LayerKv<T>>,
    /// Positions `[0, len)` have been written (in every layer).
    len: usize,
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
}

impl<T: CacheElem> KvStore<T> {
    /// Allocate every layer up front (zeroed), so decoding never allocates.
    pub fn new(n_kv_heads: usize, head_dim: usize, specs: &[LayerSpec]) -> Self {
        let layers = specs
            .iter()
            .map(|&spec| {
                let n = n_kv_heads * spec.capacity * head_dim;
                LayerKv {
                    spec,
                    k: vec![T::default(); n],
                    v: vec![T::default(); n],
                }
            })
            .collect();
        KvStore {
            n_kv_heads,
            head_dim,
            layers,
            len: 0,
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
    }
    /// Drop positions `>= len` (e.g. rejected speculative tokens); never grows.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Record that positions up to `len` are written in every layer (after the last layer).
    pub fn set_len(&mut self, len: usize) {
        self.len = len;
    }
    /// Tokens a global layer can hold.
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| !l.spec.ring)
            .map(|l| l.spec.capacity)
            .min()
            .unwrap_or(usize::MAX)
    }
    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| 2 * l.k.len() * std::mem::size_of::<T>())
            .sum()
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
        let (nkv, d) = (self.n_kv_heads, self.head_dim);
        let n = k.len() / (nkv * d).max(1);
        if k.len() != n * nkv * d || v.len() != k.len() {
            return Err(KvError::Shape {
                got: k.len().max(v.len()),
                n,
                n_kv_heads: nkv,
                head_dim: d,
            });
        }
        let l = &mut self.layers[layer];
        let cap = l.spec.capacity;
        if l.spec.ring {
            if n > cap {
                return Err(KvError::ChunkTooLong {
                    pos0,
                    n,
                    capacity: cap,
                });
            }
        } else if pos0 + n > cap {
            return Err(KvError::Full {
                layer,
                pos: pos0 + n - 1,
                capacity: cap,
            });
        }
        for t in 0..n {
            let slot = if l.spec.ring {
                (pos0 + t) % cap
            } else {
                pos0 + t
            };
            for h in 0..nkv {
                let src = (t * nkv + h) * d;
                let dst = (h * cap + slot) * d;
                T::store(&k[src..src + d], &mut l.k[dst..dst + d]);
                T::store(&v[src..src + d], &mut l.v[dst..dst + d]);
            }
        }
        Ok(())
    }

    /// The keys of kv head `h` at positions `[lo, hi)` as one or two contiguous segments
    /// (two when a ring wraps). `lo` must be within what the layer still holds.
    pub fn segments(
        &self,
        layer: usize,
        h: usize,
        lo: usize,
        hi: usize,
    ) -> [Option<KvSegment<'_, T>>; 2] {
        let l = &self.layers[layer];
        let (cap, d) = (l.spec.capacity, self.head_dim);
        if hi <= lo {
            return [None, None];
        }
        let base = h * cap * d;
        let seg = |slot: usize, pos: usize, len: usize| KvSegment {
            k: &l.k[base + slot * d..base + (slot + len) * d],
            v: &l.v[base + slot * d..base + (slot + len) * d],
            pos: KvPositions::Range { start: pos as u32 },
        };
        if !l.spec.ring {
            debug_assert!(hi <= cap);
            return [Some(seg(lo, lo, hi - lo)), None];
        }
        debug_assert!(hi - lo <= cap, "ring of {cap} cannot hold [{lo}, {hi})");
        let s = lo % cap;
        let first = (cap - s).min(hi - lo);
        let a = Some(seg(s, lo, first));
        let b = (first < hi - lo).then(|| seg(0, lo + first, hi - lo - first));
        [a, b]
    }

    /// Raw K and V of one kv head over all slots (`[capacity, head_dim]`), for policies that
    /// gather tokens (compact buffers, key norms).
    pub fn head_slab(&self, layer: usize, h: usize) -> (&[T], &[T]) {
        let l = &self.layers[layer];
        let n = l.spec.capacity * self.head_dim;
        (&l.k[h * n..(h + 1) * n], &l.v[h * n..(h + 1) * n])
    }
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
        let [a, b] = s.segments(0, 1, 3, 8);
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
        let [a, b] = s.segments(0, 0, 4, 10);
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
        let [a, _] = s.segments(0, 0, 0, 1);
        let a = a.unwrap();
        assert_eq!(a.k[0].to_f32(), 1.0);
        assert!((a.k[1].to_f32() - 0.1).abs() < 1e-3);
        assert_eq!(a.v[1].to_f32(), -0.5);
    }
}
