// common.cuh: types, conversions, warp/block reductions and the mma/ldmatrix/cp.async
// wrappers shared by every slowfast kernel. Prepended to each .cu file before NVRTC.
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;
typedef __nv_bfloat16 bf16;

#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }

// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute may start
// while the kernel before it in the stream is finishing: pdl_wait() blocks until that grid has
// completed and its writes are visible (a no-op after a plain launch), pdl_trigger() lets the
// next kernel launch. Every kernel kernels.rs is_pdl_kernel() names calls pdl_wait() before it
// reads anything an earlier kernel wrote and before it writes anything; before the wait it may
// only read constant data (weights).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// Step tracing (compiled in only with -DSLOWFAST_TRACE, which SLOWFAST_TRACE asks for; see
// src/trace.rs). Thread 0 of block 0 of every PDL kernel records its grid's launch number, the
// global timer before and after its pdl_wait(), the call site (file index << 16 | line) and its
// grid size, in record slot (launch number % SF_TRACE_CAP): no atomics, and nothing after the
// wait but stores. A graph's kernel keeps its launch number over replays, so a replay writes
// over the one before. The host lays a step out from these: a kernel's wait returns when the
// kernel before it has finished, so the time between two consecutive kernels' wait returns is
// what the earlier one costs the step with every overlap in place.
#ifdef SLOWFAST_TRACE
#define SF_TRACE_CAP 16384
__constant__ u64* sf_trace_buf;  // [SF_TRACE_CAP records of 4 u64]
__device__ __forceinline__ u64 sf_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void sf_traced_wait(u32 site) {
    const bool lead = (threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0;
    const u64 t0 = lead ? sf_globaltimer() : 0;
    pdl_wait();
    if (lead && sf_trace_buf != nullptr) {
        const u64 t1 = sf_globaltimer();
        u64 grid;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
        u64* r = sf_trace_buf + 4 * (grid % SF_TRACE_CAP);
        r[0] = grid;
        r[1] = t0;
        r[2] = t1;
        r[3] = ((u64)(gridDim.x * gridDim.y * gridDim.z) << 32) | site;
    }
}
#define pdl_wait() sf_traced_wait((SF_FILE << 16) | __LINE__)
#endif
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : 0.0f;
    r = warp_sum(r);
    return r;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : NEG_INF;
    r = warp_max(r);
    return r;
}

// The GLU activations (SwiGLU's SiLU, GeGLU's tanh-approximated GELU).
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x)));
}

