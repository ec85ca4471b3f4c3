// sfi.cu: the SFI Selector on the GPU (methods.md §1.4; the CPU fast path is
// crates/kv/src/sfi/selector.rs, the f64 reference selector_ref.rs) and the compact-memory
// gather. One refresh of one (layer, sequence) runs:
//   sfi_key_norms     L2 norms of newly cached keys (kept per layer, extended incrementally)
//   sfi_rowstats      per captured row: max and sum^-alpha (or the LSE) over the domain
//   sfi_evidence      per (kv head, token): the power-mean accumulator over the rows
//   sfi_score         per kv head: evidence f, prior r, lambda, fused log-score, soft-NMS (f64)
//   sfi_cross_head    cross-head exclusivity (more than two kv heads)
//   sfi_topk          equalised count, exact top-m per kv head (radix select), sorted positions
//   sfi_gather        sinks + chosen keys/values into the compact buffer; publishes its length
// Logits come from attn_sparse_decode_* (scaled scores in log2 units, row-major with row
// stride `lstride`); the domain is keys [lo, hi) = [sinks, recent_start), n = hi - lo.
// Every kernel handles several layers of one sequence at once: blockIdx.z (sfi_score, sfi_topk:
// blockIdx.y) is the layer, and each per-layer array advances by its layer stride.

#define D_INF __longlong_as_double(0x7ff0000000000000ll)
#define TOPK_BINS 4096
#define TOPK_CAP 2048
#define D_NAN __longlong_as_double(0x7ff8000000000000ll)

// Warp and block reductions (every thread gets the result; block scratch >= 32 values).
template <typename T>
__device__ __forceinline__ T warp_sum_t(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_max_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block sums: double, and u32 counts.
template <typename T>
__device__ __forceinline__ T block_sum_t(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum_t(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum_t(lane < nw ? scratch[lane] : T(0));
}
__device__ __forceinline__ double block_sum_d(double v, double* scratch) { return block_sum_t(v, scratch); }
__device__ __forceinline__ u32 block_sum_u(u32 v, u32* scratch) { return block_sum_t(v, scratch); }
// Double-precision block max.
__device__ __forceinline__ double block_max_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max_d(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max_d(lane < nw ? scratch[lane] : -D_INF);
}

// norms[kvh, p] = |k[slot, kvh, p, :hd]| for p in [p0, p1). kptrs[layer]: that layer's cache
// [num_slots, kv_heads, capacity, D]; norms: this slot's [kv_heads, capacity] (layer stride ns).
// grid (ceil((p1 - p0) / 8), kv_heads, layers), block 256 (a warp per position).
template <bool F8>
__device__ __forceinline__ void sfi_key_norms_impl(const u64* __restrict__ kptrs, float* __restrict__ norms, u32 ns,
                                                   u32 slot, u32 kv_heads, u32 capacity, u32 D, u32 p0, u32 p1) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 p = p0 + blockIdx.x * 8 + warp, h = blockIdx.y;
    if (p >= p1) return;
    norms += (u64)blockIdx.z * ns;
    const u64 row = (((u64)slot * kv_heads + h) * capacity + p) * D;
    float s = 0.0f;
    for (u32 c = lane; c < D; c += 32) {
        float x;
        if constexpr (F8)
            x = fp82f(reinterpret_cast<const unsigned char*>(kptrs[blockIdx.z])[row + c]);
        else
            x = bf2f(reinterpret_cast<const bf16*>(kptrs[blockIdx.z])[row + c]);
        s += x * x;
    }
    s = warp_sum(s);
    if (lane == 0) norms[(u64)h * capacity + p] = sqrtf(s);
}
extern "C" __global__ void sfi_key_norms(const u64* __restrict__ kptrs, float* __restrict__ norms, u32 ns, u32 slot,
                                         u32 kv_heads, u32 capacity, u32 D, u32 p0, u32 p1) {
    sfi_key_norms_impl<false>(kptrs, norms, ns, slot, kv_heads, capacity, D, p0, p1);
}
// The same over e4m3 caches.
extern "C" __global__ void sfi_key_norms_f8(const u64* __restrict__ kptrs, float* __restrict__ norms, u32 ns, u32 slot,
                                            u32 kv_heads, u32 capacity, u32 D, u32 p0, u32 p1) {
    sfi_key_norms_impl<true>(kptrs, norms, ns, slot, kv_heads, capacity, D, p0, p1);
}

// Row (kvh, rr), rr = r * G + gi, of the captured logits: capture row r, query head kvh*G + gi.
__device__ __forceinline__ const float* sfi_row(const float* logits, u32 kvh, u32 rr, u32 G, u32 n_heads,
                                               u32 lstride) {
    const u32 r = rr / G, gi = rr % G;
    return logits + ((u64)r * n_heads + kvh * G + gi) * lstride;
}

// stats[kvh, rr] = (m, c): m = max over the domain (log2 units), c = (sum 2^(z - m))^-alpha, or
// for the geometric mean (geo != 0) c = the row's natural LSE over the domain. A row that sees no
// key of the domain gets m = -inf. grid (rows, kv_heads), block 256.
extern "C" __global__ void sfi_rowstats(const float* __restrict__ logits, float2* __restrict__ stats, u32 n_heads,
                                        u32 G, u32 lstride, u32 lo, u32 hi, float alpha, u32 geo, u32 ls) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    const u32 rr = blockIdx.x, kvh = blockIdx.y, rows = gridDim.x;
    logits += (u64)blockIdx.z * ls;
    stats += (u64)blockIdx.z * gridDim.y * rows;
    const float* z = sfi_row(logits, kvh, rr, G, n_heads, lstride);
    // One pass: each thread's sum relative to its running max, rescaled when the max rises,
    // then to the row's max.
    float mt = NEG_INF;
    double st = 0.0;
    #pragma unroll 4
    for (u32 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float v = z[j];
        if (v > mt) {
            st *= (double)exp2f(mt - v);
            mt = v;
        }
        if (v != NEG_INF) st += (double)exp2f(v - mt);
    }
    const float m = block_max(mt, scratch);
    double s = mt == NEG_INF ? 0.0 : st * (double)exp2f(mt - m);
    s = block_sum_d(s, dscratch);
    if (threadIdx.x == 0) {
        float c = 0.0f;
        if (m != NEG_INF) c = geo ? (float)((double)m * (double)LN2_F + log(s)) : (float)pow(s, -(double)alpha);
        stats[(u64)kvh * rows + rr] = make_float2(m, c);
    }
}

