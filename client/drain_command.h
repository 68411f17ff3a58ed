#pragma once
// `wbctl drain`: finish in-flight versions, refuse new ones, report drained.
//
//   wbctl drain --addr ADDR [--node ID] [--timeout 60s] [--json]
//
// Against the coordinator: --node drains that node, no --node drains the whole cluster. Against a
// node daemon: drains that node. Exit codes: 0 drained, 3 not drained before --timeout (versions
// still in flight; new ones are refused from now on either way), 1 RPC failed (e.g. unknown node),
// 2 usage.

#include <ostream>
#include <string>
#include <vector>

namespace wb::client {

int RunDrainCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
