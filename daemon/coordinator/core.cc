// CoordinatorCore: the handlers over the node table (node_table.h) and the model registry
// (model_registry.h), and the waiting ones (Publish, WaitVersion, Drain). The driver is in
// driver.cc, status and WatchStatus in status.cc, aborts (and the pauses they keep) in aborts.cc.
#include "daemon/coordinator/core.h"

#include <algorithm>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/convert.h"
#include "daemon/coordinator/checks.h"
#include "daemon/coordinator/grpc_node_client.h"
#include "daemon/log.h"
#include "planner/planner.h"
#include "base/status_macros.h"

namespace wb::daemon {
namespace {

std::string NewInstanceId() {
  std::random_device rd;
  return absl::StrCat(absl::Hex(rd(), absl::kZeroPad8), absl::Hex(rd(), absl::kZeroPad8), "-",
                      absl::ToUnixMillis(absl::Now()));
}

}  // namespace

CoordinatorCore::CoordinatorCore(CoordinatorOptions options)
    : options_(std::move(options)),
      nodes_(NodeTable::Options{options_.lease, options_.local_node, options_.max_heartbeat_progress}),
      models_(ModelRegistry::Options{options_.max_models, options_.max_name_bytes, options_.max_reply_bytes,
                                     options_.max_inventory_bytes_total, options_.model_idle_grace, options_.clock}),
      // No default make_plan: PlanCache then plans with MakePlanWithOptions and polls the
      // cancellation of the planner thread's job (a newer plan of the model queued, shutdown) and
      // the plan deadline.
      plan_cache_(PlanCache::Options{.plan_deadline = options_.plan_deadline, .cancelled = &PlanQueue::CurrentJobCancelled}),
      instance_(NewInstanceId()),
      rejoin_window_end_(options_.clock->Now() + options_.rejoin_window.value_or(options_.lease)),
      // After each call: the lane's model or node may have its next step waiting (a commit or an
      // owed try is collected only while its lane is idle).
      lanes_(RpcLanes::Options{.threads = 16, .on_idle = [this] {
                                 absl::MutexLock l(&mu_);
                                 wake_ = true;
                               }}) {
  if (!options_.make_node_client) {
    auto make_channel = options_.make_channel;
    // Stamped with this process's instance: a node that re-joined after a restart refuses its late
    // InstallPlan / CommitVersion / AbortVersion (docs/daemon.md "Coordinator restart").
    options_.make_node_client = [make_channel, instance = instance_](const std::string&,
                                                                     const std::string& address) -> std::shared_ptr<NodeClient> {
      return std::make_shared<GrpcNodeClient>(
          make_channel ? make_channel(address) : grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), instance);
    };
  }
}

CoordinatorCore::~CoordinatorCore() {
  Shutdown();
  options_.clock->Forget(&mu_);
}

void CoordinatorCore::Start() {
  driver_ = std::thread([this] { DriverLoop(); });
  planner_ = std::thread([this] { PlannerLoop(); });
}

void CoordinatorCore::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
    plan_queue_.CancelRunning("coordinator shutting down");
  }
  if (driver_.joinable()) driver_.join();
  // Node RPCs not started are dropped; running ones end within their timeouts (as the driver's
  // own did before lanes).
  lanes_.Shutdown();
  // A running plan stops at the planner's next poll (milliseconds); an injected PlanFn runs to its end.
  if (planner_.joinable()) planner_.join();
}

bool CoordinatorCore::AwaitDriverPassAt(absl::Time t, absl::Time real_deadline) const {
  absl::MutexLock l(&mu_);
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return last_sweep_ != absl::InfinitePast() && last_sweep_ >= t; };
  return mu_.AwaitWithDeadline(absl::Condition(&done), real_deadline);
}

bool CoordinatorCore::AwaitNodeRpcsIdle(absl::Time real_deadline) const { return lanes_.AwaitIdle(real_deadline); }

absl::Time CoordinatorCore::Deadline(int64_t timeout_ms) const {
  const absl::Duration asked = timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(60);
  return options_.clock->Now() + std::min(asked, options_.max_wait);
}

int CoordinatorCore::num_models() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(models_.size());
}

void CoordinatorCore::MarkPlanDirtyLocked(Model& m) {
  m.plan_dirty = true;
  ++m.membership;
  if (!m.planning || stopping_) return;
  // The plan being made is of an older membership: RunPlan discards it when it ends. It used to
  // run on until the driver queued the newer plan (whose push cancels it), and the driver queues
  // nothing for a model that is not ready to plan any more (its trainer left), nor for any model
  // while it runs node RPCs (another model's sync commit copying into live memory, abort calls to
  // an unreachable node): meanwhile the stale plan held the one planner thread - every other
  // model's plan waited -, up to the plan deadline. So it is cancelled here, and the newer plan
  // queued as the driver's next pass would (a model being planned has no version in flight, no
  // commit and no catch-up: none starts while it plans; the checks mirror CollectWorkLocked).
  const std::string& model_id = m.spec.model_id();
  if (!m.plan_queued && m.committing == 0 && !m.catch_up && !m.machine->InFlight()) PlanWorkLocked(model_id, m);
  plan_queue_.CancelRunning("the model's membership changed while its plan was being made", model_id, kPlanJob);
}

