#include "planner/quantized.h"

#include <string>

#include "gtest/gtest.h"
#include "planner/validate.h"

namespace wb::planner {
namespace {

// a.weight: 256 x 384 bf16 (2 x 3 blocks of 128), b.bias: 10 f32, c.idx: 4 int64.
Inventory Inv() {
  Inventory inv;
  inv.tensors.push_back({"a.weight", {256, 384}, DType::kBF16});
  inv.tensors.push_back({"b.bias", {10}, DType::kF32});
  inv.tensors.push_back({"c.idx", {4}, DType::kI64});
  inv.tensors.push_back({"d.weight", {200, 130}, DType::kF16});
  return inv;
}

Piece QuantPiece(int32_t tensor, Box box, int64_t off, std::vector<int64_t> strides, std::vector<int64_t> block,
                 int64_t scale_off, int32_t scale_buffer = 0) {
  Piece p;
  p.tensor = tensor;
  p.box = std::move(box);
  p.offset_bytes = off;
  p.strides = std::move(strides);
  Quantization q;
  q.block = std::move(block);
  q.scale_buffer = scale_buffer;
  q.scale_offset_bytes = scale_off;
  p.quant = q;
  return p;
}

// Rows [128, 256) of a.weight as fp8 (128 x 384 bytes at 0), its 1 x 3 scales at 49152.
WorkerLayout Good() {
  WorkerLayout l;
  l.buffers.push_back({49152 + 12});
  l.pieces.push_back(QuantPiece(0, {{128, 0}, {256, 384}}, 0, {384, 1}, {128, 128}, 49152));
  return l;
}

void ExpectError(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.message();
}

TEST(QuantizedTest, ScaleShapeRoundsUpAtTheTensorEnd) {
  Piece p = QuantPiece(3, {{128, 0}, {200, 130}}, 0, {130, 1}, {128, 128}, 0);
  EXPECT_EQ(ScaleShape(p), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ScaleCount(p), 2);
  Piece plain;
  EXPECT_TRUE(ScaleShape(plain).empty());
  EXPECT_EQ(ScaleCount(plain), 0);
}

TEST(QuantizedTest, ValidQuantisedRolloutPiece) {
  Inventory inv = Inv();
  EXPECT_TRUE(ValidateLayout(inv, Good(), Role::kRollout, "r").ok()) << ValidateLayout(inv, Good(), Role::kRollout, "r");
  EXPECT_EQ(StoredBytes(inv, Good().pieces[0]).element_size, 1);
  // The fp8 elements take one byte each: a buffer one byte short of elements + scales is refused.
  WorkerLayout l = Good();
  l.buffers[0].size_bytes -= 1;
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "scales [49152, 49164) reach beyond buffer 0 of 49163 bytes");
}

TEST(QuantizedTest, TrainersMayNotQuantise) {
  ExpectError(ValidateLayout(Inv(), Good(), Role::kTrainer, "t"), "only rollout workers may hold a quantised piece");
}

TEST(QuantizedTest, UnalignedBoxIsRefused) {
  WorkerLayout l = Good();
  l.pieces[0].box = {{64, 0}, {192, 384}};
  ExpectError(ValidateLayout(Inv(), l, Role::kRollout, "r"), "not aligned to the quantisation blocks 128x128 in dim 0");
  // Ending at the tensor's end is fine although 130 is not a multiple of 128.
  WorkerLayout d;
  d.buffers.push_back({200 * 130 + 8});
  d.pieces.push_back(QuantPiece(3, {{128, 0}, {200, 130}}, 0, {130, 1}, {128, 128}, 72 * 130));
  EXPECT_TRUE(ValidateLayout(Inv(), d, Role::kRollout, "r").ok()) << ValidateLayout(Inv(), d, Role::kRollout, "r");
}

TEST(QuantizedTest, BadDtypesBlocksAndScaleRegions) {
  Inventory inv = Inv();
  WorkerLayout l = Good();
  l.pieces[0].quant->dtype = DType::kBF16;
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "quantised dtype bfloat16 is not supported");
  l = Good();
  l.pieces[0].quant->block = {128};
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "quantisation block has rank 1, the tensor has rank 2");
  l = Good();
  l.pieces[0].quant->block = {128, 0};
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "quantisation block dim 1 is 0");
  l = Good();
  l.pieces[0].quant->scale_buffer = 1;
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "scale buffer 1 not registered");
  l = Good();
  l.pieces[0].quant->scale_offset_bytes = 49150;
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "scale offset 49150 negative or not a multiple of 4");
  WorkerLayout c;
  c.buffers.push_back({64});
  c.pieces.push_back(QuantPiece(2, {{0}, {4}}, 0, {1}, {4}, 32));
  ExpectError(ValidateLayout(inv, c, Role::kRollout, "r"), "cannot quantise a int64 tensor");
}

