// The conformance suite against cuda_ipc on the CPU emulation of CUDA (tools/fake_cuda): this
// process and real peer processes (transport_peer_emulated, the same peer main linked with the
// fake) exchange fake-device buffers through emulated CUDA IPC (shm segments). It checks our
// logic (handles, allocation offsets, stream/event ordering, bounds) on every CI run; the real
// GPU run is cuda_ipc_conformance_test (tests/gpu/run_gpu_checks.sh).
#include "tools/fake_cuda/fake_cuda.h"
#include "transport/conformance.h"
#include "transport/test_buffer.h"

namespace wb::transport {
namespace {

// The suite skips GPU kinds without a visible device; here it must run: fail loudly instead.
TEST(CudaIpcEmulatedTest, RunsOnTheFakeRuntime) {
  ASSERT_GE(VisibleCudaDevices(), 1) << "the fake CUDA runtime is not linked in (or WB_FAKE_CUDA_DEVICES=0)";
  auto b = MakeTestBuffer(MemoryKind::kCuda, 4096, 0, "probe");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(fake_cuda::IsDevicePointer((*b)->spec().base)) << "device memory does not come from the fake";
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(CudaIpcEmulated, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"cuda_ipc", MemoryKind::kCuda, /*min_gpus=*/1,
                                                            /*large_op_bytes=*/int64_t{64} << 20,
                                                            /*peer_device=*/0,
                                                            /*peer_binary=*/"transport/transport_peer_emulated"}),
                         ConformanceName);

}  // namespace wb::transport
