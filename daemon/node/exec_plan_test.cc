#include "daemon/node/exec_plan.h"

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/str_cat.h"

namespace wb::daemon::node {
namespace {

using transport::MemoryKind;

// A slice builder: workers with one buffer each, pieces of tensor 0 ([64] float32) or tensor 1
// ([8, 8] float32), ops between them.
class SliceBuilder {
 public:
  SliceBuilder() {
    inventory_.tensors.push_back({"t0", {64}, planner::DType::kF32});
    inventory_.tensors.push_back({"t1", {8, 8}, planner::DType::kF32});
    slice_.inventory = &inventory_;
    slice_.num_buckets = 1;
    slice_.sync = true;
  }
  // Returns the slice worker index.
  uint32_t Worker(const std::string& id, const std::string& node, planner::Role role, int64_t buffer_bytes = 1024) {
    slice_.workers.push_back({id, node, role});
    planner::WorkerLayout l;
    l.buffers.push_back({buffer_bytes});
    slice_.layouts.push_back(l);
    slice_.quantized.push_back(false);
    return static_cast<uint32_t>(slice_.workers.size() - 1);
  }
  // A piece of tensor 0 [begin, end) at `offset`; returns its index.
  int32_t Piece(uint32_t w, int64_t begin, int64_t end, int64_t offset) {
    planner::Piece p;
    p.tensor = 0;
    p.box = {{begin}, {end}};
    p.offset_bytes = offset;
    p.strides = {1};
    slice_.layouts[w].pieces.push_back(p);
    return static_cast<int32_t>(slice_.layouts[w].pieces.size() - 1);
  }
  SliceOp& Op(uint32_t index, uint32_t bucket, uint32_t src, int32_t src_piece, uint32_t dst, int32_t dst_piece, int64_t begin, int64_t end) {
    SliceOp op;
    op.index = index;
    op.bucket = bucket;
    op.src_worker = src;
    op.src_piece = src_piece;
    op.dst_worker = dst;
    op.dst_piece = dst_piece;
    op.tensor = 0;
    op.box = {{begin}, {end}};
    op.bytes = static_cast<uint64_t>(end - begin) * 4;
    slice_.num_buckets = std::max(slice_.num_buckets, bucket + 1);
    slice_.ops.push_back(op);
    return slice_.ops.back();
  }
  Slice& slice() { return slice_; }

  // Facts of node `me`: every local region present in host memory.
  ExecFacts Facts(const std::string& me) const {
    ExecFacts f;
    f.me = me;
    for (uint32_t i = 0; i < slice_.workers.size(); ++i) {
      if (slice_.workers[i].node_id == me) f.kind[RegionKey(i, 0)] = MemoryKind::kHost;
    }
    return f;
  }

