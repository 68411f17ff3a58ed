#include "planner/quantized.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/box.h"
#include "base/status_macros.h"

namespace wb::planner {

ByteView StoredBytes(const Inventory& inventory, const Piece& piece) {
  ByteView v{piece, 0};
  if (!piece.quant.has_value()) {
    v.element_size = DTypeSize(inventory.tensors[piece.tensor].dtype);
    return v;
  }
  if (!IsPacked4(piece.quant->dtype) || piece.box.begin.empty()) {
    v.element_size = DTypeSize(piece.quant->dtype);
    return v;
  }
  const size_t last = piece.box.begin.size() - 1;
  v.element_size = 1;
  v.piece.box.end[last] = piece.box.begin[last] + (piece.box.end[last] - piece.box.begin[last]) / 2;
  for (size_t d = 0; d < last; ++d) v.piece.strides[d] = piece.strides[d] / 2;
  v.piece.strides[last] = 1;
  return v;
}

absl::Status CheckInt4Packing(const Piece& piece, absl::string_view where) {
  if (!piece.quant.has_value() || !IsPacked4(piece.quant->dtype)) return absl::OkStatus();
  const char* name = DTypeName(piece.quant->dtype);
  const size_t rank = piece.box.begin.size();
  if (rank == 0 || piece.strides.size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": an ", name, " piece needs at least one dim"));
  }
  const int64_t ext = piece.box.end[rank - 1] - piece.box.begin[rank - 1];
  if (piece.strides[rank - 1] != 1 || ext % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", name, " elements are packed two per byte along the last dim, so its stride must be 1 and its extent even (stride ",
                                                   piece.strides[rank - 1], ", extent ", ext, ")"));
  }
  for (size_t d = 0; d + 1 < rank; ++d) {
    if (piece.strides[d] % 2 != 0 && piece.box.end[d] - piece.box.begin[d] > 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", name, " stride of dim ", d, " is ", piece.strides[d],
                                                     " elements, not a whole number of bytes (must be even)"));
    }
  }
  return absl::OkStatus();
}

int ScaleElementSize(const Quantization& quant) { return DTypeSize(quant.scale_dtype); }

std::vector<int64_t> ScaleShape(const Piece& piece) {
  std::vector<int64_t> out;
  if (!piece.quant.has_value()) return out;
  for (size_t d = 0; d < piece.box.begin.size() && d < piece.quant->block.size(); ++d) {
    const int64_t ext = piece.box.end[d] - piece.box.begin[d];
    const int64_t b = piece.quant->block[d];
    out.push_back(b > 0 ? (ext + b - 1) / b : 0);
  }
  return out;
}

int64_t ScaleCount(const Piece& piece) {
  if (!piece.quant.has_value()) return 0;
  int64_t n = 1;
  for (int64_t s : ScaleShape(piece)) n *= s;
  return n;
}

