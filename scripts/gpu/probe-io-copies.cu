// What the copies around a small graph replay cost, and what reading and
// writing pinned host memory from the graph's own kernels would save: a
// probe, not part of the product (the product's figures come from
// `replayd backend-check`). Built and run on a GPU machine:
//
//   nvcc -O2 -arch=sm_90 -o probe scripts/gpu/probe-io-copies.cu && ./probe
//
// A chain of `K` dependent one-block kernels stands for the (1, 16) graph's
// 32 nodes; the input block is 256 bytes and the output 1,536 (one 384-float
// embedding), as for one 16-token text. Every variant is timed one batch at
// a time, submit -> event synchronised, median and p99 of 3,000.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "probe-common.cuh"

constexpr int K = 32;
constexpr int IN_BYTES = 256;
constexpr int OUT_FLOATS = 384;

__global__ void step(float* x) {
  if (threadIdx.x == 0) x[0] = x[0] * 0.5f + 1.0f;
}
// Input block host -> device and a step; the device copy is what later
// kernels would read.
__global__ void step_stage_in(const int4* __restrict__ host, int4* dev, int n, float* x) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dev[i] = host[i];
  if (threadIdx.x == 0) x[0] = x[0] * 0.5f + (float)dev[0].x;
}
// A step and the output written straight into pinned host memory.
__global__ void step_stage_out(const float* x, float4* host, int n) {
  float v = x[0];
  for (int i = threadIdx.x; i < n; i += blockDim.x) host[i] = make_float4(v, v, v, v);
}
// The same last step, then a done flag per block (the launch's number) the
// host polls instead of synchronising an event.
__global__ void step_stage_out_flag(const float* x, float4* host, int n, volatile unsigned* flag, unsigned seq) {
  float v = x[0];
  for (int i = threadIdx.x; i < n; i += blockDim.x) host[i] = make_float4(v, v, v, v);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    *flag = seq;
  }
}
// The input block passed by value as the kernel's parameter (set per launch
// with cudaGraphExecKernelNodeSetParams): no read of host memory.
struct InBlock {
  int4 v[IN_BYTES / 16];
};
__global__ void step_params_in(InBlock in, int4* dev, int n, float* x) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dev[i] = in.v[i];
  if (threadIdx.x == 0) x[0] = x[0] * 0.5f + (float)in.v[0].x;
}
__global__ void stage_in(const int4* __restrict__ host, int4* dev, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dev[i] = host[i];
}
__global__ void stage_out(const float4* dev, float4* host, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) host[i] = dev[i];
}

struct Stat {
  double p50, p99;
};

