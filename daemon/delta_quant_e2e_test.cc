// Lossless deltas of quantised targets (issue 17.2; docs/daemon.md "Deltas (design and status)"),
// with real daemons: trainers t0, t1 on n0 publish bf16 versions in which 5% of the elements
// change; rollout r1 on n1 holds tensor w as fp8_block128 (float8_e4m3, 128x128 blocks, float32
// scales) and tensor n unquantised. The coordinator plans sender-side quantisation (host trainers,
// shards of whole blocks): n0 quantises each box and sends its fp8 elements and scales. With
// --delta_cache_bytes, version 1 goes in full and later versions as deltas OF THE QUANTISED BYTES
// (n0 caches the quantised bytes it sent, apart from canonical ones; r1's node decodes against its
// committed quantised copy: committed staging, or its live buffers in sync). Every byte of r1 is
// compared with the receiver's own quantisation of the canonical version (daemon/quantize.h
// QuantizePiece, what the full path lands), and every version is verified by the end-to-end
// digests. Also: a quantised base that no longer matches is refused and resent in full.
#include <cstring>
#include <vector>

#include "daemon/delta_e2e_util.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/multinode_fixture.h"
#include "daemon/quantize.h"
#include "gtest/gtest.h"
#include "tests/common/weight_gen.h"

namespace wb::daemon {
namespace {

constexpr double kChange = 0.05;
constexpr int64_t kRows = 512, kCols = 256, kNorm = 256;
// r1's buffer: w's fp8 elements (row-major), its 4x2 float32 scales, then n (bf16).
constexpr int64_t kScalesAt = kRows * kCols;           // 131072
constexpr int64_t kScalesBytes = (kRows / 128) * (kCols / 128) * 4;
constexpr int64_t kNormAt = kScalesAt + 64;            // 131136
constexpr int64_t kRolloutBytes = kNormAt + kNorm * 2;  // 131648
constexpr double kQuantBytes = kRows * kCols;           // fp8 elements of w per version
constexpr double kCanonicalBytes = kRows * kCols * 2;   // bf16 bytes of w per version

planner::Inventory QuantInventory() {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {kRows, kCols}, planner::DType::kBF16});
  inv.tensors.push_back({"n", {1, kNorm}, planner::DType::kBF16});  // 2-D: LayoutOf takes rows and columns
  return inv;
}

pb::ModelSpec QuantSpec(const planner::Inventory& inv, pb::Mode mode, int rollouts) {
  pb::ModelSpec spec;
  spec.set_model_id("m");
  for (const planner::TensorSpec& t : inv.tensors) {
    pb::TensorSpec* ts = spec.mutable_explicit_tensors()->add_tensors();
    ts->set_name(t.name);
    ts->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    ts->set_dtype(pb::DTYPE_BF16);
  }
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(rollouts);
  spec.set_mode(mode);
  spec.set_strategy(pb::STRATEGY_WEIGHTBRIDGE);
  return spec;
}

planner::WorkerLayout QuantRolloutLayout() {
  planner::WorkerLayout l;
  l.buffers.push_back({kRolloutBytes});
  planner::Piece w;
  w.tensor = 0;
  w.box = {{0, 0}, {kRows, kCols}};
  w.offset_bytes = 0;
  w.strides = {kCols, 1};
  planner::Quantization q;
  q.dtype = planner::DType::kF8E4M3;
  q.block = {128, 128};
  q.scale_buffer = 0;
  q.scale_offset_bytes = kScalesAt;
  q.scale_dtype = planner::DType::kF32;
  w.quant = q;
  l.pieces.push_back(w);
  planner::Piece n;
  n.tensor = 1;
  n.box = {{0, 0}, {1, kNorm}};
  n.offset_bytes = kNormAt;
  n.strides = {kNorm, 1};
  l.pieces.push_back(n);
  return l;
}

// What r1's buffer holds once version v is applied, by the receiver's own quantiser (the full
// path's bytes): w quantised from its canonical bf16 version, n as is.
std::vector<uint8_t> Expected(const planner::Inventory& inv, const planner::WorkerLayout& layout, uint64_t v) {
  std::vector<uint8_t> out(static_cast<size_t>(kRolloutBytes), 0);
  std::vector<uint8_t> shadow(static_cast<size_t>(kRows * kCols * 2));
  for (int64_t i = 0; i < kRows * kCols; ++i) WriteDeltaWeight(0, v, static_cast<uint64_t>(i), 2, kChange, shadow.data() + 2 * i);
  const absl::Status s = QuantizePiece(inv, layout.pieces[0], shadow.data(), out.data(), out.data());
  EXPECT_TRUE(s.ok()) << s;
  for (int64_t i = 0; i < kNorm; ++i) WriteDeltaWeight(1, v, static_cast<uint64_t>(i), 2, kChange, out.data() + kNormAt + 2 * i);
  return out;
}

// Bytes of r1 (elements, scales, n) that differ from `expected`.
int64_t CountBadQuant(const TestWorker& r, const std::vector<uint8_t>& expected) {
  const uint8_t* got = static_cast<const uint8_t*>(r.seg.data());
  int64_t bad = 0;
  for (auto [at, n] : {std::pair<int64_t, int64_t>{0, kScalesAt + kScalesBytes}, {kNormAt, kNorm * 2}}) {
    for (int64_t i = at; i < at + n; ++i) bad += got[i] != expected[static_cast<size_t>(i)];
  }
  return bad;
}

