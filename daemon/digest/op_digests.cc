#include "daemon/digest/op_digests.h"

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

}  // namespace

absl::StatusOr<OpDigests> DigestLocalOps(const daemon::node::Slice& slice, const std::string& me, const std::set<uint32_t>& at_commit,
                                         const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline) {
  OpDigests out;
  std::map<BoxKey, size_t> index;  // box -> position in `boxes`
  std::vector<StridedBox> boxes;
  std::vector<std::pair<std::map<uint32_t, Digest>*, std::pair<uint32_t, size_t>>> wanted;  // (side map, (op, box))
  auto local = [&](uint32_t w) { return w < slice.workers.size() && slice.workers[w].node_id == me; };
  // Adds the box an op side covers; false when that side is in device memory.
  auto add = [&](const SliceOp& op, const PieceAt& at, std::map<uint32_t, Digest>* into) -> absl::StatusOr<bool> {
    auto r = regions.find(at.key);
    if (r == regions.end()) return absl::InternalError(absl::StrCat("digests: op ", op.index, ": region ", at.key, " is not a region of node ", me));
    if (r->second.host == nullptr) return false;
    if (slice.inventory == nullptr || op.tensor < 0 || static_cast<size_t>(op.tensor) >= slice.inventory->tensors.size()) {
      return absl::InternalError(absl::StrCat("digests: op ", op.index, ": tensor ", op.tensor, " is not in the inventory"));
    }
    const int32_t es = planner::DTypeSize(slice.inventory->tensors[static_cast<size_t>(op.tensor)].dtype);
    const transport::StridedRef ref = daemon::RefFor(at.piece, op.box, es, {});
    StridedBox box;
    box.element_size = es;
    box.strides = ref.strides;
    int64_t last = ref.offset_bytes;  // byte offset of the box's last element
    bool empty = false;
    for (size_t d = 0; d < op.box.begin.size(); ++d) {
      box.shape.push_back(op.box.end[d] - op.box.begin[d]);
      empty = empty || box.shape.back() <= 0;
      if (d < ref.strides.size()) last += (box.shape.back() - 1) * ref.strides[d] * es;
    }
    if (box.shape.size() != box.strides.size()) {
      return absl::InternalError(absl::StrCat("digests: op ", op.index, ": box of rank ", box.shape.size(), " in a piece of rank ", box.strides.size()));
    }
    if (!empty && (ref.offset_bytes < 0 || last + es > r->second.size)) {
      return absl::InternalError(absl::StrCat("digests: op ", op.index, ": box ", planner::BoxToString(op.box), " of region ", at.key,
                                              " reaches byte ", last + es, " of ", r->second.size));
    }
    box.base = empty ? nullptr : r->second.host + ref.offset_bytes;
    BoxKey key{at.key, ref.offset_bytes, box.shape, box.strides, es};
    auto [it, inserted] = index.emplace(std::move(key), boxes.size());
    if (inserted) {
      int64_t n = es;
      for (int64_t s : box.shape) n *= std::max<int64_t>(s, 0);
      out.bytes += n;
      boxes.push_back(std::move(box));
    }
    wanted.push_back({into, {op.index, it->second}});
    return true;
  };
  for (const SliceOp& op : slice.ops) {
    const bool s = local(op.src_worker), d = local(op.dst_worker);
    if (!s && !d) continue;
    if (s) {
      ASSIGN_OR_RETURN(PieceAt src, daemon::node::ResolveSide(slice, op, true));
      ASSIGN_OR_RETURN(bool done, add(op, src, &out.source));
      if (!done) ++out.skipped_sides;
      if (at_commit.count(op.index) > 0) {
        // Left to the commit: what will be copied into live memory is the source box itself.
        if (done) {
          ASSIGN_OR_RETURN(done, add(op, src, &out.landed));
        }
        if (!done) ++out.skipped_sides;
        continue;
      }
    }
    if (d) {
      ASSIGN_OR_RETURN(PieceAt dst, daemon::node::ResolveSide(slice, op, false));
      ASSIGN_OR_RETURN(bool done, add(op, dst, &out.landed));
      if (!done) ++out.skipped_sides;
    }
  }
  ASSIGN_OR_RETURN(std::vector<Digest> digests, DigestMany(boxes, threads, deadline));
  for (auto& [into, at] : wanted) (*into)[at.first] = digests[at.second];
  return out;
}

}  // namespace wb::digest
