// Lossless deltas through the executor on the in-process fake transport (two "nodes" in one test,
// each running its own ExecPlan): byte-exact deltas both ways, a base that does not match and a
// corrupt stream fall back to a full resend of those ops, a sender without a cached base sends
// in full; plus the pure parts (region layout, strided pack/unpack).
#include "daemon/node/delta_exchange.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/digest/digest.h"
#include "daemon/node/executor.h"
#include "daemon/testing/exec_rendezvous.h"
#include "transport/config.h"
#include "transport/host_shm/host_shm.h"
#include "transport/testing/fake_transport.h"

namespace wb::daemon::node {
namespace {

using transport::MemoryKind;

// Where two executors meet (descriptors and endpoints through memory).
using Rendezvous = daemon::testing::ExecRendezvous;

constexpr int64_t kRows = 64, kCols = 256;  // each tensor: [64, 256] bf16
constexpr int64_t kBytes = kRows * kCols * 2;

// Trainer "t" (n0) sends tensor 0 to rollout "r" (n1): rows [0, 32) in bucket 0, rows [32, 64)
// as two column halves in bucket 1 (strided boxes); trainer "t1" (n1) sends tensor 1 whole to
// rollout "r1" (n0) in bucket 0 (the other direction). Every op may travel as a delta.
class DeltaExecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"t0", "t1"}) inv_.tensors.push_back({name, {kRows, kCols}, planner::DType::kBF16});
    slice_.inventory = &inv_;
    slice_.num_buckets = 2;
    const std::tuple<const char*, const char*, planner::Role, int> workers[] = {
        {"t", "n0", planner::Role::kTrainer, 0}, {"r", "n1", planner::Role::kRollout, 0},
        {"t1", "n1", planner::Role::kTrainer, 1}, {"r1", "n0", planner::Role::kRollout, 1}};
    for (auto [id, node, role, tensor] : workers) {
      slice_.workers.push_back({id, node, role});
      planner::WorkerLayout l;
      l.buffers.push_back({kBytes});
      planner::Piece p;
      p.tensor = tensor;
      p.box = {{0, 0}, {kRows, kCols}};
      p.strides = {kCols, 1};
      l.pieces.push_back(p);
      slice_.layouts.push_back(l);
      slice_.quantized.push_back(false);
    }
    AddOp(0, 0, 0, 1, 0, {{0, 0}, {32, kCols}});
    AddOp(1, 1, 0, 1, 0, {{32, 0}, {64, 128}});
    AddOp(2, 1, 0, 1, 0, {{32, 128}, {64, kCols}});
    AddOp(3, 0, 2, 3, 1, {{0, 0}, {kRows, kCols}});
    for (int i = 0; i < 2; ++i) {
      trainer_[i].assign(kBytes, 0);
      staging_[i].assign(kBytes, 0);
      caches_[i] = std::make_unique<DeltaCache>(1 << 20);
    }
    transport::TransportConfig tc;
    local_ = transport::NewHostShmTransport(tc);
    ASSERT_NE(local_, nullptr);
    for (int n = 0; n < 2; ++n) {
      transport::testing::FakeOptions o;
      o.fabric = &fabric_;
      o.node_id = absl::StrCat("n", n);
      o.kind = "host_tcp";
      cross_[n] = transport::testing::MakeFakeTransport(o);
      rendezvous_.Add(o.node_id, cross_[n].get());
    }
  }

  void AddOp(uint32_t index, uint32_t bucket, uint32_t src, uint32_t dst, int32_t tensor, planner::Box box) {
    const uint64_t bytes = static_cast<uint64_t>((box.end[0] - box.begin[0]) * (box.end[1] - box.begin[1]) * 2);
    SliceOp op = daemon::testing::TestSliceOp(index, bucket, src, dst, tensor, std::move(box), bytes);
    op.delta = true;
    slice_.ops.push_back(op);
  }

  // Version v of both trainers: bf16-like values, about 1 element in 16 moved by 1..3 ulp per version.
  void SetVersion(uint64_t v) {
    for (int i = 0; i < 2; ++i) {
      for (int64_t e = 0; e < kRows * kCols; ++e) {
        uint16_t x = static_cast<uint16_t>(0x3c00 + ((e * 2654435761u + i * 977) >> 7) % 0x200);
        for (uint64_t u = 2; u <= v; ++u) {
          const uint64_t h = (static_cast<uint64_t>(e) * 0x9E3779B97F4A7C15ull) ^ (u * 0xC2B2AE3D27D4EB4Full) ^ (i * 0x165667B19E3779F9ull);
          if (((h >> 17) & 15) == 0) x = static_cast<uint16_t>(x + 1 + ((h >> 33) % 3));
        }
        std::memcpy(trainer_[i].data() + 2 * e, &x, 2);
      }
    }
  }

  struct Outcome {
    absl::Status status;
    ExecResult result;
  };

  // Runs version v on both nodes; `bases`: per destination slice worker its base version.
  void Run(uint64_t v, std::map<uint32_t, uint64_t> bases) {
    rendezvous_.Reset();
    {
      absl::MutexLock l(&landed_mu_);
      landed_.clear();
    }
    for (auto& s : staging_) std::fill(s.begin(), s.end(), 0xAB);  // reused staging: stale bytes
    std::thread threads[2];
    for (int n = 0; n < 2; ++n) {
      threads[n] = std::thread([&, n] {
        const std::string me = absl::StrCat("n", n);
        std::map<std::string, RegionMemory> mem;
        // n0 holds t (trainer 0) and r1 (staging 1); n1 holds r (staging 0) and t1 (trainer 1).
        const uint32_t tw = n == 0 ? 0 : 2, rw = n == 0 ? 3 : 1;
        mem[RegionKey(tw, 0)] = RegionMemory{MemoryKind::kHost, trainer_[n].data(), kBytes, -1, {}};
        mem[RegionKey(rw, 0)] = RegionMemory{MemoryKind::kHost, staging_[1 - n].data(), kBytes, -1, {}};
        ExecOptions o;
        o.label = absl::StrCat("m v", v, " on ", me);
        o.version = v;
        o.deadline = absl::Now() + absl::Seconds(20);
        o.deltas.me = me;
        o.deltas.base_versions = bases;
        o.deltas.cache = caches_[n].get();
        o.deltas.buffers = &buffers_[n];
        o.deltas.threads = delta_threads_;
        const int staging = 1 - n;
        o.deltas.base = [this, staging](const std::string&) -> std::optional<DeltaBase> {
          if (committed_version_[staging] == 0) return std::nullopt;
          return DeltaBase{committed_version_[staging], committed_[staging].data(), kBytes, nullptr};
        };
        // Digests hash a route's landed boxes in on_batch_done: by then every box must be final.
        o.on_batch_done = [this, n](const Route& r, const std::string&) {
          for (const RouteOp& op : r.ops) {
            if (!op.dst_local || r.kind != RouteKind::kPeer) continue;
            std::vector<uint8_t> got(static_cast<size_t>(op.copy.bytes())), want(got.size());
            const std::vector<uint8_t>& src = trainer_[1 - n];
            ASSERT_TRUE(PackSide(staging_[1 - n].data(), kBytes, op.copy.dst, op.copy, got.data()).ok());
            ASSERT_TRUE(PackSide(src.data(), kBytes, op.copy.src, op.copy, want.data()).ok());
            if (got != want) ++not_final_;
          }
        };
        // Receiver-side quantising starts a piece on on_op_landed: each op once, its box final.
        o.on_op_landed = [this, n](const RouteOp& op) {
          std::vector<uint8_t> got(static_cast<size_t>(op.copy.bytes())), want(got.size());
          ASSERT_TRUE(PackSide(staging_[1 - n].data(), kBytes, op.copy.dst, op.copy, got.data()).ok());
          ASSERT_TRUE(PackSide(trainer_[1 - n].data(), kBytes, op.copy.src, op.copy, want.data()).ok());
          if (got != want) ++not_final_;
          absl::MutexLock l(&landed_mu_);
          ++landed_[{n, op.op_index}];
        };
        if (on_landed_) o.deltas.on_landed = [this, n](uint32_t op, absl::Span<uint8_t> s) { on_landed_(n, op, s); };
        if (track_units_) {
          o.deltas.unit_hashes = [this, n](const RouteOp& op, bool landed, const std::vector<uint64_t>* h) {
            absl::MutexLock l(&units_mu_);
            units_[{n, op.op_index, landed}].push_back(h != nullptr ? std::optional<std::vector<uint64_t>>(*h) : std::nullopt);
          };
        }
        if (record_digests_) {
          o.deltas.recorded = [this, n](const RouteOp& op, uint64_t version) -> std::optional<delta::Digest> {
            absl::MutexLock l(&recorded_mu_);
            auto it = recorded_.find({n, op.op_index});
            if (it == recorded_.end() || it->second.first != version) return std::nullopt;
            return it->second.second;
          };
          o.deltas.record = [this, n](const RouteOp& op, uint64_t version, const delta::Digest& d) {
            absl::MutexLock l(&recorded_mu_);
            recorded_[{n, op.op_index}] = {version, d};
          };
        }
        out_[n].status = rendezvous_.RunNode(slice_, me, mem, local_.get(), cross_[n].get(), o, out_[n].result);
      });
    }
    for (auto& t : threads) t.join();
  }

  // CommitVersion(v) on both nodes: caches commit, the rollouts' committed copies are the staging.
  void Commit(uint64_t v) {
    for (int i = 0; i < 2; ++i) {
      caches_[i]->Commit(v);
      committed_[i] = staging_[i];
      committed_version_[i] = v;
    }
  }

  // End-to-end digest (issue 17.4's format) of op's box in `bytes` (a trainer or a staging copy:
  // both [kRows, kCols] row-major).
  digest::Digest BoxDigestOf(const std::vector<uint8_t>& bytes, uint32_t op) const {
    const planner::Box& box = slice_.ops[op].box;
    const uint8_t* at = bytes.data() + (box.begin[0] * kCols + box.begin[1]) * 2;
    absl::StatusOr<digest::Digest> d =
        digest::BoxDigest({at, {box.end[0] - box.begin[0], box.end[1] - box.begin[1]}, {kCols, 1}, 2});
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *d : 0;
  }
  // The digest the codec's unit hashes of (node, op, side) give; nullopt when it handed none.
  std::optional<digest::Digest> UnitDigest(int node, uint32_t op, bool landed) {
    absl::MutexLock l(&units_mu_);
    auto it = units_.find({node, op, landed});
    if (it == units_.end() || it->second.size() != 1 || !it->second[0].has_value()) return std::nullopt;
    const planner::Box& box = slice_.ops[op].box;
    const int64_t bytes = (box.end[0] - box.begin[0]) * (box.end[1] - box.begin[1]) * 2;
    absl::StatusOr<digest::Digest> d = digest::DigestFromChunks(bytes, 2, *it->second[0]);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::optional<digest::Digest>(*d) : std::nullopt;
  }
  size_t UnitCalls(int node, uint32_t op, bool landed) {
    absl::MutexLock l(&units_mu_);
    auto it = units_.find({node, op, landed});
    return it == units_.end() ? 0 : it->second.size();
  }

  void ExpectExact(const char* what) {
    EXPECT_EQ(not_final_.load(), 0) << what << ": a route or op was reported done before its boxes were final";
    absl::MutexLock l(&landed_mu_);
    EXPECT_EQ(landed_.size(), slice_.ops.size()) << what << ": every op lands on one node and is reported there";
    for (const auto& [at, count] : landed_) EXPECT_EQ(count, 1) << what << ": node " << at.first << " op " << at.second;
    EXPECT_TRUE(staging_[0] == trainer_[0]) << what << ": tensor 0 on n1";
    EXPECT_TRUE(staging_[1] == trainer_[1]) << what << ": tensor 1 on n0";
  }

  planner::Inventory inv_;
  Slice slice_;
  std::vector<uint8_t> trainer_[2];   // trainer_[0] on n0 (tensor 0), trainer_[1] on n1 (tensor 1)
  std::vector<uint8_t> staging_[2];   // staging_[0] = r on n1 (tensor 0), staging_[1] = r1 on n0
  std::vector<uint8_t> committed_[2];
  uint64_t committed_version_[2] = {0, 0};
  std::unique_ptr<DeltaCache> caches_[2];
  DeltaBuffers buffers_[2];
  transport::testing::FakeFabric fabric_;
  std::unique_ptr<transport::Transport> local_;
  std::unique_ptr<transport::Transport> cross_[2];
  Rendezvous rendezvous_;
  Outcome out_[2];
  std::function<void(int node, uint32_t op, absl::Span<uint8_t> stream)> on_landed_;
  std::atomic<int> not_final_{0};
  absl::Mutex landed_mu_;
  std::map<std::pair<int, uint32_t>, int> landed_ ABSL_GUARDED_BY(landed_mu_);  // (node, op) -> on_op_landed calls
  // Receivers record the digests of the boxes they decode (as NodeDeltas does), by (node, op).
  bool record_digests_ = false;
  absl::Mutex recorded_mu_;
  std::map<std::pair<int, uint32_t>, std::pair<uint64_t, delta::Digest>> recorded_ ABSL_GUARDED_BY(recorded_mu_);
  // DeltaOptions::unit_hashes, by (node, op, landed): every call's hashes (nullopt: none).
  bool track_units_ = false;
  absl::Mutex units_mu_;
  std::map<std::tuple<int, uint32_t, bool>, std::vector<std::optional<std::vector<uint64_t>>>> units_ ABSL_GUARDED_BY(units_mu_);
  int delta_threads_ = 2;  // DeltaOptions::threads of both executors

 public:
  void FullThenDeltasBothWays();
};

