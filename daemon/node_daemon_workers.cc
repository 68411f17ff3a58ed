// NodeDaemon, part three: what local workers ask of this node (the WorkerService calls;
// daemon/node/worker_service.cc only adapts gRPC to these). Worker state lives in LocalWorkers
// (daemon/node/local_workers.h); this file forwards to the coordinator and holds the parts that
// need the node's staging, plans and coordinator session.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/convert.h"
#include "daemon/layout_discovery.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/node/deadlines.h"
#include "daemon/node_daemon.h"
#include "planner/box.h"
#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/quantized.h"

namespace wb::daemon {
namespace {

// Runs planner::ExtractPieces on every probed local tensor. The probe (int64 canonical indices,
// -1 = unmapped) is read from the worker's registered shared memory.
absl::StatusOr<pb::ExplicitPieces> ResolveIndexProbe(const planner::Inventory& inventory, const pb::RegisterLayoutRequest& req,
                                                     const std::vector<std::shared_ptr<transport::ShmSegment>>& buffers) {
  const std::vector<int64_t> bases = planner::TensorBases(inventory);
  int64_t total = 0;
  for (const planner::TensorSpec& t : inventory.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    total += n;
  }
  std::map<uint32_t, int> index_of;
  for (int i = 0; i < req.buffers_size(); ++i) index_of[req.buffers(i).buffer_id()] = i;
  pb::ExplicitPieces out;
  const auto& probe = req.layout().index_probe();
  for (int t = 0; t < probe.tensors_size(); ++t) {
    const pb::IndexProbe::LocalTensor& lt = probe.tensors(t);
    auto b = index_of.find(lt.buffer_id()), pbuf = index_of.find(lt.probe_buffer_id());
    if (b == index_of.end() || pbuf == index_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat("local tensor ", t, ": unknown buffer id ", lt.buffer_id(), " or ", lt.probe_buffer_id()));
    }
    std::vector<int64_t> shape(lt.shape().begin(), lt.shape().end());
    int64_t n = 1;
    for (int64_t d : shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("local tensor ", t, ": negative dim"));
      n *= d;
    }
    if (buffers[pbuf->second] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("local tensor ", t, ": the index probe must be in a shared-memory buffer, not CUDA memory"));
    }
    const transport::ShmSegment& seg = *buffers[pbuf->second];
    if (absl::Status intact = seg.CheckIntact(); !intact.ok()) {
      return absl::Status(intact.code(), absl::StrCat("local tensor ", t, ": probe buffer ", lt.probe_buffer_id(), ": ", intact.message()));
    }
    if (lt.probe_offset_bytes() % sizeof(int64_t) != 0 || lt.probe_offset_bytes() > static_cast<uint64_t>(seg.size()) ||
        static_cast<uint64_t>(n) * sizeof(int64_t) > static_cast<uint64_t>(seg.size()) - lt.probe_offset_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("local tensor ", t, ": probe of ", n, " int64 at byte ", lt.probe_offset_bytes(),
                                                     " is outside (or misaligned in) buffer ", lt.probe_buffer_id()));
    }
    absl::Span<const int64_t> values(reinterpret_cast<const int64_t*>(static_cast<const uint8_t*>(seg.data()) + lt.probe_offset_bytes()),
                                     static_cast<size_t>(n));
    // Element size: the dtype of the first mapped canonical tensor (ExtractPieces checks the rest).
    int elem = 0;
    for (int64_t v : values) {
      if (v < 0) continue;
      if (v >= total) return absl::InvalidArgumentError(absl::StrCat("local tensor ", t, ": index ", v, " out of range"));
      size_t k = static_cast<size_t>(std::upper_bound(bases.begin(), bases.end(), v) - bases.begin()) - 1;
      elem = planner::DTypeSize(inventory.tensors[k].dtype);
      break;
    }
    if (elem == 0) continue;  // nothing mapped (e.g. pure padding)
    ASSIGN_OR_RETURN(std::vector<planner::Piece> pieces,
                     planner::ExtractPieces(inventory, bases, values, shape, static_cast<int64_t>(lt.offset_bytes()), elem, b->second));
    for (const planner::Piece& p : pieces) {
      pb::Piece* pp = out.add_pieces();
      pp->set_tensor(inventory.tensors[p.tensor].name);
      ToProto(p.box, pp->mutable_box());
      pp->set_buffer_id(lt.buffer_id());
      pp->set_offset_bytes(static_cast<uint64_t>(p.offset_bytes));
      for (int64_t st : p.strides) pp->add_strides(st);
    }
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------- WorkerService calls
absl::Status NodeDaemon::RegisterWorker(const pb::RegisterWorkerRequest& req, pb::RegisterWorkerResponse* resp) {
  // Enums are checked before anything is forwarded or stored (role 99 was counted as a trainer).
  // Ids were checked by the front (daemon/limits.h: length, control characters).
  if (req.role() != pb::ROLE_TRAINER && req.role() != pb::ROLE_ROLLOUT) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker.role is ", static_cast<int>(req.role()), ": must be ROLE_TRAINER (1) or ROLE_ROLLOUT (2)"));
  }
  if (req.has_model() && !pb::Mode_IsValid(req.model().mode())) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterWorker.model.mode is ", static_cast<int>(req.model().mode()),
                                                   ": must be MODE_SYNC (1), MODE_ONE_STEP_OFF (2), MODE_ASYNC (3) or unset"));
  }
  if (req.has_model() && !pb::Strategy_IsValid(req.model().strategy())) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker.model.strategy is ", static_cast<int>(req.model().strategy()),
                     ": must be STRATEGY_WEIGHTBRIDGE (1), STRATEGY_RANK0_BROADCAST (2), STRATEGY_P2P_NO_DEDUP (3) or unset"));
  }
  // A join sent before this node's (re-)registration and re-join have finished could reach the
  // coordinator first and then be dropped by that registration (a restarted node's workers are
  // dropped there) while this node keeps the worker: it would be left out of every plan.
  if (!AwaitRegistered(absl::Now() + absl::Seconds(10))) {
    return absl::UnavailableError(absl::StrCat("node ", options_.node_id, " is not registered with the coordinator yet (retry)"));
  }
  const std::string& id = req.worker_id();
  const NodeDaemon::WorkerKey key{req.model_id(), id};  // worker ids are scoped per model (issue 16.5)
  // An earlier process of this worker id that exited: its LeaveWorker reaches the coordinator
  // before this join (LocalWorkers::BeginJoin).
  if (absl::Status joining = local_.BeginJoin(key, absl::Now() + absl::Seconds(10)); !joining.ok()) return joining;
  struct Joined {
    LocalWorkers* workers;
    NodeDaemon::WorkerKey key;
    ~Joined() { workers->EndJoin(key); }
  } joined{&local_, key};
  pb::JoinWorkerRequest j;
  j.set_node_id(options_.node_id);
  j.set_worker_id(req.worker_id());
  j.set_model_id(req.model_id());
  j.set_role(req.role());
  j.set_gpu(req.gpu());
  if (req.has_model()) *j.mutable_model() = req.model();
  pb::JoinWorkerResponse jr;
  absl::Status s = coordinator_client_->JoinWorker(j, &jr, CallTimeout(absl::Now() + absl::Seconds(10)));
  if (!s.ok()) return s;
  LocalWorker w;
  w.model_id = req.model_id();
  w.role = FromProto(req.role());
  w.gpu = req.gpu();
  w.mode = jr.mode();
  w.spec = jr.has_model() ? jr.model() : req.model();
  if (w.spec.model_id().empty()) w.spec.set_model_id(req.model_id());
  if (req.pid() > 0) {
    auto watch = PidWatch::Open(req.pid(), absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id()));
    if (!watch.ok()) return watch.status();
    w.pid = std::move(*watch);
  }
  auto inv = InventoryFromProto(jr.tensors());
  local_.Add(key, std::move(w), inv.ok() ? std::optional<planner::Inventory>(std::move(*inv)) : std::nullopt);
  Log(LogLevel::kInfo, "worker registered",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"role", pb::Role_Name(req.role())}, {"pid", req.pid()}});
  resp->set_session(absl::StrCat(options_.node_id, "/", req.worker_id()));
  return absl::OkStatus();
}

