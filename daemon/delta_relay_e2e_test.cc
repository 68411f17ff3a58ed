// Lossless deltas into boxes a rollout relays on (issue 17.2; docs/daemon.md "Deltas (design and
// status)"), with real daemons: trainers t0, t1 on n0, two rollout replicas r1, r2 on n1
// (WeightBridge). Every box crosses the nodes once, into one replica; the other gets it by a
// same-node relay. The ordering this relies on: such a relay reads its source only after n1's
// delta tail (executor.cc DeltaTail: every stream into the source decoded and checked, every
// refused one resent in full) - a sync commit runs it after the executor (exec_plan.h "Relays at
// commit"), otherwise the executor posts it in its bucket's after-deltas route once the tail is
// done ("Relays after the deltas") - so the slicer may send the relayed boxes as deltas (relays
// themselves go full, same-node). Shown here: every cross-node byte of versions 2-3 travels as a
// delta with relays at the commit and with relays in their buckets (sync, one-step-off, async),
// both replicas exact and verified; and when the relays' source no longer matches, its deltas are
// refused and resent in full, and the relayed replica still gets exact bytes (a relay that read
// before the full resend would have copied undecoded bytes).
#include "daemon/delta_e2e_util.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr double kChange = 0.05;

// a [128, 256] f32, b [64, 128] bf16.
planner::Inventory RelayInventory() {
  planner::Inventory inv;
  inv.tensors.push_back({"a", {128, 256}, planner::DType::kF32});
  inv.tensors.push_back({"b", {64, 128}, planner::DType::kBF16});
  return inv;
}
constexpr double kModelBytes = 128 * 256 * 4 + 64 * 128 * 2;


class DeltaRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    endpoint_ = std::move(*endpoint);
  }

  // `whole`: 1 MiB buckets and one trainer per tensor, so the planner's fragments (its
  // load-balancing grain, at most a quarter of a bucket) are whole tensors: each crosses the nodes
  // into one replica's piece and is relayed whole into the other's, which a sync commit does.
  // Else 16 KiB buckets and tensor a split over both trainers: 4 KiB fragments, alternating
  // between the replicas, each relaying to the other in its buckets (after the delta tail).
  // `across`: r2 on a third node n2 instead of next to r1 (relays across nodes).
  // `in_place` false: sync rollouts' deltas decode against their live weights (as when a node has
  // no staging of the last commit to take back), so a byte changed there behind the node is a base
  // mismatch.
  void Start(pb::Mode mode, bool whole, bool across = false, bool in_place = true) {
    mode_ = mode;
    c_.delta_fraction = kChange;
    c_.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [whole](ServerOptions& o) { o.bucket_bytes = whole ? 1 << 20 : 16384; });
    for (int n = 0; n < (across ? 3 : 2); ++n) {
      c_.StartNode(n, nullptr, nullptr, [in_place](ServerOptions& o) {
        o.delta_cache_bytes = 64 << 20;
        o.delta_in_place = in_place;
      });
    }
    spec_ = SpecOf(inv_, mode, pb::STRATEGY_WEIGHTBRIDGE);
    if (whole) {
      t0_ = &c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {128, 256}, false}}));
      t1_ = &c_.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{1, {0, 0}, {64, 128}, false}}));
    } else {
      t0_ = &c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {64, 256}, false}, {1, {0, 0}, {64, 128}, false}}));
      t1_ = &c_.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {64, 0}, {128, 256}, false}}));
    }
    const std::vector<PieceDef> all = {{0, {0, 0}, {128, 256}, false}, {1, {0, 0}, {64, 128}, false}};
    r1_ = &c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, LayoutOf(inv_, all));
    r2_ = &c_.AddWorker("r2", pb::ROLE_ROLLOUT, across ? 2 : 1, &inv_, LayoutOf(inv_, all));
    for (TestWorker* w : {t0_, t1_, r1_, r2_}) ASSERT_TRUE(c_.Register(*w, spec_).ok()) << w->id;
  }
  void TearDown() override { c_.Stop(); }

  // Bytes n1 and n2 moved between them (relays across nodes; n1's count of its batches with n2).
  double RelayedBetweenN1AndN2() {
    auto m = ScrapeMetrics(endpoint_->port(), absl::Seconds(10));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? MetricSum(*m, "wb_bytes_total", "node=\"n1\",peer=\"n2\"") : 0;
  }

  double RelayedAtCommit() {
    auto m = ScrapeMetrics(endpoint_->port(), absl::Seconds(10));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? MetricSum(*m, "wb_relay_at_commit_bytes_total", "node=\"n1\"") : 0;
  }

  // Version v published (and applied outside sync), both replicas exact, the version verified end
  // to end.
  void Version(uint64_t v) {
    for (auto& s : c_.Publish("m", mode_, v, {t0_, t1_}, {r1_, r2_})) ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
    for (TestWorker* r : {r1_, r2_}) {
      if (mode_ != pb::MODE_SYNC) {
        pb::ApplyResponse resp;
        grpc::Status a = c_.Apply(*r, "m", v, &resp);
        ASSERT_TRUE(a.ok()) << r->id << " v" << v << ": " << a.error_message();
      }
      EXPECT_EQ(CountBadDelta(*r, v, kChange), 0) << r->id << " version " << v;
    }
    const pb::VersionStatus vs = FinalVersionStatus(c_, v);
    EXPECT_TRUE(vs.verified()) << "version " << v << ": " << vs.ShortDebugString();
  }

  planner::Inventory inv_ = RelayInventory();
  pb::ModelSpec spec_;
  pb::Mode mode_ = pb::MODE_SYNC;
  Cluster c_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  TestWorker *t0_ = nullptr, *t1_ = nullptr, *r1_ = nullptr, *r2_ = nullptr;
};

