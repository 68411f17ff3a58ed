#include "base/shm_segment.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace wb::transport {
namespace {

std::string ErrnoText(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view name) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case ENOENT: code = absl::StatusCode::kNotFound; break;
    case EEXIST: code = absl::StatusCode::kAlreadyExists; break;
    case EACCES:
    case EPERM: code = absl::StatusCode::kPermissionDenied; break;
    case EINVAL:
    case ENAMETOOLONG: code = absl::StatusCode::kInvalidArgument; break;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE: code = absl::StatusCode::kResourceExhausted; break;
    default: break;
  }
  return absl::Status(code, absl::StrCat(what, " shared memory segment '", name, "': ", ErrnoText(err)));
}

absl::StatusOr<void*> MapFd(int fd, int64_t size, bool populate, const std::string& name) {
  if (size == 0) return nullptr;  // mmap of length 0 is invalid; an empty segment maps to nothing.
  int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, flags, fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap", name);
  return p;
}

}  // namespace

absl::Status ShmSegment::ValidateName(absl::string_view name) {
  if (name.size() < 2 || name[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory name '", name, "' must start with '/' and have at least one more character"));
  }
  if (name.substr(1).find('/') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory name '", name, "' contains a second '/'"));
  }
  if (name.size() > NAME_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory name '", name.substr(0, 32), "...' is longer than ", NAME_MAX, " characters"));
  }
  return absl::OkStatus();
}

std::string ShmSegment::UniqueName(absl::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return absl::StrCat("/wb-", prefix, "-", getpid(), "-", counter.fetch_add(1), "-", salt % 1000000007);
}

absl::StatusOr<ShmSegment> ShmSegment::Create(const std::string& name, int64_t size_bytes,
                                              const CreateOptions& options) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (size_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory segment '", name, "': negative size ", size_bytes));
  }
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "create", name);
  ShmSegment seg;
  seg.name_ = name;
  seg.fd_ = fd;
  seg.created_ = true;
  seg.unlink_on_destroy_ = true;  // from here on, any failure unlinks via the destructor
  // The umask may have cleared bits but never adds any; enforce exactly 0600 anyway.
  if (fchmod(fd, 0600) != 0) return ErrnoStatus(errno, "fchmod", name);
  if (ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) return ErrnoStatus(errno, "ftruncate", name);
  auto mapped = MapFd(fd, size_bytes, options.populate, name);
  if (!mapped.ok()) return mapped.status();
  seg.data_ = *mapped;
  seg.size_ = size_bytes;
  return seg;
}

// ---- SIGBUS guard (see CheckIntact in the header). The table is read by the signal handler:
// only atomics, no locks there; slots are claimed and released under g_guard_mu.
namespace {
constexpr int kGuardSlots = 65536;
struct GuardSlot {
  std::atomic<uintptr_t> begin{0}, end{0};  // [begin, end) mapped; begin == 0: free
  std::atomic<int> faulted{0};
};
GuardSlot g_slots[kGuardSlots];
std::atomic<bool> g_guard_on{false};
absl::Mutex g_guard_mu;
struct sigaction g_previous;

void SigbusHandler(int sig, siginfo_t* info, void* ctx) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (GuardSlot& s : g_slots) {
    const uintptr_t b = s.begin.load(std::memory_order_acquire);
    if (b == 0 || addr < b) continue;
    const uintptr_t e = s.end.load(std::memory_order_acquire);
    if (addr >= e) continue;
    const uintptr_t from = addr & ~(page - 1);
    // The file behind the mapping shrank: the rest of the mapping becomes private zero pages, so
    // the faulting access (and any later one) completes; the owner learns it from `faulted`.
    void* m = mmap(reinterpret_cast<void*>(from), e - from, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (m == MAP_FAILED) break;
    s.faulted.store(1, std::memory_order_release);
    return;
  }
  // Not ours: what would have happened without the guard.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);  // returning re-executes the access: the default action (death) follows
}

int GuardMapping(void* data, int64_t size) {
  if (!g_guard_on.load() || data == nullptr || size <= 0) return -1;
  absl::MutexLock l(&g_guard_mu);
  for (int i = 0; i < kGuardSlots; ++i) {
    if (g_slots[i].begin.load(std::memory_order_relaxed) != 0) continue;
    g_slots[i].faulted.store(0);
    g_slots[i].end.store(reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(size), std::memory_order_release);
    g_slots[i].begin.store(reinterpret_cast<uintptr_t>(data), std::memory_order_release);
    return i;
  }
  return -1;
}

void UnguardMapping(int slot) {
  if (slot < 0) return;
  absl::MutexLock l(&g_guard_mu);
  g_slots[slot].begin.store(0, std::memory_order_release);
  g_slots[slot].end.store(0, std::memory_order_release);
}
}  // namespace

