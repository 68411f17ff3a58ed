// The CPU emulation of the CUDA runtime described in fake_cuda.h. The cuda* functions are defined
// in this translation unit AFTER including the real CUDA headers, so every macro rename those
// headers apply (e.g. per-thread-default-stream or _v2 variants) renames our definitions too, and
// the definitions get the headers' C linkage.
//
// Structure: one process-wide State (leaked on purpose: worker threads may still run while the
// process exits) under one absl::Mutex. Device memory = a POSIX shm segment mapped read-write at a
// private "alias" address plus a PROT_NONE reservation whose address is the device pointer. Every
// stream (the legacy stream of each device included) has a worker thread that runs its ops in
// order; cross-stream dependencies (legacy-stream semantics) are (stream, sequence number) pairs
// an op waits for before it runs.

#include "tests/fake_cuda/fake_cuda.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wb::fake_cuda {
namespace {

constexpr int64_t kMaxPitch = INT_MAX;  // cudaDeviceProp::memPitch we report (what GPUs report)
constexpr char kHandleMagic[8] = {'W', 'B', 'F', 'C', 'I', 'P', 'C', '1'};
constexpr char kShmPrefix[] = "wbfc.";  // /dev/shm/wbfc.<pid>.<token>.<counter>

// The IPC handle's 64 bytes.
struct HandleBytes {
  char magic[8];
  int32_t pid;
  int32_t device;
  uint64_t size;
  char name[40];
};
static_assert(sizeof(HandleBytes) == sizeof(cudaIpcMemHandle_t), "handle layout must fill cudaIpcMemHandle_t");

int64_t EnvInt(const char* name, int64_t def, int64_t lo, int64_t hi) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  long long x = strtoll(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) {
    fprintf(stderr, "fake_cuda: ignoring %s=%s (want an integer in [%lld, %lld])\n", name, v,
            static_cast<long long>(lo), static_cast<long long>(hi));
    return def;
  }
  return x;
}

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One device allocation: own (cudaMalloc) or mapped from another process (cudaIpcOpenMemHandle).
struct VmmAlloc;

struct Alloc {
  uintptr_t base = 0;      // the device pointer (start of the PROT_NONE reservation)
  size_t size = 0;         // bytes the caller asked for
  size_t reserved = 0;     // bytes of the reservation (page-rounded size + one guard page)
  size_t mapped = 0;       // bytes of the alias mapping
  char* alias = nullptr;   // the emulator's read-write view of the bytes
  int device = 0;
  bool opened = false;     // IPC import
  // Stream-ordered memory-pool memory (cudaMallocAsync / cudaMallocFromPoolAsync, from the device's
  // default pool): legacy IPC cannot export it (cudaIpcGetMemHandle refuses it, and
  // cuPointerGetAttribute says CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 0).
  bool pool = false;
  bool free_pending = false;  // a cudaFree / cudaFreeAsync of it is under way (another one is a double free)
  int ipc_refs = 0;        // imports: how many opens are outstanding
  std::string shm_name;    // "/wbfc...."
  // cuMemMap mappings (VMM): `base` lies inside a cuMemAddressReserve reservation owned by the
  // caller (not by this entry); bytes are inaccessible until cuMemSetAccess grants the device.
  bool vmm = false;
  bool accessible = true;
  uint64_t vmm_handle = 0;  // the CUmemGenericAllocationHandle mapped here
  std::shared_ptr<VmmAlloc> vmm_alloc;  // what it maps (cuMemRetainAllocationHandle finds it again)
  // A temporary contiguous view of several adjacent cuMemMap mappings (ResolveLocked), alive while
  // one copy uses it; never in State::allocs.
  bool view = false;
  std::vector<std::shared_ptr<Alloc>> viewed;  // the mappings it shows (kept alive with it)
  ~Alloc() {
    if (alias != nullptr) munmap(alias, mapped);
  }
};

// A physical VMM allocation (cuMemCreate, or cuMemImportFromShareableHandle of another process's
// export): a memfd named "wbfc-vmm.p<machine device>" (the name tells an importer which GPU holds
// it; a memfd needs no unlinking and lives as long as some descriptor or mapping of it).
struct VmmAlloc {
  int fd = -1;
  size_t size = 0;
  int device = 0;           // this process's ordinal
  bool imported = false;
  bool exportable = false;  // requestedHandleTypes included CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  int refs = 1;             // cuMemCreate / import, plus one per cuMemRetainAllocationHandle
  bool counted = false;     // its bytes count in State::used (until the last cuMemRelease)
  ~VmmAlloc() {
    if (fd >= 0) close(fd);
  }
};

struct Stream;

struct Op {
  std::function<cudaError_t()> fn;
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> deps;  // wait for stream->completed >= seq
  uint64_t seq = 0;
};

struct Stream {
  int device = 0;
  bool blocking = true;  // synchronises with the legacy stream
  bool legacy = false;
  bool destroyed = false;
  std::deque<Op> queue;
  uint64_t enqueued = 0;   // ops ever enqueued
  uint64_t completed = 0;  // ops finished (in order)
  cudaError_t error = cudaSuccess;  // first failure of an op on this stream (sticky for the stream)
  uint64_t error_seq = 0;
};

struct Event {
  int device = 0;
  std::shared_ptr<Stream> stream;  // null until recorded
  uint64_t seq = 0;
};

struct HostRange {
  size_t size = 0;
  bool from_malloc_host = false;
};

struct State {
  absl::Mutex mu;
  pid_t pid = 0;
  int devices = 1;
  std::vector<int> physical;  // this process's ordinal -> the machine's device (CUDA_VISIBLE_DEVICES)
  size_t mem_per_device = 0;
  absl::Duration sync_timeout;
  int64_t op_delay_us = 0;
  std::atomic<int> sticky{cudaSuccess};  // a context-killing error (cudaErrorIllegalAddress)

  std::map<uintptr_t, std::shared_ptr<Alloc>> allocs ABSL_GUARDED_BY(mu);  // by base
  std::map<uintptr_t, size_t> quarantine ABSL_GUARDED_BY(mu);  // freed/closed reservations
  std::map<uintptr_t, HostRange> host ABSL_GUARDED_BY(mu);     // pinned host ranges
  std::map<Stream*, std::shared_ptr<Stream>> streams ABSL_GUARDED_BY(mu);  // incl. destroyed, draining
  std::vector<std::shared_ptr<Stream>> legacy ABSL_GUARDED_BY(mu);        // per device, lazily
  std::map<Event*, std::unique_ptr<Event>> events ABSL_GUARDED_BY(mu);
  std::vector<size_t> used ABSL_GUARDED_BY(mu);
  std::vector<std::string> owned_names ABSL_GUARDED_BY(mu);  // shm names to unlink at exit
  std::string prefix ABSL_GUARDED_BY(mu);  // "wbfc.<pid>.<token>."
  // VMM (cuMem*): physical allocations by CUmemGenericAllocationHandle, VA reservations by base.
  std::map<uint64_t, std::shared_ptr<VmmAlloc>> vmm ABSL_GUARDED_BY(mu);
  std::map<uintptr_t, size_t> reservations ABSL_GUARDED_BY(mu);
  uint64_t vmm_counter ABSL_GUARDED_BY(mu) = 0;
  uint64_t counter ABSL_GUARDED_BY(mu) = 0;
  bool reaper_started ABSL_GUARDED_BY(mu) = false;
};

void UnlinkOwnedAtExit();

State& S() {
  static State* s = [] {
    auto* st = new State();  // leaked: worker threads may outlive static destruction
    st->pid = getpid();
    const int machine = static_cast<int>(EnvInt("WB_FAKE_CUDA_DEVICES", 1, 0, 64));
    // CUDA_VISIBLE_DEVICES (ordinals only): the listed devices, renumbered 0, 1, ... in list
    // order; like CUDA, the list ends at the first entry that is not a device of the machine.
    if (const char* v = getenv("CUDA_VISIBLE_DEVICES"); v != nullptr) {
      for (absl::string_view item : absl::StrSplit(v, ',')) {
        int d = -1;
        if (!absl::SimpleAtoi(item, &d) || d < 0 || d >= machine) break;
        st->physical.push_back(d);
      }
    } else {
      for (int d = 0; d < machine; ++d) st->physical.push_back(d);
    }
    st->devices = static_cast<int>(st->physical.size());
    st->mem_per_device = static_cast<size_t>(EnvInt("WB_FAKE_CUDA_MEM_BYTES", int64_t{16} << 30, 1 << 20, int64_t{1} << 44));
    st->sync_timeout = absl::Seconds(EnvInt("WB_FAKE_CUDA_SYNC_TIMEOUT_S", 120, 1, 86400));
    st->op_delay_us = EnvInt("WB_FAKE_CUDA_OP_DELAY_US", 0, 0, 10'000'000);
    st->used.assign(st->devices, 0);
    std::random_device rd;
    char buf[64];
    snprintf(buf, sizeof(buf), "%s%d.%08x.", kShmPrefix, static_cast<int>(st->pid), rd());
    st->prefix = buf;
    atexit(UnlinkOwnedAtExit);
    return st;
  }();
  return *s;
}

thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;

void Log(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  fprintf(stderr, "fake_cuda[%d]: %s\n", static_cast<int>(getpid()), buf);
}

