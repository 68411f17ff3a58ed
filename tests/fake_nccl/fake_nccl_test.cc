// Unit tests of the NCCL emulation (fake_nccl.h) on the fake CUDA runtime: two ranks in two real
// processes (this binary re-executed as the child, WB_FAKE_NCCL_TEST_CHILD=<role>), plus
// one-process checks of argument validation and group semantics. Run with WB_FAKE_CUDA_DEVICES=2.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace wb::fake_nccl {
namespace {

uint8_t PatternByte(int seed, size_t i) { return static_cast<uint8_t>(i * 131 + seed * 7 + (i >> 8)); }

std::vector<uint8_t> Pattern(int seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = PatternByte(seed, i);
  return v;
}

// Polls until the communicator leaves ncclInProgress or `limit` passes; returns the last state.
ncclResult_t AwaitState(ncclComm_t comm, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  ncclResult_t state = ncclInProgress;
  while (true) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
    if (state != ncclInProgress || absl::Now() >= until) return state;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// Polls the event and (if not null) the communicator; "" when the event completed, else what went
// wrong.
std::string AwaitEvent(ncclComm_t comm, cudaEvent_t ev, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  while (true) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return "";
    if (e != cudaErrorNotReady) return absl::StrCat("event error ", cudaGetErrorString(e));
    ncclResult_t state = ncclSuccess;
    if (comm != nullptr) (void)ncclCommGetAsyncError(comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      return absl::StrCat("async error ", ncclGetErrorString(state), ": ", ncclGetLastError(comm));
    }
    if (absl::Now() >= until) return "timed out";
    absl::SleepFor(absl::Milliseconds(1));
  }
}

ncclComm_t InitNonBlocking(int device, int nranks, int rank, const ncclUniqueId& id, ncclResult_t* res) {
  (void)cudaSetDevice(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  *res = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
  return comm;
}

// The symmetric exchange both processes run: rank r sends Pattern(r, n) and receives the other
// rank's, for several sizes, in one group each (a deadlock-prone shape unless sends and receives
// progress together), then two sends and two receives of different sizes in one group (order).
std::string RunExchange(ncclComm_t comm, int rank, int device) {
  (void)cudaSetDevice(device);
  cudaStream_t stream = nullptr;
  cudaEvent_t ev = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    return "stream/event creation failed";
  }
  const int peer = 1 - rank;
  std::string out;
  auto one_group = [&](const std::vector<size_t>& sizes) -> std::string {
    std::vector<void*> sb(sizes.size()), rb(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      if (cudaMalloc(&sb[k], n + 1) != cudaSuccess || cudaMalloc(&rb[k], n + 1) != cudaSuccess) return "cudaMalloc";
      auto p = Pattern(rank * 10 + static_cast<int>(k), n);
      if (n > 0 && cudaMemcpy(sb[k], p.data(), n, cudaMemcpyHostToDevice) != cudaSuccess) return "H2D";
    }
    // A pageable-memory upload may still be landing when cudaMemcpy returns, and the NCCL stream is
    // non-blocking: finish the uploads first (the race failed this test under load in CI).
    if (cudaDeviceSynchronize() != cudaSuccess) return "cudaDeviceSynchronize";
    (void)ncclGroupStart();
    for (size_t k = 0; k < sizes.size(); ++k) {
      if (ncclSend(sb[k], sizes[k], ncclUint8, peer, comm, stream) != ncclSuccess) return "ncclSend";
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      if (ncclRecv(rb[k], sizes[k], ncclUint8, peer, comm, stream) != ncclSuccess) return "ncclRecv";
    }
    const ncclResult_t end = ncclGroupEnd();
    if (end != ncclInProgress) return absl::StrCat("ncclGroupEnd returned ", end, ", want ncclInProgress");
    if (ncclResult_t s = AwaitState(comm, absl::Seconds(20)); s != ncclSuccess) {
      return absl::StrCat("state after group: ", ncclGetErrorString(s));
    }
    if (cudaEventRecord(ev, stream) != cudaSuccess) return "cudaEventRecord";
    if (std::string w = AwaitEvent(comm, ev, absl::Seconds(30)); !w.empty()) return w;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<uint8_t> got(sizes[k]);
      if (sizes[k] > 0 && cudaMemcpy(got.data(), rb[k], sizes[k], cudaMemcpyDeviceToHost) != cudaSuccess) return "D2H";
      if (got != Pattern(peer * 10 + static_cast<int>(k), sizes[k])) {
        return absl::StrCat("rank ", rank, ": received bytes of message ", k, " (", sizes[k], " bytes) differ");
      }
      (void)cudaFree(sb[k]);
      (void)cudaFree(rb[k]);
    }
    return "";
  };
  for (size_t n : {size_t{0}, size_t{1}, size_t{4099}, (size_t{8} << 20) + 3}) {
    if (std::string e = one_group({n}); !e.empty()) return absl::StrCat(n, " bytes: ", e);
  }
  if (std::string e = one_group({100, 200000, 3}); !e.empty()) return absl::StrCat("three in one group: ", e);
  (void)cudaEventDestroy(ev);
  (void)cudaStreamDestroy(stream);
  return out;
}

