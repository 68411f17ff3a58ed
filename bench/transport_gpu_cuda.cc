// GPU figures of //bench:transport (see transport_gpu.h). Written without a GPU at hand: every CUDA
// call is checked and a failure turns into {"gpu_error": ...} rather than a crash.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/transport_gpu.h"
#include "transport/factory.h"

namespace wb::transport {
namespace {

std::string Hex(const std::string& b) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : b) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

std::string Unhex(const std::string& h) {
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<char>(v(h[i]) * 16 + v(h[i + 1])));
  return out;
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define GPU_CHECK(expr)                                                                       \
  do {                                                                                        \
    cudaError_t e_ = (expr);                                                                  \
    if (e_ != cudaSuccess) return nlohmann::json{{"gpu_error", absl::StrCat(#expr, ": ", cudaGetErrorString(e_))}}; \
  } while (0)

// Reads one line from fd within `ms`.
bool ReadLine(int fd, std::string* line, int ms) {
  const auto t0 = std::chrono::steady_clock::now();
  char c;
  while (true) {
    const int left = ms - static_cast<int>(Since(t0) * 1000);
    if (left <= 0) return false;
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) continue;
    if (read(fd, &c, 1) != 1) return false;
    if (c == '\n') return true;
    line->push_back(c);
  }
}

nlohmann::json Measure(int64_t bytes, int reps, const std::string& endpoint_hex, const std::string& desc_hex) {
  nlohmann::json out;
  cudaDeviceProp prop;
  GPU_CHECK(cudaGetDeviceProperties(&prop, 0));
  GPU_CHECK(cudaSetDevice(0));
  out["gpu_name"] = prop.name;
  out["gpu_bytes"] = bytes;
  TransportConfig config;
  auto t = CreateTransport("cuda_ipc", config);
  if (!t.ok()) return {{"gpu_error", t.status().ToString()}};
  void* dst = nullptr;
  void* src2 = nullptr;
  GPU_CHECK(cudaMalloc(&dst, bytes));
  GPU_CHECK(cudaMalloc(&src2, bytes));
  GPU_CHECK(cudaMemset(dst, 1, bytes));
  GPU_CHECK(cudaMemset(src2, 3, bytes));
  // cudaMemset on the legacy stream is asynchronous and cuda_ipc copies on non-blocking streams,
  // which do not wait for it: finish the fills first, or the probe below could see them land late.
  GPU_CHECK(cudaDeviceSynchronize());
  MemorySpec spec{MemoryKind::kCuda, dst, bytes, 0, "", 0, "bench dst"};
  // The child's region belongs to its transport instance: batches touching it must name that peer
  // (found by running this on the emulated runtime: the copy was refused with kNoPeer).
  auto peer = (*t)->Connect(Unhex(endpoint_hex), absl::Now() + absl::Seconds(10));
  if (!peer.ok()) return {{"gpu_error", absl::StrCat("connect to the child: ", peer.status().ToString())}};
  auto local = (*t)->RegisterMemory(spec);
  auto remote = (*t)->ImportDescriptor(Unhex(desc_hex));
  if (!local.ok() || !remote.ok()) {
    return {{"gpu_error", absl::StrCat("register/import: ", local.status().ToString(), " / ",
                                       remote.status().ToString())}};
  }
  // Each timed batch copies the buffer kOpsPerBatch times: one 1 GiB copy takes ~0.5 ms on an H200,
  // the same order as Wait's completion polling (backoff up to 1 ms), which would otherwise
  // dominate the figure; the in-process baseline below enqueues the same number of copies.
  constexpr int kOpsPerBatch = 8;
  out["gpu_ops_per_batch"] = kOpsPerBatch;
  CopyOp op;
  op.shape = {bytes};
  op.element_size = 1;
  auto run = [&](RegionHandle from, RegionHandle to, double* best) -> absl::Status {
    op.src = {from, 0, {1}};
    op.dst = {to, 0, {1}};
    const std::vector<CopyOp> ops(kOpsPerBatch, op);
    for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up (peer mappings, stream creation)
      const auto t0 = std::chrono::steady_clock::now();
      auto id = (*t)->Post(Batch{static_cast<uint64_t>(r), *peer, false, ops});
      if (!id.ok()) return id.status();
      if (absl::Status s = (*t)->Wait(*id, absl::Now() + absl::Seconds(60)); !s.ok()) return s;
      if (r > 0) *best = std::min(*best, Since(t0));
    }
    return absl::OkStatus();
  };
  double read_s = 1e9, write_s = 1e9;
  if (absl::Status s = run(*remote, *local, &read_s); !s.ok()) return {{"gpu_error", "ipc read: " + s.ToString()}};
  unsigned char probe[16] = {};
  GPU_CHECK(cudaMemcpy(probe, static_cast<char*>(dst) + bytes - 16, 16, cudaMemcpyDeviceToHost));
  for (unsigned char c : probe) {
    if (c != 7) return {{"gpu_error", "ipc read copied wrong bytes (expected the child's 0x07 fill)"}};
  }
  if (absl::Status s = run(*local, *remote, &write_s); !s.ok()) return {{"gpu_error", "ipc write: " + s.ToString()}};
  // In-process cudaMemcpyAsync D2D of the same bytes on a non-blocking stream.
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  double d2d_s = 1e9;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < kOpsPerBatch; ++k) {
      GPU_CHECK(cudaMemcpyAsync(dst, src2, bytes, cudaMemcpyDeviceToDevice, stream));
    }
    GPU_CHECK(cudaStreamSynchronize(stream));  // bench only: the copy is bounded by its size
    if (r > 0) d2d_s = std::min(d2d_s, Since(t0));
  }
  (void)(*t)->Release(*remote);
  (void)(*t)->Release(*local);
  cudaStreamDestroy(stream);
  cudaFree(dst);
  cudaFree(src2);
  const double moved = static_cast<double>(bytes) * kOpsPerBatch;
  out["ipc_copy_GBps"] = moved / read_s / 1e9;
  out["ipc_write_GBps"] = moved / write_s / 1e9;
  out["cuda_d2d_GBps"] = moved / d2d_s / 1e9;
  out["ipc_vs_d2d"] = d2d_s / read_s;
  return out;
}

}  // namespace

