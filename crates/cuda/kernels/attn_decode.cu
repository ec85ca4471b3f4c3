// attn_decode.cu: flash-decoding. Each block takes one (sequence, kv head, split) and a
// chunk of that sequence's keys, computes the G query heads of the kv group on tensor
// cores (the group's heads are the 16 rows of the mma, so every K/V byte is loaded once
// per group), and writes an unnormalised partial (O, max, sum). attn_decode_reduce
// merges the splits. K/V tiles stream through a STAGES-deep cp.async pipeline.
#define DEC_THREADS 128
#define DEC_BK 64

// q [batch, n_heads, D]; caches [num_slots, kv_heads, capacity, D]; seq_lens, slots [batch];
// part_o [batch, n_heads, splits, D] f32; part_ml [batch, n_heads, splits, 2] f32 (max in
// log2 units of the scaled score, sum). Sequence b sees keys [lo, len) with
// lo = window ? max(0, len - window) : 0; split s covers [lo + s*chunk, lo + (s+1)*chunk),
// the last split up to len; chunk 0: split s covers [lo + s*per, lo + (s+1)*per), per =
// ceil((len - lo) / splits), computed on the device at every step.
// grid (splits, kv_heads * ceil(G / 16), batch), block 128,
// dynamic smem (16 + 2 * STAGES * 64) * (D + 8) * 2 bytes.
// SPARSE (attn_sparse_decode_*): sequence b reads a virtual sequence of vlen = c + (len - rlo)
// keys: rows [0, c) of its compact buffer (sinks + Selector-chosen keys, [num_slots, kv_heads,
// ccap, D], c = clen[b]) followed by its cache rows [rlo, len) read in place (rlo = rstart[b],
// raised to len - rwin when rwin > 0: a sliding recent window). c = 0, rlo = 0 is dense. The
// chunk is per sequence (vlen over the splits), so a dense and a sparse sequence share a launch.
// With logits != null and capture[b] != 0 the row attends densely (c = 0, rlo = 0) and the scaled
// scores (log2 units) of every key go to logits[capture[b] - 1, head, j] (row stride lstride) for
// the Selector: the host numbers the capturing rows 1, 2, ... so the score buffer holds only them.
// PAGE LIST (cidx != null, Quest): the compact rows are read in place from the cache: row j is
// cache row cidx[b, kv head, j / cgran] * cgran + j % cgran (cidx [batch, kv_heads, ccap]), there
// are clen[b] * cgran of them (clen counts list entries), and the recent part starts no lower
// than the newest key's page, (len - 1) / cgran * cgran. The list is written by the kernels just
// before this one, so such a launch waits for them (pdl_wait) before reading anything.
// VIEW (vmeta != null, SFI's cheaper slow step): a capturing row r = capture[b] - 1 whose
// vmeta[r * 8] is set reads, instead of every key, the cache pages of its own list
// vpages[r * vcap ..] (vmeta[r * 8 + 2] entries of vmeta[r * 8 + 1] rows, shared by the kv heads)
// and then [vmeta[r * 8 + 3], len) in place; its scores go to the row's virtual indices, so the
// score row holds the view in order (sfi_cand_* write the list just before: pdl_wait first).
struct SparseArgs {
    const bf16* ck;
    const bf16* cv;
    const u32* clen;
    const u32* rstart;
    u32 ccap, rwin;
    float* logits;
    const u32* capture;
    u32 lstride;
    const u32* cidx;
    u32 cgran;
    const u32* vpages = nullptr;
    const u32* vmeta = nullptr;
    u32 vcap = 0;
};

// POST (attn_decode_post_*, dense): the step's q/k/v projection row goes straight in, and
// the kernel does what qkv_post_bf16 would have done first (one kernel and one launch boundary
// fewer a layer): each block normalises and rotates its query heads from the row into its Q
// tile, and the blocks whose keys include the newest position (positions[b], which must be
// seq_lens[b] - 1) do the same for the new key, take the new value, write both into the cache
// (row group 0) and into their K/V tile in place of the row the tile read. The arithmetic is
// qkv_post_bf16's (qk_head_post), so the results are bit-identical to qkv_post + attn_decode.
// qkv [batch, qkv_stride]: q heads, k heads, v heads; kw / vw: the caches, written.
struct PostArgs {
    const bf16* qkv;
    u32 qkv_stride;
    const float* qn;
    const float* kn;
    float eps;
    const u32* positions;
    u32 rot;
    const double* inv_freq;
    bf16* kw;
    bf16* vw;
};

// VERIFY (attn_verify_*, dense): speculative verification, `rps` query rows per sequence at
// consecutive positions, causal among themselves. Row r of sequence b is q row b * rps + r with
// its own length seq_lens[b * rps + r] (the rows' keys and values are in the cache already);
// the block's keys run from the first row's window start to the last row's length, and each
// row masks what it may not see. The virtual query group is rps x G heads (row-major: r, then
// head), cut into the mma's 16-row groups. A block takes NGB of those groups with 4 warps each
// (blockDim 128 NGB): the warps of a group split a K/V tile's 64 keys as the decode kernel's do,
// and all NGB groups read the one tile in shared memory, so each K/V byte leaves DRAM once for
// up to 16 NGB rows (G = 4, NGB = 3: 12 rows, the target row and 11 drafts). More groups than
// NGB take further block columns. (One group a block and ceil(rps G / 16) blocks a column read
// each tile once a group: verification at 5 rows a sequence cost 1.75x a dense step, run 102.)
// With logits != null, row 0 of a sequence whose capture[slot] is set leaves its scaled scores
// (log2 units) at logits[capture[slot] - 1, head, j], j < its length, for the Selector (SFI's
// slow step).
struct VerifyArgs {
    u32 rps;
    float* logits;
    const u32* capture;
    u32 lstride;
};