absl::Status CoordinatorCore::RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp) {
  RETURN_IF_ERROR(CheckRegisterNode(req, options_.max_name_bytes));
  std::shared_ptr<NodeClient> client = options_.make_node_client(req.node_id(), req.address());
  absl::MutexLock l(&mu_);
  if (nodes_.Find(req.node_id()) == nullptr && nodes_.size() >= static_cast<size_t>(std::max(0, options_.max_nodes))) {
    RETURN_IF_ERROR(MakeRoomForNodeLocked(req.node_id()));
  }
  const NodeTable::Registered reg = nodes_.Register(req, std::move(client), options_.clock->Now());
  if (reg.restarted) {
    // A restarted node: whatever its workers had registered is gone with the old process.
    for (auto& [id, m] : models_) {
      std::vector<std::string> gone;
      for (auto& [w, rec] : m.workers) if (rec.node == req.node_id()) gone.push_back(w);
      for (const std::string& w : gone) DropWorkerLocked(m, w, absl::StrCat("node ", req.node_id(), " restarted"));
      // The version in flight cannot finish with the old process gone.
      if (m.machine->InFlightInvolves(req.node_id())) {
        AbortLocked(id, m, *m.machine->InFlight(), absl::StrCat("node ", req.node_id(), " restarted"));
      }
    }
  }
  // Commits the old incarnation missed are moot: its staging died with it. So are its owed
  // aborts: a restarted node rolls back at its re-join every sync commit never confirmed to it.
  pending_commits_.erase(std::remove_if(pending_commits_.begin(), pending_commits_.end(),
                                        [&](const PendingCommit& p) { return p.node == req.node_id(); }),
                         pending_commits_.end());
  pending_aborts_.erase(std::remove_if(pending_aborts_.begin(), pending_aborts_.end(),
                                       [&](const PendingAbort& p) { return p.node == req.node_id() && p.incarnation != reg.incarnation; }),
                        pending_aborts_.end());
  Log(LogLevel::kInfo, "node registered", {{"node", req.node_id()}, {"address", req.address()},
                                           {"data_address", req.data_address()}, {"incarnation", reg.incarnation}});
  resp->set_lease_ms(absl::ToInt64Milliseconds(reg.lease));
  resp->set_incarnation(reg.incarnation);
  resp->set_coordinator_instance(instance_);
  wake_ = true;
  StatusChangedLocked();
  return absl::OkStatus();
}

absl::Status CoordinatorCore::MakeRoomForNodeLocked(const std::string& node_id) {
  // What may refer to a node entry: workers (their node), a plan's nodes (commit / start work
  // looks their clients up), a version in flight, a catch-up run, an owed commit (incarnation).
  // A lost node's workers are dropped and its versions aborted when its lease runs out, so a lost
  // node is normally free of all of them by the next re-plan.
  std::set<std::string> used;
  for (const PendingCommit& p : pending_commits_) used.insert(p.node);
  for (auto& [mid, m] : models_) {
    for (auto& [w, rec] : m.workers) used.insert(rec.node);
    used.insert(m.plan.nodes.begin(), m.plan.nodes.end());
    if (m.catch_up) used.insert(m.catch_up->nodes.begin(), m.catch_up->nodes.end());
  }
  const std::string* victim = nullptr;
  absl::Time victim_expiry = absl::InfiniteFuture();
  int lost = 0;
  for (const auto& [id, n] : nodes_) {
    if (n.alive) continue;
    ++lost;
    if (used.count(id) > 0 || n.lease_expiry >= victim_expiry) continue;
    bool in_flight = false;
    for (auto& [mid, m] : models_) in_flight = in_flight || m.machine->InFlightInvolves(id);
    if (in_flight) continue;
    victim = &id;
    victim_expiry = n.lease_expiry;
  }
  if (victim == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("RegisterNode: node ", EchoValue(node_id), " refused: ", nodes_.size(),
                                                     " nodes are registered, the limit (max_nodes) is ", options_.max_nodes, ", and ",
                                                     lost == 0 ? "none is lost" : absl::StrCat("each of the ", lost, " lost ones still has workers, a plan or a version"),
                                                     " (a lost node without them gives its place)"));
  }
  const std::string gone = *victim;
  Log(LogLevel::kInfo, "lost node removed", {{"node", gone}, {"for", node_id}, {"max_nodes", options_.max_nodes}});
  nodes_.Remove(gone);
  StatusChangedLocked();
  return absl::OkStatus();
}

