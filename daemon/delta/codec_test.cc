#include "daemon/delta/codec.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "daemon/digest/digest.h"
#include "gtest/gtest.h"

namespace wb::delta {
namespace {

using Bytes = std::vector<uint8_t>;

// `count` elements of `es` bytes; a share `share` of them changed in `target`: by a small signed
// step (+-1..max_step in the integer view, like an optimiser step on bf16) or to random bits.
struct Pair {
  Bytes base, target;
};
Pair MakePair(size_t count, int es, double share, int max_step, uint32_t seed, bool random_changes = false) {
  std::mt19937_64 rng(seed);
  Pair p;
  p.base.resize(count * es);
  for (auto& b : p.base) b = static_cast<uint8_t>(rng());
  p.target = p.base;
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t i = 0; i < count; ++i) {
    if (u(rng) >= share) continue;
    uint64_t v = 0;
    std::memcpy(&v, &p.target[i * es], es);
    if (random_changes) {
      uint64_t r = rng();
      if (std::memcmp(&r, &v, es) == 0) r ^= 1;
      v = r;
    } else {
      const int64_t step = static_cast<int64_t>(rng() % max_step) + 1;
      v = (rng() & 1) ? v + step : v - step;
    }
    std::memcpy(&p.target[i * es], &v, es);
  }
  return p;
}

struct Coded {
  Bytes stream;
  EncodeStats stats;
};

Coded EncodeOk(const Pair& p, int es, uint32_t chunk = kDefaultChunkElems, uint64_t base_v = 4, uint64_t target_v = 5) {
  Coded c;
  EncodeOptions o;
  o.elem_size = es;
  o.chunk_elems = chunk;
  auto s = Encode({base_v, p.base}, {target_v, p.target}, o, &c.stats);
  EXPECT_TRUE(s.ok()) << s.status();
  if (s.ok()) c.stream = std::move(*s);
  return c;
}

absl::Status DecodeInto(const Bytes& stream, const Bytes& base, Bytes& out, uint64_t base_v = 4) {
  return Decode(stream, DecodeBase{base_v, base, std::nullopt}, absl::MakeSpan(out), "tensor 'w'");
}

TEST(DeltaCodec, RoundTripsEveryElementSizeAndDensity) {
  for (int es : {1, 2, 4, 8}) {
    for (double share : {0.0, 1e-4, 0.01, 0.04, 0.25, 0.6, 0.95, 1.0}) {
      for (bool random_changes : {false, true}) {
        // Not a multiple of 64 or of the chunk: a short last chunk with a partial bitmap word.
        const size_t count = 3 * 4096 + 37;
        const Pair p = MakePair(count, es, share, 100, 11 + es, random_changes);
        const Coded c = EncodeOk(p, es, 4096);
        Bytes out(p.target.size(), 0xAB);
        const absl::Status s = DecodeInto(c.stream, p.base, out);
        ASSERT_TRUE(s.ok()) << s << " es " << es << " share " << share;
        ASSERT_EQ(out, p.target) << "es " << es << " share " << share << " random " << random_changes;
        EXPECT_EQ(c.stats.encoded_bytes, c.stream.size());
        EXPECT_LE(c.stream.size(), MaxEncodedBytes(p.target.size(), es, 4096));
      }
    }
  }
}

TEST(DeltaCodec, EmptyAndTiny) {
  for (size_t count : {0, 1, 63, 64, 65}) {
    const Pair p = MakePair(count, 2, 0.5, 3, 5);
    const Coded c = EncodeOk(p, 2, 64);
    Bytes out(p.target.size());
    ASSERT_TRUE(DecodeInto(c.stream, p.base, out).ok()) << count;
    EXPECT_EQ(out, p.target);
  }
}

TEST(DeltaCodec, ChoosesTheSmallestEncodingPerChunk) {
  const size_t n = 4 * kDefaultChunkElems;
  auto kinds = [&](const Pair& p, int es) {
    const Coded c = EncodeOk(p, es);
    Bytes out(p.target.size());
    EXPECT_TRUE(DecodeInto(c.stream, p.base, out).ok());
    EXPECT_EQ(out, p.target);
    return c;
  };
  EXPECT_EQ(kinds(MakePair(n, 2, 0.0, 1, 1), 2).stats.chunks[int(ChunkKind::kSame)], 4u);
  EXPECT_EQ(kinds(MakePair(n, 2, 0.001, 4, 1), 2).stats.chunks[int(ChunkKind::kIndex)], 4u);
  EXPECT_EQ(kinds(MakePair(n, 2, 0.25, 4, 1), 2).stats.chunks[int(ChunkKind::kBitmap)], 4u);
  EXPECT_EQ(kinds(MakePair(n, 2, 1.0, 4, 1, true), 2).stats.chunks[int(ChunkKind::kRaw)], 4u);
  // fp32 where every element moved a few hundred units in the last place: 2 bytes per element.
  const Coded fp32 = kinds(MakePair(n, 4, 1.0, 500, 1), 4);
  EXPECT_EQ(fp32.stats.chunks[int(ChunkKind::kDenseDiff)], 4u);
  EXPECT_LT(fp32.stream.size(), n * 4 * 0.55);
}

TEST(DeltaCodec, Bf16SmallStepsAreOneBytePerChange) {
  // 4% of bf16 elements move by 1..3 ulps: ~1 byte of position + 1 byte of value per change.
  const size_t n = 1 << 20;
  const Pair p = MakePair(n, 2, 0.04, 3, 2);
  const Coded c = EncodeOk(p, 2);
  EXPECT_LT(static_cast<double>(c.stream.size()) / p.target.size(), 0.05) << c.stream.size();
  // A few values that need both bytes (e.g. a sign flip near zero) stay exceptions, not width 2.
  Pair q = p;
  for (size_t i = 1000; i < n; i += 50000) q.target[2 * i + 1] ^= 0x80;
  const Coded d = EncodeOk(q, 2);
  EXPECT_GT(d.stats.exceptions, 0u);
  EXPECT_LT(d.stream.size(), c.stream.size() + 200);
  Bytes out(q.target.size());
  ASSERT_TRUE(DecodeInto(d.stream, q.base, out).ok());
  EXPECT_EQ(out, q.target);
}

TEST(DeltaCodec, RefusesAnotherBaseBeforeWritingAByte) {
  const Pair p = MakePair(10000, 2, 0.05, 3, 3);
  const Coded c = EncodeOk(p, 2, kDefaultChunkElems, /*base_v=*/4, /*target_v=*/5);
  Bytes out(p.target.size(), 0xEE);
  const Bytes untouched = out;
  // Wrong version.
  absl::Status s = DecodeInto(c.stream, p.base, out, /*base_v=*/3);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("made against version 4"), std::string::npos) << s;
  EXPECT_NE(s.message().find("holds version 3"), std::string::npos) << s;
  EXPECT_NE(s.message().find(DigestOf(p.base, 2).ToString()), std::string::npos) << s;
  EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s;
  EXPECT_EQ(out, untouched);
  // Right version, other bytes (e.g. a destination that missed a version): digest differs.
  Bytes other = p.base;
  other[777] ^= 1;
  s = DecodeInto(c.stream, other, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(DigestOf(other, 2).ToString()), std::string::npos) << s;
  EXPECT_EQ(out, untouched);
  // A recorded digest that no longer matches the bytes (staging corrupted after it landed): the
  // base check passes on the record, the target digest catches the result.
  s = Decode(c.stream, DecodeBase{4, other, DigestOf(p.base, 2)}, absl::MakeSpan(out), "w");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // The recorded digest, right: no hashing of the base, same result.
  s = Decode(c.stream, DecodeBase{4, p.base, DigestOf(p.base, 2)}, absl::MakeSpan(out), "w");
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out, p.target);
  auto h = ReadHeader(c.stream);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->base_version, 4u);
  EXPECT_EQ(h->target_version, 5u);
  EXPECT_EQ(h->target_digest, DigestOf(p.target, 2));
}

