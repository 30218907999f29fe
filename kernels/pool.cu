// Sentence pooling + optional L2 normalisation, writing f32.
//
// x    : [batch*seq, hidden] (T), mask: i32 [batch, seq], out: f32 [batch, hidden]
// mode : 0 = mean over tokens with mask != 0 (divided by max(sum(mask), 1e-9)),
//        1 = cls (the first token), 2 = max over tokens with mask != 0
//        (0 where a row has none, as the CPU backend does).
// Then, if `normalize`, out[b] /= max(||out[b]||, 1e-12).
//
// pool_skip_<t> (include_prompt = false): `skip` is i32 [batch]; row b pools
// only its positions s >= skip[b] (clamped to [0, seq]) with mask != 0: mean
// and max over those, cls the first of them; a row with none gives zeros.
//
// pool_ln_<t> (a deferred LayerNorm, see gemm_small.cu): x is the f32
// pre-norm rows [batch*seq, hidden] of the last add + LayerNorm, normalised
// with gamma `lg`, beta `lb`, eps `leps` as they are loaded (each warp holds
// whole token rows: hidden <= POOL_CHUNK) and rounded to T, the values the
// LayerNorm would have stored; mean and max only (host-checked). Its last
// argument `out_rows` is the number of rows it writes (the batch's own, at
// most the grid): a staged graph's pool_ln writes straight into the batch's
// pinned host slot (stage.cu), where every row written crosses PCIe.
//
// One block of POOL_THREADS (8 warps) per batch row. Columns are processed in
// chunks of 32*POOL_VPL: lane l of every warp owns columns l + 32*k of the
// chunk, and warp w reduces the tokens s = w, w+8, ...; the 8 partial results
// meet in shared memory. So a single row still uses 8 warps' worth of loads.

#define POOL_THREADS 256
#define POOL_WARPS (POOL_THREADS / 32)
#define POOL_VPL 16
#define POOL_CHUNK (32 * POOL_VPL)
#define POOL_UNROLL 4

#define POOL_MEAN 0
#define POOL_CLS 1
#define POOL_MAX 2

// A warp's token row v (lane l holds columns l + 32·k, hidden <= POOL_CHUNK)
// normalised in place and rounded to T.
template <typename T>
__device__ __forceinline__ void pool_ln_row(float (&v)[POOL_VPL], const float (&g)[POOL_VPL],
                                            const float (&b)[POOL_VPL], int hidden, float eps) {
    const int lane = threadIdx.x & 31;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < POOL_VPL; k++)
        if (lane + 32 * k < hidden) s += v[k];
    const float mean = warp_sum(s) / (float)hidden;
    float d2 = 0.0f;
#pragma unroll
    for (int k = 0; k < POOL_VPL; k++) {
        const float d = v[k] - mean;
        if (lane + 32 * k < hidden) d2 += d * d;
    }
    const float rstd = 1.0f / sqrtf(warp_sum(d2) / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < POOL_VPL; k++)
        if (lane + 32 * k < hidden) v[k] = to_f32(from_f32<T>((v[k] - mean) * rstd * g[k] + b[k]));
}

// gamma and beta at this lane's columns (lg != null).
template <typename T>
__device__ __forceinline__ void pool_ln_params(const T* __restrict__ lg, const T* __restrict__ lb, int hidden,
                                               float (&g)[POOL_VPL], float (&b)[POOL_VPL]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < POOL_VPL; k++) {
        const int c = lane + 32 * k;
        g[k] = lg != 0 && c < hidden ? to_f32(lg[c]) : 0.0f;
        b[k] = lg != 0 && c < hidden ? to_f32(lb[c]) : 0.0f;
    }
}

// The columns i = tid, tid + POOL_THREADS of a chunk: values a thread keeps
// until the row's norm is known (one chunk: hidden <= POOL_CHUNK), so the
// output is written once — it may be the batch's pinned host slot (a staged
// graph's last kernel, see stage.cu), where reading it back would cross PCIe.
#define POOL_KEEP (POOL_CHUNK / POOL_THREADS)

