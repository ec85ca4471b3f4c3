//! GGUF v2/v3 reader: metadata key/values, tensor directory, and zero-copy (mmap) tensor data.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::LoadError;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Sanity bounds so a corrupt header cannot make us allocate absurd amounts.
const MAX_COUNT: u64 = 1 << 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// Integer value of any integer (or bool) variant.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            GgufValue::U8(v) => v as i64,
            GgufValue::I8(v) => v as i64,
            GgufValue::U16(v) => v as i64,
            GgufValue::I16(v) => v as i64,
            GgufValue::U32(v) => v as i64,
            GgufValue::I32(v) => v as i64,
            GgufValue::U64(v) => i64::try_from(v).ok()?,
            GgufValue::I64(v) => v,
            GgufValue::Bool(v) => v as i64,
            _ => return None,
        })
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A tensor's directory entry. `dims` are in GGUF order (fastest-varying first): a weight of
/// `[out, in]` in PyTorch terms appears as `dims = [in, out]`.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    /// ggml type id (see `slowfast_quant::GgmlType`).
    pub ggml_type: u32,
    /// Offset of the data from the start of the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An opened GGUF file: parsed header plus the mmap'd bytes.
pub struct GgufFile {
    path: PathBuf,
    pub version: u32,
    metadata: HashMap<String, GgufValue>,
    /// Keys in file order (for `info`).
    keys: Vec<String>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
    mmap: Arc<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("keys", &self.keys.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "unexpected end of file at byte {} (wanted {} more bytes; file has {})",
                    self.pos,
                    n,
                    self.buf.len()
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn count(&mut self, what: &str) -> Result<u64, String> {
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(format!("implausible {what} count {n}"));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.count("string length")? as usize;
        let bytes = self.take(n)?;
        // Token strings in some vocabularies are not valid UTF-8; keep them lossily rather
        // than refusing the whole file.
        Ok(match std::str::from_utf8(bytes) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(bytes).into_owned(),
        })
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<GgufValue, String> {
        Ok(match ty {
            0 => GgufValue::U8(self.arr::<1>()?[0]),
            1 => GgufValue::I8(self.arr::<1>()?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => match self.arr::<1>()?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("invalid bool byte {b}")),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err("arrays nested too deeply".into());
                }
                let elem_ty = self.u32()?;
                let n = self.count("array element")?;
                // Refuse counts the rest of the file cannot hold (each element takes at least
                // `min_value_size` bytes) before reserving anything.
                let left = (self.buf.len() - self.pos) as u64;
                if n.saturating_mul(min_value_size(elem_ty)) > left {
                    return Err(format!("array of {n} elements exceeds the file size"));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr()?)),
            t => return Err(format!("unknown metadata value type {t}")),
        })
    }
}

