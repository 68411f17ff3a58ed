#pragma once
// Index-probe extraction: a client runs an engine's own weight loader on "index tensors" (every
// canonical element's value is its canonical index) and hands us what landed in each local tensor.
// We recover the pieces: boxes, fused parts, splits, interleaves, transposes and flat ranges.
//
// Canonical index of element c of tensor t = TensorBases(inventory)[t] + row-major flat index of c.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/types.h"

namespace wb::planner {

// `probe` holds one int64 per local element in row-major order of `local_shape` (-1 = the element
// maps to nothing, e.g. vocab padding). The local tensor is contiguous and starts at byte
// `offset_bytes` of buffer `buffer`; each element is `element_size` bytes (must equal the dtype
// size of every canonical tensor it maps to). `bases` is TensorBases(inventory).
//
// Returns pieces covering exactly the mapped elements, each a canonical box with local strides
// (a local sub-box whose canonical coordinates are affine in the local ones, or a flat run
// decomposed into boxes). Runs in O(n * local rank). Inconsistent input (size mismatch, index out
// of range, dtype size mismatch) -> InvalidArgument; never crashes on arbitrary probe values, nor on
// values that change while it runs (`probe` may be a worker's shared memory): a value changed after
// it was checked is InvalidArgument, or lands in pieces the layout's validation judges.
absl::StatusOr<std::vector<Piece>> ExtractPieces(const Inventory& inventory, const std::vector<int64_t>& bases,
                                                 absl::Span<const int64_t> probe,
                                                 const std::vector<int64_t>& local_shape, int64_t offset_bytes,
                                                 int element_size, int32_t buffer = 0);

}  // namespace wb::planner
