#include "planner/index_probe.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/presets.h"

namespace wb::planner {
namespace {

int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Renders pieces back into a probe (independent of the extractor): local element -> canonical index.
std::vector<int64_t> Render(const Inventory& inv, const std::vector<int64_t>& bases, const std::vector<Piece>& pieces,
                            int64_t n, int64_t offset_bytes, int es) {
  std::vector<int64_t> out(n, -1);
  for (const Piece& p : pieces) {
    const auto& shape = inv.tensors[p.tensor].shape;
    const auto cs = ContiguousStrides(shape);
    std::vector<int64_t> c = p.box.begin;
    const int64_t vol = BoxVolume(p.box);
    for (int64_t k = 0; k < vol; ++k) {
      int64_t local = (p.offset_bytes - offset_bytes) / es, flat = 0;
      for (size_t d = 0; d < c.size(); ++d) {
        local += (c[d] - p.box.begin[d]) * p.strides[d];
        flat += c[d] * cs[d];
      }
      EXPECT_TRUE(local >= 0 && local < n) << local;
      if (local < 0 || local >= n) return out;
      EXPECT_EQ(out[local], -1) << "local element " << local << " written twice";
      out[local] = bases[p.tensor] + flat;
      for (int d = static_cast<int>(c.size()) - 1; d >= 0; --d) {
        if (++c[d] < p.box.end[d]) break;
        c[d] = p.box.begin[d];
      }
    }
  }
  return out;
}

Inventory Synthetic() {
  Inventory inv;
  inv.tensors.push_back({"q", {8, 4}, DType::kBF16});
  inv.tensors.push_back({"k", {4, 4}, DType::kBF16});
  inv.tensors.push_back({"v", {4, 4}, DType::kBF16});
  inv.tensors.push_back({"w", {6, 5}, DType::kBF16});
  inv.tensors.push_back({"bias", {8}, DType::kBF16});
  inv.tensors.push_back({"f32", {3}, DType::kF32});
  return inv;
}

struct Fixture {
  Inventory inv = Synthetic();
  std::vector<int64_t> bases = TensorBases(inv);
  int64_t At(int t, std::vector<int64_t> c) const {
    auto cs = ContiguousStrides(inv.tensors[t].shape);
    int64_t f = bases[t];
    for (size_t d = 0; d < c.size(); ++d) f += c[d] * cs[d];
    return f;
  }
  // Extracts, checks the round trip, returns the pieces.
  std::vector<Piece> RoundTrip(const std::vector<int64_t>& probe, const std::vector<int64_t>& shape,
                               int64_t offset = 512) {
    auto pieces = ExtractPieces(inv, bases, probe, shape, offset, 2, 3);
    EXPECT_TRUE(pieces.ok()) << pieces.status();
    if (!pieces.ok()) return {};
    for (const Piece& p : *pieces) EXPECT_EQ(p.buffer, 3);
    EXPECT_EQ(Render(inv, bases, *pieces, Numel(shape), offset, 2), probe);
    return *pieces;
  }
};

TEST(IndexProbe, FusedQkv) {
  Fixture f;
  std::vector<int64_t> probe;
  for (int t = 0; t < 3; ++t) {
    for (int64_t r = 0; r < f.inv.tensors[t].shape[0]; ++r) {
      for (int64_t col = 0; col < 4; ++col) probe.push_back(f.At(t, {r, col}));
    }
  }
  auto pieces = f.RoundTrip(probe, {16, 4});
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(BoxToString(pieces[0].box), "[0:8, 0:4]");
  EXPECT_EQ(pieces[1].tensor, 1);
  EXPECT_EQ(pieces[1].offset_bytes, 512 + 32 * 2);
  EXPECT_EQ(pieces[2].offset_bytes, 512 + 48 * 2);
  EXPECT_EQ(pieces[2].strides, (std::vector<int64_t>{4, 1}));
}

TEST(IndexProbe, SplitColumnsAndPadding) {
  Fixture f;
  // Local [7, 2]: w[:, 3:5] plus one padding row.
  std::vector<int64_t> probe;
  for (int64_t r = 0; r < 6; ++r) {
    for (int64_t col = 3; col < 5; ++col) probe.push_back(f.At(3, {r, col}));
  }
  probe.push_back(-1);
  probe.push_back(-1);
  auto pieces = f.RoundTrip(probe, {7, 2});
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(BoxToString(pieces[0].box), "[0:6, 3:5]");
  EXPECT_EQ(pieces[0].strides, (std::vector<int64_t>{2, 1}));
}

TEST(IndexProbe, InterleavedGroups) {
  Fixture f;
  // Megatron-style: per group g of 2: [q rows 4g..4g+3; k rows 2g..2g+1; v rows 2g..2g+1].
  std::vector<int64_t> probe;
  for (int g = 0; g < 2; ++g) {
    for (int64_t r = 4 * g; r < 4 * g + 4; ++r)
      for (int col = 0; col < 4; ++col) probe.push_back(f.At(0, {r, col}));
    for (int t = 1; t < 3; ++t)
      for (int64_t r = 2 * g; r < 2 * g + 2; ++r)
        for (int col = 0; col < 4; ++col) probe.push_back(f.At(t, {r, col}));
  }
  auto pieces = f.RoundTrip(probe, {16, 4});
  EXPECT_EQ(pieces.size(), 6u);
}

TEST(IndexProbe, Transposed) {
  Fixture f;
  // Local [5, 6] = w^T.
  std::vector<int64_t> probe;
  for (int64_t a = 0; a < 5; ++a)
    for (int64_t b = 0; b < 6; ++b) probe.push_back(f.At(3, {b, a}));
  auto pieces = f.RoundTrip(probe, {5, 6});
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(BoxToString(pieces[0].box), "[0:6, 0:5]");
  EXPECT_EQ(pieces[0].strides, (std::vector<int64_t>{1, 6}));
}

TEST(IndexProbe, FlatRangeAndFlatFusion) {
  Fixture f;
  std::vector<int64_t> probe;
  for (int64_t x = 7; x < 23; ++x) probe.push_back(f.bases[3] + x);  // w flat [7, 23)
  auto pieces = f.RoundTrip(probe, {16});
  EXPECT_EQ(pieces.size(), FlatRangeToBoxes({6, 5}, 7, 23).size());
  // Whole q, k, v flattened back to back into 1-D: one box each.
  probe.clear();
  for (int64_t x = f.bases[0]; x < f.bases[3]; ++x) probe.push_back(x);
  pieces = f.RoundTrip(probe, {64});
  EXPECT_EQ(pieces.size(), 3u);
}

TEST(IndexProbe, StackedExpertsW13) {
  Fixture f;
  // Local [2, 4, 4]: slot 0 = [q rows 0..1; k rows 0..1], slot 1 = [q rows 2..3; v rows 2..3].
  std::vector<int64_t> probe;
  for (int s = 0; s < 2; ++s) {
    for (int64_t r = 2 * s; r < 2 * s + 2; ++r)
      for (int col = 0; col < 4; ++col) probe.push_back(f.At(0, {r, col}));
    for (int64_t r = 2 * s; r < 2 * s + 2; ++r)
      for (int col = 0; col < 4; ++col) probe.push_back(f.At(s == 0 ? 1 : 2, {r, col}));
  }
  auto pieces = f.RoundTrip(probe, {2, 4, 4});
  EXPECT_LE(pieces.size(), 4u);
}

TEST(IndexProbe, RandomPermutationsRoundTrip) {
  Fixture f;
  std::mt19937 rng(11);
  for (int iter = 0; iter < 200; ++iter) {
    // Random local tensor: random sub-box of w with random dim order, optionally with shuffled rows.
    const int64_t r0 = rng() % 6, r1 = r0 + 1 + rng() % (6 - r0);
    const int64_t c0 = rng() % 5, c1 = c0 + 1 + rng() % (5 - c0);
    const bool transpose = rng() % 2;
    std::vector<int64_t> probe;
    std::vector<int64_t> shape = transpose ? std::vector<int64_t>{c1 - c0, r1 - r0} : std::vector<int64_t>{r1 - r0, c1 - c0};
    for (int64_t a = 0; a < shape[0]; ++a)
      for (int64_t b = 0; b < shape[1]; ++b)
        probe.push_back(transpose ? f.At(3, {r0 + b, c0 + a}) : f.At(3, {r0 + a, c0 + b}));
    if (rng() % 3 == 0) std::shuffle(probe.begin(), probe.end(), rng);
    if (rng() % 3 == 0) probe[rng() % probe.size()] = -1;
    f.RoundTrip(probe, shape);
  }
}

TEST(IndexProbe, GarbageIsAnErrorOrExact) {
  Fixture f;
  const int64_t total = f.bases.back();
  EXPECT_EQ(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0, 1, 2}, {4}, 0, 2).status().code(),
            absl::StatusCode::kInvalidArgument);  // size mismatch
  EXPECT_FALSE(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0, total}, {2}, 0, 2).ok());  // out of range
  EXPECT_FALSE(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0, -7}, {2}, 0, 2).ok());
  EXPECT_FALSE(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{f.bases[5]}, {1}, 0, 2).ok());  // f32 vs 2 bytes
  EXPECT_TRUE(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{f.bases[5]}, {1}, 0, 4).ok());
  EXPECT_FALSE(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0}, {-1}, 0, 2).ok());
  EXPECT_FALSE(ExtractPieces(f.inv, {0, 1}, std::vector<int64_t>{0}, {1}, 0, 2).ok());
  // Random in-range values (duplicates included) are representable: the round trip must be exact.
  std::mt19937 rng(3);
  for (int iter = 0; iter < 100; ++iter) {
    std::vector<int64_t> probe(24);
    for (int64_t& x : probe) x = static_cast<int64_t>(rng() % f.bases[5]) - (rng() % 5 == 0 ? f.bases[5] : 0);
    for (int64_t& x : probe) x = x < 0 ? -1 : x;
    auto shape = (iter % 2) ? std::vector<int64_t>{4, 6} : std::vector<int64_t>{2, 3, 4};
    auto pieces = ExtractPieces(f.inv, f.bases, probe, shape, 0, 2);
    ASSERT_TRUE(pieces.ok()) << pieces.status();
    EXPECT_EQ(Render(f.inv, f.bases, *pieces, 24, 0, 2), probe);
  }
}