/// The fewest bytes a metadata value of type `ty` occupies in the file.
fn min_value_size(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

/// (block size in elements, bytes per block) for the ggml types a GGUF may hold.
fn ggml_layout(ty: u32) -> Option<(u64, u64)> {
    Some(match ty {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        8 => (32, 34),    // Q8_0
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        15 => (256, 292), // Q8_K
        20 => (32, 18),   // IQ4_NL
        23 => (256, 136), // IQ4_XS
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        30 => (1, 2),     // BF16
        _ => return None,
    })
}

/// The parsed header of a GGUF image (everything but the mapping).
struct Header {
    version: u32,
    metadata: HashMap<String, GgufValue>,
    keys: Vec<String>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
}

/// Parse and check a GGUF header against `buf` (the whole file): every count and length is
/// checked against the bytes left before anything is allocated from it.
fn parse_header(buf: &[u8]) -> Result<Header, String> {
    let bad = |msg: String| msg;
    let mut c = Cursor { buf, pos: 0 };
    let magic = c
        .take(4)
        .map_err(|_| bad("file is shorter than the 4-byte magic".into()))?;
    if magic != GGUF_MAGIC {
        return Err(bad(format!("bad magic {magic:02x?} (expected \"GGUF\")")));
    }
    let version = c.u32().map_err(&bad)?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!(
            "unsupported GGUF version {version} (supported: 2, 3)"
        )));
    }
    let n_tensors = c.count("tensor").map_err(&bad)?;
    let n_kv = c.count("metadata").map_err(&bad)?;
    let mut metadata = HashMap::new();
    let mut keys = Vec::new();
    for i in 0..n_kv {
        let key = c
            .string()
            .map_err(|e| bad(format!("metadata entry {i}: {e}")))?;
        let ty = c.u32().map_err(|e| bad(format!("metadata `{key}`: {e}")))?;
        let v = c
            .value(ty, 0)
            .map_err(|e| bad(format!("metadata `{key}`: {e}")))?;
        keys.push(key.clone());
        metadata.insert(key, v);
    }
    // A tensor entry takes at least 32 bytes (empty name, one dim): never reserve more
    // entries than the rest of the input could hold.
    let room = (buf.len() - c.pos) as u64 / 32;
    let mut tensors = Vec::with_capacity(n_tensors.min(room) as usize);
    for i in 0..n_tensors {
        let name = c
            .string()
            .map_err(|e| bad(format!("tensor entry {i}: {e}")))?;
        let ctx = |e: String| bad(format!("tensor `{name}`: {e}"));
        let n_dims = c.u32().map_err(ctx)?;
        if n_dims == 0 || n_dims > 4 {
            return Err(ctx(format!("invalid number of dimensions {n_dims}")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64().map_err(ctx)?);
        }
        let ggml_type = c.u32().map_err(ctx)?;
        let offset = c.u64().map_err(ctx)?;
        let (bs, ts) = ggml_layout(ggml_type)
            .ok_or_else(|| ctx(format!("unknown ggml tensor type id {ggml_type}")))?;
        let n: u64 = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| ctx(format!("dimensions {dims:?} overflow")))?;
        if dims[0] % bs != 0 {
            return Err(ctx(format!(
                "row length {} is not a multiple of the type's block size {bs}",
                dims[0]
            )));
        }
        let size = (n / bs)
            .checked_mul(ts)
            .ok_or_else(|| ctx(format!("dimensions {dims:?} overflow")))?;
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            size,
        });
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_i64() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
            _ => return Err(bad(format!("invalid general.alignment {v:?}"))),
        },
    };
    let file_len = buf.len() as u64;
    let data_start = (c.pos as u64)
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or_else(|| bad(format!("general.alignment {alignment} is too large")))?;
    let mut index = HashMap::new();
    for (i, t) in tensors.iter_mut().enumerate() {
        if t.offset % alignment != 0 {
            return Err(bad(format!(
                "tensor `{}` data offset {} is not aligned to {alignment}",
                t.name, t.offset
            )));
        }
        let start = data_start.saturating_add(t.offset);
        let end = start.saturating_add(t.size);
        if end > file_len {
            return Err(bad(format!(
                    "tensor `{}` data [{start}, {end}) lies past the end of the file ({file_len} bytes): the file is truncated",
                    t.name
                )));
        }
        t.offset = start;
        if index.insert(t.name.clone(), i).is_some() {
            return Err(bad(format!("duplicate tensor name `{}`", t.name)));
        }
    }
    Ok(Header {
        version,
        metadata,
        keys,
        tensors,
        index,
    })
}

