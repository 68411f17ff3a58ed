#include "daemon/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/quantized.h"

namespace wb::daemon {

uint8_t FloatToE4M3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 31) << 7);
  if (std::isnan(x)) return sign | 0x7f;
  const float a = std::fabs(x);
  if (a < 0x1p-6f) {
    // Subnormal range: multiples of 2^-9 (a * 512 is exact); nearbyint rounds half to even.
    const int m = static_cast<int>(std::nearbyint(a * 512.0f));  // 0..8; 8 is the smallest normal
    return sign | static_cast<uint8_t>(m);
  }
  std::memcpy(&bits, &a, 4);
  int e = static_cast<int>((bits >> 23) & 0xff) - 127;
  const uint32_t mant = bits & 0x7fffff;
  uint32_t r = mant >> 20;
  const uint32_t rem = mant & 0xfffff;
  if (rem > 0x80000 || (rem == 0x80000 && (r & 1) != 0)) ++r;
  if (r == 8) {
    r = 0;
    ++e;
  }
  const int biased = e + 7;
  if (biased > 15 || (biased == 15 && r == 7)) return sign | 0x7e;  // saturate at 448
  return sign | static_cast<uint8_t>((biased << 3) | r);
}

float E4M3ToFloat(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int e = (bits >> 3) & 0xf;
  const int m = bits & 7;
  if (e == 15 && m == 7) return std::nanf("");
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + m / 8.0f, e - 7);
}

uint8_t E8M0ScaleFor(float amax) {
  if (std::isnan(amax)) return kE8M0Nan;
  if (!(amax > 0.0f)) return 0;  // all zeros: the smallest scale, every element stays 0
  int exp2 = 0;
  std::frexp(amax, &exp2);  // amax = m * 2^exp2, m in [0.5, 1): floor(log2(amax)) = exp2 - 1
  const int e = std::clamp(exp2 - 1 - kE4M3MaxExponent, -127, 127);
  return static_cast<uint8_t>(e + 127);
}

float LoadAsFloat(const uint8_t* p, planner::DType dtype) {
  switch (dtype) {
    case planner::DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case planner::DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const float sign = (h & 0x8000) ? -1.0f : 1.0f;
      const int e = (h >> 10) & 0x1f;
      const int m = h & 0x3ff;
      if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
      if (e == 31) return m == 0 ? sign * INFINITY : std::nanf("");
      return sign * std::ldexp(1.0f + m / 1024.0f, e - 15);
    }
    case planner::DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    default:
      return std::nanf("");
  }
}

absl::Status QuantizePiece(const planner::Inventory& inventory, const planner::Piece& piece, const uint8_t* shadow,
                           uint8_t* elements, uint8_t* scales) {
  if (!piece.quant.has_value()) return absl::InvalidArgumentError("QuantizePiece: the piece is not quantised");
  const planner::DType src = inventory.tensors[piece.tensor].dtype;
  if (src != planner::DType::kBF16 && src != planner::DType::kF16 && src != planner::DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("cannot quantise ", inventory.tensors[piece.tensor].name, ": dtype ",
                                                   planner::DTypeName(src)));
  }
  const size_t rank = piece.box.begin.size();
  const int es = planner::DTypeSize(src);
  const std::vector<int64_t> grid = planner::ScaleShape(piece);
  const std::vector<int64_t>& block = piece.quant->block;
  std::vector<int64_t> ext(rank);
  for (size_t d = 0; d < rank; ++d) ext[d] = piece.box.end[d] - piece.box.begin[d];
  // Rows = every index of the dims but the last; the last dim runs in the inner loop.
  const int64_t inner = rank == 0 ? 1 : ext[rank - 1];
  const int64_t inner_block = rank == 0 ? 1 : block[rank - 1];
  const int64_t inner_stride = rank == 0 ? 0 : piece.strides[rank - 1];
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < rank; ++d) rows *= ext[d];
  std::vector<float> amax(static_cast<size_t>(planner::ScaleCount(piece)), 0.0f);

  // Walks the rows in row-major order; `fn(row_index, block_row_base, dst_row_offset)`.
  auto for_each_row = [&](auto&& fn) {
    std::vector<int64_t> idx(rank > 0 ? rank - 1 : 0, 0);
    for (int64_t r = 0; r < rows; ++r) {
      int64_t block_base = 0, dst = piece.offset_bytes;
      for (size_t d = 0; d + 1 < rank; ++d) {
        block_base = block_base * grid[d] + idx[d] / block[d];
        dst += idx[d] * piece.strides[d];  // fp8: one byte per element
      }
      if (rank > 0) block_base *= grid[rank - 1];
      fn(r, block_base, dst);
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < ext[d]) break;
        idx[d] = 0;
      }
    }
  };
  for_each_row([&](int64_t r, int64_t block_base, int64_t) {
    const uint8_t* row = shadow + r * inner * es;
    for (int64_t j = 0; j < inner; ++j) {
      const float a = std::fabs(LoadAsFloat(row + j * es, src));
      float& m = amax[static_cast<size_t>(block_base + j / inner_block)];
      if (std::isnan(a) || a > m) m = a;  // a NaN sticks: the block's scale and elements are NaN
    }
  });
  // Per block: float32 scales multiply by 448 / amax; e8m0 scales multiply by 2^-e (exact, ldexp).
  const bool e8m0 = piece.quant->scale_dtype == planner::DType::kE8M0;
  if (!e8m0 && piece.quant->scale_dtype != planner::DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("cannot quantise ", inventory.tensors[piece.tensor].name, ": scale dtype ",
                                                   planner::DTypeName(piece.quant->scale_dtype)));
  }
  std::vector<float> factor(amax.size());
  std::vector<int> shift(amax.size());
  uint8_t* scale_out = scales + piece.quant->scale_offset_bytes;
  for (size_t b = 0; b < amax.size(); ++b) {
    if (e8m0) {
      const uint8_t s = E8M0ScaleFor(amax[b]);
      scale_out[b] = s;
      shift[b] = 127 - static_cast<int>(s);  // x * 2^-e
      factor[b] = s == kE8M0Nan ? std::nanf("") : 1.0f;
    } else {
      const float m = std::isnan(amax[b]) ? amax[b] : std::max(amax[b], kMinBlockAmax);
      const float scale_inv = m / kE4M3Max;
      std::memcpy(scale_out + static_cast<int64_t>(b) * 4, &scale_inv, 4);
      factor[b] = kE4M3Max / m;
    }
  }
  for_each_row([&](int64_t r, int64_t block_base, int64_t dst) {
    const uint8_t* row = shadow + r * inner * es;
    for (int64_t j = 0; j < inner; ++j) {
      const float x = LoadAsFloat(row + j * es, src);
      const size_t b = static_cast<size_t>(block_base + j / inner_block);
      const float scaled = e8m0 ? std::ldexp(x, shift[b]) * factor[b] : x * factor[b];
      elements[dst + j * inner_stride] = FloatToE4M3(scaled);
    }
  });
  return absl::OkStatus();
}

}  // namespace wb::daemon
