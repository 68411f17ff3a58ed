#include "client/ctl_client.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/grpc_status.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tools/cc/status_macros.h"

namespace wb::client {

namespace pb = ::weightbridge::v1;

absl::StatusOr<CtlAddress> ParseCtlAddress(const std::string& addr) {
  if (addr.empty()) return absl::InvalidArgumentError("--addr is required (host:port or unix:PATH)");
  if (absl::StartsWith(addr, "unix:")) {
    if (addr.size() <= 5) return absl::InvalidArgumentError("--addr unix: needs a path");
    return CtlAddress{addr, true};
  }
  if (addr[0] == '/') return CtlAddress{absl::StrCat("unix:", addr), true};
  size_t colon = addr.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(addr.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--addr '", addr, "' is neither host:port nor unix:PATH"));
  }
  return CtlAddress{addr, false};
}

absl::StatusOr<std::unique_ptr<CtlClient>> CtlClient::Connect(const std::string& addr,
                                                              absl::Duration timeout) {
  ASSIGN_OR_RETURN(CtlAddress a, ParseCtlAddress(addr));
  auto channel = grpc::CreateChannel(a.target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", a.target, " within ",
                                               absl::FormatDuration(timeout)));
  }
  return std::unique_ptr<CtlClient>(new CtlClient(std::move(a), std::move(channel)));
}

absl::StatusOr<pb::StatusResponse> CtlClient::FetchStatus(absl::Duration timeout,
                                                          std::string* source) {
  const absl::Time deadline = absl::Now() + timeout;
  pb::StatusResponse resp;
  if (addr_.unix_socket) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    RETURN_IF_ERROR(FromGrpcStatus(
        pb::WorkerService::NewStub(channel_)->Status(&ctx, pb::StatusRequest(), &resp)));
    if (source) *source = "worker socket";
    return resp;
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    absl::Status s = FromGrpcStatus(
        pb::CoordinatorService::NewStub(channel_)->ClusterStatus(&ctx, pb::StatusRequest(), &resp));
    if (s.ok()) {
      if (source) *source = "coordinator";
      return resp;
    }
    if (s.code() != absl::StatusCode::kUnimplemented) return s;
  }
  resp.Clear();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  RETURN_IF_ERROR(
      FromGrpcStatus(pb::NodeService::NewStub(channel_)->Status(&ctx, pb::StatusRequest(), &resp)));
  if (source) *source = "node";
  return resp;
}

absl::StatusOr<pb::DrainResponse> CtlClient::Drain(const std::string& node_id,
                                                   absl::Duration timeout) {
  if (addr_.unix_socket) {
    return absl::InvalidArgumentError(
        "drain needs the coordinator's or a node daemon's TCP address, not a worker socket");
  }
  pb::DrainRequest req;
  req.set_node_id(node_id);
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  // The daemon waits up to timeout_ms and then answers drained=false: give the RPC a little more.
  const absl::Time deadline = absl::Now() + timeout + absl::Seconds(5);
  pb::DrainResponse resp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    absl::Status s =
        FromGrpcStatus(pb::CoordinatorService::NewStub(channel_)->Drain(&ctx, req, &resp));
    if (s.ok()) return resp;
    if (s.code() != absl::StatusCode::kUnimplemented) return s;
  }
  resp.Clear();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(pb::NodeService::NewStub(channel_)->Drain(&ctx, req, &resp)));
  return resp;
}

}  // namespace wb::client