absl::Status NodeDaemon::RegisterLayout(const pb::RegisterLayoutRequest& req, pb::RegisterLayoutResponse* resp) {
  pb::ModelSpec spec;
  planner::Role role = planner::Role::kTrainer;
  {
    std::optional<LocalWorkers::View> it = local_.Get({req.model_id(), req.worker_id()});
    if (!it || it->worker.model_id != req.model_id()) {
      return absl::NotFoundError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " is not registered on node ",
                                              options_.node_id, " (register again)"));
    }
    spec = it->worker.spec;
    role = it->worker.role;
  }
  // Layout discovery: a preset's buffer sizes are checked against its description first,
  // naming worker, model and both sizes; the description is the response's `layout`.
  auto preset_described = describer_.DescribePresetForRegister(spec, req);
  if (!preset_described.ok()) return preset_described.status();
  // Map every buffer first: a bad name fails the call and changes nothing.
  std::vector<std::shared_ptr<transport::ShmSegment>> buffers;
  std::vector<std::shared_ptr<CudaImport>> cuda;
  for (const pb::BufferSpec& b : req.buffers()) {
    if (b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey) {
      auto imp = ImportCuda(req.model_id(), req.worker_id(), b);
      if (!imp.ok()) return imp.status();
      buffers.push_back(nullptr);
      cuda.push_back(std::move(*imp));
      continue;
    }
    if (b.memory_case() != pb::BufferSpec::kShmName) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": neither shm_name nor cuda_ipc_handle"));
    }
    cuda.push_back(nullptr);
    auto seg = transport::ShmSegment::Open(b.shm_name(), static_cast<int64_t>(b.size_bytes()));
    if (seg.ok()) {
      absl::Status priv = seg->CheckPrivate();
      if (!priv.ok()) seg = priv;
    }
    if (!seg.ok()) return Annotate(seg.status(), absl::StrCat("worker ", req.worker_id(), " buffer ", b.buffer_id()));
    // Ownership (the segment's uid == the calling worker's uid) is checked by the front
    // (daemon/auth.cc) with the worker's SO_PEERCRED uid; the daemon's own uid is irrelevant.
    buffers.push_back(std::make_shared<transport::ShmSegment>(std::move(*seg)));
  }
  if (role == planner::Role::kRollout) {
    // The daemon writes a rollout's live buffers (sync commit, Apply, catch-up): their pages are
    // faulted in now, not inside the first version's (or a late rollout's catch-up's) copy.
    const absl::Time t0 = absl::Now();
    for (size_t j = 0; j < buffers.size(); ++j) {
      if (buffers[j] == nullptr) continue;
      if (absl::Status pre = buffers[j]->Populate(); !pre.ok()) {
        return Annotate(pre, absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " buffer ", j));
      }
    }
    // And its incoming staging of the first version (or of a catch-up) is faulted in now too.
    for (const auto& b : buffers) {
      if (b != nullptr) PrewarmStaging(b->size());
    }
    Log(LogLevel::kDebug, "rollout buffers pre-faulted",
        {{"model", req.model_id()}, {"worker", req.worker_id()}, {"seconds", absl::ToDoubleSeconds(absl::Now() - t0)}});
  }
  pb::SubmitLayoutRequest sreq;
  sreq.set_node_id(options_.node_id);
  sreq.set_model_id(req.model_id());
  sreq.set_worker_id(req.worker_id());
  *sreq.mutable_buffers() = req.buffers();
  // The coordinator places CUDA buffers (nccl lanes) by GPU in this daemon's numbering.
  for (int i = 0; i < sreq.buffers_size(); ++i) {
    if (cuda[i] != nullptr) sreq.mutable_buffers(i)->set_gpu(cuda[i]->device);
  }
  if (req.layout().has_index_probe()) {
    // Index probes are resolved here (the probe bytes live in this node's shared memory) and
    // reach the coordinator as explicit pieces.
    std::optional<planner::Inventory> inventory = local_.Inventory(req.model_id());
    if (!inventory) return absl::FailedPreconditionError("model inventory unknown on this node");
    auto pieces = ResolveIndexProbe(*inventory, req, buffers);
    if (!pieces.ok()) return Annotate(pieces.status(), absl::StrCat("worker ", req.worker_id(), " index probe"));
    *sreq.mutable_layout()->mutable_pieces() = std::move(*pieces);
  } else {
    *sreq.mutable_layout() = req.layout();
  }
  pb::SubmitLayoutResponse sresp;
  absl::Status s = coordinator_client_->SubmitLayout(sreq, &sresp, CallTimeout(absl::Now() + absl::Seconds(30)));
  if (!s.ok()) return s;
  if (preset_described->has_value()) {
    *resp->mutable_layout() = std::move(**preset_described);
  } else {
    auto described =
        describer_.DescribeResolved(spec, sresp.layout(), req.layout().has_index_probe() ? "index_probe" : "pieces", role, req.worker_id());
    if (described.ok()) *resp->mutable_layout() = std::move(*described);
    if (!described.ok()) Log(LogLevel::kWarning, "layout not described", {{"worker", req.worker_id()}, {"error", described.status().message()}});
  }
  absl::StatusOr<uint64_t> bytes =
      local_.AttachLayout({req.model_id(), req.worker_id()}, std::move(buffers), std::move(cuda), std::move(sreq), sresp.layout());
  if (!bytes.ok()) return bytes.status();
  resp->set_num_pieces(static_cast<uint32_t>(sresp.layout().pieces_size()));
  resp->set_bytes(*bytes);
  return absl::OkStatus();
}

