// Shared by the standalone probes (scripts/gpu/probe-*.cu, built with nvcc on a
// GPU machine): a CUDA runtime call that fails prints where and returns 1
// from main.
#pragma once
#include <cstdio>

#include <cuda_runtime.h>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      return 1;                                                                \
    }                                                                          \
  } while (0)