// Versions 2-3: every cross-node byte travels as a delta (the replaced bytes are the whole model
// per version, though one replica's boxes are all relayed on), streams < 1/4 of them, no refusal;
// the relays ran at the commit; both replicas exact and verified.
TEST_F(DeltaRelayTest, BoxesRelayedAtTheCommitTravelAsDeltas) {
  Start(pb::MODE_SYNC, /*whole=*/true);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m0 = ScrapeDeltaMeter(endpoint_->port());
  const double relayed0 = RelayedAtCommit();
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = ScrapeDeltaMeter(endpoint_->port());
  EXPECT_EQ(m1.stream - m0.stream, 0) << "version 1 has no base";
  EXPECT_GE(RelayedAtCommit() - relayed0, kModelBytes) << "the plan must relay one replica's copy at the commit";
  for (uint64_t v = 2; v <= 3; ++v) {
    Version(v);
    ASSERT_FALSE(HasFatalFailure());
  }
  const DeltaMeter m3 = ScrapeDeltaMeter(endpoint_->port());
  EXPECT_EQ(m3.fallbacks - m0.fallbacks, 0);
  EXPECT_EQ(m3.replaced - m1.replaced, 2 * kModelBytes) << "every cross-node op of versions 2-3, relayed boxes included, went as a delta";
  EXPECT_GT(m3.stream - m1.stream, 0);
  EXPECT_LT((m3.stream - m1.stream) * 4, m3.replaced - m1.replaced);
  EXPECT_GE(RelayedAtCommit() - relayed0, 3 * kModelBytes);
  EXPECT_GT(m3.decoded_in_place - m1.decoded_in_place, 0) << "sync: decoded into the staging the last commit held";
}

// The relays' source no longer matches what the sender diffed against: after version 1 a byte of
// each replica's live copy of tensor a changes behind n1's back (the live copies are the bases:
// --delta_in_place=false). Version 2's deltas into that box are refused and resent in full after
// the buckets; the relay at the commit copies the final bytes, so both replicas are exact and
// verified (and version 3 is deltas again, no refusal).
TEST_F(DeltaRelayTest, ARefusedDeltaIsResentBeforeTheRelayReadsIt) {
  Start(pb::MODE_SYNC, /*whole=*/true, /*across=*/false, /*in_place=*/false);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  for (TestWorker* r : {r1_, r2_}) static_cast<uint8_t*>(r->seg.data())[5] ^= 0x40;  // whichever replica receives it
  const DeltaMeter m0 = ScrapeDeltaMeter(endpoint_->port());
  Version(2);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = ScrapeDeltaMeter(endpoint_->port());
  EXPECT_GE(m1.fallbacks - m0.fallbacks, 1) << "the delta into the changed box must be refused";
  EXPECT_GT(m1.stream - m0.stream, 0) << "the other deltas still travel";
  Version(3);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(ScrapeDeltaMeter(endpoint_->port()).fallbacks - m1.fallbacks, 0);
}

