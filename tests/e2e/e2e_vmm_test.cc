// End-to-end with workers whose weights live in CUDA VMM memory (cuMemCreate with a POSIX-fd
// handle type, as PyTorch's expandable segments allocate), on EMULATED GPUs (//tests/fake_cuda):
// real daemons and worker processes. Each worker (--memory=cuda_vmm) keeps its weights in ONE
// allocation, hands its fd to the node daemon over the fd channel (<worker socket>.fd, SCM_RIGHTS)
// once, and registers three buffers inside it at different offsets (client::WorkerClient::
// ShareCudaVmmAllocation / AddCudaVmmBuffer): one fd serves every buffer. With
// --vmm_allocations=5 the weights lie in five allocations mapped back to back (an expandable
// segment's pages) and a buffer that crosses them names each (AddCudaVmmBuffer(keys, ...)). Every rollout byte is
// checked (downloaded from the allocation). The refusals: a buffer that runs past its allocation
// (RegisterLayout fails with the daemon's reason, nothing is registered or committed), and an fd
// offered by a process that is not the worker's (refused; the worker's own allocation keeps
// serving). Says nothing about real GPUs (tests/gpu/run_gpu_checks.sh).
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"
#include "base/fd_passing.h"

namespace wb::e2e {
namespace {

using weightbridge::v1::StatusResponse;

class VmmTest : public testing::Test {
 protected:
  void SetUp() override { setenv("WB_FAKE_CUDA_DEVICES", "2", 1); }  // inherited by every daemon and worker

