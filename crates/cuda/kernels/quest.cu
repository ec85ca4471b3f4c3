// quest.cu: Quest's page selection at decode on the GPU (the CPU policy is crates/kv/src/quest.rs:
// PageBounds, upper_bound). A global layer's keys are cut into pages of P tokens; per (slot, kv
// head, page) the channel-wise key minimum and maximum are kept, `bounds [num_slots, kv_heads,
// maxp, 2, D]` bf16 (exact: they are cache values, and e4m3 values are bf16 values). At each
// decode step a page's score is the bound sum_g sum_i max(q_gi min_i, q_gi max_i) over the GQA
// group's query heads; quest_topk keeps the best k full pages, and the sparse decode kernel reads
// them in place (its page list) plus the newest, partial page (always read).
//   quest_bounds  bounds of pages [p0, p1) of one slot, for several layers (after a prefill)
//   quest_score   per (sequence, kv head, full page before the newest): the bound; the `fresh`
//                 full pages before the newest get their bounds recomputed first (a page fills
//                 during decode)
//   quest_topk    per (sequence, kv head): the k best full pages, ascending (ties: lower page
//                 first), by a radix select over the scores held in shared memory

// One warp computes page p's bounds of one (slot, kv head): rows [p P, p P + P) of `k` (that
// run's rows), channels c = lane + 32 i. Writes them to `b` ([2, D]: min, max) and returns them
// in mn / mx (channel lane + 32 i at index i).
template <bool F8, int PER>
__device__ __forceinline__ void quest_page_bounds(const void* k, u32 p, u32 P, u32 D, bf16* b, float* mn, float* mx) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        mn[i] = -NEG_INF;
        mx[i] = NEG_INF;
    }
    for (u32 t = p * P; t < (p + 1) * P; ++t) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const u32 c = lane + 32 * i;
            if (c >= D) continue;
            float x;
            if constexpr (F8)
                x = fp82f(reinterpret_cast<const unsigned char*>(k)[(u64)t * D + c]);
            else
                x = bf2f(reinterpret_cast<const bf16*>(k)[(u64)t * D + c]);
            mn[i] = fminf(mn[i], x);
            mx[i] = fmaxf(mx[i], x);
        }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const u32 c = lane + 32 * i;
        if (c >= D) continue;
        b[c] = f2bf(mn[i]);
        b[D + c] = f2bf(mx[i]);
    }
}

// kptrs[z]: layer z's K cache [num_slots, kv_heads, capacity, D]; bounds + z * bstride: that
// layer's bounds. grid (ceil((p1 - p0) / 8), kv_heads, layers), block 256 (a warp a page).
template <bool F8>
__device__ __forceinline__ void quest_bounds_impl(const u64* __restrict__ kptrs, bf16* __restrict__ bounds,
                                                  u64 bstride, u32 slot, u32 kv_heads, u32 capacity, u32 D,
                                                  u32 maxp, u32 P, u32 p0, u32 p1) {
    const u32 p = p0 + blockIdx.x * 8 + (threadIdx.x >> 5), h = blockIdx.y;
    if (p >= p1 || p >= maxp) return;
    const u64 run = (u64)slot * kv_heads + h;
    const size_t eb = F8 ? 1 : 2;
    const void* k = reinterpret_cast<const unsigned char*>(kptrs[blockIdx.z]) + run * capacity * D * eb;
    bf16* b = bounds + blockIdx.z * bstride + (run * maxp + p) * 2 * D;
    float mn[8], mx[8];
    quest_page_bounds<F8, 8>(k, p, P, D, b, mn, mx);
}
extern "C" __global__ void quest_bounds(const u64* __restrict__ kptrs, bf16* __restrict__ bounds, u64 bstride,
                                        u32 slot, u32 kv_heads, u32 capacity, u32 D, u32 maxp, u32 P, u32 p0,
                                        u32 p1) {
    quest_bounds_impl<false>(kptrs, bounds, bstride, slot, kv_heads, capacity, D, maxp, P, p0, p1);
}
extern "C" __global__ void quest_bounds_f8(const u64* __restrict__ kptrs, bf16* __restrict__ bounds, u64 bstride,
                                           u32 slot, u32 kv_heads, u32 capacity, u32 D, u32 maxp, u32 P, u32 p0,
                                           u32 p1) {
    quest_bounds_impl<true>(kptrs, bounds, bstride, slot, kv_heads, capacity, D, maxp, P, p0, p1);
}

