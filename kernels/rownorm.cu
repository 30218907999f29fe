// L2 normalisation of rows in place: x[r] /= max(||x[r]||, 1e-12), one block
// per row of `width` values (a sentence-transformers Normalize module after a
// Dense). Sums in f32.

template <typename T>
__device__ __forceinline__ void l2norm_rows_impl(T* x, int width) {
    __shared__ float sh[32];
    T* row = x + (size_t)blockIdx.x * width;
    float s = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        const float v = to_f32(row[c]);
        s += v * v;
    }
    const float inv = 1.0f / fmaxf(sqrtf(block_sum(s, sh)), 1e-12f);
    for (int c = threadIdx.x; c < width; c += blockDim.x) row[c] = from_f32<T>(to_f32(row[c]) * inv);
}

#define ROWNORM_KERNEL(T, SUF) \
    extern "C" __global__ void l2norm_rows_##SUF(T* x, int width) { pdl_enter(); l2norm_rows_impl<T>(x, width); }

ROWNORM_KERNEL(float, f32)
ROWNORM_KERNEL(f16_t, f16)
ROWNORM_KERNEL(bf16_t, bf16)
