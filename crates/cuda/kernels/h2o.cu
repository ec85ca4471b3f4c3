// h2o.cu: H2O (heavy hitters + recent window) on the GPU. The rules are the CPU policy's
// (crates/kv/src/h2o.rs): per kv head of each global layer, every key's score is the softmax
// attention it received, summed over all queries so far and over the query heads of its GQA
// group; a head holds the `recent` newest keys and the `heavy` best-scored older ones, and each
// decode step evicts the lowest-scored older key (ties: the lower position).
//
// State per (global layer, slot, kv head): scores[pos] (f32, every position; an evicted key's
// score is -inf, so that a later selection never brings it back), the positions cpos[heavy] of
// the compact buffer's rows (which the sparse kernel reads), and the window [rstart, len) read in
// place. With one token a decode step the state follows from the length alone: rstart =
// max(0, len - recent), and the compact buffer holds min(heavy, rstart) rows.
//
//   h2o_colsum   prefill: probabilities of captured rows (snap_rowstats' stats) added to scores
//   h2o_prep     end of prefill: scores of keys [0, n) as the f64 that sfi_topk ranks
//   h2o_mark     end of prefill: the picks into cpos; every other key of [0, n) gets -inf
//   h2o_logits, h2o_evict   a decode step, after sparse flash-decoding: the step's probabilities
//                over the held keys added to their scores, then the key leaving the window either
//                evicted or swapped into the compact buffer for the lowest-scored heavy hitter

// scores[kvh * sstride + j] += sum over the group's query heads g (in order) of the sum over rows r
// of 2^(z[r, kvh * G + g, j] - m) / sum, for every key j some row sees (row r sees j < len0 + r).
// Logits are attn_sparse_decode_*'s capture (log2 units, row stride lstride); stats are
// snap_rowstats' (m, 1 / sum). grid (ceil((len0 + rows - 1) / 256), kv_heads), block 256.
extern "C" __global__ void h2o_colsum(const float* __restrict__ logits, const float2* __restrict__ stats,
                                      float* __restrict__ scores, u32 n_heads, u32 G, u32 rows, u32 lstride,
                                      u32 len0, u32 sstride) {
    const u32 kvh = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j + 1 >= len0 + rows) return;
    const u32 r0 = j < len0 ? 0 : j + 1 - len0; // the first row that sees key j
    float acc = 0.0f;
    for (u32 g = 0; g < G; ++g) {
        const u32 h = kvh * G + g;
        float a = 0.0f;
        for (u32 r = r0; r < rows; ++r) {
            const float2 st = stats[(u64)r * n_heads + h];
            if (st.x == NEG_INF) continue;
            a += exp2f(logits[((u64)r * n_heads + h) * lstride + j] - st.x) * st.y;
        }
        acc += a;
    }
    scores[(u64)kvh * sstride + j] += acc;
}

// out[kvh, j] = scores[kvh * sstride + j] for j < n; cnt[kvh] = n. grid (ceil(n / 256), kv_heads),
// block 256.
extern "C" __global__ void h2o_prep(const float* __restrict__ scores, double* __restrict__ out, u32* __restrict__ cnt,
                                    u32 n, u32 sstride) {
    const u32 kvh = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) cnt[kvh] = n;
    if (j < n) out[(u64)kvh * n + j] = (double)scores[(u64)kvh * sstride + j];
}

// After sfi_topk kept m = mcount[0] ascending positions sel[kvh, :m] (row stride k) of keys
// [0, n): cpos[kvh, i] = sel[kvh, i] for i < m, and scores of the keys of [0, n) not kept = -inf.
// grid (ceil(max(n, m) / 256), kv_heads), block 256.
extern "C" __global__ void h2o_mark(const u32* __restrict__ sel, const u32* __restrict__ mcount, u32* __restrict__ cpos,
                                    float* __restrict__ scores, u32 n, u32 k, u32 heavy, u32 sstride) {
    const u32 kvh = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 m = mcount[0];
    const u32* s = sel + (u64)kvh * k;
    if (j < m) cpos[(u64)kvh * heavy + j] = s[j];
    if (j >= n) return;
    u32 lo = 0, hi = m; // binary search of j among the ascending picks
    while (lo < hi) {
        const u32 mid = (lo + hi) >> 1;
        if (s[mid] < j) lo = mid + 1;
        else hi = mid;
    }
    if (lo == m || s[lo] != j) scores[(u64)kvh * sstride + j] = NEG_INF;
}

#define H2O_MAXG 16
#define H2O_KEYS 256 // held keys a block takes (a thread a key)

