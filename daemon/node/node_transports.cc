#include "daemon/node/node_transports.h"

#include "daemon/nccl_route.h"
#include "daemon/node/exec_plan.h"

namespace wb::daemon::node {

using transport::MemoryKind;

transport::Transport* NodeTransports::Local() const { return set_.Pick(MemoryKind::kHost, MemoryKind::kHost, false); }

transport::Transport* NodeTransports::CrossHost() const { return set_.Pick(MemoryKind::kHost, MemoryKind::kHost, true); }

transport::Transport* NodeTransports::Cuda() const { return set_.Pick(MemoryKind::kCuda, MemoryKind::kCuda, false); }

std::map<int, transport::Transport*> NodeTransports::NcclLanes() const {
  if (!gpu_staging()) return {};
  return set_.ByDevice("nccl");
}

transport::Transport* NodeTransports::Cross(const std::string& name) const {
  if (const int device = ParseNcclLaneName(name); device >= 0) {
    std::map<int, transport::Transport*> lanes = NcclLanes();
    auto it = lanes.find(device);
    return it == lanes.end() ? nullptr : it->second;
  }
  transport::Transport* t = CrossHost();
  return t != nullptr && t->capabilities().kind == name ? t : nullptr;
}

transport::Transport* NodeTransports::OfChannel(const std::string& chan) const {
  const std::string name = ChannelTransportName(chan);
  return name.empty() ? CrossHost() : Cross(name);
}

}  // namespace wb::daemon::node
