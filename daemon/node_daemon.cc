#include "daemon/node_daemon.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/box_copy.h"
#include "daemon/convert.h"
#include "planner/box.h"
#include "proto/grpc_status.h"
#include "tools/cc/status_macros.h"

namespace wb::daemon {
namespace {

absl::Time Deadline(int64_t timeout_ms) {
  return absl::Now() + (timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(60));
}

void SetDeadline(grpc::ClientContext* ctx, absl::Time deadline) {
  ctx->set_deadline(absl::ToChronoTime(deadline + absl::Seconds(2)));
}

}  // namespace

// ------------------------------------------------------------------------------- WorkerService
class NodeDaemon::WorkerImpl final : public pb::WorkerService::Service {
 public:
  explicit WorkerImpl(NodeDaemon* d) : d_(d) {}

  grpc::Status RegisterWorker(grpc::ServerContext*, const pb::RegisterWorkerRequest* req, pb::RegisterWorkerResponse* resp) override {
    pb::JoinWorkerRequest j;
    j.set_node_id(d_->options_.node_id);
    j.set_worker_id(req->worker_id());
    j.set_model_id(req->model_id());
    j.set_role(req->role());
    j.set_gpu(req->gpu());
    if (req->has_model()) *j.mutable_model() = req->model();
    pb::JoinWorkerResponse jr;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + absl::Seconds(10));
    grpc::Status s = d_->coordinator_->JoinWorker(&ctx, j, &jr);
    if (!s.ok()) return s;
    LocalWorker w;
    w.model_id = req->model_id();
    w.role = FromProto(req->role());
    w.gpu = req->gpu();
    w.mode = jr.mode();
    absl::MutexLock l(&d_->mu_);
    d_->workers_[req->worker_id()] = std::move(w);
    resp->set_session(absl::StrCat(d_->options_.node_id, "/", req->worker_id()));
    return grpc::Status::OK;
  }

