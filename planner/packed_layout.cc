#include "planner/packed_layout.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wb::planner {
namespace {

// What Pack copies. A field added to Piece or Quantization must be packed and unpacked too (and
// this count updated): the round trip is what keeps plans made from a packed layout unchanged.
static_assert(sizeof(Piece) == 168, "planner::Piece changed: pack and unpack its new field (packed_layout.cc)");
static_assert(sizeof(Quantization) == 64, "planner::Quantization changed: pack and unpack its new field (packed_layout.cc)");

constexpr size_t kMaxRank = std::numeric_limits<uint8_t>::max();

std::vector<int64_t> ToVector(absl::Span<const int64_t> s) { return std::vector<int64_t>(s.begin(), s.end()); }

}  // namespace

absl::StatusOr<PackedLayout> PackedLayout::Pack(const WorkerLayout& layout) {
  PackedLayout out;
  out.buffers_ = layout.buffers;
  size_t coords = 0, quants = 0;
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const Piece& p = layout.pieces[i];
    const size_t block = p.quant.has_value() ? p.quant->block.size() : 0;
    if (p.box.begin.size() > kMaxRank || p.box.end.size() > kMaxRank || p.strides.size() > kMaxRank || block > kMaxRank) {
      return absl::InvalidArgumentError(absl::StrCat("piece ", i, ": more than ", kMaxRank, " dims (box ", p.box.begin.size(), "/",
                                                     p.box.end.size(), ", strides ", p.strides.size(), ", block ", block, ")"));
    }
    coords += p.box.begin.size() + p.box.end.size() + p.strides.size() + block;
    quants += p.quant.has_value() ? 1 : 0;
  }
  if (coords > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("layout of ", layout.pieces.size(), " pieces: ", coords, " coordinates, over 2^32"));
  }
  // Sized exactly once: no slack kept (capacity is what a holder pays for).
  out.pieces_.reserve(layout.pieces.size());
  out.quants_.reserve(quants);
  out.coords_.reserve(coords);
  auto append = [&out](const std::vector<int64_t>& v) { out.coords_.insert(out.coords_.end(), v.begin(), v.end()); };
  for (const Piece& p : layout.pieces) {
    Record r;
    r.offset_bytes = p.offset_bytes;
    r.coords = static_cast<uint32_t>(out.coords_.size());
    r.tensor = p.tensor;
    r.buffer = p.buffer;
    r.begin_rank = static_cast<uint8_t>(p.box.begin.size());
    r.end_rank = static_cast<uint8_t>(p.box.end.size());
    r.strides_rank = static_cast<uint8_t>(p.strides.size());
    append(p.box.begin);
    append(p.box.end);
    append(p.strides);
    if (p.quant.has_value()) {
      const Quantization& q = *p.quant;
      QuantRecord qr;
      qr.scale_offset_bytes = q.scale_offset_bytes;
      qr.global_scale_offset_bytes = q.global_scale_offset_bytes;
      qr.scale_buffer = q.scale_buffer;
      qr.block = static_cast<uint32_t>(out.coords_.size());
      qr.dtype = q.dtype;
      qr.scale_dtype = q.scale_dtype;
      qr.block_rank = static_cast<uint8_t>(q.block.size());
      append(q.block);
      r.quant = static_cast<int32_t>(out.quants_.size());
      out.quants_.push_back(qr);
      out.has_global_scales_ = out.has_global_scales_ || q.global_scale_offset_bytes >= 0;
    }
    out.pieces_.push_back(r);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const PackedLayout>> PackedLayout::PackShared(const WorkerLayout& layout) {
  absl::StatusOr<PackedLayout> packed = Pack(layout);
  if (!packed.ok()) return packed.status();
  return std::make_shared<const PackedLayout>(std::move(*packed));
}

Box PackedLayout::box(size_t i) const { return Box{ToVector(begin(i)), ToVector(end(i))}; }

std::optional<Quantization> PackedLayout::quant(size_t i) const {
  if (!quantized(i)) return std::nullopt;
  const QuantRecord& qr = quants_[pieces_[i].quant];
  Quantization q;
  q.dtype = qr.dtype;
  q.block = ToVector(Coords(qr.block, qr.block_rank));
  q.scale_buffer = qr.scale_buffer;
  q.scale_offset_bytes = qr.scale_offset_bytes;
  q.scale_dtype = qr.scale_dtype;
  q.global_scale_offset_bytes = qr.global_scale_offset_bytes;
  return q;
}

WorkerLayout PackedLayout::Unpack() const {
  WorkerLayout out;
  out.buffers = buffers_;
  out.pieces.resize(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    Piece& p = out.pieces[i];
    p.tensor = pieces_[i].tensor;
    p.box = box(i);
    p.buffer = pieces_[i].buffer;
    p.offset_bytes = pieces_[i].offset_bytes;
    p.strides = ToVector(strides(i));
    p.quant = quant(i);
  }
  return out;
}

bool PackedLayout::BoxContains(size_t i, const Box& inner) const {
  const absl::Span<const int64_t> b = begin(i), e = end(i);
  // As planner::BoxContains, for the well-formed boxes it is given (begin and end of one rank).
  if (b.size() != inner.begin.size() || e.size() != b.size() || inner.end.size() != b.size()) return false;
  for (size_t d = 0; d < b.size(); ++d) {
    if (inner.begin[d] < b[d] || inner.end[d] > e[d]) return false;
  }
  return true;
}

size_t PackedLayout::heap_bytes() const {
  return buffers_.capacity() * sizeof(BufferInfo) + pieces_.capacity() * sizeof(Record) + quants_.capacity() * sizeof(QuantRecord) +
         coords_.capacity() * sizeof(int64_t);
}

bool PackedLayout::operator==(const PackedLayout& other) const {
  auto same_buffers = [&] {
    if (buffers_.size() != other.buffers_.size()) return false;
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].size_bytes != other.buffers_[i].size_bytes) return false;
    }
    return true;
  };
  auto same_pieces = [&] {
    if (pieces_.size() != other.pieces_.size()) return false;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Record& a = pieces_[i];
      const Record& b = other.pieces_[i];
      if (a.offset_bytes != b.offset_bytes || a.coords != b.coords || a.tensor != b.tensor || a.buffer != b.buffer || a.quant != b.quant ||
          a.begin_rank != b.begin_rank || a.end_rank != b.end_rank || a.strides_rank != b.strides_rank) {
        return false;
      }
    }
    return true;
  };
  auto same_quants = [&] {
    if (quants_.size() != other.quants_.size()) return false;
    for (size_t i = 0; i < quants_.size(); ++i) {
      const QuantRecord& a = quants_[i];
      const QuantRecord& b = other.quants_[i];
      if (a.scale_offset_bytes != b.scale_offset_bytes || a.global_scale_offset_bytes != b.global_scale_offset_bytes ||
          a.scale_buffer != b.scale_buffer || a.block != b.block || a.dtype != b.dtype || a.scale_dtype != b.scale_dtype ||
          a.block_rank != b.block_rank) {
        return false;
      }
    }
    return true;
  };
  return same_buffers() && same_pieces() && same_quants() && coords_ == other.coords_;
}

}  // namespace wb::planner
