#include "daemon/conn_guard.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/log.h"
#include "daemon/metrics.h"

namespace wb::daemon {
namespace {

constexpr size_t kChunk = 64 << 10;  // bytes moved per read
constexpr int kReadsPerEvent = 16;   // then the next connection's turn

std::string Errno(absl::string_view what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

int CountOpenFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
    n -= 3;  // ".", "..", and the directory's own fd
  }
  return std::max(n, 0);
}

// Numeric source address and "addr:port" of an accepted socket.
void PeerOf(const sockaddr_storage& ss, std::string* source, std::string* peer) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    *peer = absl::StrCat(host, ":", port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    *peer = absl::StrCat("[", host, "]:", port);
  } else {
    *peer = "?";
  }
  *source = host;
}

}  // namespace

struct ConnGuard::Conn {
  uint64_t id = 0;
  int ext = -1, in = -1;
  std::string source, peer;
  absl::Time accepted;
  bool authenticated = false;
  std::string to_in, to_ext;        // read from one side, not yet written to the other
  bool ext_eof = false, in_eof = false;  // that side's read half reached EOF
};

absl::StatusOr<std::unique_ptr<ConnGuard>> ConnGuard::Bind(const std::string& listen, ConnLimits limits, std::string label,
                                                       DaemonMetrics* metrics) {
  std::unique_ptr<ConnGuard> g(new ConnGuard());
  g->limits_ = limits;
  g->label_ = std::move(label);
  g->metrics_ = metrics != nullptr ? metrics : &Metrics();
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("--listen '", listen, "' is not host:port"));
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int e = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res); e != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--listen '", listen, "': ", gai_strerror(e)));
  }
  std::string why = "no address";
  for (addrinfo* ai = res; ai != nullptr && g->listen_fd_ < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      g->listen_fd_ = fd;
    } else {
      why = Errno("bind/listen");
      close(fd);
    }
  }
  freeaddrinfo(res);
  if (g->listen_fd_ < 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, ": ", why));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(g->listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  g->port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  // The private socket gRPC listens on: in a fresh 0700 directory, so only this uid can reach
  // gRPC around the guard.
  // $TMPDIR when set (containers with a read-only root mount a writable one), else /tmp.
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp != nullptr && tmp[0] == '/' ? tmp : "/tmp", "/wb-grpc-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(Errno(absl::StrCat("mkdtemp ", templ, " (the daemon needs a writable $TMPDIR or /tmp)")));
  }
  const std::string dir = templ;
  g->dir_ = dir;
  g->inner_path_ = absl::StrCat(dir, "/grpc.sock");
  static std::atomic<int> guards{0};
  g->tag_ = absl::StrCat("wbg-", getpid(), "-", guards.fetch_add(1), "-");
  g->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  g->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  g->reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (g->epoll_fd_ < 0 || g->wake_fd_ < 0 || g->reserve_fd_ < 0) return absl::InternalError(Errno("conn guard setup"));
  // Each connection costs 3 fds (client, splice, gRPC's end): together at most 3/4 of what is free.
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  const int64_t free_fds = rl.rlim_cur == RLIM_INFINITY ? int64_t{1} << 20 : static_cast<int64_t>(rl.rlim_cur) - CountOpenFds();
  g->stats_.max_connections = static_cast<int>(std::clamp<int64_t>(free_fds / 4, 8, std::max(8, limits.max_connections)));
  g->limits_.max_unauthenticated = std::max(1, std::min(limits.max_unauthenticated, g->stats_.max_connections / 2));
  return g;
}

ConnGuard::~ConnGuard() {
  Stop();
  for (int fd : {listen_fd_, epoll_fd_, wake_fd_, reserve_fd_}) {
    if (fd >= 0) close(fd);
  }
}

void ConnGuard::Serve() {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // the listener
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.u64 = 1;  // wake
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  serving_ = true;
  buf_.resize(kChunk);
  thread_ = std::thread([this] { Loop(); });
}

