#pragma once
// The per-method access rules of the three services, as AuthGate rules (daemon/auth_gate.h): who
// may call each RPC, as whom, within which limits, and what is counted. docs/security.md says the
// same in prose.
//
//  - CoordinatorService / NodeService (TCP, other daemons): every call carries the token and, with
//    TLS, a verified client certificate (CheckPeer, UNAUTHENTICATED); calls a node makes about
//    itself name the node its certificate names (CheckNodeIdentity, PERMISSION_DENIED,
//    "impersonation"); calls carrying specs / layouts are checked against the limits; blocking
//    calls (WaitVersion, Publish, Drain, waiting ExchangeMagnitudes) hold a BlockedCalls slot,
//    at most a share per node (PeerKey), and their timeout_ms is clamped to Limits::max_wait_ms.
//  - WorkerService (Unix socket, local workers): WorkerGuard binds worker ids to the process that
//    registered them (SO_PEERCRED, PeerCredListener) and checks every later call against it,
//    shm ownership, limits and the versions a trainer may have in flight.
// Refusals are counted by the gate's owner (DaemonFront) in wb_rejected_total{what}.

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/auth.h"
#include "daemon/auth_gate.h"
#include "daemon/limits.h"

namespace wb::daemon {

struct PeerRuleOptions {
  std::shared_ptr<const PeerAuthConfig> config;  // required
  Limits limits;
  PeerAuthenticated on_authenticated;  // told every call that passed CheckPeer (ConnGuard); may be empty
  std::string node_id;                 // NodeService: this node (InstallPlan's slice check)
};

// CoordinatorService: CheckPeer on every call, CheckNodeIdentity on the node-scoped calls
// (RegisterNode, Heartbeat, JoinWorker, SubmitLayout, LeaveWorker, Publish, ReportReady,
// ReportDone, ReportApplied), limits on CreateModel / JoinWorker / SubmitLayout, WaitVersion,
// Publish and Drain bounded by limits.max_blocked_calls (BlockedCallsPerNode of them per node).
// Drain of the cluster, of another node or undoing such a drain needs the operator credential when
// one is configured (CheckOperator; a node's own certificate may drain itself), "operator".
void AddCoordinatorRules(AuthGate& gate, const PeerRuleOptions& options);

// NodeService: CheckPeer on every call. `on_commit` (after a CommitVersion succeeded, before its
// reply) and `on_abort` (before AbortVersion runs) are told (model, version); either may be empty.
using VersionHook = std::function<void(const std::string& model, uint64_t version)>;
void AddNodeRules(AuthGate& gate, const PeerRuleOptions& options, VersionHook on_commit, VersionHook on_abort);

// Worker identities on one node's worker socket, and the WorkerService rules that enforce them:
//  - RegisterWorker binds (model_id, worker_id) -> (pid, process start time, uid). Worker ids are
//    scoped per model: two models may each have a trainer/0, from one process or two. A (model,
//    worker) bound to another LIVE process is PERMISSION_DENIED naming both (a dead one's binding
//    is taken over: restarts).
//  - every other call naming a worker must come from the bound process and name its model;
//    WaitVersion needs some worker of the caller bound to that model;
//  - RegisterLayout: every shm segment must be owned by the caller's uid (fstat of the opened
//    descriptor) and be at least size_bytes large; request limits (daemon/limits.h) first. The
//    node checks the owner again on the descriptor it maps (WorkerCalls::Options::worker_uid).
//  - waiting calls (WaitVersion, Publish, Apply, BeginUpdate) hold a BlockedCalls slot, at most
//    max_blocked_calls_per_worker per worker, and wait at most max_wait_ms.
class WorkerGuard {
 public:
  // `peers` must outlive this; `node_id` names the node in errors.
  WorkerGuard(const PeerCredListener* peers, Limits limits, std::string node_id);
  // Adds the WorkerService rules to `gate` (which must not outlive this).
  void AddRules(AuthGate& gate);

