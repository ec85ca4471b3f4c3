// sfi_cand.cu: SFI's cheaper slow step on the GPU (the CPU rule: crates/kv/src/sfi/candidates.rs,
// `candidate_pages` and `view_ranges`). A capturing row whose slow step is cheap reads, instead
// of every key, a VIEW: the sinks' pages, the `want` pages (of P keys) whose Quest bound on q.k
// is highest (shared by the layer's kv heads), and its recent window; the Selector then chooses
// among the keys of the view.
// Per global layer, before the row's attention:
//   sfi_cand_ub     per (capturing row, query head, candidate page): the bound, and each query
//                   head's best bound (the pages' key min / max are kept like Quest's, computed
//                   for the pages from vmeta's `fresh` on)
//   sfi_cand_score  per (capturing row, page): the largest gap to a query head's best bound over
//                   the query heads; the sinks' pages and the two forced pages +inf
//   quest_topk      (kv_heads = 1, a row a capturing row) the top `first + want` pages, ascending:
//                   the row's page list, which attn_sparse_decode_* reads (its VIEW)
// After the forward, for the Selector over the view of (capturing row r, layers):
//   sfi_view_norms  the key norms in view order
//   sfi_pos_prior_view  the position prior at the view's positions, per layer
//   sfi_view_unmap  the Selector's picks (view indices) back to positions, for sfi_gather
// vmeta [cap_rows, 8] u32 (uploaded with the capture flags): 0 active, 1 P, 2 entries (first +
// want), 3 recent start, 4 first (sinks' pages), 5 pages (candidates are [first, pages)),
// 6 fresh (bounds computed from this page on), 7 the row's batch index.

// The view position of view index j: page list entries first, then the recent part.
__device__ __forceinline__ u32 sfi_view_pos(const u32* __restrict__ vp, u32 np, u32 P, u32 rs, u32 j) {
    return j < np * P ? vp[j / P] * P + j % P : rs + (j - np * P);
}

