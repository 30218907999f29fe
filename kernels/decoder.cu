// Decoder embedding models (Qwen3-Embedding, EmbeddingGemma): RMSNorm with
// the residual adds around it, the per-head q/k RMSNorm fused with the rotary
// embedding, and the scaled embedding gather. All math in f32; every value a
// separate op would store is rounded to the storage type T where that op
// stores it, so a fused kernel computes exactly what its ops one by one do.
//
// * rms_norm_<t> (one block per row, 16-byte vectors; `rms_threads` on the
//   host picks the block): up to three steps of a pre-norm block in one pass
//   over the row, each present when its pointer is:
//     v = x
//     g1:       v = v / sqrt(mean(v^2) + eps1) * (off1 + g1)    (an RmsNorm of x)
//     res_in:   v = res_in + v, stored to res_out where given    (the Add into the residual)
//     g2:       v = v / sqrt(mean(v^2) + eps2) * (off2 + g2)    (the next RmsNorm)
//     out:      out = v
//   So RmsNorm is (g1, out); Add then RmsNorm (Qwen3's residual add and the
//   next sublayer's norm) is (res_in = res_out = the residual, g2, out);
//   Gemma's post-norm, add and the next pre-norm is (g1, res, g2, out); its
//   post-norm and add alone (g1, res). `out` may alias x and res_in/res_out
//   (each value is read and written by one thread, reads first); the host
//   passes res_out null where out is the residual itself or nothing reads it.
//   Thread t holds the vectors t + k·blockDim.x (k < RMS_VPT) of V = 16 /
//   sizeof(T) values when hidden % V == 0, else the values t + i·blockDim.x.
//   The weights (g1, g2) are loaded before the kernel waits for the one
//   before it (programmatic dependent launch).
//
// * qk_norm_rope_<t> (one block per row, one warp per head): in place on the
//   heads q heads and kv_heads k heads of a row of qkv ([q | k | v], (heads +
//   2·kv_heads)·head_dim wide; v untouched): with q_gamma, each head's RMSNorm
//   (q_gamma for q heads, k_gamma for k heads; `offset` 0 or Gemma's 1),
//   rounded to T; with `rotate`, then rotary position embedding ("rotate
//   half", prenorm.cu's rotary: cos and sin of p · scale · theta^(-2d/hd) in
//   f32, computed once a row in shared memory for all its heads). The row's
//   position p is positions[r] (packed), r % seq (padded), or with dynamic
//   NTK (factor > 0) from the mask or offsets in `index` with the base of its
//   sequence's length (prenorm.cu's rotary_ntk). Lane l holds the pairs (d,
//   d + half) for d = l·P .. l·P + P - 1 (head_dim = 64·P, one vector load per
//   half; P = 1, 2, 4) or for d = l + 32·j (other even head sizes up to 256),
//   so the rotation needs no shuffle; a warp loads QK_HEADS heads before it
//   computes any, one read and one write of q and k in all.
//
// * embed_scaled_<t>: out[r] = word[ids[r]] · scale (Gemma's √hidden, which
//   the host rounds to T first, as Gemma's embed_scale is), one block a row,
//   16-byte vectors; the product rounded to T. (Scale 1 keeps prenorm.cu's
//   embed_rows.)

#define RMS_VPT 2
#define RMS_MAX_THREADS 768
#define QK_HEADS 4
#define QK_MAX_HALF 128

template <typename T>
__device__ __forceinline__ float round_to(float x) {
    return to_f32(from_f32<T>(x));
}

// V values of T as one 16-byte vector (V = 16 / sizeof(T)).
template <typename T>
struct RmsVec {
    static constexpr int V = 16 / sizeof(T);
};

template <typename T>
__device__ __forceinline__ void vec_load(const T* p, float (&v)[16 / sizeof(T)]) {
    constexpr int V = 16 / sizeof(T);
    alignas(16) T t[V];
    *reinterpret_cast<uint4*>(t) = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int e = 0; e < V; e++) v[e] = to_f32(t[e]);
}

