#include "planner/model_config.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "base/status_macros.h"

namespace wb::planner {

const char* ModelFamilyName(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama:
      return "llama";
    case ModelFamily::kQwen2:
      return "qwen2";
    case ModelFamily::kQwen2Moe:
      return "qwen2_moe";
    case ModelFamily::kQwen3:
      return "qwen3";
    case ModelFamily::kQwen3Moe:
      return "qwen3_moe";
    case ModelFamily::kMixtral:
      return "mixtral";
    case ModelFamily::kDeepseekV3:
      return "deepseek_v3";
    case ModelFamily::kDeepseekV2:
      return "deepseek_v2";
    case ModelFamily::kGlm4Moe:
      return "glm4_moe";
    case ModelFamily::kGptOss:
      return "gpt_oss";
    case ModelFamily::kGemma2:
      return "gemma2";
    case ModelFamily::kGemma3:
      return "gemma3_text";
    case ModelFamily::kOlmo2:
      return "olmo2";
    case ModelFamily::kPhi3:
      return "phi3";
    case ModelFamily::kDeepseekV32:
      return "deepseek_v32";
    case ModelFamily::kMiniMaxM2:
      return "minimax_m2";
  }
  return "unknown";
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (experts <= 0) return false;
  switch (family) {
    case ModelFamily::kMixtral:
    case ModelFamily::kGptOss:
    case ModelFamily::kMiniMaxM2:
      return true;
    case ModelFamily::kGlm4Moe:
      return layer >= first_k_dense_replace;
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3:
    case ModelFamily::kDeepseekV32:
      return layer >= first_k_dense_replace && moe_layer_freq > 0 && layer % moe_layer_freq == 0;
    case ModelFamily::kQwen2Moe:
    case ModelFamily::kQwen3Moe:
      if (std::binary_search(mlp_only_layers.begin(), mlp_only_layers.end(), layer)) return false;
      return decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
    default:
      return false;
  }
}

namespace {

using nlohmann::json;

// Non-throwing field readers: every accessor checks the type first.
class Reader {
 public:
  explicit Reader(const json& j) : j_(j) {}

  const json* Find(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end()) return nullptr;
    return &*it;
  }

  absl::StatusOr<int64_t> Int(const char* key) const {
    const json* v = Find(key);
    if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("config.json: missing field `", key, "`"));
    return AsInt(key, *v);
  }

  // Absent or null -> default.
  absl::StatusOr<int64_t> IntOr(const char* key, int64_t dflt) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) return dflt;
    return AsInt(key, *v);
  }

  // Absent -> `absent` (the default of the family's HF config class, which differs from what a
  // null means); null -> `null_value`.
  absl::StatusOr<int64_t> IntAbsentOr(const char* key, int64_t absent, int64_t null_value) const {
    const json* v = Find(key);
    if (v == nullptr) return absent;
    if (v->is_null()) return null_value;
    return AsInt(key, *v);
  }

  absl::StatusOr<bool> BoolOr(const char* key, bool dflt) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) return dflt;
    if (!v->is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` is not a boolean"));
    }
    return v->get<bool>();
  }

 private:
  static absl::StatusOr<int64_t> AsInt(const char* key, const json& v) {
    std::string shown;  // the value as written, for the over-the-limit message
    bool over = false;
    int64_t x = 0;
    if (v.is_number_unsigned()) {  // may be above int64 range: compared before converting
      const uint64_t u = v.get<uint64_t>();
      over = u > static_cast<uint64_t>(kMaxConfigValue);
      x = over ? 0 : static_cast<int64_t>(u);
      shown = absl::StrCat(u);
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
      if (x < 0) return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` is negative"));
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!(d >= 0) || d != std::floor(d)) {
        return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` is not a non-negative integer"));
      }
      over = d > static_cast<double>(kMaxConfigValue);
      x = over ? 0 : static_cast<int64_t>(d);
      shown = absl::StrCat(d);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` is not a non-negative integer"));
    }
    if (over || x > kMaxConfigValue) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` = ", over ? shown : absl::StrCat(x),
                                                     " exceeds the limit of ", kMaxConfigValue));
    }
    return x;
  }

  const json& j_;
};

absl::Status RequirePositive(const char* key, int64_t v) {
  if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` must be > 0"));
  return absl::OkStatus();
}

}  // namespace

