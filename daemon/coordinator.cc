#include "daemon/coordinator.h"

#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "daemon/box_copy.h"
#include "daemon/convert.h"
#include "daemon/log.h"
#include "daemon/nccl_route.h"
#include "planner/quantized.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/planner.h"
#include "planner/presets.h"
#include "planner/validate.h"
#include "proto/grpc_status.h"
#include "tools/cc/status_macros.h"

namespace wb::daemon {
namespace {

// fn(0) .. fn(n - 1) on up to 32 threads at once (per-node RPCs of one version: every node at
// once on a small cluster, bounded threads on a large one); returns when all returned.
void ForEachConcurrently(size_t n, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min<size_t>(n, 32); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

ModeKind ToMode(pb::Mode mode) {
  switch (mode) {
    case pb::MODE_ONE_STEP_OFF: return ModeKind::kOneStepOff;
    case pb::MODE_ASYNC: return ModeKind::kAsync;
    default: return ModeKind::kSync;
  }
}

absl::Time RequestDeadline(int64_t timeout_ms) {
  return absl::Now() + (timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(60));
}

// A preset's parallel config from the proto (0 = the preset's default of 1; etp 0 = tp).
planner::ParallelConfig FromProto(const pb::ParallelConfig& p) {
  planner::ParallelConfig c;
  c.preset = p.preset();
  c.tp = p.tp() ? static_cast<int>(p.tp()) : 1;
  c.pp = p.pp() ? static_cast<int>(p.pp()) : 1;
  c.dp = p.dp() ? static_cast<int>(p.dp()) : 1;
  c.ep = p.ep() ? static_cast<int>(p.ep()) : 1;
  c.etp = static_cast<int>(p.etp());
  c.expert_parallel = p.expert_parallel();
  c.replicas = p.replicas() ? static_cast<int>(p.replicas()) : 1;
  c.quantization = p.quantization();
  c.first_stage_layers = static_cast<int>(std::min<uint32_t>(p.first_stage_layers(), 1u << 30));
  c.last_stage_layers = static_cast<int>(std::min<uint32_t>(p.last_stage_layers(), 1u << 30));
  c.vpp = p.vpp() ? static_cast<int>(std::min<uint32_t>(p.vpp(), 1u << 30)) : 1;
  c.expert_placement = p.expert_placement();
  return c;
}

std::string BoxKey(int32_t tensor, const planner::Box& box) { return absl::StrCat(tensor, planner::BoxToString(box)); }

}  // namespace

namespace {
std::string NewInstanceId() {
  std::random_device rd;
  return absl::StrCat(absl::Hex(rd(), absl::kZeroPad8), absl::Hex(rd(), absl::kZeroPad8), "-",
                      absl::ToUnixMillis(absl::Now()));
}
}  // namespace

Coordinator::Coordinator(Options options) : options_(std::move(options)), instance_(NewInstanceId()) {
  if (!options_.make_plan) options_.make_plan = [](const planner::Problem& p, planner::Strategy s) { return planner::MakePlan(p, s); };
}

Coordinator::~Coordinator() { Shutdown(); }

void Coordinator::Start() { driver_ = std::thread([this] { DriverLoop(); }); }

void Coordinator::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  if (driver_.joinable()) driver_.join();
}

absl::StatusOr<Coordinator::Model*> Coordinator::GetModelLocked(const std::string& id) {
  auto it = models_.find(id);
  if (it == models_.end()) return absl::NotFoundError(absl::StrCat("unknown model '", id, "'"));
  return &it->second;
}

absl::Status Coordinator::CreateModelLocked(const pb::ModelSpec& spec, bool* created) {
  *created = false;
  if (spec.model_id().empty()) return absl::InvalidArgumentError("model_id is empty");
  auto it = models_.find(spec.model_id());
  if (it != models_.end()) {
    const pb::ModelSpec& have = it->second.spec;
    if (have.mode() != spec.mode() || have.num_trainer_workers() != spec.num_trainer_workers() ||
        have.num_rollout_workers() != spec.num_rollout_workers() || have.strategy() != spec.strategy() ||
        have.max_staleness() != spec.max_staleness()) {
      return absl::AlreadyExistsError(absl::StrCat("model ", spec.model_id(), " exists with a different spec"));
    }
    return absl::OkStatus();
  }
  if (spec.num_trainer_workers() == 0 || spec.num_rollout_workers() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec.model_id(), ": worker counts must be > 0"));
  }
  Model m;
  m.spec = spec;
  if (spec.has_explicit_tensors()) {
    ASSIGN_OR_RETURN(m.inventory, InventoryFromProto(spec.explicit_tensors().tensors()));
  } else if (!spec.hf_config_json().empty()) {
    planner::DType dtype = planner::DType::kBF16;
    if (spec.dtype() != pb::DTYPE_UNSPECIFIED) {
      ASSIGN_OR_RETURN(dtype, FromProto(spec.dtype()));
    }
    auto config = planner::ParseHfConfig(spec.hf_config_json());
    if (!config.ok()) return Annotate(config.status(), absl::StrCat("model ", spec.model_id(), ": hf_config_json"));
    ASSIGN_OR_RETURN(m.inventory, planner::BuildInventory(*config, dtype));
    m.config = std::move(*config);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec.model_id(), ": no inventory (hf_config_json or explicit_tensors)"));
  }
  if (m.inventory.tensors.empty()) return absl::InvalidArgumentError("model has no tensors");
  m.machine = std::make_unique<VersionMachine>(ToMode(spec.mode()), spec.max_staleness());
  Log(LogLevel::kInfo, "model created", {{"model", spec.model_id()}, {"tensors", m.inventory.tensors.size()},
                                         {"mode", ModeName(spec.mode())}, {"strategy", planner::StrategyName(FromProto(spec.strategy()))},
                                         {"trainers", spec.num_trainer_workers()}, {"rollouts", spec.num_rollout_workers()}});
  models_.emplace(spec.model_id(), std::move(m));
  StatusChangedLocked();
  *created = true;
  return absl::OkStatus();
}