template <typename T>
__device__ __forceinline__ void vec_store(T* p, const float (&v)[16 / sizeof(T)]) {
    constexpr int V = 16 / sizeof(T);
    alignas(16) T t[V];
#pragma unroll
    for (int e = 0; e < V; e++) t[e] = from_f32<T>(v[e]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(t);
}

// Thread-held row values: VEC, vectors t + k·n of V values; else values
// t + (k·V + e)·n. `col` is the column of (k, e), `in` whether it exists.
template <typename T, bool VEC>
struct RmsLayout {
    static constexpr int V = 16 / sizeof(T);
    int t, n, hidden;
    __device__ __forceinline__ int col(int k, int e) const { return VEC ? (t + k * n) * V + e : t + (k * V + e) * n; }
    __device__ __forceinline__ bool in(int k, int e) const { return col(k, e) < hidden; }
    // Loads the row `p` (0 where a column does not exist).
    __device__ __forceinline__ void load(const T* p, float (&v)[RMS_VPT][V]) const {
#pragma unroll
        for (int k = 0; k < RMS_VPT; k++) {
            if (VEC) {
                if (in(k, 0)) {
                    vec_load(p + col(k, 0), v[k]);
                } else {
#pragma unroll
                    for (int e = 0; e < V; e++) v[k][e] = 0.0f;
                }
            } else {
#pragma unroll
                for (int e = 0; e < V; e++) v[k][e] = in(k, e) ? to_f32(p[col(k, e)]) : 0.0f;
            }
        }
    }
    __device__ __forceinline__ void store(T* p, const float (&v)[RMS_VPT][V]) const {
#pragma unroll
        for (int k = 0; k < RMS_VPT; k++) {
            if (VEC) {
                if (in(k, 0)) vec_store(p + col(k, 0), v[k]);
            } else {
#pragma unroll
                for (int e = 0; e < V; e++)
                    if (in(k, e)) p[col(k, e)] = from_f32<T>(v[k][e]);
            }
        }
    }
};

// This thread's gamma values: with VEC prefetched as raw 16-byte vectors
// (before the kernel waits for the one before it), else read when used.
template <typename T, bool VEC>
struct RmsGamma {
    static constexpr int V = 16 / sizeof(T);
    const T* g;
    uint4 raw[RMS_VPT];
    __device__ __forceinline__ void prefetch(const RmsLayout<T, VEC>& lay) {
        if (VEC && g)
#pragma unroll
            for (int k = 0; k < RMS_VPT; k++)
                if (lay.in(k, 0)) raw[k] = *reinterpret_cast<const uint4*>(g + lay.col(k, 0));
    }
    __device__ __forceinline__ float at(const RmsLayout<T, VEC>& lay, int k, int e) const {
        if (VEC) return to_f32(reinterpret_cast<const T*>(&raw[k])[e]);
        return lay.in(k, e) ? to_f32(g[lay.col(k, e)]) : 0.0f;
    }
};

// v ← v / sqrt(mean(v²) + eps) · (off + g), rounded to T.
template <typename T, bool VEC>
__device__ __forceinline__ void rms_apply(float (&v)[RMS_VPT][16 / sizeof(T)], const RmsLayout<T, VEC>& lay,
                                          const RmsGamma<T, VEC>& g, float eps, float off, int hidden, float* sh) {
    constexpr int V = 16 / sizeof(T);
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_VPT; k++)
#pragma unroll
        for (int e = 0; e < V; e++) ss = fmaf(v[k][e], v[k][e], ss);  // zeros where no column
    const float r = 1.0f / sqrtf(block_sum(ss, sh) / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < RMS_VPT; k++)
#pragma unroll
        for (int e = 0; e < V; e++) v[k][e] = round_to<T>(v[k][e] * (r * (off + g.at(lay, k, e))));
}

