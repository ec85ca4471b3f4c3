// attn_prefill.cu: tiled flash attention for prefill (FA2-style, bf16 mma.sync m16n8k16,
// f32 online softmax). Causal over positions pos0.., GQA, optional sliding window; reads
// earlier keys from the cache; memory is O(tile), never O(prompt^2).
#define ATT_THREADS 128

// Async-copies key rows [j0, j0 + BK) of one head into shared tiles [BK][D + 8];
// rows outside [0, kv_len) are zero-filled.
template <int D, int BK>
__device__ __forceinline__ void pf_load_kv(bf16* ks, bf16* vs, const bf16* kc, const bf16* vc, int j0,
                                           int kv_len) {
    constexpr int CH = D / 8, STR = D + 8;
    for (int idx = threadIdx.x; idx < BK * CH; idx += ATT_THREADS) {
        const int r = idx / CH, c = idx % CH, j = j0 + r;
        const bool ok = j < kv_len;
        const u64 off = (u64)(ok ? j : 0) * D + c * 8;
        cp_async_16(smem_addr(ks + r * STR + c * 8), kc + off, ok ? 16u : 0u);
        cp_async_16(smem_addr(vs + r * STR + c * 8), vc + off, ok ? 16u : 0u);
    }
}

// The same over e4m3 caches (kc8 / vc8: the head's rows, D bytes each): 16 bytes a copy into the
// upper half of each shared row, widened by fp8_tiles_to_bf16 once the copy has landed.
template <int D, int BK>
__device__ __forceinline__ void pf_load_kv8(bf16* ks, bf16* vs, const unsigned char* kc8, const unsigned char* vc8,
                                            int j0, int kv_len) {
    constexpr int C = D / 16, STR = D + 8;
    for (int idx = threadIdx.x; idx < BK * C; idx += ATT_THREADS) {
        const int r = idx / C, c = idx % C, j = j0 + r;
        const bool ok = j < kv_len;
        const u64 off = (u64)(ok ? j : 0) * D + c * 16;
        cp_async_16(fp8_row_dst(ks + r * STR, D, c), kc8 + off, ok ? 16u : 0u);
        cp_async_16(fp8_row_dst(vs + r * STR, D, c), vc8 + off, ok ? 16u : 0u);
    }
}

// A prefill block's query tile and the key tiles it reads: query rows [q0, q0 + BQ) of head h
// (blocks in reverse order, so the heaviest, last tiles start first), positions
// [p_first, p_last], keys [t_begin * BK, t_end * BK) of kv head kvh's cache rows kc / vc.
struct PfTile {
    int h, q0, kv_len, p_first, p_last, t_begin, t_end;
    const bf16* kc;
    const bf16* vc;
};
template <int D, int BQ, int BK>
__device__ __forceinline__ PfTile pf_tile(const bf16* k_cache, const bf16* v_cache, u32 n_q, u32 n_heads,
                                          u32 kv_heads, u32 capacity, u32 pos0, u32 window) {
    PfTile t;
    t.h = blockIdx.y;
    const int kvh = t.h / (n_heads / kv_heads);
    t.q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    t.kv_len = pos0 + n_q;
    t.kc = k_cache + (u64)kvh * capacity * D;
    t.vc = v_cache + (u64)kvh * capacity * D;
    t.p_first = pos0 + t.q0;
    t.p_last = pos0 + min(t.q0 + BQ - 1, (int)n_q - 1);
    const int lo = window ? max(0, t.p_first - (int)window + 1) : 0;
    t.t_begin = lo / BK;
    t.t_end = (t.p_last + BK) / BK;
    return t;
}

// The online-softmax step of one 16-row m-tile (the mma accumulator layout: rows g and g + 8 of
// the warp, NT 8-key blocks from key j0) over its unscaled scores s. With need_mask, keys after
// a row's position (pa for row g, pb for row g + 8), at or past kv_len, or outside the window
// are -inf. Updates the running max m_r and sum l_r, turns s into the exp2 weights and returns
// each row's rescale factor for the accumulators in alpha.
template <int NT>
__device__ __forceinline__ void pf_softmax(float (*s)[4], bool need_mask, int j0, int pa, int pb, int kv_len,
                                           u32 window, int tig, float scale_log2, float* m_r, float* l_r,
                                           float* alpha) {
    if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = j0 + nt * 8 + 2 * tig + (e & 1);
                const int p = e < 2 ? pa : pb;
                const bool ok = j <= p && j < kv_len && (window == 0 || j + (int)window > p);
                if (!ok) s[nt][e] = NEG_INF;
            }
        }
    }
    float mx[2] = {m_r[0], m_r[1]};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
    }
    // Scores stay unscaled; the scale folds into one FFMA before each exp2.
    float nb[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        nb[i] = mx[i] == NEG_INF ? 0.0f : -mx[i] * scale_log2;
        alpha[i] = exp2f(fmaf(m_r[i], scale_log2, nb[i]));
        m_r[i] = mx[i];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = exp2f(fmaf(s[nt][0], scale_log2, nb[0]));
        s[nt][1] = exp2f(fmaf(s[nt][1], scale_log2, nb[0]));
        s[nt][2] = exp2f(fmaf(s[nt][2], scale_log2, nb[1]));
        s[nt][3] = exp2f(fmaf(s[nt][3], scale_log2, nb[1]));
        rs[0] += s[nt][0] + s[nt][1];
        rs[1] += s[nt][2] + s[nt][3];
    }
    l_r[0] = l_r[0] * alpha[0] + rs[0];
    l_r[1] = l_r[1] * alpha[1] + rs[1];
}

