#include "daemon/node_daemon.h"

#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/box_copy.h"
#include "daemon/convert.h"
#include "daemon/layout_discovery.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/nccl_route.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/exec_plan_proto.h"
#include "daemon/node/grpc_coordinator_client.h"
#include "daemon/quantize.h"
#include "planner/box.h"
#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/quantized.h"
#include "proto/grpc_status.h"
#include "tools/cc/status_macros.h"
#if WB_WITH_CUDA_IPC
#include "transport/common.h"
#include "transport/cuda_ipc.h"
#endif

namespace wb::daemon {
namespace {

// Data channels a version sets up at once (RunExecInner step 3): NCCL communicator init takes a
// while per lane pair, and a node pair may use up to (GPUs x peer GPUs) of them.
constexpr size_t kMaxChannelSetups = 16;

}  // namespace

// ------------------------------------------------------------------------------- NodeDaemon
NodeDaemon::NodeDaemon(Options options)
    : options_(std::move(options)),
      worker_impl_(MakeWorkerService(this)),
      node_impl_(MakeNodeService(this)),
      copier_(options_.node_id, options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, false),
              options_.test_live_copy_fault) {
  // Idle staging is bounded by the staging budget (what versions may hold anyway) and returned to
  // the system after a few minutes without a version that wants it.
  StagingPool::Options po;
  po.max_idle_bytes = options_.staging_budget_bytes;
  po.clock = options_.clock;
  staging_pool_ = std::make_shared<StagingPool>(po);
  budget_ = StagingBudget::Create(options_.node_id, options_.staging_budget_bytes);
  // Workers' shm segments may shrink under us (a worker truncating its own memory): a fault in one
  // must fail that worker's call, not kill the daemon (ShmSegment::CheckIntact).
  transport::ShmSegment::InstallSigbusGuard();
}

std::vector<uint8_t> NodeDaemon::TakeHost(int64_t size) {
  bool reused = false;
  std::vector<uint8_t> out = staging_pool_->Take(size, &reused);
  if (size > 0) Metrics().StagingTaken(options_.node_id, reused, static_cast<uint64_t>(size));
  return out;
}

std::shared_ptr<NodeDaemon::Bytes> NodeDaemon::NewBytes(size_t n, std::vector<std::shared_ptr<StagingBudget::Charge>> charges) {
  std::weak_ptr<StagingPool> pool = staging_pool_;
  std::shared_ptr<StagingBudget> budget = budget_;
  return std::shared_ptr<Bytes>(new Bytes(n), [pool, budget, charges = std::move(charges)](Bytes* b) mutable {
    std::shared_ptr<StagingPool> p = pool.lock();
    if (p) {
      for (StagedBuffer& sb : *b) p->Give(std::move(sb.host));
    }
    delete b;
    charges.clear();  // released first: what the pool may keep idle is what the budget leaves
    // Idle pooled memory counts too: in use + idle stays within the node's budget.
    if (p) p->TrimTo(std::max<int64_t>(0, budget->budget() - budget->in_use()));
  });
}

std::shared_ptr<NodeDaemon::Bytes> NodeDaemon::KeepWith(std::shared_ptr<Bytes> bytes, std::shared_ptr<StagingBudget::Charge> charge) {
  auto holder = std::make_shared<std::pair<std::shared_ptr<Bytes>, std::shared_ptr<StagingBudget::Charge>>>(std::move(bytes), std::move(charge));
  Bytes* raw = holder->first.get();
  return std::shared_ptr<Bytes>(std::move(holder), raw);
}

NodeDaemon::~NodeDaemon() { Shutdown(); }

pb::WorkerService::Service* NodeDaemon::worker_service() { return worker_impl_.get(); }
pb::NodeService::Service* NodeDaemon::node_service() { return node_impl_.get(); }

NodeDaemon::PidWatch::~PidWatch() {
  if (fd >= 0) ::close(fd);
}

