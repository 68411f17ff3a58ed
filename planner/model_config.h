#pragma once
// The few fields of a Hugging Face `config.json` that decide a model's canonical tensors.
// Pure: callers read the file; this only parses text.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace wb::planner {

enum class ModelFamily : uint8_t {
  kLlama,       // LlamaForCausalLM (also MistralForCausalLM: same tensors)
  kQwen2,       // Qwen2ForCausalLM: q/k/v bias
  kQwen2Moe,    // Qwen2MoeForCausalLM: q/k/v bias, experts, one gated shared expert
  kQwen3,       // Qwen3ForCausalLM: q_norm/k_norm
  kQwen3Moe,    // Qwen3MoeForCausalLM: q_norm/k_norm, experts
  kMixtral,     // MixtralForCausalLM: block_sparse_moe with w1/w2/w3
  kDeepseekV3,  // DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2): MLA, shared experts, dense prefix
  kDeepseekV2,  // DeepseekV2ForCausalLM (DeepSeek-V2, V2-Lite): as V3; router bias only with noaux_tc
  kGlm4Moe,     // Glm4MoeForCausalLM (GLM-4.5, 4.5-Air, 4.6): q/k/v bias, optional qk norm, DeepSeek-style MoE
  kGptOss,      // GptOssForCausalLM: q/k/v/o biases, attention sinks, fused experts with biases, router bias
  kGemma2,      // Gemma2ForCausalLM: pre/post feed-forward norms, tied embeddings by default
  kGemma3,      // Gemma3ForCausalLM (text): as Gemma 2 plus q_norm/k_norm
  kOlmo2,       // Olmo2ForCausalLM, Olmo3ForCausalLM (same tensors): post-norms only, full-width q_norm/k_norm
  kPhi3,        // Phi3ForCausalLM (Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini): fused qkv_proj and gate_up_proj in the checkpoint
  kDeepseekV32, // DeepseekV32ForCausalLM (DeepSeek-V3.2, V3.2-Exp): DeepSeek-V3 plus a DSA lightning indexer per layer
  kMiniMaxM2,   // MiniMaxM2ForCausalLM (MiniMax-M2, M2.x): full-width q_norm/k_norm, block_sparse_moe experts w1/w2/w3, fp32 router bias
};
const char* ModelFamilyName(ModelFamily family);

// LoRA adapters a model declares (issue 17.3; planner/lora.h). Not read from config.json: the
// daemon fills it from ModelSpec.lora.
struct LoraConfig {
  std::vector<std::string> target_modules;  // PEFT names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
  int64_t r = 0;                            // rank
  double alpha = 0;                         // lora_alpha (metadata: scaling alpha / r is not applied to bytes)
  int64_t max_lora_rank = 0;                // vllm_lora: vLLM's --max-lora-rank (0: planner::VllmSlotRank)
  bool fully_sharded_loras = false;         // vllm_lora: vLLM's --fully-sharded-loras
};

struct ModelConfig {
  std::string architecture;  // architectures[0]
  std::string model_type;    // informational ("" when absent)
  ModelFamily family = ModelFamily::kLlama;

