#include "proto/grpc_retry.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "gtest/gtest.h"
#include "grpcpp/support/status.h"
#include "proto/grpc_status.h"

namespace wb {
namespace {

// Time moves only when the code under test sleeps: the backoff is observed exactly.
class SteppingClock : public Clock {
 public:
  absl::Time Now() const override { return now_; }
  void SleepUntil(absl::Time deadline) override {
    sleeps_.push_back(deadline - now_);
    now_ = std::max(now_, deadline);
  }
  absl::Time now_ = absl::UnixEpoch();
  std::vector<absl::Duration> sleeps_;
};

absl::Status Busy() {
  // What the client sees: gRPC's own refusal passed through the one conversion point.
  return FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "Server Threadpool Exhausted"));
}

TEST(GrpcRetryTest, RecognisesOnlyGrpcsOwnThreadPoolRefusal) {
  EXPECT_TRUE(IsServerThreadpoolExhausted(Busy()));
  // The daemons' own refusals keep their answer: a blocked-call limit is not retried.
  EXPECT_FALSE(IsServerThreadpoolExhausted(absl::ResourceExhaustedError("400 blocked calls (limit 400)")));
  EXPECT_FALSE(IsServerThreadpoolExhausted(absl::UnavailableError("Server Threadpool Exhausted")));
  EXPECT_FALSE(IsServerThreadpoolExhausted(absl::OkStatus()));
}

TEST(GrpcRetryTest, SendsAgainWithGrowingBackoffUntilTheServerHasAThread) {
  SteppingClock clock;
  int calls = 0, tries = 0;
  absl::Status s = CallWhileServerBusy(&clock, clock.Now() + absl::Seconds(10), [&] {
    return ++calls <= 8 ? Busy() : absl::OkStatus();
  }, &tries);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, 9);
  EXPECT_EQ(tries, 9);
  const std::vector<absl::Duration> want = {absl::Milliseconds(2),  absl::Milliseconds(4),  absl::Milliseconds(8),
                                            absl::Milliseconds(16), absl::Milliseconds(32), absl::Milliseconds(64),
                                            absl::Milliseconds(100), absl::Milliseconds(100)};
  EXPECT_EQ(clock.sleeps_, want);
}

TEST(GrpcRetryTest, GivesUpWithTheRefusalWhenTheNextTryWouldPassTheDeadline) {
  SteppingClock clock;
  const absl::Time deadline = clock.Now() + absl::Milliseconds(50);
  int calls = 0;
  absl::Status s = CallWhileServerBusy(&clock, deadline, [&] {
    ++calls;
    return Busy();
  });
  EXPECT_TRUE(IsServerThreadpoolExhausted(s)) << s;
  // Tries at 0, 2, 6, 14, 30 ms; the next (62 ms) would start past the 50 ms deadline.
  EXPECT_EQ(calls, 5);
  EXPECT_LE(clock.Now(), deadline);
}

TEST(GrpcRetryTest, EveryOtherAnswerIsReturnedAtOnce) {
  SteppingClock clock;
  for (const absl::Status& answer : {absl::OkStatus(), absl::ResourceExhaustedError("limit 400"),
                                     absl::UnavailableError("gone"), absl::DeadlineExceededError("late")}) {
    int calls = 0;
    absl::Status s = CallWhileServerBusy(&clock, clock.Now() + absl::Seconds(10), [&] {
      ++calls;
      return answer;
    });
    EXPECT_EQ(s, answer);
    EXPECT_EQ(calls, 1) << answer;
  }
  EXPECT_TRUE(clock.sleeps_.empty());
}

}  // namespace
}  // namespace wb
