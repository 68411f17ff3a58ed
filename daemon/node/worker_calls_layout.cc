// node::WorkerCalls, part two: layouts (see worker_calls.h): RegisterLayout maps a worker's
// buffers (shared memory, CUDA IPC / VMM), resolves index probes and submits the layout;
// DescribeLayout answers layout discovery on this node.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/convert.h"
#include "daemon/log.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/worker_calls.h"
#include "planner/box.h"
#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/quantized.h"

namespace wb::daemon::node {
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
    for (const int64_t& value : values) {
      // Read once (the worker may rewrite its probe meanwhile: ExtractPieces checks every value again).
      const int64_t v = *static_cast<const volatile int64_t*>(&value);
      // -1 is padding; anything below it is no index at all (a probe of only such values was
      // taken as pure padding: hostile probe, 2026-12-07).
      if (v < -1) {
        return absl::InvalidArgumentError(absl::StrCat("local tensor ", t, ": probe value ", v, " is neither -1 (padding) nor an index in [0, ",
                                                       total, ")"));
      }
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

absl::Status WorkerCalls::CheckWorkerOwns(const std::string& model, const std::string& worker, uint32_t buffer_id,
                                          const transport::ShmSegment& seg) const {
  if (!options_.worker_uid) return absl::OkStatus();
  absl::StatusOr<uid_t> uid = options_.worker_uid(model, worker);
  if (!uid.ok()) return Annotate(uid.status(), absl::StrCat("worker ", worker, " buffer ", buffer_id));
  absl::StatusOr<uid_t> owner = seg.OwnerUid();
  if (!owner.ok()) return Annotate(owner.status(), absl::StrCat("worker ", worker, " buffer ", buffer_id));
  if (*owner != *uid) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " of model ", model, " buffer ", buffer_id, ": shared memory segment '",
                                                    seg.name(), "' as node ", options_.node_id, " opened it is owned by uid ", *owner,
                                                    ", not by the worker's uid ", *uid, " (was the name replaced after it was checked?)"));
  }
  return absl::OkStatus();
}

std::vector<std::vector<std::string>> WorkerCalls::VmmAllocationsNow(const pb::RegisterLayoutRequest& req) const {
  std::vector<std::vector<std::string>> out(static_cast<size_t>(req.buffers_size()));
  if (!options_.cuda_vmm_fd) return out;
  for (int i = 0; i < req.buffers_size(); ++i) {
    const pb::BufferSpec& b = req.buffers(i);
    if (b.memory_case() != pb::BufferSpec::kCudaVmmKey) continue;
    for (int k = -1; k < b.cuda_vmm_next_keys_size(); ++k) {
      absl::StatusOr<CudaVmmFd> fd = options_.cuda_vmm_fd(req.model_id(), req.worker_id(), k < 0 ? b.cuda_vmm_key() : b.cuda_vmm_next_keys(k));
      if (!fd.ok()) {  // no fd under a key: not the memory imported before (the import names why)
        out[i].clear();
        break;
      }
      ::close(fd->fd);
      out[i].push_back(fd->cache_key);
    }
  }
  return out;
}

