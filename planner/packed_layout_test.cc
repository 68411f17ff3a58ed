#include "planner/packed_layout.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "planner/quantized.h"

namespace wb::planner {
namespace {

// Every field of two layouts, piece by piece (WorkerLayout has no operator==).
void ExpectSameLayout(const WorkerLayout& a, const WorkerLayout& b, const std::string& ctx) {
  ASSERT_EQ(a.buffers.size(), b.buffers.size()) << ctx;
  for (size_t i = 0; i < a.buffers.size(); ++i) EXPECT_EQ(a.buffers[i].size_bytes, b.buffers[i].size_bytes) << ctx << " buffer " << i;
  ASSERT_EQ(a.pieces.size(), b.pieces.size()) << ctx;
  for (size_t i = 0; i < a.pieces.size(); ++i) {
    const Piece& x = a.pieces[i];
    const Piece& y = b.pieces[i];
    const std::string at = absl::StrCat(ctx, " piece ", i);
    ASSERT_EQ(x.tensor, y.tensor) << at;
    ASSERT_EQ(x.box.begin, y.box.begin) << at;
    ASSERT_EQ(x.box.end, y.box.end) << at;
    ASSERT_EQ(x.buffer, y.buffer) << at;
    ASSERT_EQ(x.offset_bytes, y.offset_bytes) << at;
    ASSERT_EQ(x.strides, y.strides) << at;
    ASSERT_EQ(x.quant.has_value(), y.quant.has_value()) << at;
    if (!x.quant.has_value()) continue;
    ASSERT_EQ(x.quant->dtype, y.quant->dtype) << at;
    ASSERT_EQ(x.quant->block, y.quant->block) << at;
    ASSERT_EQ(x.quant->scale_buffer, y.quant->scale_buffer) << at;
    ASSERT_EQ(x.quant->scale_offset_bytes, y.quant->scale_offset_bytes) << at;
    ASSERT_EQ(x.quant->scale_dtype, y.quant->scale_dtype) << at;
    ASSERT_EQ(x.quant->global_scale_offset_bytes, y.quant->global_scale_offset_bytes) << at;
  }
}

// Pieces whose every field differs from the defaults and from each other's, of ranks 0-3, some
// quantised (each format's fields), one malformed (box and strides of different lengths: packed
// layouts need not be validated to come back exactly).
WorkerLayout Varied() {
  WorkerLayout l;
  l.buffers = {{1000}, {2000}, {3}};
  for (int i = 0; i < 12; ++i) {
    Piece p;
    p.tensor = 100 + i;
    const int rank = i % 4;
    for (int d = 0; d < rank; ++d) {
      p.box.begin.push_back(10 * i + d);
      p.box.end.push_back(10 * i + d + 5 + d);
      p.strides.push_back(1000 * i + 7 * d + 1);
    }
    p.buffer = i % 3;
    p.offset_bytes = int64_t{1} << (20 + i);
    if (i % 3 == 1) {
      Quantization q;
      q.dtype = i % 2 ? DType::kI4 : DType::kF4E2M1;
      for (int d = 0; d < rank; ++d) q.block.push_back(16 << d);
      q.scale_buffer = 2 + i;
      q.scale_offset_bytes = 77 * i;
      q.scale_dtype = i % 2 ? DType::kBF16 : DType::kF8E4M3;
      q.global_scale_offset_bytes = i % 2 ? -1 : 4096 + i;
      p.quant = q;
    }
    l.pieces.push_back(std::move(p));
  }
  l.pieces[5].strides.push_back(9);  // malformed: strides one longer than the box
  return l;
}

TEST(PackedLayoutTest, UnpackGivesBackEveryField) {
  const WorkerLayout l = Varied();
  absl::StatusOr<PackedLayout> packed = PackedLayout::Pack(l);
  ASSERT_TRUE(packed.ok()) << packed.status();
  ExpectSameLayout(l, packed->Unpack(), "varied");
  ExpectSameLayout(WorkerLayout{}, PackedLayout::Pack(WorkerLayout{})->Unpack(), "empty");
}

TEST(PackedLayoutTest, AccessorsReadEachPiece) {
  const WorkerLayout l = Varied();
  absl::StatusOr<PackedLayout> p = PackedLayout::Pack(l);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->num_pieces(), l.pieces.size());
  ASSERT_EQ(p->buffers().size(), l.buffers.size());
  for (size_t i = 0; i < l.pieces.size(); ++i) {
    const Piece& x = l.pieces[i];
    EXPECT_EQ(p->tensor(i), x.tensor) << i;
    EXPECT_EQ(p->buffer(i), x.buffer) << i;
    EXPECT_EQ(p->offset_bytes(i), x.offset_bytes) << i;
    EXPECT_EQ(std::vector<int64_t>(p->begin(i).begin(), p->begin(i).end()), x.box.begin) << i;
    EXPECT_EQ(std::vector<int64_t>(p->end(i).begin(), p->end(i).end()), x.box.end) << i;
    EXPECT_EQ(std::vector<int64_t>(p->strides(i).begin(), p->strides(i).end()), x.strides) << i;
    EXPECT_TRUE(BoxEqual(p->box(i), x.box)) << i;
    EXPECT_EQ(p->quantized(i), x.quant.has_value()) << i;
    EXPECT_EQ(p->scale_buffer(i), x.quant ? x.quant->scale_buffer : -1) << i;
    EXPECT_EQ(p->global_scale_offset_bytes(i), x.quant ? x.quant->global_scale_offset_bytes : -1) << i;
    // The box helper agrees with planner::BoxContains, inside and outside.
    EXPECT_TRUE(p->BoxContains(i, x.box)) << i;
    if (!x.box.begin.empty()) {
      Box wider = x.box;
      wider.end.back() += 1;
      EXPECT_EQ(p->BoxContains(i, wider), BoxContains(x.box, wider)) << i;
      EXPECT_FALSE(p->BoxContains(i, wider)) << i;
      Box inner = x.box;
      inner.begin.back() += 1;
      EXPECT_TRUE(p->BoxContains(i, inner)) << i;
    }
  }
  EXPECT_EQ(p->HasQuantizedPieces(), HasQuantizedPieces(l));
  EXPECT_EQ(p->HasGlobalScales(), HasGlobalScales(l));
  EXPECT_TRUE(p->HasGlobalScales());
  WorkerLayout plain = l;
  for (Piece& x : plain.pieces) x.quant.reset();
  EXPECT_FALSE(PackedLayout::Pack(plain)->HasQuantizedPieces());
  WorkerLayout no_global = l;
  for (Piece& x : no_global.pieces) {
    if (x.quant) x.quant->global_scale_offset_bytes = -1;
  }
  EXPECT_TRUE(PackedLayout::Pack(no_global)->HasQuantizedPieces());
  EXPECT_FALSE(PackedLayout::Pack(no_global)->HasGlobalScales());
}

TEST(PackedLayoutTest, EqualityIsEveryField) {
  const WorkerLayout l = Varied();
  const PackedLayout a = *PackedLayout::Pack(l);
  EXPECT_TRUE(a == *PackedLayout::Pack(l));
  auto differs = [&](auto change) {
    WorkerLayout m = l;
    change(m);
    return !(a == *PackedLayout::Pack(m));
  };
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.buffers[1].size_bytes += 1; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[3].tensor += 1; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[3].box.end[0] += 1; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[3].strides[1] += 1; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[3].offset_bytes += 1; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[7].quant->block[0] += 1; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[7].quant->scale_dtype = DType::kF32; }));
  EXPECT_TRUE(differs([](WorkerLayout& m) { m.pieces[7].quant->global_scale_offset_bytes = 5; }));
}

