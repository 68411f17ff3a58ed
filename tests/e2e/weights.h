#pragma once
// Canonical test weights in a worker's local memory: fill a trainer's pieces with the
// deterministic weights of a version (tests/common/weight_gen.h: value = f(tensor index, version,
// canonical flat element index)), and check every byte of a rollout's pieces against a version.
//
// Contract: `buffers[i]` is the mapped memory of layout buffer i, `sizes[i]` its length in bytes.
// Every piece is bounds-checked against its buffer before anything is touched (INVALID_ARGUMENT
// naming the tensor and box otherwise). Element (c_0..c_{n-1}) of a piece lives at
//   offset_bytes + sum_i (c_i - begin_i) * strides[i] * element_size
// (planner/types.h); its canonical flat index is the row-major index of c in the tensor's shape.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/types.h"

namespace wb::e2e {

struct MemoryView {
  std::vector<void*> buffers;
  std::vector<int64_t> sizes;
};

// Process-wide: versions in which a share `fraction` of the elements changes from one version to
// the next (tests/common/weight_gen.h DeltaElementBits; bench:e2e --delta); 0 (the default) =
// every element changes (ElementBits). Call before any Fill / Verify.
void SetDeltaFraction(double fraction);

// Writes version `version`'s weights into every element of every piece. Returns bytes written.
absl::StatusOr<int64_t> FillPieces(const planner::Inventory& inventory,
                                   const planner::WorkerLayout& layout, const MemoryView& memory,
                                   uint64_t version);

struct VerifyResult {
  int64_t elements = 0;    // elements checked
  int64_t bytes = 0;       // bytes checked
  int64_t mismatches = 0;  // elements that differ from the expected version
  std::string first_mismatch;  // "tensor <name> element [i, j] (piece k): ..." when mismatches > 0
};

// Compares every element of every piece with version `version`'s weights. Versions start at 1;
// `version` 0 means "never written": every piece byte must be zero (fresh shm is zero-filled).
absl::StatusOr<VerifyResult> VerifyPieces(const planner::Inventory& inventory,
                                          const planner::WorkerLayout& layout,
                                          const MemoryView& memory, uint64_t version);

}  // namespace wb::e2e
