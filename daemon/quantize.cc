#include "daemon/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::daemon {

uint8_t FloatToE4M3(float x) {
  // Branch-light so the quantiser's inner loop stays cheap: integer rounding on the float's bits
  // for the normal range, a magic-number add for the subnormal one.
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t u = bits & 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7f;     // NaN
  if (u >= 0x43e00000u) return sign | 0x7e;    // >= 448 (incl. inf): saturate
  if (u >= 0x3c800000u) {                      // >= 2^-6: normal e4m3
    // Exponent rebias 127 -> 7 and keep 3 mantissa bits, rounding to nearest even on the 20
    // dropped bits; a carry into the exponent is the right result (next binade).
    return sign | static_cast<uint8_t>((u + 0x7ffffu + ((u >> 20) & 1u) - (120u << 23)) >> 20);
  }
  // Subnormal: multiples of 2^-9; a * 512 < 8 is exact, and adding 2^23 rounds it to an integer
  // with the FPU's round-to-nearest-even (8 is the smallest normal's code).
  float a;
  std::memcpy(&a, &u, 4);
  const float t = a * 512.0f + 8388608.0f;  // IEEE semantics (no -ffast-math): the add is kept
  return sign | static_cast<uint8_t>(static_cast<int>(t - 8388608.0f));
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
  if (std::isinf(amax)) return kE8M0Nan;  // torchao: an infinite block magnitude gives the NaN scale
  int exp2 = 0;
  std::frexp(amax, &exp2);  // amax = m * 2^exp2, m in [0.5, 1): floor(log2(amax)) = exp2 - 1
  const int e = std::clamp(exp2 - 1 - kE4M3MaxExponent, -127, 127);
  return static_cast<uint8_t>(e + 127);
}

namespace {

// ModelOpt's _cast_fp4: the code's magnitude is the number of rounding bounds below |y|, plus one
// on the three bounds where the even neighbour is the upper one; the sign is y < 0. Branch-free,
// so the quantiser's row loop (ScaledToE2M1) vectorises with it inlined.
inline __attribute__((always_inline)) uint32_t E2M1Code(float y) {
  const float a = std::fabs(y);
  uint32_t ord = static_cast<uint32_t>(a > 0.25f) + (a > 0.75f) + (a > 1.25f) + (a > 1.75f) + (a > 2.5f) + (a > 3.5f) +
                 (a > 5.0f) + (a == 0.75f) + (a == 1.75f) + (a == 3.5f);
  ord = a != a ? 7u : ord;  // NaN: past every bound (torch.searchsorted)
  return ord | (y < 0.0f ? 8u : 0u);
}

}  // namespace

uint8_t FloatToE2M1(float y) { return static_cast<uint8_t>(E2M1Code(y)); }

float E2M1ToFloat(uint8_t code) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (code & 8) ? -kMag[code & 7] : kMag[code & 7];
}

float NvFp4GlobalScale(float amax) {
  const float g = amax / (kE2M1Max * kE4M3Max);
  return g > 0.0f || std::isnan(g) ? g : 1.0f;
}

