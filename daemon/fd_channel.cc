#include "daemon/fd_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/fd_passing.h"

namespace wb::daemon {

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Bind(const std::string& path, mode_t mode, Authorize authorize,
                                                          size_t max_fds_per_worker) {
  sockaddr_un addr = {};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel path '", path, "' is empty or too long"));
  }
  std::unique_ptr<FdChannel> c(new FdChannel());
  c->path_ = path;
  c->authorize_ = std::move(authorize);
  c->max_per_worker_ = max_fds_per_worker;
  c->listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  c->stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (c->listen_fd_ < 0 || c->stop_fd_ < 0) return absl::InternalError(absl::StrCat("fd channel: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ::unlink(path.c_str());
  if (::bind(c->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::chmod(path.c_str(), mode) != 0 ||
      ::listen(c->listen_fd_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("fd channel: cannot listen on ", path, ": ", std::strerror(errno)));
  }
  c->thread_ = std::thread([raw = c.get()] { raw->Serve(); });
  return c;
}

FdChannel::~FdChannel() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
  absl::MutexLock l(&mu_);
  for (auto& [k, e] : entries_) ::close(e.fd);
}

void FdChannel::Stop() {
  {
    absl::MutexLock l(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  ::unlink(path_.c_str());
}

void FdChannel::Serve() {
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    const int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;  // EAGAIN (the client went away) or transient
    ServeConnection(conn);
    ::close(conn);
  }
}

void FdChannel::ServeConnection(int conn) {
  ucred uc = {};
  socklen_t len = sizeof(uc);
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0) return;
  const PeerCred sender{uc.pid, uc.uid, uc.gid, ProcessStartTime(uc.pid)};
  while (true) {
    auto msg = transport::RecvWithFds(conn, 4096, 1, absl::Now() + absl::Seconds(2));
    if (!msg.ok()) {
      if (msg.status().code() == absl::StatusCode::kInvalidArgument) {
        (void)transport::SendWithFds(conn, transport::EncodeFdReply(msg.status()), {}, absl::Now() + absl::Seconds(2));
      }
      return;  // closed, too slow, or garbage
    }
    absl::Status s;
    auto offer = transport::DecodeVmmFdOffer(msg->bytes);
    if (!offer.ok()) {
      s = offer.status();
    } else if (msg->fds.size() != 1) {
      s = absl::InvalidArgumentError("fd channel: an offer carries exactly one fd");
    } else {
      s = Accept(sender, offer->model_id, offer->worker_id, offer->key, offer->allocation_bytes, msg->fds[0]);
      if (s.ok()) msg->fds.clear();  // kept
    }
    for (int fd : msg->fds) ::close(fd);
    if (!transport::SendWithFds(conn, transport::EncodeFdReply(s), {}, absl::Now() + absl::Seconds(2)).ok()) return;
  }
}

absl::Status FdChannel::Accept(const PeerCred& sender, const std::string& model, const std::string& worker,
                               const std::string& key, int64_t bytes, int fd) {
  if (absl::Status s = authorize_(sender, model, worker); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("fd channel: offer of '", key, "' for worker ", worker, " from pid ", sender.pid,
                                               " uid ", sender.uid, " refused: ", s.message()));
  }
  absl::MutexLock l(&mu_);
  size_t mine = 0;
  for (auto it = entries_.lower_bound({worker, ""}); it != entries_.end() && it->first.first == worker;) {
    const PeerCred& was = it->second.sender;
    if (was.pid != sender.pid || was.start_time != sender.start_time) {  // a previous process of this worker id
      ::close(it->second.fd);
      it = entries_.erase(it);
      continue;
    }
    ++mine;
    ++it;
  }
  auto it = entries_.find({worker, key});
  if (it == entries_.end() && mine >= max_per_worker_) {
    return absl::ResourceExhaustedError(absl::StrCat("fd channel: worker ", worker, " already keeps ", mine, " fds (limit ",
                                                     max_per_worker_, ")"));
  }
  if (it != entries_.end()) ::close(it->second.fd);
  entries_[{worker, key}] = Entry{fd, bytes, sender};
  return absl::OkStatus();
}

absl::StatusOr<CudaVmmFd> FdChannel::Get(const std::string& worker, const std::string& key, const PeerCred& bound) const {
  absl::MutexLock l(&mu_);
  auto it = entries_.find({worker, key});
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker, " sent no CUDA VMM fd under key '", key, "' on the fd channel ",
                                            path_, " (send it before RegisterLayout)"));
  }
  const Entry& e = it->second;
  if (e.sender.pid != bound.pid || e.sender.start_time != bound.start_time) {
    return absl::PermissionDeniedError(absl::StrCat("the fd under key '", key, "' was sent by pid ", e.sender.pid,
                                                    ", not by worker ", worker, "'s process ", bound.pid));
  }
  CudaVmmFd out;
  out.fd = ::fcntl(e.fd, F_DUPFD_CLOEXEC, 0);
  if (out.fd < 0) return absl::ResourceExhaustedError(absl::StrCat("fd channel: dup: ", std::strerror(errno)));
  out.allocation_bytes = e.allocation_bytes;
  out.cache_key = absl::StrCat(e.sender.pid, ".", e.sender.start_time, "/", worker, "/", key);
  return out;
}

size_t FdChannel::size() const {
  absl::MutexLock l(&mu_);
  return entries_.size();
}

}  // namespace wb::daemon
