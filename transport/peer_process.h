#pragma once
// Moved to transport/testing/peer_process.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/testing/peer_process.h"  // IWYU pragma: export
