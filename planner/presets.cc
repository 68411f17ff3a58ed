#include "planner/presets.h"

#include <algorithm>
#include <array>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/quantized.h"
#include "base/status_macros.h"

namespace wb::planner {

namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class Kind { kMegatron, kFsdp2, kFsdp2Tp, kFsdpFlat, kVllm };

absl::StatusOr<Kind> KindOf(const std::string& preset) {
  if (preset == "megatron") return Kind::kMegatron;
  if (preset == "fsdp" || preset == "fsdp2") return Kind::kFsdp2;
  // torch FSDP2 over the dp_shard dim of a (replicate, dp_shard, tp) mesh after tensor parallelism
  // (NeMo-RL's DTensor policy with tensor_parallel_size > 1, torchtitan): docs/presets.md.
  if (preset == "fsdp2_tp" || preset == "fsdp_tp") return Kind::kFsdp2Tp;
  // DeepSpeed ZeRO-3 partitions every parameter exactly as fsdp_flat lays it out (docs/presets.md).
  if (preset == "fsdp_flat" || preset == "deepspeed_zero3") return Kind::kFsdpFlat;
  if (preset == "vllm" || preset == "sglang") return Kind::kVllm;
  return absl::InvalidArgumentError(absl::StrCat("unknown layout preset `", preset,
                                                 "` (expected megatron, fsdp (= fsdp2), fsdp2_tp (= fsdp_tp), fsdp_flat (= deepspeed_zero3), vllm or sglang)"));
}

struct LayerIds {
  int32_t input_norm = -1, post_norm = -1;
  int32_t q = -1, k = -1, v = -1, o = -1, qb = -1, kb = -1, vb = -1, ob = -1, qn = -1, kn = -1;
  int32_t q_a = -1, q_a_norm = -1, q_b = -1, q_proj = -1, kv_a = -1, kv_a_norm = -1, kv_b = -1;
  // DeepSeek-V3.2's indexer: wq_b, wk, k_norm weight / bias, weights_proj.
  int32_t ix_wq_b = -1, ix_wk = -1, ix_kn = -1, ix_kn_b = -1, ix_wp = -1;
  bool moe = false;
  int32_t gate = -1, up = -1, down = -1;
  int32_t gate_b = -1, up_b = -1, down_b = -1;  // Llama mlp_bias
  int32_t pre_ff = -1, post_ff = -1;            // Gemma pre/post feed-forward norms
  int32_t sinks = -1;                           // GPT-OSS attention sinks
  int32_t qkv = -1, gate_up = -1;               // Phi-3's fused qkv_proj / gate_up_proj (canonical tensors)
  int32_t gu = -1, gu_b = -1, dn = -1, dn_b = -1;  // GPT-OSS fused experts (gate_up_proj[_bias], down_proj[_bias])
  int32_t router = -1, router_bias = -1;
  std::vector<std::array<int32_t, 3>> experts;  // {gate, up, down} (Mixtral: {w1, w3, w2})
  int32_t sh_gate = -1, sh_up = -1, sh_down = -1, sh_expert_gate = -1;
};

// Writes local tensors and their pieces into one buffer.
class Writer {
 public:
  explicit Writer(const Inventory& inv) : inv_(inv) {}

  // Starts a local tensor whose dtype is that of canonical tensor `dtype_of`. `reserve_elements`
  // >= 0: storage reserved for it when larger than the shape (FSDP2's padded shards).
  void Begin(std::string name, std::vector<int64_t> shape, int32_t dtype_of, int64_t reserve_elements = -1) {
    Close();
    cursor_ = AlignUp(cursor_, kLocalTensorAlignment);
    LocalTensor lt;
    lt.name = std::move(name);
    lt.dtype = inv_.tensors[dtype_of].dtype;
    lt.offset_bytes = cursor_;
    lt.first_piece = static_cast<int32_t>(out_.layout.pieces.size());
    elsize_ = DTypeSize(lt.dtype);
    cursor_ += std::max(Numel(shape), reserve_elements) * elsize_;
    lt.shape = std::move(shape);
    out_.local_tensors.push_back(std::move(lt));
  }

  // Canonical tensor `t` restricted to [lo, hi) along dim `d` (d < 0: whole tensor), stored
  // row-major-contiguous at local element offset `at` of the current local tensor.
  void Block(int32_t t, int d, int64_t lo, int64_t hi, int64_t at) {
    const std::vector<int64_t>& shape = inv_.tensors[t].shape;
    Piece p;
    p.tensor = t;
    p.box.begin.assign(shape.size(), 0);
    p.box.end = shape;
    if (d >= 0) {
      p.box.begin[d] = lo;
      p.box.end[d] = hi;
      if (hi <= lo) return;
    }
    std::vector<int64_t> extents(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) extents[i] = p.box.end[i] - p.box.begin[i];
    p.strides = ContiguousStrides(extents);
    p.buffer = 0;
    p.offset_bytes = out_.local_tensors.back().offset_bytes + at * elsize_;
    out_.layout.pieces.push_back(std::move(p));
  }

  // Canonical box `box` of tensor `t` at local element offset `at` with explicit local strides
  // (per canonical dim): transposed placements.
  void Strided(int32_t t, Box box, std::vector<int64_t> strides, int64_t at) {
    Piece p;
    p.tensor = t;
    p.box = std::move(box);
    p.strides = std::move(strides);
    p.buffer = 0;
    p.offset_bytes = out_.local_tensors.back().offset_bytes + at * elsize_;
    out_.layout.pieces.push_back(std::move(p));
  }

  // A flat 1-D shard [lo, hi) of tensor `t` (the current local tensor holds exactly that range).
  void Flat(int32_t t, int64_t lo, int64_t hi) {
    const std::vector<int64_t>& shape = inv_.tensors[t].shape;
    std::vector<int64_t> strides = ContiguousStrides(shape);
    for (Box& b : FlatRangeToBoxes(shape, lo, hi)) {
      int64_t flat = 0;
      for (size_t i = 0; i < shape.size(); ++i) flat += b.begin[i] * strides[i];
      Piece p;
      p.tensor = t;
      p.box = std::move(b);
      p.strides = strides;
      p.offset_bytes = out_.local_tensors.back().offset_bytes + (flat - lo) * elsize_;
      out_.layout.pieces.push_back(std::move(p));
    }
  }

  // Whole tensor, replicated.
  void Replicated(std::string name, int32_t t) {
    Begin(std::move(name), inv_.tensors[t].shape, t);
    Block(t, -1, 0, 0, 0);
  }

  // Part `idx` of `parts` equal parts along dim `d`.
  void Split(std::string name, int32_t t, int d, int64_t parts, int64_t idx) {
    std::vector<int64_t> shape = inv_.tensors[t].shape;
    const int64_t n = shape[d] / parts;
    shape[d] = n;
    Begin(std::move(name), std::move(shape), t);
    Block(t, d, idx * n, (idx + 1) * n, 0);
  }

  // [a_part; b_part] along dim 0, each part `idx` of `parts` (gate_up_proj, linear_fc1).
  void FusedRows(std::string name, int32_t a, int32_t b, int64_t parts, int64_t idx) {
    std::vector<int64_t> shape = inv_.tensors[a].shape;
    const int64_t n = shape[0] / parts;
    const int64_t row = Numel(shape) / shape[0];
    shape[0] = 2 * n;
    Begin(std::move(name), std::move(shape), a);
    Block(a, 0, idx * n, (idx + 1) * n, 0);
    Block(b, 0, idx * n, (idx + 1) * n, n * row);
  }

  // Vocab-parallel: rows [idx*per_rank, (idx+1)*per_rank) of a padded vocabulary.
  void Vocab(std::string name, int32_t t, int64_t per_rank, int64_t idx) {
    std::vector<int64_t> shape = inv_.tensors[t].shape;
    const int64_t vocab = shape[0];
    shape[0] = per_rank;
    Begin(std::move(name), std::move(shape), t);
    const int64_t lo = idx * per_rank;
    Block(t, 0, std::min(lo, vocab), std::min(lo + per_rank, vocab), 0);
  }

  PresetLayout Finish() {
    Close();
    out_.layout.buffers = {BufferInfo{AlignUp(cursor_, kLocalTensorAlignment)}};
    return std::move(out_);
  }

 private:
  void Close() {
    if (out_.local_tensors.empty()) return;
    LocalTensor& lt = out_.local_tensors.back();
    lt.num_pieces = static_cast<int32_t>(out_.layout.pieces.size()) - lt.first_piece;
  }

  const Inventory& inv_;
  PresetLayout out_;
  int64_t cursor_ = 0;
  int elsize_ = 2;
};

}  // namespace

struct PresetBuilder::Ids {
  int32_t embed = -1, final_norm = -1, lm_head = -1;
  std::vector<LayerIds> layers;
};

namespace {

class Resolver {
 public:
  explicit Resolver(const Inventory& inv) : index_(inv) {}
  absl::StatusOr<int32_t> Need(const std::string& name) const {
    auto i = index_.Find(name);
    if (!i) return absl::InvalidArgumentError(absl::StrCat("inventory lacks tensor `", name, "`"));
    return *i;
  }
  int32_t Maybe(const std::string& name) const { return index_.Find(name).value_or(-1); }

