#include "daemon/coordinator/slicer.h"

#include "absl/strings/str_cat.h"
#include "daemon/convert.h"
#include "daemon/nccl_route.h"
#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::daemon {
namespace {

std::string BoxKey(int32_t tensor, const planner::Box& box) { return absl::StrCat(tensor, planner::BoxToString(box)); }

// rank0_broadcast: every gathered box gets a place in the rank-0 node's gather staging (row-major,
// 64-byte aligned); each read of staged data points at the entry that holds its box.
class GatherStaging {
 public:
  explicit GatherStaging(const planner::Plan& plan) {
    for (const planner::Bucket& b : plan.buckets) {
      for (const planner::TransferOp& op : b.ops) {
        if (op.dst_piece >= 0) continue;
        auto [it, fresh] = staged_.try_emplace(BoxKey(op.tensor, op.box), Staged{op.tensor, op.box, bytes_});
        if (fresh) {
          bytes_ += (static_cast<uint64_t>(op.bytes) + 63) / 64 * 64;
          by_tensor_[op.tensor].push_back(&it->second);
        }
      }
    }
  }
  struct Staged {
    int32_t tensor;
    planner::Box box;
    uint64_t offset;
  };
  const Staged* Find(const planner::TransferOp& op) const {
    auto it = staged_.find(BoxKey(op.tensor, op.box));
    if (it != staged_.end()) return &it->second;
    auto t = by_tensor_.find(op.tensor);
    if (t == by_tensor_.end()) return nullptr;
    for (const Staged* st : t->second) {
      if (planner::BoxContains(st->box, op.box)) return st;
    }
    return nullptr;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  std::map<std::string, Staged> staged_;
  std::map<int32_t, std::vector<const Staged*>> by_tensor_;
  uint64_t bytes_ = 0;
};

// The CUDA buffer a piece lives in, or null (host memory, or the rank-0 gather staging).
const pb::BufferSpec* CudaBuffer(const SliceWorker& w, int32_t piece) {
  if (piece < 0 || static_cast<size_t>(piece) >= w.layout->num_pieces()) return nullptr;
  const int32_t buffer = w.layout->buffer(static_cast<size_t>(piece));
  if (buffer < 0 || buffer >= w.layout_proto->buffers_size()) return nullptr;
  const pb::BufferSpec& b = w.layout_proto->buffers(buffer);
  const bool cuda = b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey;
  return cuda ? &b : nullptr;
}

// Which ops go GPU to GPU over nccl (TransferOp.nccl; daemon/nccl_route.h), in plan op order.
std::vector<bool> NcclOps(const planner::Plan& plan, const SliceInput& in,
                          const std::map<std::string, std::vector<int>>& lanes) {
  auto has_nccl = [&](const std::string& node) {
    auto it = lanes.find(node);
    return it != lanes.end() && !it->second.empty();
  };
  // Once per worker, not per op: HasQuantizedPieces walked every piece of the layout (per op it was
  // quadratic: 8192 tensors x 16 rollouts spent 1.3 s here, 16384 tensors over 300 s, unpolled by
  // plan cancellation).
  std::vector<bool> quantized(in.workers.size());
  for (size_t w = 0; w < in.workers.size(); ++w) {
    quantized[w] = in.workers[w].layout != nullptr && in.workers[w].layout->HasQuantizedPieces();
  }
  std::vector<RouteOpFacts> facts;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      const SliceWorker& sw = in.workers[op.src_worker];
      const SliceWorker& dw = in.workers[op.dst_worker];
      RouteOpFacts f;
      f.src_worker = op.src_worker;
      f.dst_worker = op.dst_worker;
      f.cross_node = sw.node != dw.node;
      f.src_is_trainer = sw.role == planner::Role::kTrainer;
      f.dst_is_rollout = dw.role == planner::Role::kRollout;
      f.src_cuda = CudaBuffer(sw, op.src_piece) != nullptr;
      f.dst_cuda = CudaBuffer(dw, op.dst_piece) != nullptr;
      f.src_node_nccl = has_nccl(sw.node);
      f.dst_node_nccl = has_nccl(dw.node);
      f.dst_quantized = quantized[op.dst_worker];
      facts.push_back(f);
    }
  }
  return RouteOverNccl(facts);
}

