// cuda_ipc's VMM import (RawCudaVmmBuffer) on the CPU emulation of CUDA (tests/fake_cuda): a
// separate worker process (cuda_vmm_worker) allocates with cuMemCreate, exports the allocation as
// a POSIX fd and sends it over a Unix socket (SCM_RIGHTS); this process imports it into the
// transport and copies bytes out of and into the worker's memory, checked byte for byte on both
// sides. Emulated only: real GPUs run it through tests/gpu/run_gpu_checks.sh when one is lent.
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "transport/common.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/factory.h"
#include "base/fd_passing.h"
#include "transport/testing/test_buffer.h"

extern char** environ;

namespace wb::transport {
namespace {

constexpr char kWorker[] = "transport/cuda_ipc/cuda_vmm_worker";

// The worker process: its stdin/stdout, and the fd it sent.
class Worker {
 public:
  // Starts the worker (allocation of at least min_bytes on `device`, pattern of `seed`; with
  // `allocations` > 1 that many mapped back to back) and receives its fds. Check ok() after.
  Worker(int64_t min_bytes, uint64_t seed, int device, int allocations = 1) {
    int sp[2], o[2], i[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) != 0 || pipe2(o, O_CLOEXEC) != 0 || pipe2(i, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, o[1], 1);
    posix_spawn_file_actions_adddup2(&fa, i[0], 0);
    posix_spawn_file_actions_adddup2(&fa, sp[1], 3);
    std::vector<std::string> args = {kWorker, absl::StrCat(min_bytes), absl::StrCat(seed), absl::StrCat(device),
                                     absl::StrCat(allocations)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, kWorker, &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(o[1]);
    close(i[0]);
    close(sp[1]);
    out_ = o[0];
    in_ = i[1];
    auto msg = RecvWithFds(sp[0], 64, static_cast<size_t>(allocations), absl::Now() + absl::Seconds(30));
    close(sp[0]);
    if (!msg.ok() || msg->fds.size() != static_cast<size_t>(allocations)) return;
    fds_ = msg->fds;
    const std::string ready = Line();
    int64_t n = 0;
    if (ready.rfind("READY ", 0) == 0 && absl::SimpleAtoi(ready.substr(6), &n) && absl::StrCat(n) == msg->bytes) bytes_ = n;
  }
  ~Worker() {
    for (int fd : fds_) close(fd);
    if (in_ >= 0) close(in_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    if (out_ >= 0) close(out_);
  }
  bool ok() const { return pid_ > 0 && !fds_.empty() && bytes_ > 0; }
  int fd(size_t i = 0) const { return fds_.at(i); }
  int64_t allocation_bytes() const { return fds_.empty() ? 0 : bytes_ / static_cast<int64_t>(fds_.size()); }
  int64_t bytes() const { return bytes_; }
  std::string Ask(const std::string& cmd) {
    std::string line = cmd + "\n";
    if (write(in_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return "write failed";
    return Line();
  }

 private:
  std::string Line() {
    std::string line;
    const absl::Time end = absl::Now() + absl::Seconds(30);
    char ch;
    while (true) {
      pollfd p = {out_, POLLIN, 0};
      const int ms = static_cast<int>(absl::ToInt64Milliseconds(end - absl::Now()));
      if (ms <= 0 || poll(&p, 1, ms) <= 0) return line;
      if (read(out_, &ch, 1) != 1 || ch == '\n') return line;
      line.push_back(ch);
    }
  }
  pid_t pid_ = -1;
  int out_ = -1, in_ = -1;
  std::vector<int> fds_;  // one per allocation, in range order
  int64_t bytes_ = 0;
};

RawCudaVmmBuffer Raw(int fd, const std::string& key, int64_t alloc, int64_t off, int64_t size, int device, const std::string& label) {
  RawCudaVmmBuffer b;
  b.fd = fd;
  b.allocation_key = key;
  b.allocation_bytes = alloc;
  b.offset_bytes = off;
  b.size_bytes = size;
  b.device = device;
  b.node_id = DefaultNodeId();
  b.label = label;
  return b;
}

absl::StatusOr<RegionHandle> Import(Transport& t, const RawCudaVmmBuffer& b) {
  auto desc = CudaIpcDescriptorFromVmmFd(b);
  if (!desc.ok()) return desc.status();
  return t.ImportDescriptor(*desc);
}

CopyOp Contig(RegionHandle src, int64_t src_off, RegionHandle dst, int64_t dst_off, int64_t n) {
  CopyOp op;
  op.shape = {n};
  op.element_size = 1;
  op.src = {src, src_off, {1}};
  op.dst = {dst, dst_off, {1}};
  return op;
}

absl::Status Copy(Transport& t, std::vector<CopyOp> ops) {
  Batch b;
  b.tag = 1;
  b.ops = std::move(ops);
  auto id = t.Post(b);
  if (!id.ok()) return id.status();
  return t.Wait(*id, absl::Now() + absl::Seconds(30));
}

class CudaVmmImportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = CreateTransport("cuda_ipc", TransportConfig{});
    ASSERT_TRUE(t.ok()) << t.status();
    t_ = std::move(*t);
  }
  // An fd that is not an exported allocation: imports through it must fail (or hit the cache).
  int NotAnAllocation() {
    if (devnull_ < 0) devnull_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return devnull_;
  }
  void TearDown() override {
    if (devnull_ >= 0) close(devnull_);
  }
  std::unique_ptr<Transport> t_;
  int devnull_ = -1;
};

// Two buffers of one worker allocation (on device 1 of 2), imported through one fd and mapped
// once; bytes copied out of the first and into the second, checked on both sides.
TEST_F(CudaVmmImportTest, WorkerAllocationImportsOnceAndCopiesByteExact) {
  Worker w(3 << 20, 31, 1);
  ASSERT_TRUE(w.ok()) << "the worker did not start or send its fd";
  ASSERT_EQ(w.bytes(), 4 << 20) << "3 MiB rounded up to the 2 MiB granularity";
  constexpr int64_t kA = 4096 + 3, kB = (2 << 20) + 100, kN = 1 << 20;
  auto a = Import(*t_, Raw(w.fd(), "w1/alloc0", w.bytes(), kA, kN, 1, "buffer A"));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = Import(*t_, Raw(w.fd(), "w1/alloc0", w.bytes(), kB, kN, 1, "buffer B"));
  ASSERT_TRUE(b.ok()) << b.status();
  auto info = t_->Describe(*a);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->device, 1);
  EXPECT_EQ(info->kind, MemoryKind::kCuda);
  // The allocation is mapped once: a third buffer of it imports without reading the fd again.
  auto c = Import(*t_, Raw(NotAnAllocation(), "w1/alloc0", w.bytes(), 0, 4096, 1, "buffer C"));
  ASSERT_TRUE(c.ok()) << "not served from the mapping cache: " << c.status();

  auto local = MakeTestBuffer(MemoryKind::kCuda, kN, 0, "daemon staging");
  ASSERT_TRUE(local.ok()) << local.status();
  auto lh = t_->RegisterMemory((*local)->spec());
  ASSERT_TRUE(lh.ok()) << lh.status();
  // Out: worker bytes [kA, kA + kN) -> local.
  ASSERT_TRUE(Copy(*t_, {Contig(*a, 0, *lh, 0, kN)}).ok());
  auto got = (*local)->ReadAll();
  ASSERT_TRUE(got.ok());
  for (int64_t i = 0; i < kN; ++i) ASSERT_EQ((*got)[i], PatternByte(31, kA + i)) << "byte " << i;
  // In: local (pattern 77) -> worker bytes [kB, kB + kN), verified by the worker itself.
  ASSERT_TRUE((*local)->Fill(77).ok());
  ASSERT_TRUE(Copy(*t_, {Contig(*lh, 0, *b, 0, kN)}).ok());
  EXPECT_EQ(w.Ask(absl::StrCat("CHECK ", kB, " ", kN, " 77")), "OK");
  EXPECT_EQ(w.Ask(absl::StrCat("CHECK ", kA, " ", kN, " 31")), "BAD 0") << "sanity: the check can fail";
  EXPECT_EQ(w.Ask(absl::StrCat("CHECK ", kB + kN, " ", 4096, " 0")), "BAD 0") << "past the written range: not pattern 77";

  for (RegionHandle h : {*a, *b, *c, *lh}) ASSERT_TRUE(t_->Release(h).ok());
  // After the last release the mapping is gone: the cache no longer answers for the key.
  auto again = Import(*t_, Raw(NotAnAllocation(), "w1/alloc0", w.bytes(), 0, 4096, 1, "after release"));
  EXPECT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument) << again.status();
}

TEST_F(CudaVmmImportTest, RangePastTheAllocationIsInvalidArgumentAndMapsNothing) {
  Worker w(2 << 20, 5, 0);
  ASSERT_TRUE(w.ok());
  auto past = Import(*t_, Raw(w.fd(), "w2/a", w.bytes(), w.bytes() - 100, 101, 0, "one byte past"));
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
  EXPECT_NE(past.status().message().find("exceed the allocation"), std::string::npos) << past.status();
  auto huge = Import(*t_, Raw(w.fd(), "w2/a", w.bytes(), 1, INT64_MAX, 0, "overflowing size"));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument) << huge.status();
  // Nothing was mapped under the key: a bogus fd with it does not import.
  auto cached = Import(*t_, Raw(NotAnAllocation(), "w2/a", w.bytes(), 0, 100, 0, "probe"));
  EXPECT_EQ(cached.status().code(), absl::StatusCode::kInvalidArgument) << cached.status();
  // An allocation size larger than the real one: the driver refuses to map it.
  auto lying = Import(*t_, Raw(w.fd(), "w2/b", 2 * w.bytes(), 0, 100, 0, "lying size"));
  EXPECT_EQ(lying.status().code(), absl::StatusCode::kInvalidArgument) << lying.status();
  // The exact last byte is fine.
  auto last = Import(*t_, Raw(w.fd(), "w2/a", w.bytes(), w.bytes() - 100, 100, 0, "last bytes"));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(t_->Release(*last).ok());
}

// A buffer over several allocations of worker `w` (fds[i] under keys[i]), the buffer at `off` of
// the first.
RawCudaVmmBuffer Spanning(const Worker& w, const std::vector<std::string>& keys, const std::vector<int>& fds, int64_t off,
                          int64_t size, int device, const std::string& label) {
  const int64_t each = w.allocation_bytes();
  RawCudaVmmBuffer b = Raw(fds[0], keys[0], each, off, size, device, label);
  for (size_t i = 1; i < keys.size(); ++i) b.next_allocations.push_back({fds[i], keys[i], each});
  return b;
}

// PyTorch's expandable segments: the worker maps three allocations back to back in one range and
// registers one buffer that starts inside the first and ends inside the third. The daemon side
// maps them the same way (one reserved range, each allocation at its offset, access set once), so
// strided copies whose rows straddle both boundaries move the right bytes, out of and into the
// worker's memory, checked by the worker against its own range.
TEST_F(CudaVmmImportTest, BufferOverThreeAllocationsIsOneRangeAndStridedCopiesCrossTheBoundaries) {
  constexpr int64_t g = 2 << 20;
  Worker w(3 * g, 41, 1, 3);
  ASSERT_TRUE(w.ok()) << "the worker did not start or send its three fds";
  ASSERT_EQ(w.bytes(), 3 * g);
  const std::vector<std::string> keys = {"w4/a0", "w4/a1", "w4/a2"};
  const std::vector<int> fds = {w.fd(0), w.fd(1), w.fd(2)};
  constexpr int64_t kOff = 4096 + 7, kSize = 3 * g - kOff - 5000;
  auto a = Import(*t_, Spanning(w, keys, fds, kOff, kSize, 1, "spanning buffer"));
  ASSERT_TRUE(a.ok()) << a.status();
  auto info = t_->Describe(*a);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->device, 1);
  // The same key list shares the mapping: served from the cache without reading the fds.
  const std::vector<int> bogus = {NotAnAllocation(), devnull_, devnull_};
  auto again = Import(*t_, Spanning(w, keys, bogus, 100, 3 * g - 200, 1, "same list"));
  ASSERT_TRUE(again.ok()) << "not served from the mapping cache: " << again.status();

