#pragma once
// Waiting for a file to appear, without sleep-polling: inotify on the parent directory, bounded by
// a deadline. Used for daemon port files and test gates.

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wb::e2e {

// Returns the file's contents once `path` exists and is non-empty (a writer that creates the file
// and then writes it is seen after the write). DEADLINE_EXCEEDED naming the path when the
// deadline passes first. The parent directory must exist.
absl::StatusOr<std::string> WaitForFile(const std::string& path, absl::Time deadline);

}  // namespace wb::e2e