// DecodeInPlace gives what Decode gives, for every element size, density and chunk kind
// (same, index, bitmap, dense_diff, raw, exceptions), with the same unit hashes.
TEST(DeltaCodec, DecodeInPlaceEqualsOutOfPlace) {
  for (int es : {1, 2, 4, 8}) {
    for (double share : {0.0, 1e-4, 0.04, 0.25, 0.95, 1.0}) {
      for (bool random_changes : {false, true}) {
        const size_t count = 3 * 4096 + 37;
        const Pair p = MakePair(count, es, share, 100, 21 + es, random_changes);
        const Coded c = EncodeOk(p, es, 4096);
        Bytes out(p.target.size());
        std::vector<uint64_t> units_out, units_in;
        ASSERT_TRUE(Decode(c.stream, DecodeBase{4, p.base, std::nullopt}, absl::MakeSpan(out), "w", {}, &units_out).ok());
        Bytes data = p.base;
        for (const std::optional<Digest>& recorded : {std::optional<Digest>(), std::optional<Digest>(DigestOf(p.base, es))}) {
          data = p.base;
          const absl::Status s = DecodeInPlace(c.stream, 4, recorded, absl::MakeSpan(data), "w", {}, &units_in);
          ASSERT_TRUE(s.ok()) << s << " es " << es << " share " << share;
          ASSERT_EQ(data, p.target) << "es " << es << " share " << share << " random " << random_changes;
          EXPECT_EQ(units_in, units_out);
        }
      }
    }
  }
}

