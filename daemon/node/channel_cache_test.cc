#include "daemon/node/channel_cache.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace wb::daemon::node {
namespace {

using transport::PeerId;

// Stand-ins for two executions of one model running on the node at once (the next version and a
// catch-up, say): a holder is only an address.
int first_execution = 1, second_execution = 2;
const ChannelCache::Holder a = &first_execution;
const ChannelCache::Holder b = &second_execution;

std::vector<uint64_t> Ids(const std::vector<ChannelCache::Keyed>& v) {
  std::vector<uint64_t> out;
  for (const ChannelCache::Keyed& k : v) out.push_back(k.id.id);
  return out;
}

TEST(ChannelCacheTest, AChannelIsReusedOnlyWithTheSamePeerInstance) {
  ChannelCache c;
  EXPECT_EQ(c.ForPeer("m", "n1", "i1", a).reuse, transport::kNoPeer);
  EXPECT_EQ(c.Put("m", "n1", PeerId{7}, "i1", a), transport::kNoPeer);
  EXPECT_EQ(c.ForPeer("m", "n1", "i1", b).reuse, PeerId{7});
  EXPECT_EQ(c.Holders("m", "n1", PeerId{7}), 2u);  // the reuse holds it from the lookup on
  // Per model and channel.
  EXPECT_EQ(c.ForPeer("other", "n1", "i1", b).reuse, transport::kNoPeer);
  EXPECT_EQ(c.ForPeer("m", "n1\nnccl/0>nccl/1", "i1", b).reuse, transport::kNoPeer);
}

// A look-up names the round the cached channel was connected in (the receiver of ExchangeRegions
// compares it with the caller's), the newest channel's after a replacement.
TEST(ChannelCacheTest, ALookUpNamesTheRoundOfTheCachedChannel) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{7}, "i1", a, "round x");
  ChannelCache::Lookup x = c.ForPeer("m", "n1", "i1", b);
  EXPECT_EQ(x.reuse, PeerId{7});
  EXPECT_EQ(x.round, "round x");
  c.Put("m", "n1", PeerId{8}, "i1", a, "round z");
  ChannelCache::Lookup z = c.ForPeer("m", "n1", "i1", b);
  EXPECT_EQ(z.reuse, PeerId{8});
  EXPECT_EQ(z.round, "round z");
  c.Put("m", "n1", PeerId{9}, "i1", a);  // the empty round (a peer built before rounds)
  EXPECT_EQ(c.ForPeer("m", "n1", "i1", b).round, "");
}

// The peer restarted: its old channel is stale, never reused; it leaves the cache at once, and is
// to be disconnected now when nothing runs on it, else by its last holder.
TEST(ChannelCacheTest, AStaleChannelIsDisconnectedOnceNothingRunsOnIt) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{7}, "i1", a);
  ChannelCache::Lookup l = c.ForPeer("m", "n1", "i2", b);
  EXPECT_EQ(l.reuse, transport::kNoPeer);
  EXPECT_EQ(l.stale, transport::kNoPeer) << "execution a still runs on it";
  EXPECT_FALSE(c.Find("m", "n1").has_value());
  EXPECT_EQ(Ids(c.ReleaseAll(a, /*forget=*/false)), std::vector<uint64_t>{7});

  c.Put("m", "n1", PeerId{8}, "i2", a);
  c.ReleaseAll(a, false);
  EXPECT_EQ(c.ForPeer("m", "n1", "i3", b).stale, PeerId{8});
  EXPECT_TRUE(c.All().empty());
}

// The leak the daemon had: a channel replaced in the cache while a version ran on it was left
// connected for good. Now Put says to disconnect it when nothing holds it, else the last holder's
// release does.
TEST(ChannelCacheTest, AReplacedChannelIsDisconnectedWhenItsLastUserEnds) {
  ChannelCache c;
  EXPECT_EQ(c.Put("m", "n1", PeerId{7}, "i1", a), transport::kNoPeer);
  EXPECT_EQ(c.Put("m", "n1", PeerId{7}, "i1", a), transport::kNoPeer);  // the same one again
  // b connects anew while a runs on 7: 7 stays connected for a.
  EXPECT_EQ(c.Put("m", "n1", PeerId{9}, "i1", b), transport::kNoPeer);
  EXPECT_EQ(c.Find("m", "n1")->id, PeerId{9});
  EXPECT_TRUE(c.ReleaseAll(b, false).empty()) << "9 is cached: kept for the next version";
  EXPECT_EQ(Ids(c.ReleaseAll(a, false)), std::vector<uint64_t>{7});
  EXPECT_EQ(Ids(c.All()), std::vector<uint64_t>{9});
  // Nothing holds 9 when 11 replaces it: disconnect it now.
  EXPECT_EQ(c.Put("m", "n1", PeerId{11}, "i1", a), PeerId{9});
}

