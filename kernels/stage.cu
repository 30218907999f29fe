// Zero-copy staging of a small graph's inputs and output: the graph's first
// node reads the input block straight from the batch's pinned host slot
// (mapped into the device's address space) into the static device inputs,
// and its last node writes the output straight into the slot. This replaces
// the copy engine's H2D and D2H copies around the replay, which cost more
// than the data at these sizes (the backend points both nodes at a batch's
// slot before the launch; see backend::cuda::graph::StagedIo). Words of 4
// bytes, coalesced across the warp: every input block and output is a whole
// number of i32/f32.
//
// Where the graph begins with embed_ln_vec (vec.cu) and ends with pool_ln or
// pool_packed_ln (pool.cu, pool_packed.cu), those kernels do this work
// themselves (the embedding copies the block and reads its ids from the
// slot; the pooling writes its rows into it), one dependent node fewer at
// each end; these two kernels stage the other graphs. A block small enough
// travels as stage_in_inl's (or embed_ln_vec_inl's) parameter instead. The
// host knows the output has arrived when no value of it is the sentinel it
// wrote there before the launch (plan::OUTPUT_SENTINEL), so no kernel needs
// a fence or a flag at the end.

extern "C" __global__ void stage_in(const unsigned* __restrict__ host, unsigned* dev, int words) {
    pdl_enter();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) dev[i] = host[i];
}

// The input block from the kernel's own parameter (common.cuh, InlineBlock):
// no read of host memory at all. words <= INLINE_WORDS (host-checked).
extern "C" __global__ void stage_in_inl(const __grid_constant__ InlineBlock in, unsigned* dev, int words) {
    pdl_enter();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) dev[i] = in.w[i];
}

extern "C" __global__ void stage_out(const float* __restrict__ dev, float* host, int n) {
    pdl_enter();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) host[i] = dev[i];
}