bool NodeDaemon::PidWatch::Alive() const {
  if (fd >= 0) {
    // A pidfd becomes readable when the process exits (pid reuse cannot fool it).
    struct pollfd p = {fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
  return ::kill(pid, 0) == 0 || errno != ESRCH;
}

void NodeDaemon::CheckWorkers() {
  std::vector<std::pair<std::string, std::string>> gone;  // (model, worker)
  {
    absl::MutexLock l(&mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->second.pid && !it->second.pid->Alive() && joining_.count(it->first) == 0) {
        gone.push_back({it->second.model_id, it->first});
        leaving_.insert(it->first);
        Log(LogLevel::kWarning, "worker process exited", {{"node", options_.node_id}, {"model", it->second.model_id},
                                                          {"worker", it->first}, {"pid", it->second.pid->pid}});
        live_.Forget(it->first);
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [model, worker] : gone) {
    pb::LeaveWorkerRequest r;
    r.set_node_id(options_.node_id);
    r.set_model_id(model);
    r.set_worker_id(worker);
    r.set_reason("its process exited");
    pb::LeaveWorkerResponse rr;
    coordinator_client_->LeaveWorker(r, &rr, absl::Seconds(7)).IgnoreError();  // the lease drops it otherwise
    absl::MutexLock l(&mu_);
    leaving_.erase(worker);
  }
}

absl::Status NodeDaemon::Start(const std::string& node_address) {
  using transport::MemoryKind;
  if (options_.transports.Pick(MemoryKind::kHost, MemoryKind::kHost, false) == nullptr) {
    return absl::InvalidArgumentError("node daemon needs a same-node host-memory transport (host_shm)");
  }
  if (!options_.live_state_dir.empty()) {
    // Before the first worker can register: leftovers of a previous process make theirs TORN.
    ASSIGN_OR_RETURN(markers_, LiveMarkers::Open(options_.live_state_dir, options_.node_id));
    absl::MutexLock l(&mu_);
    live_.AttachMarkers(markers_.get());
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
  coordinator_ = pb::CoordinatorService::NewStub(channel);
  coordinator_client_ = std::make_unique<GrpcCoordinatorClient>(channel);
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
  RETURN_IF_ERROR_WITH(coord_->Start(), absl::StrCat("registering node ", options_.node_id, " with coordinator ", options_.coordinator));
  return absl::OkStatus();
}

pb::RegisterNodeRequest NodeDaemon::Registration() const {
  pb::RegisterNodeRequest req;
  req.set_node_id(options_.node_id);
  req.set_address(node_address_);
  req.set_data_address(data_address_);
  req.set_heartbeat_ms(absl::ToInt64Milliseconds(options_.heartbeat));
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
  for (auto& [device, t] : NcclLanes()) (*req.mutable_transport_instances())[NcclLaneName(device)] = t->instance_id();
  return req;
}

void NodeDaemon::Rejoin(const std::string& reason) {
  // 1. Whatever was in flight belongs to the old coordinator session: abort it here (node-local
  //    waiters - Apply - get ABORTED naming the reason; rollouts keep their committed/live copy).
  std::vector<std::tuple<std::string, std::string, transport::PeerId>> drop;
  struct Job {
    std::string worker;
    pb::JoinWorkerRequest join;
    bool has_layout = false;
    pb::SubmitLayoutRequest layout;
  };
  std::vector<Job> jobs;
  {
    absl::MutexLock l(&mu_);
    for (auto& [key, e] : execs_) {
      e->aborted = true;
      e->error = reason;
      aborted_[key] = reason;
      for (auto& [peer, id] : e->connected) drop.push_back({key.first, peer, id});
    }
    execs_.clear();
    restarts_ += 1;
    restart_reason_ = reason;
    for (auto& [id, w] : workers_) {
      Job j;
      j.worker = id;
      j.join.set_node_id(options_.node_id);
      j.join.set_worker_id(id);
      j.join.set_model_id(w.model_id);
      j.join.set_role(ToProto(w.role));
      j.join.set_gpu(w.gpu);
      *j.join.mutable_model() = w.spec;
      j.join.set_rejoin(true);
      j.join.set_committed_version(committed_[w.model_id]);
      j.join.set_applied_version(w.applied_version);
      j.has_layout = w.has_layout;
      j.layout = w.submitted;
      jobs.push_back(std::move(j));
    }
  }
  for (auto& [model, peer, id] : drop) DropChannel(model, peer, id);
  // 2. Re-submit models, workers and layouts. A worker the coordinator refuses is dropped here
  //    (its client sees NOT_FOUND and registers again).
  for (Job& j : jobs) {
    pb::JoinWorkerResponse jr;
    absl::Status s = coordinator_client_->JoinWorker(j.join, &jr, absl::Seconds(12));
    if (s.ok() && j.has_layout) {
      pb::SubmitLayoutResponse sr;
      s = coordinator_client_->SubmitLayout(j.layout, &sr, absl::Seconds(32));
    }
    if (!s.ok()) {
      Log(LogLevel::kWarning, "worker not re-joined", {{"node", options_.node_id}, {"worker", j.worker}, {"error", s.message()}});
      absl::MutexLock l(&mu_);
      workers_.erase(j.worker);
      live_.Forget(j.worker);
    }
  }
  Log(LogLevel::kInfo, "node re-joined", {{"node", options_.node_id}, {"workers", jobs.size()}, {"reason", reason}});
}

bool NodeDaemon::AwaitRegistered(absl::Time deadline) { return coord_ != nullptr && coord_->AwaitRegistered(deadline); }

uint64_t NodeDaemon::session() { return coord_ != nullptr ? coord_->session() : 0; }

std::optional<std::string> NodeDaemon::AwaitCoordinatorChange(uint64_t session0, absl::Time deadline) {
  if (coord_ == nullptr) return std::nullopt;
  return coord_->AwaitCoordinatorChange(session0, deadline);
}

void NodeDaemon::ControlTick() {
  CheckWorkers();
  staging_pool_->Trim();
  Metrics().StagingPoolBytes(options_.node_id, staging_pool_->stats().idle_bytes);
}

void NodeDaemon::Shutdown() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [k, e] : execs_) e->aborted = true;
    for (auto& [id, t] : exec_threads_) threads.push_back(std::move(t));
    exec_threads_.clear();
    exec_done_.clear();
  }
  if (coord_) coord_->Stop();
  // Executors blocked on a channel end when it is torn down.
  std::vector<std::tuple<std::string, std::string, transport::PeerId>> channels;
  {
    absl::MutexLock l(&mu_);
    for (auto& [key, c] : channels_) channels.push_back({key.first, key.second, c.id});
  }
  for (auto& [model, peer, id] : channels) DropChannel(model, peer, id);
  for (auto& t : threads) t.join();
}

absl::StatusOr<std::shared_ptr<NodeDaemon::Exec>> NodeDaemon::GetExecLocked(const std::string& model_id, uint64_t version,
                                                                            uint64_t epoch) {
  // Catch-up (docs/daemon.md "Catch-up"): the epoch of the installed catch-up slice; its version is
  // already committed (and may have been aborted by an earlier catch-up attempt).
  auto cu = catch_up_plans_.find(model_id);
  const bool catch_up = cu != catch_up_plans_.end() && cu->second->slice.plan_epoch() == epoch;
  auto it = execs_.find({model_id, version});
  if (it != execs_.end() && catch_up && (!it->second->catch_up || it->second->epoch != epoch)) {
    return absl::FailedPreconditionError(absl::StrCat("catch-up of model ", model_id, " version ", version, " on node ", options_.node_id,
                                                      ": another execution of that version is still held here"));
  }
  if (it != execs_.end()) return it->second;
  if (!catch_up && aborted_.count({model_id, version})) {
    return absl::AbortedError(absl::StrCat("version ", version, " was aborted: ", aborted_.at({model_id, version})));
  }
  if (!catch_up && version <= committed_[model_id]) return absl::FailedPreconditionError(absl::StrCat("version ", version, " is already committed"));
  auto p = catch_up ? cu : plans_.find(model_id);
  if (p == plans_.end() || p->second->slice.plan_epoch() != epoch) {
    return absl::FailedPreconditionError(absl::StrCat("plan epoch ", epoch, " of model ", model_id, " is not installed on node ", options_.node_id));
  }
  auto exec = std::make_shared<Exec>();
  exec->model_id = model_id;
  exec->version = version;
  exec->epoch = epoch;
  exec->catch_up = catch_up;
  exec->plan = p->second;
  exec->deadline = absl::Now() + absl::Seconds(60);
  // Staging (incoming per local rollout + gather) is only sized here; the executor allocates it
  // outside mu_ (zero-filling a model-sized buffer under the lock stalled every handler).
  // With GPU staging, a rollout's CUDA buffers are staged on its GPU under the per-GPU budget and
  // are not counted here; the executor checks any that fall back to host memory.
  const bool gpu_staging = options_.device_staging != nullptr && options_.device_staging->enabled();
  int64_t staging = 0;
  for (int i = 0; i < exec->plan->slice.workers_size(); ++i) {
    const pb::PlanWorker& w = exec->plan->slice.workers(i);
    if (w.node_id() != options_.node_id || w.role() != pb::ROLE_ROLLOUT) continue;
    auto lw = workers_.find(w.worker_id());
    for (size_t j = 0; j < exec->plan->layouts[i].buffers.size(); ++j) {
      const bool cuda = lw != workers_.end() && j < lw->second.cuda.size() && lw->second.cuda[j] != nullptr;
      if (gpu_staging && cuda && !exec->plan->quantized[i]) continue;  // quantised: host staging (the quantiser runs there)
      staging += exec->plan->layouts[i].buffers[j].size_bytes;
    }
  }
  if (exec->plan->hosts_gather) staging += static_cast<int64_t>(exec->plan->slice.gather_staging_bytes());
  // The node's total (daemon/node/staging_budget.h), not this version's alone: other versions in
  // flight, snapshots and committed staging not applied yet count too.
  ASSIGN_OR_RETURN(exec->charge, budget_->Reserve(staging, absl::StrCat("the staging of model ", model_id, " version ", version)));
  exec->staging_bytes = staging;
  execs_[{model_id, version}] = exec;
  // Heartbeats report the version's progress while it exists (without mu_).
  if (coord_) coord_->TrackProgress(model_id, version, std::shared_ptr<const std::atomic<uint64_t>>(exec, &exec->bytes_done));
  return exec;
}

namespace {

// Where a canonical box lives: a worker piece, or the rank-0 gather staging entry of the op.
struct PieceAt {
  std::string key;  // region key of this version ("w<i>.b<j>" or "g")
  planner::Piece piece;
};

std::string RegionKey(uint32_t worker, int32_t buffer) { return absl::StrCat("w", worker, ".b", buffer); }

absl::StatusOr<PieceAt> ResolveSide(const std::vector<planner::WorkerLayout>& layouts, const pb::TransferOp& op, bool src) {
  const uint32_t worker = src ? op.src_worker() : op.dst_worker();
  const int32_t piece = src ? op.src_piece() : op.dst_piece();
  PieceAt at;
  if (piece >= 0) {
    if (worker >= layouts.size() || piece >= static_cast<int32_t>(layouts[worker].pieces.size())) {
      return absl::InvalidArgumentError(absl::StrCat("op ", op.index(), ": ", src ? "source" : "destination", " piece ", piece,
                                                     " of slice worker ", worker, " is not in the slice"));
    }
    at.piece = layouts[worker].pieces[piece];
    at.key = RegionKey(worker, at.piece.buffer);
    return at;
  }
  if (!op.has_staging_box()) return absl::InvalidArgumentError(absl::StrCat("op ", op.index(), ": staged side without staging_box"));
  at.key = "g";
  at.piece.tensor = op.tensor();
  at.piece.box = FromProto(op.staging_box());
  at.piece.buffer = 0;
  at.piece.offset_bytes = static_cast<int64_t>(op.staging_offset());
  std::vector<int64_t> extents;
  for (size_t d = 0; d < at.piece.box.begin.size(); ++d) extents.push_back(at.piece.box.end[d] - at.piece.box.begin[d]);
  at.piece.strides = planner::ContiguousStrides(extents);
  return at;
}

uint64_t BatchTag(const std::string& model, uint64_t version, uint32_t bucket) {
  // Unique among unfinished batches of one channel (one channel per model and peer).
  (void)model;
  return (version << 24) ^ bucket;
}

}  // namespace

std::shared_ptr<pb::NodeService::Stub> NodeDaemon::PeerStub(const std::string& peer, const std::string& address) {
  absl::MutexLock l(&stubs_mu_);
  PeerStubEntry& e = peer_stubs_[peer];
  if (!e.stub || e.address != address) {
    // A restarted peer listens on a new address: the old incarnation's gRPC channel is released
    // here (once no call holds it) instead of accumulating one channel per restart.
    e.address = address;
    e.stub = pb::NodeService::NewStub(options_.make_channel ? options_.make_channel(address)
                                                            : grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return e.stub;
}

void NodeDaemon::DropChannel(const std::string& model_id, const std::string& chan, transport::PeerId id) {
  {
    absl::MutexLock l(&mu_);
    auto it = channels_.find({model_id, chan});
    if (it != channels_.end() && it->second.id == id) channels_.erase(it);
  }
  const std::string name = ChannelTransportName(chan);
  transport::Transport* cross = name.empty() ? options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, true)
                                             : CrossTransport(name);
  if (cross != nullptr && id != transport::kNoPeer) (void)cross->Disconnect(id);
}

absl::StatusOr<transport::PeerId> NodeDaemon::SetupPeer(Exec& exec, const std::string& peer, const pb::PlanWorker& peer_worker,
                                                        transport::Transport* cross, const std::string& mine_name,
                                                        const std::string& theirs_name) {
  const std::string kind = mine_name == theirs_name ? mine_name : absl::StrCat(mine_name, " -> ", theirs_name);  // for messages
  const std::string chan = ChannelName(peer, mine_name, theirs_name);
  auto inst_it = peer_worker.transport_instances().find(theirs_name);
  if (inst_it == peer_worker.transport_instances().end()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", peer, " has no '", theirs_name, "' transport"));
  }
  const std::string& peer_instance = inst_it->second;
  transport::PeerId cached = transport::kNoPeer;
  transport::PeerId stale = transport::kNoPeer;
  {
    absl::MutexLock l(&mu_);
    auto c = channels_.find({exec.model_id, chan});
    if (c != channels_.end()) {
      if (c->second.peer_instance == peer_instance) {
        cached = c->second.id;
      } else {
        // The peer restarted (new transport instance): the old incarnation's channel is dead
        // and would otherwise be overwritten below without its sockets ever being closed.
        stale = c->second.id;
      }
    }
  }
  if (stale != transport::kNoPeer) DropChannel(exec.model_id, chan, stale);
  ASSIGN_OR_RETURN(std::string my_endpoint, cross->ExportEndpoint(peer_instance));
  bool reuse = false;
  std::string peer_endpoint;
  if (options_.node_id < peer) {
    // We call: the peer's regions and endpoint come back in the response.
    pb::ExchangeRegionsRequest req;
    req.set_model_id(exec.model_id);
    req.set_version(exec.version);
    req.set_plan_epoch(exec.epoch);
    req.set_from_node(options_.node_id);
    req.set_transport_kind(theirs_name);
    if (theirs_name != mine_name) req.set_from_transport(mine_name);
    req.set_endpoint(my_endpoint);
    req.set_reuse(cached != transport::kNoPeer);
    {
      absl::MutexLock l(&mu_);
      for (auto& [k, d] : exec.local_desc[mine_name]) {
        pb::PeerRegion* r = req.add_regions();
        r->set_key(k);
        r->set_region_descriptor(d);
      }
    }
    pb::ExchangeRegionsResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(exec.deadline));
    RETURN_IF_ERROR_WITH(FromGrpcStatus(PeerStub(peer, peer_worker.data_address())->ExchangeRegions(&ctx, req, &resp)),
                         absl::StrCat("exchanging regions with node ", peer));
    absl::MutexLock l(&mu_);
    PeerState& ps = exec.peers[chan];
    ps.have = true;
    ps.reuse = resp.reuse();
    ps.endpoint = resp.endpoint();
    for (const pb::PeerRegion& r : resp.regions()) ps.regions[r.key()] = r.region_descriptor();
    reuse = ps.reuse;
    peer_endpoint = ps.endpoint;
  } else {
    // The peer calls us (ExchangeRegions handler fills exec.peers[peer]).
    absl::MutexLock l(&mu_);
    auto have = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      auto it = exec.peers.find(chan);
      return exec.aborted || stopping_ || (it != exec.peers.end() && it->second.have);
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&have), exec.deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("node ", peer, " did not set up the data plane of version ", exec.version, " in time"));
    }
    if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    reuse = exec.peers[chan].reuse;
    peer_endpoint = exec.peers[chan].endpoint;
  }
  transport::PeerId id = cached;
  if (!reuse) {
    if (cached != transport::kNoPeer) DropChannel(exec.model_id, chan, cached);
    auto c = cross->Connect(peer_endpoint, exec.deadline);
    if (!c.ok()) return Annotate(c.status(), absl::StrCat("connecting to node ", peer, " (", kind, ")"));
    id = *c;
    Log(LogLevel::kDebug, "data channel connected", {{"model", exec.model_id}, {"version", exec.version}, {"peer", peer}, {"transport", kind}});
  }
  transport::PeerId replaced = transport::kNoPeer;
  absl::Status aborted;
  {
    absl::MutexLock l(&mu_);
    Channel& slot = channels_[{exec.model_id, chan}];
    // Another version of the model may have cached its own channel meanwhile; the one we replace
    // must be disconnected (its fds closed) unless a version in flight still uses it.
    if (slot.id != transport::kNoPeer && slot.id != id) {
      replaced = slot.id;
      for (auto& [key, other] : execs_) {
        for (auto& [p, used] : other->connected) {
          if (used == replaced) replaced = transport::kNoPeer;
        }
      }
    }
    slot = Channel{id, peer_instance};
    exec.connected[chan] = id;
    if (exec.aborted) aborted = absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
  }
  if (replaced != transport::kNoPeer) DropChannel(exec.model_id, chan, replaced);
  if (!aborted.ok()) return aborted;
  return id;
}

std::vector<std::thread> NodeDaemon::TakeFinishedExecThreadsLocked() {
  std::vector<std::thread> out;
  for (uint64_t id : exec_done_) {
    auto it = exec_threads_.find(id);
    if (it == exec_threads_.end()) continue;
    out.push_back(std::move(it->second));
    exec_threads_.erase(it);
  }
  exec_done_.clear();
  return out;
}