 private:
  planner::Inventory inventory_;
  Slice slice_;
};

std::vector<uint32_t> OpIndices(const Route& r) {
  std::vector<uint32_t> out;
  for (const RouteOp& op : r.ops) out.push_back(op.op_index);
  return out;
}

const Route* FindRoute(const BucketPlan& b, RouteKind kind) {
  for (const Route& r : b.routes) {
    if (r.kind == kind) return &r;
  }
  return nullptr;
}

TEST(ExecPlanTest, BothNodesOfAPairDeriveTheSameMirrorBatchInOpIndexOrder) {
  SliceBuilder sb;
  const uint32_t t = sb.Worker("t", "n0", planner::Role::kTrainer);
  const uint32_t r = sb.Worker("r", "n1", planner::Role::kRollout);
  const int32_t tp = sb.Piece(t, 0, 64, 0);
  const int32_t rp = sb.Piece(r, 0, 64, 0);
  // Listed out of index order; both sides must batch them by op index.
  sb.Op(7, 0, t, tp, r, rp, 32, 48);
  sb.Op(2, 0, t, tp, r, rp, 0, 16);
  sb.Op(5, 0, t, tp, r, rp, 16, 32);
  auto a = MakeExecPlan(sb.slice(), sb.Facts("n0"));
  auto b = MakeExecPlan(sb.slice(), sb.Facts("n1"));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const Route* ra = FindRoute(a->buckets[0], RouteKind::kPeer);
  const Route* rb = FindRoute(b->buckets[0], RouteKind::kPeer);
  ASSERT_NE(ra, nullptr);
  ASSERT_NE(rb, nullptr);
  EXPECT_EQ(OpIndices(*ra), (std::vector<uint32_t>{2, 5, 7}));
  EXPECT_EQ(OpIndices(*ra), OpIndices(*rb));
  for (size_t i = 0; i < ra->ops.size(); ++i) {
    EXPECT_EQ(ra->ops[i].copy.shape, rb->ops[i].copy.shape);
    EXPECT_EQ(ra->ops[i].copy.src.offset_bytes, rb->ops[i].copy.src.offset_bytes);
    EXPECT_EQ(ra->ops[i].copy.dst.offset_bytes, rb->ops[i].copy.dst.offset_bytes);
    EXPECT_TRUE(ra->ops[i].src_local && !ra->ops[i].dst_local);
    EXPECT_TRUE(!rb->ops[i].src_local && rb->ops[i].dst_local);
  }
  EXPECT_EQ(ra->channel, "n1");
  EXPECT_EQ(rb->channel, "n0");
  EXPECT_EQ(ra->incoming, 0);
  EXPECT_EQ(rb->incoming, 48 * 4);
  EXPECT_EQ(a->cross_keys, (std::set<std::string>{"w0.b0"}));
  EXPECT_EQ(b->cross_keys, (std::set<std::string>{"w1.b0"}));
}

// Three nodes, host channels and nccl lane pairs between each pair: every node lists its channels in
// the one global order, so the smallest unfinished channel always has both of its nodes at it.
TEST(ExecPlanTest, ChannelsAreSetUpInOneGlobalOrderSmallestFirst) {
  SliceBuilder sb;
  std::map<std::string, uint32_t> trainer, rollout;
  for (const std::string n : {"a", "b", "c"}) {
    trainer[n] = sb.Worker("t" + n, n, planner::Role::kTrainer);
    rollout[n] = sb.Worker("r" + n, n, planner::Role::kRollout);
    sb.Piece(trainer[n], 0, 64, 0);
    sb.Piece(rollout[n], 0, 64, 0);
  }
  uint32_t index = 0;
  int gpu = 0;
  for (const std::string from : {"a", "b", "c"}) {
    for (const std::string to : {"a", "b", "c"}) {
      if (from == to) continue;
      sb.Op(index++, 0, trainer[from], 0, rollout[to], 0, 0, 8);  // host channel
      SliceOp& op = sb.Op(index++, 0, trainer[from], 0, rollout[to], 0, 8, 16);
      op.nccl = true;
      op.nccl_src_device = gpu % 2;
      op.nccl_dst_device = (gpu + 1) % 2;
      ++gpu;
    }
  }
  // nccl regions must be on one lane each: give every op a lane fixed by its worker (region).
  for (SliceOp& op : sb.slice().ops) {
    if (!op.nccl) continue;
    op.nccl_src_device = static_cast<int>(op.src_worker % 2);
    op.nccl_dst_device = static_cast<int>(op.dst_worker % 2);
  }
  std::map<std::string, std::vector<ChannelPlan>> channels;
  for (const std::string n : {"a", "b", "c"}) {
    ExecFacts f = sb.Facts(n);
    f.lanes = {0, 1};
    auto p = MakeExecPlan(sb.slice(), f);
    ASSERT_TRUE(p.ok()) << p.status();
    channels[n] = p->channels;
    for (size_t i = 1; i < p->channels.size(); ++i) EXPECT_LT(p->channels[i - 1].order, p->channels[i].order);
  }
  // b: every channel to a before every channel to c; host before nccl.
  ASSERT_GE(channels["b"].size(), 2u);
  EXPECT_EQ(channels["b"].front().peer, "a");
  EXPECT_EQ(channels["b"].front().mine, "host_tcp");
  EXPECT_EQ(channels["b"].back().peer, "c");
  // The channels a node shares with a peer come in the same order on both ends (as mirror names).
  for (const auto& [x, y] : std::vector<std::pair<std::string, std::string>>{{"a", "b"}, {"a", "c"}, {"b", "c"}}) {
    std::vector<std::tuple<std::string, std::string, int, int, int>> ox, oy;
    for (const ChannelPlan& c : channels[x]) {
      if (c.peer == y) ox.push_back(c.order);
    }
    for (const ChannelPlan& c : channels[y]) {
      if (c.peer == x) oy.push_back(c.order);
    }
    EXPECT_EQ(ox, oy) << x << "<->" << y;
    EXPECT_FALSE(ox.empty());
  }
}

// docs/status.md next step 23: both nodes of a channel must Connect in the same round, and no
// other execution or channel between them may share it (a Connect of an aborted version would
// take the next one's connections). Both ends derive it from what they hold in SetupPeer.
TEST(ExecPlanTest, BothNodesOfAChannelDeriveTheSameConnectRoundAndNoOtherChannelSharesIt) {
  ChannelPlan host_ab{"b", "host_tcp", "host_tcp", -1, -1, ChannelName("b", "host_tcp", "host_tcp"), {}};
  ChannelPlan host_ba{"a", "host_tcp", "host_tcp", -1, -1, ChannelName("a", "host_tcp", "host_tcp"), {}};
  ChannelPlan lane_ab{"b", "nccl/0", "nccl/1", 0, 1, ChannelName("b", "nccl/0", "nccl/1"), {}};
  ChannelPlan lane_ba{"a", "nccl/1", "nccl/0", 1, 0, ChannelName("a", "nccl/1", "nccl/0"), {}};
  ChannelPlan lane2_ab{"b", "nccl/1", "nccl/0", 1, 0, ChannelName("b", "nccl/1", "nccl/0"), {}};
  EXPECT_EQ(ConnectRound("m", 35, 2, "a", host_ab), ConnectRound("m", 35, 2, "b", host_ba));
  EXPECT_EQ(ConnectRound("m", 35, 2, "a", lane_ab), ConnectRound("m", 35, 2, "b", lane_ba));
  std::set<std::string> rounds = {ConnectRound("m", 35, 2, "a", host_ab), ConnectRound("m", 36, 2, "a", host_ab),
                                  ConnectRound("m", 35, 3, "a", host_ab), ConnectRound("m2", 35, 2, "a", host_ab),
                                  ConnectRound("m", 35, 2, "a", lane_ab), ConnectRound("m", 35, 2, "a", lane2_ab)};
  EXPECT_EQ(rounds.size(), 6u) << "two executions or channels share a round";
  // Long ids stay within the transport's bound, still agree, and still tell versions apart.
  const std::string model(300, 'm');
  const std::string node_a(200, 'a'), node_b(200, 'b');
  ChannelPlan long_ab{node_b, "host_tcp", "host_tcp", -1, -1, node_b, {}};
  ChannelPlan long_ba{node_a, "host_tcp", "host_tcp", -1, -1, node_a, {}};
  for (const std::string& id : {model, std::string("m")}) {
    const std::string r = ConnectRound(id, 35, 2, node_a, long_ab);
    EXPECT_LE(r.size(), transport::kMaxConnectRoundBytes);
    EXPECT_EQ(r, ConnectRound(id, 35, 2, node_b, long_ba));
    EXPECT_NE(r, ConnectRound(id, 36, 2, node_a, long_ab));
  }
  EXPECT_LE(ConnectRound(model, 35, 2, "a", host_ab).size(), transport::kMaxConnectRoundBytes);
  EXPECT_NE(ConnectRound(model, 35, 2, "a", host_ab), ConnectRound(model + "x", 35, 2, "a", host_ab));
}

struct RelayCase {
  SliceBuilder sb;
  uint32_t t, a, b;
  int32_t ap, bp;
  RelayCase() {
    t = sb.Worker("t", "n0", planner::Role::kTrainer);
    a = sb.Worker("A", "n1", planner::Role::kRollout);
    b = sb.Worker("B", "n1", planner::Role::kRollout);
    sb.Piece(t, 0, 64, 0);
    ap = sb.Piece(a, 0, 64, 0);
    bp = sb.Piece(b, 0, 64, 0);
    sb.Op(0, 0, t, 0, a, ap, 0, 64);
    sb.Op(1, 1, a, ap, b, bp, 0, 32);
    sb.Op(2, 1, a, ap, b, bp, 32, 64);
  }
  ExecFacts Facts(bool host_live = true) {
    ExecFacts f = sb.Facts("n1");
    if (host_live) f.host_live_sync = {a, b};
    return f;
  }
};

TEST(ExecPlanTest, RelayIsLeftToTheCommitWhenItFillsAWholeUnreadPieceOfAHostLiveSyncRollout) {
  RelayCase c;
  auto p = MakeExecPlan(c.sb.slice(), c.Facts());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->at_commit, (std::set<uint32_t>{1, 2}));
  ASSERT_EQ(p->relays_at_commit.count("B"), 1u);
  EXPECT_EQ(p->relays_at_commit.at("B").size(), 2u);
  EXPECT_EQ(p->relays_at_commit.at("B")[0].src_worker, "A");
  EXPECT_EQ(p->pieces_at_commit.at("B"), (std::set<int32_t>{c.bp}));
  EXPECT_EQ(p->relay_bytes_at_commit, 64u * 4);
  EXPECT_TRUE(p->buckets[1].routes.empty());  // the bucket skips them
}

TEST(ExecPlanTest, RelayIsNotLeftToTheCommitWithoutHostLiveBuffers) {
  RelayCase c;
  auto p = MakeExecPlan(c.sb.slice(), c.Facts(/*host_live=*/false));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->at_commit.empty());
  EXPECT_EQ(p->relay_bytes_at_commit, 0u);
}

