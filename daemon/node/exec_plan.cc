#include "daemon/node/exec_plan.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/nccl_route.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "planner/sender_quant.h"
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

std::string ConnectRound(const std::string& model_id, uint64_t version, uint64_t epoch, const std::string& me,
                         const ChannelPlan& channel) {
  const bool lo = me < channel.peer;
  const std::string& lo_node = lo ? me : channel.peer;
  const std::string& hi_node = lo ? channel.peer : me;
  const std::string& lo_transport = lo ? channel.mine : channel.theirs;
  const std::string& hi_transport = lo ? channel.theirs : channel.mine;
  auto part = [](const std::string& s) { return absl::StrCat(s.size(), ":", s); };
  const std::string ends = absl::StrCat(part(lo_node), "/", part(lo_transport), " ", part(hi_node), "/", part(hi_transport));
  std::string round = absl::StrCat("wb1 ", part(model_id), " v", version, " e", epoch, " ", ends);
  if (round.size() <= transport::kMaxConnectRoundBytes) return round;
  // FNV-1a 64: stable across builds and hosts (both nodes must compute the same bytes).
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : round) h = (h ^ c) * 1099511628211ull;
  round = absl::StrCat("wb1 #", absl::Hex(h, absl::kZeroPad16), " v", version, " e", epoch, " ", ends);
  if (round.size() <= transport::kMaxConnectRoundBytes) return round;
  return absl::StrCat("wb1 #", absl::Hex(h, absl::kZeroPad16), " v", version, " e", epoch);
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

int64_t AlignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

bool IsQuantOutKey(const std::string& key) { return key.rfind("q.", 0) == 0; }

// A slice worker's own piece (live layout; the staging layout when the slice has none).
absl::StatusOr<const planner::Piece*> LivePiece(const Slice& slice, const SliceOp& op, bool src) {
  const uint32_t w = src ? op.src_worker : op.dst_worker;
  const int32_t p = src ? op.src_piece : op.dst_piece;
  const std::vector<planner::WorkerLayout>& layouts =
      w < slice.live_layouts.size() && !slice.live_layouts[w].pieces.empty() ? slice.live_layouts : slice.layouts;
  if (p < 0 || w >= layouts.size() || p >= static_cast<int32_t>(layouts[w].pieces.size())) {
    return absl::InvalidArgumentError(absl::StrCat("sender-quantised op ", op.index, ": ", src ? "source" : "destination", " piece ", p,
                                                   " of slice worker ", w, " is not in the slice"));
  }
  return &layouts[w].pieces[static_cast<size_t>(p)];
}

// Whether op's destination piece is quantised (its own layout): an op that is not sender-quantised
// then lands canonical bytes in the piece's shadow, for the receiving node to quantise.
bool IntoQuantizedPiece(const Slice& slice, const SliceOp& op) {
  absl::StatusOr<const planner::Piece*> p = LivePiece(slice, op, false);
  return p.ok() && (*p)->quant.has_value();
}

// The destination's quantised format of a sender-quantised op (element dtype, block, scale dtype),
// hashed: the sender's delta cache keeps the quantised bytes of one box apart per format.
absl::StatusOr<uint64_t> QuantFormatHash(const Slice& slice, const SliceOp& op) {
  ASSIGN_OR_RETURN(const planner::Piece* dp, LivePiece(slice, op, false));
  if (!dp->quant.has_value()) return absl::InvalidArgumentError(absl::StrCat("sender-quantised op ", op.index, ": destination piece not quantised"));
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the format's numbers
  auto mix = [&h](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  mix(static_cast<uint64_t>(dp->quant->dtype));
  mix(static_cast<uint64_t>(dp->quant->scale_dtype));
  for (int64_t b : dp->quant->block) mix(static_cast<uint64_t>(b));
  return h;
}

}  // namespace

// The quantised elements of `box` in quantised piece `p`: its byte view (planner::StoredBytes;
// int4: the last dim packed two per byte) and the matching sub-box.
void QuantElementsSide(const planner::Inventory& inventory, const planner::Piece& p, const planner::Box& box, transport::CopyOp& copy,
                       transport::StridedRef& ref) {
  const planner::ByteView bv = planner::StoredBytes(inventory, p);
  planner::Box vb = box;
  if (p.quant->dtype == planner::DType::kI4 && !vb.begin.empty()) {
    const size_t l = vb.begin.size() - 1;
    vb.begin[l] = p.box.begin[l] + (box.begin[l] - p.box.begin[l]) / 2;
    vb.end[l] = vb.begin[l] + (box.end[l] - box.begin[l]) / 2;
  }
  copy.shape = Extents(vb);
  copy.element_size = bv.element_size;
  ref = RefFor(bv.piece, vb, bv.element_size, {});
}

