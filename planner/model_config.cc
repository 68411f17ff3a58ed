#include "planner/model_config.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tools/cc/status_macros.h"

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
  }
  return "unknown";
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (experts <= 0) return false;
  switch (family) {
    case ModelFamily::kMixtral:
      return true;
    case ModelFamily::kDeepseekV3:
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
  if (a == "LlamaForCausalLM" || a == "MistralForCausalLM") {
    c.family = ModelFamily::kLlama;
  } else if (a == "Qwen2ForCausalLM") {
    c.family = ModelFamily::kQwen2;
  } else if (a == "Qwen2MoeForCausalLM") {
    c.family = ModelFamily::kQwen2Moe;
  } else if (a == "Qwen3ForCausalLM") {
    c.family = ModelFamily::kQwen3;
  } else if (a == "Qwen3MoeForCausalLM") {
    c.family = ModelFamily::kQwen3Moe;
  } else if (a == "MixtralForCausalLM") {
    c.family = ModelFamily::kMixtral;
  } else if (a == "DeepseekV3ForCausalLM") {
    c.family = ModelFamily::kDeepseekV3;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: unsupported architecture `", a,
        "` (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM)"));
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
  ASSIGN_OR_RETURN(c.kv_heads, r.IntOr("num_key_value_heads", c.heads));
  RETURN_IF_ERROR(RequirePositive("num_key_value_heads", c.kv_heads));
  if (c.heads % c.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: num_attention_heads ", c.heads,
                                                   " is not a multiple of num_key_value_heads ", c.kv_heads));
  }
  ASSIGN_OR_RETURN(int64_t hd, r.IntOr("head_dim", 0));
  if (hd == 0) {
    if (c.hidden % c.heads != 0) {
      return absl::InvalidArgumentError(
          "config.json: missing field `head_dim` and hidden_size is not a multiple of num_attention_heads");
    }
    hd = c.hidden / c.heads;
  }
  c.head_dim = hd;
  ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(bool attention_bias, r.BoolOr("attention_bias", false));

  switch (c.family) {
    case ModelFamily::kQwen2:
    case ModelFamily::kQwen2Moe:
      c.qkv_bias = true;  // Qwen2 always has q/k/v bias and no o_proj bias.
      break;
    case ModelFamily::kQwen3:
    case ModelFamily::kQwen3Moe:
      c.qk_norm = true;
      c.qkv_bias = c.o_bias = attention_bias;
      break;
    case ModelFamily::kLlama:
      c.qkv_bias = c.o_bias = attention_bias;
      break;
    default:
      break;
  }

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
    if (c.family == ModelFamily::kQwen2Moe) {
      ASSIGN_OR_RETURN(c.shared_expert_intermediate, r.IntOr("shared_expert_intermediate_size", 0));
    }
  } else if (c.family == ModelFamily::kMixtral) {
    c.experts_field = "num_local_experts";
    ASSIGN_OR_RETURN(c.experts, r.Int("num_local_experts"));
    RETURN_IF_ERROR(RequirePositive("num_local_experts", c.experts));
    c.moe_intermediate = c.intermediate;
  } else if (c.family == ModelFamily::kDeepseekV3) {
    c.mla = true;
    c.router_bias = true;
    c.experts_field = "n_routed_experts";
    ASSIGN_OR_RETURN(c.experts, r.IntOr("n_routed_experts", 0));
    if (c.experts > 0) {
      ASSIGN_OR_RETURN(c.moe_intermediate, r.Int("moe_intermediate_size"));
      RETURN_IF_ERROR(RequirePositive("moe_intermediate_size", c.moe_intermediate));
    }
    ASSIGN_OR_RETURN(c.n_shared_experts, r.IntOr("n_shared_experts", 0));
    c.shared_expert_intermediate = c.n_shared_experts * c.moe_intermediate;
    ASSIGN_OR_RETURN(c.first_k_dense_replace, r.IntOr("first_k_dense_replace", 0));
    ASSIGN_OR_RETURN(c.moe_layer_freq, r.IntOr("moe_layer_freq", 1));
    RETURN_IF_ERROR(RequirePositive("moe_layer_freq", c.moe_layer_freq));
    ASSIGN_OR_RETURN(c.q_lora_rank, r.IntOr("q_lora_rank", 0));  // null -> no q compression
    ASSIGN_OR_RETURN(c.kv_lora_rank, r.Int("kv_lora_rank"));
    ASSIGN_OR_RETURN(c.qk_nope_head_dim, r.Int("qk_nope_head_dim"));
    ASSIGN_OR_RETURN(c.qk_rope_head_dim, r.Int("qk_rope_head_dim"));
    ASSIGN_OR_RETURN(c.v_head_dim, r.Int("v_head_dim"));
    RETURN_IF_ERROR(RequirePositive("kv_lora_rank", c.kv_lora_rank));
    RETURN_IF_ERROR(RequirePositive("qk_nope_head_dim", c.qk_nope_head_dim));
    RETURN_IF_ERROR(RequirePositive("qk_rope_head_dim", c.qk_rope_head_dim));
    RETURN_IF_ERROR(RequirePositive("v_head_dim", c.v_head_dim));
  }
  return c;
}

}  // namespace wb::planner