// ---- the child process ----

bool ParseId(const char* hex, ncclUniqueId* id) {
  if (hex == nullptr) return false;
  const std::string bytes = absl::HexStringToBytes(hex);
  if (bytes.size() != NCCL_UNIQUE_ID_BYTES) return false;
  std::memcpy(id->internal, bytes.data(), NCCL_UNIQUE_ID_BYTES);
  return true;
}

// Waits (at most 60 s) for the parent to close our stdin.
void WaitForStdinClosed() {
  pollfd p = {0, POLLIN, 0};
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (absl::Now() < until) {
    if (poll(&p, 1, 100) > 0) {
      char c;
      if (read(0, &c, 1) <= 0) return;
    }
  }
}

int ChildMain(const std::string& role) {
  ncclUniqueId id;
  int device = 1;
  const char* dev = std::getenv("WB_FAKE_NCCL_TEST_DEVICE");
  if (dev != nullptr) (void)absl::SimpleAtoi(dev, &device);
  if (!ParseId(std::getenv("WB_FAKE_NCCL_TEST_ID"), &id)) {
    std::printf("BAD id\n");
    return 2;
  }
  ncclResult_t r;
  ncclComm_t comm = InitNonBlocking(device, 2, 1, id, &r);
  if (r != ncclInProgress && r != ncclSuccess) {
    std::printf("INIT %d\n", r);
    return 0;
  }
  r = AwaitState(comm, absl::Seconds(20));
  std::printf("INIT %d\n", r);
  std::fflush(stdout);
  if (r != ncclSuccess) {
    (void)ncclCommAbort(comm);
    WaitForStdinClosed();
    return 0;
  }
  if (role == "send100") {  // one send of 100 bytes to rank 0 (which receives a different count)
    cudaStream_t stream = nullptr;
    void* buf = nullptr;
    (void)cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    (void)cudaMalloc(&buf, 100);
    const ncclResult_t s = ncclSend(buf, 100, ncclUint8, 0, comm, stream);
    std::printf("SEND %d %d\n", s, AwaitState(comm, absl::Seconds(5)));
    std::fflush(stdout);
  }
  if (role == "exchange") {
    const std::string e = RunExchange(comm, 1, device);
    std::printf("%s\n", e.empty() ? "EXCHANGE OK" : ("EXCHANGE " + e).c_str());
    std::fflush(stdout);
  }
  WaitForStdinClosed();
  (void)ncclCommAbort(comm);
  return 0;
}

// ---- the parent's side ----

