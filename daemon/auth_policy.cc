#include "daemon/auth_policy.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/log.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

namespace pb = ::weightbridge::v1;

constexpr char kCoordinator[] = "/weightbridge.v1.CoordinatorService/";
constexpr char kNode[] = "/weightbridge.v1.NodeService/";
constexpr char kWorker[] = "/weightbridge.v1.WorkerService/";

Verdict Refuse(absl::Status s, std::string what) { return Verdict{std::move(s), std::move(what)}; }

// CheckPeer; a call that passes it marks its connection authenticated.
Verdict Peer(const PeerRuleOptions& o, const AuthCall& call) {
  absl::Status s = CheckPeer(*call.ctx, *o.config);
  if (!s.ok()) return Refuse(std::move(s), "unauthenticated");
  if (o.on_authenticated) o.on_authenticated(call.ctx->peer());
  return Verdict::Ok();
}

// A call a node makes about itself: CheckPeer, then its node_id must be its certificate's.
Verdict NodeScoped(const PeerRuleOptions& o, const AuthCall& call, const std::string& node_id) {
  if (Verdict v = Peer(o, call); !v.status.ok()) return v;
  if (absl::Status s = CheckNodeIdentity(*call.ctx, *o.config, node_id); !s.ok()) return Refuse(std::move(s), "impersonation");
  return Verdict::Ok();
}

// Drain's operator check (PeerAuthConfig::operator_required): a Drain reaching beyond the caller's
// own node needs the operator credential. `self` is the node a node's own certificate may drain
// and undrain without it (mTLS with bind_node_id): at the coordinator the node the request names,
// at a node this node. Counted as "operator".
Verdict DrainOperator(const PeerRuleOptions& o, const AuthCall& call, const pb::DrainRequest& req, const std::string& self,
                      const std::string& method) {
  const PeerAuthConfig& c = *o.config;
  if (!c.operator_required()) return Verdict::Ok();
  if (!req.all() && !self.empty() && c.tls() && c.bind_node_id && CheckNodeIdentity(*call.ctx, c, self).ok()) return Verdict::Ok();
  std::string target = req.all() ? std::string("the whole cluster")
                                 : absl::StrCat("node '", (req.node_id().empty() ? o.node_id : req.node_id()).substr(0, 128), "'");
  std::string action = absl::StrCat(method, " (", req.undo() ? "lift the drain of " : "drain ", target, ")");
  if (absl::Status s = CheckOperator(*call.ctx, c, action); !s.ok()) return Refuse(std::move(s), "operator");
  return Verdict::Ok();
}

// A waiting call's timeout_ms beyond Limits::max_wait_ms is clamped to it before the handler
// sees the request (0 keeps each handler's default of 60 s): every wait ends, and gives back its
// thread and slot. A negative one is refused: it is a caller's arithmetic gone wrong (a deadline
// already passed), and taking it as "the default" would make that caller wait a minute.
template <typename Req>
Verdict ClampWait(Req& req, const Limits& limits, const char* call) {
  if (req.timeout_ms() < 0) {
    return Refuse(absl::InvalidArgumentError(absl::StrCat(call, ": timeout_ms is ", req.timeout_ms(),
                                                          "; give a positive number of milliseconds, or 0 for the default (60 s)")),
                  "invalid");
  }
  if (req.timeout_ms() > limits.max_wait_ms) req.set_timeout_ms(limits.max_wait_ms);
  return Verdict::Ok();
}

// A slot of `pool` for the caller (PeerKey: its certificate's node, else its address).
Verdict TakePeerSlot(BlockedCalls& pool, const PeerRuleOptions& o, AuthCall& call) {
  absl::StatusOr<BlockedCalls::Slot> slot = pool.Acquire(PeerKey(*call.ctx, *o.config));
  if (!slot.ok()) return Verdict{slot.status(), "blocked_calls"};
  call.slot.emplace(std::move(*slot));
  return Verdict::Ok();
}

// Checks of the request body that are not counted as refusals (as before the gate).
Verdict Uncounted(absl::Status s) { return Verdict{std::move(s), ""}; }

template <typename Req>
void AddPeerOnly(AuthGate& gate, const std::string& service, const std::string& method, const PeerRuleOptions& o) {
  gate.Add(service + method, Rule<Req>([o](AuthCall& call, Req&) { return Peer(o, call); }));
}

template <typename Req>
void AddNodeScoped(AuthGate& gate, const std::string& method, const PeerRuleOptions& o,
                   std::function<absl::Status(const Req&)> body = nullptr) {
  gate.Add(kCoordinator + method, Rule<Req>([o, body](AuthCall& call, Req& req) {
             if (Verdict v = NodeScoped(o, call, req.node_id()); !v.status.ok()) return v;
             return body ? Uncounted(body(req)) : Verdict::Ok();
           }));
}

}  // namespace

