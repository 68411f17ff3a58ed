#include "planner/inventory.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wb::planner {

namespace {

class Builder {
 public:
  Builder(Inventory* inv, DType dtype) : inv_(inv), dtype_(dtype) {}
  void Add(std::string name, std::vector<int64_t> shape) {
    inv_->tensors.push_back(TensorSpec{std::move(name), std::move(shape), dtype_});
  }

 private:
  Inventory* inv_;
  DType dtype_;
};

void AddGatedMlp(Builder& b, const std::string& prefix, int64_t hidden, int64_t inter) {
  b.Add(prefix + "gate_proj.weight", {inter, hidden});
  b.Add(prefix + "up_proj.weight", {inter, hidden});
  b.Add(prefix + "down_proj.weight", {hidden, inter});
}

}  // namespace

absl::StatusOr<Inventory> BuildInventory(const ModelConfig& c, DType dtype) {
  if (c.hidden <= 0 || c.heads <= 0 || c.kv_heads <= 0 || c.head_dim <= 0 || c.layers <= 0 || c.vocab <= 0 ||
      c.intermediate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("model config for ", c.architecture,
                                                   " has a non-positive dimension"));
  }
  if (c.experts > 0 && c.moe_intermediate <= 0) {
    return absl::InvalidArgumentError("model config: experts without moe_intermediate_size");
  }
  Inventory inv;
  inv.architecture = c.architecture;
  Builder b(&inv, dtype);
  const int64_t H = c.hidden;
  b.Add("model.embed_tokens.weight", {c.vocab, H});
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    b.Add(p + "input_layernorm.weight", {H});
    const std::string a = p + "self_attn.";
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
    } else {
      const int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
      b.Add(a + "q_proj.weight", {q, H});
      if (c.qkv_bias) b.Add(a + "q_proj.bias", {q});
      b.Add(a + "k_proj.weight", {kv, H});
      if (c.qkv_bias) b.Add(a + "k_proj.bias", {kv});
      b.Add(a + "v_proj.weight", {kv, H});
      if (c.qkv_bias) b.Add(a + "v_proj.bias", {kv});
      b.Add(a + "o_proj.weight", {H, q});
      if (c.o_bias) b.Add(a + "o_proj.bias", {H});
      if (c.qk_norm) {
        b.Add(a + "q_norm.weight", {c.head_dim});
        b.Add(a + "k_norm.weight", {c.head_dim});
      }
    }
    b.Add(p + "post_attention_layernorm.weight", {H});
    if (!c.IsMoeLayer(l)) {
      AddGatedMlp(b, p + "mlp.", H, c.intermediate);
      continue;
    }
    if (c.family == ModelFamily::kMixtral) {
      const std::string m = p + "block_sparse_moe.";
      b.Add(m + "gate.weight", {c.experts, H});
      for (int64_t e = 0; e < c.experts; ++e) {
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        b.Add(x + "w1.weight", {c.moe_intermediate, H});
        b.Add(x + "w2.weight", {H, c.moe_intermediate});
        b.Add(x + "w3.weight", {c.moe_intermediate, H});
      }
      continue;
    }
    const std::string m = p + "mlp.";
    b.Add(m + "gate.weight", {c.experts, H});
    if (c.router_bias) b.Add(m + "gate.e_score_correction_bias", {c.experts});
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
  b.Add("model.norm.weight", {H});
  if (!c.tie_word_embeddings) b.Add("lm_head.weight", {c.vocab, H});
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