  grpc::Status RegisterLayout(grpc::ServerContext*, const pb::RegisterLayoutRequest* req, pb::RegisterLayoutResponse* resp) override {
    {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->workers_.find(req->worker_id());
      if (it == d_->workers_.end() || it->second.model_id != req->model_id()) {
        return ToGrpcStatus(absl::NotFoundError(absl::StrCat("worker ", req->worker_id(), " is not registered on node ",
                                                             d_->options_.node_id, " (register again)")));
      }
    }
    if (req->layout().has_index_probe()) {
      return ToGrpcStatus(absl::UnimplementedError("index-probe layouts are not wired into the daemon yet"));
    }
    // Map every buffer first: a bad name fails the call and changes nothing.
    std::vector<std::shared_ptr<transport::ShmSegment>> buffers;
    for (const pb::BufferSpec& b : req->buffers()) {
      if (b.memory_case() != pb::BufferSpec::kShmName) {
        return ToGrpcStatus(absl::UnimplementedError(absl::StrCat("buffer ", b.buffer_id(),
                                                                  ": only shared-memory buffers are supported by this daemon (no cuda transport)")));
      }
      auto seg = transport::ShmSegment::Open(b.shm_name(), static_cast<int64_t>(b.size_bytes()));
      if (!seg.ok()) return ToGrpcStatus(Annotate(seg.status(), absl::StrCat("buffer ", b.buffer_id())));
      absl::Status own = seg->CheckOwner(::getuid());
      if (!own.ok()) return ToGrpcStatus(Annotate(own, absl::StrCat("buffer ", b.buffer_id())));
      buffers.push_back(std::make_shared<transport::ShmSegment>(std::move(*seg)));
    }
    pb::SubmitLayoutRequest sreq;
    sreq.set_node_id(d_->options_.node_id);
    sreq.set_model_id(req->model_id());
    sreq.set_worker_id(req->worker_id());
    *sreq.mutable_buffers() = req->buffers();
    *sreq.mutable_layout() = req->layout();
    pb::SubmitLayoutResponse sresp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + absl::Seconds(30));
    grpc::Status s = d_->coordinator_->SubmitLayout(&ctx, sreq, &sresp);
    if (!s.ok()) return s;
    absl::MutexLock l(&d_->mu_);
    auto it = d_->workers_.find(req->worker_id());
    if (it == d_->workers_.end()) return ToGrpcStatus(absl::NotFoundError("worker deregistered concurrently"));
    uint64_t bytes = 0;
    for (const pb::BufferSpec& b : req->buffers()) bytes += b.size_bytes();
    it->second.buffers = std::move(buffers);
    it->second.has_layout = true;  // pieces live in the plan slice the coordinator installs
    resp->set_num_pieces(static_cast<uint32_t>(sresp.layout().pieces_size()));
    resp->set_bytes(bytes);
    return grpc::Status::OK;
  }

  grpc::Status Publish(grpc::ServerContext*, const pb::PublishRequest* req, pb::PublishResponse* resp) override {
    const absl::Time start = absl::Now();
    const absl::Time deadline = Deadline(req->timeout_ms());
    {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->workers_.find(req->worker_id());
      if (it == d_->workers_.end() || !it->second.has_layout) {
        return ToGrpcStatus(absl::NotFoundError(absl::StrCat("worker ", req->worker_id(), " has no layout on node ", d_->options_.node_id)));
      }
      LocalWorker& w = it->second;
      if (w.role != planner::Role::kTrainer) {
        return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat("worker ", req->worker_id(), " is not a trainer")));
      }
      if (w.mode != pb::MODE_SYNC) {
        // Snapshot: the trainer's only stall. Budget bounds snapshot + staging memory.
        int64_t total = 0, need = 0;
        for (auto& b : w.buffers) need += b->size();
        for (auto& [id, other] : d_->workers_) {
          for (auto& [v, snap] : other.snapshots) for (auto& b : *snap) total += static_cast<int64_t>(b.size());
        }
        if (total + need > d_->options_.staging_budget_bytes) {
          return ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat("staging budget of ", d_->options_.staging_budget_bytes,
                                                                        " bytes exceeded by the snapshot of version ", req->version())));
        }
        auto snap = std::make_shared<Bytes>();
        for (auto& b : w.buffers) {
          const uint8_t* p = static_cast<const uint8_t*>(b->data());
          snap->emplace_back(p, p + b->size());
        }
        w.snapshots[req->version()] = std::move(snap);
      }
    }
    pb::CoordPublishRequest c;
    c.set_node_id(d_->options_.node_id);
    c.set_model_id(req->model_id());
    c.set_worker_id(req->worker_id());
    c.set_version(req->version());
    c.set_timeout_ms(absl::ToInt64Milliseconds(deadline - absl::Now()));
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    grpc::Status s = d_->coordinator_->Publish(&ctx, c, resp);
    if (!s.ok()) {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->workers_.find(req->worker_id());
      if (it != d_->workers_.end()) it->second.snapshots.erase(req->version());
      return s;
    }
    resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    return grpc::Status::OK;
  }

  grpc::Status BeginUpdate(grpc::ServerContext*, const pb::BeginUpdateRequest* req, pb::BeginUpdateResponse* resp) override {
    pb::ReportReadyRequest r;
    r.set_node_id(d_->options_.node_id);
    r.set_model_id(req->model_id());
    r.set_worker_id(req->worker_id());
    pb::ReportReadyResponse rr;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, Deadline(req->timeout_ms()));
    grpc::Status s = d_->coordinator_->ReportReady(&ctx, r, &rr);
    resp->set_committed_version(rr.committed_version());
    return s;
  }

  grpc::Status Apply(grpc::ServerContext*, const pb::ApplyRequest* req, pb::ApplyResponse* resp) override {
    const absl::Time start = absl::Now();
    const absl::Time deadline = Deadline(req->timeout_ms());
    std::shared_ptr<Bytes> staging;
    std::vector<std::shared_ptr<transport::ShmSegment>> buffers;
    planner::WorkerLayout layout;
    std::shared_ptr<const ModelPlan> plan;
    uint64_t version = 0;
    {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->workers_.find(req->worker_id());
      if (it == d_->workers_.end() || it->second.role != planner::Role::kRollout) {
        return ToGrpcStatus(absl::NotFoundError(absl::StrCat("worker ", req->worker_id(), " is not a rollout worker on node ", d_->options_.node_id)));
      }
      const std::string model = req->model_id();
      const std::string wid = req->worker_id();
      const uint64_t want = req->version();
      auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(d_->mu_) {
        auto w = d_->workers_.find(wid);
        if (d_->stopping_ || w == d_->workers_.end()) return true;
        if (want == 0) return true;  // safe point: take whatever is newest, never wait
        return w->second.committed_version >= want || w->second.applied_version >= want ||
               d_->aborted_.count({model, want}) > 0;
      };
      if (!d_->mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
        return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat("version ", want, " not committed on node ",
                                                                     d_->options_.node_id, " in time")));
      }
      it = d_->workers_.find(wid);
      if (d_->stopping_ || it == d_->workers_.end()) return ToGrpcStatus(absl::UnavailableError("worker or daemon went away"));
      LocalWorker& w = it->second;
      if (want != 0 && w.committed_version < want && w.applied_version < want) {
        return ToGrpcStatus(absl::AbortedError(absl::StrCat("version ", want, " aborted: ", d_->aborted_.at({model, want}))));
      }
      if (w.committed_version <= w.applied_version || !w.committed) {
        resp->set_applied_version(w.applied_version);  // nothing newer (or sync: already live)
        resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
        return grpc::Status::OK;
      }
      staging = w.committed;
      buffers = w.buffers;
      version = w.committed_version;
      auto p = d_->plans_.find(model);
      if (p == d_->plans_.end()) return ToGrpcStatus(absl::FailedPreconditionError("no plan installed"));
      plan = p->second;
      for (int i = 0; i < plan->slice.workers_size(); ++i) {
        if (plan->slice.workers(i).worker_id() == wid) layout = plan->layouts[i];
      }
    }
    // The rollout's only stall: copy its pieces from committed staging into live weights.
    for (const planner::Piece& piece : layout.pieces) {
      int elem = planner::DTypeSize(plan->inventory.tensors[piece.tensor].dtype);
      CopyPiece((*staging)[piece.buffer].data(), piece, elem, static_cast<uint8_t*>(buffers[piece.buffer]->data()));
    }
    {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->workers_.find(req->worker_id());
      if (it != d_->workers_.end()) it->second.applied_version = std::max(it->second.applied_version, version);
    }
    pb::ReportAppliedRequest r;
    r.set_node_id(d_->options_.node_id);
    r.set_model_id(req->model_id());
    r.set_worker_id(req->worker_id());
    r.set_version(version);
    pb::ReportAppliedResponse rr;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + absl::Seconds(5));
    d_->coordinator_->ReportApplied(&ctx, r, &rr);
    resp->set_applied_version(version);
    resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    return grpc::Status::OK;
  }

  grpc::Status WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest* req, pb::WaitVersionResponse* resp) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, Deadline(req->timeout_ms()));
    return d_->coordinator_->WaitVersion(&ctx, *req, resp);
  }

  grpc::Status Deregister(grpc::ServerContext*, const pb::DeregisterRequest* req, pb::DeregisterResponse*) override {
    {
      absl::MutexLock l(&d_->mu_);
      d_->workers_.erase(req->worker_id());
    }
    pb::LeaveWorkerRequest r;
    r.set_node_id(d_->options_.node_id);
    r.set_model_id(req->model_id());
    r.set_worker_id(req->worker_id());
    r.set_reason("deregistered");
    pb::LeaveWorkerResponse rr;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + absl::Seconds(5));
    return d_->coordinator_->LeaveWorker(&ctx, r, &rr);
  }

  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest* req, pb::StatusResponse* resp) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + absl::Seconds(5));
    grpc::Status s = d_->coordinator_->ClusterStatus(&ctx, *req, resp);
    resp->set_role("node");
    resp->set_node_id(d_->options_.node_id);
    return s;
  }

 private:
  NodeDaemon* d_;
};

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
      if (w.node_id() == d_->options_.node_id) {
        auto l = LayoutFromProto(w.layout(), plan->inventory);
        if (!l.ok()) return ToGrpcStatus(Annotate(l.status(), absl::StrCat("worker ", w.worker_id())));
        layout = std::move(*l);
      }
      plan->layouts.push_back(std::move(layout));
    }
    plan->incoming_per_bucket.assign(plan->slice.num_buckets(), 0);
    for (const pb::TransferOp& op : plan->slice.ops()) {
      if (op.src_worker() >= static_cast<uint32_t>(plan->slice.workers_size()) ||
          op.dst_worker() >= static_cast<uint32_t>(plan->slice.workers_size()) || op.bucket() >= plan->slice.num_buckets()) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("op ", op.index(), " refers outside the slice")));
      }
      plan->ops_by_index[op.index()] = &op;
      bool dst_local = plan->slice.workers(op.dst_worker()).node_id() == d_->options_.node_id;
      bool src_local = plan->slice.workers(op.src_worker()).node_id() == d_->options_.node_id;
      if (dst_local && !src_local) plan->incoming_per_bucket[op.bucket()] += 1;
    }
    // ops_by_index points into plan->slice, which lives as long as the plan.
    absl::MutexLock l(&d_->mu_);
    d_->plans_[plan->slice.model_id()] = std::move(plan);
    return grpc::Status::OK;
  }

  grpc::Status ExecuteVersion(grpc::ServerContext*, const pb::ExecuteVersionRequest* req, pb::ExecuteVersionResponse*) override {
    absl::MutexLock l(&d_->mu_);
    auto exec = d_->GetExecLocked(req->model_id(), req->version(), req->plan_epoch());
    if (!exec.ok()) return ToGrpcStatus(exec.status());
    if ((*exec)->started) return grpc::Status::OK;
    (*exec)->started = true;
    (*exec)->deadline = absl::Now() + absl::Milliseconds(req->timeout_ms() > 0 ? req->timeout_ms() : 60000);
    // Snapshots older than this version can never be sent any more (superseded).
    for (auto& [id, w] : d_->workers_) {
      if (w.model_id != req->model_id()) continue;
      for (auto it = w.snapshots.begin(); it != w.snapshots.end();) {
        it = it->first < req->version() ? w.snapshots.erase(it) : std::next(it);
      }
    }
    std::shared_ptr<Exec> e = *exec;
    d_->threads_.emplace_back([this, e] { d_->RunExec(e); });
    return grpc::Status::OK;
  }

  grpc::Status CommitVersion(grpc::ServerContext*, const pb::CommitVersionRequest* req, pb::CommitVersionResponse*) override {
    std::vector<std::pair<std::shared_ptr<Bytes>, LocalWorker*>> to_live;
    std::shared_ptr<Exec> exec;
    {
      absl::MutexLock l(&d_->mu_);
      auto it = d_->execs_.find({req->model_id(), req->version()});
      if (it == d_->execs_.end()) return grpc::Status::OK;  // nothing of ours in this version
      exec = it->second;
      d_->execs_.erase(it);
      for (auto& [wid, staging] : exec->incoming) {
        auto w = d_->workers_.find(wid);
        if (w == d_->workers_.end()) continue;
        w->second.committed = staging;
        w->second.committed_version = req->version();
        if (w->second.mode == pb::MODE_SYNC) to_live.push_back({staging, &w->second});
      }
      for (auto& [id, w] : d_->workers_) {
        if (w.model_id == req->model_id()) w.snapshots.erase(req->version());
      }
      d_->committed_[req->model_id()] = std::max(d_->committed_[req->model_id()], req->version());
    }
    // Sync: rollouts are paused; the commit writes their live weights before anyone is told.
    // (LocalWorker entries are stable: only Deregister erases them, and a deregistered worker's
    // buffers are kept alive by the shared_ptr copies taken here.)
    for (auto& [staging, w] : to_live) {
      std::vector<std::shared_ptr<transport::ShmSegment>> buffers;
      planner::WorkerLayout layout;
      {
        absl::MutexLock l(&d_->mu_);
        buffers = w->buffers;
        for (int i = 0; i < exec->plan->slice.workers_size(); ++i) {
          for (auto& [wid, s] : exec->incoming) {
            if (s == staging && exec->plan->slice.workers(i).worker_id() == wid) layout = exec->plan->layouts[i];
          }
        }
      }
      for (const planner::Piece& piece : layout.pieces) {
        int elem = planner::DTypeSize(exec->plan->inventory.tensors[piece.tensor].dtype);
        CopyPiece((*staging)[piece.buffer].data(), piece, elem, static_cast<uint8_t*>(buffers[piece.buffer]->data()));
      }
      absl::MutexLock l(&d_->mu_);
      w->applied_version = std::max(w->applied_version, req->version());
    }
    return grpc::Status::OK;
  }

  grpc::Status AbortVersion(grpc::ServerContext*, const pb::AbortVersionRequest* req, pb::AbortVersionResponse*) override {
    absl::MutexLock l(&d_->mu_);
    d_->aborted_[{req->model_id(), req->version()}] = req->reason();
    auto it = d_->execs_.find({req->model_id(), req->version()});
    if (it != d_->execs_.end()) {
      it->second->aborted = true;
      it->second->error = req->reason();
      d_->execs_.erase(it);  // staging dropped with the last reference
    }
    for (auto& [id, w] : d_->workers_) {
      if (w.model_id == req->model_id()) w.snapshots.erase(req->version());
    }
    return grpc::Status::OK;
  }

  grpc::Status DropWorker(grpc::ServerContext*, const pb::DropWorkerRequest* req, pb::DropWorkerResponse*) override {
    absl::MutexLock l(&d_->mu_);
    d_->workers_.erase(req->worker_id());
    return grpc::Status::OK;
  }

  grpc::Status SetupDataChannel(grpc::ServerContext*, const pb::SetupDataChannelRequest*, pb::SetupDataChannelResponse* resp) override {
    resp->set_endpoint(d_->data_address_);  // TCP needs no handshake beyond the endpoint
    return grpc::Status::OK;
  }

  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest* req, pb::DrainResponse* resp) override {
    pb::DrainRequest r = *req;
    if (r.node_id().empty()) r.set_node_id(d_->options_.node_id);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, Deadline(req->timeout_ms()));
    return d_->coordinator_->Drain(&ctx, r, resp);
  }

  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest* req, pb::StatusResponse* resp) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + absl::Seconds(5));
    grpc::Status s = d_->coordinator_->ClusterStatus(&ctx, *req, resp);
    resp->set_role("node");
    resp->set_node_id(d_->options_.node_id);
    return s;
  }

 private:
  NodeDaemon* d_;
};

