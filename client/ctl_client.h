#pragma once
// Operator-side RPCs for wbctl: one daemon address (a coordinator, a node daemon or a standalone
// daemon over TCP "host:port", or a node daemon's worker socket "unix:PATH"), the right service
// picked by trying them in order. Every call has a deadline; errors keep the daemon's code.
//
//  - FetchStatus: CoordinatorService.ClusterStatus (cluster view); on UNIMPLEMENTED,
//    NodeService.Status (one node's view); over unix:, WorkerService.Status.
//  - WatchStatus / WaitForStatus: CoordinatorService.WatchStatus, the coordinator's status push
//    (a standalone daemon serves it too). Node daemons and worker sockets have no push API:
//    UNIMPLEMENTED there (use FetchStatus).
//  - Drain: CoordinatorService.Drain (node_id empty = whole cluster: all = true); on UNIMPLEMENTED,
//    NodeService.Drain. Not available over a worker socket (INVALID_ARGUMENT).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/ctl_auth.h"
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
  // `auth`: TLS and tokens for a secured cluster (client/ctl_auth.h); errors a missing credential
  // probably caused name the wbctl flag to add.
  static absl::StatusOr<std::unique_ptr<CtlClient>> Connect(const std::string& addr,
                                                            absl::Duration timeout,
                                                            CtlAuth auth = {});
  // The daemon's status. `source` (optional) receives "coordinator", "node" or "worker socket".
  // `filter` (StatusRequest: model_id, node_id) is sent as it is: the coordinator narrows the
  // status to it before its byte budget (node daemons and worker sockets forward it there);
  // NOT_FOUND for a model or node it does not know. A coordinator built before the filter ignores
  // it and answers the whole status.
  absl::StatusOr<weightbridge::v1::StatusResponse> FetchStatus(
      absl::Duration timeout, std::string* source = nullptr,
      const weightbridge::v1::StatusRequest& filter = weightbridge::v1::StatusRequest());
  // Called with each status a stream delivers; return false to stop watching.
  using StatusFn = std::function<bool(const weightbridge::v1::StatusResponse&)>;
  // Status push: calls `on_status` with the current status at once, then again whenever the
  // coordinator's status changes (a change not signalled explicitly shows up within ~1 s: the
  // coordinator's safety net, docs/daemon.md "Status push"). Returns OK when `on_status` returns
  // false or `deadline` passes (a stream the coordinator ends earlier at its 10 min cap is
  // re-opened, starting again with the current status). Errors keep the daemon's code:
  // UNAVAILABLE (coordinator gone or shutting down), UNIMPLEMENTED (not a coordinator),
  // RESOURCE_EXHAUSTED (too many watchers there), NOT_FOUND (`filter` names a model or node the
  // coordinator does not know; at once). Never re-connects on errors. `filter`: as FetchStatus's.
  absl::Status WatchStatus(absl::Time deadline, const StatusFn& on_status,
                           const weightbridge::v1::StatusRequest& filter = weightbridge::v1::StatusRequest());
  // Blocks until `pred` holds for the coordinator's status and returns that status. Built on
  // WatchStatus; a stream lost to UNAVAILABLE (coordinator restarting) is re-opened, waiting for
  // the coordinator to be reachable again, until `deadline`. DEADLINE_EXCEEDED when `pred` did not
  // hold by then (naming the last stream error); `last` (optional) receives the last status seen.
  absl::StatusOr<weightbridge::v1::StatusResponse> WaitForStatus(
      const StatusFn& pred, absl::Time deadline, weightbridge::v1::StatusResponse* last = nullptr);
  // Drains `node_id` (empty: the cluster - DrainRequest.all -, or the node itself when talking to
  // a node daemon), waiting up to `timeout` for in-flight versions to finish. undo: lifts that
  // drain instead (answers at once).
  absl::StatusOr<weightbridge::v1::DrainResponse> Drain(const std::string& node_id,
                                                        absl::Duration timeout, bool undo = false);
  const CtlAddress& address() const { return addr_; }

 private:
  // One stream until `deadline`. *stopped = on_status returned false. wait_for_ready: the call
  // waits for the channel to (re)connect instead of failing fast.
  absl::Status WatchOnce(absl::Time deadline, bool wait_for_ready, const StatusFn& on_status,
                         bool* stopped,
                         const weightbridge::v1::StatusRequest& filter = weightbridge::v1::StatusRequest());
  CtlClient(CtlAddress addr, std::shared_ptr<grpc::Channel> channel, CtlAuth auth)
      : addr_(std::move(addr)), channel_(std::move(channel)), auth_(std::move(auth)) {}
  // A call context with the deadline and the credentials (operator_call: also the operator token).
  void Prepare(grpc::ClientContext* ctx, absl::Time deadline, bool operator_call = false) const;
  // One unary call: `rpc(ctx)` with a fresh prepared context per try, sent again while gRPC answers
  // that the daemon had no thread for it (proto/grpc_retry.h), until `deadline`.
  template <typename Rpc>
  absl::Status Unary(absl::Time deadline, bool operator_call, Rpc&& rpc) const;
  // `s` with CredentialHint appended to its message.
  absl::Status Hinted(const absl::Status& s, bool operator_call = false) const;
  CtlAddress addr_;
  std::shared_ptr<grpc::Channel> channel_;
  CtlAuth auth_;
};

}  // namespace wb::client
