#pragma once
// LoRA adapter sets (issue 17.3): a model may carry its LoRA adapters alone, planned and moved like
// any tensors. The adapters are their own canonical inventory, derived from the base model's
// config and a LoraConfig; the presets below place them where PEFT (trainer) and vLLM's LoRA
// layers (rollout) hold them. Pure: no I/O, no protobuf.
//
// Canonical tensors (PEFT's adapter_model.safetensors keys, the same for every adapter name):
//   base_model.model.model.layers.{l}.{self_attn|mlp}.{module}.lora_A.weight  [r, in_features]
//   base_model.model.model.layers.{l}.{self_attn|mlp}.{module}.lora_B.weight  [out_features, r]
// for every layer l and target module in q_proj, k_proj, v_proj, o_proj (self_attn) and
// gate_proj, up_proj, down_proj (mlp), in that module order, A before B. The scaling alpha / r is
// metadata: bytes move unscaled (vLLM folds the scaling into lora_b when it loads an adapter from
// disk, LoRALayerWeights.optimize; an engine hook that writes these bytes must do the same, or the
// trainer must send B pre-scaled).
//
// Presets (ParallelConfig::preset):
//   peft       trainer side: every rank (world = dp * replicas) holds every adapter tensor whole,
//              under PEFT's live parameter name (named_parameters of a PeftModel, adapter
//              "default"): base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.default.weight.
//   peft_fsdp2 trainer side, PEFT under torch FSDP2 fully_shard (verl's FSDP LoRA path): world =
//              dp * replicas (HSDP), shard rank = rank % dp; the same names, every tensor split on
//              dim 0 with torch.chunk semantics as the "fsdp" preset (planner/presets.h): c =
//              ceil(d0 / dp) rows, rank s holds [min(d0, s*c), min(d0, (s+1)*c)) (lora_A has only
//              r rows: ranks past them hold none), c rows reserved on every rank.
//   vllm_lora  rollout side: world = tp * dp * replicas, tp_rank = rank % tp (as the vllm preset).
//              One adapter slot of vLLM's stacked LoRA weights (the [slot, 0] slice of
//              lora_a_stacked[i] [max_loras, 1, max_lora_rank, in] and lora_b_stacked[i]
//              [max_loras, 1, out, max_lora_rank]), following vLLM's vllm/lora/layers/
//              column_parallel_linear.py and row_parallel_linear.py (fully_sharded_loras off):
//              - qkv_proj (MergedQKVParallelLinearWithLoRA, slices q=0, k=1, v=2) and gate_up_proj
//                (MergedColumnParallelLinearWithLoRA, slices gate=0, up=1): per slice i,
//                "model.layers.{l}.self_attn.qkv_proj.lora_a_stacked.{i}" [max_lora_rank, in] holds
//                lora_A whole (slice_lora_a returns it unchanged) and
//                "...lora_b_stacked.{i}" [out_shard, max_lora_rank] holds lora_B's rows of this
//                rank: q rows [tp_rank*q_shard, +q_shard), k/v rows of kv_shard_id =
//                tp_rank / num_kv_head_replicas (KV heads replicated when tp > kv heads), gate/up
//                rows [tp_rank*I/tp, +I/tp).
//              - o_proj / down_proj (RowParallelLinearWithLoRA): "...o_proj.lora_a_stacked.0"
//                [max_lora_rank, in/tp] holds lora_A's columns [tp_rank*in/tp, +in/tp)
//                (slice_lora_a), "...lora_b_stacked.0" [out, max_lora_rank] holds lora_B whole.
//              Only targeted slices get local tensors (vLLM leaves the others zero). With
//              max_lora_rank > r, rows [r, max_lora_rank) of lora_a and columns [r, max) of lora_b
//              are not covered by pieces (the engine keeps them zero). With
//              LoraConfig::fully_sharded_loras (vLLM's *WithShardedLoRA, S-LoRA): the column
//              slices' lora_a_stacked.{i} is [max_lora_rank/tp, in] holding lora_A rows
//              [tp_rank*max_lora_rank/tp, +max_lora_rank/tp) that exist (below r), and o_proj /
//              down_proj's lora_b_stacked.0 [out/tp, max_lora_rank] lora_B rows [tp_rank*out/tp,
//              +out/tp).
// Every worker has ONE buffer, local tensors packed in order at 256-byte aligned offsets.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/inventory.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "planner/types.h"

namespace wb::planner {

// Largest LoRA rank accepted (vLLM allows up to 512; PEFT has no limit).
inline constexpr int64_t kMaxLoraRank = int64_t{1} << 16;

// The values vLLM's --max-lora-rank accepts (vllm/config/lora.py MaxLoRARanks); its default is 16.
inline constexpr int64_t kVllmMaxLoraRanks[] = {1, 8, 16, 32, 64, 128, 256, 320, 512};
inline constexpr int64_t kVllmDefaultMaxLoraRank = 16;

// The rows of a vllm_lora slot (vLLM's --max-lora-rank): LoraConfig::max_lora_rank when set, else
// vLLM's default 16 when r fits it, else the smallest value vLLM accepts that holds r (r beyond
// 512, which no vLLM slot holds: r).
int64_t VllmSlotRank(const LoraConfig& lora);

// The PEFT target module names a LoraConfig may list, in canonical order.
const std::vector<std::string>& LoraModuleNames();

// Validates `lora` against `config`: r in [1, kMaxLoraRank], alpha finite and > 0, max_lora_rank 0
// or one of kVllmMaxLoraRanks and >= r, target_modules non-empty, known (LoraModuleNames), without duplicates;
// attention targets need standard attention (not MLA), MLP targets a dense model (no experts:
// PEFT would also match every expert's projections). InvalidArgument naming the field and value.
absl::Status ValidateLora(const ModelConfig& config, const LoraConfig& lora);

// The adapter inventory (see the header comment), every tensor in `dtype`. Counts and sizes are
// bounded by `limits` before anything is allocated (InvalidArgument naming the limit).
absl::StatusOr<Inventory> BuildLoraInventory(const ModelConfig& config, const LoraConfig& lora, DType dtype,
                                             const InventoryLimits& limits = InventoryLimits{});

// "peft", "peft_fsdp2" or "vllm_lora".
bool IsLoraPreset(const std::string& preset);

// World size of a LoRA preset (InvalidArgument for other presets or bad sizes).
absl::StatusOr<int> LoraPresetWorldSize(const ParallelConfig& parallel);

// Layout of `rank` for a LoRA preset. `inventory` must be BuildLoraInventory(config, lora, ...).
// InvalidArgument when the parallel config does not fit (vllm_lora: tp must divide
// num_attention_heads and intermediate_size, and tp and num_key_value_heads one another; named).
absl::StatusOr<PresetLayout> MakeLoraPresetLayout(const ModelConfig& config, const LoraConfig& lora,
                                                  const Inventory& inventory, const ParallelConfig& parallel, int rank);

// What the daemon calls for a model created from hf_config_json: the adapter inventory when
// config.lora is set, else BuildInventory.
absl::StatusOr<Inventory> BuildModelInventory(const ModelConfig& config, DType dtype,
                                              const InventoryLimits& limits = InventoryLimits{});

// The model's preset layout: MakeLoraPresetLayout when config.lora is set (a non-LoRA preset is
// then refused, naming it), else MakePresetLayout (a LoRA preset on a model without adapters is
// refused, naming it).
absl::StatusOr<PresetLayout> MakeModelPresetLayout(const ModelConfig& config, const Inventory& inventory,
                                                   const ParallelConfig& parallel, int rank);

}  // namespace wb::planner
