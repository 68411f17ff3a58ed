#pragma once
// A minimal point-to-point planner used until (and unless) the real planner::MakePlan is wired in:
// every destination piece pulls each overlapping source box from the first trainer holding it
// (replicas with identical boxes are deduplicated; distinct source pieces must not overlap).
// One bucket, no relays, no load balancing. Completeness is checked: a destination element no
// source holds is INVALID_ARGUMENT naming the tensor and box.

#include "absl/status/statusor.h"
#include "planner/types.h"

namespace wb::daemon {

absl::StatusOr<planner::Plan> SimplePlan(const planner::Problem& problem, planner::Strategy strategy);

}  // namespace wb::daemon
