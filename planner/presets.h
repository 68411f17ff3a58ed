#pragma once
// Layout presets: every worker's pieces for the frameworks' real local tensors, computed from a
// model config and a parallel config. Semantics follow ../shared/specs/README.md.
//
// Full user-level description of every preset: docs/presets.md.
//
// megatron (Megatron-Core, Transformer-Engine spec):
//   world = tp*pp*dp, rank = tp_rank + tp*(dp_rank + dp*pp_rank). Layers per pipeline stage as
//   Megatron-Core's get_num_layers_to_build / get_transformer_layer_offset assign them:
//   first_stage_layers / last_stage_layers (--decoder-first/last-pipeline-num-layers) give the
//   first / last stage that many layers and the other stages the rest evenly (must divide);
//   otherwise layers/pp each (when pp does not divide the layers, an extension Megatron itself
//   refuses: floor/ceil, earlier stages take the extra). vpp > 1 (virtual pipeline, interleaved
//   1F1B): each stage's layers are vpp model chunks; chunk v of stage s holds layers
//   [v*T + sum_{s'<s} n_s'/vpp, + n_s/vpp) with T = layers/vpp (Megatron's interleaving: with 8
//   layers, pp=2, vpp=2: stage 0 holds [0,1] and [4,5]). Local names use the chunk-local layer
//   index (`decoder.layers.{i}` as named_parameters() shows them), prefixed `model{v}.` when
//   vpp > 1 (Megatron's checkpoint keys for model chunks). embedding.word_embeddings on (stage 0,
//   chunk 0), decoder.final_layernorm + output_layer on (last stage, last chunk) (tied embeddings
//   with pp > 1: the last stage's output_layer is another replica of model.embed_tokens.weight).
//   Vocab padded to a multiple of 128*tp and split by tp (padding rows are not covered by pieces).
//   linear_qkv is interleaved per query group ([q heads of group; k; v]) and groups are split by tp
//   (requires tp | kv heads). linear_fc1 = [gate shard; up shard]. Experts: ep contiguous ranges,
//   each expert split by etp (default tp), replicated over edp = tp*dp/(ep*etp); expert rank within
//   a stage: local = tp_rank + tp*dp_rank, etp_rank = local % etp, ep_rank = (local / etp) % ep.
//   Local experts: mlp.experts.local_experts.{j}.linear_fc{1,2}.weight. router.expert_bias float32.
// fsdp (= fsdp2): torch FSDP2 `fully_shard` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py):
//   world = dp * replicas (HSDP: replicas = the replicate mesh dim, rank = replica*dp + shard_rank).
//   Every tensor is split on dim 0 with torch.chunk semantics: c = ceil(d0/dp) rows per rank, rank
//   r holds rows [min(d0, r*c), min(d0, (r+1)*c)) (trailing ranks may hold fewer rows or none,
//   e.g. d0=5 over 4 ranks: 2,2,1,0). The local tensor keeps the HF name and the shape
//   [rows, rest...] and is contiguous; c*rest elements are reserved for it (FSDP2's padded
//   shard), so every rank's buffer has the same size. Empty shards are listed with 0 rows.
// fsdp2_tp (= fsdp_tp): torch FSDP2 `fully_shard` over the dp_shard dim of a 2-D (3-D with HSDP)
//   DeviceMesh after tensor parallelism (parallelize_module): NeMo-RL's DTensor policy with
//   tensor_parallel_size > 1, torchtitan. world = replicas * dp * tp, tp fastest: rank =
//   (replica*dp + shard_rank)*tp + tp_rank. TP plan (torch ParallelStyles as NeMo-RL applies them):
//   q/k/v/gate/up weight and bias, embed_tokens and lm_head Shard(0); o_proj/down_proj weight
//   Shard(1); everything else (norms, o/down biases) whole. Each TP part is torch.chunk's (ceil,
//   trailing parts short or empty); FSDP2 then splits the TP-local tensor's dim 0 over dp with
//   torch.chunk semantics and reserves chunk 0's rows on every rank. Llama, Mistral, Qwen2, Qwen3,
//   Gemma3 (text) only; tp must divide num_attention_heads and num_key_value_heads.
// fsdp_flat: world = dp; every tensor flattened and split into dp contiguous ranges of ceil(n/dp)
//   elements; local tensors keep the HF name and are 1-D; empty shards are omitted. This is
//   DeepSpeed ZeRO-3's partitioning (each parameter's ds_tensor): also named "deepspeed_zero3".
//   (The layout "fsdp" had before FSDP2 was added; neither FSDP1 nor FSDP2 shards like this.)
// vllm / sglang: world = tp*dp*replicas, rank = (replica*dp + dp_rank)*tp + tp_rank. `replicas`
//   are independent engines; `dp` is data parallelism inside one engine (vLLM
//   --data-parallel-size; sglang dp > 1 is DP attention, --tp-size tp*dp --dp-size dp
//   --enable-dp-attention, described for DeepSeek-V2/V3 only: attention and embed_tokens over the
//   tp ranks of the DP rank, dense MLPs, shared experts and lm_head over all dp*tp ranks, lm_head
//   over the tp ranks with enable_dp_lm_head, dense MLPs whole with moe_dense_tp_size 1 -
//   docs/presets.md; otherwise): attention, dense MLPs, shared experts,
//   embeddings and lm_head are tensor-parallel over the tp ranks of the DP rank, and the MoE layers
//   span all dp*tp ranks of the engine (vLLM FusedMoEParallelConfig flatten_tp_across_dp:
//   flat_rank = dp_rank*tp + tp_rank). qkv_proj = [q;k;v] per rank (KV heads replicated when
//   tp > kv heads), gate_up_proj = [gate;up], o_proj/down_proj row-parallel, embed_tokens/lm_head
//   vocab-parallel (vocab padded to a multiple of 64, split by tp), MLA as vLLM's DeepseekV2 model
//   (fused_qkv_a_proj replicated when q_lora_rank is set -- SGLang: fused_qkv_a_proj_with_mqa;
//   q_b_proj/kv_b_proj by heads; o_proj row-parallel), FusedMoE experts.w13_weight
//   [E_local, 2*I/n, H] and experts.w2_weight [E_local, H, I/n]. Without expert_parallel every
//   flat rank holds all experts tensor-split n = dp*tp ways. With expert_parallel (EP size dp*tp,
//   ep_rank = flat_rank) whole experts are spread as vLLM's determine_expert_map does: linear
//   (default): ep_rank r holds base + (r < rem) contiguous experts starting at r*base + min(r, rem)
//   (base = E / ep, rem = E % ep: earlier ranks take the extra expert); expert_placement
//   "round_robin": experts r, r+ep, r+2ep, ... SGLang requires ep | E. Norms, routers and biases
//   replicated; e_score_correction_bias float32.
//
// Every worker has ONE buffer holding its local tensors packed in order at 256-byte aligned offsets.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/model_config.h"
#include "planner/types.h"