template <typename T, bool VEC>
__device__ __forceinline__ void rms_norm_row(const T* x, const T* __restrict__ g1, float eps1, float off1,
                                             const T* res_in, T* res_out, const T* __restrict__ g2, float eps2,
                                             float off2, T* out, int hidden) {
    constexpr int V = 16 / sizeof(T);
    __shared__ float sh[32];
    const RmsLayout<T, VEC> lay{(int)threadIdx.x, (int)blockDim.x, hidden};
    const size_t base = (size_t)blockIdx.x * hidden;
    // The weights first: they do not depend on the kernel before.
    RmsGamma<T, VEC> w1{g1}, w2{g2};
    w1.prefetch(lay);
    w2.prefetch(lay);
    pdl_enter();
    float v[RMS_VPT][V];
    lay.load(x + base, v);
    if (g1) rms_apply<T, VEC>(v, lay, w1, eps1, off1, hidden, sh);
    if (res_in) {
        float r[RMS_VPT][V];
        lay.load(res_in + base, r);
#pragma unroll
        for (int k = 0; k < RMS_VPT; k++)
#pragma unroll
            for (int e = 0; e < V; e++) v[k][e] = round_to<T>(r[k][e] + v[k][e]);
        if (res_out) lay.store(res_out + base, v);
    }
    if (g2) rms_apply<T, VEC>(v, lay, w2, eps2, off2, hidden, sh);
    if (out) lay.store(out + base, v);
}

template <typename T>
__device__ __forceinline__ void rms_norm_impl(const T* x, const T* g1, float eps1, float off1, const T* res_in,
                                              T* res_out, const T* g2, float eps2, float off2, T* out, int hidden) {
    if (hidden % RmsVec<T>::V == 0)
        rms_norm_row<T, true>(x, g1, eps1, off1, res_in, res_out, g2, eps2, off2, out, hidden);
    else
        rms_norm_row<T, false>(x, g1, eps1, off1, res_in, res_out, g2, eps2, off2, out, hidden);
}

// P values of T at p (P·sizeof(T) bytes, aligned to it: one load).
template <typename T, int P>
struct alignas(sizeof(T) * P) Pack {
    T v[P];
};

