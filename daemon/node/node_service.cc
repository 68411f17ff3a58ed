#include "daemon/node/node_service.h"

#include <grpcpp/grpcpp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/convert.h"
#include "daemon/layout_discovery.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/nccl_route.h"
#include "daemon/node/deadlines.h"
#include "daemon/node_daemon.h"
#include "planner/box.h"
#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/quantized.h"
#include "proto/grpc_status.h"
#include "base/status_macros.h"

namespace wb::daemon {

// ------------------------------------------------------------------------------- NodeService
class NodeDaemon::NodeImpl final : public pb::NodeService::Service {
 public:
  explicit NodeImpl(NodeDaemon* d) : d_(d) {}

  grpc::Status InstallPlan(grpc::ServerContext*, const pb::InstallPlanRequest* req, pb::InstallPlanResponse*) override {
    auto plan = std::make_shared<ModelPlan>();
    plan->slice = req->slice();
    auto inv = InventoryFromProto(plan->slice.tensors());
    if (!inv.ok()) return ToGrpcStatus(inv.status());
    plan->inventory = std::move(*inv);
    for (const pb::PlanWorker& w : plan->slice.workers()) {
      planner::WorkerLayout layout;
      if (w.has_layout()) {
        auto l = LayoutFromProto(w.layout(), plan->inventory);
        if (!l.ok()) return ToGrpcStatus(Annotate(l.status(), absl::StrCat("worker ", w.worker_id())));
        layout = std::move(*l);
      }
      plan->quantized.push_back(planner::HasQuantizedPieces(layout));
      plan->layouts.push_back(planner::StagingLayout(plan->inventory, layout));
      plan->live_layouts.push_back(std::move(layout));
    }
    const std::string& me = d_->options_.node_id;
    for (const pb::TransferOp& op : plan->slice.ops()) {
      if (op.src_worker() >= static_cast<uint32_t>(plan->slice.workers_size()) ||
          op.dst_worker() >= static_cast<uint32_t>(plan->slice.workers_size()) || op.bucket() >= plan->slice.num_buckets()) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("op ", op.index(), " refers outside the slice")));
      }
      for (bool src : {true, false}) {
        const uint32_t w = src ? op.src_worker() : op.dst_worker();
        const int32_t piece = src ? op.src_piece() : op.dst_piece();
        if (piece >= 0 && piece >= static_cast<int32_t>(plan->layouts[w].pieces.size())) {
          return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("op ", op.index(), ": piece ", piece, " of worker ",
                                                                      plan->slice.workers(w).worker_id(), " is not in the slice")));
        }
        if (piece < 0 && plan->slice.workers(w).node_id() == me) plan->hosts_gather = true;
      }
    }
    Log(LogLevel::kDebug, "plan installed", {{"node", me}, {"model", plan->slice.model_id()}, {"epoch", plan->slice.plan_epoch()},
                                              {"ops", plan->slice.ops_size()}});
    absl::MutexLock l(&d_->mu_);
    // A catch-up slice (docs/daemon.md "Catch-up") never replaces the model's plan.
    (plan->slice.catch_up() ? d_->catch_up_plans_ : d_->plans_)[plan->slice.model_id()] = std::move(plan);
    return grpc::Status::OK;
  }

  grpc::Status ExecuteVersion(grpc::ServerContext*, const pb::ExecuteVersionRequest* req, pb::ExecuteVersionResponse*) override {
    // Declared before the lock so finished executors are joined after it is released.
    std::vector<std::thread> finished;
    absl::Cleanup join_finished = [&finished] {
      for (auto& t : finished) t.join();
    };
    absl::MutexLock l(&d_->mu_);
    finished = d_->TakeFinishedExecThreadsLocked();
    auto exec = d_->GetExecLocked(req->model_id(), req->version(), req->plan_epoch());
    if (!exec.ok()) return ToGrpcStatus(exec.status());
    if ((*exec)->started) return grpc::Status::OK;
    (*exec)->started = true;
    (*exec)->coordinator_instance = req->coordinator_instance();
    (*exec)->deadline = absl::Now() + absl::Milliseconds(req->timeout_ms() > 0 ? req->timeout_ms() : 60000);
    // Answers at once: staging is allocated and every copy runs on the executor thread.
    // Snapshots older than this version can never be sent any more (superseded).
    for (auto& [id, w] : d_->workers_) {
      if (w.model_id != req->model_id()) continue;
      for (auto it = w.snapshots.begin(); it != w.snapshots.end();) {
        it = it->first < req->version() ? w.snapshots.erase(it) : std::next(it);
      }
    }
    std::shared_ptr<Exec> e = *exec;
    const uint64_t tid = d_->next_exec_thread_++;
    d_->exec_threads_.emplace(tid, std::thread([this, e, tid] {
                                d_->RunExec(e);
                                d_->MarkExecThreadDone(tid);
                              }));
    return grpc::Status::OK;
  }

  grpc::Status CommitVersion(grpc::ServerContext*, const pb::CommitVersionRequest* req, pb::CommitVersionResponse*) override {
    // The commit is counted while mu_ is held, before anyone can see the version committed here
    // (Apply, then a metrics scrape, must find its counts): async rollouts see it once the first
    // block below releases mu_, sync ones once their live copies are done (second block).
    const absl::Time commit_start = absl::Now();
    auto count_commit = [&] {
      DaemonMetrics& m = d_->metrics();
      m.Phase(d_->options_.node_id, "commit", absl::ToDoubleSeconds(absl::Now() - commit_start));
      m.Version(d_->options_.node_id, req->model_id(), "committed");
      m.Committed(d_->options_.node_id, req->model_id(), req->version());
    };
    // What the sync live copy needs is captured under the lock by value (worker id, buffers,
    // layout): a concurrent Deregister may erase the LocalWorker meanwhile.
    std::vector<LiveJob> jobs;
    std::shared_ptr<Exec> exec;
    const std::string& me = d_->options_.node_id;
    {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->execs_.find({req->model_id(), req->version()});
      if (it == d_->execs_.end()) {
        // Idempotent for a retried commit; a node that lost the version's staging (restart)
        // cannot apply it: its waiters see the version aborted, nothing is half-applied.
        if (req->version() <= d_->committed_[req->model_id()]) return grpc::Status::OK;
        std::string reason = absl::StrCat("node ", me, " no longer holds the staging of version ", req->version(),
                                          " (restarted before the commit)");
        d_->aborted_[{req->model_id(), req->version()}] = reason;
        return ToGrpcStatus(absl::FailedPreconditionError(reason));
      }
      exec = it->second;
      if (!exec->transferred) {
        // Committing bytes that have not all arrived would hand rollouts a half-written version.
        const std::string missing =
            exec->failed ? absl::StrCat("its transfer failed here (", exec->error, ")")
            : !exec->started
                ? std::string("its transfer has not started here (no ExecuteVersion)")
                : absl::StrCat("its transfer is still running here (", exec->bytes_done.load(), " bytes received so far; not reported done)");
        return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("cannot commit model ", req->model_id(), " version ", req->version(),
                                                                       " on node ", me, ": the version has not fully landed: ", missing)));
      }
      d_->execs_.erase(it);
      for (auto& [wid, staging] : exec->incoming) {
        auto w = d_->workers_.find({req->model_id(), wid});
        if (w == d_->workers_.end()) continue;
        // Relays at commit: this staging lacks the relayed pieces, so it must never be applied
        // later (Apply finds no committed staging; the commit below writes the live weights).
        auto relayed = exec->pieces_at_commit.find(wid);
        w->second.committed = relayed == exec->pieces_at_commit.end() ? staging : nullptr;
        w->second.committed_version = req->version();
        if (w->second.mode != pb::MODE_SYNC) continue;
        LiveJob t;
        t.model = req->model_id();
        t.worker = wid;
        t.version = req->version();
        t.staging = staging;
        t.live = LiveBuffers{w->second.buffers, w->second.cuda};
        t.plan = exec->plan;
        t.label = absl::StrCat("commit ", wid, " v", req->version());
        for (int i = 0; i < exec->plan->slice.workers_size(); ++i) {
          if (exec->plan->slice.workers(i).worker_id() == wid) t.layout = exec->plan->live_layouts[i];
        }
        if (relayed != exec->pieces_at_commit.end()) {
          std::vector<planner::Piece> own;
          for (size_t k = 0; k < t.layout.pieces.size(); ++k) {
            if (relayed->second.count(static_cast<int32_t>(k)) == 0) own.push_back(t.layout.pieces[k]);
          }
          t.layout.pieces = std::move(own);
          t.relays = &exec->relays_at_commit[wid];
          t.incoming = &exec->incoming;
        }
        jobs.push_back(std::move(t));
      }
      for (auto& [id, w] : d_->workers_) {
        if (w.model_id == req->model_id()) w.snapshots.erase(req->version());
      }
      if (jobs.empty()) count_commit();  // nothing left that can fail
    }
    // Sync: rollouts are paused; the commit writes their live weights before anyone is told.
    // All rollouts at once (their batches share the copy threads, so none waits for another's tail).
    const absl::Time copy_start = absl::Now();
    std::vector<absl::Status> copied = d_->RunLiveCopies(jobs);
    absl::MutexLock l(&d_->mu_);
    absl::Status failed;
    for (size_t i = 0; i < jobs.size(); ++i) {
      auto w = d_->workers_.find({jobs[i].model, jobs[i].worker});
      if (!copied[i].ok()) {
        Log(LogLevel::kError, "sync commit copy failed", {{"node", me}, {"worker", jobs[i].worker}, {"error", copied[i].message()}});
        const std::string what = absl::StrCat("commit of model ", req->model_id(), " version ", req->version(), " on node ", me,
                                              ": live copy into rollout ", jobs[i].worker, " failed: ", copied[i].message());
        failed = failed.ok() ? absl::Status(copied[i].code(), what) : absl::Status(failed.code(), absl::StrCat(failed.message(), "; ", what));
        continue;
      }
      if (w == d_->workers_.end()) continue;
      w->second.applied_version = std::max(w->second.applied_version, req->version());
      // Live weights hold it now and nothing reads this staging again (Apply finds nothing newer):
      // its memory goes back to the pool for the next version instead of sitting here.
      if (w->second.committed == jobs[i].staging) w->second.committed = nullptr;
    }
    if (!failed.ok()) {
      // Not committed on this node: the version stays here so that a retried CommitVersion copies
      // again (restoring whole weights); Apply of a torn rollout copies from its committed staging.
      d_->execs_.emplace(std::pair{req->model_id(), req->version()}, exec);
      return ToGrpcStatus(failed);
    }
    // Versions of this model whose commit failed here earlier are superseded now.
    for (auto it = d_->execs_.begin(); it != d_->execs_.end();) {
      const bool stale = it->first.first == req->model_id() && it->first.second < req->version() && it->second->transferred;
      it = stale ? d_->execs_.erase(it) : std::next(it);
    }
    if (exec->relay_bytes_at_commit > 0) {
      transport::Transport* host_t = d_->options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, false);
      if (host_t != nullptr) d_->metrics().Bytes(me, req->model_id(), host_t->capabilities().kind, me, exec->relay_bytes_at_commit);
      d_->metrics().RelayAtCommit(me, exec->relay_bytes_at_commit);
    }
    if (!jobs.empty()) count_commit();
    // Published last: node-local waiters (Apply) see the version only once live weights hold it.
    d_->committed_[req->model_id()] = std::max(d_->committed_[req->model_id()], req->version());
    Log(LogLevel::kInfo, "version committed on node", {{"node", me}, {"model", req->model_id()}, {"version", req->version()},
                                                       {"live_copies", jobs.size()}, {"copy_s", absl::ToDoubleSeconds(absl::Now() - copy_start)}});
    return grpc::Status::OK;
  }

  grpc::Status AbortVersion(grpc::ServerContext*, const pb::AbortVersionRequest* req, pb::AbortVersionResponse*) override {
    d_->metrics().Version(d_->options_.node_id, req->model_id(), "aborted");
    d_->metrics().Failure(d_->options_.node_id, absl::AbortedError(req->reason()));
    std::map<std::string, transport::PeerId> connected;
    {
      absl::MutexLock l(&d_->mu_);
      d_->aborted_[{req->model_id(), req->version()}] = req->reason();
      auto it = d_->execs_.find({req->model_id(), req->version()});
      if (it != d_->execs_.end()) {
        it->second->aborted = true;
        it->second->error = req->reason();
        connected = it->second->connected;
        d_->execs_.erase(it);  // staging dropped with the last reference (the executor holds one until it stops)
      }
      for (auto& [id, w] : d_->workers_) {
        if (w.model_id == req->model_id()) w.snapshots.erase(req->version());
      }
    }
    // Blocked waits on the version's channels end now instead of at the transfer deadline.
    for (auto& [peer, id] : connected) d_->DropChannel(req->model_id(), peer, id);
    Log(LogLevel::kInfo, "version aborted on node", {{"node", d_->options_.node_id}, {"model", req->model_id()}, {"version", req->version()},
                                                     {"reason", req->reason()}});
    return grpc::Status::OK;
  }

  grpc::Status ExchangeRegions(grpc::ServerContext*, const pb::ExchangeRegionsRequest* req, pb::ExchangeRegionsResponse* resp) override {
    const std::string& mine = req->transport_kind();
    const std::string& theirs = req->from_transport().empty() ? mine : req->from_transport();
    transport::Transport* cross = d_->CrossTransport(mine);
    if (cross == nullptr) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("node ", d_->options_.node_id, " has no '", mine, "' transport",
                                                                     ParseNcclLaneName(mine) >= 0 ? " (nccl lane; needs --gpu_staging_bytes)" : "")));
    }
    absl::MutexLock l(&d_->mu_);
    auto e = d_->GetExecLocked(req->model_id(), req->version(), req->plan_epoch());
    if (!e.ok()) return ToGrpcStatus(e.status());
    std::shared_ptr<Exec> exec = *e;
    // Our regions exist once our executor registered them (ExecuteVersion may reach us later).
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(d_->mu_) { return exec->regions_ready || exec->aborted || exec->failed || d_->stopping_; };
    if (!d_->mu_.AwaitWithDeadline(absl::Condition(&ready), exec->deadline)) {
      return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat("node ", d_->options_.node_id, ": version ", req->version(), " did not start in time")));
    }
    if (!exec->regions_ready) return ToGrpcStatus(absl::AbortedError(absl::StrCat("version ", req->version(), " aborted: ", exec->error)));
    std::string from_instance;
    for (const pb::PlanWorker& w : exec->plan->slice.workers()) {
      if (w.node_id() == req->from_node()) {
        auto it = w.transport_instances().find(theirs);
        if (it != w.transport_instances().end()) from_instance = it->second;
      }
    }
    const std::string chan = ChannelName(req->from_node(), mine, theirs);
    const std::optional<node::ChannelCache::Entry> c = d_->channels_.Find(req->model_id(), chan);
    const bool reuse = req->reuse() && c.has_value() && c->peer_instance == from_instance;
    auto endpoint = cross->ExportEndpoint(from_instance);
    if (!endpoint.ok()) return ToGrpcStatus(endpoint.status());
    PeerState& ps = exec->peers[chan];
    ps.have = true;
    ps.reuse = reuse;
    ps.endpoint = req->endpoint();
    for (const pb::PeerRegion& r : req->regions()) ps.regions[r.key()] = r.region_descriptor();
    resp->set_reuse(reuse);
    resp->set_endpoint(*endpoint);
    for (auto& [k, d] : exec->local_desc[mine]) {
      pb::PeerRegion* r = resp->add_regions();
      r->set_key(k);
      r->set_region_descriptor(d);
    }
    return grpc::Status::OK;
  }

  grpc::Status DropWorker(grpc::ServerContext*, const pb::DropWorkerRequest* req, pb::DropWorkerResponse*) override {
    absl::MutexLock l(&d_->mu_);
    d_->workers_.erase({req->model_id(), req->worker_id()});
    d_->live_.Forget(NodeDaemon::LiveKey(req->model_id(), req->worker_id()));
    return grpc::Status::OK;
  }

  grpc::Status SetupDataChannel(grpc::ServerContext*, const pb::SetupDataChannelRequest*, pb::SetupDataChannelResponse* resp) override {
    resp->set_endpoint(d_->data_address_);  // data planes are set up per version by ExchangeRegions
    return grpc::Status::OK;
  }

  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest* req, pb::DrainResponse* resp) override {
    pb::DrainRequest r = *req;
    if (r.node_id().empty()) r.set_node_id(d_->options_.node_id);
    return ToGrpcStatus(d_->coordinator_client_->Drain(r, resp, CallTimeout(Deadline(req->timeout_ms()))));
  }

  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest* req, pb::StatusResponse* resp) override {
    grpc::Status s = ToGrpcStatus(d_->coordinator_client_->ClusterStatus(*req, resp, CallTimeout(absl::Now() + absl::Seconds(5))));
    resp->set_role("node");
    resp->set_node_id(d_->options_.node_id);
    d_->AddLiveState(resp);
    return s;
  }

 private:
  NodeDaemon* d_;
};

std::unique_ptr<pb::NodeService::Service> NodeDaemon::MakeNodeService(NodeDaemon* d) { return std::make_unique<NodeImpl>(d); }

}  // namespace wb::daemon
