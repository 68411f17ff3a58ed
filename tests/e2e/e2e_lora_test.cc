// End-to-end: LoRA adapter-only versions (issue 17.3). A coordinator and two node daemons on
// loopback; a model declares LoRA adapters (ModelSpec.lora) and its versions carry the adapters
// alone: two PEFT trainer ranks on n0 (preset peft, dp=2, every adapter replicated; or peft_fsdp2,
// every adapter FSDP2-sharded on dim 0) publish lora_A / lora_B under PEFT names; two vLLM engines with tp=2 (preset vllm_lora) on n0 and n1
// receive them in vLLM's LoRA layout (qkv_proj / gate_up_proj slices: A whole, B row-sharded;
// o_proj / down_proj: A column-sharded, B whole). Every rollout checks EVERY byte of every piece
// against the canonical adapter weights of the version it applied, in sync and one-step-off mode.
//
//   qwen_all_targets:   Qwen2.5-0.5B (2 layers; 14 heads, 2 KV heads: tp=2 splits the KV heads),
//                       all seven PEFT targets, r=8, peft trainers, layouts sent as explicit pieces.
//   llama_gqa_replicated_kv: a small Llama (8 heads, 2 KV heads) with vLLM tp=4 (each KV head on
//                       two ranks), q/k/v/o + down_proj, r=4 in vLLM slots of max_lora_rank=8
//                       (strided pieces), peft_fsdp2 trainers, layouts sent as presets (resolved
//                       by the coordinator).
//   llama_gqa_fully_sharded: the same with vLLM's --fully-sharded-loras (S-LoRA): the column
//                       slices' lora_a split along the rank dim (ranks 0 and 1 hold rows [0, 2) and
//                       [2, 4), ranks 2 and 3 an empty slot), the row slices' lora_b along its rows.
//
// Then, on the same daemons, a merged-weight model (Megatron tp=2 -> vLLM tp=2, the full
// Qwen2.5-0.5B-2layer tensors) keeps working next to the adapter model.
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/lora.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

struct Case {
  std::string model;  // qwen_all_targets | llama_gqa_replicated_kv | llama_gqa_fully_sharded
  std::string mode;   // sync | one_step_off
};

std::string CaseName(const testing::TestParamInfo<Case>& info) { return info.param.model + "_" + info.param.mode; }

constexpr const char* kSmallLlama = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
  "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
  "vocab_size": 1000})";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Bytes a vllm_lora rank's pieces cover (what its "verified" events must add up to), computed by
// the planner from the same config the workers read.
int64_t RolloutPieceBytes(const std::string& config_json, const planner::LoraConfig& lora, int tp, int rank) {
  auto config = planner::ParseHfConfig(config_json);
  EXPECT_TRUE(config.ok()) << config.status();
  auto inv = planner::BuildLoraInventory(*config, lora, planner::DType::kBF16);
  EXPECT_TRUE(inv.ok()) << inv.status();
  planner::ParallelConfig p;
  p.preset = "vllm_lora";
  p.tp = tp;
  p.replicas = 2;
  auto l = planner::MakeLoraPresetLayout(*config, lora, *inv, p, rank);
  EXPECT_TRUE(l.ok()) << l.status();
  int64_t bytes = 0;
  for (const planner::Piece& piece : l->layout.pieces) {
    int64_t n = 2;
    for (size_t d = 0; d < piece.box.begin.size(); ++d) n *= piece.box.end[d] - piece.box.begin[d];
    bytes += n;
  }
  return bytes;
}

class LoraTest : public testing::TestWithParam<Case> {};