// Records `e` as the thread's last error (with a line on stderr saying why) and returns it.
cudaError_t Fail(cudaError_t e, const char* api, const char* fmt, ...) {
  char buf[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  Log("%s -> %s: %s", api, cudaGetErrorName(e), buf);
  t_last_error = e;
  return e;
}

// Every API entry: refuses a forked child (real CUDA cannot be used after fork() either) and
// returns the sticky error once the "context" is dead.
cudaError_t Enter(const char* api) {
  State& s = S();
  if (getpid() != s.pid) {
    return Fail(cudaErrorInitializationError, api,
                "CUDA used in a child forked from the process that initialised it (not supported by CUDA)");
  }
  const int sticky = s.sticky.load();
  if (sticky != cudaSuccess) {
    t_last_error = static_cast<cudaError_t>(sticky);
    return static_cast<cudaError_t>(sticky);
  }
  return cudaSuccess;
}

#define FAKE_ENTER(api)                                 \
  do {                                                  \
    if (cudaError_t e_ = Enter(api); e_ != cudaSuccess) \
      return e_;                                        \
  } while (0)

void SetSticky(cudaError_t e) {
  int expected = cudaSuccess;
  S().sticky.compare_exchange_strong(expected, e);
}

// ---- allocations ----

// The live allocation whose reservation contains p (guard page included), or null.
std::shared_ptr<Alloc> FindLocked(uintptr_t p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  auto& m = S().allocs;
  auto it = m.upper_bound(p);
  if (it == m.begin()) return nullptr;
  --it;
  if (p >= it->first && p < it->first + it->second->reserved) return it->second;
  return nullptr;
}

bool InQuarantineLocked(uintptr_t p, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  auto& q = S().quarantine;
  auto it = q.upper_bound(p + (n > 0 ? n - 1 : 0));
  if (it == q.begin()) return false;
  --it;
  return p < it->first + it->second;
}

// True when [p, p+n) overlaps any live device reservation.
bool OverlapsDeviceLocked(uintptr_t p, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  auto& m = S().allocs;
  auto it = m.upper_bound(p + (n > 0 ? n - 1 : 0));
  if (it == m.begin()) return false;
  --it;
  return p < it->first + it->second->reserved;
}

// A contiguous host view of adjacent VMM mappings `run` (each mapped at offset 0 of its
// allocation, as cuMemMap here requires): a fresh PROT_NONE range with each allocation's memfd
// mapped into it at its place, so a copy writes and reads the allocations' own pages. *hold owns
// it until the copy is done. Returns the view of address p.
char* ViewLocked(std::vector<std::shared_ptr<Alloc>> run, uintptr_t p, std::shared_ptr<Alloc>* hold, std::string* why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  const uintptr_t base = run.front()->base;
  const size_t total = run.back()->base + run.back()->size - base;
  void* v = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (v == MAP_FAILED) {
    *why = std::string("mmap of a view over several mappings: ") + strerror(errno);
    return nullptr;
  }
  auto view = std::make_shared<Alloc>();
  view->alias = static_cast<char*>(v);
  view->mapped = total;
  view->base = base;
  view->size = total;
  view->view = true;
  for (const std::shared_ptr<Alloc>& m : run) {
    void* at = mmap(view->alias + (m->base - base), m->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->vmm_alloc->fd, 0);
    if (at == MAP_FAILED) {
      *why = std::string("mmap of a view over several mappings: ") + strerror(errno);
      return nullptr;  // `view` unmaps the whole range
    }
  }
  view->viewed = std::move(run);
  *hold = view;
  return view->alias + (p - base);
}

// Resolves the device bytes [p, p+n) to the emulator's alias; on failure explains in *why.
char* ResolveLocked(uintptr_t p, size_t n, std::shared_ptr<Alloc>* hold, std::string* why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  std::shared_ptr<Alloc> a = FindLocked(p);
  char buf[256];
  if (a == nullptr) {
    snprintf(buf, sizeof(buf), "[0x%zx, +%zu) is in no live device allocation%s", static_cast<size_t>(p), n,
             InQuarantineLocked(p, n) ? " (it was freed / IPC-closed)" : "");
    *why = buf;
    return nullptr;
  }
  if (!a->accessible) {
    snprintf(buf, sizeof(buf), "[0x%zx, +%zu) is cuMemMap-ped at 0x%zx but no cuMemSetAccess granted a device access",
             static_cast<size_t>(p), n, static_cast<size_t>(a->base));
    *why = buf;
    return nullptr;
  }
  if (p + n > a->base + a->size && a->vmm) {
    // VMM: one reserved range may hold several mappings back to back (PyTorch's expandable
    // segments map one allocation per page), and the GPU copies across them as one range.
    std::vector<std::shared_ptr<Alloc>> run = {a};
    uintptr_t end = a->base + a->size;
    while (end < p + n) {
      auto next = S().allocs.find(end);
      if (next == S().allocs.end() || !next->second->vmm) break;
      if (!next->second->accessible) {
        snprintf(buf, sizeof(buf), "[0x%zx, +%zu) runs into the cuMemMap mapping at 0x%zx, which no cuMemSetAccess made accessible",
                 static_cast<size_t>(p), n, static_cast<size_t>(end));
        *why = buf;
        return nullptr;
      }
      run.push_back(next->second);
      end += next->second->size;
    }
    if (end >= p + n) return ViewLocked(std::move(run), p, hold, why);
  }
  if (p + n > a->base + a->size) {
    snprintf(buf, sizeof(buf), "[0x%zx, +%zu) ends %zu bytes past the end of allocation 0x%zx (%zu bytes%s)",
             static_cast<size_t>(p), n, static_cast<size_t>(p + n - (a->base + a->size)), static_cast<size_t>(a->base),
             a->size, a->opened ? ", IPC-opened" : "");
    *why = buf;
    return nullptr;
  }
  *hold = a;
  return a->alias + (p - a->base);
}

// ---- shm segments and the reaper ----

// Async-signal-safe: runs in a child forked from a possibly multi-threaded process.
[[noreturn]] void ReaperMain(int read_fd, const char* prefix) {
  setsid();  // leave the test's process group: a group kill must not take the reaper first
  struct sigaction ign = {};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGINT, &ign, nullptr);
  sigaction(SIGTERM, &ign, nullptr);
  sigaction(SIGHUP, &ign, nullptr);
  sigaction(SIGPIPE, &ign, nullptr);
  // Keep no inherited descriptor open (pipes of other children would never see EOF).
  if (syscall(SYS_close_range, 0u, static_cast<unsigned>(read_fd) - 1, 0u) != 0 ||
      syscall(SYS_close_range, static_cast<unsigned>(read_fd) + 1, ~0u, 0u) != 0) {
    for (int fd = 0; fd < 4096; ++fd) {
      if (fd != read_fd) close(fd);
    }
  }
  if (chdir("/") != 0) {
  }
  char c;
  while (true) {
    ssize_t r = read(read_fd, &c, 1);
    if (r == 0) break;                 // every write end closed: the owner is gone
    if (r < 0 && errno != EINTR) break;
  }
  const int dir = open("/dev/shm", O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    const size_t plen = strlen(prefix);
    alignas(8) char buf[8192];
    while (true) {
      long n = syscall(SYS_getdents64, dir, buf, sizeof(buf));
      if (n <= 0) break;
      for (long off = 0; off < n;) {
        // struct linux_dirent64: ino (8), off (8), reclen (2), type (1), name.
        unsigned short reclen;
        memcpy(&reclen, buf + off + 16, sizeof(reclen));
        const char* name = buf + off + 19;
        if (strncmp(name, prefix, plen) == 0) unlinkat(dir, name, 0);
        off += reclen;
      }
    }
  }
  _exit(0);
}

// Starts, once per process, a detached process that unlinks this process's segments when it
// dies, also by kill -9 (the conformance suite kills peers mid-transfer).
void StartReaperLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  if (s.reaper_started) return;
  s.reaper_started = true;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    Log("no shm reaper (pipe: %s); segments of a killed process stay in /dev/shm", strerror(errno));
    return;
  }
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "%s", s.prefix.c_str());
  const pid_t child = fork();
  if (child == 0) {
    close(p[1]);
    // Double fork: the reaper is not our child (no zombie, invisible to waitpid(-1)).
    if (fork() == 0) ReaperMain(p[0], prefix);
    _exit(0);
  }
  close(p[0]);
  if (child < 0) {
    close(p[1]);
    Log("no shm reaper (fork: %s)", strerror(errno));
    return;
  }
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  // p[1] stays open (close-on-exec) for the life of the process.
}

void UnlinkOwnedAtExit() {
  State& s = S();
  if (getpid() != s.pid) return;
  if (!s.mu.TryLock()) return;  // a worker holds it; the reaper cleans up
  for (const std::string& n : s.owned_names) shm_unlink(n.c_str());
  s.owned_names.clear();
  s.mu.Unlock();
}

// Maps an allocation: alias (RW, shared) + reservation (PROT_NONE). Takes ownership of fd.
cudaError_t MapAlloc(int fd, size_t size, Alloc* a, const char* api) {
  a->mapped = RoundUp(std::max<size_t>(size, 1), PageSize());
  a->reserved = a->mapped + PageSize();
  void* alias = mmap(nullptr, a->mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (alias == MAP_FAILED) return Fail(cudaErrorMemoryAllocation, api, "mmap of %zu bytes: %s", size, strerror(errno));
  void* res = mmap(nullptr, a->reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (res == MAP_FAILED) {
    munmap(alias, a->mapped);
    return Fail(cudaErrorMemoryAllocation, api, "reserving %zu bytes: %s", a->reserved, strerror(errno));
  }
  a->alias = static_cast<char*>(alias);
  a->base = reinterpret_cast<uintptr_t>(res);
  a->size = size;
  return cudaSuccess;
}

// ---- streams ----

void Worker(std::shared_ptr<Stream> st) {
  State& s = S();
  absl::MutexLock l(&s.mu);
  while (true) {
    auto has_work = [&] { return !st->queue.empty() || st->destroyed; };
    s.mu.Await(absl::Condition(&has_work));
    if (st->queue.empty()) {
      s.streams.erase(st.get());
      return;
    }
    Op op = std::move(st->queue.front());
    st->queue.pop_front();
    for (auto& [dep, seq] : op.deps) {
      Stream* d = dep.get();
      const uint64_t want = seq;
      auto done = [d, want] { return d->completed >= want; };
      s.mu.Await(absl::Condition(&done));
    }
    const int sticky = s.sticky.load();
    s.mu.Unlock();
    if (s.op_delay_us > 0) absl::SleepFor(absl::Microseconds(s.op_delay_us));
    cudaError_t e = sticky != cudaSuccess ? static_cast<cudaError_t>(sticky) : op.fn();
    op.fn = nullptr;  // release captures (allocation references) outside the lock
    s.mu.Lock();
    if (e != cudaSuccess && st->error == cudaSuccess) {
      st->error = e;
      st->error_seq = op.seq;
    }
    st->completed = op.seq;
  }
}

std::shared_ptr<Stream> NewStreamLocked(int device, bool blocking, bool legacy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  auto st = std::make_shared<Stream>();
  st->device = device;
  st->blocking = blocking;
  st->legacy = legacy;
  S().streams[st.get()] = st;
  std::thread(Worker, st).detach();
  return st;
}

std::shared_ptr<Stream> LegacyLocked(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  if (s.legacy.size() < static_cast<size_t>(s.devices)) s.legacy.resize(s.devices);
  if (s.legacy[device] == nullptr) s.legacy[device] = NewStreamLocked(device, true, true);
  return s.legacy[device];
}

// The stream behind a handle: 0 / cudaStreamLegacy = the current device's legacy stream.
std::shared_ptr<Stream> ResolveStreamLocked(cudaStream_t h, cudaError_t* err) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  *err = cudaSuccess;
  if (h == nullptr || h == cudaStreamLegacy) return LegacyLocked(t_device);
  if (h == cudaStreamPerThread) {
    *err = cudaErrorNotSupported;
    return nullptr;
  }
  auto it = S().streams.find(reinterpret_cast<Stream*>(h));
  if (it == S().streams.end() || it->second->destroyed || it->second->legacy) {
    *err = cudaErrorInvalidResourceHandle;
    return nullptr;
  }
  return it->second;
}

// Appends fn to st with the legacy-stream dependencies CUDA implies; returns its sequence number.
uint64_t EnqueueLocked(const std::shared_ptr<Stream>& st, std::function<cudaError_t()> fn)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  Op op;
  op.fn = std::move(fn);
  if (st->legacy) {
    // The legacy stream waits for all work already enqueued on the device's blocking streams.
    for (auto& [ptr, other] : s.streams) {
      if (other != st && other->device == st->device && other->blocking && !other->legacy &&
          other->enqueued > other->completed) {
        op.deps.push_back({other, other->enqueued});
      }
    }
  } else if (st->blocking) {
    // ... and blocking streams wait for the legacy stream's work enqueued before.
    if (static_cast<size_t>(st->device) < s.legacy.size() && s.legacy[st->device] != nullptr) {
      auto& lg = s.legacy[st->device];
      if (lg->enqueued > lg->completed) op.deps.push_back({lg, lg->enqueued});
    }
  }
  op.seq = ++st->enqueued;
  st->queue.push_back(std::move(op));
  return st->enqueued;
}

