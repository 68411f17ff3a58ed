// The conformance suite against nccl: this process on GPU 0 and a peer process on GPU 1 (NCCL
// refuses two ranks of one communicator on the same GPU: "Duplicate GPU detected"), so it needs two
// visible GPUs and skips, saying so, with fewer.
#include "transport/testing/conformance.h"

namespace wb::transport {

INSTANTIATE_TEST_SUITE_P(Nccl, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"nccl", MemoryKind::kCuda, /*min_gpus=*/2,
                                                            /*large_op_bytes=*/int64_t{64} << 20,
                                                            /*peer_device=*/1}),
                         ConformanceName);

}  // namespace wb::transport
