#include "client/plan_command.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "planner/cost_model.h"
#include "planner/planner.h"
#include "base/clock.h"
#include "base/status_macros.h"

namespace wb::client {
namespace {

// Specs and HF configs are small text files. A spec naming /dev/zero as its model grew wbctl by
// about 0.5 GB a second until it died (a FIFO would hang it): only regular files, and at most
// kMaxSpecFileBytes of them.
constexpr int64_t kMaxSpecFileBytes = int64_t{64} << 20;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", ec.message()));
  if (!std::filesystem::is_regular_file(st)) return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof(chunk)) || in.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(text.size()) > kMaxSpecFileBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is larger than ", kMaxSpecFileBytes, " bytes (a spec or HF config.json is far smaller)"));
    }
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return text;
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

double MsSince(absl::Time start) { return absl::ToDoubleMilliseconds(Clock::Real()->Now() - start); }

std::string Usage() {
  return "usage: wbctl plan --spec FILE [--json] [--quantization fp8_block128|mxfp8|nvfp4|w4a16_g32|w4a16_experts_g32|none]\n"
         "                  [--receiver_quantization]\n";
}

}  // namespace

absl::StatusOr<planner::PlanSpec> LoadPlanSpecFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  const std::string dir = DirOf(path);
  auto resolve = [&](std::string_view model) -> absl::StatusOr<std::string> {
    std::string p(model);
    if (p.empty() || p[0] != '/') p = absl::StrCat(dir, "/", p);
    return ReadFile(p);
  };
  auto spec = planner::ParsePlanSpec(text, resolve);
  if (!spec.ok()) return Annotate(spec.status(), path);
  return spec;
}

absl::Status OverrideQuantization(const std::string& name, planner::PlanSpec& spec) {
  const std::string q = name == "none" ? "" : name;
  if (!planner::KnownQuantization(q)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--quantization: unknown scheme '", name, "' (want fp8_block128, mxfp8, nvfp4, w4a16_g32, w4a16_experts_g32 or none)"));
  }
  spec.rollout.quantization = q;
  return absl::OkStatus();
}

absl::StatusOr<PlanReport> ReportForSpec(const planner::PlanSpec& spec, bool sender_quantization) {
  PlanReport report;
  report.quantization = spec.rollout.quantization;
  report.sender_quantization = sender_quantization;
  planner::PlanOptions options;
  options.sender_quantization = sender_quantization;
  absl::Time t0 = Clock::Real()->Now();
  ASSIGN_OR_RETURN(planner::Problem problem, planner::BuildProblem(spec));
  report.build_ms = MsSince(t0);
  report.num_workers = static_cast<int64_t>(problem.workers.size());
  for (const planner::Worker& w : problem.workers) report.num_pieces += w.layout.pieces.size();

  t0 = Clock::Real()->Now();
  ASSIGN_OR_RETURN(planner::Plan plan,
                   planner::MakePlanWithOptions(problem, planner::Strategy::kWeightBridge, options));
  report.stats = plan.stats;
  report.stats.plan_ms = MsSince(t0);
  report.num_buckets = static_cast<int64_t>(plan.buckets.size());
  report.fingerprint = plan.fingerprint;
  {
    std::vector<char> sends(problem.workers.size(), 0);
    for (const planner::Bucket& b : plan.buckets) {
      for (const planner::TransferOp& op : b.ops) sends[op.src_worker] = 1;
    }
    for (size_t w = 0; w < problem.workers.size(); ++w) {
      if (problem.workers[w].role != planner::Role::kTrainer) continue;
      ++report.trainers;
      report.trainers_sending += sends[w];
    }
  }
  {
    const planner::ClusterIndex ci = planner::IndexCluster(problem);
    planner::MakespanOf(planner::AccumulateLoads(ci, plan), ci, problem.topology, &report.bottleneck);
  }
  for (planner::Strategy s : planner::kBaselines) {
    ASSIGN_OR_RETURN(planner::Plan b, planner::MakePlanWithOptions(problem, s, options));
    report.baselines.emplace_back(planner::StrategyName(s), b.stats.makespan_s);
  }
  if (plan.stats.sender_quantized_bytes > 0) {
    ASSIGN_OR_RETURN(planner::Plan r, planner::MakePlan(problem, planner::Strategy::kWeightBridge));
    report.receiver_quantized_makespan_s = r.stats.makespan_s;
    report.receiver_quantized_lower_bound_s = r.stats.lower_bound_s;
  }
  return report;
}

std::string ReportJson(const PlanReport& r) {
  nlohmann::ordered_json j;
  j["complete"] = r.stats.complete;
  j["redundant_bytes"] = r.stats.redundant_bytes;
  j["bytes_inter_node"] = r.stats.bytes_inter_node;
  j["bytes_intra_node"] = r.stats.bytes_intra_node;
  j["num_ops"] = r.stats.num_ops;
  j["num_buckets"] = r.num_buckets;
  j["plan_ms"] = r.stats.plan_ms;
  j["lower_bound_s"] = r.stats.lower_bound_s;
  j["makespan_s"] = r.stats.makespan_s;
  nlohmann::ordered_json b = nlohmann::ordered_json::object();
  for (const auto& [name, s] : r.baselines) b[name] = s;
  j["baselines"] = b;
  j["fingerprint"] = r.fingerprint;
  j["wire_bytes"] = r.stats.wire_bytes;
  j["wire_bytes_inter_node"] = r.stats.wire_bytes_inter_node;
  j["sender_quantized_bytes"] = r.stats.sender_quantized_bytes;
  j["quantization"] = r.quantization.empty() ? "none" : r.quantization;
  j["sender_quantization"] = r.sender_quantization;
  if (r.receiver_quantized_makespan_s >= 0) {
    j["receiver_quantized"] = {{"makespan_s", r.receiver_quantized_makespan_s},
                               {"lower_bound_s", r.receiver_quantized_lower_bound_s}};
  }
  j["bottleneck"] = r.bottleneck;
  j["build_ms"] = r.build_ms;
  j["num_workers"] = r.num_workers;
  j["num_pieces"] = r.num_pieces;
  j["trainers_sending"] = r.trainers_sending;
  j["trainers"] = r.trainers;
  return j.dump(2) + "\n";
}

