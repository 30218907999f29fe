// Multi-head self-attention on tensor cores (f16/bf16 storage, f32 accumulation),
// same semantics as attention.cu (padding mask, max-subtracted softmax, zeros
// for queries whose keys are all masked), for head sizes of exactly 32, 64, 128
// (and 256: the band kernels).
//
// One block of 4 warps per (64 queries, head, batch); each warp owns 16 query
// rows (the `_q128` kernels: 128 queries, two 16-row tiles a warp). Keys and values stream through shared memory TC_KB(D) at a time, two
// blocks in flight (cp.async, so the next block's loads overlap this one's
// products); scores S = Q.K^T and the output O += P.V use
// mma.sync.m16n8k16 (row.col), with the online softmax of FlashAttention-2:
// a running row max and row sum, O rescaled when the max grows, the score
// fragments reused in registers as the A operand of P.V. V stays row-major in
// shared memory and `ldmatrix.trans` hands out its B fragments. Scores are
// scaled in f32 after the product, and exponentials are taken base 2 with
// log2(e) folded into the scale.
//
// attention_tc_bias_<t>_d<D> (MPNet): plus the relative position bias of
// attention.cu's rel_bias, added to the scaled scores before the mask.
//
// attention_tc_band_<t>_d<D> (decoders: Qwen3, EmbeddingGemma; D = 32, 64,
// 128, 256): grouped-query heads and a key band. The qkv row is [q: heads·d |
// k: kv_heads·d | v: kv_heads·d] for a head size d <= D (a multiple of 8; the
// kernel's columns past d are zeros) and query head h reads key/value head
// h / (heads / kv_heads) (kv_heads = heads: plain multi-head attention); query
// i sees only the keys j with i − left <= j <= i + right (positions in the
// sequence): causal is right = 0, a sliding window left = right = window,
// both together left = window, right = 0, neither left = right = seq. The
// scale is the caller's (Gemma: query_pre_attn_scalar^-1/2). A block loads
// and visits only the key blocks its 64 queries' band reaches (causal: none
// after its last query); inside, a warp skips the key blocks wholly outside
// its 16 queries' band and tests scores only in the blocks the band cuts.
// Head size 256 takes 16-key blocks (two blocks of K and V in 33 KiB of
// static shared memory; Q's fragments and the 16 x 256 output stay in
// registers) and rescales its output only when a row's running max grows.
//
// attention_tc_win_<t>_d<D> (ModernBERT's local layers): the band kernel with
// left = right = window and kv_heads = heads, its arguments those of before
// the band (one window).
//
// tc_attend is the loop; attention_varlen.cu's tensor-core kernel runs it too.

#define TC_WARPS 4
#define TC_THREADS (32 * TC_WARPS)
#define TC_QT (16 * TC_WARPS)
#define TC_PAD 8
// Keys per shared-memory block: two blocks of K and V stay under the 48 KB
// of static shared memory for every head size.
// Head size 256: 16 keys (its 16 x 256 output tile takes 128 registers a
// thread; a 32-key block of K and V would not fit static shared memory).
#define TC_KB(D) ((D) >= 256 ? 16 : (D) >= 128 ? 32 : 64)
// Blocks an SM must hold (the register budget it implies): for head size 32,
// 6 blocks fill the shared memory and keep 24 warps resident (at the 121
// registers the compiler picks unbounded, 4: measured latency-bound).
#define TC_MIN_BLOCKS(D) ((D) == 32 ? 6 : (D) == 64 ? 3 : 2)

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, f16_t) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, bf16_t) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without passing through registers; `full` false
// zero-fills them (nothing is read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory (lanes 8i..8i+7 address matrix i's
// rows), plain or transposed, in mma fragment order.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

#define TC_LOG2E 1.4426950408889634f

