#include "daemon/node/exec_plan.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/nccl_route.h"
#include "planner/box.h"
#include "base/status_macros.h"

namespace wb::daemon::node {

using transport::MemoryKind;

std::string RegionKey(uint32_t worker, int32_t buffer) { return absl::StrCat("w", worker, ".b", buffer); }

std::string ChannelName(const std::string& peer, const std::string& mine, const std::string& theirs) {
  return mine.rfind("nccl/", 0) == 0 ? peer + "\n" + mine + ">" + theirs : peer;
}

std::string ChannelTransportName(const std::string& chan) {
  const size_t nl = chan.find('\n'), gt = chan.rfind('>');
  return nl == std::string::npos || gt == std::string::npos || gt < nl ? std::string() : chan.substr(nl + 1, gt - nl - 1);
}

absl::StatusOr<PieceAt> ResolveSide(const Slice& slice, const SliceOp& op, bool src) {
  const uint32_t worker = src ? op.src_worker : op.dst_worker;
  const int32_t piece = src ? op.src_piece : op.dst_piece;
  PieceAt at;
  if (piece >= 0) {
    if (worker >= slice.layouts.size() || piece >= static_cast<int32_t>(slice.layouts[worker].pieces.size())) {
      return absl::InvalidArgumentError(absl::StrCat("op ", op.index, ": ", src ? "source" : "destination", " piece ", piece,
                                                     " of slice worker ", worker, " is not in the slice"));
    }
    at.piece = slice.layouts[worker].pieces[piece];
    at.key = RegionKey(worker, at.piece.buffer);
    return at;
  }
  if (!op.has_staging_box) return absl::InvalidArgumentError(absl::StrCat("op ", op.index, ": staged side without staging_box"));
  at.key = "g";
  at.piece.tensor = op.tensor;
  at.piece.box = op.staging_box;
  at.piece.buffer = 0;
  at.piece.offset_bytes = static_cast<int64_t>(op.staging_offset);
  std::vector<int64_t> extents;
  for (size_t d = 0; d < at.piece.box.begin.size(); ++d) extents.push_back(at.piece.box.end[d] - at.piece.box.begin[d]);
  at.piece.strides = planner::ContiguousStrides(extents);
  return at;
}

namespace {

bool IsLocal(const Slice& slice, uint32_t w, const std::string& me) { return w < slice.workers.size() && slice.workers[w].node_id == me; }

absl::Status CheckWorkers(const Slice& slice, const SliceOp& op) {
  if (op.src_worker >= slice.workers.size() || op.dst_worker >= slice.workers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("op ", op.index, ": slice worker ", std::max(op.src_worker, op.dst_worker),
                                                   " is not in the slice (", slice.workers.size(), " workers)"));
  }
  if (slice.inventory != nullptr && (op.tensor < 0 || static_cast<size_t>(op.tensor) >= slice.inventory->tensors.size())) {
    return absl::InvalidArgumentError(absl::StrCat("op ", op.index, ": tensor ", op.tensor, " is not in the model's inventory (",
                                                   slice.inventory->tensors.size(), " tensors)"));
  }
  if (op.bucket >= slice.num_buckets) {
    return absl::InvalidArgumentError(absl::StrCat("op ", op.index, ": bucket ", op.bucket, " >= num_buckets ", slice.num_buckets));
  }
  return absl::OkStatus();
}

int ElementSize(const Slice& slice, int32_t tensor) {
  // Op tensors are checked by CheckWorkers; piece tensors by the coordinator's layout validation.
  return planner::DTypeSize(slice.inventory->tensors[static_cast<size_t>(tensor)].dtype);
}

MemoryKind KindOf(const ExecFacts& facts, const std::string& key) {
  auto it = facts.kind.find(key);
  return it == facts.kind.end() ? MemoryKind::kHost : it->second;
}

std::vector<int64_t> Extents(const planner::Box& box) {
  std::vector<int64_t> out;
  for (size_t d = 0; d < box.begin.size(); ++d) out.push_back(box.end[d] - box.begin[d]);
  return out;
}

// Relays at commit (sync mode). A same-node relay from rollout A's staging into rollout B's staging
// would copy the bytes twice on this node: once in its bucket, again when the commit copies B's
// staging into B's live buffers. When relays fill whole pieces of B that no op reads (no further
// relay from them; rollout pieces never overlap), the commit copies those pieces from A's staging
// straight into B's live buffers instead, and the buckets skip them. Atomicity is the same: live
// weights still change only at the commit, from staging that holds the whole version (A's pieces are
// read by these relays, so they are never left to a commit).
absl::Status PlanRelaysAtCommit(const Slice& slice, const ExecFacts& facts, ExecPlan& out) {
  if (!slice.sync) return absl::OkStatus();
  const std::string& me = facts.me;
  std::set<std::pair<uint32_t, int32_t>> read;  // (slice worker, piece) some op of the slice reads
  for (const SliceOp& op : slice.ops) {
    if (op.src_piece >= 0) read.insert({op.src_worker, op.src_piece});
  }
  // (destination worker, piece) -> bytes of candidate relays into it, and those relays.
  std::map<std::pair<uint32_t, int32_t>, std::pair<int64_t, std::vector<const SliceOp*>>> by_piece;
  for (const SliceOp& op : slice.ops) {
    if (!IsLocal(slice, op.src_worker, me) || !IsLocal(slice, op.dst_worker, me) || op.src_piece < 0 || op.dst_piece < 0) continue;
    if (slice.workers[op.src_worker].role != planner::Role::kRollout || facts.host_live_sync.count(op.dst_worker) == 0) continue;
    if (op.dst_worker < slice.quantized.size() && slice.quantized[op.dst_worker]) continue;
    ASSIGN_OR_RETURN(PieceAt src, ResolveSide(slice, op, true));
    ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(slice, op, false));
    if (read.count({op.dst_worker, op.dst_piece}) > 0 || KindOf(facts, src.key) != MemoryKind::kHost ||
        KindOf(facts, dst.key) != MemoryKind::kHost) {
      continue;
    }
    auto& e = by_piece[{op.dst_worker, op.dst_piece}];
    e.first += static_cast<int64_t>(op.bytes);
    e.second.push_back(&op);
  }
  for (auto& [at, e] : by_piece) {
    const planner::Piece& p = slice.layouts[at.first].pieces[at.second];
    if (e.first != planner::BoxVolume(p.box) * ElementSize(slice, p.tensor)) continue;  // partly filled otherwise
    const std::string& dst_worker = slice.workers[at.first].worker_id;
    for (const SliceOp* op : e.second) {
      ASSIGN_OR_RETURN(PieceAt src, ResolveSide(slice, *op, true));
      ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(slice, *op, false));
      const int elem = ElementSize(slice, op->tensor);
      RelayAtCommit r;
      r.src_worker = slice.workers[op->src_worker].worker_id;
      r.src_buffer = src.piece.buffer;
      r.dst_buffer = dst.piece.buffer;
      r.op.shape = Extents(op->box);
      r.op.element_size = elem;
      r.op.src = RefFor(src.piece, op->box, elem, {});
      r.op.dst = RefFor(dst.piece, op->box, elem, {});  // live layout = staging layout (no quantised pieces)
      out.relays_at_commit[dst_worker].push_back(std::move(r));
      out.at_commit.insert(op->index);
      out.relay_bytes_at_commit += op->bytes;
    }
    out.pieces_at_commit[dst_worker].insert(at.second);
  }
  return absl::OkStatus();
}

