#include "planner/spec.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace wb::planner {
namespace {

// Test-only: reads the checked-in HF configs (runfiles of :testdata_models).
absl::StatusOr<std::string> ReadTestdata(std::string_view path) {
  std::ifstream f(absl::StrCat("planner/testdata/", std::string(path)));
  if (!f) return absl::NotFoundError(absl::StrCat("no testdata ", std::string(path)));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

constexpr char kSpec[] = R"({
  "model": "qwen2.5-0.5b.json",
  "dtype": "bfloat16",
  "trainer": {"layout": "megatron", "tp": 2, "pp": 2, "dp": 1},
  "rollout": {"layout": "vllm", "tp": 2, "replicas": 3},
  "cluster": {"gpus_per_node": 4, "nic_GBps_per_gpu": 25, "intra_node_GBps": 200, "colocated": false}
})";

TEST(SpecTest, ParsesEveryField) {
  auto spec = ParsePlanSpec(kSpec, ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model.architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(spec->dtype, DType::kBF16);
  EXPECT_EQ(spec->trainer.preset, "megatron");
  EXPECT_EQ(spec->trainer.tp, 2);
  EXPECT_EQ(spec->trainer.pp, 2);
  EXPECT_EQ(spec->rollout.preset, "vllm");
  EXPECT_EQ(spec->rollout.replicas, 3);
  EXPECT_EQ(spec->gpus_per_node, 4);
  EXPECT_DOUBLE_EQ(spec->topology.nic_GBps_per_gpu, 25);
  EXPECT_DOUBLE_EQ(spec->topology.intra_node_GBps, 200);
  EXPECT_FALSE(spec->topology.colocated);
}

TEST(SpecTest, InlineModelObject) {
  auto text = ReadTestdata("qwen2.5-0.5b.json");
  ASSERT_TRUE(text.ok());
  const std::string spec_json = absl::StrCat(
      R"({"model": )", *text,
      R"(, "trainer": {"layout": "fsdp", "dp": 4}, "rollout": {"layout": "sglang", "tp": 2},
         "cluster": {"gpus_per_node": 4, "colocated": true}})");
  auto spec = ParsePlanSpec(spec_json, nullptr);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->trainer.dp, 4);
  EXPECT_TRUE(spec->topology.colocated);
}

TEST(SpecTest, RolloutQuantization) {
  std::string json = kSpec;
  json.replace(json.find(R"("replicas": 3})"), 14, R"("replicas": 3, "quantization": "w4a16_g32"})");
  auto spec = ParsePlanSpec(json, ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rollout.quantization, "w4a16_g32");
  auto p = BuildProblem(*spec);
  ASSERT_TRUE(p.ok()) << p.status();
  int quantized = 0;
  for (const Worker& w : p->workers) {
    for (const Piece& pc : w.layout.pieces) quantized += pc.quant.has_value() && pc.quant->dtype == DType::kI4;
  }
  EXPECT_GT(quantized, 0);
  json.replace(json.find("w4a16_g32"), 9, "none");
  auto none = ParsePlanSpec(json, ReadTestdata);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->rollout.quantization, "");
}

TEST(SpecTest, ErrorsNameTheField) {
  struct Case {
    std::string json;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"{", "not valid JSON"},
      {R"({"trainer": {}})", "'model'"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "deepspeed"}, "rollout": {"layout": "vllm"}, "cluster": {}})",
       "trainer.layout"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron", "tp": 0}, "rollout": {"layout": "vllm"}, "cluster": {}})",
       "trainer.tp"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm", "tpp": 2}, "cluster": {}})",
       "rollout.tpp"},
      {R"({"model": "qwen2.5-0.5b.json", "dtype": "int4", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm"}, "cluster": {}})",
       "dtype"},
      {R"({"model": "missing.json", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm"}, "cluster": {}})",
       "missing.json"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm"}, "cluster": {"nic_GBps_per_gpu": -1}})",
       "cluster.nic_GBps_per_gpu"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp"}, "rollout": {"layout": "vllm"}, "cluster": {}})",
       "trainer.dp"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm", "quantization": "fp4"}, "cluster": {}})",
       "rollout.quantization"},
      {R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron"}, "rollout": {"layout": "vllm", "quantization": 8}, "cluster": {}})",
       "rollout.quantization"},
  };
  for (const Case& c : cases) {
    auto spec = ParsePlanSpec(c.json, ReadTestdata);
    ASSERT_FALSE(spec.ok()) << c.json;
    EXPECT_NE(spec.status().message().find(c.want), std::string::npos)
        << "want '" << c.want << "' in: " << spec.status().message();
  }
}

