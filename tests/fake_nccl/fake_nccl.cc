// The NCCL emulation (contract in fake_nccl.h). Defines the nccl* functions this repository calls
// against the real <nccl.h>, so the signatures are checked by the compiler.
#include "tests/fake_nccl/fake_nccl.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <nccl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/fake_cuda/fake_cuda.h"

namespace wb::fake_nccl {
namespace {

constexpr char kIdMagic[12] = "WBFAKENCCL1";
constexpr char kHelloMagic[8] = "WBFNHI1";
constexpr uint32_t kFrameMagic = 0x57424e46;  // "WBNF"
constexpr int kKeyBytes = 16;
constexpr size_t kIoSlice = size_t{1} << 20;  // bytes per send/recv call (keeps the loop fair)
constexpr absl::Duration kHandshakeLimit = absl::Seconds(5);
constexpr absl::Duration kAbortDrainLimit = absl::Seconds(10);

struct IdLayout {
  char magic[12];
  uint8_t key[kKeyBytes];
  int32_t creator_pid;
};
static_assert(sizeof(IdLayout) <= NCCL_UNIQUE_ID_BYTES);

struct Hello {
  char magic[8];
  uint8_t key[kKeyBytes];
  int32_t rank;
  int32_t nranks;
  int32_t device;
  int32_t pid;
  char host[96];
};

absl::Duration EnvDuration(const char* name, absl::Duration unit, int64_t def) {
  int64_t v = def;
  if (const char* s = std::getenv(name); s != nullptr && !absl::SimpleAtoi(s, &v)) v = def;
  return unit * std::max<int64_t>(v, 0);
}

absl::Duration StallLimit() {
  static const absl::Duration d = EnvDuration("WB_FAKE_NCCL_STALL_LIMIT_S", absl::Seconds(1), 120);
  return d;
}

absl::Duration LaunchDelay() {
  static const absl::Duration d = EnvDuration("WB_FAKE_NCCL_LAUNCH_DELAY_US", absl::Microseconds(1), 200);
  return d;
}

// Same boot of the same machine <=> same host (NCCL compares host hashes the same way in spirit).
const std::string& HostKey() {
  static const std::string key = [] {
    char host[64] = {};
    (void)gethostname(host, sizeof(host) - 1);
    char boot[64] = {};
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ssize_t n = read(fd, boot, sizeof(boot) - 1);
      (void)n;
      close(fd);
    }
    std::string k = absl::StrCat(host, "/", boot);
    k.erase(std::remove(k.begin(), k.end(), '\n'), k.end());
    return k.substr(0, 95);
  }();
  return key;
}

std::string Ptr(const void* p) { return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(p))); }

// ---- last error (ncclGetLastError) ----

absl::Mutex g_err_mu;
std::string g_last_error ABSL_GUARDED_BY(g_err_mu);

void Warn(const std::string& msg) {
  std::fprintf(stderr, "fake-nccl WARN %s\n", msg.c_str());
  std::fflush(stderr);
  absl::MutexLock l(&g_err_mu);
  g_last_error = msg;
}

struct Op {
  bool send = false;
  void* ptr = nullptr;
  size_t bytes = 0;
  int peer = 0;
  cudaStream_t stream = nullptr;
};

struct CommState;

// One launched group of one communicator.
struct Exec {
  std::vector<Op> ops;
  std::vector<cudaStream_t> streams;  // distinct, in first-use order
  uint64_t seq = 0;                   // position in the communicator's order
  // Guarded by the communicator's mu.
  size_t arrived = 0;
  bool done = false;
};

struct PeerConn {
  int fd = -1;
  int device = -1;
  int pid = 0;
  std::string host;
};

struct CommState {
  int nranks = 0;
  int rank = 0;
  int device = 0;
  bool blocking = true;
  uint8_t key[kKeyBytes] = {};
  int listen_fd = -1;
  int abort_fd = -1;  // eventfd: written once by abort, stays readable, wakes every poll
  // Written by the progress thread before init_state leaves ncclInProgress (under mu), read-only
  // afterwards; fds closed only by the destructor (abort shuts them down), so no fd is reused
  // under a thread still polling it.
  std::vector<PeerConn> peers;
  std::thread progress;

  absl::Mutex mu;
  absl::CondVar cv;
  ncclResult_t init_state ABSL_GUARDED_BY(mu) = ncclInProgress;
  ncclResult_t async_error ABSL_GUARDED_BY(mu) = ncclSuccess;
  std::string error ABSL_GUARDED_BY(mu);
  bool aborted ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> abort_flag{false};  // == aborted, readable without mu (device slot waits)
  std::deque<std::shared_ptr<Exec>> launches ABSL_GUARDED_BY(mu);  // groups not yet on their streams
  int pending ABSL_GUARDED_BY(mu) = 0;      // ncclGroupEnd calls whose group is not yet enqueued
  uint64_t launched ABSL_GUARDED_BY(mu) = 0;   // groups enqueued (next seq)
  uint64_t completed ABSL_GUARDED_BY(mu) = 0;  // groups finished (== seq allowed to run)
  int running ABSL_GUARDED_BY(mu) = 0;

  ~CommState() {
    for (PeerConn& p : peers) {
      if (p.fd >= 0) close(p.fd);
    }
    if (listen_fd >= 0) close(listen_fd);
    if (abort_fd >= 0) close(abort_fd);
  }

