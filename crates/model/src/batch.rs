//! Batched decode for continuous batching: one token of each of several independent sequences
//! (each with its own KV store, policy and position) in one forward. The matrix products run
//! over all rows at once, RoPE, K/V writes and attention per row; each row's logits are
//! bit-equal to a one-token `Model::forward_with` of its sequence alone, whatever the batch.
use slowfast_kv::{CacheElem, KvPolicy, KvStore};

use crate::attention::attend_layer;
use crate::decoder::{LogitsRows, Model, RowPos, Rows, Scratch};
use crate::ModelError;

/// One sequence of a batched decode step: the token it feeds (at position `cache.len()`), its
/// KV store and the policy deciding what its attention reads.
pub struct DecodeRow<'a, T: CacheElem> {
    pub token: u32,
    pub cache: &'a mut KvStore<T>,
    pub policy: &'a mut dyn KvPolicy<T>,
}

/// Prefix a row's compute error with the row.
fn in_row(i: usize, e: ModelError) -> ModelError {
    match e {
        ModelError::Compute(m) => ModelError::Compute(format!("row {i}: {m}")),
        e => e,
    }
}

impl Model {
    /// Check a batch for `decode_batch` without touching it: at least one row, every token
    /// inside the vocabulary, room for one more token in every cache. Errors name the row.
    pub fn check_decode_batch<T: CacheElem>(
        &self,
        rows: &[DecodeRow<'_, T>],
    ) -> Result<(), ModelError> {
        if rows.is_empty() {
            return Err(ModelError::Compute(
                "decode_batch called with no rows".into(),
            ));
        }
        let vocab = self.cfg.vocab_size;
        for (i, r) in rows.iter().enumerate() {
            if r.token as usize >= vocab {
                return Err(ModelError::Compute(format!(
                    "row {i}: token id {} is outside the vocabulary of {vocab} tokens",
                    r.token
                )));
            }
            let (needed, cap) = (r.cache.len() + 1, r.cache.capacity());
            if needed > cap || u32::try_from(needed).is_err() {
                return Err(ModelError::Compute(format!(
                    "row {i}: the sequence needs {needed} tokens of context but the KV cache holds {cap}"
                )));
            }
        }
        Ok(())
    }

    /// Decode one token for every row, each at its own position `cache.len()` against its own
    /// cache and policy (exactly as a one-token `forward_with`: the same `attend_layer` call,
    /// then `set_len` and `end_forward(pos, 1)`). `logits` receives `[rows.len(), vocab]`.
    pub fn decode_batch<T: CacheElem>(
        &self,
        rows: &mut [DecodeRow<'_, T>],
        s: &mut Scratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.check_decode_batch(rows)?;
        let c = &self.cfg;
        let n = rows.len();
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        // Fits: `check_decode_batch` bounds every position by u32.
        let pos: Vec<u32> = rows.iter().map(|r| r.cache.len() as u32).collect();
        self.embed(&tokens, s)?;
        self.rope(RowPos::List(&pos), n, s);
        let qw = c.num_attention_heads * c.head_dim;
        let kw = c.num_key_value_heads * c.head_dim;
        let share = self.kv_share();
        for l in 0..c.num_hidden_layers {
            self.layer(l, n, Rows::Independent, s, |a| {
                for (i, (r, &p)) in rows.iter_mut().zip(&pos).enumerate() {
                    let (p, kv) = (p as usize, i * kw..(i + 1) * kw);
                    r.cache
                        .write(l, p, &a.k[kv.clone()], &a.v[kv])
                        .map_err(|e| ModelError::Compute(format!("row {i}, layer {l}: {e}")))?;
                    let (q, out) = (&a.q[i * qw..(i + 1) * qw], &mut a.out[i * qw..(i + 1) * qw]);
                    attend_layer(c, l, q, p, 1, a.window, None, r.cache, r.policy, out, share)
                        .map_err(|e| in_row(i, e))?;
                }
                Ok(())
            })?;
        }
        for (r, &p) in rows.iter_mut().zip(&pos) {
            r.cache.set_len(p as usize + 1);
            r.policy.end_forward(p as usize, 1);
        }
        self.head(n, LogitsRows::All, Rows::Independent, s, logits)
    }
}

#[cfg(test)]
mod tests {
    use slowfast_kv::{FullPolicy, StreamingPolicy};
    use slowfast_quant::{gemm_crossover, GgmlType};

    use super::*;
    use crate::MatmulPrecision;

    /// A tiny Gemma 3 shape: sliding layers (window 6) around a global one, q/k and post norms.
    fn gemma_like(ty: GgmlType) -> Model {
        let mut cfg = crate::presets::gemma3(64, 3, 4, 2, 32, 96, 80, 6, 3);
        cfg.max_position_embeddings = 4096;
        let w = crate::random::random_weights(&cfg, ty, 3).unwrap();
        Model::new(cfg, w).unwrap()
    }

    /// A tiny Qwen2 shape: q/k/v biases, untied head, the last layer sliding (window 5).
    fn qwen2_like(ty: GgmlType) -> Model {
        let mut cfg = crate::presets::qwen2(64, 3, 4, 2, 16, 96, 80, false);
        cfg.sliding_window = Some(5);
        cfg.layer_sliding = vec![false, false, true];
        let w = crate::random::random_weights(&cfg, ty, 4).unwrap();
        assert!(w
            .layers
            .iter()
            .all(|l| l.bq.is_some() && l.bk.is_some() && l.bv.is_some()));
        Model::new(cfg, w).unwrap()
    }

    struct Seq {
        cache: KvStore<f32>,
        policy: Box<dyn KvPolicy<f32>>,
    }

    /// `n` sequences of prompt lengths 3, 8, 13, .. (prefilled in chunks of 4), alternating
    /// dense and streaming attention.
    fn sequences(m: &Model, n: usize, s: &mut Scratch) -> Vec<Seq> {
        (0..n)
            .map(|i| {
                let mut seq = Seq {
                    cache: m.new_cache(64, 4),
                    policy: if i % 2 == 0 {
                        Box::new(FullPolicy::new())
                    } else {
                        Box::new(StreamingPolicy::new(2, 5))
                    },
                };
                let prompt: Vec<u32> = (0..3 + 5 * (i % 7))
                    .map(|t| (t * 7 + i) as u32 % 80)
                    .collect();
                let mut lg = Vec::new();
                for (j, chunk) in prompt.chunks(4).enumerate() {
                    m.forward_with(
                        chunk,
                        4 * j,
                        &mut seq.cache,
                        seq.policy.as_mut(),
                        s,
                        LogitsRows::Last,
                        &mut lg,
                    )
                    .unwrap();
                }
                seq
            })
            .collect()
    }

    /// Decode `steps` tokens in every sequence one by one and batched: bit-equal logits.
    fn check(m: &Model, n: usize, steps: usize) {
        let mut s = Scratch::default();
        let mut alone = sequences(m, n, &mut s);
        let mut batched = sequences(m, n, &mut s);
        let v = m.cfg.vocab_size;
        let (mut want, mut got) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let tokens: Vec<u32> = (0..n).map(|i| ((i * 31 + step * 17) % v) as u32).collect();
            let mut rows: Vec<DecodeRow<'_, f32>> = batched
                .iter_mut()
                .zip(&tokens)
                .map(|(q, &token)| DecodeRow {
                    token,
                    cache: &mut q.cache,
                    policy: q.policy.as_mut(),
                })
                .collect();
            m.decode_batch(&mut rows, &mut s, &mut got).unwrap();
            assert_eq!(got.len(), n * v);
            for (i, q) in alone.iter_mut().enumerate() {
                let pos = q.cache.len();
                m.forward_with(
                    &tokens[i..i + 1],
                    pos,
                    &mut q.cache,
                    q.policy.as_mut(),
                    &mut s,
                    LogitsRows::Last,
                    &mut want,
                )
                .unwrap();
                let row = &got[i * v..(i + 1) * v];
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(row), bits(&want), "row {i} of {n}, step {step}");
                assert_eq!(batched[i].cache.len(), pos + 1);
            }
        }
    }