// Absurd but well-formed specs are refused before they take the machine's memory. Before (hostile
// probe): rollout.replicas 2^20 built layouts until wbctl died of std::bad_alloc; 16,384 replicas
// of Qwen2.5-0.5B died at a 5 GB limit after 35 s; values over 2^20 were "must be an integer >= 1".
TEST(SpecTest, AbsurdSizesAreRefusedBeforeTheyAreBuilt) {
  auto spec_with = [](const std::string& trainer, const std::string& rollout) {
    return absl::StrCat(R"({"model": "qwen2.5-0.5b.json", "trainer": )", trainer, R"(, "rollout": )", rollout,
                        R"(, "cluster": {"gpus_per_node": 8}})");
  };
  absl::StatusOr<PlanSpec> over = ParsePlanSpec(spec_with(R"({"layout": "megatron"})", R"({"layout": "vllm", "replicas": 1048577})"), ReadTestdata);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("rollout.replicas"), std::string::npos) << over.status();
  EXPECT_NE(over.status().message().find("must be an integer in [1, 1048576]"), std::string::npos) << over.status();

  absl::StatusOr<PlanSpec> ranks = ParsePlanSpec(spec_with(R"({"layout": "megatron"})", R"({"layout": "vllm", "replicas": 1048576})"), ReadTestdata);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  absl::StatusOr<Problem> p = BuildProblem(*ranks);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
  EXPECT_NE(p.status().message().find("1 trainer and 1048576 rollout ranks, more than the limit of 65536"), std::string::npos) << p.status();

  // Within the rank limit, but 16,384 replicas x ~290 pieces: refused once the pieces pass 2^21.
  absl::StatusOr<PlanSpec> pieces = ParsePlanSpec(spec_with(R"({"layout": "megatron"})", R"({"layout": "vllm", "replicas": 16384})"), ReadTestdata);
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  p = BuildProblem(*pieces);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
  EXPECT_NE(p.status().message().find("more than 2097152 pieces in all"), std::string::npos) << p.status();
}

TEST(SpecTest, PlacementTrainersFirstThenRolloutsReplicaMajor) {
  auto spec = ParsePlanSpec(kSpec, ReadTestdata);
  ASSERT_TRUE(spec.ok());
  auto problem = BuildProblem(*spec);
  ASSERT_TRUE(problem.ok()) << problem.status();
  ASSERT_EQ(problem->workers.size(), 4u + 6u);
  for (int r = 0; r < 4; ++r) {
    const Worker& w = problem->workers[r];
    EXPECT_EQ(w.role, Role::kTrainer);
    EXPECT_EQ(w.id, absl::StrCat("trainer/", r));
    EXPECT_EQ(w.node, 0);
    EXPECT_EQ(w.gpu, r);
  }
  // 4 trainers fill node 0; rollouts start on node 1, replica-major.
  for (int i = 0; i < 6; ++i) {
    const Worker& w = problem->workers[4 + i];
    EXPECT_EQ(w.role, Role::kRollout);
    EXPECT_EQ(w.id, absl::StrCat("rollout/", i / 2, "/", i % 2));
    EXPECT_EQ(w.node, 1 + i / 4);
    EXPECT_EQ(w.gpu, i % 4);
  }
  auto plan = MakePlan(*problem, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->stats.complete);
  EXPECT_EQ(plan->stats.redundant_bytes, 0);
  EXPECT_LE(plan->stats.makespan_s, 1.10 * plan->stats.lower_bound_s);
  // Every trainer NIC sends (no rank-0 funnel).
  std::set<int> senders;
  for (const Bucket& b : plan->buckets) {
    for (const TransferOp& op : b.ops) {
      if (problem->workers[op.src_worker].role == Role::kTrainer) senders.insert(op.src_worker);
    }
  }
  EXPECT_EQ(senders.size(), 4u);
}

