// RL-loop stall simulation over plan specs: for every spec, the planner's cost model gives each
// strategy's transfer time (WeightBridge's plan and every baseline); bench/rl_sim_loop.cc turns it
// into trainer and rollout GPU stall per step in sync, one-step-off and async; a table is printed,
// JSON written, and bench/rl_sim_plot.py draws the PNGs. Model and assumptions: docs/rl_sim.md.
//
//   bazel run //bench:rl_sim [-- --specs_dir DIR --train_s 30 --rollout_s 60 --steps 50
//                               --staging_GBps G --out_dir DIR --no_plot]
// Defaults: specs examples/specs, outputs docs/img/ of the workspace (rl_sim.json + PNGs).


#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/spec_files.h"
#include "bench/rl_sim.h"
#include "client/plan_command.h"
#include "nlohmann/json.hpp"
#include "planner/planner.h"
#include "planner/spec.h"

namespace {

using wb::bench::JsonFiles;

using wb::bench::SimMode;
using wb::planner::Strategy;

std::string Basename(const std::string& p) {
  size_t s = p.rfind('/');
  std::string b = s == std::string::npos ? p : p.substr(s + 1);
  return b.size() > 5 ? b.substr(0, b.size() - 5) : b;
}

int64_t LayoutBytes(const wb::planner::Problem& problem, const wb::planner::Worker& w) {
  int64_t bytes = 0;
  for (const auto& piece : w.layout.pieces) {
    int64_t n = wb::planner::DTypeSize(problem.inventory.tensors[piece.tensor].dtype);
    for (size_t d = 0; d < piece.box.begin.size(); ++d) n *= piece.box.end[d] - piece.box.begin[d];
    bytes += n;
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, out_dir;
  double train_s = 30, rollout_s = 60, staging_GBps = 0;
  int steps = 50;
  bool plot = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const std::string& flag) -> const char* {
      if (a == flag && i + 1 < argc) return argv[++i];
      if (a.rfind(flag + "=", 0) == 0) return argv[i] + flag.size() + 1;
      return nullptr;
    };
    if (const char* v = value("--specs_dir")) dir = v;
    else if (const char* v = value("--out_dir")) out_dir = v;
    else if (const char* v = value("--train_s")) train_s = std::atof(v);
    else if (const char* v = value("--rollout_s")) rollout_s = std::atof(v);
    else if (const char* v = value("--staging_GBps")) staging_GBps = std::atof(v);
    else if (const char* v = value("--steps")) steps = std::atoi(v);
    else if (a == "--no_plot") plot = false;
    else {
      std::cerr << "usage: rl_sim [--specs_dir DIR] [--train_s S] [--rollout_s S] [--steps N] "
                   "[--staging_GBps G] [--out_dir DIR] [--no_plot]\n";
      return 2;
    }
  }
  if (train_s <= 0 || rollout_s <= 0 || steps < 1) {
    std::cerr << "rl_sim: --train_s and --rollout_s must be > 0, --steps >= 1\n";
    return 2;
  }
  const char* ws_env = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  const std::string ws = ws_env != nullptr ? ws_env : ".";
  if (dir.empty()) dir = wb::bench::DefaultSpecsDir();
  if (out_dir.empty()) out_dir = ws + "/docs/img";
  const std::vector<std::string> files = JsonFiles(dir);
  if (files.empty()) {
    std::cerr << "rl_sim: no *.json specs in " << dir << " (use --specs_dir DIR)\n";
    return 2;
  }