    #[test]
    fn batched_rows_equal_one_token_forwards() {
        let f32_model = gemma_like(GgmlType::F32);
        assert_eq!(gemm_crossover(GgmlType::F32), 32);
        check(&f32_model, 33, 4); // past the GEMM crossover
        check(&gemma_like(GgmlType::Q8_0), 5, 6);
        let mut exact = gemma_like(GgmlType::Q8_0);
        exact.precision = MatmulPrecision::Exact;
        check(&exact, 33, 3);
    }

    #[test]
    fn batched_rows_with_qkv_biases_equal_one_token_forwards() {
        check(&qwen2_like(GgmlType::F32), 33, 3);
        check(&qwen2_like(GgmlType::Q8_0), 5, 5);
    }

    /// `verify_forward` of `k` tokens after each prompt (with a rejected tail cut off and
    /// verified again) against one-token forwards: bit-equal logits and K/V.
    fn check_verify(m: &Model, k: usize) {
        let mut s = Scratch::default();
        let v = m.cfg.vocab_size;
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (alone, mut verified) in sequences(m, 6, &mut s)
            .into_iter()
            .zip(sequences(m, 6, &mut s))
        {
            let mut alone = alone;
            let p0 = alone.cache.len();
            let tokens: Vec<u32> = (0..k).map(|i| ((p0 * 13 + i * 29) % v) as u32).collect();
            let (mut want, mut row) = (Vec::new(), Vec::new());
            for (i, t) in tokens.iter().enumerate() {
                m.forward_with(
                    &[*t],
                    p0 + i,
                    &mut alone.cache,
                    alone.policy.as_mut(),
                    &mut s,
                    LogitsRows::Last,
                    &mut row,
                )
                .unwrap();
                want.extend_from_slice(&row);
            }
            // A first verification whose last rows are rejected, then the real one.
            let mut got = Vec::new();
            let junk: Vec<u32> = tokens.iter().map(|t| (t + 1) % v as u32).collect();
            let pol = verified.policy.as_mut();
            m.verify_forward(&junk, p0, &mut verified.cache, pol, &mut s, &mut got)
                .unwrap();
            verified.cache.truncate(p0);
            m.verify_forward(&tokens, p0, &mut verified.cache, pol, &mut s, &mut got)
                .unwrap();
            assert_eq!(got.len(), k * v);
            assert_eq!(bits(&got), bits(&want), "prompt of {p0} tokens");
            assert_eq!(verified.cache.len(), p0 + k);
            for l in 0..m.cfg.num_hidden_layers {
                let lo = alone.cache.len().saturating_sub(alone.cache.held(l, 0));
                for h in 0..m.cfg.num_key_value_heads {
                    let seg = |c: &KvStore<f32>| {
                        c.segments(l, h, lo, p0 + k)
                            .into_iter()
                            .flat_map(|g| {
                                g.k.iter()
                                    .chain(g.v)
                                    .map(|x| x.to_bits())
                                    .collect::<Vec<_>>()
                            })
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(
                        seg(&verified.cache),
                        seg(&alone.cache),
                        "layer {l} head {h}"
                    );
                }
            }
        }
    }

    #[test]
    fn verification_rows_equal_one_token_forwards() {
        // The caches of `sequences` hold window (6) + chunk (4) slots in sliding layers: room
        // for 5 verified rows.
        check_verify(&gemma_like(GgmlType::F32), 5);
        check_verify(&gemma_like(GgmlType::Q8_0), 3);
        check_verify(&qwen2_like(GgmlType::Q8_0), 4);
        // Without sliding layers any count fits.
        let mut global = gemma_like(GgmlType::Q8_0);
        global.cfg.layer_sliding = vec![false; 3];
        check_verify(&global, 9);
    }

    #[test]
    fn a_verification_longer_than_the_ring_allows_is_an_error() {
        let m = gemma_like(GgmlType::F32);
        let mut s = Scratch::default();
        let mut seq = sequences(&m, 1, &mut s).remove(0);
        assert_eq!(m.verify_rows_max(&seq.cache), 5);
        let p0 = seq.cache.len();
        let mut lg = Vec::new();
        let e = m
            .verify_forward(
                &[1; 6],
                p0,
                &mut seq.cache,
                seq.policy.as_mut(),
                &mut s,
                &mut lg,
            )
            .unwrap_err();
        assert!(e.to_string().contains("at most 5 rows"), "{e}");
        assert_eq!(seq.cache.len(), p0, "nothing written");
    }

    #[test]
    fn bad_batches_name_the_row() {
        let m = gemma_like(GgmlType::F32);
        let mut s = Scratch::default();
        let mut lg = Vec::new();
        let empty: &mut [DecodeRow<'_, f32>] = &mut [];
        let e = m.decode_batch(empty, &mut s, &mut lg).unwrap_err();
        assert!(e.to_string().contains("no rows"), "{e}");
        let (mut c0, mut c1) = (m.new_cache::<f32>(8, 4), m.new_cache::<f32>(8, 4));
        let (mut p0, mut p1) = (FullPolicy::new(), FullPolicy::new());
        let mut rows = [
            DecodeRow {
                token: 1,
                cache: &mut c0,
                policy: &mut p0,
            },
            DecodeRow {
                token: 80,
                cache: &mut c1,
                policy: &mut p1,
            },
        ];
        let e = m.decode_batch(&mut rows, &mut s, &mut lg).unwrap_err();
        assert!(e.to_string().starts_with("row 1: token id 80"), "{e}");
        assert!(rows.iter().all(|r| r.cache.is_empty()));
        rows[1].token = 2;
        rows[1].cache.set_len(8);
        let e = m.decode_batch(&mut rows, &mut s, &mut lg).unwrap_err();
        assert!(
            e.to_string().starts_with("row 1: the sequence needs 9"),
            "{e}"
        );
    }
}
