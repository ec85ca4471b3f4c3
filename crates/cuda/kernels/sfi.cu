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

// Double-precision block reductions (every thread gets the result; scratch >= 32 doubles).
__device__ __forceinline__ double block_sum_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double r = lane < nw ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    return r;
}
__device__ __forceinline__ double block_max_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double r = lane < nw ? scratch[lane] : -D_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) r = fmax(r, __shfl_xor_sync(0xffffffffu, r, o));
    return r;
}

// norms[kvh, p] = |k[slot, kvh, p, :hd]| for p in [p0, p1). kptrs[layer]: that layer's cache
// [num_slots, kv_heads, capacity, D]; norms: this slot's [kv_heads, capacity] (layer stride ns).
// grid (ceil((p1 - p0) / 8), kv_heads, layers), block 256 (a warp per position).
extern "C" __global__ void sfi_key_norms(const u64* __restrict__ kptrs, float* __restrict__ norms, u32 ns, u32 slot,
                                         u32 kv_heads, u32 capacity, u32 D, u32 p0, u32 p1) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 p = p0 + blockIdx.x * 8 + warp, h = blockIdx.y;
    if (p >= p1) return;
    const bf16* k = reinterpret_cast<const bf16*>(kptrs[blockIdx.z]);
    norms += (u64)blockIdx.z * ns;
    const bf16* row = k + (((u64)slot * kv_heads + h) * capacity + p) * D;
    float s = 0.0f;
    for (u32 c = lane; c < D; c += 32) {
        const float x = bf2f(row[c]);
        s += x * x;
    }
    s = warp_sum(s);
    if (lane == 0) norms[(u64)h * capacity + p] = sqrtf(s);
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
    float m = NEG_INF;
    #pragma unroll 4
    for (u32 j = lo + threadIdx.x; j < hi; j += blockDim.x) m = fmaxf(m, z[j]);
    m = block_max(m, scratch);
    double s = 0.0;
    if (m != NEG_INF)
        #pragma unroll 4
        for (u32 j = lo + threadIdx.x; j < hi; j += blockDim.x) s += (double)exp2f(z[j] - m);
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
    u32 valid = 0;
    for (u32 rr = 0; rr < rows; ++rr) valid += stats[(u64)h * rows + rr].x != NEG_INF;
    if (valid == 0) {
        #pragma unroll 4
        for (u32 i = threadIdx.x; i < n; i += T) s[i] = -D_INF;
        if (threadIdx.x == 0) cnt[h] = 0;
        return;
    }
    const bool sq = !geo && cfg.alpha == 0.5;
    const double span = n > 1 ? (double)(n - 1) : 1.0;
    const double p = fmax(cfg.pos_power, 1.0);
    double fmx = -D_INF, rmx = -D_INF;
    #pragma unroll 4
    for (u32 i = threadIdx.x; i < n; i += T) {
        const double a = e[i];
        const bool hid = (a != a);
        double fv;
        if (sq)
            fv = hid ? 0.0 : a * a;  // the CPU's alpha = 0.5 path: linear, no max shift
        else if (geo)
            fv = hid ? -D_INF : a / (double)valid;
        else
            fv = hid ? -D_INF : log(a) / cfg.alpha;
        f[i] = fv;
        fmx = fmax(fmx, fv);
        const double u = fmin(fmax((double)i / span, 0.0), 1.0);
        const double tail = fmax((double)(n - 1 - i) / span, cfg.eps);
        const double pos = -cfg.beta * exp(p * log(u)) + cfg.pos_eta * log(tail);
        const double rv = hid ? -D_INF : -cfg.gamma * cfg.w_l2 * log(fmax((double)kn[i], cfg.eps)) + cfg.w_pos * pos;
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
    const double star = (ff - fr) / fmax(ff - 2.0 * fr + rr2, cfg.eps);
    const double lmax = valid <= 1 ? cfg.lclip_single : cfg.lclip_multi;
    double lam = fmin(fmax(star, 0.0), lmax);
    if (cfg.lambda_soft && lmax > 0.0) lam = lmax * tanh(lam / lmax);
    lam = fmin(lam, 1.0 - cfg.eps);
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
    const double a = cfg.cross_a, inv_t = cfg.cross_inv_t, leps = log(cfg.eps);
    double mx = -D_INF;
    for (u32 h = 0; h < kv_heads; ++h) mx = fmax(mx, scores[(u64)h * n + i] * inv_t);
    if (mx == -D_INF) mx = 0.0;
    double sum = 0.0;
    for (u32 h = 0; h < kv_heads; ++h) sum += exp(scores[(u64)h * n + i] * inv_t - mx);
    const double lse = log(sum) + mx;
    for (u32 h = 0; h < kv_heads; ++h) {
        const double v = scores[(u64)h * n + i];
        if (v != -D_INF) scores[(u64)h * n + i] = v + a * fmax(v * inv_t - lse, leps);
    }
}