namespace {

// Tensor dimensions that are products of config fields (each <= kMaxConfigValue, so a product
// can reach 2^64): refused over kMaxDerivedDim, naming both fields, before any code multiplies
// them in int64.
absl::Status CheckDerivedDims(const ModelConfig& c) {
  struct Product {
    const char* a;
    int64_t x;
    const char* b;
    int64_t y;
  };
  const Product products[] = {
      {"num_attention_heads", c.heads, "head_dim", c.head_dim},
      {"num_key_value_heads", c.kv_heads, "head_dim", c.head_dim},
      {"num_attention_heads", c.heads, "qk_nope_head_dim + qk_rope_head_dim", c.qk_nope_head_dim + c.qk_rope_head_dim},
      {"num_attention_heads", c.heads, "qk_nope_head_dim + v_head_dim", c.qk_nope_head_dim + c.v_head_dim},
      {"n_shared_experts", c.n_shared_experts, "moe_intermediate_size", c.moe_intermediate},
      {"index_n_heads", c.index_n_heads, "index_head_dim", c.index_head_dim},
  };
  for (const Product& p : products) {
    int64_t v = 0;
    if (__builtin_mul_overflow(p.x, p.y, &v) || v > kMaxDerivedDim) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", p.a, "=", p.x, " x ", p.b, "=", p.y,
                                                     " is a tensor dimension over the limit of ", kMaxDerivedDim));
    }
  }
  return absl::OkStatus();
}

