#include "client/watch_command.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/ctl_args.h"
#include "client/ctl_client.h"
#include "client/status_view.h"

namespace wb::client {

int RunWatchCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  const char* usage =
      "usage: wbctl watch --addr ADDR [--model ID] [--version V] [--timeout 300s] "
      "[--interval 0.5s] [--json]\n";
  auto parsed = CtlArgs::Parse(args, WithAuthFlags({{"addr", "model", "version", "timeout", "interval"}, {"json"}}));
  if (!parsed.ok()) {
    err << "wbctl watch: " << parsed.status().message() << "\n" << usage << kCtlAuthUsage;
    return kCtlUsage;
  }
  auto timeout = parsed->GetDuration("timeout", absl::Seconds(300));
  auto interval = parsed->GetDuration("interval", absl::Milliseconds(500));
  auto version = parsed->GetUint("version", 0);
  auto addr = ParseCtlAddress(parsed->Get("addr"));
  for (const absl::Status& s : {timeout.status(), interval.status(), version.status(), addr.status()}) {
    if (!s.ok()) {
      err << "wbctl watch: " << s.message() << "\n" << usage;
      return kCtlUsage;
    }
  }
  const bool json = parsed->Has("json");
  const std::string model = parsed->Get("model");
  const absl::Time deadline = absl::Now() + *timeout;
  const absl::Duration rpc_timeout = std::min(*timeout, absl::Seconds(10));

  auto auth = LoadCtlAuth(*parsed);
  if (!auth.ok()) {
    err << "wbctl watch: " << auth.status().message() << "\n";
    return kCtlUsage;
  }
  auto client = CtlClient::Connect(parsed->Get("addr"), rpc_timeout, *std::move(auth));
  if (!client.ok()) {
    err << "wbctl watch: " << client.status() << "\n";
    return kCtlRpcFailed;
  }
  WatchProgress progress;
  std::string followed_model;
  uint64_t followed = *version;
  bool waiting_reported = false;
  absl::Time last_line = absl::InfinitePast();
  // One status sample: prints what changed; returns the exit code once the watch is over.
  auto handle = [&](const weightbridge::v1::StatusResponse& status) -> std::optional<int> {
    auto v = PickWatched(status, followed_model.empty() ? model : followed_model, followed);
    if (v.has_value()) {
      // Stick to the first version found, even after it turns final.
      followed = v->version();
      followed_model = v->model_id();
      const absl::Time now = absl::Now();
      WatchProgress next = progress;
      WatchProgress::Line line = next.Update(*v, now);
      // --interval: at most one progress line per interval (pushes can come faster, e.g. per
      // node heartbeat while bytes move); the first and the final line are printed at once.
      if (!line.final && now - last_line < *interval) return std::nullopt;
      progress = next;
      last_line = now;
      if (json) {
        out << WatchProgress::ToJson(line).dump() << "\n";
      } else {
        out << WatchProgress::Format(line) << "\n";
      }
      out.flush();
      if (line.final) return line.state == "aborted" ? kCtlVersionAborted : kCtlOk;
    } else if (*version > 0 && !model.empty() && !HasModel(status, model)) {
      err << "wbctl watch: no model '" << model << "'\n";
      return kCtlNotFound;
    } else if (!waiting_reported && !json) {
      out << "waiting for a version to start" << (model.empty() ? "" : " of ") << model << "...\n";
      out.flush();
      waiting_reported = true;
    }
    return std::nullopt;
  };
  auto timed_out = [&] {
    err << "wbctl watch: timed out after " << absl::FormatDuration(*timeout)
        << (followed ? absl::StrCat(" watching v", followed) : std::string(" with no version running"))
        << "\n";
    return kCtlWatchTimeout;
  };

  // A coordinator (or standalone daemon) pushes every status change (WatchStatus).
  std::optional<int> code;
  bool got_any = false;
  absl::Status s = (*client)->WatchStatus(deadline, [&](const weightbridge::v1::StatusResponse& status) {
    got_any = true;
    code = handle(status);
    return !code.has_value();
  });
  if (code.has_value()) return *code;
  if (s.ok()) return timed_out();
  if (got_any || s.code() != absl::StatusCode::kUnimplemented) {
    err << "wbctl watch: " << s << "\n";
    return kCtlRpcFailed;
  }
  // A node daemon or a worker socket has no push API: read its status every --interval.
  while (true) {
    auto status = (*client)->FetchStatus(rpc_timeout);
    if (!status.ok()) {
      err << "wbctl watch: " << status.status() << "\n";
      return kCtlRpcFailed;
    }
    if (auto c = handle(*status); c.has_value()) return *c;
    if (absl::Now() + *interval > deadline) return timed_out();
    absl::SleepFor(*interval);  // the fallback's refresh period (no push from this daemon)
  }
}

}  // namespace wb::client
