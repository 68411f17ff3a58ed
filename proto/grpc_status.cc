#include "proto/grpc_status.h"

#include <string>

#include "absl/strings/string_view.h"

namespace wb {

namespace {

// Bytes one message byte takes in the grpc-message trailer (percent-encoded outside 0x20..0x7e).
size_t EncodedSize(char c) {
  const unsigned char u = static_cast<unsigned char>(c);
  return u < 0x20 || u > 0x7e || u == '%' ? 3 : 1;
}

}  // namespace

std::string CapStatusMessage(absl::string_view message) {
  size_t total = 0;
  for (char c : message) total += EncodedSize(c);
  if (total <= kMaxEncodedStatusMessage) return std::string(message);
  // The head names what failed, the tail usually why: keep both, say how much was cut.
  constexpr size_t kHead = kMaxEncodedStatusMessage * 3 / 4, kTail = kMaxEncodedStatusMessage / 8;
  size_t head = 0, tail = 0, enc = 0;
  while (head < message.size() && enc + EncodedSize(message[head]) <= kHead) enc += EncodedSize(message[head++]);
  enc = 0;
  while (tail < message.size() - head && enc + EncodedSize(message[message.size() - 1 - tail]) <= kTail) {
    enc += EncodedSize(message[message.size() - 1 - tail++]);
  }
  return std::string(message.substr(0, head)) + " ...(" + std::to_string(message.size() - head - tail) +
         " bytes of this message cut)... " + std::string(message.substr(message.size() - tail));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share the canonical numbering (0..16).
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(status.code())), CapStatusMessage(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  int code = static_cast<int>(status.error_code());
  if (code < 0 || code > 16) code = static_cast<int>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

}  // namespace wb
