// The conformance suite against cuda_ipc on the CPU emulation of CUDA (tests/fake_cuda): this
// process and real peer processes (transport_peer_emulated, the same peer main linked with the
// fake) exchange fake-device buffers through emulated CUDA IPC (shm segments). It checks our
// logic (handles, allocation offsets, stream/event ordering, bounds) on every CI run; the real
// GPU run is cuda_ipc_conformance_test (tests/gpu/run_gpu_checks.sh).
//
// Besides the shared suite (whose buffers are always whole allocations), cuda_ipc's own case: a
// region that starts INSIDE its allocation, exported from one process and written by another,
// and a raw worker handle with an offset, both of which depend on cuMemGetAddressRange and the
// descriptor's allocation offset.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/fake_cuda/fake_cuda.h"
#include "transport/common.h"
#include "transport/testing/conformance.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/factory.h"
#include "transport/testing/peer_process.h"
#include "transport/testing/test_buffer.h"

extern char** environ;

namespace wb::transport {
namespace {

constexpr char kPeer[] = "transport/cuda_ipc/transport_peer_emulated";

// The suite skips GPU kinds without a visible device; here it must run: fail loudly instead.
TEST(CudaIpcEmulatedTest, RunsOnTheFakeRuntime) {
  ASSERT_GE(VisibleCudaDevices(), 1) << "the fake CUDA runtime is not linked in (or WB_FAKE_CUDA_DEVICES=0)";
  auto b = MakeTestBuffer(MemoryKind::kCuda, 4096, 0, "probe");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(fake_cuda::IsDevicePointer((*b)->spec().base)) << "device memory does not come from the fake";
}

CopyOp Contig(int64_t src_off, int64_t dst_off, int64_t n) {
  CopyOp op;
  op.shape = {n};
  op.element_size = 1;
  op.src = {{}, src_off, {1}};
  op.dst = {{}, dst_off, {1}};
  return op;
}

// A region at an odd offset inside a larger allocation, exported to a peer process that writes
// into it and reads from it: the bytes must land at that offset of OUR allocation.
TEST(CudaIpcEmulatedTest, SubRegionInsideAnAllocationCrossesProcessesAtItsOffset) {
  constexpr int64_t kAlloc = 1 << 20, kOff = 12345, kSub = 64 << 10, kPeerSize = 128 << 10;
  auto t = CreateTransport("cuda_ipc", TransportConfig{});
  ASSERT_TRUE(t.ok()) << t.status();
  auto local = MakeTestBuffer(MemoryKind::kCuda, kAlloc, 0, "whole allocation");
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE((*local)->Fill(11).ok());
  MemorySpec sub = (*local)->spec();
  sub.base = static_cast<char*>(sub.base) + kOff;
  sub.size_bytes = kSub;
  sub.label = "sub-region";
  auto region = (*t)->RegisterMemory(sub);
  ASSERT_TRUE(region.ok()) << region.status();

  auto peer = PeerProcess::Spawn(kPeer, {"--kind=cuda_ipc", "--memory=cuda", absl::StrCat("--size=", kPeerSize),
                                         "--seed=22", "--device=0"});
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto inst = (*peer)->Command("ID");
  ASSERT_TRUE(inst.ok()) << inst.status();
  auto my_ep = (*t)->ExportEndpoint(*inst);
  auto peer_ep = (*peer)->Command("ENDPOINT " + (*t)->instance_id());
  ASSERT_TRUE(my_ep.ok() && peer_ep.ok());
  ASSERT_TRUE((*t)->Connect(*HexDecode(*peer_ep), absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE((*peer)->Command("CONNECT " + HexEncode(*my_ep)).ok());
  auto desc = (*t)->ExportDescriptor(*region);
  ASSERT_TRUE(desc.ok()) << desc.status();
  auto imp = (*peer)->Command("IMPORT " + HexEncode(*desc));
  ASSERT_TRUE(imp.ok()) << imp.status();

  // Peer: its bytes [100, 100 + kSub - 50) -> our sub-region at 50; then our sub-region's first
  // 4096 bytes -> its buffer at kPeerSize - 4096.
  MirrorBatch m;
  m.tag = 1;
  m.ops.push_back({true, Contig(100, 50, kSub - 50)});
  m.ops.push_back({false, Contig(0, kPeerSize - 4096, 4096)});
  auto id = (*peer)->Command("POST " + HexEncode(EncodeMirror(m)));
  ASSERT_TRUE(id.ok()) << id.status();
  auto waited = (*peer)->Command(absl::StrCat("WAIT ", *id, " 30000"));
  ASSERT_TRUE(waited.ok()) << waited.status();

  auto got = (*local)->ReadAll();
  ASSERT_TRUE(got.ok());
  // The second op reads bytes the first op writes (same stream order is not promised across ops
  // of one batch), so only its untouched part [0, 50) is checked on the peer side below.
  for (int64_t i = 0; i < kAlloc; ++i) {
    const bool written = i >= kOff + 50 && i < kOff + kSub;
    const uint8_t want = written ? PatternByte(22, 100 + (i - kOff - 50)) : PatternByte(11, i);
    ASSERT_EQ((*got)[i], want) << "byte " << i << " of the allocation (sub-region starts at " << kOff << ")";
  }
  auto back = (*peer)->Command(absl::StrCat("READ ", kPeerSize - 4096, " 50"));
  ASSERT_TRUE(back.ok()) << back.status();
  auto back_bytes = HexDecode(*back);
  ASSERT_TRUE(back_bytes.ok());
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(static_cast<uint8_t>((*back_bytes)[i]), PatternByte(11, kOff + i)) << "peer byte " << i;
  }
}

// The bytes the fake_cudart_ipc_child helper fills its allocation with.
uint8_t ChildPattern(uint64_t seed, size_t i) { return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff); }

// A "worker" process (fake_cudart_ipc_child hold) that keeps `size` device bytes filled with
// ChildPattern(seed) until its stdin closes; `env` is added to its environment.
struct HoldingChild {
  pid_t pid = -1;
  int out = -1, in = -1;
  std::string handle;  // its raw 64-byte IPC handle
  ~HoldingChild() {
    if (in >= 0) close(in);  // the helper exits on EOF
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
    if (out >= 0) close(out);
  }
};

absl::Status SpawnHoldingChild(size_t size, int seed, const std::vector<std::string>& env, HoldingChild* c) {
  int out[2];
  int in[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(in, O_CLOEXEC) != 0) return absl::InternalError("pipe2");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  std::string bin = "tests/fake_cuda/fake_cudart_ipc_child", a1 = "hold", a2 = absl::StrCat(size), a3 = absl::StrCat(seed);
  char* argv[] = {bin.data(), a1.data(), a2.data(), a3.data(), nullptr};
  std::vector<std::string> env_strings(env.begin(), env.end());
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int rc = posix_spawn(&c->pid, bin.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  close(in[0]);
  c->out = out[0];
  c->in = in[1];
  if (rc != 0) return absl::InternalError(absl::StrCat("posix_spawn: ", strerror(rc)));
  std::string line;
  char ch;
  pollfd p = {c->out, POLLIN, 0};
  while (poll(&p, 1, 30000) == 1 && read(c->out, &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  if (line.rfind("READY ", 0) != 0) return absl::InternalError(absl::StrCat("child said '", line, "'"));
  auto handle = HexDecode(line.substr(6));
  if (!handle.ok()) return handle.status();
  c->handle = *handle;
  return absl::OkStatus();
}

// Copies `op` (its regions set here) from `src` to `dst` in one batch and waits for it.
absl::Status CopyOnce(Transport& t, RegionHandle src, RegionHandle dst, CopyOp op, uint64_t tag) {
  op.src.region = src;
  op.dst.region = dst;
  Batch b;
  b.tag = tag;
  b.ops.push_back(std::move(op));
  absl::StatusOr<BatchId> id = t.Post(b);
  if (!id.ok()) return id.status();
  return t.Wait(*id, absl::Now() + absl::Seconds(30));
}

// A worker's raw IPC handle with an offset (what the daemon imports via CudaIpcDescriptorFromRawHandle).
TEST(CudaIpcEmulatedTest, RawWorkerHandleWithOffset) {
  constexpr size_t kWorkerAlloc = 300000;
  HoldingChild child;
  ASSERT_TRUE(SpawnHoldingChild(kWorkerAlloc, 9, {}, &child).ok());
  auto handle = std::optional<std::string>(child.handle);

  auto t = CreateTransport("cuda_ipc", TransportConfig{});
  ASSERT_TRUE(t.ok()) << t.status();
  auto local = MakeTestBuffer(MemoryKind::kCuda, 8192, 0, "local");
  ASSERT_TRUE(local.ok());
  ASSERT_TRUE((*local)->Fill(3).ok());
  auto lr = (*t)->RegisterMemory((*local)->spec());
  ASSERT_TRUE(lr.ok());
  RawCudaIpcBuffer raw;
  raw.ipc_handle = *handle;
  raw.offset_bytes = 1000;
  raw.size_bytes = 5000;
  raw.node_id = DefaultNodeId();
  raw.label = "worker buffer";
  auto desc = CudaIpcDescriptorFromRawHandle(raw);
  ASSERT_TRUE(desc.ok()) << desc.status();
  auto wr = (*t)->ImportDescriptor(*desc);
  ASSERT_TRUE(wr.ok()) << wr.status();
  ASSERT_TRUE(CopyOnce(**t, *wr, *lr, Contig(0, 100, 5000), 5).ok());
  auto got = (*local)->ReadAll();
  ASSERT_TRUE(got.ok());
  for (int64_t i = 0; i < 8192; ++i) {
    const bool written = i >= 100 && i < 5100;
    ASSERT_EQ((*got)[i], written ? ChildPattern(9, 1000 + (i - 100)) : PatternByte(3, i)) << "byte " << i;
  }
  // A raw buffer that runs past the worker's allocation is refused at import.
  raw.offset_bytes = kWorkerAlloc - 10;
  raw.size_bytes = 11;
  auto too_far = (*t)->ImportDescriptor(*CudaIpcDescriptorFromRawHandle(raw));
  EXPECT_EQ(too_far.status().code(), absl::StatusCode::kInvalidArgument) << too_far.status();
  EXPECT_TRUE((*t)->Release(*wr).ok());
}

// A worker that numbers GPUs differently (CUDA_VISIBLE_DEVICES=1: its GPU 0 is our GPU 1, as in a
// container) registers its buffer as "gpu 0". With the GPU's UUID the import finds GPU 1 at once;
// without it, it maps the memory where it lives (cudaPointerGetAttributes) - either way Describe
// reports GPU 1 and copies read the right bytes.
TEST(CudaIpcEmulatedTest, RawHandleOfAWorkerThatNumbersGpusDifferently) {
  ASSERT_GE(fake_cuda::PhysicalDevice(1), 1) << "runs with WB_FAKE_CUDA_DEVICES=2";
  constexpr size_t kWorkerAlloc = 100000;
  HoldingChild child;
  ASSERT_TRUE(SpawnHoldingChild(kWorkerAlloc, 4, {"CUDA_VISIBLE_DEVICES=1"}, &child).ok());
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 1), cudaSuccess);
  const std::string uuid1(prop.uuid.bytes, sizeof(prop.uuid.bytes));
  auto t = CreateTransport("cuda_ipc", TransportConfig{});
  ASSERT_TRUE(t.ok()) << t.status();
  for (bool with_uuid : {false, true}) {
    SCOPED_TRACE(with_uuid ? "with the GPU's UUID" : "without UUID");
    RawCudaIpcBuffer raw;
    raw.ipc_handle = child.handle;
    raw.size_bytes = 4096;
    raw.device = 0;  // the worker's numbering
    if (with_uuid) raw.device_uuid = uuid1;
    raw.node_id = DefaultNodeId();
    raw.label = "worker buffer";
    auto wr = (*t)->ImportDescriptor(*CudaIpcDescriptorFromRawHandle(raw));
    ASSERT_TRUE(wr.ok()) << wr.status();
    auto info = (*t)->Describe(*wr);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->device, 1) << "the buffer lives on our GPU 1";
    auto local = MakeTestBuffer(MemoryKind::kCuda, 4096, 1, "local");
    ASSERT_TRUE(local.ok());
    auto lr = (*t)->RegisterMemory((*local)->spec());
    ASSERT_TRUE(lr.ok()) << lr.status();
    ASSERT_TRUE(CopyOnce(**t, *wr, *lr, Contig(0, 0, 4096), 6).ok());
    auto got = (*local)->ReadAll();
    ASSERT_TRUE(got.ok());
    for (size_t i = 0; i < 4096; ++i) ASSERT_EQ((*got)[i], ChildPattern(4, i)) << "byte " << i;
    EXPECT_TRUE((*t)->Release(*lr).ok());
    EXPECT_TRUE((*t)->Release(*wr).ok());
  }
}

// A raw handle of THIS process's own allocation cannot be opened (CUDA refuses same-process IPC).
TEST(CudaIpcEmulatedTest, RawHandleOfOwnAllocationIsRefused) {
  auto t = CreateTransport("cuda_ipc", TransportConfig{});
  ASSERT_TRUE(t.ok()) << t.status();
  auto local = MakeTestBuffer(MemoryKind::kCuda, 4096, 0, "local");
  ASSERT_TRUE(local.ok());
  cudaIpcMemHandle_t h;
  ASSERT_EQ(cudaIpcGetMemHandle(&h, (*local)->spec().base), cudaSuccess);
  RawCudaIpcBuffer raw;
  raw.ipc_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  raw.size_bytes = 4096;
  raw.node_id = DefaultNodeId();
  raw.label = "own";
  auto imported = (*t)->ImportDescriptor(*CudaIpcDescriptorFromRawHandle(raw));
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument) << imported.status();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the transport clears the CUDA error it handled";
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(CudaIpcEmulated, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"cuda_ipc", MemoryKind::kCuda, /*min_gpus=*/1,
                                                            /*large_op_bytes=*/int64_t{64} << 20,
                                                            /*peer_device=*/0, /*peer_binary=*/kPeer}),
                         ConformanceName);

}  // namespace wb::transport
