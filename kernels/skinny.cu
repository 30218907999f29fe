// Matmuls with few rows (M <= SK_MAXM), where cuBLASLt's tiles are mostly
// idle: out[m, n] = epilogue(x[m, :] . w[n, :] + bias[n]), w stored [N, K].
//
// Each block owns SK_COLS output columns for all rows; its SK_WARPS warps
// split K. Lanes stream 16-byte vectors of the block's weight rows
// (coalesced; every weight is read once) and of x (small, served from L1/L2),
// accumulating in f32. The 64 partial sums of a warp are reduced with a
// butterfly that halves the values each lane holds at every step (62
// shuffles, not 320): lane l ends up with the totals of flattened indices 2l
// and 2l+1 (index = m * SK_COLS + c); the warps' totals meet in shared memory.
//
// mode 0: out = act(sum + bias)                       (TOUT may be f32 for an f32 output)
// mode 1: out = LayerNorm(sum + bias + residual)      (a Linear fused with the AddLayerNorm
//         after it). Every block writes its pre-norm values to `tmp` (f32 [M, N]); the last
//         block to finish (atomic counter) normalises whole rows and resets the counter, so
//         the kernel is replayable. `out` may alias `residual`: all blocks read residual
//         before the last one writes out.
// Requires K % (16 / sizeof(T)) == 0 and 16-byte aligned rows (checked by the host).

#define SK_MAXM 16
#define SK_COLS 4
#define SK_WARPS 4
#define SK_LN_J4 8  // float4s per lane and row kept in registers by the LayerNorm (N <= 1024)
#define SK_THREADS (32 * SK_WARPS)

__device__ __forceinline__ void load_vec(const float* p, float (&v)[4]) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

__device__ __forceinline__ void unpack2(unsigned u, f16_t, float* v) {
    f16_t lo, hi;
    lo.bits = (u16)(u & 0xffffu);
    hi.bits = (u16)(u >> 16);
    v[0] = to_f32(lo);
    v[1] = to_f32(hi);
}

__device__ __forceinline__ void unpack2(unsigned u, bf16_t, float* v) {
    v[0] = __uint_as_float(u << 16);
    v[1] = __uint_as_float(u & 0xffff0000u);
}

template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[8]) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    unpack2(q.x, T(), v + 0);
    unpack2(q.y, T(), v + 2);
    unpack2(q.z, T(), v + 4);
    unpack2(q.w, T(), v + 6);
}