class DeltaQuantE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    endpoint_ = std::move(*endpoint);
  }
  void TearDown() override { c_.Stop(); }

  // 64 KiB buckets: sender-quantised plans budget a bucket's staging at most that, so the
  // fragments are single 128x128 blocks spread over several buckets (the delta encodes of later
  // buckets wait for their bytes to be quantised).
  // `replicas` 2: r2 next to r1 (n1), same layout; each block crosses once and is relayed.
  void Start(pb::Mode mode, int replicas = 1) {
    mode_ = mode;
    c_.delta_fraction = kChange;
    c_.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) { o.bucket_bytes = 65536; });
    for (int n : {0, 1}) c_.StartNode(n, nullptr, nullptr, [](ServerOptions& o) { o.delta_cache_bytes = 64 << 20; });
    spec_ = QuantSpec(inv_, mode, replicas);
    t0_ = &c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {256, kCols}, false}, {1, {0, 0}, {1, kNorm}, false}}));
    t1_ = &c_.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {256, 0}, {kRows, kCols}, false}}));
    rollouts_ = {&c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, layout_)};
    if (replicas == 2) rollouts_.push_back(&c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, layout_));
    r1_ = rollouts_[0];
    for (TestWorker* w : {t0_, t1_}) ASSERT_TRUE(c_.Register(*w, spec_).ok()) << w->id;
    for (TestWorker* w : rollouts_) ASSERT_TRUE(c_.Register(*w, spec_).ok()) << w->id;
  }

  // Version v published (and applied outside sync), r1 byte-exact against the receiver's
  // quantisation, the version verified end to end.
  void Version(uint64_t v) {
    for (auto& s : c_.Publish("m", mode_, v, {t0_, t1_}, rollouts_)) ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
    const std::vector<uint8_t> expected = Expected(inv_, layout_, v);
    for (TestWorker* r : rollouts_) {
      if (mode_ != pb::MODE_SYNC) {
        pb::ApplyResponse resp;
        grpc::Status a = c_.Apply(*r, "m", v, &resp);
        ASSERT_TRUE(a.ok()) << r->id << " v" << v << ": " << a.error_message();
      }
      EXPECT_EQ(CountBadQuant(*r, expected), 0) << r->id << " version " << v;
    }
    const pb::VersionStatus vs = FinalVersionStatus(c_, v);
    EXPECT_TRUE(vs.verified()) << "version " << v << ": " << vs.ShortDebugString();
  }

  DeltaMeter Meter() { return ScrapeDeltaMeter(endpoint_->port()); }

  planner::Inventory inv_ = QuantInventory();
  planner::WorkerLayout layout_ = QuantRolloutLayout();
  pb::ModelSpec spec_;
  pb::Mode mode_ = pb::MODE_SYNC;
  Cluster c_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  TestWorker *t0_ = nullptr, *t1_ = nullptr, *r1_ = nullptr;
  std::vector<TestWorker*> rollouts_;
};

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
  for (uint64_t v = 2; v <= 3; ++v) {
    Version(v);
    ASSERT_FALSE(HasFatalFailure());
  }
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

// Sync: after version 1 a byte of r1's live fp8 elements (the block at rows 0-127, cols 0-127)
// changes behind n1's back. Version 2's delta into that block fails the base check before anything
// is applied, the block is resent in full (quantised), r1 is exact and verified; version 3 goes
// as deltas with no refusal.
TEST_F(DeltaQuantE2eTest, AQuantisedBaseThatDoesNotMatchIsRefusedAndTheFullBytesLand) {
  Start(pb::MODE_SYNC);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x01;
  const DeltaMeter m0 = Meter();
  Version(2);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_GE(m1.fallbacks - m0.fallbacks, 1) << "r1's node must refuse the delta made against another quantised base";
  EXPECT_GT(m1.stream - m0.stream, 0) << "the other blocks still travel as deltas";
  Version(3);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(Meter().fallbacks - m1.fallbacks, 0);
}

// Two fp8 replicas on n1 (one-step-off): each block crosses the nodes once, quantised, into one
// replica, which relays its fp8 elements and scales to the other in the bucket's after-deltas
// route (daemon/node/exec_plan.h), after n1's delta tail. Versions 2-3: every block's fp8 elements
// as deltas (the replaced bytes are one copy of them per version), both replicas exact, verified.
TEST_F(DeltaQuantE2eTest, QuantisedBlocksRelayedToASecondReplicaTravelAsDeltas) {
  Start(pb::MODE_ONE_STEP_OFF, /*replicas=*/2);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  for (uint64_t v = 2; v <= 3; ++v) {
    Version(v);
    ASSERT_FALSE(HasFatalFailure());
  }
  const DeltaMeter m3 = Meter();
  EXPECT_EQ(m3.fallbacks - m1.fallbacks, 0);
  const double replaced = m3.replaced - m1.replaced;
  EXPECT_GE(replaced, 2 * kQuantBytes) << "every block's fp8 elements crossed as a delta";
  EXPECT_LT(replaced, 2 * kQuantBytes + 2 * 2 * kNorm * 2 + 1) << "once per version: the second replica gets them by relays";
  EXPECT_LT((m3.stream - m1.stream) * 4, replaced);
}

}  // namespace
}  // namespace wb::daemon
