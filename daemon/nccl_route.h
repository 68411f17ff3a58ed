#pragma once
// Which cross-node ops of a plan move GPU to GPU on nccl (pb::TransferOp.nccl). Pure: plain values
// in, one flag per op out. The coordinator decides (both nodes of an op must agree, and only the
// coordinator sees every op into a rollout); docs/daemon.md "Cross-node GPU to GPU (nccl)".
//
// Rule: an op is routed over nccl when it crosses nodes, both nodes run nccl (a node advertises
// it only with GPU staging on), it reads a trainer's CUDA buffer and writes a rollout's CUDA
// buffer, and that rollout takes EVERY cross-node op into it this way and is the source of no
// cross-node op (its staging then lives on the GPU, which the host data channel cannot reach).

#include <vector>

namespace wb::daemon {

struct RouteOpFacts {
  int src_worker = 0;
  int dst_worker = 0;
  bool cross_node = false;
  bool src_is_trainer = false;
  bool dst_is_rollout = false;
  bool src_cuda = false;  // the source piece lives in a CUDA buffer (not host memory, not gather staging)
  bool dst_cuda = false;
  bool src_node_nccl = false;  // the node advertises nccl
  bool dst_node_nccl = false;
};

// One flag per op, in order.
std::vector<bool> RouteOverNccl(const std::vector<RouteOpFacts>& ops);

}  // namespace wb::daemon
