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
// collision is detected, not trusted). Cost is linear in (pieces x cells they cover), never
// per element, and independent tensors never meet (no O(n^2) over the model).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
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
};

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
};

// Builds the fragments of `problem`. Errors: INVALID_ARGUMENT when a piece names an unknown
// tensor or has a box of the wrong rank / outside the tensor (naming worker, tensor and box);
// FAILED_PRECONDITION when some destination element is held by no source (naming tensor and box).
absl::StatusOr<FragmentSet> BuildFragments(const Problem& problem, const FragmentOptions& options);

// Splits a fragment box into `n` near-equal chunks along its first dimension of extent > 1.
// With `quantum` (elements per block, per dim) and a box starting on a multiple of it in the
// split dim, every cut lies on a multiple (fewer chunks when the box has fewer blocks).
std::vector<Box> SplitBox(const Box& box, int64_t n, const std::vector<int64_t>* quantum = nullptr);

}  // namespace wb::planner
