#include "planner/lora.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/box.h"
#include "base/status_macros.h"

namespace wb::planner {
namespace {

constexpr const char* kCanonicalPrefix = "base_model.model.model.layers.";

// One PEFT target module and where it sits in vLLM's packed layers.
struct ModuleInfo {
  const char* name;      // PEFT name
  const char* block;     // "self_attn" or "mlp"
  const char* packed;    // vLLM module holding it
  int slice;             // slice index in the packed module
  bool row_parallel;     // RowParallelLinear in vLLM (o_proj, down_proj)
};

constexpr ModuleInfo kModules[] = {
    {"q_proj", "self_attn", "qkv_proj", 0, false},  {"k_proj", "self_attn", "qkv_proj", 1, false},
    {"v_proj", "self_attn", "qkv_proj", 2, false},  {"o_proj", "self_attn", "o_proj", 0, true},
    {"gate_proj", "mlp", "gate_up_proj", 0, false}, {"up_proj", "mlp", "gate_up_proj", 1, false},
    {"down_proj", "mlp", "down_proj", 0, true},
};
constexpr int kNumModules = sizeof(kModules) / sizeof(kModules[0]);

// [out_features, in_features] of module m (the HF nn.Linear weight shape).
std::pair<int64_t, int64_t> Dims(const ModelConfig& c, int m) {
  const int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  switch (m) {
    case 0: return {q, c.hidden};
    case 1:
    case 2: return {kv, c.hidden};
    case 3: return {c.hidden, q};
    case 4:
    case 5: return {c.intermediate, c.hidden};
    default: return {c.hidden, c.intermediate};
  }
}

// Targeted module indices into kModules, in canonical order.
std::vector<int> Targets(const LoraConfig& lora) {
  std::vector<int> out;
  for (int m = 0; m < kNumModules; ++m) {
    if (std::find(lora.target_modules.begin(), lora.target_modules.end(), kModules[m].name) != lora.target_modules.end()) {
      out.push_back(m);
    }
  }
  return out;
}

std::string ModulePath(int64_t layer, int m) {
  return absl::StrCat(layer, ".", kModules[m].block, ".", kModules[m].name);
}

int64_t MaxRank(const LoraConfig& lora) { return VllmSlotRank(lora); }

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Packs local tensors into one buffer at aligned offsets (as planner/presets.cc does).
class LoraWriter {
 public:
  explicit LoraWriter(const Inventory& inv) : inv_(inv) {}

  // A local tensor of `shape` holding canonical box [begin, end) of tensor `t` with local strides
  // `strides` starting at local element 0 (an empty box: no piece). `reserve_elements` > the
  // shape's: storage reserved for it (FSDP2's padded shards).
  void Add(std::string name, std::vector<int64_t> shape, int32_t t, Box box, std::vector<int64_t> strides,
           int64_t reserve_elements = 0) {
    cursor_ = AlignUp(cursor_, kLocalTensorAlignment);
    LocalTensor lt;
    lt.name = std::move(name);
    lt.dtype = inv_.tensors[t].dtype;
    lt.offset_bytes = cursor_;
    lt.first_piece = static_cast<int32_t>(out_.layout.pieces.size());
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    cursor_ += std::max(n, reserve_elements) * DTypeSize(lt.dtype);
    lt.shape = std::move(shape);
    const bool empty = box.end[0] <= box.begin[0];
    lt.num_pieces = empty ? 0 : 1;
    if (empty) {
      out_.local_tensors.push_back(std::move(lt));
      return;
    }
    Piece p;
    p.tensor = t;
    p.box = std::move(box);
    p.buffer = 0;
    p.offset_bytes = lt.offset_bytes;
    p.strides = std::move(strides);
    out_.layout.pieces.push_back(std::move(p));
    out_.local_tensors.push_back(std::move(lt));
  }

  PresetLayout Finish() {
    out_.layout.buffers = {BufferInfo{AlignUp(cursor_, kLocalTensorAlignment)}};
    return std::move(out_);
  }