class Child {
 public:
  // Starts this binary as rank 1 with `role` on `device`.
  bool Start(const std::string& role, const ncclUniqueId& id, int device) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return false;
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
    env.push_back("WB_FAKE_NCCL_TEST_CHILD=" + role);
    env.push_back("WB_FAKE_NCCL_TEST_ID=" +
                  absl::BytesToHexString(absl::string_view(id.internal, NCCL_UNIQUE_ID_BYTES)));
    env.push_back(absl::StrCat("WB_FAKE_NCCL_TEST_DEVICE=", device));
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    char arg0[] = "fake_nccl_test_child";
    char* argv[] = {arg0, nullptr};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    const int rc = posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
    return rc == 0;
  }

  // The child's next output line, or "" after `limit`.
  std::string Line(absl::Duration limit) {
    const absl::Time until = absl::Now() + limit;
    while (true) {
      if (size_t nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      const int64_t ms = absl::ToInt64Milliseconds(until - absl::Now());
      if (ms <= 0) return "";
      pollfd p = {from_child_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 100))) <= 0) continue;
      char chunk[4096];
      const ssize_t n = read(from_child_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buf_.append(chunk, n);
    }
  }

  void Kill9() {
    if (pid_ > 0) kill(pid_, SIGKILL);
  }

  // Closes the child's stdin (it exits) and reaps it (bounded; then SIGKILL).
  ~Child() {
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ >= 0) close(from_child_);
    if (pid_ <= 0) return;
    const absl::Time until = absl::Now() + absl::Seconds(10);
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (absl::Now() > until) {
        kill(pid_, SIGKILL);
        (void)waitpid(pid_, &status, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buf_;
};

class FakeNcclTwoProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
    ASSERT_GE(n, 2) << "run with WB_FAKE_CUDA_DEVICES=2";
    ASSERT_EQ(ncclGetUniqueId(&id_), ncclSuccess);
  }

  // Rank 0 on device 0 with a child as rank 1 in `role`; waits until both are up.
  ncclComm_t Pair(Child& child, const std::string& role) {
    if (!child.Start(role, id_, 1)) {
      ADD_FAILURE() << "spawn failed";
      return nullptr;
    }
    ncclResult_t r;
    ncclComm_t comm = InitNonBlocking(0, 2, 0, id_, &r);
    EXPECT_EQ(r, ncclInProgress);
    EXPECT_EQ(AwaitState(comm, absl::Seconds(20)), ncclSuccess) << ncclGetLastError(comm);
    EXPECT_EQ(child.Line(absl::Seconds(20)), "INIT 0");
    return comm;
  }

  ncclUniqueId id_;
};

TEST_F(FakeNcclTwoProcessTest, TwoProcessesExchangeBytes) {
  Child child;
  ncclComm_t comm = Pair(child, "exchange");
  ASSERT_NE(comm, nullptr);
  int count = 0, rank = -1, device = -1;
  EXPECT_EQ(ncclCommCount(comm, &count), ncclSuccess);
  EXPECT_EQ(ncclCommUserRank(comm, &rank), ncclSuccess);
  EXPECT_EQ(ncclCommCuDevice(comm, &device), ncclSuccess);
  EXPECT_EQ(count, 2);
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(device, 0);
  EXPECT_EQ(RunExchange(comm, 0, 0), "");
  EXPECT_EQ(child.Line(absl::Seconds(30)), "EXCHANGE OK");
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
}

TEST_F(FakeNcclTwoProcessTest, MissingRankStaysInProgressUntilAbort) {
  ncclResult_t r;
  ncclComm_t comm = InitNonBlocking(0, 2, 0, id_, &r);
  ASSERT_EQ(r, ncclInProgress);
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(AwaitState(comm, absl::Seconds(1)), ncclInProgress);
  // Calls on a communicator still in progress are invalid usage.
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 64), cudaSuccess);
  EXPECT_EQ(ncclSend(buf, 64, ncclUint8, 1, comm, nullptr), ncclInvalidUsage);
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  // The same rank of another id binds fine; the same rank of this id after abort too.
  ncclComm_t again = InitNonBlocking(0, 2, 0, id_, &r);
  EXPECT_EQ(r, ncclInProgress);
  // A second rank 0 of the same id while the first is alive: duplicate rank.
  ncclComm_t dup = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  EXPECT_EQ(ncclCommInitRankConfig(&dup, 2, id_, 0, &config), ncclInvalidUsage);
  EXPECT_EQ(ncclCommAbort(again), ncclSuccess);
  (void)cudaFree(buf);
}

TEST_F(FakeNcclTwoProcessTest, AbortUnblocksStreamWork) {
  Child child;
  ncclComm_t comm = Pair(child, "idle");
  ASSERT_NE(comm, nullptr);
  cudaStream_t stream;
  cudaEvent_t ev;
  void* buf = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&buf, 1 << 20), cudaSuccess);
  // The child never posts the matching send: the receive waits on the stream.
  ASSERT_EQ(ncclRecv(buf, 1 << 20, ncclUint8, 1, comm, stream), ncclInProgress);
  ASSERT_EQ(AwaitState(comm, absl::Seconds(5)), ncclSuccess);
  ASSERT_EQ(cudaEventRecord(ev, stream), cudaSuccess);
  EXPECT_EQ(AwaitEvent(comm, ev, absl::Milliseconds(300)), "timed out");
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
  (void)AwaitEvent(nullptr, ev, absl::Seconds(2));
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess) << "the aborted receive still blocks its stream";
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  (void)cudaFree(buf);
}

