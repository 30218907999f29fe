// replayd kernels: shared prelude.
//
// Compiled at run time by NVRTC (no CUDA headers needed): the Rust side
// concatenates this file and every kernels/*.cu file into one translation unit
// and compiles it for the device's own architecture. Storage types are f32,
// f16 and bf16; all arithmetic is f32.

typedef unsigned short u16;

// Half-precision storage types (bit patterns only; math happens in f32).
struct __align__(2) f16_t { u16 bits; };
struct __align__(2) bf16_t { u16 bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_f32(bf16_t x) {
    return __uint_as_float(((unsigned)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    // Round to nearest even; NaN stays a (quiet) NaN.
    unsigned u = __float_as_uint(x);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (u16)((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (u16)(u >> 16);
    }
    return r;
}

#define NEG_INF_F (__int_as_float(0xff800000))

// Two values as one 32-bit register (lower half = first), rounded to nearest
// even. From sm_80 one cvt converts the pair (cvt's first source goes to the
// upper half); before it, one value at a time.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<f16_t>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned)from_f32<f16_t>(lo).bits | ((unsigned)from_f32<f16_t>(hi).bits << 16);
#endif
}
template <>
__device__ __forceinline__ unsigned pack2<bf16_t>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned)from_f32<bf16_t>(lo).bits | ((unsigned)from_f32<bf16_t>(hi).bits << 16);
#endif
}



// Programmatic dependent launch (sm_90+). The host launches a kernel with
// the programmatic-serialization attribute only when it follows another of
// ours (see plan::Plan::pdl): such a kernel may start while the one before
// it still runs, so before it reads anything that kernel wrote, or writes
// anything it reads, it must pass pdl_wait(), which returns once every
// grid it depends on has completed and its memory is visible. Weights can be
// read before. pdl_trigger() lets the next kernel start (its blocks then
// wait in its own pdl_wait). Both are no-ops for a plain launch.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The prologue of every kernel that does not prefetch weights.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}

// A small graph's input block passed by value, as its first kernel's
// parameter (plan::INLINE_WORDS, set per batch by the host's StagedIo): the
// kernel reads the batch's ids from its constant bank instead of from the
// pinned slot across PCIe, one host round trip (~1.6 µs on an H200, probe in
// scripts/gpu/probe-io-copies.cu) off the start of every replay.
// __grid_constant__, so dynamic indexing reads the parameter space in place
// rather than a local copy.
#define INLINE_WORDS 128
struct InlineBlock {
    unsigned w[INLINE_WORDS];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; every thread gets the total. blockDim.x must be a
// multiple of 32. `sh` holds at least 32 floats; safe to call repeatedly.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading sh
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? sh[lane] : 0.0f;
    return warp_sum(t);
}

// Activation codes (must match `Activation` on the Rust side, see exec.rs).
#define ACT_IDENTITY 0
#define ACT_RELU 1
#define ACT_GELU 2
#define ACT_GELU_TANH 3
#define ACT_TANH 4
#define ACT_SIGMOID 5
#define ACT_SILU 6
#define ACT_LOG1P_RELU 7
#define ACT_LOG1P_LOG1P_RELU 8

// Exact GELU, 0.5 x (1 + erf(x / sqrt 2)), for half-precision storage: erfc
// by the Chebyshev fit of Numerical Recipes' erfcc (relative error 1.2e-7
// everywhere, so also in the negative tail, where 1 + erf = erfc), with one
// reciprocal and one exponential instead of erff's branches and polynomials:
// the element-wise GELU after a large matmul is issue-bound with erff. In f32
// arithmetic the result is within 7e-6 relative (2.4e-7 absolute) of the
// exact GELU on [-12, 12], far below an f16 or bf16 ulp.
__device__ __forceinline__ float gelu_erfc_fast(float x) {
    // z = |x| / sqrt 2; t = 1 / (1 + z / 2); erfc(z) = t 2^(log2(e) (P(t) - z^2)),
    // with log2(e) folded into P's coefficients.
    const float t = __fdividef(1.0f, fmaf(fabsf(x), 0.35355339059327376f, 1.0f));
    float p = fmaf(t, 0.24651730f, -1.18611495f);
    p = fmaf(t, p, 2.14747446f);
    p = fmaf(t, p, -1.63775315f);
    p = fmaf(t, p, 0.40232158f);
    p = fmaf(t, p, -0.26875686f);
    p = fmaf(t, p, 0.13963006f);
    p = fmaf(t, p, 0.53970062f);
    p = fmaf(t, p, 1.44272920f);
    p = fmaf(t, p, -1.82574822f);
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(fmaf(x * -0.72134752044448170f, x, p)));
    const float h = 0.5f * x * t * e;  // x erfc(z) / 2
    return x >= 0.0f ? x - h : h;
}

__device__ __forceinline__ float apply_act(float x, int act) {
    switch (act) {
    case ACT_RELU: return fmaxf(x, 0.0f);
    case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case ACT_GELU_TANH: {
        const float c = 0.79788456080286536f;  // sqrt(2/pi)
        return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
    }
    case ACT_TANH: return tanhf(x);
    case ACT_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case ACT_SILU: return x / (1.0f + expf(-x));
    // SPLADE's activations over masked-LM logits (SpladePooling).
    case ACT_LOG1P_RELU: return log1pf(fmaxf(x, 0.0f));
    case ACT_LOG1P_LOG1P_RELU: return log1pf(log1pf(fmaxf(x, 0.0f)));
    default: return x;
    }
}
