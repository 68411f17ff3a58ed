#pragma once
// Helpers shared by the node's small state files in --live_state_dir (live_markers.cc,
// publish_record.cc): one file name hash and one errno message, so both name files and report
// failures the same way.

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace wb::daemon::state_files {

// FNV-1a of `s` as 16 hex digits: stable across builds and restarts (the next process must find
// the same file names again), unlike std::hash.
inline std::string StableHex(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

// "<what> <path>: <strerror(errno)>"; call right after the failing system call.
inline std::string ErrnoMessage(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

}  // namespace wb::daemon::state_files
