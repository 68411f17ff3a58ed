#include "daemon/layout_discovery.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/convert.h"
#include "daemon/lora_spec.h"
#include "planner/inventory.h"
#include "planner/lora.h"
#include "planner/quantized.h"
#include "planner/validate.h"
#include "base/status_macros.h"

namespace wb::daemon {

pb::LayoutDescription LayoutInfoToProto(const planner::LayoutInfo& info, const planner::Inventory& inventory,
                                        const std::vector<uint32_t>& buffer_ids, const std::string& source) {
  auto id_of = [&](int32_t index) {
    return index >= 0 && static_cast<size_t>(index) < buffer_ids.size() ? buffer_ids[index] : static_cast<uint32_t>(index);
  };
  pb::LayoutDescription out;
  out.set_source(source);
  google::protobuf::RepeatedPtrField<pb::BufferSpec> buffers;
  for (size_t b = 0; b < info.buffer_bytes.size(); ++b) {
    pb::BufferSpec* spec = buffers.Add();
    spec->set_buffer_id(id_of(static_cast<int32_t>(b)));
    spec->set_size_bytes(static_cast<uint64_t>(info.buffer_bytes[b]));
  }
  *out.mutable_buffers() = buffers;
  pb::ResolvedLayout resolved;
  LayoutToProto(info.layout, inventory, buffers, &resolved);
  *out.mutable_pieces() = std::move(*resolved.mutable_pieces());
  for (const planner::LocalTensorInfo& t : info.tensors) {
    pb::LocalTensorInfo* lt = out.add_tensors();
    lt->set_name(t.name);
    lt->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    lt->set_dtype(ToProto(t.dtype));
    lt->set_buffer_id(id_of(t.buffer));
    lt->set_offset_bytes(static_cast<uint64_t>(t.offset_bytes));
    lt->mutable_strides()->Assign(t.strides.begin(), t.strides.end());
    lt->set_size_bytes(static_cast<uint64_t>(t.size_bytes));
    for (int32_t k : t.pieces) lt->add_pieces(static_cast<uint32_t>(k));
    lt->set_scale_tensor(t.scale_tensor);
    lt->set_scales_of(t.scales_of);
    lt->set_global_scale_tensor(t.global_scale_tensor);
    lt->set_global_scale_of(t.global_scale_of);
  }
  out.set_piece_bytes(static_cast<uint64_t>(info.piece_bytes));
  return out;
}

absl::StatusOr<std::shared_ptr<const LayoutDescriber::Model>> LayoutDescriber::ModelOf(const pb::ModelSpec& spec) {
  // What the inventory depends on, and nothing else (worker counts, mode, ... do not matter).
  pb::ModelSpec key_spec;
  if (spec.has_explicit_tensors()) {
    *key_spec.mutable_explicit_tensors() = spec.explicit_tensors();
  } else {
    key_spec.set_hf_config_json(spec.hf_config_json());
    if (spec.has_lora()) *key_spec.mutable_lora() = spec.lora();
  }
  key_spec.set_dtype(spec.dtype());
  std::string bytes;
  key_spec.SerializeToString(&bytes);
  const std::string key = absl::StrCat(bytes.size(), ":", std::hash<std::string>()(bytes));
  {
    absl::MutexLock l(&mu_);
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->first != key) continue;
      auto hit = *it;
      cache_.erase(it);
      cache_.push_back(hit);
      return hit.second;
    }
  }
  // Built outside the lock (a large MoE inventory takes a while); as the coordinator does.
  auto m = std::make_shared<Model>();
  ASSIGN_OR_RETURN(SpecInventory built, InventoryForSpec(spec));
  m->inventory = std::move(built.inventory);
  m->config = std::move(built.config);
  absl::MutexLock l(&mu_);
  cache_.emplace_back(key, m);
  if (cache_.size() > kCacheEntries) cache_.erase(cache_.begin());
  return std::shared_ptr<const Model>(m);
}

absl::StatusOr<planner::LayoutInfo> LayoutDescriber::DescribeInfo(const Model& model, const pb::LayoutSpec& layout,
                                                                  const std::vector<pb::BufferSpec>& buffers,
                                                                  std::optional<planner::Role> validate_as,
                                                                  std::vector<uint32_t>* buffer_ids, const std::string& worker) {
  buffer_ids->clear();
  if (layout.has_preset()) {
    if (!model.config.has_value()) {
      return absl::FailedPreconditionError("preset layouts need a model created from hf_config_json");
    }
    const pb::ParallelConfig& pc = layout.preset();
    absl::StatusOr<planner::ParallelConfig> parallel = ParallelFromProto(pc);
    if (!parallel.ok()) return Annotate(parallel.status(), absl::StrCat("preset ", pc.preset(), " rank ", pc.rank()));
    auto preset = planner::MakeModelPresetLayout(*model.config, model.inventory, *parallel, static_cast<int>(pc.rank()));
    if (!preset.ok()) return Annotate(preset.status(), absl::StrCat("preset ", pc.preset(), " rank ", pc.rank()));
    for (size_t b = 0; b < preset->layout.buffers.size(); ++b) {
      buffer_ids->push_back(b < buffers.size() ? buffers[b].buffer_id() : static_cast<uint32_t>(b));
    }
    return planner::DescribePresetLayout(model.inventory, *preset);
  }
  if (!layout.has_pieces()) {
    return absl::FailedPreconditionError(
        "an index probe is resolved from the registered probe buffer: describe it through RegisterLayoutResponse.layout");
  }
  pb::ResolvedLayout resolved;
  if (!buffers.empty()) {
    for (const pb::BufferSpec& b : buffers) *resolved.add_buffers() = b;
  } else {
    std::set<uint32_t> ids;
    for (const pb::Piece& p : layout.pieces().pieces()) {
      ids.insert(p.buffer_id());
      if (p.quant_dtype() != pb::DTYPE_UNSPECIFIED) ids.insert(p.scale_buffer_id());
    }
    for (uint32_t id : ids) resolved.add_buffers()->set_buffer_id(id);
  }
  for (const pb::BufferSpec& b : resolved.buffers()) buffer_ids->push_back(b.buffer_id());
  *resolved.mutable_pieces() = layout.pieces().pieces();
  return DescribeResolvedPieces(model, resolved, validate_as, worker);
}

