// Pre-norm encoders with rotary positions (ModernBERT): the embedding
// gather without position table, a LayerNorm without residual (bias
// optional), the residual add, rotary position embedding on q and k, the
// gated feed-forward unit, and sliding-window attention; and the decoders'
// attention off the tensor cores (attention_band_<t>_d<N>: grouped-query
// heads, causal / windowed band, any length). decoder.cu uses the rotary
// helpers (rotary_row_len_pos, rotary_ntk_base).
//
// Straightforward kernels: each op is one pass over its activations; the
// fused and tensor-core forms are for later (issue 32). Ids are clamped into
// the table, as everywhere, so a bad id can never fault the device.

// out[r] = word[ids[r]]: one block per row.
template <typename T>
__device__ __forceinline__ void embed_rows_impl(const int* __restrict__ ids, const T* __restrict__ word,
                                                T* __restrict__ out, int hidden, int vocab) {
    const int r = blockIdx.x;
    const int id = min(max(ids[r], 0), vocab - 1);
    const T* w = word + (size_t)id * hidden;
    T* o = out + (size_t)r * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) o[c] = w[c];
}

// out[r] = LayerNorm(x[r]) * gamma (+ beta where given): one block per row,
// values in registers as layernorm.cu's ln_finish; `out` may alias `x`.
template <typename T>
__device__ __forceinline__ void ln_rows_impl(const T* x, const T* __restrict__ gamma, const T* __restrict__ beta,
                                             float eps, T* out, int hidden) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * hidden;
    float v[LN_VPT];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < hidden ? to_f32(x[base + c]) : 0.0f;
        s += v[i];
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
    const float rstd = 1.0f / sqrtf(block_sum(q, sh) / (float)hidden + eps);
#pragma unroll
    for (int i = 0; i < LN_VPT; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < hidden) {
            const float b = beta != 0 ? to_f32(beta[c]) : 0.0f;
            out[base + c] = from_f32<T>((v[i] - mean) * rstd * to_f32(gamma[c]) + b);
        }
    }
}

// into[i] += x[i] for i < n: grid-stride.
template <typename T>
__device__ __forceinline__ void add_rows_impl(const T* __restrict__ x, T* __restrict__ into, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        into[i] = from_f32<T>(to_f32(into[i]) + to_f32(x[i]));
}

// Rotary embedding in place on the q and k parts of qkv ([rows, 3·heads·d],
// q | k | v), "rotate half": for d' < d/2 and angle a = p · scale ·
// theta^(−2d'/d) (f32, as transformers; scale is 1 but for GTE's NTK), x[d'] ← x[d']·cos a − x[d' + d/2]·sin a and
// x[d' + d/2] ← x[d' + d/2]·cos a + x[d']·sin a. The position p of row r is
// positions[r] (packed) or r % seq (padded). Grid-stride over
// rows × 2·heads × d/2 pairs.
#define ROTARY_MAX_HALF 128

template <typename T>
__device__ __forceinline__ void rotary_impl(T* qkv, const int* __restrict__ positions, int seq, int rows, int heads,
                                            int head_dim, float theta, float scale) {
    const int half = head_dim / 2;
    // The frequencies, once a block (half <= ROTARY_MAX_HALF, host-checked):
    // a powf per element made the kernel compute-bound (38.7 µs a layer at
    // (32, 128), 768 wide, on an H100).
    __shared__ float inv_s[ROTARY_MAX_HALF];
    for (int d = threadIdx.x; d < half; d += blockDim.x)
        inv_s[d] = scale / powf(theta, (float)(2 * d) / (float)head_dim);
    __syncthreads();
    const int per_row = 2 * heads * half;
    const int n = rows * per_row;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = i / per_row;
        const int rest = i - r * per_row;
        const int h = rest / half;  // 0 .. 2·heads: the q heads, then the k heads
        const int d = rest - h * half;
        const int p = positions != 0 ? positions[r] : r % seq;
        float s, c;
        sincosf((float)p * inv_s[d], &s, &c);
        T* x = qkv + (size_t)r * 3 * heads * head_dim + (size_t)h * head_dim;
        const float a = to_f32(x[d]);
        const float b = to_f32(x[d + half]);
        x[d] = from_f32<T>(a * c - b * s);
        x[d + half] = from_f32<T>(b * c + a * s);
    }
}

