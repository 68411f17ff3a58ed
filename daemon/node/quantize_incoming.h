#pragma once
// Quantised rollouts (docs/daemon.md "Quantized targets"): once every byte of a version landed in a
// rollout's incoming (host) staging, each quantised piece is quantised from its canonical-dtype
// shadow (planner::StagingLayout) into its place and scales in the same staging, on a few threads,
// before the node reports the version transferred.

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/node/live_copy.h"
#include "planner/types.h"

namespace wb::daemon::node {

// One local quantised rollout's incoming staging.
struct QuantizeTarget {
  std::string worker;
  const planner::WorkerLayout* live = nullptr;    // the worker's own layout (quantised pieces + scales)
  const planner::WorkerLayout* shadow = nullptr;  // the staging layout the bytes landed in
  StagedBytes* staging = nullptr;                 // host buffers; must stay alive during the call
  // Pieces (indices into `live`) that arrived quantised by their senders (issue 17.1,
  // ExecPlan::quant_pieces_in): already in place, not quantised again. May be null.
  const std::set<int32_t>* sender_quantized = nullptr;
};

struct QuantizeResult {
  int64_t pieces = 0;
  int64_t bytes = 0;  // canonical bytes read
  double seconds = 0;
  int threads = 0;
};

// INTERNAL naming the rollout (and tensor) when staging cannot hold a quantised piece or is not in
// host memory; DEADLINE_EXCEEDED when `deadline` passes first.
absl::StatusOr<QuantizeResult> QuantizeStaging(const planner::Inventory& inventory, const std::vector<QuantizeTarget>& targets,
                                               uint64_t version, absl::Time deadline);

}  // namespace wb::daemon::node
