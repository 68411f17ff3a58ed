// Quantiser bench: how fast a node turns a landed bf16 version into its rollouts' fp8 pieces
// (daemon/quantize.h, the step between "every byte landed" and "version transferred").
//
// For each scheme (fp8_block128: 128x128 blocks, float32 scales; mxfp8: 1x32 blocks, e8m0 scales;
// nvfp4: e2m1 pairs, 1x16 blocks, e4m3 scales and a global scale, each piece its own group;
// w4a16_g32: int4 pairs, 1x32 groups, bf16 scales)
// it quantises `--pieces` row-major bf16 pieces of `--rows` x `--cols` (default 16 x 4096 x 4096 =
// 512 MiB of bf16), first on one thread, then on `--threads` threads taking pieces in turn as the
// daemon does, and prints the input GB/s next to the baseline measured in the same run: a plain
// memcpy of the same input bytes on as many threads (the memory-bandwidth limit a streaming pass
// could reach). Every run checks a sample of the output against the first run (same bytes).
//
//   bazel run -c opt //bench:quantize [-- --rows 4096 --cols 4096 --pieces 16 --threads 8 --json]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/parallel_for.h"
#include "daemon/quantize.h"
#include "planner/quantized.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Args {
  int64_t rows = 4096, cols = 4096;
  int pieces = 16;
  int threads = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  int repeats = 3;
  bool json = false;
};

