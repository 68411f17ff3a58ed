// Catch-up from quantised rollouts (docs/daemon.md "Catch-up"), end to end with real daemons:
// trainers t0, t1 on n0 publish bf16 versions; rollout r1 on n1 holds tensor w quantised
// (fp8_block128, mxfp8 or w4a16_g32) and n unquantised (daemon/delta_quant_e2e_fixture.h). After
// versions 1 and 2, a late rollout with r1's layout registers on n0 (its sources on the other
// node: host_tcp) and another on n1 (same node): each is brought to version 2 from r1's copy -
// w as copies of r1's quantised elements and scales, n as bf16 -, byte for byte the receiver's
// own quantisation of version 2, before WaitVersion / Apply report it; then version 3 reaches
// every rollout. Before, quantised rollouts were never sources: an engine restarted among fp8
// engines waited for the next trainer step. Late rollouts in a form no source holds (bf16, NVFP4,
// another block) are told why, and the next version reaches them.
#include <string>
#include <vector>

#include "daemon/delta_quant_e2e_fixture.h"
#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

struct Case {
  pb::Mode mode;
  QuantFormat format;
  // 256: the trainers' shards hold whole blocks (n0 quantises, sender-quantised ops into r1); 192:
  // fp8_block128 blocks split between them, so r1's node quantises w itself (receiver-side).
  int64_t split_row = 256;
};

class CatchUpQuantTest : public DeltaQuantFixture, public ::testing::WithParamInterface<Case> {
 protected:
  // What a rollout does to get version v: sync, WaitVersion with its worker id (OK once its live
  // weights hold v); otherwise Apply(v).
  grpc::Status Receive(TestWorker& r, uint64_t v) {
    if (mode_ == pb::MODE_SYNC) {
      pb::WaitVersionResponse resp;
      return WaitVersionAs(r, "m", v, 20000, &resp);
    }
    pb::ApplyResponse resp;
    return c_.Apply(r, "m", v, &resp);
  }
  // Host staging node `node` had to allocate for versions (not reused from its staging pool).
  double StagingAllocated(int node) {
    auto m = ScrapeMetrics(endpoint_->port(), absl::Seconds(10));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? MetricSum(*m, "wb_staging_bytes_total", absl::StrCat("node=\"n", node, "\",result=\"allocated\"")) : -1;
  }
  TestWorker& Late(const std::string& id, int node, planner::WorkerLayout layout) {
    TestWorker& r = c_.AddWorker(id, pb::ROLE_ROLLOUT, node, &inv_, std::move(layout));
    EXPECT_TRUE(c_.Register(r, spec_).ok()) << id;
    return r;
  }
};

TEST_P(CatchUpQuantTest, LateQuantisedRolloutsAreServedTheQuantisedBytesOfOthers) {
  Start(GetParam().mode, 1, GetParam().format, GetParam().split_row);
  ASSERT_FALSE(HasFatalFailure());
  Versions(1, 2);
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<uint8_t> v2 = ExpectedQuant(inv_, layout_, geo_, 2);
  for (auto [id, node] : {std::pair<std::string, int>{"r3", 0}, {"r4", 1}}) {
    const double allocated = StagingAllocated(node);
    TestWorker& r = Late(id, node, layout_);
    grpc::Status s = Receive(r, 2);
    ASSERT_TRUE(s.ok()) << format_.name << " " << id << " on n" << node << ": " << s.error_message();
    EXPECT_EQ(CountBadQuant(r, geo_, v2), 0) << format_.name << " " << id << " was told version 2 before holding it";
    // Its incoming staging (grown by the shadows of its quantised pieces) was faulted in when it
    // registered: the catch-up allocates none (n0 held no rollout before r3).
    EXPECT_EQ(StagingAllocated(node), allocated) << id << " on n" << node;
    rollouts_.push_back(&r);
  }
  Version(3);
}