template <class F>
Stat timeit(F&& f, cudaEvent_t ev, cudaStream_t s) {
  std::vector<double> v;
  for (int i = 0; i < 3300; i++) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    cudaEventRecord(ev, s);
    cudaEventSynchronize(ev);
    auto t1 = std::chrono::steady_clock::now();
    if (i >= 300) v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[v.size() * 99 / 100]};
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  float *x, *dout;
  int4* din;
  CK(cudaMalloc(&x, 4096));
  CK(cudaMalloc(&din, IN_BYTES));
  CK(cudaMalloc(&dout, OUT_FLOATS * 4));
  void *hin, *hout;
  CK(cudaHostAlloc(&hin, IN_BYTES, cudaHostAllocDefault));
  CK(cudaHostAlloc(&hout, OUT_FLOATS * 4, cudaHostAllocDefault));
  CK(cudaMemset(x, 0, 4096));
  const int nin = IN_BYTES / 16, nout = OUT_FLOATS / 4;

  cudaGraph_t g;
  auto capture = [&](auto&& body) {
    cudaGraphExec_t e;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    body();
    cudaStreamEndCapture(s, &g);
    cudaGraphInstantiate(&e, g, 0);
    cudaGraphUpload(e, s);
    return e;
  };
  auto chain = [&](int n) {
    for (int i = 0; i < n; i++) step<<<1, 32, 0, s>>>(x);
  };
  cudaGraphExec_t plain = capture([&] { chain(K); });
  cudaGraphExec_t with_memcpy = capture([&] {
    cudaMemcpyAsync(din, hin, IN_BYTES, cudaMemcpyHostToDevice, s);
    chain(K);
    cudaMemcpyAsync(hout, dout, OUT_FLOATS * 4, cudaMemcpyDeviceToHost, s);
  });
  cudaGraphExec_t stage_nodes_exec = capture([&] {
    stage_in<<<1, 64, 0, s>>>((const int4*)hin, din, nin);
    chain(K);
    stage_out<<<1, 128, 0, s>>>((const float4*)dout, (float4*)hout, nout);
  });
  // The stage kernels' nodes, to point them at another slot per launch.
  cudaGraphNode_t nin_node = nullptr, nout_node = nullptr;
  {
    size_t n = 0;
    cudaGraphGetNodes(g, nullptr, &n);
    std::vector<cudaGraphNode_t> nodes(n);
    cudaGraphGetNodes(g, nodes.data(), &n);
    for (auto nd : nodes) {
      cudaKernelNodeParams p;
      if (cudaGraphKernelNodeGetParams(nd, &p) != cudaSuccess) continue;
      if (p.func == (void*)stage_in) nin_node = nd;
      if (p.func == (void*)stage_out) nout_node = nd;
    }
  }
  void *hin2, *hout2;
  CK(cudaHostAlloc(&hin2, IN_BYTES, cudaHostAllocDefault));
  CK(cudaHostAlloc(&hout2, OUT_FLOATS * 4, cudaHostAllocDefault));
  int flip = 0;
  auto repoint = [&] {
    flip ^= 1;
    const int4* src = (const int4*)(flip ? hin2 : hin);
    float4* dst = (float4*)(flip ? hout2 : hout);
    void* a_in[] = {(void*)&src, (void*)&din, (void*)&nin};
    void* a_out[] = {(void*)&dout, (void*)&dst, (void*)&nout};
    cudaKernelNodeParams p{};
    p.func = (void*)stage_in; p.gridDim = dim3(1); p.blockDim = dim3(64); p.kernelParams = a_in;
    cudaGraphExecKernelNodeSetParams(stage_nodes_exec, nin_node, &p);
    p.func = (void*)stage_out; p.blockDim = dim3(128); p.kernelParams = a_out;
    cudaGraphExecKernelNodeSetParams(stage_nodes_exec, nout_node, &p);
  };
  cudaGraphExec_t fused = capture([&] {
    step_stage_in<<<1, 64, 0, s>>>((const int4*)hin, din, nin, x);
    chain(K - 2);
    step_stage_out<<<1, 128, 0, s>>>(x, (float4*)hout, nout);
  });
  // The fused graph with a done flag, and with the input as parameters.
  unsigned* hflag;
  CK(cudaHostAlloc((void**)&hflag, 64, cudaHostAllocMapped));
  unsigned* dflag;
  CK(cudaHostGetDevicePointer((void**)&dflag, hflag, 0));
  *hflag = 0;
  unsigned seq = 0;
  cudaGraph_t gflag;
  cudaGraphExec_t fused_flag;
  cudaGraphNode_t flag_node = nullptr;
  {
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    step_stage_in<<<1, 64, 0, s>>>((const int4*)hin, din, nin, x);
    chain(K - 2);
    step_stage_out_flag<<<1, 128, 0, s>>>(x, (float4*)hout, nout, dflag, 0u);
    cudaStreamEndCapture(s, &gflag);
    cudaGraphInstantiate(&fused_flag, gflag, 0);
    cudaGraphUpload(fused_flag, s);
    size_t n = 0;
    cudaGraphGetNodes(gflag, nullptr, &n);
    std::vector<cudaGraphNode_t> nodes(n);
    cudaGraphGetNodes(gflag, nodes.data(), &n);
    for (auto nd : nodes) {
      cudaKernelNodeParams p;
      if (cudaGraphKernelNodeGetParams(nd, &p) != cudaSuccess) continue;
      if (p.func == (void*)step_stage_out_flag) flag_node = nd;
    }
  }
  // Sets the flag kernel's launch number; returns it.
  auto set_seq = [&] {
    seq++;
    void* a[] = {(void*)&x, (void*)&hout, (void*)&nout, (void*)&dflag, (void*)&seq};
    cudaKernelNodeParams p{};
    p.func = (void*)step_stage_out_flag; p.gridDim = dim3(1); p.blockDim = dim3(128); p.kernelParams = a;
    cudaGraphExecKernelNodeSetParams(fused_flag, flag_node, &p);
    return seq;
  };
  InBlock blk{};
  cudaGraph_t gpar;
  cudaGraphExec_t params_in;
  cudaGraphNode_t par_node = nullptr;
  {
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    step_params_in<<<1, 64, 0, s>>>(blk, din, nin, x);
    chain(K - 2);
    step_stage_out<<<1, 128, 0, s>>>(x, (float4*)hout, nout);
    cudaStreamEndCapture(s, &gpar);
    cudaGraphInstantiate(&params_in, gpar, 0);
    cudaGraphUpload(params_in, s);
    size_t n = 0;
    cudaGraphGetNodes(gpar, nullptr, &n);
    std::vector<cudaGraphNode_t> nodes(n);
    cudaGraphGetNodes(gpar, nodes.data(), &n);
    for (auto nd : nodes) {
      cudaKernelNodeParams p;
      if (cudaGraphKernelNodeGetParams(nd, &p) != cudaSuccess) continue;
      if (p.func == (void*)step_params_in) par_node = nd;
    }
  }
  auto set_block = [&] {
    blk.v[0].x++;
    void* a[] = {(void*)&blk, (void*)&din, (void*)&nin, (void*)&x};
    cudaKernelNodeParams p{};
    p.func = (void*)step_params_in; p.gridDim = dim3(1); p.blockDim = dim3(64); p.kernelParams = a;
    cudaGraphExecKernelNodeSetParams(params_in, par_node, &p);
  };
  // Launch -> flag seen (the event synchronised after the clock stops, so
  // no launch overlaps the next).
  auto time_flag = [&](bool repoint_each) {
    std::vector<double> v;
    unsigned want = set_seq();
    for (int i = 0; i < 3300; i++) {
      auto t0 = std::chrono::steady_clock::now();
      if (repoint_each) want = set_seq();
      cudaGraphLaunch(fused_flag, s);
      while (*(volatile unsigned*)hflag != want) {
      }
      auto t1 = std::chrono::steady_clock::now();
      cudaEventRecord(ev, s);
      cudaEventSynchronize(ev);
      if (!repoint_each) {
        want = set_seq();
      }
      if (i >= 300) v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(v.begin(), v.end());
    return Stat{v[v.size() / 2], v[v.size() * 99 / 100]};
  };
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());

  printf("| variant | p50 us | p99 us |\n|---|---|---|\n");
  auto row = [&](const char* name, Stat t) { printf("| %s | %.1f | %.1f |\n", name, t.p50, t.p99); };
  for (int round = 0; round < 2; round++) {
    row("graph of 32 kernels alone", timeit([&] { cudaGraphLaunch(plain, s); }, ev, s));
    row("H2D 256 B + graph + D2H 1.5 KB (memcpyAsync, as today)", timeit([&] {
          cudaMemcpyAsync(din, hin, IN_BYTES, cudaMemcpyHostToDevice, s);
          cudaGraphLaunch(plain, s);
          cudaMemcpyAsync(hout, dout, OUT_FLOATS * 4, cudaMemcpyDeviceToHost, s);
        }, ev, s));
    row("H2D only + graph", timeit([&] {
          cudaMemcpyAsync(din, hin, IN_BYTES, cudaMemcpyHostToDevice, s);
          cudaGraphLaunch(plain, s);
        }, ev, s));
    row("graph + D2H only", timeit([&] {
          cudaGraphLaunch(plain, s);
          cudaMemcpyAsync(hout, dout, OUT_FLOATS * 4, cudaMemcpyDeviceToHost, s);
        }, ev, s));
    row("memcpy nodes inside the graph", timeit([&] { cudaGraphLaunch(with_memcpy, s); }, ev, s));
    row("stage kernels (mapped host) as 2 extra nodes", timeit([&] { cudaGraphLaunch(stage_nodes_exec, s); }, ev, s));
    row("stage kernels, repointed per launch (2 x cudaGraphExecKernelNodeSetParams)", timeit([&] {
          repoint();
          cudaGraphLaunch(stage_nodes_exec, s);
        }, ev, s));
    {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 1000; i++) repoint();
      auto t1 = std::chrono::steady_clock::now();
      printf("| (CPU cost of one repoint: %.2f us) | | |\n",
             std::chrono::duration<double, std::micro>(t1 - t0).count() / 1000);
    }
    row("first/last kernel read/write mapped host (32 nodes)", timeit([&] { cudaGraphLaunch(fused, s); }, ev, s));
    row("the same + done flag, event synchronised", timeit([&] { cudaGraphLaunch(fused_flag, s); }, ev, s));
    row("the same, host polls the done flag (number set before the clock)", time_flag(false));
    row("the same, host polls the done flag (number set per launch, in the clock)", time_flag(true));
    row("input as the first kernel's parameters (set per launch), mapped-host output", timeit([&] {
          set_block();
          cudaGraphLaunch(params_in, s);
        }, ev, s));
    row("input read from mapped host, mapped-host output (same graph shape)", timeit([&] { cudaGraphLaunch(fused, s); }, ev, s));
  }
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  return 0;
}
