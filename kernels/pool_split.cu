// Mean / max / sum pooling of long sequences, parallel over tokens: the
// sequence's tokens are split over the blocks of grid row y, so a (32, 512)
// batch runs on 32 × 16 blocks instead of 32 (one block a sequence left 100
// of an H200's 132 SMs idle and each of the rest streaming 786 KB alone).
//
// pool_split_<t>    padded: x [rows·seq, hidden], mask i32 [rows, seq]
// pool_split_packed_<t>   packed: x [tokens, hidden], offsets i32 [rows + 1]
//   (sequence s is slots offsets[s] .. offsets[s+1], clamped to [0, tokens])
// Both: `skip` (null, or i32 [rows]: include_prompt = false, the sequence's
// first skip[s] positions left out, as pool_skip / pool_packed_skip), out f32
// [rows, hidden], mode POOL_MEAN / POOL_MAX / POOL_SUM (pool.cu's codes and
// results: the mean over the used tokens divided by max(count, 1e-9), the max
// 0 where a sequence has none), then if `normalize` each row L2-normalised.
//
// A sequence of n pooled positions takes ceil(n / span) blocks of its grid
// row, span = max(PS_TOKENS, ceil(n / gridDim.y)) (so any n fits the grid);
// the others exit at once. Each block reduces its span into `part` (f32
// [rows, gridDim.y, hidden]) and `pcount` (f32 [rows, gridDim.y]); the last of
// the sequence's blocks (counter[s], reset by it so the graph replays)
// combines the partials in order y = 0, 1, ... (deterministic), divides,
// normalises and writes the row. A sequence of one block writes directly.
//
// Threads: hidden / 8 vectors of 8 columns (16-byte loads of f16/bf16, two
// float4 of f32) × PS_LANES = POOL_THREADS / (hidden / 8) token lanes;
// hidden % 8 == 0 and hidden <= 8 · POOL_THREADS (host-checked).

#define PS_TOKENS 32
#define PS_UNROLL 4

