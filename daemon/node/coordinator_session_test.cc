// CoordinatorSession on simulated time (FakeClock) against FakeCoordinatorClient: heartbeat
// cadence and timeouts from the lease, re-registration and re-join after a coordinator restart or
// a lost lease, and the bounds of AwaitCoordinatorChange. The session's threads are real; each
// step waits (bounded in real time) for the fake to see the call the simulated time made due.

#include "daemon/node/coordinator_session.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "daemon/node/fake_coordinator_client.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kBeat = absl::Milliseconds(500);
constexpr absl::Duration kRealWait = absl::Seconds(20);  // bounds each test step in real time

class SessionTest : public ::testing::Test {
 protected:
  void StartSession() {
    CoordinatorSession::Options o;
    o.node_id = "n0";
    o.client = &fake_;
    o.clock = &clock_;
    o.heartbeat = kBeat;
    o.registration.set_node_id("n0");
    o.rejoin = [this](const std::string& reason) {
      absl::MutexLock l(&mu_);
      rejoins_.push_back(reason);
    };
    o.tick = [this] {
      absl::MutexLock l(&mu_);
      ticks_ += 1;
    };
    session_ = std::make_unique<CoordinatorSession>(std::move(o));
    ASSERT_TRUE(session_->Start().ok());
  }
  std::vector<std::string> rejoins() {
    absl::MutexLock l(&mu_);
    return rejoins_;
  }

  FakeClock clock_;
  FakeCoordinatorClient fake_{&clock_};
  absl::Mutex mu_;
  std::vector<std::string> rejoins_ ABSL_GUARDED_BY(mu_);
  int ticks_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<CoordinatorSession> session_;
};

TEST_F(SessionTest, BeatsAtAFixedRateWithATimeoutFromTheLease) {
  fake_.SetLeaseMs(9000);
  const absl::Time t0 = clock_.Now();
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  for (size_t i = 2; i <= 8; ++i) {
    clock_.Advance(kBeat);
    ASSERT_TRUE(fake_.AwaitBeats(i, kRealWait)) << "beat " << i;
  }
  std::vector<FakeCoordinatorClient::Beat> beats = fake_.beats();
  ASSERT_EQ(beats.size(), 8u);  // one per period: time did not move between the steps
  for (size_t i = 0; i < beats.size(); ++i) {
    EXPECT_EQ(beats[i].at, t0 + kBeat * static_cast<int64_t>(i)) << "beat " << i;
    EXPECT_TRUE(beats[i].ok);
    EXPECT_EQ(beats[i].request.node_id(), "n0");
    // Late only once the lease is in danger: a third of the 9 s lease, not the 500 ms period.
    EXPECT_EQ(beats[i].timeout, absl::Seconds(3)) << "beat " << i;
  }
  EXPECT_EQ(session_->lease(), absl::Seconds(9));
  // A lease the coordinator changes in its heartbeat answers sets the next beats' timeouts.
  fake_.SetLeaseMs(30000);
  clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(9, kRealWait));
  clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(10, kRealWait));
  EXPECT_EQ(fake_.beats().back().timeout, absl::Seconds(10));
  EXPECT_EQ(fake_.registrations(), 1);
  EXPECT_TRUE(rejoins().empty());
}

TEST_F(SessionTest, ReportsProgressUntilTheVersionIsGone) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  auto bytes = std::make_shared<std::atomic<uint64_t>>(1234);
  session_->TrackProgress("m", 7, bytes);
  clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(2, kRealWait));
  pb::HeartbeatRequest req = fake_.beats().back().request;
  ASSERT_EQ(req.progress_size(), 1);
  EXPECT_EQ(req.progress(0).model_id(), "m");
  EXPECT_EQ(req.progress(0).version(), 7u);
  EXPECT_EQ(req.progress(0).bytes_done(), 1234u);
  bytes.reset();
  clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(3, kRealWait));
  EXPECT_EQ(fake_.beats().back().request.progress_size(), 0);
}