// Which regions each transport reaches, the host-channel peers and the nccl lane pairs per peer.
absl::Status PlanRegions(const Slice& slice, const ExecFacts& facts, ExecPlan& out,
                         std::map<std::string, std::set<std::pair<int, int>>>& nccl_pairs) {
  const std::string& me = facts.me;
  for (const SliceOp& op : slice.ops) {
    const bool s = IsLocal(slice, op.src_worker, me), d = IsLocal(slice, op.dst_worker, me);
    if (!s && !d) continue;
    ASSIGN_OR_RETURN(PieceAt src, ResolveSide(slice, op, true));
    ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(slice, op, false));
    if (s && d) {
      const bool host = KindOf(facts, src.key) == MemoryKind::kHost && KindOf(facts, dst.key) == MemoryKind::kHost;
      (host ? out.host_keys : out.cuda_keys).insert({src.key, dst.key});
      continue;
    }
    const std::string& key = s ? src.key : dst.key;
    const std::string& peer = slice.workers[s ? op.dst_worker : op.src_worker].node_id;
    if (op.nccl) {
      nccl_pairs[peer].insert(s ? std::pair{op.nccl_src_device, op.nccl_dst_device} : std::pair{op.nccl_dst_device, op.nccl_src_device});
      continue;
    }
    out.peers.insert(peer);
    if (!s && KindOf(facts, key) == MemoryKind::kCuda) {
      return absl::InternalError(absl::StrCat("op ", op.index, ": region ", key, " on node ", me,
                                              " receives from another node but is staged on a GPU"));
    }
    out.cross_keys.insert(key);
  }
  if (!out.host_keys.empty() && !facts.have_local) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no same-node host transport"));
  if (!out.cuda_keys.empty() && !facts.have_cuda) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cuda_ipc transport"));
  if (!out.peers.empty() && !facts.have_cross) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cross-node host transport"));
  for (const std::set<std::string>* keys : {&out.host_keys, &out.cuda_keys, &out.cross_keys}) {
    for (const std::string& key : *keys) {
      if (facts.kind.count(key) == 0) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
    }
  }
  for (const auto& [key, lane] : out.lanes.lane_of) {
    if (facts.kind.count(key) == 0) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
  }
  return absl::OkStatus();
}

