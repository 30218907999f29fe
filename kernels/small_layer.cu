// Whole encoder sublayers in one kernel each, for programs of few token rows
// (M <= SL_MAXM), f16/bf16 on tensor cores: the graph of a (1, 16) batch then
// has two nodes per layer instead of eight.
//
// layer_attn_small_<t>_d<HD> (grid = heads):
//     h = LayerNorm(h + (Attention(h·Wqkvᵀ + bqkv) · Woᵀ + bo))
//   = the ops Linear(qkv) → Attention → Linear(o) → AddLayerNorm.
//   Phase 1, block = head: its q, k, v for all live rows (one GEMM of
//   M × 3·HD over K = H), the attention of every row against the keys of its
//   own sequence (padded: its batch row, keys with mask 0 excluded; packed:
//   its `cu_seqlens` range; exact max-subtracted softmax in f32), and its
//   head's columns of the context, written to `ctx` (M × H, T).
// layer_attn_small_bias_<t>_d<HD> (MPNet): the same, with the relative
//   position bias of attention.cu's rel_bias added to every scaled score
//   (positions inside the row's sequence), from the [heads, 2·radius + 1]
//   table `pbias` and `radius` (two more arguments).
// layer_ffn_small_<t> (grid = I / SL_FS):
//     h = LayerNorm(h + (act(h·W1ᵀ + b1) · W2ᵀ + b2))
//   = Linear(intermediate, act) → Linear(output) → AddLayerNorm.
//   Phase 1, block = SL_FS intermediate columns: act(h·W1ᵀ + b1) for them,
//   written to `inter` (M × I, T).
//
// Then, in both, a grid barrier (every block has written its phase-1 part),
// and phase 2: the second product (ctx · Woᵀ, K = H; inter · W2ᵀ, K = I),
// its n-tiles of 8 output columns dealt round robin to the blocks, plus the
// bias and the residual (h, kept in shared memory from the start), into
// `tmp` (M × H, f32). The last block to finish (the same counter, counting
// on) normalises the rows of `tmp` into `out` (which may alias h: every
// block has read h, and all of phase 2 is done, before it writes) and
// resets the counter to zero, so graphs replay. Every value has one writer
// and a fixed order of summation: replays are bit-for-bit reproducible.
//
// The barrier needs every block of the grid resident at once: the host
// launches at most one block per SM (grid <= the device's SM count, and the
// shared memory of one block fits an SM), so that blocks waiting at the
// barrier can never keep a block still to come from starting.
//
// Rows: a padded program computes all M rows. A packed one computes the
// live rows only: the real tokens (cu_seqlens[seqs]) rounded up to 16, at
// most M, so a 16-token text in a 64-token budget costs what a (1, 16) batch
// does. Rows past them keep whatever they held; nothing reads them (tail
// slots attend to nothing and pool nothing, and every other op of a program
// works row by row). Live tail rows attend to nothing and get a zero
// context, as the packed attention's tail tiles do.
//
// GEMMs: mma.sync.m16n8k16 (f32 accumulate). Each lane loads 16 bytes of
// its A row and of its B row (a weight row) per 32 values of K: the 8 values
// are the k = 2t..2t+1, 2t+8..2t+9 of two consecutive mma k-steps (a
// permutation of k applied to A and B alike, which a dot product does not
// see), so no fragment is assembled from 4-byte pieces. A's rows in shared
// memory are padded to ≡ 64 bytes mod 128 (sl_ld), so the 8 lanes of a
// 16-byte access phase hit distinct banks. K is split over the 4 warps,
// whose partials meet in shared memory in a fixed order.
//
// Numerics follow the unfused path where it stores activations in T (q, k,
// v, the context and act(...) are rounded to T); the second product is not
// rounded before the residual add (the unfused path rounds it to T; the CPU
// backend never does).
//
// Shared memory (bytes, dynamic; sl_attn_smem / sl_ffn_smem in plan.rs
// compute the same), with MP = M rounded up to 16:
//   attn: MP·sl_ld(H)·2 + SL_WARPS·16·SL_NG·8·4 + 3·MP·(HD+1)·4 + MP·(MP+1)·4 + 3·MP·4
//   ffn:  MP·sl_ld(H)·2 + SL_WARPS·16·SL_G2·8·4
// Host-checked requirements: T = f16/bf16, M <= SL_MAXM, H % 128 == 0,
// H <= 32·4·SL_LN_J, heads·HD == H, HD % 32 == 0, I % 128 == 0, grid <= SMs.
//
// Uses mma16816 (attention_tc.cu), unpack2 (skinny.cu), ld4/st4 (vec.cu).