grpc::Status Coordinator::RegisterNode(grpc::ServerContext*, const pb::RegisterNodeRequest* req,
                                       pb::RegisterNodeResponse* resp) {
  if (req->node_id().empty() || req->address().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("node_id and address are required"));
  }
  auto channel = options_.make_channel ? options_.make_channel(req->address())
                                       : grpc::CreateChannel(req->address(), grpc::InsecureChannelCredentials());
  absl::MutexLock l(&mu_);
  Node& n = nodes_[req->node_id()];
  if (n.incarnation > 0) {
    // A restarted node: whatever its workers had registered is gone with the old process.
    for (auto& [id, m] : models_) {
      std::vector<std::string> gone;
      for (auto& [w, rec] : m.workers) if (rec.node == req->node_id()) gone.push_back(w);
      for (const std::string& w : gone) DropWorkerLocked(m, w, absl::StrCat("node ", req->node_id(), " restarted"));
      // The version in flight cannot finish with the old process gone.
      if (m.machine->InFlightInvolves(req->node_id())) {
        AbortLocked(id, m, *m.machine->InFlight(), absl::StrCat("node ", req->node_id(), " restarted"));
      }
    }
  }
  n.address = req->address();
  n.data_address = req->data_address();
  n.incarnation += 1;
  n.alive = true;
  n.draining = false;
  // A lease shorter than 3 heartbeats of the node would expire on one late beat.
  n.lease = std::max(options_.lease, 3 * absl::Milliseconds(req->heartbeat_ms()));
  n.lease_expiry = options_.clock->Now() + n.lease;
  n.stub = pb::NodeService::NewStub(channel);
  n.transport_instances.clear();
  for (auto& [k, v] : req->transport_instances()) n.transport_instances[k] = v;
  n.data_nics.assign(req->data_nics().begin(), req->data_nics().end());
  // Commits the old incarnation missed are moot: its staging died with it.
  pending_commits_.erase(std::remove_if(pending_commits_.begin(), pending_commits_.end(),
                                        [&](const PendingCommit& p) { return p.node == req->node_id(); }),
                         pending_commits_.end());
  Log(LogLevel::kInfo, "node registered", {{"node", req->node_id()}, {"address", req->address()},
                                           {"data_address", req->data_address()}, {"incarnation", n.incarnation}});
  resp->set_lease_ms(absl::ToInt64Milliseconds(n.lease));
  resp->set_incarnation(n.incarnation);
  resp->set_coordinator_instance(instance_);
  wake_ = true;
  StatusChangedLocked();
  return grpc::Status::OK;
}

grpc::Status Coordinator::Heartbeat(grpc::ServerContext*, const pb::HeartbeatRequest* req,
                                    pb::HeartbeatResponse* resp) {
  // Receipt time, taken before the lock: a busy coordinator must not count its own delay as a
  // missed heartbeat.
  const absl::Time received = options_.clock->Now();
  absl::MutexLock l(&mu_);
  resp->set_coordinator_instance(instance_);
  auto it = nodes_.find(req->node_id());
  if (it == nodes_.end() || !it->second.alive || it->second.incarnation != req->incarnation()) {
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat("node ", req->node_id(), " is not registered (lease lost?): register again")));
  }
  it->second.lease_expiry = std::max(it->second.lease_expiry, received + it->second.lease);
  for (const pb::VersionProgress& p : req->progress()) {
    auto m = models_.find(p.model_id());
    if (m == models_.end()) continue;
    uint64_t& done = m->second.progress[p.version()][req->node_id()];
    // New bytes of a running version are news for watchers (wbctl watch shows progress); a beat
    // that only renews the lease is not (lease_left_ms is left to the safety net).
    if (done != p.bytes_done()) StatusChangedLocked();
    done = p.bytes_done();
  }
  resp->set_lease_ms(absl::ToInt64Milliseconds(it->second.lease));
  return grpc::Status::OK;
}

grpc::Status Coordinator::CreateModel(grpc::ServerContext*, const pb::CreateModelRequest* req,
                                      pb::CreateModelResponse* resp) {
  absl::MutexLock l(&mu_);
  bool created = false;
  absl::Status s = CreateModelLocked(req->model(), &created);
  if (!s.ok()) return ToGrpcStatus(s);
  resp->set_created(created);
  InventoryToProto(models_.at(req->model().model_id()).inventory, resp->mutable_tensors());
  return grpc::Status::OK;
}

grpc::Status Coordinator::JoinWorker(grpc::ServerContext*, const pb::JoinWorkerRequest* req,
                                     pb::JoinWorkerResponse* resp) {
  absl::MutexLock l(&mu_);
  if (req->worker_id().empty()) return ToGrpcStatus(absl::InvalidArgumentError("worker_id is empty"));
  if (!nodes_.count(req->node_id()) || !nodes_.at(req->node_id()).alive) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("node ", req->node_id(), " is not registered")));
  }
  if (req->has_model() && !models_.count(req->model_id())) {
    pb::ModelSpec spec = req->model();
    if (spec.model_id().empty()) spec.set_model_id(req->model_id());
    bool created = false;
    absl::Status s = CreateModelLocked(spec, &created);
    if (!s.ok()) return ToGrpcStatus(s);
  }
  auto m = GetModelLocked(req->model_id());
  if (!m.ok()) return ToGrpcStatus(m.status());
  Model& model = **m;
  if (model.workers.count(req->worker_id())) {
    DropWorkerLocked(model, req->worker_id(), absl::StrCat("worker ", req->worker_id(), " registered again"));
  }
  WorkerRec rec;
  rec.node = req->node_id();
  rec.role = FromProto(req->role());
  rec.gpu = req->gpu();
  if (req->rejoin()) {
    // A node re-submits what it holds (coordinator restart / lost lease): the committed version
    // bounds what may be published next, a rollout's applied version feeds the staleness bound.
    model.machine->RestoreCommitted(req->committed_version());
    rec.restored_applied = req->applied_version();
    Log(LogLevel::kInfo, "worker re-joined", {{"model", req->model_id()}, {"worker", req->worker_id()}, {"node", req->node_id()},
                                              {"committed", req->committed_version()}, {"applied", req->applied_version()}});
  }
  model.workers[req->worker_id()] = std::move(rec);
  StatusChangedLocked();
  InventoryToProto(model.inventory, resp->mutable_tensors());
  *resp->mutable_model() = model.spec;
  resp->set_mode(model.spec.mode() == pb::MODE_UNSPECIFIED ? pb::MODE_SYNC : model.spec.mode());
  return grpc::Status::OK;
}

