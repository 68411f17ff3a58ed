#pragma once
// Which cross-node ops of a plan move GPU to GPU on nccl (pb::TransferOp.nccl). Pure: plain values
// in, one flag per op out. The coordinator decides (both nodes of an op must agree, and only the
// coordinator sees every op into a rollout); docs/daemon.md "Cross-node GPU to GPU (nccl)".
//
// Rule: an op is routed over nccl when it crosses nodes, both nodes run nccl (a node advertises
// it only with GPU staging on), it reads a trainer's CUDA buffer and writes a rollout's CUDA
// buffer, and that rollout takes EVERY cross-node op into it this way and is the source of no
// cross-node op (its staging then lives on the GPU, which the host data channel cannot reach).
// A rollout with quantised pieces is staged in host memory (the node quantises there), so it
// takes every cross-node op on the host channel.

#include <string>
#include <string_view>
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
  bool dst_quantized = false;  // the destination worker holds quantised pieces (host staging)
};

// One flag per op, in order.
std::vector<bool> RouteOverNccl(const std::vector<RouteOpFacts>& ops);

// ---- nccl lanes: a node runs one nccl transport per GPU it lists (--nccl_devices), so every GPU
// sends and receives on its own communicators (and NCCL drives the NIC nearest to that GPU)
// instead of funnelling a node's cross-node bytes through one GPU and one NIC.

// A lane's name among a node's transport instances (RegisterNodeRequest.transport_instances,
// ExchangeRegionsRequest.transport_kind): "nccl/<device>".
std::string NcclLaneName(int device);
// The device of a lane name, or -1 when `name` is not a lane name.
int ParseNcclLaneName(std::string_view name);
// A node's lane devices, ascending, from the names of its transport instances.
std::vector<int> NcclLaneDevices(const std::vector<std::string>& transport_names);
// The lane that moves a buffer held on GPU `gpu`, given the node's lane devices (ascending): the
// GPU's own lane when it has one (no extra copy); otherwise lanes[gpu % lanes.size()], which
// spreads GPUs without a lane over the lanes (the daemon bounces those bytes over NVLink first);
// -1 when the node has no lane. The coordinator picks both ends of every nccl op with it
// (TransferOp.nccl_src_device / nccl_dst_device), so both nodes agree on the lane.
int NcclLaneFor(const std::vector<int>& lanes, int gpu);

}  // namespace wb::daemon