#define SL_THREADS 128
#define SL_WARPS (SL_THREADS / 32)
#define SL_MAXM 64
#define SL_FS 32  // intermediate columns per FFN block
#define SL_NG 12  // n-tiles per GEMM1 pass of the attention kernel (96 columns)
#define SL_G2 4   // n-tiles per phase-2 pass
#define SL_LN_J 8 // float4s per lane and row in the final LayerNorm (H <= 1024)

// Row stride (in 2-byte elements) of a shared-memory row of `cols` values,
// cols % 32 == 0: ≡ 64 bytes mod 128.
__device__ __forceinline__ int sl_ld(int cols) { return (cols % 64 == 0) ? cols + 32 : cols; }

// Rows the kernels compute (see the header).
__device__ __forceinline__ int sl_live_rows(int M, const int* offsets, int seqs) {
    if (offsets == 0) return M;
    const int total = min(max(offsets[seqs], 0), M);
    return min((total + 15) & ~15, M);
}

__device__ __forceinline__ unsigned sl_load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of the grid arrives before any leaves; what each wrote before
// is visible to all after. The counter counts on (see sl_last_block).
__device__ __forceinline__ void sl_grid_barrier(unsigned* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (sl_load_acquire(counter) < gridDim.x) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
}

// Counts the block as done; true in the last one (the one that brings the
// counter to `total`), which then sees what every block wrote (and must
// reset the counter). After sl_grid_barrier the counter counts on: total =
// 2 · gridDim.x.
__device__ __forceinline__ bool sl_last_block(unsigned* counter, unsigned total) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counter, 1u) == total - 1;
    __syncthreads();
    if (s_last) __threadfence();
    return s_last;
}

// Two mma k-steps over 32 values of K with the permuted fragments above:
// alo / ahi are 8 values of A rows g and g + 8, b 8 values of B column g.
template <typename T>
__device__ __forceinline__ void sl_mma32(float (&c)[4], const uint4& alo, const uint4& ahi, const uint4& b) {
    const unsigned a0[4] = {alo.x, ahi.x, alo.y, ahi.y};
    mma16816(c, a0, b.x, b.y, T());
    const unsigned a1[4] = {alo.z, ahi.z, alo.w, ahi.w};
    mma16816(c, a1, b.z, b.w, T());
}

// Copies rows 0..rows_pad of x [.., H] into xs (row stride lda), zeros from
// row `live` on.
template <typename T>
__device__ __forceinline__ void sl_load_rows(const T* x, T* xs, int lda, int live, int rows_pad, int H) {
    const int vpr = H >> 3;  // 16-byte vectors per row
    for (int i = threadIdx.x; i < rows_pad * vpr; i += SL_THREADS) {
        const int r = i / vpr, v = i - r * vpr;
        uint4 q = make_uint4(0u, 0u, 0u, 0u);
        if (r < live) q = *reinterpret_cast<const uint4*>(x + (size_t)r * H + v * 8);
        *reinterpret_cast<uint4*>(xs + r * lda + v * 8) = q;
    }
}

// Writes warp partials c[j] (16 x NT·8, m-tile rows) to red[warp][16][NT·8].
template <int NT>
__device__ __forceinline__ void sl_store_partials(const float (&c)[NT][4], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    constexpr int W = NT * 8;
    float* rw = red + warp * 16 * W;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int col = j * 8 + 2 * t4;
        *reinterpret_cast<float2*>(rw + g * W + col) = make_float2(c[j][0], c[j][1]);
        *reinterpret_cast<float2*>(rw + (g + 8) * W + col) = make_float2(c[j][2], c[j][3]);
    }
}