void NodeDaemon::MarkExecThreadDone(uint64_t id) {
  absl::MutexLock l(&mu_);
  exec_done_.push_back(id);
}

void NodeDaemon::RunExec(std::shared_ptr<Exec> exec) {
  absl::Time t0 = absl::Now();
  absl::Status s = RunExecInner(*exec);
  if (s.ok()) s = QuantizeIncoming(*exec);
  {
    // Before ReportDone: from here CommitVersion may make this staging the committed copy.
    absl::MutexLock l(&mu_);
    exec->transferred = s.ok();
    if (!s.ok()) {
      exec->failed = true;
      if (exec->error.empty()) exec->error = std::string(s.message());
    }
  }
  if (s.ok()) {
    // GB/s per link of this transfer (bytes over the summed batch times towards that peer).
    for (auto& [peer, ls] : exec->links) {
      if (ls.bytes > 0 && ls.seconds > 0) Metrics().Link(options_.node_id, peer, ls.bytes, ls.seconds);
    }
  }
  std::map<std::string, transport::PeerId> connected;
  {
    absl::MutexLock l(&mu_);
    connected = exec->connected;
  }
  if (!s.ok()) {
    // A failed batch may leave a channel unusable: start the next version on fresh ones.
    for (auto& [peer, id] : connected) DropChannel(exec->model_id, peer, id);
  }
  {
    absl::MutexLock l(&mu_);
    if (exec->aborted || stopping_) return;  // the coordinator already knows
  }
  Log(s.ok() ? LogLevel::kInfo : LogLevel::kWarning, s.ok() ? "version transferred" : "version failed",
      {{"node", options_.node_id}, {"model", exec->model_id}, {"version", exec->version}, {"bytes", exec->bytes_done.load()},
       {"seconds", absl::ToDoubleSeconds(absl::Now() - t0)}, {"staging_s", exec->staging_s}, {"setup_s", exec->setup_s},
       {"buckets_s", exec->buckets_s}, {"relay_bytes_at_commit", exec->relay_bytes_at_commit}, {"digest_s", exec->digest_s},
       {"digest_bytes", exec->digests.bytes}, {"error", s.message()}});
  pb::ReportDoneRequest req;
  req.set_node_id(options_.node_id);
  req.set_model_id(exec->model_id);
  req.set_version(exec->version);
  req.set_ok(s.ok());
  req.set_error(std::string(s.message()));
  req.set_bytes(exec->bytes_done.load());
  req.set_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  req.set_coordinator_instance(exec->coordinator_instance);
  for (const auto& [op, d] : exec->digests.source) {
    pb::OpDigest* o = req.add_source_digests();
    o->set_op(op);
    o->set_digest(d);
  }
  for (const auto& [op, d] : exec->digests.landed) {
    pb::OpDigest* o = req.add_landed_digests();
    o->set_op(op);
    o->set_digest(d);
  }
  req.set_catch_up(exec->catch_up);
  pb::ReportDoneResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Now() + absl::Seconds(10));
  coordinator_->ReportDone(&ctx, req, &resp);
}

