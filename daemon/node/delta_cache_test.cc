#include "daemon/node/delta_cache.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

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

// ---- The cache at 1x: streams as pending entries, applied to the committed copy after commit.

// Version v of a 64 KiB box of bf16-like elements: every 7th element moves by one unit per version.
UninitVector<uint8_t> Version(uint64_t v, size_t n = 32768) {
  UninitVector<uint8_t> b(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t x = static_cast<uint16_t>(i * 2654435761u >> 7) + static_cast<uint16_t>(i % 7 == 0 ? v : 0);
    std::memcpy(&b[2 * i], &x, 2);
  }
  return b;
}

std::vector<uint8_t> StreamOf(uint64_t from, uint64_t to, delta::Digest* target_digest, size_t n = 32768) {
  const UninitVector<uint8_t> a = Version(from, n), b = Version(to, n);
  delta::EncodeOptions o;
  o.elem_size = 2;
  auto s = delta::Encode({from, absl::MakeConstSpan(a.data(), a.size())}, {to, absl::MakeConstSpan(b.data(), b.size())}, o);
  EXPECT_TRUE(s.ok()) << s.status();
  *target_digest = delta::DigestOf(absl::MakeConstSpan(b.data(), b.size()), 2);
  return s.ok() ? *s : std::vector<uint8_t>{};
}

// Commits version 1 of Key(0) as a full copy with its digest (as EncodeOp files it).
void CommitFirst(DeltaCache& c, size_t n = 32768) {
  UninitVector<uint8_t> v1 = Version(1, n);
  const delta::Digest d = delta::DigestOf(absl::MakeConstSpan(v1.data(), v1.size()), 2);
  ASSERT_TRUE(c.AddPending(Key(0), 1, std::move(v1), d, /*packs=*/false));
  c.Commit(1);
}

TEST(DeltaCacheStreamTest, ACommittedStreamIsAppliedInPlaceInTheBackground) {
  DeltaCache c(1 << 20);
  CommitFirst(c);
  const uint8_t* at = c.Committed(Key(0), 1)->bytes.data();
  delta::Digest d2;
  std::vector<uint8_t> s12 = StreamOf(1, 2, &d2);
  const size_t stream_bytes = s12.size();
  ASSERT_LT(stream_bytes, Version(2).size() / 4);
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, std::move(s12), d2));
  EXPECT_EQ(c.stats().pending_bytes, stream_bytes) << "a stream, not a second copy";
  EXPECT_EQ(c.Committed(Key(0), 2), nullptr) << "pending is not committed";
  ASSERT_NE(c.Committed(Key(0), 1), nullptr) << "the base stays until the commit";
  c.Commit(2);
  EXPECT_EQ(c.stats().queued_streams, 1u);
  EXPECT_EQ(c.Committed(Key(0), 1), nullptr) << "committed is version 2 now (queued)";
  EXPECT_EQ(c.ApplyQueued(), 1);
  EXPECT_EQ(c.ApplyQueued(), 0);
  auto e = c.Committed(Key(0), 2);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, Version(2));
  EXPECT_EQ(e->bytes.data(), at) << "applied in place: one copy of the box";
  ASSERT_TRUE(e->digest.has_value());
  EXPECT_EQ(*e->digest, d2);
  const DeltaCache::Stats st = c.stats();
  EXPECT_EQ(st.applied_streams, 1u);
  EXPECT_EQ(st.copied_applies, 0u);
  EXPECT_EQ(st.queued_streams, 0u);
  EXPECT_EQ(st.committed_bytes, Version(2).size()) << "1x the box";
  EXPECT_EQ(st.pending_bytes, 0u);
}