// ev[kvh, i] for token j = lo + i: sum over valid rows of c * 2^(alpha (z - m)) (power mean), or of
// the natural log-probability z ln2 - lse (geometric); NaN where no row sees the token (hidden).
// grid (ceil(n / 256), kv_heads), block 256.
extern "C" __global__ void sfi_evidence(const float* __restrict__ logits, const float2* __restrict__ stats,
                                        double* __restrict__ ev, u32 n_heads, u32 G, u32 rows, u32 lstride,
                                        u32 lo, u32 hi, float alpha, u32 geo, u32 ls) {
    const u32 kvh = blockIdx.y, n = hi - lo;
    logits += (u64)blockIdx.z * ls;
    stats += (u64)blockIdx.z * gridDim.y * rows;
    ev += (u64)blockIdx.z * gridDim.y * n;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32 j = lo + i;
    float acc = 0.0f;
    double accg = 0.0;
    bool seen = false;
    for (u32 rr = 0; rr < rows; ++rr) {
        const float2 st = stats[(u64)kvh * rows + rr];
        if (st.x == NEG_INF) continue;
        const float z = sfi_row(logits, kvh, rr, G, n_heads, lstride)[j];
        if (z == NEG_INF) {
            if (geo) accg = -D_INF;  // log p = -inf for a row that cannot see it
            continue;
        }
        seen = true;
        if (geo)
            accg += (double)z * (double)LN2_F - (double)st.y;
        else
            acc += st.y * exp2f(alpha * (z - st.x));
    }
    ev[(u64)kvh * n + i] = !seen ? D_NAN : geo ? accg : (double)acc;
}

// Selector knobs, uploaded once as doubles (SFI_CFG_* index them; see ops/sfi.rs).
#define SFI_CFG_LEN 16
struct SelCfg {
    double alpha, gamma, w_l2, w_pos, pos_power, pos_eta, beta, soft_alpha, lclip_single, lclip_multi, eps;
    u32 half, lambda_soft;
    double cross_a, cross_inv_t;
};
__device__ __forceinline__ SelCfg sfi_cfg(const double* c) {
    SelCfg r;
    r.alpha = c[0];
    r.gamma = c[1];
    r.w_l2 = c[2];
    r.w_pos = c[3];
    r.pos_power = c[4];
    r.pos_eta = c[5];
    r.beta = c[6];
    r.soft_alpha = c[7];
    r.lclip_single = c[8];
    r.lclip_multi = c[9];
    r.eps = c[10];
    r.half = (u32)c[11];
    r.lambda_soft = c[12] != 0.0;
    r.cross_a = c[13];
    r.cross_inv_t = c[14];
    return r;
}

// The number of captured rows of a head that see the domain (stats.x != -inf).
__device__ __forceinline__ u32 sfi_valid_rows(const float2* stats, u32 rows) {
    u32 valid = 0;
    for (u32 rr = 0; rr < rows; ++rr) valid += stats[rr].x != NEG_INF;
    return valid;
}

// The position part of the log prior of domain position i of n.
// The position prior of a key at position pj in a domain whose first and last keys are at
// positions first and last (the CPU's log_pos_prior); sfi_pos: the domain's own indices.
__device__ __forceinline__ double sfi_pos_at(const SelCfg& cfg, u32 pj, u32 first, u32 last) {
    const double span = last > first ? (double)(last - first) : 1.0;
    const double p = fmax(cfg.pos_power, 1.0);
    const double u = fmin(fmax((double)(pj - first) / span, 0.0), 1.0);
    const double tail = fmax((double)(last - pj) / span, cfg.eps);
    return -cfg.beta * exp(p * log(u)) + cfg.pos_eta * log(tail);
}
__device__ __forceinline__ double sfi_pos(const SelCfg& cfg, u32 i, u32 n) {
    return sfi_pos_at(cfg, i, 0, n > 0 ? n - 1 : 0);
}

// Domain position i (evidence a, key norm kn, position prior pos = sfi_pos): the evidence term
// fv (sq: the linear a^2 of the alpha = 0.5 path; geo: the mean log-probability; else
// log(a) / alpha) and the log prior rv (key norm and position); hidden tokens (a is NaN):
// fv = 0 (sq) or -inf, rv = -inf.
__device__ __forceinline__ void sfi_fr(const SelCfg& cfg, double a, float kn, double pos, bool sq, u32 geo,
                                       u32 valid, double& fv, double& rv) {
    const bool hid = (a != a);
    if (sq)
        fv = hid ? 0.0 : a * a;  // the CPU's alpha = 0.5 path: linear, no max shift
    else if (geo)
        fv = hid ? -D_INF : a / (double)valid;
    else
        fv = hid ? -D_INF : log(a) / cfg.alpha;
    rv = hid ? -D_INF : -cfg.gamma * cfg.w_l2 * log(fmax((double)kn, cfg.eps)) + cfg.w_pos * pos;
}

// lambda from the normalised f / r moments (clipped, optionally softened).
__device__ __forceinline__ double sfi_lambda(const SelCfg& cfg, double ff, double rr2, double fr, u32 valid) {
    const double star = (ff - fr) / fmax(ff - 2.0 * fr + rr2, cfg.eps);
    const double lmax = valid <= 1 ? cfg.lclip_single : cfg.lclip_multi;
    double lam = fmin(fmax(star, 0.0), lmax);
    if (cfg.lambda_soft && lmax > 0.0) lam = lmax * tanh(lam / lmax);
    return fmin(lam, 1.0 - cfg.eps);
}

// Cross-head exclusivity of one position: s[h * stride], h < kv_heads, in place.
__device__ __forceinline__ void sfi_cross_one(double* s, u64 stride, u32 kv_heads, const SelCfg& cfg) {
    const double a = cfg.cross_a, inv_t = cfg.cross_inv_t, leps = log(cfg.eps);
    double mx = -D_INF;
    for (u32 h = 0; h < kv_heads; ++h) mx = fmax(mx, s[h * stride] * inv_t);
    if (mx == -D_INF) mx = 0.0;
    double sum = 0.0;
    for (u32 h = 0; h < kv_heads; ++h) sum += exp(s[h * stride] * inv_t - mx);
    const double lse = log(sum) + mx;
    for (u32 h = 0; h < kv_heads; ++h) {
        const double v = s[h * stride];
        if (v != -D_INF) s[h * stride] = v + a * fmax(v * inv_t - lse, leps);
    }
}

