// Sentence pooling + optional L2 normalisation, writing f32.
//
// x    : [batch*seq, hidden] (T), mask: i32 [batch, seq], out: f32 [batch, hidden]
// mode : 0 = mean over tokens with mask != 0 (divided by max(sum(mask), 1e-9)),
//        1 = cls (the first token), 2 = max over tokens with mask != 0
//        (0 where a row has none, as the CPU backend does), 3 = sum over
//        tokens with mask != 0 (SPLADE's sum pooling: the mean, undivided),
//        4 = last token (the last position with mask != 0, found by the
//        block's threads together; zeros where the row has none).
// Then, if `normalize`, out[b] /= max(||out[b]||, 1e-12).
//
// pool_skip_<t> (include_prompt = false): `skip` is i32 [batch]; row b pools
// only its positions s >= skip[b] (clamped to [0, seq]) with mask != 0: mean
// and max over those, cls the first of them, last token the last of them; a
// row with none gives zeros.
//
// pool_ln_<t> (a deferred LayerNorm, see gemm_small.cu): x is the f32
// pre-norm rows [batch*seq, hidden] of the last add + LayerNorm, normalised
// with gamma `lg`, beta `lb`, eps `leps` as they are loaded (each warp holds
// whole token rows: hidden <= POOL_CHUNK) and rounded to T, the values the
// LayerNorm would have stored; mean, max and sum only (host-checked). Its last
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
#define POOL_SUM 3
#define POOL_LAST 4

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

// pool_ln / pool_packed_ln when hidden % 128 == 0 (hidden <= POOL_CHUNK,
// host-checked): lane l of a warp holds the float4 columns l + 32·j of a
// token row, so a row is hidden/128 16-byte loads a lane instead of hidden/32
// 4-byte ones, and the warp normalises it in registers. The generic path
// above issued ~850 instructions a warp for (1, 16) at hidden 384 (ncu,
// H200: 7 µs of one SM, stalled on each load in turn). Tokens are the n rows
// of xs, counted where mask (null: all) is non-zero; two per warp in flight.
// `part` is the caller's shared partials (POOL_WARPS × POOL_CHUNK floats).
// With `enter` it passes pdl_enter itself, after its loads of gamma and beta
// (weights), so that their round trip overlaps the kernel before rather than
// preceding the rows' (pool_ln_<t>, the last node of a small graph).
#define PLV_J (POOL_CHUNK / 128)

template <typename T>
__device__ __forceinline__ void pool_ln_vec4(const float* __restrict__ xs, const int* __restrict__ mask, int n,
                                             float* __restrict__ ob, int hidden, int mode, int normalize,
                                             const T* __restrict__ lg, const T* __restrict__ lb, float eps,
                                             float (*part)[POOL_CHUNK], float* sh, bool enter) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nv = hidden >> 7;
    const bool is_max = mode == POOL_MAX;
    const float init = is_max ? NEG_INF_F : 0.0f;
    float g[PLV_J][4], b[PLV_J][4], acc[PLV_J][4];
#pragma unroll
    for (int j = 0; j < PLV_J; j++) {
        T gt[4], bt[4];
        if (j < nv) {
            *reinterpret_cast<uint2*>(gt) = *reinterpret_cast<const uint2*>(lg + 4 * (lane + 32 * j));
            *reinterpret_cast<uint2*>(bt) = *reinterpret_cast<const uint2*>(lb + 4 * (lane + 32 * j));
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            g[j][e] = j < nv ? to_f32(gt[e]) : 0.0f;
            b[j][e] = j < nv ? to_f32(bt[e]) : 0.0f;
            acc[j][e] = init;
        }
    }
    if (enter) pdl_enter();
    float used = 0.0f;
    for (int t0 = warp; t0 < n; t0 += 2 * POOL_WARPS) {
        float v[2][PLV_J][4];
        bool use[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int t = t0 + u * POOL_WARPS;
            const bool in = t < n;
            const float* row = xs + (size_t)(in ? t : 0) * hidden;
#pragma unroll
            for (int j = 0; j < PLV_J; j++) {
                float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (j < nv && in) q = *reinterpret_cast<const float4*>(row + 4 * (lane + 32 * j));
                v[u][j][0] = q.x; v[u][j][1] = q.y; v[u][j][2] = q.z; v[u][j][3] = q.w;
            }
            use[u] = in && (mask == 0 || mask[t] != 0);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (!use[u]) continue;  // warp-uniform
            used += 1.0f;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < PLV_J; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) sum += v[u][j][e];  // zeros past nv
            const float mean = warp_sum(sum) / (float)hidden;
            float d2 = 0.0f;
#pragma unroll
            for (int j = 0; j < PLV_J; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float d = v[u][j][e] - mean;
                    if (j < nv) d2 += d * d;
                }
            const float rstd = 1.0f / sqrtf(warp_sum(d2) / (float)hidden + eps);
#pragma unroll
            for (int j = 0; j < PLV_J; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    // The LayerNorm's output as it would have been stored (T).
                    const float y = to_f32(from_f32<T>((v[u][j][e] - mean) * rstd * g[j][e] + b[j][e]));
                    acc[j][e] = is_max ? fmaxf(acc[j][e], y) : acc[j][e] + y;
                }
        }
    }