// Publish and Apply are counted here, before their reply is sent.
absl::Status NodeDaemon::Publish(const pb::PublishRequest& req, pb::PublishResponse* resp) {
  absl::Status s = PublishVersion(req, resp);
  const std::string& me = options_.node_id;
  if (s.ok()) {
    metrics().Version(me, req.model_id(), "published");
    metrics().Phase(me, "publish_stall", resp->stall_seconds());
  } else {
    metrics().Failure(me, s);
  }
  return s;
}

absl::Status NodeDaemon::PublishVersion(const pb::PublishRequest& req, pb::PublishResponse* resp) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = Deadline(req.timeout_ms());
  std::vector<std::shared_ptr<transport::ShmSegment>> to_snapshot;
  std::vector<std::shared_ptr<CudaImport>> cuda_snapshot;
  std::shared_ptr<StagingBudget::Charge> snap_charge;
  bool snapshot = false;
  {
    std::optional<LocalWorkers::View> it = local_.Get({req.model_id(), req.worker_id()});
    if (!it || !it->worker.has_layout) {
      return absl::NotFoundError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " has no layout on node ", options_.node_id));
    }
    const LocalWorker& w = it->worker;
    if (w.role != planner::Role::kTrainer) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " is not a trainer"));
    }
    if (w.mode != pb::MODE_SYNC) {
      // Snapshot: the trainer's only stall. Budget bounds snapshot + staging memory.
      // With GPU staging, CUDA buffers are snapshotted on their GPU (under its own budget); if
      // one falls back to host memory it is checked against this budget after the copy.
      const bool gpu_staging = options_.device_staging != nullptr && options_.device_staging->enabled();
      int64_t need = 0;
      for (size_t j = 0; j < w.buffers.size(); ++j) {
        if (w.buffers[j]) {
          need += w.buffers[j]->size();
        } else if (!gpu_staging) {
          need += w.cuda[j]->size;
        }
      }
      // One node total (daemon/node/staging_budget.h): with every other snapshot, version in
      // flight and committed staging not applied yet. Reserved before the copy, which runs
      // outside any lock; the charge goes with the snapshot's memory.
      auto charge = budget_->Reserve(need, absl::StrCat("the snapshot of worker ", req.worker_id(), " version ", req.version()));
      if (!charge.ok()) return charge.status();
      snap_charge = std::move(*charge);
      snapshot = true;
      to_snapshot = w.buffers;
      cuda_snapshot = w.cuda;
    }
  }
  if (snapshot) {
    std::shared_ptr<Bytes> snap = NewBytes(0, {snap_charge});
    absl::Status copied = ReadLive(to_snapshot, cuda_snapshot, *snap, absl::StrCat("snapshot ", req.worker_id(), " v", req.version()), deadline,
                                   /*on_gpu=*/true);
    if (!copied.ok()) return Annotate(copied, absl::StrCat("snapshot of version ", req.version()));
    int64_t fell_back = 0;  // CUDA buffers that did not fit GPU staging: host memory after all
    for (size_t j = 0; j < snap->size(); ++j) {
      if (!(*snap)[j].device && j < cuda_snapshot.size() && cuda_snapshot[j] && options_.device_staging != nullptr &&
          options_.device_staging->enabled()) {
        fell_back += (*snap)[j].size();
      }
    }
    if (fell_back > 0) {
      auto extra = budget_->Reserve(fell_back, absl::StrCat("the snapshot of worker ", req.worker_id(), " version ", req.version(),
                                                            " (CUDA buffers that did not fit the GPU staging budget)"));
      if (!extra.ok()) return extra.status();
      snap = KeepWith(std::move(snap), std::move(*extra));
    }
    if (!local_.AddSnapshot({req.model_id(), req.worker_id()}, req.version(), std::move(snap))) {
      return absl::NotFoundError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " left during Publish"));
    }
  }
  pb::CoordPublishRequest c;
  c.set_node_id(options_.node_id);
  c.set_model_id(req.model_id());
  c.set_worker_id(req.worker_id());
  c.set_version(req.version());
  uint64_t session0 = 0;
  absl::Status s = ForwardHeld(req.model_id(), req.worker_id(), deadline, &session0, [&](absl::Time dl) {
    c.set_timeout_ms(absl::ToInt64Milliseconds(dl - absl::Now()));
    return coordinator_client_->Publish(c, resp, CallTimeout(dl));
  });
  if (!s.ok()) {
    local_.DropSnapshot({req.model_id(), req.worker_id()}, req.version());
    // NOT_FOUND: ForwardHeld already waited for a re-join; nothing was recorded anywhere.
    if (s.code() == absl::StatusCode::kNotFound) return s;
    return RestartAware(s, session0, deadline, absl::StrCat("version ", req.version()));
  }
  resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

