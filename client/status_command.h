#pragma once
// `wbctl status` and `wbctl versions`.
//
//   wbctl status   --addr ADDR [--json] [--timeout 10s]
//   wbctl versions --addr ADDR --model ID [--json] [--timeout 10s]
//
// ADDR: a coordinator / node / standalone daemon "host:port", or a worker socket "unix:PATH".
// Exit codes (client/ctl_client.h): 0 ok, 1 RPC failed or daemon unavailable, 2 usage,
// 6 unknown model (versions).

#include <ostream>
#include <string>
#include <vector>

namespace wb::client {

int RunStatusCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
int RunVersionsCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace wb::client
