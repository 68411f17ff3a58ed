#include "tests/e2e/vmm_layout.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wb::e2e {
namespace {

// [first byte, one past the last byte) of a piece in its buffer (strides are non-negative).
std::pair<int64_t, int64_t> Extent(const planner::Inventory& inventory, const planner::Piece& p) {
  const int64_t es = planner::DTypeSize(inventory.tensors[p.tensor].dtype);
  int64_t last = 0;  // elements
  for (size_t d = 0; d < p.strides.size(); ++d) last += (p.box.end[d] - p.box.begin[d] - 1) * p.strides[d];
  return {p.offset_bytes, p.offset_bytes + (last + 1) * es};
}

}  // namespace

absl::StatusOr<VmmLayout> SpreadOverVmmBuffers(const planner::Inventory& inventory, const planner::WorkerLayout& layout,
                                               int parts, int64_t gap) {
  if (parts < 1 || gap < 0) return absl::InvalidArgumentError(absl::StrCat("VMM buffers: parts ", parts, " and gap ", gap));
  if (layout.buffers.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("VMM buffers: the layout has ", layout.buffers.size(), " buffers, not one"));
  }
  const int64_t size = layout.buffers[0].size_bytes;
  // Cut candidates: starts of groups of pieces whose extents do not overlap the ones before.
  std::vector<std::pair<int64_t, int64_t>> ext;
  for (const planner::Piece& p : layout.pieces) {
    if (parts > 1 && p.quant.has_value()) {
      return absl::InvalidArgumentError("VMM buffers: a layout with quantised pieces stays in one buffer (--vmm_buffers=1)");
    }
    ext.push_back(Extent(inventory, p));
  }
  std::sort(ext.begin(), ext.end());
  std::vector<int64_t> candidates;
  int64_t reach = 0;
  for (size_t i = 0; i < ext.size(); ++i) {
    if (i > 0 && ext[i].first >= reach && ext[i].first > 0) candidates.push_back(ext[i].first);
    reach = std::max(reach, ext[i].second);
  }
  // Cuts spread evenly over the candidates (not over the bytes: one tensor, e.g. the embedding,
  // may hold most of them), so `parts` buffers come out whenever there are parts - 1 candidates.
  std::vector<int64_t> cuts = {0};
  const size_t m = candidates.size();
  for (int j = 1; j < parts && m > 0; ++j) {
    const int64_t c = candidates[static_cast<size_t>(j) * m / static_cast<size_t>(parts)];
    if (c > cuts.back()) cuts.push_back(c);
  }
  cuts.push_back(size);

  VmmLayout out;
  const size_t n = cuts.size() - 1;
  for (size_t j = 0; j < n; ++j) {
    out.layout.buffers.push_back({cuts[j + 1] - cuts[j]});
    out.offsets.push_back(cuts[j] + static_cast<int64_t>(j + 1) * gap);
  }
  out.bytes = size + static_cast<int64_t>(n) * gap;
  for (planner::Piece p : layout.pieces) {
    // The buffer whose range holds the piece's first byte holds all of it (cuts avoid pieces).
    const size_t j = static_cast<size_t>(std::upper_bound(cuts.begin(), cuts.end() - 1, p.offset_bytes) - cuts.begin()) - 1;
    p.buffer = static_cast<int32_t>(j);
    p.offset_bytes -= cuts[j];
    out.layout.pieces.push_back(std::move(p));
  }
  return out;
}

}  // namespace wb::e2e
