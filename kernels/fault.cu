// Fault injection only: writes far past the end of a real allocation, which
// the device reports as CUDA_ERROR_ILLEGAL_ADDRESS (a sticky error: the
// context, and every context of the device in this process, is lost).

extern "C" __global__ void fault_oob_write(float* p, long long offset) {
    p[offset + threadIdx.x] = 1.0f;
}

// Fault injection only: spins until *flag becomes non-zero, which nothing
// ever writes. Everything queued behind it on the stream waits forever, as
// behind a hung GPU; only destroying the context (the worker's exit) ends it.
extern "C" __global__ void fault_spin(volatile int* flag) {
    while (*flag == 0) {
        __nanosleep(1000);
    }
}