// Runs fn(i) for i in [0, n) on `threads` threads taking indices in turn; returns seconds.
template <typename Fn>
double Parallel(int n, int threads, Fn fn) {
  const auto t0 = Clock::now();
  wb::ParallelFor(static_cast<size_t>(n), static_cast<size_t>(threads), [&](size_t i) { fn(static_cast<int>(i)); });
  return Seconds(t0, Clock::now());
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::cerr << s << " needs a value\n";
        std::exit(2);
      }
      return std::stoll(argv[++i]);
    };
    if (s == "--rows") a.rows = next();
    else if (s == "--cols") a.cols = next();
    else if (s == "--pieces") a.pieces = static_cast<int>(next());
    else if (s == "--threads") a.threads = static_cast<int>(next());
    else if (s == "--repeats") a.repeats = static_cast<int>(next());
    else if (s == "--json") a.json = true;
    else {
      std::cerr << "usage: quantize [--rows R] [--cols C] [--pieces N] [--threads T] [--repeats K] [--json]\n";
      return 2;
    }
  }
  if (a.rows < 128 || a.cols < 128 || a.rows % 128 || a.cols % 128 || a.pieces < 1 || a.threads < 1 || a.repeats < 1) {
    std::cerr << "rows and cols must be multiples of 128, pieces/threads/repeats >= 1\n";
    return 2;
  }
  wb::planner::Inventory inv;
  inv.tensors.push_back({"w", {a.rows, a.cols}, wb::planner::DType::kBF16});
  const int64_t n = a.rows * a.cols;
  const int64_t in_bytes = n * 2;

  // Inputs: weights of typical magnitude (normal, sigma 0.02) with a few outliers, as bf16.
  std::vector<std::vector<uint16_t>> input(static_cast<size_t>(a.pieces), std::vector<uint16_t>(static_cast<size_t>(n)));
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (auto& v : input) {
    for (int64_t i = 0; i < n; ++i) {
      float f = dist(rng) * (i % 4099 == 0 ? 30.0f : 1.0f);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      v[static_cast<size_t>(i)] = static_cast<uint16_t>(b >> 16);
    }
  }
  std::vector<std::vector<uint8_t>> copy_out(static_cast<size_t>(a.pieces), std::vector<uint8_t>(static_cast<size_t>(in_bytes)));

  // Baseline: memcpy of the same input bytes, one thread and `threads` threads.
  auto memcpy_all = [&](int threads) {
    double best = 1e30;
    for (int r = 0; r < a.repeats; ++r) {
      best = std::min(best, Parallel(a.pieces, threads, [&](int i) {
                        std::memcpy(copy_out[static_cast<size_t>(i)].data(), input[static_cast<size_t>(i)].data(), static_cast<size_t>(in_bytes));
                      }));
    }
    return static_cast<double>(in_bytes) * a.pieces / best / 1e9;
  };
  const double memcpy1 = memcpy_all(1);
  const double memcpyN = memcpy_all(a.threads);
  copy_out.clear();

  struct Scheme {
    const char* name;
    std::vector<int64_t> block;
    wb::planner::DType scale_dtype;
    wb::planner::DType dtype = wb::planner::DType::kF8E4M3;
  };
  const Scheme schemes[] = {{"fp8_block128", {128, 128}, wb::planner::DType::kF32},
                            {"mxfp8", {1, 32}, wb::planner::DType::kE8M0},
                            {"nvfp4", {1, 16}, wb::planner::DType::kF8E4M3, wb::planner::DType::kF4E2M1},
                            {"w4a16_g32", {1, 32}, wb::planner::DType::kBF16, wb::planner::DType::kI4}};
  if (!a.json) {
    std::cout << absl::StrFormat("quantise %d pieces of %d x %d bf16 (%.0f MiB), best of %d; memcpy %.2f GB/s (1 thread), %.2f GB/s (%d threads)\n",
                                 a.pieces, a.rows, a.cols, static_cast<double>(in_bytes) * a.pieces / (1 << 20), a.repeats, memcpy1,
                                 memcpyN, a.threads);
  }
  std::string json = absl::StrFormat("{\"input_bytes\": %d, \"threads\": %d, \"memcpy_GBps_1\": %.3f, \"memcpy_GBps\": %.3f",
                                     in_bytes * a.pieces, a.threads, memcpy1, memcpyN);
  bool ok = true;
  for (const Scheme& s : schemes) {
    wb::planner::Piece p;
    p.tensor = 0;
    p.box = {{0, 0}, {a.rows, a.cols}};
    p.offset_bytes = 0;
    p.strides = {a.cols, 1};
    wb::planner::Quantization q;
    q.dtype = s.dtype;
    q.block = s.block;
    q.scale_dtype = s.scale_dtype;
    q.scale_offset_bytes = n;
    p.quant = q;
    int64_t out_bytes = n + wb::planner::ScaleCount(p) * wb::planner::ScaleElementSize(q);
    if (s.dtype == wb::planner::DType::kF4E2M1) {  // each piece its own group (its global scale after the scales)
      p.quant->global_scale_offset_bytes = (out_bytes + 3) / 4 * 4;
      out_bytes = p.quant->global_scale_offset_bytes + 4;
    }
    std::vector<std::vector<uint8_t>> out(static_cast<size_t>(a.pieces), std::vector<uint8_t>(static_cast<size_t>(out_bytes)));
    std::vector<uint8_t> reference;
    auto run = [&](int threads) {
      double best = 1e30;
      for (int r = 0; r < a.repeats; ++r) {
        best = std::min(best, Parallel(a.pieces, threads, [&](int i) {
                          auto st = wb::daemon::QuantizePiece(inv, p, reinterpret_cast<const uint8_t*>(input[static_cast<size_t>(i)].data()),
                                                              out[static_cast<size_t>(i)].data(), out[static_cast<size_t>(i)].data());
                          if (!st.ok()) {
                            std::cerr << st << "\n";
                            std::exit(1);
                          }
                        }));
        if (reference.empty()) {
          reference = out[0];
        } else if (out[0] != reference) {
          std::cerr << s.name << ": output differs between runs\n";
          ok = false;
        }
      }
      return static_cast<double>(in_bytes) * a.pieces / best / 1e9;
    };
    const double q1 = run(1);
    const double qN = run(a.threads);
    if (!a.json) {
      std::cout << absl::StrFormat("  %-13s 1 thread %6.2f GB/s (%.2fx memcpy)   %d threads %6.2f GB/s (%.2fx memcpy)\n", s.name, q1,
                                   q1 / memcpy1, a.threads, qN, qN / memcpyN);
    }
    json += absl::StrFormat(", \"%s_GBps_1\": %.3f, \"%s_GBps\": %.3f", s.name, q1, s.name, qN);
  }
  json += "}";
  if (a.json) std::cout << json << "\n";
  return ok ? 0 : 1;
}
