// Variable-length multi-head self-attention over a packed batch: every
// sequence of the batch lies end to end in one token buffer, and each query
// attends to the keys of its own sequence only (no mask: every key of a
// sequence is real).
//
// qkv   : [tokens, 3*heads*hd], laid out [q | k | v], heads contiguous inside each part
// tiles : i32 [max_tiles][4], the work list the host writes for every batch
//         (plan.rs `write_tile_table`), one entry per query tile:
//           {q_start, q_count, kv_start, kv_len}
//         queries q_start .. q_start+q_count (at most the kernel's tile size)
//         attend to the keys kv_start .. kv_start+kv_len (their sequence);
//         kv_len == 0 marks a tail tile, whose rows get zeros; q_count == 0 an
//         unused entry (its blocks exit at once).
// out   : [tokens, heads*hd]
// grid  : (max_tiles * heads); block b runs tile b / heads for head b % heads,
//         so the heads of one tile are neighbours and the host's order of the
//         tiles (longest sequences first) is the order blocks are dispatched.
//
// The grid is fixed when a graph is captured; the table's contents change per
// batch. Every entry is checked against `tokens` (and the tile size, and for
// the CUDA-core kernel `max_len`) before anything is read, so no contents of
// the table can make a block read or write outside the buffers: an entry that
// breaks a bound is skipped.
//
// Two kernels:
// * attention_varlen_tc_<t>_d<D> (f16/bf16, D = 32, 64, 128): tensor cores,
//   attention_tc.cu's tc_attend (4 warps x 16 queries = 64 queries per tile,
//   K and V double-buffered through shared memory, mma.sync.m16n8k16 for
//   Q.K^T and P.V, online softmax in f32) on the tile's own sequence.
// * attention_varlen_<t>_d<DMAX> (f32, and any head size <= 128): CUDA cores,
//   as attention.cu: 32 queries per tile, exact softmax over score rows held
//   in dynamic shared memory of VA_QT*(max_len|1) floats (plus the Q and K/V
//   tiles), so the host sizes it by the program's longest sequence.
//
// attention_varlen_bias_<t>_d<DMAX> and attention_varlen_tc_bias_<t>_d<D>
// (MPNet): plus the relative position bias of attention.cu's rel_bias, by
// positions within the sequence, added to the scaled scores.
//
// attention_varlen_tc_band_<t>_d<D> (decoders; D = 32, 64, 128, 256): the
// tensor-core kernel with grouped-query heads of head_dim <= D values (qkv
// rows of (heads + 2·kv_heads)·head_dim) and the key band [i - left, i +
// right] of attention_tc.cu's
// band kernels, by positions within the sequence; attention_varlen_tc_win_
// is it with kv_heads = heads and left = right = window.
//
// Uses tc_attend and TC_* from attention_tc.cu and ATT_* from
// attention.cu (one translation unit, those files come first).

#define VT_QT TC_QT
#define VA_QT ATT_QT

// Reads and bounds-checks a tile entry; false when the block has nothing to do
// or the entry is out of bounds.
__device__ __forceinline__ bool varlen_tile(const int* __restrict__ tiles, int tile, int qt, int tokens,
                                            int max_len, int& q_start, int& q_count, int& kv_start, int& kv_len) {
    const int4 e = reinterpret_cast<const int4*>(tiles)[tile];
    q_start = e.x;
    q_count = e.y;
    kv_start = e.z;
    kv_len = e.w;
    if (q_count <= 0 || q_count > qt || q_start < 0 || q_start > tokens - q_count) return false;
    if (kv_len == 0) return true;  // tail tile: zeros
    if (kv_len < 0 || kv_len > max_len || kv_start < 0 || kv_start > tokens - kv_len) return false;
    // The queries belong to the sequence.
    return q_start >= kv_start && q_start - kv_start <= kv_len - q_count;
}

// Zeros head h of rows q_start .. q_start+q_count (a tail tile).
template <typename T>
__device__ __forceinline__ void varlen_zero(T* out, int q_start, int q_count, int HD, int h, int hd) {
    for (int i = threadIdx.x; i < q_count * hd; i += blockDim.x) {
        const int r = i / hd, d = i % hd;
        out[(size_t)(q_start + r) * HD + (size_t)h * hd + d] = from_f32<T>(0.0f);
    }
}