TEST_F(FakeNcclTwoProcessTest, PeerKilledIsRemoteError) {
  Child child;
  ncclComm_t comm = Pair(child, "idle");
  ASSERT_NE(comm, nullptr);
  cudaStream_t stream;
  cudaEvent_t ev;
  void* buf = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&buf, 1 << 20), cudaSuccess);
  ASSERT_EQ(ncclRecv(buf, 1 << 20, ncclUint8, 1, comm, stream), ncclInProgress);
  ASSERT_EQ(AwaitState(comm, absl::Seconds(5)), ncclSuccess);
  ASSERT_EQ(cudaEventRecord(ev, stream), cudaSuccess);
  child.Kill9();
  const absl::Time t0 = absl::Now();
  const std::string w = AwaitEvent(comm, ev, absl::Seconds(5));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  ncclResult_t state = ncclSuccess;
  EXPECT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclRemoteError) << w;
  EXPECT_NE(std::string(ncclGetLastError(comm)).find("rank 1"), std::string::npos) << ncclGetLastError(comm);
  // Like a real NCCL kernel, the failed receive does not complete; abort ends it.
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
  (void)AwaitEvent(nullptr, ev, absl::Seconds(2));
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess);
  (void)cudaFree(buf);
}

TEST_F(FakeNcclTwoProcessTest, CountMismatchIsInvalidUsage) {
  Child child;
  ncclComm_t comm = Pair(child, "send100");
  ASSERT_NE(comm, nullptr);
  cudaStream_t stream;
  cudaEvent_t ev;
  void* buf = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&buf, 200), cudaSuccess);
  ASSERT_EQ(ncclRecv(buf, 200, ncclUint8, 1, comm, stream), ncclInProgress);
  // The child sends at once: the mismatch may already be reported when the launch is observed.
  const ncclResult_t launched = AwaitState(comm, absl::Seconds(5));
  ASSERT_TRUE(launched == ncclSuccess || launched == ncclInvalidUsage) << ncclGetErrorString(launched);
  ASSERT_EQ(cudaEventRecord(ev, stream), cudaSuccess);
  EXPECT_EQ(child.Line(absl::Seconds(10)), "SEND 7 0");
  const std::string w = AwaitEvent(comm, ev, absl::Seconds(5));
  EXPECT_NE(w.find("matched its ncclSend of 100 bytes"), std::string::npos) << w;
  ncclResult_t state = ncclSuccess;
  EXPECT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclInvalidUsage);
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
  (void)cudaFree(buf);
}

TEST_F(FakeNcclTwoProcessTest, TwoRanksOnOneDeviceAreRefused) {
  Child child;
  ASSERT_TRUE(child.Start("idle", id_, /*device=*/0));
  ncclResult_t r;
  ncclComm_t comm = InitNonBlocking(0, 2, 0, id_, &r);
  ASSERT_EQ(r, ncclInProgress);
  EXPECT_EQ(AwaitState(comm, absl::Seconds(20)), ncclInvalidUsage);
  EXPECT_NE(std::string(ncclGetLastError(comm)).find("Duplicate GPU"), std::string::npos) << ncclGetLastError(comm);
  EXPECT_EQ(child.Line(absl::Seconds(20)), absl::StrCat("INIT ", static_cast<int>(ncclInvalidUsage)));
  EXPECT_EQ(ncclCommAbort(comm), ncclSuccess);
}

// ---- one process ----

class FakeNcclOneRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(ncclGetUniqueId(&id_), ncclSuccess);
    ncclResult_t r;
    comm_ = InitNonBlocking(0, 1, 0, id_, &r);
    ASSERT_EQ(r, ncclInProgress);
    ASSERT_EQ(AwaitState(comm_, absl::Seconds(5)), ncclSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&a_, kN), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&b_, kN), cudaSuccess);
  }
  void TearDown() override {
    if (comm_ != nullptr) {
      EXPECT_EQ(ncclCommAbort(comm_), ncclSuccess);
    }
    (void)cudaFree(a_);
    (void)cudaFree(b_);
  }
  static constexpr size_t kN = 1 << 16;
  ncclUniqueId id_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_ = nullptr;
  void* a_ = nullptr;
  void* b_ = nullptr;
};