// 2^x in one MUFU instruction (relative error about 2^-22; 2^-inf = 0).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One head of one tile of at most TC_QT · MR queries against the `seq` keys
// of their sequence. `base` is the sequence's first qkv row at this head's
// query columns (rows `row_stride` apart, its key head at +koff, its value
// head at +voff: +HD and +2HD for multi-head attention); `obase` the
// sequence's first output row at this head (rows HD apart). Queries q_first
// .. q_end-1 (relative to the sequence) are this block's; with MASK, key j
// counts only where mrow[j] != 0, and a row with no key gets zeros. With
// BAND, query i sees only keys i - left .. i + right. GQA (the band kernels'
// geometry): koff and voff are the caller's (else +HD and +2HD), and the head
// has `hd` values (hd <= D, a multiple of 8): the columns past it are zeros in
// Q, K and V (zero-filled, never read) and are not written.
// KB (keys per shared-memory block) is TC_KB(D) unless the caller knows the
// sequence is shorter (attention_tc_s16_<t>_d<D>: 16).
// MR: 16-row query tiles per warp (1 or 2). With 2 (the `_q128` kernels, 128
// queries a block) every K and V fragment a warp loads from shared memory
// feeds two mma instead of one, halving the ldmatrix traffic per product, and
// the warp has two independent chains of products and softmax to interleave.
template <typename T, int D, bool BIAS, bool MASK, int KB = TC_KB(D), bool BAND = false, bool GQA = false,
          int MR = 1>
