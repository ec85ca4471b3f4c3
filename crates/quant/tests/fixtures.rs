//! Dequantization must equal gguf-py's `gguf.quants.dequantize` bit for bit
//! (fixtures made by tests/fixtures/make_fixtures.py from real GGUF rows and random blocks, and
//! for Q4_1, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL and IQ4_XS by scripts/fixtures/make_quant_fixtures.py
//! from random blocks; gguf-py version in tests/fixtures/new_types.txt). gguf-py computes each
//! value with the same f32 operations in the same order as ggml (e.g. `(d * sc) * q - dmin * m`),
//! so the comparison is exact, not within a tolerance.

use slowfast_quant::{dequantize_row, GgmlType};
use std::path::PathBuf;

fn fixture(name: &str) -> (Vec<u8>, Vec<f32>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let raw = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
    let f = std::fs::read(dir.join(format!("{name}.f32"))).unwrap();
    let vals = f
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (raw, vals)
}

fn check(name: &str, ty: GgmlType) {
    let (raw, expected) = fixture(name);
    assert_eq!(
        raw.len(),
        ty.row_bytes(expected.len()).unwrap(),
        "{name}: fixture sizes"
    );
    let mut got = vec![0.0f32; expected.len()];
    dequantize_row(ty, &raw, &mut got).unwrap();
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            g.to_bits(),
            e.to_bits(),
            "{name}[{i}]: got {g}, gguf-py says {e}"
        );
    }
}

#[test]
fn real_rows_match_gguf_py() {
    check("real_q8_0", GgmlType::Q8_0);
    check("real_q5_0", GgmlType::Q5_0);
    check("real_q4_k", GgmlType::Q4_K);
    check("real_q6_k", GgmlType::Q6_K);
}

#[test]
fn random_blocks_match_gguf_py() {
    check("random_q8_0", GgmlType::Q8_0);
    check("random_q5_0", GgmlType::Q5_0);
    check("random_q4_0", GgmlType::Q4_0);
    check("random_q4_k", GgmlType::Q4_K);
    check("random_q6_k", GgmlType::Q6_K);
}

#[test]
fn random_blocks_of_the_newer_types_match_gguf_py() {
    check("random_q4_1", GgmlType::Q4_1);
    check("random_q5_1", GgmlType::Q5_1);
    check("random_q2_k", GgmlType::Q2_K);
    check("random_q3_k", GgmlType::Q3_K);
    check("random_q5_k", GgmlType::Q5_K);
    check("random_iq4_nl", GgmlType::IQ4_NL);
    check("random_iq4_xs", GgmlType::IQ4_XS);
}
