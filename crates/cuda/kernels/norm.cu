// norm.cu: RMSNorm (optionally fused with a post-norm and residual add), per-head q/k
// RMSNorm and NeoX-layout RoPE.

__device__ __forceinline__ float norm_weight(const float* w, u32 i, u32 gemma) {
    return gemma ? 1.0f + w[i] : w[i];
}

// One block per row of `dim` elements.
//   residual == nullptr:  out = rmsnorm(x) * w
//   residual != nullptr:  y = post_w ? rmsnorm(x) * post_w : x
//                         residual = residual + y   (stored as bf16)
//                         out = rmsnorm(residual) * w
// gemma != 0 uses (1 + w) for both weights. x, residual, out [rows, dim].
extern "C" __global__ void rmsnorm_bf16(const bf16* __restrict__ x, bf16* residual,
                                        const float* __restrict__ post_w, const float* __restrict__ w,
                                        bf16* __restrict__ out, u32 dim, float eps, u32 gemma) {
    __shared__ float scratch[32];
    pdl_wait();
    pdl_trigger();
    const u64 base = (u64)blockIdx.x * dim;
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
