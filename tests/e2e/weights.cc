#include "tests/e2e/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "base/status_macros.h"
#include "tests/common/weight_gen.h"

namespace wb::e2e {
namespace {

// SetDeltaFraction: 0 = tests/common/weight_gen.h's ElementBits (every element changes every
// version), else DeltaElementBits with that share of elements changing per version.
double g_delta_fraction = 0;

uint64_t VersionBits(uint32_t tensor, uint64_t version, uint64_t flat, int esize) {
  return g_delta_fraction > 0 ? DeltaElementBits(tensor, version, flat, esize, g_delta_fraction) : ElementBits(tensor, version, flat, esize);
}

// Checks that every byte a piece addresses lies inside its buffer.
absl::Status CheckPiece(const planner::Inventory& inventory, const planner::WorkerLayout& layout,
                        const MemoryView& memory, int piece_index) {
  const planner::Piece& p = layout.pieces[piece_index];
  if (p.tensor < 0 || p.tensor >= static_cast<int>(inventory.tensors.size())) {
    return absl::InvalidArgumentError(absl::StrCat("piece ", piece_index, " names tensor index ",
                                                   p.tensor, " outside the inventory"));
  }
  const planner::TensorSpec& t = inventory.tensors[p.tensor];
  auto where = [&] { return absl::StrCat("tensor ", t.name, " box ", planner::BoxToString(p.box)); };
  if (p.box.begin.size() != t.shape.size() || p.box.end.size() != t.shape.size() ||
      p.strides.size() != t.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": rank does not match shape"));
  }
  if (!planner::BoxInside(p.box, t.shape)) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": outside the tensor's shape"));
  }
  if (p.buffer < 0 || p.buffer >= static_cast<int>(memory.buffers.size())) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": buffer ", p.buffer, " not mapped"));
  }
  if (planner::BoxEmpty(p.box)) return absl::OkStatus();
  if (p.quant.has_value() && planner::IsPacked4(p.quant->dtype)) {
    RETURN_IF_ERROR(planner::CheckInt4Packing(p, where()));
  }
  // The bytes the piece occupies (int4: two elements per byte along the last dim).
  const planner::ByteView view = planner::StoredBytes(inventory, p);
  const int64_t esize = view.element_size;
  int64_t lo = p.offset_bytes, hi = p.offset_bytes;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    int64_t span = (view.piece.box.end[d] - view.piece.box.begin[d] - 1) * view.piece.strides[d] * esize;
    (span < 0 ? lo : hi) += span;
  }
  hi += esize;
  if (lo < 0 || hi > memory.sizes[p.buffer]) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": addresses bytes [", lo, ", ", hi,
                                                   ") outside buffer ", p.buffer, " of ",
                                                   memory.sizes[p.buffer], " bytes"));
  }
  if (p.quant.has_value()) {
    const planner::Quantization& q = *p.quant;
    const bool fp8_ok = q.dtype == planner::DType::kF8E4M3 && (q.scale_dtype == planner::DType::kF32 || q.scale_dtype == planner::DType::kE8M0);
    const bool int4_ok = q.dtype == planner::DType::kI4 && (q.scale_dtype == planner::DType::kBF16 || q.scale_dtype == planner::DType::kF16 ||
                                                            q.scale_dtype == planner::DType::kF32);
    const bool nvfp4_ok = q.dtype == planner::DType::kF4E2M1 && q.scale_dtype == planner::DType::kF8E4M3 &&
                          q.global_scale_offset_bytes >= 0 && q.scale_buffer >= 0 &&
                          q.scale_buffer < static_cast<int>(memory.buffers.size()) &&
                          q.global_scale_offset_bytes + 4 <= memory.sizes[q.scale_buffer];
    if ((!fp8_ok && !int4_ok && !nvfp4_ok) ||
        q.block.size() != t.shape.size() || q.scale_buffer < 0 ||
        q.scale_buffer >= static_cast<int>(memory.buffers.size())) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": malformed quantisation"));
    }
    int64_t count = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (q.block[d] < 1) return absl::InvalidArgumentError(absl::StrCat(where(), ": block < 1"));
      count *= (p.box.end[d] - p.box.begin[d] + q.block[d] - 1) / q.block[d];
    }
    if (q.scale_offset_bytes < 0 || q.scale_offset_bytes + planner::DTypeSize(q.scale_dtype) * count > memory.sizes[q.scale_buffer]) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": scales outside buffer ", q.scale_buffer));
    }
  }
  return absl::OkStatus();
}