 private:
  TensorIndex index_;
};

absl::StatusOr<std::shared_ptr<const PresetBuilder::Ids>> ResolveIds(const ModelConfig& c,
                                                                     const Inventory& inv) {
  Resolver r(inv);
  auto ids = std::make_shared<PresetBuilder::Ids>();
  ASSIGN_OR_RETURN(ids->embed, r.Need("model.embed_tokens.weight"));
  ASSIGN_OR_RETURN(ids->final_norm, r.Need("model.norm.weight"));
  if (!c.tie_word_embeddings) {
    ASSIGN_OR_RETURN(ids->lm_head, r.Need("lm_head.weight"));
  }
  ids->layers.resize(c.layers);
  for (int64_t l = 0; l < c.layers; ++l) {
    LayerIds& L = ids->layers[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    if (!c.post_norms) {  // OLMo-2/3 have no input_layernorm
      ASSIGN_OR_RETURN(L.input_norm, r.Need(p + "input_layernorm.weight"));
    }
    ASSIGN_OR_RETURN(L.post_norm, r.Need(p + "post_attention_layernorm.weight"));
    if (c.fused_proj) {  // Phi-3: the canonical tensors are the fused ones
      ASSIGN_OR_RETURN(L.qkv, r.Need(a + "qkv_proj.weight"));
      ASSIGN_OR_RETURN(L.o, r.Need(a + "o_proj.weight"));
      ASSIGN_OR_RETURN(L.gate_up, r.Need(p + "mlp.gate_up_proj.weight"));
      ASSIGN_OR_RETURN(L.down, r.Need(p + "mlp.down_proj.weight"));
      continue;
    }
    if (c.mla) {
      if (c.q_lora_rank > 0) {
        ASSIGN_OR_RETURN(L.q_a, r.Need(a + "q_a_proj.weight"));
        ASSIGN_OR_RETURN(L.q_a_norm, r.Need(a + "q_a_layernorm.weight"));
        ASSIGN_OR_RETURN(L.q_b, r.Need(a + "q_b_proj.weight"));
      } else {
        ASSIGN_OR_RETURN(L.q_proj, r.Need(a + "q_proj.weight"));
      }
      ASSIGN_OR_RETURN(L.kv_a, r.Need(a + "kv_a_proj_with_mqa.weight"));
      ASSIGN_OR_RETURN(L.kv_a_norm, r.Need(a + "kv_a_layernorm.weight"));
      ASSIGN_OR_RETURN(L.kv_b, r.Need(a + "kv_b_proj.weight"));
      ASSIGN_OR_RETURN(L.o, r.Need(a + "o_proj.weight"));
      if (c.dsa_indexer) {
        const std::string x = a + "indexer.";
        ASSIGN_OR_RETURN(L.ix_wq_b, r.Need(x + "wq_b.weight"));
        ASSIGN_OR_RETURN(L.ix_wk, r.Need(x + "wk.weight"));
        ASSIGN_OR_RETURN(L.ix_kn, r.Need(x + "k_norm.weight"));
        ASSIGN_OR_RETURN(L.ix_kn_b, r.Need(x + "k_norm.bias"));
        ASSIGN_OR_RETURN(L.ix_wp, r.Need(x + "weights_proj.weight"));
      }
    } else {
      ASSIGN_OR_RETURN(L.q, r.Need(a + "q_proj.weight"));
      ASSIGN_OR_RETURN(L.k, r.Need(a + "k_proj.weight"));
      ASSIGN_OR_RETURN(L.v, r.Need(a + "v_proj.weight"));
      ASSIGN_OR_RETURN(L.o, r.Need(a + "o_proj.weight"));
      if (c.qkv_bias) {
        ASSIGN_OR_RETURN(L.qb, r.Need(a + "q_proj.bias"));
        ASSIGN_OR_RETURN(L.kb, r.Need(a + "k_proj.bias"));
        ASSIGN_OR_RETURN(L.vb, r.Need(a + "v_proj.bias"));
      }
      if (c.o_bias) {
        ASSIGN_OR_RETURN(L.ob, r.Need(a + "o_proj.bias"));
      }
      if (c.qk_norm) {
        ASSIGN_OR_RETURN(L.qn, r.Need(a + "q_norm.weight"));
        ASSIGN_OR_RETURN(L.kn, r.Need(a + "k_norm.weight"));
      }
      if (c.attn_sinks) {
        ASSIGN_OR_RETURN(L.sinks, r.Need(a + "sinks"));
      }
    }
    if (c.fused_experts) {
      const std::string m = p + "mlp.";
      L.moe = true;
      ASSIGN_OR_RETURN(L.router, r.Need(m + "router.weight"));
      ASSIGN_OR_RETURN(L.router_bias, r.Need(m + "router.bias"));
      ASSIGN_OR_RETURN(L.gu, r.Need(m + "experts.gate_up_proj"));
      ASSIGN_OR_RETURN(L.gu_b, r.Need(m + "experts.gate_up_proj_bias"));
      ASSIGN_OR_RETURN(L.dn, r.Need(m + "experts.down_proj"));
      ASSIGN_OR_RETURN(L.dn_b, r.Need(m + "experts.down_proj_bias"));
      continue;
    }
    L.moe = c.IsMoeLayer(l) && !c.ffn_norms;
    if (c.ffn_norms) {
      ASSIGN_OR_RETURN(L.pre_ff, r.Need(p + "pre_feedforward_layernorm.weight"));
    }
    if (c.ffn_norms || c.post_norms) {
      ASSIGN_OR_RETURN(L.post_ff, r.Need(p + "post_feedforward_layernorm.weight"));
    }
    if (!L.moe) {
      ASSIGN_OR_RETURN(L.gate, r.Need(p + "mlp.gate_proj.weight"));
      ASSIGN_OR_RETURN(L.up, r.Need(p + "mlp.up_proj.weight"));
      ASSIGN_OR_RETURN(L.down, r.Need(p + "mlp.down_proj.weight"));
      if (c.mlp_bias) {
        ASSIGN_OR_RETURN(L.gate_b, r.Need(p + "mlp.gate_proj.bias"));
        ASSIGN_OR_RETURN(L.up_b, r.Need(p + "mlp.up_proj.bias"));
        ASSIGN_OR_RETURN(L.down_b, r.Need(p + "mlp.down_proj.bias"));
      }
      continue;
    }
    L.experts.resize(c.experts);
    if (c.family == ModelFamily::kMixtral || c.family == ModelFamily::kMiniMaxM2) {
      const std::string m = p + "block_sparse_moe.";
      ASSIGN_OR_RETURN(L.router, r.Need(m + "gate.weight"));
      if (c.family == ModelFamily::kMiniMaxM2) {
        ASSIGN_OR_RETURN(L.router_bias, r.Need(m + "e_score_correction_bias"));
      }
      for (int64_t e = 0; e < c.experts; ++e) {
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        ASSIGN_OR_RETURN(L.experts[e][0], r.Need(x + "w1.weight"));
        ASSIGN_OR_RETURN(L.experts[e][1], r.Need(x + "w3.weight"));
        ASSIGN_OR_RETURN(L.experts[e][2], r.Need(x + "w2.weight"));
      }
      continue;
    }
    const std::string m = p + "mlp.";
    ASSIGN_OR_RETURN(L.router, r.Need(m + "gate.weight"));
    if (c.router_bias) {
      ASSIGN_OR_RETURN(L.router_bias, r.Need(m + "gate.e_score_correction_bias"));
    }
    for (int64_t e = 0; e < c.experts; ++e) {
      const std::string x = absl::StrCat(m, "experts.", e, ".");
      ASSIGN_OR_RETURN(L.experts[e][0], r.Need(x + "gate_proj.weight"));
      ASSIGN_OR_RETURN(L.experts[e][1], r.Need(x + "up_proj.weight"));
      ASSIGN_OR_RETURN(L.experts[e][2], r.Need(x + "down_proj.weight"));
    }
    if (c.shared_expert_intermediate > 0) {
      const std::string s = m + (c.family == ModelFamily::kQwen2Moe ? "shared_expert." : "shared_experts.");
      ASSIGN_OR_RETURN(L.sh_gate, r.Need(s + "gate_proj.weight"));
      ASSIGN_OR_RETURN(L.sh_up, r.Need(s + "up_proj.weight"));
      ASSIGN_OR_RETURN(L.sh_down, r.Need(s + "down_proj.weight"));
      if (c.family == ModelFamily::kQwen2Moe) {
        ASSIGN_OR_RETURN(L.sh_expert_gate, r.Need(m + "shared_expert_gate.weight"));
      }
    }
  }
  return std::shared_ptr<const PresetBuilder::Ids>(std::move(ids));
}

absl::Status Divides(int64_t d, int64_t n, const char* what_d, const char* what_n, const char* preset) {
  if (d <= 0 || n % d != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(preset, ": ", what_d, "=", d, " must divide ", what_n, "=", n));
  }
  return absl::OkStatus();
}

int EffectiveEtp(const ParallelConfig& p) { return p.etp > 0 ? p.etp : p.tp; }

absl::Status CheckMegatron(const ModelConfig& c, const ParallelConfig& p) {
  const char* m = "megatron";
  if (p.pp > c.layers) {
    return absl::InvalidArgumentError(absl::StrCat("megatron: pp=", p.pp, " exceeds num_hidden_layers=", c.layers));
  }
  if (!p.expert_placement.empty()) {
    return absl::InvalidArgumentError("megatron: expert_placement is a vllm option");
  }
  if (p.vocab_divisible_by < 1) {
    return absl::InvalidArgumentError(absl::StrCat("megatron: make_vocab_size_divisible_by must be >= 1 (got ", p.vocab_divisible_by, ")"));
  }
  RETURN_IF_ERROR(MegatronStageLayers(c.layers, p, 0).status());
  // Megatron has add_qkv_bias (q/k/v) and add_bias_linear (linear_proj, linear_fc1, linear_fc2 and
  // the experts' together): an o_proj bias without MLP biases, or the other way round, has no
  // Megatron model.
  if (c.o_bias != c.mlp_bias) {
    return absl::InvalidArgumentError(absl::StrCat("megatron: ", c.o_bias ? "attention_bias (o_proj bias) without mlp_bias" : "mlp_bias without attention_bias",
                                                   " has no Megatron-Core model (add_bias_linear gives linear_proj and linear_fc1/fc2 biases together)"));
  }
  RETURN_IF_ERROR(Divides(p.tp, c.heads, "tp", "num_attention_heads", m));
  if (!c.mla) {
    if (c.kv_heads % p.tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "megatron: tp=", p.tp, " must divide num_key_value_heads=", c.kv_heads,
          " (Megatron splits linear_qkv by query group and cannot replicate KV heads)"));
    }
  }
  RETURN_IF_ERROR(Divides(p.tp, c.intermediate, "tp", "intermediate_size", m));
  if (c.experts > 0) {
    const int etp = EffectiveEtp(p);
    RETURN_IF_ERROR(Divides(p.ep, c.experts, "ep", "num_experts", m));
    RETURN_IF_ERROR(Divides(etp, c.moe_intermediate, "etp", "moe_intermediate_size", m));
    if (int64_t{p.tp} * p.dp % (int64_t{p.ep} * etp) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("megatron: ep*etp=", p.ep * etp,
                                                     " must divide tp*dp=", p.tp * p.dp));
    }
    if (c.shared_expert_intermediate > 0) {
      RETURN_IF_ERROR(Divides(p.tp, c.shared_expert_intermediate, "tp", "shared expert intermediate size", m));
    }
    if (p.tp_pp_dp_mapping && int64_t{p.ep} * etp != p.tp) {
      // Megatron builds the expert groups in the same order (tp-cp-ep-pp-dp): their pipeline groups
      // match the dense ones only when ep * etp spans exactly the tp ranks.
      return absl::InvalidArgumentError(absl::StrCat("megatron: use_tp_pp_dp_mapping needs ep*etp = tp (got ep=", p.ep, " etp=", etp,
                                                     " tp=", p.tp, "): the expert groups would cross pipeline stages"));
    }
  } else if (p.ep != 1 || (p.etp != 0 && p.etp != p.tp)) {
    return absl::InvalidArgumentError("megatron: ep/etp given for a dense model");
  }
  if (p.moe_legacy_grouped_gemm && !p.moe_grouped_gemm) {
    return absl::InvalidArgumentError("megatron: moe_use_legacy_grouped_gemm needs moe_grouped_gemm (--moe-use-legacy-grouped-gemm only applies with --moe-grouped-gemm)");
  }
  if (p.moe_legacy_grouped_gemm && c.mlp_bias) {
    return absl::InvalidArgumentError("megatron: moe_use_legacy_grouped_gemm with mlp_bias: the legacy GroupedMLP has no biases");
  }
  return absl::OkStatus();
}

// vLLM's all2all backends (--all2all-backend, VLLM_ALL2ALL_BACKEND; vllm/config/parallel.py): those
// ParallelConfig.use_sequence_parallel_moe lists (in one release or another; "" = vLLM's default,
// allgather_reducescatter) and the others.
constexpr std::array<const char*, 9> kVllmSequenceParallelA2a = {
    "allgather_reducescatter", "naive", "deepep_high_throughput", "deepep_low_latency", "mori",
    "mori_high_throughput", "mori_low_latency", "nixl_ep", "flashinfer_nvlink_one_sided"};
constexpr std::array<const char*, 3> kVllmOtherA2a = {"pplx", "flashinfer_all2allv", "flashinfer_nvlink_two_sided"};
// SGLang's --moe-a2a-backend values ("" = none, SGLang's default).
constexpr std::array<const char*, 7> kSglangA2a = {"none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer"};

template <size_t N>
bool OneOf(const std::array<const char*, N>& names, const std::string& s) {
  return std::find(names.begin(), names.end(), s) != names.end();
}

bool VllmSequenceParallelA2a(const std::string& backend) {
  return backend.empty() || OneOf(kVllmSequenceParallelA2a, backend);
}

bool SglangA2aNone(const std::string& backend) { return backend.empty() || backend == "none"; }

// Whether the engine keeps the MoE layers' shared experts whole on every rank instead of TP-split.
// vLLM: ParallelConfig.use_sequence_parallel_moe (an all2all backend of kVllmSequenceParallelA2a,
// expert parallel, tp > 1, dp > 1) makes DeepseekV2MoE (DeepSeek-V2/V3, Kimi-K2) build its shared
// experts with disable_tp; other families' stay TP-split (glm4_moe.py, qwen2_moe.py).
// SGLang: with an a2a MoE backend (--moe-a2a-backend other than none) DeepseekV2MoE and
// Glm4MoeSparseMoeBlock build them with tp_size 1, and Qwen2MoeSparseMoeBlock with deepep
// (CheckA2aBackend refuses flashinfer for MoE models and Qwen2-MoE with the others).
bool SharedExpertsWhole(const ModelConfig& c, const ParallelConfig& par) {
  const bool deepseek = c.family == ModelFamily::kDeepseekV3 || c.family == ModelFamily::kDeepseekV2 ||
                        c.family == ModelFamily::kDeepseekV32;
  if (par.preset == "vllm") {
    return deepseek && par.expert_parallel && par.tp > 1 && par.dp > 1 && VllmSequenceParallelA2a(par.moe_a2a_backend);
  }
  return !SglangA2aNone(par.moe_a2a_backend) &&
         (deepseek || c.family == ModelFamily::kGlm4Moe || c.family == ModelFamily::kQwen2Moe);
}

absl::Status CheckA2aBackend(const ModelConfig& c, const ParallelConfig& p) {
  const std::string& b = p.moe_a2a_backend;
  // Dense models: the backend changes nothing (the vLLM hook passes the engine's own setting,
  // whatever a future release calls it). vLLM: it only decides shared experts.
  if (c.experts == 0) return absl::OkStatus();
  if (p.preset == "vllm") {
    if (b.empty() || OneOf(kVllmSequenceParallelA2a, b) || OneOf(kVllmOtherA2a, b) || c.shared_expert_intermediate == 0) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("vllm: unknown moe_a2a_backend `", b, "` (vLLM's --all2all-backend: ",
                                                   absl::StrJoin(kVllmSequenceParallelA2a, ", "), ", ",
                                                   absl::StrJoin(kVllmOtherA2a, ", "), ")"));
  }
  if (!b.empty() && !OneOf(kSglangA2a, b)) {
    return absl::InvalidArgumentError(absl::StrCat("sglang: unknown moe_a2a_backend `", b, "` (SGLang's --moe-a2a-backend: ",
                                                   absl::StrJoin(kSglangA2a, ", "), ")"));
  }
  if (SglangA2aNone(b)) return absl::OkStatus();
  if (b == "flashinfer") {
    // server_args.py ties it to FlashInfer's CUTLASS MoE runner, whose weight loader puts up before
    // gate in w13_weight (load_up_proj_weight_first).
    return absl::InvalidArgumentError("sglang: moe_a2a_backend flashinfer runs FlashInfer's CUTLASS MoE, which holds w13_weight as [up; gate]: not described");
  }
  if (!p.expert_parallel) {
    // server_args.py: an a2a backend sets ep_size = tp_size.
    return absl::InvalidArgumentError(absl::StrCat("sglang: moe_a2a_backend ", b,
                                                   " makes SGLang's expert parallel size the tp size: set expert_parallel"));
  }
  if (c.family == ModelFamily::kQwen2Moe && b != "deepep") {
    return absl::InvalidArgumentError(absl::StrCat("sglang: moe_a2a_backend ", b, " on ", c.architecture,
                                                   ": its shared expert's split is not described (deepep keeps it whole)"));
  }
  return absl::OkStatus();
}

