#include "planner/inventory.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wb::planner {

namespace {

// Config fields whose value is `v` (for messages: which config numbers made a tensor too large).
std::string FieldsWithValue(const ModelConfig& c, int64_t v) {
  const std::pair<const char*, int64_t> fields[] = {
      {"hidden_size", c.hidden},          {"vocab_size", c.vocab},
      {"intermediate_size", c.intermediate}, {"moe_intermediate_size", c.moe_intermediate},
      {"num_attention_heads", c.heads},   {"num_key_value_heads", c.kv_heads},
      {"head_dim", c.head_dim},           {"kv_lora_rank", c.kv_lora_rank},
      {"q_lora_rank", c.q_lora_rank},     {"index_head_dim", c.index_head_dim},
      {c.experts_field.empty() ? "num_experts" : c.experts_field.c_str(), c.experts}};
  std::vector<std::string> names;
  for (const auto& [name, value] : fields) {
    if (value == v && v > 0) names.push_back(name);
  }
  return names.empty() ? std::string("derived") : absl::StrJoin(names, "/");
}

// Appends tensors to an inventory, or (inv == nullptr) only counts them: tensors, bytes, and the
// first tensor over the element limit. Element counts are overflow-checked.
class Builder {
 public:
  Builder(Inventory* inv, const ModelConfig& c, DType dtype, const InventoryLimits& limits)
      : inv_(inv), c_(c), dtype_(dtype), limits_(limits) {}

  // `dtype`: the tensor's own dtype when it is not the model's (fp32 router biases).
  void Add(std::string name, std::vector<int64_t> shape, std::optional<DType> dtype = std::nullopt) {
    const DType dt = dtype.value_or(dtype_);
    if (inv_ != nullptr) {
      inv_->tensors.push_back(TensorSpec{std::move(name), std::move(shape), dt});
      return;
    }
    ++count_;
    if (!status_.ok()) return;
    int64_t n = 1;
    bool over = false;
    for (int64_t d : shape) over = over || __builtin_mul_overflow(n, d, &n) || n > limits_.max_tensor_elements;
    int64_t b = 0;
    if (over || __builtin_mul_overflow(n, int64_t{DTypeSize(dt)}, &b) || __builtin_add_overflow(bytes_, b, &bytes_)) {
      std::vector<std::string> dims;
      for (int64_t d : shape) dims.push_back(absl::StrCat(FieldsWithValue(c_, d), "=", d));
      status_ = absl::InvalidArgumentError(absl::StrCat("config.json: tensor ", name, " [", absl::StrJoin(dims, ", "),
                                                        "] has more than the limit of ", limits_.max_tensor_elements,
                                                        " elements"));
    }
  }

  int64_t count() const { return count_; }
  int64_t bytes() const { return bytes_; }
  const absl::Status& status() const { return status_; }