absl::Status CoordinatorCore::Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp) {
  // Receipt time, taken before the lock: a busy coordinator must not count its own delay as a
  // missed heartbeat.
  const absl::Time received = options_.clock->Now();
  RETURN_IF_ERROR(nodes_.CheckHeartbeat(req));  // refused before anything is stored
  absl::MutexLock l(&mu_);
  // A coordinator shutting down (a graceful restart: SIGTERM, then the next process) answered its
  // waiting calls UNAVAILABLE already. Heartbeats answered OK meanwhile told the nodes "the same
  // coordinator is there", so they passed that UNAVAILABLE on instead of waiting for the next
  // coordinator (a trainer's Publish in flight is sent again there, WorkerCalls).
  if (stopping_) return absl::UnavailableError("coordinator shutting down");
  resp->set_coordinator_instance(instance_);
  ASSIGN_OR_RETURN(const absl::Duration lease, nodes_.Heartbeat(req.node_id(), req.incarnation(), received));
  for (const pb::VersionProgress& p : req.progress()) {
    Model* m = models_.Find(p.model_id());
    if (m == nullptr) continue;
    // Only versions transferring now are kept (and dropped at commit/abort): a node cannot grow
    // the table with made-up versions.
    const VersionRecord* rec = m->machine->Find(p.version());
    if (rec == nullptr || rec->state != VState::kTransferring) continue;
    uint64_t& done = m->progress[p.version()][req.node_id()];
    // New bytes of a running version are news for watchers (wbctl watch shows progress); a beat
    // that only renews the lease is not (lease_left_ms is left to the safety net).
    if (done != p.bytes_done()) StatusChangedLocked();
    done = p.bytes_done();
  }
  resp->set_lease_ms(absl::ToInt64Milliseconds(lease));
  return absl::OkStatus();
}

absl::Status CoordinatorCore::CreateModel(const pb::CreateModelRequest& req, pb::CreateModelResponse* resp) {
  std::shared_ptr<const pb::ExplicitInventory> inventory;
  {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const bool created, models_.Create(req.model()));
    if (created) {
      used_by_rejoin_.erase(req.model().model_id());  // of an evicted model of that id
      StatusChangedLocked();
    }
    RETURN_IF_ERROR(models_.CheckReplySize(req.model().model_id(), 16, created));
    resp->set_created(created);
    inventory = models_.Find(req.model().model_id())->inventory_proto;
  }
  *resp->mutable_tensors() = inventory->tensors();  // outside the lock: the bulk of the reply
  return absl::OkStatus();
}

namespace {

// A worker-scoped call must come from the node the worker joined through. Node ids are bound to
// the caller's certificate under mTLS (daemon/auth_policy.cc), so this is what keeps one node from
// publishing, pausing, dropping, re-laying-out or advancing another node's workers.
absl::Status WorkerOnNode(const ModelRegistry::Model& m, const std::string& worker, const std::string& node) {
  auto w = m.workers.find(worker);
  if (w == m.workers.end() || w->second.node == node) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("worker ", EchoValue(worker), " of model ", m.spec.model_id(),
                                                  " joined through node ", w->second.node, ", not ", EchoValue(node)));
}