// Channels in the global order: (smaller node id, larger node id, host before nccl, GPU on the
// smaller node, GPU on the larger). Each node starts a channel only after every smaller one of its
// own, so the smallest unfinished channel always has both nodes at it.
void PlanChannels(const ExecFacts& facts, const std::map<std::string, std::set<std::pair<int, int>>>& nccl_pairs, ExecPlan& out) {
  const std::string& me = facts.me;
  std::set<std::string> all_peers = out.peers;
  for (auto& [peer, pairs] : nccl_pairs) all_peers.insert(peer);
  for (const std::string& peer : all_peers) {
    const std::string& lo = std::min(me, peer);
    const std::string& hi = std::max(me, peer);
    if (out.peers.count(peer)) {
      out.channels.push_back({peer, facts.cross_kind, facts.cross_kind, -1, -1, ChannelName(peer, facts.cross_kind, facts.cross_kind),
                              {lo, hi, 0, -1, -1}});
    }
    auto np = nccl_pairs.find(peer);
    if (np == nccl_pairs.end()) continue;
    for (auto [mine, theirs] : np->second) {
      ChannelPlan c{peer, NcclLaneName(mine), NcclLaneName(theirs), mine, theirs, "", {lo, hi, 1, me < peer ? mine : theirs, me < peer ? theirs : mine}};
      c.name = ChannelName(peer, c.mine, c.theirs);
      out.channels.push_back(std::move(c));
    }
  }
  std::sort(out.channels.begin(), out.channels.end(), [](const ChannelPlan& x, const ChannelPlan& y) { return x.order < y.order; });
}

