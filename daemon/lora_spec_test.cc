// ModelSpec.lora through the coordinator (issue 17.3): the adapter inventory is built from the base
// config, presets resolve to the LoRA layouts, and bad or inconsistent LoRA specs are refused
// naming the model and field. CoordinatorCore over fake nodes (no transfers).
#include "daemon/lora_spec.h"

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/layout_discovery.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr const char* kLlama = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
  "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100})";

pb::ModelSpec LoraModel(const std::string& id, uint32_t r) {
  pb::ModelSpec spec;
  spec.set_model_id(id);
  spec.set_hf_config_json(kLlama);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  spec.set_mode(pb::MODE_SYNC);
  pb::LoraSpec* l = spec.mutable_lora();
  for (const char* m : {"q_proj", "v_proj", "o_proj"}) l->add_target_modules(m);
  l->set_r(r);
  l->set_alpha(16);
  return spec;
}

class Coordinator {
 public:
  Coordinator() {
    CoordinatorOptions o;
    o.make_node_client = [](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      return std::make_shared<FakeNodeClient>(node);
    };
    core = std::make_unique<CoordinatorCore>(std::move(o));
    core->Start();
    pb::RegisterNodeRequest req;
    req.set_node_id("n0");
    req.set_address("n0:1");
    pb::RegisterNodeResponse resp;
    EXPECT_TRUE(core->RegisterNode(req, &resp).ok());
  }
  ~Coordinator() { core->Shutdown(); }

  absl::Status Join(const std::string& worker, pb::Role role, const pb::ModelSpec& spec) {
    pb::JoinWorkerRequest j;
    j.set_node_id("n0");
    j.set_worker_id(worker);
    j.set_model_id(spec.model_id());
    j.set_role(role);
    *j.mutable_model() = spec;
    pb::JoinWorkerResponse jr;
    return core->JoinWorker(j, &jr);
  }

  absl::Status Preset(const std::string& model, const std::string& worker, const std::string& preset, uint32_t tp,
                      uint32_t rank, pb::SubmitLayoutResponse* resp) {
    pb::SubmitLayoutRequest req;
    req.set_node_id("n0");
    req.set_model_id(model);
    req.set_worker_id(worker);
    pb::BufferSpec* b = req.add_buffers();
    b->set_buffer_id(0);
    b->set_size_bytes(1 << 20);
    b->set_shm_name("/wb-" + worker);
    b->set_gpu(-1);
    pb::ParallelConfig* p = req.mutable_layout()->mutable_preset();
    p->set_preset(preset);
    p->set_tp(tp);
    p->set_rank(rank);
    return core->SubmitLayout(req, resp);
  }

  std::unique_ptr<CoordinatorCore> core;
};

TEST(LoraSpec, BuildSpecInventoryNamesModelAndField) {
  auto config = planner::ParseHfConfig(kLlama);
  ASSERT_TRUE(config.ok());
  pb::ModelSpec spec = LoraModel("m", 4);
  auto inv = BuildSpecInventory(spec, *config, planner::DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->tensors.size(), 2u * 3 * 2);
  EXPECT_EQ(inv->tensors[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  ASSERT_TRUE(config->lora.has_value());
  EXPECT_EQ(config->lora->r, 4);
  spec.mutable_lora()->add_target_modules("qkv_proj");
  auto bad = BuildSpecInventory(spec, *config, planner::DType::kBF16);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "model m: lora.target_modules: unknown module `qkv_proj`")) << bad.status();
}

TEST(LoraSpec, CoordinatorResolvesLoraPresetsAndRefusesBaseOnes) {
  Coordinator c;
  ASSERT_TRUE(c.Join("t0", pb::ROLE_TRAINER, LoraModel("m", 4)).ok());
  pb::SubmitLayoutResponse resp;
  absl::Status s = c.Preset("m", "t0", "peft", 1, 0, &resp);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(c.Join("r0", pb::ROLE_ROLLOUT, LoraModel("m", 4)).ok());
  s = c.Preset("m", "r0", "vllm", 1, 0, &resp);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "preset `vllm` places base weights")) << s;
  s = c.Preset("m", "r0", "vllm_lora", 2, 1, &resp);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(LoraSpec, CoordinatorRefusesBadLoraSpecs) {
  Coordinator c;
  absl::Status s = c.Join("t0", pb::ROLE_TRAINER, LoraModel("m", 0));
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "model m: lora.r=0")) << s;
  pb::ModelSpec explicit_lora = LoraModel("e", 4);
  pb::TensorSpec* t = explicit_lora.mutable_explicit_tensors()->add_tensors();  // clears hf_config_json (oneof)
  t->set_name("w");
  t->add_shape(4);
  t->set_dtype(pb::DTYPE_BF16);
  s = c.Join("t0", pb::ROLE_TRAINER, explicit_lora);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "lora needs hf_config_json")) << s;
}

// A later worker must declare the same adapters: a different LoRA spec would describe different
// tensors than the model's.
TEST(LoraSpec, CoordinatorRefusesAWorkerWithDifferentAdapters) {
  Coordinator c;
  ASSERT_TRUE(c.Join("t0", pb::ROLE_TRAINER, LoraModel("m", 4)).ok());
  absl::Status s = c.Join("r0", pb::ROLE_ROLLOUT, LoraModel("m", 8));
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "lora")) << s;
  pb::ModelSpec none = LoraModel("m", 4);
  none.clear_lora();
  s = c.Join("r0", pb::ROLE_ROLLOUT, none);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "lora")) << s;
  EXPECT_TRUE(c.Join("r0", pb::ROLE_ROLLOUT, LoraModel("m", 4)).ok());
}

// Layout discovery describes an adapter model's presets from the same inventory, and its model
// cache tells two specs that differ only in `lora` apart.
TEST(LoraSpec, LayoutDiscoveryDescribesVllmLoraAndKeysOnLora) {
  LayoutDescriber describer;
  pb::LayoutSpec layout;
  layout.mutable_preset()->set_preset("vllm_lora");
  layout.mutable_preset()->set_tp(2);
  layout.mutable_preset()->set_rank(1);
  auto d4 = describer.Describe(LoraModel("m", 4), layout, {}, planner::Role::kRollout);
  ASSERT_TRUE(d4.ok()) << d4.status();
  ASSERT_GT(d4->tensors_size(), 0);
  EXPECT_EQ(d4->tensors(0).name(), "model.layers.0.self_attn.qkv_proj.lora_a_stacked.0");
  EXPECT_EQ(d4->tensors(0).shape(0), 16);  // vLLM's default --max-lora-rank slot
  auto d24 = describer.Describe(LoraModel("m", 24), layout, {}, planner::Role::kRollout);
  ASSERT_TRUE(d24.ok()) << d24.status();
  EXPECT_EQ(d24->tensors(0).shape(0), 32);  // not the cached r=4 model: the smallest slot vLLM accepts >= 24
  pb::ModelSpec base = LoraModel("m", 4);
  base.clear_lora();
  auto wrong = describer.Describe(base, layout, {}, planner::Role::kRollout);
  ASSERT_FALSE(wrong.ok());
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "declares none")) << wrong.status();
}

}  // namespace
}  // namespace wb::daemon
