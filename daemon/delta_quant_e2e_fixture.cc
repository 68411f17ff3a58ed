#include "daemon/delta_quant_e2e_fixture.h"

#include "daemon/quantize.h"
#include "tests/common/weight_gen.h"

namespace wb::daemon {

QuantFormat Fp8Block128Format() { return {"fp8_block128", planner::DType::kF8E4M3, {128, 128}, planner::DType::kF32}; }
QuantFormat Mxfp8Format() { return {"mxfp8", planner::DType::kF8E4M3, {1, 32}, planner::DType::kE8M0}; }
QuantFormat W4a16G32Format() { return {"w4a16_g32", planner::DType::kI4, {1, 32}, planner::DType::kBF16}; }
QuantFormat Nvfp4Format() { return {"nvfp4", planner::DType::kF4E2M1, {1, 16}, planner::DType::kF8E4M3, true}; }

QuantGeometry GeometryOf(const QuantFormat& f) {
  QuantGeometry g;
  const int64_t elements = kDeltaQuantRows * kDeltaQuantCols;
  g.element_bytes = planner::IsPacked4(f.dtype) ? elements / 2 : elements * planner::DTypeSize(f.dtype);
  g.scales_at = g.element_bytes;
  const int64_t scales = ((kDeltaQuantRows + f.block[0] - 1) / f.block[0]) * ((kDeltaQuantCols + f.block[1] - 1) / f.block[1]);
  g.scale_bytes = scales * planner::DTypeSize(f.scale_dtype);
  if (f.global_scale) {
    g.global_at = g.scales_at + (g.scale_bytes + 3) / 4 * 4;
    g.scale_bytes = g.global_at + 4 - g.scales_at;
  }
  g.norm_at = g.scales_at + (g.scale_bytes + 63) / 64 * 64;
  g.rollout_bytes = g.norm_at + kDeltaQuantNorm * 2;
  return g;
}

planner::Inventory QuantInventory() {
  planner::Inventory inv;
  inv.tensors.push_back({"w", {kDeltaQuantRows, kDeltaQuantCols}, planner::DType::kBF16});
  inv.tensors.push_back({"n", {1, kDeltaQuantNorm}, planner::DType::kBF16});  // 2-D: LayoutOf takes rows and columns
  return inv;
}


planner::WorkerLayout QuantRolloutLayout(const QuantFormat& f) {
  const QuantGeometry g = GeometryOf(f);
  planner::WorkerLayout l;
  l.buffers.push_back({g.rollout_bytes});
  planner::Piece w;
  w.tensor = 0;
  w.box = {{0, 0}, {kDeltaQuantRows, kDeltaQuantCols}};
  w.offset_bytes = 0;
  w.strides = {kDeltaQuantCols, 1};  // int4: counted in int4 elements (planner/types.h)
  planner::Quantization q;
  q.dtype = f.dtype;
  q.block = f.block;
  q.scale_buffer = 0;
  q.scale_offset_bytes = g.scales_at;
  q.scale_dtype = f.scale_dtype;
  q.global_scale_offset_bytes = g.global_at;
  w.quant = q;
  l.pieces.push_back(w);
  planner::Piece n;
  n.tensor = 1;
  n.box = {{0, 0}, {1, kDeltaQuantNorm}};
  n.offset_bytes = g.norm_at;
  n.strides = {kDeltaQuantNorm, 1};
  l.pieces.push_back(n);
  return l;
}

std::vector<uint8_t> ExpectedQuant(const planner::Inventory& inv, const planner::WorkerLayout& layout, const QuantGeometry& g,
                                   uint64_t v) {
  std::vector<uint8_t> out(static_cast<size_t>(g.rollout_bytes), 0);
  std::vector<uint8_t> shadow(static_cast<size_t>(kDeltaQuantRows * kDeltaQuantCols * 2));
  for (int64_t i = 0; i < kDeltaQuantRows * kDeltaQuantCols; ++i) {
    WriteDeltaWeight(0, v, static_cast<uint64_t>(i), 2, kDeltaQuantChange, shadow.data() + 2 * i);
  }
  const absl::Status s = QuantizePiece(inv, layout.pieces[0], shadow.data(), out.data(), out.data());
  EXPECT_TRUE(s.ok()) << s;
  for (int64_t i = 0; i < kDeltaQuantNorm; ++i) {
    WriteDeltaWeight(1, v, static_cast<uint64_t>(i), 2, kDeltaQuantChange, out.data() + g.norm_at + 2 * i);
  }
  return out;
}

int64_t CountBadQuant(const TestWorker& r, const QuantGeometry& g, const std::vector<uint8_t>& expected) {
  const uint8_t* got = static_cast<const uint8_t*>(r.seg.data());
  int64_t bad = 0;
  for (auto [at, n] : {std::pair<int64_t, int64_t>{0, g.scales_at + g.scale_bytes}, {g.norm_at, kDeltaQuantNorm * 2}}) {
    for (int64_t i = at; i < at + n; ++i) bad += got[i] != expected[static_cast<size_t>(i)];
  }
  return bad;
}

void DeltaQuantFixture::SetUp() {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  endpoint_ = std::move(*endpoint);
}

void DeltaQuantFixture::Start(pb::Mode mode, int replicas, const QuantFormat& format, int64_t split_row,
                              std::function<void(ServerOptions&)> node_options) {
  mode_ = mode;
  format_ = format;
  geo_ = GeometryOf(format);
  layout_ = QuantRolloutLayout(format);
  c_.delta_fraction = kDeltaQuantChange;
  c_.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) { o.bucket_bytes = 65536; });
  for (int n : {0, 1}) {
    c_.StartNode(n, nullptr, nullptr, [&node_options](ServerOptions& o) {
      o.delta_cache_bytes = 64 << 20;
      if (node_options) node_options(o);
    });
  }
  spec_ = SpecOf(inv_, mode, pb::STRATEGY_WEIGHTBRIDGE, /*trainers=*/2, /*rollouts=*/replicas);
  t0_ = &c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_,
                      LayoutOf(inv_, {{0, {0, 0}, {split_row, kDeltaQuantCols}, false}, {1, {0, 0}, {1, kDeltaQuantNorm}, false}}));
  t1_ = &c_.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {split_row, 0}, {kDeltaQuantRows, kDeltaQuantCols}, false}}));
  rollouts_ = {&c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, layout_)};
  if (replicas == 2) rollouts_.push_back(&c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, layout_));
  r1_ = rollouts_[0];
  for (TestWorker* w : {t0_, t1_}) ASSERT_TRUE(c_.Register(*w, spec_).ok()) << w->id;
  for (TestWorker* w : rollouts_) ASSERT_TRUE(c_.Register(*w, spec_).ok()) << w->id;
}

void DeltaQuantFixture::Version(uint64_t v) {
  for (auto& s : c_.Publish("m", mode_, v, {t0_, t1_}, rollouts_)) ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
  const std::vector<uint8_t> expected = ExpectedQuant(inv_, layout_, geo_, v);
  for (TestWorker* r : rollouts_) {
    if (mode_ != pb::MODE_SYNC) {
      pb::ApplyResponse resp;
      grpc::Status a = c_.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(a.ok()) << r->id << " v" << v << ": " << a.error_message();
    }
    EXPECT_EQ(CountBadQuant(*r, geo_, expected), 0) << format_.name << " " << r->id << " version " << v;
  }
  const pb::VersionStatus vs = FinalVersionStatus(c_, v);
  EXPECT_TRUE(vs.verified()) << format_.name << " version " << v << ": " << vs.ShortDebugString();
}

}  // namespace wb::daemon