// Per kv head (one block): f from the evidence, r from the key norms and the position prior,
// lambda, log s = log((1 - lambda) f + (lambda + eps) r) normalised, soft-NMS with the pooled max
// over [i - half, i + half]. a, b: scratch [kv_heads, n]; out: scores [kv_heads, n]; cnt[kvh] =
// the number of finite scores. grid (kv_heads, layers), block 1024.
extern "C" __global__ void __launch_bounds__(1024)
    sfi_score(const double* __restrict__ ev, const float2* __restrict__ stats, const float* __restrict__ norms,
              double* __restrict__ fa, double* __restrict__ fb, double* __restrict__ out, u32* __restrict__ cnt,
              u32 rows, u32 capacity, u32 lo, u32 hi, const double* __restrict__ cfgp, u32 geo, u32 ns) {
    __shared__ double ds[32];
    const SelCfg cfg = sfi_cfg(cfgp);
    const u32 h = blockIdx.x, n = hi - lo, T = blockDim.x;
    {
        const u64 z = blockIdx.y, kvs = (u64)gridDim.x * n;
        ev += z * kvs;
        fa += z * kvs;
        fb += z * kvs;
        out += z * kvs;
        stats += z * gridDim.x * rows;
        norms += z * ns;
        cnt += z * gridDim.x;
    }
    const double* e = ev + (u64)h * n;
    double* f = fa + (u64)h * n;
    double* r = fb + (u64)h * n;
    double* s = out + (u64)h * n;
    const float* kn = norms + (u64)h * capacity + lo;
    const u32 valid = sfi_valid_rows(stats + (u64)h * rows, rows);
    if (valid == 0) {
        #pragma unroll 4
        for (u32 i = threadIdx.x; i < n; i += T) s[i] = -D_INF;
        if (threadIdx.x == 0) cnt[h] = 0;
        return;
    }
    const bool sq = !geo && cfg.alpha == 0.5;
    double fmx = -D_INF, rmx = -D_INF;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        double fv, rv;
        sfi_fr(cfg, e[i], kn[i], sfi_pos(cfg, i, n), sq, geo, valid, fv, rv);
        f[i] = fv;
        fmx = fmax(fmx, fv);
        r[i] = rv;
        rmx = fmax(rmx, rv);
    }
    if (!sq) fmx = block_max_d(fmx, ds);
    rmx = block_max_d(rmx, ds);
    double zf = 0.0, zr = 0.0;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        double fv = f[i];
        if (!sq) fv = fmx == -D_INF ? 0.0 : exp(fv - fmx);
        const double rv = rmx == -D_INF ? 0.0 : exp(r[i] - rmx);
        f[i] = fv;
        r[i] = rv;
        zf += fv;
        zr += rv;
    }
    zf = block_sum_d(zf, ds);
    zr = block_sum_d(zr, ds);
    const double inv_f = zf > 0.0 ? 1.0 / zf : 0.0, inv_r = 1.0 / zr;
    double ff = 0.0, rr2 = 0.0, fr = 0.0;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        const double fv = f[i] * inv_f, rv = r[i] * inv_r;
        f[i] = fv;
        r[i] = rv;
        ff += fv * fv;
        rr2 += rv * rv;
        fr += fv * rv;
    }
    ff = block_sum_d(ff, ds);
    rr2 = block_sum_d(rr2, ds);
    fr = block_sum_d(fr, ds);
    const double lam = sfi_lambda(cfg, ff, rr2, fr, valid);
    const double wf = 1.0 - lam, wr = lam + cfg.eps;
    double zs = 0.0;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        const double v = wf * f[i] + wr * r[i];
        f[i] = v;
        zs += v;
    }
    zs = block_sum_d(zs, ds);
    const double inv_s = 1.0 / zs;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) s[i] = (e[i] != e[i]) ? -D_INF : log(f[i] * inv_s);
    __syncthreads();
    u32 c = 0;
    const bool nms = cfg.half > 0 && cfg.soft_alpha != 0.0;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        double v = s[i];
        if (nms && v != -D_INF) {
            const u32 a = i > cfg.half ? i - cfg.half : 0, b = min(i + cfg.half, n - 1);
            double pooled = -D_INF;
            for (u32 t = a; t <= b; ++t) pooled = fmax(pooled, s[t]);
            v = v - cfg.soft_alpha * fmax(pooled - v, 0.0);
        }
        r[i] = v;  // the pooled pass reads s, so the result goes to r first
        c += v != -D_INF;
    }
    __syncthreads();
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) s[i] = r[i];
    __shared__ u32 cs[32];
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0) cs[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 t = 0;
        for (u32 w = 0; w < (T + 31) / 32; ++w) t += cs[w];
        cnt[h] = t;
    }
}

// Cross-head exclusivity in place on scores [kv_heads, n]:
// s_h += a * max(s_h / T - LSE_h'(s_h' / T), ln eps). grid (ceil(n / 256), 1, layers), block 256.
extern "C" __global__ void sfi_cross_head(double* __restrict__ scores, u32 kv_heads, u32 n,
                                          const double* __restrict__ cfgp) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    scores += (u64)blockIdx.z * kv_heads * n;
    const SelCfg cfg = sfi_cfg(cfgp);
    sfi_cross_one(scores + i, n, kv_heads, cfg);
}

// Order-preserving u64 of a double (greater score, greater key); -inf maps to 0 (never chosen).
__device__ __forceinline__ u64 sfi_key(double v) {
    if (v == -D_INF) return 0;
    const u64 b = (u64)__double_as_longlong(v);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

// The equalised count: min over the layer's heads of min(k, finite scores of the head).
__device__ __forceinline__ u32 sfi_equal_count(const u32* cnt, u32 kv_heads, u32 k) {
    u32 m = k;
    for (u32 t = 0; t < kv_heads; ++t) m = min(m, cnt[t]);
    return m;
}

// The top-k histogram bin of finite score v over [mn, mn + TOPK_BINS / scale].
__device__ __forceinline__ int sfi_bin(double v, double mn, double scale) {
    return min(TOPK_BINS - 1, (int)((v - mn) * scale));
}

// Of the c candidate keys in shared memory, the r-th largest (1 <= r <= c): its key into *key
// and into *rem how many of the keys equal to it are taken (r - the keys above it). Every
// thread of the block takes part; synchronise before reading the results.
__device__ __forceinline__ void sfi_rank_cand(const u64* cand, u32 c, u32 r, u64* key, u32* rem) {
    for (u32 t = threadIdx.x; t < c; t += blockDim.x) {
        const u64 kt = cand[t];
        u32 g = 0, e = 0;
        for (u32 j = 0; j < c; ++j) {
            g += cand[j] > kt;
            e += cand[j] == kt;
        }
        if (g < r && r <= g + e) {
            *key = kt;
            *rem = r - g;
        }
    }
}

// Radix select over one head's n scores by one block: the m-th largest key (8 bits at a time
// from the top) into `prefix`, and in `rem` how many of the keys equal to it are taken.
__device__ __noinline__ void sfi_radix_select(const double* __restrict__ s, u32 n, u32 m, u64& prefix, u32& rem) {
    __shared__ u32 hist[256];
    __shared__ u32 sh_digit, sh_rem;
    const u32 T = blockDim.x;
    u64 mask = 0;
    prefix = 0;
    rem = m;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < 256; b += T) hist[b] = 0;
        __syncthreads();
        for (u32 i = threadIdx.x; i < n; i += T) {
            const u64 key = sfi_key(s[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 acc = 0;
            int d = 255;
            for (; d > 0; --d) {
                if (acc + hist[d] >= rem) break;
                acc += hist[d];
            }
            sh_digit = (u32)d;
            sh_rem = rem - acc;
        }
        __syncthreads();
        prefix |= (u64)sh_digit << shift;
        mask |= (u64)255 << shift;
        rem = sh_rem;
        __syncthreads();
    }
}

// The block's top-m write, once the m-th largest key `prefix` is known: every key above it and
// the first `rem` equal to it (lowest indices first), as ascending `lo + i` into out[:m].
// key_at(i) is key i < n (the same in every call); one pass over the keys in tiles of the block
// (every thread calls it).
template <typename K, typename F>
__device__ __forceinline__ void topk_write_ascending(F key_at, u32 n, K prefix, u32 rem, u32 m, u32 lo, u32* out) {
    __shared__ u32 wsum[32];
    __shared__ u32 sh_base;
    const u32 T = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) sh_base = 0;
    u32 eq_seen = 0;  // equal keys before this tile (uniform across the block)
    __syncthreads();
    for (u32 t0 = 0; t0 < n; t0 += T) {
        const u32 i = t0 + threadIdx.x;
        const K key = i < n ? key_at(i) : K(0);
        const bool gt = i < n && key > prefix, eq = i < n && key == prefix;
        // Inclusive scans of eq (to rank equal keys) and then of the chosen flag.
        const u32 be = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) wsum[warp] = __popc(be);
        __syncthreads();
        u32 eq_before = eq_seen, eq_tile = 0;
        for (u32 w = 0; w < T / 32; ++w) {
            if (w < warp) eq_before += wsum[w];
            eq_tile += wsum[w];
        }
        eq_before += __popc(be & ((1u << lane) - 1));
        const bool take = gt || (eq && eq_before < rem);
        __syncthreads();
        const u32 bt = __ballot_sync(0xffffffffu, take);
        if (lane == 0) wsum[warp] = __popc(bt);
        __syncthreads();
        u32 before = sh_base, tile = 0;
        for (u32 w = 0; w < T / 32; ++w) {
            if (w < warp) before += wsum[w];
            tile += wsum[w];
        }
        before += __popc(bt & ((1u << lane) - 1));
        if (take && before < m) out[before] = lo + i;
        eq_seen += eq_tile;
        __syncthreads();
        if (threadIdx.x == 0) sh_base += tile;
        __syncthreads();
    }
}

