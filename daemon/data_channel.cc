#include "daemon/data_channel.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "tools/cc/status_macros.h"

namespace wb::daemon {
namespace {

constexpr uint32_t kMagic = 0x57424431;  // "WBD1"

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& addr) {
  size_t colon = addr.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(addr.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("bad address '", addr, "' (want host:port)"));
  }
  std::string host = addr.substr(0, colon);
  if (host.empty() || host == "localhost") host = "127.0.0.1";
  return std::make_pair(host, port);
}

// Waits for `events` on fd until deadline (poll in 100 ms slices so Stop()/deadlines are honoured).
absl::Status WaitFd(int fd, short events, absl::Time deadline, const std::atomic<bool>* stop) {
  while (true) {
    if (stop && stop->load()) return absl::CancelledError("data channel stopped");
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("data channel deadline passed");
    int ms = static_cast<int>(std::min<int64_t>(100, absl::ToInt64Milliseconds(left) + 1));
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, ms);
    if (r < 0 && errno != EINTR) return Errno("poll");
    if (r > 0) {
      if (p.revents & (POLLERR | POLLNVAL)) return absl::UnavailableError("connection error");
      return absl::OkStatus();
    }
  }
}

absl::Status WriteAll(int fd, const void* data, size_t n, absl::Time deadline) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline, nullptr));
      continue;
    }
    return Errno("send");
  }
  return absl::OkStatus();
}

// Reads exactly n bytes; NOT_FOUND on a clean EOF before the first byte.
absl::Status ReadAll(int fd, void* data, size_t n, const std::atomic<bool>* stop) {
  uint8_t* p = static_cast<uint8_t*>(data);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, p + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return got == 0 ? absl::NotFoundError("eof") : absl::UnavailableError("peer closed mid-frame");
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      RETURN_IF_ERROR(WaitFd(fd, POLLIN, absl::InfiniteFuture(), stop));
      continue;
    }
    return Errno("recv");
  }
  return absl::OkStatus();
}

struct WireHeader {
  uint32_t magic;
  uint32_t model_len;
  uint64_t version;
  uint64_t plan_epoch;
  uint32_t op_index;
  uint32_t reserved;
  uint64_t payload_len;
  uint64_t checksum;
};

class TcpDataChannel : public DataChannel {
 public:
  ~TcpDataChannel() override { Stop(); }