__device__ __forceinline__ void tc_attend(const T* __restrict__ base, size_t row_stride, int HD, int koff, int voff,
                                          int seq, int q_first, int q_end, const int* __restrict__ mrow, float scale,
                                          const T* __restrict__ brow, int radius, T* __restrict__ obase,
                                          int left = 0, int right = 0, int hd = D) {
    static_assert(KB % 16 == 0 && KB <= 64, "a key block is whole mma k-steps, its mask one 64-bit word");
    static_assert(MR == 1 || MR == 2, "one or two row tiles a warp");
    constexpr int KS = D + TC_PAD;  // row stride of sK and sV (halves): ldmatrix rows hit distinct banks
    constexpr int ND = D / 8;       // output n-tiles
    constexpr int KD = D / 16;      // k-steps over the head
    constexpr int NK = KB / 8;      // score n-tiles per key block
    constexpr int CH = D / 8;       // 16-byte chunks per row
    constexpr int WR = 16 * MR;     // query rows a warp
    __shared__ __align__(16) u16 sK[2][KB * KS];
    __shared__ __align__(16) u16 sV[2][KB * KS];
    __shared__ unsigned sM[2][(KB + 31) / 32];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int q0 = q_first + warp * WR;
    const bool active = q0 < q_end;
    const int nblocks = (seq + KB - 1) / KB;
    // The key blocks this tile visits: all, or (BAND) those holding a key
    // that one of its queries q_first .. q_last sees.
    int kb_begin = 0, kb_end = nblocks;
    if (BAND) {
        const int q_last = min(q_first + TC_QT * MR, q_end) - 1;
        kb_begin = max(q_first - left, 0) / KB;
        kb_end = min(q_last + right, seq - 1) / KB + 1;
    }

    // Issues key block `kb`'s K and V rows into stage `st` (rows past the end
    // zero-filled) and commits them as one group; an empty group past the last.
    auto issue = [&](int kb, int st) {
        if (kb < kb_end) {
            const int kb0 = kb * KB;
            for (int i = tid; i < KB * CH; i += TC_THREADS) {
                const int j = i / CH, d = (i % CH) * 8;
                if (GQA) {
                    // Rows past the end and columns past the head: zeros.
                    const bool in = kb0 + j < seq && d < hd;
                    const T* r = base + (size_t)(in ? kb0 + j : 0) * row_stride + (in ? d : 0);
                    cp_async16(&sK[st][j * KS + d], r + koff, in);
                    cp_async16(&sV[st][j * KS + d], r + voff, in);
                } else {
                    const bool in = kb0 + j < seq;
                    const T* r = base + (size_t)(in ? kb0 + j : 0) * row_stride;
                    // (Multi-head: HD and 2·HD written out, which the
                    // compiler schedules better than the same values passed in.)
                    cp_async16(&sK[st][j * KS + d], r + HD + d, in);
                    cp_async16(&sV[st][j * KS + d], r + 2 * HD + d, in);
                }
            }
            // The mask as bits, 32 keys a word (one ballot a warp; every lane
            // of the warp takes part, also where KB < 32).
            if (MASK)
                for (int j = tid; j < ((KB + 31) & ~31); j += TC_THREADS) {
                    const bool in = j < KB && kb0 + j < seq;
                    const unsigned bits = __ballot_sync(0xffffffffu, in && mrow[kb0 + j] != 0);
                    if (lane == 0) sM[st][j >> 5] = bits;
                }
        }
        cp_async_commit();
    };
    // Q fragments (A operand, row-major 16 x D), straight from global memory,
    // issued first: the mask's ballot in `issue` waits for the mask's loads,
    // and Q's loads issued after it would add a second memory round trip
    // before the first product (one of a (1, 16) layer's critical path).
    unsigned qa[MR][KD][4];
#pragma unroll
    for (int mr = 0; mr < MR; mr++)
#pragma unroll
        for (int kk = 0; kk < KD; kk++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int row = q0 + 16 * mr + g + ((r & 1) ? 8 : 0);
                const int col = kk * 16 + t4 * 2 + ((r & 2) ? 8 : 0);
                qa[mr][kk][r] = (row < q_end && (!GQA || col < hd))
                                    ? *reinterpret_cast<const unsigned*>(base + (size_t)row * row_stride + col)
                                    : 0u;
            }
    // The first key blocks, while Q's loads are on their way.
    issue(kb_begin, 0);
    issue(kb_begin + 1, 1);

    float o[MR][ND][4];
#pragma unroll
    for (int mr = 0; mr < MR; mr++)
#pragma unroll
        for (int i = 0; i < ND; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mr][i][e] = 0.0f;
    float m_run[MR][2], l_run[MR][2];  // running max (log2 units) and sum
#pragma unroll
    for (int mr = 0; mr < MR; mr++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            m_run[mr][r] = NEG_INF_F;
            l_run[mr][r] = 0.0f;
        }
    const float scale2 = scale * TC_LOG2E;
    // This lane's ldmatrix row: matrix lane/8, row lane%8 of it.
    const int lm = lane >> 3, lr = lane & 7;

    for (int kb = kb_begin; kb < kb_end; kb++) {
        const int st = (kb - kb_begin) & 1, kb0 = kb * KB;
        cp_async_wait<1>();  // block kb has landed (kb+1 may still fly)
        __syncthreads();
        // BAND: this warp's queries q0 .. q0+WR-1 against keys kb0 .. kb0+KB-1.
        const bool band_skip = BAND && (kb0 > q0 + WR - 1 + right || kb0 + KB - 1 < q0 - left);
        const bool band_full = !BAND || (kb0 >= q0 + WR - 1 - left && kb0 + KB - 1 <= q0 + right);
        if (active && !band_skip) {
            // S = Q K^T: K's rows are the B fragments as stored, each loaded
            // once for the warp's MR row tiles.
            float sc[MR][NK][4];
#pragma unroll
            for (int nt = 0; nt < NK; nt++) {
#pragma unroll
                for (int mr = 0; mr < MR; mr++)
#pragma unroll
                    for (int e = 0; e < 4; e++) sc[mr][nt][e] = 0.0f;
#pragma unroll
                for (int kp = 0; kp < KD / 2; kp++) {
                    unsigned b[4];
                    ldsm_x4(b, &sK[st][(nt * 8 + lr) * KS + kp * 32 + lm * 8]);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        mma16816(sc[mr][nt], qa[mr][2 * kp], b[0], b[1], T());
                        mma16816(sc[mr][nt], qa[mr][2 * kp + 1], b[2], b[3], T());
                    }
                }
            }
            // The online softmax over rows g and g + 8 of each 16-row tile,
            // in log2 units. Without a bias the row max is taken on the raw
            // products (the scale is positive), so scaling and subtracting the
            // max is one fma per score.
            unsigned long long live = 0;
            if (MASK) {
                live = sM[st][0];
                if (KB > 32) live |= (unsigned long long)sM[st][KB > 32 ? 1 : 0] << 32;
            } else {
                const int n = seq - kb0;
                live = n >= 64 ? ~0ull : ((1ull << n) - 1);
            }
            // A block whose keys are all live (the common case) skips the
            // per-score test; otherwise this lane's keys start at bit 2 t4.
            constexpr unsigned long long all_keys = KB >= 64 ? ~0ull : ((1ull << KB) - 1);
            const bool full = (live & all_keys) == all_keys;
            const unsigned long long lt = live >> (t4 * 2);
            // s * mul - sub is the score in log2 units minus the row max.
            const float mul = BIAS ? 1.0f : scale2;
#pragma unroll
            for (int mr = 0; mr < MR; mr++) {
                const int qm = q0 + 16 * mr;
                float mx[2] = {NEG_INF_F, NEG_INF_F};
#pragma unroll
                for (int nt = 0; nt < NK; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float s = sc[mr][nt][e];
                        if (BIAS)
                            s = fmaf(s, scale,
                                     rel_bias(brow, radius, qm + g + 8 * (e >> 1), kb0 + nt * 8 + t4 * 2 + (e & 1))) *
                                TC_LOG2E;
                        if (!full && !((lt >> (nt * 8 + (e & 1))) & 1ull)) s = NEG_INF_F;
                        if (BAND && !band_full) {
                            const int d = (qm + g + 8 * (e >> 1)) - (kb0 + nt * 8 + t4 * 2 + (e & 1));
                            if (d > left || d < -right) s = NEG_INF_F;
                        }
                        sc[mr][nt][e] = s;
                        mx[e >> 1] = fmaxf(mx[e >> 1], s);
                    }
                float alpha[2], sub[2];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                    const float m_new = fmaxf(m_run[mr][r], mx[r] * mul);
                    // (Head size 256: exactly 1 where the max stays, so the
                    // rescale below can be skipped.)
                    alpha[r] = (m_new == NEG_INF_F || (D >= 256 && m_new == m_run[mr][r]))
                                   ? 1.0f
                                   : ex2_approx(m_run[mr][r] - m_new);
                    m_run[mr][r] = m_new;
                    // A row with no live key yet: every p is 0 (ex2(-inf)).
                    sub[r] = (m_new == NEG_INF_F) ? 0.0f : m_new;
                }
                float rs[2] = {0.0f, 0.0f};
#pragma unroll
                for (int nt = 0; nt < NK; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = e >> 1;
                        const float p = ex2_approx(fmaf(sc[mr][nt][e], mul, -sub[r]));
                        sc[mr][nt][e] = p;
                        rs[r] += p;
                    }
#pragma unroll
                for (int r = 0; r < 2; r++) l_run[mr][r] = l_run[mr][r] * alpha[r] + rs[r];
                // Head size 256: 128 products a thread for 16 keys; skipped
                // (warp-uniformly) where no row's max grew, as multiplying by
                // 1 changes nothing.
                if (D < 256 || __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
                    for (int i = 0; i < ND; i++) {
                        o[mr][i][0] *= alpha[0];
                        o[mr][i][1] *= alpha[0];
                        o[mr][i][2] *= alpha[1];
                        o[mr][i][3] *= alpha[1];
                    }
                }
            }
            // O += P V: the score fragments of key tiles 2ks and 2ks+1 form
            // the A operand; ldmatrix.trans turns V's rows into B fragments
            // (matrices: keys +0..7 and +8..15, for d-tiles nd and nd+1),
            // each loaded once for the warp's MR row tiles.
#pragma unroll
            for (int ks = 0; ks < KB / 16; ks++) {
                unsigned pa[MR][4];
#pragma unroll
                for (int mr = 0; mr < MR; mr++) {
                    pa[mr][0] = pack2<T>(sc[mr][2 * ks][0], sc[mr][2 * ks][1]);
                    pa[mr][1] = pack2<T>(sc[mr][2 * ks][2], sc[mr][2 * ks][3]);
                    pa[mr][2] = pack2<T>(sc[mr][2 * ks + 1][0], sc[mr][2 * ks + 1][1]);
                    pa[mr][3] = pack2<T>(sc[mr][2 * ks + 1][2], sc[mr][2 * ks + 1][3]);
                }
#pragma unroll
                for (int nd = 0; nd < ND; nd += 2) {
                    unsigned b[4];
                    ldsm_x4_t(b, &sV[st][(ks * 16 + (lm & 1) * 8 + lr) * KS + (nd + (lm >> 1)) * 8]);
#pragma unroll
                    for (int mr = 0; mr < MR; mr++) {
                        mma16816(o[mr][nd], pa[mr], b[0], b[1], T());
                        mma16816(o[mr][nd + 1], pa[mr], b[2], b[3], T());
                    }
                }
            }
        }
        __syncthreads();  // stage st consumed: it takes block kb + 2
        issue(kb + 2, st);
    }
    cp_async_wait<0>();
    if (!active) return;
