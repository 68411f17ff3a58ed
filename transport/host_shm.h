#pragma once
// Moved to transport/host_shm/host_shm.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/host_shm/host_shm.h"  // IWYU pragma: export