// A re-joining node's committed / applied versions bound every later publish: the same limits as
// a published version (VersionMachine::kMaxVersion, kMaxVersionJump above the newest known), so
// one wild number (2^64 - 1) cannot block the model or make waiters see versions never sent.
absl::Status CheckRestoredVersion(const VersionMachine& vm, const char* what, uint64_t version) {
  const uint64_t newest = vm.newest_known();
  if (version > VersionMachine::kMaxVersion || version - std::min(version, newest) > VersionMachine::kMaxVersionJump) {
    return absl::InvalidArgumentError(absl::StrCat("re-join: ", what, " ", version, " is above the largest version ", VersionMachine::kMaxVersion,
                                                   " or more than 2^32 above the newest version ", newest, " of this model"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CoordinatorCore::JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp) {
  RETURN_IF_ERROR(CheckJoinWorker(req, options_.max_name_bytes));
  std::shared_ptr<const pb::ExplicitInventory> inventory;
  {
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(JoinWorkerLocked(req, resp));
    inventory = models_.Find(req.model_id())->inventory_proto;
  }
  *resp->mutable_tensors() = inventory->tensors();  // outside the lock: the bulk of the reply
  return absl::OkStatus();
}

absl::Status CoordinatorCore::JoinWorkerLocked(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp) {
  if (!nodes_.IsAlive(req.node_id())) {
    return absl::FailedPreconditionError(absl::StrCat("node ", req.node_id(), " is not registered"));
  }
  bool created = false;
  absl::StatusOr<Model*> mp = models_.ForJoin(req, &created);
  if (created) {
    used_by_rejoin_.erase(req.model_id());  // of an evicted model of that id
    StatusChangedLocked();  // (even if the spec check below fails: as before the split)
  }
  RETURN_IF_ERROR(mp.status());
  Model& model = **mp;
  RETURN_IF_ERROR(models_.CheckReplySize(req.model_id(), model.spec.ByteSizeLong() + 32, created));
  *resp->mutable_model() = model.spec;
  resp->set_mode(model.spec.mode() == pb::MODE_UNSPECIFIED ? pb::MODE_SYNC : model.spec.mode());
  if (req.rejoin()) {
    RETURN_IF_ERROR(CheckRestoredVersion(*model.machine, "committed_version", req.committed_version()));
    RETURN_IF_ERROR(CheckRestoredVersion(*model.machine, "applied_version", req.applied_version()));
    RETURN_IF_ERROR(CheckRestoredVersion(*model.machine, "holds_version", req.holds_version()));
  }
  RETURN_IF_ERROR(CheckRestoredVersion(*model.machine, "published_version", req.published_version()));
  if (auto old = model.workers.find(req.worker_id()); old != model.workers.end()) {
    // Moving a worker to another node is fine once its old node is gone; while that node lives,
    // the worker is its (another node's join would take it over).
    if (old->second.node != req.node_id() && nodes_.IsAlive(old->second.node)) {
      return absl::PermissionDeniedError(absl::StrCat("worker ", EchoValue(req.worker_id()), " of model ", req.model_id(),
                                                      " is held by live node ", old->second.node, "; it must leave there first"));
    }
    DropWorkerLocked(model, req.worker_id(), absl::StrCat("worker ", req.worker_id(), " registered again"));
  }
  WithdrawPublishesOfOtherProcessLocked(req.model_id(), model, req.worker_id(), req.process());
  WorkerRec rec;
  rec.node = req.node_id();
  rec.process = req.process();
  rec.role = FromProto(req.role());
  rec.gpu = req.gpu();
  if (req.rejoin()) {
    // A node re-submits what it holds (coordinator restart / lost lease): the committed version
    // bounds what may be published next, a rollout's applied version feeds the staleness bound.
    model.machine->RestoreCommitted(req.committed_version());
    rec.restored_applied = req.applied_version();
    // What the rollout itself holds (holds_version), never more than its node: a late rollout
    // whose catch-up had not finished is late here too and is caught up. Not the node's committed
    // version: that made it count as holding it (WaitVersion answered OK, no catch-up ever ran).
    // A node built before the field sends 0: the rollout is caught up (a copy of what it holds).
    rec.holds = std::min(req.holds_version(), std::max(req.committed_version(), req.applied_version()));
    // A version it holds from a catch-up (quantised bytes, no canonical shadows), as its node
    // remembers it: the mark the coordinator before the restart had (WorkerRec::holds_without_shadows).
    rec.holds_without_shadows = rec.holds > 0 && req.holds_without_shadows();
    Log(LogLevel::kInfo, "worker re-joined", {{"model", req.model_id()}, {"worker", req.worker_id()}, {"node", req.node_id()},
                                              {"committed", req.committed_version()}, {"applied", req.applied_version()}});
  }
  // Used numbers, above what is committed: one held (a commit that was not cluster-wide; never a
  // catch-up source or destination, holds != committed) or a trainer's publish an earlier
  // coordinator recorded (not sync; one whose answer was lost is re-sent, not counted): never
  // published again. The latter also on a first join: a trainer's node that restarted sends the
  // record it kept on disk when the same trainer process registers again (node::PublishRecord).
  const uint64_t held = req.rejoin() ? std::max(rec.holds, rec.restored_applied) : 0;
  const uint64_t published = rec.role == planner::Role::kTrainer ? req.published_version() : 0;
  for (const auto& [n, is_publish] : {std::pair{held, false}, std::pair{published, true}}) {
    if (n <= model.machine->committed()) continue;  // (no entry for every model's first joins)
    UsedByRejoin& used = used_by_rejoin_[req.model_id()];
    if (n > used.version) used = {n, req.worker_id(), req.node_id(), is_publish};
  }
  models_.AddWorker(model, req.worker_id(), std::move(rec));
  StatusChangedLocked();
  return absl::OkStatus();
}

// Resolving and validating a layout is outside mu_ (1e6 pieces took seconds, and every other call
// of every model waited for them): a snapshot under mu_ (ModelRegistry::SnapshotLayout, which
// holds the model), the work without it, and under mu_ again the result is applied if the worker
// is still the registration with the layout the snapshot saw; else it is resolved again (a
// worker that left or joined again meanwhile gets the answer a fresh call would).
absl::Status CoordinatorCore::SubmitLayout(const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse* resp) {
  constexpr int kAttempts = 3;
  for (int attempt = 1;; ++attempt) {
    ModelRegistry::LayoutSnapshot snap;
    {
      absl::MutexLock l(&mu_);
      ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
      RETURN_IF_ERROR(WorkerOnNode(*m, req.worker_id(), req.node_id()));
      ASSIGN_OR_RETURN(snap, models_.SnapshotLayout(*m, req.worker_id()));
    }
    if (options_.test_before_layout_resolve) options_.test_before_layout_resolve();
    absl::StatusOr<ModelRegistry::ResolvedWorkerLayout> resolved = ModelRegistry::ResolveSnapshot(snap, req);
    absl::StatusOr<bool> changed;
    {
      absl::MutexLock l(&mu_);
      if (!resolved.ok()) {
        models_.DropSnapshot(snap);
        return resolved.status();
      }
      Model& m = *snap.model;
      changed = models_.ApplyLayout(snap, req, *resolved);
      if (changed.ok() && *changed) {
        MarkPlanDirtyLocked(m);
        wake_ = true;
        StatusChangedLocked();
      }
    }
    if (absl::IsAborted(changed.status()) && absl::StrContains(changed.status().message(), ModelRegistry::kLayoutChanged) &&
        attempt < kAttempts) {
      continue;
    }
    RETURN_IF_ERROR(changed.status());
    resp->mutable_layout()->Swap(resolved->answer.get());  // outside mu_; the answer is this call's alone
    return absl::OkStatus();
  }
}

void CoordinatorCore::DropWorkerLocked(Model& m, const std::string& worker, const std::string& reason) {
  auto it = m.workers.find(worker);
  if (it == m.workers.end()) return;
  const bool in_plan = m.InPlan(worker);
  m.workers.erase(it);
  models_.Touch(m);  // its idle grace starts now, not at the last call (a node's lease just lapsed?)
  Log(LogLevel::kInfo, "worker dropped", {{"model", m.spec.model_id()}, {"worker", worker}, {"reason", reason}});
  // A plan being made outside the lock may include the worker: it is stale now.
  if (in_plan || m.planning) {
    MarkPlanDirtyLocked(m);
    if (auto v = m.machine->InFlight()) AbortLocked(m.spec.model_id(), m, *v, reason);
  }
  wake_ = true;
  StatusChangedLocked();
}

absl::Status CoordinatorCore::LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse*) {
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  RETURN_IF_ERROR(WorkerOnNode(*m, req.worker_id(), req.node_id()));
  const std::string why = absl::StrCat("worker ", req.worker_id(), " left", req.reason().empty() ? "" : ": ", EchoValue(req.reason()));
  // Sync: a trainer that left (its process exited, it deregistered) no longer promises its live
  // memory holds what it published: those versions never start from it (or from a process that
  // registers the same id later).
  if (m->machine->mode() == ModeKind::kSync) {
    for (uint64_t v : m->machine->UnfinishedPublishedBy(req.worker_id())) {
      AbortLocked(req.model_id(), *m, v, absl::StrCat(why, " before version ", v, ", which it published, was read from its memory"));
    }
  }
  DropWorkerLocked(*m, req.worker_id(), why);
  return absl::OkStatus();
}

void CoordinatorCore::WithdrawPublishesOfOtherProcessLocked(const std::string& model_id, Model& m, const std::string& worker,
                                                            const std::string& process) {
  // Sync: a version is read from its trainers' live memory once it starts. A trainer id joining
  // from another process than the one that published version v (the publisher was killed and a
  // new process took its id, before its node noticed the exit) holds other bytes - the new
  // process's, possibly its next step half-written (chaos run: rollouts were told v22 and held
  // v23's bytes). Unknown processes (empty: a node built before the field) are not compared.
  if (m.machine->mode() != ModeKind::kSync) return;
  for (uint64_t v : m.machine->PublishedFromAnotherProcess(worker, process)) {
    const VersionRecord* rec = m.machine->Find(v);
    const std::string old = rec != nullptr && rec->publisher_process.count(worker) > 0 ? rec->publisher_process.at(worker) : "?";
    AbortLocked(model_id, m, v,
                absl::StrCat("trainer ", worker, " registered again from another process (", EchoValue(process), ") than the one that published version ",
                             v, " (", EchoValue(old), "): its memory does not hold version ", v));
  }
}

absl::Status CoordinatorCore::Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp) {
  const absl::Time start = options_.clock->Now();
  const absl::Time deadline = Deadline(req.timeout_ms());
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  ModelRegistry::Held held(models_, *m);  // m is kept across the waits below
  const uint64_t v = req.version();
  if (cluster_draining_ && !m->machine->Find(v)) {
    return absl::UnavailableError(absl::StrCat("cluster is draining: version ", v, " refused"));
  }
  // (Only looked at when some node drains: a version of T trainers on N nodes is T publishes.)
  for (const std::string& n : nodes_.any_draining() ? m->plan.nodes : std::set<std::string>{}) {
    if (nodes_.IsDraining(n) && !m->machine->Find(v)) {
      return absl::UnavailableError(absl::StrCat("node ", n, " is draining: version ", v, " refused"));
    }
  }
  // A trainer that joined (with its layout) before the model is (re-)planned - e.g. right after a
  // coordinator restart, while the nodes re-submit - waits for the plan instead of failing.
  const std::string& worker = req.worker_id();
  auto planned = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto w = m->workers.find(worker);
    return stopping_ || w == m->workers.end() || !w->second.has_layout || m->machine->trainers().count(worker) > 0;
  };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&planned), deadline)) {
    // Still joined with its layout and still not in a plan: say so (was FAILED_PRECONDITION "not a
    // registered trainer", which read as if the trainer had never joined).
    return absl::DeadlineExceededError(absl::StrCat("publish of version ", v, " by ", EchoValue(worker), ": model ", req.model_id(),
                                                    " has no plan with this trainer yet, not in time (",
                                                    m->plan_error.empty() ? "are all its workers registered with their layouts?" : m->plan_error,
                                                    ")"));
  }
  if (stopping_) return absl::UnavailableError("coordinator shutting down");
  // Unknown here (or joined without its layout yet): after a coordinator restart or a lost lease
  // its node has not re-submitted it yet. NOT_FOUND, nothing recorded: the node sends the publish
  // again once it has re-joined (never FAILED_PRECONDITION, which would fail the trainer).
  if (auto w = m->workers.find(worker); w == m->workers.end() || !w->second.has_layout) {
    return absl::NotFoundError(absl::StrCat("worker ", EchoValue(worker), " has not joined model ", req.model_id(),
                                            " with a layout at this coordinator (node ", EchoValue(req.node_id()), " not re-joined yet?)"));
  }
  RETURN_IF_ERROR(WorkerOnNode(*m, worker, req.node_id()));
  // A number a re-joined rollout holds without a cluster-wide commit: never named again (other bytes
  // under it would pass for what that rollout holds) once no re-joining node may restore its commit.
  if (UsedUncommittedLocked(req.model_id(), *m, v, "")) (void)AwaitRejoinWindowLocked(req.model_id(), *m, v, deadline);
  if (std::optional<absl::Status> used = UsedUncommittedLocked(req.model_id(), *m, v, absl::StrCat("publish by ", worker))) return *used;
  // Staleness bound (async): hold the trainer while a rollout is too far behind.
  auto admissible = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || m->machine->PublishAdmissible(v); };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&admissible), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("publish of version ", v, ": a rollout is more than ",
                                                    m->machine->max_staleness(), " versions behind"));
  }
  if (stopping_) return absl::UnavailableError("coordinator shutting down");
  // (The worker's record as it is now: the waits above let go of the lock.)
  const auto publisher = m->workers.find(worker);
  const std::string process = publisher != m->workers.end() ? publisher->second.process : std::string();
  RETURN_IF_ERROR_WITH(m->machine->RecordPublish(worker, v, process), absl::StrCat("publish by ", worker));
  // Older versions this trainer skipped can never be published by every trainer: the ranks that
  // did publish them (sync: blocked until they commit) hear ABORTED now and publish this one,
  // instead of each version waiting for the other's rank until the publish deadline (chaos: at a
  // coordinator restart one rank's Publish in flight was answered ABORTED, the other's was sent
  // again to the new coordinator; v35 waited for one rank, v36 for the other, 15 s each).
  for (uint64_t older : m->machine->PublishingWithout(worker, v)) {
    AbortLocked(req.model_id(), *m, older,
                absl::StrCat("trainer ", worker, " published version ", v, " without publishing version ", older,
                             ", which can therefore never be published by every trainer"));
  }
  // The same, the other way round: another rank is past v already (a Publish of v re-sent after a
  // coordinator restart, docs/daemon.md "Coordinator restart", can arrive after the other rank's
  // newer one). v would wait for that rank until this call's deadline.
  if (std::string past = m->machine->PublishedPastWithout(worker, v); !past.empty()) {
    AbortLocked(req.model_id(), *m, v,
                absl::StrCat("trainer ", past, " published a newer version without publishing version ", v,
                             ", which can therefore never be published by every trainer"));
  }
  wake_ = true;
  StatusChangedLocked();
  if (m->machine->mode() == ModeKind::kSync) {
    // Sync: the trainer's live weights are the source, so it waits until the version is in, i.e.
    // every node acknowledged the commit (every rollout holds it whole in live memory).
    auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || m->machine->Outcome(v).has_value(); };
    if (!options_.clock->WaitUntil(&mu_, absl::Condition(&done), deadline)) {
      // The trainer writes its live weights again once this returns (its next step): the version
      // is withdrawn, queued or transferring, so it never starts - or commits - from them later.
      // A commit already decided read them whole and goes on (AbortLocked leaves it).
      AbortLocked(req.model_id(), *m, v,
                  absl::StrCat("publish of version ", v, " by ", worker, " timed out before the version committed"));
      return absl::DeadlineExceededError(absl::StrCat("version ", v, " not committed before the publish deadline"));
    }
    if (stopping_) return absl::UnavailableError("coordinator shutting down");
    RETURN_IF_ERROR(*m->machine->Outcome(v));
  }
  resp->set_version(v);
  resp->set_stall_seconds(absl::ToDoubleSeconds(options_.clock->Now() - start));
  return absl::OkStatus();
}

