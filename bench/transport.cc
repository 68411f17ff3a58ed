// Data-plane bench: host same-node copy vs plain memcpy of the same bytes, host_tcp on loopback vs
// iperf3 on loopback with the same number of streams, and, when a GPU is visible, CUDA IPC copy
// between two processes on GPU 0 vs an in-process cudaMemcpy D2D (bench/transport_gpu.h). Measured
// in one run, best of --reps.
//
//   bazel run //bench:transport [-- --json] [-- --bytes=1073741824 --tcp_bytes=536870912 --streams=4]
//   [--gpu_bytes=1073741824] [--no_gpu] [--gpu_only]
//   [--tcp_local_addrs=127.0.0.1,127.0.0.2]   host_tcp multi-NIC striping (TcpOptions::local_addresses)

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/transport_gpu.h"
#include "transport/factory.h"
#include "base/shm_segment.h"

namespace wb::transport {
namespace {

double Seconds(std::chrono::steady_clock::time_point a) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  int port = ntohs(sa.sin_port);
  close(fd);
  return port;
}

std::string RunCapture(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  pclose(f);
  return out;
}

// iperf3 on loopback with `streams` parallel streams; GB/s received, or a negative value + reason.
double Iperf3GBps(int streams, std::string* why) {
  const int port = FreePort();
  int ready[2];
  if (pipe(ready) != 0) {
    *why = "pipe failed";
    return -1;
  }
  pid_t server = fork();
  if (server == 0) {
    close(ready[0]);
    dup2(ready[1], 1);
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 2);
    // --forceflush: "Server listening" reaches the pipe at once, so the bench waits on that line.
    execlp("iperf3", "iperf3", "-s", "-1", "--forceflush", "-p", std::to_string(port).c_str(), nullptr);
    _exit(127);
  }
  close(ready[1]);
  // Wait (bounded) for the server to say it listens, then run one client.
  std::string seen;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (seen.find("Server listening") == std::string::npos) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now()).count());
    pollfd p = {ready[0], POLLIN, 0};
    char buf[256];
    ssize_t n = 0;
    if (left <= 0 || poll(&p, 1, left) <= 0 || (n = read(ready[0], buf, sizeof(buf))) <= 0) break;
    seen.append(buf, static_cast<size_t>(n));
  }
  std::string json;
  if (seen.find("Server listening") != std::string::npos) {
    json = RunCapture(absl::StrCat("iperf3 -c 127.0.0.1 -p ", port, " -P ", streams, " -t 3 -J 2>/dev/null"));
  }
  close(ready[0]);
  kill(server, SIGKILL);
  waitpid(server, nullptr, 0);
  auto j = nlohmann::json::parse(json, nullptr, false);
  if (!j.is_discarded() && j.contains("end") && j["end"].contains("sum_received")) {
    return j["end"]["sum_received"]["bits_per_second"].get<double>() / 8 / 1e9;
  }
  *why = seen.find("Server listening") == std::string::npos
             ? "iperf3 server did not start listening within 10 s: " + seen.substr(0, 200)
             : "iperf3 produced no result: " + json.substr(0, 200);
  return -1;
}

