#include "planner/lora.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/inventory.h"
#include "planner/validate.h"

namespace wb::planner {
namespace {

std::string ReadTestdata(const std::string& name) {
  std::ifstream f("planner/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ModelConfig Config(const std::string& text) {
  auto c = ParseHfConfig(text);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// A small Llama with GQA (8 query heads, 2 KV heads, head_dim 8): tp=4 replicates each KV head on
// 2 ranks, as vLLM's QKVParallelLinear does.
const char* kSmallLlama = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
  "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100})";

LoraConfig AllTargets(int64_t r, int64_t max_rank = 0) {
  LoraConfig l;
  l.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  l.r = r;
  l.alpha = 2.0 * r;
  l.max_lora_rank = max_rank;
  return l;
}

// Adapters on `targets` with rank r and alpha = 2r.
LoraConfig Adapters(std::vector<std::string> targets, int64_t r) {
  LoraConfig l;
  l.target_modules = std::move(targets);
  l.r = r;
  l.alpha = 2.0 * r;
  return l;
}

ParallelConfig Par(const std::string& preset, int tp, int dp = 1) {
  ParallelConfig p;
  p.preset = preset;
  p.tp = tp;
  p.dp = dp;
  return p;
}

TEST(LoraInventory, PeftNamesAndShapesQwen2Gqa) {
  ModelConfig c = Config(ReadTestdata("qwen2.5-7b.json"));
  LoraConfig lora = AllTargets(16);
  auto inv = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  ASSERT_EQ(inv->tensors.size(), 28u * 7 * 2);
  TensorIndex idx(*inv);
  // Qwen2.5-7B: hidden 3584, 28 heads x 128, 4 KV heads, intermediate 18944.
  const std::map<std::string, std::vector<int64_t>> want = {
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {16, 3584}},
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {3584, 16}},
      {"base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight", {512, 16}},
      {"base_model.model.model.layers.3.self_attn.v_proj.lora_A.weight", {16, 3584}},
      {"base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight", {512, 16}},
      {"base_model.model.model.layers.27.self_attn.o_proj.lora_A.weight", {16, 3584}},
      {"base_model.model.model.layers.27.mlp.gate_proj.lora_B.weight", {18944, 16}},
      {"base_model.model.model.layers.27.mlp.up_proj.lora_A.weight", {16, 3584}},
      {"base_model.model.model.layers.27.mlp.down_proj.lora_A.weight", {16, 18944}},
      {"base_model.model.model.layers.27.mlp.down_proj.lora_B.weight", {3584, 16}},
  };
  for (const auto& [name, shape] : want) {
    auto i = idx.Find(name);
    ASSERT_TRUE(i.has_value()) << name;
    EXPECT_EQ(inv->tensors[*i].shape, shape) << name;
  }
  // Canonical order: layer, then q k v o gate up down, A before B.
  EXPECT_EQ(inv->tensors[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(inv->tensors[1].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(inv->tensors[13].name, "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  EXPECT_EQ(inv->tensors[14].name, "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
}

TEST(LoraInventory, SubsetOfTargetsAndQwen3HeadDim) {
  // Qwen3-30B-A3B: head_dim 128 with 32 heads (q_proj out 4096 != hidden 2048); attention only
  // (its MLPs are experts).
  ModelConfig c = Config(ReadTestdata("qwen3-30b-a3b.json"));
  LoraConfig lora;
  lora.target_modules = {"v_proj", "q_proj"};  // order given does not matter
  lora.r = 8;
  lora.alpha = 16;
  auto inv = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  ASSERT_EQ(inv->tensors.size(), 48u * 4);
  EXPECT_EQ(inv->tensors[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(inv->tensors[1].shape, (std::vector<int64_t>{4096, 8}));
  EXPECT_EQ(inv->tensors[2].name, "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight");
  EXPECT_EQ(inv->tensors[3].shape, (std::vector<int64_t>{512, 8}));
  lora.target_modules.push_back("gate_proj");
  auto moe = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_FALSE(moe.ok());
  EXPECT_TRUE(absl::StrContains(moe.status().message(), "gate_proj")) << moe.status();
  EXPECT_TRUE(absl::StrContains(moe.status().message(), "num_experts")) << moe.status();
}

TEST(LoraInventory, BadConfigsNameTheField) {
  ModelConfig c = Config(kSmallLlama);
  struct Case {
    LoraConfig lora;
    std::string needle;
  };
  std::vector<Case> cases;
  LoraConfig l = AllTargets(4);
  l.r = 0;
  cases.push_back({l, "lora.r=0"});
  l = AllTargets(4);
  l.alpha = -1;
  cases.push_back({l, "lora.alpha=-1"});
  l = AllTargets(4, 2);
  cases.push_back({l, "lora.max_lora_rank=2"});
  l = AllTargets(4, 12);  // >= r, but no value vLLM's --max-lora-rank accepts
  cases.push_back({l, "lora.max_lora_rank=12"});
  l = AllTargets(4);
  l.target_modules = {};
  cases.push_back({l, "lora.target_modules is empty"});
  l = AllTargets(4);
  l.target_modules = {"q_proj", "qkv_proj"};
  cases.push_back({l, "unknown module `qkv_proj`"});
  l = AllTargets(4);
  l.target_modules = {"q_proj", "q_proj"};
  cases.push_back({l, "`q_proj` listed twice"});
  l = AllTargets(int64_t{1} << 20);
  cases.push_back({l, "lora.r=1048576"});
  for (const Case& k : cases) {
    auto inv = BuildLoraInventory(c, k.lora, DType::kBF16);
    ASSERT_FALSE(inv.ok()) << k.needle;
    EXPECT_EQ(inv.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(inv.status().message(), k.needle)) << inv.status() << " / " << k.needle;
  }
  // Limits apply before allocation.
  InventoryLimits small;
  small.max_tensors = 10;
  auto over = BuildLoraInventory(c, AllTargets(4), DType::kBF16, small);
  ASSERT_FALSE(over.ok());
  EXPECT_TRUE(absl::StrContains(over.status().message(), "exceeds the limit of 10")) << over.status();
  ModelConfig mla = Config(ReadTestdata("deepseek-v2-lite.json"));
  LoraConfig q;
  q.target_modules = {"o_proj"};
  q.r = 4;
  q.alpha = 8;
  auto m = BuildLoraInventory(mla, q, DType::kBF16);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(absl::StrContains(m.status().message(), "multi-head latent attention")) << m.status();
}

// Canonical flat index of every local element, from the layout's pieces (-1: not covered).
std::vector<int64_t> LocalContent(const Inventory& inv, const PresetLayout& l, const LocalTensor& lt) {
  int64_t n = 1;
  for (int64_t d : lt.shape) n *= d;
  std::vector<int64_t> out(n, -1);
  const int es = DTypeSize(lt.dtype);
  for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) {
    const Piece& p = l.layout.pieces[k];
    const auto& shape = inv.tensors[p.tensor].shape;
    for (int64_t i = p.box.begin[0]; i < p.box.end[0]; ++i) {
      for (int64_t j = p.box.begin[1]; j < p.box.end[1]; ++j) {
        const int64_t byte = p.offset_bytes + ((i - p.box.begin[0]) * p.strides[0] + (j - p.box.begin[1]) * p.strides[1]) * es;
        const int64_t local = (byte - lt.offset_bytes) / es;
        EXPECT_GE(local, 0);
        EXPECT_LT(local, n);
        if (local >= 0 && local < n) out[local] = i * shape[1] + j;
      }
    }
  }
  return out;
}

// What vLLM's set_lora writes into the [slot, 0] slice of a stacked tensor of shape
// [rows, cols]: `src` (a [src_rows, src_cols] matrix of canonical flat indices, already sliced
// by slice_lora_a / slice_lora_b) at [:src_rows, :src_cols], the rest zero (-1 here).
std::vector<int64_t> Stacked(int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t src_rows, int64_t src_cols,
                             int64_t canon_cols) {
  std::vector<int64_t> out(rows * cols, -1);
  for (int64_t i = 0; i < src_rows; ++i) {
    for (int64_t j = 0; j < src_cols; ++j) out[i * cols + j] = (row0 + i) * canon_cols + (col0 + j);
  }
  return out;
}

// Every rank of vllm_lora against an independent transcription of vLLM's slicing
// (MergedQKVParallelLinearWithLoRA / MergedColumnParallelLinearWithLoRA / RowParallelLinearWithLoRA
// slice_lora_a, slice_lora_b), for a GQA model with tp = 1, 2 (KV heads split) and 4 (each KV head
// on 2 ranks), with max_lora_rank == r and > r, and with fully_sharded_loras (S-LoRA:
// *ShardedLoRA.slice_lora_a takes rows [tp_rank * R/tp, +R/tp) of the column slices' lora_a,
// RowParallelLinearWithShardedLoRA.slice_lora_b rows [tp_rank * out/tp, +out/tp) of lora_b).
TEST(LoraPresets, VllmLoraMatchesVllmSlicing) {
  ModelConfig c = Config(kSmallLlama);
  for (int combo = 0; combo < 4; ++combo) {
    const int64_t max_rank = combo % 2 == 0 ? 0 : 8;
    const bool sharded = combo >= 2;
    LoraConfig lora = AllTargets(4, max_rank);
    lora.fully_sharded_loras = sharded;
    const int64_t R = max_rank > 0 ? max_rank : 16;  // 0: vLLM's default --max-lora-rank
    auto inv = BuildLoraInventory(c, lora, DType::kBF16);
    ASSERT_TRUE(inv.ok()) << inv.status();
    TensorIndex idx(*inv);
    for (int tp : {1, 2, 4}) {
      for (int rank = 0; rank < tp; ++rank) {
        auto l = MakeLoraPresetLayout(c, lora, *inv, Par("vllm_lora", tp), rank);
        ASSERT_TRUE(l.ok()) << l.status();
        ASSERT_TRUE(ValidateLayout(*inv, l->layout, Role::kRollout, "r").ok());
        ASSERT_EQ(l->local_tensors.size(), 2u * 7 * 2);
        const int64_t q_shard = 8 / tp * 8;
        const int64_t kv_heads_per_rank = tp >= 2 ? 1 : 2;
        const int64_t kv_shard = kv_heads_per_rank * 8;
        const int64_t kv_id = tp >= 2 ? rank / (tp / 2) : 0;  // num_kv_head_replicas = tp / 2
        const int64_t inter = 96 / tp;
        for (const LocalTensor& lt : l->local_tensors) {
          // Name -> (PEFT module, expected content).
          std::string mod;
          bool is_a = absl::StrContains(lt.name, "lora_a_stacked");
          const int slice = lt.name.back() - '0';
          const int layer = lt.name[13] - '0';
          if (absl::StrContains(lt.name, "qkv_proj")) mod = slice == 0 ? "q_proj" : slice == 1 ? "k_proj" : "v_proj";
          else if (absl::StrContains(lt.name, "gate_up_proj")) mod = slice == 0 ? "gate_proj" : "up_proj";
          else if (absl::StrContains(lt.name, "o_proj")) mod = "o_proj";
          else mod = "down_proj";
          const std::string block = absl::StrContains(lt.name, "self_attn") ? "self_attn" : "mlp";
          const std::string canon =
              absl::StrCat("base_model.model.model.layers.", layer, ".", block, ".", mod, is_a ? ".lora_A.weight" : ".lora_B.weight");
          auto t = idx.Find(canon);
          ASSERT_TRUE(t.has_value()) << lt.name;
          const auto& shape = inv->tensors[*t].shape;
          std::vector<int64_t> want;
          if (mod == "o_proj" || mod == "down_proj") {
            const int64_t in_shard = (mod == "o_proj" ? 64 : 96) / tp;
            if (is_a) {
              ASSERT_EQ(lt.shape, (std::vector<int64_t>{R, in_shard})) << lt.name;
              want = Stacked(R, in_shard, 0, rank * in_shard, 4, in_shard, shape[1]);
            } else if (sharded) {
              const int64_t s = 64 / tp;
              ASSERT_EQ(lt.shape, (std::vector<int64_t>{s, R})) << lt.name;
              want = Stacked(s, R, rank * s, 0, s, 4, shape[1]);
            } else {
              ASSERT_EQ(lt.shape, (std::vector<int64_t>{64, R})) << lt.name;
              want = Stacked(64, R, 0, 0, 64, 4, shape[1]);
            }
          } else if (is_a && sharded) {
            const int64_t s = R / tp, lo = std::min<int64_t>(4, rank * s), hi = std::min<int64_t>(4, rank * s + s);
            ASSERT_EQ(lt.shape, (std::vector<int64_t>{s, 64})) << lt.name;
            want = Stacked(s, 64, lo, 0, hi - lo, 64, shape[1]);
          } else if (is_a) {
            ASSERT_EQ(lt.shape, (std::vector<int64_t>{R, 64})) << lt.name;
            want = Stacked(R, 64, 0, 0, 4, 64, shape[1]);
          } else {
            int64_t shard = inter, id = rank;
            if (mod == "q_proj") shard = q_shard;
            if (mod == "k_proj" || mod == "v_proj") shard = kv_shard, id = kv_id;
            ASSERT_EQ(lt.shape, (std::vector<int64_t>{shard, R})) << lt.name;
            want = Stacked(shard, R, id * shard, 0, shard, 4, shape[1]);
          }
          EXPECT_EQ(LocalContent(*inv, *l, lt), want) << lt.name << " tp=" << tp << " rank=" << rank << " R=" << R << " sharded=" << sharded;
        }
      }
    }
  }
}

TEST(LoraPresets, PackedSliceIndicesWithSubsetOfTargets) {
  ModelConfig c = Config(kSmallLlama);
  const LoraConfig lora = Adapters({"v_proj", "up_proj"}, 2);
  auto inv = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  auto l = MakeLoraPresetLayout(c, lora, *inv, Par("vllm_lora", 2), 1);
  ASSERT_TRUE(l.ok()) << l.status();
  std::vector<std::string> names;
  for (const LocalTensor& lt : l->local_tensors) names.push_back(lt.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "model.layers.0.self_attn.qkv_proj.lora_a_stacked.2", "model.layers.0.self_attn.qkv_proj.lora_b_stacked.2",
                       "model.layers.0.mlp.gate_up_proj.lora_a_stacked.1", "model.layers.0.mlp.gate_up_proj.lora_b_stacked.1",
                       "model.layers.1.self_attn.qkv_proj.lora_a_stacked.2", "model.layers.1.self_attn.qkv_proj.lora_b_stacked.2",
                       "model.layers.1.mlp.gate_up_proj.lora_a_stacked.1", "model.layers.1.mlp.gate_up_proj.lora_b_stacked.1"}));
  // Offsets are 256-aligned and inside the one buffer.
  for (const LocalTensor& lt : l->local_tensors) EXPECT_EQ(lt.offset_bytes % kLocalTensorAlignment, 0) << lt.name;
  ASSERT_EQ(l->layout.buffers.size(), 1u);
}

TEST(LoraPresets, PeftReplicatedAndCoversEveryVllmRank) {
  ModelConfig c = Config(ReadTestdata("qwen2.5-0.5b.json"));
  c.layers = 2;
  LoraConfig lora = AllTargets(8);
  auto inv = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  std::vector<Worker> workers;
  for (int r = 0; r < 2; ++r) {
    auto l = MakeLoraPresetLayout(c, lora, *inv, Par("peft", 1, 2), r);
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_EQ(l->local_tensors.size(), inv->tensors.size());
    EXPECT_EQ(l->local_tensors[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight");
    EXPECT_EQ(l->local_tensors[3].name, "base_model.model.model.layers.0.self_attn.k_proj.lora_B.default.weight");
    EXPECT_EQ(l->local_tensors[3].shape, (std::vector<int64_t>{128, 8}));
    workers.push_back(Worker{absl::StrCat("trainer/", r), Role::kTrainer, 0, r, l->layout});
  }
  // Qwen2.5-0.5B: 14 heads, 2 KV heads: tp=2 splits them.
  for (int r = 0; r < 2; ++r) {
    auto l = MakeLoraPresetLayout(c, lora, *inv, Par("vllm_lora", 2), r);
    ASSERT_TRUE(l.ok()) << l.status();
    workers.push_back(Worker{absl::StrCat("rollout/", r), Role::kRollout, 1, r, l->layout});
  }
  Problem p;
  p.inventory = *inv;
  p.workers = workers;
  EXPECT_TRUE(ValidateProblem(p).ok()) << ValidateProblem(p);
  // tp=4 does not divide 14 heads: named.
  auto bad = MakeLoraPresetLayout(c, lora, *inv, Par("vllm_lora", 4), 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "num_attention_heads=14")) << bad.status();
  auto peft_tp = MakeLoraPresetLayout(c, lora, *inv, Par("peft", 2), 0);
  ASSERT_FALSE(peft_tp.ok());
  EXPECT_TRUE(absl::StrContains(peft_tp.status().message(), "tp=2")) << peft_tp.status();
  // SGLang's DP-attention options do not describe adapters: named, never ignored.
  ParallelConfig lm_head = Par("vllm_lora", 1);
  lm_head.enable_dp_lm_head = true;
  auto with_lm_head = MakeLoraPresetLayout(c, lora, *inv, lm_head, 0);
  ASSERT_FALSE(with_lm_head.ok());
  EXPECT_TRUE(absl::StrContains(with_lm_head.status().message(), "enable_dp_lm_head")) << with_lm_head.status();
  ParallelConfig dense = Par("peft", 1);
  dense.moe_dense_tp_size = 1;
  auto with_dense = MakeLoraPresetLayout(c, lora, *inv, dense, 0);
  ASSERT_FALSE(with_dense.ok());
  EXPECT_TRUE(absl::StrContains(with_dense.status().message(), "moe_dense_tp_size=1")) << with_dense.status();
}

// PEFT under FSDP2 (verl's FSDP LoRA path): torch.chunk rows on dim 0, padded reservation, ranks
// past lora_A's r rows hold an empty shard without pieces; together they cover every vllm_lora rank.
TEST(LoraPresets, PeftFsdp2ShardsDim0AsTorchChunk) {
  ModelConfig c = Config(kSmallLlama);
  LoraConfig lora = AllTargets(2);
  auto inv = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  std::vector<Worker> workers;
  int64_t buffer = -1;
  for (int r = 0; r < 4; ++r) {
    auto l = MakeLoraPresetLayout(c, lora, *inv, Par("peft_fsdp2", 1, 4), r);
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_TRUE(ValidateLayout(*inv, l->layout, Role::kTrainer, "t").ok());
    ASSERT_EQ(l->local_tensors.size(), inv->tensors.size());
    // q_proj.lora_A [2, 64]: chunk 1 row; ranks 2 and 3 hold none (listed, 0 rows, no piece).
    const LocalTensor& qa = l->local_tensors[0];
    EXPECT_EQ(qa.name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight");
    EXPECT_EQ(qa.shape, (std::vector<int64_t>{r < 2 ? 1 : 0, 64}));
    EXPECT_EQ(qa.num_pieces, r < 2 ? 1 : 0);
    if (r < 2) {
      const Piece& p = l->layout.pieces[qa.first_piece];
      EXPECT_EQ(p.box.begin, (std::vector<int64_t>{r, 0}));
      EXPECT_EQ(p.box.end, (std::vector<int64_t>{r + 1, 64}));
    }
    // q_proj.lora_B [64, 2]: 16 rows per rank; the next tensor starts after the padded shard.
    const LocalTensor& qb = l->local_tensors[1];
    EXPECT_EQ(qb.shape, (std::vector<int64_t>{16, 2}));
    EXPECT_EQ(qb.offset_bytes, 256);  // qa reserved 1 x 64 bf16 = 128 bytes, aligned to 256
    const Piece& pb = l->layout.pieces[qb.first_piece];
    EXPECT_EQ(pb.box.begin, (std::vector<int64_t>{16 * r, 0}));
    // Every rank's buffer has the same size (FSDP2's padded shards).
    if (buffer < 0) buffer = l->layout.buffers[0].size_bytes;
    EXPECT_EQ(l->layout.buffers[0].size_bytes, buffer);
    workers.push_back(Worker{absl::StrCat("trainer/", r), Role::kTrainer, 0, r, l->layout});
  }
  for (int r = 0; r < 4; ++r) {
    auto l = MakeLoraPresetLayout(c, lora, *inv, Par("vllm_lora", 4), r);
    ASSERT_TRUE(l.ok()) << l.status();
    workers.push_back(Worker{absl::StrCat("rollout/", r), Role::kRollout, 1, r, l->layout});
  }
  Problem p;
  p.inventory = *inv;
  p.workers = workers;
  EXPECT_TRUE(ValidateProblem(p).ok()) << ValidateProblem(p);
}

TEST(LoraPresets, ModelDispatchRefusesMismatchedPresets) {
  ModelConfig base = Config(kSmallLlama);
  ModelConfig with = base;
  with.lora = AllTargets(4);
  auto inv = BuildModelInventory(with, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->tensors.size(), 2u * 7 * 2);
  EXPECT_TRUE(MakeModelPresetLayout(with, *inv, Par("vllm_lora", 2), 1).ok());
  auto wrong = MakeModelPresetLayout(with, *inv, Par("vllm", 2), 1);
  ASSERT_FALSE(wrong.ok());
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "preset `vllm`")) << wrong.status();
  auto base_inv = BuildModelInventory(base, DType::kBF16);
  ASSERT_TRUE(base_inv.ok());
  EXPECT_TRUE(MakeModelPresetLayout(base, *base_inv, Par("vllm", 2), 1).ok());
  auto no_lora = MakeModelPresetLayout(base, *base_inv, Par("peft", 1), 0);
  ASSERT_FALSE(no_lora.ok());
  EXPECT_TRUE(absl::StrContains(no_lora.status().message(), "declares none")) << no_lora.status();
  // An inventory that is not this LoRA config's adapters is refused, not indexed out of range.
  auto mismatch = MakeLoraPresetLayout(with, *with.lora, *base_inv, Par("vllm_lora", 1), 0);
  ASSERT_FALSE(mismatch.ok());
  auto bad_rank = MakeLoraPresetLayout(with, *with.lora, *inv, Par("vllm_lora", 2), 2);
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_TRUE(absl::StrContains(bad_rank.status().message(), "rank 2")) << bad_rank.status();
}

// vLLM's --max-lora-rank: only its listed values; 0 means its default (16) or, for a larger r, the
// smallest value that holds r.
TEST(LoraPresets, SlotRankFollowsVllmsMaxLoraRank) {
  EXPECT_EQ(VllmSlotRank(AllTargets(4)), 16);
  EXPECT_EQ(VllmSlotRank(AllTargets(16)), 16);
  EXPECT_EQ(VllmSlotRank(AllTargets(17)), 32);
  EXPECT_EQ(VllmSlotRank(AllTargets(300)), 320);
  EXPECT_EQ(VllmSlotRank(AllTargets(600)), 600);  // beyond vLLM: no slot holds it
  EXPECT_EQ(VllmSlotRank(AllTargets(4, 8)), 8);
  ModelConfig c = Config(kSmallLlama);
  for (int64_t ok : {8, 16, 320, 512}) EXPECT_TRUE(ValidateLora(c, AllTargets(4, ok)).ok()) << ok;
  for (int64_t bad : {2, 5, 24, 1024}) EXPECT_FALSE(ValidateLora(c, AllTargets(4, bad)).ok()) << bad;
  // fully_sharded_loras: vLLM divides the slot's rank by tp (column targets).
  LoraConfig one = AllTargets(1, 1);
  one.fully_sharded_loras = true;
  auto inv = BuildLoraInventory(c, one, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  auto bad = MakeLoraPresetLayout(c, one, *inv, Par("vllm_lora", 2), 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "max_lora_rank (fully_sharded_loras)")) << bad.status();
  one.fully_sharded_loras = false;
  EXPECT_TRUE(MakeLoraPresetLayout(c, one, *inv, Par("vllm_lora", 2), 0).ok());
  // r beyond vLLM's largest --max-lora-rank: no engine holds it (PEFT trainers still may).
  LoraConfig big = AllTargets(600);
  auto big_inv = BuildLoraInventory(c, big, DType::kBF16);
  ASSERT_TRUE(big_inv.ok()) << big_inv.status();
  auto refused = MakeLoraPresetLayout(c, big, *big_inv, Par("vllm_lora", 1), 0);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "lora.r=600 exceeds vLLM's largest --max-lora-rank (512)")) << refused.status();
  EXPECT_TRUE(MakeLoraPresetLayout(c, big, *big_inv, Par("peft", 1), 0).ok());
}

// vLLM's GPT-OSS names its attention `attn` (gpt_oss.py maps HF's .self_attn. to .attn.): the
// vllm_lora local tensors follow; the PEFT (trainer) names keep HF's self_attn.
TEST(LoraPresets, VllmLoraOnGptOssUsesItsAttnNames) {
  ModelConfig c = Config(ReadTestdata("gpt-oss-20b.json"));
  const LoraConfig lora = Adapters({"q_proj", "o_proj"}, 8);
  auto inv = BuildLoraInventory(c, lora, DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_TRUE(TensorIndex(*inv).Find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").has_value());
  auto l = MakeLoraPresetLayout(c, lora, *inv, Par("vllm_lora", 2), 1);
  ASSERT_TRUE(l.ok()) << l.status();
  std::set<std::string> names;
  for (const LocalTensor& lt : l->local_tensors) names.insert(lt.name);
  EXPECT_TRUE(names.count("model.layers.0.attn.qkv_proj.lora_a_stacked.0")) << *names.begin();
  EXPECT_TRUE(names.count("model.layers.0.attn.o_proj.lora_b_stacked.0")) << *names.begin();
  for (const std::string& n : names) EXPECT_FALSE(absl::StrContains(n, "self_attn")) << n;
}

}  // namespace
}  // namespace wb::planner