// ------------------------------------------------------------------------------ CoordinatorService
void AddCoordinatorRules(AuthGate& gate, const PeerRuleOptions& o) {
  AddNodeScoped<pb::RegisterNodeRequest>(gate, "RegisterNode", o);
  AddNodeScoped<pb::HeartbeatRequest>(gate, "Heartbeat", o);
  AddNodeScoped<pb::LeaveWorkerRequest>(gate, "LeaveWorker", o);
  AddNodeScoped<pb::ReportReadyRequest>(gate, "ReportReady", o);
  AddNodeScoped<pb::ReportAppliedRequest>(gate, "ReportApplied", o);
  // A failure's text is the node's (any bytes a token holder sends): kept, logged and forwarded to
  // every node of the version, so bounded here, before any handler sees it.
  gate.Add(std::string(kCoordinator) + "ReportDone", Rule<pb::ReportDoneRequest>([o](AuthCall& call, pb::ReportDoneRequest& req) {
             if (Verdict v = NodeScoped(o, call, req.node_id()); !v.status.ok()) return v;
             if (req.error().size() > kMaxNodeTextBytes) req.set_error(BoundNodeText(std::move(*req.mutable_error())));
             return Verdict::Ok();
           }));
  AddNodeScoped<pb::JoinWorkerRequest>(gate, "JoinWorker", o, [limits = o.limits](const pb::JoinWorkerRequest& r) {
    return r.has_model() ? CheckModelSpec(r.model(), limits) : absl::OkStatus();
  });
  AddNodeScoped<pb::SubmitLayoutRequest>(gate, "SubmitLayout", o, [limits = o.limits](const pb::SubmitLayoutRequest& r) {
    absl::Status s = CheckLayoutRequest(r.buffers(), r.layout(), limits);
    return s.ok() ? s : absl::Status(s.code(), absl::StrCat("worker ", r.worker_id(), ": ", s.message()));
  });
  gate.Add(std::string(kCoordinator) + "CreateModel", Rule<pb::CreateModelRequest>([o](AuthCall& call, pb::CreateModelRequest& req) {
             if (Verdict v = Peer(o, call); !v.status.ok()) return v;
             return Uncounted(CheckModelSpec(req.model(), o.limits));
           }));
  // Each blocked call holds a server thread: WaitVersion, Publish (waits for its plan, the
  // staleness bound and in sync mode the commit) and Drain share max_blocked_calls slots, of which
  // one node holds at most BlockedCallsPerNode; each waits at most max_wait_ms.
  auto blocked = std::make_shared<BlockedCalls>(
      "coordinator: CoordinatorService waiting calls (WaitVersion, Publish, Drain)", o.limits.max_blocked_calls,
      BlockedCallsPerNode(o.limits, o.limits.max_blocked_calls), "per node, --max_blocked_calls_per_node");
  gate.Add(std::string(kCoordinator) + "WaitVersion", Rule<pb::WaitVersionRequest>([o, blocked](AuthCall& call, pb::WaitVersionRequest& req) {
             if (Verdict v = Peer(o, call); !v.status.ok()) return v;
             if (Verdict v = ClampWait(req, o.limits, "WaitVersion"); !v.status.ok()) return v;
             return TakePeerSlot(*blocked, o, call);
           }));
  gate.Add(std::string(kCoordinator) + "Publish", Rule<pb::CoordPublishRequest>([o, blocked](AuthCall& call, pb::CoordPublishRequest& req) {
             if (Verdict v = NodeScoped(o, call, req.node_id()); !v.status.ok()) return v;
             if (Verdict v = ClampWait(req, o.limits, "Publish"); !v.status.ok()) return v;
             return TakePeerSlot(*blocked, o, call);
           }));
  // Lifting a drain answers at once and needs no slot: an operator can always undo one.
  gate.Add(std::string(kCoordinator) + "Drain", Rule<pb::DrainRequest>([o, blocked](AuthCall& call, pb::DrainRequest& req) {
             if (Verdict v = Peer(o, call); !v.status.ok()) return v;
             if (Verdict v = DrainOperator(o, call, req, req.node_id(), "CoordinatorService.Drain"); !v.status.ok()) return v;
             if (req.undo()) return Verdict::Ok();
             if (Verdict v = ClampWait(req, o.limits, "Drain"); !v.status.ok()) return v;
             return TakePeerSlot(*blocked, o, call);
           }));
  // A node's NVFP4 magnitudes: node-scoped, and it may wait for the other nodes. Its own slots
  // (workers' WaitVersion calls must not starve the exchange their version needs), a quarter of
  // --max_blocked_calls (at least 16): one waiting call per node and model in flight, inside the
  // 256 threads the server has beyond the blocked calls; one node holds at most its share of them.
  const int exchange_slots = std::max(16, o.limits.max_blocked_calls / 4);
  auto exchanges = std::make_shared<BlockedCalls>("coordinator: CoordinatorService.ExchangeMagnitudes", exchange_slots,
                                                  BlockedCallsPerNode(o.limits, exchange_slots), "per node, --max_blocked_calls_per_node");
  gate.Add(std::string(kCoordinator) + "ExchangeMagnitudes",
           Rule<pb::ExchangeMagnitudesRequest>([o, exchanges](AuthCall& call, pb::ExchangeMagnitudesRequest& req) {
             if (Verdict v = NodeScoped(o, call, req.node_id()); !v.status.ok()) return v;
             if (Verdict v = ClampWait(req, o.limits, "ExchangeMagnitudes"); !v.status.ok()) return v;
             if (!req.wait()) return Verdict::Ok();
             return TakePeerSlot(*exchanges, o, call);
           }));
  AddPeerOnly<pb::StatusRequest>(gate, kCoordinator, "ClusterStatus", o);
  AddPeerOnly<pb::PlanRequest>(gate, kCoordinator, "Plan", o);
  // WatchStatus caps its own stream length (its handler); a negative timeout_ms is refused here too.
  gate.Add(std::string(kCoordinator) + "WatchStatus", Rule<pb::WatchStatusRequest>([o](AuthCall& call, pb::WatchStatusRequest& req) {
             if (Verdict v = Peer(o, call); !v.status.ok()) return v;
             if (req.timeout_ms() >= 0) return Verdict::Ok();
             return Refuse(absl::InvalidArgumentError(absl::StrCat("WatchStatus: timeout_ms is ", req.timeout_ms(),
                                                                   "; give a positive number of milliseconds, or 0 for the default")),
                           "invalid");
           }));
}

