// The QKV projection of few token rows (M <= GS_MAXM) with each head's
// attention done in the same kernel, f16/bf16, head size 32:
//
//   qkv = x·Wqkvᵀ + bqkv                      (as gemm_small mode 0 computes it)
//   ctx[:, h·HD ..] = Attention(q_h, k_h, v_h) for every head h
//
// Why: at (1, 16) the separate attention kernel is a graph node of ~4 µs
// of which the work is well under one (H200, docs/perf-log.md): the
// dependency wait and launch dominate. Here the attention of a head starts
// as soon as the head's own q, k, v columns exist, with no grid-wide wait.
//
// Grid: heads · QA_PARTS blocks of GS_THREADS. Block b computes GS_NB = 16
// of head h = b / QA_PARTS's 3·HD columns (q, k, v: weight rows part·H +
// h·HD + d), exactly as gemm_small computes 16 output columns, and writes
// them (rounded to T, as the unfused path stores qkv) to `qkv` [M, 3H], the
// buffer the unfused attention reads. The last of a head's QA_PARTS blocks
// to finish (atomic counters[h], reset by it so graphs replay) reads the
// head's q, k, v back through L2 and computes its attention with
// small_layer.cu's exact f32 softmax: padded programs attend within the
// row's batch row to keys with mask != 0; packed ones within the row's
// cu_seqlens range, and live tail rows get a zero context.
//
// Rows: as gemm_small (padded: all M; packed: the live rows, sl_live_rows).
//
// Host-checked requirements: T = f16/bf16, 1 <= M <= GS_MAXM, H % 32 == 0,
// heads · QA_HD == H, rows 16-byte aligned, heads counters of zero.
//
// Uses gs_product (gemm_small.cu), sl_live_rows / sl_last_block
// (small_layer.cu), rel_bias (attention.cu), unpack2 (skinny.cu).

#define QA_HD 32
#define QA_PARTS (3 * QA_HD / GS_NB)  // blocks per head