uint16_t FloatToBF16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even (a carry may reach inf: correct)
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t FloatToF16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t u = bits & 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00;  // NaN
  if (u >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65536: inf
  if (u >= 0x38800000u) {                      // >= 2^-14: normal half
    return sign | static_cast<uint16_t>((u + 0xfffu + ((u >> 13) & 1u) - (112u << 23)) >> 13);
  }
  // Subnormal half: multiples of 2^-24; |x| * 2^24 < 1024 rounded to nearest even by the FPU.
  float a;
  std::memcpy(&a, &u, 4);
  const float t = a * 16777216.0f + 8388608.0f;
  return sign | static_cast<uint16_t>(static_cast<int32_t>(t - 8388608.0f));
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

namespace {

// One row of the shadow (canonical dtype) as float32, in a tight per-dtype loop.
void RowToFloat(const uint8_t* row, planner::DType dtype, int64_t n, float* out) {
  switch (dtype) {
    case planner::DType::kBF16:
      for (int64_t j = 0; j < n; ++j) {
        uint16_t h;
        std::memcpy(&h, row + 2 * j, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[j], &bits, 4);
      }
      return;
    case planner::DType::kF32:
      std::memcpy(out, row, static_cast<size_t>(n) * 4);
      return;
    default:
      for (int64_t j = 0; j < n; ++j) out[j] = LoadAsFloat(row + j * planner::DTypeSize(dtype), dtype);
      return;
  }
}

// FloatToE4M3(y), branch-free so that loops calling it vectorise (every case computed and
// selected; quantize_test checks every element QuantizePiece writes against a nearest-code search).
inline __attribute__((always_inline)) uint32_t E4M3Code(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  const uint32_t u = bits & 0x7fffffffu;
  // Selects on integers only (float compares would keep GCC from if-converting the loop).
  const uint32_t normal = (u + 0x7ffffu + ((u >> 20) & 1u) - (120u << 23)) >> 20;
  const uint32_t small_bits = u < 0x3c800000u ? u : 0x3c800000u;  // keeps the int conversion in range
  float small;
  std::memcpy(&small, &small_bits, 4);
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>((small * 512.0f + 8388608.0f) - 8388608.0f));
  uint32_t code = u >= 0x3c800000u ? normal : subnormal;
  code = u >= 0x43e00000u ? 0x7eu : code;
  code = u > 0x7f800000u ? 0x7fu : code;
  return code | ((bits >> 24) & 0x80u);
}

// E4M3ToFloat(code), branch-free (NVFP4 reads each block's scale back).
inline __attribute__((always_inline)) float E4M3Value(uint32_t code) {
  const uint32_t mag = code & 0x7fu;
  // Normal: exponent rebias 7 -> 127, three mantissa bits on top; subnormal: m * 2^-9, exact.
  const uint32_t normal_bits = (mag << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &normal_bits, 4);
  const float subnormal = static_cast<float>(static_cast<int32_t>(mag & 7u)) * (1.0f / 512.0f);
  float v = mag < 8u ? subnormal : normal;
  uint32_t vb;
  std::memcpy(&vb, &v, 4);
  vb = mag == 0x7fu ? 0x7fc00000u : vb | ((code & 0x80u) << 24);
  std::memcpy(&v, &vb, 4);
  return v;
}

// FloatToE4M3 of x[j] * f for j in [0, n).
// kBf16: the inputs are bfloat16 bytes, else float32 bytes.
template <bool kBf16>
inline __attribute__((always_inline)) void ScaledToE4M3(const uint8_t* p, float f, int64_t n, uint8_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    float x;
    if constexpr (kBf16) {
      uint16_t h;
      std::memcpy(&h, p + 2 * j, 2);
      const uint32_t wide = static_cast<uint32_t>(h) << 16;
      std::memcpy(&x, &wide, 4);
    } else {
      std::memcpy(&x, p + 4 * j, 4);
    }
    out[j] = static_cast<uint8_t>(E4M3Code(x * f));
  }
}

// max |x| over n canonical elements at `p` (bfloat16, float16 or float32); NaN when any element
// is NaN (a NaN block gets a NaN scale). On the bits of |x|: non-negative floats of each format
// order as their bit patterns, and every NaN's bits exceed infinity's, so an integer max finds the
// largest magnitude and lets a NaN win - without converting anything (vectorisable).
template <typename Bits, Bits kAbsMask>
inline __attribute__((always_inline)) Bits AbsMaxBits(const uint8_t* p, int64_t n) {
  Bits m = 0;
  for (int64_t j = 0; j < n; ++j) {
    Bits bits;
    std::memcpy(&bits, p + j * sizeof(Bits), sizeof(Bits));
    bits &= kAbsMask;
    m = bits > m ? bits : m;
  }
  return m;
}

inline __attribute__((always_inline)) float AbsMax(const uint8_t* p, planner::DType dtype, int64_t n) {
  if (dtype == planner::DType::kF32) {
    const uint32_t m = AbsMaxBits<uint32_t, 0x7fffffffu>(p, n);
    if (m > 0x7f800000u) return std::nanf("");
    float f;
    std::memcpy(&f, &m, 4);
    return f;
  }
  const uint16_t m = AbsMaxBits<uint16_t, 0x7fff>(p, n);
  return LoadAsFloat(reinterpret_cast<const uint8_t*>(&m), dtype);  // NaN bits stay NaN
}

