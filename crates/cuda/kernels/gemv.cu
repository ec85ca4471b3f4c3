// gemv.cu: y[b, o] = sum_i x[b, i] w[o, i] for a few rows b (decode at small batch), bf16 in,
// f32 accumulate, bf16 or f32 out. Streams the weights once at the memory's rate: each block
// takes GEMV_GR output rows and its 8 warps split the input dimension (thread t reads 16-byte
// chunks t, t + 256, ... of every row, two per row in flight per iteration), the N input rows
// come through the read-only cache, and the block sums its partials in shared memory.
// One implementation (gemv_fused_impl) serves the plain entries (gemv_bf16_n*, 3-8 rows) and
// the fused decode step's entries (gemv_fused_n*_m*, 1-2 rows: plain / normed inputs, residual / GLU
// outputs). in % 8 == 0. grid (ceil(out / GEMV_GR)), block 256.
#define GEMV_GR 4

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float a) {
    a = fmaf(bf_lo(w.x), bf_lo(x.x), a);
    a = fmaf(bf_hi(w.x), bf_hi(x.x), a);
    a = fmaf(bf_lo(w.y), bf_lo(x.y), a);
    a = fmaf(bf_hi(w.y), bf_hi(x.y), a);
    a = fmaf(bf_lo(w.z), bf_lo(x.z), a);
    a = fmaf(bf_hi(w.z), bf_hi(x.z), a);
    a = fmaf(bf_lo(w.w), bf_lo(x.w), a);
    a = fmaf(bf_hi(w.w), bf_hi(x.w), a);
    return a;
}

// gemv_fused_n{1,2}_m{0,1}: y[n, o] = sum_i xin[n, i] w[o, i] for N = 1-2 rows, where the
// input row is made on the fly from x:
//   m0 (plain): x [N, in];
//   m1 (norm):  rmsnorm(x [N, in]) * nw, rounded to bf16 as rmsnorm_bf16 writes it (each block
//               sums the row's squares first).
// y [N, out] bf16, or f32 with flag 1; flag 2: y is the residual stream [N, out] and receives
// y + bf16(acc) (the residual add of rmsnorm_bf16); flag 8: out rows are [gate; up] and y
// [N, out / 2] receives act(gate) * up as glu_bf16 writes it (act SiLU, GELU-tanh with flag 16),
// so the down projection reads a plain row (run 26: computing the GLU inside the down GEMV, in
// every block, cost it ~25 %); grid (ceil(out / 4)) still: a block takes two gate rows and their
// two up rows.
// The weights stream as in gemv.cu: GEMV_GR = 4 output rows a block (8 measured slower: run 19), its
// 8 warps split the input (thread t reads 16-byte chunks t, t + 256, ..., two per row in flight).
// Each block loads its first weights (chunks t and t + 256 of its rows) into registers before
// pdl_wait(), so the weight stream starts while the kernel before is still running and the input
// row is made while those loads are in flight (the plain gemv_bf16_n* entries prefetch them
// into L2 instead). Run 24: 77 % of the copy rate over the 145 GEMVs of a Qwen3-4B step, from 67 %
// with the L2 prefetch.
// grid (ceil(out / 4)), block 256; in % 8 == 0.

__device__ __forceinline__ u32 gf_glu2(u32 g, u32 u, bool gelu) {
    const float g0 = bf_lo(g), g1 = bf_hi(g);
    const float a0 = gelu ? gelu_tanh(g0) : silu(g0), a1 = gelu ? gelu_tanh(g1) : silu(g1);
    return pack_bf16x2(a0 * bf_lo(u), a1 * bf_hi(u));
}
__device__ __forceinline__ u32 gf_norm2(u32 x, float scale, float w0, float w1) {
    return pack_bf16x2(bf_lo(x) * scale * w0, bf_hi(x) * scale * w1);
}

// ss plus the squares of a 16-byte chunk's 8 bf16 elements, in element order.
__device__ __forceinline__ float gf_sq8(uint4 v, float ss) {
    float e[8];
    unpack8(v, e);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += e[j] * e[j];
    return ss;
}

// The RMSNorm scale of one input row (c8 16-byte chunks, `in` elements): every thread of the
// 256-thread block sums its chunks' squares in element order, then the block adds them.
__device__ __forceinline__ float gf_rms_scale(const uint4* __restrict__ row, u32 c8, u32 in, float eps,
                                              float* scratch) {
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < c8; c += 256) ss = gf_sq8(__ldg(row + c), ss);
    ss = block_sum(ss, scratch);
    return rsqrtf(ss / (float)in + eps);
}

