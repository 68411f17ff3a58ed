#include "client/proto_convert.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "tools/cc/status_macros.h"

namespace wb::client {

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kSync:
      return "sync";
    case Mode::kOneStepOff:
      return "one_step_off";
    case Mode::kAsync:
      return "async";
  }
  return "unknown";
}

absl::StatusOr<Mode> ParseMode(const std::string& name) {
  if (name == "sync") return Mode::kSync;
  if (name == "one_step_off" || name == "one-step-off") return Mode::kOneStepOff;
  if (name == "async") return Mode::kAsync;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown mode '", name, "' (want sync | one_step_off | async)"));
}

pb::DType ToProto(planner::DType dtype) {
  switch (dtype) {
    case planner::DType::kBF16:
      return pb::DTYPE_BF16;
    case planner::DType::kF16:
      return pb::DTYPE_F16;
    case planner::DType::kF32:
      return pb::DTYPE_F32;
    case planner::DType::kF8E4M3:
      return pb::DTYPE_F8_E4M3;
    case planner::DType::kI64:
      return pb::DTYPE_I64;
    case planner::DType::kE8M0:
      return pb::DTYPE_E8M0;
    case planner::DType::kI4:
      return pb::DTYPE_I4;
  }
  return pb::DTYPE_UNSPECIFIED;
}

absl::StatusOr<planner::DType> FromProto(pb::DType dtype) {
  switch (dtype) {
    case pb::DTYPE_UNSPECIFIED:  // the proto's documented default
    case pb::DTYPE_BF16:
      return planner::DType::kBF16;
    case pb::DTYPE_F16:
      return planner::DType::kF16;
    case pb::DTYPE_F32:
      return planner::DType::kF32;
    case pb::DTYPE_F8_E4M3:
      return planner::DType::kF8E4M3;
    case pb::DTYPE_I64:
      return planner::DType::kI64;
    case pb::DTYPE_E8M0:
      return planner::DType::kE8M0;
    case pb::DTYPE_I4:
      return planner::DType::kI4;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype enum value ", static_cast<int>(dtype)));
}

pb::Role ToProto(planner::Role role) {
  return role == planner::Role::kTrainer ? pb::ROLE_TRAINER : pb::ROLE_ROLLOUT;
}

absl::StatusOr<planner::Role> FromProto(pb::Role role) {
  if (role == pb::ROLE_TRAINER) return planner::Role::kTrainer;
  if (role == pb::ROLE_ROLLOUT) return planner::Role::kRollout;
  return absl::InvalidArgumentError(absl::StrCat("worker role must be trainer or rollout, got enum ",
                                                 static_cast<int>(role)));
}

pb::Mode ToProto(Mode mode) {
  switch (mode) {
    case Mode::kSync:
      return pb::MODE_SYNC;
    case Mode::kOneStepOff:
      return pb::MODE_ONE_STEP_OFF;
    case Mode::kAsync:
      return pb::MODE_ASYNC;
  }
  return pb::MODE_UNSPECIFIED;
}

absl::StatusOr<Mode> FromProto(pb::Mode mode) {
  if (mode == pb::MODE_SYNC) return Mode::kSync;
  if (mode == pb::MODE_ONE_STEP_OFF) return Mode::kOneStepOff;
  if (mode == pb::MODE_ASYNC) return Mode::kAsync;
  return absl::InvalidArgumentError(absl::StrCat("mode must be sync, one_step_off or async, got enum ",
                                                 static_cast<int>(mode)));
}

pb::Strategy ToProto(planner::Strategy strategy) {
  switch (strategy) {
    case planner::Strategy::kWeightBridge:
      return pb::STRATEGY_WEIGHTBRIDGE;
    case planner::Strategy::kRank0Broadcast:
      return pb::STRATEGY_RANK0_BROADCAST;
    case planner::Strategy::kP2PNoDedup:
      return pb::STRATEGY_P2P_NO_DEDUP;
    case planner::Strategy::kOwnerBroadcast:
      break;  // not executable by the daemons; callers get UNSPECIFIED and the daemon rejects nothing
  }
  return pb::STRATEGY_UNSPECIFIED;
}

absl::StatusOr<planner::Strategy> FromProto(pb::Strategy strategy) {
  switch (strategy) {
    case pb::STRATEGY_UNSPECIFIED:
    case pb::STRATEGY_WEIGHTBRIDGE:
      return planner::Strategy::kWeightBridge;
    case pb::STRATEGY_RANK0_BROADCAST:
      return planner::Strategy::kRank0Broadcast;
    case pb::STRATEGY_P2P_NO_DEDUP:
      return planner::Strategy::kP2PNoDedup;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown strategy enum value ", static_cast<int>(strategy)));
}

absl::StatusOr<planner::Strategy> ParseStrategy(const std::string& name) {
  if (name == "weightbridge") return planner::Strategy::kWeightBridge;
  if (name == "rank0_broadcast") return planner::Strategy::kRank0Broadcast;
  if (name == "p2p_no_dedup") return planner::Strategy::kP2PNoDedup;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown strategy '", name, "' (want weightbridge | rank0_broadcast | p2p_no_dedup)"));
}

pb::Box ToProto(const planner::Box& box) {
  pb::Box out;
  for (int64_t b : box.begin) out.add_begin(b);
  for (int64_t e : box.end) out.add_end(e);
  return out;
}

absl::StatusOr<planner::Box> FromProto(const pb::Box& box) {
  if (box.begin_size() != box.end_size()) {
    return absl::InvalidArgumentError(absl::StrCat("box has ", box.begin_size(), " begin and ",
                                                   box.end_size(), " end coordinates"));
  }
  planner::Box out;
  out.begin.assign(box.begin().begin(), box.begin().end());
  out.end.assign(box.end().begin(), box.end().end());
  return out;
}

pb::TensorSpec ToProto(const planner::TensorSpec& spec) {
  pb::TensorSpec out;
  out.set_name(spec.name);
  for (int64_t d : spec.shape) out.add_shape(d);
  out.set_dtype(ToProto(spec.dtype));
  return out;
}

absl::StatusOr<planner::TensorSpec> FromProto(const pb::TensorSpec& spec) {
  planner::TensorSpec out;
  out.name = spec.name();
  if (out.name.empty()) return absl::InvalidArgumentError("tensor spec without a name");
  out.shape.assign(spec.shape().begin(), spec.shape().end());
  for (int64_t d : out.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", out.name, " has a negative dimension ", d));
    }
  }
  ASSIGN_OR_RETURN(out.dtype, FromProto(spec.dtype()));
  return out;
}

pb::ExplicitInventory ToProto(const planner::Inventory& inventory) {
  pb::ExplicitInventory out;
  for (const auto& t : inventory.tensors) *out.add_tensors() = ToProto(t);
  return out;
}

absl::StatusOr<planner::Inventory> FromProto(const pb::ExplicitInventory& inventory) {
  planner::Inventory out;
  for (const auto& t : inventory.tensors()) {
    ASSIGN_OR_RETURN(planner::TensorSpec spec, FromProto(t));
    out.tensors.push_back(std::move(spec));
  }
  return out;
}

absl::StatusOr<pb::Piece> PieceToProto(const planner::Piece& piece,
                                       const planner::Inventory& inventory) {
  if (piece.tensor < 0 || piece.tensor >= static_cast<int32_t>(inventory.tensors.size())) {
    return absl::InvalidArgumentError(absl::StrCat("piece names tensor index ", piece.tensor,
                                                   " but the inventory has ",
                                                   inventory.tensors.size(), " tensors"));
  }
  if (piece.buffer < 0 || piece.offset_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "piece of ", inventory.tensors[piece.tensor].name, " ", planner::BoxToString(piece.box),
        " has a negative buffer (", piece.buffer, ") or offset (", piece.offset_bytes, ")"));
  }
  pb::Piece out;
  out.set_tensor(inventory.tensors[piece.tensor].name);
  *out.mutable_box() = ToProto(piece.box);
  out.set_buffer_id(static_cast<uint32_t>(piece.buffer));
  out.set_offset_bytes(static_cast<uint64_t>(piece.offset_bytes));
  for (int64_t s : piece.strides) out.add_strides(s);
  if (piece.quant.has_value()) {
    if (piece.quant->scale_buffer < 0 || piece.quant->scale_offset_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("piece of ", inventory.tensors[piece.tensor].name, " ",
                                                     planner::BoxToString(piece.box), " has a negative scale buffer or offset"));
    }
    out.set_quant_dtype(ToProto(piece.quant->dtype));
    out.set_quant_scale_dtype(ToProto(piece.quant->scale_dtype));
    for (int64_t b : piece.quant->block) out.add_quant_block(b);
    out.set_scale_buffer_id(static_cast<uint32_t>(piece.quant->scale_buffer));
    out.set_scale_offset_bytes(static_cast<uint64_t>(piece.quant->scale_offset_bytes));
  }
  return out;
}

