#pragma once
// Moved to transport/testing/conformance.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/testing/conformance.h"  // IWYU pragma: export
