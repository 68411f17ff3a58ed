#pragma once
// Canonical tensors (HF checkpoint names and shapes) of a model described by a ModelConfig.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/model_config.h"
#include "planner/types.h"

namespace wb::planner {

// Bounds on what a config.json may make us build (issue 15.5: a hostile config must not allocate
// gigabytes). The defaults match the daemon's limits on explicit inventories (daemon/limits.h:
// max_tensors_per_model, max_tensor_elements).
struct InventoryLimits {
  int64_t max_tensors = int64_t{1} << 17;          // tensors in the model
  int64_t max_tensor_elements = int64_t{1} << 40;  // elements of one tensor
  int64_t max_total_bytes = int64_t{1} << 46;      // all tensors together (64 TiB; Kimi-K2 bf16 is ~2 TiB)
};

// Deterministic order: model.embed_tokens.weight, then layers 0..L-1 (each: input_layernorm,
// self_attn.*, post_attention_layernorm, mlp.* with experts in index order), then model.norm.weight
// and lm_head.weight (absent when embeddings are tied). DeepSeek's MTP layers are excluded.
// Every tensor gets `dtype` (the transfer dtype).
// The tensor count, every tensor's element count (overflow-checked) and the total bytes are
// computed from the config's numbers BEFORE anything is allocated (the layers of one kind are
// counted once, not per layer x expert); over a limit -> InvalidArgument naming the config fields
// (num_hidden_layers, the experts field, the tensor and its dims) and the limit.
absl::StatusOr<Inventory> BuildInventory(const ModelConfig& config, DType dtype,
                                         const InventoryLimits& limits = InventoryLimits{});

// Sum of all tensor element counts.
int64_t TotalElements(const Inventory& inventory);

// Name -> index into inventory.tensors.
class TensorIndex {
 public:
  explicit TensorIndex(const Inventory& inventory);
  // Index of `name`, or nullopt.
  std::optional<int32_t> Find(absl::string_view name) const;

 private:
  absl::flat_hash_map<std::string, int32_t> index_;
};

// Cumulative element offsets of the tensors in inventory order: bases[i] is the canonical index of
// element 0 of tensor i; bases has tensors.size() + 1 entries (the last is the total).
std::vector<int64_t> TensorBases(const Inventory& inventory);

}  // namespace wb::planner