// SGLang DP attention (--enable-dp-attention --dp-size D --tp-size T): the preset's dp is D and
// its tp the attention-TP size T / D (compute_dp_attention_world_info, layers/dp_attention.py:
// attn_tp_rank = tp_rank % (T / D), attn_dp_rank = tp_rank / (T / D)), so the preset's rank is
// SGLang's tp_rank. Only DeepSeek-V2/V3's layout (models/deepseek_v2.py) is described.
bool SglangDpAttention(const ParallelConfig& p) { return p.preset == "sglang" && p.dp > 1; }

bool IsDeepseek(const ModelConfig& c) {
  return c.family == ModelFamily::kDeepseekV3 || c.family == ModelFamily::kDeepseekV2 || c.family == ModelFamily::kDeepseekV32;
}

// SGLang's --moe-dense-tp-size 1 (layers/communicator.py enable_moe_dense_fully_dp()):
// DeepseekV2DecoderLayer builds its dense MLPs with tp_rank 0, tp_size 1, whole on every rank.
bool SglangDenseMlpsWhole(const ParallelConfig& p) { return p.preset == "sglang" && p.moe_dense_tp_size == 1; }

// The SGLang server options --enable-dp-lm-head and --moe-dense-tp-size: refused where SGLang
// refuses them or where their layout is not described, naming the option.
absl::Status CheckSglangServerOptions(const ModelConfig& c, const ParallelConfig& p) {
  if (p.preset != "sglang") {
    if (p.enable_dp_lm_head || p.moe_dense_tp_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(p.preset, ": enable_dp_lm_head and moe_dense_tp_size are sglang options (--enable-dp-lm-head, --moe-dense-tp-size)"));
    }
    return absl::OkStatus();
  }
  if (p.enable_dp_lm_head && p.dp == 1) {
    // server_args.py: `assert enable_dp_attention` with enable_dp_lm_head; --dp-size 1 turns both off.
    return absl::InvalidArgumentError("sglang: enable_dp_lm_head needs DP attention (dp > 1): SGLang asserts --enable-dp-attention with --enable-dp-lm-head and drops both when --dp-size is 1");
  }
  const int64_t engine_tp = int64_t{p.dp} * p.tp;  // SGLang's --tp-size
  if (p.moe_dense_tp_size != 0 && p.moe_dense_tp_size != 1 && p.moe_dense_tp_size != engine_tp) {
    // server_args.py check_server_args: moe_dense_tp_size in (None, 1, tp_size).
    return absl::InvalidArgumentError(absl::StrCat("sglang: moe_dense_tp_size=", p.moe_dense_tp_size,
                                                   " is not one SGLang accepts (--moe-dense-tp-size: 1 or its --tp-size, here dp*tp=", engine_tp, ")"));
  }
  if (p.moe_dense_tp_size == 1 && !IsDeepseek(c)) {
    return absl::InvalidArgumentError(absl::StrCat("sglang: moe_dense_tp_size=1 is described for DeepSeek-V2/V3 only; ", c.architecture,
                                                   "'s dense MLPs under --moe-dense-tp-size 1 are not described"));
  }
  return absl::OkStatus();
}

absl::Status CheckSglangDpAttention(const ModelConfig& c, const ParallelConfig& p) {
  if (!IsDeepseek(c)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sglang: dp=", p.dp, " (DP attention) is described for DeepSeek-V2/V3 (MLA) only; ", c.architecture,
        "'s layout under --enable-dp-attention is not described (use dp=1 with replicas for independent engines)"));
  }
  const int64_t world = int64_t{p.dp} * p.tp;
  // ParallelLMHead (use_attn_tp_group off, SGLang's default without --enable-dp-lm-head) splits
  // the vocabulary padded to 64 over all tp_size = dp*tp ranks, as divide() asserts. With
  // --enable-dp-lm-head it splits it over the attention-TP group (tp, checked with embed_tokens).
  if (const int64_t padded = AlignUp(c.vocab, 64); !c.tie_word_embeddings && !p.enable_dp_lm_head && padded % world != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sglang: dp*tp=", world, " (DP attention: lm_head over all ranks) must divide the vocabulary padded to a multiple of 64 (vocab_size=",
                                                   c.vocab, " -> ", padded, "; --enable-dp-lm-head splits it over the tp ranks of a DP rank)"));
  }
  // Dense layers' DeepseekV2MLP is TP over all tp_size ranks (--moe-dense-tp-size unset or
  // tp_size), whole with --moe-dense-tp-size 1.
  for (int64_t l = 0; l < c.layers && !SglangDenseMlpsWhole(p); ++l) {
    if (!c.IsMoeLayer(l)) return Divides(world, c.intermediate, "dp*tp (DP attention: dense MLPs over all ranks)", "intermediate_size", "sglang");
  }
  return absl::OkStatus();
}

// OLMo-2/3 in vLLM (vllm/model_executor/models/olmo2.py, which also serves Olmo3ForCausalLM) and
// SGLang (python/sglang/srt/models/olmo2.py; configs/olmo3.py maps Olmo3ForCausalLM onto it):
// Olmo2Attention takes head_dim = hidden_size / num_attention_heads, builds q_norm over
// hidden_size and k_norm over num_key_value_heads * head_dim, and applies them to q / k
// all-gathered over the tp ranks. With KV heads replicated (tp > num_key_value_heads) the
// gathered k holds tp heads, not num_key_value_heads: k_norm cannot apply, so no engine runs it.
// vLLM's olmo2.py builds qkv_proj / o_proj with bias=False and its loader skips checkpoint biases
// it has no parameter for: attention_bias would be dropped silently. SGLang's builds them from
// attention_bias.
absl::Status CheckOlmo2Engine(const ModelConfig& c, const ParallelConfig& p) {
  const std::string& m = p.preset;
  if (c.head_dim * c.heads != c.hidden) {
    return absl::InvalidArgumentError(absl::StrCat(m, ": head_dim=", c.head_dim, " on ", c.architecture, " (", m,
                                                   "'s olmo2.py uses hidden_size / num_attention_heads)"));
  }
  if (p.tp > c.kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        m, ": tp=", p.tp, " > num_key_value_heads=", c.kv_heads, " on ", c.architecture, " (", m,
        "'s olmo2.py applies k_norm [num_key_value_heads*head_dim] to k all-gathered over the tp ranks, which holds tp "
        "heads once KV heads are replicated: no such engine runs)"));
  }
  if (m == "vllm" && c.o_bias) {
    return absl::InvalidArgumentError(absl::StrCat("vllm: attention_bias on ", c.architecture,
                                                   " (vLLM's olmo2.py builds qkv_proj / o_proj without biases and skips them at load)"));
  }
  return absl::OkStatus();
}

absl::Status CheckVllm(const ModelConfig& c, const ParallelConfig& p) {
  const std::string& m = p.preset;
  const bool sglang = m == "sglang";
  if (p.first_stage_layers != 0 || p.last_stage_layers != 0 || p.vpp != 1) {
    return absl::InvalidArgumentError(absl::StrCat(m, ": first_stage_layers, last_stage_layers and vpp are megatron options"));
  }
  if (!p.expert_placement.empty() && p.expert_placement != "linear" && p.expert_placement != "round_robin") {
    return absl::InvalidArgumentError(absl::StrCat(m, ": unknown expert_placement `", p.expert_placement,
                                                   "` (expected linear or round_robin)"));
  }
  if (sglang && p.expert_placement == "round_robin") {
    return absl::InvalidArgumentError("sglang: expert_placement round_robin is not supported (SGLang assigns contiguous expert ranges)");
  }
  RETURN_IF_ERROR(CheckSglangServerOptions(c, p));
  if (SglangDpAttention(p)) RETURN_IF_ERROR(CheckSglangDpAttention(c, p));
  if (p.expert_placement == "round_robin" && !p.expert_parallel) {
    return absl::InvalidArgumentError(absl::StrCat(m, ": expert_placement round_robin needs expert_parallel"));
  }
  RETURN_IF_ERROR(CheckA2aBackend(c, p));
  if (c.bias_key && !c.o_bias) {
    // llama.py (both engines): attention_bias = config.attention_bias or config.bias.
    return absl::InvalidArgumentError(absl::StrCat(m, ": `bias: true` on ", c.architecture, " without attention_bias (", m,
                                                   "'s llama.py builds q/k/v/o biases from it; Hugging Face's ", c.architecture, " has none)"));
  }
  if (!sglang) {
    // Configs vLLM's model classes do not build as the HF config says (gemma2.py / gemma3.py assert
    // tied embeddings; qwen3.py / qwen3_moe.py build o_proj without a bias; gpt_oss.py always
    // builds the q/k/v/o biases): refused rather than mis-described.
    if ((c.family == ModelFamily::kGemma2 || c.family == ModelFamily::kGemma3) && !c.tie_word_embeddings) {
      return absl::InvalidArgumentError("vllm: tie_word_embeddings false on Gemma (vLLM's Gemma asserts tied embeddings and computes logits from embed_tokens)");
    }
    if ((c.family == ModelFamily::kQwen3 || c.family == ModelFamily::kQwen3Moe) && c.o_bias) {
      return absl::InvalidArgumentError("vllm: attention_bias on Qwen3 (vLLM's Qwen3 o_proj has no bias)");
    }
    if (c.family == ModelFamily::kGptOss && !c.o_bias) {
      return absl::InvalidArgumentError("vllm: attention_bias false on GPT-OSS (vLLM's GPT-OSS always holds q/k/v/o biases)");
    }
  } else {
    // Configs SGLang's model classes do not build as the HF config says (models/llama.py,
    // gemma2.py / gemma3, qwen2_moe.py / qwen3_moe.py): refused rather than mis-described.
    if (c.mlp_bias) return absl::InvalidArgumentError("sglang: mlp_bias (SGLang's LlamaMLP has no biases and skips them at load)");
    if ((c.family == ModelFamily::kGemma2 || c.family == ModelFamily::kGemma3) && !c.tie_word_embeddings) {
      return absl::InvalidArgumentError("sglang: tie_word_embeddings false on Gemma (SGLang's Gemma computes logits from embed_tokens)");
    }
    if ((c.family == ModelFamily::kQwen2Moe || c.family == ModelFamily::kQwen3Moe) && (c.decoder_sparse_step != 1 || !c.mlp_only_layers.empty())) {
      return absl::InvalidArgumentError("sglang: decoder_sparse_step != 1 or mlp_only_layers (SGLang's Qwen MoE layers are all sparse)");
    }
  }
  if (c.family == ModelFamily::kOlmo2) RETURN_IF_ERROR(CheckOlmo2Engine(c, p));
  if (c.family == ModelFamily::kMiniMaxM2 && !sglang && p.tp > c.kv_heads) {
    // vLLM's MiniMaxText01RMSNormTP splits k_norm [KV x head_dim] into tp row ranges, which with
    // KV heads replicated is no longer the rank's k head: not described.
    return absl::InvalidArgumentError(absl::StrCat("vllm: tp=", p.tp, " > num_key_value_heads=", c.kv_heads,
                                                   " on MiniMaxM2ForCausalLM (k_norm is split by rows over tp, not by KV head)"));
  }
  RETURN_IF_ERROR(Divides(p.tp, c.heads, "tp", "num_attention_heads", m.c_str()));
  // VocabParallelEmbedding / ParallelLMHead pad the vocabulary to a multiple of 64 and divide()
  // it by tp (which asserts); SGLang's Gemma 3 embedding is whole, but its tied head is the same.
  if (const int64_t padded = AlignUp(c.vocab, 64); padded % p.tp != 0 && !(sglang && c.family == ModelFamily::kGemma3)) {
    return absl::InvalidArgumentError(absl::StrCat(m, ": tp=", p.tp, " must divide the vocabulary padded to a multiple of 64 (vocab_size=",
                                                   c.vocab, " -> ", padded, ")"));
  }
  if ((c.family == ModelFamily::kQwen2Moe || (sglang && c.family == ModelFamily::kMixtral)) && c.head_dim * c.heads != c.hidden) {
    // Qwen2MoeAttention (vLLM and SGLang) and SGLang's MixtralAttention take head_dim =
    // hidden_size / num_heads, whatever the config says.
    return absl::InvalidArgumentError(absl::StrCat(m, ": head_dim=", c.head_dim, " on ", c.architecture, " (", m,
                                                   " uses hidden_size / num_attention_heads = ", c.hidden / c.heads, ")"));
  }
  if (!c.mla) {
    if (p.tp >= c.kv_heads ? p.tp % c.kv_heads != 0 : c.kv_heads % p.tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          m, ": tp=", p.tp, " and num_key_value_heads=", c.kv_heads, " must divide one another"));
    }
  }
  if (!SglangDenseMlpsWhole(p)) RETURN_IF_ERROR(Divides(p.tp, c.intermediate, "tp", "intermediate_size", m.c_str()));
  if (c.fused_experts) {
    // vLLM gpt_oss.py: MLPBlock asserts intermediate_size % world == 0; its weight loader slices
    // experts evenly over the EP ranks (num_experts // ep_size each).
    const int64_t flat = int64_t{p.dp} * p.tp;
    if (p.expert_placement == "round_robin") {
      return absl::InvalidArgumentError(absl::StrCat(m, ": ", c.architecture, " loads experts in contiguous ranges (no round_robin)"));
    }
    return p.expert_parallel ? Divides(flat, c.experts, "dp*tp (expert parallel)", "num_local_experts", m.c_str())
                             : Divides(flat, c.moe_intermediate, "dp*tp", "intermediate_size", m.c_str());
  }
  if (c.experts > 0) {
    // The MoE layers span the engine's dp*tp ranks (vLLM flatten_tp_across_dp).
    const int64_t flat = int64_t{p.dp} * p.tp;
    if (p.expert_parallel) {
      if (sglang) {
        RETURN_IF_ERROR(Divides(flat, c.experts, "tp (expert parallel)", "num_experts", m.c_str()));
      } else if (c.experts < flat) {
        return absl::InvalidArgumentError(absl::StrCat(m, ": expert parallel over dp*tp=", flat, " ranks needs at least as many experts (",
                                                       c.experts_field.empty() ? "num_experts" : c.experts_field, "=", c.experts, ")"));
      }
    } else {
      RETURN_IF_ERROR(Divides(flat, c.moe_intermediate, p.dp > 1 ? "dp*tp" : "tp", "moe_intermediate_size", m.c_str()));
    }
    if (c.shared_expert_intermediate > 0 && !SharedExpertsWhole(c, p)) {
      // SGLang DP attention: DeepseekV2MoE's shared experts are TP over all tp_size = dp*tp ranks.
      RETURN_IF_ERROR(SglangDpAttention(p) ? Divides(flat, c.shared_expert_intermediate, "dp*tp (DP attention)", "shared expert intermediate size", m.c_str())
                                          : Divides(p.tp, c.shared_expert_intermediate, "tp", "shared expert intermediate size", m.c_str()));
    }
  }
  return absl::OkStatus();
}

