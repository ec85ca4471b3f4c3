//! Decode path: `QMatrix` (a borrowed ggml weight matrix) times one or a few activation vectors,
//! by integer dot products against a quantized activation, parallel over row chunks.

use crate::activation::{ActKind, QuantAct};
use crate::dequant_simd::dequantize_fast;
use crate::dot::{dot_row, dot_rows, has_dot, Isa};
use crate::types::GgmlType;
use crate::QuantError;
use rayon::prelude::*;
use std::ops::Range;

/// A row-major ggml weight matrix: `rows` output features, each a row of `cols` values stored as
/// `ty` blocks (`data.len() == rows * ty.row_bytes(cols)`), e.g. a slice of an mmap'd GGUF.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8], // [rows, row_bytes]
}

impl<'a> QMatrix<'a> {
    /// Wrap `data`, checking that it holds exactly `rows` rows of `cols` values of `ty`.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        let m = QMatrix {
            ty,
            rows,
            cols,
            data,
        };
        m.validate()?;
        Ok(m)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> Result<usize, QuantError> {
        self.ty.row_bytes(self.cols)
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> Result<&'a [u8], QuantError> {
        let rb = self.validate()?;
        if r >= self.rows {
            return Err(QuantError::BadRowRange {
                start: r,
                end: r + 1,
                rows: self.rows,
            });
        }
        Ok(&self.data[r * rb..(r + 1) * rb])
    }

    /// Dequantize row `r` into `dst` (`cols` values); the embedding lookup.
    pub fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<(), QuantError> {
        QuantError::check_len("dequantize_row dst", "values", self.cols, dst.len())?;
        crate::dequantize_row(self.ty, self.row(r)?, dst)
    }

    /// Checks sizes; returns the row size in bytes.
    pub(crate) fn validate(&self) -> Result<usize, QuantError> {
        let rb = self.ty.row_bytes(self.cols)?;
        let expected = rb.checked_mul(self.rows).ok_or(QuantError::BadLength {
            what: "QMatrix data",
            unit: "bytes",
            expected: usize::MAX,
            got: self.data.len(),
        })?;
        QuantError::check_len("QMatrix data", "bytes", expected, self.data.len())?;
        Ok(rb)
    }
}

/// How each row dot product is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotPath {
    /// Integer dot products against an 8-bit quantized activation (f32 FMA for float weights).
    Quantized,
    /// Dequantize each weight row to f32, then an f32 dot (the reference for the measurement).
    Dequantized,
}

/// Reusable buffers for `matvec_*` (quantized activations), so the decode loop allocates
/// nothing once warmed up.
#[derive(Debug, Default)]
pub struct MatvecScratch {
    acts: Vec<QuantAct>, // [n] one per activation vector
}

impl MatvecScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// Below this many weight bytes a matvec runs on the calling thread (rayon overhead dominates).
const PAR_MIN_BYTES: usize = 96 * 1024;

/// `y = W x`: `x` is `[cols]`, `y` is `[rows]`.
pub fn matvec(w: &QMatrix, x: &[f32], y: &mut [f32]) -> Result<(), QuantError> {
    matvec_into(w, x, y, &mut MatvecScratch::new())
}

/// `matvec` with caller-provided scratch (no allocation after the first call of a given size).
pub fn matvec_into(
    w: &QMatrix,
    x: &[f32],
    y: &mut [f32],
    scratch: &mut MatvecScratch,
) -> Result<(), QuantError> {
    let rows = 0..w.rows;
    matvec_with(w, x, 1, rows, y, scratch, DotPath::Quantized, Isa::best())
}

/// Rows `rows` of `W x` only: `y` is `[rows.len()]` (e.g. a slice of a 262144-row LM head).
pub fn matvec_rows(
    w: &QMatrix,
    x: &[f32],
    rows: Range<usize>,
    y: &mut [f32],
    scratch: &mut MatvecScratch,
) -> Result<(), QuantError> {
    matvec_with(w, x, 1, rows, y, scratch, DotPath::Quantized, Isa::best())
}

/// `n` activations sharing one pass over the weights: `x` is `[n, cols]`, `y` is `[n, rows]`.
/// Each weight row is read from memory once and dotted with all `n` vectors (small n, 2..8).
pub fn matvec_batch(
    w: &QMatrix,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    scratch: &mut MatvecScratch,
) -> Result<(), QuantError> {
    let rows = 0..w.rows;
    matvec_with(w, x, n, rows, y, scratch, DotPath::Quantized, Isa::best())
}