// A quantised source whose memory changed since the version landed there (one of its block
// scales, as an engine that re-quantises its scales in place after loading) does not serve it: a
// sender-quantised landing's digest covers the piece's elements and the scales of its blocks, and
// where r1's node quantised w itself (split_row 192) its quantiser's digest of the piece does
// (PlanSlice.certify, `quantized`), so the catch-up finds the change, r1 serves version 1 no more
// and the late rollout is told why (sync: r1 is read in its live weights). Outside sync the
// catch-up may read r1's committed staging, which still holds the version: then the late rollout
// gets it byte for byte. Before, quantised sources were not certified: the late rollout got the
// changed scale, with matching catch-up digests. Version 2 then rewrites r1 and reaches r3.
TEST_P(CatchUpQuantTest, AQuantisedSourceWhoseScalesChangedDoesNotServeTheVersion) {
  Start(GetParam().mode, 1, GetParam().format, GetParam().split_row);
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<uint8_t> v1 = ExpectedQuant(inv_, layout_, geo_, 1);
  static_cast<uint8_t*>(r1_->seg.data())[geo_.scales_at + 1] ^= 0x01;
  ASSERT_EQ(CountBadQuant(*r1_, geo_, v1), 1);
  TestWorker& r = Late("r3", 0, layout_);
  grpc::Status s = Receive(r, 1);
  if (s.ok()) {
    EXPECT_NE(mode_, pb::MODE_SYNC) << format_.name << ": a sync source is read in its live weights, which changed";
    EXPECT_EQ(CountBadQuant(r, geo_, v1), 0) << format_.name << ": the late rollout got the source's changed scale";
  } else {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_NE(s.error_message().find("no rollout holds version 1 (rollouts r1 held it, but a catch-up found their memory changed since)"),
              std::string::npos)
        << s.error_message();
    std::string why;
    const pb::StatusResponse st = c_.Status(*t0_);
    for (const pb::WorkerStatus& ws : st.workers()) {
      if (ws.worker_id() == "r1") why = ws.catch_up_error();
    }
    EXPECT_NE(why.find("source rollout r1 on node n1 no longer holds the version it would serve: box "), std::string::npos) << why;
    EXPECT_NE(why.find("of tensor w (quantised elements and scales) hashes to "), std::string::npos) << why;
  }
  rollouts_.push_back(&r);
  Version(2);
}

INSTANTIATE_TEST_SUITE_P(
    ModesAndFormats, CatchUpQuantTest,
    ::testing::Values(Case{pb::MODE_SYNC, Fp8Block128Format()}, Case{pb::MODE_ONE_STEP_OFF, Fp8Block128Format()},
                      Case{pb::MODE_ASYNC, Fp8Block128Format()}, Case{pb::MODE_SYNC, Mxfp8Format()},
                      Case{pb::MODE_ONE_STEP_OFF, W4a16G32Format()}, Case{pb::MODE_SYNC, Fp8Block128Format(), 192},
                      Case{pb::MODE_ONE_STEP_OFF, Fp8Block128Format(), 192}, Case{pb::MODE_ASYNC, Fp8Block128Format(), 192}),
    [](const ::testing::TestParamInfo<Case>& i) {
      return pb::Mode_Name(i.param.mode) + "_" + i.param.format.name + (i.param.split_row != 256 ? "_receiver_quantised" : "");
    });

class CatchUpQuantFormsTest : public CatchUpQuantTest {};

// Only fp8_block128 rollouts hold the version: a late bf16 rollout and a late mxfp8 rollout cannot
// be served (a quantised piece holds no canonical bytes and nobody re-quantises); each is told
// why (ABORTED naming the tensor and what it needs), and version 2 reaches both.
TEST_F(CatchUpQuantFormsTest, LateRolloutsInAnotherFormAreToldWhyAndGetTheNextVersion) {
  Start(pb::MODE_SYNC, 1, Fp8Block128Format());
  ASSERT_FALSE(HasFatalFailure());
  Version(1);
  ASSERT_FALSE(HasFatalFailure());
  TestWorker& bf16 = Late("r3", 0, LayoutOf(inv_, {{0, {0, 0}, {kDeltaQuantRows, kDeltaQuantCols}, false}, {1, {0, 0}, {1, kDeltaQuantNorm}, false}}));
  pb::WaitVersionResponse resp;
  grpc::Status s = WaitVersionAs(bf16, "m", 1, 20000, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("catch-up of model m version 1 failed: no plan from the rollouts holding it"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("of tensor w in the canonical dtype, as r3 needs it"), std::string::npos) << s.error_message();
  const QuantFormat mx = Mxfp8Format();
  const QuantGeometry mx_geo = GeometryOf(mx);
  const planner::WorkerLayout mx_layout = QuantRolloutLayout(mx);
  TestWorker& other = Late("r4", 1, mx_layout);
  s = WaitVersionAs(other, "m", 1, 20000, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("it holds the box as float8_e4m3"), std::string::npos) << s.error_message();
  rollouts_.push_back(&bf16);
  rollouts_.push_back(&other);
  for (auto& st : c_.Publish("m", mode_, 2, {t0_, t1_}, rollouts_)) ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(CountBadQuant(*r1_, geo_, ExpectedQuant(inv_, layout_, geo_, 2)), 0);
  EXPECT_EQ(CountBadDelta(bf16, 2, kDeltaQuantChange), 0);
  EXPECT_EQ(CountBadQuant(other, mx_geo, ExpectedQuant(inv_, mx_layout, mx_geo, 2)), 0);
}

}  // namespace
}  // namespace wb::daemon
