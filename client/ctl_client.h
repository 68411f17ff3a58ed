#pragma once
// Operator-side RPCs for wbctl: one daemon address (a coordinator, a node daemon or a standalone
// daemon over TCP "host:port", or a node daemon's worker socket "unix:PATH"), the right service
// picked by trying them in order. Every call has a deadline; errors keep the daemon's code.
//
//  - FetchStatus: CoordinatorService.ClusterStatus (cluster view); on UNIMPLEMENTED,
//    NodeService.Status (one node's view); over unix:, WorkerService.Status.
//  - Drain: CoordinatorService.Drain (node_id empty = whole cluster); on UNIMPLEMENTED,
//    NodeService.Drain. Not available over a worker socket (INVALID_ARGUMENT).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "proto/weightbridge.pb.h"

namespace wb::client {

// Exit codes of wbctl that scripts may rely on (documented in docs/operations.md).
inline constexpr int kCtlOk = 0;
inline constexpr int kCtlRpcFailed = 1;       // daemon unreachable or the RPC failed
inline constexpr int kCtlUsage = 2;           // bad flags / arguments
inline constexpr int kCtlDrainTimeout = 3;    // drain: not drained before --timeout
inline constexpr int kCtlVersionAborted = 4;  // watch: the watched version aborted
inline constexpr int kCtlWatchTimeout = 5;    // watch: --timeout before commit/abort
inline constexpr int kCtlNotFound = 6;        // versions/watch: unknown model or version

struct CtlAddress {
  std::string target;  // gRPC target: "host:port" or "unix:/path"
  bool unix_socket = false;
};
// Accepts "host:port", "unix:PATH" or an absolute socket path. INVALID_ARGUMENT otherwise.
absl::StatusOr<CtlAddress> ParseCtlAddress(const std::string& addr);

class CtlClient {
 public:
  static absl::StatusOr<std::unique_ptr<CtlClient>> Connect(const std::string& addr,
                                                            absl::Duration timeout);
  // The daemon's status. `source` (optional) receives "coordinator", "node" or "worker socket".
  absl::StatusOr<weightbridge::v1::StatusResponse> FetchStatus(absl::Duration timeout,
                                                               std::string* source = nullptr);
  // Drains `node_id` (empty: the cluster, or the node itself when talking to a node daemon),
  // waiting up to `timeout` for in-flight versions to finish.
  absl::StatusOr<weightbridge::v1::DrainResponse> Drain(const std::string& node_id,
                                                        absl::Duration timeout);
  const CtlAddress& address() const { return addr_; }

 private:
  CtlClient(CtlAddress addr, std::shared_ptr<grpc::Channel> channel)
      : addr_(std::move(addr)), channel_(std::move(channel)) {}
  CtlAddress addr_;
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace wb::client
