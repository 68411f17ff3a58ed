#include "transport/cpu_affinity.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace wb::transport {
namespace {

absl::StatusOr<int> ParseCpu(absl::string_view s, absl::string_view item) {
  int cpu = -1;
  if (!absl::SimpleAtoi(s, &cpu) || cpu < 0 || s.empty() || !absl::ascii_isdigit(s.front())) {
    return absl::InvalidArgumentError(absl::StrCat("cpu list item '", item, "' is not a CPU number or range"));
  }
  if (cpu >= CPU_SETSIZE) {
    return absl::InvalidArgumentError(absl::StrCat("cpu list item '", item, "': CPU ", cpu, " >= ", CPU_SETSIZE));
  }
  return cpu;
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return absl::InvalidArgumentError("cpu list is empty");
  std::vector<int> out;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    absl::string_view item = absl::StripAsciiWhitespace(raw);
    if (item.empty()) return absl::InvalidArgumentError(absl::StrCat("cpu list '", text, "' has an empty item"));
    std::vector<absl::string_view> ends = absl::StrSplit(item, '-');
    if (ends.size() > 2) return absl::InvalidArgumentError(absl::StrCat("cpu list item '", item, "' is not a CPU number or range"));
    absl::StatusOr<int> lo = ParseCpu(absl::StripAsciiWhitespace(ends[0]), item);
    if (!lo.ok()) return lo.status();
    int hi_value = *lo;
    if (ends.size() == 2) {
      absl::StatusOr<int> hi = ParseCpu(absl::StripAsciiWhitespace(ends[1]), item);
      if (!hi.ok()) return hi.status();
      if (*hi < *lo) return absl::InvalidArgumentError(absl::StrCat("cpu list item '", item, "' is a descending range"));
      hi_value = *hi;
    }
    for (int c = *lo; c <= hi_value; ++c) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::vector<std::string> items;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    items.push_back(j == i ? absl::StrCat(cpus[i]) : absl::StrCat(cpus[i], "-", cpus[j]));
    i = j + 1;
  }
  return absl::StrJoin(items, ",");
}

absl::StatusOr<std::vector<int>> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    return absl::InternalError(absl::StrCat("sched_getaffinity: ", std::strerror(errno)));
  }
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

absl::StatusOr<std::vector<int>> NumaNodeCpus(int node, absl::string_view sysfs_node_dir) {
  if (node < 0) return absl::InvalidArgumentError(absl::StrCat("NUMA node ", node, " is negative"));
  const std::string path = absl::StrCat(sysfs_node_dir, "/node", node, "/cpulist");
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("NUMA node ", node, ": cannot read ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  absl::StatusOr<std::vector<int>> cpus = ParseCpuList(ss.str());
  if (!cpus.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("NUMA node ", node, ": ", path, ": ", cpus.status().message()));
  }
  absl::StatusOr<std::vector<int>> allowed = AllowedCpus();
  if (!allowed.ok()) return allowed.status();
  std::vector<int> both;
  std::set_intersection(cpus->begin(), cpus->end(), allowed->begin(), allowed->end(), std::back_inserter(both));
  if (both.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("NUMA node ", node, " has CPUs ", FormatCpuList(*cpus),
                                                      " but this process may only run on ", FormatCpuList(*allowed)));
  }
  return both;
}

absl::Status ValidateCpuSet(const std::vector<int>& cpus) {
  if (cpus.empty()) return absl::InvalidArgumentError("cpu set is empty");
  absl::StatusOr<std::vector<int>> allowed = AllowedCpus();
  if (!allowed.ok()) return allowed.status();
  std::vector<int> missing;
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE || !std::binary_search(allowed->begin(), allowed->end(), c)) missing.push_back(c);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("CPU(s) ", FormatCpuList(missing),
                                                   " are not available to this process (allowed: ",
                                                   FormatCpuList(*allowed), ")"));
  }
  return absl::OkStatus();
}

absl::Status PinThread(std::thread& t, const std::vector<int>& cpus) {
  if (cpus.empty()) return absl::OkStatus();
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) return absl::InvalidArgumentError(absl::StrCat("CPU ", c, " out of range"));
    CPU_SET(c, &set);
  }
  if (int e = pthread_setaffinity_np(t.native_handle(), sizeof(set), &set); e != 0) {
    return absl::InvalidArgumentError(absl::StrCat("pthread_setaffinity_np(", FormatCpuList(cpus), "): ", std::strerror(e)));
  }
  return absl::OkStatus();
}

}  // namespace wb::transport
