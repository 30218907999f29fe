// Linear layers of few token rows (M <= GS_MAXM) on tensor cores, f16/bf16,
// with the work that follows a matmul done in the same kernel:
//
//   mode 0: out = act(x·Wᵀ + bias)                       (bias + activation epilogue)
//   mode 1: out = LayerNorm(x·Wᵀ + bias + residual)      (a Linear and the AddLayerNorm after it)
//   mode 2: tmp = x·Wᵀ + bias + residual (f32)           (the same, normalised by the next Linear)
//
// and, in any mode, x may be that next Linear's view of a mode-2 output
// (xf != null: "deferred LayerNorm"): x = LayerNorm(xf) with gamma xg, beta
// xb, eps xeps, computed by every block as it loads its rows, and written
// (rounded to T) to `xout` by block 0 for the ops that read the
// LayerNorm's output later (the next residual).
//
// Why deferred: the last-block LayerNorm of mode 1 costs ~2.7 µs a kernel
// at (1, 16) (ncu, H200: O + LN 6.8 µs against 4.1 for FFN1 + GELU, which
// has 4× the blocks and the same K): a fence, an atomic, and one block
// reading back 16 rows, all after the product. The next Linear reads whole
// rows of x anyway, so its blocks compute the row statistics from the
// values they hold, with two block-wide sums and no extra global load.
//
// x [M, K], w [N, K] (a PyTorch Linear's weight), out [M, N], all of type T.
//
// Why: at (1, 16) cuBLASLt's smallest tiles are mostly idle and each of its
// matmuls takes 5-10 µs; with the separate bias + GELU and add + LayerNorm
// kernels a MiniLM graph has 50 dependent nodes of ~3.4 µs each (H200,
// docs/perf-log.md). Here a layer is QKV, attention, O + LN, FFN1 + GELU,
// FFN2 + LN: 5 nodes instead of 8, and the matmuls use the whole GPU.
//
// Grid: one block per GS_NB = 16 output columns (two mma n8-tiles), so even
// N = 384 gives 24 blocks and each weight row is read by exactly one block.
// The GS_WARPS warps of a block split K in chunks of 32 (chunk c goes to warp
// c % GS_WARPS) and keep up to GS_G chunks of loads in flight per round; the
// fragments use a permutation of k (gs_mma32: one 16-byte load of A per row
// and of B per column per 32 values of K); the m-tiles are a
// template parameter, so all of a round's loads are issued before its first
// mma. The warps' partial
// sums meet in shared memory and are added in a fixed order, so replays are
// bit-for-bit reproducible.
//
// mode 1: every block writes its pre-norm values (f32) to `tmp` [M, N]; the
// last block to finish (atomic `counter`) normalises whole rows into `out`
// and resets the counter, so the graph replays. `out` may alias `residual`:
// every block has read its residual values before the last one writes.
//
// Rows: a padded program computes all M rows; a packed one (offsets !=
// null) only its live rows, the real tokens cu_seqlens[seqs] rounded up to
// 16 (gs_live_rows): rows past them are the batch's empty tail, which
// nothing reads (tail slots attend to nothing and pool nothing, and every
// other op works row by row).
//
// Host-checked requirements: T = f16/bf16, 1 <= M <= GS_MAXM, K % 32 == 0,
// rows 16-byte aligned; mode 1 also N % 4 == 0 and N <= 32·4·GS_LN_J;
// a deferred LayerNorm (xf) K <= 32·GS_WARPS·4.
//
// Launched with programmatic dependent launch after another kernel: the
// block reads its first weights before pdl_wait (common.cuh), so their
// latency overlaps the kernel before.
//
// Uses mma16816 (attention_tc.cu), ld4 / st4 (vec.cu).

#define GS_WARPS 8
#define GS_THREADS (32 * GS_WARPS)
#define GS_NB 16   // output columns per block
#define GS_MAXM 64 // most rows (4 m16-tiles)
#define GS_LN_J 8  // float4s per lane and row in the LayerNorm tail (N <= 1024)

// Rows the kernel computes (see the header): all M (padded), or a packed
// batch's real tokens rounded up to 16, at most M.
__device__ __forceinline__ int gs_live_rows(int M, const int* offsets, int seqs) {
    if (offsets == 0) return M;
    const int total = min(max(offsets[seqs], 0), M);
    return min((total + 15) & ~15, M);
}