// q [batch, n_heads, D] (after qkv_post); k: this layer's K cache; bounds: this layer's; sequence
// b (slot slots[b], length seq_lens[b] including the newest token) has nfull = (len - 1) / P
// full pages before its newest one. scores [batch, kv_heads, maxp] f32: the bound for p < nfull
// (nothing written after); cnt [batch, kv_heads] = nfull. Pages [nfull - fresh, nfull) get their
// bounds from the keys first. grid (ceil(maxp / 64), kv_heads, batch), block 256: warp w takes pages
// x * 64 + w, + 8, ... D <= 256.
template <bool F8>
__device__ __forceinline__ void quest_score_impl(const bf16* __restrict__ q, const void* __restrict__ k,
                                                 bf16* __restrict__ bounds, const u32* __restrict__ seq_lens,
                                                 const u32* __restrict__ slots, float* __restrict__ scores,
                                                 u32* __restrict__ cnt, u32 n_heads, u32 kv_heads, u32 capacity,
                                                 u32 num_slots, u32 D, u32 maxp, u32 P, u32 fresh) {
    __shared__ float qs[16 * 256];
    const u32 h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 G = n_heads / kv_heads;
    const u32 slot = slots[b];
    const u32 len = slot < num_slots ? min(seq_lens[b], capacity) : 0;
    const u32 nfull = len > 0 ? (len - 1) / P : 0;
    float* s = scores + ((u64)b * kv_heads + h) * maxp;
    if (blockIdx.x == 0 && threadIdx.x == 0) cnt[(u64)b * kv_heads + h] = nfull;
    const u32 pa = blockIdx.x * 64, pz = min(pa + 64, nfull);
    if (pa >= nfull) return;
    for (u32 i = threadIdx.x; i < G * D; i += blockDim.x) qs[i] = bf2f(q[((u64)b * n_heads + h * G) * D + i]);
    __syncthreads();
    const u64 run = (u64)slot * kv_heads + h;
    const size_t eb = F8 ? 1 : 2;
    const void* kr = reinterpret_cast<const unsigned char*>(k) + run * capacity * D * eb;
    bf16* br = bounds + run * maxp * 2 * D;
    for (u32 p = pa + warp; p < pz; p += 8) {
        float mn[8], mx[8];
        if (p + fresh >= nfull) {
            quest_page_bounds<F8, 8>(kr, p, P, D, br + (u64)p * 2 * D, mn, mx);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const u32 c = lane + 32 * i;
                mn[i] = c < D ? bf2f(br[(u64)p * 2 * D + c]) : 0.0f;
                mx[i] = c < D ? bf2f(br[(u64)p * 2 * D + D + c]) : 0.0f;
            }
        }
        float acc = 0.0f;
        for (u32 g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const u32 c = lane + 32 * i;
                if (c >= D) continue;
                const float qv = qs[g * D + c];
                acc += fmaxf(qv * mn[i], qv * mx[i]);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) s[p] = acc;
    }
}
extern "C" __global__ void __launch_bounds__(256)
    quest_score(const bf16* __restrict__ q, const bf16* __restrict__ k, bf16* __restrict__ bounds,
                const u32* __restrict__ seq_lens, const u32* __restrict__ slots, float* __restrict__ scores,
                u32* __restrict__ cnt, u32 n_heads, u32 kv_heads, u32 capacity, u32 num_slots, u32 D, u32 maxp,
                u32 P, u32 fresh) {
    quest_score_impl<false>(q, k, bounds, seq_lens, slots, scores, cnt, n_heads, kv_heads, capacity, num_slots, D,
                            maxp, P, fresh);
}
extern "C" __global__ void __launch_bounds__(256)
    quest_score_f8(const bf16* __restrict__ q, const bf16* __restrict__ k, bf16* __restrict__ bounds,
                   const u32* __restrict__ seq_lens, const u32* __restrict__ slots, float* __restrict__ scores,
                   u32* __restrict__ cnt, u32 n_heads, u32 kv_heads, u32 capacity, u32 num_slots, u32 D, u32 maxp,
                   u32 P, u32 fresh) {
    quest_score_impl<true>(q, k, bounds, seq_lens, slots, scores, cnt, n_heads, kv_heads, capacity, num_slots, D,
                           maxp, P, fresh);
}

