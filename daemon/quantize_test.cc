#include "daemon/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "planner/quantized.h"
#include "planner/validate.h"

namespace wb::daemon {
namespace {

// Reference: the value of every finite e4m3fn code by its definition, and the nearest code by
// search (ties to the even code), independent of FloatToE4M3's bit manipulation.
double CodeValue(int code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const double mag = e == 0 ? m * std::pow(2.0, -9) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

uint8_t NearestCode(float x) {
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_d = a;
  for (int c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(CodeValue(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

uint16_t ToBF16(float f) {  // truncation is fine for making inputs
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}

float BF16Value(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

float ToBF16Value(float f) { return BF16Value(ToBF16(f)); }

TEST(QuantizeTest, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(E4M3ToFloat(static_cast<uint8_t>(c))));
      continue;
    }
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    EXPECT_EQ(v, static_cast<float>(CodeValue(c))) << c;
    if (c == 0x80) continue;  // -0 encodes as 0x80 and decodes to -0: same bits back
    EXPECT_EQ(FloatToE4M3(v), c) << c;
  }
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
}

TEST(QuantizeTest, MatchesNearestCodeSearchIncludingTiesAndSaturation) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-10.0f, 9.5f);
  for (int i = 0; i < 200000; ++i) {
    const float x = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(mag(rng));
    ASSERT_EQ(FloatToE4M3(x), NearestCode(x)) << x;
  }
  // Midpoints between neighbours go to the even code; beyond 448 saturates.
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = static_cast<float>((CodeValue(c) + CodeValue(c + 1)) / 2);
    EXPECT_EQ(FloatToE4M3(mid), (c & 1) ? c + 1 : c) << "between " << c << " and " << c + 1;
  }
  EXPECT_EQ(FloatToE4M3(460.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(1e30f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToE4M3(std::nanf("")) & 0x7f, 0x7f);
}

TEST(QuantizeTest, LoadsEachCanonicalDtype) {
  const uint16_t bf = 0x3fc0;  // 1.5
  EXPECT_EQ(LoadAsFloat(reinterpret_cast<const uint8_t*>(&bf), planner::DType::kBF16), 1.5f);
  const uint16_t half[] = {0x3e00, 0xc400, 0x0001, 0x7c00};  // 1.5, -4, 2^-24, inf
  EXPECT_EQ(LoadAsFloat(reinterpret_cast<const uint8_t*>(&half[0]), planner::DType::kF16), 1.5f);
  EXPECT_EQ(LoadAsFloat(reinterpret_cast<const uint8_t*>(&half[1]), planner::DType::kF16), -4.0f);
  EXPECT_EQ(LoadAsFloat(reinterpret_cast<const uint8_t*>(&half[2]), planner::DType::kF16), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(LoadAsFloat(reinterpret_cast<const uint8_t*>(&half[3]), planner::DType::kF16)));
  const float f = -2.25f;
  EXPECT_EQ(LoadAsFloat(reinterpret_cast<const uint8_t*>(&f), planner::DType::kF32), -2.25f);
}

// A 2-D bf16 piece with a partial last block, stored transposed (column-major) in the worker's
// buffer: every element and scale against a reference computed element by element here.
TEST(QuantizeTest, BlockQuantisesATransposedPieceWithAPartialBlock) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {300, 200}, planner::DType::kBF16});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{128, 0}, {300, 200}};  // 172 x 200: blocks 2 x 2 with 128x128 (last ones partial)
  p.buffer = 0;
  p.offset_bytes = 64;
  p.strides = {1, 172};  // transposed
  planner::Quantization q;
  q.block = {128, 128};
  q.scale_buffer = 0;
  q.scale_offset_bytes = 64 + 172 * 200 + 4;
  p.quant = q;
  planner::WorkerLayout layout;
  layout.buffers.push_back({q.scale_offset_bytes + 16 + 8});
  layout.pieces.push_back(p);
  ASSERT_TRUE(planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r");

  const int64_t rows = 172, cols = 200;
  std::vector<uint16_t> shadow(rows * cols);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 0.02f);
  for (int64_t i = 0; i < rows * cols; ++i) shadow[i] = ToBF16(n(rng) * (i % 977 == 0 ? 50.0f : 1.0f));
  // One all-zero block (rows 128.., cols 128..): amax clamps to 1e-4, every element encodes 0.
  for (int64_t r = 128; r < rows; ++r) {
    for (int64_t c = 128; c < cols; ++c) shadow[r * cols + c] = 0;
  }
  std::vector<uint8_t> buf(layout.buffers[0].size_bytes, 0xAB);
  ASSERT_TRUE(QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()), buf.data(), buf.data()).ok());

  auto val = [&](int64_t r, int64_t c) {
    uint32_t b = static_cast<uint32_t>(shadow[r * cols + c]) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  };
  for (int br = 0; br < 2; ++br) {
    for (int bc = 0; bc < 2; ++bc) {
      float amax = 0;
      for (int64_t r = br * 128; r < std::min<int64_t>(rows, br * 128 + 128); ++r) {
        for (int64_t c = bc * 128; c < std::min<int64_t>(cols, bc * 128 + 128); ++c) amax = std::max(amax, std::fabs(val(r, c)));
      }
      amax = std::max(amax, 1e-4f);
      float stored;
      std::memcpy(&stored, buf.data() + q.scale_offset_bytes + (br * 2 + bc) * 4, 4);
      ASSERT_EQ(stored, amax / 448.0f) << br << "," << bc;
      for (int64_t r = br * 128; r < std::min<int64_t>(rows, br * 128 + 128); ++r) {
        for (int64_t c = bc * 128; c < std::min<int64_t>(cols, bc * 128 + 128); ++c) {
          const uint8_t got = buf[64 + r + c * 172];
          // DeepGEMM's x * (1.0 / sf), each operation rounded to float32.
          ASSERT_EQ(got, NearestCode(val(r, c) * (1.0f / stored))) << "element " << r << "," << c;
        }
      }
    }
  }
  // Bytes outside the elements and scales are untouched.
  for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(buf[i], 0xAB);
  for (int64_t i = 64 + rows * cols; i < q.scale_offset_bytes; ++i) ASSERT_EQ(buf[i], 0xAB);
  for (int64_t i = q.scale_offset_bytes + 16; i < static_cast<int64_t>(buf.size()); ++i) ASSERT_EQ(buf[i], 0xAB);
  // The dequantised block holding the largest values is close to the input (e4m3: 3 mantissa bits).
  float amax0;
  std::memcpy(&amax0, buf.data() + q.scale_offset_bytes, 4);
  for (int64_t r = 0; r < 128; ++r) {
    for (int64_t c = 0; c < 128; ++c) {
      const float back = E4M3ToFloat(buf[64 + r + c * 172]) * amax0;
      ASSERT_NEAR(back, val(r, c), std::fabs(val(r, c)) / 16 + amax0 * std::ldexp(1.0f, -9)) << r << "," << c;
    }
  }
}

