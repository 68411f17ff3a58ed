// Unit tests of the CUDA emulation itself (fake_cuda.h). Run with WB_FAKE_CUDA_DEVICES=2 (BUILD).
// Tests that poison the process (sticky cudaErrorIllegalAddress) or crash it run in death-test
// children ("threadsafe" style: a fresh exec of this binary, so no CUDA state crosses a fork).
#include "tests/fake_cuda/fake_cuda.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace wb::fake_cuda {
namespace {

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorName(cudaGetLastError())

uint8_t Pat(uint64_t seed, size_t i) { return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff); }

std::vector<uint8_t> Pattern(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Pat(seed, i);
  return v;
}

class FakeCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
  void* Malloc(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess);
    allocs_.push_back(p);
    return p;
  }
  void TearDown() override {
    for (void* p : allocs_) EXPECT_EQ(cudaFree(p), cudaSuccess);
  }
  std::vector<void*> allocs_;
};

TEST_F(FakeCudaTest, DevicesAndProperties) {
  int n = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&n));
  EXPECT_EQ(n, 2);  // WB_FAKE_CUDA_DEVICES=2 in BUILD
  cudaDeviceProp p0, p1, again;
  ASSERT_CUDA(cudaGetDeviceProperties(&p0, 0));
  ASSERT_CUDA(cudaGetDeviceProperties(&p1, 1));
  ASSERT_CUDA(cudaGetDeviceProperties(&again, 0));
  EXPECT_NE(std::string(p0.name).find("fake"), std::string::npos) << p0.name;
  EXPECT_EQ(memcmp(p0.uuid.bytes, again.uuid.bytes, 16), 0);
  EXPECT_NE(memcmp(p0.uuid.bytes, p1.uuid.bytes, 16), 0);
  EXPECT_GT(p0.totalGlobalMem, size_t{1} << 30);
  EXPECT_EQ(cudaGetDeviceProperties(&p0, 2), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaSetDevice(2), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaGetLastError clears a non-sticky error";
  // The current device is per thread.
  ASSERT_CUDA(cudaSetDevice(1));
  int other = -1;
  std::thread([&] { (void)cudaGetDevice(&other); }).join();
  EXPECT_EQ(other, 0);
  int mine = -1;
  ASSERT_CUDA(cudaGetDevice(&mine));
  EXPECT_EQ(mine, 1);
}

TEST_F(FakeCudaTest, LastErrorIsPerThread) {
  EXPECT_EQ(cudaSetDevice(99), cudaErrorInvalidDevice);
  cudaError_t seen = cudaErrorUnknown;
  std::thread([&] { seen = cudaGetLastError(); }).join();
  EXPECT_EQ(seen, cudaSuccess);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
  EXPECT_STREQ(cudaGetErrorName(cudaErrorIllegalAddress), "cudaErrorIllegalAddress");
  EXPECT_STRNE(cudaGetErrorString(cudaErrorIllegalAddress), "");
}

TEST_F(FakeCudaTest, RoundTripAndPointerAttributes) {
  const size_t n = 100000;
  char* d = static_cast<char*>(Malloc(n));
  ASSERT_NE(d, nullptr);
  EXPECT_TRUE(IsDevicePointer(d));
  EXPECT_TRUE(IsDevicePointer(d + n - 1));
  EXPECT_FALSE(IsDevicePointer(d + n));
  auto in = Pattern(3, n);
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(d, in.data(), n, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(out.data(), d, n, cudaMemcpyDefault));
  EXPECT_EQ(in, out);
  EXPECT_EQ(memcmp(DeviceToHost(d, n), in.data(), n), 0);
  EXPECT_EQ(DeviceToHost(d, n + 1), nullptr);
  // Wrong direction for the pointers: refused (stricter than some CUDA versions).
  EXPECT_EQ(cudaMemcpy(out.data(), d, n, cudaMemcpyHostToDevice), cudaErrorInvalidMemcpyDirection);
  (void)cudaGetLastError();

  cudaPointerAttributes a;
  ASSERT_CUDA(cudaPointerGetAttributes(&a, d + 10));
  EXPECT_EQ(a.type, cudaMemoryTypeDevice);
  EXPECT_EQ(a.device, 0);
  ASSERT_CUDA(cudaPointerGetAttributes(&a, in.data()));
  EXPECT_EQ(a.type, cudaMemoryTypeUnregistered);
  ASSERT_CUDA(cudaHostRegister(in.data(), n, cudaHostRegisterPortable));
  ASSERT_CUDA(cudaPointerGetAttributes(&a, in.data() + 5));
  EXPECT_EQ(a.type, cudaMemoryTypeHost);
  EXPECT_EQ(cudaHostRegister(in.data() + 8, 16, 0), cudaErrorHostMemoryAlreadyRegistered);
  EXPECT_EQ(cudaHostUnregister(in.data() + 8), cudaErrorHostMemoryNotRegistered);
  ASSERT_CUDA(cudaHostUnregister(in.data()));
  EXPECT_EQ(cudaHostRegister(d, 16, 0), cudaErrorInvalidValue) << "device memory cannot be host-registered";
  void* pinned = nullptr;
  ASSERT_CUDA(cudaMallocHost(&pinned, 4096));
  ASSERT_CUDA(cudaPointerGetAttributes(&a, pinned));
  EXPECT_EQ(a.type, cudaMemoryTypeHost);
  EXPECT_EQ(cudaHostUnregister(pinned), cudaErrorHostMemoryNotRegistered);
  ASSERT_CUDA(cudaFreeHost(pinned));
  EXPECT_EQ(cudaFreeHost(in.data()), cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_F(FakeCudaTest, FreeRules) {
  char* d = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d), 1000));
  EXPECT_EQ(cudaFree(d + 1), cudaErrorInvalidValue) << "interior pointer";
  ASSERT_CUDA(cudaFree(d));
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidValue) << "double free";
  EXPECT_FALSE(IsDevicePointer(d));
  EXPECT_EQ(cudaFree(nullptr), cudaSuccess);
  (void)cudaGetLastError();
}

TEST_F(FakeCudaTest, MemGetAddressRangeThroughTheDriverEntryPoint) {
  char* d = static_cast<char*>(Malloc(12345));
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  ASSERT_CUDA(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q));
  ASSERT_EQ(q, cudaDriverEntryPointSuccess);
  auto get = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr)>(fn);
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_EQ(get(&base, &size, reinterpret_cast<CUdeviceptr>(d + 777)), CUDA_SUCCESS);
  EXPECT_EQ(base, reinterpret_cast<CUdeviceptr>(d));
  EXPECT_EQ(size, 12345u);
  EXPECT_NE(get(&base, &size, reinterpret_cast<CUdeviceptr>(d + 12345)), CUDA_SUCCESS);
  int host = 0;
  EXPECT_NE(get(&base, &size, reinterpret_cast<CUdeviceptr>(&host)), CUDA_SUCCESS);
  ASSERT_CUDA(cudaGetDriverEntryPointByVersion("cuNotAFunction", &fn, 12000, cudaEnableDefault, &q));
  EXPECT_EQ(q, cudaDriverEntryPointSymbolNotFound);
  EXPECT_EQ(fn, nullptr);
}

