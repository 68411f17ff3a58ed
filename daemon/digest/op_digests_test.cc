#include "daemon/digest/op_digests.h"

#include <xxhash.h>

#include <algorithm>
#include <optional>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace wb::digest {
namespace {

using daemon::node::Slice;
using daemon::node::SliceOp;

// Tensor 0: [4, 6] bf16. Trainer t0 (node n0) holds rows 0..4 row-major at offset 0; rollout r0
// (node n0) holds it transposed at offset 64; rollout r1 lives on node n1.
struct Fixture {
  planner::Inventory inv;
  Slice slice;
  std::vector<uint8_t> trainer = std::vector<uint8_t>(48), rollout = std::vector<uint8_t>(64 + 48);
  Fixture() {
    inv.tensors.push_back({"model.embed_tokens.weight", {4, 6}, planner::DType::kBF16});
    slice.inventory = &inv;
    slice.workers = {{"t0", "n0", planner::Role::kTrainer}, {"r0", "n0", planner::Role::kRollout}, {"r1", "n1", planner::Role::kRollout}};
    const planner::Box whole{{0, 0}, {4, 6}};
    slice.layouts.resize(3);
    slice.layouts[0].pieces.push_back({0, whole, 0, 0, {6, 1}, std::nullopt});
    slice.layouts[1].pieces.push_back({0, whole, 0, 64, {1, 4}, std::nullopt});
    slice.layouts[2].pieces.push_back({0, whole, 0, 0, {6, 1}, std::nullopt});
    slice.ops.push_back(Op(0, 0, 1, planner::Box{{0, 0}, {2, 6}}));
    slice.ops.push_back(Op(1, 0, 1, planner::Box{{2, 0}, {4, 6}}));
    slice.ops.push_back(Op(2, 0, 2, whole));
    // Element (r, c) = bytes {r, c}: trainer row-major, rollout transposed (what a copy lands).
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 6; ++c) {
        const uint8_t v[2] = {static_cast<uint8_t>(r), static_cast<uint8_t>(c)};
        std::memcpy(trainer.data() + (r * 6 + c) * 2, v, 2);
        std::memcpy(rollout.data() + 64 + (c * 4 + r) * 2, v, 2);
      }
    }
  }
  static SliceOp Op(uint32_t index, uint32_t src, uint32_t dst, planner::Box box) {
    SliceOp op;
    op.index = index;
    op.src_worker = src;
    op.dst_worker = dst;
    op.src_piece = 0;
    op.dst_piece = 0;
    op.tensor = 0;
    op.box = std::move(box);
    return op;
  }
  std::map<std::string, RegionBytes> Regions() const {
    return {{"w0.b0", {trainer.data(), static_cast<int64_t>(trainer.size())}}, {"w1.b0", {rollout.data(), static_cast<int64_t>(rollout.size())}}};
  }
};

TEST(OpDigestsTest, SourceAndLandedAgreeAcrossLayoutsAndOnlyLocalSidesAreDigested) {
  Fixture f;
  auto d = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 2, absl::InfiniteFuture());
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->source.size(), 3u);  // n0 sends all three ops
  ASSERT_EQ(d->landed.size(), 2u);  // and receives ops 0 and 1 (op 2 lands on n1)
  EXPECT_EQ(d->source.at(0), d->landed.at(0));
  EXPECT_EQ(d->source.at(1), d->landed.at(1));
  EXPECT_NE(d->source.at(0), d->source.at(1));
  // Ops 0 and 2 read different boxes; the whole tensor's digest is what n1 must land for op 2.
  EXPECT_NE(d->source.at(2), d->source.at(0));
}

TEST(OpDigestsTest, AFlippedBitInStagingChangesOnlyThatOpsLandedDigest) {
  Fixture f;
  auto before = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(before.ok());
  f.rollout[64 + (5 * 4 + 3) * 2] ^= 0x04;  // element (3, 5): op 1
  auto after = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->landed.at(0), before->landed.at(0));
  EXPECT_NE(after->landed.at(1), before->landed.at(1));
  EXPECT_EQ(after->source, before->source);
}

TEST(OpDigestsTest, DeviceMemoryIsSkippedAndRelaysAtCommitUseTheirSource) {
  Fixture f;
  auto regions = f.Regions();
  regions["w1.b0"].host = nullptr;  // GPU staging
  auto d = DigestLocalOps(f.slice, "n0", {}, regions, 1, absl::InfiniteFuture());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->landed.empty());
  EXPECT_EQ(d->skipped_sides, 2);
  // Op 0 left to the commit: its landed digest is its source's (the rollout staging is not read).
  f.rollout.assign(f.rollout.size(), 0);
  auto c = DigestLocalOps(f.slice, "n0", {0}, f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->landed.at(0), c->source.at(0));
  EXPECT_NE(c->landed.at(1), c->source.at(1));
}