absl::Status CoordinatorCore::ReportReady(const pb::ReportReadyRequest& req, pb::ReportReadyResponse* resp) {
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  auto w = m->workers.find(req.worker_id());
  if (w == m->workers.end()) {
    // As in Publish: NOT_FOUND (nothing recorded) lets its node re-send after re-joining it.
    return absl::NotFoundError(absl::StrCat("worker ", EchoValue(req.worker_id()), " has not joined model ", req.model_id(),
                                            " at this coordinator (node ", EchoValue(req.node_id()), " not re-joined yet?)"));
  }
  RETURN_IF_ERROR(WorkerOnNode(*m, req.worker_id(), req.node_id()));
  if (w->second.role != planner::Role::kRollout) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", req.worker_id(), " is not a registered rollout worker"));
  }
  w->second.paused = !req.resumed();
  if (req.resumed()) {
    m->machine->RecordResumed(req.worker_id());
  } else {
    m->machine->RecordReady(req.worker_id());
    RejoinLeftOutLocked(req.model_id(), *m, req.worker_id());  // left out for not pausing: back in the plan
  }
  resp->set_committed_version(m->machine->committed());
  wake_ = true;
  StatusChangedLocked();
  return absl::OkStatus();
}

absl::Status CoordinatorCore::ReportDone(const pb::ReportDoneRequest& req, pb::ReportDoneResponse*) {
  if (!req.coordinator_instance().empty() && req.coordinator_instance() != instance_) {
    // An executor started by the previous coordinator process finished late: that version was
    // aborted on the node when it re-registered, and this coordinator may run the same version
    // number again. Its outcome must not touch this coordinator's versions.
    Log(LogLevel::kInfo, "stale ReportDone ignored",
        {{"node", req.node_id()}, {"model", req.model_id()}, {"version", req.version()},
         {"from_instance", req.coordinator_instance()}, {"instance", instance_}});
    return absl::OkStatus();
  }
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  if (req.catch_up()) return CatchUpDoneLocked(req, *m);
  if (!req.ok()) {
    // Only a node the version is transferring through can fail it: another node's (or a version
    // never started) must not abort it, nor leave a record for a version no one published.
    const VersionRecord* r = m->machine->Find(req.version());
    if (r == nullptr || r->state != VState::kTransferring || !m->plan.nodes.count(req.node_id())) {
      if (r != nullptr && r->state == VState::kTransferring) {
        return absl::PermissionDeniedError(absl::StrCat("node ", EchoValue(req.node_id()), " is not in version ", req.version(),
                                                        " of model ", req.model_id()));
      }
      Log(LogLevel::kInfo, "failure report for a version not transferring ignored",
          {{"node", req.node_id()}, {"model", req.model_id()}, {"version", req.version()}});
      return absl::OkStatus();
    }
    // A node whose transfer deadline passed closes its channels, and its peers may report that
    // ("peer vanished") before its own report of the timeout arrives: name the timeout whenever
    // the version's deadline had (all but) passed, whoever reported first.
    const absl::Duration slack = std::min(absl::Seconds(1), (r->deadline - r->started) / 20);
    const bool timed_out = r->deadline != absl::InfiniteFuture() && options_.clock->Now() >= r->deadline - slack;
    AbortLocked(req.model_id(), *m, req.version(),
                absl::StrCat(timed_out ? absl::StrCat("at the transfer deadline (", absl::FormatDuration(r->deadline - r->started), "): ")
                                       : "",
                             "node ", req.node_id(), ": ", req.error()));
    return absl::OkStatus();
  }
  const VersionRecord* rec = m->machine->Find(req.version());
  if (rec != nullptr && rec->state == VState::kTransferring) {
    // What landed must be what was sent (end-to-end digests) before the node counts as done.
    if (absl::Status d = AddDigestsLocked(req.model_id(), *m, req); !d.ok()) {
      AbortLocked(req.model_id(), *m, req.version(), std::string(d.message()));
      return absl::OkStatus();
    }
    MagnitudesDoneLocked(*m, req.node_id(), req.version());
    m->progress[req.version()][req.node_id()] = req.bytes();
    m->deltas[req.version()][req.node_id()] = {req.delta_stream_bytes(), req.delta_replaced_bytes(), req.delta_fallback_bytes()};
    while (m->deltas.size() > kVersionDetailsKept) m->deltas.erase(m->deltas.begin());
    StatusChangedLocked();
  }
  if (m->machine->NodeDone(req.node_id(), req.version())) {
    FinishDigestsLocked(req.model_id(), *m, req.version());
    m->committing = req.version();
    wake_ = true;
  }
  return absl::OkStatus();
}

