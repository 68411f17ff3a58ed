// Plans made from packed layouts are the plans made from the layouts (planner/packed_layout.h, what
// the coordinator keeps): every spec of a directory (default the workspace's examples/specs) is
// planned with each strategy (weightbridge also with sender-side quantisation when the spec's
// rollouts are quantised), and weightbridge once more with each of three rollout quantisation presets, once from its layouts and once from them packed and unpacked;
// prints both plans' fingerprints (planner/fingerprint.h: every op of every bucket) and exits 1 on
// any difference.
//
//   bazel run //bench:packed_plans [-- --specs_dir DIR]

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/spec_files.h"
#include "client/plan_command.h"
#include "planner/fingerprint.h"
#include "planner/packed_layout.h"
#include "planner/planner.h"
#include "planner/spec.h"

namespace {

// 1: a difference, 2: an error.
int Compare(const std::string& name, const wb::planner::PlanSpec& spec, bool all_strategies) {
  namespace planner = wb::planner;
  absl::StatusOr<planner::Problem> problem = planner::BuildProblem(spec);
  if (!problem.ok()) {
    std::printf("%s: %s\n", name.c_str(), problem.status().ToString().c_str());
    return 2;
  }
  planner::Problem repacked = *problem;
  size_t pieces = 0, packed_bytes = 0;
  for (planner::Worker& w : repacked.workers) {
    absl::StatusOr<planner::PackedLayout> packed = planner::PackedLayout::Pack(w.layout);
    if (!packed.ok()) {
      std::printf("%s: %s\n", name.c_str(), packed.status().ToString().c_str());
      return 2;
    }
    pieces += packed->num_pieces();
    packed_bytes += packed->heap_bytes();
    w.layout = packed->Unpack();
  }
  int rc = 0;
  struct Run {
    planner::Strategy strategy;
    bool sender_quantization;
  };
  std::vector<Run> runs = {{planner::Strategy::kWeightBridge, false}};
  if (all_strategies) {
    runs.insert(runs.end(), {{planner::Strategy::kRank0Broadcast, false}, {planner::Strategy::kOwnerBroadcast, false},
                             {planner::Strategy::kP2PNoDedup, false}});
  }
  if (!spec.rollout.quantization.empty()) runs.push_back({planner::Strategy::kWeightBridge, true});
  for (const Run& r : runs) {
    planner::PlanOptions options;
    options.sender_quantization = r.sender_quantization;
    absl::StatusOr<planner::Plan> a = planner::MakePlanWithOptions(*problem, r.strategy, options);
    absl::StatusOr<planner::Plan> b = planner::MakePlanWithOptions(repacked, r.strategy, options);
    const std::string what = absl::StrCat(name, " ", planner::StrategyName(r.strategy), r.sender_quantization ? "+sq" : "");
    if (!a.ok() || !b.ok()) {
      std::printf("%-70s error: %s / %s\n", what.c_str(), a.status().ToString().c_str(), b.status().ToString().c_str());
      rc = std::max(rc, a.status() == b.status() ? rc : 1);
      continue;
    }
    const std::string fa = planner::Fingerprint(*problem, *a), fb = planner::Fingerprint(repacked, *b);
    const bool same = fa == fb && a->fingerprint == b->fingerprint && a->stats.num_ops == b->stats.num_ops;
    std::printf("%-70s ops %9lld  %s %s  %s\n", what.c_str(), static_cast<long long>(a->stats.num_ops), fa.c_str(), fb.c_str(),
                same ? "same" : "DIFFERENT");
    if (!same) rc = 1;
  }
  std::printf("%-70s %zu pieces, packed %.1f B/piece\n", name.c_str(), pieces,
              pieces ? static_cast<double>(packed_bytes) / static_cast<double>(pieces) : 0.0);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--specs_dir=", 0) == 0) {
      dir = a.substr(12);
    } else if (a == "--specs_dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: packed_plans [--specs_dir DIR]\n");
      return 2;
    }
  }
  if (dir.empty()) dir = wb::bench::DefaultSpecsDir();
  const std::vector<std::string> files = wb::bench::JsonFiles(dir);
  if (files.empty()) {
    std::fprintf(stderr, "no *.json specs in %s\n", dir.c_str());
    return 2;
  }
  int rc = 0;
  for (const std::string& f : files) {
    absl::StatusOr<wb::planner::PlanSpec> spec = wb::client::LoadPlanSpecFile(f);
    if (!spec.ok()) {
      std::printf("%s: %s\n", f.c_str(), spec.status().ToString().c_str());
      rc = std::max(rc, 2);
      continue;
    }
    const std::string name = f.substr(f.rfind('/') + 1);
    rc = std::max(rc, Compare(name, *spec, true));
    // Each rollout quantisation preset too (sender- and receiver-quantised plans).
    for (const char* q : {"fp8_block128", "nvfp4", "w4a16_g32"}) {
      if (spec->rollout.quantization == q) continue;
      wb::planner::PlanSpec qs = *spec;
      qs.rollout.quantization = q;
      rc = std::max(rc, Compare(absl::StrCat(name, " [", q, "]"), qs, false));
    }
  }
  std::printf("%s\n", rc == 0 ? "all plans the same" : rc == 1 ? "PLANS DIFFER" : "errors");
  return rc;
}