// ------------------------------------------------------------------------------- NodeDaemon
NodeDaemon::NodeDaemon(Options options)
    : options_(std::move(options)),
      worker_impl_(std::make_unique<WorkerImpl>(this)),
      node_impl_(std::make_unique<NodeImpl>(this)) {}

NodeDaemon::~NodeDaemon() { Shutdown(); }

pb::WorkerService::Service* NodeDaemon::worker_service() { return worker_impl_.get(); }
pb::NodeService::Service* NodeDaemon::node_service() { return node_impl_.get(); }

absl::Status NodeDaemon::Start(const std::string& node_address) {
  if (!options_.data_channel) return absl::InvalidArgumentError("node daemon needs a data channel");
  node_address_ = node_address;
  ASSIGN_OR_RETURN(data_address_, options_.data_channel->Start(options_.data_listen, [this](const FrameHeader& h, absl::Span<const uint8_t> p) {
                     return OnFrame(h, p);
                   }));
  coordinator_ = pb::CoordinatorService::NewStub((options_.make_channel ? options_.make_channel(options_.coordinator) : grpc::CreateChannel(options_.coordinator, grpc::InsecureChannelCredentials())));
  RETURN_IF_ERROR_WITH(Register(), absl::StrCat("registering node ", options_.node_id, " with coordinator ", options_.coordinator));
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  return absl::OkStatus();
}

