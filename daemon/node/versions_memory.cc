// node::Versions, part three: the memory of a version on this node (see versions.h): its staging,
// which memory backs each region key, digests after the buckets, quantising incoming staging.
#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/log.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/quantize_incoming.h"
#include "daemon/node/versions.h"

namespace wb::daemon::node {

absl::Status Versions::AllocateStaging(Exec& exec, const node::LanePlan& lanes) {
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
  std::map<std::pair<std::string, size_t>, uint64_t> holds;
  std::map<std::string, std::pair<uint64_t, std::shared_ptr<Bytes>>> bases_held;
  std::shared_ptr<Bytes> gather;
  for (int i = 0; i < plan.slice.workers_size(); ++i) {
    const pb::PlanWorker& w = plan.slice.workers(i);
    if (w.node_id() != me || w.role() != pb::ROLE_ROLLOUT) continue;
    const std::vector<std::shared_ptr<CudaImport>>& cuda = rollout_cuda[w.worker_id()];
    // The commit tagged a rollout's staging with the version it holds (TagCommittedStaging), and
    // the pool got it back once live weights held that version (a sync commit's copy, or Apply):
    // asked for by that tag, the pool hands the same buffers back. Only while the rollout holds
    // its newest committed version: that is the base the sender's deltas are made against.
    // One look at the worker for both: the committed staging is kept as this version's base
    // when the rollout has not applied it (an Apply before NodeDeltas::For would let it go).
    uint64_t held = 0;
    std::optional<LocalWorkers::View> lw = local_.Get({exec.model_id, w.worker_id()});
    if (!exec.catch_up && lw && lw->worker.committed != nullptr) bases_held[w.worker_id()] = {lw->worker.committed_version, lw->worker.committed};
    if (options_.delta_in_place && lw && lw->worker.applied_version >= lw->worker.committed_version) held = lw->worker.applied_version;
    std::shared_ptr<Bytes> bytes = staging_.NewBytes(0, {exec.charge});
    for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) {
      const int64_t size = plan.layouts[i].buffers[j].size_bytes;
      StagedBuffer sb;
      if (j < cuda.size() && cuda[j] != nullptr && !plan.quantized[i]) {
        const std::string what = absl::StrCat(vlabel, " incoming ", w.worker_id(), " b", j);
        auto lane = lanes.lane_of.find(node::RegionKey(i, j));
        if (lane != lanes.lane_of.end()) {
          // Received over nccl: staged on the lane's GPU (the buffer's own GPU when it has a lane;
          // commit/apply copy it to the worker's buffer).
          ASSIGN_OR_RETURN(sb.device, staging_.TryDeviceStaging(lane->second, size, what));
          if (sb.device == nullptr) {
            return absl::ResourceExhaustedError(absl::StrCat(what, ": ", size, " bytes of GPU staging on GPU ", lane->second,
                                                             " (nccl route) exceed --gpu_staging_bytes or the GPU's free memory"));
          }
        } else if (lanes.crosses.count(static_cast<uint32_t>(i)) == 0 || lanes.nccl_in.count(static_cast<uint32_t>(i)) > 0) {
          // Nothing from another node lands in this buffer except over nccl: stage it on its GPU.
          ASSIGN_OR_RETURN(sb.device, staging_.TryDeviceStaging(cuda[j]->device, size, what));
        }
        metrics().Staged(me, sb.device ? "gpu" : "host", "incoming", static_cast<uint64_t>(size));
        if (sb.device == nullptr && staging_.gpu_staging()) {
          // Not counted in exec.staging_bytes (expected on the GPU): reserved from the host budget now.
          ASSIGN_OR_RETURN(std::shared_ptr<StagingBudget::Charge> extra,
                           staging_.budget().Reserve(size, absl::StrCat(vlabel, " incoming ", w.worker_id(), " b", j,
                                                               " (a CUDA buffer that did not fit the GPU staging budget)")));
          bytes = NodeStaging::KeepWith(std::move(bytes), std::move(extra));
        }
      }
      if (sb.device == nullptr && held > 0 && !exec.catch_up) {
        // The applied staging may not be back in the pool yet (still held by the Apply that
        // copied it, or by a running version): then it is this version's base, out of place.
        NodeStaging::Base b = staging_.TakeBase(size, NodeStaging::BaseTag(exec.model_id, w.worker_id(), j, held), exec.deadline);
        sb.host = std::move(b.host);
        if (b.matched) holds[{w.worker_id(), j}] = held;
        if (b.held != nullptr) bases_held[w.worker_id()] = {held, std::move(b.held)};
      } else if (sb.device == nullptr) {
        sb.host = staging_.TakeHost(size);  // recycled: see daemon/staging_pool.h
      }
      bytes->push_back(std::move(sb));
    }
    incoming[w.worker_id()] = std::move(bytes);
  }
  if (plan.hosts_gather) {
    gather = staging_.NewBytes(1, {exec.charge});
    (*gather)[0].host = staging_.TakeHost(static_cast<int64_t>(plan.slice.gather_staging_bytes()));
  }
  absl::MutexLock l(&mu_);
  exec.incoming = std::move(incoming);
  exec.staging_holds = std::move(holds);
  exec.bases_held = std::move(bases_held);
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

absl::Status Versions::GatherVersionMemory(Exec& exec, VersionMemory& out) {
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
      // A catch-up source that left this node (its leave may still be on its way to the
      // coordinator) serves the version no more: reported as such (before the channels go), the
      // coordinator tries again from the other holders instead of ending the catch-up for good.
      if (exec.catch_up) exec.stale_sources.push_back(pw.worker_id());
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
      const LocalWorkers::Worker& src = w->worker;
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
      if (src.buffers.size() < layout.buffers.size() || src.cuda.size() < layout.buffers.size()) {
        return absl::FailedPreconditionError(absl::StrCat(what, " has fewer buffers than its layout"));
      }
      for (size_t j = 0; j < layout.buffers.size(); ++j) {
        auto seg = src.buffers[j];
        if (seg == nullptr) {
          // CUDA live weights (the engine reads them; nothing writes them while the catch-up
          // runs): read on the GPU as a sync trainer's are (same node: cuda_ipc; other nodes:
          // copied to host once, or bounced onto an nccl lane).
          std::shared_ptr<CudaImport> imp = src.cuda[j];
          if (imp == nullptr) return absl::FailedPreconditionError(absl::StrCat(what, " buffer ", j, ": neither host nor CUDA memory"));
          out.holds.push_back(imp);
          out.regions[node::RegionKey(i, j)] = node::RegionMemory{transport::MemoryKind::kCuda, nullptr, imp->size, imp->device, imp->h};
          continue;
        }
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

std::set<uint32_t> Versions::HostLiveSyncRollouts(const ModelPlan& plan) {
  std::set<uint32_t> out;
  for (int i = 0; i < plan.slice.workers_size(); ++i) {
    const pb::PlanWorker& pw = plan.slice.workers(i);
    if (pw.node_id() != options_.node_id || pw.role() != pb::ROLE_ROLLOUT || plan.quantized[i]) continue;
    std::optional<LocalWorkers::View> w = local_.Get({plan.slice.model_id(), pw.worker_id()});
    // Not a rollout that resumed (EndUpdate): the commit must not write its live memory. (One that
    // resumes after this decision gets the relays into its staging at the commit instead.)
    if (!w || w->worker.mode != pb::MODE_SYNC || !w->worker.paused || w->worker.buffers.size() < plan.layouts[i].buffers.size()) continue;
    bool host = true;
    for (size_t j = 0; j < plan.layouts[i].buffers.size(); ++j) host = host && w->worker.buffers[j] != nullptr;
    if (host) out.insert(static_cast<uint32_t>(i));
  }
  return out;
}

absl::Status Versions::DigestVersion(Exec& exec, const VersionMemory& memory, digest::OpDigestTracker* digests) {
  if (digests == nullptr && !options_.test_after_buckets) return absl::OkStatus();
  const ModelPlan& plan = *exec.plan;
  using transport::MemoryKind;
  // End-to-end digests (docs/daemon.md "End-to-end digests"): what each local op read and landed,
  // over host memory (device memory has none). Receiver-side quantising may run meanwhile: it
  // reads the shadows these hash and writes only the pieces' places and scales.
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
    const absl::Time t0 = options_.clock->Now();  // digest_s: what is left to hash after the buckets
    absl::StatusOr<digest::OpDigests> d = digests->Finish();
    if (!d.ok()) return Annotate(d.status(), absl::StrCat("version ", exec.version, ": end-to-end digests"));
    exec.digests = std::move(*d);
    exec.digest_s = absl::ToDoubleSeconds(options_.clock->Now() - t0);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<node::IncomingQuantization>> Versions::StartQuantizing(Exec& exec, const node::Slice& slice) {
  const ModelPlan& plan = *exec.plan;
  // The ops landing in each piece of each destination worker: a piece is quantised as soon as they
  // all landed. Built once, outside the lock (the slice and the exec plan do not change while the
  // version runs). An op left to the commit must not land in a quantised piece: Finish would
  // quantise the piece before its bytes are there (the exec plan never routes one so: no relays at
  // commit for quantised rollouts).
  std::map<uint32_t, std::map<int32_t, std::vector<uint32_t>>> landing;  // worker -> piece -> ops
  for (const node::SliceOp& op : slice.ops) {
    if (op.dst_piece < 0) continue;
    if (exec.exec_plan != nullptr && exec.exec_plan->at_commit.count(op.index) > 0) {
      if (op.dst_worker < slice.quantized.size() && slice.quantized[op.dst_worker]) {
        return absl::InternalError(absl::StrCat("version ", exec.version, ": op ", op.index,
                                                " into a quantised rollout's piece is left to the commit (its piece would be quantised first)"));
      }
      continue;
    }
    landing[op.dst_worker][op.dst_piece].push_back(op.index);
  }
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
      node::QuantizeTarget t{w.worker_id(), &plan.live_layouts[i], &plan.layouts[i], in->second.get(), sent_quantized};
      if (auto it = landing.find(static_cast<uint32_t>(i)); it != landing.end()) t.landing = std::move(it->second);
      targets.push_back(std::move(t));
    }
  }
  if (targets.empty()) return std::unique_ptr<node::IncomingQuantization>();
  node::IncomingOptions o;
  o.early_threads = options_.quantize_early_threads;
  o.digests = options_.digests;
  o.exchange = [this, &exec](const std::vector<node::MagnitudePart>& parts, bool wait) { return ExchangeMagnitudes(exec, parts, wait); };
  return node::IncomingQuantization::Start(plan.inventory, std::move(targets), exec.version, exec.deadline, o);
}

absl::Status Versions::FinishQuantizing(Exec& exec, node::IncomingQuantization& q) {
  ASSIGN_OR_RETURN(node::QuantizeResult r, q.Finish());
  if (r.pieces == 0) return absl::OkStatus();
  exec.quantized_pieces = std::move(r.digests);  // reported with ReportDone (pb::QuantizedPieceDigest)
  metrics().Quantized(options_.node_id, static_cast<uint64_t>(r.bytes), r.finish_seconds);
  Log(LogLevel::kInfo, "version quantised",
      {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version}, {"pieces", r.pieces}, {"bytes", r.bytes},
       {"seconds", r.seconds}, {"busy_seconds", r.busy_seconds}, {"finish_seconds", r.finish_seconds}, {"early_pieces", r.early_pieces}, {"ready_pieces", r.ready_pieces},
       {"global_scales", r.global_scales}, {"partial_global_scales", r.partial_global_scales},
       {"exchanged_tensors", r.exchanged_tensors}, {"exchange_seconds", r.exchange_seconds},
       {"threads", r.threads}, {"digested_pieces", static_cast<int64_t>(exec.quantized_pieces.size())}, {"digest_bytes", r.digest_bytes}});
  return absl::OkStatus();
}

absl::StatusOr<std::map<int32_t, node::TensorMagnitude>> Versions::ExchangeMagnitudes(const Exec& exec,
                                                                                      const std::vector<node::MagnitudePart>& parts, bool wait) {
  std::map<int32_t, node::TensorMagnitude> out;
  if (exec.catch_up && !wait) return out;  // the committed version's book stays as its nodes made it
  const planner::Inventory& inventory = exec.plan->inventory;
  pb::ExchangeMagnitudesRequest req;
  req.set_node_id(options_.node_id);
  req.set_model_id(exec.model_id);
  req.set_version(exec.version);
  req.set_plan_epoch(exec.epoch);
  req.set_coordinator_instance(exec.coordinator_instance);
  req.set_catch_up(exec.catch_up);
  req.set_wait(wait);
  req.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(exec.deadline - options_.clock->Now())));
  std::map<std::string, int32_t> index;  // the tensors asked about
  for (const node::MagnitudePart& p : parts) {
    const std::string& name = inventory.tensors[static_cast<size_t>(p.tensor)].name;
    index[name] = p.tensor;
    if (exec.catch_up) continue;  // asks only: nothing to add to the committed version's book
    pb::TensorMagnitude* t = req.add_parts();  // which boxes: the coordinator takes them from the plan
    t->set_tensor(name);
    t->set_amax(p.amax);
  }
  pb::ExchangeMagnitudesResponse resp;
  // A coordinator busy (its waiting slots full) or briefly unreachable is asked again until the
  // version's deadline: a node whose report is lost holds the others until its ReportDone.
  auto call = [&](const pb::ExchangeMagnitudesRequest& r) {
    absl::Status st;
    for (absl::Duration backoff = absl::Milliseconds(20);; backoff = std::min(2 * backoff, absl::Seconds(1))) {
      resp.Clear();
      st = coordinator_.client().ExchangeMagnitudes(r, &resp, CallTimeout(options_.clock, exec.deadline));
      if (st.code() != absl::StatusCode::kResourceExhausted && st.code() != absl::StatusCode::kUnavailable) break;
      const absl::Time retry = options_.clock->Now() + backoff;
      if (retry >= exec.deadline) break;
      {
        absl::MutexLock l(&mu_);
        if (exec.aborted || stopping_) break;
      }
      options_.clock->SleepUntil(retry);
    }
    return st;
  };
  if (wait && req.parts_size() > 0) {
    // Report first, without waiting: a report takes none of the coordinator's waiting slots, so it
    // is recorded even while they are full (a refused waiting call lost the report with it, and
    // every node waiting for it was held to the deadline). The wait below then only asks.
    pb::ExchangeMagnitudesRequest report = req;
    report.set_wait(false);
    if (call(report).ok()) req.clear_parts();  // else the waiting call carries them again
  }
  absl::Status s = call(req);
  if (!s.ok()) {
    if (wait && s.code() != absl::StatusCode::kNotFound && s.code() != absl::StatusCode::kUnimplemented) return s;
    Log(LogLevel::kWarning, "NVFP4 magnitudes not exchanged",
        {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version}, {"catch_up", exec.catch_up ? "yes" : "no"},
         {"wait", wait ? "yes" : "no"}, {"error", s.message()}});
    return out;
  }
  for (const pb::TensorMagnitude& t : resp.tensors()) {
    auto it = index.find(t.tensor());
    if (it != index.end()) out[it->second] = {t.amax(), t.whole()};
  }
  return out;
}

}  // namespace wb::daemon::node
