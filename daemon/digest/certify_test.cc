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

}  // namespace
}  // namespace wb::digest