absl::Status NodeDaemon::RunExecInner(Exec& exec) {
  const ModelPlan& plan = *exec.plan;
  const std::string& me = options_.node_id;
  using transport::MemoryKind;
  transport::Transport* local_t = options_.transports.Pick(MemoryKind::kHost, MemoryKind::kHost, false);
  transport::Transport* cross_t = options_.transports.Pick(MemoryKind::kHost, MemoryKind::kHost, true);
  transport::Transport* cuda_t = CudaTransport();
  const std::map<int, transport::Transport*> lanes = NcclLanes();
  auto is_local = [&](uint32_t w) { return plan.slice.workers(w).node_id() == me; };
  const std::string vlabel = absl::StrCat(exec.model_id, " v", exec.version);
  absl::Time phase_start = absl::Now();  // phase times for the "version transferred" log line
  auto end_phase = [&phase_start](double& into) {
    const absl::Time now = absl::Now();
    into = absl::ToDoubleSeconds(now - phase_start);
    phase_start = now;
  };

  // Local workers with an op to or from another node: their memory must be host memory that the
  // cross-node transport reaches (a rollout of theirs is staged in host memory; a trainer's CUDA
  // source gets a host copy below).
  std::set<uint32_t> crosses;
  std::set<uint32_t> nccl_in;  // local rollouts that receive over nccl (TransferOp.nccl)
  // Local regions (RegionKey) sent or received over nccl -> the lane (GPU) that moves them; the
  // coordinator picked it per op (TransferOp.nccl_src_device / nccl_dst_device), one per region.
  std::map<std::string, int> nccl_lane_of;
  for (const pb::TransferOp& op : plan.slice.ops()) {
    const bool s = is_local(op.src_worker()), d = is_local(op.dst_worker());
    if (s != d) crosses.insert(s ? op.src_worker() : op.dst_worker());
    if (s != d && op.nccl()) {
      const int lane = s ? op.nccl_src_device() : op.nccl_dst_device();
      if (lanes.count(lane) == 0) {
        return absl::FailedPreconditionError(absl::StrCat("op ", op.index(), " is routed over nccl lane ", NcclLaneName(lane), " but node ", me,
                                                          " has no such lane (--nccl_devices) with GPU staging (--gpu_staging_bytes)"));
      }
      if (d) nccl_in.insert(op.dst_worker());
      ASSIGN_OR_RETURN(PieceAt side, ResolveSide(plan.layouts, op, s));
      auto [it, inserted] = nccl_lane_of.emplace(side.key, lane);
      if (!inserted && it->second != lane) {
        return absl::InvalidArgumentError(absl::StrCat("op ", op.index(), ": region ", side.key, " on node ", me, " is routed over nccl lanes ",
                                                       NcclLaneName(it->second), " and ", NcclLaneName(lane), " (one lane per region)"));
      }
    }
  }

  // 0. Staging of this version, allocated here (outside mu_). A rollout whose live buffers are
  //    CUDA memory and that exchanges nothing with other nodes is staged on its GPU when the
  //    GPU staging budget allows (GPU-direct: the version never leaves the GPUs).
  {
    std::map<std::string, std::vector<std::shared_ptr<CudaImport>>> rollout_cuda;
    {
      absl::MutexLock l(&mu_);
      for (int i = 0; i < plan.slice.workers_size(); ++i) {
        const pb::PlanWorker& w = plan.slice.workers(i);
        if (w.node_id() != me || w.role() != pb::ROLE_ROLLOUT) continue;
        auto it = workers_.find(w.worker_id());
        if (it != workers_.end()) rollout_cuda[w.worker_id()] = it->second.cuda;
      }
    }
    std::map<std::string, std::shared_ptr<Bytes>> incoming;
    std::shared_ptr<Bytes> gather;
    for (int i = 0; i < plan.slice.workers_size(); ++i) {
      const pb::PlanWorker& w = plan.slice.workers(i);
      if (w.node_id() != me || w.role() != pb::ROLE_ROLLOUT) continue;
      const std::vector<std::shared_ptr<CudaImport>>& cuda = rollout_cuda[w.worker_id()];
      std::shared_ptr<Bytes> bytes = NewBytes(0, {exec.charge});
      for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) {
        const int64_t size = plan.layouts[i].buffers[j].size_bytes;
        StagedBuffer sb;
        if (plan.quantized[i] && nccl_lane_of.count(RegionKey(i, j)) > 0) {
          return absl::FailedPreconditionError(absl::StrCat(vlabel, ": rollout ", w.worker_id(), " holds quantised pieces (host staging) ",
                                                            "but buffer ", j, " is routed over nccl"));
        }
        if (j < cuda.size() && cuda[j] != nullptr && !plan.quantized[i]) {
          const std::string what = absl::StrCat(vlabel, " incoming ", w.worker_id(), " b", j);
          auto lane = nccl_lane_of.find(RegionKey(i, j));
          if (lane != nccl_lane_of.end()) {
            // Received over nccl: staged on the lane's GPU (the buffer's own GPU when it has a lane;
            // commit/apply copy it to the worker's buffer).
            ASSIGN_OR_RETURN(sb.device, TryDeviceStaging(lane->second, size, what));
            if (sb.device == nullptr) {
              return absl::ResourceExhaustedError(absl::StrCat(what, ": ", size, " bytes of GPU staging on GPU ", lane->second,
                                                               " (nccl route) exceed --gpu_staging_bytes or the GPU's free memory"));
            }
          } else if (crosses.count(static_cast<uint32_t>(i)) == 0 || nccl_in.count(static_cast<uint32_t>(i)) > 0) {
            // Nothing from another node lands in this buffer except over nccl: stage it on its GPU.
            ASSIGN_OR_RETURN(sb.device, TryDeviceStaging(cuda[j]->device, size, what));
          }
          Metrics().Staged(me, sb.device ? "gpu" : "host", "incoming", static_cast<uint64_t>(size));
          if (sb.device == nullptr && options_.device_staging != nullptr && options_.device_staging->enabled()) {
            // Not counted in exec.staging_bytes (expected on the GPU): reserved from the host budget now.
            ASSIGN_OR_RETURN(std::shared_ptr<StagingBudget::Charge> extra,
                             budget_->Reserve(size, absl::StrCat(vlabel, " incoming ", w.worker_id(), " b", j,
                                                                 " (a CUDA buffer that did not fit the GPU staging budget)")));
            bytes = KeepWith(std::move(bytes), std::move(extra));
          }
        }
        if (sb.device == nullptr) sb.host = TakeHost(size);  // recycled: see daemon/staging_pool.h
        bytes->push_back(std::move(sb));
      }
      incoming[w.worker_id()] = std::move(bytes);
    }
    if (plan.hosts_gather) {
      gather = NewBytes(1, {exec.charge});
      (*gather)[0].host = TakeHost(static_cast<int64_t>(plan.slice.gather_staging_bytes()));
    }
    absl::MutexLock l(&mu_);
    exec.incoming = std::move(incoming);
    exec.gather = std::move(gather);
  }
  end_phase(exec.staging_s);

  // 1. The memory of this version on this node: host memory, or CUDA memory (a worker's imported
  //    buffer, or GPU staging of the daemon).
  struct Mem {
    MemoryKind kind = MemoryKind::kHost;
    uint8_t* base = nullptr;  // host address, or device pointer of GPU staging
    int64_t size = 0;
    int device = -1;
    std::shared_ptr<CudaImport> import;  // a worker's CUDA buffer (already a cuda_ipc region)
  };
  std::map<std::string, Mem> mem;
  std::vector<std::shared_ptr<void>> holds;  // keeps snapshots / segments / staging alive
  // Sync: trainers' live segments read in place (checked again after the buckets: a trainer may
  // truncate its memory mid-version; ShmSegment's SIGBUS guard keeps the daemon alive meanwhile).
  std::vector<std::pair<std::string, std::shared_ptr<transport::ShmSegment>>> live_sources;
  auto staged = [](const StagedBuffer& b) {
    Mem m;
    m.size = b.size();
    if (b.device) {
      m.kind = MemoryKind::kCuda;
      m.base = static_cast<uint8_t*>(b.device->data());
      m.device = b.device->device();
    } else {
      m.base = const_cast<uint8_t*>(b.host.data());
    }
    return m;
  };
  {
    absl::MutexLock l(&mu_);
    if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    for (int i = 0; i < plan.slice.workers_size(); ++i) {
      const pb::PlanWorker& pw = plan.slice.workers(i);
      if (pw.node_id() != me) continue;
      const planner::WorkerLayout& layout = plan.layouts[i];
      if (pw.role() == pb::ROLE_ROLLOUT) {
        std::shared_ptr<Bytes> staging = exec.incoming.at(pw.worker_id());
        holds.push_back(staging);
        for (size_t j = 0; j < staging->size(); ++j) mem[RegionKey(i, j)] = staged((*staging)[j]);
        continue;
      }
      auto w = workers_.find(pw.worker_id());
      if (w == workers_.end() || !w->second.has_layout) {
        return absl::FailedPreconditionError(absl::StrCat("trainer worker ", pw.worker_id(), " is gone from node ", me));
      }
      if (w->second.buffers.size() < layout.buffers.size()) {
        return absl::FailedPreconditionError(absl::StrCat("trainer worker ", pw.worker_id(), " has fewer buffers than its layout"));
      }
      if (exec.catch_up) {
        // Catch-up source (docs/daemon.md "Catch-up"): a rollout holding the committed version,
        // read in place: its committed staging while held, else its live buffers when they hold
        // exactly that version whole (no newer version commits while a catch-up runs, so no
        // commit or Apply writes them meanwhile).
        const LocalWorker& src = w->second;
        const std::string what = absl::StrCat("catch-up source rollout ", pw.worker_id(), " on node ", me);
        if (src.role != planner::Role::kRollout) return absl::FailedPreconditionError(absl::StrCat(what, ": not a rollout here"));
        if (src.committed != nullptr && src.committed_version == exec.version) {
          holds.push_back(src.committed);
          for (size_t j = 0; j < src.committed->size(); ++j) mem[RegionKey(i, j)] = staged((*src.committed)[j]);
          continue;
        }
        if (src.applied_version != exec.version || live_.Copying(pw.worker_id()) || !live_.TornError(pw.worker_id(), me).ok()) {
          return absl::FailedPreconditionError(absl::StrCat(what, " no longer holds version ", exec.version, " (committed staging: version ",
                                                            src.committed != nullptr ? src.committed_version : 0, ", live weights: version ",
                                                            src.applied_version, live_.Copying(pw.worker_id()) ? ", being written" : "", ")"));
        }
        for (size_t j = 0; j < layout.buffers.size(); ++j) {
          auto seg = src.buffers[j];
          if (seg == nullptr) return absl::FailedPreconditionError(absl::StrCat(what, " buffer ", j, ": CUDA memory is not a catch-up source"));
          if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
            return absl::Status(intact.code(), absl::StrCat(what, " buffer ", j, ": ", intact.message()));
          }
          live_sources.push_back({absl::StrCat(what, " buffer ", j), seg});
          holds.push_back(seg);
          mem[RegionKey(i, j)] = Mem{MemoryKind::kHost, static_cast<uint8_t*>(seg->data()), seg->size(), -1, nullptr};
        }
        continue;
      }
      if (plan.slice.mode() == pb::MODE_SYNC) {
        // Live buffers (the trainer is paused in Publish meanwhile).
        for (size_t j = 0; j < layout.buffers.size(); ++j) {
          auto seg = w->second.buffers[j];
          if (seg == nullptr) {
            std::shared_ptr<CudaImport> imp = w->second.cuda[j];
            holds.push_back(imp);
            mem[RegionKey(i, j)] = Mem{MemoryKind::kCuda, nullptr, imp->size, imp->device, imp};
            continue;
          }
          if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
            return absl::Status(intact.code(), absl::StrCat("trainer worker ", pw.worker_id(), " buffer ", j, ": ", intact.message()));
          }
          live_sources.push_back({absl::StrCat("trainer worker ", pw.worker_id(), " buffer ", j), seg});
          holds.push_back(seg);
          mem[RegionKey(i, j)] = Mem{MemoryKind::kHost, static_cast<uint8_t*>(seg->data()), seg->size(), -1, nullptr};
        }
      } else {
        auto snap = w->second.snapshots.find(exec.version);
        if (snap == w->second.snapshots.end()) {
          return absl::FailedPreconditionError(absl::StrCat("no snapshot of version ", exec.version, " for worker ", pw.worker_id()));
        }
        holds.push_back(snap->second);
        for (size_t j = 0; j < snap->second->size(); ++j) mem[RegionKey(i, j)] = staged((*snap->second)[j]);
      }
    }
    if (exec.gather) {
      holds.push_back(exec.gather);
      mem["g"] = staged((*exec.gather)[0]);
    }
  }

  // 2. Which ops run where, and which memory each transport must reach: same-node ops between
  //    host memory on the host transport, same-node ops with a CUDA side on cuda_ipc (device to
  //    device when both sides are on GPUs), and per peer node the mirror batches on the
  //    cross-node transport (host memory only).
  std::set<std::string> peers, host_keys, cuda_keys, cross_keys;
  // Ops with TransferOp.nccl: per peer node, the lane pairs (our GPU, the peer's GPU) they use.
  std::map<std::string, std::set<std::pair<int, int>>> nccl_pairs;
  auto kind_of = [&](const std::string& key) {
    auto it = mem.find(key);
    return it == mem.end() ? MemoryKind::kHost : it->second.kind;
  };
  for (const pb::TransferOp& op : plan.slice.ops()) {
    const bool s = is_local(op.src_worker()), d = is_local(op.dst_worker());
    if (!s && !d) continue;
    ASSIGN_OR_RETURN(PieceAt src, ResolveSide(plan.layouts, op, true));
    ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(plan.layouts, op, false));
    if (s && d) {
      const bool host = kind_of(src.key) == MemoryKind::kHost && kind_of(dst.key) == MemoryKind::kHost;
      (host ? host_keys : cuda_keys).insert({src.key, dst.key});
      continue;
    }
    const std::string& key = s ? src.key : dst.key;
    if (op.nccl()) {
      const std::pair<int, int> pair = s ? std::pair{op.nccl_src_device(), op.nccl_dst_device()} : std::pair{op.nccl_dst_device(), op.nccl_src_device()};
      nccl_pairs[plan.slice.workers(s ? op.dst_worker() : op.src_worker()).node_id()].insert(pair);
      continue;
    }
    peers.insert(plan.slice.workers(s ? op.dst_worker() : op.src_worker()).node_id());
    if (!s && kind_of(key) == MemoryKind::kCuda) {
      return absl::InternalError(absl::StrCat("op ", op.index(), ": region ", key, " on node ", me,
                                              " receives from another node but is staged on a GPU"));
    }
    cross_keys.insert(key);
  }
  if (!host_keys.empty() && local_t == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no same-node host transport"));
  if (!cuda_keys.empty() && cuda_t == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cuda_ipc transport"));
  if (!peers.empty() && cross_t == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cross-node host transport"));
  for (const std::string& key : host_keys) {
    if (mem.count(key) == 0) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
  }

  // Registered regions are released on every path (after every posted batch was waited for).
  struct Registered {
    transport::Transport* t;
    transport::RegionHandle h;
  };
  std::vector<Registered> registered;
  auto release_all = [&] {
    for (auto& r : registered) (void)r.t->Release(r.h);
    registered.clear();
  };
  absl::Cleanup cleanup = release_all;
  auto register_on = [&](transport::Transport* t, const std::string& key, const Mem& m) -> absl::StatusOr<transport::RegionHandle> {
    if (m.import != nullptr) return m.import->h;  // owned by the worker's import, not by this version
    transport::MemorySpec spec;
    spec.kind = m.kind;
    spec.base = m.base;
    spec.size_bytes = m.size;
    spec.device = m.device;
    spec.label = absl::StrCat(vlabel, " ", key);
    ASSIGN_OR_RETURN(transport::RegionHandle h, t->RegisterMemory(spec));
    registered.push_back({t, h});
    return h;
  };
  std::map<std::string, transport::RegionHandle> local_h, cuda_h, cross_h;
  for (const std::string& key : host_keys) {
    ASSIGN_OR_RETURN(local_h[key], register_on(local_t, key, mem.at(key)));
  }
  for (const std::string& key : cuda_keys) {
    auto m = mem.find(key);
    if (m == mem.end()) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
    ASSIGN_OR_RETURN(cuda_h[key], register_on(cuda_t, key, m->second));
  }
  // A CUDA source of cross-node ops (a sync trainer's live buffer, or a snapshot on its GPU) is
  // copied to host memory once, before the first bucket: the cross-node transport reaches host
  // memory only, and sources do not change during a version.
  std::map<std::string, Mem> host_copy;  // key -> host copy of a CUDA source of cross-node ops
  {
    transport::Batch d2h;
    for (const std::string& key : cross_keys) {
      auto m = mem.find(key);
      if (m == mem.end() || m->second.kind != MemoryKind::kCuda) continue;
      if (cuda_t == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cuda_ipc transport"));
      auto host = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(m->second.size));
      holds.push_back(host);
      ASSIGN_OR_RETURN(transport::RegionHandle src, register_on(cuda_t, key, m->second));
      Mem hm{MemoryKind::kHost, host->data(), m->second.size, -1, nullptr};
      ASSIGN_OR_RETURN(transport::RegionHandle dst, register_on(cuda_t, key + " (host copy)", hm));
      transport::CopyOp op;
      op.shape = {hm.size};
      op.element_size = 1;
      op.src = {src, 0, {1}};
      op.dst = {dst, 0, {1}};
      d2h.ops.push_back(std::move(op));
      host_copy[key] = hm;
    }
    if (!d2h.ops.empty()) {
      ASSIGN_OR_RETURN(transport::BatchId id, cuda_t->Post(d2h));
      RETURN_IF_ERROR_WITH(cuda_t->Wait(id, exec.deadline), absl::StrCat(vlabel, ": copying CUDA sources to host for other nodes"));
    }
  }
  for (const std::string& key : cross_keys) {
    auto m = mem.find(key);
    if (m == mem.end()) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
    auto hc = host_copy.find(key);
    ASSIGN_OR_RETURN(cross_h[key], register_on(cross_t, key, hc != host_copy.end() ? hc->second : m->second));
  }
  // nccl regions, each on its lane's transport: GPU staging on the lane's GPU is registered as is;
  // any other source (a worker's imported buffer, a snapshot in host memory or on a GPU without a
  // lane) is first copied whole into GPU staging on the lane's GPU (sources do not change during
  // a version).
  std::map<std::string, transport::RegionHandle> nccl_h;  // key -> region on lanes.at(nccl_lane_of[key])
  {
    transport::Batch bounce_batch;
    for (const auto& [key, lane] : nccl_lane_of) {
      transport::Transport* nccl_t = lanes.at(lane);
      auto m = mem.find(key);
      if (m == mem.end()) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
      const Mem& src = m->second;
      if (src.kind == MemoryKind::kCuda && src.import == nullptr && src.device == lane) {
        ASSIGN_OR_RETURN(nccl_h[key], register_on(nccl_t, key, src));
        continue;
      }
      if (key[0] != 'w' || cuda_t == nullptr) {
        return absl::InternalError(absl::StrCat("region ", key, " on node ", me, " is routed over nccl but is not GPU staging"));
      }
      const std::string what = absl::StrCat(vlabel, " ", key, " (nccl source copy)");
      ASSIGN_OR_RETURN(std::shared_ptr<transport::DeviceMemory> dev, TryDeviceStaging(lane, src.size, what));
      if (dev == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(what, ": ", src.size, " bytes of GPU staging on GPU ", lane,
                                                         " exceed --gpu_staging_bytes or the GPU's free memory"));
      }
      Metrics().NcclBounce(me, static_cast<uint64_t>(src.size));
      holds.push_back(dev);
      Mem dm{MemoryKind::kCuda, static_cast<uint8_t*>(dev->data()), src.size, dev->device(), nullptr};
      ASSIGN_OR_RETURN(transport::RegionHandle from, register_on(cuda_t, key, src));
      ASSIGN_OR_RETURN(transport::RegionHandle to, register_on(cuda_t, what, dm));
      transport::CopyOp op;
      op.shape = {src.size};
      op.element_size = 1;
      op.src = {from, 0, {1}};
      op.dst = {to, 0, {1}};
      bounce_batch.ops.push_back(std::move(op));
      ASSIGN_OR_RETURN(nccl_h[key], register_on(nccl_t, key, dm));
    }
    if (!bounce_batch.ops.empty()) {
      ASSIGN_OR_RETURN(transport::BatchId id, cuda_t->Post(bounce_batch));
      RETURN_IF_ERROR_WITH(cuda_t->Wait(id, exec.deadline), absl::StrCat(vlabel, ": copying nccl sources to their lanes' GPUs"));
    }
  }
  {
    std::map<std::string, std::map<std::string, std::string>> desc;
    for (auto& [key, h] : cross_h) {
      ASSIGN_OR_RETURN(desc[cross_t->capabilities().kind][key], cross_t->ExportDescriptor(h));
    }
    for (auto& [key, h] : nccl_h) {
      const int lane = nccl_lane_of.at(key);
      ASSIGN_OR_RETURN(desc[NcclLaneName(lane)][key], lanes.at(lane)->ExportDescriptor(h));
    }
    absl::MutexLock l(&mu_);
    exec.local_desc = std::move(desc);
    exec.regions_ready = true;
  }

  // 3. Channels to peers (keyed by ChannelName: the peer for the host channel, peer + lane pair for
  //    nccl), set up by up to kMaxChannelSetups threads. Each Connect waits for the peer's, so
  //    both nodes start their channels in one global order (smaller node id, larger node id, host
  //    channel before nccl, GPU on the smaller node, GPU on the larger): a channel starts only
  //    after every smaller one of this node has started, so the smallest unfinished channel always
  //    has both nodes at it (no cycle, whatever the number of threads), while up to
  //    kMaxChannelSetups communicators initialise at once (NCCL's init takes a while per lane pair).
  std::map<std::string, transport::PeerId> ids;
  std::map<std::string, std::map<std::string, transport::RegionHandle>> remote_h;
  {
    struct ChannelTask {
      std::tuple<std::string, std::string, int, int, int> order;
      std::string peer;
      const pb::PlanWorker* pw = nullptr;
      transport::Transport* t = nullptr;
      std::string mine, theirs;
    };
    std::vector<ChannelTask> tasks;
    std::set<std::string> all_peers = peers;
    for (auto& [peer, pairs] : nccl_pairs) all_peers.insert(peer);
    for (const std::string& peer : all_peers) {
      const pb::PlanWorker* pw = nullptr;
      for (const pb::PlanWorker& w : plan.slice.workers()) {
        if (w.node_id() == peer) pw = &w;
      }
      const std::string& lo = std::min(me, peer);
      const std::string& hi = std::max(me, peer);
      if (peers.count(peer)) {
        const std::string kind = cross_t->capabilities().kind;
        tasks.push_back({{lo, hi, 0, -1, -1}, peer, pw, cross_t, kind, kind});
      }
      for (auto [mine, theirs] : nccl_pairs[peer]) {
        tasks.push_back({{lo, hi, 1, me < peer ? mine : theirs, me < peer ? theirs : mine}, peer, pw, lanes.at(mine), NcclLaneName(mine),
                         NcclLaneName(theirs)});
      }
    }
    std::sort(tasks.begin(), tasks.end(), [](const ChannelTask& x, const ChannelTask& y) { return x.order < y.order; });
    absl::Mutex setup_mu;  // guards next, setup_error, ids, remote_h and registered while the threads run
    size_t next = 0;
    absl::Status setup_error;
    auto work = [&] {
      while (true) {
        size_t i = 0;
        {
          absl::MutexLock l(&setup_mu);
          if (!setup_error.ok() || next >= tasks.size()) return;
          i = next++;
        }
        const ChannelTask& task = tasks[i];
        const std::string chan = ChannelName(task.peer, task.mine, task.theirs);
        absl::StatusOr<transport::PeerId> id = SetupPeer(exec, task.peer, *task.pw, task.t, task.mine, task.theirs);
        absl::Status s = id.status();
        std::map<std::string, std::string> regions;
        if (s.ok()) {
          absl::MutexLock l(&mu_);
          regions = exec.peers[chan].regions;
        }
        std::map<std::string, transport::RegionHandle> imported;
        for (auto& [key, d] : regions) {
          auto h = task.t->ImportDescriptor(d);
          if (!h.ok()) {
            s = Annotate(h.status(), absl::StrCat("importing region ", key, " of node ", task.peer, " (", task.theirs, ")"));
            break;
          }
          imported[key] = *h;
        }
        absl::MutexLock l(&setup_mu);
        for (auto& [key, h] : imported) registered.push_back({task.t, h});
        if (!s.ok()) {
          if (setup_error.ok()) setup_error = s;
          return;
        }
        ids[chan] = *id;
        remote_h[chan] = std::move(imported);
      }
    };
    const size_t threads = std::min(tasks.size(), kMaxChannelSetups);
    if (threads <= 1) {
      work();
    } else {
      std::vector<std::thread> pool;
      for (size_t i = 0; i < threads; ++i) pool.emplace_back(work);
      for (std::thread& t : pool) t.join();
    }
    RETURN_IF_ERROR(setup_error);
  }

  // 4. Buckets.
  end_phase(exec.setup_s);
  std::map<std::string, std::string> peer_instances;  // the peers' host-channel transport instance -> node (NicMeter)
  if (cross_t != nullptr) {
    const std::string kind = cross_t->capabilities().kind;
    for (const pb::PlanWorker& w : plan.slice.workers()) {
      auto it = w.transport_instances().find(kind);
      if (w.node_id() != me && it != w.transport_instances().end()) peer_instances[it->second] = w.node_id();
    }
  }
  std::vector<std::vector<const pb::TransferOp*>> by_bucket(plan.slice.num_buckets());
  for (const pb::TransferOp& op : plan.slice.ops()) by_bucket[op.bucket()].push_back(&op);
  for (auto& ops : by_bucket) {
    std::sort(ops.begin(), ops.end(), [](const pb::TransferOp* a, const pb::TransferOp* b) { return a->index() < b->index(); });
  }
  // Relays at commit (sync mode). A same-node relay from rollout A's staging into rollout B's
  // staging would copy the bytes twice on this node: once in its bucket, again when the commit
  // copies B's staging into B's live buffers. When relays fill whole pieces of B that no op reads
  // (no further relay from them; rollout pieces never overlap), the commit copies those pieces
  // from A's staging straight into B's live buffers instead, and the buckets skip them.
  // Atomicity is the same: live weights still change only at the commit, from staging that holds
  // the whole version (A's pieces are read by these relays, so they are never left to a commit).
  std::set<uint32_t> at_commit;  // op indices left to the commit
  if (plan.slice.mode() == pb::MODE_SYNC) {
    std::set<std::pair<uint32_t, int32_t>> read;  // (slice worker, piece) some op of the slice reads
    for (const pb::TransferOp& op : plan.slice.ops()) {
      if (op.src_piece() >= 0) read.insert({op.src_worker(), op.src_piece()});
    }
    std::set<uint32_t> host_live;  // local sync rollouts with host live buffers and no quantised pieces
    {
      absl::MutexLock l(&mu_);
      for (int i = 0; i < plan.slice.workers_size(); ++i) {
        const pb::PlanWorker& pw = plan.slice.workers(i);
        if (pw.node_id() != me || pw.role() != pb::ROLE_ROLLOUT || plan.quantized[i]) continue;
        auto w = workers_.find(pw.worker_id());
        if (w == workers_.end() || w->second.mode != pb::MODE_SYNC || w->second.buffers.size() < plan.layouts[i].buffers.size()) continue;
        bool host = true;
        for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) host = host && w->second.buffers[j] != nullptr;
        if (host) host_live.insert(static_cast<uint32_t>(i));
      }
    }
    // (destination worker, piece) -> bytes of candidate relays into it, and those relays.
    std::map<std::pair<uint32_t, int32_t>, std::pair<int64_t, std::vector<const pb::TransferOp*>>> by_piece;
    for (const pb::TransferOp& op : plan.slice.ops()) {
      if (!is_local(op.src_worker()) || !is_local(op.dst_worker()) || op.src_piece() < 0 || op.dst_piece() < 0) continue;
      if (plan.slice.workers(op.src_worker()).role() != pb::ROLE_ROLLOUT || host_live.count(op.dst_worker()) == 0) continue;
      ASSIGN_OR_RETURN(PieceAt src, ResolveSide(plan.layouts, op, true));
      ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(plan.layouts, op, false));
      if (read.count({op.dst_worker(), op.dst_piece()}) > 0 || kind_of(src.key) != MemoryKind::kHost || kind_of(dst.key) != MemoryKind::kHost) continue;
      auto& e = by_piece[{op.dst_worker(), op.dst_piece()}];
      e.first += static_cast<int64_t>(op.bytes());
      e.second.push_back(&op);
    }
    std::map<std::string, std::vector<Exec::RelayAtCommit>> relays;
    std::map<std::string, std::set<int32_t>> pieces;
    uint64_t relay_bytes = 0;
    for (auto& [at, e] : by_piece) {
      const planner::Piece& p = plan.layouts[at.first].pieces[at.second];
      if (e.first != planner::BoxVolume(p.box) * planner::DTypeSize(plan.inventory.tensors[p.tensor].dtype)) continue;  // partly filled otherwise
      const std::string& dst_worker = plan.slice.workers(at.first).worker_id();
      for (const pb::TransferOp* op : e.second) {
        ASSIGN_OR_RETURN(PieceAt src, ResolveSide(plan.layouts, *op, true));
        ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(plan.layouts, *op, false));
        const int elem = planner::DTypeSize(plan.inventory.tensors[op->tensor()].dtype);
        const planner::Box box = FromProto(op->box());
        Exec::RelayAtCommit r;
        r.src_worker = plan.slice.workers(op->src_worker()).worker_id();
        r.src_buffer = src.piece.buffer;
        r.dst_buffer = dst.piece.buffer;
        for (size_t d = 0; d < box.begin.size(); ++d) r.op.shape.push_back(box.end[d] - box.begin[d]);
        r.op.element_size = elem;
        r.op.src = RefFor(src.piece, box, elem, {});
        r.op.dst = RefFor(dst.piece, box, elem, {});  // live layout = staging layout (no quantised pieces)
        relays[dst_worker].push_back(std::move(r));
        at_commit.insert(op->index());
        relay_bytes += op->bytes();
      }
      pieces[dst_worker].insert(at.second);
    }
    absl::MutexLock l(&mu_);
    exec.relays_at_commit = std::move(relays);
    exec.pieces_at_commit = std::move(pieces);
    exec.relay_bytes_at_commit = relay_bytes;
  }
  // Local regions this version writes: rollout incoming staging and the gather staging. A batch
  // that reads one of them (a relay, a read of gathered data) needs every earlier bucket complete;
  // every other batch only reads sources that do not change during the version (trainer live
  // buffers or snapshots) and only writes bytes nothing else of this version writes.
  std::set<std::string> written;
  for (int i = 0; i < plan.slice.workers_size(); ++i) {
    if (plan.slice.workers(i).node_id() != me || plan.slice.workers(i).role() != pb::ROLE_ROLLOUT) continue;
    for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) written.insert(RegionKey(static_cast<uint32_t>(i), static_cast<int32_t>(j)));
  }
  if (plan.hosts_gather) written.insert("g");
  // One batch per transport route and bucket: same-node host copies, same-node CUDA copies, per
  // peer channel.
  struct Route {
    transport::Transport* t = nullptr;
    transport::Batch batch;
    std::string what;
    std::string peer;  // metrics label: the peer node (own id for same-node copies)
    int64_t bytes = 0;
    int64_t incoming = 0;       // bytes landing on this node (progress)
    uint32_t bucket = 0;
    bool reads_written = false;  // reads a region of `written` (see above)
    std::pair<int, int> lane{-1, -1};  // nccl: (our GPU, the peer's GPU)
    // nccl: the channel's place in the global order of all nccl channels (smaller node id, larger
    // node id, GPU on the smaller, GPU on the larger); see the lane schedule below.
    std::tuple<std::string, std::string, int, int> order;
  };
  // Pipelining: buckets are not run one after another with a barrier in between. A batch that
  // reads nothing this version writes is posted as soon as its bucket comes up, so the streams to
  // a peer go on with bucket b+1 while relays of bucket b copy; a batch that reads written regions
  // is posted once every batch of earlier buckets completed (what the planner promises a relay).
  // Per channel, both nodes still post in bucket order (a channel's bucket b batch is posted in
  // iteration b, after its bucket b-1 batch), so every stream carries bucket b-1's bytes before
  // bucket b's on both sides and mirror batches cannot wait on each other in a cycle. Buckets
  // with nccl routes keep the barrier and the lane schedule below.
  std::vector<std::unique_ptr<Route>> routes_alive;  // every route of the version (posted batches reference them)
  std::vector<std::pair<Route*, transport::BatchId>> outstanding;  // posted, not yet waited for (post order)
  std::map<std::string, absl::Time> first_post;  // per peer: when its first batch of the version was posted
  absl::Mutex result_mu;  // guards `first`, exec.links and first_post while GPU schedule threads run
  absl::Status first;
  auto finish = [&](Route* r, const absl::Status& s) {
    absl::MutexLock l(&result_mu);
    if (!s.ok() && first.ok()) first = Annotate(s, absl::StrCat("bucket ", r->bucket, ", ", r->what));
    if (!s.ok()) return;
    // Bytes per route (transport kind) and peer; link time = the peer's first post -> this batch's
    // completion (the union over its overlapping batches).
    Metrics().Bytes(me, exec.model_id, r->t->capabilities().kind, r->peer, static_cast<uint64_t>(r->bytes));
    if (r->lane.first >= 0) Metrics().NcclLane(me, r->peer, r->lane.first, r->lane.second, static_cast<uint64_t>(r->bytes));
    LinkStat& ls = exec.links[r->peer];
    ls.bytes += static_cast<uint64_t>(r->bytes);
    ls.seconds = std::max(ls.seconds, absl::ToDoubleSeconds(absl::Now() - first_post[r->peer]));
    exec.bytes_done += static_cast<uint64_t>(r->incoming);
  };
  auto post = [&](Route* r) {
    {
      absl::MutexLock l(&result_mu);
      first_post.emplace(r->peer, absl::Now());
    }
    r->batch.tag = BatchTag(exec.model_id, exec.version, r->bucket);
    auto id = r->t->Post(r->batch);
    if (!id.ok()) {
      finish(r, id.status());
      return;
    }
    outstanding.push_back({r, *id});
  };
  // Waits for the outstanding batches of buckets before `bucket` (all of them by default), each
  // exactly once; a failure is kept in `first`.
  auto wait_before = [&](uint32_t bucket = std::numeric_limits<uint32_t>::max()) {
    std::vector<std::pair<Route*, transport::BatchId>> later;
    for (auto& [r, id] : outstanding) {
      if (r->bucket >= bucket) {
        later.push_back({r, id});
        continue;
      }
      finish(r, r->t->Wait(id, exec.deadline));
    }
    outstanding = std::move(later);
    // Per-NIC bytes of the host channel (also of a failed batch: those bytes did cross the wire).
    if (cross_t != nullptr && !peer_instances.empty()) nic_meter_.Record(Metrics(), me, cross_t->stats().paths, peer_instances);
  };
  auto failed = [&] {
    absl::MutexLock l(&result_mu);
    return !first.ok();
  };
  // Builds the routes of bucket b.
  auto make_routes = [&](uint32_t b, std::vector<Route*>& out) -> absl::Status {
    Route* host_route = nullptr;
    Route* cuda_route = nullptr;
    std::map<std::string, Route*> peer_routes;
    auto add = [&](Route r) {
      r.bucket = b;
      routes_alive.push_back(std::make_unique<Route>(std::move(r)));
      out.push_back(routes_alive.back().get());
      return out.back();
    };
    for (const pb::TransferOp* op : by_bucket[b]) {
      const bool s_local = is_local(op->src_worker()), d_local = is_local(op->dst_worker());
      if ((!s_local && !d_local) || at_commit.count(op->index()) > 0) continue;
      ASSIGN_OR_RETURN(PieceAt src, ResolveSide(plan.layouts, *op, true));
      ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(plan.layouts, *op, false));
      const int elem = planner::DTypeSize(plan.inventory.tensors[op->tensor()].dtype);
      const planner::Box box = FromProto(op->box());
      transport::CopyOp c;
      for (size_t d = 0; d < box.begin.size(); ++d) c.shape.push_back(box.end[d] - box.begin[d]);
      c.element_size = elem;
      const bool reads_written = s_local && written.count(src.key) > 0;
      if (s_local && d_local) {
        const bool host = kind_of(src.key) == MemoryKind::kHost && kind_of(dst.key) == MemoryKind::kHost;
        auto& handles = host ? local_h : cuda_h;
        Route*& route = host ? host_route : cuda_route;
        if (route == nullptr) route = host ? add(Route{local_t, {}, "same-node copies", me}) : add(Route{cuda_t, {}, "same-node CUDA copies", me});
        auto sh = handles.find(src.key), dh = handles.find(dst.key);
        if (sh == handles.end() || dh == handles.end()) {
          return absl::InternalError(absl::StrCat("op ", op->index(), ": region ", src.key, " or ", dst.key, " missing on node ", me));
        }
        c.src = RefFor(src.piece, box, elem, sh->second);
        c.dst = RefFor(dst.piece, box, elem, dh->second);
        route->batch.ops.push_back(std::move(c));
        route->bytes += static_cast<int64_t>(op->bytes());
        route->incoming += static_cast<int64_t>(op->bytes());
        route->reads_written = route->reads_written || reads_written;
        continue;
      }
      const std::string peer = plan.slice.workers(s_local ? op->dst_worker() : op->src_worker()).node_id();
      const bool nccl = op->nccl();
      const int my_lane = s_local ? op->nccl_src_device() : op->nccl_dst_device();
      const int their_lane = s_local ? op->nccl_dst_device() : op->nccl_src_device();
      const std::string chan = nccl ? ChannelName(peer, NcclLaneName(my_lane), NcclLaneName(their_lane)) : ChannelName(peer, "", "");
      auto& mine = nccl ? nccl_h : cross_h;
      auto& theirs = remote_h[chan];
      auto sh = s_local ? mine.find(src.key) : theirs.find(src.key);
      auto dh = d_local ? mine.find(dst.key) : theirs.find(dst.key);
      if (sh == (s_local ? mine.end() : theirs.end()) || dh == (d_local ? mine.end() : theirs.end())) {
        return absl::InternalError(absl::StrCat("op ", op->index(), ": region ", src.key, " or ", dst.key, " unknown (node ", me, ", peer ", peer,
                                                nccl ? absl::StrCat(", ", NcclLaneName(my_lane), " -> ", NcclLaneName(their_lane)) : "", ")"));
      }
      c.src = RefFor(src.piece, box, elem, sh->second);
      c.dst = RefFor(dst.piece, box, elem, dh->second);
      Route*& route = peer_routes[chan];
      if (route == nullptr) {
        Route r;
        r.t = nccl ? lanes.at(my_lane) : cross_t;
        r.what = nccl ? absl::StrCat("node ", me, " GPU ", my_lane, " <-> node ", peer, " GPU ", their_lane, " (nccl)")
                      : absl::StrCat("node ", me, " <-> node ", peer);
        r.peer = peer;
        r.batch.peer = ids.at(chan);
        r.batch.checksum = options_.checksums && !nccl;
        if (nccl) {
          r.lane = {my_lane, their_lane};
          r.order = me < peer ? std::tuple{me, peer, my_lane, their_lane} : std::tuple{peer, me, their_lane, my_lane};
        }
        route = add(std::move(r));
      }
      route->batch.ops.push_back(std::move(c));
      route->bytes += static_cast<int64_t>(op->bytes());
      if (d_local) route->incoming += static_cast<int64_t>(op->bytes());
      route->reads_written = route->reads_written || reads_written;
    }
    return absl::OkStatus();
  };
  for (uint32_t b = 0; b < plan.slice.num_buckets() && !failed(); ++b) {
    if (options_.test_before_bucket) options_.test_before_bucket(exec.model_id, exec.version, b);
    {
      absl::MutexLock l(&mu_);
      if (exec.aborted || stopping_) {
        absl::MutexLock rl(&result_mu);
        if (first.ok()) first = absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
        break;
      }
    }
    std::vector<Route*> routes;
    if (absl::Status s = make_routes(b, routes); !s.ok()) {
      absl::MutexLock l(&result_mu);
      if (first.ok()) first = s;
      break;
    }
    std::map<int, std::vector<Route*>> per_gpu;  // nccl routes by our GPU, in channel order
    for (Route* r : routes) {
      if (r->lane.first >= 0) per_gpu[r->lane.first].push_back(r);
    }
    if (per_gpu.empty()) {
      // Host routes only: what reads nothing written goes now; the rest after the earlier buckets.
      for (Route* r : routes) {
        if (!r->reads_written && !failed()) post(r);
      }
      if (std::any_of(routes.begin(), routes.end(), [](const Route* r) { return r->reads_written; })) {
        wait_before(b);
        for (Route* r : routes) {
          if (r->reads_written && !failed()) post(r);
        }
      }
      continue;
    }
    // A bucket with nccl routes: earlier buckets first, then this one as a whole. Same-node routes
    // and the host channels are posted at once; nccl channels follow a schedule: every GPU runs the
    // batches of its lane pairs one after another, in the global channel order (Route::order),
    // while different GPUs run in parallel. NCCL kernels of different communicators on one GPU may
    // wait on each other (NCCL: "Using multiple NCCL communicators concurrently"); with one order
    // shared by every node, the smallest unfinished channel always has both of its GPUs at it, so
    // the schedule cannot deadlock (a GPU sending to two peer GPUs, or one GPU with channels to two
    // nodes, takes them in turn; its NIC is shared anyway).
    wait_before();
    if (failed()) break;
    for (auto& [gpu, seq] : per_gpu) {
      std::sort(seq.begin(), seq.end(), [](const Route* x, const Route* y) { return x->order < y->order; });
    }
    for (Route* r : routes) {
      if (r->lane.first < 0 && !failed()) post(r);
    }
    std::vector<std::thread> gpu_threads;
    if (!failed()) {
      for (auto& [gpu, seq] : per_gpu) {
        gpu_threads.emplace_back([&, seq = seq] {
          for (Route* r : seq) {
            {
              absl::MutexLock l(&result_mu);
              first_post.emplace(r->peer, absl::Now());
            }
            r->batch.tag = BatchTag(exec.model_id, exec.version, r->bucket);
            auto id = r->t->Post(r->batch);
            absl::Status s = id.ok() ? r->t->Wait(*id, exec.deadline) : id.status();
            finish(r, s);
            if (!s.ok()) return;  // the version fails; the peer's mirrors end with the aborted version
          }
        });
      }
    }
    wait_before();
    for (std::thread& t : gpu_threads) t.join();
  }
  // Every posted batch is waited for (also after a failure: transports touch the memory until then).
  wait_before();
  RETURN_IF_ERROR_WITH(first, absl::StrCat("version ", exec.version));
  for (auto& [what, seg] : live_sources) {
    if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
      return absl::Status(intact.code(), absl::StrCat("version ", exec.version, ": ", what, ": ", intact.message()));
    }
  }
  exec.bytes_done += exec.relay_bytes_at_commit;  // in staging as far as the commit is concerned
  if (options_.digests || options_.test_after_buckets) {
    // End-to-end digests (docs/daemon.md "End-to-end digests"): what each local op read and landed,
    // over host memory (device memory has none), before anything quantises staging.
    std::map<std::string, digest::RegionBytes> regions;
    for (const auto& [key, m] : mem) regions[key] = {m.kind == MemoryKind::kHost ? m.base : nullptr, m.size};
    if (options_.test_after_buckets) {
      std::map<std::string, std::pair<uint8_t*, int64_t>> named;
      for (int i = 0; i < plan.slice.workers_size(); ++i) {
        for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) {
          auto m = mem.find(RegionKey(i, j));
          if (m != mem.end() && m->second.kind == MemoryKind::kHost) named[absl::StrCat(plan.slice.workers(i).worker_id(), ".b", j)] = {m->second.base, m->second.size};
        }
      }
      if (auto g = mem.find("g"); g != mem.end() && g->second.kind == MemoryKind::kHost) named["g"] = {g->second.base, g->second.size};
      options_.test_after_buckets(exec.model_id, exec.version, named);
    }
    if (options_.digests) {
      const absl::Time t0 = absl::Now();
      const node::Slice slice = node::SliceFromProto(plan.slice, plan.layouts, plan.quantized, plan.hosts_gather, plan.inventory);
      absl::StatusOr<digest::OpDigests> d = digest::DigestLocalOps(slice, me, at_commit, regions, options_.digest_threads, exec.deadline);
      if (!d.ok()) return Annotate(d.status(), absl::StrCat("version ", exec.version, ": end-to-end digests"));
      exec.digests = std::move(*d);
      exec.digest_s = absl::ToDoubleSeconds(absl::Now() - t0);
    }
  }
  end_phase(exec.buckets_s);
  return absl::OkStatus();
}