absl::Status NodeDaemon::BeginUpdate(const pb::BeginUpdateRequest& req, pb::BeginUpdateResponse* resp) {
  pb::ReportReadyRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(req.model_id());
  r.set_worker_id(req.worker_id());
  pb::ReportReadyResponse rr;
  uint64_t session0 = 0;
  absl::Status s = ForwardHeld(req.model_id(), req.worker_id(), Deadline(req.timeout_ms()), &session0,
                               [&](absl::Time dl) { return coordinator_client_->ReportReady(r, &rr, CallTimeout(dl)); });
  resp->set_committed_version(rr.committed_version());
  return s;
}

absl::Status NodeDaemon::Apply(const pb::ApplyRequest& req, pb::ApplyResponse* resp) {
  absl::Status s = ApplyVersion(req, resp);
  if (s.ok()) {
    uint64_t committed = 0;
    {
      absl::MutexLock l(&mu_);
      auto it = committed_.find(req.model_id());
      if (it != committed_.end()) committed = it->second;
    }
    const std::string& me = options_.node_id;
    metrics().Version(me, req.model_id(), "applied");
    metrics().Phase(me, "apply", resp->stall_seconds());
    metrics().Applied(me, req.model_id(), req.worker_id(), resp->applied_version(), committed);
  }
  return s;
}

