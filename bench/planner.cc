// Planner bench: plans every spec of a directory (default the workspace's examples/specs) and
// prints plan_ms, makespan, lower bound, their ratio, redundant bytes and every baseline's
// makespan with its ratio to ours, then checks the targets (complete, no redundant
// bytes, makespan <= 1.10x lower bound, plan_ms < 1000).
//
//   bazel run //bench:planner [-- --specs_dir DIR] [--quantization NAME] [--receiver_quantization]
//
// --quantization overrides every spec's rollout.quantization (fp8_block128, mxfp8, nvfp4, w4a16_g32,
// w4a16_experts_g32, none); plans use sender-side quantisation unless --receiver_quantization
// (client/plan_command.h).

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/spec_files.h"
#include "client/plan_command.h"

namespace {

using wb::bench::JsonFiles;

std::string Basename(const std::string& p) {
  const size_t s = p.rfind('/');
  return s == std::string::npos ? p : p.substr(s + 1);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, quantization;
  bool override_quantization = false, sender_quantization = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--specs_dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a.rfind("--specs_dir=", 0) == 0) {
      dir = a.substr(12);
    } else if (a == "--quantization" && i + 1 < argc) {
      quantization = argv[++i];
      override_quantization = true;
    } else if (a.rfind("--quantization=", 0) == 0) {
      quantization = a.substr(15);
      override_quantization = true;
    } else if (a == "--receiver_quantization") {
      sender_quantization = false;
    } else {
      std::cerr << "usage: planner [--specs_dir DIR] [--quantization NAME] [--receiver_quantization]\n";
      return 2;
    }
  }
  if (dir.empty()) dir = wb::bench::DefaultSpecsDir();
  const std::vector<std::string> files = JsonFiles(dir);
  if (files.empty()) {
    std::cerr << "no *.json specs in " << dir << " (use --specs_dir DIR)\n";
    return 2;
  }
  std::cout << absl::StrFormat("%-38s %8s %8s %10s %10s %6s %10s %5s", "spec", "plan_ms", "build_ms",
                               "makespan_s", "lower_bd_s", "ratio", "redund_B", "cmpl");
  std::cout << absl::StrFormat(" %22s %22s %22s\n", "rank0_broadcast", "owner_broadcast", "p2p_no_dedup");
  bool all_ok = true;
  for (const std::string& f : files) {
    auto spec = wb::client::LoadPlanSpecFile(f);
    if (!spec.ok()) {
      std::cout << Basename(f) << ": " << spec.status() << "\n";
      all_ok = false;
      continue;
    }
    if (override_quantization) {
      if (absl::Status st = wb::client::OverrideQuantization(quantization, *spec); !st.ok()) {
        std::cerr << st.message() << "\n";
        return 2;
      }
    }
    auto r = wb::client::ReportForSpec(*spec, sender_quantization);
    if (!r.ok()) {
      std::cout << Basename(f) << ": " << r.status() << "\n";
      all_ok = false;
      continue;
    }
    const double ratio = r->stats.lower_bound_s > 0 ? r->stats.makespan_s / r->stats.lower_bound_s : 1;
    std::cout << absl::StrFormat("%-38s %8.1f %8.1f %10.4f %10.4f %6.3f %10d %5s", Basename(f),
                                 r->stats.plan_ms, r->build_ms, r->stats.makespan_s,
                                 r->stats.lower_bound_s, ratio, r->stats.redundant_bytes,
                                 r->stats.complete ? "yes" : "NO");
    for (const auto& [name, t] : r->baselines) {
      std::cout << absl::StrFormat(" %10.4f (%7.2fx)", t, r->stats.makespan_s > 0 ? t / r->stats.makespan_s : 0);
    }
    std::cout << absl::StrFormat(
        "\n    ops %d, buckets %d, inter %.1f GB, intra %.1f GB, pieces %d, trainers sending %d/%d, busiest %s\n",
        r->stats.num_ops, r->num_buckets, r->stats.bytes_inter_node / 1e9, r->stats.bytes_intra_node / 1e9,
        r->num_pieces, r->trainers_sending, r->trainers, r->bottleneck);
    if (!r->quantization.empty()) {
      std::cout << absl::StrFormat("    %s rollouts, sender-side %s: wire %.1f GB (inter %.1f GB), sender-quantised %.1f GB",
                                   r->quantization, sender_quantization ? "on" : "off", r->stats.wire_bytes / 1e9,
                                   r->stats.wire_bytes_inter_node / 1e9, r->stats.sender_quantized_bytes / 1e9);
      if (r->receiver_quantized_makespan_s >= 0) {
        std::cout << absl::StrFormat("; receiver-side makespan %.4f s (bound %.4f s)", r->receiver_quantized_makespan_s,
                                     r->receiver_quantized_lower_bound_s);
      }
      std::cout << "\n";
    }
    // plan_ms target: the Kimi-K2 spec (the largest) under 1 s; applied to every spec.
    const bool ok = r->stats.complete && r->stats.redundant_bytes == 0 && ratio <= 1.10 &&
                    r->stats.plan_ms < 1000;
    if (!ok) std::cout << "    TARGET MISSED\n";
    all_ok &= ok;
  }
  std::cout << (all_ok ? "all targets met\n" : "some targets missed\n");
  return all_ok ? 0 : 1;
}
