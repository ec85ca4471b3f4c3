//! Model weights by role: each linear layer is a `Weight` (a ggml-typed row-major matrix whose
//! bytes live in a mapped file or an owned buffer), norms are plain f32 vectors.
use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;
use slowfast_quant::{GgmlType, QMatrix};

use crate::ModelError;

/// Bytes of a weight: a range of a mapped file, or an owned buffer.
#[derive(Clone)]
pub enum Bytes {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
    Owned(Arc<Vec<u8>>),
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, start, len } => &map[*start..*start + *len],
            Bytes::Owned(v) => v,
        }
    }
}

/// A weight matrix `[rows, cols]` (rows = output features) in a ggml type.
#[derive(Clone)]
pub struct Weight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Weight({} [{}, {}])",
            self.ty.name(),
            self.rows,
            self.cols
        )
    }
}

impl Weight {
    /// Wrap bytes as a `[rows, cols]` matrix, checking the size.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: Bytes,
        name: &str,
    ) -> Result<Self, ModelError> {
        let row_bytes = ty
            .row_bytes(cols)
            .map_err(|e| ModelError::Weights(format!("`{name}`: {e}")))?;
        if data.as_slice().len() != row_bytes * rows {
            return Err(ModelError::Weights(format!(
                "`{name}`: {} bytes for a {} [{rows}, {cols}] matrix (expected {})",
                data.as_slice().len(),
                ty.name(),
                row_bytes * rows
            )));
        }
        if !ty.is_supported() {
            return Err(ModelError::Weights(format!(
                "`{name}`: tensor type {} is not supported (supported: {})",
                ty.name(),
                GgmlType::supported_names()
            )));
        }
        Ok(Weight {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn view(&self) -> QMatrix<'_> {
        QMatrix {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            data: self.data.as_slice(),
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.ty
            .row_bytes(self.cols)
            .expect("checked at construction")
    }

    /// Dequantize row `r` into `out` (`[cols]`): the embedding lookup.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let src = &self.data.as_slice()[r * rb..(r + 1) * rb];
        slowfast_quant::dequantize_row(self.ty, src, out)
            .expect("row size checked at construction");
    }

    /// The whole matrix as f32 (small tensors: norms, tests).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, o) in out.chunks_mut(self.cols).enumerate() {
            self.row_f32(r, o);
        }
        out
    }

    pub fn nbytes(&self) -> usize {
        self.data.as_slice().len()
    }

    /// Rows `rows` of the matrix (`[rows.len(), cols]`): ggml rows are whole, so this is one
    /// byte range, a view of the same mapping when the bytes are mapped.
    pub fn slice_rows(&self, rows: Range<usize>) -> Result<Weight, ModelError> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(ModelError::Weights(format!(
                "rows {rows:?} of a {self:?} matrix (expected a range within 0..{})",
                self.rows
            )));
        }
        let rb = self.row_bytes();
        let (a, b) = (rows.start * rb, rows.end * rb);
        let data = match &self.data {
            Bytes::Mapped { map, start, .. } => Bytes::Mapped {
                map: map.clone(),
                start: start + a,
                len: b - a,
            },
            Bytes::Owned(v) => Bytes::Owned(Arc::new(v[a..b].to_vec())),
        };
        Ok(Weight {
            ty: self.ty,
            rows: rows.len(),
            cols: self.cols,
            data,
        })
    }

    /// Columns `cols` of every row (`[rows, cols.len()]`), re-packed: both ends must fall on
    /// whole blocks of the weight's type (a ggml block is never split).
    pub fn slice_cols(&self, cols: Range<usize>) -> Result<Weight, ModelError> {
        let bs = self.ty.block_size();
        if cols.start > cols.end || cols.end > self.cols {
            return Err(ModelError::Weights(format!(
                "columns {cols:?} of a {self:?} matrix (expected a range within 0..{})",
                self.cols
            )));
        }
        if !crate::tp::on_blocks(&cols, bs) {
            return Err(ModelError::Weights(format!(
                "columns {cols:?} of a {self:?} matrix split its {}-value {} blocks (both ends must be multiples of {bs})",
                bs,
                self.ty.name()
            )));
        }
        let (rb, ts) = (self.row_bytes(), self.ty.type_size());
        let (a, b) = (cols.start / bs * ts, cols.end / bs * ts);
        let src = self.data.as_slice();
        let mut out = Vec::with_capacity(self.rows * (b - a));
        for r in 0..self.rows {
            out.extend_from_slice(&src[r * rb + a..r * rb + b]);
        }
        Weight::new(
            self.ty,
            self.rows,
            cols.len(),
            Bytes::Owned(Arc::new(out)),
            "column slice",
        )
    }

    /// A copy with rows reordered: row `i` of the result is row `perm[i]` of `self`.
    pub fn permute_rows(&self, perm: &[usize]) -> Weight {
        let rb = self.row_bytes();
        let src = self.data.as_slice();
        let mut out = Vec::with_capacity(src.len());
        for &p in perm {
            out.extend_from_slice(&src[p * rb..(p + 1) * rb]);
        }
        Weight {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            data: Bytes::Owned(Arc::new(out)),
        }
    }
}

/// Weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    /// Biases of the q, k and v projections (`[q_dim]`, `[kv_dim]`, `[kv_dim]`; Qwen2).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Weight,
    pub w_up: Weight,
    pub w_down: Weight,
    pub post_ffw_norm: Option<Vec<f32>>,
}

/// All weights of the generic decoder.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, hidden]`
    pub embed: Weight,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Weight>,
}

impl ModelWeights {
    pub fn lm_head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of all weights (the embedding once when tied).
    pub fn nbytes(&self) -> usize {
        let mut n = self.embed.nbytes() + self.lm_head.as_ref().map_or(0, |w| w.nbytes());
        for l in &self.layers {
            n += [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .iter()
                .map(|w| w.nbytes())
                .sum::<usize>();
        }
        n
    }

    /// Bytes read from weights by one decode step (every matrix once, one embedding row).
    pub fn decode_bytes_per_step(&self) -> usize {
        self.nbytes() - self.embed.nbytes() * usize::from(self.lm_head.is_some())
            + self.embed.row_bytes()
    }

    /// Distinct weight types with their byte totals, for `info`.
    pub fn dtype_summary(&self) -> Vec<(GgmlType, usize)> {
        let mut m: Vec<(GgmlType, usize)> = Vec::new();
        let mut add = |w: &Weight| match m.iter_mut().find(|(t, _)| *t == w.ty) {
            Some((_, n)) => *n += w.nbytes(),
            None => m.push((w.ty, w.nbytes())),
        };
        add(&self.embed);
        if let Some(h) = &self.lm_head {
            add(h);
        }
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                add(w);
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_weight_types_name_every_supported_type() {
        let data = Bytes::Owned(Arc::new(vec![0u8; 66]));
        let e = Weight::new(GgmlType::IQ2_XXS, 1, 256, data, "w").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("IQ2_XXS is not supported"), "{msg}");
        for t in GgmlType::SUPPORTED {
            assert!(msg.contains(t.name()), "{msg} lacks {t}");
        }
        let q41 = Bytes::Owned(Arc::new(vec![0u8; 20 * 8]));
        assert!(Weight::new(GgmlType::Q4_1, 1, 256, q41, "w").is_ok());
    }
}