TEST(ExecPlanTest, RelayIsNotLeftToTheCommitWhenItFillsPartOfAPiece) {
  RelayCase c;
  c.sb.slice().ops.pop_back();  // op 2 gone: B's piece only half filled by relays
  auto p = MakeExecPlan(c.sb.slice(), c.Facts());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->at_commit.empty());
}

TEST(ExecPlanTest, RelayIsNotLeftToTheCommitWhenItsDestinationPieceIsRead) {
  RelayCase c;
  const uint32_t d = c.sb.Worker("D", "n1", planner::Role::kRollout);
  c.sb.Piece(d, 0, 64, 0);
  c.sb.Op(3, 2, c.b, c.bp, d, 0, 0, 64);  // B's piece relayed on: B's staging must hold it
  ExecFacts f = c.Facts();
  f.kind[RegionKey(d, 0)] = MemoryKind::kHost;
  f.host_live_sync.insert(d);
  auto p = MakeExecPlan(c.sb.slice(), f);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->at_commit, (std::set<uint32_t>{3}));  // D's piece is whole and unread; B's is read
}

TEST(ExecPlanTest, RelayIsNotLeftToTheCommitOutsideSyncModeOrIntoAQuantisedRollout) {
  {
    RelayCase c;
    c.sb.slice().sync = false;
    auto p = MakeExecPlan(c.sb.slice(), c.Facts());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(p->at_commit.empty());
  }
  {
    RelayCase c;
    c.sb.slice().quantized[c.b] = true;
    auto p = MakeExecPlan(c.sb.slice(), c.Facts());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(p->at_commit.empty());
  }
  {
    RelayCase c;
    ExecFacts f = c.Facts();
    f.kind[RegionKey(c.b, 0)] = MemoryKind::kCuda;  // B staged on its GPU
    auto p = MakeExecPlan(c.sb.slice(), f);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(p->at_commit.empty());
  }
}

