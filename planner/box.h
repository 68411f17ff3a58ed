#pragma once
// Box arithmetic in canonical coordinates. Pure and allocation-light; used on hot planning paths.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "planner/types.h"

namespace wb::planner {

// Number of elements (0 for an empty box). Requires begin.size() == end.size().
int64_t BoxVolume(const Box& box);
bool BoxEmpty(const Box& box);
// The whole tensor as a box.
Box FullBox(const std::vector<int64_t>& shape);
// Intersection, or nullopt when empty.
std::optional<Box> Intersect(const Box& a, const Box& b);
// True when `inner` lies inside `outer`.
bool BoxContains(const Box& outer, const Box& inner);
// True when the box lies inside [0, shape).
bool BoxInside(const Box& box, const std::vector<int64_t>& shape);
bool BoxEqual(const Box& a, const Box& b);
// "[0:128, 0:896]"
std::string BoxToString(const Box& box);

// True when the union of `boxes` (each inside [0, shape), any overlaps) covers every element of
// a tensor of `shape`. Exact: the boxes' boundaries cut each dim into intervals and every cell of
// that grid must lie in some box. False when the grid would have more than `max_cells` cells or
// marking the boxes' cells would take more than 4 * max_cells steps (not decided).
bool BoxesCover(const std::vector<Box>& boxes, const std::vector<int64_t>& shape, int64_t max_cells = int64_t{1} << 20);

// Decomposes the flat row-major element range [flat_begin, flat_end) of a tensor with `shape`
// into disjoint boxes (at most 2*rank-1), in flat order. Used for FSDP flat shards.
std::vector<Box> FlatRangeToBoxes(const std::vector<int64_t>& shape, int64_t flat_begin,
                                  int64_t flat_end);

// Row-major contiguous strides for `shape`.
std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape);

}  // namespace wb::planner