TEST(QuantizedTest, E8M0ScalesAreOneByteEachAndNeedNoAlignment) {
  Inventory inv = Inv();
  // Rows [128, 256) of a.weight with MX blocks 1 x 32: 128 x 12 byte scales at an odd offset.
  WorkerLayout l;
  l.buffers.push_back({49153 + 128 * 12});
  l.pieces.push_back(QuantPiece(0, {{128, 0}, {256, 384}}, 0, {384, 1}, {1, 32}, 49153));
  l.pieces[0].quant->scale_dtype = DType::kE8M0;
  EXPECT_EQ(ScaleElementSize(*l.pieces[0].quant), 1);
  EXPECT_EQ(ScaleCount(l.pieces[0]), 128 * 12);
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kRollout, "r").ok()) << ValidateLayout(inv, l, Role::kRollout, "r");
  l.buffers[0].size_bytes -= 1;  // the last scale byte falls outside
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "reach beyond buffer 0");
  l.buffers[0].size_bytes += 1;
  l.pieces[0].quant->scale_offset_bytes = 49152 - 1;  // overlaps the piece's last element
  EXPECT_EQ(ValidateLayout(inv, l, Role::kRollout, "r").code(), absl::StatusCode::kInvalidArgument);
  l.pieces[0].quant->scale_offset_bytes = 49153;
  l.pieces[0].quant->scale_dtype = DType::kBF16;
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "scale dtype bfloat16 is not supported for float8_e4m3 (float32 or float8_e8m0)");
  // The scale dtype is part of the fingerprinted layout: float32 scales of the same piece need 4x
  // the bytes and 4-byte alignment.
  l.pieces[0].quant->scale_dtype = DType::kF32;
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "not a multiple of 4 (float32 scales)");
}

