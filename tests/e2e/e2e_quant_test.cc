// End-to-end: quantised rollout targets (user ask 5). A Megatron tp=2 trainer (both ranks on n0)
// publishes bf16 weights; two vLLM tp=1 rollouts hold them as float8_e4m3 with 128x128 block scales
// (preset quantization fp8_block128): one on n0 (same node, host_shm), one on n1 (across nodes,
// host_tcp). Real daemons and worker processes on loopback. Bytes travel in bf16 into the
// rollouts' staging shadows; the receiving node quantises once the version has landed; commit /
// Apply copy fp8 elements and scales into the live buffer. Every rollout checks EVERY element and
// scale against its own reference quantisation of the canonical weights (tests/e2e/weights.cc,
// independent of daemon/quantize), in sync and one-step-off mode, with the layout reaching the
// daemon as a preset (resolved by the coordinator) and as explicit pieces; once with MXFP8 (preset
// quantization mxfp8: 1x32 blocks, float8_e8m0 scales) and once with INT4 (w4a16_g32:
// compressed-tensors W4A16, groups of 32, bf16 scales, two elements per byte).
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

struct Case {
  std::string mode;           // sync | one_step_off
  std::string layout_source;  // preset | pieces
  std::string scheme;         // fp8_block128 | mxfp8
};

std::string CaseName(const testing::TestParamInfo<Case>& info) {
  return info.param.mode + "_" + info.param.layout_source + "_" + info.param.scheme;
}

class QuantTest : public testing::TestWithParam<Case> {};

TEST_P(QuantTest, QuantisedRolloutsMatchTheReferenceQuantisation) {
  const Case& c = GetParam();
  auto harness = Harness::Create("quant");
  ASSERT_TRUE(harness.ok()) << harness.status();
  ClusterOptions options;
  options.num_nodes = 2;
  auto cluster = Cluster::Start(harness->get(), options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& cl = **cluster;

  RunOptions run;
  run.config = ModelConfigPath();
  run.model_id = "qwen-" + c.scheme + "-" + c.mode;
  run.mode = c.mode;
  run.versions = 2;
  run.timeout_ms = ScaledMs(60000);
  run.layout_source = c.layout_source;

  std::vector<WorkerSpec> trainers, rollouts;
  for (int r = 0; r < 2; ++r) trainers.push_back({true, 0, "megatron", 2, 1, 1, 1, r, r});
  for (int r = 0; r < 2; ++r) {
    WorkerSpec w{false, r, "vllm", 1, 1, 1, 2, r, 2};
    w.extra_flags = {"--quantization=" + c.scheme};
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
  for (Process* p : result->rollouts) {
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    auto applied = EventsNamed(p, "applied");
    ASSERT_EQ(applied.size(), 2u) << p->LogTail();
    EXPECT_EQ(applied.back()["version"].get<uint64_t>(), 2u);
    EXPECT_GT(VerifiedBytes(p, 2), 0) << p->name();
  }
  // Each node quantised its own rollout's pieces (the log line the daemon writes per version).
  for (int n = 0; n < 2; ++n) {
    EXPECT_TRUE(absl::StrContains(cl.node(n)->LogTail(1 << 22), "msg=\"version quantised\"")) << cl.node(n)->LogTail();
  }
}

INSTANTIATE_TEST_SUITE_P(E2E, QuantTest,
                         testing::Values(Case{"sync", "preset", "fp8_block128"}, Case{"one_step_off", "pieces", "fp8_block128"},
                                         Case{"one_step_off", "preset", "mxfp8"}, Case{"sync", "pieces", "w4a16_g32"}),
                         CaseName);

}  // namespace
}  // namespace wb::e2e
