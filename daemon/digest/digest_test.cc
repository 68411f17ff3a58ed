#include "daemon/digest/digest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace wb::digest {
namespace {

// A [rows x cols] matrix of `es`-byte elements with deterministic pseudo-random bytes: element
// (r, c) has the bytes Value(r, c).
std::vector<uint8_t> Value(int64_t r, int64_t c, int es) {
  std::vector<uint8_t> v(static_cast<size_t>(es));
  uint64_t x = static_cast<uint64_t>(r) * 1000003u + static_cast<uint64_t>(c) * 7919u + 12345u;
  for (int i = 0; i < es; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v[static_cast<size_t>(i)] = static_cast<uint8_t>(x >> 56);
  }
  return v;
}

// Stores the matrix in row-major order (row pitch `pitch` elements, >= cols) at element offset
// `off` of a buffer.
std::vector<uint8_t> RowMajor(int64_t rows, int64_t cols, int es, int64_t pitch, int64_t off) {
  std::vector<uint8_t> buf(static_cast<size_t>((off + rows * pitch) * es), 0xAB);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      auto v = Value(r, c, es);
      std::memcpy(buf.data() + (off + r * pitch + c) * es, v.data(), static_cast<size_t>(es));
    }
  }
  return buf;
}

// Stores it transposed (column-major: element (r, c) at c * rows + r).
std::vector<uint8_t> ColMajor(int64_t rows, int64_t cols, int es) {
  std::vector<uint8_t> buf(static_cast<size_t>(rows * cols * es));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      auto v = Value(r, c, es);
      std::memcpy(buf.data() + (c * rows + r) * es, v.data(), static_cast<size_t>(es));
    }
  }
  return buf;
}

Digest Of(const StridedBox& b) {
  auto d = BoxDigest(b);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : 0;
}

TEST(DigestTest, SameBoxInThreeLayoutsHasOneDigest) {
  const int64_t rows = 37, cols = 53;
  const int es = 2;
  auto dense = RowMajor(rows, cols, es, cols, 0);
  auto padded = RowMajor(rows, cols, es, cols + 11, 5);  // a fused piece: rows with a gap, at an offset
  auto trans = ColMajor(rows, cols, es);
  const Digest a = Of({dense.data(), {rows, cols}, {cols, 1}, es});
  const Digest b = Of({padded.data() + 5 * es, {rows, cols}, {cols + 11, 1}, es});
  const Digest c = Of({trans.data(), {rows, cols}, {1, rows}, es});
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  // A sub-box of the padded layout equals the same sub-box of the transposed one.
  const Digest sa = Of({padded.data() + (5 + 3 * (cols + 11) + 7) * es, {10, 20}, {cols + 11, 1}, es});
  const Digest sc = Of({trans.data() + (7 * rows + 3) * es, {10, 20}, {1, rows}, es});
  EXPECT_EQ(sa, sc);
  EXPECT_NE(sa, a);
}

TEST(DigestTest, EqualsTheFormatsDefinitionOnTheCanonicalStream) {
  // One chunk: digest = XXH3_64(seed kDigestSeed) of [total bytes, XXH3_64(stream, seed 0)].
  auto dense = RowMajor(4, 6, 4, 6, 0);
  const uint64_t chunk = XXH3_64bits_withSeed(dense.data(), dense.size(), 0);
  const uint64_t words[2] = {dense.size(), chunk};
  EXPECT_EQ(Of({dense.data(), {4, 6}, {6, 1}, 4}), XXH3_64bits_withSeed(words, sizeof(words), kDigestSeed));
  // The empty stream.
  const uint64_t zero = 0;
  EXPECT_EQ(Of({nullptr, {0, 6}, {6, 1}, 4}), XXH3_64bits_withSeed(&zero, 8, kDigestSeed));
}

TEST(DigestTest, OneFlippedBitChangesTheDigest) {
  auto dense = RowMajor(64, 64, 2, 64, 0);
  const Digest before = Of({dense.data(), {64, 64}, {64, 1}, 2});
  for (size_t byte : {size_t{0}, size_t{4097}, dense.size() - 1}) {
    for (int bit : {0, 7}) {
      dense[byte] ^= static_cast<uint8_t>(1 << bit);
      EXPECT_NE(Of({dense.data(), {64, 64}, {64, 1}, 2}), before) << "byte " << byte << " bit " << bit;
      dense[byte] ^= static_cast<uint8_t>(1 << bit);
    }
  }
  EXPECT_EQ(Of({dense.data(), {64, 64}, {64, 1}, 2}), before);
}

