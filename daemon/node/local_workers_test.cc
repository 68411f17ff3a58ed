#include "daemon/node/local_workers.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "base/shm_segment.h"
#include "gtest/gtest.h"
#include "transport/config.h"
#include "transport/host_shm/host_shm.h"

namespace wb::daemon {
namespace {

using Key = LocalWorkers::WorkerKey;

class LocalWorkersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    transport::TransportConfig tc;
    t_ = transport::NewHostShmTransport(tc);
    ASSERT_NE(t_, nullptr);
    copier_ = std::make_unique<LiveCopier>("n0", t_.get(), [this](const std::string& label) {
      if (label == hold_label_) {
        // A copy held midway until the test releases it (no sleeps: notifications both ways).
        held_.Notify();
        release_.WaitForNotification();
      }
      return label == fail_label_ ? absl::UnavailableError("injected") : absl::OkStatus();
    });
    LocalWorkers::Options o;
    o.node_id = "n0";
    o.clock = &clock_;
    o.copier = copier_.get();
    o.live_copy_timeout = absl::Seconds(30);
    workers_ = std::make_unique<LocalWorkers>(o);
    inv_ = std::make_shared<planner::Inventory>();
    inv_->tensors = {{"a", {64, 64}, planner::DType::kF32}};
    for (int k = 0; k < 2; ++k) {
      planner::Piece p;
      p.tensor = 0;
      p.box = {{32 * k, 0}, {32 * (k + 1), 64}};
      p.offset_bytes = 32 * 64 * 4 * k;
      p.strides = {64, 1};
      layout_.pieces.push_back(p);
    }
    layout_.buffers = {{64 * 64 * 4}};
  }

  // A sync or async rollout `id` of model m with one host buffer of the layout's size.
  void AddRollout(const std::string& id, pb::Mode mode) {
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = planner::Role::kRollout;
    w.mode = mode;
    workers_->Add({"m", id}, std::move(w), std::nullopt);
    auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("lw"), 64 * 64 * 4);
    ASSERT_TRUE(seg.ok()) << seg.status();
    std::vector<std::shared_ptr<transport::ShmSegment>> buffers = {std::make_shared<transport::ShmSegment>(std::move(*seg))};
    ASSERT_TRUE(workers_->AttachLayout({"m", id}, buffers, {nullptr}, pb::SubmitLayoutRequest(), pb::ResolvedLayout()).ok());
  }
  std::shared_ptr<StagedBytes> Staging(uint8_t fill) {
    auto b = std::make_shared<StagedBytes>(1);
    (*b)[0].host.assign(64 * 64 * 4, fill);
    return b;
  }
  int64_t LiveBytesEqual(const Key& key, uint8_t fill) {
    auto v = workers_->Get(key);
    const auto& seg = v->worker.buffers[0];
    const uint8_t* p = static_cast<const uint8_t*>(seg->data());
    int64_t n = 0;
    for (int64_t i = 0; i < seg->size(); ++i) n += p[i] == fill;
    return n;
  }
  // The live copies a commit of `version` asks for, completed with the layout (NodeDaemon's part).
  std::vector<LocalWorkers::LiveJob> CommitJobs(uint64_t version, const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming) {
    std::vector<LocalWorkers::LiveJob> jobs = workers_->Commit("m", version, incoming, {});
    for (auto& j : jobs) {
      j.layout = layout_;
      j.inventory = inv_;
      j.label = "commit " + j.worker;
    }
    return jobs;
  }

  // The one live-copy job of `version` into r0 from `staging`, labelled `label`.
  std::vector<LocalWorkers::LiveJob> OneJob(uint64_t version, std::shared_ptr<StagedBytes> staging, const std::string& label) {
    std::vector<LocalWorkers::LiveJob> jobs(1);
    jobs[0].model = "m";
    jobs[0].worker = "r0";
    jobs[0].version = version;
    jobs[0].staging = std::move(staging);
    jobs[0].live = LiveBuffers{workers_->Get({"m", "r0"})->worker.buffers, {nullptr}};
    jobs[0].layout = layout_;
    jobs[0].inventory = inv_;
    jobs[0].label = label;
    return jobs;
  }
  // The worker's live state as a status answer names it (whole / copying / torn).
  std::string LocalStatusOf(const Key& key) {
    pb::StatusResponse resp;
    pb::WorkerStatus* ws = resp.add_workers();
    ws->set_node_id("n0");
    ws->set_model_id(key.first);
    ws->set_worker_id(key.second);
    workers_->AddLiveState(&resp);
    return resp.workers(0).live_state();
  }
  // RunLiveCopies waits for a running copy into the same worker with this deadline on the clock.
  absl::Time CopyWaitDeadline() { return clock_.Now() + absl::Seconds(30); }

  FakeClock clock_;
  std::unique_ptr<transport::Transport> t_;
  std::unique_ptr<LiveCopier> copier_;
  std::string fail_label_;
  std::string hold_label_ = "(none)";  // a copy of this label blocks midway: held_, then release_
  absl::Notification held_, release_;
  std::unique_ptr<LocalWorkers> workers_;
  std::shared_ptr<planner::Inventory> inv_;
  planner::WorkerLayout layout_;
};