absl::Status CoordinatorCore::ReportApplied(const pb::ReportAppliedRequest& req, pb::ReportAppliedResponse*) {
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  RETURN_IF_ERROR(WorkerOnNode(*m, req.worker_id(), req.node_id()));
  // Applied versions only rise, and feed the staleness bound: one never published cannot be held.
  if (const uint64_t newest = m->machine->newest_known(); req.version() > newest) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", EchoValue(req.worker_id()), " reports version ", req.version(),
                                                   " applied, but the newest version of model ", req.model_id(), " is ", newest));
  }
  m->machine->RecordApplied(req.worker_id(), req.version());
  StatusChangedLocked();
  return absl::OkStatus();
}

absl::Status CoordinatorCore::WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp) {
  const absl::Time deadline = Deadline(req.timeout_ms());
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  ModelRegistry::Held held(models_, *m);  // m is kept across the waits below
  const uint64_t v = std::max<uint64_t>(req.version(), 1);
  // Sync: the rollout's node forwards its wait while it is paused (BeginUpdate, then WaitVersion):
  // recorded for as long as the wait lasts, so that a commit or abort of an older version leaves
  // it paused (PausedPastLocked). Only on this registration: a worker registered again is another
  // record (a new serial), which this wait is none of.
  uint64_t wait_serial = 0;
  if (m->machine->mode() == ModeKind::kSync && !req.worker_id().empty()) {
    auto w = m->workers.find(req.worker_id());
    if (w != m->workers.end() && w->second.role == planner::Role::kRollout) {
      w->second.waits.insert(v);
      wait_serial = w->second.serial;
    }
  }
  absl::Cleanup unrecord = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {  // runs under mu_ (l outlives it)
    if (wait_serial == 0) return;
    auto w = m->workers.find(req.worker_id());
    if (w == m->workers.end() || w->second.serial != wait_serial) return;
    auto it = w->second.waits.find(v);
    if (it != w->second.waits.end()) w->second.waits.erase(it);
  };
  const std::string what = absl::StrCat("wait for version ", v);
  // (A used number held by a re-joined rollout without a cluster-wide commit ends the wait - it is
  // never published again - once no node still re-joining may restore its commit.)
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || m->machine->Outcome(v).has_value() || UsedUncommittedLocked(req.model_id(), *m, v, what).has_value();
  };
  std::optional<absl::Status> outcome;
  do {
    if (!options_.clock->WaitUntil(&mu_, absl::Condition(&done), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("version ", v, " of model ", req.model_id(),
                                                      " not committed in time (committed: ", m->machine->committed(), ")"));
    }
    if (stopping_) return absl::UnavailableError("coordinator shutting down");
    outcome = m->machine->Outcome(v);
  } while (!outcome.has_value() && AwaitRejoinWindowLocked(req.model_id(), *m, v, deadline));
  if (!outcome.has_value()) return *UsedUncommittedLocked(req.model_id(), *m, v, what);
  RETURN_IF_ERROR(*outcome);
  // A late rollout (registered or restarted after the version was committed) is told only once
  // its catch-up landed (docs/daemon.md "Catch-up").
  auto caught_up = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || CaughtUpLocked(*m, req.worker_id(), v).has_value(); };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&caught_up), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("version ", v, " of model ", req.model_id(), " is committed but rollout ",
                                                    EchoValue(req.worker_id()), " has not caught up to it in time (",
                                                    m->catch_up ? "its catch-up is running" : "waiting for its layout, plan or catch-up", ")"));
  }
  if (stopping_) return absl::UnavailableError("coordinator shutting down");
  RETURN_IF_ERROR(*CaughtUpLocked(*m, req.worker_id(), v));
  resp->set_committed_version(m->machine->committed());
  return absl::OkStatus();
}