  absl::StatusOr<std::string> Start(const std::string& listen, Handler handler) override {
    ASSIGN_OR_RETURN(auto hp, SplitHostPort(listen));
    handler_ = std::move(handler);
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listen_fd_ < 0) return Errno("socket");
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(hp.second));
    if (::inet_pton(AF_INET, hp.first.c_str(), &addr.sin_addr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("data_listen host must be an IPv4 address: ", listen));
    }
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) return Errno(absl::StrCat("bind ", listen));
    if (::listen(listen_fd_, 64) < 0) return Errno("listen");
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    address_ = absl::StrCat(hp.first, ":", ntohs(addr.sin_port));
    accept_thread_ = std::thread([this] { AcceptLoop(); });
    return address_;
  }

  absl::Status Send(const std::string& peer, const FrameHeader& header,
                    absl::Span<const uint8_t> payload, absl::Time deadline) override {
    std::shared_ptr<Conn> conn;
    {
      absl::MutexLock l(&mu_);
      auto& c = conns_[peer];
      if (!c) c = std::make_shared<Conn>();
      conn = c;
    }
    absl::MutexLock cl(&conn->mu);
    if (conn->fd < 0) {
      auto fd = Dial(peer, deadline);
      if (!fd.ok()) return Annotate(fd.status(), absl::StrCat("data channel to ", peer));
      conn->fd = *fd;
    }
    WireHeader h{kMagic, static_cast<uint32_t>(header.model_id.size()), header.version,
                 header.plan_epoch, header.op_index, 0, payload.size(),
                 XXH3_64bits(payload.data(), payload.size())};
    absl::Status s = WriteAll(conn->fd, &h, sizeof(h), deadline);
    if (s.ok()) s = WriteAll(conn->fd, header.model_id.data(), header.model_id.size(), deadline);
    if (s.ok()) s = WriteAll(conn->fd, payload.data(), payload.size(), deadline);
    if (!s.ok()) {
      ::close(conn->fd);
      conn->fd = -1;
      return Annotate(s, absl::StrCat("sending op ", header.op_index, " to ", peer));
    }
    return absl::OkStatus();
  }

  void Forget(const std::string& peer) override {
    std::shared_ptr<Conn> conn;
    {
      absl::MutexLock l(&mu_);
      auto it = conns_.find(peer);
      if (it == conns_.end()) return;
      conn = it->second;
      conns_.erase(it);
    }
    absl::MutexLock cl(&conn->mu);
    if (conn->fd >= 0) ::close(conn->fd);
    conn->fd = -1;
  }

  void Stop() override {
    if (stopped_.exchange(true)) return;
    if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
    if (accept_thread_.joinable()) accept_thread_.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    std::vector<std::thread> readers;
    {
      absl::MutexLock l(&mu_);
      for (auto& [peer, c] : conns_) {
        absl::MutexLock cl(&c->mu);
        if (c->fd >= 0) ::close(c->fd);
        c->fd = -1;
      }
      conns_.clear();
      readers.swap(readers_);
    }
    for (auto& t : readers) t.join();
  }

 private:
  struct Conn {
    absl::Mutex mu;
    int fd ABSL_GUARDED_BY(mu) = -1;
  };

  absl::StatusOr<int> Dial(const std::string& peer, absl::Time deadline) {
    ASSIGN_OR_RETURN(auto hp, SplitHostPort(peer));
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) return Errno("socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(hp.second));
    ::inet_pton(AF_INET, hp.first.c_str(), &addr.sin_addr);
    int r = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (r < 0 && errno != EINPROGRESS) {
      absl::Status s = Errno(absl::StrCat("connect ", peer));
      ::close(fd);
      return s;
    }
    absl::Status s = WaitFd(fd, POLLOUT, deadline, &stopped_);
    int err = 0;
    socklen_t len = sizeof(err);
    if (s.ok()) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (!s.ok() || err != 0) {
      ::close(fd);
      return s.ok() ? absl::UnavailableError(absl::StrCat("connect ", peer, ": ", std::strerror(err))) : s;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    int buf = 8 << 20;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    return fd;
  }

  void AcceptLoop() {
    while (!stopped_.load()) {
      pollfd p{listen_fd_, POLLIN, 0};
      int r = ::poll(&p, 1, 100);
      if (r <= 0) continue;
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK);
      if (fd < 0) continue;
      int buf = 8 << 20;
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
      absl::MutexLock l(&mu_);
      if (stopped_.load()) {
        ::close(fd);
        break;
      }
      readers_.emplace_back([this, fd] { ReadLoop(fd); });
    }
  }

  void ReadLoop(int fd) {
    std::vector<uint8_t> payload;
    while (!stopped_.load()) {
      WireHeader h;
      absl::Status s = ReadAll(fd, &h, sizeof(h), &stopped_);
      if (!s.ok() || h.magic != kMagic || h.model_len > 4096) break;
      FrameHeader fh;
      fh.model_id.resize(h.model_len);
      fh.version = h.version;
      fh.plan_epoch = h.plan_epoch;
      fh.op_index = h.op_index;
      if (!ReadAll(fd, fh.model_id.data(), h.model_len, &stopped_).ok()) break;
      payload.resize(h.payload_len);
      if (!ReadAll(fd, payload.data(), payload.size(), &stopped_).ok()) break;
      if (XXH3_64bits(payload.data(), payload.size()) != h.checksum) {
        fh.checksum_ok = false;
        handler_(fh, payload);  // lets the receiver fail the version
        break;
      }
      if (!handler_(fh, payload).ok()) break;
    }
    ::close(fd);
  }

  Handler handler_;
  int listen_fd_ = -1;
  std::string address_;
  std::atomic<bool> stopped_{false};
  std::thread accept_thread_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> readers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<DataChannel> NewTcpDataChannel() { return std::make_unique<TcpDataChannel>(); }

}  // namespace wb::daemon