namespace wb::planner {

struct ParallelConfig {
  std::string preset;  // "megatron", "fsdp" (= "fsdp2"), "fsdp2_tp" (= "fsdp_tp"), "fsdp_flat" (= "deepspeed_zero3"), "vllm", "sglang"
  int tp = 1, pp = 1, dp = 1, ep = 1, etp = 0;  // etp 0 = tp
  bool expert_parallel = false;                 // vllm/sglang
  int replicas = 1;                             // vllm/sglang: engines; fsdp2 / fsdp2_tp: HSDP replicate size
  // megatron: --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (0 = not set)
  // and --virtual-pipeline-model-parallel-size (1 = none).
  int first_stage_layers = 0, last_stage_layers = 0, vpp = 1;
  // vllm: --expert-placement-strategy, "" (= "linear") or "round_robin" (expert_parallel only).
  std::string expert_placement;
  // vllm: --all2all-backend (VLLM_ALL2ALL_BACKEND), "" = allgather_reducescatter; sglang:
  // --moe-a2a-backend, "" = none. It decides whether the engine keeps the MoE layers' shared
  // experts whole on every rank (docs/presets.md): vLLM's DeepSeek-V2/V3 under
  // use_sequence_parallel_moe (a backend of its list, expert parallel, tp > 1, dp > 1); SGLang's
  // DeepSeek, GLM-4.5 and Qwen2-MoE with any a2a backend (Qwen2-MoE: deepep / flashinfer only).
  // An unknown name is refused, listing the known ones.
  std::string moe_a2a_backend;
  // megatron: --make-vocab-size-divisible-by: the embedding and output layer hold
  // ceil(vocab / (m * tp)) * m rows per rank (Megatron-LM pads the vocab to a multiple of m * tp;
  // 128 is its default). 1: padded to a multiple of tp only - Megatron-Bridge's and verl's mcore
  // models build the vocab unpadded (should_pad_vocab false), which is this when tp divides it.
  int vocab_divisible_by = 128;
  // megatron: --moe-grouped-gemm with Transformer Engine (TEGroupedMLP, verl's and
  // Megatron-Bridge's default for MoE): rank-local expert j's weights are
  // "mlp.experts.linear_fc1.weight<j>" / "mlp.experts.linear_fc2.weight<j>" instead of
  // SequentialMLP's "mlp.experts.local_experts.<j>.linear_fc1.weight"; the same bytes.
  bool moe_grouped_gemm = false;
  // megatron: --moe-use-legacy-grouped-gemm (with moe_grouped_gemm): the legacy GroupedMLP holds a
  // layer's local experts in two parameters, "mlp.experts.weight1" [hidden, E_local * F] and
  // "mlp.experts.weight2" [E_local * F2, hidden] (F = 2 * moe_intermediate / etp, F2 = F / 2),
  // whose memory is, per local expert j, linear_fc1's slice transposed ([hidden, F]: gate columns,
  // then up) and linear_fc2's slice transposed ([F2, hidden]), as GroupedMLP.forward's
  // view(E_local, hidden, -1) / view(E_local, -1, hidden) reads it. No biases (GroupedMLP has none).
  bool moe_legacy_grouped_gemm = false;
  // megatron: --use-tp-pp-dp-mapping (rank order tp-pp-dp instead of tp-dp-pp):
  // rank = tp_rank + tp * (pp_rank + pp * dp_rank). Megatron wants no CP with it, and for MoE
  // models the expert groups must keep the same pipeline groups (ep * etp = tp).
  bool tp_pp_dp_mapping = false;
  // vllm/sglang only: "" (weights in the canonical dtype) or "fp8_block128": every 2-D linear
  // weight (a ".weight" whose name has "proj" or ".experts.") is held as float8_e4m3 with
  // 128x128 block scales (planner/types.h Quantization), as vLLM / SGLang fp8 block-quant
  // checkpoints (DeepSeek-V3 style) hold them. Its local tensor becomes float8_e4m3 and is followed
  // by "<name>_scale_inv" (float32): each piece's scales in piece order; shape
  // [sum of the pieces' row blocks, column blocks] when the pieces are row slabs of a 2-D tensor,
  // else [number of scales]. Embeddings, lm_head, norms, routers and biases stay unquantised.
  // "mxfp8": the same tensors as float8_e4m3 with OCP MX scales: blocks of 1x32 along the input
  // (last) dim, one float8_e8m0 byte per block, in "<name>_scale" ([rows, cols/32] for row slabs;
  // "<name>_scale_inv" for sglang, whose Fp8LinearMethod holds MX scales under fp8's name).
  // "w4a16_g32": the same tensors as int4 (compressed-tensors pack-quantized W4A16, symmetric,
  // groups of 1x32 along the input dim): the local tensor becomes "<name>_packed" (int4, two per
  // byte), followed by "<name>_scale" in the tensor's dtype. "w4a16_experts_g32": routed experts
  // only (".experts." but not shared experts), as Kimi-K2-Thinking's INT4 checkpoint.
  // "nvfp4": the same tensors as float4_e2m1 (ModelOpt NVFP4, vLLM's modelopt_fp4 checkpoint
  // layout: two per byte, the even element in the low nibble), followed by "<name>_scale"
  // (float8_e4m3, one per 1x16 block along the input dim) and "<name>_scale_2" (float32 [1], the
  // second-level scale: one per local tensor, from the largest magnitude of the whole canonical
  // tensors of its pieces, so a fused qkv_proj / gate_up_proj shares it as ModelOpt exports them
  // and every TP rank holds the same value (when the receiving node holds the whole tensors:
  // daemon/node/quantize_incoming.h);
  // fused MoE experts [E, rows, cols]: [E], one per expert, its gate and up sharing it).
  // Every quantised piece must be block-aligned (InvalidArgument naming it otherwise).
  std::string quantization;
  // sglang DP attention (dp > 1) only: --enable-dp-lm-head. lm_head.weight is vocab-parallel over
  // the attention-TP group (the tp ranks of the DP rank, as embed_tokens: padded vocab / tp rows,
  // part tp_rank) instead of all dp*tp ranks (deepseek_v2.py: ParallelLMHead(use_attn_tp_group=
  // enable_dp_lm_head); layers/vocab_parallel_embedding.py: use_attn_tp_group takes the attention
  // TP rank and size). SGLang asserts --enable-dp-attention with it and drops it with --dp-size 1:
  // refused with dp = 1, naming it.
  bool enable_dp_lm_head = false;
  // sglang: --moe-dense-tp-size (0 = not set). 1: the dense MLPs of DeepSeek-V2/V3 / Kimi-K2 (the
  // first_k_dense_replace prefix) are whole on every rank (DeepseekV2DecoderLayer builds
  // DeepseekV2MLP with tp_rank 0, tp_size 1 when layers/communicator.py enable_moe_dense_fully_dp()),
  // with or without DP attention; shared experts, routed experts and everything else unchanged.
  // dp*tp (SGLang's --tp-size): the same as not set. Any other value is refused (SGLang's
  // check_server_args accepts None, 1 or tp_size), and 1 on any other family (not described).
  int moe_dense_tp_size = 0;
};

// One framework-local tensor inside the worker's buffer.
struct LocalTensor {
  std::string name;            // framework name, e.g. "model.layers.0.self_attn.qkv_proj.weight"
  std::vector<int64_t> shape;  // local shape
  DType dtype = DType::kBF16;
  int64_t offset_bytes = 0;    // in buffer 0
  int32_t first_piece = 0;     // its pieces are layout.pieces[first_piece, first_piece + num_pieces)
  int32_t num_pieces = 0;
};

struct PresetLayout {
  WorkerLayout layout;  // exactly one buffer
  std::vector<LocalTensor> local_tensors;
};

inline constexpr int64_t kLocalTensorAlignment = 256;

// Whether `scheme` is a known ParallelConfig::quantization ("" included).
bool KnownQuantization(const std::string& scheme);

// Largest world a preset may describe (ranks of one trainer or one set of engines).
inline constexpr int64_t kMaxPresetWorld = int64_t{1} << 20;

// World size of the preset, or InvalidArgument for an unknown preset / non-positive sizes / a
// world over kMaxPresetWorld (computed without overflow).
absl::StatusOr<int> PresetWorldSize(const ParallelConfig& parallel);

// Resolves the inventory once, then makes any rank's layout cheaply. `inventory` must be the one
// BuildInventory(config, ...) returned (it is referenced, not copied, and must outlive the object).
class PresetBuilder {
 public:
  // InvalidArgument when the parallel config does not fit the model (names the constraint).
  static absl::StatusOr<PresetBuilder> Create(const ModelConfig& config, const Inventory& inventory,
                                              const ParallelConfig& parallel);
  int world_size() const { return world_; }
  // Layout of `rank` in [0, world_size()).
  absl::StatusOr<PresetLayout> Make(int rank) const;

  struct Ids;  // resolved tensor indices (implementation detail)

 private:
  PresetBuilder() = default;
  ModelConfig config_;
  ParallelConfig parallel_;
  const Inventory* inventory_ = nullptr;
  int world_ = 0;
  std::shared_ptr<const Ids> ids_;
};

// Global expert ids an expert-parallel vLLM rank holds, in local order (determine_expert_map):
// linear: earlier ranks take the extra expert; round_robin: ep_rank, ep_rank + ep, ...
std::vector<int64_t> VllmLocalExperts(int64_t experts, int64_t ep_size, int64_t ep_rank, bool round_robin);

// Megatron layers of pipeline rank `pp_rank`: one [first, first + count) range per virtual stage
// (vpp of them, in chunk order). InvalidArgument when the split is not one Megatron accepts.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> MegatronStageLayers(int64_t layers, const ParallelConfig& par,
                                                                             int pp_rank);

// Convenience: PresetBuilder::Create(...) then Make(rank).
absl::StatusOr<PresetLayout> MakePresetLayout(const ModelConfig& config, const Inventory& inventory,
                                              const ParallelConfig& parallel, int rank);

}  // namespace wb::planner
