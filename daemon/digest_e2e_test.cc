// End-to-end digests with real daemons (issue 17.4; docs/daemon.md "End-to-end digests"): a
// coordinator and two node daemons in one process, workers on shared memory, bytes over host_shm
// (same node) and host_tcp (across nodes). Every version of every mode and strategy is verified (what
// each op landed matches what its source read); a bit flipped on the wire or in staging aborts the
// version with an error naming tensor, box, source and destination worker, while the previous
// version stays whole in the rollouts.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <sstream>

#include "absl/synchronization/mutex.h"
#include "client/status_command.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"
#include "transport/host_tcp/host_tcp.h"

namespace wb::daemon {
namespace {

// A transport of a node, with one fault when `armed`. Cross-node (host_tcp, `version` 0): the first
// batch that lands bytes on this node gets one bit of its first frame flipped as it lands, before
// host_tcp hashes it (HostTcpTestFlipNextReceived): a corruption on the wire (NIC, switch, DMA) that
// no per-batch check caught. Same-node (host_shm, `version` > 0: only the executor's batches of
// that version): the first batch landing bytes gets one bit of its first received element flipped
// after the transport reported it complete - a bad copy into a rollout's staging, landing before
// its batch is reported done, what the node's digests, hashed as each batch completes, must see.
// Everything else is the real transport.
class CorruptingTransport final : public transport::Transport {
 public:
  CorruptingTransport(transport::TransportSet inner, const std::string& kind, std::atomic<bool>* armed, uint64_t version = 0)
      : inner_(std::move(inner)), t_(inner_.Find(kind)), armed_(armed), version_(version) {}

  transport::Capabilities capabilities() const override { return t_->capabilities(); }
  std::string instance_id() const override { return t_->instance_id(); }
  absl::StatusOr<std::string> ExportEndpoint(absl::string_view peer) override { return t_->ExportEndpoint(peer); }
  using transport::Transport::Connect;
  absl::StatusOr<transport::PeerId> Connect(absl::string_view endpoint, absl::string_view round, absl::Time deadline) override {
    return t_->Connect(endpoint, round, deadline);
  }
  absl::Status CancelRound(absl::string_view round) override { return t_->CancelRound(round); }
  absl::Status Disconnect(transport::PeerId peer) override { return t_->Disconnect(peer); }
  absl::StatusOr<transport::RegionHandle> RegisterMemory(const transport::MemorySpec& spec) override {
    auto h = t_->RegisterMemory(spec);
    if (h.ok()) {
      absl::MutexLock l(&mu_);
      local_[h->id] = static_cast<uint8_t*>(spec.base);
    }
    return h;
  }
  absl::StatusOr<std::string> ExportDescriptor(transport::RegionHandle r) override { return t_->ExportDescriptor(r); }
  absl::StatusOr<transport::RegionHandle> ImportDescriptor(absl::string_view d) override { return t_->ImportDescriptor(d); }
  absl::StatusOr<transport::RegionInfo> Describe(transport::RegionHandle r) const override { return t_->Describe(r); }
  absl::Status Release(transport::RegionHandle r) override {
    {
      absl::MutexLock l(&mu_);
      local_.erase(r.id);
    }
    return t_->Release(r);
  }
  absl::StatusOr<transport::BatchId> Post(const transport::Batch& batch) override {
    if (version_ == 0 && LandsBytes(batch)) {
      bool expected = true;
      // Armed before the post: no frame of this batch is read before it is posted.
      if (armed_->compare_exchange_strong(expected, false)) {
        absl::Status s = transport::HostTcpTestFlipNextReceived(*t_);
        if (!s.ok()) return s;
      }
    }
    auto id = t_->Post(batch);
    if (id.ok() && version_ > 0 && (batch.tag >> 24) == version_) {
      absl::MutexLock l(&mu_);
      posted_[id->id] = batch.ops;
    }
    return id;
  }
  absl::StatusOr<transport::BatchState> Poll(transport::BatchId b) override { return t_->Poll(b); }
  absl::Status Wait(transport::BatchId b, absl::Time deadline) override {
    absl::Status s = t_->Wait(b, deadline);
    absl::MutexLock l(&mu_);
    auto ops = posted_.find(b.id);
    if (ops == posted_.end()) return s;
    if (s.ok()) {
      for (const transport::CopyOp& op : ops->second) {
        auto dst = local_.find(op.dst.region.id);
        if (dst == local_.end() || op.bytes() == 0) continue;  // not a receive
        bool expected = true;
        if (!armed_->compare_exchange_strong(expected, false)) break;
        dst->second[op.dst.offset_bytes] ^= 0x20;
        break;
      }
    }
    posted_.erase(ops);
    return s;
  }
  transport::TransportStats stats() const override { return t_->stats(); }

