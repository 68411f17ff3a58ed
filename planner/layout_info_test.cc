#include "planner/layout_info.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "planner/validate.h"

namespace wb::planner {
namespace {

struct Model {
  ModelConfig config;
  Inventory inv;
};

Model Load(const std::string& name, int64_t layers) {
  std::ifstream f("planner/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  auto c = ParseHfConfig(ss.str());
  EXPECT_TRUE(c.ok()) << c.status();
  Model m{*c, {}};
  m.config.layers = layers;
  auto inv = BuildInventory(m.config, DType::kBF16);
  EXPECT_TRUE(inv.ok()) << inv.status();
  m.inv = *inv;
  return m;
}

const LocalTensorInfo* Find(const LayoutInfo& info, const std::string& name) {
  for (const LocalTensorInfo& t : info.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// Every piece lies inside the local tensor that lists it, tensors are 256-byte aligned, in
// increasing offsets, disjoint, inside buffer 0, and the buffer is the preset's.
void CheckPresetDescription(const Inventory& inv, const PresetLayout& preset, const LayoutInfo& info) {
  ASSERT_EQ(info.buffer_bytes.size(), 1u);
  EXPECT_EQ(info.buffer_bytes[0], preset.layout.buffers[0].size_bytes);
  ASSERT_EQ(info.tensors.size(), preset.local_tensors.size());
  int64_t prev_end = 0, covered = 0;
  size_t listed = 0;
  for (const LocalTensorInfo& t : info.tensors) {
    EXPECT_EQ(t.offset_bytes % kLocalTensorAlignment, 0) << t.name;
    EXPECT_GE(t.offset_bytes, prev_end) << t.name;
    prev_end = t.offset_bytes + t.size_bytes;
    EXPECT_LE(prev_end, info.buffer_bytes[0]) << t.name;
    ASSERT_EQ(t.strides.size(), t.shape.size()) << t.name;
    if (!t.shape.empty()) {
      EXPECT_EQ(t.strides.back(), 1) << t.name;
      for (size_t d = 0; d + 1 < t.shape.size(); ++d) EXPECT_EQ(t.strides[d], t.strides[d + 1] * t.shape[d + 1]) << t.name;
    }
    for (int32_t k : t.pieces) {
      const Piece& p = info.layout.pieces[k];
      auto end = PieceEndByte(inv, p);
      ASSERT_TRUE(end.ok()) << end.status();
      EXPECT_GE(p.offset_bytes, t.offset_bytes) << t.name;
      EXPECT_LE(*end, t.offset_bytes + t.size_bytes) << t.name << " piece of " << inv.tensors[p.tensor].name;
      covered += BoxVolume(p.box) * DTypeSize(inv.tensors[p.tensor].dtype);
      ++listed;
    }
  }
  EXPECT_EQ(listed, info.layout.pieces.size());
  EXPECT_EQ(info.piece_bytes, covered);
}

TEST(LayoutInfoTest, MegatronTp2DescribesEveryLocalTensorAtItsPackedPlace) {
  Model m = Load("qwen2.5-0.5b.json", 2);
  ParallelConfig pc;
  pc.preset = "megatron";
  pc.tp = 2;
  for (int rank = 0; rank < 2; ++rank) {
    auto preset = MakePresetLayout(m.config, m.inv, pc, rank);
    ASSERT_TRUE(preset.ok()) << preset.status();
    LayoutInfo info = DescribePresetLayout(m.inv, *preset);
    CheckPresetDescription(m.inv, *preset, info);
    // Qwen2.5-0.5B: 14 heads, 2 KV heads of 64, hidden 896: linear_qkv holds one query group per
    // rank = (7 + 2) * 64 rows.
    const LocalTensorInfo* qkv = Find(info, "decoder.layers.1.self_attention.linear_qkv.weight");
    ASSERT_NE(qkv, nullptr);
    EXPECT_EQ(qkv->shape, (std::vector<int64_t>{9 * 64, 896}));
    EXPECT_EQ(qkv->dtype, DType::kBF16);
    EXPECT_EQ(qkv->size_bytes, 9 * 64 * 896 * 2);
    EXPECT_EQ(qkv->pieces.size(), 3u);  // q, k, v of the group
    const LocalTensorInfo* emb = Find(info, "embedding.word_embeddings.weight");
    ASSERT_NE(emb, nullptr);
    EXPECT_EQ(emb->offset_bytes, 0);
    EXPECT_TRUE(emb->scale_tensor.empty());
  }
}

TEST(LayoutInfoTest, QuantisedVllmTensorsNameTheirScales) {
  Model m = Load("qwen2.5-0.5b.json", 1);
  ParallelConfig pc;
  pc.preset = "vllm";
  pc.tp = 1;
  pc.quantization = "fp8_block128";
  auto preset = MakePresetLayout(m.config, m.inv, pc, 0);
  ASSERT_TRUE(preset.ok()) << preset.status();
  LayoutInfo info = DescribePresetLayout(m.inv, *preset);
  CheckPresetDescription(m.inv, *preset, info);
  const LocalTensorInfo* o = Find(info, "model.layers.0.self_attn.o_proj.weight");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->dtype, DType::kF8E4M3);
  EXPECT_EQ(o->size_bytes, 896 * 896);
  ASSERT_EQ(o->scale_tensor, "model.layers.0.self_attn.o_proj.weight_scale_inv");
  const LocalTensorInfo* s = Find(info, o->scale_tensor);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->scales_of, o->name);
  EXPECT_EQ(s->dtype, DType::kF32);
  EXPECT_EQ(s->shape, (std::vector<int64_t>{7, 7}));  // ceil(896 / 128) blocks per dim
  EXPECT_EQ(s->size_bytes, 7 * 7 * 4);
  EXPECT_TRUE(s->pieces.empty());
  // Every quantised piece's scales start inside its scales tensor.
  const Piece& p = info.layout.pieces[o->pieces.front()];
  ASSERT_TRUE(p.quant.has_value());
  EXPECT_EQ(p.quant->scale_offset_bytes, s->offset_bytes);
  // The embedding stays bf16 and has no scales.
  const LocalTensorInfo* e = Find(info, "model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, DType::kBF16);
  EXPECT_TRUE(e->scale_tensor.empty());
}

Inventory Small() {
  Inventory inv;
  inv.tensors = {{"q", {8, 8}, DType::kBF16}, {"b", {8}, DType::kF32}, {"w", {256, 192}, DType::kBF16}};
  return inv;
}

// NVFP4 pieces: each gets its e4m3 scales; the float32 global scale two of them share is described
// once, named after the first piece that names it, and counts towards its buffer's size.
TEST(LayoutInfoTest, Nvfp4PiecesDescribeTheirSharedGlobalScaleOnce) {
  Inventory inv = Small();
  WorkerLayout l;
  Piece top{2, Box{{0, 0}, {128, 192}}, 0, 0, {192, 1}, std::nullopt};
  top.quant = Quantization{DType::kF4E2M1, {1, 16}, 1, 0, DType::kF8E4M3, 2 * 128 * 12};
  Piece bottom{2, Box{{128, 0}, {256, 192}}, 0, 128 * 96, {192, 1}, std::nullopt};
  bottom.quant = Quantization{DType::kF4E2M1, {1, 16}, 1, 128 * 12, DType::kF8E4M3, 2 * 128 * 12};
  l.pieces = {top, bottom};
  auto info = DescribePieces(inv, l);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->buffer_bytes, (std::vector<int64_t>{256 * 96, 2 * 128 * 12 + 4}));
  ASSERT_EQ(info->tensors.size(), 5u);
  EXPECT_EQ(info->tensors[0].name, "w[0:128, 0:192]");
  EXPECT_EQ(info->tensors[0].dtype, DType::kF4E2M1);
  EXPECT_EQ(info->tensors[0].size_bytes, 127 * 96 + 96);
  EXPECT_EQ(info->tensors[0].scale_tensor, "w[0:128, 0:192]_scale");
  EXPECT_EQ(info->tensors[0].global_scale_tensor, "w[0:128, 0:192]_scale_2");
  EXPECT_EQ(info->tensors[1].dtype, DType::kF8E4M3);
  EXPECT_EQ(info->tensors[1].shape, (std::vector<int64_t>{128, 12}));
  EXPECT_EQ(info->tensors[2].name, "w[0:128, 0:192]_scale_2");
  EXPECT_EQ(info->tensors[2].dtype, DType::kF32);
  EXPECT_EQ(info->tensors[2].offset_bytes, 2 * 128 * 12);
  EXPECT_EQ(info->tensors[2].global_scale_of, "w[0:128, 0:192]");
  EXPECT_EQ(info->tensors[3].name, "w[128:256, 0:192]");
  EXPECT_EQ(info->tensors[3].global_scale_tensor, "w[0:128, 0:192]_scale_2");  // shared, not described twice
  EXPECT_EQ(info->tensors[4].name, "w[128:256, 0:192]_scale");
  EXPECT_TRUE(ValidateLayout(inv, info->layout, Role::kRollout, "r").ok()) << ValidateLayout(inv, info->layout, Role::kRollout, "r");
}

TEST(LayoutInfoTest, ExplicitPiecesSizeEachBufferFromTheFarthestByte) {
  Inventory inv = Small();
  WorkerLayout l;
  // q transposed in buffer 1 at 64: element (r, c) at 64 + (c * 8 + r) * 2; rows 0-3 and 4-7 apart.
  l.pieces.push_back(Piece{0, Box{{0, 0}, {4, 8}}, 1, 64, {1, 8}, std::nullopt});
  l.pieces.push_back(Piece{0, Box{{4, 0}, {8, 8}}, 1, 64 + 8, {1, 8}, std::nullopt});
  l.pieces.push_back(Piece{1, Box{{0}, {8}}, 0, 0, {1}, std::nullopt});
  Piece w{2, Box{{0, 0}, {256, 192}}, 0, 1024, {192, 1}, std::nullopt};
  w.quant = Quantization{DType::kF8E4M3, {128, 128}, 2, 16, DType::kF32};
  l.pieces.push_back(w);
  auto info = DescribePieces(inv, l);
  ASSERT_TRUE(info.ok()) << info.status();
  // buffer 0: w's fp8 elements end at 1024 + 256*192; buffer 1: q's last element (3,7)+(4..) at
  // 64 + 8 + (7*8 + 3) * 2 + 2; buffer 2: 4 float32 scales from 16.
  EXPECT_EQ(info->buffer_bytes, (std::vector<int64_t>{1024 + 256 * 192, 64 + 8 + (7 * 8 + 3) * 2 + 2, 16 + 16}));
  ASSERT_EQ(info->tensors.size(), 5u);
  EXPECT_EQ(info->tensors[0].name, "q[0:4, 0:8]");
  EXPECT_EQ(info->tensors[0].strides, (std::vector<int64_t>{1, 8}));
  EXPECT_EQ(info->tensors[0].shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(info->tensors[2].name, "b");
  EXPECT_EQ(info->tensors[2].dtype, DType::kF32);
  EXPECT_EQ(info->tensors[3].name, "w");
  EXPECT_EQ(info->tensors[3].dtype, DType::kF8E4M3);
  EXPECT_EQ(info->tensors[3].scale_tensor, "w_scale_inv");
  EXPECT_EQ(info->tensors[4].name, "w_scale_inv");
  EXPECT_EQ(info->tensors[4].scales_of, "w");
  EXPECT_EQ(info->tensors[4].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(info->tensors[4].buffer, 2);
  EXPECT_EQ(info->piece_bytes, 64 * 2 + 8 * 4 + 256 * 192 * 2);
  // The described sizes are exactly enough: the layout validates as a rollout's, one byte less does not.
  EXPECT_TRUE(ValidateLayout(inv, info->layout, Role::kRollout, "r").ok());
  WorkerLayout tight = info->layout;
  tight.buffers[1].size_bytes -= 1;
  EXPECT_FALSE(ValidateLayout(inv, tight, Role::kRollout, "r").ok());
}

TEST(LayoutInfoTest, BadPiecesAreNamed) {
  Inventory inv = Small();
  WorkerLayout l;
  l.pieces.push_back(Piece{1, Box{{0}, {8}}, 0, 0, {-1}, std::nullopt});
  auto info = DescribePieces(inv, l);
  ASSERT_FALSE(info.ok());
  EXPECT_TRUE(absl::StrContains(info.status().message(), "piece 0")) << info.status();
  EXPECT_TRUE(absl::StrContains(info.status().message(), "negative stride")) << info.status();
  l.pieces[0] = Piece{7, Box{{0}, {8}}, 0, 0, {1}, std::nullopt};
  EXPECT_EQ(DescribePieces(inv, l).status().code(), absl::StatusCode::kInvalidArgument);
  l.pieces[0] = Piece{1, Box{{0}, {8}}, 0, int64_t{1} << 62, {int64_t{1} << 62}, std::nullopt};
  EXPECT_TRUE(absl::StrContains(DescribePieces(inv, l).status().message(), "overflow"));
}

TEST(LayoutInfoTest, CheckBufferSizesNamesWhoBufferAndBothSizes) {
  LayoutInfo info;
  info.buffer_bytes = {4096, 0, 100};
  EXPECT_TRUE(CheckBufferSizes(info, {4096, 0, 100}, "w").ok());
  absl::Status s = CheckBufferSizes(info, {4000, 0, 100}, "worker t0 of model m");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "worker t0 of model m: buffer 0 needs 4096 bytes, registered 4000")) << s;
  s = CheckBufferSizes(info, {4096}, "w");
  EXPECT_TRUE(absl::StrContains(s.message(), "needs buffer 2 of 100 bytes")) << s;
}

}  // namespace
}  // namespace wb::planner
