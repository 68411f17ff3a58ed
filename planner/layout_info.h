#pragma once
// Layout discovery (pure): what a worker needs to size, fill and read its buffers BEFORE it
// registers them - each buffer's size and, per local tensor, its name, shape, dtype, buffer,
// offset and strides (docs/integration.md). The daemon answers DescribeLayout and
// RegisterLayoutResponse.layout from this (daemon/layout_discovery.h), wbctl layout prints it.
//
// Two sources:
//  - a preset (planner/presets.h): the framework's local tensors in the preset's packing order,
//    each at a kLocalTensorAlignment-aligned offset of buffer 0, stored row-major; a quantised
//    tensor is followed by its scales tensor ("<name>_scale_inv" / "<name>_scale"; NVFP4 also by
//    "<name>_scale_2", its float32 global scale);
//  - explicit pieces (or pieces an index probe resolved to): one local tensor per piece, named
//    after its canonical tensor (plus the box when the tensor has several pieces), with the
//    piece's own strides in canonical dim order; a quantised piece gets a scales tensor too (and
//    an NVFP4 one its global scale, one per distinct place, named after the first piece naming it).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/presets.h"
#include "planner/types.h"

namespace wb::planner {

struct LocalTensorInfo {
  std::string name;
  std::vector<int64_t> shape;    // local shape, elements (int4: unpacked elements)
  DType dtype = DType::kBF16;    // as stored (quantised element dtype; scale dtype for scales)
  int32_t buffer = 0;            // index into LayoutInfo::buffer_bytes / layout.buffers
  int64_t offset_bytes = 0;      // of element [0, ..., 0]
  std::vector<int64_t> strides;  // elements per local dim (int4: int4 elements)
  int64_t size_bytes = 0;        // bytes from offset_bytes to one past the last byte
  std::vector<int32_t> pieces;   // indices into LayoutInfo::layout.pieces stored in this tensor
  std::string scale_tensor;      // quantised: name of the local tensor holding its scales
  std::string scales_of;         // scales: name of the tensor they belong to
  // NVFP4 (float4_e2m1) pieces: their float32 second-level scale ("<name>_scale_2", ModelOpt's
  // weight_scale_2, shape [1]), and on that tensor the quantised tensor it belongs to.
  std::string global_scale_tensor;
  std::string global_scale_of;
};

struct LayoutInfo {
  // The least size of each buffer (index = piece buffer index). Presets: one buffer, the packed
  // size rounded up to kLocalTensorAlignment; pieces: one past the last byte any piece or scale
  // region of that buffer reaches.
  std::vector<int64_t> buffer_bytes;
  std::vector<LocalTensorInfo> tensors;
  WorkerLayout layout;      // the pieces; layout.buffers sized as buffer_bytes
  int64_t piece_bytes = 0;  // canonical bytes the pieces cover (model dtype): what one version moves in
};

// A preset's layout (PresetBuilder::Make) described. Its buffer is the preset's buffer 0.
LayoutInfo DescribePresetLayout(const Inventory& inventory, const PresetLayout& preset);

// Explicit pieces described. `layout.buffers` may be empty or too small: buffer_bytes is computed
// from the pieces (and the returned layout's buffers resized to it; at least `num_buffers`
// entries). INVALID_ARGUMENT naming the piece for an unknown tensor index, a box/stride rank
// mismatch, a negative stride or buffer index, or byte extents that overflow 64 bits.
absl::StatusOr<LayoutInfo> DescribePieces(const Inventory& inventory, const WorkerLayout& layout, int num_buffers = 0);
// The same, taking the layout over (no copy of 1e6 pieces).
absl::StatusOr<LayoutInfo> DescribePieces(const Inventory& inventory, WorkerLayout&& layout, int num_buffers = 0);

// One past the last byte of `piece` (its stored bytes, planner/quantized.h StoredBytes), or
// INVALID_ARGUMENT on negative strides / overflow. Empty boxes reach their offset.
absl::StatusOr<int64_t> PieceEndByte(const Inventory& inventory, const Piece& piece);

// INVALID_ARGUMENT naming `who` (e.g. "worker trainer/0 of model m, preset megatron rank 0"), the
// buffer, the bytes it needs and the bytes registered, when a registered size is smaller than the
// layout needs or a buffer is missing. `registered[i]` is buffer i's size.
absl::Status CheckBufferSizes(const LayoutInfo& info, const std::vector<int64_t>& registered, const std::string& who);

}  // namespace wb::planner
