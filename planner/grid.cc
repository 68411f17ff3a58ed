#include "planner/grid.h"

#include <algorithm>
#include <limits>

namespace wb::planner {

void TensorGrid::Reset(size_t rank) {
  bp.resize(rank);
  for (auto& v : bp) v.clear();
  dims.assign(rank, 0);
  hull_lo.assign(rank, std::numeric_limits<int64_t>::max());
  hull_hi.assign(rank, std::numeric_limits<int64_t>::min());
}

void TensorGrid::AddNeeded(const Box& box) {
  for (size_t d = 0; d < bp.size(); ++d) {
    hull_lo[d] = std::min(hull_lo[d], box.begin[d]);
    hull_hi[d] = std::max(hull_hi[d], box.end[d]);
    bp[d].push_back(box.begin[d]);
    bp[d].push_back(box.end[d]);
  }
}

void TensorGrid::AddHeld(const Box& box) {
  for (size_t d = 0; d < bp.size(); ++d) {
    if (box.begin[d] > hull_lo[d] && box.begin[d] < hull_hi[d]) bp[d].push_back(box.begin[d]);
    if (box.end[d] > hull_lo[d] && box.end[d] < hull_hi[d]) bp[d].push_back(box.end[d]);
  }
}

int64_t TensorGrid::Finish() {
  int64_t cells = 1;
  for (size_t d = 0; d < bp.size(); ++d) {
    auto& v = bp[d];
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    dims[d] = std::max<int64_t>(static_cast<int64_t>(v.size()) - 1, 0);
    cells *= dims[d];  // at most kMaxGridCells x (2 x boxes) here: no overflow
    if (cells > kMaxGridCells) return -1;
  }
  return cells;
}

int64_t TensorGrid::IndexRange(const int64_t* clipped, int64_t* lo, int64_t* hi) const {
  const size_t rank = bp.size();
  int64_t vol = 1;
  for (size_t d = 0; d < rank; ++d) {
    const auto& v = bp[d];
    lo[d] = std::lower_bound(v.begin(), v.end(), clipped[d]) - v.begin();
    hi[d] = std::lower_bound(v.begin(), v.end(), clipped[rank + d]) - v.begin();
    vol *= hi[d] - lo[d];
  }
  return vol;
}

}  // namespace wb::planner