absl::Status NodeDaemon::Register() {
  pb::RegisterNodeRequest req;
  req.set_node_id(options_.node_id);
  req.set_address(node_address_);
  req.set_data_address(data_address_);
  pb::RegisterNodeResponse resp;
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);
  SetDeadline(&ctx, absl::Now() + absl::Seconds(10));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->RegisterNode(&ctx, req, &resp)));
  absl::MutexLock l(&mu_);
  incarnation_ = resp.incarnation();
  return absl::OkStatus();
}

void NodeDaemon::HeartbeatLoop() {
  absl::MutexLock l(&mu_);
  while (!stopping_) {
    auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), options_.heartbeat);
    if (stopping_) return;
    pb::HeartbeatRequest req;
    req.set_node_id(options_.node_id);
    req.set_incarnation(incarnation_);
    for (auto& [key, e] : execs_) {
      pb::VersionProgress* p = req.add_progress();
      p->set_model_id(key.first);
      p->set_version(key.second);
      p->set_bytes_done(e->bytes_done);
    }
    mu_.Unlock();
    pb::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Now() + options_.heartbeat);
    grpc::Status s = coordinator_->Heartbeat(&ctx, req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      // The coordinator declared us lost (or restarted): it dropped our workers, so do we; their
      // clients see NOT_FOUND and register again.
      mu_.Lock();
      workers_.clear();
      execs_.clear();
      mu_.Unlock();
      (void)Register();
    }
    mu_.Lock();
  }
}

