#include "tests/e2e/file_wait.h"

#include <errno.h>
#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wb::e2e {
namespace {

bool ReadNonEmpty(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return !out->empty();
}

}  // namespace

absl::StatusOr<std::string> WaitForFile(const std::string& path, absl::Time deadline) {
  std::string dir = ".";
  size_t slash = path.rfind('/');
  if (slash != std::string::npos) dir = slash == 0 ? "/" : path.substr(0, slash);
  int fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (fd < 0) return absl::InternalError(absl::StrCat("inotify_init1: ", std::strerror(errno)));
  // Watch before the first check so a file created in between is not missed.
  if (inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_CLOSE_WRITE | IN_MOVED_TO | IN_MODIFY) < 0) {
    int err = errno;
    close(fd);
    return absl::NotFoundError(absl::StrCat("cannot watch ", dir, ": ", std::strerror(err)));
  }
  std::string content;
  absl::Status result = absl::OkStatus();
  while (!ReadNonEmpty(path, &content)) {
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      result = absl::DeadlineExceededError(absl::StrCat("timed out waiting for ", path));
      break;
    }
    pollfd pfd{fd, POLLIN, 0};
    int64_t ms = absl::ToInt64Milliseconds(left) + 1;
    int n = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (n < 0 && errno != EINTR) {
      result = absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
      break;
    }
    char buf[4096];
    while (read(fd, buf, sizeof(buf)) > 0) {
    }  // drain events; the loop condition re-checks the file
  }
  close(fd);
  if (!result.ok()) return result;
  return content;
}

}  // namespace wb::e2e
