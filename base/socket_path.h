#pragma once
// The file a Unix socket was bound to, so that its owner removes it at exit only while the path
// still names that file. A daemon stopping while a new one (a restart into the same directory, a
// rolling update with both pods up for a moment) has already bound the path must not delete the
// new daemon's socket: its workers could no longer connect.

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace wb {

// Makes `path` free for a bind of a Unix socket of `type` (SOCK_STREAM, SOCK_SEQPACKET): a socket
// file nobody accepts connections on any more (a killed daemon's) is removed; a socket some
// process still listens on is refused (FAILED_PRECONDITION naming `what` and the path: a second
// daemon must not take a live daemon's workers away from it), and so is a path that is not a
// socket (it is someone's file, not ours to delete). Nothing at `path`: OK. The probe is a
// non-blocking connect, so it never waits (a listener with a full backlog counts as live).
absl::Status ClearStaleSocket(const std::string& path, int type, absl::string_view what);

class BoundSocketPath {
 public:
  BoundSocketPath() = default;
  // Records the file at `path` now (call right after bind). Not recorded when it cannot be stat'ed.
  static BoundSocketPath Note(const std::string& path);
  // Unlinks the path when it still names the recorded file (same device and inode); true when it
  // did. Nothing when nothing was recorded, the path is gone, or it names another file now.
  bool UnlinkIfStillOurs() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool known_ = false;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

}  // namespace wb
