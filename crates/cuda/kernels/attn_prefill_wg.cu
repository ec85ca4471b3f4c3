// attn_prefill_wg.cu: prefill flash attention on Hopper's warpgroup MMA (wgmma, sm_90a only),
// head_dim 128. A block is two warpgroups of 128 threads, 64 query rows each (128 rows a block).
// K/V tiles of 128 keys stream through an ST-stage cp.async ring into shared memory in the
// 128-byte-swizzled layout wgmma reads. S = Q K^T takes both operands from shared memory; O += P V
// takes P from registers (the S accumulators after the online softmax, rounded to bf16: the
// accumulator fragment of a warp is the A fragment of mma.m16n8k16) and V from shared memory
// (MN-major, i.e. transposed). Same arguments, masks and outputs as attn_prefill_d128*; compiled
// to a trap on other architectures, where the host never selects it.
#define WG_THREADS 256
#define WG_BQ 128
#define WG_BK 128

// D[64x128] (+)= A[64x16] B[16x128]: A, B in shared memory (descriptors), D f32 in registers
// (the warpgroup's fragment: 64 floats a thread). scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float* d, u64 desc_a, u64 desc_b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}
// D[64x64] += A[64x16] B[16x64]: A in registers (the mma.m16n8k16 A fragment of the thread's
// warp rows), B in shared memory, MN-major (transposed), D f32 (32 floats a thread).
__device__ __forceinline__ void wgmma_m64n64k16_rs_tb(float* d, const u32* a, u64 desc_b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#endif
}
__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_wait0() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Orders this thread's generic-proxy writes to shared memory (cp.async) before later
// async-proxy reads (wgmma).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving reads or writes of wgmma accumulators across the fences.
template <int N>
__device__ __forceinline__ void wg_pin(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand: rows of 64 bf16 (128 bytes),
// row r's 16-byte chunk c stored at chunk c ^ (r & 7), groups of 8 rows 1024 bytes apart (the
// stride byte offset); the tile base 1024-byte aligned. `lbo` is the leading byte offset, unused
// by these shapes (one swizzle atom across the leading dimension).
__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024u >> 4) << 32) | (1ull << 62);
}

// Async-copies rows [r0, r0 + R) of a [rows][128] bf16 matrix (row stride `stride` elements)
// into a swizzled tile at `dst`: two halves of [R][64] (columns 0-63, then 64-127), R * 128
// bytes each. Rows at or past `end` are zero-filled.
template <int R>
__device__ __forceinline__ void wg_load_tile(u32 dst, const bf16* src, u64 stride, int r0, int end) {
#pragma unroll
    for (int i = 0; i < R * 16 / WG_THREADS; ++i) {
        const int idx = threadIdx.x + i * WG_THREADS;
        const int r = idx >> 4, c16 = idx & 15, c = c16 & 7;
        const bool ok = r0 + r < end;
        const bf16* g = src + (u64)(ok ? r0 + r : 0) * stride + c16 * 8;
        cp_async_16(dst + (c16 >> 3) * (R * 128) + r * 128 + ((c ^ (r & 7)) << 4), g, ok ? 16u : 0u);
    }
}

// grid (ceil(n_q / 128), n_heads), block 256, dynamic smem 1024 + 128 * 256 + ST * 2 * 128 * 256.
template <int ST>
__device__ __forceinline__ void attn_prefill_wg_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                     const bf16* __restrict__ v_cache, bf16* __restrict__ o,
                                                     float* __restrict__ lse, u32 n_q, u32 n_heads, u32 kv_heads,
                                                     u32 capacity, u32 pos0, u32 window, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr int D = 128, BQ = WG_BQ, BK = WG_BK;
    constexpr u32 QB = BQ * 256, KB = BK * 256;  // bytes of the Q tile and of one K or V tile
    const u32 sbase = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 qs = sbase, ks = sbase + QB, vs = ks + ST * KB;

    const PfTile tl = pf_tile<D, BQ, BK>(k_cache, v_cache, n_q, n_heads, kv_heads, capacity, pos0, window);
    const int h = tl.h, q0 = tl.q0, kv_len = tl.kv_len, t_begin = tl.t_begin, t_end = tl.t_end;
    const bf16 *kc = tl.kc, *vc = tl.vc;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, tig = lane & 3;
    // This warpgroup's rows: positions [w_first, w_last] (empty past the last query row).
    const int wq0 = q0 + wg * 64;
    const int w_first = (int)pos0 + wq0;
    const int w_last = wq0 < (int)n_q ? (int)pos0 + min(wq0 + 63, (int)n_q - 1) : -1;
    const int pa = w_first + warp * 16 + g, pb = pa + 8;

    wg_load_tile<BQ>(qs, q + (u64)h * D, (u64)n_heads * D, q0, n_q);
    wg_load_tile<BK>(ks, kc, D, t_begin * BK, kv_len);
    wg_load_tile<BK>(vs, vc, D, t_begin * BK, kv_len);
    cp_async_commit();