// ---- Megatron ----

// The legacy GroupedMLP (--moe-grouped-gemm --moe-use-legacy-grouped-gemm): weight1 [H, E_l * F]
// and weight2 [E_l * F2, H] whose memory GroupedMLP.forward reads as [E_l, H, F] and [E_l, F2, H]:
// local expert j's linear_fc1 slice ([gate rows; up rows], F x H) and linear_fc2 slice (H x F2),
// each transposed, one after the other.
void MegatronLegacyGroupedExperts(const ModelConfig& c, const LayerIds& L, const std::string& p,
                                  int64_t per_ep, int ep_rank, int etp, int etp_rank, Writer& w) {
  const int64_t H = c.hidden;
  const int64_t n = c.moe_intermediate / etp;  // gate (and up) rows of this etp rank
  const int64_t F = 2 * n;
  const int64_t i0 = int64_t{etp_rank} * n;
  w.Begin(p + "mlp.experts.weight1", {H, per_ep * F}, L.experts[0][0]);
  for (int64_t j = 0; j < per_ep; ++j) {
    const auto& e = L.experts[ep_rank * per_ep + j];
    // Canonical gate / up [I, H]: element (i, h) of the slice lands at j*H*F + h*F + (i - i0) (+ n for up).
    w.Strided(e[0], Box{{i0, 0}, {i0 + n, H}}, {1, F}, j * H * F);
    w.Strided(e[1], Box{{i0, 0}, {i0 + n, H}}, {1, F}, j * H * F + n);
  }
  w.Begin(p + "mlp.experts.weight2", {per_ep * n, H}, L.experts[0][2]);
  for (int64_t j = 0; j < per_ep; ++j) {
    const auto& e = L.experts[ep_rank * per_ep + j];
    // Canonical down [H, I]: element (h, i) of the slice lands at j*n*H + (i - i0)*H + h.
    w.Strided(e[2], Box{{0, i0}, {H, i0 + n}}, {1, H}, j * n * H);
  }
}

void MegatronLayer(const ModelConfig& c, const ParallelConfig& par, const LayerIds& L,
                   const std::string& p, int tp_rank, int expert_local, Writer& w) {
  const int64_t tp = par.tp;
  const int64_t H = c.hidden;
  if (c.mla) {
    w.Replicated(p + "input_layernorm.weight", L.input_norm);
    if (L.q_b >= 0) {
      w.Replicated(p + "self_attention.linear_q_down_proj.weight", L.q_a);
      w.Replicated(p + "self_attention.linear_q_up_proj.layer_norm_weight", L.q_a_norm);
      w.Split(p + "self_attention.linear_q_up_proj.weight", L.q_b, 0, tp, tp_rank);
    } else {
      w.Split(p + "self_attention.linear_q_proj.weight", L.q_proj, 0, tp, tp_rank);
    }
    w.Replicated(p + "self_attention.linear_kv_down_proj.weight", L.kv_a);
    w.Replicated(p + "self_attention.linear_kv_up_proj.layer_norm_weight", L.kv_a_norm);
    w.Split(p + "self_attention.linear_kv_up_proj.weight", L.kv_b, 0, tp, tp_rank);
    w.Split(p + "self_attention.linear_proj.weight", L.o, 1, tp, tp_rank);
  } else {
    w.Replicated(p + "self_attention.linear_qkv.layer_norm_weight", L.input_norm);
    const int64_t hd = c.head_dim, qpg = c.heads / c.kv_heads, groups = c.kv_heads / tp;
    for (int bias = 0; bias < (L.qb >= 0 ? 2 : 1); ++bias) {
      const int32_t q = bias ? L.qb : L.q, k = bias ? L.kb : L.k, v = bias ? L.vb : L.v;
      const int64_t row = bias ? 1 : H;
      std::vector<int64_t> shape = {groups * (qpg + 2) * hd};
      if (!bias) shape.push_back(H);
      w.Begin(p + (bias ? "self_attention.linear_qkv.bias" : "self_attention.linear_qkv.weight"), shape, q);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t G = tp_rank * groups + g;
        const int64_t base = g * (qpg + 2) * hd;
        w.Block(q, 0, G * qpg * hd, (G + 1) * qpg * hd, base * row);
        w.Block(k, 0, G * hd, (G + 1) * hd, (base + qpg * hd) * row);
        w.Block(v, 0, G * hd, (G + 1) * hd, (base + (qpg + 1) * hd) * row);
      }
    }
    w.Split(p + "self_attention.linear_proj.weight", L.o, 1, tp, tp_rank);
    if (L.ob >= 0) w.Replicated(p + "self_attention.linear_proj.bias", L.ob);
    if (L.qn >= 0) {
      w.Replicated(p + "self_attention.q_layernorm.weight", L.qn);
      w.Replicated(p + "self_attention.k_layernorm.weight", L.kn);
    }
  }
  if (!L.moe) {
    w.Replicated(p + "mlp.linear_fc1.layer_norm_weight", L.post_norm);
    w.FusedRows(p + "mlp.linear_fc1.weight", L.gate, L.up, tp, tp_rank);
    if (L.gate_b >= 0) w.FusedRows(p + "mlp.linear_fc1.bias", L.gate_b, L.up_b, tp, tp_rank);
    w.Split(p + "mlp.linear_fc2.weight", L.down, 1, tp, tp_rank);
    if (L.down_b >= 0) w.Replicated(p + "mlp.linear_fc2.bias", L.down_b);
    return;
  }
  w.Replicated(p + "pre_mlp_layernorm.weight", L.post_norm);
  w.Replicated(p + "mlp.router.weight", L.router);
  if (L.router_bias >= 0) w.Replicated(p + "mlp.router.expert_bias", L.router_bias);
  const int etp = EffectiveEtp(par);
  const int etp_rank = expert_local % etp;
  const int ep_rank = (expert_local / etp) % par.ep;
  const int64_t per_ep = c.experts / par.ep;
  if (par.moe_legacy_grouped_gemm) {
    MegatronLegacyGroupedExperts(c, L, p, per_ep, ep_rank, etp, etp_rank, w);
  }
  for (int64_t j = 0; j < per_ep && !par.moe_legacy_grouped_gemm; ++j) {
    const auto& e = L.experts[ep_rank * per_ep + j];
    if (par.moe_grouped_gemm) {  // TEGroupedMLP: one parameter per local expert, suffixed by its index
      w.FusedRows(absl::StrCat(p, "mlp.experts.linear_fc1.weight", j), e[0], e[1], etp, etp_rank);
      w.Split(absl::StrCat(p, "mlp.experts.linear_fc2.weight", j), e[2], 1, etp, etp_rank);
      continue;
    }
    const std::string x = absl::StrCat(p, "mlp.experts.local_experts.", j, ".");
    w.FusedRows(x + "linear_fc1.weight", e[0], e[1], etp, etp_rank);
    w.Split(x + "linear_fc2.weight", e[2], 1, etp, etp_rank);
  }
  if (L.sh_gate >= 0) {
    w.FusedRows(p + "mlp.shared_experts.linear_fc1.weight", L.sh_gate, L.sh_up, tp, tp_rank);
    w.Split(p + "mlp.shared_experts.linear_fc2.weight", L.sh_down, 1, tp, tp_rank);
    if (L.sh_expert_gate >= 0) w.Replicated(p + "mlp.shared_experts.gate_weight", L.sh_expert_gate);
  }
}

absl::StatusOr<PresetLayout> MakeMegatron(const ModelConfig& c, const ParallelConfig& par, const Inventory& inv,
                                          const PresetBuilder::Ids& ids, int rank) {
  const int tp_rank = rank % par.tp;
  // Megatron's default order tp-dp-pp, or tp-pp-dp (--use-tp-pp-dp-mapping).
  const int dp_rank = par.tp_pp_dp_mapping ? rank / (par.tp * par.pp) : (rank / par.tp) % par.dp;
  const int pp_rank = par.tp_pp_dp_mapping ? (rank / par.tp) % par.pp : rank / (par.tp * par.dp);
  // Within one pipeline stage, expert groups order the same tp x dp ranks (with tp-pp-dp, ep*etp = tp
  // keeps that true: CheckMegatron).
  const int expert_local = tp_rank + par.tp * dp_rank;
  ASSIGN_OR_RETURN(auto chunks, MegatronStageLayers(c.layers, par, pp_rank));
  const int64_t vocab_per_rank = CeilDiv(c.vocab, int64_t{par.vocab_divisible_by} * par.tp) * par.vocab_divisible_by;
  Writer w(inv);
  for (size_t v = 0; v < chunks.size(); ++v) {
    // Model chunks of the virtual pipeline: Megatron's checkpoint keys them model0, model1, ...
    const std::string chunk = par.vpp > 1 ? absl::StrCat("model", v, ".") : "";
    const auto [l0, n] = chunks[v];
    if (pp_rank == 0 && v == 0) w.Vocab(chunk + "embedding.word_embeddings.weight", ids.embed, vocab_per_rank, tp_rank);
    for (int64_t i = 0; i < n; ++i) {
      MegatronLayer(c, par, ids.layers[l0 + i], absl::StrCat(chunk, "decoder.layers.", i, "."), tp_rank, expert_local, w);
    }
    if (pp_rank == par.pp - 1 && v + 1 == chunks.size()) {
      w.Replicated(chunk + "decoder.final_layernorm.weight", ids.final_norm);
      if (ids.lm_head >= 0) {
        w.Vocab(chunk + "output_layer.weight", ids.lm_head, vocab_per_rank, tp_rank);
      } else if (par.pp > 1) {
        // Tied embeddings: the last stage keeps its own copy as the output layer.
        w.Vocab(chunk + "output_layer.weight", ids.embed, vocab_per_rank, tp_rank);
      }
    }
  }
  return w.Finish();
}

// ---- vLLM / SGLang ----