TEST_F(LocalWorkersTest, WorkerIdsAreScopedPerModel) {
  LocalWorkers::Worker a;
  a.model_id = "m1";
  a.spec.set_model_id("m1");
  workers_->Add({"m1", "trainer/0"}, a, std::nullopt);
  LocalWorkers::Worker b;
  b.model_id = "m2";
  b.role = planner::Role::kRollout;
  workers_->Add({"m2", "trainer/0"}, b, std::nullopt);
  EXPECT_TRUE(workers_->Has({"m1", "trainer/0"}));
  EXPECT_EQ(workers_->Get({"m2", "trainer/0"})->worker.role, planner::Role::kRollout);
  workers_->Remove({"m2", "trainer/0"});
  EXPECT_FALSE(workers_->Has({"m2", "trainer/0"}));
  EXPECT_TRUE(workers_->Has({"m1", "trainer/0"})) << "another model's worker of the same id must stay";
  std::optional<planner::Role> role;
  auto spec = workers_->SpecOf("m1", "other", &role);
  ASSERT_TRUE(spec.has_value());
  EXPECT_EQ(spec->model_id(), "m1");
  EXPECT_FALSE(role.has_value()) << "the role is only taken from the worker asked about";
  EXPECT_FALSE(workers_->SpecOf("m3", "", &role).has_value());
  ASSERT_EQ(workers_->Joins().size(), 1u);
  EXPECT_EQ(workers_->Joins()[0].key, (Key{"m1", "trainer/0"}));
}