TEST_F(DeltaExecTest, FirstVersionFullThenDeltasBothWaysByteExact) { FullThenDeltasBothWays(); }

// --delta_threads on a many-core host (ResolveDeltaThreads: up to 16), and a single thread: more
// encodes and decodes than boxes at once, largest first; the same bytes and counts.
TEST_F(DeltaExecTest, AnyNumberOfCodecThreadsGivesTheSameBytes) {
  delta_threads_ = 16;
  FullThenDeltasBothWays();
}

TEST_F(DeltaExecTest, OneCodecThreadGivesTheSameBytes) {
  delta_threads_ = 1;
  FullThenDeltasBothWays();
}

void DeltaExecTest::FullThenDeltasBothWays() {
  SetVersion(1);
  Run(1, {});  // nothing committed anywhere: full, but the senders cache what they sent
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  ExpectExact("v1");
  EXPECT_EQ(out_[0].result.delta.ops_sent_delta, 0u);
  EXPECT_EQ(out_[0].result.delta.cache_candidates, 3u);
  EXPECT_EQ(out_[1].result.delta.cache_candidates, 1u);
  Commit(1);
  for (uint64_t v = 2; v <= 3; ++v) {
    SetVersion(v);
    ASSERT_NE(trainer_[0], committed_[0]);
    const int64_t sent0 = cross_[0]->stats().bytes_copied;
    Run(v, {{1, v - 1}, {3, v - 1}});
    ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
    ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
    ExpectExact(absl::StrCat("v", v).c_str());
    const DeltaStats& s0 = out_[0].result.delta;
    const DeltaStats& s1 = out_[1].result.delta;
    EXPECT_EQ(s0.ops_sent_delta, 3u) << "v" << v;
    EXPECT_EQ(s1.ops_sent_delta, 1u) << "v" << v;
    EXPECT_EQ(s1.ops_decoded, 3u);
    EXPECT_EQ(s0.ops_decoded, 1u);
    EXPECT_EQ(s0.ops_refused + s1.ops_refused, 0u);
    EXPECT_EQ(s0.bytes_sent_raw, static_cast<uint64_t>(kBytes));
    EXPECT_LT(s0.bytes_sent_stream * 4, s0.bytes_sent_raw) << "about 1 element in 16 changed";
    // On the wire: the streams, their lengths and the refusals, far less than the full tensors.
    EXPECT_LT(cross_[0]->stats().bytes_copied - sent0, kBytes);
    Commit(v);
  }
}

