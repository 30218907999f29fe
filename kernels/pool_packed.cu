// Packed batches: per-sequence pooling + optional L2 normalisation, writing f32.
//
// x       : [tokens, hidden] (T), sequences end to end
// offsets : i32 [seqs + 1], the cumulative lengths (cu_seqlens); sequence s is
//           slots offsets[s] .. offsets[s+1]; unused slots repeat the total
// out     : f32 [seqs, hidden]
// mode    : POOL_MEAN (average of the sequence's tokens), POOL_CLS (its first
//           token), POOL_MAX (element-wise maximum), POOL_SUM (the tokens'
//           sum, SPLADE's sum pooling), POOL_LAST (its last token, slot
//           offsets[s+1] - 1); an empty sequence gives
//           zeros in every mode. Then, if `normalize`, out[s] /= max(||out[s]||, 1e-12).
//
// pool_packed_skip_<t> (include_prompt = false): `skip` is i32 [seqs];
// sequence s pools its slots from offsets[s] + skip[s] (a negative skip
// counts as 0; zeros when none are left; the last token is the sequence's
// whenever one is left).
//
// pool_packed_ln_<t>: x is the f32 pre-norm rows of a deferred LayerNorm,
// normalised as they are loaded, as pool.cu's pool_ln_<t>, and writes only
// the first `out_rows` sequences' rows, as it does.
//
// One block of POOL_THREADS (8 warps) per sequence slot, with pool.cu's
// decomposition: columns in chunks of 32*POOL_VPL, warp w reduces the tokens
// w, w+8, ... of the sequence, the partials meet in shared memory. The
// offsets are clamped to [0, tokens] (an inverted range is empty), so no
// contents of the offsets can make a block read outside `x`.