// The two bf16 of a packed word as floats (element 0 in the low half).
__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}
// The 8 elements of a 16-byte bf16 chunk as floats, in element order, and back (rounded).
__device__ __forceinline__ void unpack8(uint4 v, float* e) {
    e[0] = bf_lo(v.x); e[1] = bf_hi(v.x); e[2] = bf_lo(v.y); e[3] = bf_hi(v.y);
    e[4] = bf_lo(v.z); e[5] = bf_hi(v.z); e[6] = bf_lo(v.w); e[7] = bf_hi(v.w);
}
__device__ __forceinline__ uint4 pack8(const float* e) {
    return make_uint4(pack_bf16x2(e[0], e[1]), pack_bf16x2(e[2], e[3]), pack_bf16x2(e[4], e[5]),
                      pack_bf16x2(e[6], e[7]));
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
// D[16x8] += A[16x16] * B[16x8], bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// One 32-wide k slice of the tensor-core GEMVs (gemv_mma_impl, gemv_tma_bench): a and b hold
// 16-byte chunk t of the slice from A rows g and g + 8, x the same chunk of input row g (B's
// column g); elements 0-3 of each chunk go to the first k16 step and 4-7 to the second, as the
// fragment positions (2t, 2t + 1, 2t + 8, 2t + 9). The k order is permuted, the sum is not.
__device__ __forceinline__ void mma_k32_slice(float* acc, uint4 a, uint4 b, uint4 x) {
    const u32 a0[4] = {a.x, b.x, a.y, b.y};
    const u32 b0[2] = {x.x, x.y};
    mma_16816(acc, a0, b0);
    const u32 a1[4] = {a.z, b.z, a.w, b.w};
    const u32 b1[2] = {x.z, x.w};
    mma_16816(acc, a1, b1);
}
__device__ __forceinline__ void ldmatrix_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// 16-byte async copy global->shared; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async_16(u32 saddr, const void* gptr, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gptr),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// fp8 KV (e4m3: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; largest 448, no infinity).
// Plain integer arithmetic (no sm_89 cvt), so every architecture compiles it. The caches hold no
// scale: the model's per-layer / per-head power-of-two scales are folded into its weights
// (model.rs calibrate_fp8), so a stored value is the key or value itself.
// bf16 bits of one e4m3 byte (exact: e4m3 is a subset of bf16).
__device__ __forceinline__ u32 fp8_bf16_bits(u32 x) {
    const u32 s = (x & 0x80u) << 8, em = x & 0x7fu;
    if (em >= 8u) return s | ((em << 4) + (120u << 7));         // normal: rebias 7 -> 127
    return s | (__float_as_uint((float)em * 0.001953125f) >> 16);  // subnormal m * 2^-9, or 0
}
__device__ __forceinline__ float fp82f(unsigned char x) { return __uint_as_float(fp8_bf16_bits(x) << 16); }
// e4m3 byte of f: round to nearest even, saturating to +-448 (NaN saturates too).
__device__ __forceinline__ unsigned char f2fp8(float f) {
    const u32 s = (__float_as_uint(f) >> 24) & 0x80u;
    const float a = fminf(fabsf(f), 448.0f);
    if (a < 0.015625f) return (unsigned char)(s | __float2uint_rn(a * 512.0f));  // 8 -> 2^-6
    u32 b = __float_as_uint(a);
    b += 0x7ffffu + ((b >> 20) & 1u);
    return (unsigned char)(s | ((((b >> 23) - 120u) << 3) | ((b >> 20) & 7u)));
}
// Two e4m3 bytes, at bits 0-7 and 16-23 of `two`, -> a bf16 pair: the sign to bit 15 and the
// exponent and mantissa to bits 4-14 read as a bf16 of the same bits, whose value is the e4m3
// value times 2^-120 (subnormal e4m3 codes land on bf16 subnormals: m/8 * 2^-126), then one
// packed multiply by 2^120 (exact). Run 116 widened each byte alone (about 8 integer operations
// with a branch an element), which bound the fp8 flash-decoding kernels.
__device__ __forceinline__ u32 fp8x2_bf16x2(u32 two) {
    const u32 bits = ((two & 0x00800080u) << 8) | ((two & 0x007f007fu) << 4);
    const __nv_bfloat162 p120 = __halves2bfloat162(__ushort_as_bfloat16(0x7b80), __ushort_as_bfloat16(0x7b80));
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), p120);
    return *reinterpret_cast<const u32*>(&v);
}
// Four e4m3 bytes of a word -> two words of bf16 pairs (element order kept).
__device__ __forceinline__ void fp8x4_bf16(u32 w, u32& lo, u32& hi) {
    lo = fp8x2_bf16x2(__byte_perm(w, 0u, 0x4140));
    hi = fp8x2_bf16x2(__byte_perm(w, 0u, 0x4342));
}
// A shared K/V tile of BK rows of stride D + 8 bf16 whose e4m3 bytes were copied into the upper
// D bytes of each row (from byte D + 16, as fp8_row_dst places them): converted to bf16 in place,
// so the bf16 code after it runs unchanged. Every one of the block's NTH threads calls it (two
// barriers: all bytes are read into registers before any row is overwritten).
__device__ __forceinline__ const unsigned char* fp8_in_row(const bf16* row, int D, int c16) {
    return reinterpret_cast<const unsigned char*>(row) + D + 16 + c16 * 16;
}
__device__ __forceinline__ u32 fp8_row_dst(const bf16* row, int D, int c16) { return smem_addr(fp8_in_row(row, D, c16)); }
template <int D, int BK, int NTH>
__device__ __forceinline__ void fp8_tiles_to_bf16(bf16* kt, bf16* vt) {
    constexpr int C = D / 16, N = BK * C, PER = (N + NTH - 1) / NTH, STR = D + 8;
    uint4 rk[PER], rv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int idx = threadIdx.x + i * NTH, r = idx / C, c = idx % C;
        if (idx < N) {
            rk[i] = *reinterpret_cast<const uint4*>(fp8_in_row(kt + r * STR, D, c));
            rv[i] = *reinterpret_cast<const uint4*>(fp8_in_row(vt + r * STR, D, c));
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int idx = threadIdx.x + i * NTH, r = idx / C, c = idx % C;
        if (idx < N) {
            uint4 a, b;
            fp8x4_bf16(rk[i].x, a.x, a.y);
            fp8x4_bf16(rk[i].y, a.z, a.w);
            fp8x4_bf16(rk[i].z, b.x, b.y);
            fp8x4_bf16(rk[i].w, b.z, b.w);
            *reinterpret_cast<uint4*>(kt + r * STR + c * 16) = a;
            *reinterpret_cast<uint4*>(kt + r * STR + c * 16 + 8) = b;
            fp8x4_bf16(rv[i].x, a.x, a.y);
            fp8x4_bf16(rv[i].y, a.z, a.w);
            fp8x4_bf16(rv[i].z, b.x, b.y);
            fp8x4_bf16(rv[i].w, b.z, b.w);
            *reinterpret_cast<uint4*>(vt + r * STR + c * 16) = a;
            *reinterpret_cast<uint4*>(vt + r * STR + c * 16 + 8) = b;
        }
    }
    __syncthreads();
}

