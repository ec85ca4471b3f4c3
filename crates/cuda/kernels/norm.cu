// norm.cu: RMSNorm (optionally fused with a post-norm and residual add), per-head q/k
// RMSNorm and NeoX-layout RoPE.

__device__ __forceinline__ float norm_weight(const float* w, u32 i, u32 gemma) {
    return gemma ? 1.0f + w[i] : w[i];
}

// The 8 norm weights of chunk c (as norm_weight gives them).
__device__ __forceinline__ void norm_weight8(const float* w, u32 c, u32 gemma, float* e) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(w) + 2 * c);
    const float4 b = __ldg(reinterpret_cast<const float4*>(w) + 2 * c + 1);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = gemma ? 1.0f + v[j] : v[j];
}

// rmsnorm_bf16 for dim % 8 == 0 and dim <= RMS_CHUNKS * 8 * blockDim.x: the row read once, in
// 16-byte chunks t, t + blockDim, ... that stay in registers through both passes, instead of
// three strided passes over global memory (the row written between them). The same arithmetic
// a element; the squares are summed in a different order (a thread's chunks in element order).
#define RMS_CHUNKS 4
__device__ __forceinline__ void rmsnorm_row_v(const bf16* __restrict__ xr, bf16* rr, const float* __restrict__ post_w,
                                              const float* __restrict__ w, bf16* __restrict__ o, u32 dim,
                                              float eps, u32 gemma, float* scratch) {
    const u32 c8 = dim / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(xr);
    float v[RMS_CHUNKS][8];
    uint4 r4[RMS_CHUNKS];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RMS_CHUNKS; ++i) {
        const u32 c = threadIdx.x + i * blockDim.x;
        const uint4 z = make_uint4(0, 0, 0, 0);
        unpack8(c < c8 ? __ldg(x4 + c) : z, v[i]);
        r4[i] = rr != nullptr && c < c8 ? reinterpret_cast<const uint4*>(rr)[c] : z;
    }
    if (rr != nullptr) {
        float post_scale = 0.0f;
        if (post_w != nullptr) {
#pragma unroll
            for (int i = 0; i < RMS_CHUNKS; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) ss += v[i][j] * v[i][j];
            ss = block_sum(ss, scratch);
            post_scale = rsqrtf(ss / (float)dim + eps);
        }
#pragma unroll
        for (int i = 0; i < RMS_CHUNKS; ++i) {
            const u32 c = threadIdx.x + i * blockDim.x;
            if (c >= c8) continue;
            float pw[8], r[8];
            if (post_w != nullptr) norm_weight8(post_w, c, gemma, pw);
            unpack8(r4[i], r);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float y = post_w != nullptr ? v[i][j] * post_scale * pw[j] : v[i][j];
                v[i][j] = r[j] + y;
            }
            const uint4 packed = pack8(v[i]);
            reinterpret_cast<uint4*>(rr)[c] = packed;
            unpack8(packed, v[i]);  // the residual as stored (bf16)
        }
    }
    ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RMS_CHUNKS; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += v[i][j] * v[i][j];
    ss = block_sum(ss, scratch);
    const float scale = rsqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int i = 0; i < RMS_CHUNKS; ++i) {
        const u32 c = threadIdx.x + i * blockDim.x;
        if (c >= c8) continue;
        float nw[8], y[8];
        norm_weight8(w, c, gemma, nw);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = v[i][j] * scale * nw[j];
        reinterpret_cast<uint4*>(o)[c] = pack8(y);
    }
}