// rotary_ntk_<t> (NomicBERT's dynamic NTK, decided per sequence): the same
// rotation, one block a row, with the base of its sequence's length len:
// theta · (factor · len / max_trained − (factor − 1))^(d / (d − 2)) when len
// > max_trained (factor 0: never). The length comes from the row's mask
// (padded: `index` is the mask, rows of `seq`) or from the offsets (packed:
// `index` holds nseqs + 1 of them; a row past the last sequence is tail).
// Block-wide: the length of row r's sequence and r's position in it, from
// the mask (padded: `index` is the mask, rows of `seq`) or the offsets
// (packed: nseqs + 1 of them; a row past the last sequence is tail: 0, 0),
// in shared memory `len_s`, `pos_s` (read after the closing barrier).
__device__ __forceinline__ void rotary_row_len_pos(const int* __restrict__ index, int packed, int seq, int nseqs,
                                                   int r, int& len_s, int& pos_s) {
    if (packed) {
        if (threadIdx.x == 0) {
            // The last s with offsets[s] <= r; s == nseqs: the tail.
            int lo = 0, hi = nseqs;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (index[mid] <= r) lo = mid; else hi = mid - 1;
            }
            len_s = lo < nseqs ? index[lo + 1] - index[lo] : 0;
            pos_s = lo < nseqs ? r - index[lo] : 0;
        }
    } else {
        if (threadIdx.x == 0) {
            len_s = 0;
            pos_s = r % seq;
        }
        __syncthreads();
        const int* m = index + (size_t)(r / seq) * seq;
        int n = 0;
        for (int j = threadIdx.x; j < seq; j += blockDim.x) n += m[j] != 0;
        atomicAdd(&len_s, n);
    }
    __syncthreads();
}

// The rotary base of a sequence of `len` tokens under dynamic NTK (factor 0:
// theta).
__device__ __forceinline__ float rotary_ntk_base(float theta, float factor, int max_trained, int len, int head_dim) {
    float base = theta;
    if (factor > 0.0f && len > max_trained)
        base = (float)((double)theta * pow((double)factor * len / max_trained - ((double)factor - 1.0),
                                           (double)head_dim / (double)(head_dim - 2)));
    return base;
}

template <typename T>
__device__ __forceinline__ void rotary_ntk_impl(T* qkv, const int* __restrict__ index, int packed, int seq,
                                                int nseqs, int heads, int head_dim, float theta, float scale,
                                                float factor, int max_trained) {
    const int r = blockIdx.x;
    const int half = head_dim / 2;
    __shared__ int len_s, pos_s;
    __shared__ float inv_s[ROTARY_MAX_HALF];
    rotary_row_len_pos(index, packed, seq, nseqs, r, len_s, pos_s);
    const int len = len_s;
    const float base = rotary_ntk_base(theta, factor, max_trained, len, head_dim);
    for (int d = threadIdx.x; d < half; d += blockDim.x)
        inv_s[d] = scale / powf(base, (float)(2 * d) / (float)head_dim);
    __syncthreads();
    const float p = (float)pos_s;
    T* row = qkv + (size_t)r * 3 * heads * head_dim;
    for (int i = threadIdx.x; i < 2 * heads * half; i += blockDim.x) {
        const int h = i / half, d = i - h * half;
        float s, c;
        sincosf(p * inv_s[d], &s, &c);
        T* x = row + (size_t)h * head_dim;
        const float a = to_f32(x[d]);
        const float b = to_f32(x[d + half]);
        x[d] = from_f32<T>(a * c - b * s);
        x[d + half] = from_f32<T>(b * c + a * s);
    }
}

