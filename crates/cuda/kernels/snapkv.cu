// snapkv.cu: SnapKV's (and PyramidKV's) one-shot selection at the end of prefill on the GPU
// (the CPU policy is crates/kv/src/snapkv.rs, its arithmetic score.rs: accumulate_probs,
// max_pool, group_sum, snap_keep). For one global layer of one sequence of L prompt tokens
// whose last `rows` rows were captured (the observation window, w = rows):
//   snap_rowstats  per (row, query head): max and 1 / sum of 2^(z - max) over the keys the row sees
//   snap_colsum    per (query head, key j < n = L - w): the softmax probabilities summed over the rows
//   snap_pool      per (kv head, key j < n): max-pooled probabilities summed over the GQA group, as
//                  the f64 scores sfi_topk ranks (its ties: lower position first, as top_k's)
// then sfi_topk keeps the top k = capacity - w a kv head and sfi_gather copies them into the
// compact buffer (the window and the decoded tokens after it are read in place).
// Logits: attn_sparse_decode_*'s capture, logits[r, head, j] (row stride lstride), log2 units;
// row r sees keys j < len0 + r. Every sum runs in the CPU's order (rows, then the group's heads).

// stats[r, h] = (m, 1 / sum): m = -inf (and 0) for a row that sees nothing. grid (rows, n_heads),
// block 256.
extern "C" __global__ void snap_rowstats(const float* __restrict__ logits, float2* __restrict__ stats, u32 n_heads,
                                         u32 lstride, u32 len0) {
    __shared__ float scratch[32];
    const u32 r = blockIdx.x, h = blockIdx.y, len = len0 + r;
    const float* z = logits + ((u64)r * n_heads + h) * lstride;
    float m = NEG_INF;
    for (u32 j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, z[j]);
    m = block_max(m, scratch);
    float s = 0.0f;
    if (m != NEG_INF)
        for (u32 j = threadIdx.x; j < len; j += blockDim.x) s += exp2f(z[j] - m);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) stats[(u64)r * n_heads + h] = make_float2(m, m == NEG_INF ? 0.0f : 1.0f / s);
}

// probs[h, j] = sum over rows r of 2^(z[r, h, j] - m[r, h]) / sum[r, h], for j < n (keys every row
// sees). grid (ceil(n / 256), n_heads), block 256.
extern "C" __global__ void snap_colsum(const float* __restrict__ logits, const float2* __restrict__ stats,
                                       float* __restrict__ probs, u32 n_heads, u32 rows, u32 lstride, u32 n) {
    const u32 h = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float acc = 0.0f;
    for (u32 r = 0; r < rows; ++r) {
        const float2 st = stats[(u64)r * n_heads + h];
        if (st.x == NEG_INF) continue;
        acc += exp2f(logits[((u64)r * n_heads + h) * lstride + j] - st.x) * st.y;
    }
    probs[(u64)h * n + j] = acc;
}

// scores[kvh, j] = sum over the group's query heads g of max(probs[kvh * G + g, i]) for
// |i - j| <= half, 0 <= i < n; cnt[kvh] = n. grid (ceil(n / 256), kv_heads), block 256.
extern "C" __global__ void snap_pool(const float* __restrict__ probs, double* __restrict__ scores,
                                     u32* __restrict__ cnt, u32 G, u32 n, u32 half) {
    const u32 kvh = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) cnt[kvh] = n;
    if (j >= n) return;
    const u32 a = j >= half ? j - half : 0, b = min(n, j + half + 1);
    float s = 0.0f;
    for (u32 g = 0; g < G; ++g) {
        const float* p = probs + (u64)(kvh * G + g) * n;
        float m = NEG_INF;
        for (u32 i = a; i < b; ++i) m = fmaxf(m, p[i]);
        s += m;
    }
    scores[(u64)kvh * n + j] = (double)s;
}

// FastKV's token choice (the CPU's Model::tsp_select): the pooled scores of every kv head summed
// into row 0, scores[0, j] = sum over kv heads h of scores[h, j] (in place: thread j alone reads
// and writes column j); cnt[0] = n. grid (ceil(n / 256)), block 256.
extern "C" __global__ void snap_head_sum(double* __restrict__ scores, u32* __restrict__ cnt, u32 kv_heads, u32 n) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) cnt[0] = n;
    if (j >= n) return;
    double s = 0.0;
    for (u32 h = 0; h < kv_heads; ++h) s += scores[(u64)h * n + j];
    scores[j] = s;
}
