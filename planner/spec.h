#pragma once
// Plan specs (../shared/specs/README.md): a model, the trainer and rollout parallel layouts and the
// cluster, turned into a planner Problem with the layout presets. Pure: the caller reads files and
// passes a resolver for the spec's model path.
//
// Spec JSON fields: model (path string or inline config object), dtype ("bfloat16" default,
// "float16", "float32"), trainer {layout: megatron|fsdp|fsdp2_tp|fsdp_flat, tp, pp, dp, ep, etp}, rollout {layout:
// vllm|sglang, tp, dp, expert_parallel, expert_placement, moe_a2a_backend, replicas, quantization (a
// ParallelConfig::quantization preset name: fp8_block128, mxfp8, nvfp4, w4a16_g32, w4a16_experts_g32,
// or none), enable_dp_lm_head and moe_dense_tp_size (sglang: --enable-dp-lm-head,
// --moe-dense-tp-size)}, cluster {gpus_per_node, nic_GBps_per_gpu,
// intra_node_GBps, colocated, same_gpu_GBps (optional)}, staging_budget_bytes (optional, per GPU
// per bucket). Unknown fields are errors (a typo must not silently change the problem).

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "planner/types.h"

namespace wb::planner {

struct PlanSpec {
  ModelConfig model;
  DType dtype = DType::kBF16;
  ParallelConfig trainer;  // preset "megatron", "fsdp", "fsdp2_tp" or "fsdp_flat" (and their aliases)
  ParallelConfig rollout;  // preset "vllm" or "sglang"
  int gpus_per_node = 8;
  Topology topology;
  int64_t staging_budget_bytes = int64_t{2} << 30;
};

// Returns the text of the HF config.json named by the spec's `model` path (relative to the spec).
using ModelResolver = std::function<absl::StatusOr<std::string>(std::string_view path)>;

// Parses a spec. INVALID_ARGUMENT naming the field for malformed JSON, a missing/ill-typed/unknown
// field, an unknown layout or dtype; the resolver's error (annotated) when the model is unreadable.
absl::StatusOr<PlanSpec> ParsePlanSpec(std::string_view spec_json, const ModelResolver& resolve_model);

// The planning problem of a spec: trainer ranks fill nodes first in rank order (node = rank /
// gpus_per_node), then rollout GPUs, replica-major (index = replica * tp + tp_rank), fill the next
// nodes starting at a node boundary; when colocated, rollout GPU i is trainer GPU i. Worker ids are
// "trainer/<rank>" and "rollout/<replica>/<tp_rank>". Errors from the inventory and presets;
// RESOURCE_EXHAUSTED past kMaxSpecWorkers ranks or kMaxSpecPieces pieces in all (checked as the
// layouts are built, so an absurd spec is refused before it takes the machine's memory).
inline constexpr int64_t kMaxSpecWorkers = int64_t{1} << 16;
inline constexpr int64_t kMaxSpecPieces = int64_t{1} << 21;  // ~3x the largest example spec
absl::StatusOr<Problem> BuildProblem(const PlanSpec& spec);

}  // namespace wb::planner