TEST(DigestTest, OnlyTheCanonicalStreamCounts) {
  // The same bytes as [8 x 8] bf16, [64] bf16 and [8 x 4] fp32 are one stream: the shape is not
  // hashed (the coordinator compares the two digests of one op, whose box both sides share).
  auto dense = RowMajor(8, 8, 2, 8, 0);
  EXPECT_EQ(Of({dense.data(), {8, 8}, {8, 1}, 2}), Of({dense.data(), {64}, {1}, 2}));
  EXPECT_EQ(Of({dense.data(), {8, 8}, {8, 1}, 2}), Of({dense.data(), {8, 4}, {4, 1}, 4}));
  // A shorter stream differs.
  EXPECT_NE(Of({dense.data(), {8, 8}, {8, 1}, 2}), Of({dense.data(), {8, 7}, {8, 1}, 2}));
}

TEST(DigestTest, BigBoxesAcrossChunksAndThreadsAgree) {
  // 3 chunks and a bit: the chunk borders fall mid-row in the padded layout.
  const int64_t rows = 3 * 1024 + 5, cols = 1031;
  const int es = 1;
  auto dense = RowMajor(rows, cols, es, cols, 0);
  auto padded = RowMajor(rows, cols, es, cols + 3, 0);
  auto trans = ColMajor(rows, cols, es);
  std::vector<StridedBox> boxes = {{dense.data(), {rows, cols}, {cols, 1}, es},
                                   {padded.data(), {rows, cols}, {cols + 3, 1}, es},
                                   {trans.data(), {rows, cols}, {1, rows}, es},
                                   {dense.data(), {2, 3}, {cols, 1}, es}};
  auto one = DigestMany(boxes, 1);
  auto many = DigestMany(boxes, 8);
  ASSERT_TRUE(one.ok() && many.ok());
  EXPECT_EQ(*one, *many);
  EXPECT_EQ((*one)[0], (*one)[1]);
  EXPECT_EQ((*one)[0], (*one)[2]);
  EXPECT_EQ((*one)[3], Of(boxes[3]));
  // A flipped bit in the last chunk of the transposed copy.
  trans[trans.size() - 2] ^= 0x10;
  auto after = DigestMany(boxes, 4);
  ASSERT_TRUE(after.ok());
  EXPECT_NE((*after)[2], (*one)[2]);
  EXPECT_EQ((*after)[0], (*one)[0]);
}

// Chunk hashes taken elsewhere (host_tcp hashing an op's bytes as they cross) combine into the
// box's digest: chunk k = bytes [k * ChunkBytes(es), ...) of the canonical stream, seed k.
TEST(DigestTest, DigestFromChunksEqualsTheBoxDigest) {
  const int64_t rows = 2 * 1024 + 7, cols = 1031;  // 3 chunks of 2-byte elements, the last one short
  const int es = 2;
  auto dense = RowMajor(rows, cols, es, cols, 0);
  auto trans = ColMajor(rows, cols, es);
  std::vector<uint64_t> chunks;
  const int64_t total = static_cast<int64_t>(dense.size());
  for (int64_t off = 0, k = 0; off < total; off += ChunkBytes(es), ++k) {
    chunks.push_back(XXH3_64bits_withSeed(dense.data() + off, static_cast<size_t>(std::min(ChunkBytes(es), total - off)), static_cast<uint64_t>(k)));
  }
  ASSERT_EQ(chunks.size(), 3u);
  auto d = DigestFromChunks(total, es, chunks);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, Of({trans.data(), {rows, cols}, {1, rows}, es}));
  chunks[1] ^= 1;
  EXPECT_NE(*DigestFromChunks(total, es, chunks), *d);
  // The empty stream, and counts that do not fit.
  EXPECT_EQ(*DigestFromChunks(0, es, {}), Of({nullptr, {0, 6}, {6, 1}, es}));
  EXPECT_EQ(DigestFromChunks(total, es, {1, 2}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DigestFromChunks(total + 1, es, chunks).status().code(), absl::StatusCode::kInvalidArgument);
}

