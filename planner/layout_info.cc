#include "planner/layout_info.h"

#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "base/status_macros.h"

namespace wb::planner {
namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Bytes of `n` elements of `dtype` (int4: two per byte, rounded up).
int64_t StoredSize(DType dtype, int64_t n) { return (n * DTypeBits(dtype) + 7) / 8; }

int64_t CanonicalBytes(const Inventory& inventory, const std::vector<Piece>& pieces) {
  int64_t bytes = 0;
  for (const Piece& p : pieces) bytes += BoxVolume(p.box) * DTypeSize(inventory.tensors[p.tensor].dtype);
  return bytes;
}

const char* ScaleSuffix(const Quantization& q) {
  // DeepSeek-V3 fp8 checkpoints call float32 block scales "weight_scale_inv"; MX and
  // compressed-tensors call theirs "weight_scale".
  return q.dtype == DType::kF8E4M3 && q.scale_dtype == DType::kF32 ? "_scale_inv" : "_scale";
}

}  // namespace

absl::StatusOr<int64_t> PieceEndByte(const Inventory& inventory, const Piece& piece) {
  if (piece.tensor < 0 || piece.tensor >= static_cast<int32_t>(inventory.tensors.size())) {
    return absl::InvalidArgumentError(absl::StrCat("piece names tensor index ", piece.tensor, " of ", inventory.tensors.size()));
  }
  // Built only for an error: once per piece it was most of the cost of describing 1e6 pieces.
  auto what = [&] { return absl::StrCat("piece of ", inventory.tensors[piece.tensor].name, " ", BoxToString(piece.box)); };
  if (piece.box.begin.size() != piece.box.end.size() || piece.strides.size() != piece.box.begin.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": box has ", piece.box.begin.size(), "/", piece.box.end.size(),
                                                   " dims and ", piece.strides.size(), " strides"));
  }
  if (piece.offset_bytes < 0) return absl::InvalidArgumentError(absl::StrCat(what(), ": negative offset ", piece.offset_bytes));
  if (piece.quant.has_value()) RETURN_IF_ERROR(CheckInt4Packing(piece, what()));
  // The stored bytes' view (a copy of the piece) only for quantised pieces: unquantised ones are
  // their own view, and copying each of 1e6 pieces cost three allocations apiece.
  std::optional<ByteView> quantised;
  const Piece* stored = &piece;
  int element_size = DTypeSize(inventory.tensors[piece.tensor].dtype);
  if (piece.quant.has_value()) {
    quantised = StoredBytes(inventory, piece);
    stored = &quantised->piece;
    element_size = quantised->element_size;
  }
  int64_t span = 0;
  for (size_t d = 0; d < stored->strides.size(); ++d) {
    const int64_t ext = stored->box.end[d] - stored->box.begin[d];
    if (ext <= 0) return piece.offset_bytes;  // empty box: no bytes
    if (stored->strides[d] < 0) return absl::InvalidArgumentError(absl::StrCat(what(), ": negative stride"));
    int64_t term = 0;
    if (__builtin_mul_overflow(ext - 1, stored->strides[d], &term) || __builtin_add_overflow(span, term, &span)) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ": strides overflow"));
    }
  }
  int64_t end = 0;
  if (__builtin_add_overflow(span, 1, &end) || __builtin_mul_overflow(end, element_size, &end) ||
      __builtin_add_overflow(end, piece.offset_bytes, &end)) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": offset ", piece.offset_bytes, " + extent overflows 64 bits"));
  }
  return end;
}

LayoutInfo DescribePresetLayout(const Inventory& inventory, const PresetLayout& preset) {
  LayoutInfo info;
  info.layout = preset.layout;
  for (const BufferInfo& b : preset.layout.buffers) info.buffer_bytes.push_back(b.size_bytes);
  info.piece_bytes = CanonicalBytes(inventory, preset.layout.pieces);
  for (const LocalTensor& lt : preset.local_tensors) {
    LocalTensorInfo t;
    t.name = lt.name;
    t.shape = lt.shape;
    t.dtype = lt.dtype;
    t.buffer = 0;
    t.offset_bytes = lt.offset_bytes;
    t.strides = ContiguousStrides(lt.shape);
    t.size_bytes = StoredSize(lt.dtype, Numel(lt.shape));
    for (int32_t k = lt.first_piece; k < lt.first_piece + lt.num_pieces; ++k) t.pieces.push_back(k);
    info.tensors.push_back(std::move(t));
  }
  // A quantised tensor's scales are the piece-less local tensor that holds its pieces' scale
  // regions (presets.cc QuantizePreset puts it right after the tensor).
  for (LocalTensorInfo& t : info.tensors) {
    if (t.pieces.empty()) continue;
    const Piece& p = preset.layout.pieces[t.pieces.front()];
    if (!p.quant.has_value()) continue;
    for (LocalTensorInfo& s : info.tensors) {
      if (!s.pieces.empty() || s.buffer != p.quant->scale_buffer) continue;
      if (p.quant->scale_offset_bytes >= s.offset_bytes && p.quant->scale_offset_bytes < s.offset_bytes + s.size_bytes) {
        t.scale_tensor = s.name;
        s.scales_of = t.name;
        break;
      }
    }
    const int64_t g = p.quant->global_scale_offset_bytes;
    if (g < 0) continue;
    for (LocalTensorInfo& s : info.tensors) {
      if (!s.pieces.empty() || s.buffer != p.quant->scale_buffer || s.dtype != DType::kF32) continue;
      if (g >= s.offset_bytes && g < s.offset_bytes + s.size_bytes) {
        t.global_scale_tensor = s.name;
        s.global_scale_of = t.name;
        break;
      }
    }
  }
  return info;
}