// `flat`, `flat_rank`: the engine's dp*tp ranks the MoE layers span, and this rank among them.
void VllmExperts(const ModelConfig& c, const ParallelConfig& par, const LayerIds& L, const std::string& m,
                 int64_t flat, int64_t flat_rank, Writer& w) {
  const int64_t H = c.hidden;
  std::vector<int64_t> ids;
  int64_t parts = flat, idx = flat_rank;
  if (par.expert_parallel) {
    ids = VllmLocalExperts(c.experts, flat, flat_rank, par.expert_placement == "round_robin");
    parts = 1;
    idx = 0;
  } else {
    for (int64_t e = 0; e < c.experts; ++e) ids.push_back(e);
  }
  const int64_t ne = static_cast<int64_t>(ids.size());
  const int64_t n = c.moe_intermediate / parts;
  const auto& first = L.experts[ids.empty() ? 0 : ids[0]];
  w.Begin(m + "experts.w13_weight", {ne, 2 * n, H}, first[0]);
  for (int64_t j = 0; j < ne; ++j) {
    const auto& e = L.experts[ids[j]];
    w.Block(e[0], 0, idx * n, (idx + 1) * n, j * 2 * n * H);
    w.Block(e[1], 0, idx * n, (idx + 1) * n, j * 2 * n * H + n * H);
  }
  w.Begin(m + "experts.w2_weight", {ne, H, n}, first[2]);
  for (int64_t j = 0; j < ne; ++j) {
    w.Block(L.experts[ids[j]][2], 1, idx * n, (idx + 1) * n, j * H * n);
  }
}

// vLLM's GPT-OSS (vllm/model_executor/models/gpt_oss.py, bf16 weights, _load_weights_other):
// HF names mapped `.self_attn.` -> `.attn.` and `embed_tokens` -> `embedding`; qkv_proj/o_proj with
// biases as any vLLM attention; attn.sinks sliced by heads; mlp.router replicated; FusedMoE
// parameters over the dp*tp ranks: w13_weight [E_l, 2*I_l, H] = gate_up_proj[e, :, 2*i0:2*i1]
// transposed (gate/up stay interleaved for the swigluoai activation), w13_bias [E_l, 2*I_l],
// w2_weight [E_l, H, I_l] = down_proj[e, i0:i1, :] transposed, w2_bias [E_l, H] loaded on flat
// rank 0 only without EP (the other ranks keep zeros: no piece). EP: E/ep contiguous experts.
void VllmGptOssLayer(const ModelConfig& c, const ParallelConfig& par, const LayerIds& L, const std::string& p,
                     int tp_rank, int64_t flat, int64_t flat_rank, Writer& w) {
  const int64_t tp = par.tp, H = c.hidden, hd = c.head_dim, nq = c.heads / tp;
  int64_t nkv, kv0;
  if (tp >= c.kv_heads) {
    nkv = 1;
    kv0 = tp_rank / (tp / c.kv_heads);
  } else {
    nkv = c.kv_heads / tp;
    kv0 = tp_rank * nkv;
  }
  const std::string a = p + "attn.";
  w.Replicated(p + "input_layernorm.weight", L.input_norm);
  for (int bias = 0; bias < 2; ++bias) {
    const int32_t q = bias ? L.qb : L.q, k = bias ? L.kb : L.k, v = bias ? L.vb : L.v;
    const int64_t row = bias ? 1 : H;
    std::vector<int64_t> shape = {(nq + 2 * nkv) * hd};
    if (!bias) shape.push_back(H);
    w.Begin(a + (bias ? "qkv_proj.bias" : "qkv_proj.weight"), shape, q);
    w.Block(q, 0, tp_rank * nq * hd, (tp_rank + 1) * nq * hd, 0);
    w.Block(k, 0, kv0 * hd, (kv0 + nkv) * hd, nq * hd * row);
    w.Block(v, 0, kv0 * hd, (kv0 + nkv) * hd, (nq + nkv) * hd * row);
  }
  w.Split(a + "o_proj.weight", L.o, 1, tp, tp_rank);
  w.Replicated(a + "o_proj.bias", L.ob);
  w.Split(a + "sinks", L.sinks, 0, tp, tp_rank);
  w.Replicated(p + "post_attention_layernorm.weight", L.post_norm);
  const std::string m = p + "mlp.";
  w.Replicated(m + "router.weight", L.router);
  w.Replicated(m + "router.bias", L.router_bias);
  const int64_t E = c.experts, I = c.moe_intermediate;
  int64_t e0 = 0, ne = E, i0 = 0, ni = I;
  if (par.expert_parallel) {
    ne = E / flat;
    e0 = flat_rank * ne;
  } else {
    ni = I / flat;
    i0 = flat_rank * ni;
  }
  w.Begin(m + "experts.w13_weight", {ne, 2 * ni, H}, L.gu);
  w.Strided(L.gu, Box{{e0, 0, 2 * i0}, {e0 + ne, H, 2 * (i0 + ni)}}, {2 * ni * H, 1, H}, 0);
  w.Begin(m + "experts.w13_bias", {ne, 2 * ni}, L.gu_b);
  w.Strided(L.gu_b, Box{{e0, 2 * i0}, {e0 + ne, 2 * (i0 + ni)}}, {2 * ni, 1}, 0);
  w.Begin(m + "experts.w2_weight", {ne, H, ni}, L.dn);
  w.Strided(L.dn, Box{{e0, i0, 0}, {e0 + ne, i0 + ni, H}}, {H * ni, 1, ni}, 0);
  w.Begin(m + "experts.w2_bias", {ne, H}, L.dn_b);
  if (par.expert_parallel || flat_rank == 0) w.Block(L.dn_b, 0, e0, e0 + ne, 0);
}

// KV heads of tp rank `tp_rank`: [kv0, kv0 + nkv). With tp > KV heads each KV head is on
// tp / kv_heads consecutive ranks (QKVParallelLinear's num_kv_head_replicas).
std::pair<int64_t, int64_t> VllmKvHeads(const ModelConfig& c, int64_t tp, int tp_rank) {
  if (tp >= c.kv_heads) return {tp_rank / (tp / c.kv_heads), 1};
  const int64_t nkv = c.kv_heads / tp;
  return {tp_rank * nkv, nkv};
}

// Phi-3 (vllm/model_executor/models/phi3.py and SGLang's python/sglang/srt/models/llama.py both
// run it as their Llama): the checkpoint's fused qkv_proj / gate_up_proj match no entry of
// llama.py's stacked_params_mapping, so load_weights hands each to the parameter's weight_loader
// with no shard id, and QKVParallelLinear / MergedColumnParallelLinear split it on disk order
// (q rows [0, H*d), k rows [H*d, (H+KV)*d), v rows [(H+KV)*d, (H+2KV)*d); gate rows [0, I), up
// rows [I, 2I)) and load each shard as for separate tensors. So the local qkv_proj holds three
// boxes of the one canonical qkv_proj (the rank's q heads, its KV heads replicated when
// tp > KV heads) and gate_up_proj two boxes of the canonical gate_up_proj.
void VllmFusedCheckpointLayer(const ModelConfig& c, const ParallelConfig& par, const LayerIds& L,
                              const std::string& p, int tp_rank, Writer& w) {
  const int64_t tp = par.tp, H = c.hidden, hd = c.head_dim, nq = c.heads / tp;
  const auto [kv0, nkv] = VllmKvHeads(c, tp, tp_rank);
  const std::string a = p + "self_attn.";
  const int64_t k_rows = c.heads * hd, v_rows = (c.heads + c.kv_heads) * hd;
  w.Begin(a + "qkv_proj.weight", {(nq + 2 * nkv) * hd, H}, L.qkv);
  w.Block(L.qkv, 0, tp_rank * nq * hd, (tp_rank + 1) * nq * hd, 0);
  w.Block(L.qkv, 0, k_rows + kv0 * hd, k_rows + (kv0 + nkv) * hd, nq * hd * H);
  w.Block(L.qkv, 0, v_rows + kv0 * hd, v_rows + (kv0 + nkv) * hd, (nq + nkv) * hd * H);
  w.Split(a + "o_proj.weight", L.o, 1, tp, tp_rank);
  w.Replicated(p + "post_attention_layernorm.weight", L.post_norm);
  const int64_t I = c.intermediate, n = I / tp;
  w.Begin(p + "mlp.gate_up_proj.weight", {2 * n, H}, L.gate_up);
  w.Block(L.gate_up, 0, tp_rank * n, (tp_rank + 1) * n, 0);
  w.Block(L.gate_up, 0, I + tp_rank * n, I + (tp_rank + 1) * n, n * H);
  w.Split(p + "mlp.down_proj.weight", L.down, 1, tp, tp_rank);
}