  // One node with cuda_ipc and GPU staging.
  void Start(const std::string& tag) {
    auto h = Harness::Create(tag);
    ASSERT_TRUE(h.ok()) << h.status();
    harness_ = std::move(*h);
    ClusterOptions o;
    o.num_nodes = 1;
    o.node_metrics = true;
    o.daemon_binary = "daemon/weightbridged_emulated_gpu";
    o.trainer_binary = "tests/e2e/trainer_worker_emulated_gpu";
    o.rollout_binary = "tests/e2e/rollout_worker_emulated_gpu";
    o.extra_node_flags = {"--transports=host_shm,host_tcp,cuda_ipc", "--gpu_staging_bytes=2147483648"};
    auto c = Cluster::Start(harness_.get(), o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = std::move(*c);
  }

  // FSDP dp=`n` trainers -> vLLM tp=`n` rollouts, rank r on GPU r % 2, all --memory=cuda_vmm, the
  // weights of each in `allocations` allocations mapped back to back.
  static std::vector<WorkerSpec> Workers(bool trainer, int n, int allocations = 1) {
    std::vector<WorkerSpec> out;
    for (int r = 0; r < n; ++r) {
      WorkerSpec w = trainer ? WorkerSpec{true, 0, "fsdp", 1, 1, n, 1, r, r % 2} : WorkerSpec{false, 0, "vllm", n, 1, 1, 1, r, r % 2};
      w.memory = "cuda_vmm";
      w.extra_flags = {"--vmm_buffers=3", absl::StrCat("--vmm_allocations=", allocations)};
      out.push_back(w);
    }
    return out;
  }

  static RunOptions Run(const std::string& model, const std::string& mode) {
    RunOptions run;
    run.config = ModelConfigPath();
    run.model_id = model;
    run.mode = mode;
    run.layout_source = "pieces";  // the pieces spread over three buffers (a preset names one)
    return run;
  }

  // Every worker registered three buffers of one allocation; every rollout checked every byte of
  // the last version.
  void ExpectVmmWorkersAndEveryByte(const std::vector<Process*>& trainers, const std::vector<Process*>& rollouts, uint64_t last) {
    for (const std::vector<Process*>* group : {&trainers, &rollouts}) {
      for (Process* p : *group) {
        auto ready = EventsNamed(p, "ready");
        ASSERT_FALSE(ready.empty()) << p->name() << "\n" << p->LogTail();
        EXPECT_EQ(ready[0].value("memory", ""), "cuda_vmm") << p->name();
        EXPECT_EQ(ready[0].value("buffers", 0), 3) << p->name() << ": three buffers in the one allocation";
      }
    }
    for (Process* p : rollouts) {
      EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
      EXPECT_GT(VerifiedBytes(p, last), 0) << p->name() << " did not verify v" << last;
    }
    auto m = daemon::ScrapeMetrics(cluster_->node_metrics_port(0), absl::Seconds(10));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_GT(daemon::MetricSum(*m, "wb_bytes_total", "route=\"cuda_ipc\""), 0);
    EXPECT_EQ(daemon::MetricSum(*m, "wb_bytes_total", "route=\"host_shm\""), 0) << "VMM buffers went through host memory";
  }

  std::unique_ptr<Harness> harness_;
  std::unique_ptr<Cluster> cluster_;
};

// Sync mode, trainers and rollouts colocated on GPUs 0 and 1: every byte moves device to device
// between VMM allocations, through the daemon's one mapping per allocation.
TEST_F(VmmTest, SyncEveryByteThroughOneFdPerWorker) {
  ASSERT_NO_FATAL_FAILURE(Start("vmm-sync"));
  RunOptions run = Run("qwen-vmm-sync", "sync");
  auto result = cluster_->RunWorkers(run, Workers(true, 2), Workers(false, 2));
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s << "\n" << cluster_->node(0)->LogTail();
  if (HasFailure()) return;
  ExpectVmmWorkersAndEveryByte(result->trainers, result->rollouts, run.versions);
}

// PyTorch's expandable segments: each worker's weights in five allocations mapped back to back
// (one fd each), three buffers cut between pieces, at least one of them crossing allocation
// boundaries (the daemon maps its allocations as one range, in order). Sync mode, colocated: every
// byte device to device, strided pieces included, checked by every rollout.
TEST_F(VmmTest, SyncEveryByteWithBuffersSpanningSeveralAllocations) {
  ASSERT_NO_FATAL_FAILURE(Start("vmm-multi"));
  RunOptions run = Run("qwen-vmm-multi", "sync");
  auto result = cluster_->RunWorkers(run, Workers(true, 2, 5), Workers(false, 2, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s << "\n" << cluster_->node(0)->LogTail();
  if (HasFailure()) return;
  for (const std::vector<Process*>* group : {&result->trainers, &result->rollouts}) {
    for (Process* p : *group) {
      auto ready = EventsNamed(p, "ready");
      ASSERT_FALSE(ready.empty()) << p->name();
      EXPECT_EQ(ready[0].value("vmm_allocations", 0), 5) << p->name();
      EXPECT_GE(ready[0].value("vmm_spanning_buffers", 0), 1) << p->name() << ": no buffer crosses an allocation boundary";
    }
  }
  ExpectVmmWorkersAndEveryByte(result->trainers, result->rollouts, run.versions);
}

// One-step-off with a foreign process in the middle: after the workers registered, this test
// process (not bound to any worker) offers an fd under a trainer's id and key. The daemon refuses
// it, naming why; the trainer's own allocation keeps serving and every version arrives intact.
TEST_F(VmmTest, FdFromAnotherProcessIsRefusedAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start("vmm-foreign"));
  RunOptions run = Run("qwen-vmm-foreign", "one_step_off");
  run.num_trainers = run.num_rollouts = 2;
  run.gate_dir = harness_->Path("gates");
  ASSERT_EQ(::mkdir(run.gate_dir.c_str(), 0700), 0);
  std::vector<Process*> trainers, rollouts;
  for (const WorkerSpec& w : Workers(true, 2)) {
    auto p = cluster_->SpawnWorker(run, w);
    ASSERT_TRUE(p.ok()) << p.status();
    trainers.push_back(*p);
  }
  for (const WorkerSpec& w : Workers(false, 2)) {
    auto p = cluster_->SpawnWorker(run, w);
    ASSERT_TRUE(p.ok()) << p.status();
    rollouts.push_back(*p);
  }
  for (Process* p : trainers) {
    auto ready = p->WaitForEvent("ready", 0, Scaled(absl::Seconds(120)));
    ASSERT_TRUE(ready.ok()) << ready.status();
  }

  const int fd = memfd_create("not-the-trainers-memory", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 2 << 20), 0);
  const std::string channel = cluster_->worker_socket(0) + ".fd";
  absl::Status foreign =
      transport::OfferVmmFd(channel, {run.model_id, "trainer/0", "weights", 2 << 20}, fd, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(foreign.code(), absl::StatusCode::kPermissionDenied) << foreign;
  EXPECT_NE(foreign.message().find("refused"), std::string::npos) << foreign;
  EXPECT_NE(foreign.message().find(absl::StrCat("belongs to process ", trainers[0]->pid())), std::string::npos) << foreign;
  absl::Status unknown =
      transport::OfferVmmFd(channel, {run.model_id, "trainer/7", "weights", 2 << 20}, fd, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  ::close(fd);

  for (int v = 1; v <= run.versions; ++v) ASSERT_TRUE(harness_->Touch(absl::StrCat(run.gate_dir, "/publish-", v)).ok());
  for (Process* p : rollouts) {
    absl::Status s = ExpectCleanExit(p, Scaled(absl::Seconds(240)));
    EXPECT_TRUE(s.ok()) << s << "\n" << cluster_->node(0)->LogTail();
  }
  for (Process* p : trainers) {
    absl::Status s = ExpectCleanExit(p, Scaled(absl::Seconds(60)));
    EXPECT_TRUE(s.ok()) << s;
  }
  if (HasFailure()) return;
  ExpectVmmWorkersAndEveryByte(trainers, rollouts, run.versions);
}

// A rollout whose last buffer runs 4 KiB past the end of its allocation: RegisterLayout fails
// with the daemon's reason (INVALID_ARGUMENT, "exceed the allocation"), the worker exits, and the
// model has no rollout layout and no committed version (the trainer stays registered and waits).
TEST_F(VmmTest, BufferPastItsAllocationIsRefusedAndNothingCommits) {
  ASSERT_NO_FATAL_FAILURE(Start("vmm-overrun"));
  RunOptions run = Run("qwen-vmm-overrun", "one_step_off");
  run.num_trainers = run.num_rollouts = 1;
  run.gate_dir = harness_->Path("gates");
  ASSERT_EQ(::mkdir(run.gate_dir.c_str(), 0700), 0);
  WorkerSpec trainer = Workers(true, 1)[0];
  WorkerSpec rollout = Workers(false, 1)[0];
  rollout.extra_flags.push_back("--vmm_overrun_bytes=4096");
  auto t = cluster_->SpawnWorker(run, trainer);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->WaitForEvent("ready", 0, Scaled(absl::Seconds(120))).ok()) << (*t)->LogTail();
  auto r = cluster_->SpawnWorker(run, rollout);
  ASSERT_TRUE(r.ok()) << r.status();
  auto code = (*r)->WaitExit(Scaled(absl::Seconds(120)));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0) << (*r)->LogTail();
  auto errors = EventsNamed(*r, "error");
  ASSERT_FALSE(errors.empty()) << (*r)->LogTail();
  EXPECT_EQ(errors[0].value("code", ""), "INVALID_ARGUMENT") << errors[0].dump();
  const std::string message = errors[0].value("message", "");
  EXPECT_NE(message.find("RegisterLayout"), std::string::npos) << message;
  EXPECT_NE(message.find("exceed the allocation"), std::string::npos) << message;
  EXPECT_TRUE(EventsNamed(*r, "ready").empty());

  auto model = [&](const StatusResponse& s) -> const weightbridge::v1::ModelStatus* {
    for (const auto& m : s.models()) {
      if (m.model_id() == run.model_id) return &m;
    }
    return nullptr;
  };
  auto st = cluster_->WaitForStatus(
      [&](const StatusResponse& s) { return model(s) != nullptr && model(s)->registered_trainers() == 1; },
      Scaled(absl::Seconds(30)), "the trainer's layout at the coordinator");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(model(*st)->registered_rollouts(), 0u) << "the refused layout was registered";
  EXPECT_EQ(model(*st)->committed_version(), 0u);
}

}  // namespace
}  // namespace wb::e2e
