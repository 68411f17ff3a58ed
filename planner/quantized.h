#pragma once
// Quantized rollout pieces (planner/types.h `Quantization`): the layout-level rules, pure.
//
// A quantized piece changes only where the worker keeps its box, never what travels: ops carry the
// canonical dtype. So the receiving node gives each quantized piece a "shadow" in its staging - a
// contiguous canonical-dtype copy of the box appended after the end of the piece's buffer - and
// every transfer addresses the shadow; once the version has landed, the node quantises each
// shadow into the piece's place and its scales (daemon/quantize.h) and commits as usual.
// StagingLayout() is that addressing; every node computes it from the same layout (the sender
// writes into the receiver's staging), so it must stay a pure function of the layout.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "planner/types.h"

namespace wb::planner {

// Bytes per element of `piece` in the worker's memory: the quantised dtype when set, else the
// tensor's (callers have validated piece.tensor).
int PieceElementSize(const Inventory& inventory, const Piece& piece);

// Blocks per canonical dim of a quantised piece: ceil(extent_d / block_d). Empty when unquantised.
std::vector<int64_t> ScaleShape(const Piece& piece);
int64_t ScaleCount(const Piece& piece);  // product of ScaleShape (0 when unquantised)
// Bytes per scale: DTypeSize(quant.scale_dtype) (float32: 4, float8_e8m0: 1).
int ScaleElementSize(const Quantization& quant);

// The quantisation rules of one piece (dtype pair, block rank and size, block alignment of the box,
// scale region inside its buffer and aligned to its scale size). Called by ValidateLayout, which adds the
// role check and the overlap check of the scale regions. `where` prefixes the message.
absl::Status CheckQuantization(const Inventory& inventory, const WorkerLayout& layout, const Piece& piece,
                               absl::string_view where);

bool HasQuantizedPieces(const WorkerLayout& layout);

// Alignment of each shadow inside the grown buffer.
inline constexpr int64_t kShadowAlignment = 256;

// The layout transfers use for a rollout's staging: `layout` with every quantised piece replaced
// by its shadow (same tensor and box, unquantised, contiguous row-major strides, at the next
// kShadowAlignment-aligned offset past the buffer's previous end; buffers grow accordingly).
// Identical to `layout` when nothing is quantised. Shadows are placed in piece order.
WorkerLayout StagingLayout(const Inventory& inventory, const WorkerLayout& layout);

}  // namespace wb::planner
