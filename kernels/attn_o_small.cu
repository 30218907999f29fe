// A layer's self-attention and the output Linear after it, for few token
// rows, in one kernel, f16/bf16 (attn_o_small_<t>_d<D>, D = 32, 64):
//
//   ctx = Attention(qkv)            (in shared memory, rounded to T)
//   out = gemm_small(ctx, W, ...)   (any of gemm_small's modes and epilogues)
//
// Why: at (1, 16) a layer was 5 dependent kernels (QKV, attention, O,
// FFN1, FFN2), each costing more as a link in the chain (its launch, the
// wait for the one before, the first loads' latency) than as work: the
// attention of 16 rows is ~20 mma a head. Here each of the O Linear's
// N / 16 blocks computes the whole attention of the batch's live rows
// itself (12 heads × 16 rows at MiniLM's (1, 16): 36 KB of q, k, v from
// L2 a block, warp-sized tasks on tensor cores) and multiplies it by its
// 16 columns of W, so the attention node is gone and nothing else changes:
// the O Linear keeps its grid of N / 16 blocks (the next kernel's blocks
// still find free SMs to launch early on), and its epilogue is
// gemm_small's (gs_store). The redundant attention costs each block far
// less than a node does (about 1 µs of the chain, against ~3).
//
// Attention semantics are attention_tc.cu's: a padded batch (`seq` > 0)
// has rows of `seq` tokens, key j of a row's sequence counts where
// mask[j] != 0; a packed batch (offsets != null, seq == 0) has sequence s
// at rows offsets[s] .. offsets[s+1] and no mask. Scores are scaled in f32
// and taken base 2 (log2(e) folded into the scale), with the online softmax
// of FlashAttention-2 over 16 keys at a time; P is rounded to T for the
// P·V product as in attention_tc, and a row with no key gets zeros (so do
// the rows past a packed batch's tokens).
//
// Loads: the block first copies the live rows of qkv into shared memory in
// one burst of cp.async (36 KB at (1, 16), 9 per thread, all in flight at
// once). A first version read each task's fragments from L2 as it went:
// its loads waited on each other's mma and took 11.2 µs a kernel (ncu)
// against 3.8 + 4.0 for the two kernels it replaced.
//
// Tasks: one (head, m-tile) per warp at a time; a task's keys are the span
// of its 16 rows' sequences (at most M). A task writes its context rows
// over its own q columns in shared memory (no other task reads them), and
// the O product reads them there.
//
// qkv [M, 3·H] (q | k | v, head h at h·D of each), W [N, H], the rest as
// gemm_small's (x is qkv). Dynamic shared memory: ⌈M/16⌉·16 rows of
// 3·H + 8 values of T (qkv; the 8 keep fragment loads conflict-free), then
// M + seqs + 1 ints (the mask, the packed offsets).
//
// Host-checked: T = f16/bf16, 1 <= M <= GS_MAXM, H = heads·D, H % 32 == 0,
// mode 0..2 as gemm_small.
//
// Uses gs_product / gs_bias / gs_store (gemm_small.cu), mma16816 / ex2_approx /
// TC_LOG2E (attention_tc.cu), sl_live_rows (small_layer.cu).

// Two T values as one packed pair (lo = a, hi = b).
__device__ __forceinline__ unsigned ao_pair(const u16* a, const u16* b) {
    return (unsigned)*a | ((unsigned)*b << 16);
}