// Phase 1 GEMM partials of m-tile mt: C[16 x NT·8] = xs[mt·16 .., 0..K] ·
// W[row_of(c), 0..K]ᵀ, K split over the warps (K % (32·SL_WARPS) == 0);
// warp w's partial goes to red[w][16][NT·8]. The caller synchronises and sums.
template <typename T, int NT, typename RowOf>
__device__ __forceinline__ void sl_gemm1(const T* xs, int lda, int mt, const T* __restrict__ w, int ldw, RowOf row_of,
                                         int K, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    float c[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[j][e] = 0.0f;
    const int nch = K / (32 * SL_WARPS);
    const T* alo_p = xs + (mt * 16 + g) * lda + 8 * t4;
    const T* ahi_p = alo_p + 8 * lda;
#pragma unroll 1
    for (int ch = 0; ch < nch; ch++) {
        const int k0 = (warp * nch + ch) * 32;
        uint4 b[NT];
#pragma unroll
        for (int j = 0; j < NT; j++)
            b[j] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)row_of(j * 8 + g) * ldw + k0 + 8 * t4));
        const uint4 alo = *reinterpret_cast<const uint4*>(alo_p + k0);
        const uint4 ahi = *reinterpret_cast<const uint4*>(ahi_p + k0);
#pragma unroll
        for (int j = 0; j < NT; j++) sl_mma32<T>(c[j], alo, ahi, b[j]);
    }
    sl_store_partials<NT>(c, red);
}

// Phase 2: tmp[r][n] = Σ_k a[r][k]·w[n][k] + bias[n] + xs[r][n] for the rows
// r < live and this block's n-tiles (nt = blockIdx.x + i·gridDim.x of H/8),
// K % (32·SL_WARPS) == 0. `a` (M × K) was written by other blocks of this
// grid before the barrier: read through L2.
template <typename T>
__device__ __forceinline__ void sl_gemm2(const T* a, int K, const T* __restrict__ w, const T* __restrict__ bias,
                                         const T* xs, int lda, float* tmp, int H, int live, float* red) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int ntiles = H >> 3;
    const int cnt = (int)blockIdx.x < ntiles ? (ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int MT = (live + 15) >> 4;
    const int nch = K / (32 * SL_WARPS);
    constexpr int W = SL_G2 * 8;
    for (int i0 = 0; i0 < cnt; i0 += SL_G2) {
        const int ng = min(SL_G2, cnt - i0);
        const T* wrow[SL_G2];
#pragma unroll
        for (int j = 0; j < SL_G2; j++) {
            const int nt = (int)blockIdx.x + min(i0 + j, cnt - 1) * (int)gridDim.x;
            wrow[j] = w + (size_t)(nt * 8 + g) * K + 8 * t4;
        }
        for (int mt = 0; mt < MT; mt++) {
            float c[SL_G2][4];
#pragma unroll
            for (int j = 0; j < SL_G2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) c[j][e] = 0.0f;
            const int ra = mt * 16 + g, rb = ra + 8;
            const T* pa = a + (size_t)ra * K + 8 * t4;
            const T* pb = a + (size_t)rb * K + 8 * t4;
#pragma unroll 4
            for (int ch = 0; ch < nch; ch++) {
                const int k0 = (warp * nch + ch) * 32;
                const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
                const uint4 alo = ra < live ? __ldcg(reinterpret_cast<const uint4*>(pa + k0)) : zero;
                const uint4 ahi = rb < live ? __ldcg(reinterpret_cast<const uint4*>(pb + k0)) : zero;
#pragma unroll
                for (int j = 0; j < SL_G2; j++) {
                    if (j < ng) {
                        const uint4 b = __ldg(reinterpret_cast<const uint4*>(wrow[j] + k0));
                        sl_mma32<T>(c[j], alo, ahi, b);
                    }
                }
            }
            sl_store_partials<SL_G2>(c, red);
            __syncthreads();
            for (int i = tid; i < 16 * W; i += SL_THREADS) {
                const int m = i / W, jj = i - m * W, j = jj >> 3;
                const int r = mt * 16 + m;
                if (j < ng && r < live) {
                    const int n = ((int)blockIdx.x + (i0 + j) * (int)gridDim.x) * 8 + (jj & 7);
                    float v = 0.0f;
#pragma unroll
                    for (int q = 0; q < SL_WARPS; q++) v += red[(q * 16 + m) * W + jj];
                    if (bias != 0) v += to_f32(bias[n]);
                    v += to_f32(xs[r * lda + n]);
                    tmp[(size_t)r * H + n] = v;
                }
            }
            __syncthreads();
        }
    }
}