TEST(SpecTest, ColocatedRolloutGpuIIsTrainerGpuI) {
  auto spec = ParsePlanSpec(
      R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp", "dp": 4},
          "rollout": {"layout": "vllm", "tp": 2, "replicas": 2},
          "cluster": {"gpus_per_node": 4, "colocated": true}})",
      ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto problem = BuildProblem(*spec);
  ASSERT_TRUE(problem.ok()) << problem.status();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(problem->workers[4 + i].node, problem->workers[i].node);
    EXPECT_EQ(problem->workers[4 + i].gpu, problem->workers[i].gpu);
  }
  auto plan = MakePlan(*problem, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stats.bytes_inter_node, 0);
  EXPECT_TRUE(plan->stats.complete);
  EXPECT_LE(plan->stats.makespan_s, 1.10 * plan->stats.lower_bound_s);
}

TEST(SpecTest, PresetConstraintErrorsPropagate) {
  // 14 heads / 2 kv heads cannot be split 4-way by megatron (tp must divide kv heads).
  auto spec = ParsePlanSpec(
      R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron", "tp": 4},
          "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})",
      ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto problem = BuildProblem(*spec);
  EXPECT_FALSE(problem.ok());
  EXPECT_NE(problem.status().message().find("trainer"), std::string::npos) << problem.status();
}

// The layouts users run (docs/presets.md): vLLM DP+EP, Megatron custom splits + virtual pipeline,
// FSDP2 with HSDP replicas; the problem validates and plans completely.
TEST(SpecTest, DataParallelExpertParallelAndCustomPipeline) {
  const std::string json = R"({"model": "qwen3-30b-a3b.json",
    "trainer": {"layout": "megatron", "tp": 2, "pp": 4, "dp": 2, "ep": 4, "etp": 1, "first_stage_layers": 15,
                "last_stage_layers": 15, "vpp": 3},
    "rollout": {"layout": "vllm", "tp": 2, "dp": 4, "expert_parallel": true, "expert_placement": "round_robin", "replicas": 1},
    "cluster": {"gpus_per_node": 8}})";
  auto spec = ParsePlanSpec(json, ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->trainer.vpp, 3);
  EXPECT_EQ(spec->rollout.dp, 4);
  auto p = BuildProblem(*spec);
  ASSERT_TRUE(p.ok()) << p.status();
  int rollouts = 0;
  for (const Worker& w : p->workers) rollouts += w.role == Role::kRollout;
  EXPECT_EQ(rollouts, 8);
  auto plan = MakePlan(*p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->stats.complete);
  auto hsdp = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp2", "dp": 2, "replicas": 2},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_TRUE(hsdp.ok()) << hsdp.status();
  EXPECT_EQ(hsdp->trainer.replicas, 2);
  auto bad = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp", "dp": 2, "vpp": 2},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("trainer.vpp"), std::string::npos) << bad.status();
  // FSDP2 + TP trainers: tp, dp and replicas (world tp * dp * replicas), no other sizes.
  auto tp2 = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp2_tp", "tp": 2, "dp": 2, "replicas": 2},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_TRUE(tp2.ok()) << tp2.status();
  EXPECT_EQ(tp2->trainer.tp, 2);
  auto tp2_problem = BuildProblem(*tp2);
  ASSERT_TRUE(tp2_problem.ok()) << tp2_problem.status();
  int tp2_trainers = 0;
  for (const Worker& w : tp2_problem->workers) tp2_trainers += w.role == Role::kTrainer;
  EXPECT_EQ(tp2_trainers, 8);
  auto tp2_plan = MakePlan(*tp2_problem, Strategy::kWeightBridge);
  ASSERT_TRUE(tp2_plan.ok()) << tp2_plan.status();
  EXPECT_TRUE(tp2_plan->stats.complete);
  auto tp2_pp = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp_tp", "tp": 2, "dp": 2, "pp": 2},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(tp2_pp.ok());
  EXPECT_NE(tp2_pp.status().message().find("trainer.pp"), std::string::npos) << tp2_pp.status();
  auto fsdp_tp = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp", "tp": 2, "dp": 2},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(fsdp_tp.ok());
  EXPECT_NE(fsdp_tp.status().message().find("trainer.tp"), std::string::npos) << fsdp_tp.status();
  // DeepSpeed ZeRO-3 trainers (= fsdp_flat): dp only.
  auto zero3 = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "deepspeed_zero3", "dp": 3},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_TRUE(zero3.ok()) << zero3.status();
  EXPECT_EQ(zero3->trainer.preset, "deepspeed_zero3");
  auto zero3_replicas = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "deepspeed_zero3", "dp": 2, "replicas": 2},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(zero3_replicas.ok());
  EXPECT_NE(zero3_replicas.status().message().find("trainer.replicas"), std::string::npos) << zero3_replicas.status();
}

