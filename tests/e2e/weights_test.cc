#include "tests/e2e/weights.h"

#include <cstring>
#include <vector>

#include "daemon/quantize.h"
#include "gtest/gtest.h"
#include "planner/quantized.h"
#include "planner/validate.h"
#include "tests/common/weight_gen.h"

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

// The test workers' reference quantisation agrees with the daemon's quantiser on real (finite)
// weights: fill a canonical shadow, quantise it with daemon/quantize, verify with weights.cc.
TEST(WeightsTest, QuantisedPieceMatchesTheDaemonsQuantiser) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {256, 200}, planner::DType::kBF16});
  inv.tensors.push_back({"h", {130, 64}, planner::DType::kF16});
  planner::WorkerLayout live;
  live.buffers.push_back({1 << 16});
  planner::Piece w;
  w.tensor = 0;
  w.box = {{128, 0}, {256, 200}};  // 128 x 200: blocks 1 x 2 (the second one partial)
  w.offset_bytes = 0;
  w.strides = {1, 128};  // transposed
  w.quant = planner::Quantization{planner::DType::kF8E4M3, {128, 128}, 0, 40000};
  planner::Piece h;
  h.tensor = 1;
  h.box = {{0, 0}, {130, 64}};
  h.offset_bytes = 26000;
  h.strides = {64, 1};
  h.quant = planner::Quantization{planner::DType::kF8E4M3, {64, 32}, 0, 40008};  // 3 x 2 blocks
  live.pieces = {w, h};
  ASSERT_TRUE(planner::ValidateLayout(inv, live, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, live, planner::Role::kRollout, "r");
  // Canonical shadows as the staging layout places them, filled with version 5.
  planner::WorkerLayout shadow = planner::StagingLayout(inv, live);
  std::vector<uint8_t> staging(static_cast<size_t>(shadow.buffers[0].size_bytes), 0);
  MemoryView sv{{staging.data()}, {shadow.buffers[0].size_bytes}};
  ASSERT_TRUE(FillPieces(inv, shadow, sv, 5).ok());
  for (size_t k = 0; k < live.pieces.size(); ++k) {
    ASSERT_TRUE(daemon::QuantizePiece(inv, live.pieces[k], staging.data() + shadow.pieces[k].offset_bytes, staging.data(), staging.data()).ok());
  }
  MemoryView lv{{staging.data()}, {live.buffers[0].size_bytes}};
  auto r = VerifyPieces(inv, live, lv, 5);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mismatches, 0) << r->first_mismatch;
  EXPECT_EQ(r->elements, 128 * 200 + 130 * 64);
  // The weights are finite numbers (no NaN code; blocks are not NaN-filled) and a good share of
  // them encode non-zero (their exponents are uniform, so the smallest flush to zero).
  int nonzero = 0, nan = 0;
  for (int64_t i = 0; i < 128 * 200; ++i) {
    nonzero += (staging[i] & 0x7f) != 0;
    nan += (staging[i] & 0x7f) == 0x7f;
  }
  EXPECT_EQ(nan, 0);
  EXPECT_GT(nonzero, 128 * 200 / 10);
  // Another version, a flipped element byte, a flipped scale byte: caught and named.
  EXPECT_GT(VerifyPieces(inv, live, lv, 4)->mismatches, 100);
  staging[17] ^= 0x01;
  auto e = VerifyPieces(inv, live, lv, 5);
  EXPECT_EQ(e->mismatches, 1);
  EXPECT_NE(e->first_mismatch.find("tensor w (quantised piece 0"), std::string::npos) << e->first_mismatch;
  staging[17] ^= 0x01;
  staging[40008 + 4 * 3 + 1] ^= 0x40;
  auto sc = VerifyPieces(inv, live, lv, 5);
  EXPECT_EQ(sc->mismatches, 1);  // the scale only: the elements are compared with the reference's own scales
  EXPECT_NE(sc->first_mismatch.find("scale of block 3"), std::string::npos) << sc->first_mismatch;
  // Fresh memory is version 0: all zero, scales included.
  std::vector<uint8_t> fresh(static_cast<size_t>(live.buffers[0].size_bytes), 0);
  MemoryView fv{{fresh.data()}, {live.buffers[0].size_bytes}};
  EXPECT_EQ(VerifyPieces(inv, live, fv, 0)->mismatches, 0);
  // Nothing fills a quantised piece.
  EXPECT_EQ(FillPieces(inv, live, fv, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WeightsTest, MxQuantisedPieceMatchesTheDaemonsQuantiser) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {64, 100}, planner::DType::kBF16});
  planner::WorkerLayout live;
  live.buffers.push_back({1 << 14});
  planner::Piece w;
  w.tensor = 0;
  w.box = {{0, 32}, {64, 100}};  // 64 x 68: blocks 1 x 32 -> 64 x 3 (the last 4 wide)
  w.offset_bytes = 0;
  w.strides = {68, 1};
  w.quant = planner::Quantization{planner::DType::kF8E4M3, {1, 32}, 0, 64 * 68 + 1, planner::DType::kE8M0};
  live.pieces = {w};
  ASSERT_TRUE(planner::ValidateLayout(inv, live, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, live, planner::Role::kRollout, "r");
  planner::WorkerLayout shadow = planner::StagingLayout(inv, live);
  std::vector<uint8_t> staging(static_cast<size_t>(shadow.buffers[0].size_bytes), 0);
  MemoryView sv{{staging.data()}, {shadow.buffers[0].size_bytes}};
  ASSERT_TRUE(FillPieces(inv, shadow, sv, 9).ok());
  ASSERT_TRUE(daemon::QuantizePiece(inv, w, staging.data() + shadow.pieces[0].offset_bytes, staging.data(), staging.data()).ok());
  MemoryView lv{{staging.data()}, {live.buffers[0].size_bytes}};
  auto r = VerifyPieces(inv, live, lv, 9);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mismatches, 0) << r->first_mismatch;
  EXPECT_EQ(r->elements, 64 * 68);
  // A flipped scale byte is named as such; a flipped element too.
  staging[64 * 68 + 1 + 5] ^= 0x01;
  auto sc = VerifyPieces(inv, live, lv, 9);
  EXPECT_EQ(sc->mismatches, 1);
  EXPECT_NE(sc->first_mismatch.find("e8m0 scale of block 5"), std::string::npos) << sc->first_mismatch;
  staging[64 * 68 + 1 + 5] ^= 0x01;
  staging[100] ^= 0x02;
  EXPECT_EQ(VerifyPieces(inv, live, lv, 9)->mismatches, 1);
  staging[100] ^= 0x02;
  // The same bytes read as float32-scaled are wrong: the scale dtype matters to the check.
  planner::WorkerLayout as_f32 = live;
  as_f32.pieces[0].quant->scale_dtype = planner::DType::kF32;
  as_f32.pieces[0].quant->scale_offset_bytes = 64 * 68 + 4;
  EXPECT_GT(VerifyPieces(inv, as_f32, lv, 9)->mismatches, 100);
}