// The last block: out[r] = LayerNorm(tmp[r]) for rows < live, a row per warp.
template <typename T>
__device__ __forceinline__ void sl_ln_rows(const float* tmp, const T* __restrict__ gamma, const T* __restrict__ beta,
                                           float eps, T* out, int live, int H) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nv = H >> 2;
    for (int r = warp; r < live; r += blockDim.x >> 5) {
        const float4* row = reinterpret_cast<const float4*>(tmp + (size_t)r * H);
        float v[SL_LN_J][4];
#pragma unroll
        for (int j = 0; j < SL_LN_J; j++) {
            const int q = lane + 32 * j;
            const float4 a = q < nv ? __ldcg(row + q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v[j][0] = a.x;
            v[j][1] = a.y;
            v[j][2] = a.z;
            v[j][3] = a.w;
        }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < SL_LN_J; j++)
            if (lane + 32 * j < nv) s += (v[j][0] + v[j][1]) + (v[j][2] + v[j][3]);
        const float mean = warp_sum(s) / (float)H;
        float q2 = 0.0f;
#pragma unroll
        for (int j = 0; j < SL_LN_J; j++) {
            if (lane + 32 * j < nv) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float d = v[j][e] - mean;
                    q2 += d * d;
                }
            }
        }
        const float rstd = 1.0f / sqrtf(warp_sum(q2) / (float)H + eps);
#pragma unroll
        for (int j = 0; j < SL_LN_J; j++) {
            const int q = lane + 32 * j;
            if (q < nv) {
                float gm[4], bt[4], o[4];
                ld4(gamma + 4 * q, gm);
                ld4(beta + 4 * q, bt);
#pragma unroll
                for (int e = 0; e < 4; e++) o[e] = (v[j][e] - mean) * rstd * gm[e] + bt[e];
                st4(out + (size_t)r * H + 4 * q, o);
            }
        }
    }
}

