#include "transport/host_tcp/nic_list.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace wb::transport {

absl::StatusOr<std::vector<std::string>> ParseNicList(absl::string_view text) {
  std::vector<std::string> out;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return out;
  std::set<std::string> seen;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    std::string item(absl::StripAsciiWhitespace(raw));
    if (item.empty()) return absl::InvalidArgumentError(absl::StrCat("NIC list '", text, "' has an empty item"));
    if (!seen.insert(item).second) {
      return absl::InvalidArgumentError(absl::StrCat("NIC list '", text, "' names ", item, " twice"));
    }
    out.push_back(std::move(item));
  }
  return out;
}

bool IsIpv4Literal(absl::string_view s) {
  in_addr a;
  return inet_pton(AF_INET, std::string(s).c_str(), &a) == 1;
}

absl::StatusOr<std::string> ResolveNic(absl::string_view nic) {
  if (IsIpv4Literal(nic)) return std::string(nic);
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  std::string found;
  std::set<std::string> with_ipv4;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    with_ipv4.insert(i->ifa_name);
    if (found.empty() && nic == i->ifa_name) {
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
      found = buf;
    }
  }
  freeifaddrs(list);
  if (found.empty()) {
    return absl::NotFoundError(absl::StrCat("NIC '", nic, "' is neither an IPv4 address nor an interface with an IPv4 ",
                                            "address (interfaces with IPv4: ", absl::StrJoin(with_ipv4, ", "), ")"));
  }
  return found;
}

}  // namespace wb::transport
