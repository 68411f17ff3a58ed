#include "daemon/node/delta_cache.h"

#include <gtest/gtest.h>

namespace wb::daemon::node {
namespace {

DeltaKey Key(int32_t tensor, int64_t begin = 0, int64_t end = 8) { return DeltaKey::Of(tensor, planner::Box{{begin}, {end}}, 2); }
UninitVector<uint8_t> Bytes(size_t n, uint8_t v) { return UninitVector<uint8_t>(n, v); }

TEST(DeltaCacheTest, PendingBecomesCommittedOnCommitOnly) {
  DeltaCache c(1000);
  ASSERT_TRUE(c.AddPending(Key(0), 1, Bytes(16, 1)));
  EXPECT_EQ(c.Committed(Key(0), 1), nullptr) << "pending is not committed";
  c.Commit(1);
  auto e = c.Committed(Key(0), 1);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, Bytes(16, 1));
  EXPECT_EQ(c.Committed(Key(0), 2), nullptr) << "another version is no base";
  EXPECT_EQ(c.Committed(Key(1), 1), nullptr);
  EXPECT_EQ(c.Committed(Key(0, 0, 4), 1), nullptr) << "another box is another key";
  EXPECT_EQ(c.stats().committed_bytes, 16u);
  EXPECT_EQ(c.stats().pending_bytes, 0u);
}

TEST(DeltaCacheTest, TheDigestFiledWithTheBytesComesBackWithTheCommittedEntry) {
  DeltaCache c(1000);
  ASSERT_TRUE(c.AddPending(Key(0), 1, Bytes(16, 1), delta::Digest{7, 9}));
  ASSERT_TRUE(c.AddPending(Key(1), 1, Bytes(16, 1)));
  c.Commit(1);
  auto e = c.Committed(Key(0), 1);
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(e->digest.has_value());
  EXPECT_EQ(*e->digest, (delta::Digest{7, 9}));
  EXPECT_FALSE(c.Committed(Key(1), 1)->digest.has_value()) << "none filed: the encoder hashes the base";
}

TEST(DeltaCacheTest, AbortDropsPendingAndKeepsCommitted) {
  DeltaCache c(1000);
  ASSERT_TRUE(c.AddPending(Key(0), 1, Bytes(16, 1)));
  c.Commit(1);
  ASSERT_TRUE(c.AddPending(Key(0), 2, Bytes(16, 2)));
  c.Drop(2);
  EXPECT_EQ(c.stats().pending_bytes, 0u);
  auto e = c.Committed(Key(0), 1);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, Bytes(16, 1)) << "v1 is still what destinations committed";
  c.Commit(2);  // nothing pending for 2 any more
  EXPECT_NE(c.Committed(Key(0), 1), nullptr);
}

TEST(DeltaCacheTest, SupersededPendingIsDroppedByANewerCommit) {
  DeltaCache c(1000);
  ASSERT_TRUE(c.AddPending(Key(0), 2, Bytes(16, 2)));
  ASSERT_TRUE(c.AddPending(Key(0), 3, Bytes(16, 3)));
  ASSERT_TRUE(c.AddPending(Key(0), 4, Bytes(16, 4)));
  c.Commit(3);  // v2 was superseded, v4 still in flight
  EXPECT_EQ(c.Committed(Key(0), 2), nullptr);
  ASSERT_NE(c.Committed(Key(0), 3), nullptr);
  EXPECT_EQ(c.Committed(Key(0), 3)->bytes, Bytes(16, 3));
  EXPECT_EQ(c.stats().pending_entries, 1u);
  EXPECT_EQ(c.stats().pending_bytes, 16u);
  c.Commit(4);
  EXPECT_EQ(c.Committed(Key(0), 4)->bytes, Bytes(16, 4));
  EXPECT_EQ(c.bytes(), 16u) << "the v3 copy was replaced, not kept";
}

TEST(DeltaCacheTest, BoundedByCapacityEvictingLeastRecentlyUsed) {
  DeltaCache c(48);
  for (int t = 0; t < 3; ++t) ASSERT_TRUE(c.AddPending(Key(t), 1, Bytes(16, 1)));
  c.Commit(1);
  ASSERT_NE(c.Committed(Key(0), 1), nullptr);  // 0 used: 1 is the least recent now
  ASSERT_NE(c.Committed(Key(2), 1), nullptr);
  ASSERT_TRUE(c.AddPending(Key(3), 2, Bytes(16, 2)));
  EXPECT_EQ(c.Committed(Key(1), 1), nullptr) << "least recently used evicted";
  EXPECT_NE(c.Committed(Key(0), 1), nullptr);
  EXPECT_LE(c.bytes(), 48u);
  EXPECT_EQ(c.stats().evictions, 1u);
  // Bigger than the whole cache: refused, and nothing else is lost for it beyond evictions.
  EXPECT_FALSE(c.AddPending(Key(4), 2, Bytes(100, 2)));
  EXPECT_EQ(c.stats().refused_adds, 1u);
  EXPECT_LE(c.bytes(), 48u);
}

