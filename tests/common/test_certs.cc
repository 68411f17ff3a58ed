#include "tests/common/test_certs.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace wb {

std::string MakeTestCerts(const std::string& dir, const std::vector<std::string>& names, const std::string& ca_name,
                          const std::map<std::string, std::string>& files) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  std::string script = absl::StrCat("set -e; rm -rf ", dir, "; mkdir -p ", dir, "; cd ", dir, "; ", "openssl req -x509 ", ec,
                                    " -keyout ca.key -out ca.pem -days 1 -subj /CN=", ca_name, "; ");
  for (const std::string& n : names) {
    absl::StrAppend(&script, "openssl req ", ec, " -keyout ", n, ".key -out ", n, ".csr -subj /CN=", n, "; ",
                    "printf 'subjectAltName=DNS:", n, ",IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ", n,
                    ".cnf; ", "openssl x509 -req -in ", n, ".csr -CA ca.pem -CAkey ca.key -CAcreateserial -out ", n,
                    ".pem -days 1 -extfile ", n, ".cnf; ");
  }
  if (std::system(absl::StrCat("(", script, ") >/dev/null 2>&1").c_str()) != 0) return "openssl failed";
  for (const auto& [name, contents] : files) {
    std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
    out << contents;
    if (!out.good()) return absl::StrCat("writing ", dir, "/", name, " failed");
  }
  return "";
}

}  // namespace wb