// Block-wide: the row's pooled values `keep` (this thread's columns of the
// only chunk), L2-normalised if asked, written to ob.
__device__ __forceinline__ void pool_write_kept(const float (&keep)[POOL_KEEP], float sq, float* ob, int hidden,
                                                int normalize, float* sh) {
    const int tid = threadIdx.x;
    float inv = 1.0f;
    if (normalize) inv = 1.0f / fmaxf(sqrtf(block_sum(sq, sh)), 1e-12f);
#pragma unroll
    for (int j = 0; j < POOL_KEEP; j++) {
        const int c = tid + j * POOL_THREADS;
        if (c < hidden) ob[c] = keep[j] * inv;
    }
}

template <typename TX, typename T = TX>
__device__ __forceinline__ void pool_impl(const TX* __restrict__ x, const int* __restrict__ mask,
                                          const int* __restrict__ skip, float* __restrict__ out, int seq,
                                          int hidden, int mode, int normalize, const T* __restrict__ lg = nullptr,
                                          const T* __restrict__ lb = nullptr, float leps = 0.0f,
                                          int out_rows = 0x7fffffff) {
    __shared__ float part[POOL_WARPS][POOL_CHUNK];
    __shared__ float sh[32];
    const int b = blockIdx.x;
    // Rows past the batch's own are not written (the host reads only those).
    if (b >= out_rows) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const TX* xb = x + (size_t)b * seq * hidden;
    const int* mb = mask + (size_t)b * seq;
    float* ob = out + (size_t)b * hidden;

    // The first pooled position (0 without `skip`).
    const int first = skip ? min(max(skip[b], 0), seq) : 0;

    float sq = 0.0f;
    if (mode == POOL_CLS) {
        // Without `skip`, token 0 whatever its mask; with it, the first
        // unmasked position >= first (none: zeros).
        int t0 = 0;
        if (skip) {
            t0 = first;
            while (t0 < seq && mb[t0] == 0) t0++;
        }
        const TX* xr = xb + (size_t)t0 * hidden;
        for (int c = tid; c < hidden; c += POOL_THREADS) {
            const float v = t0 < seq ? to_f32(xr[c]) : 0.0f;
            ob[c] = v;
            sq += v * v;
        }
    } else {
        const bool is_max = mode == POOL_MAX;
        const float init = is_max ? NEG_INF_F : 0.0f;
        float lgv[POOL_VPL], lbv[POOL_VPL];
        pool_ln_params<T>(lg, lb, hidden, lgv, lbv);
        float keep[POOL_KEEP];
        float cnt = 0.0f;
        for (int c0 = 0; c0 < hidden; c0 += POOL_CHUNK) {
            float acc[POOL_VPL];
#pragma unroll
            for (int k = 0; k < POOL_VPL; k++) acc[k] = init;
            float used = 0.0f;  // this warp's unmasked tokens
            // POOL_UNROLL tokens' loads in flight at once: one token at a time
            // the loop waits out a memory latency per token. The rows are
            // loaded whatever their mask (the mask then selects), so their
            // loads do not wait for the mask's.
            for (int s0 = first + warp; s0 < seq; s0 += POOL_UNROLL * POOL_WARPS) {
                float v[POOL_UNROLL][POOL_VPL];
                bool use[POOL_UNROLL];
#pragma unroll
                for (int u = 0; u < POOL_UNROLL; u++) {
                    const int s = s0 + u * POOL_WARPS;
                    const bool in = s < seq;
                    const TX* xr = xb + (size_t)(in ? s : first) * hidden;
#pragma unroll
                    for (int k = 0; k < POOL_VPL; k++) {
                        const int c = c0 + lane + 32 * k;
                        v[u][k] = (in && c < hidden) ? to_f32(xr[c]) : init;
                    }
                    use[u] = in && mb[s] != 0;
                }
#pragma unroll
                for (int u = 0; u < POOL_UNROLL; u++) {
                    if (!use[u]) continue;  // warp-uniform
                    used += 1.0f;
                    if (lg != 0) pool_ln_row<T>(v[u], lgv, lbv, hidden, leps);
#pragma unroll
                    for (int k = 0; k < POOL_VPL; k++) acc[k] = is_max ? fmaxf(acc[k], v[u][k]) : acc[k] + v[u][k];
                }
            }
            __syncthreads();  // previous chunk's partials consumed
#pragma unroll
            for (int k = 0; k < POOL_VPL; k++) part[warp][lane + 32 * k] = acc[k];
            if (c0 == 0 && lane == 0) sh[warp] = used;
            __syncthreads();
            if (c0 == 0) {
                for (int w = 0; w < POOL_WARPS; w++) cnt += sh[w];
            }
#pragma unroll
            for (int j = 0; j < POOL_KEEP; j++) {
                const int i = tid + j * POOL_THREADS;
                const int c = c0 + i;
                float v = 0.0f;
                if (c < hidden) {
                    v = part[0][i];
#pragma unroll
                    for (int w = 1; w < POOL_WARPS; w++) v = is_max ? fmaxf(v, part[w][i]) : v + part[w][i];
                    if (is_max) {
                        if (v == NEG_INF_F) v = 0.0f;
                    } else {
                        v = v / fmaxf(cnt, 1e-9f);
                    }
                    sq += v * v;
                    if (hidden > POOL_CHUNK) ob[c] = v;
                }
                keep[j] = v;
            }
        }
        if (hidden <= POOL_CHUNK) {
            // (block_sum's first barrier orders its use of sh after the counts' reads.)
            pool_write_kept(keep, sq, ob, hidden, normalize, sh);
            return;
        }
    }
    if (normalize) {
        const float total = block_sum(sq, sh);
        const float inv = 1.0f / fmaxf(sqrtf(total), 1e-12f);
        // Each thread rescales exactly the columns it wrote above.
        if (mode == POOL_CLS) {
            for (int c = tid; c < hidden; c += POOL_THREADS) ob[c] *= inv;
        } else {
            for (int c0 = 0; c0 < hidden; c0 += POOL_CHUNK)
                for (int i = tid; i < POOL_CHUNK; i += POOL_THREADS)
                    if (c0 + i < hidden) ob[c0 + i] *= inv;
        }
    }
}