// The e4m3 codes of a row's block: bfloat16 and float32 read straight from the canonical bytes,
// float16 (rare) through a float copy.
inline __attribute__((always_inline)) void QuantizeSpan(const uint8_t* row, planner::DType dtype, int64_t lo, int64_t n, float f, std::vector<float>& tmp,
                  uint8_t* out) {
  switch (dtype) {
    case planner::DType::kBF16:
      ScaledToE4M3<true>(row + lo * 2, f, n, out + lo);
      return;
    case planner::DType::kF32:
      ScaledToE4M3<false>(row + lo * 4, f, n, out + lo);
      return;
    default:
      if (tmp.size() < static_cast<size_t>(n)) tmp.resize(static_cast<size_t>(n));
      RowToFloat(row + lo * 2, dtype, n, tmp.data());
      ScaledToE4M3<false>(reinterpret_cast<const uint8_t*>(tmp.data()), f, n, out + lo);
      return;
  }
}

// The row kernels: one row of the shadow, every block of it. Compiled twice, for AVX2 and for
// baseline x86-64, the loader picking one per CPU (GCC function multi-versioning, an ifunc), so
// the vectorised loops run 8 lanes wide where the CPU can.
// Not under sanitizers: the ifunc resolver runs while the dynamic loader relocates, before the
// sanitizer runtime is up, and TSan's instrumentation of it crashed every binary at load.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define WB_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define WB_ROW_KERNEL
#endif

// bfloat16 rows in blocks of a constant kBlock elements (NVFP4's 16, MX's 32): the block's max is
// a fixed-size reduction the compiler unrolls into whole vectors (with a run-time count it built a
// vector loop, its tail and its reduction per block). Returns the elements done (whole blocks).
template <int kBlock>
inline __attribute__((always_inline)) int64_t Bf16BlocksAbsMax(const uint8_t* row, int64_t inner, float* amax) {
  const int64_t whole = inner / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    const uint32_t bits = static_cast<uint32_t>(AbsMaxBits<uint16_t, 0x7fff>(row + b * kBlock * 2, kBlock)) << 16;
    float m;
    std::memcpy(&m, &bits, 4);  // NaN bits stay NaN
    amax[b] = (std::isnan(m) || m > amax[b]) ? m : amax[b];
  }
  return whole * kBlock;
}

// amax[b] = max(amax[b], max |x| over block b of the row); a NaN sticks.
WB_ROW_KERNEL void RowBlockAbsMax(const uint8_t* row, planner::DType dtype, int64_t inner, int64_t inner_block, float* amax) {
  const int es = planner::DTypeSize(dtype);
  int64_t done = 0;
  if (dtype == planner::DType::kBF16 && inner_block == 16) done = Bf16BlocksAbsMax<16>(row, inner, amax);
  if (dtype == planner::DType::kBF16 && inner_block == 32) done = Bf16BlocksAbsMax<32>(row, inner, amax);
  for (int64_t lo = done, b = done / inner_block; lo < inner; lo += inner_block, ++b) {
    const float m = AbsMax(row + lo * es, dtype, std::min(inner_block, inner - lo));
    amax[b] = (std::isnan(m) || m > amax[b]) ? m : amax[b];
  }
}

// NVFP4 block scales over n blocks: code = e4m3(amax / (6 * global)) (0 -> 1, as ModelOpt), and
// the divisor its elements use, the code read back times the global scale. A loop of its own with
// the branch-free conversions, so it runs in vectors (it was the scalar conversion per block).
WB_ROW_KERNEL void Nvfp4BlockScales(const float* __restrict__ amax, int64_t n, float six_global, float global,
                                    uint8_t* __restrict__ codes, float* __restrict__ divisor) {
  for (int64_t b = 0; b < n; ++b) {
    float bs = amax[b] / six_global;
    bs = bs == 0.0f ? 1.0f : bs;
    const uint32_t code = E4M3Code(bs);
    codes[b] = static_cast<uint8_t>(code);
    divisor[b] = E4M3Value(code) * global;
  }
}