grpc::Status Coordinator::SubmitLayout(grpc::ServerContext*, const pb::SubmitLayoutRequest* req,
                                       pb::SubmitLayoutResponse* resp) {
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  Model& m = **mm;
  auto w = m.workers.find(req->worker_id());
  if (w == m.workers.end()) {
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat("worker ", req->worker_id(), " has not joined model ", req->model_id())));
  }
  pb::ResolvedLayout resolved;
  *resolved.mutable_buffers() = req->buffers();
  planner::WorkerLayout layout;
  if (req->layout().has_pieces()) {
    *resolved.mutable_pieces() = req->layout().pieces().pieces();
    auto l2 = LayoutFromProto(resolved, m.inventory);
    if (!l2.ok()) return ToGrpcStatus(l2.status());
    layout = std::move(*l2);
  } else if (req->layout().has_preset()) {
    if (!m.config) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("worker ", req->worker_id(), ": preset layouts need a model created from hf_config_json")));
    }
    const pb::ParallelConfig& pc = req->layout().preset();
    auto l2 = planner::MakePresetLayout(*m.config, m.inventory, FromProto(pc), static_cast<int>(pc.rank()));
    if (!l2.ok()) {
      return ToGrpcStatus(Annotate(l2.status(), absl::StrCat("worker ", req->worker_id(), " preset ", pc.preset(), " rank ", pc.rank())));
    }
    layout = std::move(l2->layout);
    if (layout.buffers.size() != static_cast<size_t>(req->buffers_size())) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("preset needs ", layout.buffers.size(),
                                                                  " buffers, worker registered ", req->buffers_size())));
    }
    for (size_t i = 0; i < layout.buffers.size(); ++i) {
      if (layout.buffers[i].size_bytes > static_cast<int64_t>(req->buffers(i).size_bytes())) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("preset buffer ", i, " needs ", layout.buffers[i].size_bytes,
                                                                    " bytes, registered ", req->buffers(i).size_bytes())));
      }
      layout.buffers[i].size_bytes = static_cast<int64_t>(req->buffers(i).size_bytes());
    }
    resolved.clear_pieces();
    LayoutToProto(layout, m.inventory, req->buffers(), &resolved);
  } else {
    return ToGrpcStatus(absl::InvalidArgumentError("layout: pieces or preset required (index probes are resolved by the node)"));
  }
  absl::Status s = planner::ValidateLayout(m.inventory, layout, w->second.role, req->worker_id());
  if (!s.ok()) {
    Log(LogLevel::kWarning, "layout rejected", {{"model", req->model_id()}, {"worker", req->worker_id()}, {"error", s.message()}});
    return ToGrpcStatus(s);
  }
  // Valid: replace (a changed layout of a worker in flight aborts that version).
  if (w->second.has_layout) DropWorkerLocked(m, req->worker_id(), absl::StrCat("worker ", req->worker_id(), " changed its layout"));
  w = m.workers.find(req->worker_id());
  if (w == m.workers.end()) return ToGrpcStatus(absl::AbortedError("worker dropped concurrently"));
  w->second.has_layout = true;
  w->second.layout = std::move(layout);
  w->second.layout_proto = resolved;
  // A worker with CUDA buffers sits on their GPU as its node daemon numbers it (the node rewrites
  // BufferSpec.gpu; the worker's own `gpu` may use its CUDA_VISIBLE_DEVICES numbering): the plan's
  // topology (same-GPU colocation) then compares GPUs of one numbering.
  for (const pb::BufferSpec& b : w->second.layout_proto.buffers()) {
    if ((b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey) && b.gpu() >= 0) {
      w->second.gpu = b.gpu();
      break;
    }
  }
  *resp->mutable_layout() = std::move(resolved);
  m.plan_dirty = true;
  wake_ = true;
  StatusChangedLocked();
  return grpc::Status::OK;
}

void Coordinator::DropWorkerLocked(Model& m, const std::string& worker, const std::string& reason) {
  auto it = m.workers.find(worker);
  if (it == m.workers.end()) return;
  bool in_plan = false;
  for (const std::string& id : m.plan.worker_ids) in_plan |= id == worker;
  m.workers.erase(it);
  Log(LogLevel::kInfo, "worker dropped", {{"model", m.spec.model_id()}, {"worker", worker}, {"reason", reason}});
  if (in_plan) {
    m.plan_dirty = true;
    if (auto v = m.machine->InFlight()) {
      for (auto& [id, model] : models_) {
        if (&model == &m) AbortLocked(id, m, *v, reason);
      }
    }
  }
  wake_ = true;
  StatusChangedLocked();
}

void Coordinator::AbortLocked(const std::string& model_id, Model& m, uint64_t version, const std::string& reason) {
  const VersionRecord* rec = m.machine->Find(version);
  if (rec && (rec->state == VState::kCommitted || rec->state == VState::kAborted)) return;
  if (m.committing == version) return;  // commit already decided
  m.machine->Abort(version, reason, options_.clock->Now());
  for (auto& [w, rec] : m.workers) rec.paused = false;  // released with the error; they pause again
  Log(LogLevel::kWarning, "version aborted", {{"model", model_id}, {"version", version}, {"reason", reason}});
  std::vector<std::pair<std::string, std::shared_ptr<pb::NodeService::Stub>>> targets;
  for (const std::string& n : m.plan.nodes) {
    auto it = nodes_.find(n);
    if (it != nodes_.end() && it->second.alive && it->second.stub) targets.push_back({n, it->second.stub});
  }
  pending_rpcs_.push_back([targets, model_id, version, reason] {
    for (auto& [n, stub] : targets) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      pb::AbortVersionRequest req;
      req.set_model_id(model_id);
      req.set_version(version);
      req.set_reason(reason);
      pb::AbortVersionResponse resp;
      stub->AbortVersion(&ctx, req, &resp);  // best effort: a dead node has nothing to drop
    }
  });
  wake_ = true;
  StatusChangedLocked();
}

grpc::Status Coordinator::LeaveWorker(grpc::ServerContext*, const pb::LeaveWorkerRequest* req, pb::LeaveWorkerResponse*) {
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  DropWorkerLocked(**mm, req->worker_id(),
                   absl::StrCat("worker ", req->worker_id(), " left", req->reason().empty() ? "" : ": ", req->reason()));
  return grpc::Status::OK;
}

grpc::Status Coordinator::Publish(grpc::ServerContext*, const pb::CoordPublishRequest* req, pb::PublishResponse* resp) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = RequestDeadline(req->timeout_ms());
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  Model* m = *mm;
  const uint64_t v = req->version();
  if (cluster_draining_ && !m->machine->Find(v)) {
    return ToGrpcStatus(absl::UnavailableError(absl::StrCat("cluster is draining: version ", v, " refused")));
  }
  for (const std::string& n : m->plan.nodes) {
    auto it = nodes_.find(n);
    if (it != nodes_.end() && it->second.draining && !m->machine->Find(v)) {
      return ToGrpcStatus(absl::UnavailableError(absl::StrCat("node ", n, " is draining: version ", v, " refused")));
    }
  }
  // A trainer that joined (with its layout) before the model is (re-)planned - e.g. right after a
  // coordinator restart, while the nodes re-submit - waits for the plan instead of failing.
  const std::string worker = req->worker_id();
  auto planned = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto w = m->workers.find(worker);
    return stopping_ || w == m->workers.end() || !w->second.has_layout || m->machine->trainers().count(worker) > 0;
  };
  mu_.AwaitWithDeadline(absl::Condition(&planned), deadline);
  if (stopping_) return ToGrpcStatus(absl::UnavailableError("coordinator shutting down"));
  // Unknown here (or joined without its layout yet): after a coordinator restart or a lost lease
  // its node has not re-submitted it yet. NOT_FOUND, nothing recorded: the node sends the publish
  // again once it has re-joined (never FAILED_PRECONDITION, which would fail the trainer).
  if (auto w = m->workers.find(worker); w == m->workers.end() || !w->second.has_layout) {
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat("worker ", worker, " has not joined model ", req->model_id(),
                                                         " with a layout at this coordinator (node ", req->node_id(), " not re-joined yet?)")));
  }
  // Staleness bound (async): hold the trainer while a rollout is too far behind.
  auto admissible = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || m->machine->PublishAdmissible(v);
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&admissible), deadline)) {
    return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat("publish of version ", v, ": a rollout is more than ",
                                                                 m->machine->max_staleness(), " versions behind")));
  }
  if (stopping_) return ToGrpcStatus(absl::UnavailableError("coordinator shutting down"));
  absl::Status s = m->machine->RecordPublish(req->worker_id(), v);
  if (!s.ok()) return ToGrpcStatus(Annotate(s, absl::StrCat("publish by ", req->worker_id())));
  wake_ = true;
  StatusChangedLocked();
  if (m->machine->mode() == ModeKind::kSync) {
    // Sync: the trainer's live weights are the source, so it waits until the version is in.
    auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || m->machine->Outcome(v).has_value(); };
    if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
      return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat("version ", v, " not committed before the publish deadline")));
    }
    if (stopping_) return ToGrpcStatus(absl::UnavailableError("coordinator shutting down"));
    s = *m->machine->Outcome(v);
    if (!s.ok()) return ToGrpcStatus(s);
  }
  resp->set_version(v);
  resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return grpc::Status::OK;
}

