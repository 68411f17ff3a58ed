#include "daemon/digest/op_digests.h"

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/node/live_copy.h"
#include "planner/box.h"
#include "base/status_macros.h"

namespace wb::digest {
namespace {

using daemon::node::PieceAt;
using daemon::node::SliceOp;

// One box to hash, keyed by where it lives (equal keys: equal bytes).
using BoxKey = std::tuple<std::string, int64_t, std::vector<int64_t>, std::vector<int64_t>, int32_t>;

// (shape, strides) with dims of size 1 dropped and neighbours merged where the outer one steps
// exactly over the inner one (row-major contiguous): the element order is unchanged, so two sides
// with equal forms (same offset and element size) list the same bytes in the same order - e.g. a
// route's copy flattened to one run and the box it covers.
std::pair<std::vector<int64_t>, std::vector<int64_t>> Merged(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  std::pair<std::vector<int64_t>, std::vector<int64_t>> m;
  for (size_t d = 0; d < shape.size() && d < strides.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!m.first.empty() && m.second.back() == strides[d] * shape[d]) {
      m.first.back() *= shape[d];
      m.second.back() = strides[d];
      continue;
    }
    m.first.push_back(shape[d]);
    m.second.push_back(strides[d]);
  }
  return m;
}

// The canonical stream of `box` (at `offset` of its region) is the logical stream of a copy side
// (`shape`, `side`, `element_size`).
bool SameStream(const StridedBox& box, int64_t offset, const std::vector<int64_t>& shape, const transport::StridedRef& side, int32_t element_size) {
  return element_size == box.element_size && side.offset_bytes == offset && shape.size() == side.strides.size() &&
         Merged(shape, side.strides) == Merged(box.shape, box.strides);
}

}  // namespace

struct OpDigestTracker::Boxes {
  struct Side {
    bool landed = false;  // OpDigests::landed, else ::source
    uint32_t op = 0;
    size_t box = 0;
  };
  OpDigests out;  // bytes and skipped_sides; the digests come with Finish
  std::vector<StridedBox> boxes;
  std::vector<std::string> key;          // per box: its region
  std::vector<std::set<uint32_t>> deps;  // per box: ops whose landing here it waits for
  std::vector<Side> sides;
  // Tracking: per box the ops of `deps` not landed yet, whether it was queued and its pool id.
  std::vector<size_t> waits;
  std::vector<bool> queued;
  std::vector<size_t> pool_id;
  std::map<uint32_t, int64_t> route_ops_left;       // op -> its route ops landing here not done yet
  std::map<uint32_t, std::vector<size_t>> waiters;  // op -> boxes waiting for it
  std::set<std::string> written;                    // regions this version's buckets write here
  // Per box: final (nothing left to land in it; queued unless a transport is still to hash it),
  // transport hashings still expected, the digest when a transport hashed it whole, its stream
  // bytes and whether it has a landed side (cost split).
  std::vector<bool> ready, have, landed_box;
  std::vector<int> tcp_pending;
  std::vector<Digest> digest;
  std::vector<int64_t> box_bytes;
  std::vector<int64_t> box_offset;  // byte offset of the box in its region
  // The delta codec's hashes still expected: per box, and per side (op, landed) the calls left.
  std::vector<int> codec_pending;
  std::map<std::pair<uint32_t, bool>, int> codec_left;
  std::map<std::pair<uint32_t, bool>, size_t> side_box;  // (op, landed) -> box
  // Host-channel routes whose ops the transport may hash: route -> (position in its ops, box), and
  // the UnitHashes PrepareBatch attached to their batches.
  std::map<const daemon::node::Route*, std::vector<std::pair<size_t, size_t>>> tcp_routes;
  std::map<const daemon::node::Route*, std::shared_ptr<transport::UnitHashes>> attached;
};