// The "unknown peer" failure (docs/soak.md): a failed execution's channels leave the cache, but
// one a sibling execution still runs on stays connected until the sibling ends.
TEST(ChannelCacheTest, AFailedExecutionLeavesASharedChannelToItsSibling) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{7}, "i1", a);
  c.Put("m", "n2", PeerId{8}, "i2", a);
  ASSERT_EQ(c.ForPeer("m", "n1", "i1", b).reuse, PeerId{7});
  EXPECT_EQ(Ids(c.ReleaseAll(a, /*forget=*/true)), std::vector<uint64_t>{8}) << "only a used 8";
  EXPECT_FALSE(c.Find("m", "n1").has_value()) << "not reused by later versions";
  EXPECT_EQ(c.Holders("m", "n1", PeerId{7}), 1u);
  EXPECT_EQ(Ids(c.ReleaseAll(b, /*forget=*/false)), std::vector<uint64_t>{7});
  EXPECT_TRUE(c.All().empty());
}

TEST(ChannelCacheTest, ASuccessfulExecutionKeepsItsCachedChannels) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{7}, "i1", a);
  EXPECT_TRUE(c.ReleaseAll(a, /*forget=*/false).empty());
  EXPECT_EQ(c.Find("m", "n1")->id, PeerId{7});
  EXPECT_EQ(c.Holders("m", "n1", PeerId{7}), 0u);
}

TEST(ChannelCacheTest, ForgetLeavesANewerChannelAlone) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{9}, "i1", a);
  EXPECT_TRUE(c.Forget("m", "n1", PeerId{7})) << "nothing holds 7: to be disconnected";
  EXPECT_TRUE(c.Find("m", "n1").has_value());
  EXPECT_FALSE(c.Forget("m", "n1", PeerId{9})) << "a holds 9";
  EXPECT_FALSE(c.Find("m", "n1").has_value());
  EXPECT_TRUE(c.Release(a, "m", "n1", PeerId{9}, false));
}

// An abort: every channel of the aborted execution leaves the cache; those it alone holds, and
// those its batches are in flight on, are to be disconnected now (its waits end); a shared one
// without its batches stays for the sibling.
TEST(ChannelCacheTest, AnAbortDisconnectsOnlyUnsharedOrBusyChannels) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{7}, "i1", a);
  c.Put("m", "n2", PeerId{8}, "i2", a);
  c.Put("m", "n3", PeerId{9}, "i3", a);
  ASSERT_EQ(c.ForPeer("m", "n1", "i1", b).reuse, PeerId{7});
  ASSERT_EQ(c.ForPeer("m", "n3", "i3", b).reuse, PeerId{9});
  const std::vector<ChannelCache::Keyed> now = c.Abandon(a, /*busy=*/{"n3"});
  EXPECT_EQ(Ids(now), (std::vector<uint64_t>{8, 9}));
  EXPECT_FALSE(c.Find("m", "n1").has_value());
  EXPECT_FALSE(c.Find("m", "n2").has_value());
  EXPECT_EQ(c.Holders("m", "n1", PeerId{7}), 2u) << "a still runs on it until its release";
  EXPECT_EQ(c.Holders("m", "n3", PeerId{9}), 0u) << "forgotten: its later releases return nothing";
  EXPECT_TRUE(c.ReleaseAll(a, true).empty());
  EXPECT_EQ(Ids(c.ReleaseAll(b, false)), std::vector<uint64_t>{7});
}

TEST(ChannelCacheTest, AllListsCachedAndHeldChannels) {
  ChannelCache c;
  c.Put("a", "n1", PeerId{1}, "i1", a);
  c.Put("b", "n2", PeerId{2}, "i2", b);
  c.Forget("b", "n2", PeerId{2});  // still held by b
  auto all = c.All();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].model_id, "a");
  EXPECT_EQ(all[1].id, PeerId{2});
  c.Drop("b", "n2", PeerId{2});
  EXPECT_EQ(c.All().size(), 1u);
  EXPECT_TRUE(c.ReleaseAll(b, false).empty());
}

}  // namespace
}  // namespace wb::daemon::node