// ------------------------------------------------------------------------------ NodeService
namespace {

// A call only the coordinator makes: CheckPeer, then (mTLS) the caller's certificate must name
// the coordinator (PeerAuthConfig::coordinator_identity).
Verdict CoordinatorOnly(const PeerRuleOptions& o, const AuthCall& call, const std::string& method) {
  if (Verdict v = Peer(o, call); !v.status.ok()) return v;
  if (absl::Status s = CheckCoordinatorIdentity(*call.ctx, *o.config, method); !s.ok()) return Refuse(std::move(s), "impersonation");
  return Verdict::Ok();
}

template <typename Req>
void AddCoordinatorOnly(AuthGate& gate, const std::string& method, const PeerRuleOptions& o) {
  gate.Add(kNode + method, Rule<Req>([o, method](AuthCall& call, Req&) { return CoordinatorOnly(o, call, method); }));
}

}  // namespace

void AddNodeRules(AuthGate& gate, const PeerRuleOptions& o, VersionHook on_commit, VersionHook on_abort) {
  // A slice must cover every piece of each local rollout it writes (CheckSliceCoversLocalRollouts).
  gate.Add(std::string(kNode) + "InstallPlan", Rule<pb::InstallPlanRequest>([o](AuthCall& call, pb::InstallPlanRequest& req) {
             if (Verdict v = CoordinatorOnly(o, call, "InstallPlan"); !v.status.ok()) return v;
             return Uncounted(CheckSliceCoversLocalRollouts(req.slice(), o.node_id));
           }));
  AddCoordinatorOnly<pb::ExecuteVersionRequest>(gate, "ExecuteVersion", o);
  AddCoordinatorOnly<pb::DropWorkerRequest>(gate, "DropWorker", o);
  AddPeerOnly<pb::SetupDataChannelRequest>(gate, kNode, "SetupDataChannel", o);
  // A peer exchanges regions as itself: from_node must be its certificate's (else it could replace
  // another node's endpoint for a version in flight).
  gate.Add(std::string(kNode) + "ExchangeRegions", Rule<pb::ExchangeRegionsRequest>([o](AuthCall& call, pb::ExchangeRegionsRequest& req) {
             return NodeScoped(o, call, req.from_node());
           }));
  // Forwarded to the coordinator's Drain (which takes a slot there) within max_wait_ms.
  gate.Add(std::string(kNode) + "Drain", Rule<pb::DrainRequest>([o](AuthCall& call, pb::DrainRequest& req) {
             if (Verdict v = Peer(o, call); !v.status.ok()) return v;
             // This node's own certificate may drain this node; anything else needs the operator.
             const bool this_node = !req.all() && (req.node_id().empty() || req.node_id() == o.node_id);
             if (Verdict v = DrainOperator(o, call, req, this_node ? o.node_id : std::string(), "NodeService.Drain"); !v.status.ok()) {
               return v;
             }
             if (Verdict v = ClampWait(req, o.limits, "Drain"); !v.status.ok()) return v;
             return Verdict::Ok();
           }));
  AddPeerOnly<pb::StatusRequest>(gate, kNode, "Status", o);
  // Commits and aborts change which versions a trainer may still publish (WorkerGuard); their
  // metrics are counted by the node in its commit / abort paths.
  gate.Add(std::string(kNode) + "CommitVersion", Rule<pb::CommitVersionRequest>([o, on_commit](AuthCall& call, pb::CommitVersionRequest& req) {
             if (Verdict v = CoordinatorOnly(o, call, "CommitVersion"); !v.status.ok()) return v;
             call.after = [on_commit, model = req.model_id(), version = req.version()](const grpc::Status& s, const void*) {
               if (s.ok() && on_commit) on_commit(model, version);
             };
             return Verdict::Ok();
           }));
  gate.Add(std::string(kNode) + "AbortVersion", Rule<pb::AbortVersionRequest>([o, on_abort](AuthCall& call, pb::AbortVersionRequest& req) {
             if (Verdict v = CoordinatorOnly(o, call, "AbortVersion"); !v.status.ok()) return v;
             if (on_abort) on_abort(req.model_id(), req.version());
             return Verdict::Ok();
           }));
}

