#include "client/ctl_args.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace wb::client {

absl::StatusOr<CtlArgs> CtlArgs::Parse(const std::vector<std::string>& args,
                                       const CtlFlagSpec& spec) {
  CtlArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!absl::StartsWith(a, "--") || a.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (spec.boolean.count(name)) {
      if (has_value && value != "true" && value != "false") {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
      if (!has_value || value == "true") out.values_[name] = "true";
      continue;
    }
    if (!spec.valued.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (!has_value) {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      value = args[++i];
    }
    out.values_[name] = value;
  }
  return out;
}

std::string CtlArgs::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

absl::StatusOr<absl::Duration> CtlArgs::GetDuration(const std::string& name,
                                                    absl::Duration fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  absl::Duration d;
  double seconds = 0;
  if (absl::SimpleAtod(it->second, &seconds)) {
    d = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(it->second, &d)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " '", it->second, "' is not a duration (e.g. 30s, 500ms)"));
  }
  if (d <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be positive"));
  }
  return d;
}

absl::StatusOr<uint64_t> CtlArgs::GetUint(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " '", it->second, "' is not a number"));
  }
  return v;
}

}  // namespace wb::client