// Relays after the deltas: one-step-off (no relays at the commit), op 0 into A is a delta. The
// relays out of the box it writes go into their bucket's after_deltas route (the executor posts it
// once every stream was decoded and checked and every refused op resent); without the delta they
// are ordinary same-node copies, and a relay reading another box is not held back.
TEST(ExecPlanTest, RelaysOutOfBoxesDeltasWriteWaitForTheDeltaTail) {
  RelayCase c;
  c.sb.slice().sync = false;
  c.sb.slice().ops[0].delta = true;
  c.sb.slice().ops[0].box = {{0}, {32}};  // the delta writes A's [0, 32)
  c.sb.slice().ops[0].bytes = 128;
  c.sb.Op(3, 0, c.t, 0, c.a, c.ap, 32, 64);  // A's [32, 64) in full
  auto p = MakeExecPlan(c.sb.slice(), c.Facts(false));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->buckets.size(), 2u);
  const Route* peer = FindRoute(p->buckets[0], RouteKind::kPeer);
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(peer->ops[0].delta);
  std::vector<std::pair<std::vector<uint32_t>, bool>> relays;
  for (const Route& r : p->buckets[1].routes) relays.push_back({OpIndices(r), r.after_deltas});
  EXPECT_EQ(relays, (std::vector<std::pair<std::vector<uint32_t>, bool>>{{{1}, true}, {{2}, false}}))
      << "op 1 reads the delta's box, op 2 the full one";
  c.sb.slice().ops[0].delta = false;
  p = MakeExecPlan(c.sb.slice(), c.Facts(false));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->buckets[1].routes.size(), 1u);
  EXPECT_FALSE(p->buckets[1].routes[0].after_deltas);
  EXPECT_EQ(OpIndices(p->buckets[1].routes[0]), (std::vector<uint32_t>{1, 2}));
}

