#include "proto/convert.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "planner/box.h"

namespace wb::convert {
namespace {

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError(what); }

// "piece 3 of tensor model.x.weight" (or "piece 3" before the tensor is known).
std::string PieceName(int index, const std::string& tensor) {
  std::string s = index >= 0 ? absl::StrCat("piece ", index) : std::string("piece");
  if (!tensor.empty()) absl::StrAppend(&s, " of tensor ", tensor);
  return s;
}

// Shared by PieceFromProto (id == index) and LayoutFromProto (ids of the layout's buffers):
// `buffer_index` maps a proto buffer id to a planner buffer index, nullopt when the id is unknown.
absl::StatusOr<planner::Piece> ConvertPiece(const pb::Piece& p, int index, const planner::Inventory& inventory,
                                            const absl::flat_hash_map<std::string, int32_t>& tensor_index,
                                            const std::function<std::optional<int32_t>(uint32_t)>& buffer_index) {
  auto t = tensor_index.find(p.tensor());
  if (t == tensor_index.end()) {
    return Invalid(absl::StrCat(PieceName(index, ""), ": unknown tensor '", p.tensor(), "' (not in the model)"));
  }
  auto name = [&] { return PieceName(index, p.tensor()); };  // only for an error: not per piece of 1e6
  planner::Piece piece;
  piece.tensor = t->second;
  auto box = FromProto(p.box());
  if (!box.ok()) return Invalid(absl::StrCat(name(), ": ", box.status().message()));
  piece.box = *std::move(box);
  std::optional<int32_t> b = buffer_index(p.buffer_id());
  if (!b) return Invalid(absl::StrCat(name(), ": unknown buffer_id ", p.buffer_id()));
  piece.buffer = *b;
  if (p.offset_bytes() > static_cast<uint64_t>(INT64_MAX)) {
    return Invalid(absl::StrCat(name(), ": offset_bytes ", p.offset_bytes(), " too large"));
  }
  piece.offset_bytes = static_cast<int64_t>(p.offset_bytes());
  piece.strides.assign(p.strides().begin(), p.strides().end());
  if (p.quant_dtype() != pb::DTYPE_UNSPECIFIED) {
    planner::Quantization q;
    auto dtype = FromProto(p.quant_dtype());
    if (!dtype.ok()) return Invalid(absl::StrCat(name(), ": quant_dtype: ", dtype.status().message()));
    q.dtype = *dtype;
    if (p.quant_scale_dtype() != pb::DTYPE_UNSPECIFIED) {
      auto scale = FromProto(p.quant_scale_dtype());
      if (!scale.ok()) return Invalid(absl::StrCat(name(), ": quant_scale_dtype: ", scale.status().message()));
      q.scale_dtype = *scale;
    }
    q.block.assign(p.quant_block().begin(), p.quant_block().end());
    std::optional<int32_t> sb = buffer_index(p.scale_buffer_id());
    if (!sb) return Invalid(absl::StrCat(name(), ": unknown scale_buffer_id ", p.scale_buffer_id()));
    q.scale_buffer = *sb;
    if (p.scale_offset_bytes() > static_cast<uint64_t>(INT64_MAX)) {
      return Invalid(absl::StrCat(name(), ": scale_offset_bytes ", p.scale_offset_bytes(), " too large"));
    }
    q.scale_offset_bytes = static_cast<int64_t>(p.scale_offset_bytes());
    if (p.has_quant_global_scale_offset()) {
      if (p.quant_global_scale_offset() > static_cast<uint64_t>(INT64_MAX)) {
        return Invalid(absl::StrCat(name(), ": quant_global_scale_offset ", p.quant_global_scale_offset(), " too large"));
      }
      q.global_scale_offset_bytes = static_cast<int64_t>(p.quant_global_scale_offset());
    }
    piece.quant = std::move(q);
  } else if (p.quant_block_size() > 0) {
    return Invalid(absl::StrCat(name(), ": quant_block without quant_dtype"));
  } else if (p.has_quant_global_scale_offset()) {
    return Invalid(absl::StrCat(name(), ": quant_global_scale_offset without quant_dtype"));
  }
  const size_t rank = inventory.tensors[t->second].shape.size();
  if (piece.box.begin.size() != rank || piece.strides.size() != rank) {
    return Invalid(absl::StrCat(name(), ": box/strides rank must be ", rank, " (the tensor's), got box rank ",
                                piece.box.begin.size(), " and ", piece.strides.size(), " strides"));
  }
  return piece;
}

absl::flat_hash_map<std::string, int32_t> TensorIndex(const planner::Inventory& inventory) {
  absl::flat_hash_map<std::string, int32_t> index;
  for (size_t i = 0; i < inventory.tensors.size(); ++i) index.emplace(inventory.tensors[i].name, static_cast<int32_t>(i));
  return index;
}

}  // namespace