absl::Status NodeDaemon::ApplyVersion(const pb::ApplyRequest& req, pb::ApplyResponse* resp) {
  const absl::Time start = absl::Now();
  // The client's deadline bounds the wait for the version (and for a copy into this worker that
  // is already running); a copy that started runs to live_copy_timeout (RunLiveCopies).
  const absl::Time deadline = Deadline(req.timeout_ms());
  const std::string& model = req.model_id();
  const std::string& wid = req.worker_id();
  absl::StatusOr<LocalWorkers::Applicable> found = local_.AwaitApplicable({model, wid}, req.version(), deadline);
  if (!found.ok()) return found.status();
  if (found->staging == nullptr) {
    resp->set_applied_version(found->applied_version);
    resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    return absl::OkStatus();
  }
  std::vector<LiveJob> jobs(1);
  LiveJob& job = jobs[0];
  job.model = model;
  job.worker = wid;
  job.version = found->version;
  job.staging = found->staging;
  job.live = std::move(found->live);
  std::shared_ptr<const ModelPlan> plan;
  {
    absl::MutexLock l(&mu_);
    auto p = plans_.find(model);
    if (p == plans_.end()) return absl::FailedPreconditionError("no plan installed");
    plan = p->second;
  }
  job.inventory = std::shared_ptr<const planner::Inventory>(plan, &plan->inventory);
  for (int i = 0; i < plan->slice.workers_size(); ++i) {
    if (plan->slice.workers(i).worker_id() == wid) job.layout = plan->live_layouts[i];
  }
  job.label = absl::StrCat("apply ", wid, " v", job.version);
  // A copy that starts runs to its end; one that would obviously outlast the caller's timeout
  // (the wait for the version took it) is not started: the caller learns that nothing changed
  // instead of giving up while its live weights are being rewritten.
  int64_t bytes = 0;
  for (const StagedBuffer& b : *job.staging) bytes += b.size();
  const absl::Duration estimate = absl::Seconds(static_cast<double>(bytes) / found->copy_Bps);
  if (absl::Now() + estimate > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("version ", job.version, " is committed on node ", options_.node_id, " but copying it into the live weights of worker ", wid,
                     " (", bytes, " bytes, about ", absl::FormatDuration(estimate), ") does not fit in what is left of the call's timeout (",
                     absl::FormatDuration(std::max(absl::ZeroDuration(), deadline - absl::Now())),
                     "); nothing was copied: live weights still hold version ", found->applied_version, " (call Apply with a longer timeout)"));
  }
  // The rollout's only stall: copy its pieces from committed staging into live weights (on the
  // same-node transport's copy threads).
  const uint64_t version = job.version;
  absl::Status copied = local_.RunLiveCopies(jobs)[0];
  if (!copied.ok()) return Annotate(copied, absl::StrCat("applying version ", version, " to ", req.worker_id()));
  // Applied: the staging is not read again (a later Apply finds nothing newer); back to the pool.
  local_.MarkApplied({model, wid}, version, job.staging, /*after_commit=*/false);
  pb::ReportAppliedRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(req.model_id());
  r.set_worker_id(req.worker_id());
  r.set_version(version);
  pb::ReportAppliedResponse rr;
  // Best effort: the coordinator learns the applied version from the next ReportApplied or re-join.
  coordinator_client_->ReportApplied(r, &rr, CallTimeout(absl::Now() + absl::Seconds(5))).IgnoreError();
  resp->set_applied_version(version);
  resp->set_stall_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