// ------------------------------------------------------------------------------ WorkerService
WorkerGuard::WorkerGuard(const PeerCredListener* peers, Limits limits, std::string node_id)
    : peers_(peers),
      limits_(limits),
      node_id_(std::move(node_id)),
      blocked_(absl::StrCat("node ", node_id_, ": WorkerService waiting calls (WaitVersion, Publish, Apply, BeginUpdate)"),
               limits.max_blocked_calls, limits.max_blocked_calls_per_worker, "per worker, --max_blocked_calls_per_worker") {}

absl::StatusOr<PeerCred> WorkerGuard::Caller(const AuthCall& call) const { return peers_->Lookup(*call.ctx); }

namespace {
// The same process: pid and start time (a pid alone may have been reused).
bool SameProcess(const PeerCred& a, const PeerCred& b) { return a.pid == b.pid && a.start_time == b.start_time; }

// Whether `c`'s process is known to have exited: its pid's start time now differs, or /proc has no
// such pid. A process whose start time was never known (0: the daemon cannot see the worker's pid
// namespace - a container without hostPID - or /proc could not be read) is never taken for gone,
// nor is one whose /proc entry cannot be read now (out of descriptors): its binding stays.
bool ProcessExited(const PeerCred& c) {
  if (c.start_time == 0) return false;
  if (const uint64_t now = ProcessStartTime(c.pid); now != 0) return now != c.start_time;
  struct stat st;
  return ::stat(absl::StrCat("/proc/", c.pid).c_str(), &st) != 0 && errno == ENOENT;
}

// Said when a worker's binding is still held by a process that has exited (bindings of exited
// processes are swept only now and then): the caller can take the id over by registering it.
std::string OwnerGone(const PeerCred& owner) {
  return ProcessExited(owner) ? ", which has exited (RegisterWorker takes the id over)" : "";
}
}  // namespace

absl::Status WorkerGuard::CheckActsAs(const AuthCall& call, const std::string& model, const std::string& worker) {
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return me.status();
  PeerCred owner;
  {
    absl::MutexLock l(&mu_);
    auto it = bindings_.find({model, worker});
    if (it == bindings_.end()) {
      return absl::NotFoundError(absl::StrCat("worker ", worker, " of model '", model, "' is not registered on node ", node_id_,
                                              " (register again)"));
    }
    if (it->second.cred.pid == me->pid && it->second.cred.start_time == me->start_time) return absl::OkStatus();
    owner = it->second.cred;
  }
  return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " of model '", model, "' belongs to process ", owner.pid,
                                                  OwnerGone(owner), ", not to the caller (pid ", me->pid, ")"));
}

// Keyed by the worker and its process (pid + start time): a restarted worker does not inherit the
// slots its dead predecessor's calls still hold.
Verdict WorkerGuard::TakeSlot(AuthCall& call, const PeerCred& me, const std::string& model, const std::string& worker) {
  // An empty `worker`: a WaitVersion naming none of the caller's workers, counted for its process.
  absl::StatusOr<BlockedCalls::Slot> slot =
      blocked_.Acquire(absl::StrCat(me.pid, "/", me.start_time, "/", model.size(), ":", model, "/", worker),
                       worker.empty() ? absl::StrCat("process ", me.pid, " (WaitVersion naming none of its workers of model '", model, "')")
                                      : absl::StrCat("worker ", worker, " of model '", model, "' (pid ", me.pid, ")"));
  if (!slot.ok()) return Refuse(slot.status(), "blocked_calls");
  call.slot.emplace(std::move(*slot));
  return Verdict::Ok();
}

Verdict WorkerGuard::Waiting(AuthCall& call, const std::string& model, const std::string& worker) {
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return Refuse(me.status(), "unauthenticated");
  return TakeSlot(call, *me, model, worker);
}

// Before (fortieth session on), these calls held over a coordinator outage took no slot: one
// process's held registrations took every thread of the worker socket's quota, and every other
// worker's calls (Status, Apply, WaitVersion) were answered "Server Threadpool Exhausted".
Verdict WorkerGuard::Registering(AuthCall& call, const std::string& model, const std::string& worker) {
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return Refuse(me.status(), "unauthenticated");
  return TakeSlot(call, *me, model, absl::StrCat(worker, " (registration calls)"));
}

