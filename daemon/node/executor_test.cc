// The executor on the in-process fake transport: two "nodes" in one test, each running its own
// ExecPlan of one slice, meeting through a ChannelSetup that pairs them in memory.
#include "daemon/node/executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/testing/exec_rendezvous.h"
#include "transport/config.h"
#include "transport/host_shm/host_shm.h"
#include "transport/testing/fake_transport.h"

namespace wb::daemon::node {
namespace {

using transport::MemoryKind;

// Where two executors meet (descriptors and endpoints through memory).
using Rendezvous = daemon::testing::ExecRendezvous;

constexpr int64_t kElems = 1024;  // tensor 0: [1024] float32

// Trainer t on n0 sends its tensor to rollout r on n1 in two buckets (halves); on n1 rollout r
// relays it on to rollout r2 in bucket 2 (a same-node batch that reads a written region).
class ExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    inv_.tensors.push_back({"t0", {kElems}, planner::DType::kF32});
    slice_.inventory = &inv_;
    slice_.sync = false;
    slice_.num_buckets = 3;
    for (auto [id, node, role] : {std::tuple{"t", "n0", planner::Role::kTrainer}, std::tuple{"r", "n1", planner::Role::kRollout},
                                  std::tuple{"r2", "n1", planner::Role::kRollout}}) {
      slice_.workers.push_back({id, node, role});
      planner::WorkerLayout l;
      l.buffers.push_back({kElems * 4});
      planner::Piece p;
      p.tensor = 0;
      p.box = {{0}, {kElems}};
      p.strides = {1};
      l.pieces.push_back(p);
      slice_.layouts.push_back(l);
      slice_.quantized.push_back(false);
    }
    AddOp(0, 0, 0, 1, 0, kElems / 2);
    AddOp(1, 1, 0, 1, kElems / 2, kElems);
    AddOp(2, 2, 1, 2, 0, kElems);
    for (int n = 0; n < 2; ++n) {
      mem_[n].assign(static_cast<size_t>(kElems * 4), 0);
    }
    relay_.assign(static_cast<size_t>(kElems * 4), 0);
    for (size_t i = 0; i < mem_[0].size(); ++i) mem_[0][i] = static_cast<uint8_t>(i * 7 + 3);
    transport::TransportConfig tc;
    local_ = transport::NewHostShmTransport(tc);
    ASSERT_NE(local_, nullptr);
  }

  void AddOp(uint32_t index, uint32_t bucket, uint32_t src, uint32_t dst, int64_t begin, int64_t end) {
    slice_.ops.push_back(daemon::testing::TestSliceOp(index, bucket, src, dst, 0, {{begin}, {end}}, static_cast<uint64_t>(end - begin) * 4));
  }

  void MakeTransports(int64_t link = 0) {
    for (int n = 0; n < 2; ++n) {
      transport::testing::FakeOptions o;
      o.fabric = &fabric_;
      o.node_id = absl::StrCat("n", n);
      o.kind = "host_tcp";
      o.link_bytes_per_second = link;
      cross_[n] = transport::testing::MakeFakeTransport(o);
      rendezvous_.Add(o.node_id, cross_[n].get());
    }
  }

  struct Outcome {
    absl::Status status;
    ExecResult result;
    std::atomic<uint64_t> bytes{0};
  };

  // Runs both nodes' plans at once.
  void RunBoth(absl::Duration timeout, std::function<void(int node, uint32_t bucket)> before_bucket = nullptr,
               std::function<absl::Status()> aborted = nullptr) {
    std::thread threads[2];
    for (int n = 0; n < 2; ++n) {
      threads[n] = std::thread([&, n] {
        const std::string me = absl::StrCat("n", n);
        std::map<std::string, RegionMemory> mem;
        for (uint32_t w = 0; w < slice_.workers.size(); ++w) {
          if (slice_.workers[w].node_id != me) continue;
          uint8_t* base = w == 2 ? relay_.data() : mem_[n].data();
          mem[RegionKey(w, 0)] = RegionMemory{MemoryKind::kHost, base, kElems * 4, -1, {}};
        }
        ExecOptions o;
        o.label = absl::StrCat("m v1 on ", me);
        o.version = 1;
        o.deadline = absl::Now() + timeout;
        o.bytes_done = &out_[n].bytes;
        if (before_bucket) o.before_bucket = [&, n](uint32_t b) { before_bucket(n, b); };
        o.aborted = aborted;
        if (before_post_) o.before_post = [&, n](uint32_t b) { return before_post_(n, b); };
        if (channel_post_) o.channel_post = [&, n](const std::string& c) { return channel_post_(n, c); };
        if (channel_waited_) o.channel_waited = [&, n](const std::string& c) { channel_waited_(n, c); };
        out_[n].status = rendezvous_.RunNode(slice_, me, mem, local_.get(), cross_[n].get(), o, out_[n].result);
      });
    }
    for (auto& t : threads) t.join();
  }

  planner::Inventory inv_;
  Slice slice_;
  std::vector<uint8_t> mem_[2], relay_;
  transport::testing::FakeFabric fabric_;
  std::unique_ptr<transport::Transport> local_;
  std::unique_ptr<transport::Transport> cross_[2];
  Rendezvous rendezvous_;
  Outcome out_[2];
  std::function<absl::Status(int node, uint32_t bucket)> before_post_;  // ExecOptions::before_post per node
  std::function<absl::Status(int node, const std::string& channel)> channel_post_;  // ExecOptions::channel_post per node
  std::function<void(int node, const std::string& channel)> channel_waited_;
};

// Per node and channel: batches posted, waited for, in flight now (ExecOptions::channel_post /
// channel_waited), as the node daemon counts them for aborts (Versions::AbortChannels).
struct ChannelCounts {
  absl::Mutex mu;
  std::map<std::pair<int, std::string>, int> posted ABSL_GUARDED_BY(mu), waited ABSL_GUARDED_BY(mu), in_flight ABSL_GUARDED_BY(mu);
  int InFlight(int node, const std::string& channel) {
    absl::MutexLock l(&mu);
    return in_flight[{node, channel}];
  }
};

// Every batch on a cross-node channel is counted while in flight: posted -> waited, balanced at the
// end; same-node copies are not (bucket 2 is n1's relay). Bucket 0's batch is still in flight
// when bucket 1 comes up (slow link, pipelined buckets).
TEST_F(ExecutorTest, BatchesOnAChannelAreCountedWhileInFlight) {
  MakeTransports(/*link=*/4000);  // bucket 0 (2 KiB) takes about half a second
  ChannelCounts c;
  channel_post_ = [&](int n, const std::string& chan) {
    absl::MutexLock l(&c.mu);
    ++c.posted[{n, chan}];
    ++c.in_flight[{n, chan}];
    return absl::OkStatus();
  };
  channel_waited_ = [&](int n, const std::string& chan) {
    absl::MutexLock l(&c.mu);
    ++c.waited[{n, chan}];
    --c.in_flight[{n, chan}];
  };
  int in_flight_at_bucket_1[2] = {-1, -1};
  RunBoth(absl::Seconds(10), [&](int node, uint32_t bucket) {
    if (bucket == 1) in_flight_at_bucket_1[node] = c.InFlight(node, node == 0 ? "n1" : "n0");
  });
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  EXPECT_EQ(mem_[1], mem_[0]);
  absl::MutexLock l(&c.mu);
  using Key = std::pair<int, std::string>;
  EXPECT_EQ(c.posted, (std::map<Key, int>{{{0, "n1"}, 2}, {{1, "n0"}, 2}}));
  EXPECT_EQ(c.waited, c.posted);
  EXPECT_EQ(in_flight_at_bucket_1[0], 1);
  EXPECT_EQ(in_flight_at_bucket_1[1], 1);
}

// A post the node refuses (its version was aborted meanwhile) is not made: the version fails with
// the refusal, and what was posted before is still waited for.
TEST_F(ExecutorTest, ARefusedChannelPostFailsTheVersionWithoutPosting) {
  MakeTransports();
  ChannelCounts c;
  channel_post_ = [&](int n, const std::string& chan) -> absl::Status {
    absl::MutexLock l(&c.mu);
    if (n == 0 && c.posted[{n, chan}] == 1) return absl::AbortedError("version 1 aborted: test");
    ++c.posted[{n, chan}];
    return absl::OkStatus();
  };
  channel_waited_ = [&](int n, const std::string& chan) {
    absl::MutexLock l(&c.mu);
    ++c.waited[{n, chan}];
  };
  RunBoth(absl::Seconds(2));
  ASSERT_FALSE(out_[0].status.ok());
  EXPECT_EQ(out_[0].status.code(), absl::StatusCode::kAborted) << out_[0].status;
  EXPECT_NE(out_[0].status.message().find("bucket 1"), std::string::npos) << out_[0].status;
  EXPECT_FALSE(out_[1].status.ok()) << "n1's bucket 1 had no mirror";
  absl::MutexLock l(&c.mu);
  EXPECT_EQ(c.posted[std::make_pair(0, std::string("n1"))], 1);
  EXPECT_EQ(c.waited, c.posted);
}

