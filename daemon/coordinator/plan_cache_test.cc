// PlanCache: a plan with sender-side quantisation gets buckets of at most
// PlanSettings::sender_quantization_bucket_bytes per GPU, so the sending node's quantising
// pipelines with the transfer (issue 17.1); a canonical plan keeps bucket_bytes.
#include "daemon/coordinator/plan_cache.h"

#include <gtest/gtest.h>

#include "planner/planner.h"

namespace wb::daemon {
namespace {

constexpr int kTensors = 4;
constexpr int64_t kRows = 128, kCols = 256;  // one 128x128-block row: 64 KiB bf16, ~32 KiB fp8

// Trainer t (host memory, n0) holds kTensors bf16 tensors; rollout r (n1) holds them fp8_block128
// when `quantised`, bf16 otherwise.
SliceInput Input(bool quantised) {
  auto inv = std::make_shared<planner::Inventory>();
  for (int i = 0; i < kTensors; ++i) {
    inv->tensors.push_back({"model.layers." + std::to_string(i) + ".mlp.down_proj.weight", {kRows, kCols}, planner::DType::kBF16});
  }
  auto layout = [&](bool quant) {
    auto l = std::make_shared<planner::WorkerLayout>();
    const int64_t elements = quant ? kRows * kCols : kRows * kCols * 2;
    const int64_t scales = quant ? (kRows / 128) * (kCols / 128) * 4 : 0;
    for (int i = 0; i < kTensors; ++i) {
      planner::Piece p;
      p.tensor = i;
      p.buffer = 0;
      p.box = {{0, 0}, {kRows, kCols}};
      p.strides = {kCols, 1};
      p.offset_bytes = i * (elements + scales);
      if (quant) p.quant = planner::Quantization{planner::DType::kF8E4M3, {128, 128}, 0, p.offset_bytes + elements, planner::DType::kF32};
      l->pieces.push_back(p);
    }
    l->buffers.push_back({kTensors * (elements + scales)});
    return l;
  };
  auto proto = [](int64_t size) {
    auto p = std::make_shared<pb::ResolvedLayout>();
    pb::BufferSpec* b = p->add_buffers();
    b->set_size_bytes(static_cast<uint64_t>(size));
    b->set_shm_name("/wb-test");
    b->set_gpu(-1);
    return p;
  };
  SliceInput in;
  in.model_id = "m";
  in.inventory = inv;
  auto tl = layout(false), rl = layout(quantised);
  in.workers.push_back({"t", "n0", planner::Role::kTrainer, -1, tl, proto(tl->buffers[0].size_bytes)});
  in.workers.push_back({"r", "n1", planner::Role::kRollout, -1, rl, proto(rl->buffers[0].size_bytes)});
  in.nodes["n0"] = {};
  in.nodes["n1"] = {};
  return in;
}

int64_t SenderQuantisedOps(const planner::Plan& plan) {
  int64_t n = 0;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) n += op.sender_quantized;
  }
  return n;
}

TEST(PlanCacheTest, SenderQuantisedPlansGetSmallBucketsSoQuantisingPipelines) {
  PlanCache cache;
  PlanSettings settings;
  settings.bucket_bytes = int64_t{2} << 30;
  settings.sender_quantization_bucket_bytes = 40 << 10;  // about one tensor's quantised bytes
  const SliceInput quantised = Input(true);
  ASSERT_TRUE(SenderQuantizationFor(quantised, settings));
  absl::StatusOr<PlanOutcome> capped = cache.PlanAndSlice(quantised, settings, planner::MakePlan);
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(SenderQuantisedOps(*capped->plan), kTensors);
  EXPECT_EQ(capped->plan->buckets.size(), static_cast<size_t>(kTensors));  // one tensor per bucket

  // Without the cap (0: off) the 2 GiB budget holds everything in one bucket; a different plan,
  // not the cached one.
  settings.sender_quantization_bucket_bytes = 0;
  absl::StatusOr<PlanOutcome> whole = cache.PlanAndSlice(quantised, settings, planner::MakePlan);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_FALSE(whole->cached);
  EXPECT_EQ(SenderQuantisedOps(*whole->plan), kTensors);
  EXPECT_EQ(whole->plan->buckets.size(), 1u);
}

TEST(PlanCacheTest, CanonicalPlansKeepTheBucketBudget) {
  PlanCache cache;
  PlanSettings settings;
  settings.bucket_bytes = int64_t{2} << 30;
  settings.sender_quantization_bucket_bytes = 40 << 10;
  const SliceInput bf16 = Input(false);
  ASSERT_FALSE(SenderQuantizationFor(bf16, settings));
  absl::StatusOr<PlanOutcome> out = cache.PlanAndSlice(bf16, settings, planner::MakePlan);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(SenderQuantisedOps(*out->plan), 0);
  EXPECT_EQ(out->plan->buckets.size(), 1u);
}

}  // namespace
}  // namespace wb::daemon