template <typename T, int D, bool BIAS, bool BAND = false, bool GQA = false>
__device__ __forceinline__ void attention_varlen_tc_impl(const T* __restrict__ qkv, const int* __restrict__ tiles,
                                                         T* __restrict__ out, int heads, float scale, int tokens,
                                                         const T* __restrict__ pbias, int radius, int kv_heads = 0,
                                                         int left = 0, int right = 0, int head_dim = D) {
    const int tile = blockIdx.x / heads, h = blockIdx.x % heads;
    int q_start, q_count, kv_start, kv_len;
    // Tensor-core tiles never exceed `tokens` keys; `tokens` bounds kv_len.
    if (!varlen_tile(tiles, tile, VT_QT, tokens, tokens, q_start, q_count, kv_start, kv_len)) return;
    const int hd = GQA ? head_dim : D;
    const int HD = heads * hd;
    if (kv_len == 0) {
        varlen_zero<T>(out, q_start, q_count, HD, h, hd);
        return;
    }
    int koff, voff;
    size_t row_stride;
    tc_kv_offsets<D, GQA>(h, heads, kv_heads, hd, koff, voff, row_stride);
    // Everything is relative to the sequence's first token; keys past its
    // end (the last key block's tail) are masked by the length.
    const int q_first = q_start - kv_start;
    const T* brow = BIAS ? pbias + (size_t)h * (2 * radius + 1) : nullptr;
    tc_attend<T, D, BIAS, false, TC_KB(D), BAND, GQA>(qkv + (size_t)kv_start * row_stride + (size_t)h * hd,
                                                      row_stride, HD, koff, voff, kv_len, q_first,
                                                      q_first + q_count, nullptr, scale, brow, radius,
                                                      out + (size_t)kv_start * HD + (size_t)h * hd, left, right, hd);
}

// Dynamic shared memory (floats): VA_QT*(DMAX+1) + ATT_KC*(DMAX+1) + VA_QT*(max_len|1),
// the same formula as attention.cu with the program's longest sequence for seq
// (attention_smem_bytes in plan.rs).
template <typename T, int DMAX, bool BIAS>
__device__ __forceinline__ void attention_varlen_impl(const T* __restrict__ qkv, const int* __restrict__ tiles,
                                                      T* __restrict__ out, int heads, int hd, float scale,
                                                      int tokens, int max_len, const T* __restrict__ pbias,
                                                      int radius) {
    constexpr int DP = DMAX + 1;
    constexpr int DJ = DMAX / 16;
    extern __shared__ float smem[];
    float* sQ = smem;               // [VA_QT][DP]
    float* sKV = sQ + VA_QT * DP;   // [ATT_KC][DP]
    float* sP = sKV + ATT_KC * DP;  // [VA_QT][ld]
    const int ld = max_len | 1;

    const int tile = blockIdx.x / heads, h = blockIdx.x % heads;
    int q_start, q_count, kv_start, kv_len;
    if (!varlen_tile(tiles, tile, VA_QT, tokens, max_len, q_start, q_count, kv_start, kv_len)) return;
    const int HD = heads * hd;
    if (kv_len == 0) {
        varlen_zero<T>(out, q_start, q_count, HD, h, hd);
        return;
    }
    const int tid = threadIdx.x;
    const size_t row_stride = (size_t)3 * HD;
    const T* base = qkv + (size_t)kv_start * row_stride + (size_t)h * hd;
    const int seq = kv_len;
    const int q0 = q_start - kv_start;
    const T* brow = BIAS ? pbias + (size_t)h * (2 * radius + 1) : nullptr;

    for (int i = tid; i < VA_QT * DMAX; i += ATT_THREADS) {
        const int qi = i / DMAX, d = i % DMAX;
        float v = 0.0f;
        if (qi < q_count && d < hd) v = to_f32(base[(size_t)(q0 + qi) * row_stride + d]) * scale;
        sQ[qi * DP + d] = v;
    }

    const int tq = tid >> 4;
    const int tk = tid & 15;
    for (int c0 = 0; c0 < seq; c0 += ATT_KC) {
        __syncthreads();
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
#pragma unroll
                for (int ii = 0; ii < 4; ii++) {
                    float v = acc[ii][jj];
                    if (BIAS) v += rel_bias(brow, radius, q0 + tq + 8 * ii, kj);
                    sP[(tq + 8 * ii) * ld + kj] = v;
                }
            }
        }
    }
    __syncthreads();

    // Softmax over each score row (seq >= 1 real keys): one warp per row.
    {
        const int warp = tid >> 5, lane = tid & 31;
        for (int qi = warp; qi < VA_QT; qi += ATT_THREADS / 32) {
            float* row = sP + qi * ld;
            float m = NEG_INF_F;
            for (int j = lane; j < seq; j += 32) m = fmaxf(m, row[j]);
            m = warp_max(m);
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

    const int td = tid & 15;
    float o[4][DJ];
#pragma unroll
    for (int ii = 0; ii < 4; ii++)
#pragma unroll
        for (int jj = 0; jj < DJ; jj++) o[ii][jj] = 0.0f;
    for (int c0 = 0; c0 < seq; c0 += ATT_KC) {
        __syncthreads();
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
        const int qi = tq + 8 * ii;
        if (qi < q_count) {
            T* orow = out + ((size_t)q_start + qi) * HD + (size_t)h * hd;
#pragma unroll
            for (int jj = 0; jj < DJ; jj++) {
                const int d = td + 16 * jj;
                if (d < hd) orow[d] = from_f32<T>(o[ii][jj]);
            }
        }
    }
}

#define ATTENTION_VARLEN_TC_KERNEL(T, SUF, D)                                                                  \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                 \
        attention_varlen_tc_##SUF##_d##D(const T* qkv, const int* tiles, T* out, int heads, float scale,      \
                                         int tokens) { pdl_enter();                                                         \
        attention_varlen_tc_impl<T, D, false>(qkv, tiles, out, heads, scale, tokens, nullptr, 0);              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                 \
        attention_varlen_tc_bias_##SUF##_d##D(const T* qkv, const int* tiles, T* out, int heads, float scale, \
                                              int tokens, const T* pbias, int radius) { pdl_enter();                        \
        attention_varlen_tc_impl<T, D, true>(qkv, tiles, out, heads, scale, tokens, pbias, radius);            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                 \
        attention_varlen_tc_win_##SUF##_d##D(const T* qkv, const int* tiles, T* out, int heads, float scale,  \
                                             int tokens, int window) {                                         \
        pdl_enter();                                                                                           \
        attention_varlen_tc_impl<T, D, false, true>(qkv, tiles, out, heads, scale, tokens, nullptr, 0, heads,  \
                                                    window, window);                                           \
    }

