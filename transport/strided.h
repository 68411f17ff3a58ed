#pragma once
// One side of a CopyOp as a sequence of contiguous byte runs, plus op validation. Every transport
// uses this so that "which byte goes where" is defined once (transport.h, "Copy ops").
//
// The op's elements, in row-major index order, form a LOGICAL byte stream [0, total_bytes). A side
// maps that stream onto its region: the trailing dims that are contiguous (stride 1 for the last,
// stride == product of inner extents for the others; dims of extent 1 never break contiguity) form
// a run of `run_bytes`; run r starts at RunOffset(r) in the region. Thread-compatible value type.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace wb::transport {

class StridedLayout {
 public:
  // INVALID_ARGUMENT for negative dims/strides/offset, element_size <= 0, rank mismatch or overflow.
  static absl::StatusOr<StridedLayout> Make(int64_t offset_bytes, const std::vector<int64_t>& shape,
                                            const std::vector<int64_t>& strides, int32_t element_size);

  int64_t total_bytes() const { return total_bytes_; }
  int64_t run_bytes() const { return run_bytes_; }
  int64_t num_runs() const { return num_runs_; }
  // Lowest and one-past-highest region byte touched; both 0 when total_bytes() == 0.
  int64_t min_byte() const { return min_byte_; }
  int64_t end_byte() const { return end_byte_; }

  // Region byte offset where run r (0 <= r < num_runs()) starts.
  int64_t RunOffset(int64_t r) const;

  // Calls f(region_offset, logical_offset, length) for the pieces of logical range [begin, end),
  // in logical order. Requires 0 <= begin <= end <= total_bytes().
  template <typename F>
  void ForEachPiece(int64_t begin, int64_t end, F&& f) const {
    while (begin < end) {
      const int64_t r = begin / run_bytes_;
      const int64_t within = begin - r * run_bytes_;
      const int64_t len = std::min(run_bytes_ - within, end - begin);
      f(RunOffset(r) + within, begin, len);
      begin += len;
    }
  }
  // Number of pieces ForEachPiece(begin, end) would produce.
  int64_t CountPieces(int64_t begin, int64_t end) const;

 private:
  int64_t offset_ = 0;
  int64_t total_bytes_ = 0;
  int64_t run_bytes_ = 1;
  int64_t num_runs_ = 0;
  int64_t min_byte_ = 0;
  int64_t end_byte_ = 0;
  // Outer (non-contiguous) dims, outermost first: extent and byte stride.
  std::vector<int64_t> outer_extent_;
  std::vector<int64_t> outer_stride_bytes_;
};

// Both sides of a validated op.
struct OpLayout {
  StridedLayout src;
  StridedLayout dst;
};

// Validates shape/strides/element size and that every touched byte lies inside [0, src_size) and
// [0, dst_size). Errors read "op <index>: ..." and name the region labels.
absl::StatusOr<OpLayout> ValidateOp(const CopyOp& op, int op_index, int64_t src_size, int64_t dst_size,
                                    const std::string& src_label, const std::string& dst_label);

// Calls f(src_offset, dst_offset, length) for the contiguous pieces of logical range [begin, end)
// common to both sides.
template <typename F>
void ForEachCopyPiece(const OpLayout& op, int64_t begin, int64_t end, F&& f) {
  op.src.ForEachPiece(begin, end, [&](int64_t src_off, int64_t logical, int64_t len) {
    op.dst.ForEachPiece(logical, logical + len, [&](int64_t dst_off, int64_t logical2, int64_t len2) {
      f(src_off + (logical2 - logical), dst_off, len2);
    });
  });
}

}  // namespace wb::transport
