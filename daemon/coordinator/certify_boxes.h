#pragma once
// Which boxes of a catch-up's sources are checked against the committed version's own digests
// (pb::CertifyBox, docs/daemon.md "Catch-up"; the node side is daemon/digest/certify.h). A catch-up
// proves with its own digests that what landed is what the sources read; these boxes prove that the
// sources still held the version when they served it. Pure: plain values in, slices amended.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "daemon/coordinator/digest_book.h"
#include "daemon/coordinator/slicer.h"
#include "planner/types.h"

namespace wb::daemon {

struct CertifyCount {
  int64_t boxes = 0;    // entries added (over all slices)
  int64_t sources = 0;  // sources with at least one
  int64_t uncovered_sources = 0;  // sources the plan reads from with no landed record to check against
};

// For every source of the catch-up `plan` (the ROLE_TRAINER workers of `in`) and every box of
// `landed[source]` (what the version landed in it) that intersects a box the plan reads from it and
// lies inside one of its pieces of the same form - an unquantised piece for a canonical digest, a
// quantised piece for a sender-quantised one (LandedBox::quantized; a quantised piece's memory holds
// quantised bytes, so a canonical digest of a receiver-quantised landing certifies nothing there):
// a CertifyBox in the slice of the source's node in `by_node` (nodes without a slice there are
// skipped). Each landed box is added at most once.
CertifyCount AddCertifyBoxes(const planner::Plan& plan, const SliceInput& in, const std::map<std::string, std::vector<LandedBox>>& landed,
                             std::map<std::string, pb::PlanSlice>* by_node);

}  // namespace wb::daemon