// ---- enums ----

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kSync: return "sync";
    case Mode::kOneStepOff: return "one_step_off";
    case Mode::kAsync: return "async";
  }
  return "unknown";
}

const char* ModeName(pb::Mode mode) {
  switch (mode) {
    case pb::MODE_ONE_STEP_OFF: return "one_step_off";
    case pb::MODE_ASYNC: return "async";
    default: return "sync";
  }
}

absl::StatusOr<Mode> ParseMode(const std::string& name) {
  if (name == "sync") return Mode::kSync;
  if (name == "one_step_off" || name == "one-step-off") return Mode::kOneStepOff;
  if (name == "async") return Mode::kAsync;
  return Invalid(absl::StrCat("unknown mode '", name, "' (want sync | one_step_off | async)"));
}

absl::StatusOr<planner::Strategy> ParseStrategy(const std::string& name) {
  if (name == "weightbridge") return planner::Strategy::kWeightBridge;
  if (name == "rank0_broadcast") return planner::Strategy::kRank0Broadcast;
  if (name == "p2p_no_dedup") return planner::Strategy::kP2PNoDedup;
  return Invalid(absl::StrCat("unknown strategy '", name, "' (want weightbridge | rank0_broadcast | p2p_no_dedup)"));
}

absl::StatusOr<planner::DType> FromProto(pb::DType dtype) {
  switch (dtype) {
    case pb::DTYPE_UNSPECIFIED:  // the proto's documented default
    case pb::DTYPE_BF16: return planner::DType::kBF16;
    case pb::DTYPE_F16: return planner::DType::kF16;
    case pb::DTYPE_F32: return planner::DType::kF32;
    case pb::DTYPE_F8_E4M3: return planner::DType::kF8E4M3;
    case pb::DTYPE_I64: return planner::DType::kI64;
    case pb::DTYPE_E8M0: return planner::DType::kE8M0;
    case pb::DTYPE_I4: return planner::DType::kI4;
    case pb::DTYPE_F4_E2M1: return planner::DType::kF4E2M1;
    default: break;
  }
  return Invalid(absl::StrCat("unknown dtype enum value ", static_cast<int>(dtype)));
}

absl::StatusOr<planner::Role> FromProto(pb::Role role) {
  if (role == pb::ROLE_TRAINER) return planner::Role::kTrainer;
  if (role == pb::ROLE_ROLLOUT) return planner::Role::kRollout;
  return Invalid(absl::StrCat("worker role must be trainer or rollout, got enum ", static_cast<int>(role)));
}

absl::StatusOr<Mode> FromProto(pb::Mode mode) {
  if (mode == pb::MODE_SYNC) return Mode::kSync;
  if (mode == pb::MODE_ONE_STEP_OFF) return Mode::kOneStepOff;
  if (mode == pb::MODE_ASYNC) return Mode::kAsync;
  return Invalid(absl::StrCat("mode must be sync, one_step_off or async, got enum ", static_cast<int>(mode)));
}

absl::StatusOr<planner::Strategy> FromProto(pb::Strategy strategy) {
  switch (strategy) {
    case pb::STRATEGY_UNSPECIFIED:  // = STRATEGY_WEIGHTBRIDGE (documented in the proto)
    case pb::STRATEGY_WEIGHTBRIDGE: return planner::Strategy::kWeightBridge;
    case pb::STRATEGY_RANK0_BROADCAST: return planner::Strategy::kRank0Broadcast;
    case pb::STRATEGY_P2P_NO_DEDUP: return planner::Strategy::kP2PNoDedup;
    default: break;
  }
  return Invalid(absl::StrCat("unknown strategy enum value ", static_cast<int>(strategy)));
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
    case planner::DType::kF4E2M1: return pb::DTYPE_F4_E2M1;
  }
  return pb::DTYPE_UNSPECIFIED;
}

pb::Role ToProto(planner::Role role) { return role == planner::Role::kRollout ? pb::ROLE_ROLLOUT : pb::ROLE_TRAINER; }

