#include "transport/gpu_info.h"

namespace wb {

GpuInfo ProbeGpus() {
  GpuInfo info;
  info.unavailable_reason = "built without CUDA (CUDA_HOME had no toolkit at build time)";
  return info;
}

}  // namespace wb