absl::StatusOr<StridedBox> BoxInRegion(const std::string& what, const PieceAt& at, const planner::Box& box, int32_t element_size,
                                        const RegionBytes& region, int64_t* offset) {
  const int32_t es = element_size;
  const transport::StridedRef ref = daemon::RefFor(at.piece, box, es, {});
  StridedBox out;
  out.element_size = es;
  out.strides = ref.strides;
  int64_t last = ref.offset_bytes;  // byte offset of the box's last element
  bool empty = false;
  for (size_t d = 0; d < box.begin.size() && d < box.end.size(); ++d) {
    out.shape.push_back(box.end[d] - box.begin[d]);
    empty = empty || out.shape.back() <= 0;
    if (d < ref.strides.size()) last += (out.shape.back() - 1) * ref.strides[d] * es;
  }
  if (out.shape.size() != out.strides.size()) {
    return absl::InternalError(absl::StrCat(what, ": box of rank ", out.shape.size(), " in a piece of rank ", out.strides.size()));
  }
  if (!empty && (ref.offset_bytes < 0 || last + es > region.size)) {
    return absl::InternalError(absl::StrCat(what, ": box ", planner::BoxToString(box), " of region ", at.key, " reaches byte ", last + es,
                                            " of ", region.size));
  }
  out.base = empty ? nullptr : region.host + ref.offset_bytes;
  *offset = ref.offset_bytes;
  return out;
}

