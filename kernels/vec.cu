// Vectorised memory-bound kernels: LayerNorm (residual add + LN, embedding
// gather + LN) with one warp per row, and the element-wise bias/activation
// with 8 values per thread. Same results as layernorm.cu / elementwise.cu
// (f32 arithmetic, two-pass variance) up to the order of the f32 sums.
//
// * add_ln_vec_<t>, embed_ln_vec_<t> (embed_ln_vec_inl_<t>: its input block
//   as a parameter): LNV_WARPS rows per block, one per
//   warp; lane l holds the 4-value vectors l, l + 32, ... of its row in
//   registers (8-byte loads for f16/bf16, 16-byte for f32), so the row is
//   read once and the reductions are warp shuffles (no __syncthreads, no
//   shared memory). Requires hidden % 4 == 0 and hidden <= 32 * 4 * LNV_J
//   (checked by the host).
// * bias_act_vec_<t>: y = act(x + bias) for same-type input and output (exact
//   GELU through gelu_erfc_fast for f16/bf16), 8
//   values per thread and step (one 16-byte load for f16/bf16); requires
//   n % 8 == 0 and, with a bias, cols % 8 == 0 (a vector never straddles
//   two rows). `y` may alias `x`. Grid-stride; the host caps the grid.
//
// Uses unpack2 and load_vec from skinny.cu (one translation unit, it comes first).

#define LNV_WARPS 4
#define LNV_THREADS (32 * LNV_WARPS)
#define LNV_J 8  // 4-value vectors per lane: hidden <= 1024

__device__ __forceinline__ void ld4(const float* p, float (&v)[4]) { load_vec(p, v); }

template <typename T>
__device__ __forceinline__ void ld4(const T* p, float (&v)[4]) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    unpack2(q.x, T(), v + 0);
    unpack2(q.y, T(), v + 2);
}

__device__ __forceinline__ void st4(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

template <typename T>
__device__ __forceinline__ void st4(T* p, const float (&v)[4]) {
    uint2 q;
    q.x = pack2<T>(v[0], v[1]);
    q.y = pack2<T>(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = q;
}

// The mean and 1/std of the row a warp holds in v (vectors lane + 32 j).
__device__ __forceinline__ void lnv_stats(const float (&v)[LNV_J][4], int hidden, float eps, float& mean,
                                          float& rstd) {
    const int lane = threadIdx.x & 31;
    const int nv = hidden >> 2;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < LNV_J; j++)
        if (lane + 32 * j < nv) s += (v[j][0] + v[j][1]) + (v[j][2] + v[j][3]);
    mean = warp_sum(s) / (float)hidden;
    float q = 0.0f;
#pragma unroll
    for (int j = 0; j < LNV_J; j++) {
        if (lane + 32 * j < nv) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float d = v[j][e] - mean;
                q += d * d;
            }
        }
    }
    rstd = 1.0f / sqrtf(warp_sum(q) / (float)hidden + eps);
}

// out = (v - mean)·rstd·gamma + beta for the row a warp holds in v (vectors
// lane + 32 j); `gb(j, c, gm, bt)` gives gamma and beta at column c.
template <typename T, typename GammaBeta>
__device__ __forceinline__ void lnv_apply(const float (&v)[LNV_J][4], int hidden, float mean, float rstd,
                                          GammaBeta gb, T* out) {
    const int lane = threadIdx.x & 31;
    const int nv = hidden >> 2;
#pragma unroll
    for (int j = 0; j < LNV_J; j++) {
        const int qi = lane + 32 * j;
        if (qi < nv) {
            const int c = 4 * qi;
            float gm[4], bt[4], o[4];
            gb(j, c, gm, bt);
#pragma unroll
            for (int e = 0; e < 4; e++) o[e] = (v[j][e] - mean) * rstd * gm[e] + bt[e];
            st4(out + c, o);
        }
    }
}

// LayerNorm of the row a warp holds in v (vectors lane + 32 j), written to out.
template <typename T>
__device__ __forceinline__ void lnv_finish(float (&v)[LNV_J][4], int hidden, const T* __restrict__ gamma,
                                           const T* __restrict__ beta, float eps, T* out) {
    float mean, rstd;
    lnv_stats(v, hidden, eps, mean, rstd);
    const auto load = [&](int, int c, float (&gm)[4], float (&bt)[4]) {
        ld4(gamma + c, gm);
        ld4(beta + c, bt);
    };
    lnv_apply<T>(v, hidden, mean, rstd, load, out);
}

// The same with gamma and beta loaded by the caller (gm, bt), before the
// row, so that their latency is not one more after the reductions.
template <typename T>
__device__ __forceinline__ void lnv_finish_pre(float (&v)[LNV_J][4], int hidden, const float (&gm)[LNV_J][4],
                                               const float (&bt)[LNV_J][4], float eps, T* out) {
    float mean, rstd;
    lnv_stats(v, hidden, eps, mean, rstd);
    const auto held = [&](int j, int, float (&g)[4], float (&b)[4]) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            g[e] = gm[j][e];
            b[e] = bt[j][e];
        }
    };
    lnv_apply<T>(v, hidden, mean, rstd, held, out);
}

