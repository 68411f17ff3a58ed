#pragma once
// `wbctl plan --spec FILE [--json]`: plan a spec offline and print its figures (fields of
// ../shared/specs/README.md). Also the shared spec-file loading and reporting used by
// //bench:planner.

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/spec.h"
#include "planner/types.h"

namespace wb::client {

// Reads a spec file; a `model` path is resolved relative to the spec file's directory.
absl::StatusOr<planner::PlanSpec> LoadPlanSpecFile(const std::string& path);

struct PlanReport {
  planner::PlanStats stats;  // of the weightbridge plan, plan_ms filled
  int64_t num_buckets = 0;
  std::string fingerprint;
  double build_ms = 0;  // presets + problem construction
  std::string bottleneck;  // busiest link of the weightbridge plan
  int64_t num_workers = 0;
  int64_t num_pieces = 0;
  int64_t trainers = 0;          // trainer workers
  int64_t trainers_sending = 0;  // trainer workers that are the source of at least one op
  // Baseline name -> predicted makespan_s, in planner::kBaselines order.
  std::vector<std::pair<std::string, double>> baselines;
};

// Builds the problem, plans it (timed with the real clock) and plans every baseline.
absl::StatusOr<PlanReport> ReportForSpec(const planner::PlanSpec& spec);

// One JSON object with the README fields (plus a few extras).
std::string ReportJson(const PlanReport& report);
// Human-readable table.
std::string ReportTable(const PlanReport& report);

// Runs `wbctl plan ARGS...` (args exclude "wbctl" and "plan"). Returns the exit code: 0 success,
// 2 bad usage or bad spec (message on err), 1 planning failure.
int RunPlanCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