absl::Status CoordinatorCore::Drain(const pb::DrainRequest& req, pb::DrainResponse* resp) {
  const absl::Time deadline = Deadline(req.timeout_ms());
  if (req.node_id().empty() && !req.all()) {
    return absl::InvalidArgumentError("Drain: name the node to drain (node_id), or set all = true to drain the whole cluster");
  }
  if (!req.node_id().empty() && req.all()) {
    return absl::InvalidArgumentError(absl::StrCat("Drain: node_id (", EchoValue(req.node_id()), ") and all = true are exclusive"));
  }
  absl::MutexLock l(&mu_);
  const bool one_node = !req.node_id().empty();
  if (one_node && nodes_.Find(req.node_id()) == nullptr) {
    return absl::NotFoundError(absl::StrCat("unknown node ", EchoValue(req.node_id())));
  }
  if (req.undo()) {
    // Lifts the drain: new versions are accepted again (a node's drain also ends when it
    // re-registers). Answers at once.
    if (one_node) {
      nodes_.SetDraining(req.node_id(), false);
    } else {
      cluster_draining_ = false;
      for (auto& [id, m] : models_) m.machine->set_draining(false);
      nodes_.ClearDraining();
    }
    Log(LogLevel::kInfo, "drain lifted", {{"target", one_node ? req.node_id() : std::string("cluster")}});
    wake_ = true;
    StatusChangedLocked();
    resp->set_drained(false);
    return absl::OkStatus();
  }
  if (one_node) {
    nodes_.SetDraining(req.node_id(), true);
  } else {
    cluster_draining_ = true;
    for (auto& [id, m] : models_) m.machine->set_draining(true);
  }
  Log(LogLevel::kInfo, "drain", {{"target", one_node ? req.node_id() : std::string("cluster")}});
  StatusChangedLocked();
  // Drained when nothing the drain covers is queued or transferring.
  auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (stopping_) return true;
    for (auto& [id, m] : models_) {
      if (!one_node ? !m.machine->Idle() : m.machine->InFlightInvolves(req.node_id())) return false;
    }
    return true;
  };
  const bool drained = options_.clock->WaitUntil(&mu_, absl::Condition(&idle), deadline) && !stopping_;
  uint32_t in_flight = 0;
  for (auto& [id, m] : models_) in_flight += m.machine->InFlight().has_value();
  resp->set_drained(drained);
  resp->set_in_flight_versions(in_flight);
  return absl::OkStatus();
}

