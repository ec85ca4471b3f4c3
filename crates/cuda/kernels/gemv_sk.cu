// gemv_sk.cu: the decode step's GEMV at 1-8 rows as one persistent wave, y[n, o] =
// sum_i xin[n, i] w[o, i] on tensor cores, the work split evenly over the blocks (stream-K).
// An experiment (SLOWFAST_GEMV_SK=1, off): slower than gemv_mma and cuBLAS at every shape
// (docs/gpu-notes.md, runs 71-75).
//
// Why it was tried: at 6 rows a graph of the 144 GEMMs of a Qwen3-4B step ran at 71 % of the
// copy rate with cuBLAS or gemv_mma (run 69), and per shape the short ones lose most (o 52 %,
// q/k/v 57 %), which looked like wave quantization and each launch's ramp up and down.
// - 2 blocks a SM (gridDim <= 2 SMs), SK_WARPS warps. The work is the list of (tile, unit)
//   pairs, tile = SK_ROWS output rows, unit = SK_KC inputs; block b takes units
//   [b total / G, (b + 1) total / G), so every block streams the same bytes whatever the shape.
//   A tile cut between blocks is finished by the last of them to arrive (a counter a tile): it
//   adds the blocks' partial tiles in block order, so the result does not depend on timing.
// - Weights come straight into registers as in gemv_mma_impl (thread (g = lane / 4, t = lane %
//   4) loads 16-byte chunk t of each 32-wide slice from A rows g and g + 8, the k order inside a
//   slice permuted to match), the next unit's while the current one is multiplied; the first
//   unit's before pdl_wait().
// Input modes and output flags as gemv_fused_impl's: MODE 1 RMS-norms the input rows on the fly
// (the scale from the whole row, then x * scale * nw rounded to bf16); flags 1 f32 out, 2 residual
// add, 8 GLU of [gate; up] (16: GELU-tanh): then a tile is 8 gate rows and their 8 up rows.
// part: [gridDim][2][SK_ROWS][8] f32 (a block's partial first and last tile); cnt: one u32 a
// tile, zero between launches (the finishing block puts it back).
// in % 8 == 0, 1 <= n_rows <= 8; block SK_THREADS.
#define SK_WARPS 8
#define SK_THREADS (32 * SK_WARPS)
// A tile: 16 output rows (the mma's A rows). A unit of work: SK_KC inputs of a tile, slice
// q = u * SK_WARPS + w (32 inputs) to warp w, u < SK_U; each warp keeps its SK_U slices of the
// next unit in flight while it multiplies the current one.
#define SK_ROWS 16
#define SK_U 4
#define SK_KC (SK_WARPS * SK_U * 32)

// Weight row of the tile's row r (clamped into the matrix; rows past it are never written):
// output row 16 tile + r, or with the GLU the gate rows 8 tile .. 8 tile + 7 then their up rows.
__device__ __forceinline__ u32 sk_row(u32 tile, u32 r, bool glu, u32 out, u32 half) {
    if (!glu) return min(tile * SK_ROWS + r, out - 1);
    const u32 j = min(tile * (SK_ROWS / 2) + (r & 7), half - 1);
    return r < 8 ? j : half + j;
}

// First unit of block b when `total` are split over g blocks.
__device__ __forceinline__ u32 sk_begin(u32 b, u32 total, u32 g) {
    return (u32)(((u64)b * total) / g);
}

// The last block whose units include i.
__device__ __forceinline__ u32 sk_owner(u32 i, u32 total, u32 g) {
    return (u32)((((u64)i + 1) * g + total - 1) / total) - 1;
}

