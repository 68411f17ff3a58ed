#pragma once
// `wbctl watch`: live progress of the running version (bytes done / total, rate, ETA).
//
//   wbctl watch --addr ADDR [--model ID] [--version V] [--timeout 300s] [--interval 0.5s] [--json]
//
// Follows version V of the model (or, without --version, the newest running version; if none
// runs yet, the next one to start). Against a coordinator (or standalone daemon) it follows the
// status push (CoordinatorService.WatchStatus): a line per change, at most one per --interval
// (the final line at once). Against a node daemon or worker socket, which have no push API, it
// reads the status every --interval. --model is sent as StatusRequest's filter (the status of that
// model alone, narrowed before the coordinator's byte budget); a model the coordinator does not
// know yet is waited for on the whole status (with --version: exit 6). --json: one JSON object per
// line. Exits when the version reaches a final state or --timeout passes.
// Exit codes: 0 committed (or applied / superseded by a newer version), 4 aborted,
// 5 --timeout first, 1 RPC failed, 2 usage, 6 --version given but unknown to the daemon.

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/status_view.h"
#include "proto/weightbridge.pb.h"

namespace wb::client {

// The watch's printing, one status sample at a time (pure apart from the streams; tested in
// ctl_test). A status the coordinator trimmed to its byte budget (StatusResponse.trimmed) prints
// TrimmedLine once in text, and every --json line carries it as "status_trimmed".
class WatchFollower {
 public:
  WatchFollower(std::string model, uint64_t version, bool json, absl::Duration interval, std::ostream& out,
                std::ostream& err);
  // Prints what changed in `status` (taken at `now`); the exit code once the watch is over.
  std::optional<int> Handle(const weightbridge::v1::StatusResponse& status, absl::Time now);
  uint64_t followed() const { return followed_; }  // 0 until a version is found
  // The StatusRequest filter the statuses were asked with (TrimmedLine's pointers depend on it).
  void SetFilter(const weightbridge::v1::StatusRequest& filter) { filter_ = filter; }

 private:
  const std::string model_;
  const uint64_t version_;
  uint64_t followed_;
  std::string followed_model_;
  const bool json_;
  const absl::Duration interval_;
  std::ostream& out_;
  std::ostream& err_;
  WatchProgress progress_;
  weightbridge::v1::StatusRequest filter_;
  bool waiting_reported_ = false, trimmed_reported_ = false;
  absl::Time last_line_ = absl::InfinitePast();
};

int RunWatchCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