// q, o [n_q, n_heads, D]; k_cache, v_cache [kv_heads, capacity, D] (one slot);
// lse [n_q, n_heads] natural-log log-sum-exp of the scaled scores, or null.
// Query row i sits at position pos0 + i and sees keys j <= pos0 + i (and j > pos0 + i - window
// when window > 0). Each of the 4 warps owns MT 16-row m-tiles (BQ = 64 MT rows a block), so
// every K/V fragment read from shared memory feeds MT mma instructions.
// K/V tiles stream through an ST-stage cp.async ring (ST - 1 tiles in flight during compute).
// grid (ceil(n_q / BQ), n_heads), block 128, dynamic smem (BQ + 2 ST BK)(D + 8) * 2 bytes.
template <int D, int BK, int MT, int ST, bool F8 = false>
__device__ __forceinline__ void attn_prefill_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                  const bf16* __restrict__ v_cache, bf16* __restrict__ o,
                                                  float* __restrict__ lse, u32 n_q, u32 n_heads, u32 kv_heads,
                                                  u32 capacity, u32 pos0, u32 window, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr int CH = D / 8, STR = D + 8, NT = BK / 8, DT = D / 8, BQ = 64 * MT;
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);  // [BQ][STR]
    bf16* ks = qs + BQ * STR;                       // [ST][BK][STR]
    bf16* vs = ks + ST * BK * STR;                  // [ST][BK][STR]

    const PfTile tl = pf_tile<D, BQ, BK>(k_cache, v_cache, n_q, n_heads, kv_heads, capacity, pos0, window);
    const int h = tl.h, q0 = tl.q0, kv_len = tl.kv_len, p_first = tl.p_first, p_last = tl.p_last;
    const int t_begin = tl.t_begin, t_end = tl.t_end;
    const bf16 *kc = tl.kc, *vc = tl.vc;
    // F8: e4m3 caches, this head's rows D bytes each
    const u64 head_row0 = (u64)(h / (n_heads / kv_heads)) * capacity;
    const unsigned char* kc8 = reinterpret_cast<const unsigned char*>(k_cache) + head_row0 * D;
    const unsigned char* vc8 = reinterpret_cast<const unsigned char*>(v_cache) + head_row0 * D;
    auto load_kv = [&](bf16* kd, bf16* vd, int j0) {
        if constexpr (F8)
            pf_load_kv8<D, BK>(kd, vd, kc8, vc8, j0, kv_len);
        else
            pf_load_kv<D, BK>(kd, vd, kc, vc, j0, kv_len);
    };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tig = lane & 3;

    for (int idx = threadIdx.x; idx < BQ * CH; idx += ATT_THREADS) {
        const int r = idx / CH, c = idx % CH, row = q0 + r;
        const bool ok = row < (int)n_q;
        const bf16* src = q + ((u64)(ok ? row : 0) * n_heads + h) * D + c * 8;
        cp_async_16(smem_addr(qs + r * STR + c * 8), src, ok ? 16u : 0u);
    }
    load_kv(ks, vs, t_begin * BK);
    cp_async_commit();
