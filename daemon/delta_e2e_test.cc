// Lossless deltas with real daemons (issue 17.2; docs/daemon.md "Deltas (design and status)"): a
// coordinator and two node daemons in one process (--delta_cache_bytes set), workers on shared
// memory, bytes over host_shm (same node) and host_tcp (across nodes). Trainers publish versions in
// which 5% of the elements change (tests/common/weight_gen.h DeltaElementBits): the first version
// goes in full, later ones as deltas across nodes; every rollout byte is checked, every version is
// verified end to end (digests), and the delta counters show streams replacing full bytes. Also:
// a version superseded before it started, a rollout that restarts (full by catch-up, then deltas
// again), and a destination whose committed copy does not match (the base check refuses the delta,
// the op is resent in full, bytes exact).
#include <atomic>

#include "absl/synchronization/notification.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/delta_e2e_util.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr double kChange = 0.05;

// a [128, 256] f32, b [64, 128] bf16: boxes large enough that a delta is far smaller than them.
planner::Inventory DeltaInventory() {
  planner::Inventory inv;
  inv.tensors.push_back({"a", {128, 256}, planner::DType::kF32});
  inv.tensors.push_back({"b", {64, 128}, planner::DType::kBF16});
  return inv;
}


using Metered = DeltaMeter;

class DeltaE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    endpoint_ = std::move(*endpoint);
  }
  void TearDown() override {
    if (!release_.HasBeenNotified()) release_.Notify();  // a held executor must not outlive the test
    c_.Stop();
  }

  // Coordinator, n0 and n1 with a delta cache; `n0_hook` as n0's test_before_bucket. `in_place`
  // false (--delta_in_place=false): rollouts' deltas decode against their committed staging while
  // held, else against their live weights, never into staging taken back by its tag.
  void Start(Cluster::BucketHook n0_hook = nullptr, bool in_place = true) {
    c_.delta_fraction = kChange;
    c_.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) { o.bucket_bytes = 16384; });
    for (int n : {0, 1}) {
      c_.StartNode(n, n == 0 ? n0_hook : nullptr, nullptr, [in_place](ServerOptions& o) {
        o.delta_cache_bytes = 64 << 20;
        o.delta_in_place = in_place;
      });
    }
  }

  // t0 (n0): rows 0-63 of a and all of b; t1 (n1): rows 64-127 of a; r0 (n0) whole; r1 (n1)
  // whole, transposed (its boxes are strided: deltas decode into scratch and scatter).
  void AddWorkers(pb::Mode mode, pb::Strategy strategy) {
    spec_ = SpecOf(inv_, mode, strategy);
    t0_ = &c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {64, 256}, false}, {1, {0, 0}, {64, 128}, false}}));
    t1_ = &c_.AddWorker("t1", pb::ROLE_TRAINER, 1, &inv_, LayoutOf(inv_, {{0, {64, 0}, {128, 256}, false}}));
    r0_ = &c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {128, 256}, false}, {1, {0, 0}, {64, 128}, false}}));
    r1_ = &c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, LayoutOf(inv_, {{0, {0, 0}, {128, 256}, true}, {1, {0, 0}, {64, 128}, true}}));
    for (TestWorker* w : {t0_, t1_, r0_, r1_}) ASSERT_TRUE(c_.Register(*w, spec_).ok()) << w->id;
  }

  Metered Meter() { return ScrapeDeltaMeter(endpoint_->port()); }

  // The coordinator's final record of version v.
  pb::VersionStatus VersionOf(uint64_t v) { return c_.FinalVersion(v); }

  // Version v published, applied where the mode asks, every rollout byte checked, verified.
  void Version(pb::Mode mode, uint64_t v, bool apply = true) {
    for (auto& s : c_.Publish("m", mode, v, {t0_, t1_}, {r0_, r1_})) ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
    if (!apply) return;
    for (TestWorker* r : {r0_, r1_}) {
      if (mode != pb::MODE_SYNC) {
        pb::ApplyResponse resp;
        grpc::Status a = c_.Apply(*r, "m", v, &resp);
        ASSERT_TRUE(a.ok()) << r->id << " v" << v << ": " << a.error_message();
      }
      EXPECT_EQ(CountBadDelta(*r, v, kChange), 0) << r->id << " version " << v;
    }
    const pb::VersionStatus vs = VersionOf(v);
    EXPECT_TRUE(vs.verified()) << "version " << v << ": " << vs.ShortDebugString();
  }

  planner::Inventory inv_ = DeltaInventory();
  pb::ModelSpec spec_;
  absl::Notification held_, release_;  // ASupersededVersionNeverBecomesABase
  Cluster c_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  TestWorker *t0_ = nullptr, *t1_ = nullptr, *r0_ = nullptr, *r1_ = nullptr;
};