// One warp: the context of rows r0 .. r0+15 at head h's D columns, from
// qkv in shared memory (rows rs values apart), written over the rows' q.
// lo/hi: the key span of this lane's rows g and g + 8 (empty: lo >= hi);
// [klo, khi) their union over the warp; mask (shared memory) or null.
template <typename T, int D>
__device__ __forceinline__ void ao_task(T* qkv, int rs, int H, int h, int r0, int live, const int (&lo)[2],
                                        const int (&hi)[2], int klo, int khi, const int* mask, float scale2) {
    constexpr int KD = D / 16;  // k-steps over the head
    constexpr int ND = D / 8;   // output n8-tiles
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const u16* q = reinterpret_cast<const u16*>(qkv) + (size_t)h * D;
    const u16* k = q + H;
    const u16* v = q + 2 * H;

    unsigned qa[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = r0 + g + ((r & 1) ? 8 : 0);
            const int col = kk * 16 + 2 * t4 + ((r & 2) ? 8 : 0);
            qa[kk][r] = row < live ? *reinterpret_cast<const unsigned*>(q + (size_t)row * rs + col) : 0u;
        }
    float o[ND][4];
#pragma unroll
    for (int i = 0; i < ND; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[i][e] = 0.0f;
    float m_run[2] = {NEG_INF_F, NEG_INF_F}, l_run[2] = {0.0f, 0.0f};

    for (int kc = klo; kc < khi; kc += 16) {
        // S = Q·Kᵀ for keys kc .. kc+15 (two n8-tiles: key kc + 8·nt + g).
        float sc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const int key = kc + 8 * nt + g;
            const bool in = key < khi;
#pragma unroll
            for (int e = 0; e < 4; e++) sc[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                const u16* kr = k + (size_t)key * rs + kk * 16 + 2 * t4;
                const unsigned b0 = in ? *reinterpret_cast<const unsigned*>(kr) : 0u;
                const unsigned b1 = in ? *reinterpret_cast<const unsigned*>(kr + 8) : 0u;
                mma16816(sc[nt], qa[kk], b0, b1, T());
            }
        }
        // V's B fragments (keys 2·t4 (+1), 2·t4 + 8 (+1) of the chunk,
        // column g of each n8-tile), zero past the span.
        unsigned vb[ND][2];
        {
            const int j0 = kc + 2 * t4;
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                const u16* c = v + nd * 8 + g;
                const unsigned z = 0u;
                vb[nd][0] = j0 + 1 < khi ? ao_pair(c + (size_t)j0 * rs, c + (size_t)(j0 + 1) * rs)
                                         : (j0 < khi ? (unsigned)c[(size_t)j0 * rs] : z);
                vb[nd][1] = j0 + 9 < khi ? ao_pair(c + (size_t)(j0 + 8) * rs, c + (size_t)(j0 + 9) * rs)
                                         : (j0 + 8 < khi ? (unsigned)c[(size_t)(j0 + 8) * rs] : z);
            }
        }
        // Which of this lane's keys count (kc + 8·nt + 2·t4 + (e & 1)).
        bool key_ok[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int b = 0; b < 2; b++) {
                const int j = kc + 8 * nt + 2 * t4 + b;
                key_ok[nt][b] = j < khi && (mask == 0 || mask[j] != 0);
            }
        // Online softmax over rows g (e < 2) and g + 8 (e >= 2), log2 units.
        float mx[2] = {NEG_INF_F, NEG_INF_F};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hr = e >> 1, j = kc + 8 * nt + 2 * t4 + (e & 1);
                const bool ok = key_ok[nt][e & 1] && j >= lo[hr] && j < hi[hr];
                sc[nt][e] = ok ? sc[nt][e] * scale2 : NEG_INF_F;
                mx[hr] = fmaxf(mx[hr], sc[nt][e]);
            }
        float alpha[2];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
            const float m_new = fmaxf(m_run[hr], mx[hr]);
            alpha[hr] = m_new == NEG_INF_F ? 1.0f : ex2_approx(m_run[hr] - m_new);
            m_run[hr] = m_new;
        }
        float p[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hr = e >> 1;
                p[nt][e] = m_run[hr] == NEG_INF_F ? 0.0f : ex2_approx(sc[nt][e] - m_run[hr]);
            }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            l_run[hr] = l_run[hr] * alpha[hr] + (p[0][2 * hr] + p[0][2 * hr + 1]) + (p[1][2 * hr] + p[1][2 * hr + 1]);
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                o[nd][2 * hr] *= alpha[hr];
                o[nd][2 * hr + 1] *= alpha[hr];
            }
        }
        // O += P·V, P (rounded to T) reused from the score fragments.
        unsigned pa[4];
        pa[0] = pack2<T>(p[0][0], p[0][1]);
        pa[1] = pack2<T>(p[0][2], p[0][3]);
        pa[2] = pack2<T>(p[1][0], p[1][1]);
        pa[3] = pack2<T>(p[1][2], p[1][3]);
#pragma unroll
        for (int nd = 0; nd < ND; nd++) mma16816(o[nd], pa, vb[nd][0], vb[nd][1], T());
    }
    // Normalise (the row sums meet over the 4 lanes of a row) over q.
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        float l = l_run[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* dst = qkv + (size_t)(r0 + g + 8 * hr) * rs + (size_t)h * D + 2 * t4;
#pragma unroll
        for (int nd = 0; nd < ND; nd++)
            *reinterpret_cast<unsigned*>(dst + nd * 8) = pack2<T>(o[nd][2 * hr] * inv, o[nd][2 * hr + 1] * inv);
    }
}