// The RMSNorm scales of up to 8 rows (`n_rows`, consecutive, c8 chunks each) in one pass:
// every row summed exactly as gf_rms_scale sums it (the same per-thread order and reduction
// tree), with the rows' loads in flight together and one barrier instead of two a row. Returns
// row `want`'s scale (rows >= n_rows read nothing: scale of an empty sum). Block 256.
__device__ __forceinline__ float gf_rms_scales8(const uint4* __restrict__ rows, u32 n_rows, u32 c8, u32 in,
                                               float eps, float (*scratch)[8], u32 want) {
    float ss[8];
#pragma unroll
    for (int n = 0; n < 8; ++n) ss[n] = 0.0f;
    for (u32 c = threadIdx.x; c < c8; c += 256) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            if ((u32)n < n_rows) ss[n] = gf_sq8(__ldg(rows + n * c8 + c), ss[n]);
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        ss[n] = warp_sum(ss[n]);
        if (lane == 0) scratch[n][warp] = ss[n];
    }
    __syncthreads();
    float r = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const float v = warp_sum(lane < 8 ? scratch[n][lane] : 0.0f);
        if ((u32)n == want) r = v;
    }
    return rsqrtf(r / (float)in + eps);
}

// Output element i of a fused GEMV: f32 (flag 1), added to the bf16 residual stream as
// rmsnorm's residual add rounds it (flag 2), or bf16.
__device__ __forceinline__ void gf_store(void* y, u64 i, float v, u32 flags) {
    if (flags & 1) {
        reinterpret_cast<float*>(y)[i] = v;
    } else if (flags & 2) {
        bf16* res = reinterpret_cast<bf16*>(y);
        res[i] = f2bf(bf2f(res[i]) + bf2f(f2bf(v)));
    } else {
        reinterpret_cast<bf16*>(y)[i] = f2bf(v);
    }
}

// GLU output element i of a fused GEMV (flag 8): act(bf16(gate)) * bf16(up) as glu_bf16 writes
// it, act GELU-tanh with flag 16, else SiLU.
__device__ __forceinline__ void gf_store_glu(void* y, u64 i, float gate, float up, u32 flags) {
    const u32 gu = pack_bf16x2(gate, up);
    const u32 a = gf_glu2(gu & 0xffffu, gu >> 16, (flags & 16) != 0);
    reinterpret_cast<bf16*>(y)[i] = __ushort_as_bfloat16((unsigned short)(a & 0xffffu));
}

// The 16-byte input chunk c of row n.
template <int MODE>
__device__ __forceinline__ uint4 gf_x(const uint4* __restrict__ xv, const float4* __restrict__ nw4, u32 c8,
                                      u32 n, u32 c, float scale) {
    if (MODE == 0) return __ldg(xv + n * c8 + c);
    const uint4 x = __ldg(xv + n * c8 + c);
    const float4 wa = __ldg(nw4 + 2 * c), wb = __ldg(nw4 + 2 * c + 1);
    return make_uint4(gf_norm2(x.x, scale, wa.x, wa.y), gf_norm2(x.y, scale, wa.z, wa.w),
                      gf_norm2(x.z, scale, wb.x, wb.y), gf_norm2(x.w, scale, wb.z, wb.w));
}

template <int N, int MODE, bool PRE>
__device__ __forceinline__ void gemv_fused_impl(const bf16* __restrict__ x, const float* __restrict__ nw,
                                                const bf16* __restrict__ w, void* y, u32 in, u32 out,
                                                u32 flags, float eps) {
    __shared__ float red[8][GEMV_GR * N];
    __shared__ float scratch[32];
    const u32 c8 = in / 8, o0 = blockIdx.x * GEMV_GR;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const float4* nw4 = reinterpret_cast<const float4*>(nw);
    // flag 8 (GLU out): the rows are [gate; up] halves of out; this block takes gate rows j0,
    // j0 + 1 and the up rows of the same two (rows half + j0, half + j0 + 1).
    const bool glu_out = (flags & 8) != 0;
    const u32 half = out / 2, j0 = blockIdx.x * 2;
    const uint4* wr[GEMV_GR];
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r) {
        const u32 row = glu_out ? min(j0 + (r & 1), half - 1) + (r >= 2 ? half : 0) : min(o0 + r, out - 1);
        wr[r] = reinterpret_cast<const uint4*>(w + (u64)row * in);
    }
    float scale[N];