// One decode step of H2O on one global layer runs two kernels, for batch row b = blockIdx.x (slot
// slots[b], length seq_lens[b] with this step's token) and kv head blockIdx.y, after the sparse
// kernel read the held keys: the compact rows [0, c0) (positions cpos) and the window [r0, len),
// where r0 = max(0, len - 1 - recent) and c0 = min(heavy, r0). Block z takes held keys
// [256 z, 256 z + 256), a thread a key.
//   h2o_logits  z[b, kvh, g, i] = scale * q_g . k_i for each query head g of the group (q [batch,
//               n_heads, hd] after RoPE), and the block's max and sum of exp(z - max) per g
//   h2o_evict   each held key's softmax probabilities, summed over the group in order, added to
//               its score, and the block's lowest (score, position) heavy hitter; the last block
//               of (b, kvh) to finish (a counter it resets) then moves the window when len >
//               recent: key r0 leaves it and is appended to the compact buffer while there is
//               room, else the lowest of (score, position) among it and the heavy hitters is
//               evicted (its score -inf) and r0, when kept, takes the evicted row's place (K and
//               V copied from the cache); block kv head 0 publishes clen / rstart (from the
//               length).
// K / V caches [num_slots, kv_heads, capacity, hd] bf16 (h2o_logits_f8: e4m3; rb = a row's
// bytes); compact [num_slots, kv_heads, heavy, hd] of the caches' type;
// cpos [num_slots, kv_heads, heavy]; scores [num_slots, kv_heads, capacity]; clen / rstart
// [num_slots]; zs [batch, kv_heads, G, hcap] (hcap >= heavy + recent + 1); part [batch, kv_heads,
// S, G] (max, sum); mins [batch, kv_heads, S] (score, position, row); count [batch, kv_heads], zero
// between steps. grid (batch, kv_heads, S = ceil(hcap / 256)), block 256.

struct H2oGeom {
    u32 r0, c0, held;
};

__device__ __forceinline__ H2oGeom h2o_geom(u32 len, u32 heavy, u32 recent) {
    H2oGeom g;
    g.r0 = len > recent + 1 ? len - 1 - recent : 0;
    g.c0 = min(heavy, g.r0);
    g.held = len == 0 ? 0 : g.c0 + (len - g.r0);
    return g;
}