TEST_F(SessionTest, ReRegistersAndRejoinsAfterTheCoordinatorRestarts) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  const uint64_t session0 = session_->session();
  const std::string instance0 = session_->coordinator_instance();
  fake_.Restart();
  clock_.Advance(kBeat);  // the next beat finds the node unknown: the control thread registers again
  std::optional<std::string> change = session_->AwaitCoordinatorChange(session0, clock_.Now() + absl::Seconds(5));
  ASSERT_TRUE(change.has_value());
  EXPECT_NE(change->find("the coordinator restarted (instance " + instance0 + " -> " + fake_.instance() + ")"), std::string::npos) << *change;
  EXPECT_EQ(fake_.registrations(), 2);
  EXPECT_EQ(session_->session(), session0 + 1);
  ASSERT_EQ(rejoins().size(), 1u);
  EXPECT_EQ(rejoins()[0], *change);
  EXPECT_TRUE(session_->AwaitRegistered(clock_.Now()));
  // Beats go on with the new incarnation, accepted by the new instance. The re-join kicks an extra
  // beat (the schedule stays), and whether it was sent before `n` was read is a race: two periods
  // leave room for either.
  const size_t n = fake_.beats().size();
  clock_.Advance(2 * kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(n + 1, kRealWait));
  EXPECT_TRUE(fake_.beats().back().ok);
}

TEST_F(SessionTest, ReRegistersAfterALostLeaseAndSaysSo) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  const uint64_t session0 = session_->session();
  fake_.ForgetNode("n0");
  clock_.Advance(kBeat);
  std::optional<std::string> change = session_->AwaitCoordinatorChange(session0, clock_.Now() + absl::Seconds(5));
  ASSERT_TRUE(change.has_value());
  EXPECT_EQ(*change, "node n0 lost its lease at the coordinator and registered again");
}

TEST_F(SessionTest, AwaitCoordinatorChangeAnswersNoChangeAfterTwoGoodBeats) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  const uint64_t session0 = session_->session();
  absl::Notification done;
  std::optional<std::string> change = "not answered";
  std::thread waiter([&] {
    change = session_->AwaitCoordinatorChange(session0, clock_.Now() + absl::Seconds(60));
    done.Notify();
  });
  // The wait kicks a heartbeat at once (no time passes), an extra beat; the answer needs one more
  // good beat after it.
  ASSERT_TRUE(fake_.AwaitBeats(2, kRealWait));
  EXPECT_EQ(fake_.beats()[1].at, fake_.beats()[0].at);
  // Whether the first beat's success was counted before the waiter took its baseline is a race
  // (the fake records a beat when it is sent, the session counts it when the answer is back), so
  // the answer comes one or two periods later; it must be "no change" either way.
  clock_.Advance(kBeat);
  clock_.Advance(kBeat);
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(kRealWait));
  waiter.join();
  EXPECT_FALSE(change.has_value());
}

// Kicked beats (every failing worker call kicks one through AwaitCoordinatorChange) are extra:
// they must not push the fixed-rate schedule back. Before, each kicked beat moved the next regular
// beat one period later, so a burst of failing worker calls put it tens of seconds (a long burst:
// hours) ahead; once the burst stopped the node sent no beat, lost its lease, and, with no beat to
// be told so, re-registered only when the schedule came round (hostile probe: 21-43 s out of the
// cluster after 20 s of failing calls, its workers dropped, RegisterWorker "node n0 is not
// registered").
TEST_F(SessionTest, KickedBeatsDoNotPushTheRegularBeatsBack) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  const uint64_t session0 = session_->session();
  for (size_t i = 2; i <= 21; ++i) {  // 20 kicks, no simulated time passing
    EXPECT_FALSE(session_->AwaitCoordinatorChange(session0, clock_.Now()).has_value());
    ASSERT_TRUE(fake_.AwaitBeats(i, kRealWait)) << "kicked beat " << i;
  }
  const size_t n = fake_.beats().size();
  clock_.Advance(kBeat);  // the regular beat is due one period after the first
  ASSERT_TRUE(fake_.AwaitBeats(n + 1, absl::Seconds(5))) << "no regular beat one period after 20 kicked beats";
  EXPECT_EQ(fake_.beats().back().at, fake_.beats().front().at + kBeat);
  clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(n + 2, kRealWait));
}

