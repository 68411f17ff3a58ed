#pragma once
// Minimal leveled, structured logging for the daemon: one line per event on stderr,
//   2026-01-02T03:04:05.678Z level=info msg="version committed" model=qwen version=3 bytes=123
// Fields are key=value; values with spaces or quotes are quoted. The level is process-wide
// (--log_level); lines below it cost one atomic load. Thread-safe (one write(2) per line).

#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace wb::daemon {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// "debug" | "info" | "warning" | "error"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// One structured field. Anything absl::StrCat accepts is a value.
struct LogField {
  LogField(absl::string_view k, const absl::AlphaNum& v) : key(k), value(v.Piece()) {}
  absl::string_view key;
  std::string value;
};

void Log(LogLevel level, absl::string_view msg, std::initializer_list<LogField> fields = {});

// Formats one line (without the timestamp) - exposed for tests.
std::string FormatLogLine(LogLevel level, absl::string_view msg, std::initializer_list<LogField> fields);

}  // namespace wb::daemon
