// End-to-end: a coordinator and three node daemons as separate processes on loopback, trainer and
// rollout workers as separate processes with their weights in POSIX shared memory, in every mode.
//
//   megatron_to_vllm:        Megatron tp=2 pp=2 (4 trainer ranks on n0, n1) -> vLLM tp=2 x 2
//                            replicas (rollout ranks on n1, n2): resharding across nodes,
//                            interleaved linear_qkv -> [q;k;v] qkv_proj, pp stages, tied embeddings.
//   fsdp_to_vllm_colocated:  FSDP2 dp=4 dim-0 shards -> vLLM tp=2 x 2 replicas, rollout rank i on the
//                            same node and slot as trainer rank i (n0, n1).
//
// Model: Qwen2.5-0.5B's real inventory with the layer count reduced 24 -> 2
// (testdata/qwen2.5-0.5b-2layer.json: every tensor kind and shape of the family kept, 0.33 GB in
// bf16) so that six runs with every byte checked fit in the CI budget on 2 cores.
// Every rollout checks EVERY byte of every piece against the canonical weights of the version it
// applied (tests/common/weight_gen.h); the test also checks the verified bytes add up to the whole
// model once per replica, that each rollout saw the versions its mode promises, and that
// `wbctl status/versions --json` report the committed version and a transfer rate.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

struct Case {
  std::string layout;  // megatron_to_vllm | fsdp_to_vllm_colocated
  std::string mode;    // sync | one_step_off | async
};

std::string CaseName(const testing::TestParamInfo<Case>& info) {
  return info.param.layout + "_" + info.param.mode;
}

class ModesTest : public testing::TestWithParam<Case> {};

