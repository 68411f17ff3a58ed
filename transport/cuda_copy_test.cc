// Canonical forms of strided boxes (pure; no GPU needed). The copies themselves are exercised by
// the cuda_ipc / nccl conformance tests on a GPU machine.
#include "transport/cuda_copy.h"

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(CanonicalizeTest, ContiguousFoldsIntoOneRow) {
  CanonicalBox b = Canonicalize({4, 5, 6}, {30, 6, 1}, {30, 6, 1}, 2);
  EXPECT_FALSE(b.empty);
  EXPECT_EQ(b.width, 4 * 5 * 6 * 2);
  EXPECT_TRUE(b.outer.empty());
  EXPECT_TRUE(SrcContiguous(b));
  EXPECT_TRUE(DstContiguous(b));
}

TEST(CanonicalizeTest, PaddedRowsStayTwoD) {
  // 300 x 200 bf16 box of a 1000-wide matrix -> dense.
  CanonicalBox b = Canonicalize({300, 200}, {1000, 1}, {200, 1}, 2);
  EXPECT_EQ(b.width, 400);
  ASSERT_EQ(b.outer.size(), 1u);
  EXPECT_EQ(b.outer[0].extent, 300);
  EXPECT_EQ(b.outer[0].src_stride, 2000);
  EXPECT_EQ(b.outer[0].dst_stride, 400);
  EXPECT_FALSE(SrcContiguous(b));
  EXPECT_TRUE(DstContiguous(b));
  EXPECT_EQ(b.bytes(), 300 * 200 * 2);
}

TEST(CanonicalizeTest, ThreeDAndMergesNestedDims) {
  CanonicalBox b = Canonicalize({7, 9, 33}, {9 * 40, 40, 1}, {10 * 33, 33, 1}, 4);
  EXPECT_EQ(b.width, 132);
  ASSERT_EQ(b.outer.size(), 2u);
  EXPECT_EQ(b.outer[0].extent, 7);
  EXPECT_EQ(b.outer[1].extent, 9);
  // Dims that nest exactly on both sides merge: [2][3][4] padded only at the row level.
  CanonicalBox m = Canonicalize({2, 3, 4}, {3 * 8, 8, 1}, {3 * 8, 8, 1}, 1);
  ASSERT_EQ(m.outer.size(), 1u);
  EXPECT_EQ(m.outer[0].extent, 6);
  EXPECT_EQ(m.outer[0].src_stride, 8);
  EXPECT_EQ(m.width, 4);
}

TEST(CanonicalizeTest, TransposeAndDegenerateDims) {
  CanonicalBox t = Canonicalize({64, 48}, {48, 1}, {1, 64}, 2);
  EXPECT_EQ(t.width, 2);
  ASSERT_EQ(t.outer.size(), 2u);
  CanonicalBox z = Canonicalize({0, 5}, {5, 1}, {5, 1}, 2);
  EXPECT_TRUE(z.empty);
  EXPECT_EQ(z.bytes(), 0);
  CanonicalBox ones = Canonicalize({1, 1, 7}, {100, 50, 1}, {3, 2, 1}, 8);
  EXPECT_TRUE(ones.outer.empty());
  EXPECT_EQ(ones.width, 56);
  CanonicalBox scalar = Canonicalize({}, {}, {}, 4);
  EXPECT_EQ(scalar.width, 4);
  EXPECT_EQ(scalar.bytes(), 4);
}

}  // namespace
}  // namespace wb::transport
