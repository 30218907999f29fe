// A transformer's feed-forward block of few token rows in one kernel,
// f16/bf16 (ffn_small_<t>):
//
//   acc += act(x·W1ᵀ + b1)·W2ᵀ (+ b2 + residual, added once)
//
// = Linear(intermediate, act) → Linear(output) with the AddLayerNorm after
// it left to the next Linear (or pooling) as a deferred LayerNorm
// (gemm_small.cu's mode 2 output, read there through `xf`).
//
// Why: gemm_small made each of a layer's Linears one node of ~3 µs in the
// (1, 16) graph, and a node's cost there is mostly the dependency itself
// (~1.2 µs) and the latency of its loads. The FFN's second Linear needs the
// whole intermediate row, which no one block has; layer_ffn_small
// (small_layer.cu) joined the two with a grid barrier and streamed W2 from
// few blocks, and was slower than two nodes. Here the second product is
// split over K instead: the block that computed 16 intermediate columns
// multiplies them by the matching 16 columns of W2 (12 KB at hidden 384)
// and adds its partial rows into `acc` with float2 atomics at L2. Every
// block reads a slice of both weights, so the weight reads use the whole
// GPU as gemm_small's do, and the layer has 4 nodes instead of 5.
//
// x [M, K] (or LayerNorm(xf) as in gemm_small: xf, xg, xb, xeps, xout),
// w1 [N1, K], b1 [N1], w2 [N2, N1], b2 [N2], residual [M, N2] (x's rows:
// the AddLayerNorm adds the FFN's input), acc [M, N2] f32.
//
// acc must be zero when the kernel starts: the planner gives the fused FFNs
// of a plan accumulators in rotation from a buffer that is zero between
// graphs (Loc::Accum), and each kernel zeroes the one the next fused FFN
// will use (`zero`, `zero_n` floats, after pdl_wait: its last reader, the
// Linear after the FFN before, has completed by then). The last one zeroes
// the first's, so the buffer is zero again when the graph ends.
//
// Numerics: act(...) is rounded to T as the unfused path stores it; the
// second product and the residual are summed in f32 in an order that
// depends on the atomics (not bit-for-bit reproducible across replays).
//
// Grid: N1 / GS_NB blocks of GS_THREADS (gemm_small's product, then the
// block's 16 × N2 slice of the second product, its n8-tiles dealt to the
// warps). Host-checked: T = f16/bf16, 1 <= M <= GS_MAXM, K % 32 == 0,
// N1 % GS_NB == 0, N1 % 32 == 0, N2 == K, N2 % 8 == 0, N2 <= 8·GS_WARPS·FS_TPW,
// a deferred LayerNorm (xf) K <= 32·GS_WARPS·4.
//
// Uses gs_product_rows (gemm_small.cu), mma16816
// (attention_tc.cu), sl_live_rows (small_layer.cu).

#define FS_TPW 16  // most n8-tiles of the second product a warp (N2 <= 1024)
#define FS_LDH (GS_NB + 8)  // row stride of the intermediate slice in shared memory (conflict-free A loads)

// Adds (a, b) to p[0], p[1] at L2.
__device__ __forceinline__ void fs_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