absl::Status WorkerGuard::CheckBound(const PeerCred& sender, const std::string& model, const std::string& worker) {
  PeerCred owner;
  {
    absl::MutexLock l(&mu_);
    auto it = bindings_.find({model, worker});
    if (it == bindings_.end()) {
      return absl::NotFoundError(absl::StrCat("worker ", worker, " of model '", model, "' is not registered on node ", node_id_,
                                              " (RegisterWorker first)"));
    }
    const PeerCred& c = it->second.cred;
    if (c.pid == sender.pid && c.start_time == sender.start_time && c.uid == sender.uid) return absl::OkStatus();
    owner = c;
  }
  return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " of model '", model, "' belongs to process ", owner.pid, " (uid ",
                                                  owner.uid, ")", OwnerGone(owner), ", not to the sender"));
}

absl::StatusOr<PeerCred> WorkerGuard::BoundCred(const std::string& model, const std::string& worker) {
  absl::MutexLock l(&mu_);
  auto it = bindings_.find({model, worker});
  if (it != bindings_.end()) return it->second.cred;
  return absl::NotFoundError(absl::StrCat("worker ", worker, " of model ", model, " is not registered on node ", node_id_));
}

void WorkerGuard::NoteCommitted(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  uint64_t& c = committed_[model];
  c = std::max(c, version);
}

void WorkerGuard::NoteAborted(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  for (auto& [id, b] : bindings_) {
    if (b.model == model) b.pending.erase(version);
  }
}

Verdict WorkerGuard::RegisterWorker(AuthCall& call, pb::RegisterWorkerRequest& req) {
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return Refuse(me.status(), "unauthenticated");
  for (auto [what, id] : {std::pair{"model_id", &req.model_id()}, std::pair{"worker_id", &req.worker_id()}}) {
    if (absl::Status s = CheckId(what, *id, limits_); !s.ok()) return Refuse(s, "limit");
  }
  if (Verdict v = Registering(call, req.model_id(), req.worker_id()); !v.status.ok()) return v;
  if (req.has_model()) {
    if (absl::Status s = CheckModelSpec(req.model(), limits_); !s.ok()) return Refuse(s, "limit");
  }
  // The binding this call replaced when it claimed the id (from nobody or from a process that has
  // exited), and its claim number; unset when the caller's own process held it already.
  std::optional<std::optional<Binding>> replaced;
  uint64_t claim = 0;
  const std::pair<std::string, std::string> key{req.model_id(), req.worker_id()};
  std::optional<PeerCred> owner;
  {
    absl::MutexLock l(&mu_);
    // Worker ids are scoped per model: only the same (model, worker) can be held by someone else.
    auto it = bindings_.find(key);
    if (it != bindings_.end() && !SameProcess(it->second.cred, *me)) owner = it->second.cred;
  }
  // A restarted worker takes its id over from its dead predecessor; a live owner keeps it. (/proc
  // is read without the lock; the claim below checks that the owner did not change meanwhile.)
  if (owner.has_value() && !ProcessExited(*owner)) {
    return Refuse(absl::PermissionDeniedError(absl::StrCat("worker ", req.worker_id(), " of model '", req.model_id(), "' on node ",
                                                           node_id_, " is held by live process ", owner->pid, ", not the caller (pid ",
                                                           me->pid, ")")),
                  "impersonation");
  }
  {
    absl::MutexLock l(&mu_);
    auto it = bindings_.find(key);
    const bool mine = it != bindings_.end() && SameProcess(it->second.cred, *me);
    if (!mine) {
      // Claimed now, not once the registration has succeeded: two live processes registering one
      // id at the same time both passed the check above and both got OK (the later binding won).
      if (it != bindings_.end() && !(owner.has_value() && SameProcess(it->second.cred, *owner))) {
        // Someone claimed it since the check: a live process (or one that exited since) - refused.
        return Refuse(absl::PermissionDeniedError(absl::StrCat("worker ", req.worker_id(), " of model '", req.model_id(), "' on node ",
                                                               node_id_, " was just claimed by process ", it->second.cred.pid,
                                                               ", not the caller (pid ", me->pid, ")")),
                      "impersonation");
      }
      replaced.emplace(it == bindings_.end() ? std::nullopt : std::optional<Binding>(it->second));
      claim = ++claims_;
      Binding b{*me, req.model_id()};
      b.claim = claim;
      bindings_[key] = std::move(b);
    }
  }
  // The node daemon watches the worker's process (kill -9 detection). A worker that names no pid
  // is watched through the kernel's word for it (SO_PEERCRED); one that names another (a launcher
  // registering for its engine process) keeps its choice - it can only get itself dropped.
  if (req.pid() <= 0) req.set_pid(static_cast<int32_t>(me->pid));
  if (me->pid == 0) {
    // The kernel reports pid 0 for a peer outside this daemon's pid namespace (a container without
    // hostPID / shareProcessNamespace): its workers cannot be told apart nor watched.
    Log(LogLevel::kWarning, "worker process not visible in this daemon's pid namespace",
        {{"node", node_id_}, {"model", req.model_id()}, {"worker", req.worker_id()},
         {"effect", "processes not told apart, a killed worker not noticed"},
         {"fix", "run the daemon with hostPID: true (DaemonSet) or shareProcessNamespace: true (sidecar)"}});
  }
  call.after = [this, cred = *me, key, replaced, claim](const grpc::Status& s, const void*) {
    if (!s.ok()) {
      // A failed registration gives its own claim back (to the exited process it was taken from, or
      // to nobody); a binding another call of this process made or kept meanwhile stays.
      absl::MutexLock l(&mu_);
      auto it = bindings_.find(key);
      if (replaced.has_value() && it != bindings_.end() && it->second.claim == claim) {
        if (replaced->has_value()) {
          it->second = **replaced;
        } else {
          bindings_.erase(it);
        }
      }
      return;
    }
    {
      absl::MutexLock l(&mu_);
      auto it = bindings_.find(key);
      if (it == bindings_.end()) {
        // Given up meanwhile (a Deregister of this process): the registration that succeeded binds it.
        Binding b{cred, key.first};
        b.claim = ++claims_;
        bindings_.emplace(key, std::move(b));
      } else if (SameProcess(it->second.cred, cred) && it->second.model == key.first) {
        // Confirmed by a registration that succeeded: a failing call of this process that claimed
        // it (two at once) no longer gives it back.
        it->second.claim = ++claims_;
      } else {
        // Another process holds it now (its claim came after a Deregister of ours): that one keeps
        // it; calls of this process naming the worker are refused from now on.
        Log(LogLevel::kWarning, "worker id taken over during its registration",
            {{"node", node_id_}, {"model", key.first}, {"worker", key.second}, {"registered_by", cred.pid}, {"held_by", it->second.cred.pid}});
      }
      // The same process registering again (a client's replay after a reconnect; the node keeps the
      // worker as it was) keeps its binding, with the versions it published and that are pending.
      if (bindings_.size() <= sweep_at_) return;
    }
    SweepExitedBindings();
  };
  return Verdict::Ok();
}