  // Rows of 300000 bytes every 650001: in range coordinates row 3 straddles the first boundary and
  // row 6 the second (asserted, so the box cannot silently stop crossing them).
  constexpr int64_t kS0 = 300, kPitch = 650001, kWidth = 300000, kRows = 9;
  auto straddles = [&](int64_t r, int64_t boundary) {
    const int64_t at = kOff + kS0 + r * kPitch;
    return at < boundary && at + kWidth > boundary;
  };
  ASSERT_TRUE(straddles(3, g) && straddles(6, 2 * g));
  ASSERT_LE(kS0 + (kRows - 1) * kPitch + kWidth, kSize);
  auto local = MakeTestBuffer(MemoryKind::kCuda, kRows * kWidth, 0, "daemon staging");
  ASSERT_TRUE(local.ok()) << local.status();
  auto lh = t_->RegisterMemory((*local)->spec());
  ASSERT_TRUE(lh.ok()) << lh.status();
  CopyOp out;
  out.shape = {kRows, kWidth};
  out.element_size = 1;
  out.src = {*a, kS0, {kPitch, 1}};
  out.dst = {*lh, 0, {kWidth, 1}};
  ASSERT_TRUE(Copy(*t_, {out}).ok());
  auto got = (*local)->ReadAll();
  ASSERT_TRUE(got.ok());
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kWidth; ++j) {
      ASSERT_EQ((*got)[r * kWidth + j], PatternByte(41, kOff + kS0 + r * kPitch + j)) << "row " << r << " byte " << j;
    }
  }
  // In: local (pattern 77) -> the same strided box, checked row by row by the worker.
  ASSERT_TRUE((*local)->Fill(77).ok());
  CopyOp in = out;
  std::swap(in.src, in.dst);
  in.src.region = *lh;
  in.dst.region = *a;
  ASSERT_TRUE(Copy(*t_, {in}).ok());
  EXPECT_EQ(w.Ask(absl::StrCat("CHECKROWS ", kOff + kS0, " ", kPitch, " ", kWidth, " ", kRows, " 77")), "OK");
  EXPECT_EQ(w.Ask(absl::StrCat("CHECKROWS ", kOff + kS0 + 1, " ", kPitch, " ", kWidth, " ", kRows, " 77")), "BAD row 0 byte 0")
      << "sanity: the check can fail";
  auto small = MakeTestBuffer(MemoryKind::kCuda, kWidth, 0, "one row");
  ASSERT_TRUE(small.ok());
  auto sh = t_->RegisterMemory((*small)->spec());
  ASSERT_TRUE(sh.ok());
  // Bytes between the rows kept the worker's pattern (the gap after row 3, next to the boundary).
  const int64_t gap = kS0 + 3 * kPitch + kWidth;
  ASSERT_TRUE(Copy(*t_, {Contig(*a, gap, *sh, 0, 4096)}).ok());
  auto between = (*small)->ReadAll();
  ASSERT_TRUE(between.ok());
  for (int64_t j = 0; j < 4096; ++j) ASSERT_EQ((*between)[j], PatternByte(41, kOff + gap + j)) << "byte " << j;

  // Another list (the last two allocations) maps its own range over the same memory: it sees the
  // bytes the first mapping wrote.
  auto tail = Import(*t_, Spanning(w, {"w4/a1", "w4/a2"}, {w.fd(1), w.fd(2)}, 0, 2 * g, 1, "last two"));
  ASSERT_TRUE(tail.ok()) << tail.status();
  const int64_t row6 = kOff + kS0 + 6 * kPitch - g;  // row 6 in the tail's coordinates
  ASSERT_TRUE(Copy(*t_, {Contig(*tail, row6, *sh, 0, kWidth)}).ok());
  auto row = (*small)->ReadAll();
  ASSERT_TRUE(row.ok());
  for (int64_t j = 0; j < kWidth; ++j) ASSERT_EQ((*row)[j], PatternByte(77, 6 * kWidth + j)) << "byte " << j;

  for (RegionHandle h : {*a, *again, *tail, *lh, *sh}) ASSERT_TRUE(t_->Release(h).ok());
  // The last Release undid the mapping: the cache no longer answers for the list.
  auto after = Import(*t_, Spanning(w, keys, bogus, 0, 3 * g, 1, "after release"));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kInvalidArgument) << after.status();
}