TEST_F(DeltaExecTest, ABaseThatDoesNotMatchIsRefusedAndResentInFull) {
  SetVersion(1);
  Run(1, {});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  Commit(1);
  committed_[0][4097] ^= 0x10;  // r's committed copy is not what n0 committed: its digest differs
  SetVersion(2);
  Run(2, {{1, 1}, {3, 1}});
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  ExpectExact("v2 after refusals");
  const DeltaStats& s1 = out_[1].result.delta;
  EXPECT_EQ(s1.ops_refused, 1u) << "only the op whose box holds the flipped byte";
  EXPECT_EQ(s1.ops_decoded, 2u);
  EXPECT_NE(s1.first_refusal.find("was made against version 1"), std::string::npos) << s1.first_refusal;
  EXPECT_GT(s1.bytes_fallback, 0u);
  EXPECT_EQ(out_[0].result.delta.ops_decoded, 1u);  // the other direction was fine
  EXPECT_EQ(out_[0].result.delta.bytes_sent_full, s1.bytes_fallback);
}

// Receivers that record what they decoded check the next version's base against that digest
// (no hash of the base), and a base changed behind the node after it was recorded is still refused
// ("made against", decided on the base's own digest) and resent in full: never a wrong byte.
TEST_F(DeltaExecTest, RecordedBaseDigestsSkipTheBaseHashAndAStaleOneIsStillRefused) {
  record_digests_ = true;
  SetVersion(1);
  Run(1, {});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  Commit(1);
  for (uint64_t v = 2; v <= 3; ++v) {
    SetVersion(v);
    Run(v, {{1, v - 1}, {3, v - 1}});
    ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
    ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
    ExpectExact(absl::StrCat("v", v).c_str());
    const DeltaStats& s1 = out_[1].result.delta;
    EXPECT_EQ(s1.ops_decoded, 3u) << "v" << v;
    EXPECT_EQ(s1.ops_refused + out_[0].result.delta.ops_refused, 0u) << "v" << v;
    // Version 1 came in full (nothing recorded); version 2's decodes were recorded.
    EXPECT_EQ(s1.base_digests_recorded, v == 2 ? 0u : 3u) << "v" << v;
    EXPECT_EQ(out_[0].result.delta.base_digests_recorded, v == 2 ? 0u : 1u) << "v" << v;
    Commit(v);
  }
  committed_[0][4097] ^= 0x10;  // behind the node, after its digest was recorded
  SetVersion(4);
  Run(4, {{1, 3}, {3, 3}});
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  ExpectExact("v4 after the refusal");
  const DeltaStats& s1 = out_[1].result.delta;
  EXPECT_EQ(s1.ops_refused, 1u) << "only the op whose box holds the flipped byte";
  EXPECT_EQ(s1.ops_decoded, 2u);
  EXPECT_EQ(s1.base_digests_recorded, 3u);
  EXPECT_NE(s1.first_refusal.find("was made against version 3"), std::string::npos) << s1.first_refusal;
  EXPECT_GT(s1.bytes_fallback, 0u);
}

