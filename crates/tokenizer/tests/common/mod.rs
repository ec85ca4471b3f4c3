//! A minimal GGUF v3 writer (metadata only) for tokenizer tests.
#![allow(dead_code)]

pub enum V {
    Str(&'static str),
    Bool(bool),
    U32(u32),
    I32(i32),
    Strs(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file with metadata only.
pub fn gguf(kvs: &[(&str, V)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_str(&mut out, k);
        match v {
            V::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            V::Bool(b) => {
                out.extend(7u32.to_le_bytes());
                out.push(*b as u8);
            }
            V::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            V::I32(x) => {
                out.extend(5u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            V::Strs(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for s in a {
                    put_str(&mut out, s);
                }
            }
            V::F32s(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    out.extend(x.to_le_bytes());
                }
            }
            V::I32s(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
    out
}
