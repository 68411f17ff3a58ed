#pragma once
// Conversions between weightbridge.v1 protos and the planner's plain value types. This is the
// edge where protos meet planner types: planner/ never sees a proto. Every conversion that can
// fail (unknown enum, unknown tensor name, rank mismatch) returns an error naming what is wrong.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::client {

namespace pb = ::weightbridge::v1;

// Worker-side modes of a model (design.md "Versions and modes").
enum class Mode : uint8_t { kSync, kOneStepOff, kAsync };
const char* ModeName(Mode mode);  // "sync", "one_step_off", "async"
absl::StatusOr<Mode> ParseMode(const std::string& name);

pb::DType ToProto(planner::DType dtype);
absl::StatusOr<planner::DType> FromProto(pb::DType dtype);

pb::Role ToProto(planner::Role role);
absl::StatusOr<planner::Role> FromProto(pb::Role role);

pb::Mode ToProto(Mode mode);
absl::StatusOr<Mode> FromProto(pb::Mode mode);

pb::Strategy ToProto(planner::Strategy strategy);
// Fails for strategies the daemon cannot execute (owner_broadcast is planned, never executed).
absl::StatusOr<planner::Strategy> FromProto(pb::Strategy strategy);
absl::StatusOr<planner::Strategy> ParseStrategy(const std::string& name);

pb::Box ToProto(const planner::Box& box);
// Fails when begin and end have different ranks.
absl::StatusOr<planner::Box> FromProto(const pb::Box& box);

pb::TensorSpec ToProto(const planner::TensorSpec& spec);
absl::StatusOr<planner::TensorSpec> FromProto(const pb::TensorSpec& spec);

pb::ExplicitInventory ToProto(const planner::Inventory& inventory);
absl::StatusOr<planner::Inventory> FromProto(const pb::ExplicitInventory& inventory);

// A planner piece names its tensor by inventory index; a proto piece by HF name. `inventory`
// resolves both directions; an index or name it does not hold is INVALID_ARGUMENT.
absl::StatusOr<pb::Piece> PieceToProto(const planner::Piece& piece,
                                       const planner::Inventory& inventory);
absl::StatusOr<planner::Piece> PieceFromProto(const pb::Piece& piece,
                                              const planner::Inventory& inventory);

// All pieces of a layout, in order.
absl::StatusOr<pb::ExplicitPieces> PiecesToProto(const std::vector<planner::Piece>& pieces,
                                                 const planner::Inventory& inventory);

}  // namespace wb::client