#pragma unroll
    for (int st = 1; st < ST - 1; ++st) {
        if (t_begin + st < t_end) {
            wg_load_tile<BK>(ks + st * KB, kc, D, (t_begin + st) * BK, kv_len);
            wg_load_tile<BK>(vs + st * KB, vc, D, (t_begin + st) * BK, kv_len);
        }
        cp_async_commit();
    }

    float s[BK / 8][4], oacc[2][32];  // S: the m64n128 accumulator fragment, 16 8-key blocks
#pragma unroll
    for (int i = 0; i < 32; ++i) oacc[0][i] = oacc[1][i] = 0.0f;
    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.0f, 0.0f};

    for (int t = t_begin; t < t_end; ++t) {
        cp_async_wait<ST - 2>();
        fence_proxy_async_smem();
        __syncthreads();  // tile t is in every thread's view; tile t - 1's stage is free
        const int stage = (t - t_begin) % ST;
        if (t + ST - 1 < t_end) {
            const int ahead = (t - t_begin + ST - 1) % ST;
            wg_load_tile<BK>(ks + ahead * KB, kc, D, (t + ST - 1) * BK, kv_len);
            wg_load_tile<BK>(vs + ahead * KB, vc, D, (t + ST - 1) * BK, kv_len);
        }
        cp_async_commit();
        const int j0 = t * BK;
        // Keys wholly after this warpgroup's last row, or wholly before its window: skip.
        if (j0 > w_last || (window != 0 && j0 + BK - 1 <= w_first - (int)window)) continue;
        const u32 kst = ks + stage * KB, vst = vs + stage * KB;

        // S = Q K^T over the 8 16-column steps of head_dim (4 per swizzled half).
        wg_pin<64>(&s[0][0]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 off = (kk & 3) * 32;  // 16 columns = 32 bytes into the swizzled row
            const u64 da = wg_desc(qs + (kk >> 2) * (QB / 2) + wg * 64 * 128 + off, 16);
            const u64 db = wg_desc(kst + (kk >> 2) * (KB / 2) + off, 16);
            wgmma_m64n128k16_ss(&s[0][0], da, db, kk > 0 ? 1 : 0);
        }
        wg_commit();
        wg_wait0();
        wg_pin<64>(&s[0][0]);

        const bool need_mask = (j0 + BK - 1 > w_first) || (j0 + BK > kv_len) ||
                               (window != 0 && j0 <= w_last - (int)window);
        float alpha[2];
        pf_softmax<BK / 8>(s, need_mask, j0, pa, pb, kv_len, window, tig, scale_log2, m_r, l_r, alpha);
        u32 pf[BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            pf[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            pf[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            pf[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pf[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
        // Once the running max settles (most tiles of a long row) alpha is exactly 1.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int nb = 0; nb < 8; ++nb) {
                    oacc[hh][nb * 4] *= alpha[0];
                    oacc[hh][nb * 4 + 1] *= alpha[0];
                    oacc[hh][nb * 4 + 2] *= alpha[1];
                    oacc[hh][nb * 4 + 3] *= alpha[1];
                }
        }

        // O += P V: 8 16-key steps, each over the two 64-column halves of V.
        wg_pin<32>(oacc[0]);
        wg_pin<32>(oacc[1]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const u64 dv = wg_desc(vst + hh * (KB / 2) + kk * 16 * 128, 1024);
                wgmma_m64n64k16_rs_tb(oacc[hh], pf[kk], dv, 1);
            }
        }
        wg_commit();
        wg_wait0();
        wg_pin<32>(oacc[0]);
        wg_pin<32>(oacc[1]);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 1);
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 2);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = wq0 + warp * 16 + g + 8 * half;
        if (row >= (int)n_q) continue;
        const float l = l_r[half];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        bf16* orow = o + ((u64)row * n_heads + h) * D;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
                *reinterpret_cast<u32*>(orow + hh * 64 + nb * 8 + 2 * tig) =
                    pack_bf16x2(oacc[hh][nb * 4 + 2 * half] * inv, oacc[hh][nb * 4 + 2 * half + 1] * inv);
        if (lse != nullptr && tig == 0)
            lse[(u64)row * n_heads + h] = l > 0.0f ? (m_r[half] * scale_log2 + log2f(l)) * LN2_F : NEG_INF;
    }
#else
    __trap();
#endif
}

#define PREFILL_WG_ENTRY(NAME, ST)                                                                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                         \
        NAME(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* o, float* lse, u32 n_q,       \
             u32 n_heads, u32 kv_heads, u32 capacity, u32 pos0, u32 window, float scale_log2) {           \
        attn_prefill_wg_impl<ST>(q, k_cache, v_cache, o, lse, n_q, n_heads, kv_heads, capacity, pos0,    \
                                 window, scale_log2);                                                    \
    }
PREFILL_WG_ENTRY(attn_prefill_d128_wg, 2)
PREFILL_WG_ENTRY(attn_prefill_d128_wg3, 3)
