#include "planner/presets.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/layout_info.h"
#include "planner/quantized.h"
#include "planner/validate.h"

namespace wb::planner {
namespace {

std::string ReadTestdata(const std::string& name) {
  std::ifstream f("planner/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Model {
  ModelConfig config;
  Inventory inv;
};

// Loads a test config; `layers` > 0 shrinks the model (runtime only: sharding rules do not change).
Model Load(const std::string& name, int64_t layers = 0) {
  auto c = ParseHfConfig(ReadTestdata(name));
  EXPECT_TRUE(c.ok()) << c.status();
  Model m{*c, {}};
  if (layers > 0) m.config.layers = layers;
  auto inv = BuildInventory(m.config, DType::kBF16);
  EXPECT_TRUE(inv.ok()) << inv.status();
  m.inv = *inv;
  return m;
}

Model FromText(const std::string& text) {
  auto c = ParseHfConfig(text);
  EXPECT_TRUE(c.ok()) << c.status();
  auto inv = BuildInventory(*c, DType::kBF16);
  EXPECT_TRUE(inv.ok()) << inv.status();
  return Model{*c, *inv};
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const LocalTensor* FindLocal(const PresetLayout& l, const std::string& name) {
  for (const LocalTensor& t : l.local_tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// Canonical (tensor, row-major flat index) held at local element `local` of `lt`, or {-1, -1}.
// Independent of the preset code's arithmetic: it inverts each piece's strides generically.
std::pair<int32_t, int64_t> CanonicalAt(const Inventory& inv, const PresetLayout& l, const LocalTensor& lt,
                                        int64_t local) {
  const int bits = DTypeBits(lt.dtype);  // in bits: int4 local tensors pack two elements per byte
  std::pair<int32_t, int64_t> found{-1, -1};
  for (int32_t i = lt.first_piece; i < lt.first_piece + lt.num_pieces; ++i) {
    const Piece& p = l.layout.pieces[i];
    int64_t rel = (lt.offset_bytes - p.offset_bytes) * 8 + local * bits;
    if (rel < 0 || rel % bits) continue;
    rel /= bits;
    // Decompose using strides in decreasing order (pieces here have positive distinct strides).
    const size_t r = p.strides.size();
    std::vector<size_t> order(r);
    for (size_t k = 0; k < r; ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p.strides[a] > p.strides[b]; });
    std::vector<int64_t> c(r);
    bool inside = true;
    for (size_t k : order) {
      c[k] = rel / p.strides[k];
      rel -= c[k] * p.strides[k];
      if (c[k] >= p.box.end[k] - p.box.begin[k]) inside = false;
    }
    if (!inside || rel != 0) continue;
    const auto strides = ContiguousStrides(inv.tensors[p.tensor].shape);
    int64_t flat = 0;
    for (size_t k = 0; k < r; ++k) flat += (c[k] + p.box.begin[k]) * strides[k];
    EXPECT_EQ(found.first, -1) << "local element " << local << " of " << lt.name << " held twice";
    found = {p.tensor, flat};
  }
  return found;
}

TEST(Presets, VllmTp4Rank1QkvProjOfQwen25_7B) {
  Model m = Load("qwen2.5-7b.json", 2);
  TensorIndex idx(m.inv);
  ParallelConfig par{.preset = "vllm", .tp = 4, .replicas = 2};
  auto l = MakePresetLayout(m.config, m.inv, par, /*rank=*/4 + 1);  // replica 1, tp rank 1
  ASSERT_TRUE(l.ok()) << l.status();
  const LocalTensor* qkv = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  ASSERT_EQ(qkv->shape, (std::vector<int64_t>{(7 + 2) * 128, 3584}));
  const int32_t q = *idx.Find("model.layers.1.self_attn.q_proj.weight");
  const int32_t k = *idx.Find("model.layers.1.self_attn.k_proj.weight");
  const int32_t v = *idx.Find("model.layers.1.self_attn.v_proj.weight");
  const int64_t H = 3584;
  for (int64_t row = 0; row < 9 * 128; ++row) {
    // Rank 1 of 4: q heads 7..13, kv head 1.
    int32_t want_t;
    int64_t want_row;
    if (row < 7 * 128) {
      want_t = q, want_row = 7 * 128 + row;
    } else if (row < 8 * 128) {
      want_t = k, want_row = 128 + (row - 7 * 128);
    } else {
      want_t = v, want_row = 128 + (row - 8 * 128);
    }
    for (int64_t col = 0; col < H; ++col) {
      auto got = CanonicalAt(m.inv, *l, *qkv, row * H + col);
      ASSERT_EQ(got.first, want_t) << row << "," << col;
      ASSERT_EQ(got.second, want_row * H + col) << row << "," << col;
    }
  }
  const LocalTensor* bias = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.bias");
  ASSERT_NE(bias, nullptr);
  auto b = CanonicalAt(m.inv, *l, *bias, 7 * 128 + 5);
  EXPECT_EQ(b.first, *idx.Find("model.layers.1.self_attn.k_proj.bias"));
  EXPECT_EQ(b.second, 128 + 5);
}

// fp8_block128: the same element mapping as unquantised, one byte per element, scales after each
// quantised local tensor, and a layout the validator accepts as a rollout's.
TEST(Presets, VllmFp8Block128QuantisesLinearWeightsOnly) {
  Model m = Load("qwen2.5-7b.json", 2);
  TensorIndex idx(m.inv);
  ParallelConfig par{.preset = "vllm", .tp = 4, .replicas = 2};
  par.quantization = "fp8_block128";
  auto l = MakePresetLayout(m.config, m.inv, par, /*rank=*/5);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout, "r").ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout, "r");
  const LocalTensor* qkv = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->dtype, DType::kF8E4M3);
  const int32_t k = *idx.Find("model.layers.1.self_attn.k_proj.weight");
  const int64_t H = 3584;
  for (int64_t col = 0; col < H; col += 97) {
    auto got = CanonicalAt(m.inv, *l, *qkv, (7 * 128 + 3) * H + col);
    EXPECT_EQ(got.first, k);
    EXPECT_EQ(got.second, (128 + 3) * H + col);
  }
  const LocalTensor* scales = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight_scale_inv");
  ASSERT_NE(scales, nullptr);
  EXPECT_EQ(scales->dtype, DType::kF32);
  EXPECT_EQ(scales->shape, (std::vector<int64_t>{9, 28}));  // (7 + 1 + 1) x 128 rows, 3584 / 128 columns
  // Each of q, k, v has its scales in piece order inside that tensor.
  int64_t at = scales->offset_bytes;
  for (int32_t p = qkv->first_piece; p < qkv->first_piece + qkv->num_pieces; ++p) {
    const Piece& piece = l->layout.pieces[p];
    ASSERT_TRUE(piece.quant.has_value());
    EXPECT_EQ(piece.quant->scale_offset_bytes, at);
    EXPECT_EQ(piece.quant->block, (std::vector<int64_t>{128, 128}));
    at += ScaleCount(piece) * 4;
  }
  EXPECT_EQ(at, scales->offset_bytes + 9 * 28 * 4);
  // Row-parallel o_proj: [H, H/4] -> scales [28, 7].
  const LocalTensor* o = FindLocal(*l, "model.layers.0.self_attn.o_proj.weight_scale_inv");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->shape, (std::vector<int64_t>{28, 7}));
  // Not quantised: biases, norms, embeddings, lm_head.
  for (const char* name : {"model.layers.1.self_attn.qkv_proj.bias", "model.layers.0.input_layernorm.weight",
                           "model.embed_tokens.weight", "lm_head.weight"}) {
    const LocalTensor* t = FindLocal(*l, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, DType::kBF16) << name;
    EXPECT_EQ(FindLocal(*l, std::string(name) + "_scale_inv"), nullptr) << name;
  }
  // The quantised local tensor takes half the bytes of the bf16 one.
  par.quantization = "";
  auto plain = MakePresetLayout(m.config, m.inv, par, 5);
  ASSERT_TRUE(plain.ok());
  EXPECT_LT(l->layout.buffers[0].size_bytes, plain->layout.buffers[0].size_bytes);
  const LocalTensor* plain_qkv = FindLocal(*plain, "model.layers.1.self_attn.qkv_proj.weight");
  ASSERT_NE(plain_qkv, nullptr);
  EXPECT_EQ(DTypeSize(plain_qkv->dtype), 2 * DTypeSize(qkv->dtype));
}

TEST(Presets, VllmMxfp8HoldsOneE8M0ScalePer32Inputs) {
  Model m = Load("qwen2.5-7b.json", 2);
  ParallelConfig par{.preset = "vllm", .tp = 4, .replicas = 2};
  par.quantization = "mxfp8";
  auto l = MakePresetLayout(m.config, m.inv, par, /*rank=*/5);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout, "r").ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout, "r");
  const LocalTensor* qkv = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->dtype, DType::kF8E4M3);
  const LocalTensor* scales = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight_scale");
  ASSERT_NE(scales, nullptr);
  EXPECT_EQ(FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight_scale_inv"), nullptr);
  EXPECT_EQ(scales->dtype, DType::kE8M0);
  EXPECT_EQ(scales->shape, (std::vector<int64_t>{qkv->shape[0], 3584 / 32}));  // one byte per 32 inputs
  int64_t at = scales->offset_bytes;
  for (int32_t p = qkv->first_piece; p < qkv->first_piece + qkv->num_pieces; ++p) {
    const Piece& piece = l->layout.pieces[p];
    ASSERT_TRUE(piece.quant.has_value());
    EXPECT_EQ(piece.quant->block, (std::vector<int64_t>{1, 32}));
    EXPECT_EQ(piece.quant->scale_dtype, DType::kE8M0);
    EXPECT_EQ(piece.quant->scale_offset_bytes, at);
    at += ScaleCount(piece);
  }
  EXPECT_EQ(at, scales->offset_bytes + qkv->shape[0] * 112);
  // Row-parallel down_proj [H, I/4]: its input dim is split by tp, 18944 / 4 = 4736 = 148 x 32.
  const LocalTensor* down = FindLocal(*l, "model.layers.0.mlp.down_proj.weight_scale");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{3584, 148}));
  const LocalTensor* norm = FindLocal(*l, "model.layers.0.input_layernorm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->dtype, DType::kBF16);
  // SGLang holds the same uint8 scales under fp8's name (Fp8LinearMethod with use_mxfp8:
  // "weight_scale_inv"); the bytes and places are the same.
  par.preset = "sglang";
  auto sg = MakePresetLayout(m.config, m.inv, par, /*rank=*/5);
  ASSERT_TRUE(sg.ok()) << sg.status();
  const LocalTensor* sg_scales = FindLocal(*sg, "model.layers.1.self_attn.qkv_proj.weight_scale_inv");
  ASSERT_NE(sg_scales, nullptr);
  EXPECT_EQ(FindLocal(*sg, "model.layers.1.self_attn.qkv_proj.weight_scale"), nullptr);
  EXPECT_EQ(sg_scales->offset_bytes, scales->offset_bytes);
  EXPECT_EQ(sg_scales->shape, scales->shape);
  EXPECT_EQ(sg_scales->dtype, DType::kE8M0);
}

// NVFP4 (ModelOpt, vLLM modelopt_fp4): e2m1 pairs, one e4m3 scale per 16 inputs, and one float32
// "<name>_scale_2" per local tensor that all its pieces (q, k and v of the fused qkv_proj) share.
TEST(Presets, VllmNvfp4HoldsE4M3ScalesPer16InputsAndOneGlobalScalePerLocalTensor) {
  Model m = Load("qwen2.5-7b.json", 2);
  ParallelConfig par{.preset = "vllm", .tp = 4, .replicas = 2};
  par.quantization = "nvfp4";
  auto l = MakePresetLayout(m.config, m.inv, par, /*rank=*/5);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout, "r").ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout, "r");
  const LocalTensor* qkv = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->dtype, DType::kF4E2M1);
  const LocalTensor* scales = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight_scale");
  ASSERT_NE(scales, nullptr);
  EXPECT_EQ(scales->dtype, DType::kF8E4M3);
  EXPECT_EQ(scales->shape, (std::vector<int64_t>{qkv->shape[0], 3584 / 16}));
  const LocalTensor* global = FindLocal(*l, "model.layers.1.self_attn.qkv_proj.weight_scale_2");
  ASSERT_NE(global, nullptr);
  EXPECT_EQ(global->dtype, DType::kF32);
  EXPECT_EQ(global->shape, (std::vector<int64_t>{1}));
  EXPECT_GE(global->offset_bytes, scales->offset_bytes + qkv->shape[0] * 224);
  ASSERT_EQ(qkv->num_pieces, 3);  // q, k, v rows of this rank
  int64_t at = scales->offset_bytes;
  for (int32_t p = qkv->first_piece; p < qkv->first_piece + qkv->num_pieces; ++p) {
    const Piece& piece = l->layout.pieces[p];
    ASSERT_TRUE(piece.quant.has_value());
    EXPECT_EQ(piece.quant->dtype, DType::kF4E2M1);
    EXPECT_EQ(piece.quant->block, (std::vector<int64_t>{1, 16}));
    EXPECT_EQ(piece.quant->scale_dtype, DType::kF8E4M3);
    EXPECT_EQ(piece.quant->scale_offset_bytes, at);
    EXPECT_EQ(piece.quant->global_scale_offset_bytes, global->offset_bytes);
    at += ScaleCount(piece);
  }
  // The packed elements: half a byte each; the next local tensor starts after the global scale.
  const LocalTensor* down = FindLocal(*l, "model.layers.0.mlp.down_proj.weight_scale");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{3584, 4736 / 16}));
  const LocalTensor* down_w = FindLocal(*l, "model.layers.0.mlp.down_proj.weight");
  ASSERT_NE(down_w, nullptr);
  const LocalTensor* down_g = FindLocal(*l, "model.layers.0.mlp.down_proj.weight_scale_2");
  ASSERT_NE(down_g, nullptr);
  EXPECT_NE(down_g->offset_bytes, global->offset_bytes);
  EXPECT_EQ(FindLocal(*l, "model.layers.0.input_layernorm.weight")->dtype, DType::kBF16);
  EXPECT_EQ(FindLocal(*l, "model.embed_tokens.weight")->dtype, DType::kBF16);
  auto info = DescribePresetLayout(m.inv, *l);
  bool found = false;
  for (const LocalTensorInfo& t : info.tensors) {
    if (t.name != "model.layers.1.self_attn.qkv_proj.weight") continue;
    found = true;
    EXPECT_EQ(t.scale_tensor, "model.layers.1.self_attn.qkv_proj.weight_scale");
    EXPECT_EQ(t.global_scale_tensor, "model.layers.1.self_attn.qkv_proj.weight_scale_2");
    EXPECT_EQ(t.size_bytes, qkv->shape[0] * 3584 / 2);
  }
  EXPECT_TRUE(found);
  for (const LocalTensorInfo& t : info.tensors) {
    if (t.name == "model.layers.1.self_attn.qkv_proj.weight_scale_2") {
      EXPECT_EQ(t.global_scale_of, "model.layers.1.self_attn.qkv_proj.weight");
    }
    if (t.name == "model.layers.1.self_attn.qkv_proj.weight_scale") {
      EXPECT_TRUE(t.global_scale_of.empty());
    }
  }
}

// NVFP4 fused MoE experts: one global scale per local expert ([E_local]), shared by its gate and
// up rows in w13 as vLLM keeps them after loading.
TEST(Presets, VllmNvfp4FusedExpertsGetOneGlobalScalePerExpert) {
  Model m = Load("qwen3-30b-a3b.json", 2);
  auto l = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 4, .quantization = "nvfp4"}, 2);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout, "r").ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout, "r");
  for (const char* name : {"model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"}) {
    const LocalTensor* w = FindLocal(*l, name);
    ASSERT_NE(w, nullptr) << name;
    EXPECT_EQ(w->dtype, DType::kF4E2M1);
    const LocalTensor* g = FindLocal(*l, absl::StrCat(name, "_scale_2"));
    ASSERT_NE(g, nullptr) << name;
    EXPECT_EQ(g->shape, (std::vector<int64_t>{128}));
    std::map<int64_t, std::set<std::string>> parts_by_slot;  // expert slot -> which projections name it
    for (int32_t k = w->first_piece; k < w->first_piece + w->num_pieces; ++k) {
      const Piece& p = l->layout.pieces[k];
      const std::string& t = m.inv.tensors[p.tensor].name;
      const int64_t slot = (p.quant->global_scale_offset_bytes - g->offset_bytes) / 4;
      ASSERT_GE(slot, 0);
      ASSERT_LT(slot, 128);
      EXPECT_TRUE(absl::StrContains(t, absl::StrCat(".experts.", slot, "."))) << t << " slot " << slot;
      parts_by_slot[slot].insert(t.substr(t.rfind('.', t.size() - 8) + 1));
    }
    EXPECT_EQ(parts_by_slot.size(), 128u);
    EXPECT_EQ(parts_by_slot[5].size(), absl::StrContains(name, "w13") ? 2u : 1u);  // gate_proj + up_proj share
  }
}

TEST(Presets, KimiInt4ExpertsOnly) {
  Model m = Load("kimi-k2.json", 2);  // layer 0 dense, layer 1 MoE (384 experts, 2048 wide)
  TensorIndex idx(m.inv);
  ParallelConfig par{.preset = "vllm", .tp = 8, .expert_parallel = true};
  par.quantization = "w4a16_experts_g32";
  auto l = MakePresetLayout(m.config, m.inv, par, /*rank=*/1);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout, "r").ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout, "r");
  const int64_t H = 7168, I = 2048;
  const LocalTensor* w13 = FindLocal(*l, "model.layers.1.mlp.experts.w13_weight_packed");
  ASSERT_NE(w13, nullptr);
  EXPECT_EQ(FindLocal(*l, "model.layers.1.mlp.experts.w13_weight"), nullptr);
  EXPECT_EQ(w13->dtype, DType::kI4);
  ASSERT_EQ(w13->shape, (std::vector<int64_t>{48, 2 * I, H}));
  // Expert 48 + 2 = 50's up_proj row 7, column 33: two elements per byte, same canonical mapping.
  auto got = CanonicalAt(m.inv, *l, *w13, (2 * 2 * I + I + 7) * H + 33);
  EXPECT_EQ(got.first, *idx.Find("model.layers.1.mlp.experts.50.up_proj.weight"));
  EXPECT_EQ(got.second, 7 * H + 33);
  const LocalTensor* scale = FindLocal(*l, "model.layers.1.mlp.experts.w13_weight_scale");
  ASSERT_NE(scale, nullptr);
  EXPECT_EQ(scale->dtype, DType::kBF16);  // the model's dtype
  EXPECT_EQ(scale->shape, (std::vector<int64_t>{48, 2 * I, H / 32}));  // per expert: gate's groups, then up's
  EXPECT_EQ(scale->offset_bytes, (w13->offset_bytes + 48 * 2 * I * H / 2 + kLocalTensorAlignment - 1) / kLocalTensorAlignment * kLocalTensorAlignment);
  for (int32_t p = w13->first_piece; p < w13->first_piece + w13->num_pieces; ++p) {
    const Piece& piece = l->layout.pieces[p];
    ASSERT_TRUE(piece.quant.has_value());
    EXPECT_EQ(piece.quant->dtype, DType::kI4);
    EXPECT_EQ(piece.quant->block, (std::vector<int64_t>{1, 32}));
    EXPECT_EQ(piece.quant->scale_dtype, DType::kBF16);
  }
  // Attention, shared experts, the dense layer's MLP, router: not quantised.
  for (const char* name : {"model.layers.1.self_attn.fused_qkv_a_proj.weight", "model.layers.1.mlp.shared_experts.gate_up_proj.weight",
                           "model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.gate.weight"}) {
    const LocalTensor* t = FindLocal(*l, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, DType::kBF16) << name;
  }
  // The int4 layout takes about a quarter of the bf16 one for the experts.
  par.quantization = "";
  auto plain = MakePresetLayout(m.config, m.inv, par, 1);
  ASSERT_TRUE(plain.ok());
  EXPECT_LT(l->layout.buffers[0].size_bytes, plain->layout.buffers[0].size_bytes * 2 / 5);
  // All linear weights (w4a16_g32): attention too.
  par.quantization = "w4a16_g32";
  auto all = MakePresetLayout(m.config, m.inv, par, 1);
  ASSERT_TRUE(all.ok()) << all.status();
  const LocalTensor* qa = FindLocal(*all, "model.layers.1.self_attn.q_b_proj.weight_packed");
  ASSERT_NE(qa, nullptr);
  EXPECT_EQ(qa->dtype, DType::kI4);
}

TEST(Presets, QuantisationErrors) {
  Model m = Load("qwen2.5-0.5b.json", 1);  // 14 q heads of 64: tp=2 puts 448 rows of q_proj on a rank
  ParallelConfig par{.preset = "vllm", .tp = 2};
  par.quantization = "fp8_block128";
  auto l = MakePresetLayout(m.config, m.inv, par, 0);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("not aligned to the quantisation blocks 128x128"), std::string::npos) << l.status();
  EXPECT_NE(l.status().message().find("q_proj.weight box [0:448, 0:896]"), std::string::npos) << l.status();
  par.tp = 1;
  EXPECT_TRUE(MakePresetLayout(m.config, m.inv, par, 0).ok());
  par.quantization = "int4";
  EXPECT_NE(MakePresetLayout(m.config, m.inv, par, 0).status().message().find("unknown quantization `int4`"), std::string::npos);
  ParallelConfig meg{.preset = "megatron"};
  meg.quantization = "fp8_block128";
  EXPECT_NE(MakePresetLayout(m.config, m.inv, meg, 0).status().message().find("is for rollout presets"), std::string::npos);
}

TEST(Presets, VllmReplicatesKvHeadsWhenTpExceedsThem) {
  Model m = Load("qwen3-30b-a3b.json", 1);  // 32 q heads, 4 kv heads, head_dim 128
  TensorIndex idx(m.inv);
  const int64_t H = 2048;
  for (int rank = 0; rank < 8; ++rank) {
    auto l = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 8}, rank);
    ASSERT_TRUE(l.ok()) << l.status();
    const LocalTensor* qkv = FindLocal(*l, "model.layers.0.self_attn.qkv_proj.weight");
    ASSERT_NE(qkv, nullptr);
    ASSERT_EQ(qkv->shape, (std::vector<int64_t>{(4 + 2) * 128, H}));
    // Two consecutive ranks share one KV head: rank r holds kv head r / 2.
    auto k = CanonicalAt(m.inv, *l, *qkv, (4 * 128 + 3) * H + 11);
    EXPECT_EQ(k.first, *idx.Find("model.layers.0.self_attn.k_proj.weight"));
    EXPECT_EQ(k.second, ((rank / 2) * 128 + 3) * H + 11);
    auto v = CanonicalAt(m.inv, *l, *qkv, (5 * 128 + 127) * H);
    EXPECT_EQ(v.first, *idx.Find("model.layers.0.self_attn.v_proj.weight"));
    EXPECT_EQ(v.second, ((rank / 2) * 128 + 127) * H);
    auto q = CanonicalAt(m.inv, *l, *qkv, 0);
    EXPECT_EQ(q.second, rank * 4 * 128 * H);
  }
}