// Waits (bounded) until st has completed op `seq`; the op's error (or the stream's earlier one).
cudaError_t WaitLocked(const std::shared_ptr<Stream>& st, uint64_t seq, const char* api)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  Stream* p = st.get();
  auto done = [p, seq] { return p->completed >= seq; };
  if (!s.mu.AwaitWithTimeout(absl::Condition(&done), s.sync_timeout)) {
    return Fail(cudaErrorLaunchTimeout, api, "stream work not finished after %s (WB_FAKE_CUDA_SYNC_TIMEOUT_S)",
                absl::FormatDuration(s.sync_timeout).c_str());
  }
  if (st->error != cudaSuccess && st->error_seq <= seq) {
    t_last_error = st->error;
    return st->error;
  }
  const int sticky = s.sticky.load();
  if (sticky != cudaSuccess) {
    t_last_error = static_cast<cudaError_t>(sticky);
    return static_cast<cudaError_t>(sticky);
  }
  return cudaSuccess;
}

// Waits for every stream of `device` (-1: all devices) to drain.
cudaError_t WaitAllLocked(int device, const char* api) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> targets;
  for (auto& [ptr, st] : s.streams) {
    if (device < 0 || st->device == device) targets.push_back({st, st->enqueued});
  }
  cudaError_t first = cudaSuccess;
  for (auto& [st, seq] : targets) {
    cudaError_t e = WaitLocked(st, seq, api);
    if (e == cudaErrorLaunchTimeout) return e;
    if (first == cudaSuccess) first = e;
  }
  return first;
}

// ---- copies ----

enum class Side { kHost, kPinned, kDevice };

struct Copy {
  const char* api = "";
  char* dst = nullptr;
  const char* src = nullptr;
  int64_t dpitch = 0, dslice = 0, spitch = 0, sslice = 0;
  int64_t width = 0, height = 1, depth = 1;
  Side dside = Side::kHost, sside = Side::kHost;
  std::shared_ptr<std::vector<char>> staged;  // pageable source copied at enqueue time
  int64_t span(int64_t pitch, int64_t slice) const { return (depth - 1) * slice + (height - 1) * pitch + width; }
};

cudaError_t Classify(const void* p, int64_t n, Side* side, const char* api, const char* which)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  if (FindLocked(u) != nullptr) {
    *side = Side::kDevice;  // bounds are checked when the copy runs
    return cudaSuccess;
  }
  if (OverlapsDeviceLocked(u, n) || InQuarantineLocked(u, n)) {
    SetSticky(cudaErrorIllegalAddress);
    return Fail(cudaErrorIllegalAddress, api, "%s [%p, +%lld) %s", which, p, static_cast<long long>(n),
                InQuarantineLocked(u, n) ? "lies in device memory that was freed / IPC-closed"
                                         : "starts outside but runs into a device allocation");
  }
  *side = Side::kHost;
  auto& h = S().host;
  auto it = h.upper_bound(u);
  if (it != h.begin()) {
    --it;
    if (u >= it->first && u + n <= it->first + it->second.size) *side = Side::kPinned;
  }
  return cudaSuccess;
}

cudaError_t RunCopy(const Copy& c) {
  State& s = S();
  std::shared_ptr<Alloc> dhold, shold;
  char* d = c.dst;
  const char* src = c.staged ? c.staged->data() : c.src;
  {
    absl::MutexLock l(&s.mu);
    std::string why;
    if (c.dside == Side::kDevice) {
      d = ResolveLocked(reinterpret_cast<uintptr_t>(c.dst), c.span(c.dpitch, c.dslice), &dhold, &why);
      if (d == nullptr) {
        SetSticky(cudaErrorIllegalAddress);
        Log("ILLEGAL ADDRESS in %s: destination %s", c.api, why.c_str());
        return cudaErrorIllegalAddress;
      }
    }
    if (c.sside == Side::kDevice && !c.staged) {
      src = ResolveLocked(reinterpret_cast<uintptr_t>(c.src), c.span(c.spitch, c.sslice), &shold, &why);
      if (src == nullptr) {
        SetSticky(cudaErrorIllegalAddress);
        Log("ILLEGAL ADDRESS in %s: source %s", c.api, why.c_str());
        return cudaErrorIllegalAddress;
      }
    }
  }
  const int64_t sp = c.staged ? c.width : c.spitch;
  const int64_t ss = c.staged ? c.width * c.height : c.sslice;
  for (int64_t z = 0; z < c.depth; ++z) {
    for (int64_t y = 0; y < c.height; ++y) {
      memmove(d + z * c.dslice + y * c.dpitch, src + z * ss + y * sp, c.width);
    }
  }
  return cudaSuccess;
}

bool KindMatches(cudaMemcpyKind kind, Side dst, Side src) {
  const bool dd = dst == Side::kDevice, sd = src == Side::kDevice;
  switch (kind) {
    case cudaMemcpyDefault: return true;
    case cudaMemcpyHostToHost: return !dd && !sd;
    case cudaMemcpyHostToDevice: return dd && !sd;
    case cudaMemcpyDeviceToHost: return !dd && sd;
    case cudaMemcpyDeviceToDevice: return dd && sd;
  }
  return false;
}

// Validates, stages and enqueues a (1/2/3-D) copy with CUDA's host-synchronisation rules (the
// "API synchronization behavior" page of the runtime docs):
//   async (cudaMemcpy*Async): pageable -> device returns once the source was staged; device ->
//     pageable and host -> host return once done; everything else is asynchronous.
//   sync (cudaMemcpy): waits for the copy, except device -> device (CUDA does not wait) and
//     pageable -> device, which returns once the source is staged: "the DMA to final destination
//     may not have completed", so another stream must not read the bytes without synchronising.
cudaError_t SubmitCopy(Copy c, cudaMemcpyKind kind, cudaStream_t stream, bool sync) {
  State& s = S();
  if (c.width == 0 || c.height == 0 || c.depth == 0) return cudaSuccess;
  if (c.width < 0 || c.height < 0 || c.depth < 0) return Fail(cudaErrorInvalidValue, c.api, "negative extent");
  if (c.dst == nullptr || c.src == nullptr) return Fail(cudaErrorInvalidValue, c.api, "null pointer");
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
    return Fail(cudaErrorInvalidMemcpyDirection, c.api, "kind %d", static_cast<int>(kind));
  }
  absl::MutexLock l(&s.mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(stream, &err);
  if (st == nullptr) return Fail(err, c.api, "stream %p is not a live stream of this process", static_cast<void*>(stream));
  if (st->device != t_device) {
    // Stricter than CUDA (which allows it for copies): our code documents that the stream's device
    // is current (cuda_copy.h), and kernels would require it.
    return Fail(cudaErrorInvalidResourceHandle, c.api, "stream of device %d used while device %d is current",
                st->device, t_device);
  }
  if ((err = Classify(c.dst, c.span(c.dpitch, c.dslice), &c.dside, c.api, "destination")) != cudaSuccess) return err;
  if ((err = Classify(c.src, c.span(c.spitch, c.sslice), &c.sside, c.api, "source")) != cudaSuccess) return err;
  if (!KindMatches(kind, c.dside, c.sside)) {
    return Fail(cudaErrorInvalidMemcpyDirection, c.api, "kind %d but destination is %s and source is %s",
                static_cast<int>(kind), c.dside == Side::kDevice ? "device" : "host",
                c.sside == Side::kDevice ? "device" : "host");
  }
  const bool dd = c.dside == Side::kDevice, sd = c.sside == Side::kDevice;
  if (!sd && c.sside == Side::kHost && dd) {
    // Pageable -> device: CUDA copies the source to a staging buffer before returning.
    c.staged = std::make_shared<std::vector<char>>(c.width * c.height * c.depth);
    char* out = c.staged->data();
    for (int64_t z = 0; z < c.depth; ++z) {
      for (int64_t y = 0; y < c.height; ++y) {
        memcpy(out, c.src + z * c.sslice + y * c.spitch, c.width);
        out += c.width;
      }
    }
  }
  const bool wait = sync ? !(dd && sd) && !c.staged : ((!dd && c.dside == Side::kHost && sd) || (!dd && !sd));
  const uint64_t seq = EnqueueLocked(st, [c] { return RunCopy(c); });
  if (!wait) return cudaSuccess;
  return WaitLocked(st, seq, c.api);
}

cudaError_t FakeCuMemGetAddressRangeImpl(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr);

}  // namespace

// ---- the test-facing helpers of fake_cuda.h ----

void* DeviceToHost(const void* dptr, size_t n) {
  State& s = S();
  absl::MutexLock l(&s.mu);
  std::shared_ptr<Alloc> hold;
  std::string why;
  char* h = ResolveLocked(reinterpret_cast<uintptr_t>(dptr), n, &hold, &why);
  // A view over several VMM mappings lives only as long as `hold`: not one allocation's bytes.
  return hold != nullptr && hold->view ? nullptr : h;
}

bool IsDevicePointer(const void* p) {
  State& s = S();
  absl::MutexLock l(&s.mu);
  std::shared_ptr<Alloc> a = FindLocked(reinterpret_cast<uintptr_t>(p));
  return a != nullptr && reinterpret_cast<uintptr_t>(p) < a->base + a->size;
}

