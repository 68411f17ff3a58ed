#pragma once
// Block quantisation (float8_e4m3fn, int4, NVFP4) of a rollout's quantised pieces (planner/types.h
// `Quantization`, planner/quantized.h): runs on the receiving node, on host staging, after a
// version has fully landed and before it commits.
//
// Numerics, float32 scales (DeepGEMM's per_block_cast_to_fp8, copied into vLLM as
// vllm/utils/deep_gemm.py: `sf = amax / 448.0; (x * (1.0 / sf)).to(float8_e4m3fn)`), IEEE float32
// operations as written (torch on the CPU; torch on CUDA turns `amax / 448.0` into a multiply by
// the rounded reciprocal, which can differ in scale_inv's last bit):
//   amax      = max(max |x| over the block, 1e-4)   (x read in float32 from the canonical dtype)
//   scale_inv = amax / 448                          (stored, float32; dequantise: q * scale_inv)
//   q         = float8_e4m3fn(x * (1 / scale_inv))  (each operation rounded to float32; the cast
//                                                    rounds to nearest even, saturating at +-448)
// float8_e8m0 scales (OCP Microscaling spec v1.0, MXFP8 e4m3; torchao's default FLOOR rounding):
//   e         = floor(log2(amax)) - 8, clamped to [-127, 127] (amax 0 -> -127; 8 = emax of e4m3)
//   scale     = e + 127 stored as one byte (dequantise: q * 2^e)
//   q         = float8_e4m3fn(x * 2^-e)             (exact scaling; round to nearest even,
//                                                    saturating: amax * 2^-e lies in [256, 512))
// NaN inputs give the e4m3fn NaN (0x7f / 0xff); with e8m0 a block holding a NaN or an infinity
// gets scale 0xff (the NaN scale, as torchao's to_mx) and NaN elements.
// int4 (compressed-tensors "pack-quantized" W4A16, symmetric, group strategy):
//   scale     = max(amax / 7.5, 2^-23), stored in the scale dtype (bf16/f16/f32, nearest even)
//   q         = clamp(rint(x / s), -8, 7) with s the stored scale read back, NaN -> 0; the
//               quotient rounded as compressed-tensors' `x / scale` rounds it in torch: to the
//               model dtype when the scale has that dtype (bfloat16 / float16: nearest even, then
//               rint - about 1% of elements differ from rounding the float32 quotient), else float32
//   stored    = q + 8, two per byte along the last dim, the even element in the low nibble
//               (compressed-tensors' int32 packing read as little-endian bytes).
// NVFP4 (float4_e2m1 elements, 1x16 blocks, float8_e4m3 scales, float32 global scale; ModelOpt's
// NVFP4QTensor, the format vLLM's modelopt_fp4 loads):
//   global    = amax_group / (6 * 448) (amax over every piece sharing the global scale; 0 -> 1)
//   scale     = e4m3(amax_block / (6 * global)), an exact 0 replaced by 1 before the cast
//   q         = e2m1(x / (float(scale) * global)): round to nearest even over
//               {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, sign = (x / d < 0) (so a negative
//               value that rounds to 0 is code 8), NaN -> 7; float32 arithmetic in that order
//   stored    = code (sign << 3 | magnitude index), two per byte, the even element in the low nibble.

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "planner/types.h"

namespace wb::daemon {

// float -> float8_e4m3fn bits (round to nearest, ties to even; |x| beyond 448 saturates to +-448).
uint8_t FloatToE4M3(float x);
// float -> bfloat16 / float16 bits, round to nearest even (float16: beyond its range -> inf).
uint16_t FloatToBF16(float x);
uint16_t FloatToF16(float x);
// float8_e4m3fn bits -> float (0x7f / 0xff are NaN).
float E4M3ToFloat(uint8_t bits);
// One element of a canonical tensor (bfloat16, float16 or float32 bytes) as float.
float LoadAsFloat(const uint8_t* p, planner::DType dtype);

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kMinBlockAmax = 1e-4f;
inline constexpr int kE4M3MaxExponent = 8;  // floor(log2(448))
inline constexpr float kInt4ScaleDivisor = 7.5f;        // (q_max - q_min) / 2 for q in [-8, 7]
inline constexpr float kInt4MinScale = 1.1920929e-07f;  // float32 epsilon, compressed-tensors' floor
inline constexpr uint8_t kE8M0Nan = 0xff;

// The e8m0 scale byte of a block whose largest magnitude is `amax` (see above).
uint8_t E8M0ScaleFor(float amax);

inline constexpr float kE2M1Max = 6.0f;
// float -> float4_e2m1 code (NVFP4 rounding above), and back.
uint8_t FloatToE2M1(float y);
float E2M1ToFloat(uint8_t code);
// NVFP4's second-level scale for a group whose largest magnitude is `amax` (see above).
float NvFp4GlobalScale(float amax);
// max |x| over a quantised piece's shadow (canonical dtype, row-major over its box); NaN if any
// element is NaN or the dtype is not bfloat16 / float16 / float32.
float ShadowAbsMax(const planner::Inventory& inventory, const planner::Piece& piece, const uint8_t* shadow);

// Quantises `piece` (quantised and validated against its layout): reads its box from `shadow`
// (canonical dtype, row-major over the box, as planner::StagingLayout places it), writes the e4m3
// (or packed int4) elements at the piece's offset and strides into `elements` (the base of the piece's buffer) and
// the scales (quant.scale_dtype), row-major over the block grid, at quant.scale_offset_bytes of `scales` (the
// base of the scale buffer). The caller has checked every address against its buffer (the layout
// was validated); INVALID_ARGUMENT for a piece without quant or a dtype it cannot read.
// NVFP4 pieces: `nvfp4_global_scale` is the group's global scale (NvFp4GlobalScale of the group's
// ShadowAbsMax), which the caller stores once at quant.global_scale_offset_bytes of `scales`;
// without it the piece is its own group and its global scale is computed and stored here.
absl::Status QuantizePiece(const planner::Inventory& inventory, const planner::Piece& piece, const uint8_t* shadow,
                           uint8_t* elements, uint8_t* scales, std::optional<float> nvfp4_global_scale = std::nullopt);

}  // namespace wb::daemon