TEST(Presets, MegatronTp2LinearQkvInterleave) {
  Model m = Load("qwen2.5-7b.json", 2);
  TensorIndex idx(m.inv);
  ParallelConfig par{.preset = "megatron", .tp = 2, .pp = 2, .dp = 2};
  // rank = tp_rank + tp*(dp_rank + dp*pp_rank): tp_rank 1, dp_rank 1, pp_rank 1 -> 7. Stage 1 holds
  // global layer 1 as local layer 0.
  auto l = MakePresetLayout(m.config, m.inv, par, 7);
  ASSERT_TRUE(l.ok()) << l.status();
  const LocalTensor* qkv = FindLocal(*l, "decoder.layers.0.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  const int64_t H = 3584, hd = 128, qpg = 7, groups = 2;
  ASSERT_EQ(qkv->shape, (std::vector<int64_t>{groups * (qpg + 2) * hd, H}));
  const int32_t q = *idx.Find("model.layers.1.self_attn.q_proj.weight");
  const int32_t k = *idx.Find("model.layers.1.self_attn.k_proj.weight");
  const int32_t v = *idx.Find("model.layers.1.self_attn.v_proj.weight");
  for (int64_t row = 0; row < groups * (qpg + 2) * hd; ++row) {
    const int64_t g = row / ((qpg + 2) * hd), in = row % ((qpg + 2) * hd);
    const int64_t G = 2 + g;  // tp rank 1 owns query groups 2 and 3
    int32_t want_t;
    int64_t want_row;
    if (in < qpg * hd) {
      want_t = q, want_row = G * qpg * hd + in;
    } else if (in < (qpg + 1) * hd) {
      want_t = k, want_row = G * hd + in - qpg * hd;
    } else {
      want_t = v, want_row = G * hd + in - (qpg + 1) * hd;
    }
    for (int64_t col = 0; col < H; col += 7) {
      auto got = CanonicalAt(m.inv, *l, *qkv, row * H + col);
      ASSERT_EQ(got.first, want_t) << row;
      ASSERT_EQ(got.second, want_row * H + col) << row;
    }
  }
  EXPECT_EQ(FindLocal(*l, "embedding.word_embeddings.weight"), nullptr);  // first stage only
  const LocalTensor* out = FindLocal(*l, "output_layer.weight");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(out->shape, (std::vector<int64_t>{152064 / 2, H}));  // 152064 is a multiple of 256
}

TEST(Presets, FusedGateUpAndExperts) {
  Model m = Load("qwen3-30b-a3b.json", 2);
  TensorIndex idx(m.inv);
  const int64_t H = 2048, I = 768;
  {  // vLLM tp=4, no EP: w13 [128, 2*192, H]; expert 5 of tp rank 2.
    auto l = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 4}, 2);
    ASSERT_TRUE(l.ok()) << l.status();
    const LocalTensor* w13 = FindLocal(*l, "model.layers.1.mlp.experts.w13_weight");
    ASSERT_NE(w13, nullptr);
    ASSERT_EQ(w13->shape, (std::vector<int64_t>{128, 2 * I / 4, H}));
    const int64_t n = I / 4;
    for (int64_t r = 0; r < 2 * n; r += 5) {
      auto got = CanonicalAt(m.inv, *l, *w13, (5 * 2 * n + r) * H + 17);
      const char* part = r < n ? "gate_proj" : "up_proj";
      EXPECT_EQ(got.first, *idx.Find(absl::StrCat("model.layers.1.mlp.experts.5.", part, ".weight")));
      EXPECT_EQ(got.second, (2 * n + r % n) * H + 17);
    }
    const LocalTensor* w2 = FindLocal(*l, "model.layers.1.mlp.experts.w2_weight");
    ASSERT_NE(w2, nullptr);
    ASSERT_EQ(w2->shape, (std::vector<int64_t>{128, H, n}));
    auto got = CanonicalAt(m.inv, *l, *w2, (9 * H + 100) * n + 3);
    EXPECT_EQ(got.first, *idx.Find("model.layers.1.mlp.experts.9.down_proj.weight"));
    EXPECT_EQ(got.second, 100 * I + 2 * n + 3);
  }
  {  // vLLM tp=8 expert parallel: rank 3 holds experts 48..63 whole.
    auto l = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 8, .expert_parallel = true}, 3);
    ASSERT_TRUE(l.ok()) << l.status();
    const LocalTensor* w13 = FindLocal(*l, "model.layers.0.mlp.experts.w13_weight");
    ASSERT_NE(w13, nullptr);
    ASSERT_EQ(w13->shape, (std::vector<int64_t>{16, 2 * I, H}));
    auto got = CanonicalAt(m.inv, *l, *w13, (2 * 2 * I + I + 7) * H + 1);
    EXPECT_EQ(got.first, *idx.Find("model.layers.0.mlp.experts.50.up_proj.weight"));
    EXPECT_EQ(got.second, 7 * H + 1);
  }
  {  // Megatron tp=2 dp=4 ep=8 etp=1: rank 5 = tp 1, dp 2 -> expert-local 5 -> ep rank 5: experts 80..95.
    auto l = MakePresetLayout(m.config, m.inv, {.preset = "megatron", .tp = 2, .dp = 4, .ep = 8, .etp = 1}, 5);
    ASSERT_TRUE(l.ok()) << l.status();
    const LocalTensor* fc1 = FindLocal(*l, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight");
    ASSERT_NE(fc1, nullptr);
    ASSERT_EQ(fc1->shape, (std::vector<int64_t>{2 * I, H}));
    auto got = CanonicalAt(m.inv, *l, *fc1, (I + 4) * H + 9);
    EXPECT_EQ(got.first, *idx.Find("model.layers.1.mlp.experts.83.up_proj.weight"));
    EXPECT_EQ(got.second, 4 * H + 9);
    const LocalTensor* proj = FindLocal(*l, "decoder.layers.1.self_attention.linear_proj.weight");
    ASSERT_NE(proj, nullptr);
    ASSERT_EQ(proj->shape, (std::vector<int64_t>{H, 32 * 128 / 2}));
    got = CanonicalAt(m.inv, *l, *proj, 3 * 2048 + 10);
    EXPECT_EQ(got.first, *idx.Find("model.layers.1.self_attn.o_proj.weight"));
    EXPECT_EQ(got.second, 3 * 4096 + 2048 + 10);
  }
}

// --make-vocab-size-divisible-by: Megatron-LM pads the vocab to a multiple of m * tp (m = 128 by
// default); Megatron-Bridge / verl mcore build it unpadded (m = 1 where tp divides it). Qwen2.5's
// 151936 at tp=2: 76032 rows per rank padded, 75968 unpadded - rank 1 starts at that row.
TEST(Presets, MegatronVocabPaddingFollowsMakeVocabSizeDivisibleBy) {
  Model m = Load("qwen2.5-0.5b.json", 2);
  TensorIndex idx(m.inv);
  const int64_t H = 896;
  for (const auto& [divisible_by, rows] : {std::pair<int, int64_t>{128, 76032}, {1, 75968}, {7, 75971}}) {
    ParallelConfig par{.preset = "megatron", .tp = 2};
    par.vocab_divisible_by = divisible_by;
    auto l = MakePresetLayout(m.config, m.inv, par, 1);
    ASSERT_TRUE(l.ok()) << l.status();
    const LocalTensor* e = FindLocal(*l, "embedding.word_embeddings.weight");
    ASSERT_NE(e, nullptr);
    ASSERT_EQ(e->shape, (std::vector<int64_t>{rows, H})) << divisible_by;
    auto got = CanonicalAt(m.inv, *l, *e, 5 * H + 3);  // local row 5 of rank 1
    EXPECT_EQ(got.first, *idx.Find("model.embed_tokens.weight"));
    EXPECT_EQ(got.second, (rows + 5) * H + 3) << divisible_by;
  }
  ParallelConfig zero{.preset = "megatron", .tp = 2};
  zero.vocab_divisible_by = 0;
  EXPECT_EQ(MakePresetLayout(m.config, m.inv, zero, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ParallelConfig vllm{.preset = "vllm", .tp = 2};
  vllm.vocab_divisible_by = 1;
  absl::Status s = MakePresetLayout(m.config, m.inv, vllm, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("megatron option"), std::string::npos) << s;
}

// --moe-grouped-gemm (TEGroupedMLP): expert j's weights are mlp.experts.linear_fc1.weight<j> /
// linear_fc2.weight<j>, the same bytes SequentialMLP's local_experts.<j> hold.
TEST(Presets, MegatronGroupedGemmExpertNames) {
  Model m = Load("qwen3-30b-a3b.json", 2);
  ParallelConfig seq{.preset = "megatron", .tp = 2, .dp = 4, .ep = 8, .etp = 1};
  ParallelConfig grouped = seq;
  grouped.moe_grouped_gemm = true;
  auto a = MakePresetLayout(m.config, m.inv, seq, 5);
  auto b = MakePresetLayout(m.config, m.inv, grouped, 5);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->local_tensors.size(), b->local_tensors.size());
  ASSERT_EQ(a->layout.pieces.size(), b->layout.pieces.size());
  for (size_t i = 0; i < a->layout.pieces.size(); ++i) {
    EXPECT_EQ(a->layout.pieces[i].tensor, b->layout.pieces[i].tensor) << i;
    EXPECT_EQ(a->layout.pieces[i].box.begin, b->layout.pieces[i].box.begin) << i;
    EXPECT_EQ(a->layout.pieces[i].offset_bytes, b->layout.pieces[i].offset_bytes) << i;
  }
  EXPECT_EQ(FindLocal(*b, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"), nullptr);
  const LocalTensor* fc1 = FindLocal(*b, "decoder.layers.1.mlp.experts.linear_fc1.weight3");
  const LocalTensor* seq_fc1 = FindLocal(*a, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  ASSERT_NE(seq_fc1, nullptr);
  EXPECT_EQ(fc1->shape, seq_fc1->shape);
  EXPECT_EQ(fc1->offset_bytes, seq_fc1->offset_bytes);
  EXPECT_NE(FindLocal(*b, "decoder.layers.0.mlp.experts.linear_fc2.weight15"), nullptr);
  ParallelConfig fsdp{.preset = "fsdp", .dp = 2};
  fsdp.moe_grouped_gemm = true;
  EXPECT_EQ(MakePresetLayout(m.config, m.inv, fsdp, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// --moe-grouped-gemm --moe-use-legacy-grouped-gemm (GroupedMLP): a layer's local experts live in
// weight1 [H, E_l*F] / weight2 [E_l*F2, H], read by GroupedMLP.forward as view(E_l, H, -1) /
// view(E_l, -1, H): expert j's linear_fc1 slice and linear_fc2 slice, each transposed.
TEST(Presets, MegatronLegacyGroupedGemmTransposesEachExpert) {
  Model m = Load("qwen3-30b-a3b.json", 2);
  const int64_t H = m.config.hidden;
  for (int etp : {1, 2}) {
    ParallelConfig seq{.preset = "megatron", .tp = 2, .dp = 4, .ep = 8 / etp, .etp = etp};
    ParallelConfig legacy = seq;
    legacy.moe_grouped_gemm = true;
    legacy.moe_legacy_grouped_gemm = true;
    const int rank = 5;
    auto a = MakePresetLayout(m.config, m.inv, seq, rank);
    auto b = MakePresetLayout(m.config, m.inv, legacy, rank);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(ValidateLayout(m.inv, b->layout, Role::kTrainer, "t").ok()) << ValidateLayout(m.inv, b->layout, Role::kTrainer, "t");
    EXPECT_EQ(FindLocal(*b, "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"), nullptr);
    EXPECT_EQ(FindLocal(*b, "decoder.layers.1.mlp.experts.linear_fc1.weight0"), nullptr);
    const int64_t E_l = m.config.experts / seq.ep;
    const int64_t n = m.config.moe_intermediate / etp, F = 2 * n;
    const LocalTensor* w1 = FindLocal(*b, "decoder.layers.1.mlp.experts.weight1");
    const LocalTensor* w2 = FindLocal(*b, "decoder.layers.1.mlp.experts.weight2");
    ASSERT_NE(w1, nullptr);
    ASSERT_NE(w2, nullptr);
    EXPECT_EQ(w1->shape, (std::vector<int64_t>{H, E_l * F}));
    EXPECT_EQ(w2->shape, (std::vector<int64_t>{E_l * n, H}));
    for (int64_t j : {int64_t{0}, int64_t{3}, E_l - 1}) {
      const LocalTensor* fc1 = FindLocal(*a, absl::StrCat("decoder.layers.1.mlp.experts.local_experts.", j, ".linear_fc1.weight"));
      const LocalTensor* fc2 = FindLocal(*a, absl::StrCat("decoder.layers.1.mlp.experts.local_experts.", j, ".linear_fc2.weight"));
      ASSERT_NE(fc1, nullptr);
      ASSERT_NE(fc2, nullptr);
      ASSERT_EQ(fc1->shape, (std::vector<int64_t>{F, H}));
      // Rows f of fc1 (gate rows, then up rows) at column f of expert j's [H, F] block.
      for (int64_t f : {int64_t{0}, int64_t{1}, n - 1, n, F - 1}) {
        for (int64_t h : {int64_t{0}, int64_t{7}, H - 1}) {
          EXPECT_EQ(CanonicalAt(m.inv, *b, *w1, j * H * F + h * F + f), CanonicalAt(m.inv, *a, *fc1, f * H + h))
              << "etp " << etp << " expert " << j << " f " << f << " h " << h;
        }
      }
      ASSERT_EQ(fc2->shape, (std::vector<int64_t>{H, n}));
      for (int64_t i : {int64_t{0}, int64_t{5}, n - 1}) {
        for (int64_t h : {int64_t{0}, int64_t{9}, H - 1}) {
          EXPECT_EQ(CanonicalAt(m.inv, *b, *w2, j * n * H + i * H + h), CanonicalAt(m.inv, *a, *fc2, h * n + i))
              << "etp " << etp << " expert " << j << " i " << i << " h " << h;
        }
      }
    }
  }
  ParallelConfig no_grouped{.preset = "megatron", .tp = 2, .dp = 4, .ep = 8, .etp = 1};
  no_grouped.moe_legacy_grouped_gemm = true;
  absl::Status s = MakePresetLayout(m.config, m.inv, no_grouped, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("moe_grouped_gemm"), std::string::npos) << s;
  ParallelConfig vllm{.preset = "vllm", .tp = 2};
  vllm.moe_legacy_grouped_gemm = true;
  EXPECT_EQ(MakePresetLayout(m.config, m.inv, vllm, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// --use-tp-pp-dp-mapping: rank = tp_rank + tp * (pp_rank + pp * dp_rank) (Megatron's order
// tp-pp-dp); the default is tp-dp-pp.
TEST(Presets, MegatronTpPpDpMapping) {
  Model m = Load("qwen2.5-7b.json", 4);
  ParallelConfig def{.preset = "megatron", .tp = 2, .pp = 2, .dp = 2};
  ParallelConfig mapped = def;
  mapped.tp_pp_dp_mapping = true;
  // Rank 2: default -> dp_rank 1, pp_rank 0 (embedding, layers 0-1); mapped -> pp_rank 1, dp_rank 0.
  auto d2 = MakePresetLayout(m.config, m.inv, def, 2);
  auto m2 = MakePresetLayout(m.config, m.inv, mapped, 2);
  auto m4 = MakePresetLayout(m.config, m.inv, mapped, 4);
  ASSERT_TRUE(d2.ok()) << d2.status();
  ASSERT_TRUE(m2.ok()) << m2.status();
  ASSERT_TRUE(m4.ok()) << m4.status();
  EXPECT_NE(FindLocal(*d2, "embedding.word_embeddings.weight"), nullptr);
  EXPECT_EQ(FindLocal(*m2, "embedding.word_embeddings.weight"), nullptr);
  EXPECT_NE(FindLocal(*m2, "output_layer.weight"), nullptr);
  EXPECT_NE(FindLocal(*m4, "embedding.word_embeddings.weight"), nullptr);  // tp 0, pp 0, dp 1
  // Mapped rank 2 holds what default rank 4 (tp 0, dp 0, pp 1) holds; mapped rank 4 what default 2 does.
  auto d4 = MakePresetLayout(m.config, m.inv, def, 4);
  ASSERT_TRUE(d4.ok()) << d4.status();
  for (auto [x, y] : {std::pair{&*m2, &*d4}, std::pair{&*m4, &*d2}}) {
    ASSERT_EQ(x->layout.pieces.size(), y->layout.pieces.size());
    for (size_t i = 0; i < x->layout.pieces.size(); ++i) {
      EXPECT_EQ(x->layout.pieces[i].tensor, y->layout.pieces[i].tensor) << i;
      EXPECT_EQ(x->layout.pieces[i].box.begin, y->layout.pieces[i].box.begin) << i;
      EXPECT_EQ(x->layout.pieces[i].box.end, y->layout.pieces[i].box.end) << i;
    }
  }
  // MoE: the expert groups keep the dense pipeline groups only when ep * etp = tp.
  Model moe = Load("qwen3-30b-a3b.json", 2);
  ParallelConfig ok{.preset = "megatron", .tp = 2, .pp = 2, .dp = 2, .ep = 2, .etp = 1};
  ok.tp_pp_dp_mapping = true;
  auto o = MakePresetLayout(moe.config, moe.inv, ok, 3);  // tp 1, pp 1, dp 0: ep_rank 1
  ASSERT_TRUE(o.ok()) << o.status();
  TensorIndex idx(moe.inv);
  const LocalTensor* fc1 = FindLocal(*o, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(CanonicalAt(moe.inv, *o, *fc1, 0).first, *idx.Find("model.layers.1.mlp.experts.64.gate_proj.weight"));
  ParallelConfig bad = ok;
  bad.ep = 4;
  absl::Status s = MakePresetLayout(moe.config, moe.inv, bad, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("use_tp_pp_dp_mapping needs ep*etp = tp"), std::string::npos) << s;
  ParallelConfig fsdp{.preset = "fsdp", .dp = 2};
  fsdp.tp_pp_dp_mapping = true;
  EXPECT_EQ(MakePresetLayout(m.config, m.inv, fsdp, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// vLLM's DeepseekV2MoE with use_sequence_parallel_moe (expert parallel, tp > 1, dp > 1, the
// default all2all backend) builds its shared experts with disable_tp: whole on every rank; with
// dp = 1 (or without EP) they stay TP-split.
TEST(Presets, VllmDeepseekSharedExpertsWholeUnderSequenceParallelMoe) {
  Model m = Load("deepseek-v3.json", 4);  // layer 3 is MoE; shared expert I = 2048, H = 7168
  TensorIndex idx(m.inv);
  auto sp = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true}, 6);
  auto tp = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 4, .dp = 1, .expert_parallel = true}, 2);
  ASSERT_TRUE(sp.ok()) << sp.status();
  ASSERT_TRUE(tp.ok()) << tp.status();
  const LocalTensor* gu = FindLocal(*sp, "model.layers.3.mlp.shared_experts.gate_up_proj.weight");
  const LocalTensor* dn = FindLocal(*sp, "model.layers.3.mlp.shared_experts.down_proj.weight");
  ASSERT_NE(gu, nullptr);
  ASSERT_NE(dn, nullptr);
  EXPECT_EQ(gu->shape, (std::vector<int64_t>{2 * 2048, 7168}));
  EXPECT_EQ(dn->shape, (std::vector<int64_t>{7168, 2048}));
  EXPECT_EQ(CanonicalAt(m.inv, *sp, *gu, 2048 * 7168 + 5),
            std::make_pair(*idx.Find("model.layers.3.mlp.shared_experts.up_proj.weight"), int64_t{5}));
  // Dense layers' MLP stays TP-split (DeepseekV2MLP without is_sequence_parallel).
  const LocalTensor* dense = FindLocal(*sp, "model.layers.0.mlp.gate_up_proj.weight");
  ASSERT_NE(dense, nullptr);
  EXPECT_EQ(dense->shape[0], 2 * 18432 / 4);
  const LocalTensor* split = FindLocal(*tp, "model.layers.3.mlp.shared_experts.gate_up_proj.weight");
  ASSERT_NE(split, nullptr);
  EXPECT_EQ(split->shape, (std::vector<int64_t>{2 * 2048 / 4, 7168}));
}

// The engines' a2a MoE backends decide whether shared experts are TP-split or whole: vLLM's
// use_sequence_parallel_moe list (config/parallel.py), SGLang's --moe-a2a-backend (deepseek_v2.py,
// glm4_moe.py, qwen2_moe.py build the shared experts with tp_size 1 under an a2a backend).
TEST(Presets, MoeA2aBackendDecidesSharedExperts) {
  Model ds = Load("deepseek-v3.json", 4);  // layer 3 is MoE; shared expert I = 2048, H = 7168
  const std::string gu = "model.layers.3.mlp.shared_experts.gate_up_proj.weight";
  auto rows = [&](const Model& m, const ParallelConfig& par, int rank, const std::string& name) -> int64_t {
    auto l = MakePresetLayout(m.config, m.inv, par, rank);
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return -1;
    const LocalTensor* t = FindLocal(*l, name);
    return t == nullptr ? -2 : t->shape[0];
  };
  EXPECT_EQ(rows(ds, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true, .moe_a2a_backend = "pplx"}, 5, gu), 2 * 2048 / 4);
  EXPECT_EQ(rows(ds, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true, .moe_a2a_backend = "flashinfer_all2allv"}, 5, gu),
            2 * 2048 / 4);
  EXPECT_EQ(rows(ds, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true, .moe_a2a_backend = "deepep_high_throughput"}, 5, gu),
            2 * 2048);
  EXPECT_EQ(rows(ds, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true, .moe_a2a_backend = "allgather_reducescatter"}, 5, gu),
            2 * 2048);
  EXPECT_EQ(rows(ds, {.preset = "sglang", .tp = 4, .expert_parallel = true}, 1, gu), 2 * 2048 / 4);
  EXPECT_EQ(rows(ds, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "none"}, 1, gu), 2 * 2048 / 4);
  for (const char* b : {"deepep", "mooncake", "nixl", "mori", "ascend_fuseep"}) {
    EXPECT_EQ(rows(ds, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = b}, 1, gu), 2 * 2048) << b;
  }
  // Whole means the same bytes on every rank: rank 3 holds up_proj's row 0 right after gate's rows.
  auto l = MakePresetLayout(ds.config, ds.inv, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "deepep"}, 3);
  ASSERT_TRUE(l.ok()) << l.status();
  const LocalTensor* t = FindLocal(*l, gu);
  ASSERT_NE(t, nullptr);
  TensorIndex idx(ds.inv);
  EXPECT_EQ(CanonicalAt(ds.inv, *l, *t, 2048 * 7168 + 9),
            std::make_pair(*idx.Find("model.layers.3.mlp.shared_experts.up_proj.weight"), int64_t{9}));
  const LocalTensor* dn = FindLocal(*l, "model.layers.3.mlp.shared_experts.down_proj.weight");
  ASSERT_NE(dn, nullptr);
  EXPECT_EQ(dn->shape, (std::vector<int64_t>{7168, 2048}));

  // GLM-4.5 and Qwen2-MoE (every layer sparse, as SGLang requires).
  Model glm = FromText(R"({"architectures":["Glm4MoeForCausalLM"],"hidden_size":64,"head_dim":16,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":8,
    "num_key_value_heads":4,"vocab_size":1000,"n_routed_experts":8,"n_shared_experts":1,"first_k_dense_replace":1})");
  EXPECT_EQ(rows(glm, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "mooncake"}, 2,
                 "model.layers.1.mlp.shared_experts.gate_up_proj.weight"), 2 * 32);
  EXPECT_EQ(rows(glm, {.preset = "sglang", .tp = 4, .expert_parallel = true}, 2, "model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
            2 * 32 / 4);
  EXPECT_EQ(rows(glm, {.preset = "vllm", .tp = 2, .dp = 2, .expert_parallel = true}, 2, "model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
            2 * 32 / 2);  // vLLM's GLM keeps them TP-split under sequence-parallel MoE
  Model qwen = FromText(R"({"architectures":["Qwen2MoeForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"moe_intermediate_size":32,"shared_expert_intermediate_size":64,
    "num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":4,"vocab_size":1000,"num_experts":8})");
  EXPECT_EQ(rows(qwen, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "deepep"}, 3,
                 "model.layers.0.mlp.shared_expert.gate_up_proj.weight"), 2 * 64);
  EXPECT_EQ(rows(qwen, {.preset = "sglang", .tp = 4, .expert_parallel = true}, 3, "model.layers.0.mlp.shared_expert.gate_up_proj.weight"),
            2 * 64 / 4);

  // Refusals name what is wrong.
  struct Refusal {
    const Model* m;
    ParallelConfig par;
    const char* says;
  };
  for (const Refusal& r : {Refusal{&ds, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true, .moe_a2a_backend = "deepep"}, "allgather_reducescatter"},
                           Refusal{&ds, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "deepep_low_latency"}, "mooncake"},
                           Refusal{&ds, {.preset = "sglang", .tp = 4, .moe_a2a_backend = "deepep"}, "expert_parallel"},
                           Refusal{&qwen, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "mori"}, "Qwen2MoeForCausalLM"},
                           // FlashInfer's CUTLASS MoE holds w13 as [up; gate].
                           Refusal{&ds, {.preset = "sglang", .tp = 4, .expert_parallel = true, .moe_a2a_backend = "flashinfer"}, "[up; gate]"},
                           Refusal{&ds, {.preset = "megatron", .tp = 4, .moe_a2a_backend = "deepep"}, "does not apply"}}) {
    auto b = PresetBuilder::Create(r.m->config, r.m->inv, r.par);
    ASSERT_FALSE(b.ok()) << r.par.preset << " " << r.par.moe_a2a_backend;
    EXPECT_TRUE(absl::StrContains(b.status().message(), "moe_a2a_backend")) << b.status();
    EXPECT_TRUE(absl::StrContains(b.status().message(), r.says)) << b.status();
  }
  // Without experts (or, for vLLM, without shared experts) the backend decides nothing: a name
  // a later engine release introduces is no reason to refuse.
  Model dense = Load("qwen2.5-0.5b.json", 2);
  EXPECT_TRUE(PresetBuilder::Create(dense.config, dense.inv, {.preset = "vllm", .tp = 2, .moe_a2a_backend = "future_backend"}).ok());
  EXPECT_TRUE(PresetBuilder::Create(dense.config, dense.inv, {.preset = "sglang", .tp = 2, .moe_a2a_backend = "future_backend"}).ok());
  Model qwen3 = Load("qwen3-30b-a3b.json", 2);
  EXPECT_TRUE(PresetBuilder::Create(qwen3.config, qwen3.inv, {.preset = "vllm", .tp = 2, .dp = 2, .expert_parallel = true,
                                                              .moe_a2a_backend = "future_backend"}).ok());
}

