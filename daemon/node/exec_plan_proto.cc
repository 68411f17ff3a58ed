#include "daemon/node/exec_plan_proto.h"

#include "daemon/convert.h"

namespace wb::daemon::node {

namespace pb = ::weightbridge::v1;

Slice SliceFromProto(const pb::PlanSlice& slice, const std::vector<planner::WorkerLayout>& layouts, const std::vector<bool>& quantized,
                     bool hosts_gather, const planner::Inventory& inventory, const std::vector<planner::WorkerLayout>& live_layouts) {
  Slice out;
  out.live_layouts = live_layouts;
  for (const pb::PlanWorker& w : slice.workers()) out.workers.push_back({w.worker_id(), w.node_id(), FromProto(w.role())});
  out.layouts = layouts;
  out.quantized = quantized;
  out.layouts.resize(out.workers.size());
  out.quantized.resize(out.workers.size(), false);
  out.num_buckets = slice.num_buckets();
  out.sync = slice.mode() == pb::MODE_SYNC;
  out.hosts_gather = hosts_gather;
  out.inventory = &inventory;
  out.ops.reserve(static_cast<size_t>(slice.ops_size()));
  for (const pb::TransferOp& op : slice.ops()) {
    SliceOp o;
    o.index = op.index();
    o.bucket = op.bucket();
    o.src_worker = op.src_worker();
    o.dst_worker = op.dst_worker();
    o.src_piece = op.src_piece();
    o.dst_piece = op.dst_piece();
    o.tensor = op.tensor();
    o.box = FromProto(op.box());
    o.bytes = op.bytes();
    o.nccl = op.nccl();
    o.nccl_src_device = op.nccl_src_device();
    o.nccl_dst_device = op.nccl_dst_device();
    o.has_staging_box = op.has_staging_box();
    if (o.has_staging_box) o.staging_box = FromProto(op.staging_box());
    o.staging_offset = op.staging_offset();
    o.sender_quantized = op.sender_quantized();
    o.wire_bytes = op.wire_bytes() > 0 ? op.wire_bytes() : op.bytes();
    o.delta = op.delta();
    o.after_deltas = op.after_deltas();
    out.ops.push_back(std::move(o));
  }
  out.certify.reserve(static_cast<size_t>(slice.certify_size()));
  for (const pb::CertifyBox& c : slice.certify()) {
    out.certify.push_back({c.worker(), c.piece(), c.tensor(), FromProto(c.box()), c.digest(), c.version_op(), c.from_catch_up(), c.quantized(), c.quantized_here()});
  }
  return out;
}

}  // namespace wb::daemon::node
