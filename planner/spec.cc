#include "planner/spec.h"

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "planner/inventory.h"
#include "base/status_macros.h"

namespace wb::planner {
namespace {

using nlohmann::json;

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("spec field '", field, "': ", what));
}

absl::Status CheckKeys(const json& obj, absl::string_view where,
                       std::initializer_list<absl::string_view> allowed) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = false;
    for (absl::string_view a : allowed) ok |= it.key() == a;
    if (!ok) return Bad(absl::StrCat(where, it.key()), "unknown field");
  }
  return absl::OkStatus();
}

// Reads an optional positive integer field.
absl::Status GetInt(const json& obj, absl::string_view where, const char* key, int* out, bool required,
                    int min_value = 1) {
  if (!obj.contains(key)) {
    return required ? Bad(absl::StrCat(where, key), "missing") : absl::OkStatus();
  }
  const json& v = obj[key];
  if (!v.is_number_integer() || v.get<int64_t>() < min_value || v.get<int64_t>() > (1 << 20)) {
    return Bad(absl::StrCat(where, key), absl::StrCat("must be an integer in [", min_value, ", ", 1 << 20, "]"));
  }
  *out = static_cast<int>(v.get<int64_t>());
  return absl::OkStatus();
}

absl::Status GetDouble(const json& obj, absl::string_view where, const char* key, double* out,
                       bool required) {
  if (!obj.contains(key)) {
    return required ? Bad(absl::StrCat(where, key), "missing") : absl::OkStatus();
  }
  const json& v = obj[key];
  if (!v.is_number() || !(v.get<double>() > 0)) {
    return Bad(absl::StrCat(where, key), "must be a positive number");
  }
  *out = v.get<double>();
  return absl::OkStatus();
}

absl::Status GetBool(const json& obj, absl::string_view where, const char* key, bool* out) {
  if (!obj.contains(key)) return absl::OkStatus();
  if (!obj[key].is_boolean()) return Bad(absl::StrCat(where, key), "must be true or false");
  *out = obj[key].get<bool>();
  return absl::OkStatus();
}

absl::StatusOr<std::string> GetLayout(const json& obj, absl::string_view where,
                                      std::initializer_list<absl::string_view> allowed) {
  if (!obj.contains("layout")) return Bad(absl::StrCat(where, "layout"), "missing");
  if (!obj["layout"].is_string()) return Bad(absl::StrCat(where, "layout"), "must be a string");
  std::string s = obj["layout"].get<std::string>();
  for (absl::string_view a : allowed) {
    if (s == a) return s;
  }
  std::string list;
  for (absl::string_view a : allowed) absl::StrAppend(&list, list.empty() ? "" : ", ", a);
  return Bad(absl::StrCat(where, "layout"), absl::StrCat("unknown layout '", s, "' (want one of ", list, ")"));
}

}  // namespace

