// Multi-head self-attention over a fused QKV projection, with the padding mask.
//
// qkv  : [batch*seq, 3*heads*hd], laid out [q | k | v], heads contiguous inside each part
// mask : i32 [batch, seq], keys with mask 0 get -inf before the softmax
// out  : [batch*seq, heads*hd]
//
// One block of ATT_THREADS threads per (query tile of ATT_QT queries, head, batch).
// The query tile (pre-scaled by 1/sqrt(hd)) stays in shared memory; keys and
// then values stream through a shared buffer ATT_KC rows at a time; the
// tile's full score rows live in shared memory, so the softmax is exact
// (max-subtracted, f32) without an online rescale. Threads compute 4x4
// (scores) and 4x(DMAX/16) (output) register tiles. DMAX is the head size
// rounded up to 32, 64 or 128; the tail is zero-padded in shared memory.
// A query whose keys are all masked gets zeros.
//
// attention_bias_<t>_d<N> (MPNet): the same, plus a relative position bias
// added to every scaled score before the mask, computed in-kernel from the
// table `pbias` [heads, 2*radius+1] (compute dtype): score(h, i, j) +=
// pbias[h, clamp(j - i, -radius, radius) + radius] for query i and key j of
// the row (see `rel_bias` and model::program::PositionBias).
//
// Dynamic shared memory (floats): ATT_QT*(DMAX+1) + ATT_KC*(DMAX+1) + ATT_QT*(seq|1);
// the host computes the same (attention_smem_bytes in exec.rs).

#define ATT_QT 32
#define ATT_KC 64
#define ATT_THREADS 128

// MPNet's relative attention bias of query `q` and key `k` (positions within
// their sequence) from head h's row `row` of the [heads, 2*radius+1] table.
template <typename T>
__device__ __forceinline__ float rel_bias(const T* __restrict__ row, int radius, int q, int k) {
    return to_f32(row[min(max(k - q, -radius), radius) + radius]);
}

template <typename T, int DMAX, bool BIAS>
__device__ __forceinline__ void attention_impl(const T* __restrict__ qkv, const int* __restrict__ mask,
                                               T* __restrict__ out, int seq, int heads, int hd, float scale,
                                               const T* __restrict__ pbias, int radius) {
    constexpr int DP = DMAX + 1;
    constexpr int DJ = DMAX / 16;
    extern __shared__ float smem[];
    float* sQ = smem;                 // [ATT_QT][DP]
    float* sKV = sQ + ATT_QT * DP;    // [ATT_KC][DP]
    float* sP = sKV + ATT_KC * DP;    // [ATT_QT][ld]
    const int ld = seq | 1;

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int q0 = blockIdx.x * ATT_QT;
    const int tid = threadIdx.x;
    const int HD = heads * hd;
    const size_t row_stride = (size_t)3 * HD;
    const T* base = qkv + (size_t)b * seq * row_stride + (size_t)h * hd;
    const int* mrow = mask + (size_t)b * seq;
    const T* brow = BIAS ? pbias + (size_t)h * (2 * radius + 1) : nullptr;

    for (int i = tid; i < ATT_QT * DMAX; i += ATT_THREADS) {
        const int qi = i / DMAX, d = i % DMAX;
        float v = 0.0f;
        if (q0 + qi < seq && d < hd) v = to_f32(base[(size_t)(q0 + qi) * row_stride + d]) * scale;
        sQ[qi * DP + d] = v;
    }

    // Scores: thread (tq, tk) owns queries tq + 8*ii and keys tk + 16*jj of each chunk.
    const int tq = tid >> 4;
    const int tk = tid & 15;
    for (int c0 = 0; c0 < seq; c0 += ATT_KC) {
        __syncthreads();  // sQ written / previous chunk consumed
        for (int i = tid; i < ATT_KC * DMAX; i += ATT_THREADS) {
            const int kj = i / DMAX, d = i % DMAX;
            float v = 0.0f;
            if (c0 + kj < seq && d < hd) v = to_f32(base[(size_t)(c0 + kj) * row_stride + HD + d]);
            sKV[kj * DP + d] = v;
        }
        __syncthreads();
        float acc[4][4];
#pragma unroll
        for (int ii = 0; ii < 4; ii++)
#pragma unroll
            for (int jj = 0; jj < 4; jj++) acc[ii][jj] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < DMAX; d++) {
            float qv[4], kv[4];
#pragma unroll
            for (int ii = 0; ii < 4; ii++) qv[ii] = sQ[(tq + 8 * ii) * DP + d];
#pragma unroll
            for (int jj = 0; jj < 4; jj++) kv[jj] = sKV[(tk + 16 * jj) * DP + d];
#pragma unroll
            for (int ii = 0; ii < 4; ii++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++) acc[ii][jj] = fmaf(qv[ii], kv[jj], acc[ii][jj]);
        }
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            const int kj = c0 + tk + 16 * jj;
            if (kj < seq) {
                const bool keep = mrow[kj] != 0;
#pragma unroll
                for (int ii = 0; ii < 4; ii++) {
                    float v = acc[ii][jj];
                    if (BIAS) v += rel_bias(brow, radius, q0 + tq + 8 * ii, kj);
                    sP[(tq + 8 * ii) * ld + kj] = keep ? v : NEG_INF_F;
                }
            }
        }
    }
    __syncthreads();

    // Softmax over each score row: one warp per row.
    {
        const int warp = tid >> 5, lane = tid & 31;
        for (int qi = warp; qi < ATT_QT; qi += ATT_THREADS / 32) {
            float* row = sP + qi * ld;
            float m = NEG_INF_F;
            for (int j = lane; j < seq; j += 32) m = fmaxf(m, row[j]);
            m = warp_max(m);
            if (m == NEG_INF_F) {
                for (int j = lane; j < seq; j += 32) row[j] = 0.0f;
            } else {
                float s = 0.0f;
                for (int j = lane; j < seq; j += 32) {
                    const float e = expf(row[j] - m);
                    row[j] = e;
                    s += e;
                }
                const float inv = 1.0f / warp_sum(s);
                for (int j = lane; j < seq; j += 32) row[j] *= inv;
            }
        }
    }

    // out = P . V: thread (tq, td) owns queries tq + 8*ii and dims td + 16*jj.
    const int td = tid & 15;
    float o[4][DJ];