/// The general form: `y[i, r - rows.start] = dot(W[r], x[i])` for `i < n`, `r` in `rows`;
/// `x` is `[n, cols]`, `y` is `[n, rows.len()]`. `path` and `isa` force a kernel (tests,
/// benchmarks); `isa` must be available on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn matvec_with(
    w: &QMatrix,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    y: &mut [f32],
    scratch: &mut MatvecScratch,
    path: DotPath,
    isa: Isa,
) -> Result<(), QuantError> {
    let rb = w.validate()?;
    if !w.ty.is_supported() {
        return Err(w.ty.unsupported("matvec"));
    }
    if !isa.is_available() {
        return Err(QuantError::Unsupported {
            ty: isa.name(),
            op: "matvec on this CPU (instruction set)",
        });
    }
    if rows.start > rows.end || rows.end > w.rows {
        return Err(QuantError::BadRowRange {
            start: rows.start,
            end: rows.end,
            rows: w.rows,
        });
    }
    let nr = rows.len();
    QuantError::check_len("matvec x", "values", n * w.cols, x.len())?;
    QuantError::check_len("matvec y", "values", n * nr, y.len())?;
    if n == 0 || nr == 0 {
        return Ok(());
    }
    if w.cols == 0 {
        y.fill(0.0);
        return Ok(());
    }

    let quantized = path == DotPath::Quantized && has_dot(w.ty);
    let kind = if quantized {
        ActKind::for_weight(w.ty)
    } else {
        ActKind::F32
    };
    if scratch.acts.len() < n {
        scratch.acts.resize_with(n, QuantAct::default);
    }
    for (act, xi) in scratch.acts.iter_mut().zip(x.chunks_exact(w.cols)) {
        act.quantize(kind, xi);
    }
    let job = Job {
        w,
        rb,
        x,
        acts: &scratch.acts[..n],
        row0: rows.start,
        nr,
        y: SyncPtr(y.as_mut_ptr()),
        isa,
        quantized,
    };

    let bytes = nr * rb;
    let threads = rayon::current_num_threads();
    if bytes < PAR_MIN_BYTES || threads == 1 {
        job.run(0..nr, &mut Vec::new());
    } else {
        let chunk = nr.div_ceil(threads * 4).max(16);
        let nchunks = nr.div_ceil(chunk);
        (0..nchunks)
            .into_par_iter()
            .for_each_init(Vec::new, |buf, c| {
                job.run(c * chunk..((c + 1) * chunk).min(nr), buf)
            });
    }
    Ok(())
}

/// A raw output pointer shared by the row-chunk tasks; each task writes disjoint elements.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint indices (their own row chunk) and the pointee outlives them.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

struct Job<'a, 'w> {
    w: &'a QMatrix<'w>,
    rb: usize,
    x: &'a [f32],
    acts: &'a [QuantAct],
    row0: usize,
    nr: usize,
    y: SyncPtr,
    isa: Isa,
    quantized: bool,
}

impl Job<'_, '_> {
    /// Rows `local` (relative to `row0`); `buf` is a per-thread f32 row for the dequant path.
    fn run(&self, local: Range<usize>, buf: &mut Vec<f32>) {
        let (cols, rb, n) = (self.w.cols, self.rb, self.acts.len());
        // With several activations, walk the rows in small groups so each group's weights are
        // still in L1 when the next activation reads them.
        let group = if n == 1 { local.len() } else { 16 };
        let mut start = local.start;
        while start < local.end {
            let end = (start + group).min(local.end);
            let (r0, r1) = (self.row0 + start, self.row0 + end);
            let rows = &self.w.data[r0 * rb..r1 * rb];
            for i in 0..n {
                let xi = &self.x[i * cols..(i + 1) * cols];
                // SAFETY: y is [n, nr]; this is y[i, start..end], inside y, and row chunks of
                // different tasks are disjoint, so no two tasks alias.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(self.y.0.add(i * self.nr + start), end - start)
                };
                if self.quantized {
                    dot_rows(self.isa, self.w.ty, rows, rb, xi, self.acts[i].view(), out);
                } else {
                    self.dequantized(rows, xi, i, out, buf);
                }
            }
            start = end;
        }
    }

    /// Dequantize each row to f32 and run the f32 dot kernel on it.
    fn dequantized(&self, rows: &[u8], xi: &[f32], i: usize, out: &mut [f32], buf: &mut Vec<f32>) {
        let cols = self.w.cols;
        buf.resize(cols, 0.0);
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(self.rb)) {
            dequantize_fast(self.isa, self.w.ty, row, buf);
            // SAFETY: an f32 slice viewed as its bytes.
            let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, cols * 4) };
            *o = dot_row(self.isa, GgmlType::F32, bytes, xi, self.acts[i].view());
        }
    }
}
