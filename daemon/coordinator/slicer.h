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
#include "daemon/coordinator/stored_pieces.h"
#include "planner/packed_layout.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

struct SliceWorker {
  std::string id, node;
  planner::Role role = planner::Role::kTrainer;
  int32_t gpu = 0;
  std::shared_ptr<const planner::PackedLayout> layout;  // unpacked only into the plan's problem
  // The layout as the worker's node resolved it, sent in slices: layout_proto's buffers (and its
  // pieces, if any), then layout_pieces' (the coordinator keeps them there: stored_pieces.h).
  std::shared_ptr<const pb::ResolvedLayout> layout_proto;
  std::shared_ptr<const StoredPieces> layout_pieces;
};

struct SliceNode {
  std::string data_address;
  std::map<std::string, std::string> transport_instances;  // kind or "nccl/<device>" -> instance
  bool sends_deltas = false;  // RegisterNodeRequest.delta_cache_bytes > 0 (TransferOp.delta)
  // RegisterNodeRequest.delta_in_place: the node keeps its quantised rollouts' canonical shadows in
  // the staging it committed, the base of deltas into receiver-quantised pieces.
  bool keeps_shadows = false;
};

struct SliceInput {
  std::string model_id;
  uint64_t epoch = 0;
  pb::Mode mode = pb::MODE_SYNC;
  std::shared_ptr<const planner::Inventory> inventory;
  std::vector<SliceWorker> workers;        // plan worker index order (planner::Problem::workers)
  std::map<std::string, SliceNode> nodes;  // at least every node a worker sits on
  // Lossless deltas (TransferOp.delta, DeltaOps): off for catch-up slices (their sources are
  // rollouts' committed copies, whose destinations hold nothing to diff against).
  bool deltas = true;
};

struct Slices {
  std::map<std::string, pb::PlanSlice> by_node;  // every node a worker of the plan sits on
  uint64_t total_bytes = 0;                      // sum of op bytes (every slice carries it)
  // Filled by SliceOps: what FillSliceHeader needs per node.
  std::map<std::string, std::set<int32_t>> known;  // node -> workers whose layouts it must know
  uint64_t gather_bytes = 0;
};

// INTERNAL if the plan reads a staged (rank-0 gather) box no op stages; otherwise never fails on
// a plan the planner made for these workers.
absl::StatusOr<Slices> SlicePlan(const planner::Plan& plan, const SliceInput& in);

// The same in two steps, so a caller can hold one full slice at a time (a slice's header carries
// the whole inventory and every worker: N full slices of a large model are N x that): SliceOps
// fills only the ops, total_bytes, known and gather_bytes of each node's slice; FillSliceHeader
// adds model, epoch, inventory, stats and workers to one of them.
absl::StatusOr<Slices> SliceOps(const planner::Plan& plan, const SliceInput& in);
// Which ops may travel as lossless deltas (TransferOp.delta; docs/daemon.md "Deltas"), in plan op
// order: cross-node ops not over nccl, from a trainer's host piece on a node that sends deltas to a
// host rollout piece (its scales too) that is unquantised (the op not sender-quantised), filled
// with the sender's quantised bytes (TransferOp.sender_quantized: a delta of the quantised elements
// and of the scales) or receiver-quantised (a delta of the canonical bytes into the piece's shadow,
// decoded against the shadow its node kept in the committed staging, then quantised; only where
// that node keeps them, SliceNode::keeps_shadows), and whose box
// no relay reads from that rollout before the receiving node's delta tail (it would forward bytes
// before their delta is decoded and checked). Relays between host pieces into a box no op reads
// run after the tail - same-node ones left to the commit or in the bucket's after-deltas route,
// ones across nodes in their channel's after-deltas route on both nodes (SliceOps marks them
// TransferOp.after_deltas; daemon/node/exec_plan.h) - so the boxes they read may be deltas; any
// other relay (into a box some op reads, GPU memory) keeps the boxes it reads full. Relays
// themselves go full.
std::vector<bool> DeltaOps(const planner::Plan& plan, const SliceInput& in, const std::vector<bool>& over_nccl);

void FillSliceHeader(const planner::Plan& plan, const SliceInput& in, const Slices& slices, const std::string& node,
                     pb::PlanSlice* slice);

}  // namespace wb::daemon
