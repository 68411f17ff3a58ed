#include "transport/gpu_transports.h"

namespace wb::transport {

bool CudaIpcBuiltIn() { return false; }
bool NcclBuiltIn() { return false; }
absl::StatusOr<std::unique_ptr<Transport>> NewCudaIpcTransport(const TransportConfig&) {
  return absl::UnimplementedError("cuda_ipc: this binary was built without CUDA");
}
absl::StatusOr<std::unique_ptr<Transport>> NewNcclTransport(const TransportConfig&) {
  return absl::UnimplementedError("nccl: this binary was built without NCCL");
}

}  // namespace wb::transport
