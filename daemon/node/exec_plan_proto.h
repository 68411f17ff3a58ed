#pragma once
// The edge between the node's installed plan (pb::PlanSlice) and the pure exec plan's value types.

#include <vector>

#include "daemon/node/exec_plan.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon::node {

// `layouts` (the staging layouts transfers address), `quantized` and `inventory` are the node's
// resolved view of the slice (node::ModelPlan, daemon/node/versions.h); `inventory` must outlive the result.
// `live_layouts`: the workers' own layouts (Slice::live_layouts; sender-quantised ops need them).
Slice SliceFromProto(const ::weightbridge::v1::PlanSlice& slice, const std::vector<planner::WorkerLayout>& layouts,
                     const std::vector<bool>& quantized, bool hosts_gather, const planner::Inventory& inventory,
                     const std::vector<planner::WorkerLayout>& live_layouts = {});

}  // namespace wb::daemon::node