std::vector<absl::Status> NodeDaemon::RunLiveCopies(std::vector<LiveJob>& jobs) {
  std::vector<absl::Status> out(jobs.size());
  if (jobs.empty()) return out;
  const std::string& me = options_.node_id;
  {
    // One copy per worker at a time: a second one (a retried commit, an Apply racing the commit)
    // waits for the first, bounded, so two versions never interleave in live memory.
    absl::MutexLock l(&mu_);
    auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stopping_ || std::none_of(jobs.begin(), jobs.end(), [&](const LiveJob& j) { return live_.Copying(j.worker); });
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&idle), absl::Now() + options_.live_copy_timeout) || stopping_) {
      for (size_t i = 0; i < jobs.size(); ++i) {
        out[i] = absl::UnavailableError(absl::StrCat("worker ", jobs[i].worker, ": another copy into its live weights is still running on node ", me));
      }
      return out;
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      auto w = workers_.find(jobs[i].worker);
      live_.Begin(jobs[i].worker, jobs[i].version, w == workers_.end() ? 0 : w->second.applied_version);
      // On disk before the first byte: a daemon killed mid-copy reports it after its restart.
      out[i] = live_.Mark(w == workers_.end() ? "" : w->second.model_id, jobs[i].worker, jobs[i].live.host);
    }
  }
  // Its own deadline: once bytes go into live memory the copy finishes (or fails) on its own
  // terms; cutting it at a client's deadline is what left weights half new, half old.
  const absl::Time deadline = absl::Now() + options_.live_copy_timeout;
  std::vector<char> wrote(jobs.size(), 0);
  auto copy_one = [&](size_t i) {
    if (!out[i].ok()) return;  // not recorded: not started
    LiveJob& j = jobs[i];
    bool w = false;
    out[i] = copier_.CopyToLive(*j.staging, j.live, j.layout, j.plan->inventory, j.label, deadline, &w);
    wrote[i] = w;
    if (out[i].ok() && j.relays != nullptr) {
      out[i] = copier_.CopyRelaysToLive(*j.relays, *j.incoming, j.live.host, j.label, deadline, &w);
      wrote[i] = wrote[i] || w;
    }
  };
  const absl::Time copy_start = absl::Now();
  std::vector<std::thread> copiers;
  for (size_t i = 1; i < jobs.size(); ++i) copiers.emplace_back(copy_one, i);
  copy_one(0);
  for (std::thread& th : copiers) th.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - copy_start);
  int64_t bytes = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    for (const StagedBuffer& b : *jobs[i].staging) bytes += out[i].ok() ? b.size() : 0;
  }
  absl::MutexLock l(&mu_);
  if (bytes >= (int64_t{1} << 20) && seconds > 0) {
    // Copy speed for Apply's "does it fit" estimate: smoothed, never above 100 GB/s.
    live_copy_Bps_ = 0.5 * live_copy_Bps_ + 0.5 * std::min(1e11, static_cast<double>(bytes) / seconds);
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    live_.End(jobs[i].worker, out[i], wrote[i]);
    if (out[i].ok() || !wrote[i]) continue;
    Log(LogLevel::kError, "live weights torn", {{"node", me}, {"worker", jobs[i].worker}, {"version", jobs[i].version}, {"error", out[i].message()}});
    absl::Status torn = live_.TornError(jobs[i].worker, me);
    // Forgotten meanwhile (the worker left): still say what happened to the copy.
    out[i] = torn.ok() ? absl::DataLossError(absl::StrCat("live weights of worker ", jobs[i].worker, " on node ", me, " are TORN: ",
                                                          out[i].message()))
                       : torn;
  }
  return out;
}