 private:
  // Some op of `batch` writes into memory registered here (a receive).
  bool LandsBytes(const transport::Batch& batch) {
    absl::MutexLock l(&mu_);
    for (const transport::CopyOp& op : batch.ops) {
      if (local_.count(op.dst.region.id) > 0 && op.bytes() > 0) return true;
    }
    return false;
  }

  transport::TransportSet inner_;
  transport::Transport* t_;
  std::atomic<bool>* armed_;
  const uint64_t version_;
  absl::Mutex mu_;
  std::map<uint64_t, uint8_t*> local_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<transport::CopyOp>> posted_ ABSL_GUARDED_BY(mu_);
};

// host_shm + a CorruptingTransport over host_tcp.
absl::StatusOr<transport::TransportSet> CorruptingHostTransports(std::atomic<bool>* armed) {
  return HostTransportsWrappingTcp([armed](transport::TransportSet tcp) -> std::unique_ptr<transport::Transport> {
    return std::make_unique<CorruptingTransport>(std::move(tcp), "host_tcp", armed);
  });
}

// A CorruptingTransport over host_shm (corrupting version `version`'s same-node copies) + host_tcp.
absl::StatusOr<transport::TransportSet> CorruptingSameNodeTransports(std::atomic<bool>* armed, uint64_t version) {
  transport::TransportConfig shm, tcp;
  shm.kinds = {"host_shm"};
  tcp.kinds = {"host_tcp"};
  auto inner_shm = transport::CreateTransports(shm);
  if (!inner_shm.ok()) return inner_shm.status();
  auto inner_tcp = transport::CreateTransports(tcp);
  if (!inner_tcp.ok()) return inner_tcp.status();
  static std::atomic<bool> never{false};  // host_tcp as is (the same-node transport must come first: Pick)
  transport::TransportSet set;
  set.Add(std::make_unique<CorruptingTransport>(std::move(*inner_shm), "host_shm", armed, version));
  set.Add(std::make_unique<CorruptingTransport>(std::move(*inner_tcp), "host_tcp", &never));
  return set;
}

// The coordinator's final record of version v of model "m" (a superseded one fails the callers'
// checks, as it failed this wait before).
pb::VersionStatus VersionOf(Cluster& c, uint64_t v) { return c.FinalVersion(v, absl::Seconds(20)); }

// Sum of a metric's samples whose labels contain `filter`.
double Scraped(int port, const std::string& name, const std::string& filter) {
  auto m = ScrapeMetrics(port, absl::Seconds(10));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? MetricSum(*m, name, filter) : -1;
}

double VerifiedCount(int port) {
  auto m = ScrapeMetrics(port, absl::Seconds(10));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? MetricSum(*m, "wb_versions_total", "event=\"verified\"") : -1;
}

struct ModeCase {
  pb::Mode mode;
  pb::Strategy strategy;
  bool overlap = true;  // NodeDaemon::Options::digest_overlap (false: hashed after the buckets)
};

class DigestModesTest : public ::testing::TestWithParam<ModeCase> {};

// Two versions on two nodes (same-node and cross-node ops, a transposed rollout): both are
// committed verified - every op of the plan had equal digests of what it read and what landed -,
// `wbctl versions` says so, the verified counter moved, and every rollout byte is exact.
TEST_P(DigestModesTest, EveryVersionIsVerified) {
  const ModeCase mc = GetParam();
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const double verified_before = VerifiedCount((*endpoint)->port());
  const int port = (*endpoint)->port();
  const double tcp_hashed_before = Scraped(port, "wb_digest_bytes_total", "how=\"transport\"");
  const double tcp_moved_before = Scraped(port, "wb_bytes_total", "route=\"host_tcp\"");
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  for (int n : {0, 1}) c.StartNode(n, nullptr, nullptr, [&](ServerOptions& o) { o.digest_overlap = mc.overlap; });
  const pb::ModelSpec spec = SmallSpec(mc.mode, mc.strategy);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (uint64_t v = 1; v <= 2; ++v) {
    for (auto& s : c.Publish("m", mc.mode, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      if (mc.mode != pb::MODE_SYNC) {
        pb::ApplyResponse resp;
        grpc::Status a = c.Apply(*r, "m", v, &resp);
        ASSERT_TRUE(a.ok()) << r->id << ": " << a.error_message();
      }
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
    const pb::VersionStatus vs = VersionOf(c, v);
    EXPECT_TRUE(vs.verified()) << "version " << v << ": " << vs.ShortDebugString();
    EXPECT_GT(vs.num_ops(), 0u);
    EXPECT_EQ(vs.ops_verified(), vs.num_ops()) << vs.ShortDebugString();
  }
  std::ostringstream out, err;
  ASSERT_EQ(client::RunVersionsCommand({"--addr", c.coord_->address(), "--model", "m"}, out, err), 0) << err.str();
  EXPECT_NE(out.str().find("VERIFIED"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find(" yes "), std::string::npos) << out.str();
  EXPECT_GE(VerifiedCount((*endpoint)->port()) - verified_before, 2) << "wb_versions_total{event=\"verified\"}";
  // Digests hashed in host_tcp as the bytes cross (the default, with overlap): every box a
  // cross-node op read or landed - on each node, the bytes of the host_tcp routes it completed -
  // was hashed by host_tcp, none read again from memory (a silent fallback would show here).
  const double tcp_moved = Scraped(port, "wb_bytes_total", "route=\"host_tcp\"") - tcp_moved_before;
  const double tcp_hashed = Scraped(port, "wb_digest_bytes_total", "how=\"transport\"") - tcp_hashed_before;
  // (rank0_broadcast: the other node's rows land in rank 0's gather staging and are sent on from
  // there over host_tcp again: one box, moved twice, hashed once.)
  EXPECT_GT(tcp_moved, 0);
  if (!mc.overlap) {
    EXPECT_EQ(tcp_hashed, 0);
  } else if (mc.strategy == pb::STRATEGY_RANK0_BROADCAST) {
    EXPECT_GT(tcp_hashed, 0);
    EXPECT_LE(tcp_hashed, tcp_moved);
  } else {
    EXPECT_EQ(tcp_hashed, tcp_moved) << "wb_digest_bytes_total{how=\"transport\"} against wb_bytes_total{route=\"host_tcp\"}";
  }
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(Modes, DigestModesTest,
                         ::testing::Values(ModeCase{pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE}, ModeCase{pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE},
                                           ModeCase{pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE}, ModeCase{pb::MODE_SYNC, pb::STRATEGY_RANK0_BROADCAST},
                                           ModeCase{pb::MODE_ONE_STEP_OFF, pb::STRATEGY_P2P_NO_DEDUP},
                                           ModeCase{pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE, false},
                                           ModeCase{pb::MODE_ONE_STEP_OFF, pb::STRATEGY_RANK0_BROADCAST, false}),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return absl::StrCat(pb::Mode_Name(i.param.mode), "_", pb::Strategy_Name(i.param.strategy),
                                               i.param.overlap ? "" : "_AfterBuckets");
                         });

// Checks an abort's message names the digest mismatch with tensor, box and both workers.
void ExpectNamedMismatch(const std::string& msg, const std::string& to) {
  for (const std::string& part : {std::string("end-to-end digest mismatch in model m version 2"), std::string("tensor "), std::string(" box ["),
                                  std::string(" from worker t"), std::string(" to worker ") + to, std::string("previous version stays whole")}) {
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing in: " << msg;
  }
}

// Sync mode: version 2's bytes arriving at n1 get one bit flipped on the wire. The coordinator
// sees n1's landed digest differ from n0's source digest: version 2 is aborted (the trainers'
// Publish says why, naming the op), the rollouts' live weights still hold version 1 byte for byte,
// and version 3 goes through verified.
TEST(DigestFaultTest, BitFlippedOnTheWireAbortsTheVersionAndKeepsThePrevious) {
  planner::Inventory inv = SmallInventory();
  std::atomic<bool> armed{false};
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1, nullptr, nullptr, [&](ServerOptions& o) { o.make_transports = [&armed] { return CorruptingHostTransports(&armed); }; });
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(CountBad(r1, 1), 0);

  armed = true;
  std::vector<grpc::Status> st = c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1});
  EXPECT_FALSE(armed.load()) << "the wire fault never fired";
  for (const grpc::Status& s : st) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    ExpectNamedMismatch(s.error_message(), "r1 (node n1)");
  }
  const pb::VersionStatus v2 = VersionOf(c, 2);
  EXPECT_EQ(v2.state(), "aborted");
  ExpectNamedMismatch(v2.error(), "r1 (node n1)");
  EXPECT_FALSE(v2.verified());
  EXPECT_EQ(CountBad(r0, 1), 0) << "r0 must still hold version 1 whole";
  EXPECT_EQ(CountBad(r1, 1), 0) << "r1 must still hold version 1 whole";

  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  EXPECT_TRUE(VersionOf(c, 3).verified());
  c.Stop();
}

// One-step-off, on `c` (coordinator, n0, n1 started; n0 carries the fault): version 1 lands whole;
// then `arm` arms a fault that corrupts what lands in rollout r0's staging on n0 during version 2,
// and `fired` says afterwards whether it struck. r0's landed digest differs from the source's:
// version 2 is aborted naming the op into r0, Apply(2) is refused, r0 keeps version 1 whole, and
// version 3 goes through verified.
void ExpectStagingFaultIntoR0IsCaught(Cluster& c, const std::function<void()>& arm, const std::function<bool()>& fired) {
  planner::Inventory inv = SmallInventory();
  const pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(c.Apply(r0, "m", 1, &resp).ok());
  ASSERT_EQ(CountBad(r0, 1), 0);

  arm();
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  grpc::Status a = c.Apply(r0, "m", 2, &resp);
  EXPECT_TRUE(fired()) << "the staging fault never fired";
  EXPECT_EQ(a.error_code(), grpc::StatusCode::ABORTED) << a.error_message();
  ExpectNamedMismatch(a.error_message(), "r0 (node n0)");
  const pb::VersionStatus v2 = VersionOf(c, 2);
  EXPECT_EQ(v2.state(), "aborted");
  ExpectNamedMismatch(v2.error(), "r0 (node n0)");
  EXPECT_EQ(CountBad(r0, 1), 0) << "r0 must still hold version 1 whole";

  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 3, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
  EXPECT_TRUE(VersionOf(c, 3).verified());
}

// After version 2's buckets a bit of rollout r0's staging on n0 flips (memory, a bad copy). The
// flip comes after the buckets, so n0 hashes after them here (--digest_overlap=false); with the
// digests hashed as batches complete, the next test flips a bit as the copy lands.
TEST(DigestFaultTest, BitFlippedInStagingAbortsTheVersionAndKeepsThePrevious) {
  std::atomic<bool> armed{false};
  std::atomic<int> flips{0};
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) {
    o.digest_overlap = false;
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_after_buckets = [&](const std::string&, uint64_t, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions) {
        auto r = regions.find("r0.b0");
        bool expected = true;
        if (r == regions.end() || r->second.second == 0 || !armed.compare_exchange_strong(expected, false)) return;
        r->second.first[3] ^= 0x01;  // a byte of r0's first piece (tensor a, element (0, 0))
        ++flips;
      };
    };
  });
  c.StartNode(1);
  ExpectStagingFaultIntoR0IsCaught(c, [&] { armed = true; }, [&] { return flips.load() == 1; });
  c.Stop();
}

