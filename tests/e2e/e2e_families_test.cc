// End-to-end: the model families added in the thirty-fourth session through real daemons and
// worker processes on loopback, every rollout byte checked against the canonical weights of the
// version it applied (tests/common/weight_gen.h), in every mode (sync, one-step-off, async). An FSDP2 dp=2 trainer (both ranks
// on n0) publishes the HF tensors dim-0 sharded; rollouts on n1:
//
//   phi3_vllm_tp2:         Phi-3 (fused qkv_proj / gate_up_proj are the canonical tensors; each
//                          vLLM rank's qkv_proj holds a q, a k and a v box of the one fused tensor,
//                          its gate_up_proj a gate and an up box) -> vLLM tp=2.
//   phi3_sglang_tp4_mqa:   tied Phi-3 with 2 KV heads -> SGLang tp=4: each KV head replicated on
//                          two ranks, no lm_head.
//   olmo2_vllm_tp2:        OLMo-2 (no input_layernorm, full-width q_norm / k_norm whole on every
//                          rank, post_feedforward_layernorm) -> vLLM tp=2.
//
// Small configs of the real families (testdata/phi3-*.json, olmo2-2layer.json: 2 layers, hidden
// 512) so that each run fits the CI budget on 2 cores.
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
};

using Param = std::tuple<Case, std::string>;  // the case, the mode

std::string CaseName(const testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param);
}

class FamiliesTest : public testing::TestWithParam<Param> {};

TEST_P(FamiliesTest, FsdpToRolloutEveryByte) {
  const Case& c = std::get<0>(GetParam());
  PresetRun run{.harness = "families", .model_id = c.name, .config = c.config, .mode = std::get<1>(GetParam())};
  for (int r = 0; r < 2; ++r) run.trainers.push_back({true, 0, "fsdp", 1, 1, 2, 1, r, r});
  for (int r = 0; r < c.tp; ++r) run.rollouts.push_back({false, 1, c.engine, c.tp, 1, 1, 1, r, r});
  absl::Status s = RunPresetCase(run);
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(
    E2E, FamiliesTest,
    testing::Combine(testing::Values(Case{"phi3_vllm_tp2", "phi3-2layer.json", "vllm", 2},
                                     Case{"phi3_sglang_tp4_mqa", "phi3-tied-mqa-2layer.json", "sglang", 4},
                                     Case{"olmo2_vllm_tp2", "olmo2-2layer.json", "vllm", 2}),
                     testing::Values("sync", "one_step_off", "async")),
    CaseName);

}  // namespace
}  // namespace wb::e2e
