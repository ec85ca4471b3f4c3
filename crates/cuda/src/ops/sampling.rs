//! Token choice on the GPU: greedy argmax and seeded top-p sampling over f32 logits.

use super::u32_of;
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// The uniform draw in [0, 1) that `sample_top_p` uses for a row with `seed`
/// (splitmix64, top 24 bits); exposed so references can reproduce it.
pub fn uniform_from_seed(seed: u64) -> f32 {
    let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x >> 40) as f32 * (1.0 / 16_777_216.0)
}

/// Rows one `argmax` may take, and the blocks it splits a row over (its scratch, owned by the
/// context, holds a counter and a (value, index) pair a block for that many rows).
pub const ARGMAX_MAX_ROWS: usize = 4096;
pub const ARGMAX_BLOCKS: usize = 64;

impl CudaContext {
    /// out[r] = argmax of logits [rows, vocab] row r (lowest index on ties).
    pub fn argmax(
        &self,
        logits: &GpuBuffer<f32>,
        out: &mut GpuBuffer<u32>,
        rows: usize,
        vocab: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "argmax";
        if vocab == 0 {
            return Err(CudaError::bad(OP, "vocab is 0"));
        }
        if rows > ARGMAX_MAX_ROWS {
            return Err(CudaError::bad(
                OP,
                format!("{rows} rows (at most {ARGMAX_MAX_ROWS})"),
            ));
        }
        // Blocks a row: about 2048 logits each, at most ARGMAX_BLOCKS.
        let nb = vocab.div_ceil(2048).clamp(1, ARGMAX_BLOCKS);
        let args = [
            KArg::P(logits.ptr_min(OP, "logits [rows, vocab]", rows * vocab)?),
            KArg::P(out.ptr_min(OP, "out [rows]", rows)?),
            KArg::U(u32_of(OP, "vocab", vocab)?),
            KArg::P(
                self.argmax_scratch
                    .ptr_min(OP, "scratch", ARGMAX_MAX_ROWS + rows * 2 * nb)?,
            ),
            KArg::U(ARGMAX_MAX_ROWS as u32),
        ];
        self.launch(
            "argmax_f32",
            (nb as u32, u32_of(OP, "rows", rows)?, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }

    /// Nucleus sampling of each row of logits [rows, vocab] at `temperature` (> 0) keeping the
    /// smallest top set of mass >= top_p; row r draws its uniform from `seeds[r]`
    /// ([`uniform_from_seed`]), so equal seeds give equal tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_top_p(
        &self,
        logits: &GpuBuffer<f32>,
        seeds: &GpuBuffer<u64>,
        out: &mut GpuBuffer<u32>,
        rows: usize,
        vocab: usize,
        temperature: f32,
        top_p: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "sample_top_p";
        if vocab == 0
            || temperature.is_nan()
            || temperature <= 0.0
            || top_p.is_nan()
            || top_p <= 0.0
            || top_p > 1.0
        {
            return Err(CudaError::bad(
                OP,
                format!(
                    "vocab {vocab}, temperature {temperature} (> 0), top_p {top_p} (in (0, 1])"
                ),
            ));
        }
        let args = [
            KArg::P(logits.ptr_min(OP, "logits [rows, vocab]", rows * vocab)?),
            KArg::P(seeds.ptr_min(OP, "seeds [rows]", rows)?),
            KArg::P(out.ptr_min(OP, "out [rows]", rows)?),
            KArg::U(u32_of(OP, "vocab", vocab)?),
            KArg::F(temperature),
            KArg::F(top_p),
        ];
        self.launch(
            "sample_top_p_f32",
            (u32_of(OP, "rows", rows)?, 1, 1),
            (1024, 1, 1),
            0,
            &args,
        )
    }
}