// InternLM-style `bias: true`: HF's Llama ignores it, vLLM's and SGLang's llama.py build q/k/v/o
// biases from it. Refused for the engines; trainers follow HF.
TEST(Presets, EnginesRefuseLlamaBiasKeyHfIgnores) {
  Model m = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000,"bias":true})");
  for (const char* preset : {"vllm", "sglang"}) {
    auto b = PresetBuilder::Create(m.config, m.inv, {.preset = preset, .tp = 2});
    ASSERT_FALSE(b.ok()) << preset;
    EXPECT_TRUE(absl::StrContains(b.status().message(), "`bias: true`")) << b.status();
  }
  EXPECT_TRUE(PresetBuilder::Create(m.config, m.inv, {.preset = "fsdp", .dp = 2}).ok());
  Model both = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000,"bias":true,"attention_bias":true})");
  EXPECT_TRUE(PresetBuilder::Create(both.config, both.inv, {.preset = "vllm", .tp = 2}).ok());
}

// Sizes and options a preset's framework has no counterpart for are refused, naming them.
TEST(Presets, FieldsThatDoNotApplyAreRefused) {
  Model m = Load("qwen3-30b-a3b.json", 2);
  struct Case {
    ParallelConfig par;
    const char* says;
  };
  for (const Case& c : {Case{{.preset = "fsdp", .tp = 2, .dp = 4}, "tp=2"},
                        Case{{.preset = "fsdp2", .pp = 2, .dp = 4}, "pp=2"},
                        Case{{.preset = "fsdp", .dp = 4, .ep = 2}, "ep=2"},
                        Case{{.preset = "fsdp", .dp = 4, .etp = 1}, "etp=1"},
                        Case{{.preset = "fsdp", .dp = 4, .expert_parallel = true}, "expert_parallel"},
                        Case{{.preset = "fsdp_flat", .dp = 4, .replicas = 2}, "replicas=2"},
                        Case{{.preset = "vllm", .tp = 2, .pp = 2}, "pp=2"},
                        Case{{.preset = "sglang", .tp = 8, .ep = 2, .expert_parallel = true}, "ep=2"},
                        Case{{.preset = "vllm", .tp = 4, .etp = 2}, "etp=2"},
                        Case{{.preset = "megatron", .tp = 2, .dp = 2, .replicas = 2}, "replicas=2"},
                        Case{{.preset = "megatron", .tp = 2, .dp = 2, .expert_parallel = true}, "expert_parallel"}}) {
    auto b = PresetBuilder::Create(m.config, m.inv, c.par);
    ASSERT_FALSE(b.ok()) << c.par.preset << " " << c.says;
    EXPECT_TRUE(absl::StrContains(b.status().message(), c.says)) << b.status();
    EXPECT_TRUE(absl::StrContains(b.status().message(), "does not apply")) << b.status();
  }
}

// vLLM's and SGLang's VocabParallelEmbedding divide() the vocabulary padded to 64 by tp.
TEST(Presets, RolloutTpMustDivideThePaddedVocabulary) {
  Model odd = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":96,"intermediate_size":192,
    "num_hidden_layers":1,"num_attention_heads":6,"num_key_value_heads":3,"vocab_size":1000})");
  for (const char* preset : {"vllm", "sglang"}) {
    auto b = PresetBuilder::Create(odd.config, odd.inv, {.preset = preset, .tp = 3});  // 1000 -> 1024, not / 3
    ASSERT_FALSE(b.ok()) << preset;
    EXPECT_TRUE(absl::StrContains(b.status().message(), "vocab_size=1000 -> 1024")) << b.status();
  }
  EXPECT_TRUE(PresetBuilder::Create(odd.config, odd.inv, {.preset = "megatron", .tp = 3}).ok());
}

// SGLang's Gemma 3 (gemma3_causal.py) embeds with a plain nn.Embedding: whole and unpadded on
// every rank, at any tp; Gemma 2 and vLLM's Gemma 3 are vocab-parallel.
TEST(Presets, SglangGemma3EmbeddingIsWhole) {
  Model m = FromText(R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":64,"head_dim":32,
    "intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000})");
  auto s = MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 2}, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  const LocalTensor* e = FindLocal(*s, "model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{1000, 64}));
  EXPECT_EQ(CanonicalAt(m.inv, *s, *e, 999 * 64).second, 999 * 64);
  auto v = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 2}, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_NE(FindLocal(*v, "model.embed_tokens.weight"), nullptr);
  EXPECT_EQ(FindLocal(*v, "model.embed_tokens.weight")->shape, (std::vector<int64_t>{512, 64}));
}

// SGLang's Qwen2-MoE and Mixtral attention take head_dim = hidden / heads, whatever the config says.
TEST(Presets, SglangRefusesAHeadDimItsQwen2MoeAndMixtralIgnore) {
  Model m = FromText(R"({"architectures":["MixtralForCausalLM"],"hidden_size":64,"head_dim":32,
    "intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,
    "vocab_size":1000,"num_local_experts":4})");
  auto b = PresetBuilder::Create(m.config, m.inv, {.preset = "sglang", .tp = 2});
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::StrContains(b.status().message(), "head_dim=32")) << b.status();
  EXPECT_TRUE(PresetBuilder::Create(m.config, m.inv, {.preset = "vllm", .tp = 2}).ok());
  Model q = FromText(R"({"architectures":["Qwen2MoeForCausalLM"],"hidden_size":64,"head_dim":32,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"num_experts":4})");
  for (const char* preset : {"vllm", "sglang"}) {
    auto r = PresetBuilder::Create(q.config, q.inv, {.preset = preset, .tp = 2});
    ASSERT_FALSE(r.ok()) << preset;
    EXPECT_TRUE(absl::StrContains(r.status().message(), "head_dim=32")) << r.status();
  }
}

TEST(Presets, VllmMlaFusedQkvA) {
  Model m = Load("deepseek-v3.json", 4);
  TensorIndex idx(m.inv);
  auto l = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 32, .expert_parallel = true}, 31);
  ASSERT_TRUE(l.ok()) << l.status();
  const LocalTensor* f = FindLocal(*l, "model.layers.0.self_attn.fused_qkv_a_proj.weight");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->shape, (std::vector<int64_t>{1536 + 576, 7168}));
  auto got = CanonicalAt(m.inv, *l, *f, (1536 + 2) * 7168 + 5);
  EXPECT_EQ(got.first, *idx.Find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"));
  EXPECT_EQ(got.second, 2 * 7168 + 5);
  const LocalTensor* qb = FindLocal(*l, "model.layers.0.self_attn.q_b_proj.weight");
  ASSERT_NE(qb, nullptr);
  EXPECT_EQ(qb->shape, (std::vector<int64_t>{4 * 192, 1536}));
  got = CanonicalAt(m.inv, *l, *qb, 0);
  EXPECT_EQ(got.second, 31 * 4 * 192 * 1536);
  const LocalTensor* w2 = FindLocal(*l, "model.layers.3.mlp.experts.w2_weight");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{8, 7168, 2048}));
  EXPECT_NE(FindLocal(*l, "model.layers.3.mlp.gate.e_score_correction_bias"), nullptr);
  EXPECT_NE(FindLocal(*l, "model.layers.3.mlp.shared_experts.gate_up_proj.weight"), nullptr);
}

TEST(Presets, LocalTensorsAreAlignedAndDisjoint) {
  Model m = Load("qwen2.5-0.5b.json", 3);
  for (ParallelConfig par : {ParallelConfig{.preset = "vllm", .tp = 2}, ParallelConfig{.preset = "fsdp", .dp = 3},
                             ParallelConfig{.preset = "megatron", .tp = 2, .pp = 2}}) {
    auto l = MakePresetLayout(m.config, m.inv, par, 1);
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_EQ(l->layout.buffers.size(), 1u);
    int64_t end = 0;
    for (const LocalTensor& t : l->local_tensors) {
      EXPECT_EQ(t.offset_bytes % kLocalTensorAlignment, 0) << t.name;
      EXPECT_GE(t.offset_bytes, end) << t.name;
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      end = t.offset_bytes + n * DTypeSize(t.dtype);
      EXPECT_GT(t.num_pieces, 0) << t.name;
    }
    EXPECT_LE(end, l->layout.buffers[0].size_bytes);
  }
}

// Counts, cell by cell, how many times the union of all ranks' boxes covers each tensor.
// Returns per tensor the coverage count if uniform, -1 if not uniform (some cells differ).
std::vector<int64_t> CoverageCounts(const Inventory& inv, const std::vector<PresetLayout>& ranks) {
  std::vector<std::vector<const Box*>> boxes(inv.tensors.size());
  for (const PresetLayout& l : ranks) {
    for (const Piece& p : l.layout.pieces) boxes[p.tensor].push_back(&p.box);
  }
  std::vector<int64_t> out(inv.tensors.size(), 0);
  for (size_t t = 0; t < inv.tensors.size(); ++t) {
    const auto& shape = inv.tensors[t].shape;
    const size_t r = shape.size();
    std::vector<std::vector<int64_t>> cuts(r);
    for (size_t d = 0; d < r; ++d) {
      cuts[d] = {0, shape[d]};
      for (const Box* b : boxes[t]) {
        cuts[d].push_back(b->begin[d]);
        cuts[d].push_back(b->end[d]);
      }
      std::sort(cuts[d].begin(), cuts[d].end());
      cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    }
    std::vector<int64_t> dims(r);
    int64_t cells = 1;
    for (size_t d = 0; d < r; ++d) cells *= (dims[d] = cuts[d].size() - 1);
    std::vector<int64_t> count(cells, 0);
    for (const Box* b : boxes[t]) {
      std::vector<int64_t> lo(r), hi(r);
      for (size_t d = 0; d < r; ++d) {
        lo[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), b->begin[d]) - cuts[d].begin();
        hi[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), b->end[d]) - cuts[d].begin();
      }
      std::vector<int64_t> c = lo;
      while (true) {
        int64_t flat = 0;
        for (size_t d = 0; d < r; ++d) flat = flat * dims[d] + c[d];
        count[flat]++;
        size_t d = r;
        while (d > 0) {
          --d;
          if (++c[d] < hi[d]) break;
          c[d] = lo[d];
          if (d == 0) goto done;
        }
        if (r == 0) break;
      }
    done:;
    }
    const int64_t first = count[0];
    out[t] = std::all_of(count.begin(), count.end(), [&](int64_t x) { return x == first; }) ? first : -1;
  }
  return out;
}

struct CoverCase {
  const char* model;
  int64_t layers;
  ParallelConfig par;
};

// Expected copies of each canonical element across all ranks, from the name (test's own rules).
int64_t ExpectedCopies(const ModelConfig& c, const ParallelConfig& p, const std::string& name) {
  const bool replicated = absl::EndsWith(name, "norm.weight") || absl::StrContains(name, "gate.weight") ||
                          absl::StrContains(name, "e_score_correction_bias") ||
                          absl::StrContains(name, "q_a_proj") || absl::StrContains(name, "kv_a_proj") ||
                          absl::StrContains(name, "o_proj.bias") || absl::EndsWith(name, "down_proj.bias");
  const bool expert = absl::StrContains(name, ".experts.");
  // SGLang's Gemma 3 embedding is a plain nn.Embedding: whole on every rank.
  const bool whole_embedding = p.preset == "sglang" && c.family == ModelFamily::kGemma3 && name == "model.embed_tokens.weight";
  if (p.preset == "fsdp_flat") return 1;
  if (p.preset == "fsdp" || p.preset == "fsdp2") return p.replicas;
  if (p.preset == "megatron") {
    const int etp = p.etp ? p.etp : p.tp;
    if (expert) return int64_t{p.tp} * p.dp / (p.ep * etp);
    if (replicated) return int64_t{p.tp} * p.dp;
    if (name == "model.embed_tokens.weight" && c.tie_word_embeddings && p.pp > 1) return 2 * p.dp;
    return p.dp;
  }
  // vllm/sglang: dp ranks of one engine each hold the dense part; MoE experts once per engine.
  // vLLM's sequence-parallel MoE (EP, tp > 1, dp > 1, an all2all backend of its list) keeps
  // DeepSeek's shared experts whole; SGLang's a2a backends keep DeepSeek's, GLM's and Qwen2-MoE's.
  const bool deepseek = c.family == ModelFamily::kDeepseekV3 || c.family == ModelFamily::kDeepseekV2;
  const bool shared = absl::StrContains(name, ".shared_experts.") || absl::StrContains(name, ".shared_expert.");
  const bool vllm_sp = p.moe_a2a_backend != "pplx" && p.moe_a2a_backend != "flashinfer_all2allv" &&
                       p.moe_a2a_backend != "flashinfer_nvlink_two_sided";
  const bool sp_shared =
      shared && ((p.preset == "vllm" && deepseek && p.expert_parallel && p.tp > 1 && p.dp > 1 && vllm_sp) ||
                 (p.preset == "sglang" && !p.moe_a2a_backend.empty() && p.moe_a2a_backend != "none" &&
                  (deepseek || c.family == ModelFamily::kGlm4Moe || c.family == ModelFamily::kQwen2Moe)));
  if (replicated || sp_shared || whole_embedding) return int64_t{p.tp} * p.dp * p.replicas;
  if (expert) return p.replicas;
  // SGLang DP attention (deepseek_v2.py): dense MLPs, TP-split shared experts and lm_head span all
  // dp*tp ranks of the engine (attention and embed_tokens only the attention-TP group).
  const bool dense_mlp = absl::StrContains(name, ".mlp.") && !absl::StrContains(name, ".mlp.gate.");
  if (p.preset == "sglang" && p.dp > 1 && (dense_mlp || name == "lm_head.weight")) return p.replicas;
  const bool kv = absl::StrContains(name, "k_proj") || absl::StrContains(name, "v_proj");
  if (kv && p.tp > c.kv_heads) return int64_t{p.replicas} * p.dp * p.tp / c.kv_heads;
  return int64_t{p.dp} * p.replicas;
}

class Coverage : public ::testing::TestWithParam<CoverCase> {};

