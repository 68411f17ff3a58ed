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