void NodeDaemon::AddLiveState(pb::StatusResponse* resp) {
  absl::MutexLock l(&mu_);
  for (pb::WorkerStatus& ws : *resp->mutable_workers()) {
    if (ws.node_id() != options_.node_id || workers_.count(ws.worker_id()) == 0) continue;
    const LiveState::Info info = live_.Get(ws.worker_id());
    ws.set_live_state(LiveState::Name(info.state));
    if (info.state == LiveState::State::kWhole) continue;
    ws.set_live_writing_version(info.writing);
    ws.set_live_over_version(info.over);
    if (info.state == LiveState::State::kTorn) ws.set_live_detail(std::string(live_.TornError(ws.worker_id(), options_.node_id).message()));
  }
}

absl::Status NodeDaemon::ReadLive(const std::vector<std::shared_ptr<transport::ShmSegment>>& buffers,
                                  const std::vector<std::shared_ptr<CudaImport>>& cuda, Bytes& out, const std::string& label,
                                  absl::Time deadline, bool on_gpu) {
  out.clear();
  out.resize(buffers.size());
  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;
  std::vector<int64_t> size;
  transport::Transport* ct = nullptr;
  transport::Batch device_batch;
  std::vector<transport::RegionHandle> regions;  // on ct
  absl::Cleanup cleanup = [&] {
    for (auto& h : regions) (void)ct->Release(h);
  };
  for (size_t j = 0; j < buffers.size(); ++j) {
    if (buffers[j]) {
      out[j].host = TakeHost(buffers[j]->size());  // every byte is copied over below
      src.push_back(static_cast<const uint8_t*>(buffers[j]->data()));
      dst.push_back(out[j].host.data());
      size.push_back(buffers[j]->size());
      continue;
    }
    if (j >= cuda.size() || cuda[j] == nullptr) return absl::InternalError(absl::StrCat(label, ": buffer ", j, " is neither host nor CUDA"));
    // CUDA: device -> GPU staging (device to device) when allowed, else device -> host; both on
    // the cuda_ipc transport (host memory registered with it: pinned when possible).
    ct = cuda[j]->t;
    const int64_t n = cuda[j]->size;
    if (on_gpu) {
      ASSIGN_OR_RETURN(out[j].device, TryDeviceStaging(cuda[j]->device, n, absl::StrCat(label, " b", j)));
      Metrics().Staged(options_.node_id, out[j].device ? "gpu" : "host", "snapshot", static_cast<uint64_t>(n));
    }
    transport::MemorySpec spec;
    if (out[j].device) {
      spec.kind = transport::MemoryKind::kCuda;
      spec.base = out[j].device->data();
      spec.device = out[j].device->device();
    } else {
      out[j].host = TakeHost(n);
      spec.kind = transport::MemoryKind::kHost;
      spec.base = out[j].host.data();
    }
    spec.size_bytes = n;
    spec.label = absl::StrCat(label, " staging b", j);
    ASSIGN_OR_RETURN(transport::RegionHandle h, ct->RegisterMemory(spec));
    regions.push_back(h);
    transport::CopyOp op;
    op.shape = {n};
    op.element_size = 1;
    op.src = {cuda[j]->h, 0, {1}};
    op.dst = {h, 0, {1}};
    device_batch.ops.push_back(std::move(op));
  }
  if (!device_batch.ops.empty()) {
    ASSIGN_OR_RETURN(transport::BatchId id, ct->Post(device_batch));
    RETURN_IF_ERROR_WITH(ct->Wait(id, deadline), absl::StrCat(label, ": copying CUDA buffers"));
  }
  // The worker may have truncated its segments (before: refused; during: the SIGBUS guard let the
  // copy finish on zero pages, and the snapshot is refused).
  RETURN_IF_ERROR(CheckLive(buffers, label));
  RETURN_IF_ERROR(copier_.CopyFlat(src, dst, size, label, deadline));
  return CheckLive(buffers, label);
}