  // Newest version committed on this node per model: published versions up to it stop counting
  // against max_concurrent_versions. NoteAborted frees an aborted version's slot.
  void NoteCommitted(const std::string& model, uint64_t version);
  void NoteAborted(const std::string& model, uint64_t version);
  // The fd channel (daemon/fd_channel.h): OK when `sender` is the live process bound to `worker`
  // (pid + start time) and the worker belongs to `model`; NOT_FOUND / PERMISSION_DENIED otherwise.
  absl::Status CheckBound(const PeerCred& sender, const std::string& model, const std::string& worker);
  // The process `worker` of `model` is bound to; NOT_FOUND if none.
  absl::StatusOr<PeerCred> BoundCred(const std::string& model, const std::string& worker);
  // Told the (model, worker) of every worker that deregistered (the fd channel releases its fds).
  // Set before serving.
  void set_on_deregister(std::function<void(const std::string& model, const std::string& worker)> f) { on_deregister_ = std::move(f); }
  // (model, worker) bindings held now: live workers, plus those of exited processes not yet swept.
  size_t bindings() {
    absl::MutexLock l(&mu_);
    return bindings_.size();
  }

 private:
  struct Binding {
    PeerCred cred;
    std::string model;
    std::set<uint64_t> pending;  // published by this worker, not yet committed or aborted
    // Which RegisterWorker call claimed it (claims_): a failed call gives back only its own claim,
    // and a call that succeeds finds out whether its claim still stands.
    uint64_t claim = 0;
  };
  absl::StatusOr<PeerCred> Caller(const AuthCall& call) const;
  // The caller is the process bound to `worker` and names its model.
  absl::Status CheckActsAs(const AuthCall& call, const std::string& model, const std::string& worker);
  Verdict RegisterWorker(AuthCall& call, ::weightbridge::v1::RegisterWorkerRequest& req);
  Verdict RegisterLayout(AuthCall& call, const ::weightbridge::v1::RegisterLayoutRequest& req);
  Verdict Publish(AuthCall& call, ::weightbridge::v1::PublishRequest& req);
  Verdict WaitVersion(AuthCall& call, ::weightbridge::v1::WaitVersionRequest& req);
  // A blocked-call slot for a waiting call of `worker` (of `model`) from process `me`: at most
  // max_blocked_calls_per_worker per worker, max_blocked_calls on this node.
  Verdict TakeSlot(AuthCall& call, const PeerCred& me, const std::string& model, const std::string& worker);
  // The same for the caller of `call`.
  Verdict Waiting(AuthCall& call, const std::string& model, const std::string& worker);
  // A slot for a RegisterWorker / RegisterLayout / Deregister of `worker`: the node holds them
  // while its coordinator is down (up to 60 s), each on a server thread, so they count against
  // max_blocked_calls too - with a per-worker share of their own, apart from its waiting calls.
  Verdict Registering(AuthCall& call, const std::string& model, const std::string& worker);
  Verdict DescribeLayout(AuthCall& call, const ::weightbridge::v1::DescribeLayoutRequest& req);
  // Drops the bindings of processes that have exited (a worker that never deregistered: the node
  // reaps the worker, nothing else erases its binding), once the table has doubled since the last
  // sweep, so workers of short-lived processes cannot grow it without bound.
  void SweepExitedBindings();

  const PeerCredListener* peers_;
  Limits limits_;
  std::string node_id_;
  absl::Mutex mu_;
  // Keyed by (model, worker): worker ids are scoped per model (issue 16.5).
  std::map<std::pair<std::string, std::string>, Binding> bindings_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> committed_ ABSL_GUARDED_BY(mu_);
  size_t sweep_at_ ABSL_GUARDED_BY(mu_) = kMinBindingSweep;
  uint64_t claims_ ABSL_GUARDED_BY(mu_) = 0;
  static constexpr size_t kMinBindingSweep = 64;
  std::function<void(const std::string&, const std::string&)> on_deregister_;
  BlockedCalls blocked_;
};

}  // namespace wb::daemon
