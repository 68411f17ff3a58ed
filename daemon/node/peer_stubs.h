#pragma once
// gRPC stubs to peer nodes' NodeService (the data-plane exchange, ExchangeRegions): one per peer
// node, replaced when its address changes (a restarted peer listens elsewhere; the old channel is
// released once no call holds it). Thread-safe (own leaf lock).

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon::node {

class PeerStubs {
 public:
  // Channel to a peer (TLS + token: daemon/auth.h); null = insecure.
  using MakeChannel = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;
  explicit PeerStubs(MakeChannel make_channel) : make_channel_(std::move(make_channel)) {}

  // Peer `peer`'s ExchangeRegions at `address`, cut at `deadline` (real time: a network call).
  absl::Status ExchangeRegions(const std::string& peer, const std::string& address, const ::weightbridge::v1::ExchangeRegionsRequest& req,
                               ::weightbridge::v1::ExchangeRegionsResponse* resp, absl::Time deadline);

 private:
  std::shared_ptr<::weightbridge::v1::NodeService::Stub> Stub(const std::string& peer, const std::string& address);

  MakeChannel make_channel_;
  absl::Mutex mu_;
  struct Entry {
    std::string address;
    std::shared_ptr<::weightbridge::v1::NodeService::Stub> stub;
  };
  std::map<std::string, Entry> stubs_ ABSL_GUARDED_BY(mu_);  // peer node -> stub
};

}  // namespace wb::daemon::node
