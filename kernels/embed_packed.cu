// Packed batches: embedding gather + LayerNorm with per-token positions.
//
// out[t] = LayerNorm(word[ids[t]] + pos[positions[t]] + token_type[types[t]])
// for every slot t of the token budget (one block per slot, as embed_ln in
// layernorm.cu, whose ln_finish it shares). The host writes each sequence's
// positions 0 .. len-1 and zeros (id 0, position 0, type 0) in the tail of
// the budget, so tail slots get a defined, finite embedding that nothing
// real reads. Ids, positions and types are clamped into their tables, so no
// contents of the static inputs can make a block read outside them.

template <typename T>
__device__ __forceinline__ void embed_ln_packed_impl(const int* __restrict__ ids, const int* __restrict__ types,
                                                     const int* __restrict__ positions, const T* __restrict__ word,
                                                     const T* __restrict__ pos, const T* __restrict__ ttab,
                                                     const T* __restrict__ gamma, const T* __restrict__ beta,
                                                     float eps, T* __restrict__ out, int hidden, int vocab,
                                                     int npos, int ntypes) {
    const int t = blockIdx.x;
    const int id = min(max(ids[t], 0), vocab - 1);
    const int tt = min(max(types[t], 0), ntypes - 1);
    const int p = min(max(positions[t], 0), npos - 1);
    const T* w = word + (size_t)id * hidden;
    const T* ps = pos + (size_t)p * hidden;
    const T* ty = ttab + (size_t)tt * hidden;
    float v[LN_VPT];
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < hidden ? to_f32(w[c]) + to_f32(ps[c]) + to_f32(ty[c]) : 0.0f;
    }
    ln_finish<T>(v, hidden, gamma, beta, eps, out + (size_t)t * hidden);
}

#define EMBED_PACKED_KERNEL(T, SUF)                                                                            \
    extern "C" __global__ void embed_ln_packed_##SUF(const int* ids, const int* types, const int* positions,   \
                                                     const T* word, const T* pos, const T* ttab,               \
                                                     const T* gamma, const T* beta, float eps, T* out,         \
                                                     int hidden, int vocab, int npos, int ntypes) { pdl_enter();            \
        embed_ln_packed_impl<T>(ids, types, positions, word, pos, ttab, gamma, beta, eps, out, hidden, vocab, \
                                npos, ntypes);                                                                 \
    }

EMBED_PACKED_KERNEL(float, f32)
EMBED_PACKED_KERNEL(f16_t, f16)
EMBED_PACKED_KERNEL(bf16_t, bf16)
