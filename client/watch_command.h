#pragma once
// `wbctl watch`: live progress of the running version (bytes done / total, rate, ETA).
//
//   wbctl watch --addr ADDR [--model ID] [--version V] [--timeout 300s] [--interval 0.5s] [--json]
//
// Follows version V of the model (or, without --version, the newest running version; if none
// runs yet, the next one to start). Against a coordinator (or standalone daemon) it follows the
// status push (CoordinatorService.WatchStatus): a line per change, at most one per --interval
// (the final line at once). Against a node daemon or worker socket, which have no push API, it
// reads the status every --interval. --json: one JSON object per line. Exits when the version
// reaches a final state or --timeout passes.
// Exit codes: 0 committed (or applied / superseded by a newer version), 4 aborted,
// 5 --timeout first, 1 RPC failed, 2 usage, 6 --version given but unknown to the daemon.

#include <ostream>
#include <string>
#include <vector>

namespace wb::client {

int RunWatchCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
