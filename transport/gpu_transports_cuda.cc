// Built with CUDA and NCCL: the factory's GPU transports are the real ones (transport/cuda_ipc/cuda_ipc.h,
// transport/nccl/nccl.h). Whether a GPU is visible is checked by the factory (KindUsable) and again by
// the constructors (FAILED_PRECONDITION without a device).
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/gpu_transports.h"
#include "transport/nccl/nccl.h"

namespace wb::transport {

bool CudaIpcBuiltIn() { return true; }
bool NcclBuiltIn() { return true; }
absl::StatusOr<std::unique_ptr<Transport>> NewCudaIpcTransport(const TransportConfig& config) {
  return CreateCudaIpcTransport(config);
}
absl::StatusOr<std::unique_ptr<Transport>> NewNcclTransport(const TransportConfig& config) {
  return CreateNcclTransport(config);
}

}  // namespace wb::transport
