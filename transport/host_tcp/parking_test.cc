// host_tcp's parking table on socketpairs: a Connect's round takes only its own set, and every
// bound (park size, rounds per instance, timeout, hung-up dialers) holds per (instance, round).
#include "transport/host_tcp/parking.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace wb::transport {
namespace {

// Socketpairs: the table gets one end of each (as it would an accepted connection); the test keeps
// the other, to see whether the table closed its end or to hang up as a dialer would.
class Sockets {
 public:
  ~Sockets() {
    for (int fd : ours_) close(fd);
  }
  // Returns the end for the table; remembers ours under the same index.
  int Make() {
    int fd[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd), 0);
    fcntl(fd[1], F_SETFL, O_NONBLOCK);
    ours_.push_back(fd[1]);
    theirs_.push_back(fd[0]);
    return fd[0];
  }
  // Whether the table's end of pair i was closed (our end reads EOF).
  bool Closed(size_t i) const {
    char c;
    return read(ours_[i], &c, 1) == 0;
  }
  void HangUp(size_t i) {
    close(ours_[i]);
    ours_[i] = -1;
  }
  int table_end(size_t i) const { return theirs_[i]; }

 private:
  std::vector<int> ours_, theirs_;
};

ParkingTable::Limits SmallLimits() {
  ParkingTable::Limits l;
  l.max_connections = 8;
  l.max_rounds_per_instance = 2;
  l.timeout = absl::Seconds(60);
  return l;
}

// Parks a whole set of `total` streams for `key` at `now`; returns the sockets' indexes.
std::vector<size_t> ParkSet(ParkingTable& t, Sockets& s, const ParkingTable::Key& key, int total, absl::Time now,
                            size_t* next) {
  std::vector<size_t> idx;
  for (int i = 0; i < total; ++i) {
    bool reserved = false;
    EXPECT_TRUE(t.Admit(key, now, &reserved));
    t.Park(key, static_cast<uint32_t>(i), total, s.Make(), now);
    if (reserved) t.Unreserve();
    idx.push_back((*next)++);
  }
  return idx;
}