namespace {

// The boxes of every local op side (identical boxes once), as DigestLocalOps documents.
absl::StatusOr<std::unique_ptr<OpDigestTracker::Boxes>> Collect(const daemon::node::Slice& slice, const std::string& me,
                                                                 const std::set<uint32_t>& at_commit,
                                                                 const std::map<std::string, RegionBytes>& regions) {
  auto b = std::make_unique<OpDigestTracker::Boxes>();
  OpDigests& out = b->out;
  std::map<BoxKey, size_t> index;  // box -> position in `boxes`
  auto local = [&](uint32_t w) { return w < slice.workers.size() && slice.workers[w].node_id == me; };
  // Adds the box an op side covers; false when that side is in device memory.
  auto add = [&](const SliceOp& op, const PieceAt& at, bool landed) -> absl::StatusOr<bool> {
    auto r = regions.find(at.key);
    if (r == regions.end()) return absl::InternalError(absl::StrCat("digests: op ", op.index, ": region ", at.key, " is not a region of node ", me));
    if (r->second.host == nullptr) return false;
    if (slice.inventory == nullptr || op.tensor < 0 || static_cast<size_t>(op.tensor) >= slice.inventory->tensors.size()) {
      return absl::InternalError(absl::StrCat("digests: op ", op.index, ": tensor ", op.tensor, " is not in the inventory"));
    }
    const int32_t es = planner::DTypeSize(slice.inventory->tensors[static_cast<size_t>(op.tensor)].dtype);
    int64_t offset = 0;
    ASSIGN_OR_RETURN(StridedBox box, BoxInRegion(absl::StrCat("digests: op ", op.index), at, op.box, es, r->second, &offset));
    BoxKey key{at.key, offset, box.shape, box.strides, es};
    auto [it, inserted] = index.emplace(std::move(key), b->boxes.size());
    if (inserted) {
      int64_t n = es;
      for (int64_t s : box.shape) n *= std::max<int64_t>(s, 0);
      out.bytes += n;
      b->boxes.push_back(std::move(box));
      b->key.push_back(at.key);
      b->deps.emplace_back();
      b->box_bytes.push_back(n);
      b->box_offset.push_back(offset);
      b->landed_box.push_back(false);
    }
    b->sides.push_back({landed, op.index, it->second});
    b->side_box.emplace(std::make_pair(op.index, landed), it->second);
    if (landed) b->landed_box[it->second] = true;
    return true;
  };
  for (const SliceOp& op : slice.ops) {
    const bool s = local(op.src_worker), d = local(op.dst_worker);
    if (!s && !d) continue;
    // Sender-quantised (issue 17.1): what travels is the quantised bytes, which
    // node::DigestSenderQuantized digests on both sides; hashing the canonical boxes here would only
    // be overwritten (and competed with the sending node's quantiser for its cores).
    if (op.sender_quantized) continue;
    if (s) {
      ASSIGN_OR_RETURN(PieceAt src, daemon::node::ResolveSide(slice, op, true));
      ASSIGN_OR_RETURN(bool done, add(op, src, false));
      if (!done) ++out.skipped_sides;
      if (at_commit.count(op.index) > 0) {
        // Left to the commit: what will be copied into live memory is the source box itself.
        if (done) {
          ASSIGN_OR_RETURN(done, add(op, src, true));
        }
        if (!done) ++out.skipped_sides;
        continue;
      }
    }
    if (d) {
      ASSIGN_OR_RETURN(PieceAt dst, daemon::node::ResolveSide(slice, op, false));
      ASSIGN_OR_RETURN(bool done, add(op, dst, true));
      if (!done) ++out.skipped_sides;
    }
  }
  return b;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OpDigestTracker>> OpDigestTracker::Start(const daemon::node::Slice& slice, const std::string& me,
                                                                        const daemon::node::ExecPlan& plan,
                                                                        const std::map<std::string, RegionBytes>& regions, Options options) {
  ASSIGN_OR_RETURN(std::unique_ptr<Boxes> b, Collect(slice, me, plan.at_commit, regions));
  b->written = plan.written;
  // Which route ops land each op here, and in which region.
  std::map<std::string, std::set<uint32_t>> landing_in;  // region -> ops landing there
  for (const daemon::node::BucketPlan& bucket : plan.buckets) {
    for (const daemon::node::Route& r : bucket.routes) {
      for (const daemon::node::RouteOp& op : r.ops) {
        if (!op.dst_local) continue;
        ++b->route_ops_left[op.op_index];
        landing_in[op.dst_key].insert(op.op_index);
      }
    }
  }
  // A landed box waits for its op; a source box in a written region for every op landing there.
  for (const Boxes::Side& side : b->sides) {
    std::set<uint32_t>& deps = b->deps[side.box];
    if (side.landed && plan.at_commit.count(side.op) == 0) {
      if (b->route_ops_left.count(side.op) > 0) deps.insert(side.op);
    } else if (b->written.count(b->key[side.box]) > 0) {
      auto in = landing_in.find(b->key[side.box]);
      if (in != landing_in.end()) deps.insert(in->second.begin(), in->second.end());
    }
  }
  const size_t n = b->boxes.size();
  b->waits.resize(n);
  b->queued.assign(n, false);
  b->pool_id.assign(n, 0);
  b->ready.assign(n, false);
  b->have.assign(n, false);
  b->tcp_pending.assign(n, 0);
  b->codec_pending.assign(n, 0);
  b->digest.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    b->waits[i] = b->deps[i].size();
    for (uint32_t op : b->deps[i]) b->waiters[op].push_back(i);
    // Boxes no bucket writes are final now (a written region's box with nothing landing it here
    // waits for Finish: whatever writes it is not a batch this tracker hears of).
    b->ready[i] = b->waits[i] == 0 && b->written.count(b->key[i]) == 0;
  }
  if (options.overlap && options.in_transport) {
    // The local side of each canonical, non-delta op of a host-channel route: hashed as it crosses.
    for (const daemon::node::BucketPlan& bucket : plan.buckets) {
      for (const daemon::node::Route& r : bucket.routes) {
        if (r.kind != daemon::node::RouteKind::kPeer) continue;
        for (size_t pos = 0; pos < r.ops.size(); ++pos) {
          const daemon::node::RouteOp& op = r.ops[pos];
          // Delta ops too: when one travels in full, its copy is the route's (a stream standing in
          // is never: PrepareBatch tells them apart).
          if (op.part != daemon::node::RouteOp::Part::kCanonical || op.src_local == op.dst_local) continue;
          auto side = b->side_box.find({op.op_index, op.dst_local});
          if (side == b->side_box.end()) continue;  // device memory, sender-quantised
          b->tcp_routes[&r].push_back({pos, side->second});
          ++b->tcp_pending[side->second];
        }
      }
    }
  }
  if (options.overlap && !options.codec_sides.empty()) {
    // Delta ops' local sides the codec hashes as it packs / decodes them: only where the route op
    // copies exactly the side's box, so the codec's stream (the op's logical order) is the box's
    // canonical stream.
    for (const daemon::node::BucketPlan& bucket : plan.buckets) {
      for (const daemon::node::Route& r : bucket.routes) {
        if (r.kind != daemon::node::RouteKind::kPeer) continue;
        for (const daemon::node::RouteOp& op : r.ops) {
          if (op.part != daemon::node::RouteOp::Part::kCanonical || !op.delta || op.src_local == op.dst_local) continue;
          const std::pair<uint32_t, bool> side_key{op.op_index, op.dst_local};
          if (options.codec_sides.count(side_key) == 0) continue;
          auto side = b->side_box.find(side_key);
          if (side == b->side_box.end()) continue;  // device memory
          const size_t box = side->second;
          const StridedBox& sb = b->boxes[box];
          const transport::StridedRef& local = op.dst_local ? op.copy.dst : op.copy.src;
          const std::string& key = op.dst_local ? op.dst_key : op.src_key;
          if (key != b->key[box] || !SameStream(sb, b->box_offset[box], op.copy.shape, local, op.copy.element_size)) continue;
          ++b->codec_left[side_key];
          ++b->codec_pending[box];
        }
      }
    }
  }
  std::unique_ptr<OpDigestTracker> t(new OpDigestTracker(std::move(b), options));
  {
    absl::MutexLock l(&t->mu_);
    for (size_t i = 0; i < n; ++i) t->MaybeQueueLocked(i);
  }
  return t;
}

OpDigestTracker::OpDigestTracker(std::unique_ptr<Boxes> boxes, Options options) : options_(options), boxes_(std::move(boxes)) {
  DigestPool::Options po;
  po.threads = options.threads;
  po.deadline = options.deadline;
  po.nice = options.overlap ? options.nice : 0;
  pool_ = std::make_unique<DigestPool>(po);
}

// The pool stops (its destructor joins) before the boxes go.
OpDigestTracker::~OpDigestTracker() { pool_.reset(); }

void OpDigestTracker::QueueLocked(size_t box) {
  Boxes& b = *boxes_;
  if (b.queued[box]) return;
  b.queued[box] = true;
  absl::StatusOr<size_t> id = pool_->Add(b.boxes[box]);
  if (!id.ok()) {
    if (error_.ok()) error_ = id.status();
    return;
  }
  b.pool_id[box] = *id;
}

void OpDigestTracker::MaybeQueueLocked(size_t box) {
  const Boxes& b = *boxes_;
  if (!options_.overlap || !b.ready[box] || b.have[box] || b.tcp_pending[box] > 0 || b.codec_pending[box] > 0) return;
  QueueLocked(box);
}

void OpDigestTracker::PrepareBatch(const daemon::node::Route& route, transport::Batch& batch) {
  absl::MutexLock l(&mu_);
  Boxes& b = *boxes_;
  auto tr = b.tcp_routes.find(&route);
  if (tr == b.tcp_routes.end()) return;
  auto uh = std::make_shared<transport::UnitHashes>();
  uh->unit_bytes.assign(batch.ops.size(), 0);
  bool any = false;
  for (const auto& [pos, box] : tr->second) {
    if (pos >= batch.ops.size() || pos >= route.ops.size()) continue;
    const transport::CopyOp& c = batch.ops[pos];
    const transport::CopyOp& want = route.ops[pos].copy;
    const transport::StridedRef& local = route.ops[pos].dst_local ? c.dst : c.src;
    const StridedBox& sb = b.boxes[box];
    if (b.have[box]) continue;  // the delta codec hashed it already (it packed the source)
    // Only the route's own copy (a delta stream may stand in its place) over this very box: then
    // the op's logical stream is the box's canonical stream.
    const bool same = c.shape == want.shape && c.element_size == want.element_size && c.src.offset_bytes == want.src.offset_bytes &&
                      c.dst.offset_bytes == want.dst.offset_bytes && c.src.strides == want.src.strides && c.dst.strides == want.dst.strides &&
                      SameStream(sb, b.box_offset[box], c.shape, local, c.element_size);
    if (!same) continue;
    uh->unit_bytes[pos] = ChunkBytes(sb.element_size);
    any = true;
  }
  if (!any) return;
  batch.unit_hashes = uh;
  b.attached[&route] = std::move(uh);
}

void OpDigestTracker::TakeUnitHashesLocked(const daemon::node::Route& route) {
  Boxes& b = *boxes_;
  auto tr = b.tcp_routes.find(&route);
  if (tr == b.tcp_routes.end()) return;
  std::shared_ptr<transport::UnitHashes> uh;
  if (auto at = b.attached.find(&route); at != b.attached.end()) {
    uh = std::move(at->second);
    b.attached.erase(at);
  }
  const std::vector<std::pair<size_t, size_t>> ops = std::move(tr->second);
  b.tcp_routes.erase(tr);  // a route completes once
  for (const auto& [pos, box] : ops) {
    if (b.tcp_pending[box] > 0) --b.tcp_pending[box];
    if (!b.have[box] && uh != nullptr && pos < uh->complete.size() && uh->complete[pos] != 0) {
      absl::StatusOr<Digest> d = DigestFromChunks(b.box_bytes[box], b.boxes[box].element_size, uh->hashes[pos]);
      if (d.ok()) {
        b.have[box] = true;
        b.digest[box] = *d;
        b.out.transport_bytes += b.box_bytes[box];
      }
    }
    MaybeQueueLocked(box);
  }
}

void OpDigestTracker::CodecHashes(uint32_t op, bool landed, const std::vector<uint64_t>* chunk_hashes) {
  absl::MutexLock l(&mu_);
  Boxes& b = *boxes_;
  auto left = b.codec_left.find({op, landed});
  if (left == b.codec_left.end() || left->second <= 0) return;
  --left->second;
  const size_t box = b.side_box.at({op, landed});
  if (b.codec_pending[box] > 0) --b.codec_pending[box];
  if (!b.have[box] && chunk_hashes != nullptr) {
    absl::StatusOr<Digest> d = DigestFromChunks(b.box_bytes[box], b.boxes[box].element_size, *chunk_hashes);
    if (d.ok()) {
      b.have[box] = true;
      b.digest[box] = *d;
      b.out.codec_bytes += b.box_bytes[box];
    }
  }
  MaybeQueueLocked(box);
}

void OpDigestTracker::OnRouteDone(const daemon::node::Route& route) {
  absl::MutexLock l(&mu_);
  Boxes& b = *boxes_;
  TakeUnitHashesLocked(route);  // first: a landed box the transport hashed is never queued
  for (const daemon::node::RouteOp& op : route.ops) {
    if (!op.dst_local) continue;
    auto left = b.route_ops_left.find(op.op_index);
    if (left == b.route_ops_left.end() || left->second <= 0 || --left->second > 0) continue;
    auto w = b.waiters.find(op.op_index);
    if (w == b.waiters.end()) continue;
    for (size_t box : w->second) {
      if (b.waits[box] > 0 && --b.waits[box] == 0) {
        b.ready[box] = true;
        MaybeQueueLocked(box);
      }
    }
  }
}

absl::StatusOr<OpDigests> OpDigestTracker::Finish() {
  {
    absl::MutexLock l(&mu_);
    for (size_t i = 0; i < boxes_->boxes.size(); ++i) {
      if (!boxes_->have[i]) QueueLocked(i);
    }
    if (!error_.ok()) return error_;
  }
  ASSIGN_OR_RETURN(std::vector<Digest> digests, pool_->Finish());
  absl::MutexLock l(&mu_);
  const Boxes& b = *boxes_;
  OpDigests out = b.out;
  for (const Boxes::Side& side : b.sides) {
    (side.landed ? out.landed : out.source)[side.op] = b.have[side.box] ? b.digest[side.box] : digests[b.pool_id[side.box]];
  }
  for (size_t i = 0; i < b.boxes.size(); ++i) {
    if (b.have[i] || !b.queued[i]) continue;
    (b.landed_box[i] ? out.landed_hash_s : out.source_hash_s) += pool_->HashSeconds(b.pool_id[i]);
  }
  return out;
}

absl::StatusOr<OpDigests> DigestLocalOps(const daemon::node::Slice& slice, const std::string& me, const std::set<uint32_t>& at_commit,
                                         const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline) {
  daemon::node::ExecPlan plan;  // no routes: every box is hashed in Finish
  plan.at_commit = at_commit;
  OpDigestTracker::Options o;
  o.threads = std::max(1, threads) - 1;  // Finish's caller hashes too
  o.deadline = deadline;
  o.overlap = false;
  ASSIGN_OR_RETURN(std::unique_ptr<OpDigestTracker> t, OpDigestTracker::Start(slice, me, plan, regions, o));
  return t->Finish();
}

}  // namespace wb::digest