#pragma unroll
    for (int n = 0; n < N; ++n) scale[n] = 1.0f;
    // This block's first weights (chunks t and t + 256 of each row): loaded into registers
    // (PRE) or prefetched into L2 before waiting for the kernel before (PDL); the weights are
    // constant, so under PDL their stream starts while that kernel is still running.
    uint4 pa[GEMV_GR], pb[GEMV_GR];
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r) {
        if (PRE) {
            pa[r] = threadIdx.x < c8 ? ld_stream(wr[r] + threadIdx.x) : make_uint4(0, 0, 0, 0);
            pb[r] = threadIdx.x + 256 < c8 ? ld_stream(wr[r] + threadIdx.x + 256) : make_uint4(0, 0, 0, 0);
        } else {
            if (threadIdx.x < c8) prefetch_l2(wr[r] + threadIdx.x);
            if (threadIdx.x + 256 < c8) prefetch_l2(wr[r] + threadIdx.x + 256);
        }
    }
    pdl_wait();
    pdl_trigger();
    if (MODE == 1) {
#pragma unroll
        for (int n = 0; n < N; ++n) scale[n] = gf_rms_scale(xv + n * c8, c8, in, eps, scratch);
    }
    float acc[GEMV_GR][N];
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r)
#pragma unroll
        for (int n = 0; n < N; ++n) acc[r][n] = 0.0f;
    u32 c = threadIdx.x;
    if (PRE) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            if (c < c8) {
                const uint4 xa = gf_x<MODE>(xv, nw4, c8, n, c, scale[n]);
#pragma unroll
                for (int r = 0; r < GEMV_GR; ++r) acc[r][n] = dot8(pa[r], xa, acc[r][n]);
            }
            if (c + 256 < c8) {
                const uint4 xb = gf_x<MODE>(xv, nw4, c8, n, c + 256, scale[n]);
#pragma unroll
                for (int r = 0; r < GEMV_GR; ++r) acc[r][n] = dot8(pb[r], xb, acc[r][n]);
            }
        }
        c += 512;
    }
    for (; c + 256 < c8; c += 512) {
        uint4 a[GEMV_GR], b[GEMV_GR];
#pragma unroll
        for (int r = 0; r < GEMV_GR; ++r) {
            a[r] = ld_stream(wr[r] + c);
            b[r] = ld_stream(wr[r] + c + 256);
        }
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const uint4 xa = gf_x<MODE>(xv, nw4, c8, n, c, scale[n]);
            const uint4 xb = gf_x<MODE>(xv, nw4, c8, n, c + 256, scale[n]);
#pragma unroll
            for (int r = 0; r < GEMV_GR; ++r) acc[r][n] = dot8(b[r], xb, dot8(a[r], xa, acc[r][n]));
        }
    }
    if (c < c8) {
        uint4 a[GEMV_GR];
#pragma unroll
        for (int r = 0; r < GEMV_GR; ++r) a[r] = ld_stream(wr[r] + c);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const uint4 xa = gf_x<MODE>(xv, nw4, c8, n, c, scale[n]);
#pragma unroll
            for (int r = 0; r < GEMV_GR; ++r) acc[r][n] = dot8(a[r], xa, acc[r][n]);
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r)
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const float v = warp_sum(acc[r][n]);
            if (lane == 0) red[warp][r * N + n] = v;
        }
    __syncthreads();
    if (glu_out) {
        // y [N, half] = act(bf16(gate)) * bf16(up), rounded as glu_bf16 writes it.
        if (threadIdx.x < 2 * N) {
            const u32 jj = threadIdx.x / N, n = threadIdx.x % N, j = j0 + jj;
            float g = 0.0f, u = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                g += red[k][jj * N + n];
                u += red[k][(2 + jj) * N + n];
            }
            if (j < half) gf_store_glu(y, (u64)n * half + j, g, u, flags);
        }
        return;
    }
    if (threadIdx.x < GEMV_GR * N) {
        const u32 r = threadIdx.x / N, n = threadIdx.x % N, o = o0 + r;
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) v += red[k][threadIdx.x];
        if (o < out) {
            const u64 i = (u64)n * out + o;
            gf_store(y, i, v, flags);
        }
    }
}

#define GEMV_FUSED_ENTRY(NAME, N, MODE, PRE)                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        NAME(const bf16* x, const float* nw, const bf16* w, void* y, u32 in, u32 out, u32 flags,    \
             float eps) {                                                                          \
        gemv_fused_impl<N, MODE, PRE>(x, nw, w, y, in, out, flags, eps);                           \
    }