// MX block scales over n blocks (amax >= 0 or NaN): code = E8M0ScaleFor(amax), and the factor
// its elements are multiplied by, 2^(127 - code) exactly (NaN for the NaN code). Branch-free (the
// exponent read off the float's bits), so it vectorises where E8M0ScaleFor's frexp ran per block.
WB_ROW_KERNEL void E8M0BlockScales(const float* __restrict__ amax, int64_t n, uint8_t* __restrict__ codes,
                                   float* __restrict__ factor) {
  for (int64_t b = 0; b < n; ++b) {
    const float a = amax[b];
    uint32_t u;
    std::memcpy(&u, &a, 4);
    u &= 0x7fffffffu;
    // floor(log2(a)) for normal a; a subnormal one (< 2^-126) has floor(log2(a)) - 8 < -127, which
    // clamps to -127 like the -127 taken for it here.
    const int32_t e2 = u >= 0x00800000u ? static_cast<int32_t>(u >> 23) - 127 : -127;
    int32_t e = e2 - kE4M3MaxExponent;
    e = e < -127 ? -127 : e;
    e = e > 127 ? 127 : e;
    uint32_t code = static_cast<uint32_t>(e + 127);
    code = u == 0u ? 0u : code;                // all zeros: the smallest scale
    code = u >= 0x7f800000u ? 0xffu : code;    // inf or NaN: the NaN scale (torchao)
    codes[b] = static_cast<uint8_t>(code);
    // 2^(127 - code): normal down to 2^-126 (code 253), 2^-127 (code 254) is the subnormal 0x00400000.
    uint32_t fb = code <= 253u ? (254u - code) << 23 : 0x00400000u;
    fb = code == 0xffu ? 0x7fc00000u : fb;
    float f;
    std::memcpy(&f, &fb, 4);
    factor[b] = f;
  }
}

// out[j] = e4m3(x[j] * factor[j / inner_block]) for the row.
WB_ROW_KERNEL void RowToE4M3(const uint8_t* row, planner::DType dtype, int64_t inner, int64_t inner_block, const float* factor,
                             std::vector<float>& tmp, uint8_t* out) {
  for (int64_t lo = 0, b = 0; lo < inner; lo += inner_block, ++b) {
    QuantizeSpan(row, dtype, lo, std::min(inner_block, inner - lo), factor[b], tmp, out);
  }
}

// How compressed-tensors' `x / scale` rounds the quotient before torch.round: in the dtype torch
// promotes the weight and its scale to (both bfloat16: bfloat16; both float16: float16; else float32).
enum class QuotientRounding { kFloat32, kBf16, kF16 };

// q = clamp(rint(x / s), -8, 7) (NaN -> 0), stored as q + 8, two per byte (even j low nibble);
// the quotient first rounded to bfloat16 (nearest even) with kBf16.
template <QuotientRounding kRound>
inline __attribute__((always_inline)) void ScaledToInt4(const float* x, float s, int64_t n, uint8_t* nibbles) {
  for (int64_t j = 0; j < n; ++j) {
    float q = x[j] / s;
    uint32_t bits;
    std::memcpy(&bits, &q, 4);
    bits = (bits & 0x7fffffffu) > 0x7f800000u ? 0u : bits;  // NaN -> 0 (int4 has no NaN)
    if constexpr (kRound == QuotientRounding::kBf16) {
      bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;  // finite: nearest even (may reach inf: clamped)
    }
    std::memcpy(&q, &bits, 4);
    if constexpr (kRound == QuotientRounding::kF16) {  // rare: the scalar conversion
      const uint16_t h = FloatToF16(q);
      q = LoadAsFloat(reinterpret_cast<const uint8_t*>(&h), planner::DType::kF16);
    }
    q = q < -8.0f ? -8.0f : q;
    q = q > 7.0f ? 7.0f : q;
    // Round half to even: adding 1.5 * 2^23 leaves an integer mantissa (|q| <= 8).
    const float r = (q + 12582912.0f) - 12582912.0f;
    nibbles[j] = static_cast<uint8_t>(static_cast<int32_t>(r) + 8);
  }
}

// codes of x[j] / d[j] (d the element's block divisor: its e4m3 scale read back times the global
// scale), over a whole row so the loop runs in full vectors (per 16-element block the loop's setup
// cost as much as its work).
// The codes go out as 32-bit lanes: with byte outputs GCC narrowed each of E2M1Code's compares to
// bytes before adding them (packs and permutes per compare, 4x the work of the compares).
inline __attribute__((always_inline)) void ScaledToE2M1(const float* __restrict__ x, const float* __restrict__ d, int64_t n,
                                                        uint32_t* __restrict__ codes) {
  for (int64_t j = 0; j < n; ++j) codes[j] = E2M1Code(x[j] / d[j]);
}