// Blocks a stream until released, so asynchrony is observable without timing.
struct Gate {
  absl::Notification open;
  void Block(cudaStream_t s) {
    Enqueue(s, [this] {
      open.WaitForNotificationWithTimeout(absl::Seconds(30));
      return cudaSuccess;
    });
  }
};

TEST_F(FakeCudaTest, StreamsRunInOrderAndAsynchronously) {
  const size_t n = 1 << 16;
  char* a = static_cast<char*>(Malloc(n));
  char* b = static_cast<char*>(Malloc(n));
  void* host = nullptr;
  ASSERT_CUDA(cudaMallocHost(&host, n));
  auto in = Pattern(5, n);
  memcpy(host, in.data(), n);
  cudaStream_t s;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_EQ(StreamDevice(s), 0);
  cudaEvent_t never, ev;
  ASSERT_CUDA(cudaEventCreateWithFlags(&never, cudaEventDisableTiming));
  ASSERT_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  EXPECT_EQ(cudaEventQuery(never), cudaSuccess) << "an event never recorded counts as complete";
  Gate g;
  g.Block(s);
  ASSERT_CUDA(cudaMemcpyAsync(a, host, n, cudaMemcpyDefault, s));  // pinned: asynchronous
  ASSERT_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDefault, s));     // must see the first copy's bytes
  ASSERT_CUDA(cudaEventRecord(ev, s));
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaErrorNotReady is not recorded as an error";
  // A non-blocking stream does not synchronise with the legacy stream: this read sees old bytes.
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), b, n, cudaMemcpyDeviceToHost));
  EXPECT_NE(out, in);
  g.open.Notify();
  ASSERT_CUDA(cudaEventSynchronize(ev));
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess);
  ASSERT_CUDA(cudaStreamSynchronize(s));
  ASSERT_CUDA(cudaMemcpy(out.data(), b, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, in);
  ASSERT_CUDA(cudaEventDestroy(ev));
  ASSERT_CUDA(cudaEventDestroy(never));
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorInvalidResourceHandle);
  ASSERT_CUDA(cudaStreamDestroy(s));
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorInvalidResourceHandle);
  ASSERT_CUDA(cudaFreeHost(host));
  (void)cudaGetLastError();
}

TEST_F(FakeCudaTest, LegacyStreamWaitsForBlockingStreams) {
  const size_t n = 4096;
  char* d = static_cast<char*>(Malloc(n));
  void* host = nullptr;
  ASSERT_CUDA(cudaMallocHost(&host, n));
  memset(host, 0x11, n);
  cudaStream_t s;
  ASSERT_CUDA(cudaStreamCreate(&s));  // blocking
  Gate g;
  g.Block(s);
  ASSERT_CUDA(cudaMemcpyAsync(d, host, n, cudaMemcpyHostToDevice, s));
  std::vector<uint8_t> out(n, 0);
  void* out_pinned = nullptr;
  ASSERT_CUDA(cudaMallocHost(&out_pinned, n));
  // On the legacy stream (0): waits for s's copy; asynchronous for pinned memory.
  ASSERT_CUDA(cudaMemcpyAsync(out_pinned, d, n, cudaMemcpyDeviceToHost, 0));
  EXPECT_EQ(cudaStreamQuery(0), cudaErrorNotReady);
  g.open.Notify();
  ASSERT_CUDA(cudaStreamSynchronize(0));
  EXPECT_EQ(static_cast<uint8_t*>(out_pinned)[n - 1], 0x11);
  ASSERT_CUDA(cudaStreamDestroy(s));
  ASSERT_CUDA(cudaFreeHost(out_pinned));
  ASSERT_CUDA(cudaFreeHost(host));
}

TEST_F(FakeCudaTest, EventAndStreamOfDifferentDevicesAreRefused) {
  cudaStream_t s1;
  ASSERT_CUDA(cudaSetDevice(1));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  EXPECT_EQ(StreamDevice(s1), 1);
  ASSERT_CUDA(cudaSetDevice(0));
  cudaEvent_t e0;
  ASSERT_CUDA(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming));
  EXPECT_EQ(cudaEventRecord(e0, s1), cudaErrorInvalidResourceHandle);
  char* d = static_cast<char*>(Malloc(64));
  char host[64];
  EXPECT_EQ(cudaMemcpyAsync(d, host, 64, cudaMemcpyDefault, s1), cudaErrorInvalidResourceHandle)
      << "the stream's device must be current";
  (void)cudaGetLastError();
  ASSERT_CUDA(cudaEventDestroy(e0));
  ASSERT_CUDA(cudaSetDevice(1));
  ASSERT_CUDA(cudaStreamDestroy(s1));
}

// Reference for a pitched (2-D: depth 1) or 3-D copy.
void RefCopy(uint8_t* dst, size_t dpitch, size_t dys, const uint8_t* src, size_t spitch, size_t sys, size_t w,
             size_t h, size_t dep) {
  for (size_t z = 0; z < dep; ++z) {
    for (size_t y = 0; y < h; ++y) memcpy(dst + (z * dys + y) * dpitch, src + (z * sys + y) * spitch, w);
  }
}

