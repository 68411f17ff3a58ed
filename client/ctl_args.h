#pragma once
// Flag parsing for wbctl subcommands: "--name=value", "--name value" and boolean "--name".
// Unknown flags and stray positional arguments are INVALID_ARGUMENT (wbctl exits 2 on them).

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wb::client {

struct CtlFlagSpec {
  std::set<std::string> valued;   // flags that take a value
  std::set<std::string> boolean;  // flags that take none
};

class CtlArgs {
 public:
  static absl::StatusOr<CtlArgs> Parse(const std::vector<std::string>& args,
                                       const CtlFlagSpec& spec);
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  // Durations accept absl syntax ("30s", "500ms", "2m") or a bare number of seconds.
  absl::StatusOr<absl::Duration> GetDuration(const std::string& name, absl::Duration fallback) const;
  absl::StatusOr<uint64_t> GetUint(const std::string& name, uint64_t fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace wb::client
