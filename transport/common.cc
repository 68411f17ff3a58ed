#include "transport/common.h"

#include <unistd.h>

#include <fstream>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"

namespace wb::transport {

std::string RandomInstanceId() {
  std::random_device rd;
  uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  return absl::StrFormat("%016x", v);
}

std::string DefaultNodeId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return std::string(absl::StripAsciiWhitespace(id));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace wb::transport
