// End-to-end: the model families added in the thirty-fifth session through real daemons and worker
// processes on loopback, every rollout byte checked against the canonical weights of the version it
// applied (tests/common/weight_gen.h), in every mode (sync, one-step-off, async). An FSDP2 dp=2
// trainer (both ranks on n0) publishes the HF tensors dim-0 sharded; rollouts on n1:
//
//   dsv32_vllm_tp2:       DeepSeek-V3.2 (MLA, MoE, float32 e_score_correction_bias, the DSA
//                         indexer: wq_b whole, wk + weights_proj fused into wk_weights_proj whole,
//                         float32 k_norm weight / bias whole) -> vLLM tp=2.
//   dsv32_sglang_tp2_ep:  the same -> SGLang tp=2 with expert parallelism (the indexer under the
//                         checkpoint names, whole on every rank; experts 0..3 / 4..7).
//   minimax_vllm_tp2:     MiniMax-M2 (full-width q_norm / k_norm split over the TP ranks,
//                         block_sparse_moe experts, float32 e_score_correction_bias on the MoE
//                         block) -> vLLM tp=2.
//   minimax_sglang_tp4_ep: the same -> SGLang tp=4 with expert parallelism: 2 KV heads, each (and
//                         its k_norm part) replicated on two ranks.
//
// Small configs of the real families (testdata/deepseek-v32-2layer.json, minimax-m2-2layer.json:
// 2 layers, hidden 256) so that each run fits the CI budget on 2 cores.
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
  std::string engine;  // vllm | sglang
  int tp = 2;
  bool expert_parallel = false;
};

using Param = std::tuple<Case, std::string>;  // the case, the mode

std::string CaseName(const testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param);
}

class Families2Test : public testing::TestWithParam<Param> {};

TEST_P(Families2Test, FsdpToRolloutEveryByte) {
  const Case& c = std::get<0>(GetParam());
  PresetRun run{.harness = "families2", .model_id = c.name, .config = c.config, .mode = std::get<1>(GetParam())};
  for (int r = 0; r < 2; ++r) run.trainers.push_back({true, 0, "fsdp", 1, 1, 2, 1, r, r});
  for (int r = 0; r < c.tp; ++r) {
    run.rollouts.push_back({false, 1, c.engine, c.tp, 1, 1, 1, r, r});
    if (c.expert_parallel) run.rollouts.back().extra_flags.push_back("--expert_parallel");
  }
  absl::Status s = RunPresetCase(run);
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(
    E2E, Families2Test,
    testing::Combine(testing::Values(Case{"dsv32_vllm_tp2", "deepseek-v32-2layer.json", "vllm", 2},
                                     Case{"dsv32_sglang_tp2_ep", "deepseek-v32-2layer.json", "sglang", 2, true},
                                     Case{"minimax_vllm_tp2", "minimax-m2-2layer.json", "vllm", 2},
                                     Case{"minimax_sglang_tp4_ep", "minimax-m2-2layer.json", "sglang", 4, true}),
                     testing::Values("sync", "one_step_off", "async")),
    CaseName);

}  // namespace
}  // namespace wb::e2e