template <typename T>
__device__ __forceinline__ void ffn_small_impl(const T* x, const T* __restrict__ w1, const T* __restrict__ b1,
                                               int act, const T* __restrict__ w2, const T* __restrict__ b2,
                                               const T* residual, float* acc, float* zero, int zero_n, int M,
                                               int N1, int K, int N2, const int* offsets, int seqs,
                                               const float* xf, const T* __restrict__ xg,
                                               const T* __restrict__ xb, float xeps, T* xout) {
    constexpr int MTMAX = GS_MAXM / 16;
    __shared__ float red[GS_WARPS][MTMAX][16 * GS_NB];
    __shared__ float st[2][GS_WARPS][16];
    __shared__ __align__(16) T hs[GS_MAXM * FS_LDH];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int n0 = blockIdx.x * GS_NB;
    const int rr = tid / GS_NB, nn = tid % GS_NB;
    const float bn = b1 != 0 ? to_f32(b1[n0 + nn]) : 0.0f;
    // Readable before pdl_wait, as in gemm_small (the inputs' live rows).
    const int live = sl_live_rows(M, offsets, seqs);
    const int mts = (live + 15) >> 4;

    // 1. The block's 16 intermediate columns over all of K (pdl_wait inside).
    gs_product_rows<T>(mts, x, xf, w1, N1, K, live, n0, xg, xb, xeps, xout, red, st);

    // This block's W2 columns n0..n0+15 of the warp's n8-tiles (the mma B
    // fragment: column g of the tile, k = 2·t4 (+1) and 2·t4 + 8 (+1)),
    // loaded while the partials meet.
    const int tiles = N2 >> 3;
    unsigned wb[FS_TPW][2];
#pragma unroll
    for (int i = 0; i < FS_TPW; i++) {
        const int nt = warp + i * GS_WARPS;
        if (nt < tiles) {
            const T* p = w2 + (size_t)(nt * 8 + g) * N1 + n0 + 2 * t4;
            wb[i][0] = __ldg(reinterpret_cast<const unsigned*>(p));
            wb[i][1] = __ldg(reinterpret_cast<const unsigned*>(p + 8));
        } else {
            wb[i][0] = wb[i][1] = 0u;
        }
    }
    // The next fused FFN's accumulator, zeroed (its last reader is done).
    {
        const int per = (((zero_n + (int)gridDim.x - 1) / (int)gridDim.x) + 3) & ~3;
        const int z0 = blockIdx.x * per, z1 = min(z0 + per, zero_n);
        for (int i = z0 + 4 * tid; i < z1; i += 4 * GS_THREADS)
            *reinterpret_cast<float4*>(zero + i) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();

    // 2. act(· + b1), rounded to T, into hs (rows past `live`: zeros).
#pragma unroll
    for (int mt = 0; mt < MTMAX; mt++) {
        if (mt >= mts) break;
        const int r = mt * 16 + rr;
        float v = bn;
#pragma unroll
        for (int q = 0; q < GS_WARPS; q++) v += red[q][mt][tid];
        hs[r * FS_LDH + nn] = r < live ? from_f32<T>(apply_act(v, act)) : from_f32<T>(0.0f);
    }
    __syncthreads();

    // 3. The block's partial of the second product, K = its 16 columns: one
    // mma k-step per m-tile and n8-tile, added into acc. Block 0 adds the
    // bias and the residual (x's rows; in the deferred case block 0 itself
    // wrote them to xout == residual, visible after the barriers above).
    for (int mt = 0; mt < mts; mt++) {
        const int ra = mt * 16 + g, rb = ra + 8;
        unsigned a[4];
        a[0] = *reinterpret_cast<const unsigned*>(&hs[ra * FS_LDH + 2 * t4]);
        a[1] = *reinterpret_cast<const unsigned*>(&hs[rb * FS_LDH + 2 * t4]);
        a[2] = *reinterpret_cast<const unsigned*>(&hs[ra * FS_LDH + 2 * t4 + 8]);
        a[3] = *reinterpret_cast<const unsigned*>(&hs[rb * FS_LDH + 2 * t4 + 8]);
#pragma unroll
        for (int i = 0; i < FS_TPW; i++) {
            const int nt = warp + i * GS_WARPS;
            if (nt >= tiles) break;  // warp-uniform
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma16816(c, a, wb[i][0], wb[i][1], T());
            const int col = nt * 8 + 2 * t4;
            if (blockIdx.x == 0) {
                const float e0 = b2 != 0 ? to_f32(b2[col]) : 0.0f, e1 = b2 != 0 ? to_f32(b2[col + 1]) : 0.0f;
                if (ra < live) {
                    c[0] += e0 + to_f32(residual[(size_t)ra * N2 + col]);
                    c[1] += e1 + to_f32(residual[(size_t)ra * N2 + col + 1]);
                }
                if (rb < live) {
                    c[2] += e0 + to_f32(residual[(size_t)rb * N2 + col]);
                    c[3] += e1 + to_f32(residual[(size_t)rb * N2 + col + 1]);
                }
            }
            if (ra < live) fs_add2(acc + (size_t)ra * N2 + col, c[0], c[1]);
            if (rb < live) fs_add2(acc + (size_t)rb * N2 + col, c[2], c[3]);
        }
    }
}

#define FFN_SMALL_KERNEL(T, SUF)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                                     \
        ffn_small_##SUF(const T* x, const T* w1, const T* b1, int act, const T* w2, const T* b2,                \
                        const T* residual, float* acc, float* zero, int zero_n, int M, int N1, int K, int N2,   \
                        const int* offsets, int seqs, const float* xf, const T* xg, const T* xb, float xeps,   \
                        T* xout) {                                                                               \
        ffn_small_impl<T>(x, w1, b1, act, w2, b2, residual, acc, zero, zero_n, M, N1, K, N2, offsets, seqs, xf, \
                          xg, xb, xeps, xout);                                                                   \
    }

FFN_SMALL_KERNEL(f16_t, f16)
FFN_SMALL_KERNEL(bf16_t, bf16)
