#include "transport/registry.h"

#include <memory>

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

struct TestRegion : RegionRecord {
  int extra = 0;
};

struct TestBatch {
  uint64_t id = 0;
  absl::Status status;
  bool done = false;
};

TestRegion Local(const char* label, int64_t size) {
  TestRegion r;
  r.local = true;
  r.size = size;
  r.label = label;
  r.owner_instance = "me";
  return r;
}

TestRegion Import(const char* label, const char* owner) {
  TestRegion r;
  r.local = false;
  r.size = 64;
  r.label = label;
  r.owner_instance = owner;
  return r;
}

TEST(RegionRegistryTest, AddFindRelease) {
  RegionRegistry<TestRegion> reg("kindx");
  TestRegion r = Local("buf", 128);
  r.extra = 7;
  reg.Add(3, r);
  auto found = reg.Find(RegionHandle{3});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ((*found)->label, "buf");
  EXPECT_EQ((*found)->extra, 7);
  EXPECT_EQ(reg.Get(4), nullptr);
  auto missing = reg.Find(RegionHandle{4});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "kindx: unknown region 4");
  EXPECT_TRUE(reg.Release(RegionHandle{3}).ok());
  EXPECT_EQ(reg.Release(RegionHandle{3}).code(), absl::StatusCode::kNotFound);
}

TEST(RegionRegistryTest, PinnedRegionCannotBeReleasedUntilUnpinned) {
  RegionRegistry<TestRegion> reg("kindx");
  reg.Add(1, Local("a", 8));
  reg.Add(2, Local("b", 8));
  reg.Pin({1, 2, 1});  // one count per occurrence
  EXPECT_EQ(reg.Get(1)->pinned, 2);
  absl::Status s = reg.Release(RegionHandle{1});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "kindx: region 'a' is used by 2 unfinished batch(es)");
  EXPECT_EQ(reg.CheckNotInUse(*reg.Get(2)).code(), absl::StatusCode::kFailedPrecondition);
  reg.Erase(2);     // a backend may drop a region itself
  reg.Unpin({1, 2, 1});  // ids no longer present are skipped
  EXPECT_EQ(reg.Get(1)->pinned, 0);
  EXPECT_TRUE(reg.Release(RegionHandle{1}).ok());
  EXPECT_TRUE(reg.all().empty());
}

TEST(RegionRegistryTest, FindForOpNamesBatchOpAndSide) {
  RegionRegistry<TestRegion> reg("kindx");
  auto s = reg.FindForOp(RegionHandle{9}, "kindx batch 5", 2, "destination");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(), "kindx batch 5 op 2: unknown destination region 9");
  reg.Add(9, Local("x", 1));
  EXPECT_TRUE(reg.FindForOp(RegionHandle{9}, "kindx batch 5", 2, "destination").ok());
}

