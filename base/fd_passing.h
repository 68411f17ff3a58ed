#pragma once
// Passing file descriptors between processes of one machine (SCM_RIGHTS over a Unix
// SOCK_SEQPACKET socket), and the messages of the node daemon's fd channel. gRPC cannot carry
// descriptors, so a worker that shares CUDA VMM memory (cuMemExportToShareableHandle ->
// POSIX fd) hands the fd to its node daemon here; the BufferSpec then names it by key
// (docs/daemon.md "CUDA buffers", docs/security.md "fd channel"). The server side is
// daemon/fd_channel.h; OfferVmmFd below is the worker side.
//
// Contract: every call takes a deadline and never blocks past it (poll before each socket call).
// Received descriptors are owned by the caller (close-on-exec set at receipt); a message carrying
// more descriptors than asked for, or whose descriptors were truncated, closes them all and is
// INVALID_ARGUMENT.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace wb::transport {

// One datagram with the descriptors that came with it (owned by the receiver).
struct FdMessage {
  std::string bytes;
  std::vector<int> fds;
};

absl::Status SendWithFds(int sock, absl::string_view bytes, absl::Span<const int> fds, absl::Time deadline);
// EOF (peer closed) is OUT_OF_RANGE; a missed deadline DEADLINE_EXCEEDED.
absl::StatusOr<FdMessage> RecvWithFds(int sock, size_t max_bytes, size_t max_fds, absl::Time deadline);

// What a worker tells the daemon together with one VMM allocation's fd.
struct VmmFdOffer {
  std::string model_id;
  std::string worker_id;
  std::string key;               // the worker's name for the allocation (BufferSpec.cuda_vmm_key)
  int64_t allocation_bytes = 0;  // the size passed to cuMemCreate (the importer maps that much)
  // The worker's id of the allocation behind the fd, unique in its process (0: not given, as before
  // this field): the same id when it offers the same allocation again (a replay after a
  // reconnect), another one for another allocation under a key it used before. The daemon maps a key offered with a new
  // id anew, so a layout naming the key is not taken for a replay of the old memory
  // (docs/daemon.md "CUDA buffers"). On the wire: a u64 after allocation_bytes, absent = 0.
  uint64_t allocation_id = 0;
};
constexpr size_t kMaxVmmKeyBytes = 128;

std::string EncodeVmmFdOffer(const VmmFdOffer& offer);
absl::StatusOr<VmmFdOffer> DecodeVmmFdOffer(absl::string_view bytes);
// The daemon's reply to one offer: OK, or the refusal (code + message).
std::string EncodeFdReply(const absl::Status& status);
absl::Status DecodeFdReply(absl::string_view bytes);

// Worker side: connects to the daemon's fd channel at `path`, sends `offer` with `fd` (which stays
// the caller's) and returns the daemon's answer. UNAVAILABLE when nothing listens at `path`.
absl::Status OfferVmmFd(const std::string& path, const VmmFdOffer& offer, int fd, absl::Time deadline);

}  // namespace wb::transport
