#include "daemon/digest/certify.h"

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "planner/box.h"

namespace wb::digest {

absl::StatusOr<CertifyOutcome> CertifySources(const daemon::node::Slice& slice, const std::string& me,
                                              const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline) {
  CertifyOutcome out;
  std::vector<StridedBox> boxes;
  std::vector<const daemon::node::CertifyBox*> of;  // per box: its entry
  for (const daemon::node::CertifyBox& c : slice.certify) {
    const std::string what = absl::StrCat("certified box ", planner::BoxToString(c.box), " of tensor ", c.tensor, " of slice worker ", c.worker);
    if (c.worker >= slice.workers.size() || c.worker >= slice.layouts.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": no such worker in the slice"));
    }
    if (slice.workers[c.worker].node_id != me) continue;
    const planner::WorkerLayout& layout = slice.layouts[c.worker];
    if (c.piece < 0 || static_cast<size_t>(c.piece) >= layout.pieces.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": piece ", c.piece, " is not in its layout"));
    }
    const planner::Piece& piece = layout.pieces[static_cast<size_t>(c.piece)];
    if (slice.inventory == nullptr || c.tensor < 0 || static_cast<size_t>(c.tensor) >= slice.inventory->tensors.size() ||
        piece.tensor != c.tensor) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": piece ", c.piece, " holds tensor ", piece.tensor, ", not this one"));
    }
    if (!planner::BoxInside(c.box, slice.inventory->tensors[static_cast<size_t>(c.tensor)].shape)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": not a box of the tensor's shape"));
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
    const int32_t es = planner::DTypeSize(slice.inventory->tensors[static_cast<size_t>(c.tensor)].dtype);
    int64_t offset = 0;
    ASSIGN_OR_RETURN(StridedBox box, BoxInRegion(what, at, c.box, es, r->second, &offset));
    out.bytes += planner::BoxVolume(c.box) * es;
    boxes.push_back(std::move(box));
    of.push_back(&c);
  }
  if (boxes.empty()) return out;
  ASSIGN_OR_RETURN(std::vector<Digest> found, DigestMany(boxes, threads, deadline));
  std::set<std::string> stale;
  for (size_t i = 0; i < found.size(); ++i) {
    const daemon::node::CertifyBox& c = *of[i];
    if (found[i] == c.digest) {
      ++out.boxes;
      continue;
    }
    const daemon::node::SliceWorker& w = slice.workers[c.worker];
    stale.insert(w.worker_id);
    if (!out.first_mismatch.empty()) continue;
    const std::string from = c.from_catch_up ? absl::StrCat("an earlier catch-up landed there (its op ", c.version_op, ")")
                                             : absl::StrCat("the version landed there (op ", c.version_op, " of its plan)");
    out.first_mismatch = absl::StrCat("source rollout ", w.worker_id, " on node ", w.node_id,
                                      " no longer holds the version it would serve: box ", planner::BoxToString(c.box), " of tensor ",
                                      slice.inventory->tensors[static_cast<size_t>(c.tensor)].name, " hashes to ", DigestHex(found[i]),
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
