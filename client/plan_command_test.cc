#include "client/plan_command.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"

namespace wb::client {
namespace {

constexpr char kSpec[] = "client/testdata/qwen05b_plan_spec.json";

TEST(PlanCommandTest, JsonHasEveryReadmeField) {
  std::ostringstream out, err;
  ASSERT_EQ(RunPlanCommand({"--spec", kSpec, "--json"}, out, err), 0) << err.str();
  const auto j = nlohmann::json::parse(out.str(), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out.str();
  for (const char* k : {"complete", "redundant_bytes", "bytes_inter_node", "bytes_intra_node", "num_ops",
                        "num_buckets", "plan_ms", "lower_bound_s", "makespan_s", "baselines", "fingerprint"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  EXPECT_EQ(j["complete"], true);
  EXPECT_EQ(j["redundant_bytes"], 0);
  EXPECT_GT(j["bytes_inter_node"].get<int64_t>(), 0);
  EXPECT_GT(j["num_ops"].get<int64_t>(), 0);
  ASSERT_TRUE(j["baselines"].contains("rank0_broadcast"));
  EXPECT_GT(j["baselines"]["rank0_broadcast"].get<double>(), j["makespan_s"].get<double>());
  EXPECT_LE(j["makespan_s"].get<double>(), 1.10 * j["lower_bound_s"].get<double>());
  EXPECT_EQ(j["fingerprint"].get<std::string>().size(), 32u);
  // Deterministic across runs.
  std::ostringstream out2;
  ASSERT_EQ(RunPlanCommand({"--spec=" + std::string(kSpec), "--json"}, out2, err), 0);
  EXPECT_EQ(nlohmann::json::parse(out2.str())["fingerprint"], j["fingerprint"]);
}

TEST(PlanCommandTest, QuantizedRolloutsReportWireBytes) {
  // Qwen2.5-0.5B, megatron tp=2 dp=2 -> vLLM tp=1 x 4 with MXFP8 (1x32 blocks along rows: every TP shard
  // holds whole blocks), planned with sender-side quantisation (the default of wbctl plan).
  std::ostringstream out, err;
  ASSERT_EQ(RunPlanCommand({"--spec", kSpec, "--json", "--quantization", "mxfp8"}, out, err), 0) << err.str();
  const auto j = nlohmann::json::parse(out.str(), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out.str();
  EXPECT_EQ(j["quantization"], "mxfp8");
  EXPECT_EQ(j["sender_quantization"], true);
  const int64_t canonical = j["bytes_inter_node"].get<int64_t>() + j["bytes_intra_node"].get<int64_t>();
  const int64_t quantized = j["sender_quantized_bytes"].get<int64_t>();
  EXPECT_GT(quantized, canonical / 2);  // the linear weights; embeddings and norms stay bf16
  // Quantised bytes travel as 1 byte per element + 1 scale byte per 32: 33/64 of bf16.
  EXPECT_EQ(j["wire_bytes"].get<int64_t>(), canonical - quantized + quantized / 64 * 33);
  EXPECT_LT(j["wire_bytes_inter_node"].get<int64_t>(), j["bytes_inter_node"].get<int64_t>());
  ASSERT_TRUE(j.contains("receiver_quantized"));
  EXPECT_LT(j["makespan_s"].get<double>(), j["receiver_quantized"]["makespan_s"].get<double>());
  EXPECT_LE(j["makespan_s"].get<double>(), 1.10 * j["lower_bound_s"].get<double>());

  // --receiver_quantization: the plan today's daemons execute, canonical bytes on the wire.
  std::ostringstream out2;
  ASSERT_EQ(RunPlanCommand({"--spec", kSpec, "--json", "--quantization=mxfp8", "--receiver_quantization"}, out2, err), 0)
      << err.str();
  const auto r = nlohmann::json::parse(out2.str());
  EXPECT_EQ(r["sender_quantized_bytes"], 0);
  EXPECT_EQ(r["wire_bytes"].get<int64_t>(), canonical);
  EXPECT_DOUBLE_EQ(r["makespan_s"].get<double>(), j["receiver_quantized"]["makespan_s"].get<double>());

  std::ostringstream out3, err3;
  EXPECT_EQ(RunPlanCommand({"--spec", kSpec, "--quantization", "fp4"}, out3, err3), 2);
  EXPECT_NE(err3.str().find("--quantization"), std::string::npos) << err3.str();
}

TEST(PlanCommandTest, TableByDefault) {
  std::ostringstream out, err;
  ASSERT_EQ(RunPlanCommand({"--spec", kSpec}, out, err), 0) << err.str();
  EXPECT_NE(out.str().find("makespan_s"), std::string::npos);
  EXPECT_NE(out.str().find("rank0_broadcast"), std::string::npos);
  EXPECT_NE(out.str().find("fingerprint"), std::string::npos);
}

TEST(PlanCommandTest, UsageAndSpecErrorsExitTwo) {
  {
    std::ostringstream out, err;
    EXPECT_EQ(RunPlanCommand({}, out, err), 2);
    EXPECT_NE(err.str().find("--spec"), std::string::npos);
  }
  {
    std::ostringstream out, err;
    EXPECT_EQ(RunPlanCommand({"--spec", kSpec, "--bogus"}, out, err), 2);
    EXPECT_NE(err.str().find("--bogus"), std::string::npos);
  }
  {
    std::ostringstream out, err;
    EXPECT_EQ(RunPlanCommand({"--spec", "client/testdata/does_not_exist.json"}, out, err), 2);
    EXPECT_NE(err.str().find("does_not_exist.json"), std::string::npos);
  }
  {
    const std::string bad = ::testing::TempDir() + "/bad_spec.json";
    std::ofstream(bad) << R"({"model": "x.json", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm", "tp": 2}, "cluster": {"gpus": 8}})";
    std::ostringstream out, err;
    EXPECT_EQ(RunPlanCommand({"--spec", bad}, out, err), 2);
    EXPECT_NE(err.str().find("bad spec"), std::string::npos) << err.str();
    EXPECT_TRUE(out.str().empty());
  }
}

// A spec whose model is not a regular file, or is too large, is refused naming it. Before
// (hostile probe): "model": "/dev/zero" grew wbctl by about 0.5 GB a second (10.9 GB in 20 s),
// and a FIFO hung it.
TEST(PlanCommandTest, ModelThatIsNotASmallRegularFileIsRefused) {
  const std::string dir = ::testing::TempDir();
  const std::string spec = dir + "/dev_zero_spec.json";
  std::ofstream(spec) << R"({"model": "/dev/zero", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm"}, "cluster": {}})";
  {
    std::ostringstream out, err;
    EXPECT_EQ(RunPlanCommand({"--spec", spec}, out, err), 2);
    EXPECT_NE(err.str().find("/dev/zero is not a regular file"), std::string::npos) << err.str();
  }
  const std::string big = dir + "/big_config.json";
  {
    std::ofstream f(big);
    const std::string mib(1 << 20, ' ');
    for (int i = 0; i < 65; ++i) f << mib;
  }
  const std::string spec2 = dir + "/big_model_spec.json";
  std::ofstream(spec2) << R"({"model": ")" << big << R"(", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm"}, "cluster": {}})";
  {
    std::ostringstream out, err;
    EXPECT_EQ(RunPlanCommand({"--spec", spec2}, out, err), 2);
    EXPECT_NE(err.str().find("big_config.json is larger than 67108864 bytes"), std::string::npos) << err.str();
  }
}

}  // namespace
}  // namespace wb::client