// Counts the block as done; true in the last one (the one that brings the
// counter to `total`), which then sees what every block wrote (and must
// reset the counter, so the graph replays).
__device__ __forceinline__ bool gs_last_block(unsigned* counter, unsigned total) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counter, 1u) == total - 1;
    __syncthreads();
    if (s_last) __threadfence();
    return s_last;
}

// Two mma k-steps over 32 values of K with permuted fragments: each lane
// loads 16 bytes of its A row and of its B row per 32 values of K, the 8
// values k = 2t..2t+1, 2t+8..2t+9 of two consecutive mma k-steps (a
// permutation of k applied to A and B alike, which a dot product does not
// see), so no fragment is assembled from 4-byte pieces. alo / ahi are 8
// values of A rows g and g + 8, b 8 values of B column g.
template <typename T>
__device__ __forceinline__ void gs_mma32(float (&c)[4], const uint4& alo, const uint4& ahi, const uint4& b) {
    const unsigned a0[4] = {alo.x, ahi.x, alo.y, ahi.y};
    mma16816(c, a0, b.x, b.y, T());
    const unsigned a1[4] = {alo.z, ahi.z, alo.w, ahi.w};
    mma16816(c, a1, b.z, b.w, T());
}

// Chunks of 32 values of K each warp keeps in flight per round, for MT
// m16-tiles: the loads of a round (2·G of the weights, 2·G·MT of x, 16 bytes
// each) stay under ~100 registers.
template <int MT>
struct GsRound {
    static constexpr int G = MT == 1 ? 6 : (MT == 2 ? 3 : 2);
};

// The products' `after_wait`: loads the caller issues right after pdl_wait,
// so that their latency overlaps the product's own loads (gs_residual).
struct GsNoop {
    __device__ __forceinline__ void operator()() const {}
};

// The block's partial sums over all of K for MT m-tiles, summed over the
// warps into red[0] order: red[w][mt][r·GS_NB + c]. Weights of the first
// round are read before pdl_wait (they are no other kernel's output). x's
// rows are ldx values apart (K, or more in shared memory).
template <typename T, int MT, typename AfterWait = GsNoop>
__device__ __forceinline__ void gs_product(const T* x, int ldx, const T* __restrict__ w, int N, int K, int live,
                                           int n0, float (*red)[GS_MAXM / 16][16 * GS_NB],
                                           const AfterWait& after_wait = AfterWait()) {
    constexpr int G = GsRound<MT>::G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    const int chunks = K >> 5;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    // This lane's weight rows (the column g of each n8-tile) and A columns.
    const bool w_ok0 = n0 + g < N, w_ok1 = n0 + 8 + g < N;
    const T* w0 = w + (size_t)min(n0 + g, N - 1) * K + 8 * t4;
    const T* w1 = w + (size_t)min(n0 + 8 + g, N - 1) * K + 8 * t4;
    const T* xa = x + (size_t)g * ldx + 8 * t4;

    float c[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) c[mt][j][e] = 0.0f;

    uint4 b[G][2];
    auto load_w = [&](int c0) {
#pragma unroll
        for (int i = 0; i < G; i++) {
            const int ch = c0 + i * GS_WARPS;
            b[i][0] = ch < chunks && w_ok0 ? __ldg(reinterpret_cast<const uint4*>(w0 + ch * 32)) : zero;
            b[i][1] = ch < chunks && w_ok1 ? __ldg(reinterpret_cast<const uint4*>(w1 + ch * 32)) : zero;
        }
    };
    load_w(warp);
    pdl_wait();
    pdl_trigger();
    after_wait();
    for (int c0 = warp; c0 < chunks; c0 += GS_WARPS * G) {
        if (c0 != warp) load_w(c0);
        uint4 alo[MT][G], ahi[MT][G];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const int ra = mt * 16 + g;
#pragma unroll
            for (int i = 0; i < G; i++) {
                const int ch = c0 + i * GS_WARPS;
                const T* p = xa + (size_t)(mt * 16) * ldx + ch * 32;
                alo[mt][i] = ch < chunks && ra < live ? *reinterpret_cast<const uint4*>(p) : zero;
                ahi[mt][i] = ch < chunks && ra + 8 < live ? *reinterpret_cast<const uint4*>(p + (size_t)8 * ldx) : zero;
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < G; i++) {
                gs_mma32<T>(c[mt][0], alo[mt][i], ahi[mt][i], b[i][0]);
                gs_mma32<T>(c[mt][1], alo[mt][i], ahi[mt][i], b[i][1]);
            }
    }
    // c[mt][j] holds rows g, g + 8 of the m-tile, columns j·8 + 2·t4 (+1).
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = j * 8 + 2 * t4;
            *reinterpret_cast<float2*>(&red[warp][mt][g * GS_NB + col]) = make_float2(c[mt][j][0], c[mt][j][1]);
            *reinterpret_cast<float2*>(&red[warp][mt][(g + 8) * GS_NB + col]) =
                make_float2(c[mt][j][2], c[mt][j][3]);
        }
}

