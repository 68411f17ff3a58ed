#include "daemon/nccl_route.h"

#include <algorithm>
#include <charconv>
#include <set>

namespace wb::daemon {

std::vector<bool> RouteOverNccl(const std::vector<RouteOpFacts>& ops) {
  auto candidate = [](const RouteOpFacts& op) {
    return op.cross_node && op.src_node_nccl && op.dst_node_nccl && op.src_is_trainer && op.dst_is_rollout && op.src_cuda &&
           op.dst_cuda && !op.dst_quantized;
  };
  // Workers whose cross-node ops must all stay on the host channel: a destination with any
  // cross-node op that cannot take nccl, and every rollout that relays to another node.
  std::set<int> host_only;
  for (const RouteOpFacts& op : ops) {
    if (!op.cross_node) continue;
    if (!candidate(op)) host_only.insert(op.dst_worker);
    if (!op.src_is_trainer) host_only.insert(op.src_worker);
  }
  std::vector<bool> out;
  out.reserve(ops.size());
  for (const RouteOpFacts& op : ops) out.push_back(candidate(op) && host_only.count(op.dst_worker) == 0);
  return out;
}

std::string NcclLaneName(int device) { return "nccl/" + std::to_string(device); }

int ParseNcclLaneName(std::string_view name) {
  constexpr std::string_view kPrefix = "nccl/";
  if (name.size() <= kPrefix.size() || name.substr(0, kPrefix.size()) != kPrefix) return -1;
  std::string_view digits = name.substr(kPrefix.size());
  if (digits.size() > 1 && digits[0] == '0') return -1;  // one spelling per device
  int device = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), device);
  if (ec != std::errc() || end != digits.data() + digits.size() || device < 0) return -1;
  return device;
}

std::vector<int> NcclLaneDevices(const std::vector<std::string>& transport_names) {
  std::set<int> devices;
  for (const std::string& name : transport_names) {
    const int d = ParseNcclLaneName(name);
    if (d >= 0) devices.insert(d);
  }
  return std::vector<int>(devices.begin(), devices.end());
}

int NcclLaneFor(const std::vector<int>& lanes, int gpu) {
  if (lanes.empty()) return -1;
  if (std::binary_search(lanes.begin(), lanes.end(), gpu)) return gpu;
  const int n = static_cast<int>(lanes.size());
  return lanes[gpu < 0 ? 0 : gpu % n];
}

}  // namespace wb::daemon
