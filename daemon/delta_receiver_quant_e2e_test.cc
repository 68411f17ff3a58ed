// Lossless deltas into receiver-quantised pieces (issue 17.2 with quantised targets; docs/daemon.md
// "Deltas (design and status)"), with real daemons (delta_quant_e2e_fixture.h): rollout r1 holds w
// in a format its node quantises itself - NVFP4 (never quantised on the sender: its global scale
// needs the whole piece), or fp8_block128 when the trainers split w at row 192, inside a 128-row
// block - so every op into w carries canonical bf16 bytes into w's shadow in r1's staging. With
// --delta_cache_bytes those travel as deltas of the canonical bytes from version 2 on, decoded
// against the shadow r1's node kept in the staging of the committed version (in place in sync; the
// committed staging in one-step-off / async), then quantised as before. Every rollout byte equals
// the receiver's own quantisation of the canonical version (daemon/quantize.h QuantizePiece, what
// the full path lands), every version is verified end to end. Without kept shadows (a node with
// --delta_in_place=false, whose base would be r1's live weights, which hold no canonical bytes) the
// coordinator plans those ops in full.
#include <atomic>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/delta_quant_e2e_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr double kCanonicalBytes = kDeltaQuantRows * kDeltaQuantCols * 2;  // bf16 bytes of w per version
constexpr double kNormBytes = kDeltaQuantNorm * 2;

// (format, split row): the trainers' shards of w hold whole blocks (256) or not (192).
struct ReceiverCase {
  QuantFormat format;
  int64_t split_row = 256;
};
ReceiverCase CaseNamed(const std::string& name) {
  if (name == "nvfp4") return {Nvfp4Format(), 256};
  return {Fp8Block128Format(), 192};  // "fp8_block128_split": blocks straddle the trainers
}

class DeltaReceiverQuantTest : public DeltaQuantFixture, public ::testing::WithParamInterface<std::tuple<std::string, pb::Mode>> {};

