#include "daemon/coordinator/model_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/convert.h"
#include "daemon/coordinator/checks.h"
#include "daemon/log.h"
#include "daemon/lora_spec.h"
#include "planner/inventory.h"
#include "planner/lora.h"
#include "planner/presets.h"
#include "planner/validate.h"
#include "base/status_macros.h"

namespace wb::daemon {
namespace {

namespace pb = ::weightbridge::v1;

ModeKind ToMode(pb::Mode mode) {
  switch (mode) {
    case pb::MODE_ONE_STEP_OFF: return ModeKind::kOneStepOff;
    case pb::MODE_ASYNC: return ModeKind::kAsync;
    default: return ModeKind::kSync;
  }
}

// The inventory (and, from hf_config_json, the model config) of a new model's spec.
absl::Status BuildInventory(const pb::ModelSpec& spec, ModelRegistry::Model* m) {
  if (spec.has_explicit_tensors() && spec.has_lora()) {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec.model_id(), ": lora needs hf_config_json"));
  }
  ASSIGN_OR_RETURN(SpecInventory built, InventoryForSpec(spec));
  planner::Inventory inventory = std::move(built.inventory);
  m->config = std::move(built.config);
  if (inventory.tensors.empty()) return absl::InvalidArgumentError("model has no tensors");
  m->inventory = std::make_shared<const planner::Inventory>(std::move(inventory));
  auto inventory_proto = std::make_shared<pb::ExplicitInventory>();
  InventoryToProto(*m->inventory, inventory_proto->mutable_tensors());
  m->inventory_bytes = inventory_proto->ByteSizeLong();
  m->inventory_proto = std::move(inventory_proto);
  return absl::OkStatus();
}

// A layout as submitted (pieces, or a preset of a model made from hf_config_json) -> the
// planner's layout; `resolved` gets the buffers and the pieces it resolved to.
absl::StatusOr<planner::WorkerLayout> ResolveLayout(const planner::Inventory& inventory, const planner::ModelConfig* config,
                                                    const pb::SubmitLayoutRequest& req, pb::ResolvedLayout* resolved) {
  *resolved->mutable_buffers() = req.buffers();
  if (req.layout().has_pieces()) {
    *resolved->mutable_pieces() = req.layout().pieces().pieces();
    return LayoutFromProto(*resolved, inventory);
  }
  if (!req.layout().has_preset()) {
    return absl::InvalidArgumentError("layout: pieces or preset required (index probes are resolved by the node)");
  }
  if (config == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", req.worker_id(), ": preset layouts need a model created from hf_config_json"));
  }
  const pb::ParallelConfig& pc = req.layout().preset();
  absl::StatusOr<planner::ParallelConfig> parallel = ParallelFromProto(pc);
  if (!parallel.ok()) {
    return Annotate(parallel.status(), absl::StrCat("worker ", req.worker_id(), " preset ", pc.preset(), " rank ", pc.rank()));
  }
  auto preset = planner::MakeModelPresetLayout(*config, inventory, *parallel, static_cast<int>(pc.rank()));
  if (!preset.ok()) {
    return Annotate(preset.status(), absl::StrCat("worker ", req.worker_id(), " preset ", pc.preset(), " rank ", pc.rank()));
  }
  planner::WorkerLayout layout = std::move(preset->layout);
  if (layout.buffers.size() != static_cast<size_t>(req.buffers_size())) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), ": preset ", pc.preset(), " needs ",
                                                   layout.buffers.size(), " buffers, the worker registered ", req.buffers_size()));
  }
  for (size_t i = 0; i < layout.buffers.size(); ++i) {
    if (layout.buffers[i].size_bytes > static_cast<int64_t>(req.buffers(i).size_bytes())) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), ": preset ", pc.preset(),
                                                     " buffer ", i, " needs ", layout.buffers[i].size_bytes, " bytes, registered ",
                                                     req.buffers(i).size_bytes()));
    }
    layout.buffers[i].size_bytes = static_cast<int64_t>(req.buffers(i).size_bytes());
  }
  resolved->clear_pieces();
  LayoutToProto(layout, inventory, req.buffers(), resolved);
  return layout;
}

}  // namespace

bool ModelRegistry::Model::InPlan(const std::string& worker) const {
  return std::find(plan.worker_ids.begin(), plan.worker_ids.end(), worker) != plan.worker_ids.end();
}