void NodeDaemon::Shutdown() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [k, e] : execs_) e->aborted = true;
    threads.swap(threads_);
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (options_.data_channel) options_.data_channel->Stop();
  for (auto& t : threads) t.join();
}

absl::StatusOr<std::shared_ptr<NodeDaemon::Exec>> NodeDaemon::GetExecLocked(const std::string& model_id, uint64_t version,
                                                                            uint64_t epoch) {
  auto it = execs_.find({model_id, version});
  if (it != execs_.end()) return it->second;
  if (aborted_.count({model_id, version})) {
    return absl::AbortedError(absl::StrCat("version ", version, " was aborted: ", aborted_.at({model_id, version})));
  }
  if (version <= committed_[model_id]) return absl::FailedPreconditionError(absl::StrCat("version ", version, " is already committed"));
  auto p = plans_.find(model_id);
  if (p == plans_.end() || p->second->slice.plan_epoch() != epoch) {
    return absl::FailedPreconditionError(absl::StrCat("plan epoch ", epoch, " of model ", model_id, " is not installed on node ", options_.node_id));
  }
  auto exec = std::make_shared<Exec>();
  exec->model_id = model_id;
  exec->version = version;
  exec->epoch = epoch;
  exec->plan = p->second;
  exec->received_per_bucket.assign(exec->plan->slice.num_buckets(), 0);
  exec->deadline = absl::Now() + absl::Seconds(60);
  // Incoming staging for every local rollout worker of the plan.
  int64_t staging = 0;
  for (int i = 0; i < exec->plan->slice.workers_size(); ++i) {
    const pb::PlanWorker& w = exec->plan->slice.workers(i);
    if (w.node_id() != options_.node_id || w.role() != pb::ROLE_ROLLOUT) continue;
    auto bytes = std::make_shared<Bytes>();
    for (const planner::BufferInfo& b : exec->plan->layouts[i].buffers) {
      staging += b.size_bytes;
      bytes->emplace_back(static_cast<size_t>(b.size_bytes));
    }
    exec->incoming[w.worker_id()] = std::move(bytes);
  }
  if (staging > options_.staging_budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("node ", options_.node_id, ": staging of ", staging,
                                                     " bytes exceeds the budget of ", options_.staging_budget_bytes));
  }
  execs_[{model_id, version}] = exec;
  return exec;
}