TEST(ExecPlanTest, ABatchReadingAWrittenRegionWaitsForEarlierBuckets) {
  RelayCase c;
  auto p = MakeExecPlan(c.sb.slice(), c.Facts(/*host_live=*/false));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->written, (std::set<std::string>{RegionKey(c.a, 0), RegionKey(c.b, 0)}));
  const Route* in = FindRoute(p->buckets[0], RouteKind::kPeer);  // trainer -> A: reads a source
  ASSERT_NE(in, nullptr);
  EXPECT_FALSE(in->reads_written);
  const Route* relay = FindRoute(p->buckets[1], RouteKind::kHost);  // A -> B: reads A's staging
  ASSERT_NE(relay, nullptr);
  EXPECT_TRUE(relay->reads_written);
  EXPECT_EQ(relay->incoming, 64 * 4);
  // The trainer's node sends without waiting: nothing it reads is written by the version.
  auto t = MakeExecPlan(c.sb.slice(), c.sb.Facts("n0"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->written.empty());
  EXPECT_FALSE(FindRoute(t->buckets[0], RouteKind::kPeer)->reads_written);
}

TEST(ExecPlanTest, GatherStagingIsWrittenSoItsReadersWait) {
  SliceBuilder sb;
  const uint32_t t = sb.Worker("t", "n0", planner::Role::kTrainer);
  const uint32_t r = sb.Worker("r", "n1", planner::Role::kRollout);
  sb.Piece(t, 0, 64, 0);
  sb.Piece(r, 0, 64, 0);
  sb.slice().hosts_gather = true;
  SliceOp& read = sb.Op(0, 1, t, -1, r, 0, 0, 64);  // a read of gathered data (staged source)
  read.has_staging_box = true;
  read.staging_box = {{0}, {64}};
  read.staging_offset = 256;
  ExecFacts f = sb.Facts("n0");
  f.kind["g"] = MemoryKind::kHost;
  auto p = MakeExecPlan(sb.slice(), f);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->written.count("g"), 1u);
  const Route* route = FindRoute(p->buckets[1], RouteKind::kPeer);
  ASSERT_NE(route, nullptr);
  EXPECT_TRUE(route->reads_written);
  EXPECT_EQ(route->ops[0].src_key, "g");
  EXPECT_EQ(route->ops[0].copy.src.offset_bytes, 256);
}

