#include "transport/strided.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

// Reference: element-by-element byte positions.
std::vector<int64_t> Reference(int64_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                               int elem) {
  std::vector<int64_t> out;
  int64_t n = 1;
  for (auto d : shape) n *= d;
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, off = offset;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      off += (rem % shape[d]) * strides[d] * elem;
      rem /= shape[d];
    }
    for (int b = 0; b < elem; ++b) out.push_back(off + b);
  }
  return out;
}

std::vector<int64_t> Expand(const StridedLayout& l, int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  int64_t expect_logical = begin;
  l.ForEachPiece(begin, end, [&](int64_t off, int64_t logical, int64_t len) {
    EXPECT_EQ(logical, expect_logical);
    expect_logical += len;
    for (int64_t b = 0; b < len; ++b) out.push_back(off + b);
  });
  EXPECT_EQ(expect_logical, end);
  return out;
}

TEST(StridedLayoutTest, MatchesElementwiseReferenceOnRandomLayouts) {
  std::mt19937 rng(42);
  for (int iter = 0; iter < 300; ++iter) {
    int rank = rng() % 4;
    std::vector<int64_t> shape(rank), strides(rank);
    for (int d = 0; d < rank; ++d) shape[d] = 1 + rng() % 4;
    // Random mix of contiguous and padded strides.
    int64_t inner = 1;
    for (int d = rank - 1; d >= 0; --d) {
      strides[d] = inner + ((rng() % 3 == 0) ? rng() % 3 : 0);
      inner = strides[d] * shape[d];
    }
    if (rank > 1 && rng() % 4 == 0) std::swap(strides[0], strides[rank - 1]);  // transposed
    int elem = 1 << (rng() % 3);
    int64_t offset = rng() % 17;
    auto l = StridedLayout::Make(offset, shape, strides, elem);
    ASSERT_TRUE(l.ok()) << l.status();
    auto ref = Reference(offset, shape, strides, elem);
    ASSERT_EQ(l->total_bytes(), static_cast<int64_t>(ref.size()));
    EXPECT_EQ(Expand(*l, 0, l->total_bytes()), ref);
    if (!ref.empty()) {
      EXPECT_EQ(l->min_byte(), *std::min_element(ref.begin(), ref.end()));
      EXPECT_EQ(l->end_byte(), *std::max_element(ref.begin(), ref.end()) + 1);
      int64_t b = rng() % ref.size(), e = b + rng() % (ref.size() - b + 1);
      EXPECT_EQ(Expand(*l, b, e), std::vector<int64_t>(ref.begin() + b, ref.begin() + e));
    }
  }
}

TEST(StridedLayoutTest, ContiguousBecomesOneRun) {
  auto l = StridedLayout::Make(8, {4, 5, 6}, {30, 6, 1}, 2);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->num_runs(), 1);
  EXPECT_EQ(l->run_bytes(), 240);
  auto padded = StridedLayout::Make(0, {4, 6}, {8, 1}, 4);
  ASSERT_TRUE(padded.ok());
  EXPECT_EQ(padded->num_runs(), 4);
  EXPECT_EQ(padded->run_bytes(), 24);
  EXPECT_EQ(padded->RunOffset(3), 96);
}

TEST(StridedLayoutTest, RejectsMalformed) {
  EXPECT_FALSE(StridedLayout::Make(0, {2}, {1, 1}, 2).ok());
  EXPECT_FALSE(StridedLayout::Make(0, {-1}, {1}, 2).ok());
  EXPECT_FALSE(StridedLayout::Make(0, {2}, {-1}, 2).ok());
  EXPECT_FALSE(StridedLayout::Make(0, {2}, {1}, 0).ok());
  EXPECT_FALSE(StridedLayout::Make(-4, {2}, {1}, 2).ok());
  EXPECT_FALSE(StridedLayout::Make(0, {int64_t{1} << 62, 8}, {8, 1}, 4).ok());
}

TEST(ValidateOpTest, OutOfBoundsNamesOpAndRegion) {
  CopyOp op;
  op.shape = {4, 4};
  op.element_size = 4;
  op.src.strides = {4, 1};
  op.dst.strides = {8, 1};
  EXPECT_TRUE(ValidateOp(op, 0, 64, 112, "a", "b").ok());
  auto bad = ValidateOp(op, 7, 64, 100, "a", "rollout/0 buffer 1");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("op 7"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("rollout/0 buffer 1"), std::string::npos) << bad.status();
  // Zero-length ops are valid anywhere.
  op.shape = {0, 4};
  op.dst.offset_bytes = 1 << 30;
  EXPECT_TRUE(ValidateOp(op, 0, 0, 0, "a", "b").ok());
}

TEST(ForEachCopyPieceTest, CopiesTransposeCorrectly) {
  // src 3x5 row-major, dst 3x5 stored transposed (5x3 row-major), float.
  std::vector<float> src(15), dst(15, -1);
  for (int i = 0; i < 15; ++i) src[i] = i;
  CopyOp op;
  op.shape = {3, 5};
  op.element_size = 4;
  op.src.strides = {5, 1};
  op.dst.strides = {1, 3};
  auto l = ValidateOp(op, 0, 60, 60, "s", "d");
  ASSERT_TRUE(l.ok());
  ForEachCopyPiece(*l, 0, l->src.total_bytes(), [&](int64_t s, int64_t d, int64_t n) {
    std::memcpy(reinterpret_cast<char*>(dst.data()) + d, reinterpret_cast<char*>(src.data()) + s, n);
  });
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j) EXPECT_EQ(dst[j * 3 + i], src[i * 5 + j]);
}

}  // namespace
}  // namespace wb::transport