// ub [cap_rows, n_heads, maxp] f32 (page p's bound for query head hq); best [cap_rows, n_heads]
// u32 (quest_key of the largest over the row's pages, atomicMax; zeroed before). q [batch, n_heads,
// D] after qkv_post; k: this layer's K cache; bounds: this layer's [num_slots, kv_heads, maxp, 2,
// D]. grid (ceil(maxp / SFI_CAND_PAGES), kv_heads, cap_rows), block 256: the block's pages from
// `fresh` on get their bounds first (a warp a page), then SFI_CAND_TPP threads a page each read
// every SFI_CAND_TPP-th 8-channel chunk of its bounds in 16-byte loads, sum every query head of
// the group over them (the query from shared memory) and add the partial sums up with shuffles.
// D <= 256 and a multiple of 8, G <= 16. (Run 133 had a thread a page: 39 us a layer at 32K,
// 243 GB/s, 64 blocks at 2048 pages.)
// SFI_CAND_TPP comes from the compile options (ops/sfi_cand.rs: CAND_THREADS_A_PAGE, which
// the host's grid uses too).
#ifndef SFI_CAND_TPP
#error "SFI_CAND_TPP: set by the host (ops::sfi_cand::CAND_THREADS_A_PAGE)"
#endif
#define SFI_CAND_PAGES (256 / SFI_CAND_TPP)
template <bool F8>
__device__ __forceinline__ void sfi_cand_ub_impl(const bf16* __restrict__ q, const void* __restrict__ k,
                                                 bf16* __restrict__ bounds, const u32* __restrict__ slots,
                                                 const u32* __restrict__ vmeta, float* __restrict__ ub,
                                                 u32* __restrict__ best, u32 n_heads, u32 kv_heads,
                                                 u32 capacity, u32 D, u32 maxp) {
    __shared__ __align__(16) float qs[16 * 256];
    __shared__ float bmax[8][16];
    const u32 h = blockIdx.y, r = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32* m = vmeta + (u64)r * 8;
    if (m[0] == 0) return;
    const u32 G = n_heads / kv_heads, P = m[1], first = m[4], pages = min(m[5], maxp), fresh = m[6], b = m[7];
    const u32 pa = first + blockIdx.x * SFI_CAND_PAGES, pz = min(pa + SFI_CAND_PAGES, pages);
    if (pa >= pages) return;
    for (u32 i = threadIdx.x; i < G * D; i += blockDim.x) qs[i] = bf2f(q[((u64)b * n_heads + h * G) * D + i]);
    const u64 run = (u64)slots[b] * kv_heads + h;
    const size_t eb = F8 ? 1 : 2;
    const void* kr = reinterpret_cast<const unsigned char*>(k) + run * capacity * D * eb;
    bf16* br = bounds + run * maxp * 2 * D;
    // the block's pages whose bounds are not kept yet: from the keys, a warp a page
    for (u32 p = max(pa, fresh) + warp; p < pz; p += 8) {
        float mn[8], mx[8];
        quest_page_bounds<F8, 8>(kr, p, P, D, br + (u64)p * 2 * D, mn, mx);
    }
    __syncthreads();
    const u32 sub = threadIdx.x % SFI_CAND_TPP, p = pa + threadIdx.x / SFI_CAND_TPP;
    const bool ok = p < pz;
    float acc[16];
#pragma unroll
    for (int g = 0; g < 16; ++g) acc[g] = 0.0f;
    if (ok) {
        const bf16* bp = br + (u64)p * 2 * D;
        for (u32 c = 8 * sub; c < D; c += 8 * SFI_CAND_TPP) {
            const uint4 lo = *reinterpret_cast<const uint4*>(bp + c);
            const uint4 hi = *reinterpret_cast<const uint4*>(bp + D + c);
            const bf16* l8 = reinterpret_cast<const bf16*>(&lo);
            const bf16* h8 = reinterpret_cast<const bf16*>(&hi);
            float mn[8], mx[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                mn[e] = bf2f(l8[e]);
                mx[e] = bf2f(h8[e]);
            }
#pragma unroll
            for (int g = 0; g < 16; ++g) {
                if (g < (int)G) {
                    const float4 q0 = *reinterpret_cast<const float4*>(qs + g * D + c);
                    const float4 q1 = *reinterpret_cast<const float4*>(qs + g * D + c + 4);
                    const float qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
                    float a = acc[g];
#pragma unroll
                    for (int e = 0; e < 8; ++e) a += fmaxf(qv[e] * mn[e], qv[e] * mx[e]);
                    acc[g] = a;
                }
            }
        }
    }
    // the page's SFI_CAND_TPP partial sums (every lane of the warp takes part in the shuffles)
#pragma unroll
    for (int g = 0; g < 16; ++g) {
        if (g < (int)G) {
#pragma unroll
            for (int o = SFI_CAND_TPP / 2; o > 0; o >>= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
            if (!ok) acc[g] = NEG_INF;
        }
    }
    if (ok) {
        float* u = ub + ((u64)r * n_heads + h * G) * maxp + p;
#pragma unroll
        for (int g = 0; g < 16; ++g)
            if (g < (int)G && g % SFI_CAND_TPP == (int)sub) u[(u64)g * maxp] = acc[g];
    }
    // each query head's best over the block's pages, then over the blocks
#pragma unroll
    for (int g = 0; g < 16; ++g) {
        if (g < (int)G) {
            float v = acc[g];
#pragma unroll
            for (int o = 16; o >= SFI_CAND_TPP; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
            if (lane == 0) bmax[warp][g] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float v = NEG_INF;
        for (int w = 0; w < 8; ++w) v = fmaxf(v, bmax[w][threadIdx.x]);
        if (v > NEG_INF) atomicMax(best + (u64)r * n_heads + h * G + threadIdx.x, quest_key(v));
    }
}
extern "C" __global__ void __launch_bounds__(256)
    sfi_cand_ub(const bf16* __restrict__ q, const bf16* __restrict__ k, bf16* __restrict__ bounds,
                const u32* __restrict__ slots, const u32* __restrict__ vmeta, float* __restrict__ ub,
                u32* __restrict__ best, u32 n_heads, u32 kv_heads, u32 capacity, u32 D, u32 maxp) {
    sfi_cand_ub_impl<false>(q, k, bounds, slots, vmeta, ub, best, n_heads, kv_heads, capacity, D, maxp);
}
extern "C" __global__ void __launch_bounds__(256)
    sfi_cand_ub_f8(const bf16* __restrict__ q, const bf16* __restrict__ k, bf16* __restrict__ bounds,
                   const u32* __restrict__ slots, const u32* __restrict__ vmeta, float* __restrict__ ub,
                   u32* __restrict__ best, u32 n_heads, u32 kv_heads, u32 capacity, u32 D, u32 maxp) {
    sfi_cand_ub_impl<true>(q, k, bounds, slots, vmeta, ub, best, n_heads, kv_heads, capacity, D, maxp);
}

// The inverse of quest_key.
__device__ __forceinline__ float quest_unkey(u32 key) {
    return __uint_as_float((key >> 31) ? (key & 0x7fffffffu) : ~key);
}

// scores [cap_rows, maxp]: page p < pages of row r scores the largest over query heads of its
// bound less that head's best; the sinks' pages (p < first), page `forced0` and page pages - 1 get
// +inf. cnt[r] = pages (0 for an inactive row). grid (ceil(maxp / 256), cap_rows), block 256.
extern "C" __global__ void __launch_bounds__(256)
    sfi_cand_score(const float* __restrict__ ub, const u32* __restrict__ best, const u32* __restrict__ vmeta,
                   float* __restrict__ scores, u32* __restrict__ cnt, u32 n_heads, u32 maxp, u32 forced0) {
    const u32 r = blockIdx.y, p = blockIdx.x * 256 + threadIdx.x;
    const u32* m = vmeta + (u64)r * 8;
    const u32 pages = m[0] ? min(m[5], maxp) : 0, first = m[4];
    if (p == 0 && threadIdx.x == 0) cnt[r] = pages;
    if (p >= pages) return;
    float s = -NEG_INF;
    if (p >= first && p != forced0 && p + 1 != pages) {
        s = NEG_INF;
        for (u32 hq = 0; hq < n_heads; ++hq)
            s = fmaxf(s, ub[((u64)r * n_heads + hq) * maxp + p] - quest_unkey(best[(u64)r * n_heads + hq]));
    }
    scores[(u64)r * maxp + p] = s;
}

// out [layers, kv_heads, ostride]: the key norms of view index j < vlen of capturing row r (norms
// [layers, ..] of this slot: layer z at norms + z * nls, kv head h at + h * capacity; the page
// lists vpages [layers, cap_rows, vcap]). grid (ceil(vlen / 256), kv_heads, layers), block 256.
extern "C" __global__ void sfi_view_norms(const float* __restrict__ norms, const u32* __restrict__ vpages,
                                          float* __restrict__ out, u32 r, u32 cap_rows, u32 vcap, u32 np, u32 P,
                                          u32 rs, u32 vlen, u32 capacity, u32 nls, u32 ostride) {
    const u32 j = blockIdx.x * 256 + threadIdx.x, h = blockIdx.y, z = blockIdx.z;
    if (j >= vlen) return;
    const u32* vp = vpages + ((u64)z * cap_rows + r) * vcap;
    out[((u64)z * gridDim.y + h) * ostride + j] = norms[(u64)z * nls + (u64)h * capacity + sfi_view_pos(vp, np, P, rs, j)];
}

// pp [layers, n]: the position prior of the domain [lo, hi) of view indices at their positions
// (the CPU's log_pos_prior over explicit positions). grid (ceil(n / 256), 1, layers), block 256.
extern "C" __global__ void sfi_pos_prior_view(double* __restrict__ pp, const u32* __restrict__ vpages, u32 r,
                                              u32 cap_rows, u32 vcap, u32 np, u32 P, u32 rs, u32 lo, u32 hi,
                                              const double* __restrict__ cfgp) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x, z = blockIdx.z, n = hi - lo;
    if (i >= n) return;
    const SelCfg cfg = sfi_cfg(cfgp);
    const u32* vp = vpages + ((u64)z * cap_rows + r) * vcap;
    const u32 first = sfi_view_pos(vp, np, P, rs, lo), last = sfi_view_pos(vp, np, P, rs, hi - 1);
    pp[(u64)z * n + i] = sfi_pos_at(cfg, sfi_view_pos(vp, np, P, rs, lo + i), first, last);
}

// sel [layers, kv_heads, k_cap] (mcount[z] entries a head): view indices to positions.
// grid (kv_heads, layers), block 256.
extern "C" __global__ void sfi_view_unmap(u32* __restrict__ sel, const u32* __restrict__ mcount,
                                          const u32* __restrict__ vpages, u32 r, u32 cap_rows, u32 vcap, u32 np,
                                          u32 P, u32 rs, u32 k_cap) {
    const u32 h = blockIdx.x, z = blockIdx.y;
    const u32* vp = vpages + ((u64)z * cap_rows + r) * vcap;
    u32* s = sel + ((u64)z * gridDim.x + h) * k_cap;
    for (u32 i = threadIdx.x; i < min(mcount[z], k_cap); i += blockDim.x) s[i] = sfi_view_pos(vp, np, P, rs, s[i]);
}