pb::Mode ToProto(Mode mode) {
  switch (mode) {
    case Mode::kSync: return pb::MODE_SYNC;
    case Mode::kOneStepOff: return pb::MODE_ONE_STEP_OFF;
    case Mode::kAsync: return pb::MODE_ASYNC;
  }
  return pb::MODE_UNSPECIFIED;
}

pb::Strategy ToProto(planner::Strategy strategy) {
  switch (strategy) {
    case planner::Strategy::kWeightBridge: return pb::STRATEGY_WEIGHTBRIDGE;
    case planner::Strategy::kRank0Broadcast: return pb::STRATEGY_RANK0_BROADCAST;
    case planner::Strategy::kP2PNoDedup: return pb::STRATEGY_P2P_NO_DEDUP;
    case planner::Strategy::kOwnerBroadcast: break;  // planned (wbctl plan), never executed
  }
  return pb::STRATEGY_UNSPECIFIED;
}

pb::Route ToProto(planner::Route route) {
  switch (route) {
    case planner::Route::kSameGpu: return pb::ROUTE_SAME_GPU;
    case planner::Route::kIntraNode: return pb::ROUTE_INTRA_NODE;
    case planner::Route::kInterNode: return pb::ROUTE_INTER_NODE;
  }
  return pb::ROUTE_UNSPECIFIED;
}

// ---- boxes and tensors ----

absl::StatusOr<planner::Box> FromProto(const pb::Box& box) {
  if (box.begin_size() != box.end_size()) {
    return Invalid(absl::StrCat("box has ", box.begin_size(), " begin and ", box.end_size(), " end coordinates"));
  }
  planner::Box out;
  out.begin.assign(box.begin().begin(), box.begin().end());
  out.end.assign(box.end().begin(), box.end().end());
  return out;
}

pb::Box ToProto(const planner::Box& box) {
  pb::Box out;
  ToProto(box, &out);
  return out;
}

void ToProto(const planner::Box& box, pb::Box* out) {
  out->mutable_begin()->Assign(box.begin.begin(), box.begin.end());
  out->mutable_end()->Assign(box.end.begin(), box.end.end());
}

absl::StatusOr<planner::TensorSpec> FromProto(const pb::TensorSpec& spec) {
  if (spec.name().empty()) return Invalid("tensor with an empty name");
  planner::TensorSpec out;
  out.name = spec.name();
  out.shape.assign(spec.shape().begin(), spec.shape().end());
  for (size_t i = 0; i < out.shape.size(); ++i) {
    if (out.shape[i] <= 0) {
      return Invalid(absl::StrCat("tensor ", out.name, ": dimension ", i, " is ", out.shape[i], " (must be > 0)"));
    }
  }
  auto dtype = FromProto(spec.dtype());
  if (!dtype.ok()) return Invalid(absl::StrCat("tensor ", out.name, ": ", dtype.status().message()));
  out.dtype = *dtype;
  return out;
}

pb::TensorSpec ToProto(const planner::TensorSpec& spec) {
  pb::TensorSpec out;
  out.set_name(spec.name);
  out.mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
  out.set_dtype(ToProto(spec.dtype));
  return out;
}

absl::StatusOr<planner::Inventory> InventoryFromProto(const TensorSpecs& tensors) {
  planner::Inventory inv;
  absl::flat_hash_set<std::string> seen;
  for (const pb::TensorSpec& t : tensors) {
    ASSIGN_OR_RETURN(planner::TensorSpec spec, FromProto(t));
    if (!seen.insert(spec.name).second) return Invalid(absl::StrCat("duplicate tensor ", spec.name));
    inv.tensors.push_back(std::move(spec));
  }
  return inv;
}

absl::StatusOr<planner::Inventory> FromProto(const pb::ExplicitInventory& inventory) {
  return InventoryFromProto(inventory.tensors());
}

void InventoryToProto(const planner::Inventory& inventory, TensorSpecs* out) {
  for (const planner::TensorSpec& t : inventory.tensors) *out->Add() = ToProto(t);
}

pb::ExplicitInventory ToProto(const planner::Inventory& inventory) {
  pb::ExplicitInventory out;
  InventoryToProto(inventory, out.mutable_tensors());
  return out;
}

// ---- pieces and layouts ----

