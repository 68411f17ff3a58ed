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
// compressed-tensors W4A16, groups of 32, bf16 scales, two elements per byte), and NVFP4 (nvfp4:
// e2m1 pairs, 1x16 blocks of e4m3 scales, a float32 global scale per local tensor that the fused
// qkv_proj's q, k and v pieces share; quantised by the receiving nodes only) - also with both
// ranks of one vLLM tp=2 engine on n1, whose global scales must come from the whole tensors
// (ModelOpt's weight_scale_2 on every rank), not from each rank's half; and with rank r of that
// engine on node r, where each node holds half of every tensor and the whole tensors' magnitudes
// come from the coordinator's ExchangeMagnitudes (every node's parts merged).
// Sender-side quantisation (issue 17.1): the coordinator plans it (the trainers' buffers are host
// memory), so ops whose trainer shard holds whole blocks travel quantised - quantised by n0 before
// sending, relayed as they are - and the rest falls back to the receiving node's quantiser: with
// fp8_block128 the tp=2 shards of q/k/v (448 / 64 / 64 rows) and o_proj (448 columns) are not whole
// 128x128 blocks, the MLP's (2432 rows / columns) are; with 1x32 blocks (mxfp8, w4a16) every shard
// is. Both paths must give the reference bytes, in every mode, and every version is verified by
// the end-to-end digests (over the quantised bytes for sender-quantised ops).
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

struct Case {
  std::string mode;           // sync | one_step_off | async
  std::string layout_source;  // preset | pieces
  std::string scheme;         // fp8_block128 | mxfp8 | w4a16_g32 | nvfp4
  int tp = 1;                 // 1: two tp=1 replicas, one per node; 2: one tp=2 replica on n1
  bool split = false;         // tp=2: rank r on node r (the engine spans both nodes)
};