// e8m0 scale by definition (OCP MX v1.0, FLOOR): the largest power of two 2^k <= amax, then
// e = k - 8; found by doubling/halving in double, independent of frexp.
uint8_t ReferenceE8M0(float amax) {
  if (std::isnan(amax)) return 0xff;
  if (amax == 0.0f) return 0;
  int k = 0;
  double p = 1.0;
  while (p * 2 <= amax) { p *= 2; ++k; }
  while (p > amax) { p /= 2; --k; }
  return static_cast<uint8_t>(std::clamp(k - 8, -127, 127) + 127);
}

TEST(QuantizeTest, E8M0ScaleIsTheFloorPowerOfTwoOverTheE4M3Range) {
  EXPECT_EQ(E8M0ScaleFor(1.0f), 127 - 8);
  EXPECT_EQ(E8M0ScaleFor(448.0f), 127 + 0);     // 2^8 <= 448 < 2^9: e = 0
  EXPECT_EQ(E8M0ScaleFor(511.9f), 127 + 0);
  EXPECT_EQ(E8M0ScaleFor(512.0f), 127 + 1);
  EXPECT_EQ(E8M0ScaleFor(0.0f), 0);
  EXPECT_EQ(E8M0ScaleFor(std::nanf("")), 0xff);
  EXPECT_EQ(E8M0ScaleFor(std::numeric_limits<float>::infinity()), 0xff);  // torchao's to_mx: the NaN scale
  EXPECT_EQ(E8M0ScaleFor(std::ldexp(1.0f, -140)), 0);  // clamps at e = -127
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mag(-130.0f, 127.0f);
  for (int i = 0; i < 20000; ++i) {
    const float a = std::exp2(mag(rng));
    ASSERT_EQ(E8M0ScaleFor(a), ReferenceE8M0(a)) << a;
  }
}