// An f32's order as a u32 (larger float, larger key).
__device__ __forceinline__ u32 quest_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

// Per (sequence b, kv head h): n = cnt[b, h] scores (the full pages), m = min(k, n) of them kept:
// the m largest (ties: lower page first) as ascending pages into sel[b, h, :m]; mcount[b] = m.
// The scores are copied to shared memory as keys; a radix select of four 8-bit digits finds the
// m-th largest key (each digit found by one warp's parallel suffix count over 256 bins), and an
// ordered pass writes the pages. Up to QUEST_TOPK_MAX scores (128K tokens in pages of 16) are
// held in shared memory; more are read from `scores` at each pass. grid (kv_heads, batch), block
// 1024.
#define QUEST_TOPK_MAX 8192
extern "C" __global__ void __launch_bounds__(1024)
    quest_topk(const float* __restrict__ scores, const u32* __restrict__ cnt, u32* __restrict__ sel,
               u32* __restrict__ mcount, u32 kv_heads, u32 maxp, u32 k) {
    __shared__ u32 keys[QUEST_TOPK_MAX];
    __shared__ u32 hist[256];
    __shared__ u32 sh_digit, sh_rem;
    const u32 h = blockIdx.x, b = blockIdx.y, T = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 row = (u64)b * kv_heads + h;
    const u32 n = min(cnt[row], maxp);
    const u32 m = min(k, n);
    if (h == 0 && threadIdx.x == 0) mcount[b] = m;
    u32* out = sel + row * k;
    if (m == n) {  // every full page
        for (u32 i = threadIdx.x; i < n; i += T) out[i] = i;
        return;
    }
    const float* s = scores + row * maxp;
    const bool shared = n <= QUEST_TOPK_MAX;
    if (shared)
        for (u32 i = threadIdx.x; i < n; i += T) keys[i] = quest_key(s[i]);
    auto key_at = [&](u32 i) { return shared ? keys[i] : quest_key(s[i]); };
    u32 prefix = 0, mask = 0, rem = m;  // the m-th largest key's digits so far; keys to take at it
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = threadIdx.x; i < 256; i += T) hist[i] = 0;
        __syncthreads();
        // warp-aggregated: the keys of a pass share a few bins (the top digit of nearby scores),
        // so one atomic a bin and warp instead of one a key
        for (u32 t0 = 0; t0 < n; t0 += T) {
            const u32 i = t0 + threadIdx.x;
            const bool ok = i < n && (key_at(i) & mask) == prefix;
            const u32 bin = ok ? (key_at(i) >> shift) & 255 : 256 + lane;
            const u32 peers = __match_any_sync(0xffffffffu, bin);
            if (ok && lane == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[bin], (u32)__popc(peers));
        }
        __syncthreads();
        if (warp == 0) {
            // lane l holds bins 255 - 8 l .. 248 - 8 l (from the top)
            u32 c[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = hist[255 - 8 * lane - j];
                tot += c[j];
            }
            u32 incl = tot;  // inclusive prefix over lanes (bins above and in this lane's)
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= (u32)o) incl += v;
            }
            const u32 excl = incl - tot;
            if (excl < rem && rem <= incl) {
                u32 acc = excl;
                int j = 0;
                for (; j < 7; ++j) {
                    if (acc + c[j] >= rem) break;
                    acc += c[j];
                }
                sh_digit = 255 - 8 * lane - j;
                sh_rem = rem - acc;
            }
        }
        __syncthreads();
        prefix |= sh_digit << shift;
        mask |= 255u << shift;
        rem = sh_rem;
    }
    // prefix is the m-th largest key: take every key above it and the first `rem` equal to it.
    topk_write_ascending(key_at, n, prefix, rem, m, 0, out);
}