template <typename TX, typename T = TX>
__device__ __forceinline__ void pool_packed_impl(const TX* __restrict__ x, const int* __restrict__ offsets,
                                                 const int* __restrict__ skip, float* __restrict__ out,
                                                 int tokens, int hidden, int mode, int normalize,
                                                 const T* __restrict__ lg = nullptr,
                                                 const T* __restrict__ lb = nullptr, float leps = 0.0f,
                                                 int out_rows = 0x7fffffff) {
    __shared__ __align__(16) float part[POOL_WARPS][POOL_CHUNK];
    __shared__ float sh[32];
    const int s = blockIdx.x;
    // Sequence slots past the batch's own are not written (the host reads
    // only those; a lone text in a 64-sequence budget writes one row).
    if (s >= out_rows) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int begin = min(max(offsets[s], 0), tokens);
    const int end = max(min(offsets[s + 1], tokens), begin);
    const int start = skip ? begin + min(max(skip[s], 0), end - begin) : begin;
    const int len = end - start;
    const TX* xs = x + (size_t)start * hidden;
    float* os = out + (size_t)s * hidden;

    if (len == 0) {
        for (int c = tid; c < hidden; c += POOL_THREADS) os[c] = 0.0f;
        return;
    }
    if constexpr (sizeof(TX) == 4 && sizeof(T) == 2) {  // pool_packed_ln_<t> (pool.cu, pool_ln_vec4)
        if (lg != 0 && mode != POOL_CLS && mode != POOL_LAST && hidden % 128 == 0 && hidden <= POOL_CHUNK) {
            pool_ln_vec4<T>(reinterpret_cast<const float*>(xs), nullptr, len, os, hidden, mode, normalize, lg, lb,
                            leps, part, sh, false);
            return;
        }
    }
    float sq = 0.0f;
    if (mode == POOL_CLS || mode == POOL_LAST) {
        const TX* xr = mode == POOL_LAST ? xs + (size_t)(len - 1) * hidden : xs;
        for (int c = tid; c < hidden; c += POOL_THREADS) {
            const float v = to_f32(xr[c]);
            os[c] = v;
            sq += v * v;
        }
    } else {
        const bool is_max = mode == POOL_MAX;
        const float init = is_max ? NEG_INF_F : 0.0f;
        const float inv_len = 1.0f / (float)len;
        float lgv[POOL_VPL], lbv[POOL_VPL];
        pool_ln_params<T>(lg, lb, hidden, lgv, lbv);
        float keep[POOL_KEEP];
        for (int c0 = 0; c0 < hidden; c0 += POOL_CHUNK) {
            float acc[POOL_VPL];
#pragma unroll
            for (int k = 0; k < POOL_VPL; k++) acc[k] = init;
            for (int t = warp; t < len; t += POOL_WARPS) {
                const TX* xr = xs + (size_t)t * hidden;
                float v[POOL_VPL];
#pragma unroll
                for (int k = 0; k < POOL_VPL; k++) {
                    const int c = c0 + lane + 32 * k;
                    v[k] = c < hidden ? to_f32(xr[c]) : 0.0f;
                }
                if (lg != 0) pool_ln_row<T>(v, lgv, lbv, hidden, leps);
#pragma unroll
                for (int k = 0; k < POOL_VPL; k++)
                    if (c0 + lane + 32 * k < hidden) acc[k] = is_max ? fmaxf(acc[k], v[k]) : acc[k] + v[k];
            }
            __syncthreads();  // previous chunk's partials consumed
#pragma unroll
            for (int k = 0; k < POOL_VPL; k++) part[warp][lane + 32 * k] = acc[k];
            __syncthreads();
#pragma unroll
            for (int j = 0; j < POOL_KEEP; j++) {
                const int i = tid + j * POOL_THREADS;
                const int c = c0 + i;
                float v = 0.0f;
                if (c < hidden) {
                    v = part[0][i];
#pragma unroll
                    for (int w = 1; w < POOL_WARPS; w++) v = is_max ? fmaxf(v, part[w][i]) : v + part[w][i];
                    if (mode == POOL_MEAN) v *= inv_len;
                    sq += v * v;
                    if (hidden > POOL_CHUNK) os[c] = v;
                }
                keep[j] = v;
            }
        }
        // One chunk: written once, normalised (pool.cu, pool_write_kept).
        if (hidden <= POOL_CHUNK) {
            pool_write_kept(keep, sq, os, hidden, normalize, sh);
            return;
        }
    }
    if (normalize) {
        const float total = block_sum(sq, sh);
        const float inv = 1.0f / fmaxf(sqrtf(total), 1e-12f);
        // Each thread rescales exactly the columns it wrote above.
        if (mode == POOL_CLS || mode == POOL_LAST) {
            for (int c = tid; c < hidden; c += POOL_THREADS) os[c] *= inv;
        } else {
            for (int c0 = 0; c0 < hidden; c0 += POOL_CHUNK)
                for (int i = tid; i < POOL_CHUNK; i += POOL_THREADS)
                    if (c0 + i < hidden) os[c0 + i] *= inv;
        }
    }
}

#define POOL_PACKED_KERNEL(T, SUF)                                                                           \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                               \
        pool_packed_##SUF(const T* x, const int* offsets, float* out, int tokens, int hidden, int mode,      \
                          int normalize) { pdl_enter();                                                                   \
        pool_packed_impl<T>(x, offsets, nullptr, out, tokens, hidden, mode, normalize);                      \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                               \
        pool_packed_skip_##SUF(const T* x, const int* offsets, const int* skip, float* out, int tokens,      \
                               int hidden, int mode, int normalize) { pdl_enter();                                        \
        pool_packed_impl<T>(x, offsets, skip, out, tokens, hidden, mode, normalize);                         \
    }

#define POOL_PACKED_LN_KERNEL(T, SUF)                                                                      \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                             \
        pool_packed_ln_##SUF(const float* x, const int* offsets, float* out, int tokens, int hidden,       \
                             int mode, int normalize, const T* gamma, const T* beta, float eps,            \
                             int out_rows) {                                                               \
        pdl_enter();                                                                                       \
        pool_packed_impl<float, T>(x, offsets, nullptr, out, tokens, hidden, mode, normalize, gamma, beta, \
                                   eps, out_rows);                                                         \
    }

POOL_PACKED_KERNEL(float, f32)
POOL_PACKED_KERNEL(f16_t, f16)
POOL_PACKED_KERNEL(bf16_t, bf16)
POOL_PACKED_LN_KERNEL(f16_t, f16)
POOL_PACKED_LN_KERNEL(bf16_t, bf16)
