#include "client/status_command.h"

#include "absl/strings/str_cat.h"
#include "client/ctl_args.h"
#include "client/ctl_client.h"
#include "client/status_view.h"

namespace wb::client {

int RunStatusCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  auto parsed = CtlArgs::Parse(args, WithAuthFlags({{"addr", "timeout"}, {"json"}}));
  if (!parsed.ok()) {
    err << "wbctl status: " << parsed.status().message()
        << "\nusage: wbctl status --addr ADDR [--json] [--timeout 10s]\n" << kCtlAuthUsage;
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
  auto status = (*client)->FetchStatus(*timeout, &source);
  if (!status.ok()) {
    err << "wbctl status: " << status.status() << "\n";
    return kCtlRpcFailed;
  }
  if (parsed->Has("json")) {
    out << StatusJson(*status, source).dump() << "\n";
  } else {
    out << StatusTable(*status, source);
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
  auto status = (*client)->FetchStatus(*timeout);
  if (!status.ok()) {
    err << "wbctl versions: " << status.status() << "\n";
    return kCtlRpcFailed;
  }
  if (!HasModel(*status, model)) {
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
          << " not listed (the coordinator's status byte budget of " << status->trimmed().budget_bytes()
          << " bytes); they are in the coordinator log (\"version committed\" / \"version aborted\")\n";
    }
  }
  return kCtlOk;
}

}  // namespace wb::client