#pragma unroll
    for (int st = 1; st < ST - 1; ++st) {
        if (t_begin + st < t_end)
            load_kv(ks + st * BK * STR, vs + st * BK * STR, (t_begin + st) * BK);
        cp_async_commit();
    }

    float m_r[MT][2], l_r[MT][2];
    float acc[MT][DT][4];
    int pa[MT], pb[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_r[mt][0] = m_r[mt][1] = NEG_INF;
        l_r[mt][0] = l_r[mt][1] = 0.0f;
#pragma unroll
        for (int i = 0; i < DT; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;
        pa[mt] = pos0 + q0 + (warp * MT + mt) * 16 + g;
        pb[mt] = pa[mt] + 8;
    }

    for (int t = t_begin; t < t_end; ++t) {
        cp_async_wait<ST - 2>();
        __syncthreads();
        const int stage = (t - t_begin) % ST;
        if (t + ST - 1 < t_end) {
            const int ahead = (t - t_begin + ST - 1) % ST;
            load_kv(ks + ahead * BK * STR, vs + ahead * BK * STR, (t + ST - 1) * BK);
        }
        cp_async_commit();
        if constexpr (F8) fp8_tiles_to_bf16<D, BK, ATT_THREADS>(ks + stage * BK * STR, vs + stage * BK * STR);
        const bf16* kst = ks + stage * BK * STR;
        const bf16* vst = vs + stage * BK * STR;
        const int j0 = t * BK;

        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NT; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(a[mt], smem_addr(qs + ((warp * MT + mt) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STR + kk * 16 + (lane >> 4) * 8));
#pragma unroll
            for (int nn = 0; nn < BK / 16; ++nn) {
                u32 b[4];
                ldmatrix_x4(b, smem_addr(kst + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * STR + kk * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816(s[mt][2 * nn], a[mt], b);
                    mma_16816(s[mt][2 * nn + 1], a[mt], b + 2);
                }
            }
        }
        const bool need_mask = (j0 + BK - 1 > p_first) || (j0 + BK > kv_len) ||
                               (window != 0 && j0 <= p_last - (int)window);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float alpha[2];
            pf_softmax<NT>(s[mt], need_mask, j0, pa[mt], pb[mt], kv_len, window, tig, scale_log2, m_r[mt], l_r[mt],
                           alpha);
            // Once the running max settles (most tiles of a long row) alpha is exactly 1.
            if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    acc[mt][dt][0] *= alpha[0];
                    acc[mt][dt][1] *= alpha[0];
                    acc[mt][dt][2] *= alpha[1];
                    acc[mt][dt][3] *= alpha[1];
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dd = 0; dd < D / 16; ++dd) {
                u32 b[4];
                ldmatrix_x4_trans(b, smem_addr(vst + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STR + dd * 16 + (lane >> 4) * 8));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816(acc[mt][2 * dd], a[mt], b);
                    mma_16816(acc[mt][2 * dd + 1], a[mt], b + 2);
                }
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l_r[mt][i] += __shfl_xor_sync(0xffffffffu, l_r[mt][i], 1);
            l_r[mt][i] += __shfl_xor_sync(0xffffffffu, l_r[mt][i], 2);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = q0 + (warp * MT + mt) * 16 + g + 8 * half;
            if (row >= (int)n_q) continue;
            const float l = l_r[mt][half];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            bf16* orow = o + ((u64)row * n_heads + h) * D;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<u32*>(orow + dt * 8 + 2 * tig) =
                    pack_bf16x2(acc[mt][dt][2 * half] * inv, acc[mt][dt][2 * half + 1] * inv);
            if (lse != nullptr && tig == 0)
                lse[(u64)row * n_heads + h] = l > 0.0f ? (m_r[mt][half] * scale_log2 + log2f(l)) * LN2_F : NEG_INF;
        }
    }
}

#define PREFILL_ENTRY_T(NAME, D, BK, MT, ST, F8)                                                        \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                           \
        NAME(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* o, float* lse, u32 n_q,       \
             u32 n_heads, u32 kv_heads, u32 capacity, u32 pos0, u32 window, float scale_log2) {           \
        attn_prefill_impl<D, BK, MT, ST, F8>(q, k_cache, v_cache, o, lse, n_q, n_heads, kv_heads,         \
                                             capacity,                                                   \
                                         pos0, window, scale_log2);                                      \
    }
// Each entry twice: NAME over bf16 caches, NAME_f8 over e4m3 caches (the wgmma kernels of
// attn_prefill_wg.cu read bf16 only; an fp8 prefill runs these).
#define PREFILL_ENTRY(NAME, D, BK, MT, ST) \
    PREFILL_ENTRY_T(NAME, D, BK, MT, ST, false) PREFILL_ENTRY_T(NAME##_f8, D, BK, MT, ST, true)
PREFILL_ENTRY(attn_prefill_d64, 64, 64, 1, 2)
PREFILL_ENTRY(attn_prefill_d128, 128, 64, 1, 2)
PREFILL_ENTRY(attn_prefill_d256, 256, 32, 1, 2)
// Two m-tiles a warp (128 query rows a block): half the shared-memory reads per mma.
PREFILL_ENTRY(attn_prefill_d64_m2, 64, 64, 2, 2)
PREFILL_ENTRY(attn_prefill_d128_m2, 128, 32, 2, 2)
// Tried and dropped (docs/gpu-notes.md, runs 2-4): 32- and 48-key narrow d128 tiles (3-4
// blocks/SM), and 3-stage rings for the m2 kernels: none beat attn_prefill_d128_m2.