// One block per row of `dim` elements.
//   residual == nullptr:  out = rmsnorm(x) * w
//   residual != nullptr:  y = post_w ? rmsnorm(x) * post_w : x
//                         residual = residual + y   (stored as bf16)
//                         out = rmsnorm(residual) * w
// gemma != 0 uses (1 + w) for both weights. x, residual, out [rows, dim] (16-byte aligned rows
// when dim % 8 == 0: rmsnorm_row_v).
extern "C" __global__ void rmsnorm_bf16(const bf16* __restrict__ x, bf16* residual,
                                        const float* __restrict__ post_w, const float* __restrict__ w,
                                        bf16* __restrict__ out, u32 dim, float eps, u32 gemma) {
    __shared__ float scratch[32];
    pdl_wait();
    pdl_trigger();
    const u64 base = (u64)blockIdx.x * dim;
    if (dim % 8 == 0 && dim <= RMS_CHUNKS * 8 * blockDim.x) {
        rmsnorm_row_v(x + base, residual != nullptr ? residual + base : nullptr, post_w, w, out + base, dim, eps,
                      gemma, scratch);
        return;
    }
    const bf16* xr = x + base;
    float post_scale = 0.0f;
    if (residual != nullptr && post_w != nullptr) {
        float ss = 0.0f;
        for (u32 c = threadIdx.x; c < dim; c += blockDim.x) { float v = bf2f(xr[c]); ss += v * v; }
        ss = block_sum(ss, scratch);
        post_scale = rsqrtf(ss / (float)dim + eps);
    }
    const bf16* src = xr;
    if (residual != nullptr) {
        bf16* rr = residual + base;
        for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
            float y = bf2f(xr[c]);
            if (post_w != nullptr) y = y * post_scale * norm_weight(post_w, c, gemma);
            rr[c] = f2bf(bf2f(rr[c]) + y);
        }
        src = rr;
        __syncthreads();
    }
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) { float v = bf2f(src[c]); ss += v * v; }
    ss = block_sum(ss, scratch);
    const float scale = rsqrtf(ss / (float)dim + eps);
    bf16* o = out + base;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x)
        o[c] = f2bf(bf2f(src[c]) * scale * norm_weight(w, c, gemma));
}

// In-place RMSNorm of each head vector: x [rows, head_dim] (rows = tokens * heads), w [head_dim].
// One warp per row; block 128 threads = 4 rows.
extern "C" __global__ void head_rmsnorm_bf16(bf16* x, const float* __restrict__ w, u32 rows,
                                             u32 head_dim, float eps, u32 gemma) {
    const u32 row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const u32 lane = threadIdx.x & 31;
    if (row >= rows) return;
    bf16* xr = x + (u64)row * head_dim;
    float ss = 0.0f;
    for (u32 c = lane; c < head_dim; c += 32) { float v = bf2f(xr[c]); ss += v * v; }
    ss = warp_sum(ss);
    const float scale = rsqrtf(ss / (float)head_dim + eps);
    for (u32 c = lane; c < head_dim; c += 32) xr[c] = f2bf(bf2f(xr[c]) * scale * norm_weight(w, c, gemma));
}

// NeoX (rotate-half) RoPE in place on q [n, q_heads, head_dim] and k [n, k_heads, head_dim]
// (k may be null). Pair i < rot_dim/2 rotates (x[i], x[i + rot_dim/2]) by
// angle = positions[t] * theta^(-2i/rot_dim) / pos_scale, or positions[t] * inv_freq[i] when
// the table inv_freq [rot_dim/2] is given (Llama 3 / per-frequency scaling). Angles in double
// precision so positions near 128K keep their phase. grid (n, q_heads + k_heads), block
// rot_dim/2.
extern "C" __global__ void rope_neox_bf16(bf16* q, bf16* k, const u32* __restrict__ positions,
                                          u32 q_heads, u32 k_heads, u32 head_dim, u32 rot_dim,
                                          float theta, float pos_scale,
                                          const double* __restrict__ inv_freq_table) {
    const u32 t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    const u32 half = rot_dim / 2;
    if (i >= half) return;
    bf16* x;
    if (h < q_heads) x = q + ((u64)t * q_heads + h) * head_dim;
    else if (k != nullptr) x = k + ((u64)t * k_heads + (h - q_heads)) * head_dim;
    else return;
    const double inv_freq = inv_freq_table != nullptr
        ? inv_freq_table[i]
        : pow((double)theta, -2.0 * (double)i / (double)rot_dim) / (double)pos_scale;
    const double ang = (double)positions[t] * inv_freq;
    double s, c;
    sincos(ang, &s, &c);
    const float x1 = bf2f(x[i]), x2 = bf2f(x[i + half]);
    x[i] = f2bf(x1 * (float)c - x2 * (float)s);
    x[i + half] = f2bf(x2 * (float)c + x1 * (float)s);
}