WB_ROW_KERNEL void RowToE2M1(const uint8_t* row, planner::DType dtype, int64_t inner, int64_t inner_block, const float* divisor,
                             std::vector<float>& tmp, uint8_t* out) {
  if (tmp.size() < static_cast<size_t>(3 * inner)) tmp.resize(static_cast<size_t>(3 * inner));
  float* x = tmp.data();
  float* d = tmp.data() + inner;
  RowToFloat(row, dtype, inner, x);
  for (int64_t lo = 0, b = 0; lo < inner; lo += inner_block, ++b) {
    const int64_t n = std::min(inner_block, inner - lo);
    for (int64_t j = 0; j < n; ++j) d[lo + j] = divisor[b];
  }
  uint32_t* codes = reinterpret_cast<uint32_t*>(tmp.data() + 2 * inner);
  ScaledToE2M1(x, d, inner, codes);
  for (int64_t j = 0; j < inner / 2; ++j) out[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
}

WB_ROW_KERNEL void RowToInt4(const uint8_t* row, planner::DType dtype, int64_t inner, int64_t inner_block, const float* scale,
                             QuotientRounding rounding, std::vector<float>& tmp, uint8_t* out) {
  if (tmp.size() < static_cast<size_t>(2 * inner)) tmp.resize(static_cast<size_t>(2 * inner));
  float* x = tmp.data();
  RowToFloat(row, dtype, inner, x);
  uint8_t* nib = reinterpret_cast<uint8_t*>(tmp.data() + inner);  // inner bytes, inside tmp's second half
  for (int64_t lo = 0, b = 0; lo < inner; lo += inner_block, ++b) {
    const int64_t n = std::min(inner_block, inner - lo);
    switch (rounding) {
      case QuotientRounding::kBf16:
        ScaledToInt4<QuotientRounding::kBf16>(x + lo, scale[b], n, nib + lo);
        break;
      case QuotientRounding::kF16:
        ScaledToInt4<QuotientRounding::kF16>(x + lo, scale[b], n, nib + lo);
        break;
      default:
        ScaledToInt4<QuotientRounding::kFloat32>(x + lo, scale[b], n, nib + lo);
    }
  }
  for (int64_t j = 0; j < inner / 2; ++j) out[j] = static_cast<uint8_t>(nib[2 * j] | (nib[2 * j + 1] << 4));
}

// Writes `s` as a `dtype` scale (round to nearest even) at `at` and returns the stored value.
float StoreScale(float s, planner::DType dtype, uint8_t* at) {
  switch (dtype) {
    case planner::DType::kBF16: {
      const uint16_t h = FloatToBF16(s);
      std::memcpy(at, &h, 2);
      return LoadAsFloat(at, dtype);
    }
    case planner::DType::kF16: {
      const uint16_t h = FloatToF16(s);
      std::memcpy(at, &h, 2);
      return LoadAsFloat(at, dtype);
    }
    default:
      std::memcpy(at, &s, 4);
      return s;
  }
}

// max |x| over n elements, in the AVX2 clone where the CPU has it (ShadowAbsMax's whole-piece pass).
WB_ROW_KERNEL float SpanAbsMax(const uint8_t* p, planner::DType dtype, int64_t n) { return AbsMax(p, dtype, n); }

}  // namespace

float ShadowAbsMax(const planner::Inventory& inventory, const planner::Piece& piece, const uint8_t* shadow) {
  const planner::DType src = inventory.tensors[piece.tensor].dtype;
  if (src != planner::DType::kBF16 && src != planner::DType::kF16 && src != planner::DType::kF32) return std::nanf("");
  const int64_t n = planner::BoxVolume(piece.box);
  const int es = planner::DTypeSize(src);
  float m = 0.0f;
  // In slices, so the vectorised max runs over a bounded count (and a NaN still wins).
  constexpr int64_t kSlice = int64_t{1} << 16;
  for (int64_t lo = 0; lo < n; lo += kSlice) {
    const float s = SpanAbsMax(shadow + lo * es, src, std::min(kSlice, n - lo));
    m = (std::isnan(s) || s > m) ? s : m;
    if (std::isnan(m)) break;
  }
  return m;
}

