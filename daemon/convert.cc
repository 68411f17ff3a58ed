#include "daemon/convert.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace wb::daemon {

absl::StatusOr<planner::DType> FromProto(pb::DType dtype) {
  switch (dtype) {
    case pb::DTYPE_UNSPECIFIED:
    case pb::DTYPE_BF16: return planner::DType::kBF16;
    case pb::DTYPE_F16: return planner::DType::kF16;
    case pb::DTYPE_F32: return planner::DType::kF32;
    case pb::DTYPE_F8_E4M3: return planner::DType::kF8E4M3;
    case pb::DTYPE_I64: return planner::DType::kI64;
    case pb::DTYPE_E8M0: return planner::DType::kE8M0;
    case pb::DTYPE_I4: return planner::DType::kI4;
    default: return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
  }
}

pb::DType ToProto(planner::DType dtype) {
  switch (dtype) {
    case planner::DType::kBF16: return pb::DTYPE_BF16;
    case planner::DType::kF16: return pb::DTYPE_F16;
    case planner::DType::kF32: return pb::DTYPE_F32;
    case planner::DType::kF8E4M3: return pb::DTYPE_F8_E4M3;
    case planner::DType::kI64: return pb::DTYPE_I64;
    case planner::DType::kE8M0: return pb::DTYPE_E8M0;
    case planner::DType::kI4: return pb::DTYPE_I4;
  }
  return pb::DTYPE_UNSPECIFIED;
}

planner::Role FromProto(pb::Role role) {
  return role == pb::ROLE_ROLLOUT ? planner::Role::kRollout : planner::Role::kTrainer;
}
pb::Role ToProto(planner::Role role) {
  return role == planner::Role::kRollout ? pb::ROLE_ROLLOUT : pb::ROLE_TRAINER;
}

planner::Strategy FromProto(pb::Strategy strategy) {
  switch (strategy) {
    case pb::STRATEGY_RANK0_BROADCAST: return planner::Strategy::kRank0Broadcast;
    case pb::STRATEGY_P2P_NO_DEDUP: return planner::Strategy::kP2PNoDedup;
    default: return planner::Strategy::kWeightBridge;
  }
}
pb::Strategy ToProto(planner::Strategy strategy) {
  switch (strategy) {
    case planner::Strategy::kRank0Broadcast: return pb::STRATEGY_RANK0_BROADCAST;
    case planner::Strategy::kP2PNoDedup: return pb::STRATEGY_P2P_NO_DEDUP;
    default: return pb::STRATEGY_WEIGHTBRIDGE;
  }
}

pb::Route ToProto(planner::Route route) {
  switch (route) {
    case planner::Route::kSameGpu: return pb::ROUTE_SAME_GPU;
    case planner::Route::kIntraNode: return pb::ROUTE_INTRA_NODE;
    case planner::Route::kInterNode: return pb::ROUTE_INTER_NODE;
  }
  return pb::ROUTE_UNSPECIFIED;
}

const char* ModeName(pb::Mode mode) {
  switch (mode) {
    case pb::MODE_ONE_STEP_OFF: return "one_step_off";
    case pb::MODE_ASYNC: return "async";
    default: return "sync";
  }
}

planner::Box FromProto(const pb::Box& box) {
  planner::Box out;
  out.begin.assign(box.begin().begin(), box.begin().end());
  out.end.assign(box.end().begin(), box.end().end());
  return out;
}

void ToProto(const planner::Box& box, pb::Box* out) {
  out->mutable_begin()->Assign(box.begin.begin(), box.begin.end());
  out->mutable_end()->Assign(box.end.begin(), box.end.end());
}