bool CudaBufferAt(const SliceWorker& w, int32_t buffer) {
  if (buffer < 0 || buffer >= w.layout_proto->buffers_size()) return false;
  const pb::BufferSpec& b = w.layout_proto->buffers(buffer);
  return b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey;
}

// Relays that may read only decoded, checked bytes, by plan op order: relays between host pieces
// into a box no op reads. The relaying node runs them after its delta tail (every stream decoded
// and checked, every refused op resent in full): a same-node one left to the commit (sync, whole
// pieces of an unquantised host rollout: daemon/node/exec_plan.h "Relays at commit") or else in the
// bucket's after-deltas route ("Relays after the deltas"), one across nodes in its channel's
// after-deltas route on both nodes (TransferOp.after_deltas); that delays nothing another op reads
// because no op reads the box they write.
std::vector<bool> RelaysAfterDeltas(const planner::Plan& plan, const SliceInput& in) {
  std::map<std::pair<uint32_t, int32_t>, std::vector<const planner::Box*>> read;  // (worker, tensor) -> boxes ops read
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      if (op.src_piece >= 0) read[{op.src_worker, op.tensor}].push_back(&op.box);
    }
  }
  auto is_read = [&](uint32_t worker, int32_t tensor, const planner::Box& box) {
    auto it = read.find({worker, tensor});
    if (it == read.end()) return false;
    for (const planner::Box* r : it->second) {
      if (planner::Intersect(*r, box).has_value()) return true;
    }
    return false;
  };
  std::vector<bool> out;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      const SliceWorker& sw = in.workers[op.src_worker];
      const SliceWorker& dw = in.workers[op.dst_worker];
      out.push_back(sw.role == planner::Role::kRollout && dw.role == planner::Role::kRollout &&
                    op.src_piece >= 0 && op.dst_piece >= 0 && CudaBuffer(sw, op.src_piece) == nullptr &&
                    CudaBuffer(dw, op.dst_piece) == nullptr && !is_read(op.dst_worker, op.tensor, op.box));
    }
  }
  return out;
}

// Relays across nodes out of a box a delta op writes (TransferOp.after_deltas), by plan op order.
std::vector<bool> AfterDeltaRelays(const planner::Plan& plan, const SliceInput& in, const std::vector<bool>& delta) {
  std::map<std::pair<uint32_t, int32_t>, std::vector<const planner::Box*>> written;  // (rollout, tensor) -> delta boxes
  size_t i = 0;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      if (delta[i++]) written[{op.dst_worker, op.tensor}].push_back(&op.box);
    }
  }
  const std::vector<bool> eligible = RelaysAfterDeltas(plan, in);
  std::vector<bool> out;
  i = 0;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      bool after = eligible[i++] && in.workers[op.src_worker].node != in.workers[op.dst_worker].node;
      if (after) {
        auto it = written.find({op.src_worker, op.tensor});
        after = false;
        if (it != written.end()) {
          for (const planner::Box* w : it->second) after = after || planner::Intersect(*w, op.box).has_value();
        }
      }
      out.push_back(after);
    }
  }
  return out;
}

}  // namespace

