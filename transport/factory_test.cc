// The explicit factory and TransportSet. Built twice: plain (host transports; CUDA/NCCL kinds are
// unusable without a GPU) and as factory_emulated_test on the CPU emulations of CUDA and NCCL with
// three emulated GPUs, where "nccl" becomes one transport per GPU (lanes).
#include "transport/factory.h"

#include <sched.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"
#include "transport/gpu_info.h"

namespace wb::transport {
namespace {

TEST(TransportSetTest, PickFindAndDevices) {
  TransportConfig c;
  c.kinds = {"host_shm", "host_tcp"};
  auto set = CreateTransports(c);
  ASSERT_TRUE(set.ok()) << set.status();
  Transport* shm = set->Pick(MemoryKind::kHost, MemoryKind::kHost, false);
  Transport* tcp = set->Pick(MemoryKind::kHost, MemoryKind::kHost, true);
  ASSERT_NE(shm, nullptr);
  ASSERT_NE(tcp, nullptr);
  EXPECT_EQ(shm->capabilities().kind, "host_shm");
  EXPECT_EQ(tcp->capabilities().kind, "host_tcp");
  EXPECT_EQ(set->Find("host_tcp"), tcp);
  EXPECT_EQ(set->Find("nccl"), nullptr);
  EXPECT_TRUE(set->ByDevice("host_tcp").empty()) << "host transports are not bound to a device";
  EXPECT_EQ(set->DeviceOf(tcp), -1);
  EXPECT_EQ(set->DeviceOf(nullptr), -1);
}

TEST(TransportSetTest, UnknownKindIsInvalidArgument) {
  TransportConfig c;
  c.kinds = {"host_shm", "carrier_pigeon"};
  auto set = CreateTransports(c);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("carrier_pigeon"), std::string::npos) << set.status();
}

// Without a usable nccl: listed explicitly it is an error saying why; by default it is skipped.
// TransportConfig::cpus: host_shm's copy threads are pinned (read back with sched_getaffinity by
// thread id, found by name), and a CPU this process may not run on is refused up front.
TEST(CpuAffinityTest, HostShmCopyThreadsArePinnedAndBadSetsRefused) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int first = 0;
  while (!CPU_ISSET(first, &allowed)) ++first;  // CPU 0 on an unrestricted machine
  TransportConfig c;
  c.host_shm.threads = 3;
  c.cpus = {first};
  auto shm = CreateTransport("host_shm", c);
  ASSERT_TRUE(shm.ok()) << shm.status();
  int copy_threads = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(entry.path() / "comm");
    std::string name;
    std::getline(f, name);
    if (name != "wb-shm-copy") continue;
    ++copy_threads;
    cpu_set_t got;
    CPU_ZERO(&got);
    ASSERT_EQ(sched_getaffinity(std::stoi(entry.path().filename().string()), sizeof(got), &got), 0);
    EXPECT_EQ(CPU_COUNT(&got), 1);
    EXPECT_TRUE(CPU_ISSET(first, &got));
  }
  EXPECT_EQ(copy_threads, 3);

  c.cpus = {CPU_SETSIZE - 1};
  for (const char* kind : {"host_shm", "host_tcp"}) {
    auto t = CreateTransport(kind, c);
    ASSERT_FALSE(t.ok()) << kind;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_NE(t.status().message().find(absl::StrCat(CPU_SETSIZE - 1)), std::string::npos) << t.status();
  }
}

// A bad host_tcp option is an error even when the kinds are not listed (it is not "unusable").
TEST(TransportSetTest, BadHostTcpOptionFailsTheDefaultSet) {
  TransportConfig c;
  c.tcp.local_addresses = {"127.0.0.1", "192.0.2.1"};  // TEST-NET-1: on no interface here
  auto set = CreateTransports(c);
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.status().message().find("192.0.2.1"), std::string::npos) << set.status();
  c.tcp.local_addresses = {"127.0.0.1", "127.0.0.2"};
  set = CreateTransports(c);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_NE(set->Find("host_tcp"), nullptr);
}

TEST(NcclLanesTest, UnusableNcclIsSkippedByDefaultAndRefusedWhenListed) {
  if (KindUsable("nccl").ok()) GTEST_SKIP() << "nccl is usable here (see the emulated build)";
  TransportConfig c;
  auto all = CreateTransports(c);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->Find("nccl"), nullptr);
  c.kinds = {"nccl"};
  auto only = CreateTransports(c);
  ASSERT_FALSE(only.ok());
  EXPECT_NE(only.status().message().find("nccl"), std::string::npos) << only.status();
}

TEST(NcclLanesTest, OneTransportPerGpu) {
  if (!KindUsable("nccl").ok()) GTEST_SKIP() << KindUsable("nccl");
  const int n = ProbeGpus().device_count;
  ASSERT_GE(n, 3) << "the emulated build runs with 3 emulated GPUs";
  TransportConfig c;
  c.kinds = {"host_tcp", "nccl"};
  auto all = CreateTransports(c);
  ASSERT_TRUE(all.ok()) << all.status();
  std::map<int, Transport*> lanes = all->ByDevice("nccl");
  ASSERT_EQ(static_cast<int>(lanes.size()), n);
  std::set<std::string> instances;
  for (auto& [d, t] : lanes) {
    EXPECT_EQ(t->capabilities().kind, "nccl");
    EXPECT_EQ(all->DeviceOf(t), d);
    instances.insert(t->instance_id());
  }
  EXPECT_EQ(static_cast<int>(instances.size()), n) << "every lane is a transport instance of its own";

  c.nccl.devices = {2, 0};
  auto two = CreateTransports(c);
  ASSERT_TRUE(two.ok()) << two.status();
  lanes = two->ByDevice("nccl");
  ASSERT_EQ(lanes.size(), 2u);
  EXPECT_EQ(lanes.count(0), 1u);
  EXPECT_EQ(lanes.count(2), 1u);

  c.nccl.devices = {1, 1};
  auto dup = CreateTransports(c);
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("device 1 listed twice"), std::string::npos) << dup.status();

  c.nccl.devices = {0, n};
  auto missing = CreateTransports(c);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(absl::StrCat("GPU ", n)), std::string::npos) << missing.status();
}

}  // namespace
}  // namespace wb::transport