// Digests hashed as batches complete (the default): version 2's same-node copy into rollout r0's
// staging on n0 lands one flipped bit (a bad copy); r0's landed digest is taken when that batch
// completed, and must see it.
TEST(DigestFaultTest, BitFlippedByASameNodeCopyIsCaughtWhileTheBucketsRun) {
  std::atomic<bool> armed{false};
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) { o.make_transports = [&armed] { return CorruptingSameNodeTransports(&armed, 2); }; });
  c.StartNode(1);
  ExpectStagingFaultIntoR0IsCaught(c, [&] { armed = true; }, [&] { return !armed.load(); });
  c.Stop();
}

// ------------------------------------------------------------------ catch-up (docs "Catch-up")

// The whole-model layout of a late rollout.
planner::WorkerLayout Whole(const planner::Inventory& inv, bool transposed) {
  return LayoutOf(inv, {{0, {0, 0}, {8, 16}, transposed}, {1, {0, 0}, {4, 6}, transposed}});
}

double CatchUpEvents(int port, const std::string& event) {
  auto m = ScrapeMetrics(port, absl::Seconds(10));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? MetricSum(*m, "wb_versions_total", absl::StrCat("event=\"", event, "\"")) : -1;
}

// How a rollout of `mode` is told version v: sync, WaitVersion with its id (answered once it
// holds v); otherwise Apply(v).
grpc::Status Receive(Cluster& c, TestWorker& r, pb::Mode mode, uint64_t v) {
  if (mode != pb::MODE_SYNC) {
    pb::ApplyResponse resp;
    return c.Apply(r, "m", v, &resp);
  }
  pb::WaitVersionResponse resp;
  return WaitVersionAs(r, "m", v, 20000, &resp);
}

