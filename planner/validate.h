#pragma once
// Layout validation: run on every registered layout before anything uses it. Errors are
// InvalidArgument and name the worker, the canonical tensor and the box (BoxToString).

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "planner/types.h"

namespace wb::planner {

// Checks one worker's layout against the inventory:
//  - every piece names an existing tensor; box rank == tensor rank == strides rank; box non-empty
//    and inside the tensor's shape;
//  - buffer index valid; offset >= 0 and a multiple of the element size; strides >= 0 and
//    non-aliasing (each dim's stride exceeds the span of the smaller-stride dims, so distinct
//    elements have distinct addresses); the farthest element lies inside the buffer;
//  - inventory dtypes valid;
//  - for Role::kRollout (destinations): no two pieces overlap in their buffer bytes.
// `worker` is used in messages only.
absl::Status ValidateLayout(const Inventory& inventory, const WorkerLayout& layout, Role role,
                            absl::string_view worker = "");

// Every element of every destination piece is held by at least one source piece (same tensor).
// Per tensor, destination boxes are checked against the union of the distinct source boxes (fast
// path: one source box contains it; otherwise box subtraction). Layouts are assumed valid.
absl::Status ValidateCoverage(const Inventory& inventory, const std::vector<const Worker*>& sources,
                              const std::vector<const Worker*>& destinations);

// ValidateLayout on every worker, then ValidateCoverage with trainers as sources and rollouts as
// destinations.
absl::Status ValidateProblem(const Problem& problem);

}  // namespace wb::planner