absl::Status WorkerCalls::RegisterLayout(const pb::RegisterLayoutRequest& req, pb::RegisterLayoutResponse* resp, absl::Duration time_left) {
  const absl::Time deadline = CallerDeadline(options_.clock, time_left);
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  if (std::optional<pb::RegisterLayoutResponse> same = local_.SameLayout(key, req, VmmAllocationsNow(req))) {
    // The layout this worker registered, again (a client's replay after a reconnect, after its
    // repeated RegisterWorker): the same answer; nothing is mapped, imported or submitted again.
    *resp = std::move(*same);
    Log(LogLevel::kInfo, "worker layout repeated: unchanged", {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}});
    return absl::OkStatus();
  }
  if (std::optional<pb::RegisterWorkerRequest> repeated = local_.TakeRepeat(key)) {
    // The RegisterWorker repeated before this was no replay: the process brings other memory or
    // another layout, so it registers anew, as RegisterWorker always did before repeats were
    // recognised (the coordinator drops and re-adds the worker, the node's entry is replaced).
    pb::RegisterWorkerResponse joined;
    RETURN_IF_ERROR(JoinWorker(*repeated, &joined, deadline));
  }
  // Judged before mapping (what the entry mapped), joined once the new memory is mapped.
  std::optional<pb::RegisterWorkerRequest> fresh = local_.NewMemory(key, req);
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
    // Ownership: the segment's uid must be the registering worker's (its SO_PEERCRED uid, bound at
    // RegisterWorker); the daemon's own uid is irrelevant. The front checked the name before this
    // call; checked again here on the descriptor this node maps, which is the one that counts.
    if (absl::Status owned = CheckWorkerOwns(req.model_id(), req.worker_id(), b.buffer_id(), *seg); !owned.ok()) return owned;
    buffers.push_back(std::make_shared<transport::ShmSegment>(std::move(*seg)));
  }
  if (role == planner::Role::kRollout) {
    // The daemon writes a rollout's live buffers (sync commit, Apply, catch-up): their pages are
    // faulted in now, not inside the first version's (or a late rollout's catch-up's) copy.
    const absl::Time t0 = options_.clock->Now();
    for (size_t j = 0; j < buffers.size(); ++j) {
      if (buffers[j] == nullptr) continue;
      if (absl::Status pre = buffers[j]->Populate(); !pre.ok()) {
        return Annotate(pre, absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " buffer ", j));
      }
    }
    Log(LogLevel::kDebug, "rollout buffers pre-faulted",
        {{"model", req.model_id()}, {"worker", req.worker_id()}, {"seconds", absl::ToDoubleSeconds(options_.clock->Now() - t0)}});
  }
  std::vector<bool> is_cuda;  // per buffer (the vectors move into the entry below)
  for (const auto& c : cuda) is_cuda.push_back(c != nullptr);
  if (fresh) {
    // A rollout registering its layout over new memory (a new segment, the same name naming a new
    // file, a new CUDA allocation: e.g. an engine that slept and discarded its weights): its live
    // weights hold nothing the node or the coordinator knows of. Registered anew: the coordinator
    // counts it as holding no version (it is caught up into the new memory, never a catch-up
    // source meanwhile), the node replaces its entry (applied and committed versions, committed
    // copy, live state). Keeping the entry made Apply / WaitVersion answer the old version over
    // the new memory and the coordinator use it as a catch-up source.
    Log(LogLevel::kWarning, "rollout layout over new memory: registered anew",
        {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}});
    pb::RegisterWorkerResponse joined;
    if (absl::Status s = JoinWorker(*fresh, &joined, deadline); !s.ok()) {
      return Annotate(s, absl::StrCat("registering rollout ", req.worker_id(), " of model ", req.model_id(), " anew on node ", options_.node_id,
                                      " (its layout names new memory)"));
    }
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
  // Before the coordinator knows the layout: a late rollout's catch-up starts right after it.
  if (role == planner::Role::kRollout) PrewarmIncomingStaging(spec, req, sreq.layout(), is_cuda);
  pb::SubmitLayoutResponse sresp;
  // Held while the coordinator is down or the node re-joins (a worker registering during a
  // coordinator restart): sent once the node re-joined - the re-join re-sent this worker's join
  // (it is registered here) but no layout (it has none yet), so the layout reaches the new
  // coordinator once, from here - or once more to the same coordinator (the same layout again
  // changes nothing there). A worker the re-join could not re-submit: NOT_FOUND, register again.
  uint64_t sent_in = 0;
  absl::Status s = ForwardHeld(
      req.model_id(), req.worker_id(), deadline, &sent_in,
      [&](absl::Time dl) {
        sresp.Clear();
        return coordinator_.client().SubmitLayout(sreq, &sresp, std::min(absl::Seconds(30), CallTimeout(options_.clock, dl)));
      },
      Hold{.call = "RegisterLayout", .advice = "the layout is not registered: call RegisterLayout again"});
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
  local_.RecordLayoutAnswer(key, req, *resp);
  return absl::OkStatus();
}

