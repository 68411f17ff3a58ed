#include "planner/model_config.h"

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

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

// A field the config leaves out takes its HF config class's default (what transformers, vLLM and
// SGLang see); null is None.
TEST(ModelConfig, AbsentFieldsTakeTheHfConfigClassDefaults) {
  const std::string base = R"("hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,"num_attention_heads":4,
    "vocab_size":100,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":4,"v_head_dim":8)";
  auto v3 = ParseHfConfig(R"({"architectures":["DeepseekV3ForCausalLM"],)" + base + "}");
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_EQ(v3->experts, 256);  // DeepseekV3Config defaults
  EXPECT_EQ(v3->moe_intermediate, 2048);
  EXPECT_EQ(v3->n_shared_experts, 1);
  EXPECT_EQ(v3->first_k_dense_replace, 3);
  EXPECT_EQ(v3->q_lora_rank, 1536);
  EXPECT_FALSE(v3->IsMoeLayer(2));
  EXPECT_TRUE(v3->IsMoeLayer(3));
  auto nulls = ParseHfConfig(R"({"architectures":["DeepseekV3ForCausalLM"],"n_routed_experts":4,"moe_intermediate_size":32,
    "n_shared_experts":null,"first_k_dense_replace":null,"q_lora_rank":null,)" + base + "}");
  ASSERT_TRUE(nulls.ok()) << nulls.status();
  EXPECT_EQ(nulls->n_shared_experts, 0);
  EXPECT_EQ(nulls->first_k_dense_replace, 0);
  EXPECT_EQ(nulls->q_lora_rank, 0);
  auto glm = ParseHfConfig(R"({"architectures":["Glm4MoeForCausalLM"],"num_key_value_heads":2,)" + base + "}");
  ASSERT_TRUE(glm.ok()) << glm.status();
  EXPECT_EQ(glm->experts, 128);  // Glm4MoeConfig defaults
  EXPECT_EQ(glm->moe_intermediate, 1408);
  EXPECT_EQ(glm->n_shared_experts, 1);
  EXPECT_EQ(glm->first_k_dense_replace, 1);
  // DeepSeek-V2's defaults changed between releases: both counts must be given.
  auto v2 = ParseHfConfig(R"({"architectures":["DeepseekV2ForCausalLM"],"n_routed_experts":4,"moe_intermediate_size":32,)" + base + "}");
  ASSERT_FALSE(v2.ok());
  EXPECT_NE(v2.status().message().find("`n_shared_experts`"), std::string::npos) << v2.status();
  auto v2ok = ParseHfConfig(R"({"architectures":["DeepseekV2ForCausalLM"],"n_routed_experts":4,"n_shared_experts":2,"moe_intermediate_size":32,)" + base + "}");
  ASSERT_TRUE(v2ok.ok()) << v2ok.status();
  EXPECT_EQ(v2ok->q_lora_rank, 1536);
  EXPECT_EQ(v2ok->first_k_dense_replace, 0);
  auto qwen = ParseHfConfig(R"({"architectures":["Qwen2MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "moe_intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"num_experts":4})");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->shared_expert_intermediate, 5632);  // Qwen2MoeConfig default
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

