// decode_fused.cu: the kernel after the merged q/k/v projection (q/k norms, RoPE, KV append),
// for every forward; the fused GEMVs of the 1-2-row decode step are in gemv.cu.

// After the merged q/k/v projection, per (token row t, head h) of q, k and v: the per-head
// RMSNorm of q and k (when qn / kn are given; the head_rmsnorm_bf16 arithmetic), NeoX RoPE of the
// first `rot` dims of q and k at positions[t] (rope_neox_bf16's arithmetic, angles in f64 from the
// table inv_freq [rot / 2]), q written to q_out [n, qh, hd], and k and v appended to the caches
// [num_slots, kh, capacity, hd] at (slots[t], positions[t]) (rows out of range are not cached).
// rope_pos, when not null, gives the RoPE positions instead (FastKV's propagated rows are stored
// compactly at rows positions[t] but rotated at their own positions rope_pos[t]).
// qkv [n, row_stride]: row t holds q (qh heads), then k (kh), then v (kh), each hd wide.
// A warp a head, QKV_POST_HEADS heads of one token a block: the block computes the token's
// rot / 2 angles once (a prefill's f64 sincos per head was most of this kernel's time).
// grid (n, ceil((qh + 2 kh) / QKV_POST_HEADS)), block 32 * QKV_POST_HEADS; hd <= 256 and a
// multiple of 32.
#define QKV_POST_HEADS 8
// F8: the caches hold e4m3 bytes (rounded and saturated from the bf16 values), and amax, when
// given, collects each kv head's largest |k| (amax[h]) and |v| (amax[kh + h]) before rounding
// (calibrate_fp8 in model.rs sets the fp8 scales from it).
template <bool F8>
__device__ __forceinline__ void qkv_post_impl(const bf16* __restrict__ qkv, u32 row_stride, bf16* __restrict__ q_out,
                                              bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                              const float* __restrict__ qn, const float* __restrict__ kn, float eps,
                                              const u32* __restrict__ positions, const u32* __restrict__ slots,
                                              u32 qh, u32 kh, u32 hd, u32 rot, const double* __restrict__ inv_freq,
                                              u32 capacity, u32 num_slots, const u32* __restrict__ rope_pos,
                                              float* __restrict__ amax) {
    __shared__ float bufs[QKV_POST_HEADS][256];
    __shared__ float cs[2][128];  // cos, sin of token t's angles
    pdl_wait();
    pdl_trigger();
    const u32 t = blockIdx.x, lane = threadIdx.x & 31, h = blockIdx.y * QKV_POST_HEADS + (threadIdx.x >> 5);
    const u32 pos = positions[t], slot = slots[t];
    const u32 half = rot / 2;
    rope_angles(rope_pos != nullptr ? rope_pos[t] : pos, inv_freq, half, cs);
    __syncthreads();
    if (h >= qh + 2 * kh) return;
    float* buf = bufs[threadIdx.x >> 5];
    const bool cached = pos < capacity && slot < num_slots;
    const bf16* x = qkv + (u64)t * row_stride + (u64)h * hd;
    if (h >= qh + kh) {
        const u32 hv = h - qh - kh;
        if (!cached) return;
        const u64 at = (((u64)slot * kh + hv) * capacity + pos) * hd;
        if constexpr (F8) {
            float mx = 0.0f;
            unsigned char* dst = reinterpret_cast<unsigned char*>(v_cache) + at;
            for (u32 c = lane; c < hd; c += 32) {
                const float v = bf2f(x[c]);
                mx = fmaxf(mx, fabsf(v));
                dst[c] = f2fp8(v);
            }
            mx = warp_max(mx);
            if (amax != nullptr && lane == 0) atomicMax(reinterpret_cast<int*>(amax + kh + hv), __float_as_int(mx));
            return;
        }
        const uint4* src = reinterpret_cast<const uint4*>(x);
        uint4* dst = reinterpret_cast<uint4*>(v_cache + at);
        for (u32 c = lane; c < hd / 8; c += 32) dst[c] = src[c];
        return;
    }
    const bool is_k = h >= qh;
    qk_head_post(x, is_k ? kn : qn, eps, hd, half, cs, buf, lane);
    if (is_k && !cached) return;
    if (F8 && is_k) {
        const u32 hk = h - qh;
        unsigned char* dst = reinterpret_cast<unsigned char*>(k_cache) + (((u64)slot * kh + hk) * capacity + pos) * hd;
        float mx = 0.0f;
        for (u32 c = lane; c < hd; c += 32) {
            const float k = bf2f(f2bf(buf[c]));
            mx = fmaxf(mx, fabsf(k));
            dst[c] = f2fp8(k);
        }
        mx = warp_max(mx);
        if (amax != nullptr && lane == 0) atomicMax(reinterpret_cast<int*>(amax + hk), __float_as_int(mx));
        return;
    }
    bf16* dst = is_k ? k_cache + (((u64)slot * kh + (h - qh)) * capacity + pos) * hd : q_out + ((u64)t * qh + h) * hd;
    for (u32 c = lane; c < hd; c += 32) dst[c] = f2bf(buf[c]);
}
extern "C" __global__ void __launch_bounds__(32 * QKV_POST_HEADS)
    qkv_post_bf16(const bf16* __restrict__ qkv, u32 row_stride, bf16* __restrict__ q_out,
                  bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, const float* __restrict__ qn,
                  const float* __restrict__ kn, float eps, const u32* __restrict__ positions,
                  const u32* __restrict__ slots, u32 qh, u32 kh, u32 hd, u32 rot,
                  const double* __restrict__ inv_freq, u32 capacity, u32 num_slots,
                  const u32* __restrict__ rope_pos) {
    qkv_post_impl<false>(qkv, row_stride, q_out, k_cache, v_cache, qn, kn, eps, positions, slots, qh, kh, hd, rot,
                         inv_freq, capacity, num_slots, rope_pos, nullptr);
}
// The same writing e4m3 caches; amax [2 kh] or null (see qkv_post_impl).
extern "C" __global__ void __launch_bounds__(32 * QKV_POST_HEADS)
    qkv_post_f8(const bf16* __restrict__ qkv, u32 row_stride, bf16* __restrict__ q_out,
                bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, const float* __restrict__ qn,
                const float* __restrict__ kn, float eps, const u32* __restrict__ positions,
                const u32* __restrict__ slots, u32 qh, u32 kh, u32 hd, u32 rot,
                const double* __restrict__ inv_freq, u32 capacity, u32 num_slots,
                const u32* __restrict__ rope_pos, float* __restrict__ amax) {
    qkv_post_impl<true>(qkv, row_stride, q_out, k_cache, v_cache, qn, kn, eps, positions, slots, qh, kh, hd, rot,
                        inv_freq, capacity, num_slots, rope_pos, amax);
}

// Scales a bf16 block by s (a power of two, so exactly): rows [0, rows) of stride ld, columns
// [0, cols) from w (the fp8 scales folded into q/k/v and output projection weights).
// grid (ceil(cols / 256), rows), block 256.
extern "C" __global__ void scale_block_bf16(bf16* __restrict__ w, u32 rows, u32 ld, u32 cols, float s) {
    const u32 c = blockIdx.x * 256 + threadIdx.x, r = blockIdx.y;
    if (r < rows && c < cols) w[(u64)r * ld + c] = f2bf(bf2f(w[(u64)r * ld + c]) * s);
}
