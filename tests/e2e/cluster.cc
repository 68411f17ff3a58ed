#include "tests/e2e/cluster.h"

#include <signal.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/ctl_client.h"
#include "tests/e2e/e2e_util.h"
#include "base/status_macros.h"

namespace wb::e2e {

namespace pb = ::weightbridge::v1;

std::string VersionState(const pb::StatusResponse& s, const std::string& model, uint64_t v) {
  for (const auto& vs : s.versions()) {
    if (vs.model_id() == model && vs.version() == v) return vs.state();
  }
  return "";
}

std::vector<std::string> Cluster::DaemonFlags() const {
  std::vector<std::string> f = {
      absl::StrCat("--heartbeat_ms=", options_.heartbeat_ms),
      absl::StrCat("--lease_ms=", options_.lease_ms),
      absl::StrCat("--transfer_timeout_ms=", options_.transfer_timeout_ms),
  };
  f.insert(f.end(), options_.extra_daemon_flags.begin(), options_.extra_daemon_flags.end());
  return f;
}

std::string Cluster::worker_socket(int i) const {
  return harness_->Path(absl::StrCat("n", i, ".sock"));
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(Harness* harness, ClusterOptions options) {
  std::unique_ptr<Cluster> c(new Cluster(harness, std::move(options)));
  RETURN_IF_ERROR(c->StartCoordinator("127.0.0.1:0"));
  c->nodes_.resize(c->options_.num_nodes, nullptr);
  c->node_ports_.resize(c->options_.num_nodes, 0);
  c->node_starts_.resize(c->options_.num_nodes, 0);
  for (int i = 0; i < c->options_.num_nodes; ++i) RETURN_IF_ERROR(c->StartNode(i));
  // Every node registered with the coordinator before workers come.
  const int n = c->options_.num_nodes;
  RETURN_IF_ERROR(c->WaitForStatus(
                       [n](const pb::StatusResponse& s) {
                         int alive = 0;
                         for (const auto& node : s.nodes()) alive += node.alive();
                         return alive >= n;
                       },
                       c->options_.start_timeout, "all nodes registered")
                      .status());
  return c;
}

absl::Status Cluster::StartCoordinator(const std::string& listen) {
  const int start = ++coord_starts_;
  const std::string name = start == 1 ? "coordinator" : absl::StrCat("coordinator-", start);
  const std::string port_file = harness_->Path(name + ".port");
  std::vector<std::string> argv = {Runfile(options_.daemon_binary), "--role=coordinator", "--listen=" + listen,
                                   "--port_file=" + port_file};
  for (const auto& f : DaemonFlags()) argv.push_back(f);
  ASSIGN_OR_RETURN(coordinator_, harness_->Spawn(name, argv));
  ASSIGN_OR_RETURN(coord_port_, harness_->WaitForPortFile(port_file, options_.start_timeout, coordinator_));
  return absl::OkStatus();
}

absl::Status Cluster::KillCoordinator() {
  coordinator_->Kill();
  return coordinator_->WaitExit(absl::Seconds(10)).status();
}

absl::Status Cluster::RestartCoordinator() {
  if (!coordinator_->Exited()) return absl::FailedPreconditionError("the coordinator still runs");
  return StartCoordinator(absl::StrCat("127.0.0.1:", coord_port_));
}

absl::Status Cluster::StartNode(int i) {
  const int start = ++node_starts_[i];
  const std::string port_file = harness_->Path(absl::StrCat("n", i, "-", start, ".port"));
  std::vector<std::string> argv = {Runfile(options_.daemon_binary),
                                   "--role=node",
                                   "--listen=127.0.0.1:0",
                                   "--data_listen=127.0.0.1:0",
                                   "--port_file=" + port_file,
                                   "--worker_socket=" + worker_socket(i),
                                   "--coordinator=" + coordinator_address(),
                                   "--node_id=" + node_id(i)};
  for (const auto& f : DaemonFlags()) argv.push_back(f);
  for (const auto& f : options_.extra_node_flags) argv.push_back(f);
  if (auto it = options_.node_flags.find(i); it != options_.node_flags.end()) {
    for (const auto& f : it->second) argv.push_back(f);
  }
  const std::string metrics_file = harness_->Path(absl::StrCat("n", i, "-", start, ".metrics"));
  if (options_.node_metrics) {
    argv.push_back("--metrics_listen=127.0.0.1:0");
    argv.push_back("--metrics_port_file=" + metrics_file);
  }
  ASSIGN_OR_RETURN(nodes_[i], harness_->Spawn(absl::StrCat("n", i, "-", start), argv));
  ASSIGN_OR_RETURN(node_ports_[i],
                   harness_->WaitForPortFile(port_file, options_.start_timeout, nodes_[i]));
  if (options_.node_metrics) {
    // Written before the port file.
    node_metrics_ports_.resize(nodes_.size(), 0);
    ASSIGN_OR_RETURN(node_metrics_ports_[i], harness_->WaitForPortFile(metrics_file, options_.start_timeout, nodes_[i]));
  }
  return absl::OkStatus();
}

absl::Status Cluster::KillNode(int i) {
  nodes_[i]->Kill();
  return nodes_[i]->WaitExit(absl::Seconds(10)).status();
}

absl::Status Cluster::RestartNode(int i) {
  if (!nodes_[i]->Exited()) return absl::FailedPreconditionError(absl::StrCat("node ", i, " still runs"));
  return StartNode(i);
}

absl::StatusOr<Process*> Cluster::SpawnWorker(const RunOptions& run, const WorkerSpec& w) {
  const std::string role = w.trainer ? "trainer" : "rollout";
  std::vector<std::string> argv = {
      Runfile(w.trainer ? options_.trainer_binary : options_.rollout_binary),
      "--socket=" + worker_socket(w.node),
      "--config=" + run.config,
      "--model_id=" + run.model_id,
      "--mode=" + run.mode,
      "--strategy=" + run.strategy,
      absl::StrCat("--num_trainers=", run.num_trainers),
      absl::StrCat("--num_rollouts=", run.num_rollouts),
      absl::StrCat("--max_staleness=", run.max_staleness),
      absl::StrCat("--versions=", run.versions),
      absl::StrCat("--first_version=", run.first_version),
      absl::StrCat("--timeout_ms=", run.timeout_ms),
      "--layout_source=" + run.layout_source,
      absl::StrCat("--tolerate_failures=", run.tolerate_failures ? "true" : "false"),
      "--preset=" + w.preset,
      absl::StrCat("--tp=", w.tp),
      absl::StrCat("--pp=", w.pp),
      absl::StrCat("--dp=", w.dp),
      absl::StrCat("--replicas=", w.replicas),
      absl::StrCat("--rank=", w.rank),
      absl::StrCat("--gpu=", w.gpu),
      "--memory=" + w.memory,
      absl::StrCat("--step_ms=", w.step_ms),
  };
  if (w.trainer && !run.gate_dir.empty()) argv.push_back("--gate_dir=" + run.gate_dir);
  for (const auto& f : w.extra_flags) argv.push_back(f);
  ++workers_;
  return harness_->Spawn(absl::StrCat(role, w.rank, "-n", w.node, "-", run.model_id), argv, w.env);
}

absl::StatusOr<Cluster::RunResult> Cluster::RunWorkers(RunOptions run, const std::vector<WorkerSpec>& trainers,
                                                       const std::vector<WorkerSpec>& rollouts, absl::Duration rollout_timeout,
                                                       absl::Duration trainer_timeout) {
  run.num_trainers = static_cast<int>(trainers.size());
  run.num_rollouts = static_cast<int>(rollouts.size());
  RunResult r;
  for (const WorkerSpec& w : trainers) {
    ASSIGN_OR_RETURN(Process * p, SpawnWorker(run, w));
    r.trainers.push_back(p);
  }
  for (const WorkerSpec& w : rollouts) {
    ASSIGN_OR_RETURN(Process * p, SpawnWorker(run, w));
    r.rollouts.push_back(p);
  }
  for (Process* p : r.rollouts) {
    if (absl::Status s = ExpectCleanExit(p, Scaled(rollout_timeout)); !s.ok()) r.failures.push_back(s);
  }
  for (Process* p : r.trainers) {
    if (absl::Status s = ExpectCleanExit(p, Scaled(trainer_timeout)); !s.ok()) r.failures.push_back(s);
  }
  return r;
}

absl::StatusOr<pb::StatusResponse> Cluster::Status() const {
  ASSIGN_OR_RETURN(auto client, client::CtlClient::Connect(coordinator_address(), absl::Seconds(5)));
  return client->FetchStatus(absl::Seconds(5));
}

absl::StatusOr<pb::StatusResponse> Cluster::WaitForStatus(
    const std::function<bool(const pb::StatusResponse&)>& pred, absl::Duration timeout,
    const std::string& what) const {
  const absl::Time deadline = absl::Now() + timeout;
  ASSIGN_OR_RETURN(auto client, client::CtlClient::Connect(coordinator_address(), timeout));
  // The coordinator pushes each status change (WatchStatus); a restarting coordinator is waited
  // for within the same deadline.
  pb::StatusResponse last;
  auto s = client->WaitForStatus(pred, deadline, &last);
  if (s.ok() || !absl::IsDeadlineExceeded(s.status())) return s;
  return absl::DeadlineExceededError(absl::StrCat(
      "cluster status: '", what, "' not reached within ", absl::FormatDuration(timeout), " (",
      s.status().message(), ")\nlast status: ", last.ShortDebugString().substr(0, 3000)));
}

absl::StatusOr<int> Cluster::RunWbctl(const std::vector<std::string>& args, absl::Duration timeout,
                                      std::vector<std::string>* lines) {
  std::vector<std::string> argv = {Runfile("client/wbctl")};
  argv.insert(argv.end(), args.begin(), args.end());
  ASSIGN_OR_RETURN(Process * p, harness_->Spawn(absl::StrCat("wbctl-", ++wbctl_runs_), argv));
  // WaitExit returns once stdout is read to the end too: the lines are complete.
  ASSIGN_OR_RETURN(int code, p->WaitExit(timeout));
  if (lines) *lines = p->Lines();
  return code;
}

}  // namespace wb::e2e