absl::StatusOr<planner::Piece> PieceFromProto(const pb::Piece& piece, const planner::Inventory& inventory) {
  return ConvertPiece(piece, -1, inventory, TensorIndex(inventory), [](uint32_t id) -> std::optional<int32_t> {
    if (id > static_cast<uint32_t>(INT32_MAX)) return std::nullopt;
    return static_cast<int32_t>(id);
  });
}

absl::StatusOr<pb::Piece> PieceToProto(const planner::Piece& piece, const planner::Inventory& inventory) {
  if (piece.tensor < 0 || piece.tensor >= static_cast<int32_t>(inventory.tensors.size())) {
    return Invalid(absl::StrCat("piece names tensor index ", piece.tensor, " but the inventory has ",
                                inventory.tensors.size(), " tensors"));
  }
  const std::string& name = inventory.tensors[piece.tensor].name;
  if (piece.buffer < 0 || piece.offset_bytes < 0) {
    return Invalid(absl::StrCat("piece of ", name, " ", planner::BoxToString(piece.box), " has a negative buffer (",
                                piece.buffer, ") or offset (", piece.offset_bytes, ")"));
  }
  pb::Piece out;
  out.set_tensor(name);
  ToProto(piece.box, out.mutable_box());
  out.set_buffer_id(static_cast<uint32_t>(piece.buffer));
  out.set_offset_bytes(static_cast<uint64_t>(piece.offset_bytes));
  out.mutable_strides()->Assign(piece.strides.begin(), piece.strides.end());
  if (piece.quant.has_value()) {
    if (piece.quant->scale_buffer < 0 || piece.quant->scale_offset_bytes < 0) {
      return Invalid(absl::StrCat("piece of ", name, " ", planner::BoxToString(piece.box),
                                  " has a negative scale buffer or offset"));
    }
    out.set_quant_dtype(ToProto(piece.quant->dtype));
    out.set_quant_scale_dtype(ToProto(piece.quant->scale_dtype));
    out.mutable_quant_block()->Assign(piece.quant->block.begin(), piece.quant->block.end());
    out.set_scale_buffer_id(static_cast<uint32_t>(piece.quant->scale_buffer));
    out.set_scale_offset_bytes(static_cast<uint64_t>(piece.quant->scale_offset_bytes));
    if (piece.quant->global_scale_offset_bytes >= 0) {
      out.set_quant_global_scale_offset(static_cast<uint64_t>(piece.quant->global_scale_offset_bytes));
    }
  }
  return out;
}

absl::StatusOr<pb::ExplicitPieces> PiecesToProto(const std::vector<planner::Piece>& pieces,
                                                 const planner::Inventory& inventory) {
  pb::ExplicitPieces out;
  for (const planner::Piece& p : pieces) {
    ASSIGN_OR_RETURN(*out.add_pieces(), PieceToProto(p, inventory));
  }
  return out;
}

absl::StatusOr<planner::WorkerLayout> LayoutFromProto(const pb::ResolvedLayout& layout,
                                                      const planner::Inventory& inventory) {
  planner::WorkerLayout out;
  absl::flat_hash_map<uint32_t, int32_t> buffer_index;
  for (const pb::BufferSpec& b : layout.buffers()) {
    if (!buffer_index.emplace(b.buffer_id(), static_cast<int32_t>(out.buffers.size())).second) {
      return Invalid(absl::StrCat("duplicate buffer_id ", b.buffer_id()));
    }
    out.buffers.push_back(planner::BufferInfo{static_cast<int64_t>(b.size_bytes())});
  }
  const auto tensor_index = TensorIndex(inventory);
  auto by_id = [&](uint32_t id) -> std::optional<int32_t> {
    auto it = buffer_index.find(id);
    if (it == buffer_index.end()) return std::nullopt;
    return it->second;
  };
  out.pieces.reserve(static_cast<size_t>(layout.pieces_size()));
  for (int i = 0; i < layout.pieces_size(); ++i) {
    ASSIGN_OR_RETURN(planner::Piece piece, ConvertPiece(layout.pieces(i), i, inventory, tensor_index, by_id));
    out.pieces.push_back(std::move(piece));
  }
  return out;
}