void WorkerGuard::SweepExitedBindings() {
  std::vector<std::pair<std::pair<std::string, std::string>, PeerCred>> held;
  {
    absl::MutexLock l(&mu_);
    held.reserve(bindings_.size());
    for (const auto& [key, b] : bindings_) held.emplace_back(key, b.cred);
  }
  // /proc is read without the lock; a binding that changed hands meanwhile is kept.
  std::erase_if(held, [](const auto& h) { return !ProcessExited(h.second); });
  absl::MutexLock l(&mu_);
  for (const auto& [key, cred] : held) {
    auto it = bindings_.find(key);
    if (it != bindings_.end() && SameProcess(it->second.cred, cred)) bindings_.erase(it);
  }
  sweep_at_ = std::max(kMinBindingSweep, 2 * bindings_.size());
}

Verdict WorkerGuard::RegisterLayout(AuthCall& call, const pb::RegisterLayoutRequest& req) {
  if (absl::Status s = CheckActsAs(call, req.model_id(), req.worker_id()); !s.ok()) return Refuse(s, "impersonation");
  if (Verdict v = Registering(call, req.model_id(), req.worker_id()); !v.status.ok()) return v;
  if (absl::Status s = CheckLayoutRequest(req.buffers(), req.layout(), limits_); !s.ok()) {
    return Refuse(absl::Status(s.code(), absl::StrCat("worker ", req.worker_id(), ": ", s.message())), "limit");
  }
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return Refuse(me.status(), "unauthenticated");
  // Memory must belong to the caller's uid: fstat of the opened descriptor (no TOCTOU on names).
  for (const pb::BufferSpec& b : req.buffers()) {
    if (b.memory_case() != pb::BufferSpec::kShmName) continue;  // CUDA IPC: the handle is the capability
    const std::string& name = b.shm_name();
    if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 255) {
      return Refuse(absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": bad shm name '", name, "'")), "invalid");
    }
    // O_NONBLOCK: a FIFO named as a segment would block this open until a writer came.
    int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0) {
      return Refuse(absl::NotFoundError(absl::StrCat("buffer ", b.buffer_id(), ": cannot open shm ", name, ": ", std::strerror(errno))),
                    "invalid");
    }
    struct stat st {};
    int rc = ::fstat(fd, &st);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return Refuse(absl::InternalError(absl::StrCat("fstat shm ", name, ": ", std::strerror(err))), "invalid");
    if (!S_ISREG(st.st_mode)) {
      return Refuse(absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": shm ", name, " is not a regular file (",
                                                            S_ISFIFO(st.st_mode) ? "a FIFO" : "not shared memory", ")")),
                    "invalid");
    }
    if (st.st_uid != me->uid) {
      return Refuse(absl::PermissionDeniedError(absl::StrCat("buffer ", b.buffer_id(), ": shm ", name, " is owned by uid ", st.st_uid,
                                                             ", not by the caller's uid ", me->uid)),
                    "foreign_memory");
    }
    if (static_cast<uint64_t>(st.st_size) < b.size_bytes()) {
      return Refuse(absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": shm ", name, " has ", st.st_size,
                                                            " bytes, fewer than size_bytes ", b.size_bytes())),
                    "invalid");
    }
  }
  return Verdict::Ok();
}