TEST(QuantizedTest, Int4PiecesPackTwoElementsPerByteAlongTheLastDim) {
  Inventory inv = Inv();
  // Rows [128, 256) of a.weight as int4 with groups of 1 x 32 and bfloat16 scales: 128 x 384
  // elements = 128 x 192 bytes (row pitch 200 bytes = 400 int4 elements), then 128 x 12 scales.
  const int64_t pitch = 400, bytes = 127 * 200 + 192;
  WorkerLayout l;
  l.buffers.push_back({bytes + 128 * 12 * 2});
  l.pieces.push_back(QuantPiece(0, {{128, 0}, {256, 384}}, 0, {pitch, 1}, {1, 32}, bytes));
  l.pieces[0].quant->dtype = DType::kI4;
  l.pieces[0].quant->scale_dtype = DType::kBF16;
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kRollout, "r").ok()) << ValidateLayout(inv, l, Role::kRollout, "r");
  const ByteView v = StoredBytes(inv, l.pieces[0]);
  EXPECT_EQ(v.element_size, 1);
  EXPECT_EQ(v.piece.box.end, (std::vector<int64_t>{256, 192}));
  EXPECT_EQ(v.piece.strides, (std::vector<int64_t>{200, 1}));
  EXPECT_EQ(ScaleElementSize(*l.pieces[0].quant), 2);
  // One byte short: the last element pair or the last scale falls outside.
  l.buffers[0].size_bytes -= 1;
  EXPECT_EQ(ValidateLayout(inv, l, Role::kRollout, "r").code(), absl::StatusCode::kInvalidArgument);
  l.buffers[0].size_bytes += 1;
  // Scales placed over the packed bytes' last row overlap them (bytes, not elements).
  WorkerLayout o = l;
  o.pieces[0].quant->scale_offset_bytes = bytes - 2;
  ExpectError(ValidateLayout(inv, o, Role::kRollout, "r"), "overlap");
  // Packing rules.
  WorkerLayout s = l;
  s.pieces[0].strides = {401, 1};
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "int4 stride of dim 0 is 401 elements");
  s = l;
  s.pieces[0].strides = {1, 128};  // transposed: not packed along the last dim
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "packed two per byte along the last dim");
  // Scale dtypes per element dtype.
  s = l;
  s.pieces[0].quant->scale_dtype = DType::kE8M0;
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "not supported for int4 (bfloat16, float16 or float32)");
  s = l;
  s.pieces[0].quant->dtype = DType::kF8E4M3;  // one byte per element: the same strides reach twice as far
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "beyond buffer 0");
  // Two int4 pieces side by side in one row share no byte: q rows [0, 128) in bytes [0, 96) of
  // each row, then rows [128, 256) in bytes [96, 192) - fine; one element further, they would.
  WorkerLayout two;
  two.buffers.push_back({128 * 192 + 4096});
  two.pieces.push_back(QuantPiece(0, {{0, 0}, {128, 192}}, 0, {384, 1}, {1, 32}, 128 * 192));
  two.pieces.push_back(QuantPiece(0, {{0, 192}, {128, 384}}, 96, {384, 1}, {1, 32}, 128 * 192 + 2048));
  for (Piece& p : two.pieces) {
    p.quant->dtype = DType::kI4;
    p.quant->scale_dtype = DType::kBF16;
  }
  EXPECT_TRUE(ValidateLayout(inv, two, Role::kRollout, "r").ok()) << ValidateLayout(inv, two, Role::kRollout, "r");
  two.pieces[1].offset_bytes = 95;
  ExpectError(ValidateLayout(inv, two, Role::kRollout, "r"), "overlap");
}

// NVFP4: e2m1 pairs like int4, 1x16 blocks of e4m3 scales, a float32 global scale that pieces
// naming the same place share.
TEST(QuantizedTest, Nvfp4PiecesNeedE4M3ScalesBlocksOf16AndAGlobalScale) {
  Inventory inv = Inv();
  // Rows [0, 128) and [128, 256) of a.weight, each 128 x 192 bytes, then their 128 x 24 scales
  // each, then one global scale both share.
  const int64_t half = 128 * 192, scales = 2 * half, global = scales + 2 * 128 * 24;
  WorkerLayout l;
  l.buffers.push_back({global + 4});
  for (int k = 0; k < 2; ++k) {
    l.pieces.push_back(QuantPiece(0, {{128 * k, 0}, {128 * k + 128, 384}}, k * half, {384, 1}, {1, 16}, scales + k * 128 * 24));
    l.pieces[k].quant->dtype = DType::kF4E2M1;
    l.pieces[k].quant->scale_dtype = DType::kF8E4M3;
    l.pieces[k].quant->global_scale_offset_bytes = global;
  }
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kRollout, "r").ok()) << ValidateLayout(inv, l, Role::kRollout, "r");
  EXPECT_EQ(StoredBytes(inv, l.pieces[0]).element_size, 1);
  EXPECT_EQ(StoredBytes(inv, l.pieces[0]).piece.box.end, (std::vector<int64_t>{128, 192}));
  EXPECT_EQ(ScaleCount(l.pieces[1]), 128 * 24);
  WorkerLayout s = l;
  s.pieces[1].quant->block = {1, 32};
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "float4_e2m1 (NVFP4) needs blocks of 16 along the last dim");
  s = l;
  s.pieces[0].quant->scale_dtype = DType::kE8M0;
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "float8_e4m3 scales (got float8_e8m0)");
  s = l;
  s.pieces[0].quant->global_scale_offset_bytes = -1;
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "needs its float32 global scale inside scale buffer 0");
  s = l;
  s.pieces[0].quant->global_scale_offset_bytes = global + 2;  // not a multiple of 4, and past the end
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "at a multiple of 4");
  s = l;
  s.pieces[1].quant->global_scale_offset_bytes = scales + 4;  // inside piece 0's scales
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "overlap");
  s = l;
  s.pieces[0].strides = {385, 1};
  ExpectError(ValidateLayout(inv, s, Role::kRollout, "r"), "float4_e2m1 stride of dim 0 is 385 elements");
  // A global scale is NVFP4's only.
  WorkerLayout f = Good();
  f.buffers[0].size_bytes += 4;
  f.pieces[0].quant->global_scale_offset_bytes = 49152 + 12;
  ExpectError(ValidateLayout(inv, f, Role::kRollout, "r"), "a global scale is for float4_e2m1 (NVFP4) pieces only");
  // Wire bytes: half a byte per element and a byte per block (no sender-side quantisation).
  EXPECT_EQ(QuantizedBoxBytes(l.pieces[0].box, *l.pieces[0].quant), half + 128 * 24);
}