TEST(OpDigestsTest, MissingRegionsAndBoxesOutsideTheirRegionAreBugsNamed) {
  Fixture f;
  auto regions = f.Regions();
  regions.erase("w1.b0");
  auto d = DigestLocalOps(f.slice, "n0", {}, regions, 1, absl::InfiniteFuture());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(d.status().message().find("region w1.b0"), std::string::npos) << d.status();
  regions = f.Regions();
  regions["w1.b0"].size = 100;  // the transposed piece ends at byte 112
  d = DigestLocalOps(f.slice, "n0", {}, regions, 1, absl::InfiniteFuture());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(d.status().message().find("reaches byte"), std::string::npos) << d.status();
}

// n0's ExecPlan for the fixture: ops 0 and 1 land in r0's staging (w1.b0) in two buckets, op 2
// goes to n1.
daemon::node::ExecPlan TwoBucketPlan() {
  daemon::node::ExecPlan plan;
  plan.written = {"w1.b0"};
  plan.buckets.resize(2);
  for (uint32_t op : {0u, 1u}) {
    daemon::node::Route r;
    r.bucket = op;
    daemon::node::RouteOp ro;
    ro.op_index = op;
    ro.src_key = "w0.b0";
    ro.dst_key = "w1.b0";
    r.ops.push_back(ro);
    plan.buckets[op].routes.push_back(r);
  }
  daemon::node::Route away;
  daemon::node::RouteOp ro;
  ro.op_index = 2;
  ro.dst_local = false;
  away.ops.push_back(ro);
  plan.buckets[0].routes.push_back(away);
  return plan;
}

TEST(OpDigestTrackerTest, HashedDuringTheBucketsEqualsHashedAfter) {
  Fixture f;
  auto after = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 2, absl::InfiniteFuture());
  ASSERT_TRUE(after.ok()) << after.status();
  const daemon::node::ExecPlan plan = TwoBucketPlan();
  for (bool overlap : {true, false}) {
    OpDigestTracker::Options o;
    o.threads = 2;
    o.overlap = overlap;
    auto t = OpDigestTracker::Start(f.slice, "n0", plan, f.Regions(), o);
    ASSERT_TRUE(t.ok()) << t.status();
    for (const auto& bucket : plan.buckets) {
      for (const auto& r : bucket.routes) (*t)->OnRouteDone(r);
    }
    auto d = (*t)->Finish();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->source, after->source) << overlap;
    EXPECT_EQ(d->landed, after->landed) << overlap;
    EXPECT_EQ(d->bytes, after->bytes);
    EXPECT_EQ((*t)->Finish().status().code(), absl::StatusCode::kFailedPrecondition) << "Finish twice";
  }
}

// A landed box is hashed only once its op's batch completed: bytes that are still wrong when the
// tracker starts (nothing landed yet) and right when the batch completes give the right digest.
TEST(OpDigestTrackerTest, ALandedBoxIsHashedOnlyAfterItsBatchCompleted) {
  Fixture f;
  auto want = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(want.ok());
  const std::vector<uint8_t> landed = f.rollout;
  std::fill(f.rollout.begin(), f.rollout.end(), 0xAB);  // nothing landed yet
  const daemon::node::ExecPlan plan = TwoBucketPlan();
  OpDigestTracker::Options o;
  o.threads = 4;
  auto t = OpDigestTracker::Start(f.slice, "n0", plan, f.Regions(), o);
  ASSERT_TRUE(t.ok()) << t.status();
  f.rollout = landed;  // same buffer size: the regions' pointers stay valid
  for (const auto& bucket : plan.buckets) {
    for (const auto& r : bucket.routes) (*t)->OnRouteDone(r);
  }
  auto d = (*t)->Finish();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->landed, want->landed);
  EXPECT_EQ(d->source, want->source);
}

// n0's plan where op 2 (the whole tensor, t0 -> r1 on n1) goes over the host channel (kPeer).
daemon::node::ExecPlan PeerPlan() {
  daemon::node::ExecPlan plan = TwoBucketPlan();
  daemon::node::Route& away = plan.buckets[0].routes[1];
  away.kind = daemon::node::RouteKind::kPeer;
  daemon::node::RouteOp& ro = away.ops[0];
  ro.src_key = "w0.b0";
  ro.dst_key = "w2.b0";
  ro.copy.shape = {4, 6};
  ro.copy.element_size = 2;
  ro.copy.src = {{}, 0, {6, 1}};
  ro.copy.dst = {{}, 0, {6, 1}};
  return plan;
}

