#pragma once
// Moved to base/shm_segment.h (issue 14.5); this forwarder goes away at the end of the session.
#include "base/shm_segment.h"  // IWYU pragma: export