GEMV_FUSED_ENTRY(gemv_fused_n1_m0, 1, 0, true)
GEMV_FUSED_ENTRY(gemv_fused_n1_m1, 1, 1, true)
GEMV_FUSED_ENTRY(gemv_fused_n2_m0, 2, 0, true)
GEMV_FUSED_ENTRY(gemv_fused_n2_m1, 2, 1, true)

// gemv_bf16_n{3..8}: the plain GEMV (m0) for 3-8 rows, bf16 or f32 out (1-2 rows run the
// gemv_fused_n*_m0 entries, which load their first weights before the PDL wait).
#define GEMV_ENTRY(NAME, N)                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        NAME(const bf16* x, const bf16* w, void* y, u32 in, u32 out, u32 out_f32) {                 \
        gemv_fused_impl<N, 0, false>(x, nullptr, w, y, in, out, out_f32 ? 1u : 0u, 0.0f);                  \
    }
GEMV_ENTRY(gemv_bf16_n3, 3)
GEMV_ENTRY(gemv_bf16_n4, 4)
GEMV_ENTRY(gemv_bf16_n5, 5)
GEMV_ENTRY(gemv_bf16_n6, 6)
GEMV_ENTRY(gemv_bf16_n7, 7)
GEMV_ENTRY(gemv_bf16_n8, 8)


// gemv_mma_*: y[n, o] = sum_i xin[n, i] w[o, i] for n < N <= 8 rows on tensor cores, for the
// 3-8-row steps where the FMA kernels above run out of issue slots (4-6 FMAs and unpacks a weight
// element). mma.m16n8k16 with A = 16 weight rows, B = the (up to) 8 input rows as its 8 columns.
// The dot product does not care in which order k is summed, so the k order inside a 32-wide
// slice is permuted to match what a thread loads: thread (g = lane / 4, t = lane % 4) loads the
// 16-byte chunk t of the slice (8 consecutive k) from weight rows g and g + 8 and from input row g,
// and hands its elements 0-3 to the first k16 step and 4-7 to the second, as the fragment
// positions (2t, 2t + 1, 2t + 8, 2t + 9) of rows g / g + 8 (A) and column g (B). No shared memory
// for the operands, no shuffles; each warp streams its k slices of 16 rows with GEMV_MMA_U slices
// in flight. Block: 16 output rows, 8 warps split the input; their partial tiles are summed in
// shared memory. Input modes and output flags as gemv_fused_impl's (MODE 1: the row RMS-normed
// on the fly with nw, rounded to bf16; flags 1 f32 out, 2 residual add, 8 GLU of [gate; up] with
// 16 for GELU-tanh: then block j's 16 rows are gate rows 8j .. 8j + 7 and their up rows).
// in % 8 == 0, 1 <= n_rows <= 8; grid (ceil(out / 16)), with flag 8 (ceil(out / 2 / 8)); block 256.
#define GEMV_MMA_U 4
template <int MODE>
__device__ __forceinline__ void gemv_mma_impl(const bf16* __restrict__ x, const float* __restrict__ nw,
                                              const bf16* __restrict__ w, void* y, u32 n_rows, u32 in, u32 out,
                                              u32 flags, float eps) {
    __shared__ float red[8][16][8];
    __shared__ float scratch[8][8];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 c8 = in / 8;
    const bool glu_out = (flags & 8) != 0;
    const u32 half = out / 2;
    // Weight rows of A's rows g and g + 8: output rows o0 + g, o0 + g + 8, or (GLU) gate row
    // j0 + g and its up row.
    const u32 o0 = blockIdx.x * 16, j0 = blockIdx.x * 8;
    const u32 ra = glu_out ? min(j0 + g, half - 1) : min(o0 + g, out - 1);
    const u32 rb = glu_out ? half + min(j0 + g, half - 1) : min(o0 + g + 8, out - 1);
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (u64)ra * in);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (u64)rb * in);
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    const float4* nw4 = reinterpret_cast<const float4*>(nw);
    const bool has_x = g < n_rows;
    // Slice q (32 k: chunks 4q .. 4q + 3) of warp w's iteration it, unrolled u: q = (it U + u) 8 + w.
    const u32 slices = (c8 + 3) / 4, iters = (slices + 8 * GEMV_MMA_U - 1) / (8 * GEMV_MMA_U);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint4 wa[GEMV_MMA_U], wb[GEMV_MMA_U];
    auto load_w = [&](u32 it) {
#pragma unroll
        for (int u = 0; u < GEMV_MMA_U; ++u) {
            const u32 c = 4 * ((it * GEMV_MMA_U + u) * 8 + warp) + t;
            wa[u] = c < c8 ? ld_stream(w0 + c) : make_uint4(0, 0, 0, 0);
            wb[u] = c < c8 ? ld_stream(w1 + c) : make_uint4(0, 0, 0, 0);
        }
    };
    // The first weights before the PDL wait (they are constant), the inputs after it.
    load_w(0);
    pdl_wait();
    pdl_trigger();
    // MODE 1: input row g's RMS scale (every block sums the rows' squares first, all rows in
    // one pass while its first weights are in flight).
    float scale = 1.0f;
    if (MODE == 1) scale = gf_rms_scales8(xs, n_rows, c8, in, eps, scratch, g);
    for (u32 it = 0; it < iters; ++it) {
        uint4 xv[GEMV_MMA_U];
#pragma unroll
        for (int u = 0; u < GEMV_MMA_U; ++u) {
            const u32 c = 4 * ((it * GEMV_MMA_U + u) * 8 + warp) + t;
            xv[u] = has_x && c < c8 ? gf_x<MODE>(xs, nw4, c8, g, c, scale) : make_uint4(0, 0, 0, 0);
        }
        uint4 ca[GEMV_MMA_U], cb[GEMV_MMA_U];
#pragma unroll
        for (int u = 0; u < GEMV_MMA_U; ++u) {
            ca[u] = wa[u];
            cb[u] = wb[u];
        }
        if (it + 1 < iters) load_w(it + 1);
#pragma unroll
        for (int u = 0; u < GEMV_MMA_U; ++u) mma_k32_slice(acc, ca[u], cb[u], xv[u]);
    }
    // acc: A rows g, g + 8 of the block's 16, columns (input rows) 2t, 2t + 1.
    red[warp][g][2 * t] = acc[0];
    red[warp][g][2 * t + 1] = acc[1];
    red[warp][g + 8][2 * t] = acc[2];
    red[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    if (glu_out) {
        // glu [n_rows, half] = act(bf16(gate)) * bf16(up), rounded as glu_bf16 writes it.
        if (threadIdx.x < 64) {
            const u32 r = threadIdx.x >> 3, n = threadIdx.x & 7, j = j0 + r;
            float gt = 0.0f, up = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                gt += red[k][r][n];
                up += red[k][r + 8][n];
            }
            if (j < half && n < n_rows) gf_store_glu(y, (u64)n * half + j, gt, up, flags);
        }
        return;
    }
    if (threadIdx.x < 128) {
        const u32 r = threadIdx.x >> 3, n = threadIdx.x & 7, o = o0 + r;
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) v += red[k][r][n];
        if (o < out && n < n_rows) {
            const u64 i = (u64)n * out + o;
            gf_store(y, i, v, flags);
        }
    }
}