absl::StatusOr<bool> ModelRegistry::Create(const pb::ModelSpec& spec) {
  RETURN_IF_ERROR(CheckModelSpecEnums(spec, options_.max_name_bytes));
  auto it = models_.find(spec.model_id());
  if (it != models_.end()) {
    const pb::ModelSpec& have = it->second.spec;
    if (have.mode() != spec.mode() || have.num_trainer_workers() != spec.num_trainer_workers() ||
        have.num_rollout_workers() != spec.num_rollout_workers() || have.strategy() != spec.strategy() ||
        have.max_staleness() != spec.max_staleness()) {
      return absl::AlreadyExistsError(absl::StrCat("model ", spec.model_id(), " exists with a different spec"));
    }
    RETURN_IF_ERROR(CheckSameLora(have, spec));
    Touch(it->second);
    return false;
  }
  // At the cap an idle model makes room; it is removed only once the new one is built (a spec
  // that fails leaves it). Nothing else runs meanwhile: the caller holds mu_.
  Map::iterator victim = models_.end();
  if (static_cast<int>(models_.size()) >= options_.max_models) {
    absl::Status refusal;
    victim = PickVictim(spec.model_id(), &refusal);
    if (victim == models_.end()) return refusal;
  }
  if (spec.num_trainer_workers() == 0 || spec.num_rollout_workers() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec.model_id(), ": worker counts must be > 0"));
  }
  Model m;
  m.spec = spec;
  RETURN_IF_ERROR(BuildInventory(spec, &m));
  // All inventories together are bounded too: each costs the coordinator several times its
  // encoded size (parsed, planner form, reply copy), and max_models times the largest reply would
  // be tens of GB (size probe, thirty-eighth session: 135 MB kept ~650 MB).
  if (options_.max_inventory_bytes_total > 0) {
    int64_t held = 0;
    for (const auto& [id, other] : models_) {
      if (victim == models_.end() || id != victim->first) held += static_cast<int64_t>(other.inventory_bytes);
    }
    if (held + static_cast<int64_t>(m.inventory_bytes) > options_.max_inventory_bytes_total) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "model ", spec.model_id(), " refused: its inventory is ", m.inventory_bytes, " bytes and the ", models_.size(),
          " models held keep ", held, " bytes of inventories, more than the limit (max_inventory_bytes_total) of ",
          options_.max_inventory_bytes_total, " bytes"));
    }
  }
  m.machine = std::make_unique<VersionMachine>(ToMode(spec.mode()), spec.max_staleness());
  m.last_used = options_.clock->Now();
  if (victim != models_.end()) {
    Log(LogLevel::kInfo, "model evicted", {{"model", victim->first}, {"for", spec.model_id()},
                                           {"idle_seconds", absl::ToDoubleSeconds(m.last_used - victim->second.last_used)},
                                           {"max_models", options_.max_models}});
    models_.erase(victim);
  }
  Log(LogLevel::kInfo, "model created", {{"model", spec.model_id()}, {"tensors", m.inventory->tensors.size()},
                                         {"mode", ModeName(spec.mode())}, {"strategy", planner::StrategyName(FromProto(spec.strategy()))},
                                         {"trainers", spec.num_trainer_workers()}, {"rollouts", spec.num_rollout_workers()}});
  models_.emplace(spec.model_id(), std::move(m));
  return true;
}

absl::StatusOr<ModelRegistry::Model*> ModelRegistry::ForJoin(const pb::JoinWorkerRequest& req, bool* created) {
  *created = false;
  if (req.has_model() && !models_.count(req.model_id())) {
    pb::ModelSpec spec = req.model();
    if (spec.model_id().empty()) spec.set_model_id(req.model_id());
    ASSIGN_OR_RETURN(*created, Create(spec));
  }
  ASSIGN_OR_RETURN(Model * m, Get(req.model_id()));
  if (req.has_model() && !*created) {
    // Every worker of a model declares its spec (issue 16.5): the first one no longer wins silently.
    pb::ModelSpec declared = req.model();
    if (declared.model_id().empty()) declared.set_model_id(req.model_id());
    RETURN_IF_ERROR(CheckSameSpec(m->spec, declared, req.worker_id(), req.role()));
  }
  return m;
}

absl::StatusOr<ModelRegistry::Model*> ModelRegistry::Get(const std::string& model_id) {
  Model* m = Find(model_id);
  if (m == nullptr) return absl::NotFoundError(absl::StrCat("unknown model ", EchoValue(model_id)));
  Touch(*m);
  return m;
}

void ModelRegistry::Release(Model& m) {
  --m.holds;
  Touch(m);
}