#define ATTENTION_VARLEN_TC_BAND_KERNEL(T, SUF, D)                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                 \
        attention_varlen_tc_band_##SUF##_d##D(const T* qkv, const int* tiles, T* out, int heads, int kv_heads, \
                                              int head_dim, float scale, int tokens, int left, int right) {    \
        pdl_enter();                                                                                           \
        attention_varlen_tc_impl<T, D, false, true, true>(qkv, tiles, out, heads, scale, tokens, nullptr, 0,   \
                                                          kv_heads, left, right, head_dim);                    \
    }

#define ATTENTION_VARLEN_KERNEL(T, SUF, DMAX)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                                  \
        attention_varlen_##SUF##_d##DMAX(const T* qkv, const int* tiles, T* out, int heads, int hd,           \
                                         float scale, int tokens, int max_len) { pdl_enter();                               \
        attention_varlen_impl<T, DMAX, false>(qkv, tiles, out, heads, hd, scale, tokens, max_len, nullptr, 0); \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                                  \
        attention_varlen_bias_##SUF##_d##DMAX(const T* qkv, const int* tiles, T* out, int heads, int hd,      \
                                              float scale, int tokens, int max_len, const T* pbias,            \
                                              int radius) { pdl_enter();                                                    \
        attention_varlen_impl<T, DMAX, true>(qkv, tiles, out, heads, hd, scale, tokens, max_len, pbias,        \
                                             radius);                                                          \
    }

ATTENTION_VARLEN_TC_KERNEL(f16_t, f16, 32)
ATTENTION_VARLEN_TC_KERNEL(f16_t, f16, 64)
ATTENTION_VARLEN_TC_KERNEL(f16_t, f16, 128)
ATTENTION_VARLEN_TC_KERNEL(bf16_t, bf16, 32)
ATTENTION_VARLEN_TC_KERNEL(bf16_t, bf16, 64)
ATTENTION_VARLEN_TC_KERNEL(bf16_t, bf16, 128)

ATTENTION_VARLEN_TC_BAND_KERNEL(f16_t, f16, 32)
ATTENTION_VARLEN_TC_BAND_KERNEL(f16_t, f16, 64)
ATTENTION_VARLEN_TC_BAND_KERNEL(f16_t, f16, 128)
ATTENTION_VARLEN_TC_BAND_KERNEL(f16_t, f16, 256)
ATTENTION_VARLEN_TC_BAND_KERNEL(bf16_t, bf16, 32)
ATTENTION_VARLEN_TC_BAND_KERNEL(bf16_t, bf16, 64)
ATTENTION_VARLEN_TC_BAND_KERNEL(bf16_t, bf16, 128)
ATTENTION_VARLEN_TC_BAND_KERNEL(bf16_t, bf16, 256)

ATTENTION_VARLEN_KERNEL(float, f32, 32)
ATTENTION_VARLEN_KERNEL(float, f32, 64)
ATTENTION_VARLEN_KERNEL(float, f32, 128)
ATTENTION_VARLEN_KERNEL(f16_t, f16, 32)
ATTENTION_VARLEN_KERNEL(f16_t, f16, 64)
ATTENTION_VARLEN_KERNEL(f16_t, f16, 128)
ATTENTION_VARLEN_KERNEL(bf16_t, bf16, 32)
ATTENTION_VARLEN_KERNEL(bf16_t, bf16, 64)
ATTENTION_VARLEN_KERNEL(bf16_t, bf16, 128)