void Enqueue(cudaStream_t stream, std::function<cudaError_t()> fn) {
  State& s = S();
  absl::MutexLock l(&s.mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(stream, &err);
  if (st == nullptr) {
    Log("FATAL: wb::fake_cuda::Enqueue on stream %p: %s", static_cast<void*>(stream), cudaGetErrorName(err));
    abort();
  }
  const uint64_t seq = EnqueueLocked(st, std::move(fn));
  if (st->legacy) (void)WaitLocked(st, seq, "wb::fake_cuda::Enqueue");
}

int PhysicalDevice(int device) {
  const State& s = S();
  return device >= 0 && device < static_cast<int>(s.physical.size()) ? s.physical[device] : -1;
}

int StreamDevice(cudaStream_t stream) {
  State& s = S();
  absl::MutexLock l(&s.mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(stream, &err);
  return st == nullptr ? -1 : st->device;
}

namespace {

cudaError_t FakeCuMemGetAddressRangeImpl(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  State& s = S();
  if (getpid() != s.pid) return cudaErrorInitializationError;
  if (s.sticky.load() != cudaSuccess) return cudaErrorIllegalAddress;
  absl::MutexLock l(&s.mu);
  std::shared_ptr<Alloc> a = FindLocked(static_cast<uintptr_t>(dptr));
  if (a == nullptr || dptr >= a->base + a->size) return cudaErrorInvalidValue;
  if (pbase) *pbase = static_cast<CUdeviceptr>(a->base);
  if (psize) *psize = a->size;
  return cudaSuccess;
}

// The emulated driver function handed out by cudaGetDriverEntryPointByVersion.
CUresult FakeCuMemGetAddressRange(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  switch (FakeCuMemGetAddressRangeImpl(pbase, psize, dptr)) {
    case cudaSuccess: return CUDA_SUCCESS;
    case cudaErrorInitializationError: return CUDA_ERROR_NOT_INITIALIZED;
    case cudaErrorIllegalAddress: return CUDA_ERROR_ILLEGAL_ADDRESS;
    default: return CUDA_ERROR_NOT_FOUND;
  }
}
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
static_assert(std::is_same_v<decltype(&FakeCuMemGetAddressRange), GetAddressRangeFn>);

// ---- VMM driver calls (cuMem*), handed out by cudaGetDriverEntryPointByVersion ----

constexpr size_t kVmmGranularity = size_t{2} << 20;  // what current GPUs report (2 MiB)
constexpr char kVmmMemfdPrefix[] = "wbfc-vmm.p";       // memfd name: wbfc-vmm.p<machine device>

const char* CuName(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
    default: return "CUDA_ERROR_(other)";
  }
}

// Driver calls do not touch the runtime's last error; they say why on stderr and return r.
CUresult DFail(CUresult r, const char* api, const char* fmt, ...) {
  char buf[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  Log("%s -> %s: %s", api, CuName(r), buf);
  return r;
}

CUresult DEnter(const char* api) {
  State& s = S();
  if (getpid() != s.pid) return DFail(CUDA_ERROR_NOT_INITIALIZED, api, "CUDA used in a forked child");
  if (s.sticky.load() != cudaSuccess) return CUDA_ERROR_ILLEGAL_ADDRESS;
  return CUDA_SUCCESS;
}

#define FAKE_DENTER(api)                                     \
  do {                                                       \
    if (CUresult r_ = DEnter(api); r_ != CUDA_SUCCESS) return r_; \
  } while (0)

// A pinned device allocation on a device this process sees; *why otherwise.
bool ValidProp(const CUmemAllocationProp* prop, const char** why) {
  if (prop == nullptr) return *why = "null prop", false;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return *why = "type must be CU_MEM_ALLOCATION_TYPE_PINNED", false;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return *why = "location must be a device", false;
  if (prop->location.id < 0 || prop->location.id >= S().devices) return *why = "no such device", false;
  if ((prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0) {
    return *why = "only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (or none) is emulated", false;
  }
  return true;
}

CUresult FakeCuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                           CUmemAllocationGranularity_flags option) {
  FAKE_DENTER("cuMemGetAllocationGranularity");
  const char* why = "";
  if (granularity == nullptr || !ValidProp(prop, &why) ||
      (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) {
    return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity", "%s", granularity == nullptr ? "null out" : why);
  }
  *granularity = kVmmGranularity;
  return CUDA_SUCCESS;
}

CUresult FakeCuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                         unsigned long long flags) {
  FAKE_DENTER("cuMemCreate");
  const char* api = "cuMemCreate";
  const char* why = "";
  if (handle == nullptr || flags != 0 || !ValidProp(prop, &why)) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "%s", handle == nullptr ? "null handle" : flags != 0 ? "flags must be 0" : why);
  }
  if (size == 0 || size % kVmmGranularity != 0) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "size %zu is not a positive multiple of the granularity %zu", size, kVmmGranularity);
  }
  State& s = S();
  const int device = prop->location.id;
  absl::MutexLock l(&s.mu);
  if (s.used[device] + size > s.mem_per_device) {
    return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "%zu bytes on device %d (%zu of %zu in use)", size, device, s.used[device],
                 s.mem_per_device);
  }
  char name[64];
  snprintf(name, sizeof(name), "%s%d", kVmmMemfdPrefix, s.physical[device]);
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "memfd_create: %s", strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "ftruncate(%zu): %s", size, strerror(errno));
  }
  // Fresh device memory is not zeroed on a GPU.
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "mmap(%zu): %s", size, strerror(errno));
  }
  memset(m, 0xA5, size);
  munmap(m, size);
  auto v = std::make_shared<VmmAlloc>();
  v->fd = fd;
  v->size = size;
  v->device = device;
  v->exportable = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
  v->counted = true;
  const uint64_t h = (uint64_t{0x7766} << 32) | ++s.vmm_counter;
  s.vmm[h] = v;
  s.used[device] += size;
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult FakeCuMemRelease(CUmemGenericAllocationHandle handle) {
  FAKE_DENTER("cuMemRelease");
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto it = s.vmm.find(handle);
  if (it == s.vmm.end()) return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemRelease", "handle 0x%llx is not live", handle);
  // As CUDA: the memory stays while mappings of it exist (they hold the pages), the handle dies
  // with its last reference (cuMemRetainAllocationHandle adds one).
  if (--it->second->refs > 0) return CUDA_SUCCESS;
  if (it->second->counted) s.used[it->second->device] -= it->second->size;
  it->second->counted = false;
  s.vmm.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeCuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
  FAKE_DENTER("cuMemAddressReserve");
  const char* api = "cuMemAddressReserve";
  if (ptr == nullptr || flags != 0 || size == 0 || size % kVmmGranularity != 0 ||
      (alignment != 0 && (alignment & (alignment - 1)) != 0)) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "ptr %p size %zu alignment %zu flags %llu", static_cast<void*>(ptr), size,
                 alignment, flags);
  }
  (void)addr;  // a hint; the emulator picks the address
  const size_t align = std::max(alignment, kVmmGranularity);
  void* res = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (res == MAP_FAILED) return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "reserving %zu bytes: %s", size, strerror(errno));
  const uintptr_t base = RoundUp(reinterpret_cast<uintptr_t>(res), align);
  State& s = S();
  absl::MutexLock l(&s.mu);
  s.reservations[base] = size;
  *ptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

// The reservation containing [p, p + n), or reservations.end().
std::map<uintptr_t, size_t>::iterator ReservationLocked(uintptr_t p, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  auto& r = S().reservations;
  auto it = r.upper_bound(p);
  if (it == r.begin()) return r.end();
  --it;
  if (p >= it->first && p + n <= it->first + it->second) return it;
  return r.end();
}

CUresult FakeCuMemAddressFree(CUdeviceptr ptr, size_t size) {
  FAKE_DENTER("cuMemAddressFree");
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto it = s.reservations.find(static_cast<uintptr_t>(ptr));
  if (it == s.reservations.end() || it->second != size) {
    return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree", "[0x%llx, +%zu) is not a reservation", ptr, size);
  }
  if (OverlapsDeviceLocked(it->first, it->second)) {
    return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree", "[0x%llx, +%zu) still has mappings (cuMemUnmap first)", ptr, size);
  }
  // The PROT_NONE range stays reserved (quarantined): a use after free is caught, not reused.
  s.quarantine[it->first] = it->second;
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeCuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags) {
  FAKE_DENTER("cuMemMap");
  const char* api = "cuMemMap";
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto h = s.vmm.find(handle);
  if (h == s.vmm.end()) return DFail(CUDA_ERROR_INVALID_HANDLE, api, "handle 0x%llx is not live", handle);
  if (flags != 0 || offset != 0) return DFail(CUDA_ERROR_INVALID_VALUE, api, "flags and offset must be 0 (offset %zu)", offset);
  if (size == 0 || size % kVmmGranularity != 0 || size > h->second->size) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "size %zu: must be a multiple of %zu and at most the allocation's %zu bytes",
                 size, kVmmGranularity, h->second->size);
  }
  const uintptr_t p = static_cast<uintptr_t>(ptr);
  if (p % kVmmGranularity != 0 || ReservationLocked(p, size) == s.reservations.end()) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "[0x%llx, +%zu) is not aligned inside one cuMemAddressReserve range", ptr, size);
  }
  if (OverlapsDeviceLocked(p, size)) return DFail(CUDA_ERROR_INVALID_VALUE, api, "[0x%llx, +%zu) is already mapped", ptr, size);
  void* alias = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, h->second->fd, 0);
  if (alias == MAP_FAILED) return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "mmap of %zu bytes: %s", size, strerror(errno));
  auto a = std::make_shared<Alloc>();
  a->base = p;
  a->size = size;
  a->reserved = size;
  a->mapped = size;
  a->alias = static_cast<char*>(alias);
  a->device = h->second->device;
  a->vmm = true;
  a->accessible = false;
  a->vmm_handle = handle;
  a->vmm_alloc = h->second;
  for (auto q = s.quarantine.lower_bound(p); q != s.quarantine.end() && q->first < p + size;) q = s.quarantine.erase(q);
  s.allocs[p] = a;
  return CUDA_SUCCESS;
}

// The mappings that exactly tile [p, p + n) (in address order), or empty.
std::vector<std::shared_ptr<Alloc>> TilingLocked(uintptr_t p, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  std::vector<std::shared_ptr<Alloc>> out;
  uintptr_t at = p;
  while (at < p + n) {
    auto it = S().allocs.find(at);
    if (it == S().allocs.end() || !it->second->vmm || at + it->second->size > p + n) return {};
    out.push_back(it->second);
    at += it->second->size;
  }
  return out;
}

CUresult FakeCuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  FAKE_DENTER("cuMemSetAccess");
  const char* api = "cuMemSetAccess";
  State& s = S();
  if (desc == nullptr || count == 0) return DFail(CUDA_ERROR_INVALID_VALUE, api, "no access descriptors");
  bool grant = false;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 || desc[i].location.id >= s.devices) {
      return DFail(CUDA_ERROR_INVALID_DEVICE, api, "descriptor %zu: not a device of this process", i);
    }
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
      return DFail(CUDA_ERROR_INVALID_VALUE, api, "descriptor %zu: flags %d", i, static_cast<int>(desc[i].flags));
    }
    grant |= desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  absl::MutexLock l(&s.mu);
  std::vector<std::shared_ptr<Alloc>> maps = TilingLocked(static_cast<uintptr_t>(ptr), size);
  if (maps.empty()) return DFail(CUDA_ERROR_INVALID_VALUE, api, "[0x%llx, +%zu) is not fully mapped by cuMemMap", ptr, size);
  // Emulated as one switch: read-write for some device makes the bytes usable by copies (peer
  // access between emulated devices is not modelled).
  for (auto& a : maps) a->accessible = grant;
  return CUDA_SUCCESS;
}

CUresult FakeCuMemUnmap(CUdeviceptr ptr, size_t size) {
  FAKE_DENTER("cuMemUnmap");
  State& s = S();
  absl::MutexLock l(&s.mu);
  std::vector<std::shared_ptr<Alloc>> maps = TilingLocked(static_cast<uintptr_t>(ptr), size);
  if (maps.empty()) return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap", "[0x%llx, +%zu) is not whole cuMemMap mappings", ptr, size);
  // No implicit synchronisation (as cudaIpcCloseMemHandle here): a copy still queued on these
  // bytes faults when it runs; one running now keeps the alias alive until it finishes.
  for (auto& a : maps) {
    s.quarantine[a->base] = a->size;
    s.allocs.erase(a->base);
  }
  return CUDA_SUCCESS;
}

CUresult FakeCuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType type,
                                          unsigned long long flags) {
  FAKE_DENTER("cuMemExportToShareableHandle");
  const char* api = "cuMemExportToShareableHandle";
  if (shareable == nullptr || flags != 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR with flags 0 is emulated");
  }
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto h = s.vmm.find(handle);
  if (h == s.vmm.end()) return DFail(CUDA_ERROR_INVALID_VALUE, api, "handle 0x%llx is not live", handle);
  if (!h->second->exportable) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api,
                 "handle 0x%llx was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes", handle);
  }
  const int fd = fcntl(h->second->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "dup: %s", strerror(errno));
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