// Per kv head (one block): m = min over heads of min(k, cnt[h]) (the equalised count); the m
// highest scores (ties: lower position first) as ascending positions lo + i into sel[h, :m];
// mcount[0] = m. grid (kv_heads, layers), block 1024.
extern "C" __global__ void __launch_bounds__(1024)
    sfi_topk(const double* __restrict__ scores, const u32* __restrict__ cnt, u32* __restrict__ sel,
             u32* __restrict__ mcount, u32 kv_heads, u32 n, u32 k, u32 lo) {
    __shared__ u32 sh_rem;
    const u32 h = blockIdx.x, T = blockDim.x;
    {
        const u64 z = blockIdx.y;
        scores += z * kv_heads * n;
        cnt += z * kv_heads;
        sel += z * kv_heads * k;
        mcount += z;
    }
    const u32 m = sfi_equal_count(cnt, kv_heads, k);
    if (h == 0 && threadIdx.x == 0) mcount[0] = m;
    if (m == 0) return;
        const double* s = scores + (u64)h * n;
    u64 prefix = 0;
    u32 rem = m;
    // Bucket pass: 4096 equal-width bins over the finite scores locate the bin holding the
    // m-th largest; when that bin has at most TOPK_CAP members they are ranked in shared memory,
    // which gives the exact threshold (key and how many of its ties to take) in four passes
    // over the scores instead of nine. Otherwise the radix select below finds it.
    __shared__ u32 bins[TOPK_BINS];
    __shared__ u64 cand[TOPK_CAP];
    __shared__ u32 sh_bstar, sh_above, sh_cnum, sh_ok;
    __shared__ u64 sh_key;
    __shared__ double dred[32];
    double mn = D_INF, mx = -D_INF;
#pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        const double v = s[i];
        if (v != -D_INF) {
            mn = fmin(mn, v);
            mx = fmax(mx, v);
        }
    }
    mn = -block_max_d(-mn, dred);
    mx = block_max_d(mx, dred);
    bool bucketed = false;
    if (mx > mn) {
        const double scale = (double)TOPK_BINS / (mx - mn);
        for (u32 b = threadIdx.x; b < TOPK_BINS; b += T) bins[b] = 0;
        if (threadIdx.x == 0) sh_cnum = 0;
        __syncthreads();
#pragma unroll 4
        for (u32 i = threadIdx.x; i < n; i += T) {
            const double v = s[i];
            if (v != -D_INF) atomicAdd(&bins[sfi_bin(v, mn, scale)], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 acc = 0;
            int b = TOPK_BINS - 1;
            for (; b > 0; --b) {
                if (acc + bins[b] >= m) break;
                acc += bins[b];
            }
            sh_bstar = (u32)b;
            sh_above = acc;
            sh_ok = bins[b] <= TOPK_CAP;
        }
        __syncthreads();
        if (sh_ok) {
            const int bstar = (int)sh_bstar;
            for (u32 i = threadIdx.x; i < n; i += T) {
                const double v = s[i];
                if (v != -D_INF && sfi_bin(v, mn, scale) == bstar) cand[atomicAdd(&sh_cnum, 1u)] = sfi_key(v);
            }
            __syncthreads();
            // The r-th largest candidate (r = m - keys in higher bins) is the threshold key; of
            // the keys equal to it, take r - (candidates above it), lowest positions first.
            sfi_rank_cand(cand, sh_cnum, m - sh_above, &sh_key, &sh_rem);
            __syncthreads();
            prefix = sh_key;
            rem = sh_rem;
            bucketed = true;
            __syncthreads();
        }
    }
    if (!bucketed) sfi_radix_select(s, n, m, prefix, rem);
    // prefix is the threshold key; take every key above it and the first `rem` equal to it.
    topk_write_ascending([&](u32 i) { return sfi_key(s[i]); }, n, prefix, rem, m, lo, sel + (u64)h * k);
}

// ---- The Selector split over many blocks (the default; the tests' set_split(false) runs sfi_score,
// sfi_cross_head and sfi_topk above, one block per (layer, kv head) walking its whole domain in
// six and four dependent passes). The same arithmetic, each pass spread over chunks of the
// domain, and f, r and log s recomputed from the evidence instead of stored:
//   sfi_pos_prior     the position part of the prior, once for the domain
//   sfi_score_part    per (layer, kv head, chunk of SFI_SC positions): f and r, the chunk's
//                     maxima and its sums (f, f^2, r, r^2, f r relative to them)
//   sfi_score_lambda  per (layer, kv head): the chunks merged -> normalisers, lambda, weights
//   sfi_score_fin     per (layer, span of positions), every kv head: log s (plus a halo of the
//                     soft-NMS half window), soft-NMS, cross-head exclusivity, the final scores,
//                     each head's finite count and min / max (atomics)
//   sfi_topk_hist     per chunk: histogram of the finite scores, TOPK_BINS bins over [min, max]
//   sfi_topk_cand     per chunk: the bin b* holding the m-th largest score, the chunk's count of
//                     scores in higher bins, the members of b* as candidates (key, position)
//   sfi_topk_rank     per (layer, kv head): the threshold key and the last position taken at it
//                     (ties: lower positions first), taken candidates counted per chunk; when b*
//                     holds more than TOPK_CAP scores, sfi_radix_select over the whole row instead
//   sfi_topk_write    per chunk: its chosen positions, in order, after the chunks before it
// Zeroed before sfi_score_part (one memset): min / max (u64 [lh][2]: the max key and the max of
// ~key), finite counts and candidate counts (u32 [lh] each), histograms ([lh][TOPK_BINS]) and
// taken counts ([lh][nch]), lh = layers x kv heads.
#define SFI_SC 2048
#define SFI_PER (SFI_SC / 256)