TEST_F(CudaVmmImportTest, SpanningBufferRefusalsNameTheAllocationAndMapNothing) {
  constexpr int64_t g = 2 << 20;
  Worker w(3 * g, 43, 0, 3);
  ASSERT_TRUE(w.ok());
  const std::vector<std::string> keys = {"w5/a0", "w5/a1", "w5/a2"};
  const std::vector<int> fds = {w.fd(0), w.fd(1), w.fd(2)};
  auto expect_invalid = [&](const absl::StatusOr<RegionHandle>& r, const std::string& words) {
    ASSERT_FALSE(r.ok()) << words;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status();
  };
  // Past the sum of the three.
  expect_invalid(Import(*t_, Spanning(w, keys, fds, g - 10, 2 * g + 11, 0, "one byte past")),
                 "exceed the 3 allocations of 6291456 bytes in all");
  // A list longer than the buffer: it ends in the second allocation.
  expect_invalid(Import(*t_, Spanning(w, keys, fds, 10, g, 0, "ends early")), "before its last allocation 'w5/a2'");
  // It starts past the first allocation.
  expect_invalid(Import(*t_, Spanning(w, keys, fds, g, g + 10, 0, "starts late")), "past its first allocation 'w5/a0'");
  // The middle fd is not an exported allocation: named, and the first import is undone.
  expect_invalid(Import(*t_, Spanning(w, keys, {w.fd(0), NotAnAllocation(), w.fd(2)}, 0, 3 * g, 0, "bad middle fd")),
                 "cuMemImportFromShareableHandle of allocation 'w5/a1'");
  // A size that is not what cuMemCreate was given (and not a multiple of the granularity).
  RawCudaVmmBuffer odd = Spanning(w, keys, fds, 0, 3 * g - 8192, 0, "odd size");
  odd.next_allocations[0].bytes = g - 4096;
  expect_invalid(Import(*t_, odd), "allocation 'w5/a1' size 2093056 is not a multiple of the granularity");
  // One key twice.
  auto twice = CudaIpcDescriptorFromVmmFd(Spanning(w, {"w5/a0", "w5/a0"}, {w.fd(0), w.fd(0)}, 0, g + 1, 0, "twice"));
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("names allocation 'w5/a0' twice"), std::string::npos) << twice.status();
  // Allocations of two GPUs cannot form one range.
  Worker other(g, 44, 1);
  ASSERT_TRUE(other.ok());
  RawCudaVmmBuffer mixed = Raw(w.fd(2), "w5/a2", g, 0, g + 1, 0, "two GPUs");
  mixed.next_allocations.push_back({other.fd(), "w6/a0", g});
  expect_invalid(Import(*t_, mixed), "allocation 'w6/a0' is on GPU 1, allocation 'w5/a2' on GPU 0");
  // Nothing of the refused lists was mapped: with bogus fds none of them imports.
  const std::vector<int> bogus = {NotAnAllocation(), devnull_, devnull_};
  EXPECT_FALSE(Import(*t_, Spanning(w, keys, bogus, 0, 3 * g, 0, "probe")).ok());
  // The valid list works (and the exact last byte is fine).
  auto ok = Import(*t_, Spanning(w, keys, fds, g - 1, 2 * g + 1, 0, "exact"));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(t_->Release(*ok).ok());
}

TEST_F(CudaVmmImportTest, NotAnExportedAllocationIsRefused) {
  auto r = Import(*t_, Raw(NotAnAllocation(), "w3/a", 2 << 20, 0, 100, 0, "dev null"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("cuMemImportFromShareableHandle"), std::string::npos) << r.status();
  EXPECT_FALSE(CudaIpcDescriptorFromVmmFd(Raw(-1, "k", 2 << 20, 0, 1, 0, "no fd")).ok());
  EXPECT_FALSE(CudaIpcDescriptorFromVmmFd(Raw(0, "", 2 << 20, 0, 1, 0, "no key")).ok());
}

}  // namespace
}  // namespace wb::transport
