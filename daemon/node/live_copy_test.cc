#include "daemon/node/live_copy.h"

#include <cstring>

#include "gtest/gtest.h"
#include "transport/config.h"
#include "transport/host_shm/host_shm.h"
#include "base/shm_segment.h"

namespace wb::daemon {
namespace {

TEST(LiveStateTest, WholeCopyingTornAndRestored) {
  LiveState s;
  EXPECT_EQ(s.Get("r0").state, LiveState::State::kWhole);
  ASSERT_TRUE(s.Begin("r0", 2, 1));
  EXPECT_TRUE(s.Copying("r0"));
  EXPECT_FALSE(s.Begin("r0", 3, 1)) << "a second copy into the same worker must wait for the first";
  s.End("r0", absl::OkStatus(), true);
  EXPECT_EQ(s.Get("r0").state, LiveState::State::kWhole);
  EXPECT_TRUE(s.TornError("r0", "n0").ok());

  // Fails after writing: torn, naming the versions and the reason.
  ASSERT_TRUE(s.Begin("r0", 3, 2));
  s.End("r0", absl::UnavailableError("peer gone"), /*wrote=*/true);
  EXPECT_TRUE(s.Torn("r0"));
  absl::Status e = s.TornError("r0", "n0");
  EXPECT_EQ(e.code(), absl::StatusCode::kDataLoss);
  for (const char* want : {"worker r0", "node n0", "TORN", "version 3", "over version 2", "peer gone"}) {
    EXPECT_NE(e.message().find(want), std::string::npos) << want << " missing in: " << e.message();
  }
  // A copy that fails before writing changes nothing: still torn, same versions.
  ASSERT_TRUE(s.Begin("r0", 4, 3));
  s.End("r0", absl::InternalError("registration failed"), /*wrote=*/false);
  EXPECT_TRUE(s.Torn("r0"));
  EXPECT_EQ(s.Get("r0").writing, 3u);
  // A copy over torn weights is over what they last were meant to be.
  ASSERT_TRUE(s.Begin("r0", 4, 3));
  EXPECT_EQ(s.Get("r0").over, 2u);
  s.End("r0", absl::OkStatus(), true);
  EXPECT_FALSE(s.Torn("r0"));

  // Fails before writing on a whole worker: whole.
  ASSERT_TRUE(s.Begin("r1", 1, 0));
  s.End("r1", absl::InternalError("x"), false);
  EXPECT_EQ(s.Get("r1").state, LiveState::State::kWhole);
  // Forget drops everything (the worker left).
  ASSERT_TRUE(s.Begin("r1", 2, 1));
  s.End("r1", absl::InternalError("x"), true);
  s.Forget("r1");
  EXPECT_EQ(s.Get("r1").state, LiveState::State::kWhole);
}

class LiveCopierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    transport::TransportConfig tc;
    t_ = transport::NewHostShmTransport(tc);
    ASSERT_NE(t_, nullptr);
    inv_.tensors = {{"a", {64, 64}, planner::DType::kF32}};
    planner::Piece p;
    p.tensor = 0;
    p.box = {{0, 0}, {64, 64}};
    p.offset_bytes = 0;
    p.strides = {64, 1};
    layout_.pieces = {p};
    layout_.buffers = {{64 * 64 * 4}};
    auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("lc"), 64 * 64 * 4);
    ASSERT_TRUE(seg.ok()) << seg.status();
    live_.host.push_back(std::make_shared<transport::ShmSegment>(std::move(*seg)));
    live_.cuda.push_back(nullptr);
    staging_.resize(1);
    staging_[0].host.assign(64 * 64 * 4, 0xAB);
  }
  int64_t CountNew() const {
    const uint8_t* p = static_cast<const uint8_t*>(live_.host[0]->data());
    int64_t n = 0;
    for (int64_t i = 0; i < live_.host[0]->size(); ++i) n += p[i] == 0xAB;
    return n;
  }
  std::unique_ptr<transport::Transport> t_;
  planner::Inventory inv_;
  planner::WorkerLayout layout_;
  LiveBuffers live_;
  StagedBytes staging_;
};

TEST_F(LiveCopierTest, CopiesEveryPiece) {
  LiveCopier c("n0", t_.get());
  bool wrote = false;
  ASSERT_TRUE(c.CopyToLive(staging_, live_, layout_, inv_, "apply r0 v1", absl::Now() + absl::Seconds(10), &wrote).ok());
  EXPECT_TRUE(wrote);
  EXPECT_EQ(CountNew(), live_.host[0]->size());
}

TEST_F(LiveCopierTest, FaultMidwayReportsWroteAndLeavesPartialBytes) {
  // Two pieces (two ops): the injected fault copies the first only.
  layout_.pieces[0].box = {{0, 0}, {32, 64}};
  planner::Piece second = layout_.pieces[0];
  second.box = {{32, 0}, {64, 64}};
  second.offset_bytes = 32 * 64 * 4;
  layout_.pieces.push_back(second);
  LiveCopier c("n0", t_.get(), [](const std::string& label) {
    return label == "apply r0 v1" ? absl::UnavailableError("injected") : absl::OkStatus();
  });
  bool wrote = false;
  absl::Status s = c.CopyToLive(staging_, live_, layout_, inv_, "apply r0 v1", absl::Now() + absl::Seconds(10), &wrote);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(wrote);
  EXPECT_EQ(CountNew(), live_.host[0]->size() / 2) << "half the pieces landed";
}

TEST_F(LiveCopierTest, RefusalBeforeWritingSaysNothingWasWritten) {
  layout_.pieces[0].buffer = 3;  // a buffer the worker does not have
  LiveCopier c("n0", t_.get());
  bool wrote = true;
  absl::Status s = c.CopyToLive(staging_, live_, layout_, inv_, "apply r0 v1", absl::Now() + absl::Seconds(10), &wrote);
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(wrote);
  EXPECT_EQ(CountNew(), 0);
}

}  // namespace
}  // namespace wb::daemon
