// cuda_ipc's VMM import (RawCudaVmmBuffer) on the CPU emulation of CUDA (tools/fake_cuda): a
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
#include "transport/cuda_ipc.h"
#include "transport/factory.h"
#include "transport/fd_passing.h"
#include "transport/test_buffer.h"

extern char** environ;

namespace wb::transport {
namespace {

constexpr char kWorker[] = "transport/cuda_vmm_worker";

// The worker process: its stdin/stdout, and the fd it sent.
class Worker {
 public:
  // Starts the worker (allocation of at least min_bytes on `device`, pattern of `seed`) and
  // receives its fd. Check ok() after.
  Worker(int64_t min_bytes, uint64_t seed, int device) {
    int sp[2], o[2], i[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) != 0 || pipe2(o, O_CLOEXEC) != 0 || pipe2(i, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, o[1], 1);
    posix_spawn_file_actions_adddup2(&fa, i[0], 0);
    posix_spawn_file_actions_adddup2(&fa, sp[1], 3);
    std::vector<std::string> args = {kWorker, absl::StrCat(min_bytes), absl::StrCat(seed), absl::StrCat(device)};
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
    auto msg = RecvWithFds(sp[0], 64, 1, absl::Now() + absl::Seconds(30));
    close(sp[0]);
    if (!msg.ok() || msg->fds.size() != 1) return;
    fd_ = msg->fds[0];
    const std::string ready = Line();
    int64_t n = 0;
    if (ready.rfind("READY ", 0) == 0 && absl::SimpleAtoi(ready.substr(6), &n) && absl::StrCat(n) == msg->bytes) bytes_ = n;
  }
  ~Worker() {
    if (fd_ >= 0) close(fd_);
    if (in_ >= 0) close(in_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    if (out_ >= 0) close(out_);
  }
  bool ok() const { return pid_ > 0 && fd_ >= 0 && bytes_ > 0; }
  int fd() const { return fd_; }
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
  int out_ = -1, in_ = -1, fd_ = -1;
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
    devnull_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
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
