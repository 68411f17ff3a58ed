#pragma once
// Moved to base/wire.h (issue 14.5); this forwarder goes away at the end of the session.
#include "base/wire.h"  // IWYU pragma: export
