// elementwise.cu: embedding gather, residual add, SwiGLU/GeGLU and KV-cache append.

// out[i, :] = table[ids[i], :] * scale. Ids outside the table give a zero row.
// table [vocab, hidden], ids [n], out [n, hidden]; grid (n), block 256.
extern "C" __global__ void embed_gather(const bf16* __restrict__ table, const u32* __restrict__ ids,
                                        bf16* __restrict__ out, u32 hidden, u32 vocab, float scale) {
    pdl_wait();
    pdl_trigger();
    const u32 row = blockIdx.x;
    const u32 id = ids[row];
    bf16* dst = out + (u64)row * hidden;
    if (id >= vocab) {
        for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = f2bf(0.0f);
        return;
    }
    const bf16* src = table + (u64)id * hidden;
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = f2bf(bf2f(src[c]) * scale);
}

// x[r, c] += bias[c] over rows of `cols` elements (the q/k/v projections' biases, Qwen2);
// grid-stride over all `n` elements.
extern "C" __global__ void add_bias_bf16(bf16* x, const float* __restrict__ bias, u32 cols, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bias[i % cols]);
}

// out[i] = a[i] + b[i] (out may alias a or b); grid-stride.
extern "C" __global__ void add_bf16(const bf16* a, const bf16* b, bf16* out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}


// act(g) * u, rounded to bf16; act 0 = SiLU (SwiGLU), 1 = GELU-tanh (GeGLU).
__device__ __forceinline__ bf16 glu_one(bf16 g, bf16 u, u32 act) {
    const float x = bf2f(g);
    return f2bf((act == 0 ? silu(x) : gelu_tanh(x)) * bf2f(u));
}

// out[r, c] = act(gate[r, c]) * up[r, c] (glu_one).
// gate/up rows are `in_stride` elements apart (2*cols for a fused [gate|up] GEMM output),
// out [rows, cols]. A thread takes 8 consecutive columns of a row, with 16-byte loads and
// stores when the rows allow (cols and in_stride multiples of 8, 16-byte-aligned pointers).
// grid (ceil(cols / 2048), min(rows, 65535)), block 256; rows stride over grid.y.
extern "C" __global__ void glu_bf16(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                    bf16* __restrict__ out, u32 rows, u32 cols, u32 in_stride,
                                    u32 act) {
    const u32 c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (c0 >= cols) return;
    const bool vec = (cols % 8 == 0) && (in_stride % 8 == 0) &&
                     (((unsigned long long)gate | (unsigned long long)up | (unsigned long long)out) % 16 == 0);
    for (u32 r = blockIdx.y; r < rows; r += gridDim.y) {
        const bf16* g = gate + (u64)r * in_stride + c0;
        const bf16* u = up + (u64)r * in_stride + c0;
        bf16* o = out + (u64)r * cols + c0;
        if (vec) {
            const uint4 gv = *reinterpret_cast<const uint4*>(g);
            const uint4 uv = *reinterpret_cast<const uint4*>(u);
            const bf16* gb = reinterpret_cast<const bf16*>(&gv);
            const bf16* ub = reinterpret_cast<const bf16*>(&uv);
            uint4 ov;
            bf16* ob = reinterpret_cast<bf16*>(&ov);
#pragma unroll
            for (int k = 0; k < 8; ++k) ob[k] = glu_one(gb[k], ub[k], act);
            *reinterpret_cast<uint4*>(o) = ov;
        } else {
            for (u32 k = 0; k < 8 && c0 + k < cols; ++k) o[k] = glu_one(g[k], u[k], act);
        }
    }
}

// Writes new keys/values into a paged-by-slot cache.
// k, v [n, kv_heads, head_dim]; caches [num_slots, kv_heads, capacity, head_dim];
// positions [n], slots [n]. Rows whose slot/position is out of range are skipped.
// grid (n, kv_heads), block head_dim/8 threads (16-byte copies).
extern "C" __global__ void kv_append(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                     bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                     const u32* __restrict__ positions, const u32* __restrict__ slots,
                                     u32 kv_heads, u32 capacity, u32 head_dim, u32 num_slots) {
    const u32 t = blockIdx.x, h = blockIdx.y;
    const u32 pos = positions[t], slot = slots[t];
    if (pos >= capacity || slot >= num_slots) return;
    const u64 src = ((u64)t * kv_heads + h) * head_dim;
    const u64 dst = (((u64)slot * kv_heads + h) * capacity + pos) * head_dim;
    for (u32 c = threadIdx.x; c < head_dim / 8; c += blockDim.x) {
        reinterpret_cast<uint4*>(k_cache + dst)[c] = reinterpret_cast<const uint4*>(k + src)[c];
        reinterpret_cast<uint4*>(v_cache + dst)[c] = reinterpret_cast<const uint4*>(v + src)[c];
    }
}

// End of a decode step: pos[b] += 1 (the next token's position) and seq_lens[b] = pos[b] + 1
// (the cache length the next step attends to, its own key included). n <= 1024, one block.
extern "C" __global__ void advance_positions(u32* pos, u32* seq_lens, u32 n) {
    pdl_wait();
    pdl_trigger();
    for (u32 b = threadIdx.x; b < n; b += blockDim.x) {
        const u32 p = pos[b] + 1;
        pos[b] = p;
        seq_lens[b] = p + 1;
    }
}
