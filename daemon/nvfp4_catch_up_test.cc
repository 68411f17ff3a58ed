// NVFP4 global scales with real daemons (docs/daemon.md "Quantized targets"): one NVFP4 engine
// whose two ranks live on two nodes (r0 on n0: rows 0-255 of w, r1 on n1: rows 256-511), next to a
// bf16 rollout rb (n0) holding the whole model. ModelOpt's weight_scale_2 is the whole tensor's:
// the nodes exchange their parts' magnitudes through the coordinator (ExchangeMagnitudes), so both
// ranks hold the same scale, from the whole tensor. When r1 restarts, its catch-up (from rb) reaches
// only r1's half: the coordinator answers from the committed version's book, so the restarted rank
// gets the scale r0 holds, not its half's. The trainers' weights are made so that the halves'
// magnitudes differ (rows 256-511 stay below 1, rows 0-255 reach ~2): a scale from one half alone
// would show in every byte.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstring>

#include "daemon/multinode_fixture.h"
#include "daemon/quantize.h"
#include "gtest/gtest.h"
#include "tests/common/weight_gen.h"

namespace wb::daemon {
namespace {

constexpr int64_t kRows = 512, kCols = 256, kNorm = 256, kHalf = 256;

planner::Inventory Inv() {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {kRows, kCols}, planner::DType::kBF16});
  inv.tensors.push_back({"n", {1, kNorm}, planner::DType::kBF16});
  return inv;
}

// Where an NVFP4 rank's buffer holds what: w's rows [row0, row0 + 256) as e2m1 pairs from 0, their
// e4m3 block scales after them, the global scale (4-aligned) after those, n (bf16) at a multiple of 64.
struct Geometry {
  int64_t scales_at = kHalf * kCols / 2;
  int64_t global_at = scales_at + kHalf * kCols / 16;
  int64_t norm_at = (global_at + 4 + 63) / 64 * 64;
  int64_t bytes = norm_at + kNorm * 2;
};

planner::WorkerLayout Nvfp4Rank(int64_t row0) {
  const Geometry g;
  planner::WorkerLayout l;
  l.buffers.push_back({g.bytes});
  planner::Piece w;
  w.tensor = 0;
  w.box = {{row0, 0}, {row0 + kHalf, kCols}};
  w.offset_bytes = 0;
  w.strides = {kCols, 1};
  planner::Quantization q;
  q.dtype = planner::DType::kF4E2M1;
  q.block = {1, 16};
  q.scale_buffer = 0;
  q.scale_offset_bytes = g.scales_at;
  q.scale_dtype = planner::DType::kF8E4M3;
  q.global_scale_offset_bytes = g.global_at;
  w.quant = q;
  l.pieces.push_back(w);
  planner::Piece n;
  n.tensor = 1;
  n.box = {{0, 0}, {1, kNorm}};
  n.offset_bytes = g.norm_at;
  n.strides = {kNorm, 1};
  l.pieces.push_back(n);
  return l;
}

// Rows 256-511 below 1 in magnitude: a bf16 element with exponent 127 (|x| in [1, 2)) gets 126.
void Shrink(uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  if (((b >> 7) & 0xFF) == 127) b = static_cast<uint16_t>((b & ~(0xFF << 7)) | (126 << 7));
  std::memcpy(p, &b, 2);
}

// w of version v as the trainers publish it (canonical bf16, row-major).
std::vector<uint8_t> CanonicalW(uint64_t v) {
  std::vector<uint8_t> w(static_cast<size_t>(kRows * kCols * 2));
  for (int64_t i = 0; i < kRows * kCols; ++i) {
    WriteWeight(0, v, static_cast<uint64_t>(i), 2, w.data() + 2 * i);
    if (i >= kHalf * kCols) Shrink(w.data() + 2 * i);
  }
  return w;
}

// What NVFP4 rank `row0` holds once version v is applied: its half quantised with the global
// scale of the WHOLE tensor.
std::vector<uint8_t> ExpectedRank(const planner::Inventory& inv, const planner::WorkerLayout& l, uint64_t v, float* global_out) {
  const Geometry g;
  const std::vector<uint8_t> w = CanonicalW(v);
  planner::Piece whole;
  whole.tensor = 0;
  whole.box = {{0, 0}, {kRows, kCols}};
  whole.strides = {kCols, 1};
  whole.quant = l.pieces[0].quant;
  const float global = NvFp4GlobalScale(ShadowAbsMax(inv, whole, w.data()));
  std::vector<uint8_t> out(static_cast<size_t>(g.bytes), 0);
  const uint8_t* shadow = w.data() + l.pieces[0].box.begin[0] * kCols * 2;
  EXPECT_TRUE(QuantizePiece(inv, l.pieces[0], shadow, out.data(), out.data(), global).ok());
  std::memcpy(out.data() + g.global_at, &global, 4);
  for (int64_t i = 0; i < kNorm; ++i) WriteWeight(1, v, static_cast<uint64_t>(i), 2, out.data() + g.norm_at + 2 * i);
  if (global_out != nullptr) *global_out = global;
  return out;
}

// Bytes of NVFP4 rank r (elements, scales, global scale, n) that differ from `want`.
int64_t CountBadRank(const TestWorker& r, const std::vector<uint8_t>& want) {
  const Geometry g;
  const uint8_t* got = static_cast<const uint8_t*>(r.seg.data());
  int64_t bad = 0;
  for (auto [at, n] : {std::pair<int64_t, int64_t>{0, g.global_at + 4}, {g.norm_at, kNorm * 2}}) {
    for (int64_t i = at; i < at + n; ++i) bad += got[i] != want[static_cast<size_t>(i)];
  }
  return bad;
}