CUresult FakeCuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle, CUmemAllocationHandleType type) {
  FAKE_DENTER("cuMemImportFromShareableHandle");
  const char* api = "cuMemImportFromShareableHandle";
  if (handle == nullptr || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR is emulated");
  }
  const int in = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  struct stat st;
  if (in < 0 || fstat(in, &st) != 0) return DFail(CUDA_ERROR_INVALID_VALUE, api, "fd %d: %s", in, strerror(errno));
  char link[256];
  char path[64];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", in);
  const ssize_t n = readlink(path, link, sizeof(link) - 1);
  link[n < 0 ? 0 : n] = '\0';
  const size_t plen = strlen("/memfd:") + strlen(kVmmMemfdPrefix);
  if (n < 0 || strncmp(link, "/memfd:", 7) != 0 || strncmp(link + 7, kVmmMemfdPrefix, strlen(kVmmMemfdPrefix)) != 0) {
    return DFail(CUDA_ERROR_INVALID_VALUE, api, "fd %d (%s) is not an exported allocation of this emulator", in, link);
  }
  const int physical = atoi(link + plen);
  State& s = S();
  absl::MutexLock l(&s.mu);
  const auto local = std::find(s.physical.begin(), s.physical.end(), physical);
  if (local == s.physical.end()) {
    return DFail(CUDA_ERROR_INVALID_DEVICE, api, "the allocation lives on device %d of the machine, not visible to this process", physical);
  }
  const int fd = fcntl(in, F_DUPFD_CLOEXEC, 0);  // the caller keeps (and closes) its descriptor
  if (fd < 0) return DFail(CUDA_ERROR_OUT_OF_MEMORY, api, "dup: %s", strerror(errno));
  auto v = std::make_shared<VmmAlloc>();
  v->fd = fd;
  v->size = static_cast<size_t>(st.st_size);
  v->device = static_cast<int>(local - s.physical.begin());
  v->imported = true;
  v->exportable = true;
  const uint64_t h = (uint64_t{0x7766} << 32) | ++s.vmm_counter;
  s.vmm[h] = v;
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult FakeCuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  FAKE_DENTER("cuMemRetainAllocationHandle");
  State& s = S();
  absl::MutexLock l(&s.mu);
  std::shared_ptr<Alloc> a = FindLocked(reinterpret_cast<uintptr_t>(addr));
  if (handle == nullptr || a == nullptr || !a->vmm || reinterpret_cast<uintptr_t>(addr) >= a->base + a->size) {
    return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemRetainAllocationHandle", "%p is not inside a cuMemMap mapping", addr);
  }
  // As CUDA: the handle value that was mapped there, one more reference (released by cuMemRelease),
  // also when the creator released its own already (the mapping holds the memory).
  auto it = s.vmm.find(a->vmm_handle);
  if (it != s.vmm.end()) {
    ++it->second->refs;
  } else {
    a->vmm_alloc->refs = 1;
    s.vmm[a->vmm_handle] = a->vmm_alloc;
  }
  *handle = a->vmm_handle;
  return CUDA_SUCCESS;
}

CUresult FakeCuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  FAKE_DENTER("cuMemGetAllocationPropertiesFromHandle");
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto h = s.vmm.find(handle);
  if (prop == nullptr || h == s.vmm.end()) {
    return DFail(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationPropertiesFromHandle", "handle 0x%llx is not live", handle);
  }
  memset(prop, 0, sizeof(*prop));
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = h->second->device;
  prop->requestedHandleTypes = h->second->exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return CUDA_SUCCESS;
}

// ---- memory pools (stream-ordered allocator): each device's default pool only ----

// The opaque cudaMemPool_t / CUmemoryPool of device `d` (this process's ordinal): the address of
// the d-th byte of a static array, never dereferenced by anyone.
char g_pool_tags[64];
cudaMemPool_t DefaultPool(int d) { return reinterpret_cast<cudaMemPool_t>(&g_pool_tags[d]); }
// The device whose default pool `pool` is, or -1 (no other pool exists: cudaMemPoolCreate is not emulated).
int PoolDevice(cudaMemPool_t pool) {
  const char* p = reinterpret_cast<const char*>(pool);
  if (p < g_pool_tags || p >= g_pool_tags + S().devices) return -1;
  return static_cast<int>(p - g_pool_tags);
}

// cuPointerGetAttribute: the two attributes that tell memory legacy CUDA IPC can export
// (cudaIpcGetMemHandle) from memory it cannot, for the pointers the emulator knows:
//   CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int*)data = 1 for this process's own
//     cudaMalloc memory, 0 for stream-ordered pool memory (cudaMallocAsync), cuMemMap mappings,
//     IPC imports and pinned host memory - exactly the memory cudaIpcGetMemHandle here refuses.
//     The driver documents "a boolean"; it is written as an int, as NCCL reads it (`int
//     legacyIpcCap = 0`): callers pass a zeroed int.
//   CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(CUmemoryPool*)data = the pool the memory came from (the
//     device's default pool, cudaDeviceGetDefaultMemPool), NULL for memory from no pool.
// A pointer in no live device allocation and no pinned host range: CUDA_ERROR_INVALID_VALUE (as
// the driver answers for memory it does not know); any other attribute: CUDA_ERROR_NOT_SUPPORTED
// with a line saying it is not emulated (the real driver answers them).
CUresult FakeCuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  FAKE_DENTER("cuPointerGetAttribute");
  const char* api = "cuPointerGetAttribute";
  if (attribute != CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE && attribute != CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE) {
    return DFail(CUDA_ERROR_NOT_SUPPORTED, api,
                 "attribute %d is not emulated (only CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = %d and "
                 "CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = %d are)",
                 static_cast<int>(attribute), static_cast<int>(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE),
                 static_cast<int>(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE));
  }
  if (data == nullptr) return DFail(CUDA_ERROR_INVALID_VALUE, api, "null data");
  State& s = S();
  absl::MutexLock l(&s.mu);
  const uintptr_t u = static_cast<uintptr_t>(ptr);
  bool capable = false;
  cudaMemPool_t pool = nullptr;
  std::shared_ptr<Alloc> a = FindLocked(u);
  if (a != nullptr && u < a->base + a->size) {
    capable = !a->opened && !a->vmm && !a->pool;
    pool = a->pool ? DefaultPool(a->device) : nullptr;
  } else {
    auto it = s.host.upper_bound(u);
    const bool pinned = it != s.host.begin() && u >= std::prev(it)->first && u < std::prev(it)->first + std::prev(it)->second.size;
    if (!pinned) {
      return DFail(CUDA_ERROR_INVALID_VALUE, api, "0x%llx is neither device memory of this process nor pinned host memory%s", ptr,
                   InQuarantineLocked(u, 1) ? " (it was freed / unmapped / IPC-closed)" : "");
    }
  }
  if (attribute == CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) {
    *static_cast<int*>(data) = capable ? 1 : 0;
  } else {
    *static_cast<CUmemoryPool*>(data) = reinterpret_cast<CUmemoryPool>(pool);
  }
  return CUDA_SUCCESS;
}

// The driver symbols cudaGetDriverEntryPointByVersion hands out (all exist since CUDA 10.2).
struct DriverSymbol {
  const char* name;
  void* fn;
  unsigned min_version;
};
const DriverSymbol kDriverSymbols[] = {
    {"cuMemGetAddressRange", reinterpret_cast<void*>(&FakeCuMemGetAddressRange), 3020},
    {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&FakeCuMemGetAllocationGranularity), 10020},
    {"cuMemCreate", reinterpret_cast<void*>(&FakeCuMemCreate), 10020},
    {"cuMemRelease", reinterpret_cast<void*>(&FakeCuMemRelease), 10020},
    {"cuMemAddressReserve", reinterpret_cast<void*>(&FakeCuMemAddressReserve), 10020},
    {"cuMemAddressFree", reinterpret_cast<void*>(&FakeCuMemAddressFree), 10020},
    {"cuMemMap", reinterpret_cast<void*>(&FakeCuMemMap), 10020},
    {"cuMemUnmap", reinterpret_cast<void*>(&FakeCuMemUnmap), 10020},
    {"cuMemSetAccess", reinterpret_cast<void*>(&FakeCuMemSetAccess), 10020},
    {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&FakeCuMemExportToShareableHandle), 10020},
    {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&FakeCuMemImportFromShareableHandle), 10020},
    {"cuMemGetAllocationPropertiesFromHandle", reinterpret_cast<void*>(&FakeCuMemGetAllocationPropertiesFromHandle), 10020},
    {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&FakeCuMemRetainAllocationHandle), 11000},
    {"cuPointerGetAttribute", reinterpret_cast<void*>(&FakeCuPointerGetAttribute), 4000},
};
// Signatures must match the driver's (a mismatch would be undefined behaviour for callers).
static_assert(std::is_same_v<decltype(&FakeCuMemCreate), decltype(&::cuMemCreate)>);
static_assert(std::is_same_v<decltype(&FakeCuMemMap), decltype(&::cuMemMap)>);
static_assert(std::is_same_v<decltype(&FakeCuMemSetAccess), decltype(&::cuMemSetAccess)>);
static_assert(std::is_same_v<decltype(&FakeCuMemAddressReserve), decltype(&::cuMemAddressReserve)>);
static_assert(std::is_same_v<decltype(&FakeCuMemExportToShareableHandle), decltype(&::cuMemExportToShareableHandle)>);
static_assert(std::is_same_v<decltype(&FakeCuMemImportFromShareableHandle), decltype(&::cuMemImportFromShareableHandle)>);
static_assert(std::is_same_v<decltype(&FakeCuMemGetAllocationGranularity), decltype(&::cuMemGetAllocationGranularity)>);
static_assert(std::is_same_v<decltype(&FakeCuMemGetAllocationPropertiesFromHandle),
                             decltype(&::cuMemGetAllocationPropertiesFromHandle)>);
static_assert(std::is_same_v<decltype(&FakeCuMemUnmap), decltype(&::cuMemUnmap)>);
static_assert(std::is_same_v<decltype(&FakeCuMemRelease), decltype(&::cuMemRelease)>);
static_assert(std::is_same_v<decltype(&FakeCuMemAddressFree), decltype(&::cuMemAddressFree)>);
static_assert(std::is_same_v<decltype(&FakeCuMemRetainAllocationHandle), decltype(&::cuMemRetainAllocationHandle)>);
static_assert(std::is_same_v<decltype(&FakeCuPointerGetAttribute), decltype(&::cuPointerGetAttribute)>);

}  // namespace
}  // namespace wb::fake_cuda

// ============================ the CUDA runtime API ============================

using namespace wb::fake_cuda;  // NOLINT: the definitions below are the C API
using wb::fake_cuda::S;