impl GgufFile {
    /// Open and parse a GGUF file. The tensor data stays memory-mapped.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| LoadError::io(&path, e))?;
        // SAFETY: the file is opened read-only; slowfast never writes model files while running.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(&path, e))?;
        let h = parse_header(&mmap).map_err(|msg| LoadError::BadGguf {
            path: path.clone(),
            msg,
        })?;
        Ok(Self::assemble(path, h, mmap))
    }

    /// Parse a GGUF image held in memory (same checks as `open`). The header is parsed
    /// straight from `bytes`; only a valid file is copied into an anonymous mapping so that
    /// `tensor_data` / `shared_mmap` work as for a file. `path()` is `<memory>`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, LoadError> {
        let path = PathBuf::from("<memory>");
        let h = parse_header(bytes).map_err(|msg| LoadError::BadGguf {
            path: path.clone(),
            msg,
        })?;
        let mut anon =
            memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(|e| LoadError::io(&path, e))?;
        anon[..bytes.len()].copy_from_slice(bytes);
        let mmap = anon.make_read_only().map_err(|e| LoadError::io(&path, e))?;
        Ok(Self::assemble(path, h, mmap))
    }

    fn assemble(path: PathBuf, h: Header, mmap: Mmap) -> Self {
        GgufFile {
            path,
            version: h.version,
            metadata: h.metadata,
            keys: h.keys,
            tensors: h.tensors,
            index: h.index,
            mmap: Arc::new(mmap),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The whole mapped file, shared, so tensors can be referenced without copying.
    pub fn shared_mmap(&self) -> Arc<Mmap> {
        Arc::clone(&self.mmap)
    }
    /// Metadata keys in file order.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        u32::try_from(self.get(key)?.as_i64()?).ok()
    }
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f64().map(|v| v as f32)
    }
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.get(key)? {
            GgufValue::Bool(b) => Some(*b),
            v => v.as_i64().map(|i| i != 0),
        }
    }
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_str())
            .collect()
    }
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_f64().map(|x| x as f32))
            .collect()
    }
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_i64().and_then(|x| i32::try_from(x).ok()))
            .collect()
    }
    /// A required string key, with an error naming the file and key.
    pub fn require_str(&self, key: &str) -> Result<&str, LoadError> {
        self.get_str(key).ok_or_else(|| self.missing(key))
    }
    pub fn require_u32(&self, key: &str) -> Result<u32, LoadError> {
        self.get_u32(key).ok_or_else(|| self.missing(key))
    }
    pub fn require_f32(&self, key: &str) -> Result<f32, LoadError> {
        self.get_f32(key).ok_or_else(|| self.missing(key))
    }
    fn missing(&self, key: &str) -> LoadError {
        LoadError::MissingKey {
            path: self.path.clone(),
            key: key.to_owned(),
        }
    }
    /// `general.architecture`, e.g. "gemma3".
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
    /// The raw bytes of a tensor (zero-copy).
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        let t = self.tensor_info(name)?;
        Some(&self.mmap[t.offset as usize..(t.offset + t.size) as usize])
    }
    /// Like `tensor_data`, with an error naming the missing tensor.
    pub fn require_tensor(&self, name: &str) -> Result<(&GgufTensorInfo, &[u8]), LoadError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| LoadError::MissingTensor {
                path: self.path.clone(),
                name: name.to_owned(),
            })?;
        Ok((
            info,
            &self.mmap[info.offset as usize..(info.offset + info.size) as usize],
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn put_str(b: &mut Vec<u8>, s: &str) {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }

    /// A tiny valid GGUF: two metadata keys and one F32 tensor of 4 elements.
    fn tiny() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(3u64.to_le_bytes()); // kv
        put_str(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        put_str(&mut b, "llama");
        put_str(&mut b, "llama.block_count");
        b.extend(4u32.to_le_bytes());
        b.extend(2u32.to_le_bytes());
        put_str(&mut b, "tokenizer.ggml.scores");
        b.extend(9u32.to_le_bytes());
        b.extend(6u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0.5f32.to_le_bytes());
        b.extend((-1.5f32).to_le_bytes());
        put_str(&mut b, "w");
        b.extend(1u32.to_le_bytes());
        b.extend(4u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for x in [1.0f32, 2.0, 3.0, 4.0] {
            b.extend(x.to_le_bytes());
        }
        b
    }

    fn write_tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("slowfast-gguf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    #[test]
    fn parses_tiny_file() {
        let p = write_tmp("ok.gguf", &tiny());
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.architecture(), Some("llama"));
        assert_eq!(g.get_u32("llama.block_count"), Some(2));
        assert_eq!(
            g.get_f32_array("tokenizer.ggml.scores"),
            Some(vec![0.5, -1.5])
        );
        let d = g.tensor_data("w").unwrap();
        let vals: Vec<f32> = d
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(vals, vec![1.0, 2.0, 3.0, 4.0]);
        assert!(matches!(
            g.require_tensor("nope"),
            Err(LoadError::MissingTensor { .. })
        ));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = tiny();
        for len in 0..full.len() {
            let p = write_tmp(&format!("trunc{len}.gguf"), &full[..len]);
            let err = GgufFile::open(&p).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("trunc"), "error should name the file: {msg}");
        }
    }

    #[test]
    fn corrupt_header_fields_are_errors() {
        let mut bad_magic = tiny();
        bad_magic[0] = b'X';
        let e = GgufFile::open(write_tmp("magic.gguf", &bad_magic)).unwrap_err();
        assert!(e.to_string().contains("bad magic"), "{e}");

        let mut bad_version = tiny();
        bad_version[4] = 9;
        let e = GgufFile::open(write_tmp("ver.gguf", &bad_version)).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");

        let mut huge_count = tiny();
        huge_count[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = GgufFile::open(write_tmp("count.gguf", &huge_count)).unwrap_err();
        assert!(e.to_string().contains("implausible"), "{e}");
    }

    /// A header with one tensor `w` of `dims`/`ty`/`offset` and optional extra metadata.
    fn one_tensor(dims: &[u64], ty: u32, offset: u64, alignment: Option<u64>) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend((alignment.is_some() as u64).to_le_bytes());
        if let Some(a) = alignment {
            put_str(&mut b, "general.alignment");
            b.extend(10u32.to_le_bytes());
            b.extend(a.to_le_bytes());
        }
        put_str(&mut b, "w");
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        b.extend([0u8; 64]);
        b
    }

    // Regressions found by reviewing the parser for the fuzzers (docs/fuzzing.md): each was
    // an arithmetic overflow (a panic in debug builds, a wrong size/offset in release).
    #[test]
    fn tensor_size_overflow_is_an_error() {
        // 2^62 F32 elements: the byte size 2^64 does not fit a u64.
        let e = GgufFile::from_bytes(&one_tensor(&[1 << 62], 0, 0, None)).unwrap_err();
        assert!(e.to_string().contains("overflow"), "{e}");
        // Q8_K: n / 256 * 292 overflows although n does not.
        let dims = [256, 0xF0_0000_0000_0000];
        let e = GgufFile::from_bytes(&one_tensor(&dims, 15, 0, None)).unwrap_err();
        assert!(e.to_string().contains("overflow"), "{e}");
    }

    #[test]
    fn every_weight_type_the_quant_crate_supports_has_its_layout() {
        // (ggml id, row length, bytes of that row): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
        // Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS, BF16.
        let cases = [
            (2, 32, 18),
            (3, 32, 20),
            (6, 32, 22),
            (7, 32, 24),
            (8, 32, 34),
            (10, 256, 84),
            (11, 256, 110),
            (12, 256, 144),
            (13, 256, 176),
            (14, 256, 210),
            (15, 256, 292),
            (20, 32, 18),
            (23, 256, 136),
            (30, 1, 2),
        ];
        for (ty, n, bytes) in cases {
            let mut b = one_tensor(&[n, 2], ty, 0, None);
            b.extend([0u8; 1024]);
            let g = GgufFile::from_bytes(&b).unwrap_or_else(|e| panic!("type {ty}: {e}"));
            assert_eq!(g.tensor_data("w").unwrap().len(), 2 * bytes, "type {ty}");
        }
    }

    #[test]
    fn huge_alignment_is_an_error() {
        let e = GgufFile::from_bytes(&one_tensor(&[4], 0, 0, Some(1 << 63))).unwrap_err();
        assert!(e.to_string().contains("invalid general.alignment"), "{e}");
        let e = GgufFile::from_bytes(&one_tensor(&[4], 0, 0, Some(1 << 62))).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
    }

    #[test]
    fn huge_data_offset_is_an_error() {
        // data_start + offset wrapped around to a small in-file offset.
        let off = u64::MAX - 31;
        let e = GgufFile::from_bytes(&one_tensor(&[4], 0, off, None)).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
    }

    #[test]
    fn counts_are_checked_against_the_input_before_allocating() {
        // A 2^32-element u64 array and 2^32 tensors claimed by a 60-byte file.
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend((1u64 << 32).to_le_bytes());
        b.extend(1u64.to_le_bytes());
        put_str(&mut b, "a");
        b.extend(9u32.to_le_bytes());
        b.extend(10u32.to_le_bytes());
        b.extend((1u64 << 32).to_le_bytes());
        b.extend([0u8; 16]);
        let e = GgufFile::from_bytes(&b).unwrap_err();
        assert!(e.to_string().contains("exceeds the file size"), "{e}");
        let mut c = b[..24].to_vec();
        c[16..24].copy_from_slice(&0u64.to_le_bytes());
        c.extend([0u8; 40]);
        let e = GgufFile::from_bytes(&c).unwrap_err();
        assert!(
            e.to_string().contains("invalid number of dimensions"),
            "{e}"
        );
    }

    #[test]
    fn from_bytes_matches_open() {
        let bytes = tiny();
        let a = GgufFile::from_bytes(&bytes).unwrap();
        let b = GgufFile::open(write_tmp("same.gguf", &bytes)).unwrap();
        assert_eq!(a.keys(), b.keys());
        assert_eq!(a.tensor_data("w"), b.tensor_data("w"));
        for len in 0..bytes.len() {
            assert!(GgufFile::from_bytes(&bytes[..len]).is_err());
        }
    }

    #[test]
    fn real_model_header_if_present() {
        let Some(p) = crate::test_model_path() else {
            return;
        };
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.architecture(), Some("gemma3"));
        assert_eq!(g.get_u32("gemma3.block_count"), Some(18));
        assert_eq!(g.tensors().len(), 236);
        let (info, data) = g.require_tensor("token_embd.weight").unwrap();
        assert_eq!(info.dims, vec![640, 262144]);
        assert_eq!(data.len() as u64, 262144 * 640 / 32 * 34);
    }
}