TEST_F(LocalWorkersTest, AJoinWaitsForTheLeaveOfAnExitedProcessOnTheClock) {
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipefd[1]);  // EOF on the read end once the parent closes its write end
    char c;
    [[maybe_unused]] const ssize_t got = ::read(pipefd[0], &c, 1);  // returns at EOF; the result does not matter
    ::_exit(0);
  }
  auto watch = PidWatch::Open(child, "worker r0");
  ASSERT_TRUE(watch.ok()) << watch.status();
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.pid = *watch;
  workers_->Add({"m", "r0"}, w, std::nullopt);
  EXPECT_TRUE(workers_->ReapExited().empty()) << "alive";
  ::close(pipefd[1]);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  ::close(pipefd[0]);
  ASSERT_EQ(workers_->ReapExited(), std::vector<Key>{Key("m", "r0")});
  EXPECT_FALSE(workers_->Has({"m", "r0"}));

  // The leave is still on its way: a join of the same id waits for it, up to its deadline.
  const absl::Time deadline = clock_.Now() + absl::Seconds(10);
  absl::Status joined;
  std::thread t([&] { joined = workers_->BeginJoin({"m", "r0"}, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  clock_.Advance(absl::Seconds(11));
  t.join();
  EXPECT_EQ(joined.code(), absl::StatusCode::kUnavailable) << joined;
  EXPECT_NE(joined.message().find("worker r0 of model m"), std::string::npos) << joined;
  // Another model's r0 is another worker: it does not wait.
  EXPECT_TRUE(workers_->BeginJoin({"m2", "r0"}, clock_.Now()).ok());
  workers_->EndJoin({"m2", "r0"});

  // Once the leave reached the coordinator the join goes ahead.
  const absl::Time deadline2 = clock_.Now() + absl::Seconds(10);
  std::thread t2([&] { joined = workers_->BeginJoin({"m", "r0"}, deadline2); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline2, absl::Now() + absl::Seconds(30)));
  workers_->LeaveDone({"m", "r0"});
  t2.join();
  EXPECT_TRUE(joined.ok()) << joined;
  workers_->EndJoin({"m", "r0"});
}

TEST_F(LocalWorkersTest, ApplyWaitsForTheCommitThenCopiesAndReleasesTheStaging) {
  AddRollout("r0", pb::MODE_ASYNC);
  const Key key{"m", "r0"};
  const absl::Time deadline = clock_.Now() + absl::Seconds(20);
  absl::StatusOr<LocalWorkers::Applicable> got = absl::UnknownError("not run");
  std::thread t([&] { got = workers_->AwaitApplicable(key, 1, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  auto staging = Staging(0xAB);
  // Async: committing needs no live copy; Apply does it.
  EXPECT_TRUE(CommitJobs(1, {{"r0", staging}}).empty());
  t.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->version, 1u);
  EXPECT_EQ(got->staging, staging);
  EXPECT_EQ(got->applied_version, 0u);
  EXPECT_GT(got->copy_Bps, 0);

  std::vector<LocalWorkers::LiveJob> jobs(1);
  jobs[0].model = "m";
  jobs[0].worker = "r0";
  jobs[0].version = got->version;
  jobs[0].staging = got->staging;
  jobs[0].live = got->live;
  jobs[0].layout = layout_;
  jobs[0].inventory = inv_;
  jobs[0].label = "apply r0 v1";
  std::vector<absl::Status> copied = workers_->RunLiveCopies(jobs);
  ASSERT_TRUE(copied[0].ok()) << copied[0];
  EXPECT_EQ(LiveBytesEqual(key, 0xAB), 64 * 64 * 4);
  workers_->MarkApplied(key, 1, staging, /*after_commit=*/false);
  auto v = workers_->Get(key);
  EXPECT_EQ(v->worker.applied_version, 1u);
  EXPECT_EQ(v->worker.committed, nullptr) << "applied staging goes back to the pool";
  // Nothing newer: answers at once with what live weights hold.
  auto again = workers_->AwaitApplicable(key, 0, clock_.Now());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->staging, nullptr);
  EXPECT_EQ(again->applied_version, 1u);
}

TEST_F(LocalWorkersTest, ApplyEndsAtItsDeadlineOnTheClockOrWhenTheVersionIsAborted) {
  AddRollout("r0", pb::MODE_ASYNC);
  const Key key{"m", "r0"};
  absl::Time deadline = clock_.Now() + absl::Seconds(20);
  absl::StatusOr<LocalWorkers::Applicable> got = absl::UnknownError("not run");
  std::thread t([&] { got = workers_->AwaitApplicable(key, 3, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  clock_.Advance(absl::Seconds(21));
  t.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_NE(got.status().message().find("version 3 not committed on node n0"), std::string::npos) << got.status();

  deadline = clock_.Now() + absl::Seconds(20);
  std::thread t2([&] { got = workers_->AwaitApplicable(key, 3, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  workers_->NoteAborted("m", 3, "a peer failed");
  t2.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_NE(got.status().message().find("version 3 aborted: a peer failed"), std::string::npos) << got.status();
  EXPECT_EQ(workers_->AbortReason("m", 3), "a peer failed");

  // A re-join aborts waiters naming its reason.
  deadline = clock_.Now() + absl::Seconds(20);
  std::thread t3([&] { got = workers_->AwaitApplicable(key, 4, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  workers_->NoteRejoin("coordinator restarted");
  t3.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_NE(got.status().message().find("coordinator restarted"), std::string::npos) << got.status();
  EXPECT_EQ(workers_->AwaitApplicable({"m", "nobody"}, 1, clock_.Now()).status().code(), absl::StatusCode::kNotFound);
}

// A catch-up attempt of version 1 ending on this node is no outcome of version 1 here: Apply(1)
// of a rollout not holding it (waiting then, or asking later) is sent to the coordinator
// (ask_coordinator) instead of being answered ABORTED, nothing is recorded as the version's abort,
// and once the node committed version 1 for the rollout the record no longer matters.
TEST_F(LocalWorkersTest, ACatchUpAbortSendsApplyToTheCoordinator) {
  AddRollout("r0", pb::MODE_ASYNC);
  const Key key{"m", "r0"};
  const absl::Time deadline = clock_.Now() + absl::Seconds(20);
  absl::StatusOr<LocalWorkers::Applicable> got = absl::UnknownError("not run");
  std::thread t([&] { got = workers_->AwaitApplicable(key, 1, deadline, /*ask_on_catch_up_abort=*/true); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  workers_->NoteCatchUpAborted("m", 1, "catch-up attempt void");
  t.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->ask_coordinator);
  EXPECT_EQ(got->staging, nullptr);
  EXPECT_FALSE(workers_->AbortReason("m", 1).has_value());
  EXPECT_EQ(workers_->CatchUpAbortReason("m", 1), "catch-up attempt void");
  // A later Apply(1) asks at once; one that does not ask is not ended by the record.
  got = workers_->AwaitApplicable(key, 1, clock_.Now(), /*ask_on_catch_up_abort=*/true);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->ask_coordinator);
  EXPECT_EQ(workers_->AwaitApplicable(key, 1, clock_.Now()).status().code(), absl::StatusCode::kDeadlineExceeded);
  // Committed here (the next attempt): copied as any version.
  auto staging = Staging(0xCD);
  EXPECT_TRUE(CommitJobs(1, {{"r0", staging}}).empty());
  got = workers_->AwaitApplicable(key, 1, clock_.Now(), /*ask_on_catch_up_abort=*/true);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->ask_coordinator);
  EXPECT_EQ(got->version, 1u);
  EXPECT_EQ(got->staging, staging);
}

TEST_F(LocalWorkersTest, SyncCommitCopyFailingMidwayLeavesTheRolloutTorn) {
  AddRollout("r0", pb::MODE_SYNC);
  AddRollout("r1", pb::MODE_SYNC);
  fail_label_ = "commit r1";
  std::vector<LocalWorkers::LiveJob> jobs = CommitJobs(1, {{"r0", Staging(0x11)}, {"r1", Staging(0x22)}});
  ASSERT_EQ(jobs.size(), 2u);
  std::vector<absl::Status> copied = workers_->RunLiveCopies(jobs);
  EXPECT_TRUE(copied[0].ok()) << copied[0];
  EXPECT_EQ(copied[1].code(), absl::StatusCode::kDataLoss) << copied[1];
  EXPECT_NE(copied[1].message().find("r1 of model m"), std::string::npos) << copied[1];
  EXPECT_EQ(LiveBytesEqual({"m", "r0"}, 0x11), 64 * 64 * 4);
  EXPECT_EQ(LiveBytesEqual({"m", "r1"}, 0x22), 32 * 64 * 4) << "half the pieces landed";
  workers_->MarkApplied({"m", "r0"}, 1, jobs[0].staging, /*after_commit=*/true);
  EXPECT_EQ(workers_->Get({"m", "r0"})->worker.committed, nullptr);

  EXPECT_EQ(workers_->TornRollout("m").code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(workers_->TornRollout("other").ok());
  auto r1 = workers_->Get({"m", "r1"});
  EXPECT_EQ(r1->torn.code(), absl::StatusCode::kDataLoss);
  pb::StatusResponse resp;
  for (const char* id : {"r0", "r1"}) {
    pb::WorkerStatus* ws = resp.add_workers();
    ws->set_node_id("n0");
    ws->set_model_id("m");
    ws->set_worker_id(id);
  }
  workers_->AddLiveState(&resp);
  EXPECT_EQ(resp.workers(0).live_state(), "whole");
  EXPECT_EQ(resp.workers(1).live_state(), "torn");
  EXPECT_EQ(resp.workers(1).live_writing_version(), 1u);

  // A retried commit copies again from the committed staging and makes it whole.
  fail_label_.clear();
  std::vector<LocalWorkers::LiveJob> retry = CommitJobs(1, {{"r1", r1->worker.committed}});
  copied = workers_->RunLiveCopies(retry);
  ASSERT_TRUE(copied[0].ok()) << copied[0];
  EXPECT_TRUE(workers_->TornRollout("m").ok());
  EXPECT_EQ(LiveBytesEqual({"m", "r1"}, 0x22), 64 * 64 * 4);
}

TEST_F(LocalWorkersTest, StopEndsWaitsAndRefusesCopies) {
  AddRollout("r0", pb::MODE_ASYNC);
  const absl::Time deadline = clock_.Now() + absl::Seconds(20);
  absl::StatusOr<LocalWorkers::Applicable> got = absl::UnknownError("not run");
  std::thread t([&] { got = workers_->AwaitApplicable({"m", "r0"}, 1, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  workers_->Stop();
  t.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  std::vector<LocalWorkers::LiveJob> jobs = CommitJobs(1, {{"r0", Staging(1)}});
  EXPECT_TRUE(jobs.empty());
}

TEST_F(LocalWorkersTest, SnapshotsPerVersion) {
  LocalWorkers::Worker w;
  w.model_id = "m";
  workers_->Add({"m", "t0"}, w, std::nullopt);
  for (uint64_t v : {1, 2, 3}) workers_->AddSnapshot({"m", "t0"}, v, Staging(static_cast<uint8_t>(v)));
  workers_->DropSnapshot({"m", "t0"}, 3);
  workers_->DropSnapshotsBefore("m", 2);
  auto snaps = workers_->Get({"m", "t0"})->worker.snapshots;
  ASSERT_EQ(snaps.size(), 1u);
  EXPECT_EQ(snaps.begin()->first, 2u);
  workers_->DropSnapshots("m", 2);
  EXPECT_TRUE(workers_->Get({"m", "t0"})->worker.snapshots.empty());
}

// Issue 11 (d): two Apply calls of one worker racing. The copy of version 6 runs; a copy of
// version 5 (an Apply that found 5 before 6 was committed) waits behind it and must then be
// skipped, not write 5 over 6.
TEST_F(LocalWorkersTest, AnOlderCopyThatWaitedBehindANewerOneIsSkipped) {
  AddRollout("r0", pb::MODE_ASYNC);
  const Key key{"m", "r0"};
  auto v5 = Staging(0x05);
  auto v6 = Staging(0x06);
  EXPECT_TRUE(CommitJobs(5, {{"r0", v5}}).empty());
  auto found5 = workers_->AwaitApplicable(key, 5, clock_.Now());
  ASSERT_TRUE(found5.ok()) << found5.status();
  ASSERT_EQ(found5->staging, v5);
  EXPECT_TRUE(CommitJobs(6, {{"r0", v6}}).empty());
  auto found6 = workers_->AwaitApplicable(key, 6, clock_.Now());
  ASSERT_TRUE(found6.ok()) << found6.status();
  ASSERT_EQ(found6->staging, v6);

  hold_label_ = "apply r0 v6";
  std::vector<LocalWorkers::LiveJob> jobs6 = OneJob(6, v6, "apply r0 v6");
  std::vector<LocalWorkers::LiveJob> jobs5 = OneJob(5, v5, "apply r0 v5");
  std::vector<absl::Status> copied6, copied5;
  std::thread a([&] { copied6 = workers_->RunLiveCopies(jobs6); });
  ASSERT_TRUE(held_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  const absl::Time wait_deadline = CopyWaitDeadline();
  std::thread b([&] { copied5 = workers_->RunLiveCopies(jobs5); });
  ASSERT_TRUE(clock_.AwaitWaiter(wait_deadline, absl::Now() + absl::Seconds(30))) << "the copy of 5 waits for the copy of 6";
  release_.Notify();
  a.join();
  b.join();
  ASSERT_TRUE(copied6[0].ok()) << copied6[0];
  ASSERT_TRUE(copied5[0].ok()) << copied5[0];
  EXPECT_FALSE(jobs6[0].skipped);
  EXPECT_EQ(jobs6[0].holds, 6u);
  EXPECT_TRUE(jobs5[0].skipped) << "version 5 was copied over version 6";
  EXPECT_EQ(jobs5[0].holds, 6u);
  EXPECT_EQ(LiveBytesEqual(key, 0x06), 64 * 64 * 4);
  EXPECT_EQ(workers_->Get(key)->worker.applied_version, 6u);
  EXPECT_TRUE(workers_->Get(key)->torn.ok());

  // The version the live weights hold, again: nothing to copy either.
  std::vector<LocalWorkers::LiveJob> again6 = OneJob(6, v6, "apply r0 v6 again");
  EXPECT_TRUE(workers_->RunLiveCopies(again6)[0].ok());
  EXPECT_TRUE(again6[0].skipped);
  // Torn live weights are never skipped: a copy of 7 fails midway (they still count version 6
  // applied), and a copy of 6 makes them whole again.
  fail_label_ = "apply r0 v7";
  std::vector<LocalWorkers::LiveJob> jobs7 = OneJob(7, Staging(0x07), "apply r0 v7");
  EXPECT_EQ(workers_->RunLiveCopies(jobs7)[0].code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(workers_->Get(key)->worker.applied_version, 6u);
  std::vector<LocalWorkers::LiveJob> restore6 = OneJob(6, v6, "apply r0 v6 restore");
  ASSERT_TRUE(workers_->RunLiveCopies(restore6)[0].ok());
  EXPECT_FALSE(restore6[0].skipped);
  EXPECT_EQ(LiveBytesEqual(key, 0x06), 64 * 64 * 4);
  EXPECT_TRUE(workers_->Get(key)->torn.ok());
}

// Issue 11 (b): a sync rollout that resumed (EndUpdate) gets no live copy from a commit: the
// version becomes its committed copy, which a later copy (BeginUpdate, Apply) takes. Paused
// again, commits write its live weights as before.
TEST_F(LocalWorkersTest, AResumedSyncRolloutKeepsTheCommitAsItsCommittedCopy) {
  AddRollout("r0", pb::MODE_SYNC);
  const Key key{"m", "r0"};
  EXPECT_TRUE(workers_->Get(key)->worker.paused) << "paused from registration on: commits write live weights as before EndUpdate";
  auto ended = workers_->EndUpdate(key, clock_.Now());
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->applied_version, 0u);
  auto v1 = Staging(0x11);
  EXPECT_TRUE(CommitJobs(1, {{"r0", v1}}).empty()) << "a commit must not write the live weights of a resumed rollout";
  EXPECT_EQ(LiveBytesEqual(key, 0x11), 0);
  auto view = workers_->Get(key);
  EXPECT_EQ(view->worker.committed, v1);
  EXPECT_EQ(view->worker.committed_version, 1u);
  EXPECT_EQ(view->worker.applied_version, 0u);
  ended = workers_->EndUpdate(key, clock_.Now());
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->committed_version, 1u);
  EXPECT_EQ(ended->applied_version, 0u);
  // What BeginUpdate copies once paused: the committed copy.
  ASSERT_TRUE(workers_->Pause(key));
  auto found = workers_->AwaitApplicable(key, 0, clock_.Now());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->staging, v1);
  EXPECT_EQ(found->version, 1u);
  // Paused: the next commit writes the live weights.
  std::vector<LocalWorkers::LiveJob> jobs = CommitJobs(2, {{"r0", Staging(0x22)}});
  ASSERT_EQ(jobs.size(), 1u);
  ASSERT_TRUE(workers_->RunLiveCopies(jobs)[0].ok());
  EXPECT_EQ(LiveBytesEqual(key, 0x22), 64 * 64 * 4);
  EXPECT_EQ(workers_->Get(key)->worker.applied_version, 2u);
  EXPECT_FALSE(workers_->Pause({"m", "nobody"}));
  EXPECT_EQ(workers_->EndUpdate({"m", "nobody"}, clock_.Now()).status().code(), absl::StatusCode::kNotFound);
}

// A call that began for one registration of r0 (a WaitVersion of the process then registered)
// copies what the node found once its wait ended - by then r0 may be another process (the first
// killed, a new one registered the same id) whose engine reads its live weights: the job carries
// the incarnation its call began with and is refused, nothing written, nothing recorded (sync
// chaos run: a killed rollout's wait, answered when the next version committed, copied it into its
// successor, which had been told the version before). A job of the current registration copies.
TEST_F(LocalWorkersTest, ACopyForAnEarlierRegistrationOfTheWorkerIsRefused) {
  AddRollout("r0", pb::MODE_SYNC);
  const Key key{"m", "r0"};
  const uint64_t first = workers_->Incarnation(key);
  ASSERT_NE(first, 0u);
  EXPECT_EQ(workers_->Incarnation({"m", "nobody"}), 0u);
  AddRollout("r0", pb::MODE_SYNC);  // the same id registered again: another process, new memory
  const uint64_t second = workers_->Incarnation(key);
  ASSERT_NE(second, first);

  std::vector<LocalWorkers::LiveJob> stale = OneJob(2, Staging(0x22), "apply r0 v2");
  stale[0].incarnation = first;
  absl::Status copied = workers_->RunLiveCopies(stale)[0];
  EXPECT_EQ(copied.code(), absl::StatusCode::kAborted) << copied;
  EXPECT_NE(copied.message().find("registered again on node n0"), std::string::npos) << copied;
  EXPECT_TRUE(stale[0].skipped);
  EXPECT_EQ(LiveBytesEqual(key, 0x22), 0) << "a call of the earlier registration wrote the new one's live weights";
  EXPECT_EQ(workers_->Get(key)->worker.applied_version, 0u);
  EXPECT_EQ(LocalStatusOf(key), "whole");

  std::vector<LocalWorkers::LiveJob> own = OneJob(2, Staging(0x22), "apply r0 v2 own");
  own[0].incarnation = second;
  ASSERT_TRUE(workers_->RunLiveCopies(own)[0].ok());
  EXPECT_EQ(LiveBytesEqual(key, 0x22), 64 * 64 * 4);
  EXPECT_EQ(workers_->Get(key)->worker.applied_version, 2u);
}

// WaitVersion resumes a paused sync rollout it answers (a wait for a version committed before
// the pause) on behalf of the registration its call began with: when the id was registered again
// meanwhile (the first process killed, another registered), the new process's pause is not the
// caller's to end - it stays paused, so commits keep writing its live weights and the coordinator
// keeps waiting for its own BeginUpdate.
TEST_F(LocalWorkersTest, AResumeForAnEarlierRegistrationLeavesTheNewOnePaused) {
  AddRollout("r0", pb::MODE_SYNC);
  const Key key{"m", "r0"};
  const uint64_t first = workers_->Incarnation(key);
  AddRollout("r0", pb::MODE_SYNC);
  const uint64_t second = workers_->Incarnation(key);
  ASSERT_NE(first, second);
  ASSERT_TRUE(workers_->Pause(key));
  workers_->NotePausedAt(key, 3);
  EXPECT_FALSE(workers_->PausedAfter(key, 2, first)) << "the earlier registration's call saw the new one's pause";
  EXPECT_TRUE(workers_->PausedAfter(key, 2, second));
  EXPECT_TRUE(workers_->PausedAfter(key, 2));
  auto stale = workers_->EndUpdate(key, clock_.Now(), first);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted) << stale.status();
  EXPECT_NE(stale.status().message().find("registered again"), std::string::npos) << stale.status();
  EXPECT_TRUE(workers_->Get(key)->worker.paused) << "the earlier registration's call resumed the new one";
  EXPECT_TRUE(workers_->PausedAfter(key, 3, second)) << "its pause record was changed";
  auto own = workers_->EndUpdate(key, clock_.Now(), second);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_FALSE(workers_->Get(key)->worker.paused);
}

// The commit chose the rollout while it was paused, then it resumed before the copy started:
// the copy is skipped (nothing written), the staging stays its committed copy, and the commit's
// MarkApplied changes nothing.
TEST_F(LocalWorkersTest, ACommitCopyOfARolloutThatResumedBeforeItStartedIsSkipped) {
  AddRollout("r0", pb::MODE_SYNC);
  const Key key{"m", "r0"};
  auto v1 = Staging(0x11);
  std::vector<LocalWorkers::LiveJob> jobs = CommitJobs(1, {{"r0", v1}});
  ASSERT_EQ(jobs.size(), 1u);
  ASSERT_TRUE(workers_->EndUpdate(key, clock_.Now()).ok());
  std::vector<absl::Status> copied = workers_->RunLiveCopies(jobs);
  ASSERT_TRUE(copied[0].ok()) << copied[0];
  EXPECT_TRUE(jobs[0].skipped);
  EXPECT_EQ(LiveBytesEqual(key, 0x11), 0) << "the live weights of a resumed rollout were written";
  workers_->MarkApplied(key, 1, v1, /*after_commit=*/true);
  auto view = workers_->Get(key);
  EXPECT_EQ(view->worker.applied_version, 0u);
  EXPECT_EQ(view->worker.committed, v1) << "the committed copy must stay for the next BeginUpdate";
}

// Relays at commit into a sync rollout that resumed (EndUpdate) after the commit chose it: the
// relayed pieces go into its own staging, never into its live memory, and that staging (whole now)
// becomes its committed copy, which it copies once paused again. Before: the commit wrote the live
// weights of the resumed rollout (own pieces and relays).
TEST_F(LocalWorkersTest, RelaysAtCommitIntoAResumedRolloutGoIntoItsStaging) {
  AddRollout("r0", pb::MODE_SYNC);
  const Key key{"m", "r0"};
  const int64_t half = 32 * 64 * 4;
  auto own = Staging(0x00);
  std::fill((*own)[0].host.begin(), (*own)[0].host.begin() + half, 0x22);  // piece 0 landed; piece 1 is relayed
  const std::map<std::string, std::shared_ptr<StagedBytes>> incoming = {{"r0", own}, {"src", Staging(0x33)}};
  std::vector<RelayAtCommit> relays(1);
  relays[0].src_worker = "src";
  relays[0].op.shape = {32, 64};
  relays[0].op.element_size = 4;
  relays[0].op.src = RefFor(layout_.pieces[1], layout_.pieces[1].box, 4, {});
  relays[0].op.dst = RefFor(layout_.pieces[1], layout_.pieces[1].box, 4, {});
  std::vector<LocalWorkers::LiveJob> jobs = workers_->Commit("m", 1, {{"r0", own}}, {"r0"});
  ASSERT_EQ(jobs.size(), 1u);
  jobs[0].layout.pieces = {layout_.pieces[0]};  // its own pieces (what CommitJobsLocked leaves)
  jobs[0].layout.buffers = layout_.buffers;
  jobs[0].inventory = inv_;
  jobs[0].label = "commit r0";
  jobs[0].relays = &relays;
  jobs[0].incoming = &incoming;
  ASSERT_TRUE(workers_->EndUpdate(key, clock_.Now()).ok());
  std::vector<absl::Status> copied = workers_->RunLiveCopies(jobs);
  ASSERT_TRUE(copied[0].ok()) << copied[0];
  EXPECT_TRUE(jobs[0].skipped);
  EXPECT_EQ(LiveBytesEqual(key, 0x22) + LiveBytesEqual(key, 0x33), 0) << "the commit wrote the live weights of resumed r0";
  auto view = workers_->Get(key);
  EXPECT_EQ(view->worker.applied_version, 0u);
  ASSERT_EQ(view->worker.committed, own) << "its staging, whole now, must be its committed copy";
  EXPECT_EQ(view->worker.committed_version, 1u);
  EXPECT_EQ(std::count((*own)[0].host.begin() + half, (*own)[0].host.end(), 0x33), half) << "the relayed piece is not in its staging";
  // Paused again (BeginUpdate): the committed copy goes into live weights, whole.
  ASSERT_TRUE(workers_->Pause(key));
  auto found = workers_->AwaitApplicable(key, 0, clock_.Now());
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->staging, own);
  std::vector<LocalWorkers::LiveJob> apply = OneJob(1, own, "apply r0");
  ASSERT_TRUE(workers_->RunLiveCopies(apply)[0].ok());
  EXPECT_EQ(LiveBytesEqual(key, 0x22), half);
  EXPECT_EQ(LiveBytesEqual(key, 0x33), half);
}

// EndUpdate while a commit's copy into the rollout runs: it waits for the copy (bounded by its
// deadline on the clock, then DEADLINE_EXCEEDED naming worker, model, node and version), and
// answers what the live weights hold once it ended.
TEST_F(LocalWorkersTest, EndUpdateWaitsForACopyThatIsRunning) {
  AddRollout("r0", pb::MODE_SYNC);
  const Key key{"m", "r0"};
  hold_label_ = "commit r0";
  std::vector<LocalWorkers::LiveJob> jobs = CommitJobs(1, {{"r0", Staging(0x11)}});
  ASSERT_EQ(jobs.size(), 1u);
  std::vector<absl::Status> copied;
  std::thread a([&] { copied = workers_->RunLiveCopies(jobs); });
  ASSERT_TRUE(held_.WaitForNotificationWithTimeout(absl::Seconds(30)));

  absl::Time deadline = clock_.Now() + absl::Seconds(5);
  absl::StatusOr<LocalWorkers::Ended> ended = absl::UnknownError("not run");
  std::thread b([&] { ended = workers_->EndUpdate(key, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  clock_.Advance(absl::Seconds(6));
  b.join();
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kDeadlineExceeded) << ended.status();
  for (const char* part : {"EndUpdate: worker r0 of model m on node n0", "version 1", "call EndUpdate again"}) {
    EXPECT_NE(ended.status().message().find(part), std::string::npos) << part << " in " << ended.status();
  }

  deadline = clock_.Now() + absl::Seconds(5);
  std::thread c([&] { ended = workers_->EndUpdate(key, deadline); });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  release_.Notify();
  a.join();
  c.join();
  ASSERT_TRUE(copied[0].ok()) << copied[0];
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->applied_version, 1u);
  EXPECT_EQ(LiveBytesEqual(key, 0x11), 64 * 64 * 4);
}

// What a re-join reports of a rollout's canonical shadows: a version committed by a catch-up (the
// sources' quantised bytes) holds none, until a version committed through the plan replaces it;
// a new registration under the id holds nothing of either.
TEST_F(LocalWorkersTest, ARejoinSaysWhetherTheRolloutsVersionCameFromACatchUp) {
  AddRollout("r0", pb::MODE_ASYNC);
  auto without_shadows = [&] {
    std::vector<LocalWorkers::JoinInfo> joins = workers_->Joins();
    EXPECT_EQ(joins.size(), 1u);
    return !joins.empty() && joins[0].holds_without_shadows;
  };
  EXPECT_TRUE(workers_->Commit("m", 1, {{"r0", Staging(1)}}, {}).empty());
  EXPECT_FALSE(without_shadows());
  EXPECT_TRUE(workers_->Commit("m", 2, {{"r0", Staging(2)}}, {}, /*catch_up=*/true).empty());
  EXPECT_TRUE(without_shadows()) << "version 2 came from a catch-up";
  EXPECT_TRUE(workers_->Commit("m", 3, {{"r0", Staging(3)}}, {}).empty());
  EXPECT_FALSE(without_shadows()) << "version 3 came through the plan";
  EXPECT_TRUE(workers_->Commit("m", 4, {{"r0", Staging(4)}}, {}, /*catch_up=*/true).empty());
  AddRollout("r0", pb::MODE_ASYNC);  // a new process under the id
  EXPECT_FALSE(without_shadows());
}

// status.md item 24: after a re-join, Apply(v) of a version this node knows nothing of (no
// execution of it reached the node before the coordinator died, so no abort of it is recorded;
// the Apply came after the re-join, so the re-join did not end its wait) is sent to the
// coordinator at once instead of waiting for a version no coordinator may run. Not before any
// re-join, not for a version the rollout holds or whose abort is recorded, and not at or above a
// version the new session ran here (every number the old coordinator used is below it).
TEST_F(LocalWorkersTest, AfterAReJoinApplyOfAVersionUnknownHereAsksTheCoordinator) {
  AddRollout("r0", pb::MODE_ASYNC);
  const Key key{"m", "r0"};
  EXPECT_TRUE(workers_->Commit("m", 1, {{"r0", Staging(1)}}, {}).empty());
  auto asks = [&](uint64_t want) {
    absl::StatusOr<LocalWorkers::Applicable> got = workers_->AwaitApplicable(key, want, clock_.Now(), true, /*ask_if_unknown_since_rejoin=*/true);
    return got.ok() && got->ask_coordinator && got->unknown_since_rejoin;
  };
  auto waits = [&](uint64_t want) {  // waited locally (to its deadline: now)
    return workers_->AwaitApplicable(key, want, clock_.Now(), true, /*ask_if_unknown_since_rejoin=*/true).status().code() ==
           absl::StatusCode::kDeadlineExceeded;
  };
  EXPECT_TRUE(waits(2)) << "no re-join yet: the next version is awaited here";
  workers_->NoteRejoin("the coordinator restarted (instance A -> B)");
  EXPECT_TRUE(asks(2));
  EXPECT_TRUE(asks(7));
  // The second wait after the coordinator's answer does not ask again.
  EXPECT_EQ(workers_->AwaitApplicable(key, 2, clock_.Now(), /*ask_on_catch_up_abort=*/true).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // Held: answered here.
  absl::StatusOr<LocalWorkers::Applicable> one = workers_->AwaitApplicable(key, 1, clock_.Now(), true, true);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(one->ask_coordinator);
  EXPECT_EQ(one->version, 1u);
  // Its abort recorded here (AbortVersion, or the re-join ended its execution): ABORTED here.
  workers_->NoteAborted("m", 5, "a peer failed");
  EXPECT_EQ(workers_->AwaitApplicable(key, 5, clock_.Now(), true, true).status().code(), absl::StatusCode::kAborted);
  // The new session runs version 4 here: 4 and above are awaited here, below it still asked.
  workers_->NoteSessionVersion("m", 4);
  EXPECT_TRUE(waits(4));
  EXPECT_TRUE(waits(6));
  EXPECT_TRUE(asks(3));
  EXPECT_TRUE(asks(2));
  // Another re-join starts another session: asked again.
  workers_->NoteRejoin("node n0 lost its lease at the coordinator and registered again");
  EXPECT_TRUE(asks(6));
}

// A trainer's publish the coordinator answered (one-step-off / async) is what a re-join reports as
// published (JoinWorkerRequest.published_version), for its registration only.
TEST_F(LocalWorkersTest, ARejoinReportsTheTrainersLastRecordedPublish) {
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kTrainer;
  w.mode = pb::MODE_ONE_STEP_OFF;
  workers_->Add({"m", "t0"}, std::move(w), std::nullopt);
  const uint64_t inc = workers_->Incarnation({"m", "t0"});
  workers_->NotePublished({"m", "t0"}, 3, inc);
  workers_->NotePublished({"m", "t0"}, 2, inc);  // (an older answer arriving late)
  workers_->NotePublished({"m", "t0"}, 9, inc + 1);  // another registration's
  std::vector<LocalWorkers::JoinInfo> joins = workers_->Joins();
  ASSERT_EQ(joins.size(), 1u);
  EXPECT_EQ(joins[0].published_version, 3u);
}

}  // namespace
}  // namespace wb::daemon