std::vector<bool> DeltaOps(const planner::Plan& plan, const SliceInput& in, const std::vector<bool>& over_nccl) {
  // Boxes some op reads from a rollout before the receiving node's delta tail (relays other than
  // RelaysAfterDeltas), per (worker, tensor): such a relay would forward bytes before their delta
  // is decoded and checked.
  const std::vector<bool> after_deltas = RelaysAfterDeltas(plan, in);
  std::map<std::pair<uint32_t, int32_t>, std::vector<const planner::Box*>> relayed;
  size_t k = 0;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      if (in.workers[op.src_worker].role != planner::Role::kTrainer && !after_deltas[k]) relayed[{op.src_worker, op.tensor}].push_back(&op.box);
      ++k;
    }
  }
  auto relays_box = [&](uint32_t worker, int32_t tensor, const planner::Box& box) {
    auto it = relayed.find({worker, tensor});
    if (it == relayed.end()) return false;
    for (const planner::Box* r : it->second) {
      if (planner::Intersect(*r, box).has_value()) return true;
    }
    return false;
  };
  // The destination piece: host memory (its scales too). Unquantised: a delta of its bytes;
  // filled by the sending node's quantised bytes: a delta of those; receiver-quantised: a delta of
  // the canonical bytes into its shadow, against the shadow of the committed staging (the receiving
  // node keeps it: Versions::TagCommittedStaging), which the node then quantises as before.
  // Without in-place decoding the receiving node's only base would be live weights, which hold no
  // shadows: every such delta would be refused and resent in full.
  auto host_target = [&](const SliceWorker& dw, const planner::TransferOp& op) {
    if (CudaBuffer(dw, op.dst_piece) != nullptr) return false;
    const auto p = static_cast<size_t>(op.dst_piece);
    if (!dw.layout->quantized(p)) return !op.sender_quantized;
    if (CudaBufferAt(dw, dw.layout->scale_buffer(p))) return false;
    if (op.sender_quantized) return true;
    auto dn = in.nodes.find(dw.node);
    return dn != in.nodes.end() && dn->second.keeps_shadows;
  };
  std::vector<bool> out;
  size_t i = 0;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      const SliceWorker& sw = in.workers[op.src_worker];
      const SliceWorker& dw = in.workers[op.dst_worker];
      auto n = in.nodes.find(sw.node);
      const bool ok = in.deltas && !over_nccl[i] && sw.node != dw.node && n != in.nodes.end() && n->second.sends_deltas &&
                      sw.role == planner::Role::kTrainer && dw.role == planner::Role::kRollout && op.src_piece >= 0 &&
                      op.dst_piece >= 0 && static_cast<size_t>(op.dst_piece) < dw.layout->num_pieces() &&
                      CudaBuffer(sw, op.src_piece) == nullptr && host_target(dw, op) && !relays_box(op.dst_worker, op.tensor, op.box);
      out.push_back(ok);
      ++i;
    }
  }
  return out;
}

// The header of every slice: model, epoch, inventory, stats, every worker (layouts only for the
// node's own workers and the peers of its ops).
void FillSliceHeader(const planner::Plan& plan, const SliceInput& in, const Slices& slices, const std::string& node,
                     pb::PlanSlice* s) {
  static const std::set<int32_t> kNone;
  auto k = slices.known.find(node);
  const std::set<int32_t>& known = k != slices.known.end() ? k->second : kNone;
  const uint64_t gather_bytes = slices.gather_bytes;
  s->set_model_id(in.model_id);
  s->set_plan_epoch(in.epoch);
  s->set_fingerprint(plan.fingerprint);
  s->set_strategy(ToProto(plan.strategy));
  s->set_mode(in.mode == pb::MODE_UNSPECIFIED ? pb::MODE_SYNC : in.mode);
  InventoryToProto(*in.inventory, s->mutable_tensors());
  s->set_num_buckets(static_cast<uint32_t>(plan.buckets.size()));
  StatsToProto(plan.stats, static_cast<int>(plan.buckets.size()), s->mutable_stats());
  s->set_gather_staging_bytes(gather_bytes);
  for (size_t i = 0; i < in.workers.size(); ++i) {
    const SliceWorker& w = in.workers[i];
    pb::PlanWorker* pw = s->add_workers();
    pw->set_worker_id(w.id);
    pw->set_role(ToProto(w.role));
    pw->set_node_id(w.node);
    pw->set_gpu(w.gpu);
    auto n = in.nodes.find(w.node);
    if (n != in.nodes.end()) {
      pw->set_data_address(n->second.data_address);
      for (auto& [k, v] : n->second.transport_instances) (*pw->mutable_transport_instances())[k] = v;
    }
    if (w.node == node || known.count(static_cast<int32_t>(i))) {
      *pw->mutable_layout() = *w.layout_proto;
      // The stored pieces are bytes this process encoded and they parse; were one not to, the
      // layout goes without pieces and the node refuses the slice's ops naming them.
      if (w.layout_pieces != nullptr && !w.layout_pieces->AppendTo(pw->mutable_layout()).ok()) pw->mutable_layout()->clear_pieces();
    }
  }
}

