#include "client/layout_command.h"

#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace wb::client {
namespace {

const char* kConfig = "tests/soak/testdata/qwen2-tiny.json";

int RunCmd(const std::vector<std::string>& args, std::string* out, std::string* err) {
  std::ostringstream o, e;
  int rc = RunLayoutCommand(args, o, e);
  *out = o.str();
  *err = e.str();
  return rc;
}

TEST(LayoutCommandTest, OfflinePresetRankListsTheBufferAndEveryLocalTensor) {
  std::string out, err;
  ASSERT_EQ(RunCmd({"--config", kConfig, "--preset", "megatron", "--tp", "2", "--rank", "1"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("buffer 0: "), std::string::npos) << out;
  EXPECT_NE(out.find("decoder.layers.1.self_attention.linear_qkv.weight"), std::string::npos) << out;
  EXPECT_NE(out.find("[256, 256]"), std::string::npos) << out;
  // JSON: the LayoutDescription; the buffer holds every tensor, tensors are 256-byte aligned.
  ASSERT_EQ(RunCmd({"--config", kConfig, "--preset", "megatron", "--tp=2", "--rank=1", "--json"}, &out, &err), 0) << err;
  auto j = nlohmann::json::parse(out);
  const uint64_t size = std::stoull(j["buffers"][0]["size_bytes"].get<std::string>());
  ASSERT_FALSE(j["tensors"].empty());
  for (const auto& t : j["tensors"]) {
    const uint64_t off = std::stoull(t["offset_bytes"].get<std::string>()), bytes = std::stoull(t["size_bytes"].get<std::string>());
    EXPECT_EQ(off % 256, 0u) << t.dump();
    EXPECT_LE(off + bytes, size) << t.dump();
  }
  EXPECT_EQ(j["source"], "preset");
}

TEST(LayoutCommandTest, QuantisedRolloutNamesItsScales) {
  std::string out, err;
  ASSERT_EQ(RunCmd({"--config", kConfig, "--preset", "vllm", "--quantization", "fp8_block128", "--rank", "0"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("float8_e4m3"), std::string::npos) << out;
  EXPECT_NE(out.find("(scales: model.layers.0.self_attn.o_proj.weight_scale_inv)"), std::string::npos) << out;
}

// Megatron's option flags reach the preset: the legacy GroupedMLP's weight1 / weight2, and the
// tp-pp-dp rank order (rank 2 of tp=2 pp=2 dp=2 is on the last stage, holding the output layer).
TEST(LayoutCommandTest, MegatronOptionFlags) {
  const char* moe = "planner/testdata/qwen3-30b-a3b.json";
  std::string out, err;
  ASSERT_EQ(RunCmd({"--config", moe, "--preset", "megatron", "--tp", "2", "--dp", "2", "--ep", "4", "--etp", "1", "--rank", "3",
                    "--moe_grouped_gemm", "--moe_use_legacy_grouped_gemm"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("decoder.layers.0.mlp.experts.weight1"), std::string::npos) << out;
  EXPECT_NE(out.find("[2048, 49152]"), std::string::npos) << out;  // hidden x (128 / ep 4 local experts) * 2 * 768
  EXPECT_EQ(out.find("linear_fc1.weight0"), std::string::npos) << out;
  ASSERT_EQ(RunCmd({"--config", kConfig, "--preset", "megatron", "--tp", "2", "--pp", "2", "--dp", "2", "--rank", "2",
                    "--use_tp_pp_dp_mapping"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("output_layer.weight"), std::string::npos) << out;
  EXPECT_EQ(out.find("embedding.word_embeddings.weight"), std::string::npos) << out;
  ASSERT_EQ(RunCmd({"--config", kConfig, "--preset", "megatron", "--tp", "2", "--pp", "2", "--dp", "2", "--rank", "2"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("embedding.word_embeddings.weight"), std::string::npos) << out;
}

TEST(LayoutCommandTest, MoeA2aBackendFlag) {
  const char* ds = "planner/testdata/deepseek-v3.json";  // shared experts: I = 2048, H = 7168
  // The line naming `name` (names end the line).
  auto line_of = [](const std::string& out, const std::string& name) {
    const size_t at = out.find(name + "\n");
    if (at == std::string::npos) return std::string();
    const size_t begin = out.rfind('\n', at);
    return out.substr(begin == std::string::npos ? 0 : begin + 1, at + name.size() - (begin == std::string::npos ? 0 : begin + 1));
  };
  const std::string gu = "model.layers.3.mlp.shared_experts.gate_up_proj.weight";
  std::string out, err;
  ASSERT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "8", "--expert_parallel", "--rank", "3",
                    "--moe_a2a_backend", "deepep"}, &out, &err), 0) << err;
  EXPECT_NE(line_of(out, gu).find("[4096, 7168]"), std::string::npos) << line_of(out, gu);
  ASSERT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "8", "--expert_parallel", "--rank", "3"}, &out, &err), 0) << err;
  EXPECT_NE(line_of(out, gu).find("[512, 7168]"), std::string::npos) << line_of(out, gu);
  EXPECT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "8", "--expert_parallel", "--rank", "3",
                    "--moe_a2a_backend", "pplx"}, &out, &err), 1);
  EXPECT_NE(err.find("unknown moe_a2a_backend `pplx`"), std::string::npos) << err;
}

// SGLang's --enable-dp-lm-head and --moe-dense-tp-size reach the preset: DeepSeek-V3 under
// --tp-size 8 --dp-size 8 (preset tp 1, dp 8), rank 3: lm_head [129280 / 8, 7168] or whole with
// the flag; the dense layer 0's gate_up_proj [2 x 18432 / 8, 7168] or whole with size 1.
TEST(LayoutCommandTest, SglangDpLmHeadAndDenseTpFlags) {
  const char* ds = "planner/testdata/deepseek-v3.json";
  auto line_of = [](const std::string& out, const std::string& name) {
    const size_t at = out.find(name + "\n");
    if (at == std::string::npos) return std::string();
    const size_t begin = out.rfind('\n', at);
    return out.substr(begin == std::string::npos ? 0 : begin + 1, at + name.size() - (begin == std::string::npos ? 0 : begin + 1));
  };
  const std::string gu = "model.layers.0.mlp.gate_up_proj.weight";
  std::string out, err;
  ASSERT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "1", "--dp", "8", "--rank", "3"}, &out, &err), 0) << err;
  EXPECT_NE(line_of(out, "lm_head.weight").find("[16160, 7168]"), std::string::npos) << line_of(out, "lm_head.weight");
  EXPECT_NE(line_of(out, gu).find("[4608, 7168]"), std::string::npos) << line_of(out, gu);
  ASSERT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "1", "--dp", "8", "--rank", "3", "--enable_dp_lm_head",
                    "--moe_dense_tp_size", "1"}, &out, &err), 0) << err;
  EXPECT_NE(line_of(out, "lm_head.weight").find("[129280, 7168]"), std::string::npos) << line_of(out, "lm_head.weight");
  EXPECT_NE(line_of(out, gu).find("[36864, 7168]"), std::string::npos) << line_of(out, gu);
  // What SGLang refuses is refused, naming the option.
  EXPECT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "8", "--rank", "3", "--enable_dp_lm_head"}, &out, &err), 1);
  EXPECT_NE(err.find("enable_dp_lm_head needs DP attention"), std::string::npos) << err;
  EXPECT_EQ(RunCmd({"--config", ds, "--preset", "sglang", "--tp", "1", "--dp", "8", "--rank", "3", "--moe_dense_tp_size", "2"}, &out, &err), 1);
  EXPECT_NE(err.find("moe_dense_tp_size=2"), std::string::npos) << err;
}

TEST(LayoutCommandTest, ErrorsAndUsage) {
  std::string out, err;
  EXPECT_EQ(RunCmd({"--config", kConfig, "--preset", "megatron", "--tp", "3"}, &out, &err), 1);
  EXPECT_NE(err.find("megatron"), std::string::npos) << err;
  EXPECT_EQ(RunCmd({"--config", kConfig}, &out, &err), 2);
  EXPECT_NE(err.find("--preset is required"), std::string::npos) << err;
  EXPECT_EQ(RunCmd({"--preset", "vllm"}, &out, &err), 2);
  EXPECT_EQ(RunCmd({"--addr", "127.0.0.1:1", "--model", "m", "--preset", "vllm"}, &out, &err), 2);
  EXPECT_NE(err.find("unix:PATH"), std::string::npos) << err;
  EXPECT_EQ(RunCmd({"--config", "/nonexistent.json", "--preset", "vllm"}, &out, &err), 2);
}

}  // namespace
}  // namespace wb::client
