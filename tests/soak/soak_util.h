#pragma once
// Small helpers the soak tests share: fields of a worker's JSON progress line (absent or of
// another type: 0 / empty) and numeric settings from the environment (WB_SOAK_*, WB_CHAOS_*).

#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "nlohmann/json.hpp"

namespace wb::e2e {

inline uint64_t U64(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_number_unsigned() ? e[key].get<uint64_t>() : 0;
}
inline std::string Str(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_string() ? e[key].get<std::string>() : "";
}
// The environment variable `name` as an unsigned integer, `def` when unset or not a number.
inline uint64_t EnvOr(const char* name, uint64_t def) {
  const char* v = std::getenv(name);
  uint64_t out = 0;
  if (v != nullptr && absl::SimpleAtoi(v, &out)) return out;
  return def;
}
// The environment variable `name`, `def` when unset or empty.
inline std::string EnvStrOr(const char* name, const std::string& def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : def;
}

}  // namespace wb::e2e