// Where gs_product_xn's pre-norm rows come from: 8 values of row r at
// column col, in f32.
// XfRows: a deferred LayerNorm's f32 rows (see the header).
struct XfRows {
    const float* xf;
    int K;
    __device__ __forceinline__ void load(int r, int col, float (&v)[8]) const {
        const float4* src = reinterpret_cast<const float4*>(xf + (size_t)r * K + col);
        const float4 p = src[0], q = src[1];
        v[0] = p.x; v[1] = p.y; v[2] = p.z; v[3] = p.w;
        v[4] = q.x; v[5] = q.y; v[6] = q.z; v[7] = q.w;
    }
};
// gs_product with x = LayerNorm(xf) (see the header): warp w holds the
// chunks w + i·GS_WARPS (i < CPW, so K <= 32·GS_WARPS·CPW) of rows g, g + 8
// of one m-tile at a time in f32; the rows' mean and then variance are
// summed over the 4 lanes of a row (shuffles) and the warps (st [2][GS_WARPS]
// [16] in shared memory, in a fixed order), the values normalised, rounded
// to T and multiplied. Block 0 stores the rounded rows to xout.
template <typename T, int MT, int CPW, typename Rows, typename AfterWait>
__device__ __forceinline__ void gs_product_xn(const Rows& rows, const T* __restrict__ w, int N, int K, int live,
                                              int n0, const T* __restrict__ xg, const T* __restrict__ xb,
                                              float xeps, T* xout, float (*red)[GS_MAXM / 16][16 * GS_NB],
                                              float (*st)[GS_WARPS][16], const AfterWait& after_wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    const int chunks = K >> 5;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const bool w_ok0 = n0 + g < N, w_ok1 = n0 + 8 + g < N;
    const T* w0 = w + (size_t)min(n0 + g, N - 1) * K + 8 * t4;
    const T* w1 = w + (size_t)min(n0 + 8 + g, N - 1) * K + 8 * t4;
    uint4 b[CPW][2];
    float gm[CPW][8], bt[CPW][8];
#pragma unroll
    for (int i = 0; i < CPW; i++) {
        const int ch = warp + i * GS_WARPS;
        const bool ok = ch < chunks;
        b[i][0] = ok && w_ok0 ? __ldg(reinterpret_cast<const uint4*>(w0 + ch * 32)) : zero;
        b[i][1] = ok && w_ok1 ? __ldg(reinterpret_cast<const uint4*>(w1 + ch * 32)) : zero;
        const uint4 gq = ok ? __ldg(reinterpret_cast<const uint4*>(xg + ch * 32 + 8 * t4)) : zero;
        const uint4 bq = ok ? __ldg(reinterpret_cast<const uint4*>(xb + ch * 32 + 8 * t4)) : zero;
        unpack2(gq.x, T(), gm[i] + 0);
        unpack2(gq.y, T(), gm[i] + 2);
        unpack2(gq.z, T(), gm[i] + 4);
        unpack2(gq.w, T(), gm[i] + 6);
        unpack2(bq.x, T(), bt[i] + 0);
        unpack2(bq.y, T(), bt[i] + 2);
        unpack2(bq.z, T(), bt[i] + 4);
        unpack2(bq.w, T(), bt[i] + 6);
    }
    pdl_wait();
    pdl_trigger();
    after_wait();
    float c[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) c[mt][j][e] = 0.0f;
    const float inv_k = 1.0f / (float)K;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int ra = mt * 16 + g, rb = ra + 8;
        float v[2][CPW][8];
#pragma unroll
        for (int i = 0; i < CPW; i++) {
            const int ch = warp + i * GS_WARPS;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = h == 0 ? ra : rb;
                if (ch < chunks && r < live) {
                    rows.load(r, ch * 32 + 8 * t4, v[h][i]);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; e++) v[h][i][e] = 0.0f;
                }
            }
        }
        // Means (absent chunks hold zeros).
        float mean[2], rstd[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < CPW; i++)
