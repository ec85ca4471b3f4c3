// sampling.cu: greedy argmax and seeded top-p (nucleus) sampling over f32 logits [rows, vocab].
// Both use one block of SAMPLE_THREADS threads per row.
#define SAMPLE_THREADS 1024

// splitmix64; the uniform draw of a row is (splitmix64(seed) >> 40) * 2^-24 in [0, 1).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// out[r] = argmax_i logits[r, i]; ties go to the lowest index; NaN never wins.
// Row r is split over gridDim.x blocks; each writes its (best, index) to scratch, and the last
// block of the row to finish (a per-row counter) merges them, writes out[r] and resets the
// counter for the next launch. scratch: [cnt_rows] counters (zero between launches; a fixed
// region, ARGMAX_MAX_ROWS on the host, so a launch of more rows than the last one never takes
// that one's pairs for counters), then [rows][gridDim.x] (value bits, index) pairs. grid
// (blocks a row, rows), block 256.
__device__ __forceinline__ void argmax_merge(float& best, u32& bi, float ov, u32 oi) {
    if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
}
extern "C" __global__ void __launch_bounds__(256) argmax_f32(const float* __restrict__ logits, u32* __restrict__ out,
                                                             u32 vocab, u32* __restrict__ scratch,
                                                             u32 cnt_rows) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    __shared__ bool last;
    pdl_wait();
    pdl_trigger();
    const u32 row = blockIdx.y, nb = gridDim.x;
    const u32 per = (vocab + nb - 1) / nb, lo = blockIdx.x * per, hi = min(vocab, lo + per);
    const float* x = logits + (u64)row * vocab;
    float best = NEG_INF;
    u32 bi = 0xffffffffu;
    for (u32 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = x[i];
        if (v > best || (bi == 0xffffffffu && v == v)) { best = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    u32* cnt = scratch + row;
    u32* part = scratch + cnt_rows + (u64)row * nb * 2;
    if (warp == 0) {
        const u32 nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : 0xffffffffu;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            argmax_merge(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
        if (lane == 0) {
            part[2 * blockIdx.x] = __float_as_uint(best);
            part[2 * blockIdx.x + 1] = bi;
            __threadfence();
            last = atomicAdd(cnt, 1u) == nb - 1;
        }
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    best = NEG_INF;
    bi = 0xffffffffu;
    for (u32 j = lane; j < nb; j += 32) argmax_merge(best, bi, __uint_as_float(__ldcg(part + 2 * j)), __ldcg(part + 2 * j + 1));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0) {
        out[row] = bi == 0xffffffffu ? 0u : bi;
        *cnt = 0u;
    }
}

// Nucleus sampling. With e_i = exp((x_i - max) / T) and Z = sum e_i, the nucleus is
// {i : e_i >= t} for the largest t whose nucleus mass reaches top_p * Z (ties at t all
// included). t is found exactly by a 4-pass radix select on the f32 bits of e_i with
// mass-weighted 256-bin histograms. The token is then the first index (in vocab order)
// at which the running nucleus mass exceeds u * mass, u = uniform(seeds[row]).
// logits [rows, vocab], seeds [rows], out [rows]. block SAMPLE_THREADS.
extern "C" __global__ void sample_top_p_f32(const float* __restrict__ logits, const u64* __restrict__ seeds,
                                            u32* __restrict__ out, u32 vocab, float temperature,
                                            float top_p) {
    __shared__ float scratch[32];
    __shared__ float hist[256];
    __shared__ float chunk_mass[SAMPLE_THREADS];
    __shared__ u32 s_prefix;
    __shared__ float s_above;
    const float* x = logits + (u64)blockIdx.x * vocab;
    const float inv_t = 1.0f / temperature;

    float m = NEG_INF;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, x[i]);
    m = block_max(m, scratch);
    float z = 0.0f;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) z += __expf((x[i] - m) * inv_t);
    z = block_sum(z, scratch);
    const float target = top_p * z;

    u32 prefix = 0, mask = 0;
    float above = 0.0f;  // mass of elements whose key is above the current prefix range
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.0f;
        __syncthreads();
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float e = __expf((x[i] - m) * inv_t);
            const u32 key = __float_as_uint(e);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], e);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = above;
            int b = 255;
            for (; b > 0; --b) {
                if (acc + hist[b] >= target) break;
                acc += hist[b];
            }
            // b == 0 here either reaches the target or holds everything that is left.
            s_prefix = prefix | ((u32)b << shift);
            s_above = acc;
        }
        __syncthreads();
        prefix = s_prefix;
        above = s_above;
        mask |= 255u << shift;
    }
    const u32 t_key = prefix;

    // Running mass in vocab order over contiguous per-thread chunks.
    const u32 chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const u32 lo = threadIdx.x * chunk;
    const u32 hi = min(vocab, lo + chunk);
    float my = 0.0f;
    for (u32 i = lo; i < hi; ++i) {
        const float e = __expf((x[i] - m) * inv_t);
        if (__float_as_uint(e) >= t_key) my += e;
    }
    chunk_mass[threadIdx.x] = my;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (u32 c = 0; c < blockDim.x; ++c) total += chunk_mass[c];
        const float u = (float)(splitmix64(seeds[blockIdx.x]) >> 40) * (1.0f / 16777216.0f);
        const float r = u * total;
        float acc = 0.0f;
        u32 pick = 0xffffffffu, last = 0;
        for (u32 c = 0; c < blockDim.x && pick == 0xffffffffu; ++c) {
            if (chunk_mass[c] > 0.0f && acc + chunk_mass[c] > r) {
                const u32 clo = c * chunk, chi = min(vocab, clo + chunk);
                for (u32 i = clo; i < chi; ++i) {
                    const float e = __expf((x[i] - m) * inv_t);
                    if (__float_as_uint(e) < t_key) continue;
                    last = i;
                    acc += e;
                    if (acc > r) { pick = i; break; }
                }
                if (pick == 0xffffffffu) pick = last;  // rounding: stay inside this chunk
            } else {
                acc += chunk_mass[c];
                if (chunk_mass[c] > 0.0f) last = min(vocab - 1, (c + 1) * chunk - 1);
            }
        }
        if (pick == 0xffffffffu) {
            // r at or past the total through rounding: take the last nucleus token.
            for (u32 i = vocab; i-- > 0;) {
                if (__float_as_uint(__expf((x[i] - m) * inv_t)) >= t_key) { pick = i; break; }
            }
        }
        out[blockIdx.x] = pick == 0xffffffffu ? 0u : pick;
    }
}
