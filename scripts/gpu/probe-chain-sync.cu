// What a node boundary of a small graph costs, and what chaining the
// kernels by counters instead of by grid completion would save: a probe,
// not part of the product (the product's figures come from
// `replayd backend-check`). Built and run on a GPU machine:
//
//   nvcc -O2 -arch=sm_90 -o probe-chain scripts/gpu/probe-chain-sync.cu && ./probe-chain
//
// A graph of n dependent kernels with the (1, 16) MiniLM graph's grids (the
// embedding's 4 blocks; per layer QKV 72, attention 12, O 24, FFN1 96,
// FFN2 24; the pooling's 1), the matmul nodes held to one block an SM by
// their shared memory as gemm_small is by its registers. Each block reads
// one float4 a thread of the node before's output and writes its own. Three
// ways to order them:
//
//   stream  plain launches: a node starts when the one before has completed
//   pdl     programmatic dependent launch, as replayd does: each kernel
//           starts early and waits in griddepcontrol.wait for the grid
//           before to complete and its memory to be visible
//   flags   programmatic launch without griddepcontrol.wait: each block
//           spins until every block of the node before has counted itself
//           done (release/acquire on a counter per node); the last node
//           (one block) resets the counters for the next replay
//
// Each graph is timed one replay at a time, launch -> event synchronised,
// median and p99 of 3,000; n = 1 and n = 32 give the cost a node adds.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "probe-common.cuh"

constexpr int K = 32;
constexpr int THREADS = 256;
constexpr int ROW_F4 = 16 * 384 / 4;  // a node's output: 16 rows of 384 floats
constexpr int BIG_SMEM = 120 * 1024;  // one block an SM

enum Mode { STREAM = 0, PDL = 1, FLAGS = 2 };

int blocks_of(int i, int n) {
  if (i == 0) return 4;
  if (i == n - 1) return 1;
  const int layer[5] = {72, 12, 24, 96, 24};
  return layer[(i - 1) % 5];
}
bool is_matmul(int i, int n) { return i > 0 && i < n - 1 && (i - 1) % 5 != 1; }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void node(const float4* in, float4* out, int mode, unsigned* counters, int i, int prev_blocks, int last) {
  extern __shared__ float4 pad[];
  if (mode == PDL) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  } else if (mode == FLAGS) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (i > 0) {
      if (threadIdx.x == 0)
        while (ld_acquire(&counters[i - 1]) < (unsigned)prev_blocks) {
        }
      __syncthreads();
    }
  }
  const int t = (blockIdx.x * THREADS + threadIdx.x) % ROW_F4;
  float4 v = i > 0 ? in[t] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
  v.x = v.x + 1.0f;  // the last node's value is n + 1
  if (threadIdx.x == 0) pad[0] = v;  // keeps the shared memory
  out[t] = v;
  if (mode == FLAGS) {
    __syncthreads();
    if (threadIdx.x == 0) {
      if (last) {
        // Every earlier node has counted all its blocks (this one waited
        // for the one before, which waited for its own before, ...).
        for (int k = 0; k < i; k++) counters[k] = 0u;
      } else {
        __threadfence();
        atomicAdd(&counters[i], 1u);
      }
    }
  }
}

struct Stat {
  double p50, p99;
};

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  float4* buf;
  CK(cudaMalloc(&buf, (size_t)(K + 1) * ROW_F4 * sizeof(float4)));
  unsigned* counters;
  CK(cudaMalloc(&counters, K * sizeof(unsigned)));
  CK(cudaMemset(counters, 0, K * sizeof(unsigned)));
  CK(cudaFuncSetAttribute(node, cudaFuncAttributeMaxDynamicSharedMemorySize, BIG_SMEM));

  auto build = [&](int mode, int n, cudaGraphExec_t* exec) -> cudaError_t {
    cudaGraph_t g;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < n; i++) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(blocks_of(i, n));
      cfg.blockDim = dim3(THREADS);
      cfg.dynamicSmemBytes = is_matmul(i, n) ? BIG_SMEM : 16;
      cfg.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      // The first node is a plain launch, as in replayd's plans.
      if (mode != STREAM && i > 0) {
        cfg.attrs = attr;
        cfg.numAttrs = 1;
      }
      const float4* in = buf + (size_t)i * ROW_F4;
      float4* out = buf + (size_t)(i + 1) * ROW_F4;
      const int prev = i > 0 ? blocks_of(i - 1, n) : 0;
      const int last = i == n - 1 && n > 1;
      cudaError_t e = cudaLaunchKernelEx(&cfg, node, in, out, mode, counters, i, prev, last);
      if (e != cudaSuccess) {
        cudaStreamEndCapture(s, &g);
        return e;
      }
    }
    cudaError_t e = cudaStreamEndCapture(s, &g);
    if (e != cudaSuccess) return e;
    e = cudaGraphInstantiate(exec, g, 0);
    if (e != cudaSuccess) return e;
    return cudaGraphUpload(*exec, s);
  };
  auto timeit = [&](cudaGraphExec_t e) {
    std::vector<double> v;
    for (int i = 0; i < 3300; i++) {
      auto t0 = std::chrono::steady_clock::now();
      cudaGraphLaunch(e, s);
      cudaEventRecord(ev, s);
      cudaEventSynchronize(ev);
      auto t1 = std::chrono::steady_clock::now();
      if (i >= 300) v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(v.begin(), v.end());
    return Stat{v[v.size() / 2], v[v.size() * 99 / 100]};
  };

  const char* names[3] = {"stream", "pdl", "flags"};
  printf("| order | nodes | p50 µs | p99 µs | µs a node (32 vs 1) |\n|---|---|---|---|---|\n");
  for (int round = 0; round < 2; round++) {
    for (int mode = 0; mode < 3; mode++) {
      cudaGraphExec_t one, many;
      CK(build(mode, 1, &one));
      CK(build(mode, K, &many));
      const Stat a = timeit(one);
      // The one-node flags graph counts without resetting.
      CK(cudaStreamSynchronize(s));
      CK(cudaMemset(counters, 0, K * sizeof(unsigned)));
      const Stat b = timeit(many);
      CK(cudaGetLastError());
      CK(cudaStreamSynchronize(s));
      // 33 when every node ran after its predecessor's write of this
      // replay (or of the last: the values repeat, so this is a sanity
      // check, not a race detector).
      float4 last;
      CK(cudaMemcpy(&last, buf + (size_t)K * ROW_F4, sizeof(float4), cudaMemcpyDeviceToHost));
      printf("| %s | 1 | %.1f | %.1f | |\n", names[mode], a.p50, a.p99);
      printf("| %s | %d | %.1f | %.1f | %.2f (last value %.6f) |\n", names[mode], K, b.p50, b.p99,
             (b.p50 - a.p50) / (K - 1), last.x);
      cudaGraphExecDestroy(one);
      cudaGraphExecDestroy(many);
    }
  }
  return 0;
}