// A rollout's incoming staging of the first version (or of a catch-up) is faulted in at
// registration, not inside that version: one pool buffer per staging buffer, of the size a
// version's staging will ask the pool for (planner::StagingLayout of the layout the coordinator
// resolves: the pieces over the registered buffers - a quantised rollout's buffers grow by the
// canonical shadows of its quantised pieces, so the live sizes it was prewarmed with before never
// matched, and its first version, or a late rollout's catch-up, paid fresh pages: seconds per GB
// on a VM that traps first touches). Done before the layout is submitted, as the catch-up of a
// late rollout starts right after (prewarming after it raced the catch-up's own allocation).
// Buffers staged on their GPU (--gpu_staging_bytes, unquantised CUDA rollouts) take none. Best
// effort: a layout that cannot be described here is left to the version (and refused by the
// coordinator if it is wrong).
void WorkerCalls::PrewarmIncomingStaging(const pb::ModelSpec& spec, const pb::RegisterLayoutRequest& req, const pb::LayoutSpec& layout,
                                         const std::vector<bool>& is_cuda) {
  absl::StatusOr<std::shared_ptr<const LayoutDescriber::Model>> model = describer_.ModelOf(spec);
  if (!model.ok()) return;
  const std::vector<pb::BufferSpec> buffers(req.buffers().begin(), req.buffers().end());
  std::vector<uint32_t> ids;
  absl::StatusOr<planner::LayoutInfo> info = describer_.DescribeInfo(**model, layout, buffers, planner::Role::kRollout, &ids, req.worker_id());
  if (!info.ok()) return;
  planner::WorkerLayout planned = std::move(info->layout);
  // The registered sizes, as the resolved layout carries them (StagingLayout appends past them).
  for (size_t j = 0; j < planned.buffers.size() && j < buffers.size(); ++j) planned.buffers[j].size_bytes = static_cast<int64_t>(buffers[j].size_bytes());
  const bool quantized = planner::HasQuantizedPieces(planned);
  const planner::WorkerLayout staging = planner::StagingLayout((*model)->inventory, planned);
  const absl::Time t0 = options_.clock->Now();
  for (size_t j = 0; j < staging.buffers.size(); ++j) {
    const bool cuda = j < is_cuda.size() && is_cuda[j];
    if (cuda && staging_.gpu_staging() && !quantized) continue;
    staging_.PrewarmStaging(staging.buffers[j].size_bytes);
  }
  Log(LogLevel::kDebug, "rollout staging pre-faulted",
      {{"model", req.model_id()}, {"worker", req.worker_id()}, {"seconds", absl::ToDoubleSeconds(options_.clock->Now() - t0)}});
}

// Layout discovery (daemon/layout_discovery.h), computed on this node: from the model's spec as
// this node holds it (a worker of the model registered here: the coordinator's spec), else from
// the request's `model`, so a worker can size its buffers before it registers anything.
absl::Status WorkerCalls::DescribeLayout(const pb::DescribeLayoutRequest& req, pb::DescribeLayoutResponse* resp) {
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

absl::StatusOr<std::shared_ptr<CudaImport>> WorkerCalls::ImportCuda(const std::string& model, const std::string& worker,
                                                                   const pb::BufferSpec& b) {
  const bool is_vmm = b.memory_case() == pb::BufferSpec::kCudaVmmKey;
  const std::string what =
      absl::StrCat("worker ", worker, " buffer ", b.buffer_id(), is_vmm ? " (CUDA VMM, gpu " : " (CUDA IPC, gpu ", b.gpu(), ")");
  transport::Transport* t = transports_.set().Find("cuda_ipc");
  if (t == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": node ", options_.node_id,
                                                      " has no cuda_ipc transport (no GPU visible to the daemon, "
                                                      "or --transports excludes it); register host shared memory instead"));
  }
  GpuImport::VmmFdFn vmm_fd;
  if (options_.cuda_vmm_fd) {
    vmm_fd = [this, &model](const std::string& w, const std::string& key) { return options_.cuda_vmm_fd(model, w, key); };
  }
  ASSIGN_OR_RETURN(std::shared_ptr<CudaImport> imp, options_.gpu_import->Import(*t, worker, b, what, vmm_fd));
  if (imp->device != b.gpu()) {
    Log(LogLevel::kInfo, "CUDA buffer on another GPU than the worker numbers it",
        {{"node", options_.node_id}, {"worker", worker}, {"buffer", b.buffer_id()}, {"worker_gpu", b.gpu()}, {"daemon_gpu", imp->device}});
  }
  return imp;
}

}  // namespace wb::daemon::node
