#pragma once
// Moved to transport/testing/test_buffer.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/testing/test_buffer.h"  // IWYU pragma: export
