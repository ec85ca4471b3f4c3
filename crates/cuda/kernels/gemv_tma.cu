// gemv_tma.cu: an experiment for cuda_bench (`gemvt`), not used by the decoder. y[n, o] =
// sum_i x[n, i] w[o, i] for n < n_rows <= 8, f32 out, with the weights brought into shared memory
// by 2-D tensor copies (TMA), one 16-row x 256-input box (8 KiB) a copy.
//
// The question it answers (docs/gpu-notes.md, runs 71-75): the stream-K GEMV fed by 1-D bulk
// copies read at ~3 us a 32 KiB stage whatever the ring depth (512-byte copies: 64 a stage,
// 2 KiB copies: 16), as if a SM kept only a few copies in flight. With 8 KiB a copy, does the
// same kind of ring stream at the copy rate?
// Block: 16 output rows (the mma's A rows), 4 warps; the weights of those rows stream through a
// TMA_STAGES-deep ring of boxes, TMA_STAGES - 1 in flight while one is multiplied; warp w takes
// inputs 64w .. 64w + 63 of each box (two 32-wide slices, gemv_mma_impl's permuted k), and the
// warps' sums are added in shared memory at the end. The box lands densely (rows 512 bytes
// apart): the fragment loads of rows g and g + 1 share banks (2-way conflicts, accepted).
// Rows past `out` and inputs past `in` are zero-filled by the copy. tmap: a CUtensorMap in global
// memory over w as {in, out} bf16 (row stride in * 2 bytes), box {256, 16}, no swizzle.
// grid (ceil(out / 16)), block 128, dynamic shared memory TMA_SMEM; sm_90+.
#define TMA_STAGES 4
#define TMA_BOX_K 256
#define TMA_BOX_R 16
#define TMA_SMEM (TMA_STAGES * TMA_BOX_R * TMA_BOX_K * 2 + 8 * TMA_STAGES)

extern "C" __global__ void __launch_bounds__(128)
    gemv_tma_bench(const unsigned char* __restrict__ tmap, const bf16* __restrict__ x, float* __restrict__ y,
                   u32 n_rows, u32 in, u32 out) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char tm_smem[];
    __shared__ float red[4][16][8];
    const bf16* ring = reinterpret_cast<const bf16*>(tm_smem);
    const u32 ring0 = smem_addr(tm_smem);
    const u32 bar0 = ring0 + TMA_STAGES * TMA_BOX_R * TMA_BOX_K * 2;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 o0 = blockIdx.x * TMA_BOX_R, c8 = in / 8;
    const u32 stages = (in + TMA_BOX_K - 1) / TMA_BOX_K;
    const u64 tm = reinterpret_cast<u64>(tmap);
    auto issue = [&](u32 st) {
        const u32 s = st % TMA_STAGES, bar = bar0 + 8 * s;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                     "r"((u32)(TMA_BOX_R * TMA_BOX_K * 2))
                     : "memory");
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
            "[%4];\n" ::"r"(ring0 + s * TMA_BOX_R * TMA_BOX_K * 2),
            "l"(tm), "r"((int)(st * TMA_BOX_K)), "r"((int)o0), "r"(bar)
            : "memory");
    };
    if (threadIdx.x == 0) {
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(tm) : "memory");
        for (int s = 0; s < TMA_STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + 8 * s));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // The weights are constant: the first boxes before the wait.
    if (threadIdx.x == 0) {
        for (u32 st = 0; st < TMA_STAGES - 1 && st < stages; ++st) issue(st);
    }
    pdl_wait();
    pdl_trigger();
    const bool has_x = g < n_rows;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 st = 0; st < stages; ++st) {
        // Every warp is done with the slot stage st - 1 used: refill it.
        __syncthreads();
        if (threadIdx.x == 0 && st + TMA_STAGES - 1 < stages) issue(st + TMA_STAGES - 1);
        uint4 xv[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const u32 c = st * (TMA_BOX_K / 8) + 8 * warp + 4 * q + t;
            xv[q] = has_x && c < c8 ? __ldg(xs + g * c8 + c) : make_uint4(0, 0, 0, 0);
        }
        const u32 s = st % TMA_STAGES, parity = (st / TMA_STAGES) & 1;
        u32 ok = 0;
        while (!ok) {
            asm volatile(
                "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(ok)
                : "r"(bar0 + 8 * s), "r"(parity)
                : "memory");
        }
        const bf16* ra = ring + s * TMA_BOX_R * TMA_BOX_K + g * TMA_BOX_K + 64 * warp;
        const bf16* rb = ra + 8 * TMA_BOX_K;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const uint4 a = *reinterpret_cast<const uint4*>(ra + (4 * q + t) * 8);
            const uint4 b = *reinterpret_cast<const uint4*>(rb + (4 * q + t) * 8);
            mma_k32_slice(acc, a, b, xv[q]);
        }
    }
    red[warp][g][2 * t] = acc[0];
    red[warp][g][2 * t + 1] = acc[1];
    red[warp][g + 8][2 * t] = acc[2];
    red[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    const u32 r = threadIdx.x >> 3, n = threadIdx.x & 7, o = o0 + r;
    if (o < out && n < n_rows) y[(u64)n * out + o] = red[0][r][n] + red[1][r][n] + red[2][r][n] + red[3][r][n];
#else
    __trap();  // the host runs it on sm_90+ only
#endif
}