 private:
  Inventory* inv_;
  const ModelConfig& c_;
  DType dtype_;
  const InventoryLimits& limits_;
  int64_t count_ = 0;
  int64_t bytes_ = 0;
  absl::Status status_;
};

void AddGatedMlp(Builder& b, const std::string& prefix, int64_t hidden, int64_t inter, bool bias = false) {
  b.Add(prefix + "gate_proj.weight", {inter, hidden});
  if (bias) b.Add(prefix + "gate_proj.bias", {inter});
  b.Add(prefix + "up_proj.weight", {inter, hidden});
  if (bias) b.Add(prefix + "up_proj.bias", {inter});
  b.Add(prefix + "down_proj.weight", {hidden, inter});
  if (bias) b.Add(prefix + "down_proj.bias", {hidden});
}

void AddAttention(Builder& b, const ModelConfig& c, const std::string& a) {
  const int64_t H = c.hidden;
  if (c.mla) {
    const int64_t qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
    if (c.q_lora_rank > 0) {
      b.Add(a + "q_a_proj.weight", {c.q_lora_rank, H});
      b.Add(a + "q_a_layernorm.weight", {c.q_lora_rank});
      b.Add(a + "q_b_proj.weight", {c.heads * qk_head, c.q_lora_rank});
    } else {
      b.Add(a + "q_proj.weight", {c.heads * qk_head, H});
    }
    b.Add(a + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H});
    b.Add(a + "kv_a_layernorm.weight", {c.kv_lora_rank});
    b.Add(a + "kv_b_proj.weight", {c.heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
    b.Add(a + "o_proj.weight", {H, c.heads * c.v_head_dim});
    if (c.dsa_indexer) {
      // DeepSeek-V3.2's lightning indexer (HF DeepseekV32Indexer, the checkpoint's
      // self_attn.indexer.* keys). k_norm is a LayerNorm whose weight and bias are float32 in the
      // reference model (inference/model.py LayerNorm), vLLM (layers/layernorm.py LayerNorm) and
      // SGLang (nsa_indexer.py: LayerNorm(dtype=torch.float32)).
      const std::string x = a + "indexer.";
      b.Add(x + "wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank});
      b.Add(x + "wk.weight", {c.index_head_dim, H});
      b.Add(x + "k_norm.weight", {c.index_head_dim}, DType::kF32);
      b.Add(x + "k_norm.bias", {c.index_head_dim}, DType::kF32);
      b.Add(x + "weights_proj.weight", {c.index_n_heads, H});
    }
    return;
  }
  const int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  if (c.fused_proj) {
    // Phi-3 (Phi3Attention): one qkv_proj whose rows are [q; k; v], no biases (ParseHfConfig).
    b.Add(a + "qkv_proj.weight", {q + 2 * kv, H});
    b.Add(a + "o_proj.weight", {H, q});
    return;
  }
  b.Add(a + "q_proj.weight", {q, H});
  if (c.qkv_bias) b.Add(a + "q_proj.bias", {q});
  b.Add(a + "k_proj.weight", {kv, H});
  if (c.qkv_bias) b.Add(a + "k_proj.bias", {kv});
  b.Add(a + "v_proj.weight", {kv, H});
  if (c.qkv_bias) b.Add(a + "v_proj.bias", {kv});
  b.Add(a + "o_proj.weight", {H, q});
  if (c.o_bias) b.Add(a + "o_proj.bias", {H});
  if (c.attn_sinks) b.Add(a + "sinks", {c.heads});  // GPT-OSS: one learned sink logit per head
  if (c.qk_norm) {
    // OLMo-2/3 normalise the whole q / k projection (Olmo2RMSNorm(heads * head_dim)), the others
    // each head (RMSNorm(head_dim)).
    b.Add(a + "q_norm.weight", {c.qk_norm_full ? q : c.head_dim});
    b.Add(a + "k_norm.weight", {c.qk_norm_full ? kv : c.head_dim});
  }
}

void AddLayer(Builder& b, const ModelConfig& c, int64_t l) {
  const int64_t H = c.hidden;
  const std::string p = absl::StrCat("model.layers.", l, ".");
  if (!c.post_norms) b.Add(p + "input_layernorm.weight", {H});  // OLMo-2/3 have none
  AddAttention(b, c, p + "self_attn.");
  b.Add(p + "post_attention_layernorm.weight", {H});
  if (c.post_norms) {  // OLMo-2/3: the MLP's output is normalised, its input is not
    AddGatedMlp(b, p + "mlp.", H, c.intermediate);
    b.Add(p + "post_feedforward_layernorm.weight", {H});
    return;
  }
  if (c.fused_proj) {  // Phi-3 (Phi3MLP): gate_up_proj rows are [gate; up] (forward chunks it in two)
    b.Add(p + "mlp.gate_up_proj.weight", {2 * c.intermediate, H});
    b.Add(p + "mlp.down_proj.weight", {H, c.intermediate});
    return;
  }
  if (c.ffn_norms) {  // Gemma 2/3: the MLP is wrapped in its own pre/post norms
    b.Add(p + "pre_feedforward_layernorm.weight", {H});
    AddGatedMlp(b, p + "mlp.", H, c.intermediate, c.mlp_bias);
    b.Add(p + "post_feedforward_layernorm.weight", {H});
    return;
  }
  if (!c.IsMoeLayer(l)) {
    AddGatedMlp(b, p + "mlp.", H, c.intermediate, c.mlp_bias);
    return;
  }
  if (c.fused_experts) {
    // GPT-OSS (HF GptOssExperts): all experts in one tensor each; gate_up_proj's last dim
    // interleaves gate and up columns (gate = [..., ::2], up = [..., 1::2]).
    const std::string m = p + "mlp.";
    const int64_t E = c.experts, I = c.moe_intermediate;
    b.Add(m + "router.weight", {E, H});
    b.Add(m + "router.bias", {E});
    b.Add(m + "experts.gate_up_proj", {E, H, 2 * I});
    b.Add(m + "experts.gate_up_proj_bias", {E, 2 * I});
    b.Add(m + "experts.down_proj", {E, I, H});
    b.Add(m + "experts.down_proj_bias", {E, H});
    return;
  }
  if (c.family == ModelFamily::kMixtral || c.family == ModelFamily::kMiniMaxM2) {
    const std::string m = p + "block_sparse_moe.";
    b.Add(m + "gate.weight", {c.experts, H});
    // MiniMax-M2: the routing bias sits on the MoE block, not on the gate (checkpoint key
    // block_sparse_moe.e_score_correction_bias; float32 in vLLM / SGLang's MiniMaxM2MoE).
    if (c.family == ModelFamily::kMiniMaxM2) b.Add(m + "e_score_correction_bias", {c.experts}, DType::kF32);
    for (int64_t e = 0; e < c.experts; ++e) {
      const std::string x = absl::StrCat(m, "experts.", e, ".");
      b.Add(x + "w1.weight", {c.moe_intermediate, H});
      b.Add(x + "w2.weight", {H, c.moe_intermediate});
      b.Add(x + "w3.weight", {c.moe_intermediate, H});
    }
    return;
  }
  const std::string m = p + "mlp.";
  b.Add(m + "gate.weight", {c.experts, H});
  // float32 whatever the model's dtype: the checkpoints, HF transformers (a float32 buffer), vLLM
  // and SGLang (float32 parameter) and Megatron (router.expert_bias) all keep it in fp32.
  if (c.router_bias) b.Add(m + "gate.e_score_correction_bias", {c.experts}, DType::kF32);
  for (int64_t e = 0; e < c.experts; ++e) {
    AddGatedMlp(b, absl::StrCat(m, "experts.", e, "."), H, c.moe_intermediate);
  }
  if (c.shared_expert_intermediate > 0) {
    if (c.family == ModelFamily::kQwen2Moe) {
      AddGatedMlp(b, m + "shared_expert.", H, c.shared_expert_intermediate);
      b.Add(m + "shared_expert_gate.weight", {1, H});
    } else {
      AddGatedMlp(b, m + "shared_experts.", H, c.shared_expert_intermediate);
    }
  }
}

void AddHead(Builder& b, const ModelConfig& c) { b.Add("model.embed_tokens.weight", {c.vocab, c.hidden}); }

void AddTail(Builder& b, const ModelConfig& c) {
  b.Add("model.norm.weight", {c.hidden});
  if (!c.tie_word_embeddings) b.Add("lm_head.weight", {c.vocab, c.hidden});
}

// Counts the tensors and bytes BuildInventory would make, without building them: a layer's tensors
// depend only on whether it is an MoE layer, so one layer of each kind is counted and multiplied.
// Returns the tensor count.
absl::StatusOr<int64_t> CheckBounds(const ModelConfig& c, DType dtype, const InventoryLimits& lim) {
  const std::string experts_field = c.experts_field.empty() ? "num_experts" : c.experts_field;
  // Each layer has at least one tensor, each MoE layer at least one per expert: refuse before
  // walking the layers or building an expert's names.
  if (c.layers > lim.max_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: num_hidden_layers=", c.layers,
                                                   " gives more tensors than the limit of ", lim.max_tensors));
  }
  if (c.experts > lim.max_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", experts_field, "=", c.experts,
                                                   " gives more tensors than the limit of ", lim.max_tensors));
  }
  Builder ends(nullptr, c, dtype, lim);
  AddHead(ends, c);
  AddTail(ends, c);
  int64_t dense = 0, moe = 0, first_dense = -1, first_moe = -1;
  for (int64_t l = 0; l < c.layers; ++l) {
    if (c.IsMoeLayer(l)) {
      if (moe++ == 0) first_moe = l;
    } else if (dense++ == 0) {
      first_dense = l;
    }
  }
  Builder dl(nullptr, c, dtype, lim), ml(nullptr, c, dtype, lim);
  if (first_dense >= 0) AddLayer(dl, c, first_dense);
  if (first_moe >= 0) AddLayer(ml, c, first_moe);
  for (const Builder* b : {&ends, &dl, &ml}) {
    if (!b->status().ok()) return b->status();
  }
  // Counts: each factor <= ~2^19 (limits above), so these products cannot overflow.
  const int64_t tensors = ends.count() + dense * dl.count() + moe * ml.count();
  if (tensors > lim.max_tensors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: num_hidden_layers=", c.layers, c.experts > 0 ? absl::StrCat(", ", experts_field, "=", c.experts) : "",
        " give ", tensors, " tensors, more than the limit of ", lim.max_tensors));
  }
  int64_t total = ends.bytes(), part = 0;
  bool overflow = __builtin_mul_overflow(dense, dl.bytes(), &part) || __builtin_add_overflow(total, part, &total) ||
                  __builtin_mul_overflow(moe, ml.bytes(), &part) || __builtin_add_overflow(total, part, &total);
  if (overflow || total > lim.max_total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: the model's tensors need ",
                                                   overflow ? "more than 2^63" : absl::StrCat(total),
                                                   " bytes, more than the limit of ", lim.max_total_bytes, " bytes"));
  }
  return tensors;
}

}  // namespace