TEST_P(LoraTest, AdapterVersionsLandInVllmLoraLayoutByteExact) {
  const Case& c = GetParam();
  auto harness = Harness::Create("lora");
  ASSERT_TRUE(harness.ok()) << harness.status();
  ClusterOptions options;
  options.num_nodes = 2;
  auto cluster = Cluster::Start(harness->get(), options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& cl = **cluster;

  const bool qwen = c.model == "qwen_all_targets";
  RunOptions run;
  if (qwen) {
    run.config = ModelConfigPath();
  } else {
    run.config = (*harness)->Path("llama-gqa.json");
    std::ofstream(run.config) << kSmallLlama;
  }
  run.model_id = "lora-" + c.model + "-" + c.mode;
  run.mode = c.mode;
  run.versions = 3;
  run.timeout_ms = ScaledMs(60000);
  run.layout_source = qwen ? "pieces" : "preset";

  planner::LoraConfig lora;
  lora.target_modules = qwen ? std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
                             : std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"};
  lora.r = qwen ? 8 : 4;
  lora.alpha = 16;
  lora.max_lora_rank = qwen ? 0 : 8;
  lora.fully_sharded_loras = c.model == "llama_gqa_fully_sharded";
  std::string targets;
  for (const std::string& t : lora.target_modules) absl::StrAppend(&targets, targets.empty() ? "" : ",", t);
  const std::vector<std::string> lora_flags = {"--lora_targets=" + targets, absl::StrCat("--lora_r=", lora.r),
                                               absl::StrCat("--lora_alpha=", lora.alpha),
                                               absl::StrCat("--lora_max_rank=", lora.max_lora_rank),
                                               absl::StrCat("--lora_fully_sharded=", lora.fully_sharded_loras ? "true" : "false")};
  const int tp = qwen ? 2 : 4;

  std::vector<WorkerSpec> trainers, rollouts;
  for (int r = 0; r < 2; ++r) {
    WorkerSpec w{true, 0, qwen ? "peft" : "peft_fsdp2", 1, 1, 2, 1, r, r};
    w.extra_flags = lora_flags;
    trainers.push_back(w);
  }
  // Two engines of tp ranks: engine 0 on n0 (next to the trainers), engine 1 on n1.
  for (int r = 0; r < 2 * tp; ++r) {
    WorkerSpec w{false, r / tp, "vllm_lora", tp, 1, 1, 2, r, 2 + r % tp};
    w.extra_flags = lora_flags;
    rollouts.push_back(w);
  }
  auto result = cl.RunWorkers(run, trainers, rollouts);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s;
  if (HasFailure()) {
    auto st = cl.Status();
    ADD_FAILURE() << "cluster status at failure: " << (st.ok() ? st->DebugString() : st.status().ToString());
    return;
  }
  const std::string config_json = ReadFile(run.config);
  for (size_t r = 0; r < result->rollouts.size(); ++r) {
    Process* p = result->rollouts[r];
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    auto applied = EventsNamed(p, "applied");
    ASSERT_FALSE(applied.empty()) << p->LogTail();
    EXPECT_EQ(applied.back()["version"].get<uint64_t>(), 3u) << p->name();
    if (c.mode == "sync") {
      EXPECT_EQ(applied.size(), 3u) << p->LogTail();
    }
    // Every byte of the rank's vLLM LoRA slices was checked for the last version.
    EXPECT_EQ(VerifiedBytes(p, 3), RolloutPieceBytes(config_json, lora, tp, static_cast<int>(r))) << p->name();
  }

  // A merged-weight model on the same daemons keeps working next to the adapter model.
  RunOptions base;
  base.config = ModelConfigPath();
  base.model_id = "merged-" + c.mode;
  base.mode = c.mode;
  base.versions = 2;
  base.timeout_ms = ScaledMs(60000);
  base.layout_source = "preset";
  std::vector<WorkerSpec> base_trainers, base_rollouts;
  for (int r = 0; r < 2; ++r) base_trainers.push_back({true, 0, "megatron", 2, 1, 1, 1, r, r});
  for (int r = 0; r < 2; ++r) base_rollouts.push_back({false, 1, "vllm", 2, 1, 1, 1, r, r});
  auto merged = cl.RunWorkers(base, base_trainers, base_rollouts);
  ASSERT_TRUE(merged.ok()) << merged.status();
  for (const absl::Status& s : merged->failures) ADD_FAILURE() << s;
  for (Process* p : merged->rollouts) {
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    EXPECT_GT(VerifiedBytes(p, 2), 0) << p->name();
  }
  auto st = cl.Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(VersionState(*st, run.model_id, 3), "committed") << st->DebugString();
}

INSTANTIATE_TEST_SUITE_P(E2E, LoraTest,
                         testing::Values(Case{"qwen_all_targets", "sync"}, Case{"qwen_all_targets", "one_step_off"},
                                         Case{"llama_gqa_replicated_kv", "sync"},
                                         Case{"llama_gqa_replicated_kv", "one_step_off"}, Case{"llama_gqa_fully_sharded", "sync"}),
                         CaseName);

}  // namespace
}  // namespace wb::e2e
