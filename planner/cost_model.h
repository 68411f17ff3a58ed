#pragma once
// The link cost model and the link-capacity lower bound (see docs/planner.md).
//
// Links, all per GPU slot (a (node, gpu) pair; colocated trainer and rollout workers share one):
//   NIC egress and NIC ingress at topology.nic_GBps_per_gpu (kInterNode ops),
//   intra-node egress and ingress at topology.intra_node_GBps (kIntraNode ops),
//   one device-local copy link at topology.same_gpu_GBps (kSameGpu ops).
// Predicted makespan = max over links of (bytes the plan puts on the link / its bandwidth), summed
// over all buckets. That assumes buckets pipeline perfectly (a link never idles waiting for an
// earlier hop), so it is the steady-state figure, not a latency model.

#include <cstdint>
#include <string>
#include <vector>

#include "planner/fragments.h"
#include "planner/types.h"

namespace wb::planner {

// Dense numbering of the GPU slots of a problem, sorted by (node, gpu).
struct ClusterIndex {
  std::vector<int32_t> worker_slot;  // per worker
  std::vector<int32_t> worker_node;  // per worker
  std::vector<int32_t> slot_node;    // per slot
  std::vector<int32_t> slot_gpu;     // per slot
  std::vector<int32_t> node_slots;   // per node index (0..max node): GPU slots in use on it
  std::vector<uint8_t> node_has_rollout;
  std::vector<uint8_t> node_has_trainer;
  int32_t num_slots = 0;
};
ClusterIndex IndexCluster(const Problem& problem);

// Which links an op between two slots uses.
Route RouteBetween(const ClusterIndex& ci, int32_t src_worker, int32_t dst_worker);

// Bytes per link, indexed by slot.
struct LinkLoads {
  std::vector<int64_t> nic_out, nic_in, intra_out, intra_in, same_gpu;
  explicit LinkLoads(int32_t num_slots = 0)
      : nic_out(num_slots), nic_in(num_slots), intra_out(num_slots), intra_in(num_slots),
        same_gpu(num_slots) {}
  void Add(Route route, int32_t src_slot, int32_t dst_slot, int64_t bytes);
};

// Bytes an op moves: its wire bytes (sender-side quantisation) when set, else its canonical bytes.
inline int64_t OpWireBytes(const TransferOp& op) { return op.wire_bytes > 0 ? op.wire_bytes : op.bytes; }

// Loads of every op of `plan` (routes as recorded in the ops, bytes as moved: OpWireBytes).
LinkLoads AccumulateLoads(const ClusterIndex& ci, const Plan& plan);

// max over links of bytes / bandwidth, in seconds. `bottleneck`, when given, names the link.
double MakespanOf(const LinkLoads& loads, const ClusterIndex& ci, const Topology& topo,
                  std::string* bottleneck = nullptr);

// Predicted makespan of `plan` for `problem` under the model above.
double PredictMakespan(const Problem& problem, const Plan& plan);

// Link-capacity lower bound in seconds: the max over these links of the bytes that must cross
// them (each a valid bound for any plan whose ops read source/destination pieces as TransferOp
// requires and copy same-node bytes inside the node):
//  - NIC ingress of each destination node: distinct bytes its GPUs need that no GPU on the node
//    holds, spread over all its GPUs' NICs;
//  - NIC ingress of one GPU: such bytes that only this GPU of its node needs;
//  - intra-node ingress of one GPU: bytes it needs that another GPU of its node holds (and its own
//    GPU does not);
//  - total ingress of one GPU: the distinct bytes it needs and does not hold itself enter it over
//    its NIC or its intra-node link, so they take at least bytes / (NIC + intra-node bandwidth)
//    (valid for every plan: an op writes its destination's GPU over exactly one of its links);
//    with the bytes its own GPU holds, over NIC + intra-node + same-GPU bandwidth;
//  - egress of each exact set of source GPUs (when no rollout shares their nodes), of each source
//    node, and of all source nodes together: every byte needed on a node without a holder leaves
//    its holders at least once.
// Returns 0 for a problem with nothing to move, and -1 for a problem BuildFragments rejects (call
// MakePlan for the error message).
// `sender_quantization`: the bound of plans made with PlanOptions::sender_quantization (fragments
// that travel quantised count their quantised bytes, planner/sender_quant.h).
double LowerBound(const Problem& problem, bool sender_quantization = false);
// `wire_bytes` (one per fragment: the bytes each of its ops moves) replaces Fragment::bytes when
// given.
double LowerBoundOfFragments(const Problem& problem, const ClusterIndex& ci, const FragmentSet& fs,
                             const std::vector<int64_t>* wire_bytes = nullptr);

}  // namespace wb::planner