template <int D, int STAGES, bool SPARSE, bool POST = false, bool VERIFY = false, int NGB = 1, bool F8 = false>
__device__ __forceinline__ void attn_decode_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                 const bf16* __restrict__ v_cache, const u32* __restrict__ seq_lens,
                                                 const u32* __restrict__ slots, float* __restrict__ part_o,
                                                 float* __restrict__ part_ml, u32 n_heads, u32 kv_heads,
                                                 u32 capacity, u32 num_slots, u32 window, u32 chunk,
                                                 float scale_log2, SparseArgs sp, PostArgs pa = {},
                                                 VerifyArgs va = {1, nullptr, nullptr, 0}) {
    static_assert(NGB == 1 || (VERIFY && !SPARSE && !POST), "several row groups a block: VERIFY only");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr int CH = D / 8, STR = D + 8, DT = D / 8, BK = DEC_BK, NT = DEC_THREADS * NGB;
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);  // [NGB][16][STR]
    bf16* ks = qs + NGB * 16 * STR;                 // [STAGES][BK][STR]
    bf16* vs = ks + STAGES * BK * STR;              // [STAGES][BK][STR]
    // The first K/V tiles stream before pdl_wait() (see the prologue below).

    const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.z;
    const int G = n_heads / kv_heads;
    // VERIFY: R query rows of one sequence (row0 = its first q row); GV virtual group rows.
    const int R = VERIFY ? (int)va.rps : 1;
    const int GV = R * G;
    const int row0 = b * R;
    const int row_groups = (GV + 15) / 16;
    const int bcols = (row_groups + NGB - 1) / NGB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // This warp's row group (of the block's NGB, from rg0) and its quarter of each key tile.
    const int kvh = blockIdx.y / bcols, rg0 = blockIdx.y % bcols * NGB;
    const int wg = warp / 4, kw = warp % 4, rg = rg0 + wg;
    const int g = lane >> 2, tig = lane & 3;
    // The q row and head of virtual group row vr (< GV).
    auto vrow = [&](int vr) { return row0 + vr / G; };
    auto vhead = [&](int vr) { return kvh * G + vr % G; };

    const u32 slot = slots[row0];
    int len = slot < num_slots ? (int)min(seq_lens[row0 + R - 1], capacity) : 0;
    // VERIFY: the visible keys [lim_lo, lim_hi) of this thread's two mma rows (g, g + 8), and
    // where row 0's captured scores go.
    int lim_lo[2] = {0, 0}, lim_hi[2] = {len, len};
    float* vl[2] = {nullptr, nullptr};
    if constexpr (VERIFY) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int vr = min(rg * 16 + g + 8 * i, GV - 1);
            const int r = vr / G;
            lim_hi[i] = slot < num_slots ? (int)min(seq_lens[row0 + r], capacity) : 0;
            lim_lo[i] = window ? max(0, lim_hi[i] - (int)window) : 0;
            if (va.logits != nullptr && r == 0 && rg * 16 + g + 8 * i < GV && slot < num_slots &&
                va.capture[slot] != 0)
                vl[i] = va.logits + ((u64)(va.capture[slot] - 1) * n_heads + vhead(vr)) * va.lstride;
        }
    }
    // Dense: keys [s_lo, s_hi) are cache rows. Sparse: virtual indices (compact rows, then the
    // recent rows from rlo); `n_c` compact rows come first.
    int s_lo, s_hi, n_c = 0, rlo = 0;
    // Keys (cache rows, or the sparse variant's virtual indices) [0, vend): the last is the
    // newest position, the only one the kernel before this one (qkv_post) writes.
    int vend = len;
    float* lrow = nullptr;
    const u32* cpg = nullptr;  // PAGE LIST: this (sequence, kv head)'s list; VIEW: the row's
    int cg = (int)sp.cgran;    // rows a list entry
    if constexpr (SPARSE) {
        if (sp.cidx != nullptr) pdl_wait();
        if (sp.logits != nullptr && sp.capture[b] != 0) {
            // A capturing row attends densely (a slow step): its scores index positions.
            lrow = sp.logits + ((u64)(sp.capture[b] - 1) * n_heads + kvh * G + rg * 16) * sp.lstride;
            if (sp.vmeta != nullptr && sp.vmeta[(u64)(sp.capture[b] - 1) * 8] != 0) {
                // VIEW: the row's page list, then its recent part.
                pdl_wait();
                const u32* m = sp.vmeta + (u64)(sp.capture[b] - 1) * 8;
                cg = (int)m[1];
                cpg = sp.vpages + (u64)(sp.capture[b] - 1) * sp.vcap;
                rlo = (int)min(m[3], (u32)len);
                n_c = min((int)m[2] * cg, rlo);
            }
        } else {
            n_c = slot < num_slots ? (int)min(sp.clen[b], sp.ccap) : 0;
            rlo = (int)min(sp.rstart[b], (u32)len);
            if (sp.rwin) rlo = max(rlo, len - (int)sp.rwin);
            if (sp.cidx != nullptr) {
                cpg = sp.cidx + ((u64)b * kv_heads + kvh) * sp.ccap;
                n_c *= (int)sp.cgran;
                if (len > 0) rlo = max(rlo, (len - 1) / (int)sp.cgran * (int)sp.cgran);
            }
            n_c = min(n_c, rlo);  // compact rows are positions below the recent window
        }
        const int vlen = n_c + len - rlo;
        vend = vlen;
        const int per = (vlen + splits - 1) / splits;
        const int ch = (per + BK - 1) / BK * BK;
        s_lo = split * ch;
        s_hi = min(vlen, s_lo + ch);
    } else {
        // VERIFY: from the first row's window start (its length is the shortest).
        const int lo_len = VERIFY ? (slot < num_slots ? (int)min(seq_lens[row0], capacity) : 0) : len;
        const int lo_seq = window ? max(0, lo_len - (int)window) : 0;
        if (VERIFY || chunk == 0) {
            // Balanced on every step: ceil(n / splits) keys a split, not rounded to the 64-key
            // tiles (a split's last tile may be partial), so the longest split is at most one key
            // longer than the mean whatever the length (a host chunk of 33 tiles for 32K + 1
            // keys left 15 of 16 splits a tile longer than needed).
            const int per = (len - lo_seq + splits - 1) / splits;
            s_lo = lo_seq + split * per;
            s_hi = min(len, s_lo + per);
        } else {
            s_lo = lo_seq + split * (int)chunk;
            // The last split runs to the end, so a max_seq_len below a real length costs
            // balance, not keys.
            s_hi = split == splits - 1 ? len : min(len, s_lo + (int)chunk);
        }
    }

    if (s_lo >= s_hi) {
        pdl_wait();
        pdl_trigger();
        for (int r = threadIdx.x; r < 16 * NGB; r += NT) {
            const int vr = rg0 * 16 + r;
            if (vr >= GV) continue;
            const u64 idx = ((u64)vrow(vr) * n_heads + vhead(vr)) * splits + split;
            part_ml[idx * 2] = NEG_INF;
            part_ml[idx * 2 + 1] = 0.0f;
        }
        return;
    }
    const bf16* kc = k_cache + ((u64)slot * kv_heads + kvh) * capacity * D;
    const bf16* vc = v_cache + ((u64)slot * kv_heads + kvh) * capacity * D;
    const bf16* kcc = nullptr;
    const bf16* vcc = nullptr;
    if constexpr (SPARSE) {
        kcc = cpg ? kc : sp.ck + ((u64)slot * kv_heads + kvh) * sp.ccap * D;
        vcc = cpg ? vc : sp.cv + ((u64)slot * kv_heads + kvh) * sp.ccap * D;
    }
    // The cache row of compact row jj (< n_c): its index, or its place in the page list.
    auto crow = [&](int jj) -> u64 {
        return cpg ? (u64)cpg[jj / cg] * cg + jj % cg : (u64)jj;
    };
    // F8: the caches (and the compact buffers) hold e4m3 bytes, a row D bytes.
    typedef const unsigned char* b8;
    const b8 kc8 = reinterpret_cast<b8>(k_cache) + ((u64)slot * kv_heads + kvh) * capacity * D;
    const b8 vc8 = reinterpret_cast<b8>(v_cache) + ((u64)slot * kv_heads + kvh) * capacity * D;
    b8 kcc8 = nullptr, vcc8 = nullptr;
    if constexpr (SPARSE && F8) {
        kcc8 = cpg ? kc8 : reinterpret_cast<b8>(sp.ck) + ((u64)slot * kv_heads + kvh) * sp.ccap * D;
        vcc8 = cpg ? vc8 : reinterpret_cast<b8>(sp.cv) + ((u64)slot * kv_heads + kvh) * sp.ccap * D;
    }

    const int n_tiles = (s_hi - s_lo + BK - 1) / BK;
    auto load_tile = [&](int t) {
        bf16* kd = ks + (t % STAGES) * BK * STR;
        bf16* vd = vs + (t % STAGES) * BK * STR;
        const int j0 = s_lo + t * BK;
        if constexpr (F8) {
            // 16 e4m3 a copy, into the upper half of the row (fp8_tiles_to_bf16 widens them)
            for (int idx = threadIdx.x; idx < BK * (D / 16); idx += NT) {
                const int r = idx / (D / 16), c = idx % (D / 16), j = j0 + r;
                const bool ok = j < s_hi;
                const int jj = ok ? j : s_lo;
                b8 ksrc = kc8, vsrc = vc8;
                u64 row = jj;
                if constexpr (SPARSE) {
                    const bool cmp = jj < n_c;
                    ksrc = cmp ? kcc8 : kc8;
                    vsrc = cmp ? vcc8 : vc8;
                    row = cmp ? crow(jj) : rlo + jj - n_c;
                }
                cp_async_16(fp8_row_dst(kd + r * STR, D, c), ksrc + row * D + c * 16, ok ? 16u : 0u);
                cp_async_16(fp8_row_dst(vd + r * STR, D, c), vsrc + row * D + c * 16, ok ? 16u : 0u);
            }
            return;
        }
        for (int idx = threadIdx.x; idx < BK * CH; idx += NT) {
            const int r = idx / CH, c = idx % CH, j = j0 + r;
            const bool ok = j < s_hi;
            const int jj = ok ? j : s_lo;
            if constexpr (SPARSE) {
                const bool cmp = jj < n_c;
                const u64 off = (cmp ? crow(jj) : (u64)(rlo + jj - n_c)) * D + c * 8;
                cp_async_16(smem_addr(kd + r * STR + c * 8), (cmp ? kcc : kc) + off, ok ? 16u : 0u);
                cp_async_16(smem_addr(vd + r * STR + c * 8), (cmp ? vcc : vc) + off, ok ? 16u : 0u);
            } else {
                const u64 off = (u64)jj * D + c * 8;
                cp_async_16(smem_addr(kd + r * STR + c * 8), kc + off, ok ? 16u : 0u);
                cp_async_16(smem_addr(vd + r * STR + c * 8), vc + off, ok ? 16u : 0u);
            }
        }
    };
    // The prologue. Under PDL the kernel before (qkv_post) writes q and the cache row of the
    // newest position (len - 1); every kernel before that one has finished when this one starts
    // (each triggers its dependents only after its own wait), so lengths, slots, older cache
    // rows and (sparse) the compact buffers, their lengths and the recent starts (published by
    // earlier kernels of the stream) are final. Tiles wholly below the newest key load before
    // pdl_wait(), hiding their DRAM latency behind the kernel before; the rest of the prologue
    // after it.
    // POST: past the V ring, the token's RoPE angles [2][128], a row buffer a warp [4][256] and
    // the new key and value [2][D] (bf16). The angles before the wait: positions are final
    // (written a step ago; the kernel before this one is the q/k/v projection).
    float(*cs)[128] = reinterpret_cast<float(*)[128]>(vs + STAGES * BK * STR);
    float* hbuf = reinterpret_cast<float*>(cs + 2) + warp * 256;
    bf16* newk = reinterpret_cast<bf16*>(reinterpret_cast<float*>(cs + 2) + 4 * 256);
    bf16* newv = newk + D;
    u32 pos = 0;
    bool has_new = false;
    // The new key's index among this sequence's keys: its position (dense), or the last
    // virtual index (sparse: the recent part runs to len, pos must be len - 1, and the recent
    // part must hold it, rstart[b] < seq_lens[b], as every fast step's does; a row whose recent
    // part is empty would leave the new row unwritten).
    int jnew = 0;
    if constexpr (POST) {
        pos = pa.positions[b];
        rope_angles(pos, pa.inv_freq, pa.rot / 2, cs);
        jnew = SPARSE ? vend - 1 : (int)pos;
        has_new = pos < capacity && slot < num_slots && jnew >= s_lo && jnew < s_hi && (!SPARSE || rlo < len);
    }
    int st = 0;
    for (; st < STAGES - 1 && st < n_tiles && s_lo + (st + 1) * BK <= vend - 1; ++st) {
        load_tile(st);
        cp_async_commit();
    }
    pdl_wait();
    pdl_trigger();
    for (; st < STAGES - 1; ++st) {
        if (st < n_tiles) load_tile(st);
        cp_async_commit();
    }
    // Q after the first K/V requests are in flight; the loop's first barrier publishes it.
    if constexpr (POST) {
        __syncthreads();  // the angles
        const bf16* row = pa.qkv + (u64)b * pa.qkv_stride;
        const u32 half = pa.rot / 2;
        for (int r = warp; r < 16; r += DEC_THREADS / 32) {
            const int hig = rg * 16 + r;
            if (hig < G) {
                qk_head_post(row + (u64)(kvh * G + hig) * D, pa.qn, pa.eps, D, half, cs, hbuf, lane);
                for (int c = lane; c < D; c += 32) qs[r * STR + c] = f2bf(hbuf[c]);
                __syncwarp();
            } else {
                for (int c = lane; c < D; c += 32) qs[r * STR + c] = f2bf(0.0f);
            }
        }
        if (has_new && warp == 0) {
            qk_head_post(row + (u64)(n_heads + kvh) * D, pa.kn, pa.eps, D, half, cs, hbuf, lane);
            const bf16* vrow = row + (u64)(n_heads + kv_heads + kvh) * D;
            const u64 at = (((u64)slot * kv_heads + kvh) * capacity + pos) * D;
            for (int c = lane; c < D; c += 32) {
                newk[c] = f2bf(hbuf[c]);
                newv[c] = vrow[c];
                if constexpr (F8) {
                    const unsigned char k8 = f2fp8(bf2f(newk[c])), v8 = f2fp8(bf2f(newv[c]));
                    newk[c] = f2bf(fp82f(k8));
                    newv[c] = f2bf(fp82f(v8));
                    if (rg == 0) {
                        reinterpret_cast<unsigned char*>(pa.kw)[at + c] = k8;
                        reinterpret_cast<unsigned char*>(pa.vw)[at + c] = v8;
                    }
                } else if (rg == 0) {
                    pa.kw[at + c] = newk[c];
                    pa.vw[at + c] = newv[c];
                }
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < NGB * 16 * CH; idx += NT) {
            const int r = idx / CH, c = idx % CH, vr = rg0 * 16 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (vr < GV) v = *reinterpret_cast<const uint4*>(q + ((u64)vrow(vr) * n_heads + vhead(vr)) * D + c * 8);
            *reinterpret_cast<uint4*>(qs + r * STR + c * 8) = v;
        }
    }

    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.0f, 0.0f};
    float acc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (t + STAGES - 1 < n_tiles) load_tile(t + STAGES - 1);
        cp_async_commit();
        if constexpr (F8) fp8_tiles_to_bf16<D, BK, NT>(ks + (t % STAGES) * BK * STR, vs + (t % STAGES) * BK * STR);
        if constexpr (POST) {
            // The tile holding the new position read the cache row before anyone wrote it:
            // put the new key and value in its place.
            if (has_new && t == (jnew - s_lo) / BK) {
                const int r = jnew - s_lo - t * BK;
                for (int c = threadIdx.x; c < D; c += DEC_THREADS) {
                    ks[(t % STAGES) * BK * STR + r * STR + c] = newk[c];
                    vs[(t % STAGES) * BK * STR + r * STR + c] = newv[c];
                }
                __syncthreads();
            }
        }
        const bf16* kst = ks + (t % STAGES) * BK * STR + kw * 16 * STR;
        const bf16* vst = vs + (t % STAGES) * BK * STR + kw * 16 * STR;
        const int jw = s_lo + t * BK + kw * 16;
        if (jw >= s_hi) continue;  // this warp's 16 keys are all past the end

        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[4], bb[4];
            ldmatrix_x4(a, smem_addr(qs + (wg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STR + kk * 16 + (lane >> 4) * 8));
            ldmatrix_x4(bb, smem_addr(kst + ((lane & 7) + (lane >> 4) * 8) * STR + kk * 16 + ((lane >> 3) & 1) * 8));
            mma_16816(s[0], a, bb);
            mma_16816(s[1], a, bb + 2);
        }
        float mx[2] = {m_r[0], m_r[1]};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = jw + nt * 8 + 2 * tig + (e & 1);
                bool vis = j < s_hi;
                if constexpr (VERIFY) vis = vis && j < lim_hi[e >> 1] && j >= lim_lo[e >> 1];
                const float v = vis ? s[nt][e] * scale_log2 : NEG_INF;
                s[nt][e] = v;
                if constexpr (VERIFY) {
                    if (vl[e >> 1] != nullptr && vis) vl[e >> 1][j] = v;
                }
                if constexpr (SPARSE) {
                    const int hig = rg * 16 + g + 8 * (e >> 1);
                    if (lrow != nullptr && j < s_hi && hig < G) lrow[(u64)(g + 8 * (e >> 1)) * sp.lstride + j] = v;
                }
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float base[2], alpha[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            base[i] = mx[i] == NEG_INF ? 0.0f : mx[i];
            alpha[i] = exp2f(m_r[i] - base[i]);
            m_r[i] = mx[i];
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - base[0]);
            s[nt][1] = exp2f(s[nt][1] - base[0]);
            s[nt][2] = exp2f(s[nt][2] - base[1]);
            s[nt][3] = exp2f(s[nt][3] - base[1]);
            rs[0] += s[nt][0] + s[nt][1];
            rs[1] += s[nt][2] + s[nt][3];
        }
        l_r[0] = l_r[0] * alpha[0] + rs[0];
        l_r[1] = l_r[1] * alpha[1] + rs[1];
        u32 a[4];
        a[0] = pack_bf16x2(s[0][0], s[0][1]);
        a[1] = pack_bf16x2(s[0][2], s[0][3]);
        a[2] = pack_bf16x2(s[1][0], s[1][1]);
        a[3] = pack_bf16x2(s[1][2], s[1][3]);
