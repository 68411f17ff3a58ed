#include "daemon/fd_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/fd_passing.h"

namespace wb::daemon {

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Bind(const std::string& path, mode_t mode, Authorize authorize,
                                                          FdChannelLimits limits) {
  sockaddr_un addr = {};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel path '", path, "' is empty or too long"));
  }
  std::unique_ptr<FdChannel> c(new FdChannel());
  c->path_ = path;
  c->authorize_ = std::move(authorize);
  // The kept fds count against this process's open-file limit: never more than half of it.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    limits.total = std::min<size_t>(limits.total, std::max<size_t>(1, rl.rlim_cur / 2));
  }
  c->limits_ = limits;
  c->listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  c->stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (c->listen_fd_ < 0 || c->stop_fd_ < 0) return absl::InternalError(absl::StrCat("fd channel: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (absl::Status s = ClearStaleSocket(path, SOCK_SEQPACKET, "fd channel"); !s.ok()) return s;
  if (::bind(c->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::chmod(path.c_str(), mode) != 0 ||
      ::listen(c->listen_fd_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("fd channel: cannot listen on ", path, ": ", std::strerror(errno)));
  }
  c->bound_ = BoundSocketPath::Note(path);
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
  bound_.UnlinkIfStillOurs();  // not a socket another daemon bound at this path since
}

// One poll loop over the listener and every open connection: each ready connection gets one
// message read without blocking and answered, so no client waits behind another.
void FdChannel::Serve() {
  std::vector<Conn> conns;
  absl::Time next_sweep = absl::Now() + absl::Seconds(1);
  while (true) {
    const absl::Time now = absl::Now();
    absl::Time wake = next_sweep;
    for (const Conn& c : conns) wake = std::min(wake, c.last + limits_.message_timeout);
    std::vector<pollfd> p = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    for (const Conn& c : conns) p.push_back({c.fd, POLLIN, 0});
    const int ms = static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 1000));
    if (::poll(p.data(), p.size(), ms) < 0 && errno != EINTR) return;
    if (p[1].revents != 0) break;
    // Connections first (their indices match p[2..]), then the listener adds new ones.
    std::vector<Conn> keep;
    const absl::Time t = absl::Now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      bool open = true;
      if (p[i + 2].revents != 0) {
        open = ServeOne(c);
      } else if (t - c.last >= limits_.message_timeout) {
        open = false;  // silent for too long
      }
      if (open) {
        keep.push_back(c);
      } else {
        ::close(c.fd);
      }
    }
    conns.swap(keep);
    if (p[0].revents != 0) AcceptConnections(conns);
    if (t >= next_sweep) {
      absl::MutexLock l(&mu_);
      ReleaseDeadLocked();
      next_sweep = t + absl::Seconds(1);
    }
  }
  for (Conn& c : conns) ::close(c.fd);
}

void FdChannel::AcceptConnections(std::vector<Conn>& conns) {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN (drained), the client went away, or out of fds (retried next time)
    ucred uc = {};
    socklen_t len = sizeof(uc);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0) {
      ::close(fd);
      continue;
    }
    size_t same_uid = 0;
    for (const Conn& c : conns) same_uid += c.sender.uid == uc.uid;
    if (conns.size() >= limits_.max_connections || same_uid >= limits_.max_connections_per_uid) {
      const absl::Status busy = absl::ResourceExhaustedError(absl::StrCat(
          "fd channel: too many connections (", conns.size(), " open, ", same_uid, " of uid ", uc.uid, "; limits ",
          limits_.max_connections, " and ", limits_.max_connections_per_uid, " per uid)"));
      (void)transport::SendWithFds(fd, transport::EncodeFdReply(busy), {}, absl::Now() + absl::Milliseconds(50));
      ::close(fd);
      continue;
    }
    conns.push_back(Conn{fd, PeerCred{uc.pid, uc.uid, uc.gid, ProcessStartTime(uc.pid)}, absl::Now()});
  }
}

bool FdChannel::ServeOne(Conn& conn) {
  // Readable now: the receive does not wait (a datagram is whole or absent).
  auto msg = transport::RecvWithFds(conn.fd, 4096, 1, absl::Now() + absl::Milliseconds(20));
  if (!msg.ok()) {
    if (msg.status().code() == absl::StatusCode::kInvalidArgument) {
      (void)transport::SendWithFds(conn.fd, transport::EncodeFdReply(msg.status()), {}, absl::Now() + absl::Milliseconds(50));
      return false;
    }
    return msg.status().code() == absl::StatusCode::kDeadlineExceeded;  // spurious wake-up; else closed or broken
  }
  conn.last = absl::Now();
  absl::Status s;
  auto offer = transport::DecodeVmmFdOffer(msg->bytes);
  if (!offer.ok()) {
    s = offer.status();
  } else if (msg->fds.size() != 1) {
    s = absl::InvalidArgumentError("fd channel: an offer carries exactly one fd");
  } else {
    s = Accept(conn.sender, *offer, msg->fds[0]);
    if (s.ok()) msg->fds.clear();  // kept
  }
  for (int fd : msg->fds) ::close(fd);
  // A client that does not read its replies (its receive queue full) is dropped, not waited for.
  return transport::SendWithFds(conn.fd, transport::EncodeFdReply(s), {}, absl::Now() + absl::Milliseconds(50)).ok();
}