  std::string Name() const { return absl::StrCat("rank ", rank, "/", nranks, " (device ", device, ")"); }

  // Records the first asynchronous error (later ones only update the message).
  void Fail(ncclResult_t r, const std::string& msg) ABSL_LOCKS_EXCLUDED(mu) {
    const std::string full = absl::StrCat(Name(), ": ", msg);
    Warn(full);
    absl::MutexLock l(&mu);
    if (async_error == ncclSuccess) async_error = r;
    error = full;
    cv.SignalAll();
  }

  bool Aborted() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock l(&mu);
    return aborted;
  }

  // Like a hung NCCL kernel after a failure: returns when aborted (true) or after the stall limit.
  bool HangUntilAbort() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock l(&mu);
    const absl::Time until = absl::Now() + StallLimit();
    while (!aborted && !cv.WaitWithDeadline(&mu, until)) {
    }
    return aborted;
  }
};

}  // namespace
}  // namespace wb::fake_nccl

// The opaque handle of nccl.h.
struct ncclComm {
  std::shared_ptr<wb::fake_nccl::CommState> state;
};

namespace wb::fake_nccl {
namespace {

// Live handles, so that a use after ncclCommAbort/Destroy is reported instead of undefined.
absl::Mutex g_comms_mu;
std::set<ncclComm*>* g_comms ABSL_GUARDED_BY(g_comms_mu) = new std::set<ncclComm*>();

std::shared_ptr<CommState> Lookup(ncclComm_t comm) {
  if (comm == nullptr) return nullptr;
  absl::MutexLock l(&g_comms_mu);
  if (g_comms->count(comm) == 0) return nullptr;
  return comm->state;
}

// ---- sockets ----

sockaddr_un Address(const uint8_t* key, int rank, socklen_t* len) {
  sockaddr_un a = {};
  a.sun_family = AF_UNIX;
  const std::string name = absl::StrCat("wb-fake-nccl/",
                                        absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(key), kKeyBytes)),
                                        "/", rank);
  std::memcpy(a.sun_path + 1, name.data(), name.size());  // abstract namespace: leading NUL
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

enum class Io { kOk, kAborted, kClosed, kError, kTimeout };

// Moves exactly n bytes over a non-blocking socket (write if `out`), waiting at most `limit`;
// abort wakes it.
Io Exact(CommState& c, int fd, bool out, char* buf, size_t n, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  size_t off = 0;
  while (off < n) {
    const ssize_t r = out ? send(fd, buf + off, n - off, MSG_NOSIGNAL | MSG_DONTWAIT)
                          : recv(fd, buf + off, n - off, MSG_DONTWAIT);
    if (r > 0) {
      off += static_cast<size_t>(r);
      continue;
    }
    if (r == 0 && !out) return Io::kClosed;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return (errno == EPIPE || errno == ECONNRESET) ? Io::kClosed : Io::kError;
    }
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return Io::kTimeout;
    pollfd p[2] = {{fd, static_cast<short>(out ? POLLOUT : POLLIN), 0}, {c.abort_fd, POLLIN, 0}};
    (void)poll(p, 2, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 100)));
    if (p[1].revents != 0) return Io::kAborted;
  }
  return Io::kOk;
}

Hello MakeHello(const CommState& c) {
  Hello h = {};
  std::memcpy(h.magic, kHelloMagic, sizeof(h.magic));
  std::memcpy(h.key, c.key, kKeyBytes);
  h.rank = c.rank;
  h.nranks = c.nranks;
  h.device = wb::fake_cuda::PhysicalDevice(c.device);  // the machine's numbering: compared across processes
  h.pid = static_cast<int32_t>(getpid());
  std::snprintf(h.host, sizeof(h.host), "%s", HostKey().c_str());
  return h;
}

// ncclSuccess: connected; ncclInProgress: not this time (retry); anything else: init fails.
ncclResult_t Handshake(CommState& c, int fd, bool initiator, int expect_rank, PeerConn* out, int* their_rank) {
  Hello mine = MakeHello(c), theirs = {};
  auto io = [&](bool send_side) {
    return send_side ? Exact(c, fd, true, reinterpret_cast<char*>(&mine), sizeof(mine), kHandshakeLimit)
                     : Exact(c, fd, false, reinterpret_cast<char*>(&theirs), sizeof(theirs), kHandshakeLimit);
  };
  Io r1 = io(initiator);
  Io r2 = r1 == Io::kOk ? io(!initiator) : r1;
  if (r2 == Io::kAborted) return ncclInternalError;  // ignored: the caller checks aborted
  if (r2 != Io::kOk) return ncclInProgress;          // the other side went away: try again
  if (std::memcmp(theirs.magic, kHelloMagic, sizeof(theirs.magic)) != 0 ||
      std::memcmp(theirs.key, c.key, kKeyBytes) != 0) {
    return ncclInProgress;  // not one of ours
  }
  theirs.host[sizeof(theirs.host) - 1] = '\0';
  if (theirs.nranks != c.nranks) {
    c.Fail(ncclInvalidUsage, absl::StrCat("rank ", theirs.rank, " (pid ", theirs.pid, ") joined with nranks=",
                                          theirs.nranks, " but this rank has nranks=", c.nranks));
    return ncclInvalidUsage;
  }
  const bool bad_rank = expect_rank >= 0 ? theirs.rank != expect_rank
                                         : (theirs.rank <= c.rank || theirs.rank >= c.nranks ||
                                            c.peers[theirs.rank].fd >= 0);
  if (bad_rank) {
    c.Fail(ncclInvalidUsage, absl::StrCat("unexpected or duplicate rank ", theirs.rank, " (pid ", theirs.pid,
                                          ") joined this unique id"));
    return ncclInvalidUsage;
  }
  *their_rank = theirs.rank;
  out->fd = fd;
  out->device = theirs.device;
  out->pid = theirs.pid;
  out->host = theirs.host;
  return ncclSuccess;
}