// MXFP8: a 2-D float32 piece with 1x32 blocks (last block partial), row-major with a row pitch;
// elements and e8m0 scales against the reference, zero and NaN blocks included.
TEST(QuantizeTest, MxScalesQuantiseAPieceWithA1x32BlockGrid) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {64, 80}, planner::DType::kF32});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{32, 0}, {64, 80}};  // 32 x 80: blocks 1 x 32 -> grid 32 x 3 (last 16 wide)
  p.buffer = 0;
  p.offset_bytes = 16;
  p.strides = {96, 1};  // row pitch 96 bytes
  planner::Quantization q;
  q.block = {1, 32};
  q.scale_dtype = planner::DType::kE8M0;
  q.scale_buffer = 0;
  q.scale_offset_bytes = 16 + 32 * 96 + 3;  // byte scales: any alignment
  p.quant = q;
  planner::WorkerLayout layout;
  layout.buffers.push_back({q.scale_offset_bytes + 32 * 3 + 5});
  layout.pieces.push_back(p);
  ASSERT_TRUE(planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r");

  const int64_t rows = 32, cols = 80;
  std::vector<float> shadow(rows * cols);
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.0f, static_cast<int>(r) * 3 - 60);  // blocks far apart in magnitude
    for (int64_t c = 0; c < cols; ++c) shadow[r * cols + c] = n(rng) * row_scale;
  }
  for (int64_t c = 32; c < 64; ++c) shadow[2 * cols + c] = 0.0f;  // zero block (row 2, block 1)
  shadow[5 * cols + 70] = std::nanf("");                           // NaN block (row 5, block 2)
  std::vector<uint8_t> buf(layout.buffers[0].size_bytes, 0xAB);
  ASSERT_TRUE(QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()), buf.data(), buf.data()).ok());

  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < 3; ++b) {
      float amax = 0;
      bool nan = false;
      for (int64_t c = b * 32; c < std::min<int64_t>(cols, b * 32 + 32); ++c) {
        nan = nan || std::isnan(shadow[r * cols + c]);
        amax = std::max(amax, std::fabs(shadow[r * cols + c]));
      }
      const uint8_t want_scale = nan ? 0xff : ReferenceE8M0(amax);
      ASSERT_EQ(buf[q.scale_offset_bytes + r * 3 + b], want_scale) << r << "," << b;
      const double pow2 = std::pow(2.0, static_cast<int>(want_scale) - 127);
      for (int64_t c = b * 32; c < std::min<int64_t>(cols, b * 32 + 32); ++c) {
        const uint8_t got = buf[16 + r * 96 + c];
        if (nan) {
          ASSERT_EQ(got & 0x7f, 0x7f) << r << "," << c;
          continue;
        }
        ASSERT_EQ(got, NearestCode(static_cast<float>(shadow[r * cols + c] / pow2))) << r << "," << c;
        if (amax > 0) {  // dequantised within e4m3's precision (and saturation at 448 * 2^e)
          const double back = E4M3ToFloat(got) * pow2;
          ASSERT_NEAR(back, shadow[r * cols + c], std::fabs(shadow[r * cols + c]) / 8 + pow2 * std::ldexp(1.0, -9)) << r << "," << c;
        }
      }
    }
  }
  // Row padding and the bytes around the scales are untouched.
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = cols; c < 96 && 16 + r * 96 + c < q.scale_offset_bytes; ++c) ASSERT_EQ(buf[16 + r * 96 + c], 0xAB);
  }
  for (int64_t i = q.scale_offset_bytes + 96; i < static_cast<int64_t>(buf.size()); ++i) ASSERT_EQ(buf[i], 0xAB);
  EXPECT_EQ(buf[q.scale_offset_bytes - 1], 0xAB);
}

// Nearest bfloat16 / float16 by comparing the two neighbours in double (ties to the even one).
uint16_t NearestHalfLike(float x, bool bf16) {
  auto value = [&](uint16_t h) -> double {
    if (bf16) {
      const uint32_t b = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
    return LoadAsFloat(reinterpret_cast<const uint8_t*>(&h), planner::DType::kF16);
  };
  const double a = std::fabs(static_cast<double>(x));
  uint16_t lo = 0, hi = bf16 ? 0x7f80 : 0x7c00;  // binary search over the magnitude codes
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    (value(mid) <= a ? lo : hi) = mid;
  }
  const double dl = a - value(lo), dh = value(hi) - a;
  const uint16_t pick = dl < dh ? lo : dh < dl ? hi : ((lo & 1) == 0 ? lo : hi);
  return static_cast<uint16_t>(pick | (std::signbit(x) ? 0x8000 : 0));
}

