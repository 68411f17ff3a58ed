// host_tcp's unit hashing (transport.h UnitHashes; the end-to-end digests' cost): both sides hash
// each op's logical stream unit by unit as the bytes cross, the receiver what landed in its
// memory, the sender what it read; a frame that cuts a unit leaves the op incomplete; a bit flipped
// on the wire shows in the receiver's hashes.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "transport/host_tcp/connected_pair.h"
#include "transport/host_tcp/host_tcp.h"

namespace wb::transport {
namespace {

using Pair = ConnectedPair;

absl::StatusOr<Pair> Connected(const TransportConfig& ca, const TransportConfig& cb) {
  return ConnectHostTcpPair(ca, cb);
}

// XXH3-64 (seed k) of every unit of a logical stream.
std::vector<uint64_t> Units(const std::vector<char>& stream, int64_t unit) {
  std::vector<uint64_t> out;
  const int64_t n = static_cast<int64_t>(stream.size());
  for (int64_t off = 0, k = 0; off < n; off += unit, ++k) {
    out.push_back(XXH3_64bits_withSeed(stream.data() + off, static_cast<size_t>(std::min(unit, n - off)), static_cast<uint64_t>(k)));
  }
  return out;
}

std::vector<char> Pattern(int64_t n, uint32_t seed) {
  std::vector<char> v(static_cast<size_t>(n));
  uint32_t x = seed;
  for (char& c : v) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

// Memory on both sides and the ops of one test batch, A's view and B's view.
struct Memory {
  std::vector<char> a_mem, b_mem;
  RegionHandle a_h, b_h, a_in_b, b_in_a;
};

absl::Status Register(Pair& p, Memory& s) {
  auto a_h = p.a->RegisterMemory({MemoryKind::kHost, s.a_mem.data(), static_cast<int64_t>(s.a_mem.size()), -1, "", 0, "a"});
  auto b_h = p.b->RegisterMemory({MemoryKind::kHost, s.b_mem.data(), static_cast<int64_t>(s.b_mem.size()), -1, "", 0, "b"});
  if (!a_h.ok()) return a_h.status();
  if (!b_h.ok()) return b_h.status();
  auto da = p.a->ExportDescriptor(*a_h);
  auto db = p.b->ExportDescriptor(*b_h);
  if (!da.ok()) return da.status();
  if (!db.ok()) return db.status();
  auto a_in_b = p.b->ImportDescriptor(*da);
  auto b_in_a = p.a->ImportDescriptor(*db);
  if (!a_in_b.ok()) return a_in_b.status();
  if (!b_in_a.ok()) return b_in_a.status();
  s.a_h = *a_h;
  s.b_h = *b_h;
  s.a_in_b = *a_in_b;
  s.b_in_a = *b_in_a;
  return absl::OkStatus();
}

// Posts the mirror batches on both sides and waits for both.
absl::Status RunMirror(Pair& p, Batch a, Batch b) {
  a.peer = p.a_to_b;
  b.peer = p.b_to_a;
  auto ia = p.a->Post(a);
  if (!ia.ok()) return ia.status();
  auto ib = p.b->Post(b);
  if (!ib.ok()) return ib.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Status sa = p.a->Wait(*ia, deadline);
  absl::Status sb = p.b->Wait(*ib, deadline);
  return sa.ok() ? sb : sa;
}

// Three ops: A -> B contiguous (5 units and a bit), A -> B into a padded 2-D layout on B (rows of
// 1000 bytes, pitch 1024), B -> A contiguous with a unit larger than chunk_bytes; and one A -> B op
// not hashed. Both sides' hashes equal the units of the logical stream.
// `cap`: both sides' egress cap (0 = none). A capped writer hashes each chunk's units before it
// waits for its booking, not as it sends: the hashes must be the same.
void ExpectBothSidesHashEveryUnit(double cap) {
  TransportConfig c;
  c.tcp.streams = 3;
  c.tcp.chunk_bytes = 256 << 10;
  c.tcp.max_send_bytes_per_s = cap;
  auto p = Connected(c, c);
  ASSERT_TRUE(p.ok()) << p.status();
  constexpr int64_t kUnit = 128 << 10, kBig = 5 * kUnit + 1000, kRows = 700, kCols = 1000, kPitch = 1024;
  constexpr int64_t kBack = 3 * (512 << 10) + 17, kBackUnit = 512 << 10, kPlain = 70000;
  Memory s;
  s.a_mem = Pattern(kBig + kRows * kCols + kBack + kPlain, 1);
  s.b_mem.assign(static_cast<size_t>(kBig + kRows * kPitch + kBack + kPlain), 0);
  std::vector<char> back = Pattern(kBack, 2);
  std::memcpy(s.b_mem.data() + kBig + kRows * kPitch, back.data(), back.size());
  ASSERT_TRUE(Register(*p, s).ok());
  const int64_t a_back = kBig + kRows * kCols, b_back = kBig + kRows * kPitch;

  auto ops = [&](RegionHandle a, RegionHandle b) {
    std::vector<CopyOp> v(4);
    v[0].shape = {kBig};
    v[0].src = {a, 0, {1}};
    v[0].dst = {b, 0, {1}};
    v[1].shape = {kRows, kCols};
    v[1].src = {a, kBig, {kCols, 1}};
    v[1].dst = {b, kBig, {kPitch, 1}};
    v[2].shape = {kBack};
    v[2].src = {b, b_back, {1}};
    v[2].dst = {a, a_back, {1}};
    v[3].shape = {kPlain};
    v[3].src = {a, a_back + kBack, {1}};
    v[3].dst = {b, b_back + kBack, {1}};
    return v;
  };
  Batch ba, bb;
  ba.tag = bb.tag = 7;
  ba.ops = ops(s.a_h, s.b_in_a);
  bb.ops = ops(s.a_in_b, s.b_h);
  ba.unit_hashes = std::make_shared<UnitHashes>();
  ba.unit_hashes->unit_bytes = {kUnit, kUnit, kBackUnit, 0};
  bb.unit_hashes = std::make_shared<UnitHashes>();
  bb.unit_hashes->unit_bytes = ba.unit_hashes->unit_bytes;
  ASSERT_TRUE(RunMirror(*p, ba, bb).ok());

  const std::vector<char> big(s.a_mem.begin(), s.a_mem.begin() + kBig);
  const std::vector<char> grid(s.a_mem.begin() + kBig, s.a_mem.begin() + kBig + kRows * kCols);
  const std::vector<std::vector<uint64_t>> want = {Units(big, kUnit), Units(grid, kUnit), Units(back, kBackUnit), {}};
  for (const auto* uh : {ba.unit_hashes.get(), bb.unit_hashes.get()}) {
    ASSERT_EQ(uh->complete.size(), 4u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(uh->complete[i], 1) << "op " << i << (uh == ba.unit_hashes.get() ? " on A" : " on B");
      EXPECT_EQ(uh->hashes[i], want[i]) << "op " << i;
    }
    EXPECT_EQ(uh->complete[3], 0);
    EXPECT_TRUE(uh->hashes[3].empty());
  }
  // The bytes moved as always.
  EXPECT_EQ(std::memcmp(s.b_mem.data(), big.data(), big.size()), 0);
  for (int64_t r = 0; r < kRows; ++r) {
    ASSERT_EQ(std::memcmp(s.b_mem.data() + kBig + r * kPitch, grid.data() + r * kCols, kCols), 0) << "row " << r;
  }
  EXPECT_EQ(std::memcmp(s.a_mem.data() + a_back, back.data(), back.size()), 0);
  EXPECT_EQ(std::memcmp(s.b_mem.data() + b_back + kBack, s.a_mem.data() + a_back + kBack, kPlain), 0);
}

TEST(HostTcpUnitHashesTest, BothSidesHashEveryUnitOfTheLogicalStream) { ExpectBothSidesHashEveryUnit(0); }

// 100 MB/s: about 3 MB of ops, so every chunk after the first few waits for its booking.
TEST(HostTcpUnitHashesTest, ACappedSenderHashesWhileItWaitsAndGetsTheSameHashes) { ExpectBothSidesHashEveryUnit(100e6); }

// The sender did not ask for units (its frames are chunk_bytes long): frames of the receiver's op
// cut its units, so it reports the op incomplete (and the batch still succeeds).
TEST(HostTcpUnitHashesTest, FramesThatCutUnitsLeaveTheOpIncomplete) {
  TransportConfig c;
  c.tcp.chunk_bytes = 64 << 10;
  auto p = Connected(c, c);
  ASSERT_TRUE(p.ok()) << p.status();
  constexpr int64_t kN = 1 << 20;
  Memory s;
  s.a_mem = Pattern(kN, 3);
  s.b_mem.assign(kN, 0);
  ASSERT_TRUE(Register(*p, s).ok());
  Batch ba, bb;
  ba.tag = bb.tag = 8;
  CopyOp op;
  op.shape = {kN};
  op.src = {s.a_h, 0, {1}};
  op.dst = {s.b_in_a, 0, {1}};
  ba.ops = {op};
  op.src.region = s.a_in_b;
  op.dst.region = s.b_h;
  bb.ops = {op};
  bb.unit_hashes = std::make_shared<UnitHashes>();
  bb.unit_hashes->unit_bytes = {96 << 10};  // not a divisor of the sender's 64 KiB frames
  ASSERT_TRUE(RunMirror(*p, ba, bb).ok());
  EXPECT_EQ(bb.unit_hashes->complete, std::vector<uint8_t>{0});
  EXPECT_EQ(s.a_mem, s.b_mem);
}

// A bit flipped on the wire (as it lands, before any hash): the receiver's hashes are those of
// what landed, so exactly one unit differs from the sender's.
TEST(HostTcpUnitHashesTest, ABitFlippedOnTheWireShowsInTheReceiversHashes) {
  TransportConfig c;
  c.tcp.chunk_bytes = 64 << 10;
  auto p = Connected(c, c);
  ASSERT_TRUE(p.ok()) << p.status();
  constexpr int64_t kN = 1 << 20, kUnit = 64 << 10;
  Memory s;
  s.a_mem = Pattern(kN, 4);
  s.b_mem.assign(kN, 0);
  ASSERT_TRUE(Register(*p, s).ok());
  Batch ba, bb;
  ba.tag = bb.tag = 9;
  CopyOp op;
  op.shape = {kN};
  op.src = {s.a_h, 0, {1}};
  op.dst = {s.b_in_a, 0, {1}};
  ba.ops = {op};
  op.src.region = s.a_in_b;
  op.dst.region = s.b_h;
  bb.ops = {op};
  for (Batch* x : {&ba, &bb}) {
    x->unit_hashes = std::make_shared<UnitHashes>();
    x->unit_hashes->unit_bytes = {kUnit};
  }
  ASSERT_TRUE(HostTcpTestFlipNextReceived(*p->b).ok());
  ASSERT_TRUE(RunMirror(*p, ba, bb).ok());
  ASSERT_EQ(ba.unit_hashes->complete, std::vector<uint8_t>{1});
  ASSERT_EQ(bb.unit_hashes->complete, std::vector<uint8_t>{1});
  EXPECT_EQ(ba.unit_hashes->hashes[0], Units(s.a_mem, kUnit));
  EXPECT_EQ(bb.unit_hashes->hashes[0], Units(s.b_mem, kUnit)) << "the receiver hashes what landed";
  int differ = 0, bytes = 0;
  for (size_t k = 0; k < ba.unit_hashes->hashes[0].size(); ++k) differ += ba.unit_hashes->hashes[0][k] != bb.unit_hashes->hashes[0][k];
  for (int64_t i = 0; i < kN; ++i) bytes += s.a_mem[static_cast<size_t>(i)] != s.b_mem[static_cast<size_t>(i)];
  EXPECT_EQ(differ, 1);
  EXPECT_EQ(bytes, 1);
}

}  // namespace
}  // namespace wb::transport