PresetLayout MakeVllm(const ModelConfig& c, const ParallelConfig& par, const Inventory& inv,
                      const PresetBuilder::Ids& ids, int rank) {
  const int tp_rank = rank % par.tp;
  const int dp_rank = (rank / par.tp) % par.dp;
  const int64_t tp = par.tp;
  const int64_t H = c.hidden;
  const int64_t vocab_per_rank = CeilDiv(AlignUp(c.vocab, 64), tp);
  // MoE layers span the engine's dp*tp ranks (vLLM FusedMoEParallelConfig.flatten_tp_across_dp).
  const int64_t flat = int64_t{par.dp} * tp, flat_rank = int64_t{dp_rank} * tp + tp_rank;
  // SGLang names the fused q_a + kv_a projection after both halves.
  const std::string fused_qkv_a = par.preset == "sglang" ? "fused_qkv_a_proj_with_mqa.weight" : "fused_qkv_a_proj.weight";
  // SGLang DP attention (deepseek_v2.py): attention and embed_tokens over the attention-TP group
  // (tp ranks), but dense MLPs (DeepseekV2MLP's default tp), shared experts and lm_head
  // (ParallelLMHead without --enable-dp-lm-head) over all tp_size = dp*tp ranks of the engine.
  // --enable-dp-lm-head: lm_head over the attention-TP group too (use_attn_tp_group);
  // --moe-dense-tp-size 1: dense MLPs whole (tp_rank 0, tp_size 1), with or without DP attention.
  const bool dp_attention = SglangDpAttention(par);
  const int64_t mlp_parts = dp_attention ? flat : tp, mlp_rank = dp_attention ? flat_rank : tp_rank;
  const bool dense_whole = SglangDenseMlpsWhole(par);
  const int64_t dense_parts = dense_whole ? 1 : mlp_parts, dense_rank = dense_whole ? 0 : mlp_rank;
  const bool head_over_all = dp_attention && !par.enable_dp_lm_head;
  const int64_t head_per_rank = head_over_all ? CeilDiv(AlignUp(c.vocab, 64), flat) : vocab_per_rank;
  Writer w(inv);
  if (par.preset == "sglang" && c.family == ModelFamily::kGemma3) {
    // SGLang's Gemma 3 (gemma3_causal.py) embeds with Gemma3TextScaledWordEmbedding, a plain
    // nn.Embedding: the whole unpadded [vocab, hidden] on every rank (also its tied head).
    w.Replicated("model.embed_tokens.weight", ids.embed);
  } else {
    w.Vocab(c.fused_experts ? "model.embedding.weight" : "model.embed_tokens.weight", ids.embed, vocab_per_rank, tp_rank);
  }
  for (int64_t l = 0; l < c.layers; ++l) {
    const LayerIds& L = ids.layers[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    if (c.fused_experts) {
      VllmGptOssLayer(c, par, L, p, tp_rank, flat, flat_rank, w);
      continue;
    }
    const std::string a = p + "self_attn.";
    if (L.input_norm >= 0) w.Replicated(p + "input_layernorm.weight", L.input_norm);  // none on OLMo-2/3
    if (L.qkv >= 0) {
      VllmFusedCheckpointLayer(c, par, L, p, tp_rank, w);
      continue;
    }
    if (c.mla) {
      if (L.q_b >= 0) {
        w.Begin(a + fused_qkv_a, {c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim, H}, L.q_a);
        w.Block(L.q_a, -1, 0, 0, 0);
        w.Block(L.kv_a, -1, 0, 0, c.q_lora_rank * H);
        w.Replicated(a + "q_a_layernorm.weight", L.q_a_norm);
        w.Split(a + "q_b_proj.weight", L.q_b, 0, tp, tp_rank);
      } else {
        w.Split(a + "q_proj.weight", L.q_proj, 0, tp, tp_rank);
        w.Replicated(a + "kv_a_proj_with_mqa.weight", L.kv_a);
      }
      w.Replicated(a + "kv_a_layernorm.weight", L.kv_a_norm);
      w.Split(a + "kv_b_proj.weight", L.kv_b, 0, tp, tp_rank);
      w.Split(a + "o_proj.weight", L.o, 1, tp, tp_rank);
      if (L.ix_wq_b >= 0) {
        // DeepSeek-V3.2's indexer is replicated, whole on every rank, in both engines (and with
        // SGLang's DP attention). vLLM (models/deepseek_v2.py, class Indexer): wq_b a
        // ReplicatedLinear; wk and weights_proj fused into one MergedColumnParallelLinear
        // (disable_tp) `wk_weights_proj` = [wk rows; weights_proj rows] (load_weights'
        // indexer_fused_mapping, shards 0 and 1); k_norm a float32 LayerNorm. SGLang
        // (layers/attention/nsa/nsa_indexer.py, class Indexer): wq_b, wk, weights_proj separate
        // ReplicatedLinear under the checkpoint names, k_norm a float32 LayerNorm.
        const std::string x = a + "indexer.";
        w.Replicated(x + "wq_b.weight", L.ix_wq_b);
        if (par.preset == "sglang") {
          w.Replicated(x + "wk.weight", L.ix_wk);
          w.Replicated(x + "weights_proj.weight", L.ix_wp);
        } else {
          w.Begin(x + "wk_weights_proj.weight", {c.index_head_dim + c.index_n_heads, H}, L.ix_wk);
          w.Block(L.ix_wk, -1, 0, 0, 0);
          w.Block(L.ix_wp, -1, 0, 0, c.index_head_dim * H);
        }
        w.Replicated(x + "k_norm.weight", L.ix_kn);
        w.Replicated(x + "k_norm.bias", L.ix_kn_b);
      }
    } else {
      const int64_t hd = c.head_dim, nq = c.heads / tp;
      int64_t nkv, kv0;
      if (tp >= c.kv_heads) {
        nkv = 1;
        kv0 = tp_rank / (tp / c.kv_heads);
      } else {
        nkv = c.kv_heads / tp;
        kv0 = tp_rank * nkv;
      }
      for (int bias = 0; bias < (L.qb >= 0 ? 2 : 1); ++bias) {
        const int32_t q = bias ? L.qb : L.q, k = bias ? L.kb : L.k, v = bias ? L.vb : L.v;
        const int64_t row = bias ? 1 : H;
        std::vector<int64_t> shape = {(nq + 2 * nkv) * hd};
        if (!bias) shape.push_back(H);
        w.Begin(a + (bias ? "qkv_proj.bias" : "qkv_proj.weight"), shape, q);
        w.Block(q, 0, tp_rank * nq * hd, (tp_rank + 1) * nq * hd, 0);
        w.Block(k, 0, kv0 * hd, (kv0 + nkv) * hd, nq * hd * row);
        w.Block(v, 0, kv0 * hd, (kv0 + nkv) * hd, (nq + nkv) * hd * row);
      }
      w.Split(a + "o_proj.weight", L.o, 1, tp, tp_rank);
      if (L.ob >= 0) w.Replicated(a + "o_proj.bias", L.ob);
      if (L.qn >= 0 && c.family == ModelFamily::kMiniMaxM2) {
        // MiniMax-M2's full-width q_norm / k_norm are TP-sharded like the projections they
        // normalise (the variance is all-reduced). vLLM (models/minimax_m2.py,
        // MiniMaxText01RMSNormTP in layers/mamba/linear_attn.py): weight [size / tp], its
        // weight_loader copies rows [tp_rank * size/tp, +size/tp) - CheckVllm refuses tp > KV
        // heads, where that would not be the rank's k head. SGLang (models/minimax_m2.py,
        // MiniMaxM2RMSNormTP): by heads as QKVParallelLinear, num_heads / tp heads of q; k's
        // kv0..kv0+nkv (with tp > KV heads the rank's replicated head, shard tp_rank / replicas).
        w.Split(a + "q_norm.weight", L.qn, 0, tp, tp_rank);
        w.Begin(a + "k_norm.weight", {nkv * hd}, L.kn);
        w.Block(L.kn, 0, kv0 * hd, (kv0 + nkv) * hd, 0);
      } else if (L.qn >= 0) {
        w.Replicated(a + "q_norm.weight", L.qn);
        w.Replicated(a + "k_norm.weight", L.kn);
      }
    }
    w.Replicated(p + "post_attention_layernorm.weight", L.post_norm);
    if (L.pre_ff >= 0) w.Replicated(p + "pre_feedforward_layernorm.weight", L.pre_ff);
    if (!L.moe) {
      w.FusedRows(p + "mlp.gate_up_proj.weight", L.gate, L.up, dense_parts, dense_rank);
      if (L.gate_b >= 0) w.FusedRows(p + "mlp.gate_up_proj.bias", L.gate_b, L.up_b, dense_parts, dense_rank);
      w.Split(p + "mlp.down_proj.weight", L.down, 1, dense_parts, dense_rank);
      // RowParallelLinear keeps the whole bias on every rank (added once, after the reduce).
      if (L.down_b >= 0) w.Replicated(p + "mlp.down_proj.bias", L.down_b);
      if (L.post_ff >= 0) w.Replicated(p + "post_feedforward_layernorm.weight", L.post_ff);
      continue;
    }
    const bool minimax = c.family == ModelFamily::kMiniMaxM2;
    const std::string m = p + (c.family == ModelFamily::kMixtral || minimax ? "block_sparse_moe." : "mlp.");
    w.Replicated(m + "gate.weight", L.router);
    // MiniMaxM2MoE (both engines) holds the bias on the MoE block: block_sparse_moe.e_score_correction_bias.
    if (L.router_bias >= 0) w.Replicated(m + (minimax ? "e_score_correction_bias" : "gate.e_score_correction_bias"), L.router_bias);
    VllmExperts(c, par, L, m, flat, flat_rank, w);
    if (L.sh_gate >= 0) {
      const std::string s = m + (c.family == ModelFamily::kQwen2Moe ? "shared_expert." : "shared_experts.");
      const bool whole = SharedExpertsWhole(c, par);
      w.FusedRows(s + "gate_up_proj.weight", L.sh_gate, L.sh_up, whole ? 1 : mlp_parts, whole ? 0 : mlp_rank);
      w.Split(s + "down_proj.weight", L.sh_down, 1, whole ? 1 : mlp_parts, whole ? 0 : mlp_rank);
      if (L.sh_expert_gate >= 0) w.Replicated(m + "shared_expert_gate.weight", L.sh_expert_gate);
    }
  }
  w.Replicated("model.norm.weight", ids.final_norm);
  if (ids.lm_head >= 0) w.Vocab("lm_head.weight", ids.lm_head, head_per_rank, head_over_all ? flat_rank : tp_rank);
  return w.Finish();
}

// ---- FSDP ----

// FSDP2 (torch.distributed.fsdp.fully_shard), as torch/distributed/fsdp/_fully_shard/_fsdp_param.py
// FSDPParam._init_sharded_param does it: chunks = _chunk_with_empty(param, shard_world_size, dim=0)
// (torch.chunk: ceil(d0 / world) rows per chunk, so trailing ranks may get fewer rows or none,
// then empty chunks appended up to the world size); the rank keeps chunks[shard_rank] at the
// start of a zero-padded buffer of chunks[0]'s size (padded_sharded_param_size), and its local
// parameter is the unpadded narrow [rows, ...] of it. HSDP (replicas > 1): mesh (replicate,
// shard), rank = replica * dp + shard_rank, each replica holding the same shards.
PresetLayout MakeFsdp2(const ParallelConfig& par, const Inventory& inv, int rank) {
  const int shard_rank = rank % par.dp;
  Writer w(inv);
  for (size_t t = 0; t < inv.tensors.size(); ++t) {
    const std::vector<int64_t>& shape = inv.tensors[t].shape;
    const int64_t d0 = shape[0];
    const int64_t chunk = CeilDiv(d0, par.dp);
    const int64_t lo = std::min(d0, shard_rank * chunk), hi = std::min(d0, lo + chunk);
    std::vector<int64_t> local = shape;
    local[0] = hi - lo;
    std::vector<int64_t> padded = shape;
    padded[0] = chunk;
    w.Begin(inv.tensors[t].name, std::move(local), static_cast<int32_t>(t), Numel(padded));
    w.Block(static_cast<int32_t>(t), 0, lo, hi, 0);
  }
  return w.Finish();
}

// [lo, hi) of part `idx` of a dim of `n` split `parts` ways with torch.chunk semantics: ceil(n / parts)
// per part, the last non-empty part shorter, the parts past the end empty (torch.chunk returns
// fewer chunks; DTensor's Shard._split_tensor and FSDP2's _chunk_with_empty append empty ones).
std::pair<int64_t, int64_t> TorchChunk(int64_t n, int64_t parts, int64_t idx) {
  const int64_t c = CeilDiv(n, parts);
  const int64_t lo = std::min(n, idx * c);
  return {lo, std::min(n, lo + c)};
}

// The tensor dim torch's tensor-parallel styles shard a canonical tensor on in the fsdp2_tp plan
// (NeMo-RL nemo_rl/models/dtensor/parallelize.py _parallelize_llama / _parallelize_qwen /
// _parallelize_gemma3 and get_hf_tp_plan; torchtitan's llama3 apply_tp), -1 when replicated:
// ColwiseParallel on nn.Linear (q/k/v, gate/up, lm_head) shards weight and bias Shard(0);
// RowwiseParallel on nn.Linear (o_proj, down_proj) shards the weight Shard(1) and replicates the
// bias; RowwiseParallel on nn.Embedding (embed_tokens) shards the weight Shard(0)
// (torch/distributed/tensor/parallel/style.py _partition_linear_fn / _partition_embedding_fn).
// Norms (SequenceParallel or not parallelized) are whole on every TP rank.
int TpShardDim(const std::string& name) {
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return 0;
  for (const char* m : {".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", ".mlp.gate_proj.", ".mlp.up_proj."}) {
    if (absl::StrContains(name, m)) return 0;
  }
  for (const char* m : {".self_attn.o_proj.weight", ".mlp.down_proj.weight"}) {
    if (absl::EndsWith(name, m)) return 1;
  }
  return -1;
}

// FSDP2 + TP (2-D DeviceMesh): world = replicas * dp * tp, tp fastest (NeMo-RL's (dp, cp, tp) mesh,
// torchtitan's / NeMo Automodel's (pp, dp_replicate, dp_shard, cp, tp)): rank = (replica * dp +
// shard_rank) * tp + tp_rank. parallelize_module gives each TP rank its torch.chunk part of the
// TP-sharded dim (DTensor Shard._split_tensor, unpadded local tensor); fully_shard then takes
// param._local_tensor (FSDPParam._init_sharding_spec_tp) and shards it exactly like a plain
// parameter (_init_sharded_param: _chunk_with_empty over dp on dim 0, the rank's chunk at the start
// of a buffer of chunk 0's size): a TP Shard(0) tensor's rows are chunked twice (TP, then dp within
// the TP part: _StridedShard(0, split_factor=tp) records it), a Shard(1) tensor's TP columns are
// chunked by rows over dp. Each rank's local tensor is one box of the canonical tensor.
PresetLayout MakeFsdp2Tp(const ParallelConfig& par, const Inventory& inv, int rank) {
  const int64_t tp_rank = rank % par.tp;
  const int64_t shard_rank = (rank / par.tp) % par.dp;
  Writer w(inv);
  for (size_t t = 0; t < inv.tensors.size(); ++t) {
    const std::vector<int64_t>& shape = inv.tensors[t].shape;
    Box box;
    box.begin.assign(shape.size(), 0);
    box.end = shape;
    const int tp_dim = TpShardDim(inv.tensors[t].name);
    if (tp_dim >= 0) std::tie(box.begin[tp_dim], box.end[tp_dim]) = TorchChunk(shape[tp_dim], par.tp, tp_rank);
    // FSDP2 on the TP-local tensor: rows chunked over dp, chunk 0's size reserved on every rank.
    const int64_t tp_rows = box.end[0] - box.begin[0];
    const auto [lo, hi] = TorchChunk(tp_rows, par.dp, shard_rank);
    const int64_t first = box.begin[0];
    box.begin[0] = first + lo;
    box.end[0] = first + hi;
    std::vector<int64_t> local(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) local[d] = box.end[d] - box.begin[d];
    std::vector<int64_t> padded = local;
    padded[0] = CeilDiv(tp_rows, par.dp);
    const int64_t numel = Numel(local);
    std::vector<int64_t> strides = ContiguousStrides(local);
    w.Begin(inv.tensors[t].name, std::move(local), static_cast<int32_t>(t), Numel(padded));
    if (numel > 0) w.Strided(static_cast<int32_t>(t), std::move(box), std::move(strides), 0);
  }
  return w.Finish();
}

// fsdp_flat: every tensor flattened and split into dp contiguous 1-D ranges of ceil(n / dp)
// elements (not what any torch FSDP version does; kept for specs written against it).
PresetLayout MakeFsdpFlat(const ParallelConfig& par, const Inventory& inv, int rank) {
  Writer w(inv);
  for (size_t t = 0; t < inv.tensors.size(); ++t) {
    const int64_t n = Numel(inv.tensors[t].shape);
    const int64_t chunk = CeilDiv(n, par.dp);
    const int64_t lo = std::min(n, rank * chunk), hi = std::min(n, lo + chunk);
    if (lo >= hi) continue;
    w.Begin(inv.tensors[t].name, {hi - lo}, static_cast<int32_t>(t));
    w.Flat(static_cast<int32_t>(t), lo, hi);
  }
  return w.Finish();
}

}  // namespace