struct ModeCase {
  pb::Mode mode;
  pb::Strategy strategy;
};

class DeltaModesTest : public DeltaE2eTest, public ::testing::WithParamInterface<ModeCase> {};

// Version 1 in full, versions 2-3 as deltas across nodes: every byte exact and verified; the
// streams are a small share of the bytes they replace and no delta was refused.
TEST_P(DeltaModesTest, DeltasAreByteExactAndSmall) {
  const ModeCase mc = GetParam();
  Start();
  AddWorkers(mc.mode, mc.strategy);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m0 = Meter();
  Version(mc.mode, 1);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m1 = Meter();
  EXPECT_EQ(m1.stream - m0.stream, 0) << "version 1 has no base anywhere";
  Version(mc.mode, 2);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m2 = Meter();
  Version(mc.mode, 3);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m3 = Meter();
  // Version 3's base on the sender is version 2 as the cache made it: version 1's copy with
  // version 2's streams applied in place (the cache at 1x, DeltaCache::AddPendingStream).
  EXPECT_GT(m3.stream - m2.stream, 0) << "version 3 must travel as deltas too";
  EXPECT_GT(m2.stream - m1.stream, 0) << "version 2 must travel as deltas";
  // The commit tagged each rollout's staging, and once live weights held the version (the sync
  // commit's copy; Apply in the other modes, which Version() calls before the next version) the
  // pool got it back: the next version took it by its tag, so the receiver decodes in place (no
  // copy of the base) in every mode.
  EXPECT_GT(m3.decoded_in_place - m2.decoded_in_place, 0) << "version 3 decodes in place";
  EXPECT_EQ(m3.decoded_copied - m1.decoded_copied, 0) << "every decode found its base in the staging it writes";
  EXPECT_EQ(m3.fallbacks - m0.fallbacks, 0) << "no delta may be refused here";
  // (rank0_broadcast: the rank-0 trainer's own boxes go straight to the rollouts, as deltas; what
  // passes through the gather staging goes full.)
  EXPECT_GT(m3.stream - m1.stream, 0) << "versions 2-3 must travel as deltas";
  EXPECT_LT((m3.stream - m1.stream) * 4, m3.replaced - m1.replaced) << "5% of elements changed: streams far below the raw bytes";
  // Issue 17.4's digests of the delta ops came from the codec's own passes: each op's source box as
  // the sender packed it and its destination box as the receiver decoded it (neither read again).
  EXPECT_EQ(m3.digest_codec - m1.digest_codec, 2 * (m3.replaced - m1.replaced)) << "wb_digest_bytes_total{how=\"codec\"}";
  // The coordinator's record of each version (ClusterStatus, `wbctl versions`' DELTA column) sums
  // what the nodes reported sending: exactly what their counters moved by.
  EXPECT_EQ(VersionOf(1).delta_replaced_bytes(), 0u);
  EXPECT_EQ(static_cast<double>(VersionOf(3).delta_bytes()), m3.stream - m2.stream);
  EXPECT_EQ(static_cast<double>(VersionOf(3).delta_replaced_bytes()), m3.replaced - m2.replaced);
  EXPECT_EQ(VersionOf(3).delta_fallback_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeltaModesTest,
                         ::testing::Values(ModeCase{pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE}, ModeCase{pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE},
                                           ModeCase{pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE},
                                           ModeCase{pb::MODE_ONE_STEP_OFF, pb::STRATEGY_P2P_NO_DEDUP},
                                           ModeCase{pb::MODE_SYNC, pb::STRATEGY_RANK0_BROADCAST}),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return absl::StrCat(pb::Mode_Name(i.param.mode), "_", pb::Strategy_Name(i.param.strategy));
                         });