// The key of sfi_key back to its double.
__device__ __forceinline__ double sfi_unkey(u64 key) {
    const u64 b = (key >> 63) ? (key & 0x7fffffffffffffffull) : ~key;
    return __longlong_as_double((long long)b);
}

// The range of a head's finite scores from its min / max pair; false when they do not span an
// interval (no finite score, or all equal).
__device__ __forceinline__ bool sfi_range(const u64* mm, double& mn, double& mx) {
    const u64 kmax = mm[0], kmin = ~mm[1];
    if (kmax == 0) return false;
    mn = sfi_unkey(kmin);
    mx = sfi_unkey(kmax);
    return mx > mn;
}

// pp[i] = sfi_pos(i, n) for the domain (every layer and head shares it: the score kernels' pstride
// 0; a cheaper slow step's view has a prior per layer, sfi_pos_prior_view, pstride n).
// grid ceil(n / 256), block 256.
extern "C" __global__ void sfi_pos_prior(double* __restrict__ pp, u32 n, const double* __restrict__ cfgp) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) pp[i] = sfi_pos(sfi_cfg(cfgp), i, n);
}

// part[(lh, c)][0..7] = (max f, sum F, sum F^2, max r, sum R, sum R^2, sum F R, 0), F = exp(f - max f)
// (sq: F = f, max f = 0), R = exp(r - max r) over the chunk. grid (nch, kv_heads, layers), block 256.
extern "C" __global__ void __launch_bounds__(256)
    sfi_score_part(const double* __restrict__ ev, const float2* __restrict__ stats, const float* __restrict__ norms,
                   const double* __restrict__ pp, double* __restrict__ part, u32 rows, u32 capacity, u32 lo, u32 hi,
                   const double* __restrict__ cfgp, u32 geo, u32 ns, u32 pstride) {
    __shared__ double ds[32];
    const SelCfg cfg = sfi_cfg(cfgp);
    const u32 c = blockIdx.x, nch = gridDim.x, h = blockIdx.y, z = blockIdx.z, n = hi - lo;
    pp += (u64)z * pstride;
    const u64 zh = (u64)z * gridDim.y + h;
    const u32 valid = sfi_valid_rows(stats + zh * rows, rows);
    if (valid == 0) return;  // sfi_score_lambda marks the head; its chunks are not read
    const double* e = ev + zh * n;
    const float* kn = norms + (u64)z * ns + (u64)h * capacity + lo;
    const bool sq = !geo && cfg.alpha == 0.5;
    double fv[SFI_PER], rv[SFI_PER];
    double fmx = -D_INF, rmx = -D_INF;
#pragma unroll
    for (int t = 0; t < SFI_PER; ++t) {
        const u32 i = c * SFI_SC + t * 256 + threadIdx.x;
        if (i < n) {
            sfi_fr(cfg, e[i], kn[i], pp[i], sq, geo, valid, fv[t], rv[t]);
        } else {
            fv[t] = sq ? 0.0 : -D_INF;
            rv[t] = -D_INF;
        }
        fmx = fmax(fmx, fv[t]);
        rmx = fmax(rmx, rv[t]);
    }
    fmx = sq ? 0.0 : block_max_d(fmx, ds);
    rmx = block_max_d(rmx, ds);
    double s1f = 0.0, s2f = 0.0, s1r = 0.0, s2r = 0.0, sfr = 0.0;
#pragma unroll
    for (int t = 0; t < SFI_PER; ++t) {
        const double F = sq ? fv[t] : (fmx == -D_INF ? 0.0 : exp(fv[t] - fmx));
        const double R = rmx == -D_INF ? 0.0 : exp(rv[t] - rmx);
        s1f += F;
        s2f += F * F;
        s1r += R;
        s2r += R * R;
        sfr += F * R;
    }
    s1f = block_sum_d(s1f, ds);
    s2f = block_sum_d(s2f, ds);
    s1r = block_sum_d(s1r, ds);
    s2r = block_sum_d(s2r, ds);
    sfr = block_sum_d(sfr, ds);
    if (threadIdx.x == 0) {
        double* o = part + (zh * nch + c) * 8;
        o[0] = fmx;
        o[1] = s1f;
        o[2] = s2f;
        o[3] = rmx;
        o[4] = s1r;
        o[5] = s2r;
        o[6] = sfr;
        o[7] = 0.0;
    }
}

// hc[lh][0..7] = (max f, 1 / Z_f, max r, 1 / Z_r, w_f, w_r, 1 / Z_s, valid rows) from the chunk
// sums: f = F / Z_f, r = R / Z_r, s = (w_f f + w_r r) / Z_s as sfi_score computes them.
// grid (kv_heads, layers), block 32.
extern "C" __global__ void __launch_bounds__(32)
    sfi_score_lambda(const double* __restrict__ part, const float2* __restrict__ stats, double* __restrict__ hc,
                     u32 rows, u32 nch, const double* __restrict__ cfgp, u32 geo) {
    const SelCfg cfg = sfi_cfg(cfgp);
    const u64 zh = (u64)blockIdx.y * gridDim.x + blockIdx.x;
    double* o = hc + zh * 8;
    const u32 valid = sfi_valid_rows(stats + zh * rows, rows);
    if (valid == 0) {
        if (threadIdx.x == 0) o[7] = 0.0;
        return;
    }
    const bool sq = !geo && cfg.alpha == 0.5;
    const double* pp = part + zh * nch * 8;
    double fmx = -D_INF, rmx = -D_INF;
    for (u32 c = threadIdx.x; c < nch; c += 32) {
        fmx = fmax(fmx, pp[c * 8]);
        rmx = fmax(rmx, pp[c * 8 + 3]);
    }
    fmx = warp_max_d(fmx);
    rmx = warp_max_d(rmx);
    double zf = 0.0, sff = 0.0, zr = 0.0, srr = 0.0, sfr = 0.0;
    for (u32 c = threadIdx.x; c < nch; c += 32) {
        const double* q = pp + c * 8;
        const double wF = sq ? 1.0 : (q[0] == -D_INF ? 0.0 : exp(q[0] - fmx));
        const double wR = q[3] == -D_INF ? 0.0 : exp(q[3] - rmx);
        zf += q[1] * wF;
        sff += q[2] * wF * wF;
        zr += q[4] * wR;
        srr += q[5] * wR * wR;
        sfr += q[6] * wF * wR;
    }
    zf = warp_sum_t(zf);
    sff = warp_sum_t(sff);
    zr = warp_sum_t(zr);
    srr = warp_sum_t(srr);
    sfr = warp_sum_t(sfr);
    const double inv_f = zf > 0.0 ? 1.0 / zf : 0.0, inv_r = 1.0 / zr;
    const double lam = sfi_lambda(cfg, sff * inv_f * inv_f, srr * inv_r * inv_r, sfr * inv_f * inv_r, valid);
    const double wf = 1.0 - lam, wr = lam + cfg.eps;
    if (threadIdx.x == 0) {
        o[0] = fmx;
        o[1] = inv_f;
        o[2] = rmx;
        o[3] = inv_r;
        o[4] = wf;
        o[5] = wr;
        o[6] = 1.0 / (wf * (zf * inv_f) + wr * (zr * inv_r));
        o[7] = (double)valid;
    }
}

