#pragma once
// Layout validation: run on every registered layout before anything uses it. Errors are
// InvalidArgument and name the worker, the canonical tensor and the box (BoxToString).

#include <cstdint>
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
// Per tensor, the boundaries of the destination boxes and of the source boxes inside their hull
// form a grid; the distinct source boxes mark the cells they cover and each distinct destination
// box is checked cell by cell (the planner's grid, planner/grid.h): linear in the cells the
// distinct boxes cover, never per element and never quadratic in pieces. Layouts are assumed valid.
// Errors: INVALID_ARGUMENT naming the worker, tensor, box and an uncovered cell; RESOURCE_EXHAUSTED
// naming the tensor (and the largest source piece) when its boundaries form more than
// kMaxGridCells cells or the walk would pass CoverageWorkBudget(pieces) (docs/planner.md "Work
// bounds"): the planner would refuse such a layout anyway.
inline constexpr int64_t kCoverageWorkBase = int64_t{1} << 28;
inline constexpr int64_t kCoverageWorkPerPiece = 1024;
inline int64_t CoverageWorkBudget(int64_t pieces) { return kCoverageWorkBase + kCoverageWorkPerPiece * pieces; }
// `work_budget` > 0 replaces CoverageWorkBudget (tests).
absl::Status ValidateCoverage(const Inventory& inventory, const std::vector<const Worker*>& sources,
                              const std::vector<const Worker*>& destinations, int64_t work_budget = 0);

// ValidateLayout on every worker, then ValidateCoverage with trainers as sources and rollouts as
// destinations.
absl::Status ValidateProblem(const Problem& problem);

}  // namespace wb::planner
