#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "bench/gpu_limit.h"

namespace wb::bench {

double DeviceToDeviceGBps(int64_t bytes, int reps, std::string* why) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    *why = "no CUDA device visible";
    return 0;
  }
  void *a = nullptr, *b = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  double result = 0;
  if (cudaSetDevice(0) == cudaSuccess && cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
      cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess &&
      cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice) == cudaSuccess) {
    std::vector<double> gbps;
    for (int i = 0; i < reps; ++i) {
      float ms = 0;
      if (cudaEventRecord(e0) != cudaSuccess || cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice) != cudaSuccess ||
          cudaEventRecord(e1) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
          cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess || ms <= 0) {
        break;
      }
      gbps.push_back(static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
    }
    if (!gbps.empty()) {
      std::sort(gbps.begin(), gbps.end());
      result = gbps[gbps.size() / 2];
    }
  }
  if (result == 0) *why = cudaGetErrorString(cudaGetLastError());
  (void)cudaGetLastError();
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (a) cudaFree(a);
  if (b) cudaFree(b);
  return result;
}

}  // namespace wb::bench
