// NodeDaemon, part two: running a version on this node (plans -> exec, staging, which memory
// backs each region key, channels, the executor run, digests, quantising incoming staging).
// The pure plan step and the executor are daemon/node/exec_plan and daemon/node/executor; this
// file is NodeDaemon's wiring of them (daemon/node_daemon.cc holds the rest of the class).
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
#include "daemon/node/exec_plan_proto.h"
#include "daemon/node/quantize_incoming.h"
#include "daemon/node/quantize_outgoing.h"
#include "daemon/quantize.h"
#include "planner/box.h"
#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/quantized.h"
#include "proto/grpc_status.h"
#include "base/status_macros.h"

namespace wb::daemon {

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
  if (std::optional<std::string> aborted = local_.AbortReason(model_id, version); !catch_up && aborted) {
    return absl::AbortedError(absl::StrCat("version ", version, " was aborted: ", *aborted));
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
    const std::vector<std::shared_ptr<CudaImport>> lw = local_.Cuda({exec->model_id, w.worker_id()});  // empty: unknown
    for (size_t j = 0; j < exec->plan->layouts[i].buffers.size(); ++j) {
      const bool cuda = j < lw.size() && lw[j] != nullptr;
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
  channels_.EraseIf(model_id, chan, id);
  const std::string name = ChannelTransportName(chan);
  transport::Transport* cross = name.empty() ? options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, true)
                                             : CrossTransport(name);
  if (cross != nullptr && id != transport::kNoPeer) (void)cross->Disconnect(id);
}

absl::StatusOr<node::ChannelLink> NodeDaemon::SetupPeer(Exec& exec, const node::ChannelPlan& channel, transport::Transport* cross) {
  const std::string& peer = channel.peer;
  const std::string& mine_name = channel.mine;
  const std::string& theirs_name = channel.theirs;
  const std::string& chan = channel.name;
  const std::string kind = mine_name == theirs_name ? mine_name : absl::StrCat(mine_name, " -> ", theirs_name);  // for messages
  const pb::PlanWorker* peer_worker = nullptr;
  for (const pb::PlanWorker& w : exec.plan->slice.workers()) {
    if (w.node_id() == peer) peer_worker = &w;
  }
  if (peer_worker == nullptr) return absl::InvalidArgumentError(absl::StrCat("node ", peer, " has no worker in the plan slice of model ", exec.model_id));
  auto inst_it = peer_worker->transport_instances().find(theirs_name);
  if (inst_it == peer_worker->transport_instances().end()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", peer, " has no '", theirs_name, "' transport"));
  }
  const std::string& peer_instance = inst_it->second;
  // A peer that restarted (new transport instance) left a stale channel: disconnected, not reused.
  const node::ChannelCache::Lookup cache = channels_.ForPeer(exec.model_id, chan, peer_instance);
  const transport::PeerId cached = cache.reuse;
  if (cache.stale != transport::kNoPeer) DropChannel(exec.model_id, chan, cache.stale);
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
    RETURN_IF_ERROR_WITH(FromGrpcStatus(PeerStub(peer, peer_worker->data_address())->ExchangeRegions(&ctx, req, &resp)),
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
  node::ChannelLink link;
  link.id = id;
  transport::PeerId replaced = transport::kNoPeer;
  absl::Status aborted;
  {
    absl::MutexLock l(&mu_);
    // Another version of the model may have cached its own channel meanwhile; the one we replace
    // must be disconnected (its fds closed) unless a version in flight still uses it.
    replaced = channels_.Put(exec.model_id, chan, id, peer_instance);
    for (auto& [key, other] : execs_) {
      for (auto& [p, used] : other->connected) {
        if (used == replaced) replaced = transport::kNoPeer;
      }
    }
    exec.connected[chan] = id;
    link.regions = exec.peers[chan].regions;
    if (exec.aborted) aborted = absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
  }
  if (replaced != transport::kNoPeer) DropChannel(exec.model_id, chan, replaced);
  if (!aborted.ok()) return aborted;
  return link;
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
      if (ls.bytes > 0 && ls.seconds > 0) metrics().Link(options_.node_id, peer, ls.bytes, ls.seconds);
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

// The executor's way to its peers (node::ChannelSetup): our descriptors go into exec.local_desc
// (the ExchangeRegions handler answers with them), and each channel is set up by SetupPeer
// (ExchangeRegions + the model's channel cache).
class NodeDaemon::ExecChannels final : public node::ChannelSetup {
 public:
  ExecChannels(NodeDaemon* d, Exec& exec) : d_(d), exec_(exec) {}
  void Publish(std::map<std::string, std::map<std::string, std::string>> descriptors) override {
    absl::MutexLock l(&d_->mu_);
    exec_.local_desc = std::move(descriptors);
    exec_.regions_ready = true;
  }
  absl::StatusOr<node::ChannelLink> Setup(const node::ChannelPlan& channel, transport::Transport* t, absl::Time) override {
    return d_->SetupPeer(exec_, channel, t);
  }

 private:
  NodeDaemon* d_;
  Exec& exec_;
};

absl::Status NodeDaemon::AllocateStaging(Exec& exec, const node::LanePlan& lanes) {
  const ModelPlan& plan = *exec.plan;
  const std::string& me = options_.node_id;
  const std::string vlabel = absl::StrCat(exec.model_id, " v", exec.version);
  // A rollout whose live buffers are CUDA memory and that exchanges nothing with other nodes is
  // staged on its GPU when the GPU staging budget allows (GPU-direct: the version never leaves the
  // GPUs); one that receives over nccl is staged on its lane's GPU.
  std::map<std::string, std::vector<std::shared_ptr<CudaImport>>> rollout_cuda;
  for (int i = 0; i < plan.slice.workers_size(); ++i) {
    const pb::PlanWorker& w = plan.slice.workers(i);
    if (w.node_id() != me || w.role() != pb::ROLE_ROLLOUT) continue;
    rollout_cuda[w.worker_id()] = local_.Cuda({exec.model_id, w.worker_id()});
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
      if (j < cuda.size() && cuda[j] != nullptr && !plan.quantized[i]) {
        const std::string what = absl::StrCat(vlabel, " incoming ", w.worker_id(), " b", j);
        auto lane = lanes.lane_of.find(node::RegionKey(i, j));
        if (lane != lanes.lane_of.end()) {
          // Received over nccl: staged on the lane's GPU (the buffer's own GPU when it has a lane;
          // commit/apply copy it to the worker's buffer).
          ASSIGN_OR_RETURN(sb.device, TryDeviceStaging(lane->second, size, what));
          if (sb.device == nullptr) {
            return absl::ResourceExhaustedError(absl::StrCat(what, ": ", size, " bytes of GPU staging on GPU ", lane->second,
                                                             " (nccl route) exceed --gpu_staging_bytes or the GPU's free memory"));
          }
        } else if (lanes.crosses.count(static_cast<uint32_t>(i)) == 0 || lanes.nccl_in.count(static_cast<uint32_t>(i)) > 0) {
          // Nothing from another node lands in this buffer except over nccl: stage it on its GPU.
          ASSIGN_OR_RETURN(sb.device, TryDeviceStaging(cuda[j]->device, size, what));
        }
        metrics().Staged(me, sb.device ? "gpu" : "host", "incoming", static_cast<uint64_t>(size));
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
  return absl::OkStatus();
}

namespace {

node::RegionMemory StagedRegion(const StagedBuffer& b) {
  node::RegionMemory m;
  m.size = b.size();
  if (b.device) {
    m.kind = transport::MemoryKind::kCuda;
    m.base = static_cast<uint8_t*>(b.device->data());
    m.device = b.device->device();
  } else {
    m.base = const_cast<uint8_t*>(b.host.data());
  }
  return m;
}

node::RegionMemory SegmentRegion(const std::shared_ptr<transport::ShmSegment>& seg) {
  return node::RegionMemory{transport::MemoryKind::kHost, static_cast<uint8_t*>(seg->data()), seg->size(), -1, {}};
}

}  // namespace

absl::Status NodeDaemon::GatherVersionMemory(Exec& exec, VersionMemory& out) {
  const ModelPlan& plan = *exec.plan;
  const std::string& me = options_.node_id;
  absl::MutexLock l(&mu_);
  if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
  for (int i = 0; i < plan.slice.workers_size(); ++i) {
    const pb::PlanWorker& pw = plan.slice.workers(i);
    if (pw.node_id() != me) continue;
    const planner::WorkerLayout& layout = plan.layouts[i];
    if (pw.role() == pb::ROLE_ROLLOUT) {
      std::shared_ptr<Bytes> staging = exec.incoming.at(pw.worker_id());
      out.holds.push_back(staging);
      for (size_t j = 0; j < staging->size(); ++j) out.regions[node::RegionKey(i, j)] = StagedRegion((*staging)[j]);
      continue;
    }
    std::optional<LocalWorkers::View> w = local_.Get({exec.model_id, pw.worker_id()});
    if (!w || !w->worker.has_layout) {
      return absl::FailedPreconditionError(absl::StrCat("trainer worker ", pw.worker_id(), " of model ", exec.model_id, " is gone from node ", me));
    }
    if (w->worker.buffers.size() < layout.buffers.size()) {
      return absl::FailedPreconditionError(absl::StrCat("trainer worker ", pw.worker_id(), " has fewer buffers than its layout"));
    }
    if (exec.catch_up) {
      // Catch-up source (docs/daemon.md "Catch-up"): a rollout holding the committed version,
      // read in place: its committed staging while held, else its live buffers when they hold
      // exactly that version whole (no newer version commits while a catch-up runs, so no
      // commit or Apply writes them meanwhile).
      const LocalWorker& src = w->worker;
      const std::string what = absl::StrCat("catch-up source rollout ", pw.worker_id(), " on node ", me);
      if (src.role != planner::Role::kRollout) return absl::FailedPreconditionError(absl::StrCat(what, ": not a rollout here"));
      if (src.committed != nullptr && src.committed_version == exec.version) {
        out.holds.push_back(src.committed);
        for (size_t j = 0; j < src.committed->size(); ++j) out.regions[node::RegionKey(i, j)] = StagedRegion((*src.committed)[j]);
        continue;
      }
      if (src.applied_version != exec.version || w->copying || !w->torn.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(what, " no longer holds version ", exec.version, " (committed staging: version ",
                                                          src.committed != nullptr ? src.committed_version : 0, ", live weights: version ",
                                                          src.applied_version, w->copying ? ", being written" : "", ")"));
      }
      for (size_t j = 0; j < layout.buffers.size(); ++j) {
        auto seg = src.buffers[j];
        if (seg == nullptr) return absl::FailedPreconditionError(absl::StrCat(what, " buffer ", j, ": CUDA memory is not a catch-up source"));
        if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
          return absl::Status(intact.code(), absl::StrCat(what, " buffer ", j, ": ", intact.message()));
        }
        out.live_sources.push_back({absl::StrCat(what, " buffer ", j), seg});
        out.holds.push_back(seg);
        out.regions[node::RegionKey(i, j)] = SegmentRegion(seg);
      }
      continue;
    }
    if (plan.slice.mode() == pb::MODE_SYNC) {
      // Live buffers (the trainer is paused in Publish meanwhile).
      for (size_t j = 0; j < layout.buffers.size(); ++j) {
        auto seg = w->worker.buffers[j];
        if (seg == nullptr) {
          std::shared_ptr<CudaImport> imp = w->worker.cuda[j];
          out.holds.push_back(imp);
          out.regions[node::RegionKey(i, j)] = node::RegionMemory{transport::MemoryKind::kCuda, nullptr, imp->size, imp->device, imp->h};
          continue;
        }
        if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
          return absl::Status(intact.code(), absl::StrCat("trainer worker ", pw.worker_id(), " buffer ", j, ": ", intact.message()));
        }
        out.live_sources.push_back({absl::StrCat("trainer worker ", pw.worker_id(), " buffer ", j), seg});
        out.holds.push_back(seg);
        out.regions[node::RegionKey(i, j)] = SegmentRegion(seg);
      }
    } else {
      auto snap = w->worker.snapshots.find(exec.version);
      if (snap == w->worker.snapshots.end()) {
        return absl::FailedPreconditionError(absl::StrCat("no snapshot of version ", exec.version, " for worker ", pw.worker_id()));
      }
      out.holds.push_back(snap->second);
      for (size_t j = 0; j < snap->second->size(); ++j) out.regions[node::RegionKey(i, j)] = StagedRegion((*snap->second)[j]);
    }
  }
  if (exec.gather) {
    out.holds.push_back(exec.gather);
    out.regions["g"] = StagedRegion((*exec.gather)[0]);
  }
  return absl::OkStatus();
}

std::set<uint32_t> NodeDaemon::HostLiveSyncRollouts(const ModelPlan& plan) {
  std::set<uint32_t> out;
  for (int i = 0; i < plan.slice.workers_size(); ++i) {
    const pb::PlanWorker& pw = plan.slice.workers(i);
    if (pw.node_id() != options_.node_id || pw.role() != pb::ROLE_ROLLOUT || plan.quantized[i]) continue;
    std::optional<LocalWorkers::View> w = local_.Get({plan.slice.model_id(), pw.worker_id()});
    if (!w || w->worker.mode != pb::MODE_SYNC || w->worker.buffers.size() < plan.layouts[i].buffers.size()) continue;
    bool host = true;
    for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) host = host && w->worker.buffers[j] != nullptr;
    if (host) out.insert(static_cast<uint32_t>(i));
  }
  return out;
}

node::ExecOptions NodeDaemon::ExecOptionsFor(Exec& exec) {
  const std::string& me = options_.node_id;
  node::ExecOptions o;
  o.label = absl::StrCat(exec.model_id, " v", exec.version);
  o.version = exec.version;
  o.deadline = exec.deadline;
  o.aborted = [this, &exec]() -> absl::Status {
    absl::MutexLock l(&mu_);
    if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    return absl::OkStatus();
  };
  if (options_.test_before_bucket) o.before_bucket = [this, &exec](uint32_t b) { options_.test_before_bucket(exec.model_id, exec.version, b); };
  o.device_staging = [this](int device, int64_t size, const std::string& what) { return TryDeviceStaging(device, size, what); };
  DaemonMetrics* m = &metrics();
  o.on_batch_done = [m, me, model = exec.model_id](const node::Route& r, const std::string& kind) {
    m->Bytes(me, model, kind, r.peer, static_cast<uint64_t>(r.bytes));
    if (r.lane.first >= 0) m->NcclLane(me, r.peer, r.lane.first, r.lane.second, static_cast<uint64_t>(r.bytes));
  };
  o.on_bounce = [m, me](uint64_t bytes) { m->NcclBounce(me, bytes); };
  // Per-NIC bytes of the host channel (also of a failed batch: those bytes did cross the wire).
  transport::Transport* cross_t = options_.transports.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, true);
  std::map<std::string, std::string> peer_instances;  // the peers' host-channel transport instance -> node
  if (cross_t != nullptr) {
    const std::string kind = cross_t->capabilities().kind;
    for (const pb::PlanWorker& w : exec.plan->slice.workers()) {
      auto it = w.transport_instances().find(kind);
      if (w.node_id() != me && it != w.transport_instances().end()) peer_instances[it->second] = w.node_id();
    }
  }
  if (cross_t != nullptr && !peer_instances.empty()) {
    o.after_wait = [this, m, me, cross_t, peer_instances] { nic_meter_.Record(*m, me, cross_t->stats().paths, peer_instances); };
  }
  o.bytes_done = &exec.bytes_done;
  return o;
}