absl::StatusOr<Inventory> BuildInventory(const ModelConfig& c, DType dtype, const InventoryLimits& limits) {
  if (c.hidden <= 0 || c.heads <= 0 || c.kv_heads <= 0 || c.head_dim <= 0 || c.layers <= 0 || c.vocab <= 0 ||
      c.intermediate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("model config for ", c.architecture,
                                                   " has a non-positive dimension"));
  }
  if (c.experts > 0 && c.moe_intermediate <= 0) {
    return absl::InvalidArgumentError("model config: experts without moe_intermediate_size");
  }
  auto tensors = CheckBounds(c, dtype, limits);
  if (!tensors.ok()) return tensors.status();
  Inventory inv;
  inv.architecture = c.architecture;
  inv.tensors.reserve(static_cast<size_t>(*tensors));
  Builder b(&inv, c, dtype, limits);
  AddHead(b, c);
  for (int64_t l = 0; l < c.layers; ++l) AddLayer(b, c, l);
  AddTail(b, c);
  return inv;
}

int64_t TotalElements(const Inventory& inventory) {
  int64_t total = 0;
  for (const TensorSpec& t : inventory.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    total += n;
  }
  return total;
}

TensorIndex::TensorIndex(const Inventory& inventory) {
  index_.reserve(inventory.tensors.size());
  for (size_t i = 0; i < inventory.tensors.size(); ++i) {
    index_.emplace(inventory.tensors[i].name, static_cast<int32_t>(i));
  }
}

std::optional<int32_t> TensorIndex::Find(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

std::vector<int64_t> TensorBases(const Inventory& inventory) {
  std::vector<int64_t> bases;
  bases.reserve(inventory.tensors.size() + 1);
  int64_t total = 0;
  for (const TensorSpec& t : inventory.tensors) {
    bases.push_back(total);
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    total += n;
  }
  bases.push_back(total);
  return bases;
}

}  // namespace wb::planner