#pragma unroll
    for (int mr = 0; mr < MR; mr++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l_run[mr][r] += __shfl_xor_sync(0xffffffffu, l_run[mr][r], 1);
            l_run[mr][r] += __shfl_xor_sync(0xffffffffu, l_run[mr][r], 2);
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = q0 + 16 * mr + g + 8 * r;
            if (row >= q_end) continue;
            const float inv = l_run[mr][r] > 0.0f ? 1.0f / l_run[mr][r] : 0.0f;
            T* orow = obase + (size_t)row * HD;
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                if (GQA && nd * 8 >= hd) break;
                *reinterpret_cast<unsigned*>(orow + nd * 8 + t4 * 2) =
                    pack2<T>(o[mr][nd][2 * r] * inv, o[mr][nd][2 * r + 1] * inv);
            }
        }
    }
}

// Where head h's key and value heads start, relative to its query head, and
// the qkv row's width: multi-head (+HD, +2HD, 3HD), or with GQA grouped-query
// heads of hd values (`kv_heads` key heads after the `heads` query heads,
// then as many value heads; query head h reads h / (heads / kv_heads)).
template <int D, bool GQA>
__device__ __forceinline__ void tc_kv_offsets(int h, int heads, int kv_heads, int hd, int& koff, int& voff,
                                              size_t& row_stride) {
    const int HD = heads * (GQA ? hd : D);
    if (GQA) {
        const int kvh = h / (heads / kv_heads);
        koff = HD + (kvh - h) * hd;
        voff = HD + (kv_heads + kvh - h) * hd;
        row_stride = (size_t)(heads + 2 * kv_heads) * hd;
    } else {
        koff = HD;
        voff = 2 * HD;
        row_stride = (size_t)3 * HD;
    }
}