// Refusals before the first write leave the base untouched (the caller may still use it); a
// stream whose payload or target digest is wrong is caught after writing (the caller drops the
// bytes).
TEST(DeltaCodec, DecodeInPlaceRefusesBeforeWritingAndCatchesBadPayloads) {
  const Pair p = MakePair(20000, 2, 0.05, 3, 7);
  const Coded c = EncodeOk(p, 2, 4096);
  Bytes data = p.base;
  absl::Status s = DecodeInPlace(c.stream, 3, std::nullopt, absl::MakeSpan(data), "w");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(data, p.base);
  Bytes other = p.base;
  other[99] ^= 4;
  Bytes before = other;
  s = DecodeInPlace(c.stream, 4, std::nullopt, absl::MakeSpan(other), "w");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(other, before) << "refused on the base digest: nothing written";
  Bytes truncated(c.stream.begin(), c.stream.end() - 1);
  s = DecodeInPlace(truncated, 4, std::nullopt, absl::MakeSpan(data), "w");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(data, p.base) << "chunk headers are checked before anything is written";
  // A stale recorded digest: the base check passes on the record, the target digest catches it.
  other = before;
  s = DecodeInPlace(c.stream, 4, DigestOf(p.base, 2), absl::MakeSpan(other), "w");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // Wrong size.
  Bytes shorter(p.base.begin(), p.base.end() - 2);
  EXPECT_EQ(DecodeInPlace(c.stream, 4, std::nullopt, absl::MakeSpan(shorter), "w").code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeltaCodec, RejectsBadArguments) {
  const Pair p = MakePair(1000, 2, 0.1, 3, 4);
  EncodeOptions o;
  o.elem_size = 3;
  EXPECT_EQ(Encode({1, p.base}, {2, p.target}, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.elem_size = 2;
  o.chunk_elems = 100;
  EXPECT_EQ(Encode({1, p.base}, {2, p.target}, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.chunk_elems = 64;
  Bytes shorter(p.base.begin(), p.base.end() - 2);
  EXPECT_EQ(Encode({1, shorter}, {2, p.target}, o).status().code(), absl::StatusCode::kInvalidArgument);
  Bytes odd(p.base.begin(), p.base.end() - 1);
  EXPECT_EQ(Encode({1, odd}, {2, odd}, o).status().code(), absl::StatusCode::kInvalidArgument);
  Bytes small(100);
  EXPECT_EQ(EncodeInto({1, p.base}, {2, p.target}, o, absl::MakeSpan(small)).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto c = Encode({1, p.base}, {2, p.target}, o);
  ASSERT_TRUE(c.ok());
  Bytes out(p.base.size() - 2);
  EXPECT_EQ(Decode(*c, {1, p.base, std::nullopt}, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
  Bytes same = p.base;  // in place: refused
  EXPECT_EQ(Decode(*c, {1, same, std::nullopt}, absl::MakeSpan(same)).code(), absl::StatusCode::kInvalidArgument);
}

// Every prefix of a stream, and every single-byte change of it, is an error - never a crash, never
// OK with other bytes (a flipped value byte is caught by the target digest).
TEST(DeltaCodec, TruncatedOrCorruptedStreamsAreErrors) {
  for (int es : {1, 2, 4}) {
    Pair p = MakePair(700, es, 0.1, 300, 21 + es);
    // Two chunks of each coded kind at chunk_elems 64: sparse, dense, a few exceptions.
    for (size_t i = 0; i < 64; ++i) p.target[(128 + i) * es] ^= 0x3;
    for (size_t i = 0; i < 5; ++i) p.target[(320 + 7 * i) * es + es - 1] ^= 0x40;
    const Coded c = EncodeOk(p, es, 64);
    Bytes out(p.target.size());
    ASSERT_TRUE(DecodeInto(c.stream, p.base, out).ok());
    for (size_t len = 0; len < c.stream.size(); ++len) {
      Bytes cut(c.stream.begin(), c.stream.begin() + len);
      const absl::Status s = DecodeInto(cut, p.base, out);
      ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << "prefix " << len << ": " << s;
    }
    for (size_t pos = 0; pos < c.stream.size(); ++pos) {
      for (uint8_t flip : {0x01, 0x80, 0xFF}) {
        Bytes bad = c.stream;
        bad[pos] ^= flip;
        const absl::Status s = DecodeInto(bad, p.base, out);
        ASSERT_FALSE(s.ok()) << "es " << es << " byte " << pos << " ^ " << int{flip} << " decoded OK";
      }
    }
  }
}

// Chunk headers crafted by a hostile peer (header hash recomputed is not possible from outside, so
// only chunk fields change): each is named, none crashes.
TEST(DeltaCodec, HostileChunkHeadersAreNamed) {
  const Pair p = MakePair(256, 2, 0.3, 3, 9);
  const Coded c = EncodeOk(p, 2, 64);
  const size_t ch = kHeaderBytes;  // first chunk header
  auto try_field = [&](size_t off, std::vector<uint8_t> bytes, const std::string& want) {
    Bytes bad = c.stream;
    std::memcpy(&bad[ch + off], bytes.data(), bytes.size());
    Bytes out(p.target.size());
    const absl::Status s = DecodeInto(bad, p.base, out);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << want;
    EXPECT_NE(s.message().find(want), std::string::npos) << s;
    EXPECT_NE(s.message().find("chunk 0 (elements [0, 64))"), std::string::npos) << s;
  };
  try_field(0, {9}, "unknown chunk kind 9");
  try_field(1, {0}, "value width 0");
  try_field(1, {3}, "value width 3");
  try_field(4, {0xFF, 0xFF, 0, 0}, "changed elements");
  try_field(8, {0xFF, 0, 0, 0}, "exceptions");
  try_field(12, {0xFF, 0xFF, 0xFF, 0x7F}, "stream ends");
  try_field(0, {uint8_t(ChunkKind::kSame)}, "same chunk with");
}

TEST(DeltaCodec, HeaderChecks) {
  const Pair p = MakePair(100, 2, 0.3, 3, 9);
  const Coded c = EncodeOk(p, 2, 64);
  EXPECT_EQ(ReadHeader(Bytes(c.stream.begin(), c.stream.begin() + 40)).status().code(), absl::StatusCode::kDataLoss);
  Bytes bad = c.stream;
  bad[0] = 'X';
  EXPECT_NE(ReadHeader(bad).status().message().find("magic"), std::string::npos);
  bad = c.stream;
  bad[24] ^= 1;  // base version
  EXPECT_NE(ReadHeader(bad).status().message().find("header hash"), std::string::npos);
  bad = c.stream;
  bad.push_back(0);
  Bytes out(p.target.size());
  const absl::Status s = DecodeInto(bad, p.base, out);
  EXPECT_NE(s.message().find("1 bytes after the last chunk"), std::string::npos) << s;
}

TEST(DeltaCodec, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(77);
  const Pair p = MakePair(300, 2, 0.3, 3, 9);
  const Coded c = EncodeOk(p, 2, 64);
  Bytes out(p.target.size());
  for (int round = 0; round < 3000; ++round) {
    // Valid header, random chunk bytes of random length: exercises every payload check.
    Bytes bad(c.stream.begin(), c.stream.begin() + kHeaderBytes);
    const size_t len = rng() % 400;
    for (size_t i = 0; i < len; ++i) bad.push_back(static_cast<uint8_t>(rng()));
    if (len >= 16 && round % 2 == 0) bad[kHeaderBytes] = static_cast<uint8_t>(rng() % 5);  // a real kind
    EXPECT_FALSE(DecodeInto(bad, p.base, out).ok());
  }
}

// The vector scan (2-byte elements, AVX2 where the CPU has it) and the portable loop make the same
// streams: every density, small and random changes (values needing 2 bytes: exceptions, raw,
// dense), chunks that end mid mask word.
TEST(DeltaCodec, VectorAndPortableScansMakeTheSameStream) {
  for (double share : {0.0, 1e-3, 0.04, 0.3, 0.9, 1.0}) {
    for (int max_step : {1, 100, 300, 40000}) {
      for (uint32_t chunk : {64u, 4096u, kDefaultChunkElems}) {
        const Pair p = MakePair(2 * 4096 + 45, 2, share, max_step, 5 + max_step);
        EncodeOptions o;
        o.elem_size = 2;
        o.chunk_elems = chunk;
        EncodeStats sv, sp;
        auto vec = Encode({4, p.base}, {5, p.target}, o, &sv);
        o.portable_scan = true;
        auto port = Encode({4, p.base}, {5, p.target}, o, &sp);
        ASSERT_TRUE(vec.ok() && port.ok());
        ASSERT_EQ(*vec, *port) << "share " << share << " step " << max_step << " chunk " << chunk;
        EXPECT_EQ(sv.changed_elements, sp.changed_elements);
      }
    }
  }
}

// The fused AVX-512 pass (scan + gaps + 1-byte values in one, where the CPU has it) against the
// portable loop: gaps of every LEB128 length (changes 1e-5 apart need 3 bytes), runs of adjacent
// changes, values needing their high byte at every position of a step, steps without changes,
// chunks of 64..100 elements and tails cut mid step, chunks that end up bitmap, index, dense or
// raw; then each stream decodes back to the target.
TEST(DeltaCodec, FusedWalkAndPortableLoopMakeTheSameStream) {
  struct Case {
    size_t count;
    uint32_t chunk;
    double share;
    int max_step;
  };
  const std::vector<Case> cases = {
      {3 * 32768 + 77, 32768, 1e-5, 50},  // gaps > 2^14: 3-byte LEB128
      {3 * 32768 + 77, 32768, 3e-4, 50},  // gaps > 2^7: 2 bytes
      {100000, 32768, 0.04, 100},         // bf16 at lr 1e-6: index
      {100000, 32768, 0.04, 400},         // with exceptions
      {100000, 32768, 0.25, 100},         // bitmap
      {100000, 4096, 0.7, 300},           // dense / exceptions galore
      {64 * 50 + 33, 64, 0.1, 1000},      // 64-element chunks, tail of 33
      {192 * 40 + 100, 192, 0.5, 200},    // 192-element chunks, tail of 100: cut mid step
      {128 * 7 + 70, 128, 0.02, 5},
      {4096 * 4, 4096, 1.0, 2},           // every element changed
  };
  int seed = 0;
  for (const Case& c : cases) {
    for (bool random : {false, true}) {
      const Pair p = MakePair(c.count, 2, c.share, c.max_step, 100 + ++seed, random);
      Pair q = p;
      if (!random) {  // plus runs of adjacent changes
        for (size_t i = 0; i + 40 < c.count; i += 997) {
          for (size_t j = i; j < i + 40; ++j) q.target[2 * j] ^= static_cast<uint8_t>(1 + (j & 3));
        }
      }
      for (const Pair* x : {&p, static_cast<const Pair*>(&q)}) {
        EncodeOptions o;
        o.elem_size = 2;
        o.chunk_elems = c.chunk;
        EncodeStats sv, sp;
        auto vec = Encode({4, x->base}, {5, x->target}, o, &sv);
        o.portable_scan = true;
        auto port = Encode({4, x->base}, {5, x->target}, o, &sp);
        ASSERT_TRUE(vec.ok() && port.ok());
        ASSERT_EQ(*vec, *port) << "count " << c.count << " chunk " << c.chunk << " share " << c.share << " random " << random;
        EXPECT_EQ(sv.changed_elements, sp.changed_elements);
        EXPECT_EQ(sv.exceptions, sp.exceptions);
        for (int k = 0; k < 5; ++k) EXPECT_EQ(sv.chunks[k], sp.chunks[k]);
        Bytes out(x->target.size());
        ASSERT_TRUE(Decode(*vec, {4, x->base}, absl::MakeSpan(out)).ok());
        EXPECT_EQ(out, x->target);
      }
    }
  }
}

// The same over 300 random shapes: sizes, chunk sizes, densities, step sizes, random changes.
TEST(DeltaCodec, FusedWalkAndPortableLoopAgreeOnRandomShapes) {
  std::mt19937_64 rng(2026);
  for (int i = 0; i < 300; ++i) {
    const uint32_t chunk = 64u << (rng() % 10);  // 64 .. 32768
    const size_t count = 1 + rng() % (3 * chunk + 200);
    const double share = std::pow(10.0, -4.0 * static_cast<double>(rng() % 1000) / 1000.0);  // 1e-4 .. 1
    const int max_step = 1 + static_cast<int>(rng() % (rng() % 2 ? 200 : 70000));
    const Pair p = MakePair(count, 2, share, max_step, static_cast<uint32_t>(rng()), rng() % 4 == 0);
    EncodeOptions o;
    o.elem_size = 2;
    o.chunk_elems = chunk;
    auto vec = Encode({4, p.base}, {5, p.target}, o);
    o.portable_scan = true;
    auto port = Encode({4, p.base}, {5, p.target}, o);
    ASSERT_TRUE(vec.ok() && port.ok());
    ASSERT_EQ(*vec, *port) << "case " << i << ": count " << count << " chunk " << chunk << " share " << share << " step " << max_step;
  }
}

// Decodes `stream` against `base` four ways - Decode and DecodeInPlace, each with the fast paths
// (index chunks: decode_parts.h; bf16 bitmap chunks on AVX-512) and with the portable loops
// forced - into buffers that start `misalign` bytes past an aligned address, and expects the same
// status from all four (message included: a hostile stream is named the same either way) and, when
// OK, the same bytes and unit hashes.
void ExpectFastAndPortableDecodeAgree(const Bytes& stream, const Bytes& base, size_t misalign, const std::string& what) {
  absl::Status status[4];
  Bytes got[4];
  std::vector<uint64_t> units[4];
  for (int way = 0; way < 4; ++way) {
    const bool portable = way >= 2, in_place = way % 2 == 1;
    internal::SetPortableDecodeForTest(portable);
    std::vector<uint64_t> buf((base.size() + misalign) / 8 + 2);
    uint8_t* at = reinterpret_cast<uint8_t*>(buf.data()) + misalign;
    absl::Span<uint8_t> out(at, base.size());
    if (in_place) {
      std::memcpy(at, base.data(), base.size());
      status[way] = DecodeInPlace(stream, 4, std::nullopt, out, "w", {}, &units[way]);
    } else {
      status[way] = Decode(stream, DecodeBase{4, base, std::nullopt}, out, "w", {}, &units[way]);
    }
    internal::SetPortableDecodeForTest(false);
    got[way].assign(out.begin(), out.end());
  }
  for (int way = 1; way < 4; ++way) {
    ASSERT_EQ(status[way], status[0]) << what << " way " << way;
    if (status[0].ok()) {
      ASSERT_EQ(got[way], got[0]) << what << " way " << way;
      ASSERT_EQ(units[way], units[0]) << what << " way " << way;
    }
  }
}

// The decoder's fast paths against its portable loops on valid streams: every element size, random
// shapes (chunk sizes 64..32768, lengths that are no multiple of a vector or a chunk, densities
// 1e-5..1, small steps, steps needing exceptions, random changes), unaligned buffers; and edge
// cases: all equal, all different, changes only at a chunk's first or last element, gaps of every
// LEB128 length (up to 4 bytes: a 2^22-element chunk). Every stream also decodes to the target.
TEST(DeltaCodec, FastAndPortableDecodeAgreeOnValidStreams) {
  std::mt19937_64 rng(131);
  uint64_t index_chunks = 0;
  for (int i = 0; i < 240; ++i) {
    const int es = 1 << (i % 4);
    const uint32_t chunk = 64u << (rng() % 10);
    const size_t count = 1 + rng() % (3 * chunk + 200);
    const double share = std::pow(10.0, -5.0 * static_cast<double>(rng() % 1000) / 1000.0);
    const int max_step = 1 + static_cast<int>(rng() % (rng() % 2 ? 200 : 70000));
    const Pair p = MakePair(count, es, share, max_step, static_cast<uint32_t>(rng()), rng() % 5 == 0);
    const Coded c = EncodeOk(p, es, chunk);
    index_chunks += c.stats.chunks[static_cast<int>(ChunkKind::kIndex)];
    Bytes out(p.target.size());
    ASSERT_TRUE(DecodeInto(c.stream, p.base, out).ok());
    ASSERT_EQ(out, p.target);
    ExpectFastAndPortableDecodeAgree(c.stream, p.base, i % 8,
                                     "case " + std::to_string(i) + " es " + std::to_string(es) + " chunk " + std::to_string(chunk));
  }
  EXPECT_GT(index_chunks, 200u) << "the random shapes hardly reach the index path";
  for (int es : {1, 2, 4, 8}) {
    for (double share : {0.0, 1.0}) {  // all equal, all different
      const Pair p = MakePair(4096 + 13, es, share, 3, 7 + es);
      ExpectFastAndPortableDecodeAgree(EncodeOk(p, es, 1024).stream, p.base, 3, "share " + std::to_string(share));
    }
    Pair p = MakePair(4 * 1024 + 5, es, 0.0, 1, 11 + es);  // first and last element of each chunk
    for (size_t i = 0; i < p.target.size() / es; ++i) {
      if (i % 1024 == 0 || i % 1024 == 1023 || i + 1 == p.target.size() / es) p.target[i * es] ^= 0x81;
    }
    const Coded c = EncodeOk(p, es, 1024);
    ASSERT_GT(c.stats.chunks[static_cast<int>(ChunkKind::kIndex)], 0u);
    ExpectFastAndPortableDecodeAgree(c.stream, p.base, 5, "chunk ends, es " + std::to_string(es));
  }
  Pair p = MakePair((size_t{1} << 22) + 100, 1, 0.0, 1, 3);  // gaps of 1..4 LEB128 bytes
  for (size_t i : {size_t{0}, size_t{1}, size_t{200}, size_t{20000}, size_t{3000000}, (size_t{1} << 22) - 1}) p.target[i] ^= 0x41;
  const Coded big = EncodeOk(p, 1, 1u << 22);
  ASSERT_EQ(big.stats.chunks[static_cast<int>(ChunkKind::kIndex)], 1u);
  ExpectFastAndPortableDecodeAgree(big.stream, p.base, 1, "LEB128 lengths");
}

// ... and on broken streams: every prefix and every single-byte change (3 patterns) of streams of
// index chunks with exceptions, for every element size: the same status, message included, from
// the fast paths and the portable loops (a fast path never accepts what the portable loop refuses).
TEST(DeltaCodec, FastAndPortableDecodeAgreeOnBrokenStreams) {
  for (int es : {1, 2, 4, 8}) {
    // Index chunks (< 8 of 64 elements changed), each with one value needing its high bytes.
    Pair p = MakePair(300, es, 0.0, 1, 40 + es);
    for (size_t i = 0; i < 300; ++i) {
      if (i % 11 == 3) p.target[i * es] = static_cast<uint8_t>(p.target[i * es] + 1 + i % 50);
      if (i % 64 == 40) p.target[i * es + es - 1] ^= 0x40;
    }
    const Coded c = EncodeOk(p, es, 64);
    ASSERT_GT(c.stats.chunks[static_cast<int>(ChunkKind::kIndex)], 0u) << es;
    if (es > 1) ASSERT_GT(c.stats.exceptions, 0u) << es;
    for (size_t len = 0; len < c.stream.size(); ++len) {
      ExpectFastAndPortableDecodeAgree(Bytes(c.stream.begin(), c.stream.begin() + len), p.base, 0,
                                       "es " + std::to_string(es) + " prefix " + std::to_string(len));
    }
    for (size_t pos = kHeaderBytes; pos < c.stream.size(); ++pos) {
      for (uint8_t flip : {0x01, 0x80, 0xFF}) {
        Bytes bad = c.stream;
        bad[pos] ^= flip;
        ExpectFastAndPortableDecodeAgree(bad, p.base, 0, "es " + std::to_string(es) + " byte " + std::to_string(pos) +
                                                             " ^ " + std::to_string(flip));
      }
    }
  }
}

// The sender's fused pass: the same stream as packing first, the target written out whole, its
// digest returned; a recorded base digest gives the same stream without hashing the base; a wrong
// one is refused by the receiver, never decoded into wrong bytes.
TEST(DeltaCodec, EncodeFillingMatchesEncodeIntoAndRecordsTheTargetDigest) {
  for (int es : {1, 2, 4, 8}) {
    const Pair p = MakePair(3 * 4096 + 37, es, 0.04, 100, 21 + es);
    EncodeOptions o;
    o.elem_size = es;
    o.chunk_elems = 4096;
    const Coded want = EncodeOk(p, es, 4096);
    std::vector<size_t> fills;
    const FillFn fill = [&](size_t off, absl::Span<uint8_t> dst) {
      fills.push_back(off);
      std::memcpy(dst.data(), p.target.data() + off, dst.size());
    };
    Bytes target_out(p.target.size(), 0), out(MaxEncodedBytes(p.target.size(), es, 4096));
    Digest td;
    auto n = EncodeFilling({4, p.base}, 5, fill, absl::MakeSpan(target_out), o, absl::MakeSpan(out), &td);
    ASSERT_TRUE(n.ok()) << n.status();
    out.resize(*n);
    EXPECT_EQ(out, want.stream) << "es " << es;
    EXPECT_EQ(target_out, p.target);
    EXPECT_EQ(td, DigestOf(p.target, es));
    EXPECT_EQ(fills.size(), 4u) << "one fill per chunk";
    // With the base's digest recorded: the same stream.
    o.base_digest = DigestOf(p.base, es);
    Bytes out2(MaxEncodedBytes(p.target.size(), es, 4096));
    auto n2 = EncodeInto({4, p.base}, {5, p.target}, o, absl::MakeSpan(out2));
    ASSERT_TRUE(n2.ok());
    out2.resize(*n2);
    EXPECT_EQ(out2, want.stream);
    // A wrong recorded digest: the receiver refuses before writing.
    o.base_digest = Digest{1, 2};
    auto n3 = EncodeInto({4, p.base}, {5, p.target}, o, absl::MakeSpan(out2 = Bytes(MaxEncodedBytes(p.target.size(), es, 4096))));
    ASSERT_TRUE(n3.ok());
    out2.resize(*n3);
    Bytes dec(p.target.size());
    EXPECT_EQ(DecodeInto(out2, p.base, dec).code(), absl::StatusCode::kFailedPrecondition);
  }
  Bytes t(100000);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(i * 7);
  Bytes got(t.size());
  const Digest d = FillAndDigest([&](size_t off, absl::Span<uint8_t> dst) { std::memcpy(dst.data(), t.data() + off, dst.size()); },
                                 absl::MakeSpan(got), 1, 4096);
  EXPECT_EQ(got, t);
  EXPECT_EQ(d, DigestOf(t, 1));
}

// The sender's contiguous-source path: the same stream and digest as EncodeInto, the copy exact
// whatever its alignment and length (cache-bypassing stores with unaligned heads and short tails),
// the observer sees the target; CopyAndDigest is FillAndDigest without a fill.
TEST(DeltaCodec, EncodeCopyingMatchesEncodeIntoAndCopiesTheTarget) {
  for (int es : {1, 2, 4, 8}) {
    for (size_t shift : {0, 1, 3, 8, 15}) {
      const Pair p = MakePair(3 * 4096 + 37, es, 0.04, 100, 41 + es);
      EncodeOptions o;
      o.elem_size = es;
      o.chunk_elems = 4096;
      const Coded want = EncodeOk(p, es, 4096);
      Bytes seen;
      o.on_target = [&](absl::Span<const uint8_t> c) { seen.insert(seen.end(), c.begin(), c.end()); };
      Bytes copy_buf(p.target.size() + 16, 0xEE), out(MaxEncodedBytes(p.target.size(), es, 4096));
      const absl::Span<uint8_t> copy = absl::MakeSpan(copy_buf).subspan(shift, p.target.size());
      Digest td;
      auto n = EncodeCopying({4, p.base}, {5, p.target}, copy, o, absl::MakeSpan(out), &td);
      ASSERT_TRUE(n.ok()) << n.status();
      out.resize(*n);
      EXPECT_EQ(out, want.stream) << "es " << es << " shift " << shift;
      EXPECT_TRUE(std::equal(copy.begin(), copy.end(), p.target.begin())) << "es " << es << " shift " << shift;
      for (size_t i = 0; i < shift; ++i) EXPECT_EQ(copy_buf[i], 0xEE) << "wrote before the copy";
      for (size_t i = shift + p.target.size(); i < copy_buf.size(); ++i) EXPECT_EQ(copy_buf[i], 0xEE) << "wrote past the copy";
      EXPECT_EQ(td, DigestOf(p.target, es));
      EXPECT_EQ(seen, p.target);
    }
  }
  const Pair p = MakePair(1000, 2, 0.04, 100, 7);
  EncodeOptions o;
  Bytes small(10), out(MaxEncodedBytes(p.target.size(), 2));
  EXPECT_EQ(EncodeCopying({4, p.base}, {5, p.target}, absl::MakeSpan(small), o, absl::MakeSpan(out), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (size_t len : {size_t{0}, size_t{1}, size_t{63}, size_t{100000}}) {
    Bytes t(len);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(i * 13 + 1);
    Bytes got(len + 5, 0);
    Bytes seen;
    const Digest d = CopyAndDigest(t, absl::MakeSpan(got).subspan(5, len), 1, 4096,
                                   [&](absl::Span<const uint8_t> c) { seen.insert(seen.end(), c.begin(), c.end()); });
    EXPECT_TRUE(std::equal(t.begin(), t.end(), got.begin() + 5)) << len;
    EXPECT_EQ(d, DigestOf(t, 1)) << len;
    EXPECT_EQ(seen, t) << len;
  }
}

// One hash per side: the codec's digests are issue 17.4's digest of the box (lo) and its length
// (hi), and the chunk hashes it made them from are handed out by the encoder, the decoder,
// CopyAndDigest and FillAndDigest - the end-to-end digests' unit hashes, equal to a separate
// ChunkStreamHasher's over the same bytes.
TEST(DeltaCodec, DigestsAreTheEndToEndDigestsAndTheirUnitHashesAreHandedOut) {
  for (int es : {1, 2, 4, 8}) {
    // Over two 2^20-element chunks for 1-byte elements, several codec chunks for every size.
    const size_t elems = es == 1 ? (size_t{1} << 21) + 4099 : 300000 + 17;
    const Pair p = MakePair(elems, es, 0.04, 100, 51 + es);
    digest::ChunkStreamHasher want_units(es);
    want_units.Update(p.target.data(), p.target.size());
    const std::vector<uint64_t> want = want_units.Finish();
    absl::StatusOr<digest::Digest> want_digest = digest::BoxDigest({p.target.data(), {static_cast<int64_t>(elems)}, {1}, es});
    ASSERT_TRUE(want_digest.ok());
    const Digest d = DigestOf(p.target, es);
    EXPECT_EQ(d.lo, *want_digest) << "es " << es;
    EXPECT_EQ(d.hi, p.target.size());
    std::vector<uint64_t> enc_units, dec_units, copy_units, fill_units;
    EncodeOptions o;
    o.elem_size = es;
    o.target_unit_hashes = &enc_units;
    Bytes copy(p.target.size()), out(MaxEncodedBytes(p.target.size(), es));
    Digest td;
    auto n = EncodeCopying({4, p.base}, {5, p.target}, absl::MakeSpan(copy), o, absl::MakeSpan(out), &td);
    ASSERT_TRUE(n.ok()) << n.status();
    out.resize(*n);
    EXPECT_EQ(td, d);
    EXPECT_EQ(enc_units, want) << "es " << es;
    Bytes dec(p.target.size());
    ASSERT_TRUE(Decode(out, {4, p.base, DigestOf(p.base, es)}, absl::MakeSpan(dec), "w", {}, &dec_units).ok());
    EXPECT_EQ(dec, p.target);
    EXPECT_EQ(dec_units, want);
    Bytes c2(p.target.size());
    EXPECT_EQ(CopyAndDigest(p.target, absl::MakeSpan(c2), es, 65536, {}, &copy_units), d);
    EXPECT_EQ(copy_units, want);
    EXPECT_EQ(FillAndDigest([&](size_t off, absl::Span<uint8_t> dst) { std::memcpy(dst.data(), p.target.data() + off, dst.size()); },
                            absl::MakeSpan(c2), es, 65536, {}, &fill_units),
              d);
    EXPECT_EQ(fill_units, want);
    // A failed decode hands out nothing.
    std::vector<uint64_t> none = {7};
    Bytes bad = p.base;
    bad[3] ^= 1;
    EXPECT_FALSE(Decode(out, {4, bad, DigestOf(p.base, es)}, absl::MakeSpan(dec), "w", {}, &none).ok());
    EXPECT_EQ(none, std::vector<uint64_t>{7});
  }
  EXPECT_EQ(DigestOf({}, 2).hi, 0u);
  EXPECT_EQ(DigestOf({}, 2), DigestOf({}, 2));
}

// The observers (issue 17.4's unit hashes are taken there) see exactly the target / the decoded
// output, in order, one codec chunk at a time, from memory that holds those bytes.
TEST(DeltaCodec, ObserversSeeTheTargetAndTheDecodedOutputInOrder) {
  for (int es : {1, 2, 8}) {
    const Pair p = MakePair(3 * 4096 + 37, es, 0.04, 100, 31 + es);
    Bytes seen;
    size_t pieces = 0;
    EncodeOptions o;
    o.elem_size = es;
    o.chunk_elems = 4096;
    o.on_target = [&](absl::Span<const uint8_t> c) {
      seen.insert(seen.end(), c.begin(), c.end());
      ++pieces;
    };
    Bytes target_out(p.target.size()), out(MaxEncodedBytes(p.target.size(), es, 4096));
    Digest td;
    auto n = EncodeFilling({4, p.base}, 5, [&](size_t off, absl::Span<uint8_t> dst) { std::memcpy(dst.data(), p.target.data() + off, dst.size()); },
                           absl::MakeSpan(target_out), o, absl::MakeSpan(out), &td);
    ASSERT_TRUE(n.ok()) << n.status();
    out.resize(*n);
    EXPECT_EQ(seen, p.target) << "es " << es;
    EXPECT_EQ(pieces, 4u);
    seen.clear();
    Bytes dec(p.target.size());
    ASSERT_TRUE(Decode(out, {4, p.base, std::nullopt}, absl::MakeSpan(dec), "w",
                       [&](absl::Span<const uint8_t> c) {
                         // Each piece lies in `dec` (the caller's destination), already decoded.
                         EXPECT_GE(c.data(), dec.data());
                         EXPECT_LE(c.data() + c.size(), dec.data() + dec.size());
                         seen.insert(seen.end(), c.begin(), c.end());
                       }).ok());
    EXPECT_EQ(seen, p.target);
    seen.clear();
    Bytes filled(p.target.size());
    FillAndDigest([&](size_t off, absl::Span<uint8_t> dst) { std::memcpy(dst.data(), p.target.data() + off, dst.size()); },
                  absl::MakeSpan(filled), es, 5000, [&](absl::Span<const uint8_t> c) { seen.insert(seen.end(), c.begin(), c.end()); });
    EXPECT_EQ(seen, p.target);
  }
}

}  // namespace
}  // namespace wb::delta
