#include "base/fd_passing.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

constexpr uint32_t kOfferMagic = 0x44464257;  // "WBFD"
constexpr uint32_t kReplyMagic = 0x52464257;  // "WBFR"
constexpr size_t kMaxFdsPerMessage = 16;

// Waits until `sock` is ready for `events` or the deadline passes.
absl::Status WaitFor(int sock, short events, absl::Time deadline, const char* what) {
  while (true) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError(absl::StrCat(what, ": deadline passed"));
    pollfd p = {sock, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 60'000)));
    if (r > 0) return absl::OkStatus();
    if (r < 0 && errno != EINTR) return absl::InternalError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
  }
}

}  // namespace

absl::Status SendWithFds(int sock, absl::string_view bytes, absl::Span<const int> fds, absl::Time deadline) {
  if (fds.size() > kMaxFdsPerMessage) return absl::InvalidArgumentError("SendWithFds: too many descriptors");
  if (absl::Status s = WaitFor(sock, POLLOUT, deadline, "fd channel send"); !s.ok()) return s;
  iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  while (true) {
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(bytes.size())) return absl::OkStatus();
    if (n >= 0) return absl::InternalError("fd channel send: short datagram");
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {
      if (absl::Status s = WaitFor(sock, POLLOUT, deadline, "fd channel send"); !s.ok()) return s;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("fd channel send: ", std::strerror(errno)));
  }
}

absl::StatusOr<FdMessage> RecvWithFds(int sock, size_t max_bytes, size_t max_fds, absl::Time deadline) {
  FdMessage out;
  out.bytes.resize(max_bytes + 1);  // +1: an oversized datagram is detected, not silently cut
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)] = {};
  while (true) {
    if (absl::Status s = WaitFor(sock, POLLIN, deadline, "fd channel receive"); !s.ok()) return s;
    iovec iov = {out.bytes.data(), out.bytes.size()};
    msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return absl::UnavailableError(absl::StrCat("fd channel receive: ", std::strerror(errno)));
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out.fds.push_back(fd);
      }
    }
    auto refuse = [&](const std::string& why) -> absl::Status {
      for (int fd : out.fds) ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("fd channel receive: ", why));
    };
    if (n == 0 && out.fds.empty()) return absl::OutOfRangeError("fd channel receive: peer closed the connection");
    if ((msg.msg_flags & MSG_CTRUNC) != 0) return refuse("descriptors were truncated");
    if ((msg.msg_flags & MSG_TRUNC) != 0 || static_cast<size_t>(n) > max_bytes) {
      return refuse(absl::StrCat("message larger than ", max_bytes, " bytes"));
    }
    if (out.fds.size() > max_fds) return refuse(absl::StrCat(out.fds.size(), " descriptors, at most ", max_fds, " expected"));
    out.bytes.resize(static_cast<size_t>(n));
    return out;
  }
}

std::string EncodeVmmFdOffer(const VmmFdOffer& offer) {
  wire::Writer w;
  w.U32(kOfferMagic);
  w.Str(offer.model_id);
  w.Str(offer.worker_id);
  w.Str(offer.key);
  w.I64(offer.allocation_bytes);
  if (offer.allocation_id != 0) w.U64(offer.allocation_id);
  return std::move(w.out());
}

absl::StatusOr<VmmFdOffer> DecodeVmmFdOffer(absl::string_view bytes) {
  wire::Reader r(bytes);
  VmmFdOffer o;
  const uint32_t magic = r.U32();
  o.model_id = r.Str(1024);
  o.worker_id = r.Str(1024);
  o.key = r.Str(kMaxVmmKeyBytes);
  o.allocation_bytes = r.I64();
  if (r.ok() && !r.done()) o.allocation_id = r.U64();  // absent from workers built before the field
  if (!r.done() || magic != kOfferMagic) return absl::InvalidArgumentError("fd channel: not a VMM fd offer");
  if (o.key.empty() || o.worker_id.empty() || o.allocation_bytes <= 0) {
    return absl::InvalidArgumentError("fd channel: offer needs a worker id, a key and a positive allocation size");
  }
  return o;
}

std::string EncodeFdReply(const absl::Status& status) {
  wire::Writer w;
  w.U32(kReplyMagic);
  w.U32(static_cast<uint32_t>(status.code()));
  w.Str(status.message().substr(0, 4000));
  return std::move(w.out());
}

absl::Status DecodeFdReply(absl::string_view bytes) {
  wire::Reader r(bytes);
  const uint32_t magic = r.U32();
  const uint32_t code = r.U32();
  std::string message = r.Str(4096);
  if (!r.done() || magic != kReplyMagic || code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError("fd channel: malformed reply from the daemon");
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

absl::Status OfferVmmFd(const std::string& path, const VmmFdOffer& offer, int fd, absl::Time deadline) {
  sockaddr_un addr = {};
  if (path.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError(absl::StrCat("fd channel path too long: ", path));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int sock = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::InternalError(absl::StrCat("fd channel: socket: ", std::strerror(errno)));
  absl::Status s;
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    s = absl::UnavailableError(absl::StrCat("fd channel: connect ", path, ": ", std::strerror(errno),
                                            " (is the node daemon running, with a CUDA-capable build?)"));
  }
  if (s.ok()) s = SendWithFds(sock, EncodeVmmFdOffer(offer), {fd}, deadline);
  if (s.ok()) {
    auto reply = RecvWithFds(sock, 8192, 0, deadline);
    s = reply.ok() ? DecodeFdReply(reply->bytes) : reply.status();
  }
  ::close(sock);
  return s;
}

}  // namespace wb::transport