Verdict WorkerGuard::Publish(AuthCall& call, pb::PublishRequest& req) {
  if (absl::Status s = CheckActsAs(call, req.model_id(), req.worker_id()); !s.ok()) return Refuse(s, "impersonation");
  // Publish waits (snapshot, plan, staleness bound, a sync commit): a blocked call like WaitVersion.
  if (Verdict v = ClampWait(req, limits_, "Publish"); !v.status.ok()) return v;
  if (Verdict v = Waiting(call, req.model_id(), req.worker_id()); !v.status.ok()) return v;
  {
    // Concurrent versions: each one pins a snapshot of this trainer and staging on every node.
    absl::MutexLock l(&mu_);
    // Looked up again: the binding may have gone since CheckActsAs released mu_ (a Deregister in between).
    auto bound = bindings_.find({req.model_id(), req.worker_id()});
    if (bound == bindings_.end()) {
      return Refuse(absl::NotFoundError(absl::StrCat("worker ", req.worker_id(), " was deregistered on node ", node_id_,
                                                     " while it published version ", req.version(), " (register again)")),
                    "impersonation");
    }
    Binding& b = bound->second;
    const uint64_t committed = committed_[req.model_id()];
    for (auto it = b.pending.begin(); it != b.pending.end() && *it <= committed;) it = b.pending.erase(it);
    if (!b.pending.count(req.version()) && static_cast<int>(b.pending.size()) >= limits_.max_concurrent_versions) {
      return Refuse(absl::ResourceExhaustedError(absl::StrCat("worker ", req.worker_id(), " has ", b.pending.size(),
                                                              " versions published and not yet committed (limit ",
                                                              limits_.max_concurrent_versions, "); wait for one")),
                    "limit");
    }
    b.pending.insert(req.version());
  }
  call.after = [this, key = std::pair{req.model_id(), req.worker_id()}, version = req.version()](const grpc::Status& s, const void*) {
    if (s.ok()) return;
    absl::MutexLock l(&mu_);
    auto it = bindings_.find(key);
    if (it != bindings_.end()) it->second.pending.erase(version);
  };
  return Verdict::Ok();
}

Verdict WorkerGuard::WaitVersion(AuthCall& call, pb::WaitVersionRequest& req) {
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return Refuse(me.status(), "unauthenticated");
  // Counted against the worker it names when that worker is the caller's own; else (no worker
  // named, or one not registered here) against the caller's process: naming an id cannot use up
  // another worker's slots.
  std::string counted_as;
  std::optional<PeerCred> owner;  // of the named worker, when that is another process
  {
    absl::MutexLock l(&mu_);
    bool member = false;
    for (auto& [id, b] : bindings_) member |= b.cred.pid == me->pid && b.model == req.model_id();
    if (!member) {
      return Refuse(absl::PermissionDeniedError(absl::StrCat("the caller (pid ", me->pid, ") has no worker of model '", req.model_id(),
                                                             "' on node ", node_id_)),
                    "impersonation");
    }
    auto named = bindings_.find({req.model_id(), req.worker_id()});
    if (named != bindings_.end()) {
      if (named->second.cred.pid == me->pid && named->second.cred.start_time == me->start_time) {
        counted_as = req.worker_id();
      } else {
        owner = named->second.cred;
      }
    }
  }
  // The worker id is the caller's: for a rollout the node acts on it (a paused sync rollout
  // waiting for a version it holds is resumed and reported resumed to the coordinator; a committed
  // copy newer than its live weights is copied into them). Another process's worker is not the
  // caller's to resume or to write: its engine may be reading those weights.
  if (owner.has_value()) {
    return Refuse(absl::PermissionDeniedError(absl::StrCat(
                      "WaitVersion names worker ", req.worker_id(), " of model '", req.model_id(), "', which belongs to process ",
                      owner->pid, OwnerGone(*owner), ", not to the caller (pid ", me->pid,
                      "): a worker waits as itself (its own worker_id; none: the cluster-wide commit only)")),
                  "impersonation");
  }
  if (Verdict v = ClampWait(req, limits_, "WaitVersion"); !v.status.ok()) return v;
  return TakeSlot(call, *me, req.model_id(), counted_as);
}