void LayoutToProto(const planner::WorkerLayout& layout, const planner::Inventory& inventory, const BufferSpecs& buffers,
                   pb::ResolvedLayout* out) {
  *out->mutable_buffers() = buffers;
  auto id_of = [&](int32_t index) { return index >= 0 && index < buffers.size() ? buffers[index].buffer_id() : 0u; };
  for (const planner::Piece& piece : layout.pieces) {
    pb::Piece* p = out->add_pieces();
    p->set_tensor(inventory.tensors[piece.tensor].name);
    ToProto(piece.box, p->mutable_box());
    p->set_buffer_id(id_of(piece.buffer));
    p->set_offset_bytes(static_cast<uint64_t>(piece.offset_bytes));
    p->mutable_strides()->Assign(piece.strides.begin(), piece.strides.end());
    if (piece.quant.has_value()) {
      p->set_quant_dtype(ToProto(piece.quant->dtype));
      p->set_quant_scale_dtype(ToProto(piece.quant->scale_dtype));
      p->mutable_quant_block()->Assign(piece.quant->block.begin(), piece.quant->block.end());
      p->set_scale_buffer_id(id_of(piece.quant->scale_buffer));
      p->set_scale_offset_bytes(static_cast<uint64_t>(piece.quant->scale_offset_bytes));
      if (piece.quant->global_scale_offset_bytes >= 0) {
        p->set_quant_global_scale_offset(static_cast<uint64_t>(piece.quant->global_scale_offset_bytes));
      }
    }
  }
}

// ---- parallel configs and plan statistics ----

absl::StatusOr<planner::ParallelConfig> ParallelFromProto(const pb::ParallelConfig& p) {
  // Every count is refused above the largest preset world (2^20), naming the value sent: before,
  // tp / pp / dp / ep / etp / replicas of 2^31 or more were cast to negative ints (refused as
  // "dp=-2147483648"), stage counts and vpp over 2^30 were refused as 2^30, and a
  // make_vocab_size_divisible_by over 2^20 was silently taken as 2^20 (a layout the worker did
  // not ask for).
  const std::pair<const char*, uint32_t> counts[] = {
      {"tp", p.tp()},
      {"pp", p.pp()},
      {"dp", p.dp()},
      {"ep", p.ep()},
      {"etp", p.etp()},
      {"replicas", p.replicas()},
      {"rank", p.rank()},
      {"first_stage_layers", p.first_stage_layers()},
      {"last_stage_layers", p.last_stage_layers()},
      {"vpp", p.vpp()},
      {"make_vocab_size_divisible_by", p.make_vocab_size_divisible_by()},
      {"moe_dense_tp_size", p.moe_dense_tp_size()},
  };
  for (const auto& [name, value] : counts) {
    if (value > planner::kMaxPresetWorld) {
      return Invalid(absl::StrCat("ParallelConfig.", name, " is ", value, ": more than the limit of ", planner::kMaxPresetWorld));
    }
  }
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
  c.first_stage_layers = static_cast<int>(p.first_stage_layers());
  c.last_stage_layers = static_cast<int>(p.last_stage_layers());
  c.vpp = p.vpp() ? static_cast<int>(p.vpp()) : 1;
  c.expert_placement = p.expert_placement();
  c.moe_a2a_backend = p.moe_a2a_backend();
  c.vocab_divisible_by = p.make_vocab_size_divisible_by() ? static_cast<int>(p.make_vocab_size_divisible_by()) : 128;
  c.moe_grouped_gemm = p.moe_grouped_gemm();
  c.moe_legacy_grouped_gemm = p.moe_use_legacy_grouped_gemm();
  c.tp_pp_dp_mapping = p.use_tp_pp_dp_mapping();
  c.enable_dp_lm_head = p.enable_dp_lm_head();
  c.moe_dense_tp_size = static_cast<int>(p.moe_dense_tp_size());
  return c;
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
  out->set_wire_bytes(stats.wire_bytes);
  out->set_wire_bytes_inter_node(stats.wire_bytes_inter_node);
  out->set_sender_quantized_bytes(stats.sender_quantized_bytes);
}

void OpToProto(const planner::TransferOp& op, pb::TransferOp* out) {
  out->set_src_worker(static_cast<uint32_t>(op.src_worker));
  out->set_dst_worker(static_cast<uint32_t>(op.dst_worker));
  out->set_src_piece(op.src_piece);
  out->set_dst_piece(op.dst_piece);
  out->set_tensor(op.tensor);
  ToProto(op.box, out->mutable_box());
  out->set_bytes(static_cast<uint64_t>(op.bytes));
  out->set_route(ToProto(op.route));
  out->set_sender_quantized(op.sender_quantized);
  out->set_wire_bytes(static_cast<uint64_t>(op.wire_bytes > 0 ? op.wire_bytes : op.bytes));
}

}  // namespace wb::convert
