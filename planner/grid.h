#pragma once
// The grid of one canonical tensor that BuildFragments (planner/fragments.h) and ValidateCoverage
// (planner/validate.h) share: the hull of the needed (destination) boxes and, per dimension, the
// sorted distinct breakpoints of the needed boxes and of the held (source) boxes' coordinates that
// lie strictly inside the hull. Every needed or held box clipped to the hull is then a box of whole
// grid cells; both walk cells, never elements.

#include <cstdint>
#include <vector>

#include "planner/types.h"

namespace wb::planner {

// Most grid cells one tensor's piece boundaries may form (scratch is a few bytes per cell).
inline constexpr int64_t kMaxGridCells = int64_t{1} << 24;

struct TensorGrid {
  std::vector<std::vector<int64_t>> bp;  // per dim: sorted distinct breakpoints (after Finish)
  std::vector<int64_t> dims;             // per dim: cells, bp[d].size() - 1 (0 when none)
  std::vector<int64_t> hull_lo, hull_hi;  // hull of the needed boxes

  // Starts the grid of a rank-`rank` tensor (keeps the vectors' capacity).
  void Reset(size_t rank);
  // Extends the hull by a needed box and adds its coordinates. Call for every needed box first.
  void AddNeeded(const Box& box);
  // Adds a held box's coordinates that lie strictly inside the hull.
  void AddHeld(const Box& box);
  // Sorts the breakpoints and sets dims. Returns the number of cells (1 for rank 0), or -1 when
  // they pass kMaxGridCells.
  int64_t Finish();
  // Grid index range [lo, hi) (rank values each) of a box given as rank begins then rank ends,
  // clipped to the hull; returns the cells it covers.
  int64_t IndexRange(const int64_t* clipped, int64_t* lo, int64_t* hi) const;
};

// Calls fn(cell_index) for every cell of the index box [lo, hi) of a row-major grid with `dims`
// (rank <= 16), in increasing cell order.
template <typename Fn>
void ForEachGridCell(const std::vector<int64_t>& dims, const int64_t* lo, const int64_t* hi, Fn&& fn) {
  const size_t rank = dims.size();
  for (size_t d = 0; d < rank; ++d) {
    if (lo[d] >= hi[d]) return;
  }
  if (rank == 0) {
    fn(int64_t{0});
    return;
  }
  int64_t idx[16];
  for (size_t d = 0; d < rank; ++d) idx[d] = lo[d];
  while (true) {
    int64_t c = 0;
    for (size_t d = 0; d < rank; ++d) c = c * dims[d] + idx[d];
    // The last dimension is contiguous in cell order.
    const int64_t run = hi[rank - 1] - lo[rank - 1];
    for (int64_t k = 0; k < run; ++k) fn(c + k);
    if (rank == 1) return;
    size_t d = rank - 2;
    while (true) {
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
      if (d == 0) return;
      --d;
    }
  }
}

}  // namespace wb::planner