absl::Status NodeDaemon::QuantizeIncoming(Exec& exec) {
  const ModelPlan& plan = *exec.plan;
  struct Job {
    const planner::Piece* live;     // the quantised piece (its place and scales in staging)
    const planner::Piece* shadow;   // where its canonical bytes landed
    StagedBuffer* elements;
    StagedBuffer* scales;
  };
  std::vector<Job> jobs;
  int64_t bytes = 0;
  {
    absl::MutexLock l(&mu_);
    for (int i = 0; i < plan.slice.workers_size(); ++i) {
      const pb::PlanWorker& w = plan.slice.workers(i);
      if (w.node_id() != options_.node_id || w.role() != pb::ROLE_ROLLOUT || !plan.quantized[i]) continue;
      auto in = exec.incoming.find(w.worker_id());
      if (in == exec.incoming.end()) continue;
      Bytes& staging = *in->second;
      const planner::WorkerLayout& live = plan.live_layouts[i];
      const planner::WorkerLayout& shadow = plan.layouts[i];
      for (size_t k = 0; k < live.pieces.size(); ++k) {
        const planner::Piece& p = live.pieces[k];
        if (!p.quant.has_value()) continue;
        const size_t b = static_cast<size_t>(p.buffer), sb = static_cast<size_t>(p.quant->scale_buffer);
        if (b >= staging.size() || sb >= staging.size() || staging[b].device != nullptr || staging[sb].device != nullptr) {
          return absl::InternalError(absl::StrCat("version ", exec.version, ": staging of rollout ", w.worker_id(),
                                                  " cannot be quantised (buffer missing or not in host memory)"));
        }
        // The layout was validated (coordinator) and StagingLayout grew the buffers; check anyway
        // that every byte the quantiser touches lies in staging.
        const int64_t sh_bytes = planner::BoxVolume(p.box) * planner::DTypeSize(plan.inventory.tensors[p.tensor].dtype);
        const planner::Piece& sp = shadow.pieces[k];
        if (sp.offset_bytes + sh_bytes > staging[b].size() ||
            p.quant->scale_offset_bytes + planner::ScaleCount(p) * planner::ScaleElementSize(*p.quant) > staging[sb].size()) {
          return absl::InternalError(absl::StrCat("version ", exec.version, ": rollout ", w.worker_id(), " tensor ",
                                                  plan.inventory.tensors[p.tensor].name, ": quantised piece outside its staging"));
        }
        const planner::ByteView bytes_of_p = planner::StoredBytes(plan.inventory, p);  // int4: two elements per byte
        RETURN_IF_ERROR(CheckPieceInBuffer(bytes_of_p.piece, bytes_of_p.element_size, staging[b].size(), plan.inventory.tensors[p.tensor].name));
        jobs.push_back(Job{&p, &sp, &staging[b], &staging[sb]});
        bytes += sh_bytes;
      }
    }
  }
  if (jobs.empty()) return absl::OkStatus();
  const absl::Time t0 = absl::Now();
  // Threads take pieces in turn (big pieces dominate; they are independent). Nothing else of this
  // version runs meanwhile, and one thread quantises ~2-3 GB/s (//bench:quantize), so up to 16.
  const int threads = static_cast<int>(std::min<size_t>(jobs.size(), std::max(1u, std::min(16u, std::thread::hardware_concurrency()))));
  std::atomic<size_t> next{0};
  absl::Mutex err_mu;
  absl::Status first;
  auto work = [&] {
    for (size_t j = next++; j < jobs.size(); j = next++) {
      if (absl::Now() > exec.deadline) {
        absl::MutexLock l(&err_mu);
        if (first.ok()) first = absl::DeadlineExceededError(absl::StrCat("version ", exec.version, ": quantising did not finish before the transfer deadline"));
        return;
      }
      const Job& job = jobs[j];
      absl::Status s = QuantizePiece(plan.inventory, *job.live, job.elements->host.data() + job.shadow->offset_bytes, job.elements->host.data(),
                                     job.scales->host.data());
      if (!s.ok()) {
        absl::MutexLock l(&err_mu);
        if (first.ok()) first = s;
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  RETURN_IF_ERROR(first);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  Metrics().Quantized(options_.node_id, static_cast<uint64_t>(bytes), seconds);
  Log(LogLevel::kInfo, "version quantised", {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version},
                                             {"pieces", static_cast<int64_t>(jobs.size())}, {"bytes", bytes}, {"seconds", seconds},
                                             {"threads", threads}});
  return absl::OkStatus();
}

std::map<int, transport::Transport*> NodeDaemon::NcclLanes() const {
  if (options_.device_staging == nullptr || !options_.device_staging->enabled()) return {};
  return options_.transports.ByDevice("nccl");
}

transport::Transport* NodeDaemon::CrossTransport(const std::string& name) const {
  if (const int device = ParseNcclLaneName(name); device >= 0) {
    std::map<int, transport::Transport*> lanes = NcclLanes();
    auto it = lanes.find(device);
    return it == lanes.end() ? nullptr : it->second;
  }
  transport::Transport* t = options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, true);
  return t != nullptr && t->capabilities().kind == name ? t : nullptr;
}

transport::Transport* NodeDaemon::CudaTransport() const {
  return options_.transports.Pick(transport::MemoryKind::kCuda, transport::MemoryKind::kCuda, false);
}

absl::StatusOr<std::shared_ptr<transport::DeviceMemory>> NodeDaemon::TryDeviceStaging(int device, int64_t size, const std::string& label) {
  if (options_.device_staging == nullptr || !options_.device_staging->enabled()) return std::shared_ptr<transport::DeviceMemory>();
  auto m = options_.device_staging->TryAllocate(device, size, label);
  if (!m.ok()) return Annotate(m.status(), absl::StrCat("GPU staging for ", label));
  if (*m == nullptr) {
    // Not an error: over the per-GPU budget (or the GPU is full): host staging, as without a GPU.
    Log(LogLevel::kInfo, "GPU staging unavailable, staging in host memory",
        {{"node", options_.node_id}, {"what", label}, {"gpu", device}, {"bytes", size},
         {"used", options_.device_staging->used(device)}, {"budget", options_.device_staging->budget_per_gpu()}});
  }
  return m;
}

absl::StatusOr<std::shared_ptr<CudaImport>> NodeDaemon::ImportCuda(const std::string& worker, const pb::BufferSpec& b) {
  const bool is_vmm = b.memory_case() == pb::BufferSpec::kCudaVmmKey;
  const std::string what =
      absl::StrCat("worker ", worker, " buffer ", b.buffer_id(), is_vmm ? " (CUDA VMM, gpu " : " (CUDA IPC, gpu ", b.gpu(), ")");
  transport::Transport* t = options_.transports.Find("cuda_ipc");
  if (t == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": node ", options_.node_id,
                                                      " has no cuda_ipc transport (no GPU visible to the daemon, "
                                                      "or --transports excludes it); register host shared memory instead"));
  }
