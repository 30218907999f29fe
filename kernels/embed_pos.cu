// Embedding gather + LayerNorm with RoBERTa-style position ids (XLM-R, MPNet):
// the position of token t of a sequence is `pad` when its id is `pad`, and
// otherwise pad + 1 + the number of tokens before it in its sequence whose id
// is not `pad` (transformers' create_position_ids_from_input_ids). So real
// tokens count from pad + 1 and a literal pad token in a text neither moves
// nor is counted.
//
// embed_ln_padpos_<t>        : padded rows, token r of row r / seq (index r % seq)
// embed_ln_packed_padpos_<t> : packed budget, token t at index positions[t] of
//                              the sequence starting at t - positions[t]
//
// One block per token, as embed_ln (layernorm.cu, whose ln_finish it shares):
// the block counts the non-pad ids before its token (at most the sequence's
// length, <= 512 reads from L1/L2) with one block reduction, then gathers and
// normalises. Ids, types, positions and the sequence start are clamped into
// their tables and buffers, so no contents of the inputs can fault the device.

template <typename T>
__device__ __forceinline__ void embed_ln_padpos_impl(const int* __restrict__ ids, const int* __restrict__ types,
                                                     int t, int start, const T* __restrict__ word,
                                                     const T* __restrict__ pos, const T* __restrict__ ttab,
                                                     const T* __restrict__ gamma, const T* __restrict__ beta,
                                                     float eps, T* __restrict__ out, int hidden, int vocab,
                                                     int npos, int ntypes, int pad) {
    __shared__ float sh[32];
    float c = 0.0f;
    for (int j = start + (int)threadIdx.x; j < t; j += blockDim.x) c += (ids[j] != pad) ? 1.0f : 0.0f;
    const int before = (int)(block_sum(c, sh) + 0.5f);
    const int raw = ids[t];
    const int p = min(raw == pad ? pad : pad + 1 + before, npos - 1);
    const int id = min(max(raw, 0), vocab - 1);
    const int tt = min(max(types[t], 0), ntypes - 1);
    const T* w = word + (size_t)id * hidden;
    const T* ps = pos + (size_t)max(p, 0) * hidden;
    const T* ty = ttab + (size_t)tt * hidden;
    float v[LN_VPT];
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int col = threadIdx.x + i * blockDim.x;
        v[i] = col < hidden ? to_f32(w[col]) + to_f32(ps[col]) + to_f32(ty[col]) : 0.0f;
    }
    ln_finish<T>(v, hidden, gamma, beta, eps, out + (size_t)t * hidden);
}

#define EMBED_POS_KERNELS(T, SUF)                                                                              \
    extern "C" __global__ void embed_ln_padpos_##SUF(const int* ids, const int* types, const T* word,          \
                                                     const T* pos, const T* ttab, const T* gamma,              \
                                                     const T* beta, float eps, T* out, int seq, int hidden,    \
                                                     int vocab, int npos, int ntypes, int pad) { pdl_enter();               \
        const int r = blockIdx.x;                                                                              \
        embed_ln_padpos_impl<T>(ids, types, r, r - r % seq, word, pos, ttab, gamma, beta, eps, out, hidden,    \
                                vocab, npos, ntypes, pad);                                                     \
    }                                                                                                          \
    extern "C" __global__ void embed_ln_packed_padpos_##SUF(                                                   \
        const int* ids, const int* types, const int* positions, const T* word, const T* pos, const T* ttab,    \
        const T* gamma, const T* beta, float eps, T* out, int hidden, int vocab, int npos, int ntypes,         \
        int pad) { pdl_enter();                                                                                             \
        const int t = blockIdx.x;                                                                              \
        const int start = t - min(max(positions[t], 0), t);                                                    \
        embed_ln_padpos_impl<T>(ids, types, t, start, word, pos, ttab, gamma, beta, eps, out, hidden, vocab,   \
                                npos, ntypes, pad);                                                            \
    }

EMBED_POS_KERNELS(float, f32)
EMBED_POS_KERNELS(f16_t, f16)
EMBED_POS_KERNELS(bf16_t, bf16)
