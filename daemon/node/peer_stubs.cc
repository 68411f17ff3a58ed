#include "daemon/node/peer_stubs.h"

#include "base/clock.h"
#include "proto/grpc_retry.h"
#include "proto/grpc_status.h"

namespace wb::daemon::node {

namespace pb = ::weightbridge::v1;

std::shared_ptr<pb::NodeService::Stub> PeerStubs::Stub(const std::string& peer, const std::string& address) {
  absl::MutexLock l(&mu_);
  Entry& e = stubs_[peer];
  if (!e.stub || e.address != address) {
    // A restarted peer listens on a new address: the old incarnation's gRPC channel is released
    // here (once no call holds it) instead of accumulating one channel per restart.
    e.address = address;
    e.stub = pb::NodeService::NewStub(make_channel_ ? make_channel_(address) : grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return e.stub;
}

absl::Status PeerStubs::ExchangeRegions(const std::string& peer, const std::string& address, const pb::ExchangeRegionsRequest& req,
                                        pb::ExchangeRegionsResponse* resp, absl::Time deadline) {
  std::shared_ptr<pb::NodeService::Stub> stub = Stub(peer, address);
  // Sent again while the peer's server had no thread for it (proto/grpc_retry.h).
  return CallWhileServerBusy(Clock::Real(), deadline, [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    return FromGrpcStatus(stub->ExchangeRegions(&ctx, req, resp));
  });
}

}  // namespace wb::daemon::node
