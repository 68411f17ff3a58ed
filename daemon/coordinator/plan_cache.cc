#include "daemon/coordinator/plan_cache.h"

#include <algorithm>
#include <optional>
#include <string>

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "planner/planner.h"
#include "planner/quantized.h"
#include "planner/validate.h"
#include "base/status_macros.h"

namespace wb::daemon {

bool SenderQuantizationFor(const SliceInput& in, const PlanSettings& settings) {
  if (!settings.sender_quantization || settings.strategy != planner::Strategy::kWeightBridge) return false;
  bool quantized_rollout = false;
  for (const SliceWorker& w : in.workers) {
    if (w.layout == nullptr) return false;
    if (w.role == planner::Role::kRollout) {
      quantized_rollout = quantized_rollout || w.layout->HasQuantizedPieces();
      continue;
    }
    if (w.layout->HasQuantizedPieces() || w.layout_proto == nullptr) return false;
    for (const pb::BufferSpec& b : w.layout_proto->buffers()) {
      if (b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey) return false;
    }
  }
  return quantized_rollout;
}

absl::StatusOr<PlanOutcome> PlanCache::PlanAndSlice(const SliceInput& in, const PlanSettings& settings, const PlanFn& make_plan) {
  planner::Problem problem;
  problem.inventory = *in.inventory;
  problem.topology = settings.topology;
  problem.staging_budget_bytes = settings.bucket_bytes;
  std::map<std::string, int32_t> node_index;
  for (const SliceWorker& w : in.workers) node_index.emplace(w.node, 0);
  int32_t next_node = 0;
  for (auto& [n, idx] : node_index) idx = next_node++;
  std::map<std::string, int32_t> host_slots;  // node -> next host slot
  // Cache key: everything the planner sees.
  std::string key_src = absl::StrCat(in.model_id, "|", static_cast<int>(settings.strategy_proto), "|", settings.topology.intra_node_GBps,
                                     "/", settings.topology.nic_GBps_per_gpu, "/", settings.topology.colocated, "/", settings.bucket_bytes);
  const bool sender_quantization = SenderQuantizationFor(in, settings);
  if (sender_quantization && settings.sender_quantization_bucket_bytes > 0) {
    problem.staging_budget_bytes = std::min(problem.staging_budget_bytes, settings.sender_quantization_bucket_bytes);
  }
  absl::StrAppend(&key_src, sender_quantization ? absl::StrCat("|sq", problem.staging_budget_bytes) : "");
  bool quantized_sources = false;
  if (settings.quantized_sources && !sender_quantization) {
    for (const SliceWorker& w : in.workers) {
      quantized_sources = quantized_sources || (w.role == planner::Role::kTrainer && w.layout != nullptr && w.layout->HasQuantizedPieces());
    }
  }
  absl::StrAppend(&key_src, quantized_sources ? "|qs" : "");
  for (const SliceWorker& w : in.workers) {
    planner::Worker pw;
    pw.id = w.id;
    pw.role = w.role;
    pw.node = node_index.at(w.node);
    pw.gpu = w.gpu >= 0 ? w.gpu : 1024 + host_slots[w.node]++;
    // pw.layout is unpacked below, only when the plan is not cached.
    // The role too: a catch-up plan (catch_up.cc) has rollouts as sources, so the same ids with the
    // same layouts may be a source in one plan and a destination in another.
    absl::StrAppend(&key_src, "|", w.id, "@", pw.node, ":", pw.gpu, ":", static_cast<int>(w.role), ":", w.layout_proto->SerializeAsString());
    if (w.layout_pieces != nullptr) w.layout_pieces->AppendSerialized(&key_src);  // the whole layout's bytes, as before
    problem.workers.push_back(std::move(pw));
  }
  const std::string key = absl::StrCat(absl::Hex(XXH3_64bits(key_src.data(), key_src.size())));
  PlanOutcome out;
  {
    absl::MutexLock l(&mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      out.plan = it->second;
      out.cached = true;
    }
    if (auto f = failed_.find(key); f != failed_.end()) return f->second;  // failed before: at once
  }
  if (!out.plan) {
    // Cancellation and the deadline (Options): checked before the coverage check and before the
    // planner starts, and polled by the planner (MakePlanWithOptions) as it works.
    auto clock = [this] { return options_.now ? options_.now() : absl::Now(); };
    const absl::Time start = clock();
    const absl::Duration deadline = options_.plan_deadline;
    const bool has_deadline = deadline > absl::ZeroDuration() && deadline != absl::InfiniteDuration();
    planner::CancelCheck check = [&, this]() -> absl::Status {
      if (options_.cancelled) {
        if (std::optional<std::string> why = options_.cancelled()) {
          return absl::CancelledError(absl::StrCat("model ", in.model_id, ": plan cancelled after ",
                                                   absl::FormatDuration(clock() - start), ": ", *why));
        }
      }
      if (has_deadline) {
        if (const absl::Duration spent = clock() - start; spent > deadline) {
          return absl::DeadlineExceededError(absl::StrCat("model ", in.model_id, ": plan abandoned after ", absl::FormatDuration(spent),
                                                          ", past the plan deadline of ", absl::FormatDuration(deadline)));
        }
      }
      return absl::OkStatus();
    };
    if (absl::Status go = check(); !go.ok()) return go;
    // The planner's form of each layout, exactly as resolved (planner/packed_layout.h): the
    // coordinator keeps it packed; the plan's problem holds it unpacked only while it is planned.
    for (size_t i = 0; i < in.workers.size(); ++i) {
      if (in.workers[i].layout != nullptr) problem.workers[i].layout = in.workers[i].layout->Unpack();
    }
    std::vector<const planner::Worker*> sources, destinations;
    for (const planner::Worker& w : problem.workers) (w.role == planner::Role::kTrainer ? sources : destinations).push_back(&w);
    if (absl::Status covered = planner::ValidateCoverage(problem.inventory, sources, destinations); !covered.ok()) {
      covered = Annotate(covered, absl::StrCat("model ", in.model_id));
      RememberFailure(key, covered);
      return covered;
    }
    if (absl::Status go = check(); !go.ok()) return go;  // the coverage check is bounded (~1 s), not polled
    const absl::Time t0 = absl::Now();
    absl::StatusOr<planner::Plan> plan;
    if (sender_quantization || quantized_sources || !make_plan) {
      planner::PlanOptions options;
      options.sender_quantization = sender_quantization;
      options.quantized_sources = quantized_sources;
      if (options_.cancelled || has_deadline) options.cancel = check;
      plan = planner::MakePlanWithOptions(problem, settings.strategy, options);
    } else {
      plan = make_plan(problem, settings.strategy);
    }
    if (!plan.ok()) {
      RememberFailure(key, plan.status());
      return plan.status();
    }
    plan->stats.plan_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    out.plan = std::make_shared<const planner::Plan>(std::move(*plan));
    absl::MutexLock l(&mu_);
    if (plans_.size() >= options_.max_entries) plans_.clear();
    plans_[key] = out.plan;
  }
  ASSIGN_OR_RETURN(out.slices, SliceOps(*out.plan, in));
  return out;
}

size_t PlanCache::size() const {
  absl::MutexLock l(&mu_);
  return plans_.size();
}

size_t PlanCache::failures() const {
  absl::MutexLock l(&mu_);
  return failed_.size();
}

void PlanCache::RememberFailure(const std::string& key, const absl::Status& status) {
  if (options_.max_failures == 0 || absl::IsCancelled(status) || absl::IsDeadlineExceeded(status) || absl::IsUnavailable(status) ||
      absl::IsAborted(status)) {
    return;
  }
  absl::MutexLock l(&mu_);
  if (!failed_.emplace(key, status).second) return;
  failed_order_.push_back(key);
  while (failed_.size() > options_.max_failures) {
    failed_.erase(failed_order_.front());
    failed_order_.pop_front();
  }
}

}  // namespace wb::daemon