void ShmSegment::InstallSigbusGuard() {
  absl::MutexLock l(&g_guard_mu);
  if (g_guard_on.load()) return;
  struct sigaction sa {};
  sa.sa_sigaction = SigbusHandler;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
  g_guard_on.store(true);
}

bool ShmSegment::faulted() const { return guard_slot_ >= 0 && g_slots[guard_slot_].faulted.load(std::memory_order_acquire) != 0; }

absl::Status ShmSegment::CheckIntact() const {
  if (fd_ < 0) return absl::FailedPreconditionError("CheckIntact on an empty ShmSegment");
  if (faulted()) {
    return absl::FailedPreconditionError(absl::StrCat("shared memory segment '", name_, "' shrank while it was being copied (its owner ",
                                                      "truncated it): its bytes are lost to this mapping; register the layout again"));
  }
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", name_);
  if (!S_ISREG(st.st_mode) || st.st_size < size_) {
    return absl::FailedPreconditionError(absl::StrCat("shared memory segment '", name_, "' shrank to ", st.st_size,
                                                      " bytes after it was registered with ", size_, " (its owner truncated it)"));
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::CheckPrivate() const {
  if (fd_ < 0) return absl::FailedPreconditionError("CheckPrivate on an empty ShmSegment");
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", name_);
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("shared memory segment '", name_, "' has mode 0", absl::StrFormat("%o", st.st_mode & 0777),
                                                    ": group/other access is not allowed (create it with mode 0600)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name, int64_t expected_size) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  // O_NONBLOCK: a FIFO named as a segment must not block us until a writer shows up.
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
  if (fd < 0) return ErrnoStatus(errno, "open", name);
  ShmSegment seg;
  seg.name_ = name;
  seg.fd_ = fd;
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", name);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory segment '", name, "' is not a regular file (",
                                                   S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) ? "a character device" : "mode 0" + absl::StrFormat("%o", st.st_mode),
                                                   "); create it with shm_open"));
  }
  if (expected_size >= 0 && st.st_size != expected_size) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory segment '", name, "' has ", st.st_size,
                                                   " bytes, expected ", expected_size));
  }
  auto mapped = MapFd(fd, st.st_size, /*populate=*/false, name);
  if (!mapped.ok()) return mapped.status();
  seg.data_ = *mapped;
  seg.size_ = st.st_size;
  seg.guard_slot_ = GuardMapping(seg.data_, seg.size_);
  return seg;
}

absl::Status ShmSegment::Unlink(const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (shm_unlink(name.c_str()) != 0) return ErrnoStatus(errno, "unlink", name);
  return absl::OkStatus();
}

absl::StatusOr<uid_t> ShmSegment::OwnerUid() const {
  if (fd_ < 0) return absl::FailedPreconditionError("OwnerUid on an empty ShmSegment");
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", name_);
  return st.st_uid;
}

