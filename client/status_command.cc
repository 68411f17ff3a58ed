#include "client/status_command.h"

#include "absl/strings/str_cat.h"
#include "client/ctl_args.h"
#include "client/ctl_client.h"
#include "client/status_view.h"

namespace wb::client {

int RunStatusCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  auto parsed = CtlArgs::Parse(args, WithAuthFlags({{"addr", "timeout", "model", "node"}, {"json"}}));
  if (!parsed.ok()) {
    err << "wbctl status: " << parsed.status().message()
        << "\nusage: wbctl status --addr ADDR [--model ID] [--node ID] [--json] [--timeout 10s]\n" << kCtlAuthUsage;
    return kCtlUsage;
  }
  // StatusRequest's filter: the daemon narrows the status before its byte budget.
  weightbridge::v1::StatusRequest filter;
  filter.set_model_id(parsed->Get("model"));
  filter.set_node_id(parsed->Get("node"));
  if ((parsed->Has("model") && filter.model_id().empty()) || (parsed->Has("node") && filter.node_id().empty())) {
    err << "wbctl status: --model and --node take a non-empty id\n";
    return kCtlUsage;
  }
  auto timeout = parsed->GetDuration("timeout", absl::Seconds(10));
  auto addr = ParseCtlAddress(parsed->Get("addr"));
  if (!timeout.ok() || !addr.ok()) {
    err << "wbctl status: " << (!timeout.ok() ? timeout.status() : addr.status()).message() << "\n";
    return kCtlUsage;
  }
  auto auth = LoadCtlAuth(*parsed);
  if (!auth.ok()) {
    err << "wbctl status: " << auth.status().message() << "\n";
    return kCtlUsage;
  }
  auto client = CtlClient::Connect(parsed->Get("addr"), *timeout, *std::move(auth));
  if (!client.ok()) {
    err << "wbctl status: " << client.status() << "\n";
    return kCtlRpcFailed;
  }
  std::string source;
  auto status = (*client)->FetchStatus(*timeout, &source, filter);
  if (!status.ok()) {
    err << "wbctl status: " << status.status() << "\n";
    // A filter naming a model or node the coordinator does not know.
    return absl::IsNotFound(status.status()) ? kCtlNotFound : kCtlRpcFailed;
  }
  if (parsed->Has("json")) {
    nlohmann::json j = StatusJson(*status, source);
    j["filter"] = {{"model_id", filter.model_id()}, {"node_id", filter.node_id()}};
    out << j.dump() << "\n";
  } else {
    out << StatusTable(*status, source, filter);
  }
  return kCtlOk;
}

int RunVersionsCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  auto parsed = CtlArgs::Parse(args, WithAuthFlags({{"addr", "timeout", "model"}, {"json"}}));
  const char* usage = "usage: wbctl versions --addr ADDR --model ID [--json] [--timeout 10s]\n";
  if (!parsed.ok()) {
    err << "wbctl versions: " << parsed.status().message() << "\n" << usage << kCtlAuthUsage;
    return kCtlUsage;
  }
  const std::string model = parsed->Get("model");
  auto timeout = parsed->GetDuration("timeout", absl::Seconds(10));
  auto addr = ParseCtlAddress(parsed->Get("addr"));
  if (model.empty() || !timeout.ok() || !addr.ok()) {
    err << "wbctl versions: "
        << (model.empty() ? std::string("--model is required")
                          : std::string((!timeout.ok() ? timeout.status() : addr.status()).message()))
        << "\n" << usage;
    return kCtlUsage;
  }
  auto auth = LoadCtlAuth(*parsed);
  if (!auth.ok()) {
    err << "wbctl versions: " << auth.status().message() << "\n";
    return kCtlUsage;
  }
  auto client = CtlClient::Connect(parsed->Get("addr"), *timeout, *std::move(auth));
  if (!client.ok()) {
    err << "wbctl versions: " << client.status() << "\n";
    return kCtlRpcFailed;
  }
  // Sent as StatusRequest.model_id: the coordinator narrows the status to the model before its byte
  // budget, so the model's records are all listed unless they alone pass the budget.
  weightbridge::v1::StatusRequest filter;
  filter.set_model_id(model);
  auto status = (*client)->FetchStatus(*timeout, nullptr, filter);
  if (!status.ok() && !absl::IsNotFound(status.status())) {
    err << "wbctl versions: " << status.status() << "\n";
    return kCtlRpcFailed;
  }
  if (!status.ok() || !HasModel(*status, model)) {
    err << "wbctl versions: no model '" << model << "' at " << parsed->Get("addr") << "\n";
    return kCtlNotFound;
  }
  auto versions = VersionsOf(*status, model);
  // Older finished records the coordinator's status byte budget left out (the list also holds a
  // record with state "trimmed" saying so).
  const uint32_t not_listed = VersionsNotListed(*status, model);
  if (parsed->Has("json")) {
    nlohmann::json j = VersionsJson(model, versions);
    j["versions_not_listed"] = not_listed;
    out << j.dump() << "\n";
  } else {
    out << VersionsTable(versions);
    if (not_listed > 0) {
      out << "TRIMMED: " << not_listed << " older finished version records of " << model
          << " not listed: the model alone is over the coordinator's status byte budget of " << status->trimmed().budget_bytes()
          << " bytes; they are in the coordinator log (\"version committed\" / \"version aborted\")\n";
    }
  }
  return kCtlOk;
}

}  // namespace wb::client