size_t FdChannel::ReleaseDeadLocked() {
  size_t n = 0;
  std::map<pid_t, bool> alive;  // one /proc read per sender
  for (auto it = entries_.begin(); it != entries_.end();) {
    const PeerCred& who = it->second.sender;
    auto [a, fresh] = alive.try_emplace(who.pid, false);
    if (fresh) a->second = ProcessStartTime(who.pid) == who.start_time;
    if (!a->second) {
      ::close(it->second.fd);
      it = entries_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

size_t FdChannel::ReleaseDead() {
  absl::MutexLock l(&mu_);
  return ReleaseDeadLocked();
}

size_t FdChannel::ReleaseWorker(const std::string& model, const std::string& worker) {
  absl::MutexLock l(&mu_);
  size_t n = 0;
  for (auto it = entries_.lower_bound(Key{model, worker, ""});
       it != entries_.end() && std::get<0>(it->first) == model && std::get<1>(it->first) == worker;) {
    ::close(it->second.fd);
    it = entries_.erase(it);
    ++n;
  }
  return n;
}

absl::Status FdChannel::Accept(const PeerCred& sender, const transport::VmmFdOffer& offer, int fd) {
  const std::string& model = offer.model_id;
  const std::string& worker = offer.worker_id;
  const std::string& key = offer.key;
  if (absl::Status s = authorize_(sender, model, worker); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("fd channel: offer of '", key, "' for worker ", worker, " of model ", model, " from pid ",
                                               sender.pid, " uid ", sender.uid, " refused: ", s.message()));
  }
  absl::MutexLock l(&mu_);
  ReleaseDeadLocked();
  size_t mine = 0;
  for (auto it = entries_.lower_bound(Key{model, worker, ""});
       it != entries_.end() && std::get<0>(it->first) == model && std::get<1>(it->first) == worker;) {
    const PeerCred& was = it->second.sender;
    if (was.pid != sender.pid || was.start_time != sender.start_time) {  // a previous process of this (model, worker)
      ::close(it->second.fd);
      it = entries_.erase(it);
      continue;
    }
    ++mine;
    ++it;
  }
  auto it = entries_.find(Key{model, worker, key});
  if (it == entries_.end()) {
    size_t uid = 0;
    for (const auto& [k, e] : entries_) uid += e.sender.uid == sender.uid;
    const char* limit = nullptr;
    size_t have = 0, max = 0;
    if (mine >= limits_.per_worker) {
      limit = "per worker";
      have = mine;
      max = limits_.per_worker;
    } else if (uid >= limits_.per_uid) {
      limit = "per uid";
      have = uid;
      max = limits_.per_uid;
    } else if (entries_.size() >= limits_.total) {
      limit = "per node";
      have = entries_.size();
      max = limits_.total;
    }
    if (limit != nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("fd channel: offer of '", key, "' for worker ", worker, " of model ", model, " (uid ",
                                                       sender.uid, ") refused: ", have, " fds already kept, limit ", max, " ", limit,
                                                       " (Deregister workers or restart them to release theirs)"));
    }
  }
  // The same allocation again (a replay: the id it was offered with) keeps its cache key; any
  // other (a new id, or none after one) is another allocation, mapped apart.
  const bool same = it != entries_.end() && it->second.allocation_id == offer.allocation_id;
  const uint64_t serial = same ? it->second.serial : ++next_serial_;
  if (it != entries_.end()) ::close(it->second.fd);
  entries_[Key{model, worker, key}] = Entry{fd, offer.allocation_bytes, sender, offer.allocation_id, serial};
  return absl::OkStatus();
}

absl::StatusOr<CudaVmmFd> FdChannel::Get(const std::string& model, const std::string& worker, const std::string& key,
                                         const PeerCred& bound) const {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(Key{model, worker, key});
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker, " of model ", model, " sent no CUDA VMM fd under key '", key,
                                            "' on the fd channel ", path_, " (send it before RegisterLayout)"));
  }
  const Entry& e = it->second;
  if (e.sender.pid != bound.pid || e.sender.start_time != bound.start_time) {
    return absl::PermissionDeniedError(absl::StrCat("the fd under key '", key, "' was sent by pid ", e.sender.pid, ", not by worker ",
                                                    worker, " of model ", model, "'s process ", bound.pid));
  }
  CudaVmmFd out;
  out.fd = ::fcntl(e.fd, F_DUPFD_CLOEXEC, 0);
  if (out.fd < 0) return absl::ResourceExhaustedError(absl::StrCat("fd channel: dup: ", std::strerror(errno)));
  out.allocation_bytes = e.allocation_bytes;
  // Length-prefixed: ids may contain '/', and (model, worker, key) must map to one cache key only.
  out.cache_key = absl::StrCat(e.sender.pid, ".", e.sender.start_time, "/", model.size(), ":", model, "/", worker.size(), ":", worker, "/",
                               key.size(), ":", key, "/", e.serial);
  return out;
}

size_t FdChannel::size() const {
  absl::MutexLock l(&mu_);
  return entries_.size();
}

}  // namespace wb::daemon