// out = LayerNorm(x + residual), `rows` rows; `out` may alias `residual`
// (each value is read by the lane that later writes it). A null residual:
// LayerNorm(x) (the matmul before it added the residual: mm_residual).
template <typename T>
__device__ __forceinline__ void add_ln_vec_impl(const T* __restrict__ x, const T* residual,
                                                const T* __restrict__ gamma, const T* __restrict__ beta, float eps,
                                                T* out, int rows, int hidden) {
    const int row = blockIdx.x * LNV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // warp-uniform; nothing below synchronises the block
    const int lane = threadIdx.x & 31;
    const int nv = hidden >> 2;
    const size_t base = (size_t)row * hidden;
    float v[LNV_J][4];
#pragma unroll
    for (int j = 0; j < LNV_J; j++) {
        const int qi = lane + 32 * j;
        if (qi < nv) {
            float a[4], b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            ld4(x + base + 4 * qi, a);
            if (residual != 0) ld4(residual + base + 4 * qi, b);
#pragma unroll
            for (int e = 0; e < 4; e++) v[j][e] = a[e] + b[e];
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) v[j][e] = 0.0f;
        }
    }
    lnv_finish<T>(v, hidden, gamma, beta, eps, out + base);
}

// out[r] = LayerNorm(word[ids[r]] + pos[p] + token_type[types[r]]) with
// p = positions[r] (packed programs) or r % seq (padded: positions is null).
// Ids, positions and types are clamped into their tables, as embed_ln and
// embed_ln_packed do.
//
// A staged graph's first kernel also copies the input block from the
// batch's pinned slot for the kernels after it (this kernel's own ids,
// types and positions then point into the slot too), instead of a stage_in
// node before it (stage.cu); embed_ln_vec_inl_<t> takes the block as its
// parameter instead (common.cuh, InlineBlock) and its ids etc. as word
// offsets into it (positions: -1 for none). With `stage_sync` (packed plans,
// whose next kernel reads the live rows from the inputs before its
// pdl_wait: gemm_small), the copy is made visible before this block lets
// the next kernel launch; otherwise it launches at once and reads its
// weights while this one runs.
template <typename Src>
__device__ __forceinline__ void embed_stage(Src src, unsigned* __restrict__ stage_dst, int stage_words,
                                            int stage_sync) {
    pdl_wait();
    if (!stage_sync) pdl_trigger();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < stage_words; i += gridDim.x * blockDim.x)
        stage_dst[i] = src(i);
    if (stage_sync) {
        __threadfence();
        __syncthreads();  // every thread's part copied before the block triggers
        pdl_trigger();
    }
}

// One row (a warp) of the embedding, from its raw id, type and position.
template <typename T>
__device__ __forceinline__ void embed_ln_vec_row(int raw_id, int raw_type, int raw_pos, const T* __restrict__ word,
                                                 const T* __restrict__ pos, const T* __restrict__ ttab,
                                                 const T* __restrict__ gamma, const T* __restrict__ beta,
                                                 float eps, T* __restrict__ out_row, int hidden, int vocab, int npos,
                                                 int ntypes) {
    const int lane = threadIdx.x & 31;
    const int nv = hidden >> 2;
    const int id = min(max(raw_id, 0), vocab - 1);
    const int tt = min(max(raw_type, 0), ntypes - 1);
    const int p = min(max(raw_pos, 0), npos - 1);
    const T* w = word + (size_t)id * hidden;
    const T* ps = pos + (size_t)p * hidden;
    const T* ty = ttab + (size_t)tt * hidden;
    float v[LNV_J][4], gm[LNV_J][4], bt[LNV_J][4];
#pragma unroll
    for (int j = 0; j < LNV_J; j++) {
        const int qi = lane + 32 * j;
        if (qi < nv) {
            float a[4], b[4], c[4];
            ld4(gamma + 4 * qi, gm[j]);
            ld4(beta + 4 * qi, bt[j]);
            ld4(w + 4 * qi, a);
            ld4(ps + 4 * qi, b);
            ld4(ty + 4 * qi, c);
#pragma unroll
            for (int e = 0; e < 4; e++) v[j][e] = a[e] + b[e] + c[e];
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) v[j][e] = gm[j][e] = bt[j][e] = 0.0f;
        }
    }
    lnv_finish_pre<T>(v, hidden, gm, bt, eps, out_row);
}

template <typename T>
__device__ __forceinline__ void embed_ln_vec_impl(const int* __restrict__ ids, const int* __restrict__ types,
                                                  const int* __restrict__ positions, const T* __restrict__ word,
                                                  const T* __restrict__ pos, const T* __restrict__ ttab,
                                                  const T* __restrict__ gamma, const T* __restrict__ beta, float eps,
                                                  T* __restrict__ out, int rows, int seq, int hidden, int vocab,
                                                  int npos, int ntypes, const unsigned* __restrict__ stage_src,
                                                  unsigned* __restrict__ stage_dst, int stage_words,
                                                  int stage_sync) {
    embed_stage([&](int i) { return stage_src[i]; }, stage_dst, stage_words, stage_sync);
    const int row = blockIdx.x * LNV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    embed_ln_vec_row<T>(ids[row], types[row], positions != 0 ? positions[row] : row % seq, word, pos, ttab, gamma,
                        beta, eps, out + (size_t)row * hidden, hidden, vocab, npos, ntypes);
}