// One head of a row, in place: lane-held pairs a[j] = x[d_j], b[j] = x[d_j +
// half] (d_j as the kernel's comment says), RMSNorm with gamma values (ga,
// gb) and/or rotation by (cs, sn) at d_j.
template <typename T, int P, bool CONTIG>
struct QkLanes {
    int lane, half;
    __device__ __forceinline__ int d(int j) const { return CONTIG ? lane * P + j : lane + 32 * j; }
    __device__ __forceinline__ bool in(int j) const { return CONTIG || d(j) < half; }
    __device__ __forceinline__ void load(const T* x, float (&a)[P], float (&b)[P]) const {
        if (CONTIG) {
            const Pack<T, P> pa = *reinterpret_cast<const Pack<T, P>*>(x + lane * P);
            const Pack<T, P> pb = *reinterpret_cast<const Pack<T, P>*>(x + half + lane * P);
#pragma unroll
            for (int j = 0; j < P; j++) {
                a[j] = to_f32(pa.v[j]);
                b[j] = to_f32(pb.v[j]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < P; j++) {
                a[j] = in(j) ? to_f32(x[d(j)]) : 0.0f;
                b[j] = in(j) ? to_f32(x[d(j) + half]) : 0.0f;
            }
        }
    }
    __device__ __forceinline__ void store(T* x, const float (&a)[P], const float (&b)[P]) const {
        if (CONTIG) {
            Pack<T, P> pa, pb;
#pragma unroll
            for (int j = 0; j < P; j++) {
                pa.v[j] = from_f32<T>(a[j]);
                pb.v[j] = from_f32<T>(b[j]);
            }
            *reinterpret_cast<Pack<T, P>*>(x + lane * P) = pa;
            *reinterpret_cast<Pack<T, P>*>(x + half + lane * P) = pb;
        } else {
#pragma unroll
            for (int j = 0; j < P; j++)
                if (in(j)) {
                    x[d(j)] = from_f32<T>(a[j]);
                    x[d(j) + half] = from_f32<T>(b[j]);
                }
        }
    }
};

template <typename T, int P, bool CONTIG>
__device__ __forceinline__ void qk_norm_rope_row(T* row, const T* __restrict__ q_gamma, const T* __restrict__ k_gamma,
                                                 float eps, float offset, int heads, int nh, int head_dim, int rotate,
                                                 const float* cs, const float* sn) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const QkLanes<T, P, CONTIG> ln{lane, head_dim / 2};
    const bool norm = q_gamma != 0;
    float qa[P], qb[P], ka[P], kb[P], c[P], s[P];
    if (norm) {
        ln.load(q_gamma, qa, qb);
        ln.load(k_gamma, ka, kb);
#pragma unroll
        for (int j = 0; j < P; j++) {
            qa[j] += offset;
            qb[j] += offset;
            ka[j] += offset;
            kb[j] += offset;
        }
    }
    if (rotate) {
#pragma unroll
        for (int j = 0; j < P; j++) {
            c[j] = ln.in(j) ? cs[ln.d(j)] : 0.0f;
            s[j] = ln.in(j) ? sn[ln.d(j)] : 0.0f;
        }
    }
    const float inv_hd = 1.0f / (float)head_dim;
    for (int h0 = warp; h0 < nh; h0 += QK_HEADS * nwarps) {
        float a[QK_HEADS][P], b[QK_HEADS][P];
        // Every head's loads before any is computed.
#pragma unroll
        for (int u = 0; u < QK_HEADS; u++) {
            const int h = h0 + u * nwarps;
            if (h < nh) ln.load(row + (size_t)h * head_dim, a[u], b[u]);
        }
#pragma unroll
        for (int u = 0; u < QK_HEADS; u++) {
            const int h = h0 + u * nwarps;
            if (h >= nh) break;  // warp-uniform
            if (norm) {
                float ss = 0.0f;
#pragma unroll
                for (int j = 0; j < P; j++) ss = fmaf(a[u][j], a[u][j], fmaf(b[u][j], b[u][j], ss));
                const float r = 1.0f / sqrtf(warp_sum(ss) * inv_hd + eps);
                const bool q = h < heads;
#pragma unroll
                for (int j = 0; j < P; j++) {
                    a[u][j] = round_to<T>(a[u][j] * (r * (q ? qa[j] : ka[j])));
                    b[u][j] = round_to<T>(b[u][j] * (r * (q ? qb[j] : kb[j])));
                }
            }
            if (rotate) {
#pragma unroll
                for (int j = 0; j < P; j++) {
                    const float x = a[u][j], y = b[u][j];
                    a[u][j] = x * c[j] - y * s[j];
                    b[u][j] = y * c[j] + x * s[j];
                }
            }
            ln.store(row + (size_t)h * head_dim, a[u], b[u]);
        }
    }
}

