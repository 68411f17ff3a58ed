#pragma once
// Constructors of the GPU transports. Implemented by cuda_ipc.cc / nccl.cc when the binary is built
// with CUDA/NCCL, else by gpu_transports_none.cc (UNIMPLEMENTED). Only factory.cc calls these.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

bool CudaIpcBuiltIn();
bool NcclBuiltIn();
absl::StatusOr<std::unique_ptr<Transport>> NewCudaIpcTransport(const TransportConfig& config);
absl::StatusOr<std::unique_ptr<Transport>> NewNcclTransport(const TransportConfig& config);

}  // namespace wb::transport
