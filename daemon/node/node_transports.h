#pragma once
// Which of the node's transports (transport/factory.h TransportSet) serves what: the same-node
// host transport, the host channel to other nodes, cuda_ipc, and the nccl lanes (one per GPU,
// used only when GPU staging is on). Read-only after construction: thread-safe.

#include <map>
#include <memory>
#include <string>

#include "daemon/device_staging.h"
#include "transport/factory.h"
#include "transport/transport.h"

namespace wb::daemon::node {

class NodeTransports {
 public:
  // `set` must outlive this; `device_staging` may be null (host staging only: no nccl lanes).
  NodeTransports(const transport::TransportSet* set, std::shared_ptr<DeviceStaging> device_staging)
      : set_(*set), device_staging_(std::move(device_staging)) {}

  const transport::TransportSet& set() const { return set_; }
  // The same-node transport reaching host memory (required by NodeDaemon::Start), or nullptr.
  transport::Transport* Local() const;
  // The cross-node host channel ("host_tcp"), or nullptr.
  transport::Transport* CrossHost() const;
  // The same-node transport that reaches CUDA memory (cuda_ipc), or nullptr.
  transport::Transport* Cuda() const;
  // The nccl lanes (device -> transport) when this node moves GPU staging across nodes (nccl built
  // and usable, GPU staging on), else empty.
  std::map<int, transport::Transport*> NcclLanes() const;
  // The cross-node transport named `name`: the host channel's kind ("host_tcp") or an nccl lane
  // ("nccl/<device>"); nullptr when there is none.
  transport::Transport* Cross(const std::string& name) const;
  // The transport of cross-node channel `chan` (node::ChannelName), or nullptr.
  transport::Transport* OfChannel(const std::string& chan) const;
  // GPU staging on (a DeviceStaging with a non-zero budget).
  bool gpu_staging() const { return device_staging_ != nullptr && device_staging_->enabled(); }

 private:
  const transport::TransportSet& set_;
  std::shared_ptr<DeviceStaging> device_staging_;
};

}  // namespace wb::daemon::node