// The flags that add or remove tensors (docs/presets.md "Models"): honoured, or refused naming
// the flag when the family's HF implementation has no such tensors.
absl::Status ParseTensorFlags(const Reader& r, ModelConfig& c) {
  const std::string& a = c.architecture;
  // HF defaults: Gemma ties the embeddings unless told otherwise, the others do not.
  const bool gemma = c.family == ModelFamily::kGemma2 || c.family == ModelFamily::kGemma3;
  ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", gemma));
  // GPT-OSS's attention_bias defaults to true (GptOssConfig), everyone else's to false.
  ASSIGN_OR_RETURN(bool attention_bias, r.BoolOr("attention_bias", c.family == ModelFamily::kGptOss));
  ASSIGN_OR_RETURN(bool mlp_bias, r.BoolOr("mlp_bias", false));
  // A flag the family's HF implementation does not read cannot add tensors there: refuse it
  // rather than invent (or silently drop) tensors.
  auto refuse = [&](const char* flag) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: `", flag, "`: true is not supported for ", a,
                                                   " (its Hugging Face implementation has no such tensors)"));
  };
  if (mlp_bias && c.family != ModelFamily::kLlama) return refuse("mlp_bias");

  switch (c.family) {
    case ModelFamily::kQwen2:
    case ModelFamily::kQwen2Moe:
      c.qkv_bias = true;  // Qwen2 always has q/k/v bias and no o_proj bias (attention_bias unused).
      if (attention_bias) return refuse("attention_bias");
      break;
    case ModelFamily::kQwen3:
    case ModelFamily::kQwen3Moe:
      c.qk_norm = true;
      c.qkv_bias = c.o_bias = attention_bias;
      break;
    case ModelFamily::kLlama:
      if (a == "MistralForCausalLM") {
        if (attention_bias) return refuse("attention_bias");
        if (mlp_bias) return refuse("mlp_bias");
      }
      c.qkv_bias = c.o_bias = attention_bias;
      c.mlp_bias = mlp_bias;
      // InternLM-style `bias`: HF's Llama ignores it; vLLM's and SGLang's llama.py read
      // `attention_bias or bias`.
      if (const json* b = r.Find("bias"); b != nullptr && b->is_boolean()) c.bias_key = b->get<bool>();
      break;
    case ModelFamily::kMixtral:
      if (attention_bias) return refuse("attention_bias");
      break;
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3:
    case ModelFamily::kDeepseekV32:
      // HF DeepseekV3Attention puts attention_bias on q_a/kv_a/o projections: not modelled.
      if (attention_bias) return refuse("attention_bias");
      break;
    case ModelFamily::kGlm4Moe: {
      c.qkv_bias = attention_bias;  // Glm4MoeAttention: q/k/v bias = attention_bias, o_proj never
      ASSIGN_OR_RETURN(c.qk_norm, r.BoolOr("use_qk_norm", false));
      break;
    }
    case ModelFamily::kGptOss:
      c.qkv_bias = c.o_bias = attention_bias;
      c.attn_sinks = true;
      c.fused_experts = true;
      break;
    case ModelFamily::kGemma2:
    case ModelFamily::kGemma3:
      c.qkv_bias = c.o_bias = attention_bias;
      c.ffn_norms = true;
      c.qk_norm = c.family == ModelFamily::kGemma3;
      break;
    case ModelFamily::kOlmo2:
      // Olmo2Attention / Olmo3Attention (configuration_olmo2.py / olmo3.py: attention_bias default
      // false): q/k/v/o biases from attention_bias; q_norm over num_attention_heads*head_dim and
      // k_norm over num_key_value_heads*head_dim; Olmo2DecoderLayer drops input_layernorm.
      c.qkv_bias = c.o_bias = attention_bias;
      c.qk_norm = c.qk_norm_full = true;
      c.post_norms = true;
      break;
    case ModelFamily::kMiniMaxM2:
      // MiniMaxM2Attention (transformers' modular_minimax_m2.py, from FlexOlmoAttention): q/k/v/o
      // without biases, q_norm over num_attention_heads*head_dim and k_norm over
      // num_key_value_heads*head_dim (one RMSNorm over the whole projection). MiniMaxM2Config has no
      // attention_bias (vLLM's minimax_m2.py would read it as a q/k/v bias): refused.
      if (attention_bias) return refuse("attention_bias");
      c.qk_norm = c.qk_norm_full = true;
      {
        // The engines build the norms from use_qk_norm / qk_norm_type (SGLang) or always (vLLM),
        // HF always: anything but the per-layer full-width norm is refused, naming the field.
        ASSIGN_OR_RETURN(bool qk, r.BoolOr("use_qk_norm", true));
        if (!qk) {
          return absl::InvalidArgumentError("config.json: `use_qk_norm`: false is not supported for MiniMaxM2ForCausalLM (its Hugging Face implementation and vLLM always hold q_norm / k_norm)");
        }
        if (const json* t = r.Find("qk_norm_type"); t != nullptr && !t->is_null() && !(t->is_string() && t->get<std::string>() == "per_layer")) {
          return absl::InvalidArgumentError("config.json: `qk_norm_type` other than per_layer is not supported for MiniMaxM2ForCausalLM");
        }
      }
      break;
    case ModelFamily::kPhi3:
      // Phi3Attention / Phi3MLP build every projection with bias=False and Phi3Config has neither
      // attention_bias nor mlp_bias: refused rather than ignored.
      if (attention_bias) return refuse("attention_bias");
      c.fused_proj = true;
      // InternLM-style `bias`: HF's Phi-3 ignores it; vLLM's and SGLang's Phi-3 (their llama.py)
      // read `attention_bias or bias` (refused there: CheckVllm).
      if (const json* b = r.Find("bias"); b != nullptr && b->is_boolean()) c.bias_key = b->get<bool>();
      break;
  }

  return absl::OkStatus();
}