// ---- errors ----

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
#define WB_FC_NAME(x) \
  case x:             \
    return #x;
    WB_FC_NAME(cudaSuccess)
    WB_FC_NAME(cudaErrorInvalidValue)
    WB_FC_NAME(cudaErrorMemoryAllocation)
    WB_FC_NAME(cudaErrorInitializationError)
    WB_FC_NAME(cudaErrorInvalidPitchValue)
    WB_FC_NAME(cudaErrorInvalidDevicePointer)
    WB_FC_NAME(cudaErrorInvalidMemcpyDirection)
    WB_FC_NAME(cudaErrorNoDevice)
    WB_FC_NAME(cudaErrorInvalidDevice)
    WB_FC_NAME(cudaErrorDeviceUninitialized)
    WB_FC_NAME(cudaErrorMapBufferObjectFailed)
    WB_FC_NAME(cudaErrorAlreadyMapped)
    WB_FC_NAME(cudaErrorInvalidResourceHandle)
    WB_FC_NAME(cudaErrorSymbolNotFound)
    WB_FC_NAME(cudaErrorNotReady)
    WB_FC_NAME(cudaErrorIllegalAddress)
    WB_FC_NAME(cudaErrorLaunchTimeout)
    WB_FC_NAME(cudaErrorHostMemoryAlreadyRegistered)
    WB_FC_NAME(cudaErrorHostMemoryNotRegistered)
    WB_FC_NAME(cudaErrorLaunchFailure)
    WB_FC_NAME(cudaErrorNotSupported)
    WB_FC_NAME(cudaErrorNotPermitted)
    WB_FC_NAME(cudaErrorInsufficientDriver)
    WB_FC_NAME(cudaErrorTimeout)
    WB_FC_NAME(cudaErrorUnknown)
#undef WB_FC_NAME
    default: return "cudaErrorUnrecognized";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorDeviceUninitialized: return "invalid device context";
    case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed";
    case cudaErrorAlreadyMapped: return "resource already mapped";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorSymbolNotFound: return "named symbol not found";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorNotPermitted: return "operation not permitted";
    case cudaErrorTimeout: return "wait operation timed out";
    default: return "unrecognized error code";
  }
}

cudaError_t cudaGetLastError(void) {
  (void)S();
  const int sticky = S().sticky.load();
  if (sticky != cudaSuccess && getpid() == S().pid) return static_cast<cudaError_t>(sticky);
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  const int sticky = S().sticky.load();
  if (sticky != cudaSuccess && getpid() == S().pid) return static_cast<cudaError_t>(sticky);
  return t_last_error;
}

// ---- versions and devices ----

cudaError_t cudaRuntimeGetVersion(int* v) {
  if (v == nullptr) return Fail(cudaErrorInvalidValue, "cudaRuntimeGetVersion", "null");
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (v == nullptr) return Fail(cudaErrorInvalidValue, "cudaDriverGetVersion", "null");
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* n) {
  FAKE_ENTER("cudaGetDeviceCount");
  if (n == nullptr) return Fail(cudaErrorInvalidValue, "cudaGetDeviceCount", "null");
  *n = S().devices;
  if (*n == 0) return Fail(cudaErrorNoDevice, "cudaGetDeviceCount", "WB_FAKE_CUDA_DEVICES=0");
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
  FAKE_ENTER("cudaSetDevice");
  if (S().devices == 0) return Fail(cudaErrorNoDevice, "cudaSetDevice", "no device");
  if (d < 0 || d >= S().devices) return Fail(cudaErrorInvalidDevice, "cudaSetDevice", "device %d of %d", d, S().devices);
  t_device = d;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
  FAKE_ENTER("cudaGetDevice");
  if (d == nullptr) return Fail(cudaErrorInvalidValue, "cudaGetDevice", "null");
  if (S().devices == 0) return Fail(cudaErrorNoDevice, "cudaGetDevice", "no device");
  *d = t_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int d) {
  FAKE_ENTER("cudaGetDeviceProperties");
  if (prop == nullptr) return Fail(cudaErrorInvalidValue, "cudaGetDeviceProperties", "null");
  if (d < 0 || d >= S().devices) return Fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties", "device %d", d);
  memset(prop, 0, sizeof(*prop));
  snprintf(prop->name, sizeof(prop->name), "WeightBridge fake CUDA device %d (CPU emulation, tests/fake_cuda)", d);
  // Deterministic per device of the machine, so every process sees the same UUID for a device
  // whatever its CUDA_VISIBLE_DEVICES (cuda_ipc matches on them).
  uint64_t x = 0x57424643554441ull + static_cast<uint64_t>(S().physical[d]) * 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 16; ++i) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    prop->uuid.bytes[i] = static_cast<char>(x >> 56);
  }
  prop->totalGlobalMem = S().mem_per_device;
  prop->memPitch = static_cast<size_t>(wb::fake_cuda::kMaxPitch);
  prop->major = 9;
  prop->minor = 0;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->multiProcessorCount = 1;
  prop->asyncEngineCount = 2;
  prop->unifiedAddressing = 1;
  prop->canMapHostMemory = 1;
  prop->pciBusID = d + 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  FAKE_ENTER("cudaDeviceSynchronize");
  absl::MutexLock l(&S().mu);
  return WaitAllLocked(t_device, "cudaDeviceSynchronize");
}

// ---- device memory ----

namespace wb::fake_cuda {
namespace {

// A new device allocation of `size` bytes on `device` (a POSIX shm segment, see fake_cuda.h);
// `pool`: stream-ordered memory of the device's default pool (cudaMallocAsync).
cudaError_t AllocateLocked(int device, size_t size, bool pool, const char* api, void** p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  if (s.used[device] + size > s.mem_per_device) {
    return Fail(cudaErrorMemoryAllocation, api, "%zu bytes on device %d (%zu of %zu in use)", size, device, s.used[device],
                s.mem_per_device);
  }
  StartReaperLocked();
  char name[64];
  snprintf(name, sizeof(name), "/%s%llu", s.prefix.c_str(), static_cast<unsigned long long>(++s.counter));
  const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Fail(cudaErrorMemoryAllocation, api, "shm_open(%s): %s", name, strerror(errno));
  auto a = std::make_shared<Alloc>();
  const size_t mapped = RoundUp(size, PageSize());
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    close(fd);
    shm_unlink(name);
    return Fail(cudaErrorMemoryAllocation, api, "ftruncate(%s, %zu): %s", name, mapped, strerror(errno));
  }
  if (cudaError_t e = MapAlloc(fd, size, a.get(), api); e != cudaSuccess) {
    shm_unlink(name);
    return e;
  }
  // Fresh device memory is not zeroed on a GPU; code must not rely on it.
  memset(a->alias, 0xA5, size);
  a->device = device;
  a->pool = pool;
  a->shm_name = name;
  s.allocs[a->base] = a;
  s.owned_names.push_back(name);
  s.used[device] += size;
  *p = reinterpret_cast<void*>(a->base);
  return cudaSuccess;
}

// The live own allocation (cudaMalloc or pool memory) based at `p` with no free under way, or null
// after recording why not (cudaErrorInvalidValue, as CUDA answers a bad free).
std::shared_ptr<Alloc> FreeableLocked(void* p, const char* api) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocs.find(u);
  if (it == s.allocs.end() || it->second->opened || it->second->vmm || it->second->free_pending) {
    const bool freed = InQuarantineLocked(u, 1);
    Fail(cudaErrorInvalidValue, api, "%p is %s", p,
         it != s.allocs.end() ? (it->second->vmm      ? "a cuMemMap mapping (use cuMemUnmap)"
                                 : it->second->opened ? "an IPC mapping (use cudaIpcCloseMemHandle)"
                                                      : "already being freed (a cudaFree / cudaFreeAsync of it is under way)")
         : freed              ? "already freed / closed"
         : FindLocked(u)      ? "inside an allocation, not its base"
                              : "not a device allocation");
    return nullptr;
  }
  return it->second;
}

// Frees an own allocation: its reservation stays (a use after free is caught, not reused), the
// segment is unlinked (importers keep their mappings, as with CUDA).
void ReleaseLocked(const std::shared_ptr<Alloc>& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(S().mu) {
  State& s = S();
  auto it = s.allocs.find(a->base);
  if (it == s.allocs.end() || it->second != a) return;
  s.allocs.erase(it);
  s.quarantine[a->base] = a->reserved;
  shm_unlink(a->shm_name.c_str());
  s.owned_names.erase(std::remove(s.owned_names.begin(), s.owned_names.end(), a->shm_name), s.owned_names.end());
  s.used[a->device] -= a->size;
}

}  // namespace
}  // namespace wb::fake_cuda

cudaError_t cudaMalloc(void** p, size_t size) {
  FAKE_ENTER("cudaMalloc");
  State& s = S();
  if (p == nullptr) return Fail(cudaErrorInvalidValue, "cudaMalloc", "null devPtr");
  if (s.devices == 0) return Fail(cudaErrorNoDevice, "cudaMalloc", "no device");
  if (size == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  absl::MutexLock l(&s.mu);
  return AllocateLocked(t_device, size, /*pool=*/false, "cudaMalloc", p);
}

// Frees cudaMalloc memory, and pool memory too (CUDA allows cudaFree on cudaMallocAsync memory).
cudaError_t cudaFree(void* p) {
  FAKE_ENTER("cudaFree");
  if (p == nullptr) return cudaSuccess;
  State& s = S();
  absl::MutexLock l(&s.mu);
  std::shared_ptr<Alloc> a = FreeableLocked(p, "cudaFree");
  if (a == nullptr) return cudaErrorInvalidValue;
  // cudaFree synchronises the device: queued work on this memory finishes first.
  a->free_pending = true;
  if (cudaError_t e = WaitAllLocked(-1, "cudaFree"); e == cudaErrorLaunchTimeout) {
    a->free_pending = false;
    return e;
  }
  ReleaseLocked(a);
  return cudaSuccess;
}

// ---- the stream-ordered allocator (memory pools): each device's default pool ----
//
// The allocation is usable at once (the emulation does not check a use on another stream before
// the allocating stream reached it); cudaFreeAsync frees when the stream reaches the free, so work
// queued before it on that stream still sees the bytes and later work faults (illegal address).

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  FAKE_ENTER("cudaDeviceGetDefaultMemPool");
  if (pool == nullptr) return Fail(cudaErrorInvalidValue, "cudaDeviceGetDefaultMemPool", "null memPool");
  if (device < 0 || device >= S().devices) {
    return Fail(cudaErrorInvalidDevice, "cudaDeviceGetDefaultMemPool", "device %d of %d", device, S().devices);
  }
  *pool = wb::fake_cuda::DefaultPool(device);
  return cudaSuccess;
}

namespace wb::fake_cuda {
namespace {

// cudaMallocAsync / cudaMallocFromPoolAsync: `device` < 0 means the stream's device.
cudaError_t MallocAsync(void** p, size_t size, int device, cudaStream_t stream, const char* api) {
  State& s = S();
  if (p == nullptr) return Fail(cudaErrorInvalidValue, api, "null devPtr");
  if (s.devices == 0) return Fail(cudaErrorNoDevice, api, "no device");
  absl::MutexLock l(&s.mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(stream, &err);
  if (st == nullptr) return Fail(err, api, "stream %p is not a live stream of this process", static_cast<void*>(stream));
  if (size == 0) {  // as cudaMalloc
    *p = nullptr;
    return cudaSuccess;
  }
  return AllocateLocked(device < 0 ? st->device : device, size, /*pool=*/true, api, p);
}

}  // namespace
}  // namespace wb::fake_cuda

cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t stream) {
  FAKE_ENTER("cudaMallocAsync");
  // "The allocation comes from the memory pool associated with the stream's device."
  return wb::fake_cuda::MallocAsync(p, size, -1, stream, "cudaMallocAsync");
}

