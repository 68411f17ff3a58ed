#pragma once
// Fragments: the atoms of a transfer problem. For every canonical tensor, the region needed by the
// destinations is cut into disjoint boxes such that every box lies entirely inside or entirely
// outside every source piece and every destination piece. Each fragment therefore has one set of
// holders (source pieces) and one set of needers (destination pieces), and the planner and the
// cost model reason per fragment instead of per element.
//
// Construction is per tensor: the breakpoints of all boxes of that tensor form a grid; grid cells
// are labelled by a 128-bit signature of the covering pieces; equal-signature cells are merged
// greedily into maximal boxes; membership is then recomputed exactly by containment (a signature
// collision is detected, not trusted). Cost is linear in (distinct boxes x cells they cover),
// never per element, and independent tensors never meet (no O(n^2) over the model).
//
// Work bounds (docs/planner.md "Work bounds"): pieces are grouped by their box clipped to the
// destinations' hull, so N copies of a box cost one grid walk; the work (cells walked, cells
// merged, candidate holders tested, refs written, split chunks) is metered against
// FragmentWorkBudget(pieces) and exceeding it is RESOURCE_EXHAUSTED, so a hostile layout cannot
// keep the coordinator's planner thread busy for hours.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cancel.h"
#include "planner/grid.h"  // kMaxGridCells, ForEachGridCell (the grid shared with ValidateCoverage)
#include "planner/types.h"

namespace wb::planner {

struct PieceRef {
  int32_t worker = -1;
  int32_t piece = -1;
};

struct Fragment {
  int32_t tensor = -1;
  Box box;
  int64_t bytes = 0;
  // [src_begin, src_end) and [dst_begin, dst_end) index FragmentSet::refs; both ranges are in
  // increasing worker order. Every src piece contains `box`; every dst piece contains `box`.
  uint32_t src_begin = 0, src_end = 0;
  uint32_t dst_begin = 0, dst_end = 0;
};

struct FragmentSet {
  std::vector<Fragment> fragments;  // tensor order, then row-major box order: deterministic
  std::vector<PieceRef> refs;       // pooled holder/needer lists
  int64_t total_dst_bytes = 0;      // sum over destination pieces of their bytes
  int64_t work = 0;                 // work units spent (FragmentWorkBudget), for tests and benches
};

// Work budget of one BuildFragments call: kFragmentWorkBase + kFragmentWorkPerPiece per piece
// (trainer and rollout pieces together). A unit is one grid cell walked or merged, one candidate
// box tested against a fragment, one holder/needer ref written or one split chunk: a few ns each,
// so the base alone is about a second of one core. Real layouts use well under 1% of it
// (docs/planner.md "Work bounds" lists them); only layouts whose boxes overlap each other in ways
// no framework produces get near it.
inline constexpr int64_t kFragmentWorkBase = int64_t{1} << 28;
inline constexpr int64_t kFragmentWorkPerPiece = 1024;
inline int64_t FragmentWorkBudget(int64_t pieces) { return kFragmentWorkBase + kFragmentWorkPerPiece * pieces; }

struct FragmentOptions {
  // Fragments larger than this are split along their first dimension of extent > 1 into
  // near-equal chunks (load-balancing granularity and staging-budget fit). 0: never split.
  int64_t max_fragment_bytes = 0;
  // When max_fragment_bytes is 0 and this is > 0: split at about total destination bytes /
  // (auto_grain_slots * 64), at least 4 MiB, at most auto_grain_cap.
  int64_t auto_grain_slots = 0;
  int64_t auto_grain_cap = 0;
  // Splits of a fragment whose (first) needer is a quantised piece cut on that piece's block grid
  // (sender-side quantisation: planner/sender_quant.h).
  bool align_splits_to_quant_blocks = false;
  // > 0: the work budget instead of FragmentWorkBudget(pieces) (tests).
  int64_t work_budget = 0;
  // Polled as the work is done (grid walks, cell merges, refs written, split chunks: planner/cancel.h);
  // null: never. When it says stop, BuildFragments returns its error naming the tensor it was on.
  CancelPoll* cancel = nullptr;
};

// Builds the fragments of `problem`. Errors: INVALID_ARGUMENT when a piece names an unknown
// tensor or has a box of the wrong rank / outside the tensor (naming worker, tensor and box);
// FAILED_PRECONDITION when some destination element is held by no source (naming tensor and box);
// RESOURCE_EXHAUSTED when a tensor's boundaries form more than kMaxGridCells cells or the work
// budget (FragmentWorkBudget, or options.work_budget when > 0) runs out (naming the tensor, the
// worker when one piece is to blame, and the budget); options.cancel's error (its code) when it
// says stop, naming the tensor and the fragments built so far.
//
// Holders: a worker holding several pieces with the same box (clipped to the destinations' hull)
// is listed once per fragment, with its lowest-indexed such piece (one GPU, one choice); distinct
// workers holding the same box all stay holders (alternative senders for load balancing).
// Needers are never merged: every destination piece gets its own ref.
absl::StatusOr<FragmentSet> BuildFragments(const Problem& problem, const FragmentOptions& options);

// Splits a fragment box into `n` near-equal chunks along its first dimension of extent > 1.
// With `quantum` (elements per block, per dim) and a box starting on a multiple of it in the
// split dim, every cut lies on a multiple (fewer chunks when the box has fewer blocks).
std::vector<Box> SplitBox(const Box& box, int64_t n, const std::vector<int64_t>* quantum = nullptr);

}  // namespace wb::planner