absl::StatusOr<planner::Piece> PieceFromProto(const pb::Piece& piece,
                                              const planner::Inventory& inventory) {
  planner::Piece out;
  for (size_t i = 0; i < inventory.tensors.size(); ++i) {
    if (inventory.tensors[i].name == piece.tensor()) {
      out.tensor = static_cast<int32_t>(i);
      break;
    }
  }
  if (out.tensor < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("piece names tensor '", piece.tensor(), "', which is not in the model"));
  }
  ASSIGN_OR_RETURN(out.box, FromProto(piece.box()));
  out.buffer = static_cast<int32_t>(piece.buffer_id());
  out.offset_bytes = static_cast<int64_t>(piece.offset_bytes());
  out.strides.assign(piece.strides().begin(), piece.strides().end());
  if (piece.quant_dtype() != pb::DTYPE_UNSPECIFIED) {
    planner::Quantization q;
    ASSIGN_OR_RETURN(q.dtype, FromProto(piece.quant_dtype()));
    if (piece.quant_scale_dtype() != pb::DTYPE_UNSPECIFIED) {
      ASSIGN_OR_RETURN(q.scale_dtype, FromProto(piece.quant_scale_dtype()));
    }
    q.block.assign(piece.quant_block().begin(), piece.quant_block().end());
    q.scale_buffer = static_cast<int32_t>(piece.scale_buffer_id());
    q.scale_offset_bytes = static_cast<int64_t>(piece.scale_offset_bytes());
    out.quant = std::move(q);
  }
  return out;
}

absl::StatusOr<pb::ExplicitPieces> PiecesToProto(const std::vector<planner::Piece>& pieces,
                                                 const planner::Inventory& inventory) {
  pb::ExplicitPieces out;
  for (const auto& p : pieces) {
    ASSIGN_OR_RETURN(*out.add_pieces(), PieceToProto(p, inventory));
  }
  return out;
}

}  // namespace wb::client
