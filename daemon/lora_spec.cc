#include "daemon/lora_spec.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/convert.h"
#include "planner/lora.h"

namespace wb::daemon {

planner::LoraConfig LoraFromProto(const ::weightbridge::v1::LoraSpec& lora) {
  planner::LoraConfig out;
  out.target_modules.assign(lora.target_modules().begin(), lora.target_modules().end());
  out.r = lora.r();
  out.alpha = lora.alpha();
  out.max_lora_rank = lora.max_lora_rank();
  out.fully_sharded_loras = lora.fully_sharded_loras();
  return out;
}

absl::StatusOr<planner::Inventory> BuildSpecInventory(const ::weightbridge::v1::ModelSpec& spec,
                                                      planner::ModelConfig& config, planner::DType dtype) {
  if (spec.has_lora()) config.lora = LoraFromProto(spec.lora());
  auto inventory = planner::BuildModelInventory(config, dtype);
  if (!inventory.ok()) {
    return absl::Status(inventory.status().code(),
                        absl::StrCat("model ", spec.model_id(), ": ", inventory.status().message()));
  }
  return inventory;
}

absl::StatusOr<SpecInventory> InventoryForSpec(const ::weightbridge::v1::ModelSpec& spec) {
  SpecInventory out;
  if (spec.has_explicit_tensors()) {
    ASSIGN_OR_RETURN(out.inventory, InventoryFromProto(spec.explicit_tensors().tensors()));
    return out;
  }
  if (spec.hf_config_json().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec.model_id(), ": no inventory (hf_config_json or explicit_tensors)"));
  }
  planner::DType dtype = planner::DType::kBF16;
  if (spec.dtype() != ::weightbridge::v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(dtype, FromProto(spec.dtype()));
  }
  auto config = planner::ParseHfConfig(spec.hf_config_json());
  if (!config.ok()) return Annotate(config.status(), absl::StrCat("model ", spec.model_id(), ": hf_config_json"));
  ASSIGN_OR_RETURN(out.inventory, BuildSpecInventory(spec, *config, dtype));  // base tensors or LoRA adapters
  out.config = std::move(*config);
  return out;
}

absl::Status CheckSameLora(const ::weightbridge::v1::ModelSpec& have, const ::weightbridge::v1::ModelSpec& spec) {
  if (have.has_lora() == spec.has_lora() && have.lora().SerializeAsString() == spec.lora().SerializeAsString()) {
    return absl::OkStatus();
  }
  auto describe = [](const ::weightbridge::v1::ModelSpec& s) {
    return s.has_lora() ? absl::StrCat("r=", s.lora().r(), ", ", s.lora().target_modules_size(), " target modules") : std::string("none");
  };
  return absl::AlreadyExistsError(absl::StrCat("model ", have.model_id(), " exists with different LoRA adapters (ModelSpec.lora: ",
                                               describe(have), "; this worker: ", describe(spec), ")"));
}

}  // namespace wb::daemon