// RoPE angles of one position: cos / sin of pos * inv_freq[i] for i < half (f64, cast to float),
// into cs[0][i] / cs[1][i]; threads of a block share the loop. The caller synchronises.
__device__ __forceinline__ void rope_angles(u32 pos, const double* __restrict__ inv_freq, u32 half, float (*cs)[128]) {
    for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
        const double ang = (double)pos * inv_freq[i];
        double sn, cn;
        sincos(ang, &sn, &cn);
        cs[0][i] = (float)cn;
        cs[1][i] = (float)sn;
    }
}

// One head after the q/k/v projection, by one warp: the per-head RMSNorm (when nw is given;
// head_rmsnorm_bf16's arithmetic and rounding) and NeoX RoPE of the first 2 * half dims
// (rope_neox_bf16's), leaving the bf16-exact results in buf [hd] (the warp's shared memory;
// the caller rounds them to bf16). hd <= 256, a multiple of 32.
__device__ __forceinline__ void qk_head_post(const bf16* __restrict__ x, const float* __restrict__ nw, float eps,
                                             u32 hd, u32 half, const float (*cs)[128], float* buf, u32 lane) {
    float vals[8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 c = lane + 32 * j;
        vals[j] = c < hd ? bf2f(x[c]) : 0.0f;
        ss += vals[j] * vals[j];
    }
    if (nw != nullptr) {
        ss = warp_sum(ss);
        const float scale = rsqrtf(ss / (float)hd + eps);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 c = lane + 32 * j;
            if (c < hd) vals[j] = bf2f(f2bf(vals[j] * scale * nw[c]));
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 c = lane + 32 * j;
        if (c < hd) buf[c] = vals[j];
    }
    __syncwarp();
    for (u32 i = lane; i < half; i += 32) {
        const float c = cs[0][i], s = cs[1][i];
        const float x1 = buf[i], x2 = buf[i + half];
        buf[i] = bf2f(f2bf(x1 * c - x2 * s));
        buf[i + half] = bf2f(f2bf(x2 * c + x1 * s));
    }
    __syncwarp();
}