TEST_P(Coverage, UnionOfRanksCoversEveryElementTheExpectedNumberOfTimes) {
  const CoverCase& cc = GetParam();
  Model m = Load(cc.model, cc.layers);
  auto b = PresetBuilder::Create(m.config, m.inv, cc.par);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<PresetLayout> ranks;
  for (int r = 0; r < b->world_size(); ++r) {
    auto l = b->Make(r);
    ASSERT_TRUE(l.ok()) << l.status();
    for (const Piece& p : l->layout.pieces) {
      ASSERT_TRUE(BoxInside(p.box, m.inv.tensors[p.tensor].shape)) << BoxToString(p.box);
    }
    ranks.push_back(std::move(*l));
  }
  std::vector<int64_t> counts = CoverageCounts(m.inv, ranks);
  for (size_t t = 0; t < m.inv.tensors.size(); ++t) {
    EXPECT_EQ(counts[t], ExpectedCopies(m.config, cc.par, m.inv.tensors[t].name)) << m.inv.tensors[t].name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    RealConfigs, Coverage,
    ::testing::Values(
        CoverCase{"qwen2.5-0.5b.json", 4, {.preset = "megatron", .tp = 2, .pp = 3, .dp = 2}},
        CoverCase{"qwen2.5-0.5b.json", 4, {.preset = "megatron", .tp = 1, .pp = 1, .dp = 2}},
        CoverCase{"qwen2.5-0.5b.json", 4, {.preset = "vllm", .tp = 2, .replicas = 2}},
        CoverCase{"qwen2.5-0.5b.json", 4, {.preset = "fsdp", .dp = 3}},
        CoverCase{"qwen2.5-7b.json", 4, {.preset = "megatron", .tp = 4, .pp = 2, .dp = 2}},
        CoverCase{"qwen2.5-7b.json", 4, {.preset = "vllm", .tp = 4, .replicas = 2}},
        CoverCase{"qwen2.5-7b.json", 4, {.preset = "fsdp", .dp = 8}},
        CoverCase{"qwen3-30b-a3b.json", 4, {.preset = "megatron", .tp = 2, .pp = 2, .dp = 4, .ep = 8, .etp = 1}},
        CoverCase{"qwen3-30b-a3b.json", 4, {.preset = "megatron", .tp = 2, .pp = 1, .dp = 2, .ep = 2}},
        CoverCase{"qwen3-30b-a3b.json", 4, {.preset = "vllm", .tp = 4, .replicas = 2}},
        CoverCase{"qwen3-30b-a3b.json", 4, {.preset = "vllm", .tp = 8, .expert_parallel = true}},
        CoverCase{"qwen3-30b-a3b.json", 2, {.preset = "fsdp", .dp = 5}},
        CoverCase{"qwen3-30b-a3b.json", 2, {.preset = "fsdp_flat", .dp = 5}},
        CoverCase{"qwen2.5-0.5b.json", 2, {.preset = "fsdp2", .dp = 3, .replicas = 2}},
        CoverCase{"deepseek-v3.json", 5, {.preset = "megatron", .tp = 1, .pp = 5, .dp = 16, .ep = 16, .etp = 1}},
        CoverCase{"deepseek-v3.json", 5, {.preset = "megatron", .tp = 4, .pp = 2, .dp = 2, .ep = 8, .etp = 1}},
        CoverCase{"deepseek-v3.json", 5, {.preset = "vllm", .tp = 32, .expert_parallel = true, .replicas = 2}},
        CoverCase{"deepseek-v3.json", 4, {.preset = "vllm", .tp = 8, .replicas = 1}},
        CoverCase{"kimi-k2.json", 3, {.preset = "megatron", .tp = 8, .pp = 3, .dp = 4, .ep = 32, .etp = 1}},
        CoverCase{"kimi-k2.json", 3, {.preset = "vllm", .tp = 16, .expert_parallel = true, .replicas = 2}},
        // vLLM DP + EP: experts over all dp*tp ranks, uneven (384 experts over 4*2*... ranks).
        CoverCase{"kimi-k2.json", 3, {.preset = "vllm", .tp = 8, .dp = 4, .expert_parallel = true, .replicas = 2}},
        CoverCase{"qwen3-30b-a3b.json", 2, {.preset = "vllm", .tp = 2, .dp = 3, .expert_parallel = true}},
        CoverCase{"qwen3-30b-a3b.json", 2, {.preset = "vllm", .tp = 2, .dp = 3, .expert_parallel = true,
                                            .expert_placement = "round_robin"}},
        CoverCase{"qwen3-30b-a3b.json", 2, {.preset = "vllm", .tp = 2, .dp = 2}},
        CoverCase{"deepseek-v3.json", 4, {.preset = "vllm", .tp = 4, .dp = 3, .expert_parallel = true}},
        // The engines' a2a MoE backends: vLLM's pplx is outside use_sequence_parallel_moe (shared
        // experts TP-split again), SGLang's deepep keeps them whole.
        CoverCase{"deepseek-v3.json", 4, {.preset = "vllm", .tp = 4, .dp = 2, .expert_parallel = true,
                                          .moe_a2a_backend = "pplx"}},
        CoverCase{"kimi-k2.json", 4, {.preset = "vllm", .tp = 2, .dp = 4, .expert_parallel = true,
                                      .moe_a2a_backend = "deepep_low_latency"}},
        CoverCase{"deepseek-v3.json", 4, {.preset = "sglang", .tp = 8, .expert_parallel = true, .replicas = 2,
                                          .moe_a2a_backend = "deepep"}},
        // SGLang DP attention (--tp-size 8 --dp-size 4 --enable-dp-attention: tp = 2, dp = 4).
        CoverCase{"deepseek-v3.json", 4, {.preset = "sglang", .tp = 2, .dp = 4, .expert_parallel = true, .replicas = 2}},
        CoverCase{"deepseek-v3.json", 4, {.preset = "sglang", .tp = 1, .dp = 8}},
        CoverCase{"kimi-k2.json", 2, {.preset = "sglang", .tp = 1, .dp = 8, .expert_parallel = true, .moe_a2a_backend = "deepep"}},
        // Megatron custom pipeline splits and virtual pipeline stages.
        CoverCase{"qwen2.5-7b.json", 10, {.preset = "megatron", .tp = 2, .pp = 4, .dp = 1, .first_stage_layers = 1,
                                          .last_stage_layers = 3}},
        CoverCase{"qwen2.5-7b.json", 12, {.preset = "megatron", .tp = 1, .pp = 3, .dp = 2, .first_stage_layers = 2,
                                          .last_stage_layers = 2, .vpp = 2}},
        CoverCase{"qwen2.5-0.5b.json", 8, {.preset = "megatron", .tp = 2, .pp = 2, .dp = 1, .vpp = 2}},
        CoverCase{"deepseek-v3.json", 6, {.preset = "megatron", .tp = 1, .pp = 2, .dp = 8, .ep = 8, .etp = 1,
                                          .first_stage_layers = 2, .vpp = 2}},
        // Legacy GroupedMLP (transposed experts) and the tp-pp-dp rank order.
        CoverCase{"qwen3-30b-a3b.json", 2, {.preset = "megatron", .tp = 2, .pp = 2, .dp = 4, .ep = 4, .etp = 2,
                                            .moe_grouped_gemm = true, .moe_legacy_grouped_gemm = true}},
        CoverCase{"deepseek-v3.json", 4, {.preset = "megatron", .tp = 4, .pp = 2, .dp = 2, .ep = 4, .etp = 1,
                                          .moe_grouped_gemm = true, .moe_legacy_grouped_gemm = true,
                                          .tp_pp_dp_mapping = true}},
        CoverCase{"qwen2.5-7b.json", 4, {.preset = "megatron", .tp = 2, .pp = 2, .dp = 2, .tp_pp_dp_mapping = true}}));

TEST(Presets, SmallFamiliesCover) {
  // Mixtral, DeepSeek without q_lora, Qwen2-MoE with a gated shared expert, Llama with bias.
  const std::string mixtral = R"({"architectures":["MixtralForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":3,"num_attention_heads":8,"num_key_value_heads":2,
    "vocab_size":1000,"num_local_experts":8})";
  const std::string dsv2lite = R"({"architectures":["DeepseekV3ForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":8,
    "vocab_size":1000,"n_routed_experts":8,"n_shared_experts":2,"first_k_dense_replace":1,
    "q_lora_rank":null,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":4,"v_head_dim":8})";
  const std::string qwen2moe = R"({"architectures":["Qwen2MoeForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"moe_intermediate_size":32,"shared_expert_intermediate_size":64,
    "num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":4,"vocab_size":1000,
    "num_experts":8,"decoder_sparse_step":2})";
  const std::string llama = R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":2,
    "vocab_size":1000,"attention_bias":true,"tie_word_embeddings":true})";
  // Llama with mlp_bias, GLM-4.5 style MoE, DeepSeek-V2 (no router bias), Gemma 3.
  const std::string llama_mlp_bias = R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":4,
    "vocab_size":1000,"mlp_bias":true})";
  const std::string glm = R"({"architectures":["Glm4MoeForCausalLM"],"hidden_size":64,"head_dim":16,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":8,
    "num_key_value_heads":4,"vocab_size":1000,"n_routed_experts":8,"n_shared_experts":1,"first_k_dense_replace":1,
    "attention_bias":true,"use_qk_norm":true})";
  const std::string dsv2 = R"({"architectures":["DeepseekV2ForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":8,
    "vocab_size":1000,"n_routed_experts":8,"n_shared_experts":2,"first_k_dense_replace":1,"topk_method":"greedy",
    "q_lora_rank":24,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":4,"v_head_dim":8})";
  const std::string gemma3 = R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":64,"head_dim":32,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000})";
  for (const std::string* text : {&mixtral, &dsv2lite, &qwen2moe, &llama, &llama_mlp_bias, &glm, &dsv2, &gemma3}) {
    Model m = FromText(*text);
    for (ParallelConfig par : {ParallelConfig{.preset = "megatron", .tp = 2, .pp = 2, .dp = 2, .ep = 2, .etp = 1},
                               ParallelConfig{.preset = "vllm", .tp = 4, .replicas = 2},
                               ParallelConfig{.preset = "sglang", .tp = 4, .expert_parallel = true},
                               ParallelConfig{.preset = "fsdp", .dp = 3}}) {
      if (m.config.experts == 0 && par.preset == "megatron") par.ep = 1, par.etp = 0;
      if (m.config.ffn_norms && par.preset == "megatron") {  // Megatron has no Gemma layer: refused, named
        auto refused = PresetBuilder::Create(m.config, m.inv, par);
        ASSERT_FALSE(refused.ok());
        EXPECT_NE(refused.status().message().find("Gemma3ForCausalLM"), std::string::npos) << refused.status();
        continue;
      }
      // Configs the engine's model classes do not build as HF does: refused, naming the flag.
      // Megatron: an o_proj bias without MLP biases or the other way round (add_bias_linear is
      // both); SGLang: Llama mlp_bias, Qwen MoE dense layers.
      std::string refusal;
      if (par.preset == "megatron" && m.config.o_bias != m.config.mlp_bias) refusal = m.config.o_bias ? "attention_bias" : "mlp_bias";
      if (par.preset == "sglang" && m.config.mlp_bias) refusal = "mlp_bias";
      if (par.preset == "sglang" && m.config.family == ModelFamily::kQwen2Moe) refusal = "decoder_sparse_step";
      if (!refusal.empty()) {
        auto refused = PresetBuilder::Create(m.config, m.inv, par);
        ASSERT_FALSE(refused.ok()) << m.config.architecture << " " << par.preset;
        EXPECT_NE(refused.status().message().find(refusal), std::string::npos) << refused.status();
        continue;
      }
      auto b = PresetBuilder::Create(m.config, m.inv, par);
      ASSERT_TRUE(b.ok()) << m.config.architecture << " " << par.preset << ": " << b.status();
      std::vector<PresetLayout> ranks;
      for (int r = 0; r < b->world_size(); ++r) ranks.push_back(*b->Make(r));
      std::vector<int64_t> counts = CoverageCounts(m.inv, ranks);
      for (size_t t = 0; t < m.inv.tensors.size(); ++t) {
        EXPECT_EQ(counts[t], ExpectedCopies(m.config, par, m.inv.tensors[t].name))
            << m.config.architecture << " " << par.preset << " " << m.inv.tensors[t].name;
      }
    }
  }
}

// FSDP2 (fully_shard) as torch/distributed/fsdp/_fully_shard/_fsdp_param.py shards: dim 0 in
// torch.chunk pieces of ceil(d0/world) rows (d0=5 over 4 ranks: 2,2,1,0), padded storage of
// ceil(d0/world) rows on every rank, local shape = the unpadded rows.
TEST(Presets, Fsdp2TorchChunkSemantics) {
  Model m = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":5,"intermediate_size":6,
    "num_hidden_layers":1,"num_attention_heads":1,"num_key_value_heads":1,"vocab_size":7})");
  const std::map<std::string, std::vector<int64_t>> rows = {
      {"model.norm.weight", {2, 2, 1, 0}},                      // d0 = 5
      {"model.layers.0.self_attn.q_proj.weight", {2, 2, 1, 0}},  // [5, 5]
      {"model.layers.0.mlp.gate_proj.weight", {2, 2, 2, 0}},    // d0 = 6: torch.chunk gives 3 chunks
      {"model.embed_tokens.weight", {2, 2, 2, 1}},              // d0 = 7
  };
  int64_t buffer = -1;
  for (int r = 0; r < 4; ++r) {
    auto l = MakePresetLayout(m.config, m.inv, {.preset = "fsdp", .dp = 4}, r);
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_TRUE(ValidateLayout(m.inv, l->layout, Role::kTrainer).ok());
    EXPECT_EQ(l->local_tensors.size(), m.inv.tensors.size());  // empty shards listed too
    if (buffer < 0) buffer = l->layout.buffers[0].size_bytes;
    EXPECT_EQ(l->layout.buffers[0].size_bytes, buffer) << "padded shards: every rank the same size";
    for (const auto& [name, want] : rows) {
      const LocalTensor* lt = FindLocal(*l, name);
      ASSERT_NE(lt, nullptr) << name;
      EXPECT_EQ(lt->shape[0], want[r]) << name << " rank " << r;
      EXPECT_EQ(lt->num_pieces, want[r] > 0 ? 1 : 0) << name;
      if (want[r] == 0) continue;
      const Piece& p = l->layout.pieces[lt->first_piece];
      EXPECT_EQ(p.box.begin[0], r * 2) << name;
      EXPECT_EQ(p.box.end[0], r * 2 + want[r]) << name;
      EXPECT_EQ(p.offset_bytes, lt->offset_bytes);
      // Local element (i, j) is canonical (r*2 + i, j): contiguous rows.
      if (lt->shape.size() == 2 && want[r] >= 2) {
        EXPECT_EQ(CanonicalAt(m.inv, *l, *lt, 5).second, (r * 2 + 1) * 5 + 0) << name;
      }
    }
    // Storage of a padded shard: the next local tensor starts after ceil(d0/4) rows.
    for (size_t i = 0; i + 1 < l->local_tensors.size(); ++i) {
      const LocalTensor& a = l->local_tensors[i];
      const auto& shape = m.inv.tensors[i].shape;
      int64_t padded = (shape[0] + 3) / 4;
      for (size_t d = 1; d < shape.size(); ++d) padded *= shape[d];
      EXPECT_GE(l->local_tensors[i + 1].offset_bytes, a.offset_bytes + padded * 2) << a.name;
    }
  }
  // HSDP: replicas x dp ranks, replica-major; replica 1 holds what replica 0 holds.
  auto a = MakePresetLayout(m.config, m.inv, {.preset = "fsdp2", .dp = 2, .replicas = 2}, 1);
  auto b = MakePresetLayout(m.config, m.inv, {.preset = "fsdp2", .dp = 2, .replicas = 2}, 3);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->layout.pieces.size(), b->layout.pieces.size());
  for (size_t i = 0; i < a->layout.pieces.size(); ++i) {
    EXPECT_EQ(BoxToString(a->layout.pieces[i].box), BoxToString(b->layout.pieces[i].box));
  }
  EXPECT_EQ(*PresetWorldSize({.preset = "fsdp", .dp = 8, .replicas = 2}), 16);
  // The flat layout keeps its old meaning under its own name: 1-D ranges of ceil(n/dp) elements.
  auto flat = MakePresetLayout(m.config, m.inv, {.preset = "fsdp_flat", .dp = 4}, 3);
  ASSERT_TRUE(flat.ok());
  const LocalTensor* emb = FindLocal(*flat, "model.embed_tokens.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->shape, (std::vector<int64_t>{35 - 3 * 9}));
  // deepspeed_zero3 names the same layout (ZeRO-3's partitioning), piece for piece.
  auto zero3 = MakePresetLayout(m.config, m.inv, {.preset = "deepspeed_zero3", .dp = 4}, 3);
  ASSERT_TRUE(zero3.ok()) << zero3.status();
  ASSERT_EQ(zero3->layout.pieces.size(), flat->layout.pieces.size());
  for (size_t i = 0; i < flat->layout.pieces.size(); ++i) {
    EXPECT_EQ(BoxToString(zero3->layout.pieces[i].box), BoxToString(flat->layout.pieces[i].box));
    EXPECT_EQ(zero3->layout.pieces[i].offset_bytes, flat->layout.pieces[i].offset_bytes);
  }
  EXPECT_FALSE(MakePresetLayout(m.config, m.inv, {.preset = "deepspeed_zero3", .dp = 4, .replicas = 2}, 0).ok());
}

// vLLM --data-parallel-size 4 --tensor-parallel-size 2 --enable-expert-parallel: attention TP
// within the DP rank, experts over all 8 ranks (ep_rank = dp_rank * tp + tp_rank).
TEST(Presets, VllmDataParallelExpertParallel) {
  Model m = Load("qwen3-30b-a3b.json", 1);  // 128 experts, moe_intermediate 768, 32 heads, 4 KV heads
  ParallelConfig par{.preset = "vllm", .tp = 2, .dp = 4, .expert_parallel = true};
  auto b = PresetBuilder::Create(m.config, m.inv, par);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->world_size(), 8);
  auto l = b->Make(5);  // dp_rank 2, tp_rank 1 -> ep_rank 5: experts 80..95
  ASSERT_TRUE(l.ok()) << l.status();
  const LocalTensor* w13 = FindLocal(*l, "model.layers.0.mlp.experts.w13_weight");
  ASSERT_NE(w13, nullptr);
  EXPECT_EQ(w13->shape, (std::vector<int64_t>{16, 2 * 768, 2048}));
  TensorIndex idx(m.inv);
  EXPECT_EQ(l->layout.pieces[w13->first_piece].tensor, *idx.Find("model.layers.0.mlp.experts.80.gate_proj.weight"));
  const LocalTensor* qkv = FindLocal(*l, "model.layers.0.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (std::vector<int64_t>{(16 + 2 * 2) * 128, 2048}));  // tp=2 within the DP rank
  EXPECT_EQ(l->layout.pieces[qkv->first_piece].box.begin[0], 16 * 128);   // q heads 16..31 (tp_rank 1)
  // Without expert parallelism the experts are tensor-split over all dp*tp = 8 ranks.
  auto t = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 2, .dp = 4}, 5);
  ASSERT_TRUE(t.ok()) << t.status();
  const LocalTensor* t13 = FindLocal(*t, "model.layers.0.mlp.experts.w13_weight");
  ASSERT_NE(t13, nullptr);
  EXPECT_EQ(t13->shape, (std::vector<int64_t>{128, 2 * 96, 2048}));
  EXPECT_EQ(t->layout.pieces[t13->first_piece].box.begin[0], 5 * 96);
  EXPECT_FALSE(MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 2, .dp = 4}, 0).ok());
}

// SGLang DP attention (--tp-size T --dp-size D --enable-dp-attention; preset tp = T / D, dp = D),
// transcribed from sglang's models/deepseek_v2.py and layers/dp_attention.py independently of the
// preset code: attn_tp_rank = rank % (T/D); MLA projections (q_b, kv_b by heads, o_proj by columns)
// and embed_tokens (VocabParallelEmbedding use_attn_tp_group: padded vocab over T/D) over the
// attention-TP group; dense MLPs (DeepseekV2MLP default tp), shared experts, routed experts and
// lm_head (ParallelLMHead without --enable-dp-lm-head) over all T ranks; norms and routers whole.
// --enable-dp-lm-head (enable_dp_lm_head): lm_head over the attention-TP group instead
// (ParallelLMHead(use_attn_tp_group=True)); --moe-dense-tp-size 1 (moe_dense_tp_size): the dense
// MLP whole (DeepseekV2MLP tp_rank 0, tp_size 1), shared experts unchanged. dp = 1 is plain TP
// (A = T = tp). Every element of every local tensor of every rank is checked.
const char* kSmallDeepseekV3 = R"({"architectures":["DeepseekV3ForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":8,
    "vocab_size":1000,"n_routed_experts":8,"n_shared_experts":2,"first_k_dense_replace":1,
    "q_lora_rank":24,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":4,"v_head_dim":8})";

void CheckSglangDpAttentionRank(const Model& m, const ParallelConfig& par, int rank) {
  TensorIndex idx(m.inv);
  auto l = MakePresetLayout(m.config, m.inv, par, rank);
  ASSERT_TRUE(l.ok()) << l.status();
  const int64_t A = par.tp, T = int64_t{par.tp} * par.dp, a = rank % A, t = rank % T;
  const int64_t padded = 1024, vocab = 1000;
  const bool whole_shared = par.moe_a2a_backend == "deepep";
  // Expected canonical (name, row, col) of local element (e, i, j) of the local tensor `name`.
  struct Want {
    std::string name;
    int64_t row = -1, col = -1;
  };
  auto expect = [&](const std::string& name, int64_t e, int64_t i, int64_t j) -> Want {
    auto rows = [&](int64_t n, int64_t part) { return part * n + i; };
    if (name == "model.embed_tokens.weight") {
      const int64_t r = rows(padded / A, a);
      return r < vocab ? Want{name, r, j} : Want{};
    }
    if (name == "lm_head.weight") {
      const int64_t r = par.enable_dp_lm_head ? rows(padded / A, a) : rows(padded / T, t);
      return r < vocab ? Want{name, r, j} : Want{};
    }
    if (absl::EndsWith(name, "norm.weight") || absl::EndsWith(name, ".mlp.gate.weight") ||
        absl::EndsWith(name, "e_score_correction_bias")) {
      return {name, i, j};
    }
    const std::string p = name.substr(0, name.find(".self_attn.") != std::string::npos ? name.find(".self_attn.") + 1
                                                                                         : name.find(".mlp.") + 1);
    if (absl::EndsWith(name, "fused_qkv_a_proj_with_mqa.weight")) {
      return i < 24 ? Want{p + "self_attn.q_a_proj.weight", i, j} : Want{p + "self_attn.kv_a_proj_with_mqa.weight", i - 24, j};
    }
    if (absl::EndsWith(name, "q_b_proj.weight")) return {name, rows(8 * 12 / A, a), j};
    if (absl::EndsWith(name, "kv_b_proj.weight")) return {name, rows(8 * 16 / A, a), j};
    if (absl::EndsWith(name, "o_proj.weight")) return {name, i, a * (64 / A) + j};
    const bool shared = absl::StrContains(name, ".shared_experts.");
    const std::string mlp = p + (shared ? "mlp.shared_experts." : "mlp.");
    const int64_t I = shared ? 64 : 128;
    const bool whole = shared ? whole_shared : par.moe_dense_tp_size == 1;
    const int64_t parts = whole ? 1 : T, part = whole ? 0 : t;
    if (absl::EndsWith(name, "mlp.gate_up_proj.weight") || absl::EndsWith(name, "shared_experts.gate_up_proj.weight")) {
      const int64_t n = I / parts;
      return i < n ? Want{mlp + "gate_proj.weight", part * n + i, j} : Want{mlp + "up_proj.weight", part * n + i - n, j};
    }
    if (absl::EndsWith(name, "down_proj.weight")) return {mlp + "down_proj.weight", i, part * (I / parts) + j};
    // Routed experts (FusedMoE over all T ranks): EP holds 8/T whole experts, else 32/T rows each.
    const int64_t n = par.expert_parallel ? 32 : 32 / T, i0 = par.expert_parallel ? 0 : t * n;
    const int64_t expert = par.expert_parallel ? t * (8 / T) + e : e;
    const std::string x = absl::StrCat(p, "mlp.experts.", expert, ".");
    if (absl::EndsWith(name, "experts.w13_weight")) {
      return i < n ? Want{x + "gate_proj.weight", i0 + i, j} : Want{x + "up_proj.weight", i0 + i - n, j};
    }
    if (absl::EndsWith(name, "experts.w2_weight")) return {x + "down_proj.weight", i, i0 + j};
    ADD_FAILURE() << "unexpected local tensor " << name;
    return {};
  };
  std::set<std::string> seen;
  for (const LocalTensor& lt : l->local_tensors) {
    seen.insert(lt.name);
    const int64_t n = Numel(lt.shape);
    const int64_t cols = lt.shape.back(), rows = lt.shape.size() >= 2 ? lt.shape[lt.shape.size() - 2] : 1;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t e = lt.shape.size() == 3 ? k / (rows * cols) : 0;
      const int64_t i = lt.shape.size() >= 2 ? (k / cols) % rows : k, j = lt.shape.size() >= 2 ? k % cols : 0;
      Want w = expect(lt.name, e, i, j);
      std::pair<int32_t, int64_t> want{-1, -1};
      if (!w.name.empty()) {
        auto tid = idx.Find(w.name);
        ASSERT_TRUE(tid.has_value()) << w.name;
        const std::vector<int64_t>& shape = m.inv.tensors[*tid].shape;
        want = {*tid, shape.size() == 1 ? w.row : w.row * shape[1] + w.col};
      }
      ASSERT_EQ(CanonicalAt(m.inv, *l, lt, k), want) << "rank " << rank << " " << lt.name << " element " << k;
    }
  }
  // The engine's parameters, no more and no fewer: dense layer 0, MoE layers 1 and 2.
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                           "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                           "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa.weight",
                           "model.layers.2.mlp.experts.w13_weight", "model.layers.2.mlp.shared_experts.down_proj.weight"}) {
    EXPECT_TRUE(seen.count(name)) << name;
  }
  EXPECT_EQ(FindLocal(*l, "model.layers.1.mlp.gate_up_proj.weight"), nullptr);
}

