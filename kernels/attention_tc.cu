// Multi-head self-attention on tensor cores (f16/bf16 storage, f32 accumulation),
// same semantics as attention.cu (padding mask, max-subtracted softmax, zeros
// for queries whose keys are all masked), for head sizes of exactly 32, 64, 128.
//
// One block of 4 warps per (64 queries, head, batch); each warp owns 16 query
// rows. Keys and values stream through shared memory TC_KB at a time (V stored
// transposed); scores S = Q.K^T and the output O += P.V use
// mma.sync.m16n8k16 (row.col), with the online softmax of FlashAttention-2:
// a running row max and row sum, O rescaled when the max grows, the score
// fragments reused in registers as the A operand of P.V. Scores are scaled in
// f32 after the product.
//
// attention_tc_bias_<t>_d<D> (MPNet): plus the relative position bias of
// attention.cu's rel_bias, added to the scaled scores before the mask.

#define TC_WARPS 4
#define TC_THREADS (32 * TC_WARPS)
#define TC_QT (16 * TC_WARPS)
#define TC_KB 64
#define TC_PAD 8

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

// Two values as one 32-bit register (lower half = first).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)from_f32<T>(lo).bits | ((unsigned)from_f32<T>(hi).bits << 16);
}

template <typename T, int D, bool BIAS>
__device__ __forceinline__ void attention_tc_impl(const T* __restrict__ qkv, const int* __restrict__ mask,
                                                  T* __restrict__ out, int seq, int heads, float scale,
                                                  const T* __restrict__ pbias, int radius) {
    constexpr int KS = D + TC_PAD;      // sK row stride (halves)
    constexpr int VS = TC_KB + TC_PAD;  // sVt row stride (halves)
    constexpr int ND = D / 8;           // output n-tiles
    constexpr int KD = D / 16;          // k-steps over the head
    constexpr int NK = TC_KB / 8;       // score n-tiles per key block
    __shared__ __align__(16) u16 sK[TC_KB * KS];
    __shared__ __align__(16) u16 sVt[D * VS];
    __shared__ int sM[TC_KB];

    const int b = blockIdx.z, h = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int HD = heads * D;
    const size_t row_stride = (size_t)3 * HD;
    const T* base = qkv + (size_t)b * seq * row_stride + (size_t)h * D;
    const int* mrow = mask + (size_t)b * seq;
    const int q0 = blockIdx.x * TC_QT + warp * 16;
    const bool active = q0 < seq;
    const T* brow = BIAS ? pbias + (size_t)h * (2 * radius + 1) : nullptr;

    // Q fragments (A operand, row-major 16 x D), straight from global memory.
    unsigned qa[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = q0 + g + ((r & 1) ? 8 : 0);
            const int col = kk * 16 + t4 * 2 + ((r & 2) ? 8 : 0);
            qa[kk][r] = (row < seq) ? *reinterpret_cast<const unsigned*>(base + (size_t)row * row_stride + col) : 0u;
        }

    float o[ND][4];
#pragma unroll
    for (int i = 0; i < ND; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[i][e] = 0.0f;
    float m_run[2] = {NEG_INF_F, NEG_INF_F};
    float l_run[2] = {0.0f, 0.0f};

    for (int kb0 = 0; kb0 < seq; kb0 += TC_KB) {
        __syncthreads();  // previous block's K/V consumed
        // K rows and V (transposed) into shared memory, 16 bytes at a time.
        for (int i = tid; i < TC_KB * (D / 8); i += TC_THREADS) {
            const int j = i / (D / 8), d = (i % (D / 8)) * 8;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
            if (kb0 + j < seq) {
                const T* r = base + (size_t)(kb0 + j) * row_stride;
                kv = *reinterpret_cast<const uint4*>(r + HD + d);
                vv = *reinterpret_cast<const uint4*>(r + 2 * HD + d);
            }
            *reinterpret_cast<uint4*>(&sK[j * KS + d]) = kv;
            const unsigned vw[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                sVt[(d + 2 * e) * VS + j] = (u16)(vw[e] & 0xffffu);
                sVt[(d + 2 * e + 1) * VS + j] = (u16)(vw[e] >> 16);
            }
        }
        for (int j = tid; j < TC_KB; j += TC_THREADS) sM[j] = (kb0 + j < seq) && (mrow[kb0 + j] != 0);
        __syncthreads();
        if (!active) continue;

        // S = Q K^T for this key block.
        float sc[NK][4];
#pragma unroll
        for (int nt = 0; nt < NK; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) sc[nt][e] = 0.0f;
            const u16* kr = &sK[(nt * 8 + g) * KS + t4 * 2];
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                const unsigned b0 = *reinterpret_cast<const unsigned*>(kr + kk * 16);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(kr + kk * 16 + 8);
                mma16816(sc[nt], qa[kk], b0, b1, T());
            }
        }
        // Scale, mask, and the online softmax (rows g and g + 8 of the warp's 16).
        float mx[2] = {NEG_INF_F, NEG_INF_F};
#pragma unroll
        for (int nt = 0; nt < NK; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = nt * 8 + t4 * 2 + (e & 1);
                float s = sc[nt][e] * scale;
                if (BIAS) s += rel_bias(brow, radius, q0 + g + 8 * (e >> 1), kb0 + key);
                s = sM[key] ? s : NEG_INF_F;
                sc[nt][e] = s;
                mx[e >> 1] = fmaxf(mx[e >> 1], s);
            }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m_run[r], mx[r]);
            alpha[r] = (m_new == NEG_INF_F) ? 1.0f : expf(m_run[r] - m_new);
            m_run[r] = m_new;
        }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < NK; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                const float p = (m_run[r] == NEG_INF_F) ? 0.0f : expf(sc[nt][e] - m_run[r]);
                sc[nt][e] = p;
                rs[r] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; r++) l_run[r] = l_run[r] * alpha[r] + rs[r];