absl::Status CoordinatorCore::Plan(const pb::PlanRequest& req, pb::PlanResponse* resp) {
  absl::MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
  if (m->plan.epoch == 0) {
    return absl::FailedPreconditionError(absl::StrCat("model ", req.model_id(), " has no plan yet",
                                                      m->plan_error.empty() ? "" : ": ", m->plan_error));
  }
  const planner::Plan& plan = *m->plan.plan;
  resp->set_fingerprint(plan.fingerprint);
  resp->set_strategy(ToProto(plan.strategy));
  StatsToProto(plan.stats, static_cast<int>(plan.buckets.size()), resp->mutable_stats());
  resp->set_total_bytes(m->plan.total_bytes);
  return absl::OkStatus();
}

bool CoordinatorCore::AwaitPlanInstalled(const std::string& model_id, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto installed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Model* m = models_.Find(model_id);
    return m != nullptr && m->plan.installed && !m->plan_dirty && !m->planning && !m->plan_queued;
  };
  return options_.clock->WaitUntil(&mu_, absl::Condition(&installed), deadline);
}

bool CoordinatorCore::AwaitPlansWaiting(size_t n, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto waiting = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return plan_queue_.size() == n; };
  return options_.clock->WaitUntil(&mu_, absl::Condition(&waiting), deadline);
}

bool CoordinatorCore::AwaitModelHolds(const std::string& model_id, int n, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto held = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Model* m = models_.Find(model_id);
    return m != nullptr && m->holds == n;
  };
  return options_.clock->WaitUntil(&mu_, absl::Condition(&held), deadline);
}

bool CoordinatorCore::AwaitPlanSettled(const std::string& model_id, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto settled = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Model* m = models_.Find(model_id);
    return m != nullptr && !m->plan_dirty && !m->planning && !m->plan_queued;
  };
  return options_.clock->WaitUntil(&mu_, absl::Condition(&settled), deadline);
}

}  // namespace wb::daemon