grpc::Status Coordinator::ReportReady(grpc::ServerContext*, const pb::ReportReadyRequest* req, pb::ReportReadyResponse* resp) {
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  auto w = (*mm)->workers.find(req->worker_id());
  if (w == (*mm)->workers.end()) {
    // As in Publish: NOT_FOUND (nothing recorded) lets its node re-send after re-joining it.
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat("worker ", req->worker_id(), " has not joined model ", req->model_id(),
                                                         " at this coordinator (node ", req->node_id(), " not re-joined yet?)")));
  }
  if (w->second.role != planner::Role::kRollout) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("worker ", req->worker_id(), " is not a registered rollout worker")));
  }
  w->second.paused = true;
  (*mm)->machine->RecordReady(req->worker_id());
  resp->set_committed_version((*mm)->machine->committed());
  wake_ = true;
  StatusChangedLocked();
  return grpc::Status::OK;
}

grpc::Status Coordinator::ReportDone(grpc::ServerContext*, const pb::ReportDoneRequest* req, pb::ReportDoneResponse*) {
  if (!req->coordinator_instance().empty() && req->coordinator_instance() != instance_) {
    // An executor started by the previous coordinator process finished late: that version was
    // aborted on the node when it re-registered, and this coordinator may run the same version
    // number again. Its outcome must not touch this coordinator's versions.
    Log(LogLevel::kInfo, "stale ReportDone ignored",
        {{"node", req->node_id()}, {"model", req->model_id()}, {"version", req->version()},
         {"from_instance", req->coordinator_instance()}, {"instance", instance_}});
    return grpc::Status::OK;
  }
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  Model& m = **mm;
  if (!req->ok()) {
    AbortLocked(req->model_id(), m, req->version(), absl::StrCat("node ", req->node_id(), ": ", req->error()));
    return grpc::Status::OK;
  }
  m.progress[req->version()][req->node_id()] = req->bytes();
  StatusChangedLocked();
  if (m.machine->NodeDone(req->node_id(), req->version())) {
    m.committing = req->version();
    wake_ = true;
  }
  return grpc::Status::OK;
}

grpc::Status Coordinator::ReportApplied(grpc::ServerContext*, const pb::ReportAppliedRequest* req, pb::ReportAppliedResponse*) {
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  (*mm)->machine->RecordApplied(req->worker_id(), req->version());
  StatusChangedLocked();
  return grpc::Status::OK;
}

grpc::Status Coordinator::WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest* req, pb::WaitVersionResponse* resp) {
  const absl::Time deadline = RequestDeadline(req->timeout_ms());
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  Model* m = *mm;
  const uint64_t v = std::max<uint64_t>(req->version(), 1);
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || m->machine->Outcome(v).has_value(); };
  if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat("version ", v, " of model ", req->model_id(),
                                                                 " not committed in time (committed: ", m->machine->committed(), ")")));
  }
  if (stopping_) return ToGrpcStatus(absl::UnavailableError("coordinator shutting down"));
  absl::Status s = *m->machine->Outcome(v);
  if (!s.ok()) return ToGrpcStatus(s);
  resp->set_committed_version(m->machine->committed());
  return grpc::Status::OK;
}

void Coordinator::FillStatusLocked(pb::StatusResponse* out) {
  const absl::Time now = options_.clock->Now();
  for (auto& [id, n] : nodes_) {
    pb::NodeStatus* ns = out->add_nodes();
    ns->set_node_id(id);
    ns->set_address(n.address);
    ns->set_data_address(n.data_address);
    ns->set_alive(n.alive);
    ns->set_draining(n.draining);
    ns->set_lease_left_ms(std::max<int64_t>(0, absl::ToInt64Milliseconds(n.lease_expiry - now)));
    for (const auto& [name, instance] : n.transport_instances) ns->add_transports(name);
    for (const std::string& nic : n.data_nics) ns->add_data_nics(nic);
    uint32_t count = 0;
    bool busy = false;
    for (auto& [mid, m] : models_) {
      for (auto& [w, rec] : m.workers) count += rec.node == id;
      busy |= m.machine->InFlightInvolves(id);
    }
    ns->set_num_workers(count);
    ns->set_drained(n.draining && !busy);
  }
  for (auto& [mid, m] : models_) {
    pb::ModelStatus* ms = out->add_models();
    ms->set_model_id(mid);
    ms->set_mode(m.spec.mode());
    ms->set_strategy(m.spec.strategy());
    ms->set_committed_version(m.machine->committed());
    ms->set_plan_fingerprint(m.plan.plan.fingerprint);
    ms->set_last_transfer_seconds(m.last_seconds);
    ms->set_last_transfer_bytes(m.last_bytes);
    ms->set_last_transfer_gbps(m.last_seconds > 0 ? m.last_bytes / m.last_seconds / 1e9 : 0);
    ms->set_num_trainer_workers(m.spec.num_trainer_workers());
    ms->set_num_rollout_workers(m.spec.num_rollout_workers());
    ms->set_max_staleness(m.spec.max_staleness());
    ms->set_draining(cluster_draining_ || m.machine->draining());
    uint32_t nt = 0, nr = 0;
    for (auto& [w, rec] : m.workers) {
      if (!rec.has_layout) continue;
      (rec.role == planner::Role::kTrainer ? nt : nr) += 1;
    }
    ms->set_registered_trainers(nt);
    ms->set_registered_rollouts(nr);
    StatsToProto(m.plan.plan.stats, static_cast<int>(m.plan.plan.buckets.size()), ms->mutable_plan_stats());
    for (auto& [w, rec] : m.workers) {
      pb::WorkerStatus* ws = out->add_workers();
      ws->set_worker_id(w);
      ws->set_model_id(mid);
      ws->set_role(ToProto(rec.role));
      ws->set_node_id(rec.node);
      ws->set_applied_version(m.machine->Applied(w));
      ws->set_has_layout(rec.has_layout);
      ws->set_paused(m.machine->IsPaused(w));
    }
    for (auto& [v, rec] : m.machine->records()) {
      pb::VersionStatus* vs = out->add_versions();
      vs->set_model_id(mid);
      vs->set_version(v);
      vs->set_state(VStateName(rec.state));
      vs->set_bytes_total(rec.bytes_total);
      uint64_t done = 0;
      auto p = m.progress.find(v);
      if (p != m.progress.end()) for (auto& [n, b] : p->second) done += b;
      vs->set_bytes_done(rec.state == VState::kCommitted ? rec.bytes_total : std::min(done, rec.bytes_total));
      if (rec.started != absl::InfinitePast()) {
        absl::Time end = rec.finished != absl::InfinitePast() ? rec.finished : now;
        vs->set_seconds(absl::ToDoubleSeconds(end - rec.started));
      }
      vs->set_error(rec.error);
      vs->set_num_ops(static_cast<uint32_t>(m.plan.plan.stats.num_ops));
    }
  }
}