absl::Status CheckQuantization(const Inventory& inventory, const WorkerLayout& layout, const Piece& piece,
                               absl::string_view where) {
  const Quantization& q = *piece.quant;
  const TensorSpec& t = inventory.tensors[piece.tensor];
  if (q.dtype != DType::kF8E4M3 && q.dtype != DType::kI4 && q.dtype != DType::kF4E2M1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": quantised dtype ", DTypeName(q.dtype),
                                                   " is not supported (float8_e4m3, int4 or float4_e2m1)"));
  }
  if (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": cannot quantise a ", DTypeName(t.dtype),
                                                   " tensor (bfloat16, float16 or float32 only)"));
  }
  if (q.block.size() != t.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": quantisation block has rank ", q.block.size(),
                                                   ", the tensor has rank ", t.shape.size()));
  }
  int64_t block_elems = 1;
  for (size_t d = 0; d < q.block.size(); ++d) {
    if (q.block[d] < 1 || q.block[d] > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": quantisation block dim ", d, " is ", q.block[d],
                                                     " (must be in [1, 2^30])"));
    }
    if (__builtin_mul_overflow(block_elems, q.block[d], &block_elems)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": quantisation block too large"));
    }
    // Blocks live on the tensor's global grid (the scales of a TP shard are a slice of the full
    // tensor's): a box must not cut one.
    if (piece.box.begin[d] % q.block[d] != 0 || (piece.box.end[d] % q.block[d] != 0 && piece.box.end[d] != t.shape[d])) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": box is not aligned to the quantisation blocks ", absl::StrJoin(q.block, "x"), " in dim ", d,
          " (it must start on a multiple of ", q.block[d], " and end on one or at the tensor's end ", t.shape[d], ")"));
    }
  }
  if (q.scale_buffer < 0 || static_cast<size_t>(q.scale_buffer) >= layout.buffers.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": scale buffer ", q.scale_buffer, " not registered (",
                                                   layout.buffers.size(), " buffers)"));
  }
  if (q.dtype == DType::kF8E4M3 && q.scale_dtype != DType::kF32 && q.scale_dtype != DType::kE8M0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": scale dtype ", DTypeName(q.scale_dtype),
                                                   " is not supported for float8_e4m3 (float32 or float8_e8m0)"));
  }
  if (q.dtype == DType::kI4 && q.scale_dtype != DType::kBF16 && q.scale_dtype != DType::kF16 && q.scale_dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": scale dtype ", DTypeName(q.scale_dtype),
                                                   " is not supported for int4 (bfloat16, float16 or float32)"));
  }
  if (q.dtype == DType::kF4E2M1) {
    // NVFP4 as vLLM / ModelOpt define it: 16 elements per scale along the input (last) dim,
    // e4m3 scales, one float32 second-level scale.
    bool nvfp4_block = q.block.back() == 16;
    for (size_t d = 0; d + 1 < q.block.size(); ++d) nvfp4_block = nvfp4_block && q.block[d] == 1;
    if (!nvfp4_block || q.scale_dtype != DType::kF8E4M3) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": float4_e2m1 (NVFP4) needs blocks of 16 along the last dim (1x...x16, got ",
                                                     absl::StrJoin(q.block, "x"), ") and float8_e4m3 scales (got ", DTypeName(q.scale_dtype), ")"));
    }
    const int64_t size = layout.buffers[q.scale_buffer].size_bytes;
    if (q.global_scale_offset_bytes < 0 || q.global_scale_offset_bytes % 4 != 0 || q.global_scale_offset_bytes > size - 4) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": float4_e2m1 (NVFP4) needs its float32 global scale inside scale buffer ",
                                                      q.scale_buffer, " (", size, " bytes) at a multiple of 4 (got offset ",
                                                      q.global_scale_offset_bytes, ")"));
    }
  } else if (q.global_scale_offset_bytes != -1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a global scale is for float4_e2m1 (NVFP4) pieces only, not ", DTypeName(q.dtype)));
  }
  RETURN_IF_ERROR(CheckInt4Packing(piece, where));
  const int scale_size = ScaleElementSize(q);
  if (q.scale_offset_bytes < 0 || q.scale_offset_bytes % scale_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": scale offset ", q.scale_offset_bytes, " negative or not a multiple of ",
                                                   scale_size, " (", DTypeName(q.scale_dtype), " scales)"));
  }
  int64_t bytes = 0;  // count <= box volume <= 2^62 (ValidateLayout), times the scale size may not fit
  if (__builtin_mul_overflow(ScaleCount(piece), static_cast<int64_t>(scale_size), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": scale region too large"));
  }
  const int64_t size = layout.buffers[q.scale_buffer].size_bytes;
  if (q.scale_offset_bytes > size || bytes > size - q.scale_offset_bytes) {
    const int64_t end = bytes > INT64_MAX - q.scale_offset_bytes ? INT64_MAX : q.scale_offset_bytes + bytes;  // for the message
    return absl::InvalidArgumentError(absl::StrCat(where, ": scales [", q.scale_offset_bytes, ", ", end, ") reach beyond buffer ",
                                                   q.scale_buffer, " of ", size, " bytes"));
  }
  return absl::OkStatus();
}

bool HasQuantizedPieces(const WorkerLayout& layout) {
  for (const Piece& p : layout.pieces) {
    if (p.quant.has_value()) return true;
  }
  return false;
}

bool HasGlobalScales(const WorkerLayout& layout) {
  for (const Piece& p : layout.pieces) {
    if (p.quant.has_value() && p.quant->global_scale_offset_bytes >= 0) return true;
  }
  return false;
}

bool BoxOnBlockGrid(const Box& box, const std::vector<int64_t>& shape, const std::vector<int64_t>& block) {
  if (block.size() != box.begin.size() || shape.size() != box.begin.size()) return false;
  for (size_t d = 0; d < block.size(); ++d) {
    if (block[d] < 1) return false;
    if (box.begin[d] % block[d] != 0) return false;
    if (box.end[d] % block[d] != 0 && box.end[d] != shape[d]) return false;
  }
  return true;
}

int64_t QuantizedBoxBytes(const Box& box, const Quantization& quant) {
  int64_t blocks = 1;
  for (size_t d = 0; d < box.begin.size() && d < quant.block.size(); ++d) {
    const int64_t ext = box.end[d] - box.begin[d];
    blocks *= quant.block[d] > 0 ? (ext + quant.block[d] - 1) / quant.block[d] : 0;
  }
  const int64_t bits = BoxVolume(box) * DTypeBits(quant.dtype);
  return (bits + 7) / 8 + blocks * ScaleElementSize(quant);
}

bool SameQuantFormat(const Quantization& a, const Quantization& b) {
  return a.dtype == b.dtype && a.scale_dtype == b.scale_dtype && a.block == b.block &&
         (a.global_scale_offset_bytes < 0) == (b.global_scale_offset_bytes < 0);
}

WorkerLayout StagingLayout(const Inventory& inventory, const WorkerLayout& layout) {
  WorkerLayout out = layout;
  if (!HasQuantizedPieces(layout)) return out;
  for (Piece& p : out.pieces) {
    if (!p.quant.has_value()) continue;
    p.quant.reset();
    std::vector<int64_t> extents;
    for (size_t d = 0; d < p.box.begin.size(); ++d) extents.push_back(p.box.end[d] - p.box.begin[d]);
    int64_t& end = out.buffers[p.buffer].size_bytes;
    const int64_t at = (end + kShadowAlignment - 1) / kShadowAlignment * kShadowAlignment;
    p.offset_bytes = at;
    p.strides = ContiguousStrides(extents);
    end = at + BoxVolume(p.box) * DTypeSize(inventory.tensors[p.tensor].dtype);
  }
  return out;
}

}  // namespace wb::planner