template <typename T, int D>
__device__ __forceinline__ void attn_o_small_impl(const T* qkv, const T* __restrict__ w, const T* __restrict__ bias,
                                                  T* out, int M, int N, int K, int act, int mode,
                                                  const T* residual, float* tmp, const T* __restrict__ gamma,
                                                  const T* __restrict__ beta, float eps, unsigned* counter,
                                                  const int* offsets, int seqs, const int* mask, int seq,
                                                  int heads, float scale) {
    constexpr int MTMAX = GS_MAXM / 16;
    __shared__ float red[GS_WARPS][MTMAX][16 * GS_NB];
    extern __shared__ __align__(16) unsigned char ao_dyn[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
    const int n0 = blockIdx.x * GS_NB;
    const int live = sl_live_rows(M, offsets, seqs);
    const int mts = (live + 15) >> 4;
    const int rs = 3 * K + 8;  // the qkv rows' stride in shared memory
    T* sq = reinterpret_cast<T*>(ao_dyn);
    int* smask = reinterpret_cast<int*>(ao_dyn + (size_t)((M + 15) & ~15) * rs * sizeof(T));
    int* so = smask + M;
    // This block's weight rows into L1 while the QKV kernel finishes (they
    // are no kernel's output): gs_product then finds them there.
    {
        const int lines = (K * (int)sizeof(T) + 127) >> 7;
        for (int i = tid; i < GS_NB * lines; i += GS_THREADS) {
            const int r = min(n0 + i / lines, N - 1);
            const char* p = reinterpret_cast<const char*>(w + (size_t)r * K) + (i % lines) * 128;
            asm volatile("prefetch.L1 [%0];" ::"l"(p));
        }
    }
    const float bn = gs_bias(bias, N);
    pdl_wait();
    pdl_trigger();
    // The live rows of qkv (rows past M zero), the mask and the offsets
    // (clamped into [0, M]), all loads in flight at once.
    {
        const int cpr = (3 * K) >> 3;  // 16-byte chunks a row
        for (int i = tid; i < mts * 16 * cpr; i += GS_THREADS) {
            const int r = i / cpr, c = (i % cpr) * 8;
            cp_async16(sq + (size_t)r * rs + c, qkv + (size_t)min(r, M - 1) * 3 * K + c, r < M);
        }
        cp_async_commit();
    }
    const int total = offsets != 0 ? min(max(__ldcg(offsets + seqs), 0), M) : M;
    if (mask != 0)
        for (int i = tid; i < M; i += GS_THREADS) smask[i] = __ldcg(mask + i);
    if (offsets != 0)
        for (int i = tid; i <= seqs; i += GS_THREADS) so[i] = min(max(__ldcg(offsets + i), 0), total);
    cp_async_wait<0>();
    __syncthreads();
    const float scale2 = scale * TC_LOG2E;
    for (int task = warp; task < heads * mts; task += GS_WARPS) {
        const int mt = task / heads, h = task % heads, r0 = mt * 16;
        // The key span of this lane's rows g and g + 8.
        int lo[2], hi[2];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = r0 + g + 8 * hr;
            if (offsets == 0) {
                lo[hr] = (r / seq) * seq;
                hi[hr] = min(lo[hr] + seq, M);
            } else if (r >= total) {
                lo[hr] = hi[hr] = 0;
            } else {
                // The last s with so[s] <= r (so[seqs] = total > r). Any
                // offsets give a span inside [0, M]: what is read stays in
                // bounds even should a batch's offsets be wrong.
                int a = 0, b = seqs;
                while (b - a > 1) {
                    const int c = (a + b) >> 1;
                    if (so[c] <= r) a = c; else b = c;
                }
                lo[hr] = so[a];
                hi[hr] = max(so[a + 1], lo[hr]);
            }
        }
        int klo = lo[0] < hi[0] ? lo[0] : M, khi = lo[0] < hi[0] ? hi[0] : 0;
        if (lo[1] < hi[1]) {
            klo = min(klo, lo[1]);
            khi = max(khi, hi[1]);
        }
#pragma unroll
        for (int s = 16; s >= 1; s >>= 1) {
            klo = min(klo, __shfl_xor_sync(0xffffffffu, klo, s));
            khi = max(khi, __shfl_xor_sync(0xffffffffu, khi, s));
        }
        ao_task<T, D>(sq, rs, K, h, r0, live, lo, hi, klo, khi, mask != 0 ? smask : 0, scale2);
    }
    __syncthreads();

    // The O Linear over the context (the q columns), as gemm_small.
    if (mts <= 1) {
        gs_product<T, 1>(sq, rs, w, N, K, live, n0, red);
    } else if (mts == 2) {
        gs_product<T, 2>(sq, rs, w, N, K, live, n0, red);
    } else {
        gs_product<T, 4>(sq, rs, w, N, K, live, n0, red);
    }
    float res[GS_MAXM / 16];
    gs_residual<T>(residual, mode, mts, live, N, res);
    gs_store<T>(red, mts, live, bn, out, N, act, mode, res, tmp, gamma, beta, eps, counter);
}

#define ATTN_O_SMALL_KERNEL(T, SUF, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                                    \
        attn_o_small_##SUF##_d##D(const T* qkv, const T* w, const T* bias, T* out, int M, int N, int K,        \
                                  int act, int mode, const T* residual, float* tmp, const T* gamma,             \
                                  const T* beta, float eps, unsigned* counter, const int* offsets, int seqs,    \
                                  const int* mask, int seq, int heads, float scale) {                          \
        attn_o_small_impl<T, D>(qkv, w, bias, out, M, N, K, act, mode, residual, tmp, gamma, beta, eps,        \
                                counter, offsets, seqs, mask, seq, heads, scale);                              \
    }

ATTN_O_SMALL_KERNEL(f16_t, f16, 32)
ATTN_O_SMALL_KERNEL(f16_t, f16, 64)
ATTN_O_SMALL_KERNEL(bf16_t, bf16, 32)
ATTN_O_SMALL_KERNEL(bf16_t, bf16, 64)