// One butterfly step (see above), with compile-time sizes so `a` stays in registers.
template <int HALF, int O, int V>
__device__ __forceinline__ void butterfly_step(float (&a)[V], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        const float send = up ? a[i] : a[i + HALF];
        const float keep = up ? a[i + HALF] : a[i];
        a[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

template <typename T, typename TOUT>
__device__ __forceinline__ void skinny_impl(const T* __restrict__ x, const T* __restrict__ w,
                                            const T* __restrict__ bias, TOUT* out, int M, int N, int K, int act,
                                            int mode, const T* residual, float* __restrict__ tmp,
                                            const T* __restrict__ gamma, const T* __restrict__ beta, float eps,
                                            unsigned* counter) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int V = SK_MAXM * SK_COLS;  // 64 partial sums per lane
    __shared__ float red[SK_WARPS][V];
    __shared__ bool s_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * SK_COLS;

    float a[V];
#pragma unroll
    for (int i = 0; i < V; i++) a[i] = 0.0f;
    for (int k = threadIdx.x * VEC; k < K; k += SK_THREADS * VEC) {
        float wv[SK_COLS][VEC];
#pragma unroll
        for (int c = 0; c < SK_COLS; c++) {
            if (n0 + c < N) {
                load_vec(w + (size_t)(n0 + c) * K + k, wv[c]);
            } else {
#pragma unroll
                for (int v = 0; v < VEC; v++) wv[c][v] = 0.0f;
            }
        }
#pragma unroll
        for (int m = 0; m < SK_MAXM; m++) {
            if (m < M) {
                float xv[VEC];
                load_vec(x + (size_t)m * K + k, xv);
#pragma unroll
                for (int c = 0; c < SK_COLS; c++)
#pragma unroll
                    for (int v = 0; v < VEC; v++) a[m * SK_COLS + c] = fmaf(xv[v], wv[c][v], a[m * SK_COLS + c]);
            }
        }
    }
    static_assert(V == 64, "the butterfly below is written for 64 values over 32 lanes");
    butterfly_step<32, 16>(a, lane);
    butterfly_step<16, 8>(a, lane);
    butterfly_step<8, 4>(a, lane);
    butterfly_step<4, 2>(a, lane);
    butterfly_step<2, 1>(a, lane);
    red[warp][2 * lane] = a[0];
    red[warp][2 * lane + 1] = a[1];
    __syncthreads();

    if (threadIdx.x < V) {
        const int idx = threadIdx.x;
        const int m = idx / SK_COLS, n = n0 + idx % SK_COLS;
        if (m < M && n < N) {
            float v = 0.0f;
#pragma unroll
            for (int i = 0; i < SK_WARPS; i++) v += red[i][idx];
            if (bias != 0) v += to_f32(bias[n]);
            if (mode == 0) {
                out[(size_t)m * N + n] = from_f32<TOUT>(apply_act(v, act));
            } else {
                tmp[(size_t)m * N + n] = v + to_f32(residual[(size_t)m * N + n]);
            }
        }
    }
    if (mode == 0) return;

    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int N4 = N >> 2;
    if ((N & 3) == 0 && N4 <= 32 * SK_LN_J4) {
        // Two rows per warp at a time, every load of both rows in flight at once.
        for (int m0 = 2 * warp; m0 < M; m0 += 2 * SK_WARPS) {
            float4 v[2][SK_LN_J4];
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int j = 0; j < SK_LN_J4; j++) {
                    const int q = lane + 32 * j;
                    v[r][j] = (m0 + r < M && q < N4) ? __ldcg(reinterpret_cast<const float4*>(tmp + (size_t)(m0 + r) * N) + q)
                                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int m = m0 + r;
                if (m >= M) break;  // warp-uniform
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < SK_LN_J4; j++) s += (v[r][j].x + v[r][j].y) + (v[r][j].z + v[r][j].w);
                const float mean = warp_sum(s) / (float)N;
                float q2 = 0.0f;
#pragma unroll
                for (int j = 0; j < SK_LN_J4; j++) {
                    if (lane + 32 * j < N4) {
                        const float d0 = v[r][j].x - mean, d1 = v[r][j].y - mean;
                        const float d2 = v[r][j].z - mean, d3 = v[r][j].w - mean;
                        q2 += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
                    }
                }
                const float rstd = 1.0f / sqrtf(warp_sum(q2) / (float)N + eps);
#pragma unroll
                for (int j = 0; j < SK_LN_J4; j++) {
                    const int q = lane + 32 * j;
                    if (q < N4) {
                        const int n = 4 * q;
                        TOUT* o = out + (size_t)m * N + n;
                        o[0] = from_f32<TOUT>((v[r][j].x - mean) * rstd * to_f32(gamma[n]) + to_f32(beta[n]));
                        o[1] = from_f32<TOUT>((v[r][j].y - mean) * rstd * to_f32(gamma[n + 1]) + to_f32(beta[n + 1]));
                        o[2] = from_f32<TOUT>((v[r][j].z - mean) * rstd * to_f32(gamma[n + 2]) + to_f32(beta[n + 2]));
                        o[3] = from_f32<TOUT>((v[r][j].w - mean) * rstd * to_f32(gamma[n + 3]) + to_f32(beta[n + 3]));
                    }
                }
            }
        }
    } else {
        // Any N: one row per warp, looping (slower, still correct).
        for (int m = warp; m < M; m += SK_WARPS) {
            const float* row = tmp + (size_t)m * N;
            float s = 0.0f;
            for (int n = lane; n < N; n += 32) s += __ldcg(row + n);
            const float mean = warp_sum(s) / (float)N;
            float q2 = 0.0f;
            for (int n = lane; n < N; n += 32) {
                const float d = __ldcg(row + n) - mean;
                q2 += d * d;
            }
            const float rstd = 1.0f / sqrtf(warp_sum(q2) / (float)N + eps);
            for (int n = lane; n < N; n += 32) {
                out[(size_t)m * N + n] =
                    from_f32<TOUT>((__ldcg(row + n) - mean) * rstd * to_f32(gamma[n]) + to_f32(beta[n]));
            }
        }
    }
    if (threadIdx.x == 0) *counter = 0u;
}

#define SKINNY_KERNEL(T, TOUT, SUF)                                                                            \
    extern "C" __global__ void __launch_bounds__(SK_THREADS)                                                   \
        skinny_##SUF(const T* x, const T* w, const T* bias, TOUT* out, int M, int N, int K, int act, int mode, \
                     const T* residual, float* tmp, const T* gamma, const T* beta, float eps, unsigned* counter) { pdl_enter(); \
        skinny_impl<T, TOUT>(x, w, bias, out, M, N, K, act, mode, residual, tmp, gamma, beta, eps, counter);   \
    }

SKINNY_KERNEL(float, float, f32_f32)
SKINNY_KERNEL(f16_t, f16_t, f16_f16)
SKINNY_KERNEL(bf16_t, bf16_t, bf16_bf16)
SKINNY_KERNEL(f16_t, float, f16_f32)
SKINNY_KERNEL(bf16_t, float, bf16_f32)