TEST(WeightsTest, Int4PieceMatchesTheDaemonsQuantiser) {
  for (planner::DType sdt : {planner::DType::kBF16, planner::DType::kF16}) {
    planner::Inventory inv;
    inv.tensors.push_back({"w", {40, 128}, planner::DType::kBF16});
    planner::WorkerLayout live;
    live.buffers.push_back({1 << 14});
    planner::Piece w;
    w.tensor = 0;
    w.box = {{8, 32}, {40, 128}};  // 32 x 96: groups 1 x 32 -> 32 x 3
    w.offset_bytes = 2;
    w.strides = {100, 1};  // row pitch 50 bytes
    w.quant = planner::Quantization{planner::DType::kI4, {1, 32}, 0, 2 + 31 * 50 + 48 + 2, sdt};
    live.pieces = {w};
    ASSERT_TRUE(planner::ValidateLayout(inv, live, planner::Role::kRollout, "r").ok())
        << planner::ValidateLayout(inv, live, planner::Role::kRollout, "r");
    planner::WorkerLayout shadow = planner::StagingLayout(inv, live);
    std::vector<uint8_t> staging(static_cast<size_t>(shadow.buffers[0].size_bytes), 0);
    MemoryView sv{{staging.data()}, {shadow.buffers[0].size_bytes}};
    ASSERT_TRUE(FillPieces(inv, shadow, sv, 3).ok());
    ASSERT_TRUE(daemon::QuantizePiece(inv, w, staging.data() + shadow.pieces[0].offset_bytes, staging.data(), staging.data()).ok());
    MemoryView lv{{staging.data()}, {live.buffers[0].size_bytes}};
    auto r = VerifyPieces(inv, live, lv, 3);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->mismatches, 0) << r->first_mismatch;
    EXPECT_EQ(r->elements, 32 * 96);
    // Several nibble values occur (the generated weights have spread exponents, so most round to
    // 0), so a swapped nibble pair would show.
    int distinct = 0;
    std::vector<bool> seen(16, false);
    for (int64_t i = 0; i < 48; ++i) {
      for (int n : {staging[2 + i] & 0xf, staging[2 + i] >> 4}) {
        if (!seen[n]) ++distinct;
        seen[n] = true;
      }
    }
    EXPECT_GE(distinct, 5);
    // A high nibble flipped, a scale byte flipped: caught and named.
    staging[2 + 50 * 3 + 7] ^= 0x10;
    auto e = VerifyPieces(inv, live, lv, 3);
    EXPECT_EQ(e->mismatches, 1);
    EXPECT_NE(e->first_mismatch.find("element at local [3, 15]"), std::string::npos) << e->first_mismatch;
    staging[2 + 50 * 3 + 7] ^= 0x10;
    staging[w.quant->scale_offset_bytes + 2 * 4] ^= 0x01;
    auto sc = VerifyPieces(inv, live, lv, 3);
    EXPECT_EQ(sc->mismatches, 1);
    EXPECT_NE(sc->first_mismatch.find("scale of group 4"), std::string::npos) << sc->first_mismatch;
    staging[w.quant->scale_offset_bytes + 2 * 4] ^= 0x01;
    EXPECT_GT(VerifyPieces(inv, live, lv, 2)->mismatches, 100);
  }
}

}  // namespace
}  // namespace wb::e2e
