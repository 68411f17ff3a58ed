#include "daemon/node/channel_cache.h"

#include <gtest/gtest.h>

namespace wb::daemon::node {
namespace {

using transport::PeerId;

TEST(ChannelCacheTest, AChannelIsReusedOnlyWithTheSamePeerInstance) {
  ChannelCache c;
  EXPECT_EQ(c.ForPeer("m", "n1", "i1").reuse, transport::kNoPeer);
  EXPECT_EQ(c.Put("m", "n1", PeerId{7}, "i1"), transport::kNoPeer);
  EXPECT_EQ(c.ForPeer("m", "n1", "i1").reuse, PeerId{7});
  EXPECT_EQ(c.ForPeer("m", "n1", "i1").stale, transport::kNoPeer);
  // The peer restarted: its old channel is stale (to be disconnected), never reused.
  EXPECT_EQ(c.ForPeer("m", "n1", "i2").reuse, transport::kNoPeer);
  EXPECT_EQ(c.ForPeer("m", "n1", "i2").stale, PeerId{7});
  // Per model and channel.
  EXPECT_EQ(c.ForPeer("other", "n1", "i1").reuse, transport::kNoPeer);
  EXPECT_EQ(c.ForPeer("m", "n1\nnccl/0>nccl/1", "i1").reuse, transport::kNoPeer);
}

TEST(ChannelCacheTest, PutReturnsTheDifferentChannelItReplaced) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{7}, "i1");
  EXPECT_EQ(c.Put("m", "n1", PeerId{7}, "i1"), transport::kNoPeer);  // the same one again
  EXPECT_EQ(c.Put("m", "n1", PeerId{9}, "i1"), PeerId{7});
  EXPECT_EQ(c.Find("m", "n1")->id, PeerId{9});
}

TEST(ChannelCacheTest, EraseIfLeavesANewerChannelAlone) {
  ChannelCache c;
  c.Put("m", "n1", PeerId{9}, "i1");
  EXPECT_FALSE(c.EraseIf("m", "n1", PeerId{7}));  // a failed version drops its old channel: the newer one stays
  EXPECT_TRUE(c.Find("m", "n1").has_value());
  EXPECT_TRUE(c.EraseIf("m", "n1", PeerId{9}));
  EXPECT_FALSE(c.Find("m", "n1").has_value());
}

TEST(ChannelCacheTest, AllListsEveryModelsChannels) {
  ChannelCache c;
  c.Put("a", "n1", PeerId{1}, "i1");
  c.Put("b", "n2", PeerId{2}, "i2");
  auto all = c.All();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].model_id, "a");
  EXPECT_EQ(all[1].id, PeerId{2});
}

}  // namespace
}  // namespace wb::daemon::node
