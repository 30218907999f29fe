// Embedding gather + LayerNorm, and residual add + LayerNorm.
//
// One block per row (token). Each thread keeps up to LN_VPT values of the row
// in registers (column c = threadIdx.x + i * blockDim.x, coalesced), so the
// row is read once; mean and variance are two block reductions (two-pass
// variance, f32). The host picks blockDim = a multiple of 32 with
// hidden <= blockDim * LN_VPT.

#define LN_VPT 8

template <typename T>
__device__ __forceinline__ void ln_finish(float (&v)[LN_VPT], int hidden, const T* __restrict__ gamma,
                                          const T* __restrict__ beta, float eps, T* out) {
    __shared__ float sh[32];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < hidden) s += v[i];
    }
    const float mean = block_sum(s, sh) / (float)hidden;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < hidden) {
            const float d = v[i] - mean;
            q += d * d;
        }
    }
    const float var = block_sum(q, sh) / (float)hidden;
    const float rstd = 1.0f / sqrtf(var + eps);
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < hidden) {
            out[c] = from_f32<T>((v[i] - mean) * rstd * to_f32(gamma[c]) + to_f32(beta[c]));
        }
    }
}

// out[r] = LayerNorm(word[ids[r]] + position[r % seq] + token_type[types[r]]).
// Ids are clamped into their tables so a bad id can never fault the device.
template <typename T>
__device__ __forceinline__ void embed_ln_impl(const int* __restrict__ ids, const int* __restrict__ types,
                                              const T* __restrict__ word, const T* __restrict__ pos,
                                              const T* __restrict__ ttab, const T* __restrict__ gamma,
                                              const T* __restrict__ beta, float eps, T* __restrict__ out,
                                              int seq, int hidden, int vocab, int npos, int ntypes) {
    const int r = blockIdx.x;
    const int id = min(max(ids[r], 0), vocab - 1);
    const int tt = min(max(types[r], 0), ntypes - 1);
    const int p = min(r % seq, npos - 1);
    const T* w = word + (size_t)id * hidden;
    const T* ps = pos + (size_t)p * hidden;
    const T* ty = ttab + (size_t)tt * hidden;
    float v[LN_VPT];
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < hidden ? to_f32(w[c]) + to_f32(ps[c]) + to_f32(ty[c]) : 0.0f;
    }
    ln_finish<T>(v, hidden, gamma, beta, eps, out + (size_t)r * hidden);
}

// out = LayerNorm(x + residual); `out` may alias `residual` (each element is
// read by the thread that later writes it).
template <typename T>
__device__ __forceinline__ void add_ln_impl(const T* __restrict__ x, const T* residual, const T* __restrict__ gamma,
                                            const T* __restrict__ beta, float eps, T* out, int hidden) {
    const size_t base = (size_t)blockIdx.x * hidden;
    float v[LN_VPT];
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < hidden ? to_f32(x[base + c]) + to_f32(residual[base + c]) : 0.0f;
    }
    ln_finish<T>(v, hidden, gamma, beta, eps, out + base);
}

#define LN_KERNELS(T, SUF)                                                                                      \
    extern "C" __global__ void embed_ln_##SUF(const int* ids, const int* types, const T* word, const T* pos,    \
                                              const T* ttab, const T* gamma, const T* beta, float eps, T* out,  \
                                              int seq, int hidden, int vocab, int npos, int ntypes) { pdl_enter();           \
        embed_ln_impl<T>(ids, types, word, pos, ttab, gamma, beta, eps, out, seq, hidden, vocab, npos, ntypes); \
    }                                                                                                           \
    extern "C" __global__ void add_ln_##SUF(const T* x, const T* residual, const T* gamma, const T* beta,       \
                                            float eps, T* out, int hidden) { pdl_enter();                                    \
        add_ln_impl<T>(x, residual, gamma, beta, eps, out, hidden);                                             \
    }

LN_KERNELS(float, f32)
LN_KERNELS(f16_t, f16)
LN_KERNELS(bf16_t, bf16)
