//! Error type of the quant crate: every bad input names what it got and what was expected.

use thiserror::Error;

/// Errors returned by the quant crate. Bad input never panics.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuantError {
    /// A ggml type id that this crate does not know.
    #[error("unknown ggml type id {0}")]
    UnknownType(u32),
    /// A known type for which the requested operation is not implemented.
    #[error("{op} is not supported for ggml type {ty}")]
    Unsupported { ty: &'static str, op: &'static str },
    /// A row length that is not a whole number of blocks.
    #[error("ggml type {ty}: {ncols} columns is not a multiple of the block size {block_size}")]
    BadColumns {
        ty: &'static str,
        ncols: usize,
        block_size: usize,
    },
    /// A buffer whose length does not match the shape it is used with.
    #[error("{what}: expected {expected} {unit}, got {got}")]
    BadLength {
        what: &'static str,
        unit: &'static str,
        expected: usize,
        got: usize,
    },
    /// A row range outside the matrix.
    #[error("row range {start}..{end} is outside a matrix of {rows} rows")]
    BadRowRange {
        start: usize,
        end: usize,
        rows: usize,
    },
}

impl QuantError {
    pub(crate) fn len(what: &'static str, unit: &'static str, expected: usize, got: usize) -> Self {
        QuantError::BadLength {
            what,
            unit,
            expected,
            got,
        }
    }

    /// `Ok(())` when `got == expected`, else a [`QuantError::BadLength`].
    pub(crate) fn check_len(
        what: &'static str,
        unit: &'static str,
        expected: usize,
        got: usize,
    ) -> Result<(), Self> {
        if expected == got {
            Ok(())
        } else {
            Err(Self::len(what, unit, expected, got))
        }
    }
}