// The next version's streams go into the buffers the applied ones leave (their pages are faulted
// in already): none is allocated afresh per box and version.
TEST(DeltaCacheStreamTest, TheBufferOfAnAppliedStreamIsReusedForTheNextStream) {
  DeltaCache c(4 << 20);
  CommitFirst(c);
  delta::Digest d2;
  const std::vector<uint8_t> bytes = StreamOf(1, 2, &d2);
  std::vector<uint8_t> s12;
  s12.reserve(256 << 10);  // above the size the pool keeps (streams this small come warm from malloc)
  s12.assign(bytes.begin(), bytes.end());
  const uint8_t* buffer = s12.data();
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, std::move(s12), d2));
  EXPECT_EQ(c.StreamBuffer(200 << 10).capacity() >= (200u << 10), true) << "none free yet: a new one";
  c.Commit(2);
  ASSERT_EQ(c.ApplyQueued(), 1);
  EXPECT_EQ(c.stats().free_bytes, 256u << 10) << "the applied stream's buffer is kept";
  std::vector<uint8_t> again = c.StreamBuffer(200 << 10);
  EXPECT_EQ(again.data(), buffer) << "the applied stream's buffer";
  EXPECT_TRUE(again.empty());
  EXPECT_GE(again.capacity(), 200u << 10);
  EXPECT_EQ(c.stats().free_bytes, 0u);
  std::vector<uint8_t> small = c.StreamBuffer(1000);
  EXPECT_GE(small.capacity(), 1000u);
  // A much smaller stream does not pin a big buffer.
  std::vector<uint8_t> big;
  big.reserve(1 << 20);
  const uint8_t* big_at = big.data();
  {
    DeltaCache d(4 << 20);
    CommitFirst(d);
    big.assign(bytes.begin(), bytes.end());
    ASSERT_TRUE(d.AddPendingStream(Key(0), 2, 1, std::move(big), d2));
    d.Commit(2);
    ASSERT_EQ(d.ApplyQueued(), 1);
    EXPECT_NE(d.StreamBuffer(100 << 10).data(), big_at) << "1 MiB is too big for a 100 KiB stream";
    EXPECT_EQ(d.StreamBuffer(600 << 10).data(), big_at);
  }
}

TEST(DeltaCacheStreamTest, TheNextEncodeAppliesQueuedStreamsItself) {
  DeltaCache c(1 << 20);
  CommitFirst(c);
  delta::Digest d2, d3;
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, StreamOf(1, 2, &d2), d2));
  c.Commit(2);
  ASSERT_TRUE(c.AddPendingStream(Key(0), 3, 2, StreamOf(2, 3, &d3), d3));  // made against v2 (still queued)
  c.Commit(3);
  EXPECT_EQ(c.stats().queued_streams, 2u);
  EXPECT_EQ(c.Committed(Key(0), 2), nullptr) << "committed is version 3";
  auto e = c.Committed(Key(0), 3);  // no background apply ran: both streams applied here, in order
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, Version(3));
  EXPECT_EQ(*e->digest, d3);
  EXPECT_EQ(c.stats().applied_streams, 2u);
  EXPECT_EQ(c.stats().committed_bytes, Version(3).size());
}

// The background applier and the next encode race for a key: whichever runs the apply, the
// other gets version 2 (the encode waits for a running apply instead of sending the box full).
TEST(DeltaCacheStreamTest, AnEncodeWaitsForARunningApplyInsteadOfGoingFull) {
  constexpr size_t kN = size_t{1} << 22;  // 8 MB: the apply takes long enough to be caught running
  for (int round = 0; round < 5; ++round) {
    DeltaCache c(64 << 20);
    CommitFirst(c, kN);
    delta::Digest d2;
    ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, StreamOf(1, 2, &d2, kN), d2));
    c.Commit(2);
    std::thread applier([&c] { c.ApplyQueued(); });
    auto e = c.Committed(Key(0), 2);
    applier.join();
    ASSERT_NE(e, nullptr) << "round " << round;
    EXPECT_EQ(e->bytes, Version(2, kN));
    EXPECT_EQ(c.stats().applied_streams, 1u);
  }
}

TEST(DeltaCacheStreamTest, AnEntryAnEncoderStillReadsIsCopiedNotChanged) {
  DeltaCache c(1 << 20);
  CommitFirst(c);
  auto held = c.Committed(Key(0), 1);  // e.g. an encode of a later version in flight (async)
  delta::Digest d2;
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, StreamOf(1, 2, &d2), d2));
  c.Commit(2);
  EXPECT_EQ(c.ApplyQueued(), 1);
  EXPECT_EQ(held->bytes, Version(1)) << "the reader's bytes did not change under it";
  auto e = c.Committed(Key(0), 2);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, Version(2));
  EXPECT_EQ(c.stats().copied_applies, 1u);
}