absl::StatusOr<Slices> SlicePlan(const planner::Plan& plan, const SliceInput& in) {
  absl::StatusOr<Slices> out = SliceOps(plan, in);
  if (!out.ok()) return out;
  for (auto& [n, s] : out->by_node) FillSliceHeader(plan, in, *out, n, &s);
  return out;
}

absl::StatusOr<Slices> SliceOps(const planner::Plan& plan, const SliceInput& in) {
  Slices out;
  const GatherStaging gather(plan);
  out.gather_bytes = gather.bytes();
  // Which workers each node must know the layout of: its own and every peer of one of its ops.
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      for (const std::string* n : {&in.workers[op.src_worker].node, &in.workers[op.dst_worker].node}) {
        out.known[*n].insert(op.src_worker);
        out.known[*n].insert(op.dst_worker);
      }
    }
  }
  std::set<std::string> plan_nodes;
  for (const SliceWorker& w : in.workers) plan_nodes.insert(w.node);
  for (const std::string& n : plan_nodes) out.by_node[n];

  std::map<std::string, std::vector<int>> lanes;  // node -> its nccl lane devices (ascending)
  for (const std::string& n : plan_nodes) {
    std::vector<std::string> names;
    auto it = in.nodes.find(n);
    if (it != in.nodes.end()) for (const auto& [k, v] : it->second.transport_instances) names.push_back(k);
    lanes[n] = NcclLaneDevices(names);
  }
  const std::vector<bool> over_nccl = NcclOps(plan, in, lanes);
  const std::vector<bool> delta = DeltaOps(plan, in, over_nccl);
  const std::vector<bool> after_deltas = AfterDeltaRelays(plan, in, delta);
  size_t op_i = 0;
  uint32_t index = 0;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (const planner::TransferOp& op : plan.buckets[b].ops) {
      const SliceWorker& sw = in.workers[op.src_worker];
      const SliceWorker& dw = in.workers[op.dst_worker];
      out.total_bytes += static_cast<uint64_t>(op.bytes);
      pb::TransferOp pop;
      pop.set_index(index++);
      pop.set_bucket(static_cast<uint32_t>(b));
      convert::OpToProto(op, &pop);
      if (delta[op_i]) pop.set_delta(true);
      if (after_deltas[op_i]) pop.set_after_deltas(true);
      if (over_nccl[op_i++]) {
        // Both ends' lanes: the GPU of each side's buffer when it has a lane (daemon/nccl_route.h).
        pop.set_nccl(true);
        pop.set_nccl_src_device(NcclLaneFor(lanes[sw.node], CudaBuffer(sw, op.src_piece)->gpu()));
        pop.set_nccl_dst_device(NcclLaneFor(lanes[dw.node], CudaBuffer(dw, op.dst_piece)->gpu()));
      }
      if (op.dst_piece < 0 || op.src_piece < 0) {
        const GatherStaging::Staged* st = gather.Find(op);
        if (st == nullptr) {
          return absl::InternalError(absl::StrCat("plan op ", pop.index(), " reads staged tensor ", in.inventory->tensors[op.tensor].name,
                                                  " box ", planner::BoxToString(op.box), " that no gather op stages"));
        }
        pop.set_staging_offset(st->offset);
        ToProto(st->box, pop.mutable_staging_box());
      }
      *out.by_node[sw.node].add_ops() = pop;
      if (dw.node != sw.node) *out.by_node[dw.node].add_ops() = std::move(pop);
    }
  }
  for (auto& [n, s] : out.by_node) s.set_total_bytes(out.total_bytes);
  return out;
}

}  // namespace wb::daemon
