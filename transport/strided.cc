#include "transport/strided.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wb::transport {
namespace {

bool MulOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

absl::StatusOr<StridedLayout> StridedLayout::Make(int64_t offset_bytes, const std::vector<int64_t>& shape,
                                                  const std::vector<int64_t>& strides, int32_t element_size) {
  if (element_size <= 0) return absl::InvalidArgumentError(absl::StrCat("element_size ", element_size, " <= 0"));
  if (shape.size() != strides.size()) {
    return absl::InvalidArgumentError(absl::StrCat("shape has ", shape.size(), " dims but strides has ",
                                                   strides.size(), " (shape [", absl::StrJoin(shape, ","),
                                                   "], strides [", absl::StrJoin(strides, ","), "])"));
  }
  if (offset_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("negative offset_bytes ", offset_bytes));
  int64_t elems = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) return absl::InvalidArgumentError(absl::StrCat("negative extent ", shape[d], " in dim ", d));
    if (strides[d] < 0) return absl::InvalidArgumentError(absl::StrCat("negative stride ", strides[d], " in dim ", d));
    if (MulOverflows(elems, shape[d], &elems)) return absl::InvalidArgumentError("element count overflows int64");
  }
  StridedLayout l;
  l.offset_ = offset_bytes;
  if (MulOverflows(elems, element_size, &l.total_bytes_)) return absl::InvalidArgumentError("byte count overflows");
  if (l.total_bytes_ == 0) {
    l.run_bytes_ = 1;
    l.num_runs_ = 0;
    return l;
  }
  // Merge the contiguous suffix into one run (in elements), then keep outer dims with extent > 1.
  int n = static_cast<int>(shape.size());
  int64_t run_elems = 1;
  int k = n;
  while (k > 0 && (shape[k - 1] == 1 || strides[k - 1] == run_elems)) {
    run_elems *= shape[k - 1];
    --k;
  }
  l.run_bytes_ = run_elems * element_size;
  l.num_runs_ = elems / run_elems;
  int64_t max_off = offset_bytes;
  for (int d = 0; d < k; ++d) {
    if (shape[d] == 1) continue;
    int64_t sb = 0;
    if (MulOverflows(strides[d], element_size, &sb)) return absl::InvalidArgumentError("stride overflows");
    int64_t span = 0;
    if (MulOverflows(shape[d] - 1, sb, &span) || __builtin_add_overflow(max_off, span, &max_off)) {
      return absl::InvalidArgumentError("byte extent overflows int64");
    }
    l.outer_extent_.push_back(shape[d]);
    l.outer_stride_bytes_.push_back(sb);
  }
  l.min_byte_ = offset_bytes;
  if (__builtin_add_overflow(max_off, l.run_bytes_, &l.end_byte_)) return absl::InvalidArgumentError("overflow");
  return l;
}

int64_t StridedLayout::RunOffset(int64_t r) const {
  int64_t off = offset_;
  for (int d = static_cast<int>(outer_extent_.size()) - 1; d >= 0 && r > 0; --d) {
    const int64_t e = outer_extent_[d];
    off += (r % e) * outer_stride_bytes_[d];
    r /= e;
  }
  return off;
}

int64_t StridedLayout::CountPieces(int64_t begin, int64_t end) const {
  if (begin >= end) return 0;
  return (end - 1) / run_bytes_ - begin / run_bytes_ + 1;
}

absl::StatusOr<OpLayout> ValidateOp(const CopyOp& op, int op_index, int64_t src_size, int64_t dst_size,
                                    const std::string& src_label, const std::string& dst_label) {
  auto side = [&](const StridedRef& ref, int64_t size, const std::string& label,
                  const char* which) -> absl::StatusOr<StridedLayout> {
    auto l = StridedLayout::Make(ref.offset_bytes, op.shape, ref.strides, op.element_size);
    if (!l.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("op ", op_index, " ", which, " (", label, "): ", l.status().message()));
    }
    if (l->total_bytes() > 0 && l->end_byte() > size) {
      return absl::InvalidArgumentError(absl::StrCat("op ", op_index, " ", which, " (", label, "): touches bytes [",
                                                     l->min_byte(), ", ", l->end_byte(),
                                                     ") but the region has ", size, " bytes"));
    }
    return l;
  };
  OpLayout out;
  auto s = side(op.src, src_size, src_label, "source");
  if (!s.ok()) return s.status();
  auto d = side(op.dst, dst_size, dst_label, "destination");
  if (!d.ok()) return d.status();
  out.src = std::move(*s);
  out.dst = std::move(*d);
  return out;
}

}  // namespace wb::transport