// The defect this table fixes: a Connect of round A still waiting (abandoned by its caller) took
// the set the dialer made for round B. Keyed by round, each Connect sees only its own set.
TEST(ParkingTableTest, AConnectTakesOnlyTheSetOfItsOwnRound) {
  ParkingTable t(SmallLimits());
  Sockets s;
  size_t next = 0;
  const absl::Time now = absl::Now();
  t.Await({"x", "round A"});
  t.Await({"x", "round B"});
  const std::vector<size_t> b = ParkSet(t, s, {"x", "round B"}, 3, now, &next);
  EXPECT_FALSE(t.Ready({"x", "round A"})) << "round A's Connect would take round B's connections";
  EXPECT_TRUE(t.Take({"x", "round A"}).empty());
  ASSERT_TRUE(t.Ready({"x", "round B"}));
  const std::vector<int> fds = t.Take({"x", "round B"});
  ASSERT_EQ(fds.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(fds[i], s.table_end(b[i])) << "stream order";
  EXPECT_EQ(t.counters().parked, 0);
  for (int fd : fds) close(fd);
  // The empty round is a round like any other: it matches only itself.
  ParkSet(t, s, {"x", ""}, 2, now, &next);
  EXPECT_FALSE(t.Ready({"x", "round A"}));
  EXPECT_TRUE(t.Ready({"x", ""}));
  t.Unawait({"x", "round A"});
  t.Unawait({"x", "round B"});
}

TEST(ParkingTableTest, AFullParkRefusesUnlessAConnectWaitsForThatRound) {
  ParkingTable t(SmallLimits());  // 8 connections
  Sockets s;
  size_t next = 0;
  const absl::Time now = absl::Now();
  for (int i = 0; i < 4; ++i) ParkSet(t, s, {"junk" + std::to_string(i), "r"}, 2, now, &next);
  EXPECT_EQ(t.counters().parked, 8);
  bool reserved = true;
  EXPECT_FALSE(t.Admit({"x", "B"}, now, &reserved));
  EXPECT_FALSE(reserved);
  EXPECT_EQ(t.counters().refused, 1);
  EXPECT_EQ(t.last_refused_instance(), "x");
  // A Connect waiting for round A of x does not open the park to x's round B.
  t.Await({"x", "A"});
  EXPECT_FALSE(t.Admit({"x", "B"}, now, &reserved));
  EXPECT_TRUE(t.Admit({"x", "A"}, now, &reserved));
  EXPECT_FALSE(reserved) << "an awaited round takes no place in the park";
  t.Unawait({"x", "A"});
  // Reservations count against the bound until given back.
  ParkingTable u(SmallLimits());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(u.Admit({"y", "r"}, now, &reserved)) << i;
  EXPECT_FALSE(u.Admit({"y", "r"}, now, &reserved));
  u.Unreserve();
  EXPECT_TRUE(u.Admit({"y", "r"}, now, &reserved));
}

TEST(ParkingTableTest, UnawaitedSetsExpirePerRound) {
  ParkingTable t(SmallLimits());
  Sockets s;
  size_t next = 0;
  const absl::Time t0 = absl::Now();
  const std::vector<size_t> a = ParkSet(t, s, {"x", "A"}, 2, t0, &next);
  const std::vector<size_t> b = ParkSet(t, s, {"x", "B"}, 2, t0, &next);
  t.Await({"x", "B"});
  t.Expire(t0 + absl::Seconds(61));
  EXPECT_EQ(t.counters().expired, 2);
  for (size_t i : a) EXPECT_TRUE(s.Closed(i));
  for (size_t i : b) EXPECT_FALSE(s.Closed(i)) << "a set a Connect waits for expired";
  EXPECT_TRUE(t.Ready({"x", "B"}));
  t.Unawait({"x", "B"});
}

TEST(ParkingTableTest, PastTheRoundsPerInstanceTheOldestUnawaitedRoundIsClosed) {
  ParkingTable t(SmallLimits());  // 2 rounds per instance
  Sockets s;
  size_t next = 0;
  const absl::Time t0 = absl::Now();
  const std::vector<size_t> r1 = ParkSet(t, s, {"x", "1"}, 1, t0, &next);
  const std::vector<size_t> r2 = ParkSet(t, s, {"x", "2"}, 1, t0 + absl::Seconds(1), &next);
  t.Await({"x", "0"});  // awaited rounds are not counted and not closed
  const std::vector<size_t> r0 = ParkSet(t, s, {"x", "0"}, 1, t0, &next);
  const std::vector<size_t> y = ParkSet(t, s, {"y", "1"}, 1, t0, &next);  // another instance: its own count
  EXPECT_EQ(t.counters().superseded, 0);
  const std::vector<size_t> r3 = ParkSet(t, s, {"x", "3"}, 1, t0 + absl::Seconds(2), &next);
  EXPECT_EQ(t.counters().superseded, 1);
  EXPECT_TRUE(s.Closed(r1[0])) << "the oldest unawaited round of x stays";
  for (size_t i : {r0[0], r2[0], r3[0], y[0]}) EXPECT_FALSE(s.Closed(i)) << i;
  EXPECT_EQ(t.counters().parked, 4);
  std::set<std::string> in_use;
  t.InstancesInUse(in_use);
  EXPECT_EQ(in_use, (std::set<std::string>{"x", "y"}));
  size_t more = 0;
  const auto others = t.OtherRounds("x", "0", 1, &more);
  ASSERT_EQ(others.size(), 1u);
  EXPECT_EQ(others[0].first, "2");
  EXPECT_EQ(more, 1u);
  t.Unawait({"x", "0"});
}

TEST(ParkingTableTest, ReadyDropsConnectionsTheDialerClosedAndARedialReplaces) {
  ParkingTable t(SmallLimits());
  Sockets s;
  size_t next = 0;
  const absl::Time now = absl::Now();
  const std::vector<size_t> a = ParkSet(t, s, {"x", "A"}, 2, now, &next);
  s.HangUp(a[1]);
  EXPECT_FALSE(t.Ready({"x", "A"}));
  EXPECT_EQ(t.counters().hung_up, 1);
  EXPECT_EQ(t.counters().parked, 1);
  // Stream 0 again (a redial) replaces the parked one, stream 1 completes the set.
  t.Park({"x", "A"}, 0, 2, s.Make(), now);
  EXPECT_TRUE(s.Closed(a[0])) << "the replaced connection stays open";
  t.Park({"x", "A"}, 1, 2, s.Make(), now);
  EXPECT_EQ(t.counters().parked, 2);
  EXPECT_TRUE(t.Ready({"x", "A"}));
  t.CloseAll();
  EXPECT_EQ(t.counters().parked, 0);
}

}  // namespace
}  // namespace wb::transport