#pragma unroll
        for (int dd = 0; dd < D / 16; ++dd) {
            acc[2 * dd][0] *= alpha[0];
            acc[2 * dd][1] *= alpha[0];
            acc[2 * dd][2] *= alpha[1];
            acc[2 * dd][3] *= alpha[1];
            acc[2 * dd + 1][0] *= alpha[0];
            acc[2 * dd + 1][1] *= alpha[0];
            acc[2 * dd + 1][2] *= alpha[1];
            acc[2 * dd + 1][3] *= alpha[1];
            u32 bb[4];
            ldmatrix_x4_trans(bb, smem_addr(vst + ((lane & 7) + ((lane >> 3) & 1) * 8) * STR + dd * 16 + (lane >> 4) * 8));
            mma_16816(acc[2 * dd], a, bb);
            mma_16816(acc[2 * dd + 1], a, bb + 2);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Merge the four warps' partials of each row group (the K/V rings are free now; NGB > 1
    // needs NGB x 4 slices, which the launch's smem covers): each warp scales its rows to the
    // group's max and stores the valid ones (query heads < G) in its own slice
    // [16][D + 8] f32, as float2 (row g of the warp lands 8 floats further mod 32 banks: no bank
    // conflicts; one slice for all four warps cost four barriers and 8-way conflicts, run 24's
    // 85 % conflicted shared stores); one barrier, then the slices are summed in warp order.
    constexpr int OSTR = D + 8;
    float* obuf = reinterpret_cast<float*>(ks);  // [NGB][4][16][OSTR]
    float* mls = obuf + NGB * 4 * 16 * OSTR;     // m [NGB][4][16], then l [NGB][4][16]
    constexpr int LOFF = NGB * 64;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 1);
        l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 2);
    }
    if (tig == 0) {
        mls[warp * 16 + g] = m_r[0];
        mls[warp * 16 + g + 8] = m_r[1];
        mls[LOFF + warp * 16 + g] = l_r[0];
        mls[LOFF + warp * 16 + g + 8] = l_r[1];
    }
    __syncthreads();
    const int nrows = min(16, GV - rg * 16);
    float* ow = obuf + warp * 16 * OSTR;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = g + 8 * i;
        float M = NEG_INF;
        for (int w = 0; w < 4; ++w) M = fmaxf(M, mls[(wg * 4 + w) * 16 + row]);
        const float base = M == NEG_INF ? 0.0f : M;
        const float wsc = m_r[i] == NEG_INF ? 0.0f : exp2f(m_r[i] - base);
        if (row < nrows) {
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(ow + row * OSTR + dt * 8 + 2 * tig) =
                    make_float2(acc[dt][2 * i] * wsc, acc[dt][2 * i + 1] * wsc);
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < NGB * 16 * D; idx += NT) {
        const int gi = idx / (16 * D), r = idx / D % 16, d = idx % D, vr = (rg0 + gi) * 16 + r;
        if (vr >= GV) continue;
        const float* o = obuf + (gi * 64 + r) * OSTR + d;
        part_o[(((u64)vrow(vr) * n_heads + vhead(vr)) * splits + split) * D + d] =
            o[0] + o[16 * OSTR] + o[32 * OSTR] + o[48 * OSTR];
    }
    if (threadIdx.x < 16 * NGB) {
        const int gi = threadIdx.x / 16, r = threadIdx.x % 16, vr = (rg0 + gi) * 16 + r;
        if (vr < GV) {
            float M = NEG_INF;
            for (int w = 0; w < 4; ++w) M = fmaxf(M, mls[(gi * 4 + w) * 16 + r]);
            const float base = M == NEG_INF ? 0.0f : M;
            float L = 0.0f;
            for (int w = 0; w < 4; ++w) {
                const float mw = mls[(gi * 4 + w) * 16 + r];
                if (mw != NEG_INF) L += mls[LOFF + (gi * 4 + w) * 16 + r] * exp2f(mw - base);
            }
            const u64 idx = ((u64)vrow(vr) * n_heads + vhead(vr)) * splits + split;
            part_ml[idx * 2] = M;
            part_ml[idx * 2 + 1] = L;
        }
    }
}