// Versions 2-3: w's canonical bytes went as deltas (what the streams replaced is w's bf16 bytes,
// at most with n's), the streams under a quarter of that, no refusal, r1 exact and verified.
TEST_P(DeltaReceiverQuantTest, ReceiverQuantisedPiecesGetDeltasOfTheCanonicalBytes) {
  const ReceiverCase rc = CaseNamed(std::get<0>(GetParam()));
  Start(std::get<1>(GetParam()), /*replicas=*/1, rc.format, rc.split_row);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m0 = Meter();
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_EQ(m1.stream - m0.stream, 0) << "version 1 has no base";
  Versions(2, 3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m3 = Meter();
  EXPECT_EQ(m3.fallbacks - m0.fallbacks, 0) << "the kept shadows are the base: no delta may be refused";
  const double replaced = m3.replaced - m1.replaced, stream = m3.stream - m1.stream;
  EXPECT_GE(replaced, 2 * kCanonicalBytes) << "every box of w's canonical bytes of versions 2-3 went as a delta";
  EXPECT_LE(replaced, 2 * (kCanonicalBytes + kNormBytes));
  EXPECT_GT(stream, 0);
  EXPECT_LT(stream * 4, replaced) << "5% of bf16 elements changed: streams far below the canonical bytes";
}

INSTANTIATE_TEST_SUITE_P(
    FormatsAndModes, DeltaReceiverQuantTest,
    ::testing::Combine(::testing::Values("nvfp4", "fp8_block128_split"),
                       ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, pb::Mode>>& i) {
      return std::get<0>(i.param) + "_" + pb::Mode_Name(std::get<1>(i.param));
    });

class DeltaReceiverQuantCaseTest : public DeltaQuantFixture, public ::testing::WithParamInterface<std::string> {};

// Sync with --delta_in_place=false on the nodes: r1's node would have only r1's live weights as
// a base, which hold no canonical shadows, so the coordinator (RegisterNodeRequest.delta_in_place)
// plans w's ops in full from the start - no stream wasted, nothing refused - while n (unquantised)
// still travels as deltas; r1 exact and verified in every version.
TEST_P(DeltaReceiverQuantCaseTest, WithoutKeptShadowsTheReceiverQuantisedOpsGoFull) {
  const ReceiverCase rc = CaseNamed(GetParam());
  Start(pb::MODE_SYNC, /*replicas=*/1, rc.format, rc.split_row, [](ServerOptions& o) { o.delta_in_place = false; });
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  Versions(2, 3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m3 = Meter();
  EXPECT_EQ(m3.fallbacks - m1.fallbacks, 0) << "nothing sent as a delta that the node must refuse";
  EXPECT_GT(m3.replaced - m1.replaced, 0) << "n still travels as deltas";
  EXPECT_LE(m3.replaced - m1.replaced, 2 * kNormBytes) << "w's canonical bytes go full";
}

// Two replicas on n1 (one-step-off): w's canonical boxes cross the nodes once, as deltas, into
// one replica's shadow, which relays them to the other's after n1's delta tail; both quantise.
// Versions 2-3: both replicas exact, verified, no refusal, w's bytes replaced once per version.
TEST_P(DeltaReceiverQuantCaseTest, ShadowsRelayedToASecondReplicaAfterTheirDeltas) {
  const ReceiverCase rc = CaseNamed(GetParam());
  Start(pb::MODE_ONE_STEP_OFF, /*replicas=*/2, rc.format, rc.split_row);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  Versions(2, 3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m3 = Meter();
  EXPECT_EQ(m3.fallbacks - m1.fallbacks, 0);
  const double replaced = m3.replaced - m1.replaced;
  EXPECT_GE(replaced, 2 * kCanonicalBytes) << "w's canonical bytes crossed as deltas";
  EXPECT_LE(replaced, 2 * (kCanonicalBytes + 2 * kNormBytes)) << "once per version: the second replica gets them by relays";
  EXPECT_LT((m3.stream - m1.stream) * 4, replaced);
}

class DeltaReceiverQuantCatchUpTest : public DeltaQuantFixture, public ::testing::WithParamInterface<pb::Mode> {
 protected:
  // Two fp8_block128 replicas on n1 (w split between trainer shards: quantised by n1), versions 1
  // and 2; then r2 restarts: a new process (its memory zeroed) registers under its id and is caught
  // up to version 2 from r1's quantised bytes, checked exact.
  void StartAndRestartR2AfterVersion2() {
    const ReceiverCase rc = CaseNamed("fp8_block128_split");
    Start(GetParam(), /*replicas=*/2, rc.format, rc.split_row);
    ASSERT_FALSE(HasFatalFailure());
    Versions(1, 2);
    ASSERT_FALSE(HasFatalFailure());
    TestWorker& r2 = *rollouts_[1];
    {
      grpc::ClientContext ctx;
      pb::DeregisterRequest req;
      req.set_model_id("m");
      req.set_worker_id(r2.id);
      pb::DeregisterResponse resp;
      ASSERT_TRUE(r2.stub->Deregister(&ctx, req, &resp).ok());
    }
    std::memset(r2.seg.data(), 0, r2.seg.size());  // the new process starts from nothing
    ASSERT_TRUE(c_.Register(r2, spec_).ok());
    if (mode_ == pb::MODE_SYNC) {
      pb::WaitVersionResponse resp;
      grpc::Status s = WaitVersionAs(r2, "m", 2, 20000, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
    } else {
      pb::ApplyResponse resp;
      grpc::Status s = c_.Apply(r2, "m", 2, &resp);  // the catch-up
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    EXPECT_EQ(CountBadQuant(r2, geo_, ExpectedQuant(inv_, layout_, geo_, 2)), 0) << "the catch-up";
  }
};

// r2 (one of two fp8_block128 replicas on n1 whose node quantises w) restarts after version 2: a
// new process registers under its id and is caught up to version 2 from r1's quantised bytes - the
// catch-up writes w's quantised elements and scales, never the canonical shadows r2's node
// quantises from. Version 3's ops into w's shadows must then not travel as deltas into r2 (its
// node has no base for them): they go full from the start, nothing refused (before, each was
// refused - a base or, with r2's old process's recorded digests, a target digest mismatch - and
// resent in full); r2 exact, verified. Version 4 travels as deltas again, nothing refused.
TEST_P(DeltaReceiverQuantCatchUpTest, ARestartedReplicaCaughtUpFromQuantisedBytesGetsTheNextVersionWithoutARefusal) {
  ASSERT_NO_FATAL_FAILURE(StartAndRestartR2AfterVersion2());
  TestWorker& r2 = *rollouts_[1];
  const DeltaMeter m0 = Meter();
  Version(3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0) << "r2's node holds no canonical shadows of version 2: nothing may be sent against them";
  EXPECT_GT(m1.replaced - m0.replaced, 0) << "what has a base still travels as deltas";
  Version(4);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m2 = Meter();
  EXPECT_EQ(m2.fallbacks - m1.fallbacks, 0);
  EXPECT_GE(m2.replaced - m1.replaced, kCanonicalBytes) << "version 4: w's canonical bytes travel as deltas again";
}

// As above, with a coordinator restart between the catch-up and version 3: the new coordinator
// learns what r2 holds from n1's re-join, and n1 says r2's version 2 came from a catch-up
// (JoinWorkerRequest.holds_without_shadows), so version 3's ops into r2's shadows still go full
// from the start: nothing refused (before, the restarted coordinator named version 2 as their
// base and each was refused once, then resent in full). Version 4 travels as deltas again.
TEST_P(DeltaReceiverQuantCatchUpTest, TheMarkOfACaughtUpReplicaSurvivesACoordinatorRestart) {
  ASSERT_NO_FATAL_FAILURE(StartAndRestartR2AfterVersion2());
  TestWorker& r2 = *rollouts_[1];
  // The coordinator restarts on its port; both nodes re-join with their workers and layouts.
  const int port = c_.coord_->port();
  c_.coord_->Shutdown();
  c_.coord_.reset();
  c_.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port), [](ServerOptions& o) { o.bucket_bytes = 65536; });
  ASSERT_FALSE(HasFatalFailure());
  auto back = c_.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        int with_layout = 0;
        for (const pb::WorkerStatus& ws : st.workers()) with_layout += ws.has_layout();
        return with_layout == 4 && CommittedOf(st, "m") == 2;
      },
      absl::Seconds(20));
  ASSERT_TRUE(back.ok()) << back.status();
  const DeltaMeter m0 = Meter();
  Version(3);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0) << "r2's node holds no canonical shadows of version 2, restarted coordinator or not";
  EXPECT_GT(m1.replaced - m0.replaced, 0) << "what has a base still travels as deltas";
  Version(4);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m2 = Meter();
  EXPECT_EQ(m2.fallbacks - m1.fallbacks, 0);
  EXPECT_GE(m2.replaced - m1.replaced, kCanonicalBytes) << "version 4: w's canonical bytes travel as deltas again";
}

