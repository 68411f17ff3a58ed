// PlanCache: a plan with sender-side quantisation gets buckets of at most
// PlanSettings::sender_quantization_bucket_bytes per GPU, so the sending node's quantising
// pipelines with the transfer (issue 17.1); a canonical plan keeps bucket_bytes.
#include "daemon/coordinator/plan_cache.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "daemon/coordinator/test_specs.h"

#include "planner/planner.h"

namespace wb::daemon {
namespace {

using testing::BigSliceInput;

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
    auto l = std::make_shared<planner::WorkerLayout>();  // packed below
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
    return *planner::PackedLayout::PackShared(*l);
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
  in.workers.push_back({"t", "n0", planner::Role::kTrainer, -1, tl, proto(tl->buffers()[0].size_bytes)});
  in.workers.push_back({"r", "n1", planner::Role::kRollout, -1, rl, proto(rl->buffers()[0].size_bytes)});
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

// The cache key holds every byte of each worker's layout as it was resolved, its stored pieces
// (stored_pieces.h) too: layouts differing only there are planned apart, the same ones hit.
TEST(PlanCacheTest, LayoutsDifferingOnlyInTheirStoredPiecesArePlannedApart) {
  PlanCache cache;
  PlanSettings settings;
  SliceInput in = Input(false);
  auto stored = [&](uint64_t offset) {
    google::protobuf::RepeatedPtrField<pb::Piece> pieces;
    const planner::PackedLayout& l = *in.workers[1].layout;
    for (size_t i = 0; i < l.num_pieces(); ++i) {
      pb::Piece* q = pieces.Add();
      q->set_tensor(in.inventory->tensors[l.tensor(i)].name);
      q->set_offset_bytes(offset + static_cast<uint64_t>(l.offset_bytes(i)));
    }
    absl::StatusOr<std::shared_ptr<const StoredPieces>> out = StoredPieces::Make(pieces, *in.workers[1].layout, in.inventory);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : nullptr;
  };
  in.workers[1].layout_pieces = stored(0);
  absl::StatusOr<PlanOutcome> first = cache.PlanAndSlice(in, settings, planner::MakePlan);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->cached);
  in.workers[1].layout_pieces = stored(0);
  absl::StatusOr<PlanOutcome> same = cache.PlanAndSlice(in, settings, planner::MakePlan);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->cached) << "equal bytes: the cached plan";
  in.workers[1].layout_pieces = stored(64);
  absl::StatusOr<PlanOutcome> other = cache.PlanAndSlice(in, settings, planner::MakePlan);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE(other->cached) << "other pieces: planned, not the cached plan";
}