template <typename T, int D, bool BIAS, int KB = TC_KB(D), bool BAND = false, bool GQA = false, int MR = 1>
__device__ __forceinline__ void attention_tc_impl(const T* __restrict__ qkv, const int* __restrict__ mask,
                                                  T* __restrict__ out, int seq, int heads, float scale,
                                                  const T* __restrict__ pbias, int radius, int kv_heads = 0,
                                                  int left = 0, int right = 0, int head_dim = D) {
    const int b = blockIdx.z, h = blockIdx.y;
    const int hd = GQA ? head_dim : D;
    const int HD = heads * hd;
    int koff, voff;
    size_t row_stride;
    tc_kv_offsets<D, GQA>(h, heads, kv_heads, hd, koff, voff, row_stride);
    const T* base = qkv + (size_t)b * seq * row_stride + (size_t)h * hd;
    const T* brow = BIAS ? pbias + (size_t)h * (2 * radius + 1) : nullptr;
    tc_attend<T, D, BIAS, true, KB, BAND, GQA, MR>(base, row_stride, HD, koff, voff, seq, blockIdx.x * TC_QT * MR, seq,
                                               mask + (size_t)b * seq, scale, brow, radius,
                                               out + (size_t)b * seq * HD + (size_t)h * hd, left, right, hd);
}

#define ATTENTION_TC_KERNEL(T, SUF, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                    \
        attention_tc_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale) { pdl_enter();      \
        attention_tc_impl<T, D, false>(qkv, mask, out, seq, heads, scale, nullptr, 0);                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                    \
        attention_tc_bias_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale,   \
                                       const T* pbias, int radius) { pdl_enter();                                              \
        attention_tc_impl<T, D, true>(qkv, mask, out, seq, heads, scale, pbias, radius);                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                    \
        attention_tc_win_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale,    \
                                      int window) {                                                               \
        pdl_enter();                                                                                              \
        attention_tc_impl<T, D, false, TC_KB(D), true>(qkv, mask, out, seq, heads, scale, nullptr, 0, heads,      \
                                                       window, window);                                           \
    }