TEST(QuantizeTest, FloatToBF16AndF16RoundToNearestEven) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> mag(-30.0f, 17.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(mag(rng));
    ASSERT_EQ(FloatToBF16(x), NearestHalfLike(x, true)) << x;
    if (std::fabs(x) < 65504.0f) {
      ASSERT_EQ(FloatToF16(x), NearestHalfLike(x, false)) << x;
    }
  }
  // Ties: exactly between two bfloat16 codes -> the even one.
  EXPECT_EQ(FloatToBF16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(FloatToBF16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // rounds past the largest half: inf
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(0x1p-25f), 0x0000);  // half of the smallest subnormal: tie to even (0)
  EXPECT_EQ(FloatToF16(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(FloatToF16(std::nanf("")) & 0x7e00, 0x7e00);
}

// int4 (compressed-tensors W4A16): a bf16 piece with groups of 1 x 32 and bf16 scales, packed two
// per byte with a row pitch; every nibble and scale against a reference computed here.
TEST(QuantizeTest, Int4GroupsPackTwoElementsPerByte) {
  for (planner::DType sdt : {planner::DType::kBF16, planner::DType::kF16, planner::DType::kF32}) {
    planner::Inventory inv;
    inv.tensors.push_back({"w", {16, 96}, planner::DType::kBF16});
    planner::Piece p;
    p.tensor = 0;
    p.box = {{4, 32}, {16, 96}};  // 12 x 64: groups 1 x 32 -> 12 x 2
    p.buffer = 0;
    p.offset_bytes = 8;
    p.strides = {80, 1};  // row pitch 40 bytes
    planner::Quantization q;
    q.dtype = planner::DType::kI4;
    q.scale_dtype = sdt;
    q.block = {1, 32};
    q.scale_offset_bytes = 8 + 11 * 40 + 32 + 4;
    p.quant = q;
    planner::WorkerLayout layout;
    const int ss = planner::DTypeSize(sdt);
    layout.buffers.push_back({q.scale_offset_bytes + 24 * ss + 8});
    layout.pieces.push_back(p);
    ASSERT_TRUE(planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r").ok())
        << planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r");
    const int64_t rows = 12, cols = 64;
    std::vector<uint16_t> shadow(rows * cols);
    std::mt19937 rng(8);
    std::normal_distribution<float> n(0.0f, 0.05f);
    for (int64_t i = 0; i < rows * cols; ++i) shadow[i] = ToBF16(n(rng));
    for (int64_t c = 0; c < 32; ++c) shadow[3 * cols + c] = 0;  // zero group: scale floors at 2^-23
    shadow[7 * cols + 40] = 0x7fc0;                               // NaN: its group's scale is NaN, elements 0
    std::vector<uint8_t> buf(layout.buffers[0].size_bytes, 0xAB);
    ASSERT_TRUE(QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()), buf.data(), buf.data()).ok());
    auto val = [&](int64_t r, int64_t c) {
      uint32_t b = static_cast<uint32_t>(shadow[r * cols + c]) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    };
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < 2; ++g) {
        double amax = 0;
        bool nan = false;
        for (int64_t c = g * 32; c < g * 32 + 32; ++c) {
          nan = nan || std::isnan(val(r, c));
          amax = std::max(amax, std::fabs(static_cast<double>(val(r, c))));
        }
        const uint8_t* sp = buf.data() + q.scale_offset_bytes + (r * 2 + g) * ss;
        const float stored = sdt == planner::DType::kF32 ? [&] { float f; std::memcpy(&f, sp, 4); return f; }()
                                                         : LoadAsFloat(sp, sdt);
        if (nan) {
          ASSERT_TRUE(std::isnan(stored)) << r << "," << g;
        } else {
          const float want = std::max(static_cast<float>(amax) / 7.5f, 1.1920929e-07f);
          const float want_stored = sdt == planner::DType::kF32 ? want
                                    : [&] { uint16_t h = NearestHalfLike(want, sdt == planner::DType::kBF16);
                                            return LoadAsFloat(reinterpret_cast<const uint8_t*>(&h), sdt); }();
          ASSERT_EQ(stored, want_stored) << r << "," << g;
        }
        for (int64_t c = g * 32; c < g * 32 + 32; ++c) {
          const uint8_t byte = buf[8 + r * 40 + c / 2];
          const int got = (c % 2 == 0 ? byte & 0xf : byte >> 4) - 8;
          int want = 0;
          if (!nan) {
            // compressed-tensors: x / scale in torch's promoted dtype (bf16 / bf16 rounds to bf16),
            // then torch.round (half to even).
            float quotient = val(r, c) / stored;
            if (sdt == planner::DType::kBF16) {
              const uint16_t h = NearestHalfLike(quotient, true);
              quotient = LoadAsFloat(reinterpret_cast<const uint8_t*>(&h), planner::DType::kBF16);
            }
            want = static_cast<int>(std::clamp(std::nearbyint(static_cast<double>(quotient)), -8.0, 7.0));
          }
          ASSERT_EQ(got, want) << r << "," << c;
        }
      }
    }
    // Row padding (bytes 32..39 of each row) and the bytes around the scales are untouched.
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 32; c < 40 && 8 + r * 40 + c < q.scale_offset_bytes; ++c) ASSERT_EQ(buf[8 + r * 40 + c], 0xAB);
    }
    for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(buf[i], 0xAB);
    for (int64_t i = q.scale_offset_bytes + 24 * ss; i < static_cast<int64_t>(buf.size()); ++i) ASSERT_EQ(buf[i], 0xAB);
  }
}