// The final scores of positions [c0, c0 + span) of every kv head of layer z (see above).
// Dynamic smem (kv_heads * span + span + 2 * half) doubles. grid (ceil(n / span), layers), block 256.
extern "C" __global__ void __launch_bounds__(256)
    sfi_score_fin(const double* __restrict__ ev, const float* __restrict__ norms, const double* __restrict__ pp,
                  const double* __restrict__ hc,
                  double* __restrict__ out, u32* __restrict__ cnt, u64* __restrict__ mm, u32 kv_heads,
                  u32 capacity, u32 lo, u32 hi, u32 span, const double* __restrict__ cfgp, u32 geo, u32 ns,
                  u32 pstride) {
    extern __shared__ double fsm[];
    const SelCfg cfg = sfi_cfg(cfgp);
    const u32 z = blockIdx.y, n = hi - lo, half = cfg.half, lane = threadIdx.x & 31;
    pp += (u64)z * pstride;
    const u32 c0 = blockIdx.x * span, cn = min(span, n - c0);
    const bool sq = !geo && cfg.alpha == 0.5, nms = half > 0 && cfg.soft_alpha != 0.0;
    const u32 a0 = nms && c0 > half ? c0 - half : (nms ? 0 : c0);
    const u32 a1 = nms ? min(n, c0 + cn + half) : c0 + cn;
    double* fin = fsm;                        // [kv_heads][span]
    double* pre = fsm + (u64)kv_heads * span;  // [span + 2 half]: log s before soft-NMS
    for (u32 h = 0; h < kv_heads; ++h) {
        const u64 zh = (u64)z * kv_heads + h;
        const double* k = hc + zh * 8;
        double* fh = fin + (u64)h * span;
        if (k[7] == 0.0) {
            for (u32 i = threadIdx.x; i < cn; i += 256) fh[i] = -D_INF;
            continue;
        }
        const u32 valid = (u32)k[7];
        const double fmx = k[0], inv_f = k[1], rmx = k[2], inv_r = k[3], wf = k[4], wr = k[5], inv_s = k[6];
        const double* e = ev + zh * n;
        const float* kn = norms + (u64)z * ns + (u64)h * capacity + lo;
        for (u32 i = a0 + threadIdx.x; i < a1; i += 256) {
            const double a = e[i];
            double v = -D_INF;
            if (a == a) {
                double fv, rv;
                sfi_fr(cfg, a, kn[i], pp[i], sq, geo, valid, fv, rv);
                const double F = sq ? fv : (fmx == -D_INF ? 0.0 : exp(fv - fmx));
                const double R = rmx == -D_INF ? 0.0 : exp(rv - rmx);
                v = log((wf * (F * inv_f) + wr * (R * inv_r)) * inv_s);
            }
            pre[i - a0] = v;
        }
        __syncthreads();
        u32 finite = 0;
        for (u32 i = c0 + threadIdx.x; i < c0 + cn; i += 256) {
            double v = pre[i - a0];
            if (nms && v != -D_INF) {
                const u32 a = i > half ? i - half : 0, b = min(i + half, n - 1);
                double pooled = -D_INF;
                for (u32 t = a; t <= b; ++t) pooled = fmax(pooled, pre[t - a0]);
                v = v - cfg.soft_alpha * fmax(pooled - v, 0.0);
            }
            fh[i - c0] = v;
            finite += v != -D_INF;
        }
        finite = warp_sum_t(finite);
        if (lane == 0 && finite) atomicAdd(&cnt[zh], finite);
        __syncthreads();  // pre is the next head's
    }
    // Each thread owns the positions i = threadIdx.x + 256 j from here on: no barrier needed.
    if (kv_heads > 2)
        for (u32 i = threadIdx.x; i < cn; i += 256) sfi_cross_one(fin + i, span, kv_heads, cfg);
    for (u32 h = 0; h < kv_heads; ++h) {
        const u64 zh = (u64)z * kv_heads + h;
        u64 kmax = 0, kminc = 0;
        for (u32 i = threadIdx.x; i < cn; i += 256) {
            const double v = fin[(u64)h * span + i];
            out[zh * n + c0 + i] = v;
            if (v != -D_INF) {
                const u64 key = sfi_key(v);
                kmax = max(kmax, key);
                kminc = max(kminc, ~key);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
            kminc = max(kminc, __shfl_xor_sync(0xffffffffu, kminc, o));
        }
        if (lane == 0 && kmax != 0) {
            atomicMax(reinterpret_cast<unsigned long long*>(&mm[zh * 2]), (unsigned long long)kmax);
            atomicMax(reinterpret_cast<unsigned long long*>(&mm[zh * 2 + 1]), (unsigned long long)kminc);
        }
    }
}

// hist[lh][b] += the chunk's finite scores in bin b. grid (nch, kv_heads, layers), block 256.
extern "C" __global__ void __launch_bounds__(256)
    sfi_topk_hist(const double* __restrict__ scores, const u32* __restrict__ cnt, const u64* __restrict__ mm,
                  u32* __restrict__ hist, u32 n, u32 k) {
    __shared__ u32 bins[TOPK_BINS];
    const u32 c = blockIdx.x, kvh = gridDim.y, z = blockIdx.z;
    const u64 zh = (u64)z * kvh + blockIdx.y;
    double mn, mx;
    if (sfi_equal_count(cnt + (u64)z * kvh, kvh, k) == 0 || !sfi_range(mm + zh * 2, mn, mx)) return;
    const double scale = (double)TOPK_BINS / (mx - mn);
    for (u32 b = threadIdx.x; b < TOPK_BINS; b += 256) bins[b] = 0;
    __syncthreads();
    const double* s = scores + zh * n;
#pragma unroll
    for (int t = 0; t < SFI_PER; ++t) {
        const u32 i = c * SFI_SC + t * 256 + threadIdx.x;
        if (i < n) {
            const double v = s[i];
            if (v != -D_INF) atomicAdd(&bins[sfi_bin(v, mn, scale)], 1u);
        }
    }
    __syncthreads();
    u32* hh = hist + zh * TOPK_BINS;
    for (u32 b = threadIdx.x; b < TOPK_BINS; b += 256)
        if (bins[b]) atomicAdd(&hh[b], bins[b]);
}

// The bin b* of the m-th largest score (and the count in higher bins, into tinfo[lh] by chunk
// 0); above[lh][c] = the chunk's scores in higher bins; its members of b* appended to
// cand / cpos[lh][..TOPK_CAP] (ccount[lh] counts them all). Without a range (all finite scores
// equal) every finite score is in b* = 0. grid (nch, kv_heads, layers), block 256.
extern "C" __global__ void __launch_bounds__(256)
    sfi_topk_cand(const double* __restrict__ scores, const u32* __restrict__ cnt, const u64* __restrict__ mm,
                  const u32* __restrict__ hist, u32* __restrict__ above, u32* __restrict__ tinfo,
                  u64* __restrict__ cand, u32* __restrict__ cpos, u32* __restrict__ ccount, u32 n, u32 k) {
    __shared__ u32 tsum[256];
    __shared__ u32 sh_b, sh_above;
    __shared__ u32 red[32];
    const u32 c = blockIdx.x, nch = gridDim.x, kvh = gridDim.y, z = blockIdx.z, tid = threadIdx.x;
    const u64 zh = (u64)z * kvh + blockIdx.y;
    const u32 m = sfi_equal_count(cnt + (u64)z * kvh, kvh, k);
    if (m == 0) return;
    double mn = 0.0, mx = 0.0;
    const bool ranged = sfi_range(mm + zh * 2, mn, mx);
    const double scale = ranged ? (double)TOPK_BINS / (mx - mn) : 0.0;
    if (tid == 0) sh_b = sh_above = 0;
    if (ranged) {
        // Thread t holds bins [16 t, 16 t + 16); a suffix scan over the threads finds the one
        // whose bins hold the m-th largest, which walks them from the top.
        const u32* hh = hist + zh * TOPK_BINS;
        u32 loc[TOPK_BINS / 256], ts = 0;
#pragma unroll
        for (int j = 0; j < TOPK_BINS / 256; ++j) {
            loc[j] = hh[tid * (TOPK_BINS / 256) + j];
            ts += loc[j];
        }
        tsum[tid] = ts;
        __syncthreads();
        for (u32 off = 1; off < 256; off <<= 1) {
            const u32 v = tid + off < 256 ? tsum[tid + off] : 0u;
            __syncthreads();
            tsum[tid] += v;
            __syncthreads();
        }
        const u32 incl = tsum[tid], excl = incl - ts;
        if (excl < m && m <= incl) {
            u32 acc = excl;
            int b = TOPK_BINS / 256 - 1;
            for (; b > 0; --b) {
                if (acc + loc[b] >= m) break;
                acc += loc[b];
            }
            sh_b = tid * (TOPK_BINS / 256) + b;
            sh_above = acc;
        }
    }
    __syncthreads();
    const int bstar = (int)sh_b;
    if (c == 0 && tid == 0) {
        tinfo[zh * 2] = sh_b;
        tinfo[zh * 2 + 1] = sh_above;
    }
    const double* s = scores + zh * n;
    u32 up = 0;
#pragma unroll
    for (int t = 0; t < SFI_PER; ++t) {
        const u32 i = c * SFI_SC + t * 256 + tid;
        if (i < n) {
            const double v = s[i];
            if (v != -D_INF) {
                const int b = ranged ? sfi_bin(v, mn, scale) : 0;
                up += b > bstar;
                if (b == bstar) {
                    const u32 q = atomicAdd(&ccount[zh], 1u);
                    if (q < TOPK_CAP) {
                        cand[zh * TOPK_CAP + q] = sfi_key(v);
                        cpos[zh * TOPK_CAP + q] = i;
                    }
                }
            }
        }
    }
    up = block_sum_u(up, red);
    if (tid == 0) above[zh * nch + c] = up;
}

// The threshold of head lh: tres[lh] = (the m-th largest key, the last domain position taken
// among the keys equal to it: ties go to lower positions), taken[lh][c] += the chunk's taken
// candidates; mcount[layer] = m. When b* overflowed the candidate buffer, sfi_radix_select over
// the row, and taken[lh][c] the chunk's whole count (above[lh][c] zeroed).
// grid (kv_heads, layers), block 1024.
extern "C" __global__ void __launch_bounds__(1024)
    sfi_topk_rank(const double* __restrict__ scores, const u32* __restrict__ cnt, const u32* __restrict__ tinfo,
                  const u64* __restrict__ cand, const u32* __restrict__ cpos, const u32* __restrict__ ccount,
                  u32* __restrict__ above, u32* __restrict__ taken, u64* __restrict__ tres, u32* __restrict__ mcount,
                  u32 n, u32 k, u32 nch) {
    __shared__ u64 ck[TOPK_CAP];
    __shared__ u32 cp[TOPK_CAP];
    __shared__ u64 sh_key;
    __shared__ u32 sh_rem, sh_cut;
    __shared__ u32 wsum[32];
    const u32 kvh = gridDim.x, z = blockIdx.y, T = blockDim.x, tid = threadIdx.x;
    const u32 lane = tid & 31, warp = tid >> 5;
    const u64 zh = (u64)z * kvh + blockIdx.x;
    const u32 m = sfi_equal_count(cnt + (u64)z * kvh, kvh, k);
    if (blockIdx.x == 0 && tid == 0) mcount[z] = m;
    if (m == 0) return;
    const u32 cc = ccount[zh];
    u32* tk = taken + zh * nch;
    u64 thr;
    u32 cut;
    if (cc <= TOPK_CAP) {
        const u32 r = m - tinfo[zh * 2 + 1];
        for (u32 t = tid; t < cc; t += T) {
            ck[t] = cand[zh * TOPK_CAP + t];
            cp[t] = cpos[zh * TOPK_CAP + t];
        }
        __syncthreads();
        sfi_rank_cand(ck, cc, r, &sh_key, &sh_rem);
        __syncthreads();
        thr = sh_key;
        for (u32 t = tid; t < cc; t += T) {
            if (ck[t] != thr) continue;
            u32 q = 0;
            for (u32 j = 0; j < cc; ++j) q += ck[j] == thr && cp[j] < cp[t];
            if (q + 1 == sh_rem) sh_cut = cp[t];
        }
        __syncthreads();
        cut = sh_cut;
        for (u32 t = tid; t < cc; t += T)
            if (ck[t] > thr || (ck[t] == thr && cp[t] <= cut)) atomicAdd(&tk[cp[t] / SFI_SC], 1u);
    } else {
        const double* s = scores + zh * n;
        u32 rem;
        sfi_radix_select(s, n, m, thr, rem);
        // Walk the row in order: the rem-th key equal to the threshold is the cut; each tile
        // (T divides SFI_SC, so one chunk) adds its taken count.
        u32 eq_seen = 0;
        for (u32 t0 = 0; t0 < n; t0 += T) {
            const u32 i = t0 + tid;
            const u64 key = i < n ? sfi_key(s[i]) : 0;
            const bool eq = i < n && key == thr;
            const u32 be = __ballot_sync(0xffffffffu, eq);
            if (lane == 0) wsum[warp] = __popc(be);
            __syncthreads();
            u32 before = eq_seen + __popc(be & ((1u << lane) - 1)), tile = 0;
            for (u32 w = 0; w < T / 32; ++w) {
                if (w < warp) before += wsum[w];
                tile += wsum[w];
            }
            if (eq && before + 1 == rem) sh_cut = i;
            const bool take = key > thr || (eq && before < rem);
            const u32 nt = __syncthreads_count(take);
            if (tid == 0) tk[t0 / SFI_SC] += nt;
            eq_seen += tile;
        }
        for (u32 c = tid; c < nch; c += T) above[zh * nch + c] = 0;
        __syncthreads();
        cut = sh_cut;
    }
    if (tid == 0) {
        tres[zh * 2] = thr;
        tres[zh * 2 + 1] = cut;
    }
}

// sel[lh][..m]: the chunk's taken positions (lo + i, ascending) after those of the chunks before
// it. grid (nch, kv_heads, layers), block 256.
extern "C" __global__ void __launch_bounds__(256)
    sfi_topk_write(const double* __restrict__ scores, const u32* __restrict__ cnt, const u32* __restrict__ above,
                   const u32* __restrict__ taken, const u64* __restrict__ tres, u32* __restrict__ sel, u32 n,
                   u32 k, u32 lo) {
    __shared__ u32 wsum[8];
    __shared__ u32 red[32];
    const u32 c = blockIdx.x, nch = gridDim.x, kvh = gridDim.y, z = blockIdx.z, tid = threadIdx.x;
    const u32 lane = tid & 31, warp = tid >> 5;
    const u64 zh = (u64)z * kvh + blockIdx.y;
    const u32 m = sfi_equal_count(cnt + (u64)z * kvh, kvh, k);
    if (m == 0) return;
    const u64 thr = tres[zh * 2];
    const u32 cut = (u32)tres[zh * 2 + 1];
    u32 base = 0;
    for (u32 j = tid; j < c; j += 256) base += above[zh * nch + j] + taken[zh * nch + j];
    base = block_sum_u(base, red);
    const double* s = scores + zh * n;
    u32* out = sel + zh * k;
#pragma unroll 1
    for (int t = 0; t < SFI_PER; ++t) {
        const u32 i = c * SFI_SC + t * 256 + tid;
        const u64 key = i < n ? sfi_key(s[i]) : 0;
        const bool take = i < n && (key > thr || (key == thr && i <= cut));
        const u32 bt = __ballot_sync(0xffffffffu, take);
        if (lane == 0) wsum[warp] = __popc(bt);
        __syncthreads();
        u32 before = base + __popc(bt & ((1u << lane) - 1)), tile = 0;
        for (u32 w = 0; w < 8; ++w) {
            if (w < warp) before += wsum[w];
            tile += wsum[w];
        }
        if (take && before < m) out[before] = lo + i;
        base += tile;
        __syncthreads();
    }
}

// Compact memory of one (layer, slot): rows [0, sinks) are positions 0..sinks, rows
// [sinks, sinks + m) the chosen positions sel[h, :]. A copy of rows, so e4m3 caches gather with
// D given in bf16 units (the row's bytes / 2) and compact buffers of e4m3 rows. ck/cv [num_slots, kv_heads, ccap, D]; then
// clen[slot] = sinks + m and rstart[slot] = recent_start (thread 0 of block (0, 0)).
// Per layer z: caches kptrs[z] / vptrs[z], compact buffers advance by cs elements, clen and
// rstart by num_slots, sel by kv_heads * k_cap, mcount by 1.
// grid (ceil(ccap / 8), kv_heads, layers), block 256 (a warp per row, 16-byte copies).
extern "C" __global__ void sfi_gather(const u64* __restrict__ kptrs, const u64* __restrict__ vptrs,
                                      bf16* __restrict__ ck, bf16* __restrict__ cv, const u32* __restrict__ sel,
                                      const u32* __restrict__ mcount, u32* __restrict__ clen, u32* __restrict__ rstart,
                                      u32 slot, u32 kv_heads, u32 capacity, u32 ccap, u32 D, u32 sinks, u32 k_cap,
                                      u32 recent_start, u32 num_slots, u32 cs) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = blockIdx.y;
    const u64 z = blockIdx.z;
    const bf16* k = reinterpret_cast<const bf16*>(kptrs[z]);
    const bf16* v = reinterpret_cast<const bf16*>(vptrs[z]);
    ck += z * cs;
    cv += z * cs;
    sel += z * kv_heads * k_cap;
    mcount += z;
    clen += z * num_slots;
    rstart += z * num_slots;
    const u32 row = blockIdx.x * 8 + warp, m = mcount[0], total = min(sinks + m, ccap);
    if (blockIdx.x == 0 && h == 0 && threadIdx.x == 0) {
        clen[slot] = total;
        rstart[slot] = recent_start;
    }
    if (row >= total) return;
    const u32 pos = row < sinks ? row : sel[(u64)h * k_cap + row - sinks];
    const u64 src = (((u64)slot * kv_heads + h) * capacity + pos) * D;
    const u64 dst = (((u64)slot * kv_heads + h) * ccap + row) * D;
    for (u32 c = lane * 8; c < D; c += 256) {
        *reinterpret_cast<uint4*>(ck + dst + c) = *reinterpret_cast<const uint4*>(k + src + c);
        *reinterpret_cast<uint4*>(cv + dst + c) = *reinterpret_cast<const uint4*>(v + src + c);
    }
}