// Every config flag that adds or removes tensors is honoured or refused naming the flag.
TEST(ModelConfig, TensorFlagsHonouredOrRefused) {
  const std::string base = R"("hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
    "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100)";
  auto parse = [&](const std::string& arch, const std::string& extra) {
    return ParseHfConfig(R"({"architectures":[")" + arch + R"("],)" + base + (extra.empty() ? "" : "," + extra) + "}");
  };
  auto llama = parse("LlamaForCausalLM", R"("mlp_bias":true,"attention_bias":true)");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_TRUE(llama->mlp_bias);
  EXPECT_TRUE(llama->qkv_bias);
  EXPECT_TRUE(llama->o_bias);
  for (const auto& [arch, flag] : std::vector<std::pair<std::string, std::string>>{
           {"MistralForCausalLM", "attention_bias"}, {"MistralForCausalLM", "mlp_bias"},
           {"Qwen2ForCausalLM", "attention_bias"}, {"Qwen2ForCausalLM", "mlp_bias"},
           {"Qwen3ForCausalLM", "mlp_bias"}, {"Gemma2ForCausalLM", "mlp_bias"}}) {
    auto c = parse(arch, "\"" + flag + "\":true");
    ASSERT_FALSE(c.ok()) << arch << " " << flag;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(flag), std::string::npos) << c.status();
    EXPECT_TRUE(parse(arch, "\"" + flag + "\":false").ok()) << arch << " " << flag;  // false is what HF does
  }
  auto mix = parse("MixtralForCausalLM", R"("num_local_experts":4,"attention_bias":true)");
  ASSERT_FALSE(mix.ok());
  EXPECT_NE(mix.status().message().find("attention_bias"), std::string::npos);
  const std::string mla = R"("n_routed_experts":4,"n_shared_experts":1,"moe_intermediate_size":32,"kv_lora_rank":16,"qk_nope_head_dim":8,
    "qk_rope_head_dim":4,"v_head_dim":8)";
  auto ds = parse("DeepseekV3ForCausalLM", mla + R"(,"attention_bias":true)");
  ASSERT_FALSE(ds.ok());
  EXPECT_NE(ds.status().message().find("attention_bias"), std::string::npos);
  // topk_method decides e_score_correction_bias (DeepSeek-V2 greedy: none; V3 default noaux_tc).
  EXPECT_FALSE(parse("DeepseekV2ForCausalLM", mla)->router_bias);
  EXPECT_TRUE(parse("DeepseekV2ForCausalLM", mla + R"(,"topk_method":"noaux_tc")")->router_bias);
  EXPECT_TRUE(parse("DeepseekV3ForCausalLM", mla)->router_bias);
  // Gemma ties embeddings unless told otherwise; the others do not.
  EXPECT_TRUE(parse("Gemma2ForCausalLM", "")->tie_word_embeddings);
  EXPECT_FALSE(parse("Gemma2ForCausalLM", R"("tie_word_embeddings":false)")->tie_word_embeddings);
  EXPECT_FALSE(parse("LlamaForCausalLM", "")->tie_word_embeddings);
  EXPECT_TRUE(parse("Gemma3ForCausalLM", "")->qk_norm);
  EXPECT_TRUE(parse("Gemma3ForCausalLM", R"("attention_bias":true)")->o_bias);
  // GLM-4.5: attention_bias puts biases on q/k/v only; use_qk_norm adds q_norm/k_norm.
  auto glm = parse("Glm4MoeForCausalLM", R"("n_routed_experts":4,"moe_intermediate_size":32,"attention_bias":true,"use_qk_norm":true)");
  ASSERT_TRUE(glm.ok()) << glm.status();
  EXPECT_TRUE(glm->qkv_bias);
  EXPECT_FALSE(glm->o_bias);
  EXPECT_TRUE(glm->qk_norm);
  EXPECT_TRUE(glm->router_bias);
  // GPT-OSS: attention_bias defaults to true; sinks, fused experts, router bias.
  auto oss = parse("GptOssForCausalLM", R"("num_local_experts":4)");
  ASSERT_TRUE(oss.ok()) << oss.status();
  EXPECT_TRUE(oss->qkv_bias && oss->o_bias && oss->attn_sinks && oss->fused_experts && oss->router_bias);
  // Multimodal wrappers are refused with a pointer to the text config.
  auto mm = parse("Gemma3ForConditionalGeneration", "");
  ASSERT_FALSE(mm.ok());
  EXPECT_NE(mm.status().message().find("text"), std::string::npos) << mm.status();
}

