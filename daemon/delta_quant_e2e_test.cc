// Lossless deltas of quantised targets (issue 17.2; docs/daemon.md "Deltas (design and status)"),
// with real daemons: trainers t0, t1 on n0 publish bf16 versions in which 5% of the elements
// change; rollout r1 on n1 holds tensor w as fp8_block128 (float8_e4m3, 128x128 blocks, float32
// scales) and tensor n unquantised. The coordinator plans sender-side quantisation (host trainers,
// shards of whole blocks): n0 quantises each box and sends its fp8 elements and scales. With
// --delta_cache_bytes, version 1 goes in full and later versions as deltas OF THE QUANTISED BYTES
// (n0 caches the quantised bytes it sent, apart from canonical ones; r1's node decodes against its
// committed quantised copy: the staging it committed, taken back and decoded in place). Every byte of r1 is
// compared with the receiver's own quantisation of the canonical version (daemon/quantize.h
// QuantizePiece, what the full path lands), and every version is verified by the end-to-end
// digests. (A quantised base that no longer matches, refused and resent in full, and two replicas
// relaying each other's blocks: delta_quant_formats_e2e_test.cc, with every format.)
#include "daemon/delta_quant_e2e_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr double kQuantBytes = kDeltaQuantRows * kDeltaQuantCols;          // fp8 elements of w per version
constexpr double kCanonicalBytes = kDeltaQuantRows * kDeltaQuantCols * 2;  // bf16 bytes of w per version

// The cluster, the fp8_block128 layout (w's fp8 elements, its 4x2 float32 scales, then n) and the
// exact check: daemon/delta_quant_e2e_fixture.h (shared with delta_quant_formats_e2e_test).
class DeltaQuantE2eTest : public DeltaQuantFixture {};

class DeltaQuantTest : public DeltaQuantE2eTest, public ::testing::WithParamInterface<pb::Mode> {};

// Version 1 in full (quantised on n0), versions 2-3 as deltas of the quantised bytes: r1 exact,
// verified; what the streams replaced is the fp8 elements (not the bf16 bytes), and they are
// under a quarter of it; no refusal.
TEST_P(DeltaQuantTest, SenderQuantisedVersionsTravelAsDeltasOfTheQuantisedBytes) {
  Start(GetParam());
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
  EXPECT_GE(replaced, 2 * kQuantBytes) << "every block's fp8 elements of versions 2-3 went as deltas";
  EXPECT_LT(replaced, 2 * kCanonicalBytes) << "deltas of the quantised bytes, not of the bf16 ones";
  EXPECT_GT(stream, 0);
  EXPECT_LT(stream * 4, replaced) << "5% of bf16 elements changed: streams far below the fp8 bytes";
}

INSTANTIATE_TEST_SUITE_P(Modes, DeltaQuantTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

// The base-mismatch and relay cases for fp8_block128 run with the other formats'
// (delta_quant_formats_e2e_test.cc, DeltaQuantFormatCaseTest/fp8_block128).

}  // namespace
}  // namespace wb::daemon
