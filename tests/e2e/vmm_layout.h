#pragma once
// Spreading a test worker's one-buffer layout over several buffers that all live in one CUDA VMM
// range (--memory=cuda_vmm of the e2e workers: one allocation, or several mapped back to back):
// shows that one fd handed to the daemon serves many buffers, each at its own offset. The cuts fall between pieces (never through a piece or
// through pieces that interleave), and every buffer is preceded by `gap` unused bytes of the
// allocation, so a daemon that ignored a buffer's offset would move bytes to the wrong place.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/types.h"

namespace wb::e2e {

struct VmmLayout {
  planner::WorkerLayout layout;  // the same pieces, over buffers 0..n-1
  std::vector<int64_t> offsets;  // buffer j lies at offsets[j] of the allocation
  int64_t bytes = 0;             // the allocation needs at least this much
};

// `layout` must have exactly one buffer and no quantised piece when parts > 1 (their scales would
// need cutting too). Fewer than `parts` buffers come out when the pieces offer fewer cut points.
// INVALID_ARGUMENT for parts < 1, gap < 0 or such a layout.
absl::StatusOr<VmmLayout> SpreadOverVmmBuffers(const planner::Inventory& inventory, const planner::WorkerLayout& layout,
                                               int parts, int64_t gap);

}  // namespace wb::e2e