TEST(PackedLayoutTest, RefusesMoreDimsThanItHolds) {
  WorkerLayout l;
  l.buffers = {{8}};
  Piece p;
  p.tensor = 0;
  p.box.begin.assign(256, 0);
  p.box.end.assign(256, 1);
  p.strides.assign(256, 1);
  l.pieces.push_back(p);
  absl::StatusOr<PackedLayout> packed = PackedLayout::Pack(l);
  ASSERT_FALSE(packed.ok());
  EXPECT_EQ(packed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(packed.status().message().find("piece 0"), std::string::npos) << packed.status();
  l.pieces[0].box.begin.resize(255);
  l.pieces[0].box.end.resize(255);
  l.pieces[0].strides.resize(255);
  EXPECT_TRUE(PackedLayout::Pack(l).ok());
}

// What a holder pays per 2-D piece: a 32-byte record and six coordinates, nothing per piece on the
// heap besides (WorkerLayout: ~260 bytes).
TEST(PackedLayoutTest, TwoDimPiecesCostEightyBytes) {
  WorkerLayout l;
  l.buffers = {{int64_t{16} << 20}};
  constexpr int kPieces = 100000;
  for (int i = 0; i < kPieces; ++i) {
    Piece p;
    p.tensor = 0;
    p.box = {{i, 0}, {i + 1, 8}};
    p.offset_bytes = int64_t{16} * i;
    p.strides = {8, 1};
    l.pieces.push_back(std::move(p));
  }
  const PackedLayout p = *PackedLayout::Pack(l);
  EXPECT_EQ(p.heap_bytes(), sizeof(BufferInfo) + size_t{kPieces} * (32 + 6 * 8));
}

// Every preset's rank layouts (all families of planner/testdata, trainer and engine presets,
// quantised engines) come back exactly.
std::string ReadTestdata(const std::string& name) {
  std::ifstream f("planner/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(PackedLayoutTest, PresetLayoutsComeBackExactly) {
  struct Case {
    std::string model;
    ParallelConfig par;
  };
  auto par = [](std::string preset, int tp, int pp, int dp, int ep, std::string quant = "") {
    ParallelConfig p;
    p.preset = std::move(preset);
    p.tp = tp;
    p.pp = pp;
    p.dp = dp;
    p.ep = ep;
    p.quantization = std::move(quant);
    return p;
  };
  const std::vector<Case> cases = {
      {"qwen2.5-0.5b.json", par("megatron", 2, 2, 1, 1)},
      {"qwen2.5-0.5b.json", par("fsdp_flat", 1, 1, 4, 1)},
      {"qwen2.5-0.5b.json", par("fsdp2", 1, 1, 4, 1)},
      {"qwen2.5-0.5b.json", par("vllm", 2, 1, 1, 1)},
      {"qwen2.5-0.5b.json", par("vllm", 1, 1, 1, 1, "fp8_block128")},
      {"qwen2.5-0.5b.json", par("vllm", 2, 1, 1, 1, "w4a16_g32")},
      {"qwen2.5-0.5b.json", par("vllm", 2, 1, 1, 1, "nvfp4")},
      {"qwen2.5-0.5b.json", par("sglang", 2, 1, 1, 1, "mxfp8")},
      {"qwen3-30b-a3b.json", ParallelConfig{.preset = "vllm", .tp = 2, .expert_parallel = true}},
      {"deepseek-v2-lite.json", ParallelConfig{.preset = "megatron", .tp = 2, .dp = 2, .ep = 4, .etp = 1}},
  };
  int layouts = 0, quantized = 0;
  for (const Case& c : cases) {
    absl::StatusOr<ModelConfig> config = ParseHfConfig(ReadTestdata(c.model));
    ASSERT_TRUE(config.ok()) << c.model << ": " << config.status();
    config->layers = std::min<int64_t>(config->layers, 3);  // the rules, not the size
    absl::StatusOr<Inventory> inv = BuildInventory(*config, DType::kBF16);
    ASSERT_TRUE(inv.ok()) << inv.status();
    absl::StatusOr<PresetBuilder> builder = PresetBuilder::Create(*config, *inv, c.par);
    ASSERT_TRUE(builder.ok()) << c.model << " " << c.par.preset << ": " << builder.status();
    for (int rank = 0; rank < builder->world_size(); ++rank) {
      absl::StatusOr<PresetLayout> l = builder->Make(rank);
      ASSERT_TRUE(l.ok()) << l.status();
      absl::StatusOr<PackedLayout> packed = PackedLayout::Pack(l->layout);
      ASSERT_TRUE(packed.ok()) << packed.status();
      ExpectSameLayout(l->layout, packed->Unpack(), absl::StrCat(c.model, " ", c.par.preset, " ", c.par.quantization, " rank ", rank));
      EXPECT_EQ(packed->HasQuantizedPieces(), HasQuantizedPieces(l->layout));
      EXPECT_EQ(packed->HasGlobalScales(), HasGlobalScales(l->layout));
      ++layouts;
      quantized += packed->HasQuantizedPieces();
    }
  }
  EXPECT_GT(layouts, 20);
  EXPECT_GT(quantized, 4);
}

}  // namespace
}  // namespace wb::planner