template <typename T, bool BIAS>
__device__ __forceinline__ void qkv_attn_small_impl(const T* x, const T* __restrict__ w, const T* __restrict__ bias,
                                                    T* qkv, T* ctx, unsigned* counters, const int* mask,
                                                    const int* offsets, int seqs, int seq, int M, int H,
                                                    float scale, const T* __restrict__ pbias, int radius) {
    constexpr int HD = QA_HD, QS = HD + 1, MP = GS_MAXM, LDS = MP + 1;
    constexpr int MTMAX = GS_MAXM / 16;
    constexpr int RED_BYTES = GS_WARPS * MTMAX * 16 * GS_NB * 4;
    constexpr int ATT_BYTES = (3 * MP * QS + MP * LDS) * 4 + 3 * MP * 4;
    // The partial sums, then (in the head's last block) the attention.
    __shared__ __align__(16) unsigned char smem[RED_BYTES > ATT_BYTES ? RED_BYTES : ATT_BYTES];
    auto red = reinterpret_cast<float(*)[MTMAX][16 * GS_NB]>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x / QA_PARTS, c0 = (blockIdx.x % QA_PARTS) * GS_NB;
    const int N = 3 * H;
    const int n0 = (c0 / HD) * H + h * HD + c0 % HD;
    const int rr = tid / GS_NB, n = n0 + tid % GS_NB;
    const float bn = bias != 0 ? to_f32(bias[n]) : 0.0f;
    const int live = sl_live_rows(M, offsets, seqs);
    const int mts = (live + 15) >> 4;
    if (mts <= 1) {
        gs_product<T, 1>(x, H, w, N, H, live, n0, red);
    } else if (mts == 2) {
        gs_product<T, 2>(x, H, w, N, H, live, n0, red);
    } else {
        gs_product<T, 4>(x, H, w, N, H, live, n0, red);
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MTMAX; mt++) {
        const int r = mt * 16 + rr;
        if (mt >= mts || r >= live) continue;
        float v = bn;
#pragma unroll
        for (int q = 0; q < GS_WARPS; q++) v += red[q][mt][tid];
        qkv[(size_t)r * N + n] = from_f32<T>(v);
    }
    // Every thread has read `red` before the last block reuses it.
    if (!sl_last_block(counters + h, QA_PARTS)) return;

    float* sq = reinterpret_cast<float*>(smem);  // [MP][QS] q, k, v of head h
    float* sk = sq + MP * QS;
    float* sv = sk + MP * QS;
    float* ss = sv + MP * QS;                          // [MP][LDS] scores, then probabilities
    int* rs = reinterpret_cast<int*>(ss + MP * LDS);  // [MP] first key of each row's sequence
    int* rl = rs + MP;                                // [MP] its keys (0: none)
    int* km = rl + MP;                                // [MP] key not masked
    const int MR = mts * 16;
    // q, k, v of this head, 8 values a load, through L2 (other blocks wrote them).
    for (int i = tid; i < MR * 3 * (HD / 8); i += GS_THREADS) {
        const int r = i / (3 * (HD / 8)), rest = i - r * 3 * (HD / 8);
        const int part = rest / (HD / 8), d0 = (rest - part * (HD / 8)) * 8;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (r < live) {
            const uint4 u = __ldcg(reinterpret_cast<const uint4*>(qkv + (size_t)r * N + part * H + h * HD + d0));
            unpack2(u.x, T(), v + 0);
            unpack2(u.y, T(), v + 2);
            unpack2(u.z, T(), v + 4);
            unpack2(u.w, T(), v + 6);
        }
        float* dst = (part == 0 ? sq : (part == 1 ? sk : sv)) + r * QS + d0;
#pragma unroll
        for (int e = 0; e < 8; e++) dst[e] = v[e];
    }
    if (offsets == 0) {
        for (int r = tid; r < MR; r += GS_THREADS) {
            const bool on = r < live;
            rs[r] = on ? (r / seq) * seq : 0;
            rl[r] = on ? seq : 0;
            km[r] = on ? (mask[r] != 0) : 0;
        }
    } else {
        for (int r = tid; r < MR; r += GS_THREADS) {
            rs[r] = 0;
            rl[r] = 0;
            km[r] = 1;
        }
        __syncthreads();
        for (int s = tid; s < seqs; s += GS_THREADS) {
            const int a = min(max(offsets[s], 0), live);
            const int e = min(max(offsets[s + 1], a), live);
            for (int t = a; t < e; t++) {
                rs[t] = a;
                rl[t] = e - a;
            }
        }
    }
    __syncthreads();
    // Scores of every row against the keys of its sequence.
    for (int idx = tid; idx < MR * MR; idx += GS_THREADS) {
        const int i = idx / MR, j = idx - i * MR;
        const int a = rs[i];
        float s = NEG_INF_F;
        if (j >= a && j < a + rl[i] && km[j] != 0) {
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < HD; e++) d = fmaf(sq[i * QS + e], sk[j * QS + e], d);
            s = d * scale;
            if (BIAS) s += rel_bias(pbias + (size_t)h * (2 * radius + 1), radius, i - a, j - a);
        }
        ss[i * LDS + j] = s;
    }
    __syncthreads();
    // Softmax per row (a warp per row); a row whose keys are all masked gets zeros.
    for (int i = warp; i < MR; i += GS_WARPS) {
        float* row = ss + i * LDS;
        const int a = rs[i], e = a + rl[i];
        float m = NEG_INF_F;
        for (int j = a + lane; j < e; j += 32) m = fmaxf(m, row[j]);
        m = warp_max(m);
        float sum = 0.0f;
        for (int j = a + lane; j < e; j += 32) {
            const float p = (m == NEG_INF_F) ? 0.0f : expf(row[j] - m);
            row[j] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int j = a + lane; j < e; j += 32) row[j] *= inv;
    }
    __syncthreads();
    // This head's columns of the context = P · V, rounded to T, live rows.
    for (int idx = tid; idx < live * HD; idx += GS_THREADS) {
        const int i = idx / HD, d = idx - i * HD;
        const int a = rs[i], e = a + rl[i];
        float o = 0.0f;
        for (int j = a; j < e; j++) o = fmaf(ss[i * LDS + j], sv[j * QS + d], o);
        ctx[(size_t)i * H + h * HD + d] = from_f32<T>(o);
    }
    if (tid == 0) counters[h] = 0u;
}

#define QKV_ATTN_SMALL_KERNEL(T, SUF)                                                                           \
    extern "C" __global__ void __launch_bounds__(GS_THREADS) qkv_attn_small_##SUF##_d32(                        \
        const T* x, const T* w, const T* bias, T* qkv, T* ctx, unsigned* counters, const int* mask,            \
        const int* offsets, int seqs, int seq, int M, int H, float scale) {                                     \
        qkv_attn_small_impl<T, false>(x, w, bias, qkv, ctx, counters, mask, offsets, seqs, seq, M, H, scale,    \
                                      nullptr, 0);                                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(GS_THREADS) qkv_attn_small_bias_##SUF##_d32(                   \
        const T* x, const T* w, const T* bias, T* qkv, T* ctx, unsigned* counters, const int* mask,            \
        const int* offsets, int seqs, int seq, int M, int H, float scale, const T* pbias, int radius) {         \
        qkv_attn_small_impl<T, true>(x, w, bias, qkv, ctx, counters, mask, offsets, seqs, seq, M, H, scale,     \
                                     pbias, radius);                                                            \
    }

QKV_ATTN_SMALL_KERNEL(f16_t, f16)
QKV_ATTN_SMALL_KERNEL(bf16_t, bf16)
