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
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

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
  const std::string& mode = std::get<1>(GetParam());
  auto harness = Harness::Create("families");
  ASSERT_TRUE(harness.ok()) << harness.status();
  ClusterOptions options;
  options.num_nodes = 2;
  auto cluster = Cluster::Start(harness->get(), options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& cl = **cluster;

  RunOptions run;
  run.config = Runfile("tests/e2e/testdata/" + c.config);
  run.model_id = c.name;
  run.mode = mode;
  run.versions = 3;
  run.timeout_ms = ScaledMs(60000);
  run.layout_source = "preset";  // the coordinator resolves the presets from the config

  std::vector<WorkerSpec> trainers, rollouts;
  for (int r = 0; r < 2; ++r) trainers.push_back({true, 0, "fsdp", 1, 1, 2, 1, r, r});
  for (int r = 0; r < c.tp; ++r) rollouts.push_back({false, 1, c.engine, c.tp, 1, 1, 1, r, r});
  if (mode == "one_step_off") {
    // A training step between publishes: one-step-off trainers do not wait for the rollouts, and an
    // Apply(v) that finds v + 1 committed already applies the newest (docs/daemon.md), which this
    // test would count as a skipped version.
    for (auto& t : trainers) t.step_ms = 300;
  }
  auto result = cl.RunWorkers(run, trainers, rollouts);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s;
  if (HasFailure()) {
    auto st = cl.Status();
    ADD_FAILURE() << "cluster status at failure: " << (st.ok() ? st->DebugString() : st.status().ToString());
    return;
  }
  const uint64_t last = static_cast<uint64_t>(run.versions);
  int64_t verified = 0;
  absl::Status applied = CheckRolloutsApplied(result->rollouts, mode, last, &verified);
  EXPECT_TRUE(applied.ok()) << applied;
  // The engine's ranks together hold the whole model at least once (norms and replicated KV heads
  // more often; vocabulary padding is not verified).
  const int64_t model_bytes = ModelBytes(run.config);
  ASSERT_GT(model_bytes, 0);
  EXPECT_GE(verified, model_bytes);
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