absl::Status ShmSegment::CheckOwner(uid_t uid) const {
  if (fd_ < 0) return absl::FailedPreconditionError("CheckOwner on an empty ShmSegment");
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", name_);
  if (st.st_uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("shared memory segment '", name_, "' is owned by uid ",
                                                    st.st_uid, ", expected uid ", uid));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("shared memory segment '", name_, "' has mode 0",
                                                    absl::StrFormat("%o", st.st_mode & 0777),
                                                    ": group/other access is not allowed (want 0600)"));
  }
  return absl::OkStatus();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    created_ = std::exchange(other.created_, false);
    unlink_on_destroy_ = std::exchange(other.unlink_on_destroy_, false);
    guard_slot_ = std::exchange(other.guard_slot_, -1);
    other.name_.clear();
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() {
  UnguardMapping(guard_slot_);  // before munmap: the range may be mapped again by anyone
  guard_slot_ = -1;
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  if (fd_ >= 0) close(fd_);
  if (unlink_on_destroy_ && !name_.empty()) shm_unlink(name_.c_str());
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
  created_ = false;
  unlink_on_destroy_ = false;
  name_.clear();
}

absl::Status ShmSegment::Populate(int threads) const {
  if (data_ == nullptr || size_ <= 0) return absl::OkStatus();
  const int64_t page = ::sysconf(_SC_PAGESIZE) > 0 ? ::sysconf(_SC_PAGESIZE) : 4096;
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::max(threads, 1), size_ / (int64_t{64} << 20))));
  const int64_t per = (size_ / n + page - 1) / page * page;
  std::vector<int> errs(static_cast<size_t>(n), 0);
  auto one = [&](int i) {
    const int64_t begin = per * i;
    const int64_t end = std::min(size_, begin + per);
    if (begin >= end) return;
    uint8_t* p = static_cast<uint8_t*>(data_);
    if (::madvise(p + begin, static_cast<size_t>(end - begin), MADV_POPULATE_WRITE) != 0) {
      errs[i] = errno;
      return;  // not populated (or the segment shrank): no read here may fault
    }
    // Then one read per page through this mapping: on a VM that shadows the guest's page tables
    // (measured here: PVM), the first access to each page through a mapping still traps to the
    // hypervisor after MADV_POPULATE_WRITE, ~1.5 s of CPU per GB that the first copy into the
    // buffer would otherwise pay; a read suffices (the populated entries are writable) and
    // changes no byte. Nearly free on bare metal. A fault (the segment truncated meanwhile) is
    // caught by the SIGBUS guard and reported below.
    uint8_t sink = 0;
    for (int64_t off = begin; off < end; off += page) sink ^= *static_cast<volatile uint8_t*>(p + off);
    (void)sink;
    // And once from the kernel (such a VM shadows the kernel's view of user pages apart): one
    // byte per page written into a pipe (copy_from_user) and drained, so a socket's send(2)
    // from these pages later (a catch-up reading a source's live weights) does not trap either.
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    std::vector<struct iovec> iov;
    char drain[1024];
    for (int64_t off = begin; off < end;) {
      iov.clear();
      for (; off < end && iov.size() < sizeof(drain); off += page) iov.push_back({p + off, 1});
      const ssize_t n = ::writev(fds[1], iov.data(), static_cast<int>(iov.size()));
      if (n <= 0 || ::read(fds[0], drain, static_cast<size_t>(n)) != n) break;
    }
    ::close(fds[0]);
    ::close(fds[1]);
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(one, i);
  one(0);
  for (std::thread& t : pool) t.join();
  for (int e : errs) {
    if (e == 0 || e == EINVAL) continue;  // EINVAL: a kernel without MADV_POPULATE_WRITE
    return absl::InternalError(absl::StrCat("pre-faulting shm segment ", name_, " (", size_, " bytes): ", std::strerror(e)));
  }
  if (faulted()) return CheckIntact();
  return absl::OkStatus();
}

}  // namespace wb::transport