TEST_F(DeltaExecTest, ADestinationHoldingAnotherVersionGetsFullBytes) {
  SetVersion(1);
  Run(1, {});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  Commit(1);
  committed_version_[0] = 7;  // r's node holds version 7 (say, a coordinator that was wrong)
  committed_version_[1] = 0;  // r1's node holds nothing (restarted)
  SetVersion(2);
  Run(2, {{1, 1}, {3, 1}});
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  ExpectExact("v2");
  EXPECT_EQ(out_[1].result.delta.ops_refused, 3u);
  EXPECT_NE(out_[1].result.delta.first_refusal.find("holds version 7"), std::string::npos) << out_[1].result.delta.first_refusal;
  EXPECT_EQ(out_[0].result.delta.ops_refused, 1u);
  EXPECT_NE(out_[0].result.delta.first_refusal.find("no committed copy"), std::string::npos) << out_[0].result.delta.first_refusal;
}

TEST_F(DeltaExecTest, ACorruptStreamIsCaughtAndResentInFull) {
  SetVersion(1);
  Run(1, {});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  Commit(1);
  SetVersion(2);
  on_landed_ = [](int node, uint32_t op, absl::Span<uint8_t> stream) {
    if (node == 1 && op == 1) stream[stream.size() / 2] ^= 0x04;  // past the headers: a payload byte
    if (node == 1 && op == 2) stream[stream.size() - 1] ^= 0x80;
  };
  Run(2, {{1, 1}, {3, 1}});
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  ExpectExact("v2 after corrupt streams");
  EXPECT_EQ(out_[1].result.delta.ops_refused, 2u);
  EXPECT_EQ(out_[1].result.delta.ops_decoded, 1u);
}