void ConnGuard::Stop() {
  {
    absl::MutexLock l(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  absl::MutexLock l(&mu_);
  while (!conns_.empty()) CloseLocked(conns_.begin()->first, nullptr);
  if (!inner_path_.empty()) unlink(inner_path_.c_str());
  if (!dir_.empty()) rmdir(dir_.c_str());
}

// epoll data: 0 listener, 1 wake, else id * 2 + (1 = the client's side, 0 = gRPC's side).
void ConnGuard::Loop() {
  epoll_event events[256];
  while (true) {
    int timeout_ms = -1;
    {
      absl::MutexLock l(&mu_);
      if (stopped_) return;
      const absl::Time now = absl::Now();
      ExpireLocked(now);
      for (auto& [id, c] : conns_) {
        if (c->authenticated) continue;
        const absl::Duration left = c->accepted + limits_.unauthenticated_timeout - now;
        timeout_ms = static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1, 60000));
        break;  // ids grow with accept time: the first unauthenticated one expires first
      }
    }
    const int n = epoll_wait(epoll_fd_, events, 256, timeout_ms);
    if (n < 0 && errno != EINTR) {
      Log(LogLevel::kError, "conn guard: epoll_wait failed", {{"daemon", label_}, {"error", std::strerror(errno)}});
      return;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t d = events[i].data.u64;
      if (d == 0) {
        AcceptAll();
        continue;
      }
      if (d == 1) return;  // Stop()
      const uint64_t id = d / 2;
      const bool ext = (d & 1) != 0;
      const uint32_t e = events[i].events;
      if (e & EPOLLOUT) Flush(id, ext);
      if (e & (EPOLLIN | EPOLLHUP | EPOLLERR)) Pump(id, ext);
    }
  }
}

void ConnGuard::AcceptAll() {
  while (true) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of fds: take the connection off the queue with the reserve and close it, so the
        // client is told at once and the listener stays readable for the next (gRPC 1.51 stops
        // accepting for good here).
        absl::MutexLock l(&mu_);
        ++stats_.fd_exhausted;
        metrics_->Rejected(label_, "conn_fd_exhausted");
        Note("fd_exhausted", "accept4 failed with EMFILE/ENFILE: closing new connections until fds are free");
        close(reserve_fd_);
        const int drop = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (drop >= 0) close(drop);
        reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (drop >= 0) continue;
      }
      return;  // EAGAIN: drained (or a transient error: the next readiness retries)
    }
    std::string source, peer;
    PeerOf(ss, &source, &peer);
    Admit(fd, source, peer);
  }
}

void ConnGuard::Admit(int ext, const std::string& source, const std::string& peer) {
  absl::MutexLock l(&mu_);
  const int mine = unauth_by_source_.count(source) ? unauth_by_source_[source] : 0;
  const char* refused = nullptr;
  if (stats_.open >= stats_.max_connections) {
    refused = "total";
  } else if (mine >= limits_.max_unauthenticated_per_source) {
    refused = "per_source";
  } else if (stats_.unauthenticated >= limits_.max_unauthenticated && !EvictForLocked(source)) {
    refused = "total";
  }
  if (refused != nullptr) {
    close(ext);
    const bool per_source = refused[0] == 'p';
    ++(per_source ? stats_.refused_per_source : stats_.refused_total);
    metrics_->Rejected(label_, per_source ? "conn_per_source" : "conn_total");
    Note(refused, per_source ? absl::StrCat(source, " already has ", mine, " unauthenticated connection(s) (limit ",
                                            limits_.max_unauthenticated_per_source, ")")
                             : absl::StrCat(stats_.open, " connections open, ", stats_.unauthenticated,
                                            " unauthenticated (limits ", stats_.max_connections, ", ",
                                            limits_.max_unauthenticated, "); closing ", peer));
    return;
  }
  const uint64_t id = next_id_++;
  const int in = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  bool ok = in >= 0;
  if (ok) {
    // An abstract name per splice: gRPC reports it as the call's peer, which maps back to `id`.
    sockaddr_un self{};
    self.sun_family = AF_UNIX;
    const std::string name = absl::StrCat(tag_, id);
    std::memcpy(self.sun_path + 1, name.data(), name.size());
    sockaddr_un dst{};
    dst.sun_family = AF_UNIX;
    std::memcpy(dst.sun_path, inner_path_.data(), inner_path_.size());
    ok = bind(in, reinterpret_cast<sockaddr*>(&self), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())) == 0 &&
         connect(in, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) == 0;
  }
  if (!ok) {
    if (errno == EMFILE || errno == ENFILE) ++stats_.fd_exhausted;
    ++stats_.refused_total;
    metrics_->Rejected(label_, "conn_total");
    Note("splice", Errno(absl::StrCat("cannot reach the gRPC server for ", peer)));
    if (in >= 0) close(in);
    close(ext);
    return;
  }
  const int one = 1;
  setsockopt(ext, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto c = std::make_unique<Conn>();
  c->id = id;
  c->ext = ext;
  c->in = in;
  c->source = source;
  c->peer = peer;
  c->accepted = absl::Now();
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = id * 2 + 1;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, ext, &ev);
  ev.data.u64 = id * 2;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, in, &ev);
  conns_[id] = std::move(c);
  ++unauth_by_source_[source];
  ++stats_.unauthenticated;
  ++stats_.open;
  ++stats_.accepted;
}

