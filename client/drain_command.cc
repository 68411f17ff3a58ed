#include "client/drain_command.h"

#include "client/ctl_args.h"
#include "client/ctl_client.h"
#include "nlohmann/json.hpp"

namespace wb::client {

int RunDrainCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  const char* usage =
      "usage: wbctl drain --addr ADDR [--node ID | --all] [--undo] [--timeout 60s] [--json]\n"
      "  without --node: the whole cluster (coordinator address) or that node (node address);\n"
      "  --undo lifts the drain again (new versions accepted)\n";
  const std::string usage_all = std::string(usage) + kCtlAuthUsage;
  auto parsed = CtlArgs::Parse(args, WithAuthFlags({{"addr", "node", "timeout"}, {"json", "all", "undo"}}));
  if (!parsed.ok()) {
    err << "wbctl drain: " << parsed.status().message() << "\n" << usage_all;
    return kCtlUsage;
  }
  auto timeout = parsed->GetDuration("timeout", absl::Seconds(60));
  auto addr = ParseCtlAddress(parsed->Get("addr"));
  if (!timeout.ok() || !addr.ok()) {
    err << "wbctl drain: " << (!timeout.ok() ? timeout.status() : addr.status()).message() << "\n"
        << usage_all;
    return kCtlUsage;
  }
  if (addr->unix_socket) {
    err << "wbctl drain: needs the coordinator's or a node daemon's host:port, not a worker socket\n";
    return kCtlUsage;
  }
  const std::string node = parsed->Get("node");
  if (!node.empty() && parsed->Has("all")) {
    err << "wbctl drain: --node and --all are exclusive\n" << usage;
    return kCtlUsage;
  }
  auto auth = LoadCtlAuth(*parsed);
  if (!auth.ok()) {
    err << "wbctl drain: " << auth.status().message() << "\n";
    return kCtlUsage;
  }
  auto client = CtlClient::Connect(parsed->Get("addr"), std::min(*timeout, absl::Seconds(10)), *std::move(auth));
  if (!client.ok()) {
    err << "wbctl drain: " << client.status() << "\n";
    return kCtlRpcFailed;
  }
  const bool undo = parsed->Has("undo");
  auto resp = (*client)->Drain(node, *timeout, undo);
  if (!resp.ok()) {
    err << "wbctl drain: " << resp.status() << "\n";
    return kCtlRpcFailed;
  }
  const std::string what = node.empty() ? std::string("cluster") : "node " + node;
  if (undo) {
    if (parsed->Has("json")) {
      out << nlohmann::json{{"target", what}, {"undrained", true}}.dump() << "\n";
    } else {
      out << what << " undrained: new versions are accepted again\n";
    }
    return kCtlOk;
  }
  if (parsed->Has("json")) {
    out << nlohmann::json{{"target", what},
                          {"drained", resp->drained()},
                          {"in_flight_versions", resp->in_flight_versions()}}
               .dump()
        << "\n";
  } else if (resp->drained()) {
    out << what << " drained\n";
  } else {
    out << what << " NOT drained after " << absl::FormatDuration(*timeout) << ": "
        << resp->in_flight_versions() << " version(s) still in flight (new versions are refused)\n";
  }
  return resp->drained() ? kCtlOk : kCtlDrainTimeout;
}

}  // namespace wb::client
