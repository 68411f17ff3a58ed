// The thirty-eighth session's size probe (docs/security.md "Found by the thirty-eighth session's
// size probe"): repeated fields of ~1e6 entries, ~10 MB strings and floods of parallel calls,
// first black box against weightbridged processes, then each finding here against a real
// coordinator and two node daemons in this process (daemon/multinode_fixture.h) on 127.0.0.1:0.
// Each case fails without its fix.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/auth.h"
#include "daemon/limits.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr size_t kTenMiB = size_t{10} << 20;

// A client of the coordinator's TCP port as any token holder is (no TLS in the fixture: a caller
// may name any node), able to send 10 MB requests.
std::unique_ptr<pb::CoordinatorService::Stub> CoordinatorStub(Cluster& c) {
  return pb::CoordinatorService::NewStub(MakePeerChannel(c.coord_->address(), PeerAuthConfig(), int64_t{64} << 20));
}

std::unique_ptr<grpc::ClientContext> Within(absl::Duration d) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
  return ctx;
}

class SizeProbeTest : public ::testing::Test {
 protected:
  void TearDown() override { c_.Stop(); }
  planner::Inventory inv_ = SmallInventory();
  Cluster c_;
};

// ReportDoneRequest.error is a node's free text (any bytes a token holder naming a node of the
// version sends). The coordinator kept it whole in the version's record (ClusterStatus, wbctl
// status / versions / watch), logged it as one line, and sent it in AbortVersion to every node of
// the version, which kept it as their record of the version too: the probe's 10 MB error made every
// status reply 10 MB larger (and past gRPC's default 4 MB a status client could no longer read it).
// Now it is cut to its first 4 KiB where it enters the coordinator, marked with its length.
TEST_F(SizeProbeTest, ATenMegabyteReportDoneErrorIsCutWhereItEnters) {
  std::atomic<bool> armed{true};
  absl::Notification entered, release;
  const StopAtExit stop(c_, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go, not in TearDown
  TwoNodeSetup setup{pb::MODE_ONE_STEP_OFF};
  setup.n1_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || !armed.exchange(false)) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  };
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, setup);
  ASSERT_FALSE(HasFatalFailure());
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c_.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1}); });
  const bool held = entered.WaitForNotificationWithTimeout(absl::Seconds(15));
  grpc::Status reported;
  if (held) {
    // n0's failure report of version 1, 10 MB of text (a multi-byte character straddles the cut).
    pb::ReportDoneRequest req;
    req.set_node_id("n0");
    req.set_model_id("m");
    req.set_version(1);
    req.set_ok(false);
    std::string error(kMaxNodeTextBytes - 1, 'e');
    error += "\xc3\xa9";
    error.resize(kTenMiB, 'e');
    req.set_error(error);
    pb::ReportDoneResponse resp;
    reported = CoordinatorStub(c_)->ReportDone(Within(absl::Seconds(20)).get(), req, &resp);
  }
  release.Notify();
  publisher.join();
  ASSERT_TRUE(held) << "version 1 never ran on n1";
  ASSERT_TRUE(reported.ok()) << reported.error_message();
  const pb::VersionStatus v1 = c_.FinalVersion(1);
  // (Without the cut the coordinator's status push carried the 10 MB and its reader, at gRPC's
  // default 4 MB, never saw the version final.)
  ASSERT_EQ(v1.state(), "aborted");
  EXPECT_LE(v1.error().size(), kMaxNodeTextBytes + 200) << "the coordinator keeps the node's text whole";
  EXPECT_TRUE(absl::StartsWith(v1.error(), "node n0: eee")) << v1.error().substr(0, 100);
  EXPECT_NE(v1.error().find("... (truncated: 10485760 bytes)"), std::string::npos) << v1.error().substr(v1.error().size() > 100 ? v1.error().size() - 100 : 0);
  EXPECT_EQ(v1.error().find("\xc3"), std::string::npos) << "cut inside a UTF-8 character";
  // What every status holds (the coordinator's, and each node's, which forwards it) stays small.
  for (TestWorker* x : {&w.r0, &w.r1}) {
    const pb::StatusResponse st = c_.Status(*x);
    EXPECT_LT(st.ByteSizeLong(), size_t{64} << 10) << x->id;
  }
  // The model goes on: version 2 moves whole.
  for (grpc::Status& s : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse applied;
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(c_.Apply(*r, "m", 2, &applied).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

// BoundNodeText itself: text that fits is unchanged; longer text keeps its first 4 KiB, never
// half a UTF-8 character, and says how long it was.
TEST(BoundNodeTextTest, KeepsTheFirstFourKibibytesWhole) {
  EXPECT_EQ(BoundNodeText("short"), "short");
  const std::string fits(kMaxNodeTextBytes, 'x');
  EXPECT_EQ(BoundNodeText(fits), fits);
  EXPECT_EQ(BoundNodeText(fits + "y"), fits + "... (truncated: 4097 bytes)");
  std::string straddles(kMaxNodeTextBytes - 1, 'x');
  straddles += "\xe2\x82\xac tail";  // a 3-byte character starting 1 byte before the cut
  EXPECT_EQ(BoundNodeText(straddles), std::string(kMaxNodeTextBytes - 1, 'x') + "... (truncated: 4103 bytes)");
}

// JoinWorkerRequest.process ("<pid>@<start time>", set by a node) was the one JoinWorker string
// not checked: the probe's JoinWorker with a 10 MB process was answered OK, and the coordinator
// kept those 10 MB with the worker (compared again at every later join of the id). Now it is held
// to max_name_bytes like the ids, INVALID_ARGUMENT naming the field and the limit.
TEST_F(SizeProbeTest, ATenMegabyteJoinWorkerProcessIsRefusedNamingTheField) {
  c_.StartCoordinator();
  c_.StartNode(0);
  ASSERT_FALSE(HasFatalFailure());
  auto stub = CoordinatorStub(c_);
  pb::CreateModelRequest create;
  *create.mutable_model() = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  pb::CreateModelResponse created;
  ASSERT_TRUE(stub->CreateModel(Within(absl::Seconds(20)).get(), create, &created).ok());
  pb::JoinWorkerRequest join;
  join.set_node_id("n0");
  join.set_worker_id("x0");
  join.set_model_id("m");
  join.set_role(pb::ROLE_ROLLOUT);
  join.set_gpu(-1);
  join.set_process(std::string(kTenMiB, 'P'));
  pb::JoinWorkerResponse joined;
  grpc::Status s = stub->JoinWorker(Within(absl::Seconds(20)).get(), join, &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message().substr(0, 200);
  for (const char* want : {"JoinWorker.process", "10485760 bytes", "limit of 1024"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message().substr(0, 300);
  }
  EXPECT_LE(s.error_message().size(), 4096u);
  // A process as nodes send it joins.
  join.set_process("12345@678901");
  s = stub->JoinWorker(Within(absl::Seconds(20)).get(), join, &joined);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace wb::daemon