template <typename T, int HD, bool BIAS>
__device__ __forceinline__ void layer_attn_small_impl(const T* x, const T* __restrict__ wqkv,
                                                      const T* __restrict__ bqkv, const T* __restrict__ wo,
                                                      const T* __restrict__ bo, const T* __restrict__ gamma,
                                                      const T* __restrict__ beta, float eps, T* out, T* ctx,
                                                      float* tmp, unsigned* counter, const int* __restrict__ mask,
                                                      const int* __restrict__ offsets, int seqs, int seq, int M,
                                                      int H, float scale, const T* __restrict__ pbias,
                                                      int radius) {
    static_assert(HD % 32 == 0 && (3 * HD) % (8 * SL_NG) == 0, "head size");
    constexpr int NGRP = 3 * HD / (8 * SL_NG);
    constexpr int W1 = SL_NG * 8;  // columns per GEMM1 pass
    constexpr int QS = HD + 1;     // f32 row stride of q, k, v
    extern __shared__ __align__(16) unsigned char sl_smem[];
    const int h = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int live = sl_live_rows(M, offsets, seqs);
    const int MT = (live + 15) >> 4, MR = MT * 16;
    const int MP = (M + 15) & ~15;
    const int lda = sl_ld(H), lds = MP + 1;
    T* xs = reinterpret_cast<T*>(sl_smem);                 // [MP][lda]  the rows of h
    float* red = reinterpret_cast<float*>(xs + MP * lda);  // [SL_WARPS][16][W1]
    float* sq = red + SL_WARPS * 16 * W1;                  // [MP][QS]   q, k, v of this head
    float* sk = sq + MP * QS;
    float* sv = sk + MP * QS;
    float* ss = sv + MP * QS;                   // [MP][lds]  scores, then probabilities
    int* rs = reinterpret_cast<int*>(ss + MP * lds);  // [MP] first key of each row's sequence
    int* rl = rs + MP;                          // [MP] its keys (0: none)
    int* km = rl + MP;                          // [MP] key not masked

    sl_load_rows<T>(x, xs, lda, live, MR, H);
    if (offsets == 0) {
        for (int r = tid; r < MR; r += SL_THREADS) {
            const bool on = r < live;
            rs[r] = on ? (r / seq) * seq : 0;
            rl[r] = on ? seq : 0;
            km[r] = on ? (mask[r] != 0) : 0;
        }
    } else {
        for (int r = tid; r < MR; r += SL_THREADS) {
            rs[r] = 0;
            rl[r] = 0;
            km[r] = 1;
        }
        __syncthreads();
        for (int s = tid; s < seqs; s += SL_THREADS) {
            const int a = min(max(offsets[s], 0), live);
            const int e = min(max(offsets[s + 1], a), live);
            for (int t = a; t < e; t++) {
                rs[t] = a;
                rl[t] = e - a;
            }
        }
    }
    __syncthreads();

    // q | k | v of this head: columns c of a pass map to weight rows part·H + h·HD + d.
    for (int grp = 0; grp < NGRP; grp++) {
        const auto row_of = [&](int c) {
            const int col = grp * W1 + c;
            return (col / HD) * H + h * HD + col % HD;
        };
        for (int mt = 0; mt < MT; mt++) {
            sl_gemm1<T, SL_NG>(xs, lda, mt, wqkv, H, row_of, H, red);
            __syncthreads();
            for (int i = tid; i < 16 * W1; i += SL_THREADS) {
                const int m = i / W1, cc = i - m * W1;
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < SL_WARPS; w++) v += red[(w * 16 + m) * W1 + cc];
                if (bqkv != 0) v += to_f32(bqkv[row_of(cc)]);
                const int col = grp * W1 + cc, part = col / HD, d = col % HD;
                float* dst = part == 0 ? sq : (part == 1 ? sk : sv);
                dst[(mt * 16 + m) * QS + d] = to_f32(from_f32<T>(v));
            }
            __syncthreads();
        }
    }

    // Scores of every row against the keys of its sequence.
    for (int idx = tid; idx < MR * MR; idx += SL_THREADS) {
        const int i = idx / MR, j = idx - i * MR;
        const int a = rs[i];
        float s = NEG_INF_F;
        if (j >= a && j < a + rl[i] && km[j] != 0) {
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < HD; e++) d = fmaf(sq[i * QS + e], sk[j * QS + e], d);
            s = d * scale;
            if (BIAS) s += rel_bias(pbias + (size_t)h * (2 * radius + 1), radius, i - a, j - a);
        }
        ss[i * lds + j] = s;
    }
    __syncthreads();
    // Softmax per row (one warp per row); a row whose keys are all masked gets zeros.
    for (int i = warp; i < MR; i += SL_WARPS) {
        float* row = ss + i * lds;
        const int a = rs[i], e = a + rl[i];
        float m = NEG_INF_F;
        for (int j = a + lane; j < e; j += 32) m = fmaxf(m, row[j]);
        m = warp_max(m);
        float sum = 0.0f;
        for (int j = a + lane; j < e; j += 32) {
            const float p = (m == NEG_INF_F) ? 0.0f : expf(row[j] - m);
            row[j] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int j = a + lane; j < e; j += 32) row[j] *= inv;
    }
    __syncthreads();
    // This head's columns of the context = P · V, rounded to T, live rows.
    for (int idx = tid; idx < live * HD; idx += SL_THREADS) {
        const int i = idx / HD, d = idx - i * HD;
        const int a = rs[i], e = a + rl[i];
        float o = 0.0f;
        for (int j = a; j < e; j++) o = fmaf(ss[i * lds + j], sv[j * QS + d], o);
        ctx[(size_t)i * H + h * HD + d] = from_f32<T>(o);
    }

    sl_grid_barrier(counter);
    sl_gemm2<T>(ctx, H, wo, bo, xs, lda, tmp, H, live, red);
    if (!sl_last_block(counter, 2 * gridDim.x)) return;
    sl_ln_rows<T>(tmp, gamma, beta, eps, out, live, H);
    if (tid == 0) *counter = 0u;
}