// The same with the input block as the parameter `in`; ids_w, types_w,
// pos_w are word offsets into it (host-checked: the block's words, rows
// included, fit INLINE_WORDS), and the index is clamped besides.
template <typename T>
__device__ __forceinline__ void embed_ln_vec_inl_impl(const InlineBlock& in, int ids_w, int types_w, int pos_w,
                                                      const T* __restrict__ word, const T* __restrict__ pos,
                                                      const T* __restrict__ ttab, const T* __restrict__ gamma,
                                                      const T* __restrict__ beta, float eps, T* __restrict__ out,
                                                      int rows, int seq, int hidden, int vocab, int npos, int ntypes,
                                                      unsigned* __restrict__ stage_dst, int stage_words,
                                                      int stage_sync) {
    const auto word_at = [&](int i) { return in.w[min(max(i, 0), INLINE_WORDS - 1)]; };
    embed_stage(word_at, stage_dst, stage_words, stage_sync);
    const int row = blockIdx.x * LNV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int p = pos_w >= 0 ? (int)word_at(pos_w + row) : row % seq;
    embed_ln_vec_row<T>((int)word_at(ids_w + row), (int)word_at(types_w + row), p, word, pos, ttab, gamma, beta,
                        eps, out + (size_t)row * hidden, hidden, vocab, npos, ntypes);
}

template <typename T>
__device__ __forceinline__ void ld8(const T* p, float (&v)[8]) {
    load_vec(p, v);
}
__device__ __forceinline__ void ld8(const float* p, float (&v)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void st8(T* p, const float (&v)[8]) {
    uint4 q;
    q.x = pack2<T>(v[0], v[1]);
    q.y = pack2<T>(v[2], v[3]);
    q.z = pack2<T>(v[4], v[5]);
    q.w = pack2<T>(v[6], v[7]);
    *reinterpret_cast<uint4*>(p) = q;
}
__device__ __forceinline__ void st8(float* p, const float (&v)[8]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename T>
__device__ __forceinline__ void bias_act_vec_impl(const T* x, const T* __restrict__ bias, T* y, int n, int cols,
                                                  int act) {
    const int items = n >> 3;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const size_t e0 = (size_t)i * 8;
        float v[8];
        ld8(x + e0, v);
        if (bias != 0) {
            float b[8];
            ld8(bias + (int)(e0 % (size_t)cols), b);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] += b[e];
        }
        if (sizeof(T) == 2 && act == ACT_GELU) {
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = gelu_erfc_fast(v[e]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = apply_act(v[e], act);
        }
        st8(y + e0, v);
    }
}

#define VEC_KERNELS(T, SUF)                                                                                     \
    extern "C" __global__ void __launch_bounds__(LNV_THREADS)                                                   \
        add_ln_vec_##SUF(const T* x, const T* residual, const T* gamma, const T* beta, float eps, T* out,       \
                         int rows, int hidden) { pdl_enter();                                                                \
        add_ln_vec_impl<T>(x, residual, gamma, beta, eps, out, rows, hidden);                                   \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(LNV_THREADS)                                                   \
        embed_ln_vec_##SUF(const int* ids, const int* types, const int* positions, const T* word, const T* pos, \
                           const T* ttab, const T* gamma, const T* beta, float eps, T* out, int rows, int seq,  \
                           int hidden, int vocab, int npos, int ntypes, const unsigned* stage_src,              \
                           unsigned* stage_dst, int stage_words, int stage_sync) {                              \
        embed_ln_vec_impl<T>(ids, types, positions, word, pos, ttab, gamma, beta, eps, out, rows, seq, hidden,  \
                             vocab, npos, ntypes, stage_src, stage_dst, stage_words, stage_sync);               \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(LNV_THREADS) embed_ln_vec_inl_##SUF(                         \
        const __grid_constant__ InlineBlock in, int ids_w, int types_w, int pos_w, const T* word, const T* pos, \
        const T* ttab, const T* gamma, const T* beta, float eps, T* out, int rows, int seq, int hidden,         \
        int vocab, int npos, int ntypes, unsigned* stage_dst, int stage_words, int stage_sync) {                \
        embed_ln_vec_inl_impl<T>(in, ids_w, types_w, pos_w, word, pos, ttab, gamma, beta, eps, out, rows, seq,  \
                                 hidden, vocab, npos, ntypes, stage_dst, stage_words, stage_sync);              \
    }                                                                                                           \
    extern "C" __global__ void bias_act_vec_##SUF(const T* x, const T* bias, T* y, int n, int cols, int act) { pdl_enter();  \
        bias_act_vec_impl<T>(x, bias, y, n, cols, act);                                                         \
    }

VEC_KERNELS(float, f32)
VEC_KERNELS(f16_t, f16)
VEC_KERNELS(bf16_t, bf16)