// A probe in a worker's shared memory can change while the node daemon extracts it. Here the
// probe spans two pages; the second is unreadable until CheckProbe first touches it, and that
// fault rewrites element 0 (already checked) to `changed_to`, so the extraction reads a value its
// check never saw. Before, element 0 = the inventory's total indexed one tensor past the
// inventory's end (the node daemon crashed: a worker rewriting its probe during RegisterLayout).
struct ChangingProbe {
  static inline int64_t* first = nullptr;
  static inline char* second_page = nullptr;
  static inline size_t page = 0;
  static inline int64_t changed_to = 0;
  static void OnFault(int, siginfo_t* info, void*) {
    char* at = static_cast<char*>(info->si_addr);
    if (second_page == nullptr || at < second_page || at >= second_page + page) {
      signal(SIGSEGV, SIG_DFL);  // not ours: crash as usual
      return;
    }
    *first = changed_to;
    mprotect(second_page, page, PROT_READ);
  }
};

absl::Status ExtractWhileElementZeroChanges(const Inventory& inv, const std::vector<int64_t>& bases, int64_t changed_to) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return absl::InternalError("mmap");
  auto* probe = static_cast<int64_t*>(mem);
  const int64_t n = static_cast<int64_t>(2 * page / sizeof(int64_t));
  for (int64_t i = 0; i < n; ++i) probe[i] = -1;
  probe[0] = 0;  // tensor q, element 0: valid when checked
  ChangingProbe::first = probe;
  ChangingProbe::second_page = static_cast<char*>(mem) + page;
  ChangingProbe::page = page;
  ChangingProbe::changed_to = changed_to;
  mprotect(ChangingProbe::second_page, page, PROT_NONE);
  struct sigaction sa {}, old {};
  sa.sa_sigaction = ChangingProbe::OnFault;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old);
  absl::Status s = ExtractPieces(inv, bases, absl::Span<const int64_t>(probe, static_cast<size_t>(n)), {n}, 0, 2).status();
  sigaction(SIGSEGV, &old, nullptr);
  ChangingProbe::second_page = nullptr;
  munmap(mem, 2 * page);
  return s;
}