// Dynamic shared memory G * hd floats. F8: the caches and compact rows hold e4m3 bytes (the
// values themselves: their scales are folded into the weights).
template <bool F8>
__device__ __forceinline__ void h2o_logits_impl(const bf16* __restrict__ q, const void* __restrict__ kc,
                                                const void* __restrict__ ck, const u32* __restrict__ seq_lens,
                                                const u32* __restrict__ slots, float* __restrict__ zs,
                                                float2* __restrict__ part, u32 n_heads, u32 kv_heads, u32 capacity,
                                                u32 hd, u32 heavy, u32 recent, u32 hcap, float scale) {
    extern __shared__ float qs[];
    __shared__ float wred[8][H2O_MAXG];
    const u32 b = blockIdx.x, kvh = blockIdx.y, G = n_heads / kv_heads;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (G > H2O_MAXG) return;
    const u32 slot = slots[b], len = min(seq_lens[b], capacity);
    const H2oGeom gm = h2o_geom(len, heavy, recent);
    const u64 hrow = (u64)slot * kv_heads + kvh, eb = F8 ? 1 : 2;
    float* z = zs + ((u64)b * kv_heads + kvh) * G * hcap;
    for (u32 i = threadIdx.x; i < G * hd; i += blockDim.x)
        qs[i] = __bfloat162float(q[((u64)b * n_heads + kvh * G) * hd + i]);
    __syncthreads();
    const u32 i = blockIdx.z * H2O_KEYS + threadIdx.x;
    float acc[H2O_MAXG];
#pragma unroll
    for (u32 g = 0; g < H2O_MAXG; ++g) acc[g] = NEG_INF;
    if (i < gm.held) {
        const u64 row = i < gm.c0 ? hrow * heavy + i : hrow * capacity + gm.r0 + i - gm.c0;
        const unsigned char* k =
            reinterpret_cast<const unsigned char*>(i < gm.c0 ? ck : kc) + row * hd * eb;
#pragma unroll
        for (u32 g = 0; g < H2O_MAXG; ++g) acc[g] = 0.0f;
        for (u32 c = 0; c < hd; c += 8) {
            float kf[8];
            if constexpr (F8) {
                const uint2 raw = *reinterpret_cast<const uint2*>(k + c);
                const unsigned char* e = reinterpret_cast<const unsigned char*>(&raw);
#pragma unroll
                for (u32 t = 0; t < 8; ++t) kf[t] = fp82f(e[t]);
            } else {
                const uint4 raw = *reinterpret_cast<const uint4*>(k + 2 * c);
                const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
                for (u32 t = 0; t < 8; ++t) kf[t] = __bfloat162float(e[t]);
            }
#pragma unroll
            for (u32 g = 0; g < H2O_MAXG; ++g)
                if (g < G)
#pragma unroll
                    for (u32 t = 0; t < 8; ++t) acc[g] += kf[t] * qs[g * hd + c + t];
        }
#pragma unroll
        for (u32 g = 0; g < H2O_MAXG; ++g)
            if (g < G) {
                acc[g] *= scale;
                z[(u64)g * hcap + i] = acc[g];
            }
    }
    // the block's max per g, then its sum of exp(z - max)
#pragma unroll
    for (u32 g = 0; g < H2O_MAXG; ++g)
        if (g < G) {
            const float m = warp_max(acc[g]);
            if (lane == 0) wred[warp][g] = m;
        }
    __syncthreads();
    float bm[H2O_MAXG];
#pragma unroll
    for (u32 g = 0; g < H2O_MAXG; ++g) {
        bm[g] = NEG_INF;
        if (g < G)
            for (u32 w = 0; w < 8; ++w) bm[g] = fmaxf(bm[g], wred[w][g]);
    }
    __syncthreads();
#pragma unroll
    for (u32 g = 0; g < H2O_MAXG; ++g)
        if (g < G) {
            const float e = i < gm.held ? __expf(acc[g] - bm[g]) : 0.0f;
            const float t = warp_sum(e);
            if (lane == 0) wred[warp][g] = t;
        }
    __syncthreads();
    if (threadIdx.x < G) {
        float t = 0.0f;
        for (u32 w = 0; w < 8; ++w) t += wred[w][threadIdx.x];
        part[(((u64)b * kv_heads + kvh) * gridDim.z + blockIdx.z) * G + threadIdx.x] =
            make_float2(bm[threadIdx.x], t);
    }
}
#define H2O_LOGITS_ARGS                                                                                          \
    const bf16 *__restrict__ q, const void *__restrict__ kc, const void *__restrict__ ck,                        \
        const u32 *__restrict__ seq_lens, const u32 *__restrict__ slots, float *__restrict__ zs,                 \
        float2 *__restrict__ part, u32 n_heads, u32 kv_heads, u32 capacity, u32 hd, u32 heavy, u32 recent,      \
        u32 hcap, float scale
extern "C" __global__ void __launch_bounds__(256) h2o_logits(H2O_LOGITS_ARGS) {
    h2o_logits_impl<false>(q, kc, ck, seq_lens, slots, zs, part, n_heads, kv_heads, capacity, hd, heavy, recent,
                           hcap, scale);
}
extern "C" __global__ void __launch_bounds__(256) h2o_logits_f8(H2O_LOGITS_ARGS) {
    h2o_logits_impl<true>(q, kc, ck, seq_lens, slots, zs, part, n_heads, kv_heads, capacity, hd, heavy, recent,
                          hcap, scale);
}

// Ordering of heavy-hitter candidates: the lower score, then the lower position.
__device__ __forceinline__ bool h2o_lower(float v, u32 p, float bv, u32 bp) {
    return v < bv || (v == bv && p < bp);
}

