#pragma once
// Proto <-> planner value types. The only place in the daemon where both meet (design: planner is
// pure, protos stay at the edges). Every conversion that can fail names the offending field.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/presets.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

absl::StatusOr<planner::DType> FromProto(pb::DType dtype);
pb::DType ToProto(planner::DType dtype);
planner::Role FromProto(pb::Role role);
pb::Role ToProto(planner::Role role);
planner::Strategy FromProto(pb::Strategy strategy);
pb::Strategy ToProto(planner::Strategy strategy);
pb::Route ToProto(planner::Route route);
const char* ModeName(pb::Mode mode);

planner::Box FromProto(const pb::Box& box);
void ToProto(const planner::Box& box, pb::Box* out);

absl::StatusOr<planner::Inventory> InventoryFromProto(
    const google::protobuf::RepeatedPtrField<pb::TensorSpec>& tensors);
void InventoryToProto(const planner::Inventory& inventory,
                      google::protobuf::RepeatedPtrField<pb::TensorSpec>* out);

// Resolved layout (pieces name tensors and buffer ids) -> planner layout (indices). Unknown tensor
// names, unknown buffer ids and rank mismatches are INVALID_ARGUMENT naming the piece.
absl::StatusOr<planner::WorkerLayout> LayoutFromProto(const pb::ResolvedLayout& layout,
                                                      const planner::Inventory& inventory);
// Inverse: `buffers` supplies the ids/specs in buffer-index order.
void LayoutToProto(const planner::WorkerLayout& layout, const planner::Inventory& inventory,
                   const google::protobuf::RepeatedPtrField<pb::BufferSpec>& buffers,
                   pb::ResolvedLayout* out);

// A preset's parallel config from the proto (0 = the preset's default of 1; etp 0 = tp; stage
// counts capped at 2^30). The one conversion the coordinator (resolving presets) and the node
// (layout discovery) share, so both always describe the same layout.
planner::ParallelConfig ParallelFromProto(const pb::ParallelConfig& p);

void StatsToProto(const planner::PlanStats& stats, int num_buckets, pb::PlanStats* out);

}  // namespace wb::daemon
