#pragma once
// Moved to base/fd_passing.h (issue 14.5); this forwarder goes away at the end of the session.
#include "base/fd_passing.h"  // IWYU pragma: export