Verdict WorkerGuard::DescribeLayout(AuthCall& call, const pb::DescribeLayoutRequest& req) {
  // Computes from the request alone (no worker's memory involved), like Status: any caller
  // allowed onto the socket, within the limits a registration would have to meet.
  absl::StatusOr<PeerCred> me = Caller(call);
  if (!me.ok()) return Refuse(me.status(), "unauthenticated");
  if (absl::Status s = CheckId("model_id", req.model_id(), limits_); !s.ok()) return Refuse(s, "limit");
  if (req.has_model()) {
    if (absl::Status s = CheckModelSpec(req.model(), limits_); !s.ok()) return Refuse(s, "limit");
  }
  // No memory yet: the buffers are the ids the pieces name (a worker may have max_buffers_per_worker).
  google::protobuf::RepeatedPtrField<pb::BufferSpec> named;
  std::set<uint32_t> ids;
  for (const pb::Piece& p : req.layout().pieces().pieces()) {
    for (uint32_t id : {p.buffer_id(), p.scale_buffer_id()}) {
      if (ids.insert(id).second) {
        pb::BufferSpec* b = named.Add();
        b->set_buffer_id(id);
        b->set_size_bytes(1);
      }
    }
  }
  if (absl::Status s = CheckLayoutRequest(named, req.layout(), limits_); !s.ok()) return Refuse(s, "limit");
  return Verdict::Ok();
}

void WorkerGuard::AddRules(AuthGate& gate) {
  const std::string w = kWorker;
  // Calls a worker makes as itself: the caller must be the process bound to the worker it names.
  auto acts_as = [this](AuthCall& call, const std::string& model, const std::string& worker) {
    absl::Status s = CheckActsAs(call, model, worker);
    return s.ok() ? Verdict::Ok() : Refuse(std::move(s), "impersonation");
  };
  gate.Add(w + "RegisterWorker", Rule<pb::RegisterWorkerRequest>([this](AuthCall& c, pb::RegisterWorkerRequest& r) { return RegisterWorker(c, r); }));
  gate.Add(w + "RegisterLayout", Rule<pb::RegisterLayoutRequest>([this](AuthCall& c, pb::RegisterLayoutRequest& r) { return RegisterLayout(c, r); }));
  gate.Add(w + "Publish", Rule<pb::PublishRequest>([this](AuthCall& c, pb::PublishRequest& r) { return Publish(c, r); }));
  gate.Add(w + "WaitVersion", Rule<pb::WaitVersionRequest>([this](AuthCall& c, pb::WaitVersionRequest& r) { return WaitVersion(c, r); }));
  gate.Add(w + "DescribeLayout", Rule<pb::DescribeLayoutRequest>([this](AuthCall& c, pb::DescribeLayoutRequest& r) { return DescribeLayout(c, r); }));
  // BeginUpdate (held while the node re-joins) and Apply (waits for the version) block: a slot of
  // the worker's, within max_wait_ms.
  gate.Add(w + "BeginUpdate", Rule<pb::BeginUpdateRequest>([this, acts_as](AuthCall& c, pb::BeginUpdateRequest& r) {
             if (Verdict v = acts_as(c, r.model_id(), r.worker_id()); !v.status.ok()) return v;
             if (Verdict v = ClampWait(r, limits_, "BeginUpdate"); !v.status.ok()) return v;
             return Waiting(c, r.model_id(), r.worker_id());
           }));
  // EndUpdate may wait for a running commit copy into the worker's live weights: a waiting slot too.
  gate.Add(w + "EndUpdate", Rule<pb::EndUpdateRequest>([this, acts_as](AuthCall& c, pb::EndUpdateRequest& r) {
             if (Verdict v = acts_as(c, r.model_id(), r.worker_id()); !v.status.ok()) return v;
             if (Verdict v = ClampWait(r, limits_, "EndUpdate"); !v.status.ok()) return v;
             return Waiting(c, r.model_id(), r.worker_id());
           }));
  gate.Add(w + "Apply", Rule<pb::ApplyRequest>([this, acts_as](AuthCall& c, pb::ApplyRequest& r) {
             if (Verdict v = acts_as(c, r.model_id(), r.worker_id()); !v.status.ok()) return v;
             if (Verdict v = ClampWait(r, limits_, "Apply"); !v.status.ok()) return v;
             return Waiting(c, r.model_id(), r.worker_id());
           }));
  gate.Add(w + "Deregister", Rule<pb::DeregisterRequest>([this, acts_as](AuthCall& c, pb::DeregisterRequest& r) {
             Verdict v = acts_as(c, r.model_id(), r.worker_id());
             if (!v.status.ok()) return v;
             if (v = Registering(c, r.model_id(), r.worker_id()); !v.status.ok()) return v;
             c.after = [this, model = r.model_id(), worker = r.worker_id()](const grpc::Status&, const void*) {
               {
                 absl::MutexLock l(&mu_);
                 bindings_.erase({model, worker});
               }
               if (on_deregister_) on_deregister_(model, worker);
             };
             return v;
           }));
  // Anyone allowed onto the socket (mode 0660) may read status.
  gate.Add(w + "Status", Rule<pb::StatusRequest>([this](AuthCall& c, pb::StatusRequest&) {
             absl::StatusOr<PeerCred> me = Caller(c);
             return me.ok() ? Verdict::Ok() : Refuse(me.status(), "unauthenticated");
           }));
}

}  // namespace wb::daemon