// Negative cache: a layout set that failed fails again at once with the same error (the planner
// is not called), at most max_failures are kept (the oldest forgotten first), and errors that may
// pass on another try are not kept.
TEST(PlanCacheTest, ALayoutSetThatFailedFailsAgainAtOnceBoundedInNumber) {
  PlanCache cache(/*max_entries=*/64, /*max_failures=*/2);
  PlanSettings settings;
  int calls = 0;
  absl::StatusCode code = absl::StatusCode::kResourceExhausted;
  PlanFn failing = [&](const planner::Problem&, planner::Strategy) -> absl::StatusOr<planner::Plan> {
    ++calls;
    return absl::Status(code, "work budget exceeded #" + std::to_string(calls));
  };
  auto input = [](const std::string& model) {
    SliceInput in = Input(false);
    in.model_id = model;  // part of the cache key: one layout set per model here
    return in;
  };
  absl::StatusOr<PlanOutcome> first = cache.PlanAndSlice(input("m1"), settings, failing);
  ASSERT_EQ(first.status().code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<PlanOutcome> again = cache.PlanAndSlice(input("m1"), settings, failing);
  EXPECT_EQ(again.status(), first.status()) << "the same error";
  EXPECT_EQ(calls, 1) << "without planning again";

  ASSERT_FALSE(cache.PlanAndSlice(input("m2"), settings, failing).ok());
  ASSERT_FALSE(cache.PlanAndSlice(input("m3"), settings, failing).ok());
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(cache.failures(), 2u) << "bounded";
  absl::StatusOr<PlanOutcome> forgotten = cache.PlanAndSlice(input("m1"), settings, failing);
  EXPECT_EQ(calls, 4) << "the oldest failure was forgotten: planned again";
  EXPECT_EQ(forgotten.status().message(), "work budget exceeded #4");
  ASSERT_FALSE(cache.PlanAndSlice(input("m3"), settings, failing).ok());
  EXPECT_EQ(calls, 4) << "a newer failure is still remembered";

  // A failure that may pass on another try is planned again each time; a layout set that plans is
  // cached as a plan, never as a failure.
  code = absl::StatusCode::kDeadlineExceeded;
  ASSERT_FALSE(cache.PlanAndSlice(input("m5"), settings, failing).ok());
  ASSERT_FALSE(cache.PlanAndSlice(input("m5"), settings, failing).ok());
  EXPECT_EQ(calls, 6);
  ASSERT_TRUE(cache.PlanAndSlice(input("m6"), settings, planner::MakePlan).ok());
  absl::StatusOr<PlanOutcome> cached = cache.PlanAndSlice(input("m6"), settings, failing);
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_TRUE(cached->cached);
  EXPECT_EQ(calls, 6);
}

// The coverage check's failure (a trainer layout with a hole) is remembered too.
TEST(PlanCacheTest, ACoverageFailureIsRemembered) {
  PlanCache cache;
  PlanSettings settings;
  int calls = 0;
  PlanFn counting = [&](const planner::Problem& p, planner::Strategy s) {
    ++calls;
    return planner::MakePlan(p, s);
  };
  SliceInput in = Input(false);
  planner::WorkerLayout holed = in.workers[0].layout->Unpack();
  holed.pieces.pop_back();  // the trainer no longer holds the last tensor
  in.workers[0].layout = *planner::PackedLayout::PackShared(holed);
  absl::StatusOr<PlanOutcome> first = cache.PlanAndSlice(in, settings, counting);
  ASSERT_FALSE(first.ok());
  EXPECT_NE(first.status().message().find("model m: "), absl::string_view::npos) << first.status();
  EXPECT_EQ(cache.PlanAndSlice(in, settings, counting).status(), first.status());
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(cache.failures(), 1u);
}

// ---- Cancelling a plan (Options::cancelled, plan_deadline) ----

// A plan whose job is cancelled mid-way (Options::cancelled says why from its 6th call: the coverage
// check and the planner's start went by) stops at that call, CANCELLED naming the model, the time
// spent, the reason and where the planner was; it is not remembered as a failure, and the next
// request plans. With no PlanFn the plan is MakePlanWithOptions's; an injected PlanFn is only
// checked before it starts.
TEST(PlanCacheTest, ACancelledPlanStopsWhereThePlannerWasAndTheNextOnePlans) {
  int calls = 0, stop_from = 6;
  PlanCache::Options o;
  o.cancelled = [&]() -> std::optional<std::string> {
    ++calls;
    if (stop_from > 0 && calls >= stop_from) return std::string("a newer plan job of the model is queued");
    return std::nullopt;
  };
  PlanCache cache(o);
  PlanSettings settings;
  const SliceInput in = BigSliceInput("m", 4096);
  absl::StatusOr<PlanOutcome> stopped = cache.PlanAndSlice(in, settings, PlanFn());
  ASSERT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
  EXPECT_EQ(calls, stop_from) << "stopped at the call that said so";
  EXPECT_TRUE(absl::StartsWith(stopped.status().message(), "model m: plan cancelled after ")) << stopped.status();
  EXPECT_NE(stopped.status().message().find(": a newer plan job of the model is queued (planner stopped building "), std::string::npos)
      << stopped.status();
  EXPECT_EQ(cache.failures(), 0u) << "a cancelled plan may pass on another try";
  EXPECT_EQ(cache.size(), 0u);

  // Not cancelled: the same layout set plans (the planner polled all along), and is cached.
  stop_from = 0;
  calls = 0;
  absl::StatusOr<PlanOutcome> next = cache.PlanAndSlice(in, settings, PlanFn());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(next->cached);
  EXPECT_EQ(next->plan->stats.num_ops, 4096 * 16);
  EXPECT_GT(calls, 8) << "polled as the planner works";
  PlanCache uncancellable;
  absl::StatusOr<PlanOutcome> plain = uncancellable.PlanAndSlice(in, settings, planner::MakePlan);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(next->plan->fingerprint, plain->plan->fingerprint) << "the polls change nothing";

  // An injected PlanFn has no options: checked before it starts, not polled.
  int fn_calls = 0;
  PlanFn fn = [&](const planner::Problem& p, planner::Strategy s) {
    ++fn_calls;
    return planner::MakePlan(p, s);
  };
  SliceInput other = BigSliceInput("m", 64);
  stop_from = 1;
  calls = 0;
  absl::StatusOr<PlanOutcome> before = cache.PlanAndSlice(other, settings, fn);
  EXPECT_EQ(before.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(fn_calls, 0);
  stop_from = 0;
  ASSERT_TRUE(cache.PlanAndSlice(other, settings, fn).ok());
  EXPECT_EQ(fn_calls, 1);
}

// Past the plan deadline (a clock that advances 1 s per reading, a 10 s deadline): abandoned,
// DEADLINE_EXCEEDED naming the model, the time spent, the deadline and where the planner was; not
// remembered. Without a deadline (0) the same clock plans.
TEST(PlanCacheTest, APlanPastTheDeadlineIsAbandoned) {
  absl::Time t = absl::UnixEpoch();
  PlanCache::Options o;
  o.plan_deadline = absl::Seconds(10);
  o.now = [&] { return t += absl::Seconds(1); };
  PlanCache cache(o);
  absl::StatusOr<PlanOutcome> late = cache.PlanAndSlice(BigSliceInput("m", 4096), PlanSettings(), PlanFn());
  ASSERT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_TRUE(absl::StartsWith(late.status().message(), "model m: plan abandoned after 11s, past the plan deadline of 10s (planner stopped "))
      << late.status();
  EXPECT_EQ(cache.failures(), 0u);

  o.plan_deadline = absl::ZeroDuration();
  PlanCache unbounded(o);
  ASSERT_TRUE(unbounded.PlanAndSlice(BigSliceInput("m", 4096), PlanSettings(), PlanFn()).ok());
}

}  // namespace
}  // namespace wb::daemon