TEST_F(ExecutorTest, TwoNodesMoveEveryByteExactlyAndCountIt) {
  MakeTransports();
  RunBoth(absl::Seconds(10));
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  EXPECT_EQ(mem_[1], mem_[0]);
  EXPECT_EQ(relay_, mem_[0]);  // the relay read delivered bytes (it waited for buckets 0 and 1)
  EXPECT_EQ(out_[1].bytes.load(), 2u * kElems * 4);  // received over the channel + relayed locally
  EXPECT_EQ(out_[0].bytes.load(), 0u);
  EXPECT_EQ(out_[0].result.links.at("n1").bytes, static_cast<uint64_t>(kElems * 4));
  EXPECT_EQ(out_[1].result.links.at("n0").bytes, static_cast<uint64_t>(kElems * 4));
  EXPECT_EQ(out_[1].result.links.at("n1").bytes, static_cast<uint64_t>(kElems * 4));  // same-node
  EXPECT_EQ(out_[0].result.channels.count("n1"), 1u);
}

TEST_F(ExecutorTest, AFailingBatchFailsTheVersionNamingTheBucketAndLink) {
  MakeTransports();
  fabric_.FailNextBatches(cross_[0]->instance_id(), absl::InternalError("injected"), 1);
  RunBoth(absl::Seconds(10));
  for (int n = 0; n < 2; ++n) {
    ASSERT_FALSE(out_[n].status.ok()) << n;
    EXPECT_NE(out_[n].status.message().find("bucket 0"), std::string::npos) << out_[n].status;
  }
  EXPECT_NE(out_[0].status.message().find("node n0 <-> node n1"), std::string::npos) << out_[0].status;
  EXPECT_EQ(relay_, std::vector<uint8_t>(relay_.size(), 0));  // the relay never ran
}

