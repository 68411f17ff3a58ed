// TEST ONLY: the remote endpoint of the transport conformance suite. A separate process with its
// own Transport and its own buffer, driven over stdin/stdout (protocol in peer_process.h), so tests
// cross real process boundaries and can kill -9 it mid-transfer.
//
// Usage: transport_peer --kind=host_tcp --memory=host|cuda --size=N --seed=S [--node_id=X]
//                       [--device=D] [--corrupt]

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "transport/factory.h"
#include "transport/testing/peer_interpreter.h"
#include "transport/testing/test_buffer.h"

namespace wb::transport {
namespace {

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    size_t eq = a.find('=');
    flags[a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2)] =
        eq == std::string::npos ? "1" : a.substr(eq + 1);
  }
  TransportConfig config;
  config.node_id = flags["node_id"];
  config.test_corrupt_checksummed_payload = flags.count("corrupt") > 0;
  if (flags.count("device")) (void)absl::SimpleAtoi(flags["device"], &config.nccl.device);
  int64_t size = 0;
  uint64_t seed = 0;
  int device = config.nccl.device;
  (void)absl::SimpleAtoi(flags["size"], &size);
  (void)absl::SimpleAtoi(flags["seed"], &seed);
  auto buffer = MakeTestBuffer(flags["memory"] == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost, size, device,
                               absl::StrCat("peer buffer (pid ", getpid(), ")"));
  auto transport = CreateTransport(flags["kind"], config);
  if (!transport.ok()) {
    std::cout << ErrLine(transport.status()) << std::endl;
    return 2;
  }
  if (!buffer.ok() || !(*buffer)->Fill(seed).ok()) {
    std::cout << ErrLine(buffer.ok() ? absl::InternalError("fill failed") : buffer.status()) << std::endl;
    return 2;
  }
  // The interpreter destroys the transport before the buffer (see PeerInterpreter::Create).
  auto peer = PeerInterpreter::Create(std::move(*buffer), std::move(*transport));
  if (!peer.ok()) {
    std::cout << ErrLine(peer.status()) << std::endl;
    return 2;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    bool quit = false;
    std::string reply = (*peer)->Execute(line, &quit);
    if (quit) break;
    std::cout << reply << std::endl;
  }
  return 0;
}

}  // namespace
}  // namespace wb::transport

int main(int argc, char** argv) { return wb::transport::Main(argc, argv); }