#define DECODE_ENTRY_T(NAME, D, STAGES, F8)                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                            \
        NAME(const bf16* q, const bf16* k_cache, const bf16* v_cache, const u32* seq_lens,               \
             const u32* slots, float* part_o, float* part_ml, u32 n_heads, u32 kv_heads, u32 capacity,    \
             u32 num_slots, u32 window, u32 chunk, float scale_log2) {                                    \
        SparseArgs sp = {};                                                                              \
        attn_decode_impl<D, STAGES, false, false, false, 1, F8>(q, k_cache, v_cache, seq_lens, slots,   \
                                                                part_o, part_ml,                        \
                                           n_heads, kv_heads, capacity, num_slots, window, chunk,        \
                                           scale_log2, sp);                                              \
    }
// Each entry twice: NAME over bf16 caches, NAME_f8 over e4m3 caches.
#define DECODE_ENTRY(NAME, D, STAGES) DECODE_ENTRY_T(NAME, D, STAGES, false) DECODE_ENTRY_T(NAME##_f8, D, STAGES, true)
DECODE_ENTRY(attn_decode_d64, 64, 4)
DECODE_ENTRY(attn_decode_d128, 128, 3)
// A deeper K/V ring (more bytes in flight a SM, one block a SM): decode_plan picks it when one
// block a SM fills the device (6 stages were no better, run 25).
DECODE_ENTRY(attn_decode_d128_s4, 128, 4)
DECODE_ENTRY(attn_decode_d256, 256, 2)