// Joins every other rank: connects to the lower ones (retrying until they listen), accepts the
// higher ones. Returns when all are connected, on an error, or when aborted.
ncclResult_t Bootstrap(CommState& c) {
  int missing = c.nranks - 1;
  while (missing > 0) {
    if (c.Aborted()) return ncclInternalError;
    for (int j = 0; j < c.rank; ++j) {
      if (c.peers[j].fd >= 0) continue;
      const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        c.Fail(ncclSystemError, absl::StrCat("socket: ", std::strerror(errno)));
        return ncclSystemError;
      }
      socklen_t len = 0;
      sockaddr_un a = Address(c.key, j, &len);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {  // rank j not listening yet
        close(fd);
        continue;
      }
      int their_rank = -1;
      const ncclResult_t r = Handshake(c, fd, /*initiator=*/true, j, &c.peers[j], &their_rank);
      if (r != ncclSuccess) close(fd);
      if (r == ncclInProgress) continue;
      if (r != ncclSuccess) return r;
      --missing;
    }
    if (missing == 0) break;
    // Accept higher ranks; the timeout is also the retry pause for lower ranks not yet listening.
    pollfd p[2] = {{c.listen_fd, POLLIN, 0}, {c.abort_fd, POLLIN, 0}};
    (void)poll(p, 2, c.rank > 0 ? 10 : 100);
    if (p[1].revents != 0) return ncclInternalError;
    if ((p[0].revents & POLLIN) != 0) {
      const int fd = accept4(c.listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) continue;
      PeerConn conn;
      int their_rank = -1;
      const ncclResult_t r = Handshake(c, fd, /*initiator=*/false, -1, &conn, &their_rank);
      if (r != ncclSuccess) close(fd);
      if (r == ncclInProgress) continue;
      if (r != ncclSuccess) return r;
      c.peers[their_rank] = conn;
      --missing;
    }
  }
  return ncclSuccess;
}

// NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").
ncclResult_t CheckDevices(CommState& c) {
  std::vector<PeerConn> all = c.peers;
  all[c.rank].device = wb::fake_cuda::PhysicalDevice(c.device);
  all[c.rank].pid = static_cast<int>(getpid());
  all[c.rank].host = HostKey();
  for (int i = 0; i < c.nranks; ++i) {
    for (int j = i + 1; j < c.nranks; ++j) {
      if (all[i].host == all[j].host && all[i].device == all[j].device) {
        c.Fail(ncclInvalidUsage, absl::StrCat("Duplicate GPU detected: rank ", i, " (pid ", all[i].pid, ") and rank ", j,
                                              " (pid ", all[j].pid, ") both use CUDA device ", all[i].device,
                                              " of this host (set WB_FAKE_CUDA_DEVICES and give each rank its own)"));
        return ncclInvalidUsage;
      }
    }
  }
  return ncclSuccess;
}

cudaError_t RunExec(const std::shared_ptr<CommState>& c, const std::shared_ptr<Exec>& e);

