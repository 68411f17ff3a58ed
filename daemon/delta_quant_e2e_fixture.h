// Shared by the end-to-end tests of lossless deltas of sender-quantised bytes (issue 17.2 with
// 17.1; delta_quant_e2e_test: fp8_block128, delta_quant_formats_e2e_test: mxfp8 and w4a16_g32), with
// real daemons: trainers t0, t1 on n0 publish bf16 versions in which 5% of the elements change;
// rollout r1 (and r2 with two replicas) on n1 holds tensor w [512, 256] in one quantised format and
// tensor n [1, 256] unquantised. The trainers' shards are row ranges (rows 0-255 with n, rows
// 256-511), so they hold whole blocks of every format here and the coordinator plans sender-side
// quantisation: n0 quantises each box and sends its quantised elements and scales. Every rollout
// byte is compared with the receiver's own quantisation of the canonical version (daemon/quantize.h
// QuantizePiece, what the full path lands) and every version must be verified by the end-to-end
// digests.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon/delta_e2e_util.h"
#include "daemon/metrics.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"
#include "planner/types.h"

namespace wb::daemon {

// A quantised format of w, as planner/presets.cc makes it for the preset `name`.
struct QuantFormat {
  std::string name;  // the preset name: fp8_block128, mxfp8, w4a16_g32, nvfp4
  planner::DType dtype = planner::DType::kF8E4M3;
  std::vector<int64_t> block;
  planner::DType scale_dtype = planner::DType::kF32;
  bool global_scale = false;  // NVFP4's float32 second-level scale, after the block scales
};
QuantFormat Fp8Block128Format();  // float8_e4m3, 128x128 blocks, float32 scales
QuantFormat Mxfp8Format();        // float8_e4m3, 1x32 blocks, float8_e8m0 scales
QuantFormat W4a16G32Format();     // int4 (two per byte), 1x32 groups, bfloat16 scales (w's dtype)
QuantFormat Nvfp4Format();        // float4_e2m1 (two per byte), 1x16 blocks, float8_e4m3 scales, a global
                                  // scale: always quantised by the receiving node

inline constexpr double kDeltaQuantChange = 0.05;
inline constexpr int64_t kDeltaQuantRows = 512, kDeltaQuantCols = 256, kDeltaQuantNorm = 256;

// Where r1's buffer holds what: w's quantised elements (row-major; int4 packed) from 0, its scales
// (row-major over the block grid) right after them, n (bf16) at the next multiple of 64.
struct QuantGeometry {
  int64_t element_bytes = 0;  // w's quantised elements (what a delta of the elements replaces)
  int64_t scales_at = 0, scale_bytes = 0;  // scale_bytes: NVFP4's global scale included
  int64_t global_at = -1;                  // NVFP4: its global scale's offset
  int64_t norm_at = 0, rollout_bytes = 0;
};
QuantGeometry GeometryOf(const QuantFormat& f);

planner::Inventory QuantInventory();
planner::WorkerLayout QuantRolloutLayout(const QuantFormat& f);
// What r1's buffer holds once version v is applied, by the receiver's own quantiser (the full
// path's bytes): w quantised from its canonical bf16 version, n as is.
std::vector<uint8_t> ExpectedQuant(const planner::Inventory& inv, const planner::WorkerLayout& layout, const QuantGeometry& g,
                                   uint64_t v);
// Bytes of r (elements, scales, n) that differ from `expected`.
int64_t CountBadQuant(const TestWorker& r, const QuantGeometry& g, const std::vector<uint8_t>& expected);

// The cluster above: 64 KiB buckets (sender-quantised plans budget a bucket's staging at most that,
// so the fragments spread over several buckets and the delta encodes of later buckets wait for
// their bytes to be quantised), --delta_cache_bytes 64 MiB on both nodes, metrics on port 0.
class DeltaQuantFixture : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override { c_.Stop(); }

  // `replicas` 2: r2 next to r1 (n1), same layout; each block crosses once and is relayed.
  // `split_row`: t0 holds w's rows [0, split_row) and n, t1 the rest (256: whole blocks of every
  // format; 192 leaves 128x128 blocks split between the trainers, so fp8_block128 is quantised by
  // the receiving node). `node_options` adjusts both nodes' options.
  void Start(pb::Mode mode, int replicas = 1, const QuantFormat& format = Fp8Block128Format(), int64_t split_row = 256,
             std::function<void(ServerOptions&)> node_options = nullptr);
  // Version v published (and applied outside sync), every rollout byte-exact against the
  // receiver's quantisation, the version verified end to end.
  void Version(uint64_t v);
  // Version(v) for v in [first, last], stopping at the first fatal failure (callers check
  // HasFatalFailure() after it).
  void Versions(uint64_t first, uint64_t last) {
    for (uint64_t v = first; v <= last && !HasFatalFailure(); ++v) Version(v);
  }
  DeltaMeter Meter() { return ScrapeDeltaMeter(endpoint_->port()); }

  planner::Inventory inv_ = QuantInventory();
  QuantFormat format_ = Fp8Block128Format();
  QuantGeometry geo_ = GeometryOf(format_);
  planner::WorkerLayout layout_ = QuantRolloutLayout(format_);
  pb::ModelSpec spec_;
  pb::Mode mode_ = pb::MODE_SYNC;
  Cluster c_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  TestWorker *t0_ = nullptr, *t1_ = nullptr, *r1_ = nullptr;
  std::vector<TestWorker*> rollouts_;
};

}  // namespace wb::daemon
