#include "daemon/log.h"

#include <unistd.h>

#include <atomic>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wb::daemon {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "info";
}

void AppendValue(std::string* out, absl::string_view v) {
  bool quote = v.empty();
  for (char c : v) quote |= c == ' ' || c == '"' || c == '=' || c == '\n' || c == '\t';
  if (!quote) {
    out->append(v.data(), v.size());
    return;
  }
  out->push_back('"');
  for (char c : v) {
    if (c == '"' || c == '\\') out->push_back('\\');
    out->push_back(c == '\n' ? ' ' : c);
  }
  out->push_back('"');
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(absl::StrCat("--log_level must be debug, info, warning or error, got '", name, "'"));
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed); }

std::string FormatLogLine(LogLevel level, absl::string_view msg, std::initializer_list<LogField> fields) {
  std::string line = absl::StrCat("level=", LevelName(level), " msg=");
  AppendValue(&line, msg);
  for (const LogField& f : fields) {
    absl::StrAppend(&line, " ", f.key, "=");
    AppendValue(&line, f.value);
  }
  return line;
}

void Log(LogLevel level, absl::string_view msg, std::initializer_list<LogField> fields) {
  if (!LogEnabled(level)) return;
  std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                                  FormatLogLine(level, msg, fields), "\n");
  // One write per line so concurrent lines never interleave.
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace wb::daemon
