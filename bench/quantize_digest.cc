// What the receiving node's piece digests cost (docs/daemon.md "Catch-up", certification of
// receiver-quantised sources): IncomingQuantization (daemon/node/quantize_incoming.h) over one
// rollout's landed bf16 version - `--pieces` fp8_block128 pieces of `--rows` x `--cols` (default 16 x
// 2048 x 4096 = 256 MiB of bf16) - with IncomingOptions::digests off and on, alternated for
// `--rounds` rounds on `--threads` threads, all in Finish as after the last bucket. Prints the
// median seconds of each, the ratio on / off, and the bytes the digests read; every round's bytes
// are compared with the first round's, and the digests of every "on" round with each other.
//
//   bazel run -c opt //bench:quantize_digest [-- --threads=2 --rounds=5 --json]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/node/quantize_incoming.h"
#include "planner/quantized.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int64_t rows = 2048, cols = 4096;
  int pieces = 16;
  int threads = 2;
  int rounds = 5;
  bool json = false;
};

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&](const std::string& flag) -> const char* {
      if (s.rfind(flag + "=", 0) == 0) return s.c_str() + flag.size() + 1;
      return nullptr;
    };
    if (const char* v = value("--rows")) a.rows = std::stoll(v);
    else if (const char* v = value("--cols")) a.cols = std::stoll(v);
    else if (const char* v = value("--pieces")) a.pieces = std::stoi(v);
    else if (const char* v = value("--threads")) a.threads = std::stoi(v);
    else if (const char* v = value("--rounds")) a.rounds = std::stoi(v);
    else if (s == "--json") a.json = true;
    else {
      std::cerr << "bench/quantize_digest: unknown flag " << s << " (--rows= --cols= --pieces= --threads= --rounds= --json)\n";
      return 2;
    }
  }
  if (a.rows % 128 != 0 || a.cols % 128 != 0 || a.pieces < 1 || a.threads < 1 || a.rounds < 1) {
    std::cerr << "bench/quantize_digest: rows and cols must be multiples of 128; pieces, threads, rounds >= 1\n";
    return 2;
  }
  using namespace wb;
  planner::Inventory inv;
  planner::WorkerLayout live;
  const int64_t elements = a.rows * a.cols;
  const int64_t scales = (a.rows / 128) * (a.cols / 128) * 4;
  int64_t at = 0;
  for (int p = 0; p < a.pieces; ++p) {
    inv.tensors.push_back({absl::StrFormat("w%d", p), {a.rows, a.cols}, planner::DType::kBF16});
    planner::Piece piece{p, planner::Box{{0, 0}, {a.rows, a.cols}}, 0, at, {a.cols, 1}, std::nullopt};
    piece.quant = planner::Quantization{planner::DType::kF8E4M3, {128, 128}, 0, at + elements, planner::DType::kF32, -1};
    live.pieces.push_back(piece);
    at += elements + scales;
  }
  live.buffers.push_back({at});
  const planner::WorkerLayout shadow = planner::StagingLayout(inv, live);
  daemon::StagedBytes landed(1);
  landed[0].host.assign(static_cast<size_t>(shadow.buffers[0].size_bytes), 0);
  std::mt19937 rng(7);
  std::normal_distribution<float> x(0.0f, 0.02f);
  for (const planner::Piece& sp : shadow.pieces) {
    uint16_t* e = reinterpret_cast<uint16_t*>(landed[0].host.data() + sp.offset_bytes);
    for (int64_t i = 0; i < elements; ++i) e[i] = Bf16(x(rng));
  }
  std::vector<double> off, on;
  std::vector<uint8_t> first;
  std::vector<uint64_t> first_digests;
  int64_t digest_bytes = 0;
  for (int round = 0; round < 2 * a.rounds; ++round) {
    const bool digests = round % 2 == 1;
    daemon::StagedBytes staging = landed;
    daemon::node::QuantizeTarget t;
    t.worker = "r";
    t.live = &live;
    t.shadow = &shadow;
    t.staging = &staging;
    daemon::node::IncomingOptions o;
    o.max_threads = a.threads;
    o.early_threads = -1;  // everything in Finish: what the version's critical path pays
    o.digests = digests;
    auto q = daemon::node::IncomingQuantization::Start(inv, {t}, 1, absl::Now() + absl::Minutes(10), o);
    if (!q.ok()) {
      std::cerr << "bench/quantize_digest: " << q.status() << "\n";
      return 1;
    }
    const auto t0 = Clock::now();
    absl::StatusOr<daemon::node::QuantizeResult> r = (*q)->Finish();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!r.ok()) {
      std::cerr << "bench/quantize_digest: " << r.status() << "\n";
      return 1;
    }
    std::vector<uint8_t> placed(staging[0].host.begin(), staging[0].host.begin() + at);
    if (first.empty()) first = placed;
    if (placed != first) {
      std::cerr << "bench/quantize_digest: round " << round << " wrote other bytes\n";
      return 1;
    }
    if (digests) {
      std::vector<uint64_t> d;
      for (const auto& pd : r->digests) d.push_back(pd.digest);
      if (d.size() != static_cast<size_t>(a.pieces)) {
        std::cerr << "bench/quantize_digest: " << d.size() << " digests for " << a.pieces << " pieces\n";
        return 1;
      }
      if (first_digests.empty()) first_digests = d;
      if (d != first_digests) {
        std::cerr << "bench/quantize_digest: round " << round << " hashed other digests\n";
        return 1;
      }
      digest_bytes = r->digest_bytes;
      on.push_back(s);
    } else {
      off.push_back(s);
    }
  }
  const double canonical = static_cast<double>(elements) * 2 * a.pieces;
  const double m_off = Median(off), m_on = Median(on);
  if (a.json) {
    std::cout << absl::StrFormat(
        "{\"canonical_bytes\": %.0f, \"threads\": %d, \"rounds\": %d, \"off_s\": %.4f, \"on_s\": %.4f, \"ratio\": %.3f, "
        "\"digest_bytes\": %d, \"verified\": true}\n",
        canonical, a.threads, a.rounds, m_off, m_on, m_on / m_off, digest_bytes);
  } else {
    std::cout << absl::StrFormat("receiver quantiser, fp8_block128, %.0f MiB bf16, %d threads, median of %d rounds each (alternated)\n",
                                 canonical / (1 << 20), a.threads, a.rounds);
    std::cout << absl::StrFormat("  digests off  %.4f s  %.2f GB/s\n", m_off, canonical / 1e9 / m_off);
    std::cout << absl::StrFormat("  digests on   %.4f s  %.2f GB/s  (%.3fx; %.0f MiB of quantised bytes hashed)\n", m_on,
                                 canonical / 1e9 / m_on, m_on / m_off, static_cast<double>(digest_bytes) / (1 << 20));
  }
  return 0;
}
