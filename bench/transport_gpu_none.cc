// Built without CUDA: no GPU figures.
#include "bench/transport_gpu.h"

namespace wb::transport {

nlohmann::json MeasureGpu(const char*, int64_t, int) {
  return {{"gpu_skipped", "built without CUDA"}};
}
int RunGpuChild(int64_t) { return 2; }

}  // namespace wb::transport