// Async: version 1 is held in its first bucket on n0 while versions 2 and 3 are published, so 3
// supersedes 2 (2 never travels). Version 3's deltas are made against what the destinations hold
// (version 1), and land exact.
TEST_F(DeltaE2eTest, ASupersededVersionNeverBecomesABase) {
  absl::Notification& held = held_;  // members: the hook may run until the cluster stops
  absl::Notification& release = release_;
  Start([&held, &release](const std::string&, uint64_t v, uint32_t b) {
    if (v != 1 || b != 0) return;
    held.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  });
  AddWorkers(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  ASSERT_FALSE(HasFatalFailure());
  Version(pb::MODE_ASYNC, 1, /*apply=*/false);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(absl::Seconds(20))) << "version 1 never reached its first bucket";
  Version(pb::MODE_ASYNC, 2, /*apply=*/false);
  ASSERT_FALSE(HasFatalFailure());
  Version(pb::MODE_ASYNC, 3, /*apply=*/false);
  ASSERT_FALSE(HasFatalFailure());
  release.Notify();
  const Metered m0 = Meter();
  for (TestWorker* r : {r0_, r1_}) {
    pb::ApplyResponse resp;
    grpc::Status a = c_.Apply(*r, "m", 3, &resp);
    ASSERT_TRUE(a.ok()) << r->id << ": " << a.error_message();
    EXPECT_EQ(CountBadDelta(*r, 3, kChange), 0) << r->id;
  }
  EXPECT_EQ(VersionOf(2).state(), "superseded");
  EXPECT_TRUE(VersionOf(3).verified()) << VersionOf(3).ShortDebugString();
  const Metered m1 = Meter();
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0);
  // Then version 4 against 3.
  Version(pb::MODE_ASYNC, 4);
  EXPECT_GT(Meter().stream - m0.stream, 0);
}

// One-step-off: r1 leaves after version 2 and registers again (a restarted rollout: it holds
// nothing). The catch-up brings it version 2 in full; version 3 reaches it as deltas again (its
// node holds version 2 now), exact, and no delta is refused (the coordinator never claims a base a
// restarted rollout lacks).
TEST_F(DeltaE2eTest, ARestartedRolloutGetsFullBytesThenDeltasAgain) {
  Start();
  AddWorkers(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  ASSERT_FALSE(HasFatalFailure());
  for (uint64_t v = 1; v <= 2; ++v) {
    Version(pb::MODE_ONE_STEP_OFF, v);
    ASSERT_FALSE(HasFatalFailure());
  }
  {
    grpc::ClientContext ctx;
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id("r1");
    pb::DeregisterResponse resp;
    ASSERT_TRUE(r1_->stub->Deregister(&ctx, req, &resp).ok());
  }
  std::memset(r1_->seg.data(), 0, r1_->seg.size());  // the new process starts from nothing
  ASSERT_TRUE(c_.Register(*r1_, spec_).ok());
  pb::ApplyResponse resp;
  grpc::Status a = c_.Apply(*r1_, "m", 2, &resp);  // the catch-up (full)
  ASSERT_TRUE(a.ok()) << a.error_message();
  EXPECT_EQ(CountBadDelta(*r1_, 2, kChange), 0);
  const Metered m0 = Meter();
  Version(pb::MODE_ONE_STEP_OFF, 3);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m1 = Meter();
  EXPECT_GT(m1.stream - m0.stream, 0) << "version 3 travels as deltas again";
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0);
}