// out[r, j] = act(x[r, j]) · x[r, width + j] (act_first) or
// x[r, j] · act(x[r, width + j]): grid-stride over rows × width, 16 bytes a
// thread at a time where width allows (the scalar loop ran at a third of
// the memory bandwidth: 60 µs for 4096 × 3072 f16 on an H100).
template <typename T>
__device__ __forceinline__ void gated_impl(const T* __restrict__ x, T* __restrict__ out, int rows, int width, int act,
                                           int act_first) {
    constexpr int V = 16 / sizeof(T);
    if (width % V == 0) {
        const int wv = width / V;
        const int n = rows * wv;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const int r = i / wv;
            const int j = (i - r * wv) * V;
            T a[V], b[V], o[V];
            *reinterpret_cast<uint4*>(a) = *reinterpret_cast<const uint4*>(x + (size_t)r * 2 * width + j);
            *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(x + (size_t)r * 2 * width + width + j);
#pragma unroll
            for (int e = 0; e < V; e++) {
                const float fa = to_f32(a[e]), fb = to_f32(b[e]);
                o[e] = from_f32<T>(act_first ? apply_act(fa, act) * fb : fa * apply_act(fb, act));
            }
            *reinterpret_cast<uint4*>(out + (size_t)r * width + j) = *reinterpret_cast<const uint4*>(o);
        }
        return;
    }
    const int n = rows * width;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = i / width;
        const int j = i - r * width;
        const float a = to_f32(x[(size_t)r * 2 * width + j]);
        const float b = to_f32(x[(size_t)r * 2 * width + width + j]);
        out[i] = from_f32<T>(act_first ? apply_act(a, act) * b : a * apply_act(b, act));
    }
}

// Sliding-window attention: one warp per (query row, head) over the keys of
// its sequence within ±window of it, online softmax in f32; each lane keeps
// head_dim / 32 (at most DMAX / 32) output values. Padded (offsets null): row
// r is position r % seq of sequence r / seq, its keys those with mask 1.
// Packed: row r's sequence is found in offsets (nseqs + 1 values); tail rows
// get zeros. A query that sees no key gets zeros.
//
// attention_band_<t>_d<DMAX> (decoders off the tensor cores: f32, head sizes
// other than 32/64/128/256, tc_attention off; DMAX 128 or 256): the same
// loop with grouped-query heads (qkv rows of (heads + 2·kv_heads)·head_dim,
// query head h reading key/value head h / (heads / kv_heads)) and the keys
// i - left .. i + right (causal: right = 0), the caller's scale. Its state
// is a warp's registers, so any sequence length runs (slowly: a key a step).
#define WATT_DMAX 128
template <typename T, int DMAX = WATT_DMAX, bool GQA = false>
__device__ __forceinline__ void attention_window_impl(const T* __restrict__ qkv, const int* __restrict__ index,
                                                      T* __restrict__ out, int packed, int seq, int nseqs, int rows,
                                                      int heads, int head_dim, float scale, int left, int right,
                                                      int kv_heads = 0) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= rows * heads) return;
    const int r = warp / heads;
    const int h = warp - r * heads;
    const int hd = heads * head_dim;
    // GQA: the row's width and where this head's key and value columns
    // start.
    size_t width = 0;
    int kcol = 0, vcol = 0;
    if (GQA) {
        const int kvh = h / (heads / kv_heads);
        width = (size_t)(heads + 2 * kv_heads) * head_dim;
        kcol = hd + kvh * head_dim;
        vcol = hd + (kv_heads + kvh) * head_dim;
    }
    int start, len;
    if (packed) {
        int lo = 0, hi = nseqs;  // the s with offsets[s] <= r < offsets[s + 1]
        if (r >= index[nseqs]) {
            start = r;
            len = 0;
        } else {
            while (hi - lo > 1) {
                const int mid = (lo + hi) / 2;
                if (index[mid] <= r) lo = mid; else hi = mid;
            }
            start = index[lo];
            len = index[lo + 1] - start;
        }
    } else {
        start = r - r % seq;
        len = seq;
    }
    const int i = r - start;
    float q[DMAX / 32], acc[DMAX / 32];
#pragma unroll
    for (int k = 0; k < DMAX / 32; k++) {
        const int d = lane + 32 * k;
        q[k] = d < head_dim && len > 0 ? to_f32(qkv[(GQA ? (size_t)r * width : (size_t)r * 3 * hd) + h * head_dim + d]) : 0.0f;
        acc[k] = 0.0f;
    }
    float m = NEG_INF_F, l = 0.0f;
    const int lo = max(0, i - left), hi = min(len - 1, i + right);
    for (int j = lo; j <= hi; j++) {
        if (!packed && index[start + j] == 0) continue;
        // (Multi-head: the addresses written as they were before grouped
        // heads, so the window kernel compiles as it did.)
        const T* kv = GQA ? qkv + (size_t)(start + j) * width : qkv + (size_t)(start + j) * 3 * hd + h * head_dim;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < DMAX / 32; k++) {
            const int d = lane + 32 * k;
            if (d < head_dim) dot += q[k] * to_f32(kv[GQA ? kcol + d : hd + d]);
        }
        const float sc = warp_sum(dot) * scale;
        const float m2 = fmaxf(m, sc);
        const float corr = __expf(m - m2);
        const float p = __expf(sc - m2);
        l = l * corr + p;