absl::StatusOr<PlanSpec> ParsePlanSpec(std::string_view spec_json, const ModelResolver& resolve_model) {
  const json doc = json::parse(spec_json.begin(), spec_json.end(), nullptr, false);
  if (doc.is_discarded()) return absl::InvalidArgumentError("spec is not valid JSON");
  if (!doc.is_object()) return absl::InvalidArgumentError("spec must be a JSON object");
  RETURN_IF_ERROR(CheckKeys(doc, "", {"model", "dtype", "trainer", "rollout", "cluster",
                                      "staging_budget_bytes", "name", "comment"}));
  PlanSpec spec;

  // model
  if (!doc.contains("model")) return Bad("model", "missing");
  const json& model = doc["model"];
  std::string config_text;
  if (model.is_string()) {
    if (!resolve_model) return Bad("model", "a path was given but no resolver");
    auto text = resolve_model(model.get<std::string>());
    if (!text.ok()) {
      return absl::Status(text.status().code(),
                          absl::StrCat("spec field 'model' (", model.get<std::string>(), "): ",
                                       text.status().message()));
    }
    config_text = *std::move(text);
  } else if (model.is_object()) {
    config_text = model.dump();
  } else {
    return Bad("model", "must be a path string or an inline config object");
  }
  auto cfg = ParseHfConfig(config_text);
  if (!cfg.ok()) return Annotate(cfg.status(), "spec field 'model'");
  spec.model = *std::move(cfg);

  // dtype
  if (doc.contains("dtype")) {
    if (!doc["dtype"].is_string()) return Bad("dtype", "must be a string");
    const std::string d = doc["dtype"].get<std::string>();
    if (d == "bfloat16") {
      spec.dtype = DType::kBF16;
    } else if (d == "float16") {
      spec.dtype = DType::kF16;
    } else if (d == "float32") {
      spec.dtype = DType::kF32;
    } else {
      return Bad("dtype", absl::StrCat("unknown dtype '", d, "' (want bfloat16, float16 or float32)"));
    }
  }

  // trainer
  if (!doc.contains("trainer") || !doc["trainer"].is_object()) return Bad("trainer", "missing or not an object");
  {
    const json& t = doc["trainer"];
    RETURN_IF_ERROR(CheckKeys(t, "trainer.", {"layout", "tp", "pp", "dp", "ep", "etp", "first_stage_layers",
                                              "last_stage_layers", "vpp", "replicas", "make_vocab_size_divisible_by",
                                              "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "use_tp_pp_dp_mapping"}));
    ASSIGN_OR_RETURN(spec.trainer.preset, GetLayout(t, "trainer.", {"megatron", "fsdp", "fsdp2", "fsdp2_tp", "fsdp_tp", "fsdp_flat", "deepspeed_zero3"}));
    const bool flat = spec.trainer.preset == "fsdp_flat" || spec.trainer.preset == "deepspeed_zero3";
    // FSDP2 + TP (docs/presets.md fsdp2_tp): tp, dp and replicas.
    const bool with_tp = spec.trainer.preset == "fsdp2_tp" || spec.trainer.preset == "fsdp_tp";
    RETURN_IF_ERROR(GetInt(t, "trainer.", "dp", &spec.trainer.dp, spec.trainer.preset != "megatron"));
    if (spec.trainer.preset == "megatron") {
      RETURN_IF_ERROR(GetInt(t, "trainer.", "tp", &spec.trainer.tp, false));
      RETURN_IF_ERROR(GetInt(t, "trainer.", "pp", &spec.trainer.pp, false));
      RETURN_IF_ERROR(GetInt(t, "trainer.", "ep", &spec.trainer.ep, false));
      RETURN_IF_ERROR(GetInt(t, "trainer.", "etp", &spec.trainer.etp, false));
      // Megatron custom pipeline splits / virtual pipeline (docs/presets.md).
      RETURN_IF_ERROR(GetInt(t, "trainer.", "first_stage_layers", &spec.trainer.first_stage_layers, false));
      RETURN_IF_ERROR(GetInt(t, "trainer.", "last_stage_layers", &spec.trainer.last_stage_layers, false));
      RETURN_IF_ERROR(GetInt(t, "trainer.", "vpp", &spec.trainer.vpp, false));
      // Megatron-LM / Megatron-Bridge options that change names, vocab rows or rank order.
      RETURN_IF_ERROR(GetInt(t, "trainer.", "make_vocab_size_divisible_by", &spec.trainer.vocab_divisible_by, false));
      RETURN_IF_ERROR(GetBool(t, "trainer.", "moe_grouped_gemm", &spec.trainer.moe_grouped_gemm));
      RETURN_IF_ERROR(GetBool(t, "trainer.", "moe_use_legacy_grouped_gemm", &spec.trainer.moe_legacy_grouped_gemm));
      RETURN_IF_ERROR(GetBool(t, "trainer.", "use_tp_pp_dp_mapping", &spec.trainer.tp_pp_dp_mapping));
      if (t.contains("replicas")) return Bad("trainer.replicas", "not used by the megatron layout");
    } else {
      // fsdp2: replicas = HSDP replicate size.
      if (!flat) RETURN_IF_ERROR(GetInt(t, "trainer.", "replicas", &spec.trainer.replicas, false));
      if (with_tp) RETURN_IF_ERROR(GetInt(t, "trainer.", "tp", &spec.trainer.tp, false));
      for (const char* k : {"tp", "pp", "ep", "etp", "first_stage_layers", "last_stage_layers", "vpp", "replicas",
                            "make_vocab_size_divisible_by", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
                            "use_tp_pp_dp_mapping"}) {
        if (k == std::string_view("replicas") && !flat) continue;
        if (k == std::string_view("tp") && with_tp) continue;
        if (t.contains(k)) return Bad(absl::StrCat("trainer.", k), absl::StrCat("not used by the ", spec.trainer.preset, " layout"));
      }
    }
  }

  // rollout
  if (!doc.contains("rollout") || !doc["rollout"].is_object()) return Bad("rollout", "missing or not an object");
  {
    const json& r = doc["rollout"];
    RETURN_IF_ERROR(CheckKeys(r, "rollout.", {"layout", "tp", "dp", "expert_parallel", "expert_placement", "moe_a2a_backend", "replicas",
                                              "quantization", "enable_dp_lm_head", "moe_dense_tp_size"}));
    ASSIGN_OR_RETURN(spec.rollout.preset, GetLayout(r, "rollout.", {"vllm", "sglang"}));
    RETURN_IF_ERROR(GetInt(r, "rollout.", "tp", &spec.rollout.tp, false));
    RETURN_IF_ERROR(GetInt(r, "rollout.", "replicas", &spec.rollout.replicas, false));
    RETURN_IF_ERROR(GetBool(r, "rollout.", "expert_parallel", &spec.rollout.expert_parallel));
    // Data parallelism inside one engine (vLLM --data-parallel-size; docs/presets.md).
    RETURN_IF_ERROR(GetInt(r, "rollout.", "dp", &spec.rollout.dp, false));
    if (r.contains("expert_placement")) {
      if (!r["expert_placement"].is_string()) return Bad("rollout.expert_placement", "must be a string");
      spec.rollout.expert_placement = r["expert_placement"].get<std::string>();
    }
    if (r.contains("moe_a2a_backend")) {
      if (!r["moe_a2a_backend"].is_string()) return Bad("rollout.moe_a2a_backend", "must be a string");
      spec.rollout.moe_a2a_backend = r["moe_a2a_backend"].get<std::string>();
    }
    // SGLang's --enable-dp-lm-head and --moe-dense-tp-size (the preset checks where they apply).
    RETURN_IF_ERROR(GetBool(r, "rollout.", "enable_dp_lm_head", &spec.rollout.enable_dp_lm_head));
    RETURN_IF_ERROR(GetInt(r, "rollout.", "moe_dense_tp_size", &spec.rollout.moe_dense_tp_size, false));
    if (r.contains("quantization")) {
      if (!r["quantization"].is_string()) return Bad("rollout.quantization", "must be a string");
      const std::string q = r["quantization"].get<std::string>();
      // "none" reads as the empty scheme (weights in the canonical dtype).
      spec.rollout.quantization = q == "none" ? "" : q;
      if (!KnownQuantization(spec.rollout.quantization)) {
        return Bad("rollout.quantization",
                   absl::StrCat("unknown quantization '", q,
                                "' (want none, fp8_block128, mxfp8, nvfp4, w4a16_g32 or w4a16_experts_g32)"));
      }
    }
  }

  // cluster
  if (!doc.contains("cluster") || !doc["cluster"].is_object()) return Bad("cluster", "missing or not an object");
  {
    const json& c = doc["cluster"];
    RETURN_IF_ERROR(CheckKeys(c, "cluster.", {"gpus_per_node", "nic_GBps_per_gpu", "intra_node_GBps",
                                              "colocated", "same_gpu_GBps"}));
    RETURN_IF_ERROR(GetInt(c, "cluster.", "gpus_per_node", &spec.gpus_per_node, false));
    RETURN_IF_ERROR(GetDouble(c, "cluster.", "nic_GBps_per_gpu", &spec.topology.nic_GBps_per_gpu, false));
    RETURN_IF_ERROR(GetDouble(c, "cluster.", "intra_node_GBps", &spec.topology.intra_node_GBps, false));
    RETURN_IF_ERROR(GetDouble(c, "cluster.", "same_gpu_GBps", &spec.topology.same_gpu_GBps, false));
    RETURN_IF_ERROR(GetBool(c, "cluster.", "colocated", &spec.topology.colocated));
  }
  if (doc.contains("staging_budget_bytes")) {
    const json& b = doc["staging_budget_bytes"];
    if (!b.is_number_integer() || b.get<int64_t>() <= 0) return Bad("staging_budget_bytes", "must be a positive integer");
    spec.staging_budget_bytes = b.get<int64_t>();
  }
  return spec;
}

absl::StatusOr<Problem> BuildProblem(const PlanSpec& spec) {
  ASSIGN_OR_RETURN(Inventory inventory, BuildInventory(spec.model, spec.dtype));
  auto trainer = PresetBuilder::Create(spec.model, inventory, spec.trainer);
  if (!trainer.ok()) return Annotate(trainer.status(), absl::StrCat("trainer layout ", spec.trainer.preset));
  auto rollout = PresetBuilder::Create(spec.model, inventory, spec.rollout);
  if (!rollout.ok()) return Annotate(rollout.status(), absl::StrCat("rollout layout ", spec.rollout.preset));
  const int gpn = spec.gpus_per_node;
  const int num_trainers = trainer->world_size();
  const int num_rollouts = rollout->world_size();
  const int rollout_tp = spec.rollout.tp;

  // An absurd spec (rollout.replicas 2^20) used to build layouts until the process died of
  // std::bad_alloc (tens of GB); it is refused by its numbers, and by the pieces as they are built.
  if (static_cast<int64_t>(num_trainers) + num_rollouts > kMaxSpecWorkers) {
    return absl::ResourceExhaustedError(absl::StrCat("the spec has ", num_trainers, " trainer and ", num_rollouts,
                                                     " rollout ranks, more than the limit of ", kMaxSpecWorkers, " in all"));
  }
  int64_t pieces = 0;
  auto count_pieces = [&](const Worker& w) -> absl::Status {
    pieces += static_cast<int64_t>(w.layout.pieces.size());
    if (pieces <= kMaxSpecPieces) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat("the spec's layouts have more than ", kMaxSpecPieces, " pieces in all (", pieces,
                                                     " up to ", w.id, " of ", num_trainers, " trainer and ", num_rollouts,
                                                     " rollout ranks)"));
  };
  Problem problem;
  problem.topology = spec.topology;
  problem.staging_budget_bytes = spec.staging_budget_bytes;
  problem.workers.reserve(num_trainers + num_rollouts);
  for (int r = 0; r < num_trainers; ++r) {
    auto layout = trainer->Make(r);
    if (!layout.ok()) return Annotate(layout.status(), absl::StrCat("trainer rank ", r));
    Worker w;
    w.id = absl::StrCat("trainer/", r);
    w.role = Role::kTrainer;
    w.node = r / gpn;
    w.gpu = r % gpn;
    w.layout = std::move(layout->layout);
    RETURN_IF_ERROR(count_pieces(w));
    problem.workers.push_back(std::move(w));
  }
  const int first = spec.topology.colocated ? 0 : (num_trainers + gpn - 1) / gpn * gpn;
  for (int i = 0; i < num_rollouts; ++i) {
    auto layout = rollout->Make(i);
    if (!layout.ok()) return Annotate(layout.status(), absl::StrCat("rollout rank ", i));
    Worker w;
    w.id = absl::StrCat("rollout/", i / rollout_tp, "/", i % rollout_tp);
    w.role = Role::kRollout;
    w.node = (first + i) / gpn;
    w.gpu = (first + i) % gpn;
    w.layout = std::move(layout->layout);
    RETURN_IF_ERROR(count_pieces(w));
    problem.workers.push_back(std::move(w));
  }
  problem.inventory = std::move(inventory);
  return problem;
}

}  // namespace wb::planner