std::string CaseName(const testing::TestParamInfo<Case>& info) {
  return info.param.mode + "_" + info.param.layout_source + "_" + info.param.scheme + (info.param.tp > 1 ? "_tp2" : "") + (info.param.split ? "_split" : "");
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
  run.versions = c.mode == "async" ? 3 : 2;
  run.timeout_ms = ScaledMs(60000);
  run.layout_source = c.layout_source;

  std::vector<WorkerSpec> trainers, rollouts;
  for (int r = 0; r < 2; ++r) trainers.push_back({true, 0, "megatron", 2, 1, 1, 1, r, r});
  for (int r = 0; r < 2; ++r) {
    WorkerSpec w{false, r, "vllm", 1, 1, 1, 2, r, 2};
    if (c.tp == 2) w = WorkerSpec{false, c.split ? r : 1, "vllm", 2, 1, 1, 1, r, 2};  // one engine: on n1, or rank r on node r
    w.extra_flags = {"--quantization=" + c.scheme};
    if (c.mode == "async") w.step_ms = 200;  // generate between updates: newer versions may supersede
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
  const uint64_t last = static_cast<uint64_t>(run.versions);
  for (Process* p : result->rollouts) {
    EXPECT_TRUE(EventsNamed(p, "mismatch").empty()) << p->LogTail();
    auto applied = EventsNamed(p, "applied");
    if (c.mode == "async") {
      ASSERT_FALSE(applied.empty()) << p->LogTail();
    } else {
      ASSERT_EQ(applied.size(), last) << p->LogTail();
    }
    EXPECT_EQ(applied.back()["version"].get<uint64_t>(), last);
    EXPECT_GT(VerifiedBytes(p, last), 0) << p->name();
  }
  // The trainers' node quantised on send (the log line it writes per version); with 128x128
  // blocks each rollout's node also quantised the pieces whose shards are not whole blocks. NVFP4
  // is never quantised on send (its global scale needs every piece of the group): both receiving
  // nodes quantise, and the wire carries bf16.
  const bool nvfp4 = c.scheme == "nvfp4";
  EXPECT_EQ(absl::StrContains(cl.node(0)->LogTail(1 << 22), "msg=\"version quantised on send\""), !nvfp4) << cl.node(0)->LogTail();
  if (c.scheme == "fp8_block128" || nvfp4) {
    for (int n = c.tp == 2 && !c.split ? 1 : 0; n < 2; ++n) {
      const std::string log = cl.node(n)->LogTail(1 << 22);
      EXPECT_TRUE(absl::StrContains(log, "msg=\"version quantised\"")) << cl.node(n)->LogTail();
      // NVFP4: every global scale from whole tensors (a tp=1 rank holds them; the tp=2 engine's
      // two ranks on n1 together do), none from a part. (The generated weights reach nearly the
      // same magnitude in every half of a tensor, so the elements alone would not tell.)
      if (nvfp4) {
        EXPECT_TRUE(absl::StrContains(log, "partial_global_scales=0")) << log;
        // Split: each node holds half of every tensor; the whole magnitudes came from the
        // coordinator's exchange (every tensor of the half answered).
        if (c.split) {
          EXPECT_TRUE(absl::StrContains(log, "exchanged_tensors=")) << log;
          EXPECT_FALSE(absl::StrContains(log, "exchanged_tensors=0")) << log;
        }
        for (char d = '1'; d <= '9'; ++d) EXPECT_FALSE(absl::StrContains(log, absl::StrCat("partial_global_scales=", std::string(1, d)))) << log;
      }
    }
  }
  // The plan moved quantised bytes, and the last version was proven op by op.
  auto st = cl.Status();
  ASSERT_TRUE(st.ok()) << st.status();
  bool found = false;
  for (const auto& m : st->models()) {
    if (m.model_id() != run.model_id) continue;
    found = true;
    const auto& ps = m.plan_stats();
    if (nvfp4) {
      EXPECT_EQ(ps.sender_quantized_bytes(), 0) << ps.ShortDebugString();
      EXPECT_EQ(ps.wire_bytes_inter_node(), ps.bytes_inter_node()) << ps.ShortDebugString();
      continue;
    }
    EXPECT_GT(ps.sender_quantized_bytes(), 0) << ps.ShortDebugString();
    EXPECT_LT(ps.wire_bytes(), ps.bytes_inter_node() + ps.bytes_intra_node()) << ps.ShortDebugString();
    EXPECT_LT(ps.wire_bytes_inter_node(), ps.bytes_inter_node()) << ps.ShortDebugString();
  }
  EXPECT_TRUE(found) << st->ShortDebugString();
  bool proven = false;
  for (const auto& vs : st->versions()) {
    if (vs.model_id() != run.model_id || vs.version() != last) continue;
    proven = vs.verified() && vs.ops_verified() == vs.num_ops() && vs.num_ops() > 0;
    EXPECT_TRUE(proven) << vs.ShortDebugString();
  }
  EXPECT_TRUE(proven) << "version " << last << " not verified: " << st->ShortDebugString();
}

INSTANTIATE_TEST_SUITE_P(E2E, QuantTest,
                         testing::Values(Case{"sync", "preset", "fp8_block128"}, Case{"one_step_off", "pieces", "fp8_block128"},
                                         Case{"async", "preset", "fp8_block128"}, Case{"sync", "pieces", "mxfp8"},
                                         Case{"one_step_off", "preset", "mxfp8"}, Case{"async", "pieces", "mxfp8"},
                                         Case{"sync", "pieces", "w4a16_g32"}, Case{"sync", "preset", "nvfp4"},
                                         Case{"one_step_off", "pieces", "nvfp4"}, Case{"sync", "preset", "nvfp4", 2},
                                         Case{"sync", "preset", "nvfp4", 2, true}, Case{"one_step_off", "pieces", "nvfp4", 2, true}),
                         CaseName);

}  // namespace
}  // namespace wb::e2e
