// node::WorkerCalls and the record of answered one-step-off / async publishes (status.md item 24,
// docs/daemon.md "Coordinator restart"), on a scripted coordinator: an OK that reaches the node
// only after it registered with another coordinator is sent there too, and a trainer's node that
// restarted hands the publish it kept on disk (node::PublishRecord) to the same trainer process
// when it registers again. (With real daemons: //daemon:publish_record_restart_test.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/fake_gpu_import.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/publish_record.h"
#include "daemon/node/worker_calls.h"
#include "daemon/testing/node_parts.h"

namespace wb::daemon::node {
namespace {

// Publish answers from a script (OK when none), JoinWorker OK recording published_version; every
// other call UNAVAILABLE. Always registered, no coordinator change in the session sense; the
// instance is what SetInstance made it ("A" first).
class ScriptedCoordinator final : public CoordinatorAccess, public CoordinatorClient {
 public:
  std::deque<absl::Status> publish_answers;
  std::function<void()> on_publish;  // runs inside each Publish call (before its answer)

  CoordinatorClient& client() override { return *this; }
  bool AwaitRegistered(absl::Time) override { return true; }
  uint64_t session() override { return 0; }
  std::optional<std::string> AwaitCoordinatorChange(uint64_t, absl::Time) override { return std::nullopt; }
  void TrackProgress(const std::string&, uint64_t, std::weak_ptr<const std::atomic<uint64_t>>) override {}
  std::string coordinator_instance() override {
    absl::MutexLock l(&mu_);
    return instance_;
  }
  void SetInstance(const std::string& instance) {
    absl::MutexLock l(&mu_);
    instance_ = instance;
  }