// Calls fn(row_ptr, canonical_flat_of_first, local_stride_bytes_inner, canonical_inner_step, n)
// once per innermost row of the piece's box.
template <typename Fn>
void ForEachRow(const planner::TensorSpec& t, const planner::Piece& p, char* base, Fn fn) {
  const size_t rank = t.shape.size();
  const int64_t esize = planner::DTypeSize(t.dtype);
  if (rank == 0) {
    fn(base + p.offset_bytes, int64_t{0}, esize, int64_t{1}, int64_t{1});
    return;
  }
  std::vector<int64_t> cstride = planner::ContiguousStrides(t.shape);
  std::vector<int64_t> c(p.box.begin);  // current coordinate (inner dim fixed at begin)
  const size_t inner = rank - 1;
  const int64_t n = p.box.end[inner] - p.box.begin[inner];
  while (true) {
    int64_t flat = 0, local = 0;
    for (size_t d = 0; d < rank; ++d) {
      flat += c[d] * cstride[d];
      local += (c[d] - p.box.begin[d]) * p.strides[d];
    }
    fn(base + p.offset_bytes + local * esize, flat, p.strides[inner] * esize, cstride[inner], n);
    // Odometer over the outer dims.
    size_t d = inner;
    while (d > 0) {
      --d;
      if (++c[d] < p.box.end[d]) break;
      c[d] = p.box.begin[d];
      if (d == 0) return;
    }
    if (inner == 0) return;
  }
}

// Element values of a version as unsigned integers of the element's width (little-endian: the
// same bytes WriteWeight writes).
template <typename T>
void FillRow(uint32_t tensor, uint64_t version, int64_t flat, int64_t flat_step, char* dst,
             int64_t step_bytes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T v = static_cast<T>(VersionBits(tensor, version, static_cast<uint64_t>(flat + i * flat_step), sizeof(T)));
    std::memcpy(dst + i * step_bytes, &v, sizeof(T));
  }
}

template <typename T>
bool RowMatches(uint32_t tensor, uint64_t version, int64_t flat, int64_t flat_step,
                const char* src, int64_t step_bytes, int64_t n) {
  T diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    T want = version == 0 ? T{0}
                          : static_cast<T>(VersionBits(tensor, version,
                                                       static_cast<uint64_t>(flat + i * flat_step), sizeof(T)));
    T got;
    std::memcpy(&got, src + i * step_bytes, sizeof(T));
    diff |= static_cast<T>(want ^ got);
  }
  return diff == 0;
}