int Main(int argc, char** argv) {
  bool json = false;
  int64_t bytes = int64_t{1} << 30, tcp_bytes = int64_t{512} << 20;
  int streams = 4, reps = 3;
  int threads = static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency())));
  int64_t gpu_bytes = int64_t{1} << 30;
  bool gpu = true, gpu_only = false, gpu_child = false;
  std::string tcp_local_addrs;  // host_tcp multi-NIC: e.g. 127.0.0.1,127.0.0.2 (both transports)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json") json = true;
    if (a == "--no_gpu") gpu = false;
    if (a == "--gpu_only") gpu_only = true;
    if (a == "--gpu_child") gpu_child = true;
    if (a.rfind("--gpu_bytes=", 0) == 0) (void)absl::SimpleAtoi(a.substr(12), &gpu_bytes);
    if (a.rfind("--bytes=", 0) == 0) (void)absl::SimpleAtoi(a.substr(8), &bytes);
    if (a.rfind("--tcp_bytes=", 0) == 0) (void)absl::SimpleAtoi(a.substr(12), &tcp_bytes);
    if (a.rfind("--streams=", 0) == 0) (void)absl::SimpleAtoi(a.substr(10), &streams);
    if (a.rfind("--reps=", 0) == 0) (void)absl::SimpleAtoi(a.substr(7), &reps);
    if (a.rfind("--threads=", 0) == 0) (void)absl::SimpleAtoi(a.substr(10), &threads);
    if (a.rfind("--tcp_local_addrs=", 0) == 0) tcp_local_addrs = a.substr(18);
  }
  if (gpu_child) return RunGpuChild(gpu_bytes);  // the exporting process of the GPU figures
  if (gpu_only) {
    nlohmann::json g = MeasureGpu("/proc/self/exe", gpu_bytes, reps);
    printf("%s\n", g.dump().c_str());
    return g.contains("gpu_error") ? 1 : 0;
  }
  ShmSegment::CreateOptions populate;
  populate.populate = true;
  auto src = ShmSegment::Create(ShmSegment::UniqueName("bench-src"), bytes, populate);
  auto dst = ShmSegment::Create(ShmSegment::UniqueName("bench-dst"), bytes, populate);
  if (!src.ok() || !dst.ok()) {
    fprintf(stderr, "shm: %s %s\n", src.status().ToString().c_str(), dst.status().ToString().c_str());
    return 1;
  }
  memset(src->data(), 7, bytes);
  memset(dst->data(), 1, bytes);

  // 1. plain memcpy.
  double memcpy_s = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    memcpy(dst->data(), src->data(), bytes);
    memcpy_s = std::min(memcpy_s, Seconds(t0));
  }

  // 2. host_shm: one contiguous op of `bytes`.
  TransportConfig config;
  config.host_shm.threads = threads;
  config.tcp.streams = streams;
  for (absl::string_view nic : absl::StrSplit(tcp_local_addrs, ',', absl::SkipEmpty())) {
    config.tcp.local_addresses.emplace_back(nic);
  }
  auto shm = CreateTransport("host_shm", config);
  if (!shm.ok()) return 1;
  MemorySpec s{MemoryKind::kHost, src->data(), bytes, -1, src->name(), 0, "bench src"};
  MemorySpec d{MemoryKind::kHost, dst->data(), bytes, -1, dst->name(), 0, "bench dst"};
  auto hs = (*shm)->RegisterMemory(s);
  auto hd = (*shm)->RegisterMemory(d);
  CopyOp op;
  op.shape = {bytes};
  op.element_size = 1;
  op.src = {*hs, 0, {1}};
  op.dst = {*hd, 0, {1}};
  double shm_s = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    auto id = (*shm)->Post(Batch{static_cast<uint64_t>(r), kNoPeer, false, {op}});
    absl::Status st = id.ok() ? (*shm)->Wait(*id, absl::Now() + absl::Seconds(120)) : id.status();
    if (!st.ok()) {
      fprintf(stderr, "host_shm: %s\n", st.ToString().c_str());
      return 1;
    }
    shm_s = std::min(shm_s, Seconds(t0));
  }

  // 3. host_tcp on loopback between two transport instances.
  auto a = CreateTransport("host_tcp", config);
  auto b = CreateTransport("host_tcp", config);
  if (!a.ok() || !b.ok()) {
    fprintf(stderr, "host_tcp: %s / %s\n", a.status().ToString().c_str(), b.status().ToString().c_str());
    return 1;
  }
  auto ea = (*a)->ExportEndpoint((*b)->instance_id());
  auto eb = (*b)->ExportEndpoint((*a)->instance_id());
  absl::StatusOr<PeerId> pb = absl::UnknownError("");
  std::thread th([&] { pb = (*b)->Connect(*ea, absl::Now() + absl::Seconds(10)); });
  auto pa = (*a)->Connect(*eb, absl::Now() + absl::Seconds(10));
  th.join();
  if (!pa.ok() || !pb.ok()) {
    fprintf(stderr, "connect failed\n");
    return 1;
  }
  auto ra = (*a)->RegisterMemory(s);
  auto rb = (*b)->RegisterMemory(d);
  auto rb_in_a = (*a)->ImportDescriptor(*(*b)->ExportDescriptor(*rb));
  auto ra_in_b = (*b)->ImportDescriptor(*(*a)->ExportDescriptor(*ra));
  CopyOp top;
  top.shape = {tcp_bytes};
  top.element_size = 1;
  double tcp_s = 1e9;
  for (int r = 0; r < reps; ++r) {
    top.src = {*ra, 0, {1}};
    top.dst = {*rb_in_a, 0, {1}};
    Batch send{static_cast<uint64_t>(100 + r), *pa, false, {top}};
    top.src = {*ra_in_b, 0, {1}};
    top.dst = {*rb, 0, {1}};
    Batch recv{static_cast<uint64_t>(100 + r), *pb, false, {top}};
    auto t0 = std::chrono::steady_clock::now();
    auto ib = (*b)->Post(recv);
    auto ia = (*a)->Post(send);
    absl::Status s1 = (*a)->Wait(*ia, absl::Now() + absl::Seconds(120));
    absl::Status s2 = (*b)->Wait(*ib, absl::Now() + absl::Seconds(120));
    if (!s1.ok() || !s2.ok()) {
      fprintf(stderr, "host_tcp: %s / %s\n", s1.ToString().c_str(), s2.ToString().c_str());
      return 1;
    }
    tcp_s = std::min(tcp_s, Seconds(t0));
  }
  std::string iperf_why;
  const double iperf = Iperf3GBps(streams, &iperf_why);

  const double memcpy_GBps = bytes / memcpy_s / 1e9;
  const double host_copy_GBps = bytes / shm_s / 1e9;
  const double tcp_GBps = tcp_bytes / tcp_s / 1e9;
  nlohmann::json out = {
      {"bytes", bytes},
      {"tcp_bytes", tcp_bytes},
      {"streams", streams},
      {"tcp_local_addrs", tcp_local_addrs},
      {"host_shm_threads", threads},
      {"cpus", std::thread::hardware_concurrency()},
      {"memcpy_GBps", memcpy_GBps},
      {"host_copy_GBps", host_copy_GBps},
      {"host_copy_vs_memcpy", host_copy_GBps / memcpy_GBps},
      {"tcp_GBps", tcp_GBps},
  };
  if (iperf > 0) {
    out["iperf3_GBps"] = iperf;
    out["tcp_vs_iperf3"] = tcp_GBps / iperf;
  } else {
    out["iperf3_error"] = iperf_why;
  }
  bool gpu_failed = false;
  if (gpu) {
    out.update(MeasureGpu("/proc/self/exe", gpu_bytes, reps));
    gpu_failed = out.contains("gpu_error");
  } else {
    out["gpu_skipped"] = "--no_gpu";
  }
  if (json) {
    printf("%s\n", out.dump().c_str());
  } else {
    printf("host same-node copy, %lld bytes, %d threads: %.2f GB/s   plain memcpy: %.2f GB/s   ratio %.2f\n",
           static_cast<long long>(bytes), threads, host_copy_GBps, memcpy_GBps, host_copy_GBps / memcpy_GBps);
    if (iperf > 0) {
      printf("host_tcp loopback, %lld bytes, %d streams: %.2f GB/s   iperf3 -P %d: %.2f GB/s   ratio %.2f\n",
             static_cast<long long>(tcp_bytes), streams, tcp_GBps, streams, iperf, tcp_GBps / iperf);
    } else {
      printf("host_tcp loopback: %.2f GB/s   iperf3: %s\n", tcp_GBps, iperf_why.c_str());
    }
    if (out.contains("ipc_copy_GBps")) {
      printf("cuda_ipc copy (GPU 0, two processes), %lld bytes: read %.1f GB/s, write %.1f GB/s   in-process "
             "cudaMemcpy D2D: %.1f GB/s   ratio %.2f  (%s)\n",
             static_cast<long long>(gpu_bytes), out["ipc_copy_GBps"].get<double>(),
             out["ipc_write_GBps"].get<double>(), out["cuda_d2d_GBps"].get<double>(), out["ipc_vs_d2d"].get<double>(),
             out["gpu_name"].get<std::string>().c_str());
    } else if (out.contains("gpu_error")) {
      printf("GPU figures FAILED: %s\n", out["gpu_error"].get<std::string>().c_str());
    } else {
      printf("GPU figures not measured: %s\n", out["gpu_skipped"].get<std::string>().c_str());
    }
  }
  return gpu_failed ? 1 : 0;
}

}  // namespace
}  // namespace wb::transport

int main(int argc, char** argv) { return wb::transport::Main(argc, argv); }