  absl::Status Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp, absl::Duration) override {
    absl::Status answer;
    {
      absl::MutexLock l(&mu_);
      publishes_.push_back(absl::StrCat(req.worker_id(), " v", req.version(), "@", instance_));
      if (!publish_answers.empty()) {
        answer = publish_answers.front();
        publish_answers.pop_front();
      }
    }
    if (on_publish) on_publish();
    if (answer.ok()) resp->set_version(req.version());
    return answer;
  }
  absl::Status JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp, absl::Duration) override {
    absl::MutexLock l(&mu_);
    joins_.push_back(absl::StrCat(req.worker_id(), " published ", req.published_version()));
    resp->set_mode(pb::MODE_ONE_STEP_OFF);
    return absl::OkStatus();
  }
  std::vector<std::string> publishes() {  // "<worker> v<version>@<instance it reached>"
    absl::MutexLock l(&mu_);
    return publishes_;
  }
  std::vector<std::string> joins() {  // "<worker> published <JoinWorkerRequest.published_version>"
    absl::MutexLock l(&mu_);
    return joins_;
  }
#define WB_UNAVAILABLE_(Name, Req, Resp) \
  absl::Status Name(const pb::Req&, pb::Resp*, absl::Duration) override { return absl::UnavailableError(#Name); }
  WB_UNAVAILABLE_(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
  WB_UNAVAILABLE_(Heartbeat, HeartbeatRequest, HeartbeatResponse)
  WB_UNAVAILABLE_(SubmitLayout, SubmitLayoutRequest, SubmitLayoutResponse)
  WB_UNAVAILABLE_(LeaveWorker, LeaveWorkerRequest, LeaveWorkerResponse)
  WB_UNAVAILABLE_(ReportReady, ReportReadyRequest, ReportReadyResponse)
  WB_UNAVAILABLE_(ReportDone, ReportDoneRequest, ReportDoneResponse)
  WB_UNAVAILABLE_(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
  WB_UNAVAILABLE_(WaitVersion, WaitVersionRequest, WaitVersionResponse)
  WB_UNAVAILABLE_(ExchangeMagnitudes, ExchangeMagnitudesRequest, ExchangeMagnitudesResponse)
  WB_UNAVAILABLE_(ClusterStatus, StatusRequest, StatusResponse)
  WB_UNAVAILABLE_(Drain, DrainRequest, DrainResponse)
#undef WB_UNAVAILABLE_

 private:
  absl::Mutex mu_;
  std::string instance_ ABSL_GUARDED_BY(mu_) = "A";
  std::vector<std::string> publishes_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> joins_ ABSL_GUARDED_BY(mu_);
};

class PublishRecordCallsTest : public ::testing::Test, public daemon::testing::NodeParts {
 protected:
  PublishRecordCallsTest() : NodeParts({}) {
    MakeVersions(coordinator_);
    WorkerCalls::Options wo;
    wo.node_id = "n0";
    wo.coordinator = "coord.test:7070";
    wo.clock = &clock_;
    wo.metrics = &metrics_;
    wo.gpu_import = std::make_shared<FakeGpuImport>();
    calls_ = std::make_unique<WorkerCalls>(wo, *local_, *staging_, *versions_, *transports_, coordinator_);
  }
  ~PublishRecordCallsTest() override {
    calls_.reset();
    versions_.reset();
    local_.reset();
  }
  // A one-step-off trainer of this process with its layout and no buffers (its snapshot is empty).
  void AddTrainer(const std::string& id) {
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = planner::Role::kTrainer;
    w.mode = pb::MODE_ONE_STEP_OFF;
    w.has_layout = true;
    auto me = PidWatch::Open(::getpid(), "test");
    ASSERT_TRUE(me.ok()) << me.status();
    w.pid = *me;
    local_->Add({"m", id}, std::move(w), std::nullopt);
  }
  // A PublishRecord in a fresh directory, attached to calls_.
  PublishRecord* AttachRecord() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/publish-record-calls-", ::getpid(), "-",
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    EXPECT_EQ(::mkdir(dir.c_str(), 0700), 0) << dir;
    auto r = PublishRecord::Open(dir, "n0", nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    record_ = std::move(*r);
    calls_->AttachPublishRecord(record_.get());
    return record_.get();
  }
  std::string Me() {
    auto me = PidWatch::Open(::getpid(), "test");
    return me.ok() ? (*me)->Identity() : std::string();
  }
  uint64_t ReportedAtReJoin(const std::string& id) {
    for (const LocalWorkers::JoinInfo& j : local_->Joins()) {
      if (j.key.second == id) return j.published_version;
    }
    ADD_FAILURE() << id << " is not a local worker";
    return 0;
  }

  ScriptedCoordinator coordinator_;
  std::unique_ptr<PublishRecord> record_;
  std::unique_ptr<WorkerCalls> calls_;
};

// Coordinator A answers Publish(2) OK, but the node handles that answer only after it registered
// with coordinator B, whose re-join may have reported the trainer's older publish: B would not know
// the number is used. The node sends the publish to B too - from the same snapshot, as a publish
// whose answer was lost - and answers the trainer OK as A said, also when B refuses it (here: the
// number is used there already).
TEST_F(PublishRecordCallsTest, AnOkThatReachesTheNodeAfterAReJoinIsSentToTheNewCoordinator) {
  ASSERT_NO_FATAL_FAILURE(AddTrainer("t1"));
  PublishRecord* record = AttachRecord();
  coordinator_.publish_answers = {absl::OkStatus(), absl::AbortedError("its number is used")};
  bool first = true;
  coordinator_.on_publish = [&] {
    if (std::exchange(first, false)) coordinator_.SetInstance("B");  // the re-join, while A's OK is on its way
  };
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("t1");
  req.set_version(2);
  req.set_timeout_ms(10000);
  pb::PublishResponse resp;
  absl::Status s = calls_->Publish(req, &resp);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.version(), 2u);
  EXPECT_EQ(coordinator_.publishes(), (std::vector<std::string>{"t1 v2@A", "t1 v2@B"})) << "sent to the new coordinator too";
  EXPECT_EQ(ReportedAtReJoin("t1"), 2u) << "a later re-join reports it";
  EXPECT_EQ(record->Find("m", "t1"), (PublishEntry{"m", "t1", Me(), 2, "A"})) << "kept on disk with the instance that answered it";
}

// No coordinator change: sent once (the common case costs nothing more).
TEST_F(PublishRecordCallsTest, AnOkOfTheSameCoordinatorIsNotSentAgain) {
  ASSERT_NO_FATAL_FAILURE(AddTrainer("t1"));
  PublishRecord* record = AttachRecord();
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("t1");
  req.set_version(3);
  req.set_timeout_ms(10000);
  pb::PublishResponse resp;
  ASSERT_TRUE(calls_->Publish(req, &resp).ok());
  EXPECT_EQ(coordinator_.publishes(), (std::vector<std::string>{"t1 v3@A"}));
  EXPECT_EQ(ReportedAtReJoin("t1"), 3u);
  EXPECT_EQ(record->Find("m", "t1"), (PublishEntry{"m", "t1", Me(), 3, "A"})) << "kept before the trainer hears OK";
}

// A trainer's node that restarted: the trainer's process registering again inherits the publish
// the node kept on disk - told to a coordinator other than the one that answered it
// (JoinWorkerRequest.published_version) and reported by the node's later re-joins - while another
// process under the same worker id does not (its entry is dropped).
TEST_F(PublishRecordCallsTest, ARegisteringTrainerProcessInheritsThePublishTheNodeKept) {
  PublishRecord* record = AttachRecord();
  ASSERT_NE(record, nullptr);
  const std::string process = Me();
  ASSERT_FALSE(process.empty());
  ASSERT_TRUE(record->Note({"m", "t7", process, 5, "X"}).ok());  // answered by a coordinator before A
  ASSERT_TRUE(record->Note({"m", "t8", process, 6, "A"}).ok());  // answered by A itself
  ASSERT_TRUE(record->Note({"m", "t9", "1@1", 7, "X"}).ok());    // another process's
  for (const char* id : {"t7", "t8", "t9"}) {
    pb::RegisterWorkerRequest req;
    req.set_model_id("m");
    req.set_worker_id(id);
    req.set_role(pb::ROLE_TRAINER);
    req.set_pid(::getpid());
    pb::RegisterWorkerResponse resp;
    absl::Status s = calls_->RegisterWorker(req, &resp, absl::Seconds(10));
    ASSERT_TRUE(s.ok()) << id << ": " << s;
  }
  EXPECT_EQ(coordinator_.joins(), (std::vector<std::string>{"t7 published 5", "t8 published 0", "t9 published 0"}))
      << "told only to a coordinator that did not answer it";
  EXPECT_EQ(ReportedAtReJoin("t7"), 5u);
  EXPECT_EQ(ReportedAtReJoin("t8"), 6u);
  EXPECT_EQ(ReportedAtReJoin("t9"), 0u);
  EXPECT_FALSE(record->Find("m", "t9").has_value()) << "no process inherits another's record";
  EXPECT_TRUE(record->Find("m", "t7").has_value());
}

}  // namespace
}  // namespace wb::daemon::node