// Order-preserving u64 of a double (greater score, greater key); -inf maps to 0 (never chosen).
__device__ __forceinline__ u64 sfi_key(double v) {
    if (v == -D_INF) return 0;
    const u64 b = (u64)__double_as_longlong(v);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

// Per kv head (one block): m = min over heads of min(k, cnt[h]) (the equalised count); the m
// highest scores (ties: lower position first) as ascending positions lo + i into sel[h, :m];
// mcount[0] = m. grid (kv_heads, layers), block 1024.
extern "C" __global__ void __launch_bounds__(1024)
    sfi_topk(const double* __restrict__ scores, const u32* __restrict__ cnt, u32* __restrict__ sel,
             u32* __restrict__ mcount, u32 kv_heads, u32 n, u32 k, u32 lo) {
    __shared__ u32 hist[256];
    __shared__ u32 sh_digit, sh_rem, sh_base;
    __shared__ u32 wsum[32];
    const u32 h = blockIdx.x, T = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    {
        const u64 z = blockIdx.y;
        scores += z * kv_heads * n;
        cnt += z * kv_heads;
        sel += z * kv_heads * k;
        mcount += z;
    }
    u32 m = k;
    for (u32 t = 0; t < kv_heads; ++t) m = min(m, cnt[t]);
    if (h == 0 && threadIdx.x == 0) mcount[0] = m;
    if (m == 0) return;
        const double* s = scores + (u64)h * n;
    u64 prefix = 0, mask = 0;
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
        auto bin_of = [&](double v) { return min(TOPK_BINS - 1, (int)((v - mn) * scale)); };
        for (u32 b = threadIdx.x; b < TOPK_BINS; b += T) bins[b] = 0;
        if (threadIdx.x == 0) sh_cnum = 0;
        __syncthreads();
#pragma unroll 4
        for (u32 i = threadIdx.x; i < n; i += T) {
            const double v = s[i];
            if (v != -D_INF) atomicAdd(&bins[bin_of(v)], 1u);
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
                if (v != -D_INF && bin_of(v) == bstar) cand[atomicAdd(&sh_cnum, 1u)] = sfi_key(v);
            }
            __syncthreads();
            // The r-th largest candidate (r = m - keys in higher bins) is the threshold key; of
            // the keys equal to it, take r - (candidates above it), lowest positions first.
            const u32 c = sh_cnum, r = m - sh_above;
            for (u32 t = threadIdx.x; t < c; t += T) {
                const u64 kt = cand[t];
                u32 g = 0, e = 0;
                for (u32 j = 0; j < c; ++j) {
                    g += cand[j] > kt;
                    e += cand[j] == kt;
                }
                if (g < r && r <= g + e) {
                    sh_key = kt;
                    sh_rem = r - g;
                }
            }
            __syncthreads();
            prefix = sh_key;
            rem = sh_rem;
            bucketed = true;
            __syncthreads();
        }
    }
    // Radix select of the m-th largest key, 8 bits at a time from the top.
    for (int shift = 56; !bucketed && shift >= 0; shift -= 8) {
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
    // prefix is the threshold key; take every key above it and the first `rem` equal to it.
    u32* out = sel + (u64)h * k;
    if (threadIdx.x == 0) sh_base = 0;
    u32 eq_seen = 0;  // equal keys before this tile (uniform across the block)
    __syncthreads();
    for (u32 t0 = 0; t0 < n; t0 += T) {
        const u32 i = t0 + threadIdx.x;
        const u64 key = i < n ? sfi_key(s[i]) : 0;
        const bool gt = i < n && key > prefix, eq = i < n && key == prefix;
        // Inclusive scans of eq (to rank equal keys) and then of the chosen flag.
        const u32 be = __ballot_sync(0xffffffffu, eq);
        const u32 eq_in_warp = __popc(be & ((1u << lane) - 1));
        if (lane == 0) wsum[warp] = __popc(be);
        __syncthreads();
        u32 eq_before = eq_seen, eq_tile = 0;
        for (u32 w = 0; w < T / 32; ++w) {
            if (w < warp) eq_before += wsum[w];
            eq_tile += wsum[w];
        }
        eq_before += eq_in_warp;
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

// Compact memory of one (layer, slot): rows [0, sinks) are positions 0..sinks, rows
// [sinks, sinks + m) the chosen positions sel[h, :]. ck/cv [num_slots, kv_heads, ccap, D]; then
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