grpc::Status Coordinator::ClusterStatus(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse* resp) {
  absl::MutexLock l(&mu_);
  resp->set_role("coordinator");
  FillStatusLocked(resp);
  return grpc::Status::OK;
}

bool Coordinator::AwaitStatusWatchersAtMost(int n, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto few = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return status_watchers_ <= n; };
  return mu_.AwaitWithDeadline(absl::Condition(&few), deadline);
}

grpc::Status Coordinator::WatchStatus(grpc::ServerContext* ctx, const pb::WatchStatusRequest* req,
                                      grpc::ServerWriter<pb::StatusResponse>* writer) {
  const absl::Duration timeout =
      req->timeout_ms() > 0 ? std::min(absl::Milliseconds(req->timeout_ms()), kWatchMaxTimeout) : kWatchDefaultTimeout;
  const absl::Time deadline = absl::Now() + timeout;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return ToGrpcStatus(absl::UnavailableError("coordinator shutting down"));
    if (status_watchers_ >= options_.max_status_watchers) {
      return ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "WatchStatus: ", status_watchers_, " status watchers open already (limit max_status_watchers = ",
          options_.max_status_watchers, "); use ClusterStatus or close a watcher")));
    }
    ++status_watchers_;
  }
  // The slot is freed however the stream ends (deadline, cancelled client, shutdown, write error).
  struct Slot {
    Coordinator* c;
    ~Slot() {
      absl::MutexLock l(&c->mu_);
      --c->status_watchers_;
    }
  } slot{this};

  uint64_t seen = 0;
  bool first = true;
  std::string last_sent;
  absl::Time next_rebuild = absl::InfinitePast();
  while (true) {
    pb::StatusResponse status;
    bool built = false;
    {
      absl::MutexLock l(&mu_);
      if (!first) {
        // Wake on a change, on Shutdown, for the safety-net rebuild, at the stream's deadline, and
        // every kWatchCancelCheck to notice a client that went away (gRPC's sync API has no
        // cancellation callback that could signal mu_).
        auto changed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || status_generation_ != seen; };
        const absl::Time wake = std::min({deadline, next_rebuild, absl::Now() + kWatchCancelCheck});
        mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
      }
      if (stopping_) return ToGrpcStatus(absl::UnavailableError("coordinator shutting down: status stream closed"));
      if (first || status_generation_ != seen || absl::Now() >= next_rebuild) {
        seen = status_generation_;
        status.set_role("coordinator");
        FillStatusLocked(&status);
        built = true;
      }
    }
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "status watcher went away");
    if (built) {
      next_rebuild = absl::Now() + options_.status_resend;
      std::string bytes;
      status.SerializeToString(&bytes);
      // Deterministic enough for a change check: same fields in the same order from one process.
      if (first || bytes != last_sent) {
        if (!writer->Write(status)) return grpc::Status(grpc::StatusCode::CANCELLED, "status watcher went away (write failed)");
        last_sent = std::move(bytes);
      }
      first = false;
    }
    if (absl::Now() >= deadline) return grpc::Status::OK;
  }
}

grpc::Status Coordinator::Drain(grpc::ServerContext*, const pb::DrainRequest* req, pb::DrainResponse* resp) {
  const absl::Time deadline = RequestDeadline(req->timeout_ms());
  absl::MutexLock l(&mu_);
  if (req->node_id().empty()) {
    cluster_draining_ = true;
    for (auto& [id, m] : models_) m.machine->set_draining(true);
  } else {
    auto it = nodes_.find(req->node_id());
    if (it == nodes_.end()) return ToGrpcStatus(absl::NotFoundError(absl::StrCat("unknown node ", req->node_id())));
    it->second.draining = true;
  }
  StatusChangedLocked();
  // Drained when nothing the drain covers is queued or transferring.
  auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (stopping_) return true;
    for (auto& [id, m] : models_) {
      if (req->node_id().empty() ? !m.machine->Idle() : m.machine->InFlightInvolves(req->node_id())) return false;
    }
    return true;
  };
  bool drained = mu_.AwaitWithDeadline(absl::Condition(&idle), deadline) && !stopping_;
  uint32_t in_flight = 0;
  for (auto& [id, m] : models_) in_flight += m.machine->InFlight().has_value();
  resp->set_drained(drained);
  resp->set_in_flight_versions(in_flight);
  return grpc::Status::OK;
}

grpc::Status Coordinator::Plan(grpc::ServerContext*, const pb::PlanRequest* req, pb::PlanResponse* resp) {
  absl::MutexLock l(&mu_);
  auto mm = GetModelLocked(req->model_id());
  if (!mm.ok()) return ToGrpcStatus(mm.status());
  Model& m = **mm;
  if (m.plan.epoch == 0) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("model ", req->model_id(), " has no plan yet",
                                                                   m.plan_error.empty() ? "" : ": ", m.plan_error)));
  }
  resp->set_fingerprint(m.plan.plan.fingerprint);
  resp->set_strategy(ToProto(m.plan.plan.strategy));
  StatsToProto(m.plan.plan.stats, static_cast<int>(m.plan.plan.buckets.size()), resp->mutable_stats());
  resp->set_total_bytes(m.plan.total_bytes);
  return grpc::Status::OK;
}