#pragma unroll
                for (int e = 0; e < 8; e++) s += v[h][i][e];
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            if (t4 == 0) st[0][warp][g + 8 * h] = s;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < GS_WARPS; q++) s += st[0][q][g + 8 * h];
            mean[h] = s * inv_k;
            float d2 = 0.0f;
#pragma unroll
            for (int i = 0; i < CPW; i++) {
                if (warp + i * GS_WARPS < chunks) {
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        const float d = v[h][i][e] - mean[h];
                        d2 += d * d;
                    }
                }
            }
            d2 += __shfl_xor_sync(0xffffffffu, d2, 1);
            d2 += __shfl_xor_sync(0xffffffffu, d2, 2);
            if (t4 == 0) st[1][warp][g + 8 * h] = d2;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < GS_WARPS; q++) s += st[1][q][g + 8 * h];
            rstd[h] = 1.0f / sqrtf(s * inv_k + xeps);
        }
        // Normalise, round to T, multiply; block 0 keeps the rows.
#pragma unroll
        for (int i = 0; i < CPW; i++) {
            const int ch = warp + i * GS_WARPS;
            if (ch >= chunks) continue;  // warp-uniform
            uint4 a[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = h == 0 ? ra : rb;
                unsigned u[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float lo = (v[h][i][2 * e] - mean[h]) * rstd[h] * gm[i][2 * e] + bt[i][2 * e];
                    const float hi = (v[h][i][2 * e + 1] - mean[h]) * rstd[h] * gm[i][2 * e + 1] + bt[i][2 * e + 1];
                    u[e] = r < live ? pack2<T>(lo, hi) : 0u;
                }
                a[h] = make_uint4(u[0], u[1], u[2], u[3]);
                if (xout != 0 && blockIdx.x == 0 && r < live)
                    *reinterpret_cast<uint4*>(xout + (size_t)r * K + ch * 32 + 8 * t4) = a[h];
            }
            gs_mma32<T>(c[mt][0], a[0], a[1], b[i][0]);
            gs_mma32<T>(c[mt][1], a[0], a[1], b[i][1]);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = j * 8 + 2 * t4;
            *reinterpret_cast<float2*>(&red[warp][mt][g * GS_NB + col]) = make_float2(c[mt][j][0], c[mt][j][1]);
            *reinterpret_cast<float2*>(&red[warp][mt][(g + 8) * GS_NB + col]) =
                make_float2(c[mt][j][2], c[mt][j][3]);
        }
}

template <typename T, int CPW, typename Rows, typename AfterWait>
__device__ __forceinline__ void gs_product_xn_mt(int mts, const Rows& xf, const T* __restrict__ w, int N, int K,
                                                 int live, int n0, const T* __restrict__ xg,
                                                 const T* __restrict__ xb, float xeps, T* xout,
                                                 float (*red)[GS_MAXM / 16][16 * GS_NB], float (*st)[GS_WARPS][16],
                                                 const AfterWait& after_wait) {
    if (mts <= 1) {
        gs_product_xn<T, 1, CPW>(xf, w, N, K, live, n0, xg, xb, xeps, xout, red, st, after_wait);
    } else if (mts == 2) {
        gs_product_xn<T, 2, CPW>(xf, w, N, K, live, n0, xg, xb, xeps, xout, red, st, after_wait);
    } else {
        gs_product_xn<T, 4, CPW>(xf, w, N, K, live, n0, xg, xb, xeps, xout, red, st, after_wait);
    }
}

// gs_product_xn for K <= 32·GS_WARPS·4 (host-checked).
template <typename T, typename Rows, typename AfterWait = GsNoop>
__device__ __forceinline__ void gs_product_ln(int mts, const Rows& rows, const T* __restrict__ w, int N, int K,
                                              int live, int n0, const T* __restrict__ xg, const T* __restrict__ xb,
                                              float xeps, T* xout, float (*red)[GS_MAXM / 16][16 * GS_NB],
                                              float (*st)[GS_WARPS][16], const AfterWait& after_wait = AfterWait()) {
    if (K <= 32 * GS_WARPS * 2) {
        gs_product_xn_mt<T, 2>(mts, rows, w, N, K, live, n0, xg, xb, xeps, xout, red, st, after_wait);
    } else {
        gs_product_xn_mt<T, 4>(mts, rows, w, N, K, live, n0, xg, xb, xeps, xout, red, st, after_wait);
    }
}