// Found by fuzz_validate_layout: a scale region whose end does not fit int64 (the error message
// added offset + bytes). INVALID_ARGUMENT, computed without overflow.
TEST(QuantizedTest, ScaleRegionEndingPast2To63IsRefused) {
  Inventory inv;
  inv.tensors.push_back({"w", {int64_t{1} << 20, int64_t{1} << 20}, DType::kBF16});
  WorkerLayout l;
  l.buffers.push_back({INT64_MAX});
  l.pieces.push_back(QuantPiece(0, {{0, 0}, {int64_t{1} << 20, int64_t{1} << 20}}, 0, {int64_t{1} << 20, 1}, {1, 1},
                                (INT64_MAX - (int64_t{1} << 41)) & ~int64_t{3}));
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "reach beyond buffer 0");
}

TEST(QuantizedTest, ScalesMustNotOverlapPiecesOrOtherScales) {
  Inventory inv = Inv();
  WorkerLayout l = Good();
  l.pieces[0].quant->scale_offset_bytes = 49148;  // last 4 bytes of the elements
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "the scales of worker `r` piece 0");
  // Two quantised pieces whose scale regions overlap.
  WorkerLayout two;
  two.buffers.push_back({2 * 49152 + 24});
  two.pieces.push_back(QuantPiece(0, {{0, 0}, {128, 384}}, 0, {384, 1}, {128, 128}, 2 * 49152));
  two.pieces.push_back(QuantPiece(0, {{128, 0}, {256, 384}}, 49152, {384, 1}, {128, 128}, 2 * 49152 + 8));
  ExpectError(ValidateLayout(inv, two, Role::kRollout, "r"), "overlap");
  two.pieces[1].quant->scale_offset_bytes = 2 * 49152 + 12;
  EXPECT_TRUE(ValidateLayout(inv, two, Role::kRollout, "r").ok()) << ValidateLayout(inv, two, Role::kRollout, "r");
}