// The dense kernels with the q/k/v post-processing inside (POST above): the same grid and
// partials; dynamic smem 6 KB (+ 2 D bf16) more.
#define POST_DECODE_ENTRY_T(NAME, D, STAGES, F8)                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                            \
        NAME(const bf16* qkv, bf16* k_cache, bf16* v_cache, const u32* seq_lens, const u32* slots,       \
             float* part_o, float* part_ml, u32 n_heads, u32 kv_heads, u32 capacity, u32 num_slots,      \
             u32 window, u32 chunk, float scale_log2, u32 qkv_stride, const float* qn, const float* kn,  \
             float eps, const u32* positions, u32 rot, const double* inv_freq) {                         \
        SparseArgs sp = {};                                                                              \
        PostArgs pa = {qkv, qkv_stride, qn, kn, eps, positions, rot, inv_freq, k_cache, v_cache};        \
        attn_decode_impl<D, STAGES, false, true, false, 1, F8>(nullptr, k_cache, v_cache, seq_lens,      \
                                                 slots, part_o,                                          \
                                                 part_ml, n_heads, kv_heads, capacity, num_slots, window, \
                                                 chunk, scale_log2, sp, pa);                              \
    }
#define POST_DECODE_ENTRY(NAME, D, STAGES) \
    POST_DECODE_ENTRY_T(NAME, D, STAGES, false) POST_DECODE_ENTRY_T(NAME##_f8, D, STAGES, true)
POST_DECODE_ENTRY(attn_decode_post_d64, 64, 4)
POST_DECODE_ENTRY(attn_decode_post_d128, 128, 3)
POST_DECODE_ENTRY(attn_decode_post_d128_s4, 128, 4)
POST_DECODE_ENTRY(attn_decode_post_d256, 256, 2)

// The sparse / capturing variant (see SparseArgs above); same grid, smem and partials.
#define SPARSE_DECODE_ENTRY_T(NAME, D, STAGES, F8)                                                       \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                            \
        NAME(const bf16* q, const bf16* k_cache, const bf16* v_cache, const u32* seq_lens,               \
             const u32* slots, float* part_o, float* part_ml, u32 n_heads, u32 kv_heads, u32 capacity,    \
             u32 num_slots, float scale_log2, const bf16* ck, const bf16* cv, const u32* clen,            \
             const u32* rstart, u32 ccap, u32 rwin, float* logits, const u32* capture, u32 lstride,       \
             const u32* cidx, u32 cgran, const u32* vpages, const u32* vmeta, u32 vcap) {               \
        SparseArgs sp = {ck, cv, clen, rstart, ccap, rwin, logits, capture, lstride, cidx, cgran,        \
                         vpages, vmeta, vcap};                                                           \
        attn_decode_impl<D, STAGES, true, false, false, 1, F8>(q, k_cache, v_cache, seq_lens, slots,     \
                                          part_o, part_ml, n_heads,                                      \
                                          kv_heads, capacity, num_slots, 0, 0, scale_log2, sp);          \
    }
#define SPARSE_DECODE_ENTRY(NAME, D, STAGES) \
    SPARSE_DECODE_ENTRY_T(NAME, D, STAGES, false) SPARSE_DECODE_ENTRY_T(NAME##_f8, D, STAGES, true)
SPARSE_DECODE_ENTRY(attn_sparse_decode_d64, 64, 4)
SPARSE_DECODE_ENTRY(attn_sparse_decode_d128, 128, 3)
SPARSE_DECODE_ENTRY(attn_sparse_decode_d256, 256, 2)

// The sparse kernels with the q/k/v post-processing inside (POST above; positions[b] must be
// seq_lens[b] - 1, and the new key is the last of the sequence's virtual keys): the sparse
// entry's arguments with the q/k/v row in place of q, then the post arguments; dynamic smem as
// the sparse kernel's plus the post kernels' 6 KB (+ 2 D bf16).
#define SPARSE_POST_DECODE_ENTRY_T(NAME, D, STAGES, F8)                                                  \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                            \
        NAME(const bf16* qkv, bf16* k_cache, bf16* v_cache, const u32* seq_lens, const u32* slots,       \
             float* part_o, float* part_ml, u32 n_heads, u32 kv_heads, u32 capacity, u32 num_slots,      \
             float scale_log2, const bf16* ck, const bf16* cv, const u32* clen, const u32* rstart,       \
             u32 ccap, u32 rwin, float* logits, const u32* capture, u32 lstride, u32 qkv_stride,        \
             const float* qn, const float* kn, float eps, const u32* positions, u32 rot,                \
             const double* inv_freq) {                                                                  \
        SparseArgs sp = {ck, cv, clen, rstart, ccap, rwin, logits, capture, lstride, nullptr, 1};        \
        PostArgs pa = {qkv, qkv_stride, qn, kn, eps, positions, rot, inv_freq, k_cache, v_cache};        \
        attn_decode_impl<D, STAGES, true, true, false, 1, F8>(nullptr, k_cache, v_cache, seq_lens,       \
                                                slots, part_o,                                           \
                                                part_ml, n_heads, kv_heads, capacity, num_slots, 0, 0,    \
                                                scale_log2, sp, pa);                                      \
    }
#define SPARSE_POST_DECODE_ENTRY(NAME, D, STAGES) \
    SPARSE_POST_DECODE_ENTRY_T(NAME, D, STAGES, false) SPARSE_POST_DECODE_ENTRY_T(NAME##_f8, D, STAGES, true)
SPARSE_POST_DECODE_ENTRY(attn_sparse_decode_post_d64, 64, 4)
SPARSE_POST_DECODE_ENTRY(attn_sparse_decode_post_d128, 128, 3)
SPARSE_POST_DECODE_ENTRY(attn_sparse_decode_post_d256, 256, 2)

// Speculative verification (VERIFY above), NGB row groups a block: grid (splits, kv_heads *
// ceil(ceil(rps * G / 16) / NGB), sequences), block 128 NGB, dynamic smem as
// verify_smem_bytes on the host says; partials for sequences x rps rows (reduce over them); the
// split is always the device's even one. NGB is capped by the registers (128 NGB threads) and
// the merge buffer (NGB <= STAGES keeps it inside the K/V ring).
#define VERIFY_ENTRY_T(NAME, D, STAGES, NGB, F8)                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS * NGB)                                      \
        NAME(const bf16* q, const bf16* k_cache, const bf16* v_cache, const u32* seq_lens,               \
             const u32* slots, float* part_o, float* part_ml, u32 n_heads, u32 kv_heads, u32 capacity,    \
             u32 num_slots, u32 window, float scale_log2, u32 rps, float* logits, const u32* capture,    \
             u32 lstride) {                                                                              \
        SparseArgs sp = {};                                                                              \
        PostArgs pa = {};                                                                                \
        VerifyArgs va = {rps, logits, capture, lstride};                                                 \
        attn_decode_impl<D, STAGES, false, false, true, NGB, F8>(q, k_cache, v_cache, seq_lens, slots,    \
                                                             part_o, part_ml, n_heads, kv_heads,          \
                                                             capacity, num_slots, window, 0, scale_log2,  \
                                                             sp, pa, va);                                 \
    }
#define VERIFY_ENTRY(NAME, D, STAGES, NGB) \
    VERIFY_ENTRY_T(NAME, D, STAGES, NGB, false) VERIFY_ENTRY_T(NAME##_f8, D, STAGES, NGB, true)
VERIFY_ENTRY(attn_verify_d64, 64, 4, 1)
VERIFY_ENTRY(attn_verify_d64_g2, 64, 4, 2)
VERIFY_ENTRY(attn_verify_d64_g4, 64, 4, 4)
VERIFY_ENTRY(attn_verify_d128, 128, 3, 1)
VERIFY_ENTRY(attn_verify_d128_g2, 128, 3, 2)
VERIFY_ENTRY(attn_verify_d128_g3, 128, 3, 3)
VERIFY_ENTRY(attn_verify_d256, 256, 2, 1)
VERIFY_ENTRY(attn_verify_d256_g2, 256, 2, 2)

// Merges the splits: out [batch, n_heads, D] bf16, lse [batch, n_heads] (natural log) or null.
// Warp w sums splits w, w + 8, ... with float4 loads; its first RED_U rows are loaded before
// the max, so their trip to L2 overlaps the trip for the (max, sum) pairs. Each warp finds the
// max and the weighted sum over all splits itself (lanes stride the splits), so one barrier
// remains: the eight warp partials are added. D <= 256. grid (n_heads, batch), block 256.
#define RED_U 4
extern "C" __global__ void __launch_bounds__(256) attn_decode_reduce(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, bf16* __restrict__ out,
    float* __restrict__ lse, u32 n_heads, u32 splits, u32 head_dim) {
    __shared__ float4 red[8][64];
    pdl_wait();
    pdl_trigger();
    const u64 bh = (u64)blockIdx.y * n_heads + blockIdx.x;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + bh * splits;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, d4 = head_dim / 4;
    const float4* po = reinterpret_cast<const float4*>(part_o) + bh * splits * d4;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    // This lane's float4 columns of split s's partial row (zero past the splits or the row).
    auto load_row = [&](u32 s, float4* v) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u32 c = lane + 32 * i;
            v[i] = s < splits && c < d4 ? po[s * d4 + c] : zero;
        }
    };
    float pm[RED_U];
    float4 pre[RED_U][2];
#pragma unroll
    for (int u = 0; u < RED_U; ++u) {
        const u32 s = warp + 8 * u;
        pm[u] = s < splits ? ml[s].x : NEG_INF;
        load_row(s, pre[u]);
    }
    float m = NEG_INF;
    for (u32 s = lane; s < splits; s += 32) m = fmaxf(m, ml[s].x);
    const float M = warp_max(m);
    const float base = M == NEG_INF ? 0.0f : M;
    float l = 0.0f;
    for (u32 s = lane; s < splits; s += 32) {
        const float2 v = ml[s];
        if (v.x != NEG_INF) l += exp2f(v.x - base) * v.y;
    }
    const float L = warp_sum(l);
    float4 acc[2] = {zero, zero};
    auto add = [&](float ms, const float4* v) {
        const float w = ms == NEG_INF ? 0.0f : exp2f(ms - base);
        if (w == 0.0f) return;  // empty split: its O was never written
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            acc[i].x += w * v[i].x;
            acc[i].y += w * v[i].y;
            acc[i].z += w * v[i].z;
            acc[i].w += w * v[i].w;
        }
    };
#pragma unroll
    for (int u = 0; u < RED_U; ++u) add(pm[u], pre[u]);
    for (u32 s = warp + 8 * RED_U; s < splits; s += 8) {
        float4 v[2];
        load_row(s, v);
        add(ml[s].x, v);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
        if (lane + 32 * i < d4) red[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const float4 v = red[w][d / 4];
            a += (d & 3) == 0 ? v.x : (d & 3) == 1 ? v.y : (d & 3) == 2 ? v.z : v.w;
        }
        out[bh * head_dim + d] = f2bf(a * inv);
    }
    if (lse != nullptr && threadIdx.x == 0) lse[bh] = L > 0.0f ? (M + log2f(L)) * LN2_F : NEG_INF;
}