TEST(DeltaCacheTest, OneTimesTheBytesKeepsEveryKeyVersionAfterVersion) {
  // Capacity = the bytes of one version: each add evicts the key's own (already used) copy first.
  DeltaCache c(64);
  for (uint64_t v = 1; v <= 4; ++v) {
    for (int t = 0; t < 4; ++t) {
      if (v > 1) {
        ASSERT_NE(c.Committed(Key(t), v - 1), nullptr) << "tensor " << t << " v" << v;
      }
      ASSERT_TRUE(c.AddPending(Key(t), v, Bytes(16, static_cast<uint8_t>(v))));
    }
    c.Commit(v);
  }
  EXPECT_EQ(c.stats().committed_entries, 4u);
}

TEST(DeltaCacheTest, ZeroCapacityIsOff) {
  DeltaCache c(0);
  EXPECT_FALSE(c.enabled());
  EXPECT_FALSE(c.AddPending(Key(0), 1, Bytes(1, 1)));
  c.Commit(1);
  EXPECT_EQ(c.Committed(Key(0), 1), nullptr);
}

TEST(DeltaCacheTest, AnEntryInUseSurvivesItsEviction) {
  DeltaCache c(16);
  ASSERT_TRUE(c.AddPending(Key(0), 1, Bytes(16, 7)));
  c.Commit(1);
  auto held = c.Committed(Key(0), 1);
  ASSERT_TRUE(c.AddPending(Key(1), 2, Bytes(16, 2)));  // evicts key 0
  EXPECT_EQ(c.Committed(Key(0), 1), nullptr);
  EXPECT_EQ(held->bytes, Bytes(16, 7));
}

TEST(DeltaCacheTest, BuffersOfEntriesThatGoAreReused) {
  DeltaCache c(1000);
  UninitVector<uint8_t> b = c.Buffer(16);
  ASSERT_EQ(b.size(), 16u);
  const uint8_t* at = b.data();
  std::fill(b.begin(), b.end(), 1);
  ASSERT_TRUE(c.AddPending(Key(0), 1, std::move(b)));
  c.Commit(1);
  ASSERT_TRUE(c.AddPending(Key(0), 2, c.Buffer(16)));
  c.Commit(2);  // v1's entry goes: its buffer is kept
  EXPECT_EQ(c.stats().free_bytes, 16u);
  UninitVector<uint8_t> again = c.Buffer(16);
  EXPECT_EQ(again.data(), at) << "the same memory, not a fresh allocation";
  EXPECT_EQ(c.stats().free_bytes, 0u);
  EXPECT_EQ(c.Buffer(8).size(), 8u) << "no free buffer of that size: a new one";
}

// After a commit, WarmSpares leaves one spare per committed entry in the pool (the next
// version's packs take them), none twice, none beyond the pool's limit, none once stopped.
TEST(DeltaCacheTest, WarmSparesLeavesOneSparePerCommittedEntry) {
  DeltaCache c(64);
  ASSERT_TRUE(c.AddPending(Key(0), 1, Bytes(16, 1)));
  ASSERT_TRUE(c.AddPending(Key(1), 1, Bytes(16, 1)));
  ASSERT_TRUE(c.AddPending(Key(2), 1, Bytes(8, 1)));
  c.Commit(1);
  EXPECT_EQ(c.stats().free_bytes, 0u);
  EXPECT_EQ(c.WarmSpares(), 40u);
  EXPECT_EQ(c.stats().free_bytes, 40u);
  EXPECT_EQ(c.WarmSpares(), 0u) << "spares already there";
  EXPECT_EQ(c.Buffer(16).size(), 16u);
  EXPECT_EQ(c.stats().free_bytes, 24u) << "a pack took a warm spare";

  // The pool's limit counts what is already free: with 16 of 20 bytes free (other sizes), a
  // 16-byte spare does not fit.
  DeltaCache small(20);
  ASSERT_TRUE(small.AddPending(Key(0), 1, Bytes(16, 1)));
  small.Commit(1);
  ASSERT_TRUE(small.AddPending(Key(0), 2, Bytes(4, 2)));  // the box shrank: v1's 16 bytes go free
  small.Commit(2);
  ASSERT_EQ(small.stats().free_bytes, 16u);
  EXPECT_EQ(small.WarmSpares(), 4u) << "a 4-byte spare fits (20), a 16-byte one would not";
  EXPECT_EQ(small.stats().free_bytes, 20u);

  DeltaCache stopped(64);
  ASSERT_TRUE(stopped.AddPending(Key(0), 1, Bytes(16, 1)));
  stopped.Commit(1);
  stopped.StopWarming();
  EXPECT_EQ(stopped.WarmSpares(), 0u);
}

}  // namespace
}  // namespace wb::daemon::node
