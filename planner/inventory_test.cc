#include "planner/inventory.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace wb::planner {
namespace {

std::string ReadTestdata(const std::string& name) {
  std::ifstream f("planner/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Inventory Load(const std::string& name) {
  auto c = ParseHfConfig(ReadTestdata(name));
  EXPECT_TRUE(c.ok()) << name << ": " << c.status();
  auto inv = BuildInventory(*c, DType::kBF16);
  EXPECT_TRUE(inv.ok()) << inv.status();
  return *inv;
}

struct Published {
  const char* file;
  double params;
};

class ParamCount : public ::testing::TestWithParam<Published> {};

TEST_P(ParamCount, WithinHalfPercentOfPublished) {
  Inventory inv = Load(GetParam().file);
  double total = static_cast<double>(TotalElements(inv));
  EXPECT_LT(std::abs(total / GetParam().params - 1.0), 0.005)
      << GetParam().file << ": " << total << " vs " << GetParam().params;
}

INSTANTIATE_TEST_SUITE_P(Models, ParamCount,
                         ::testing::Values(Published{"qwen2.5-0.5b.json", 0.494e9},
                                           Published{"qwen2.5-7b.json", 7.62e9},
                                           Published{"qwen3-30b-a3b.json", 30.5e9},
                                           Published{"deepseek-v3.json", 671e9},
                                           Published{"kimi-k2.json", 1.026e12}));

TEST(Inventory, TiedEmbeddingsHaveNoLmHead) {
  Inventory inv = Load("qwen2.5-0.5b.json");
  TensorIndex idx(inv);
  EXPECT_TRUE(idx.Find("model.embed_tokens.weight").has_value());
  EXPECT_FALSE(idx.Find("lm_head.weight").has_value());
  ASSERT_TRUE(idx.Find("model.layers.3.self_attn.k_proj.bias").has_value());
  EXPECT_EQ(inv.tensors[*idx.Find("model.layers.3.self_attn.k_proj.bias")].shape,
            (std::vector<int64_t>{128}));
  EXPECT_EQ(inv.tensors.back().name, "model.norm.weight");
}

TEST(Inventory, DeepseekTensors) {
  Inventory inv = Load("deepseek-v3.json");
  TensorIndex idx(inv);
  auto shape = [&](const std::string& n) -> std::vector<int64_t> {
    auto i = idx.Find(n);
    EXPECT_TRUE(i.has_value()) << n;
    return i ? inv.tensors[*i].shape : std::vector<int64_t>{};
  };
  EXPECT_EQ(shape("model.layers.0.self_attn.q_a_proj.weight"), (std::vector<int64_t>{1536, 7168}));
  EXPECT_EQ(shape("model.layers.0.self_attn.q_b_proj.weight"), (std::vector<int64_t>{128 * 192, 1536}));
  EXPECT_EQ(shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (std::vector<int64_t>{576, 7168}));
  EXPECT_EQ(shape("model.layers.0.self_attn.kv_b_proj.weight"), (std::vector<int64_t>{128 * 256, 512}));
  EXPECT_EQ(shape("model.layers.2.mlp.gate_proj.weight"), (std::vector<int64_t>{18432, 7168}));
  EXPECT_FALSE(idx.Find("model.layers.2.mlp.gate.weight").has_value());
  EXPECT_EQ(shape("model.layers.3.mlp.gate.e_score_correction_bias"), (std::vector<int64_t>{256}));
  EXPECT_EQ(shape("model.layers.3.mlp.experts.255.down_proj.weight"), (std::vector<int64_t>{7168, 2048}));
  EXPECT_EQ(shape("model.layers.60.mlp.shared_experts.up_proj.weight"), (std::vector<int64_t>{2048, 7168}));
  EXPECT_FALSE(idx.Find("model.layers.61.input_layernorm.weight").has_value());  // MTP excluded
  EXPECT_EQ(shape("lm_head.weight"), (std::vector<int64_t>{129280, 7168}));
}

TEST(Inventory, DeterministicOrderAndBases) {
  Inventory a = Load("qwen3-30b-a3b.json");
  Inventory b = Load("qwen3-30b-a3b.json");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) ASSERT_EQ(a.tensors[i].name, b.tensors[i].name);
  EXPECT_EQ(a.tensors[0].name, "model.embed_tokens.weight");
  std::vector<int64_t> bases = TensorBases(a);
  ASSERT_EQ(bases.size(), a.tensors.size() + 1);
  EXPECT_EQ(bases[0], 0);
  EXPECT_EQ(bases[1], 151936 * 2048);
  EXPECT_EQ(bases.back(), TotalElements(a));
  TensorIndex idx(a);
  EXPECT_TRUE(idx.Find("model.layers.47.mlp.experts.127.up_proj.weight").has_value());
  EXPECT_TRUE(idx.Find("model.layers.0.self_attn.q_norm.weight").has_value());
  EXPECT_FALSE(idx.Find("model.layers.0.mlp.experts.128.up_proj.weight").has_value());
}

}  // namespace
}  // namespace wb::planner
