#pragma once
// A WeightBridge cluster of real processes on loopback for end-to-end tests: one coordinator and
// N node daemons (`weightbridged --role=...`), plus trainer/rollout worker processes attached to
// the nodes' worker sockets. Built on the process harness (tests/e2e/harness.h).

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/weightbridge.pb.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {

struct ClusterOptions {
  int num_nodes = 3;
  // Generous for a loaded 2-core CI machine: eight workers filling and checking hundreds of MB
  // can delay a heartbeat by a second; a lost lease there would be a false failure.
  int64_t heartbeat_ms = 300;
  int64_t lease_ms = ScaledMs(6000);
  // The daemon's own default: a version of the test model across nccl lanes overran 20 s once on
  // the loaded 2-core machine (NcclLanePerGpu). Tests that need an abort sooner set their own.
  int64_t transfer_timeout_ms = ScaledMs(60000);
  std::vector<std::string> extra_daemon_flags;
  std::vector<std::string> extra_node_flags;  // node daemons only
  std::map<int, std::vector<std::string>> node_flags;  // node i only (after extra_node_flags)
  // Nodes serve Prometheus /metrics on 127.0.0.1:0 (node_metrics_port(i) says where).
  bool node_metrics = false;
  // Binaries, as runfiles paths. The emulated-GPU tests swap in builds linked with the emulated
  // CUDA runtime (//tests/fake_cuda).
  std::string daemon_binary = "daemon/weightbridged";
  std::string trainer_binary = "tests/e2e/trainer_worker";
  std::string rollout_binary = "tests/e2e/rollout_worker";
  absl::Duration start_timeout = Scaled(absl::Seconds(30));
};

// What every worker of one model run shares.
struct RunOptions {
  std::string config;  // HF config.json path
  std::string model_id = "qwen";
  std::string mode = "sync";
  std::string strategy = "weightbridge";
  int num_trainers = 1;
  int num_rollouts = 1;
  int max_staleness = 0;
  int versions = 2;
  int first_version = 1;
  int64_t timeout_ms = ScaledMs(60000);
  std::string layout_source = "pieces";
  bool tolerate_failures = false;
  std::string gate_dir;  // trainers wait for <gate_dir>/publish-<v>
};

struct WorkerSpec {
  bool trainer = true;
  int node = 0;
  std::string preset;  // megatron | fsdp | vllm
  int tp = 1, pp = 1, dp = 1, replicas = 1;
  int rank = 0;
  int gpu = -1;
  int64_t step_ms = 0;
  std::vector<std::string> extra_flags;
  std::string memory = "shm";  // shm | cuda (the worker's --memory; cuda needs gpu >= 0)
  std::vector<std::string> env;  // extra environment of the worker process, "K=V"
};

class Cluster {
 public:
  // Starts the coordinator, then the nodes (n0, n1, ...), each waited for through its port file.
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(Harness* harness, ClusterOptions options);

  std::string coordinator_address() const { return "127.0.0.1:" + std::to_string(coord_port_); }
  std::string node_id(int i) const { return "n" + std::to_string(i); }
  std::string worker_socket(int i) const;
  std::string node_address(int i) const { return "127.0.0.1:" + std::to_string(node_ports_[i]); }
  Process* coordinator() const { return coordinator_; }
  Process* node(int i) const { return nodes_[i]; }
  // Metrics port of node i's current process (ClusterOptions::node_metrics), else 0.
  int node_metrics_port(int i) const { return node_metrics_ports_.empty() ? 0 : node_metrics_ports_[i]; }

  // kill -9 of the coordinator, waited for.
  absl::Status KillCoordinator();
  // Starts the coordinator again on the same port (nodes keep dialling that address) and waits
  // for its port file. Nodes re-register on their own.
  absl::Status RestartCoordinator();
  // kill -9 of node i, waited for.
  absl::Status KillNode(int i);
  // Starts node i again (same id and worker socket) and waits for its port file.
  absl::Status RestartNode(int i);

  absl::StatusOr<Process*> SpawnWorker(const RunOptions& run, const WorkerSpec& spec);

  // The workers of one run, as RunWorkers left them.
  struct RunResult {
    std::vector<Process*> trainers, rollouts;
    std::vector<absl::Status> failures;  // one per worker that did not exit cleanly, rollouts first
  };
  // Spawns `trainers`, then `rollouts`, for `run` (its num_trainers / num_rollouts are taken from
  // them) and waits until every rollout (within `rollout_timeout`), then every trainer (within
  // `trainer_timeout`) has exited, both Scaled (harness.h). A worker that could not be spawned is the error.
  absl::StatusOr<RunResult> RunWorkers(RunOptions run, const std::vector<WorkerSpec>& trainers, const std::vector<WorkerSpec>& rollouts,
                                       absl::Duration rollout_timeout = absl::Seconds(240),
                                       absl::Duration trainer_timeout = absl::Seconds(60));

  // ClusterStatus from the coordinator.
  absl::StatusOr<weightbridge::v1::StatusResponse> Status() const;
  // Waits (bounded) until `pred` holds, on the coordinator's status push (WatchStatus).
  absl::StatusOr<weightbridge::v1::StatusResponse> WaitForStatus(
      const std::function<bool(const weightbridge::v1::StatusResponse&)>& pred,
      absl::Duration timeout, const std::string& what) const;

  // Runs `wbctl ARGS...` to completion (bounded); returns its exit code, stdout lines in `lines`.
  absl::StatusOr<int> RunWbctl(const std::vector<std::string>& args, absl::Duration timeout,
                               std::vector<std::string>* lines = nullptr);

 private:
  Cluster(Harness* h, ClusterOptions o) : harness_(h), options_(std::move(o)) {}
  absl::Status StartNode(int i);
  absl::Status StartCoordinator(const std::string& listen);
  std::vector<std::string> DaemonFlags() const;

  Harness* harness_;
  ClusterOptions options_;
  Process* coordinator_ = nullptr;
  int coord_port_ = 0;
  int coord_starts_ = 0;
  std::vector<Process*> nodes_;
  std::vector<int> node_ports_;
  std::vector<int> node_metrics_ports_;
  std::vector<int> node_starts_;
  int wbctl_runs_ = 0;
  int workers_ = 0;
};

// Version state of `model`'s version `v` in a status ("" when absent).
std::string VersionState(const weightbridge::v1::StatusResponse& s, const std::string& model,
                         uint64_t v);

}  // namespace wb::e2e
