#include "tests/e2e/e2e_util.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/inventory.h"
#include "planner/model_config.h"

namespace wb::e2e {

std::vector<nlohmann::json> EventsNamed(const Process* p, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (auto& e : p->Events()) {
    if (e["event"].is_string() && e["event"].get<std::string>() == event) out.push_back(e);
  }
  return out;
}

absl::Status ExpectCleanExit(const Process* p, absl::Duration timeout) {
  auto code = p->WaitExit(timeout);
  if (!code.ok()) {
    return absl::Status(code.status().code(), absl::StrCat(code.status().message(),
                                                           "\n--- log tail of ", p->name(),
                                                           " ---\n", p->LogTail(3000)));
  }
  if (*code != 0) {
    return absl::InternalError(absl::StrCat(p->name(), " exited with ", *code, "\n--- log tail ---\n",
                                            p->LogTail(3000)));
  }
  return absl::OkStatus();
}

VersionWindow UpdateWindow(const std::vector<Process*>& trainers, const std::vector<Process*>& rollouts, uint64_t version) {
  VersionWindow w;
  for (const Process* t : trainers) {
    for (auto& e : t->Events()) {
      if (e.value("version", uint64_t{0}) != version) continue;
      if (e.value("event", "") == "published") {
        w.start = std::max(w.start, e.value("t_start", -1.0));
        w.publish_stall_s = std::max(w.publish_stall_s, e.value("stall_s", 0.0));
      }
      if (e.value("event", "") == "committed") w.end = std::max(w.end, e.value("t", -1.0));
    }
  }
  for (const Process* r : rollouts) {
    for (auto& e : EventsNamed(r, "applied")) {
      if (e.value("version", uint64_t{0}) != version) continue;
      w.start = std::max(w.start, e.value("t_start", -1.0));
      w.end = std::max(w.end, e.value("t", -1.0));
      w.apply_stall_s = std::max(w.apply_stall_s, e.value("stall_s", 0.0));
    }
  }
  return w;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

namespace {
int64_t SumVerified(const Process* p, uint64_t version, const char* field) {
  int64_t sum = 0;
  for (auto& e : EventsNamed(p, "verified")) {
    if (e.value("why", "") == "applied" && e.value("version", uint64_t{0}) == version) sum += e.value(field, int64_t{0});
  }
  return sum;
}
}  // namespace

int64_t VerifiedBytes(const Process* p, uint64_t version) { return SumVerified(p, version, "bytes"); }
int64_t VerifiedElements(const Process* p, uint64_t version) { return SumVerified(p, version, "elements"); }

std::string ModelConfigPath(bool full) {
  if (full) return Runfile("tests/e2e/testdata/qwen2.5-0.5b.json");
  return Runfile(kTimeScale > 1 ? "tests/e2e/testdata/qwen2.5-0.5b-2layer-sanitizer.json"
                                : "tests/e2e/testdata/qwen2.5-0.5b-2layer.json");
}

int64_t ModelBytes(const std::string& config_path) {
  std::ifstream in(config_path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto config = planner::ParseHfConfig(ss.str());
  if (!config.ok()) return -1;
  auto inv = planner::BuildInventory(*config, planner::DType::kBF16);
  if (!inv.ok()) return -1;
  return planner::TotalElements(*inv) * 2;
}

absl::Status CheckRolloutsApplied(const std::vector<Process*>& rollouts, const std::string& mode, uint64_t last, int64_t* verified) {
  std::vector<std::string> problems;
  int64_t total = 0;
  for (const Process* p : rollouts) {
    if (!EventsNamed(p, "mismatch").empty()) problems.push_back(absl::StrCat(p->name(), ": mismatch events\n", p->LogTail()));
    uint64_t prev = 0;
    for (const nlohmann::json& e : EventsNamed(p, "applied")) {
      const uint64_t v = e.value("version", uint64_t{0});
      if (v <= prev) problems.push_back(absl::StrCat(p->name(), ": applied version ", v, " after ", prev, " (must increase)"));
      if (mode != "async" && v != prev + 1) problems.push_back(absl::StrCat(p->name(), ": skipped from ", prev, " to ", v, " in ", mode));
      prev = v;
    }
    if (prev != last) problems.push_back(absl::StrCat(p->name(), ": ended on version ", prev, ", not ", last, "\n", p->LogTail()));
    const int64_t bytes = VerifiedBytes(p, last);
    if (bytes <= 0) problems.push_back(absl::StrCat(p->name(), ": no byte of version ", last, " verified"));
    total += bytes;
  }
  if (verified != nullptr) *verified = total;
  if (problems.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrJoin(problems, "\n"));
}

}  // namespace wb::e2e