TEST_F(DeltaExecTest, ASenderWithoutTheBaseSendsInFull) {
  SetVersion(1);
  Run(1, {});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  Commit(1);
  caches_[0] = std::make_unique<DeltaCache>(1 << 20);  // n0 restarted: its cache is empty
  SetVersion(2);
  Run(2, {{1, 1}, {3, 1}});
  ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
  ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
  ExpectExact("v2");
  EXPECT_EQ(out_[0].result.delta.ops_sent_delta, 0u);
  EXPECT_EQ(out_[0].result.delta.ops_sent_full, 3u);
  EXPECT_EQ(out_[1].result.delta.ops_sent_delta, 1u);
  EXPECT_EQ(out_[1].result.delta.ops_refused + out_[0].result.delta.ops_refused, 0u);
  // ... and it cached v2, so v3 goes as deltas again.
  Commit(2);
  SetVersion(3);
  Run(3, {{1, 2}, {3, 2}});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  ExpectExact("v3");
  EXPECT_EQ(out_[0].result.delta.ops_sent_delta, 3u);
}

// Issue 17.4's digests of delta ops come from the codec's passes (DeltaOptions::unit_hashes): one
// call per local side, whose chunk hashes give exactly the digest of the box the sender read and
// of what landed in staging (ops 1 and 2 are strided boxes: hashed as the scratch is copied out).
// Sides only cached (first version) are hashed as packed; a stream that is not decoded OK (corrupt,
// or against another base) hands none: its full resend is hashed some other way.
TEST_F(DeltaExecTest, TheCodecsUnitHashesAreTheDigestsOfWhatWasReadAndWhatLanded) {
  track_units_ = true;
  SetVersion(1);
  Run(1, {});
  ASSERT_TRUE(out_[0].status.ok() && out_[1].status.ok());
  for (uint32_t op : {0u, 1u, 2u}) {
    EXPECT_EQ(UnitDigest(0, op, false), BoxDigestOf(trainer_[0], op)) << "v1 op " << op << " cached only";
    EXPECT_EQ(UnitCalls(1, op, true), 0u) << "no slot: nothing decoded";
  }
  EXPECT_EQ(UnitDigest(1, 3, false), BoxDigestOf(trainer_[1], 3));
  Commit(1);
  for (uint64_t v = 2; v <= 3; ++v) {
    {
      absl::MutexLock l(&units_mu_);
      units_.clear();
    }
    SetVersion(v);
    if (v == 3) {
      on_landed_ = [](int node, uint32_t op, absl::Span<uint8_t> stream) {
        if (node == 1 && op == 1) stream[stream.size() / 2] ^= 0x04;
      };
    }
    Run(v, {{1, v - 1}, {3, v - 1}});
    ASSERT_TRUE(out_[0].status.ok()) << out_[0].status;
    ASSERT_TRUE(out_[1].status.ok()) << out_[1].status;
    ExpectExact(absl::StrCat("v", v).c_str());
    for (uint32_t op : {0u, 1u, 2u, 3u}) {
      const int sender = op == 3 ? 1 : 0, receiver = 1 - sender;
      const std::vector<uint8_t>& src = trainer_[op == 3 ? 1 : 0];
      const std::vector<uint8_t>& landed = staging_[op == 3 ? 1 : 0];
      EXPECT_EQ(UnitCalls(sender, op, false), 1u) << "v" << v << " op " << op;
      EXPECT_EQ(UnitCalls(receiver, op, true), 1u) << "v" << v << " op " << op;
      EXPECT_EQ(UnitDigest(sender, op, false), BoxDigestOf(src, op)) << "v" << v << " op " << op;
      if (v == 3 && op == 1) {
        EXPECT_EQ(UnitDigest(receiver, op, true), std::nullopt) << "corrupt stream: refused, resent in full, no codec hashes";
      } else {
        EXPECT_EQ(UnitDigest(receiver, op, true), BoxDigestOf(landed, op)) << "v" << v << " op " << op;
      }
    }
    if (v == 3) {
      EXPECT_EQ(out_[1].result.delta.ops_refused, 1u);
    }
    Commit(v);
  }
}

