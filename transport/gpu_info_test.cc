#include "transport/gpu_info.h"

#include "gtest/gtest.h"

namespace wb {
namespace {

TEST(GpuInfo, ProbeIsConsistent) {
  GpuInfo info = ProbeGpus();
  if (info.device_count == 0) {
    EXPECT_FALSE(info.unavailable_reason.empty());
  }
  if (info.built_with_cuda) {
    EXPECT_FALSE(info.cuda_runtime.empty());
  } else {
    EXPECT_EQ(info.device_count, 0);
  }
  if (info.built_with_nccl) {
    EXPECT_FALSE(info.nccl_version.empty());
  }
}

}  // namespace
}  // namespace wb
