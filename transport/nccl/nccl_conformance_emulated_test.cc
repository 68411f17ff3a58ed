// The conformance suite against nccl on the CPU emulations of CUDA and NCCL (tests/fake_cuda,
// tests/fake_nccl): this process (rank of fake device 0) and real peer processes
// (transport_peer_nccl_emulated, the same peer main linked with both fakes, on fake device 1)
// build 2-rank communicators over Unix sockets and move fake-device bytes with grouped
// ncclSend/ncclRecv on fake streams. It checks the transport's logic (unique-id exchange, init
// deadline, manifest exchange, chunking/staging, group/stream ordering, abort and peer death) on
// every CI run. It cannot check NCCL's kernels, GPU memory ordering or performance; the real
// 2-GPU run is nccl_conformance_test (needs two GPUs: NCCL refuses two ranks on one).
#include "tests/fake_cuda/fake_cuda.h"
#include "transport/testing/conformance.h"
#include "transport/testing/test_buffer.h"

namespace wb::transport {
namespace {

// The suite skips GPU kinds with fewer visible devices than needed; here it must run: fail loudly.
TEST(NcclEmulatedTest, RunsOnTheFakeRuntimeWithTwoDevices) {
  ASSERT_GE(VisibleCudaDevices(), 2) << "the fake CUDA runtime is not linked in, or WB_FAKE_CUDA_DEVICES < 2";
  auto b = MakeTestBuffer(MemoryKind::kCuda, 4096, 1, "probe");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(fake_cuda::IsDevicePointer((*b)->spec().base)) << "device memory does not come from the fake";
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(NcclEmulated, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"nccl", MemoryKind::kCuda, /*min_gpus=*/2,
                                                            /*large_op_bytes=*/int64_t{64} << 20,
                                                            /*peer_device=*/1,
                                                            /*peer_binary=*/"transport/nccl/transport_peer_nccl_emulated"}),
                         ConformanceName);

}  // namespace wb::transport