absl::Status NodeDaemon::WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp) {
  const uint64_t session0 = session();
  const absl::Time deadline = Deadline(req.timeout_ms());
  absl::Status s = coordinator_client_->WaitVersion(req, resp, CallTimeout(deadline));
  if (s.ok()) {
    // Committed cluster-wide, but a local rollout of the model whose live copy failed does not
    // hold it (sync: "committed" includes live weights): say so instead of OK.
    if (absl::Status torn = local_.TornRollout(req.model_id()); !torn.ok()) return torn;
  }
  return RestartAware(s, session0, deadline, absl::StrCat("version ", req.version()));
}

absl::Status NodeDaemon::Deregister(const pb::DeregisterRequest& req) {
  local_.Remove({req.model_id(), req.worker_id()});
  pb::LeaveWorkerRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(req.model_id());
  r.set_worker_id(req.worker_id());
  r.set_reason("deregistered");
  pb::LeaveWorkerResponse rr;
  return coordinator_client_->LeaveWorker(r, &rr, CallTimeout(absl::Now() + absl::Seconds(5)));
}

absl::Status NodeDaemon::ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp) {
  absl::Status s = coordinator_client_->ClusterStatus(req, resp, CallTimeout(absl::Now() + absl::Seconds(5)));
  resp->set_role("node");
  resp->set_node_id(options_.node_id);
  local_.AddLiveState(resp);
  return s;
}