// One version on this node: staging, the memory of each region key, the pure exec plan
// (daemon/node/exec_plan.h: channel order, relays at commit, routes) and its run over the
// transports (daemon/node/executor.h).
absl::Status NodeDaemon::RunExecInner(Exec& exec) {
  const ModelPlan& plan = *exec.plan;
  const std::string& me = options_.node_id;
  using transport::MemoryKind;
  absl::Time phase_start = absl::Now();  // phase times for the "version transferred" log line
  node::ExecTransports transports;
  transports.local = options_.transports.Pick(MemoryKind::kHost, MemoryKind::kHost, false);
  transports.cross = options_.transports.Pick(MemoryKind::kHost, MemoryKind::kHost, true);
  transports.cuda = CudaTransport();
  transports.lanes = NcclLanes();
  node::ExecFacts facts;
  facts.me = me;
  for (auto& [device, t] : transports.lanes) facts.lanes.insert(device);
  const node::Slice slice = node::SliceFromProto(plan.slice, plan.layouts, plan.quantized, plan.hosts_gather, plan.inventory,
                                                 plan.live_layouts);
  ASSIGN_OR_RETURN(node::LanePlan lanes, node::PlanLanes(slice, me, facts.lanes));

  // 0. Staging of this version, allocated here (outside mu_).
  RETURN_IF_ERROR(AllocateStaging(exec, lanes));
  exec.staging_s = absl::ToDoubleSeconds(absl::Now() - phase_start);
  phase_start = absl::Now();

  // 1. The memory behind each region key of this version on this node.
  VersionMemory memory;
  RETURN_IF_ERROR(GatherVersionMemory(exec, memory));

  // 2. The plan: which transport reaches which region, channels, relays at commit, routes.
  for (auto& [key, m] : memory.regions) facts.kind[key] = m.kind;
  if (plan.slice.mode() == pb::MODE_SYNC) facts.host_live_sync = HostLiveSyncRollouts(plan);
  facts.cross_kind = transports.cross != nullptr ? transports.cross->capabilities().kind : "host_tcp";
  facts.have_local = transports.local != nullptr;
  facts.have_cuda = transports.cuda != nullptr;
  facts.have_cross = transports.cross != nullptr;
  facts.checksums = options_.checksums;
  ASSIGN_OR_RETURN(node::ExecPlan made, node::MakeExecPlan(slice, facts));
  auto xplan = std::make_shared<const node::ExecPlan>(std::move(made));
  {
    absl::MutexLock l(&mu_);
    exec.exec_plan = xplan;
    exec.relays_at_commit = xplan->relays_at_commit;
    exec.pieces_at_commit = xplan->pieces_at_commit;
    exec.relay_bytes_at_commit = xplan->relay_bytes_at_commit;
  }
  // Sender-side quantisation (issue 17.1): this node's trainers' boxes of sender-quantised ops are
  // quantised into its q staging before the buckets (daemon/node/quantize_outgoing.h).
  ASSIGN_OR_RETURN(node::OutgoingStaging qout, node::OutgoingQuantizer().Quantize(plan.inventory, xplan->quant_out, memory.regions,
                                                                                   absl::StrCat(exec.model_id, " v", exec.version), exec.deadline));
  for (auto& [key, m] : qout.regions) memory.regions[key] = m;
  memory.holds.push_back(qout.hold);
  if (qout.ops > 0) {
    Log(LogLevel::kInfo, "version quantised on send", {{"node", me}, {"model", exec.model_id}, {"version", exec.version}, {"ops", qout.ops},
                                                        {"bytes", qout.canonical_bytes}, {"wire_bytes", qout.wire_bytes}, {"seconds", qout.seconds}});
  }

  // 3. Register, set up channels, run the buckets. End-to-end digests hash alongside (docs/daemon.md
  // "End-to-end digests"): sources at once, each landed box as its batch completes. Declared after
  // `memory`: a failed version's tracker stops hashing before the memory goes.
  const double prepare_s = absl::ToDoubleSeconds(absl::Now() - phase_start);
  node::ExecOptions exec_options = ExecOptionsFor(exec);
  std::unique_ptr<digest::OpDigestTracker> digests;
  if (options_.digests) {
    std::map<std::string, digest::RegionBytes> host;  // device memory (no host address) has no digest
    for (const auto& [key, m] : memory.regions) host[key] = {m.kind == MemoryKind::kHost ? m.base : nullptr, m.size};
    absl::StatusOr<std::unique_ptr<digest::OpDigestTracker>> t = digest::OpDigestTracker::Start(
        slice, me, *xplan, host, {options_.digest_threads, exec.deadline, options_.digest_overlap});
    if (!t.ok()) return Annotate(t.status(), absl::StrCat("version ", exec.version, ": end-to-end digests"));
    digests = std::move(*t);
    exec_options.on_batch_done = [metered = std::move(exec_options.on_batch_done), d = digests.get()](const node::Route& r, const std::string& kind) {
      if (metered) metered(r, kind);
      d->OnRouteDone(r);
    };
  }
  ExecChannels channels(this, exec);
  node::ExecResult result;
  absl::Status s = node::RunExecPlan(*xplan, memory.regions, transports, channels, exec_options, result);
  exec.links = result.links;
  exec.setup_s = prepare_s + result.setup_s;
  exec.buckets_s = result.buckets_s;
  RETURN_IF_ERROR(s);
  // Sync: trainers' live segments were read in place (a trainer may truncate its memory
  // mid-version; ShmSegment's SIGBUS guard kept the daemon alive meanwhile).
  for (auto& [what, seg] : memory.live_sources) {
    if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
      return absl::Status(intact.code(), absl::StrCat("version ", exec.version, ": ", what, ": ", intact.message()));
    }
  }
  exec.bytes_done += exec.relay_bytes_at_commit;  // in staging as far as the commit is concerned
  phase_start = absl::Now();
  RETURN_IF_ERROR(DigestVersion(exec, memory, digests.get()));
  if (options_.digests) {
    // Sender-quantised ops (issue 17.1): both sides digest the quantised bytes that travel.
    std::map<std::string, digest::RegionBytes> host;
    for (const auto& [key, m] : memory.regions) host[key] = {m.kind == MemoryKind::kHost ? m.base : nullptr, m.size};
    RETURN_IF_ERROR(node::DigestSenderQuantized(slice, me, host, options_.digest_threads, exec.deadline, exec.digests));
  }
  exec.buckets_s += absl::ToDoubleSeconds(absl::Now() - phase_start);
  return absl::OkStatus();
}