TEST(ExecPlanTest, NcclBucketsKeepTheBarrierAndEachGpuRunsItsLanePairsInTheGlobalOrder) {
  SliceBuilder sb;
  const uint32_t t = sb.Worker("t", "n1", planner::Role::kTrainer);
  const uint32_t r0 = sb.Worker("r0", "n0", planner::Role::kRollout);
  const uint32_t r2 = sb.Worker("r2", "n2", planner::Role::kRollout);
  const uint32_t r3 = sb.Worker("r3", "n2", planner::Role::kRollout);
  for (uint32_t w : {t, r0, r2, r3}) sb.Piece(w, 0, 64, 0);
  // GPU 0 of n1 sends to n2 GPU 1, n2 GPU 0 and n0 GPU 5, in an order the global order reverses.
  auto nccl = [&](SliceOp& op, int src, int dst) {
    op.nccl = true;
    op.nccl_src_device = src;
    op.nccl_dst_device = dst;
  };
  nccl(sb.Op(0, 0, t, 0, r2, 0, 0, 8), 0, 1);
  nccl(sb.Op(1, 0, t, 0, r3, 0, 0, 8), 0, 0);
  nccl(sb.Op(2, 0, t, 0, r0, 0, 0, 8), 0, 5);
  sb.Op(3, 0, t, 0, r0, 0, 8, 16);  // and the host channel to n0
  ExecFacts f = sb.Facts("n1");
  f.lanes = {0};
  f.kind[RegionKey(t, 0)] = MemoryKind::kCuda;
  auto p = MakeExecPlan(sb.slice(), f);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->buckets[0].has_nccl);
  auto sched = LaneSchedule(p->buckets[0]);
  ASSERT_EQ(sched.size(), 1u);
  std::vector<std::string> order;
  for (const Route* r : sched.at(0)) order.push_back(r->channel);
  // (n0, n1, GPU 5 on n0, GPU 0 on n1) < (n1, n2, 0, 0) < (n1, n2, 0, 1).
  EXPECT_EQ(order, (std::vector<std::string>{"n0\nnccl/0>nccl/5", "n2\nnccl/0>nccl/0", "n2\nnccl/0>nccl/1"}));
  for (const Route* r : sched.at(0)) EXPECT_FALSE(r->checksum);  // NCCL has none
  EXPECT_TRUE(FindRoute(p->buckets[0], RouteKind::kPeer)->checksum);
  // The peer n2 derives the same relative order for its lane pairs with n1.
  ExecFacts f2 = sb.Facts("n2");
  f2.lanes = {0, 1};
  auto p2 = MakeExecPlan(sb.slice(), f2);
  ASSERT_TRUE(p2.ok()) << p2.status();
  std::vector<std::tuple<std::string, std::string, int, int>> mine, theirs;
  for (const Route* r : sched.at(0)) {
    if (r->peer == "n2") mine.push_back(r->order);
  }
  for (auto& [gpu, seq] : LaneSchedule(p2->buckets[0])) {
    for (const Route* r : seq) theirs.push_back(r->order);
  }
  std::sort(theirs.begin(), theirs.end());
  EXPECT_EQ(mine, theirs);
}

TEST(ExecPlanTest, ErrorsNameTheLaneTheRegionAndTheRollout) {
  SliceBuilder sb;
  const uint32_t t = sb.Worker("t", "n0", planner::Role::kTrainer);
  const uint32_t r = sb.Worker("r", "n1", planner::Role::kRollout);
  sb.Piece(t, 0, 64, 0);
  sb.Piece(r, 0, 64, 0);
  SliceOp& op = sb.Op(0, 0, t, 0, r, 0, 0, 32);
  op.nccl = true;
  op.nccl_src_device = 3;
  op.nccl_dst_device = 0;
  // An op over a lane the node does not have.
  auto p = MakeExecPlan(sb.slice(), sb.Facts("n0"));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(p.status().message().find("nccl lane nccl/3"), std::string::npos) << p.status();
  // One region on two lanes.
  SliceOp& op2 = sb.Op(1, 0, t, 0, r, 0, 32, 64);
  op2.nccl = true;
  op2.nccl_src_device = 2;
  op2.nccl_dst_device = 0;
  ExecFacts f = sb.Facts("n0");
  f.lanes = {2, 3};
  p = MakeExecPlan(sb.slice(), f);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("region w0.b0"), std::string::npos) << p.status();
  EXPECT_NE(p.status().message().find("one lane per region"), std::string::npos) << p.status();
  // A quantised rollout's buffer routed over nccl.
  sb.slice().ops.pop_back();
  sb.slice().quantized[r] = true;
  ExecFacts fr = sb.Facts("n1");
  fr.lanes = {0};
  p = MakeExecPlan(sb.slice(), fr);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(p.status().message().find("rollout r holds quantised pieces"), std::string::npos) << p.status();
}