bool ConnGuard::EvictForLocked(const std::string& source) {
  const int mine = unauth_by_source_.count(source) ? unauth_by_source_[source] : 0;
  const std::string* heaviest = nullptr;
  int most = mine;
  for (const auto& [s, n] : unauth_by_source_) {
    if (n > most) {
      most = n;
      heaviest = &s;
    }
  }
  if (heaviest == nullptr) return false;
  for (auto& [id, c] : conns_) {
    if (!c->authenticated && c->source == *heaviest) {
      ++stats_.evicted;
      metrics_->Rejected(label_, "conn_evicted");
      Note("evicted", absl::StrCat("closing unauthenticated ", c->peer, " (", most, " from its address) to admit one from ", source));
      CloseLocked(id, nullptr);
      return true;
    }
  }
  return false;
}

void ConnGuard::ExpireLocked(absl::Time now) {
  std::vector<uint64_t> expired;
  for (auto& [id, c] : conns_) {
    if (c->authenticated) continue;
    if (now - c->accepted < limits_.unauthenticated_timeout) break;  // later ones are younger
    expired.push_back(id);
  }
  for (uint64_t id : expired) {
    ++stats_.timed_out;
    metrics_->Rejected(label_, "conn_timeout");
    Note("timeout", absl::StrCat(conns_[id]->peer, " made no authenticated call within ",
                                 absl::FormatDuration(limits_.unauthenticated_timeout)));
    CloseLocked(id, nullptr);
  }
}

void ConnGuard::CloseLocked(uint64_t id, const char* why) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  if (why != nullptr) Log(LogLevel::kDebug, "conn guard: closed", {{"daemon", label_}, {"peer", c.peer}, {"why", why}});
  close(c.ext);  // also removes both from the epoll set
  close(c.in);
  if (!c.authenticated) {
    if (--unauth_by_source_[c.source] <= 0) unauth_by_source_.erase(c.source);
    --stats_.unauthenticated;
  }
  --stats_.open;
  conns_.erase(it);
}

void ConnGuard::Note(const char* reason, const std::string& detail) {
  const absl::Time now = absl::Now();
  absl::Time& last = last_log_[reason];
  if (now - last < absl::Seconds(1)) return;
  last = now;
  Log(LogLevel::kWarning, "gRPC port: connection refused or closed",
      {{"daemon", label_}, {"reason", reason}, {"detail", detail}});
}

void ConnGuard::Arm(Conn& c) {
  epoll_event ev{};
  ev.events = ((!c.ext_eof && c.to_in.empty()) ? EPOLLIN : 0) | (!c.to_ext.empty() ? EPOLLOUT : 0);
  ev.data.u64 = c.id * 2 + 1;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.ext, &ev);
  ev.events = ((!c.in_eof && c.to_ext.empty()) ? EPOLLIN : 0) | (!c.to_in.empty() ? EPOLLOUT : 0);
  ev.data.u64 = c.id * 2;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.in, &ev);
}

