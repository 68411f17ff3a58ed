#pragma once
// Quantized rollout pieces (planner/types.h `Quantization`): the layout-level rules, pure.
//
// A quantized piece changes where the worker keeps its box. What travels into it: its quantised
// elements and scales when the plan flags its ops sender-quantised (planner/sender_quant.h; the
// coordinator's plans do where the sending node can quantise), else the canonical dtype
// (receiver-side quantisation, the fallback). For the fallback the receiving node gives each
// quantized piece a "shadow" in its staging - a contiguous canonical-dtype copy of the box appended
// after the end of the piece's buffer - and every such transfer addresses the shadow; once the
// version has landed, the node quantises each shadow into the piece's place and its scales
// (daemon/quantize.h) and commits as usual.
// StagingLayout() is that addressing; every node computes it from the same layout (the sender
// writes into the receiver's staging), so it must stay a pure function of the layout.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "planner/types.h"

namespace wb::planner {

// Where a piece's elements lie in its buffer, as bytes: `piece` addresses elements of
// `element_size` bytes with the piece's offset and strides. For unquantised and float8 pieces that
// is the piece itself with the element size of its (quantised) dtype. An int4 piece packs two
// elements per byte along its last dim: the view is the piece with the last extent halved (box end
// moved), every stride halved but the last (1), element size 1 - valid once CheckInt4Packing
// passed. Byte-level consumers (bounds, overlap runs, copies of the quantised bytes) use the view;
// the canonical box stays the piece's own.
struct ByteView {
  Piece piece;
  int element_size = 0;
};
ByteView StoredBytes(const Inventory& inventory, const Piece& piece);

// The int4 packing rules of a quantised piece (no-op for other pieces): last stride 1, the other
// strides even, the last extent even. `where` prefixes the message.
absl::Status CheckInt4Packing(const Piece& piece, absl::string_view where);

// Blocks per canonical dim of a quantised piece: ceil(extent_d / block_d). Empty when unquantised.
std::vector<int64_t> ScaleShape(const Piece& piece);
int64_t ScaleCount(const Piece& piece);  // product of ScaleShape (0 when unquantised)
// Bytes per scale: DTypeSize(quant.scale_dtype) (float32: 4, bfloat16/float16: 2, float8_e8m0: 1).
int ScaleElementSize(const Quantization& quant);

// The quantisation rules of one piece (dtype pair, block rank and size, block alignment of the box,
// scale region inside its buffer and aligned to its scale size). Called by ValidateLayout, which adds the
// role check and the overlap check of the scale regions. `where` prefixes the message.
absl::Status CheckQuantization(const Inventory& inventory, const WorkerLayout& layout, const Piece& piece,
                               absl::string_view where);

bool HasQuantizedPieces(const WorkerLayout& layout);
// Some piece has an NVFP4 global scale (Quantization::global_scale_offset_bytes >= 0): its node
// takes part in the version's magnitude exchange (daemon/coordinator/magnitude_book.h).
bool HasGlobalScales(const WorkerLayout& layout);

// Sender-side quantisation helpers (planner/sender_quant.h decides which ops use it).
// Whether `box` of a tensor of `shape` is a union of whole blocks of the tensor's global block
// grid: in every dim it starts on a multiple of block_d and ends on one or at the tensor's end.
// Then the box's scales are exactly a sub-grid of any covering piece's scales.
bool BoxOnBlockGrid(const Box& box, const std::vector<int64_t>& shape, const std::vector<int64_t>& block);
// Bytes of `box` (on the block grid) held in `quant`'s format: the quantised elements
// (DTypeBits(quant.dtype) each, rounded up to whole bytes) plus one scale per block.
int64_t QuantizedBoxBytes(const Box& box, const Quantization& quant);
// Same element dtype, scale dtype and block: one piece's quantised bytes are the other's.
bool SameQuantFormat(const Quantization& a, const Quantization& b);

// Alignment of each shadow inside the grown buffer.
inline constexpr int64_t kShadowAlignment = 256;

// The layout transfers use for a rollout's staging: `layout` with every quantised piece replaced
// by its shadow (same tensor and box, unquantised, contiguous row-major strides, at the next
// kShadowAlignment-aligned offset past the buffer's previous end; buffers grow accordingly).
// Identical to `layout` when nothing is quantised. Shadows are placed in piece order.
WorkerLayout StagingLayout(const Inventory& inventory, const WorkerLayout& layout);

}  // namespace wb::planner