absl::StatusOr<int> PresetWorldSize(const ParallelConfig& p) {
  ASSIGN_OR_RETURN(Kind kind, KindOf(p.preset));
  if (p.tp < 1 || p.pp < 1 || p.dp < 1 || p.ep < 1 || p.etp < 0 || p.replicas < 1 || p.vpp < 1 ||
      p.first_stage_layers < 0 || p.last_stage_layers < 0) {
    return absl::InvalidArgumentError(absl::StrCat(p.preset, ": tp, pp, dp, ep, replicas must be >= 1 (got tp=",
                                                   p.tp, " pp=", p.pp, " dp=", p.dp, " ep=", p.ep,
                                                   " etp=", p.etp, " replicas=", p.replicas, " vpp=", p.vpp, ")"));
  }
  // In int64: the sizes come from a worker's request; a product over the bound is refused, never
  // overflowed.
  int64_t world = 0;
  switch (kind) {
    case Kind::kMegatron:
      world = int64_t{p.tp} * p.pp * p.dp;
      break;
    case Kind::kFsdp2:
      world = int64_t{p.dp} * p.replicas;
      break;
    case Kind::kFsdp2Tp:
      world = int64_t{p.tp} * p.dp * p.replicas;
      break;
    case Kind::kFsdpFlat:
      world = p.dp;
      break;
    case Kind::kVllm:
      world = int64_t{p.tp} * p.dp * p.replicas;
      break;
  }
  if (world > kMaxPresetWorld) {
    return absl::InvalidArgumentError(absl::StrCat(p.preset, ": world size ", world, " (tp=", p.tp, " pp=", p.pp, " dp=", p.dp,
                                                   " replicas=", p.replicas, ") exceeds the limit of ", kMaxPresetWorld));
  }
  return static_cast<int>(world);
}

namespace {

// Linear weights a block-quantised checkpoint holds quantised (see ParallelConfig::quantization):
// every 2-D ".weight" with "proj" or ".experts." in its name; `experts_only`: routed experts only
// (Kimi-K2-Thinking's INT4: attention, shared experts and dense MLPs stay bf16).
bool QuantizableTensor(const TensorSpec& t, bool experts_only) {
  const std::string& n = t.name;
  if (t.shape.size() != 2 || !absl::EndsWith(n, ".weight")) return false;
  if (experts_only) return n.find(".experts.") != std::string::npos && n.find("shared_expert") == std::string::npos;
  return n.find("proj") != std::string::npos || n.find(".experts.") != std::string::npos;
}

// Blocks of `block` covering `box` (ceil per dim); 0 when the ranks differ (the caller refuses those).
int64_t BlocksOf(const Box& box, const std::vector<int64_t>& block) {
  if (box.begin.size() != block.size()) return 0;
  int64_t n = 1;
  for (size_t d = 0; d < block.size(); ++d) n *= (box.end[d] - box.begin[d] + block[d] - 1) / block[d];
  return n;
}

// Re-packs `out` (one buffer) with quantisable local tensors quantised + their scales.
absl::Status QuantizePreset(const Inventory& inv, const std::string& scheme, bool sglang, PresetLayout& out) {
  // fp8_block128: float8_e4m3, 128x128 blocks, float32 scale_inv (DeepSeek-V3); mxfp8: float8_e4m3,
  // 1x32 blocks along the input dim, e8m0 scales (OCP MX, vLLM's "weight_scale" uint8);
  // w4a16_g32 / w4a16_experts_g32: int4, 1x32 groups, scales in the tensor's dtype
  // (compressed-tensors pack-quantized; "<name>_packed" holds the int4 pairs).
  // nvfp4: float4_e2m1 (ModelOpt NVFP4 as vLLM loads it), 1x16 blocks, float8_e4m3 scales in
  // "<name>_scale", then the float32 global scale all the local tensor's pieces share in
  // "<name>_scale_2" (one per local tensor: vLLM's fused qkv_proj keeps one after loading; fused
  // MoE experts one per local expert, shared by its gate and up as vLLM keeps w13's).
  // SGLang holds MXFP8 block scales as fp8 block ones, under "<name>_scale_inv" (its
  // Fp8LinearMethod with use_mxfp8: uint8, [rows, cols/32]; MoE "w13_weight_scale_inv").
  const bool mx = scheme == "mxfp8";
  const bool nvfp4 = scheme == "nvfp4";
  const bool int4 = scheme == "w4a16_g32" || scheme == "w4a16_experts_g32";
  const bool experts_only = scheme == "w4a16_experts_g32";
  const std::vector<int64_t> block = nvfp4 ? std::vector<int64_t>{1, 16}
                                     : mx || int4 ? std::vector<int64_t>{1, 32}
                                                  : std::vector<int64_t>{128, 128};
  const DType elem_dtype = int4 ? DType::kI4 : nvfp4 ? DType::kF4E2M1 : DType::kF8E4M3;
  PresetLayout q;
  q.layout.buffers = out.layout.buffers;
  q.layout.pieces = out.layout.pieces;
  int64_t cursor = 0;
  for (const LocalTensor& lt : out.local_tensors) {
    bool quantize = lt.num_pieces > 0;
    for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) {
      quantize = quantize && QuantizableTensor(inv.tensors[out.layout.pieces[k].tensor], experts_only);
    }
    const DType scale_dtype = mx ? DType::kE8M0 : int4 ? lt.dtype : nvfp4 ? DType::kF8E4M3 : DType::kF32;
    const int scale_size = DTypeSize(scale_dtype);
    const int old_bits = DTypeBits(lt.dtype);
    const int new_bits = quantize ? DTypeBits(elem_dtype) : old_bits;
    LocalTensor nt = lt;
    nt.offset_bytes = AlignUp(cursor, kLocalTensorAlignment);
    if (quantize) nt.dtype = elem_dtype;
    if (quantize && int4) {  // compressed-tensors: the packed pairs are "<weight>_packed"
      nt.name = absl::StrCat(lt.name, "_packed");
    }
    // NVFP4: the slot of each piece's global scale - 0, or for fused MoE experts ([E, rows, cols]
    // local tensors) the piece's expert, so that each expert's gate and up (w13) share one.
    std::vector<int64_t> global_slot(static_cast<size_t>(std::max(lt.num_pieces, 0)), 0);
    const int64_t expert_elems = lt.shape.size() == 3 ? lt.shape[1] * lt.shape[2] : 0;
    for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) {
      Piece& p = q.layout.pieces[k];
      const int64_t elems = (out.layout.pieces[k].offset_bytes - lt.offset_bytes) * 8 / old_bits;
      if (expert_elems > 0) global_slot[static_cast<size_t>(k - lt.first_piece)] = elems / expert_elems;
      if (elems * new_bits % 8 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(scheme, ": local tensor ", lt.name, " holds a piece of ", inv.tensors[p.tensor].name,
                                                       " at element ", elems, ", not on a byte boundary once packed"));
      }
      p.offset_bytes = nt.offset_bytes + elems * new_bits / 8;
    }
    cursor = nt.offset_bytes + (Numel(lt.shape) * new_bits + 7) / 8;
    q.local_tensors.push_back(nt);
    if (!quantize) continue;
    LocalTensor st;
    st.name = lt.name;
    const char* suffix = (mx && !sglang) || int4 || nvfp4 ? "_scale" : "_scale_inv";
    // "x.weight" -> "x.weight_scale"; vLLM's fused expert "experts.w13_weight" -> "experts.w13_weight_scale".
    st.name += absl::EndsWith(st.name, "weight") ? suffix : absl::StrCat(".weight", suffix);
    st.dtype = scale_dtype;
    st.offset_bytes = AlignUp(cursor, kLocalTensorAlignment);
    st.first_piece = lt.first_piece;
    st.num_pieces = 0;
    int64_t count = 0, row_blocks = 0, col_blocks = -1;
    // Row slabs of one grid width: [row blocks, column blocks]; for fused MoE experts ([E, rows,
    // cols]) expert by expert, the same blocks each: [E, row blocks per expert, column blocks], as
    // vLLM's w13_weight_scale_inv / w13_weight_scale are shaped (the bytes are the same either way).
    bool slabs = lt.shape.size() == 2 || lt.shape.size() == 3;
    std::vector<int64_t> expert_row_blocks(lt.shape.size() == 3 ? static_cast<size_t>(lt.shape[0]) : 0, 0);
    int64_t last_expert = 0;
    // NVFP4's global scale goes after the block scales; its place is known once they are counted,
    // so the pieces get it below (CheckQuantization runs on a stand-in until then).
    int64_t global_at = -1;
    if (nvfp4) {
      int64_t n = 0;
      for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) n += BlocksOf(q.layout.pieces[k].box, block);
      global_at = AlignUp(st.offset_bytes + n * scale_size, kLocalTensorAlignment);
    }
    for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) {
      Piece& p = q.layout.pieces[k];
      Quantization quant;
      if (p.box.begin.size() != block.size()) {
        return absl::InvalidArgumentError(absl::StrCat(scheme, ": local tensor ", lt.name, " holds a ", p.box.begin.size(),
                                                       "-D piece of ", inv.tensors[p.tensor].name, " (2-D only)"));
      }
      quant.dtype = elem_dtype;
      quant.block = block;
      quant.scale_dtype = scale_dtype;
      quant.scale_buffer = 0;
      quant.scale_offset_bytes = st.offset_bytes + count * scale_size;
      quant.global_scale_offset_bytes = global_at < 0 ? -1 : global_at + 4 * global_slot[static_cast<size_t>(k - lt.first_piece)];
      p.quant = quant;
      RETURN_IF_ERROR(CheckQuantization(inv, WorkerLayout{{BufferInfo{int64_t{1} << 62}}, {}}, p,
                                        absl::StrCat(scheme, ": local tensor ", lt.name, " (tensor ", inv.tensors[p.tensor].name,
                                                     " box ", BoxToString(p.box), ")")));
      const std::vector<int64_t> grid = ScaleShape(p);
      count += ScaleCount(p);
      if (grid.size() == 2 && (col_blocks < 0 || col_blocks == grid[1])) {
        row_blocks += grid[0];
        col_blocks = grid[1];
      } else {
        slabs = false;
      }
      if (!expert_row_blocks.empty() && slabs) {
        const int64_t e = global_slot[static_cast<size_t>(k - lt.first_piece)];
        slabs = e >= last_expert && e < static_cast<int64_t>(expert_row_blocks.size());  // experts in order
        if (slabs) expert_row_blocks[static_cast<size_t>(e)] += grid[0];
        last_expert = e;
      }
    }
    for (int64_t n : expert_row_blocks) slabs = slabs && n == expert_row_blocks[0];
    if (!slabs) {
      st.shape = {count};
    } else if (!expert_row_blocks.empty()) {
      st.shape = {lt.shape[0], expert_row_blocks[0], col_blocks};
    } else {
      st.shape = {row_blocks, col_blocks};
    }
    cursor = st.offset_bytes + count * scale_size;
    const std::string scale_name = st.name;
    q.local_tensors.push_back(std::move(st));
    if (nvfp4) {
      LocalTensor gt;  // "x.weight_scale" -> "x.weight_scale_2" (ModelOpt)
      gt.name = absl::StrCat(scale_name, "_2");
      gt.dtype = DType::kF32;
      gt.shape = {expert_elems > 0 ? lt.shape[0] : 1};  // one per local expert, else one
      gt.offset_bytes = global_at;
      gt.first_piece = lt.first_piece;
      gt.num_pieces = 0;
      cursor = global_at + 4 * gt.shape[0];
      q.local_tensors.push_back(std::move(gt));
    }
  }
  q.layout.buffers = {BufferInfo{AlignUp(cursor, kLocalTensorAlignment)}};
  out = std::move(q);
  return absl::OkStatus();
}

}  // namespace

// fsdp2_tp describes the dense families whose tensor-parallel plan is verified (NeMo-RL's
// PARALLIZE_FUNCTIONS: Llama, Qwen2, Qwen3, Gemma3ForCausalLM; Mistral through get_hf_tp_plan,
// its base_model_tp_plan being Llama's); anything else is refused naming the architecture, and tp
// not dividing the heads as NeMo-RL's _parallelize_model asserts.
absl::Status CheckFsdp2Tp(const ModelConfig& config, const ParallelConfig& par) {
  const std::string& a = config.architecture;
  if (a != "LlamaForCausalLM" && a != "MistralForCausalLM" && a != "Qwen2ForCausalLM" && a != "Qwen3ForCausalLM" &&
      a != "Gemma3ForCausalLM") {
    return absl::InvalidArgumentError(absl::StrCat(
        par.preset, ": no preset layout for ", a,
        " (its FSDP2 + TP plan is not verified; described: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Gemma3ForCausalLM); use fsdp with tp=1, explicit pieces or an index-probe layout"));
  }
  // nemo_rl/models/dtensor/parallelize.py _parallelize_model: both asserts when tp > 1.
  if (config.kv_heads % par.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(par.preset, ": tp=", par.tp, " must divide num_key_value_heads=", config.kv_heads));
  }
  if (config.heads % par.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(par.preset, ": tp=", par.tp, " must divide num_attention_heads=", config.heads));
  }
  return absl::OkStatus();
}