// attention_tc_band_<t>_d<D>: grouped-query heads of head_dim values (a
// multiple of 8, at most D), the key band [i - left, i + right] (see the
// top of the file).
#define ATTENTION_TC_BAND_KERNEL(T, SUF, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                    \
        attention_tc_band_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, int kv_heads,  \
                                       int head_dim, float scale, int left, int right) {                          \
        pdl_enter();                                                                                              \
        attention_tc_impl<T, D, false, TC_KB(D), true, true>(qkv, mask, out, seq, heads, scale, nullptr, 0,       \
                                                             kv_heads, left, right, head_dim);                    \
    }

// attention_tc_s16_<t>_d<D>, attention_tc_bias_s16_<t>_d<D>: the same for
// sequences of at most 16 tokens (the planner's choice; head sizes 32 and
// 64), in 16-key blocks: at (1, 16) the 64-key block computed four times the
// scores, exponentials and P·V a live key needs. Kernels of their own
// rather than a branch in the kernels above: with the branch in them, those
// measured ~1 µs slower a node at (1, 32), and the varlen kernel with the
// same branch at 64 tokens (docs/perf-log.md, 2026-12-04).
#define ATTENTION_TC_S16_KERNEL(T, SUF, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                    \
        attention_tc_s16_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale) {   \
        pdl_enter();                                                                                              \
        attention_tc_impl<T, D, false, 16>(qkv, mask, out, seq, heads, scale, nullptr, 0);                        \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS(D))                                    \
        attention_tc_bias_s16_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads,             \
                                           float scale, const T* pbias, int radius) {                             \
        pdl_enter();                                                                                              \
        attention_tc_impl<T, D, true, 16>(qkv, mask, out, seq, heads, scale, pbias, radius);                      \
    }

// attention_tc_q128_<t>_d<D> (head sizes 32 and 64): two 16-row tiles a
// warp, 128 queries a block (tc_attend's MR = 2), for longer sequences.
#define TC_Q128_MIN_BLOCKS(D) ((D) == 32 ? 3 : 2)
#define ATTENTION_TC_Q128_KERNEL(T, SUF, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_Q128_MIN_BLOCKS(D))                               \
        attention_tc_q128_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale) {  \
        pdl_enter();                                                                                              \
        attention_tc_impl<T, D, false, TC_KB(D), false, false, 2>(qkv, mask, out, seq, heads, scale, nullptr, 0); \
    }

ATTENTION_TC_KERNEL(f16_t, f16, 32)
ATTENTION_TC_KERNEL(f16_t, f16, 64)
ATTENTION_TC_KERNEL(f16_t, f16, 128)
ATTENTION_TC_KERNEL(bf16_t, bf16, 32)
ATTENTION_TC_KERNEL(bf16_t, bf16, 64)
ATTENTION_TC_KERNEL(bf16_t, bf16, 128)
ATTENTION_TC_BAND_KERNEL(f16_t, f16, 32)
ATTENTION_TC_BAND_KERNEL(f16_t, f16, 64)
ATTENTION_TC_BAND_KERNEL(f16_t, f16, 128)
ATTENTION_TC_BAND_KERNEL(f16_t, f16, 256)
ATTENTION_TC_BAND_KERNEL(bf16_t, bf16, 32)
ATTENTION_TC_BAND_KERNEL(bf16_t, bf16, 64)
ATTENTION_TC_BAND_KERNEL(bf16_t, bf16, 128)
ATTENTION_TC_BAND_KERNEL(bf16_t, bf16, 256)
ATTENTION_TC_Q128_KERNEL(f16_t, f16, 32)
ATTENTION_TC_Q128_KERNEL(f16_t, f16, 64)
ATTENTION_TC_Q128_KERNEL(bf16_t, bf16, 32)
ATTENTION_TC_Q128_KERNEL(bf16_t, bf16, 64)
ATTENTION_TC_S16_KERNEL(f16_t, f16, 32)
ATTENTION_TC_S16_KERNEL(f16_t, f16, 64)
ATTENTION_TC_S16_KERNEL(bf16_t, bf16, 32)
ATTENTION_TC_S16_KERNEL(bf16_t, bf16, 64)