absl::Status QuantizePiece(const planner::Inventory& inventory, const planner::Piece& piece, const uint8_t* shadow,
                           uint8_t* elements, uint8_t* scales, std::optional<float> nvfp4_global_scale) {
  if (!piece.quant.has_value()) return absl::InvalidArgumentError("QuantizePiece: the piece is not quantised");
  const planner::DType src = inventory.tensors[piece.tensor].dtype;
  if (src != planner::DType::kBF16 && src != planner::DType::kF16 && src != planner::DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("cannot quantise ", inventory.tensors[piece.tensor].name, ": dtype ",
                                                   planner::DTypeName(src)));
  }
  const planner::DType sdt = piece.quant->scale_dtype;
  const bool int4 = piece.quant->dtype == planner::DType::kI4;
  const bool nvfp4 = piece.quant->dtype == planner::DType::kF4E2M1;
  const bool e8m0 = !int4 && !nvfp4 && sdt == planner::DType::kE8M0;
  const bool scale_ok = int4    ? (sdt == planner::DType::kBF16 || sdt == planner::DType::kF16 || sdt == planner::DType::kF32)
                        : nvfp4 ? sdt == planner::DType::kF8E4M3 && piece.quant->global_scale_offset_bytes >= 0
                                : (piece.quant->dtype == planner::DType::kF8E4M3 && (sdt == planner::DType::kE8M0 || sdt == planner::DType::kF32));
  if (!scale_ok) {
    return absl::InvalidArgumentError(absl::StrCat("cannot quantise ", inventory.tensors[piece.tensor].name, " to ",
                                                   planner::DTypeName(piece.quant->dtype), " with ", planner::DTypeName(sdt), " scales"));
  }
  const bool packed4 = int4 || nvfp4;
  if (packed4 && (piece.box.begin.empty() || piece.strides.back() != 1 || (piece.box.end.back() - piece.box.begin.back()) % 2 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot quantise ", inventory.tensors[piece.tensor].name, " to ",
                                                   planner::DTypeName(piece.quant->dtype),
                                                   ": not packed along its last dim (validate the layout first)"));
  }
  // NVFP4's second-level scale: the caller's (shared by the piece's group, stored by the caller),
  // else this piece's own, stored here.
  float global = 0.0f;
  if (nvfp4) {
    if (nvfp4_global_scale.has_value()) {
      global = *nvfp4_global_scale;
    } else {
      global = NvFp4GlobalScale(ShadowAbsMax(inventory, piece, shadow));
      std::memcpy(scales + piece.quant->global_scale_offset_bytes, &global, 4);
    }
  }
  const float six_global = kE2M1Max * global;
  const QuotientRounding int4_rounding = sdt != src                    ? QuotientRounding::kFloat32
                                         : src == planner::DType::kBF16 ? QuotientRounding::kBf16
                                         : src == planner::DType::kF16  ? QuotientRounding::kF16
                                                                        : QuotientRounding::kFloat32;
  const size_t rank = piece.box.begin.size();
  const int es = planner::DTypeSize(src);
  const std::vector<int64_t> grid = planner::ScaleShape(piece);
  const std::vector<int64_t>& block = piece.quant->block;
  std::vector<int64_t> ext(rank);
  for (size_t d = 0; d < rank; ++d) ext[d] = piece.box.end[d] - piece.box.begin[d];
  // Rows = every index of the dims but the last; the last dim runs in the inner loops. Rows that
  // share their blocks form a group: amax over the group's rows, then the scales, then the group's
  // elements, while the group is still in cache. With blocks of 1 in every dim before the last two
  // (any 1-D/2-D piece; MX and 128x128 blocks) such rows are runs of consecutive rows; otherwise a
  // block's rows recur after others, and the whole piece is one group.
  const int64_t inner = rank == 0 ? 1 : ext[rank - 1];
  const int64_t inner_block = rank == 0 ? 1 : block[rank - 1];
  const int64_t inner_blocks = rank == 0 ? 1 : grid[rank - 1];
  const int64_t inner_stride = rank == 0 ? 0 : piece.strides[rank - 1];
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < rank; ++d) rows *= ext[d];
  bool runs = true;
  for (size_t d = 0; d + 2 < rank; ++d) runs = runs && block[d] == 1;
  uint8_t* scale_out = scales + piece.quant->scale_offset_bytes;

  struct Row {
    int64_t index;  // row-major row number in the shadow
    int64_t dst;    // byte offset of its first element in `elements`
    int64_t base;   // scale index of its first block
  };
  std::vector<Row> group;
  std::vector<int64_t> bases;  // distinct Row::base of the group
  const size_t count = static_cast<size_t>(planner::ScaleCount(piece));
  std::vector<float> tmp, amax(count, 0.0f), factor(count);
  std::vector<uint8_t> packed(inner_stride == 1 ? 0 : static_cast<size_t>(inner));

  auto flush = [&] {
    if (group.empty()) return;
    for (const Row& r : group) {
      RowBlockAbsMax(shadow + r.index * inner * es, src, inner, inner_block, amax.data() + r.base);
      if (bases.empty() || bases.back() != r.base) bases.push_back(r.base);
    }
    std::sort(bases.begin(), bases.end());
    bases.erase(std::unique(bases.begin(), bases.end()), bases.end());
    // Per block the factor that maps x onto the e4m3 grid: 1 / scale_inv (float32 scale_inv,
    // DeepGEMM's `x * (1.0 / sf)`) or 2^-e as an exact float (e8m0).
    for (int64_t base : bases) {
      if (nvfp4) {  // factor = the divisor: the stored e4m3 scale read back times the global scale
        Nvfp4BlockScales(amax.data() + base, inner_blocks, six_global, global, scale_out + base, factor.data() + base);
        continue;
      }
      if (e8m0) {  // factor = 2^-e, exact
        E8M0BlockScales(amax.data() + base, inner_blocks, scale_out + base, factor.data() + base);
        continue;
      }
      for (int64_t b = base; b < base + inner_blocks; ++b) {
        const float a = amax[static_cast<size_t>(b)];
        if (int4) {  // factor = the stored scale, read back: q = x / scale
          const float s = std::isnan(a) ? a : std::max(a / kInt4ScaleDivisor, kInt4MinScale);
          factor[static_cast<size_t>(b)] = StoreScale(s, sdt, scale_out + b * planner::DTypeSize(sdt));
        } else {
          const float m = std::isnan(a) ? a : std::max(a, kMinBlockAmax);
          const float scale_inv = m / kE4M3Max;
          std::memcpy(scale_out + b * 4, &scale_inv, 4);
          factor[static_cast<size_t>(b)] = 1.0f / scale_inv;
        }
      }
    }
    bases.clear();
    for (const Row& r : group) {
      if (nvfp4) {  // stride 1 (checked above), as int4
        RowToE2M1(shadow + r.index * inner * es, src, inner, inner_block, factor.data() + r.base, tmp, elements + r.dst);
        continue;
      }
      if (int4) {  // stride 1 (checked above): the row's packed bytes are contiguous
        RowToInt4(shadow + r.index * inner * es, src, inner, inner_block, factor.data() + r.base, int4_rounding, tmp, elements + r.dst);
        continue;
      }
      uint8_t* out = inner_stride == 1 ? elements + r.dst : packed.data();
      RowToE4M3(shadow + r.index * inner * es, src, inner, inner_block, factor.data() + r.base, tmp, out);
      if (inner_stride != 1) {
        for (int64_t j = 0; j < inner; ++j) elements[r.dst + j * inner_stride] = packed[static_cast<size_t>(j)];
      }
    }
    group.clear();
  };

  std::vector<int64_t> idx(rank > 0 ? rank - 1 : 0, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t block_base = 0, dst = piece.offset_bytes;
    for (size_t d = 0; d + 1 < rank; ++d) {
      block_base = block_base * grid[d] + idx[d] / block[d];
      dst += packed4 ? idx[d] * piece.strides[d] / 2 : idx[d] * piece.strides[d];  // fp8: a byte per element; int4 / e2m1: two
    }
    block_base *= inner_blocks;
    if (runs && !group.empty() && group.back().base != block_base) flush();
    group.push_back(Row{r, dst, block_base});
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < ext[d]) break;
      idx[d] = 0;
    }
  }
  flush();
  return absl::OkStatus();
}

}  // namespace wb::daemon
