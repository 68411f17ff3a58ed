#pragma once
// TEST ONLY: certificates for TLS tests, issued the way docs/security.md says to issue them.

#include <map>
#include <string>
#include <vector>

namespace wb {

// Empties `dir` and writes into it a CA (ca.key, ca.pem; CN `ca_name`) and per identity in
// `names` <name>.key and <name>.pem signed by it (CN = the name, SAN DNS:<name> plus 127.0.0.1 /
// localhost so every daemon can also serve, serverAuth + clientAuth), valid one day; then each
// entry of `files` (file name -> contents, e.g. token files). Runs openssl(1). Returns "" on
// success, else what failed.
std::string MakeTestCerts(const std::string& dir, const std::vector<std::string>& names, const std::string& ca_name,
                          const std::map<std::string, std::string>& files = {});

}  // namespace wb
