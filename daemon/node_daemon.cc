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
#include "daemon/node/grpc_coordinator_client.h"
#include "daemon/node/node_service.h"
#include "daemon/node/worker_service.h"
#include "daemon/node/exec_plan_proto.h"
#include "daemon/node/quantize_incoming.h"
#include "daemon/quantize.h"
#include "planner/box.h"
#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/quantized.h"
#include "proto/grpc_status.h"
#include "base/status_macros.h"

namespace wb::daemon {
// ------------------------------------------------------------------------------- NodeDaemon
NodeDaemon::NodeDaemon(Options options)
    : options_(std::move(options)),
      worker_impl_(NewWorkerService(this)),
      node_impl_(NewNodeService(this)),
      copier_(options_.node_id, options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, false),
              options_.test_live_copy_fault),
      local_(LocalWorkers::Options{options_.node_id, options_.clock, options_.live_copy_timeout, &copier_}) {
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
  gpu_import_ = options_.gpu_import != nullptr ? options_.gpu_import : NewGpuImport();
}

std::vector<uint8_t> NodeDaemon::TakeHost(int64_t size) {
  bool reused = false;
  std::vector<uint8_t> out = staging_pool_->Take(size, &reused);
  if (size > 0) metrics().StagingTaken(options_.node_id, reused, static_cast<uint64_t>(size));
  return out;
}

void NodeDaemon::PrewarmStaging(int64_t size) {
  if (staging_pool_->Prewarm(size, std::max<int64_t>(0, budget_->budget() - budget_->in_use()))) {
    metrics().StagingPoolBytes(options_.node_id, staging_pool_->stats().idle_bytes);
  }
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

void NodeDaemon::CheckWorkers() {
  const std::vector<WorkerKey> gone = local_.ReapExited();  // (model, worker), marked leaving
  for (auto& [model, worker] : gone) {
    pb::LeaveWorkerRequest r;
    r.set_node_id(options_.node_id);
    r.set_model_id(model);
    r.set_worker_id(worker);
    r.set_reason("its process exited");
    pb::LeaveWorkerResponse rr;
    coordinator_client_->LeaveWorker(r, &rr, absl::Seconds(7)).IgnoreError();  // the lease drops it otherwise
    local_.LeaveDone({model, worker});
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
    local_.AttachMarkers(markers_.get());
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
    WorkerKey worker;
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
      local_.NoteAborted(key.first, key.second, reason);
      for (auto& [peer, id] : e->connected) drop.push_back({key.first, peer, id});
    }
    execs_.clear();
    local_.NoteRejoin(reason);
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
      j.join.set_committed_version(committed_[w.key.first]);
      j.join.set_applied_version(w.applied_version);
      j.has_layout = w.has_layout;
      j.layout = std::move(w.submitted);
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
      Log(LogLevel::kWarning, "worker not re-joined",
          {{"node", options_.node_id}, {"model", j.worker.first}, {"worker", j.worker.second}, {"error", s.message()}});
      local_.Remove(j.worker);
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
  metrics().StagingPoolBytes(options_.node_id, staging_pool_->stats().idle_bytes);
}

void NodeDaemon::Shutdown() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [k, e] : execs_) e->aborted = true;
    local_.Stop();
    for (auto& [id, t] : exec_threads_) threads.push_back(std::move(t));
    exec_threads_.clear();
    exec_done_.clear();
  }
  if (coord_) coord_->Stop();
  // Executors blocked on a channel end when it is torn down.
  std::vector<std::tuple<std::string, std::string, transport::PeerId>> channels;
  {
    absl::MutexLock l(&mu_);
    for (const node::ChannelCache::Keyed& c : channels_.All()) channels.push_back({c.model_id, c.channel, c.id});
  }
  for (auto& [model, peer, id] : channels) DropChannel(model, peer, id);
  for (auto& t : threads) t.join();
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
      metrics().Staged(options_.node_id, out[j].device ? "gpu" : "host", "snapshot", static_cast<uint64_t>(n));
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

absl::StatusOr<std::shared_ptr<CudaImport>> NodeDaemon::ImportCuda(const std::string& model, const std::string& worker,
                                                                   const pb::BufferSpec& b) {
  const bool is_vmm = b.memory_case() == pb::BufferSpec::kCudaVmmKey;
  const std::string what =
      absl::StrCat("worker ", worker, " buffer ", b.buffer_id(), is_vmm ? " (CUDA VMM, gpu " : " (CUDA IPC, gpu ", b.gpu(), ")");
  transport::Transport* t = options_.transports.Find("cuda_ipc");
  if (t == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": node ", options_.node_id,
                                                      " has no cuda_ipc transport (no GPU visible to the daemon, "
                                                      "or --transports excludes it); register host shared memory instead"));
  }
  GpuImport::VmmFdFn vmm_fd;
  if (options_.cuda_vmm_fd) {
    vmm_fd = [this, &model](const std::string& w, const std::string& key) { return options_.cuda_vmm_fd(model, w, key); };
  }
  ASSIGN_OR_RETURN(std::shared_ptr<CudaImport> imp, gpu_import_->Import(*t, worker, b, what, vmm_fd));
  if (imp->device != b.gpu()) {
    Log(LogLevel::kInfo, "CUDA buffer on another GPU than the worker numbers it",
        {{"node", options_.node_id}, {"worker", worker}, {"buffer", b.buffer_id()}, {"worker_gpu", b.gpu()}, {"daemon_gpu", imp->device}});
  }
  return imp;
}

}  // namespace wb::daemon
