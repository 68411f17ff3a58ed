#pragma once
// A WorkerLayout as a long-lived holder keeps it: flat. planner::Piece is ~170 bytes inline (its
// optional Quantization alone 72) plus three heap vectors (box begin / end, strides), ~260 bytes
// for a 2-D piece; a 1e6-piece layout the coordinator kept cost ~260 MB (docs/security.md, the
// size probe's entry). PackedLayout keeps per piece one 32-byte record and the piece's begin, end
// and strides in one shared array (48 bytes for 2-D), the quantised pieces' formats in another:
// ~80 bytes per 2-D piece and no allocation per piece.
//
// Unpack() gives back the very WorkerLayout that was packed (every field, in order), so what the
// planner is given - and the plan it makes - is unchanged; the accessors read single fields
// without unpacking a piece. Pure (no I/O, no protobuf), like the rest of the planner.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/types.h"

namespace wb::planner {

class PackedLayout {
 public:
  // INVALID_ARGUMENT for what the flat form cannot hold (a box or stride list of more than 255
  // dims, more than 2^32 coordinates in all); validated layouts are far inside both.
  static absl::StatusOr<PackedLayout> Pack(const WorkerLayout& layout);
  // The same, shared (what the coordinator keeps: immutable, read outside its lock).
  static absl::StatusOr<std::shared_ptr<const PackedLayout>> PackShared(const WorkerLayout& layout);

  // The layout that was packed, field for field.
  WorkerLayout Unpack() const;

  const std::vector<BufferInfo>& buffers() const { return buffers_; }
  size_t num_pieces() const { return pieces_.size(); }
  // Piece i's fields (i < num_pieces()).
  int32_t tensor(size_t i) const { return pieces_[i].tensor; }
  int32_t buffer(size_t i) const { return pieces_[i].buffer; }
  int64_t offset_bytes(size_t i) const { return pieces_[i].offset_bytes; }
  absl::Span<const int64_t> begin(size_t i) const { return Coords(pieces_[i].coords, pieces_[i].begin_rank); }
  absl::Span<const int64_t> end(size_t i) const {
    return Coords(pieces_[i].coords + pieces_[i].begin_rank, pieces_[i].end_rank);
  }
  absl::Span<const int64_t> strides(size_t i) const {
    return Coords(pieces_[i].coords + pieces_[i].begin_rank + pieces_[i].end_rank, pieces_[i].strides_rank);
  }
  bool quantized(size_t i) const { return pieces_[i].quant >= 0; }
  // Piece i's box (allocates) / quantisation (allocates; nullopt when unquantised).
  Box box(size_t i) const;
  std::optional<Quantization> quant(size_t i) const;
  // The quantisation's scalar fields without its block (unquantised pieces: -1 / -1).
  int32_t scale_buffer(size_t i) const { return quantized(i) ? quants_[pieces_[i].quant].scale_buffer : -1; }
  int64_t global_scale_offset_bytes(size_t i) const {
    return quantized(i) ? quants_[pieces_[i].quant].global_scale_offset_bytes : -1;
  }
  // planner::BoxContains(box(i), inner) without materialising box(i).
  bool BoxContains(size_t i, const Box& inner) const;

  // HasQuantizedPieces / HasGlobalScales (planner/quantized.h) of the packed layout, O(1).
  bool HasQuantizedPieces() const { return !quants_.empty(); }
  bool HasGlobalScales() const { return has_global_scales_; }

  // Heap bytes held (capacity), for what a holder keeps per piece.
  size_t heap_bytes() const;

  bool operator==(const PackedLayout& other) const;

 private:
  // One piece. begin, end and strides are coords_[coords ...] in that order (their own lengths:
  // the packed layout need not be validated to come back exactly).
  struct Record {
    int64_t offset_bytes = 0;
    uint32_t coords = 0;
    int32_t tensor = -1;
    int32_t buffer = 0;
    int32_t quant = -1;  // index into quants_, -1: unquantised
    uint8_t begin_rank = 0, end_rank = 0, strides_rank = 0;
  };
  static_assert(sizeof(Record) == 32, "a piece's record is meant to stay 32 bytes");
  struct QuantRecord {
    int64_t scale_offset_bytes = 0;
    int64_t global_scale_offset_bytes = -1;
    int32_t scale_buffer = 0;
    uint32_t block = 0;  // coords_[block ...], block_rank of them
    DType dtype = DType::kF8E4M3;
    DType scale_dtype = DType::kF32;
    uint8_t block_rank = 0;
  };

  absl::Span<const int64_t> Coords(uint32_t at, uint8_t n) const { return absl::MakeConstSpan(coords_.data() + at, n); }

  std::vector<BufferInfo> buffers_;
  std::vector<Record> pieces_;
  std::vector<QuantRecord> quants_;
  std::vector<int64_t> coords_;
  bool has_global_scales_ = false;
};

}  // namespace wb::planner