TEST(Presets, SglangDpAttentionDeepseek) {
  Model m = FromText(kSmallDeepseekV3);
  for (const ParallelConfig& par :
       {ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2},  // --tp-size 4 --dp-size 2
        ParallelConfig{.preset = "sglang", .tp = 1, .dp = 4},  // --tp-size 4 --dp-size 4
        ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2, .expert_parallel = true},
        ParallelConfig{.preset = "sglang", .tp = 1, .dp = 4, .expert_parallel = true, .moe_a2a_backend = "deepep"},
        ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2, .expert_parallel = true, .replicas = 2},
        // --enable-dp-lm-head and / or --moe-dense-tp-size 1 (with DP attention, and plain TP).
        ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2, .enable_dp_lm_head = true},
        ParallelConfig{.preset = "sglang", .tp = 1, .dp = 4, .enable_dp_lm_head = true, .moe_dense_tp_size = 1},
        ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2, .expert_parallel = true, .moe_a2a_backend = "deepep",
                       .moe_dense_tp_size = 1},
        ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2, .replicas = 2, .enable_dp_lm_head = true, .moe_dense_tp_size = 1},
        ParallelConfig{.preset = "sglang", .tp = 2, .dp = 2, .moe_dense_tp_size = 4},  // = --tp-size: as unset
        ParallelConfig{.preset = "sglang", .tp = 4, .moe_dense_tp_size = 1}}) {
    auto b = PresetBuilder::Create(m.config, m.inv, par);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->world_size(), par.tp * par.dp * par.replicas);
    for (int r = 0; r < b->world_size(); ++r) {
      SCOPED_TRACE(testing::Message() << "tp=" << par.tp << " dp=" << par.dp << " ep=" << par.expert_parallel
                                      << " a2a=" << par.moe_a2a_backend << " dp_lm_head=" << par.enable_dp_lm_head
                                      << " moe_dense_tp_size=" << par.moe_dense_tp_size << " rank " << r);
      CheckSglangDpAttentionRank(m, par, r);
    }
  }
  // Shapes spelled out for --tp-size 4 --dp-size 2, rank 3 (attn_tp_rank 1, attn_dp_rank 1).
  auto l = MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 2, .dp = 2}, 3);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(FindLocal(*l, "model.embed_tokens.weight")->shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(FindLocal(*l, "lm_head.weight")->shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(FindLocal(*l, "model.layers.1.self_attn.q_b_proj.weight")->shape, (std::vector<int64_t>{48, 24}));
  EXPECT_EQ(FindLocal(*l, "model.layers.1.self_attn.o_proj.weight")->shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(FindLocal(*l, "model.layers.0.mlp.gate_up_proj.weight")->shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(FindLocal(*l, "model.layers.1.mlp.shared_experts.gate_up_proj.weight")->shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(FindLocal(*l, "model.layers.1.mlp.experts.w13_weight")->shape, (std::vector<int64_t>{8, 16, 64}));
}

// What SGLang's DP attention layout does not describe stays refused, naming the constraint.
TEST(Presets, SglangDpAttentionRefusals) {
  Model ds = FromText(kSmallDeepseekV3);
  Model qwen3 = Load("qwen3-30b-a3b.json", 2);
  Model dense = Load("qwen2.5-7b.json", 2);
  const std::string llama = R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":2,"vocab_size":1000})";
  Model ll = FromText(llama);
  struct Refusal {
    const Model* m;
    ParallelConfig par;
    std::string needle;
  };
  for (const Refusal& r : {Refusal{&qwen3, {.preset = "sglang", .tp = 2, .dp = 4}, "Qwen3MoeForCausalLM"},
                           Refusal{&dense, {.preset = "sglang", .tp = 2, .dp = 2}, "DeepSeek-V2/V3"},
                           Refusal{&ll, {.preset = "sglang", .tp = 1, .dp = 2}, "LlamaForCausalLM"},
                           // lm_head over all dp*tp = 3 ranks: 1024 padded rows do not split.
                           Refusal{&ds, {.preset = "sglang", .tp = 1, .dp = 3}, "lm_head"},
                           // Dense MLPs over all dp*tp = 256 ranks: intermediate 128 does not split.
                           Refusal{&ds, {.preset = "sglang", .tp = 4, .dp = 64}, "dense MLPs"},
                           Refusal{&ds, {.preset = "sglang", .tp = 2, .dp = 2, .expert_parallel = true, .expert_placement = "round_robin"},
                                   "round_robin"}}) {
    auto b = PresetBuilder::Create(r.m->config, r.m->inv, r.par);
    ASSERT_FALSE(b.ok()) << r.m->config.architecture << " tp=" << r.par.tp << " dp=" << r.par.dp;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(b.status().message().find(r.needle), std::string::npos) << b.status();
  }
  // dp = 1 is plain TP, as before.
  EXPECT_TRUE(PresetBuilder::Create(dense.config, dense.inv, {.preset = "sglang", .tp = 2}).ok());
}

// --enable-dp-lm-head and --moe-dense-tp-size 1 on the real DeepSeek-V3 and Kimi-K2 configs
// (first 4 layers: DeepSeek-V3 dense 0..2, Kimi-K2 dense 0, MoE 3): the shape of each rank's lm_head and dense / shared MLP
// tensors and the canonical box each holds, with each option on and off.
TEST(Presets, SglangDpLmHeadAndDenseTpOnRealConfigs) {
  struct Case {
    const char* config;
    int64_t vocab, H, I, I_shared;
    int last_dense;  // first_k_dense_replace - 1
  };
  for (const Case& k : {Case{"deepseek-v3.json", 129280, 7168, 18432, 2048, 2}, Case{"kimi-k2.json", 163840, 7168, 18432, 2048, 0}}) {
    SCOPED_TRACE(k.config);
    Model m = Load(k.config, 4);
    TensorIndex idx(m.inv);
    const int64_t V = k.vocab, H = k.H;  // both vocabularies are multiples of 64: no padding rows
    // (preset tp, dp) = (--tp-size / --dp-size, --dp-size): --tp-size 8 with --dp-size 8, 4; plain TP 8.
    for (auto [tp, dp] : {std::pair{1, 8}, std::pair{2, 4}, std::pair{8, 1}}) {
      for (bool dp_lm_head : {false, true}) {
        for (int dense_tp : {0, 1, 8}) {
          if (dp_lm_head && dp == 1) continue;  // refused (below)
          const ParallelConfig par{.preset = "sglang", .tp = tp, .dp = dp, .enable_dp_lm_head = dp_lm_head,
                                   .moe_dense_tp_size = dense_tp};
          for (int rank : {0, 5, 7}) {
            SCOPED_TRACE(testing::Message() << "tp=" << tp << " dp=" << dp << " dp_lm_head=" << dp_lm_head
                                            << " moe_dense_tp_size=" << dense_tp << " rank " << rank);
            auto l = MakePresetLayout(m.config, m.inv, par, rank);
            ASSERT_TRUE(l.ok()) << l.status();
            const int64_t a = rank % tp, t = rank % 8;
            auto box = [&](const LocalTensor* lt, int j) -> const Box& { return l->layout.pieces[lt->first_piece + j].box; };
            auto tensor = [&](const LocalTensor* lt, int j) { return m.inv.tensors[l->layout.pieces[lt->first_piece + j].tensor].name; };
            // lm_head: over the attention-TP group with --enable-dp-lm-head, else over all 8 ranks.
            const int64_t head_parts = dp_lm_head ? tp : 8, head_part = dp_lm_head ? a : t;
            const LocalTensor* head = FindLocal(*l, "lm_head.weight");
            ASSERT_NE(head, nullptr);
            EXPECT_EQ(head->shape, (std::vector<int64_t>{V / head_parts, H}));
            EXPECT_EQ(box(head, 0).begin, (std::vector<int64_t>{head_part * (V / head_parts), 0}));
            EXPECT_EQ(box(head, 0).end, (std::vector<int64_t>{(head_part + 1) * (V / head_parts), H}));
            // embed_tokens: always over the attention-TP group.
            const LocalTensor* embed = FindLocal(*l, "model.embed_tokens.weight");
            ASSERT_NE(embed, nullptr);
            EXPECT_EQ(embed->shape, (std::vector<int64_t>{V / tp, H}));
            EXPECT_EQ(box(embed, 0).begin[0], a * (V / tp));
            // Dense MLPs (the first_k_dense_replace prefix): whole with --moe-dense-tp-size 1, else over all 8 ranks.
            const int64_t dparts = dense_tp == 1 ? 1 : 8, dpart = dense_tp == 1 ? 0 : t, n = k.I / dparts;
            for (int layer : {0, k.last_dense}) {
              const std::string p = absl::StrCat("model.layers.", layer, ".mlp.");
              const LocalTensor* gu = FindLocal(*l, p + "gate_up_proj.weight");
              const LocalTensor* down = FindLocal(*l, p + "down_proj.weight");
              ASSERT_NE(gu, nullptr);
              ASSERT_NE(down, nullptr);
              EXPECT_EQ(gu->shape, (std::vector<int64_t>{2 * n, H}));
              ASSERT_EQ(gu->num_pieces, 2);
              EXPECT_EQ(tensor(gu, 0), p + "gate_proj.weight");
              EXPECT_EQ(tensor(gu, 1), p + "up_proj.weight");
              for (int j : {0, 1}) {
                EXPECT_EQ(box(gu, j).begin, (std::vector<int64_t>{dpart * n, 0}));
                EXPECT_EQ(box(gu, j).end, (std::vector<int64_t>{(dpart + 1) * n, H}));
              }
              EXPECT_EQ(down->shape, (std::vector<int64_t>{H, n}));
              EXPECT_EQ(box(down, 0).begin, (std::vector<int64_t>{0, dpart * n}));
              EXPECT_EQ(box(down, 0).end, (std::vector<int64_t>{H, (dpart + 1) * n}));
            }
            // Shared experts (layer 3): over all 8 ranks whatever --moe-dense-tp-size says.
            const LocalTensor* sh = FindLocal(*l, "model.layers.3.mlp.shared_experts.gate_up_proj.weight");
            ASSERT_NE(sh, nullptr);
            EXPECT_EQ(sh->shape, (std::vector<int64_t>{2 * k.I_shared / 8, H}));
            EXPECT_EQ(box(sh, 0).begin[0], t * (k.I_shared / 8));
            EXPECT_EQ(FindLocal(*l, "model.layers.3.mlp.gate_up_proj.weight"), nullptr);
          }
        }
      }
    }
  }
  // The two options together, every rank of --tp-size 8 --dp-size 8 covering every canonical
  // element (nothing lost to the new splits).
  Model m = Load("deepseek-v3.json", 4);
  std::vector<PresetLayout> ranks;
  for (int r = 0; r < 8; ++r) {
    auto l = MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 1, .dp = 8, .enable_dp_lm_head = true, .moe_dense_tp_size = 1}, r);
    ASSERT_TRUE(l.ok()) << l.status();
    ranks.push_back(*std::move(l));
  }
  for (int64_t c : CoverageCounts(m.inv, ranks)) EXPECT_GE(c, 1);
}

// What SGLang refuses, or what is not described, with the two options: INVALID_ARGUMENT naming it.
TEST(Presets, SglangDpLmHeadAndDenseTpRefusals) {
  Model ds = FromText(kSmallDeepseekV3);
  Model qwen3 = Load("qwen3-30b-a3b.json", 2);
  Model glm = Load("glm-4.5-air.json", 2);
  struct Refusal {
    const Model* m;
    ParallelConfig par;
    std::string needle;
  };
  for (const Refusal& r : {
           // SGLang asserts --enable-dp-attention with --enable-dp-lm-head (and drops it at --dp-size 1).
           Refusal{&ds, {.preset = "sglang", .tp = 4, .enable_dp_lm_head = true}, "enable_dp_lm_head needs DP attention"},
           // check_server_args: moe_dense_tp_size in (None, 1, tp_size).
           Refusal{&ds, {.preset = "sglang", .tp = 2, .dp = 2, .moe_dense_tp_size = 2}, "moe_dense_tp_size=2"},
           Refusal{&ds, {.preset = "sglang", .tp = 4, .moe_dense_tp_size = 2}, "moe_dense_tp_size=2"},
           Refusal{&ds, {.preset = "sglang", .tp = 4, .moe_dense_tp_size = -1}, "moe_dense_tp_size=-1"},
           // Other families' dense MLPs under --moe-dense-tp-size 1: not described.
           Refusal{&qwen3, {.preset = "sglang", .tp = 2, .moe_dense_tp_size = 1}, "Qwen3MoeForCausalLM"},
           Refusal{&glm, {.preset = "sglang", .tp = 2, .moe_dense_tp_size = 1}, "Glm4MoeForCausalLM"},
           // Not vLLM's, nor a trainer's.
           Refusal{&ds, {.preset = "vllm", .tp = 2, .dp = 2, .enable_dp_lm_head = true}, "sglang options"},
           Refusal{&ds, {.preset = "vllm", .tp = 2, .moe_dense_tp_size = 1}, "sglang options"},
           Refusal{&ds, {.preset = "megatron", .tp = 2, .moe_dense_tp_size = 1}, "moe_dense_tp_size=1 does not apply"},
           Refusal{&ds, {.preset = "fsdp", .dp = 2, .enable_dp_lm_head = true}, "enable_dp_lm_head does not apply"}}) {
    auto b = PresetBuilder::Create(r.m->config, r.m->inv, r.par);
    ASSERT_FALSE(b.ok()) << r.m->config.architecture << " " << r.par.preset << " tp=" << r.par.tp << " dp=" << r.par.dp;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(b.status().message().find(r.needle), std::string::npos) << b.status();
  }
  // --enable-dp-lm-head lifts the lm_head-over-all-ranks constraint: vocabulary 1050 (padded 1088
  // = 17 x 64) does not split over --tp-size 128, but does over the attention-TP group of 2.
  std::string text = kSmallDeepseekV3;
  text.replace(text.find("\"vocab_size\":1000"), 17, "\"vocab_size\":1050");
  text.replace(text.find("\"n_routed_experts\":8"), 20, "\"n_routed_experts\":128");
  Model big = FromText(text);
  ParallelConfig par{.preset = "sglang", .tp = 2, .dp = 64, .expert_parallel = true, .moe_a2a_backend = "deepep"};
  auto without = PresetBuilder::Create(big.config, big.inv, par);
  ASSERT_FALSE(without.ok());
  EXPECT_NE(without.status().message().find("lm_head over all ranks"), std::string::npos) << without.status();
  par.enable_dp_lm_head = true;
  auto l = MakePresetLayout(big.config, big.inv, par, 127);
  ASSERT_TRUE(l.ok()) << l.status();
  const LocalTensor* head = FindLocal(*l, "lm_head.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->shape, (std::vector<int64_t>{544, 64}));
  EXPECT_EQ(l->layout.pieces[head->first_piece].box.begin[0], 544);  // attn_tp_rank 1: rows 544..1049
  EXPECT_EQ(l->layout.pieces[head->first_piece].box.end[0], 1050);
}

// vLLM determine_expert_map: 10 experts over 4 EP ranks -> 3, 3, 2, 2 (earlier ranks take the
// extra); round_robin: rank r holds r, r+4, r+8.
TEST(Presets, VllmUnevenExpertParallel) {
  EXPECT_EQ(VllmLocalExperts(10, 4, 0, false), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(VllmLocalExperts(10, 4, 1, false), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(VllmLocalExperts(10, 4, 2, false), (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(VllmLocalExperts(10, 4, 3, false), (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(VllmLocalExperts(10, 4, 1, true), (std::vector<int64_t>{1, 5, 9}));
  EXPECT_EQ(VllmLocalExperts(10, 4, 3, true), (std::vector<int64_t>{3, 7}));
  Model m = FromText(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":4,"vocab_size":100,
    "num_experts":10,"moe_intermediate_size":32})");
  TensorIndex idx(m.inv);
  for (bool rr : {false, true}) {
    ParallelConfig par{.preset = "vllm", .tp = 4, .expert_parallel = true};
    if (rr) par.expert_placement = "round_robin";
    std::vector<PresetLayout> ranks;
    for (int r = 0; r < 4; ++r) {
      auto l = MakePresetLayout(m.config, m.inv, par, r);
      ASSERT_TRUE(l.ok()) << l.status();
      const LocalTensor* w2 = FindLocal(*l, "model.layers.0.mlp.experts.w2_weight");
      ASSERT_NE(w2, nullptr);
      const std::vector<int64_t> want = VllmLocalExperts(10, 4, r, rr);
      ASSERT_EQ(w2->shape[0], static_cast<int64_t>(want.size()));
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_EQ(l->layout.pieces[w2->first_piece + j].tensor,
                  *idx.Find(absl::StrCat("model.layers.0.mlp.experts.", want[j], ".down_proj.weight")));
      }
      ranks.push_back(std::move(*l));
    }
    for (int64_t c : CoverageCounts(m.inv, ranks)) EXPECT_GE(c, 1);
  }
  // SGLang asserts num_experts % ep_size == 0.
  EXPECT_FALSE(MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 4, .expert_parallel = true}, 0).ok());
}

// Megatron-Core's layer assignment (get_num_layers_to_build / get_transformer_layer_offset).
TEST(Presets, MegatronCustomPipelineAndVirtualStages) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  ParallelConfig uneven{.preset = "megatron", .pp = 4, .first_stage_layers = 1, .last_stage_layers = 3};
  EXPECT_EQ(*MegatronStageLayers(10, uneven, 0), (Ranges{{0, 1}}));
  EXPECT_EQ(*MegatronStageLayers(10, uneven, 1), (Ranges{{1, 3}}));
  EXPECT_EQ(*MegatronStageLayers(10, uneven, 3), (Ranges{{7, 3}}));
  // DeepSeek-V3 style: 61 layers, pp=16, first 4 and last 1 -> 14 middle stages of 4.
  ParallelConfig ds{.preset = "megatron", .pp = 16, .first_stage_layers = 4, .last_stage_layers = 1};
  EXPECT_EQ(*MegatronStageLayers(61, ds, 15), (Ranges{{60, 1}}));
  EXPECT_EQ(*MegatronStageLayers(61, ds, 2), (Ranges{{8, 4}}));
  // Interleaved: 8 layers, pp=2, vpp=2 -> stage 0 [0,1] [4,5], stage 1 [2,3] [6,7] (the example
  // in Megatron-Core's transformer_block.py).
  ParallelConfig vp{.preset = "megatron", .pp = 2, .vpp = 2};
  EXPECT_EQ(*MegatronStageLayers(8, vp, 0), (Ranges{{0, 2}, {4, 2}}));
  EXPECT_EQ(*MegatronStageLayers(8, vp, 1), (Ranges{{2, 2}, {6, 2}}));
  vp.vpp = 4;
  EXPECT_EQ(*MegatronStageLayers(8, vp, 1), (Ranges{{1, 1}, {3, 1}, {5, 1}, {7, 1}}));
  // Uneven + interleaved: 12 layers, pp=3, first 2, last 2, vpp=2: chunks of 1, 4, 1 per stage.
  ParallelConfig both{.preset = "megatron", .pp = 3, .first_stage_layers = 2, .last_stage_layers = 2, .vpp = 2};
  EXPECT_EQ(*MegatronStageLayers(12, both, 0), (Ranges{{0, 1}, {6, 1}}));
  EXPECT_EQ(*MegatronStageLayers(12, both, 1), (Ranges{{1, 4}, {7, 4}}));
  EXPECT_EQ(*MegatronStageLayers(12, both, 2), (Ranges{{5, 1}, {11, 1}}));
  // Refusals name the numbers.
  auto bad = MegatronStageLayers(10, ParallelConfig{.preset = "megatron", .pp = 4, .first_stage_layers = 2}, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("first_stage_layers=2"), std::string::npos) << bad.status();
  EXPECT_FALSE(MegatronStageLayers(10, ParallelConfig{.preset = "megatron", .pp = 2, .vpp = 2}, 0).ok());  // 5 % 2
  EXPECT_FALSE(MegatronStageLayers(8, ParallelConfig{.preset = "megatron", .pp = 1, .vpp = 2}, 0).ok());

  // The layout: chunk v's layers are named model{v}.decoder.layers.{i}; embedding on (0, 0),
  // output layer on (last, last).
  Model m = Load("qwen2.5-7b.json", 8);
  TensorIndex idx(m.inv);
  ParallelConfig par{.preset = "megatron", .tp = 1, .pp = 2, .dp = 1, .vpp = 2};
  auto s0 = MakePresetLayout(m.config, m.inv, par, 0);
  auto s1 = MakePresetLayout(m.config, m.inv, par, 1);
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << s1.status();
  const LocalTensor* n = FindLocal(*s0, "model1.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(s0->layout.pieces[n->first_piece].tensor, *idx.Find("model.layers.5.input_layernorm.weight"));
  EXPECT_NE(FindLocal(*s0, "model0.embedding.word_embeddings.weight"), nullptr);
  EXPECT_EQ(FindLocal(*s0, "model1.output_layer.weight"), nullptr);
  EXPECT_NE(FindLocal(*s1, "model1.output_layer.weight"), nullptr);
  EXPECT_NE(FindLocal(*s1, "model1.decoder.final_layernorm.weight"), nullptr);
  EXPECT_EQ(FindLocal(*s1, "model0.decoder.final_layernorm.weight"), nullptr);
  // Without vpp the names are unprefixed and a custom split moves layers.
  auto u = MakePresetLayout(m.config, m.inv, {.preset = "megatron", .pp = 2, .first_stage_layers = 3}, 1);
  ASSERT_TRUE(u.ok()) << u.status();
  const LocalTensor* u0 = FindLocal(*u, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight");
  ASSERT_NE(u0, nullptr);
  EXPECT_EQ(u->layout.pieces[u0->first_piece].tensor, *idx.Find("model.layers.3.input_layernorm.weight"));
  EXPECT_EQ(FindLocal(*u, "decoder.layers.5.self_attention.linear_qkv.layer_norm_weight"), nullptr);
}

// A model is not one dtype: the router's e_score_correction_bias stays float32 in bf16 models,
// in the inventory and in every engine's local tensor.
TEST(Presets, RouterBiasIsFloat32) {
  Model m = Load("deepseek-v3.json", 4);
  TensorIndex idx(m.inv);
  const auto bias = idx.Find("model.layers.3.mlp.gate.e_score_correction_bias");
  ASSERT_TRUE(bias.has_value());
  EXPECT_EQ(m.inv.tensors[*bias].dtype, DType::kF32);
  EXPECT_EQ(m.inv.tensors[*idx.Find("model.layers.3.mlp.gate.weight")].dtype, DType::kBF16);
  auto v = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 8, .expert_parallel = true}, 3);
  ASSERT_TRUE(v.ok()) << v.status();
  const LocalTensor* vb = FindLocal(*v, "model.layers.3.mlp.gate.e_score_correction_bias");
  ASSERT_NE(vb, nullptr);
  EXPECT_EQ(vb->dtype, DType::kF32);
  EXPECT_TRUE(ValidateLayout(m.inv, v->layout, Role::kRollout).ok());
  auto g = MakePresetLayout(m.config, m.inv, {.preset = "megatron", .tp = 1, .pp = 1, .dp = 8, .ep = 8, .etp = 1}, 0);
  ASSERT_TRUE(g.ok()) << g.status();
  const LocalTensor* gb = FindLocal(*g, "decoder.layers.3.mlp.router.expert_bias");
  ASSERT_NE(gb, nullptr);
  EXPECT_EQ(gb->dtype, DType::kF32);
  auto f = MakePresetLayout(m.config, m.inv, {.preset = "fsdp", .dp = 4}, 1);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(FindLocal(*f, "model.layers.3.mlp.gate.e_score_correction_bias")->dtype, DType::kF32);
}

// SGLang's DeepSeek names the fused q_a + kv_a projection fused_qkv_a_proj_with_mqa (vLLM:
// fused_qkv_a_proj); without q_lora_rank both keep q_proj + kv_a_proj_with_mqa.
TEST(Presets, SglangDeepseekNames) {
  Model m = Load("deepseek-v3.json", 1);
  auto s = MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 8}, 0);
  auto v = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 8}, 0);
  ASSERT_TRUE(s.ok() && v.ok());
  EXPECT_NE(FindLocal(*s, "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"), nullptr);
  EXPECT_EQ(FindLocal(*s, "model.layers.0.self_attn.fused_qkv_a_proj.weight"), nullptr);
  EXPECT_NE(FindLocal(*v, "model.layers.0.self_attn.fused_qkv_a_proj.weight"), nullptr);
}

