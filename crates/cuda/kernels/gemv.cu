// gemv.cu: y[b, o] = sum_i x[b, i] w[o, i] for a few rows b (decode at small batch), bf16 in,
// f32 accumulate, bf16 or f32 out. The weights are streamed once: each warp takes two output
// rows at a time, each lane four 16-byte chunks of each row per iteration (eight loads in
// flight per lane), with the N input rows in shared memory. Persistent blocks stride over the
// output rows, so the input is staged once per block. in % 8 == 0.
// grid (blocks), block 256, dynamic smem N * in * 2 bytes.
__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

template <int N>
__device__ __forceinline__ void gemv_dot(float* acc, uint4 wv, const uint4* xs, u32 c8, u32 c) {
    const float w[8] = {bf_lo(wv.x), bf_hi(wv.x), bf_lo(wv.y), bf_hi(wv.y),
                        bf_lo(wv.z), bf_hi(wv.z), bf_lo(wv.w), bf_hi(wv.w)};
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const uint4 xv = xs[n * c8 + c];
        float a = acc[n];
        a = fmaf(w[0], bf_lo(xv.x), a);
        a = fmaf(w[1], bf_hi(xv.x), a);
        a = fmaf(w[2], bf_lo(xv.y), a);
        a = fmaf(w[3], bf_hi(xv.y), a);
        a = fmaf(w[4], bf_lo(xv.z), a);
        a = fmaf(w[5], bf_hi(xv.z), a);
        a = fmaf(w[6], bf_lo(xv.w), a);
        a = fmaf(w[7], bf_hi(xv.w), a);
        acc[n] = a;
    }
}

template <int N>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ x, const bf16* __restrict__ w, void* y, u32 in,
                                          u32 out, u32 out_f32) {
    extern __shared__ uint4 xs[];  // [N][in / 8]
    const u32 c8 = in / 8;
    for (u32 i = threadIdx.x; i < N * c8; i += blockDim.x) xs[i] = reinterpret_cast<const uint4*>(x)[i];
    __syncthreads();
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    for (u32 o0 = (blockIdx.x * wpb + warp) * 2; o0 < out; o0 += gridDim.x * wpb * 2) {
        const u32 o1 = min(o0 + 1, out - 1);
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (u64)o0 * in);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (u64)o1 * in);
        float a0[N], a1[N];
#pragma unroll
        for (int n = 0; n < N; ++n) a0[n] = a1[n] = 0.0f;
        u32 c = lane;
        for (; c + 96 < c8; c += 128) {
            uint4 p[4], q[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                p[u] = ld_stream(w0 + c + 32 * u);
                q[u] = ld_stream(w1 + c + 32 * u);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                gemv_dot<N>(a0, p[u], xs, c8, c + 32 * u);
                gemv_dot<N>(a1, q[u], xs, c8, c + 32 * u);
            }
        }
        for (; c < c8; c += 32) {
            gemv_dot<N>(a0, ld_stream(w0 + c), xs, c8, c);
            gemv_dot<N>(a1, ld_stream(w1 + c), xs, c8, c);
        }
#pragma unroll
        for (int n = 0; n < N; ++n) {
            a0[n] = warp_sum(a0[n]);
            a1[n] = warp_sum(a1[n]);
        }
        if (lane < N) {
            // Lane n writes batch row n (registers indexed by a constant in each branch).
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
            for (int n = 0; n < N; ++n)
                if (lane == (u32)n) {
                    v0 = a0[n];
                    v1 = a1[n];
                }
            const u64 i0 = (u64)lane * out + o0, i1 = (u64)lane * out + o1;
            if (out_f32) {
                reinterpret_cast<float*>(y)[i0] = v0;
                if (o1 != o0) reinterpret_cast<float*>(y)[i1] = v1;
            } else {
                reinterpret_cast<bf16*>(y)[i0] = f2bf(v0);
                if (o1 != o0) reinterpret_cast<bf16*>(y)[i1] = f2bf(v1);
            }
        }
    }
}

#define GEMV_ENTRY(NAME, N)                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        NAME(const bf16* x, const bf16* w, void* y, u32 in, u32 out, u32 out_f32) {                 \
        gemv_impl<N>(x, w, y, in, out, out_f32);                                                    \
    }
GEMV_ENTRY(gemv_bf16_n1, 1)
GEMV_ENTRY(gemv_bf16_n2, 2)
GEMV_ENTRY(gemv_bf16_n3, 3)
GEMV_ENTRY(gemv_bf16_n4, 4)
GEMV_ENTRY(gemv_bf16_n5, 5)
GEMV_ENTRY(gemv_bf16_n6, 6)
GEMV_ENTRY(gemv_bf16_n7, 7)
GEMV_ENTRY(gemv_bf16_n8, 8)