class DeltaRelayModesTest : public DeltaRelayTest, public ::testing::WithParamInterface<pb::Mode> {};

// Relays in their buckets, both ways between the replicas (every piece filled partly by the
// nodes' link, partly by a relay): the relays wait for n1's delta tail (exec_plan.h "Relays after
// the deltas"), so every cross-node byte of versions 2-3 still travels as a delta; both replicas
// exact and verified, in every mode.
TEST_P(DeltaRelayModesTest, BoxesRelayedInTheirBucketsTravelAsDeltas) {
  Start(GetParam(), /*whole=*/false);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = ScrapeDeltaMeter(endpoint_->port());
  for (uint64_t v = 2; v <= 3; ++v) {
    Version(v);
    ASSERT_FALSE(HasFatalFailure());
  }
  const DeltaMeter m3 = ScrapeDeltaMeter(endpoint_->port());
  EXPECT_EQ(m3.fallbacks - m1.fallbacks, 0);
  EXPECT_EQ(m3.replaced - m1.replaced, 2 * kModelBytes) << "every cross-node op of versions 2-3, relayed boxes included, went as a delta";
  EXPECT_GT(m3.stream - m1.stream, 0);
  EXPECT_LT((m3.stream - m1.stream) * 4, m3.replaced - m1.replaced);
}

// Sync, relays in their buckets (pieces filled partly by relays are not left to the commit): a
// byte of both replicas' live copies - the bases (--delta_in_place=false) - changes behind n1's back; the refused delta is
// resent in full after the buckets and only then relayed: both replicas exact and verified.
TEST_F(DeltaRelayTest, ARefusedDeltaIsResentBeforeARelayInItsBucketReadsIt) {
  Start(pb::MODE_SYNC, /*whole=*/false, /*across=*/false, /*in_place=*/false);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  for (TestWorker* r : {r1_, r2_}) static_cast<uint8_t*>(r->seg.data())[5] ^= 0x40;
  const DeltaMeter m0 = ScrapeDeltaMeter(endpoint_->port());
  Version(2);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = ScrapeDeltaMeter(endpoint_->port());
  EXPECT_GE(m1.fallbacks - m0.fallbacks, 1) << "the delta into the changed box must be refused";
  EXPECT_GT(m1.stream - m0.stream, 0);
  Version(3);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(ScrapeDeltaMeter(endpoint_->port()).fallbacks - m1.fallbacks, 0);
}

// r1 on n1, r2 on n2: n0's trainers send each fragment to one of them (its egress bounds the
// version) and that rollout relays it across to the other, in its channel's after-deltas batch on
// both nodes (TransferOp.after_deltas) once the relaying node's delta tail is done. Versions 2-3:
// n0 sends every fragment once to one rollout node (two models' bytes per version) less what
// n1 and n2 relay to each other, and all of it as deltas - the relayed boxes included: the
// replaced bytes are exactly that (relays that kept their boxes full would make them smaller);
// both rollouts exact and verified.
TEST_P(DeltaRelayModesTest, BoxesRelayedAcrossNodesTravelAsDeltas) {
  Start(GetParam(), /*whole=*/false, /*across=*/true);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = ScrapeDeltaMeter(endpoint_->port());
  const double relayed1 = RelayedBetweenN1AndN2();
  for (uint64_t v = 2; v <= 3; ++v) {
    Version(v);
    ASSERT_FALSE(HasFatalFailure());
  }
  const DeltaMeter m3 = ScrapeDeltaMeter(endpoint_->port());
  const double relayed = RelayedBetweenN1AndN2() - relayed1;
  EXPECT_GT(relayed, 0) << "the plan must relay across nodes";
  EXPECT_EQ(m3.fallbacks - m1.fallbacks, 0);
  EXPECT_EQ(m3.replaced - m1.replaced, 2 * 2 * kModelBytes - relayed) << "every byte n0 sent went as a delta, relayed boxes included";
  EXPECT_LT((m3.stream - m1.stream) * 4, m3.replaced - m1.replaced);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeltaRelayModesTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

}  // namespace
}  // namespace wb::daemon