// Llama mlp_bias: the biases move (vLLM gate_up_proj.bias split with the weight, down_proj.bias
// whole on every rank; Megatron linear_fc1.bias / linear_fc2.bias). GPT-OSS: FSDP only, other
// presets refused naming the architecture. Gemma's extra norms in vLLM.
TEST(Presets, BiasesNormsAndRefusals) {
  Model m = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":1,"num_attention_heads":8,"num_key_value_heads":4,"vocab_size":1000,"mlp_bias":true})");
  TensorIndex idx(m.inv);
  auto v = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 2}, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  const LocalTensor* gub = FindLocal(*v, "model.layers.0.mlp.gate_up_proj.bias");
  ASSERT_NE(gub, nullptr);
  EXPECT_EQ(gub->shape, (std::vector<int64_t>{128}));
  EXPECT_EQ(CanonicalAt(m.inv, *v, *gub, 0), std::make_pair(*idx.Find("model.layers.0.mlp.gate_proj.bias"), int64_t{64}));
  EXPECT_EQ(CanonicalAt(m.inv, *v, *gub, 64), std::make_pair(*idx.Find("model.layers.0.mlp.up_proj.bias"), int64_t{64}));
  const LocalTensor* db = FindLocal(*v, "model.layers.0.mlp.down_proj.bias");
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->shape, (std::vector<int64_t>{64}));
  // Megatron's add_bias_linear gives linear_proj and linear_fc1/fc2 biases together: mlp_bias alone
  // (or attention_bias alone) has no Megatron model; both together do. SGLang's LlamaMLP has no
  // biases at all.
  for (const char* preset : {"megatron", "sglang"}) {
    absl::Status s = MakePresetLayout(m.config, m.inv, {.preset = preset, .tp = 2}, 0).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << preset;
    EXPECT_NE(s.message().find("mlp_bias"), std::string::npos) << s;
  }
  Model both = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":1,"num_attention_heads":8,"num_key_value_heads":4,"vocab_size":1000,"mlp_bias":true,"attention_bias":true})");
  auto g = MakePresetLayout(both.config, both.inv, {.preset = "megatron", .tp = 2}, 0);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_NE(FindLocal(*g, "decoder.layers.0.mlp.linear_fc1.bias"), nullptr);
  EXPECT_NE(FindLocal(*g, "decoder.layers.0.mlp.linear_fc2.bias"), nullptr);
  EXPECT_NE(FindLocal(*g, "decoder.layers.0.self_attention.linear_proj.bias"), nullptr);
  Model attn = FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":1,"num_attention_heads":8,"num_key_value_heads":4,"vocab_size":1000,"attention_bias":true})");
  EXPECT_EQ(MakePresetLayout(attn.config, attn.inv, {.preset = "megatron", .tp = 2}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MakePresetLayout(attn.config, attn.inv, {.preset = "sglang", .tp = 2}, 0).ok());

  Model oss = Load("gpt-oss-20b.json", 2);
  for (const char* preset : {"sglang", "megatron"}) {
    auto r = MakePresetLayout(oss.config, oss.inv, {.preset = preset}, 0);
    ASSERT_FALSE(r.ok()) << preset;
    EXPECT_NE(r.status().message().find("GptOssForCausalLM"), std::string::npos) << r.status();
  }
  auto f = MakePresetLayout(oss.config, oss.inv, {.preset = "fsdp", .dp = 8}, 7);
  ASSERT_TRUE(f.ok()) << f.status();
  const LocalTensor* gu = FindLocal(*f, "model.layers.1.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->shape, (std::vector<int64_t>{4, 2880, 5760}));  // 32 experts over 8 ranks, dim 0
  const LocalTensor* sinks = FindLocal(*f, "model.layers.1.self_attn.sinks");
  ASSERT_NE(sinks, nullptr);
  EXPECT_EQ(sinks->shape, (std::vector<int64_t>{8}));

  Model gem = Load("gemma-2-9b.json", 2);
  auto gv = MakePresetLayout(gem.config, gem.inv, {.preset = "vllm", .tp = 8}, 0);
  ASSERT_TRUE(gv.ok()) << gv.status();
  EXPECT_NE(FindLocal(*gv, "model.layers.1.pre_feedforward_layernorm.weight"), nullptr);
  EXPECT_NE(FindLocal(*gv, "model.layers.1.post_feedforward_layernorm.weight"), nullptr);
  EXPECT_EQ(FindLocal(*gv, "lm_head.weight"), nullptr);  // tied
  // vLLM's and SGLang's Gemma compute logits from embed_tokens (vLLM asserts tied embeddings): an
  // untied Gemma is refused there; FSDP2 holds its lm_head.
  Model untied = FromText(R"({"architectures":["Gemma2ForCausalLM"],"hidden_size":64,"intermediate_size":128,"head_dim":16,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000,"tie_word_embeddings":false})");
  for (const char* preset : {"vllm", "sglang"}) {
    absl::Status us = MakePresetLayout(untied.config, untied.inv, {.preset = preset}, 0).status();
    EXPECT_EQ(us.code(), absl::StatusCode::kInvalidArgument) << us;
    EXPECT_NE(us.message().find("tie_word_embeddings"), std::string::npos) << us;
  }
  EXPECT_TRUE(MakePresetLayout(untied.config, untied.inv, {.preset = "fsdp"}, 0).ok());
  // vLLM's Qwen3 o_proj has no bias: attention_bias (q/k/v/o in HF) is refused there, not SGLang.
  Model qb = FromText(R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"intermediate_size":128,"head_dim":16,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000,"attention_bias":true})");
  absl::Status qs = MakePresetLayout(qb.config, qb.inv, {.preset = "vllm"}, 0).status();
  EXPECT_EQ(qs.code(), absl::StatusCode::kInvalidArgument) << qs;
  EXPECT_NE(qs.message().find("attention_bias"), std::string::npos) << qs;
  EXPECT_TRUE(MakePresetLayout(qb.config, qb.inv, {.preset = "sglang"}, 0).ok());
  // vLLM's GPT-OSS always builds q/k/v/o biases: attention_bias false is refused (it used to read
  // the missing bias tensors out of bounds).
  Model nob = FromText(R"({"architectures":["GptOssForCausalLM"],"hidden_size":64,"intermediate_size":64,"head_dim":16,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1000,"num_local_experts":4,
    "num_experts_per_tok":2,"attention_bias":false})");
  absl::Status os = MakePresetLayout(nob.config, nob.inv, {.preset = "vllm"}, 0).status();
  EXPECT_EQ(os.code(), absl::StatusCode::kInvalidArgument) << os;
  EXPECT_NE(os.message().find("attention_bias"), std::string::npos) << os;
  EXPECT_TRUE(MakePresetLayout(nob.config, nob.inv, {.preset = "fsdp"}, 0).ok());
  // SGLang's Qwen MoE layers are all sparse: a config with dense layers is refused there.
  Model dense = FromText(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,"head_dim":16,
    "moe_intermediate_size":32,"num_experts":4,"num_experts_per_tok":2,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"mlp_only_layers":[0]})");
  EXPECT_TRUE(MakePresetLayout(dense.config, dense.inv, {.preset = "vllm"}, 0).ok());
  absl::Status ds = MakePresetLayout(dense.config, dense.inv, {.preset = "sglang"}, 0).status();
  EXPECT_EQ(ds.code(), absl::StatusCode::kInvalidArgument) << ds;
  EXPECT_NE(ds.message().find("mlp_only_layers"), std::string::npos) << ds;
}

// vLLM's GPT-OSS (gpt_oss.py, bf16): attn.* names, sinks by heads, FusedMoE w13/w2 transposed from
// HF's [E, H, 2I] / [E, I, H] with gate/up kept interleaved, w2_bias on flat rank 0 only.
TEST(Presets, VllmGptOss) {
  Model m = Load("gpt-oss-20b.json", 2);  // 32 experts, I = H = 2880, 64 heads, 8 KV heads
  TensorIndex idx(m.inv);
  for (ParallelConfig par : {ParallelConfig{.preset = "vllm", .tp = 4},
                             ParallelConfig{.preset = "vllm", .tp = 2, .dp = 2, .expert_parallel = true}}) {
    auto b = PresetBuilder::Create(m.config, m.inv, par);
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<PresetLayout> ranks;
    for (int r = 0; r < b->world_size(); ++r) {
      auto l = b->Make(r);
      ASSERT_TRUE(l.ok()) << l.status();
      ASSERT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout).ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout);
      ranks.push_back(std::move(*l));
    }
    const PresetLayout& r1 = ranks[1];
    EXPECT_NE(FindLocal(r1, "model.embedding.weight"), nullptr);
    EXPECT_NE(FindLocal(r1, "model.layers.1.attn.qkv_proj.bias"), nullptr);
    const LocalTensor* sinks = FindLocal(r1, "model.layers.1.attn.sinks");
    ASSERT_NE(sinks, nullptr);
    EXPECT_EQ(sinks->shape, (std::vector<int64_t>{64 / par.tp}));
    const LocalTensor* w13 = FindLocal(r1, "model.layers.0.mlp.experts.w13_weight");
    ASSERT_NE(w13, nullptr);
    const int32_t gu = *idx.Find("model.layers.0.mlp.experts.gate_up_proj");
    if (!par.expert_parallel) {
      EXPECT_EQ(w13->shape, (std::vector<int64_t>{32, 2 * 720, 2880}));
      // local (e=3, row=5, h=7) = gate_up_proj[3, 7, 2*720*1 + 5]
      EXPECT_EQ(CanonicalAt(m.inv, r1, *w13, (3 * 1440 + 5) * 2880 + 7),
                std::make_pair(gu, int64_t{(3 * 2880 + 7) * 5760 + 1440 + 5}));
      const LocalTensor* w2 = FindLocal(r1, "model.layers.0.mlp.experts.w2_weight");
      ASSERT_NE(w2, nullptr);
      EXPECT_EQ(w2->shape, (std::vector<int64_t>{32, 2880, 720}));
      // local (e=1, h=2, i=3) = down_proj[1, 720 + 3, 2]
      EXPECT_EQ(CanonicalAt(m.inv, r1, *w2, (1 * 2880 + 2) * 720 + 3),
                std::make_pair(*idx.Find("model.layers.0.mlp.experts.down_proj"), int64_t{(1 * 2880 + 723) * 2880 + 2}));
      EXPECT_EQ(FindLocal(r1, "model.layers.0.mlp.experts.w2_bias")->num_pieces, 0);  // zeros off rank 0
      EXPECT_EQ(FindLocal(ranks[0], "model.layers.0.mlp.experts.w2_bias")->num_pieces, 1);
    } else {
      EXPECT_EQ(w13->shape, (std::vector<int64_t>{8, 5760, 2880}));
      EXPECT_EQ(r1.layout.pieces[w13->first_piece].box.begin[0], 8);
    }
    // Every canonical element lands once per engine (experts, sinks, biases) or tp*dp times
    // (replicated norms, router, o_proj.bias).
    std::vector<int64_t> counts = CoverageCounts(m.inv, ranks);
    for (size_t t = 0; t < m.inv.tensors.size(); ++t) {
      const std::string& n = m.inv.tensors[t].name;
      const bool repl = absl::EndsWith(n, "norm.weight") || absl::StrContains(n, "router") || absl::EndsWith(n, "o_proj.bias");
      const bool kv = absl::StrContains(n, "k_proj") || absl::StrContains(n, "v_proj");
      int64_t want = repl ? int64_t{par.tp} * par.dp : (absl::StrContains(n, ".experts.") ? 1 : par.dp);
      if (kv && par.tp > 8) want = par.dp * par.tp / 8;
      EXPECT_EQ(counts[t], want) << n;
    }
  }
  EXPECT_FALSE(MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 2, .dp = 3, .expert_parallel = true}, 0).ok());
}

TEST(Presets, ClearErrors) {
  Model moe = Load("qwen3-30b-a3b.json", 1);  // 32 heads, 4 KV heads
  auto bad = MakePresetLayout(moe.config, moe.inv, {.preset = "megatron", .tp = 8}, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("num_key_value_heads"), std::string::npos) << bad.status();
  EXPECT_TRUE(MakePresetLayout(moe.config, moe.inv, {.preset = "vllm", .tp = 8}, 0).ok());  // vLLM replicates
  Model m = Load("qwen2.5-7b.json", 2);
  EXPECT_FALSE(MakePresetLayout(m.config, m.inv, {.preset = "deepspeed"}, 0).ok());
  EXPECT_FALSE(MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 2}, 2).ok());  // rank outside
  EXPECT_FALSE(PresetWorldSize({.preset = "vllm", .tp = 0}).ok());
  EXPECT_EQ(*PresetWorldSize({.preset = "megatron", .tp = 8, .pp = 8, .dp = 4, .ep = 32}), 256);
  EXPECT_EQ(*PresetWorldSize({.preset = "sglang", .tp = 16, .replicas = 8}), 128);
  EXPECT_EQ(*PresetWorldSize({.preset = "vllm", .tp = 8, .dp = 4, .replicas = 2}), 64);
  // Sizes from a request: an overflowing product is refused, not wrapped.
  EXPECT_FALSE(PresetWorldSize({.preset = "megatron", .tp = 65536, .pp = 65536, .dp = 65536}).ok());
  EXPECT_FALSE(PresetWorldSize({.preset = "vllm", .tp = 1 << 30, .replicas = 4}).ok());
}

// Fused MoE experts' block scales are shaped as vLLM holds them after loading ([E, row blocks,
// column blocks]: w13 = each expert's gate blocks then its up blocks), not flat; Qwen3-30B-A3B
// (128 experts, hidden 2048, moe_intermediate 768) fp8_block128 at tp = 2.
TEST(Presets, QuantizedMoeScalesAreShapedPerExpert) {
  Model m = Load("qwen3-30b-a3b.json", 1);
  ParallelConfig par{.preset = "vllm", .tp = 2};
  par.quantization = "fp8_block128";
  auto l = MakePresetLayout(m.config, m.inv, par, /*rank=*/1);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_TRUE(ValidateLayout(m.inv, l->layout, Role::kRollout, "r").ok()) << ValidateLayout(m.inv, l->layout, Role::kRollout, "r");
  const LocalTensor* w13 = FindLocal(*l, "model.layers.0.mlp.experts.w13_weight_scale_inv");
  const LocalTensor* w2 = FindLocal(*l, "model.layers.0.mlp.experts.w2_weight_scale_inv");
  ASSERT_NE(w13, nullptr);
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w13->shape, (std::vector<int64_t>{128, 6, 16}));  // 2 x ceil(384 / 128) rows, 2048 / 128 columns
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{128, 16, 3}));
  // Expert 5's up_proj scales start at [5, 3, 0]: the pieces' scale offsets follow that order.
  const auto up5 = *TensorIndex(m.inv).Find("model.layers.0.mlp.experts.5.up_proj.weight");
  bool found = false;
  for (int32_t k = 0; k < static_cast<int32_t>(l->layout.pieces.size()); ++k) {
    const Piece& p = l->layout.pieces[k];
    if (p.tensor != up5) continue;
    found = true;
    EXPECT_EQ(p.quant->scale_offset_bytes, w13->offset_bytes + ((5 * 6 + 3) * 16) * 4);
  }
  EXPECT_TRUE(found);
}

// ---- DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 plus the DSA lightning indexer ----

// A small DeepSeek-V3.2: 2 layers (layer 1 MoE), 8 heads, 8 experts, q_lora 24, indexer 4 heads of 16.
const char* kSmallV32Fields = R"("hidden_size":64,"intermediate_size":128,"moe_intermediate_size":32,
    "num_hidden_layers":2,"num_attention_heads":8,"vocab_size":1000,"n_routed_experts":8,"n_shared_experts":1,
    "first_k_dense_replace":1,"q_lora_rank":24,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":4,
    "v_head_dim":8,"index_n_heads":4,"index_head_dim":16,"index_topk":32)";

Model SmallV32(const std::string& arch = "DeepseekV32ForCausalLM") {
  return FromText(std::string(R"({"architectures":[")") + arch + "\"]," + kSmallV32Fields + "}");
}

// Independent transcription of the indexer tensors each engine rank holds (whole on every rank,
// replicated, whatever tp / dp / expert parallelism): vLLM models/deepseek_v2.py class Indexer -
// wq_b ReplicatedLinear; wk_weights_proj = MergedColumnParallelLinear(hidden, [index_head_dim,
// index_n_heads], disable_tp=True) loaded from wk (shard 0) and weights_proj (shard 1); k_norm
// LayerNorm with float32 weight and bias (layers/layernorm.py). SGLang
// layers/attention/nsa/nsa_indexer.py class Indexer - wq_b, wk, weights_proj ReplicatedLinear under
// the checkpoint names; k_norm LayerNorm(dtype=torch.float32). Returns the canonical (name, flat).
std::pair<std::string, int64_t> IndexerHolds(const ModelConfig& c, bool sglang, const std::string& local, int64_t i) {
  const std::string fused = ".indexer.wk_weights_proj.weight";
  if (!sglang && absl::EndsWith(local, fused)) {
    const std::string x = local.substr(0, local.size() - std::string("wk_weights_proj.weight").size());
    const int64_t row = i / c.hidden, col = i % c.hidden;
    if (row < c.index_head_dim) return {x + "wk.weight", row * c.hidden + col};
    return {x + "weights_proj.weight", (row - c.index_head_dim) * c.hidden + col};
  }
  return {local, i};
}

void ExpectV32EngineLayout(const Model& v32, const Model& v3, const ParallelConfig& par) {
  SCOPED_TRACE(par.preset + " tp=" + std::to_string(par.tp) + " dp=" + std::to_string(par.dp) +
               (par.expert_parallel ? " ep" : ""));
  const bool sglang = par.preset == "sglang";
  auto b32 = PresetBuilder::Create(v32.config, v32.inv, par);
  auto b3 = PresetBuilder::Create(v3.config, v3.inv, par);
  ASSERT_TRUE(b32.ok()) << b32.status();
  ASSERT_TRUE(b3.ok()) << b3.status();
  ASSERT_EQ(b32->world_size(), b3->world_size());
  TensorIndex i32(v32.inv), i3(v3.inv);
  for (int r = 0; r < b32->world_size(); ++r) {
    auto l32 = b32->Make(r);
    auto l3 = b3->Make(r);
    ASSERT_TRUE(l32.ok()) << l32.status();
    ASSERT_TRUE(l3.ok()) << l3.status();
    // Everything but the indexer is DeepSeek-V3's layout: the same local tensors, shapes, dtypes
    // and, element by element, the same canonical elements.
    std::set<std::string> indexer_names;
    for (const LocalTensor& lt : l32->local_tensors) {
      if (!absl::StrContains(lt.name, ".indexer.")) continue;
      indexer_names.insert(lt.name.substr(lt.name.find(".indexer.")));
      for (int64_t e = 0; e < Numel(lt.shape); ++e) {
        const auto [want, flat] = IndexerHolds(v32.config, sglang, lt.name, e);
        ASSERT_TRUE(i32.Find(want).has_value()) << want;
        ASSERT_EQ(CanonicalAt(v32.inv, *l32, lt, e), std::make_pair(*i32.Find(want), flat)) << lt.name << " rank " << r << " element " << e;
      }
      const bool f32 = absl::StrContains(lt.name, "k_norm");
      EXPECT_EQ(lt.dtype, f32 ? DType::kF32 : DType::kBF16) << lt.name;
      const int64_t H = v32.config.hidden, D = v32.config.index_head_dim, N = v32.config.index_n_heads;
      std::vector<int64_t> want_shape;
      if (absl::EndsWith(lt.name, "wq_b.weight")) want_shape = {N * D, v32.config.q_lora_rank};
      if (absl::EndsWith(lt.name, "wk_weights_proj.weight")) want_shape = {D + N, H};
      if (absl::EndsWith(lt.name, ".wk.weight")) want_shape = {D, H};
      if (absl::EndsWith(lt.name, "weights_proj.weight") && !absl::EndsWith(lt.name, "wk_weights_proj.weight")) want_shape = {N, H};
      if (absl::StrContains(lt.name, "k_norm")) want_shape = {D};
      EXPECT_EQ(lt.shape, want_shape) << lt.name;
    }
    const std::set<std::string> want_names =
        sglang ? std::set<std::string>{".indexer.wq_b.weight", ".indexer.wk.weight", ".indexer.weights_proj.weight",
                                       ".indexer.k_norm.weight", ".indexer.k_norm.bias"}
               : std::set<std::string>{".indexer.wq_b.weight", ".indexer.wk_weights_proj.weight",
                                       ".indexer.k_norm.weight", ".indexer.k_norm.bias"};
    EXPECT_EQ(indexer_names, want_names) << "rank " << r;
    std::vector<const LocalTensor*> rest;
    for (const LocalTensor& lt : l32->local_tensors) {
      if (!absl::StrContains(lt.name, ".indexer.")) rest.push_back(&lt);
    }
    ASSERT_EQ(rest.size(), l3->local_tensors.size()) << "rank " << r;
    for (size_t k = 0; k < rest.size(); ++k) {
      const LocalTensor& a = *rest[k];
      const LocalTensor& w = l3->local_tensors[k];
      ASSERT_EQ(a.name, w.name);
      ASSERT_EQ(a.shape, w.shape) << a.name;
      ASSERT_EQ(a.dtype, w.dtype) << a.name;
      for (int64_t e = 0; e < Numel(a.shape); ++e) {
        const auto got = CanonicalAt(v32.inv, *l32, a, e);
        const auto want = CanonicalAt(v3.inv, *l3, w, e);
        if (want.first < 0) {
          ASSERT_EQ(got.first, -1) << a.name << " element " << e;
          continue;
        }
        ASSERT_GE(got.first, 0) << a.name << " element " << e;
        ASSERT_EQ(v32.inv.tensors[got.first].name, v3.inv.tensors[want.first].name) << a.name << " element " << e;
        ASSERT_EQ(got.second, want.second) << a.name << " element " << e;
      }
    }
  }
}

TEST(Presets, DeepseekV32IndexerWholeOnEveryEngineRank) {
  Model v32 = SmallV32();
  Model v3 = SmallV32("DeepseekV3ForCausalLM");  // the same fields: DeepseekV3 ignores the index_* ones
  ASSERT_EQ(v32.inv.tensors.size(), v3.inv.tensors.size() + 2 * 5);
  for (const char* preset : {"vllm", "sglang"}) {
    for (int tp : {1, 2, 4, 8}) {
      for (bool ep : {false, true}) ExpectV32EngineLayout(v32, v3, {.preset = preset, .tp = tp, .expert_parallel = ep});
    }
    // Engine data parallelism (experts over dp*tp; vLLM's sequence-parallel shared experts) and replicas.
    ExpectV32EngineLayout(v32, v3, {.preset = preset, .tp = 2, .dp = 2, .expert_parallel = true});
    ExpectV32EngineLayout(v32, v3, {.preset = preset, .tp = 2, .replicas = 2});
  }
  // SGLang DP attention (--tp-size 4 --dp-size 2): the indexer stays whole on every rank.
  ExpectV32EngineLayout(v32, v3, {.preset = "sglang", .tp = 2, .dp = 2});
}