// Megatron-LM / Megatron-Bridge options that change names, vocab rows or rank order.
TEST(SpecTest, MegatronOptions) {
  const std::string json = R"({"model": "qwen3-30b-a3b.json",
    "trainer": {"layout": "megatron", "tp": 2, "pp": 2, "dp": 2, "ep": 2, "etp": 1, "make_vocab_size_divisible_by": 1,
                "moe_grouped_gemm": true, "moe_use_legacy_grouped_gemm": true, "use_tp_pp_dp_mapping": true},
    "rollout": {"layout": "vllm", "tp": 4}, "cluster": {"gpus_per_node": 8}})";
  auto spec = ParsePlanSpec(json, ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->trainer.vocab_divisible_by, 1);
  EXPECT_TRUE(spec->trainer.moe_grouped_gemm);
  EXPECT_TRUE(spec->trainer.moe_legacy_grouped_gemm);
  EXPECT_TRUE(spec->trainer.tp_pp_dp_mapping);
  auto p = BuildProblem(*spec);
  ASSERT_TRUE(p.ok()) << p.status();
  auto plan = MakePlan(*p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->stats.complete);
  auto bad = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp", "dp": 2, "moe_grouped_gemm": true},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("trainer.moe_grouped_gemm"), std::string::npos) << bad.status();
  auto wrong = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "megatron", "use_tp_pp_dp_mapping": 1},
    "rollout": {"layout": "vllm", "tp": 2}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("trainer.use_tp_pp_dp_mapping"), std::string::npos) << wrong.status();
}

TEST(SpecTest, RolloutMoeA2aBackend) {
  auto spec = ParsePlanSpec(R"({"model": {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 8,
      "vocab_size": 1000, "n_routed_experts": 8, "n_shared_experts": 2, "first_k_dense_replace": 1,
      "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
    "trainer": {"layout": "megatron", "tp": 2, "pp": 1, "dp": 4, "ep": 4, "etp": 1},
    "rollout": {"layout": "sglang", "tp": 4, "expert_parallel": true, "moe_a2a_backend": "deepep"},
    "cluster": {"gpus_per_node": 8}})", ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rollout.moe_a2a_backend, "deepep");
  auto p = BuildProblem(*spec);
  ASSERT_TRUE(p.ok()) << p.status();
  auto plan = MakePlan(*p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->stats.complete);
  auto wrong = ParsePlanSpec(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp", "dp": 2},
    "rollout": {"layout": "vllm", "tp": 2, "moe_a2a_backend": 3}, "cluster": {}})", ReadTestdata);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("rollout.moe_a2a_backend"), std::string::npos) << wrong.status();
  auto unknown = ParsePlanSpec(R"({"model": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 1000, "num_experts": 4},
    "trainer": {"layout": "fsdp", "dp": 2},
    "rollout": {"layout": "sglang", "tp": 2, "expert_parallel": true, "moe_a2a_backend": "carrier_pigeon"}, "cluster": {}})",
                               ReadTestdata);
  ASSERT_TRUE(unknown.ok()) << unknown.status();  // the preset checks it, naming it
  auto problem = BuildProblem(*unknown);
  ASSERT_FALSE(problem.ok());
  EXPECT_NE(problem.status().message().find("carrier_pigeon"), std::string::npos) << problem.status();
}