// The digest of op 2's source box with what a transport reported as its one chunk hash.
struct TransportRun {
  OpDigests digests;
  bool attached = false;
  int64_t unit_bytes = 0;
};
TransportRun RunWithTransport(Fixture& f, bool in_transport, bool substituted, std::optional<uint64_t> chunk_hash) {
  const daemon::node::ExecPlan plan = PeerPlan();
  OpDigestTracker::Options o;
  o.threads = 2;
  o.in_transport = in_transport;
  auto t = OpDigestTracker::Start(f.slice, "n0", plan, f.Regions(), o);
  EXPECT_TRUE(t.ok()) << t.status();
  TransportRun run;
  if (!t.ok()) return run;
  const daemon::node::Route& away = plan.buckets[0].routes[1];
  transport::Batch batch;
  batch.ops = {away.ops[0].copy};
  if (substituted) batch.ops[0].shape = {48};  // a delta stream in the op's place
  (*t)->PrepareBatch(away, batch);
  run.attached = batch.unit_hashes != nullptr;
  if (run.attached) {
    run.unit_bytes = batch.unit_hashes->unit_bytes[0];
    // What host_tcp fills in before the batch completes.
    batch.unit_hashes->hashes = {{chunk_hash.value_or(0)}};
    batch.unit_hashes->complete = {static_cast<uint8_t>(chunk_hash.has_value() ? 1 : 0)};
  }
  for (const auto& bucket : plan.buckets) {
    for (const auto& r : bucket.routes) (*t)->OnRouteDone(r);
  }
  auto d = (*t)->Finish();
  EXPECT_TRUE(d.ok()) << d.status();
  if (d.ok()) run.digests = *d;
  return run;
}

// A box the host channel moves is digested from the chunk hashes the transport took as it sent
// it (not hashed from memory again); an op the transport could not hash whole, a delta stream in
// its place, or a tracker not told to (in_transport false) fall back to hashing the memory.
TEST(OpDigestTrackerTest, TransportChunkHashesStandInForHashingTheMemory) {
  Fixture f;
  auto want = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(want.ok());
  const uint64_t chunk = XXH3_64bits_withSeed(f.trainer.data(), f.trainer.size(), 0);
  TransportRun run = RunWithTransport(f, true, false, chunk);
  EXPECT_TRUE(run.attached);
  EXPECT_EQ(run.unit_bytes, ChunkBytes(2));
  EXPECT_EQ(run.digests.source, want->source);
  EXPECT_EQ(run.digests.landed, want->landed);
  EXPECT_EQ(run.digests.transport_bytes, 48);
  // The transport's hash is what counts: another chunk hash (the bytes it sent differ) shows.
  run = RunWithTransport(f, true, false, chunk ^ 1);
  EXPECT_NE(run.digests.source.at(2), want->source.at(2));
  EXPECT_EQ(run.digests.source.at(0), want->source.at(0));
  // Incomplete: hashed from memory.
  run = RunWithTransport(f, true, false, std::nullopt);
  EXPECT_TRUE(run.attached);
  EXPECT_EQ(run.digests.source, want->source);
  EXPECT_EQ(run.digests.transport_bytes, 0);
  // A delta stream in the op's place, or not asked to: nothing attached, hashed from memory.
  for (bool substituted : {true, false}) {
    run = RunWithTransport(f, substituted ? true : false, substituted, chunk ^ 1);
    EXPECT_FALSE(run.attached) << substituted;
    EXPECT_EQ(run.digests.source, want->source) << substituted;
    EXPECT_EQ(run.digests.transport_bytes, 0) << substituted;
  }
}

// n1's plan for op 2 (t0 on n0 -> r1 on n1, a delta op over the host channel): it lands in "w2.b0".
daemon::node::ExecPlan LandingPlan() {
  daemon::node::ExecPlan plan;
  plan.written = {"w2.b0"};
  plan.buckets.resize(1);
  daemon::node::Route r;
  r.kind = daemon::node::RouteKind::kPeer;
  daemon::node::RouteOp ro;
  ro.op_index = 2;
  ro.src_local = false;
  ro.dst_local = true;
  ro.delta = true;
  ro.src_key = "w0.b0";
  ro.dst_key = "w2.b0";
  ro.copy.shape = {4, 6};
  ro.copy.element_size = 2;
  ro.copy.src = {{}, 0, {6, 1}};
  ro.copy.dst = {{}, 0, {6, 1}};
  r.ops.push_back(ro);
  plan.buckets[0].routes.push_back(r);
  return plan;
}

// The chunk hashes of `bytes` as the delta codec hands them over (ChunkStreamHasher, in pieces).
std::vector<uint64_t> CodecChunks(const std::vector<uint8_t>& bytes) {
  ChunkStreamHasher h(2);
  h.Update(bytes.data(), 20);
  h.Update(bytes.data() + 20, bytes.size() - 20);
  return h.Finish();
}

