#include "planner/grid.h"

#include <vector>

#include "gtest/gtest.h"

namespace wb::planner {
namespace {

Box B(std::vector<int64_t> b, std::vector<int64_t> e) { return Box{std::move(b), std::move(e)}; }

TEST(TensorGridTest, NeededBoxesSetTheHullAndHeldBoxesCutOnlyInsideIt) {
  TensorGrid g;
  g.Reset(2);
  g.AddNeeded(B({2, 0}, {6, 8}));
  g.AddNeeded(B({4, 0}, {10, 4}));
  g.AddHeld(B({0, 0}, {5, 8}));   // row 5 is inside the hull [2, 10), row 0 and col 8 are not
  g.AddHeld(B({5, 2}, {12, 3}));  // col 2, 3 inside; row 12 outside
  EXPECT_EQ(g.Finish(), 4 * 4);
  EXPECT_EQ(g.hull_lo, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(g.hull_hi, (std::vector<int64_t>{10, 8}));
  EXPECT_EQ(g.bp[0], (std::vector<int64_t>{2, 4, 5, 6, 10}));
  EXPECT_EQ(g.bp[1], (std::vector<int64_t>{0, 2, 3, 4, 8}));
  EXPECT_EQ(g.dims, (std::vector<int64_t>{4, 4}));
  const int64_t clipped[] = {5, 2, 10, 3};  // rows [5, 10), col [2, 3)
  int64_t lo[2], hi[2];
  EXPECT_EQ(g.IndexRange(clipped, lo, hi), 2);
  EXPECT_EQ(lo[0], 2);
  EXPECT_EQ(hi[0], 4);
  EXPECT_EQ(lo[1], 1);
  EXPECT_EQ(hi[1], 2);
  // Reset keeps nothing of the previous tensor.
  g.Reset(1);
  g.AddNeeded(B({3}, {7}));
  EXPECT_EQ(g.Finish(), 1);
  EXPECT_EQ(g.bp[0], (std::vector<int64_t>{3, 7}));
}

TEST(TensorGridTest, RankZeroHasOneCellAndTooManyCellsIsMinusOne) {
  TensorGrid g;
  g.Reset(0);
  g.AddNeeded(B({}, {}));
  EXPECT_EQ(g.Finish(), 1);
  g.Reset(2);
  for (int64_t i = 0; i < 4097; ++i) g.AddNeeded(B({i, i}, {i + 1, i + 1}));  // 4097 x 4097 cells
  EXPECT_EQ(g.Finish(), -1);
  g.Reset(2);
  for (int64_t i = 0; i < 4096; ++i) g.AddNeeded(B({i, i}, {i + 1, i + 1}));  // exactly 2^24
  EXPECT_EQ(g.Finish(), kMaxGridCells);
}

TEST(TensorGridTest, ForEachGridCellVisitsTheIndexBoxInCellOrder) {
  const std::vector<int64_t> dims = {3, 4, 5};
  const int64_t lo[] = {1, 1, 2}, hi[] = {3, 3, 4};
  std::vector<int64_t> seen;
  ForEachGridCell(dims, lo, hi, [&](int64_t c) { seen.push_back(c); });
  std::vector<int64_t> want;
  for (int64_t a = 1; a < 3; ++a) {
    for (int64_t b = 1; b < 3; ++b) {
      for (int64_t c = 2; c < 4; ++c) want.push_back((a * 4 + b) * 5 + c);
    }
  }
  EXPECT_EQ(seen, want);
  const int64_t empty_hi[] = {3, 1, 4};
  seen.clear();
  ForEachGridCell(dims, lo, empty_hi, [&](int64_t c) { seen.push_back(c); });
  EXPECT_TRUE(seen.empty());
}

}  // namespace
}  // namespace wb::planner
