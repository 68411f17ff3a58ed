#pragma once
// The daemon's names for the one proto <-> planner conversion library, proto/convert.h (whose
// header states the contract: what is validated there and what planner::ValidateLayout checks).
// New code: include "proto/convert.h" and call wb::convert:: directly.
//
// Three daemon-only forms remain for callers that validated the request BEFORE converting
// (daemon/coordinator/checks.h, the worker service's role check) or that read plans the
// coordinator made: Role and Strategy return the value itself (an enum value the proto does not
// define reads as trainer / weightbridge), and a Box is copied without the rank check. Everything
// else is wb::convert's, unchanged.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/presets.h"
#include "planner/types.h"
#include "proto/convert.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

using convert::InventoryFromProto;
using convert::InventoryToProto;
using convert::LayoutFromProto;
using convert::LayoutToProto;
using convert::ModeName;
using convert::ParallelFromProto;
using convert::StatsToProto;
using convert::ToProto;

inline absl::StatusOr<planner::DType> FromProto(pb::DType dtype) { return convert::FromProto(dtype); }

// Validated before (checks.h / the worker service): anything but ROLLOUT reads as trainer.
inline planner::Role FromProto(pb::Role role) {
  return role == pb::ROLE_ROLLOUT ? planner::Role::kRollout : planner::Role::kTrainer;
}

// Validated before (checks.h): UNSPECIFIED and undefined values read as weightbridge.
inline planner::Strategy FromProto(pb::Strategy strategy) {
  return convert::FromProto(strategy).value_or(planner::Strategy::kWeightBridge);
}

// A box of a plan the coordinator made (already checked): copied as is.
inline planner::Box FromProto(const pb::Box& box) {
  return planner::Box{{box.begin().begin(), box.begin().end()}, {box.end().begin(), box.end().end()}};
}

}  // namespace wb::daemon