TEST(QuantizedTest, StagingLayoutAppendsAlignedShadows) {
  Inventory inv = Inv();
  WorkerLayout l;
  l.buffers.push_back({1000});
  l.buffers.push_back({100});
  Piece bias;
  bias.tensor = 1;
  bias.box = {{0}, {10}};
  bias.buffer = 1;
  bias.offset_bytes = 0;
  bias.strides = {1};
  l.pieces.push_back(QuantPiece(3, {{128, 0}, {200, 130}}, 0, {1, 72}, {128, 128}, 9360, 0));  // transposed
  l.pieces.push_back(bias);
  l.pieces.push_back(QuantPiece(1, {{0}, {10}}, 40, {1}, {5}, 52, 1));
  l.pieces.back().buffer = 1;
  WorkerLayout s = StagingLayout(inv, l);
  ASSERT_EQ(s.pieces.size(), 3u);
  // Piece 0: 72 x 130 f16 shadow at 1024 (1000 rounded up to 256), row-major.
  EXPECT_FALSE(s.pieces[0].quant.has_value());
  EXPECT_EQ(s.pieces[0].offset_bytes, 1024);
  EXPECT_EQ(s.pieces[0].strides, (std::vector<int64_t>{130, 1}));
  EXPECT_EQ(s.buffers[0].size_bytes, 1024 + 72 * 130 * 2);
  // Unquantised pieces are untouched.
  EXPECT_EQ(s.pieces[1].offset_bytes, 0);
  EXPECT_EQ(s.pieces[1].buffer, 1);
  // Piece 2: 10 f32 at 256 of buffer 1.
  EXPECT_EQ(s.pieces[2].offset_bytes, 256);
  EXPECT_EQ(s.buffers[1].size_bytes, 256 + 40);
  EXPECT_EQ(s.pieces[2].box.end, (std::vector<int64_t>{10}));
  // Nothing quantised: the same layout.
  WorkerLayout plain;
  plain.buffers.push_back({100});
  plain.pieces.push_back(bias);
  plain.pieces[0].buffer = 0;
  WorkerLayout same = StagingLayout(inv, plain);
  EXPECT_EQ(same.buffers[0].size_bytes, 100);
  EXPECT_EQ(same.pieces[0].offset_bytes, 0);
  EXPECT_FALSE(HasQuantizedPieces(plain));
  EXPECT_TRUE(HasQuantizedPieces(l));
}

TEST(QuantizedTest, WireBytesOfBoxesOnTheBlockGrid) {
  const std::vector<int64_t> shape = {256, 300};
  // 128x128 blocks: a box must start on multiples of 128 and end on one or at the tensor's end.
  EXPECT_TRUE(BoxOnBlockGrid(Box{{0, 0}, {256, 300}}, shape, {128, 128}));
  EXPECT_TRUE(BoxOnBlockGrid(Box{{128, 256}, {256, 300}}, shape, {128, 128}));
  EXPECT_FALSE(BoxOnBlockGrid(Box{{0, 0}, {100, 300}}, shape, {128, 128}));
  EXPECT_FALSE(BoxOnBlockGrid(Box{{0, 64}, {128, 128}}, shape, {128, 128}));
  EXPECT_FALSE(BoxOnBlockGrid(Box{{0, 0}, {128, 128}}, shape, {128}));  // rank mismatch
  Quantization fp8;
  fp8.dtype = DType::kF8E4M3;
  fp8.scale_dtype = DType::kF32;
  fp8.block = {128, 128};
  // 256 x 300 fp8 elements + 2 x 3 float32 scales (the last column block is partial).
  EXPECT_EQ(QuantizedBoxBytes(Box{{0, 0}, {256, 300}}, fp8), 256 * 300 + 2 * 3 * 4);
  Quantization mx = fp8;
  mx.scale_dtype = DType::kE8M0;
  mx.block = {1, 32};
  EXPECT_EQ(QuantizedBoxBytes(Box{{0, 0}, {2, 64}}, mx), 128 + 4);
  Quantization w4;
  w4.dtype = DType::kI4;
  w4.scale_dtype = DType::kBF16;
  w4.block = {1, 32};
  EXPECT_EQ(QuantizedBoxBytes(Box{{0, 0}, {2, 64}}, w4), 64 + 4 * 2);  // two int4 per byte
  EXPECT_TRUE(SameQuantFormat(mx, mx));
  EXPECT_FALSE(SameQuantFormat(mx, fp8));
  EXPECT_FALSE(SameQuantFormat(mx, w4));
}

}  // namespace
}  // namespace wb::planner
