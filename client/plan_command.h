#pragma once
// `wbctl plan --spec FILE [--json] [--quantization NAME] [--receiver_quantization]`: plan a spec
// offline and print its figures (fields of examples/specs/README.md). Also the shared spec-file
// loading and reporting used by //bench:planner.
//
// Quantised rollouts (spec `rollout.quantization` or --quantization): the prediction plans with
// sender-side quantisation (planner::PlanOptions::sender_quantization: ops on the destination's
// block grid carry fp8 / int4 plus scales) unless --receiver_quantization asks for the plan today's
// node daemons execute (the coordinator plans with it off; docs/planner.md).

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
  std::string quantization;          // the rollout preset's ("" none)
  bool sender_quantization = false;  // planned with sender-side quantisation
  // When some ops were sender-quantised: the same problem planned with receiver-side quantisation
  // (canonical bytes on the wire, as the daemons execute today). -1 otherwise.
  double receiver_quantized_makespan_s = -1;
  double receiver_quantized_lower_bound_s = -1;
};

// Builds the problem, plans it (timed with the real clock) and plans every baseline, all with
// `sender_quantization` (which changes nothing without quantised rollout pieces).
absl::StatusOr<PlanReport> ReportForSpec(const planner::PlanSpec& spec, bool sender_quantization = true);

// Applies a --quantization value ("none" = ""); INVALID_ARGUMENT naming the flag when unknown.
absl::Status OverrideQuantization(const std::string& name, planner::PlanSpec& spec);

// One JSON object with the README fields (plus a few extras).
std::string ReportJson(const PlanReport& report);
// Human-readable table.
std::string ReportTable(const PlanReport& report);

// Runs `wbctl plan ARGS...` (args exclude "wbctl" and "plan"). Returns the exit code: 0 success,
// 2 bad usage or bad spec (message on err), 1 planning failure.
int RunPlanCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