class DeltaReceiverQuantAbortTest : public DeltaQuantFixture, public ::testing::WithParamInterface<pb::Mode> {
 protected:
  // Members, not the test's locals: the nodes' hooks may run until TearDown stops them.
  std::atomic<bool> armed_{false};
  std::atomic<int> flips_{0};
};

// Version 3 decodes in place into r1's base - the staging of version 2, the only copy of w's
// canonical shadows on n1 - and is then aborted: after its buckets a byte of n in r1's staging
// flips, which its end-to-end digest catches (n1 hashes after the buckets here). r1 still holds
// version 2 (live weights, quantised pieces), its shadows are gone. Version 4's ops into them must
// not travel as deltas against version 2 (the coordinator marks r1 at the abort): full from the
// start, nothing refused (before, each was refused - no staging held the base - and resent in
// full); n still travels as a delta; r1 exact and verified. Version 5 is all deltas again.
TEST_P(DeltaReceiverQuantAbortTest, AVersionAbortedAfterDecodingInPlaceCostsTheNextVersionNoRefusal) {
  const ReceiverCase rc = CaseNamed("fp8_block128_split");
  Start(GetParam(), /*replicas=*/1, rc.format, rc.split_row, [this](ServerOptions& o) {
    o.digest_overlap = false;  // the flip comes after the buckets
    o.configure_node = [this](NodeDaemon::Options& no) {
      no.test_after_buckets = [this](const std::string&, uint64_t v, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions) {
        auto r = regions.find("r1.b0");
        bool expected = true;
        if (v != 3 || r == regions.end() || r->second.second <= geo_.norm_at || !armed_.compare_exchange_strong(expected, false)) return;
        r->second.first[geo_.norm_at] ^= 0x01;  // n's first element
        ++flips_;
      };
    };
  });
  ASSERT_FALSE(HasFatalFailure());
  Versions(1, 2);
  ASSERT_FALSE(HasFatalFailure());
  armed_ = true;
  for (const grpc::Status& s : c_.Publish("m", mode_, 3, {t0_, t1_}, rollouts_)) {
    if (mode_ == pb::MODE_SYNC) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    }
  }
  if (mode_ != pb::MODE_SYNC) {
    pb::ApplyResponse resp;
    grpc::Status a = c_.Apply(*r1_, "m", 3, &resp);
    EXPECT_EQ(a.error_code(), grpc::StatusCode::ABORTED) << a.error_message();
  }
  ASSERT_EQ(flips_.load(), 1) << "the staging fault never fired";
  EXPECT_EQ(FinalVersionStatus(c_, 3).state(), "aborted");
  EXPECT_EQ(CountBadQuant(*r1_, geo_, ExpectedQuant(inv_, layout_, geo_, 2)), 0) << "r1 must still hold version 2";
  const DeltaMeter m0 = Meter();
  Version(4);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m1 = Meter();
  EXPECT_EQ(m1.fallbacks - m0.fallbacks, 0) << "the aborted version tore r1's shadows of version 2: nothing may be sent against them";
  EXPECT_GT(m1.replaced - m0.replaced, 0) << "n still travels as a delta";
  Version(5);
  ASSERT_FALSE(HasFatalFailure());
  const DeltaMeter m2 = Meter();
  EXPECT_EQ(m2.fallbacks - m1.fallbacks, 0);
  EXPECT_GE(m2.replaced - m1.replaced, kCanonicalBytes) << "version 5: w's canonical bytes travel as deltas again";
}

INSTANTIATE_TEST_SUITE_P(Modes, DeltaReceiverQuantAbortTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

INSTANTIATE_TEST_SUITE_P(Modes, DeltaReceiverQuantCatchUpTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

INSTANTIATE_TEST_SUITE_P(Formats, DeltaReceiverQuantCaseTest, ::testing::Values("nvfp4", "fp8_block128_split"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace wb::daemon