ModelRegistry::Kept ModelRegistry::WhyKept(const Model& m, absl::Time now) const {
  if (!m.workers.empty()) return Kept::kWorkers;
  // Committed data (or a version a node reported holding) matters: never evicted.
  if (m.machine->newest_known() > 0) return Kept::kVersions;
  // (planning / committing / catch_up imply a hold or a version; checked anyway.)
  if (m.holds > 0 || m.planning || m.plan_queued || m.committing != 0 || m.catch_up.has_value()) return Kept::kInUse;
  if (now - m.last_used < options_.idle_grace) return Kept::kGrace;
  return Kept::kEvictable;
}

ModelRegistry::Map::iterator ModelRegistry::PickVictim(const std::string& new_id, absl::Status* refusal) {
  const absl::Time now = options_.clock->Now();
  Map::iterator victim = models_.end();
  std::map<Kept, size_t> kept;
  for (auto it = models_.begin(); it != models_.end(); ++it) {
    const Kept why = WhyKept(it->second, now);
    ++kept[why];
    if (why == Kept::kEvictable && (victim == models_.end() || it->second.last_used < victim->second.last_used)) victim = it;
  }
  if (victim == models_.end()) {
    *refusal = absl::ResourceExhaustedError(absl::StrCat(
        "model ", new_id, " refused: ", models_.size(), " models exist, the limit (max_models) is ", options_.max_models,
        ", and none is idle enough to evict: ", kept[Kept::kWorkers], " held by workers, ", kept[Kept::kVersions],
        " have had a version, ", kept[Kept::kInUse], " in use (a waiting call or a plan), ", kept[Kept::kGrace],
        " used within the idle grace period (", absl::FormatDuration(options_.idle_grace), ")"));
  }
  return victim;
}

ModelRegistry::Model* ModelRegistry::Find(const std::string& model_id) {
  auto it = models_.find(model_id);
  return it == models_.end() ? nullptr : &it->second;
}

const ModelRegistry::Model* ModelRegistry::Find(const std::string& model_id) const {
  auto it = models_.find(model_id);
  return it == models_.end() ? nullptr : &it->second;
}

absl::Status ModelRegistry::CheckReplySize(const std::string& model_id, size_t extra, bool created) {
  auto it = models_.find(model_id);
  if (it == models_.end()) return absl::OkStatus();
  // The reply must reach the node (its coordinator channel's receive limit); a model this call
  // created is removed again, so failed attempts leave nothing behind.
  const size_t size = it->second.inventory_bytes + extra;
  if (static_cast<int64_t>(size) <= options_.max_reply_bytes) return absl::OkStatus();
  if (created) models_.erase(it);
  return absl::ResourceExhaustedError(absl::StrCat("model ", model_id, ": its inventory reply is ", size, " bytes, more than max_reply_bytes (",
                                                   options_.max_reply_bytes, ")", created ? "; the model was not kept" : ""));
}

ModelRegistry::WorkerRec& ModelRegistry::AddWorker(Model& m, const std::string& worker_id, WorkerRec rec) {
  rec.serial = next_worker_serial_++;
  Touch(m);
  WorkerRec& slot = m.workers[worker_id];
  slot = std::move(rec);
  return slot;
}

absl::StatusOr<bool> ModelRegistry::SetLayout(Model& m, const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse* resp) {
  ASSIGN_OR_RETURN(LayoutSnapshot snap, SnapshotLayout(m, req.worker_id()));
  absl::StatusOr<ResolvedWorkerLayout> resolved = ResolveSnapshot(snap, req);
  if (!resolved.ok()) {
    DropSnapshot(snap);
    return resolved.status();
  }
  ASSIGN_OR_RETURN(const bool changed, ApplyLayout(snap, req, *resolved));
  resp->mutable_layout()->Swap(resolved->answer.get());
  return changed;
}

absl::StatusOr<ModelRegistry::LayoutSnapshot> ModelRegistry::SnapshotLayout(Model& m, const std::string& worker_id) {
  auto w = m.workers.find(worker_id);
  if (w == m.workers.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", EchoValue(worker_id), " has not joined model ", m.spec.model_id()));
  }
  LayoutSnapshot snap;
  snap.model = &m;
  snap.inventory = m.inventory;
  snap.config = m.config ? &*m.config : nullptr;
  snap.role = w->second.role;
  snap.serial = w->second.serial;
  if (w->second.has_layout) {
    snap.current = w->second.layout_proto;
    snap.current_pieces = w->second.layout_pieces;
  }
  Hold(m);
  return snap;
}

void ModelRegistry::DropSnapshot(LayoutSnapshot& snap) {
  if (snap.model == nullptr) return;
  Release(*snap.model);
  snap.model = nullptr;
}

