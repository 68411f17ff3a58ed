#pragma once
// The daemon's open-file limit. A node daemon holds many descriptors: a mapped shared-memory
// segment or an imported CUDA VMM allocation fd per worker buffer / allocation (PyTorch's
// expandable segments use one allocation per 20 MiB page, so a GPU full of weights is thousands),
// data-channel sockets, gRPC. The default soft limit (often 1024) would make a large trainer fail
// half-way through registration; raising the soft limit to the hard one costs nothing.

#include <sys/resource.h>

#include "absl/status/statusor.h"

namespace wb::daemon {

struct FdLimit {
  rlim_t before = 0;  // soft limit found
  rlim_t now = 0;     // soft limit after raising (= the hard limit, or `before` when it was there)
};

// Raises RLIMIT_NOFILE's soft limit to its hard limit (capped at `cap`, since an unlimited hard
// limit would make some libraries allocate per-fd tables). Errors only when getrlimit/setrlimit fail.
absl::StatusOr<FdLimit> RaiseFdLimit(rlim_t cap = 1 << 20);

}  // namespace wb::daemon