TEST(TwoSidedOpIsSendTest, DirectionAndPeerChecks) {
  const TestRegion local = Local("l", 8), remote = Import("r", "peerA");
  auto send = TwoSidedOpIsSend(local, remote, "b 1", 0, "peerA");
  ASSERT_TRUE(send.ok()) << send.status();
  EXPECT_TRUE(*send);
  auto recv = TwoSidedOpIsSend(remote, local, "b 1", 0, "peerA");
  ASSERT_TRUE(recv.ok()) << recv.status();
  EXPECT_FALSE(*recv);
  auto both_local = TwoSidedOpIsSend(local, local, "b 1", 3, "peerA");
  EXPECT_EQ(both_local.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(both_local.status().message(), "b 1 op 3: needs exactly one local and one imported region");
  auto wrong_peer = TwoSidedOpIsSend(local, remote, "b 1", 4, "peerB");
  EXPECT_EQ(wrong_peer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wrong_peer.status().message(), "b 1 op 4: region 'r' was exported by peerA, not by the batch's peer peerB");
}

TEST(BasicRegionInfoTest, CopiesCommonFields) {
  RegionInfo info = BasicRegionInfo(Import("r", "peerA"));
  EXPECT_FALSE(info.local);
  EXPECT_EQ(info.size_bytes, 64);
  EXPECT_EQ(info.owner_instance, "peerA");
  EXPECT_EQ(info.label, "r");
  EXPECT_EQ(info.peer, kNoPeer);
}

TEST(BatchTableTest, PollFollowsFinishedAndStatusRetireForgets) {
  BatchTable<TestBatch> table("kindx");
  auto b = std::make_shared<TestBatch>();
  b->id = 11;
  table.Add(b);
  auto finished = [](TestBatch* x) { return x->done; };
  auto st = table.Poll(BatchId{11}, finished);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, BatchState::kRunning);
  b->done = true;
  st = table.Poll(BatchId{11}, finished);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, BatchState::kDone);
  b->status = absl::DataLossError("bad");
  EXPECT_EQ(table.Poll(BatchId{11}, finished).status().code(), absl::StatusCode::kDataLoss);
  auto found = table.Find(BatchId{11});
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->get(), b.get());
  table.Retire(11);
  EXPECT_EQ(table.Find(BatchId{11}).status().message(), "kindx: unknown batch 11");
  EXPECT_EQ(table.Poll(BatchId{11}, finished).status().code(), absl::StatusCode::kNotFound);
}

TEST(PeerInstancesTest, SameInstanceSameIdRemoveForgets) {
  PeerInstances peers("kindx");
  EXPECT_EQ(peers.Find("a"), kNoPeer);
  peers.Add(4, "a");
  peers.Add(6, "b");
  EXPECT_EQ(peers.Find("a"), PeerId{4});
  EXPECT_EQ(peers.PeerOf("b"), PeerId{6});
  EXPECT_EQ(peers.PeerOf("c"), kNoPeer);
  ASSERT_NE(peers.Instance(PeerId{6}), nullptr);
  EXPECT_EQ(*peers.Instance(PeerId{6}), "b");
  EXPECT_EQ(peers.Instance(PeerId{5}), nullptr);
  EXPECT_TRUE(peers.Remove(PeerId{4}).ok());
  absl::Status again = peers.Remove(PeerId{4});
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.message(), "kindx: unknown peer 4");
  EXPECT_EQ(peers.Find("a"), kNoPeer);
}

// CancelRound's memory: the newest rounds kept, the oldest forgotten first; a round cancelled
// again becomes the newest; the empty round and over-long ones refused.
TEST(CancelledRoundsTest, RemembersTheNewestRounds) {
  CancelledRounds c(/*remember=*/3);
  for (const char* r : {"a", "b", "c"}) c.Add(r);
  c.Add("a");  // "a" again: newest, so "b" is the oldest now
  c.Add("d");
  EXPECT_TRUE(c.Has("a"));
  EXPECT_FALSE(c.Has("b"));
  EXPECT_TRUE(c.Has("c"));
  EXPECT_TRUE(c.Has("d"));
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(CancelledRounds::Check("k", "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CancelledRounds::Check("k", std::string(kMaxConnectRoundBytes + 1, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CancelledRounds::Check("k", std::string(kMaxConnectRoundBytes, 'x')).ok());
  absl::Status e = CancelledRounds::Error("k", "peer-1", "round r");
  EXPECT_EQ(e.code(), absl::StatusCode::kCancelled);
  EXPECT_NE(e.message().find("'round r'"), std::string::npos) << e;
  CancelledRounds defaults;
  for (size_t i = 0; i <= kMinRememberedCancelledRounds; ++i) defaults.Add(absl::StrCat("r", i));
  EXPECT_EQ(defaults.size(), kMinRememberedCancelledRounds);
  EXPECT_FALSE(defaults.Has("r0"));
  EXPECT_TRUE(defaults.Has("r1"));
}

}  // namespace
}  // namespace wb::transport
