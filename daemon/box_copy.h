#pragma once
// Moving one canonical box between a worker's strided local memory and a packed (row-major over the
// box) byte stream. The packed order is the wire order between node daemons, so sender and receiver
// need only their own piece to agree on where each byte goes.

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "planner/types.h"

namespace wb::daemon {

// Calls fn(buffer_offset_bytes, packed_offset_bytes, run_bytes) for every contiguous run of `box`
// (which must lie inside piece.box) in packed order. Runs are whole innermost rows when the
// innermost stride is 1, single elements otherwise.
void ForEachRun(const planner::Piece& piece, const planner::Box& box, int elem_size,
                const std::function<void(int64_t, int64_t, int64_t)>& fn);

// Packs `box` out of buffer `base` (laid out as `piece`) into `out` (BoxVolume * elem_size bytes).
void GatherBox(const uint8_t* base, const planner::Piece& piece, const planner::Box& box,
               int elem_size, uint8_t* out);
// Unpacks `in` into buffer `base` at the places `piece` gives for `box`.
void ScatterBox(const uint8_t* in, const planner::Piece& piece, const planner::Box& box,
                int elem_size, uint8_t* base);
// Copies the whole piece from `src_base` to `dst_base`, both laid out as `piece` (staging -> live).
void CopyPiece(const uint8_t* src_base, const planner::Piece& piece, int elem_size,
               uint8_t* dst_base);

// OK when every byte `piece` addresses lies in [0, buffer_size) and strides are non-negative;
// INVALID_ARGUMENT naming `what` (e.g. the tensor and box) otherwise.
absl::Status CheckPieceInBuffer(const planner::Piece& piece, int elem_size, int64_t buffer_size,
                                const std::string& what);

}  // namespace wb::daemon