TEST_P(ModesTest, EveryRolloutByteMatchesTheAppliedVersion) {
  const Case& c = GetParam();
  auto harness = Harness::Create("modes");
  ASSERT_TRUE(harness.ok()) << harness.status();
  auto cluster = Cluster::Start(harness->get(), ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& cl = **cluster;

  RunOptions run;
  run.config = ModelConfigPath();
  run.model_id = "qwen-" + c.layout;
  run.mode = c.mode;
  run.versions = c.mode == "async" ? 3 : 2;
  run.timeout_ms = ScaledMs(60000);
  // Both ways a layout reaches the daemon: explicit pieces (computed by the worker from the
  // preset) and the preset by name (computed by the daemon); the worker checks its bytes with its
  // own computation either way.
  run.layout_source = c.layout == "megatron_to_vllm" ? "pieces" : "preset";

  std::vector<WorkerSpec> trainers, rollouts;
  if (c.layout == "megatron_to_vllm") {
    for (int r = 0; r < 4; ++r) {
      trainers.push_back({true, r < 2 ? 0 : 1, "megatron", 2, 2, 1, 1, r, r % 2});
    }
    for (int r = 0; r < 4; ++r) {
      rollouts.push_back({false, r < 2 ? 1 : 2, "vllm", 2, 1, 1, 2, r, r < 2 ? 2 + r : r - 2});
    }
  } else {
    for (int r = 0; r < 4; ++r) trainers.push_back({true, r / 2, "fsdp", 1, 1, 4, 1, r, r % 2});
    for (int r = 0; r < 4; ++r) rollouts.push_back({false, r / 2, "vllm", 2, 1, 1, 2, r, r % 2});
  }
  if (c.mode == "async") {
    // Rollouts generate for a while between updates, so newer versions can supersede.
    for (auto& r : rollouts) r.step_ms = 200;
  }
  auto result = cl.RunWorkers(run, trainers, rollouts);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s;
  const std::vector<Process*>& r_procs = result->rollouts;
  if (HasFailure()) {
    auto st = cl.Status();
    ADD_FAILURE() << "cluster status at failure: "
                  << (st.ok() ? st->DebugString() : st.status().ToString());
    return;
  }

  const uint64_t last = static_cast<uint64_t>(run.versions);
  const int64_t model_bytes = ModelBytes(run.config);
  ASSERT_GT(model_bytes, 0);
  std::map<uint64_t, int64_t> verified_per_version;
  for (Process* p : r_procs) {
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    auto applied = EventsNamed(p, "applied");
    ASSERT_FALSE(applied.empty()) << p->name();
    uint64_t prev = 0;
    for (auto& e : applied) {
      uint64_t v = e["version"].get<uint64_t>();
      EXPECT_GT(v, prev) << p->name() << " applied versions must increase";
      if (c.mode != "async") {
        EXPECT_EQ(v, prev + 1) << p->name() << " skipped a version in " << c.mode;
      }
      prev = v;
      verified_per_version[v] += VerifiedBytes(p, v);
    }
    EXPECT_EQ(prev, last) << p->name() << " did not end on the last version";
  }
  // Each rollout checked every byte its layout holds (the worker walks all of its pieces), and
  // each replica holds at least the whole model (more where vLLM replicates: norms on every tp
  // rank), so at least 2 x the model was checked for the last version.
  for (Process* p : r_procs) EXPECT_GT(VerifiedBytes(p, last), 0) << p->name();
  EXPECT_GE(verified_per_version[last], 2 * model_bytes);

  // The operator's view agrees.
  std::vector<std::string> lines;
  auto code = cl.RunWbctl({"status", "--addr", cl.coordinator_address(), "--json"},
                          Scaled(absl::Seconds(30)), &lines);
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0);
  ASSERT_FALSE(lines.empty());
  auto status = nlohmann::json::parse(lines.back(), nullptr, false);
  ASSERT_FALSE(status.is_discarded()) << lines.back();
  bool found = false;
  for (auto& m : status["models"]) {
    if (m.value("model_id", "") != run.model_id) continue;
    found = true;
    EXPECT_EQ(m.value("committed_version", uint64_t{0}), last);
    EXPECT_GT(m.value("last_transfer_GBps", 0.0), 0.0);
    EXPECT_EQ(m.value("mode", ""), c.mode);
  }
  EXPECT_TRUE(found) << lines.back();
  code = cl.RunWbctl({"versions", "--addr", cl.coordinator_address(), "--model", run.model_id,
                      "--json"},
                     Scaled(absl::Seconds(30)), &lines);
  ASSERT_TRUE(code.ok());
  ASSERT_EQ(*code, 0);
  auto versions = nlohmann::json::parse(lines.back(), nullptr, false);
  ASSERT_FALSE(versions.is_discarded());
  bool last_committed = false;
  for (auto& v : versions["versions"]) {
    EXPECT_NE(v.value("state", ""), "aborted") << v.dump();
    if (v.value("version", uint64_t{0}) == last) last_committed = v.value("state", "") == "committed";
  }
  EXPECT_TRUE(last_committed) << versions.dump();
  // Watching a version that already committed returns at once with 0.
  code = cl.RunWbctl({"watch", "--addr", cl.coordinator_address(), "--model", run.model_id,
                      "--version", std::to_string(last), "--timeout", absl::StrCat(20 * kTimeScale, "s"), "--json"},
                     Scaled(absl::Seconds(30)), &lines);
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  code = cl.RunWbctl({"versions", "--addr", cl.coordinator_address(), "--model", "nope"},
                     Scaled(absl::Seconds(30)));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 6);  // unknown model
}

INSTANTIATE_TEST_SUITE_P(
    E2E, ModesTest,
    testing::Values(Case{"megatron_to_vllm", "sync"}, Case{"megatron_to_vllm", "one_step_off"},
                    Case{"megatron_to_vllm", "async"}, Case{"fsdp_to_vllm_colocated", "sync"},
                    Case{"fsdp_to_vllm_colocated", "one_step_off"},
                    Case{"fsdp_to_vllm_colocated", "async"}),
    CaseName);

}  // namespace
}  // namespace wb::e2e