absl::StatusOr<planner::LayoutInfo> LayoutDescriber::DescribeResolvedPieces(const Model& model, const pb::ResolvedLayout& resolved,
                                                                            std::optional<planner::Role> validate_as,
                                                                            const std::string& worker) {
  ASSIGN_OR_RETURN(planner::WorkerLayout pieces, LayoutFromProto(resolved, model.inventory));
  planner::Role role = planner::Role::kTrainer;
  if (validate_as.has_value()) {
    role = *validate_as;
  } else if (planner::HasQuantizedPieces(pieces)) {
    role = planner::Role::kRollout;
  }
  // Moved, not copied: 1e6 pieces are ~250 MB in planner form.
  ASSIGN_OR_RETURN(planner::LayoutInfo info,
                   planner::DescribePieces(model.inventory, std::move(pieces), static_cast<int>(resolved.buffers_size())));
  RETURN_IF_ERROR(planner::ValidateLayout(model.inventory, info.layout, role, worker));
  return info;
}

absl::StatusOr<pb::LayoutDescription> LayoutDescriber::Describe(const pb::ModelSpec& spec, const pb::LayoutSpec& layout,
                                                                const std::vector<pb::BufferSpec>& buffers,
                                                                std::optional<planner::Role> validate_as, const std::string& worker) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, ModelOf(spec));
  std::vector<uint32_t> ids;
  ASSIGN_OR_RETURN(planner::LayoutInfo info, DescribeInfo(*model, layout, buffers, validate_as, &ids, worker));
  return LayoutInfoToProto(info, model->inventory, ids, layout.has_preset() ? "preset" : "pieces");
}

absl::StatusOr<std::optional<pb::LayoutDescription>> LayoutDescriber::DescribePresetForRegister(const pb::ModelSpec& spec,
                                                                                                const pb::RegisterLayoutRequest& req) {
  if (!req.layout().has_preset()) return std::optional<pb::LayoutDescription>();
  const pb::ParallelConfig& pc = req.layout().preset();
  const std::string who = absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id());
  auto model = ModelOf(spec);
  if (!model.ok()) return Annotate(model.status(), who);
  std::vector<uint32_t> ids;
  const std::vector<pb::BufferSpec> buffers(req.buffers().begin(), req.buffers().end());
  auto info = DescribeInfo(**model, req.layout(), buffers, std::nullopt, &ids, req.worker_id());
  if (!info.ok()) return Annotate(info.status(), who);
  std::vector<int64_t> registered;
  for (const pb::BufferSpec& b : req.buffers()) registered.push_back(static_cast<int64_t>(std::min<uint64_t>(b.size_bytes(), INT64_MAX)));
  RETURN_IF_ERROR(planner::CheckBufferSizes(*info, registered, absl::StrCat(who, ", preset ", pc.preset(), " rank ", pc.rank())));
  return std::optional<pb::LayoutDescription>(LayoutInfoToProto(*info, (*model)->inventory, ids, "preset"));
}

absl::StatusOr<pb::LayoutDescription> LayoutDescriber::DescribeResolved(const pb::ModelSpec& spec, const pb::ResolvedLayout& resolved,
                                                                        const std::string& source, planner::Role role,
                                                                        const std::string& worker) {
  if (resolved.buffers_size() > 0) {
    // Described straight from `resolved` (what Describe would do with its pieces and buffers,
    // without the two copies of every piece on the way).
    ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, ModelOf(spec));
    std::vector<uint32_t> ids;
    for (const pb::BufferSpec& b : resolved.buffers()) ids.push_back(b.buffer_id());
    ASSIGN_OR_RETURN(planner::LayoutInfo info, DescribeResolvedPieces(*model, resolved, role, worker));
    return LayoutInfoToProto(info, model->inventory, ids, source);
  }
  pb::LayoutSpec layout;
  *layout.mutable_pieces()->mutable_pieces() = resolved.pieces();
  const std::vector<pb::BufferSpec> buffers(resolved.buffers().begin(), resolved.buffers().end());
  ASSIGN_OR_RETURN(pb::LayoutDescription d, Describe(spec, layout, buffers, role, worker));
  d.set_source(source);
  return d;
}

}  // namespace wb::daemon
