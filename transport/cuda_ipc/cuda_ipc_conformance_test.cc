// The conformance suite against cuda_ipc: this process and a peer process on the SAME GPU (device
// 0), each importing the other's device buffer through CUDA IPC. Skips without a visible GPU.
#include "transport/testing/conformance.h"

namespace wb::transport {

INSTANTIATE_TEST_SUITE_P(CudaIpc, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"cuda_ipc", MemoryKind::kCuda, /*min_gpus=*/1,
                                                            /*large_op_bytes=*/int64_t{64} << 20,
                                                            /*peer_device=*/0}),
                         ConformanceName);

}  // namespace wb::transport