absl::StatusOr<LayoutInfo> DescribePieces(const Inventory& inventory, const WorkerLayout& layout, int num_buffers) {
  return DescribePieces(inventory, WorkerLayout(layout), num_buffers);
}

absl::StatusOr<LayoutInfo> DescribePieces(const Inventory& inventory, WorkerLayout&& moved, int num_buffers) {
  LayoutInfo info;
  info.layout = std::move(moved);
  const WorkerLayout& layout = info.layout;  // (its buffers are resized only at the end)
  std::map<int32_t, int> pieces_of;  // tensor -> pieces in the layout
  std::map<std::pair<int32_t, int64_t>, std::string> global_names;  // NVFP4 global scale place -> its name
  for (const Piece& p : layout.pieces) ++pieces_of[p.tensor];
  std::vector<int64_t> need(static_cast<size_t>(std::max(num_buffers, 0)), 0);
  auto reach = [&](int32_t buffer, int64_t end) -> absl::Status {
    if (buffer < 0) return absl::InvalidArgumentError(absl::StrCat("negative buffer index ", buffer));
    if (static_cast<size_t>(buffer) >= need.size()) need.resize(static_cast<size_t>(buffer) + 1, 0);
    need[buffer] = std::max(need[buffer], end);
    return absl::OkStatus();
  };
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const Piece& p = layout.pieces[i];
    absl::StatusOr<int64_t> end_or = PieceEndByte(inventory, p);
    if (!end_or.ok()) return Annotate(end_or.status(), absl::StrCat("piece ", i));
    const int64_t end = *end_or;
    RETURN_IF_ERROR(reach(p.buffer, end));
    const TensorSpec& spec = inventory.tensors[p.tensor];
    LocalTensorInfo t;
    t.name = pieces_of[p.tensor] > 1 ? absl::StrCat(spec.name, BoxToString(p.box)) : spec.name;
    for (size_t d = 0; d < p.box.begin.size(); ++d) t.shape.push_back(p.box.end[d] - p.box.begin[d]);
    t.dtype = p.quant.has_value() ? p.quant->dtype : spec.dtype;
    t.buffer = p.buffer;
    t.offset_bytes = p.offset_bytes;
    t.strides = p.strides;
    t.size_bytes = end - p.offset_bytes;
    t.pieces = {static_cast<int32_t>(i)};
    if (p.quant.has_value()) {
      LocalTensorInfo s;
      s.name = absl::StrCat(t.name, ScaleSuffix(*p.quant));
      s.shape = ScaleShape(p);
      s.dtype = p.quant->scale_dtype;
      s.buffer = p.quant->scale_buffer;
      s.offset_bytes = p.quant->scale_offset_bytes;
      s.strides = ContiguousStrides(s.shape);
      int64_t bytes = 0, scale_end = 0;
      if (s.offset_bytes < 0 || __builtin_mul_overflow(ScaleCount(p), ScaleElementSize(*p.quant), &bytes) ||
          __builtin_add_overflow(s.offset_bytes, bytes, &scale_end)) {
        return absl::InvalidArgumentError(absl::StrCat("piece ", i, " (", t.name, "): scale region at ", s.offset_bytes, " overflows"));
      }
      s.size_bytes = bytes;
      RETURN_IF_ERROR(reach(s.buffer, scale_end));
      s.scales_of = t.name;
      t.scale_tensor = s.name;
      // NVFP4: the global scale, described once per place (the first piece naming it names it).
      const int64_t g = p.quant->global_scale_offset_bytes;
      std::optional<LocalTensorInfo> gs;
      if (g >= 0) {
        auto [it, fresh] = global_names.emplace(std::make_pair(p.quant->scale_buffer, g), absl::StrCat(t.name, "_scale_2"));
        t.global_scale_tensor = it->second;
        if (fresh) {
          if (g > INT64_MAX - 4) return absl::InvalidArgumentError(absl::StrCat("piece ", i, " (", t.name, "): global scale at ", g, " overflows"));
          gs.emplace();
          gs->name = it->second;
          gs->shape = {1};
          gs->dtype = DType::kF32;
          gs->buffer = p.quant->scale_buffer;
          gs->offset_bytes = g;
          gs->strides = {1};
          gs->size_bytes = 4;
          gs->global_scale_of = t.name;
          RETURN_IF_ERROR(reach(gs->buffer, g + 4));
        }
      }
      info.tensors.push_back(std::move(t));
      info.tensors.push_back(std::move(s));
      if (gs.has_value()) info.tensors.push_back(*std::move(gs));
    } else {
      info.tensors.push_back(std::move(t));
    }
  }
  info.buffer_bytes = need;
  info.layout.buffers.resize(need.size());
  for (size_t b = 0; b < need.size(); ++b) info.layout.buffers[b].size_bytes = need[b];
  info.piece_bytes = CanonicalBytes(inventory, layout.pieces);
  return info;
}

absl::Status CheckBufferSizes(const LayoutInfo& info, const std::vector<int64_t>& registered, const std::string& who) {
  for (size_t b = 0; b < info.buffer_bytes.size(); ++b) {
    if (info.buffer_bytes[b] == 0) continue;  // a buffer no piece uses
    if (b >= registered.size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": the layout needs buffer ", b, " of ", info.buffer_bytes[b],
                                                     " bytes, but only ", registered.size(), " buffer(s) are registered"));
    }
    if (registered[b] < info.buffer_bytes[b]) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": buffer ", b, " needs ", info.buffer_bytes[b], " bytes, registered ",
                                                     registered[b], " (DescribeLayout / wbctl layout give the sizes before registering)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace wb::planner