// A stream fed piece by piece (pieces of any size, cutting chunks anywhere, as the delta codec's
// 64 KiB chunks and a strided box's runs do) gives the box's chunk hashes, hence its digest.
TEST(DigestTest, ChunkStreamHasherGivesTheBoxesChunkHashes) {
  const int64_t rows = 2 * 1024 + 7, cols = 1031;  // 3 chunks of 2-byte elements, the last one short
  const int es = 2;
  auto dense = RowMajor(rows, cols, es, cols, 0);
  auto trans = ColMajor(rows, cols, es);
  const Digest want = Of({trans.data(), {rows, cols}, {1, rows}, es});
  ChunkStreamHasher h(es);
  std::mt19937 rng(7);
  for (size_t off = 0; off < dense.size();) {
    const size_t n = std::min<size_t>(dense.size() - off, 1 + rng() % (off % 3 == 0 ? 70000 : 300));
    h.Update(dense.data() + off, n);
    off += n;
  }
  EXPECT_EQ(h.bytes(), static_cast<int64_t>(dense.size()));
  std::vector<uint64_t> chunks = h.Finish();
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(*DigestFromChunks(static_cast<int64_t>(dense.size()), es, chunks), want);
  // Exactly whole chunks, in one piece: no extra short chunk; then the hasher starts afresh.
  h.Update(dense.data(), static_cast<size_t>(2 * ChunkBytes(es)));
  chunks = h.Finish();
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1], XXH3_64bits_withSeed(dense.data() + ChunkBytes(es), static_cast<size_t>(ChunkBytes(es)), 1));
  EXPECT_TRUE(h.Finish().empty());
  // A flipped byte shows in its chunk's hash only.
  dense[static_cast<size_t>(ChunkBytes(es)) + 5] ^= 0x10;
  h.Update(dense.data(), dense.size());
  const std::vector<uint64_t> flipped = h.Finish();
  EXPECT_NE(*DigestFromChunks(static_cast<int64_t>(dense.size()), es, flipped), want);
}

TEST(DigestTest, ThreeDimsWithUnitDimsAndScalars) {
  // [2, 1, 3] row-major == [6]; a scalar == a one-element box.
  auto dense = RowMajor(1, 6, 2, 6, 0);
  EXPECT_EQ(Of({dense.data(), {2, 1, 3}, {3, 99, 1}, 2}), Of({dense.data(), {6}, {1}, 2}));
  EXPECT_EQ(Of({dense.data(), {}, {}, 2}), Of({dense.data(), {1, 1}, {5, 7}, 2}));
}

TEST(DigestTest, MalformedBoxesAreRefusedNamingTheProblem) {
  uint8_t b[4] = {};
  auto r = BoxDigest({b, {2}, {1, 1}, 2});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("1 dims but 2 strides"), std::string::npos) << r.status();
  EXPECT_EQ(BoxDigest({b, {2}, {-1}, 2}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BoxDigest({b, {2}, {1}, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BoxDigest({nullptr, {2}, {1}, 2}).status().code(), absl::StatusCode::kInvalidArgument);
  auto late = DigestMany({{b, {2}, {1}, 2}}, 1, absl::InfinitePast());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(DigestHex(0xabc), "0000000000000abc");
}

// Boxes added over time, hashed by background threads and the caller of Finish: the same digests
// as DigestMany, ids in Add order; Add after Finish is refused.
TEST(DigestPoolTest, BoxesAddedOverTimeGetDigestManysDigests) {
  std::vector<uint8_t> bytes(3 * kChunkElements * 2 + 10);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + 7);
  std::vector<StridedBox> boxes = {{bytes.data(), {3 * kChunkElements + 5}, {1}, 2},
                                   {bytes.data() + 2, {7, 3}, {5, 1}, 2},
                                   {bytes.data(), {0}, {1}, 2}};
  auto want = DigestMany(boxes, 1);
  ASSERT_TRUE(want.ok());
  for (int nice : {0, 10}) {
    DigestPool pool({3, absl::InfiniteFuture(), nice});
    for (size_t i = 0; i < boxes.size(); ++i) {
      auto id = pool.Add(boxes[i]);
      ASSERT_TRUE(id.ok()) << id.status();
      EXPECT_EQ(*id, i);
    }
    auto got = pool.Finish();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);
    EXPECT_EQ(pool.Add(boxes[0]).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  DigestPool empty({2, absl::InfiniteFuture(), 0});
  auto none = empty.Finish();
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  DigestPool late({2, absl::InfinitePast(), 0});
  ASSERT_TRUE(late.Add(boxes[0]).ok());
  EXPECT_EQ(late.Finish().status().code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace wb::digest