#pragma unroll
        for (int k = 0; k < DMAX / 32; k++) {
            const int d = lane + 32 * k;
            acc[k] = acc[k] * corr + (d < head_dim ? p * to_f32(kv[GQA ? vcol + d : 2 * hd + d]) : 0.0f);
        }
        m = m2;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int k = 0; k < DMAX / 32; k++) {
        const int d = lane + 32 * k;
        if (d < head_dim) out[(size_t)r * hd + h * head_dim + d] = from_f32<T>(acc[k] * inv);
    }
}

#define PRENORM_KERNELS(T, SUF)                                                                                   \
    extern "C" __global__ void embed_rows_##SUF(const int* ids, const T* word, T* out, int hidden, int vocab) {   \
        pdl_enter();                                                                                              \
        embed_rows_impl<T>(ids, word, out, hidden, vocab);                                                        \
    }                                                                                                             \
    extern "C" __global__ void ln_rows_##SUF(const T* x, const T* gamma, const T* beta, float eps, T* out,        \
                                             int hidden) {                                                        \
        pdl_enter();                                                                                              \
        ln_rows_impl<T>(x, gamma, beta, eps, out, hidden);                                                        \
    }                                                                                                             \
    extern "C" __global__ void add_rows_##SUF(const T* x, T* into, int n) {                                       \
        pdl_enter();                                                                                              \
        add_rows_impl<T>(x, into, n);                                                                             \
    }                                                                                                             \
    extern "C" __global__ void rotary_##SUF(T* qkv, const int* positions, int seq, int rows, int heads,           \
                                            int head_dim, float theta, float scale) {                             \
        pdl_enter();                                                                                              \
        rotary_impl<T>(qkv, positions, seq, rows, heads, head_dim, theta, scale);                                 \
    }                                                                                                             \
    extern "C" __global__ void rotary_ntk_##SUF(T* qkv, const int* index, int packed, int seq, int nseqs,       \
                                                int heads, int head_dim, float theta, float scale, float factor,  \
                                                int max_trained) {                                                \
        pdl_enter();                                                                                              \
        rotary_ntk_impl<T>(qkv, index, packed, seq, nseqs, heads, head_dim, theta, scale, factor, max_trained);  \
    }                                                                                                             \
    extern "C" __global__ void gated_##SUF(const T* x, T* out, int rows, int width, int act, int act_first) {     \
        pdl_enter();                                                                                              \
        gated_impl<T>(x, out, rows, width, act, act_first);                                                       \
    }                                                                                                             \
    extern "C" __global__ void attention_window_##SUF(const T* qkv, const int* index, T* out, int packed,         \
                                                      int seq, int nseqs, int rows, int heads, int head_dim,      \
                                                      float scale, int window) {                                  \
        pdl_enter();                                                                                              \
        attention_window_impl<T>(qkv, index, out, packed, seq, nseqs, rows, heads, head_dim, scale, window,       \
                                 window);                                                                         \
    }

#define ATTENTION_BAND_KERNEL(T, SUF, DMAX)                                                                       \
    extern "C" __global__ void attention_band_##SUF##_d##DMAX(const T* qkv, const int* index, T* out, int packed,  \
                                                             int seq, int nseqs, int rows, int heads,             \
                                                             int kv_heads, int head_dim, float scale, int left,   \
                                                             int right) {                                         \
        pdl_enter();                                                                                              \
        attention_window_impl<T, DMAX, true>(qkv, index, out, packed, seq, nseqs, rows, heads, head_dim, scale,  \
                                             left, right, kv_heads);                                              \
    }

PRENORM_KERNELS(float, f32)
PRENORM_KERNELS(f16_t, f16)
PRENORM_KERNELS(bf16_t, bf16)
ATTENTION_BAND_KERNEL(float, f32, 128)
ATTENTION_BAND_KERNEL(float, f32, 256)
ATTENTION_BAND_KERNEL(f16_t, f16, 128)
ATTENTION_BAND_KERNEL(f16_t, f16, 256)
ATTENTION_BAND_KERNEL(bf16_t, bf16, 128)
ATTENTION_BAND_KERNEL(bf16_t, bf16, 256)
