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
//   h2o_decode   a decode step, after sparse flash-decoding: the step's probabilities over the
//                held keys added to their scores, then the key leaving the window either evicted
//                or swapped into the compact buffer for the lowest-scored heavy hitter

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
#define H2O_MAXD 8 // head dims a lane holds: 256 / 32

// The dot product of key row k (bf16, hd = 32 * nd) with query g of qs (f32 [G, hd] in shared
// memory) over the warp; every lane gets the sum.
__device__ __forceinline__ float h2o_dot(const float* kr, const float* qs, u32 g, u32 hd, u32 nd, u32 lane) {
    float p = 0.0f;
    for (u32 t = 0; t < nd; ++t) p += kr[t] * qs[g * hd + lane + 32 * t];
    for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
    return p;
}

// One decode step of H2O on one global layer, for batch row b (slot slots[b], length seq_lens[b]
// with this step's token) and kv head blockIdx.y, after the sparse kernel read the held keys: the
// compact rows [0, c0) (positions cpos) and the window [r0, len), where r0 = max(0, len - 1 -
// recent) and c0 = min(heavy, r0). Their softmax probabilities for each query head of the group
// (q [batch, n_heads, hd] after RoPE; logits scale * q.k) are summed over the group and added to
// their scores. Then, when the window moves (len > recent), key r0 leaves it: with room in the
// compact buffer it is appended; otherwise the lowest of (score, position) among it and the heavy
// hitters is evicted (its score -inf) and r0, when kept, takes the evicted row's place (K and V
// copied from the cache). Block kv head 0 publishes clen / rstart (both from the length).
// K / V caches [num_slots, kv_heads, capacity, hd] bf16; compact [num_slots, kv_heads, heavy, hd];
// cpos [num_slots, kv_heads, heavy]; scores [num_slots, kv_heads, capacity]; clen / rstart
// [num_slots]. grid (batch, kv_heads), block 256, dynamic shared memory G * hd floats.
extern "C" __global__ void __launch_bounds__(256)
    h2o_decode(const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
               bf16* __restrict__ ck, bf16* __restrict__ cv, u32* __restrict__ cpos, float* __restrict__ scores,
               u32* __restrict__ clen, u32* __restrict__ rstart, const u32* __restrict__ seq_lens,
               const u32* __restrict__ slots, u32 n_heads, u32 kv_heads, u32 capacity, u32 hd, u32 heavy,
               u32 recent, float scale) {
    extern __shared__ float qs[];
    __shared__ float wm[8][H2O_MAXG], wsum[8][H2O_MAXG], gm[H2O_MAXG], gs[H2O_MAXG];
    __shared__ float rs[8];
    __shared__ u32 rp[8], ri[8];
    __shared__ int sh_row;
    const u32 b = blockIdx.x, kvh = blockIdx.y, G = n_heads / kv_heads;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, nd = hd / 32;
    const u32 slot = slots[b], len = min(seq_lens[b], capacity);
    if (len == 0 || G > H2O_MAXG) return;
    const u32 r0 = len - 1 > recent ? len - 1 - recent : 0, c0 = min(heavy, r0);
    const u32 held = c0 + (len - r0);
    const u64 hrow = (u64)slot * kv_heads + kvh;
    const bf16* kb = kc + hrow * capacity * hd;
    bf16* ckb = ck + hrow * heavy * hd;
    bf16* cvb = cv + hrow * heavy * hd;
    u32* cp = cpos + hrow * heavy;
    float* sc = scores + hrow * capacity;
    for (u32 i = threadIdx.x; i < G * hd; i += blockDim.x)
        qs[i] = __bfloat162float(q[((u64)b * n_heads + kvh * G) * hd + i]);
    __syncthreads();
    // Pass 1: per query head, the max and the sum of exp(z - max) over the held keys (a warp a key).
    float m[H2O_MAXG], s[H2O_MAXG];
    for (u32 g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        s[g] = 0.0f;
    }
    float kr[H2O_MAXD];
    for (u32 i = warp; i < held; i += nw) {
        const bf16* k = i < c0 ? ckb + (u64)i * hd : kb + (u64)(r0 + i - c0) * hd;
        for (u32 t = 0; t < nd; ++t) kr[t] = __bfloat162float(k[lane + 32 * t]);
        for (u32 g = 0; g < G; ++g) {
            const float z = h2o_dot(kr, qs, g, hd, nd, lane) * scale;
            if (z > m[g]) {
                s[g] = s[g] * __expf(m[g] - z) + 1.0f;
                m[g] = z;
            } else {
                s[g] += __expf(z - m[g]);
            }
        }
    }
    if (lane == 0)
        for (u32 g = 0; g < G; ++g) {
            wm[warp][g] = m[g];
            wsum[warp][g] = s[g];
        }
    __syncthreads();
    if (threadIdx.x < G) {
        const u32 g = threadIdx.x;
        float M = NEG_INF, S = 0.0f;
        for (u32 w = 0; w < nw; ++w) M = fmaxf(M, wm[w][g]);
        for (u32 w = 0; w < nw; ++w)
            if (wm[w][g] != NEG_INF) S += wsum[w][g] * __expf(wm[w][g] - M);
        gm[threadIdx.x] = M;
        gs[threadIdx.x] = S;
    }
    __syncthreads();
    // Pass 2: each held key's probabilities, summed over the group, added to its score.
    for (u32 i = warp; i < held; i += nw) {
        const bool compact = i < c0;
        const u32 pos = compact ? min(cp[i], capacity - 1) : r0 + i - c0;
        const bf16* k = compact ? ckb + (u64)i * hd : kb + (u64)pos * hd;
        for (u32 t = 0; t < nd; ++t) kr[t] = __bfloat162float(k[lane + 32 * t]);
        float p = 0.0f;
        for (u32 g = 0; g < G; ++g) p += __expf(h2o_dot(kr, qs, g, hd, nd, lane) * scale - gm[g]) / gs[g];
        if (lane == 0) sc[pos] += p;
    }
    __syncthreads();
    const u32 r1 = len > recent ? len - recent : 0;
    if (r1 > r0) {
        // key r0 leaves the window
        if (threadIdx.x == 0) sh_row = c0 < heavy ? (int)c0 : -1;
        if (c0 == heavy && heavy > 0) {
            // the lowest (score, position) among the heavy hitters
            float bs = __int_as_float(0x7f800000);
            u32 bp = 0xffffffffu, bi = 0;
            for (u32 i = threadIdx.x; i < heavy; i += blockDim.x) {
                const u32 p = min(cp[i], capacity - 1);
                const float v = sc[p];
                if (v < bs || (v == bs && p < bp)) {
                    bs = v;
                    bp = p;
                    bi = i;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float v = __shfl_xor_sync(0xffffffffu, bs, o);
                const u32 p = __shfl_xor_sync(0xffffffffu, bp, o), i = __shfl_xor_sync(0xffffffffu, bi, o);
                if (v < bs || (v == bs && p < bp)) {
                    bs = v;
                    bp = p;
                    bi = i;
                }
            }
            if (lane == 0) {
                rs[warp] = bs;
                rp[warp] = bp;
                ri[warp] = bi;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                float fs = rs[0];
                u32 fp = rp[0], fi = ri[0];
                for (u32 w = 1; w < nw; ++w)
                    if (rs[w] < fs || (rs[w] == fs && rp[w] < fp)) {
                        fs = rs[w];
                        fp = rp[w];
                        fi = ri[w];
                    }
                if (sc[r0] < fs) {
                    sc[r0] = NEG_INF; // the leaving key is the lowest: evicted
                } else {
                    sc[fp] = NEG_INF;
                    sh_row = (int)fi;
                }
            }
        } else if (c0 == heavy && threadIdx.x == 0) {
            sc[r0] = NEG_INF; // no heavy hitters kept at all
        }
        __syncthreads();
        const int row = sh_row;
        if (row >= 0) {
            const bf16* ks = kb + (u64)r0 * hd;
            const bf16* vs = vc + hrow * capacity * hd + (u64)r0 * hd;
            for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
                ckb[(u64)row * hd + d] = ks[d];
                cvb[(u64)row * hd + d] = vs[d];
            }
            if (threadIdx.x == 0) cp[row] = r0;
        }
    }
    if (kvh == 0 && threadIdx.x == 0) {
        clen[slot] = min(heavy, r1);
        rstart[slot] = r1;
    }
}