// DeepSeek-V3.2's lightning indexer (DeepseekV32Config: index_n_heads 64, index_head_dim 128).
absl::Status ParseDsaIndexer(const Reader& r, ModelConfig& c) {
  c.dsa_indexer = true;
  ASSIGN_OR_RETURN(c.index_n_heads, r.IntOr("index_n_heads", 64));
  ASSIGN_OR_RETURN(c.index_head_dim, r.IntOr("index_head_dim", 128));
  RETURN_IF_ERROR(RequirePositive("index_n_heads", c.index_n_heads));
  RETURN_IF_ERROR(RequirePositive("index_head_dim", c.index_head_dim));
  // The indexer's queries come from the q_a latent (wq_b reads q_lora_rank): HF's
  // DeepseekV32Attention and vLLM's Indexer (assert q_lora_rank is not None) need q compression.
  if (c.q_lora_rank == 0) {
    return absl::InvalidArgumentError(
        "config.json: `q_lora_rank`: null is not supported for DeepseekV32ForCausalLM (the indexer's wq_b reads the q_a latent)");
  }
  // vLLM's IndexCache options build an indexer on some layers only; HF's DeepseekV32 has none of
  // them (an indexer on every layer): refused rather than mis-described.
  for (const char* k : {"index_topk_freq", "index_topk_pattern", "index_skip_topk_offset"}) {
    const json* v = r.Find(k);
    if (v == nullptr || v->is_null()) continue;
    if (std::string(k) == "index_topk_freq" && v->is_number_integer() && v->get<int64_t>() == 1) continue;
    return absl::InvalidArgumentError(absl::StrCat("config.json: `", k, "` is not supported for DeepseekV32ForCausalLM (",
                                                   "its Hugging Face implementation has an indexer on every layer)"));
  }
  // transformers writes mlp_layer_types (dense / sparse per layer) when it saves the config; a
  // list that disagrees with first_k_dense_replace / moe_layer_freq is refused naming it.
  if (const json* m = r.Find("mlp_layer_types"); m != nullptr && !m->is_null()) {
    bool ok = m->is_array() && static_cast<int64_t>(m->size()) == c.layers;
    for (int64_t l = 0; ok && l < c.layers; ++l) {
      const json& x = (*m)[static_cast<size_t>(l)];
      ok = x.is_string() && x.get<std::string>() == (c.IsMoeLayer(l) ? "sparse" : "dense");
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          "config.json: `mlp_layer_types` disagrees with first_k_dense_replace / moe_layer_freq (not supported)");
    }
  }
  return absl::OkStatus();
}