absl::Status NodeDaemon::DigestVersion(Exec& exec, const VersionMemory& memory, digest::OpDigestTracker* digests) {
  if (digests == nullptr && !options_.test_after_buckets) return absl::OkStatus();
  const ModelPlan& plan = *exec.plan;
  using transport::MemoryKind;
  // End-to-end digests (docs/daemon.md "End-to-end digests"): what each local op read and landed,
  // over host memory (device memory has none), before anything quantises staging.
  if (options_.test_after_buckets) {
    std::map<std::string, std::pair<uint8_t*, int64_t>> named;
    for (int i = 0; i < plan.slice.workers_size(); ++i) {
      for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) {
        auto m = memory.regions.find(node::RegionKey(i, j));
        if (m != memory.regions.end() && m->second.kind == MemoryKind::kHost) {
          named[absl::StrCat(plan.slice.workers(i).worker_id(), ".b", j)] = {m->second.base, m->second.size};
        }
      }
    }
    if (auto g = memory.regions.find("g"); g != memory.regions.end() && g->second.kind == MemoryKind::kHost) named["g"] = {g->second.base, g->second.size};
    options_.test_after_buckets(exec.model_id, exec.version, named);
  }
  if (digests != nullptr) {
    const absl::Time t0 = absl::Now();  // digest_s: what is left to hash after the buckets
    absl::StatusOr<digest::OpDigests> d = digests->Finish();
    if (!d.ok()) return Annotate(d.status(), absl::StrCat("version ", exec.version, ": end-to-end digests"));
    exec.digests = std::move(*d);
    exec.digest_s = absl::ToDoubleSeconds(absl::Now() - t0);
  }
  return absl::OkStatus();
}

