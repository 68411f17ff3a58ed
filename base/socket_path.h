#pragma once
// The file a Unix socket was bound to, so that its owner removes it at exit only while the path
// still names that file. A daemon stopping while a new one (a restart into the same directory, a
// rolling update with both pods up for a moment) has already bound the path must not delete the
// new daemon's socket: its workers could no longer connect.

#include <sys/types.h>

#include <string>

namespace wb {

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