cudaError_t cudaMallocFromPoolAsync(void** p, size_t size, cudaMemPool_t pool, cudaStream_t stream) {
  FAKE_ENTER("cudaMallocFromPoolAsync");
  const int device = wb::fake_cuda::PoolDevice(pool);
  if (device < 0) {
    return Fail(cudaErrorInvalidValue, "cudaMallocFromPoolAsync",
                "%p is not a memory pool of this emulator (only each device's default pool, cudaDeviceGetDefaultMemPool)",
                static_cast<void*>(pool));
  }
  return wb::fake_cuda::MallocAsync(p, size, device, stream, "cudaMallocFromPoolAsync");
}

// Frees pool memory, and cudaMalloc memory too (CUDA allows both), when `stream` reaches the free.
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  FAKE_ENTER("cudaFreeAsync");
  if (p == nullptr) return cudaSuccess;  // as cudaFree
  State& s = S();
  absl::MutexLock l(&s.mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(stream, &err);
  if (st == nullptr) return Fail(err, "cudaFreeAsync", "stream %p is not a live stream of this process", static_cast<void*>(stream));
  std::shared_ptr<Alloc> a = FreeableLocked(p, "cudaFreeAsync");
  if (a == nullptr) return cudaErrorInvalidValue;
  a->free_pending = true;
  wb::fake_cuda::EnqueueLocked(st, [a] {
    absl::MutexLock l2(&S().mu);
    wb::fake_cuda::ReleaseLocked(a);
    return cudaSuccess;
  });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t n) {
  FAKE_ENTER("cudaMemset");
  if (n == 0) return cudaSuccess;
  State& s = S();
  absl::MutexLock l(&s.mu);
  if (FindLocked(reinterpret_cast<uintptr_t>(p)) == nullptr) {
    return Fail(cudaErrorInvalidValue, "cudaMemset", "%p is not device memory", p);
  }
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(nullptr, &err);
  // Asynchronous for device memory, as CUDA documents: ordered on the legacy stream only.
  EnqueueLocked(st, [p, value, n] {
    std::shared_ptr<Alloc> hold;
    std::string why;
    char* h;
    {
      absl::MutexLock l2(&S().mu);
      h = ResolveLocked(reinterpret_cast<uintptr_t>(p), n, &hold, &why);
    }
    if (h == nullptr) {
      SetSticky(cudaErrorIllegalAddress);
      Log("ILLEGAL ADDRESS in cudaMemset: %s", why.c_str());
      return cudaErrorIllegalAddress;
    }
    memset(h, value & 0xff, n);
    return cudaSuccess;
  });
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  FAKE_ENTER("cudaPointerGetAttributes");
  if (attr == nullptr) return Fail(cudaErrorInvalidValue, "cudaPointerGetAttributes", "null attributes");
  State& s = S();
  absl::MutexLock l(&s.mu);
  memset(attr, 0, sizeof(*attr));
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  std::shared_ptr<Alloc> a = FindLocked(u);
  if (a != nullptr && u < a->base + a->size) {
    attr->type = cudaMemoryTypeDevice;
    attr->device = a->device;
    attr->devicePointer = const_cast<void*>(p);
    return cudaSuccess;
  }
  auto it = s.host.upper_bound(u);
  if (it != s.host.begin()) {
    --it;
    if (u >= it->first && u < it->first + it->second.size) {
      attr->type = cudaMemoryTypeHost;
      attr->device = t_device;
      attr->devicePointer = const_cast<void*>(p);
      attr->hostPointer = const_cast<void*>(p);
      return cudaSuccess;
    }
  }
  attr->type = cudaMemoryTypeUnregistered;
  attr->device = -2;
  return cudaSuccess;
}

// ---- host memory ----

cudaError_t cudaHostRegister(void* p, size_t size, unsigned int flags) {
  FAKE_ENTER("cudaHostRegister");
  const unsigned known = cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterIoMemory |
                         cudaHostRegisterReadOnly;
  if (p == nullptr || size == 0 || (flags & ~known) != 0) {
    return Fail(cudaErrorInvalidValue, "cudaHostRegister", "ptr %p size %zu flags 0x%x", p, size, flags);
  }
  State& s = S();
  absl::MutexLock l(&s.mu);
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  if (FindLocked(u) != nullptr || OverlapsDeviceLocked(u, size)) {
    return Fail(cudaErrorInvalidValue, "cudaHostRegister", "%p is device memory", p);
  }
  // The pages must exist (CUDA pins them): madvise fails with ENOMEM on unmapped ranges.
  const uintptr_t lo = u / PageSize() * PageSize();
  if (madvise(reinterpret_cast<void*>(lo), RoundUp(u + size - lo, PageSize()), MADV_NORMAL) != 0) {
    return Fail(cudaErrorInvalidValue, "cudaHostRegister", "[%p, +%zu) is not mapped memory", p, size);
  }
  auto it = s.host.upper_bound(u + size - 1);
  if (it != s.host.begin()) {
    --it;
    if (u < it->first + it->second.size) {
      return Fail(cudaErrorHostMemoryAlreadyRegistered, "cudaHostRegister", "[%p, +%zu) overlaps a registered range",
                  p, size);
    }
  }
  s.host[u] = {size, false};
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* p) {
  FAKE_ENTER("cudaHostUnregister");
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto it = s.host.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.host.end() || it->second.from_malloc_host) {
    return Fail(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister", "%p is not the start of a registered range", p);
  }
  s.host.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t size) {
  FAKE_ENTER("cudaMallocHost");
  if (p == nullptr) return Fail(cudaErrorInvalidValue, "cudaMallocHost", "null ptr");
  if (size == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return Fail(cudaErrorMemoryAllocation, "cudaMallocHost", "%zu bytes", size);
  State& s = S();
  absl::MutexLock l(&s.mu);
  s.host[reinterpret_cast<uintptr_t>(m)] = {size, true};
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  FAKE_ENTER("cudaFreeHost");
  if (p == nullptr) return cudaSuccess;
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto it = s.host.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.host.end() || !it->second.from_malloc_host) {
    return Fail(cudaErrorInvalidValue, "cudaFreeHost", "%p is not from cudaMallocHost", p);
  }
  if (cudaError_t e = WaitAllLocked(-1, "cudaFreeHost"); e == cudaErrorLaunchTimeout) return e;
  munmap(p, it->second.size);
  s.host.erase(it);
  return cudaSuccess;
}

// ---- copies ----

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  FAKE_ENTER("cudaMemcpy");
  Copy c;
  c.api = "cudaMemcpy";
  c.dst = static_cast<char*>(dst);
  c.src = static_cast<const char*>(src);
  c.width = static_cast<int64_t>(n);
  return SubmitCopy(c, kind, nullptr, /*sync=*/true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
  FAKE_ENTER("cudaMemcpyAsync");
  Copy c;
  c.api = "cudaMemcpyAsync";
  c.dst = static_cast<char*>(dst);
  c.src = static_cast<const char*>(src);
  c.width = static_cast<int64_t>(n);
  return SubmitCopy(c, kind, stream, false);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
  FAKE_ENTER("cudaMemcpy2DAsync");
  if (width > 0 && height > 0) {
    if (width > dpitch || width > spitch) {
      return Fail(cudaErrorInvalidPitchValue, "cudaMemcpy2DAsync", "width %zu > pitch (dst %zu, src %zu)", width,
                  dpitch, spitch);
    }
    if (dpitch > static_cast<size_t>(kMaxPitch) || spitch > static_cast<size_t>(kMaxPitch)) {
      return Fail(cudaErrorInvalidPitchValue, "cudaMemcpy2DAsync", "pitch above the device maximum %lld",
                  static_cast<long long>(kMaxPitch));
    }
  }
  Copy c;
  c.api = "cudaMemcpy2DAsync";
  c.dst = static_cast<char*>(dst);
  c.src = static_cast<const char*>(src);
  c.dpitch = static_cast<int64_t>(dpitch);
  c.spitch = static_cast<int64_t>(spitch);
  c.width = static_cast<int64_t>(width);
  c.height = static_cast<int64_t>(height);
  return SubmitCopy(c, kind, stream, false);
}

cudaError_t cudaMemcpy3DAsync(const cudaMemcpy3DParms* p, cudaStream_t stream) {
  FAKE_ENTER("cudaMemcpy3DAsync");
  const char* api = "cudaMemcpy3DAsync";
  if (p == nullptr) return Fail(cudaErrorInvalidValue, api, "null parameters");
  if (p->srcArray != nullptr || p->dstArray != nullptr) {
    return Fail(cudaErrorNotSupported, api, "CUDA arrays are not emulated (only pitched linear memory)");
  }
  const cudaExtent& e = p->extent;
  if (e.width == 0 || e.height == 0 || e.depth == 0) return cudaSuccess;
  // Linear memory: extent.width and pos.x are in bytes; slice z starts at z * pitch * ysize.
  for (const auto* side : {&p->srcPtr, &p->dstPtr}) {
    const cudaPos& pos = side == &p->srcPtr ? p->srcPos : p->dstPos;
    if (side->ptr == nullptr) return Fail(cudaErrorInvalidValue, api, "null pitched pointer");
    if (pos.x + e.width > side->pitch) {
      return Fail(cudaErrorInvalidPitchValue, api, "%s pos.x %zu + width %zu > pitch %zu",
                  side == &p->srcPtr ? "src" : "dst", pos.x, e.width, side->pitch);
    }
    if (side->pitch > static_cast<size_t>(kMaxPitch)) {
      return Fail(cudaErrorInvalidPitchValue, api, "pitch %zu above the device maximum", side->pitch);
    }
    // Stricter than documented where CUDA may be lenient: rows of a slice must fit its ysize.
    if (e.depth > 1 && pos.y + e.height > side->ysize) {
      return Fail(cudaErrorInvalidValue, api, "%s pos.y %zu + height %zu > ysize %zu with depth %zu",
                  side == &p->srcPtr ? "src" : "dst", pos.y, e.height, side->ysize, e.depth);
    }
  }
  Copy c;
  c.api = api;
  c.dpitch = static_cast<int64_t>(p->dstPtr.pitch);
  c.dslice = static_cast<int64_t>(p->dstPtr.pitch * p->dstPtr.ysize);
  c.spitch = static_cast<int64_t>(p->srcPtr.pitch);
  c.sslice = static_cast<int64_t>(p->srcPtr.pitch * p->srcPtr.ysize);
  c.dst = static_cast<char*>(p->dstPtr.ptr) + p->dstPos.z * c.dslice + p->dstPos.y * c.dpitch + p->dstPos.x;
  c.src = static_cast<const char*>(p->srcPtr.ptr) + p->srcPos.z * c.sslice + p->srcPos.y * c.spitch + p->srcPos.x;
  c.width = static_cast<int64_t>(e.width);
  c.height = static_cast<int64_t>(e.height);
  c.depth = static_cast<int64_t>(e.depth);
  return SubmitCopy(c, p->kind, stream, false);
}