TEST_F(ExecutorTest, ADeadlineThatExpiresEndsTheVersion) {
  MakeTransports(/*link=*/1000);  // 4 KiB at 1 kB/s: far longer than the deadline
  const absl::Time t0 = absl::Now();
  RunBoth(absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // The side whose deadline passes first cancels its batch (DEADLINE_EXCEEDED); the other may see
  // its peer's cancellation first (UNAVAILABLE): both end, well before the transfer would.
  int deadline_exceeded = 0;
  for (int n = 0; n < 2; ++n) {
    ASSERT_FALSE(out_[n].status.ok()) << n;
    EXPECT_TRUE(out_[n].status.code() == absl::StatusCode::kDeadlineExceeded || out_[n].status.code() == absl::StatusCode::kUnavailable)
        << out_[n].status;
    deadline_exceeded += out_[n].status.code() == absl::StatusCode::kDeadlineExceeded;
  }
  EXPECT_GE(deadline_exceeded, 1);
}

TEST_F(ExecutorTest, APeerVanishingMidVersionFailsUnavailable) {
  MakeTransports(/*link=*/4000);  // bucket 1 (2 KiB) takes about half a second
  RunBoth(absl::Seconds(10), [&](int node, uint32_t bucket) {
    if (node == 1 && bucket == 1) fabric_.Vanish(cross_[0]->instance_id());
  });
  ASSERT_FALSE(out_[1].status.ok());
  EXPECT_EQ(out_[1].status.code(), absl::StatusCode::kUnavailable) << out_[1].status;
  ASSERT_FALSE(out_[0].status.ok());
}

TEST_F(ExecutorTest, AbortStopsBeforeTheNextBucket) {
  MakeTransports();
  std::atomic<bool> abort{false};
  RunBoth(
      absl::Seconds(10), [&](int, uint32_t bucket) { if (bucket == 1) abort = true; },
      [&]() { return abort ? absl::AbortedError("version 1 aborted: test") : absl::OkStatus(); });
  for (int n = 0; n < 2; ++n) {
    ASSERT_FALSE(out_[n].status.ok()) << n;
    EXPECT_EQ(out_[n].status.code(), absl::StatusCode::kAborted) << out_[n].status;
  }
  EXPECT_EQ(relay_, std::vector<uint8_t>(relay_.size(), 0));
}

TEST_F(ExecutorTest, BeforePostRunsOncePerBucketInOrderBeforeItsBytesAreRead) {
  MakeTransports();
  // n0's hook writes bucket b's half of the source only when asked for bucket b (as sender
  // quantisation fills its staging): the receiver gets the hook's bytes only if each bucket was
  // posted after its hook returned.
  std::vector<uint8_t> want(mem_[0].size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<uint8_t>(i * 13 + 1);
  std::fill(mem_[0].begin(), mem_[0].end(), 0);
  absl::Mutex mu;
  std::vector<uint32_t> calls[2];
  before_post_ = [&](int node, uint32_t b) {
    if (node == 0 && b < 2) {
      const size_t half = want.size() / 2;
      std::memcpy(mem_[0].data() + b * half, want.data() + b * half, half);
    }
    absl::MutexLock l(&mu);
    calls[node].push_back(b);
    return absl::OkStatus();
  };
  RunBoth(absl::Seconds(10));
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  EXPECT_EQ(mem_[1], want);
  EXPECT_EQ(relay_, want);
  for (int n = 0; n < 2; ++n) EXPECT_EQ(calls[n], (std::vector<uint32_t>{0, 1, 2})) << n;
}

TEST_F(ExecutorTest, ABeforePostErrorFailsTheVersionWithIt) {
  MakeTransports();
  absl::Mutex mu;
  std::vector<uint32_t> calls[2];
  before_post_ = [&](int node, uint32_t b) {
    absl::MutexLock l(&mu);
    calls[node].push_back(b);
    if (b == 1) return absl::ResourceExhaustedError(absl::StrCat("quantising tensor t0 on node n", node, ": test"));
    return absl::OkStatus();
  };
  RunBoth(absl::Seconds(10));
  for (int n = 0; n < 2; ++n) {
    ASSERT_FALSE(out_[n].status.ok()) << n;
    EXPECT_EQ(out_[n].status.code(), absl::StatusCode::kResourceExhausted) << out_[n].status;
    EXPECT_NE(out_[n].status.message().find(absl::StrCat("quantising tensor t0 on node n", n, ": test")), std::string::npos)
        << out_[n].status;
    EXPECT_NE(out_[n].status.message().find("bucket 1"), std::string::npos) << out_[n].status;
    EXPECT_EQ(calls[n], (std::vector<uint32_t>{0, 1})) << n;  // no bucket after the failing one
  }
  EXPECT_EQ(relay_, std::vector<uint8_t>(relay_.size(), 0));  // bucket 2 was never posted
}

class FailingSetup : public ChannelSetup {
 public:
  void Publish(std::map<std::string, std::map<std::string, std::string>>) override {}
  absl::StatusOr<ChannelLink> Setup(const ChannelPlan& c, transport::Transport*, absl::Time) override {
    return absl::UnavailableError(absl::StrCat("exchanging regions with node ", c.peer, ": peer gone"));
  }
};

TEST_F(ExecutorTest, AChannelSetupFailureIsReturnedAndNothingIsPosted) {
  MakeTransports();
  ExecFacts f;
  f.me = "n0";
  f.kind["w0.b0"] = MemoryKind::kHost;
  auto plan = MakeExecPlan(slice_, f);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::map<std::string, RegionMemory> mem{{"w0.b0", RegionMemory{MemoryKind::kHost, mem_[0].data(), kElems * 4, -1, {}}}};
  ExecTransports t;
  t.local = local_.get();
  t.cross = cross_[0].get();
  ExecOptions o;
  o.label = "m v1";
  o.version = 1;
  o.deadline = absl::Now() + absl::Seconds(5);
  FailingSetup setup;
  ExecResult result;
  absl::Status s = RunExecPlan(*plan, mem, t, setup, o, result);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("node n1: peer gone"), std::string::npos) << s;
  EXPECT_EQ(cross_[0]->stats().batches_posted, 0);
}

}  // namespace
}  // namespace wb::daemon::node