TEST(ExecPlanTest, ErrorsForMissingTransportsAndGpuStagingFedByAnotherNode) {
  SliceBuilder sb;
  const uint32_t t = sb.Worker("t", "n0", planner::Role::kTrainer);
  const uint32_t r = sb.Worker("r", "n1", planner::Role::kRollout);
  sb.Piece(t, 0, 64, 0);
  sb.Piece(r, 0, 64, 0);
  sb.Op(0, 0, t, 0, r, 0, 0, 64);
  ExecFacts f = sb.Facts("n0");
  f.have_cross = false;
  auto p = MakeExecPlan(sb.slice(), f);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("node n0 has no cross-node host transport"), std::string::npos) << p.status();
  ExecFacts g = sb.Facts("n1");
  g.kind[RegionKey(r, 0)] = MemoryKind::kCuda;
  p = MakeExecPlan(sb.slice(), g);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("receives from another node but is staged on a GPU"), std::string::npos) << p.status();
  // A local region that is not there.
  ExecFacts h = sb.Facts("n1");
  h.kind.clear();
  p = MakeExecPlan(sb.slice(), h);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("region w1.b0 missing on node n1"), std::string::npos) << p.status();
  // An op naming a tensor that is not in the inventory.
  sb.Op(2, 0, t, 0, r, 0, 0, 8).tensor = 5;
  p = MakeExecPlan(sb.slice(), sb.Facts("n1"));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("op 2: tensor 5 is not in the model's inventory (2 tensors)"), std::string::npos) << p.status();
  sb.slice().ops.pop_back();
  // An op naming a worker that is not in the slice.
  sb.Op(1, 0, 9, 0, r, 0, 0, 8);
  p = MakeExecPlan(sb.slice(), sb.Facts("n1"));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("op 1: slice worker 9 is not in the slice"), std::string::npos) << p.status();
}

TEST(ExecPlanTest, SameNodeCopiesGoToTheHostOrCudaRouteByMemoryKind) {
  SliceBuilder sb;
  const uint32_t t = sb.Worker("t", "n0", planner::Role::kTrainer);
  const uint32_t h = sb.Worker("h", "n0", planner::Role::kRollout);
  const uint32_t g = sb.Worker("g", "n0", planner::Role::kRollout);
  for (uint32_t w : {t, h, g}) sb.Piece(w, 0, 64, 0);
  sb.Op(0, 0, t, 0, h, 0, 0, 64);
  sb.Op(1, 0, t, 0, g, 0, 0, 64);
  ExecFacts f = sb.Facts("n0");
  f.kind[RegionKey(g, 0)] = MemoryKind::kCuda;
  auto p = MakeExecPlan(sb.slice(), f);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->buckets[0].routes.size(), 2u);
  EXPECT_EQ(p->buckets[0].routes[0].kind, RouteKind::kHost);
  EXPECT_EQ(p->buckets[0].routes[1].kind, RouteKind::kCuda);
  EXPECT_EQ(p->host_keys, (std::set<std::string>{"w0.b0", "w1.b0"}));
  EXPECT_EQ(p->cuda_keys, (std::set<std::string>{"w0.b0", "w2.b0"}));
  EXPECT_TRUE(p->channels.empty());
}

TEST(ExecPlanTest, ChannelNamesRoundTrip) {
  EXPECT_EQ(ChannelName("n1", "host_tcp", "host_tcp"), "n1");
  EXPECT_EQ(ChannelName("n1", "nccl/0", "nccl/3"), "n1\nnccl/0>nccl/3");
  EXPECT_EQ(ChannelTransportName("n1\nnccl/0>nccl/3"), "nccl/0");
  EXPECT_EQ(ChannelTransportName("n1"), "");
}

}  // namespace
}  // namespace wb::daemon::node