absl::StatusOr<planner::Inventory> InventoryFromProto(
    const google::protobuf::RepeatedPtrField<pb::TensorSpec>& tensors) {
  planner::Inventory inv;
  absl::flat_hash_map<std::string, int> seen;
  for (const pb::TensorSpec& t : tensors) {
    if (t.name().empty()) return absl::InvalidArgumentError("tensor with an empty name");
    if (!seen.emplace(t.name(), 1).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor ", t.name()));
    }
    planner::TensorSpec spec;
    spec.name = t.name();
    spec.shape.assign(t.shape().begin(), t.shape().end());
    for (int64_t d : spec.shape) {
      if (d <= 0) return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), ": non-positive dim"));
    }
    auto dtype = FromProto(t.dtype());
    if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), ": ", dtype.status().message()));
    spec.dtype = *dtype;
    inv.tensors.push_back(std::move(spec));
  }
  return inv;
}

void InventoryToProto(const planner::Inventory& inventory,
                      google::protobuf::RepeatedPtrField<pb::TensorSpec>* out) {
  for (const planner::TensorSpec& t : inventory.tensors) {
    pb::TensorSpec* p = out->Add();
    p->set_name(t.name);
    p->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    p->set_dtype(ToProto(t.dtype));
  }
}

absl::StatusOr<planner::WorkerLayout> LayoutFromProto(const pb::ResolvedLayout& layout,
                                                      const planner::Inventory& inventory) {
  planner::WorkerLayout out;
  absl::flat_hash_map<uint32_t, int32_t> buffer_index;
  for (const pb::BufferSpec& b : layout.buffers()) {
    if (!buffer_index.emplace(b.buffer_id(), static_cast<int32_t>(out.buffers.size())).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate buffer_id ", b.buffer_id()));
    }
    out.buffers.push_back(planner::BufferInfo{static_cast<int64_t>(b.size_bytes())});
  }
  absl::flat_hash_map<std::string, int32_t> tensor_index;
  for (size_t i = 0; i < inventory.tensors.size(); ++i) tensor_index[inventory.tensors[i].name] = static_cast<int32_t>(i);
  for (int i = 0; i < layout.pieces_size(); ++i) {
    const pb::Piece& p = layout.pieces(i);
    auto t = tensor_index.find(p.tensor());
    if (t == tensor_index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("piece ", i, ": unknown tensor '", p.tensor(), "'"));
    }
    auto b = buffer_index.find(p.buffer_id());
    if (b == buffer_index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("piece ", i, " of tensor ", p.tensor(), ": unknown buffer_id ", p.buffer_id()));
    }
    planner::Piece piece;
    piece.tensor = t->second;
    piece.box = FromProto(p.box());
    piece.buffer = b->second;
    piece.offset_bytes = static_cast<int64_t>(p.offset_bytes());
    piece.strides.assign(p.strides().begin(), p.strides().end());
    if (p.quant_dtype() != pb::DTYPE_UNSPECIFIED) {
      planner::Quantization q;
      auto dtype = FromProto(p.quant_dtype());
      if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor ", p.tensor(), " piece ", i, ": quant_dtype: ", dtype.status().message()));
      q.dtype = *dtype;
      if (p.quant_scale_dtype() != pb::DTYPE_UNSPECIFIED) {
        auto scale_dtype = FromProto(p.quant_scale_dtype());
        if (!scale_dtype.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", p.tensor(), " piece ", i, ": quant_scale_dtype: ", scale_dtype.status().message()));
        }
        q.scale_dtype = *scale_dtype;
      }
      q.block.assign(p.quant_block().begin(), p.quant_block().end());
      auto sb = buffer_index.find(p.scale_buffer_id());
      if (sb == buffer_index.end()) {
        return absl::InvalidArgumentError(absl::StrCat("piece ", i, " of tensor ", p.tensor(), ": unknown scale_buffer_id ", p.scale_buffer_id()));
      }
      q.scale_buffer = sb->second;
      if (p.scale_offset_bytes() > static_cast<uint64_t>(INT64_MAX)) {
        return absl::InvalidArgumentError(absl::StrCat("piece ", i, " of tensor ", p.tensor(), ": scale_offset_bytes too large"));
      }
      q.scale_offset_bytes = static_cast<int64_t>(p.scale_offset_bytes());
      piece.quant = std::move(q);
    } else if (p.quant_block_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat("piece ", i, " of tensor ", p.tensor(), ": quant_block without quant_dtype"));
    }
    size_t rank = inventory.tensors[t->second].shape.size();
    if (piece.box.begin.size() != rank || piece.box.end.size() != rank || piece.strides.size() != rank) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", p.tensor(), " piece ", i, ": box/strides rank must be ", rank));
    }
    out.pieces.push_back(std::move(piece));
  }
  return out;
}