 private:
  const Inventory& inv_;
  PresetLayout out_;
  int64_t cursor_ = 0;
};

Box Rows(const TensorSpec& t, int64_t lo, int64_t hi) {
  Box b{{lo, 0}, {hi, t.shape[1]}};
  return b;
}

Box Cols(const TensorSpec& t, int64_t lo, int64_t hi) {
  Box b{{0, lo}, {t.shape[0], hi}};
  return b;
}

absl::Status CheckSizes(const ParallelConfig& p) {
  if (p.tp < 1 || p.dp < 1 || p.replicas < 1 || p.pp != 1 || p.ep != 1 || p.etp != 0 || p.vpp != 1 ||
      p.first_stage_layers != 0 || p.last_stage_layers != 0 || p.expert_parallel || !p.expert_placement.empty() ||
      p.vocab_divisible_by != 128 || p.moe_grouped_gemm || p.moe_legacy_grouped_gemm || p.tp_pp_dp_mapping ||
      !p.quantization.empty() || p.enable_dp_lm_head || p.moe_dense_tp_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        p.preset, ": only tp, dp and replicas apply (each >= 1; pp/ep/vpp 1, no etp, expert options or quantization); got tp=", p.tp,
        " dp=", p.dp, " replicas=", p.replicas, " pp=", p.pp, " ep=", p.ep, " etp=", p.etp, " vpp=", p.vpp,
        p.quantization.empty() ? "" : absl::StrCat(" quantization=", p.quantization),
        p.enable_dp_lm_head ? " enable_dp_lm_head" : "", p.moe_dense_tp_size != 0 ? absl::StrCat(" moe_dense_tp_size=", p.moe_dense_tp_size) : ""));
  }
  if (p.preset != "vllm_lora" && p.tp != 1) {
    return absl::InvalidArgumentError(absl::StrCat(p.preset, ": adapters are replicated or FSDP2-sharded over dp; tp=", p.tp,
                                                   " is not supported"));
  }
  return absl::OkStatus();
}

absl::Status CheckVllmLora(const ModelConfig& c, const LoraConfig& lora, int tp) {
  if (lora.r > kVllmMaxLoraRanks[std::size(kVllmMaxLoraRanks) - 1]) {
    // vllm/config/lora.py: max_lora_rank is one of MaxLoRARanks (at most 512), and an adapter whose
    // r exceeds it is rejected at load.
    return absl::InvalidArgumentError(absl::StrCat("vllm_lora: lora.r=", lora.r, " exceeds vLLM's largest --max-lora-rank (",
                                                   kVllmMaxLoraRanks[std::size(kVllmMaxLoraRanks) - 1], ")"));
  }
  auto divides = [&](int64_t n, const char* field) -> absl::Status {
    if (n % tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat("vllm_lora: tp=", tp, " must divide ", field, "=", n));
    }
    return absl::OkStatus();
  };
  // fully_sharded_loras: vLLM divides max_lora_rank (column-parallel slices' lora_a) and the output
  // (row-parallel slices' lora_b: hidden_size) by tp.
  for (int m : lora.fully_sharded_loras ? Targets(lora) : std::vector<int>{}) {
    if (kModules[m].row_parallel) {
      RETURN_IF_ERROR(divides(c.hidden, "hidden_size (fully_sharded_loras: o_proj / down_proj lora_b rows)"));
    } else {
      RETURN_IF_ERROR(divides(MaxRank(lora), "max_lora_rank (fully_sharded_loras)"));
    }
  }
  for (int m : Targets(lora)) {
    if (m <= 3) {
      RETURN_IF_ERROR(divides(c.heads, "num_attention_heads"));
      if (tp >= c.kv_heads ? tp % c.kv_heads != 0 : c.kv_heads % tp != 0) {
        return absl::InvalidArgumentError(absl::StrCat("vllm_lora: tp=", tp, " and num_key_value_heads=", c.kv_heads,
                                                       " must divide one another"));
      }
    } else {
      RETURN_IF_ERROR(divides(c.intermediate, "intermediate_size"));
    }
  }
  return absl::OkStatus();
}

// peft: every tensor whole. peft_fsdp2 (shards > 0): FSDP2 fully_shard over `shards` ranks, as
// planner/presets.h "fsdp": torch.chunk rows on dim 0 (c = ceil(d0 / shards) rows, rank s holds
// [min(d0, s*c), min(d0, (s+1)*c)), possibly none), c rows reserved on every rank.
PresetLayout MakePeft(const Inventory& inv, int64_t shards, int64_t shard_rank) {
  LoraWriter w(inv);
  for (int32_t t = 0; t < static_cast<int32_t>(inv.tensors.size()); ++t) {
    const TensorSpec& spec = inv.tensors[t];
    // "...lora_A.weight" -> "...lora_A.default.weight" (the live PeftModel parameter name).
    std::string name = spec.name.substr(0, spec.name.size() - 7) + ".default.weight";
    const int64_t d0 = spec.shape[0], cols = spec.shape[1];
    const int64_t chunk = shards > 0 ? (d0 + shards - 1) / shards : d0;
    const int64_t lo = shards > 0 ? std::min(d0, shard_rank * chunk) : 0;
    const int64_t hi = std::min(d0, lo + chunk);
    w.Add(std::move(name), {hi - lo, cols}, t, Rows(spec, lo, hi), {cols, 1}, chunk * cols);
  }
  return w.Finish();
}

