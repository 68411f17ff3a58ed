#include "daemon/box_copy.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/box.h"

namespace wb::daemon {

void ForEachRun(const planner::Piece& piece, const planner::Box& box, int elem_size,
                const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const size_t rank = box.begin.size();
  if (rank == 0) {
    fn(piece.offset_bytes, 0, elem_size);
    return;
  }
  if (planner::BoxEmpty(box)) return;
  const size_t last = rank - 1;
  const bool contiguous_rows = piece.strides[last] == 1;
  const int64_t row_len = box.end[last] - box.begin[last];
  std::vector<int64_t> idx(box.begin);  // current coordinate (outer dims); idx[last] = begin
  int64_t packed = 0;
  while (true) {
    int64_t off = piece.offset_bytes;
    for (size_t d = 0; d < rank; ++d) off += (idx[d] - piece.box.begin[d]) * piece.strides[d] * elem_size;
    if (contiguous_rows) {
      fn(off, packed, row_len * elem_size);
      packed += row_len * elem_size;
    } else {
      const int64_t step = piece.strides[last] * elem_size;
      for (int64_t i = 0; i < row_len; ++i) {
        fn(off + i * step, packed, elem_size);
        packed += elem_size;
      }
    }
    // Advance the outer coordinates (odometer), innermost outer dim first.
    int64_t d = static_cast<int64_t>(last) - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < box.end[d]) break;
      idx[d] = box.begin[d];
    }
    if (d < 0) return;
  }
}

void GatherBox(const uint8_t* base, const planner::Piece& piece, const planner::Box& box,
               int elem_size, uint8_t* out) {
  ForEachRun(piece, box, elem_size, [&](int64_t buf, int64_t packed, int64_t n) {
    std::memcpy(out + packed, base + buf, static_cast<size_t>(n));
  });
}

void ScatterBox(const uint8_t* in, const planner::Piece& piece, const planner::Box& box,
                int elem_size, uint8_t* base) {
  ForEachRun(piece, box, elem_size, [&](int64_t buf, int64_t packed, int64_t n) {
    std::memcpy(base + buf, in + packed, static_cast<size_t>(n));
  });
}

void CopyPiece(const uint8_t* src_base, const planner::Piece& piece, int elem_size,
               uint8_t* dst_base) {
  ForEachRun(piece, piece.box, elem_size, [&](int64_t buf, int64_t, int64_t n) {
    std::memcpy(dst_base + buf, src_base + buf, static_cast<size_t>(n));
  });
}

absl::Status CheckPieceInBuffer(const planner::Piece& piece, int elem_size, int64_t buffer_size,
                                const std::string& what) {
  if (piece.offset_bytes < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative offset"));
  int64_t last = piece.offset_bytes;
  for (size_t d = 0; d < piece.strides.size(); ++d) {
    if (piece.strides[d] < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative stride"));
    int64_t extent = piece.box.end[d] - piece.box.begin[d];
    if (extent <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": empty box"));
    last += (extent - 1) * piece.strides[d] * elem_size;
  }
  if (last + elem_size > buffer_size) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": piece ends at byte ", last + elem_size,
                                                   ", outside its buffer of ", buffer_size, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon
