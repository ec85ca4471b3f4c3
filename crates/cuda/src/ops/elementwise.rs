//! Embedding gather, residual add, gated activations (SwiGLU / GeGLU) and KV-cache append.

use half::bf16;

use super::{grid_1d, u32_of, KvLayout};
use crate::buffer::GpuBuffer;
use crate::context::{CudaContext, KArg};
use crate::error::CudaError;

/// Gated activation of the MLP: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// SiLU gate (Llama, Qwen).
    SwiGlu,
    /// GELU with the tanh approximation (Gemma).
    GeGluTanh,
}

impl CudaContext {
    /// `out[i, :] = table[ids[i], :] * scale`; table [vocab, hidden], ids [n], out [n, hidden].
    /// Ids outside the table give zero rows (the device cannot report them).
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        table: &GpuBuffer<bf16>,
        ids: &GpuBuffer<u32>,
        out: &mut GpuBuffer<bf16>,
        n: usize,
        hidden: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "embed";
        let t = table.ptr_min(OP, "table [vocab, hidden]", vocab * hidden)?;
        let i = ids.ptr_min(OP, "ids [n]", n)?;
        let o = out.ptr_min(OP, "out [n, hidden]", n * hidden)?;
        let args = [
            KArg::P(t),
            KArg::P(i),
            KArg::P(o),
            KArg::U(u32_of(OP, "hidden", hidden)?),
            KArg::U(u32_of(OP, "vocab", vocab)?),
            KArg::F(scale),
        ];
        self.launch(
            "embed_gather",
            (u32_of(OP, "n", n)?, 1, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }

    /// `out = a + b` over `n` elements.
    pub fn add(
        &self,
        a: &GpuBuffer<bf16>,
        b: &GpuBuffer<bf16>,
        out: &mut GpuBuffer<bf16>,
        n: usize,
    ) -> Result<(), CudaError> {
        let (pa, pb, po) = (
            a.ptr_min("add", "a", n)?,
            b.ptr_min("add", "b", n)?,
            out.ptr_min("add", "out", n)?,
        );
        self.launch_add(pa, pb, po, n)
    }

    /// `acc += x` over `n` elements (residual add in place).
    pub fn add_assign(
        &self,
        acc: &mut GpuBuffer<bf16>,
        x: &GpuBuffer<bf16>,
        n: usize,
    ) -> Result<(), CudaError> {
        let (pa, pb) = (
            acc.ptr_min("add_assign", "acc", n)?,
            x.ptr_min("add_assign", "x", n)?,
        );
        self.launch_add(pa, pb, pa, n)
    }

    /// `x[r, :] += bias` for `rows` rows of `bias.len()` elements (a projection's bias).
    pub fn add_bias(
        &self,
        x: &mut GpuBuffer<bf16>,
        bias: &GpuBuffer<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let cols = bias.len();
        let n = rows * cols;
        let px = x.ptr_min("add_bias", "x", n)?;
        let pb = bias.ptr_min("add_bias", "bias", cols)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            KArg::P(px),
            KArg::P(pb),
            KArg::U(u32_of("add_bias", "cols", cols)?),
            KArg::P(n as u64),
        ];
        self.launch(
            "add_bias_bf16",
            (grid_1d(n, 256), 1, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }

    fn launch_add(&self, a: u64, b: u64, out: u64, n: usize) -> Result<(), CudaError> {
        // add_bf16 takes n as a 64-bit count (KArg::P is a plain u64).
        let args = [KArg::P(a), KArg::P(b), KArg::P(out), KArg::P(n as u64)];
        self.launch("add_bf16", (grid_1d(n, 256), 1, 1), (256, 1, 1), 0, &args)
    }

    /// `out[r, :] = act(gate_up[r, :cols]) * gate_up[r, cols..]`; gate_up [rows, 2 cols]
    /// (the output of one GEMM over concatenated gate and up weights), out [rows, cols].
    pub fn glu(
        &self,
        act: Glu,
        gate_up: &GpuBuffer<bf16>,
        out: &mut GpuBuffer<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "glu";
        let g = gate_up.ptr_min(OP, "gate_up [rows, 2*cols]", rows * 2 * cols)?;
        let up = g + (cols * 2) as u64;
        self.launch_glu(
            act,
            g,
            up,
            out.ptr_min(OP, "out [rows, cols]", rows * cols)?,
            rows,
            cols,
            2 * cols,
        )
    }

    /// `out = act(gate) * up` with gate, up, out all [rows, cols].
    pub fn glu_split(
        &self,
        act: Glu,
        gate: &GpuBuffer<bf16>,
        up: &GpuBuffer<bf16>,
        out: &mut GpuBuffer<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "glu_split";
        let n = rows * cols;
        let (g, u, o) = (
            gate.ptr_min(OP, "gate", n)?,
            up.ptr_min(OP, "up", n)?,
            out.ptr_min(OP, "out", n)?,
        );
        self.launch_glu(act, g, u, o, rows, cols, cols)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_glu(
        &self,
        act: Glu,
        g: u64,
        u: u64,
        o: u64,
        rows: usize,
        cols: usize,
        stride: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "glu";
        let args = [
            KArg::P(g),
            KArg::P(u),
            KArg::P(o),
            KArg::U(u32_of(OP, "rows", rows)?),
            KArg::U(u32_of(OP, "cols", cols)?),
            KArg::U(u32_of(OP, "row stride", stride)?),
            KArg::U(match act {
                Glu::SwiGlu => 0,
                Glu::GeGluTanh => 1,
            }),
        ];
        // 8 columns a thread, 256 threads a block; rows over grid.y (striding past 65535)
        let grid = (
            cols.div_ceil(8 * 256).max(1) as u32,
            rows.clamp(1, 65_535) as u32,
            1,
        );
        self.launch("glu_bf16", grid, (256, 1, 1), 0, &args)
    }

    /// Writes k, v [n_tokens, kv_heads, head_dim] into the caches at `positions[t]` of slot
    /// `slots[t]`. Rows with an out-of-range slot or position are skipped on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        k: &GpuBuffer<bf16>,
        v: &GpuBuffer<bf16>,
        k_cache: &mut GpuBuffer<bf16>,
        v_cache: &mut GpuBuffer<bf16>,
        positions: &GpuBuffer<u32>,
        slots: &GpuBuffer<u32>,
        n_tokens: usize,
        kv: KvLayout,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_append";
        kv.check(OP)?;
        if kv.fp8 {
            return Err(CudaError::bad(
                OP,
                "bf16 caches only (qkv_post writes fp8 ones)",
            ));
        }
        let rows = n_tokens * kv.kv_heads * kv.head_dim;
        let args = [
            KArg::P(k.ptr_min(OP, "k [n, kv_heads, head_dim]", rows)?),
            KArg::P(v.ptr_min(OP, "v [n, kv_heads, head_dim]", rows)?),
            KArg::P(k_cache.ptr_min(OP, "k_cache", kv.buf_len())?),
            KArg::P(v_cache.ptr_min(OP, "v_cache", kv.buf_len())?),
            KArg::P(positions.ptr_min(OP, "positions [n]", n_tokens)?),
            KArg::P(slots.ptr_min(OP, "slots [n]", n_tokens)?),
            KArg::U(kv.kv_heads as u32),
            KArg::U(kv.capacity as u32),
            KArg::U(kv.head_dim as u32),
            KArg::U(kv.num_slots as u32),
        ];
        let grid = (u32_of(OP, "n_tokens", n_tokens)?, kv.kv_heads as u32, 1);
        self.launch(
            "kv_append",
            grid,
            ((kv.head_dim / 8) as u32, 1, 1),
            0,
            &args,
        )
    }

    /// End of a decode step: `pos[b] += 1; seq_lens[b] = pos[b] + 1` for `b < n` (n <= 1024).
    pub fn advance_positions(
        &self,
        pos: &mut GpuBuffer<u32>,
        seq_lens: &mut GpuBuffer<u32>,
        n: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "advance_positions";
        if n > 1024 {
            return Err(CudaError::bad(OP, format!("{n} sequences (at most 1024)")));
        }
        let args = [
            KArg::P(pos.ptr_min(OP, "pos [n]", n)?),
            KArg::P(seq_lens.ptr_min(OP, "seq_lens [n]", n)?),
            KArg::U(n as u32),
        ];
        self.launch(OP, (1, 1, 1), (1024, 1, 1), 0, &args)
    }

    /// Multiplies `w[offset + r * ld + c]` (r < rows, c < cols) by `s`; with a power of two,
    /// exactly (fp8 KV folds its scales into the weights with it).
    pub fn scale_block(
        &self,
        w: &mut GpuBuffer<bf16>,
        offset: usize,
        rows: usize,
        ld: usize,
        cols: usize,
        s: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "scale_block";
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if cols > ld || rows > 65535 {
            return Err(CudaError::bad(
                OP,
                format!("{rows} rows of {cols} (stride {ld})"),
            ));
        }
        let n = (rows - 1) * ld + cols;
        let p = w.ptr_range(OP, "w", offset, n)?;
        let args = [
            KArg::P(p),
            KArg::U(rows as u32),
            KArg::U(u32_of(OP, "ld", ld)?),
            KArg::U(u32_of(OP, "cols", cols)?),
            KArg::F(s),
        ];
        self.launch(
            "scale_block_bf16",
            (cols.div_ceil(256) as u32, rows as u32, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }
}