// The routes of one bucket: one batch of same-node host copies, one of same-node CUDA copies, one
// per peer channel, each with its ops in op-index order (the mirror the peer derives).
absl::Status PlanBucket(const Slice& slice, const ExecFacts& facts, const std::vector<const SliceOp*>& ops, uint32_t b, ExecPlan& plan,
                        BucketPlan& out) {
  const std::string& me = facts.me;
  int host_route = -1, cuda_route = -1;
  std::map<std::string, int> peer_routes;
  for (const SliceOp* op : ops) {
    const bool s_local = IsLocal(slice, op->src_worker, me), d_local = IsLocal(slice, op->dst_worker, me);
    if ((!s_local && !d_local) || plan.at_commit.count(op->index) > 0) continue;
    RouteOp r;
    r.op_index = op->index;
    ASSIGN_OR_RETURN(r.src, ResolveSide(slice, *op, true));
    ASSIGN_OR_RETURN(r.dst, ResolveSide(slice, *op, false));
    r.src_key = r.src.key;
    r.dst_key = r.dst.key;
    r.src_local = s_local;
    r.dst_local = d_local;
    r.box = op->box;
    r.bytes = op->bytes;
    const int elem = ElementSize(slice, op->tensor);
    r.copy.shape = Extents(op->box);
    r.copy.element_size = elem;
    r.copy.src = RefFor(r.src.piece, op->box, elem, {});
    r.copy.dst = RefFor(r.dst.piece, op->box, elem, {});
    const bool reads_written = s_local && plan.written.count(r.src_key) > 0;
    int* slot = nullptr;
    Route fresh;
    fresh.bucket = b;
    if (s_local && d_local) {
      const bool host = KindOf(facts, r.src_key) == MemoryKind::kHost && KindOf(facts, r.dst_key) == MemoryKind::kHost;
      slot = host ? &host_route : &cuda_route;
      fresh.kind = host ? RouteKind::kHost : RouteKind::kCuda;
      fresh.what = host ? "same-node copies" : "same-node CUDA copies";
      fresh.peer = me;
    } else {
      const std::string& peer = slice.workers[s_local ? op->dst_worker : op->src_worker].node_id;
      const int my_lane = s_local ? op->nccl_src_device : op->nccl_dst_device;
      const int their_lane = s_local ? op->nccl_dst_device : op->nccl_src_device;
      const std::string chan = op->nccl ? ChannelName(peer, NcclLaneName(my_lane), NcclLaneName(their_lane)) : ChannelName(peer, "", "");
      slot = &peer_routes.emplace(chan, -1).first->second;
      fresh.kind = op->nccl ? RouteKind::kNccl : RouteKind::kPeer;
      fresh.what = op->nccl ? absl::StrCat("node ", me, " GPU ", my_lane, " <-> node ", peer, " GPU ", their_lane, " (nccl)")
                            : absl::StrCat("node ", me, " <-> node ", peer);
      fresh.peer = peer;
      fresh.channel = chan;
      fresh.checksum = facts.checksums && !op->nccl;
      if (op->nccl) {
        fresh.lane = {my_lane, their_lane};
        fresh.order = me < peer ? std::tuple{me, peer, my_lane, their_lane} : std::tuple{peer, me, their_lane, my_lane};
      }
    }
    if (*slot < 0) {
      *slot = static_cast<int>(out.routes.size());
      out.routes.push_back(std::move(fresh));
    }
    Route& route = out.routes[static_cast<size_t>(*slot)];
    route.bytes += static_cast<int64_t>(op->bytes);
    if (d_local) route.incoming += static_cast<int64_t>(op->bytes);
    route.reads_written = route.reads_written || reads_written;
    route.ops.push_back(std::move(r));
    if (route.kind == RouteKind::kNccl) out.has_nccl = true;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LanePlan> PlanLanes(const Slice& slice, const std::string& me, const std::set<int>& lanes) {
  LanePlan out;
  for (const SliceOp& op : slice.ops) {
    RETURN_IF_ERROR(CheckWorkers(slice, op));
    const bool s = IsLocal(slice, op.src_worker, me), d = IsLocal(slice, op.dst_worker, me);
    if (s != d) out.crosses.insert(s ? op.src_worker : op.dst_worker);
    if (s == d || !op.nccl) continue;
    const int lane = s ? op.nccl_src_device : op.nccl_dst_device;
    if (lanes.count(lane) == 0) {
      return absl::FailedPreconditionError(absl::StrCat("op ", op.index, " is routed over nccl lane ", NcclLaneName(lane), " but node ", me,
                                                        " has no such lane (--nccl_devices) with GPU staging (--gpu_staging_bytes)"));
    }
    if (d) out.nccl_in.insert(op.dst_worker);
    ASSIGN_OR_RETURN(PieceAt side, ResolveSide(slice, op, s));
    auto [it, inserted] = out.lane_of.emplace(side.key, lane);
    if (!inserted && it->second != lane) {
      return absl::InvalidArgumentError(absl::StrCat("op ", op.index, ": region ", side.key, " on node ", me, " is routed over nccl lanes ",
                                                     NcclLaneName(it->second), " and ", NcclLaneName(lane), " (one lane per region)"));
    }
    const uint32_t w = s ? op.src_worker : op.dst_worker;
    if (slice.workers[w].role == planner::Role::kRollout && w < slice.quantized.size() && slice.quantized[w]) {
      return absl::FailedPreconditionError(absl::StrCat("rollout ", slice.workers[w].worker_id, " holds quantised pieces (host staging) ",
                                                        "but buffer ", side.piece.buffer, " is routed over nccl"));
    }
  }
  return out;
}

absl::StatusOr<ExecPlan> MakeExecPlan(const Slice& slice, const ExecFacts& facts) {
  if (slice.inventory == nullptr) return absl::InvalidArgumentError("exec plan: slice without inventory");
  if (slice.layouts.size() != slice.workers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("exec plan: ", slice.workers.size(), " slice workers but ", slice.layouts.size(), " layouts"));
  }
  ExecPlan plan;
  ASSIGN_OR_RETURN(plan.lanes, PlanLanes(slice, facts.me, facts.lanes));
  std::map<std::string, std::set<std::pair<int, int>>> nccl_pairs;  // per peer: (our GPU, the peer's GPU)
  RETURN_IF_ERROR(PlanRegions(slice, facts, plan, nccl_pairs));
  PlanChannels(facts, nccl_pairs, plan);
  RETURN_IF_ERROR(PlanRelaysAtCommit(slice, facts, plan));
  // Local regions this version writes: rollout incoming staging and the gather staging. A batch
  // that reads one of them (a relay, a read of gathered data) needs every earlier bucket complete;
  // every other batch only reads sources that do not change during the version (trainer live
  // buffers or snapshots) and only writes bytes nothing else of this version writes.
  for (uint32_t i = 0; i < slice.workers.size(); ++i) {
    if (slice.workers[i].node_id != facts.me || slice.workers[i].role != planner::Role::kRollout) continue;
    for (size_t j = 0; j < slice.layouts[i].buffers.size(); ++j) plan.written.insert(RegionKey(i, static_cast<int32_t>(j)));
  }
  if (slice.hosts_gather) plan.written.insert("g");
  std::vector<std::vector<const SliceOp*>> by_bucket(slice.num_buckets);
  for (const SliceOp& op : slice.ops) by_bucket[op.bucket].push_back(&op);
  plan.buckets.resize(slice.num_buckets);
  for (uint32_t b = 0; b < slice.num_buckets; ++b) {
    std::sort(by_bucket[b].begin(), by_bucket[b].end(), [](const SliceOp* x, const SliceOp* y) { return x->index < y->index; });
    RETURN_IF_ERROR(PlanBucket(slice, facts, by_bucket[b], b, plan, plan.buckets[b]));
  }
  return plan;
}

std::map<int, std::vector<const Route*>> LaneSchedule(const BucketPlan& bucket) {
  std::map<int, std::vector<const Route*>> per_gpu;
  for (const Route& r : bucket.routes) {
    if (r.kind == RouteKind::kNccl) per_gpu[r.lane.first].push_back(&r);
  }
  for (auto& [gpu, seq] : per_gpu) {
    std::stable_sort(seq.begin(), seq.end(), [](const Route* x, const Route* y) { return x->order < y->order; });
  }
  return per_gpu;
}

}  // namespace wb::daemon::node
