// bench/quantize_outgoing: the sending node's quantiser (daemon/node/quantize_outgoing.h) on the
// trainer shards of bench/testdata/qwen2-wide-8l.json (Megatron tp=2: q/k/v/gate/up split by rows,
// o/down by columns; every shard whole 128x128 blocks, as bench:e2e --quantization=fp8_block128
// sends them), against QuantizePiece over the same bytes already gathered into shadows (what
// bench:quantize measures), in the same run. Best of --rounds; q staging allocated once and
// reused (as the node's staging pool does), so page faults are not measured.
//
//   bazel run -c opt //bench:quantize_outgoing [-- --threads=2 --rounds=5]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/parallel_for.h"
#include "daemon/node/quantize_outgoing.h"
#include "daemon/quantize.h"
#include "planner/box.h"
#include "planner/quantized.h"

ABSL_FLAG(int, threads, 0, "quantising threads (0: every core, at most 16)");
ABSL_FLAG(int, rounds, 5, "rounds (best reported)");

namespace wb::daemon::node {
namespace {

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int Run() {
  const int threads = absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : static_cast<int>(HardwareThreads(16));
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  constexpr int64_t kHidden = 2048, kKv = 512, kInter = 5632, kLayers = 8;
  planner::Inventory inv;
  struct Shard {
    int32_t tensor;
    planner::Box box;
  };
  std::vector<Shard> shards;  // both trainers' shards
  auto add = [&](const std::string& name, int64_t rows, int64_t cols, bool split_rows) {
    inv.tensors.push_back({name, {rows, cols}, planner::DType::kBF16});
    const int32_t t = static_cast<int32_t>(inv.tensors.size() - 1);
    for (int64_t r = 0; r < 2; ++r) {
      shards.push_back({t, split_rows ? planner::Box{{r * rows / 2, 0}, {(r + 1) * rows / 2, cols}}
                                      : planner::Box{{0, r * cols / 2}, {rows, (r + 1) * cols / 2}}});
    }
  };
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "self_attn.q_proj.weight", kHidden, kHidden, true);
    add(p + "self_attn.k_proj.weight", kKv, kHidden, true);
    add(p + "self_attn.v_proj.weight", kKv, kHidden, true);
    add(p + "self_attn.o_proj.weight", kHidden, kHidden, false);
    add(p + "mlp.gate_proj.weight", kInter, kHidden, true);
    add(p + "mlp.up_proj.weight", kInter, kHidden, true);
    add(p + "mlp.down_proj.weight", kHidden, kInter, false);
  }
  // One source buffer per shard (the trainer's contiguous piece), one q region for all.
  std::vector<std::vector<uint8_t>> sources;
  std::map<std::string, RegionMemory> memory;
  QuantRegion region;
  int64_t canonical = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const Shard& s = shards[i];
    std::vector<int64_t> ext = {s.box.end[0] - s.box.begin[0], s.box.end[1] - s.box.begin[1]};
    const int64_t n = ext[0] * ext[1];
    std::vector<uint8_t> bytes(static_cast<size_t>(n * 2));
    for (int64_t k = 0; k < n; ++k) {
      const uint16_t h = FloatToBF16(static_cast<float>((k * 2654435761u) % 2001) * 1e-5f - 0.01f);
      std::memcpy(&bytes[static_cast<size_t>(2 * k)], &h, 2);
    }
    const std::string key = absl::StrCat("w", i, ".b0");
    memory[key] = RegionMemory{transport::MemoryKind::kHost, bytes.data(), static_cast<int64_t>(bytes.size()), -1, {}};
    sources.push_back(std::move(bytes));
    QuantJob j;
    j.op_index = static_cast<uint32_t>(i);
    j.src_key = key;
    j.src.tensor = s.tensor;
    j.src.box = s.box;
    j.src.strides = planner::ContiguousStrides(ext);
    j.box = s.box;
    j.quant = planner::Quantization{planner::DType::kF8E4M3, {128, 128}, 0, 0, planner::DType::kF32};
    j.elements_offset = region.size;
    j.elements_bytes = n;
    j.scales_offset = AlignUp(region.size + n, 16);
    j.scales_bytes = (ext[0] / 128) * (ext[1] / 128) * 4;
    region.size = AlignUp(j.scales_offset + j.scales_bytes, 64);
    region.jobs.push_back(j);
    canonical += n * 2;
  }
  std::map<std::string, QuantRegion> regions = {{"q.n1", region}};
  std::vector<uint8_t> q(static_cast<size_t>(region.size));
  OutgoingOptions o;
  o.max_threads = threads;
  o.allocate = [&](int64_t, const std::string&) -> absl::StatusOr<QStaging> { return QStaging{q.data(), nullptr}; };
  double best_sender = 1e30, best_ref = 1e30;
  int64_t chunks = 0;
  for (int r = 0; r < rounds; ++r) {
    const absl::Time t0 = absl::Now();
    auto run = OutgoingQuantization::Start(inv, regions, {}, memory, "bench", absl::InfiniteFuture(), o);
    if (!run.ok() || !(*run)->WaitAll().ok()) {
      std::fprintf(stderr, "bench/quantize_outgoing: %s\n", run.ok() ? "quantising failed" : run.status().ToString().c_str());
      return 1;
    }
    best_sender = std::min(best_sender, absl::ToDoubleSeconds(absl::Now() - t0));
    chunks = (*run)->stats().chunks;
    // Reference: QuantizePiece per shard over its (already contiguous) bytes, one shard per call.
    std::vector<uint8_t> ref(q.size());
    const absl::Time t1 = absl::Now();
    ParallelFor(region.jobs.size(), static_cast<size_t>(threads), [&](size_t i) {
      const QuantJob& j = region.jobs[i];
      planner::Piece piece;
      piece.tensor = j.src.tensor;
      piece.box = j.box;
      piece.strides = j.src.strides;
      piece.quant = j.quant;
      (void)QuantizePiece(inv, piece, sources[i].data(), ref.data() + j.elements_offset, ref.data() + j.scales_offset);
    });
    best_ref = std::min(best_ref, absl::ToDoubleSeconds(absl::Now() - t1));
    for (const QuantJob& j : region.jobs) {
      if (std::memcmp(q.data() + j.elements_offset, ref.data() + j.elements_offset, static_cast<size_t>(j.elements_bytes)) != 0 ||
          std::memcmp(q.data() + j.scales_offset, ref.data() + j.scales_offset, static_cast<size_t>(j.scales_bytes)) != 0) {
        std::fprintf(stderr, "bench/quantize_outgoing: op %u differs from QuantizePiece\n", j.op_index);
        return 1;
      }
    }
  }
  std::printf("qwen2-wide-8l Megatron tp=2 shards, fp8_block128: %zu ops, %.3f GB bf16 -> %.3f GB, %d thread(s), best of %d\n",
              region.jobs.size(), canonical / 1e9, region.size / 1e9, threads, rounds);
  std::printf("  OutgoingQuantization (%lld chunks)   %.3f s  %.2f GB/s\n", static_cast<long long>(chunks), best_sender, canonical / 1e9 / best_sender);
  std::printf("  QuantizePiece per op (reference)    %.3f s  %.2f GB/s\n", best_ref, canonical / 1e9 / best_ref);
  std::printf("  bytes identical: yes\n");
  return 0;
}

}  // namespace
}  // namespace wb::daemon::node

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return wb::daemon::node::Run();
}