// OLMo-2 / OLMo-3 (configuration_olmo2.py / configuration_olmo3.py, modeling_olmo2.py) and Phi-3
// (configuration_phi3.py, modeling_phi3.py): families, flags and the HF classes' defaults.
TEST(ModelConfig, Olmo2Olmo3AndPhi3) {
  for (const char* f : {"olmo-2-1124-7b.json", "olmo-2-0325-32b.json", "olmo-3-1025-7b.json"}) {
    auto c = ParseHfConfig(ReadTestdata(f));
    ASSERT_TRUE(c.ok()) << f << ": " << c.status();
    EXPECT_EQ(c->family, ModelFamily::kOlmo2) << f;
    EXPECT_TRUE(c->post_norms && c->qk_norm && c->qk_norm_full) << f;
    EXPECT_FALSE(c->qkv_bias || c->o_bias || c->fused_proj || c->ffn_norms || c->tie_word_embeddings) << f;
    EXPECT_EQ(c->head_dim, 128) << f;  // hidden_size / num_attention_heads
  }
  // Olmo2Config: attention_bias -> q/k/v/o biases; tie_word_embeddings default false; mlp_bias
  // has no tensors in Olmo2MLP.
  const std::string olmo = R"({"architectures":["Olmo2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_attention_heads":4,"num_hidden_layers":1,"vocab_size":100)";
  auto b = ParseHfConfig(olmo + R"(,"attention_bias":true})");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->qkv_bias && b->o_bias);
  EXPECT_EQ(b->kv_heads, 4);  // num_key_value_heads defaults to num_attention_heads
  auto mb = ParseHfConfig(olmo + R"(,"mlp_bias":true})");
  ASSERT_FALSE(mb.ok());
  EXPECT_EQ(mb.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mb.status().message().find("mlp_bias"), std::string::npos) << mb.status();

  auto p = ParseHfConfig(ReadTestdata("phi-4-mini-instruct.json"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->family, ModelFamily::kPhi3);
  EXPECT_TRUE(p->fused_proj);
  EXPECT_TRUE(p->tie_word_embeddings);
  EXPECT_EQ(p->head_dim, 128);  // 3072 / 24 (partial_rotary_factor changes no tensor)
  EXPECT_EQ(p->kv_heads, 8);
  EXPECT_FALSE(p->qk_norm || p->post_norms || p->qkv_bias || p->mlp_bias);
  auto p4 = ParseHfConfig(ReadTestdata("phi-4.json"));
  ASSERT_TRUE(p4.ok()) << p4.status();
  EXPECT_FALSE(p4->tie_word_embeddings);
  // Phi3Attention / Phi3MLP have no biases: attention_bias / mlp_bias true are refused, named.
  const std::string phi = R"({"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_attention_heads":4,"num_hidden_layers":1,"vocab_size":100)";
  for (const char* flag : {"attention_bias", "mlp_bias"}) {
    auto r = ParseHfConfig(phi + ",\"" + flag + "\":true}");
    ASSERT_FALSE(r.ok()) << flag;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(flag), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("Phi3ForCausalLM"), std::string::npos) << r.status();
  }
  auto hd = ParseHfConfig(phi + R"(,"head_dim":32})");  // Phi3Attention: getattr(config, "head_dim", ...)
  ASSERT_TRUE(hd.ok());
  EXPECT_EQ(hd->head_dim, 32);
}

}  // namespace
}  // namespace wb::planner

namespace wb::planner {
namespace {

TEST(ModelConfig, DeepseekV32) {
  auto c = ParseHfConfig(ReadTestdata("deepseek-v3.2.json"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kDeepseekV32);
  EXPECT_STREQ(ModelFamilyName(c->family), "deepseek_v32");
  EXPECT_TRUE(c->mla && c->dsa_indexer && c->router_bias);
  EXPECT_EQ(c->index_n_heads, 64);
  EXPECT_EQ(c->index_head_dim, 128);
  EXPECT_EQ(c->q_lora_rank, 1536);
  EXPECT_TRUE(c->IsMoeLayer(3));
  EXPECT_FALSE(c->IsMoeLayer(2));

  // Absent fields take DeepseekV32Config's defaults (V3's, plus index_n_heads 64, index_head_dim 128).
  const std::string base = R"({"architectures":["DeepseekV32ForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":4,"num_attention_heads":8,"vocab_size":1000,"kv_lora_rank":16,"qk_nope_head_dim":8,
    "qk_rope_head_dim":4,"v_head_dim":8)";
  auto d = ParseHfConfig(base + "}");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->index_n_heads, 64);
  EXPECT_EQ(d->index_head_dim, 128);
  EXPECT_EQ(d->experts, 256);
  EXPECT_EQ(d->moe_intermediate, 2048);
  EXPECT_EQ(d->first_k_dense_replace, 3);
  EXPECT_EQ(d->q_lora_rank, 1536);
  // DeepseekV3 never reads the index_* fields.
  auto v3 = ParseHfConfig(R"({"architectures":["DeepseekV3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":4,"num_attention_heads":8,"vocab_size":1000,"kv_lora_rank":16,"qk_nope_head_dim":8,
    "qk_rope_head_dim":4,"v_head_dim":8,"index_n_heads":4})");
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_FALSE(v3->dsa_indexer);
  // transformers' saved mlp_layer_types: accepted when it agrees with first_k_dense_replace.
  auto types = ParseHfConfig(base + R"(,"mlp_layer_types":["dense","dense","dense","sparse"]})");
  ASSERT_TRUE(types.ok()) << types.status();