#pragma unroll
    for (int ii = 0; ii < 4; ii++)
#pragma unroll
        for (int jj = 0; jj < DJ; jj++) o[ii][jj] = 0.0f;
    for (int c0 = 0; c0 < seq; c0 += ATT_KC) {
        __syncthreads();  // softmax done / previous chunk consumed
        for (int i = tid; i < ATT_KC * DMAX; i += ATT_THREADS) {
            const int kj = i / DMAX, d = i % DMAX;
            float v = 0.0f;
            if (c0 + kj < seq && d < hd) v = to_f32(base[(size_t)(c0 + kj) * row_stride + 2 * HD + d]);
            sKV[kj * DP + d] = v;
        }
        __syncthreads();
        const int kend = min(ATT_KC, seq - c0);
#pragma unroll 4
        for (int j = 0; j < kend; j++) {
            float pv[4], vv[DJ];
#pragma unroll
            for (int ii = 0; ii < 4; ii++) pv[ii] = sP[(tq + 8 * ii) * ld + c0 + j];
#pragma unroll
            for (int jj = 0; jj < DJ; jj++) vv[jj] = sKV[j * DP + td + 16 * jj];
#pragma unroll
            for (int ii = 0; ii < 4; ii++)
#pragma unroll
                for (int jj = 0; jj < DJ; jj++) o[ii][jj] = fmaf(pv[ii], vv[jj], o[ii][jj]);
        }
    }
#pragma unroll
    for (int ii = 0; ii < 4; ii++) {
        const int qi = q0 + tq + 8 * ii;
        if (qi < seq) {
            T* orow = out + ((size_t)b * seq + qi) * HD + (size_t)h * hd;
#pragma unroll
            for (int jj = 0; jj < DJ; jj++) {
                const int d = td + 16 * jj;
                if (d < hd) orow[d] = from_f32<T>(o[ii][jj]);
            }
        }
    }
}

#define ATTENTION_KERNEL(T, SUF, DMAX)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                              \
        attention_##SUF##_d##DMAX(const T* qkv, const int* mask, T* out, int seq, int heads, int hd,      \
                                  float scale) { pdl_enter();                                                           \
        attention_impl<T, DMAX, false>(qkv, mask, out, seq, heads, hd, scale, nullptr, 0);                 \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                              \
        attention_bias_##SUF##_d##DMAX(const T* qkv, const int* mask, T* out, int seq, int heads, int hd, \
                                       float scale, const T* pbias, int radius) { pdl_enter();                          \
        attention_impl<T, DMAX, true>(qkv, mask, out, seq, heads, hd, scale, pbias, radius);               \
    }

ATTENTION_KERNEL(float, f32, 32)
ATTENTION_KERNEL(float, f32, 64)
ATTENTION_KERNEL(float, f32, 128)
ATTENTION_KERNEL(f16_t, f16, 32)
ATTENTION_KERNEL(f16_t, f16, 64)
ATTENTION_KERNEL(f16_t, f16, 128)
ATTENTION_KERNEL(bf16_t, bf16, 32)
ATTENTION_KERNEL(bf16_t, bf16, 64)
ATTENTION_KERNEL(bf16_t, bf16, 128)
