// Linear layers of few token rows (M <= GS_MAXM) on tensor cores, f16/bf16,
// with the work that follows a matmul done in the same kernel:
//
//   mode 0: out = act(x·Wᵀ + bias)                       (bias + activation epilogue)
//   mode 1: out = LayerNorm(x·Wᵀ + bias + residual)      (a Linear and the AddLayerNorm after it)
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
// fragments use small_layer.cu's permutation of k (sl_mma32: one 16-byte load
// of A per row and of B per column per 32 values of K). The warps' partial
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
// 16 (sl_live_rows), as small_layer.cu does: rows past them are the batch's
// empty tail, which nothing reads.
//
// Host-checked requirements: T = f16/bf16, 1 <= M <= GS_MAXM, K % 32 == 0,
// rows 16-byte aligned; mode 1 also N % 4 == 0 and N <= 32·4·SL_LN_J.
//
// Uses mma16816 (attention_tc.cu), sl_mma32 / sl_live_rows / sl_last_block /
// sl_ln_rows (small_layer.cu).

#define GS_WARPS 8
#define GS_THREADS (32 * GS_WARPS)
#define GS_NB 16   // output columns per block
#define GS_MAXM 64 // most rows (4 m16-tiles)
#define GS_G 6     // chunks of 32 values of K in flight per warp and round

template <typename T>
__device__ __forceinline__ void gemm_small_impl(const T* x, const T* __restrict__ w, const T* __restrict__ bias,
                                                T* out, int M, int N, int K, int act, int mode, const T* residual,
                                                float* tmp, const T* __restrict__ gamma,
                                                const T* __restrict__ beta, float eps, unsigned* counter,
                                                const int* __restrict__ offsets, int seqs) {
    constexpr int MTMAX = GS_MAXM / 16;
    __shared__ float red[GS_WARPS][MTMAX][16 * GS_NB];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int n0 = blockIdx.x * GS_NB;
    const int live = sl_live_rows(M, offsets, seqs);
    const int mts = (live + 15) >> 4;
    const int chunks = K >> 5;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    float c[MTMAX][2][4];
#pragma unroll
    for (int mt = 0; mt < MTMAX; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) c[mt][j][e] = 0.0f;

    // This lane's weight rows (the column g of each n8-tile) and A columns.
    const bool w_ok0 = n0 + g < N, w_ok1 = n0 + 8 + g < N;
    const T* w0 = w + (size_t)min(n0 + g, N - 1) * K + 8 * t4;
    const T* w1 = w + (size_t)min(n0 + 8 + g, N - 1) * K + 8 * t4;
    const T* xa = x + (size_t)g * K + 8 * t4;

    for (int c0 = warp; c0 < chunks; c0 += GS_WARPS * GS_G) {
        uint4 b[GS_G][2];
#pragma unroll
        for (int i = 0; i < GS_G; i++) {
            const int k0 = (c0 + i * GS_WARPS) * 32;
            const bool in = c0 + i * GS_WARPS < chunks;
            b[i][0] = in && w_ok0 ? __ldg(reinterpret_cast<const uint4*>(w0 + k0)) : zero;
            b[i][1] = in && w_ok1 ? __ldg(reinterpret_cast<const uint4*>(w1 + k0)) : zero;
        }
#pragma unroll
        for (int mt = 0; mt < MTMAX; mt++) {
            if (mt >= mts) break;  // block-uniform
            const int ra = mt * 16 + g;
            uint4 alo[GS_G], ahi[GS_G];
#pragma unroll
            for (int i = 0; i < GS_G; i++) {
                const int k0 = (c0 + i * GS_WARPS) * 32;
                const bool in = c0 + i * GS_WARPS < chunks;
                const T* p = xa + (size_t)(mt * 16) * K + k0;
                alo[i] = in && ra < live ? *reinterpret_cast<const uint4*>(p) : zero;
                ahi[i] = in && ra + 8 < live ? *reinterpret_cast<const uint4*>(p + (size_t)8 * K) : zero;
            }
#pragma unroll
            for (int i = 0; i < GS_G; i++) {
                sl_mma32<T>(c[mt][0], alo[i], ahi[i], b[i][0]);
                sl_mma32<T>(c[mt][1], alo[i], ahi[i], b[i][1]);
            }
        }
    }

    // Partials to shared memory: c[mt][j] = rows g, g + 8 of the m-tile,
    // columns j·8 + 2·t4 (+1).
#pragma unroll
    for (int mt = 0; mt < MTMAX; mt++) {
        if (mt >= mts) break;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = j * 8 + 2 * t4;
            *reinterpret_cast<float2*>(&red[warp][mt][g * GS_NB + col]) = make_float2(c[mt][j][0], c[mt][j][1]);
            *reinterpret_cast<float2*>(&red[warp][mt][(g + 8) * GS_NB + col]) =
                make_float2(c[mt][j][2], c[mt][j][3]);
        }
    }
    __syncthreads();

    // One output value per thread and m-tile (16 × GS_NB = GS_THREADS).
    const int rr = tid / GS_NB, n = n0 + tid % GS_NB;
    for (int mt = 0; mt < mts; mt++) {
        const int r = mt * 16 + rr;
        if (r >= live || n >= N) continue;
        float v = 0.0f;
#pragma unroll
        for (int q = 0; q < GS_WARPS; q++) v += red[q][mt][tid];
        if (bias != 0) v += to_f32(bias[n]);
        if (mode == 0) {
            out[(size_t)r * N + n] = from_f32<T>(apply_act(v, act));
        } else {
            tmp[(size_t)r * N + n] = v + to_f32(residual[(size_t)r * N + n]);
        }
    }
    if (mode == 0) return;
    if (!sl_last_block(counter, gridDim.x)) return;
    sl_ln_rows<T>(tmp, gamma, beta, eps, out, live, N);
    if (tid == 0) *counter = 0u;
}

#define GEMM_SMALL_KERNEL(T, SUF)                                                                             \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                                  \
        gemm_small_##SUF(const T* x, const T* w, const T* bias, T* out, int M, int N, int K, int act, int mode, \
                         const T* residual, float* tmp, const T* gamma, const T* beta, float eps,               \
                         unsigned* counter, const int* offsets, int seqs) {                                    \
        gemm_small_impl<T>(x, w, bias, out, M, N, K, act, mode, residual, tmp, gamma, beta, eps, counter,     \
                           offsets, seqs);                                                                    \
    }

GEMM_SMALL_KERNEL(f16_t, f16)
GEMM_SMALL_KERNEL(bf16_t, bf16)
