// One-GPU smoke test of the nccl transport's NCCL code. NCCL refuses two ranks of one communicator
// on the same GPU, so nccl_conformance_test needs two GPUs; this test runs on one by using a 1-rank
// communicator and send/recv to itself, through the same functions the transport calls
// (nccl_internal.h: InitComm, P2P, GroupEnd, Await, WithDenseSide, plus cuda_copy's EnqueueBoxCopy
// for the staging pack/unpack), and checks the public transport's Connect deadline and repeated
// ExportEndpoint on one GPU. Skips (saying "needs 1 visible CUDA device(s), found 0") without a GPU.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/config.h"
#include "transport/cuda_ipc/cuda_copy.h"
#include "transport/cuda_ipc/cuda_status.h"
#include "transport/nccl/nccl.h"
#include "transport/nccl/nccl_internal.h"
#include "transport/testing/test_buffer.h"

namespace wb::transport {
namespace {

namespace ni = nccl_internal;

// The phrase run_gpu_checks.sh looks for to tell a skip for lack of GPUs from a pass.
#define SKIP_WITHOUT_GPU()                                                                          \
  do {                                                                                              \
    if (const int n_ = VisibleCudaDevices(); n_ < 1) {                                              \
      GTEST_SKIP() << "nccl smoke test needs 1 visible CUDA device(s), found " << n_;               \
    }                                                                                               \
  } while (0)

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

constexpr absl::Duration kAbortBound = absl::Seconds(15);

// What Wait's deadline does in the transport, for the helpers' `interrupt` argument.
std::function<absl::Status()> Until(absl::Time deadline) {
  return [deadline]() -> absl::Status {
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("smoke test deadline");
    return absl::OkStatus();
  };
}

// ncclCommAbort on a helper thread, bounded: the transport relies on abort returning. A hang is
// reported and ends the process (the stuck thread cannot be joined).
ncclResult_t BoundedAbort(ncclComm_t comm, absl::Duration* took) {
  if (comm == nullptr) return ncclSuccess;
  auto done = std::make_shared<absl::Notification>();
  // Atomic, not plain: TSan cannot see the Notification's ordering inside Debian's uninstrumented
  // absl (it reported this handoff as a race in the emulated build).
  auto res = std::make_shared<std::atomic<ncclResult_t>>(ncclSuccess);
  const absl::Time t0 = absl::Now();
  std::thread([comm, done, res] {
    (void)cudaSetDevice(0);
    res->store(ncclCommAbort(comm), std::memory_order_release);
    done->Notify();
  }).detach();
  if (!done->WaitForNotificationWithTimeout(kAbortBound)) {
    std::fprintf(stderr, "FATAL: ncclCommAbort did not return within %s\n",
                 absl::FormatDuration(kAbortBound).c_str());
    std::fflush(stderr);
    std::_Exit(2);
  }
  if (took != nullptr) *took = absl::Now() - t0;
  return res->load(std::memory_order_acquire);
}

class NcclSmokeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    ASSERT_OK(CudaStatus(cudaSetDevice(0), "cudaSetDevice(0)"));
    ncclUniqueId uid;
    ASSERT_OK(NcclStatus(ncclGetUniqueId(&uid), "ncclGetUniqueId"));
    const absl::Time t0 = absl::Now();
    absl::Status s = ni::InitComm(0, /*nranks=*/1, /*rank=*/0, uid, absl::Now() + absl::Seconds(60),
                                  "smoke 1-rank communicator", &comm_);
    ASSERT_TRUE(s.ok()) << s;
    std::printf("1-rank non-blocking communicator up in %s\n", absl::FormatDuration(absl::Now() - t0).c_str());
    ASSERT_OK(CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    ASSERT_OK(CudaStatus(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"));
  }

  void TearDown() override {
    absl::Duration took;
    if (comm_ != nullptr) {
      EXPECT_EQ(BoundedAbort(comm_, &took), ncclSuccess);
    }
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    for (void* p : allocs_) (void)cudaFree(p);
  }

  char* DeviceAlloc(int64_t n, int fill) {
    void* p = nullptr;
    if (cudaMalloc(&p, n) != cudaSuccess || cudaMemset(p, fill, n) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc/cudaMemset of " << n << " bytes failed";
      return nullptr;
    }
    allocs_.push_back(p);
    return static_cast<char*>(p);
  }

  // The fills (cudaMemset: asynchronous on the legacy stream) and uploads (cudaMemcpy from pageable
  // memory: returns once the source is staged, "the DMA to final destination may not have
  // completed") are not ordered with stream_, a cudaStreamNonBlocking stream: without this the
  // NCCL send may read the source before its bytes land (the CUDA emulation caught it: the 64 MiB
  // case sent the zero fill).
  absl::Status SettleUploads() { return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the uploads"); }

  // One grouped send-to-self + recv-from-self of `n` bytes, then an event, then Await: exactly the
  // sequence of one data round of the transport with contiguous chunks.
  absl::Status SelfSendRecv(char* src, char* dst, int64_t n, absl::Time deadline) {
    (void)ncclGroupStart();
    absl::Status calls = ni::P2P(comm_, /*send=*/true, src, n, /*peer_rank=*/0, stream_, "smoke send");
    if (calls.ok()) calls = ni::P2P(comm_, /*send=*/false, dst, n, 0, stream_, "smoke recv");
    absl::Status ended = ni::GroupEnd(comm_, "smoke group", Until(deadline));
    if (!calls.ok()) return calls;
    return ended;
  }

  absl::Status RecordAndAwait(absl::Time deadline) {
    WB_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream_), "cudaEventRecord");
    return ni::Await(comm_, event_, "smoke await", Until(deadline));
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  std::vector<void*> allocs_;
};

TEST_F(NcclSmokeTest, ContiguousSendToSelfIsByteExact) {
  for (int64_t n : {int64_t{1}, int64_t{4099}, (int64_t{8} << 20) + 3, int64_t{64} << 20}) {
    SCOPED_TRACE(absl::StrCat(n, " bytes"));
    std::vector<uint8_t> want(n), got(n, 0);
    for (int64_t i = 0; i < n; ++i) want[i] = PatternByte(n, i);
    char* src = DeviceAlloc(n, 0);
    char* dst = DeviceAlloc(n, 0xEE);
    ASSERT_NE(src, nullptr);
    ASSERT_NE(dst, nullptr);
    ASSERT_OK(CudaStatus(cudaMemcpy(src, want.data(), n, cudaMemcpyHostToDevice), "H2D"));
    ASSERT_OK(SettleUploads());
    const absl::Time t0 = absl::Now();
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    ASSERT_OK(SelfSendRecv(src, dst, n, deadline));
    ASSERT_OK(RecordAndAwait(deadline));
    const absl::Duration took = absl::Now() - t0;
    ASSERT_OK(CudaStatus(cudaMemcpy(got.data(), dst, n, cudaMemcpyDeviceToHost), "D2H"));
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; ++i) {
      if (got[i] != want[i]) bad = i;
    }
    EXPECT_EQ(bad, -1) << "first differing byte at " << bad << ": got " << int(got[bad < 0 ? 0 : bad])
                       << ", want " << int(want[bad < 0 ? 0 : bad]);
    std::printf("self send/recv of %lld bytes: %s\n", static_cast<long long>(n), absl::FormatDuration(took).c_str());
  }
}

struct StridedCase {
  std::vector<int64_t> shape, src_strides, dst_strides;  // elements
  int64_t elem = 1;
};

int64_t SpanBytes(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t elem) {
  int64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) last += (shape[i] - 1) * strides[i];
  return (last + 1) * elem;
}

// A strided source and a differently strided destination: packed into a dense staging buffer with
// EnqueueBoxCopy(WithDenseSide(box, dst)), sent to self, unpacked with
// EnqueueBoxCopy(WithDenseSide(box, src)), all on one stream, as RunBatch does for staged chunks.
TEST_F(NcclSmokeTest, StridedThroughStagingIsByteExact) {
  const std::vector<StridedCase> cases = {
      {{300, 200}, {1000, 1}, {256, 1}, 2},             // padded rows -> 2-D copies
      {{4, 33, 50}, {40 * 64, 64, 1}, {35 * 56, 56, 1}, 4},  // padded at two levels -> 3-D copies
      {{64, 48}, {48, 1}, {1, 64}, 2},                  // transpose -> row-by-row fallback
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const StridedCase& c = cases[ci];
    SCOPED_TRACE(absl::StrCat("case ", ci));
    const CanonicalBox box = Canonicalize(c.shape, c.src_strides, c.dst_strides, c.elem);
    const int64_t src_bytes = SpanBytes(c.shape, c.src_strides, c.elem);
    const int64_t dst_bytes = SpanBytes(c.shape, c.dst_strides, c.elem);
    const int64_t n = box.bytes();
    std::vector<uint8_t> src_host(src_bytes), dst_host(dst_bytes);
    for (int64_t i = 0; i < src_bytes; ++i) src_host[i] = PatternByte(ci + 7, i);
    char* src = DeviceAlloc(src_bytes, 0);
    char* dst = DeviceAlloc(dst_bytes, 0xEE);
    char* stage_out = DeviceAlloc(n, 0);
    char* stage_in = DeviceAlloc(n, 0);
    ASSERT_TRUE(src && dst && stage_out && stage_in);
    ASSERT_OK(CudaStatus(cudaMemcpy(src, src_host.data(), src_bytes, cudaMemcpyHostToDevice), "H2D"));
    ASSERT_OK(SettleUploads());
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    ASSERT_OK(EnqueueBoxCopy(stage_out, src, ni::WithDenseSide(box, /*dense_dst=*/true), stream_));
    ASSERT_OK(SelfSendRecv(stage_out, stage_in, n, deadline));
    ASSERT_OK(EnqueueBoxCopy(dst, stage_in, ni::WithDenseSide(box, /*dense_dst=*/false), stream_));
    ASSERT_OK(RecordAndAwait(deadline));
    ASSERT_OK(CudaStatus(cudaMemcpy(dst_host.data(), dst, dst_bytes, cudaMemcpyDeviceToHost), "D2H"));
    // Reference: element by element; every byte not covered by the box keeps the 0xEE fill.
    std::vector<uint8_t> want(dst_bytes, 0xEE);
    const int rank = static_cast<int>(c.shape.size());
    std::vector<int64_t> idx(rank, 0);
    while (true) {
      int64_t so = 0, dof = 0;
      for (int d = 0; d < rank; ++d) {
        so += idx[d] * c.src_strides[d];
        dof += idx[d] * c.dst_strides[d];
      }
      std::memcpy(&want[dof * c.elem], &src_host[so * c.elem], c.elem);
      int d = rank - 1;
      for (; d >= 0; --d) {
        if (++idx[d] < c.shape[d]) break;
        idx[d] = 0;
      }
      if (d < 0) break;
    }
    int64_t bad = -1;
    for (int64_t i = 0; i < dst_bytes && bad < 0; ++i) {
      if (dst_host[i] != want[i]) bad = i;
    }
    EXPECT_EQ(bad, -1) << "first differing destination byte at " << bad;
  }
}

// A receive from self with no matching send is a malformed group: NCCL must report it (at
// ncclGroupEnd or as the communicator's async error) and not hang; either way the helpers return
// an error before the deadline, and the communicator can be aborted within a bound.
TEST_F(NcclSmokeTest, UnmatchedReceiveFromSelfFailsAndAborts) {
  char* dst = DeviceAlloc(4096, 0);
  ASSERT_NE(dst, nullptr);
  const absl::Duration limit = absl::Seconds(5);
  const absl::Time t0 = absl::Now();
  (void)ncclGroupStart();
  absl::Status calls = ni::P2P(comm_, /*send=*/false, dst, 4096, 0, stream_, "smoke lone recv");
  absl::Status s = ni::GroupEnd(comm_, "smoke lone recv group", Until(t0 + limit));
  if (calls.ok() && s.ok()) s = RecordAndAwait(t0 + limit);
  const absl::Duration took = absl::Now() - t0;
  EXPECT_FALSE(calls.ok() && s.ok()) << "a receive with no matching send completed";
  EXPECT_LT(took, limit + absl::Seconds(2)) << "the wait did not honour its deadline";
  std::printf("lone recv: calls=%s group=%s after %s\n", calls.ToString().c_str(), s.ToString().c_str(),
              absl::FormatDuration(took).c_str());
  absl::Duration abort_took;
  EXPECT_EQ(BoundedAbort(comm_, &abort_took), ncclSuccess);
  comm_ = nullptr;
  std::printf("ncclCommAbort after the failed group: %s\n", absl::FormatDuration(abort_took).c_str());
  (void)cudaGetLastError();
}

// The transport's Connect path when the other rank never joins: a 2-rank communicator whose rank 1
// never comes must end in DEADLINE_EXCEEDED at the deadline, and the half-made communicator must
// abort within a bound.
TEST(NcclSmokeInitTest, InitDeadlineWhenTheOtherRankNeverJoins) {
  SKIP_WITHOUT_GPU();
  ncclUniqueId uid;
  ASSERT_OK(NcclStatus(ncclGetUniqueId(&uid), "ncclGetUniqueId"));
  ncclComm_t comm = nullptr;
  const absl::Duration budget = absl::Seconds(3);
  const absl::Time t0 = absl::Now();
  absl::Status s = ni::InitComm(0, /*nranks=*/2, /*rank=*/0, uid, t0 + budget, "smoke lonely rank 0", &comm);
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(took, budget);
  EXPECT_LT(took, budget + absl::Seconds(2));
  absl::Duration abort_took;
  EXPECT_EQ(BoundedAbort(comm, &abort_took), ncclSuccess);
  std::printf("lonely rank 0: %s after %s; abort took %s\n", s.ToString().c_str(), absl::FormatDuration(took).c_str(),
              absl::FormatDuration(abort_took).c_str());
}

// The public transport on one GPU: a repeated ExportEndpoint for the same peer hands out the same
// unique id (no second NCCL bootstrap root), another peer gets another, Connect consumes it; a
// Connect whose peer never connects fails at its deadline without hanging.
TEST(NcclSmokeTransportTest, ReexportReusesTheIdAndConnectHonoursItsDeadline) {
  SKIP_WITHOUT_GPU();
  TransportConfig config;
  config.nccl.device = 0;
  auto a = CreateNcclTransport(config);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = CreateNcclTransport(config);
  ASSERT_TRUE(b.ok()) << b.status();
  Transport* lo = a->get();
  Transport* hi = b->get();
  if (hi->instance_id() < lo->instance_id()) std::swap(lo, hi);  // lo is rank 0 towards hi
  auto e1 = lo->ExportEndpoint(hi->instance_id());
  auto e2 = lo->ExportEndpoint(hi->instance_id());
  auto other = lo->ExportEndpoint(hi->instance_id() + "~other");
  ASSERT_TRUE(e1.ok() && e2.ok() && other.ok()) << e1.status() << e2.status() << other.status();
  EXPECT_EQ(*e1, *e2) << "a repeated export for the same peer must carry the same unique id";
  EXPECT_NE(*e1, *other) << "another peer must get another unique id";

  // hi (rank 1) joins lo's id; lo never connects: DEADLINE_EXCEEDED at the deadline.
  const absl::Duration budget = absl::Seconds(3);
  absl::Time t0 = absl::Now();
  auto p = hi->Connect(*e1, t0 + budget);
  absl::Duration took = absl::Now() - t0;
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kDeadlineExceeded) << p.status();
  EXPECT_LT(took, budget + kAbortBound) << "Connect (including its abort) took " << took;
  std::printf("rank 1 alone: %s after %s\n", p.status().ToString().c_str(), absl::FormatDuration(took).c_str());

  // lo (rank 0) now connects with the consumed-by-nobody id; its rank 1 has aborted: it fails too
  // (deadline or an NCCL error), within the bound, and consumes the id.
  auto hi_endpoint = hi->ExportEndpoint(lo->instance_id());
  ASSERT_TRUE(hi_endpoint.ok()) << hi_endpoint.status();
  t0 = absl::Now();
  auto q = lo->Connect(*hi_endpoint, t0 + budget);
  took = absl::Now() - t0;
  EXPECT_FALSE(q.ok());
  EXPECT_LT(took, budget + kAbortBound) << "Connect (including its abort) took " << took;
  std::printf("rank 0 after rank 1 aborted: %s after %s\n", q.status().ToString().c_str(),
              absl::FormatDuration(took).c_str());
  auto e3 = lo->ExportEndpoint(hi->instance_id());
  ASSERT_TRUE(e3.ok()) << e3.status();
  EXPECT_NE(*e1, *e3) << "Connect must consume the pending id; the next export creates a fresh one";
}

}  // namespace
}  // namespace wb::transport