void LayoutToProto(const planner::WorkerLayout& layout, const planner::Inventory& inventory,
                   const google::protobuf::RepeatedPtrField<pb::BufferSpec>& buffers,
                   pb::ResolvedLayout* out) {
  *out->mutable_buffers() = buffers;
  for (const planner::Piece& piece : layout.pieces) {
    pb::Piece* p = out->add_pieces();
    p->set_tensor(inventory.tensors[piece.tensor].name);
    ToProto(piece.box, p->mutable_box());
    p->set_buffer_id(piece.buffer < buffers.size() ? buffers[piece.buffer].buffer_id() : 0);
    p->set_offset_bytes(static_cast<uint64_t>(piece.offset_bytes));
    p->mutable_strides()->Assign(piece.strides.begin(), piece.strides.end());
    if (piece.quant.has_value()) {
      p->set_quant_dtype(ToProto(piece.quant->dtype));
      p->set_quant_scale_dtype(ToProto(piece.quant->scale_dtype));
      p->mutable_quant_block()->Assign(piece.quant->block.begin(), piece.quant->block.end());
      const int32_t sb = piece.quant->scale_buffer;
      p->set_scale_buffer_id(sb >= 0 && sb < buffers.size() ? buffers[sb].buffer_id() : 0);
      p->set_scale_offset_bytes(static_cast<uint64_t>(piece.quant->scale_offset_bytes));
    }
  }
}

void StatsToProto(const planner::PlanStats& stats, int num_buckets, pb::PlanStats* out) {
  out->set_complete(stats.complete);
  out->set_redundant_bytes(stats.redundant_bytes);
  out->set_bytes_inter_node(stats.bytes_inter_node);
  out->set_bytes_intra_node(stats.bytes_intra_node);
  out->set_num_ops(stats.num_ops);
  out->set_lower_bound_s(stats.lower_bound_s);
  out->set_makespan_s(stats.makespan_s);
  out->set_plan_ms(stats.plan_ms);
  out->set_num_buckets(static_cast<uint32_t>(num_buckets));
}

planner::ParallelConfig ParallelFromProto(const pb::ParallelConfig& p) {
  planner::ParallelConfig c;
  c.preset = p.preset();
  c.tp = p.tp() ? static_cast<int>(p.tp()) : 1;
  c.pp = p.pp() ? static_cast<int>(p.pp()) : 1;
  c.dp = p.dp() ? static_cast<int>(p.dp()) : 1;
  c.ep = p.ep() ? static_cast<int>(p.ep()) : 1;
  c.etp = static_cast<int>(p.etp());
  c.expert_parallel = p.expert_parallel();
  c.replicas = p.replicas() ? static_cast<int>(p.replicas()) : 1;
  c.quantization = p.quantization();
  c.first_stage_layers = static_cast<int>(std::min<uint32_t>(p.first_stage_layers(), 1u << 30));
  c.last_stage_layers = static_cast<int>(std::min<uint32_t>(p.last_stage_layers(), 1u << 30));
  c.vpp = p.vpp() ? static_cast<int>(std::min<uint32_t>(p.vpp(), 1u << 30)) : 1;
  c.expert_placement = p.expert_placement();
  return c;
}

}  // namespace wb::daemon
