//! Safetensors checkpoints: one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`, memory-mapped, tensors looked up by name.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::tensor::Dtype;

use crate::LoadError;

/// One tensor's place in a mapped shard.
#[derive(Debug, Clone)]
pub struct StTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub shard: usize,
    /// Byte range inside the shard's mapping.
    pub start: usize,
    pub end: usize,
}

/// A set of mapped safetensors shards with a name index.
pub struct SafetensorsSet {
    pub shards: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: HashMap<String, StTensor>,
}

impl SafetensorsSet {
    /// Open the checkpoint of an HF model directory (single file or sharded with an index).
    pub fn open_dir(dir: &Path) -> Result<Self, LoadError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.is_file() {
            return Self::open_files(&[single]);
        }
        if index.is_file() {
            let text = std::fs::read(&index).map_err(|e| LoadError::io(&index, e))?;
            let files = parse_index(&text).map_err(|msg| LoadError::BadConfig {
                path: index.clone(),
                msg,
            })?;
            let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
            return Self::open_files(&paths);
        }
        Err(LoadError::Other(format!(
            "{}: no model.safetensors or model.safetensors.index.json",
            dir.display()
        )))
    }

    /// Open and index the given shard files.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self, LoadError> {
        let mut shards = Vec::new();
        let mut tensors = HashMap::new();
        for (si, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
            // SAFETY: read-only mapping of a checkpoint file that is not modified while in use.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
            let bad = |msg: String| LoadError::BadSafetensors {
                path: path.clone(),
                msg,
            };
            for (name, mut t) in parse_header(&mmap).map_err(bad)? {
                t.shard = si;
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(bad(format!(
                        "tensor `{name}` appears in more than one shard"
                    )));
                }
            }
            shards.push((path.clone(), Arc::new(mmap)));
        }
        Ok(SafetensorsSet { shards, tensors })
    }

    pub fn get(&self, name: &str) -> Option<&StTensor> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// The raw bytes of a tensor.
    pub fn data(&self, t: &StTensor) -> &[u8] {
        &self.shards[t.shard].1[t.start..t.end]
    }

    /// Path of the first shard (for error messages).
    pub fn describe(&self) -> String {
        match self.shards.as_slice() {
            [(p, _)] => p.display().to_string(),
            [(p, _), ..] => format!("{} (+{} more shards)", p.display(), self.shards.len() - 1),
            [] => "(no shards)".into(),
        }
    }
}

/// Parse a `model.safetensors.index.json`: the sorted, deduplicated shard file names of its
/// `weight_map`, each checked to be a plain file name.
pub fn parse_index(bytes: &[u8]) -> Result<Vec<String>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| "missing `weight_map` object".to_string())?;
    let mut files: Vec<String> = map
        .values()
        .map(|f| {
            f.as_str()
                .map(str::to_owned)
                .ok_or_else(|| "`weight_map` values must be file names".to_string())
        })
        .collect::<Result<_, _>>()?;
    files.sort();
    files.dedup();
    for f in &files {
        if f.is_empty() || f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(format!("shard name {f:?} must be a plain file name"));
        }
    }
    Ok(files)
}

/// Parse and check one shard's header against the whole shard image `bytes`: every tensor's
/// byte range must lie inside the file and match its dtype and shape. Tensors come back with
/// `shard = 0`; ranges are offsets into `bytes`.
pub fn parse_header(bytes: &[u8]) -> Result<Vec<(String, StTensor)>, String> {
    let (header_len, meta) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| format!("{e:?}"))?;
    let data_start = header_len
        .checked_add(8)
        .ok_or_else(|| "header length overflows".to_string())?;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let (a, b) = info.data_offsets;
        let range = data_start
            .checked_add(a)
            .zip(data_start.checked_add(b))
            .filter(|&(s, e)| s <= e && e <= bytes.len());
        let Some((start, end)) = range else {
            return Err(format!("tensor `{name}` lies past the end of the file"));
        };
        let size = info
            .shape
            .iter()
            .try_fold(1usize, |x, &d| x.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()))
            .map(|bits| bits / 8);
        if size != Some(end - start) {
            return Err(format!(
                "tensor `{name}` has a size that does not match its shape"
            ));
        }
        out.push((
            name.clone(),
            StTensor {
                dtype: info.dtype,
                shape: info.shape.clone(),
                shard: 0,
                start,
                end,
            },
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("slowfast-st-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn tiny_file(path: &Path) {
        let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 3], &data).unwrap();
        safetensors::serialize_to_file([("w", view)], None, path).unwrap();
    }

    #[test]
    fn reads_a_tensor() {
        let d = tmpdir("ok");
        tiny_file(&d.join("model.safetensors"));
        let s = SafetensorsSet::open_dir(&d).unwrap();
        let t = s.get("w").unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(&s.data(t)[4..8], &2.0f32.to_le_bytes());
    }

    #[test]
    fn truncated_and_corrupt_files_are_errors() {
        let d = tmpdir("bad");
        let p = d.join("model.safetensors");
        tiny_file(&p);
        let full = std::fs::read(&p).unwrap();
        for len in [0, 4, 8, 20, full.len() - 1] {
            std::fs::write(&p, &full[..len]).unwrap();
            let e = SafetensorsSet::open_dir(&d).err().expect("must fail");
            assert!(e.to_string().contains("model.safetensors"), "{e}");
        }
        let mut garbage = full.clone();
        garbage[10] = b'{';
        garbage[11] = b'{';
        std::fs::write(&p, &garbage).unwrap();
        assert!(SafetensorsSet::open_dir(&d).is_err());
    }

    #[test]
    fn missing_checkpoint_is_an_error() {
        let d = tmpdir("empty");
        let e = SafetensorsSet::open_dir(&d).err().unwrap();
        assert!(e.to_string().contains("no model.safetensors"), "{e}");
    }
}