TEST(IndexProbe, AProbeValueChangedAfterItsCheckIsAnErrorNotARead) {
  Fixture f;
  // Out of the inventory (its total, and far beyond), and into a tensor of another element size.
  for (int64_t changed_to : {f.bases.back(), int64_t{1} << 62, f.bases[5]}) {
    absl::Status s = ExtractWhileElementZeroChanges(f.inv, f.bases, changed_to);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << changed_to << ": " << s;
    EXPECT_NE(s.message().find("changed to"), std::string::npos) << s;
  }
  // A value changed to another valid one of the same element size is simply extracted.
  EXPECT_TRUE(ExtractWhileElementZeroChanges(f.inv, f.bases, 1).ok());
}

std::string ReadTestdata(const std::string& name) {
  std::ifstream in("planner/testdata/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Renders every local tensor of real preset layouts into probes and recovers equivalent pieces.
// Found by tests/fuzz/fuzz_index_probe: an unaligned offset gave pieces that ValidateLayout rejects,
// and an offset near 2^63 overflowed the pieces' offsets.
TEST(IndexProbe, MisalignedOrOverflowingOffsetIsAnError) {
  Fixture f;
  EXPECT_EQ(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0, 1}, {2}, 3, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0, 1}, {2},
                          std::numeric_limits<int64_t>::max() - 1, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ExtractPieces(f.inv, f.bases, std::vector<int64_t>{0, 1}, {2}, 6, 2).ok());
}

