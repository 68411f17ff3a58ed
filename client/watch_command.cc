#include "client/watch_command.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/ctl_args.h"
#include "client/ctl_client.h"
#include "client/status_view.h"

namespace wb::client {

WatchFollower::WatchFollower(std::string model, uint64_t version, bool json, absl::Duration interval, std::ostream& out,
                             std::ostream& err)
    : model_(std::move(model)), version_(version), followed_(version), json_(json), interval_(interval), out_(out), err_(err) {}

std::optional<int> WatchFollower::Handle(const weightbridge::v1::StatusResponse& status, absl::Time now) {
  // A status cut to the coordinator's byte budget (older finished version records may be left
  // out, so a --version long finished may not be found): said once in text, on every line in JSON.
  if (!json_ && !trimmed_reported_ && status.has_trimmed()) {
    out_ << TrimmedLine(status, filter_);
    out_.flush();
    trimmed_reported_ = true;
  }
  auto v = PickWatched(status, followed_model_.empty() ? model_ : followed_model_, followed_);
  if (v.has_value()) {
    // Stick to the first version found, even after it turns final.
    followed_ = v->version();
    followed_model_ = v->model_id();
    WatchProgress next = progress_;
    WatchProgress::Line line = next.Update(*v, now);
    // --interval: at most one progress line per interval (pushes can come faster, e.g. per
    // node heartbeat while bytes move); the first and the final line are printed at once.
    if (!line.final && now - last_line_ < interval_) return std::nullopt;
    progress_ = next;
    last_line_ = now;
    if (json_) {
      nlohmann::json j = WatchProgress::ToJson(line);
      if (status.has_trimmed()) j["status_trimmed"] = TrimmedJson(status);
      out_ << j.dump() << "\n";
    } else {
      out_ << WatchProgress::Format(line) << "\n";
    }
    out_.flush();
    if (line.final) return line.state == "aborted" ? kCtlVersionAborted : kCtlOk;
  } else if (version_ > 0 && !model_.empty() && !HasModel(status, model_)) {
    err_ << "wbctl watch: no model '" << model_ << "'\n";
    return kCtlNotFound;
  } else if (!waiting_reported_ && !json_) {
    out_ << "waiting for a version to start" << (model_.empty() ? "" : " of ") << model_ << "...\n";
    out_.flush();
    waiting_reported_ = true;
  }
  return std::nullopt;
}

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
  WatchFollower follower(model, *version, json, *interval, out, err);
  auto handle = [&](const weightbridge::v1::StatusResponse& status) { return follower.Handle(status, absl::Now()); };
  auto timed_out = [&] {
    err << "wbctl watch: timed out after " << absl::FormatDuration(*timeout)
        << (follower.followed() ? absl::StrCat(" watching v", follower.followed()) : std::string(" with no version running"))
        << "\n";
    return kCtlWatchTimeout;
  };

  // --model is sent as StatusRequest's filter: the coordinator narrows the status to that model
  // before its byte budget. A model it does not know (yet): with --version, exit 6; without, the
  // watch waits for the model's first version on the whole status (the model may be created later).
  weightbridge::v1::StatusRequest filter;
  filter.set_model_id(model);
  follower.SetFilter(filter);
  // NOT_FOUND for the filter's model: exit 6 with --version, else drop the filter (true).
  std::optional<int> refused;
  auto unknown_model = [&](const absl::Status& s) {
    if (!absl::IsNotFound(s) || filter.model_id().empty()) return false;
    if (*version > 0) {
      err << "wbctl watch: no model '" << model << "'\n";
      refused = kCtlNotFound;
    }
    filter.Clear();
    follower.SetFilter(filter);
    return true;
  };

  // A coordinator (or standalone daemon) pushes every status change (WatchStatus).
  std::optional<int> code;
  bool got_any = false;
  auto watch = [&] {
    return (*client)->WatchStatus(
        deadline,
        [&](const weightbridge::v1::StatusResponse& status) {
          got_any = true;
          code = handle(status);
          return !code.has_value();
        },
        filter);
  };
  absl::Status s = watch();
  if (!got_any && unknown_model(s)) {
    if (refused.has_value()) return *refused;
    s = watch();
  }
  if (code.has_value()) return *code;
  if (s.ok()) return timed_out();
  if (got_any || s.code() != absl::StatusCode::kUnimplemented) {
    err << "wbctl watch: " << s << "\n";
    return kCtlRpcFailed;
  }
  // A node daemon or a worker socket has no push API: read its status every --interval.
  while (true) {
    auto status = (*client)->FetchStatus(rpc_timeout, nullptr, filter);
    if (!status.ok() && unknown_model(status.status())) {
      if (refused.has_value()) return *refused;
      continue;  // unfiltered from now on
    }
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