TEST_F(SessionTest, AwaitCoordinatorChangeIsBoundedByItsDeadlineWhenTheCoordinatorIsDown) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  EXPECT_FALSE(session_->UnreachableSince().has_value());
  fake_.SetReachable(false);
  const uint64_t session0 = session_->session();
  const absl::Time deadline = clock_.Now() + absl::Seconds(2);
  absl::Notification done;
  std::optional<std::string> change = "not answered";
  std::thread waiter([&] {
    change = session_->AwaitCoordinatorChange(session0, deadline);
    done.Notify();
  });
  ASSERT_TRUE(fake_.AwaitBeats(2, kRealWait));  // the kicked beat, failed
  EXPECT_FALSE(fake_.beats()[1].ok);
  // Simulated time short of the deadline (1.5 s of 2 s): still waiting, failed beats go on.
  for (int i = 0; i < 3; ++i) clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(4, kRealWait));
  EXPECT_FALSE(done.HasBeenNotified());
  // Since the first failed beat (named by a held worker call that gives up); beats run one after
  // another, so the fourth was sent after the second's answer was taken in.
  EXPECT_EQ(session_->UnreachableSince(), std::optional<absl::Time>(fake_.beats()[1].at));
  clock_.Advance(kBeat);  // reaches the deadline
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(kRealWait));
  waiter.join();
  EXPECT_FALSE(change.has_value());
  EXPECT_EQ(fake_.registrations(), 1);  // an outage is not a lost session: no re-registration
}

// A worker call held while the coordinator is down (WorkerCalls::ForwardHeld, "BeginUpdate") waits
// here: the restarted coordinator is found by the next beat (NOT_FOUND), the node registers again
// and re-joins, and the wait answers the restart well before its deadline.
TEST_F(SessionTest, AwaitCoordinatorChangeStartedWhileTheCoordinatorIsDownAnswersItsRestart) {
  StartSession();
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  fake_.SetReachable(false);
  const uint64_t session0 = session_->session();
  const absl::Time deadline = clock_.Now() + absl::Seconds(10);
  absl::Notification done;
  std::optional<std::string> change;
  std::thread waiter([&] {
    change = session_->AwaitCoordinatorChange(session0, deadline);
    done.Notify();
  });
  ASSERT_TRUE(fake_.AwaitBeats(2, kRealWait));  // the kicked beat, failed: the coordinator is down
  EXPECT_FALSE(fake_.beats()[1].ok);
  clock_.Advance(kBeat);
  ASSERT_TRUE(fake_.AwaitBeats(3, kRealWait));
  EXPECT_FALSE(done.HasBeenNotified());
  fake_.Restart();  // back as a new process, 1 s after it went down
  fake_.SetReachable(true);
  clock_.Advance(kBeat);
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(kRealWait));
  waiter.join();
  ASSERT_TRUE(change.has_value());
  EXPECT_NE(change->find("the coordinator restarted"), std::string::npos) << *change;
  EXPECT_LT(clock_.Now(), deadline);
  EXPECT_EQ(session_->session(), session0 + 1);
  EXPECT_TRUE(session_->AwaitRegistered(clock_.Now()));
  EXPECT_FALSE(session_->UnreachableSince().has_value()) << "the restarted coordinator answered";
}

TEST_F(SessionTest, StopEndsWaits) {
  StartSession();
  EXPECT_TRUE(session_->AwaitRegistered(clock_.Now()));
  // The first beat is sent before the waiter kicks one (else the two may be one beat).
  ASSERT_TRUE(fake_.AwaitBeats(1, kRealWait));
  fake_.SetReachable(false);
  absl::Notification done;
  std::optional<std::string> change = "not answered";
  std::thread waiter([&] {
    change = session_->AwaitCoordinatorChange(session_->session(), clock_.Now() + absl::Hours(1));
    done.Notify();
  });
  ASSERT_TRUE(fake_.AwaitBeats(2, kRealWait));  // the waiter kicked a beat: it is waiting
  session_->Stop();  // returns at once, not after an hour of simulated time
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(kRealWait));
  waiter.join();
  EXPECT_FALSE(change.has_value());
  EXPECT_FALSE(session_->AwaitRegistered(clock_.Now() + absl::Hours(1)));
}

TEST_F(SessionTest, StartFailsWithTheCoordinatorsAnswer) {
  fake_.SetReachable(false);
  CoordinatorSession::Options o;
  o.node_id = "n0";
  o.client = &fake_;
  o.clock = &clock_;
  CoordinatorSession s(std::move(o));
  absl::Status st = s.Start();
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
}

}  // namespace
}  // namespace wb::daemon
