// End-to-end with CUDA workers. Two builds of this file:
//  - //tests/e2e:e2e_gpu_emulated_test (CI): on EMULATED GPUs, described below;
//  - //tests/e2e:e2e_gpu_test (WB_E2E_REAL_GPUS, tag manual, run by tests/gpu/run_gpu_checks.sh):
//    the same scenarios with the normal daemon/worker builds on the real GPUs of the machine
//    (WB_E2E_GPUS of them; workers share GPUs round robin when there are fewer than two).
//
// On EMULATED GPUs: the real daemons and worker processes, built against the emulated
// CUDA runtime (//tests/fake_cuda: device memory that the host cannot dereference, bounds-checked
// copies, asynchronous streams, CUDA IPC handles between processes). The workers keep their
// weights in (emulated) CUDA memory and register them by IPC handle; the daemons move versions
// with cuda_ipc and, with --gpu_staging_bytes, stage them on the GPU (GPU-direct). This checks the
// daemon's CUDA logic (which memory goes where, on which transport, in which order) in CI; it says
// nothing about GPU speed or driver behaviour (tests/gpu/run_gpu_checks.sh on a real GPU does).
//
// Every rollout checks every byte of its pieces (downloaded from its CUDA buffer) against the
// version it applied; the node's /metrics tell which route the bytes took and where staging lived.
#include <signal.h>
#include <sys/stat.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"
#include "base/status_macros.h"