// The block's product over its live rows (mts m-tiles): of x, or of
// LayerNorm(xf) when xf != null (see the header).
template <typename T, typename AfterWait = GsNoop>
__device__ __forceinline__ void gs_product_rows(int mts, const T* x, const float* xf, const T* __restrict__ w, int N,
                                                int K, int live, int n0, const T* __restrict__ xg,
                                                const T* __restrict__ xb, float xeps, T* xout,
                                                float (*red)[GS_MAXM / 16][16 * GS_NB], float (*st)[GS_WARPS][16],
                                                const AfterWait& after_wait = AfterWait()) {
    if (xf != 0) {
        gs_product_ln<T>(mts, XfRows{xf, K}, w, N, K, live, n0, xg, xb, xeps, xout, red, st, after_wait);
    } else if (mts <= 1) {
        gs_product<T, 1>(x, K, w, N, K, live, n0, red, after_wait);
    } else if (mts == 2) {
        gs_product<T, 2>(x, K, w, N, K, live, n0, red, after_wait);
    } else {
        gs_product<T, 4>(x, K, w, N, K, live, n0, red, after_wait);
    }
}

// The last block of mode 1: out[r] = LayerNorm(tmp[r]) for rows < live,
// two rows per warp at a time with every load of both rows (and gamma, beta)
// in flight at once.
template <typename T>
__device__ __forceinline__ void gs_ln_rows(const float* tmp, const T* __restrict__ gamma,
                                           const T* __restrict__ beta, float eps, T* out, int live, int N) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nv = N >> 2;
    for (int r0 = 2 * warp; r0 < live; r0 += 2 * GS_WARPS) {
        float v[2][GS_LN_J][4], gm[GS_LN_J][4], bt[GS_LN_J][4];
#pragma unroll
        for (int j = 0; j < GS_LN_J; j++) {
            const int q = lane + 32 * j;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float4 a = q < nv && r0 + h < live
                                     ? __ldcg(reinterpret_cast<const float4*>(tmp + (size_t)(r0 + h) * N) + q)
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                v[h][j][0] = a.x;
                v[h][j][1] = a.y;
                v[h][j][2] = a.z;
                v[h][j][3] = a.w;
            }
            if (q < nv) {
                ld4(gamma + 4 * q, gm[j]);
                ld4(beta + 4 * q, bt[j]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + h;
            if (r >= live) break;  // warp-uniform
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < GS_LN_J; j++)
                if (lane + 32 * j < nv) s += (v[h][j][0] + v[h][j][1]) + (v[h][j][2] + v[h][j][3]);
            const float mean = warp_sum(s) / (float)N;
            float q2 = 0.0f;
#pragma unroll
            for (int j = 0; j < GS_LN_J; j++) {
                if (lane + 32 * j < nv) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float d = v[h][j][e] - mean;
                        q2 += d * d;
                    }
                }
            }
            const float rstd = 1.0f / sqrtf(warp_sum(q2) / (float)N + eps);
#pragma unroll
            for (int j = 0; j < GS_LN_J; j++) {
                const int q = lane + 32 * j;
                if (q < nv) {
                    float o[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) o[e] = (v[h][j][e] - mean) * rstd * gm[j][e] + bt[j][e];
                    st4(out + (size_t)r * N + 4 * q, o);
                }
            }
        }
    }
}

// This thread's bias value in gs_store, loaded before the product so that
// its latency hides behind it.
template <typename T>
__device__ __forceinline__ float gs_bias(const T* __restrict__ bias, int N) {
    const int n = blockIdx.x * GS_NB + threadIdx.x % GS_NB;
    return bias != 0 && n < N ? to_f32(bias[n]) : 0.0f;
}

// This thread's residual values in gs_store (one per m-tile; zeros in mode
// 0). The residual is an earlier kernel's output, so this runs after
// pdl_wait: gemm_small issues it as the product's `after_wait`, beside the
// product's loads of x, rather than after the product, where its L2 round
// trip would add to the chain (modes 1 and 2: O and FFN2 of every layer).
template <typename T>
__device__ __forceinline__ void gs_residual(const T* residual, int mode, int mts, int live, int N,
                                            float (&res)[GS_MAXM / 16]) {
    const int rr = threadIdx.x / GS_NB, n = blockIdx.x * GS_NB + threadIdx.x % GS_NB;
#pragma unroll
    for (int mt = 0; mt < GS_MAXM / 16; mt++) {
        const int r = mt * 16 + rr;
        res[mt] = mode != 0 && mt < mts && r < live && n < N ? to_f32(residual[(size_t)r * N + n]) : 0.0f;
    }
}

