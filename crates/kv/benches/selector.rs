//! Micro-benchmark of the SFI Selector fast path: 8 kv heads, L = 8K / 32K, decode (2 rows) and
//! bootstrap (32 rows) captures, k = 20% of L. Prints ms per call.
use slowfast_kv::sfi::selector::{
    select_into, Selection, SelectorConfig, SelectorInput, SelectorScratch,
};
use std::time::Instant;

/// xorshift64* uniform in [0, 1).
fn uniform(state: &mut u64) -> f32 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
}

fn main() {
    let cfg = SelectorConfig::default();
    let n_kv_heads = 8;
    for &seq_len in &[8192usize, 32768] {
        for &rows in &[2usize, 32] {
            let mut s = 0x1234_5678_9abc_def1u64 ^ (seq_len * rows) as u64;
            // [n_kv_heads, rows, seq_len]: noise plus sparse peaks, like captured attention logits.
            let logits: Vec<f32> = (0..n_kv_heads * rows * seq_len)
                .map(|_| {
                    let u = uniform(&mut s);
                    4.0 * u + if u > 0.995 { 8.0 } else { 0.0 }
                })
                .collect();
            let key_norms: Vec<f32> = (0..n_kv_heads * seq_len)
                .map(|_| 5.0 + 10.0 * uniform(&mut s))
                .collect();
            let inp = SelectorInput {
                n_kv_heads,
                rows,
                seq_len,
                logits: &logits,
                key_norms: &key_norms,
                sinks: 4,
                recent_start: (seq_len - 256) / 16 * 16,
                k: seq_len / 5,
                positions: None,
            };
            let mut scratch = SelectorScratch::default();
            let mut out = Selection::default();
            select_into(&cfg, &inp, &mut scratch, &mut out).expect("selector");
            let t = Instant::now();
            let mut iters = 0u32;
            while t.elapsed().as_secs_f64() < 1.0 || iters < 3 {
                select_into(&cfg, &inp, &mut scratch, &mut out).expect("selector");
                iters += 1;
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
            println!(
                "selector L={seq_len:>5} kv_heads={n_kv_heads} rows={rows:>2} k={:>5}: {ms:8.3} ms/call ({iters} calls, {} kept/head)",
                inp.k,
                out.per_head[0].len()
            );
        }
    }
}