TEST_F(FakeCudaTest, PitchedCopiesMatchTheReference) {
  std::mt19937 rng(7);
  cudaStream_t s;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int iter = 0; iter < 60; ++iter) {
    const size_t w = 1 + rng() % 50, h = 1 + rng() % 9, dep = 1 + rng() % 4;
    const size_t spitch = w + rng() % 20, dpitch = w + rng() % 20;
    const size_t sys = h + rng() % 3, dys = h + rng() % 3;
    const size_t sbytes = spitch * sys * dep + 64, dbytes = dpitch * dys * dep + 64;
    auto src = Pattern(iter, sbytes);
    std::vector<uint8_t> expect = Pattern(1000 + iter, dbytes);
    const size_t soff = rng() % 32, doff = rng() % 32;
    RefCopy(expect.data() + doff, dpitch, dys, src.data() + soff, spitch, sys, w, h, dep);
    // Device source and destination, both initialised from the host.
    char* ds = static_cast<char*>(Malloc(sbytes));
    char* dd = static_cast<char*>(Malloc(dbytes));
    ASSERT_CUDA(cudaMemcpy(ds, src.data(), sbytes, cudaMemcpyHostToDevice));
    auto dinit = Pattern(1000 + iter, dbytes);
    ASSERT_CUDA(cudaMemcpy(dd, dinit.data(), dbytes, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaDeviceSynchronize());  // pageable H2D cudaMemcpy may return before the bytes land
    const int mode = iter % 3;  // 0: D2D, 1: H2D (pageable), 2: D2H (pageable)
    std::vector<uint8_t> hdst = dinit;
    char* dst = mode == 2 ? reinterpret_cast<char*>(hdst.data()) : dd;
    const char* sp = mode == 1 ? reinterpret_cast<const char*>(src.data()) : ds;
    if (dep == 1) {
      ASSERT_CUDA(cudaMemcpy2DAsync(dst + doff, dpitch, sp + soff, spitch, w, h, cudaMemcpyDefault, s));
    } else {
      cudaMemcpy3DParms p = {};
      p.srcPtr = make_cudaPitchedPtr(const_cast<char*>(sp) + soff, spitch, w, sys);
      p.dstPtr = make_cudaPitchedPtr(dst + doff, dpitch, w, dys);
      p.extent = make_cudaExtent(w, h, dep);
      p.kind = cudaMemcpyDefault;
      ASSERT_CUDA(cudaMemcpy3DAsync(&p, s));
    }
    ASSERT_CUDA(cudaStreamSynchronize(s));
    std::vector<uint8_t> got(dbytes);
    if (mode == 2) {
      got = hdst;
    } else {
      ASSERT_CUDA(cudaMemcpy(got.data(), dd, dbytes, cudaMemcpyDeviceToHost));
    }
    ASSERT_EQ(got, expect) << "iter " << iter << " mode " << mode << " w " << w << " h " << h << " d " << dep;
  }
  // Parameter rules.
  char* d = static_cast<char*>(Malloc(1024));
  EXPECT_EQ(cudaMemcpy2DAsync(d, 8, d + 512, 16, 10, 2, cudaMemcpyDefault, s), cudaErrorInvalidPitchValue);
  cudaMemcpy3DParms p = {};
  p.srcPtr = make_cudaPitchedPtr(d, 16, 8, 2);
  p.dstPtr = make_cudaPitchedPtr(d + 512, 16, 8, 4);
  p.extent = make_cudaExtent(8, 3, 2);  // 3 rows per slice but the source slices hold 2
  p.kind = cudaMemcpyDefault;
  EXPECT_EQ(cudaMemcpy3DAsync(&p, s), cudaErrorInvalidValue);
  EXPECT_NE(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "parameter errors are not sticky";
  ASSERT_CUDA(cudaStreamDestroy(s));
}

TEST_F(FakeCudaTest, PageableSourceIsStagedAtEnqueue) {
  const size_t n = 4096;
  char* d = static_cast<char*>(Malloc(n));
  cudaStream_t s;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Gate g;
  g.Block(s);
  std::vector<uint8_t> src(n, 0x42);
  ASSERT_CUDA(cudaMemcpyAsync(d, src.data(), n, cudaMemcpyHostToDevice, s));
  std::fill(src.begin(), src.end(), 0x99);  // allowed by CUDA once the call returned
  g.open.Notify();
  ASSERT_CUDA(cudaStreamSynchronize(s));
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out[0], 0x42);
  EXPECT_EQ(out[n - 1], 0x42);
  ASSERT_CUDA(cudaStreamDestroy(s));
}

// CUDA: cudaMemcpy from pageable memory to the device returns once the source is staged, "the DMA
// to final destination may not have completed"; a non-blocking stream may read the old bytes.
TEST_F(FakeCudaTest, SyncCopyFromPageableMayReturnBeforeTheBytesLand) {
  const size_t n = 4096;
  char* d = static_cast<char*>(Malloc(n));
  ASSERT_CUDA(cudaMemset(d, 0, n));
  ASSERT_CUDA(cudaDeviceSynchronize());
  cudaStream_t blocking, nonblocking;
  ASSERT_CUDA(cudaStreamCreate(&blocking));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
  Gate g;
  g.Block(blocking);  // the legacy stream's next op waits for this
  std::vector<uint8_t> src(n, 0x5a);
  ASSERT_CUDA(cudaMemcpy(d, src.data(), n, cudaMemcpyHostToDevice));  // returns: source staged
  void* seen = nullptr;
  ASSERT_CUDA(cudaMallocHost(&seen, n));
  ASSERT_CUDA(cudaMemcpyAsync(seen, d, n, cudaMemcpyDeviceToHost, nonblocking));
  ASSERT_CUDA(cudaStreamSynchronize(nonblocking));
  EXPECT_EQ(static_cast<uint8_t*>(seen)[0], 0) << "the non-blocking stream ran before the staged copy landed";
  g.open.Notify();
  ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_CUDA(cudaMemcpyAsync(seen, d, n, cudaMemcpyDeviceToHost, nonblocking));
  ASSERT_CUDA(cudaStreamSynchronize(nonblocking));
  EXPECT_EQ(static_cast<uint8_t*>(seen)[0], 0x5a);
  ASSERT_CUDA(cudaFreeHost(seen));
  ASSERT_CUDA(cudaStreamDestroy(blocking));
  ASSERT_CUDA(cudaStreamDestroy(nonblocking));
}

TEST_F(FakeCudaTest, MemsetIsAsynchronousOnTheLegacyStream) {
  const size_t n = 4096;
  char* d = static_cast<char*>(Malloc(n));
  ASSERT_CUDA(cudaMemset(d, 7, n));
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));  // ordered after it on stream 0
  EXPECT_EQ(out[0], 7);
  EXPECT_EQ(out[n - 1], 7);
  char host[8];
  EXPECT_EQ(cudaMemset(host, 0, 8), cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_F(FakeCudaTest, HostDereferenceOfDevicePointerCrashes) {
  char* d = static_cast<char*>(Malloc(4096));
  EXPECT_DEATH(
      {
        volatile char c = *d;
        (void)c;
      },
      "");
}

// Runs in a death-test child: the violation kills the emulated context for the whole process.
void OutOfBoundsCopy(bool async) {
  char* d = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&d), 1000) != cudaSuccess) _exit(10);
  std::vector<char> host(2000);
  cudaError_t e;
  if (async) {
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) _exit(11);
    cudaEvent_t ev;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) _exit(11);
    // One byte past the allocation, detected when the copy runs.
    if (cudaMemcpyAsync(d + 1, host.data(), 1000, cudaMemcpyHostToDevice, s) != cudaSuccess) _exit(12);
    // The worker may detect it before the next call: then that call already returns the sticky error.
    e = cudaEventRecord(ev, s);
    if (e == cudaSuccess) {
      e = cudaStreamSynchronize(s);
    } else if (e != cudaErrorIllegalAddress) {
      _exit(12);
    }
  } else {
    e = cudaMemcpy(host.data(), d + 500, 501, cudaMemcpyDeviceToHost);
  }
  if (e != cudaErrorIllegalAddress) _exit(13);
  // Sticky: every later call fails, cudaGetLastError does not clear it.
  void* p = nullptr;
  if (cudaMalloc(&p, 16) != cudaErrorIllegalAddress) _exit(14);
  if (cudaGetLastError() != cudaErrorIllegalAddress || cudaGetLastError() != cudaErrorIllegalAddress) _exit(15);
  _exit(0);
}

TEST_F(FakeCudaTest, OutOfBoundsCopyIsAStickyIllegalAddress) {
  EXPECT_EXIT(OutOfBoundsCopy(false), ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS.*ends 1 bytes past the end");
  EXPECT_EXIT(OutOfBoundsCopy(true), ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS");
}

void UseAfterFree() {
  char* d = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&d), 1000) != cudaSuccess || cudaFree(d) != cudaSuccess) _exit(10);
  char host[16];
  if (cudaMemcpy(host, d, 16, cudaMemcpyDefault) != cudaErrorIllegalAddress) _exit(11);
  _exit(0);
}

