#pragma once
// `wbctl status` and `wbctl versions`.
//
//   wbctl status   --addr ADDR [--model ID] [--node ID] [--json] [--timeout 10s]
//   wbctl versions --addr ADDR --model ID [--json] [--timeout 10s]
//
// ADDR: a coordinator / node / standalone daemon "host:port", or a worker socket "unix:PATH".
// --model / --node (and versions' --model) are sent as StatusRequest's filter: the coordinator
// narrows the status to that model (its workers and versions; every node still listed) or node
// before its status byte budget, so they are whole unless they alone pass it.
// Exit codes (client/ctl_client.h): 0 ok, 1 RPC failed or daemon unavailable, 2 usage,
// 6 unknown model (versions; status with --model) or node (status with --node).

#include <ostream>
#include <string>
#include <vector>

namespace wb::client {

int RunStatusCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
int RunVersionsCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
