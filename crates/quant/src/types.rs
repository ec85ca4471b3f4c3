//! `GgmlType`: the ggml tensor type ids with their block sizes and bytes per block.

use crate::QuantError;

/// Values per super-block of the K-quants.
pub const QK_K: usize = 256;
/// Values per block of the legacy quants (Q4_0, Q5_0, Q8_0, ...).
pub const QK: usize = 32;

macro_rules! ggml_types {
    ($( $(#[$m:meta])* $v:ident = $id:literal, $name:literal, $bs:expr, $ts:expr; )*) => {
        /// A ggml tensor type, with its on-disk id (the value stored in GGUF tensor infos).
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum GgmlType {
            $( $(#[$m])* $v = $id, )*
        }

        impl GgmlType {
            /// Every known type, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$v),*];

            /// The type with ggml id `id`, or `None` when the id is unknown.
            pub fn from_id(id: u32) -> Option<Self> {
                match id {
                    $( $id => Some(GgmlType::$v), )*
                    _ => None,
                }
            }

            /// The ggml name (`"Q4_K"`, `"F32"`, ...).
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$v => $name, )* }
            }

            /// Values per block.
            pub fn block_size(self) -> usize {
                match self { $( GgmlType::$v => $bs, )* }
            }

            /// Bytes per block.
            pub fn type_size(self) -> usize {
                match self { $( GgmlType::$v => $ts, )* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", QK, 2 + QK / 2;
    Q4_1 = 3, "Q4_1", QK, 4 + QK / 2;
    Q5_0 = 6, "Q5_0", QK, 2 + 4 + QK / 2;
    Q5_1 = 7, "Q5_1", QK, 4 + 4 + QK / 2;
    Q8_0 = 8, "Q8_0", QK, 2 + QK;
    /// ggml's `block_q8_1` (f16 d, f16 s, 32 i8) is 36 bytes; gguf-py lists 40.
    Q8_1 = 9, "Q8_1", QK, 4 + QK;
    Q2_K = 10, "Q2_K", QK_K, QK_K / 16 + QK_K / 4 + 4;
    Q3_K = 11, "Q3_K", QK_K, QK_K / 8 + QK_K / 4 + 12 + 2;
    Q4_K = 12, "Q4_K", QK_K, 4 + 12 + QK_K / 2;
    Q5_K = 13, "Q5_K", QK_K, 4 + 12 + QK_K / 8 + QK_K / 2;
    Q6_K = 14, "Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    Q8_K = 15, "Q8_K", QK_K, 4 + QK_K + QK_K / 16 * 2;
    IQ2_XXS = 16, "IQ2_XXS", QK_K, 66;
    IQ2_XS = 17, "IQ2_XS", QK_K, 74;
    IQ3_XXS = 18, "IQ3_XXS", QK_K, 98;
    IQ1_S = 19, "IQ1_S", QK_K, 50;
    IQ4_NL = 20, "IQ4_NL", QK, 18;
    IQ3_S = 21, "IQ3_S", QK_K, 110;
    IQ2_S = 22, "IQ2_S", QK_K, 82;
    IQ4_XS = 23, "IQ4_XS", QK_K, 136;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", QK_K, 56;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", QK_K, 54;
    TQ2_0 = 35, "TQ2_0", QK_K, 66;
    MXFP4 = 39, "MXFP4", QK, 17;
}

impl GgmlType {
    /// The ggml type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Bytes of one row of `ncols` values; an error when `ncols` is not a whole number of blocks.
    pub fn row_bytes(self, ncols: usize) -> Result<usize, QuantError> {
        let bs = self.block_size();
        if !ncols.is_multiple_of(bs) {
            return Err(QuantError::BadColumns {
                ty: self.name(),
                ncols,
                block_size: bs,
            });
        }
        Ok(ncols / bs * self.type_size())
    }

    /// The types `dequantize_row` and `matvec` fully support (weights of these types load).
    pub const SUPPORTED: &'static [GgmlType] = &[
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ];

    /// True for the types `dequantize_row` and `matvec` fully support.
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }

    /// The names of [`Self::SUPPORTED`], comma-separated (for error messages).
    pub fn supported_names() -> String {
        names(Self::SUPPORTED)
    }

    /// The types `quantize_row` writes (random-weight models can be built in these); a subset of
    /// [`Self::SUPPORTED`]: the others load from files but have no quantizer here.
    pub const QUANTIZABLE: &'static [GgmlType] = &[
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
    ];

    /// True for the types `quantize_row` writes.
    pub fn is_quantizable(self) -> bool {
        Self::QUANTIZABLE.contains(&self)
    }

    /// The names of [`Self::QUANTIZABLE`], comma-separated (for error messages).
    pub fn quantizable_names() -> String {
        names(Self::QUANTIZABLE)
    }

    pub(crate) fn unsupported(self, op: &'static str) -> QuantError {
        QuantError::Unsupported {
            ty: self.name(),
            op,
        }
    }
}

fn names(types: &[GgmlType]) -> String {
    types
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