#pragma unroll
        for (int i = 0; i < ND; i++) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }
        // O += P V: the score fragments of key tiles 2ks and 2ks+1 form the A operand.
#pragma unroll
        for (int ks = 0; ks < TC_KB / 16; ks++) {
            unsigned pa[4];
            pa[0] = pack2<T>(sc[2 * ks][0], sc[2 * ks][1]);
            pa[1] = pack2<T>(sc[2 * ks][2], sc[2 * ks][3]);
            pa[2] = pack2<T>(sc[2 * ks + 1][0], sc[2 * ks + 1][1]);
            pa[3] = pack2<T>(sc[2 * ks + 1][2], sc[2 * ks + 1][3]);
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                const u16* vr = &sVt[(nd * 8 + g) * VS + ks * 16 + t4 * 2];
                const unsigned b0 = *reinterpret_cast<const unsigned*>(vr);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(vr + 8);
                mma16816(o[nd], pa, b0, b1, T());
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = q0 + g + 8 * r;
        if (row >= seq) continue;
        const float inv = l_run[r] > 0.0f ? 1.0f / l_run[r] : 0.0f;
        T* orow = out + ((size_t)b * seq + row) * HD + (size_t)h * D;
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
            *reinterpret_cast<unsigned*>(orow + nd * 8 + t4 * 2) = pack2<T>(o[nd][2 * r] * inv, o[nd][2 * r + 1] * inv);
        }
    }
}

#define ATTENTION_TC_KERNEL(T, SUF, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                                      \
        attention_tc_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale) { pdl_enter();      \
        attention_tc_impl<T, D, false>(qkv, mask, out, seq, heads, scale, nullptr, 0);                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                                      \
        attention_tc_bias_##SUF##_d##D(const T* qkv, const int* mask, T* out, int seq, int heads, float scale,   \
                                       const T* pbias, int radius) { pdl_enter();                                              \
        attention_tc_impl<T, D, true>(qkv, mask, out, seq, heads, scale, pbias, radius);                          \
    }

ATTENTION_TC_KERNEL(f16_t, f16, 32)
ATTENTION_TC_KERNEL(f16_t, f16, 64)
ATTENTION_TC_KERNEL(f16_t, f16, 128)
ATTENTION_TC_KERNEL(bf16_t, bf16, 32)
ATTENTION_TC_KERNEL(bf16_t, bf16, 64)
ATTENTION_TC_KERNEL(bf16_t, bf16, 128)