bool IsZero(const char* p, int n) {
  for (int i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

std::string Coord(const planner::TensorSpec& t, int64_t flat) {
  std::vector<int64_t> idx(t.shape.size());
  for (size_t d = t.shape.size(); d-- > 0;) {
    idx[d] = t.shape[d] ? flat % t.shape[d] : 0;
    flat = t.shape[d] ? flat / t.shape[d] : 0;
  }
  return absl::StrCat("[", absl::StrJoin(idx, ", "), "]");
}

// ---- Reference float8_e4m3fn block quantisation (independent of daemon/quantize: values by the
// format's definition, nearest code by search). Semantics: docs/daemon.md "Quantized targets".

float CanonicalValue(uint64_t bits, planner::DType dtype) {
  switch (dtype) {
    case planner::DType::kBF16: {
      const uint32_t b = static_cast<uint32_t>(bits & 0xffff) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
    case planner::DType::kF16: {
      const uint32_t h = static_cast<uint32_t>(bits & 0xffff);
      const int e = static_cast<int>((h >> 10) & 0x1f), m = static_cast<int>(h & 0x3ff);
      const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);  // e < 31 (ElementBits)
      return static_cast<float>((h & 0x8000) ? -mag : mag);
    }
    default: {
      const uint32_t b = static_cast<uint32_t>(bits);
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
  }
}

// The 127 non-negative finite e4m3 values, code c at index c.
const std::vector<double>& E4M3Values() {
  static const std::vector<double>* v = [] {
    auto* out = new std::vector<double>;
    for (int c = 0; c <= 0x7e; ++c) {
      const int e = c >> 3, m = c & 7;
      out->push_back(e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
    }
    return out;
  }();
  return *v;
}

uint8_t NearestE4M3(float x) {
  const std::vector<double>& v = E4M3Values();
  const double a = std::fabs(static_cast<double>(x));
  // First code >= a; then the nearer of it and its predecessor (ties: the even code).
  size_t hi = static_cast<size_t>(std::lower_bound(v.begin(), v.end(), a) - v.begin());
  size_t c;
  if (hi == v.size()) {
    c = v.size() - 1;  // beyond 448: saturate
  } else if (hi == 0) {
    c = 0;
  } else {
    const double dl = a - v[hi - 1], dh = v[hi] - a;
    c = dl < dh ? hi - 1 : dh < dl ? hi : ((hi - 1) % 2 == 0 ? hi - 1 : hi);
  }
  return static_cast<uint8_t>(c | (std::signbit(x) ? 0x80 : 0));
}

// A bfloat16 / float16 / float32 scale code as float.
float ScaleValue(const uint8_t* p, planner::DType dtype) {
  if (dtype == planner::DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  if (dtype == planner::DType::kBF16) {
    const uint32_t b = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -24) : e == 31 ? INFINITY : std::ldexp(1.0f + m / 1024.0f, e - 15);
  return (h & 0x8000) ? -mag : mag;
}

// The nearest `dtype` value to positive `x` (ties to the even code), by binary search over the
// codes - independent of the daemon's bit arithmetic.
float NearestScale(float x, planner::DType dtype) {
  if (dtype == planner::DType::kF32) return x;
  auto value = [&](uint16_t c) { return static_cast<double>(ScaleValue(reinterpret_cast<const uint8_t*>(&c), dtype)); };
  uint16_t lo = 0, hi = dtype == planner::DType::kBF16 ? 0x7f80 : 0x7c00;
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    (value(mid) <= x ? lo : hi) = mid;
  }
  const double dl = x - value(lo), dh = value(hi) - x;
  return static_cast<float>(dl < dh ? value(lo) : dh < dl ? value(hi) : value((lo & 1) == 0 ? lo : hi));
}

// Visits every element of quantised piece `p` in row-major order of its box:
// fn(local index, canonical flat index, block index on the box's block grid, element index from
// the piece's start = sum of index * stride, in elements of the quantised dtype). Returns the
// number of blocks.
template <typename Fn>
int64_t ForEachQuantElement(const planner::TensorSpec& t, const planner::Piece& p, Fn&& fn) {
  const planner::Quantization& q = *p.quant;
  const size_t rank = t.shape.size();
  std::vector<int64_t> ext(rank), grid(rank);
  int64_t count = 1;
  for (size_t d = 0; d < rank; ++d) {
    ext[d] = p.box.end[d] - p.box.begin[d];
    grid[d] = (ext[d] + q.block[d] - 1) / q.block[d];
    count *= grid[d];
  }
  const std::vector<int64_t> cstride = planner::ContiguousStrides(t.shape);
  std::vector<int64_t> idx(rank, 0);
  const int64_t n = planner::BoxVolume(p.box);
  for (int64_t k = 0; k < n; ++k) {
    int64_t flat = 0, block = 0, elem = 0;
    for (size_t d = 0; d < rank; ++d) {
      flat += (p.box.begin[d] + idx[d]) * cstride[d];
      block = block * grid[d] + idx[d] / q.block[d];
      elem += idx[d] * p.strides[d];
    }
    fn(idx, flat, block, elem);
    for (size_t d = rank; d-- > 0;) {
      if (++idx[d] < ext[d]) break;
      idx[d] = 0;
    }
  }
  return count;
}

// Checks int4 piece `pi` (compressed-tensors W4A16, daemon/quantize.h) against version `version`.
void VerifyInt4(const planner::Inventory& inventory, const planner::WorkerLayout& layout, const MemoryView& memory, int pi,
                uint64_t version, VerifyResult& result) {
  const planner::Piece& p = layout.pieces[pi];
  const planner::Quantization& q = *p.quant;
  const planner::TensorSpec& t = inventory.tensors[p.tensor];
  const int es = planner::DTypeSize(t.dtype);
  const int ss = planner::DTypeSize(q.scale_dtype);
  const uint8_t* base = static_cast<const uint8_t*>(memory.buffers[p.buffer]) + p.offset_bytes;
  const uint8_t* scale_base = static_cast<const uint8_t*>(memory.buffers[q.scale_buffer]) + q.scale_offset_bytes;
  auto value = [&](int64_t flat) {
    return CanonicalValue(VersionBits(static_cast<uint32_t>(p.tensor), version, static_cast<uint64_t>(flat), es), t.dtype);
  };
  // fn(local index, canonical flat index, block index, stored nibble): element e of the piece is in
  // byte e / 2, the low nibble when e is even.
  auto for_each = [&](auto&& fn) {
    return ForEachQuantElement(t, p, [&](const std::vector<int64_t>& idx, int64_t flat, int64_t block, int64_t elem) {
      const uint8_t byte = base[elem / 2];
      fn(idx, flat, block, (elem % 2 == 0) ? (byte & 0xf) : (byte >> 4));
    });
  };
  const int64_t count = planner::ScaleCount(p);
  auto mismatch = [&](const std::string& what) {
    if (result.mismatches++ == 0) {
      result.first_mismatch = absl::StrCat("tensor ", t.name, " (int4 piece ", pi, ", box ", planner::BoxToString(p.box), "): ", what);
    }
  };
  std::vector<float> amax(static_cast<size_t>(count), 0.0f), scale(static_cast<size_t>(count), 0.0f);
  if (version > 0) {
    for_each([&](const std::vector<int64_t>&, int64_t flat, int64_t block, int) {
      amax[static_cast<size_t>(block)] = std::max(amax[static_cast<size_t>(block)], std::fabs(value(flat)));
    });
  }
  for (int64_t b = 0; b < count; ++b) {
    const float got = ScaleValue(scale_base + b * ss, q.scale_dtype);
    const float want = version == 0 ? 0.0f : NearestScale(std::max(amax[static_cast<size_t>(b)] / 7.5f, 1.1920929e-07f), q.scale_dtype);
    if (got != want) mismatch(absl::StrCat("scale of group ", b, ": got ", got, ", want ", want));
    scale[static_cast<size_t>(b)] = want;
  }
  for_each([&](const std::vector<int64_t>& idx, int64_t flat, int64_t block, int got) {
    int want = 0;  // version 0: fresh memory, every byte zero
    if (version > 0) {
      // compressed-tensors' x / scale: torch rounds the quotient to the promoted dtype (the model
      // dtype when the scale has it), then torch.round (half to even).
      float quotient = value(flat) / scale[static_cast<size_t>(block)];
      if (q.scale_dtype == t.dtype && t.dtype != planner::DType::kF32) {
        quotient = std::copysign(NearestScale(std::fabs(quotient), t.dtype), quotient);
      }
      want = static_cast<int>(std::clamp(std::nearbyint(quotient), -8.0f, 7.0f)) + 8;
    }
    if (got != want) mismatch(absl::StrCat("element at local [", absl::StrJoin(idx, ", "), "]: got nibble ", got, ", want ", want));
  });
  result.elements += planner::BoxVolume(p.box);
  result.bytes += planner::BoxVolume(p.box) / 2 + ss * count;
}

// The NVFP4 code of y by search over the eight magnitudes (ties to the even code, beyond 6
// saturating, NaN 7; sign = y < 0) - independent of the daemon's bound counting.
int NearestE2M1(float y) {
  static const double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if (std::isnan(y)) return 7;
  int best = 7;
  if (!std::isinf(y)) {
    const double a = std::fabs(static_cast<double>(y));
    best = 0;
    for (int c = 1; c < 8; ++c) {
      const double d = std::fabs(kMag[c] - a), bd = std::fabs(kMag[best] - a);
      if (d < bd || (d == bd && c % 2 == 0)) best = c;
    }
  }
  return best | (y < 0.0f ? 8 : 0);
}

// Checks NVFP4 piece `pi` (daemon/quantize.h) against version `version`: its global scale from the
// largest magnitude over the whole canonical tensors of the pieces that share it, its e4m3 block
// scales, and every packed element.
void VerifyNvFp4(const planner::Inventory& inventory, const planner::WorkerLayout& layout, const MemoryView& memory, int pi,
                 uint64_t version, VerifyResult& result) {
  const planner::Piece& p = layout.pieces[pi];
  const planner::Quantization& q = *p.quant;
  const planner::TensorSpec& t = inventory.tensors[p.tensor];
  const uint8_t* base = static_cast<const uint8_t*>(memory.buffers[p.buffer]) + p.offset_bytes;
  const uint8_t* scale_buffer = static_cast<const uint8_t*>(memory.buffers[q.scale_buffer]);
  const uint8_t* scale_base = scale_buffer + q.scale_offset_bytes;
  auto value_of = [&](const planner::Piece& piece, int64_t flat) {
    const planner::TensorSpec& ts = inventory.tensors[piece.tensor];
    return CanonicalValue(VersionBits(static_cast<uint32_t>(piece.tensor), version, static_cast<uint64_t>(flat), planner::DTypeSize(ts.dtype)),
                          ts.dtype);
  };
  auto mismatch = [&](const std::string& what) {
    if (result.mismatches++ == 0) {
      result.first_mismatch = absl::StrCat("tensor ", t.name, " (nvfp4 piece ", pi, ", box ", planner::BoxToString(p.box), "): ", what);
    }
  };
  // ModelOpt's weight_scale_2: the largest magnitude over the WHOLE canonical tensors of the
  // pieces sharing the scale (a fused layer's q / k / v unified), the same on every TP rank.
  float group_amax = 0;
  if (version > 0) {
    std::set<int32_t> tensors;
    for (const planner::Piece& o : layout.pieces) {
      if (o.quant.has_value() && o.quant->scale_buffer == q.scale_buffer && o.quant->global_scale_offset_bytes == q.global_scale_offset_bytes) {
        tensors.insert(o.tensor);
      }
    }
    for (int32_t ti : tensors) {
      const planner::TensorSpec& ts = inventory.tensors[ti];
      const int64_t n = planner::BoxVolume(planner::FullBox(ts.shape));
      for (int64_t flat = 0; flat < n; ++flat) {
        group_amax = std::max(group_amax, std::fabs(CanonicalValue(VersionBits(static_cast<uint32_t>(ti), version, static_cast<uint64_t>(flat),
                                                                               planner::DTypeSize(ts.dtype)), ts.dtype)));
      }
    }
  }
  float g = group_amax / 2688.0f;
  if (g == 0.0f) g = 1.0f;
  float got_g;
  std::memcpy(&got_g, scale_buffer + q.global_scale_offset_bytes, 4);
  const float want_g = version == 0 ? 0.0f : g;
  if (std::memcmp(&got_g, &want_g, 4) != 0) mismatch(absl::StrCat("global scale: got ", got_g, ", want ", want_g));
  const int64_t count = planner::ScaleCount(p);
  std::vector<float> amax(static_cast<size_t>(count), 0.0f), divisor(static_cast<size_t>(count), 0.0f);
  if (version > 0) {
    ForEachQuantElement(t, p, [&](const std::vector<int64_t>&, int64_t flat, int64_t block, int64_t) {
      amax[static_cast<size_t>(block)] = std::max(amax[static_cast<size_t>(block)], std::fabs(value_of(p, flat)));
    });
  }
  const std::vector<double>& e4m3 = E4M3Values();
  for (int64_t b = 0; b < count; ++b) {
    float bs = amax[static_cast<size_t>(b)] / (6.0f * g);
    if (bs == 0.0f) bs = 1.0f;
    const uint8_t want = version == 0 ? 0 : NearestE4M3(bs);
    if (scale_base[b] != want) mismatch(absl::StrCat("e4m3 scale of block ", b, ": got 0x", absl::Hex(scale_base[b]), ", want 0x", absl::Hex(want)));
    divisor[static_cast<size_t>(b)] = static_cast<float>(e4m3[want & 0x7f]) * g;
  }
  ForEachQuantElement(t, p, [&](const std::vector<int64_t>& idx, int64_t flat, int64_t block, int64_t elem) {
    const uint8_t byte = base[elem / 2];
    const int got = elem % 2 == 0 ? (byte & 0xf) : (byte >> 4);
    const int want = version == 0 ? 0 : NearestE2M1(value_of(p, flat) / divisor[static_cast<size_t>(block)]);
    if (got != want) mismatch(absl::StrCat("element at local [", absl::StrJoin(idx, ", "), "]: got code ", got, ", want ", want));
  });
  result.elements += planner::BoxVolume(p.box);
  result.bytes += planner::BoxVolume(p.box) / 2 + count;
}

// Checks quantised piece `pi` against version `version` (0: every element and scale byte zero).
void VerifyQuantized(const planner::Inventory& inventory, const planner::WorkerLayout& layout, const MemoryView& memory,
                     int pi, uint64_t version, VerifyResult& result) {
  const planner::Piece& p = layout.pieces[pi];
  const planner::Quantization& q = *p.quant;
  const planner::TensorSpec& t = inventory.tensors[p.tensor];
  const int es = planner::DTypeSize(t.dtype);
  const uint8_t* base = static_cast<const uint8_t*>(memory.buffers[p.buffer]) + p.offset_bytes;
  const uint8_t* scale_base = static_cast<const uint8_t*>(memory.buffers[q.scale_buffer]) + q.scale_offset_bytes;
  // Visits every element: fn(local index vector, canonical flat index, block index, element byte).
  auto for_each = [&](auto&& fn) {
    return ForEachQuantElement(t, p, [&](const std::vector<int64_t>& idx, int64_t flat, int64_t block, int64_t elem) {
      fn(idx, flat, block, base[elem]);
    });
  };
  const int64_t count = planner::ScaleCount(p);
  auto mismatch = [&](const std::string& what) {
    if (result.mismatches++ == 0) {
      result.first_mismatch = absl::StrCat("tensor ", t.name, " (quantised piece ", pi, ", box ", planner::BoxToString(p.box), "): ", what);
    }
  };
  std::vector<float> amax(static_cast<size_t>(count), 0.0f);
  if (version > 0) {
    for_each([&](const std::vector<int64_t>&, int64_t flat, int64_t block, uint8_t) {
      const float x = CanonicalValue(VersionBits(static_cast<uint32_t>(p.tensor), version, static_cast<uint64_t>(flat), es), t.dtype);
      amax[static_cast<size_t>(block)] = std::max(amax[static_cast<size_t>(block)], std::fabs(x));
    });
  }
  // Per block, the factor that maps x onto the e4m3 grid: 1 / scale_inv with scale_inv =
  // max(amax, 1e-4) / 448 (DeepGEMM's x * (1.0 / sf), float32) or 2^-e with e = floor(log2 amax) - 8,
  // found here by halving/doubling (float8_e8m0).
  const bool e8m0 = q.scale_dtype == planner::DType::kE8M0;
  std::vector<double> factor(static_cast<size_t>(count), 0.0);
  for (int64_t b = 0; b < count; ++b) {
    const float a = amax[static_cast<size_t>(b)];
    if (e8m0) {
      int e = -127;
      if (version > 0 && a > 0) {
        int k = 0;
        double pw = 1.0;
        while (pw * 2 <= a) pw *= 2, ++k;
        while (pw > a) pw /= 2, --k;
        e = std::clamp(k - 8, -127, 127);
      }
      const uint8_t got = scale_base[b];
      const uint8_t want = version == 0 ? 0 : static_cast<uint8_t>(e + 127);
      if (got != want) mismatch(absl::StrCat("e8m0 scale of block ", b, ": got ", int{got}, ", want ", int{want}));
      factor[static_cast<size_t>(b)] = std::pow(2.0, -e);
      continue;
    }
    float got;
    std::memcpy(&got, scale_base + 4 * b, 4);
    const float want = version == 0 ? 0.0f : std::max(a, 1e-4f) / 448.0f;
    if (std::memcmp(&got, &want, 4) != 0) mismatch(absl::StrCat("scale of block ", b, ": got ", got, ", want ", want));
    factor[static_cast<size_t>(b)] = 1.0f / (std::max(a, 1e-4f) / 448.0f);
  }
  for_each([&](const std::vector<int64_t>& idx, int64_t flat, int64_t block, uint8_t got) {
    uint8_t want = 0;
    if (version > 0) {
      const float x = CanonicalValue(VersionBits(static_cast<uint32_t>(p.tensor), version, static_cast<uint64_t>(flat), es), t.dtype);
      // float32 scales: x * (1 / scale_inv), each rounded to float; e8m0: exact.
      const float f = static_cast<float>(factor[static_cast<size_t>(block)]);
      want = NearestE4M3(e8m0 ? static_cast<float>(x * factor[static_cast<size_t>(block)]) : x * f);
    }
    if (got != want) {
      mismatch(absl::StrCat("element at local [", absl::StrJoin(idx, ", "), "]: got 0x", absl::Hex(got), ", want 0x", absl::Hex(want)));
    }
  });
  result.elements += planner::BoxVolume(p.box);
  result.bytes += planner::BoxVolume(p.box) + 4 * count;
}

}  // namespace

void SetDeltaFraction(double fraction) { g_delta_fraction = fraction; }

absl::StatusOr<int64_t> FillPieces(const planner::Inventory& inventory,
                                   const planner::WorkerLayout& layout, const MemoryView& memory,
                                   uint64_t version) {
  if (memory.buffers.size() != memory.sizes.size()) {
    return absl::InvalidArgumentError("buffers and sizes differ in length");
  }
  for (int i = 0; i < static_cast<int>(layout.pieces.size()); ++i) {
    RETURN_IF_ERROR(CheckPiece(inventory, layout, memory, i));
  }
  int64_t bytes = 0;
  for (const planner::Piece& p : layout.pieces) {
    if (p.quant.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", inventory.tensors[p.tensor].name,
                                                     ": quantised pieces are for rollouts (nothing fills them)"));
    }
    if (planner::BoxEmpty(p.box)) continue;
    const planner::TensorSpec& t = inventory.tensors[p.tensor];
    const int esize = planner::DTypeSize(t.dtype);
    const uint32_t tensor = static_cast<uint32_t>(p.tensor);
    ForEachRow(t, p, static_cast<char*>(memory.buffers[p.buffer]),
               [&](char* dst, int64_t flat, int64_t step_bytes, int64_t flat_step, int64_t n) {
                 switch (esize) {
                   case 2:
                     FillRow<uint16_t>(tensor, version, flat, flat_step, dst, step_bytes, n);
                     break;
                   case 4:
                     FillRow<uint32_t>(tensor, version, flat, flat_step, dst, step_bytes, n);
                     break;
                   case 8:
                     FillRow<uint64_t>(tensor, version, flat, flat_step, dst, step_bytes, n);
                     break;
                   default:
                     FillRow<uint8_t>(tensor, version, flat, flat_step, dst, step_bytes, n);
                 }
               });
    bytes += planner::BoxVolume(p.box) * esize;
  }
  return bytes;
}

absl::StatusOr<VerifyResult> VerifyPieces(const planner::Inventory& inventory,
                                          const planner::WorkerLayout& layout,
                                          const MemoryView& memory, uint64_t version) {
  if (memory.buffers.size() != memory.sizes.size()) {
    return absl::InvalidArgumentError("buffers and sizes differ in length");
  }
  for (int i = 0; i < static_cast<int>(layout.pieces.size()); ++i) {
    RETURN_IF_ERROR(CheckPiece(inventory, layout, memory, i));
  }
  VerifyResult result;
  for (int pi = 0; pi < static_cast<int>(layout.pieces.size()); ++pi) {
    const planner::Piece& p = layout.pieces[pi];
    if (planner::BoxEmpty(p.box)) continue;
    if (p.quant.has_value()) {
      if (p.quant->dtype == planner::DType::kI4) {
        VerifyInt4(inventory, layout, memory, pi, version, result);
      } else if (p.quant->dtype == planner::DType::kF4E2M1) {
        VerifyNvFp4(inventory, layout, memory, pi, version, result);
      } else {
        VerifyQuantized(inventory, layout, memory, pi, version, result);
      }
      continue;
    }
    const planner::TensorSpec& t = inventory.tensors[p.tensor];
    const int esize = planner::DTypeSize(t.dtype);
    const uint32_t tensor = static_cast<uint32_t>(p.tensor);
    ForEachRow(t, p, static_cast<char*>(memory.buffers[p.buffer]),
               [&](char* src, int64_t flat, int64_t step_bytes, int64_t flat_step, int64_t n) {
                 // Fast path: the whole row matches (the common case); otherwise find and report
                 // the differing elements one by one below.
                 bool row_ok = false;
                 switch (esize) {
                   case 2:
                     row_ok = RowMatches<uint16_t>(tensor, version, flat, flat_step, src, step_bytes, n);
                     break;
                   case 4:
                     row_ok = RowMatches<uint32_t>(tensor, version, flat, flat_step, src, step_bytes, n);
                     break;
                   case 8:
                     row_ok = RowMatches<uint64_t>(tensor, version, flat, flat_step, src, step_bytes, n);
                     break;
                   default:
                     row_ok = RowMatches<uint8_t>(tensor, version, flat, flat_step, src, step_bytes, n);
                 }
                 if (row_ok) return;
                 for (int64_t i = 0; i < n; ++i) {
                   const uint64_t f = static_cast<uint64_t>(flat + i * flat_step);
                   const uint64_t want_bits = version == 0 ? 0 : VersionBits(tensor, version, f, esize);  // little-endian low bytes
                   if (version == 0 ? IsZero(src + i * step_bytes, esize)
                                    : std::memcmp(src + i * step_bytes, &want_bits, static_cast<size_t>(esize)) == 0) {
                     continue;
                   }
                   if (result.mismatches++ == 0) {
                     uint64_t got = 0;
                     std::memcpy(&got, src + i * step_bytes, esize);
                     result.first_mismatch = absl::StrCat(
                         "tensor ", t.name, " element ", Coord(t, static_cast<int64_t>(f)),
                         " (piece ", pi, ", box ", planner::BoxToString(p.box), "): got 0x",
                         absl::Hex(got), ", want version ", version, "'s 0x",
                         absl::Hex(version == 0 ? 0
                                                : VersionBits(tensor, version, f, esize) &
                                                      (esize == 8 ? ~0ull
                                                                  : ((1ull << (8 * esize)) - 1))));
                   }
                 }
               });
    result.elements += planner::BoxVolume(p.box);
    result.bytes += planner::BoxVolume(p.box) * esize;
  }
  return result;
}

}  // namespace wb::e2e
