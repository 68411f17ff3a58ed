#include "daemon/digest/certify.h"

#include <cstring>
#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "planner/box.h"

namespace wb::digest {
namespace {

using daemon::node::CertifyBox;
using daemon::node::Slice;

// Tensor 0: [4, 6] bf16. Source s0 (node n0) holds it transposed at offset 64 of its buffer; source
// s1 lives on node n1; late rollout l0 (node n0). Element (r, c) = bytes {r, c}.
struct Fixture {
  planner::Inventory inv;
  Slice slice;
  std::vector<uint8_t> s0 = std::vector<uint8_t>(64 + 48);
  Fixture() {
    inv.tensors.push_back({"model.embed_tokens.weight", {4, 6}, planner::DType::kBF16});
    slice.inventory = &inv;
    slice.workers = {{"s0", "n0", planner::Role::kTrainer}, {"s1", "n1", planner::Role::kTrainer}, {"l0", "n0", planner::Role::kRollout}};
    const planner::Box whole{{0, 0}, {4, 6}};
    slice.layouts.resize(3);
    slice.layouts[0].pieces.push_back({0, whole, 0, 64, {1, 4}, std::nullopt});
    slice.layouts[1].pieces.push_back({0, whole, 0, 0, {6, 1}, std::nullopt});
    slice.layouts[2].pieces.push_back({0, whole, 0, 0, {6, 1}, std::nullopt});
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 6; ++c) {
        const uint8_t v[2] = {static_cast<uint8_t>(r), static_cast<uint8_t>(c)};
        std::memcpy(s0.data() + 64 + (c * 4 + r) * 2, v, 2);
      }
    }
  }
  // The digest of rows [r0, r1) of the tensor in canonical (row-major) order, as the version's
  // landed digest of such a box was computed on whatever layout it landed in.
  static Digest Rows(int r0, int r1) {
    std::vector<uint8_t> canonical;
    for (int r = r0; r < r1; ++r) {
      for (int c = 0; c < 6; ++c) {
        canonical.push_back(static_cast<uint8_t>(r));
        canonical.push_back(static_cast<uint8_t>(c));
      }
    }
    auto d = BoxDigest({canonical.data(), {r1 - r0, 6}, {6, 1}, 2});
    EXPECT_TRUE(d.ok());
    return *d;
  }
  std::map<std::string, RegionBytes> Regions() const { return {{"w0.b0", {s0.data(), static_cast<int64_t>(s0.size())}}}; }
};

TEST(CertifySourcesTest, LocalBoxesMatchingTheVersionPassAndRemoteOnesAreLeftToTheirNode) {
  Fixture f;
  f.slice.certify.push_back({0, 0, 0, planner::Box{{0, 0}, {2, 6}}, Fixture::Rows(0, 2), 7, false});
  f.slice.certify.push_back({0, 0, 0, planner::Box{{2, 0}, {4, 6}}, Fixture::Rows(2, 4), 8, false});
  f.slice.certify.push_back({1, 0, 0, planner::Box{{0, 0}, {4, 6}}, 12345, 9, false});  // s1 is n1's to check
  auto out = CertifySources(f.slice, "n0", f.Regions(), 2, absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->boxes, 2);
  EXPECT_EQ(out->bytes, 48);
  EXPECT_EQ(out->skipped, 0);
  EXPECT_TRUE(out->stale.empty());
  EXPECT_TRUE(out->first_mismatch.empty());
}