TEST(IndexProbe, RecoversPresetLayouts) {
  auto c = ParseHfConfig(ReadTestdata("qwen2.5-0.5b.json"));
  ASSERT_TRUE(c.ok());
  c->layers = 1;
  c->vocab = 1000;  // keep probes small; sharding rules are unchanged
  c->hidden = 64;
  c->intermediate = 128;
  c->heads = 4;
  c->kv_heads = 2;
  c->head_dim = 16;
  auto inv = BuildInventory(*c, DType::kBF16);
  ASSERT_TRUE(inv.ok());
  const std::vector<int64_t> bases = TensorBases(*inv);
  for (ParallelConfig par : {ParallelConfig{.preset = "vllm", .tp = 4}, ParallelConfig{.preset = "megatron", .tp = 2},
                             ParallelConfig{.preset = "fsdp", .dp = 3}}) {
    auto l = MakePresetLayout(*c, *inv, par, 1);
    ASSERT_TRUE(l.ok()) << l.status();
    for (const LocalTensor& lt : l->local_tensors) {
      std::vector<Piece> truth(l->layout.pieces.begin() + lt.first_piece,
                               l->layout.pieces.begin() + lt.first_piece + lt.num_pieces);
      const int64_t n = Numel(lt.shape);
      std::vector<int64_t> probe = Render(*inv, bases, truth, n, lt.offset_bytes, 2);
      auto got = ExtractPieces(*inv, bases, probe, lt.shape, lt.offset_bytes, 2);
      ASSERT_TRUE(got.ok()) << lt.name << ": " << got.status();
      EXPECT_EQ(Render(*inv, bases, *got, n, lt.offset_bytes, 2), probe) << lt.name;
      EXPECT_EQ(got->size(), truth.size()) << par.preset << " " << lt.name;
    }
  }
}

}  // namespace
}  // namespace wb::planner
