#pragma once
// Element-by-element plan checker for tests (small problems only: it allocates per element).
// Independent of the planner's fragment machinery: it replays the ops bucket by bucket.

#include "absl/status/status.h"
#include "planner/types.h"

namespace wb::planner {

struct CheckOptions {
  bool require_no_redundancy = true;  // at most one network delivery per element per node
  bool allow_staging = false;         // rank0_broadcast: dst_piece/src_piece -1 via trainer staging
  bool check_budget = true;           // per bucket, per GPU slot: sent and received <= budget
};

// OK when: every op's tensor/box/bytes/route is consistent; its source piece holds the box (or,
// for a relay, the source rollout piece had every element written in an earlier bucket); its
// destination piece contains the box; no destination element is written twice; every destination
// element is written; (optionally) no element enters a node over the network twice; buckets
// respect the staging budget (counting the bytes ops move, TransferOp::wire_bytes); a
// sender-quantised op moves exactly the quantised bytes of a box on its destination piece's block
// grid, all ops into a piece agree on that, and a relay reads a piece in the form it was delivered
// in (quantised bytes only into the same format). Otherwise an error describing the first violation.
absl::Status CheckPlanElementwise(const Problem& problem, const Plan& plan,
                                  const CheckOptions& options);

}  // namespace wb::planner