TEST(DeltaPartsTest, RegionLayoutMirrorsThePeers) {
  const DeltaLayout a = LayoutDeltaRegion({100, 7}, {33});
  const DeltaLayout b = LayoutDeltaRegion({33}, {100, 7});
  EXPECT_EQ(a.in_len, 16);
  EXPECT_EQ(a.out_ref, 24);
  EXPECT_EQ(a.in_ref, 26);
  ASSERT_EQ(a.out_stream.size(), 2u);
  EXPECT_EQ(a.out_stream[0] % 64, 0);
  EXPECT_GE(a.out_stream[1], a.out_stream[0] + 100);
  EXPECT_GE(a.in_land[0], a.out_stream[1] + 7);
  EXPECT_GE(a.size, a.in_land[0] + 33);
  EXPECT_EQ(b.in_land.size(), a.out_stream.size());
}

TEST(DeltaPartsTest, PackAndUnpackAStridedBoxRoundTrip) {
  std::vector<uint8_t> region(8 * 6 * 2);
  for (size_t i = 0; i < region.size(); ++i) region[i] = static_cast<uint8_t>(i);
  transport::CopyOp op;
  op.shape = {3, 2};  // rows 2..4, cols 1..2 of an [8, 6] bf16 tensor
  op.element_size = 2;
  op.src = {{}, (2 * 6 + 1) * 2, {6, 1}};
  std::vector<uint8_t> packed(12);
  ASSERT_TRUE(PackSide(region.data(), static_cast<int64_t>(region.size()), op.src, op, packed.data()).ok());
  EXPECT_EQ(packed[0], 26);
  EXPECT_EQ(packed[4], 38);  // next row
  std::vector<uint8_t> other(region.size(), 0);
  ASSERT_TRUE(UnpackSide(packed.data(), other.data(), static_cast<int64_t>(other.size()), op.src, op).ok());
  EXPECT_EQ(other[26], 26);
  EXPECT_EQ(other[25], 0);
  op.src.offset_bytes = static_cast<int64_t>(region.size());  // outside the region
  EXPECT_FALSE(PackSide(region.data(), static_cast<int64_t>(region.size()), op.src, op, packed.data()).ok());
}

// A rollout whose base holds no canonical shadows (caught up from quantised bytes): its ops into
// receiver-quantised shadows are no slots (full, on both ends alike), its other delta ops keep
// their base; other rollouts are untouched.
TEST(DeltaSlotsTest, OpsIntoShadowsOfABaseWithoutShadowsAreNoSlots) {
  DeltaOptions o;
  o.base_versions = {{2, 7}, {3, 7}};
  o.without_shadows = {3};
  RouteOp op;
  op.delta = true;
  op.dst_worker = 3;
  op.into_shadow = true;
  EXPECT_EQ(SlotBase(o, op), 0u);
  op.into_shadow = false;  // an unquantised piece, or a sender-quantised part, of the same rollout
  EXPECT_EQ(SlotBase(o, op), 7u);
  op.dst_worker = 2;
  op.into_shadow = true;
  EXPECT_EQ(SlotBase(o, op), 7u);
  op.dst_worker = 4;  // no base at all
  EXPECT_EQ(SlotBase(o, op), 0u);
}

}  // namespace
}  // namespace wb::daemon::node
