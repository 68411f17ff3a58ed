#pragma once
// The one place where gRPC and absl statuses meet. Servers return ToGrpcStatus(absl_status);
// clients turn what they got back with FromGrpcStatus. Codes map one to one (same numbering).

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace wb {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace wb