// NVFP4 reference, independent of FloatToE2M1's bound counting: the nearest of the eight
// magnitudes by search, ties to the even code, sign = y < 0, NaN -> 7.
uint8_t NearestE2M1(float y) {
  static const double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if (std::isnan(y)) return 7;
  if (std::isinf(y)) return y < 0 ? 15 : 7;  // beyond 6: saturates
  const double a = std::fabs(static_cast<double>(y));
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(kMag[c] - a), bd = std::fabs(kMag[best] - a);
    if (d < bd || (d == bd && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (y < 0.0f ? 8 : 0));
}

TEST(QuantizeTest, E2M1RoundsToNearestEvenAndSaturates) {
  // Every tie, both sides of it, and the cases ModelOpt's sign rule makes special.
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (float t : ties) {
    for (float v : {t, std::nextafter(t, 0.0f), std::nextafter(t, 10.0f)}) {
      EXPECT_EQ(FloatToE2M1(v), NearestE2M1(v)) << v;
      EXPECT_EQ(FloatToE2M1(-v), NearestE2M1(-v)) << -v;
    }
  }
  EXPECT_EQ(FloatToE2M1(0.25f), 0);    // 0 is the even neighbour
  EXPECT_EQ(FloatToE2M1(0.75f), 2);    // 1.0
  EXPECT_EQ(FloatToE2M1(2.5f), 4);     // 2.0
  EXPECT_EQ(FloatToE2M1(3.5f), 6);     // 4.0
  EXPECT_EQ(FloatToE2M1(5.0f), 6);     // 4.0
  EXPECT_EQ(FloatToE2M1(100.0f), 7);   // saturates at 6
  EXPECT_EQ(FloatToE2M1(-INFINITY), 15);
  EXPECT_EQ(FloatToE2M1(-0.0f), 0);    // -0 < 0 is false
  EXPECT_EQ(FloatToE2M1(-0.1f), 8);    // rounds to 0, keeps its sign
  EXPECT_EQ(FloatToE2M1(std::nanf("")), 7);
  for (int c = 0; c < 16; ++c) {
    if (c == 8) continue;  // -0 decodes to -0.0, which encodes as 0
    EXPECT_EQ(FloatToE2M1(E2M1ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  for (int i = 0; i < 100000; ++i) {
    const float v = u(rng);
    ASSERT_EQ(FloatToE2M1(v), NearestE2M1(v)) << v;
  }
  EXPECT_EQ(NvFp4GlobalScale(2688.0f), 1.0f);
  EXPECT_EQ(NvFp4GlobalScale(0.0f), 1.0f);  // all zeros: scale 1 (ModelOpt would divide by 0)
  EXPECT_EQ(NvFp4GlobalScale(1.5f), 1.5f / 2688.0f);
}

// NVFP4: a bf16 piece with a row pitch, blocks of 1 x 16, e4m3 scales and its own global scale
// (no group given), then the same piece with a group's (larger) global scale; every nibble, scale
// and the global scale against the reference above, computed here from the definitions.
TEST(QuantizeTest, NvFp4BlocksPackTwoElementsPerByteWithAGlobalScale) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {16, 96}, planner::DType::kBF16});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{4, 32}, {16, 96}};  // 12 x 64: blocks 1 x 16 -> 12 x 4
  p.buffer = 0;
  p.offset_bytes = 8;
  p.strides = {80, 1};  // row pitch 40 bytes
  planner::Quantization q;
  q.dtype = planner::DType::kF4E2M1;
  q.scale_dtype = planner::DType::kF8E4M3;
  q.block = {1, 16};
  q.scale_offset_bytes = 8 + 11 * 40 + 32 + 1;
  q.global_scale_offset_bytes = (q.scale_offset_bytes + 48 + 3) / 4 * 4;
  p.quant = q;
  planner::WorkerLayout layout;
  layout.buffers.push_back({q.global_scale_offset_bytes + 4 + 8});
  layout.pieces.push_back(p);
  ASSERT_TRUE(planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r");
  const int64_t rows = 12, cols = 64;
  std::vector<uint16_t> shadow(rows * cols);
  std::mt19937 rng(9);
  std::normal_distribution<float> n(0.0f, 0.02f);
  for (int64_t i = 0; i < rows * cols; ++i) shadow[i] = ToBF16(n(rng));
  for (int64_t c = 0; c < 16; ++c) shadow[2 * cols + c] = 0;  // zero block: scale 1.0
  shadow[5 * cols + 3] = ToBF16(0.5f);                        // the piece's largest magnitude
  for (int64_t c = 16; c < 32; ++c) shadow[6 * cols + c] = ToBF16(1e-9f * (c - 20));  // tiny block: scale underflows
  auto val = [&](int64_t r, int64_t c) {
    uint32_t b = static_cast<uint32_t>(shadow[r * cols + c]) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  };
  for (float group_amax : {0.0f, 0.75f}) {  // 0: the piece is its own group
    std::vector<uint8_t> buf(layout.buffers[0].size_bytes, 0xAB);
    std::optional<float> given;
    if (group_amax > 0) given = NvFp4GlobalScale(group_amax);
    ASSERT_TRUE(QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()), buf.data(), buf.data(), given).ok());
    const float g = (group_amax > 0 ? group_amax : 0.5f) / 2688.0f;
    float stored_g;
    std::memcpy(&stored_g, buf.data() + q.global_scale_offset_bytes, 4);
    if (given.has_value()) {
      uint32_t untouched;
      std::memcpy(&untouched, buf.data() + q.global_scale_offset_bytes, 4);
      EXPECT_EQ(untouched, 0xABABABABu) << "a given group scale is stored by the caller";
    } else {
      EXPECT_EQ(stored_g, g);
    }
    int underflowed = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < 4; ++b) {
        float amax = 0;
        for (int64_t c = b * 16; c < b * 16 + 16; ++c) amax = std::max(amax, std::fabs(val(r, c)));
        float bs = amax / (6.0f * g);
        if (bs == 0.0f) bs = 1.0f;
        const uint8_t want_scale = NearestCode(bs);
        const uint8_t got_scale = buf[q.scale_offset_bytes + r * 4 + b];
        ASSERT_EQ(got_scale, want_scale) << r << "," << b;
        underflowed += want_scale == 0;
        const float d = static_cast<float>(CodeValue(want_scale)) * g;
        for (int64_t c = b * 16; c < b * 16 + 16; ++c) {
          const uint8_t byte = buf[8 + r * 40 + c / 2];
          const int got = c % 2 == 0 ? byte & 0xf : byte >> 4;
          ASSERT_EQ(got, NearestE2M1(val(r, c) / d)) << r << "," << c;
        }
      }
    }
    EXPECT_GT(underflowed, 0) << "the tiny block's scale should round to e4m3 zero (x / 0 saturates)";
    EXPECT_EQ(buf[q.scale_offset_bytes + 2 * 4], 0x38) << "an all-zero block gets scale 1.0";
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 32; c < 40 && 8 + r * 40 + c < q.scale_offset_bytes; ++c) ASSERT_EQ(buf[8 + r * 40 + c], 0xAB);
    }
    for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(buf[i], 0xAB);
    for (int64_t i = q.scale_offset_bytes + 48; i < q.global_scale_offset_bytes; ++i) ASSERT_EQ(buf[i], 0xAB);
  }
}

