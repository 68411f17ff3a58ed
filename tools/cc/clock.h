#pragma once
// Moved to base/clock.h (issue 14.5); this forwarder goes away at the end of the session.
#include "base/clock.h"  // IWYU pragma: export
