#include "daemon/fd_limit.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wb::daemon {

absl::StatusOr<FdLimit> RaiseFdLimit(rlim_t cap) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  FdLimit out{rl.rlim_cur, rl.rlim_cur};
  const rlim_t target = rl.rlim_max == RLIM_INFINITY ? cap : std::min(rl.rlim_max, cap);
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= target) return out;
  rl.rlim_cur = target;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return absl::InternalError(absl::StrCat("setrlimit(RLIMIT_NOFILE, ", target, "): ", std::strerror(errno)));
  }
  out.now = target;
  return out;
}

}  // namespace wb::daemon
