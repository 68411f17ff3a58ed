#pragma once
// Planning for the coordinator, made to run OUTSIDE its lock: a snapshot of a model's membership
// (SliceInput) -> the plan (from the cache or the planner) and the per-node slices. The cache is
// keyed by everything the planner sees (layouts, placement, strategy, topology, bucket budget) and
// is bounded. Thread-safe; PlanAndSlice holds no lock while the planner runs.
// Cancelling (docs/planner.md "Cancelling a plan"): a plan made by
// planner::MakePlanWithOptions (sender-side quantisation, or no PlanFn injected) polls
// Options::cancelled and the plan deadline where the planner meters its work (planner/cancel.h):
// a plan whose job was cancelled ends CANCELLED, one past the deadline DEADLINE_EXCEEDED, both
// naming the model, the time spent and where the planner stopped, and neither is kept in the
// negative cache. An injected PlanFn is not polled (it has no options): it is only checked before
// it starts.

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/coordinator/slicer.h"
#include "planner/types.h"

namespace wb::daemon {

// The planner entry point a test may inject. Empty: planner::MakePlanWithOptions, cancellable.
using PlanFn = std::function<absl::StatusOr<planner::Plan>(const planner::Problem&, planner::Strategy)>;

struct PlanSettings {
  planner::Strategy strategy = planner::Strategy::kWeightBridge;
  pb::Strategy strategy_proto = pb::STRATEGY_UNSPECIFIED;
  planner::Topology topology;
  int64_t bucket_bytes = int64_t{2} << 30;
  // Sender-side quantisation (issue 17.1, planner/sender_quant.h) allowed. PlanAndSlice plans with
  // it only where every source can quantise on send (SenderQuantizationFor); otherwise the plan
  // keeps receiver-side quantisation (canonical bytes into the rollouts' shadows).
  bool sender_quantization = true;
  // A plan with sender-side quantisation gets buckets of at most this many bytes per GPU (wire
  // bytes, below bucket_bytes): the sending node quantises in bucket order and posts a bucket as
  // soon as its own ops are written (node::OutgoingQuantization), so the first bucket leaves after
  // a slice of the quantising instead of all of it, and the rest overlaps the transfer.
  int64_t sender_quantization_bucket_bytes = int64_t{64} << 20;
  // Catch-up plans: sources (ROLE_TRAINER) may be quantised rollouts, whose quantised pieces serve
  // only copies of their quantised bytes (planner::PlanOptions::quantized_sources). Applied when
  // some source holds quantised pieces (planned by planner::MakePlanWithOptions, not the injected
  // PlanFn); excludes sender_quantization.
  bool quantized_sources = false;
};

// Whether PlanAndSlice plans `in` with sender-side quantisation: allowed by `settings`, WeightBridge's
// strategy, some rollout holds quantised pieces, and every source is a trainer whose buffers are
// all host memory (the sending node quantises on its CPU) holding no quantised pieces (a catch-up
// slice's sources are rollouts: they stay receiver-side). A plan made with it is made by
// planner::MakePlanWithOptions, not by the injected PlanFn.
bool SenderQuantizationFor(const SliceInput& in, const PlanSettings& settings);

struct PlanOutcome {
  std::shared_ptr<const planner::Plan> plan;
  Slices slices;
  bool cached = false;
};

// The plan deadline by default: generous (the largest plans measured take under 10 s of one core,
// docs/planner.md "Work bounds"; a plan past it is hostile or the machine is starved).
inline constexpr absl::Duration kDefaultPlanDeadline = absl::Seconds(120);

class PlanCache {
 public:
  struct Options {
    size_t max_entries = 64;   // plans kept (all forgotten when full)
    size_t max_failures = 64;  // failed keys kept (the negative cache, below)
    // A plan (coverage check + planner) still running this long after it started is abandoned:
    // DEADLINE_EXCEEDED "model M: plan abandoned after 120.2s, past the plan deadline of 2m (planner
    // stopped building the weightbridge ops: fragment ... of ..., ... ops built)". <= 0 or infinite:
    // none. The coordinator's CoordinatorOptions::plan_deadline (flag --plan_deadline_s).
    absl::Duration plan_deadline = kDefaultPlanDeadline;
    // Whether the plan running on the calling thread should stop: nullopt to go on, else why
    // (CANCELLED "model M: plan cancelled after 1.2s: WHY (planner stopped ...)"). The coordinator
    // passes PlanQueue::CurrentJobCancelled: its planner thread's job, cancelled when a newer plan
    // of the model is queued or at shutdown. Called from PlanAndSlice's thread, without any lock of
    // the cache. Empty: never.
    std::function<std::optional<std::string>()> cancelled;
    // The clock the deadline reads (tests); empty: absl::Now.
    std::function<absl::Time()> now;
  };
  explicit PlanCache(Options options) : options_(std::move(options)) {}

  // Negative cache: a layout set whose coverage check or planning failed fails again at once, with
  // the same error, instead of being planned again (a hostile layout just under the planner's work
  // budgets would otherwise hold the one planner thread once more each time it is re-submitted).
  // At most max_failures are kept, the oldest forgotten first. Errors that may pass on another try
  // (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE, ABORTED) are never kept.
  explicit PlanCache(size_t max_entries = 64, size_t max_failures = 64) : PlanCache(Options{max_entries, max_failures}) {}

  // Problem from the snapshot (node index = order of node ids; gpu = the worker's gpu, or for host
  // workers (gpu < 0) a slot of its own above every real gpu), coverage check, cache (plans and
  // failures) or planner, then SliceOps: the caller adds each slice's header (FillSliceHeader)
  // when it sends it, so only the slices in flight are held whole. Errors name the model.
  // `make_plan` empty: planner::MakePlanWithOptions, polling Options::cancelled and the deadline
  // (so does a plan with sender-side quantisation); otherwise make_plan, checked only before it
  // starts.
  absl::StatusOr<PlanOutcome> PlanAndSlice(const SliceInput& in, const PlanSettings& settings, const PlanFn& make_plan);

  size_t size() const;
  size_t failures() const;

 private:
  // Remembers a failed key (see max_failures).
  void RememberFailure(const std::string& key, const absl::Status& status);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const planner::Plan>> plans_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> failed_order_ ABSL_GUARDED_BY(mu_);  // failed_'s keys, oldest first
};

}  // namespace wb::daemon
