#include "client/ctl_client.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/grpc_retry.h"
#include "proto/grpc_status.h"
#include "proto/weightbridge.grpc.pb.h"
#include "base/status_macros.h"

namespace wb::client {

namespace pb = ::weightbridge::v1;

absl::StatusOr<CtlAddress> ParseCtlAddress(const std::string& addr) {
  if (addr.empty()) return absl::InvalidArgumentError("--addr is required (host:port or unix:PATH)");
  if (absl::StartsWith(addr, "unix:")) {
    if (addr.size() <= 5) return absl::InvalidArgumentError("--addr unix: needs a path");
    return CtlAddress{addr, true};
  }
  if (addr[0] == '/') return CtlAddress{absl::StrCat("unix:", addr), true};
  // gRPC target URIs with a resolver scheme go to gRPC as they are.
  for (const char* scheme : {"dns:", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(addr, scheme) && addr.size() > strlen(scheme)) return CtlAddress{addr, false};
  }
  size_t colon = addr.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(addr.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--addr '", addr, "' is neither host:port nor unix:PATH"));
  }
  // The host: a name or IPv4 address, or an IPv6 literal in brackets ([::1]:PORT). Anything else
  // ('[::1' taken as host '[:' and port 1) would only fail in gRPC's resolver after the whole
  // connect timeout.
  const std::string host = addr.substr(0, colon);
  const bool bracketed = host.size() > 2 && host.front() == '[' && host.back() == ']';
  const std::string_view inner = bracketed ? std::string_view(host).substr(1, host.size() - 2) : std::string_view(host);
  for (char ch : inner) {
    const bool ok = bracketed ? (absl::ascii_isalnum(ch) || ch == ':' || ch == '.' || ch == '%' || ch == '-' || ch == '_')
                              : (absl::ascii_isalnum(ch) || ch == '.' || ch == '-' || ch == '_');
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("--addr '", addr, "': bad host '", host,
                                                     "' (a name, an IPv4 address or an IPv6 address in brackets: [::1]:PORT)"));
    }
  }
  return CtlAddress{addr, false};
}

absl::StatusOr<std::unique_ptr<CtlClient>> CtlClient::Connect(const std::string& addr,
                                                              absl::Duration timeout,
                                                              CtlAuth auth) {
  ASSIGN_OR_RETURN(CtlAddress a, ParseCtlAddress(addr));
  auto channel = MakeCtlChannel(a.target, a.unix_socket, auth);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    // A TLS handshake the daemon refuses (or plaintext against a TLS daemon) shows up here too.
    const absl::Status s = absl::UnavailableError(absl::StrCat(
        "cannot connect to ", a.target, " within ", absl::FormatDuration(timeout)));
    return absl::UnavailableError(
        absl::StrCat(s.message(), a.unix_socket ? "" : CredentialHint(s, auth, false)));
  }
  return std::unique_ptr<CtlClient>(new CtlClient(std::move(a), std::move(channel), std::move(auth)));
}

void CtlClient::Prepare(grpc::ClientContext* ctx, absl::Time deadline, bool operator_call) const {
  ctx->set_deadline(absl::ToChronoTime(deadline));
  if (!addr_.unix_socket) AddCallCredentials(ctx, auth_, operator_call);
}

template <typename Rpc>
absl::Status CtlClient::Unary(absl::Time deadline, bool operator_call, Rpc&& rpc) const {
  return CallWhileServerBusy(Clock::Real(), deadline, [&] {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline, operator_call);
    return FromGrpcStatus(rpc(&ctx));
  });
}

absl::Status CtlClient::Hinted(const absl::Status& s, bool operator_call) const {
  if (s.ok() || addr_.unix_socket) return s;
  const std::string hint = CredentialHint(s, auth_, operator_call);
  return hint.empty() ? s : absl::Status(s.code(), absl::StrCat(s.message(), hint));
}

absl::StatusOr<pb::StatusResponse> CtlClient::FetchStatus(absl::Duration timeout,
                                                          std::string* source,
                                                          const pb::StatusRequest& filter) {
  const absl::Time deadline = absl::Now() + timeout;
  pb::StatusResponse resp;
  if (addr_.unix_socket) {
    RETURN_IF_ERROR(Unary(deadline, false, [&](grpc::ClientContext* ctx) {
      return pb::WorkerService::NewStub(channel_)->Status(ctx, filter, &resp);
    }));
    if (source) *source = "worker socket";
    return resp;
  }
  {
    absl::Status s = Unary(deadline, false, [&](grpc::ClientContext* ctx) {
      return pb::CoordinatorService::NewStub(channel_)->ClusterStatus(ctx, filter, &resp);
    });
    if (s.ok()) {
      if (source) *source = "coordinator";
      return resp;
    }
    if (s.code() != absl::StatusCode::kUnimplemented) return Hinted(s);
  }
  resp.Clear();
  RETURN_IF_ERROR(Hinted(Unary(deadline, false, [&](grpc::ClientContext* ctx) {
    return pb::NodeService::NewStub(channel_)->Status(ctx, filter, &resp);
  })));
  if (source) *source = "node";
  return resp;
}