// ---- one NCCL kernel per device (WB_FAKE_NCCL_ONE_KERNEL_PER_DEVICE=1) ----
// A GPU is not obliged to run two NCCL kernels at once (NCCL: "Using multiple NCCL communicators
// concurrently"): with the option on, a group holds its device (in this process) while it moves
// bytes, so groups of different communicators on one device run one at a time, and ranks that
// take their communicators in inconsistent orders deadlock (until ncclCommAbort or the stall
// limit), as they may on a real GPU.
bool OneKernelPerDevice() {
  static const bool on = [] {
    const char* v = std::getenv("WB_FAKE_NCCL_ONE_KERNEL_PER_DEVICE");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

struct DeviceSlot {
  absl::Mutex mu;
  absl::CondVar cv;
  bool busy ABSL_GUARDED_BY(mu) = false;
};

DeviceSlot& Slot(int device) {
  static DeviceSlot* slots = new DeviceSlot[64];
  return slots[static_cast<unsigned>(device) % 64];
}

// Takes the device for a group of `c`; false when the communicator was aborted, or no slot came
// within the stall limit (then the async error says so), while waiting.
bool AcquireDevice(CommState& c) {
  if (!OneKernelPerDevice()) return true;
  DeviceSlot& slot = Slot(c.device);
  const absl::Time until = absl::Now() + StallLimit();
  absl::MutexLock l(&slot.mu);
  while (slot.busy) {
    if (c.abort_flag.load()) return false;
    if (absl::Now() >= until) {
      slot.mu.Unlock();
      c.Fail(ncclSystemError, absl::StrCat("no progress: device ", c.device,
                                           " was held by another communicator's group for the whole stall limit (one kernel per device)"));
      slot.mu.Lock();
      return false;
    }
    // Abort does not signal this condition: re-check it every few milliseconds.
    slot.cv.WaitWithTimeout(&slot.mu, absl::Milliseconds(5));
  }
  slot.busy = true;
  return true;
}

void ReleaseDevice(const CommState& c) {
  if (!OneKernelPerDevice()) return;
  DeviceSlot& slot = Slot(c.device);
  absl::MutexLock l(&slot.mu);
  slot.busy = false;
  slot.cv.Signal();
}

// The communicator's thread: bootstrap, then moves launched groups onto their streams.
void ProgressMain(std::shared_ptr<CommState> c) {
  ncclResult_t r = Bootstrap(*c);
  if (r == ncclSuccess) r = CheckDevices(*c);
  {
    absl::MutexLock l(&c->mu);
    if (c->aborted) return;
    c->init_state = r;
    if (r != ncclSuccess && c->async_error == ncclSuccess) c->async_error = r;
    c->cv.SignalAll();
  }
  if (r != ncclSuccess) return;
  while (true) {
    std::shared_ptr<Exec> e;
    {
      absl::MutexLock l(&c->mu);
      while (!c->aborted && c->launches.empty()) c->cv.Wait(&c->mu);
      if (c->aborted) return;
      // The delay between ncclGroupEnd returning ncclInProgress and the group reaching its stream.
      const absl::Time until = absl::Now() + LaunchDelay();
      while (!c->aborted && !c->cv.WaitWithDeadline(&c->mu, until)) {
      }
      if (c->aborted) return;
      e = c->launches.front();
      c->launches.pop_front();
      e->seq = c->launched++;
    }
    // Outside mu: Enqueue on the legacy default stream runs the work right here.
    for (cudaStream_t s : e->streams) {
      wb::fake_cuda::Enqueue(s, [c, e]() { return RunExec(c, e); });
    }
    absl::MutexLock l(&c->mu);
    c->pending--;
    c->cv.SignalAll();
  }
}

// Runs the group's transfers: self pairs by copy, peers over their sockets, all concurrently.
cudaError_t Transfer(CommState& c, Exec& e) {
  std::vector<char*> host(e.ops.size(), nullptr);
  for (size_t i = 0; i < e.ops.size(); ++i) {
    const Op& op = e.ops[i];
    if (op.bytes == 0) continue;
    host[i] = static_cast<char*>(wb::fake_cuda::DeviceToHost(op.ptr, op.bytes));
    if (host[i] == nullptr) {
      c.Fail(ncclUnhandledCudaError,
             absl::StrCat(op.send ? "ncclSend" : "ncclRecv", " of ", op.bytes, " bytes at ", Ptr(op.ptr), " (peer ", op.peer,
                          "): the buffer is no longer inside a live device allocation (illegal address)"));
      return cudaErrorIllegalAddress;
    }
  }
  struct Queue {
    std::deque<size_t> ops;
    size_t off = 0;  // bytes of the front op's frame (16-byte header + payload) moved so far
    char hdr[16] = {};
  };
  std::vector<Queue> sends(c.nranks), recvs(c.nranks);
  std::vector<size_t> self_send, self_recv;
  for (size_t i = 0; i < e.ops.size(); ++i) {
    const Op& op = e.ops[i];
    if (op.peer == c.rank) {
      (op.send ? self_send : self_recv).push_back(i);
    } else {
      (op.send ? sends : recvs)[op.peer].ops.push_back(i);
    }
  }
  for (size_t k = 0; k < self_send.size() && k < self_recv.size(); ++k) {  // paired and sized at ncclGroupEnd
    const Op& s = e.ops[self_send[k]];
    if (s.bytes > 0) std::memmove(host[self_recv[k]], host[self_send[k]], s.bytes);
  }
  auto fail_and_hang = [&](ncclResult_t r, const std::string& msg) {
    c.Fail(r, msg);
    return c.HangUntilAbort() ? cudaSuccess : cudaErrorLaunchTimeout;
  };
  auto peer_gone = [&](int p, const char* what) {
    return absl::StrCat("connection to rank ", p, " (pid ", c.peers[p].pid, ") closed while ", what,
                        " (the peer process exited, or aborted or destroyed its communicator)");
  };
  absl::Time last_progress = absl::Now();
  while (true) {
    std::vector<pollfd> pfd;
    std::vector<int> who;
    for (int p = 0; p < c.nranks; ++p) {
      short ev = 0;
      if (!sends[p].ops.empty()) ev |= POLLOUT;
      if (!recvs[p].ops.empty()) ev |= POLLIN;
      if (ev == 0) continue;
      pfd.push_back({c.peers[p].fd, ev, 0});
      who.push_back(p);
    }
    if (pfd.empty()) return cudaSuccess;
    pfd.push_back({c.abort_fd, POLLIN, 0});
    (void)poll(pfd.data(), pfd.size(), 100);
    if (pfd.back().revents != 0 || c.Aborted()) return cudaSuccess;  // aborted kernels end without a CUDA error
    bool progressed = false;
    for (size_t k = 0; k + 1 < pfd.size(); ++k) {
      const int p = who[k];
      const int fd = c.peers[p].fd;
      if (pfd[k].revents == 0) continue;
      // Sends: header then payload, op by op, until the socket is full.
      Queue& sq = sends[p];
      while (!sq.ops.empty()) {
        const Op& op = e.ops[sq.ops.front()];
        if (sq.off == 0) {
          const uint32_t magic = kFrameMagic, zero = 0;
          const uint64_t n = op.bytes;
          std::memcpy(sq.hdr, &magic, 4);
          std::memcpy(sq.hdr + 4, &zero, 4);
          std::memcpy(sq.hdr + 8, &n, 8);
        }
        const size_t total = 16 + op.bytes;
        const char* src = sq.off < 16 ? sq.hdr + sq.off : host[sq.ops.front()] + (sq.off - 16);
        const size_t len = sq.off < 16 ? 16 - sq.off : std::min(total - sq.off, kIoSlice);
        const ssize_t r = send(fd, src, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (r < 0) {
          return fail_and_hang(errno == EPIPE || errno == ECONNRESET ? ncclRemoteError : ncclSystemError,
                               absl::StrCat(peer_gone(p, absl::StrCat("sending ", op.bytes, " bytes").c_str()), ": ",
                                            std::strerror(errno)));
        }
        progressed = true;
        sq.off += static_cast<size_t>(r);
        if (sq.off == total) {
          sq.ops.pop_front();
          sq.off = 0;
        }
      }
      // Receives: only as many frames as this group expects from p; later ones stay in the socket.
      Queue& rq = recvs[p];
      while (!rq.ops.empty()) {
        const Op& op = e.ops[rq.ops.front()];
        const size_t total = 16 + op.bytes;
        char* dst = rq.off < 16 ? rq.hdr + rq.off : host[rq.ops.front()] + (rq.off - 16);
        const size_t len = rq.off < 16 ? 16 - rq.off : std::min(total - rq.off, kIoSlice);
        const ssize_t r = recv(fd, dst, len, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (r == 0 || r < 0) {
          const bool closed = r == 0 || errno == ECONNRESET;
          return fail_and_hang(closed ? ncclRemoteError : ncclSystemError,
                               absl::StrCat(peer_gone(p, absl::StrCat("receiving ", op.bytes, " bytes").c_str()),
                                            r < 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
        }
        progressed = true;
        const size_t before = rq.off;
        rq.off += static_cast<size_t>(r);
        if (before < 16 && rq.off >= 16) {
          uint32_t magic = 0;
          uint64_t n = 0;
          std::memcpy(&magic, rq.hdr, 4);
          std::memcpy(&n, rq.hdr + 8, 8);
          if (magic != kFrameMagic) {
            return fail_and_hang(ncclInternalError, absl::StrCat("corrupt frame from rank ", p));
          }
          if (n != op.bytes) {
            return fail_and_hang(ncclInvalidUsage,
                                 absl::StrCat("ncclRecv of ", op.bytes, " bytes from rank ", p, " matched its ncclSend of ",
                                              n, " bytes (NCCL needs the same count and type on both sides)"));
          }
        }
        if (rq.off == total) {
          rq.ops.pop_front();
          rq.off = 0;
        }
      }
    }
    const absl::Time now = absl::Now();
    if (progressed) {
      last_progress = now;
    } else if (now - last_progress > StallLimit()) {
      c.Fail(ncclSystemError, absl::StrCat("no progress for ", absl::FormatDuration(StallLimit()),
                                           " in a group (a peer never posted the matching operations?)"));
      return cudaErrorLaunchTimeout;
    }
  }
}

// The stream-side body of a group (one call per stream of the group; the last arrival runs it, in
// the communicator's order).
cudaError_t RunExec(const std::shared_ptr<CommState>& c, const std::shared_ptr<Exec>& e) {
  absl::MutexLock l(&c->mu);
  const absl::Time until = absl::Now() + StallLimit();
  if (++e->arrived < e->streams.size()) {  // NCCL joins a group's streams: wait for the run
    while (!e->done && !c->aborted && !c->cv.WaitWithDeadline(&c->mu, until)) {
    }
    return e->done || c->aborted ? cudaSuccess : cudaErrorLaunchTimeout;
  }
  while (c->completed != e->seq && !c->aborted && !c->cv.WaitWithDeadline(&c->mu, until)) {
  }
  cudaError_t r = cudaSuccess;
  if (!c->aborted && c->completed == e->seq && c->async_error == ncclSuccess) {
    c->running++;
    c->mu.Unlock();
    if (AcquireDevice(*c)) {
      r = Transfer(*c, *e);
      ReleaseDevice(*c);
    } else {
      r = c->abort_flag.load() ? cudaSuccess : cudaErrorLaunchTimeout;
    }
    c->mu.Lock();
    c->running--;
  } else if (!c->aborted && c->async_error != ncclSuccess) {
    // An earlier group failed: like NCCL after an async error, nothing moves until abort.
    c->mu.Unlock();
    r = c->HangUntilAbort() ? cudaSuccess : cudaErrorLaunchTimeout;
    c->mu.Lock();
  } else if (!c->aborted) {
    r = cudaErrorLaunchTimeout;
  }
  if (c->completed == e->seq) c->completed++;
  e->done = true;
  c->cv.SignalAll();
  return r;
}

// ---- groups (per thread, as NCCL's) ----

struct GroupOp {
  ncclComm_t handle = nullptr;
  std::shared_ptr<CommState> comm;
  Op op;
};

struct GroupState {
  int depth = 0;
  std::vector<GroupOp> ops;
  ncclResult_t error = ncclSuccess;
};

thread_local GroupState g_group;

ncclResult_t Reject(ncclResult_t r, const std::string& msg) {
  Warn(msg);
  return r;
}

// The state calls other than ncclCommGetAsyncError/Abort/Destroy need (NCCL: ncclCommEnsureReady).
ncclResult_t EnsureReady(CommState& c, const char* call) {
  absl::MutexLock l(&c.mu);
  if (c.async_error != ncclSuccess && c.async_error != ncclInProgress) {
    return Reject(c.async_error, absl::StrCat(call, " on ", c.Name(), ": the communicator has failed (", c.error, ")"));
  }
  if (c.init_state == ncclInProgress || c.pending > 0) {
    return Reject(ncclInvalidUsage, absl::StrCat(call, " on ", c.Name(),
                                                 " while its state is ncclInProgress: poll ncclCommGetAsyncError "
                                                 "until ncclSuccess first"));
  }
  return ncclSuccess;
}

ncclResult_t AddP2P(bool send, const void* buff, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                    cudaStream_t stream) {
  const char* call = send ? "ncclSend" : "ncclRecv";
  std::shared_ptr<CommState> c = Lookup(comm);
  ncclResult_t r = ncclSuccess;
  size_t elem = 0;
  switch (type) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: elem = 1; break;
    case ncclFloat16: case ncclBfloat16: elem = 2; break;
    case ncclInt32: case ncclUint32: case ncclFloat32: elem = 4; break;
    case ncclInt64: case ncclUint64: case ncclFloat64: elem = 8; break;
    default: break;
  }
  if (c == nullptr) {
    r = Reject(ncclInvalidArgument, absl::StrCat(call, ": not a live communicator (", Ptr(comm), ")"));
  } else if (elem == 0) {
    r = Reject(ncclInvalidArgument, absl::StrCat(call, ": bad datatype ", static_cast<int>(type)));
  } else if (peer < 0 || peer >= c->nranks) {
    r = Reject(ncclInvalidArgument, absl::StrCat(call, ": peer ", peer, " is not a rank of ", c->Name()));
  } else if ((r = EnsureReady(*c, call)) != ncclSuccess) {
  } else if (count > 0 && buff == nullptr) {
    r = Reject(ncclInvalidArgument, absl::StrCat(call, " of ", count, " elements: null buffer"));
  } else if (count > 0 && wb::fake_cuda::DeviceToHost(buff, count * elem) == nullptr) {
    r = Reject(ncclInvalidArgument,
               absl::StrCat(call, " of ", count * elem, " bytes at ", Ptr(buff),
                            wb::fake_cuda::IsDevicePointer(buff) ? ": runs past the end of its device allocation"
                                                                  : ": not device memory"));
  } else {
    if (count > 0) {
      cudaPointerAttributes attr = {};
      if (cudaPointerGetAttributes(&attr, buff) == cudaSuccess && attr.type == cudaMemoryTypeDevice &&
          attr.device != c->device) {
        r = Reject(ncclInvalidArgument, absl::StrCat(call, ": buffer ", Ptr(buff), " is on device ", attr.device,
                                                     ", the communicator on device ", c->device));
      }
      (void)cudaGetLastError();
    }
    const int sdev = stream == nullptr ? c->device : wb::fake_cuda::StreamDevice(stream);
    if (r == ncclSuccess && sdev != c->device) {
      r = Reject(ncclInvalidArgument, absl::StrCat(call, ": stream of device ", sdev, ", the communicator is on device ",
                                                   c->device));
    }
  }
  if (r != ncclSuccess) {
    if (g_group.depth > 0 && g_group.error == ncclSuccess) g_group.error = r;
    return r;
  }
  GroupOp g;
  g.handle = comm;
  g.comm = c;
  g.op.send = send;
  g.op.ptr = const_cast<void*>(buff);
  g.op.bytes = count * elem;
  g.op.peer = peer;
  g.op.stream = stream;
  if (g_group.depth > 0) {
    g_group.ops.push_back(std::move(g));
    return ncclSuccess;
  }
  // Outside a group: a group of one.
  g_group.depth = 1;
  g_group.ops.push_back(std::move(g));
  return ncclGroupEnd();
}

}  // namespace
}  // namespace wb::fake_nccl

using wb::fake_nccl::CommState;

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  thread_local std::string copy;
  copy.clear();
  if (std::shared_ptr<CommState> c = wb::fake_nccl::Lookup(comm)) {
    absl::MutexLock l(&c->mu);
    copy = c->error;
  }
  if (copy.empty()) {
    absl::MutexLock l(&wb::fake_nccl::g_err_mu);
    copy = wb::fake_nccl::g_last_error;
  }
  return copy.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* out) {
  if (out == nullptr) return wb::fake_nccl::Reject(ncclInvalidArgument, "ncclGetUniqueId: null argument");
  std::memset(out->internal, 0, NCCL_UNIQUE_ID_BYTES);
  wb::fake_nccl::IdLayout id = {};
  std::memcpy(id.magic, wb::fake_nccl::kIdMagic, sizeof(id.magic));
  if (getrandom(id.key, sizeof(id.key), 0) != static_cast<ssize_t>(sizeof(id.key))) {
    return wb::fake_nccl::Reject(ncclSystemError, absl::StrCat("ncclGetUniqueId: getrandom: ", std::strerror(errno)));
  }
  id.creator_pid = static_cast<int32_t>(getpid());
  std::memcpy(out->internal, &id, sizeof(id));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  using wb::fake_nccl::Reject;
  if (comm == nullptr) return Reject(ncclInvalidArgument, "ncclCommInitRankConfig: comm is null");
  *comm = nullptr;
  if (config != nullptr && (config->magic != 0xcafebeef || config->size < offsetof(ncclConfig_t, cgaClusterSize))) {
    return Reject(ncclInvalidArgument, "ncclCommInitRankConfig: config not initialised with NCCL_CONFIG_INITIALIZER");
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return Reject(ncclInvalidArgument, absl::StrCat("ncclCommInitRankConfig: rank ", rank, " of ", nranks));
  }
  wb::fake_nccl::IdLayout id;
  std::memcpy(&id, commId.internal, sizeof(id));
  if (std::memcmp(id.magic, wb::fake_nccl::kIdMagic, sizeof(id.magic)) != 0) {
    return Reject(ncclInvalidArgument, "ncclCommInitRankConfig: the unique id was not made by ncclGetUniqueId");
  }
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return Reject(ncclUnhandledCudaError, "ncclCommInitRankConfig: cudaGetDevice failed");
  }
  int blocking = 1;
  if (config != nullptr && config->blocking != NCCL_CONFIG_UNDEF_INT) blocking = config->blocking;
  auto c = std::make_shared<CommState>();
  c->nranks = nranks;
  c->rank = rank;
  c->device = device;
  c->blocking = blocking != 0;
  std::memcpy(c->key, id.key, sizeof(c->key));
  c->peers.resize(nranks);
  c->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (c->abort_fd < 0 || c->listen_fd < 0) {
    return Reject(ncclSystemError, absl::StrCat("ncclCommInitRankConfig: eventfd/socket: ", std::strerror(errno)));
  }
  socklen_t len = 0;
  sockaddr_un a = wb::fake_nccl::Address(c->key, rank, &len);
  if (bind(c->listen_fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    const int err = errno;
    return Reject(err == EADDRINUSE ? ncclInvalidUsage : ncclSystemError,
                  absl::StrCat("ncclCommInitRankConfig: rank ", rank, " of this unique id ",
                               err == EADDRINUSE ? "has already joined (duplicate rank)" : std::strerror(err)));
  }
  if (listen(c->listen_fd, 64) != 0) {
    return Reject(ncclSystemError, absl::StrCat("ncclCommInitRankConfig: listen: ", std::strerror(errno)));
  }
  auto* handle = new ncclComm{c};
  {
    absl::MutexLock l(&wb::fake_nccl::g_comms_mu);
    wb::fake_nccl::g_comms->insert(handle);
  }
  c->progress = std::thread(wb::fake_nccl::ProgressMain, c);
  *comm = handle;
  if (!c->blocking) return ncclInProgress;
  absl::MutexLock l(&c->mu);
  const absl::Time until = absl::Now() + wb::fake_nccl::StallLimit();
  while (c->init_state == ncclInProgress && !c->cv.WaitWithDeadline(&c->mu, until)) {
  }
  if (c->init_state == ncclInProgress) {
    return Reject(ncclSystemError, "ncclCommInitRankConfig (blocking): not every rank joined within the stall limit");
  }
  return c->init_state;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return ncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  std::shared_ptr<CommState> c = wb::fake_nccl::Lookup(comm);
  if (c == nullptr || asyncError == nullptr) {
    return wb::fake_nccl::Reject(ncclInvalidArgument, "ncclCommGetAsyncError: not a live communicator");
  }
  absl::MutexLock l(&c->mu);
  if (c->async_error != ncclSuccess) {
    *asyncError = c->async_error;
  } else if (c->init_state != ncclSuccess || c->pending > 0) {
    *asyncError = c->init_state == ncclSuccess ? ncclInProgress : c->init_state;
  } else {
    *asyncError = ncclSuccess;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  std::shared_ptr<CommState> c = wb::fake_nccl::Lookup(comm);
  if (c == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = c->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  std::shared_ptr<CommState> c = wb::fake_nccl::Lookup(comm);
  if (c == nullptr || device == nullptr) return ncclInvalidArgument;
  *device = c->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  std::shared_ptr<CommState> c = wb::fake_nccl::Lookup(comm);
  if (c == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  std::shared_ptr<CommState> c;
  {
    absl::MutexLock l(&wb::fake_nccl::g_comms_mu);
    if (wb::fake_nccl::g_comms->erase(comm) == 0) {
      return wb::fake_nccl::Reject(ncclInvalidArgument, "ncclCommAbort: not a live communicator (aborted twice?)");
    }
    c = comm->state;
  }
  delete comm;
  {
    absl::MutexLock l(&c->mu);
    c->aborted = true;
    c->abort_flag.store(true);
    c->launches.clear();
    c->pending = 0;
    c->cv.SignalAll();
  }
  const uint64_t one = 1;
  ssize_t n = write(c->abort_fd, &one, sizeof(one));
  (void)n;
  // The progress thread (it may still be bootstrapping, i.e. writing peers) ends on the eventfd.
  if (c->progress.joinable()) {
    if (c->progress.get_id() == std::this_thread::get_id()) {
      c->progress.detach();  // abort from stream work run on the progress thread (legacy stream)
    } else {
      c->progress.join();
    }
  }
  for (wb::fake_nccl::PeerConn& p : c->peers) {
    if (p.fd >= 0) (void)shutdown(p.fd, SHUT_RDWR);  // the peers see the connection close
  }
  // Running groups notice within one poll interval; bounded all the same.
  absl::MutexLock l(&c->mu);
  const absl::Time until = absl::Now() + wb::fake_nccl::kAbortDrainLimit;
  while (c->running > 0 && !c->cv.WaitWithDeadline(&c->mu, until)) {
  }
  if (c->running > 0) {
    wb::fake_nccl::Warn(absl::StrCat("ncclCommAbort: ", c->Name(), ": a group did not stop within ",
                                     absl::FormatDuration(wb::fake_nccl::kAbortDrainLimit)));
  }
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::shared_ptr<CommState> c = wb::fake_nccl::Lookup(comm);
  if (c == nullptr) return wb::fake_nccl::Reject(ncclInvalidArgument, "ncclCommFinalize: not a live communicator");
  absl::MutexLock l(&c->mu);
  const absl::Time until = absl::Now() + wb::fake_nccl::StallLimit();
  while (c->async_error == ncclSuccess && (c->pending > 0 || c->completed < c->launched) &&
         !c->cv.WaitWithDeadline(&c->mu, until)) {
  }
  return c->async_error == ncclSuccess && c->pending == 0 && c->completed == c->launched
             ? ncclSuccess
             : (c->async_error != ncclSuccess ? c->async_error : ncclSystemError);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  if (wb::fake_nccl::Lookup(comm) == nullptr) {
    return wb::fake_nccl::Reject(ncclInvalidArgument, "ncclCommDestroy: not a live communicator");
  }
  (void)ncclCommFinalize(comm);  // waits for launched groups (bounded)
  return ncclCommAbort(comm);
}

ncclResult_t ncclGroupStart() {
  wb::fake_nccl::g_group.depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  using wb::fake_nccl::GroupOp;
  using wb::fake_nccl::Reject;
  auto& g = wb::fake_nccl::g_group;
  if (g.depth == 0) return Reject(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--g.depth > 0) return ncclSuccess;
  std::vector<GroupOp> ops = std::move(g.ops);
  g.ops.clear();
  const ncclResult_t err = g.error;
  g.error = ncclSuccess;
  if (err != ncclSuccess) return err;  // an argument error poisoned the group: nothing is launched
  // Per communicator, in first-use order.
  std::vector<std::shared_ptr<CommState>> comms;
  for (const GroupOp& o : ops) {
    if (std::find(comms.begin(), comms.end(), o.comm) == comms.end()) comms.push_back(o.comm);
  }
  bool any_blocking = false, any_nonblocking = false;
  for (const auto& c : comms) (c->blocking ? any_blocking : any_nonblocking) = true;
  if (any_blocking && any_nonblocking) {
    return Reject(ncclInvalidArgument, "ncclGroupEnd: blocking and non-blocking communicators in one group");
  }
  std::vector<std::pair<std::shared_ptr<CommState>, std::shared_ptr<wb::fake_nccl::Exec>>> execs;
  for (const auto& c : comms) {
    auto e = std::make_shared<wb::fake_nccl::Exec>();
    for (const GroupOp& o : ops) {
      if (o.comm != c) continue;
      e->ops.push_back(o.op);
      if (std::find(e->streams.begin(), e->streams.end(), o.op.stream) == e->streams.end()) {
        e->streams.push_back(o.op.stream);
      }
    }
    // NCCL checks self send/recv pairing when it launches the group.
    std::vector<size_t> ss, rr;
    for (const auto& op : e->ops) {
      if (op.peer == c->rank) (op.send ? ss : rr).push_back(op.bytes);
    }
    if (ss.size() != rr.size()) {
      const std::string msg = ss.size() > rr.size() ? "Trying to send to self without a matching recv"
                                                    : "Trying to recv from self without a matching send";
      c->Fail(ncclInvalidUsage, absl::StrCat("ncclGroupEnd: ", msg));
      return ncclInvalidUsage;
    }
    for (size_t k = 0; k < ss.size(); ++k) {
      if (ss[k] != rr[k]) {
        c->Fail(ncclInvalidUsage, absl::StrCat("ncclGroupEnd: send to self of ", ss[k], " bytes matched a recv of ",
                                               rr[k], " bytes"));
        return ncclInvalidUsage;
      }
    }
    execs.emplace_back(c, std::move(e));
  }
  for (auto& [c, e] : execs) {
    absl::MutexLock l(&c->mu);
    if (c->aborted) {  // aborted by another thread since ncclSend/ncclRecv: nothing to run
      e = nullptr;
      continue;
    }
    c->pending++;
    if (c->blocking) {
      e->seq = c->launched++;
    } else {
      c->launches.push_back(e);
      c->cv.SignalAll();
    }
  }
  if (any_nonblocking) return ncclInProgress;
  for (auto& [c, e] : execs) {  // blocking: on the streams before returning
    if (e == nullptr) continue;
    for (cudaStream_t s : e->streams) {
      auto cc = c;
      auto ee = e;
      wb::fake_cuda::Enqueue(s, [cc, ee]() { return wb::fake_nccl::RunExec(cc, ee); });
    }
    absl::MutexLock l(&c->mu);
    c->pending--;
    c->cv.SignalAll();
  }
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return wb::fake_nccl::AddP2P(true, sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return wb::fake_nccl::AddP2P(false, recvbuff, count, datatype, peer, comm, stream);
}

}  // extern "C"