// The block's outputs from its warps' partial sums (red, see gs_product):
// mode 0 out = act(sum + bn), modes 1 and 2 tmp = sum + bn + res
// (bn: gs_bias, res: gs_residual),
// and in mode 1 the last block to finish normalises whole rows into `out`
// (see the header).
template <typename T>
__device__ __forceinline__ void gs_store(float (*red)[GS_MAXM / 16][16 * GS_NB], int mts, int live,
                                         float bn, T* out, int N, int act, int mode,
                                         const float (&res)[GS_MAXM / 16], float* tmp, const T* __restrict__ gamma,
                                         const T* __restrict__ beta, float eps, unsigned* counter) {
    constexpr int MTMAX = GS_MAXM / 16;
    const int tid = threadIdx.x;
    // One output value per thread and m-tile (16 × GS_NB = GS_THREADS).
    const int rr = tid / GS_NB, n = blockIdx.x * GS_NB + tid % GS_NB;
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MTMAX; mt++) {
        const int r = mt * 16 + rr;
        if (mt >= mts || r >= live || n >= N) continue;
        float v = bn;
#pragma unroll
        for (int q = 0; q < GS_WARPS; q++) v += red[q][mt][tid];
        if (mode == 0) {
            out[(size_t)r * N + n] = from_f32<T>(apply_act(v, act));
        } else {
            tmp[(size_t)r * N + n] = v + res[mt];
        }
    }
    if (mode != 1) return;
    if (!gs_last_block(counter, gridDim.x)) return;
    gs_ln_rows<T>(tmp, gamma, beta, eps, out, live, N);
    if (tid == 0) *counter = 0u;
}

template <typename T>
__device__ __forceinline__ void gemm_small_impl(const T* x, const T* __restrict__ w, const T* __restrict__ bias,
                                                T* out, int M, int N, int K, int act, int mode, const T* residual,
                                                float* tmp, const T* __restrict__ gamma,
                                                const T* __restrict__ beta, float eps, unsigned* counter,
                                                const int* offsets, int seqs, const float* xf,
                                                const T* __restrict__ xg, const T* __restrict__ xb, float xeps,
                                                T* xout) {
    constexpr int MTMAX = GS_MAXM / 16;
    __shared__ float red[GS_WARPS][MTMAX][16 * GS_NB];
    __shared__ float st[2][GS_WARPS][16];
    // The live rows come from this batch's inputs, written before the graph
    // runs or, in a staged graph, by the kernel before (stage_in, which has
    // completed before anything launches after it, or the embedding, which
    // triggers only after its copy is visible): readable before pdl_wait.
    const int live = gs_live_rows(M, offsets, seqs);
    const int mts = (live + 15) >> 4;
    const float bn = gs_bias(bias, N);
    float res[MTMAX];
    const auto load_residual = [&]() { gs_residual<T>(residual, mode, mts, live, N, res); };
    gs_product_rows<T>(mts, x, xf, w, N, K, live, blockIdx.x * GS_NB, xg, xb, xeps, xout, red, st, load_residual);
    gs_store<T>(red, mts, live, bn, out, N, act, mode, res, tmp, gamma, beta, eps, counter);
}

#define GEMM_SMALL_KERNEL(T, SUF)                                                                             \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                                  \
        gemm_small_##SUF(const T* x, const T* w, const T* bias, T* out, int M, int N, int K, int act, int mode, \
                         const T* residual, float* tmp, const T* gamma, const T* beta, float eps,               \
                         unsigned* counter, const int* offsets, int seqs, const float* xf, const T* xg,        \
                         const T* xb, float xeps, T* xout) {                                                   \
        gemm_small_impl<T>(x, w, bias, out, M, N, K, act, mode, residual, tmp, gamma, beta, eps, counter,     \
                           offsets, seqs, xf, xg, xb, xeps, xout);                                            \
    }

GEMM_SMALL_KERNEL(f16_t, f16)
GEMM_SMALL_KERNEL(bf16_t, bf16)