  int64_t hidden = 0;        // hidden_size
  int64_t intermediate = 0;  // intermediate_size: dense MLP (Mixtral: each expert)
  int64_t heads = 0;         // num_attention_heads
  int64_t kv_heads = 0;      // num_key_value_heads (defaults to heads)
  int64_t head_dim = 0;      // head_dim, or hidden / heads
  int64_t layers = 0;        // num_hidden_layers (DeepSeek MTP layers are not counted)
  int64_t vocab = 0;         // vocab_size
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections have a bias (Qwen2, attention_bias)
  bool o_bias = false;    // o_proj has a bias (attention_bias on Llama/Qwen3)
  bool qk_norm = false;   // per-head q_norm/k_norm (Qwen3, Gemma 3, GLM-4.5 use_qk_norm)
  bool mlp_bias = false;  // gate/up/down_proj biases (Llama mlp_bias)
  bool bias_key = false;  // Llama config `bias: true`: HF ignores it, vLLM / SGLang add q/k/v/o biases
  bool ffn_norms = false; // pre_feedforward_layernorm + post_feedforward_layernorm (Gemma 2/3)
  bool attn_sinks = false;     // self_attn.sinks [heads] (GPT-OSS)
  bool fused_experts = false;  // GPT-OSS: mlp.experts.{gate_up_proj,down_proj}[_bias] over all experts, mlp.router.{weight,bias}
  // OLMo-2/3: no input_layernorm; post_attention_layernorm normalises the attention output and
  // post_feedforward_layernorm the MLP output (Olmo2DecoderLayer).
  bool post_norms = false;
  // With qk_norm: q_norm [heads*head_dim] and k_norm [kv_heads*head_dim] over all heads at once
  // (OLMo-2/3's Olmo2RMSNorm on the whole projection) instead of per-head [head_dim].
  bool qk_norm_full = false;
  // Phi-3: the checkpoint (and HF's Phi3Attention / Phi3MLP) holds self_attn.qkv_proj
  // [(heads + 2*kv_heads)*head_dim, hidden] and mlp.gate_up_proj [2*intermediate, hidden] fused.
  bool fused_proj = false;

  // Mixture of experts (experts == 0: dense model).
  int64_t experts = 0;                    // num_experts / n_routed_experts / num_local_experts
  std::string experts_field;              // which of those the config named (for messages)
  int64_t moe_intermediate = 0;           // per routed expert
  int64_t n_shared_experts = 0;           // DeepSeek: shared experts fused into one MLP
  int64_t shared_expert_intermediate = 0; // width of the shared-expert MLP (0: none)
  int64_t first_k_dense_replace = 0;      // DeepSeek: layers [0, k) are dense
  int64_t moe_layer_freq = 1;             // DeepSeek: layer l >= k is MoE when l % freq == 0
  int64_t decoder_sparse_step = 1;        // Qwen MoE: layer l is MoE when (l + 1) % step == 0
  std::vector<int64_t> mlp_only_layers;   // Qwen MoE: forced dense layers (sorted, unique)
  bool router_bias = false;               // gate.e_score_correction_bias (DeepSeek topk_method noaux_tc, GLM-4.5)

  // Multi-head latent attention (DeepSeek-V3 family).
  bool mla = false;
  int64_t q_lora_rank = 0;  // 0 when the config has null: q_proj instead of q_a/q_b
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // DeepSeek-V3.2's DSA lightning indexer (self_attn.indexer.*, every layer): wq_b
  // [index_n_heads*index_head_dim, q_lora_rank], wk [index_head_dim, hidden], k_norm (LayerNorm,
  // weight and bias [index_head_dim], float32), weights_proj [index_n_heads, hidden].
  bool dsa_indexer = false;
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;

  // Set: the model's tensors are these adapters alone (planner/lora.h BuildModelInventory).
  std::optional<LoraConfig> lora;

  // True when layer `layer` has routed experts.
  bool IsMoeLayer(int64_t layer) const;
};

// Every integer field read from config.json must be <= this (2^32): larger values are refused
// naming the field, so no product of two fields overflows int64 (BuildInventory then bounds the
// tensors themselves: planner/inventory.h InventoryLimits).
inline constexpr int64_t kMaxConfigValue = int64_t{1} << 32;
// Largest tensor dimension that is a product of fields (num_attention_heads x head_dim, ...).
inline constexpr int64_t kMaxDerivedDim = int64_t{1} << 40;
// Longest list field (mlp_only_layers) accepted.
inline constexpr int64_t kMaxConfigListLength = int64_t{1} << 17;

// Parses config.json text. Unknown architecture, malformed JSON, or a missing/ill-typed required
// field -> InvalidArgument naming the field. Every flag that adds or removes tensors in the
// family's HF implementation is honoured (attention_bias, mlp_bias, tie_word_embeddings, use_qk_norm,
// topk_method, ...); one set to a value the family does not support (e.g. attention_bias on
// MistralForCausalLM, whose HF code has no biases) is refused naming the flag, never ignored.
// Multimodal wrappers (Gemma3ForConditionalGeneration, ...) are refused: use the text config.
absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view json_text);

}  // namespace wb::planner