// The delta codec's chunk hashes (DeltaOptions::unit_hashes -> CodecHashes) stand in for hashing a
// delta op's box from memory, on the sender (the box it packed) and on the receiver (what it
// decoded into staging); the box waits for them even once its batch completed. Hashes of other
// bytes show as another digest (a corrupted landing is caught by the coordinator's comparison);
// none handed over (a refused stream resent in full), a side not announced in codec_sides, or a
// route op whose copy is not the side's box: hashed from memory.
TEST(OpDigestTrackerTest, DeltaCodecChunkHashesStandInForHashingTheMemory) {
  Fixture f;
  auto want = DigestLocalOps(f.slice, "n0", {}, f.Regions(), 1, absl::InfiniteFuture());
  ASSERT_TRUE(want.ok());
  // Sender (n0): op 2's source box.
  for (int c = 0; c < 4; ++c) {  // 0: hashes, 1: hashes of other bytes, 2: none, 3: side not announced
    daemon::node::ExecPlan plan = PeerPlan();
    plan.buckets[0].routes[1].ops[0].delta = true;
    OpDigestTracker::Options o;
    o.threads = 2;
    o.in_transport = true;
    if (c != 3) o.codec_sides = {{2, false}};
    auto t = OpDigestTracker::Start(f.slice, "n0", plan, f.Regions(), o);
    ASSERT_TRUE(t.ok()) << t.status();
    std::vector<uint8_t> packed = f.trainer;  // what EncodeOp packed (t0's box is the whole tensor)
    if (c == 1) packed[7] ^= 0x02;
    const std::vector<uint64_t> chunks = CodecChunks(packed);
    (*t)->CodecHashes(2, false, c == 2 ? nullptr : &chunks);
    // A delta stream stood in for the op (or the box had its hashes): nothing for host_tcp to hash.
    const daemon::node::Route& away = plan.buckets[0].routes[1];
    transport::Batch batch;
    batch.ops = {away.ops[0].copy};
    batch.ops[0].shape = {30};
    (*t)->PrepareBatch(away, batch);
    EXPECT_EQ(batch.unit_hashes, nullptr);
    for (const auto& bucket : plan.buckets) {
      for (const auto& r : bucket.routes) (*t)->OnRouteDone(r);
    }
    auto d = (*t)->Finish();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->codec_bytes, c == 0 || c == 1 ? 48 : 0) << c;
    EXPECT_EQ(d->source.at(0), want->source.at(0)) << c;
    if (c == 1) {
      EXPECT_NE(d->source.at(2), want->source.at(2)) << "the codec's hashes are what counts";
    } else {
      EXPECT_EQ(d->source.at(2), want->source.at(2)) << c;
    }
  }
  // Receiver (n1): what landed in r1's staging. The source digest n0 reports is want->source[2].
  for (int c = 0; c < 4; ++c) {  // 0: hashes of what landed, 1: of a corrupted landing, 2: none, 3: copy not the box
    std::vector<uint8_t> staging(48, 0xAB);  // nothing landed yet
    const std::map<std::string, RegionBytes> regions = {{"w2.b0", {staging.data(), 48}}};
    daemon::node::ExecPlan plan = LandingPlan();
    if (c == 3) plan.buckets[0].routes[0].ops[0].copy.dst.strides = {1, 4};
    OpDigestTracker::Options o;
    o.threads = 2;
    o.in_transport = true;
    o.codec_sides = {{2, true}};
    auto t = OpDigestTracker::Start(f.slice, "n1", plan, regions, o);
    ASSERT_TRUE(t.ok()) << t.status();
    // The decode writes staging and hands its hashes over; the route completes later (the executor
    // holds it until the delta tail), or first.
    std::vector<uint8_t> landed = f.trainer;
    if (c == 1) landed[30] ^= 0x40;
    if (c == 2) (*t)->OnRouteDone(plan.buckets[0].routes[0]);
    staging = landed;
    const std::vector<uint64_t> chunks = CodecChunks(staging);
    (*t)->CodecHashes(2, true, c == 2 ? nullptr : &chunks);
    if (c != 2) (*t)->OnRouteDone(plan.buckets[0].routes[0]);
    auto d = (*t)->Finish();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->codec_bytes, c == 0 || c == 1 ? 48 : 0) << c;
    if (c == 1) {
      EXPECT_NE(d->landed.at(2), want->source.at(2)) << "a corrupted landing is caught";
    } else {
      EXPECT_EQ(d->landed.at(2), want->source.at(2)) << c;
    }
  }
}

// A failed version drops its tracker without Finish: the hashing stops and nothing is left running.
TEST(OpDigestTrackerTest, DroppedWithoutFinish) {
  Fixture f;
  auto t = OpDigestTracker::Start(f.slice, "n0", TwoBucketPlan(), f.Regions(), {});
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->OnRouteDone(TwoBucketPlan().buckets[0].routes[0]);
  t->reset();
}

}  // namespace
}  // namespace wb::digest