// NVFP4 block scales over every e4m3 code: with the global scale 1, block k's largest magnitude is
// 6 x code k's value (exact in bfloat16), so its scale must be code k, an all-zero block 1.0 (0x38),
// and a block between two codes the nearest one; its elements against the reference with the
// divisor read back. Covers the block-scale loop's branch-free e4m3 conversion and read-back.
TEST(QuantizeTest, NvFp4ScalesHitEveryE4M3Code) {
  const int64_t blocks = 0x7e + 1 + 8;  // codes 0..0x7e, then 8 blocks halfway between codes
  planner::Inventory inv;
  inv.tensors.push_back({"w", {1, blocks * 16}, planner::DType::kBF16});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{0, 0}, {1, blocks * 16}};
  p.buffer = 0;
  p.offset_bytes = 0;
  p.strides = {blocks * 16, 1};
  planner::Quantization q;
  q.dtype = planner::DType::kF4E2M1;
  q.scale_dtype = planner::DType::kF8E4M3;
  q.block = {1, 16};
  q.scale_offset_bytes = blocks * 8;
  q.global_scale_offset_bytes = (q.scale_offset_bytes + blocks + 3) / 4 * 4;
  p.quant = q;
  planner::WorkerLayout layout;
  layout.buffers.push_back({q.global_scale_offset_bytes + 4});
  layout.pieces.push_back(p);
  ASSERT_TRUE(planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r").ok());
  std::vector<float> want_amax(static_cast<size_t>(blocks));
  for (int64_t b = 0; b <= 0x7e; ++b) want_amax[static_cast<size_t>(b)] = 6.0f * static_cast<float>(CodeValue(static_cast<int>(b)));
  for (int64_t k = 0; k < 8; ++k) {  // midpoints between codes 16k+3 and 16k+4 (ties to even) and a bit above
    const int c = static_cast<int>(16 * k + 3);
    const double mid = (CodeValue(c) + CodeValue(c + 1)) / 2 * 6.0;
    want_amax[static_cast<size_t>(0x7f + k)] = ToBF16Value(static_cast<float>(k % 2 == 0 ? mid : mid * 1.01));
  }
  std::vector<uint16_t> shadow(static_cast<size_t>(blocks * 16));
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float a = want_amax[static_cast<size_t>(b)];
    for (int64_t j = 0; j < 16; ++j) shadow[static_cast<size_t>(b * 16 + j)] = ToBF16(a * u(rng));
    shadow[static_cast<size_t>(b * 16 + (b % 16))] = ToBF16(b % 2 == 0 ? a : -a);  // the block's magnitude, exact in bf16
  }
  std::vector<uint8_t> buf(layout.buffers[0].size_bytes, 0);
  ASSERT_TRUE(QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()), buf.data(), buf.data(), 1.0f).ok());
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0;
    for (int64_t j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(BF16Value(shadow[static_cast<size_t>(b * 16 + j)])));
    ASSERT_EQ(amax, want_amax[static_cast<size_t>(b)]) << b;
    const float bs = amax / 6.0f == 0.0f ? 1.0f : amax / 6.0f;
    const uint8_t want_scale = NearestCode(bs);
    if (b <= 0x7e && b > 0) {
      ASSERT_EQ(want_scale, b) << "the sweep itself";
    }
    ASSERT_EQ(buf[static_cast<size_t>(q.scale_offset_bytes + b)], want_scale) << "block " << b;
    const float d = static_cast<float>(CodeValue(want_scale));
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t c = b * 16 + j;
      const uint8_t byte = buf[static_cast<size_t>(c / 2)];
      ASSERT_EQ(c % 2 == 0 ? byte & 0xf : byte >> 4, NearestE2M1(BF16Value(shadow[static_cast<size_t>(c)]) / d)) << "block " << b << " element " << j;
    }
  }
  EXPECT_EQ(buf[static_cast<size_t>(q.scale_offset_bytes)], 0x38) << "an all-zero block gets scale 1.0";
}