PresetLayout MakeVllmLora(const ModelConfig& c, const LoraConfig& lora, const Inventory& inv, int tp_rank, int tp) {
  LoraWriter w(inv);
  const std::vector<int> targets = Targets(lora);
  const int64_t R = MaxRank(lora);
  const int64_t r = lora.r;
  // vLLM QKVParallelLinear: KV heads per rank and how many ranks share each KV head.
  const int64_t kv_per_rank = tp >= c.kv_heads ? 1 : c.kv_heads / tp;
  const int64_t kv_replicas = tp >= c.kv_heads ? tp / c.kv_heads : 1;
  int32_t t = 0;
  for (int64_t l = 0; l < c.layers; ++l) {
    for (int m : targets) {
      const ModuleInfo& info = kModules[m];
      const int32_t a = t++, b = t++;
      const TensorSpec& A = inv.tensors[a];  // [r, in]
      const TensorSpec& B = inv.tensors[b];  // [out, r]
      // vLLM's GPT-OSS names its attention `attn` (gpt_oss.py maps HF's `.self_attn.` to `.attn.`).
      const char* block = c.family == ModelFamily::kGptOss && std::string(info.block) == "self_attn" ? "attn" : info.block;
      const std::string base = absl::StrCat("model.layers.", l, ".", block, ".", info.packed);
      const std::string a_name = absl::StrCat(base, ".lora_a_stacked.", info.slice);
      const std::string b_name = absl::StrCat(base, ".lora_b_stacked.", info.slice);
      const int64_t in = A.shape[1], out = B.shape[0];
      if (info.row_parallel) {
        // RowParallelLinearWithLoRA.slice_lora_a: lora_a[:, tp_rank*shard : (tp_rank+1)*shard].
        const int64_t shard = in / tp;
        w.Add(a_name, {R, shard}, a, Cols(A, tp_rank * shard, (tp_rank + 1) * shard), {shard, 1});
        if (lora.fully_sharded_loras) {
          // RowParallelLinearWithShardedLoRA.slice_lora_b: lora_b[tp_rank*s : (tp_rank+1)*s, :], s = out / tp.
          const int64_t s = out / tp;
          w.Add(b_name, {s, R}, b, Rows(B, tp_rank * s, (tp_rank + 1) * s), {R, 1});
        } else {
          w.Add(b_name, {out, R}, b, Rows(B, 0, out), {R, 1});
        }
        continue;
      }
      // Column-parallel slices: lora_a whole (fully sharded, S-LoRA: its rows [tp_rank*R/tp, +R/tp)
      // of the adapter's r, at the slot's first rows - *ShardedLoRA.slice_lora_a), lora_b rows of
      // this rank's shard.
      if (lora.fully_sharded_loras) {
        const int64_t s = R / tp, lo = std::min(r, tp_rank * s), hi = std::min(r, tp_rank * s + s);
        w.Add(a_name, {s, in}, a, Rows(A, lo, hi), {in, 1});
      } else {
        w.Add(a_name, {R, in}, a, Rows(A, 0, r), {in, 1});
      }
      int64_t shard = 0, shard_id = tp_rank;
      if (m == 0) {
        shard = c.heads / tp * c.head_dim;
      } else if (m <= 2) {
        shard = kv_per_rank * c.head_dim;
        shard_id = tp_rank / kv_replicas;
      } else {
        shard = c.intermediate / tp;
      }
      w.Add(b_name, {shard, R}, b, Rows(B, shard_id * shard, (shard_id + 1) * shard), {R, 1});
    }
  }
  return w.Finish();
}

}  // namespace

const std::vector<std::string>& LoraModuleNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const ModuleInfo& m : kModules) v->push_back(m.name);
    return v;
  }();
  return *names;
}

