#include "base/socket_path.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace wb {

absl::Status ClearStaleSocket(const std::string& path, int type, absl::string_view what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(what, " path ", path, ": cannot stat it: ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " path ", path, " exists and is not a socket; not removing it (pick another path)"));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " path ", path, " is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat(what, ": socket: ", std::strerror(errno)));
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = rc == 0 ? 0 : errno;
  ::close(fd);
  // ECONNREFUSED: nobody listens (the owner died or closed it).
  if (err == ECONNREFUSED) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return absl::FailedPreconditionError(absl::StrCat(what, " path ", path, ": cannot remove the stale socket: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }
  if (err == 0 || err == EAGAIN || err == EINPROGRESS) {
    return absl::FailedPreconditionError(absl::StrCat(what, " path ", path,
                                                      " is in use: a process (another daemon?) accepts connections there; stop it or "
                                                      "pick another path"));
  }
  return absl::FailedPreconditionError(absl::StrCat(what, " path ", path, ": cannot tell whether a process still listens there: ",
                                                    std::strerror(err)));
}

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
