// End-to-end: FSDP2 + TP trainers (preset fsdp2_tp: NeMo-RL's DTensor policy / torchtitan, a
// (dp_shard, tp) mesh with tp = 2 fastest and dp = 2; docs/presets.md) through real daemons and
// worker processes on loopback, every rollout byte checked against the canonical weights of the
// version it applied (tests/common/weight_gen.h), in every mode (sync, one-step-off, async). The
// four trainer ranks (n0) each hold FSDP2's dim-0 chunk of their TP part; rollouts on n1:
//
//   qwen3_vllm_tp2:        untied Qwen3 (q_norm / k_norm) -> vLLM tp=2 (the trainers' TP split
//                          and the engine's coincide for the linears, not for the dp chunks).
//   qwen3_vllm_tp4:        the same -> vLLM tp=4 (one KV head per engine rank).
//   llama_tied_vllm_tp4:   tied Llama with 2 KV heads -> vLLM tp=4 (each KV head on two ranks).
//
// vocab 10003 and intermediate 1000: the TP parts and FSDP2 chunks of the vocabulary are uneven.
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/e2e/preset_run.h"

namespace wb::e2e {
namespace {

struct Case {
  std::string name;
  std::string config;  // tests/e2e/testdata/...
  int engine_tp = 2;
};

using Param = std::tuple<Case, std::string>;  // the case, the mode

std::string CaseName(const testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param);
}

class Fsdp2TpTest : public testing::TestWithParam<Param> {};

TEST_P(Fsdp2TpTest, Fsdp2TpTrainersToVllmEveryByte) {
  const Case& c = std::get<0>(GetParam());
  PresetRun run{.harness = "fsdp2tp", .model_id = c.name, .config = c.config, .mode = std::get<1>(GetParam())};
  // WorkerSpec {trainer, node, preset, tp, pp, dp, replicas, rank, gpu}: rank = shard * tp + tp_rank.
  for (int r = 0; r < 4; ++r) run.trainers.push_back({true, 0, "fsdp2_tp", 2, 1, 2, 1, r, r});
  for (int r = 0; r < c.engine_tp; ++r) run.rollouts.push_back({false, 1, "vllm", c.engine_tp, 1, 1, 1, r, r});
  absl::Status s = RunPresetCase(run);
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(
    E2E, Fsdp2TpTest,
    testing::Combine(testing::Values(Case{"qwen3_vllm_tp2", "qwen3-fsdp2tp-2layer.json", 2},
                                     Case{"qwen3_vllm_tp4", "qwen3-fsdp2tp-2layer.json", 4},
                                     Case{"llama_tied_vllm_tp4", "llama-tied-gqa-fsdp2tp-2layer.json", 4}),
                     testing::Values("sync", "one_step_off", "async")),
    CaseName);

}  // namespace
}  // namespace wb::e2e
