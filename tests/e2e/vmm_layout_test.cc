#include "tests/e2e/vmm_layout.h"

#include "gtest/gtest.h"

namespace wb::e2e {
namespace {

planner::Inventory Inv() {
  planner::Inventory inv;
  inv.tensors.push_back({"a", {4, 8}, planner::DType::kBF16});
  inv.tensors.push_back({"b", {4, 8}, planner::DType::kF32});
  return inv;
}

planner::Piece Rows(int32_t tensor, int64_t r0, int64_t r1, int64_t offset) {
  planner::Piece p;
  p.tensor = tensor;
  p.box = {{r0, 0}, {r1, 8}};
  p.offset_bytes = offset;
  p.strides = {8, 1};
  return p;
}

TEST(VmmLayoutTest, CutsBetweenPiecesAndKeepsEveryPieceWhole) {
  // a (64 B bf16) at 0, b rows 0..2 (64 B f32) at 64, b rows 2..4 at 128: 192 bytes.
  planner::WorkerLayout l;
  l.buffers = {{192}};
  l.pieces = {Rows(0, 0, 4, 0), Rows(1, 0, 2, 64), Rows(1, 2, 4, 128)};
  auto v = SpreadOverVmmBuffers(Inv(), l, 3, 4096);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->layout.buffers.size(), 3u);
  EXPECT_EQ(v->offsets, (std::vector<int64_t>{4096, 64 + 2 * 4096, 128 + 3 * 4096}));
  EXPECT_EQ(v->bytes, 192 + 3 * 4096);
  for (size_t j = 0; j < 3; ++j) {
    EXPECT_EQ(v->layout.pieces[j].buffer, static_cast<int32_t>(j));
    EXPECT_EQ(v->layout.pieces[j].offset_bytes, 0);
    EXPECT_EQ(v->layout.buffers[j].size_bytes, 64);
  }
}

TEST(VmmLayoutTest, InterleavedPiecesAreNeverSeparated) {
  // Two column halves of `a` interleaved row by row over [0, 64), then `b` at 64.
  planner::WorkerLayout l;
  l.buffers = {{192}};
  planner::Piece left = Rows(0, 0, 4, 0), right = Rows(0, 0, 4, 8);
  left.box = {{0, 0}, {4, 4}};
  right.box = {{0, 4}, {4, 8}};
  l.pieces = {left, right, Rows(1, 0, 4, 64)};
  auto v = SpreadOverVmmBuffers(Inv(), l, 4, 0);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->layout.buffers.size(), 2u) << "one cut point only: before b";
  EXPECT_EQ(v->layout.pieces[0].buffer, 0);
  EXPECT_EQ(v->layout.pieces[1].buffer, 0);
  EXPECT_EQ(v->layout.pieces[1].offset_bytes, 8);
  EXPECT_EQ(v->layout.pieces[2].buffer, 1);
  EXPECT_EQ(v->layout.pieces[2].offset_bytes, 0);
  EXPECT_EQ(v->layout.buffers[1].size_bytes, 128);
}

TEST(VmmLayoutTest, OneBufferJustMovesItAndBadInputIsRefused) {
  planner::WorkerLayout l;
  l.buffers = {{192}};
  l.pieces = {Rows(0, 0, 4, 0)};
  auto v = SpreadOverVmmBuffers(Inv(), l, 1, 512);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->offsets, std::vector<int64_t>{512});
  EXPECT_EQ(v->layout.buffers[0].size_bytes, 192);
  EXPECT_FALSE(SpreadOverVmmBuffers(Inv(), l, 0, 0).ok());
  l.pieces[0].quant = planner::Quantization{};
  EXPECT_FALSE(SpreadOverVmmBuffers(Inv(), l, 2, 0).ok()) << "quantised pieces are not cut";
  l.buffers.push_back({8});
  EXPECT_FALSE(SpreadOverVmmBuffers(Inv(), l, 1, 0).ok());
}

}  // namespace
}  // namespace wb::e2e
