// bench/gpu_direct: what GPU-direct staging buys a colocated RL setup whose weights live in CUDA
// memory. One node daemon; FSDP dp=2 trainer ranks -> vLLM tp=2 rollout ranks, every worker's
// weights in a cudaMalloc buffer registered by CUDA IPC handle (GPU i % --gpus); the same runs
// twice, measured in the same process:
//   gpu  : --gpu_staging_bytes set: snapshots and incoming copies live on the GPU, every byte moves
//          device to device on cuda_ipc (docs/daemon.md "GPU-direct staging");
//   host : no GPU staging budget (the default): the same bytes are staged in host memory
//          (device -> host -> device over PCIe).
// Figures per staging: sync update time (all published + paused -> all saw the commit: the whole
// stall of a sync step), one-step-off trainer stall (the snapshot in Publish) and rollout stall
// (Apply at a step boundary, with the version already committed), median over versions 2..N, and
// the effective GB/s of the sync update vs an in-process cudaMemcpy D2D of the model's bytes
// (the physical limit, measured in the same run). Every rollout byte of every version is checked.
//
//   bazel run -c opt //bench:gpu_direct [-- --json] [-- --gpus=1 --versions=4]
//   bazel run -c opt //bench:gpu_direct -- --emulated   # on emulated GPUs: checks the bench
//                                                       # runs; its timings mean nothing
// On a GPU machine without Bazel: tests/gpu/run_gpu_checks.sh bundles and runs it.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/gpu_limit.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

ABSL_FLAG(bool, json, false, "print one JSON object");
ABSL_FLAG(int, versions, 4, "versions per run (the first is a warm-up)");
ABSL_FLAG(int, gpus, 1, "GPUs to spread the workers over (rank i on GPU i % gpus)");
ABSL_FLAG(bool, emulated, false, "use the emulated-GPU builds (//tests/fake_cuda): checks the bench, timings mean nothing");
ABSL_FLAG(std::string, config, "", "HF config.json (default: tests/e2e/testdata/qwen2.5-0.5b.json)");
ABSL_FLAG(int64_t, gpu_staging_bytes, int64_t{8} << 30, "--gpu_staging_bytes of the node in the gpu runs");

