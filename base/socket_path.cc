#include "base/socket_path.h"

#include <sys/stat.h>
#include <unistd.h>

namespace wb {

BoundSocketPath BoundSocketPath::Note(const std::string& path) {
  BoundSocketPath b;
  b.path_ = path;
  struct stat st {};
  if (!path.empty() && ::lstat(path.c_str(), &st) == 0) {
    b.known_ = true;
    b.dev_ = st.st_dev;
    b.ino_ = st.st_ino;
  }
  return b;
}

bool BoundSocketPath::UnlinkIfStillOurs() const {
  if (!known_) return false;
  struct stat st {};
  if (::lstat(path_.c_str(), &st) != 0 || st.st_dev != dev_ || st.st_ino != ino_) return false;
  return ::unlink(path_.c_str()) == 0;
}

}  // namespace wb
