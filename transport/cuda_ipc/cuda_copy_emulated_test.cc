// EnqueueBoxCopy (cuda_copy.h) executed for real on the CPU emulation of CUDA (tests/fake_cuda):
// the cudaMemcpyAsync / 2D / 3D calls it issues, with the exact parameters it passes, run against
// bounds-checked fake device memory and are compared with an element-by-element reference, in
// every direction. cuda_copy_test checks the planning on host replays; this checks the calls.
#include <cuda_runtime.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fake_cuda/fake_cuda.h"
#include "transport/cuda_ipc/cuda_copy.h"

namespace wb::transport {
namespace {

struct Layout {
  std::vector<int64_t> strides;  // elements
  int64_t elems = 0;             // buffer size in elements
};

// A random padded layout of `shape` with a random dimension order.
Layout RandomLayout(const std::vector<int64_t>& shape, std::mt19937& rng) {
  std::vector<int> order(shape.size());
  std::iota(order.begin(), order.end(), 0);
  if (rng() % 2) std::shuffle(order.begin(), order.end(), rng);
  Layout l;
  l.strides.assign(shape.size(), 0);
  int64_t s = 1 + (rng() % 4 == 0 ? rng() % 3 : 0);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {  // innermost last in `order`
    l.strides[*it] = s;
    s = s * shape[*it] + (rng() % 3 == 0 ? rng() % 5 : 0);
  }
  l.elems = 1;
  for (size_t d = 0; d < shape.size(); ++d) l.elems += (shape[d] - 1) * l.strides[d];
  return l;
}

void Reference(const std::vector<int64_t>& shape, const Layout& sl, const Layout& dl, int64_t es,
               const uint8_t* src, uint8_t* dst) {
  int64_t n = 1;
  for (auto e : shape) n *= e;
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, so = 0, dof = 0;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      const int64_t idx = rem % shape[d];
      rem /= shape[d];
      so += idx * sl.strides[d] * es;
      dof += idx * dl.strides[d] * es;
    }
    std::memcpy(dst + dof, src + so, es);
  }
}

TEST(CudaCopyEmulatedTest, RandomBoxesEveryDirectionMatchTheReference) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::mt19937 rng(17);
  int64_t calls_total = 0;
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<int64_t> shape(1 + rng() % 4);
    for (auto& e : shape) e = 1 + rng() % 9;
    const int64_t es = int64_t{1} << (rng() % 4);
    const Layout sl = RandomLayout(shape, rng), dl = RandomLayout(shape, rng);
    const int64_t sbytes = sl.elems * es, dbytes = dl.elems * es;
    std::vector<uint8_t> src(sbytes), dst0(dbytes);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    for (auto& b : dst0) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> want = dst0;
    Reference(shape, sl, dl, es, src.data(), want.data());

    const int mode = iter % 4;  // 0 D2D, 1 H2D pageable, 2 D2H pageable, 3 pinned H2D + D2H via device
    void* ds = nullptr;
    void* dd = nullptr;
    ASSERT_EQ(cudaMalloc(&ds, sbytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dd, dbytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ds, src.data(), sbytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dd, dst0.data(), dbytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
    std::vector<uint8_t> host_dst = dst0;
    void* pinned = nullptr;
    const char* s = static_cast<const char*>(ds);
    char* d = static_cast<char*>(dd);
    if (mode == 1) s = reinterpret_cast<const char*>(src.data());
    if (mode == 2) d = reinterpret_cast<char*>(host_dst.data());
    if (mode == 3) {
      ASSERT_EQ(cudaMallocHost(&pinned, sbytes), cudaSuccess);
      std::memcpy(pinned, src.data(), sbytes);
      s = static_cast<const char*>(pinned);
    }
    const CanonicalBox box = Canonicalize(shape, sl.strides, dl.strides, es);
    ASSERT_TRUE(EnqueueBoxCopy(d, s, box, stream, &calls_total).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint8_t> got(dbytes);
    if (mode == 2) {
      got = host_dst;
    } else {
      ASSERT_EQ(cudaMemcpy(got.data(), dd, dbytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    ASSERT_EQ(got, want) << "iter " << iter << " mode " << mode << " rank " << shape.size() << " element " << es;
    if (pinned) {
      ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
    }
    ASSERT_EQ(cudaFree(ds), cudaSuccess);
    ASSERT_EQ(cudaFree(dd), cudaSuccess);
  }
  EXPECT_GT(calls_total, 300);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A box that would run past a device allocation is a CUDA fault (sticky), not silent corruption:
// the emulator's bounds check sees what EnqueueBoxCopy really touches.
TEST(CudaCopyEmulatedTest, BoxPastTheAllocationFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: CUDA does not survive fork()
  EXPECT_EXIT(
      {
        void* d = nullptr;
        if (cudaMalloc(&d, 1000) != cudaSuccess) _exit(10);
        cudaStream_t s;
        if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) _exit(11);
        std::vector<uint8_t> host(4000);
        // 10 rows of 40 bytes, pitch 100 on the device: the last row ends at 940 + 100 > 1000.
        const CanonicalBox box = Canonicalize({10, 40}, {40, 1}, {100, 1}, 1);
        if (!EnqueueBoxCopy(static_cast<char*>(d) + 100, reinterpret_cast<char*>(host.data()), box, s).ok()) _exit(12);
        _exit(cudaStreamSynchronize(s) == cudaErrorIllegalAddress ? 0 : 13);
      },
      ::testing::ExitedWithCode(0), "ILLEGAL ADDRESS");
}

TEST(CudaCopyEmulatedTest, ScopedCudaDeviceRestoresTheDevice) {
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  {
    ScopedCudaDevice keep;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
  int d = -1;
  ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
  EXPECT_EQ(d, 1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

}  // namespace
}  // namespace wb::transport