nlohmann::json MeasureGpu(const char* self_exe, int64_t bytes, int reps) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return {{"gpu_skipped", absl::StrCat("no CUDA device visible (",
                                         e == cudaSuccess ? "0 devices" : cudaGetErrorString(e), ")")}};
  }
  int to_child[2], from_child[2];
  if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) return {{"gpu_error", "pipe failed"}};
  const std::string bytes_arg = absl::StrCat("--gpu_bytes=", bytes);
  pid_t pid = fork();
  if (pid == 0) {  // exec at once: a forked child must not touch the parent's CUDA state
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    execl(self_exe, self_exe, "--gpu_child", bytes_arg.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  std::string ep, line;
  nlohmann::json out;
  if (pid < 0) {
    out = {{"gpu_error", "fork failed"}};
  } else if (!ReadLine(from_child[0], &ep, 120000) || ep.rfind("EP ", 0) != 0) {
    out = {{"gpu_error", "the exporting child process gave no endpoint: " + ep.substr(0, 300)}};
  } else if (!ReadLine(from_child[0], &line, 120000) || line.rfind("DESC ", 0) != 0) {
    out = {{"gpu_error", "the exporting child process gave no descriptor: " + line.substr(0, 300)}};
  } else {
    out = Measure(bytes, reps, ep.substr(3), line.substr(5));
  }
  close(to_child[1]);  // the child exits when stdin closes
  close(from_child[0]);
  if (pid > 0) {
    // Give the child 5 s to exit on its own (wait on its pidfd), then kill it.
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (pidfd >= 0) {
      pollfd p = {pidfd, POLLIN, 0};
      (void)poll(&p, 1, 5000);
      close(pidfd);
    }
    if (waitpid(pid, nullptr, WNOHANG) != pid) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  return out;
}

int RunGpuChild(int64_t bytes) {
  auto fail = [](const std::string& why) {
    std::cout << "ERR " << why << std::endl;
    return 1;
  };
  if (cudaSetDevice(0) != cudaSuccess) return fail("cudaSetDevice(0)");
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return fail("cudaMalloc");
  if (cudaMemset(p, 7, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return fail("cudaMemset");
  TransportConfig config;
  auto t = CreateTransport("cuda_ipc", config);
  if (!t.ok()) return fail(t.status().ToString());
  auto h = (*t)->RegisterMemory(MemorySpec{MemoryKind::kCuda, p, bytes, 0, "", 0, "bench src (child)"});
  if (!h.ok()) return fail(h.status().ToString());
  auto d = (*t)->ExportDescriptor(*h);
  if (!d.ok()) return fail(d.status().ToString());
  auto ep = (*t)->ExportEndpoint("");
  if (!ep.ok()) return fail(ep.status().ToString());
  std::cout << "EP " << Hex(*ep) << std::endl;
  std::cout << "DESC " << Hex(*d) << std::endl;
  std::string ignored;
  std::getline(std::cin, ignored);  // parent closes the pipe (or writes a line) when done
  (void)(*t)->Release(*h);
  cudaFree(p);
  return 0;
}

}  // namespace wb::transport