absl::Status NodeDaemon::OnFrame(const FrameHeader& h, absl::Span<const uint8_t> payload) {
  std::shared_ptr<Exec> exec;
  {
    absl::MutexLock l(&mu_);
    auto e = GetExecLocked(h.model_id, h.version, h.plan_epoch);
    if (!e.ok()) return absl::OkStatus();  // stale frame of an aborted/old version: drop it
    exec = *e;
  }
  const ModelPlan& plan = *exec->plan;
  auto op_it = plan.ops_by_index.find(h.op_index);
  absl::Status error;
  if (op_it == plan.ops_by_index.end()) {
    error = absl::InvalidArgumentError(absl::StrCat("frame for unknown op ", h.op_index));
  } else if (!h.checksum_ok) {
    error = absl::DataLossError(absl::StrCat("checksum mismatch on op ", h.op_index, " (tensor ",
                                             plan.inventory.tensors[op_it->second->tensor()].name, ")"));
  } else if (payload.size() != op_it->second->bytes()) {
    error = absl::DataLossError(absl::StrCat("op ", h.op_index, ": got ", payload.size(), " bytes, want ", op_it->second->bytes()));
  }
  if (error.ok()) {
    const pb::TransferOp& op = *op_it->second;
    const pb::PlanWorker& dst = plan.slice.workers(op.dst_worker());
    auto staging = exec->incoming.find(dst.worker_id());
    if (staging == exec->incoming.end()) {
      error = absl::InvalidArgumentError(absl::StrCat("op ", h.op_index, ": destination ", dst.worker_id(), " is not local"));
    } else {
      const planner::Piece& piece = plan.layouts[op.dst_worker()].pieces[op.dst_piece()];
      ScatterBox(payload.data(), piece, FromProto(op.box()), planner::DTypeSize(plan.inventory.tensors[op.tensor()].dtype),
                 (*staging->second)[piece.buffer].data());
    }
  }
  absl::MutexLock l(&mu_);
  if (!error.ok()) {
    exec->failed = true;
    exec->error = std::string(error.message());
    return error;
  }
  exec->received_per_bucket[op_it->second->bucket()] += 1;
  exec->bytes_done += payload.size();
  return absl::OkStatus();
}

