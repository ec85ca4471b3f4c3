// gemv.cu: y[b, o] = sum_i x[b, i] w[o, i] for a few rows b (decode at small batch), bf16 in,
// f32 accumulate, bf16 or f32 out. Streams the weights once at the memory's rate: each block
// takes GEMV_GR output rows and its 8 warps split the input dimension (thread t reads 16-byte
// chunks t, t + 256, ... of every row, two per row in flight per iteration), the N input rows
// come through the read-only cache, and the block sums its partials in shared memory.
// in % 8 == 0. grid (ceil(out / GEMV_GR)), block 256.
#define GEMV_GR 4

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float a) {
    a = fmaf(bf_lo(w.x), bf_lo(x.x), a);
    a = fmaf(bf_hi(w.x), bf_hi(x.x), a);
    a = fmaf(bf_lo(w.y), bf_lo(x.y), a);
    a = fmaf(bf_hi(w.y), bf_hi(x.y), a);
    a = fmaf(bf_lo(w.z), bf_lo(x.z), a);
    a = fmaf(bf_hi(w.z), bf_hi(x.z), a);
    a = fmaf(bf_lo(w.w), bf_lo(x.w), a);
    a = fmaf(bf_hi(w.w), bf_hi(x.w), a);
    return a;
}

template <int N>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ x, const bf16* __restrict__ w, void* y, u32 in,
                                          u32 out, u32 out_f32) {
    __shared__ float red[8][GEMV_GR * N];
    const u32 c8 = in / 8, o0 = blockIdx.x * GEMV_GR;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wr[GEMV_GR];
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r) wr[r] = reinterpret_cast<const uint4*>(w + (u64)min(o0 + r, out - 1) * in);
    float acc[GEMV_GR][N];
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r)
#pragma unroll
        for (int n = 0; n < N; ++n) acc[r][n] = 0.0f;
    u32 c = threadIdx.x;
    for (; c + 256 < c8; c += 512) {
        uint4 a[GEMV_GR], b[GEMV_GR];
#pragma unroll
        for (int r = 0; r < GEMV_GR; ++r) {
            a[r] = ld_stream(wr[r] + c);
            b[r] = ld_stream(wr[r] + c + 256);
        }
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const uint4 xa = __ldg(xv + n * c8 + c), xb = __ldg(xv + n * c8 + c + 256);
#pragma unroll
            for (int r = 0; r < GEMV_GR; ++r) acc[r][n] = dot8(b[r], xb, dot8(a[r], xa, acc[r][n]));
        }
    }
    if (c < c8) {
        uint4 a[GEMV_GR];
#pragma unroll
        for (int r = 0; r < GEMV_GR; ++r) a[r] = ld_stream(wr[r] + c);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const uint4 xa = __ldg(xv + n * c8 + c);
#pragma unroll
            for (int r = 0; r < GEMV_GR; ++r) acc[r][n] = dot8(a[r], xa, acc[r][n]);
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_GR; ++r)
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const float v = warp_sum(acc[r][n]);
            if (lane == 0) red[warp][r * N + n] = v;
        }
    __syncthreads();
    if (threadIdx.x < GEMV_GR * N) {
        const u32 r = threadIdx.x / N, n = threadIdx.x % N, o = o0 + r;
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) v += red[k][threadIdx.x];
        if (o < out) {
            const u64 i = (u64)n * out + o;
            if (out_f32)
                reinterpret_cast<float*>(y)[i] = v;
            else
                reinterpret_cast<bf16*>(y)[i] = f2bf(v);
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

