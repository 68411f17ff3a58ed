#include "tests/e2e/weights.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tools/cc/weight_gen.h"

namespace wb::e2e {
namespace {

planner::Inventory Inv() {
  planner::Inventory inv;
  inv.tensors.push_back({"a", {3, 5}, planner::DType::kBF16});
  inv.tensors.push_back({"b", {6}, planner::DType::kF32});
  return inv;
}

// a is stored transposed ([5, 3] locally) at offset 0; b's elements [2, 6) contiguous after it.
planner::WorkerLayout Layout() {
  planner::WorkerLayout l;
  l.buffers.push_back({64});
  planner::Piece a;
  a.tensor = 0;
  a.box = {{0, 0}, {3, 5}};
  a.offset_bytes = 0;
  a.strides = {1, 3};
  planner::Piece b;
  b.tensor = 1;
  b.box = {{2}, {6}};
  b.offset_bytes = 32;
  b.strides = {1};
  l.pieces = {a, b};
  return l;
}

TEST(WeightsTest, FillPlacesCanonicalElementsWhereStridesSay) {
  std::vector<char> mem(64, 0);
  MemoryView view{{mem.data()}, {64}};
  auto bytes = FillPieces(Inv(), Layout(), view, 7);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, 15 * 2 + 4 * 4);
  // Independent check: a[i][j] is at local [j][i] (2-byte elements), flat index i*5+j.
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 5; ++j) {
      EXPECT_TRUE(CheckWeight(0, 7, i * 5 + j, 2, mem.data() + (j * 3 + i) * 2)) << i << "," << j;
    }
  }
  for (int k = 2; k < 6; ++k) EXPECT_TRUE(CheckWeight(1, 7, k, 4, mem.data() + 32 + (k - 2) * 4));
}

TEST(WeightsTest, VerifyCatchesWrongVersionAndSingleByteFlips) {
  std::vector<char> mem(64, 0);
  MemoryView view{{mem.data()}, {64}};
  auto zero = VerifyPieces(Inv(), Layout(), view, 0);  // never written
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->mismatches, 0);
  ASSERT_TRUE(FillPieces(Inv(), Layout(), view, 4).ok());
  EXPECT_GT(VerifyPieces(Inv(), Layout(), view, 0)->mismatches, 15);
  auto ok = VerifyPieces(Inv(), Layout(), view, 4);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->mismatches, 0);
  EXPECT_EQ(ok->elements, 19);
  EXPECT_EQ(ok->bytes, 46);

  auto old = VerifyPieces(Inv(), Layout(), view, 3);
  ASSERT_TRUE(old.ok());
  EXPECT_GT(old->mismatches, 15);  // practically all 19 differ

  mem[32 + 4 * 2 + 1] ^= 0x10;  // b[4]
  auto flipped = VerifyPieces(Inv(), Layout(), view, 4);
  ASSERT_TRUE(flipped.ok());
  EXPECT_EQ(flipped->mismatches, 1);
  EXPECT_NE(flipped->first_mismatch.find("tensor b element [4]"), std::string::npos)
      << flipped->first_mismatch;
}

TEST(WeightsTest, PieceOutsideItsBufferIsRejectedBeforeWriting) {
  std::vector<char> mem(40, 0);
  MemoryView view{{mem.data()}, {40}};  // b's piece needs bytes [32, 48)
  auto r = FillPieces(Inv(), Layout(), view, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("tensor b"), absl::string_view::npos);
  for (char c : mem) EXPECT_EQ(c, 0);
}

}  // namespace
}  // namespace wb::e2e