absl::StatusOr<std::map<std::string, pb::PlanSlice>> Coordinator::MakeSlicesLocked(const std::string& model_id, Model& m) {
  // Problem: trainers then rollouts (ids sorted: std::map order), only workers with a layout.
  // Node index = order of the node ids; gpu = the worker's gpu, or (host workers, gpu < 0) a slot
  // of its own above every real gpu so host workers never share a link budget.
  planner::Problem problem;
  problem.inventory = m.inventory;
  problem.topology = options_.topology;
  problem.staging_budget_bytes = options_.bucket_bytes;
  std::vector<std::string> ids;
  std::map<std::string, int32_t> node_index;
  std::map<std::string, int32_t> host_slots;  // node -> next host slot
  for (auto& [id, w] : m.workers) {
    if (w.has_layout) node_index.emplace(w.node, 0);
  }
  int32_t next_node = 0;
  for (auto& [n, idx] : node_index) idx = next_node++;
  std::set<std::string> trainers, rollouts;
  for (planner::Role role : {planner::Role::kTrainer, planner::Role::kRollout}) {
    for (auto& [id, w] : m.workers) {
      if (!w.has_layout || w.role != role) continue;
      planner::Worker pw;
      pw.id = id;
      pw.role = role;
      pw.node = node_index.at(w.node);
      pw.gpu = w.gpu >= 0 ? w.gpu : 1024 + host_slots[w.node]++;
      pw.layout = w.layout;
      problem.workers.push_back(std::move(pw));
      ids.push_back(id);
      (role == planner::Role::kTrainer ? trainers : rollouts).insert(id);
    }
  }
  // Cache key: everything the planner sees (layouts, placement, strategy, topology).
  std::string key_src = absl::StrCat(model_id, "|", static_cast<int>(m.spec.strategy()), "|", options_.topology.intra_node_GBps, "/",
                                     options_.topology.nic_GBps_per_gpu, "/", options_.topology.colocated, "/", options_.bucket_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    const WorkerRec& w = m.workers.at(ids[i]);
    absl::StrAppend(&key_src, "|", ids[i], "@", problem.workers[i].node, ":", problem.workers[i].gpu, ":", w.layout_proto.SerializeAsString());
  }
  std::string key = absl::StrCat(absl::Hex(XXH3_64bits(key_src.data(), key_src.size())));
  planner::Plan plan;
  auto cached = plan_cache_.find(key);
  if (cached != plan_cache_.end()) {
    plan = cached->second;
  } else {
    std::vector<const planner::Worker*> sources, destinations;
    for (const planner::Worker& w : problem.workers) (w.role == planner::Role::kTrainer ? sources : destinations).push_back(&w);
    RETURN_IF_ERROR_WITH(planner::ValidateCoverage(problem.inventory, sources, destinations), absl::StrCat("model ", model_id));
    absl::Time t0 = absl::Now();
    ASSIGN_OR_RETURN(plan, options_.make_plan(problem, FromProto(m.spec.strategy())));
    plan.stats.plan_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (plan_cache_.size() > 64) plan_cache_.clear();
    plan_cache_[key] = plan;
  }
  m.plan.epoch = next_epoch_++;
  m.plan.plan = plan;
  m.plan.worker_ids = ids;
  m.plan.nodes.clear();
  m.plan.total_bytes = 0;
  m.plan.installed = false;
  m.machine->SetTrainers(trainers);
  m.machine->SetRollouts(rollouts);
  for (const std::string& r : rollouts) {
    const WorkerRec& rec = m.workers.at(r);
    if (rec.paused) m.machine->RecordReady(r);
    if (rec.restored_applied > 0) m.machine->RecordApplied(r, rec.restored_applied);
  }
  for (auto& [n, idx] : node_index) m.plan.nodes.insert(n);

  // rank0_broadcast: place every gathered box in the rank-0 node's gather staging (row-major,
  // 64-byte aligned), and point each read of staged data at the entry that holds its box.
  struct Staged { int32_t tensor; planner::Box box; uint64_t offset; };
  std::map<std::string, Staged> staged;
  std::map<int32_t, std::vector<const Staged*>> staged_by_tensor;
  uint64_t gather_bytes = 0;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      if (op.dst_piece >= 0) continue;
      auto [it, fresh] = staged.try_emplace(BoxKey(op.tensor, op.box), Staged{op.tensor, op.box, gather_bytes});
      if (fresh) {
        gather_bytes += (static_cast<uint64_t>(op.bytes) + 63) / 64 * 64;
        staged_by_tensor[op.tensor].push_back(&it->second);
      }
    }
  }
  auto find_staged = [&](const planner::TransferOp& op) -> const Staged* {
    auto it = staged.find(BoxKey(op.tensor, op.box));
    if (it != staged.end()) return &it->second;
    for (const Staged* st : staged_by_tensor[op.tensor]) {
      if (planner::BoxContains(st->box, op.box)) return st;
    }
    return nullptr;
  };

  // Which workers each node must know the layout of: its own and every peer of one of its ops.
  std::map<std::string, std::set<int32_t>> known;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      const std::string& sn = m.workers.at(ids[op.src_worker]).node;
      const std::string& dn = m.workers.at(ids[op.dst_worker]).node;
      for (const std::string* n : {&sn, &dn}) {
        known[*n].insert(op.src_worker);
        known[*n].insert(op.dst_worker);
      }
    }
  }
  std::map<std::string, pb::PlanSlice> slices;
  for (const std::string& n : m.plan.nodes) {
    pb::PlanSlice& s = slices[n];
    s.set_model_id(model_id);
    s.set_plan_epoch(m.plan.epoch);
    s.set_fingerprint(plan.fingerprint);
    s.set_strategy(ToProto(plan.strategy));
    s.set_mode(m.spec.mode() == pb::MODE_UNSPECIFIED ? pb::MODE_SYNC : m.spec.mode());
    InventoryToProto(m.inventory, s.mutable_tensors());
    s.set_num_buckets(static_cast<uint32_t>(plan.buckets.size()));
    StatsToProto(plan.stats, static_cast<int>(plan.buckets.size()), s.mutable_stats());
    s.set_gather_staging_bytes(gather_bytes);
    for (size_t i = 0; i < ids.size(); ++i) {
      const WorkerRec& w = m.workers.at(ids[i]);
      pb::PlanWorker* pw = s.add_workers();
      pw->set_worker_id(ids[i]);
      pw->set_role(ToProto(w.role));
      pw->set_node_id(w.node);
      pw->set_gpu(w.gpu);
      auto node = nodes_.find(w.node);
      if (node != nodes_.end()) {
        pw->set_data_address(node->second.data_address);
        for (auto& [k, v] : node->second.transport_instances) (*pw->mutable_transport_instances())[k] = v;
      }
      if (w.node == n || known[n].count(static_cast<int32_t>(i))) *pw->mutable_layout() = w.layout_proto;
    }
  }
  // Cross-node ops that move GPU to GPU on nccl (TransferOp.nccl): daemon/nccl_route.h.
  std::map<std::string, std::vector<int>> lanes;  // node -> its nccl lane devices (ascending)
  for (const auto& [id, node] : nodes_) {
    std::vector<std::string> names;
    for (const auto& [k, v] : node.transport_instances) names.push_back(k);
    lanes[id] = NcclLaneDevices(names);
  }
  auto has_nccl = [&](const std::string& node) {
    auto it = lanes.find(node);
    return it != lanes.end() && !it->second.empty();
  };
  // The CUDA buffer a piece lives in, or null (host memory, or the rank-0 gather staging).
  auto cuda_buffer = [&](int32_t worker, int32_t piece) -> const pb::BufferSpec* {
    if (piece < 0) return nullptr;
    const WorkerRec& w = m.workers.at(ids[worker]);
    if (piece >= static_cast<int32_t>(w.layout.pieces.size())) return nullptr;
    const int32_t buffer = w.layout.pieces[piece].buffer;
    if (buffer < 0 || buffer >= w.layout_proto.buffers_size()) return nullptr;
    const pb::BufferSpec& b = w.layout_proto.buffers(buffer);
    const bool cuda = b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey;
    return cuda ? &b : nullptr;
  };
  auto cuda_piece = [&](int32_t worker, int32_t piece) { return cuda_buffer(worker, piece) != nullptr; };
  std::vector<RouteOpFacts> facts;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      const WorkerRec& sw = m.workers.at(ids[op.src_worker]);
      const WorkerRec& dw = m.workers.at(ids[op.dst_worker]);
      RouteOpFacts f;
      f.src_worker = op.src_worker;
      f.dst_worker = op.dst_worker;
      f.cross_node = sw.node != dw.node;
      f.src_is_trainer = sw.role == planner::Role::kTrainer;
      f.dst_is_rollout = dw.role == planner::Role::kRollout;
      f.src_cuda = cuda_piece(op.src_worker, op.src_piece);
      f.dst_cuda = cuda_piece(op.dst_worker, op.dst_piece);
      f.src_node_nccl = has_nccl(sw.node);
      f.dst_node_nccl = has_nccl(dw.node);
      f.dst_quantized = planner::HasQuantizedPieces(dw.layout);
      facts.push_back(f);
    }
  }
  const std::vector<bool> over_nccl = RouteOverNccl(facts);
  size_t op_i = 0;
  uint32_t index = 0;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (const planner::TransferOp& op : plan.buckets[b].ops) {
      m.plan.total_bytes += static_cast<uint64_t>(op.bytes);
      pb::TransferOp pop;
      pop.set_index(index++);
      pop.set_bucket(static_cast<uint32_t>(b));
      pop.set_src_worker(static_cast<uint32_t>(op.src_worker));
      pop.set_dst_worker(static_cast<uint32_t>(op.dst_worker));
      pop.set_src_piece(op.src_piece);
      pop.set_dst_piece(op.dst_piece);
      pop.set_tensor(op.tensor);
      ToProto(op.box, pop.mutable_box());
      pop.set_bytes(static_cast<uint64_t>(op.bytes));
      pop.set_route(ToProto(op.route));
      if (over_nccl[op_i++]) {
        // Both ends' lanes: the GPU of each side's buffer when it has a lane (daemon/nccl_route.h).
        pop.set_nccl(true);
        pop.set_nccl_src_device(NcclLaneFor(lanes[m.workers.at(ids[op.src_worker]).node], cuda_buffer(op.src_worker, op.src_piece)->gpu()));
        pop.set_nccl_dst_device(NcclLaneFor(lanes[m.workers.at(ids[op.dst_worker]).node], cuda_buffer(op.dst_worker, op.dst_piece)->gpu()));
      }
      if (op.dst_piece < 0 || op.src_piece < 0) {
        const Staged* st = find_staged(op);
        if (st == nullptr) {
          return absl::InternalError(absl::StrCat("plan op ", pop.index(), " reads staged tensor ", m.inventory.tensors[op.tensor].name, " box ",
                                                  planner::BoxToString(op.box), " that no gather op stages"));
        }
        pop.set_staging_offset(st->offset);
        ToProto(st->box, pop.mutable_staging_box());
      }
      const std::string& src_node = m.workers.at(ids[op.src_worker]).node;
      const std::string& dst_node = m.workers.at(ids[op.dst_worker]).node;
      *slices[src_node].add_ops() = pop;
      if (dst_node != src_node) *slices[dst_node].add_ops() = pop;
    }
  }
  for (auto& [n, s] : slices) s.set_total_bytes(m.plan.total_bytes);
  Log(LogLevel::kInfo, "plan made", {{"model", model_id}, {"epoch", m.plan.epoch}, {"strategy", planner::StrategyName(plan.strategy)},
                                     {"fingerprint", plan.fingerprint}, {"ops", plan.stats.num_ops}, {"buckets", plan.buckets.size()},
                                     {"bytes", m.plan.total_bytes}, {"bytes_inter_node", plan.stats.bytes_inter_node},
                                     {"plan_ms", plan.stats.plan_ms}, {"cached", cached != plan_cache_.end() ? "yes" : "no"}});
  return slices;
}