TEST(Presets, DeepseekV32OnTheRealConfig) {
  Model m = Load("deepseek-v3.2.json", 4);  // layer 3 is MoE
  TensorIndex idx(m.inv);
  auto v = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 8, .expert_parallel = true}, 5);
  auto s = MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 8}, 5);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string x = "model.layers.3.self_attn.indexer.";
  const LocalTensor* fused = FindLocal(*v, x + "wk_weights_proj.weight");
  ASSERT_NE(fused, nullptr);
  EXPECT_EQ(fused->shape, (std::vector<int64_t>{128 + 64, 7168}));
  EXPECT_EQ(CanonicalAt(m.inv, *v, *fused, 130 * 7168 + 9), std::make_pair(*idx.Find(x + "weights_proj.weight"), int64_t{2 * 7168 + 9}));
  EXPECT_EQ(FindLocal(*v, x + "wk.weight"), nullptr);
  EXPECT_EQ(FindLocal(*v, x + "wq_b.weight")->shape, (std::vector<int64_t>{64 * 128, 1536}));
  EXPECT_EQ(FindLocal(*v, x + "k_norm.bias")->dtype, DType::kF32);
  EXPECT_EQ(FindLocal(*s, x + "wk.weight")->shape, (std::vector<int64_t>{128, 7168}));
  EXPECT_EQ(FindLocal(*s, x + "weights_proj.weight")->shape, (std::vector<int64_t>{64, 7168}));
  EXPECT_EQ(FindLocal(*s, x + "k_norm.weight")->dtype, DType::kF32);
  // The rest is DeepSeek-V3's: q_b_proj rows by heads, experts 160..191 of 256 on EP rank 5.
  EXPECT_EQ(FindLocal(*v, "model.layers.3.self_attn.q_b_proj.weight")->shape, (std::vector<int64_t>{16 * 192, 1536}));
  EXPECT_EQ(FindLocal(*v, "model.layers.3.mlp.experts.w13_weight")->shape, (std::vector<int64_t>{32, 2 * 2048, 7168}));
  EXPECT_EQ(FindLocal(*s, "model.layers.3.self_attn.fused_qkv_a_proj_with_mqa.weight")->shape, (std::vector<int64_t>{1536 + 576, 7168}));
  // Trainer presets shard the indexer like any tensor: every element covered once (fsdp dp=3,
  // fsdp_flat dp=5), k_norm in float32.
  for (ParallelConfig par : {ParallelConfig{.preset = "fsdp", .dp = 3}, ParallelConfig{.preset = "fsdp_flat", .dp = 5}}) {
    auto b = PresetBuilder::Create(m.config, m.inv, par);
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<PresetLayout> ranks;
    for (int r = 0; r < b->world_size(); ++r) ranks.push_back(*b->Make(r));
    std::vector<int64_t> counts = CoverageCounts(m.inv, ranks);
    for (size_t t = 0; t < m.inv.tensors.size(); ++t) EXPECT_EQ(counts[t], 1) << par.preset << " " << m.inv.tensors[t].name;
    const LocalTensor* kn = FindLocal(ranks[0], x + "k_norm.weight");
    ASSERT_NE(kn, nullptr);
    EXPECT_EQ(kn->dtype, DType::kF32);
  }
}

TEST(Presets, DeepseekV32Refusals) {
  Model m = SmallV32();
  // Megatron: no verified mapping of the indexer.
  auto meg = PresetBuilder::Create(m.config, m.inv, {.preset = "megatron", .tp = 2});
  ASSERT_FALSE(meg.ok());
  EXPECT_NE(meg.status().message().find("DeepseekV32ForCausalLM"), std::string::npos) << meg.status();
  // Quantised rollout layouts: vLLM quantises wq_b but not wk_weights_proj; not described.
  auto q = PresetBuilder::Create(m.config, m.inv, {.preset = "vllm", .tp = 2, .quantization = "fp8_block128"});
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("DeepseekV32ForCausalLM"), std::string::npos) << q.status();
  // The DeepSeek-V3 constraints still hold: tp must divide the heads.
  auto heads = PresetBuilder::Create(m.config, m.inv, {.preset = "vllm", .tp = 16});
  ASSERT_FALSE(heads.ok());
  EXPECT_NE(heads.status().message().find("num_attention_heads"), std::string::npos) << heads.status();
}

// ---- MiniMax-M2 (MiniMaxM2ForCausalLM) on the rollout engines ----

// Independent transcription of what a vLLM / SGLang TP rank (dp 1) holds for MiniMax-M2, from the
// engines' sources: q_norm / k_norm - vLLM MiniMaxText01RMSNormTP (layers/mamba/linear_attn.py:
// weight [size / tp], weight_loader rows [tp_rank * size/tp, +size/tp)), SGLang MiniMaxM2RMSNormTP
// (models/minimax_m2.py: num_heads / tp heads, or one head on tp / KV ranks, shard tp_rank /
// replicas); block_sparse_moe.gate.weight and block_sparse_moe.e_score_correction_bias whole
// (ReplicatedLinear, a float32 Parameter on the MoE block); experts FusedMoE: w13_weight
// [E_local, 2 I/n, H] per expert [w1 rows; w3 rows], w2_weight [E_local, H, I/n] (n = tp without
// EP; with EP whole experts, E/tp from tp_rank * E/tp). Everything else via EngineHolds.
std::pair<std::string, int64_t> EngineHolds(const ModelConfig& c, int64_t tp, int64_t r, const std::string& local,
                                            const std::vector<int64_t>& shape, int64_t i);  // below (Phi-3 / OLMo-2)

std::pair<std::string, int64_t> MiniMaxHolds(const ModelConfig& c, bool sglang, bool ep, int64_t tp, int64_t r,
                                             const std::string& local, const std::vector<int64_t>& shape, int64_t i) {
  const int64_t d = c.head_dim, H = c.hidden;
  const std::string layer = local.substr(0, local.find(".", local.find("layers.") + 7));
  if (absl::EndsWith(local, "self_attn.q_norm.weight")) {
    const int64_t per = c.heads * d / tp;
    return {local, r * per + i};
  }
  if (absl::EndsWith(local, "self_attn.k_norm.weight")) {
    if (!sglang || tp <= c.kv_heads) {
      const int64_t per = c.kv_heads * d / tp;
      return {local, r * per + i};
    }
    const int64_t replicas = tp / c.kv_heads;
    return {local, (r / replicas) * d + i};
  }
  if (absl::StrContains(local, "block_sparse_moe.experts.w")) {
    const int64_t E = c.experts, I = c.intermediate;
    const int64_t e_local = ep ? E / tp : E, n = ep ? 1 : tp, part = ep ? 0 : r;
    const int64_t e0 = ep ? r * (E / tp) : 0;
    const int64_t per_expert = shape[1] * shape[2];
    const int64_t e = e0 + i / per_expert, rest = i % per_expert;
    EXPECT_LT(i / per_expert, e_local);
    const std::string x = absl::StrCat(layer, ".block_sparse_moe.experts.", e, ".");
    const int64_t w = I / n;
    if (absl::EndsWith(local, "w13_weight")) {
      const int64_t row = rest / H, col = rest % H;
      if (row < w) return {x + "w1.weight", (part * w + row) * H + col};
      return {x + "w3.weight", (part * w + row - w) * H + col};
    }
    const int64_t h = rest / w, col = rest % w;
    return {x + "w2.weight", h * I + part * w + col};
  }
  if (absl::StrContains(local, "block_sparse_moe.")) return {local, i};  // gate, e_score_correction_bias
  return EngineHolds(c, tp, r, local, shape, i);
}

void ExpectMiniMaxLayout(const Model& m, const ParallelConfig& par) {
  SCOPED_TRACE(par.preset + " tp=" + std::to_string(par.tp) + (par.expert_parallel ? " ep" : ""));
  const bool sglang = par.preset == "sglang";
  auto b = PresetBuilder::Create(m.config, m.inv, par);
  ASSERT_TRUE(b.ok()) << b.status();
  TensorIndex idx(m.inv);
  for (int r = 0; r < b->world_size(); ++r) {
    auto l = b->Make(r);
    ASSERT_TRUE(l.ok()) << l.status();
    std::set<std::string> names;
    for (const LocalTensor& lt : l->local_tensors) {
      names.insert(lt.name);
      const bool f32 = absl::EndsWith(lt.name, "e_score_correction_bias");
      EXPECT_EQ(lt.dtype, f32 ? DType::kF32 : DType::kBF16) << lt.name;
      for (int64_t e = 0; e < Numel(lt.shape); ++e) {
        const auto [want_name, want_flat] = MiniMaxHolds(m.config, sglang, par.expert_parallel, par.tp, r % par.tp, lt.name, lt.shape, e);
        const auto got = CanonicalAt(m.inv, *l, lt, e);
        if (want_name.empty()) {
          ASSERT_EQ(got.first, -1) << lt.name << " rank " << r << " element " << e << " (padding)";
          continue;
        }
        ASSERT_TRUE(idx.Find(want_name).has_value()) << want_name;
        ASSERT_EQ(got, std::make_pair(*idx.Find(want_name), want_flat)) << lt.name << " rank " << r << " element " << e;
      }
    }
    const std::string l0 = "model.layers.0.";
    const std::set<std::string> want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                        l0 + "input_layernorm.weight", l0 + "post_attention_layernorm.weight",
                                        l0 + "self_attn.qkv_proj.weight", l0 + "self_attn.o_proj.weight",
                                        l0 + "self_attn.q_norm.weight", l0 + "self_attn.k_norm.weight",
                                        l0 + "block_sparse_moe.gate.weight", l0 + "block_sparse_moe.e_score_correction_bias",
                                        l0 + "block_sparse_moe.experts.w13_weight", l0 + "block_sparse_moe.experts.w2_weight"};
    ASSERT_EQ(names, want) << "rank " << r;
  }
}

const char* kSmallMiniMax = R"({"architectures":["MiniMaxM2ForCausalLM"],"hidden_size":64,"intermediate_size":32,
    "num_attention_heads":8,"num_key_value_heads":4,"head_dim":16,"num_hidden_layers":1,"vocab_size":1000,
    "num_local_experts":8,"num_experts_per_tok":2,"use_qk_norm":true,"qk_norm_type":"per_layer",
    "use_routing_bias":true,"scoring_func":"sigmoid","rotary_dim":8,"shared_intermediate_size":0})";

TEST(Presets, MiniMaxM2EveryElementOfEveryEngineRank) {
  Model m = FromText(kSmallMiniMax);
  for (bool ep : {false, true}) {
    for (int tp : {1, 2, 4}) {
      ExpectMiniMaxLayout(m, {.preset = "vllm", .tp = tp, .expert_parallel = ep});
      ExpectMiniMaxLayout(m, {.preset = "sglang", .tp = tp, .expert_parallel = ep});
    }
    // SGLang tp = 8 > 4 KV heads: each k head (and its k_norm part) on two ranks.
    ExpectMiniMaxLayout(m, {.preset = "sglang", .tp = 8, .expert_parallel = ep});
  }
}

TEST(Presets, MiniMaxM2OnTheRealConfig) {
  Model m = Load("minimax-m2.json", 1);
  auto v = MakePresetLayout(m.config, m.inv, {.preset = "vllm", .tp = 8, .expert_parallel = true}, 3);
  auto s = MakePresetLayout(m.config, m.inv, {.preset = "sglang", .tp = 4}, 3);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string l0 = "model.layers.0.";
  // 48 heads, 8 KV heads, head_dim 128, hidden 3072; 256 experts of 1536.
  EXPECT_EQ(FindLocal(*v, l0 + "self_attn.qkv_proj.weight")->shape, (std::vector<int64_t>{(6 + 2) * 128, 3072}));
  EXPECT_EQ(FindLocal(*v, l0 + "self_attn.q_norm.weight")->shape, (std::vector<int64_t>{6 * 128}));
  EXPECT_EQ(FindLocal(*v, l0 + "self_attn.k_norm.weight")->shape, (std::vector<int64_t>{128}));
  EXPECT_EQ(FindLocal(*v, l0 + "block_sparse_moe.experts.w13_weight")->shape, (std::vector<int64_t>{32, 2 * 1536, 3072}));
  EXPECT_EQ(FindLocal(*v, l0 + "block_sparse_moe.e_score_correction_bias")->dtype, DType::kF32);
  EXPECT_EQ(FindLocal(*s, l0 + "self_attn.k_norm.weight")->shape, (std::vector<int64_t>{2 * 128}));
  EXPECT_EQ(FindLocal(*s, l0 + "block_sparse_moe.experts.w2_weight")->shape, (std::vector<int64_t>{256, 3072, 1536 / 4}));
  EXPECT_EQ(FindLocal(*s, l0 + "block_sparse_moe.gate.weight")->shape, (std::vector<int64_t>{256, 3072}));
  for (ParallelConfig par : {ParallelConfig{.preset = "fsdp", .dp = 3}, ParallelConfig{.preset = "fsdp_flat", .dp = 5}}) {
    auto b = PresetBuilder::Create(m.config, m.inv, par);
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<PresetLayout> ranks;
    for (int r = 0; r < b->world_size(); ++r) ranks.push_back(*b->Make(r));
    std::vector<int64_t> counts = CoverageCounts(m.inv, ranks);
    for (size_t t = 0; t < m.inv.tensors.size(); ++t) EXPECT_EQ(counts[t], 1) << par.preset << " " << m.inv.tensors[t].name;
  }
}

TEST(Presets, MiniMaxM2Refusals) {
  Model m = FromText(kSmallMiniMax);
  auto refused = [&](const ParallelConfig& par, const std::string& named) {
    auto b = PresetBuilder::Create(m.config, m.inv, par);
    ASSERT_FALSE(b.ok()) << par.preset;
    EXPECT_NE(b.status().message().find(named), std::string::npos) << b.status();
  };
  refused({.preset = "megatron", .tp = 2}, "MiniMaxM2ForCausalLM");
  refused({.preset = "vllm", .tp = 8}, "num_key_value_heads");  // k_norm rows would not be the rank's head
  refused({.preset = "sglang", .tp = 2, .dp = 2}, "DeepSeek");   // DP attention: DeepSeek only
  refused({.preset = "fsdp2_tp", .tp = 2, .dp = 2}, "MiniMaxM2ForCausalLM");
}

// ---- OLMo-2 / OLMo-3 and Phi-3 on the rollout engines ----

// Independent transcription of what each vLLM / SGLang TP rank holds for Phi-3 and OLMo-2/3: for
// local tensor `local` (its shape `shape`) of tp rank `r`, the canonical (tensor name, row-major
// flat index) at local element `i`, or {"", -1} for vocabulary padding. Follows the engines'
// sources, not planner/presets.cc: QKVParallelLinear (num_heads = H / tp, num_kv_heads =
// max(1, KV / tp), KV head replicas = tp / KV; a k/v shard's rank is tp_rank / replicas) loading
// Phi-3's fused qkv_proj by its on-disk offsets q [0, H*d), k [H*d, (H+KV)*d), v [(H+KV)*d, ...)
// (weight_loader with loaded_shard_id None); MergedColumnParallelLinear likewise [gate; up];
// RowParallelLinear column slices; VocabParallelEmbedding rows of the vocabulary padded to 64;
// OLMo-2's q_norm / k_norm and every norm whole (olmo2.py applies them to the all-gathered q / k).
std::pair<std::string, int64_t> EngineHolds(const ModelConfig& c, int64_t tp, int64_t r, const std::string& local,
                                            const std::vector<int64_t>& shape, int64_t i) {
  const int64_t H = c.hidden, d = c.head_dim, cols = shape.size() == 2 ? shape[1] : 1;
  const int64_t row = i / cols, col = i % cols;
  if (local == "model.embed_tokens.weight" || local == "lm_head.weight") {
    const int64_t per = ((c.vocab + 63) / 64 * 64) / tp, g = r * per + row;
    if (g >= c.vocab) return {"", -1};
    return {local, g * H + col};
  }
  if (!absl::StrContains(local, "_proj")) return {local, i};  // norms: whole on every rank
  const size_t dot = local.find(".self_attn.") != std::string::npos ? local.find(".self_attn.") : local.find(".mlp.");
  const std::string layer = local.substr(0, dot);
  const int64_t nq = c.heads / tp, nkv = std::max<int64_t>(1, c.kv_heads / tp);
  const int64_t replicas = std::max<int64_t>(1, tp / c.kv_heads), kv_rank = r / replicas;
  const bool bias = absl::EndsWith(local, ".bias");
  if (absl::StrContains(local, "qkv_proj")) {
    const std::string kind = bias ? "bias" : "weight";
    std::string shard;
    int64_t shard_row;
    if (row < nq * d) {
      shard = "q", shard_row = r * nq * d + row;
    } else if (row < (nq + nkv) * d) {
      shard = "k", shard_row = kv_rank * nkv * d + row - nq * d;
    } else {
      shard = "v", shard_row = kv_rank * nkv * d + row - (nq + nkv) * d;
    }
    if (c.fused_proj) {
      const int64_t base = shard == "q" ? 0 : shard == "k" ? c.heads * d : (c.heads + c.kv_heads) * d;
      return {layer + ".self_attn.qkv_proj.weight", (base + shard_row) * H + col};
    }
    return {layer + ".self_attn." + shard + "_proj." + kind, shard_row * cols + col};
  }
  if (absl::StrContains(local, "gate_up_proj")) {
    const int64_t n = c.intermediate / tp;
    const bool up = row >= n;
    const int64_t shard_row = r * n + (up ? row - n : row);
    if (c.fused_proj) return {layer + ".mlp.gate_up_proj.weight", ((up ? c.intermediate : 0) + shard_row) * H + col};
    return {layer + (up ? ".mlp.up_proj.weight" : ".mlp.gate_proj.weight"), shard_row * H + col};
  }
  if (bias) return {local, i};  // o_proj.bias: RowParallelLinear keeps it whole
  // o_proj / down_proj: RowParallelLinear, columns [r * in/tp, (r+1) * in/tp).
  const int64_t in = absl::StrContains(local, "o_proj") ? c.heads * d : c.intermediate;
  return {local, row * in + r * (in / tp) + col};
}

// Every element of every local tensor of every rank against EngineHolds, and the local names
// against the engines' parameters (OLMo-2: no input_layernorm; Phi-3: no q/k/v or gate/up parts).
void ExpectEngineLayout(const Model& m, const ParallelConfig& par) {
  SCOPED_TRACE(m.config.architecture + " " + par.preset + " tp=" + std::to_string(par.tp));
  auto b = PresetBuilder::Create(m.config, m.inv, par);
  ASSERT_TRUE(b.ok()) << b.status();
  TensorIndex idx(m.inv);
  for (int r = 0; r < b->world_size(); ++r) {
    auto l = b->Make(r);
    ASSERT_TRUE(l.ok()) << l.status();
    std::set<std::string> names;
    for (const LocalTensor& lt : l->local_tensors) {
      names.insert(lt.name);
      EXPECT_FALSE(absl::StrContains(lt.name, "input_layernorm") && m.config.post_norms) << lt.name;
      for (int64_t i = 0; i < Numel(lt.shape); ++i) {
        const auto [want_name, want_flat] = EngineHolds(m.config, par.tp, r % par.tp, lt.name, lt.shape, i);
        const auto got = CanonicalAt(m.inv, *l, lt, i);
        if (want_name.empty()) {
          ASSERT_EQ(got.first, -1) << lt.name << " rank " << r << " element " << i << " (padding)";
          continue;
        }
        ASSERT_TRUE(idx.Find(want_name).has_value()) << want_name;
        ASSERT_EQ(got, std::make_pair(*idx.Find(want_name), want_flat)) << lt.name << " rank " << r << " element " << i;
      }
    }
    const std::string l0 = "model.layers.0.";
    std::set<std::string> want = {"model.embed_tokens.weight", "model.norm.weight", l0 + "self_attn.qkv_proj.weight",
                                  l0 + "self_attn.o_proj.weight", l0 + "post_attention_layernorm.weight",
                                  l0 + "mlp.gate_up_proj.weight", l0 + "mlp.down_proj.weight"};
    if (!m.config.tie_word_embeddings) want.insert("lm_head.weight");
    if (m.config.post_norms) {
      want.insert({l0 + "self_attn.q_norm.weight", l0 + "self_attn.k_norm.weight", l0 + "post_feedforward_layernorm.weight"});
    } else {
      want.insert(l0 + "input_layernorm.weight");
    }
    if (m.config.qkv_bias) want.insert({l0 + "self_attn.qkv_proj.bias", l0 + "self_attn.o_proj.bias"});
    ASSERT_EQ(names, want) << "rank " << r;  // one-layer models
  }
}

TEST(Presets, Phi3FusedCheckpointOnVllmAndSglang) {
  // Phi-3 style, small: 8 heads, 4 KV heads (tp = 8 replicates each KV head on 2 ranks), head_dim 8.
  const std::string phi = R"({"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_key_value_heads":4,"num_hidden_layers":1,"vocab_size":1000)";
  for (const std::string& text : {phi + "}", phi + R"(,"tie_word_embeddings":true})"}) {
    Model m = FromText(text);
    for (const char* preset : {"vllm", "sglang"}) {
      for (int tp : {1, 2, 4, 8}) ExpectEngineLayout(m, {.preset = preset, .tp = tp});
    }
  }
  // MQA-like: 2 KV heads over 4 ranks, and a second replica (rank = replica * tp + tp_rank).
  Model gqa = FromText(R"({"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_key_value_heads":2,"num_hidden_layers":1,"vocab_size":1000})");
  ExpectEngineLayout(gqa, {.preset = "vllm", .tp = 4, .replicas = 2});
  ExpectEngineLayout(gqa, {.preset = "sglang", .tp = 4});
}

TEST(Presets, Olmo2FullWidthQkNormWholeOnEveryRank) {
  const std::string olmo = R"({"architectures":["Olmo2ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_hidden_layers":1,"vocab_size":1000)";
  for (const std::string& text : {olmo + R"(,"num_key_value_heads":8})", olmo + R"(,"num_key_value_heads":4})",
                                  olmo + R"(,"num_key_value_heads":4,"tie_word_embeddings":true})"}) {
    Model m = FromText(text);
    for (const char* preset : {"vllm", "sglang"}) {
      for (int tp : {1, 2, 4}) ExpectEngineLayout(m, {.preset = preset, .tp = tp});
    }
  }
  // OLMo-3 is served by the same classes (vLLM olmo2.py, SGLang's configs/olmo3.py -> Olmo2ForCausalLM).
  Model o3 = FromText(R"({"architectures":["Olmo3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_key_value_heads":8,"num_hidden_layers":1,"vocab_size":1000,"sliding_window":16})");
  ExpectEngineLayout(o3, {.preset = "vllm", .tp = 8});
  // SGLang's olmo2.py builds qkv_proj / o_proj with attention_bias: [q;k;v] bias slices, o_proj.bias whole.
  Model biased = FromText(olmo + R"(,"num_key_value_heads":4,"attention_bias":true})");
  ExpectEngineLayout(biased, {.preset = "sglang", .tp = 2});
}