// gemv_mma_fused_m0 / _m1: gemv_fused_n*_m*'s arguments plus n_rows; m0 with flags 0 / 1 is
// the plain product `linear` runs at 3-8 rows.
#define GEMV_MMA_FUSED_ENTRY(NAME, MODE)                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        NAME(const bf16* x, const float* nw, const bf16* w, void* y, u32 n_rows, u32 in, u32 out,   \
             u32 flags, float eps) {                                                               \
        gemv_mma_impl<MODE>(x, nw, w, y, n_rows, in, out, flags, eps);                             \
    }
GEMV_MMA_FUSED_ENTRY(gemv_mma_fused_m0, 0)
GEMV_MMA_FUSED_ENTRY(gemv_mma_fused_m1, 1)

// stream_read_bench: reads n16 16-byte chunks (grid-stride, four loads in flight a thread) and
// writes one word a block so the loads are kept: the read rate a GEMV of the same bytes could
// reach at most (examples/cuda_bench.rs `gemv`). grid any, block 256.
extern "C" __global__ void __launch_bounds__(256) stream_read_bench(const uint4* __restrict__ p, u64 n16,
                                                                    u32* sink) {
    pdl_wait();
    pdl_trigger();
    u32 a = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 v0 = ld_stream(p + i), v1 = ld_stream(p + i + stride), v2 = ld_stream(p + i + 2 * stride),
                    v3 = ld_stream(p + i + 3 * stride);
        a ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
    }
    for (; i < n16; i += stride) a ^= ld_stream(p + i).x;
    a = __reduce_xor_sync(0xffffffffu, a);
    if ((threadIdx.x & 31) == 0 && a == 0x9e3779b9u) sink[blockIdx.x] = a;
}
