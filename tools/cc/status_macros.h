#pragma once
// Moved to base/status_macros.h (issue 14.5); this forwarder goes away at the end of the session.
#include "base/status_macros.h"  // IWYU pragma: export
