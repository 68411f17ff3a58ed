#pragma once
// ModelSpec.lora (issue 17.3) -> planner::LoraConfig, and the inventory of a model created from
// hf_config_json: the base model's tensors, or its LoRA adapters alone when the spec declares them
// (planner/lora.h). Used by the coordinator and the layout describer so both build the same one.

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/model_config.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

// Field-by-field conversion; validation (names the field and value) is planner::ValidateLora's.
planner::LoraConfig LoraFromProto(const ::weightbridge::v1::LoraSpec& lora);

// Sets config.lora from spec.lora (when present), then builds the model's inventory
// (planner::BuildModelInventory). Bad LoRA fields -> InvalidArgument naming the model and field.
absl::StatusOr<planner::Inventory> BuildSpecInventory(const ::weightbridge::v1::ModelSpec& spec,
                                                      planner::ModelConfig& config, planner::DType dtype);

// A model's inventory from its spec: explicit_tensors as given, or hf_config_json (dtype from the
// spec, bf16 by default) through BuildSpecInventory. `config` is set for hf_config_json models.
// The coordinator's model registry and the node's layout describer both call it, so a model's
// tensors are the same wherever they are built. Errors name the model.
struct SpecInventory {
  planner::Inventory inventory;
  std::optional<planner::ModelConfig> config;
};
absl::StatusOr<SpecInventory> InventoryForSpec(const ::weightbridge::v1::ModelSpec& spec);

// A worker joining an existing model must declare the same adapters (or none when the model has
// none): different adapters are different tensors. ALREADY_EXISTS naming the model and both specs'
// rank and target count otherwise.
absl::Status CheckSameLora(const ::weightbridge::v1::ModelSpec& have, const ::weightbridge::v1::ModelSpec& spec);

}  // namespace wb::daemon