extern "C" __global__ void __launch_bounds__(256)
    h2o_evict(const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
              unsigned char* __restrict__ ck, unsigned char* __restrict__ cv, u32* __restrict__ cpos, float* __restrict__ scores, u32* __restrict__ clen,
              u32* __restrict__ rstart, const u32* __restrict__ seq_lens, const u32* __restrict__ slots,
              const float* __restrict__ zs, const float2* __restrict__ part, float4* __restrict__ mins,
              u32* __restrict__ count, u32 n_heads, u32 kv_heads, u32 capacity, u32 rb, u32 heavy, u32 recent,
              u32 hcap) {
    __shared__ float gmx[H2O_MAXG], gsm[H2O_MAXG];
    __shared__ float rs[8];
    __shared__ u32 rp[8], ri[8];
    __shared__ int sh_row;
    __shared__ bool sh_last;
    const u32 b = blockIdx.x, kvh = blockIdx.y, G = n_heads / kv_heads, S = gridDim.z;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (G > H2O_MAXG) return;
    const u32 slot = slots[b], len = min(seq_lens[b], capacity);
    const H2oGeom gm = h2o_geom(len, heavy, recent);
    const u64 hrow = (u64)slot * kv_heads + kvh, bk = (u64)b * kv_heads + kvh;
    u32* cp = cpos + hrow * heavy;
    float* sc = scores + hrow * capacity;
    const float* z = zs + bk * G * hcap;
    if (threadIdx.x < G) {
        const float2* pp = part + bk * S * G + threadIdx.x;
        float m = NEG_INF, t = 0.0f;
        for (u32 s = 0; s < S; ++s) m = fmaxf(m, pp[(u64)s * G].x);
        for (u32 s = 0; s < S; ++s) {
            const float2 v = pp[(u64)s * G];
            if (v.x != NEG_INF) t += v.y * __expf(v.x - m);
        }
        gmx[threadIdx.x] = m;
        gsm[threadIdx.x] = t;
    }
    __syncthreads();
    const u32 i = blockIdx.z * H2O_KEYS + threadIdx.x;
    float bs = __int_as_float(0x7f800000);
    u32 bp = 0xffffffffu, bi = 0;
    if (i < gm.held) {
        float p = 0.0f;
        for (u32 g = 0; g < G; ++g) p += __expf(z[(u64)g * hcap + i] - gmx[g]) / gsm[g];
        const u32 pos = i < gm.c0 ? min(cp[i], capacity - 1) : gm.r0 + i - gm.c0;
        const float v = sc[pos] + p;
        sc[pos] = v;
        if (i < gm.c0) {
            bs = v;
            bp = pos;
            bi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bs, o);
        const u32 p = __shfl_xor_sync(0xffffffffu, bp, o), j = __shfl_xor_sync(0xffffffffu, bi, o);
        if (h2o_lower(v, p, bs, bp)) {
            bs = v;
            bp = p;
            bi = j;
        }
    }
    if (lane == 0) {
        rs[warp] = bs;
        rp[warp] = bp;
        ri[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < 8; ++w)
            if (h2o_lower(rs[w], rp[w], bs, bp)) {
                bs = rs[w];
                bp = rp[w];
                bi = ri[w];
            }
        mins[bk * S + blockIdx.z] = make_float4(bs, __uint_as_float(bp), __uint_as_float(bi), 0.0f);
        __threadfence();
        const u32 prev = atomicAdd(count + bk, 1u);
        sh_last = prev + 1 == S;
        sh_row = -1;
        if (sh_last) {
            count[bk] = 0; // for the next step
            const u32 r1 = len > recent ? len - recent : 0;
            if (len > 0 && r1 > gm.r0) {
                // key r0 leaves the window
                const u32 r0 = gm.r0;
                if (gm.c0 < heavy) {
                    sh_row = (int)gm.c0;
                } else if (heavy == 0) {
                    sc[r0] = NEG_INF;
                } else {
                    float fs = __int_as_float(0x7f800000);
                    u32 fp = 0xffffffffu, fi = 0;
                    for (u32 s = 0; s < S; ++s) {
                        const float4 m = __ldcg(mins + bk * S + s);
                        const u32 p = __float_as_uint(m.y);
                        if (h2o_lower(m.x, p, fs, fp)) {
                            fs = m.x;
                            fp = p;
                            fi = __float_as_uint(m.z);
                        }
                    }
                    if (__ldcg(sc + r0) < fs) {
                        sc[r0] = NEG_INF; // the leaving key is the lowest: evicted
                    } else {
                        sc[fp] = NEG_INF;
                        sh_row = (int)fi;
                    }
                }
            }
            if (kvh == 0) {
                clen[slot] = min(heavy, r1);
                rstart[slot] = r1;
            }
        }
    }
    __syncthreads();
    const int row = sh_row;
    if (!sh_last || row < 0) return;
    const u32 r0 = gm.r0;
    // a copy of the row's rb bytes (bf16 or e4m3), a word a thread
    const u32* ks = reinterpret_cast<const u32*>(kc + (hrow * capacity + r0) * rb);
    const u32* vs = reinterpret_cast<const u32*>(vc + (hrow * capacity + r0) * rb);
    u32* kd = reinterpret_cast<u32*>(ck + (hrow * heavy + row) * rb);
    u32* vd = reinterpret_cast<u32*>(cv + (hrow * heavy + row) * rb);
    for (u32 d = threadIdx.x; d < rb / 4; d += blockDim.x) {
        kd[d] = ks[d];
        vd[d] = vs[d];
    }
    if (threadIdx.x == 0) cp[row] = r0;
}