#if WB_WITH_CUDA_IPC
  transport::RawCudaIpcBuffer raw;
  raw.ipc_handle = b.cuda_ipc_handle();
  raw.offset_bytes = 0;
  raw.size_bytes = static_cast<int64_t>(b.size_bytes());
  raw.device = b.gpu() >= 0 ? b.gpu() : 0;
  if (!b.gpu_uuid().empty()) {
    if (b.gpu_uuid().size() != 16) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": gpu_uuid must be the 16 bytes of cudaDeviceProp::uuid, got ", b.gpu_uuid().size()));
    }
    raw.device_uuid = b.gpu_uuid();  // the GPU in OUR numbering, whatever the worker's CUDA_VISIBLE_DEVICES
  }
  // The worker reached us over our Unix socket, so it is on this machine: the transports' node
  // identity (the kernel boot id; main.cc leaves TransportConfig::node_id empty), not the
  // daemon's cluster node id (found by the emulated-GPU e2e test: every CUDA buffer was refused).
  raw.node_id = transport::DefaultNodeId();
  raw.label = what;
  absl::StatusOr<std::string> desc;
  absl::StatusOr<transport::RegionHandle> h;
  if (is_vmm) {
    // VMM memory: each allocation's fd came over the fd channel (only from the process bound to
    // this worker); the transport maps each allocation (or each ordered list of allocations, for a
    // buffer that spans several) once, whatever the number of buffers in it.
    if (!options_.cuda_vmm_fd) return absl::FailedPreconditionError(absl::StrCat(what, ": this daemon has no fd channel"));
    std::vector<CudaVmmFd> fds;  // dups, closed once the transport imported (or refused) them
    auto close_fds = [&fds] {
      for (const CudaVmmFd& f : fds) ::close(f.fd);
    };
    for (int i = -1; i < b.cuda_vmm_next_keys_size(); ++i) {
      absl::StatusOr<CudaVmmFd> fd = options_.cuda_vmm_fd(worker, i < 0 ? b.cuda_vmm_key() : b.cuda_vmm_next_keys(i));
      if (!fd.ok()) {
        close_fds();
        return Annotate(fd.status(), what);
      }
      fds.push_back(*fd);
    }
    transport::RawCudaVmmBuffer vmm;
    vmm.fd = fds[0].fd;
    vmm.allocation_key = fds[0].cache_key;
    vmm.allocation_bytes = fds[0].allocation_bytes;
    for (size_t i = 1; i < fds.size(); ++i) vmm.next_allocations.push_back({fds[i].fd, fds[i].cache_key, fds[i].allocation_bytes});
    vmm.offset_bytes = static_cast<int64_t>(std::min<uint64_t>(b.cuda_vmm_offset(), INT64_MAX));
    vmm.size_bytes = raw.size_bytes;
    vmm.device = raw.device;
    vmm.device_uuid = raw.device_uuid;
    vmm.node_id = raw.node_id;
    vmm.label = what;
    desc = transport::CudaIpcDescriptorFromVmmFd(vmm);
    if (desc.ok()) h = t->ImportDescriptor(*desc);
    close_fds();  // the transport imported (or refused) them; the channel keeps its own copies
  } else {
    desc = transport::CudaIpcDescriptorFromRawHandle(raw);
    if (desc.ok()) h = t->ImportDescriptor(*desc);
  }
  if (!desc.ok()) return Annotate(desc.status(), what);
  if (!h.ok()) return Annotate(h.status(), what);
  auto imp = std::make_shared<CudaImport>();
  imp->t = t;
  imp->h = *h;
  imp->size = static_cast<int64_t>(b.size_bytes());
  // The GPU that holds the buffer in the daemon's numbering (found by UUID, or by the mapping),
  // which may differ from the worker's `gpu` (CUDA_VISIBLE_DEVICES): staging goes there.
  auto info = t->Describe(*h);
  imp->device = info.ok() && info->device >= 0 ? info->device : raw.device;
  if (imp->device != b.gpu()) {
    Log(LogLevel::kInfo, "CUDA buffer on another GPU than the worker numbers it",
        {{"node", options_.node_id}, {"worker", worker}, {"buffer", b.buffer_id()}, {"worker_gpu", b.gpu()}, {"daemon_gpu", imp->device}});
  }
  return imp;
#else
  return absl::UnimplementedError(absl::StrCat(what, ": this weightbridged was built without CUDA"));
#endif
}

}  // namespace wb::daemon
