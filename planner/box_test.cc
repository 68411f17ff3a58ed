#include "planner/box.h"

#include <random>

#include "gtest/gtest.h"

namespace wb::planner {
namespace {

TEST(Box, VolumeIntersectContains) {
  Box a{{0, 0}, {4, 6}};
  Box b{{2, 3}, {8, 5}};
  EXPECT_EQ(BoxVolume(a), 24);
  auto c = Intersect(a, b);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(BoxToString(*c), "[2:4, 3:5]");
  EXPECT_TRUE(BoxContains(a, *c));
  EXPECT_FALSE(BoxContains(*c, a));
  EXPECT_FALSE(Intersect(a, Box{{4, 0}, {5, 6}}).has_value());
  EXPECT_TRUE(BoxInside(a, {4, 6}));
  EXPECT_FALSE(BoxInside(b, {4, 6}));
}

// Every element of [lo, hi) is covered exactly once, nothing else, and there are few boxes.
TEST(Box, FlatRangeDecompositionIsExact) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 300; ++iter) {
    int rank = 1 + rng() % 4;
    std::vector<int64_t> shape;
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) {
      shape.push_back(1 + rng() % 5);
      n *= shape.back();
    }
    int64_t lo = rng() % (n + 1);
    int64_t hi = lo + rng() % (n - lo + 1);
    std::vector<Box> boxes = FlatRangeToBoxes(shape, lo, hi);
    EXPECT_LE(static_cast<int>(boxes.size()), 2 * rank - 1);
    std::vector<int> hits(n, 0);
    std::vector<int64_t> strides = ContiguousStrides(shape);
    for (const Box& b : boxes) {
      ASSERT_TRUE(BoxInside(b, shape));
      // Enumerate elements of b.
      std::vector<int64_t> c = b.begin;
      int64_t vol = BoxVolume(b);
      for (int64_t k = 0; k < vol; ++k) {
        int64_t flat = 0;
        for (int i = 0; i < rank; ++i) flat += c[i] * strides[i];
        hits[flat]++;
        for (int i = rank - 1; i >= 0; --i) {
          if (++c[i] < b.end[i]) break;
          c[i] = b.begin[i];
        }
      }
    }
    for (int64_t f = 0; f < n; ++f) EXPECT_EQ(hits[f], (f >= lo && f < hi) ? 1 : 0) << f;
  }
}

TEST(BoxTest, BoxesCover) {
  const std::vector<int64_t> shape{8, 6};
  EXPECT_TRUE(BoxesCover({FullBox(shape)}, shape));
  EXPECT_FALSE(BoxesCover({}, shape));
  // Two row halves (tp = 2) cover; one alone does not.
  const Box top{{0, 0}, {4, 6}}, bottom{{4, 0}, {8, 6}};
  EXPECT_TRUE(BoxesCover({top, bottom}, shape));
  EXPECT_FALSE(BoxesCover({bottom}, shape));
  // Overlapping boxes of two layouts (rows halves and column thirds with one third missing a
  // corner): the union decides, not the sum of volumes.
  const Box c0{{0, 0}, {8, 2}}, c1{{0, 2}, {8, 4}}, c2{{0, 4}, {7, 6}};
  EXPECT_FALSE(BoxesCover({c0, c1, c2}, shape));  // [7, 4:6] missing; volumes sum to 44 of 48
  EXPECT_TRUE(BoxesCover({c0, c1, c2, bottom}, shape));
  EXPECT_FALSE(BoxesCover({top, top, c0, c1, c2}, shape));  // volumes sum past 48, still a hole
  // Rank 3 (fused experts) and rank 1.
  const std::vector<int64_t> e{4, 3, 2};
  EXPECT_TRUE(BoxesCover({Box{{0, 0, 0}, {2, 3, 2}}, Box{{2, 0, 0}, {4, 3, 1}}, Box{{2, 0, 1}, {4, 3, 2}}}, e));
  EXPECT_FALSE(BoxesCover({Box{{0, 0, 0}, {2, 3, 2}}, Box{{2, 0, 0}, {4, 3, 1}}, Box{{2, 1, 1}, {4, 3, 2}}}, e));
  EXPECT_TRUE(BoxesCover({Box{{0}, {3}}, Box{{2}, {5}}}, {5}));
  EXPECT_FALSE(BoxesCover({Box{{0}, {2}}, Box{{3}, {5}}}, {5}));
  // A grid past the cap is not decided (false).
  EXPECT_FALSE(BoxesCover({top, bottom}, shape, 1));
  EXPECT_TRUE(BoxesCover({top, bottom}, shape, 2));
  EXPECT_FALSE(BoxesCover(std::vector<Box>(9, FullBox(shape)), shape, 2));  // 9 boxes of 2 cells: past 4 * 2 steps
  // A box of the wrong rank never covers.
  EXPECT_FALSE(BoxesCover({Box{{0}, {8}}}, shape));
}

}  // namespace
}  // namespace wb::planner