TEST_F(FakeNcclOneRankTest, SendToSelfIsByteExactAndGroupEndIsInProgressFirst) {
  const auto want = Pattern(3, kN);
  ASSERT_EQ(cudaMemcpy(a_, want.data(), kN, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the pageable upload may still be landing
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclSend(a_, kN / 4, ncclFloat32, 0, comm_, stream_), ncclSuccess);
  ASSERT_EQ(ncclRecv(b_, kN / 2, ncclBfloat16, 0, comm_, stream_), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclInProgress);
  ncclResult_t state = ncclSuccess;
  ASSERT_EQ(ncclCommGetAsyncError(comm_, &state), ncclSuccess);
  EXPECT_EQ(state, ncclInProgress) << "the group reaches its stream only after ncclGroupEnd returned";
  EXPECT_EQ(ncclSend(a_, 1, ncclUint8, 0, comm_, stream_), ncclInvalidUsage) << "a call while in progress";
  ASSERT_EQ(AwaitState(comm_, absl::Seconds(5)), ncclSuccess);
  ASSERT_EQ(cudaEventRecord(ev_, stream_), cudaSuccess);
  ASSERT_EQ(AwaitEvent(comm_, ev_, absl::Seconds(5)), "");
  std::vector<uint8_t> got(kN);
  ASSERT_EQ(cudaMemcpy(got.data(), b_, kN, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(got == want);
}

TEST_F(FakeNcclOneRankTest, UnmatchedSelfReceiveIsInvalidUsageAtGroupEnd) {
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclRecv(b_, kN, ncclUint8, 0, comm_, stream_), ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
  EXPECT_NE(std::string(ncclGetLastError(comm_)).find("without a matching send"), std::string::npos);
}

TEST_F(FakeNcclOneRankTest, SelfSizesMustMatch) {
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclSend(a_, 100, ncclUint8, 0, comm_, stream_), ncclSuccess);
  ASSERT_EQ(ncclRecv(b_, 101, ncclUint8, 0, comm_, stream_), ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
}

TEST_F(FakeNcclOneRankTest, BadArgumentsPoisonTheGroup) {
  std::vector<char> host(64);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  EXPECT_EQ(ncclSend(host.data(), 64, ncclUint8, 0, comm_, stream_), ncclInvalidArgument) << "host memory";
  EXPECT_EQ(ncclSend(a_, kN + 1, ncclUint8, 0, comm_, stream_), ncclInvalidArgument) << "past the allocation";
  EXPECT_EQ(ncclSend(a_, 1, ncclUint8, 1, comm_, stream_), ncclInvalidArgument) << "no rank 1";
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidArgument);
  // Nothing was launched, and the communicator is still usable.
  ncclResult_t state = ncclInProgress;
  ASSERT_EQ(ncclCommGetAsyncError(comm_, &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage) << "ncclGroupEnd without ncclGroupStart";
  EXPECT_EQ(ncclCommAbort(comm_), ncclSuccess);
  EXPECT_EQ(ncclSend(a_, 1, ncclUint8, 0, comm_, stream_), ncclInvalidArgument) << "use after abort";
  comm_ = nullptr;
}

TEST(FakeNcclApiTest, VersionAndErrorStrings) {
  int v = 0;
  EXPECT_EQ(ncclGetVersion(&v), ncclSuccess);
  EXPECT_EQ(v, NCCL_VERSION_CODE);
  EXPECT_STREQ(ncclGetErrorString(ncclRemoteError), "remote process exited or there was a network error");
  ncclUniqueId a, b;
  ASSERT_EQ(ncclGetUniqueId(&a), ncclSuccess);
  ASSERT_EQ(ncclGetUniqueId(&b), ncclSuccess);
  EXPECT_NE(std::memcmp(a.internal, b.internal, NCCL_UNIQUE_ID_BYTES), 0);
  ncclUniqueId junk = {};
  ncclComm_t comm = nullptr;
  EXPECT_EQ(ncclCommInitRankConfig(&comm, 2, junk, 0, nullptr), ncclInvalidArgument);
  ncclConfig_t uninitialised = {};
  EXPECT_EQ(ncclCommInitRankConfig(&comm, 2, a, 0, &uninitialised), ncclInvalidArgument);
  EXPECT_EQ(ncclCommInitRankConfig(&comm, 2, a, 2, nullptr), ncclInvalidArgument);
}

}  // namespace
}  // namespace wb::fake_nccl

int main(int argc, char** argv) {
  if (const char* role = std::getenv("WB_FAKE_NCCL_TEST_CHILD"); role != nullptr) {
    return wb::fake_nccl::ChildMain(role);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
