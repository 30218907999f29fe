// y[i] = act(x[i] + bias[i % cols]) with a type conversion: the epilogue for
// activations that cuBLASLt has no fused epilogue for (exact-erf GELU, tanh,
// sigmoid, SiLU), and the casts where the program mixes f32 inputs/outputs
// with f16/bf16 activations. `bias` may be null; `y` may alias `x`.
// Grid-stride loop; the host caps the grid.

template <typename Tin, typename Tout>
__device__ __forceinline__ void bias_act_impl(const Tin* x, const Tin* __restrict__ bias, Tout* y, int n, int cols,
                                              int act) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = to_f32(x[i]);
        if (bias != 0) v += to_f32(bias[i % cols]);
        y[i] = from_f32<Tout>(apply_act(v, act));
    }
}

#define BIAS_ACT_KERNEL(TIN, TOUT, SUF)                                                                 \
    extern "C" __global__ void bias_act_##SUF(const TIN* x, const TIN* bias, TOUT* y, int n, int cols, \
                                              int act) { pdl_enter();                                                \
        bias_act_impl<TIN, TOUT>(x, bias, y, n, cols, act);                                             \
    }

BIAS_ACT_KERNEL(float, float, f32_f32)
BIAS_ACT_KERNEL(f16_t, f16_t, f16_f16)
BIAS_ACT_KERNEL(bf16_t, bf16_t, bf16_bf16)
BIAS_ACT_KERNEL(float, f16_t, f32_f16)
BIAS_ACT_KERNEL(float, bf16_t, f32_bf16)
BIAS_ACT_KERNEL(f16_t, float, f16_f32)
BIAS_ACT_KERNEL(bf16_t, float, bf16_f32)
