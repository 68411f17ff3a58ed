// Linked into nccl_smoke_emulated_test next to nccl_smoke_test.cc: that test skips without a
// visible GPU, but on the fake CUDA runtime it must run, so a missing fake fails here instead.
#include "gtest/gtest.h"
#include "tests/fake_cuda/fake_cuda.h"
#include "transport/testing/test_buffer.h"

namespace wb::transport {
namespace {

TEST(NcclSmokeEmulatedGuard, RunsOnTheFakeRuntime) {
  ASSERT_GE(VisibleCudaDevices(), 1) << "the fake CUDA runtime is not linked in (or WB_FAKE_CUDA_DEVICES=0)";
  auto b = MakeTestBuffer(MemoryKind::kCuda, 4096, 0, "probe");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(fake_cuda::IsDevicePointer((*b)->spec().base)) << "device memory does not come from the fake";
}

}  // namespace
}  // namespace wb::transport