absl::Status CtlClient::WatchOnce(absl::Time deadline, bool wait_for_ready,
                                  const StatusFn& on_status, bool* stopped,
                                  const pb::StatusRequest& filter) {
  *stopped = false;
  if (addr_.unix_socket) {
    return absl::UnimplementedError(
        "status push needs the coordinator's TCP address, not a worker socket (use FetchStatus)");
  }
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return absl::OkStatus();
  pb::WatchStatusRequest req;
  *req.mutable_request() = filter;
  req.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(left)));
  grpc::ClientContext ctx;
  // The coordinator ends the stream (OK) at timeout_ms; the RPC deadline is a little later so
  // that its OK normally ends it (a DEADLINE_EXCEEDED at or after `deadline` counts as OK too).
  Prepare(&ctx, deadline + absl::Milliseconds(200));
  ctx.set_wait_for_ready(wait_for_ready);
  auto stub = pb::CoordinatorService::NewStub(channel_);
  std::unique_ptr<grpc::ClientReader<pb::StatusResponse>> reader = stub->WatchStatus(&ctx, req);
  pb::StatusResponse msg;
  while (reader->Read(&msg)) {
    if (!on_status(msg)) {
      *stopped = true;
      ctx.TryCancel();
      (void)reader->Finish();  // CANCELLED: ours
      return absl::OkStatus();
    }
  }
  absl::Status s = FromGrpcStatus(reader->Finish());
  if (absl::IsDeadlineExceeded(s) && absl::Now() >= deadline) return absl::OkStatus();
  return Hinted(s);
}

absl::Status CtlClient::WatchStatus(absl::Time deadline, const StatusFn& on_status, const pb::StatusRequest& filter) {
  while (true) {
    bool stopped = false;
    // A stream the coordinator had no thread for is opened again (proto/grpc_retry.h).
    RETURN_IF_ERROR(CallWhileServerBusy(Clock::Real(), deadline, [&] {
      return WatchOnce(deadline, /*wait_for_ready=*/false, on_status, &stopped, filter);
    }));
    if (stopped || absl::Now() >= deadline) return absl::OkStatus();
    // Ended OK before our deadline: the coordinator's cap on one stream. Open the next one.
  }
}

absl::StatusOr<pb::StatusResponse> CtlClient::WaitForStatus(const StatusFn& pred,
                                                            absl::Time deadline,
                                                            pb::StatusResponse* last) {
  std::optional<pb::StatusResponse> match;
  absl::Status last_error;
  absl::Duration backoff = kServerBusyFirstBackoff;
  while (absl::Now() < deadline) {
    bool stopped = false;
    absl::Status s = WatchOnce(deadline, /*wait_for_ready=*/true,
                               [&](const pb::StatusResponse& status) {
                                 if (last) *last = status;
                                 if (!pred(status)) return true;
                                 match = status;
                                 return false;
                               },
                               &stopped);
    if (match.has_value()) return *std::move(match);
    if (s.ok()) continue;  // the stream ended at the coordinator's cap (or our deadline)
    if (IsServerThreadpoolExhausted(s)) {
      // The coordinator had no thread for the stream (proto/grpc_retry.h): open it again.
      last_error = s;
      Clock::Real()->SleepUntil(std::min(deadline, absl::Now() + backoff));
      backoff = std::min(backoff * 2, kServerBusyMaxBackoff);
      continue;
    }
    if (!absl::IsUnavailable(s)) return s;
    last_error = s;
    // A coordinator shutting down answers UNAVAILABLE over a connection that is still up: wait
    // for that connection to go (bounded) before re-opening, rather than spinning on it;
    // wait_for_ready then holds the next call until a coordinator accepts it again.
    if (channel_->GetState(false) == GRPC_CHANNEL_READY) {
      channel_->WaitForStateChange(GRPC_CHANNEL_READY,
                                   absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(1))));
    }
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "status condition not reached before the deadline",
      last_error.ok() ? "" : absl::StrCat(" (last stream error: ", last_error.ToString(), ")")));
}

absl::StatusOr<pb::DrainResponse> CtlClient::Drain(const std::string& node_id,
                                                   absl::Duration timeout, bool undo) {
  if (addr_.unix_socket) {
    return absl::InvalidArgumentError(
        "drain needs the coordinator's or a node daemon's TCP address, not a worker socket");
  }
  pb::DrainRequest req;
  req.set_node_id(node_id);
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  req.set_undo(undo);
  // The coordinator drains the whole cluster only when asked explicitly.
  req.set_all(node_id.empty());
  // The daemon waits up to timeout_ms and then answers drained=false: give the RPC a little more.
  const absl::Time deadline = absl::Now() + timeout + absl::Seconds(5);
  pb::DrainResponse resp;
  {
    absl::Status s = Unary(deadline, /*operator_call=*/true, [&](grpc::ClientContext* ctx) {
      return pb::CoordinatorService::NewStub(channel_)->Drain(ctx, req, &resp);
    });
    if (s.ok()) return resp;
    if (s.code() != absl::StatusCode::kUnimplemented) return Hinted(s, /*operator_call=*/true);
  }
  resp.Clear();
  req.set_all(false);  // a node daemon drains itself (node_id empty = this node)
  RETURN_IF_ERROR(Hinted(Unary(deadline, /*operator_call=*/true, [&](grpc::ClientContext* ctx) {
                           return pb::NodeService::NewStub(channel_)->Drain(ctx, req, &resp);
                         }),
                         /*operator_call=*/true));
  return resp;
}

}  // namespace wb::client