TEST(Presets, Olmo2AndPhi3OnRealConfigs) {
  // OLMo-2 32B, vLLM tp = 8 (40 heads, 8 KV heads): q heads 5 per rank, one KV head, q_norm / k_norm whole.
  Model o = Load("olmo-2-0325-32b.json", 1);
  auto v = MakePresetLayout(o.config, o.inv, {.preset = "vllm", .tp = 8}, 3);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(FindLocal(*v, "model.layers.0.self_attn.qkv_proj.weight")->shape, (std::vector<int64_t>{(5 + 2) * 128, 5120}));
  EXPECT_EQ(FindLocal(*v, "model.layers.0.self_attn.q_norm.weight")->shape, (std::vector<int64_t>{5120}));
  EXPECT_EQ(FindLocal(*v, "model.layers.0.self_attn.k_norm.weight")->shape, (std::vector<int64_t>{1024}));
  EXPECT_EQ(FindLocal(*v, "model.layers.0.mlp.gate_up_proj.weight")->shape, (std::vector<int64_t>{2 * 3456, 5120}));
  EXPECT_EQ(FindLocal(*v, "model.embed_tokens.weight")->shape, (std::vector<int64_t>{12544, 5120}));
  EXPECT_EQ(FindLocal(*v, "model.layers.0.input_layernorm.weight"), nullptr);
  // phi-4 (40 heads, 10 KV heads) at tp = 2: rank 1 holds q rows 2560..5119, k rows 5120+640.., v rows 6400+640..
  Model p = Load("phi-4.json", 1);
  TensorIndex pidx(p.inv);
  auto pv = MakePresetLayout(p.config, p.inv, {.preset = "vllm", .tp = 2}, 1);
  ASSERT_TRUE(pv.ok()) << pv.status();
  const LocalTensor* qkv = FindLocal(*pv, "model.layers.0.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  ASSERT_EQ(qkv->shape, (std::vector<int64_t>{(20 + 10) * 128, 5120}));
  ASSERT_EQ(qkv->num_pieces, 3);
  const int32_t t = *pidx.Find("model.layers.0.self_attn.qkv_proj.weight");
  const int64_t H = 5120;
  EXPECT_EQ(CanonicalAt(p.inv, *pv, *qkv, 0), std::make_pair(t, int64_t{2560} * H));
  EXPECT_EQ(CanonicalAt(p.inv, *pv, *qkv, 2560 * H + 7), std::make_pair(t, (5120 + 640) * H + 7));
  EXPECT_EQ(CanonicalAt(p.inv, *pv, *qkv, 3200 * H), std::make_pair(t, int64_t{6400 + 640} * H));
  const LocalTensor* gu = FindLocal(*pv, "model.layers.0.mlp.gate_up_proj.weight");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->shape, (std::vector<int64_t>{17920, 5120}));
  const int32_t g = *pidx.Find("model.layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(CanonicalAt(p.inv, *pv, *gu, 0), std::make_pair(g, int64_t{8960} * H));
  EXPECT_EQ(CanonicalAt(p.inv, *pv, *gu, 8960 * H), std::make_pair(g, int64_t{17920 + 8960} * H));
  // phi-4 at tp = 4: 10 KV heads neither divide nor are divided by 4 -> refused, named.
  absl::Status s = MakePresetLayout(p.config, p.inv, {.preset = "vllm", .tp = 4}, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("num_key_value_heads"), std::string::npos) << s;
  // Phi-4-mini (tied, 24 heads, 8 KV heads) at tp = 4: no lm_head, 6 q heads + 2 KV heads per rank.
  Model mini = Load("phi-4-mini-instruct.json", 1);
  auto mv = MakePresetLayout(mini.config, mini.inv, {.preset = "sglang", .tp = 4}, 2);
  ASSERT_TRUE(mv.ok()) << mv.status();
  EXPECT_EQ(FindLocal(*mv, "lm_head.weight"), nullptr);
  EXPECT_EQ(FindLocal(*mv, "model.layers.0.self_attn.qkv_proj.weight")->shape, (std::vector<int64_t>{(6 + 4) * 128, 3072}));
  EXPECT_EQ(FindLocal(*mv, "model.embed_tokens.weight")->shape, (std::vector<int64_t>{50016, 3072}));

  // FSDP2 shards the fused canonical tensors by rows as they are; fsdp_flat by flat ranges.
  Model mini4k = Load("phi-3-mini-4k-instruct.json", 1);
  auto f = MakePresetLayout(mini4k.config, mini4k.inv, {.preset = "fsdp", .dp = 4}, 3);
  ASSERT_TRUE(f.ok()) << f.status();
  const LocalTensor* fq = FindLocal(*f, "model.layers.0.self_attn.qkv_proj.weight");
  ASSERT_NE(fq, nullptr);
  EXPECT_EQ(fq->shape, (std::vector<int64_t>{2304, 3072}));  // 9216 rows / 4
  const int32_t mq = *TensorIndex(mini4k.inv).Find("model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(CanonicalAt(mini4k.inv, *f, *fq, 0), std::make_pair(mq, int64_t{3 * 2304} * 3072));
  EXPECT_EQ(FindLocal(*f, "model.layers.0.mlp.gate_up_proj.weight")->shape, (std::vector<int64_t>{4096, 3072}));
  auto ff = MakePresetLayout(mini4k.config, mini4k.inv, {.preset = "deepspeed_zero3", .dp = 3}, 2);
  ASSERT_TRUE(ff.ok()) << ff.status();
  EXPECT_EQ(FindLocal(*ff, "model.layers.0.self_attn.qkv_proj.weight")->shape, (std::vector<int64_t>{9216 * 3072 / 3}));
  auto of = MakePresetLayout(o.config, o.inv, {.preset = "fsdp2", .dp = 3}, 2);
  ASSERT_TRUE(of.ok()) << of.status();
  EXPECT_EQ(FindLocal(*of, "model.layers.0.self_attn.k_norm.weight")->shape, (std::vector<int64_t>{1024 - 2 * 342}));
  for (const auto* mm : {&o, &p, &mini4k}) {
    for (ParallelConfig par : {ParallelConfig{.preset = "fsdp", .dp = 3, .replicas = 2}, ParallelConfig{.preset = "fsdp_flat", .dp = 5}}) {
      auto b = PresetBuilder::Create(mm->config, mm->inv, par);
      ASSERT_TRUE(b.ok()) << b.status();
      std::vector<PresetLayout> ranks;
      for (int r = 0; r < b->world_size(); ++r) ranks.push_back(*b->Make(r));
      std::vector<int64_t> counts = CoverageCounts(mm->inv, ranks);
      for (size_t i = 0; i < mm->inv.tensors.size(); ++i) {
        EXPECT_EQ(counts[i], par.preset == "fsdp" ? 2 : 1) << mm->inv.tensors[i].name;
      }
    }
  }
}

TEST(Presets, Olmo2AndPhi3Refusals) {
  auto refused = [](const Model& m, const ParallelConfig& par, const std::string& words) {
    absl::Status s = MakePresetLayout(m.config, m.inv, par, 0).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << par.preset << ": " << s;
    EXPECT_NE(s.message().find(words), std::string::npos) << s;
  };
  // Megatron: no verified layout of either family, refused naming the architecture.
  Model o = Load("olmo-2-1124-7b.json", 2);
  Model o3 = Load("olmo-3-1025-7b.json", 2);
  Model p = Load("phi-3-mini-4k-instruct.json", 2);
  refused(o, {.preset = "megatron", .tp = 2}, "Olmo2ForCausalLM");
  refused(o3, {.preset = "megatron"}, "Olmo3ForCausalLM");
  refused(p, {.preset = "megatron", .tp = 2}, "Phi3ForCausalLM");
  // OLMo-2 with KV heads replicated: olmo2.py's k_norm over num_key_value_heads*head_dim cannot
  // apply to k gathered from tp > KV ranks.
  Model gqa = FromText(R"({"architectures":["Olmo2ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_key_value_heads":2,"num_hidden_layers":1,"vocab_size":1000})");
  for (const char* preset : {"vllm", "sglang"}) refused(gqa, {.preset = preset, .tp = 4}, "k_norm");
  EXPECT_TRUE(MakePresetLayout(gqa.config, gqa.inv, {.preset = "vllm", .tp = 2}, 1).ok());
  // vLLM's olmo2.py has no attention biases (and skips them at load); SGLang's builds them.
  Model biased = FromText(R"({"architectures":["Olmo2ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_hidden_layers":1,"vocab_size":1000,"attention_bias":true})");
  refused(biased, {.preset = "vllm", .tp = 2}, "attention_bias");
  EXPECT_TRUE(MakePresetLayout(biased.config, biased.inv, {.preset = "fsdp", .dp = 2}, 1).ok());
  // Both engines' olmo2.py take head_dim = hidden_size / num_attention_heads.
  Model hd = FromText(R"({"architectures":["Olmo2ForCausalLM"],"hidden_size":64,"intermediate_size":96,"head_dim":16,
    "num_attention_heads":8,"num_hidden_layers":1,"vocab_size":1000})");
  for (const char* preset : {"vllm", "sglang"}) refused(hd, {.preset = preset, .tp = 2}, "head_dim");
  // Phi-3 `bias: true`: HF ignores it; the engines' llama.py would build q/k/v/o biases.
  Model pb = FromText(R"({"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_attention_heads":8,"num_hidden_layers":1,"vocab_size":1000,"bias":true})");
  for (const char* preset : {"vllm", "sglang"}) refused(pb, {.preset = preset, .tp = 2}, "bias");
  // SGLang DP attention is described for DeepSeek only.
  refused(p, {.preset = "sglang", .tp = 2, .dp = 2}, "DeepSeek");
}

// ---- fsdp2_tp: FSDP2 + TP on a (replicate, dp_shard, tp) mesh ----

// torch.chunk(x, parts) on a list of indices, transcribed from ATen's chunk (split by
// ceil(n / parts)) plus the empty chunks DTensor's Shard._split_tensor (fill_empty_tensor_to_shards)
// and FSDP2's _chunk_with_empty append so that there are `parts` of them. Built by walking the list,
// not by the preset's arithmetic.
std::vector<std::vector<int64_t>> TorchChunkList(const std::vector<int64_t>& x, int64_t parts) {
  const int64_t n = static_cast<int64_t>(x.size());
  const int64_t split = (n + parts - 1) / parts;
  std::vector<std::vector<int64_t>> out;
  for (int64_t at = 0; split > 0 && at < n; at += split) {
    out.emplace_back(x.begin() + at, x.begin() + std::min(n, at + split));
  }
  while (static_cast<int64_t>(out.size()) < parts) out.emplace_back();
  return out;
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// The placement NeMo-RL's plan gives a parameter on the TP mesh dim, from the module it belongs to
// (nemo_rl/models/dtensor/parallelize.py) and what torch's styles do to nn.Linear / nn.Embedding
// (torch/distributed/tensor/parallel/style.py): 'R' replicate, '0' Shard(0), '1' Shard(1).
char TpPlacement(const std::string& name) {
  const std::string module = name.substr(0, name.rfind('.'));
  const std::string param = name.substr(name.rfind('.') + 1);
  const std::string leaf = module.substr(module.rfind('.') + 1);
  static const std::set<std::string> colwise = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"};
  static const std::set<std::string> rowwise = {"o_proj", "down_proj"};
  if (colwise.count(leaf)) return '0';                  // ColwiseParallel(nn.Linear): weight and bias Shard(0)
  if (rowwise.count(leaf)) return param == "weight" ? '1' : 'R';  // RowwiseParallel(nn.Linear): bias Replicate
  if (leaf == "embed_tokens") return '0';               // RowwiseParallel(nn.Embedding): Shard(0)
  return 'R';                                           // norms: SequenceParallel / not parallelized
}

// Every element of every local tensor of every rank against torch's two chunkings: parallelize_module
// (TP part of the sharded dim), then fully_shard on the TP-local tensor (dim-0 chunk over dp).
void ExpectFsdp2TpLayout(const Model& m, const ParallelConfig& par) {
  SCOPED_TRACE(m.config.architecture + " tp=" + std::to_string(par.tp) + " dp=" + std::to_string(par.dp) +
               " replicas=" + std::to_string(par.replicas));
  auto b = PresetBuilder::Create(m.config, m.inv, par);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->world_size(), par.tp * par.dp * par.replicas);
  std::map<int, std::vector<std::string>> per_replica_boxes;
  for (int rank = 0; rank < b->world_size(); ++rank) {
    // The mesh (replicate, dp_shard, tp), row-major: tp fastest.
    const int tp_rank = rank % par.tp, shard = (rank / par.tp) % par.dp, replica = rank / (par.tp * par.dp);
    auto l = b->Make(rank);
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_TRUE(ValidateLayout(m.inv, l->layout, Role::kTrainer).ok());
    ASSERT_EQ(l->local_tensors.size(), m.inv.tensors.size()) << "every tensor listed, empty shards too";
    std::vector<std::string> boxes;
    for (size_t t = 0; t < m.inv.tensors.size(); ++t) {
      const TensorSpec& spec = m.inv.tensors[t];
      const LocalTensor& lt = l->local_tensors[t];
      ASSERT_EQ(lt.name, spec.name) << "HF names, inventory order";
      std::vector<int64_t> rows = Iota(spec.shape[0]);
      std::vector<int64_t> cols = spec.shape.size() > 1 ? Iota(spec.shape[1]) : std::vector<int64_t>{0};
      const char place = TpPlacement(spec.name);
      if (place == '0') rows = TorchChunkList(rows, par.tp)[tp_rank];
      if (place == '1') cols = TorchChunkList(cols, par.tp)[tp_rank];
      const std::vector<int64_t> tp_rows = rows;
      rows = TorchChunkList(rows, par.dp)[shard];
      std::vector<int64_t> want_shape = {static_cast<int64_t>(rows.size())};
      if (spec.shape.size() > 1) want_shape.push_back(static_cast<int64_t>(cols.size()));
      ASSERT_EQ(lt.shape, want_shape) << spec.name << " rank " << rank;
      const int64_t ncols = static_cast<int64_t>(cols.size());
      for (int64_t i = 0; i < Numel(lt.shape); ++i) {
        const int64_t canon_row = rows[static_cast<size_t>(i / ncols)], canon_col = cols[static_cast<size_t>(i % ncols)];
        const int64_t want_flat = spec.shape.size() > 1 ? canon_row * spec.shape[1] + canon_col : canon_row;
        ASSERT_EQ(CanonicalAt(m.inv, *l, lt, i), std::make_pair(static_cast<int32_t>(t), want_flat))
            << spec.name << " rank " << rank << " element " << i;
      }
      // FSDP2's padded storage: chunk 0 of the TP-local tensor's dim-0 chunks, reserved on every rank.
      const int64_t reserved = static_cast<int64_t>(TorchChunkList(tp_rows, par.dp)[0].size()) * ncols * 2;
      const int64_t next = t + 1 < l->local_tensors.size() ? l->local_tensors[t + 1].offset_bytes : l->layout.buffers[0].size_bytes;
      EXPECT_GE(next, lt.offset_bytes + reserved) << spec.name << " rank " << rank;
      EXPECT_LT(next, lt.offset_bytes + reserved + 2 * kLocalTensorAlignment) << spec.name << " rank " << rank;
      for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) boxes.push_back(spec.name + BoxToString(l->layout.pieces[k].box));
    }
    // HSDP: every replica holds what replica 0 holds, rank for rank.
    const int in_replica = rank % (par.tp * par.dp);
    if (replica == 0) {
      per_replica_boxes[in_replica] = boxes;
    } else {
      EXPECT_EQ(boxes, per_replica_boxes[in_replica]) << "rank " << rank;
    }
  }
}

// Small configs with every dim uneven somewhere: hidden 10, intermediate 10, vocab 11, 8 heads /
// 4 KV heads of 2 (GQA), so tp = 4 gives TP parts 3, 3, 3, 1 of the MLP and 3, 3, 3, 2 of the
// vocabulary, and dp = 3 then splits a 1-row TP part into 1, 0, 0 rows (empty FSDP2 shards).
const char* kFsdp2TpDims = R"("hidden_size":10,"intermediate_size":10,"num_hidden_layers":2,
    "num_attention_heads":8,"num_key_value_heads":4,"head_dim":2,"vocab_size":11)";

TEST(Presets, Fsdp2TpEveryElementOfEveryRank) {
  const std::string d = kFsdp2TpDims;
  std::vector<Model> models = {
      // Llama, untied, every bias (o_proj / down_proj biases replicated by RowwiseParallel).
      FromText(R"({"architectures":["LlamaForCausalLM"],"attention_bias":true,"mlp_bias":true,)" + d + "}"),
      // Qwen2 tied: one parameter, the embedding's vocab-parallel rows (lm_head absent).
      FromText(R"({"architectures":["Qwen2ForCausalLM"],"tie_word_embeddings":true,)" + d + "}"),
      // Qwen3: q_norm / k_norm [head_dim] whole on every TP rank, dim-0 chunked by FSDP2 (2 rows over 3).
      FromText(R"({"architectures":["Qwen3ForCausalLM"],"tie_word_embeddings":false,)" + d + "}"),
      FromText(R"({"architectures":["MistralForCausalLM"],)" + d + "}"),
      FromText(R"({"architectures":["Gemma3ForCausalLM"],)" + d + "}"),
  };
  for (const Model& m : models) {
    for (int tp : {1, 2, 4}) {
      for (int dp : {1, 2, 3}) ExpectFsdp2TpLayout(m, {.preset = "fsdp2_tp", .tp = tp, .dp = dp});
    }
    ExpectFsdp2TpLayout(m, {.preset = "fsdp_tp", .tp = 2, .dp = 3, .replicas = 2});
  }
  // MQA-like: one KV head per rank at tp = 2.
  ExpectFsdp2TpLayout(FromText(R"({"architectures":["LlamaForCausalLM"],"hidden_size":12,"intermediate_size":20,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":9})"),
                      {.preset = "fsdp2_tp", .tp = 2, .dp = 2, .replicas = 2});
  // tp = 1 is the fsdp preset, box for box.
  Model q = Load("qwen2.5-0.5b.json", 1);
  for (int r = 0; r < 3; ++r) {
    auto a = MakePresetLayout(q.config, q.inv, {.preset = "fsdp2_tp", .dp = 3}, r);
    auto f = MakePresetLayout(q.config, q.inv, {.preset = "fsdp", .dp = 3}, r);
    ASSERT_TRUE(a.ok() && f.ok());
    ASSERT_EQ(a->layout.pieces.size(), f->layout.pieces.size());
    for (size_t i = 0; i < a->layout.pieces.size(); ++i) {
      EXPECT_EQ(BoxToString(a->layout.pieces[i].box), BoxToString(f->layout.pieces[i].box));
      EXPECT_EQ(a->layout.pieces[i].offset_bytes, f->layout.pieces[i].offset_bytes);
    }
    EXPECT_EQ(a->layout.buffers[0].size_bytes, f->layout.buffers[0].size_bytes);
  }
}

TEST(Presets, Fsdp2TpOnQwen25_7B) {
  // Qwen2.5-7B (28 heads, 4 KV heads of 128, hidden 3584, intermediate 18944, vocab 152064),
  // tp = 4, dp = 2: rank 5 = dp_shard 1, tp_rank 1.
  Model m = Load("qwen2.5-7b.json", 1);
  auto l = MakePresetLayout(m.config, m.inv, {.preset = "fsdp2_tp", .tp = 4, .dp = 2}, 5);
  ASSERT_TRUE(l.ok()) << l.status();
  auto box = [&](const std::string& name) {
    const LocalTensor* lt = FindLocal(*l, name);
    EXPECT_NE(lt, nullptr) << name;
    if (lt == nullptr || lt->num_pieces != 1) return std::string("?");
    return BoxToString(l->layout.pieces[lt->first_piece].box);
  };
  const std::string a = "model.layers.0.self_attn.", p = "model.layers.0.mlp.";
  // Shard(0) twice: TP part 1 of 4 (rows 896..1791), then dp chunk 1 of 2 within it.
  EXPECT_EQ(FindLocal(*l, a + "q_proj.weight")->shape, (std::vector<int64_t>{448, 3584}));
  EXPECT_EQ(box(a + "q_proj.weight"), BoxToString(Box{{1344, 0}, {1792, 3584}}));
  EXPECT_EQ(box(a + "k_proj.bias"), BoxToString(Box{{192}, {256}}));
  // Shard(1): TP columns 896..1791, FSDP2 rows 1792..3583.
  EXPECT_EQ(FindLocal(*l, a + "o_proj.weight")->shape, (std::vector<int64_t>{1792, 896}));
  EXPECT_EQ(box(a + "o_proj.weight"), BoxToString(Box{{1792, 896}, {3584, 1792}}));
  EXPECT_EQ(box(p + "down_proj.weight"), BoxToString(Box{{1792, 4736}, {3584, 9472}}));
  EXPECT_EQ(box(p + "gate_proj.weight"), BoxToString(Box{{4736 + 2368, 0}, {9472, 3584}}));
  // Vocab-parallel embedding and lm_head: 38016 rows per TP rank, 19008 per dp shard.
  EXPECT_EQ(box("model.embed_tokens.weight"), BoxToString(Box{{38016 + 19008, 0}, {76032, 3584}}));
  EXPECT_EQ(box("lm_head.weight"), BoxToString(Box{{38016 + 19008, 0}, {76032, 3584}}));
  // Norms whole over tp, dim-0 chunked over dp.
  EXPECT_EQ(box("model.norm.weight"), BoxToString(Box{{1792}, {3584}}));
}

TEST(Presets, Fsdp2TpRefusals) {
  auto refused = [](const Model& m, const ParallelConfig& par, const std::string& words) {
    absl::Status s = MakePresetLayout(m.config, m.inv, par, 0).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << par.preset << ": " << s;
    EXPECT_NE(s.message().find(words), std::string::npos) << s;
  };
  const std::string d = kFsdp2TpDims;
  Model llama = FromText(R"({"architectures":["LlamaForCausalLM"],)" + d + "}");
  // NeMo-RL's _parallelize_model asserts tp | num_key_value_heads (and tp | num_attention_heads).
  refused(llama, {.preset = "fsdp2_tp", .tp = 8, .dp = 1}, "tp=8 must divide num_key_value_heads=4");
  refused(llama, {.preset = "fsdp2_tp", .tp = 3, .dp = 2}, "num_key_value_heads");
  // Families whose FSDP2 + TP plan is not verified: refused naming the architecture.
  refused(Load("qwen3-30b-a3b.json", 1), {.preset = "fsdp2_tp", .tp = 2, .dp = 2}, "Qwen3MoeForCausalLM");
  refused(Load("phi-4.json", 1), {.preset = "fsdp2_tp", .tp = 2}, "Phi3ForCausalLM");
  refused(Load("olmo-2-1124-7b.json", 1), {.preset = "fsdp2_tp", .tp = 2}, "Olmo2ForCausalLM");
  refused(Load("gemma-2-2b.json", 1), {.preset = "fsdp2_tp", .tp = 2}, "Gemma2ForCausalLM");
  refused(Load("deepseek-v3.json", 1), {.preset = "fsdp2_tp", .tp = 2}, "DeepseekV3ForCausalLM");
  // Sizes and options FSDP2 + TP has no counterpart for.
  refused(llama, {.preset = "fsdp2_tp", .tp = 2, .pp = 2}, "pp=2 does not apply");
  refused(llama, {.preset = "fsdp2_tp", .tp = 2, .ep = 2}, "ep=2 does not apply");
  refused(llama, {.preset = "fsdp2_tp", .tp = 2, .expert_parallel = true}, "expert_parallel");
  refused(llama, {.preset = "fsdp2_tp", .tp = 2, .vpp = 2}, "vpp");
  refused(llama, {.preset = "fsdp2_tp", .tp = 2, .quantization = "fp8_block128"}, "rollout presets");
  // The fsdp preset points a tp at this one.
  refused(llama, {.preset = "fsdp", .tp = 2, .dp = 2}, "fsdp2_tp");
  EXPECT_EQ(*PresetWorldSize({.preset = "fsdp2_tp", .tp = 4, .dp = 8, .replicas = 2}), 64);
  auto b = PresetBuilder::Create(llama.config, llama.inv, {.preset = "fsdp2_tp", .tp = 2, .dp = 2});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->Make(4).ok());
}

}  // namespace
}  // namespace wb::planner