  auto refused = [&](const std::string& extra, const std::string& named) {
    auto r = ParseHfConfig(base + extra + "}");
    ASSERT_FALSE(r.ok()) << extra;
    EXPECT_NE(r.status().message().find(named), std::string::npos) << r.status();
  };
  refused(R"(,"q_lora_rank":null)", "q_lora_rank");
  refused(R"(,"index_topk_freq":2)", "index_topk_freq");
  refused(R"(,"index_topk_pattern":"FSFS")", "index_topk_pattern");
  refused(R"(,"index_skip_topk_offset":2)", "index_skip_topk_offset");
  refused(R"(,"mlp_layer_types":["dense","sparse","sparse","sparse"])", "mlp_layer_types");
  refused(R"(,"mlp_layer_types":["dense"])", "mlp_layer_types");
  refused(R"(,"attention_bias":true)", "attention_bias");
  refused(R"(,"index_n_heads":0)", "index_n_heads");
  refused(R"(,"index_head_dim":4294967296,"index_n_heads":4294967296)", "index_n_heads");
  // index_topk_freq 1 is every layer: the HF layout.
  auto freq1 = ParseHfConfig(base + R"(,"index_topk_freq":1})");
  EXPECT_TRUE(freq1.ok()) << freq1.status();
}

}  // namespace
}  // namespace wb::planner

namespace wb::planner {
namespace {

TEST(ModelConfig, MiniMaxM2) {
  auto c = ParseHfConfig(ReadTestdata("minimax-m2.json"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kMiniMaxM2);
  EXPECT_STREQ(ModelFamilyName(c->family), "minimax_m2");
  EXPECT_TRUE(c->qk_norm && c->qk_norm_full && c->router_bias);
  EXPECT_FALSE(c->post_norms || c->qkv_bias || c->o_bias);
  EXPECT_EQ(c->experts, 256);
  EXPECT_EQ(c->moe_intermediate, 1536);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->kv_heads, 8);
  EXPECT_TRUE(c->IsMoeLayer(0));
  EXPECT_EQ(c->layers, 62);  // num_mtp_modules are not layers here

  // Absent fields take MiniMaxM2Config's defaults: num_key_value_heads 8, head_dim 128 (not
  // hidden / heads = 64), num_local_experts 256.
  const std::string base = R"({"architectures":["MiniMaxM2ForCausalLM"],"hidden_size":3072,"intermediate_size":1536,
    "num_hidden_layers":2,"num_attention_heads":48,"vocab_size":1000)";
  auto d = ParseHfConfig(base + R"(,"use_routing_bias":true})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kv_heads, 8);
  EXPECT_EQ(d->head_dim, 128);
  EXPECT_EQ(d->experts, 256);
  auto refused = [&](const std::string& extra, const std::string& named) {
    auto r = ParseHfConfig(base + extra + "}");
    ASSERT_FALSE(r.ok()) << extra;
    EXPECT_NE(r.status().message().find(named), std::string::npos) << r.status();
  };
  refused("", "use_routing_bias");
  refused(R"(,"use_routing_bias":false)", "use_routing_bias");
  refused(R"(,"use_routing_bias":true,"attention_bias":true)", "attention_bias");
  refused(R"(,"use_routing_bias":true,"use_qk_norm":false)", "use_qk_norm");
  refused(R"(,"use_routing_bias":true,"qk_norm_type":"per_head")", "qk_norm_type");
  refused(R"(,"use_routing_bias":true,"shared_intermediate_size":512)", "shared_intermediate_size");
  refused(R"(,"use_routing_bias":true,"mlp_bias":true)", "mlp_bias");
}

}  // namespace
}  // namespace wb::planner
