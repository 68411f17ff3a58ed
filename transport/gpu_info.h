#pragma once
// What GPU support this binary was built with and what the machine has right now.
// Built against CUDA/NCCL when @local_cuda found them (gpu_info_cuda.cc), else gpu_info_none.cc.
// Never fails hard: a machine without a GPU/driver reports zero devices and the reason.

#include <string>

namespace wb {

struct GpuInfo {
  bool built_with_cuda = false;
  bool built_with_nccl = false;
  int device_count = 0;          // 0 when no driver/GPU is visible
  std::string cuda_runtime;      // e.g. "13.0", empty without CUDA
  std::string nccl_version;      // e.g. "2.28.9", empty without NCCL
  std::string unavailable_reason;  // why device_count is 0, if it is
};

GpuInfo ProbeGpus();

}  // namespace wb
