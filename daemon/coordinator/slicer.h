#pragma once
// The coordinator's plan slicer: a plan and the workers/nodes it was made for -> one PlanSlice per
// node (the ops that node sends or receives, the layouts it must know, nccl lanes, the rank-0
// gather staging). PURE: no I/O, no locks, no clock; the driver runs it outside the coordinator's
// lock on a snapshot of the model's membership.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

struct SliceWorker {
  std::string id, node;
  planner::Role role = planner::Role::kTrainer;
  int32_t gpu = 0;
  std::shared_ptr<const planner::WorkerLayout> layout;
  std::shared_ptr<const pb::ResolvedLayout> layout_proto;
};

struct SliceNode {
  std::string data_address;
  std::map<std::string, std::string> transport_instances;  // kind or "nccl/<device>" -> instance
};

struct SliceInput {
  std::string model_id;
  uint64_t epoch = 0;
  pb::Mode mode = pb::MODE_SYNC;
  std::shared_ptr<const planner::Inventory> inventory;
  std::vector<SliceWorker> workers;        // plan worker index order (planner::Problem::workers)
  std::map<std::string, SliceNode> nodes;  // at least every node a worker sits on
};

struct Slices {
  std::map<std::string, pb::PlanSlice> by_node;  // every node a worker of the plan sits on
  uint64_t total_bytes = 0;                      // sum of op bytes (every slice carries it)
};

// INTERNAL if the plan reads a staged (rank-0 gather) box no op stages; otherwise never fails on
// a plan the planner made for these workers.
absl::StatusOr<Slices> SlicePlan(const planner::Plan& plan, const SliceInput& in);

}  // namespace wb::daemon