absl::Status NodeDaemon::QuantizeIncoming(Exec& exec) {
  const ModelPlan& plan = *exec.plan;
  std::vector<node::QuantizeTarget> targets;
  {
    absl::MutexLock l(&mu_);
    for (int i = 0; i < plan.slice.workers_size(); ++i) {
      const pb::PlanWorker& w = plan.slice.workers(i);
      if (w.node_id() != options_.node_id || w.role() != pb::ROLE_ROLLOUT || !plan.quantized[i]) continue;
      auto in = exec.incoming.find(w.worker_id());
      if (in == exec.incoming.end()) continue;
      // exec.incoming keeps the staging alive (the executor's exec holds it until RunExec returns).
      // Pieces whose senders quantised them (issue 17.1) are in place already.
      const std::set<int32_t>* sent_quantized = nullptr;
      if (exec.exec_plan != nullptr) {
        auto q = exec.exec_plan->quant_pieces_in.find(static_cast<uint32_t>(i));
        if (q != exec.exec_plan->quant_pieces_in.end()) sent_quantized = &q->second;
      }
      targets.push_back({w.worker_id(), &plan.live_layouts[i], &plan.layouts[i], in->second.get(), sent_quantized});
    }
  }
  if (targets.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(node::QuantizeResult r, node::QuantizeStaging(plan.inventory, targets, exec.version, exec.deadline));
  if (r.pieces == 0) return absl::OkStatus();
  metrics().Quantized(options_.node_id, static_cast<uint64_t>(r.bytes), r.seconds);
  Log(LogLevel::kInfo, "version quantised", {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version},
                                             {"pieces", r.pieces}, {"bytes", r.bytes}, {"seconds", r.seconds}, {"threads", r.threads}});
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


}  // namespace wb::daemon