std::string ReportTable(const PlanReport& r) {
  std::string s;
  const double ratio = r.stats.lower_bound_s > 0 ? r.stats.makespan_s / r.stats.lower_bound_s : 1.0;
  absl::StrAppendFormat(&s, "%-18s %s\n", "complete", r.stats.complete ? "yes" : "NO");
  absl::StrAppendFormat(&s, "%-18s %d\n", "redundant_bytes", r.stats.redundant_bytes);
  absl::StrAppendFormat(&s, "%-18s %.3f GB\n", "bytes_inter_node", r.stats.bytes_inter_node / 1e9);
  absl::StrAppendFormat(&s, "%-18s %.3f GB\n", "bytes_intra_node", r.stats.bytes_intra_node / 1e9);
  absl::StrAppendFormat(&s, "%-18s %.3f GB (inter-node %.3f GB)\n", "wire_bytes", r.stats.wire_bytes / 1e9,
                        r.stats.wire_bytes_inter_node / 1e9);
  absl::StrAppendFormat(&s, "%-18s %.3f GB (quantization %s, sender-side %s)\n", "sender_quantized",
                        r.stats.sender_quantized_bytes / 1e9, r.quantization.empty() ? "none" : r.quantization,
                        r.sender_quantization ? "on" : "off");
  absl::StrAppendFormat(&s, "%-18s %d\n", "num_ops", r.stats.num_ops);
  absl::StrAppendFormat(&s, "%-18s %d\n", "num_buckets", r.num_buckets);
  absl::StrAppendFormat(&s, "%-18s %d of %d\n", "trainers_sending", r.trainers_sending, r.trainers);
  absl::StrAppendFormat(&s, "%-18s %.1f (problem build %.1f)\n", "plan_ms", r.stats.plan_ms, r.build_ms);
  absl::StrAppendFormat(&s, "%-18s %.4f\n", "lower_bound_s", r.stats.lower_bound_s);
  absl::StrAppendFormat(&s, "%-18s %.4f  (%.3fx lower bound; busiest link: %s)\n", "makespan_s",
                        r.stats.makespan_s, ratio, r.bottleneck);
  if (r.receiver_quantized_makespan_s >= 0) {
    absl::StrAppendFormat(&s, "%-18s %.4f  (lower bound %.4f; canonical bytes on the wire, as daemons run today)\n",
                          "receiver_quantized", r.receiver_quantized_makespan_s, r.receiver_quantized_lower_bound_s);
  }
  for (const auto& [name, t] : r.baselines) {
    absl::StrAppendFormat(&s, "%-18s %.4f  (%.2fx ours)\n", name, t,
                          r.stats.makespan_s > 0 ? t / r.stats.makespan_s : 0.0);
  }
  absl::StrAppendFormat(&s, "%-18s %s\n", "fingerprint", r.fingerprint);
  return s;
}

int RunPlanCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  std::string spec_path;
  bool json = false, sender_quantization = true;
  std::optional<std::string> quantization;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--receiver_quantization") {
      sender_quantization = false;
    } else if (a == "--quantization" && i + 1 < args.size()) {
      quantization = args[++i];
    } else if (a.rfind("--quantization=", 0) == 0) {
      quantization = a.substr(15);
    } else if (a == "--spec" && i + 1 < args.size()) {
      spec_path = args[++i];
    } else if (a.rfind("--spec=", 0) == 0) {
      spec_path = a.substr(7);
    } else if (a == "-h" || a == "--help") {
      out << Usage();
      return 0;
    } else {
      err << "wbctl plan: unexpected argument '" << a << "'\n" << Usage();
      return 2;
    }
  }
  if (spec_path.empty()) {
    err << "wbctl plan: --spec FILE is required\n" << Usage();
    return 2;
  }
  // Under `bazel run` the program runs in its runfiles; a relative --spec means the caller's directory.
  const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (cwd != nullptr && !spec_path.empty() && spec_path[0] != '/') spec_path = absl::StrCat(cwd, "/", spec_path);
  auto spec = LoadPlanSpecFile(spec_path);
  if (!spec.ok()) {
    err << "wbctl plan: bad spec: " << spec.status().message() << "\n";
    return 2;
  }
  if (quantization.has_value()) {
    if (absl::Status st = OverrideQuantization(*quantization, *spec); !st.ok()) {
      err << "wbctl plan: " << st.message() << "\n" << Usage();
      return 2;
    }
  }
  auto report = ReportForSpec(*spec, sender_quantization);
  if (!report.ok()) {
    const bool bad_input = report.status().code() == absl::StatusCode::kInvalidArgument ||
                           report.status().code() == absl::StatusCode::kFailedPrecondition;
    err << "wbctl plan: " << (bad_input ? "bad spec: " : "planning failed: ")
        << report.status().message() << "\n";
    return bad_input ? 2 : 1;
  }
  out << (json ? ReportJson(*report) : ReportTable(*report));
  return 0;
}

}  // namespace wb::client