// The scales of `box`'s blocks: a sub-grid of `p`'s scale grid (row-major at scale_offset_bytes).
void QuantScalesSide(const planner::Piece& p, const planner::Box& box, transport::CopyOp& copy, transport::StridedRef& ref) {
  const std::vector<int64_t> grid = planner::ScaleShape(p);
  const std::vector<int64_t> strides = planner::ContiguousStrides(grid);
  const int es = planner::ScaleElementSize(*p.quant);
  int64_t first = 0;
  copy.shape.clear();
  for (size_t d = 0; d < box.begin.size(); ++d) {
    const int64_t b = p.quant->block[d];
    first += (box.begin[d] - p.box.begin[d]) / b * strides[d];
    copy.shape.push_back((box.end[d] - box.begin[d] + b - 1) / b);
  }
  copy.element_size = es;
  ref.offset_bytes = p.quant->scale_offset_bytes + first * es;
  ref.strides = strides;
}

namespace {

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
absl::Status PlanRegions(const Slice& slice, const ExecFacts& facts, const SenderQuant& quant, ExecPlan& out,
                         std::map<std::string, std::set<std::pair<int, int>>>& nccl_pairs) {
  const std::string& me = facts.me;
  for (const SliceOp& op : slice.ops) {
    const bool s = IsLocal(slice, op.src_worker, me), d = IsLocal(slice, op.dst_worker, me);
    if (!s && !d) continue;
    // (source key, destination key) per copy: one, or two for a sender-quantised op.
    std::vector<std::pair<std::string, std::string>> keys;
    if (auto q = quant.copies.find(op.index); q != quant.copies.end()) {
      if (op.nccl) return absl::InvalidArgumentError(absl::StrCat("sender-quantised op ", op.index, " is routed over nccl"));
      keys = {{q->second.first.src_key, q->second.first.dst_key}, {q->second.second.src_key, q->second.second.dst_key}};
    } else {
      ASSIGN_OR_RETURN(PieceAt src, ResolveSide(slice, op, true));
      ASSIGN_OR_RETURN(PieceAt dst, ResolveSide(slice, op, false));
      keys = {{src.key, dst.key}};
    }
    for (const auto& [src_key, dst_key] : keys) {
      if (s && d) {
        const bool host = KindOf(facts, src_key) == MemoryKind::kHost && KindOf(facts, dst_key) == MemoryKind::kHost;
        (host ? out.host_keys : out.cuda_keys).insert({src_key, dst_key});
        continue;
      }
      const std::string& key = s ? src_key : dst_key;
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
  }
  if (!out.host_keys.empty() && !facts.have_local) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no same-node host transport"));
  if (!out.cuda_keys.empty() && !facts.have_cuda) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cuda_ipc transport"));
  if (!out.peers.empty() && !facts.have_cross) return absl::FailedPreconditionError(absl::StrCat("node ", me, " has no cross-node host transport"));
  for (const std::set<std::string>* keys : {&out.host_keys, &out.cuda_keys, &out.cross_keys}) {
    for (const std::string& key : *keys) {
      // q regions are made from this plan (QuantizeOutgoing), after it.
      if (facts.kind.count(key) == 0 && !IsQuantOutKey(key)) return absl::InternalError(absl::StrCat("region ", key, " missing on node ", me));
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
// Boxes incoming delta ops of the slice write, per (local rollout, tensor): a same-node relay
// reading one of them waits for the delta tail (Route::after_deltas).
using DeltaWritten = std::map<std::pair<uint32_t, int32_t>, std::vector<planner::Box>>;
DeltaWritten DeltaWrittenBoxes(const Slice& slice, const std::string& me) {
  DeltaWritten out;
  for (const SliceOp& op : slice.ops) {
    if (op.delta && !op.nccl && !IsLocal(slice, op.src_worker, me) && IsLocal(slice, op.dst_worker, me)) {
      out[{op.dst_worker, op.tensor}].push_back(op.box);
    }
  }
  return out;
}

bool ReadsDeltaWritten(const DeltaWritten& written, const SliceOp& op) {
  auto it = written.find({op.src_worker, op.tensor});
  if (it == written.end()) return false;
  for (const planner::Box& b : it->second) {
    if (planner::Intersect(b, op.box).has_value()) return true;
  }
  return false;
}

absl::Status PlanBucket(const Slice& slice, const ExecFacts& facts, const SenderQuant& quant, const std::vector<const SliceOp*>& ops,
                        uint32_t b, const DeltaWritten& delta_written, ExecPlan& plan, BucketPlan& out) {
  const std::string& me = facts.me;
  int host_route = -1, cuda_route = -1, after_route = -1;
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
    r.tensor = op->tensor;
    r.dst_worker = op->dst_worker;
    // (A sender-quantised op's delta is of its quantised elements and scales: both parts below.)
    r.delta = op->delta && !op->nccl && s_local != d_local;
    r.into_shadow = r.delta && !op->sender_quantized && IntoQuantizedPiece(slice, *op);
    const int elem = ElementSize(slice, op->tensor);
    r.copy.shape = Extents(op->box);
    r.copy.element_size = elem;
    r.copy.src = RefFor(r.src.piece, op->box, elem, {});
    r.copy.dst = RefFor(r.dst.piece, op->box, elem, {});
    // A sender-quantised op: its elements and its scales, two copies in one batch.
    std::vector<RouteOp> parts;
    if (auto q = quant.copies.find(op->index); q != quant.copies.end()) {
      uint64_t format = 0;
      if (r.delta) {
        ASSIGN_OR_RETURN(format, QuantFormatHash(slice, *op));
      }
      for (const QuantCopy* c : {&q->second.first, &q->second.second}) {
        RouteOp part = r;
        part.part = c == &q->second.first ? RouteOp::Part::kElements : RouteOp::Part::kScales;
        part.delta_variant = r.delta ? (format << 2) | (part.part == RouteOp::Part::kElements ? 1u : 2u) : 0;
        part.src_key = c->src_key;
        part.dst_key = c->dst_key;
        part.copy = c->copy;
        part.bytes = static_cast<uint64_t>(c->copy.bytes());
        parts.push_back(std::move(part));
      }
    } else {
      parts.push_back(r);  // r's keys still pick the route below
    }
    bool reads_written = false;
    for (const RouteOp& part : parts) reads_written = reads_written || (s_local && plan.written.count(part.src_key) > 0);
    int* slot = nullptr;
    Route fresh;
    fresh.bucket = b;
    if (s_local && d_local) {
      const bool host = KindOf(facts, r.src_key) == MemoryKind::kHost && KindOf(facts, r.dst_key) == MemoryKind::kHost;
      const bool after = host && slice.workers[op->src_worker].role == planner::Role::kRollout && ReadsDeltaWritten(delta_written, *op);
      slot = after ? &after_route : host ? &host_route : &cuda_route;
      fresh.kind = host ? RouteKind::kHost : RouteKind::kCuda;
      fresh.what = after ? "same-node relays after the deltas" : host ? "same-node copies" : "same-node CUDA copies";
      fresh.peer = me;
      fresh.after_deltas = after;
    } else {
      const std::string& peer = slice.workers[s_local ? op->dst_worker : op->src_worker].node_id;
      const int my_lane = s_local ? op->nccl_src_device : op->nccl_dst_device;
      const int their_lane = s_local ? op->nccl_dst_device : op->nccl_src_device;
      const std::string chan = op->nccl ? ChannelName(peer, NcclLaneName(my_lane), NcclLaneName(their_lane)) : ChannelName(peer, "", "");
      const bool after = op->after_deltas && !op->nccl;  // both nodes of the op see the flag
      slot = &peer_routes.emplace(after ? chan + "\nafter deltas" : chan, -1).first->second;
      fresh.after_deltas = after;
      fresh.kind = op->nccl ? RouteKind::kNccl : RouteKind::kPeer;
      fresh.what = op->nccl  ? absl::StrCat("node ", me, " GPU ", my_lane, " <-> node ", peer, " GPU ", their_lane, " (nccl)")
                   : after ? absl::StrCat("node ", me, " <-> node ", peer, " (relays after the deltas)")
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
    // Bytes as moved (wire bytes); progress (incoming) counts the canonical bytes the op delivers.
    for (const RouteOp& part : parts) route.bytes += static_cast<int64_t>(part.bytes);
    if (d_local) route.incoming += static_cast<int64_t>(op->bytes);
    route.reads_written = route.reads_written || reads_written;
    for (RouteOp& part : parts) route.ops.push_back(std::move(part));
    if (route.kind == RouteKind::kNccl) out.has_nccl = true;
  }
  return absl::OkStatus();
}

}  // namespace

std::string QuantOutKey(const std::string& dst_node) { return "q." + dst_node; }

absl::StatusOr<SenderQuant> PlanSenderQuant(const Slice& slice, const std::string& me) {
  SenderQuant out;
  std::vector<const SliceOp*> ops;
  for (const SliceOp& op : slice.ops) {
    if (op.sender_quantized) ops.push_back(&op);
  }
  if (ops.empty()) return out;
  if (slice.inventory == nullptr) return absl::InvalidArgumentError("sender-quantised ops in a slice without inventory");
  std::sort(ops.begin(), ops.end(), [](const SliceOp* x, const SliceOp* y) { return x->index < y->index; });
  std::map<std::pair<std::string, std::string>, int64_t> next;  // (source node, destination node) -> end of its q region
  for (const SliceOp* opp : ops) {
    const SliceOp& op = *opp;
    RETURN_IF_ERROR(CheckWorkers(slice, op));
    const std::string what = absl::StrCat("sender-quantised op ", op.index, " (tensor ", slice.inventory->tensors[op.tensor].name, " box ",
                                          planner::BoxToString(op.box), ")");
    if (op.src_piece < 0 || op.dst_piece < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": has a gather staging side"));
    ASSIGN_OR_RETURN(const planner::Piece* dp, LivePiece(slice, op, false));
    if (!dp->quant.has_value() || !planner::SenderCanQuantize(*dp->quant)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": its destination piece is not in a format senders quantise to"));
    }
    if (dp->tensor != op.tensor || !planner::BoxContains(dp->box, op.box) ||
        !planner::BoxOnBlockGrid(op.box, slice.inventory->tensors[op.tensor].shape, dp->quant->block)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": not whole blocks of its destination piece ", planner::BoxToString(dp->box)));
    }
    QuantCopy el, sc;
    el.dst_key = RegionKey(op.dst_worker, dp->buffer);
    sc.dst_key = RegionKey(op.dst_worker, dp->quant->scale_buffer);
    QuantElementsSide(*slice.inventory, *dp, op.box, el.copy, el.copy.dst);
    QuantScalesSide(*dp, op.box, sc.copy, sc.copy.dst);
    const std::string& src_node = slice.workers[op.src_worker].node_id;
    const std::string& dst_node = slice.workers[op.dst_worker].node_id;
    // A source holding the box quantised: a relay, or a catch-up source (a rollout holding the
    // committed version, a trainer in the catch-up slice: planner::PlanOptions::quantized_sources).
    ASSIGN_OR_RETURN(const planner::Piece* held, LivePiece(slice, op, true));
    if (slice.workers[op.src_worker].role == planner::Role::kRollout || held->quant.has_value()) {
      // A copy of the quantised bytes it holds, at its own piece's place.
      const planner::Piece* sp = held;
      if (!sp->quant.has_value() || !planner::SameQuantFormat(*sp->quant, *dp->quant) || !planner::BoxContains(sp->box, op.box)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": relay source piece ", planner::BoxToString(sp->box),
                                                       " does not hold the box in the destination's format"));
      }
      transport::CopyOp tmp;
      el.src_key = RegionKey(op.src_worker, sp->buffer);
      sc.src_key = RegionKey(op.src_worker, sp->quant->scale_buffer);
      QuantElementsSide(*slice.inventory, *sp, op.box, tmp, el.copy.src);
      QuantScalesSide(*sp, op.box, tmp, sc.copy.src);
    } else {
      int64_t& at = next[{src_node, dst_node}];
      QuantJob job;
      job.op_index = op.index;
      job.box = op.box;
      job.quant = *dp->quant;
      job.elements_offset = at;
      job.elements_bytes = el.copy.bytes();
      job.scales_offset = AlignUp(at + job.elements_bytes, 16);
      job.scales_bytes = sc.copy.bytes();
      at = AlignUp(job.scales_offset + job.scales_bytes, 64);
      el.src_key = sc.src_key = QuantOutKey(dst_node);
      el.copy.src = {{}, job.elements_offset, planner::ContiguousStrides(el.copy.shape)};
      sc.copy.src = {{}, job.scales_offset, planner::ContiguousStrides(sc.copy.shape)};
      if (src_node == me) {
        ASSIGN_OR_RETURN(PieceAt src, ResolveSide(slice, op, true));
        job.src_key = src.key;
        job.src = src.piece;
        QuantRegion& region = out.regions[el.src_key];
        region.jobs.push_back(std::move(job));
        region.size = at;
      }
    }
    if (dst_node == me && slice.workers[op.dst_worker].role == planner::Role::kRollout) out.pieces_in[op.dst_worker].insert(op.dst_piece);
    out.copies[op.index] = {std::move(el), std::move(sc)};
  }
  return out;
}

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
  ASSIGN_OR_RETURN(SenderQuant quant, PlanSenderQuant(slice, facts.me));
  plan.quant_out = quant.regions;
  plan.quant_pieces_in = quant.pieces_in;
  std::map<std::string, std::set<std::pair<int, int>>> nccl_pairs;  // per peer: (our GPU, the peer's GPU)
  RETURN_IF_ERROR(PlanRegions(slice, facts, quant, plan, nccl_pairs));
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
  const DeltaWritten delta_written = DeltaWrittenBoxes(slice, facts.me);
  for (uint32_t b = 0; b < slice.num_buckets; ++b) {
    std::sort(by_bucket[b].begin(), by_bucket[b].end(), [](const SliceOp* x, const SliceOp* y) { return x->index < y->index; });
    RETURN_IF_ERROR(PlanBucket(slice, facts, quant, by_bucket[b], b, delta_written, plan, plan.buckets[b]));
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