  const Strategy strategies[] = {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                                 Strategy::kP2PNoDedup};
  const SimMode modes[] = {SimMode::kSync, SimMode::kOneStepOff, SimMode::kAsync};
  nlohmann::json out = {{"train_s", train_s}, {"rollout_s", rollout_s}, {"steps", steps},
                        {"staging_GBps", staging_GBps}, {"specs", nlohmann::json::array()}};
  std::cout << absl::StrFormat("train step %.1f s, rollout %.1f s, %d steps; stall = seconds per step a GPU is "
                               "blocked by weight updates\n", train_s, rollout_s, steps);
  bool ok = true;
  for (const std::string& f : files) {
    auto spec = wb::client::LoadPlanSpecFile(f);
    if (!spec.ok()) {
      std::cout << Basename(f) << ": " << spec.status() << "\n";
      ok = false;
      continue;
    }
    auto problem = wb::planner::BuildProblem(*spec);
    if (!problem.ok()) {
      std::cout << Basename(f) << ": " << problem.status() << "\n";
      ok = false;
      continue;
    }
    int n_t = 0, n_r = 0;
    int64_t max_t = 0, max_r = 0;
    for (const auto& w : problem->workers) {
      int64_t b = LayoutBytes(*problem, w);
      if (w.role == wb::planner::Role::kTrainer) ++n_t, max_t = std::max(max_t, b);
      else ++n_r, max_r = std::max(max_r, b);
    }
    const bool colocated = problem->topology.colocated;
    const double copy_GBps = staging_GBps > 0 ? staging_GBps : problem->topology.same_gpu_GBps;
    const double snapshot_s = max_t / (copy_GBps * 1e9), apply_s = max_r / (copy_GBps * 1e9);
    nlohmann::json js = {{"spec", Basename(f)}, {"colocated", colocated}, {"trainer_gpus", n_t},
                         {"rollout_gpus", n_r}, {"bytes_per_trainer_gpu", max_t}, {"bytes_per_rollout_gpu", max_r},
                         {"snapshot_s", snapshot_s}, {"apply_s", apply_s}};
    std::map<Strategy, double> x;
    for (Strategy s : strategies) {
      auto plan = wb::planner::MakePlan(*problem, s);
      if (!plan.ok()) {
        std::cout << Basename(f) << " " << wb::planner::StrategyName(s) << ": " << plan.status() << "\n";
        ok = false;
        continue;
      }
      x[s] = plan->stats.makespan_s;
      js["transfer_s"][wb::planner::StrategyName(s)] = plan->stats.makespan_s;
      if (s == Strategy::kWeightBridge) js["lower_bound_s"] = plan->stats.lower_bound_s;
    }
    if (x.size() != 4) continue;
    std::cout << absl::StrFormat("\n== %s  (%d trainer GPUs, %d rollout GPUs%s; snapshot %.3f s, apply %.3f s at "
                                 "%.0f GB/s)\n", Basename(f), n_t, n_r, colocated ? ", colocated" : "", snapshot_s,
                                 apply_s, copy_GBps);
    std::cout << absl::StrFormat("%-13s %-16s %10s %10s %10s %10s %9s\n", "mode", "strategy", "transfer_s",
                                 "trainer_s", "rollout_s", "avg_gpu_s", "step_s");
    for (SimMode m : modes) {
      // Colocated: trainer and rollout time-share each GPU, so only sync applies.
      if (colocated && m != SimMode::kSync) continue;
      double wb_avg = 0, best_base = 1e300;
      std::string best_name;
      for (Strategy s : strategies) {
        wb::bench::SimParams p;
        p.train_s = train_s;
        p.rollout_s = rollout_s;
        p.transfer_s = x[s];
        p.blocking = s != Strategy::kWeightBridge;
        p.snapshot_s = p.blocking ? 0 : snapshot_s;
        p.apply_s = p.blocking ? 0 : apply_s;
        p.steps = steps;
        wb::bench::SimResult r = wb::bench::SimulateLoop(m, p);
        // Average over GPUs: colocated GPUs are one set, stalled once per update.
        double avg = colocated ? std::max(r.trainer_stall_s, r.rollout_stall_s)
                               : (n_t * r.trainer_stall_s + n_r * r.rollout_stall_s) / (n_t + n_r);
        if (s == Strategy::kWeightBridge) wb_avg = avg;
        else if (avg < best_base) best_base = avg, best_name = wb::planner::StrategyName(s);
        std::cout << absl::StrFormat("%-13s %-16s %10.4f %10.4f %10.4f %10.4f %9.2f\n", wb::bench::SimModeName(m),
                                     wb::planner::StrategyName(s), x[s], r.trainer_stall_s, r.rollout_stall_s, avg,
                                     r.step_s);
        js["modes"][wb::bench::SimModeName(m)][wb::planner::StrategyName(s)] = {
            {"trainer_stall_s", r.trainer_stall_s}, {"rollout_stall_s", r.rollout_stall_s},
            {"avg_gpu_stall_s", avg}, {"step_s", r.step_s}, {"versions_applied", r.versions_applied}};
      }
      const double ratio = wb_avg > 0 ? best_base / wb_avg : 0;
      js["modes"][wb::bench::SimModeName(m)]["best_baseline"] = best_name;
      js["modes"][wb::bench::SimModeName(m)]["ratio_vs_best_baseline"] = ratio;
      std::cout << absl::StrFormat("%-13s best baseline %s: %.1fx the average GPU stall of weightbridge\n",
                                   wb::bench::SimModeName(m), best_name, ratio);
    }
    out["specs"].push_back(js);
  }
  const std::string json_path = out_dir + "/rl_sim.json";
  std::ofstream jf(json_path);
  jf << out.dump(1) << "\n";
  if (!jf) {
    std::cerr << "rl_sim: cannot write " << json_path << "\n";
    return 1;
  }
  jf.close();
  std::cout << "\nwrote " << json_path << std::endl;
  if (plot) {
    const std::string cmd = "/usr/bin/python3 '" + ws + "/bench/rl_sim_plot.py' '" + json_path + "' '" + out_dir + "'";
    if (std::system(cmd.c_str()) != 0) {
      std::cerr << "rl_sim: plotting failed (needs python3-matplotlib): " << cmd << "\n";
      return 1;
    }
  }
  return ok ? 0 : 1;
}