// Layout discovery (daemon/layout_discovery.h), computed on this node: from the model's spec as
// this node holds it (a worker of the model registered here: the coordinator's spec), else from
// the request's `model`, so a worker can size its buffers before it registers anything.
absl::Status NodeDaemon::DescribeLayout(const pb::DescribeLayoutRequest& req, pb::DescribeLayoutResponse* resp) {
  std::optional<pb::ModelSpec> spec;
  std::optional<planner::Role> role;
  if (req.role() != pb::ROLE_UNSPECIFIED) role = FromProto(req.role());
  spec = local_.SpecOf(req.model_id(), req.worker_id(), &role);
  const std::string who = absl::StrCat(req.worker_id().empty() ? "" : absl::StrCat("worker ", req.worker_id(), " of "), "model ", req.model_id());
  if (!spec && req.has_model()) spec = req.model();
  if (!spec) {
    return absl::NotFoundError(absl::StrCat(who, " is unknown on node ", options_.node_id,
                                            ": send its spec (DescribeLayoutRequest.model) or register a worker of it first"));
  }
  auto described = describer_.Describe(*spec, req.layout(), {}, role, req.worker_id().empty() ? "layout" : req.worker_id());
  if (!described.ok()) return Annotate(described.status(), who);
  *resp->mutable_layout() = std::move(*described);
  return absl::OkStatus();
}

// Forwards a call about local worker `worker` to the coordinator (`call` gets the deadline).
// Held while the node (re-)registers and re-joins, so it reaches the session that knows the
// worker. NOT_FOUND from the coordinator (Publish, ReportReady) means it does not know the
// worker or model and recorded nothing: a restarted coordinator this node has not re-joined yet
// (or a lost lease). Then, once the node has re-joined (a new session: the worker was
// re-submitted), the call is sent again - never twice in one session, all within `deadline`.
// Returns the last answer; *sent_in = the session that attempt was sent in.
absl::Status NodeDaemon::ForwardHeld(const std::string& model, const std::string& worker, absl::Time deadline, uint64_t* sent_in,
                                     const std::function<absl::Status(absl::Time)>& call) {
  *sent_in = session();
  while (true) {
    if (!AwaitRegistered(deadline)) {
      return absl::UnavailableError(
          absl::StrCat("node ", options_.node_id, " is not registered with the coordinator (re-joining?); worker ", worker, " of model ", model));
    }
    *sent_in = session();
    absl::Status s = call(deadline);
    if (s.code() != absl::StatusCode::kNotFound) return s;
    if (!AwaitCoordinatorChange(*sent_in, deadline)) return s;  // no re-join: the answer stands
    if (!local_.Has({model, worker})) {
      return absl::NotFoundError(absl::StrCat("worker ", worker, " of model ", model, " was not re-joined by node ", options_.node_id, " after ",
                                              local_.restart_reason(), ": register again"));
    }
    Log(LogLevel::kInfo, "worker call sent again after re-join", {{"node", options_.node_id}, {"worker", worker}, {"first_answer", s.message()}});
  }
}

// A waiting call the coordinator could not answer because it went away (UNAVAILABLE, CANCELLED) or does
// not know us any more (NOT_FOUND): once the node re-joined a restarted coordinator the caller
// gets ABORTED naming the restart (what it waited for will never happen there); otherwise the
// original error.
absl::Status NodeDaemon::RestartAware(const absl::Status& s, uint64_t session0, absl::Time deadline, const std::string& what) {
  // CANCELLED: the coordinator's server shut down under the call.
  if (s.ok() || (s.code() != absl::StatusCode::kUnavailable && s.code() != absl::StatusCode::kNotFound && s.code() != absl::StatusCode::kCancelled)) {
    return s;
  }
  std::optional<std::string> change = AwaitCoordinatorChange(session0, deadline);
  if (!change) return s;
  return absl::AbortedError(
      absl::StrCat(what, " aborted: ", *change, " (node ", options_.node_id, " re-submitted its workers; publish a newer version)"));
}

}  // namespace wb::daemon