int64_t VllmSlotRank(const LoraConfig& lora) {
  if (lora.max_lora_rank > 0) return lora.max_lora_rank;
  for (int64_t v : kVllmMaxLoraRanks) {
    if (v >= kVllmDefaultMaxLoraRank && v >= lora.r) return v;
  }
  return lora.r;
}

absl::Status ValidateLora(const ModelConfig& c, const LoraConfig& lora) {
  if (lora.r < 1 || lora.r > kMaxLoraRank) {
    return absl::InvalidArgumentError(absl::StrCat("lora.r=", lora.r, " must be in [1, ", kMaxLoraRank, "]"));
  }
  if (!std::isfinite(lora.alpha) || lora.alpha <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("lora.alpha=", lora.alpha, " must be finite and > 0"));
  }
  if (lora.max_lora_rank != 0 &&
      (lora.max_lora_rank < lora.r || std::find(std::begin(kVllmMaxLoraRanks), std::end(kVllmMaxLoraRanks), lora.max_lora_rank) ==
                                          std::end(kVllmMaxLoraRanks))) {
    return absl::InvalidArgumentError(absl::StrCat("lora.max_lora_rank=", lora.max_lora_rank, " must be 0 (vLLM's default, ",
                                                   kVllmDefaultMaxLoraRank, ", or the smallest value holding r) or a value vLLM's --max-lora-rank accepts (",
                                                   absl::StrJoin(kVllmMaxLoraRanks, ", "), ") and >= r=", lora.r));
  }
  if (lora.target_modules.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("lora.target_modules is empty (expected some of ",
                                                   absl::StrJoin(LoraModuleNames(), ", "), ")"));
  }
  absl::flat_hash_set<std::string> seen;
  for (const std::string& name : lora.target_modules) {
    const auto& known = LoraModuleNames();
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return absl::InvalidArgumentError(absl::StrCat("lora.target_modules: unknown module `", name, "` (expected one of ",
                                                     absl::StrJoin(known, ", "), ")"));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("lora.target_modules: `", name, "` listed twice"));
    }
  }
  for (int m : Targets(lora)) {
    if (m <= 3 && c.mla) {
      return absl::InvalidArgumentError(absl::StrCat("lora.target_modules: ", kModules[m].name, " on ", c.architecture,
                                                     ": multi-head latent attention has no such projection"));
    }
    if (c.fused_proj && m != 3 && m != 6) {
      // Phi-3's modules are qkv_proj / gate_up_proj: PEFT has no q/k/v/gate/up module to adapt.
      return absl::InvalidArgumentError(absl::StrCat("lora.target_modules: ", kModules[m].name, " on ", c.architecture,
                                                     ": its attention and MLP inputs are the fused qkv_proj / gate_up_proj (not modelled)"));
    }
    if (m >= 4 && (c.experts > 0 || c.fused_experts)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.target_modules: ", kModules[m].name, " on ", c.architecture, " (",
          c.experts_field.empty() ? "experts" : c.experts_field, "=", c.experts,
          "): MLP adapters are supported on dense models only (PEFT would also match every expert's projection)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Inventory> BuildLoraInventory(const ModelConfig& c, const LoraConfig& lora, DType dtype,
                                             const InventoryLimits& limits) {
  RETURN_IF_ERROR(ValidateLora(c, lora));
  const std::vector<int> targets = Targets(lora);
  // Bounded before allocating: layers <= kMaxConfigValue (2^32), so this product fits.
  const int64_t count = c.layers * static_cast<int64_t>(targets.size()) * 2;
  if (count > limits.max_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("lora: num_hidden_layers=", c.layers, " x ", targets.size(),
                                                   " target modules x 2 = ", count, " adapter tensors exceeds the limit of ",
                                                   limits.max_tensors));
  }
  int64_t per_layer = 0;
  for (int m : targets) {
    const auto [out, in] = Dims(c, m);
    // Dims are <= kMaxDerivedDim (2^40) and r <= 2^16: products fit in int64.
    for (int64_t dim : {in, out}) {
      if (dim < 1 || dim > kMaxDerivedDim || dim * lora.r > limits.max_tensor_elements) {
        return absl::InvalidArgumentError(absl::StrCat("lora: ", kModules[m].name, " [", out, ", ", in, "] with r=", lora.r,
                                                       ": an adapter tensor of ", dim, " x ", lora.r,
                                                       " elements is out of bounds (limit ", limits.max_tensor_elements, ")"));
      }
    }
    per_layer += (in + out) * lora.r;
  }
  const int64_t size = DTypeSize(dtype);
  // count <= max_tensors (2^17 by default) bounds layers; compare by division to stay exact.
  if (c.layers > 0 && per_layer > limits.max_total_bytes / size / c.layers) {
    return absl::InvalidArgumentError(absl::StrCat("lora: adapters of ", c.layers, " layers x ", per_layer,
                                                   " elements exceed the limit of ", limits.max_total_bytes, " bytes"));
  }
  Inventory inv;
  inv.architecture = c.architecture;
  inv.tensors.reserve(static_cast<size_t>(count));
  for (int64_t l = 0; l < c.layers; ++l) {
    for (int m : targets) {
      const auto [out, in] = Dims(c, m);
      const std::string path = absl::StrCat(kCanonicalPrefix, ModulePath(l, m));
      inv.tensors.push_back(TensorSpec{absl::StrCat(path, ".lora_A.weight"), {lora.r, in}, dtype});
      inv.tensors.push_back(TensorSpec{absl::StrCat(path, ".lora_B.weight"), {out, lora.r}, dtype});
    }
  }
  return inv;
}

bool IsLoraPreset(const std::string& preset) { return preset == "peft" || preset == "peft_fsdp2" || preset == "vllm_lora"; }

absl::StatusOr<int> LoraPresetWorldSize(const ParallelConfig& p) {
  if (!IsLoraPreset(p.preset)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown LoRA preset `", p.preset, "` (expected peft, peft_fsdp2 or vllm_lora)"));
  }
  RETURN_IF_ERROR(CheckSizes(p));
  const int64_t world = int64_t{p.tp} * p.dp * p.replicas;
  if (world > kMaxPresetWorld) {
    return absl::InvalidArgumentError(absl::StrCat(p.preset, ": world size ", world, " (tp=", p.tp, " dp=", p.dp,
                                                   " replicas=", p.replicas, ") exceeds the limit of ", kMaxPresetWorld));
  }
  return static_cast<int>(world);
}

absl::StatusOr<PresetLayout> MakeLoraPresetLayout(const ModelConfig& c, const LoraConfig& lora, const Inventory& inv,
                                                  const ParallelConfig& p, int rank) {
  ASSIGN_OR_RETURN(const int world, LoraPresetWorldSize(p));
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat(p.preset, ": rank ", rank, " outside [0, ", world, ")"));
  }
  RETURN_IF_ERROR(ValidateLora(c, lora));
  const std::vector<int> targets = Targets(lora);
  if (inv.tensors.size() != static_cast<size_t>(c.layers) * targets.size() * 2) {
    return absl::InvalidArgumentError(absl::StrCat(p.preset, ": the inventory has ", inv.tensors.size(),
                                                   " tensors, not the adapters of this LoRA config"));
  }
  if (p.preset == "peft") return MakePeft(inv, 0, 0);
  if (p.preset == "peft_fsdp2") return MakePeft(inv, p.dp, rank % p.dp);
  RETURN_IF_ERROR(CheckVllmLora(c, lora, p.tp));
  return MakeVllmLora(c, lora, inv, rank % p.tp, p.tp);
}

absl::StatusOr<Inventory> BuildModelInventory(const ModelConfig& config, DType dtype, const InventoryLimits& limits) {
  if (config.lora.has_value()) return BuildLoraInventory(config, *config.lora, dtype, limits);
  return BuildInventory(config, dtype, limits);
}

absl::StatusOr<PresetLayout> MakeModelPresetLayout(const ModelConfig& config, const Inventory& inventory,
                                                   const ParallelConfig& parallel, int rank) {
  if (config.lora.has_value()) {
    if (!IsLoraPreset(parallel.preset)) {
      return absl::InvalidArgumentError(absl::StrCat("preset `", parallel.preset,
                                                     "` places base weights; this model holds LoRA adapters (use peft, peft_fsdp2 or vllm_lora)"));
    }
    return MakeLoraPresetLayout(config, *config.lora, inventory, parallel, rank);
  }
  if (IsLoraPreset(parallel.preset)) {
    return absl::InvalidArgumentError(absl::StrCat("preset `", parallel.preset,
                                                   "` places LoRA adapters; this model declares none (ModelSpec.lora)"));
  }
  return MakePresetLayout(config, inventory, parallel, rank);
}

}  // namespace wb::planner