// Experts, shared experts, dense prefix and MLA dimensions of the MoE families.
absl::Status ParseExperts(const Reader& r, ModelConfig& c) {
  if (c.family == ModelFamily::kQwen2Moe || c.family == ModelFamily::kQwen3Moe) {
    c.experts_field = "num_experts";
    ASSIGN_OR_RETURN(c.experts, r.Int("num_experts"));
    ASSIGN_OR_RETURN(c.moe_intermediate, r.Int("moe_intermediate_size"));
    RETURN_IF_ERROR(RequirePositive("num_experts", c.experts));
    RETURN_IF_ERROR(RequirePositive("moe_intermediate_size", c.moe_intermediate));
    ASSIGN_OR_RETURN(c.decoder_sparse_step, r.IntOr("decoder_sparse_step", 1));
    RETURN_IF_ERROR(RequirePositive("decoder_sparse_step", c.decoder_sparse_step));
    if (const json* m = r.Find("mlp_only_layers"); m != nullptr && !m->is_null()) {
      if (!m->is_array()) return absl::InvalidArgumentError("config.json: field `mlp_only_layers` is not a list");
      if (static_cast<int64_t>(m->size()) > kMaxConfigListLength) {
        return absl::InvalidArgumentError(absl::StrCat("config.json: field `mlp_only_layers` has ", m->size(),
                                                       " entries, more than the limit of ", kMaxConfigListLength));
      }
      for (const json& x : *m) {
        if (!x.is_number_integer()) {
          return absl::InvalidArgumentError("config.json: field `mlp_only_layers` holds a non-integer");
        }
        c.mlp_only_layers.push_back(x.get<int64_t>());
      }
      // Sorted and unique: IsMoeLayer looks layers up by binary search (no layers x list scan).
      std::sort(c.mlp_only_layers.begin(), c.mlp_only_layers.end());
      c.mlp_only_layers.erase(std::unique(c.mlp_only_layers.begin(), c.mlp_only_layers.end()), c.mlp_only_layers.end());
    }
    if (c.family == ModelFamily::kQwen2Moe) {  // Qwen2MoeConfig's default: 5632
      ASSIGN_OR_RETURN(c.shared_expert_intermediate, r.IntAbsentOr("shared_expert_intermediate_size", 5632, 0));
    }
  } else if (c.family == ModelFamily::kMiniMaxM2) {
    // MiniMaxM2Config: num_local_experts 256; every layer sparse, each expert intermediate_size
    // wide; no shared experts. The routing bias (block_sparse_moe.e_score_correction_bias) is a
    // buffer in HF's MiniMaxM2SparseMoeBlock but exists in vLLM / SGLang only with
    // use_routing_bias: a config without it would hold different tensors per side, so refused.
    c.experts_field = "num_local_experts";
    ASSIGN_OR_RETURN(c.experts, r.IntOr("num_local_experts", 256));
    RETURN_IF_ERROR(RequirePositive("num_local_experts", c.experts));
    c.moe_intermediate = c.intermediate;
    ASSIGN_OR_RETURN(bool routing_bias, r.BoolOr("use_routing_bias", false));
    if (!routing_bias) {
      return absl::InvalidArgumentError("config.json: MiniMaxM2ForCausalLM needs `use_routing_bias`: true (Hugging Face always holds e_score_correction_bias; vLLM and SGLang only with it)");
    }
    c.router_bias = true;
    ASSIGN_OR_RETURN(int64_t shared, r.IntOr("shared_intermediate_size", 0));
    if (shared != 0) {
      return absl::InvalidArgumentError("config.json: `shared_intermediate_size` > 0 is not supported for MiniMaxM2ForCausalLM (no shared experts in its Hugging Face implementation)");
    }
  } else if (c.family == ModelFamily::kMixtral || c.family == ModelFamily::kGptOss) {
    c.experts_field = "num_local_experts";
    ASSIGN_OR_RETURN(c.experts, r.Int("num_local_experts"));
    RETURN_IF_ERROR(RequirePositive("num_local_experts", c.experts));
    c.moe_intermediate = c.intermediate;
    c.router_bias = c.family == ModelFamily::kGptOss;  // GPT-OSS: mlp.router.bias
  } else if (c.family == ModelFamily::kDeepseekV2 || c.family == ModelFamily::kDeepseekV3 ||
             c.family == ModelFamily::kDeepseekV32 || c.family == ModelFamily::kGlm4Moe) {
    const bool glm = c.family == ModelFamily::kGlm4Moe;
    c.mla = !glm;
    // e_score_correction_bias exists with topk_method noaux_tc (vLLM / HF DeepseekV2); HF
    // DeepseekV3 and GLM-4.5 always register it.
    std::string topk_method = c.family == ModelFamily::kDeepseekV2 ? "greedy" : "noaux_tc";
    if (const json* t = r.Find("topk_method"); t != nullptr && t->is_string()) topk_method = t->get<std::string>();
    c.router_bias = glm || topk_method == "noaux_tc";
    c.experts_field = "n_routed_experts";
    // A field the config leaves out takes its HF config class's default, as transformers, vLLM and
    // SGLang (which load the config through it) see it: DeepseekV3Config n_routed_experts 256,
    // moe_intermediate_size 2048, n_shared_experts 1, first_k_dense_replace 3, q_lora_rank 1536;
    // Glm4MoeConfig 128, 1408, 1, 1. DeepseekV2's defaults changed between releases (the remote
    // code's None - no experts - and transformers' 64 / 2): those two must be given. null is
    // None: no experts, no shared experts, no q compression.
    // DeepseekV32Config (transformers' configuration_deepseek_v32.py) has V3's defaults.
    const bool v3 = c.family == ModelFamily::kDeepseekV3 || c.family == ModelFamily::kDeepseekV32;
    if (c.family == ModelFamily::kDeepseekV2) {
      for (const char* k : {"n_routed_experts", "n_shared_experts"}) {
        if (r.Find(k) == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat("config.json: DeepseekV2ForCausalLM needs `", k,
                                                         "` (its default differs between transformers releases)"));
        }
      }
    }
    ASSIGN_OR_RETURN(c.experts, r.IntAbsentOr("n_routed_experts", v3 ? 256 : glm ? 128 : 0, 0));
    if (c.experts > 0) {
      if (c.family == ModelFamily::kDeepseekV2) {
        ASSIGN_OR_RETURN(c.moe_intermediate, r.Int("moe_intermediate_size"));
      } else {
        ASSIGN_OR_RETURN(c.moe_intermediate, r.IntAbsentOr("moe_intermediate_size", v3 ? 2048 : 1408, 0));
      }
      RETURN_IF_ERROR(RequirePositive("moe_intermediate_size", c.moe_intermediate));
    }
    ASSIGN_OR_RETURN(c.n_shared_experts, r.IntAbsentOr("n_shared_experts", 1, 0));
    // Over int64: refused by CheckDerivedDims below (naming both fields).
    if (__builtin_mul_overflow(c.n_shared_experts, c.moe_intermediate, &c.shared_expert_intermediate)) {
      c.shared_expert_intermediate = kMaxDerivedDim + 1;
    }
    ASSIGN_OR_RETURN(c.first_k_dense_replace, r.IntAbsentOr("first_k_dense_replace", v3 ? 3 : glm ? 1 : 0, 0));
    if (!glm) {  // Glm4Moe has no moe_layer_freq: every layer from first_k_dense_replace on is MoE
      ASSIGN_OR_RETURN(c.moe_layer_freq, r.IntOr("moe_layer_freq", 1));
      RETURN_IF_ERROR(RequirePositive("moe_layer_freq", c.moe_layer_freq));
    }
    if (c.mla) {
      ASSIGN_OR_RETURN(c.q_lora_rank, r.IntAbsentOr("q_lora_rank", 1536, 0));  // null -> no q compression
      ASSIGN_OR_RETURN(c.kv_lora_rank, r.Int("kv_lora_rank"));
      ASSIGN_OR_RETURN(c.qk_nope_head_dim, r.Int("qk_nope_head_dim"));
      ASSIGN_OR_RETURN(c.qk_rope_head_dim, r.Int("qk_rope_head_dim"));
      ASSIGN_OR_RETURN(c.v_head_dim, r.Int("v_head_dim"));
      RETURN_IF_ERROR(RequirePositive("kv_lora_rank", c.kv_lora_rank));
      RETURN_IF_ERROR(RequirePositive("qk_nope_head_dim", c.qk_nope_head_dim));
      RETURN_IF_ERROR(RequirePositive("qk_rope_head_dim", c.qk_rope_head_dim));
      RETURN_IF_ERROR(RequirePositive("v_head_dim", c.v_head_dim));
    }
    if (c.family == ModelFamily::kDeepseekV32) RETURN_IF_ERROR(ParseDsaIndexer(r, c));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view json_text) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("config.json: not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("config.json: top level is not an object");
  Reader r(j);
  ModelConfig c;

  const json* archs = r.Find("architectures");
  if (archs == nullptr || !archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
    return absl::InvalidArgumentError("config.json: missing field `architectures` (a non-empty list of strings)");
  }
  c.architecture = (*archs)[0].get<std::string>();
  if (const json* mt = r.Find("model_type"); mt != nullptr && mt->is_string()) c.model_type = mt->get<std::string>();

  const std::string& a = c.architecture;
  static constexpr std::pair<const char*, ModelFamily> kArchitectures[] = {
      {"LlamaForCausalLM", ModelFamily::kLlama},         {"MistralForCausalLM", ModelFamily::kLlama},
      {"Qwen2ForCausalLM", ModelFamily::kQwen2},         {"Qwen2MoeForCausalLM", ModelFamily::kQwen2Moe},
      {"Qwen3ForCausalLM", ModelFamily::kQwen3},         {"Qwen3MoeForCausalLM", ModelFamily::kQwen3Moe},
      {"MixtralForCausalLM", ModelFamily::kMixtral},     {"DeepseekV3ForCausalLM", ModelFamily::kDeepseekV3},
      {"DeepseekV2ForCausalLM", ModelFamily::kDeepseekV2}, {"Glm4MoeForCausalLM", ModelFamily::kGlm4Moe},
      {"GptOssForCausalLM", ModelFamily::kGptOss},       {"Gemma2ForCausalLM", ModelFamily::kGemma2},
      {"Gemma3ForCausalLM", ModelFamily::kGemma3},       {"Olmo2ForCausalLM", ModelFamily::kOlmo2},
      {"Olmo3ForCausalLM", ModelFamily::kOlmo2},         {"Phi3ForCausalLM", ModelFamily::kPhi3},
      {"DeepseekV32ForCausalLM", ModelFamily::kDeepseekV32}, {"MiniMaxM2ForCausalLM", ModelFamily::kMiniMaxM2}};
  bool known = false;
  std::vector<std::string> names;
  for (const auto& [name, family] : kArchitectures) {
    names.push_back(name);
    if (a == name) {
      c.family = family;
      known = true;
    }
  }
  if (!known) {
    if (absl::EndsWith(a, "ForConditionalGeneration")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: architecture `", a, "` is a multimodal wrapper (its vision tower and projector are not "
          "modelled); register the text model's config (e.g. text_config as Gemma3ForCausalLM)"));
    }
    return absl::InvalidArgumentError(absl::StrCat("config.json: unsupported architecture `", a,
                                                   "` (supported: ", absl::StrJoin(names, ", "), ")"));
  }

  ASSIGN_OR_RETURN(c.hidden, r.Int("hidden_size"));
  ASSIGN_OR_RETURN(c.intermediate, r.Int("intermediate_size"));
  ASSIGN_OR_RETURN(c.heads, r.Int("num_attention_heads"));
  ASSIGN_OR_RETURN(c.layers, r.Int("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.vocab, r.Int("vocab_size"));
  RETURN_IF_ERROR(RequirePositive("hidden_size", c.hidden));
  RETURN_IF_ERROR(RequirePositive("intermediate_size", c.intermediate));
  RETURN_IF_ERROR(RequirePositive("num_attention_heads", c.heads));
  RETURN_IF_ERROR(RequirePositive("num_hidden_layers", c.layers));
  RETURN_IF_ERROR(RequirePositive("vocab_size", c.vocab));
  // MiniMaxM2Config's defaults: num_key_value_heads 8, head_dim 128 (not hidden / heads).
  const bool minimax = c.family == ModelFamily::kMiniMaxM2;
  ASSIGN_OR_RETURN(c.kv_heads, r.IntOr("num_key_value_heads", minimax ? 8 : c.heads));
  RETURN_IF_ERROR(RequirePositive("num_key_value_heads", c.kv_heads));
  if (c.heads % c.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: num_attention_heads ", c.heads,
                                                   " is not a multiple of num_key_value_heads ", c.kv_heads));
  }
  ASSIGN_OR_RETURN(int64_t hd, r.IntOr("head_dim", minimax ? 128 : 0));
  if (hd == 0) {
    if (c.hidden % c.heads != 0) {
      return absl::InvalidArgumentError(
          "config.json: missing field `head_dim` and hidden_size is not a multiple of num_attention_heads");
    }
    hd = c.hidden / c.heads;
  }
  c.head_dim = hd;
  RETURN_IF_ERROR(ParseTensorFlags(r, c));
  RETURN_IF_ERROR(ParseExperts(r, c));
  RETURN_IF_ERROR(CheckDerivedDims(c));
  return c;
}

}  // namespace wb::planner
