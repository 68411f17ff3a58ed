#pragma once
// The one place where gRPC and absl statuses meet. Servers return ToGrpcStatus(absl_status);
// clients turn what they got back with FromGrpcStatus. Codes map one to one (same numbering).

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace wb {

// The message is capped by CapStatusMessage: every server status passes here.
grpc::Status ToGrpcStatus(const absl::Status& status);

// A status message travels percent-encoded in a gRPC trailer; one over the client's metadata limit
// (8 KiB by default) replaced the error with "received initial metadata size exceeds limit" and
// failed the client's other calls on that connection (issue 15.12: values echoed whole, e.g. a
// 1 MiB tensor name or a spec difference). Messages whose encoding exceeds
// kMaxEncodedStatusMessage bytes keep their head and tail and say how many bytes were cut.
inline constexpr size_t kMaxEncodedStatusMessage = 4096;
std::string CapStatusMessage(absl::string_view message);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace wb