namespace wb::e2e {
namespace {

constexpr char kGpuBudget[] = "--gpu_staging_bytes=2147483648";

#ifdef WB_E2E_REAL_GPUS
constexpr bool kReal = true;
#else
constexpr bool kReal = false;
#endif

// GPUs the workers use: four emulated ones, or WB_E2E_GPUS real ones (0 when unset).
int NumGpus() {
  if (!kReal) return 4;
  const char* n = std::getenv("WB_E2E_GPUS");
  return n == nullptr ? 0 : std::atoi(n);
}

// Skips a real-GPU run on a machine without one (the emulated build always runs).
#define WB_REQUIRE_GPUS()                                                                                      \
  do {                                                                                                         \
    if (NumGpus() < 1) GTEST_SKIP() << "needs 1 visible CUDA device(s), found 0 (set WB_E2E_GPUS on a GPU machine)"; \
    if (!kReal) setenv("WB_FAKE_CUDA_DEVICES", "4", 1);                                                       \
    if (!kReal) setenv("WB_FAKE_NCCL_ONE_KERNEL_PER_DEVICE", "1", 1);                                         \
  } while (0)

ClusterOptions EmulatedCluster(int nodes, bool gpu_staging) {
  ClusterOptions o;
  o.num_nodes = nodes;
  o.node_metrics = true;
  if (!kReal) {
    o.daemon_binary = "daemon/weightbridged_emulated_gpu";
    o.trainer_binary = "tests/e2e/trainer_worker_emulated_gpu";
    o.rollout_binary = "tests/e2e/rollout_worker_emulated_gpu";
  }
  // NCCL is not emulated inside the daemon here: cross-node bytes take host_tcp.
  o.extra_node_flags = {"--transports=host_shm,host_tcp,cuda_ipc"};
  if (gpu_staging) o.extra_node_flags.push_back(kGpuBudget);
  return o;
}

// The scenario of every test here: FSDP dp=2 trainer ranks on `trainer_node` -> vLLM tp=2 rollout
// ranks on `rollout_node`, all with their weights in CUDA memory, rank r on GPU r % NumGpus().
struct Workers {
  std::vector<WorkerSpec> trainers, rollouts;
};
Workers FsdpToVllm(int trainer_node, int rollout_node, int64_t rollout_step_ms = 0) {
  Workers w;
  for (int r = 0; r < 2; ++r) {
    WorkerSpec t{true, trainer_node, "fsdp", 1, 1, 2, 1, r, r % NumGpus()};
    t.memory = "cuda";
    w.trainers.push_back(t);
    WorkerSpec o{false, rollout_node, "vllm", 2, 1, 1, 1, r, r % NumGpus()};
    o.memory = "cuda";
    o.step_ms = rollout_step_ms;
    w.rollouts.push_back(o);
  }
  return w;
}

// Two nodes that both run nccl with GPU staging, with their nccl lanes on disjoint GPUs (NCCL
// refuses two ranks of one communicator on one GPU, and both "nodes" share this machine's GPUs):
// by default one lane each, n0 on GPU 0 and n1 on GPU 1.
ClusterOptions NcclCluster(const std::string& n0_lanes = "0", const std::string& n1_lanes = "1") {
  ClusterOptions o = EmulatedCluster(2, true);
  o.extra_node_flags[0] = "--transports=host_shm,host_tcp,cuda_ipc,nccl";
  o.node_flags[0] = {"--nccl_devices=" + n0_lanes};
  o.node_flags[1] = {"--nccl_devices=" + n1_lanes};
  return o;
}

// Runs trainers and rollouts to completion and checks every rollout byte of every version.
void RunAndVerify(Cluster& cl, const RunOptions& run, const std::vector<WorkerSpec>& trainers, const std::vector<WorkerSpec>& rollouts) {
  auto result = cl.RunWorkers(run, trainers, rollouts);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s;
  const std::vector<Process*>& r_procs = result->rollouts;
  if (testing::Test::HasFailure()) {
    for (int i = 0; cl.node(i) != nullptr && i < 4; ++i) {
      ADD_FAILURE() << "node " << i << " log:\n" << cl.node(i)->LogTail();
      break;
    }
    return;
  }
  const uint64_t last = static_cast<uint64_t>(run.first_version + run.versions - 1);
  for (Process* p : r_procs) {
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    auto ready = EventsNamed(p, "ready");
    ASSERT_FALSE(ready.empty()) << p->name();
    EXPECT_EQ(ready[0].value("memory", ""), "cuda") << p->name();
    auto applied = EventsNamed(p, "applied");
    ASSERT_FALSE(applied.empty()) << p->name();
    EXPECT_EQ(applied.back()["version"].get<uint64_t>(), last) << p->name();
    EXPECT_GT(VerifiedBytes(p, last), 0) << p->name();
  }
}

std::map<std::string, double> NodeMetrics(const Cluster& cl, int node) {
  auto m = daemon::ScrapeMetrics(cl.node_metrics_port(node), absl::Seconds(10));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : std::map<std::string, double>{};
}

// Sum of `name`'s series whose text contains every one of `labels` (prometheus-cpp prints labels
// sorted by name, so match them one by one).
double Sum(const std::map<std::string, double>& m, const std::string& name, std::vector<std::string> labels) {
  double sum = 0;
  for (auto& [k, v] : m) {
    if (k.rfind(name + "{", 0) != 0) continue;
    bool all = true;
    for (const std::string& l : labels) all = all && k.find(l) != std::string::npos;
    if (all) sum += v;
  }
  return sum;
}

// A running cluster and the harness that owns its processes.
struct Started {
  std::unique_ptr<Harness> harness;
  std::unique_ptr<Cluster> cluster;
};
absl::StatusOr<Started> StartCluster(const std::string& tag, ClusterOptions options) {
  Started s;
  ASSIGN_OR_RETURN(s.harness, Harness::Create(tag));
  ASSIGN_OR_RETURN(s.cluster, Cluster::Start(s.harness.get(), std::move(options)));
  return s;
}

// The run every scenario here uses, with its model id, mode and number of versions.
RunOptions GpuRun(const std::string& model_id, const std::string& mode, int versions = 2) {
  RunOptions run;
  run.config = ModelConfigPath();
  run.model_id = model_id;
  run.mode = mode;
  run.versions = versions;
  return run;
}

// Emulated builds: four emulated GPUs per process (WB_FAKE_CUDA_DEVICES, inherited by every daemon
// and worker the harness spawns), each running one NCCL group at a time
// (WB_FAKE_NCCL_ONE_KERNEL_PER_DEVICE: the daemon's lane schedule must not rely on concurrent kernels).
class GpuEmulatedTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { WB_REQUIRE_GPUS(); }
};

// FSDP dp=2 -> vLLM tp=2 colocated on one node, both on GPUs 0 and 1: with GPU staging every byte
// of the transfer moves device to device on cuda_ipc, and snapshots / incoming copies live on the GPUs.
TEST_P(GpuEmulatedTest, ColocatedGpuDirect) {
  const std::string mode = GetParam();
  auto started = StartCluster("gpu-direct-" + mode, EmulatedCluster(1, true));
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  RunOptions run = GpuRun("qwen-gpu-" + mode, mode, mode == "async" ? 3 : 2);
  run.layout_source = "preset";
  Workers w = FsdpToVllm(0, 0, mode == "async" ? 200 : 0);
  RunAndVerify(cl, run, w.trainers, w.rollouts);
  if (HasFailure()) return;
  auto m = NodeMetrics(cl, 0);
  EXPECT_GT(daemon::MetricSum(m, "wb_bytes_total", "route=\"cuda_ipc\""), 0);
  EXPECT_EQ(daemon::MetricSum(m, "wb_bytes_total", "route=\"host_shm\""), 0) << "a same-node op went through host memory";
  EXPECT_GT(daemon::MetricSum(m, "wb_cuda_staged_bytes_total", "memory=\"gpu\""), 0);
  EXPECT_EQ(daemon::MetricSum(m, "wb_cuda_staged_bytes_total", "memory=\"host\""), 0) << "staging fell back to host memory";
  if (mode != "sync") {
    EXPECT_GT(Sum(m, "wb_cuda_staged_bytes_total", {"what=\"snapshot\"", "memory=\"gpu\""}), 0)
        << "trainer snapshots of CUDA buffers are expected on the GPU";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuEmulatedTest, testing::Values("sync", "one_step_off", "async"));

// Without a GPU staging budget the same run stages in host memory (the safe default) and is
// byte-exact too.
TEST(GpuEmulatedFallbackTest, NoBudgetStagesInHostMemory) {
  WB_REQUIRE_GPUS();
  auto started = StartCluster("gpu-host-staging", EmulatedCluster(1, false));
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  RunOptions run = GpuRun("qwen-gpu-host", "one_step_off", 2);
  Workers w = FsdpToVllm(0, 0);
  RunAndVerify(cl, run, w.trainers, w.rollouts);
  if (HasFailure()) return;
  auto m = NodeMetrics(cl, 0);
  EXPECT_EQ(daemon::MetricSum(m, "wb_cuda_staged_bytes_total", "memory=\"gpu\""), 0);
  EXPECT_GT(daemon::MetricSum(m, "wb_cuda_staged_bytes_total", "memory=\"host\""), 0);
}

// GPU staging is not host memory: with a host staging budget far below the model (64 MiB vs
// ~166 MB per worker) and GPU staging on, CUDA workers still register and move every version
// (their mirrors live on the GPUs); the same budget without GPU staging refuses their layouts.
TEST(GpuEmulatedFallbackTest, HostBudgetDoesNotCountGpuStaging) {
  WB_REQUIRE_GPUS();
  ClusterOptions o = EmulatedCluster(1, true);
  o.extra_node_flags.push_back("--staging_budget_bytes=67108864");
  auto started = StartCluster("gpu-host-budget", o);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  RunOptions run = GpuRun("qwen-gpu-budget", "one_step_off", 2);
  Workers w = FsdpToVllm(0, 0);
  RunAndVerify(cl, run, w.trainers, w.rollouts);
  if (HasFailure()) return;
  auto m = NodeMetrics(cl, 0);
  EXPECT_EQ(Sum(m, "wb_cuda_staged_bytes_total", {"memory=\"host\""}), 0);
}

// CUDA trainers on n0 -> CUDA rollouts on n1: cross-node bytes take host_tcp from a host copy of
// the trainers' GPU snapshots, and land in host staging on n1 (a version received from another node
// is never staged on the GPU); n1 then applies host -> device.
TEST(GpuEmulatedCrossNodeTest, CudaToCudaAcrossNodes) {
  WB_REQUIRE_GPUS();
  auto started = StartCluster("gpu-cross-node", EmulatedCluster(2, true));
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  RunOptions run = GpuRun("qwen-gpu-cross", "one_step_off", 2);
  run.layout_source = "pieces";
  Workers w = FsdpToVllm(0, 1);
  RunAndVerify(cl, run, w.trainers, w.rollouts);
  if (HasFailure()) return;
  auto m0 = NodeMetrics(cl, 0), m1 = NodeMetrics(cl, 1);
  EXPECT_GT(daemon::MetricSum(m0, "wb_bytes_total", "route=\"host_tcp\""), 0);
  EXPECT_GT(Sum(m0, "wb_cuda_staged_bytes_total", {"what=\"snapshot\"", "memory=\"gpu\""}), 0);
  EXPECT_GT(Sum(m1, "wb_cuda_staged_bytes_total", {"what=\"incoming\"", "memory=\"host\""}), 0);
  EXPECT_EQ(daemon::MetricSum(m1, "wb_cuda_staged_bytes_total", "memory=\"gpu\""), 0);
}

// CUDA trainers on n0 -> CUDA rollouts on n1 with nccl on both nodes, one lane each (n0 on GPU 0,
// n1 on GPU 1: NCCL refuses two ranks of one communicator on one GPU): the coordinator routes every
// cross-node op over nccl (TransferOp.nccl), device to device, all on the lane pair (0, 1); n0
// first copies the trainer on GPU 1 to its lane's GPU 0 (and, in sync mode, both live buffers to
// GPU staging), n1 stages on its lane's GPU 1 and applies to the rollouts' GPUs (0 and 1: one copy
// crosses GPUs). Nothing takes the host channel.
TEST(GpuEmulatedCrossNodeTest, NcclBetweenNodes) {
  WB_REQUIRE_GPUS();
  if (NumGpus() < 2) GTEST_SKIP() << "needs 2 visible CUDA device(s), found " << NumGpus() << " (two NCCL ranks cannot share a GPU)";
  ClusterOptions o = NcclCluster();
  auto started = StartCluster("gpu-nccl", o);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  for (const std::string mode : {"sync", "one_step_off"}) {
    RunOptions run = GpuRun("qwen-gpu-nccl-" + mode, mode, 2);
    run.layout_source = "pieces";
    Workers w = FsdpToVllm(0, 1);
    RunAndVerify(cl, run, w.trainers, w.rollouts);
    if (HasFailure()) return;
  }
  auto m0 = NodeMetrics(cl, 0), m1 = NodeMetrics(cl, 1);
  EXPECT_GT(daemon::MetricSum(m0, "wb_bytes_total", "route=\"nccl\""), 0);
  EXPECT_GT(daemon::MetricSum(m1, "wb_bytes_total", "route=\"nccl\""), 0);
  EXPECT_EQ(daemon::MetricSum(m0, "wb_bytes_total", "route=\"host_tcp\""), 0) << "a cross-node op took the host channel";
  EXPECT_EQ(daemon::MetricSum(m1, "wb_bytes_total", "route=\"host_tcp\""), 0) << "a cross-node op took the host channel";
  EXPECT_GT(Sum(m1, "wb_cuda_staged_bytes_total", {"what=\"incoming\"", "memory=\"gpu\""}), 0);
  EXPECT_EQ(Sum(m1, "wb_cuda_staged_bytes_total", {"memory=\"host\""}), 0);
  EXPECT_GT(Sum(m0, "wb_nccl_lane_bytes_total", {"gpu=\"0\"", "peer_gpu=\"1\""}), 0);
  EXPECT_EQ(Sum(m0, "wb_nccl_lane_bytes_total", {}), Sum(m0, "wb_nccl_lane_bytes_total", {"gpu=\"0\"", "peer_gpu=\"1\""}))
      << "n0 has one lane (GPU 0) and n1 one (GPU 1)";
  EXPECT_GT(Sum(m0, "wb_nccl_bounce_bytes_total", {}), 0) << "the trainer on GPU 1 has no lane of its own";
}

// One nccl lane per GPU (--nccl_devices): trainers on n0's GPUs 0 and 1, rollouts on n1's GPUs 2
// and 3, every GPU with a lane of its own. Each trainer GPU sends its own snapshot on its own
// communicators straight to each rollout GPU's own staging (lane pairs (0,2) (0,3) (1,2) (1,3), in
// parallel within a bucket): no GPU funnels another's bytes, and nothing is copied to another GPU
// first. Byte-exact, every mode that moves snapshots (one-step-off) and live buffers (sync).
// `container`: every worker sees only its own GPU (CUDA_VISIBLE_DEVICES=<gpu>, so it calls it GPU 0,
// as in a container or with one GPU per rank); the even ranks send the GPU's UUID, the odd ones do
// not (the daemon must find the GPU from the mapping). The daemons see every GPU: the same lanes
// must carry the bytes, so each buffer was placed on the right GPU in the daemon's numbering.
void RunLanePerGpu(bool container) {
  auto started = StartCluster(container ? "gpu-nccl-lanes-container" : "gpu-nccl-lanes", NcclCluster("0,1", "2,3"));
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  double bounced_before_sync = 0;
  for (const std::string mode : {"one_step_off", "sync"}) {
    RunOptions run = GpuRun(absl::StrCat("qwen-gpu-lanes-", container ? "c-" : "", mode), mode, 2);
    run.layout_source = "pieces";
    Workers w = FsdpToVllm(0, 1);
    for (int r = 0; r < 2; ++r) {
      for (WorkerSpec* spec : {&w.trainers[r], &w.rollouts[r]}) {
        spec->gpu = spec == &w.trainers[r] ? r : 2 + r;
        if (!container) continue;
        spec->env = {absl::StrCat("CUDA_VISIBLE_DEVICES=", spec->gpu)};
        spec->gpu = 0;
        if (r == 1) spec->extra_flags.push_back("--send_gpu_uuid=false");
      }
    }
    RunAndVerify(cl, run, w.trainers, w.rollouts);
    if (testing::Test::HasFailure()) return;
    if (mode == "one_step_off") {
      bounced_before_sync = Sum(NodeMetrics(cl, 0), "wb_nccl_bounce_bytes_total", {});
      EXPECT_EQ(bounced_before_sync, 0) << "snapshots are on their own lanes' GPUs: nothing to copy first";
    }
  }
  auto m0 = NodeMetrics(cl, 0), m1 = NodeMetrics(cl, 1);
  EXPECT_EQ(daemon::MetricSum(m0, "wb_bytes_total", "route=\"host_tcp\""), 0) << "a cross-node op took the host channel";
  EXPECT_EQ(daemon::MetricSum(m1, "wb_bytes_total", "route=\"host_tcp\""), 0) << "a cross-node op took the host channel";
  for (int g : {0, 1}) {
    for (int p : {2, 3}) {
      const std::string gpu = absl::StrCat("gpu=\"", g, "\""), peer_gpu = absl::StrCat("peer_gpu=\"", p, "\"");
      EXPECT_GT(Sum(m0, "wb_nccl_lane_bytes_total", {gpu, peer_gpu}), 0) << "n0 lane pair (" << g << ", " << p << ") unused";
      EXPECT_GT(Sum(m1, "wb_nccl_lane_bytes_total", {absl::StrCat("gpu=\"", p, "\""), absl::StrCat("peer_gpu=\"", g, "\"")}), 0);
    }
  }
  EXPECT_EQ(Sum(m0, "wb_nccl_lane_bytes_total", {}), daemon::MetricSum(m0, "wb_bytes_total", "route=\"nccl\""));
  // Sync mode sends from the trainers' live buffers (IPC imports): those are copied to GPU staging
  // on their own GPU first, never to another GPU.
  EXPECT_GT(Sum(m0, "wb_nccl_bounce_bytes_total", {}), bounced_before_sync);
  EXPECT_EQ(Sum(m1, "wb_cuda_staged_bytes_total", {"memory=\"host\""}), 0);
}

TEST(GpuEmulatedCrossNodeTest, NcclLanePerGpu) {
  WB_REQUIRE_GPUS();
  if (NumGpus() < 4) GTEST_SKIP() << "needs 4 visible CUDA device(s), found " << NumGpus() << " (two lanes per node, none shared)";
  RunLanePerGpu(false);
}

TEST(GpuEmulatedCrossNodeTest, NcclLanePerGpuWithWorkersNumberingGpusDifferently) {
  WB_REQUIRE_GPUS();
  if (NumGpus() < 4) GTEST_SKIP() << "needs 4 visible CUDA device(s), found " << NumGpus() << " (two lanes per node, none shared)";
  RunLanePerGpu(true);
}

// A peer that vanishes mid-transfer on the nccl route: n1 (receiving over nccl) is frozen with v2
// in flight and killed; v2 aborts within the transfer timeout (no hang in the NCCL wait on n0), the
// rollouts still hold exactly v1; n1 restarts, its rollout re-registers its CUDA buffer, and v3
// flows over a NEW communicator (the old one died with the peer) to every byte.
TEST(GpuEmulatedCrossNodeTest, NcclPeerKilledMidTransfer) {
  WB_REQUIRE_GPUS();
  if (NumGpus() < 2) GTEST_SKIP() << "needs 2 visible CUDA device(s), found " << NumGpus();
  ClusterOptions o = NcclCluster();
  // n1 is frozen before v2 is opened and must stay a member until v2 has started: meanwhile the
  // trainers fill, push and publish v2 (~166 MB each), which on a loaded 2-core machine outlasted
  // a 3 s lease - n1 was lost first, its rollouts dropped, and v2 stayed "queued" with no rollout
  // to plan for (as it should: it starts once a rollout joins again). Once v2 is in flight the
  // lease does not end it: the coordinator's ExecuteVersion to the frozen n1 fails at the kill,
  // or at the transfer timeout, whichever comes first. The transfer timeout must fit v1 on that
  // machine too (6 s did not: v1's staging alone took 5 s there).
  o.lease_ms = ScaledMs(20000);
  o.transfer_timeout_ms = ScaledMs(20000);
  auto started = StartCluster("gpu-nccl-kill", o);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cl = *started->cluster;
  RunOptions run = GpuRun("qwen-gpu-nccl-kill", "one_step_off", 3);
  run.tolerate_failures = true;
  run.gate_dir = started->harness->Path("gates");
  ::mkdir(run.gate_dir.c_str(), 0700);
  run.num_trainers = 2;
  run.num_rollouts = 2;
  std::vector<Process*> trainers, rollouts;
  const Workers w = FsdpToVllm(0, 1);
  for (const WorkerSpec& spec : w.trainers) {
    auto p = cl.SpawnWorker(run, spec);
    ASSERT_TRUE(p.ok()) << p.status();
    trainers.push_back(*p);
  }
  for (const WorkerSpec& spec : w.rollouts) {
    auto p = cl.SpawnWorker(run, spec);
    ASSERT_TRUE(p.ok()) << p.status();
    rollouts.push_back(*p);
  }
  auto gate = [&](int v) { return started->harness->Touch(absl::StrCat(run.gate_dir, "/publish-", v)); };
  ASSERT_TRUE(gate(1).ok());
  for (Process* r : rollouts) {
    auto e = r->WaitForEvent("verified", 1, Scaled(absl::Seconds(90)));
    ASSERT_TRUE(e.ok()) << e.status() << "\n" << cl.node(1)->LogTail();
  }
  cl.node(1)->Signal(SIGSTOP);
  ASSERT_TRUE(gate(2).ok());
  // Transferring, not merely queued: a queued v2 starts only while n1 is still a member. Past
  // n1's lease it would not start with n1 at all.
  auto st = cl.WaitForStatus(
      [&](const weightbridge::v1::StatusResponse& r) { return VersionState(r, run.model_id, 2) == "transferring"; },
      absl::Milliseconds(o.lease_ms), "v2 transferring while n1 is frozen");
  ASSERT_TRUE(st.ok()) << st.status();
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(cl.KillNode(1).ok());
  // v2 started before the kill and ends within the transfer timeout of its start at the latest
  // (n1's ExecuteVersion broken by the kill or timed out, n0's executor, the coordinator's
  // timeout), plus slack for a loaded machine. The wait allows n1's lease on top, for a diagnosis.
  st = cl.WaitForStatus([&](const weightbridge::v1::StatusResponse& r) { return VersionState(r, run.model_id, 2) == "aborted"; },
                        absl::Milliseconds(o.transfer_timeout_ms + o.lease_ms) + Scaled(absl::Seconds(10)), "v2 aborted");
  ASSERT_TRUE(st.ok()) << st.status() << "\n" << cl.node(0)->LogTail();
  EXPECT_LT(absl::Now() - killed, absl::Milliseconds(o.transfer_timeout_ms) + Scaled(absl::Seconds(5)));
  ASSERT_TRUE(cl.RestartNode(1).ok());
  // The restarted n1 registered (its new address: with the long lease the coordinator may still
  // list the killed process and its two rollouts until then) and both rollouts re-joined it.
  const std::string n1_address = cl.node_address(1);
  st = cl.WaitForStatus(
      [&](const weightbridge::v1::StatusResponse& r) {
        bool n1_back = false;
        for (const auto& n : r.nodes()) n1_back |= n.node_id() == cl.node_id(1) && n.alive() && n.address() == n1_address;
        for (const auto& m : r.models()) {
          if (m.model_id() == run.model_id) return n1_back && m.registered_rollouts() == 2;
        }
        return false;
      },
      Scaled(absl::Seconds(60)), "rollouts on the restarted n1 re-registered");
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_TRUE(gate(3).ok());
  for (Process* p : rollouts) {
    absl::Status e = ExpectCleanExit(p, Scaled(absl::Seconds(120)));
    EXPECT_TRUE(e.ok()) << e << "\n" << cl.node(1)->LogTail();
  }
  for (Process* p : trainers) {
    absl::Status e = ExpectCleanExit(p, Scaled(absl::Seconds(60)));
    EXPECT_TRUE(e.ok()) << e;
  }
  for (Process* p : rollouts) {
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    EXPECT_GT(VerifiedBytes(p, 3), 0) << p->name() << " did not apply v3";
  }
  auto m1 = NodeMetrics(cl, 1);  // the restarted n1: v3 came over nccl
  EXPECT_GT(daemon::MetricSum(m1, "wb_bytes_total", "route=\"nccl\""), 0);
  EXPECT_EQ(daemon::MetricSum(m1, "wb_bytes_total", "route=\"host_tcp\""), 0);
}

}  // namespace
}  // namespace wb::e2e