// MX (e8m0) scales over every exponent a float32 block's magnitude can have: subnormal magnitudes
// (down to 2^-149, clamping at e = -127), every normal binade, the largest finite value, infinity
// and NaN; scales against ReferenceE8M0 and elements against the nearest-code search. Covers the
// block-scale loop's exponent read off the float's bits.
TEST(QuantizeTest, MxScalesCoverEveryExponent) {
  std::vector<float> amax;
  for (int k = -149; k <= 127; ++k) amax.push_back(std::ldexp(k % 3 == 0 ? 1.0f : 1.75f, k));
  amax.push_back(std::numeric_limits<float>::max());
  amax.push_back(std::numeric_limits<float>::infinity());
  amax.push_back(std::nanf(""));
  amax.push_back(0.0f);
  const int64_t rows = static_cast<int64_t>(amax.size());
  planner::Inventory inv;
  inv.tensors.push_back({"w", {rows, 32}, planner::DType::kF32});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{0, 0}, {rows, 32}};
  p.buffer = 0;
  p.offset_bytes = 0;
  p.strides = {32, 1};
  planner::Quantization q;
  q.block = {1, 32};
  q.scale_dtype = planner::DType::kE8M0;
  q.scale_buffer = 0;
  q.scale_offset_bytes = rows * 32;
  p.quant = q;
  planner::WorkerLayout layout;
  layout.buffers.push_back({q.scale_offset_bytes + rows});
  layout.pieces.push_back(p);
  ASSERT_TRUE(planner::ValidateLayout(inv, layout, planner::Role::kRollout, "r").ok());
  std::vector<float> shadow(static_cast<size_t>(rows * 32));
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float a = amax[static_cast<size_t>(r)];
    for (int64_t j = 0; j < 32; ++j) shadow[static_cast<size_t>(r * 32 + j)] = std::isfinite(a) ? a * u(rng) : 0.0f;
    shadow[static_cast<size_t>(r * 32 + r % 32)] = r % 2 == 0 ? a : -a;
  }
  std::vector<uint8_t> buf(layout.buffers[0].size_bytes, 0);
  ASSERT_TRUE(QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()), buf.data(), buf.data()).ok());
  for (int64_t r = 0; r < rows; ++r) {
    const float a = amax[static_cast<size_t>(r)];
    const uint8_t want = std::isinf(a) ? 0xff : ReferenceE8M0(a);  // torchao: inf -> the NaN scale
    ASSERT_EQ(buf[static_cast<size_t>(q.scale_offset_bytes + r)], want) << "block magnitude " << a;
    if (!std::isfinite(a)) {  // the NaN scale: every element NaN
      for (int64_t j = 0; j < 32; ++j) ASSERT_EQ(buf[static_cast<size_t>(r * 32 + j)] & 0x7f, 0x7f) << "block magnitude " << a << " element " << j;
      continue;
    }
    const double pow2 = std::pow(2.0, static_cast<int>(want) - 127);
    for (int64_t j = 0; j < 32; ++j) {
      const float x = shadow[static_cast<size_t>(r * 32 + j)];
      ASSERT_EQ(buf[static_cast<size_t>(r * 32 + j)], NearestCode(static_cast<float>(x / pow2))) << "block magnitude " << a << " element " << j;
    }
  }
}

TEST(QuantizeTest, ShadowAbsMaxFindsTheLargestMagnitudeAndNaN) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {3, 70000}, planner::DType::kBF16});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{0, 0}, {3, 70000}};
  std::vector<uint16_t> shadow(3 * 70000, ToBF16(0.25f));
  shadow[3 * 70000 - 1] = ToBF16(-3.0f);  // past the first 2^16-element slice
  EXPECT_EQ(ShadowAbsMax(inv, p, reinterpret_cast<const uint8_t*>(shadow.data())), 3.0f);
  shadow[5] = 0x7fc0;
  EXPECT_TRUE(std::isnan(ShadowAbsMax(inv, p, reinterpret_cast<const uint8_t*>(shadow.data()))));
}

TEST(QuantizeTest, RefusesUnquantisedPieces) {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {4}, planner::DType::kBF16});
  planner::Piece p;
  p.tensor = 0;
  p.box = {{0}, {4}};
  p.strides = {1};
  uint8_t b[8] = {};
  EXPECT_EQ(QuantizePiece(inv, p, b, b, b).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wb::daemon
