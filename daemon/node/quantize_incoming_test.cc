#include "daemon/node/quantize_incoming.h"

#include <cstring>
#include <random>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/quantize.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "planner/validate.h"

namespace wb::daemon::node {
namespace {

uint16_t Bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}

// NVFP4 groups: pieces naming one global scale share it (the largest magnitude over all of them),
// a piece naming its own keeps its own; every byte equals QuantizePiece given that group's scale.
TEST(QuantizeIncomingTest, Nvfp4PiecesSharingAGlobalScaleUseTheGroupsLargestMagnitude) {
  planner::Inventory inv;
  inv.tensors.push_back({"q", {32, 64}, planner::DType::kBF16});
  inv.tensors.push_back({"k", {16, 64}, planner::DType::kBF16});
  inv.tensors.push_back({"o", {32, 64}, planner::DType::kBF16});
  // q and k share the global scale at 4096 (as a fused qkv_proj's pieces do); o has its own at 4100.
  planner::WorkerLayout live;
  const int64_t scales = 3072;
  auto nv = [&](int32_t tensor, int64_t rows, int64_t at, int64_t scale_at, int64_t global_at) {
    planner::Piece p;
    p.tensor = tensor;
    p.box = {{0, 0}, {rows, 64}};
    p.offset_bytes = at;
    p.strides = {64, 1};
    planner::Quantization q;
    q.dtype = planner::DType::kF4E2M1;
    q.scale_dtype = planner::DType::kF8E4M3;
    q.block = {1, 16};
    q.scale_offset_bytes = scale_at;
    q.global_scale_offset_bytes = global_at;
    p.quant = q;
    return p;
  };
  live.pieces.push_back(nv(0, 32, 0, scales, 4096));
  live.pieces.push_back(nv(1, 16, 32 * 32, scales + 128, 4096));
  live.pieces.push_back(nv(2, 32, 48 * 32, scales + 192, 4100));
  live.buffers.push_back({4104});
  ASSERT_TRUE(planner::ValidateLayout(inv, live, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, live, planner::Role::kRollout, "r");
  const planner::WorkerLayout shadow = planner::StagingLayout(inv, live);
  StagedBytes staging(1);
  staging[0].host.assign(static_cast<size_t>(shadow.buffers[0].size_bytes), 0);
  // q small (|x| <= 0.05), k large (up to 3): q's scales depend on k's magnitude through the group.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> small(-0.05f, 0.05f), large(-3.0f, 3.0f);
  for (size_t k = 0; k < 3; ++k) {
    const planner::Piece& sp = shadow.pieces[k];
    uint16_t* x = reinterpret_cast<uint16_t*>(staging[0].host.data() + sp.offset_bytes);
    for (int64_t i = 0; i < planner::BoxVolume(sp.box); ++i) x[i] = Bf16(k == 1 ? large(rng) : small(rng));
  }
  std::vector<uint8_t> before = staging[0].host;
  QuantizeTarget t;
  t.worker = "r";
  t.live = &live;
  t.shadow = &shadow;
  t.staging = &staging;
  auto r = QuantizeStaging(inv, {t}, 1, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->pieces, 3);

  // The references, from the shadows left as they were.
  const float q_amax = std::max(ShadowAbsMax(inv, live.pieces[0], before.data() + shadow.pieces[0].offset_bytes),
                                ShadowAbsMax(inv, live.pieces[1], before.data() + shadow.pieces[1].offset_bytes));
  const float o_amax = ShadowAbsMax(inv, live.pieces[2], before.data() + shadow.pieces[2].offset_bytes);
  ASSERT_GT(q_amax, 1.0f);
  ASSERT_LE(o_amax, 0.05f);
  std::vector<uint8_t> want = before;
  for (size_t k = 0; k < 3; ++k) {
    const float g = NvFp4GlobalScale(k < 2 ? q_amax : o_amax);
    std::memcpy(want.data() + live.pieces[k].quant->global_scale_offset_bytes, &g, 4);
    ASSERT_TRUE(QuantizePiece(inv, live.pieces[k], before.data() + shadow.pieces[k].offset_bytes, want.data(), want.data(), g).ok());
  }
  float got_g;
  std::memcpy(&got_g, staging[0].host.data() + 4096, 4);
  EXPECT_EQ(got_g, q_amax / 2688.0f);
  std::memcpy(&got_g, staging[0].host.data() + 4100, 4);
  EXPECT_EQ(got_g, o_amax / 2688.0f);
  // Elements, scales and global scales (the shadows past 4104 are left as they landed).
  for (int64_t i = 0; i < 4104; ++i) ASSERT_EQ(staging[0].host[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "byte " << i;
  // Not what q alone would give: its own magnitude would choose other block scales.
  std::vector<uint8_t> alone = before;
  ASSERT_TRUE(QuantizePiece(inv, live.pieces[0], before.data() + shadow.pieces[0].offset_bytes, alone.data(), alone.data()).ok());
  EXPECT_NE(std::memcmp(alone.data() + scales, want.data() + scales, 128), 0);
}

}  // namespace
}  // namespace wb::daemon::node