// Moves bytes from one side to the other until the source would block, the destination is full
// (the rest waits in a buffer and the source is not read again until it drained), or EOF.
void ConnGuard::Pump(uint64_t id, bool from_ext) {
  absl::MutexLock l(&mu_);
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  const int src = from_ext ? c.ext : c.in, dst = from_ext ? c.in : c.ext;
  std::string& pending = from_ext ? c.to_in : c.to_ext;
  bool& eof = from_ext ? c.ext_eof : c.in_eof;
  char* buf = buf_.data();  // only the loop thread pumps
  for (int i = 0; i < kReadsPerEvent && !eof && pending.empty(); ++i) {
    const ssize_t n = recv(src, buf, buf_.size(), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
    if (n < 0) return CloseLocked(id, "read error");
    if (n == 0) {
      eof = true;
      shutdown(dst, SHUT_WR);  // nothing pending (loop condition): pass the half-close on
      break;
    }
    ssize_t w = send(dst, buf, static_cast<size_t>(n), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) w = 0;
    if (w < 0) return CloseLocked(id, "write error");
    if (w < n) pending.assign(buf + w, static_cast<size_t>(n - w));
  }
  if (c.ext_eof && c.in_eof && c.to_in.empty() && c.to_ext.empty()) return CloseLocked(id, "both sides closed");
  // A side that hung up completely and has nothing left to read: the other direction cannot
  // deliver anything useful any more either (level-triggered HUP would otherwise spin).
  if (eof) {
    pollfd p = {src, 0, 0};
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR))) {
      if (!pending.empty()) (void)!send(dst, pending.data(), pending.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      return CloseLocked(id, "hung up");
    }
  }
  Arm(c);
}

void ConnGuard::Flush(uint64_t id, bool to_ext) {
  absl::MutexLock l(&mu_);
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  std::string& pending = to_ext ? c.to_ext : c.to_in;
  const int dst = to_ext ? c.ext : c.in;
  if (!pending.empty()) {
    ssize_t w = send(dst, pending.data(), pending.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) w = 0;
    if (w < 0) return CloseLocked(id, "write error");
    pending.erase(0, static_cast<size_t>(w));
    if (pending.empty() && (to_ext ? c.in_eof : c.ext_eof)) shutdown(dst, SHUT_WR);
  }
  if (c.ext_eof && c.in_eof && c.to_in.empty() && c.to_ext.empty()) return CloseLocked(id, "both sides closed");
  Arm(c);
}

int64_t ConnGuard::IdFromPeer(const std::string& grpc_peer) const {
  const size_t at = grpc_peer.find(tag_);
  if (at == std::string::npos) return -1;
  size_t end = at + tag_.size();
  while (end < grpc_peer.size() && grpc_peer[end] >= '0' && grpc_peer[end] <= '9') ++end;
  int64_t id = -1;
  if (!absl::SimpleAtoi(absl::string_view(grpc_peer).substr(at + tag_.size(), end - at - tag_.size()), &id)) return -1;
  return id;
}

std::string ConnGuard::NoteAuthenticated(const std::string& grpc_peer) {
  const int64_t id = IdFromPeer(grpc_peer);
  if (id < 0) return "";
  absl::MutexLock l(&mu_);
  auto it = conns_.find(static_cast<uint64_t>(id));
  if (it == conns_.end()) return "";
  Conn& c = *it->second;
  if (!c.authenticated) {
    c.authenticated = true;
    if (--unauth_by_source_[c.source] <= 0) unauth_by_source_.erase(c.source);
    --stats_.unauthenticated;
  }
  return c.peer;
}

std::string ConnGuard::ExternalPeer(const std::string& grpc_peer) const {
  const int64_t id = IdFromPeer(grpc_peer);
  if (id < 0) return grpc_peer;
  absl::MutexLock l(&mu_);
  auto it = conns_.find(static_cast<uint64_t>(id));
  if (it == conns_.end()) return grpc_peer;
  const std::string& p = it->second->peer;
  return absl::StrCat(p[0] == '[' ? "ipv6:" : "ipv4:", p);
}

ConnGuardStats ConnGuard::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

}  // namespace wb::daemon