template <int MODE>
__device__ __forceinline__ void gemv_sk_impl(const bf16* __restrict__ x, const float* __restrict__ nw,
                                             const bf16* __restrict__ w, void* y, u32 n_rows, u32 in, u32 out,
                                             u32 flags, float eps, float* __restrict__ part, u32* __restrict__ cnt) {
    __shared__ float red[SK_WARPS][SK_ROWS][8];
    __shared__ float tot[SK_ROWS][8];
    __shared__ float scratch[8][8];
    __shared__ u32 last_flag;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool glu = (flags & 8) != 0;
    const u32 half = out / 2;
    const u32 tiles = glu ? (half + SK_ROWS / 2 - 1) / (SK_ROWS / 2) : (out + SK_ROWS - 1) / SK_ROWS;
    const u32 kiters = (in + SK_KC - 1) / SK_KC, total = tiles * kiters, G = gridDim.x;
    const u32 it0 = sk_begin(blockIdx.x, total, G), it1 = sk_begin(blockIdx.x + 1, total, G);
    const u32 c8 = in / 8;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    const float4* nw4 = reinterpret_cast<const float4*>(nw);

    // This thread's weights of unit `it`: chunk t of its warp's slices, A rows g and g + 8.
    auto load_w = [&](u32 it, uint4* wa, uint4* wb) {
        const u32 tile = it / kiters, cb = (it % kiters) * (SK_KC / 8);
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (u64)sk_row(tile, g, glu, out, half) * in);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (u64)sk_row(tile, g + 8, glu, out, half) * in);
#pragma unroll
        for (int u = 0; u < SK_U; ++u) {
            const u32 c = cb + 4 * (u * SK_WARPS + warp) + t;
            wa[u] = c < c8 ? ld_stream(w0 + c) : make_uint4(0, 0, 0, 0);
            wb[u] = c < c8 ? ld_stream(w1 + c) : make_uint4(0, 0, 0, 0);
        }
    };
    // The first unit's weights before the PDL wait (they are constant), the inputs after it.
    uint4 wa[SK_U], wb[SK_U];
    if (it0 < it1) load_w(it0, wa, wb);
    pdl_wait();
    pdl_trigger();
    // MODE 1: input row g's RMS scale, summed as gemv_mma_impl sums it.
    float scale = 1.0f;
    if (MODE == 1) scale = gf_rms_scales8(xs, n_rows, c8, in, eps, scratch, g);
    const bool has_x = g < n_rows;

    // The tile's sums v[r][n] (rows r < 16, input rows n < 8) are added over the warps into
    // tot; thread i < 128 then holds element (i / 8, i % 8).
    const u32 er = threadIdx.x >> 3, en = threadIdx.x & 7;
    // Writes output element (er, en) of the tile from tot (threads < 128; with the GLU the
    // threads < 64 write gate row er's GLU with its up row er + 8).
    auto epilogue = [&](u32 tile) {
        if (glu) {
            const u32 j = tile * (SK_ROWS / 2) + er;
            if (threadIdx.x < 64 && j < half && en < n_rows)
                gf_store_glu(y, (u64)en * half + j, tot[er][en], tot[er + 8][en], flags);
            return;
        }
        const u32 o = tile * SK_ROWS + er;
        if (threadIdx.x < 128 && o < out && en < n_rows) gf_store(y, (u64)en * out + o, tot[er][en], flags);
    };

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 it = it0; it < it1; ++it) {
        uint4 ca[SK_U], cb[SK_U];
#pragma unroll
        for (int u = 0; u < SK_U; ++u) {
            ca[u] = wa[u];
            cb[u] = wb[u];
        }
        if (it + 1 < it1) load_w(it + 1, wa, wb);
        const u32 tile = it / kiters, kk = it % kiters, c0 = kk * (SK_KC / 8);
#pragma unroll
        for (int u = 0; u < SK_U; ++u) {
            const u32 c = c0 + 4 * (u * SK_WARPS + warp) + t;
            const uint4 xv = has_x && c < c8 ? gf_x<MODE>(xs, nw4, c8, g, c, scale) : make_uint4(0, 0, 0, 0);
            const u32 a0[4] = {ca[u].x, cb[u].x, ca[u].y, cb[u].y};
            const u32 b0[2] = {xv.x, xv.y};
            mma_16816(acc, a0, b0);
            const u32 a1[4] = {ca[u].z, cb[u].z, ca[u].w, cb[u].w};
            const u32 b1[2] = {xv.z, xv.w};
            mma_16816(acc, a1, b1);
        }
        if (kk + 1 < kiters && it + 1 < it1) continue;
        // The tile ends here for this block: the warps' sums into tot (in warp order), then the
        // whole tile's outputs, or a part to merge. Every path passes a barrier after reading
        // red, before any warp can reach the next tile's end.
        red[warp][g][2 * t] = acc[0];
        red[warp][g][2 * t + 1] = acc[1];
        red[warp][g + 8][2 * t] = acc[2];
        red[warp][g + 8][2 * t + 1] = acc[3];
        __syncthreads();
        if (threadIdx.x < 128) {
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < SK_WARPS; ++k) v += red[k][er][en];
            tot[er][en] = v;
        }
        const u32 tb = tile * kiters;
        if (tb >= it0 && tb + kiters <= it1) {
            __syncthreads();
            epilogue(tile);
        } else {
            // Partial slot p of block b: [SK_ROWS][8] f32 at part + (2 b + p) * 128.
            const u32 slot = tile == it0 / kiters ? 0 : 1;
            if (threadIdx.x < 128) part[(blockIdx.x * 2 + slot) * 128 + threadIdx.x] = tot[er][en];
            __threadfence();
            __syncthreads();
            const u32 bf = sk_owner(tb, total, G), bl = sk_owner(tb + kiters - 1, total, G);
            if (threadIdx.x == 0) last_flag = atomicAdd(cnt + tile, 1u) == bl - bf;
            __syncthreads();
            if (last_flag) {
                __threadfence();
                if (threadIdx.x < 128) {
                    float v = 0.0f;
                    for (u32 bb = bf; bb <= bl; ++bb) {
                        const u32 sl = tile == sk_begin(bb, total, G) / kiters ? 0 : 1;
                        v += __ldcg(part + (bb * 2 + sl) * 128 + threadIdx.x);
                    }
                    tot[er][en] = v;
                }
                __syncthreads();
                epilogue(tile);
                if (threadIdx.x == 0) cnt[tile] = 0;
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = 0.0f;
    }
}

// gemv_sk_m0 / _m1: gemv_mma_fused_m*'s arguments plus the merge scratch (part, cnt).
#define GEMV_SK_ENTRY(NAME, MODE)                                                                  \
    extern "C" __global__ void __launch_bounds__(SK_THREADS)                                       \
        NAME(const bf16* x, const float* nw, const bf16* w, void* y, u32 n_rows, u32 in, u32 out,   \
             u32 flags, float eps, float* part, u32* cnt) {                                        \
        gemv_sk_impl<MODE>(x, nw, w, y, n_rows, in, out, flags, eps, part, cnt);                   \
    }
GEMV_SK_ENTRY(gemv_sk_m0, 0)
GEMV_SK_ENTRY(gemv_sk_m1, 1)