float GlobalOf(const TestWorker& r) {
  float f;
  std::memcpy(&f, static_cast<const uint8_t*>(r.seg.data()) + Geometry().global_at, 4);
  return f;
}

// Version v reported to rollout r: sync, WaitVersion (the commit wrote live weights); otherwise Apply.
grpc::Status Receive(Cluster& c, TestWorker& r, pb::Mode mode, uint64_t v) {
  if (mode == pb::MODE_SYNC) {
    pb::WaitVersionResponse resp;
    grpc::Status s = WaitVersionAs(r, "m", v, 20000, &resp);
    if (s.ok() && resp.committed_version() < v) return grpc::Status(grpc::StatusCode::INTERNAL, "reported an older version");
    return s;
  }
  pb::ApplyResponse resp;
  return c.Apply(r, "m", v, &resp);
}

class Nvfp4AcrossNodesTest : public ::testing::TestWithParam<pb::Mode> {
 protected:
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = Inv();
};

TEST_P(Nvfp4AcrossNodesTest, RanksOnTwoNodesAndARestartedRankHoldTheWholeTensorsScale) {
  const pb::Mode mode = GetParam();
  c_.StartCoordinator();
  c_.StartNode(0);
  c_.StartNode(1);
  // t1 holds rows 256-511: they stay below 1 in magnitude.
  c_.after_fill = [](TestWorker& t, uint64_t) {
    if (t.id != "t1") return;
    uint8_t* p = static_cast<uint8_t*>(t.seg.data());
    for (int64_t i = 0; i < kHalf * kCols; ++i) Shrink(p + 2 * i);
  };
  const pb::ModelSpec spec = SpecOf(inv_, mode, pb::STRATEGY_WEIGHTBRIDGE, /*trainers=*/2, /*rollouts=*/3);
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {kHalf, kCols}, false}, {1, {0, 0}, {1, kNorm}, false}}));
  TestWorker& t1 = c_.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {kHalf, 0}, {kRows, kCols}, false}}));
  TestWorker& rb = c_.AddWorker("rb", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {kRows, kCols}, false}, {1, {0, 0}, {1, kNorm}, false}}));
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, Nvfp4Rank(0));
  TestWorker& r1 = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, Nvfp4Rank(kHalf));
  for (TestWorker* w : {&t0, &t1, &rb, &r0, &r1}) ASSERT_TRUE(c_.Register(*w, spec).ok()) << w->id;

  for (uint64_t v : {1, 2}) {
    for (grpc::Status& s : c_.Publish("m", mode, v, {&t0, &t1}, {&rb, &r0, &r1})) ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
    for (TestWorker* r : {&rb, &r0, &r1}) {
      grpc::Status s = Receive(c_, *r, mode, v);
      ASSERT_TRUE(s.ok()) << r->id << " v" << v << ": " << s.error_message();
    }
    const std::vector<uint8_t> w = CanonicalW(v);
    EXPECT_EQ(std::memcmp(rb.seg.data(), w.data(), w.size()), 0) << "rb v" << v;
    float global = 0;
    EXPECT_EQ(CountBadRank(r0, ExpectedRank(inv_, r0.layout, v, &global)), 0) << "r0 v" << v;
    EXPECT_EQ(CountBadRank(r1, ExpectedRank(inv_, r1.layout, v, nullptr)), 0) << "r1 v" << v;
    EXPECT_EQ(GlobalOf(r0), global);
    EXPECT_EQ(GlobalOf(r1), global);
  }
  // The halves' own scales would differ (the test's premise).
  {
    const std::vector<uint8_t> w = CanonicalW(2);
    const float half0 = NvFp4GlobalScale(ShadowAbsMax(inv_, r0.layout.pieces[0], w.data()));
    const float half1 = NvFp4GlobalScale(ShadowAbsMax(inv_, r1.layout.pieces[0], w.data() + kHalf * kCols * 2));
    ASSERT_NE(half0, half1);
    ASSERT_EQ(GlobalOf(r1), half0);
  }

  // r1 restarts: its catch-up (from rb) reaches only its half; the scale is still the whole tensor's.
  TestWorker& r1b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, Nvfp4Rank(kHalf));
  std::memset(r1b.seg.data(), 0, static_cast<size_t>(Geometry().bytes));
  ASSERT_TRUE(c_.Register(r1b, spec).ok());
  grpc::Status s = Receive(c_, r1b, mode, 2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  float global = 0;
  EXPECT_EQ(CountBadRank(r1b, ExpectedRank(inv_, r1b.layout, 2, &global)), 0);
  EXPECT_EQ(GlobalOf(r1b), global);
  EXPECT_EQ(GlobalOf(r1b), GlobalOf(r0));

  // The next version reaches every rank again, whole.
  for (grpc::Status& st : c_.Publish("m", mode, 3, {&t0, &t1}, {&rb, &r0, &r1b})) ASSERT_TRUE(st.ok()) << st.error_message();
  for (TestWorker* r : {&rb, &r0, &r1b}) ASSERT_TRUE(Receive(c_, *r, mode, 3).ok()) << r->id;
  EXPECT_EQ(CountBadRank(r0, ExpectedRank(inv_, r0.layout, 3, nullptr)), 0);
  EXPECT_EQ(CountBadRank(r1b, ExpectedRank(inv_, r1b.layout, 3, nullptr)), 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, Nvfp4AcrossNodesTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return std::string(pb::Mode_Name(i.param)); });

}  // namespace
}  // namespace wb::daemon