void NodeDaemon::RunExec(std::shared_ptr<Exec> exec) {
  absl::Time t0 = absl::Now();
  absl::Status s = RunExecInner(*exec);
  {
    absl::MutexLock l(&mu_);
    if (exec->aborted || stopping_) return;  // the coordinator already knows
  }
  pb::ReportDoneRequest req;
  req.set_node_id(options_.node_id);
  req.set_model_id(exec->model_id);
  req.set_version(exec->version);
  req.set_ok(s.ok());
  req.set_error(std::string(s.message()));
  req.set_bytes(exec->bytes_done);
  req.set_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  pb::ReportDoneResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Now() + absl::Seconds(10));
  coordinator_->ReportDone(&ctx, req, &resp);
}

absl::Status NodeDaemon::RunExecInner(Exec& exec) {
  const ModelPlan& plan = *exec.plan;
  const std::string& me = options_.node_id;
  // Per bucket: wait until every remote op of earlier buckets landed (relays read them), then run
  // the ops this node sources: local copies straight into staging, remote ones over the channel.
  std::vector<std::vector<const pb::TransferOp*>> sends(plan.slice.num_buckets());
  for (const pb::TransferOp& op : plan.slice.ops()) {
    if (plan.slice.workers(op.src_worker()).node_id() == me) sends[op.bucket()].push_back(&op);
  }
  auto wait_received = [&](uint32_t upto) -> absl::Status {
    absl::MutexLock l(&mu_);
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      if (exec.aborted || exec.failed || stopping_) return true;
      for (uint32_t b = 0; b < upto; ++b) {
        if (exec.received_per_bucket[b] < plan.incoming_per_bucket[b]) return false;
      }
      return true;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), exec.deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("node ", me, ": incoming bytes of version ", exec.version, " did not arrive in time"));
    }
    if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    if (exec.failed) return absl::DataLossError(exec.error);
    return absl::OkStatus();
  };
  std::vector<uint8_t> packed;
  for (uint32_t b = 0; b < plan.slice.num_buckets(); ++b) {
    RETURN_IF_ERROR(wait_received(b));
    for (const pb::TransferOp* op : sends[b]) {
      const pb::PlanWorker& src = plan.slice.workers(op->src_worker());
      const pb::PlanWorker& dst = plan.slice.workers(op->dst_worker());
      const planner::Piece& spiece = plan.layouts[op->src_worker()].pieces[op->src_piece()];
      const int elem = planner::DTypeSize(plan.inventory.tensors[op->tensor()].dtype);
      const planner::Box box = FromProto(op->box());
      const uint8_t* src_base = nullptr;
      std::shared_ptr<Bytes> hold;
      std::shared_ptr<transport::ShmSegment> hold_seg;
      {
        absl::MutexLock l(&mu_);
        if (exec.aborted || stopping_) return absl::AbortedError("aborted");
        if (src.role() == pb::ROLE_ROLLOUT) {
          hold = exec.incoming.at(src.worker_id());  // relay: bytes an earlier bucket delivered
          src_base = (*hold)[spiece.buffer].data();
        } else {
          auto w = workers_.find(src.worker_id());
          if (w == workers_.end()) return absl::FailedPreconditionError(absl::StrCat("worker ", src.worker_id(), " is gone"));
          if (plan.slice.mode() == pb::MODE_SYNC) {
            hold_seg = w->second.buffers[spiece.buffer];
            src_base = static_cast<const uint8_t*>(hold_seg->data());
          } else {
            auto snap = w->second.snapshots.find(exec.version);
            if (snap == w->second.snapshots.end()) {
              return absl::FailedPreconditionError(absl::StrCat("no snapshot of version ", exec.version, " for worker ", src.worker_id()));
            }
            hold = snap->second;
            src_base = (*hold)[spiece.buffer].data();
          }
        }
      }
      packed.resize(op->bytes());
      GatherBox(src_base, spiece, box, elem, packed.data());
      if (dst.node_id() == me) {
        const planner::Piece& dpiece = plan.layouts[op->dst_worker()].pieces[op->dst_piece()];
        ScatterBox(packed.data(), dpiece, box, elem, (*exec.incoming.at(dst.worker_id()))[dpiece.buffer].data());
        absl::MutexLock l(&mu_);
        exec.bytes_done += op->bytes();
      } else {
        FrameHeader h{exec.model_id, exec.version, exec.epoch, op->index()};
        absl::Status s = options_.data_channel->Send(dst.data_address(), h, packed, exec.deadline);
        if (!s.ok()) {
          options_.data_channel->Forget(dst.data_address());
          return Annotate(s, absl::StrCat("node ", me, " -> node ", dst.node_id()));
        }
      }
    }
  }
  return wait_received(plan.slice.num_buckets());
}

}  // namespace wb::daemon
