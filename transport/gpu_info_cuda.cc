#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/strings/str_cat.h"
#include "transport/gpu_info.h"

namespace wb {

GpuInfo ProbeGpus() {
  GpuInfo info;
  info.built_with_cuda = true;
  info.built_with_nccl = true;
  int rt = 0;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) {
    info.cuda_runtime = absl::StrCat(rt / 1000, ".", (rt % 1000) / 10);
  }
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    info.nccl_version = absl::StrCat(nccl / 10000, ".", (nccl % 10000) / 100, ".", nccl % 100);
  }
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    info.unavailable_reason = cudaGetErrorString(err);
    (void)cudaGetLastError();  // clear the sticky error so later calls start clean
    n = 0;
  } else if (n == 0) {
    info.unavailable_reason = "no CUDA device visible";
  }
  info.device_count = n;
  return info;
}

}  // namespace wb