struct CatchUpCase {
  pb::Mode mode;
  bool flip;  // flip a bit in the late rollout's staging after the catch-up's buckets on n1
};

class CatchUpDigestTest : public ::testing::TestWithParam<CatchUpCase> {};

// Version 1 is committed to r0 (n0) and r1 (n1); rollout r2 registers late on n1 and is caught up
// from their copies. Clean: the coordinator compares the catch-up's digests like a version's and
// counts it verified; r2 holds version 1 byte for byte. Flipped (a bit of r2's incoming staging
// on n1 after the catch-up's buckets; n1 hashes after them): the catch-up is aborted before its
// commit, r2 is told why (WaitVersion / Apply ABORTED naming tensor, box, source and destination
// worker), its memory is untouched (still zero), and version 2 then reaches all three verified.
TEST_P(CatchUpDigestTest, CatchUpDigestsAreCompared) {
  const CatchUpCase cc = GetParam();
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  const double verified_before = CatchUpEvents(port, "catch_up_verified");
  const double mismatch_before = CatchUpEvents(port, "catch_up_digest_mismatch");
  planner::Inventory inv = SmallInventory();
  std::atomic<bool> armed{false};
  std::atomic<int> flips{0};
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1, nullptr, nullptr, [&](ServerOptions& o) {
    o.digest_overlap = false;  // the flip comes after the buckets
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_after_buckets = [&](const std::string&, uint64_t v, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions) {
        auto r = regions.find("r2.b0");
        bool expected = true;
        if (v != 1 || r == regions.end() || r->second.second == 0 || !armed.compare_exchange_strong(expected, false)) return;
        r->second.first[5] ^= 0x10;  // a byte of r2's first piece (tensor a, element (0, 1))
        ++flips;
      };
    };
  });
  const pb::ModelSpec spec = SmallSpec(cc.mode, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", cc.mode, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(Receive(c, *r, cc.mode, 1).ok()) << r->id;
    ASSERT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  ASSERT_TRUE(VersionOf(c, 1).verified());

  armed = cc.flip;
  TestWorker& r2 = c.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv, Whole(inv, false));
  ASSERT_TRUE(c.Register(r2, spec).ok());
  grpc::Status s = Receive(c, r2, cc.mode, 1);
  if (!cc.flip) {
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(CountBad(r2, 1), 0);
    EXPECT_EQ(CatchUpEvents(port, "catch_up_verified") - verified_before, 1) << "the clean catch-up was not counted verified";
    EXPECT_EQ(CatchUpEvents(port, "catch_up_digest_mismatch") - mismatch_before, 0);
  } else {
    EXPECT_EQ(flips.load(), 1) << "the staging fault never fired";
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    const std::string msg = s.error_message();
    for (const std::string part : {"end-to-end digest mismatch in the catch-up of model m version 1", "tensor a box [", " from worker r",
                                   " to worker r2 (node n1)", "the catch-up is aborted"}) {
      EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing in: " << msg;
    }
    const uint8_t* bytes = static_cast<const uint8_t*>(r2.seg.data());
    EXPECT_EQ(std::count(bytes, bytes + r2.seg.size(), 0), r2.seg.size()) << "the aborted catch-up wrote r2's memory";
    EXPECT_EQ(CatchUpEvents(port, "catch_up_digest_mismatch") - mismatch_before, 1);
    EXPECT_EQ(CatchUpEvents(port, "catch_up_verified") - verified_before, 0);
  }
  // Nothing of the catch-up touched the committed version; the next one reaches every rollout.
  for (auto& p : c.Publish("m", cc.mode, 2, {&t0, &t1}, {&r0, &r1, &r2})) ASSERT_TRUE(p.ok()) << p.error_message();
  for (TestWorker* r : {&r0, &r1, &r2}) {
    ASSERT_TRUE(Receive(c, *r, cc.mode, 2).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  EXPECT_TRUE(VersionOf(c, 2).verified());
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(Cases, CatchUpDigestTest,
                         ::testing::Values(CatchUpCase{pb::MODE_SYNC, false}, CatchUpCase{pb::MODE_SYNC, true},
                                           CatchUpCase{pb::MODE_ONE_STEP_OFF, true}),
                         [](const ::testing::TestParamInfo<CatchUpCase>& i) {
                           return absl::StrCat(pb::Mode_Name(i.param.mode), i.param.flip ? "_Flipped" : "_Clean");
                         });

}  // namespace
}  // namespace wb::daemon