template <typename T>
__device__ __forceinline__ void qk_norm_rope_impl(T* qkv, const T* __restrict__ q_gamma, const T* __restrict__ k_gamma,
                                                  float eps, float offset, const int* __restrict__ positions,
                                                  const int* __restrict__ index, int packed, int seq, int nseqs,
                                                  int heads, int kv_heads, int head_dim, int rotate, float theta,
                                                  float scale, float factor, int max_trained) {
    const int r = blockIdx.x;
    const int half = head_dim / 2;
    __shared__ float cs[QK_MAX_HALF], sn[QK_MAX_HALF];
    __shared__ int len_s, pos_s;
    pdl_enter();
    if (rotate) {
        float base = theta;
        int p;
        if (factor > 0.0f) {
            rotary_row_len_pos(index, packed, seq, nseqs, r, len_s, pos_s);
            base = rotary_ntk_base(theta, factor, max_trained, len_s, head_dim);
            p = pos_s;
        } else {
            p = positions != 0 ? positions[r] : r % seq;
        }
        for (int d = threadIdx.x; d < half; d += blockDim.x) {
            const float inv = scale / powf(base, (float)(2 * d) / (float)head_dim);
            float sv, cv;
            sincosf((float)p * inv, &sv, &cv);
            sn[d] = sv;
            cs[d] = cv;
        }
        __syncthreads();
    }
    T* row = qkv + (size_t)r * (heads + 2 * kv_heads) * head_dim;
    const int nh = heads + kv_heads;
    switch (head_dim) {
    case 64: qk_norm_rope_row<T, 1, true>(row, q_gamma, k_gamma, eps, offset, heads, nh, head_dim, rotate, cs, sn); break;
    case 128: qk_norm_rope_row<T, 2, true>(row, q_gamma, k_gamma, eps, offset, heads, nh, head_dim, rotate, cs, sn); break;
    case 256: qk_norm_rope_row<T, 4, true>(row, q_gamma, k_gamma, eps, offset, heads, nh, head_dim, rotate, cs, sn); break;
    default: qk_norm_rope_row<T, 4, false>(row, q_gamma, k_gamma, eps, offset, heads, nh, head_dim, rotate, cs, sn);
    }
}

template <typename T>
__device__ __forceinline__ void embed_scaled_impl(const int* __restrict__ ids, const T* __restrict__ word,
                                                  T* __restrict__ out, int hidden, int vocab, float scale) {
    constexpr int V = 16 / sizeof(T);
    const int r = blockIdx.x;
    const int id = min(max(ids[r], 0), vocab - 1);
    const T* w = word + (size_t)id * hidden;
    T* o = out + (size_t)r * hidden;
    if (hidden % V == 0) {
        for (int c = threadIdx.x * V; c < hidden; c += blockDim.x * V) {
            float v[V];
            vec_load(w + c, v);
#pragma unroll
            for (int e = 0; e < V; e++) v[e] *= scale;
            vec_store(o + c, v);
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) o[c] = from_f32<T>(to_f32(w[c]) * scale);
    }
}

#define DECODER_KERNELS(T, SUF)                                                                                   \
    extern "C" __global__ void __launch_bounds__(RMS_MAX_THREADS)                                                 \
        rms_norm_##SUF(const T* x, const T* g1, float eps1, float off1, const T* res_in, T* res_out, const T* g2, \
                       float eps2, float off2, T* out, int hidden) {                                              \
        rms_norm_impl<T>(x, g1, eps1, off1, res_in, res_out, g2, eps2, off2, out, hidden);                        \
    }                                                                                                             \
    extern "C" __global__ void qk_norm_rope_##SUF(T* qkv, const T* q_gamma, const T* k_gamma, float eps,          \
                                                  float offset, const int* positions, const int* index,           \
                                                  int packed, int seq, int nseqs, int heads, int kv_heads,        \
                                                  int head_dim, int rotate, float theta, float scale,             \
                                                  float factor, int max_trained) {                                \
        qk_norm_rope_impl<T>(qkv, q_gamma, k_gamma, eps, offset, positions, index, packed, seq, nseqs, heads,     \
                             kv_heads, head_dim, rotate, theta, scale, factor, max_trained);                      \
    }                                                                                                             \
    extern "C" __global__ void embed_scaled_##SUF(const int* ids, const T* word, T* out, int hidden, int vocab,   \
                                                  float scale) {                                                  \
        pdl_enter();                                                                                              \
        embed_scaled_impl<T>(ids, word, out, hidden, vocab, scale);                                               \
    }

DECODER_KERNELS(float, f32)
DECODER_KERNELS(f16_t, f16)
DECODER_KERNELS(bf16_t, bf16)