std::vector<std::function<void()>> Coordinator::CollectWorkLocked() {
  std::vector<std::function<void()>> work;
  const absl::Time now = options_.clock->Now();
  // Leases. If the driver itself did not run for a while (an overloaded coordinator), that time
  // is not the nodes' fault: extend every lease by the gap before judging.
  if (last_sweep_ != absl::InfinitePast() && now - last_sweep_ > options_.lease / 4) {
    const absl::Duration gap = now - last_sweep_;
    for (auto& [nid, n] : nodes_) n.lease_expiry += gap;
  }
  last_sweep_ = now;
  for (auto& [nid, n] : nodes_) {
    if (!n.alive || now < n.lease_expiry) continue;
    if (!options_.local_node.empty() && nid == options_.local_node) {
      Log(LogLevel::kWarning, "local node heartbeat late (same process: lease kept)", {{"node", nid}, {"late_s", absl::ToDoubleSeconds(now - n.lease_expiry)}});
      n.lease_expiry = now + n.lease;
      continue;
    }
    n.alive = false;
    StatusChangedLocked();
    std::string reason = absl::StrCat("node ", nid, " lost its lease");
    Log(LogLevel::kWarning, "node lost", {{"node", nid}, {"reason", reason}});
    for (auto& [mid, m] : models_) {
      if (m.machine->InFlightInvolves(nid)) AbortLocked(mid, m, *m.machine->InFlight(), reason);
      std::vector<std::string> gone;
      for (auto& [w, rec] : m.workers) if (rec.node == nid) gone.push_back(w);
      for (const std::string& w : gone) DropWorkerLocked(m, w, reason);
    }
  }
  for (auto& [mid, m] : models_) {
    if (auto v = m.machine->TimedOut(now); v && m.committing != *v) {
      AbortLocked(mid, m, *v, absl::StrCat("transfer timed out after ", absl::FormatDuration(options_.transfer_timeout)));
    }
    Model* mp = &m;
    const std::string model_id = mid;
    // Commit: every node reported done, so the decision is made. Send CommitVersion everywhere
    // (sync: nodes copy staging into the paused rollouts' live buffers before answering), then
    // mark committed. A node whose CommitVersion fails stays owed the commit (pending_commits_).
    if (m.committing != 0) {
      const uint64_t v = m.committing;
      std::vector<std::tuple<std::string, uint64_t, std::shared_ptr<pb::NodeService::Stub>>> stubs;
      for (const std::string& n : m.plan.nodes) {
        auto it = nodes_.find(n);
        if (it != nodes_.end() && it->second.stub) stubs.push_back({n, it->second.incarnation, it->second.stub});
      }
      const absl::Duration commit_timeout = options_.transfer_timeout;
      work.push_back([this, mp, model_id, v, stubs, commit_timeout] {
        std::vector<PendingCommit> missed;
        // Every node at once: a sync commit copies staging into the rollouts' live weights before
        // it answers, so one node after another would add up those copies.
        std::vector<absl::Status> acks(stubs.size());
        ForEachConcurrently(stubs.size(), [&](size_t i) {
          grpc::ClientContext ctx;
          // Sync commits copy staging into live weights before answering: as long as a transfer may take.
          ctx.set_deadline(absl::ToChronoTime(absl::Now() + std::max(absl::Seconds(5), commit_timeout)));
          pb::CommitVersionRequest req;
          req.set_model_id(model_id);
          req.set_version(v);
          pb::CommitVersionResponse resp;
          acks[i] = FromGrpcStatus(std::get<2>(stubs[i])->CommitVersion(&ctx, req, &resp));
        });
        for (size_t i = 0; i < stubs.size(); ++i) {
          const auto& [node, incarnation, stub] = stubs[i];
          const absl::Status& st = acks[i];
          if (!st.ok()) {
            Log(LogLevel::kWarning, "commit not acknowledged", {{"model", model_id}, {"version", v}, {"node", node}, {"error", st.message()}});
            if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st)) missed.push_back({node, model_id, v, incarnation, absl::Now()});
          }
        }
        absl::MutexLock l(&mu_);
        const absl::Time t = options_.clock->Now();
        mp->machine->Commit(v, t);
        for (auto& [w, rec] : mp->workers) rec.paused = false;  // the commit resumed them
        if (const VersionRecord* rec = mp->machine->Find(v)) {
          mp->last_seconds = absl::ToDoubleSeconds(rec->finished - rec->started);
          mp->last_bytes = rec->bytes_total;
        }
        Log(LogLevel::kInfo, "version committed", {{"model", model_id}, {"version", v}, {"bytes", mp->last_bytes},
                                                    {"seconds", mp->last_seconds}, {"unacked_nodes", missed.size()}});
        for (PendingCommit& p : missed) {
          p.next_try = absl::Now() + options_.commit_retry;
          pending_commits_.push_back(std::move(p));
        }
        mp->progress.erase(v);
        mp->machine->Prune(64);
        mp->committing = 0;
        wake_ = true;
        StatusChangedLocked();
      });
      continue;
    }
    if (m.machine->InFlight()) continue;
    // (Re-)plan: trainers complete; rollouts complete the first time, any non-empty set later.
    if (m.plan_dirty) {
      uint32_t nt = 0, nr = 0;
      for (auto& [w, rec] : m.workers) {
        if (!rec.has_layout) continue;
        (rec.role == planner::Role::kTrainer ? nt : nr) += 1;
      }
      bool ready = nt >= m.spec.num_trainer_workers() && nr > 0 && (m.planned_once || nr >= m.spec.num_rollout_workers());
      if (!ready) continue;
      auto slices = MakeSlicesLocked(mid, m);
      m.plan_dirty = false;
      StatusChangedLocked();  // a new plan (fingerprint, stats) or the planner's error
      if (!slices.ok()) {
        m.plan_error = std::string(slices.status().message());
        continue;
      }
      m.plan_error.clear();
      m.planned_once = true;
      std::vector<std::pair<std::shared_ptr<pb::NodeService::Stub>, pb::PlanSlice>> installs;
      for (auto& [n, s] : *slices) installs.push_back({nodes_.at(n).stub, std::move(s)});
      uint64_t epoch = m.plan.epoch;
      work.push_back([this, mp, installs, epoch] {
        absl::Status status;
        for (auto& [stub, slice] : installs) {
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
          pb::InstallPlanRequest req;
          *req.mutable_slice() = slice;
          pb::InstallPlanResponse resp;
          absl::Status s = FromGrpcStatus(stub->InstallPlan(&ctx, req, &resp));
          if (!s.ok()) status = s;
        }
        absl::MutexLock l(&mu_);
        if (mp->plan.epoch != epoch) return;
        if (!status.ok()) Log(LogLevel::kWarning, "plan install failed", {{"model", mp->spec.model_id()}, {"epoch", epoch}, {"error", status.message()}});
        if (status.ok()) {
          mp->plan.installed = true;
        } else {
          mp->plan_error = std::string(status.message());
          mp->plan_dirty = true;  // retry on the next pass
        }
        wake_ = true;
      });
      continue;
    }
    if (!m.plan.installed) continue;
    auto next = m.machine->NextToStart();
    if (!next) continue;
    uint64_t v = *next;
    m.machine->Start(v, m.plan.nodes, now, options_.transfer_timeout, m.plan.total_bytes);
    StatusChangedLocked();
    Log(LogLevel::kInfo, "version started", {{"model", mid}, {"version", v}, {"epoch", m.plan.epoch}, {"nodes", m.plan.nodes.size()},
                                             {"bytes", m.plan.total_bytes}});
    std::vector<std::pair<std::string, std::shared_ptr<pb::NodeService::Stub>>> stubs;
    for (const std::string& n : m.plan.nodes) stubs.push_back({n, nodes_.at(n).stub});
    uint64_t epoch = m.plan.epoch;
    int64_t timeout_ms = absl::ToInt64Milliseconds(options_.transfer_timeout);
    work.push_back([this, mp, model_id, v, epoch, stubs, timeout_ms] {
      // Every node at once (each answers at once; one after another the last node would start a
      // round trip per node later, and the first nodes' executors would wait for it).
      std::vector<absl::Status> started(stubs.size());
      ForEachConcurrently(stubs.size(), [&](size_t i) {
        grpc::ClientContext ctx;
        // The node answers at once (the executor runs on its own thread); the deadline is the
        // transfer timeout anyway so that a slow, loaded node is not declared unable to start.
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 5000)));
        pb::ExecuteVersionRequest req;
        req.set_model_id(model_id);
        req.set_version(v);
        req.set_plan_epoch(epoch);
        req.set_timeout_ms(timeout_ms);
        req.set_coordinator_instance(instance_);
        pb::ExecuteVersionResponse resp;
        started[i] = FromGrpcStatus(stubs[i].second->ExecuteVersion(&ctx, req, &resp));
      });
      for (size_t i = 0; i < stubs.size(); ++i) {
        if (started[i].ok()) continue;
        absl::MutexLock l(&mu_);
        AbortLocked(model_id, *mp, v, absl::StrCat("node ", stubs[i].first, " could not start: ", started[i].message()));
        return;
      }
    });
  }
  // Owed commits: retry while the node keeps the incarnation that executed the version.
  for (auto it = pending_commits_.begin(); it != pending_commits_.end();) {
    auto n = nodes_.find(it->node);
    if (n == nodes_.end() || !n->second.alive || n->second.incarnation != it->incarnation) {
      Log(LogLevel::kWarning, "owed commit dropped: node lost or restarted", {{"model", it->model_id}, {"version", it->version}, {"node", it->node}});
      it = pending_commits_.erase(it);
      continue;
    }
    if (absl::Now() >= it->next_try) {
      it->next_try = absl::Now() + options_.commit_retry;
      PendingCommit p = *it;
      std::shared_ptr<pb::NodeService::Stub> stub = n->second.stub;
      work.push_back([this, p, stub] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        pb::CommitVersionRequest req;
        req.set_model_id(p.model_id);
        req.set_version(p.version);
        pb::CommitVersionResponse resp;
        absl::Status st = FromGrpcStatus(stub->CommitVersion(&ctx, req, &resp));
        if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st)) return;  // try again later
        Log(st.ok() ? LogLevel::kInfo : LogLevel::kWarning, "owed commit delivered",
            {{"model", p.model_id}, {"version", p.version}, {"node", p.node}, {"result", st.ok() ? "committed" : st.message()}});
        absl::MutexLock l(&mu_);
        pending_commits_.erase(std::remove_if(pending_commits_.begin(), pending_commits_.end(),
                                              [&](const PendingCommit& q) {
                                                return q.node == p.node && q.model_id == p.model_id && q.version == p.version;
                                              }),
                               pending_commits_.end());
      });
    }
    ++it;
  }
  for (auto& f : pending_rpcs_) work.push_back(std::move(f));
  pending_rpcs_.clear();
  return work;
}

void Coordinator::DriverLoop() {
  while (true) {
    std::vector<std::function<void()>> work;
    {
      absl::MutexLock l(&mu_);
      auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return wake_ || stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&woken), options_.tick);
      if (stopping_) return;
      wake_ = false;
      work = CollectWorkLocked();
    }
    for (auto& f : work) f();
  }
}

}  // namespace wb::daemon