// ---- streams and events ----

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned int flags) {
  FAKE_ENTER("cudaStreamCreateWithFlags");
  if (out == nullptr || (flags & ~cudaStreamNonBlocking) != 0) {
    return Fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags", "flags 0x%x", flags);
  }
  if (S().devices == 0) return Fail(cudaErrorNoDevice, "cudaStreamCreateWithFlags", "no device");
  absl::MutexLock l(&S().mu);
  auto st = NewStreamLocked(t_device, (flags & cudaStreamNonBlocking) == 0, false);
  *out = reinterpret_cast<cudaStream_t>(st.get());
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* out) { return cudaStreamCreateWithFlags(out, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  FAKE_ENTER("cudaStreamDestroy");
  absl::MutexLock l(&S().mu);
  if (h == nullptr || h == cudaStreamLegacy) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy", "the default stream cannot be destroyed");
  }
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(h, &err);
  if (st == nullptr) return Fail(err, "cudaStreamDestroy", "stream %p is not live", static_cast<void*>(h));
  st->destroyed = true;  // queued work still runs (as CUDA), then the worker exits
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
  FAKE_ENTER("cudaStreamQuery");
  absl::MutexLock l(&S().mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(h, &err);
  if (st == nullptr) return Fail(err, "cudaStreamQuery", "stream %p is not live", static_cast<void*>(h));
  if (st->completed < st->enqueued) return cudaErrorNotReady;
  if (st->error != cudaSuccess) return t_last_error = st->error;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  FAKE_ENTER("cudaStreamSynchronize");
  absl::MutexLock l(&S().mu);
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(h, &err);
  if (st == nullptr) return Fail(err, "cudaStreamSynchronize", "stream %p is not live", static_cast<void*>(h));
  return WaitLocked(st, st->enqueued, "cudaStreamSynchronize");
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned int flags) {
  FAKE_ENTER("cudaEventCreateWithFlags");
  const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (out == nullptr || (flags & ~known) != 0 ||
      ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming))) {
    return Fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags", "flags 0x%x", flags);
  }
  absl::MutexLock l(&S().mu);
  auto ev = std::make_unique<Event>();
  ev->device = t_device;
  *out = reinterpret_cast<cudaEvent_t>(ev.get());
  S().events[ev.get()] = std::move(ev);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* out) { return cudaEventCreateWithFlags(out, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  FAKE_ENTER("cudaEventDestroy");
  absl::MutexLock l(&S().mu);
  if (S().events.erase(reinterpret_cast<Event*>(e)) == 0) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy", "event %p is not live", static_cast<void*>(e));
  }
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t h) {
  FAKE_ENTER("cudaEventRecord");
  absl::MutexLock l(&S().mu);
  auto it = S().events.find(reinterpret_cast<Event*>(e));
  if (it == S().events.end()) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventRecord", "event %p is not live", static_cast<void*>(e));
  }
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(h, &err);
  if (st == nullptr) return Fail(err, "cudaEventRecord", "stream %p is not live", static_cast<void*>(h));
  if (st->device != it->second->device) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventRecord", "event of device %d recorded on a stream of device %d",
                it->second->device, st->device);
  }
  it->second->stream = st;
  it->second->seq = st->enqueued;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  FAKE_ENTER("cudaEventQuery");
  absl::MutexLock l(&S().mu);
  auto it = S().events.find(reinterpret_cast<Event*>(e));
  if (it == S().events.end()) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventQuery", "event %p is not live", static_cast<void*>(e));
  }
  const Event& ev = *it->second;
  if (ev.stream == nullptr) return cudaSuccess;  // never recorded: complete, as CUDA says
  if (ev.stream->completed < ev.seq) return cudaErrorNotReady;
  if (ev.stream->error != cudaSuccess && ev.stream->error_seq <= ev.seq) return t_last_error = ev.stream->error;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  FAKE_ENTER("cudaEventSynchronize");
  absl::MutexLock l(&S().mu);
  auto it = S().events.find(reinterpret_cast<Event*>(e));
  if (it == S().events.end()) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize", "event %p is not live", static_cast<void*>(e));
  }
  if (it->second->stream == nullptr) return cudaSuccess;
  std::shared_ptr<Stream> st = it->second->stream;
  return WaitLocked(st, it->second->seq, "cudaEventSynchronize");
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t e, unsigned int flags) {
  FAKE_ENTER("cudaStreamWaitEvent");
  absl::MutexLock l(&S().mu);
  auto it = S().events.find(reinterpret_cast<Event*>(e));
  if (it == S().events.end() || flags != 0) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent", "event %p / flags %u", static_cast<void*>(e), flags);
  }
  cudaError_t err;
  std::shared_ptr<Stream> st = ResolveStreamLocked(h, &err);
  if (st == nullptr) return Fail(err, "cudaStreamWaitEvent", "stream %p is not live", static_cast<void*>(h));
  if (it->second->stream == nullptr) return cudaSuccess;
  std::shared_ptr<Stream> dep = it->second->stream;
  const uint64_t seq = it->second->seq;
  EnqueueLocked(st, [dep, seq] {
    State& s = S();
    absl::MutexLock l2(&s.mu);
    Stream* d = dep.get();
    auto done = [d, seq] { return d->completed >= seq; };
    s.mu.Await(absl::Condition(&done));
    return cudaSuccess;
  });
  return cudaSuccess;
}

// ---- IPC ----

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* p) {
  FAKE_ENTER("cudaIpcGetMemHandle");
  if (handle == nullptr) return Fail(cudaErrorInvalidValue, "cudaIpcGetMemHandle", "null handle");
  State& s = S();
  absl::MutexLock l(&s.mu);
  std::shared_ptr<Alloc> a = FindLocked(reinterpret_cast<uintptr_t>(p));
  if (a == nullptr || reinterpret_cast<uintptr_t>(p) >= a->base + a->size) {
    return Fail(cudaErrorInvalidValue, "cudaIpcGetMemHandle", "%p is not in a cudaMalloc allocation", p);
  }
  if (a->opened) return Fail(cudaErrorInvalidValue, "cudaIpcGetMemHandle", "%p is an IPC mapping", p);
  if (a->pool) {
    // As CUDA: stream-ordered pool memory is not legacy-IPC capable (pools share their memory with
    // cudaMemPoolExportToShareableHandle + cudaMemPoolExportPointer, not emulated).
    return Fail(cudaErrorInvalidValue, "cudaIpcGetMemHandle",
                "%p is stream-ordered memory-pool memory (cudaMallocAsync), which legacy CUDA IPC cannot export", p);
  }
  if (a->vmm) {
    // As CUDA: legacy IPC cannot export cuMemCreate memory (PyTorch expandable segments); share
    // it with cuMemExportToShareableHandle instead.
    return Fail(cudaErrorInvalidValue, "cudaIpcGetMemHandle", "%p is cuMemCreate memory (cuMemMap), not a cudaMalloc allocation", p);
  }
  HandleBytes hb = {};
  memcpy(hb.magic, kHandleMagic, sizeof(hb.magic));
  hb.pid = s.pid;
  hb.device = s.physical[a->device];  // the machine's numbering: the importer may number it differently
  hb.size = a->size;
  snprintf(hb.name, sizeof(hb.name), "%s", a->shm_name.c_str());
  memcpy(handle, &hb, sizeof(hb));
  return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void** out, cudaIpcMemHandle_t handle, unsigned int flags) {
  FAKE_ENTER("cudaIpcOpenMemHandle");
  const char* api = "cudaIpcOpenMemHandle";
  if (out == nullptr) return Fail(cudaErrorInvalidValue, api, "null devPtr");
  if (flags != cudaIpcMemLazyEnablePeerAccess) {
    return Fail(cudaErrorInvalidValue, api, "flags must be cudaIpcMemLazyEnablePeerAccess, got %u", flags);
  }
  HandleBytes hb;
  memcpy(&hb, &handle, sizeof(hb));
  if (memcmp(hb.magic, kHandleMagic, sizeof(hb.magic)) != 0 || memchr(hb.name, '\0', sizeof(hb.name)) == nullptr ||
      strncmp(hb.name, "/wbfc.", 6) != 0) {
    return Fail(cudaErrorInvalidValue, api, "not an IPC memory handle of this emulator");
  }
  State& s = S();
  if (hb.pid == s.pid) {
    return Fail(cudaErrorDeviceUninitialized, api,
                "handle exported by this very process (CUDA refuses to open those: invalid device context)");
  }
  absl::MutexLock l(&s.mu);
  for (auto& [base, a] : s.allocs) {
    if (a->opened && a->shm_name == hb.name) {  // CUDA: reopening counts references, same pointer
      a->ipc_refs++;
      *out = reinterpret_cast<void*>(a->base);
      return cudaSuccess;
    }
  }
  const int fd = shm_open(hb.name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    return Fail(cudaErrorInvalidResourceHandle, api, "%s: %s (exporter freed it or is gone)", hb.name, strerror(errno));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < hb.size) {
    close(fd);
    return Fail(cudaErrorInvalidValue, api, "%s is smaller than the handle says", hb.name);
  }
  // The mapping belongs to the GPU holding the memory (cudaPointerGetAttributes says so), in this
  // process's numbering; a GPU this process cannot see cannot be mapped.
  const auto local = std::find(s.physical.begin(), s.physical.end(), hb.device);
  if (local == s.physical.end()) {
    close(fd);
    return Fail(cudaErrorInvalidDevice, api, "%s lives on device %d of the machine, not visible to this process (CUDA_VISIBLE_DEVICES)",
                hb.name, hb.device);
  }
  auto a = std::make_shared<Alloc>();
  if (cudaError_t e = MapAlloc(fd, hb.size, a.get(), api); e != cudaSuccess) return e;
  a->device = static_cast<int>(local - s.physical.begin());
  a->opened = true;
  a->ipc_refs = 1;
  a->shm_name = hb.name;
  s.allocs[a->base] = a;
  *out = reinterpret_cast<void*>(a->base);
  return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void* p) {
  FAKE_ENTER("cudaIpcCloseMemHandle");
  State& s = S();
  absl::MutexLock l(&s.mu);
  auto it = s.allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocs.end() || !it->second->opened) {
    return Fail(cudaErrorInvalidValue, "cudaIpcCloseMemHandle", "%p is not the base of an IPC mapping", p);
  }
  if (--it->second->ipc_refs > 0) return cudaSuccess;
  // No implicit synchronisation: a copy still queued on this memory faults when it runs (one
  // running now keeps the alias mapped until it finishes).
  s.quarantine[it->first] = it->second->reserved;
  s.allocs.erase(it);
  return cudaSuccess;
}

// ---- driver entry points ----

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int cudaVersion,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status) {
  FAKE_ENTER("cudaGetDriverEntryPointByVersion");
  if (symbol == nullptr || fn == nullptr ||
      (flags != cudaEnableDefault && flags != cudaEnableLegacyStream && flags != cudaEnablePerThreadDefaultStream)) {
    return Fail(cudaErrorInvalidValue, "cudaGetDriverEntryPointByVersion", "bad arguments");
  }
  *fn = nullptr;
  cudaDriverEntryPointQueryResult r = cudaDriverEntryPointSymbolNotFound;
  bool found = false;
  for (const wb::fake_cuda::DriverSymbol& d : wb::fake_cuda::kDriverSymbols) {
    if (strcmp(symbol, d.name) != 0) continue;
    found = true;
    if (cudaVersion >= d.min_version) {
      *fn = d.fn;
      r = cudaDriverEntryPointSuccess;
    } else {
      r = cudaDriverEntryPointVersionNotSufficent;
    }
  }
  if (!found) Log("cudaGetDriverEntryPointByVersion: driver symbol '%s' is not emulated", symbol);
  if (status) *status = r;
  return cudaSuccess;
}