TEST(DeltaCacheStreamTest, AnAbortedStreamLeavesTheBase) {
  DeltaCache c(1 << 20);
  CommitFirst(c);
  delta::Digest d2;
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, StreamOf(1, 2, &d2), d2));
  c.Drop(2);
  c.Commit(2);
  EXPECT_EQ(c.stats().pending_bytes, 0u);
  auto e = c.Committed(Key(0), 1);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, Version(1));
}

TEST(DeltaCacheStreamTest, TwoVersionsMadeAgainstOneBaseEvictTheKeyOnce) {
  // Async: v2 and v3 both encoded against v1; once v2 commits, v3's stream applies to nothing.
  DeltaCache c(1 << 20);
  CommitFirst(c);
  delta::Digest d2, d3;
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, StreamOf(1, 2, &d2), d2));
  ASSERT_TRUE(c.AddPendingStream(Key(0), 3, 1, StreamOf(1, 3, &d3), d3));
  c.Commit(2);
  c.Commit(3);
  EXPECT_EQ(c.Committed(Key(0), 3), nullptr) << "that box goes full next version";
  EXPECT_EQ(c.Committed(Key(0), 2), nullptr);
  EXPECT_EQ(c.stats().evictions, 1u);
  EXPECT_EQ(c.bytes(), 0u);
}

TEST(DeltaCacheStreamTest, ACorruptStreamIsNeverApplied) {
  DeltaCache c(1 << 20);
  CommitFirst(c);
  delta::Digest d2;
  std::vector<uint8_t> s12 = StreamOf(1, 2, &d2);
  s12[s12.size() - 3] ^= 0x10;  // a value in the last chunk's payload
  ASSERT_TRUE(c.AddPendingStream(Key(0), 2, 1, std::move(s12), d2));
  c.Commit(2);
  EXPECT_EQ(c.ApplyQueued(), 1);
  EXPECT_EQ(c.Committed(Key(0), 2), nullptr) << "the target digest caught it: evicted, never a wrong base";
  EXPECT_EQ(c.stats().failed_applies, 1u);
  EXPECT_EQ(c.bytes(), 0u);
}

TEST(DeltaCacheStreamTest, AStreamNeverEvictsItsOwnBase) {
  const size_t box = Version(1).size();
  DeltaCache c(box + 100);
  CommitFirst(c);
  delta::Digest d2;
  std::vector<uint8_t> s12 = StreamOf(1, 2, &d2);
  ASSERT_GT(s12.size(), 100u);
  EXPECT_FALSE(c.AddPendingStream(Key(0), 2, 1, std::move(s12), d2)) << "does not fit beside its base";
  EXPECT_EQ(c.stats().refused_adds, 1u);
  EXPECT_NE(c.Committed(Key(0), 1), nullptr) << "the base was not evicted for it";
  // Other keys are, least recently used first.
  std::vector<uint8_t> again = StreamOf(1, 2, &d2);
  DeltaCache d(box + 64 + again.size() - 10);  // the stream fits once key 1's 64 bytes go
  CommitFirst(d);
  ASSERT_TRUE(d.AddPending(Key(1), 1, Bytes(64, 1)));
  d.Commit(1);
  ASSERT_TRUE(d.AddPendingStream(Key(0), 2, 1, std::move(again), d2));
  EXPECT_EQ(d.Committed(Key(1), 1), nullptr);
  EXPECT_NE(d.Committed(Key(0), 1), nullptr);
}

TEST(DeltaCacheStreamTest, WarmSparesSkipsBoxesThatTravelAsStreams) {
  DeltaCache c(1 << 20);
  CommitFirst(c);  // packs = false
  ASSERT_TRUE(c.AddPending(Key(1), 1, Bytes(16, 1)));  // a strided box: packs again
  c.Commit(1);
  EXPECT_EQ(c.WarmSpares(), 16u);
}

}  // namespace
}  // namespace wb::daemon::node