absl::StatusOr<ModelRegistry::ResolvedWorkerLayout> ModelRegistry::ResolveSnapshot(const LayoutSnapshot& snap,
                                                                                   const pb::SubmitLayoutRequest& req) {
  auto resolved = std::make_shared<pb::ResolvedLayout>();
  ASSIGN_OR_RETURN(planner::WorkerLayout layout, ResolveLayout(*snap.inventory, snap.config, req, resolved.get()));
  absl::Status s = planner::ValidateLayout(*snap.inventory, layout, snap.role, req.worker_id());
  if (!s.ok()) {
    Log(LogLevel::kWarning, "layout rejected", {{"model", req.model_id()}, {"worker", req.worker_id()}, {"error", s.message()}});
    return s;
  }
  ResolvedWorkerLayout out;
  // Kept once (docs/security.md, the size probe's entry): the buffers parsed, the pieces encoded
  // (their tensor names interned in the inventory), the planner's form packed; the whole resolved proto
  // only until it is the answer.
  auto buffers = std::make_shared<pb::ResolvedLayout>();
  *buffers->mutable_buffers() = resolved->buffers();
  // Packed before the pieces are encoded, and the unpacked form dropped: one less copy of the
  // layout at the resolve's peak.
  ASSIGN_OR_RETURN(std::shared_ptr<const planner::PackedLayout> packed, planner::PackedLayout::PackShared(layout));
  layout = planner::WorkerLayout();
  ASSIGN_OR_RETURN(std::shared_ptr<const StoredPieces> pieces, StoredPieces::Make(resolved->pieces(), *packed, snap.inventory));
  // The same layout again is judged by its bytes; a different number of pieces or buffers cannot be.
  out.same = snap.current != nullptr && snap.current_pieces != nullptr && snap.current_pieces->size() == pieces->size() &&
             snap.current->buffers_size() == buffers->buffers_size() &&
             snap.current->SerializeAsString() == buffers->SerializeAsString() && *snap.current_pieces == *pieces;
  // A worker with CUDA buffers sits on their GPU as its node daemon numbers it (the node rewrites
  // BufferSpec.gpu; the worker's own `gpu` may use its CUDA_VISIBLE_DEVICES numbering): the plan's
  // topology (same-GPU colocation) then compares GPUs of one numbering.
  for (const pb::BufferSpec& b : resolved->buffers()) {
    if ((b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey) && b.gpu() >= 0) {
      out.gpu = b.gpu();
      break;
    }
  }
  if (out.same) {
    out.proto = snap.current;
    out.pieces = snap.current_pieces;
  } else {
    out.proto = std::move(buffers);
    out.pieces = std::move(pieces);
    out.layout = std::move(packed);
  }
  out.answer = std::move(resolved);
  return out;
}

absl::StatusOr<bool> ModelRegistry::ApplyLayout(LayoutSnapshot& snap, const pb::SubmitLayoutRequest& req, const ResolvedWorkerLayout& resolved) {
  Model& m = *snap.model;
  DropSnapshot(snap);  // mu_ is held again: m stays valid until the caller releases it
  auto w = m.workers.find(req.worker_id());
  const bool has_layout = w != m.workers.end() && w->second.has_layout;
  if (w == m.workers.end() || w->second.serial != snap.serial || (has_layout ? w->second.layout_proto : nullptr) != snap.current) {
    // Dropped and joined again, or another SubmitLayout of it won meanwhile: what was resolved
    // may be for another registration, or judged against a layout it no longer has.
    return absl::AbortedError(absl::StrCat("worker ", EchoValue(req.worker_id()), " of model ", req.model_id(), " ", kLayoutChanged,
                                           " (registered again, left, or another layout submitted); submit it again"));
  }
  // A second layout for the same worker (NODE helper, issue 15.13): the same one again is OK and
  // changes nothing; another one while the worker is in the model's plan is refused (dropping the
  // worker here left it registered on its node but gone from the coordinator); before any plan
  // includes it, it replaces the first.
  if (resolved.same) return false;
  if (has_layout && (m.InPlan(req.worker_id()) || m.planning)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", EchoValue(req.worker_id()), " of model ", req.model_id(), " already has a different layout in the model's plan",
        m.plan.epoch > 0 ? absl::StrCat(" (epoch ", m.plan.epoch, ")") : std::string(),
        "; a worker's layout cannot change under a plan: Deregister and RegisterWorker again to register a new one"));
  }
  w->second.has_layout = true;
  w->second.layout = resolved.layout;
  if (resolved.gpu >= 0) w->second.gpu = resolved.gpu;
  w->second.layout_proto = resolved.proto;
  w->second.layout_pieces = resolved.pieces;
  return true;
}

}  // namespace wb::daemon