#pragma unroll
    for (int j = 0; j < PLV_J; j++)
        *reinterpret_cast<float4*>(&part[warp][4 * (lane + 32 * j)]) =
            make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    if (lane == 0) sh[warp] = used;
    __syncthreads();
    float cnt = 0.0f;
#pragma unroll
    for (int w = 0; w < POOL_WARPS; w++) cnt += sh[w];
    // Thread q finishes the float4 column q (hidden / 4 <= POOL_THREADS).
    const int q = tid;
    float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float sq = 0.0f;
    if (q < (hidden >> 2)) {
#pragma unroll
        for (int e = 0; e < 4; e++) r[e] = part[0][4 * q + e];
#pragma unroll
        for (int w = 1; w < POOL_WARPS; w++)
#pragma unroll
            for (int e = 0; e < 4; e++) r[e] = is_max ? fmaxf(r[e], part[w][4 * q + e]) : r[e] + part[w][4 * q + e];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (is_max) {
                if (r[e] == NEG_INF_F) r[e] = 0.0f;
            } else {
                if (mode == POOL_MEAN) r[e] = r[e] / fmaxf(cnt, 1e-9f);
            }
            sq += r[e] * r[e];
        }
    }
    float inv = 1.0f;
    if (normalize) inv = 1.0f / fmaxf(sqrtf(block_sum(sq, sh)), 1e-12f);
    if (q < (hidden >> 2))
        *reinterpret_cast<float4*>(ob + 4 * q) = make_float4(r[0] * inv, r[1] * inv, r[2] * inv, r[3] * inv);
}

template <typename TX, typename T = TX>
__device__ __forceinline__ void pool_impl(const TX* __restrict__ x, const int* __restrict__ mask,
                                          const int* __restrict__ skip, float* __restrict__ out, int seq,
                                          int hidden, int mode, int normalize, const T* __restrict__ lg = nullptr,
                                          const T* __restrict__ lb = nullptr, float leps = 0.0f,
                                          int out_rows = 0x7fffffff) {
    __shared__ __align__(16) float part[POOL_WARPS][POOL_CHUNK];
    __shared__ float sh[32];
    const int b = blockIdx.x;
    // Rows past the batch's own are not written (the host reads only those).
    if (b >= out_rows) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const TX* xb = x + (size_t)b * seq * hidden;
    const int* mb = mask + (size_t)b * seq;
    float* ob = out + (size_t)b * hidden;
    if constexpr (sizeof(TX) == 4 && sizeof(T) == 2) {  // pool_ln_<t>, not yet past pdl_enter
        if (lg != 0 && skip == 0 && mode != POOL_CLS && mode != POOL_LAST && hidden % 128 == 0 &&
            hidden <= POOL_CHUNK) {
            pool_ln_vec4<T>(reinterpret_cast<const float*>(xb), mb, seq, ob, hidden, mode, normalize, lg, lb, leps,
                            part, sh, true);
            return;
        }
        pdl_enter();
    }

    // The first pooled position (0 without `skip`).
    const int first = skip ? min(max(skip[b], 0), seq) : 0;

    float sq = 0.0f;
    if (mode == POOL_CLS || mode == POOL_LAST) {
        // cls: without `skip`, token 0 whatever its mask; with it, the first
        // unmasked position >= first (none: zeros). Last token: the last
        // unmasked position >= first (none: zeros).
        int t0 = 0;
        if (mode == POOL_LAST) {
            __shared__ int last_s;
            if (tid == 0) last_s = -1;
            __syncthreads();
            int mine = -1;
            for (int s = first + tid; s < seq; s += POOL_THREADS)
                if (mb[s] != 0) mine = s;
            mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, 16));
            mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, 8));
            mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, 4));
            mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, 2));
            mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, 1));
            if (lane == 0 && mine >= 0) atomicMax(&last_s, mine);
            __syncthreads();
            t0 = last_s < 0 ? seq : last_s;
        } else if (skip) {
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
                        if (mode == POOL_MEAN) v = v / fmaxf(cnt, 1e-9f);
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
        if (mode == POOL_CLS || mode == POOL_LAST) {
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
        /* pdl_enter in pool_impl, after the LayerNorm's weights are read */                               \
        pool_impl<float, T>(x, mask, nullptr, out, seq, hidden, mode, normalize, gamma, beta, eps,         \
                            out_rows);                                                                     \
    }

POOL_KERNEL(float, f32)
POOL_KERNEL(f16_t, f16)
POOL_KERNEL(bf16_t, bf16)
POOL_LN_KERNEL(f16_t, f16)
POOL_LN_KERNEL(bf16_t, bf16)