// One-step-off with --delta_in_place=false: after version 1 is applied, r1's live weights are its
// node's committed copy (the committed staging went back to the pool untagged), and one byte of them changes behind the node's back
// (the base of the next delta no longer matches what the sender diffed against). Version 2's
// deltas into r1 fail the base check BEFORE anything is applied, those ops are resent in full, and
// every byte of version 2 is exact and verified.
TEST_F(DeltaE2eTest, ABaseThatDoesNotMatchIsRefusedAndTheFullBytesLand) {
  Start(nullptr, /*in_place=*/false);  // the live weights are the base (with in place: the node's own staging)
  AddWorkers(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  ASSERT_FALSE(HasFatalFailure());
  Version(pb::MODE_ONE_STEP_OFF, 1);
  ASSERT_FALSE(HasFatalFailure());
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x40;  // a byte of r1's copy of tensor a (from t0)
  const Metered m0 = Meter();
  Version(pb::MODE_ONE_STEP_OFF, 2);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m1 = Meter();
  EXPECT_GE(m1.fallbacks - m0.fallbacks, 1) << "r1's node must refuse the delta made against another base";
  EXPECT_GT(VersionOf(2).delta_fallback_bytes(), 0u) << "`wbctl versions` shows the refused bytes resent in full";
  EXPECT_GT(m1.stream - m0.stream, 0) << "the other deltas still travel";
  // The refused op's landed digest is not the codec's (nothing it decoded counts): it is taken
  // from what landed in full, and version 2 is verified (Version) on it.
  EXPECT_LT(m1.digest_codec - m0.digest_codec, 2 * (m1.replaced - m0.replaced)) << "wb_digest_bytes_total{how=\"codec\"}";
  // And version 3 goes as deltas with no refusal (r1 holds version 2 whole now).
  Version(pb::MODE_ONE_STEP_OFF, 3);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m2 = Meter();
  EXPECT_EQ(m2.fallbacks - m1.fallbacks, 0);
  // Again after a version r1 received as deltas: its node recorded the digests of what it decoded
  // (the next base check's digest, not hashed again); a byte changed behind the node after that is
  // still refused - decided on the base itself - resent in full, and version 4 is exact.
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x40;
  Version(pb::MODE_ONE_STEP_OFF, 4);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_GE(Meter().fallbacks - m2.fallbacks, 1) << "a recorded digest must not let a changed base through";
}

// Sync: the base of a delta is the node's own copy, the staging the last commit copied into live
// weights (tagged and taken back from the pool), not the live weights: a byte of r1's live weights
// changed behind the node's back does not refuse anything, the deltas decode in place, and the
// commit writes every piece of version 2 over it (exact and verified).
TEST_F(DeltaE2eTest, SyncDeltasDecodeInPlaceIntoTheNodesOwnCopy) {
  Start();
  AddWorkers(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  ASSERT_FALSE(HasFatalFailure());
  Version(pb::MODE_SYNC, 1);
  ASSERT_FALSE(HasFatalFailure());
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x40;
  const Metered m0 = Meter();
  Version(pb::MODE_SYNC, 2);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m1 = Meter();
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0);
  EXPECT_GT(m1.stream - m0.stream, 0);
  EXPECT_GT(m1.decoded_in_place - m0.decoded_in_place, 0);
  EXPECT_EQ(m1.decoded_copied - m0.decoded_copied, 0) << "every decode found its base in the staging it writes";
}

// One-step-off and async: a rollout that has not applied version 2 when version 3 starts still
// needs its committed staging of version 2 for Apply, so version 3 decodes out of place from it
// into new staging; once the rollout applied version 3 before version 4 starts, version 4 decodes
// in place again. Every byte exact after each Apply.
class DeltaApplyTest : public DeltaE2eTest, public ::testing::WithParamInterface<pb::Mode> {};

TEST_P(DeltaApplyTest, DeltasDecodeInPlaceOnlyIntoStagingTheRolloutAppliedAlready) {
  const pb::Mode mode = GetParam();
  Start();
  AddWorkers(mode, pb::STRATEGY_WEIGHTBRIDGE);
  ASSERT_FALSE(HasFatalFailure());
  Version(mode, 1);
  Version(mode, 2, /*apply=*/false);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_TRUE(VersionOf(2).verified());  // committed on both nodes before anything is metered
  const Metered m2 = Meter();
  Version(mode, 3);  // applies version 3 (version 2 is never applied)
  ASSERT_FALSE(HasFatalFailure());
  const Metered m3 = Meter();
  EXPECT_GT(m3.stream - m2.stream, 0) << "version 3 travels as deltas";
  EXPECT_EQ(m3.fallbacks - m2.fallbacks, 0);
  EXPECT_EQ(m3.decoded_in_place - m2.decoded_in_place, 0) << "version 2's staging is still the committed copy";
  EXPECT_GT(m3.decoded_copied - m2.decoded_copied, 0);
  // A byte of r1's live weights changed behind the node: not the base (the node's own staging
  // is), so nothing is refused, and Apply writes every piece of version 4 over it (Version checks).
  static_cast<uint8_t*>(r1_->seg.data())[5] ^= 0x40;
  Version(mode, 4);
  ASSERT_FALSE(HasFatalFailure());
  const Metered m4 = Meter();
  EXPECT_EQ(m4.fallbacks - m3.fallbacks, 0);
  EXPECT_GT(m4.decoded_in_place - m3.decoded_in_place, 0) << "version 3 was applied before version 4 started";
  EXPECT_EQ(m4.decoded_copied - m3.decoded_copied, 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeltaApplyTest, ::testing::Values(pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

}  // namespace
}  // namespace wb::daemon
