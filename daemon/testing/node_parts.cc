#include "daemon/testing/node_parts.h"

#include "transport/config.h"
#include "transport/host_shm/host_shm.h"

namespace wb::daemon::testing {

NodeParts::NodeParts(Options o) {
  set_.Add(transport::NewHostShmTransport(transport::TransportConfig{}));
  if (o.fake_host_tcp) {
    transport::testing::FakeOptions fo;
    fo.fabric = &fabric_;
    fo.node_id = "n0";
    fo.kind = "host_tcp";
    set_.Add(transport::testing::MakeFakeTransport(fo));
  }
  copier_ = std::make_unique<LiveCopier>("n0", set_.Pick(transport::MemoryKind::kHost, transport::MemoryKind::kHost, false));
  local_ = std::make_unique<LocalWorkers>(LocalWorkers::Options{"n0", &clock_, absl::Minutes(2), copier_.get()});
  node::NodeStaging::Options so;
  so.node_id = "n0";
  if (o.staging_budget_bytes > 0) so.budget_bytes = o.staging_budget_bytes;
  so.clock = &clock_;
  so.metrics = &metrics_;
  so.copier = copier_.get();
  staging_ = std::make_unique<node::NodeStaging>(so);
  transports_ = std::make_unique<node::NodeTransports>(&set_, nullptr);
}

NodeParts::~NodeParts() {
  versions_.reset();
  local_.reset();
}

void NodeParts::MakeVersions(node::CoordinatorAccess& coordinator) {
  node::Versions::Options vo;
  vo.node_id = "n0";
  vo.clock = &clock_;
  vo.metrics = &metrics_;
  versions_ = std::make_unique<node::Versions>(vo, *local_, channels_, *staging_, *transports_, coordinator);
}

}  // namespace wb::daemon::testing
