// Fault injection only: writes far past the end of a real allocation, which
// the device reports as CUDA_ERROR_ILLEGAL_ADDRESS (a sticky error: the
// context, and every context of the device in this process, is lost).

extern "C" __global__ void fault_oob_write(float* p, long long offset) {
    p[offset + threadIdx.x] = 1.0f;
}