template <typename T>
__device__ __forceinline__ void pool_split_impl(const T* __restrict__ x, const int* __restrict__ mask,
                                                const int* __restrict__ offsets, const int* __restrict__ skip,
                                                float* __restrict__ out, int slots, int hidden, int mode,
                                                int normalize, float* __restrict__ part,
                                                float* __restrict__ pcount, unsigned* __restrict__ counter) {
    __shared__ __align__(16) float red[POOL_THREADS * 8];
    __shared__ float sh[32];
    __shared__ bool s_last;
    const int s = blockIdx.x, y = blockIdx.y, splits = gridDim.y;
    const int tid = threadIdx.x;
    const int nv = hidden >> 3, lanes = POOL_THREADS / nv;
    const int v = tid % nv, r = tid / nv;
    // The sequence's slots [begin, end) and its first pooled one.
    int begin, end;
    if (offsets) {
        begin = min(max(offsets[s], 0), slots);
        end = max(min(offsets[s + 1], slots), begin);
    } else {
        begin = s * slots;
        end = begin + slots;
    }
    const int start = skip ? begin + min(max(skip[s], 0), end - begin) : begin;
    const int n = end - start;
    const int span = max(PS_TOKENS, (n + splits - 1) / splits);
    const int blocks = max((n + span - 1) / span, 1);
    if (y >= blocks) return;
    const int t_begin = start + y * span, t_end = min(t_begin + span, end);

    const bool is_max = mode == POOL_MAX;
    const float init = is_max ? NEG_INF_F : 0.0f;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = init;
    float used = 0.0f;
    if (r < lanes) {
        const T* xc = x + 8 * v;
        for (int t0 = t_begin + r; t0 < t_end; t0 += PS_UNROLL * lanes) {
            float val[PS_UNROLL][8];
            bool use[PS_UNROLL];
            // Every load issued before any is used (no mask wait first).
#pragma unroll
            for (int u = 0; u < PS_UNROLL; u++) {
                const int t = t0 + u * lanes;
                const bool in = t < t_end;
                ld8(xc + (size_t)(in ? t : t_begin) * hidden, val[u]);
                use[u] = in && (mask == 0 || mask[t] != 0);
            }
#pragma unroll
            for (int u = 0; u < PS_UNROLL; u++) {
                if (!use[u]) continue;
                used += 1.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[e] = is_max ? fmaxf(acc[e], val[u][e]) : acc[e] + val[u][e];
            }
        }
    }
    // The token lanes meet in shared memory; thread v < nv holds the block's
    // result for its 8 columns, and (v == 0 threads' counts) the tokens used.
    if (r < lanes) {
#pragma unroll
        for (int e = 0; e < 8; e++) red[r * hidden + 8 * v + e] = acc[e];
        if (v == 0) sh[r] = used;
    }
    __syncthreads();
    float cnt = 0.0f;
    for (int i = 0; i < lanes; i++) cnt += sh[i];
    if (tid < nv) {
        for (int i = 1; i < lanes; i++)
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float w = red[i * hidden + 8 * tid + e];
                acc[e] = is_max ? fmaxf(acc[e], w) : acc[e] + w;
            }
    }
    if (blocks > 1) {
        // Publish this block's partial, count it, and let the last one go on.
        const size_t slot = (size_t)s * splits + y;
        if (tid < nv) st8(part + slot * hidden + 8 * tid, acc);
        if (tid == 0) pcount[slot] = cnt;
        __threadfence();
        __syncthreads();
        if (tid == 0) s_last = atomicAdd(counter + s, 1u) == (unsigned)blocks - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        if (tid == 0) counter[s] = 0u;
        // The partials in order (L2 reads: other blocks wrote them).
        cnt = 0.0f;
        for (int i = 0; i < blocks; i++) cnt += __ldcg(pcount + (size_t)s * splits + i);
        if (tid < nv) {
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = init;
            for (int i = 0; i < blocks; i++) {
                const float* p = part + ((size_t)s * splits + i) * hidden + 8 * tid;
                const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
                const float4 b = __ldcg(reinterpret_cast<const float4*>(p + 4));
                const float w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int e = 0; e < 8; e++) acc[e] = is_max ? fmaxf(acc[e], w[e]) : acc[e] + w[e];
            }
        }
    }
    float sq = 0.0f;
    if (tid < nv) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (is_max) {
                if (acc[e] == NEG_INF_F) acc[e] = 0.0f;
            } else if (mode == POOL_MEAN) {
                acc[e] = acc[e] / fmaxf(cnt, 1e-9f);
            }
            sq += acc[e] * acc[e];
        }
    }
    float inv = 1.0f;
    if (normalize) inv = 1.0f / fmaxf(sqrtf(block_sum(sq, sh)), 1e-12f);
    if (tid < nv) {
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= inv;
        st8(out + (size_t)s * hidden + 8 * tid, acc);
    }
}

#define POOL_SPLIT_KERNEL(T, SUF)                                                                             \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                                \
        pool_split_##SUF(const T* x, const int* mask, const int* skip, float* out, int seq, int hidden,       \
                         int mode, int normalize, float* part, float* pcount, unsigned* counter) {            \
        pdl_enter();                                                                                          \
        pool_split_impl<T>(x, mask, nullptr, skip, out, seq, hidden, mode, normalize, part, pcount, counter); \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                                \
        pool_split_packed_##SUF(const T* x, const int* offsets, const int* skip, float* out, int tokens,      \
                                int hidden, int mode, int normalize, float* part, float* pcount,              \
                                unsigned* counter) {                                                          \
        pdl_enter();                                                                                          \
        pool_split_impl<T>(x, nullptr, offsets, skip, out, tokens, hidden, mode, normalize, part, pcount,     \
                           counter);                                                                          \
    }

POOL_SPLIT_KERNEL(float, f32)
POOL_SPLIT_KERNEL(f16_t, f16)
POOL_SPLIT_KERNEL(bf16_t, bf16)
