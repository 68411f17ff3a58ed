#pragma once
// The data-plane NICs of a node (host_tcp multi-NIC striping): a comma-separated list of IPv4
// addresses or interface names, e.g. "10.0.0.5,10.0.1.5" or "eth2,eth3". Interface names let one
// config serve every node of a cluster (each node's addresses differ, its NIC names usually do
// not); they are resolved to the interface's first IPv4 address with getifaddrs.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

// Pure: "10.0.0.5, eth3" -> {"10.0.0.5", "eth3"}. Empty text = empty list (single-address mode).
// INVALID_ARGUMENT for an empty item or an item listed twice.
absl::StatusOr<std::vector<std::string>> ParseNicList(absl::string_view text);

// True if `s` is a dotted-quad IPv4 address (inet_pton).
bool IsIpv4Literal(absl::string_view s);

// An IPv4 literal is returned as is; anything else is looked up as an interface name (getifaddrs)
// and its first IPv4 address returned. NOT_FOUND naming the interface (and the interfaces that do
// have IPv4 addresses) when there is no such interface or it has no IPv4 address.
absl::StatusOr<std::string> ResolveNic(absl::string_view nic);

}  // namespace wb::transport