TEST(CertifySourcesTest, ASourceWrittenSinceTheVersionLandedIsRefusedNamingTheBox) {
  Fixture f;
  f.slice.certify.push_back({0, 0, 0, planner::Box{{0, 0}, {2, 6}}, Fixture::Rows(0, 2), 7, false});
  f.slice.certify.push_back({0, 0, 0, planner::Box{{2, 0}, {4, 6}}, Fixture::Rows(2, 4), 8, true});
  f.s0[64 + (5 * 4 + 3) * 2] ^= 0x04;  // element (3, 5): the second box
  auto out = CertifySources(f.slice, "n0", f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->stale, std::vector<std::string>{"s0"});
  EXPECT_EQ(out->boxes, 1);  // the first box still matches
  const std::string m = out->first_mismatch;
  EXPECT_NE(m.find("source rollout s0 on node n0 no longer holds the version"), std::string::npos) << m;
  EXPECT_NE(m.find("box [2:4, 0:6]"), std::string::npos) << m;
  EXPECT_NE(m.find("model.embed_tokens.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("an earlier catch-up landed there (its op 8)"), std::string::npos) << m;
}

TEST(CertifySourcesTest, DeviceMemoryIsSkippedAndBadEntriesAreRefused) {
  Fixture f;
  f.slice.certify.push_back({0, 0, 0, planner::Box{{0, 0}, {2, 6}}, 1, 7, false});
  auto skipped = CertifySources(f.slice, "n0", {{"w0.b0", {nullptr, 112}}}, 1, absl::InfiniteFuture());
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->skipped, 1);
  EXPECT_EQ(skipped->boxes, 0);
  const std::vector<CertifyBox> bad = {
      {5, 0, 0, planner::Box{{0, 0}, {2, 6}}, 1, 0, false},   // no such worker
      {0, 3, 0, planner::Box{{0, 0}, {2, 6}}, 1, 0, false},   // no such piece
      {0, 0, 1, planner::Box{{0, 0}, {2, 6}}, 1, 0, false},   // another tensor
      {0, 0, 0, planner::Box{{0, 0}, {5, 6}}, 1, 0, false},   // outside the piece
      {0, 0, 0, planner::Box{{0}, {2}}, 1, 0, false},         // wrong rank
  };
  for (const CertifyBox& c : bad) {
    f.slice.certify = {c};
    auto out = CertifySources(f.slice, "n0", f.Regions(), 1, absl::InfiniteFuture());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << planner::BoxToString(c.box) << ": " << out.status();
  }
}

// A quantised source piece (fp8 elements, float32 scales of 2x3 blocks) of a [4, 6] tensor: a
// sender-quantised landing's digest covers the box's elements and the scales of its blocks
// (QuantizedDigest of the two), read from the worker's own layout. Computed here independently of
// the daemon's geometry: rows [2, 4) are elements 12..23 of buffer 0 and scales 2..3 of buffer 1.
TEST(CertifySourcesTest, AQuantisedSourceIsCheckedOverItsElementsAndTheScalesOfItsBlocks) {
  planner::Inventory inv;
  inv.tensors.push_back({"model.layers.0.mlp.down_proj.weight", {4, 6}, planner::DType::kBF16});
  Slice slice;
  slice.inventory = &inv;
  slice.workers = {{"s0", "n0", planner::Role::kTrainer}, {"l0", "n1", planner::Role::kRollout}};
  planner::Piece q{0, planner::Box{{0, 0}, {4, 6}}, 0, 0, {6, 1}, std::nullopt};
  q.quant = planner::Quantization{planner::DType::kF8E4M3, {2, 3}, 1, 0, planner::DType::kF32, -1};
  slice.live_layouts.resize(2);
  slice.live_layouts[0].pieces.push_back(q);
  // The staging layout addresses a shadow there (unquantised, past the buffer's end).
  slice.layouts.resize(2);
  slice.layouts[0].pieces.push_back({0, planner::Box{{0, 0}, {4, 6}}, 0, 64, {6, 1}, std::nullopt});
  std::vector<uint8_t> elements(24 + 48);
  std::vector<float> scales = {0.5f, 1.5f, 2.5f, 3.5f};
  for (size_t i = 0; i < 24; ++i) elements[i] = static_cast<uint8_t>(3 * i + 1);
  auto expected = [&](size_t first_el, size_t first_sc) {
    auto e = BoxDigest({elements.data() + first_el, {2, 6}, {6, 1}, 1});
    auto c = BoxDigest({reinterpret_cast<const uint8_t*>(scales.data() + first_sc), {1, 2}, {2, 1}, 4});
    EXPECT_TRUE(e.ok() && c.ok());
    return QuantizedDigest(*e, *c);
  };
  const Digest rows_2_4 = expected(12, 2);
  auto regions = [&] {
    return std::map<std::string, RegionBytes>{{"w0.b0", {elements.data(), static_cast<int64_t>(elements.size())}},
                                              {"w0.b1", {reinterpret_cast<const uint8_t*>(scales.data()), 16}}};
  };
  slice.certify.push_back({0, 0, 0, planner::Box{{2, 0}, {4, 6}}, rows_2_4, 3, false, true});
  auto out = CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->boxes, 1);
  EXPECT_EQ(out->bytes, 12 + 8);
  EXPECT_TRUE(out->stale.empty()) << out->first_mismatch;
  // A scale of those blocks changed in place (an engine re-quantising its scales after loading).
  scales[3] = 7.0f;
  out = CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->stale, std::vector<std::string>{"s0"});
  EXPECT_NE(out->first_mismatch.find("box [2:4, 0:6] of tensor model.layers.0.mlp.down_proj.weight (quantised elements and scales)"),
            std::string::npos)
      << out->first_mismatch;
  scales[3] = 3.5f;
  elements[20] ^= 0x01;  // an element of row 3
  out = CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->stale, std::vector<std::string>{"s0"});
  // Rows [0, 2) are untouched by either change.
  elements[20] ^= 0x01;
  elements[5] ^= 0x80;
  slice.certify = {{0, 0, 0, planner::Box{{2, 0}, {4, 6}}, rows_2_4, 3, false, true}};
  out = CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->stale.empty()) << out->first_mismatch;
  // Not whole blocks, or a canonical entry on the quantised piece: refused.
  for (const CertifyBox& c : std::vector<CertifyBox>{{0, 0, 0, planner::Box{{1, 0}, {3, 6}}, rows_2_4, 3, false, true}}) {
    slice.certify = {c};
    EXPECT_EQ(CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture()).status().code(), absl::StatusCode::kInvalidArgument);
  }
  // A format no sender quantises to (NVFP4: e2m1 elements) has no such digests.
  slice.live_layouts[0].pieces[0].quant->dtype = planner::DType::kF4E2M1;
  slice.live_layouts[0].pieces[0].quant->scale_dtype = planner::DType::kF8E4M3;
  slice.certify = {{0, 0, 0, planner::Box{{2, 0}, {4, 6}}, rows_2_4, 3, false, true}};
  EXPECT_EQ(CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture()).status().code(), absl::StatusCode::kInvalidArgument);
  slice.live_layouts[0].pieces[0].quant->dtype = planner::DType::kF8E4M3;
  slice.live_layouts[0].pieces[0].quant->scale_dtype = planner::DType::kF32;
  slice.live_layouts[0].pieces[0].box = planner::Box{{0, 0}, {4, 6}};
  slice.layouts[0] = slice.live_layouts[0];  // no separate staging layout: the quantised piece itself
  slice.certify = {{0, 0, 0, planner::Box{{2, 0}, {4, 6}}, rows_2_4, 3, false, false}};
  EXPECT_EQ(CertifySources(slice, "n0", regions(), 1, absl::InfiniteFuture()).status().code(), absl::StatusCode::kInvalidArgument);
  // Device memory (no host address): skipped, not failed.
  slice.certify = {{0, 0, 0, planner::Box{{2, 0}, {4, 6}}, rows_2_4, 3, false, true}};
  auto skipped = CertifySources(slice, "n0", {{"w0.b0", {nullptr, 72}}, {"w0.b1", {nullptr, 16}}}, 1, absl::InfiniteFuture());
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->skipped, 1);
}

}  // namespace
}  // namespace wb::digest
