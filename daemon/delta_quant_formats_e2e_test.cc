// Lossless deltas of sender-quantised bytes beyond fp8_block128 (issue 17.2 with 17.1;
// docs/daemon.md "Deltas (design and status)"), with real daemons (delta_quant_e2e_fixture.h):
// rollout r1 holds w as mxfp8 (float8_e4m3, 1x32 blocks, one float8_e8m0 scale byte per block) or
// as w4a16_g32 (int4 packed two per byte, 1x32 groups, bfloat16 scales), the formats the presets of
// those names make. Both are formats the sending node produces (planner/sender_quant.h
// SenderCanQuantize: e4m3 with e8m0 scales; int4 with an even group along the last dim), and the
// trainers' row shards hold whole 1x32 blocks, so n0 quantises every box. Version 1 goes in full,
// versions 2-3 as deltas of the quantised bytes (the elements slot with element size 1, the scales
// slot with the scale's size: 1 for e8m0, 2 for bf16), in sync / one-step-off / async and with two
// replicas relaying each other's blocks; every rollout byte equals the receiver's own quantisation
// of the canonical version, every version verified. A changed quantised base is refused and resent
// in full (with --delta_in_place=false: in place, the default, the base is the staging the node
// committed, and a changed live byte is overwritten by the commit).
#include <string>
#include <tuple>

#include "daemon/delta_quant_e2e_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

QuantFormat FormatNamed(const std::string& name) {
  if (name == "fp8_block128") return Fp8Block128Format();
  return name == "mxfp8" ? Mxfp8Format() : W4a16G32Format();
}

constexpr double kCanonicalBytes = kDeltaQuantRows * kDeltaQuantCols * 2;  // bf16 bytes of w per version
constexpr double kNormBytes = kDeltaQuantNorm * 2;

class DeltaQuantFormatTest : public DeltaQuantFixture, public ::testing::WithParamInterface<std::tuple<std::string, pb::Mode>> {};

// Versions 2-3: every block's quantised elements went as deltas (what the streams replaced is at
// least those and at most the quantised bytes of w and n, far below w's bf16 bytes), the streams
// under a quarter of what they replaced, no refusal.
TEST_P(DeltaQuantFormatTest, SenderQuantisedVersionsTravelAsDeltasOfTheQuantisedBytes) {
  Start(std::get<1>(GetParam()), /*replicas=*/1, FormatNamed(std::get<0>(GetParam())));
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m0 = Meter();
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_EQ(m1.stream - m0.stream, 0) << "version 1 has no base";
  Versions(2, 3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m3 = Meter();
  EXPECT_EQ(m3.fallbacks - m0.fallbacks, 0) << "no delta may be refused here";
  const double replaced = m3.replaced - m1.replaced, stream = m3.stream - m1.stream;
  EXPECT_GE(replaced, 2 * geo_.element_bytes) << "every block's quantised elements of versions 2-3 went as deltas";
  EXPECT_LE(replaced, 2 * (geo_.element_bytes + geo_.scale_bytes + kNormBytes))
      << "deltas of the quantised bytes, once each (w's bf16 bytes are " << kCanonicalBytes << " per version)";
  EXPECT_GT(stream, 0);
  EXPECT_LT(stream * 4, replaced) << "5% of bf16 elements changed: streams far below the quantised bytes";
}

INSTANTIATE_TEST_SUITE_P(
    FormatsAndModes, DeltaQuantFormatTest,
    ::testing::Combine(::testing::Values("mxfp8", "w4a16_g32"), ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, pb::Mode>>& i) {
      return std::get<0>(i.param) + "_" + pb::Mode_Name(std::get<1>(i.param));
    });

class DeltaQuantFormatCaseTest : public DeltaQuantFixture, public ::testing::WithParamInterface<std::string> {};

// Sync with --delta_in_place=false, so that the base of r1's deltas is its live weights (in place,
// the default, the base is the staging n1 kept and committed, which nothing else writes: see the
// next test): after version 1 one bit of r1's live quantised elements (row 0: e4m3 element 5, or
// the int4 pair 10-11) changes behind n1's back. Version 2's delta into that box fails the base
// check before anything is applied, the box is resent in full (quantised), r1 is exact and
// verified; the other boxes still go as deltas; version 3 goes as deltas with no refusal.
TEST_P(DeltaQuantFormatCaseTest, AQuantisedBaseThatDoesNotMatchIsRefusedAndTheFullBytesLand) {
  Start(pb::MODE_SYNC, /*replicas=*/1, FormatNamed(GetParam()), /*split_row=*/256, [](ServerOptions& o) { o.delta_in_place = false; });
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x01;
  const DeltaMeter m0 = Meter();
  Version(2);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_GE(m1.fallbacks - m0.fallbacks, 1) << "r1's node must refuse the delta made against another quantised base";
  EXPECT_GT(m1.stream - m0.stream, 0) << "the other boxes still travel as deltas";
  Version(3);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(Meter().fallbacks - m1.fallbacks, 0);
}

// Sync, in place (the default): the same bit of r1's live weights changes behind n1's back after
// version 1. The base of version 2's deltas is the staging n1 committed (decoded in place), so
// nothing is refused, and the commit's copy overwrites the changed byte: r1 exact and verified.
TEST_P(DeltaQuantFormatCaseTest, InPlaceALiveByteChangedBehindTheNodeIsOverwrittenByTheCommit) {
  Start(pb::MODE_SYNC, /*replicas=*/1, FormatNamed(GetParam()));
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x01;
  const DeltaMeter m0 = Meter();
  Version(2);  // checks every byte of r1
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0) << "the base is n1's committed staging, not r1's live weights";
  EXPECT_GT(m1.stream - m0.stream, 0);
  EXPECT_GT(m1.decoded_in_place - m0.decoded_in_place, 0);
}

// Two replicas on n1 (one-step-off): each block crosses the nodes once, quantised, into one
// replica, which relays its quantised elements and scales to the other after n1's delta tail.
// Versions 2-3: every block's elements crossed once as deltas, both replicas exact, verified.
TEST_P(DeltaQuantFormatCaseTest, QuantisedBlocksRelayedToASecondReplicaTravelAsDeltas) {
  Start(pb::MODE_ONE_STEP_OFF, /*replicas=*/2, FormatNamed(GetParam()));
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  Versions(2, 3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m3 = Meter();
  EXPECT_EQ(m3.fallbacks - m1.fallbacks, 0);
  const double replaced = m3.replaced - m1.replaced;
  EXPECT_GE(replaced, 2 * geo_.element_bytes) << "every block's quantised elements crossed as a delta";
  EXPECT_LE(replaced, 2 * (geo_.element_bytes + geo_.scale_bytes + 2 * kNormBytes)) << "once per version: the second replica gets them by relays";
  EXPECT_LT((m3.stream - m1.stream) * 4, replaced);
}

// fp8_block128 too (its mode tests are delta_quant_e2e_test's).
INSTANTIATE_TEST_SUITE_P(Formats, DeltaQuantFormatCaseTest, ::testing::Values("fp8_block128", "mxfp8", "w4a16_g32"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace wb::daemon
