#include "daemon/digest/certify.h"

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "planner/sender_quant.h"

namespace wb::digest {

namespace {

// One side of a quantised box (QuantElementsSide / QuantScalesSide) in `region` as a StridedBox;
// INTERNAL when it reaches outside the region (a slice that does not match the node's memory).
absl::StatusOr<StridedBox> QuantSide(const std::string& what, const std::string& key, const transport::CopyOp& copy,
                                     const transport::StridedRef& ref, const RegionBytes& region) {
  int64_t last = ref.offset_bytes;
  bool empty = false;
  for (size_t d = 0; d < copy.shape.size(); ++d) {
    empty = empty || copy.shape[d] <= 0;
    last += (copy.shape[d] - 1) * ref.strides[d] * copy.element_size;
  }
  if (empty) return StridedBox{nullptr, copy.shape, ref.strides, copy.element_size};
  if (ref.offset_bytes < 0 || last + copy.element_size > region.size) {
    return absl::InternalError(absl::StrCat(what, ": reaches byte ", last + copy.element_size, " of region ", key, " (", region.size, " bytes)"));
  }
  return StridedBox{region.host + ref.offset_bytes, copy.shape, ref.strides, copy.element_size};
}

}  // namespace

absl::StatusOr<CertifyOutcome> CertifySources(const daemon::node::Slice& slice, const std::string& me,
                                              const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline) {
  CertifyOutcome out;
  std::vector<StridedBox> boxes;
  // Per entry hashed: the entry and where its boxes start in `boxes` (a quantised entry has two,
  // elements then scales).
  std::vector<std::pair<const daemon::node::CertifyBox*, size_t>> of;
  for (const daemon::node::CertifyBox& c : slice.certify) {
    const std::string what = absl::StrCat("certified box ", planner::BoxToString(c.box), " of tensor ", c.tensor, " of slice worker ", c.worker);
    if (c.worker >= slice.workers.size() || c.worker >= slice.layouts.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": no such worker in the slice"));
    }
    if (slice.workers[c.worker].node_id != me) continue;
    // A quantised entry names a piece of the worker's own layout (its quantised pieces; staging
    // lays them out at the same places); a canonical one a piece of the staging layout.
    const bool own = c.quantized && c.worker < slice.live_layouts.size() && !slice.live_layouts[c.worker].pieces.empty();
    const planner::WorkerLayout& layout = own ? slice.live_layouts[c.worker] : slice.layouts[c.worker];
    if (c.piece < 0 || static_cast<size_t>(c.piece) >= layout.pieces.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": piece ", c.piece, " is not in its layout"));
    }
    const planner::Piece& piece = layout.pieces[static_cast<size_t>(c.piece)];
    if (slice.inventory == nullptr || c.tensor < 0 || static_cast<size_t>(c.tensor) >= slice.inventory->tensors.size() ||
        piece.tensor != c.tensor) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": piece ", c.piece, " holds tensor ", piece.tensor, ", not this one"));
    }
    const planner::TensorSpec& tensor = slice.inventory->tensors[static_cast<size_t>(c.tensor)];
    if (!planner::BoxInside(c.box, tensor.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": not a box of the tensor's shape"));
    }
    if (c.quantized) {
      if (!piece.quant.has_value() || !planner::BoxContains(piece.box, c.box) || !planner::BoxOnBlockGrid(c.box, tensor.shape, piece.quant->block)) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": not whole blocks inside quantised piece ", c.piece, " (", planner::BoxToString(piece.box), ")"));
      }
      // Only formats senders produce have such digests (node::DigestSenderQuantized).
      if (!planner::SenderCanQuantize(*piece.quant)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": piece ", c.piece, " holds ", planner::DTypeName(piece.quant->dtype),
                                                       ", a format no sender quantises to"));
      }
      const std::string el_key = daemon::node::RegionKey(c.worker, piece.buffer);
      const std::string sc_key = daemon::node::RegionKey(c.worker, piece.quant->scale_buffer);
      auto el = regions.find(el_key);
      auto sc = regions.find(sc_key);
      if (el == regions.end() || sc == regions.end()) {
        return absl::InternalError(absl::StrCat(what, ": region ", el == regions.end() ? el_key : sc_key, " is not a region of node ", me));
      }
      if (el->second.host == nullptr || sc->second.host == nullptr) {
        ++out.skipped;  // device memory: the host path cannot hash it
        continue;
      }
      transport::CopyOp el_copy, sc_copy;
      transport::StridedRef el_ref, sc_ref;
      daemon::node::QuantElementsSide(*slice.inventory, piece, c.box, el_copy, el_ref);
      daemon::node::QuantScalesSide(piece, c.box, sc_copy, sc_ref);
      ASSIGN_OR_RETURN(StridedBox eb, QuantSide(what, el_key, el_copy, el_ref, el->second));
      ASSIGN_OR_RETURN(StridedBox sb, QuantSide(what, sc_key, sc_copy, sc_ref, sc->second));
      out.bytes += el_copy.bytes() + sc_copy.bytes();
      of.push_back({&c, boxes.size()});
      boxes.push_back(std::move(eb));
      boxes.push_back(std::move(sb));
      continue;
    }
    if (piece.quant.has_value() || !planner::BoxContains(piece.box, c.box)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": not inside unquantised piece ", c.piece, " (", planner::BoxToString(piece.box), ")"));
    }
    daemon::node::PieceAt at;
    at.key = daemon::node::RegionKey(c.worker, piece.buffer);
    at.piece = piece;
    auto r = regions.find(at.key);
    if (r == regions.end()) return absl::InternalError(absl::StrCat(what, ": region ", at.key, " is not a region of node ", me));
    if (r->second.host == nullptr) {
      ++out.skipped;  // device memory: the host path cannot hash it
      continue;
    }
    const int32_t es = planner::DTypeSize(tensor.dtype);
    int64_t offset = 0;
    ASSIGN_OR_RETURN(StridedBox box, BoxInRegion(what, at, c.box, es, r->second, &offset));
    out.bytes += planner::BoxVolume(c.box) * es;
    of.push_back({&c, boxes.size()});
    boxes.push_back(std::move(box));
  }
  if (boxes.empty()) return out;
  ASSIGN_OR_RETURN(std::vector<Digest> hashed, DigestMany(boxes, threads, deadline));
  std::set<std::string> stale;
  for (const auto& [entry, at] : of) {
    const daemon::node::CertifyBox& c = *entry;
    const Digest found = c.quantized ? QuantizedDigest(hashed[at], hashed[at + 1]) : hashed[at];
    if (found == c.digest) {
      ++out.boxes;
      continue;
    }
    const daemon::node::SliceWorker& w = slice.workers[c.worker];
    stale.insert(w.worker_id);
    if (!out.first_mismatch.empty()) continue;
    const std::string from =
        c.quantized_here ? std::string(c.from_catch_up ? "its node quantised what an earlier catch-up landed there"
                                                       : "its node quantised what the version landed there")
        : c.from_catch_up ? absl::StrCat("an earlier catch-up landed there (its op ", c.version_op, ")")
                          : absl::StrCat("the version landed there (op ", c.version_op, " of its plan)");
    out.first_mismatch = absl::StrCat("source rollout ", w.worker_id, " on node ", w.node_id,
                                      " no longer holds the version it would serve: box ", planner::BoxToString(c.box), " of tensor ",
                                      slice.inventory->tensors[static_cast<size_t>(c.tensor)].name, (c.quantized ? " (quantised elements and scales)" : ""), " hashes to ", DigestHex(found),
                                      ", not to ", DigestHex(c.digest), " as when ", from, " (its memory was written since, or is torn)");
  }
  out.stale.assign(stale.begin(), stale.end());
  return out;
}

SourceCertification::~SourceCertification() {
  if (thread_.joinable()) thread_.join();
}

void SourceCertification::Start(const daemon::node::Slice& slice, std::string me, std::map<std::string, RegionBytes> regions, int threads,
                                absl::Time deadline) {
  started_ = true;
  thread_ = std::thread([this, &slice, me = std::move(me), regions = std::move(regions), threads, deadline] {
    result_ = CertifySources(slice, me, regions, threads, deadline);
  });
}

absl::StatusOr<CertifyOutcome> SourceCertification::Finish() {
  if (thread_.joinable()) thread_.join();
  return result_;
}

}  // namespace wb::digest
