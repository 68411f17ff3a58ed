#include "daemon/lora_spec.h"

#include "absl/strings/str_cat.h"
#include "planner/lora.h"

namespace wb::daemon {

planner::LoraConfig LoraFromProto(const ::weightbridge::v1::LoraSpec& lora) {
  planner::LoraConfig out;
  out.target_modules.assign(lora.target_modules().begin(), lora.target_modules().end());
  out.r = lora.r();
  out.alpha = lora.alpha();
  out.max_lora_rank = lora.max_lora_rank();
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

}  // namespace wb::daemon