// SGLang DP attention with --enable-dp-lm-head and --moe-dense-tp-size 1 (docs/presets.md): the
// keys reach the rollout preset, whose layout then plans completely; bad values name the key.
TEST(SpecTest, RolloutSglangDpLmHeadAndDenseTp) {
  const std::string model = R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 8,
      "vocab_size": 1000, "n_routed_experts": 8, "n_shared_experts": 2, "first_k_dense_replace": 1,
      "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8})";
  auto spec = ParsePlanSpec(absl::StrCat(R"({"model": )", model, R"(,
    "trainer": {"layout": "megatron", "tp": 2, "pp": 1, "dp": 4, "ep": 4, "etp": 1},
    "rollout": {"layout": "sglang", "tp": 1, "dp": 4, "enable_dp_lm_head": true, "moe_dense_tp_size": 1},
    "cluster": {"gpus_per_node": 8}})"), ReadTestdata);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->rollout.enable_dp_lm_head);
  EXPECT_EQ(spec->rollout.moe_dense_tp_size, 1);
  auto p = BuildProblem(*spec);
  ASSERT_TRUE(p.ok()) << p.status();
  // The rollout ranks' layouts are the preset's with both options: lm_head whole (attention-TP
  // group of 1) and the dense MLP whole on every one of the 4 ranks.
  int rollouts = 0;
  for (const Worker& w : p->workers) {
    if (w.role != Role::kRollout) continue;
    ++rollouts;
    int64_t head_rows = 0, dense_gate_rows = 0;
    for (const Piece& piece : w.layout.pieces) {
      const std::string& name = p->inventory.tensors[piece.tensor].name;
      if (name == "lm_head.weight") head_rows += piece.box.end[0] - piece.box.begin[0];
      if (name == "model.layers.0.mlp.gate_proj.weight") dense_gate_rows += piece.box.end[0] - piece.box.begin[0];
    }
    EXPECT_EQ(head_rows, 1000) << w.id;
    EXPECT_EQ(dense_gate_rows, 128) << w.id;
  }
  EXPECT_EQ(rollouts, 4);
  auto plan = MakePlan(*p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->stats.complete);
  // Wrong JSON types and out-of-range values name the key; the preset names what SGLang refuses.
  for (const char* bad : {R"("enable_dp_lm_head": 1)", R"("moe_dense_tp_size": 0)", R"("moe_dense_tp_size": "1")"}) {
    auto wrong = ParsePlanSpec(absl::StrCat(R"({"model": "qwen2.5-0.5b.json", "trainer": {"layout": "fsdp", "dp": 2},
      "rollout": {"layout": "sglang", "tp": 2, )", bad, R"(}, "cluster": {}})"), ReadTestdata);
    ASSERT_FALSE(wrong.ok()) << bad;
    EXPECT_NE(wrong.status().message().find(std::string(bad).substr(1, std::string(bad).find('"', 1) - 1)), std::string::npos)
        << wrong.status();
  }
  auto refused = ParsePlanSpec(absl::StrCat(R"({"model": )", model, R"(, "trainer": {"layout": "fsdp", "dp": 2},
    "rollout": {"layout": "sglang", "tp": 4, "enable_dp_lm_head": true}, "cluster": {}})"), ReadTestdata);
  ASSERT_TRUE(refused.ok()) << refused.status();
  auto problem = BuildProblem(*refused);
  ASSERT_FALSE(problem.ok());
  EXPECT_EQ(problem.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(problem.status().message().find("enable_dp_lm_head needs DP attention"), std::string::npos) << problem.status();
}

}  // namespace
}  // namespace wb::planner
