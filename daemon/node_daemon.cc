// NodeDaemon: the wiring of the node's parts (see node_daemon.h and docs/architecture.md "Node
// daemon"), Start / Shutdown, registration and re-join, the control tick.
#include "daemon/node_daemon.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/convert.h"
#include "daemon/log.h"
#include "daemon/nccl_route.h"
#include "daemon/node/delta_node.h"
#include "daemon/node/grpc_coordinator_client.h"
#include "daemon/node/node_service.h"
#include "daemon/node/worker_service.h"

namespace wb::daemon {
namespace {

DaemonMetrics* MetricsOf(const NodeDaemon::Options& o) { return o.metrics != nullptr ? o.metrics : &Metrics(); }

node::NodeStaging::Options StagingOptions(const NodeDaemon::Options& o, LiveCopier* copier) {
  node::NodeStaging::Options so;
  so.node_id = o.node_id;
  so.budget_bytes = o.staging_budget_bytes;
  so.clock = o.clock;
  so.device_staging = o.device_staging;
  so.metrics = MetricsOf(o);
  so.copier = copier;
  return so;
}

node::Versions::Options VersionsOptions(const NodeDaemon::Options& o, node::PeerStubs* peers) {
  node::Versions::Options vo;
  vo.node_id = o.node_id;
  vo.clock = o.clock;
  vo.metrics = MetricsOf(o);
  vo.checksums = o.checksums;
  vo.digests = o.digests;
  vo.digest_threads = o.digest_threads;
  vo.digest_overlap = o.digest_overlap;
  vo.digest_in_transport = o.digest_in_transport;
  vo.delta_cache_bytes = o.delta_cache_bytes;
  vo.delta_threads = node::ResolveDeltaThreads(o.delta_threads, std::thread::hardware_concurrency());
  vo.quantize_early_threads = o.quantize_early_threads;
  vo.delta_in_place = o.delta_in_place;
  vo.delta_apply_delay = o.delta_apply_delay;
  vo.test_after_buckets = o.test_after_buckets;
  vo.test_before_bucket = o.test_before_bucket;
  vo.test_commit_answer = o.test_commit_answer;
  vo.connect_rounds = o.test_connect_rounds;
  vo.exchange_regions = [peers](const std::string& peer, const std::string& address, const pb::ExchangeRegionsRequest& req,
                                pb::ExchangeRegionsResponse* resp, absl::Time deadline) {
    return peers->ExchangeRegions(peer, address, req, resp, deadline);
  };
  return vo;
}

node::WorkerCalls::Options WorkerCallsOptions(const NodeDaemon::Options& o, std::shared_ptr<GpuImport> gpu_import) {
  node::WorkerCalls::Options wo;
  wo.node_id = o.node_id;
  wo.coordinator = o.coordinator;
  wo.clock = o.clock;
  wo.metrics = MetricsOf(o);
  wo.cuda_vmm_fd = o.cuda_vmm_fd;
  wo.worker_uid = o.worker_uid;
  wo.gpu_import = std::move(gpu_import);
  return wo;
}

}  // namespace

NodeDaemon::NodeDaemon(Options options)
    : options_(std::move(options)),
      transports_(&options_.transports, options_.device_staging),
      gpu_import_(options_.gpu_import != nullptr ? options_.gpu_import : NewGpuImport()),
      copier_(options_.node_id, transports_.Local(), options_.test_live_copy_fault),
      local_(LocalWorkers::Options{options_.node_id, options_.clock, options_.live_copy_timeout, &copier_}),
      staging_(StagingOptions(options_, &copier_)),
      peer_stubs_(options_.make_channel),
      unstarted_(options_.node_id),
      versions_(VersionsOptions(options_, &peer_stubs_), local_, channels_, staging_, transports_, *this),
      worker_calls_(WorkerCallsOptions(options_, gpu_import_), local_, staging_, versions_, transports_, *this),
      worker_impl_(NewWorkerService(&worker_calls_)),
      node_impl_(NewNodeService(&versions_, &worker_calls_, [this] { return data_address_; })) {
  // Workers' shm segments may shrink under us (a worker truncating its own memory): a fault in one
  // must fail that worker's call, not kill the daemon (ShmSegment::CheckIntact).
  transport::ShmSegment::InstallSigbusGuard();
}

NodeDaemon::~NodeDaemon() { Shutdown(); }

CoordinatorClient& NodeDaemon::client() {
  CoordinatorClient* c = client_.load();
  return c != nullptr ? *c : unstarted_;
}

bool NodeDaemon::AwaitRegistered(absl::Time deadline) {
  CoordinatorSession* s = session_.load();
  return s != nullptr && s->AwaitRegistered(deadline);
}

uint64_t NodeDaemon::session() {
  CoordinatorSession* s = session_.load();
  return s != nullptr ? s->session() : 0;
}

std::optional<std::string> NodeDaemon::AwaitCoordinatorChange(uint64_t session0, absl::Time deadline) {
  CoordinatorSession* s = session_.load();
  if (s == nullptr) return std::nullopt;
  return s->AwaitCoordinatorChange(session0, deadline);
}

std::optional<absl::Time> NodeDaemon::UnreachableSince() {
  CoordinatorSession* s = session_.load();
  return s != nullptr ? s->UnreachableSince() : std::nullopt;
}

std::string NodeDaemon::coordinator_instance() {
  CoordinatorSession* s = session_.load();
  return s != nullptr ? s->coordinator_instance() : std::string();
}

void NodeDaemon::TrackProgress(const std::string& model_id, uint64_t version, std::weak_ptr<const std::atomic<uint64_t>> bytes_done) {
  CoordinatorSession* s = session_.load();
  if (s != nullptr) s->TrackProgress(model_id, version, std::move(bytes_done));
}

void NodeDaemon::CheckWorkers() {
  worker_calls_.LeaveExited();     // exited workers' leaves (owed when the coordinator does not answer)
  worker_calls_.SendOwedLeaves();  // once it answers again
}

absl::Status NodeDaemon::Start(const std::string& node_address) {
  if (transports_.Local() == nullptr) {
    return absl::InvalidArgumentError("node daemon needs a same-node host-memory transport (host_shm)");
  }
  if (!options_.live_state_dir.empty()) {
    // Before the first worker can register: leftovers of a previous process make theirs TORN.
    ASSIGN_OR_RETURN(markers_, LiveMarkers::Open(options_.live_state_dir, options_.node_id));
    local_.AttachMarkers(markers_.get());
    // Its trainers' answered publishes (status.md item 24): inherited by the same process only.
    auto alive = [](const std::string& process) {
      int pid = 0;
      if (!absl::SimpleAtoi(process.substr(0, process.find('@')), &pid) || pid <= 0) return false;
      absl::StatusOr<std::shared_ptr<PidWatch>> w = PidWatch::Open(pid, "a trainer of the publish record");
      return w.ok() && (*w)->Identity() == process;
    };
    ASSIGN_OR_RETURN(publish_record_, node::PublishRecord::Open(options_.live_state_dir, options_.node_id, alive));
    worker_calls_.AttachPublishRecord(publish_record_.get());
  }
  node_address_ = node_address;
  data_address_ = node_address;  // peers reach our NodeService (ExchangeRegions) here
  std::shared_ptr<grpc::Channel> channel;
  if (options_.make_channel) {
    channel = options_.make_channel(options_.coordinator);
  } else {
    // A restarted coordinator is reached within about a second, not after gRPC's default
    // exponential reconnect backoff (up to 2 minutes).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    channel = grpc::CreateCustomChannel(options_.coordinator, grpc::InsecureChannelCredentials(), args);
  }
  coordinator_client_ = std::make_unique<GrpcCoordinatorClient>(channel);
  client_.store(coordinator_client_.get());
  CoordinatorSession::Options so;
  so.node_id = options_.node_id;
  so.client = coordinator_client_.get();
  so.clock = options_.clock;
  so.heartbeat = options_.heartbeat;
  so.registration = Registration();
  so.rejoin = [this](const std::string& reason) { Rejoin(reason); };
  so.tick = [this] { ControlTick(); };
  so.test_skip_heartbeat = options_.test_skip_heartbeat;
  coord_ = std::make_unique<CoordinatorSession>(std::move(so));
  session_.store(coord_.get());
  RETURN_IF_ERROR_WITH(coord_->Start(), absl::StrCat("registering node ", options_.node_id, " with coordinator ", options_.coordinator));
  return absl::OkStatus();
}

pb::RegisterNodeRequest NodeDaemon::Registration() const {
  pb::RegisterNodeRequest req;
  req.set_node_id(options_.node_id);
  req.set_address(node_address_);
  req.set_data_address(data_address_);
  req.set_heartbeat_ms(absl::ToInt64Milliseconds(options_.heartbeat));
  req.set_delta_cache_bytes(options_.delta_cache_bytes);
  req.set_delta_in_place(options_.delta_in_place);
  req.set_understands_bases_without_shadows(true);  // ExecuteVersionRequest.bases_without_shadows
  for (const auto& t : options_.transports.all()) {
    // nccl moves GPU staging only: without a GPU staging budget the node keeps cross-node bytes on
    // the host channel, and says so by not advertising nccl (the coordinator routes by it).
    // Each nccl lane is advertised by its own name ("nccl/<device>").
    if (t->capabilities().kind == "nccl") continue;
    const transport::Capabilities caps = t->capabilities();
    (*req.mutable_transport_instances())[caps.kind] = t->instance_id();
    if (caps.kind == "host_tcp") {
      for (const std::string& a : caps.local_addresses) req.add_data_nics(a);
    }
  }
  for (auto& [device, t] : transports_.NcclLanes()) (*req.mutable_transport_instances())[NcclLaneName(device)] = t->instance_id();
  return req;
}

void NodeDaemon::Rejoin(const std::string& reason) {
  // 1. Whatever was in flight belongs to the old coordinator session: abort it here (node-local
  //    waiters - Apply - get ABORTED naming the reason; rollouts keep their committed/live copy).
  std::map<std::string, uint64_t> committed = versions_.AbortAllForRejoin(reason);
  struct Job {
    LocalWorkers::WorkerKey worker;
    pb::JoinWorkerRequest join;
    bool has_layout = false;
    pb::SubmitLayoutRequest layout;
  };
  std::vector<Job> jobs;
  for (LocalWorkers::JoinInfo& w : local_.Joins()) {
    Job j;
    j.worker = w.key;
    j.join.set_node_id(options_.node_id);
    j.join.set_worker_id(w.key.second);
    j.join.set_model_id(w.key.first);
    j.join.set_role(ToProto(w.role));
    j.join.set_gpu(w.gpu);
    *j.join.mutable_model() = std::move(w.spec);
    j.join.set_rejoin(true);
    j.join.set_committed_version(committed[w.key.first]);  // the model's bound
    j.join.set_applied_version(w.applied_version);
    j.join.set_process(w.process);
    // What this worker itself holds: a late rollout whose catch-up had not finished holds less
    // than the node's committed version and must be caught up by the new session (sending the
    // node's version for it made the coordinator count it as holding that version: WaitVersion
    // answered OK for it and it was never caught up).
    if (w.role == planner::Role::kRollout) j.join.set_holds_version(std::max(w.committed_version, w.applied_version));
    // ... and whether a catch-up gave it that version (no canonical shadows here: the new
    // coordinator must not name it as the base of deltas into them).
    j.join.set_holds_without_shadows(w.holds_without_shadows);
    // A trainer's last publish the old coordinator recorded: never sent again, so a number the new
    // coordinator must count used (a rollout's Apply of it is answered ABORTED, not left waiting).
    if (w.role == planner::Role::kTrainer) j.join.set_published_version(w.published_version);
    j.has_layout = w.has_layout;
    j.layout = std::move(w.submitted);
    jobs.push_back(std::move(j));
  }
  // 2. Re-submit models, workers and layouts. A worker the coordinator refuses is dropped here
  //    (its client sees NOT_FOUND and registers again).
  for (Job& j : jobs) {
    pb::JoinWorkerResponse jr;
    absl::Status s = client().JoinWorker(j.join, &jr, absl::Seconds(12));
    // A sync rollout's pause the old coordinator held, before its layout (so before a re-plan).
    if (s.ok()) worker_calls_.ResendPause(j.worker);
    if (s.ok() && j.has_layout) {
      pb::SubmitLayoutResponse sr;
      s = client().SubmitLayout(j.layout, &sr, absl::Seconds(32));
    }
    if (!s.ok()) {
      Log(LogLevel::kWarning, "worker not re-joined",
          {{"node", options_.node_id}, {"model", j.worker.first}, {"worker", j.worker.second}, {"error", s.message()}});
      local_.Remove(j.worker);
    }
  }
  Log(LogLevel::kInfo, "node re-joined", {{"node", options_.node_id}, {"workers", jobs.size()}, {"reason", reason}});
}

void NodeDaemon::ControlTick() {
  CheckWorkers();
  staging_.Tick();
  RecordGuards();
}

void NodeDaemon::RecordGuards() {
  const transport::TransportSet& set = transports_.set();
  for (const auto& t : set.all()) {
    transport::TransportStats stats = t->stats();
    if (stats.guards.empty()) continue;
    const int device = set.DeviceOf(t.get());
    std::string label = t->capabilities().kind;
    if (device >= 0) absl::StrAppend(&label, "/", device);  // nccl lanes: one per GPU
    guard_meter_.Record(metrics(), options_.node_id, label, stats.guards);
  }
}

void NodeDaemon::Shutdown() {
  if (stopped_.exchange(true)) return;
  versions_.Stop();          // aborts versions in flight, ends LocalWorkers' waits
  if (coord_) coord_->Stop();
  worker_calls_.StopLeaves();  // no tick queues more; a leave in flight ends before the client goes
  versions_.Join();          // tears down channels (blocked executors end), joins executors
}

}  // namespace wb::daemon