TEST_F(FakeCudaTest, UseAfterFreeIsAnIllegalAddress) {
  EXPECT_EXIT(UseAfterFree(), ::testing::ExitedWithCode(0), "freed");
}

TEST_F(FakeCudaTest, ForkedChildCannotUseCuda) {
  Malloc(64);
  const pid_t pid = fork();
  if (pid == 0) {
    void* p = nullptr;
    _exit(cudaMalloc(&p, 16) == cudaErrorInitializationError ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// ---- IPC across processes ----

std::string Hex(const cudaIpcMemHandle_t& h) {
  std::string s;
  for (char c : h.reserved) absl::StrAppend(&s, absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
  return s;
}

struct Child {
  pid_t pid = -1;
  int out = -1;  // its stdout
  int in = -1;   // its stdin
};

// pass_fd >= 0: the child gets it as its descriptor 3 (VMM tests hand over an exported fd).
Child Spawn(const std::vector<std::string>& args, int pass_fd = -1) {
  int o[2], i[2];
  Child c;
  if (pipe2(o, O_CLOEXEC) != 0 || pipe2(i, O_CLOEXEC) != 0) return c;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, o[1], 1);
  posix_spawn_file_actions_adddup2(&fa, i[0], 0);
  if (pass_fd >= 0) posix_spawn_file_actions_adddup2(&fa, pass_fd, 3);
  std::vector<char*> argv;
  std::string bin = "tests/fake_cuda/fake_cudart_ipc_child";
  argv.push_back(bin.data());
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (posix_spawn(&c.pid, bin.c_str(), &fa, nullptr, argv.data(), environ) != 0) c.pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  close(o[1]);
  close(i[0]);
  c.out = o[0];
  c.in = i[1];
  return c;
}

// One line from fd within the deadline ("" on timeout / EOF).
std::string ReadLine(int fd, absl::Duration timeout) {
  std::string line;
  const absl::Time end = absl::Now() + timeout;
  char ch;
  while (true) {
    pollfd p = {fd, POLLIN, 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(end - absl::Now()));
    if (ms <= 0 || poll(&p, 1, ms) <= 0) return line;
    if (read(fd, &ch, 1) != 1 || ch == '\n') return line;
    line.push_back(ch);
  }
}

int Wait(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

TEST_F(FakeCudaTest, IpcAcrossProcesses) {
  const size_t n = 300000;
  char* d = static_cast<char*>(Malloc(n));
  auto in = Pattern(40, n);
  ASSERT_CUDA(cudaMemcpy(d, in.data(), n, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaDeviceSynchronize());  // the bytes must have landed before another process reads them
  cudaIpcMemHandle_t h, h_inner;
  ASSERT_CUDA(cudaIpcGetMemHandle(&h, d));
  ASSERT_CUDA(cudaIpcGetMemHandle(&h_inner, d + 4096));
  EXPECT_EQ(Hex(h), Hex(h_inner)) << "a pointer inside the allocation names the whole allocation";
  Child c = Spawn({"open", Hex(h), absl::StrCat(n), "40"});
  ASSERT_GT(c.pid, 0);
  EXPECT_EQ(ReadLine(c.out, absl::Seconds(30)), "OK");
  const int status = Wait(c.pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  close(c.out);
  close(c.in);
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, Pattern(41, n)) << "the child's writes through its mapping are visible here";
}

TEST_F(FakeCudaTest, OpeningOwnHandleOrGarbageIsRefused) {
  char* d = static_cast<char*>(Malloc(4096));
  cudaIpcMemHandle_t h;
  ASSERT_CUDA(cudaIpcGetMemHandle(&h, d));
  void* p = nullptr;
  EXPECT_EQ(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), cudaErrorDeviceUninitialized);
  EXPECT_EQ(cudaGetLastError(), cudaErrorDeviceUninitialized);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "not sticky";
  cudaIpcMemHandle_t junk = {};
  EXPECT_EQ(cudaIpcOpenMemHandle(&p, junk, cudaIpcMemLazyEnablePeerAccess), cudaErrorInvalidValue);
  EXPECT_EQ(cudaIpcCloseMemHandle(d), cudaErrorInvalidValue) << "own allocation is not an IPC mapping";
  (void)cudaGetLastError();
}

std::vector<std::string> ShmNamesOf(pid_t pid) {
  std::vector<std::string> names;
  const std::string prefix = absl::StrCat("wbfc.", pid, ".");
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* e = readdir(dir)) {
    if (strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) names.push_back(e->d_name);
  }
  closedir(dir);
  return names;
}

TEST_F(FakeCudaTest, FreeUnlinksTheSegment) {
  const size_t before = ShmNamesOf(getpid()).size();
  void* d = nullptr;
  ASSERT_CUDA(cudaMalloc(&d, 1 << 20));
  EXPECT_EQ(ShmNamesOf(getpid()).size(), before + 1);
  ASSERT_CUDA(cudaFree(d));
  EXPECT_EQ(ShmNamesOf(getpid()).size(), before);
}

TEST_F(FakeCudaTest, KilledExportersSegmentsAreReaped) {
  const int ino = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  ASSERT_GE(ino, 0);
  ASSERT_GE(inotify_add_watch(ino, "/dev/shm", IN_DELETE), 0);
  Child c = Spawn({"hold", "65536"});
  ASSERT_GT(c.pid, 0);
  const std::string line = ReadLine(c.out, absl::Seconds(30));
  ASSERT_EQ(line.rfind("READY ", 0), 0u) << line;
  ASSERT_EQ(ShmNamesOf(c.pid).size(), 1u);
  kill(c.pid, SIGKILL);
  Wait(c.pid);
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (!ShmNamesOf(c.pid).empty() && absl::Now() < end) {
    pollfd p = {ino, POLLIN, 0};
    (void)poll(&p, 1, 1000);  // wakes on any deletion in /dev/shm; rechecks at least every second
    char buf[4096];
    while (read(ino, buf, sizeof(buf)) > 0) {
    }
  }
  EXPECT_TRUE(ShmNamesOf(c.pid).empty()) << "segments of the killed exporter are still in /dev/shm";
  close(ino);
  close(c.out);
  close(c.in);
  // Its handle no longer opens (the memory is gone, as with a dead CUDA exporter).
  cudaIpcMemHandle_t h;
  const std::string hex = line.substr(6);
  ASSERT_EQ(hex.size(), 2 * sizeof(h));
  for (size_t i = 0; i < sizeof(h); ++i) h.reserved[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  void* p = nullptr;
  EXPECT_EQ(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
}

// ---- VMM (cuMem*) through the driver entry points ----

template <typename Fn>
Fn Driver(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

struct Vmm {
  decltype(&cuMemGetAllocationGranularity) granularity = Driver<decltype(granularity)>("cuMemGetAllocationGranularity");
  decltype(&cuMemCreate) create = Driver<decltype(create)>("cuMemCreate");
  decltype(&cuMemRelease) release = Driver<decltype(release)>("cuMemRelease");
  decltype(&cuMemAddressReserve) reserve = Driver<decltype(reserve)>("cuMemAddressReserve");
  decltype(&cuMemAddressFree) free_va = Driver<decltype(free_va)>("cuMemAddressFree");
  decltype(&cuMemMap) map = Driver<decltype(map)>("cuMemMap");
  decltype(&cuMemUnmap) unmap = Driver<decltype(unmap)>("cuMemUnmap");
  decltype(&cuMemSetAccess) set_access = Driver<decltype(set_access)>("cuMemSetAccess");
  decltype(&cuMemExportToShareableHandle) export_fd = Driver<decltype(export_fd)>("cuMemExportToShareableHandle");
  decltype(&cuMemImportFromShareableHandle) import_fd = Driver<decltype(import_fd)>("cuMemImportFromShareableHandle");
  decltype(&cuMemGetAllocationPropertiesFromHandle) props =
      Driver<decltype(props)>("cuMemGetAllocationPropertiesFromHandle");
  CUresult (*range)(CUdeviceptr*, size_t*, CUdeviceptr) =
      Driver<CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr)>("cuMemGetAddressRange");
  bool ok() const {
    return granularity && create && release && reserve && free_va && map && unmap && set_access && export_fd && import_fd &&
           props && range;
  }
};

CUmemAllocationProp Prop(int device, bool exportable) {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return p;
}

CUmemAccessDesc ReadWrite(int device) {
  CUmemAccessDesc d = {};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = device;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return d;
}

TEST_F(FakeCudaTest, VmmCreateMapAccessCopyAndRefuseLegacyIpc) {
  Vmm v;
  ASSERT_TRUE(v.ok()) << "every VMM entry point is emulated";
  const CUmemAllocationProp prop = Prop(1, true);
  size_t g = 0;
  ASSERT_EQ(v.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
  ASSERT_EQ(g, size_t{2} << 20);
  CUmemGenericAllocationHandle h = 0;
  EXPECT_EQ(v.create(&h, g + 1, &prop, 0), CUDA_ERROR_INVALID_VALUE) << "size not a multiple of the granularity";
  ASSERT_EQ(v.create(&h, 2 * g, &prop, 0), CUDA_SUCCESS);
  CUmemAllocationProp got = {};
  ASSERT_EQ(v.props(&got, h), CUDA_SUCCESS);
  EXPECT_EQ(got.location.id, 1);
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, 4 * g, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(v.map(va + g / 2, 2 * g, 0, h, 0), CUDA_ERROR_INVALID_VALUE) << "unaligned";
  EXPECT_EQ(v.map(va, 2 * g, 4096, h, 0), CUDA_ERROR_INVALID_VALUE) << "offset must be 0";
  EXPECT_EQ(v.map(va + g, 4 * g, 0, h, 0), CUDA_ERROR_INVALID_VALUE) << "larger than the allocation";
  ASSERT_EQ(v.map(va + g, 2 * g, 0, h, 0), CUDA_SUCCESS);
  EXPECT_EQ(v.map(va + 2 * g, 2 * g, 0, h, 0), CUDA_ERROR_INVALID_VALUE) << "overlaps a mapping";
  EXPECT_EQ(v.set_access(va, 2 * g, nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  const CUmemAccessDesc rw = ReadWrite(1);
  EXPECT_EQ(v.set_access(va, 3 * g, &rw, 1), CUDA_ERROR_INVALID_VALUE) << "range not fully mapped";
  ASSERT_EQ(v.set_access(va + g, 2 * g, &rw, 1), CUDA_SUCCESS);
  char* d = reinterpret_cast<char*>(va + g);
  cudaPointerAttributes attr = {};
  ASSERT_CUDA(cudaPointerGetAttributes(&attr, d + 100));
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attr.device, 1);
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_EQ(v.range(&base, &size, va + g + 12345), CUDA_SUCCESS);
  EXPECT_EQ(base, va + g);
  EXPECT_EQ(size, 2 * g);
  ASSERT_CUDA(cudaSetDevice(1));
  const size_t n = 3 * g / 2;
  auto in = Pattern(7, n);
  ASSERT_CUDA(cudaMemcpy(d + 1000, in.data(), n, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), d + 1000, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, in);
  cudaIpcMemHandle_t ipc;
  EXPECT_EQ(cudaIpcGetMemHandle(&ipc, d), cudaErrorInvalidValue) << "legacy IPC cannot export cuMemCreate memory";
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidValue) << "a mapping is not a cudaMalloc allocation";
  (void)cudaGetLastError();
  // An allocation made without the POSIX fd handle type cannot be exported.
  const CUmemAllocationProp plain = Prop(1, false);
  CUmemGenericAllocationHandle h2 = 0;
  ASSERT_EQ(v.create(&h2, g, &plain, 0), CUDA_SUCCESS);
  int fd = -1;
  EXPECT_EQ(v.export_fd(&fd, h2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(v.release(h2), CUDA_SUCCESS);
  EXPECT_EQ(v.release(h2), CUDA_ERROR_INVALID_VALUE) << "double release";
  // Release of a mapped handle keeps the memory while mapped (as CUDA); unmap + free the range.
  ASSERT_EQ(v.release(h), CUDA_SUCCESS);
  ASSERT_CUDA(cudaMemcpy(out.data(), d + 1000, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, in) << "mapped memory outlives its released handle";
  EXPECT_EQ(v.free_va(va, 4 * g), CUDA_ERROR_INVALID_VALUE) << "still mapped";
  EXPECT_EQ(v.unmap(va + g, g), CUDA_ERROR_INVALID_VALUE) << "part of a mapping";
  ASSERT_EQ(v.unmap(va + g, 2 * g), CUDA_SUCCESS);
  EXPECT_FALSE(IsDevicePointer(d));
  ASSERT_EQ(v.free_va(va, 4 * g), CUDA_SUCCESS);
  ASSERT_CUDA(cudaSetDevice(0));
}

// What a client does with a pointer into someone else's VMM memory (a torch tensor in an
// expandable segment): cuMemRetainAllocationHandle finds the handle, which exports like the
// creator's, and references are released one by one.
TEST_F(FakeCudaTest, VmmRetainAllocationHandleFromAnAddressInside) {
  Vmm v;
  auto retain = Driver<decltype(&cuMemRetainAllocationHandle)>("cuMemRetainAllocationHandle");
  ASSERT_TRUE(v.ok() && retain != nullptr);
  const CUmemAllocationProp prop = Prop(0, true);
  const size_t g = size_t{2} << 20;
  CUmemGenericAllocationHandle h = 0, got = 0;
  CUdeviceptr va = 0;
  ASSERT_EQ(v.create(&h, g, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(v.reserve(&va, 2 * g, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(retain(&got, reinterpret_cast<void*>(va)), CUDA_ERROR_INVALID_VALUE) << "nothing mapped there yet";
  ASSERT_EQ(v.map(va, g, 0, h, 0), CUDA_SUCCESS);
  EXPECT_EQ(retain(&got, reinterpret_cast<void*>(va + g + 8)), CUDA_ERROR_INVALID_VALUE) << "past the mapping";
  void* dev = nullptr;
  ASSERT_CUDA(cudaMalloc(&dev, 64));
  EXPECT_EQ(retain(&got, dev), CUDA_ERROR_INVALID_VALUE) << "cudaMalloc memory is not VMM memory";
  ASSERT_CUDA(cudaFree(dev));
  ASSERT_EQ(retain(&got, reinterpret_cast<void*>(va + 4096)), CUDA_SUCCESS);
  EXPECT_EQ(got, h) << "the handle that was mapped there";
  int fd = -1;
  ASSERT_EQ(v.export_fd(&fd, got, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
  EXPECT_GE(fd, 0);
  close(fd);
  ASSERT_EQ(v.release(got), CUDA_SUCCESS);
  ASSERT_EQ(v.release(h), CUDA_SUCCESS) << "the creator's reference is still there";
  EXPECT_EQ(v.release(h), CUDA_ERROR_INVALID_VALUE) << "no reference left";
  // The mapping holds the memory: retaining through it gives the handle back (one reference).
  ASSERT_EQ(retain(&got, reinterpret_cast<void*>(va)), CUDA_SUCCESS);
  EXPECT_EQ(got, h);
  EXPECT_EQ(v.release(got), CUDA_SUCCESS);
  ASSERT_EQ(v.unmap(va, g), CUDA_SUCCESS);
  ASSERT_EQ(v.free_va(va, 2 * g), CUDA_SUCCESS);
}

void CopyWithoutAccess() {
  Vmm v;
  const CUmemAllocationProp prop = Prop(0, true);
  const size_t g = size_t{2} << 20;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  if (v.create(&h, g, &prop, 0) != CUDA_SUCCESS || v.reserve(&va, g, 0, 0, 0) != CUDA_SUCCESS ||
      v.map(va, g, 0, h, 0) != CUDA_SUCCESS) {
    _exit(10);
  }
  char host[16] = {};
  if (cudaMemcpy(reinterpret_cast<void*>(va), host, 16, cudaMemcpyHostToDevice) != cudaSuccess) _exit(11);
  (void)cudaDeviceSynchronize();
  _exit(0);
}

TEST_F(FakeCudaTest, VmmCopyBeforeSetAccessIsAnIllegalAddress) {
  EXPECT_EXIT(CopyWithoutAccess(), ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS.*no cuMemSetAccess");
}

TEST_F(FakeCudaTest, VmmExportedFdImportsInAnotherProcess) {
  Vmm v;
  ASSERT_TRUE(v.ok());
  const size_t g = size_t{2} << 20;
  const CUmemAllocationProp prop = Prop(1, true);
  CUmemGenericAllocationHandle h = 0;
  ASSERT_EQ(v.create(&h, 2 * g, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, 2 * g, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(v.map(va, 2 * g, 0, h, 0), CUDA_SUCCESS);
  const CUmemAccessDesc rw = ReadWrite(1);
  ASSERT_EQ(v.set_access(va, 2 * g, &rw, 1), CUDA_SUCCESS);
  ASSERT_CUDA(cudaSetDevice(1));
  const size_t n = 2 * g;
  auto in = Pattern(50, n);
  ASSERT_CUDA(cudaMemcpy(reinterpret_cast<void*>(va), in.data(), n, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaDeviceSynchronize());
  int fd = -1;
  ASSERT_EQ(v.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
  ASSERT_GE(fd, 0);
  // The importer in this process gets the same bytes (VMM, unlike legacy IPC, may import its own export).
  CUmemGenericAllocationHandle own = 0;
  ASSERT_EQ(v.import_fd(&own, reinterpret_cast<void*>(static_cast<intptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_SUCCESS);
  EXPECT_EQ(v.release(own), CUDA_SUCCESS);
  int junk_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  CUmemGenericAllocationHandle junk = 0;
  EXPECT_EQ(v.import_fd(&junk, reinterpret_cast<void*>(static_cast<intptr_t>(junk_fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_ERROR_INVALID_VALUE) << "not an exported allocation";
  close(junk_fd);
  // Another process imports the fd (its descriptor 3), checks the bytes and writes the next pattern.
  Child c = Spawn({"vmm_open", absl::StrCat(n), "50"}, fd);
  close(fd);
  ASSERT_GT(c.pid, 0);
  EXPECT_EQ(ReadLine(c.out, absl::Seconds(30)), "OK");
  const int status = Wait(c.pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  close(c.out);
  close(c.in);
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), reinterpret_cast<void*>(va), n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, Pattern(51, n)) << "the child's writes through its mapping are visible here";
  ASSERT_EQ(v.unmap(va, 2 * g), CUDA_SUCCESS);
  ASSERT_EQ(v.release(h), CUDA_SUCCESS);
  ASSERT_EQ(v.free_va(va, 2 * g), CUDA_SUCCESS);
  ASSERT_CUDA(cudaSetDevice(0));
}

// PyTorch's expandable segments: one reserved range, one allocation per page mapped back to back,
// access granted once over the whole range. Copies run across the allocations' boundaries as on a
// GPU (one virtual range), and each allocation holds its own part of the bytes.
TEST_F(FakeCudaTest, VmmCopiesRunAcrossAllocationsMappedBackToBack) {
  Vmm v;
  ASSERT_TRUE(v.ok());
  const size_t g = size_t{2} << 20;
  const CUmemAllocationProp prop = Prop(1, true);
  const std::vector<size_t> sizes = {g, 2 * g, g};
  std::vector<CUmemGenericAllocationHandle> h(sizes.size());
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, 5 * g, 0, 0, 0), CUDA_SUCCESS);
  size_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_EQ(v.create(&h[i], sizes[i], &prop, 0), CUDA_SUCCESS);
    ASSERT_EQ(v.map(va + at, sizes[i], 0, h[i], 0), CUDA_SUCCESS);
    at += sizes[i];
  }
  const size_t total = at;
  const CUmemAccessDesc rw = ReadWrite(1);
  ASSERT_EQ(v.set_access(va, total, &rw, 1), CUDA_SUCCESS) << "one grant over several mappings";
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_EQ(v.range(&base, &size, va + g + 5), CUDA_SUCCESS);
  EXPECT_EQ(base, va + g) << "cuMemGetAddressRange names the one mapping at that address";
  EXPECT_EQ(size, 2 * g);
  ASSERT_CUDA(cudaSetDevice(1));
  char* d = reinterpret_cast<char*>(va);
  // Contiguous: from 1000 bytes before the first boundary to 3000 past the second.
  const size_t off = g - 1000, n = 2 * g + 4000;
  const auto in = Pattern(60, n);
  ASSERT_CUDA(cudaMemcpy(d + off, in.data(), n, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), d + off, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, in);
  // The bytes went into each allocation's own pages: a second mapping of the middle allocation
  // alone (another range, as an importer would map it) shows its part.
  CUdeviceptr va2 = 0;
  ASSERT_EQ(v.reserve(&va2, 2 * g, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(v.map(va2, 2 * g, 0, h[1], 0), CUDA_SUCCESS);
  ASSERT_EQ(v.set_access(va2, 2 * g, &rw, 1), CUDA_SUCCESS);
  std::vector<uint8_t> middle(2 * g);
  ASSERT_CUDA(cudaMemcpy(middle.data(), reinterpret_cast<void*>(va2), 2 * g, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::equal(middle.begin(), middle.end(), in.begin() + 1000)) << "allocation 1 holds bytes [1000, 1000 + 2g) of the copy";
  // Strided (2-D) device to device, rows crossing both boundaries, from the range into a cudaMalloc buffer.
  const size_t width = 3000, pitch = g / 2, rows = 7, src0 = g / 2 - 1500;  // rows 1 and 5 straddle a boundary
  void* flat = Malloc(width * rows);
  ASSERT_CUDA(cudaMemcpy2DAsync(flat, width, d + src0, pitch, width, rows, cudaMemcpyDeviceToDevice, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> rowsout(width * rows);
  ASSERT_CUDA(cudaMemcpy(rowsout.data(), flat, width * rows, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> whole(total);
  ASSERT_CUDA(cudaMemcpy(whole.data(), d, total, cudaMemcpyDeviceToHost)) << "the whole range at once";
  for (size_t r = 0; r < rows; ++r) {
    const size_t src = src0 + r * pitch;
    ASSERT_TRUE(std::equal(rowsout.begin() + r * width, rowsout.begin() + (r + 1) * width, whole.begin() + src)) << "row " << r;
  }
  EXPECT_EQ(DeviceToHost(d + g - 8, 16), nullptr) << "not one allocation's bytes";
  EXPECT_NE(DeviceToHost(d + g, 16), nullptr);
  ASSERT_EQ(v.unmap(va2, 2 * g), CUDA_SUCCESS);
  ASSERT_EQ(v.free_va(va2, 2 * g), CUDA_SUCCESS);
  ASSERT_EQ(v.unmap(va, total), CUDA_SUCCESS) << "whole mappings, several at once";
  for (CUmemGenericAllocationHandle x : h) ASSERT_EQ(v.release(x), CUDA_SUCCESS);
  ASSERT_EQ(v.free_va(va, 5 * g), CUDA_SUCCESS);
  ASSERT_CUDA(cudaSetDevice(0));
}

// A copy that runs from a mapping into an unmapped part of the range, or into a mapping without
// access, faults (sticky), as on a GPU.
void CopyAcrossIntoGap(bool gap) {
  Vmm v;
  const CUmemAllocationProp prop = Prop(0, true);
  const size_t g = size_t{2} << 20;
  CUmemGenericAllocationHandle a = 0, b = 0;
  CUdeviceptr va = 0;
  const CUmemAccessDesc rw = ReadWrite(0);
  if (v.create(&a, g, &prop, 0) != CUDA_SUCCESS || v.create(&b, g, &prop, 0) != CUDA_SUCCESS ||
      v.reserve(&va, 3 * g, 0, 0, 0) != CUDA_SUCCESS || v.map(va, g, 0, a, 0) != CUDA_SUCCESS ||
      v.map(va + (gap ? 2 : 1) * g, g, 0, b, 0) != CUDA_SUCCESS || v.set_access(va, g, &rw, 1) != CUDA_SUCCESS) {
    _exit(10);
  }
  std::vector<char> host(4096);
  if (cudaMemcpy(reinterpret_cast<char*>(va) + g - 2048, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess) _exit(11);
  (void)cudaDeviceSynchronize();
  _exit(0);
}

TEST_F(FakeCudaTest, VmmCopyIntoAGapOrAnInaccessibleNeighbourIsAnIllegalAddress) {
  EXPECT_EXIT(CopyAcrossIntoGap(true), ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS.*past the end of allocation");
  EXPECT_EXIT(CopyAcrossIntoGap(false), ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS.*no cuMemSetAccess made accessible");
}

TEST_F(FakeCudaTest, VmmImportOfADeviceTheProcessCannotSeeIsRefused) {
  Vmm v;
  const size_t g = size_t{2} << 20;
  const CUmemAllocationProp prop = Prop(1, true);
  CUmemGenericAllocationHandle h = 0;
  ASSERT_EQ(v.create(&h, g, &prop, 0), CUDA_SUCCESS);
  int fd = -1;
  ASSERT_EQ(v.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
  // A child that sees only device 0 of the machine cannot import memory of device 1.
  setenv("CUDA_VISIBLE_DEVICES", "0", 1);
  Child c = Spawn({"vmm_open", absl::StrCat(g), "-1"}, fd);
  unsetenv("CUDA_VISIBLE_DEVICES");
  close(fd);
  ASSERT_GT(c.pid, 0);
  EXPECT_EQ(ReadLine(c.out, absl::Seconds(30)), "import: 101");  // CUDA_ERROR_INVALID_DEVICE
  Wait(c.pid);
  close(c.out);
  close(c.in);
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
}

// ---- the stream-ordered allocator (cudaMallocAsync) and cuPointerGetAttribute ----

using PointerGetAttributeFn = decltype(&cuPointerGetAttribute);

// CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE of p (a zeroed int, as NCCL reads it), or -1 when
// the query fails.
int LegacyIpcCapable(PointerGetAttributeFn get, const void* p) {
  int capable = 0;
  if (get(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return -1;
  return capable;
}

CUmemoryPool MempoolOf(PointerGetAttributeFn get, const void* p) {
  CUmemoryPool pool = reinterpret_cast<CUmemoryPool>(uintptr_t{0xdead});
  EXPECT_EQ(get(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, reinterpret_cast<CUdeviceptr>(p)), CUDA_SUCCESS);
  return pool;
}

TEST_F(FakeCudaTest, PoolMemoryFromMallocAsyncIsRefusedByLegacyIpcAndTheDriverSaysSo) {
  auto get = Driver<PointerGetAttributeFn>("cuPointerGetAttribute");
  ASSERT_NE(get, nullptr) << "cuPointerGetAttribute is handed out by cudaGetDriverEntryPointByVersion";
  cudaMemPool_t pool0 = nullptr, pool1 = nullptr;
  ASSERT_CUDA(cudaDeviceGetDefaultMemPool(&pool0, 0));
  ASSERT_CUDA(cudaDeviceGetDefaultMemPool(&pool1, 1));
  EXPECT_NE(pool0, nullptr);
  EXPECT_NE(pool0, pool1) << "each device has its own default pool";
  EXPECT_EQ(cudaDeviceGetDefaultMemPool(&pool0, 2), cudaErrorInvalidDevice);
  (void)cudaGetLastError();

  // cudaMallocAsync allocates on the stream's device, from its default pool; the bytes are usable.
  ASSERT_CUDA(cudaSetDevice(1));
  cudaStream_t s = nullptr;
  ASSERT_CUDA(cudaStreamCreate(&s));
  const size_t n = 70000;
  char* p = nullptr;
  ASSERT_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&p), n, s));
  ASSERT_NE(p, nullptr);
  cudaPointerAttributes attr = {};
  ASSERT_CUDA(cudaPointerGetAttributes(&attr, p + 100));
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attr.device, 1);
  auto in = Pattern(11, n);
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpyAsync(p, in.data(), n, cudaMemcpyHostToDevice, s));
  ASSERT_CUDA(cudaMemcpyAsync(out.data(), p, n, cudaMemcpyDeviceToHost, s));
  ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_EQ(out, in);
  CUdeviceptr base = 0;
  size_t size = 0;
  auto range = Driver<CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr)>("cuMemGetAddressRange");
  ASSERT_EQ(range(&base, &size, reinterpret_cast<CUdeviceptr>(p + 777)), CUDA_SUCCESS);
  EXPECT_EQ(base, reinterpret_cast<CUdeviceptr>(p));
  EXPECT_EQ(size, n);
  auto retain = Driver<decltype(&cuMemRetainAllocationHandle)>("cuMemRetainAllocationHandle");
  CUmemGenericAllocationHandle h = 0;
  EXPECT_EQ(retain(&h, p), CUDA_ERROR_INVALID_VALUE) << "pool memory is not cuMemMap-ped VMM memory";

  // Legacy IPC refuses it as CUDA does; the driver tells it apart from cudaMalloc memory.
  cudaIpcMemHandle_t ipc;
  EXPECT_EQ(cudaIpcGetMemHandle(&ipc, p), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(LegacyIpcCapable(get, p + 5), 0);
  EXPECT_EQ(MempoolOf(get, p + 5), reinterpret_cast<CUmemoryPool>(pool1));
  ASSERT_CUDA(cudaSetDevice(0));
  char* d = static_cast<char*>(Malloc(4096));
  EXPECT_EQ(LegacyIpcCapable(get, d + 4095), 1);
  EXPECT_EQ(MempoolOf(get, d), nullptr) << "cudaMalloc memory comes from no pool";
  ASSERT_CUDA(cudaIpcGetMemHandle(&ipc, d));
  // cudaMallocFromPoolAsync with the default pool of device 0, on the legacy stream of device 0.
  void* q = nullptr;
  ASSERT_CUDA(cudaMallocFromPoolAsync(&q, 64, pool0, nullptr));
  ASSERT_CUDA(cudaPointerGetAttributes(&attr, q));
  EXPECT_EQ(attr.device, 0);
  EXPECT_EQ(MempoolOf(get, q), reinterpret_cast<CUmemoryPool>(pool0));
  EXPECT_EQ(LegacyIpcCapable(get, q), 0);
  int local = 0;
  EXPECT_EQ(cudaMallocFromPoolAsync(&q, 64, reinterpret_cast<cudaMemPool_t>(&local), nullptr), cudaErrorInvalidValue)
      << "no pool but the default ones";
  (void)cudaGetLastError();
  ASSERT_CUDA(cudaFree(q)) << "cudaFree frees pool memory too";
  EXPECT_EQ(LegacyIpcCapable(get, q), -1) << "freed memory is unknown to the driver";

  // Pinned host memory: known, not legacy-IPC capable, no pool; unknown memory and null data:
  // CUDA_ERROR_INVALID_VALUE; an attribute the emulation does not answer: CUDA_ERROR_NOT_SUPPORTED.
  void* pinned = nullptr;
  ASSERT_CUDA(cudaMallocHost(&pinned, 4096));
  EXPECT_EQ(LegacyIpcCapable(get, static_cast<char*>(pinned) + 8), 0);
  EXPECT_EQ(MempoolOf(get, pinned), nullptr);
  ASSERT_CUDA(cudaFreeHost(pinned));
  EXPECT_EQ(LegacyIpcCapable(get, &local), -1);
  EXPECT_EQ(get(nullptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, reinterpret_cast<CUdeviceptr>(d)),
            CUDA_ERROR_INVALID_VALUE);
  int ordinal = -1;
  EXPECT_EQ(get(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, reinterpret_cast<CUdeviceptr>(d)), CUDA_ERROR_NOT_SUPPORTED);

  // cudaFreeAsync frees when the stream reaches it: work queued before still sees the memory.
  ASSERT_CUDA(cudaSetDevice(1));
  Gate gate;
  gate.Block(s);
  ASSERT_CUDA(cudaFreeAsync(p, s));
  EXPECT_TRUE(IsDevicePointer(p)) << "freed before the stream reached the free";
  EXPECT_EQ(cudaFreeAsync(p, s), cudaErrorInvalidValue) << "its free is already queued";
  EXPECT_EQ(cudaFree(p), cudaErrorInvalidValue) << "its free is already queued";
  (void)cudaGetLastError();
  gate.open.Notify();
  ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_FALSE(IsDevicePointer(p));
  EXPECT_EQ(LegacyIpcCapable(get, p), -1);
  EXPECT_EQ(cudaFreeAsync(p, s), cudaErrorInvalidValue) << "double free";
  (void)cudaGetLastError();
  // cudaFreeAsync of cudaMalloc memory (allowed by CUDA); of an interior pointer: refused.
  void* m = nullptr;
  ASSERT_CUDA(cudaMalloc(&m, 256));
  EXPECT_EQ(cudaFreeAsync(static_cast<char*>(m) + 1, s), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  ASSERT_CUDA(cudaFreeAsync(m, s));
  ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_FALSE(IsDevicePointer(m));
  ASSERT_CUDA(cudaStreamDestroy(s));
  ASSERT_CUDA(cudaSetDevice(0));
}

TEST_F(FakeCudaTest, VmmMappingIsNotLegacyIpcCapableAndFromNoPool) {
  Vmm v;
  auto get = Driver<PointerGetAttributeFn>("cuPointerGetAttribute");
  ASSERT_TRUE(v.ok() && get != nullptr);
  const CUmemAllocationProp prop = Prop(0, true);
  const size_t g = size_t{2} << 20;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  ASSERT_EQ(v.create(&h, g, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(v.reserve(&va, g, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(v.map(va, g, 0, h, 0), CUDA_SUCCESS);
  EXPECT_EQ(LegacyIpcCapable(get, reinterpret_cast<void*>(va + 12345)), 0);
  EXPECT_EQ(MempoolOf(get, reinterpret_cast<void*>(va)), nullptr);
  ASSERT_EQ(v.unmap(va, g), CUDA_SUCCESS);
  ASSERT_EQ(v.free_va(va, g), CUDA_SUCCESS);
  ASSERT_EQ(v.release(h), CUDA_SUCCESS);
}

void CopyAfterFreeAsync() {
  cudaStream_t s = nullptr;
  if (cudaStreamCreate(&s) != cudaSuccess) _exit(3);
  void* p = nullptr;
  if (cudaMallocAsync(&p, 4096, s) != cudaSuccess) _exit(4);
  std::vector<char> host(64, 1);
  Gate gate;  // holds the stream, so that the copy is queued while the memory is still allocated
  gate.Block(s);
  if (cudaFreeAsync(p, s) != cudaSuccess) _exit(5);
  // Ordered after the free on the same stream: a use after free, when it runs.
  if (cudaMemcpyAsync(p, host.data(), host.size(), cudaMemcpyHostToDevice, s) != cudaSuccess) _exit(6);
  gate.open.Notify();
  _exit(cudaStreamSynchronize(s) == cudaErrorIllegalAddress ? 0 : 7);
}

TEST_F(FakeCudaTest, WorkOrderedAfterFreeAsyncIsAnIllegalAddress) {
  EXPECT_EXIT(CopyAfterFreeAsync(), ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS.*freed");
}

}  // namespace
}  // namespace wb::fake_cuda