namespace wb::bench {
namespace {

using e2e::Cluster;
using e2e::Process;

using e2e::Median;

struct ModeResult {
  std::vector<double> update_s;        // sync: per version
  std::vector<double> publish_stall_s;  // one-step-off: per version, max over trainers
  std::vector<double> apply_stall_s;    // one-step-off: per version, max over rollouts
  bool verified = false;
  std::string error;
};

ModeResult RunMode(Cluster& cl, const std::string& tag, const std::string& mode, const std::string& config, int versions, int gpus) {
  ModeResult res;
  e2e::RunOptions run;
  run.config = config;
  run.model_id = absl::StrCat("qwen-", tag, "-", mode);
  run.mode = mode;
  run.versions = versions;
  run.timeout_ms = 300000;
  run.layout_source = "preset";
  std::vector<e2e::WorkerSpec> trainer_specs, rollout_specs;
  for (int r = 0; r < 2; ++r) {
    e2e::WorkerSpec t{true, 0, "fsdp", 1, 1, 2, 1, r, r % gpus};
    t.memory = "cuda";
    trainer_specs.push_back(t);
    e2e::WorkerSpec o{false, 0, "vllm", 2, 1, 1, 1, r, r % gpus};
    o.memory = "cuda";
    // One-step-off: generate long enough that each version is committed before Apply, so the
    // apply stall is the copy into live weights, not the wait for the transfer.
    if (mode != "sync") o.step_ms = 1000;
    rollout_specs.push_back(o);
  }
  auto workers = cl.RunWorkers(run, trainer_specs, rollout_specs, absl::Minutes(10), absl::Minutes(2));
  if (!workers.ok()) {
    res.error = workers.status().ToString();
    return res;
  }
  bool ok = workers->failures.empty();
  if (!ok) res.error = workers->failures.back().ToString();
  int64_t verified_last = 0;
  for (Process* p : workers->rollouts) {
    if (!e2e::EventsNamed(p, "mismatch").empty()) ok = false;
    verified_last += e2e::VerifiedBytes(p, static_cast<uint64_t>(versions));
  }
  res.verified = ok && verified_last >= e2e::ModelBytes(config);
  if (ok && !res.verified) res.error = absl::StrCat("only ", verified_last, " bytes verified for the last version");
  for (int v = 1; v <= versions; ++v) {
    const e2e::VersionWindow w = e2e::UpdateWindow(workers->trainers, workers->rollouts, static_cast<uint64_t>(v));
    if (mode == "sync") {
      res.update_s.push_back(w.seconds());
    } else {
      res.publish_stall_s.push_back(w.publish_stall_s);
      res.apply_stall_s.push_back(w.apply_stall_s);
    }
  }
  return res;
}

struct StagingResult {
  std::string staging;  // gpu | host
  ModeResult sync, one_step_off;
  double sync_s = 0, publish_stall_s = 0, apply_stall_s = 0;
  std::string error;
};

std::vector<double> Steady(const std::vector<double>& v) {
  return std::vector<double>(v.begin() + (v.size() > 1 ? 1 : 0), v.end());
}

StagingResult RunStaging(const std::string& staging, const std::string& config, int versions, int gpus, bool emulated) {
  StagingResult r;
  r.staging = staging;
  auto harness = e2e::Harness::Create("bench-gpu-" + staging);
  if (!harness.ok()) {
    r.error = harness.status().ToString();
    return r;
  }
  e2e::ClusterOptions o;
  o.num_nodes = 1;
  o.lease_ms = 10000;
  o.transfer_timeout_ms = 300000;
  o.extra_node_flags = {"--transports=host_shm,host_tcp,cuda_ipc"};
  if (staging == "gpu") o.extra_node_flags.push_back(absl::StrCat("--gpu_staging_bytes=", absl::GetFlag(FLAGS_gpu_staging_bytes)));
  if (emulated) {
    o.daemon_binary = "daemon/weightbridged_emulated_gpu";
    o.trainer_binary = "tests/e2e/trainer_worker_emulated_gpu";
    o.rollout_binary = "tests/e2e/rollout_worker_emulated_gpu";
  }
  auto cluster = Cluster::Start(harness->get(), o);
  if (!cluster.ok()) {
    r.error = cluster.status().ToString();
    return r;
  }
  r.sync = RunMode(**cluster, staging, "sync", config, versions, gpus);
  r.one_step_off = RunMode(**cluster, staging, "one_step_off", config, versions, gpus);
  (*harness)->KillAll();
  r.sync_s = Median(Steady(r.sync.update_s));
  r.publish_stall_s = Median(Steady(r.one_step_off.publish_stall_s));
  r.apply_stall_s = Median(Steady(r.one_step_off.apply_stall_s));
  if (!r.sync.error.empty()) r.error = "sync: " + r.sync.error;
  if (!r.one_step_off.error.empty()) r.error += " one_step_off: " + r.one_step_off.error;
  return r;
}

int Run() {
  const bool json = absl::GetFlag(FLAGS_json);
  const int versions = std::max(2, absl::GetFlag(FLAGS_versions));
  const int gpus = std::max(1, absl::GetFlag(FLAGS_gpus));
  const bool emulated = absl::GetFlag(FLAGS_emulated);
  std::string config = absl::GetFlag(FLAGS_config);
  if (config.empty()) config = e2e::ModelConfigPath(/*full=*/true);
  if (emulated) setenv("WB_FAKE_CUDA_DEVICES", absl::StrCat(gpus).c_str(), 1);
  const int64_t model_bytes = e2e::ModelBytes(config);
  if (!json) std::fprintf(stderr, "bench/gpu_direct: %s, %.3f GB bf16, %d GPU(s)%s; running gpu then host staging...\n", config.c_str(),
                          model_bytes / 1e9, gpus, emulated ? " EMULATED (timings mean nothing)" : "");
  StagingResult g = RunStaging("gpu", config, versions, gpus, emulated);
  StagingResult h = RunStaging("host", config, versions, gpus, emulated);
  std::string limit_why;
  const double d2d = emulated ? 0 : DeviceToDeviceGBps(model_bytes, 5, &limit_why);
  if (emulated) limit_why = "emulated GPUs";
  const bool verified = g.sync.verified && g.one_step_off.verified && h.sync.verified && h.one_step_off.verified;
  auto gbps = [&](double s) { return s > 0 ? model_bytes / s / 1e9 : 0.0; };
  const double sync_ratio = g.sync_s > 0 ? h.sync_s / g.sync_s : 0;
  if (json) {
    nlohmann::json j = {
        {"emulated", emulated},
        {"model_bytes", model_bytes},
        {"gpus", gpus},
        {"versions", versions},
        {"verified", verified},
        {"gpu_sync_s", g.sync_s},
        {"host_sync_s", h.sync_s},
        {"sync_host_over_gpu", sync_ratio},
        {"gpu_publish_stall_s", g.publish_stall_s},
        {"host_publish_stall_s", h.publish_stall_s},
        {"gpu_apply_stall_s", g.apply_stall_s},
        {"host_apply_stall_s", h.apply_stall_s},
        {"gpu_sync_GBps", gbps(g.sync_s)},
        {"host_sync_GBps", gbps(h.sync_s)},
        {"cuda_d2d_GBps", d2d},
        {"gpu_sync_vs_d2d", d2d > 0 ? gbps(g.sync_s) / d2d : 0},
        {"gpu_sync_update_s", g.sync.update_s},
        {"host_sync_update_s", h.sync.update_s},
    };
    if (d2d == 0) j["cuda_d2d_skipped"] = limit_why;
    if (!g.error.empty()) j["gpu_error"] = g.error;
    if (!h.error.empty()) j["host_error"] = h.error;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("Qwen2.5-0.5B (%.3f GB bf16), FSDP dp=2 -> vLLM tp=2 colocated on %d GPU(s)%s, median of v2..v%d\n", model_bytes / 1e9,
                gpus, emulated ? " [EMULATED: timings mean nothing]" : "", versions);
    std::printf("%-8s %10s %10s %18s %16s %9s\n", "staging", "sync_s", "sync GB/s", "1-off publish_s", "1-off apply_s", "verified");
    for (const StagingResult* r : {&g, &h}) {
      std::printf("%-8s %10.3f %10.2f %18.3f %16.3f %9s\n", r->staging.c_str(), r->sync_s, gbps(r->sync_s), r->publish_stall_s,
                  r->apply_stall_s, (r->sync.verified && r->one_step_off.verified) ? "yes" : "NO");
      if (!r->error.empty()) std::printf("  error: %s\n", r->error.c_str());
    }
    std::printf("sync update, host staging / GPU staging: %.2fx\n", sync_ratio);
    if (d2d > 0) {
      std::printf("limit (same run): cudaMemcpy D2D %.1f GB/s; GPU-direct sync update = %.3f of it\n", d2d, gbps(g.sync_s) / d2d);
    } else {
      std::printf("limit: cudaMemcpy D2D not measured (%s)\n", limit_why.c_str());
    }
  }
  return verified ? 0 : 1;
}

}  // namespace
}  // namespace wb::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return wb::bench::Run();
}