template <typename T>
__device__ __forceinline__ void layer_ffn_small_impl(const T* x, const T* __restrict__ w1, const T* __restrict__ b1,
                                                     int act, const T* __restrict__ w2, const T* __restrict__ b2,
                                                     const T* __restrict__ gamma, const T* __restrict__ beta,
                                                     float eps, T* out, T* inter, float* tmp, unsigned* counter,
                                                     const int* __restrict__ offsets, int seqs, int M, int H, int I) {
    constexpr int NT = SL_FS / 8;
    extern __shared__ __align__(16) unsigned char sl_smem[];
    const int col0 = blockIdx.x * SL_FS;
    const int tid = threadIdx.x;
    const int live = sl_live_rows(M, offsets, seqs);
    const int MT = (live + 15) >> 4, MR = MT * 16;
    const int MP = (M + 15) & ~15;
    const int lda = sl_ld(H);
    T* xs = reinterpret_cast<T*>(sl_smem);                 // [MP][lda]  the rows of h
    float* red = reinterpret_cast<float*>(xs + MP * lda);  // [SL_WARPS][16][max(SL_FS, SL_G2·8)]

    sl_load_rows<T>(x, xs, lda, live, MR, H);
    __syncthreads();
    const auto row_of = [&](int c) { return col0 + c; };
    for (int mt = 0; mt < MT; mt++) {
        sl_gemm1<T, NT>(xs, lda, mt, w1, H, row_of, H, red);
        __syncthreads();
        for (int i = tid; i < 16 * SL_FS; i += SL_THREADS) {
            const int m = i / SL_FS, cc = i - m * SL_FS;
            const int r = mt * 16 + m;
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < SL_WARPS; w++) v += red[(w * 16 + m) * SL_FS + cc];
            if (b1 != 0) v += to_f32(b1[col0 + cc]);
            if (r < live) inter[(size_t)r * I + col0 + cc] = from_f32<T>(apply_act(v, act));
        }
        __syncthreads();
    }

    sl_grid_barrier(counter);
    sl_gemm2<T>(inter, I, w2, b2, xs, lda, tmp, H, live, red);
    if (!sl_last_block(counter, 2 * gridDim.x)) return;
    sl_ln_rows<T>(tmp, gamma, beta, eps, out, live, H);
    if (tid == 0) *counter = 0u;
}

#define LAYER_ATTN_SMALL_KERNEL(T, SUF, HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(SL_THREADS) layer_attn_small_##SUF##_d##HD(                    \
        const T* x, const T* wqkv, const T* bqkv, const T* wo, const T* bo, const T* gamma, const T* beta,      \
        float eps, T* out, T* ctx, float* tmp, unsigned* counter, const int* mask, const int* offsets, int seqs, \
        int seq, int M, int H, float scale) { pdl_enter();                                                                   \
        layer_attn_small_impl<T, HD, false>(x, wqkv, bqkv, wo, bo, gamma, beta, eps, out, ctx, tmp, counter,    \
                                            mask, offsets, seqs, seq, M, H, scale, nullptr, 0);                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(SL_THREADS) layer_attn_small_bias_##SUF##_d##HD(               \
        const T* x, const T* wqkv, const T* bqkv, const T* wo, const T* bo, const T* gamma, const T* beta,      \
        float eps, T* out, T* ctx, float* tmp, unsigned* counter, const int* mask, const int* offsets, int seqs, \
        int seq, int M, int H, float scale, const T* pbias, int radius) { pdl_enter();                                       \
        layer_attn_small_impl<T, HD, true>(x, wqkv, bqkv, wo, bo, gamma, beta, eps, out, ctx, tmp, counter,     \
                                           mask, offsets, seqs, seq, M, H, scale, pbias, radius);               \
    }

#define LAYER_FFN_SMALL_KERNEL(T, SUF)                                                                          \
    extern "C" __global__ void __launch_bounds__(SL_THREADS) layer_ffn_small_##SUF(                             \
        const T* x, const T* w1, const T* b1, int act, const T* w2, const T* b2, const T* gamma, const T* beta, \
        float eps, T* out, T* inter, float* tmp, unsigned* counter, const int* offsets, int seqs, int M, int H, \
        int I) { pdl_enter();                                                                                                \
        layer_ffn_small_impl<T>(x, w1, b1, act, w2, b2, gamma, beta, eps, out, inter, tmp, counter, offsets,    \
                                seqs, M, H, I);                                                                 \
    }

LAYER_ATTN_SMALL_KERNEL(f16_t, f16, 32)
LAYER_ATTN_SMALL_KERNEL(f16_t, f16, 64)
LAYER_ATTN_SMALL_KERNEL(f16_t, f16, 128)
LAYER_ATTN_SMALL_KERNEL(bf16_t, bf16, 32)
LAYER_ATTN_SMALL_KERNEL(bf16_t, bf16, 64)
LAYER_ATTN_SMALL_KERNEL(bf16_t, bf16, 128)
LAYER_FFN_SMALL_KERNEL(f16_t, f16)
LAYER_FFN_SMALL_KERNEL(bf16_t, bf16)