// A size or option the preset's framework has no counterpart for is refused, naming it, rather
// than ignored (the world and every rank's pieces would silently describe something else).
absl::Status CheckFieldsApply(Kind kind, const ParallelConfig& p) {
  std::vector<std::string> unused;
  const bool fsdp = kind == Kind::kFsdp2 || kind == Kind::kFsdp2Tp || kind == Kind::kFsdpFlat;
  if (fsdp && kind != Kind::kFsdp2Tp && p.tp != 1) unused.push_back(absl::StrCat("tp=", p.tp));
  if ((fsdp || kind == Kind::kVllm) && p.pp != 1) unused.push_back(absl::StrCat("pp=", p.pp));
  if ((fsdp || kind == Kind::kVllm) && p.ep != 1) unused.push_back(absl::StrCat("ep=", p.ep));
  if ((fsdp || kind == Kind::kVllm) && p.etp != 0) unused.push_back(absl::StrCat("etp=", p.etp));
  if (kind != Kind::kVllm && p.expert_parallel) unused.push_back("expert_parallel");
  if (kind != Kind::kVllm && !p.moe_a2a_backend.empty()) unused.push_back("moe_a2a_backend");
  if (kind != Kind::kVllm && p.enable_dp_lm_head) unused.push_back("enable_dp_lm_head");
  if (kind != Kind::kVllm && p.moe_dense_tp_size != 0) unused.push_back(absl::StrCat("moe_dense_tp_size=", p.moe_dense_tp_size));
  if ((kind == Kind::kMegatron || kind == Kind::kFsdpFlat) && p.replicas != 1) unused.push_back(absl::StrCat("replicas=", p.replicas));
  if (unused.empty()) return absl::OkStatus();
  const char* why = kind == Kind::kVllm ? " (engine pipeline parallelism is not described; experts follow dp*tp and expert_parallel)"
                    : kind == Kind::kMegatron ? " (Megatron's data parallelism is dp and its expert parallelism ep)"
                    : kind == Kind::kFsdp2Tp ? " (FSDP2 + TP combined with pipeline or expert parallelism is not described)"
                                              : " (FSDP2 with tensor parallelism is the fsdp2_tp preset; with pipeline or expert parallelism it is not described)";
  return absl::InvalidArgumentError(absl::StrCat(p.preset, ": ", absl::StrJoin(unused, ", "), " does not apply", why));
}

absl::StatusOr<PresetBuilder> PresetBuilder::Create(const ModelConfig& config, const Inventory& inventory,
                                                    const ParallelConfig& parallel) {
  ASSIGN_OR_RETURN(Kind kind, KindOf(parallel.preset));
  if (!KnownQuantization(parallel.quantization)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown quantization `", parallel.quantization, "` (expected fp8_block128, mxfp8, nvfp4, w4a16_g32, w4a16_experts_g32 or none)"));
  }
  if (kind != Kind::kMegatron && (parallel.vocab_divisible_by != 128 || parallel.moe_grouped_gemm ||
                                  parallel.moe_legacy_grouped_gemm || parallel.tp_pp_dp_mapping)) {
    return absl::InvalidArgumentError(absl::StrCat(parallel.preset, ": make_vocab_size_divisible_by, moe_grouped_gemm, moe_use_legacy_grouped_gemm and "
                                                   "use_tp_pp_dp_mapping are megatron options"));
  }
  if (!parallel.quantization.empty() && kind != Kind::kVllm) {
    return absl::InvalidArgumentError(absl::StrCat("quantization `", parallel.quantization, "` is for rollout presets (vllm, sglang), not ",
                                                   parallel.preset));
  }
  RETURN_IF_ERROR(CheckFieldsApply(kind, parallel));
  PresetBuilder b;
  ASSIGN_OR_RETURN(b.world_, PresetWorldSize(parallel));
  b.config_ = config;
  b.parallel_ = parallel;
  b.inventory_ = &inventory;
  if ((kind == Kind::kFsdp2 || kind == Kind::kFsdp2Tp || kind == Kind::kFsdpFlat) &&
      (parallel.first_stage_layers != 0 || parallel.last_stage_layers != 0 || parallel.vpp != 1 || !parallel.expert_placement.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(parallel.preset, ": first_stage_layers, last_stage_layers, vpp and expert_placement do not apply"));
  }
  if (kind == Kind::kFsdp2) {
    for (const TensorSpec& t : inventory.tensors) {
      if (t.shape.empty()) return absl::InvalidArgumentError(absl::StrCat(parallel.preset, ": tensor ", t.name, " is 0-D (FSDP2 shards dim 0)"));
    }
    return b;
  }
  if (kind == Kind::kFsdpFlat) return b;
  if (kind == Kind::kFsdp2Tp) {
    RETURN_IF_ERROR(CheckFsdp2Tp(config, parallel));
    return b;
  }
  if (config.fused_experts && parallel.preset != "vllm") {
    // GPT-OSS: only vLLM's bf16 layout is modelled (MakeVllmGptOss); SGLang's and Megatron's
    // (a bridge) are not, so refuse rather than guess.
    return absl::InvalidArgumentError(absl::StrCat(parallel.preset, ": no preset layout for ", config.architecture,
                                                   " (use vllm, fsdp, explicit pieces or an index-probe layout)"));
  }
  if (kind == Kind::kMegatron && (config.post_norms || config.fused_proj)) {
    // OLMo-2/3: Megatron-Core's GPT layer has pre-norms and per-head qk layernorms only; the
    // Megatron-Bridge OLMo-2 bridge builds a custom post-norm layer spec whose TP layout (its
    // full-width q/k layernorms in particular) is not verified here. Phi-3: no Megatron-Bridge
    // mapping of the fused qkv_proj / gate_up_proj verified (the stored Phi3 bridges disagree).
    return absl::InvalidArgumentError(absl::StrCat("megatron: no preset layout for ", config.architecture,
                                                   config.post_norms ? " (OLMo-2/3's post-norm layer and full-width q/k norms have no verified Megatron-Core layout)"
                                                                     : " (no verified Megatron-Core mapping of its fused qkv_proj / gate_up_proj)",
                                                   "; use fsdp, fsdp_flat, explicit pieces or an index-probe layout"));
  }
  if (kind == Kind::kMegatron && config.family == ModelFamily::kMiniMaxM2) {
    // MiniMax-M2: no Megatron-Core / Megatron-Bridge mapping of its full-width q/k norms verified.
    return absl::InvalidArgumentError(absl::StrCat("megatron: no preset layout for ", config.architecture,
                                                   " (no verified Megatron-Core mapping of its full-width q_norm / k_norm); use fsdp, fsdp_flat, explicit pieces or an index-probe layout"));
  }
  if (kind == Kind::kMegatron && config.dsa_indexer) {
    // DeepSeek-V3.2: no Megatron-Core / Megatron-Bridge mapping of the DSA indexer verified.
    return absl::InvalidArgumentError(absl::StrCat("megatron: no preset layout for ", config.architecture,
                                                   " (no verified Megatron-Core mapping of its DSA indexer); use fsdp, fsdp_flat, explicit pieces or an index-probe layout"));
  }
  if (kind == Kind::kVllm && config.dsa_indexer && !parallel.quantization.empty()) {
    // vLLM quantises wq_b but keeps wk_weights_proj in bf16 (FP8 wk dequantised at load): not modelled.
    return absl::InvalidArgumentError(absl::StrCat(parallel.preset, ": quantization on ", config.architecture,
                                                   " is not described (its indexer's tensors are quantised differently per engine)"));
  }
  if (kind == Kind::kMegatron && config.ffn_norms) {
    return absl::InvalidArgumentError(absl::StrCat("megatron: no preset layout for ", config.architecture,
                                                   " (Megatron-Core's GPT layer has no pre/post feed-forward norms)"));
  }
  if (kind == Kind::kMegatron) {
    RETURN_IF_ERROR(CheckMegatron(config, parallel));
  } else {
    RETURN_IF_ERROR(CheckVllm(config, parallel));
  }
  ASSIGN_OR_RETURN(b.ids_, ResolveIds(config, inventory));
  return b;
}

absl::StatusOr<PresetLayout> PresetBuilder::Make(int rank) const {
  if (rank < 0 || rank >= world_) {
    return absl::InvalidArgumentError(
        absl::StrCat(parallel_.preset, ": rank ", rank, " outside world of ", world_));
  }
  ASSIGN_OR_RETURN(Kind kind, KindOf(parallel_.preset));
  switch (kind) {
    case Kind::kMegatron:
      return MakeMegatron(config_, parallel_, *inventory_, *ids_, rank);
    case Kind::kFsdp2:
      return MakeFsdp2(parallel_, *inventory_, rank);
    case Kind::kFsdp2Tp:
      return MakeFsdp2Tp(parallel_, *inventory_, rank);
    case Kind::kFsdpFlat:
      return MakeFsdpFlat(parallel_, *inventory_, rank);
    case Kind::kVllm: {
      PresetLayout l = MakeVllm(config_, parallel_, *inventory_, *ids_, rank);
      if (!parallel_.quantization.empty()) RETURN_IF_ERROR(QuantizePreset(*inventory_, parallel_.quantization, parallel_.preset == "sglang", l));
      return l;
    }
  }
  return absl::InternalError("unreachable");
}

bool KnownQuantization(const std::string& scheme) {
  return scheme.empty() || scheme == "fp8_block128" || scheme == "mxfp8" || scheme == "nvfp4" || scheme == "w4a16_g32" ||
         scheme == "w4a16_experts_g32";
}

std::vector<int64_t> VllmLocalExperts(int64_t experts, int64_t ep_size, int64_t ep_rank, bool round_robin) {
  // vllm/model_executor/layers/fused_moe/layer.py determine_expert_map.
  const int64_t base = experts / ep_size, rem = experts % ep_size;
  const int64_t local = base + (ep_rank < rem ? 1 : 0);
  std::vector<int64_t> ids;
  ids.reserve(local);
  const int64_t start = ep_rank * base + std::min(ep_rank, rem);
  for (int64_t j = 0; j < local; ++j) ids.push_back(round_robin ? ep_rank + j * ep_size : start + j);
  return ids;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> MegatronStageLayers(int64_t layers, const ParallelConfig& par,
                                                                             int pp_rank) {
  const int64_t pp = par.pp, vpp = par.vpp;
  if (pp < 1 || vpp < 1 || pp_rank < 0 || pp_rank >= pp) {
    return absl::InvalidArgumentError(absl::StrCat("megatron: pp=", pp, " vpp=", vpp, " pp_rank=", pp_rank));
  }
  const bool first = par.first_stage_layers > 0, last = par.last_stage_layers > 0;
  if ((vpp > 1 || first || last) && pp == 1) {
    return absl::InvalidArgumentError("megatron: vpp, first_stage_layers and last_stage_layers need pp > 1");
  }
  // Layers per stage (Megatron-Core get_num_layers_to_build).
  std::vector<int64_t> n(pp);
  if (first || last) {
    const int64_t middle_stages = pp - (first ? 1 : 0) - (last ? 1 : 0);
    const int64_t middle = layers - par.first_stage_layers - par.last_stage_layers;
    if (middle < 0 || (middle_stages == 0 ? middle != 0 : middle % middle_stages != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "megatron: num_hidden_layers=", layers, " minus first_stage_layers=", par.first_stage_layers,
          " and last_stage_layers=", par.last_stage_layers, " leaves ", middle, " layers, which do not split evenly over the ",
          middle_stages, " other pipeline stages"));
    }
    for (int64_t s = 0; s < pp; ++s) n[s] = middle_stages > 0 ? middle / middle_stages : 0;
    if (first) n[0] = par.first_stage_layers;
    if (last) n[pp - 1] = par.last_stage_layers;
  } else {
    if (vpp > 1 && layers % pp != 0) {
      return absl::InvalidArgumentError(absl::StrCat("megatron: pp=", pp, " must divide num_hidden_layers=", layers,
                                                     " with a virtual pipeline (or give first/last_stage_layers)"));
    }
    for (int64_t s = 0; s < pp; ++s) n[s] = layers / pp + (s < layers % pp ? 1 : 0);
  }
  // Virtual pipeline: stage s's layers are vpp chunks of n[s]/vpp; chunk v of every stage comes
  // after chunk v-1 of every stage (get_transformer_layer_offset: v*T + the earlier stages' chunks).
  int64_t total = 0, before = 0;
  for (int64_t s = 0; s < pp; ++s) {
    if (n[s] % vpp != 0) {
      return absl::InvalidArgumentError(absl::StrCat("megatron: pipeline stage ", s, " has ", n[s],
                                                     " layers, not a multiple of vpp=", vpp));
    }
    total += n[s] / vpp;
    if (s < pp_rank) before += n[s] / vpp;
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t v = 0; v < vpp; ++v) out.emplace_back(v * total + before, n[pp_rank] / vpp);
  return out;
}

absl::StatusOr<PresetLayout> MakePresetLayout(const ModelConfig& config, const Inventory& inventory,
                                              const ParallelConfig& parallel, int rank) {
  ASSIGN_OR_RETURN(PresetBuilder b, PresetBuilder::Create(config, inventory, parallel));
  return b.Make(rank);
}

}  // namespace wb::planner
