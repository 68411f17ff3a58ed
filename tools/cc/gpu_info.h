#pragma once
// Moved to transport/gpu_info.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/gpu_info.h"  // IWYU pragma: export