// Publishes an asynchronous refresh of slot `slot` (its Selector and gather ran on the side
// stream into staging buffers laid out like the live ones): copies the staged compact K / V of
// every global layer, and its compact length and recent start, into the buffers the fast step
// reads. Compact buffers [layers, num_slots, per_slot]; clen / rstart [layers, num_slots].
// grid (layers * 2, 32), block 256 (blockIdx.x: layer * 2 + (0: K, 1: V); y: a 32nd of the rows).
extern "C" __global__ void sfi_publish(const bf16* __restrict__ sk, const bf16* __restrict__ sv,
                                       const u32* __restrict__ sclen, const u32* __restrict__ srstart,
                                       bf16* __restrict__ ck, bf16* __restrict__ cv, u32* __restrict__ clen,
                                       u32* __restrict__ rstart, u32 slot, u32 num_slots, u64 per_slot) {
    const u32 gi = blockIdx.x / 2, which = blockIdx.x % 2;
    const u64 off = ((u64)gi * num_slots + slot) * per_slot;
    const uint4* src = reinterpret_cast<const uint4*>((which ? sv : sk) + off);
    uint4* dst = reinterpret_cast<uint4*>((which ? cv : ck) + off);
    const u64 n = per_slot / 8, part = (n + gridDim.y - 1) / gridDim.y;
    const u64 lo = blockIdx.y * part, hi = min(n, lo + part);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = src[i];
    if (which == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        const u64 j = (u64)gi * num_slots + slot;
        clen[j] = sclen[j];
        rstart[j] = srstart[j];
    }
}
