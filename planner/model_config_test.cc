#include "planner/model_config.h"

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

TEST(ModelConfig, Qwen25_7B) {
  auto c = ParseHfConfig(ReadTestdata("qwen2.5-7b.json"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kQwen2);
  EXPECT_EQ(c->hidden, 3584);
  EXPECT_EQ(c->head_dim, 128);  // derived: 3584 / 28
  EXPECT_EQ(c->kv_heads, 4);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->experts, 0);
}

TEST(ModelConfig, Qwen3MoeAndDeepseek) {
  auto q = ParseHfConfig(ReadTestdata("qwen3-30b-a3b.json"));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->family, ModelFamily::kQwen3Moe);
  EXPECT_EQ(q->head_dim, 128);  // explicit, != 2048 / 32
  EXPECT_TRUE(q->qk_norm);
  EXPECT_EQ(q->experts, 128);
  EXPECT_EQ(q->moe_intermediate, 768);
  EXPECT_TRUE(q->IsMoeLayer(0));

  auto d = ParseHfConfig(ReadTestdata("deepseek-v3.json"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->mla);
  EXPECT_EQ(d->q_lora_rank, 1536);
  EXPECT_EQ(d->experts, 256);
  EXPECT_EQ(d->shared_expert_intermediate, 2048);
  EXPECT_FALSE(d->IsMoeLayer(2));
  EXPECT_TRUE(d->IsMoeLayer(3));
}

TEST(ModelConfig, NullQLoraRankAndMixtral) {
  auto d = ParseHfConfig(R"({"architectures":["DeepseekV3ForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,
    "vocab_size":100,"n_routed_experts":4,"q_lora_rank":null,"kv_lora_rank":16,"qk_nope_head_dim":8,
    "qk_rope_head_dim":4,"v_head_dim":8})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->q_lora_rank, 0);
  auto m = ParseHfConfig(R"({"architectures":["MixtralForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
    "vocab_size":100,"num_local_experts":8})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->experts, 8);
  EXPECT_EQ(m->moe_intermediate, 128);
  EXPECT_TRUE(m->IsMoeLayer(1));
}

TEST(ModelConfig, ErrorsNameTheProblem) {
  auto bad_arch = ParseHfConfig(R"({"architectures":["GPT2LMHeadModel"]})");
  ASSERT_FALSE(bad_arch.ok());
  EXPECT_EQ(bad_arch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_arch.status().message().find("GPT2LMHeadModel"), std::string::npos);

  auto missing = ParseHfConfig(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_attention_heads":4,"vocab_size":100})");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("num_hidden_layers"), std::string::npos);

  auto wrong_type = ParseHfConfig(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":"64",
    "intermediate_size":128,"num_attention_heads":4,"num_hidden_layers":2,"vocab_size":100})");
  ASSERT_FALSE(wrong_type.ok());
  EXPECT_NE(wrong_type.status().message().find("hidden_size"), std::string::npos);

  auto moe_missing = ParseHfConfig(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_attention_heads":4,"num_hidden_layers":2,"vocab_size":100,
    "moe_intermediate_size":32})");
  ASSERT_FALSE(moe_missing.ok());
  EXPECT_NE(moe_missing.status().message().find("num_experts"), std::string::npos);

  EXPECT_FALSE(ParseHfConfig("{not json").ok());
  EXPECT_FALSE(ParseHfConfig("[1,2]").ok());
}

}  // namespace
}  // namespace wb::planner