#define POOL_KERNEL(T, SUF)                                                                              \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                           \
        pool_##SUF(const T* x, const int* mask, float* out, int seq, int hidden, int mode, int normalize) { pdl_enter(); \
        pool_impl<T>(x, mask, nullptr, out, seq, hidden, mode, normalize);                               \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                           \
        pool_skip_##SUF(const T* x, const int* mask, const int* skip, float* out, int seq, int hidden,   \
                        int mode, int normalize) { pdl_enter();                                                       \
        pool_impl<T>(x, mask, skip, out, seq, hidden, mode, normalize);                                  \
    }

#define POOL_LN_KERNEL(T, SUF)                                                                             \
    extern "C" __global__ void __launch_bounds__(POOL_THREADS)                                             \
        pool_ln_##SUF(const float* x, const int* mask, float* out, int seq, int hidden, int mode,          \
                      int normalize, const T* gamma, const T* beta, float eps, int out_rows) {             \
        pdl_enter();                                                                                       \
        pool_impl<float, T>(x, mask, nullptr, out, seq, hidden, mode, normalize, gamma, beta, eps,         \
                            out_rows);                                                                     \
    }

POOL_KERNEL(float, f32)
POOL_KERNEL(f16_t, f16)
POOL_KERNEL(bf16_t, bf16)
POOL_LN_KERNEL(f16_t, f16)
POOL_LN_KERNEL(bf16_t, bf16)
